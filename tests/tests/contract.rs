//! What both binaries must agree on, held to it: `--trap-cidr` and `--envoy-port` are taken
//! under one set of rules (for every value, `lattice-agent` and `lattice-init` give the same
//! verdict, and a refusal carries the same message), and the capture port given to both is
//! where captured connections land and where the agent's listener takes them: a request
//! through a real Envoy on a port other than the default.

use std::process::Command;

use lattice_contract::{CapturePort, TrapCidrs};
use lattice_e2e::agent::run_to_exit;
use lattice_e2e::bins;
use lattice_e2e::node::{DNS, MeshFile, MeshService, Node, XDS};

/// Values and whether they are a valid `--trap-cidr`.
const VALUES: &[(&str, bool)] = &[
    ("240.240.0.0/16", true),
    ("10.0.0.0/8", true),
    ("240.240.0.0/30", true),
    ("240.240.0.0/16,fd00:240::/64", true),
    ("240.240.0.5/16", false),
    ("fd00:240::1/64", false),
    ("240.0.0.0/4", false),
    ("240.240.0.0/31", false),
    ("240.1.2.3/32", false),
    ("240.240.0.0/16,fd00::/16", false),
    ("240.240.0.0/16,fd00::/127", false),
    ("fd00:240::/64", false),
    ("240.240.0.0/16,241.0.0.0/24", false),
    ("240.240.0.0/16,240.240.1.0/24", false),
    ("127.0.0.0/8", false),
    ("240.240.0.0/33", false),
    ("banana", false),
    ("", false),
];

#[test]
fn agent_and_init_give_the_same_verdict_and_message_for_every_trap_cidr() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = dir.path().join("mesh.yaml");
    std::fs::write(&mesh, "services: []\n").unwrap();
    for &(value, valid) in VALUES {
        let verdict = TrapCidrs::parse(&[value]);
        assert_eq!(verdict.is_ok(), valid, "{value:?}: {verdict:?}");

        let (agent_code, agent_err) = run_to_exit(&[
            "--check-config",
            "--mesh-file",
            mesh.to_str().unwrap(),
            "--trap-cidr",
            value,
        ]);
        let init = Command::new(bins::path("lattice-init"))
            .args(["--check-config", "--trap-cidr", value])
            .env_remove("LATTICE_TRAP_CIDR")
            .output()
            .unwrap();
        let init_code = init.status.code();
        let init_err = String::from_utf8_lossy(&init.stderr);
        match verdict {
            Ok(_) => {
                assert_eq!(agent_code, Some(0), "agent refused {value:?}: {agent_err}");
                assert_eq!(init_code, Some(0), "init refused {value:?}: {init_err}");
            }
            Err(error) => {
                let message = error.to_string();
                assert_eq!(agent_code, Some(2), "agent on {value:?}: {agent_err}");
                assert_eq!(init_code, Some(2), "init on {value:?}: {init_err}");
                assert!(
                    agent_err.contains(&message),
                    "agent on {value:?}: {agent_err}"
                );
                assert!(init_err.contains(&message), "init on {value:?}: {init_err}");
            }
        }
    }
}

/// Values of `--envoy-port` and whether they are valid.
const PORTS: &[(&str, bool)] = &[
    ("15001", true),
    ("16001", true),
    ("1", true),
    ("65535", true),
    ("0", false),
    ("15000", false),
    ("15021", false),
    ("15006", false),
    ("70000", false),
    ("-1", false),
    ("http", false),
];

#[test]
fn agent_and_init_give_the_same_verdict_and_message_for_every_envoy_port() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = dir.path().join("mesh.yaml");
    std::fs::write(&mesh, "services: []\n").unwrap();
    for &(value, valid) in PORTS {
        let verdict = value.parse::<CapturePort>();
        assert_eq!(verdict.is_ok(), valid, "{value:?}: {verdict:?}");
        let flag = format!("--envoy-port={value}");
        let (agent_code, agent_err) = run_to_exit(&[
            "--check-config",
            "--mesh-file",
            mesh.to_str().unwrap(),
            &flag,
        ]);
        let init = Command::new(bins::path("lattice-init"))
            .args(["--check-config", &flag])
            .env_remove("LATTICE_ENVOY_PORT")
            .output()
            .unwrap();
        let init_code = init.status.code();
        let init_err = String::from_utf8_lossy(&init.stderr);
        match verdict {
            Ok(_) => {
                assert_eq!(agent_code, Some(0), "agent refused {value:?}: {agent_err}");
                assert_eq!(init_code, Some(0), "init refused {value:?}: {init_err}");
            }
            Err(error) => {
                let message = error.to_string();
                assert_eq!(agent_code, Some(2), "agent on {value:?}: {agent_err}");
                assert_eq!(init_code, Some(2), "init on {value:?}: {init_err}");
                assert!(
                    agent_err.contains(&message),
                    "agent on {value:?}: {agent_err}"
                );
                assert!(init_err.contains(&message), "init on {value:?}: {init_err}");
            }
        }
    }
}

/// The capture port moved on both binaries (16001): `lattice-init` redirects the trapped block
/// there, the agent's listener listens there, and a request from an app crosses a real Envoy
/// to the backend. The client's Envoy shows the listener on that port.
#[test]
fn a_capture_port_given_to_both_binaries_carries_traffic() {
    let node = Node::new("captureport").unwrap();
    let backend = node.http_backend("buzz-1", 10, 8080).unwrap();
    let mesh = MeshFile::new(&[MeshService {
        path: "/foo/bar/buzz".into(),
        port: 8080,
        protocol: "http".into(),
        endpoints: vec![backend.pod.address],
    }])
    .unwrap();
    let _agent = node
        .agent(
            &[
                "--mesh-file",
                mesh.path().to_str().unwrap(),
                "--envoy-port=16001",
            ],
            &[],
        )
        .unwrap();
    let client = node
        .client_with("captureport", 2, (XDS, DNS), &["--envoy-port=16001"])
        .unwrap();
    let body = lattice_e2e::wait::until(
        "a request through Envoy on 16001",
        std::time::Duration::from_secs(10),
        || client.curl("http://buzz.bar.foo.system.internal:8080/"),
    )
    .unwrap();
    assert_eq!(body.trim(), "buzz-1");
    let listeners = client.envoy_admin("/listeners").unwrap();
    assert!(
        listeners.contains("lattice-outbound::0.0.0.0:16001"),
        "{listeners}"
    );
}
