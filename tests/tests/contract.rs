//! Both binaries take `--trap-cidr` under one set of rules: for every value, `lattice-agent`
//! and `lattice-init` give the same verdict, and a refusal carries the same message.

use std::process::Command;

use lattice_contract::TrapCidrs;
use lattice_e2e::agent::run_to_exit;
use lattice_e2e::bins;

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
