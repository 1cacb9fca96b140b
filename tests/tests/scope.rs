//! Each Envoy holds only what its pod uses: the agent runs as the DaemonSet runs it (xDS and
//! DNS on the node-local address, `NODE_NAME` set, Kubernetes from the fake API server, which
//! serves this node's Pods), and the client pods are real network namespaces with a real Envoy
//! set up by `lattice-init`.
//!
//! What fails when the feature breaks:
//! - a pod that resolves a name it never used before and sends one request at once (no retry)
//!   gets an answer, 100 times in a row with fresh names, through a Delta and a SotW Envoy:
//!   the DNS answer waits until the pod's Envoy holds the service;
//! - that Envoy holds the clusters of what its pod resolved, of what its annotation declares
//!   and of a mesh-file service whose `clients:` name the pod, and no other service's;
//! - an endpoint change reaches the proxies that hold the service and no other (their ACKed
//!   endpoint versions on `/debug/xds`).
//!
//! Build the binaries first: `cargo build --workspace --bins`.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use lattice_e2e::agent::{Agent, AgentAddrs};
use lattice_e2e::fake_apiserver::FakeApiServer;
use lattice_e2e::node::{ADMIN, Backend, ClientPod, Node};
use lattice_e2e::wait;
use serde_json::{Value, json};

const NODE_LOCAL: Ipv4Addr = Ipv4Addr::new(169, 254, 20, 10);
const XDS: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(NODE_LOCAL), 15010);
const DNS: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(NODE_LOCAL), 53);
const SHARED: Ipv4Addr = Ipv4Addr::new(240, 240, 0, 1);
const PORT: u16 = 8080;
const NODE_NAME: &str = "node-a";
const WITHIN: Duration = Duration::from_secs(15);
/// Fresh names each client resolves and calls at once.
const FRESH: usize = 100;

fn pod(name: &str, host: u8, annotations: Value) -> Value {
    let ip = Ipv4Addr::new(10, 200, 0, host).to_string();
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"namespace": "default", "name": name, "annotations": annotations},
           "spec": {"nodeName": NODE_NAME, "containers": [{"name": "app", "image": "app"}]},
           "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}})
}

/// `shop/<name>` on port 8080, its endpoints `backends`.
fn service(server: &FakeApiServer, name: &str, backends: &[&Backend]) {
    server
        .apply_json(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": "shop", "name": name},
            "spec": {"ports": [{"name": "http", "port": PORT, "protocol": "TCP"}]},
        }))
        .unwrap();
    endpoints(server, name, backends);
}

fn endpoints(server: &FakeApiServer, name: &str, backends: &[&Backend]) {
    server
        .apply_json(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": "shop", "name": format!("{name}-1"),
                         "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": PORT, "protocol": "TCP"}],
            "endpoints": backends.iter()
                .map(|b| json!({"addresses": [b.pod.address.to_string()], "conditions": {"ready": true}}))
                .collect::<Vec<_>>(),
        }))
        .unwrap();
}

fn host(name: &str) -> String {
    format!("{name}.shop.system.internal")
}

/// The mesh services whose clusters the pod's Envoy holds (`svc-1.shop` for
/// `svc-1.shop.system.internal|8080`).
fn clusters(client: &ClientPod) -> BTreeSet<String> {
    let dump = client
        .envoy_admin("/config_dump?resource=dynamic_active_clusters")
        .unwrap();
    let dump: Value = serde_json::from_str(&dump).unwrap();
    dump["configs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["cluster"]["name"].as_str())
        .filter_map(|name| name.strip_suffix(&format!(".system.internal|{PORT}")))
        .map(str::to_string)
        .collect()
}

/// The endpoint version each connected proxy has ACKed, by node id.
fn eds_acked(agent: &Agent) -> Vec<(String, String)> {
    let (_, body) = agent.get("/debug/xds").unwrap();
    let proxies: Value = serde_json::from_str(&body).unwrap();
    let mut acked: Vec<(String, String)> = proxies
        .as_array()
        .or_else(|| proxies["proxies"].as_array())
        .into_iter()
        .flatten()
        .map(|p| {
            (
                p["node_id"].as_str().unwrap_or_default().to_string(),
                p["acked"]["eds"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    acked.sort();
    acked
}

/// Resolves each fresh name and sends one request to it at once: every one must be answered
/// by `expected`.
fn first_requests_succeed(client: &ClientPod, names: &[String], expected: &str) {
    let mut failures = Vec::new();
    for name in names {
        let ip = match client.resolve(&host(name)) {
            Ok(ip) => ip,
            Err(e) => {
                failures.push(format!("{name}: resolving: {e}"));
                continue;
            }
        };
        assert_eq!(ip, SHARED, "{name}");
        match client.http(
            SocketAddr::from((ip, PORT)),
            &format!("{}:{PORT}", host(name)),
        ) {
            Ok(body) if body.trim() == expected => {}
            other => failures.push(format!("{name}: {other:?}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} first requests failed, the first: {:?}",
        failures.len(),
        names.len(),
        &failures[..failures.len().min(3)]
    );
}

#[test]
fn each_envoy_holds_what_its_pod_uses_and_a_first_request_finds_it() {
    let node = Node::new("scp").unwrap();
    let web = node.http_backend("web", 11, PORT).unwrap();
    let other = node.http_backend("other", 12, PORT).unwrap();
    let moved = node.http_backend("moved", 13, PORT).unwrap();
    let server = node.netns.enter(FakeApiServer::start).unwrap().unwrap();
    let fresh: Vec<String> = (0..2 * FRESH).map(|i| format!("svc-{i}")).collect();
    for name in &fresh {
        service(&server, name, &[&web]);
    }
    service(&server, "declared", &[&web]);
    service(&server, "other", &[&other]);
    server
        .apply_json(pod(
            "client",
            2,
            json!({"lattice.mlab.com/uses": "/shop/declared"}),
        ))
        .unwrap();
    server.apply_json(pod("peer", 4, json!({}))).unwrap();
    let (_dir, kubeconfig) = server.kubeconfig_file().unwrap();
    // A VM service beside the cluster, which names the client pods as its clients.
    let files = tempfile::tempdir().unwrap();
    let mesh_file = files.path().join("mesh.yaml");
    std::fs::write(
        &mesh_file,
        format!(
            "services:\n- path: /vm/legacy\n  ports: [{{port: {PORT}, protocol: http}}]\n  \
             endpoints: [{{address: {}}}]\n  clients: [default/cli*]\n",
            web.pod.address
        ),
    )
    .unwrap();
    let mesh_file = mesh_file.to_str().unwrap();
    let agent = node
        .agent_at(
            AgentAddrs {
                xds: XDS,
                dns: DNS,
                admin: ADMIN,
            },
            &[
                "--node-local-dns",
                &NODE_LOCAL.to_string(),
                "--kubernetes",
                "--mesh-file",
                mesh_file,
            ],
            &[
                ("KUBECONFIG", kubeconfig.as_str()),
                ("NODE_NAME", NODE_NAME),
            ],
        )
        .unwrap();

    // A Delta Envoy and a SotW one; each starts with what its pod declares, nothing else.
    let client = node.client_of("client", 2, XDS, DNS).unwrap();
    let peer = node
        .client_with("peer", 4, (XDS, DNS), &["--xds-mode=sotw"])
        .unwrap();
    let shop = |names: &[String]| -> BTreeSet<String> {
        names.iter().map(|n| format!("{n}.shop")).collect()
    };
    let declared: BTreeSet<String> = ["declared.shop", "legacy.vm"].map(String::from).into();
    assert_eq!(clusters(&client), declared);
    assert_eq!(clusters(&peer), BTreeSet::new());

    // Fresh names, each resolved and called at once.
    first_requests_succeed(&client, &fresh[..FRESH], "web");
    first_requests_succeed(&peer, &fresh[FRESH..], "web");
    let expected: BTreeSet<String> = &shop(&fresh[..FRESH]) | &declared;
    assert_eq!(clusters(&client), expected, "the client's Envoy");
    assert_eq!(clusters(&peer), shop(&fresh[FRESH..]), "the peer's Envoy");
    let (_, metrics) = agent.get("/metrics").unwrap();
    println!(
        "{}",
        metrics
            .lines()
            .filter(|l| l.starts_with("lattice_scope_"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    // The peer uses `other` too; an endpoint change of `other` reaches it and not the client.
    first_requests_succeed(&peer, &["other".to_string()], "other");
    let before = eds_acked(&agent);
    endpoints(&server, "other", &[&moved]);
    wait::until(
        "other's new endpoint through the peer",
        WITHIN,
        || match peer.http(
            SocketAddr::from((SHARED, PORT)),
            &format!("{}:{PORT}", host("other")),
        ) {
            Ok(body) if body.trim() == "moved" => Ok(()),
            other => Err(format!("{other:?}")),
        },
    )
    .unwrap();
    let after = eds_acked(&agent);
    let changed: Vec<&str> = before
        .iter()
        .zip(&after)
        .filter(|(b, a)| b != a)
        .map(|(b, _)| b.0.as_str())
        .collect();
    assert_eq!(
        changed,
        ["peer.default"],
        "before {before:?}, after {after:?}"
    );
    assert!(!clusters(&client).contains("other.shop"));
}
