//! `cargo xtask bench` for xDS at scale: runs the ignored test of `tests/tests/xds_scale.rs`
//! (the real agent fed through the fake API server and then through a mesh file, synthetic
//! ADS clients half SotW and half Delta, one real Envoy) and returns the figures it prints:
//! initial sync, change-to-all-clients latency, bytes per change per client, the agent's RSS
//! and CPU, Envoy's own latency and RSS, and an agent restart (kill -9) until every client is
//! consistent again with the bytes re-sent, at a 100-service baseline and at 10k services (sizes
//! overridable from the environment, see `run`; `LATTICE_BENCH_SOURCES=kube` or `=file` runs
//! one source, `LATTICE_BENCH_ENVOY=sotw` or `=none` changes or drops the Envoy). With the
//! Kubernetes source it also runs the full size **scoped**: the agent as a node's,
//! each client and Envoy a pod of that node holding only the `LATTICE_BENCH_SCOPE` services it
//! resolved, with DNS first-lookup latency (`LATTICE_BENCH_DNS_LOOKUPS` names per client);
//! `LATTICE_BENCH_SCOPED=0` skips it. A smoke run uses 10 vs 100 services, 10 clients, 20
//! changes, scopes of 5 and 3 lookups per client, and a debug build.

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
        ("LATTICE_BENCH_SCOPE", "5", "20"),
        ("LATTICE_BENCH_DNS_LOOKUPS", "3", "10"),
        ("LATTICE_BENCH_SCOPED", "1", "1"),
        ("LATTICE_BENCH_RESTARTS", "1", "3"),
    ];
    let envs = crate::scale_test::sizes(smoke, &sizes);
    let mut report = SCALE.run(smoke, envs)?;
    print_table(&report);
    // A debug build's memory says nothing of the release agent's.
    if !smoke {
        report["sizing"] = crate::sizing::check(&report)?;
    }
    Ok(report)
}

/// Column widths of the tables: the run's name, then the figures.
const WIDTHS: [usize; 10] = [14, 8, 7, 10, 9, 9, 12, 12, 8, 10];

/// One table line: the first cell left-aligned, the others right-aligned.
fn print_row(cells: &[String]) {
    let line: Vec<String> = cells
        .iter()
        .zip(WIDTHS)
        .enumerate()
        .map(|(k, (cell, width))| {
            if k == 0 {
                format!("{cell:<width$}")
            } else {
                format!("{cell:>width$}")
            }
        })
        .collect();
    println!("{}", line.join(" "));
}

fn print_table(report: &serde_json::Value) {
    let ms = |v: &serde_json::Value| v.as_f64().map_or("-".into(), |x| format!("{x:.1}"));
    let header =
        |cells: &[&str]| print_row(&cells.iter().map(|c| c.to_string()).collect::<Vec<_>>());
    // The Kubernetes source's runs are at the top of the report, the mesh file's under
    // "mesh_file"; a source left out by LATTICE_BENCH_SOURCES has none.
    let sections = [("kube", report), ("file", &report["mesh_file"])];
    let runs = || {
        sections.iter().flat_map(|(source, section)| {
            ["baseline", "full"]
                .into_iter()
                .map(move |run| (format!("{source} {run}"), &section[run]))
                .filter(|(_, r)| !r.is_null())
        })
    };
    header(&[
        "xds",
        "services",
        "clients",
        "sync ms",
        "p50 ms",
        "p99 ms",
        "sotw B/chg",
        "delta B/chg",
        "RSS MiB",
        "cpu ms/chg",
    ]);
    for (run, r) in runs() {
        print_row(&[
            run,
            r["services"].to_string(),
            r["clients"].to_string(),
            ms(&r["initial_sync_ms"]),
            ms(&r["change_to_all_clients_ms"]["p50"]),
            ms(&r["change_to_all_clients_ms"]["p99"]),
            ms(&r["bytes_per_change_per_client"]["sotw_mean"]),
            ms(&r["bytes_per_change_per_client"]["delta_mean"]),
            ms(&r["agent_rss_mib"]["after_changes"]),
            ms(&r["agent_cpu_ms_per_change"]),
        ]);
    }
    // The real Envoy's own figures (already counted in the sync and p50/p99 above).
    header(&[
        "envoy", "services", "ads", "sync ms", "p50 ms", "p99 ms", "max ms", "timed by", "RSS MiB",
    ]);
    for (run, r) in runs() {
        let envoy = &r["envoy"];
        if envoy.is_null() {
            continue;
        }
        print_row(&[
            run,
            r["services"].to_string(),
            envoy["mode"].as_str().unwrap_or("-").to_string(),
            ms(&envoy["initial_sync_ms"]),
            ms(&envoy["change_ms"]["p50"]),
            ms(&envoy["change_ms"]["p99"]),
            ms(&envoy["change_ms"]["max"]),
            envoy["change_timed_by"]
                .as_str()
                .unwrap_or("poll")
                .to_string(),
            ms(&envoy["rss_mib"]["after_changes"]),
        ]);
    }
    // Agent restart (kill -9) until every synthetic client is consistent again.
    header(&[
        "restart",
        "services",
        "clients",
        "ms",
        "runs ms",
        "ready ms",
        "delta B",
        "delta max B",
        "sotw B",
    ]);
    for (run, r) in runs() {
        let restart = &r["restart"];
        print_row(&[
            run,
            r["services"].to_string(),
            r["clients"].to_string(),
            ms(&restart["consistent_ms"]),
            run_range(&restart["runs"]),
            ms(&restart["agent_ready_ms"]),
            ms(&restart["bytes_per_delta_client"]),
            ms(&restart["bytes_per_delta_client_max"]),
            ms(&restart["bytes_per_sotw_client"]),
        ]);
    }
    for (source, section) in sections {
        if !section["full"].is_null() {
            println!(
                "cost of one change, full vs baseline ({source}): {}",
                section["cost_ratio_full_vs_baseline"]
            );
        }
    }
    print_scoped(report);
}

/// The least and the most `consistent_ms` of a restart's runs (the row shows the median).
fn run_range(runs: &serde_json::Value) -> String {
    let times: Vec<f64> = runs
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|run| run["consistent_ms"].as_f64())
        .collect();
    let least = times.iter().copied().reduce(f64::min);
    let most = times.iter().copied().reduce(f64::max);
    match least.zip(most) {
        Some((least, most)) => format!("{least:.0}–{most:.0}"),
        None => "-".into(),
    }
}

/// The scoped run beside the unscoped full run of the same source and size.
fn print_scoped(report: &serde_json::Value) {
    let (full, scoped) = (&report["full"], &report["scoped"]);
    if scoped.is_null() {
        return;
    }
    let num = |v: &serde_json::Value| v.as_f64().map_or("-".into(), |x| format!("{x:.1}"));
    let ratio = |v: &serde_json::Value| v.as_f64().map_or("-".into(), |x| format!("{x:.3}"));
    let at = |v: &serde_json::Value, path: &[&str]| path.iter().fold(v, |v, k| &v[*k]).clone();
    println!(
        "scoped (kube, {} services, {} clients, {} services each, {} in some scope):",
        scoped["services"], scoped["clients"], scoped["scope"], scoped["services_in_some_scope"]
    );
    println!("{:<34} {:>12} {:>12} {:>8}", "", "full", "scoped", "ratio");
    let ratios = &report["scoped_vs_full"];
    let rows: [(&str, &[&str], &[&str], &str); 9] = [
        (
            "initial sync ms",
            &["initial_sync_ms"],
            &["initial_sync_ms"],
            "initial_sync",
        ),
        (
            "bytes at sync per SotW client",
            &["bytes_per_client_at_sync", "sotw_mean"],
            &["bytes_per_client_at_sync", "sotw_mean"],
            "bytes_at_sync_sotw",
        ),
        (
            "bytes at sync per Delta client",
            &["bytes_per_client_at_sync", "delta_mean"],
            &["bytes_per_client_at_sync", "delta_mean"],
            "bytes_at_sync_delta",
        ),
        (
            "change p50 ms",
            &["change_to_all_clients_ms", "p50"],
            &["change_to_all_holders_ms", "p50"],
            "change_p50",
        ),
        (
            "change p99 ms",
            &["change_to_all_clients_ms", "p99"],
            &["change_to_all_holders_ms", "p99"],
            "change_p99",
        ),
        (
            "agent RSS MiB synced",
            &["agent_rss_mib", "synced"],
            &["agent_rss_mib", "synced"],
            "agent_rss_synced",
        ),
        (
            "agent RSS MiB after changes",
            &["agent_rss_mib", "after_changes"],
            &["agent_rss_mib", "after_changes"],
            "agent_rss_after_changes",
        ),
        (
            "agent CPU ms per change",
            &["agent_cpu_ms_per_change"],
            &["agent_cpu_ms_per_change"],
            "agent_cpu_per_change",
        ),
        (
            "Envoy RSS MiB synced",
            &["envoy", "rss_mib", "synced"],
            &["envoy", "rss_mib", "synced"],
            "envoy_rss_synced",
        ),
    ];
    for (name, full_path, scoped_path, key) in rows {
        println!(
            "{name:<34} {:>12} {:>12} {:>8}",
            num(&at(full, full_path)),
            num(&at(scoped, scoped_path)),
            ratio(&ratios[key])
        );
    }
    let receivers = &scoped["change_receivers"];
    println!(
        "scoped changes: {} clients received of {} holding ({} others received)",
        receivers["clients_received_total"],
        receivers["clients_holding_total"],
        receivers["other_clients_received_total"]
    );
    let dns = &scoped["dns"];
    let num = |v: &serde_json::Value| v.as_f64().map_or("-".into(), |x| format!("{x:.2}"));
    println!(
        "scoped DNS ({} lookups): first p50/p99 {}/{} ms, repeated {}/{} ms, p99 difference {} ms; \
         {} held by the proxy at the answer",
        dns["lookups"],
        num(&dns["first_ms"]["p50"]),
        num(&dns["first_ms"]["p99"]),
        num(&dns["repeated_ms"]["p50"]),
        num(&dns["repeated_ms"]["p99"]),
        num(&dns["p99_first_minus_repeated_ms"]),
        dns["held_by_proxy_at_answer"]
    );
}
