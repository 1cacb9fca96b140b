//! The catalog: every provider's view merged into the one mesh snapshot the translators and the
//! admin server read.
//!
//! Each provider (Kubernetes, each mesh file) publishes its own complete view on a channel of
//! its own ([`crate::mesh::provider`]). The catalog waits for every provider's first view, merges
//! them all at once (so the first snapshot does not depend on which provider answered first),
//! then follows each provider's changes: a change costs the services it touched, found by
//! diffing the provider's previous and new views.
//!
//! The merge rules per service path are in [`merge`]: one provider's service is served as it
//! says; several providers' services are served as one, their endpoints united, when their ports
//! and protocols agree; a provider that disagrees is reported as a conflict and does not disturb
//! what is served.

pub mod address_record;
pub mod last_mesh;
mod merge;

use std::sync::Arc;

use futures::FutureExt as _;
use lattice_contract::TrapCidrs;
use serde::Serialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub use address_record::{AddressRecordFile, RecordStatus};
pub use last_mesh::{LastMeshFile, LastMeshStatus};
pub use merge::{Conflict, Merger};

use crate::mesh::{
    AddressBook, MeshMetrics, MeshSnapshot, MeshTx, Provider, ProviderRx, ServiceSpec, Stale,
};
use crate::parallel::BulkThread;
use crate::readiness::{Readiness, ReadyToken};

/// One provider as `/debug/mesh` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ProviderStatus {
    pub name: Provider,
    /// Whether its first complete view has arrived: the catalog publishes nothing before
    /// every provider's has.
    pub synced: bool,
    /// Services in its view.
    pub services: usize,
    /// Set while its view may be out of date; its last good view keeps serving.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stale: Option<Stale>,
}

/// What the catalog is merging, and what it refused to: for operators.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CatalogStatus {
    pub providers: Vec<ProviderStatus>,
    pub conflicts: Vec<Conflict>,
    /// The address record on the node, when there is one (`--state-dir`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub addresses: Option<RecordStatus>,
    /// The node's last mesh, when there is one (`--state-dir`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_mesh: Option<LastMeshStatus>,
}

pub type StatusRx = watch::Receiver<CatalogStatus>;

/// A provider the catalog merges: its name, in the order providers rank (an address several
/// providers report is attributed to the first), and its channel.
pub struct Feed {
    pub provider: Provider,
    pub reports: ProviderRx,
}

/// The running catalog: feeds in, merged snapshots out on the mesh channel.
pub struct Catalog {
    merger: Merger,
    feeds: Vec<ProviderRx>,
    /// Per provider: held until its first view arrives (`/readyz` names it meanwhile).
    ready: Vec<Option<ReadyToken>>,
    status: watch::Sender<CatalogStatus>,
    metrics: MeshMetrics,
    /// Where the address book is kept on the node, if anywhere.
    record: Option<AddressRecordFile>,
    /// Where the node's last mesh is read back from at start, if anywhere.
    last_mesh: Option<LastMeshFile>,
}

impl Catalog {
    pub fn new(
        trap: TrapCidrs,
        feeds: Vec<Feed>,
        readiness: &Readiness,
        metrics: MeshMetrics,
    ) -> (Catalog, StatusRx) {
        let providers = feeds.iter().map(|f| f.provider.clone()).collect();
        let ready = feeds
            .iter()
            .map(|f| Some(readiness.register(format!("provider {}", f.provider))))
            .collect();
        let merger = Merger::new(trap, providers);
        let (status, status_rx) = watch::channel(merger.status());
        let catalog = Catalog {
            merger,
            feeds: feeds.into_iter().map(|f| f.reports).collect(),
            ready,
            status,
            metrics,
            record: None,
            last_mesh: None,
        };
        (catalog, status_rx)
    }

    /// Addresses start from `book`, restored from the node's record in `file`, which every
    /// change of the addresses is written to before the snapshot that uses them is published.
    pub fn with_address_record(mut self, file: AddressRecordFile, book: AddressBook) -> Self {
        self.merger = self.merger.with_address_book(book);
        self.record = Some(file);
        self
    }

    /// Before the providers report, serves the node's last mesh from `file` provisionally
    /// ([`last_mesh`]); with the address record, so that its services get their addresses.
    pub fn with_last_mesh(mut self, file: LastMeshFile) -> Self {
        self.last_mesh = Some(file);
        self
    }

    /// Merges until shutdown, publishing each merged snapshot on `mesh` (nothing before every
    /// provider's first view).
    ///
    /// The merging runs off the async runtime, on a [`BulkThread`] of its own: a change costs
    /// the services it touched, but the first merge is every service's, bulk work that would
    /// hold a runtime worker, and the DNS queries queued on it, for as long (about 1 s for 10k
    /// services in a debug build). A bulk thread rather than tokio's blocking pool, whose
    /// threads run at the serving threads' priority.
    pub async fn run(self, mesh: MeshTx, shutdown: CancellationToken) {
        let Catalog {
            merger,
            mut feeds,
            mut ready,
            status: status_tx,
            metrics,
            mut record,
            last_mesh,
        } = self;
        // At normal policy until the first settled snapshot: the agent's start waits on it.
        let thread = match BulkThread::spawn_urgent("lattice-merge") {
            Ok(thread) => thread,
            Err(error) => {
                tracing::error!(%error, "the catalog cannot merge");
                return;
            }
        };
        let mut merger = Some(merger);
        // The node's last mesh is read beside the providers' first lists, on a thread of its
        // own, and taken in only if it comes before every provider's first view: it never
        // delays them. Not at all when every provider has already reported (mesh files alone,
        // read before the catalog starts).
        let reported = feeds.iter().all(|feed| feed.borrow().view.is_some());
        let reader =
            last_mesh.filter(|_| !reported).and_then(|file| {
                match BulkThread::spawn_urgent("lattice-last-mesh") {
                    Ok(thread) => Some((thread, file)),
                    Err(error) => {
                        tracing::warn!(%error, "the node's last mesh cannot be read");
                        None
                    }
                }
            });
        let mut reading = reader
            .as_ref()
            .zip(merger.as_ref())
            .map(|((thread, file), m)| {
                let (file, trap) = (file.clone(), m.trap().clone());
                Box::pin(thread.run(move || read_last_mesh(&file, &trap)))
            });
        let mut last_mesh_status = None;
        // The first pass reads what providers published before the catalog started.
        let mut first = true;
        loop {
            // `changed()` marks what it saw as seen: the provider it woke for is read below
            // by index, the others if they changed meanwhile.
            let mut woken = None;
            if !std::mem::take(&mut first) {
                let changed =
                    futures::future::select_all(feeds.iter_mut().map(|rx| rx.changed().boxed()));
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    read = async { reading.as_mut()?.await.ok() }, if reading.is_some() => {
                        reading = None;
                        let Some((status, specs)) = read else { continue };
                        let Some(taken) = merger.take() else { return };
                        let back = tokio::select! {
                            () = shutdown.cancelled() => return,
                            back = take_in_last_mesh(&thread, taken, status, specs) => back,
                        };
                        let Some((back, snapshot, status)) = back else { return };
                        merger = Some(back);
                        // Shown before anything is answered from it, not with the pass
                        // below, which waits for the merging thread.
                        status_tx.send_modify(|shown| shown.last_mesh = Some(status.clone()));
                        if let Some(snapshot) = snapshot {
                            mesh.send_replace(Some(snapshot));
                        }
                        // On to a pass with whatever the providers published meanwhile.
                        last_mesh_status = Some(status);
                    }
                    (result, index, _) = changed => {
                        if result.is_err() {
                            // A provider's task ended; the agent is stopping or has failed.
                            shutdown.cancelled().await;
                            return;
                        }
                        woken = Some(index);
                    }
                }
            }
            let mut reports = Vec::new();
            for (index, feed) in feeds.iter_mut().enumerate() {
                let unread = woken == Some(index)
                    || feed.has_changed().unwrap_or(false)
                    || first_look(&ready, index);
                if !unread {
                    continue;
                }
                let report = feed.borrow_and_update().clone();
                if report.view.is_some() {
                    ready[index] = None;
                }
                reports.push((index, report));
            }
            // Taken out and put back by every pass: only the merging thread touches it meanwhile.
            let Some(mut taken) = merger.take() else {
                return;
            };
            let merging = thread.run(move || {
                let mut changed = false;
                for (index, report) in reports {
                    changed |= taken.update(index, report);
                }
                let snapshot = changed.then(|| taken.snapshot()).flatten();
                let status = taken.status();
                (taken, snapshot, status)
            });
            let (back, snapshot, mut status) = tokio::select! {
                () = shutdown.cancelled() => return,
                merged = merging => match merged {
                    Ok(merged) => merged,
                    Err(error) => {
                        tracing::error!(%error, "the catalog stopped merging");
                        return;
                    }
                },
            };
            if let Some(snapshot) = snapshot {
                // Before anyone can resolve a new address: a restart must give it back.
                if let Some(record) = &mut record {
                    record.save(back.address_book()).await;
                }
                if !snapshot.provisional {
                    thread.settle();
                }
                mesh.send_replace(Some(snapshot));
            }
            merger = Some(back);
            status.addresses = record.as_ref().map(|r| r.status().clone());
            status.last_mesh.clone_from(&last_mesh_status);
            let stale = status
                .providers
                .iter()
                .filter(|p| p.stale.is_some())
                .count();
            metrics.observe_catalog(status.conflicts.len(), stale);
            status_tx.send_if_modified(|old| {
                let modified = *old != status;
                *old = status;
                modified
            });
        }
    }
}

/// The node's last mesh in `file`, and what `/debug/mesh` says of it.
fn read_last_mesh(file: &LastMeshFile, trap: &TrapCidrs) -> (LastMeshStatus, Vec<ServiceSpec>) {
    let mut status = LastMeshStatus {
        path: file.path().to_path_buf(),
        ..LastMeshStatus::default()
    };
    let specs = match file.read(trap) {
        Ok(specs) => specs.unwrap_or_default(),
        Err(reason) => {
            tracing::warn!(
                path = %status.path.display(),
                "the node's last mesh is not used ({reason}): nothing is served before the \
                 sources report"
            );
            status.unused = Some(reason);
            Vec::new()
        }
    };
    (status, specs)
}

/// Takes `specs` into `merger` on the merging thread, if no provider's view was merged
/// meanwhile: the provisional snapshot to publish, if they were taken. `None` when the
/// thread is gone.
async fn take_in_last_mesh(
    thread: &BulkThread,
    merger: Merger,
    mut status: LastMeshStatus,
    specs: Vec<ServiceSpec>,
) -> Option<(Merger, Option<Arc<MeshSnapshot>>, LastMeshStatus)> {
    let job = thread.run(move || {
        if merger.has_merged() {
            if !specs.is_empty() {
                status.unused = Some("the sources reported before it was read".into());
            }
            return (merger, None, status);
        }
        let offered = specs.len();
        let (mut merger, taken) = merger.with_last_mesh(specs);
        let snapshot = merger.provisional_snapshot();
        status.restored = taken;
        status.dropped = offered - taken;
        (merger, snapshot, status)
    });
    let (merger, snapshot, status) = match job.await {
        Ok(done) => done,
        Err(error) => {
            tracing::error!(%error, "the catalog stopped merging");
            return None;
        }
    };
    if snapshot.is_some() {
        tracing::info!(
            path = %status.path.display(),
            restored = status.restored,
            dropped = status.dropped,
            "the node's last mesh answers DNS until the sources report; no proxy is sent it"
        );
    }
    Some((merger, snapshot, status))
}

/// A provider whose first view has not been taken yet is read even if its channel says it has
/// not changed (it published before the catalog subscribed).
fn first_look(ready: &[Option<ReadyToken>], index: usize) -> bool {
    ready.get(index).is_some_and(Option::is_some)
}
