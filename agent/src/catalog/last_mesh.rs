//! The node's last mesh (`--state-dir`, `mesh.json`): every service of the last settled
//! snapshot, as the sources described them, so that a restarted agent has a mesh before its
//! sources are listed again (about 1 s at 10k services from the Kubernetes API, 5 s at 50k).
//!
//! Read back, it is served provisionally ([`crate::mesh::MeshSnapshot::provisional`]), and only
//! where a mesh that may be out of date does no harm:
//! - DNS answers the names it holds, each at its own address (the address record keeps them),
//!   and every other name of the zone SERVFAIL, never NXDOMAIN: a name added since is retried,
//!   not denied. A name removed since is still answered until the sources are listed, and
//!   reaches a proxy that holds what it held before the restart, or nothing.
//! - The translators work from it, so the first settled snapshot, which is mostly the same
//!   mesh, costs the translation of what changed rather than of every service.
//!
//! Nothing of it is pushed to a proxy: a proxy may already hold a newer mesh than the one
//! written here (it is written at most every [`SAVE_EVERY`]), and a control plane must never
//! take a proxy back. Nor is the agent ready until its sources have reported.
//!
//! Written like the address record ([`crate::state_file`]): whole, through a temporary file
//! renamed over it, no fsync, off the async runtime. A file that cannot be used (unreadable,
//! not JSON, another format or trapped block, too large) is logged and left out: the agent
//! then starts as on a node's first start, with no mesh until its sources report.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use lattice_contract::TrapCidrs;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::StatusRx;
use crate::mesh::{MeshMetrics, MeshRx, MeshSnapshot, ServiceMap, ServiceSpec};
use crate::parallel::BulkThread;
use crate::state_file;

/// The file's name in `--state-dir`.
pub const LAST_MESH_FILE: &str = "mesh.json";

/// How often, at most, the file is written while the mesh changes: each write serializes the
/// whole mesh (about 10 MB at 10k services), on a thread that yields to the serving ones.
pub const SAVE_EVERY: Duration = Duration::from_secs(5);

/// A file larger than this is not read: 50k services with 10 endpoints each are about 46 MB.
const MAX_BYTES: u64 = 512 << 20;

/// Bumped whenever what is written changes meaning; a file of another format is not used.
const FORMAT: u32 = 1;

/// What `/debug/mesh` shows of the file (`last_mesh`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LastMeshStatus {
    pub path: PathBuf,
    /// Services read back at start and served provisionally until the sources reported.
    pub restored: usize,
    /// Services read back that the mesh could not take again (an address or name they could
    /// not have).
    #[serde(skip_serializing_if = "is_zero")]
    pub dropped: usize,
    /// Why the file read at start was not used, if it was not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unused: Option<String>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// The file in the state directory.
#[derive(Clone, Debug)]
pub struct LastMeshFile {
    path: PathBuf,
}

#[derive(Serialize)]
struct Written<'a> {
    format: u32,
    trap: String,
    services: Specs<'a>,
}

/// Every service's spec, made one at a time as it is written.
struct Specs<'a>(&'a ServiceMap);

impl Serialize for Specs<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.values().map(|service| service.spec()))
    }
}

#[derive(Deserialize)]
struct Read {
    format: u32,
    trap: String,
    services: Vec<ServiceSpec>,
}

impl LastMeshFile {
    pub fn in_dir(dir: &Path) -> Self {
        LastMeshFile {
            path: dir.join(LAST_MESH_FILE),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The services of the file, if there is one for `trap`: `Ok(None)` when there is none,
    /// `Err` with the reason when it cannot be used.
    pub fn read(&self, trap: &TrapCidrs) -> Result<Option<Vec<ServiceSpec>>, String> {
        let Some(read) = state_file::read::<Read>(&self.path, MAX_BYTES, "a last mesh")? else {
            return Ok(None);
        };
        if read.format != FORMAT {
            return Err(format!(
                "format {}, where this agent reads {FORMAT}",
                read.format
            ));
        }
        let ours = String::from(trap.clone());
        if read.trap != ours {
            return Err(format!(
                "written for the trapped block {:?}, not {ours:?}",
                read.trap
            ));
        }
        Ok(Some(read.services))
    }

    /// Writes the services of every settled snapshot published on `mesh`, at most once per
    /// [`SAVE_EVERY`], on a thread of its own, until `shutdown`. A failed write is logged once
    /// per run of failures and counted; the agent goes on serving.
    ///
    /// A restart's first settled snapshot is usually the mesh the file holds already: when it
    /// has the very services read back from the file, and the mesh took every one of them
    /// (`catalog` says), the file is left as it is. Writing it again cost about 0.2 s of CPU
    /// at 50k services, in the restart's busiest second.
    pub async fn keep(
        self,
        mut mesh: MeshRx,
        catalog: StatusRx,
        metrics: MeshMetrics,
        shutdown: CancellationToken,
    ) {
        let thread = match BulkThread::spawn("lattice-last-mesh") {
            Ok(thread) => thread,
            Err(error) => {
                // Not a reason to stop serving: a restart then waits for the sources.
                tracing::warn!(%error, "the node's last mesh cannot be written");
                shutdown.cancelled().await;
                return;
            }
        };
        let mut written: Option<u64> = None;
        let mut failing = false;
        // The services of the provisional snapshot, when they are the whole file.
        let mut read_back: Option<ServiceMap> = None;
        // A snapshot may already be waiting.
        mesh.mark_changed();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                changed = mesh.changed() => if changed.is_err() { return },
            }
            let Some(snapshot) = mesh.borrow_and_update().clone() else {
                continue;
            };
            if snapshot.provisional {
                // The catalog shows what it took of the file before it publishes the
                // provisional snapshot.
                let whole = catalog.borrow().last_mesh.as_ref().is_some_and(|status| {
                    status.dropped == 0 && status.restored == snapshot.services.len()
                });
                read_back = whole.then(|| snapshot.services.clone());
                continue;
            }
            if written == Some(snapshot.version) {
                continue;
            }
            let version = snapshot.version;
            let path = self.path.clone();
            let read_back = read_back.take();
            let result = thread
                .run(move || {
                    // Equal services share their `Arc`s when the merge kept them: cheap then.
                    if read_back.is_some_and(|read| read == snapshot.services) {
                        return Ok(Write::Current);
                    }
                    write(&path, &snapshot).map(|()| Write::Written)
                })
                .await
                .unwrap_or_else(|error| Err(error.to_string()));
            match result {
                Ok(Write::Current) => {
                    tracing::debug!(
                        path = %self.path.display(),
                        "the node's last mesh holds the settled mesh already; not written again"
                    );
                    written = Some(version);
                    metrics.last_mesh_holds(version);
                    // No write to space out: the next change is written as it comes.
                    continue;
                }
                Ok(Write::Written) => {
                    if std::mem::take(&mut failing) {
                        tracing::info!(path = %self.path.display(), "the node's last mesh is written again");
                    }
                    written = Some(version);
                    metrics.last_mesh_holds(version);
                }
                Err(reason) => {
                    metrics.last_mesh_write_failed();
                    if !std::mem::replace(&mut failing, true) {
                        tracing::warn!(
                            path = %self.path.display(),
                            "cannot write the node's last mesh ({reason}): a restarted agent \
                             answers DNS only once its sources are listed; retried at every change"
                        );
                    }
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(SAVE_EVERY) => {}
            }
        }
    }
}

/// What became of a settled snapshot.
enum Write {
    Written,
    /// The file held its services already.
    Current,
}

/// Writes `snapshot`'s services at `path`, replacing the file whole.
fn write(path: &Path, snapshot: &Arc<MeshSnapshot>) -> Result<(), String> {
    let written = Written {
        format: FORMAT,
        trap: String::from(snapshot.trap.clone()),
        services: Specs(&snapshot.services),
    };
    state_file::replace(path, "mesh", &written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::{InstanceSpec, MeshState, Protocol, ServicePort};

    fn trap() -> TrapCidrs {
        "240.240.0.0/16".parse().unwrap()
    }

    /// An HTTP service, a TCP one (an address of its own) and a stateful one: every spec
    /// field's own round trip is the mesh file's test (`source::file`).
    fn snapshot() -> Arc<MeshSnapshot> {
        let web = ServiceSpec::new(
            "/shop/web".parse().unwrap(),
            vec![ServicePort::parsed(
                8080,
                Protocol::Http,
                &["10.0.0.1:9090", "10.0.0.2:9090"],
            )],
        )
        .with_identities(vec!["spiffe://cluster.local/ns/shop/sa/web".into()]);
        let db = ServiceSpec::new(
            "/shop/db".parse().unwrap(),
            vec![ServicePort::parsed(5432, Protocol::Tcp, &["10.0.0.3:5432"])],
        );
        let cache = ServiceSpec::new(
            "/data/cache".parse().unwrap(),
            vec![ServicePort::parsed(6379, Protocol::Tcp, &[])],
        )
        .with_instances(vec![InstanceSpec {
            name: "cache-0".into(),
            ready: true,
            endpoints: vec![(6379, "10.0.0.4:6379".parse().unwrap())],
        }]);
        let mut state = MeshState::new(trap());
        state.replace_all(vec![web, db, cache]).unwrap();
        state.snapshot()
    }

    #[test]
    fn every_service_reads_back_as_its_source_said_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = LastMeshFile::in_dir(dir.path());
        assert_eq!(file.read(&trap()), Ok(None), "none yet");
        let mesh = snapshot();
        write(file.path(), &mesh).unwrap();
        let read = file.read(&trap()).unwrap().unwrap();
        let written: Vec<ServiceSpec> = mesh.services.values().map(|s| s.spec()).collect();
        assert_eq!(read, written);
        // Taken again, the mesh is the same services at the same addresses.
        let mut again = MeshState::new(trap());
        again.replace_all(read).unwrap();
        assert_eq!(again.snapshot().services, mesh.services);
    }

    #[test]
    fn a_file_of_another_block_or_format_or_torn_is_not_used() {
        let dir = tempfile::tempdir().unwrap();
        let file = LastMeshFile::in_dir(dir.path());
        write(file.path(), &snapshot()).unwrap();
        let other: TrapCidrs = "241.0.0.0/16".parse().unwrap();
        let refused = file.read(&other).unwrap_err();
        assert!(refused.contains("trapped block"), "{refused}");

        let text = std::fs::read_to_string(file.path()).unwrap();
        std::fs::write(
            file.path(),
            text.replacen("\"format\":1", "\"format\":99", 1),
        )
        .unwrap();
        let refused = file.read(&trap()).unwrap_err();
        assert!(refused.contains("format 99"), "{refused}");

        std::fs::write(file.path(), &text[..text.len() / 2]).unwrap();
        let refused = file.read(&trap()).unwrap_err();
        assert!(refused.starts_with("not a last mesh"), "{refused}");

        // A path no source could have written is refused as a source's would be.
        std::fs::write(file.path(), text.replacen("/shop/web", "/Shop/web", 1)).unwrap();
        assert!(file.read(&trap()).is_err());
    }
}
