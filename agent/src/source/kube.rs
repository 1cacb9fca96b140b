//! Kubernetes source: Services (core/v1) and EndpointSlices (discovery.k8s.io/v1) through the
//! kube-rs runtime `watcher`, folded into a compact index that feeds the mesh state.
//!
//! Nothing is published until every watch has finished its initial list, so a snapshot never
//! holds Services without their endpoints. After that each batch of API events recomputes
//! only the Services it touches and publishes one new snapshot. Re-lists (after a 410, or a
//! restart of the API server) replace the re-listed scope at once: nothing lost, nothing kept
//! that vanished. Watch failures are retried by the watcher with client-go's backoff.

mod index;
mod mapping;

use std::pin::Pin;
use std::time::Instant;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use lattice_contract::TrapCidrs;

use crate::mesh::{AddressError, MeshSnapshot, MeshTx, PathError};

pub use index::MeshIndex;
pub use mapping::{PATH_ANNOTATION, SERVICE_NAME_LABEL, port_protocol};

use mapping::{MappedService, MappedSlice, ObjectKey};

pub struct KubeSourceConfig {
    /// Namespaces to watch; empty means the whole cluster.
    pub namespaces: Vec<String>,
    pub trap: TrapCidrs,
}

#[derive(Debug, thiserror::Error)]
pub enum KubeSourceError {
    #[error(
        "service {service}: annotation {PATH_ANNOTATION}={value:?} is not a mesh path ({source}); \
         fix or remove the annotation"
    )]
    InvalidPath {
        service: String,
        value: String,
        source: PathError,
    },
    #[error(
        "service {service} is skipped: mesh path {path} is held by service {owner} (the oldest \
         claim wins); give one of them another {PATH_ANNOTATION}"
    )]
    PathTaken {
        path: String,
        service: String,
        owner: String,
    },
    #[error("service at mesh path {path} is skipped: {source}")]
    Address { path: String, source: AddressError },
    #[error("the Kubernetes watch streams ended; the agent must restart to watch again")]
    WatchEnded,
}

/// The two resources the source watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resource {
    Services,
    EndpointSlices,
}

impl Resource {
    fn as_str(self) -> &'static str {
        match self {
            Resource::Services => "services",
            Resource::EndpointSlices => "endpointslices",
        }
    }
}

/// Which objects one watch covers.
#[derive(Clone, Debug)]
struct WatchScope {
    resource: Resource,
    namespace: Option<String>,
}

/// An object as the index keeps it. Watch events are mapped as they arrive, so whole
/// Kubernetes objects live only as long as one page of a list.
enum Object {
    Service(ObjectKey, MappedService),
    Slice(ObjectKey, MappedSlice),
}

impl Object {
    fn service(service: &Service) -> Object {
        let (key, mapped) = mapping::service_entry(service);
        Object::Service(key, mapped)
    }

    fn slice(slice: &EndpointSlice) -> Object {
        let (key, mapped) = mapping::slice_entry(slice);
        Object::Slice(key, mapped)
    }
}

/// One watch event, mapped.
enum Change {
    Init,
    InitApply(Object),
    InitDone,
    Apply(Object),
    Delete(Object),
}

impl Change {
    fn of<K>(event: watcher::Event<K>, map: fn(&K) -> Object) -> Change {
        match event {
            watcher::Event::Init => Change::Init,
            watcher::Event::InitApply(object) => Change::InitApply(map(&object)),
            watcher::Event::InitDone => Change::InitDone,
            watcher::Event::Apply(object) => Change::Apply(map(&object)),
            watcher::Event::Delete(object) => Change::Delete(map(&object)),
        }
    }
}

/// One event of one watch: the watch's index in [`WatchSet`], and what it saw.
type WatchEvent = (usize, Result<Change, watcher::Error>);

/// Watches the cluster (or the configured namespaces) and publishes mesh snapshots on `tx`
/// until `shutdown` is cancelled.
pub async fn run(
    client: kube::Client,
    config: KubeSourceConfig,
    tx: MeshTx,
    shutdown: CancellationToken,
) -> Result<(), KubeSourceError> {
    let mut namespaces: Vec<Option<String>> = if config.namespaces.is_empty() {
        vec![None]
    } else {
        config.namespaces.iter().cloned().map(Some).collect()
    };
    // One watch per namespace: a namespace named twice must not be listed twice.
    namespaces.sort();
    namespaces.dedup();
    let mut scopes = Vec::new();
    let mut streams: Vec<Pin<Box<dyn Stream<Item = WatchEvent> + Send>>> = Vec::new();
    for namespace in &namespaces {
        let id = scopes.len();
        scopes.push(WatchScope {
            resource: Resource::Services,
            namespace: namespace.clone(),
        });
        streams.push(
            watcher(
                api::<Service>(&client, namespace),
                watcher::Config::default(),
            )
            .default_backoff()
            .map(move |event| (id, event.map(|e| Change::of(e, Object::service))))
            .boxed(),
        );
        let id = scopes.len();
        scopes.push(WatchScope {
            resource: Resource::EndpointSlices,
            namespace: namespace.clone(),
        });
        streams.push(
            watcher(
                api::<EndpointSlice>(&client, namespace),
                watcher::Config::default(),
            )
            .default_backoff()
            .map(move |event| (id, event.map(|e| Change::of(e, Object::slice))))
            .boxed(),
        );
    }
    info!(
        namespaces = ?config.namespaces,
        "watching Kubernetes services and endpointslices{}",
        if config.namespaces.is_empty() { " cluster-wide" } else { "" }
    );
    let watches = WatchSet::new(config.trap, scopes);
    follow(
        futures::stream::select_all(streams),
        watches,
        &tx,
        &shutdown,
    )
    .await
}

fn api<K>(client: &kube::Client, namespace: &Option<String>) -> Api<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// Applies events as they come, a ready batch at a time, and publishes after each batch.
async fn follow(
    events: impl Stream<Item = WatchEvent> + Unpin,
    mut watches: WatchSet,
    tx: &MeshTx,
    shutdown: &CancellationToken,
) -> Result<(), KubeSourceError> {
    let mut batches = events.ready_chunks(1024);
    loop {
        let batch = tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            batch = batches.next() => batch,
        };
        let Some(batch) = batch else {
            return Err(KubeSourceError::WatchEnded);
        };
        for (watch, result) in batch {
            watches.handle(watch, result);
        }
        if let Some(snapshot) = watches.publishable() {
            tx.send_replace(Some(snapshot));
        }
    }
}

/// Every watch of the source, how far each one's list has come, and the index they feed: the
/// I/O-free half of the source, watch events in, snapshots out.
struct WatchSet {
    index: MeshIndex,
    scopes: Vec<WatchScope>,
    /// Per watch: the objects of a list in progress, applied at once when it completes.
    pending: Vec<Option<Vec<Object>>>,
    /// Per watch: whether its initial list has completed.
    listed: Vec<bool>,
    started: Instant,
    ready: bool,
}

impl WatchSet {
    fn new(trap: TrapCidrs, scopes: Vec<WatchScope>) -> Self {
        let n = scopes.len();
        WatchSet {
            index: MeshIndex::new(trap),
            scopes,
            pending: (0..n).map(|_| None).collect(),
            listed: vec![false; n],
            started: Instant::now(),
            ready: false,
        }
    }

    fn handle(&mut self, watch: usize, result: Result<Change, watcher::Error>) {
        let Some(scope) = self.scopes.get(watch) else {
            return;
        };
        match result {
            Err(err) => warn!(
                resource = scope.resource.as_str(),
                namespace = scope.namespace.as_deref().unwrap_or("*"),
                "Kubernetes watch failed, retrying with backoff: {}",
                error_chain(&err)
            ),
            Ok(Change::Init) => self.pending[watch] = Some(Vec::new()),
            Ok(Change::InitApply(object)) => {
                if let Some(pending) = &mut self.pending[watch] {
                    pending.push(object);
                }
            }
            Ok(Change::InitDone) => {
                let listed = self.pending[watch].take().unwrap_or_default();
                let namespace = scope.namespace.as_deref();
                match scope.resource {
                    Resource::Services => {
                        let services = listed
                            .into_iter()
                            .filter_map(|o| match o {
                                Object::Service(key, mapped) => Some((key, mapped)),
                                Object::Slice(..) => None,
                            })
                            .collect();
                        self.index.replace_services(namespace, services);
                    }
                    Resource::EndpointSlices => {
                        let slices = listed
                            .into_iter()
                            .filter_map(|o| match o {
                                Object::Slice(key, mapped) => Some((key, mapped)),
                                Object::Service(..) => None,
                            })
                            .collect();
                        self.index.replace_slices(namespace, slices);
                    }
                }
                self.listed[watch] = true;
            }
            Ok(Change::Apply(Object::Service(key, mapped))) => {
                self.index.apply_mapped_service(key, mapped)
            }
            Ok(Change::Apply(Object::Slice(key, mapped))) => {
                self.index.apply_mapped_slice(key, mapped)
            }
            Ok(Change::Delete(Object::Service(key, _))) => self.index.delete_service(key),
            Ok(Change::Delete(Object::Slice(key, _))) => self.index.delete_slice(key),
        }
    }

    /// The snapshot to publish now: none before every initial list is complete, and none
    /// when nothing changed.
    fn publishable(&mut self) -> Option<std::sync::Arc<MeshSnapshot>> {
        if !self.ready {
            if !self.listed.iter().all(|l| *l) {
                return None;
            }
            self.ready = true;
            info!(
                services = self.index.service_count(),
                endpoints = self.index.endpoint_count(),
                elapsed_ms = self.started.elapsed().as_millis() as u64,
                "Kubernetes initial lists complete; publishing the mesh"
            );
        }
        self.index.take_snapshot()
    }
}

/// An error and its causes on one line, so the log says why (say, connection refused).
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests;
