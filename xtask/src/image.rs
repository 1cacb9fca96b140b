//! The container image (deploy/Dockerfile) built with no registry: the Dockerfile's `runtime`
//! stage on a Debian base made locally with mmdebstrap, from binaries the workspace build made,
//! by podman with `--pull=never`. Used by `cargo xtask image` (release binaries, the user's
//! podman storage) and by the image test (the tests' debug binaries, a storage of its own).
//!
//! Everything here shells out (mmdebstrap, podman): this crate stays light (see lib.rs).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail, ensure};

use crate::workspace_root;

/// The Dockerfile both builds use, relative to the workspace root.
pub const DOCKERFILE: &str = "deploy/Dockerfile";

/// The programs the image holds, as the Dockerfile's `binaries` stage names them.
pub const PROGRAMS: &[&str] = &["lattice-agent", "lattice-init", "lattice"];

/// The Debian release of the Dockerfile's default base (debian:bookworm-slim).
const SUITE: &str = "bookworm";

/// A base older than this is made again, so that the image picks up Debian's security updates.
const BASE_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);

/// Where the base tarball is kept between runs: `<target dir>/image`, so that CI's cached
/// CARGO_TARGET_DIR (.ci/run) keeps it and `cargo clean` removes it.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
        .join("image")
}

/// The packages the Dockerfile's runtime stage installs (its `ARG PACKAGES="..."` line): the
/// one list both builds follow.
pub fn runtime_packages(dockerfile: &str) -> anyhow::Result<Vec<String>> {
    let line = dockerfile
        .lines()
        .map(str::trim)
        .find_map(|line| line.strip_prefix("ARG PACKAGES="))
        .with_context(|| format!("{DOCKERFILE} has no `ARG PACKAGES=\"...\"` line"))?;
    let list = line.trim_matches('"');
    let packages: Vec<String> = list.split_whitespace().map(str::to_string).collect();
    ensure!(
        !packages.is_empty()
            && packages.iter().all(|p| p
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))),
        "{DOCKERFILE}: ARG PACKAGES is not a list of Debian package names: {line}"
    );
    Ok(packages)
}

/// A Debian root filesystem made by mmdebstrap, as a tarball, and the name podman knows it by.
pub struct Base {
    pub tarball: PathBuf,
    pub name: String,
}

/// mmdebstrap's arguments for the base: debian:bookworm-slim's recipe (the minbase variant,
/// documentation and translations left out) plus `packages`, with /usr merged by symlinks
/// rather than by the usrmerge package (which would pull in perl).
fn mmdebstrap_args(packages: &[String]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--quiet",
        "--variant=minbase",
        "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
    ]
    .map(str::to_string)
    .to_vec();
    args.push(format!("--include={}", packages.join(",")));
    for option in [
        "path-exclude=/usr/share/doc/*",
        "path-include=/usr/share/doc/*/copyright",
        "path-exclude=/usr/share/man/*",
        "path-exclude=/usr/share/info/*",
        "path-exclude=/usr/share/locale/*",
        "path-exclude=/usr/share/lintian/*",
    ] {
        args.push(format!("--dpkgopt={option}"));
    }
    args.push(SUITE.to_string());
    args
}

/// FNV-1a: a hash that stays the same across Rust releases, unlike std's, so that a cached
/// base keeps its name.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The base for `packages`, from `cache` when it is there and younger than a week; else made
/// with mmdebstrap (about a minute; needs root and a Debian mirror) and older bases removed.
pub fn base(cache: &Path, packages: &[String]) -> anyhow::Result<Base> {
    let args = mmdebstrap_args(packages);
    let key = format!("{:016x}", fnv1a(&args.join("\n")));
    let tarball = cache.join(format!("base-{SUITE}-{key}.tar"));
    let name = format!("localhost/lattice-base:{SUITE}-{key}");
    let fresh = std::fs::metadata(&tarball)
        .ok()
        .filter(std::fs::Metadata::is_file)
        .and_then(|m| m.modified().ok())
        .and_then(|made| SystemTime::now().duration_since(made).ok())
        .is_some_and(|age| age < BASE_MAX_AGE);
    if fresh {
        eprintln!("xtask: base image {} (cached)", tarball.display());
        return Ok(Base { tarball, name });
    }
    if !crate::have("mmdebstrap") {
        bail!("mmdebstrap is missing (as root: apt-get install mmdebstrap)");
    }
    std::fs::create_dir_all(cache).with_context(|| format!("cannot create {}", cache.display()))?;
    let partial = cache.join(format!("partial-{}-{key}.tar", std::process::id()));
    let made = crate::run(
        Command::new("mmdebstrap")
            .arg("--format=tar")
            .args(&args)
            .arg(&partial)
            .stdin(Stdio::null()),
    );
    if let Err(err) = made {
        let _ = std::fs::remove_file(&partial);
        return Err(err);
    }
    if tarball.is_dir() {
        // What an older recipe may have left.
        let _ = std::fs::remove_dir_all(&tarball);
    }
    std::fs::rename(&partial, &tarball)
        .with_context(|| format!("cannot move the base to {}", tarball.display()))?;
    // One base on disk: the disk is shared.
    for entry in std::fs::read_dir(cache)?.flatten() {
        let path = entry.path();
        let file = entry.file_name().to_string_lossy().into_owned();
        if path != tarball && file.starts_with("base-") && file.ends_with(".tar") {
            let _ = std::fs::remove_file(&path);
        }
    }
    Ok(Base { tarball, name })
}

/// Labels of the image (org.opencontainers.image.*), passed as the Dockerfile's build args.
pub struct Labels {
    pub version: String,
    pub revision: String,
}

impl Labels {
    /// The workspace's version and the checkout's commit (with `-dirty` when it has changes).
    pub fn of_checkout() -> Labels {
        let git = |args: &[&str]| {
            Command::new("git")
                .args(args)
                .current_dir(workspace_root())
                .stderr(Stdio::null())
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        };
        let revision = match (git(&["rev-parse", "HEAD"]), git(&["status", "--porcelain"])) {
            (Some(head), Some(status)) if !status.is_empty() => format!("{head}-dirty"),
            (Some(head), _) => head,
            (None, _) => "unknown".to_string(),
        };
        Labels {
            version: env!("CARGO_PKG_VERSION").to_string(),
            revision,
        }
    }
}

/// podman with a containers.conf of its own (the `runc` runtime where installed, ulimits the
/// machine allows), leaving the machine's configuration alone; with a storage of its own too
/// when isolated. Removes what it made on drop: the whole storage when isolated, else only its
/// configuration (the user keeps the image).
pub struct Podman {
    dir: PathBuf,
    isolated: bool,
}

impl Podman {
    /// The machine's image storage (the user's `podman images`, where `podman push` finds it).
    pub fn system() -> anyhow::Result<Podman> {
        Podman::new(false)
    }

    /// A storage of its own under the temp directory, removed with everything in it on drop.
    pub fn isolated() -> anyhow::Result<Podman> {
        Podman::new(true)
    }

    fn new(isolated: bool) -> anyhow::Result<Podman> {
        if !crate::have("podman") {
            bail!("podman is missing (as root: apt-get install podman runc)");
        }
        let dir = std::env::temp_dir().join(format!(
            "lattice-podman-{}-{:x}",
            std::process::id(),
            fnv1a(&format!("{:?}", SystemTime::now()))
        ));
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let podman = Podman { dir, isolated };
        std::fs::write(podman.dir.join("containers.conf"), containers_conf()?)?;
        Ok(podman)
    }

    /// A podman command with this configuration (and storage), ready for its arguments.
    pub fn command(&self) -> Command {
        let mut command = Command::new("podman");
        command.env("CONTAINERS_CONF", self.dir.join("containers.conf"));
        if self.isolated {
            command
                .arg("--root")
                .arg(self.dir.join("root"))
                .arg("--runroot")
                .arg(self.dir.join("run"));
        }
        command.stdin(Stdio::null());
        command
    }

    /// Runs `podman args`; its stdout, or an error with its stderr.
    pub fn output(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut command = self.command();
        command.args(args);
        let output = command
            .output()
            .with_context(|| format!("cannot run {command:?}"))?;
        ensure!(
            output.status.success(),
            "{command:?} failed: {}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// Imports `base` unless this storage holds it already.
    pub fn load(&self, base: &Base) -> anyhow::Result<()> {
        let exists = self
            .command()
            .args(["image", "exists", &base.name])
            .status()
            .is_ok_and(|s| s.success());
        if !exists {
            crate::run(
                self.command()
                    .args(["import", "--quiet"])
                    .arg(&base.tarball)
                    .arg(&base.name),
            )?;
        }
        Ok(())
    }

    /// Builds the Dockerfile's runtime stage as `tag` on `base` (loaded) from `binaries` (a
    /// path per [`PROGRAMS`] entry, in order): no pull, no network. Returns the size of each
    /// program as the image holds it.
    pub fn build(
        &self,
        base: &Base,
        binaries: &[PathBuf],
        labels: &Labels,
        tag: &str,
    ) -> anyhow::Result<Vec<u64>> {
        ensure!(
            binaries.len() == PROGRAMS.len(),
            "the image needs {PROGRAMS:?}"
        );
        // The `binaries` build context: out/<program>, without its debug information, as the
        // Dockerfile's build stage stages them.
        let context = self.dir.join("context");
        let out = context.join("binaries/out");
        std::fs::create_dir_all(&out)?;
        let mut sizes = Vec::new();
        for (program, path) in PROGRAMS.iter().zip(binaries) {
            let staged = out.join(program);
            strip_debug(path, &staged)?;
            sizes.push(std::fs::metadata(&staged)?.len());
        }
        let mut command = self.command();
        command
            .args(["build", "--pull=never", "--network=none", "--layers=false"])
            .args(["--target", "runtime", "--file"])
            .arg(workspace_root().join(DOCKERFILE))
            .arg(format!(
                "--build-context=binaries={}",
                context.join("binaries").display()
            ))
            .arg(format!("--build-arg=BASE={}", base.name))
            .arg(format!("--build-arg=VERSION={}", labels.version))
            .arg(format!("--build-arg=REVISION={}", labels.revision))
            .args(["--tag", tag])
            // The main context holds nothing the runtime stage reads.
            .arg(context.join("binaries"));
        let built = crate::run(&mut command);
        let _ = std::fs::remove_dir_all(&context);
        built.map(|()| sizes)
    }

    /// The image's size in bytes as podman stores it (uncompressed layers).
    pub fn size(&self, image: &str) -> anyhow::Result<u64> {
        let text = self.output(&["image", "inspect", "--format", "{{.Size}}", image])?;
        text.trim()
            .parse()
            .with_context(|| format!("podman reported the size of {image} as {text:?}"))
    }

    /// The image's layers as a registry stores them (gzip-compressed), in bytes, base first:
    /// the figure registries publish as an image's size.
    pub fn compressed_layers(&self, image: &str) -> anyhow::Result<Vec<u64>> {
        let dir = self.dir.join("compressed");
        let _ = std::fs::remove_dir_all(&dir);
        let dir_arg = dir.to_string_lossy().into_owned();
        let saved = self.output(&[
            "save",
            "--quiet",
            "--format=docker-dir",
            "--compress",
            "--output",
            &dir_arg,
            image,
        ]);
        let layers = saved.and_then(|_| {
            let manifest: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json"))?)?;
            manifest["layers"]
                .as_array()
                .context("the saved manifest lists no layers")?
                .iter()
                .map(|layer| layer["size"].as_u64().context("a layer without a size"))
                .collect()
        });
        let _ = std::fs::remove_dir_all(&dir);
        layers
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        if self.isolated {
            // Containers first (a pod's or not), then every image: the storage goes as a whole.
            for args in [
                &["pod", "rm", "--all", "--force"][..],
                &["rm", "--all", "--force", "--time=0"],
                &["rmi", "--all", "--force"],
            ] {
                let _ = self
                    .command()
                    .args(args)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `binary` without its debug information (the workspace's profiles keep line tables, which
/// make up five sixths of a release binary), its symbols kept so that a backtrace still names
/// functions: what the Dockerfile's build stage does too.
fn strip_debug(binary: &Path, to: &Path) -> anyhow::Result<()> {
    let output = Command::new("objcopy")
        .arg("--strip-debug")
        .arg(binary)
        .arg(to)
        .output()
        .context("cannot run objcopy (binutils, which the Rust toolchain's linker needs)")?;
    ensure!(
        output.status.success(),
        "objcopy --strip-debug {} failed: {}",
        binary.display(),
        String::from_utf8_lossy(&output.stderr).trim()
    );
    Ok(())
}

/// The configuration: `runc` where installed (crun fails on cgroup v1 hybrid hosts), and the
/// containers' open-file and process limits within what the machine lets a process without
/// CAP_SYS_RESOURCE set (podman's defaults, 1048576 files and the host's process limit, are
/// refused there): the hard file limit, at most 4096 processes, plenty for one program.
fn containers_conf() -> anyhow::Result<String> {
    let limit = |option: &str| -> anyhow::Result<u64> {
        // bash: dash's ulimit has no -u.
        let output = Command::new("bash")
            .args(["-c", &format!("ulimit -H {option}")])
            .output()
            .context("cannot run bash")?;
        let text = String::from_utf8_lossy(&output.stdout).trim().to_string();
        match text.as_str() {
            "unlimited" => Ok(u64::MAX),
            number => number
                .parse()
                .with_context(|| format!("`ulimit -H {option}` printed {number:?}")),
        }
    };
    let files = limit("-n")?.min(1_048_576);
    let processes = limit("-u")?.min(4096);
    let mut conf = format!(
        "[containers]\ndefault_ulimits = [\"nofile={files}:{files}\", \
         \"nproc={processes}:{processes}\"]\n\n[engine]\nevents_logger = \"file\"\n"
    );
    if crate::have("runc") {
        conf.push_str("runtime = \"runc\"\n");
    }
    Ok(conf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packages_come_from_the_dockerfile() {
        let dockerfile = std::fs::read_to_string(workspace_root().join(DOCKERFILE)).unwrap();
        let packages = runtime_packages(&dockerfile).unwrap();
        assert!(packages.contains(&"iptables".to_string()), "{packages:?}");
        assert!(runtime_packages("FROM scratch\n").is_err());
        assert!(runtime_packages("ARG PACKAGES=\"a;rm\"\n").is_err());
    }

    #[test]
    fn the_base_name_follows_its_recipe() {
        let one = mmdebstrap_args(&["iptables".to_string()]);
        let two = mmdebstrap_args(&["iptables".to_string(), "curl".to_string()]);
        assert_ne!(fnv1a(&one.join("\n")), fnv1a(&two.join("\n")));
        // FNV-1a's published test vector: the name must not change with the toolchain.
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c);
    }
}
