//! `cargo xtask bench` for the Kubernetes source: runs the ignored scale test of
//! `tests/tests/kube.rs` (the real agent against the fake API server) and returns the figures it
//! prints: time from start to ready and the agent's RSS with 10k services and 100k endpoints.
//! A smoke run uses 1000 services and a debug build, to check the bench itself works.

use crate::scale_test::ScaleTest;

const SCALE: ScaleTest<'static> = ScaleTest {
    file: "kube",
    test: "scale_10k_services_100k_endpoints_rss_and_time_to_ready",
    marker: "BENCH_KUBE_JSON ",
};

pub fn run(smoke: bool) -> anyhow::Result<serde_json::Value> {
    let services = if smoke { "1000" } else { "10000" };
    SCALE.run(
        smoke,
        [("LATTICE_BENCH_SERVICES".to_string(), services.to_string())],
    )
}
