//! `lattice-init`: runs in each mesh pod's network namespace before the Envoy sidecar; writes
//! Envoy's bootstrap and installs the iptables capture of the trapped CIDR.
//!
//! Pure cores ([`config`], [`rules`], [`bootstrap`]) turn flags into rule text and bootstrap JSON;
//! thin edges ([`iptables`], [`interfaces`], [`validate`], [`lock`]) touch the system. This
//! module runs one invocation: every check first, then the changes, each family in one
//! transaction, with the earlier families rolled back if a later one fails. A run that changes
//! anything holds the namespace's [`lock::RunLock`] throughout, so concurrent runs take turns.

pub mod bootstrap;
pub mod config;
pub mod interfaces;
pub mod iptables;
pub mod lock;
pub mod rules;
pub mod validate;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::config::{Action, BackendChoice, CaptureConfig, ConfigError, InitConfig};
use crate::interfaces::InterfaceError;
use crate::iptables::{Backend, BackendView, Choice, IptablesError, Tools};
use crate::lock::{LockError, RunLock};
use crate::rules::{CaptureRules, Family, NatState};
use crate::validate::ValidateError;

/// How long `--validate` waits for its probe connection.
const VALIDATE_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Iptables(#[from] IptablesError),
    #[error(transparent)]
    Interfaces(#[from] InterfaceError),
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("--validate failed for {cidr}: {source}")]
    Validate { cidr: String, source: ValidateError },
    #[error(
        "--validate cannot run: this process's {kind} {id} is excluded from capture, so its probe would not be captured; drop --validate or the exclusion"
    )]
    ValidateExcluded { kind: &'static str, id: u32 },
    #[error(
        "could not write the Envoy bootstrap to {path}: {source}; check that the directory exists and is writable"
    )]
    Bootstrap {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("could not write the dry-run report to stdout: {0}")]
    Output(std::io::Error),
    #[error("could not start the async runtime for netlink: {0}")]
    Runtime(std::io::Error),
    #[error(
        "applying {failed} failed ({source}); rolling back {family} also failed ({rollback}): inspect `iptables-save` and run --cleanup"
    )]
    RollbackFailed {
        failed: Family,
        source: Box<IptablesError>,
        family: Family,
        rollback: Box<IptablesError>,
    },
}

impl InitError {
    /// The process exit code: 2 bad flags, 3 capture proven not to work, 1 anything else.
    pub fn exit_code(&self) -> u8 {
        match self {
            InitError::Config(_) | InitError::ValidateExcluded { .. } => 2,
            InitError::Validate { .. } => 3,
            _ => 1,
        }
    }
}

/// One family's part of a change: its tools, what is there now, and the restore input to apply
/// (`None`: already as wanted).
#[derive(Debug, Clone)]
pub struct FamilyPlan {
    pub tools: Tools,
    pub current: NatState,
    pub rules: Option<CaptureRules>,
    pub text: Option<String>,
}

/// The change a run makes: computed entirely before anything is touched.
#[derive(Debug, Clone)]
pub struct Plan {
    pub choice: Choice,
    pub families: Vec<FamilyPlan>,
}

impl Plan {
    pub fn is_noop(&self) -> bool {
        self.families.iter().all(|family| family.text.is_none())
    }
}

/// Families the config traps: only these are read or written.
pub fn families(config: &CaptureConfig) -> Vec<Family> {
    Family::ALL
        .into_iter()
        .filter(|family| match family {
            Family::V4 => config.has_ipv4(),
            Family::V6 => config.has_ipv6(),
        })
        .collect()
}

fn inspect_backends(
    choice: BackendChoice,
    families: &[Family],
) -> Result<(Choice, BackendView), IptablesError> {
    let forced = match choice {
        BackendChoice::Nft => Some(Backend::Nft),
        BackendChoice::Legacy => Some(Backend::Legacy),
        BackendChoice::Auto => None,
    };
    if let Some(backend) = forced {
        // Surface the missing binary by name rather than "unavailable".
        for family in families {
            Tools::find(backend, *family)?;
        }
        let view = iptables::inspect(backend, families)?;
        let chosen = iptables::choose(choice, &view.evidence, &view.evidence)?;
        return Ok((chosen, view));
    }
    let nft = iptables::inspect(Backend::Nft, families)?;
    let legacy = iptables::inspect(Backend::Legacy, families)?;
    let chosen = iptables::choose(choice, &nft.evidence, &legacy.evidence)?;
    let view = match chosen.backend {
        Backend::Nft => nft,
        Backend::Legacy => legacy,
    };
    Ok((chosen, view))
}

/// Reads the namespace and computes the restore input for `config`; changes nothing.
pub fn plan_apply(config: &CaptureConfig, backend: BackendChoice) -> Result<Plan, InitError> {
    let (choice, view) = inspect_backends(backend, &families(config))?;
    let families = view
        .families
        .into_iter()
        .filter_map(|(tools, current)| {
            let rules = CaptureRules::for_family(config, tools.family)?;
            let text = rules::apply_text(&rules, &current);
            Some(FamilyPlan {
                tools,
                current,
                rules: Some(rules),
                text,
            })
        })
        .collect();
    Ok(Plan { choice, families })
}

/// Applies `plan`: every family is first test-parsed by the kernel, then committed one
/// transaction per family; if one fails, the families already committed are put back.
pub fn execute(plan: &Plan) -> Result<(), InitError> {
    let pending: Vec<(&FamilyPlan, &String)> = plan
        .families
        .iter()
        .filter_map(|family| family.text.as_ref().map(|text| (family, text)))
        .collect();
    // One family is one atomic transaction already; several are test-parsed first so that a
    // missing table or extension in a later family stops the run before the first commit.
    if pending.len() > 1 {
        for (family, text) in &pending {
            family.tools.test(text)?;
        }
    }
    let mut done: Vec<&FamilyPlan> = Vec::new();
    for (family, text) in pending {
        info!(
            family = %family.tools.family,
            binary = %family.tools.restore.display(),
            "applying rules:\n{text}"
        );
        if let Err(err) = family.tools.restore(text) {
            if let Err((rolled, rollback)) = roll_back(&done) {
                return Err(InitError::RollbackFailed {
                    failed: family.tools.family,
                    source: Box::new(err),
                    family: rolled,
                    rollback: Box::new(rollback),
                });
            }
            return Err(err.into());
        }
        done.push(family);
    }
    Ok(())
}

fn backend_forced(choice: BackendChoice) -> bool {
    choice != BackendChoice::Auto
}

/// Puts back the families in `done`, newest first.
fn roll_back(done: &[&FamilyPlan]) -> Result<(), (Family, IptablesError)> {
    for applied in done.iter().rev() {
        let Some(rules) = &applied.rules else {
            continue;
        };
        if let Some(text) = rules::rollback_text(&applied.current, rules) {
            warn!(family = %applied.tools.family, "rolling back:\n{text}");
            applied
                .tools
                .restore(&text)
                .map_err(|err| (applied.tools.family, err))?;
        }
    }
    Ok(())
}

/// Plans `--cleanup`: every family of the forced backend, or of every backend holding our rules.
/// Families whose binaries are missing hold nothing of ours.
pub fn plan_cleanup(backend_choice: BackendChoice) -> Result<Vec<FamilyPlan>, InitError> {
    let backends: &[Backend] = match backend_choice {
        BackendChoice::Nft => &[Backend::Nft],
        BackendChoice::Legacy => &[Backend::Legacy],
        BackendChoice::Auto => &[Backend::Nft, Backend::Legacy],
    };
    let mut plans = Vec::new();
    for backend in backends {
        for family in Family::ALL {
            let tools = match Tools::find(*backend, family) {
                Ok(tools) => tools,
                // A forced backend must at least serve IPv4; IPv6 tools may be absent.
                Err(err @ IptablesError::MissingBinary { .. })
                    if backend_forced(backend_choice) && family == Family::V4 =>
                {
                    return Err(err.into());
                }
                Err(IptablesError::MissingBinary { .. }) => continue,
                Err(other) => return Err(other.into()),
            };
            let current = NatState::parse(&tools.save()?);
            let text = rules::cleanup_text(&current);
            plans.push(FamilyPlan {
                tools,
                current,
                rules: None,
                text,
            });
        }
    }
    if plans.is_empty() {
        return Err(IptablesError::NoBackend.into());
    }
    Ok(plans)
}

/// The whole invocation for a validated config. Writes the dry-run report to `out`.
pub fn run(config: &InitConfig, out: &mut impl std::io::Write) -> Result<(), InitError> {
    info!(?config, "resolved configuration");
    match config.action {
        Action::CheckConfig => {
            if config.bootstrap.is_none() {
                info!(
                    "node id not resolvable here (POD_NAME and POD_NAMESPACE come from the pod); the bootstrap is not checked"
                );
            }
            info!("configuration is valid; nothing changed (--check-config)");
            Ok(())
        }
        Action::Cleanup => cleanup(config.backend),
        Action::DryRun => dry_run(config, out),
        Action::Apply { validate } => apply(config, validate),
    }
}

fn check_pod_addresses(config: &CaptureConfig) -> Result<(), InitError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(InitError::Runtime)?;
    let addresses = runtime.block_on(interfaces::addresses())?;
    interfaces::check_outside_trap(&addresses, &config.trap)?;
    if config.inbound.is_some() {
        interfaces::check_inbound_covered(&addresses, &config.trap)?;
    }
    Ok(())
}

fn log_choice(plan: &Plan) {
    info!(backend = %plan.choice.backend, reason = %plan.choice.reason, "iptables backend chosen");
}

fn apply(config: &InitConfig, validate: bool) -> Result<(), InitError> {
    let started = Instant::now();
    if validate {
        check_validate_possible(&config.capture)?;
    }
    check_pod_addresses(&config.capture)?;
    // Held until the run ends: the plan must still be true when it is applied.
    let _lock = RunLock::acquire(lock::LOCK_WAIT)?;
    let plan = plan_apply(&config.capture, config.backend)?;
    log_choice(&plan);
    if let (Some(path), Some(bootstrap)) = (&config.bootstrap_out, &config.bootstrap) {
        write_bootstrap(path, &bootstrap::bootstrap(bootstrap))?;
        info!(path = %path.display(), "Envoy bootstrap written");
    }
    if plan.is_noop() {
        info!("capture rules already installed as configured; nothing to apply");
    } else {
        execute(&plan)?;
    }
    info!(
        elapsed_ms = started.elapsed().as_secs_f64() * 1000.0,
        "capture rules in place"
    );
    if validate {
        for cidr in &config.capture.trap {
            let found = validate::check_capture(
                cidr.first_host(),
                config.capture.envoy_port,
                VALIDATE_TIMEOUT,
            )
            .map_err(|source| InitError::Validate {
                cidr: cidr.to_string(),
                source,
            })?;
            info!(%cidr, original_dst = %found, "validated: capture reaches the Envoy port");
        }
    }
    Ok(())
}

fn check_validate_possible(config: &CaptureConfig) -> Result<(), InitError> {
    let uid = nix::unistd::getuid().as_raw();
    let gid = nix::unistd::getgid().as_raw();
    if uid == config.envoy_uid || config.exclude_uids.contains(&uid) {
        return Err(InitError::ValidateExcluded {
            kind: "uid",
            id: uid,
        });
    }
    if config.exclude_gids.contains(&gid) {
        return Err(InitError::ValidateExcluded {
            kind: "gid",
            id: gid,
        });
    }
    Ok(())
}

fn cleanup(backend: BackendChoice) -> Result<(), InitError> {
    let started = Instant::now();
    let _lock = RunLock::acquire(lock::LOCK_WAIT)?;
    let plans = plan_cleanup(backend)?;
    let mut removed = false;
    for plan in &plans {
        if let Some(text) = &plan.text {
            info!(
                family = %plan.tools.family,
                backend = %plan.tools.backend,
                "removing lattice rules:\n{text}"
            );
            plan.tools.restore(text)?;
            removed = true;
        }
    }
    if !removed {
        info!("no lattice rules installed; nothing to clean up");
    }
    info!(
        elapsed_ms = started.elapsed().as_secs_f64() * 1000.0,
        "cleanup done"
    );
    Ok(())
}

fn dry_run(config: &InitConfig, out: &mut impl std::io::Write) -> Result<(), InitError> {
    check_pod_addresses(&config.capture)?;
    let plan = plan_apply(&config.capture, config.backend)?;
    log_choice(&plan);
    let mut report = format!(
        "# lattice-init --dry-run: nothing is changed\n# iptables backend: {} ({})\n",
        plan.choice.backend, plan.choice.reason
    );
    for family in &plan.families {
        match &family.text {
            Some(text) => {
                let _ = write!(
                    report,
                    "# {}: {} --noflush --wait <<EOF\n{text}EOF\n",
                    family.tools.family,
                    family.tools.restore.display()
                );
            }
            None => {
                let _ = writeln!(
                    report,
                    "# {}: already installed as configured; nothing to apply",
                    family.tools.family
                );
            }
        }
    }
    match (&config.bootstrap, &config.bootstrap_out) {
        (Some(bootstrap), out_path) => {
            let target = out_path
                .as_ref()
                .map_or("not written: no --bootstrap-out".into(), |p| {
                    format!("would be written to {}", p.display())
                });
            let _ = writeln!(
                report,
                "# Envoy bootstrap ({target}):\n{}",
                pretty(&bootstrap::bootstrap(bootstrap))
            );
        }
        (None, _) => {
            let _ = writeln!(
                report,
                "# Envoy bootstrap: not rendered (no node id or xDS address)"
            );
        }
    }
    out.write_all(report.as_bytes()).map_err(InitError::Output)
}

fn pretty(value: &serde_json::Value) -> String {
    // Serializing a Value cannot fail: every key is a string.
    serde_json::to_string_pretty(value).unwrap_or_default()
}

/// Writes the bootstrap atomically so Envoy never reads half a file: into a temporary file of
/// its own in the same directory (a unique name: another run, or one killed half-way, cannot
/// touch it), then renamed over `path`. Temporary files left by killed runs are removed first;
/// the caller holds the run lock, so no live run is writing one.
pub fn write_bootstrap(path: &Path, value: &serde_json::Value) -> Result<(), InitError> {
    use std::io::Write as _;
    use std::os::unix::fs::PermissionsExt as _;
    let error = |source| InitError::Bootstrap {
        path: path.to_owned(),
        source,
    };
    let file_name = path
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_else(|| "bootstrap.json".into());
    let dir = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let prefix = format!(".{file_name}.");
    remove_leftovers(dir, &prefix);
    // Envoy runs as another user than this run (root): the bootstrap must be readable by it.
    let mut file = tempfile::Builder::new()
        .prefix(&prefix)
        .suffix(TEMPORARY_SUFFIX)
        .permissions(std::fs::Permissions::from_mode(0o644))
        .tempfile_in(dir)
        .map_err(error)?;
    file.write_all(format!("{}\n", pretty(value)).as_bytes())
        .map_err(error)?;
    file.persist(path).map_err(|e| error(e.error))?;
    Ok(())
}

const TEMPORARY_SUFFIX: &str = ".tmp";

/// Removes the temporary files of earlier runs that died before renaming theirs. Best effort:
/// a leftover costs a few KiB of the pod's volume, never a wrong bootstrap.
fn remove_leftovers(dir: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(prefix) && name.ends_with(TEMPORARY_SUFFIX) {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => {
                    info!(file = %entry.path().display(), "removed the temporary bootstrap of an earlier run that did not finish")
                }
                Err(err) => {
                    warn!(file = %entry.path().display(), %err, "cannot remove the temporary bootstrap of an earlier run")
                }
            }
        }
    }
}
