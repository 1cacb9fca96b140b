//! `cargo xtask bench` for xDS at scale: runs the ignored test of `tests/tests/xds_scale.rs`
//! (the real agent fed through the fake API server, synthetic ADS clients half SotW and half
//! Delta) and returns the figures it prints: initial sync, change-to-all-clients latency,
//! bytes per change per client, the agent's RSS and CPU, at a 100-service baseline and at
//! 10k services (sizes overridable from the environment, see `run`). A smoke run uses 10 vs
//! 100 services, 10 clients, 20 changes and a debug build.

use std::process::Command;

use anyhow::{Context, bail};

const TEST: &str = "xds_propagation_and_cost_at_scale";
const MARKER: &str = "BENCH_XDS_JSON ";

pub fn run(smoke: bool) -> anyhow::Result<serde_json::Value> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let profile: &[&str] = if smoke { &[] } else { &["--release"] };
    // Sizes: (variable, smoke, full); a variable already set in the environment wins, so a
    // shorter run at full size is `LATTICE_BENCH_CHANGES=50 cargo xtask bench --only xds`.
    let sizes = [
        ("LATTICE_BENCH_SERVICES", "100", "10000"),
        ("LATTICE_BENCH_BASELINE_SERVICES", "10", "100"),
        ("LATTICE_BENCH_CLIENTS", "10", "100"),
        ("LATTICE_BENCH_CHANGES", "20", "1000"),
        ("LATTICE_BENCH_SOTW_PERCENT", "50", "50"),
    ];

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
        .args(["test", "-p", "lattice-e2e", "--test", "xds_scale"])
        .args(profile)
        .args(["--", "--ignored", "--exact", "--nocapture", TEST])
        .envs(sizes.iter().map(|(name, small, full)| {
            let default = if smoke { small } else { full };
            (
                *name,
                std::env::var(name).unwrap_or_else(|_| default.to_string()),
            )
        }))
        .output()
        .context("running the xDS scale test")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "the xDS scale test failed ({}):\n{stdout}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix(MARKER))
        .with_context(|| format!("the xDS scale test printed no {MARKER:?} line:\n{stdout}"))?;
    let mut report: serde_json::Value = serde_json::from_str(line)
        .with_context(|| format!("xDS scale test report is not JSON: {line}"))?;
    report["build"] = if smoke { "debug" } else { "release" }.into();
    print_table(&report);
    Ok(report)
}

fn print_table(report: &serde_json::Value) {
    let ms = |v: &serde_json::Value| v.as_f64().map_or("-".into(), |x| format!("{x:.1}"));
    println!(
        "{:<10} {:>8} {:>7} {:>10} {:>9} {:>9} {:>12} {:>12} {:>8} {:>10}",
        "xds",
        "services",
        "clients",
        "sync ms",
        "p50 ms",
        "p99 ms",
        "sotw B/chg",
        "delta B/chg",
        "RSS MiB",
        "cpu ms/chg"
    );
    for run in ["baseline", "full"] {
        let r = &report[run];
        println!(
            "{:<10} {:>8} {:>7} {:>10} {:>9} {:>9} {:>12} {:>12} {:>8} {:>10}",
            run,
            r["services"].as_u64().unwrap_or(0),
            r["clients"].as_u64().unwrap_or(0),
            ms(&r["initial_sync_ms"]),
            ms(&r["change_to_all_clients_ms"]["p50"]),
            ms(&r["change_to_all_clients_ms"]["p99"]),
            ms(&r["bytes_per_change_per_client"]["sotw_mean"]),
            ms(&r["bytes_per_change_per_client"]["delta_mean"]),
            ms(&r["agent_rss_mib"]["after_changes"]),
            ms(&r["agent_cpu_ms_per_change"]),
        );
    }
    println!(
        "cost of one change, full vs baseline: {}",
        report["cost_ratio_full_vs_baseline"]
    );
}
