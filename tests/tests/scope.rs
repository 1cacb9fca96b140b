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
//!   endpoint versions on `/debug/xds`);
//! - after a kill -9 of the agent, the restarted agent gives each pod's Envoy (Delta and SotW)
//!   what it held: their clusters, polled throughout, never lack a service the pod resolved,
//!   and requests through them over kept-alive connections all succeed.
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

/// The services of `names` whose clusters the pod's Envoy lacks, if any (an admin query that
/// fails counts as lacking them all: Envoy itself is expected up throughout).
fn lacking(client: &ClientPod, names: &[String]) -> Vec<String> {
    match client.envoy_admin("/config_dump?resource=dynamic_active_clusters") {
        Ok(_) => {
            let held = clusters(client);
            names
                .iter()
                .filter(|n| !held.contains(&format!("{n}.shop")))
                .cloned()
                .collect()
        }
        Err(e) => vec![format!("admin: {e}")],
    }
}

/// kill -9 of the agent under scoped proxies, Delta and SotW, that resolved services before:
/// with the state directory the restarted agent gives each pod what it held, so their Envoys
/// never lose a cluster (their admin API polled throughout) and requests over kept-alive
/// connections through them all succeed. Fails when scopes live in memory only (every scoped
/// Envoy is told to drop what its pod resolved, then 404s).
#[test]
fn scoped_proxies_keep_what_they_resolved_across_an_agent_restart() {
    let node = Node::new("scr").unwrap();
    let web = node.http_backend("web", 11, PORT).unwrap();
    let server = node.netns.enter(FakeApiServer::start).unwrap().unwrap();
    let names: Vec<String> = (0..12).map(|i| format!("svc-{i}")).collect();
    for name in &names {
        service(&server, name, &[&web]);
    }
    server.apply_json(pod("client", 2, json!({}))).unwrap();
    server.apply_json(pod("peer", 4, json!({}))).unwrap();
    let (_dir, kubeconfig) = server.kubeconfig_file().unwrap();
    let state = tempfile::tempdir().unwrap();
    let state_dir = state.path().to_str().unwrap();
    let mut agent = node
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
                "--state-dir",
                state_dir,
            ],
            &[
                ("KUBECONFIG", kubeconfig.as_str()),
                ("NODE_NAME", NODE_NAME),
            ],
        )
        .unwrap();
    let client = node.client_of("client", 2, XDS, DNS).unwrap();
    let peer = node
        .client_with("peer", 4, (XDS, DNS), &["--xds-mode=sotw"])
        .unwrap();
    let (mine, theirs) = names.split_at(6);
    first_requests_succeed(&client, mine, "web");
    first_requests_succeed(&peer, theirs, "web");
    let target = |name: &str| {
        (
            SocketAddr::from((SHARED, PORT)),
            format!("{}:{PORT}", host(name)),
        )
    };
    let (to, at) = target(&mine[0]);
    let client_load = client.load_keepalive(to, &at, Duration::from_millis(5));
    let (to, at) = target(&theirs[0]);
    let peer_load = peer.load_keepalive(to, &at, Duration::from_millis(5));

    let watching = std::sync::atomic::AtomicBool::new(true);
    let (lost, polls) = std::thread::scope(|scope| {
        let watcher = scope.spawn(|| {
            let (mut lost, mut polls) = (Vec::new(), 0);
            while watching.load(std::sync::atomic::Ordering::Relaxed) {
                for (who, pod, held) in [("client", &client, mine), ("peer", &peer, theirs)] {
                    let missing = lacking(pod, held);
                    if !missing.is_empty() {
                        lost.push(format!("{who}: {missing:?}"));
                    }
                }
                polls += 1;
            }
            (lost, polls)
        });
        agent.restart();
        agent.wait_ready().unwrap();
        // Both proxies back on the restarted agent, in sync, and traffic through both since.
        wait::until("both proxies on the restarted agent", WITHIN, || {
            let (_, body) = agent.get("/debug/xds").map_err(|e| e.to_string())?;
            let proxies: Value = serde_json::from_str(&body).map_err(|e| e.to_string())?;
            let mut back: Vec<&str> = proxies
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p["node_id"].as_str())
                .collect();
            back.sort();
            (back == ["client.default", "peer.default"])
                .then_some(())
                .ok_or(body.clone())
        })
        .unwrap();
        let served = web.server.stats.served();
        wait::until("traffic after the restart", WITHIN, || {
            (web.server.stats.served() > served + 100)
                .then_some(())
                .ok_or_else(|| "not yet".to_string())
        })
        .unwrap();
        watching.store(false, std::sync::atomic::Ordering::Relaxed);
        watcher.join().unwrap()
    });
    let (client_report, peer_report) = (client_load.stop(), peer_load.stop());
    println!(
        "restart under scoped proxies: {polls} polls of both Envoys' clusters, {} lost; \
         {} + {} requests, {} + {} failed",
        lost.len(),
        client_report.outcomes.len(),
        peer_report.outcomes.len(),
        client_report.failures().len(),
        peer_report.failures().len()
    );
    assert!(
        lost.is_empty(),
        "clusters lost across the restart: {:?}",
        &lost[..lost.len().min(5)]
    );
    client_report.assert_no_failures();
    peer_report.assert_no_failures();
    assert_eq!(clusters(&client), names_of(mine));
    assert_eq!(clusters(&peer), names_of(theirs));
}

fn names_of(names: &[String]) -> BTreeSet<String> {
    names.iter().map(|n| format!("{n}.shop")).collect()
}
