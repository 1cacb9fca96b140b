//! `cargo xtask bench` for mesh mTLS: runs the ignored test of `tests/tests/mtls_bench.rs` (one
//! meshed pod calling another through real Envoys, plaintext and mTLS alternating, to the same
//! pod) and returns its figures: requests over a kept-alive connection and new connections, each
//! as exchanges per second and p50 / p99 latency, with the ratios mTLS / plaintext. A smoke run
//! takes one round of one second per kind, with a debug build.

use crate::scale_test::ScaleTest;

const BENCH: ScaleTest<'static> = ScaleTest {
    file: "mtls_bench",
    test: "mtls_against_plaintext_through_the_mesh",
    marker: "BENCH_MTLS_JSON ",
};

pub fn run(smoke: bool) -> anyhow::Result<serde_json::Value> {
    let sizes = [
        ("LATTICE_BENCH_MTLS_SECONDS", "1", "5"),
        ("LATTICE_BENCH_MTLS_ROUNDS", "1", "2"),
    ];
    let envs = crate::scale_test::sizes(smoke, &sizes);
    let report = BENCH.run(smoke, envs)?;
    for load in ["requests", "connections"] {
        let figures = &report[load];
        let show = |kind: &str| {
            let f = &figures[kind];
            format!(
                "{kind}: {:.0}/s, p50 {:.2} ms, p99 {:.2} ms, {} failed",
                f["per_second"].as_f64().unwrap_or(f64::NAN),
                f["p50_ms"].as_f64().unwrap_or(f64::NAN),
                f["p99_ms"].as_f64().unwrap_or(f64::NAN),
                f["failed"]
            )
        };
        println!(
            "mtls {load}: {}; {}; rate ×{:.2}, p99 ×{:.2}",
            show("plaintext"),
            show("mtls"),
            figures["rps_ratio"].as_f64().unwrap_or(f64::NAN),
            figures["p99_ratio"].as_f64().unwrap_or(f64::NAN)
        );
    }
    Ok(report)
}
