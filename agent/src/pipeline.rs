//! The one-way flow from a source's mesh snapshots to what the servers hand out: waits out a
//! short burst of changes, runs the translators once, and publishes the results.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lattice_dns::NameTable;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::metrics::XdsMetrics;
use crate::source::SnapshotRx;
use crate::translate;
use crate::translate::envoy::{EnvoyTranslator, XdsSnapshot};
use crate::xds::server::XdsRx;

pub struct Outputs {
    pub xds: XdsRx,
    pub names: watch::Receiver<Arc<NameTable>>,
}

pub struct Pipeline {
    mesh: SnapshotRx,
    debounce: Duration,
    xds: watch::Sender<Option<Arc<XdsSnapshot>>>,
    names: watch::Sender<Arc<NameTable>>,
    metrics: XdsMetrics,
}

impl Pipeline {
    pub fn new(mesh: SnapshotRx, debounce: Duration, metrics: XdsMetrics) -> (Pipeline, Outputs) {
        let (xds, xds_rx) = watch::channel(None);
        let (names, names_rx) = watch::channel(Arc::new(NameTable::new(Vec::new())));
        let pipeline = Pipeline {
            mesh,
            debounce,
            xds,
            names,
            metrics,
        };
        let outputs = Outputs {
            xds: xds_rx,
            names: names_rx,
        };
        (pipeline, outputs)
    }

    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut translator = EnvoyTranslator::default();
        // A snapshot may already be waiting (the file source publishes before we start).
        self.mesh.mark_changed();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                changed = self.mesh.changed() => if changed.is_err() { return },
            }
            let seen_at = Instant::now();
            // Coalesce a burst: whatever arrives during the debounce goes out in one push.
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(self.debounce) => {}
            }
            let Some(mesh) = self.mesh.borrow_and_update().clone() else {
                continue;
            };
            let translation = translator.translate(&mesh);
            let mut xds = translation.xds;
            xds.seen_at = Some(seen_at);
            // Names and addresses change only with the shape of the mesh, not its endpoints.
            if translation.shape_changed {
                self.names
                    .send_replace(Arc::new(translate::dns::name_table(&mesh)));
            }
            self.xds.send_replace(Some(Arc::new(xds)));
            self.metrics
                .snapshot_version
                .set(i64::try_from(mesh.version).unwrap_or(i64::MAX));
            tracing::info!(
                version = mesh.version,
                services = mesh.services.len(),
                endpoints = mesh.endpoint_count(),
                translate_ms = seen_at
                    .elapsed()
                    .saturating_sub(self.debounce)
                    .as_secs_f64()
                    * 1e3,
                "serving mesh snapshot"
            );
        }
    }
}
