//! Workload certificates over SDS: the agent runs as the DaemonSet runs it (node-local address,
//! `NODE_NAME`, Kubernetes from the fake API server with this node's Pods and the CA's
//! Secret), and a real Envoy in a pod's network namespace asks for its secrets over its ADS
//! stream, as a TLS listener of its own names them (`default`, `ROOTCA`).
//!
//! What fails when the feature breaks:
//! - the pod's Envoy serves TLS with a leaf whose only URI SAN is its pod's service account's
//!   SPIFFE ID, and that leaf verifies against the CA's bundle (checked with openssl);
//! - another pod of the node asking for `default` over a stream of its own gets its own
//!   identity's leaf, never the first pod's; once a second pod is listed at its address (one
//!   that went, not yet gone from the list), a stream from there gets no secret, as either;
//! - a new issuer in the CA's Secret reaches the running Envoy: it serves a leaf the new CA
//!   verifies, with no restart;
//! - `/debug/identity` lists each identity's leaf, `/debug/xds` each proxy's identity, and
//!   neither shows a key;
//! - with leaves of a minute, the pod's Envoy serves a renewed leaf before the first one ends,
//!   and no TLS handshake made meanwhile (one every 200 ms) fails;
//! - with Istio's certificate service as the signer (the in-repo server of its API, in the
//!   node's namespace): the pod's Envoy serves a leaf the service issued (its serial), that
//!   verifies against the service's roots and not the Secret's CA; a pod whose identity the
//!   service does not place on the node is refused there, gets no leaf, and the refusal is
//!   counted; `/debug/identity` names the backend;
//! - an outage of that service for twice the leaf's life (leaves of a minute): every handshake
//!   a peer makes, checking the leaf against the roots, passes until a second before the leaf
//!   ends; the failed renewals are counted before it ends; once the service is back, a new
//!   leaf is served (within the agent's longest backoff, a minute).
//!
//! Build the binaries first: `cargo build --workspace --bins`.

use std::net::Ipv4Addr;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{Node as EnvoyNode, data_source};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{Secret, secret};
use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
use lattice_e2e::ads_probe::first_delta_answer;
use lattice_e2e::agent::AgentAddrs;
use lattice_e2e::fake_apiserver::FakeApiServer;
use lattice_e2e::istio_ca::IstioCaServer;
use lattice_e2e::netns::Netns;
use lattice_e2e::node::{ADMIN, Node};
use lattice_e2e::trusted::{DNS, NODE_LOCAL, XDS, ca_secret, openssl};
use lattice_e2e::wait;
use lattice_inject::certs::Chain;
use prost::Message;
use serde_json::{Value, json};

const SECRETS: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
const PROBE_PORT: u16 = 15443;
const WITHIN: Duration = Duration::from_secs(20);

fn pod(name: &str, account: Option<&str>, ip: Ipv4Addr) -> Value {
    let mut spec = json!({"nodeName": "node-a", "containers": [{"name": "app", "image": "app"}]});
    if let Some(account) = account {
        spec["serviceAccountName"] = json!(account);
    }
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"namespace": "default", "name": name},
           "spec": spec,
           "status": {"phase": "Running", "podIP": ip.to_string(),
                      "podIPs": [{"ip": ip.to_string()}]}})
}

/// A TLS listener on the pod's loopback whose certificate and trusted CAs are the SDS secrets
/// `default` and `ROOTCA`, fetched over ADS: what a mesh listener will name.
fn add_tls_listener(bootstrap: &mut Value) {
    let over_ads =
        |name: &str| json!({"name": name, "sds_config": {"ads": {}, "resource_api_version": "V3"}});
    let listener = json!({
        "name": "sds-probe",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": PROBE_PORT}},
        "filter_chains": [{
            // HTTP, whose connection manager waits for a request: the handshake completes
            // first (a filter that answers on connect would close before it does).
            "filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                    "stat_prefix": "sds_probe",
                    "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
                    "route_config": {"virtual_hosts": [{"name": "probe", "domains": ["*"],
                        "routes": [{"match": {"prefix": "/"},
                                    "direct_response": {"status": 200, "body": {"inline_string": "over TLS"}}}]}]}
                }
            }],
            "transport_socket": {
                "name": "envoy.transport_sockets.tls",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                    "common_tls_context": {
                        "tls_certificate_sds_secret_configs": [over_ads("default")],
                        "validation_context_sds_secret_config": over_ads("ROOTCA")
                    }
                }
            }
        }]
    });
    let listeners = &mut bootstrap["static_resources"]["listeners"];
    match listeners.as_array_mut() {
        Some(list) => list.push(listener),
        None => *listeners = json!([listener]),
    }
}

/// The PEM blocks of `text`, in order.
fn certificates(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("-----BEGIN CERTIFICATE-----") {
        let end_marker = "-----END CERTIFICATE-----";
        let Some(end) = rest[start..].find(end_marker) else {
            break;
        };
        let end = start + end + end_marker.len();
        out.push(format!("{}\n", &rest[start..end]));
        rest = &rest[end..];
    }
    out
}

/// The URI SANs of a PEM certificate.
fn uri_sans(netns: &Netns, pem: &str) -> Vec<String> {
    let text = openssl(netns, &["x509", "-noout", "-ext", "subjectAltName"], pem).unwrap();
    text.split([',', '\n'])
        .filter_map(|part| part.trim().strip_prefix("URI:").map(str::to_string))
        .collect()
}

/// A Delta ADS stream from inside `netns` as `node_id` that subscribes to the secret
/// `default`: the first certificate chain it is sent.
fn workload_secret(netns: &Netns, node_id: &str) -> Result<String, String> {
    let request = DeltaDiscoveryRequest {
        node: Some(EnvoyNode {
            id: node_id.to_string(),
            ..EnvoyNode::default()
        }),
        type_url: SECRETS.to_string(),
        resource_names_subscribe: vec!["default".to_string()],
        ..DeltaDiscoveryRequest::default()
    };
    let response = first_delta_answer(netns, XDS, request).map_err(|e| e.to_string())?;
    let resource = response
        .resources
        .iter()
        .find(|r| r.name == "default")
        .ok_or_else(|| format!("no `default` in {response:?}"))?;
    let body = resource.resource.as_ref().ok_or("no body")?;
    let secret = Secret::decode(body.value.as_slice()).map_err(|e| e.to_string())?;
    match secret.r#type {
        Some(secret::Type::TlsCertificate(tls)) => {
            match tls.certificate_chain.and_then(|c| c.specifier) {
                Some(data_source::Specifier::InlineString(pem)) => Ok(pem),
                other => Err(format!("chain {other:?}")),
            }
        }
        other => Err(format!("not a certificate: {other:?}")),
    }
}

/// The node: the fake API server with the CA's Secret and two pods of node-a (`client` as
/// service account `cart`, `batch` as none), and the agent as the DaemonSet runs it with
/// `args`.
struct Setup {
    node: Node,
    server: FakeApiServer,
    chain: Chain,
    agent: lattice_e2e::agent::Agent,
    _kubeconfig: tempfile::TempDir,
}

fn setup(label: &str, args: &[&str]) -> Setup {
    setup_on(Node::new(label).unwrap(), args)
}

fn setup_on(node: Node, args: &[&str]) -> Setup {
    let server = node.netns.enter(FakeApiServer::start).unwrap().unwrap();
    let chain = Chain::issue(&["unused.example".to_string()]).unwrap();
    server.apply_json(ca_secret(&chain, &[&chain])).unwrap();
    for (name, account, host) in [("client", Some("cart"), 2), ("batch", None, 4)] {
        server
            .apply_json(pod(name, account, Ipv4Addr::new(10, 200, 0, host)))
            .unwrap();
    }
    let (dir, kubeconfig) = server.kubeconfig_file().unwrap();
    let local = NODE_LOCAL.to_string();
    let mut all_args = vec!["--node-local-dns", local.as_str()];
    all_args.extend_from_slice(args);
    let agent = node
        .agent_at(
            AgentAddrs {
                xds: XDS,
                dns: DNS,
                admin: ADMIN,
            },
            &all_args,
            &[("KUBECONFIG", kubeconfig.as_str()), ("NODE_NAME", "node-a")],
        )
        .unwrap();
    Setup {
        node,
        server,
        chain,
        agent,
        _kubeconfig: dir,
    }
}

/// The certificates the TLS listener in `netns` presents.
fn served_certificates(netns: &Netns) -> Result<Vec<String>, String> {
    let target = format!("127.0.0.1:{PROBE_PORT}");
    let shown = openssl(
        netns,
        &[
            "s_client",
            "-connect",
            &target,
            "-showcerts",
            "-servername",
            "probe",
        ],
        "",
    )?;
    let found = certificates(&shown);
    if found.is_empty() {
        return Err(format!("no certificate in: {shown}"));
    }
    Ok(found)
}

#[test]
fn a_verified_proxy_gets_its_own_identitys_certificate_over_sds() {
    let Setup {
        node,
        server,
        chain,
        agent,
        _kubeconfig,
    } = setup("sds", &[]);

    let client = node
        .client_editing("client", 2, (XDS, DNS), &add_tls_listener)
        .unwrap();
    let netns = client.netns();
    let presented = wait::until("Envoy serving TLS with its SDS certificate", WITHIN, || {
        served_certificates(netns)
    })
    .unwrap_or_else(|e| {
        let stats = client.envoy_admin("/stats?filter=15443");
        panic!(
            "{e}\nthe listener's stats: {stats:?}\n{}\n{}",
            agent.log(),
            client.envoy_log()
        )
    });
    assert_eq!(
        uri_sans(netns, &presented[0]),
        ["spiffe://cluster.local/ns/default/sa/cart"],
        "the leaf names the pod's service account, and only it"
    );
    let dir = tempfile::tempdir().unwrap();
    let bundle = dir.path().join("bundle.pem");
    std::fs::write(&bundle, &chain.ca_cert).unwrap();
    let verified = openssl(
        netns,
        &["verify", "-CAfile", bundle.to_str().unwrap()],
        &presented[0],
    )
    .unwrap();
    assert!(verified.contains("OK"), "{verified}");

    // Another pod of the node, as itself: its own identity, never the client's.
    let batch = node.pod("batch", 4).unwrap();
    let pem = workload_secret(&batch.netns, "batch.default").unwrap();
    assert_eq!(
        uri_sans(&batch.netns, &certificates(&pem)[0]),
        ["spiffe://cluster.local/ns/default/sa/default"]
    );

    // A pod that went but is still listed, at the address another was given: a stream from
    // that address may be either, so neither pod's key is handed out.
    server
        .apply_json(pod("ghost", Some("admin"), Ipv4Addr::new(10, 200, 0, 4)))
        .unwrap();
    for claimed in ["ghost.default", "batch.default"] {
        wait::until(
            "no secret at a shared address",
            WITHIN,
            || match workload_secret(&batch.netns, claimed) {
                Err(e) if e.contains("no `default`") => Ok(()),
                other => Err(format!("{other:?}")),
            },
        )
        .unwrap_or_else(|e| panic!("as {claimed}: {e}\n{}", agent.log()));
    }

    // What the operator sees, and no key anywhere in it.
    let (_, proxies) = agent.get("/debug/xds").unwrap();
    assert!(
        proxies.contains("\"identity\":\"spiffe://cluster.local/ns/default/sa/cart\""),
        "/debug/xds: {proxies}"
    );
    let (_, identity) = agent.get("/debug/identity").unwrap();
    let identity: Value = serde_json::from_str(&identity).unwrap();
    let leaves: Vec<&str> = identity["leaves"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l["identity"].as_str())
        .collect();
    assert!(
        leaves.contains(&"spiffe://cluster.local/ns/default/sa/cart"),
        "{identity}"
    );
    for shown in [&proxies, &identity.to_string()] {
        assert!(!shown.contains("PRIVATE KEY"), "a key is shown: {shown}");
    }
    // A new issuer, its root added to the bundle: the pod's Envoy serves a leaf of the new
    // issuer, pushed over SDS, with no restart.
    let next = Chain::issue(&["unused.example".to_string()]).unwrap();
    server
        .apply_json(ca_secret(&next, &[&chain, &next]))
        .unwrap();
    let next_bundle = dir.path().join("next.pem");
    std::fs::write(&next_bundle, &next.ca_cert).unwrap();
    wait::until("Envoy serving a leaf of the new issuer", WITHIN, || {
        let leaf = served_certificates(netns)?.remove(0);
        openssl(
            netns,
            &["verify", "-CAfile", next_bundle.to_str().unwrap()],
            &leaf,
        )
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));

    let (_, metrics) = agent.get("/metrics").unwrap();
    assert!(
        metrics.contains(
            "lattice_identity_leaf_expiry_timestamp_seconds{identity=\"spiffe://cluster.local/ns/default/sa/cart\"}"
        ),
        "{metrics}"
    );
    drop(client);
}

/// The serial of a PEM certificate, as openssl prints it.
fn serial(netns: &Netns, pem: &str) -> String {
    openssl(netns, &["x509", "-noout", "-serial"], pem)
        .unwrap()
        .trim()
        .to_string()
}

/// When a PEM certificate ends, in Unix seconds.
fn not_after(netns: &Netns, pem: &str) -> i64 {
    let text = openssl(netns, &["x509", "-noout", "-enddate"], pem).unwrap();
    let date = text.trim().trim_start_matches("notAfter=");
    let out = std::process::Command::new("date")
        .args(["-u", "-d", date, "+%s"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

fn unix_now() -> i64 {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    i64::try_from(since.as_secs()).unwrap()
}

#[test]
fn a_minute_long_leaf_is_renewed_before_it_ends_and_no_handshake_fails() {
    let setup = setup("sdsr", &["--leaf-lifetime-secs=60"]);
    let client = setup
        .node
        .client_editing("client", 2, (XDS, DNS), &add_tls_listener)
        .unwrap();
    let netns = client.netns();
    let first = wait::until("Envoy serving its first leaf", WITHIN, || {
        served_certificates(netns)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", setup.agent.log()));
    let (first_serial, first_end) = (serial(netns, &first[0]), not_after(netns, &first[0]));
    assert!(
        first_end - unix_now() <= 60,
        "a leaf of a minute, not one ending at {first_end}"
    );
    // A handshake every 200 ms until a renewed leaf is served: none may fail.
    let (mut handshakes, mut failures) = (0, Vec::new());
    let renewed = loop {
        assert!(
            unix_now() < first_end,
            "no renewed leaf before the first ended ({handshakes} handshakes)\n{}",
            setup.agent.log()
        );
        handshakes += 1;
        match served_certificates(netns) {
            Ok(found) if serial(netns, &found[0]) != first_serial => break found,
            Ok(_) => {}
            Err(e) => failures.push(e),
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        failures.is_empty(),
        "{} of {handshakes} handshakes failed: {failures:?}",
        failures.len()
    );
    assert!(
        not_after(netns, &renewed[0]) > first_end,
        "the renewed leaf ends later"
    );
    assert_eq!(
        uri_sans(netns, &renewed[0]),
        ["spiffe://cluster.local/ns/default/sa/cart"]
    );
    eprintln!("renewed after {handshakes} handshakes, none failed");
    drop(client);
    drop(setup.server);
}

/// The node of [`setup`], its agent asking Istio's certificate service (the in-repo
/// stand-in, in the node's namespace) instead of signing with the CA's Secret, which the API
/// server still holds. The service knows the agent's token as node-a's and a pod of `cart`
/// on node-a; no other.
struct IstioSetup {
    setup: Setup,
    ca: IstioCaServer,
    /// The service's roots, as the agent reads them.
    roots: String,
    _files: tempfile::TempDir,
}

fn setup_istio(label: &str, args: &[&str]) -> IstioSetup {
    let node = Node::new(label).unwrap();
    let ca = node.netns.enter(IstioCaServer::start).unwrap().unwrap();
    ca.pod("spiffe://cluster.local/ns/default/sa/cart", "node-a");
    let files = tempfile::tempdir().unwrap();
    let (flags, roots) = ca.agent_flags("node-a", files.path()).unwrap();
    let mut all: Vec<&str> = flags.iter().map(String::as_str).collect();
    all.extend_from_slice(args);
    IstioSetup {
        setup: setup_on(node, &all),
        ca,
        roots: roots.display().to_string(),
        _files: files,
    }
}

/// The agent's counter of leaves not issued for `reason`.
fn leaf_failures(agent: &lattice_e2e::agent::Agent, reason: &str) -> f64 {
    agent.metric(&format!(
        "lattice_identity_leaf_failures_total{{reason=\"{reason}\"}}"
    ))
}

/// A TLS handshake with the pod's listener that checks its leaf against `roots` (a file):
/// the handshake a peer of the mesh makes.
fn verified_handshake(netns: &Netns, roots: &str) -> Result<(), String> {
    let target = format!("127.0.0.1:{PROBE_PORT}");
    openssl(
        netns,
        &[
            "s_client",
            "-connect",
            &target,
            "-CAfile",
            roots,
            "-verify_return_error",
            "-servername",
            "probe",
        ],
        "",
    )
    .map(|_| ())
}

#[test]
fn istios_certificate_service_signs_for_this_nodes_pods_and_its_refusal_gives_no_leaf() {
    let IstioSetup {
        setup,
        ca,
        roots,
        _files,
    } = setup_istio("sdsi", &[]);
    let client = setup
        .node
        .client_editing("client", 2, (XDS, DNS), &add_tls_listener)
        .unwrap();
    let netns = client.netns();
    let roots = roots.as_str();
    wait::until("Envoy serving a leaf of the service", WITHIN, || {
        verified_handshake(netns, roots)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", setup.agent.log()));
    let served = served_certificates(netns).unwrap();
    assert_eq!(
        uri_sans(netns, &served[0]),
        ["spiffe://cluster.local/ns/default/sa/cart"]
    );
    // Signed by the service (its serial is one it issued), not with the Secret's CA.
    let issued = ca.issued();
    let shown = serial(netns, &served[0]);
    assert!(
        issued
            .iter()
            .any(|(id, serial)| id.ends_with("/sa/cart") && shown == format!("serial={serial}")),
        "{shown} is not among {issued:?}"
    );
    assert_eq!(
        served.len(),
        1,
        "the root is not handed on as part of the chain"
    );
    let secret_ca = _files.path().join("secret-ca.pem");
    std::fs::write(&secret_ca, &setup.chain.ca_cert).unwrap();
    assert!(verified_handshake(netns, secret_ca.to_str().unwrap()).is_err());

    // batch runs as `default`, of which the service knows no pod on node-a: refused, and its
    // stream gets no leaf.
    let batch = setup.node.pod("batch", 4).unwrap();
    let deadline = std::time::Instant::now() + WITHIN;
    loop {
        let answer = workload_secret(&batch.netns, "batch.default");
        assert!(
            matches!(&answer, Err(e) if e.contains("no `default`")),
            "{answer:?}"
        );
        let refused = ca.refused();
        if refused
            .iter()
            .any(|(id, why)| id.ends_with("/sa/default") && why.contains("no pod of"))
            && leaf_failures(&setup.agent, "refused") >= 1.0
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no refusal seen: {refused:?}\n{}",
            setup.agent.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let (_, identity) = setup.agent.get("/debug/identity").unwrap();
    assert!(identity.contains("\"backend\":\"istio-ca\""), "{identity}");
    assert!(!identity.contains("PRIVATE KEY"), "{identity}");
    drop(client);
}

#[test]
fn a_signer_outage_of_twice_the_leaf_lifetime_fails_nothing_until_the_leaf_ends() {
    const LIFE: i64 = 60;
    let IstioSetup {
        setup,
        ca,
        roots,
        _files,
    } = setup_istio("sdso", &[&format!("--leaf-lifetime-secs={LIFE}")]);
    let client = setup
        .node
        .client_editing("client", 2, (XDS, DNS), &add_tls_listener)
        .unwrap();
    let netns = client.netns();
    let roots = roots.as_str();
    let first = wait::until("Envoy serving its first leaf", WITHIN, || {
        verified_handshake(netns, roots)?;
        served_certificates(netns)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", setup.agent.log()));
    let first_end = not_after(netns, &first[0]);
    let down_at = unix_now();
    ca.set_down(true);

    // Until a second before the leaf ends, every handshake a peer makes passes; the failed
    // renewals show in the metrics before the end.
    let (mut handshakes, mut failures, mut seen_failing) = (0, Vec::new(), None);
    while unix_now() < first_end - 1 {
        handshakes += 1;
        if let Err(e) = verified_handshake(netns, roots) {
            failures.push(e);
        }
        if seen_failing.is_none() && leaf_failures(&setup.agent, "unavailable") >= 1.0 {
            seen_failing = Some(unix_now());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        failures.is_empty(),
        "{} of {handshakes} handshakes failed during the outage: {failures:?}",
        failures.len()
    );
    let seen = seen_failing.unwrap_or_else(|| {
        panic!(
            "no failed renewal counted before the leaf ended\n{}",
            setup.agent.log()
        )
    });
    assert!(seen < first_end);
    let (_, metrics) = setup.agent.get("/metrics").unwrap();
    assert!(
        metrics.contains(&format!(
            "lattice_identity_leaf_expiry_timestamp_seconds{{identity=\"spiffe://cluster.local/ns/default/sa/cart\"}} {first_end}"
        )),
        "the held leaf's end is shown: {metrics}"
    );

    // The outage lasts twice the leaf's life; once it ends, a new leaf is served.
    while unix_now() < down_at + 2 * LIFE {
        std::thread::sleep(Duration::from_millis(500));
    }
    ca.set_down(false);
    // The agent retries by its backoff, at most a minute apart.
    let retry = Duration::from_secs(60) + WITHIN;
    wait::until("Envoy serving a new leaf after the outage", retry, || {
        verified_handshake(netns, roots)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", setup.agent.log()));
    let renewed = served_certificates(netns).unwrap();
    assert_ne!(serial(netns, &renewed[0]), serial(netns, &first[0]));
    eprintln!(
        "{handshakes} handshakes during the outage, none failed; failures counted {}s before the leaf ended",
        first_end - seen
    );
    drop(client);
}
