//! The address record on the node (`--state-dir`, `addresses.json`): the catalog's address
//! book as JSON, written before a snapshot that uses a new address is published, read once at
//! start, so that every name keeps its address across restarts and upgrades of the agent
//! ([`crate::mesh::AddressBook`]).
//!
//! Each write goes to a temporary file of its own in the directory, renamed over the record:
//! a reader (the next agent) sees a whole record, the old one or the new one, also while two
//! agents overlap during an upgrade and both write. No fsync: the record must survive the
//! agent's death, which the page cache does; a node that loses power restarts its pods too,
//! and with them every DNS answer they had cached.
//!
//! A record that cannot be used (unreadable, not JSON, another format, another trapped block,
//! too large) is logged and left out: addresses are then derived from the names alone, as on
//! a node's first start, and the next write replaces it. Entries the block cannot hold are
//! dropped one by one. What happened shows on `/debug/mesh` (`addresses`).

use std::path::{Path, PathBuf};

use lattice_contract::TrapCidrs;
use serde::Serialize;

use crate::mesh::{AddressBook, AddressRecord, MeshMetrics};
use crate::state_file;

/// The record's file name in `--state-dir`.
pub const RECORD_FILE: &str = "addresses.json";

/// A record larger than this is not read: a /16's every address with a long path is about
/// 6 MiB.
const MAX_RECORD_BYTES: u64 = 32 << 20;

/// The record as `/debug/mesh` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RecordStatus {
    pub path: PathBuf,
    /// Entries of the record read at start whose addresses were set aside for their holders.
    pub restored: usize,
    /// Entries of that record left out (outside the block, repeated, not a mesh path).
    pub dropped: usize,
    /// Why the record read at start was not used, if it was not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unused: Option<String>,
    /// Why the last write failed, while it does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub write_error: Option<String>,
}

/// The record's file, and the book revision last written to it.
pub struct AddressRecordFile {
    path: PathBuf,
    written: Option<u64>,
    status: RecordStatus,
    metrics: MeshMetrics,
}

impl AddressRecordFile {
    /// Reads the record in `dir` (none yet is an empty book) and returns the book it restores.
    pub fn load(dir: &Path, trap: &TrapCidrs, metrics: MeshMetrics) -> (Self, AddressBook) {
        let path = dir.join(RECORD_FILE);
        let mut status = RecordStatus {
            path: path.clone(),
            ..RecordStatus::default()
        };
        let book = match read(&path) {
            Ok(None) => {
                tracing::info!(path = %path.display(), "no address record yet: addresses are derived from the names");
                AddressBook::new(trap.clone())
            }
            Ok(Some(record)) => {
                let (book, report) = AddressBook::restore(trap.clone(), &record);
                status.restored = report.restored;
                status.dropped = report.dropped;
                status.unused = report.refused;
                book
            }
            Err(reason) => {
                status.unused = Some(reason);
                AddressBook::new(trap.clone())
            }
        };
        match &status.unused {
            Some(reason) => tracing::warn!(
                path = %path.display(),
                "the address record is not used ({reason}): addresses are derived from the \
                 names, and names whose address had moved may get another; it is replaced at \
                 the next change"
            ),
            None if status.dropped > 0 => tracing::warn!(
                path = %path.display(),
                restored = status.restored,
                dropped = status.dropped,
                "some entries of the address record are not usable and were left out"
            ),
            None => tracing::info!(
                path = %path.display(),
                restored = status.restored,
                "addresses restored from the record"
            ),
        }
        let file = AddressRecordFile {
            path,
            // Nothing to write until the book moves: the record already says what it holds.
            written: (status.unused.is_none()).then(|| book.revision()),
            status,
            metrics,
        };
        (file, book)
    }

    pub fn status(&self) -> &RecordStatus {
        &self.status
    }

    /// Writes the record of `book` if it moved since the last write, off the async runtime.
    /// A failure is logged once per run of failures and counted; the agent goes on serving.
    pub async fn save(&mut self, book: &AddressBook) {
        if self.written == Some(book.revision()) {
            return;
        }
        let revision = book.revision();
        // A copy is cheap (persistent maps); the record is made off the runtime, from it.
        let book = book.clone();
        let path = self.path.clone();
        let result = tokio::task::spawn_blocking(move || write(&path, &book.record()))
            .await
            .unwrap_or_else(|panic| Err(format!("the writing thread failed: {panic}")));
        match result {
            Ok(()) => {
                if self.status.write_error.take().is_some() {
                    tracing::info!(path = %self.path.display(), "the address record is written again");
                }
                self.written = Some(revision);
            }
            Err(reason) => {
                self.metrics.address_record_write_failed();
                if self.status.write_error.is_none() {
                    tracing::warn!(
                        path = %self.path.display(),
                        "cannot write the address record ({reason}): a restart may move the \
                         addresses of names that had to move; retried at every change"
                    );
                }
                self.status.write_error = Some(reason);
            }
        }
    }
}

/// The record at `path`; `None` when there is none.
fn read(path: &Path) -> Result<Option<AddressRecord>, String> {
    state_file::read(path, MAX_RECORD_BYTES, "a record")
}

/// Writes `record` at `path` through a temporary file of its own, renamed over it.
fn write(path: &Path, record: &AddressRecord) -> Result<(), String> {
    state_file::replace(path, "addresses", record)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::MeshPath;

    fn trap() -> TrapCidrs {
        "240.240.0.0/16".parse().unwrap()
    }

    fn book_with(paths: &[&str]) -> AddressBook {
        let mut book = AddressBook::new(trap());
        for p in paths {
            book.assign_own(&p.parse::<MeshPath>().unwrap()).unwrap();
        }
        book
    }

    #[tokio::test]
    async fn a_written_record_restores_every_holder_and_a_bad_one_is_left_out() {
        let dir = tempfile::tempdir().unwrap();
        let (mut file, empty) =
            AddressRecordFile::load(dir.path(), &trap(), MeshMetrics::default());
        assert_eq!(empty.record().held.len(), 0);
        let book = book_with(&["/a/one", "/a/two"]);
        file.save(&book).await;
        assert_eq!(file.status().write_error, None);

        let (_, restored) = AddressRecordFile::load(dir.path(), &trap(), MeshMetrics::default());
        let mut restored = restored;
        for (path, ip) in &book.record().held {
            assert_eq!(
                restored.assign_own(&path.parse().unwrap()).unwrap(),
                *ip,
                "{path}"
            );
        }

        for (text, why) in [
            ("{\"format\": 1, \"block\"", "not a record"),
            ("[]", "not a record"),
        ] {
            std::fs::write(dir.path().join(RECORD_FILE), text).unwrap();
            let (file, book) = AddressRecordFile::load(dir.path(), &trap(), MeshMetrics::default());
            assert!(
                file.status().unused.as_deref().unwrap_or("").contains(why),
                "{:?}",
                file.status()
            );
            assert_eq!(book.record().freed.len(), 0);
        }
        let (_, foreign) = AddressRecordFile::load(
            dir.path(),
            &"240.241.0.0/16".parse().unwrap(),
            MeshMetrics::default(),
        );
        assert_eq!(foreign.record().freed.len(), 0);
    }

    /// Two agents (an upgrade's old and new) writing at once: every read sees a whole record,
    /// and nothing but the record is left in the directory.
    #[test]
    fn writers_at_once_never_leave_half_a_record() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(RECORD_FILE);
        let books: Vec<AddressRecord> = (0..2)
            .map(|w| {
                let paths: Vec<String> = (0..2000).map(|i| format!("/w{w}/s{i}")).collect();
                let refs: Vec<&str> = paths.iter().map(String::as_str).collect();
                book_with(&refs).record()
            })
            .collect();
        std::thread::scope(|scope| {
            for record in &books {
                let path = &path;
                scope.spawn(move || {
                    for _ in 0..20 {
                        write(path, record).unwrap();
                    }
                });
            }
            scope.spawn(|| {
                for _ in 0..200 {
                    if let Ok(Some(read)) = read(&path) {
                        assert!(books.contains(&read), "a record no writer wrote");
                    }
                }
            });
        });
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, [RECORD_FILE]);
    }
}
