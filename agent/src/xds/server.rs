//! The ADS streams: one task per stream, driving a [`super::SotwStream`] or [`super::DeltaStream`] from
//! the proxy's requests and the published [`XdsSnapshot`]s, and recording what happened.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::Serialize;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Status};

use super::inbound::Inbound;
use super::metrics::XdsMetrics;
use super::response::SharedHeads;
use super::snapshot::{XdsRx, XdsSnapshot};
use super::stream::{Ads, Event, Limits, Push};
use super::view::View;
use crate::identity::{IdentityCheck, PodKey, PodsRx, Refusal, RefusalLog};
use crate::scope::{ScopeRegistry, ScopeWatch, ScopedPod};

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
    /// Last ACKed version per type (`cds`, `eds`, `lds`, `rds`).
    pub acked: BTreeMap<&'static str, String>,
    pub nacks: u64,
    /// The services the proxy holds when its pod's scope limits them (its pod's and their
    /// routes' backends); absent when it holds the whole mesh.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scope: Option<Vec<String>>,
    #[serde(skip)]
    connected_at: Option<Instant>,
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
    refusals: Arc<RefusalLog>,
    scopes: Option<Arc<ScopeRegistry>>,
    heads: Arc<SharedHeads>,
    limits: Limits,
}

impl XdsServer {
    pub fn new(
        snapshots: XdsRx,
        metrics: XdsMetrics,
        proxies: ProxyRegistry,
        shutdown: CancellationToken,
    ) -> Self {
        XdsServer {
            snapshots,
            metrics,
            proxies,
            shutdown,
            next_id: Arc::new(AtomicU64::new(1)),
            identity: IdentityCheck::Off,
            refusals: Arc::default(),
            scopes: None,
            heads: Arc::default(),
            limits: Limits::default(),
        }
    }

    /// What one stream may make the agent keep (names per type).
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// The encoded response heads the streams of this server share.
    pub(super) fn shared_heads(&self) -> Arc<SharedHeads> {
        self.heads.clone()
    }

    /// Gives each verified proxy whose pod is scoped only the services its pod uses.
    pub fn with_scopes(mut self, scopes: Arc<ScopeRegistry>) -> Self {
        self.scopes = Some(scopes);
        self
    }

    /// Checks every stream's identity as `identity` says (off by default).
    pub fn with_identity(mut self, identity: IdentityCheck) -> Self {
        self.identity = identity;
        self
    }

    /// Starts the task of one ADS stream; what it sends comes out of the returned stream.
    pub(super) fn open<A: Ads>(
        &self,
        request: Request<Inbound<A::Decoder>>,
    ) -> ReceiverStream<Result<A::Response, Status>> {
        let peer = request.remote_addr().map(|addr| addr.ip().to_canonical());
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let stream = StreamTask::<A> {
            id,
            state: A::new(self.limits),
            inbound,
            tx,
            snapshots: self.snapshots.clone(),
            metrics: self.metrics.clone(),
            proxies: self.proxies.clone(),
            shutdown: self.shutdown.clone(),
            node_id: String::new(),
            peer,
            pods: self.identity.subscribe(),
            identity: self.identity.clone(),
            refusals: self.refusals.clone(),
            verified: None,
            scopes: self.scopes.clone(),
            scoped: None,
        };
        tokio::spawn(stream.run());
        ReceiverStream::new(rx)
    }
}

struct StreamTask<A: Ads> {
    id: u64,
    state: A,
    inbound: Inbound<A::Decoder>,
    tx: mpsc::Sender<Result<A::Response, Status>>,
    snapshots: XdsRx,
    metrics: XdsMetrics,
    proxies: ProxyRegistry,
    shutdown: CancellationToken,
    node_id: String,
    peer: Option<IpAddr>,
    identity: IdentityCheck,
    /// Changes when this node's pods do (identity checking on).
    pods: Option<PodsRx>,
    refusals: Arc<RefusalLog>,
    /// Set once the first request passed the identity check: the pod, if checking is on.
    verified: Option<Option<PodKey>>,
    scopes: Option<Arc<ScopeRegistry>>,
    /// The pod's scope and the proxy's view, when the proxy holds only what its pod uses.
    scoped: Option<Scoped>,
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
    Closed(String),
    Refused(Refusal),
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
    async fn run(mut self) {
        self.metrics.stream_opened();
        self.proxies.insert(
            self.id,
            ProxyStatus {
                node_id: String::new(),
                mode: A::MODE,
                peer: self.peer,
                pod: None,
                connected_for_seconds: 0,
                acked: BTreeMap::new(),
                nacks: 0,
                connected_at: Some(Instant::now()),
                scope: None,
            },
        );
        match self.serve().await {
            Ended::Closed(reason) => {
                tracing::info!(stream = self.id, node = %self.node_id, mode = A::MODE, %reason, "ADS stream closed");
            }
            Ended::Refused(refusal) => self.refuse(refusal).await,
            Ended::Exhausted(what) => self.exhausted(what).await,
        }
        self.proxies.remove(self.id);
        self.metrics.stream_closed();
    }

    /// Ends the stream with a status that says what did not match; counted, and logged at a
    /// bounded rate.
    async fn refuse(&mut self, refusal: Refusal) {
        self.metrics.refused(refusal.reason());
        if let Some(suppressed) = self.refusals.admit(&refusal) {
            let peer = self.peer.map(|p| p.to_string()).unwrap_or_default();
            if refusal == Refusal::NotSynced {
                tracing::info!(stream = self.id, %peer, node = %self.node_id, "ADS stream turned away: {refusal}");
            } else {
                tracing::warn!(stream = self.id, %peer, node = %self.node_id, reason = refusal.reason(), suppressed, "ADS stream refused: {refusal}");
            }
        }
        let status = match refusal {
            // Envoy retries on UNAVAILABLE; the pods will be known shortly.
            Refusal::NotSynced => Status::unavailable(refusal.to_string()),
            _ => Status::permission_denied(refusal.to_string()),
        };
        let _ = self.tx.send(Err(status)).await;
    }

    /// Ends the stream with RESOURCE_EXHAUSTED; counted, and logged at a bounded rate.
    async fn exhausted(&mut self, what: String) {
        const REASON: &str = "too_many_names";
        self.metrics.refused(REASON);
        if let Some(suppressed) = self.refusals.admit_reason(REASON) {
            let peer = self.peer.map(|p| p.to_string()).unwrap_or_default();
            tracing::warn!(stream = self.id, %peer, node = %self.node_id, suppressed, "ADS stream refused: {what}");
        }
        let _ = self.tx.send(Err(Status::resource_exhausted(what))).await;
    }

    async fn serve(&mut self) -> Ended {
        // Hold requests until the mesh is known: answering from nothing would let Envoy start
        // on an empty config.
        let mut snapshot = loop {
            if let Some(snapshot) = self.snapshots.borrow_and_update().clone() {
                break snapshot;
            }
            tokio::select! {
                changed = self.snapshots.changed() => if changed.is_err() { return "agent shutting down".into() },
                () = self.shutdown.cancelled() => return "agent shutting down".into(),
            }
        };
        let mut view = snapshot.clone();
        loop {
            let pushes = tokio::select! {
                message = self.inbound.message() => match message {
                    Ok(Some(request)) => {
                        if self.verified.is_none() {
                            let node_id = A::node(&request).map(|n| n.id.as_str());
                            match self.identity.verify(self.peer, node_id) {
                                Ok(pod) => {
                                    let shown = pod.as_ref().map(PodKey::to_string);
                                    self.proxies.update(self.id, |p| p.pod = shown);
                                    self.scope_if_known(pod.as_ref());
                                    self.verified = Some(pod);
                                    view = self.view_of(&snapshot);
                                }
                                Err(refusal) => {
                                    self.node_id = node_id.unwrap_or_default().to_string();
                                    return Ended::Refused(refusal);
                                }
                            }
                        }
                        match self.on_request(&request, &view) {
                            Ok(pushes) => pushes,
                            Err(ended) => return ended,
                        }
                    }
                    Ok(None) => return "proxy closed the stream".into(),
                    Err(status) => return Ended::Closed(format!("stream error: {status}")),
                },
                () = pods_changed(&mut self.pods) => {
                    if let (Some(Some(pod)), Some(peer), Some(pods)) = (&self.verified, self.peer, &self.pods) {
                        let holds = pods.borrow().as_ref().is_some_and(|d| d.holds(pod, peer));
                        if !holds {
                            return Ended::Refused(Refusal::Gone { pod: pod.clone(), ip: peer });
                        }
                    }
                    Vec::new()
                },
                () = scope_changed(&mut self.scoped) => {
                    view = self.view_of(&snapshot);
                    self.state.on_snapshot(&view)
                },
                changed = self.snapshots.changed() => {
                    if changed.is_err() {
                        return "agent shutting down".into();
                    }
                    if let Some(latest) = self.snapshots.borrow_and_update().clone() {
                        snapshot = latest;
                    }
                    view = self.view_of(&snapshot);
                    self.state.on_snapshot(&view)
                },
                () = self.shutdown.cancelled() => return "agent shutting down".into(),
            };
            for push in pushes {
                if self.tx.send(Ok(push.response)).await.is_err() {
                    return "proxy went away".into();
                }
                self.metrics.pushed(push.kind, snapshot.changed_at);
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

    /// What this proxy holds of `snapshot`: all of it, or its view.
    fn view_of(&mut self, snapshot: &Arc<XdsSnapshot>) -> Arc<XdsSnapshot> {
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
            self.node_id = node.id.clone();
            let node_id = node.id.clone();
            self.proxies.update(self.id, |p| p.node_id = node_id);
            tracing::info!(stream = self.id, node = %self.node_id, mode = A::MODE, "proxy connected");
        }
        let (pushes, events) = self.state.on_request(request, snapshot);
        for event in events {
            match event {
                Event::Ack { kind, version } => {
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
                    tracing::warn!(stream = self.id, node = %self.node_id, kind = kind.short(), %version, %error, "proxy rejected config (NACK); keeping its last good version");
                }
                Event::StaleNonce { kind, nonce } => {
                    tracing::debug!(stream = self.id, node = %self.node_id, kind = kind.short(), %nonce, "ignoring stale nonce");
                }
                Event::UnknownType { type_url } => {
                    tracing::warn!(stream = self.id, node = %self.node_id, %type_url, "request for a type this server does not serve");
                }
                Event::Exhausted { what, .. } => return Err(Ended::Exhausted(what)),
            }
        }
        Ok(pushes)
    }
}
