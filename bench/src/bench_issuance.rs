//! `cargo xtask bench` for workload certificates: runs the ignored test of
//! `tests/tests/issuance_bench.rs` (a node's pods, each of its own service account, opening
//! verified ADS streams at once and asking for their certificates) and returns its figures:
//! the agent's CPU for the streams alone and with a certificate issued to each pod, their
//! ratio, and when the last pod held its certificate. A smoke run takes 10 pods, with a debug
//! build.

use crate::scale_test::ScaleTest;

const BENCH: ScaleTest<'static> = ScaleTest {
    file: "issuance_bench",
    test: "certificates_for_a_nodes_pods_at_once",
    marker: "BENCH_ISSUANCE_JSON ",
};

pub fn run(smoke: bool) -> anyhow::Result<serde_json::Value> {
    let sizes = [
        ("LATTICE_BENCH_ISSUANCE_PODS", "10", "110"),
        ("LATTICE_BENCH_ISSUANCE_ROUNDS", "1", "5"),
    ];
    let envs = crate::scale_test::sizes(smoke, &sizes);
    let report = BENCH.run(smoke, envs)?;
    let with = &report["with_certificates"];
    println!(
        "issuance: {} pods, agent CPU {:.3} s with certificates ({:.2} ms a pod) against {:.3} s \
         for the streams alone (×{:.2}); the last pod certified after {:.0} ms",
        report["pods"],
        with["agent_cpu_s"].as_f64().unwrap_or(f64::NAN),
        with["agent_cpu_ms_per_pod"].as_f64().unwrap_or(f64::NAN),
        report["streams_only"]["agent_cpu_s"]
            .as_f64()
            .unwrap_or(f64::NAN),
        report["cpu_ratio"].as_f64().unwrap_or(f64::NAN),
        with["all_certified_ms"].as_f64().unwrap_or(f64::NAN),
    );
    let remote = &report["with_istio_ca"];
    println!(
        "issuance from Istio's certificate service: agent CPU {:.3} s ({:.2} ms a pod, ×{:.2} \
         signing on the spot); the last pod certified after {:.0} ms",
        remote["agent_cpu_s"].as_f64().unwrap_or(f64::NAN),
        remote["agent_cpu_ms_per_pod"].as_f64().unwrap_or(f64::NAN),
        report["istio_ca_cpu_ratio"].as_f64().unwrap_or(f64::NAN),
        remote["all_certified_ms"].as_f64().unwrap_or(f64::NAN),
    );
    Ok(report)
}
