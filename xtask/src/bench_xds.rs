//! `cargo xtask bench` for xDS at scale: runs the ignored test of `tests/tests/xds_scale.rs`
//! (the real agent fed through the fake API server, synthetic ADS clients half SotW and half
//! Delta) and returns the figures it prints: initial sync, change-to-all-clients latency,
//! bytes per change per client, the agent's RSS and CPU, at a 100-service baseline and at
//! 10k services (sizes overridable from the environment, see `run`). A smoke run uses 10 vs
//! 100 services, 10 clients, 20 changes and a debug build.

use crate::scale_test::ScaleTest;

const SCALE: ScaleTest<'static> = ScaleTest {
    file: "xds_scale",
    test: "xds_propagation_and_cost_at_scale",
    marker: "BENCH_XDS_JSON ",
};

pub fn run(smoke: bool) -> anyhow::Result<serde_json::Value> {
    // Sizes: (variable, smoke, full); a variable already set in the environment wins, so a
    // shorter run at full size is `LATTICE_BENCH_CHANGES=50 cargo xtask bench --only xds`.
    let sizes = [
        ("LATTICE_BENCH_SERVICES", "100", "10000"),
        ("LATTICE_BENCH_BASELINE_SERVICES", "10", "100"),
        ("LATTICE_BENCH_CLIENTS", "10", "100"),
        ("LATTICE_BENCH_CHANGES", "20", "1000"),
        ("LATTICE_BENCH_SOTW_PERCENT", "50", "50"),
    ];
    let envs = sizes.iter().map(|(name, small, full)| {
        let default = if smoke { small } else { full };
        (
            name.to_string(),
            std::env::var(name).unwrap_or_else(|_| default.to_string()),
        )
    });
    let report = SCALE.run(smoke, envs)?;
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
