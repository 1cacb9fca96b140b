//! `cargo xtask bench` — init: the real `lattice-init` (release; debug for a smoke
//! run) in network namespaces this benchmark creates, once per iptables backend installed (nft,
//! legacy). Each iteration takes a fresh namespace and times three runs of the binary:
//!
//! - **apply**: the arguments of a mesh pod's initContainer (forced backend, node id, xDS
//!   address, bootstrap file) on the namespace as created: no tables, no rules;
//! - **re-run**: the same arguments again; a no-op when `iptables-save` of the namespace (every
//!   backend, both families, comment lines dropped) is byte-identical before and after;
//! - **cleanup**: `--cleanup`, which looks at every backend; the ruleset is then compared with
//!   the one before apply (tables the kernel instantiated and left empty do not count).
//!
//! A time is the process's wall time, from spawn to exit, spawned from a thread inside the
//! namespace (as a container runtime starts it, without `ip netns exec`); the time
//! `lattice-init` logs for its own work (`elapsed_ms`) is reported next to it. Nothing leaves
//! the namespaces, and each is deleted when its iteration ends, also on an error.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Instant;

use anyhow::{Context as _, bail, ensure};
use lattice_e2e::iptables::{self, without_empty_tables};
use lattice_e2e::netns::Netns;
use serde_json::{Value, json};

/// Runs the benchmark and returns its figures. Iterations: 50, or 5 for a smoke run;
/// `LATTICE_BENCH_INIT_ITERATIONS` overrides.
pub fn run(smoke: bool) -> anyhow::Result<Value> {
    ensure!(
        nix::unistd::geteuid().is_root(),
        "the init benchmark creates network namespaces: run it as root"
    );
    let iterations: usize = match std::env::var("LATTICE_BENCH_INIT_ITERATIONS") {
        Ok(value) => value
            .parse()
            .with_context(|| format!("LATTICE_BENCH_INIT_ITERATIONS={value}"))?,
        Err(_) if smoke => 5,
        Err(_) => 50,
    };
    ensure!(iterations > 0, "LATTICE_BENCH_INIT_ITERATIONS must be > 0");
    let binary = xtask::built_executable("lattice-init", !smoke)?;
    let backends = iptables::backends();
    ensure!(
        !backends.is_empty(),
        "no iptables backend installed (apt install iptables)"
    );
    let work = crate::WorkDir::new("init")?;
    // Ctrl-C ends the run between iterations (or fails the running one), so the namespace of
    // the iteration is deleted rather than left behind.
    xtask::catch_interrupts()?;
    let mut report = serde_json::Map::new();
    for backend in &backends {
        let mut samples = Samples::default();
        for _ in 0..iterations {
            if xtask::interrupted() {
                bail!("init benchmark interrupted");
            }
            iteration(&binary, backend, work.path(), &mut samples)
                .with_context(|| format!("init benchmark, {backend} backend"))?;
        }
        report.insert(backend.to_string(), samples.report());
    }
    let mut versions = serde_json::Map::new();
    for backend in &backends {
        versions.insert(
            format!("iptables-{backend}"),
            xtask::version_of(&format!("iptables-{backend}"), &["--version"]).into(),
        );
    }
    let report = json!({
        "backends": report,
        "setup": {
            "iterations": iterations,
            "build": if smoke { "debug" } else { "release" },
            "apply_args": apply_args(backends[0], Path::new("<dir>/bootstrap.json")),
            "cleanup_args": ["--cleanup"],
            "namespace": "a fresh network namespace per iteration (loopback up, no rules)",
            "time": "wall time of the lattice-init process, spawn to exit, spawned inside the namespace; in_process: its own elapsed_ms log",
            "versions": versions,
        },
    });
    print_table(&report);
    Ok(report)
}

fn apply_args(backend: &str, bootstrap: &Path) -> Vec<String> {
    [
        "--iptables-backend",
        backend,
        "--node-id",
        "bench-0.bench",
        "--xds-address",
        "127.0.0.1:15010",
        "--bootstrap-out",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([bootstrap.display().to_string()])
    .collect()
}

#[derive(Default)]
struct Samples {
    apply: Vec<f64>,
    apply_in_process: Vec<f64>,
    rerun: Vec<f64>,
    rerun_in_process: Vec<f64>,
    cleanup: Vec<f64>,
    cleanup_in_process: Vec<f64>,
    runs: usize,
    rerun_noop: usize,
    rerun_said_nothing_to_apply: usize,
    cleanup_restored: usize,
}

impl Samples {
    fn report(&self) -> Value {
        json!({
            "iterations": self.runs,
            "apply_ms": stats(&self.apply),
            "apply_in_process_ms": stats(&self.apply_in_process),
            "rerun_ms": stats(&self.rerun),
            "rerun_in_process_ms": stats(&self.rerun_in_process),
            "cleanup_ms": stats(&self.cleanup),
            "cleanup_in_process_ms": stats(&self.cleanup_in_process),
            "rerun_is_noop": self.rerun_noop == self.runs,
            "rerun_logged_nothing_to_apply": self.rerun_said_nothing_to_apply == self.runs,
            "cleanup_restores_ruleset": self.cleanup_restored == self.runs,
        })
    }
}

/// One fresh namespace: apply, re-run, cleanup. The namespace is deleted when this returns,
/// whatever happened.
fn iteration(
    binary: &Path,
    backend: &str,
    dir: &Path,
    samples: &mut Samples,
) -> anyhow::Result<()> {
    let ns = Netns::new("bench-init")?;
    let args = apply_args(backend, &dir.join("bootstrap.json"));
    let before = iptables::snapshot(&ns)?;

    let (apply, apply_log) = timed(&ns, binary, &args)?;
    let installed = iptables::snapshot(&ns)?;
    ensure!(
        installed.contains("-A OUTPUT -j LATTICE_OUTPUT\n"),
        "apply installed no capture rules:\n{installed}"
    );

    let (rerun, rerun_log) = timed(&ns, binary, &args)?;
    let after_rerun = iptables::snapshot(&ns)?;

    let (cleanup, cleanup_log) = timed(&ns, binary, &["--cleanup".to_string()])?;
    let after_cleanup = iptables::snapshot(&ns)?;

    samples.runs += 1;
    samples.apply.push(apply);
    samples.rerun.push(rerun);
    samples.cleanup.push(cleanup);
    samples.apply_in_process.extend(logged_elapsed(&apply_log));
    samples.rerun_in_process.extend(logged_elapsed(&rerun_log));
    samples
        .cleanup_in_process
        .extend(logged_elapsed(&cleanup_log));
    samples.rerun_noop += usize::from(after_rerun == installed);
    samples.rerun_said_nothing_to_apply += usize::from(rerun_log.contains("nothing to apply"));
    samples.cleanup_restored +=
        usize::from(without_empty_tables(&after_cleanup) == without_empty_tables(&before));
    Ok(())
}

/// Runs `binary args` from a thread inside `ns`; returns its wall time in ms and its log.
fn timed(ns: &Netns, binary: &Path, args: &[String]) -> anyhow::Result<(f64, String)> {
    let (output, ms) = ns.enter(|| -> std::io::Result<(Output, f64)> {
        let mut command = Command::new(binary);
        command
            .args(args)
            .env("RUST_LOG", "info")
            .env_remove("HOST_IP")
            .env_remove("POD_NAME")
            .env_remove("POD_NAMESPACE")
            .stdin(Stdio::null());
        let started = Instant::now();
        let output = command.output()?;
        Ok((output, started.elapsed().as_secs_f64() * 1000.0))
    })??;
    let log = String::from_utf8_lossy(&output.stderr).into_owned();
    if !output.status.success() {
        bail!("lattice-init {args:?} failed ({}):\n{log}", output.status);
    }
    Ok((ms, log))
}

/// The `elapsed_ms` that `lattice-init` logs for its own work.
fn logged_elapsed(log: &str) -> Option<f64> {
    log.split("elapsed_ms=")
        .nth(1)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// p50, p99 and max of `samples` (ms), nearest rank; null when empty.
fn stats(samples: &[f64]) -> Value {
    if samples.is_empty() {
        return Value::Null;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let at = |p: f64| sorted[((sorted.len() - 1) as f64 * p).round() as usize];
    json!({
        "p50": at(0.50),
        "p99": at(0.99),
        "max": sorted[sorted.len() - 1],
        "samples": sorted.len(),
    })
}

fn print_table(report: &Value) {
    let ms = |v: &Value| v.as_f64().map_or("-".into(), |x| format!("{x:.1}"));
    println!(
        "{:<8} {:>5} {:>26} {:>26} {:>26} {:>7} {:>9}",
        "init",
        "runs",
        "apply p50/p99/max ms",
        "re-run p50/p99/max ms",
        "cleanup p50/p99/max ms",
        "no-op",
        "restored"
    );
    let Some(backends) = report["backends"].as_object() else {
        return;
    };
    for (backend, r) in backends {
        let cell = |key: &str| {
            let s = &r[key];
            format!("{} / {} / {}", ms(&s["p50"]), ms(&s["p99"]), ms(&s["max"]))
        };
        println!(
            "{:<8} {:>5} {:>26} {:>26} {:>26} {:>7} {:>9}",
            backend,
            r["iterations"].as_u64().unwrap_or(0),
            cell("apply_ms"),
            cell("rerun_ms"),
            cell("cleanup_ms"),
            r["rerun_is_noop"].to_string(),
            r["cleanup_restores_ruleset"].to_string(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_are_nearest_rank_percentiles() {
        let samples: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let s = stats(&samples);
        assert_eq!(s["p50"], 51.0);
        assert_eq!(s["p99"], 99.0);
        assert_eq!(s["max"], 100.0);
        assert_eq!(s["samples"], 100);
        assert_eq!(stats(&[]), Value::Null);
        assert_eq!(stats(&[3.0])["p99"], 3.0);
    }

    #[test]
    fn logged_elapsed_reads_the_init_log_field() {
        let log = "INFO lattice_init: capture rules in place elapsed_ms=4.25\n";
        assert_eq!(logged_elapsed(log), Some(4.25));
        assert_eq!(logged_elapsed("INFO nothing here"), None);
    }
}
