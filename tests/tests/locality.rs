//! Locality proven with traffic, for both sources: a service with one backend in the agent's
//! zone and one in another, asking for `PreferSameZone` — in a mesh file (`trafficDistribution`,
//! endpoint `zone:`, the agent's zone from `--node-zone`), and from the fake API server (the
//! Service's `spec.trafficDistribution`, the EndpointSlice's `zone`, the agent's zone read from
//! its Node's `topology.kubernetes.io/zone` label with `--node-name`). Requests come from an
//! app in a client pod through a real Envoy and are counted at the backends.
//!
//! What fails when the feature breaks:
//! - preference: every request of a batch reaches the backend in the agent's zone (without
//!   priorities Envoy would spread them over both);
//! - failover: the local backend fails its health check, then drops off the network: each time
//!   every request soon reaches the remote backend, and none fails once it has;
//! - return: the local backend recovers and gets all the traffic again;
//! - an agent that cannot learn its zone (no Node, or no zone label) still gets ready, and says
//!   why on `/debug/mesh`.
//!
//! Build the binaries first: `cargo build --workspace --bins`.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Mutex;
use std::time::Duration;

use lattice_e2e::agent::Agent;
use lattice_e2e::fake_apiserver::FakeApiServer;
use lattice_e2e::mesh_source::MeshSource as Source;
use lattice_e2e::node::{Backend, ClientPod, Node};
use lattice_e2e::wait;
use serde_json::{Value, json};

/// One topology at a time: two cores are shared by every Envoy and agent of a test.
static ONE_NODE: Mutex<()> = Mutex::new(());

const PORT: u16 = 8080;
const SHARED: Ipv4Addr = Ipv4Addr::new(240, 240, 0, 1);
const HOST: &str = "web.loc.system.internal:8080";
const CLUSTER: &str = "web.loc.system.internal|8080";
const OWN_ZONE: &str = "zone-a";
const OTHER_ZONE: &str = "zone-b";
const NODE_NAME: &str = "loc-node";
/// Health checks every 500 ms, unhealthy after 2 failures: failover within a few seconds.
const FAILOVER: Duration = Duration::from_secs(15);
const BATCH: usize = 20;

fn health() -> Value {
    json!({
        "check": {"http": {"path": "/healthz"}, "interval": "500ms", "timeout": "250ms",
                  "healthyThreshold": 1, "unhealthyThreshold": 2},
    })
}

/// The source with `/loc/web`: `near` in this node's zone, `far` in another, PreferSameZone;
/// and the agent reading it.
fn start(node: &Node, kubernetes: bool, near: &Backend, far: &Backend) -> (Source, Vec<String>) {
    let source = Source::start(node, kubernetes).unwrap();
    let endpoint = |b: &Backend, zone: &str| (b.pod.address.to_string(), zone.to_string());
    let endpoints = [endpoint(near, OWN_ZONE), endpoint(far, OTHER_ZONE)];
    let args = match &source {
        Source::File(file) => {
            let service = json!({
                "path": "/loc/web",
                "ports": [{"port": PORT, "protocol": "http"}],
                "trafficDistribution": "PreferSameZone",
                "endpoints": endpoints.iter()
                    .map(|(ip, zone)| json!({"address": ip, "zone": zone}))
                    .collect::<Vec<_>>(),
                "health": health(),
            });
            file.write_text(&serde_norway::to_string(&json!({ "services": [service] })).unwrap())
                .unwrap();
            vec!["--node-zone".to_string(), OWN_ZONE.to_string()]
        }
        Source::Kube { server, .. } => {
            // This node, labelled with its zone; and the client's Pod on it, since a node name
            // turns on proxy identity checking.
            server
                .apply_json(json!({
                    "apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": NODE_NAME,
                                 "labels": {"topology.kubernetes.io/zone": OWN_ZONE}},
                }))
                .unwrap();
            server
                .apply_json(json!({
                    "apiVersion": "v1", "kind": "Pod",
                    // Its Envoy holds what the pod declares it uses (tests/scope.rs).
                    "metadata": {"namespace": "default", "name": "client",
                                 "annotations": {"lattice.mlab.com/uses": "/loc/web"}},
                    "spec": {"nodeName": NODE_NAME, "containers": [{"name": "app", "image": "app"}]},
                    "status": {"phase": "Running", "podIP": "10.200.0.2",
                               "podIPs": [{"ip": "10.200.0.2"}]},
                }))
                .unwrap();
            server
                .apply_json(json!({
                    "apiVersion": "v1", "kind": "Service",
                    "metadata": {"namespace": "loc", "name": "web",
                                 "annotations": {"lattice.mlab.com/health": health().to_string()}},
                    "spec": {"ports": [{"name": "http", "port": PORT, "protocol": "TCP"}],
                             "trafficDistribution": "PreferSameZone"},
                }))
                .unwrap();
            server
                .apply_json(json!({
                    "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                    "metadata": {"namespace": "loc", "name": "web-1",
                                 "labels": {"kubernetes.io/service-name": "web"}},
                    "addressType": "IPv4",
                    "ports": [{"name": "http", "port": PORT, "protocol": "TCP"}],
                    "endpoints": endpoints.iter()
                        .map(|(ip, zone)| json!({"addresses": [ip], "zone": zone,
                                                 "conditions": {"ready": true}}))
                        .collect::<Vec<_>>(),
                }))
                .unwrap();
            vec!["--node-name".to_string(), NODE_NAME.to_string()]
        }
    };
    (source, args)
}

fn shared() -> SocketAddr {
    SocketAddr::from((SHARED, PORT))
}

/// Who answered each of a batch of requests (`Err` for a failed one).
fn batch(client: &ClientPod) -> Vec<Result<String, String>> {
    (0..BATCH)
        .map(|_| {
            client
                .http(shared(), HOST)
                .map(|body| body.trim().to_string())
        })
        .collect()
}

/// Batches until one is answered by `backend` alone, within `within`.
fn until_all_reach(client: &ClientPod, backend: &str, within: Duration, what: &str) {
    wait::until(what, within, || {
        let answers = batch(client);
        if answers.iter().all(|a| a.as_deref() == Ok(backend)) {
            Ok(())
        } else {
            Err(format!("answers: {answers:?}"))
        }
    })
    .unwrap();
}

/// Envoy's view of `address` in the cluster: its priority and zone, from `/clusters`.
fn envoy_placement(client: &ClientPod, address: &str) -> Result<(String, String), String> {
    let body = client.envoy_admin("/clusters")?;
    let field = |name: &str| {
        let prefix = format!("{CLUSTER}::{address}:{PORT}::{name}::");
        body.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .map(str::to_string)
            .ok_or_else(|| format!("no {prefix} in /clusters"))
    };
    Ok((field("priority")?, field("zone")?))
}

fn prefers_its_zone_and_fails_over(kubernetes: bool) {
    let _one = ONE_NODE.lock().unwrap_or_else(|p| p.into_inner());
    let node = Node::new(if kubernetes { "lck" } else { "lcf" }).unwrap();
    let near = node.http_backend("near", 31, PORT).unwrap();
    let far = node.http_backend("far", 32, PORT).unwrap();
    let (source, args) = start(&node, kubernetes, &near, &far);
    let which = if kubernetes {
        "kubernetes"
    } else {
        "mesh file"
    };
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let agent = source.agent_with(&node, &args).unwrap();
    let client = node.client("client", 2).unwrap();

    // The agent knows its zone and the service's preference, and says so.
    let (_, mesh) = agent.get("/debug/mesh").unwrap();
    let mesh: Value = serde_json::from_str(&mesh).unwrap();
    assert_eq!(
        mesh["node"]["zone"], OWN_ZONE,
        "{which}: {:#}",
        mesh["node"]
    );
    let source_of_zone = if kubernetes { "node-label" } else { "flag" };
    assert_eq!(mesh["node"]["zone_source"], source_of_zone, "{which}");
    let web = mesh["services"]
        .as_object()
        .and_then(|s| {
            s.values()
                .find(|s| s["dns_name"] == "web.loc.system.internal")
        })
        .unwrap_or_else(|| panic!("{which}: no web in {mesh:#}"));
    assert_eq!(web["traffic_distribution"], "PreferSameZone", "{which}");

    // Envoy holds both endpoints, the near one first in priority, each with its zone.
    let (near_ip, far_ip) = (near.pod.address.to_string(), far.pod.address.to_string());
    wait::until("Envoy to place both endpoints", FAILOVER, || {
        let placed = (
            envoy_placement(&client, &near_ip)?,
            envoy_placement(&client, &far_ip)?,
        );
        let expected = (
            ("0".to_string(), OWN_ZONE.to_string()),
            ("1".to_string(), OTHER_ZONE.to_string()),
        );
        (placed == expected)
            .then_some(())
            .ok_or_else(|| format!("{placed:?}"))
    })
    .unwrap();

    // Every request stays in the zone: none reaches the far backend.
    until_all_reach(&client, "near", FAILOVER, "traffic to stay in the zone");
    let far_before = far.stats().served();
    for answer in batch(&client).into_iter().chain(batch(&client)) {
        assert_eq!(answer.as_deref(), Ok("near"), "{which}");
    }
    assert_eq!(far.stats().served(), far_before, "{which}: far got traffic");

    // The near backend fails its health check: traffic fails over to the other zone, and
    // comes back when it passes again.
    near.set_healthy(false);
    until_all_reach(&client, "far", FAILOVER, "failover when near is unhealthy");
    near.set_healthy(true);
    until_all_reach(
        &client,
        "near",
        FAILOVER,
        "traffic back when near is healthy",
    );

    // The near backend drops off the network (its pod's link goes down): failover again, and
    // back when it returns.
    near.pod.netns.ip(&["link", "set", "eth0", "down"]).unwrap();
    until_all_reach(&client, "far", FAILOVER, "failover when near is gone");
    for answer in batch(&client) {
        assert_eq!(answer.as_deref(), Ok("far"), "{which}: after failover");
    }
    near.pod.netns.ip(&["link", "set", "eth0", "up"]).unwrap();
    near.pod
        .netns
        .ip(&["route", "replace", "default", "via", "10.200.0.1"])
        .unwrap();
    until_all_reach(&client, "near", FAILOVER, "traffic back when near returns");
    println!("{which}: preferred the zone, failed over twice and came back");
}

#[test]
fn a_mesh_file_service_prefers_the_agents_zone_and_fails_over() {
    prefers_its_zone_and_fails_over(false);
}

#[test]
fn a_kubernetes_service_prefers_the_nodes_zone_and_fails_over() {
    prefers_its_zone_and_fails_over(true);
}

/// The agent's `node` on `/debug/mesh`.
fn node_view(agent: &Agent) -> Value {
    let (_, mesh) = agent.get("/debug/mesh").unwrap();
    serde_json::from_str::<Value>(&mesh).unwrap()["node"].clone()
}

#[test]
fn an_agent_that_cannot_learn_its_zone_serves_and_says_why() {
    let server = FakeApiServer::start().unwrap();
    let (_dir, kubeconfig) = server.kubeconfig_file().unwrap();
    let env = [
        ("KUBECONFIG", kubeconfig.as_str()),
        ("NODE_NAME", NODE_NAME),
    ];

    // No such Node: the get is refused for good (404), and the agent serves anyway.
    let agent = Agent::start_with_env(&[], &env);
    agent.wait_ready().unwrap();
    let node = node_view(&agent);
    assert_eq!(node["zone"], Value::Null, "{node:#}");
    assert_eq!(node["zone_source"], "unknown");
    let note = node["note"].as_str().unwrap_or_default();
    assert!(
        note.contains(&format!("cannot read node {NODE_NAME}")),
        "{note}"
    );
    assert!(agent.log().contains("cannot read node"), "{}", agent.log());
    drop(agent);

    // A Node without the zone label.
    server
        .apply_json(json!({"apiVersion": "v1", "kind": "Node",
                           "metadata": {"name": NODE_NAME, "labels": {"kubernetes.io/os": "linux"}}}))
        .unwrap();
    let agent = Agent::start_with_env(&[], &env);
    agent.wait_ready().unwrap();
    let note = node_view(&agent)["note"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        note.contains("has no topology.kubernetes.io/zone label"),
        "{note}"
    );
    // --node-zone wins over the Node.
    drop(agent);
    let agent = Agent::start_with_env(&["--node-zone", OWN_ZONE], &env);
    agent.wait_ready().unwrap();
    let node = node_view(&agent);
    assert_eq!(node["zone"], OWN_ZONE, "{node:#}");
    assert_eq!(node["zone_source"], "flag");
}
