//! Forwarding of names outside the zone, against a test-started unbound and scripted upstreams on
//! loopback: relaying, EDNS toward upstream, TCP retry, SERVFAIL, failover and the cache.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{ScriptedUpstream, Server, Unbound, dig};
use hickory_proto::op::{Message, OpCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{RData, Record};

const MESH: &[(&str, &str)] = &[("buzz.bar.foo.system.internal", "240.240.0.1")];

fn unbound_zone() -> String {
    let mut zone = String::from(
        "  local-zone: \"example.test.\" static\n  local-data: \"example.test. 3600 IN SOA ns.example.test. host.example.test. 1 3600 600 86400 45\"\n  local-data: \"www.example.test. 300 IN A 192.0.2.10\"\n  local-zone: \"refused.example.\" refuse\n",
    );
    for i in 0..40 {
        zone.push_str(&format!(
            "  local-data: 'big.example.test. 300 IN TXT \"record {i:02} {}\"'\n",
            "x".repeat(90)
        ));
    }
    zone
}

/// Answers every A query with 192.0.2.1 and the given TTL.
fn answer_a(ttl: u32) -> impl Fn(&Message) -> Option<Message> + Send + 'static {
    move |query| {
        let mut reply = Message::response(query.metadata.id, OpCode::Query);
        reply.metadata.recursion_available = true;
        reply.queries.clone_from(&query.queries);
        let name = query.queries[0].name().clone();
        reply.add_answer(Record::from_rdata(
            name,
            ttl,
            RData::A(A([192, 0, 2, 1].into())),
        ));
        Some(reply)
    }
}

async fn silent_upstream() -> ScriptedUpstream {
    ScriptedUpstream::start(|_| None).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_answers_nxdomain_authority_and_ttls_from_unbound() {
    let unbound = Unbound::start(&unbound_zone()).await;
    let server = Server::start(MESH, |c| c.upstreams = vec![unbound.addr]).await;
    let d = dig(server.addr, &["www.example.test"]).await;
    assert_eq!(d.status(), "NOERROR", "{}", d.text);
    assert_eq!(
        d.answers(),
        vec![vec!["www.example.test.", "300", "IN", "A", "192.0.2.10"]],
        "{}",
        d.text
    );
    let d = dig(server.addr, &["+tcp", "nope.example.test"]).await;
    assert_eq!(d.status(), "NXDOMAIN", "{}", d.text);
    let soa = &d.authority()[0];
    assert_eq!(
        &soa[..5],
        &["example.test.", "45", "IN", "SOA", "ns.example.test."],
        "{}",
        d.text
    );
    let direct = dig(unbound.addr, &["nope.example.test"]).await;
    assert_eq!(
        d.authority(),
        direct.authority(),
        "the authority section is relayed unchanged"
    );
    // The rcode is relayed as is: unbound refuses this zone.
    let d = dig(server.addr, &["www.refused.example"]).await;
    assert_eq!(d.status(), "REFUSED", "{}", d.text);
    // Mesh names never reach upstream.
    let d = dig(server.addr, &["buzz.bar.foo.system.internal"]).await;
    assert_eq!(d.answers()[0][4], "240.240.0.1");
    assert_eq!(
        server.metric("lattice_dns_replies_total{rcode=\"NXDOMAIN\",source=\"forwarded\"}"),
        1.0,
        "{}",
        server.metrics()
    );
    assert!(
        server.metric("lattice_dns_upstream_duration_seconds_count") >= 2.0,
        "{}",
        server.metrics()
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_upstream_answer_is_retried_over_tcp_and_truncated_for_udp_clients() {
    let unbound = Unbound::start(&unbound_zone()).await;
    let server = Server::start(MESH, |c| c.upstreams = vec![unbound.addr]).await;
    // Over UDP the ~4.5 kB answer cannot reach the client: TC set, nothing else.
    let d = dig(
        server.addr,
        &["+ignore", "+bufsize=4096", "big.example.test", "TXT"],
    )
    .await;
    assert!(d.flags().contains(&"tc"), "{}", d.text);
    assert!(d.answers().is_empty(), "{}", d.text);
    // Upstream truncated our 1232-byte UDP query, so the server asked again over TCP.
    assert!(
        server.metric("lattice_dns_upstream_truncated_total") >= 1.0,
        "{}",
        server.metrics()
    );
    // dig follows TC with TCP and gets all 40 records.
    let d = dig(server.addr, &["big.example.test", "TXT"]).await;
    assert_eq!(d.status(), "NOERROR", "{}", d.text);
    assert_eq!(d.answers().len(), 40, "{}", d.text);
    // Plain DNS: 512 bytes.
    let d = dig(
        server.addr,
        &["+ignore", "+noedns", "big.example.test", "TXT"],
    )
    .await;
    assert!(d.flags().contains(&"tc"), "{}", d.text);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_queries_carry_edns_with_at_least_1232_bytes() {
    let upstream = ScriptedUpstream::start(answer_a(60)).await;
    let server = Server::start(MESH, |c| {
        c.upstreams = vec![upstream.addr];
        c.cache = false;
    })
    .await;
    let d = dig(server.addr, &["+noedns", "www.example.test"]).await;
    assert_eq!(d.answers()[0][4], "192.0.2.1", "{}", d.text);
    let queries = upstream.queries.lock().unwrap().clone();
    let edns = queries[0].edns.as_ref().expect("upstream query has EDNS");
    assert!(edns.max_payload() >= 1232, "{edns:?}");
    assert!(
        d.opt().is_none(),
        "the client sent no EDNS, so it gets none: {}",
        d.text
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servfail_when_no_upstream_answers_in_time() {
    let silent = silent_upstream().await;
    let server = Server::start(MESH, |c| {
        c.upstreams = vec![silent.addr];
        c.upstream_timeout = Duration::from_millis(300);
    })
    .await;
    let started = Instant::now();
    let d = dig(server.addr, &["www.example.test"]).await;
    assert_eq!(d.status(), "SERVFAIL", "{}", d.text);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(silent.count(), 1);
    assert_eq!(
        server.metric("lattice_dns_upstream_failures_total{reason=\"timeout\"}"),
        1.0,
        "{}",
        server.metrics()
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fails_over_to_the_next_upstream() {
    let silent = silent_upstream().await;
    let unbound = Unbound::start(&unbound_zone()).await;
    // A closed port: the kernel answers with ICMP unreachable.
    let closed: SocketAddr = {
        let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        s.local_addr().unwrap()
    };
    let server = Server::start(MESH, |c| {
        c.upstreams = vec![silent.addr, closed, unbound.addr];
        c.upstream_timeout = Duration::from_millis(300);
    })
    .await;
    let d = dig(server.addr, &["www.example.test"]).await;
    assert_eq!(d.status(), "NOERROR", "{}", d.text);
    assert_eq!(d.answers()[0][4], "192.0.2.10", "{}", d.text);
    assert_eq!(silent.count(), 1);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_serves_answers_for_their_ttl_and_counts_it_down() {
    let upstream = ScriptedUpstream::start(answer_a(2)).await;
    let server = Server::start(MESH, |c| c.upstreams = vec![upstream.addr]).await;
    let first = dig(server.addr, &["www.example.test"]).await;
    // Said before indexing, so a rare empty answer (seen once in CI) shows what dig got.
    assert!(!first.answers().is_empty(), "no answer: {}", first.text);
    assert_eq!(first.answers()[0][1], "2", "{}", first.text);
    let second = dig(server.addr, &["WWW.example.test"]).await;
    assert!(!second.answers().is_empty(), "no answer: {}", second.text);
    assert_eq!(second.answers()[0][4], "192.0.2.1", "{}", second.text);
    assert_eq!(
        second.answers()[0][0],
        "WWW.example.test.",
        "the client's case: {}",
        second.text
    );
    assert_eq!(
        upstream.count(),
        1,
        "the second query was served from the cache"
    );
    assert_eq!(
        server.metric("lattice_dns_replies_total{rcode=\"NOERROR\",source=\"cached\"}"),
        1.0
    );
    // Time passing is the point here, not readiness: the entry expires after its TTL.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    dig(server.addr, &["www.example.test"]).await;
    assert_eq!(upstream.count(), 2, "the expired entry was fetched again");
    server.stop().await;

    let uncached = ScriptedUpstream::start(answer_a(300)).await;
    let server = Server::start(MESH, |c| {
        c.upstreams = vec![uncached.addr];
        c.cache = false;
    })
    .await;
    dig(server.addr, &["www.example.test"]).await;
    dig(server.addr, &["www.example.test"]).await;
    assert_eq!(
        uncached.count(),
        2,
        "with the cache off every query goes upstream"
    );
    server.stop().await;
}
