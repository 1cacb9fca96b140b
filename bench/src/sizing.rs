//! The agent's sizing table in docs/install.md, held to what the xDS benchmark measures: a
//! full run finds the table's row for its size (services and proxies) and fails when the
//! agent's peak resident set left less headroom under the row's memory limit than the table
//! promises, so the table (and the DaemonSet's limit, which the deploy test holds to the
//! table) cannot silently fall behind the agent.

use anyhow::bail;
use serde_json::{Value, json};

use lattice_e2e::sizing::{DOC, MOST_OF_LIMIT, read};

/// Checks a full xDS run's peaks against the table's row for its size.
pub fn check(report: &Value) -> anyhow::Result<Value> {
    let rows = read(&xtask::workspace_root())?;
    let mut checked = Vec::new();
    let mut over = Vec::new();
    for (source, section) in [("kube", report), ("file", &report["mesh_file"])] {
        let run = &section["full"];
        // The agent that synced and took the changes, or one restarted after a kill -9,
        // whichever held more: a restart reads the node's last mesh beside the lists and
        // takes every proxy's reconnect at once.
        let rss = &run["agent_rss_mib"];
        let (synced, restarted) = (rss["peak"].as_f64(), rss["restarted_peak"].as_f64());
        let (Some(services), Some(clients), Some(peak)) = (
            run["services"].as_u64(),
            run["clients"].as_u64(),
            synced.into_iter().chain(restarted).reduce(f64::max),
        ) else {
            continue;
        };
        // The synthetic clients and the one real Envoy.
        let proxies = clients + 1;
        let Some(row) = rows
            .iter()
            .find(|r| r.services == services && r.proxies == proxies)
        else {
            println!(
                "sizing: no row in {DOC} for {services} services and {proxies} proxies \
                 (the agent peaked at {peak:.0} MiB)"
            );
            continue;
        };
        let allowed = row.limit_mib * MOST_OF_LIMIT;
        let mib = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
        println!(
            "sizing ({source}): {services} services, {proxies} proxies: the agent peaked at \
             {peak:.0} MiB ({} synced, {} restarted); {DOC} says {:.0} MiB measured, limit \
             {:.0} MiB ({allowed:.0} MiB allowed)",
            mib(synced),
            mib(restarted),
            row.peak_mib,
            row.limit_mib
        );
        if peak > allowed {
            over.push(format!(
                "{source}: the agent peaked at {peak:.0} MiB at {services} services and \
                 {proxies} proxies, over {:.0}% of the {:.0} MiB limit {DOC} gives",
                MOST_OF_LIMIT * 100.0,
                row.limit_mib
            ));
        }
        checked.push(json!({
            "source": source,
            "services": services,
            "proxies": proxies,
            "peak_mib": peak,
            "synced_peak_mib": synced,
            "restarted_peak_mib": restarted,
            "documented_peak_mib": row.peak_mib,
            "limit_mib": row.limit_mib,
        }));
    }
    if !over.is_empty() {
        bail!(
            "{}: raise the row's limit (and the DaemonSet's, if it is the 10k row) or find what \
             grew",
            over.join("; ")
        );
    }
    Ok(Value::Array(checked))
}
