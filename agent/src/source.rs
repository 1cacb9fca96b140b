//! Mesh sources: where the mesh comes from (a mesh file, or Kubernetes), and the channel they
//! publish snapshots on. A source publishes only complete, consistent snapshots; `None` means
//! "nothing synced yet", which keeps `/readyz` false.

pub mod file;
pub mod kube;

use std::sync::Arc;

use tokio::sync::watch;

use crate::mesh::MeshSnapshot;

pub type SnapshotTx = watch::Sender<Option<Arc<MeshSnapshot>>>;
pub type SnapshotRx = watch::Receiver<Option<Arc<MeshSnapshot>>>;

/// The one channel from the active source to every consumer (xDS, DNS, admin).
pub fn channel() -> (SnapshotTx, SnapshotRx) {
    watch::channel(None)
}
