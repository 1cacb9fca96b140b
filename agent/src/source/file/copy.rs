//! A mesh file's services as last read, kept in the state directory (`--state-dir`,
//! `mesh-files/`), so that an agent restarted with the same file takes them from there rather
//! than reading its YAML again.
//!
//! Why: YAML is the slowest part of a restart with large mesh files. libyaml, the fastest YAML
//! parser Rust has (serde-saphyr took twice as long on the same file), takes about 140 ms of
//! CPU for a 10k-service file. Five such files load from their copies in 0.14-0.15 s, against
//! 0.46-0.53 s from their YAML (the agent alone on two cores).
//!
//! A copy is used only for the very text it was read from, by the same build of the agent,
//! with the same limits and trapped block: its key is the SHA-256 of all of them together, and
//! anything else (an edit, an upgrade, another flag) reads the YAML as before. The agent's
//! build is told apart by its executable's size, inode, and modification and change times. A
//! missing copy, or one of another text, is passed over; one that cannot be used (unreadable,
//! not JSON) is logged and left aside. It is written on the file's own thread at `SCHED_IDLE`
//! (`FileSource`): at once after a start that read the YAML, and 5 s after an edit. The copy
//! keeps the services in the file's order, so that the mesh takes them, and assigns their
//! addresses, exactly as it takes the file's.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lattice_contract::TrapCidrs;
use serde::{Deserialize, Serialize};

use super::limits::Limits;
use crate::mesh::{MeshMetrics, ServiceSpec};
use crate::state_file;

/// The directory of copies in `--state-dir`.
pub const COPIES_DIR: &str = "mesh-files";

/// Bumped whenever what a mesh file reads as, or how a copy is written, changes meaning
/// within one build's reach (the build itself is in the key).
const FORMAT: &str = "lattice-mesh-file-copy-1";

/// A copy more than this many times the file's limit is not read: the JSON of a service is
/// about 2.5 times its YAML as the benchmark writes it, and more for a terse one.
const MAX_GROWTH: u64 = 16;

/// The copy of one mesh file, and what its key is made of.
#[derive(Clone, Debug)]
pub struct FileCopy {
    path: PathBuf,
    /// Everything the key covers but the text.
    context: Vec<u8>,
    max_bytes: u64,
}

#[derive(Serialize)]
struct Written<'a> {
    key: &'a str,
    services: &'a [ServiceSpec],
}

/// A copy whose key was found to be the one wanted (its `key` field, first, is not read
/// again).
#[derive(Deserialize)]
struct Read {
    services: Vec<ServiceSpec>,
}

impl FileCopy {
    /// The copy of the mesh file at `file` in `state_dir`, for this build with these limits
    /// and trapped block; `None` when the build cannot be told (its executable cannot be
    /// looked at), which leaves copies out.
    pub fn new(state_dir: &Path, file: &Path, trap: &TrapCidrs, limits: &Limits) -> Option<Self> {
        use std::os::unix::fs::MetadataExt as _;
        let exe = std::env::current_exe().and_then(std::fs::metadata).ok()?;
        // Its change time is set by the kernel whenever the file is written or installed, so a
        // build installed since differs even with the same size and modification time (which
        // reproducible builds fix); hashing its content instead would cost about 0.1 s per
        // start for a 200 MB binary with debug information.
        let context = format!(
            "{FORMAT}\n{} {} {}:{} {}.{} {}.{}\n{}\n{}\n{limits:?}\n",
            env!("CARGO_PKG_VERSION"),
            exe.len(),
            exe.dev(),
            exe.ino(),
            exe.mtime(),
            exe.mtime_nsec(),
            exe.ctime(),
            exe.ctime_nsec(),
            file.display(),
            String::from(trap.clone()),
        );
        Some(FileCopy {
            path: state_dir.join(COPIES_DIR).join(entry_name(file)),
            context: context.into_bytes(),
            max_bytes: limits
                .max_bytes
                .saturating_mul(MAX_GROWTH)
                .saturating_add(1 << 20),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The key of `text` read with this copy's context.
    pub fn key(&self, text: &str) -> String {
        let mut digest = ring::digest::Context::new(&ring::digest::SHA256);
        digest.update(&self.context);
        digest.update(text.as_bytes());
        hex(digest.finish().as_ref())
    }

    /// The services the copy holds for `key`: `Ok(None)` when there is no copy or it is of
    /// another text, `Err` with the reason when it cannot be used.
    pub fn take(&self, key: &str) -> Result<Option<Vec<ServiceSpec>>, String> {
        const WHAT: &str = "a mesh file's copy";
        let Some(text) = state_file::read_text(&self.path, self.max_bytes, WHAT)? else {
            return Ok(None);
        };
        // The key comes first as written: a copy of another text is told without decoding it.
        if !text.starts_with(&format!("{{\"key\":\"{key}\"")) {
            return Ok(None);
        }
        let read: Read = serde_json::from_str(&text).map_err(|err| format!("not {WHAT}: {err}"))?;
        Ok(Some(read.services))
    }

    /// Writes `services` as the copy for `key`, replacing any other whole.
    pub fn store(&self, key: &str, services: &[ServiceSpec]) -> Result<(), String> {
        state_file::replace(&self.path, "mesh-file", &Written { key, services })
    }
}

/// How long after an edit the file's copy is written: at most once in this time however
/// often the file changes. A write that failed is tried again after as long.
pub const COPY_AFTER: Duration = Duration::from_secs(5);

/// A file's copy and when it is to be written: due while the copy does not hold the text
/// being served (counted in `lattice_mesh_file_copies_behind`), at once after a start that
/// read the file, [`COPY_AFTER`] after the first edit since the last write.
pub struct Copying {
    copy: FileCopy,
    due: Option<Instant>,
    /// Whether the last write failed (logged once per run of failures).
    failing: bool,
    metrics: MeshMetrics,
}

impl Copying {
    pub fn new(copy: FileCopy) -> Self {
        Copying {
            copy,
            due: None,
            failing: false,
            metrics: MeshMetrics::default(),
        }
    }

    pub fn copy(&self) -> &FileCopy {
        &self.copy
    }

    /// When the copy is to be written, if it is behind.
    pub fn due(&self) -> Option<Instant> {
        self.due
    }

    /// Counts the copy in `metrics` from now on.
    pub fn count_in(&mut self, metrics: MeshMetrics) {
        if self.due.is_some() {
            metrics.file_copy_behind();
        }
        self.metrics = metrics;
    }

    /// Due at once, whenever it was due (tests: a retry without its wait).
    #[cfg(test)]
    pub fn due_now(&mut self) {
        self.due = self.due.map(|_| Instant::now());
    }

    /// The copy does not hold the text being served: due at `at`, unless it is due already.
    pub fn behind(&mut self, at: Instant) {
        if self.due.is_none() {
            self.due = Some(at);
            self.metrics.file_copy_behind();
        }
    }

    /// Writes `kept` (the last good read's text and services) as the copy of `file`, if the
    /// copy is due. A write that fails (the state directory full, say) is tried again
    /// [`COPY_AFTER`] later, the copy still counted behind.
    pub fn write(&mut self, file: &Path, kept: Option<(&str, Vec<ServiceSpec>)>) {
        if self.due.take().is_none() {
            return;
        }
        let Some((text, specs)) = kept else {
            self.metrics.file_copy_caught_up();
            return;
        };
        match self.copy.store(&self.copy.key(text), &specs) {
            Ok(()) => {
                self.metrics.file_copy_caught_up();
                self.failing = false;
                tracing::debug!(
                    file = %file.display(),
                    copy = %self.copy.path().display(),
                    "mesh file's copy written"
                );
            }
            Err(reason) => {
                if !std::mem::replace(&mut self.failing, true) {
                    tracing::warn!(
                        file = %file.display(),
                        copy = %self.copy.path().display(),
                        %reason,
                        retry_secs = COPY_AFTER.as_secs(),
                        "cannot write the mesh file's copy: tried again every retry_secs; a \
                         start meanwhile reads the file"
                    );
                }
                self.due = Some(Instant::now() + COPY_AFTER);
            }
        }
    }
}

/// The name of `file`'s copy: the SHA-256 of its path, cut to 128 bits.
fn entry_name(file: &Path) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, file.as_os_str().as_encoded_bytes());
    format!("{}.json", &hex(digest.as_ref())[..32])
}

/// Removes from `state_dir` every copy but those of `files`, and what an interrupted write
/// left: a copy is about 2.5 times its file, and the state directory is the node's tmpfs,
/// whose pages count against the agent's memory limit, so copies of files the agent was once
/// given must not pile up. How many files were removed.
pub fn prune(state_dir: &Path, files: &[PathBuf]) -> std::io::Result<usize> {
    let keep: Vec<String> = files.iter().map(|file| entry_name(file)).collect();
    let entries = match std::fs::read_dir(state_dir.join(COPIES_DIR)) {
        Ok(entries) => entries,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(err) => return Err(err),
    };
    let mut removed = 0;
    for entry in entries {
        let entry = entry?;
        if keep.iter().any(|name| entry.file_name() == name.as_str()) {
            continue;
        }
        if entry.file_type()?.is_file() {
            std::fs::remove_file(entry.path())?;
            removed += 1;
        }
    }
    Ok(removed)
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut out, b| {
            let _ = write!(out, "{b:02x}");
            out
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Copies of files the agent is not given any more, and a temporary file an interrupted
    /// write left, go; the copies of the files it is given stay.
    #[test]
    fn pruning_keeps_only_the_copies_of_the_files_given() {
        let state = tempfile::tempdir().unwrap();
        let (kept, gone) = (
            PathBuf::from("/etc/mesh/a.yaml"),
            PathBuf::from("/etc/mesh/b.yaml"),
        );
        assert_eq!(
            prune(state.path(), std::slice::from_ref(&kept)).unwrap(),
            0,
            "no directory yet"
        );
        let trap: TrapCidrs = "240.240.0.0/16".parse().unwrap();
        for file in [&kept, &gone] {
            let copy = FileCopy::new(state.path(), file, &trap, &Limits::default()).unwrap();
            copy.store(&copy.key("services: []"), &[]).unwrap();
        }
        let dir = state.path().join(COPIES_DIR);
        std::fs::write(dir.join(".mesh-file.x.tmp"), "torn").unwrap();
        assert_eq!(prune(state.path(), std::slice::from_ref(&kept)).unwrap(), 2);
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|entry| entry.unwrap().file_name())
            .collect();
        assert_eq!(left, [std::ffi::OsString::from(entry_name(&kept))]);
    }
}
