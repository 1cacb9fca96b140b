//! The `system.internal` zone answered from the live name table, checked with dig and kdig.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{ScriptedUpstream, Server, dig, eventually, kdig, table};

const MESH: &[(&str, &str)] = &[
    ("buzz.bar.foo.system.internal", "240.240.0.1"),
    ("db.foo.system.internal", "240.240.0.7"),
    ("dual.system.internal", "240.240.0.8"),
    ("dual.system.internal", "fd00::8"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_of_a_mesh_name_with_default_ttl_over_udp_and_tcp() {
    let server = Server::start(MESH, |_| {}).await;
    for transport in ["+notcp", "+tcp"] {
        let d = dig(
            server.addr,
            &[transport, "buzz.bar.foo.system.internal", "A"],
        )
        .await;
        assert_eq!(d.status(), "NOERROR", "{}", d.text);
        assert!(d.flags().contains(&"aa"), "{}", d.text);
        assert_eq!(
            d.answers(),
            vec![vec![
                "buzz.bar.foo.system.internal.",
                "30",
                "IN",
                "A",
                "240.240.0.1"
            ]],
            "{}",
            d.text
        );
    }
    let d = kdig(server.addr, &["db.foo.system.internal", "A"]).await;
    assert!(
        d.text.contains("NOERROR") && d.text.contains("240.240.0.7"),
        "{}",
        d.text
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_is_configurable() {
    let server = Server::start(MESH, |c| c.ttl = 5).await;
    let d = dig(server.addr, &["buzz.bar.foo.system.internal"]).await;
    assert_eq!(d.answers()[0][1], "5", "{}", d.text);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aaaa_of_an_ipv4_name_is_nodata_with_soa_and_negative_ttl() {
    let server = Server::start(MESH, |c| c.negative_ttl = 7).await;
    let d = dig(server.addr, &["buzz.bar.foo.system.internal", "AAAA"]).await;
    assert_eq!(d.status(), "NOERROR", "{}", d.text);
    assert!(d.answers().is_empty(), "{}", d.text);
    let soa = &d.authority()[0];
    assert_eq!(
        &soa[..4],
        &["system.internal.", "7", "IN", "SOA"],
        "{}",
        d.text
    );
    assert_eq!(
        soa.last(),
        Some(&"7"),
        "SOA minimum is the negative TTL: {}",
        d.text
    );
    // With an IPv6 address configured, AAAA answers it.
    let d = dig(server.addr, &["dual.system.internal", "AAAA"]).await;
    assert_eq!(
        d.answers(),
        vec![vec!["dual.system.internal.", "30", "IN", "AAAA", "fd00::8"]],
        "{}",
        d.text
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_names_are_nxdomain_with_soa_and_ancestors_are_nodata() {
    let server = Server::start(MESH, |_| {}).await;
    let d = dig(server.addr, &["nope.system.internal"]).await;
    assert_eq!(d.status(), "NXDOMAIN", "{}", d.text);
    assert!(d.flags().contains(&"aa"), "{}", d.text);
    assert_eq!(d.authority()[0][3], "SOA", "{}", d.text);
    // An empty non-terminal exists (it has names below it): NODATA, not NXDOMAIN (RFC 8020).
    let d = dig(server.addr, &["bar.foo.system.internal"]).await;
    assert_eq!(d.status(), "NOERROR", "{}", d.text);
    assert!(d.answers().is_empty(), "{}", d.text);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soa_and_ns_at_the_apex() {
    let server = Server::start(MESH, |_| {}).await;
    let d = dig(server.addr, &["system.internal", "SOA"]).await;
    let soa = &d.answers()[0];
    assert_eq!(
        &soa[..5],
        &["system.internal.", "30", "IN", "SOA", "ns.system.internal."],
        "{}",
        d.text
    );
    let d = kdig(server.addr, &["system.internal", "NS"]).await;
    assert!(
        d.text.contains("system.internal.") && d.text.contains("NS\tns.system.internal."),
        "{}",
        d.text
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_name_servers_name_resolves_to_the_address_the_server_answers_on() {
    let server = Server::start(MESH, |_| {}).await;
    let d = dig(server.addr, &["NS.system.internal", "A"]).await;
    assert_eq!(d.status(), "NOERROR", "{}", d.text);
    assert!(d.flags().contains(&"aa"), "{}", d.text);
    assert_eq!(
        d.answers(),
        vec![vec!["NS.system.internal.", "30", "IN", "A", "127.0.0.1"]],
        "{}",
        d.text
    );
    let d = dig(server.addr, &["system.internal", "NS"]).await;
    assert_eq!(
        d.additional(),
        vec![vec!["ns.system.internal.", "30", "IN", "A", "127.0.0.1"]],
        "the address goes along with the NS record: {}",
        d.text
    );
    // It has no IPv6 address: NODATA with the SOA, never NXDOMAIN.
    let d = dig(server.addr, &["ns.system.internal", "AAAA"]).await;
    assert_eq!(d.status(), "NOERROR", "{}", d.text);
    assert!(
        d.answers().is_empty() && d.authority()[0][3] == "SOA",
        "{}",
        d.text
    );
    server.stop().await;
    // Listening on every address, the server knows none to give: the name exists, empty.
    let server = Server::start(MESH, |c| c.nameserver = None).await;
    let d = dig(server.addr, &["ns.system.internal", "A"]).await;
    assert_eq!(d.status(), "NOERROR", "{}", d.text);
    assert!(d.answers().is_empty(), "{}", d.text);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_apex_says_it_takes_no_mail() {
    let server = Server::start(MESH, |_| {}).await;
    let d = dig(server.addr, &["system.internal", "MX"]).await;
    assert_eq!(
        d.answers(),
        vec![vec!["system.internal.", "30", "IN", "MX", "0", "."]],
        "a null MX (RFC 7505): {}",
        d.text
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_classes_than_in_are_refused_here_and_never_forwarded() {
    let upstream = ScriptedUpstream::start(|_| None).await;
    let server = Server::start(MESH, |c| c.upstreams = vec![upstream.addr]).await;
    for (class, name) in [
        ("CH", "version.bind"),
        ("CH", "hostname.bind"),
        ("CH", "id.server"),
        ("CH", "version.server"),
        ("HS", "example.test"),
        ("CH", "buzz.bar.foo.system.internal"),
    ] {
        for transport in ["+notcp", "+tcp"] {
            let d = dig(server.addr, &[transport, class, "TXT", name]).await;
            assert_eq!(d.status(), "REFUSED", "{class} {name}: {}", d.text);
            assert!(d.answers().is_empty(), "{}", d.text);
        }
    }
    assert_eq!(upstream.count(), 0, "nothing was forwarded");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_only_errors_carry_an_opt_when_the_query_had_one() {
    let server = Server::start(MESH, |_| {}).await;
    for (args, status) in [
        (&["+opcode=15", "+header-only"][..], "NOTIMP"),
        (&["+opcode=4", "system.internal", "SOA"][..], "NOTIMP"),
        (&["+opcode=5", "system.internal", "SOA"][..], "NOTIMP"),
        (&["+header-only"][..], "FORMERR"),
        (&["+header-only", "+cookie"][..], "FORMERR"),
    ] {
        for transport in ["+notcp", "+tcp"] {
            let d = dig(
                server.addr,
                &[&[transport, "+edns=0", "+dnssec"], args].concat(),
            )
            .await;
            assert_eq!(d.status(), status, "{args:?}: {}", d.text);
            let opt = d
                .opt()
                .unwrap_or_else(|| panic!("{args:?}: no OPT: {}", d.text));
            assert!(
                opt.contains("version: 0") && opt.contains("flags: do"),
                "{opt}"
            );
            assert!(
                !d.text.contains("COOKIE"),
                "options are not echoed: {}",
                d.text
            );
            let d = dig(server.addr, &[&[transport, "+noedns"], args].concat()).await;
            if !args.contains(&"+cookie") {
                assert_eq!(d.status(), status, "{args:?}: {}", d.text);
                assert!(d.opt().is_none(), "no OPT in, none out: {}", d.text);
            }
        }
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_are_case_insensitive_and_the_question_case_is_echoed() {
    let server = Server::start(MESH, |_| {}).await;
    for transport in ["+notcp", "+tcp"] {
        let d = dig(server.addr, &[transport, "BuZz.BAR.foo.System.Internal"]).await;
        assert_eq!(d.status(), "NOERROR", "{}", d.text);
        assert_eq!(
            d.answers()[0][0],
            "BuZz.BAR.foo.System.Internal.",
            "{}",
            d.text
        );
        assert_eq!(d.answers()[0][4], "240.240.0.1", "{}", d.text);
        assert!(
            d.text.contains(";BuZz.BAR.foo.System.Internal.\tIN\tA"),
            "{}",
            d.text
        );
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_suffixed_names_get_a_cname_to_the_mesh_name_and_its_address() {
    let server = Server::start(MESH, |_| {}).await;
    let d = dig(
        server.addr,
        &["buzz.bar.foo.system.internal.shop.svc.cluster.local"],
    )
    .await;
    assert_eq!(d.status(), "NOERROR", "{}", d.text);
    assert_eq!(
        d.answers(),
        vec![
            vec![
                "buzz.bar.foo.system.internal.shop.svc.cluster.local.",
                "30",
                "IN",
                "CNAME",
                "buzz.bar.foo.system.internal."
            ],
            vec![
                "buzz.bar.foo.system.internal.",
                "30",
                "IN",
                "A",
                "240.240.0.1"
            ],
        ],
        "{}",
        d.text
    );
    // No upstream is configured: the shortcut answered without forwarding.
    assert_eq!(
        server.metric("lattice_dns_replies_total{rcode=\"NOERROR\",source=\"forwarded\"}"),
        0.0
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_swaps_take_effect_within_a_second() {
    let server = Server::start(MESH, |_| {}).await;
    let addr = server.addr;
    let d = dig(addr, &["new.system.internal"]).await;
    assert_eq!(d.status(), "NXDOMAIN");
    let mut grown = MESH.to_vec();
    grown.push(("new.system.internal", "240.240.0.9"));
    server.names.send(table(&grown)).unwrap();
    let took = eventually(Duration::from_secs(1), || async move {
        let d = dig(addr, &["new.system.internal"]).await;
        d.status() == "NOERROR" && d.answers().first().is_some_and(|a| a[4] == "240.240.0.9")
    })
    .await;
    eprintln!("added name resolved after {took:?}");
    server.names.send(table(MESH)).unwrap();
    let took = eventually(Duration::from_secs(1), || async move {
        dig(addr, &["+tcp", "new.system.internal"]).await.status() == "NXDOMAIN"
    })
    .await;
    eprintln!("removed name was NXDOMAIN after {took:?}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_replies_by_rcode_and_source() {
    let server = Server::start(MESH, |_| {}).await;
    for _ in 0..3 {
        dig(server.addr, &["buzz.bar.foo.system.internal"]).await;
    }
    dig(server.addr, &["nope.system.internal"]).await;
    dig(server.addr, &["example.com"]).await;
    let text = server.metrics();
    assert_eq!(
        server.metric("lattice_dns_replies_total{rcode=\"NOERROR\",source=\"local\"}"),
        3.0,
        "{text}"
    );
    assert_eq!(
        server.metric("lattice_dns_replies_total{rcode=\"NXDOMAIN\",source=\"local\"}"),
        1.0,
        "{text}"
    );
    assert_eq!(
        server.metric("lattice_dns_replies_total{rcode=\"SERVFAIL\",source=\"forwarded\"}"),
        1.0,
        "{text}"
    );
    assert!(
        text.contains("lattice_dns_upstream_duration_seconds"),
        "{text}"
    );
    server.stop().await;
}

/// A stateful service as the agent publishes it: the service name holds the ready instances,
/// each instance its own name, and a named port SRV records pointing at the instances.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn srv_records_point_at_instances_whose_addresses_come_along() {
    use lattice_dns::{MeshRecord, NameTable, SrvRecord};
    let server = Server::start(&[], |_| {}).await;
    let a = |ip: &str| MeshRecord::Address(ip.parse().unwrap());
    let srv = |target: &str| {
        MeshRecord::Srv(SrvRecord {
            priority: 0,
            weight: 50,
            port: 9042,
            target: target.to_string(),
        })
    };
    let owner = "_cql._tcp.db.data.system.internal";
    server
        .names
        .send(std::sync::Arc::new(NameTable::from_records([
            ("db.data.system.internal".to_string(), a("240.240.0.2")),
            ("db.data.system.internal".to_string(), a("240.240.0.3")),
            ("db-0.db.data.system.internal".to_string(), a("240.240.0.2")),
            ("db-1.db.data.system.internal".to_string(), a("240.240.0.3")),
            (owner.to_string(), srv("db-0.db.data.system.internal")),
            (owner.to_string(), srv("db-1.db.data.system.internal")),
            ("idle.data.system.internal".to_string(), MeshRecord::Exists),
        ])))
        .unwrap();
    let d = dig(server.addr, &[owner, "SRV"]).await;
    assert_eq!(d.status(), "NOERROR", "{}", d.text);
    let mut answers: Vec<String> = d.answers().iter().map(|r| r[3..].join(" ")).collect();
    answers.sort();
    assert_eq!(
        answers,
        [
            "SRV 0 50 9042 db-0.db.data.system.internal.",
            "SRV 0 50 9042 db-1.db.data.system.internal."
        ],
        "{}",
        d.text
    );
    let mut additional: Vec<String> = d
        .additional()
        .iter()
        .filter(|r| r.get(3) == Some(&"A"))
        .map(|r| format!("{} {}", r[0], r[4]))
        .collect();
    additional.sort();
    assert_eq!(
        additional,
        [
            "db-0.db.data.system.internal. 240.240.0.2",
            "db-1.db.data.system.internal. 240.240.0.3"
        ],
        "{}",
        d.text
    );
    // A name that exists with nothing in it is NODATA, not NXDOMAIN; so is AAAA of an
    // instance, and A of the SRV owner.
    for (name, qtype) in [
        ("idle.data.system.internal", "A"),
        ("db-1.db.data.system.internal", "AAAA"),
        (owner, "A"),
    ] {
        let d = dig(server.addr, &[name, qtype]).await;
        assert_eq!(d.status(), "NOERROR", "{name} {qtype}: {}", d.text);
        assert!(d.answers().is_empty(), "{name} {qtype}: {}", d.text);
        assert_eq!(d.authority()[0][3], "SOA", "{}", d.text);
    }
    server.stop().await;
}
