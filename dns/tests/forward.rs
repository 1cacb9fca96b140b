//! Forwarding of names outside the zone, against a test-started unbound and scripted upstreams on
//! loopback: relaying, EDNS toward upstream, TCP retry, SERVFAIL, failover, upstream health,
//! coalescing and the cache. Time that matters (TTLs, probe intervals) is a manual clock the
//! tests move, never a sleep.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{GatedUpstream, ScriptedUpstream, Server, Unbound, dig, eventually};
use hickory_proto::op::{Message, OpCode, Query};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, Record, RecordType};
use lattice_dns::Clock;
use tokio::net::UdpSocket;

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
    // The exchange counts its time-out on its own clock, a moment after the client's answer.
    eventually(Duration::from_secs(5), || async {
        server.metric("lattice_dns_upstream_failures_total{reason=\"timeout\"}") == 1.0
    })
    .await;
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
    let upstream = ScriptedUpstream::start(answer_a(300)).await;
    let clock = Clock::manual();
    let server = Server::start(MESH, |c| {
        c.upstreams = vec![upstream.addr];
        c.clock = clock.clone();
    })
    .await;
    let first = dig(server.addr, &["www.example.test"]).await;
    // Said before indexing, so a rare empty answer (seen once in CI) shows what dig got.
    assert!(!first.answers().is_empty(), "no answer: {}", first.text);
    assert_eq!(first.answers()[0][1], "300", "{}", first.text);
    clock.advance(Duration::from_secs(100));
    for transport in ["+notcp", "+tcp"] {
        let second = dig(server.addr, &[transport, "WWW.example.test"]).await;
        assert!(!second.answers().is_empty(), "no answer: {}", second.text);
        assert_eq!(
            second.answers()[0],
            vec!["WWW.example.test.", "200", "IN", "A", "192.0.2.1"],
            "the client's case, the TTL less 100 s in the cache: {}",
            second.text
        );
    }
    assert_eq!(
        upstream.count(),
        1,
        "later queries were served from the cache"
    );
    assert_eq!(
        server.metric("lattice_dns_replies_total{rcode=\"NOERROR\",source=\"cached\"}"),
        2.0
    );
    assert_eq!(server.metric("lattice_dns_cache_hits_total"), 2.0);
    assert_eq!(server.metric("lattice_dns_cache_misses_total"), 1.0);
    clock.advance(Duration::from_secs(199));
    let last = dig(server.addr, &["www.example.test"]).await;
    assert_eq!(last.answers()[0][1], "1", "{}", last.text);
    clock.advance(Duration::from_secs(1));
    let fresh = dig(server.addr, &["www.example.test"]).await;
    assert_eq!(upstream.count(), 2, "the expired entry was fetched again");
    assert_eq!(fresh.answers()[0][1], "300", "{}", fresh.text);
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

/// One upstream dead of two: once it has missed an answer, misses go to the live one alone,
/// one upstream query each, as with two live upstreams; the dead one gets a probe now and then
/// (as the clock moves), beside the live one, and is asked again once a probe is answered.
async fn one_dead_upstream_of_two(dead: SocketAddr, dead_count: impl Fn() -> usize) {
    let live = ScriptedUpstream::start(answer_a(60)).await;
    let clock = Clock::manual();
    let server = Server::start(MESH, |c| {
        // The dead one first: configured order is the order before anything is measured.
        c.upstreams = vec![dead, live.addr];
        c.upstream_timeout = Duration::from_millis(500);
        c.clock = clock.clone();
    })
    .await;
    let up = |addr: SocketAddr| format!("lattice_dns_upstream_up{{upstream=\"{addr}\"}}");
    let d = dig(server.addr, &["first.example.test"]).await;
    assert_eq!(
        d.status(),
        "NOERROR",
        "the live one answers the first miss: {}",
        d.text
    );
    assert_eq!(dead_count(), 1);
    eventually(Duration::from_secs(5), || async {
        server.metric(&up(dead)) == 0.0
    })
    .await;
    assert_eq!(server.metric(&up(live.addr)), 1.0);
    for i in 0..20 {
        let d = dig(server.addr, &[&format!("n{i}.example.test")]).await;
        assert_eq!(d.status(), "NOERROR", "{}", d.text);
    }
    assert_eq!(dead_count(), 1, "no miss asked the dead upstream again");
    assert_eq!(live.count(), 21, "each miss cost one upstream query");
    // The probe goes once the clock says so, beside a query to the live upstream.
    clock.advance(Duration::from_secs(1));
    let d = dig(server.addr, &["probed.example.test"]).await;
    assert_eq!(d.status(), "NOERROR", "{}", d.text);
    // The probe went out before the live upstream's query; it is counted when it arrives.
    eventually(Duration::from_secs(5), || async { dead_count() == 2 }).await;
    assert_eq!(live.count(), 22);
    let d = dig(server.addr, &["after-probe.example.test"]).await;
    assert_eq!(d.status(), "NOERROR", "{}", d.text);
    assert_eq!(dead_count(), 2, "no second probe before its time");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_upstream_is_skipped_and_probed() {
    let silent = silent_upstream().await;
    one_dead_upstream_of_two(silent.addr, || silent.count()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_upstream_is_skipped_and_probed() {
    // A closed port: the kernel answers every query with ICMP port unreachable. Probes are
    // counted by the failures they cause.
    let closed: SocketAddr = {
        let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        s.local_addr().unwrap()
    };
    let live = ScriptedUpstream::start(answer_a(60)).await;
    let clock = Clock::manual();
    let server = Server::start(MESH, |c| {
        c.upstreams = vec![closed, live.addr];
        c.clock = clock.clone();
    })
    .await;
    let asked =
        |addr: SocketAddr| format!("lattice_dns_upstream_queries_total{{upstream=\"{addr}\"}}");
    for i in 0..10 {
        let d = dig(server.addr, &[&format!("n{i}.example.test")]).await;
        assert_eq!(d.status(), "NOERROR", "{}", d.text);
    }
    assert_eq!(server.metric(&asked(closed)), 1.0, "{}", server.metrics());
    assert_eq!(server.metric(&asked(live.addr)), 10.0);
    clock.advance(Duration::from_secs(1));
    dig(server.addr, &["probed.example.test"]).await;
    assert_eq!(server.metric(&asked(closed)), 2.0, "one probe");
    assert_eq!(server.metric(&asked(live.addr)), 11.0);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_down_upstream_that_answers_a_probe_is_asked_again() {
    // Down first (it answers nothing until opened), then back.
    let flaky = GatedUpstream::start(answer_a(60)).await;
    let live = ScriptedUpstream::start(answer_a(60)).await;
    let clock = Clock::manual();
    let server = Server::start(MESH, |c| {
        c.upstreams = vec![flaky.addr, live.addr];
        c.upstream_timeout = Duration::from_millis(500);
        c.clock = clock.clone();
    })
    .await;
    let up = format!("lattice_dns_upstream_up{{upstream=\"{}\"}}", flaky.addr);
    dig(server.addr, &["first.example.test"]).await;
    eventually(Duration::from_secs(5), || async {
        server.metric(&up) == 0.0
    })
    .await;
    flaky.open();
    clock.advance(Duration::from_secs(1));
    dig(server.addr, &["probe.example.test"]).await;
    eventually(Duration::from_secs(5), || async {
        server.metric(&up) == 1.0
    })
    .await;
    assert_eq!(flaky.count(), 2, "the first query and the probe");
    server.stop().await;
}

/// An outage of every upstream: one dead for good, the other silent for a while. However many
/// queries time out meanwhile (each one's waits make both upstreams look slower), each asks
/// the one that comes back, so the first query after it answers again gets its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_every_upstream_was_down_the_first_back_answers_the_next_query() {
    let dead = silent_upstream().await;
    let returning = GatedUpstream::start(answer_a(60)).await;
    let server = Server::start(MESH, |c| {
        c.upstreams = vec![dead.addr, returning.addr];
        c.upstream_timeout = Duration::from_millis(300);
    })
    .await;
    let outage = 12;
    for i in 0..outage {
        let d = dig(server.addr, &[&format!("out{i}.example.test")]).await;
        assert_eq!(d.status(), "SERVFAIL", "query {i}: {}", d.text);
    }
    assert_eq!(
        returning.count(),
        outage,
        "every query of the outage asked the upstream that comes back"
    );
    returning.open();
    let d = dig(server.addr, &["back.example.test"]).await;
    assert_eq!(
        d.status(),
        "NOERROR",
        "the upstream that answers again is asked: {}",
        d.text
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_queries_in_flight_reach_the_upstream_once() {
    let upstream = GatedUpstream::start(answer_a(60)).await;
    let server = Server::start(MESH, |c| {
        c.upstreams = vec![upstream.addr];
        c.upstream_timeout = Duration::from_secs(10);
    })
    .await;
    // Ten clients ask the same question in ten spellings, over UDP and TCP, while the upstream
    // holds its answer.
    let spellings: Vec<String> = (0..10)
        .map(|i| {
            "slow.example.test"
                .chars()
                .enumerate()
                .map(|(k, c)| {
                    if (k + i) % 3 == 0 {
                        c.to_ascii_uppercase()
                    } else {
                        c
                    }
                })
                .collect()
        })
        .collect();
    let addr = server.addr;
    let clients: Vec<_> = spellings
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let name = name.clone();
            tokio::spawn(async move {
                let transport = if i % 2 == 0 { "+notcp" } else { "+tcp" };
                (
                    name.clone(),
                    dig(addr, &[transport, "+time=10", &name]).await,
                )
            })
        })
        .collect();
    eventually(Duration::from_secs(10), || async {
        server.metric("lattice_dns_coalesced_total") == 9.0
    })
    .await;
    assert_eq!(upstream.count(), 1);
    upstream.open();
    for client in clients {
        let (name, d) = client.await.unwrap();
        // dig itself checks that the reply's id is its query's.
        assert_eq!(d.status(), "NOERROR", "{}", d.text);
        assert_eq!(d.answers()[0][0], format!("{name}."), "{}", d.text);
        assert_eq!(d.answers()[0][4], "192.0.2.1", "{}", d.text);
    }
    assert_eq!(upstream.count(), 1, "one upstream query for all ten");
    server.stop().await;
}

/// A query for `name` A with id `id` and EDNS.
fn query_bytes(id: u16, name: &str) -> Vec<u8> {
    let mut m = Message::query();
    m.metadata.id = id;
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
    m.to_vec().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_unique_names_from_one_pod_does_not_evict_anothers() {
    let upstream = ScriptedUpstream::start(answer_a(300)).await;
    let server = Server::start(MESH, |c| {
        c.upstreams = vec![upstream.addr];
        c.cache_entries = 100;
        c.cache_entries_per_source = 20;
    })
    .await;
    // The quiet pod (127.0.0.2) caches ten names.
    let quiet: Vec<String> = (0..10).map(|i| format!("app{i}.example.test")).collect();
    for name in &quiet {
        let d = dig(server.addr, &["-b", "127.0.0.2", name]).await;
        assert_eq!(d.status(), "NOERROR", "{}", d.text);
    }
    // The noisy pod (127.0.0.3) asks for 1000 names nobody asked before, 50 at a time.
    let noisy = UdpSocket::bind("127.0.0.3:0").await.unwrap();
    noisy.connect(server.addr).await.unwrap();
    let mut buf = vec![0; 1500];
    for batch in 0..20u16 {
        for i in 0..50u16 {
            let id = batch * 50 + i;
            noisy
                .send(&query_bytes(id, &format!("flood{id}.example.test.")))
                .await
                .unwrap();
        }
        for _ in 0..50 {
            tokio::time::timeout(Duration::from_secs(5), noisy.recv(&mut buf))
                .await
                .expect("the flood is answered")
                .unwrap();
        }
    }
    assert_eq!(upstream.count(), 1010);
    // The quiet pod's names are still cached: no new upstream query.
    for name in &quiet {
        let d = dig(server.addr, &["-b", "127.0.0.2", name]).await;
        assert_eq!(d.status(), "NOERROR", "{}", d.text);
    }
    assert_eq!(
        upstream.count(),
        1010,
        "the quiet pod's names stayed in the cache"
    );
    assert_eq!(
        server.metric("lattice_dns_cache_evictions_total{reason=\"source_quota\"}"),
        980.0,
        "the flood replaced its own answers: {}",
        server.metrics()
    );
    assert_eq!(server.metric("lattice_dns_cache_entries"), 30.0);
    server.stop().await;
}
