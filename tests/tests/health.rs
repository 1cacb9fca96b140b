//! Health and failover proven with traffic, for both sources: the policy written as a mesh
//! file's `health:` block, and as the same block in a Service's `lattice.mlab.com/health`
//! annotation served by the fake API server to the agent's real kube client. Requests come from
//! an app in a client pod through a real Envoy and are counted at the backends.
//!
//! What fails when the feature breaks:
//! - active checks: one of two backends starts failing `GET /healthz`; no request reaches it
//!   later than interval × unhealthy threshold + 1 s after that; when it passes again it gets
//!   traffic again;
//! - outlier detection: a backend that answers 503 to everything is ejected after the configured
//!   count of consecutive errors, under load from parallel clients: at most that count plus the
//!   requests in flight fail, against about half without it.
//!
//! Build the binaries first: `cargo build --workspace --bins`.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lattice_e2e::mesh_source::MeshSource as Source;
use lattice_e2e::node::{Backend, Behaviour, ClientPod, Node, Request};
use lattice_e2e::wait;
use serde_json::{Value, json};

/// One topology at a time: two cores are shared by every Envoy and agent of a test.
static ONE_NODE: Mutex<()> = Mutex::new(());

const PORT: u16 = 8080;
const SHARED: Ipv4Addr = Ipv4Addr::new(240, 240, 0, 1);
const CHECK_INTERVAL: Duration = Duration::from_millis(500);
const UNHEALTHY_THRESHOLD: u32 = 2;
const CONSECUTIVE_5XX: usize = 3;
const PARALLEL: usize = 4;
const SETTLE: Duration = Duration::from_secs(15);

/// `/shop/pair` checks its two backends actively (and does no outlier detection, so what is
/// seen is the active check's doing); `/shop/flaky` has one good and one failing backend and
/// outlier detection only.
fn policies() -> [(&'static str, Value); 2] {
    [
        (
            "pair",
            json!({
                "check": {"http": {"path": "/healthz"}, "interval": "500ms", "timeout": "250ms",
                          "healthyThreshold": 1, "unhealthyThreshold": UNHEALTHY_THRESHOLD},
                "outlier": {"enabled": false},
            }),
        ),
        (
            "flaky",
            json!({
                "outlier": {"consecutive5xx": CONSECUTIVE_5XX, "consecutiveGatewayErrors": CONSECUTIVE_5XX,
                            "ejectionTime": "1m", "maxEjectionPercent": 50},
            }),
        ),
    ]
}

/// The source, holding the services and their backends (`service → backends`) with their
/// policies.
fn start(node: &Node, kubernetes: bool, services: &[(&str, Vec<&Backend>)]) -> Source {
    let policies = policies();
    let policy = |name: &str| &policies.iter().find(|(n, _)| *n == name).unwrap().1;
    let source = Source::start(node, kubernetes).unwrap();
    match &source {
        Source::File(file) => {
            let services: Vec<Value> = services
                .iter()
                .map(|(name, backends)| {
                    json!({
                        "path": format!("/shop/{name}"),
                        "ports": [{"port": PORT, "protocol": "http"}],
                        "endpoints": backends.iter()
                            .map(|b| json!({"address": b.pod.address.to_string()}))
                            .collect::<Vec<_>>(),
                        "health": policy(name),
                    })
                })
                .collect();
            file.write_text(&serde_norway::to_string(&json!({ "services": services })).unwrap())
                .unwrap();
        }
        Source::Kube { server, .. } => {
            for (name, backends) in services {
                server
                    .apply_json(json!({
                        "apiVersion": "v1", "kind": "Service",
                        "metadata": {"namespace": "shop", "name": name,
                                     "annotations": {"lattice.mlab.com/health": policy(name).to_string()}},
                        "spec": {"ports": [{"name": "http", "port": PORT, "protocol": "TCP"}]},
                    }))
                    .unwrap();
                let endpoints: Vec<Value> = backends
                    .iter()
                    .map(|b| json!({"addresses": [b.pod.address.to_string()], "conditions": {"ready": true}}))
                    .collect();
                server
                    .apply_json(json!({
                        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                        "metadata": {"namespace": "shop", "name": format!("{name}-1"),
                                     "labels": {"kubernetes.io/service-name": name}},
                        "addressType": "IPv4",
                        "ports": [{"name": "http", "port": PORT, "protocol": "TCP"}],
                        "endpoints": endpoints,
                    }))
                    .unwrap();
            }
        }
    }
    source
}

fn source_name(source: &Source) -> &'static str {
    match source {
        Source::File(_) => "mesh file",
        Source::Kube { .. } => "Service annotation",
    }
}

fn shared() -> SocketAddr {
    SocketAddr::from((SHARED, PORT))
}

fn host(service: &str) -> String {
    format!("{service}.shop.system.internal:{PORT}")
}

/// Requests to `service` until each of `backends` has answered one.
fn until_all_serve(client: &ClientPod, service: &str, backends: &[&Backend]) {
    wait::until(
        &format!("every backend of {service} to get traffic"),
        SETTLE,
        || {
            let before: Vec<u64> = backends.iter().map(|b| b.stats().served()).collect();
            for _ in 0..8 {
                let _ = client.http(shared(), &host(service));
            }
            let idle: Vec<&str> = backends
                .iter()
                .zip(before)
                .filter(|(b, before)| b.stats().served() == *before)
                .map(|(b, _)| b.identity.as_str())
                .collect();
            if idle.is_empty() {
                Ok(())
            } else {
                Err(format!("no traffic at {idle:?}"))
            }
        },
    )
    .unwrap();
}

fn health_and_failover(kubernetes: bool) {
    let _one = ONE_NODE.lock().unwrap_or_else(|p| p.into_inner());
    let node = Node::new(if kubernetes { "hlk" } else { "hlf" }).unwrap();
    let a = node.http_backend("pair-a", 21, PORT).unwrap();
    let b = node.http_backend("pair-b", 22, PORT).unwrap();
    let good = node.http_backend("good", 23, PORT).unwrap();
    let bad = node
        .http_backend_with("bad", 24, PORT, Behaviour::Fail)
        .unwrap();
    let source = start(
        &node,
        kubernetes,
        &[("pair", vec![&a, &b]), ("flaky", vec![&good, &bad])],
    );
    let which = source_name(&source);
    let _agent = source.agent(&node).unwrap();
    let client = node.client("client", 2).unwrap();

    // Active checks: b starts failing its check, and soon gets no traffic at all.
    until_all_serve(&client, "pair", &[&a, &b]);
    let load = client.load(shared(), &host("pair"), Duration::from_millis(10));
    let failed_at = Instant::now();
    b.set_healthy(false);
    let bound = CHECK_INTERVAL * UNHEALTHY_THRESHOLD + Duration::from_secs(1);
    // Keep the load on past the bound, so late requests to b would be seen.
    wait::until("the load to run past the bound", bound * 3, || {
        (failed_at.elapsed() >= bound + Duration::from_secs(2))
            .then_some(())
            .ok_or_else(|| "running".to_string())
    })
    .unwrap();
    let report = load.stop();
    report.assert_no_failures();
    let last = b.stats().last().unwrap();
    let late = last.saturating_duration_since(failed_at);
    println!(
        "{which}: the last request reached the failing backend {late:?} after its check failed (bound {bound:?})"
    );
    assert!(
        last <= failed_at + bound,
        "{which}: b got a request {late:?} after its check started failing, past {bound:?}"
    );
    let by_backend = report.by_backend();
    assert!(
        by_backend.get("pair-a").copied().unwrap_or(0) > 100,
        "{which}: {by_backend:?}"
    );
    // It passes again: it gets traffic again.
    b.set_healthy(true);
    until_all_serve(&client, "pair", &[&a, &b]);

    // Outlier detection: parallel clients against a pair with one backend that always fails.
    // No request goes there before the load (it would be ejected already): wait until Envoy
    // holds both endpoints instead.
    let cluster = format!("flaky.shop.system.internal|{PORT}");
    wait::until("Envoy to hold flaky's two endpoints", SETTLE, || {
        let endpoints = client.envoy_endpoints()?;
        match endpoints.get(&cluster) {
            Some(held) if held.len() == 2 => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .unwrap();
    let replies = client.requests(shared(), &host("flaky"), &Request::get("/"), 200, PARALLEL);
    let failed = replies
        .iter()
        .filter(|r| !matches!(r, Ok(reply) if reply.status == 200))
        .count();
    let bad_served = bad.stats().served();
    println!(
        "{which}: {failed} of 200 requests failed; the failing backend served {bad_served} before it was ejected"
    );
    assert!(
        bad_served >= 1 && failed >= 1,
        "{which}: the failing backend was never tried, so nothing was proven"
    );
    // Envoy ejects on its main thread: a worker reports the errors, and until the ejection
    // reaches the workers each client may be routed there once more (a failure returns at
    // once). So up to the errors that trigger it, plus two rounds of the parallel clients
    // (one in flight, one routed meanwhile); without ejection it would be about half of 200.
    // Seen: 3-5 on a quiet machine, 8 on a busy one.
    let most = CONSECUTIVE_5XX + 2 * PARALLEL;
    assert!(
        failed <= most && bad_served as usize <= most,
        "{which}: {failed} failures, {bad_served} requests at the failing backend: more than \
         {CONSECUTIVE_5XX} consecutive errors plus two rounds of {PARALLEL} clients"
    );
    for reply in replies.iter().flatten().filter(|r| r.status == 200) {
        assert_eq!(reply.body.trim(), "good", "{which}");
    }
}

#[test]
fn health_from_the_mesh_file() {
    health_and_failover(false);
}

#[test]
fn health_from_a_service_annotation() {
    health_and_failover(true);
}
