//! `lattice check` (the real binary) against the fake API server: a healthy install passes
//! every check; each thing that can break fails its check, with what was found and a hint,
//! and the command exits 1.
//!
//! Build the binaries first: `cargo build --workspace --bins`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

use k8s_openapi::ByteString;
use lattice_e2e::bins;
use lattice_e2e::fake_apiserver::FakeApiServer;
use lattice_inject::certs::Chain;
use serde::Deserialize;
use serde_json::{Value, json};

fn documents(file: &str) -> Vec<Value> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(file);
    let text = std::fs::read_to_string(path).unwrap();
    serde_norway::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|d| !d.is_null())
        .collect()
}

const NAMES: [&str; 2] = [
    "lattice-injector.lattice-system.svc",
    "lattice-injector.lattice-system.svc.cluster.local",
];

fn chain() -> Chain {
    Chain::issue(&NAMES.map(String::from)).unwrap()
}

fn secret(chain: &Chain) -> Value {
    let bytes = |text: &str| json!(ByteString(text.as_bytes().to_vec()));
    json!({
        "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
        "metadata": {"name": "lattice-injector-tls", "namespace": "lattice-system"},
        "data": {"tls.crt": bytes(&chain.cert), "tls.key": bytes(&chain.key),
                 "ca.crt": bytes(&chain.ca_cert), "ca.key": bytes(&chain.ca_key)}
    })
}

fn configuration(ca: Option<&str>) -> Value {
    let mut configuration = documents("deploy/injector.yaml")
        .into_iter()
        .find(|d| d["kind"] == "MutatingWebhookConfiguration")
        .unwrap();
    for webhook in configuration["webhooks"].as_array_mut().unwrap() {
        webhook["clientConfig"]["caBundle"] = match ca {
            Some(ca) => json!(ByteString(ca.as_bytes().to_vec())),
            None => Value::Null,
        };
    }
    configuration
}

fn daemonset(ready: i32) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "lattice-agent", "namespace": "lattice-system"},
        "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": "lattice-agent"}},
                 "template": {"spec": {"containers": [{"name": "agent", "image": "lattice"}]}}},
        "status": {"currentNumberScheduled": 2, "desiredNumberScheduled": 2, "numberMisscheduled": 0,
                   "numberReady": ready, "numberUnavailable": 2 - ready}
    })
}

fn endpoints(ready: bool) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": "lattice-injector-x7k2p", "namespace": "lattice-system",
                     "labels": {"kubernetes.io/service-name": "lattice-injector"}},
        "endpoints": [{"addresses": ["10.0.1.7"], "conditions": {"ready": ready}}],
        "ports": [{"name": "https", "port": 8443, "protocol": "TCP"}]
    })
}

fn mesh_pod(ready: bool) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "echo-5d4f8-abcde", "namespace": "lattice-demo"},
        "spec": {"nodeName": "node-b",
                 "initContainers": [{"name": "lattice-init", "image": "lattice"},
                                    {"name": "lattice-proxy", "image": "envoy", "restartPolicy": "Always"}],
                 "containers": [{"name": "app", "image": "app"}]},
        "status": {"phase": "Running",
                   "initContainerStatuses": [
                       {"name": "lattice-init", "ready": false, "restartCount": 0, "image": "lattice", "imageID": ""},
                       {"name": "lattice-proxy", "ready": ready, "restartCount": 0, "image": "envoy", "imageID": ""}]}
    })
}

/// A cluster where everything is as installed and working.
fn healthy() -> (FakeApiServer, Chain) {
    let api = FakeApiServer::start().unwrap();
    for node in ["node-a", "node-b"] {
        api.apply_json(json!({"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node, "labels": {"kubernetes.io/os": "linux"}}}))
            .unwrap();
    }
    api.apply_json(daemonset(2)).unwrap();
    for object in documents("deploy/rbac.yaml") {
        if object["kind"] != "ServiceAccount" {
            api.apply_json(object).unwrap();
        }
    }
    let chain = chain();
    api.apply_json(configuration(Some(&chain.ca_cert))).unwrap();
    api.apply_json(secret(&chain)).unwrap();
    api.apply_json(endpoints(true)).unwrap();
    api.apply_json(json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "lattice-injector", "namespace": "lattice-system"},
        "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": "lattice-injector"}},
                 "template": {"spec": {"containers": [{"name": "injector", "image": "lattice"}]}}},
        "status": {"availableReplicas": 2, "readyReplicas": 2, "replicas": 2}}))
        .unwrap();
    api.apply_json(mesh_pod(true)).unwrap();
    api.apply_json(json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "plain", "namespace": "default"},
        "spec": {"containers": [{"name": "app", "image": "app"}]},
        "status": {"phase": "Running"}}))
        .unwrap();
    (api, chain)
}

/// `lattice check` against `api`: whether it succeeded, and what it printed.
fn check(api: &FakeApiServer) -> (bool, String) {
    let (_dir, kubeconfig) = api.kubeconfig_file().unwrap();
    let output = Command::new(bins::path("lattice"))
        .arg("check")
        .env("KUBECONFIG", &kubeconfig)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

/// The line of check `title` and the two after it (what was found, the hint).
fn failed<'a>(text: &'a str, title: &str) -> Option<&'a str> {
    let start = text.find(&format!("× {title}"))?;
    let rest = &text[start..];
    let end = rest
        .match_indices('\n')
        .nth(2)
        .map_or(rest.len(), |(i, _)| i);
    Some(&rest[..end])
}

#[test]
fn a_healthy_install_passes_every_check() {
    let (api, _) = healthy();
    let (ok, text) = check(&api);
    assert!(ok, "{text}");
    for title in [
        "√ the agent's DaemonSet lattice-system/lattice-agent exists",
        "√ an agent is ready on every Linux node",
        "√ the agent's RBAC grants what it needs",
        "√ the webhook configuration lattice-injector exists",
        "√ its CA bundle is a CA valid now",
        "√ the injector's Service lattice-system/lattice-injector has ready endpoints",
        "√ its serving certificate is signed by that CA and names its Service",
        "√ the Gateway API's CRDs are installed",
        "√ every running mesh pod's Envoy holds its configuration (1 pods)",
    ] {
        assert!(text.contains(title), "{title}\n{text}");
    }
    assert!(!text.contains('×'), "{text}");
}

/// A check's title, how to break what it checks, how to mend it, and what its failure says.
type Case = (
    &'static str,
    Box<dyn Fn(&FakeApiServer)>,
    Box<dyn Fn(&FakeApiServer)>,
    &'static str,
);

#[test]
fn each_breakage_fails_its_check_with_a_hint() {
    let (api, chain) = healthy();
    let cases: Vec<Case> = vec![
        (
            "an agent is ready on every Linux node",
            Box::new(|api| drop(api.apply_json(daemonset(1)))),
            Box::new(|api| drop(api.apply_json(daemonset(2)))),
            "1 ready of 2 Linux nodes",
        ),
        (
            "the agent's RBAC grants what it needs",
            Box::new(|api| {
                let mut role = documents("deploy/rbac.yaml")
                    .into_iter()
                    .find(|d| d["kind"] == "ClusterRole")
                    .unwrap();
                let rules = role["rules"].as_array_mut().unwrap();
                rules.retain(|r| !r["resources"].to_string().contains("endpointslices"));
                api.apply_json(role).unwrap();
            }),
            Box::new(|api| {
                let role = documents("deploy/rbac.yaml")
                    .into_iter()
                    .find(|d| d["kind"] == "ClusterRole")
                    .unwrap();
                api.apply_json(role).unwrap();
            }),
            "watch endpointslices.discovery.k8s.io",
        ),
        (
            "its CA bundle is a CA valid now",
            Box::new(|api| drop(api.apply_json(configuration(None)))),
            Box::new(move |api| drop(api.apply_json(configuration(Some(&chain.ca_cert))))),
            "no CA bundle yet",
        ),
        (
            "the injector's Service lattice-system/lattice-injector has ready endpoints",
            Box::new(|api| drop(api.apply_json(endpoints(false)))),
            Box::new(|api| drop(api.apply_json(endpoints(true)))),
            "pods of meshed namespaces cannot be created",
        ),
        (
            "its serving certificate is signed by that CA and names its Service",
            Box::new(|api| drop(api.apply_json(secret(&self::chain())))),
            Box::new({
                let chain = api_chain(&api);
                move |api| drop(api.apply_json(secret(&chain)))
            }),
            "not signed by the bundle's CA",
        ),
        (
            "every running mesh pod's Envoy holds its configuration",
            Box::new(|api| drop(api.apply_json(mesh_pod(false)))),
            Box::new(|api| drop(api.apply_json(mesh_pod(true)))),
            "1 of 1 not ready: lattice-demo/echo-5d4f8-abcde (node node-b)",
        ),
        (
            "the agent's DaemonSet lattice-system/lattice-agent exists",
            Box::new(|api| {
                drop(api.delete::<k8s_openapi::api::apps::v1::DaemonSet>(
                    "lattice-system",
                    "lattice-agent",
                ))
            }),
            Box::new(|api| drop(api.apply_json(daemonset(2)))),
            "not found",
        ),
    ];
    for (title, breaks, mends, found) in cases {
        breaks(&api);
        let (ok, text) = check(&api);
        assert!(!ok, "{title}: passed while broken\n{text}");
        let shown = failed(&text, title).unwrap_or_else(|| panic!("{title} did not fail:\n{text}"));
        assert!(shown.contains(found), "{title}: {shown}");
        assert!(shown.contains("hint: "), "{title}: {shown}");
        mends(&api);
        let (ok, text) = check(&api);
        assert!(ok, "{title}: still failing once mended\n{text}");
    }

    // Without the Gateway API's CRDs the agent serves no routes from them: a warning only.
    api.uninstall::<gateway_api::experimental::httproutes::HttpRoute>()
        .unwrap();
    let (ok, text) = check(&api);
    assert!(ok, "{text}");
    assert!(text.contains("‼ the Gateway API's CRDs"), "{text}");
}

/// The chain of the Secret stored now.
fn api_chain(api: &FakeApiServer) -> Chain {
    let secret = api
        .objects::<k8s_openapi::api::core::v1::Secret>()
        .unwrap()
        .remove(0);
    lattice_inject::setup::read(&secret).unwrap()
}
