//! The whole data path on a simulated node, with real parts only: an app in a client pod asks
//! the agent's DNS for a mesh name, connects to the trapped address it gets, iptables (installed
//! by the real `lattice-init`) sends the connection to a real Envoy running as UID 1337, which
//! the agent configured over ADS, and Envoy forwards it to a backend pod. The agent runs inside
//! the node's namespace and is fed by a mesh file, or in (f) by the fake Kubernetes API server.
//!
//! Build the binaries first: `cargo build --workspace --bins`. Timings are printed; see them
//! with `cargo test -p lattice-e2e --test datapath -- --nocapture`.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lattice_e2e::agent::Agent;
use lattice_e2e::fake_apiserver::FakeApiServer;
use lattice_e2e::node::{Backend, ClientPod, MeshFile, MeshService, Node};
use lattice_e2e::wait;
use serde_json::json;

/// One topology at a time: the sub-second bars below are about the mesh, not about two
/// topologies' Envoys competing for the same two cores.
static ONE_NODE: Mutex<()> = Mutex::new(());

const BUZZ: &str = "buzz.bar.foo.system.internal";
const BUZZ_PORT: u16 = 8080;
const DB: &str = "db.foo.system.internal";
const DB_PORT: u16 = 5432;
const SHARED: Ipv4Addr = Ipv4Addr::new(240, 240, 0, 1);
/// How soon a mesh change must reach the data path: a removed backend that keeps getting
/// requests for longer is a failed deploy for whoever removed it.
const FOLLOW: Duration = Duration::from_secs(1);
/// Between two requests of a steady stream.
const PACE: Duration = Duration::from_millis(10);

/// Where the agent's mesh comes from.
enum Source {
    File(MeshFile),
    Kube {
        server: FakeApiServer,
        dir: tempfile::TempDir,
    },
}

impl Source {
    /// The agent's arguments and environment for this source.
    fn agent(&self, node: &Node) -> anyhow::Result<Agent> {
        match self {
            Source::File(file) => node.agent(&["--mesh-file", file.path().to_str().unwrap()], &[]),
            Source::Kube { dir, .. } => {
                let kubeconfig = dir.path().join("kubeconfig");
                node.agent(&[], &[("KUBECONFIG", kubeconfig.to_str().unwrap())])
            }
        }
    }

    /// Makes the mesh: buzz (HTTP 8080) on `buzz`, db (TCP 5432) on `db`.
    fn set(&self, buzz: &[&Backend], db: &[&Backend]) -> anyhow::Result<()> {
        let addresses = |backends: &[&Backend]| -> Vec<Ipv4Addr> {
            backends.iter().map(|b| b.pod.address).collect()
        };
        match self {
            Source::File(file) => file.write(&[
                MeshService {
                    path: "/foo/bar/buzz".into(),
                    port: BUZZ_PORT,
                    protocol: "http".into(),
                    endpoints: addresses(buzz),
                },
                MeshService {
                    path: "/foo/db".into(),
                    port: DB_PORT,
                    protocol: "tcp".into(),
                    endpoints: addresses(db),
                },
            ]),
            Source::Kube { server, .. } => {
                server.apply_json(json!({
                    "apiVersion": "v1", "kind": "Service",
                    // Under its namespace's prefix, as the default path ownership asks.
                    "metadata": {"namespace": "foo", "name": "buzz",
                                 "annotations": {"lattice.mlab.com/path": "/foo/bar/buzz"}},
                    "spec": {"ports": [{"name": "http", "port": BUZZ_PORT, "protocol": "TCP"}]},
                }))?;
                server.apply_json(slice("foo", "buzz", "http", BUZZ_PORT, &addresses(buzz)))?;
                server.apply_json(json!({
                    "apiVersion": "v1", "kind": "Service",
                    "metadata": {"namespace": "foo", "name": "db"},
                    "spec": {"ports": [{"name": "tcp-db", "port": DB_PORT, "protocol": "TCP"}]},
                }))?;
                server.apply_json(slice("foo", "db", "tcp-db", DB_PORT, &addresses(db)))?;
                Ok(())
            }
        }
    }
}

fn slice(
    namespace: &str,
    service: &str,
    port_name: &str,
    port: u16,
    ips: &[Ipv4Addr],
) -> serde_json::Value {
    let endpoints: Vec<_> = ips
        .iter()
        .map(|ip| json!({"addresses": [ip.to_string()], "conditions": {"ready": true}}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": namespace, "name": format!("{service}-1"),
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": endpoints,
    })
}

/// A node with the agent, a client pod, three HTTP backends (b3 not in the mesh at first) and
/// a TCP echo. Fields drop top to bottom: the client's Envoy first, the node last.
struct Fixture {
    client: ClientPod,
    agent: Agent,
    source: Source,
    b1: Backend,
    b2: Backend,
    b3: Backend,
    echo: Backend,
    _node: Node,
}

impl Fixture {
    fn with_mesh_file(label: &str) -> Fixture {
        Fixture::build(label, |_| Ok(Source::File(MeshFile::new(&[])?)))
    }

    /// The fake API server runs on the node's loopback, where the agent's kube client reaches
    /// it through a kubeconfig.
    fn with_kubernetes(label: &str) -> Fixture {
        Fixture::build(label, |node| {
            let server = node.netns.enter(FakeApiServer::start)??;
            let dir = tempfile::tempdir()?;
            server.write_kubeconfig(&dir.path().join("kubeconfig"))?;
            Ok(Source::Kube { server, dir })
        })
    }

    fn build(label: &str, source: impl FnOnce(&Node) -> anyhow::Result<Source>) -> Fixture {
        let node = Node::new(label).unwrap();
        let b1 = node.http_backend("b1", 11, BUZZ_PORT).unwrap();
        let b2 = node.http_backend("b2", 12, BUZZ_PORT).unwrap();
        let b3 = node.http_backend("b3", 13, BUZZ_PORT).unwrap();
        let echo = node.tcp_echo("echo", 21, DB_PORT).unwrap();
        let source = source(&node).unwrap();
        source.set(&[&b1, &b2], &[&echo]).unwrap();
        let agent = source.agent(&node).unwrap();
        let client = node.client("client", 2).unwrap();
        let fixture = Fixture {
            client,
            agent,
            source,
            b1,
            b2,
            b3,
            echo,
            _node: node,
        };
        fixture.wait_envoy(&[&fixture.b1, &fixture.b2]);
        fixture
    }

    /// Waits until the client's Envoy has exactly `backends` for buzz (and the echo for db).
    fn wait_envoy(&self, backends: &[&Backend]) -> Duration {
        let start = Instant::now();
        let want: Vec<String> = {
            let mut want: Vec<String> = backends
                .iter()
                .map(|b| format!("{}:{BUZZ_PORT}", b.pod.address))
                .collect();
            want.sort();
            want
        };
        wait::until(
            "client Envoy endpoints for buzz",
            Duration::from_secs(30),
            || {
                let clusters = self.client.envoy_endpoints()?;
                let buzz = clusters.get(&format!("{BUZZ}|{BUZZ_PORT}"));
                let db = clusters.get(&format!("{DB}|{DB_PORT}"));
                let db_want = vec![format!("{}:{DB_PORT}", self.echo.pod.address)];
                if buzz == Some(&want) && db == Some(&db_want) {
                    Ok(())
                } else {
                    Err(format!("{clusters:?}"))
                }
            },
        )
        .unwrap_or_else(|e| panic!("{e}\nagent log:\n{}", self.agent.log()));
        start.elapsed()
    }

    fn buzz_url(&self) -> String {
        format!("http://{BUZZ}:{BUZZ_PORT}/")
    }

    fn shared(&self) -> SocketAddr {
        SocketAddr::from((SHARED, BUZZ_PORT))
    }

    fn host(&self) -> String {
        format!("{BUZZ}:{BUZZ_PORT}")
    }
}

/// (a) `curl http://buzz.bar.foo.system.internal:8080/` from the client pod: DNS gives the
/// shared address, and over repeated requests both backends answer.
fn http_by_name_reaches_both_backends(fx: &Fixture) {
    let answer = fx.client.dig(BUZZ).unwrap();
    assert_eq!(answer.status, "NOERROR", "{}", answer.text);
    assert_eq!(answer.addresses, [SHARED], "{}", answer.text);
    println!("(a) {BUZZ} A {SHARED} in {:?}", answer.took);

    let mut seen = BTreeSet::new();
    let mut requests = 0;
    wait::until(
        "both backends to answer curl",
        Duration::from_secs(20),
        || {
            requests += 1;
            let body = fx.client.curl(&fx.buzz_url())?;
            let identity = body.trim().to_string();
            if identity != "b1" && identity != "b2" {
                return Err(format!("unexpected answer {body:?}"));
            }
            seen.insert(identity);
            if seen.len() == 2 {
                Ok(())
            } else {
                Err(format!("seen {seen:?}"))
            }
        },
    )
    .unwrap();
    println!("(a) curl by name: both b1 and b2 answered within {requests} requests");
}

/// (b) The TCP service resolves to its own address from the block (not the shared one), and a
/// connection to it by that name reaches the echo.
fn tcp_by_name_on_its_own_address(fx: &Fixture) {
    let address = fx.client.resolve(DB).unwrap();
    assert_ne!(address, SHARED, "a TCP service needs its own address");
    assert_eq!(
        address.octets()[..2],
        [240, 240],
        "{address} not in the block"
    );
    let before = fx.echo.stats().served();
    let back = fx
        .client
        .tcp_exchange(SocketAddr::from((address, DB_PORT)), b"ping lattice\n")
        .unwrap();
    assert_eq!(back, b"ping lattice\n");
    assert_eq!(fx.echo.stats().served(), before + 1);
    println!("(b) {DB} A {address}; echo answered through Envoy");
}

/// (c) With requests flowing: remove b2 — within 1 s it gets no more requests, and no request
/// fails while it drains; add b3 — it gets traffic within 1 s.
fn backends_follow_the_mesh_without_failures(fx: &Fixture) {
    let load = fx.client.load(fx.shared(), &fx.host(), PACE);
    let (b1, b2) = (fx.b1.stats().served(), fx.b2.stats().served());
    wait::until("the stream to reach both", Duration::from_secs(10), || {
        if fx.b1.stats().served() > b1 + 5 && fx.b2.stats().served() > b2 + 5 {
            Ok(())
        } else {
            Err("not yet".into())
        }
    })
    .unwrap();

    fx.source.set(&[&fx.b1], &[&fx.echo]).unwrap();
    let removed_at = Instant::now();
    let envoy_took = fx.wait_envoy(&[&fx.b1]);
    // Keep the stream going past the bar, so a straggler would be seen.
    let b1_now = fx.b1.stats().served();
    wait::until(
        "more requests after the removal",
        Duration::from_secs(10),
        || {
            if removed_at.elapsed() > 2 * FOLLOW && fx.b1.stats().served() > b1_now + 20 {
                Ok(())
            } else {
                Err("not yet".into())
            }
        },
    )
    .unwrap();
    let last_b2 = fx.b2.stats().last().unwrap();
    let b2_after = last_b2.saturating_duration_since(removed_at);
    assert!(
        b2_after < FOLLOW,
        "b2 still got a request {b2_after:?} after its removal"
    );

    fx.source.set(&[&fx.b1, &fx.b3], &[&fx.echo]).unwrap();
    let added_at = Instant::now();
    let first_b3 = wait::until("b3 to get traffic", Duration::from_secs(10), || {
        fx.b3.stats().first().ok_or_else(|| "none yet".to_string())
    })
    .unwrap();
    let b3_after = first_b3.duration_since(added_at);
    assert!(
        b3_after < FOLLOW,
        "b3 got its first request {b3_after:?} after it was added"
    );

    let report = load.stop();
    report.assert_no_failures();
    println!(
        "(c) removal: Envoy had 1 endpoint after {envoy_took:?}, b2's last request {b2_after:?} \
         after the edit; addition: b3's first request {b3_after:?} after the edit; \
         {} requests, 0 failed, by backend {:?}",
        report.outcomes.len(),
        report.by_backend()
    );
}

#[test]
fn a_http_by_name_reaches_both_backends() {
    let _one = ONE_NODE.lock().unwrap_or_else(|p| p.into_inner());
    let mut fx = Fixture::with_mesh_file("dp-a");
    assert_eq!(
        fx.client.envoy_uid().unwrap(),
        1337,
        "Envoy must run as the proxy UID"
    );
    http_by_name_reaches_both_backends(&fx);
}

#[test]
fn b_tcp_service_by_name_on_its_own_address() {
    let _one = ONE_NODE.lock().unwrap_or_else(|p| p.into_inner());
    let fx = Fixture::with_mesh_file("dp-b");
    tcp_by_name_on_its_own_address(&fx);
}

#[test]
fn c_backend_removal_and_addition_follow_within_a_second_without_failures() {
    let _one = ONE_NODE.lock().unwrap_or_else(|p| p.into_inner());
    let fx = Fixture::with_mesh_file("dp-c");
    backends_follow_the_mesh_without_failures(&fx);
}

/// (d) Kill the agent while requests flow: Envoy keeps its config, so they keep succeeding.
/// Restart it: Envoy reconnects and follows the next mesh change.
#[test]
fn d_agent_crash_and_restart_keep_traffic_flowing() {
    let _one = ONE_NODE.lock().unwrap_or_else(|p| p.into_inner());
    let mut fx = Fixture::with_mesh_file("dp-d");
    let load = fx.client.load(fx.shared(), &fx.host(), PACE);

    fx.agent.kill();
    let killed_at = Instant::now();
    let served = |fx: &Fixture| fx.b1.stats().served() + fx.b2.stats().served();
    let before = served(&fx);
    wait::until(
        "requests served with the agent down",
        Duration::from_secs(20),
        || {
            if served(&fx) >= before + 100 {
                Ok(())
            } else {
                Err(format!("{} so far", served(&fx) - before))
            }
        },
    )
    .unwrap();
    let down_for = killed_at.elapsed();

    fx.agent.restart();
    fx.agent.wait_ready().unwrap();
    let restarted_at = Instant::now();
    fx.source.set(&[&fx.b2], &[&fx.echo]).unwrap();
    let converged = fx.wait_envoy(&[&fx.b2]);
    let b1_last = fx.b1.stats().last().unwrap();
    let b2_now = fx.b2.stats().served();
    wait::until("traffic after convergence", Duration::from_secs(10), || {
        if fx.b2.stats().served() > b2_now + 20 {
            Ok(())
        } else {
            Err("not yet".into())
        }
    })
    .unwrap();
    assert_eq!(
        fx.b1.stats().last().unwrap(),
        b1_last,
        "b1 still gets traffic"
    );

    let report = load.stop();
    report.assert_no_failures();
    println!(
        "(d) agent down {down_for:?} with {} requests served meanwhile; after restart Envoy \
         followed a mesh edit in {converged:?} (edit {:?} after ready); {} requests, 0 failed",
        served(&fx) - before,
        restarted_at.elapsed().saturating_sub(converged),
        report.outcomes.len()
    );
}

/// (e) An unknown mesh name is NXDOMAIN at once; a connection to a trapped address (or port)
/// nothing is assigned to ends at once, refused or reset, never hung.
#[test]
fn e_unknown_names_and_unassigned_addresses_fail_fast() {
    let _one = ONE_NODE.lock().unwrap_or_else(|p| p.into_inner());
    let fx = Fixture::with_mesh_file("dp-e");

    let answer = fx.client.dig("nosuch.foo.system.internal").unwrap();
    assert_eq!(answer.status, "NXDOMAIN", "{}", answer.text);
    assert!(answer.addresses.is_empty());
    assert!(answer.took < FOLLOW, "NXDOMAIN took {:?}", answer.took);
    let curl_start = Instant::now();
    let err = fx
        .client
        .curl("http://nosuch.foo.system.internal:8080/")
        .unwrap_err();
    let curl_took = curl_start.elapsed();
    assert!(err.contains("resolve"), "{err}");
    assert!(
        curl_took < Duration::from_secs(2),
        "curl took {curl_took:?}"
    );
    println!(
        "(e) NXDOMAIN in {:?} (dig process included); curl gave up in {curl_took:?}",
        answer.took
    );

    for target in [
        SocketAddr::from(([240, 240, 0, 200], BUZZ_PORT)),
        SocketAddr::from((SHARED, 9999)),
    ] {
        let start = Instant::now();
        let outcome = fx
            .client
            .tcp_exchange(target, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
        let took = start.elapsed();
        match &outcome {
            Ok(back) => assert!(back.is_empty(), "{target} answered {back:?}"),
            // Envoy closes at once: the write or the half-close may already see the reset.
            Err(err) => assert!(
                ["refused", "reset", "not connected", "Broken pipe"]
                    .iter()
                    .any(|sign| err.contains(sign)),
                "{target}: {err}"
            ),
        }
        assert!(took < FOLLOW, "{target} took {took:?} to fail");
        println!("(e) {target}: {outcome:?} after {took:?}");
    }

    // A name Envoy does not route on the shared address: an HTTP error, not a hang.
    let err = fx
        .client
        .http(fx.shared(), "nosuch.foo.system.internal:8080")
        .unwrap_err();
    assert!(err.contains("404"), "{err}");
}

/// (f) (a) to (c) with the Kubernetes source: the agent watches Services and EndpointSlices on
/// the fake API server.
#[test]
fn f_kubernetes_source_end_to_end() {
    let _one = ONE_NODE.lock().unwrap_or_else(|p| p.into_inner());
    let fx = Fixture::with_kubernetes("dp-f");
    http_by_name_reaches_both_backends(&fx);
    tcp_by_name_on_its_own_address(&fx);
    backends_follow_the_mesh_without_failures(&fx);
}
