//! `cargo xtask bench --only hostile`: hostile clients beside honest ones, in three parts: the
//! xDS server's, the DNS server's ([`crate::bench_hostile_dns`]) and the mesh file's
//! ([`crate::bench_hostile_file`]). The xDS part runs
//! the ignored test of `tests/tests/xds_hostile.rs` (the real agent at 10k services from a mesh
//! file, a real Envoy timed by its ACKs, and the hostile clients: a 10M-name subscription,
//! 4000 streams from one address, 100 clients that never read, streams that never send a first
//! request, garbage in place of HTTP/2) and returns the figures it prints: the agent's RSS
//! quiet, at its peak under attack and after the attackers went, the Envoy's change p50 and
//! p99 quiet and under attack, and the agent's refusal counters. Sizes from the environment,
//! as the xDS benchmark's (see `run`); `LATTICE_BENCH_HOSTILE_ATTACKS` chooses the attacks. A
//! smoke run uses 100 services, 10 changes and small attacks, and a debug build.
//! `LATTICE_BENCH_HOSTILE_PARTS` (a comma-separated list of `xds`, `dns`, `file`; all three
//! when unset) runs some parts only, so one part can be measured again in a minute.

use crate::scale_test::ScaleTest;

const XDS: ScaleTest<'static> = ScaleTest {
    file: "xds_hostile",
    test: "xds_hostile_clients_beside_an_honest_envoy",
    marker: "BENCH_HOSTILE_XDS_JSON ",
};

/// The parts, as `LATTICE_BENCH_HOSTILE_PARTS` names them.
const PARTS: [&str; 3] = ["xds", "dns", "file"];

pub fn run(smoke: bool) -> anyhow::Result<serde_json::Value> {
    let parts = parts(std::env::var("LATTICE_BENCH_HOSTILE_PARTS").ok().as_deref())?;
    let mut report = serde_json::Map::new();
    if parts.contains(&"xds") {
        report.insert("xds".into(), xds(smoke)?);
    }
    if parts.contains(&"dns") {
        report.insert("dns".into(), crate::bench_hostile_dns::run(smoke)?);
    }
    if parts.contains(&"file") {
        report.insert("mesh_file".into(), crate::bench_hostile_file::run(smoke)?);
    }
    Ok(report.into())
}

/// The parts `chosen` names (all when unset or empty), or an error naming an unknown one.
fn parts(chosen: Option<&str>) -> anyhow::Result<Vec<&'static str>> {
    let Some(chosen) = chosen.filter(|c| !c.trim().is_empty()) else {
        return Ok(PARTS.to_vec());
    };
    chosen
        .split(',')
        .map(|name| {
            PARTS
                .into_iter()
                .find(|part| *part == name.trim())
                .ok_or_else(|| {
                    anyhow::anyhow!(
                        "LATTICE_BENCH_HOSTILE_PARTS: unknown part {name:?}; the parts are {}",
                        PARTS.join(", ")
                    )
                })
        })
        .collect()
}

fn xds(smoke: bool) -> anyhow::Result<serde_json::Value> {
    // (variable, smoke, full); a variable already set in the environment wins.
    let sizes = [
        ("LATTICE_BENCH_SERVICES", "100", "10000"),
        ("LATTICE_BENCH_CHANGES", "10", "100"),
        ("LATTICE_BENCH_HOSTILE_NAMES", "100000", "10000000"),
        ("LATTICE_BENCH_HOSTILE_STREAMS", "200", "4000"),
        ("LATTICE_BENCH_HOSTILE_IDLE", "10", "100"),
        ("LATTICE_BENCH_HOSTILE_SILENT", "20", "400"),
        ("LATTICE_BENCH_HOSTILE_GARBAGE", "20", "1000"),
    ];
    let envs = crate::scale_test::sizes(smoke, &sizes);
    let xds = XDS.run(smoke, envs)?;
    print_summary(&xds);
    Ok(xds)
}

fn print_summary(xds: &serde_json::Value) {
    let mib = &xds["agent_rss_mib"];
    let change = &xds["envoy_change_ms"];
    let f = |v: &serde_json::Value| v.as_f64().map_or("-".into(), |x| format!("{x:.1}"));
    println!(
        "xDS, {} services: agent RSS {} MiB quiet (peak {}), {} at the peak under attack (+{} \
         over the quiet peak), {} after ({}x); Envoy change p99 {} ms quiet, {} under attack ({}x)",
        xds["services"],
        f(&mib["quiet"]),
        f(&mib["quiet_peak"]),
        f(&mib["attack_peak"]),
        f(&mib["growth_over_quiet_peak"]),
        f(&mib["after"]),
        f(&mib["after_vs_quiet"]),
        f(&change["quiet"]["p99"]),
        f(&change["under_attack"]["p99"]),
        f(&change["p99_ratio"]),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_all_three_unless_some_are_named() {
        assert_eq!(parts(None).unwrap(), PARTS);
        assert_eq!(parts(Some("")).unwrap(), PARTS);
        assert_eq!(parts(Some("dns")).unwrap(), ["dns"]);
        assert_eq!(parts(Some("file, xds")).unwrap(), ["file", "xds"]);
        assert!(parts(Some("dns,bogus")).is_err());
    }
}
