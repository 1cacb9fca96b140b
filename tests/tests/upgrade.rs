//! Upgrades without a DNS gap, on the simulated node: the agent replaced ten times as a rolling
//! update with `maxSurge: 1` replaces it (the new agent started beside the old, on the same
//! addresses, and ready by its own admin socket; then the old one sent SIGTERM), under 1000 DNS
//! queries a second of mesh and forwarded names over UDP and over persistent TCP connections,
//! and HTTP and TCP requests through a real Envoy: not a query lost, not a connection reset,
//! not a request failed. And after a crash (SIGKILL), mesh names get SERVFAIL, never NXDOMAIN,
//! until the restarted agent has its first name table.
//!
//! Build the binaries first: `cargo build --workspace --bins`; run with
//! `LATTICE_ENVOY=/opt/lattice/envoy-venv/bin/envoy`, as root. The figures are printed
//! (`-- --nocapture`).

use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use lattice_contract::NODE_LOCAL_DNS;
use lattice_e2e::agent::{Agent, AgentAddrs};
use lattice_e2e::dns_load::{DnsLoad, DnsLoadPlan, Upstream, upstream_name};
use lattice_e2e::fake_apiserver::FakeApiServer;
use lattice_e2e::k8s_objects::{ready, service, slice};
use lattice_e2e::node::{ADMIN, MeshFile, MeshService, Node};
use lattice_e2e::wait;
use serde_json::json;

const WEB: &str = "web.shop.system.internal";
const DB: &str = "db.shop.system.internal";
/// The upstream resolver, on the node's loopback.
const UPSTREAM: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 5300);
const REPLACEMENTS: usize = 10;

#[test]
fn replacing_the_agent_ten_times_under_load_loses_no_query_and_resets_no_connection()
-> anyhow::Result<()> {
    let node = Node::new("upgrade")?;
    let upstream = Upstream::start(Some(&node.netns.path()), UPSTREAM)?;
    let web = node.http_backend("web-1", 10, 8080)?;
    let db = node.tcp_echo("db-1", 20, 5432)?;
    let mesh = MeshFile::new(&[
        MeshService {
            path: "/shop/web".into(),
            port: 8080,
            protocol: "http".into(),
            endpoints: vec![web.pod.address],
        },
        MeshService {
            path: "/shop/db".into(),
            port: 5432,
            protocol: "tcp".into(),
            endpoints: vec![db.pod.address],
        },
    ])?;
    // As the DaemonSet runs it: DNS and xDS on the node-local address, which each agent adds
    // and leaves for the next.
    let addrs = AgentAddrs {
        xds: SocketAddr::from((NODE_LOCAL_DNS, 15010)),
        dns: SocketAddr::from((NODE_LOCAL_DNS, 53)),
        admin: ADMIN,
    };
    let mesh_arg = format!("--mesh-file={}", mesh.path().display());
    let upstream_arg = format!("--upstream-dns={}", upstream.addr);
    let node_local = format!("--node-local-dns={NODE_LOCAL_DNS}");
    let mut agent = node.agent_at(addrs, &[&mesh_arg, &upstream_arg, &node_local], &[])?;
    let client = node.client_of("client", 2, addrs.xds, addrs.dns)?;
    let resolver = node.pod("resolver", 3)?;
    let web_ip = client.resolve(WEB)?;
    let db_ip = client.resolve(DB)?;
    let web_addr = SocketAddr::from((web_ip, 8080));
    let db_addr = SocketAddr::from((db_ip, 5432));
    wait::until(
        "Envoy routes to web and db",
        Duration::from_secs(20),
        || {
            client.http(web_addr, WEB)?;
            client.tcp_exchange(db_addr, b"hello\n").map(|_| ())
        },
    )?;

    // Half mesh names, half forwarded ones, whose answers (TTL 0) are never cached.
    let mut names = vec![(WEB.to_string(), web_ip), (DB.to_string(), db_ip)];
    names.extend((0..2).map(upstream_name));
    let plan = DnsLoadPlan {
        server: addrs.dns,
        names,
        udp_qps: 500,
        udp_sockets: 8,
        tcp_qps: 500,
        tcp_connections: 4,
    };
    let http_before = web.stats().served();
    let tcp_before = db.stats().served();
    let dns = DnsLoad::start(&resolver.netns.path(), &plan);
    let http = client.load(web_addr, WEB, Duration::from_millis(20));
    let tcp = client.tcp_load(db_addr, Duration::from_millis(20));

    let mut handoffs = Vec::new();
    for round in 1..=REPLACEMENTS {
        let started = Instant::now();
        let next = agent.successor();
        next.wait_ready()?;
        let ready = started.elapsed();
        let status = agent.terminate()?;
        assert!(
            status.success(),
            "round {round}: the old agent exited with {status}:\n{}",
            agent.log()
        );
        let drained = started.elapsed() - ready;
        agent = next;
        // The Envoy's ADS stream ended with the old agent; it reconnects to the new one.
        wait::until(
            "Envoy's stream on the new agent",
            Duration::from_secs(10),
            || {
                let (_, proxies) = agent.get("/debug/xds").map_err(|e| e.to_string())?;
                if proxies.contains("client.default") {
                    Ok(())
                } else {
                    Err(proxies)
                }
            },
        )?;
        // Each agent serves for a while before it is replaced in turn.
        wait::until(
            "the new agent answering the load",
            Duration::from_secs(10),
            || match replies(&agent) {
                Ok(n) if n >= 300 => Ok(()),
                other => Err(format!("{other:?}")),
            },
        )?;
        handoffs.push((ready, drained));
    }

    let report = dns.stop();
    let http = http.stop();
    let tcp = tcp.stop();
    let queries = report.udp.sent + report.tcp.sent;
    println!(
        "{REPLACEMENTS} replacements in {:.1} s; DNS: {queries} queries ({:.0}/s), UDP {:?}, TCP {:?}; HTTP {} requests, TCP {} exchanges",
        report.elapsed.as_secs_f64(),
        queries as f64 / report.elapsed.as_secs_f64(),
        report.udp,
        report.tcp,
        http.outcomes.len(),
        tcp.outcomes.len(),
    );
    for (round, (ready, drained)) in handoffs.iter().enumerate() {
        println!(
            "round {}: new agent ready in {ready:?}, old drained and exited in {drained:?}",
            round + 1
        );
    }
    assert!(report.udp.clean(), "UDP: {:?}", report.udp);
    assert!(report.tcp.clean(), "TCP: {:?}", report.tcp);
    assert_eq!(report.udp.answered, report.udp.sent, "{:?}", report.udp);
    assert_eq!(report.tcp.answered, report.tcp.sent, "{:?}", report.tcp);
    assert!(
        queries as f64 / report.elapsed.as_secs_f64() > 800.0,
        "the load ran at {queries} queries in {:?}",
        report.elapsed
    );
    http.assert_no_failures();
    tcp.assert_no_failures();
    // Every request reached a backend, counted there.
    assert_eq!(
        web.stats().served() - http_before,
        http.outcomes.len() as u64
    );
    assert_eq!(db.stats().served() - tcp_before, tcp.outcomes.len() as u64);
    drop(upstream);
    Ok(())
}

/// DNS replies an agent has sent, from its own metrics.
fn replies(agent: &Agent) -> anyhow::Result<u64> {
    let (_, metrics) = agent.get("/metrics")?;
    Ok(metrics
        .lines()
        .filter(|l| l.starts_with("lattice_dns_replies_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64)
}

/// After a SIGKILL the restarted agent answers at once: names outside the mesh are forwarded
/// as ever, mesh names get SERVFAIL (retryable) while it has no name table (its Kubernetes API
/// server is down), never NXDOMAIN; and the names resume as soon as its first table is in.
#[test]
fn after_a_crash_mesh_names_fail_retryably_until_the_first_table() -> anyhow::Result<()> {
    let server = FakeApiServer::start()?;
    server.apply_json(service(
        "shop",
        "web",
        json!([{"name": "http", "port": 8080}]),
    ))?;
    server.apply_json(slice(
        "shop",
        "web",
        "web",
        json!([{"name": "http", "port": 8080}]),
        ready(&["10.1.0.5".to_string()]),
    ))?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig)?;
    let upstream = Upstream::start(None, SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))?;
    let mut agent = Agent::start_with_env(
        &[&format!("--upstream-dns={}", upstream.addr)],
        &[("KUBECONFIG", kubeconfig.to_str().unwrap_or_default())],
    );
    agent.wait_ready()?;
    let name = "web.shop.system.internal";
    let (status, addresses) = agent.dig_a(name);
    assert_eq!(status, "NOERROR");
    let address = addresses.first().cloned().unwrap_or_default();

    server.stop();
    agent.kill();
    agent.restart();
    // Serving again, from nothing: mesh names fail retryably, forwarded names are answered.
    let (forwarded, expected) = upstream_name(7);
    wait::until(
        "the restarted agent answers",
        Duration::from_secs(10),
        || match agent.dig_a(&forwarded) {
            (status, addresses) if status == "NOERROR" => Ok(addresses),
            other => Err(format!("{other:?}")),
        },
    )
    .map(|addresses| assert_eq!(addresses, [expected.to_string()]))?;
    let mut seen_servfail = 0;
    for _ in 0..5 {
        let (status, _) = agent.dig_a(name);
        assert_eq!(
            status,
            "SERVFAIL",
            "before the first table:\n{}",
            agent.log()
        );
        seen_servfail += 1;
    }
    let (status, _) = agent.dig_a("nothing.shop.system.internal");
    assert_eq!(
        status, "SERVFAIL",
        "no name of the zone is known missing yet"
    );
    assert_ne!(agent.get("/readyz")?.0, 200, "not ready without a table");

    server.restart()?;
    let took = Instant::now();
    let answered = wait::until(
        "mesh names answered again",
        Duration::from_secs(20),
        || match agent.dig_a(name) {
            (status, addresses) if status == "NOERROR" => Ok(addresses),
            (status, _) if status == "SERVFAIL" => Err("SERVFAIL".to_string()),
            other => panic!("a mesh name got {other:?}, never anything but SERVFAIL or its answer"),
        },
    )?;
    assert_eq!(answered, [address]);
    println!(
        "{seen_servfail} SERVFAIL while the table was missing; answers {:?} after the API server came back",
        took.elapsed()
    );
    let (status, _) = agent.dig_a("nothing.shop.system.internal");
    assert_eq!(
        status, "NXDOMAIN",
        "with the table, a missing name is missing"
    );
    Ok(())
}
