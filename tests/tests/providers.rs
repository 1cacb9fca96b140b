//! Several providers, one catalog, proven with traffic: the agent reads the fake API server
//! (through its real kube client) and a mesh file at once, and one service gets its pods from
//! Kubernetes and a VM from the file. Requests come from an app in a client pod through a real
//! Envoy and are counted at the backends.
//!
//! What fails when the feature breaks:
//! - `/readyz` stays false, naming the Kubernetes provider, while the API server is down and
//!   the file is loaded; it turns true once both have synced;
//! - the service's three endpoints (two pods, one VM) all get traffic, and `/debug/mesh` names
//!   each endpoint's provider;
//! - editing the file to drop the VM takes it out of rotation, live;
//! - a file that defines the service with another port is reported as a conflict (on
//!   `/debug/mesh` and in `lattice_mesh_conflicts`) and does not disturb the Kubernetes
//!   endpoints, which keep following the cluster.
//!
//! Build the binaries first: `cargo build --workspace --bins`.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use lattice_e2e::agent::{Agent, AgentAddrs};
use lattice_e2e::fake_apiserver::FakeApiServer;
use lattice_e2e::node::{ADMIN, Backend, ClientPod, DNS, MeshFile, Node, XDS};
use lattice_e2e::{k8s_objects, wait};
use serde_json::{Value, json};

const PORT: u16 = 8080;
const SHARED: Ipv4Addr = Ipv4Addr::new(240, 240, 0, 1);
const HOST: &str = "web.shop.system.internal:8080";
const SETTLE: Duration = Duration::from_secs(20);

fn shared() -> SocketAddr {
    SocketAddr::from((SHARED, PORT))
}

/// The mesh file's view of `/shop/web`: the VM at `port`, or no endpoint.
fn file_text(vm: Option<&Backend>, port: u16) -> String {
    let endpoints: Vec<Value> = vm
        .iter()
        .map(|b| json!({"address": b.pod.address.to_string()}))
        .collect();
    let service = json!({
        "path": "/shop/web",
        "ports": [{"port": port, "protocol": "http", "targetPort": PORT}],
        "endpoints": endpoints,
    });
    serde_norway::to_string(&json!({ "services": [service] })).unwrap()
}

/// Kubernetes' view of `shop/web`: a Service on 8080 and one slice with `pods`.
fn apply_kube(server: &FakeApiServer, pods: &[&Backend]) {
    let ports = json!([{"name": "http", "port": PORT, "protocol": "TCP"}]);
    let addresses: Vec<String> = pods.iter().map(|b| b.pod.address.to_string()).collect();
    server
        .apply_json(k8s_objects::service("shop", "web", ports.clone()))
        .unwrap();
    server
        .apply_json(k8s_objects::slice(
            "shop",
            "web-1",
            "web",
            ports,
            k8s_objects::ready(&addresses),
        ))
        .unwrap();
}

/// Requests until each of `serving` has answered one; then a batch in which none of `idle`
/// answers.
fn traffic_reaches(client: &ClientPod, serving: &[&Backend], idle: &[&Backend]) {
    wait::until(
        "traffic to reach exactly the serving backends",
        SETTLE,
        || {
            let before: Vec<u64> = serving.iter().map(|b| b.stats().served()).collect();
            let idle_before: Vec<u64> = idle.iter().map(|b| b.stats().served()).collect();
            for _ in 0..12 {
                let _ = client.http(shared(), HOST);
            }
            let missed: Vec<&str> = serving
                .iter()
                .zip(before)
                .filter(|(b, before)| b.stats().served() == *before)
                .map(|(b, _)| b.identity.as_str())
                .collect();
            let stray: Vec<&str> = idle
                .iter()
                .zip(idle_before)
                .filter(|(b, before)| b.stats().served() != *before)
                .map(|(b, _)| b.identity.as_str())
                .collect();
            if missed.is_empty() && stray.is_empty() {
                Ok(())
            } else {
                Err(format!("no traffic at {missed:?}, traffic at {stray:?}"))
            }
        },
    )
    .unwrap();
}

/// `(address, provider)` of each endpoint of `/shop/web`'s port, from `/debug/mesh`.
fn endpoint_providers(agent: &Agent) -> Result<Vec<(String, String)>, String> {
    let mesh = agent.mesh().map_err(|e| e.to_string())?;
    let endpoints = mesh["services"]["/shop/web"]["ports"][0]["endpoints"]
        .as_array()
        .ok_or_else(|| format!("no /shop/web: {mesh}"))?
        .iter()
        .map(|e| {
            let address = e["address"].as_str().unwrap_or_default().to_string();
            (
                address,
                e["provider"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    Ok(endpoints)
}

#[test]
fn kubernetes_and_a_mesh_file_serve_one_service() {
    let node = Node::new("prov").unwrap();
    let pod_a = node.http_backend("pod-a", 21, PORT).unwrap();
    let pod_b = node.http_backend("pod-b", 22, PORT).unwrap();
    let vm = node.http_backend("vm", 23, PORT).unwrap();

    let server = node.netns.enter(FakeApiServer::start).unwrap().unwrap();
    let (_dir, kubeconfig) = server.kubeconfig_file().unwrap();
    apply_kube(&server, &[&pod_a, &pod_b]);
    let file = MeshFile::new(&[]).unwrap();
    file.write_text(&file_text(Some(&vm), PORT)).unwrap();
    let file_provider = format!("file:{}", file.path().display());

    // The API server is down: the file is loaded, and the agent waits for Kubernetes.
    // The fake API server listens on the node's loopback: stop and rebind it there.
    node.netns.enter(|| server.stop()).unwrap();
    let agent = Agent::start_in_netns(
        &node.netns,
        AgentAddrs {
            xds: XDS,
            dns: DNS,
            admin: ADMIN,
        },
        &[
            "--mesh-file",
            &file.path().to_string_lossy(),
            "--kubernetes",
        ],
        &[("KUBECONFIG", &kubeconfig)],
    );
    wait::until("the file provider to sync", SETTLE, || {
        let (status, body) = agent.get("/debug/mesh").map_err(|e| e.to_string())?;
        let view: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        let synced = |name: &str| {
            view["providers"]
                .as_array()
                .and_then(|p| p.iter().find(|p| p["name"] == name))
                .map(|p| p["synced"] == true)
        };
        match (status, synced(&file_provider), synced("kubernetes")) {
            (503, Some(true), Some(false)) => Ok(()),
            other => Err(format!("{other:?}: {body}")),
        }
    })
    .unwrap();
    let (status, body) = agent.get("/readyz").unwrap();
    assert_eq!(status, 503, "ready without Kubernetes: {body}");
    assert!(
        body.contains("provider kubernetes") && !body.contains("provider file:"),
        "{body}"
    );

    // Kubernetes comes up: ready, and the service has all three endpoints.
    node.netns.enter(|| server.restart()).unwrap().unwrap();
    agent
        .wait_ready()
        .unwrap_or_else(|e| panic!("{e}\nagent log:\n{}", agent.log()));
    let client = node.client("client", 2).unwrap();
    traffic_reaches(&client, &[&pod_a, &pod_b, &vm], &[]);
    let mut providers = endpoint_providers(&agent).unwrap();
    providers.sort();
    let at = |b: &Backend| format!("{}:{PORT}", b.pod.address);
    assert_eq!(
        providers,
        [
            (at(&pod_a), "kubernetes".to_string()),
            (at(&pod_b), "kubernetes".to_string()),
            (at(&vm), file_provider.clone()),
        ]
    );

    // The file drops the VM: out of rotation, live.
    file.write_text(&file_text(None, PORT)).unwrap();
    traffic_reaches(&client, &[&pod_a, &pod_b], &[&vm]);

    // The file puts the VM back on another port: a conflict, reported, and the Kubernetes
    // endpoints keep serving and keep following the cluster.
    file.write_text(&file_text(Some(&vm), 9090)).unwrap();
    wait::until("the conflict to be reported", SETTLE, || {
        let mesh = agent.mesh().map_err(|e| e.to_string())?;
        let conflict = mesh["conflicts"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["path"] == "/shop/web"))
            .ok_or_else(|| mesh["conflicts"].to_string())?;
        let refused = &conflict["refused"][0];
        if refused["provider"] == file_provider.as_str()
            && refused["reason"]
                .as_str()
                .is_some_and(|r| r.contains("9090"))
        {
            Ok(())
        } else {
            Err(conflict.to_string())
        }
    })
    .unwrap();
    let (_, metrics) = agent.get("/metrics").unwrap();
    assert!(
        metrics.lines().any(|l| l == "lattice_mesh_conflicts 1"),
        "{metrics}"
    );
    traffic_reaches(&client, &[&pod_a, &pod_b], &[&vm]);
    apply_kube(&server, &[&pod_a]);
    traffic_reaches(&client, &[&pod_a], &[&pod_b, &vm]);
}
