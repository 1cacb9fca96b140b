//! Pods start after their proxy. On a simulated node with the real agent, real `lattice-init`
//! and a real Envoy in each client pod, an "app" that calls a mesh service at its first
//! instruction (curl by name, as the pod's first process would):
//!
//! - started the way the kubelet starts it behind the example's startup probe (Envoy started,
//!   the probe polled as the kubelet polls it, the app started once it passes), it succeeds,
//!   pod after pod;
//! - started without waiting for the probe while its Envoy has no configuration yet (the
//!   agent's xDS unreachable for that pod, DNS answering), it fails; and the readiness endpoint
//!   says so meanwhile, checked directly against Envoy (its server state is not LIVE). Once
//!   the proxy gets its configuration the probe passes and the same app succeeds.
//!
//! Build the binaries first: `cargo build --workspace --bins`.

use std::net::Ipv4Addr;
use std::time::Duration;

use lattice_e2e::node::{MeshFile, MeshService, Node, XDS};
use lattice_e2e::wait;

const BUZZ: &str = "buzz.bar.foo.system.internal";

/// The kubelet polls a startup probe every `periodSeconds` (the example's: 1 s); polling
/// faster only makes the test quicker, and cannot make an unready Envoy pass.
const PROBE_DEADLINE: Duration = Duration::from_secs(60);

#[test]
fn an_app_started_behind_the_startup_probe_reaches_the_mesh_at_its_first_request() {
    let node = Node::new("startup").unwrap();
    let backend = node.http_backend("buzz-1", 10, 8080).unwrap();
    let mesh = MeshFile::new(&[MeshService {
        path: "/foo/bar/buzz".into(),
        port: 8080,
        protocol: "http".into(),
        endpoints: vec![backend.pod.address],
    }])
    .unwrap();
    let _agent = node
        .agent(&["--mesh-file", mesh.path().to_str().unwrap()], &[])
        .unwrap();
    let url = format!("http://{BUZZ}:8080/");

    // Without the probe: the pod's Envoy cannot reach the agent's xDS yet (the node refuses
    // this pod's connections to it), so it has no configuration, while DNS answers.
    let late = Ipv4Addr::new(10, 200, 0, 30);
    let block = [
        "-I",
        "INPUT",
        "-s",
        &late.to_string(),
        "-p",
        "tcp",
        "--dport",
        &XDS.port().to_string(),
        "-j",
        "REJECT",
        "--reject-with",
        "tcp-reset",
    ];
    node.netns.exec("iptables", &block).unwrap();
    let unconfigured = node.client_starting("startup-late", 30).unwrap();
    let state = wait::until("Envoy's admin to answer", PROBE_DEADLINE, || {
        unconfigured.envoy_state()
    })
    .unwrap();
    assert_ne!(state, "LIVE", "Envoy cannot have its configuration yet");
    let probe = unconfigured.probe_ready(&node);
    assert!(
        probe.is_err(),
        "the readiness endpoint passed while Envoy is {state}: {probe:?}"
    );
    let resolved = unconfigured.resolve(BUZZ).unwrap();
    assert_eq!(resolved, Ipv4Addr::new(240, 240, 0, 1), "DNS answers");
    let early = unconfigured.curl(&url);
    assert!(
        early.is_err(),
        "an app started before its proxy had its configuration reached the mesh: {early:?}"
    );
    assert_ne!(
        unconfigured.envoy_state().unwrap(),
        "LIVE",
        "Envoy got its configuration during the request: the failure above proves nothing"
    );
    // The agent becomes reachable: the probe passes once Envoy is configured, then the app
    // succeeds.
    let unblock: Vec<&str> = std::iter::once("-D")
        .chain(block[1..].iter().copied())
        .collect();
    node.netns.exec("iptables", &unblock).unwrap();
    wait::until("the startup probe to pass", PROBE_DEADLINE, || {
        unconfigured.probe_ready(&node)
    })
    .unwrap();
    assert_eq!(unconfigured.envoy_state().unwrap(), "LIVE");
    assert_eq!(unconfigured.curl(&url).unwrap().trim(), "buzz-1");
    drop(unconfigured);

    // With the probe, as the kubelet runs the example's pod: Envoy starts, the probe is polled,
    // the app starts at the first pass and its first request must succeed. Pod after pod.
    for k in 0..5u8 {
        let client = node
            .client_starting(&format!("startup-{k}"), 40 + k)
            .unwrap();
        let body = wait::until("the startup probe to pass", PROBE_DEADLINE, || {
            client.probe_ready(&node)
        })
        .unwrap();
        assert!(
            body.contains("LIVE"),
            "the admin's /ready through the endpoint: {body:?}"
        );
        let first = client.curl(&url);
        assert_eq!(
            first.as_deref().map(str::trim),
            Ok("buzz-1"),
            "pod {k}: the app's first request, right after the probe passed"
        );
    }
}

/// The readiness endpoint is the one admin page the pod's network sees: every other path, and
/// the admin's own paths, are 404 on it; the admin itself stays on loopback.
#[test]
fn the_readiness_endpoint_shows_nothing_else_of_the_admin() {
    let node = Node::new("readyonly").unwrap();
    let mesh = MeshFile::new(&[]).unwrap();
    let _agent = node
        .agent(&["--mesh-file", mesh.path().to_str().unwrap()], &[])
        .unwrap();
    let client = node.client("readyonly", 2).unwrap();
    wait::until("the readiness endpoint", PROBE_DEADLINE, || {
        client.probe_ready(&node)
    })
    .unwrap();
    let from_node = |path: &str| {
        let target = std::net::SocketAddr::from((
            client.pod.address,
            lattice_contract::ENVOY_READINESS_PORT,
        ));
        node.netns
            .enter(|| lattice_e2e::agent::http_get(target, path))
            .unwrap()
            .unwrap()
    };
    for path in [
        "/ready",
        "/config_dump",
        "/server_info",
        "/quitquitquit",
        "/",
    ] {
        let (status, body) = from_node(path);
        assert_eq!(
            status, 404,
            "{path} through the readiness endpoint: {body:.200}"
        );
    }
    let admin = std::net::SocketAddr::from((client.pod.address, 15000));
    let reached = node
        .netns
        .enter(|| std::net::TcpStream::connect_timeout(&admin, Duration::from_secs(1)))
        .unwrap();
    assert!(reached.is_err(), "Envoy's admin is reachable from the node");
}
