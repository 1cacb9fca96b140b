//! The DNS budgets under attack, with real clients (dig) for the pods that behave: one source's
//! thousands of idle TCP connections and its flood of uncached names to a blackholed upstream
//! leave every other source served, mesh names at once and forwarded names as soon as an
//! upstream answers; what is turned away is counted, and nothing is reset. Sources are
//! loopback addresses: 127.0.0.2 behaves, 127.0.0.3 and 127.0.0.4 attack.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use common::{ScriptedUpstream, Server, dig, eventually};
use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, Record, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream, UdpSocket};

const MESH: &[(&str, &str)] = &[("web.shop.system.internal", "240.240.0.1")];
const GOOD: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
const BAD: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3));
const WORSE: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 4));

fn answer(query: &Message) -> Option<Message> {
    let mut reply = Message::response(query.metadata.id, OpCode::Query);
    reply.queries.clone_from(&query.queries);
    let name = query.queries.first()?.name().clone();
    reply.add_answer(Record::from_rdata(
        name,
        60,
        RData::A(A([192, 0, 2, 10].into())),
    ));
    Some(reply)
}

async fn connect_from(source: IpAddr, server: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(source, 0))?;
    socket.connect(server).await
}

fn framed_query(id: u16, name: &str) -> Vec<u8> {
    let mut message = Message::new(id, MessageType::Query, OpCode::Query);
    message.metadata.recursion_desired = true;
    message.add_query(Query::query(
        Name::from_ascii(format!("{name}.")).unwrap(),
        RecordType::A,
    ));
    let bytes = message.to_vec().unwrap();
    let mut framed = (bytes.len() as u16).to_be_bytes().to_vec();
    framed.extend_from_slice(&bytes);
    framed
}

/// dig from `source`: `(status, first answer)`.
async fn dig_from(server: SocketAddr, source: IpAddr, args: &[&str]) -> (String, String) {
    let source = source.to_string();
    let mut all = vec!["-b", source.as_str()];
    all.extend_from_slice(args);
    let d = dig(server, &all).await;
    let first = d
        .answers()
        .first()
        .and_then(|a| a.get(4))
        .map(|a| a.to_string());
    (d.status().to_string(), first.unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_sources_idle_connections_and_forward_flood_leave_the_others_served() {
    let blackhole = ScriptedUpstream::start(|_| None).await;
    let upstream = ScriptedUpstream::start(answer).await;
    let server = Server::start(MESH, |c| {
        c.upstreams = vec![blackhole.addr, upstream.addr];
        c.upstream_timeout = Duration::from_millis(1000);
    })
    .await;

    // 5000 TCP connections from one address, left idle: its budget's worth stay open, the
    // rest are refused (closed at once, without a reset: the client sent nothing).
    let mut idle = Vec::new();
    for _ in 0..5000 {
        idle.push(connect_from(BAD, server.addr).await.unwrap());
    }
    eventually(Duration::from_secs(10), || async {
        server.metric("lattice_dns_limited_total{reason=\"tcp_connections_per_source\"}")
            == 5000.0 - 64.0
    })
    .await;
    assert_eq!(
        server.metric("lattice_dns_tcp_connections "),
        64.0,
        "{}",
        server.metrics()
    );

    // Another address floods uncached names to an upstream that never answers, over UDP and
    // pipelined over TCP: over its budget it gets SERVFAIL at once.
    let flood = UdpSocket::bind(SocketAddr::new(WORSE, 0)).await.unwrap();
    for k in 0..2000u16 {
        let bytes = &framed_query(k, &format!("flood{k}.example.test"))[2..];
        flood.send_to(bytes, server.addr).await.unwrap();
    }
    let mut pipelined = connect_from(WORSE, server.addr).await.unwrap();
    let mut burst = Vec::new();
    for k in 0..300u16 {
        burst.extend(framed_query(k, &format!("pipelined{k}.example.test")));
    }
    pipelined.write_all(&burst).await.unwrap();
    eventually(Duration::from_secs(5), || async {
        server.metric("lattice_dns_limited_total{reason=\"forwards_per_source\"}") > 0.0
    })
    .await;

    // Meanwhile the well-behaved source is served: mesh names at once, over UDP and TCP; a
    // forwarded name once the second upstream answers (the first never does).
    for _ in 0..20 {
        for transport in ["+notcp", "+tcp"] {
            let (status, address) =
                dig_from(server.addr, GOOD, &[transport, "web.shop.system.internal"]).await;
            assert_eq!(
                (status.as_str(), address.as_str()),
                ("NOERROR", "240.240.0.1")
            );
        }
    }
    for transport in ["+notcp", "+tcp"] {
        let (status, address) = dig_from(server.addr, GOOD, &[transport, "www.example.test"]).await;
        assert_eq!(
            (status.as_str(), address.as_str()),
            ("NOERROR", "192.0.2.10"),
            "{transport}"
        );
    }

    // Every pipelined query gets its answer on the connection (SERVFAIL over budget or from
    // the blackhole's timeout, an address otherwise): not one reset.
    let mut answered = 0;
    while answered < 300 {
        let len = tokio::time::timeout(Duration::from_secs(10), pipelined.read_u16())
            .await
            .expect("answers keep coming")
            .expect("no reset");
        let mut reply = vec![0; usize::from(len)];
        pipelined.read_exact(&mut reply).await.unwrap();
        let reply = Message::from_vec(&reply).unwrap();
        assert!(
            matches!(
                reply.metadata.response_code,
                ResponseCode::ServFail | ResponseCode::NoError
            ),
            "{reply:?}"
        );
        answered += 1;
    }
    assert!(server.metric("lattice_dns_limited_total{reason=\"forwards_per_source\"}") >= 300.0);
    assert_eq!(
        server.metric("lattice_dns_limited_total{reason=\"forwards\"}"),
        0.0
    );
    drop(idle);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_total_a_new_connection_takes_the_oldest_idle_ones_slot() {
    let server = Server::start(MESH, |c| {
        c.tcp_connections = 4;
        c.tcp_connections_per_source = 2;
    })
    .await;
    let mut held = Vec::new();
    for source in [BAD, WORSE] {
        for _ in 0..2 {
            held.push(connect_from(source, server.addr).await.unwrap());
        }
    }
    eventually(Duration::from_secs(2), || async {
        server.metric("lattice_dns_tcp_connections ") == 4.0
    })
    .await;
    let (status, address) =
        dig_from(server.addr, GOOD, &["+tcp", "web.shop.system.internal"]).await;
    assert_eq!(
        (status.as_str(), address.as_str()),
        ("NOERROR", "240.240.0.1")
    );
    assert_eq!(
        server.metric("lattice_dns_limited_total{reason=\"tcp_idle_evicted\"}"),
        1.0,
        "{}",
        server.metrics()
    );
    // The connection that made room was closed with a FIN: one read ends cleanly.
    let mut closed = 0;
    for stream in &mut held {
        let mut byte = [0u8; 1];
        if let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(200), stream.read(&mut byte)).await
        {
            assert_eq!(n, 0, "a FIN, no data");
            closed += 1;
        }
    }
    assert_eq!(closed, 1);
    server.stop().await;
}

/// Reads framed answers until the server closes: their count, or the error that ended them.
async fn answers_until_closed(stream: &mut TcpStream) -> std::io::Result<usize> {
    let mut count = 0;
    loop {
        let len = match stream.read_u16().await {
            Ok(len) => len,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(count),
            Err(e) => return Err(e),
        };
        let mut reply = vec![0; usize::from(len)];
        stream.read_exact(&mut reply).await?;
        count += 1;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_close_when_idle_or_old_with_a_fin_and_pipelines_are_answered_whole() {
    let upstream = ScriptedUpstream::start(answer).await;
    let server = Server::start(MESH, |c| {
        c.upstreams = vec![upstream.addr];
        c.tcp_idle_timeout = Duration::from_millis(300);
        c.tcp_lifetime = Duration::from_secs(2);
        c.tcp_pipeline = 4;
    })
    .await;

    // Idle: closed with a FIN, counted.
    let mut idle = connect_from(GOOD, server.addr).await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(5), answers_until_closed(&mut idle))
        .await
        .expect("closed when idle");
    assert_eq!(ended.unwrap(), 0);
    assert_eq!(
        server.metric("lattice_dns_tcp_closed_total{reason=\"idle\"}"),
        1.0
    );

    // Forty queries in one write, mesh and forwarded, with four answered at a time: every one
    // answered, each by its id.
    let mut pipelined = connect_from(GOOD, server.addr).await.unwrap();
    let mut burst = Vec::new();
    for k in 0..40u16 {
        let name = if k % 2 == 0 {
            "web.shop.system.internal".to_string()
        } else {
            format!("n{k}.example.test")
        };
        burst.extend(framed_query(k, &name));
    }
    pipelined.write_all(&burst).await.unwrap();
    let mut ids = Vec::new();
    for _ in 0..40 {
        let len = pipelined.read_u16().await.unwrap();
        let mut reply = vec![0; usize::from(len)];
        pipelined.read_exact(&mut reply).await.unwrap();
        let reply = Message::from_vec(&reply).unwrap();
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
        ids.push(reply.metadata.id);
    }
    ids.sort_unstable();
    assert_eq!(ids, (0..40).collect::<Vec<u16>>());

    // Old: a connection that keeps asking is closed once its lifetime is up, after its answer.
    let mut busy = connect_from(GOOD, server.addr).await.unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        for k in 0u16.. {
            if busy
                .write_all(&framed_query(k, "web.shop.system.internal"))
                .await
                .is_err()
            {
                return k;
            }
            match busy.read_u16().await {
                Ok(len) => {
                    let mut reply = vec![0; usize::from(len)];
                    busy.read_exact(&mut reply).await.unwrap();
                }
                Err(e) => {
                    assert_eq!(
                        e.kind(),
                        std::io::ErrorKind::UnexpectedEof,
                        "a FIN, not a reset"
                    );
                    return k;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        unreachable!()
    })
    .await
    .expect("closed at its lifetime");
    assert!(closed >= 10, "open about its lifetime: {closed} queries");
    assert_eq!(
        server.metric("lattice_dns_tcp_closed_total{reason=\"lifetime\"}"),
        1.0
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_flooding_over_its_budget_is_sent_its_refusal_rate_and_no_more() {
    let blackhole = ScriptedUpstream::start(|_| None).await;
    let server = Server::start(MESH, |c| {
        c.upstreams = vec![blackhole.addr];
        c.upstream_timeout = Duration::from_secs(30);
        c.forwards_per_source = 4;
        c.refusals_per_source = 20;
    })
    .await;
    let flood = UdpSocket::bind(SocketAddr::new(WORSE, 0)).await.unwrap();
    let started = std::time::Instant::now();
    for k in 0..404u16 {
        let bytes = &framed_query(k, &format!("flood{k}.example.test"))[2..];
        flood.send_to(bytes, server.addr).await.unwrap();
    }
    let refused = || {
        server.metric("lattice_dns_limited_total{reason=\"forwards_per_source\"}")
            + server.metric("lattice_dns_limited_total{reason=\"forwards_per_source_unanswered\"}")
    };
    eventually(Duration::from_secs(10), || async { refused() == 400.0 }).await;
    let elapsed = started.elapsed().as_secs_f64();

    let answered = server.metric("lattice_dns_limited_total{reason=\"forwards_per_source\"}");
    // A second's worth at once, then 20 a second: not one per query.
    assert!(
        answered >= 20.0 && answered <= 20.0 + 20.0 * elapsed + 1.0,
        "{answered} SERVFAILs in {elapsed:.2} s"
    );
    // Each refusal answered is a SERVFAIL on the flooding socket: all of them arrive.
    let mut servfails = 0.0;
    let mut buf = [0u8; 512];
    while servfails < answered {
        let (len, _) = tokio::time::timeout(Duration::from_secs(5), flood.recv_from(&mut buf))
            .await
            .expect("every answered refusal arrives")
            .unwrap();
        let reply = Message::from_vec(&buf[..len]).unwrap();
        assert_eq!(reply.metadata.response_code, ResponseCode::ServFail);
        servfails += 1.0;
    }
    assert!(
        tokio::time::timeout(Duration::from_millis(200), flood.recv_from(&mut buf))
            .await
            .is_err(),
        "nothing more than the counted SERVFAILs"
    );

    // Another source is answered at once.
    let (status, address) =
        dig_from(server.addr, GOOD, &["+notcp", "web.shop.system.internal"]).await;
    assert_eq!(
        (status.as_str(), address.as_str()),
        ("NOERROR", "240.240.0.1")
    );
    // Not drained: a drain waits out the blackholed forwards, which outlive the test.
    drop(server);
}
