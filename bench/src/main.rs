//! `lattice-bench`: the benchmarks side by side with their peers, and the demo. `cargo xtask
//! bench` and `cargo xtask demo` build it with the workspace and run it; it needs the end-to-end
//! harness (network namespaces, the real binaries, Envoy), which xtask itself does not link.

mod bench_dns;
mod bench_hostile;
mod bench_hostile_dns;
mod bench_hostile_file;
mod bench_init;
mod bench_issuance;
mod bench_kube;
mod bench_mtls;
mod bench_xds;
mod demo;
mod scale_test;
mod sizing;

use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use xtask::{version_of, workspace_root};

#[derive(Parser)]
#[command(name = "lattice-bench", about = "Lattice benchmarks and demo")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Run the benchmarks and write JSON under target/bench/.
    Bench {
        /// Small sizes and short runs: checks the benchmarks work, measures little.
        #[arg(long)]
        smoke: bool,
        /// Only these parts (dns, translate, kube, xds, init, hostile, mtls, issuance); all when empty.
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
    },
    /// The whole data path on a simulated node, narrated. Needs root.
    Demo,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().task {
        Task::Bench { smoke, only } => bench_parts(smoke, &only),
        Task::Demo => demo::run(),
    }
}

/// A scratch directory for a benchmark (`lattice-bench-<label>-<pid>` under the temporary
/// directory), removed on drop.
struct WorkDir(std::path::PathBuf);

impl WorkDir {
    fn new(label: &str) -> anyhow::Result<Self> {
        let path =
            std::env::temp_dir().join(format!("lattice-bench-{label}-{}", std::process::id()));
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self(path))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A benchmark part: `smoke` → its figures.
type BenchPart = fn(bool) -> anyhow::Result<serde_json::Value>;

/// Runs the chosen benchmark parts (all when `only` is empty) and writes their JSON report.
fn bench_parts(smoke: bool, only: &[String]) -> anyhow::Result<()> {
    let runners: [(&str, BenchPart); 8] = [
        ("dns", bench_dns::run),
        ("translate", bench_dns::during_translation),
        ("kube", bench_kube::run),
        ("xds", bench_xds::run),
        ("init", bench_init::run),
        ("hostile", bench_hostile::run),
        ("mtls", bench_mtls::run),
        ("issuance", bench_issuance::run),
    ];
    if let Some(unknown) = only
        .iter()
        .find(|o| !runners.iter().any(|(part, _)| part == o))
    {
        let parts: Vec<&str> = runners.iter().map(|(part, _)| *part).collect();
        bail!(
            "unknown benchmark part {unknown:?}; the parts are {}",
            parts.join(", ")
        );
    }
    let wanted = |part: &str| only.is_empty() || only.iter().any(|o| o == part);
    let mut results = serde_json::Map::new();
    let kernel = Command::new("uname")
        .arg("-r")
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .unwrap_or_default();
    results.insert(
        "machine".to_string(),
        serde_json::json!({
            "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "kernel": kernel,
            // The real Envoy the xDS benchmark runs beside its synthetic clients.
            "envoy": version_of(&lattice_e2e::envoy::binary().to_string_lossy(), &["--version"]),
            "smoke": smoke,
        }),
    );
    for (part, run) in runners.into_iter().filter(|(part, _)| wanted(part)) {
        let started = std::time::Instant::now();
        let mut report = run(smoke).with_context(|| format!("the {part} benchmark failed"))?;
        let seconds = started.elapsed().as_secs_f64();
        eprintln!("lattice-bench: bench {part} took {seconds:.1} s");
        report["bench_seconds"] = serde_json::json!(seconds);
        results.insert(part.to_string(), report);
    }
    let dir = workspace_root().join("target/bench");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(if smoke { "smoke.json" } else { "latest.json" });
    std::fs::write(&path, serde_json::to_string_pretty(&results)?)?;
    println!("results written to {}", path.display());
    Ok(())
}
