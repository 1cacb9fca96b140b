//! `cargo xtask bench` for the Kubernetes source: runs the ignored scale test of
//! `tests/tests/kube.rs` (the real agent against the fake API server) and returns the figures it
//! prints: time from start to ready and the agent's RSS with 10k services and 100k endpoints.
//! A smoke run uses 1000 services and a debug build, to check the bench itself works.

use std::process::Command;

use anyhow::{Context, bail};

const TEST: &str = "scale_10k_services_100k_endpoints_rss_and_time_to_ready";
const MARKER: &str = "BENCH_KUBE_JSON ";

pub fn run(smoke: bool) -> anyhow::Result<serde_json::Value> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let profile: &[&str] = if smoke { &[] } else { &["--release"] };
    let services = if smoke { "1000" } else { "10000" };

    let status = Command::new(&cargo)
        .args(["build", "-p", "lattice-agent", "--bins"])
        .args(profile)
        .status()
        .context("running cargo build for lattice-agent")?;
    if !status.success() {
        bail!("cargo build -p lattice-agent failed: {status}");
    }
    // `cargo test --release` runs from target/release, so the test finds the release agent.
    let output = Command::new(&cargo)
        .args(["test", "-p", "lattice-e2e", "--test", "kube"])
        .args(profile)
        .args(["--", "--ignored", "--exact", "--nocapture", TEST])
        .env("LATTICE_BENCH_SERVICES", services)
        .output()
        .context("running the Kubernetes scale test")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "the Kubernetes scale test failed ({}):\n{stdout}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix(MARKER))
        .with_context(|| format!("the scale test printed no {MARKER:?} line:\n{stdout}"))?;
    let mut report: serde_json::Value = serde_json::from_str(line)
        .with_context(|| format!("scale test report is not JSON: {line}"))?;
    report["build"] = if smoke { "debug" } else { "release" }.into();
    Ok(report)
}
