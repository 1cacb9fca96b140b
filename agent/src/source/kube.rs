//! Kubernetes source: Services (core/v1) and EndpointSlices (discovery.k8s.io/v1), and the
//! Gateway API's HTTPRoutes, GRPCRoutes and ReferenceGrants (gateway.networking.k8s.io/v1),
//! through the kube-rs runtime `watcher`, folded into a compact index that feeds the mesh state.
//!
//! The Gateway API kinds are optional: on a cluster without their CRDs the API server answers
//! 404, which counts as an empty, complete list (so the agent gets ready), is logged once, and
//! keeps being retried with backoff, so CRDs installed later are picked up.
//!
//! Nothing is published until every watch has finished its initial list, so a snapshot never
//! holds Services without their endpoints. After that each batch of API events recomputes
//! only the Services it touches and publishes one new snapshot. Re-lists (after a 410, or a
//! restart of the API server) replace the re-listed scope at once: nothing lost, nothing kept
//! that vanished. Watch failures are retried by the watcher with client-go's backoff.

mod index;
mod mapping;
pub mod node;
pub mod pods;
mod routes;

use std::pin::Pin;
use std::time::Instant;

use futures::{Stream, StreamExt};
use gateway_api::experimental::httproutes::HttpRoute;
use gateway_api::grpcroutes::GrpcRoute;
use gateway_api::referencegrants::ReferenceGrant;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use lattice_contract::TrapCidrs;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::mesh::provider::Report as _;
use crate::mesh::{AddressError, MeshSnapshot, PathError, ProviderTx};

pub use index::MeshIndex;
pub use mapping::{HOST_HEADER_ANNOTATION, PATH_ANNOTATION, SERVICE_NAME_LABEL, port_protocol};

use mapping::{MappedService, MappedSlice, ObjectKey};
use routes::{GrantEntry, RouteEntry, RouteKey, RouteKind};

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
        "service {service} is skipped: annotation {} is not a valid health policy: {message}",
        crate::source::health::HEALTH_ANNOTATION
    )]
    InvalidHealth { service: String, message: String },
    #[error("ExternalName service {service} is skipped: spec.externalName: {source}")]
    InvalidExternalName {
        service: String,
        source: crate::mesh::HostNameError,
    },
    #[error(
        "service {service} is skipped: annotation {}: {source}",
        mapping::HOST_HEADER_ANNOTATION
    )]
    InvalidHostHeader {
        service: String,
        source: crate::mesh::UnknownHostHeader,
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

/// The resources the source watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resource {
    Services,
    EndpointSlices,
    HttpRoutes,
    GrpcRoutes,
    ReferenceGrants,
}

impl Resource {
    fn as_str(self) -> &'static str {
        match self {
            Resource::Services => "services",
            Resource::EndpointSlices => "endpointslices",
            Resource::HttpRoutes => "httproutes.gateway.networking.k8s.io",
            Resource::GrpcRoutes => "grpcroutes.gateway.networking.k8s.io",
            Resource::ReferenceGrants => "referencegrants.gateway.networking.k8s.io",
        }
    }

    /// A resource whose CRD may not be installed: its absence is an empty list, not an error.
    fn is_optional(self) -> bool {
        !matches!(self, Resource::Services | Resource::EndpointSlices)
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
    Route(RouteKey, RouteEntry),
    Grant(ObjectKey, GrantEntry),
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

    fn http_route(route: &HttpRoute) -> Object {
        let (key, entry) = routes::http_route_entry(route);
        Object::Route(key, entry)
    }

    fn grpc_route(route: &GrpcRoute) -> Object {
        let (key, entry) = routes::grpc_route_entry(route);
        Object::Route(key, entry)
    }

    fn grant(grant: &ReferenceGrant) -> Object {
        let (key, entry) = routes::grant_entry(grant);
        Object::Grant(key, entry)
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
    tx: ProviderTx,
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
    let mut watches = Watches::default();
    for namespace in &namespaces {
        watches.add(&client, namespace, Resource::Services, Object::service);
        watches.add(&client, namespace, Resource::EndpointSlices, Object::slice);
        watches.add(&client, namespace, Resource::HttpRoutes, Object::http_route);
        watches.add(&client, namespace, Resource::GrpcRoutes, Object::grpc_route);
        watches.add(&client, namespace, Resource::ReferenceGrants, Object::grant);
    }
    info!(
        namespaces = ?config.namespaces,
        "watching Kubernetes services, endpointslices, httproutes, grpcroutes and \
         referencegrants{}",
        if config.namespaces.is_empty() { " cluster-wide" } else { "" }
    );
    let set = WatchSet::new(config.trap, watches.scopes);
    follow(
        futures::stream::select_all(watches.streams),
        set,
        &tx,
        &shutdown,
    )
    .await
}

/// The watches being set up: their scopes, and their event streams tagged with their index.
#[derive(Default)]
struct Watches {
    scopes: Vec<WatchScope>,
    streams: Vec<Pin<Box<dyn Stream<Item = WatchEvent> + Send>>>,
}

impl Watches {
    fn add<K>(
        &mut self,
        client: &kube::Client,
        namespace: &Option<String>,
        resource: Resource,
        map: fn(&K) -> Object,
    ) where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + std::fmt::Debug
            + serde::de::DeserializeOwned
            + Send
            + 'static,
        K::DynamicType: Default,
    {
        let id = self.scopes.len();
        self.scopes.push(WatchScope {
            resource,
            namespace: namespace.clone(),
        });
        self.streams.push(
            watcher(api::<K>(client, namespace), watcher::Config::default())
                .default_backoff()
                .map(move |event| (id, event.map(|e| Change::of(e, map))))
                .boxed(),
        );
    }
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
    tx: &ProviderTx,
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
            tx.view(snapshot);
        }
        match watches.failing() {
            Some(reason) => tx.stale(reason),
            None => tx.fresh(),
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
    /// Per watch: whether the API server said its resource does not exist (optional only).
    missing: Vec<bool>,
    /// Per watch: why it is failing, until it delivers an event again.
    failing: Vec<Option<String>>,
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
            missing: vec![false; n],
            failing: vec![None; n],
            started: Instant::now(),
            ready: false,
        }
    }

    fn handle(&mut self, watch: usize, result: Result<Change, watcher::Error>) {
        let Some(scope) = self.scopes.get(watch).cloned() else {
            return;
        };
        // A watch that delivers again has recovered. One that recovered with nothing to say
        // stays marked until its next event: the watcher does not surface a quiet reconnect.
        if result.is_ok() {
            self.failing[watch] = None;
        }
        match result {
            Err(err) if scope.resource.is_optional() && is_not_found(&err) => {
                self.absent(watch, &scope)
            }
            Err(err) => {
                let reason = error_chain(&err);
                warn!(
                    resource = scope.resource.as_str(),
                    namespace = scope.namespace.as_deref().unwrap_or("*"),
                    "Kubernetes watch failed, retrying with backoff: {reason}",
                );
                self.failing[watch] = Some(format!("{} watch: {reason}", scope.resource.as_str()));
            }
            Ok(Change::Init) => self.pending[watch] = Some(Vec::new()),
            Ok(Change::InitApply(object)) => {
                if let Some(pending) = &mut self.pending[watch] {
                    pending.push(object);
                }
            }
            Ok(Change::InitDone) => {
                let listed = self.pending[watch].take().unwrap_or_default();
                if self.missing[watch] {
                    info!(
                        resource = scope.resource.as_str(),
                        "Gateway API resource found; its objects are read from now on"
                    );
                    self.missing[watch] = false;
                }
                self.replace(&scope, listed);
                self.listed[watch] = true;
            }
            Ok(Change::Apply(object)) => self.apply(object),
            Ok(Change::Delete(object)) => self.delete(object),
        }
    }

    /// An optional resource the API server does not know (its CRD is not installed): an empty,
    /// complete list, said once; the watcher keeps trying, so a CRD installed later is read.
    fn absent(&mut self, watch: usize, scope: &WatchScope) {
        if !self.missing[watch] {
            warn!(
                resource = scope.resource.as_str(),
                namespace = scope.namespace.as_deref().unwrap_or("*"),
                "Gateway API resource not installed (404); routing rules from it are ignored \
                 until its CRD appears"
            );
            self.missing[watch] = true;
            self.pending[watch] = None;
            self.replace(scope, Vec::new());
        }
        self.listed[watch] = true;
    }

    /// Makes the objects of one watch's scope exactly `listed`.
    fn replace(&mut self, scope: &WatchScope, listed: Vec<Object>) {
        let namespace = scope.namespace.as_deref();
        match scope.resource {
            Resource::Services => {
                let services = listed
                    .into_iter()
                    .filter_map(|o| match o {
                        Object::Service(key, mapped) => Some((key, mapped)),
                        _ => None,
                    })
                    .collect();
                self.index.replace_services(namespace, services);
            }
            Resource::EndpointSlices => {
                let slices = listed
                    .into_iter()
                    .filter_map(|o| match o {
                        Object::Slice(key, mapped) => Some((key, mapped)),
                        _ => None,
                    })
                    .collect();
                self.index.replace_slices(namespace, slices);
            }
            Resource::HttpRoutes | Resource::GrpcRoutes => {
                let kind = if scope.resource == Resource::HttpRoutes {
                    RouteKind::Http
                } else {
                    RouteKind::Grpc
                };
                let routes = listed
                    .into_iter()
                    .filter_map(|o| match o {
                        Object::Route(key, entry) if key.kind == kind => Some((key, entry)),
                        _ => None,
                    })
                    .collect();
                self.index.replace_routes(kind, namespace, routes);
            }
            Resource::ReferenceGrants => {
                let grants = listed
                    .into_iter()
                    .filter_map(|o| match o {
                        Object::Grant(key, entry) => Some((key, entry)),
                        _ => None,
                    })
                    .collect();
                self.index.replace_grants(namespace, grants);
            }
        }
    }

    fn apply(&mut self, object: Object) {
        match object {
            Object::Service(key, mapped) => self.index.apply_mapped_service(key, mapped),
            Object::Slice(key, mapped) => self.index.apply_mapped_slice(key, mapped),
            Object::Route(key, entry) => self.index.apply_route(key, entry),
            Object::Grant(key, entry) => self.index.apply_grant(key, entry),
        }
    }

    fn delete(&mut self, object: Object) {
        match object {
            Object::Service(key, _) => self.index.delete_service(key),
            Object::Slice(key, _) => self.index.delete_slice(key),
            Object::Route(key, _) => self.index.delete_route(key),
            Object::Grant(key, _) => self.index.delete_grant(key),
        }
    }

    /// Why the view may be out of date: the first failing watch's error, if any.
    fn failing(&self) -> Option<String> {
        self.failing.iter().flatten().next().cloned()
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

/// Whether the API server answered 404: the resource (a CRD) is not installed.
fn is_not_found(err: &watcher::Error) -> bool {
    match err {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => status.code == 404,
        watcher::Error::WatchError(status) => status.code == 404,
        _ => false,
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
mod route_tests;
#[cfg(test)]
mod tests;
