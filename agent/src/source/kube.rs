//! Kubernetes source: Services (core/v1) and EndpointSlices (discovery.k8s.io/v1), the
//! Gateway API's HTTPRoutes, GRPCRoutes and ReferenceGrants (gateway.networking.k8s.io/v1), and
//! the mesh's MeshAuthorizations (lattice.mlab.com/v1alpha1), through the kube-rs runtime
//! `watcher`, folded into a compact index that feeds the mesh state.
//!
//! The Gateway API kinds and MeshAuthorization are optional: on a cluster without their CRDs the API server answers
//! 404, which counts as an empty, complete list (so the agent gets ready), is logged once, and
//! keeps being retried with backoff, so CRDs installed later are picked up.
//!
//! Nothing is published until every watch has finished its initial list, so a snapshot never
//! holds Services without their endpoints. After that each batch of API events recomputes
//! only the Services it touches and publishes one new snapshot. Re-lists (after a 410, or a
//! restart of the API server) replace the re-listed scope at once: nothing lost, nothing kept
//! that vanished. Watch failures are retried by the watcher with client-go's backoff.
//!
//! An API server restored from a backup hands out resourceVersions below those the watches
//! resume from. Restored with etcd's `--bump-revision --mark-compacted`, every watch gets 410
//! and re-lists. Without it, a watch cache serves a watch from a version it has not reached
//! by sending nothing until it does, and the changes the restore made are never sent: the
//! source compares the server's current version (a consistent list of one object, every
//! `--kube-rollback-check`) and every change's version with the highest seen, and on a step
//! back lists every resource again and publishes what they give, at once.

mod authorizations;
pub mod ca;
mod index;
mod mapping;
pub mod meshed;
pub mod node;
mod objects;
mod ownership;
pub mod pods;
mod routes;
mod watches;

use std::time::Instant;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Service;
use kube::Api;
use kube::runtime::watcher;
use lattice_contract::TrapCidrs;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::mesh::provider::Report as _;
use crate::mesh::{AddressError, MeshSnapshot, PathError, ProviderTx};

pub use authorizations::MeshAuthorization;
pub use index::{MeshIndex, Ownership};
pub use mapping::port_protocol;
pub use objects::{HOST_HEADER_ANNOTATION, PATH_ANNOTATION, SERVICE_NAME_LABEL};
pub use ownership::{PathClaims, PathGrants};

use routes::RouteKind;
use watches::{Change, Object, Resource, WatchEvent, WatchScope, Watches, api};

pub struct KubeSourceConfig {
    /// Namespaces to watch; empty means the whole cluster.
    pub namespaces: Vec<String>,
    pub trap: TrapCidrs,
    /// Who may claim which mesh path.
    pub path_claims: PathClaims,
    /// The ConfigMap that grants namespaces path prefixes (`namespace`, `name`), read with
    /// `PathClaims::Granted`.
    pub path_grants: (String, String),
    /// How often the API server's current resourceVersion is compared with the highest the
    /// watches have seen ([`probe_revisions`]); `None`: never.
    pub rollback_check: Option<std::time::Duration>,
    /// The trust domain, when the agent serves workload certificates: then the meshed pods
    /// are watched too ([`meshed`]), and a Service all of whose endpoints are meshed pods is
    /// called over mesh mTLS.
    pub trust_domain: Option<String>,
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
        objects::HOST_HEADER_ANNOTATION
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
    info!(
        namespaces = ?config.namespaces,
        "watching Kubernetes services, endpointslices, httproutes, grpcroutes, \
         referencegrants and meshauthorizations{}",
        if config.namespaces.is_empty() { " cluster-wide" } else { "" }
    );
    let grants = (config.path_claims == PathClaims::Granted).then_some(&config.path_grants);
    let trust_domain = config.trust_domain.as_deref();
    let watches = Watches::new(&client, &namespaces, grants, trust_domain.is_some());
    let ownership = Ownership {
        claims: config.path_claims,
        grants: PathGrants::default(),
        grants_from: format!("{}/{}", config.path_grants.0, config.path_grants.1),
    };
    let mut set = WatchSet::new(config.trap, ownership, watches.scopes);
    if let Some(trust_domain) = trust_domain {
        set = set.with_meshed_pods(trust_domain);
    }
    let mut streams = watches.streams;
    let (probe, mut revisions) = match config.rollback_check {
        Some(every) => {
            let (task, revisions) = probe_revisions(&client, &namespaces[0], every);
            (Some(task), Some(revisions))
        }
        None => (None, None),
    };
    let result = loop {
        let events = futures::stream::select_all(std::mem::take(&mut streams));
        match follow(events, &mut set, &tx, &shutdown, &mut revisions).await {
            Ok(Followed::Shutdown) => break Ok(()),
            // Every watch starts over, from a list: a watcher only re-lists by itself on 410.
            Ok(Followed::Relist) => {
                streams = Watches::new(&client, &namespaces, grants, trust_domain.is_some()).streams
            }
            Err(error) => break Err(error),
        }
    };
    if let Some(probe) = probe {
        probe.abort();
    }
    result
}

/// Reads the API server's current resourceVersion every `every`: the list of at most one
/// Service, read consistently (from etcd's quorum, or a watch cache that waited to be as
/// fresh), whose version no object's seen before can exceed on a healthy server.
fn probe_revisions(
    client: &kube::Client,
    namespace: &Option<String>,
    every: std::time::Duration,
) -> (
    tokio::task::JoinHandle<()>,
    tokio::sync::mpsc::Receiver<u64>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let services: Api<Service> = api(client, namespace);
    let task = tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            match services
                .list_metadata(&kube::api::ListParams::default().limit(1))
                .await
            {
                Ok(list) => {
                    let current = list.metadata.resource_version.and_then(|v| v.parse().ok());
                    if let Some(current) = current
                        && tx.send(current).await.is_err()
                    {
                        return;
                    }
                }
                // A failing API server is the watches' to report.
                Err(error) => tracing::debug!(%error, "resourceVersion probe failed"),
            }
        }
    });
    (task, rx)
}

/// The next version the probe read; never, without a probe.
async fn next_revision(revisions: &mut Option<tokio::sync::mpsc::Receiver<u64>>) -> u64 {
    match revisions {
        Some(rx) => match rx.recv().await {
            Some(version) => version,
            None => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}

/// Why [`follow`] returned.
#[derive(Debug, PartialEq, Eq)]
enum Followed {
    Shutdown,
    /// The API server went back in time: every watch must list again.
    Relist,
}

/// Applies events as they come, a ready batch at a time, and publishes after each batch.
async fn follow(
    events: impl Stream<Item = WatchEvent> + Unpin,
    watches: &mut WatchSet,
    tx: &ProviderTx,
    shutdown: &CancellationToken,
    revisions: &mut Option<tokio::sync::mpsc::Receiver<u64>>,
) -> Result<Followed, KubeSourceError> {
    let mut batches = events.ready_chunks(1024);
    loop {
        let batch = tokio::select! {
            () = shutdown.cancelled() => return Ok(Followed::Shutdown),
            current = next_revision(revisions) => {
                watches.observe_revision(current);
                None
            }
            batch = batches.next() => match batch {
                Some(batch) => Some(batch),
                None => return Err(KubeSourceError::WatchEnded),
            },
        };
        for (watch, result) in batch.into_iter().flatten() {
            watches.handle(watch, result);
        }
        if let Some(reason) = watches.take_rollback() {
            warn!("{reason}; listing every resource again");
            watches.relist_all(reason);
            tx.stale(watches.failing().unwrap_or_default());
            return Ok(Followed::Relist);
        }
        // A snapshot of many changed Services (a first list's: every one) builds their specs
        // on every core, off the runtime.
        let snapshot = if watches.publishes_many() {
            crate::parallel::off_the_runtime(|| watches.publishable())
        } else {
            watches.publishable()
        };
        if let Some(snapshot) = snapshot {
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
    /// Per watch: the highest resourceVersion of the objects it delivered since its list
    /// began (0: none yet). A change must come after all of them.
    versions: Vec<u64>,
    /// A sign that the API server went back in time, not yet acted on.
    rollback: Option<String>,
    /// Why every watch is listing again, until all have: nothing is published meanwhile, so
    /// the view moves from the old state to the restored one at once.
    relisting: Option<String>,
    started: Instant,
    ready: bool,
}

impl WatchSet {
    fn new(trap: TrapCidrs, ownership: Ownership, scopes: Vec<WatchScope>) -> Self {
        let n = scopes.len();
        WatchSet {
            index: MeshIndex::new(trap, ownership),
            scopes,
            pending: (0..n).map(|_| None).collect(),
            listed: vec![false; n],
            missing: vec![false; n],
            failing: vec![None; n],
            versions: vec![0; n],
            rollback: None,
            relisting: None,
            started: Instant::now(),
            ready: false,
        }
    }

    /// Follows the meshed pods too, their identities in `trust_domain`.
    fn with_meshed_pods(mut self, trust_domain: &str) -> Self {
        self.index = self.index.with_meshed_pods(trust_domain);
        self
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
        // Rules once read are not dropped on a 404: an API server that has just restarted
        // answers so for custom resources for a moment, and every Service would open. They
        // stand, reported stale, until the resource lists again.
        let rules_kept = scope.resource == Resource::MeshAuthorizations
            && self.listed[watch]
            && !self.missing[watch];
        match result {
            Err(err) if scope.resource.is_optional() && is_not_found(&err) && !rules_kept => {
                self.absent(watch, &scope)
            }
            Err(err)
                if scope.resource == Resource::PathGrants && status_code(&err) == Some(403) =>
            {
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
            Ok(Change::Init) => {
                self.pending[watch] = Some(Vec::new());
                self.versions[watch] = 0;
            }
            Ok(Change::InitApply(object, version)) => {
                self.versions[watch] = self.versions[watch].max(version.unwrap_or(0));
                if let Some(pending) = &mut self.pending[watch] {
                    pending.push(object);
                }
            }
            Ok(Change::InitDone) => {
                let listed = self.pending[watch].take().unwrap_or_default();
                if self.missing[watch] {
                    info!(
                        resource = scope.resource.as_str(),
                        "resource found; its objects are read from now on"
                    );
                    self.missing[watch] = false;
                }
                self.replace(&scope, listed);
                self.listed[watch] = true;
            }
            Ok(Change::Apply(object, version)) => {
                self.check_order(watch, &scope, version);
                self.apply(object)
            }
            Ok(Change::Delete(object, version)) => {
                self.check_order(watch, &scope, version);
                self.delete(object)
            }
        }
    }

    /// A change at `version` after the watch delivered a higher or equal one: on a healthy
    /// API server every change has a resourceVersion above all before it, so this one was
    /// restored from a backup (or is another server's).
    fn check_order(&mut self, watch: usize, scope: &WatchScope, version: Option<u64>) {
        let Some(version) = version else { return };
        let high = self.versions[watch];
        if high != 0 && version <= high && self.rollback.is_none() {
            self.rollback = Some(format!(
                "the {} watch delivered a change at resourceVersion {version} after one at \
                 {high}: the API server went back in time (restored from a backup?)",
                scope.resource.as_str()
            ));
        }
        self.versions[watch] = high.max(version);
    }

    /// The API server's current resourceVersion, read apart from the watches: below one a
    /// watch delivered, it was restored from a backup. Its watches then deliver nothing until
    /// the restored server's versions pass the old ones (a watch cache sends only changes
    /// newer than the version a watch resumes from), and miss whatever the restore changed.
    fn observe_revision(&mut self, current: u64) {
        let high = self.versions.iter().copied().max().unwrap_or(0);
        if current < high && self.rollback.is_none() && self.relisting.is_none() {
            self.rollback = Some(format!(
                "the API server is at resourceVersion {current}, below {high} that a watch \
                 delivered: it went back in time (restored from a backup?)"
            ));
        }
    }

    fn take_rollback(&mut self) -> Option<String> {
        self.rollback.take()
    }

    /// Every watch starts over with a list; what it lists replaces what it had.
    fn relist_all(&mut self, reason: String) {
        for watch in 0..self.scopes.len() {
            self.pending[watch] = None;
            self.listed[watch] = false;
            self.versions[watch] = 0;
        }
        self.relisting = Some(format!("re-listing every resource: {reason}"));
    }

    /// An optional resource the API server does not know (its CRD is not installed): an empty,
    /// complete list, said once; the watcher keeps trying, so a CRD installed later is read.
    fn absent(&mut self, watch: usize, scope: &WatchScope) {
        if !self.missing[watch] {
            if scope.resource == Resource::PathGrants {
                warn!(
                    namespace = scope.namespace.as_deref().unwrap_or("*"),
                    "the path grants ConfigMap may not be read (403): each namespace claims \
                     paths under its own prefix only, until the agent's role grants get, list \
                     and watch on configmaps in its namespace (deploy/rbac.yaml)"
                );
            } else if scope.resource == Resource::MeshAuthorizations {
                warn!(
                    resource = scope.resource.as_str(),
                    namespace = scope.namespace.as_deref().unwrap_or("*"),
                    "MeshAuthorization not installed (404): no Service has authorization rules \
                     from Kubernetes until its CRD (deploy/crds) appears"
                );
            } else {
                warn!(
                    resource = scope.resource.as_str(),
                    namespace = scope.namespace.as_deref().unwrap_or("*"),
                    "Gateway API resource not installed (404); routing rules from it are \
                     ignored until its CRD appears"
                );
            }
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
            Resource::PathGrants => {
                let grants = listed.into_iter().find_map(|o| match o {
                    Object::PathGrants(grants) => Some(grants),
                    _ => None,
                });
                self.index.set_grants(grants.unwrap_or_default());
            }
            Resource::MeshedPods => {
                let pods = listed
                    .into_iter()
                    .filter_map(|o| match o {
                        Object::MeshedPod(key, account) => Some((key, account)),
                        _ => None,
                    })
                    .collect();
                self.index.replace_meshed_pods(namespace, pods);
            }
            Resource::MeshAuthorizations => {
                let listed = listed
                    .into_iter()
                    .filter_map(|o| match o {
                        Object::Authorization(key, entry) => Some((key, entry)),
                        _ => None,
                    })
                    .collect();
                self.index.replace_authorizations(namespace, listed);
            }
        }
    }

    fn apply(&mut self, object: Object) {
        match object {
            Object::Service(key, mapped) => self.index.apply_mapped_service(key, mapped),
            Object::Slice(key, mapped) => self.index.apply_mapped_slice(key, mapped),
            Object::Route(key, entry) => self.index.apply_route(key, entry),
            Object::Grant(key, entry) => self.index.apply_grant(key, entry),
            Object::PathGrants(grants) => self.index.set_grants(grants),
            Object::MeshedPod(key, account) => self.index.set_meshed_pod(&key, account.as_deref()),
            Object::Authorization(key, entry) => self.index.set_authorization(key, Some(entry)),
        }
    }

    fn delete(&mut self, object: Object) {
        match object {
            Object::Service(key, _) => self.index.delete_service(key),
            Object::Slice(key, _) => self.index.delete_slice(key),
            Object::Route(key, _) => self.index.delete_route(key),
            Object::Grant(key, _) => self.index.delete_grant(key),
            Object::PathGrants(_) => self.index.set_grants(PathGrants::default()),
            Object::MeshedPod(key, _) => self.index.set_meshed_pod(&key, None),
            Object::Authorization(key, _) => self.index.set_authorization(key, None),
        }
    }

    /// Why the view may be out of date: a re-list in progress, else the first failing
    /// watch's error, if any.
    fn failing(&self) -> Option<String> {
        self.relisting
            .clone()
            .or_else(|| self.failing.iter().flatten().next().cloned())
    }

    /// Whether [`WatchSet::publishable`] would take a snapshot of many changed Services.
    fn publishes_many(&self) -> bool {
        self.index.stale_count() >= crate::parallel::PARALLEL_FROM && self.listed.iter().all(|l| *l)
    }

    /// The snapshot to publish now: none before every initial list is complete, and none
    /// when nothing changed.
    fn publishable(&mut self) -> Option<std::sync::Arc<MeshSnapshot>> {
        if self.relisting.is_some() {
            if !self.listed.iter().all(|l| *l) {
                return None;
            }
            info!(
                services = self.index.service_count(),
                endpoints = self.index.endpoint_count(),
                "Kubernetes re-list complete; publishing the mesh as the API server has it"
            );
            self.relisting = None;
        }
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
    status_code(err) == Some(404)
}

/// The HTTP status the API server answered with, if it did.
pub(super) fn status_code(err: &watcher::Error) -> Option<u16> {
    match err {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => Some(status.code),
        watcher::Error::WatchError(status) => Some(status.code),
        _ => None,
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
mod index_model;
#[cfg(test)]
mod list_model;
#[cfg(test)]
mod route_tests;
#[cfg(test)]
mod tests;
