//! Make before break, proven with a real Envoy:
//! - **remove then add, SotW**: a service goes and another comes while Envoy's endpoint
//!   request for the first edit is still on its way (a relay holds Envoy's side back, as a
//!   slow link would): Envoy gets the new service's endpoints at once. Fails when a stream
//!   counts what its client holds instead of knowing it (the new service's endpoints are then
//!   taken as held and never sent; Envoy warms the cluster for 15 s).
//! - **releases and a port change under keep-alive load**: five blue-green releases, each
//!   flipping the parent's route to the new version and deleting the old one in one edit, then
//!   a backend's port changed with the route that names it, in one edit, while an app in a
//!   mesh pod sends through one kept-alive connection: no request fails. Fails when a cluster
//!   goes before the route that names it does (Envoy answers 500, the route's
//!   cluster-not-found status), or a route names a cluster Envoy still warms.
//! - **a changed cluster, at once**: a service's cluster changes (its health check) while its
//!   endpoints do not, under keep-alive load, with Envoy on Delta and on SotW: the new cluster
//!   is active within a few seconds and no request fails. Envoy re-creates a changed cluster
//!   and keeps the old one serving until the new one has its endpoints, and acknowledges the
//!   clusters only then; fails when the endpoints wait for that acknowledgement (the new
//!   cluster then waits out Envoy's 15 s initial fetch timeout).
//!
//! Build the binaries first: `cargo build --workspace --bins`.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use lattice_e2e::ads_tap::AdsTap;
use lattice_e2e::agent::Agent;
use lattice_e2e::envoy::{AdsMode, Envoy};
use lattice_e2e::node::{Backend, ClientPod, MeshFile, Node};
use lattice_e2e::wait;

/// Envoy's outbound listener binds the same port in every test: one Envoy at a time.
static ENVOY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const PORT: u16 = 8080;
const SHARED: Ipv4Addr = Ipv4Addr::new(240, 240, 0, 1);
const WITHIN: Duration = Duration::from_secs(10);

fn cluster(name: &str, port: u16) -> String {
    format!("{name}.shop.system.internal|{port}")
}

/// A mesh file of HTTP services `/shop/<name>` on [`PORT`], each with one endpoint.
fn write_plain(path: &Path, services: &[(&str, &str)]) {
    let mut text = String::from("services:\n");
    for (name, endpoint) in services {
        text.push_str(&format!(
            "  - path: /shop/{name}\n    ports: [{{port: {PORT}, protocol: http}}]\n    \
             endpoints: [{{address: {endpoint}}}]\n"
        ));
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Envoy's mesh clusters and their endpoints.
fn mesh_clusters(envoy: &Envoy) -> Result<BTreeMap<String, Vec<String>>, String> {
    let mut clusters = envoy.cluster_endpoints()?;
    clusters.retain(|name, _| name.contains(".system.internal|"));
    Ok(clusters)
}

/// The version of the mesh snapshot the agent serves (`lattice_xds_snapshot_version`).
fn serving(agent: &Agent) -> u64 {
    let (_, metrics) = agent.get("/metrics").unwrap();
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("lattice_xds_snapshot_version "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_then_add_with_sotw_gives_envoy_the_new_endpoints_at_once() {
    let _one_envoy = ENVOY.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let mesh = dir.path().join("mesh.yaml");
    let (a, b, gone, new) = (
        ("a", "10.200.0.3"),
        ("b", "10.200.0.4"),
        ("gone", "10.200.0.5"),
        ("new", "10.200.0.6"),
    );
    write_plain(&mesh, &[a, b, gone]);
    let agent = Agent::start(&["--mesh-file", mesh.to_str().unwrap()]);
    agent.wait_ready().unwrap();
    let mut tap = AdsTap::start(agent.xds, AdsMode::Sotw).await.unwrap();
    let envoy = Envoy::start("remove-then-add", tap.addr, AdsMode::Sotw);
    envoy.wait_live().unwrap();
    let holding = |services: &[(&str, &str)]| -> BTreeMap<String, Vec<String>> {
        services
            .iter()
            .map(|(name, address)| (cluster(name, PORT), vec![format!("{address}:{PORT}")]))
            .collect()
    };
    let want = holding(&[a, b, gone]);
    wait::until("Envoy to hold a, b and gone", WITHIN, || {
        let got = mesh_clusters(&envoy)?;
        (got == want).then_some(()).ok_or(format!("{got:?}"))
    })
    .unwrap();

    // Envoy's side is held back: it gets what the agent sends, the agent hears nothing.
    tap.pause();
    let sent = tap.responses();
    write_plain(&mesh, &[a, b]);
    tap.answered(sent, WITHIN).await.unwrap();
    // Envoy has answered the removal (its endpoint request without `gone` among the answers);
    // the agent takes the next edit before it hears any of it.
    let removed = serving(&agent);
    write_plain(&mesh, &[a, b, new]);
    wait::until("the agent to serve the second edit", WITHIN, || {
        let now = serving(&agent);
        (now > removed)
            .then_some(())
            .ok_or(format!("serving {now}"))
    })
    .unwrap();
    tap.resume();

    // At once: well within Envoy's 15 s wait for the endpoints of a cluster it warms.
    let want = holding(&[a, b, new]);
    let took = std::time::Instant::now();
    wait::until("Envoy to hold a, b and new", Duration::from_secs(5), || {
        let got = mesh_clusters(&envoy)?;
        (got == want).then_some(()).ok_or(format!("{got:?}"))
    })
    .unwrap_or_else(|e| panic!("{e}\nagent log:\n{}", agent.log()));
    println!(
        "the new service's endpoints reached Envoy {:?} after the relay let it speak",
        took.elapsed()
    );
}

/// The services of the release test, as a mesh file: `web` (which the app calls) routes every
/// request to `target` (service, port); `versions` are its backends' services, each on a
/// backend pod's address; `api` serves on `api_port`, its pod listening on [`PORT`].
fn release_mesh(
    file: &MeshFile,
    backends: &BTreeMap<String, Backend>,
    versions: &[&str],
    target: (&str, u16),
    api_port: u16,
) {
    let address = |name: &str| backends[name].pod.address;
    let mut text = format!(
        "services:\n  - path: /shop/web\n    ports: [{{port: {PORT}, protocol: http}}]\n    \
         endpoints: [{{address: {}}}]\n    routes:\n      - backends: \
         [{{service: /shop/{}, port: {}}}]\n",
        address("web"),
        target.0,
        target.1
    );
    for version in versions {
        text.push_str(&format!(
            "  - path: /shop/{version}\n    ports: [{{port: {PORT}, protocol: http}}]\n    \
             endpoints: [{{address: {}}}]\n",
            address(version)
        ));
    }
    text.push_str(&format!(
        "  - path: /shop/api\n    ports: [{{port: {api_port}, protocol: http, targetPort: {PORT}}}]\n    \
         endpoints: [{{address: {}}}]\n",
        address("api")
    ));
    file.write_text(&text).unwrap();
}

/// Waits until the pod's Envoy holds exactly `clusters` of the mesh (by name).
fn envoy_holds(client: &ClientPod, clusters: &[String]) {
    let mut want: Vec<&str> = clusters.iter().map(String::as_str).collect();
    want.sort();
    wait::until("the pod's Envoy to hold the edit", WITHIN, || {
        let got = client.envoy_endpoints()?;
        let names: Vec<&str> = got.keys().map(String::as_str).collect();
        (names == want).then_some(()).ok_or(format!("{got:?}"))
    })
    .unwrap();
}

#[test]
fn releases_and_a_port_change_under_keepalive_load_fail_no_request() {
    let _one_envoy = ENVOY.blocking_lock();
    let node = Node::new("mbb").unwrap();
    let names = ["web", "api", "v1", "v2", "v3", "v4", "v5", "v6"];
    let backends: BTreeMap<String, Backend> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let host = 11 + u8::try_from(i).unwrap();
            (
                name.to_string(),
                node.http_backend(name, host, PORT).unwrap(),
            )
        })
        .collect();
    let file = MeshFile::new(&[]).unwrap();
    release_mesh(&file, &backends, &["v1"], ("v1", PORT), PORT);
    let path = file.path().to_string_lossy().into_owned();
    let agent = node.agent(&["--mesh-file", &path], &[]).unwrap();
    let client = node.client("app", 2).unwrap();
    let on = |services: &[&str], api_port: u16| -> Vec<String> {
        let mut all: Vec<String> = services.iter().map(|s| cluster(s, PORT)).collect();
        all.push(cluster("api", api_port));
        all
    };
    envoy_holds(&client, &on(&["web", "v1"], PORT));
    let web = SocketAddr::from((SHARED, PORT));
    let host = format!("web.shop.system.internal:{PORT}");
    let load = client.load_keepalive(web, &host, Duration::from_millis(2));
    let reached = |identity: &str| {
        let backend = &backends[identity];
        let before = backend.server.stats.served();
        wait::until(&format!("the load to reach {identity}"), WITHIN, || {
            (backend.server.stats.served() > before + 20)
                .then_some(())
                .ok_or_else(|| "not yet".to_string())
        })
        .unwrap();
    };
    reached("v1");

    // Five releases: the new version comes beside the old, then one edit flips the route to
    // it and deletes the old.
    for k in 1..=5 {
        let (old, new) = (format!("v{k}"), format!("v{}", k + 1));
        release_mesh(&file, &backends, &[&old, &new], (&old, PORT), PORT);
        envoy_holds(&client, &on(&["web", &old, &new], PORT));
        release_mesh(&file, &backends, &[&new], (&new, PORT), PORT);
        envoy_holds(&client, &on(&["web", &new], PORT));
        reached(&new);
    }

    // The port change: the route moves to api on 9090 as api's port does, in one edit.
    release_mesh(&file, &backends, &["v6"], ("api", PORT), PORT);
    envoy_holds(&client, &on(&["web", "v6"], PORT));
    reached("api");
    release_mesh(&file, &backends, &["v6"], ("api", 9090), 9090);
    envoy_holds(&client, &on(&["web", "v6"], 9090));
    reached("api");

    let report = load.stop();
    let by_backend = report.by_backend();
    println!(
        "{} requests over kept-alive connections through 5 releases and a port change: {} \
         failed; by backend {by_backend:?}",
        report.outcomes.len(),
        report.failures().len()
    );
    report.assert_no_failures();
    drop(agent);
}

/// `/shop/web` with one endpoint and a TCP health check every `interval` seconds.
fn write_checked(path: &Path, backend: Ipv4Addr, interval: u32) {
    let text = format!(
        "services:\n  - path: /shop/web\n    ports:\n      - port: {PORT}\n        protocol: http\n    endpoints:\n      - address: {backend}\n    health:\n      check:\n        tcp: {{}}\n        interval: {interval}s\n"
    );
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[test]
fn a_changed_cluster_takes_effect_at_once_and_fails_no_request() {
    let _one_envoy = ENVOY.blocking_lock();
    let node = Node::new("recreate").unwrap();
    let backend = node.http_backend("web", 11, PORT).unwrap();
    let file = MeshFile::new(&[]).unwrap();
    write_checked(file.path(), backend.pod.address, 5);
    let path = file.path().to_string_lossy().into_owned();
    let agent = node.agent(&["--mesh-file", &path], &[]).unwrap();
    let web = SocketAddr::from((SHARED, PORT));
    let host = format!("web.shop.system.internal:{PORT}");
    let mut interval = 5;
    for (mode, at) in [("delta", 2), ("sotw", 3)] {
        let client = node
            .client_with(
                mode,
                at,
                (lattice_e2e::node::XDS, lattice_e2e::node::DNS),
                &[&format!("--xds-mode={mode}")],
            )
            .unwrap();
        envoy_holds(&client, &[cluster("web", PORT)]);
        let load = client.load_keepalive(web, &host, Duration::from_millis(2));
        for _ in 0..2 {
            let before = backend.server.stats.served();
            wait::until("the load to reach web", WITHIN, || {
                (backend.server.stats.served() > before + 20)
                    .then_some(())
                    .ok_or_else(|| "not yet".to_string())
            })
            .unwrap();
            interval += 1;
            write_checked(file.path(), backend.pod.address, interval);
            // Well under Envoy's 15 s initial fetch timeout, which a change would otherwise
            // wait out.
            let active = format!("\"interval\": \"{interval}s\"");
            wait::until(
                &format!("{mode}: the cluster checking every {interval}s active"),
                Duration::from_secs(5),
                || {
                    let dump =
                        client.envoy_admin("/config_dump?resource=dynamic_active_clusters")?;
                    dump.contains(&active)
                        .then_some(())
                        .ok_or_else(|| "not yet".to_string())
                },
            )
            .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
        }
        let report = load.stop();
        println!(
            "{mode}: {} requests while the cluster changed twice: {} failed",
            report.outcomes.len(),
            report.failures().len()
        );
        assert!(!report.outcomes.is_empty());
        report.assert_no_failures();
    }
}
