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
    for (source, section) in [("kube", report), ("file", &report["mesh_file"])] {
        let run = &section["full"];
        let (Some(services), Some(clients), Some(peak)) = (
            run["services"].as_u64(),
            run["clients"].as_u64(),
            run["agent_rss_mib"]["peak"].as_f64(),
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
        println!(
            "sizing ({source}): {services} services, {proxies} proxies: the agent peaked at \
             {peak:.0} MiB; {DOC} says {:.0} MiB measured, limit {:.0} MiB ({allowed:.0} MiB \
             allowed)",
            row.peak_mib, row.limit_mib
        );
        if peak > allowed {
            bail!(
                "the agent peaked at {peak:.0} MiB at {services} services and {proxies} proxies, \
                 over {:.0}% of the {:.0} MiB limit {DOC} gives: raise the row's limit (and the \
                 DaemonSet's, if it is the 10k row) or find what grew",
                MOST_OF_LIMIT * 100.0,
                row.limit_mib
            );
        }
        checked.push(json!({
            "source": source,
            "services": services,
            "proxies": proxies,
            "peak_mib": peak,
            "documented_peak_mib": row.peak_mib,
            "limit_mib": row.limit_mib,
        }));
    }
    Ok(Value::Array(checked))
}
