//! Owns the iptables edge: finding the `*-save`/`*-restore` binaries of a backend, choosing the
//! backend, reading the current ruleset and applying restore input (one
//! `iptables-restore --noflush --wait` per family, which the kernel commits atomically).

use std::fmt;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::config::BackendChoice;
use crate::rules::{Family, NatState};

/// An iptables implementation. Rules written by one are invisible to the other, so a pod must
/// use the one its node (and anything already in the namespace) uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Nft,
    Legacy,
}

impl Backend {
    fn suffix(self) -> &'static str {
        match self {
            Backend::Nft => "nft",
            Backend::Legacy => "legacy",
        }
    }

    fn other(self) -> Self {
        match self {
            Backend::Nft => Backend::Legacy,
            Backend::Legacy => Backend::Nft,
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.suffix())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum IptablesError {
    #[error(
        "{binary} not found in PATH; install the iptables package with the {backend} backend, or choose another with --iptables-backend"
    )]
    MissingBinary { binary: String, backend: Backend },
    #[error(
        "neither iptables-nft nor iptables-legacy binaries are in PATH; install the iptables package"
    )]
    NoBackend,
    #[error("could not run {binary}: {source}")]
    Spawn {
        binary: String,
        source: std::io::Error,
    },
    #[error("{binary} failed ({status}): {stderr}; {hint}")]
    Failed {
        binary: String,
        status: String,
        stderr: String,
        hint: &'static str,
    },
}

/// The binaries that serve one family with one backend.
#[derive(Debug, Clone)]
pub struct Tools {
    pub backend: Backend,
    pub family: Family,
    pub save: PathBuf,
    pub restore: PathBuf,
}

impl Tools {
    pub fn find(backend: Backend, family: Family) -> Result<Self, IptablesError> {
        let base = match family {
            Family::V4 => "iptables",
            Family::V6 => "ip6tables",
        };
        let lookup = |kind: &str| {
            let binary = format!("{base}-{}-{kind}", backend.suffix());
            find_in_path(&binary).ok_or(IptablesError::MissingBinary { binary, backend })
        };
        Ok(Self {
            backend,
            family,
            save: lookup("save")?,
            restore: lookup("restore")?,
        })
    }

    /// The whole ruleset of this family (every table the kernel has instantiated). Reading has
    /// no side effects: unlike `-t nat`, a plain save does not instantiate tables.
    pub fn save(&self) -> Result<String, IptablesError> {
        run(
            &self.save,
            &[],
            None,
            "check that this process has NET_ADMIN in the pod",
        )
    }

    /// Checks that the kernel accepts `text` (tables, matches, targets) without committing it.
    pub fn test(&self, text: &str) -> Result<(), IptablesError> {
        run(
            &self.restore,
            &["--noflush", "--wait", "--test"],
            Some(text),
            "the kernel lacks a table or extension the rules need (nat, owner, REDIRECT); nothing was changed",
        )
        .map(drop)
    }

    /// Applies `text` in one transaction: all of it or none of it.
    pub fn restore(&self, text: &str) -> Result<(), IptablesError> {
        run(
            &self.restore,
            &["--noflush", "--wait"],
            Some(text),
            "the transaction was rejected as a whole, so this family is unchanged",
        )
        .map(drop)
    }
}

fn find_in_path(binary: &str) -> Option<PathBuf> {
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths)
        .map(|dir| dir.join(binary))
        .find(|candidate| candidate.is_file())
}

fn run(
    binary: &Path,
    args: &[&str],
    stdin: Option<&str>,
    hint: &'static str,
) -> Result<String, IptablesError> {
    let name = binary.display().to_string();
    let spawn_error = |source| IptablesError::Spawn {
        binary: name.clone(),
        source,
    };
    let mut child = Command::new(binary)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_error)?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes()).map_err(spawn_error)?;
    }
    let output = child.wait_with_output().map_err(spawn_error)?;
    if !output.status.success() {
        return Err(IptablesError::Failed {
            binary: name,
            status: output.status.to_string(),
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
            hint,
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// What one backend's binaries show in the namespace, over the families in play.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Evidence {
    /// Both binaries exist for every family in play.
    pub available: bool,
    /// Our chains or jump are present.
    pub ours: bool,
    /// `-A` rules across all tables.
    pub rules: usize,
}

/// The backend chosen, and why (for the log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    pub backend: Backend,
    pub reason: String,
}

/// Picks the backend: forced by flag; else the one already holding our rules (so re-runs and
/// `--cleanup` find them); else the one holding more rules (the node's components wrote them,
/// and rules in the other backend would be shadowed or ignored); else nft, the kernel's current
/// interface.
pub fn choose(
    forced: BackendChoice,
    nft: &Evidence,
    legacy: &Evidence,
) -> Result<Choice, IptablesError> {
    let evidence = |backend| match backend {
        Backend::Nft => nft,
        Backend::Legacy => legacy,
    };
    let pick = |backend, reason: String| Ok(Choice { backend, reason });
    let forced = match forced {
        BackendChoice::Nft => Some(Backend::Nft),
        BackendChoice::Legacy => Some(Backend::Legacy),
        BackendChoice::Auto => None,
    };
    if let Some(backend) = forced {
        return pick(backend, "forced by --iptables-backend".into());
    }
    match (nft.available, legacy.available) {
        (false, false) => return Err(IptablesError::NoBackend),
        (true, false) => return pick(Backend::Nft, "only the nft binaries are installed".into()),
        (false, true) => {
            return pick(
                Backend::Legacy,
                "only the legacy binaries are installed".into(),
            );
        }
        (true, true) => {}
    }
    for backend in [Backend::Nft, Backend::Legacy] {
        if evidence(backend).ours && !evidence(backend.other()).ours {
            return pick(backend, "lattice chains are already installed there".into());
        }
    }
    if nft.rules != legacy.rules {
        let backend = if nft.rules > legacy.rules {
            Backend::Nft
        } else {
            Backend::Legacy
        };
        return pick(
            backend,
            format!(
                "the namespace holds more rules there (nft: {}, legacy: {})",
                nft.rules, legacy.rules
            ),
        );
    }
    pick(
        Backend::Nft,
        format!(
            "no existing rules favour either ({} each); nft is the default",
            nft.rules
        ),
    )
}

/// One backend's view of the families in play: tools and the parsed current state.
#[derive(Debug, Clone)]
pub struct BackendView {
    pub evidence: Evidence,
    pub families: Vec<(Tools, NatState)>,
}

/// Reads every family in `families` with `backend`'s binaries. Missing binaries make the backend
/// unavailable rather than an error, so detection can fall back to the other one.
pub fn inspect(backend: Backend, families: &[Family]) -> Result<BackendView, IptablesError> {
    let mut view = BackendView {
        evidence: Evidence {
            available: true,
            ..Evidence::default()
        },
        families: Vec::new(),
    };
    for family in families {
        let tools = match Tools::find(backend, *family) {
            Ok(tools) => tools,
            Err(IptablesError::MissingBinary { .. }) => {
                return Ok(BackendView {
                    evidence: Evidence::default(),
                    families: Vec::new(),
                });
            }
            Err(other) => return Err(other),
        };
        let state = NatState::parse(&tools.save()?);
        view.evidence.ours |= state.is_installed();
        view.evidence.rules += state.rule_count;
        view.families.push((tools, state));
    }
    Ok(view)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(available: bool, ours: bool, rules: usize) -> Evidence {
        Evidence {
            available,
            ours,
            rules,
        }
    }

    #[test]
    fn forced_backend_wins() {
        let choice = choose(
            BackendChoice::Legacy,
            &ev(true, true, 9),
            &ev(true, false, 0),
        );
        assert_eq!(choice.unwrap().backend, Backend::Legacy);
    }

    #[test]
    fn our_own_rules_win_over_counts() {
        let choice = choose(
            BackendChoice::Auto,
            &ev(true, false, 50),
            &ev(true, true, 5),
        )
        .unwrap();
        assert_eq!(choice.backend, Backend::Legacy);
        assert!(
            choice.reason.contains("already installed"),
            "{}",
            choice.reason
        );
    }

    #[test]
    fn more_rules_win() {
        let choice = choose(
            BackendChoice::Auto,
            &ev(true, false, 0),
            &ev(true, false, 2),
        )
        .unwrap();
        assert_eq!(choice.backend, Backend::Legacy);
        let choice = choose(
            BackendChoice::Auto,
            &ev(true, false, 3),
            &ev(true, false, 2),
        )
        .unwrap();
        assert_eq!(choice.backend, Backend::Nft);
    }

    #[test]
    fn empty_namespace_defaults_to_nft() {
        let choice = choose(
            BackendChoice::Auto,
            &ev(true, false, 0),
            &ev(true, false, 0),
        )
        .unwrap();
        assert_eq!(choice.backend, Backend::Nft);
        assert!(choice.reason.contains("default"), "{}", choice.reason);
    }

    #[test]
    fn only_installed_backend_is_used() {
        let choice = choose(
            BackendChoice::Auto,
            &ev(false, false, 0),
            &ev(true, false, 0),
        )
        .unwrap();
        assert_eq!(choice.backend, Backend::Legacy);
        assert!(
            choose(
                BackendChoice::Auto,
                &ev(false, false, 0),
                &ev(false, false, 0)
            )
            .is_err()
        );
    }
}
