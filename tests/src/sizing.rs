//! The agent's sizing table in docs/install.md (services and proxies to the agent's peak
//! memory and the limit to give it), read by the xDS benchmark, which holds it to what it
//! measures, and by the deploy test, which holds the DaemonSet's memory to it.

use std::path::Path;

use anyhow::{Context as _, bail};

/// Where the table is, and the heading it sits under.
pub const DOC: &str = "docs/install.md";
pub const HEADING: &str = "### Sizing the agent's memory";

/// One row: the mesh and proxies it is for, the peak measured there, and the limit given.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub services: u64,
    pub proxies: u64,
    pub peak_mib: f64,
    pub limit_mib: f64,
}

/// The peak may use at most this share of the limit: the rest is for what the benchmark does
/// not drive (hostile clients within their bounds, the DNS cache filling, allocator slack).
pub const MOST_OF_LIMIT: f64 = 0.6;

/// The table's rows, read from the text of docs/install.md.
pub fn table(doc: &str) -> anyhow::Result<Vec<Row>> {
    let section = doc
        .split_once(HEADING)
        .with_context(|| format!("{DOC} has no heading {HEADING:?}"))?
        .1;
    let number = |cell: &str| -> anyhow::Result<f64> {
        let digits: String = cell
            .chars()
            .filter(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        digits
            .parse()
            .with_context(|| format!("{DOC}: {cell:?} in the sizing table is not a number"))
    };
    let mut rows = Vec::new();
    for line in section.lines().skip_while(|l| !l.starts_with('|')) {
        if !line.starts_with('|') {
            break;
        }
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        // The header and the alignment row.
        if cells
            .first()
            .is_none_or(|c| !c.starts_with(|ch: char| ch.is_ascii_digit()))
        {
            continue;
        }
        let [services, proxies, peak, limit] = cells[..] else {
            bail!(
                "{DOC}: a sizing row has {} cells, not 4: {line}",
                cells.len()
            );
        };
        rows.push(Row {
            services: number(services)? as u64,
            proxies: number(proxies)? as u64,
            peak_mib: number(peak)?,
            limit_mib: number(limit)?,
        });
    }
    if rows.is_empty() {
        bail!("{DOC}: the sizing table has no rows");
    }
    Ok(rows)
}

/// The table of the repository at `workspace`.
pub fn read(workspace: &Path) -> anyhow::Result<Vec<Row>> {
    let doc =
        std::fs::read_to_string(workspace.join(DOC)).with_context(|| format!("reading {DOC}"))?;
    table(&doc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_reads_as_install_md_writes_it() {
        let doc = format!(
            "intro\n\n{HEADING}\n\nText.\n\n| services | proxies | peak | limit |\n|---:|---:|---:|---:|\n\
             | 1,000 | 101 | 40 MiB | 128 MiB |\n| 10,000 | 101 | 160.5 MiB | 512 MiB |\n\nAfter.\n| 9 | 9 | 9 | 9 |\n"
        );
        let rows = table(&doc).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(
            rows[1],
            Row {
                services: 10_000,
                proxies: 101,
                peak_mib: 160.5,
                limit_mib: 512.0
            }
        );
    }

    #[test]
    fn the_real_table_parses() {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        assert!(
            read(&workspace)
                .unwrap()
                .iter()
                .any(|r| r.services == 10_000)
        );
    }
}
