//! The ADS streams: one task per stream, driving a [`super::SotwStream`] or [`super::DeltaStream`] from
//! the proxy's requests and the published [`XdsSnapshot`]s, and recording what happened.
//!
//! A stream is admitted when it opens, before any of it is read: its peer must pass identity
//! checking's address check, and be under the caps on streams ([`super::admission`]);
//! otherwise it ends at once with `PERMISSION_DENIED` (or `UNAVAILABLE` before the pods are
//! known) or `RESOURCE_EXHAUSTED`. Once the mesh is known, its first request must come within
//! the request timeout; its node id is checked against the pod. Each request is bounded by the
//! mesh's size ([`super::limits::RequestBound`]) and must arrive whole within the timeout. Whatever ends a stream, a guard gives
//! back what it held: its slot, its entry in the registry, its gauge.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use prometheus_client::metrics::gauge::Gauge;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use super::response::Framed;
use tonic::Status;

use super::admission::{Admission, Over, Slot};
use super::inbound::{Inbound, InboundError, RequestBudget};
use super::limits::{RequestBounds, STREAM_WINDOW, XdsLimits};
use super::metrics::XdsMetrics;
use super::response::SharedHeads;
use super::secrets;
use super::snapshot::{ResourceMap, XdsRx, XdsSnapshot};
use super::stream::{Ads, Event, Push};
use super::view::View;
use crate::identity::{
    IdentityCheck, InboundMode, InboundProbe, PodKey, PodsRx, RateLimitedLog, Refusal, shown,
};
use crate::scope::{ScopeRegistry, ScopeWatch, ScopedPod};
use crate::trust::{NodeSecrets, SecretsWatch, SpiffeId};

/// Responses a stream task queues before it waits for its client: one per type in flight and
/// a little more. What they hold is shared with the snapshots (the resources, by `Arc`); a
/// message is encoded only once h2 has room for it.
const QUEUED_RESPONSES: usize = 4;

/// One connected proxy, as `/debug/xds` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct ProxyStatus {
    pub node_id: String,
    pub mode: &'static str,
    /// Where the stream comes from.
    pub peer: Option<IpAddr>,
    /// The pod the proxy was verified to belong to (`namespace/name`), when identity checking
    /// is on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    pub connected_for_seconds: u64,
    /// Last ACKed version per type (`sds`, `cds`, `eds`, `lds`, `rds`).
    pub acked: BTreeMap<&'static str, String>,
    pub nacks: u64,
    /// The services the proxy holds when its pod's scope limits them (its pod's and their
    /// routes' backends); absent when it holds the whole mesh.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scope: Option<Vec<String>>,
    /// The workload identity whose certificate the proxy is served (SDS), when it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
    /// The mode of the inbound listener it is served, when its pod captures inbound.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inbound: Option<InboundMode>,
    /// How many authorization rules its inbound listener enforces at its pod's ports.
    #[serde(skip_serializing_if = "is_zero")]
    pub authorization_rules: usize,
    #[serde(skip)]
    connected_at: Option<Instant>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// The proxies connected right now, by stream id.
#[derive(Clone, Debug, Default)]
pub struct ProxyRegistry(Arc<Mutex<BTreeMap<u64, ProxyStatus>>>);

impl ProxyRegistry {
    pub fn list(&self) -> Vec<ProxyStatus> {
        let proxies = self.0.lock().unwrap_or_else(|poison| poison.into_inner());
        proxies
            .values()
            .map(|p| ProxyStatus {
                connected_for_seconds: p.connected_at.map(|t| t.elapsed().as_secs()).unwrap_or(0),
                ..p.clone()
            })
            .collect()
    }

    fn update(&self, id: u64, f: impl FnOnce(&mut ProxyStatus)) {
        let mut proxies = self.0.lock().unwrap_or_else(|poison| poison.into_inner());
        if let Some(status) = proxies.get_mut(&id) {
            f(status);
        }
    }

    fn insert(&self, id: u64, status: ProxyStatus) {
        let mut proxies = self.0.lock().unwrap_or_else(|poison| poison.into_inner());
        proxies.insert(id, status);
    }

    fn remove(&self, id: u64) {
        let mut proxies = self.0.lock().unwrap_or_else(|poison| poison.into_inner());
        proxies.remove(&id);
    }
}

/// The ADS service (both `StreamAggregatedResources` and `DeltaAggregatedResources`).
#[derive(Clone)]
pub struct XdsServer {
    snapshots: XdsRx,
    metrics: XdsMetrics,
    proxies: ProxyRegistry,
    shutdown: CancellationToken,
    next_id: Arc<AtomicU64>,
    identity: IdentityCheck,
    /// Refusals, NACKs and unknown types: each kind logged at most once per interval.
    log: Arc<RateLimitedLog>,
    /// Streams opening and closing: many at once are normal (every proxy of the node
    /// reconnecting), so a hundred per 10 s are logged, then the count of the rest.
    lifecycle: Arc<RateLimitedLog>,
    scopes: Option<Arc<ScopeRegistry>>,
    /// Each verified proxy's certificate and the trust bundle, served over SDS.
    secrets: Option<NodeSecrets>,
    /// The inbound listener in each mode, for proxies with secrets whose pod captures inbound.
    heads: Arc<SharedHeads>,
    limits: Arc<XdsLimits>,
    admission: Arc<Admission>,
    budget: Arc<RequestBudget>,
    bounds: Arc<RequestBounds>,
}

/// What [`XdsServer::open`] hands the response body: the responses, and the status the stream
/// ends with, set before the responses end.
pub(super) struct Opened<R> {
    pub responses: ReceiverStream<R>,
    pub ending: Arc<OnceLock<Status>>,
}

impl XdsServer {
    pub fn new(
        snapshots: XdsRx,
        metrics: XdsMetrics,
        proxies: ProxyRegistry,
        shutdown: CancellationToken,
    ) -> Self {
        let limits = XdsLimits::default();
        XdsServer {
            snapshots,
            proxies,
            shutdown,
            next_id: Arc::new(AtomicU64::new(1)),
            identity: IdentityCheck::Off,
            log: Arc::default(),
            lifecycle: Arc::new(RateLimitedLog::with_burst(100)),
            scopes: None,
            secrets: None,
            heads: Arc::default(),
            admission: Arc::new(Admission::new(limits.caps)),
            budget: RequestBudget::new(
                limits.request_buffer,
                STREAM_WINDOW as usize,
                Some(metrics.clone()),
            ),
            bounds: Arc::new(RequestBounds::new(limits.request)),
            limits: Arc::new(limits),
            metrics,
        }
    }

    /// Keeps `limits` instead of the defaults.
    pub fn with_limits(mut self, limits: XdsLimits) -> Self {
        self.admission = Arc::new(Admission::new(limits.caps));
        self.budget = RequestBudget::new(
            limits.request_buffer,
            STREAM_WINDOW as usize,
            Some(self.metrics.clone()),
        );
        self.bounds = Arc::new(RequestBounds::new(limits.request));
        self.limits = Arc::new(limits);
        self
    }

    /// The encoded response heads the streams of this server share.
    pub(super) fn shared_heads(&self) -> Arc<SharedHeads> {
        self.heads.clone()
    }

    pub(super) fn limits(&self) -> &XdsLimits {
        &self.limits
    }

    pub(super) fn admission(&self) -> &Admission {
        &self.admission
    }

    pub(super) fn metrics(&self) -> &XdsMetrics {
        &self.metrics
    }

    /// The gauge of response bytes not yet written, for the response bodies.
    pub(super) fn response_bytes(&self) -> Gauge {
        self.metrics.response_bytes()
    }

    /// Gives each verified proxy whose pod is scoped only the services its pod uses.
    pub fn with_scopes(mut self, scopes: Arc<ScopeRegistry>) -> Self {
        self.scopes = Some(scopes);
        self
    }

    /// Serves each proxy verified as a pod of this node its workload certificate, for its pod's
    /// service account, and the trust bundle over SDS (with identity checking on; no stream
    /// gets a secret otherwise).
    pub fn with_secrets(mut self, secrets: NodeSecrets) -> Self {
        self.secrets = Some(secrets);
        self
    }

    /// Checks every stream's identity as `identity` says (off by default).
    pub fn with_identity(mut self, identity: IdentityCheck) -> Self {
        self.identity = identity;
        self
    }

    /// A connection from `peer` was over the cap `over` names: counted, logged at a bounded
    /// rate.
    pub(super) fn refused_connection(&self, peer: SocketAddr, over: &Over) {
        self.metrics.connection_refused(over.reason());
        if let Some(suppressed) = self.log.admit_kind(over.reason()) {
            tracing::warn!(%peer, reason = over.reason(), suppressed, "xDS connection refused: {over}");
        }
    }

    /// Starts the task of one ADS stream from `peer`, or says at once why not: identity
    /// checking refuses the peer's address, or a cap on streams is reached. Nothing of the
    /// stream has been read either way.
    pub(super) fn open<A: Ads>(
        &self,
        peer: Option<SocketAddr>,
        inbound: Inbound<A::Decoder>,
    ) -> Result<Opened<A::Response>, Status> {
        let peer = peer.map(|addr| addr.ip().to_canonical());
        if let Err(refusal) = self.identity.check_peer(peer) {
            self.log_refusal(&refusal, peer, "");
            return Err(refusal_status(&refusal));
        }
        // Identity off, a peer with no address is served as any other (the caps count it
        // under the unspecified address).
        let slot = match self
            .admission
            .stream(peer.unwrap_or(IpAddr::from([0, 0, 0, 0])))
        {
            Ok(slot) => slot,
            Err(over) => {
                self.metrics.refused(over.reason());
                if let Some(suppressed) = self.log.admit_kind(over.reason()) {
                    let peer = peer.map(|p| p.to_string()).unwrap_or_default();
                    tracing::warn!(%peer, reason = over.reason(), suppressed, "ADS stream refused: {over}");
                }
                return Err(Status::resource_exhausted(over.to_string()));
            }
        };
        let (tx, rx) = mpsc::channel(QUEUED_RESPONSES);
        let ending = Arc::new(OnceLock::new());
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let guard = StreamGuard::new(id, A::MODE, peer, slot, &self.proxies, &self.metrics);
        let stream = StreamTask::<A> {
            id,
            state: A::new(self.limits.names),
            inbound: inbound
                .with_budget(self.budget.clone())
                .with_timeout(self.limits.request_timeout),
            tx,
            ending: ending.clone(),
            snapshots: self.snapshots.clone(),
            metrics: self.metrics.clone(),
            proxies: self.proxies.clone(),
            shutdown: self.shutdown.clone(),
            node_id: String::new(),
            peer,
            pods: self.identity.subscribe(),
            identity: self.identity.clone(),
            log: self.log.clone(),
            lifecycle: self.lifecycle.clone(),
            bounds: self.bounds.clone(),
            verified: None,
            scopes: self.scopes.clone(),
            scoped: None,
            node_secrets: self.secrets.clone(),
            secrets: None,
            captured: None,
            authorization_rules: 0,
        };
        tokio::spawn(stream.run(guard));
        Ok(Opened {
            responses: ReceiverStream::new(rx),
            ending,
        })
    }

    fn log_refusal(&self, refusal: &Refusal, peer: Option<IpAddr>, node_id: &str) {
        log_refusal(&self.metrics, &self.log, refusal, peer, node_id);
    }
}

/// Counts a refusal, and logs it at a bounded rate.
fn log_refusal(
    metrics: &XdsMetrics,
    log: &RateLimitedLog,
    refusal: &Refusal,
    peer: Option<IpAddr>,
    node_id: &str,
) {
    metrics.refused(refusal.reason());
    if let Some(suppressed) = log.admit(refusal) {
        let peer = peer.map(|p| p.to_string()).unwrap_or_default();
        let node = shown(node_id);
        if *refusal == Refusal::NotSynced {
            tracing::info!(%peer, %node, "ADS stream turned away: {refusal}");
        } else {
            tracing::warn!(%peer, %node, reason = refusal.reason(), suppressed, "ADS stream refused: {refusal}");
        }
    }
}

fn refusal_status(refusal: &Refusal) -> Status {
    match refusal {
        // Envoy retries on UNAVAILABLE; the pods will be known shortly.
        Refusal::NotSynced => Status::unavailable(refusal.to_string()),
        _ => Status::permission_denied(refusal.to_string()),
    }
}

/// What a stream holds while it lives, given back when it ends however it ends (a panic in
/// its task included): its place under the caps, its entry in the registry, its gauge.
struct StreamGuard {
    id: u64,
    proxies: ProxyRegistry,
    metrics: XdsMetrics,
    _slot: Slot,
}

impl StreamGuard {
    fn new(
        id: u64,
        mode: &'static str,
        peer: Option<IpAddr>,
        slot: Slot,
        proxies: &ProxyRegistry,
        metrics: &XdsMetrics,
    ) -> Self {
        metrics.stream_opened();
        proxies.insert(
            id,
            ProxyStatus {
                node_id: String::new(),
                mode,
                peer,
                pod: None,
                connected_for_seconds: 0,
                acked: BTreeMap::new(),
                nacks: 0,
                connected_at: Some(Instant::now()),
                scope: None,
                identity: None,
                inbound: None,
                authorization_rules: 0,
            },
        );
        StreamGuard {
            id,
            proxies: proxies.clone(),
            metrics: metrics.clone(),
            _slot: slot,
        }
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.proxies.remove(self.id);
        self.metrics.stream_closed();
    }
}

struct StreamTask<A: Ads> {
    id: u64,
    state: A,
    inbound: Inbound<A::Decoder>,
    tx: mpsc::Sender<A::Response>,
    /// The status the stream ends with, for the response body.
    ending: Arc<OnceLock<Status>>,
    snapshots: XdsRx,
    metrics: XdsMetrics,
    proxies: ProxyRegistry,
    shutdown: CancellationToken,
    /// As the proxy sent it, [`shown`].
    node_id: String,
    peer: Option<IpAddr>,
    identity: IdentityCheck,
    /// Changes when this node's pods do (identity checking on).
    pods: Option<PodsRx>,
    log: Arc<RateLimitedLog>,
    lifecycle: Arc<RateLimitedLog>,
    bounds: Arc<RequestBounds>,
    /// Set once the first request passed the identity check: the pod, if checking is on.
    verified: Option<Option<PodKey>>,
    scopes: Option<Arc<ScopeRegistry>>,
    /// The pod's scope and the proxy's view, when the proxy holds only what its pod uses.
    scoped: Option<Scoped>,
    node_secrets: Option<NodeSecrets>,
    /// The verified pod's identity's secrets, and their resources as its view holds them.
    secrets: Option<Held>,
    /// The verified pod's inbound mode and probes, when it captures inbound: its view then
    /// holds the inbound listener of that mode beside its secrets.
    captured: Option<(InboundMode, Vec<InboundProbe>)>,
    /// What `/debug/xds` shows of its inbound listener's rules.
    authorization_rules: usize,
}

struct Held {
    watch: SecretsWatch,
    resources: ResourceMap,
}

impl Held {
    fn new(mut watch: SecretsWatch) -> Held {
        let resources = Held::resources_of(&mut watch);
        Held { watch, resources }
    }

    fn resources_of(watch: &mut SecretsWatch) -> ResourceMap {
        watch
            .rx
            .borrow_and_update()
            .as_deref()
            .map(secrets::resources)
            .unwrap_or_default()
    }
}

/// Waits for the next change of a proxy's secrets; forever when it has none.
async fn secrets_changed(held: &mut Option<Held>) {
    match held {
        Some(held) => {
            if held.watch.rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
            held.resources = Held::resources_of(&mut held.watch);
        }
        None => std::future::pending().await,
    }
}

struct Scoped {
    watch: ScopeWatch,
    view: View,
    /// The scope generation the current view was made for.
    generation: u64,
}

/// Waits for the next change of a scope; forever when the proxy is not scoped.
async fn scope_changed(scoped: &mut Option<Scoped>) {
    match scoped {
        Some(s) => {
            if s.watch.scope.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}

/// How a stream ended.
enum Ended {
    /// By the proxy, or because it went away.
    Closed(String),
    /// Identity checking refused it.
    Refused(Refusal),
    /// Its requests could not be read, or were over a limit.
    Failed(InboundError),
    /// The agent is shutting down: the proxy should reconnect, to the next agent.
    ShuttingDown,
    /// It named more than its limits allow (what, said to the client).
    Exhausted(String),
}

impl From<&str> for Ended {
    fn from(reason: &str) -> Self {
        Ended::Closed(reason.to_string())
    }
}

/// Waits for the next change of this node's pods; forever when there is nothing to watch.
async fn pods_changed(pods: &mut Option<PodsRx>) {
    match pods {
        Some(rx) => {
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}

impl<A: Ads> StreamTask<A> {
    async fn run(mut self, guard: StreamGuard) {
        let ended = self.serve().await;
        let status = match ended {
            Ended::Closed(reason) => {
                if let Some(suppressed) = self.lifecycle.admit_kind("closed") {
                    tracing::info!(stream = self.id, node = %self.node_id, mode = A::MODE, %reason, suppressed, "ADS stream closed");
                }
                Status::ok("")
            }
            Ended::Refused(refusal) => {
                let (metrics, log) = (&self.metrics, &self.log);
                log_refusal(metrics, log, &refusal, self.peer, &self.node_id);
                refusal_status(&refusal)
            }
            Ended::Failed(error) => {
                let status = error.status();
                match error.reason() {
                    Some(reason) => self.refused(reason, &error.to_string()),
                    None => {
                        tracing::debug!(stream = self.id, node = %self.node_id, %error, "ADS stream failed")
                    }
                }
                status
            }
            Ended::Exhausted(what) => {
                self.refused("too_many_names", &what);
                Status::resource_exhausted(what)
            }
            Ended::ShuttingDown => Status::unavailable("the agent is shutting down; reconnect"),
        };
        // Before the responses end, so the body reads it once it has sent what is queued.
        let _ = self.ending.set(status);
        drop(self);
        drop(guard);
    }

    /// Counts a stream the server ended for `reason`, and logs it at a bounded rate.
    fn refused(&self, reason: &'static str, why: &str) {
        self.metrics.refused(reason);
        if let Some(suppressed) = self.log.admit_kind(reason) {
            let peer = self.peer.map(|p| p.to_string()).unwrap_or_default();
            tracing::warn!(stream = self.id, %peer, node = %self.node_id, reason, suppressed, "ADS stream ended: {why}");
        }
    }

    async fn serve(&mut self) -> Ended {
        // Hold requests until the mesh is known: answering from nothing would let Envoy start
        // on an empty config (and the mesh says how large a request may be).
        let mut snapshot = loop {
            if let Some(snapshot) = self.snapshots.borrow_and_update().clone() {
                break snapshot;
            }
            tokio::select! {
                changed = self.snapshots.changed() => if changed.is_err() { return Ended::ShuttingDown },
                () = self.shutdown.cancelled() => return Ended::ShuttingDown,
            }
        };
        self.inbound.set_limit(self.bounds.of(&snapshot));
        self.inbound.expect_message();
        let first = tokio::select! {
            message = self.inbound.message() => match message {
                Ok(Some(request)) => request,
                Ok(None) => return "proxy closed the stream before its first request".into(),
                Err(error) => return Ended::Failed(error),
            },
            () = self.shutdown.cancelled() => return Ended::ShuttingDown,
        };
        if let Some(latest) = self.snapshots.borrow_and_update().clone() {
            snapshot = latest;
            self.inbound.set_limit(self.bounds.of(&snapshot));
        }
        let node_id = A::node(&first).map(|n| n.id.as_str());
        tracing::debug!(stream = self.id, bytes = prost::Message::encoded_len(&first), node = %shown(node_id.unwrap_or_default()), "first request");
        match self.identity.verify(self.peer, node_id) {
            Ok(pod) => {
                let shown_pod = pod.as_ref().map(PodKey::to_string);
                self.proxies.update(self.id, |p| p.pod = shown_pod);
                self.scope_if_known(pod.as_ref());
                self.secrets_if_known(pod.as_ref());
                self.verified = Some(pod);
            }
            Err(refusal) => {
                self.node_id = shown(node_id.unwrap_or_default()).into_owned();
                return Ended::Refused(refusal);
            }
        }
        let mut view = self.view_of(&snapshot);
        let mut pushes = match self.on_request(&first, &view) {
            Ok(pushes) => pushes,
            Err(ended) => return ended,
        };
        loop {
            for push in pushes {
                let resources = push.response.resource_count();
                if self.tx.send(push.response).await.is_err() {
                    return "proxy went away".into();
                }
                self.metrics
                    .pushed(push.kind, resources, snapshot.changed_at);
                tracing::debug!(stream = self.id, node = %self.node_id, kind = push.kind.short(), version = snapshot.version, "pushed");
            }
            // A DNS answer may be waiting for this proxy to hold a service its pod just
            // resolved: tell it once the proxy holds the whole view.
            if let Some(scoped) = &self.scoped
                && scoped.watch.awaited(scoped.generation)
                && self.state.holds(&view)
            {
                scoped.watch.held(scoped.generation);
            }
            pushes = tokio::select! {
                message = self.inbound.message() => match message {
                    Ok(Some(request)) => match self.on_request(&request, &view) {
                        Ok(pushes) => pushes,
                        Err(ended) => return ended,
                    },
                    Ok(None) => return "proxy closed the stream".into(),
                    Err(error) => return Ended::Failed(error),
                },
                () = pods_changed(&mut self.pods) => {
                    if let (Some(Some(pod)), Some(peer), Some(pods)) = (&self.verified, self.peer, &self.pods) {
                        let holds = pods.borrow().as_ref().is_some_and(|d| d.holds(pod, peer));
                        if !holds {
                            return Ended::Refused(Refusal::Gone { pod: pod.clone(), ip: peer });
                        }
                    }
                    if self.inbound_changed() {
                        view = self.view_of(&snapshot);
                        self.state.on_snapshot(&view)
                    } else {
                        Vec::new()
                    }
                },
                () = scope_changed(&mut self.scoped) => {
                    view = self.view_of(&snapshot);
                    self.state.on_snapshot(&view)
                },
                () = secrets_changed(&mut self.secrets) => {
                    view = self.view_of(&snapshot);
                    self.state.on_snapshot(&view)
                },
                changed = self.snapshots.changed() => {
                    if changed.is_err() {
                        return Ended::ShuttingDown;
                    }
                    if let Some(latest) = self.snapshots.borrow_and_update().clone() {
                        snapshot = latest;
                        self.inbound.set_limit(self.bounds.of(&snapshot));
                    }
                    view = self.view_of(&snapshot);
                    self.state.on_snapshot(&view)
                },
                () = self.shutdown.cancelled() => return Ended::ShuttingDown,
            };
        }
    }

    /// Follows the pod's scope when the proxy was verified as a pod's and that pod is scoped
    /// (not opted out, not on the host network).
    fn scope_if_known(&mut self, pod: Option<&PodKey>) {
        let (Some(scopes), Some(peer), Some(pod), Some(pods)) =
            (&self.scopes, self.peer, pod, &self.pods)
        else {
            return;
        };
        let scoped = pods
            .borrow()
            .as_ref()
            .and_then(|d| d.entry(pod, peer).and_then(ScopedPod::of));
        if let Some(watch) = scoped.and_then(|scoped| scopes.attach(&scoped)) {
            self.scoped = Some(Scoped {
                watch,
                view: View::default(),
                generation: 0,
            });
        }
    }

    /// Follows the secrets of the pod's identity (its service account) when the proxy was
    /// verified as a pod's, not on the host network (whose address any process of the node
    /// shares), and the agent serves secrets.
    fn secrets_if_known(&mut self, pod: Option<&PodKey>) {
        let (Some(node_secrets), Some(peer), Some(pod), Some(pods)) =
            (&self.node_secrets, self.peer, pod, &self.pods)
        else {
            return;
        };
        let (account, sharing) = {
            let directory = pods.borrow();
            let Some(directory) = directory.as_ref() else {
                return;
            };
            let account = directory
                .entry(pod, peer)
                .filter(|entry| !entry.host_network)
                .map(|entry| entry.service_account.clone());
            (account, directory.at(peer).len())
        };
        let Some(account) = account else {
            return;
        };
        // Two pods at one address (one that went, whose entry is not gone yet, and the one
        // given its address): the stream may be either, so neither's key is handed out; its
        // proxy asks again once the directory is plain (its stream ends when its pod goes).
        if sharing > 1 {
            tracing::warn!(stream = self.id, %pod, %peer, pods = sharing, "several pods have this address: no workload certificate for the stream until one remains");
            return;
        }
        match SpiffeId::new(node_secrets.trust_domain(), &pod.namespace, &account) {
            Ok(identity) => {
                self.proxies
                    .update(self.id, |p| p.identity = Some(identity.to_string()));
                self.secrets = Some(Held::new(node_secrets.watch(identity)));
                self.inbound_changed();
            }
            Err(error) => {
                tracing::warn!(stream = self.id, %pod, %error, "the pod's service account makes no workload identity: no certificate for its proxy");
            }
        }
    }

    /// Follows the verified pod's inbound mode and probes (its annotations and spec may change
    /// while its proxy runs); whether they changed. Only a proxy that may be given secrets
    /// (verified as its pod) gets an inbound listener, with its leaf or before it.
    fn inbound_changed(&mut self) -> bool {
        let wanted = match (&self.secrets, self.peer, &self.pods) {
            (Some(_), Some(peer), Some(pods)) => {
                let pod = self.verified.as_ref().and_then(Option::as_ref);
                pod.and_then(|pod| {
                    let pods = pods.borrow();
                    let entry = pods.as_ref()?.entry(pod, peer)?;
                    let mode = entry.inbound?;
                    Some((mode, entry.probes.clone()))
                })
            }
            _ => None,
        };
        if wanted == self.captured {
            return false;
        }
        let mode = wanted.as_ref().map(|(mode, _)| *mode);
        self.captured = wanted;
        self.proxies.update(self.id, |p| p.inbound = mode);
        true
    }

    /// What this proxy holds of `snapshot`: all of it, or its view; with its secrets, and its
    /// inbound listener when its pod captures inbound (from before it holds its leaf: a
    /// captured pod's every connection goes to that listener).
    fn view_of(&mut self, snapshot: &Arc<XdsSnapshot>) -> Arc<XdsSnapshot> {
        let view = self.scoped_view_of(snapshot);
        let Some(held) = &self.secrets else {
            return view;
        };
        let mtls = !held.resources.is_empty();
        let listener = match (&self.captured, &snapshot.inbound, self.peer) {
            (Some((mode, probes)), Some(listeners), Some(peer)) => {
                let rules = listeners.rules(peer);
                if rules != self.authorization_rules {
                    self.authorization_rules = rules;
                    self.proxies
                        .update(self.id, |p| p.authorization_rules = rules);
                }
                Some(listeners.listener(peer, *mode, probes, mtls))
            }
            _ => None,
        };
        if !mtls && listener.is_none() {
            return view;
        }
        Arc::new(view.with_secrets(held.resources.clone(), listener.as_ref()))
    }

    fn scoped_view_of(&mut self, snapshot: &Arc<XdsSnapshot>) -> Arc<XdsSnapshot> {
        let Some(scoped) = &mut self.scoped else {
            return snapshot.clone();
        };
        let scope = scoped.watch.scope.borrow_and_update().clone();
        let pod = self.verified.as_ref().and_then(Option::as_ref);
        let view = scoped.view.update(snapshot, &scope.services, pod);
        if scoped.generation != scope.generation {
            scoped.generation = scope.generation;
            let shown = scoped.view.services().map(|s| s.to_string()).collect();
            self.proxies.update(self.id, |p| p.scope = Some(shown));
        }
        view
    }

    fn on_request(
        &mut self,
        request: &A::Request,
        snapshot: &XdsSnapshot,
    ) -> Result<Vec<Push<A::Response>>, Ended> {
        if self.node_id.is_empty()
            && let Some(node) = A::node(request)
        {
            self.node_id = shown(&node.id).into_owned();
            let node_id = self.node_id.clone();
            self.proxies.update(self.id, |p| p.node_id = node_id);
            if let Some(suppressed) = self.lifecycle.admit_kind("connected") {
                tracing::info!(stream = self.id, node = %self.node_id, mode = A::MODE, suppressed, "proxy connected");
            }
        }
        let (pushes, events) = self.state.on_request(request, snapshot);
        for event in events {
            match event {
                Event::Ack { kind, version } => {
                    let version = shown(&version).into_owned();
                    self.proxies.update(self.id, |p| {
                        p.acked.insert(kind.short(), version);
                    });
                }
                Event::Nack {
                    kind,
                    version,
                    error,
                } => {
                    self.metrics.nacked(kind);
                    self.proxies.update(self.id, |p| p.nacks += 1);
                    if let Some(suppressed) = self.log.admit_kind("nack") {
                        tracing::warn!(stream = self.id, node = %self.node_id, kind = kind.short(), version = %shown(&version), error = %shown(&error), suppressed, "proxy rejected config (NACK); keeping its last good version");
                    }
                }
                Event::StaleNonce { kind, nonce } => {
                    tracing::debug!(stream = self.id, node = %self.node_id, kind = kind.short(), nonce = %shown(&nonce), "ignoring stale nonce");
                }
                Event::UnknownType { type_url } => {
                    if let Some(suppressed) = self.log.admit_kind("unknown_type") {
                        tracing::warn!(stream = self.id, node = %self.node_id, type_url = %shown(&type_url), suppressed, "request for a type this server does not serve");
                    }
                }
                Event::Exhausted { what, .. } => return Err(Ended::Exhausted(what)),
            }
        }
        Ok(pushes)
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::registry::Registry;

    use super::*;
    use crate::xds::admission::Caps;

    fn gauge(registry: &Registry, name: &str) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        text.lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_default()
            .to_string()
    }

    #[test]
    fn a_stream_gives_back_what_it_held_even_when_its_task_panics() {
        let mut registry = Registry::default();
        let metrics = XdsMetrics::register(&mut registry);
        let proxies = ProxyRegistry::default();
        let admission = Admission::new(Caps {
            connections: 1,
            connections_per_peer: 1,
            streams: 1,
            streams_per_peer: 1,
        });
        let peer: IpAddr = "10.0.0.7".parse().unwrap();
        let slot = admission.stream(peer).unwrap();
        let guard = StreamGuard::new(1, "delta", Some(peer), slot, &proxies, &metrics);
        assert_eq!(proxies.list().len(), 1);
        assert_eq!(
            gauge(&registry, "lattice_xds_connected_proxies "),
            "lattice_xds_connected_proxies 1"
        );
        let panicked = std::thread::spawn(move || {
            let _held = guard;
            panic!("a bug in a stream's task");
        })
        .join();
        assert!(panicked.is_err());
        assert!(proxies.list().is_empty(), "its /debug/xds entry");
        assert_eq!(
            gauge(&registry, "lattice_xds_connected_proxies "),
            "lattice_xds_connected_proxies 0"
        );
        assert!(admission.stream(peer).is_ok(), "its slot");
    }
}
