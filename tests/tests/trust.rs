//! The issuer of workload certificates, followed live from its Secret by the real agent
//! against the fake API server: `/debug/identity` and the `lattice_identity_*` metrics show
//! the CA in use, a version that does not hold together is refused while the one before stays,
//! a second root joins the bundle, and a deleted Secret stops issuance.
//!
//! Build the binaries first: `cargo build --workspace --bins`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use lattice_e2e::agent::Agent;
use lattice_e2e::fake_apiserver::FakeApiServer;
use lattice_e2e::wait;
use lattice_inject::certs::Chain;
use serde_json::{Value, json};

fn secret(tls_crt: &str, tls_key: &str, ca_crt: &str) -> Value {
    let bytes = |text: &str| json!(ByteString(text.as_bytes().to_vec()));
    json!({
        "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
        "metadata": {"name": "lattice-ca", "namespace": "lattice-system"},
        "data": {"tls.crt": bytes(tls_crt), "tls.key": bytes(tls_key), "ca.crt": bytes(ca_crt)}
    })
}

fn identity(agent: &Agent) -> Result<Value, String> {
    match agent.get("/debug/identity") {
        Ok((200, body)) => serde_json::from_str(&body).map_err(|e| e.to_string()),
        other => Err(format!("{other:?}")),
    }
}

fn metric(agent: &Agent, name: &str) -> Option<f64> {
    let (_, text) = agent.get("/metrics").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|rest| rest.trim().parse().ok())
}

/// Polls `/debug/identity` until `check` holds.
fn until(agent: &Agent, what: &str, check: impl Fn(&Value) -> bool) -> Value {
    wait::until(what, Duration::from_secs(20), || {
        let state = identity(agent)?;
        if check(&state) {
            Ok(state)
        } else {
            Err(state.to_string())
        }
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()))
}

#[test]
fn the_issuer_follows_its_secret_and_a_bad_version_keeps_the_one_before() {
    let api = FakeApiServer::start().unwrap();
    let (_dir, kubeconfig) = api.kubeconfig_file().unwrap();
    let agent = Agent::start_with_env(
        &["--trust-domain=mesh.example"],
        &[("KUBECONFIG", &kubeconfig)],
    );
    agent.wait_ready().unwrap();

    let none = until(&agent, "the Secret listed", |s| s["listed"] == true);
    assert_eq!(none["present"], false);
    assert!(none["issuer"].is_null());
    assert_eq!(none["trust_domain"], "mesh.example");
    assert_eq!(none["secret"], "lattice-system/lattice-ca");

    let names = ["unused.example".to_string()];
    let (first, second) = (Chain::issue(&names).unwrap(), Chain::issue(&names).unwrap());
    api.apply_json(secret(&first.ca_cert, &first.ca_key, &first.ca_cert))
        .unwrap();
    let state = until(&agent, "the issuer", |s| !s["issuer"].is_null());
    assert!(
        state["issuer"]["subject"]
            .as_str()
            .unwrap()
            .contains("lattice-injector CA")
    );
    let not_after = state["issuer"]["not_after"].as_f64().unwrap();
    assert_eq!(
        metric(&agent, "lattice_identity_issuer_expiry_timestamp_seconds "),
        Some(not_after)
    );

    // A key that is not the CA's: refused, the issuer before stays.
    api.apply_json(secret(&first.ca_cert, &second.ca_key, &first.ca_cert))
        .unwrap();
    let refused = until(&agent, "the refusal", |s| !s["refused"].is_null());
    assert!(
        refused["refused"].as_str().unwrap().contains("not the key"),
        "{refused}"
    );
    assert_eq!(refused["issuer"]["not_after"], state["issuer"]["not_after"]);
    assert_eq!(
        metric(
            &agent,
            r#"lattice_identity_issuer_refusals_total{reason="key_mismatch"} "#
        ),
        Some(1.0)
    );

    // A second root joins the bundle: both trusted, the issuer as before.
    let bundle = format!("{}{}", first.ca_cert, second.ca_cert);
    api.apply_json(secret(&first.ca_cert, &first.ca_key, &bundle))
        .unwrap();
    let both = until(&agent, "two roots", |s| {
        s["issuer"]["roots"]
            .as_array()
            .is_some_and(|r| r.len() == 2)
            && s["refused"].is_null()
    });
    assert_eq!(both["present"], true);

    // Deleted: no issuer.
    api.delete::<Secret>("lattice-system", "lattice-ca")
        .unwrap();
    let gone = until(&agent, "no issuer", |s| s["issuer"].is_null());
    assert_eq!(gone["present"], false);
    assert_eq!(
        metric(&agent, "lattice_identity_issuer_expiry_timestamp_seconds "),
        Some(0.0)
    );
}

/// The commands of install.md's block marked `workload-ca`, continuation lines joined.
fn install_guide_commands() -> Vec<String> {
    let guide = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/install.md"),
    )
    .unwrap();
    let after = guide
        .split_once("<!-- workload-ca:")
        .expect("install.md marks the workload CA's commands")
        .1;
    let block = after
        .split_once("```sh\n")
        .and_then(|(_, rest)| rest.split_once("```"))
        .expect("a sh block after the marker")
        .0;
    block
        .replace("\\\n", " ")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

/// install.md's commands for a CA made by hand, run as written (openssl), and the Secret its
/// `kubectl create secret` line makes, from the files it names: the agent takes the CA.
#[test]
fn a_ca_made_as_the_install_guide_says_is_taken() {
    let commands = install_guide_commands();
    let dir = tempfile::tempdir().unwrap();
    let mut data = serde_json::Map::new();
    for command in &commands {
        if command.starts_with("openssl ") {
            let status = std::process::Command::new("sh")
                .args(["-c", command])
                .current_dir(dir.path())
                .status()
                .unwrap();
            assert!(status.success(), "{command}");
        } else if command.starts_with("kubectl ") {
            assert!(command.contains("--type=kubernetes.io/tls"), "{command}");
            assert!(command.contains("-n lattice-system") && command.contains(" lattice-ca "));
            for argument in command.split_whitespace() {
                if let Some((key, file)) = argument
                    .strip_prefix("--from-file=")
                    .and_then(|pair| pair.split_once('='))
                {
                    let bytes = std::fs::read(dir.path().join(file)).unwrap();
                    data.insert(key.to_string(), json!(ByteString(bytes)));
                }
            }
        } else {
            panic!("a command this test does not know: {command}");
        }
    }
    let keys: Vec<&str> = data.keys().map(String::as_str).collect();
    assert_eq!(keys, ["ca.crt", "tls.crt", "tls.key"]);

    let api = FakeApiServer::start().unwrap();
    let (_dir, kubeconfig) = api.kubeconfig_file().unwrap();
    let agent = Agent::start_with_env(&[], &[("KUBECONFIG", &kubeconfig)]);
    agent.wait_ready().unwrap();
    api.apply_json(json!({
        "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
        "metadata": {"name": "lattice-ca", "namespace": "lattice-system"},
        "data": data,
    }))
    .unwrap();
    let state = until(&agent, "the issuer", |s| {
        !s["issuer"].is_null() || !s["refused"].is_null()
    });
    assert!(state["refused"].is_null(), "{state}");
    assert!(
        state["issuer"]["subject"]
            .as_str()
            .unwrap()
            .contains("lattice workload CA"),
        "{state}"
    );
}
