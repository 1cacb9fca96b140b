//! Handing a DNS address over to a successor: first the kernel behaviour the handoff rests on
//! (`lattice_dns::handoff`), checked on the running kernel; then two servers on one address,
//! the second taking over from the first without a query lost or a connection reset.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use common::{Server, dig, eventually, free_port, table};
use hickory_proto::op::{Message, MessageType, OpCode, Query};
use hickory_proto::rr::{Name, RData, RecordType};
use lattice_dns::NameTable;
use lattice_dns::handoff::{self, BoundTcp, BoundUdp};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};

const WEB: &str = "web.shop.system.internal";

/// Sends `count` datagrams, each from a socket of its own (so the kernel's hash spreads them),
/// carrying `tag` and their number.
async fn send_from_many(addr: SocketAddr, tag: u8, count: u8) {
    for k in 0..count {
        let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        client.send_to(&[tag, k], addr).await.unwrap();
    }
}

/// Every datagram queued on `socket` (read directly, whatever Tokio knows of its readiness),
/// as (tag, number).
fn queued(socket: UdpSocket) -> Vec<(u8, u8)> {
    let socket = socket.into_std().unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 16];
    while let Ok((len, _)) = socket.recv_from(&mut buf) {
        if len == 2 {
            got.push((buf[0], buf[1]));
        }
    }
    got
}

/// Port 0 means a port of its own, even where every port is held with SO_REUSEPORT by this very
/// user (the kernel's UDP port search would hand one of those out, and the server would share
/// its queries with a stranger). Run in a network namespace of this thread alone, with a
/// local port range of eight ports, so no other socket is touched; it goes when the thread ends.
#[test]
fn port_0_never_joins_another_sockets_reuseport_group() {
    std::thread::spawn(|| {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("a network namespace");
        let lo = std::process::Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .status()
            .unwrap();
        assert!(lo.success());
        std::fs::write("/proc/sys/net/ipv4/ip_local_port_range", "40000 40007").unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let at = |port| SocketAddr::from((Ipv4Addr::LOCALHOST, port));
            let any = at(0);
            let held: Vec<BoundUdp> = (40000..=40007)
                .map(|port| BoundUdp::bind(at(port), 1, 1 << 16).unwrap())
                .collect();
            assert!(
                BoundUdp::bind(any, 2, 1 << 16).is_err(),
                "every port of the range is held: none to be had"
            );
            assert!(BoundTcp::bind(any, &[0, 1]).is_err());
            drop(held);
            let held: Vec<BoundUdp> = (40000..=40007)
                .filter(|port| *port != 40005)
                .map(|port| BoundUdp::bind(at(port), 1, 1 << 16).unwrap())
                .collect();
            let bound = BoundUdp::bind(any, 2, 1 << 16).unwrap();
            assert_eq!(bound.local_addr(), at(40005), "the one free port");
            drop(held);
        });
    })
    .join()
    .unwrap();
}

#[tokio::test]
async fn a_connected_udp_socket_leaves_the_selection_and_keeps_its_queue() {
    let old = BoundUdp::bind("127.0.0.1:0".parse().unwrap(), 1, 1 << 20).unwrap();
    let addr = old.local_addr();
    let new = BoundUdp::bind(addr, 1, 1 << 20).unwrap();
    let (old, new) = (
        old.open(&[]).unwrap().remove(0),
        new.open(&[]).unwrap().remove(0),
    );
    // Loopback delivers a datagram within its send: once sent, it is queued.
    send_from_many(addr, 1, 100).await;
    handoff::leave_udp(&old).unwrap();
    send_from_many(addr, 2, 100).await;
    let (on_old, on_new) = (queued(old), queued(new));
    assert!(
        on_old.iter().all(|(tag, _)| *tag == 1),
        "nothing new reaches a connected socket: {on_old:?}"
    );
    assert!(!on_old.is_empty(), "what it held before stays readable");
    let mut all: Vec<_> = on_old.iter().chain(&on_new).copied().collect();
    all.sort_unstable();
    let expected: Vec<_> = (1..=2u8)
        .flat_map(|tag| (0..100u8).map(move |k| (tag, k)))
        .collect();
    assert_eq!(all, expected, "every datagram on one socket or the other");
}

/// Connections made to `addr`: how many each listener of `sets` accepted.
async fn spread(addr: SocketAddr, sets: &[&handoff::Listeners], connections: usize) -> Vec<usize> {
    let mut clients = Vec::new();
    for _ in 0..connections {
        clients.push(TcpStream::connect(addr).await.unwrap());
    }
    let mut counts = vec![0; sets.len()];
    let mut total = 0;
    while total < connections {
        for (k, listeners) in sets.iter().enumerate() {
            while let Some(accepted) = listeners.try_accept() {
                accepted.unwrap();
                counts[k] += 1;
                total += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    counts
}

#[tokio::test]
async fn steered_listeners_take_every_new_connection_and_a_bound_socket_none() {
    if handoff::kernel_steers() != Some(true) {
        eprintln!("skipped: this kernel does not steer SO_REUSEPORT by SO_INCOMING_CPU (< 6.1)");
        return;
    }
    let cpus = handoff::online_cpus();
    let old = BoundTcp::bind("127.0.0.1:0".parse().unwrap(), &[]).unwrap();
    let addr = old.local_addr();
    let old = old.listen().unwrap();
    let bound = BoundTcp::bind(addr, &cpus).unwrap();
    assert_eq!(
        spread(addr, &[&old], 20).await,
        [20],
        "a bound socket that does not listen gets nothing"
    );
    let new = bound.listen().unwrap();
    assert_eq!(
        spread(addr, &[&old, &new], 50).await,
        [0, 50],
        "steered listeners take every new connection"
    );
    // Two steered agents share; the one that leaves gets nothing more.
    let newer = BoundTcp::bind(addr, &cpus).unwrap().listen().unwrap();
    new.leave();
    assert_eq!(spread(addr, &[&old, &new, &newer], 50).await, [0, 0, 50]);
}

fn query(id: u16, name: &str) -> Vec<u8> {
    let mut message = Message::new(id, MessageType::Query, OpCode::Query);
    message.metadata.recursion_desired = true;
    message.add_query(Query::query(
        Name::from_ascii(format!("{name}.")).unwrap(),
        RecordType::A,
    ));
    message.to_vec().unwrap()
}

fn address_of(reply: &[u8]) -> Option<Ipv4Addr> {
    let reply = Message::from_vec(reply).ok()?;
    reply.answers.iter().find_map(|r| match &r.data {
        RData::A(a) => Some(a.0),
        _ => None,
    })
}

/// UDP queries from `clients` sockets, `rounds` each: the answers' addresses, counted; a query
/// without an answer counts under `None`.
async fn ask_udp(
    addr: SocketAddr,
    clients: usize,
    rounds: u16,
) -> HashMap<Option<Ipv4Addr>, usize> {
    let mut sockets = Vec::new();
    for _ in 0..clients {
        sockets.push(UdpSocket::bind("127.0.0.1:0").await.unwrap());
    }
    let mut counts = HashMap::new();
    for round in 0..rounds {
        for socket in &sockets {
            socket.send_to(&query(round, WEB), addr).await.unwrap();
        }
        for socket in &sockets {
            let mut buf = [0u8; 512];
            let got = tokio::time::timeout(Duration::from_secs(2), socket.recv(&mut buf))
                .await
                .ok()
                .and_then(|r| r.ok())
                .and_then(|n| address_of(&buf[..n]));
            *counts.entry(got).or_default() += 1;
        }
    }
    counts
}

async fn ask_tcp(stream: &mut TcpStream, id: u16) -> std::io::Result<Option<Ipv4Addr>> {
    let bytes = query(id, WEB);
    let mut framed = (bytes.len() as u16).to_be_bytes().to_vec();
    framed.extend_from_slice(&bytes);
    stream.write_all(&framed).await?;
    let len = stream.read_u16().await?;
    let mut reply = vec![0; usize::from(len)];
    stream.read_exact(&mut reply).await?;
    Ok(address_of(&reply))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_successor_takes_over_without_a_lost_query_or_a_reset() {
    let listen: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let (old_ip, new_ip) = (Ipv4Addr::new(240, 240, 0, 1), Ipv4Addr::new(240, 240, 0, 2));
    let old = Server::start_on(listen, table(&[(WEB, "240.240.0.1")]), |_| {}, None).await;
    eventually(Duration::from_secs(2), || async { old.is_open() }).await;
    let mut persistent = TcpStream::connect(listen).await.unwrap();
    assert_eq!(ask_tcp(&mut persistent, 1).await.unwrap(), Some(old_ip));

    // Beside it, the successor waits for its table: every answer is still the old server's.
    let new = Server::start_on(listen, Arc::new(NameTable::pending()), |_| {}, None).await;
    let before = ask_udp(listen, 16, 10).await;
    assert_eq!(before, HashMap::from([(Some(old_ip), 160)]), "{before:?}");
    assert!(!new.is_open());
    let d = dig(listen, &["+tcp", WEB]).await;
    assert!(d.text.contains("240.240.0.1"), "{}", d.text);

    new.names.send_replace(table(&[(WEB, "240.240.0.2")]));
    eventually(Duration::from_secs(5), || async { new.is_open() }).await;

    // The old one drains while queries keep coming: each is answered, by one or the other.
    let load = tokio::spawn(async move { ask_udp(listen, 16, 40).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let metrics_before = old.metric("lattice_dns_tcp_closed_total{reason=\"drain\"}");
    old.stop().await;
    let during = load.await.unwrap();
    assert_eq!(during.get(&None), None, "no query lost: {during:?}");
    assert_eq!(during.values().sum::<usize>(), 640);
    assert_eq!(metrics_before, 0.0);

    // The persistent connection was closed with a FIN (not a reset): a read ends cleanly.
    match ask_tcp(&mut persistent, 2).await {
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {}
        other => panic!("expected a clean close, got {other:?}"),
    }
    let mut again = TcpStream::connect(listen).await.unwrap();
    assert_eq!(ask_tcp(&mut again, 3).await.unwrap(), Some(new_ip));
    let after = ask_udp(listen, 16, 5).await;
    assert_eq!(after, HashMap::from([(Some(new_ip), 80)]), "{after:?}");
    new.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_the_first_table_the_zone_fails_retryably_and_other_names_are_forwarded() {
    let upstream = common::ScriptedUpstream::start(|query| {
        let mut reply = Message::response(query.metadata.id, OpCode::Query);
        reply.queries.clone_from(&query.queries);
        reply.metadata.response_code = hickory_proto::op::ResponseCode::NXDomain;
        Some(reply)
    })
    .await;
    let server = Server::start_with(
        Arc::new(NameTable::pending()),
        |c| {
            c.upstreams = vec![upstream.addr];
        },
        None,
    )
    .await;
    eventually(Duration::from_secs(2), || async { server.is_open() }).await;
    for name in [WEB, "nothing.shop.system.internal", "system.internal"] {
        for transport in ["+notcp", "+tcp"] {
            let d = dig(server.addr, &[transport, name]).await;
            assert_eq!(d.status(), "SERVFAIL", "{name} {transport}: {}", d.text);
        }
    }
    let suffixed = format!("{WEB}.default.svc.cluster.local");
    let d = dig(server.addr, &[&suffixed]).await;
    assert_eq!(
        d.status(),
        "SERVFAIL",
        "a search-suffixed mesh name too: {}",
        d.text
    );
    let d = dig(server.addr, &["www.example.test"]).await;
    assert_eq!(d.status(), "NXDOMAIN", "forwarded as ever: {}", d.text);
    assert_eq!(
        upstream.count(),
        1,
        "only the name outside the mesh went upstream"
    );

    server.names.send_replace(table(&[(WEB, "240.240.0.1")]));
    eventually(Duration::from_secs(2), || async {
        dig(server.addr, &[WEB]).await.status() == "NOERROR"
    })
    .await;
    let d = dig(server.addr, &["nothing.shop.system.internal"]).await;
    assert_eq!(d.status(), "NXDOMAIN", "{}", d.text);
    server.stop().await;
}

/// The agent's last mesh, read back at start: its names answer at once; a name it lacks may
/// be new, so it fails retryably instead of being denied; and beside the server it replaces,
/// a successor holding only such a table leaves every query to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provisional_table_answers_its_names_and_denies_none() {
    let provisional =
        |entries: &[(&str, &str)]| Arc::new(Arc::try_unwrap(table(entries)).unwrap().provisional());
    let listen: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let server = Server::start_on(listen, provisional(&[(WEB, "240.240.0.1")]), |_| {}, None).await;
    eventually(Duration::from_secs(2), || async { server.is_open() }).await;
    for transport in ["+notcp", "+tcp"] {
        let d = dig(listen, &[transport, WEB]).await;
        assert_eq!(d.status(), "NOERROR", "{transport}: {}", d.text);
        assert!(d.text.contains("240.240.0.1"), "{}", d.text);
    }
    // Missing, an empty non-terminal above the name, and a search-suffixed name it lacks.
    let parent = WEB.split_once('.').unwrap().1;
    for name in [
        "nothing.shop.system.internal",
        parent,
        "new.shop.system.internal.default.svc.cluster.local",
    ] {
        let d = dig(listen, &[name]).await;
        assert_eq!(d.status(), "SERVFAIL", "{name}: {}", d.text);
    }

    // A successor beside it, with a provisional table only, takes nothing.
    let successor =
        Server::start_on(listen, provisional(&[(WEB, "240.240.0.2")]), |_| {}, None).await;
    let before = ask_udp(listen, 16, 5).await;
    assert_eq!(
        before,
        HashMap::from([(Some(Ipv4Addr::new(240, 240, 0, 1)), 80)]),
        "{before:?}"
    );
    assert!(!successor.is_open());

    // Its settled table: the names it lacks are denied.
    server.names.send_replace(table(&[(WEB, "240.240.0.1")]));
    eventually(Duration::from_secs(2), || async {
        dig(listen, &["nothing.shop.system.internal"])
            .await
            .status()
            == "NXDOMAIN"
    })
    .await;
    successor.stop().await;
    server.stop().await;
}

/// An upstream that answers every query `delay` after it arrives, and counts them.
async fn slow_upstream(delay: Duration) -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    let socket = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
    let addr = socket.local_addr().unwrap();
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = seen.clone();
    tokio::spawn(async move {
        let mut buf = vec![0; 4096];
        while let Ok((len, peer)) = socket.recv_from(&mut buf).await {
            let Ok(query) = Message::from_vec(&buf[..len]) else {
                continue;
            };
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let socket = socket.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let mut reply = Message::response(query.metadata.id, OpCode::Query);
                reply.queries.clone_from(&query.queries);
                let name = query.queries[0].name().clone();
                reply.add_answer(hickory_proto::rr::Record::from_rdata(
                    name,
                    60,
                    RData::A(hickory_proto::rr::rdata::A([192, 0, 2, 7].into())),
                ));
                let _ = socket.send_to(&reply.to_vec().unwrap(), peer).await;
            });
        }
    });
    (addr, seen)
}

/// Draining answers what was received before it stops, forwarded queries still at their
/// upstream included, over UDP and TCP; the TCP connection then gets its FIN.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_answers_the_forwarded_queries_in_flight() {
    let (upstream, seen) = slow_upstream(Duration::from_millis(300)).await;
    let server = Server::start_with(
        table(&[(WEB, "240.240.0.1")]),
        |c| {
            c.upstreams = vec![upstream];
        },
        None,
    )
    .await;
    let mut clients = Vec::new();
    for k in 0..10u16 {
        let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        client
            .send_to(&query(k, &format!("n{k}.example.test")), server.addr)
            .await
            .unwrap();
        clients.push(client);
    }
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    let bytes = query(99, "tcp.example.test");
    let mut framed = (bytes.len() as u16).to_be_bytes().to_vec();
    framed.extend_from_slice(&bytes);
    stream.write_all(&framed).await.unwrap();
    eventually(Duration::from_secs(2), || async {
        seen.load(std::sync::atomic::Ordering::SeqCst) == 11
    })
    .await;
    // Every query is at the upstream: drain now.
    server.stop().await;
    for client in &clients {
        let mut buf = [0u8; 512];
        let n = tokio::time::timeout(Duration::from_secs(2), client.recv(&mut buf))
            .await
            .expect("answered while draining")
            .unwrap();
        assert_eq!(address_of(&buf[..n]), Some(Ipv4Addr::new(192, 0, 2, 7)));
    }
    let len = stream.read_u16().await.expect("answered before the FIN");
    let mut reply = vec![0; usize::from(len)];
    stream.read_exact(&mut reply).await.unwrap();
    assert_eq!(address_of(&reply), Some(Ipv4Addr::new(192, 0, 2, 7)));
    let mut rest = Vec::new();
    assert_eq!(
        stream.read_to_end(&mut rest).await.unwrap(),
        0,
        "then a FIN"
    );
}
