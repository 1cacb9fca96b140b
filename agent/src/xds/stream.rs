//! What the per-stream ADS state machines share: the [`Ads`] trait the server drives them
//! through, the per-type bookkeeping both flavours keep ([`TypeState`]), and the order in which a
//! push may send what it found ([`Types::plan`]). The machines themselves are in
//! [`super::sotw`] and [`super::delta`]; neither does I/O: requests and snapshots in, responses
//! out.
//!
//! Rules they keep (from the xDS protocol):
//! - versions and nonces per type; an ACK (matching nonce, no error) makes what the response
//!   carried held, a NACK (matching nonce, error detail) leaves the client with what it held
//!   and the refused versions are not sent again until they change; a stale nonce is ignored
//!   (SotW) or only its subscription changes are taken (Delta, where requests are incremental);
//! - at most one un-ACKed response per type; a newer snapshot waits for the ACK;
//! - make before break: types go out SDS → CDS → EDS → LDS → RDS, and a listener or route
//!   configuration change waits while a cluster new to the client lacks its endpoints (Envoy
//!   warms a new cluster until they come; a route to it meanwhile finds no cluster), once the
//!   client holds listeners or routes (in its first sync nothing flows through them yet). A
//!   removal waits until what may refer to the removed resource is acknowledged without it:
//!   a cluster until the listeners and route configurations are in sync, an assignment until
//!   the clusters are, a route configuration until the listeners are, a secret until the
//!   clusters and listeners are;
//! - after a cluster changes, its endpoints are sent again right behind it, because Envoy
//!   re-creates the cluster, waits for them, and acknowledges the clusters only once it has
//!   them;
//! - SotW: clusters and listeners go out whole (the protocol requires it: what a response
//!   leaves out is removed), endpoints and routes only where they changed (the protocol allows
//!   it: Envoy updates only the watched resources a response names), so an endpoint change
//!   costs one assignment per stream, not the whole mesh;
//! - the first request of each type is always answered, even with nothing, so Envoy's
//!   initialisation never waits on us.
//!
//! Both flavours keep, per type, exactly what the client holds (its acknowledged responses,
//! [`ClientView`]) apart from what is in flight, and look on each push only at what differs
//! between the last snapshot they reconciled and the current one: a push costs the change, not
//! the mesh. Names are the snapshot's shared `Arc<str>`s, so a stream's memory is a few words
//! per resource it holds; names no snapshot has are bounded ([`UnknownNames`]), and so is the
//! count of names per type ([`Limits`]).

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::Node;
use imbl::ordmap::DiffItem;

use super::held::ClientView;
use super::inbound::RequestDecoder;
use super::interest::{Interest, UNKNOWN_NAME_BYTES, UnknownNames};
use super::snapshot::{
    NameIndex, NameMap, NameSet, ResourceMap, ResourceType, TYPES, Whole, XdsResource, XdsSnapshot,
};

/// The two ADS flavours, as the server drives them: one value per stream, fed the proxy's
/// requests and every new snapshot, answering with what to send.
pub trait Ads: Default + Send + 'static {
    type Request: prost::Message + Default + Send + 'static;
    type Response: super::response::Framed + Send + Unpin + 'static;
    /// How the stream's requests are read off the wire (one per stream, so it may remember).
    type Decoder: RequestDecoder<Request = Self::Request>;
    /// `sotw` or `delta`, for logs and `/debug/xds`.
    const MODE: &'static str;

    /// A stream that keeps to `limits`.
    fn new(limits: Limits) -> Self;

    fn node(request: &Self::Request) -> Option<&Node>;

    /// Handles a request; returns what to send (now, or after the in-flight response of a type
    /// is ACKed) and what happened. After [`Event::Exhausted`] the stream must end.
    fn on_request(
        &mut self,
        request: &Self::Request,
        snapshot: &XdsSnapshot,
    ) -> (Vec<Push<Self::Response>>, Vec<Event>);

    /// A new snapshot: whatever changed for every requested type, in CDS → EDS → LDS → RDS
    /// order.
    fn on_snapshot(&mut self, snapshot: &XdsSnapshot) -> Vec<Push<Self::Response>>;

    /// Whether the client holds every resource of `snapshot`, acknowledged, with nothing in
    /// flight or waiting: what a DNS answer for a service new to the proxy waits for.
    fn holds(&self, snapshot: &XdsSnapshot) -> bool;
}

/// What one stream may make the agent keep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The most names a stream may subscribe to per type (and, in Delta, say it holds when it
    /// reconnects).
    pub max_names: usize,
}

/// A proxy of the whole mesh names every cluster and assignment: 50k services with two ports
/// each and as many instance clusters again are 200k names per type.
pub const DEFAULT_MAX_NAMES: usize = 200_000;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_names: DEFAULT_MAX_NAMES,
        }
    }
}

/// A response to send, and the type it carries.
#[derive(Debug, Clone)]
pub struct Push<R> {
    pub kind: ResourceType,
    pub response: R,
}

/// What a stream reports for logs, metrics and `/debug/xds`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Ack {
        kind: ResourceType,
        version: String,
    },
    Nack {
        kind: ResourceType,
        version: String,
        error: String,
    },
    StaleNonce {
        kind: ResourceType,
        nonce: String,
    },
    UnknownType {
        type_url: String,
    },
    /// The client named more than [`Limits`] allow: the stream must end (RESOURCE_EXHAUSTED).
    Exhausted {
        kind: ResourceType,
        what: String,
    },
}

pub(super) fn nonce(counter: &mut u64) -> String {
    *counter += 1;
    counter.to_string()
}

/// The most resource bytes a response that may be split carries (every Delta response; SotW
/// endpoints and routes, sent by change): the rest follows after the ACK. This paces a large
/// first sync and bounds the memory in flight; 1 MiB measured best for SotW, whose ACKs repeat
/// the whole subscription, and costs Delta no memory since the streams of a sync share their
/// large responses' bytes (docs/benchmarks.md, "The initial sync on two cores").
pub(super) const RESPONSE_BUDGET: usize = 1 << 20;

/// How one type of the snapshot differs from what the client holds: what a push must say.
#[derive(Debug, Default)]
pub(super) struct TypeDiff {
    /// Wanted, and not at the version the client holds (nor refused at it); sorted by name.
    pub(super) changed: Vec<Arc<XdsResource>>,
    /// Held by the client, but gone from the snapshot or no longer wanted.
    pub(super) removed: Vec<Arc<str>>,
    /// Subscribed by name, but not in the snapshot (and not held).
    pub(super) absent: Vec<Arc<str>>,
    /// Removals that must wait (make before break, see [`Types::plan`]); the client keeps them.
    pub(super) deferred: Vec<Arc<str>>,
}

impl TypeDiff {
    /// Nothing to send.
    pub(super) fn is_empty(&self) -> bool {
        self.changed.is_empty() && self.removed.is_empty() && self.absent.is_empty()
    }
}

/// A response sent and not yet acknowledged: what the client holds once it applies it.
#[derive(Debug)]
pub(super) struct Delivery {
    pub(super) nonce: String,
    /// The resources it carries, in name order, unless `whole` is the very map it carries:
    /// then empty, and [`Delivery::carried`] reads the map. A list of a whole type would be
    /// 80 KB a stream at 10k clusters, kept until the client ACKs (a client that does not read
    /// never does).
    pub(super) listed: Vec<Arc<XdsResource>>,
    /// The names it removes.
    pub(super) removed: Vec<Arc<str>>,
    /// When the client holds exactly a snapshot map once it applies this (a SotW response of a
    /// whole type): that map and its [`Whole`].
    pub(super) whole: Option<(ResourceMap, Whole)>,
    /// The interest's narrowings when it was sent: while they stand, every resource in it is
    /// still wanted.
    pub(super) narrowings: u64,
    /// Reported on its ACK or NACK.
    pub(super) version: String,
}

impl Delivery {
    /// The resources it carries, in name order.
    pub(super) fn carried(&self) -> impl Iterator<Item = &Arc<XdsResource>> {
        let whole = self.whole.iter().flat_map(|(map, _)| map.values());
        self.listed.iter().chain(whole)
    }
}

/// Per type, the state both flavours keep for one stream.
#[derive(Debug, Default)]
pub(super) struct TypeState {
    /// Has the client asked for this type on this stream.
    pub(super) requested: bool,
    pub(super) interest: Interest,
    /// What the client holds: its acknowledged responses.
    pub(super) client: ClientView,
    /// The response sent and not yet ACKed or NACKed.
    pub(super) in_flight: Option<Delivery>,
    /// Versions the client refused (NACKed), by name: not sent again until they change.
    pub(super) rejected: NameMap<u64>,
    /// The resources this type was last compared against; the next push looks only at what
    /// differs from them, plus `dirty`. `None` means look at everything.
    pub(super) baseline: Option<ResourceMap>,
    /// Names to look at on the next push whatever the snapshot says (new subscriptions,
    /// endpoints to re-send, removals that waited).
    pub(super) dirty: BTreeSet<Arc<str>>,
    /// Resources found to send that did not fit in the last response (see [`Self::limit`]),
    /// in name order. They stay valid until the snapshot changes them or the client's interest
    /// does, so the next response takes from here without looking at them again: a first sync
    /// of N resources in N/k responses costs O(N), not O(N²/k).
    pub(super) backlog: VecDeque<Arc<XdsResource>>,
    /// The interest's narrowings when every backlog resource was last known wanted.
    backlog_narrowings: u64,
    /// Answer on the next push even with nothing new.
    pub(super) must_answer: bool,
    /// Names of this type the client named that no snapshot had.
    pub(super) unknown: UnknownNames,
    /// A whole set of this type (SotW clusters, listeners) the client refused: a refusal of
    /// the set, so another set is answered whole again, even where its versions are the
    /// refused ones (the agent may not know what a reconnected client holds of them).
    refused_whole: Option<ResourceMap>,
}

fn diff_name<'a, V>(item: DiffItem<'a, 'a, Arc<str>, V>) -> Arc<str> {
    match item {
        DiffItem::Add(name, _) | DiffItem::Remove(name, _) => name.clone(),
        DiffItem::Update { new: (name, _), .. } => name.clone(),
    }
}

impl TypeState {
    /// How `current` differs from what the client holds and wants; `index` is the snapshot's
    /// name index of the type when it has been built (see [`TypeState::walk`]).
    pub(super) fn diff(
        &mut self,
        current: &ResourceMap,
        index: Option<&Arc<NameIndex>>,
    ) -> TypeDiff {
        let mut found = TypeDiff::default();
        if self
            .refused_whole
            .as_ref()
            .is_some_and(|r| !r.ptr_eq(current))
        {
            // Refusals were of that set: all of this one is looked at afresh.
            self.refused_whole = None;
            self.rejected.clear();
            self.baseline = None;
        }
        let dirty = std::mem::take(&mut self.dirty);
        match self.baseline.replace(current.clone()) {
            // The very same map, nothing to re-check: an ACK, or a snapshot that changed
            // only other types, costs nothing.
            Some(baseline) if baseline.ptr_eq(current) && dirty.is_empty() => {}
            Some(baseline) => {
                let mut names = dirty;
                names.extend(baseline.diff(current).map(diff_name));
                // What is looked at again is decided again, backlog or not.
                if !self.backlog.is_empty() && !names.is_empty() {
                    self.backlog.retain(|r| !names.contains(&r.name));
                }
                for name in &names {
                    self.classify(current, name, &mut found);
                }
            }
            None if !self.interest.wildcard
                && (self.interest.names.len() + self.client.len()) * 4 < current.len() =>
            {
                // Everything this client names or holds, a small part of the snapshot.
                self.clear_backlog();
                let mut names: NameSet = self.client.names().cloned().collect();
                names.extend(self.interest.names.iter().cloned());
                for name in &names {
                    self.classify(current, name, &mut found);
                }
                found.removed.sort();
                found.absent.sort();
            }
            None => {
                self.walk(current, index, &mut found);
                return found;
            }
        }
        found.changed.sort_by(|a, b| a.name.cmp(&b.name));
        found
    }

    /// Everything, most of the snapshot: one walk over it in name order (no lookup into it per
    /// name, and `changed` comes out sorted), then what the client holds or named that it
    /// lacks.
    fn walk(
        &mut self,
        current: &ResourceMap,
        index: Option<&Arc<NameIndex>>,
        found: &mut TypeDiff,
    ) {
        self.clear_backlog();
        // A client that holds exactly this map, wants exactly all of it and refused none of
        // it lacks nothing and holds nothing it should not: what a reconnecting proxy of the
        // whole mesh is once it said what it holds. Known without a look at any name (at 50k
        // services the walk below was a hash lookup or two per name, per type and stream).
        let wants_all = match index {
            _ if self.interest.wildcard && self.interest.names.is_empty() => true,
            Some(index) => self.interest.names.is_all_of(index),
            None => false,
        };
        if wants_all && self.rejected.is_empty() {
            if self.client.is_based_on(current) {
                return;
            }
            // Its mirror: one that holds nothing lacks every resource of the map, in name
            // order. The first sync of a proxy of the whole mesh, with no lookup per name (at
            // 10k services the walk below, its lookups above all, was a quarter of the agent's
            // CPU while a hundred such proxies synced).
            if self.client.len() == 0 {
                found.changed.extend(current.values().cloned());
                return;
            }
        }
        // How many of the client's names, and of the names it subscribed to, the walk met:
        // when all of them, none is missing from the snapshot, and the two lookups per name
        // below are skipped (at 10k, 20k ordered lookups per type and stream).
        let (mut held_met, mut named_met) = (0, 0);
        // A reconnected client found to hold exactly this map: its versions are the map's, no
        // lookup per name.
        let exact = self.client.is_based_on(current);
        let interest = &self.interest;
        for (name, resource) in current {
            let held = if exact {
                Some(resource.version)
            } else {
                self.client.version(name)
            };
            held_met += usize::from(held.is_some());
            if !interest.wildcard && interest.names.contains(name) {
                named_met += 1;
            }
            if interest.wants(name) {
                let refused = self.rejected.get(name) == Some(&resource.version);
                if held != Some(resource.version) && !refused {
                    found.changed.push(resource.clone());
                }
            } else if held.is_some() {
                found.removed.push(name.clone());
            }
        }
        if held_met < self.client.len() {
            for name in self.client.names() {
                if !current.contains_key(name) {
                    found.removed.push(name.clone());
                }
            }
        }
        if named_met < interest.names.len() {
            for name in interest.names.iter() {
                if !current.contains_key(name) && self.client.get(name).is_none() {
                    found.absent.push(name.clone());
                }
            }
        }
        // Refusals of versions no longer current, or of what is no longer wanted, are over.
        self.rejected.retain(|name, version| {
            interest.wants(name) && current.get(name).is_some_and(|r| r.version == *version)
        });
        found.removed.sort();
        found.absent.sort();
    }

    /// Puts one name where it belongs in `found`, if anywhere.
    fn classify(&mut self, current: &ResourceMap, name: &Arc<str>, found: &mut TypeDiff) {
        let held = self.client.version(name);
        match current.get(name) {
            Some(resource) if self.interest.wants(name) => {
                match self.rejected.get(name) {
                    Some(&refused) if refused == resource.version => return,
                    Some(_) => {
                        self.rejected.remove(name);
                    }
                    None => {}
                }
                if held != Some(resource.version) {
                    found.changed.push(resource.clone());
                }
            }
            resource => {
                self.rejected.remove(name);
                if held.is_some() {
                    found.removed.push(name.clone());
                } else if resource.is_none() && self.interest.names.contains(name) {
                    found.absent.push(name.clone());
                }
            }
        }
    }

    /// Keeps in `changed` the first resources up to [`RESPONSE_BUDGET`] bytes (at least one)
    /// and leaves the rest in the backlog for the next push, after this response's ACK; with
    /// room to spare, tops `changed` up from the backlog.
    pub(super) fn limit(&mut self, changed: &mut Vec<Arc<XdsResource>>) {
        if self.backlog_narrowings != self.interest.narrowings() {
            // Some may have been unsubscribed since they were found.
            let interest = &self.interest;
            self.backlog.retain(|r| interest.wants(&r.name));
            self.backlog_narrowings = interest.narrowings();
        }
        let mut bytes = 0;
        let over = changed.iter().position(|r| {
            bytes += r.body.value.len();
            bytes > RESPONSE_BUDGET
        });
        if let Some(at) = over {
            let keep = at.max(1);
            self.backlog.reserve(changed.len() - keep);
            for resource in changed.drain(keep..).rev() {
                self.backlog.push_front(resource);
            }
            // The response keeps only the room for what it carries: the list of a whole
            // type's walk (128 KiB at 10k resources) would otherwise stay with it until h2
            // sent it, for as long as a client that does not read likes.
            changed.shrink_to_fit();
            return;
        }
        while let Some(next) = self.backlog.front() {
            if !changed.is_empty() && bytes + next.body.value.len() > RESPONSE_BUDGET {
                break;
            }
            bytes += next.body.value.len();
            changed.extend(self.backlog.pop_front());
        }
        if self.backlog.is_empty() {
            self.clear_backlog();
        }
    }

    /// Empties the backlog and gives its room back: a stream keeps it for its life, and a
    /// whole-mesh backlog's is 64–128 KiB a stream.
    fn clear_backlog(&mut self) {
        self.backlog = VecDeque::new();
    }

    /// Makes the next push look at `name` whatever the snapshot says. Without a baseline the
    /// next push is a full diff of everything the client names or holds, so nothing is queued:
    /// a first request naming 10k resources does not insert them one by one.
    pub(super) fn look_again(&mut self, name: Arc<str>) {
        if self.baseline.is_some() {
            self.dirty.insert(name);
        }
    }

    /// The client dropped `name` (it unsubscribed, or stopped wanting it): it holds it no more.
    pub(super) fn forget(&mut self, name: &str) {
        self.client.remove(name);
        self.rejected.remove(name);
    }

    /// The in-flight response was acknowledged: the client holds what it carried (but what it
    /// unsubscribed from meanwhile).
    pub(super) fn accept(&mut self, current: &ResourceMap, whole: Whole) -> Option<Delivery> {
        let delivery = self.in_flight.take()?;
        match &delivery.whole {
            Some((map, held)) => {
                self.client = ClientView::whole(map, *held);
                self.refused_whole = None;
            }
            None => {
                for name in &delivery.removed {
                    self.client.remove(name);
                }
                if delivery.narrowings == self.interest.narrowings() {
                    self.client.extend(current, delivery.listed.iter());
                } else {
                    for resource in &delivery.listed {
                        if self.interest.wants(&resource.name) {
                            self.client.insert(resource.clone());
                        }
                    }
                }
            }
        }
        if !self.rejected.is_empty() {
            // Taken at the refused version after all. A resource sent at another (the one the
            // client holds, in place of the refused one in a whole type's response) leaves the
            // refusal standing.
            for resource in delivery.carried() {
                if self.rejected.get(&resource.name) == Some(&resource.version) {
                    self.rejected.remove(&resource.name);
                }
            }
        }
        self.client.compact(current, whole);
        Some(delivery)
    }

    /// The in-flight response was refused: the client holds what it held; what the response
    /// carried is not sent again until it changes, and what it removed is looked at again.
    pub(super) fn reject(&mut self) -> Option<Delivery> {
        let delivery = self.in_flight.take()?;
        for resource in delivery.carried() {
            let name = &resource.name;
            if self.interest.wants(name) && self.client.version(name) != Some(resource.version) {
                self.rejected.insert(name.clone(), resource.version);
            }
        }
        for name in &delivery.removed {
            self.look_again(name.clone());
        }
        if let Some((map, _)) = &delivery.whole {
            self.refused_whole = Some(map.clone());
            // What a whole response left out, it removed: looked at again too.
            let left_out: Vec<Arc<str>> = self
                .client
                .names()
                .filter(|name| !map.contains_key(*name))
                .cloned()
                .collect();
            for name in left_out {
                self.look_again(name);
            }
        }
        Some(delivery)
    }

    /// Nothing in flight, waiting or refused, and the client holds exactly `current`.
    pub(super) fn in_sync(&self, current: &ResourceMap, whole: Whole) -> bool {
        self.in_flight.is_none()
            && self.backlog.is_empty()
            && self.dirty.is_empty()
            && self.rejected.is_empty()
            && !self.must_answer
            && self.client.is_exactly(current, whole)
    }

    /// Nothing sent is unacknowledged and nothing found waits to be sent: what may refer to
    /// this type's resources is what the client holds, and it will hold nothing else until
    /// the snapshot changes (a version it refused is not sent again, so waiting for it would
    /// keep what it names for as long; what it names broke with the refusal anyway).
    fn settled(&self, found: Option<&TypeDiff>) -> bool {
        !self.requested
            || (self.in_flight.is_none()
                && self.backlog.is_empty()
                && !self.must_answer
                && found.is_some_and(|d| d.is_empty() && d.deferred.is_empty()))
    }

    /// Checks what the client named against `limits`, after a request: an error to end the
    /// stream with when over.
    pub(super) fn check_names(&mut self, kind: ResourceType, limits: Limits) -> Result<(), Event> {
        let named = self.interest.names.len();
        if named > limits.max_names {
            return Err(Event::Exhausted {
                kind,
                what: format!(
                    "{named} {} names subscribed, more than the {} a stream may name per type",
                    kind.short(),
                    limits.max_names
                ),
            });
        }
        if self.unknown.bytes() > UNKNOWN_NAME_BYTES && self.unknown.prune() > UNKNOWN_NAME_BYTES {
            return Err(Event::Exhausted {
                kind,
                what: format!(
                    "{} bytes of {} names no resource has, more than the {UNKNOWN_NAME_BYTES} a \
                     stream may name per type",
                    self.unknown.bytes(),
                    kind.short()
                ),
            });
        }
        Ok(())
    }
}

/// The limit on names a request may carry at once, checked before they are read into the
/// stream's state.
pub(super) fn too_many(kind: ResourceType, count: usize, limits: Limits) -> Option<Event> {
    (count > limits.max_names).then(|| Event::Exhausted {
        kind,
        what: format!(
            "a request naming {count} {} resources, more than the {} a stream may name per type",
            kind.short(),
            limits.max_names
        ),
    })
}

/// How a flavour sends what a push found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Flavour {
    Sotw,
    Delta,
}

impl Flavour {
    /// Whether responses of `kind` may be split (see [`RESPONSE_BUDGET`]).
    fn splits(self, kind: ResourceType) -> bool {
        self == Flavour::Delta || !kind.is_state_of_the_world()
    }

    /// Whether responses of `kind` can remove: SotW ones only by leaving a resource out of a
    /// whole type (the rest go with the cluster or listener that named them).
    fn removes(self, kind: ResourceType) -> bool {
        self == Flavour::Delta || kind.is_state_of_the_world()
    }
}

/// The per-type states of one stream, and what they share.
#[derive(Debug, Default)]
pub(super) struct Types {
    pub(super) types: [TypeState; TYPES],
    /// Clusters new to the client (sent, acknowledged or not) whose endpoints it does not hold
    /// yet: Envoy warms such a cluster until they come, and a listener or route that names it
    /// meanwhile sends its traffic nowhere, so listener and route changes wait for them.
    warming: NameSet,
    /// The assignments `warming` was last brought up to date with; `None` until it is
    /// followed (the client's first request for listeners or routes). Each push looks only at
    /// the assignments that changed since: a push costs the change, not the mesh.
    warming_checked: Option<ResourceMap>,
    /// Warming clusters to look at again on the next push: clusters the client acknowledged,
    /// kept warming while on their way whatever the snapshot said.
    warming_recheck: Vec<Arc<str>>,
    /// The endpoint interest's narrowings when `warming` was last pruned of clusters whose
    /// endpoints the client does not ask for.
    warming_narrowings: Option<u64>,
    /// Clusters the client acknowledged since its last endpoint request: whether it asks for
    /// their endpoints, that request will say (Envoy sends it after the ACK).
    acked_since_endpoints: NameSet,
    /// The client said it held resources when it opened the stream (a reconnect): it may hold
    /// listeners it has not asked for on this stream yet (its request is on its way), so
    /// removals wait for its listeners to be asked for and settled.
    pub(super) reconnected: bool,
    /// A SotW client reconnected holding clusters other than the snapshot's, and which is not
    /// known (its version is a digest): every cluster of the next response may be re-created.
    pub(super) clusters_unknown: bool,
    /// Clusters re-created by the client (their cluster response taken) before it asked for
    /// endpoints on this stream.
    recreated: NameSet,
    /// What the client holds of the endpoints of the clusters the cluster response in flight
    /// re-creates, forgotten when it was sent: held still if the client refuses it.
    recreating: Recreating,
    pub(super) nonces: u64,
    pub(super) limits: Limits,
}

/// The endpoints a refused cluster response leaves with the client (see
/// [`Types::resend_endpoints_of`]).
#[derive(Debug, Default)]
struct Recreating {
    /// As the machine believed the client held them when the cluster response was sent.
    held: Vec<Arc<XdsResource>>,
    /// Taken out of the endpoint response then in flight (by its nonce): it reaches the client
    /// before the clusters, so if the client takes it, these are what it holds instead.
    in_flight: Option<(String, Vec<Arc<XdsResource>>)>,
    /// The clusters it re-creates, sent before the client asked for endpoints on this stream:
    /// what it holds of their endpoints, its first endpoint request will say.
    unasked: Vec<Arc<str>>,
}

impl Recreating {
    fn clear(&mut self) {
        self.held.clear();
        self.in_flight = None;
        self.unasked.clear();
    }

    /// The client took the endpoint response `delivery`, while the cluster response is in
    /// flight.
    fn endpoints_taken(&mut self, delivery: &Delivery) {
        match self.in_flight.take() {
            Some((nonce, taken)) if nonce == delivery.nonce => {
                for resource in taken {
                    self.held.retain(|h| h.name != resource.name);
                    self.held.push(resource);
                }
            }
            // Sent after the clusters: applied after them too, whatever they did.
            other => {
                self.in_flight = other;
                self.held.retain(|h| {
                    !delivery.removed.contains(&h.name)
                        && !delivery.carried().any(|r| r.name == h.name)
                });
            }
        }
    }

    /// The client refused the endpoint response `delivery`.
    fn endpoints_refused(&mut self, delivery: &Delivery) {
        if self
            .in_flight
            .as_ref()
            .is_some_and(|(nonce, _)| *nonce == delivery.nonce)
        {
            self.in_flight = None;
        }
    }
}

impl Types {
    pub(super) fn new(limits: Limits) -> Types {
        Types {
            limits,
            ..Types::default()
        }
    }

    pub(super) fn of(&mut self, kind: ResourceType) -> &mut TypeState {
        &mut self.types[kind.index()]
    }

    /// What a push sends of each requested type not in flight, found and ordered so that
    /// nothing the client holds refers to what is not there (make before break, see the top):
    /// listeners and routes wait while a new cluster warms; a removal waits (`deferred`, and
    /// looked at again on the next push) until the types that may refer to what it removes
    /// are settled.
    pub(super) fn plan(
        &mut self,
        snapshot: &XdsSnapshot,
        flavour: Flavour,
    ) -> [Option<TypeDiff>; TYPES] {
        self.follow_warming(snapshot);
        self.check_warming(snapshot);
        let mut found: [Option<TypeDiff>; TYPES] = Default::default();
        for kind in ResourceType::ALL {
            let state = &mut self.types[kind.index()];
            if !state.requested || state.in_flight.is_some() {
                continue;
            }
            // Listeners and routes may name clusters the client does not have yet: they wait
            // for the clusters sent before to be acknowledged, and all of them sent, and for
            // the new ones to be warm.
            // A client that holds none of them yet (its first sync) sends no traffic through
            // them: they go at once, beside the clusters (a real Envoy asks for listeners only
            // once its clusters are warm anyway).
            let names_clusters = matches!(kind, ResourceType::Listener | ResourceType::Route)
                && (self.reconnected || state.client.len() > 0);
            let clusters = &self.types[ResourceType::Cluster.index()];
            let clusters_pending = clusters.in_flight.is_some() || !clusters.backlog.is_empty();
            if names_clusters && (clusters_pending || !self.warming.is_empty()) {
                // Left as it is: the next push finds what changed meanwhile too.
                continue;
            }
            let state = &mut self.types[kind.index()];
            let mut diff = state.diff(snapshot.of(kind), snapshot.built_name_index(kind));
            if flavour.splits(kind) {
                state.limit(&mut diff.changed);
            }
            if !flavour.removes(kind) {
                diff.removed.clear();
            }
            if flavour == Flavour::Sotw {
                diff.absent.clear();
            }
            if kind == ResourceType::Cluster && !diff.changed.is_empty() {
                // Before the listeners' and routes' turn.
                self.clusters_sent(&diff.changed, snapshot);
                // Before the endpoints' turn: this push sends them again, right behind the
                // clusters (see [`Types::resend_endpoints_of`]).
                self.clusters_recreated(&diff.changed);
            }
            found[kind.index()] = Some(diff);
        }
        let mut settled = [false; TYPES];
        for (kind, waits_on) in [
            (ResourceType::Listener, &[][..]),
            (ResourceType::Route, &[ResourceType::Listener][..]),
            (
                ResourceType::Cluster,
                &[ResourceType::Listener, ResourceType::Route][..],
            ),
            (ResourceType::Endpoint, &[ResourceType::Cluster][..]),
            (
                ResourceType::Secret,
                &[ResourceType::Cluster, ResourceType::Listener][..],
            ),
        ] {
            let i = kind.index();
            let ready = waits_on.iter().all(|k| settled[k.index()]);
            // A name told absent is removed as well, as far as the client is concerned.
            if let Some(diff) = &mut found[i]
                && !ready
                && (!diff.removed.is_empty() || !diff.absent.is_empty())
            {
                diff.deferred = std::mem::take(&mut diff.removed);
                diff.deferred.append(&mut diff.absent);
                for name in &diff.deferred {
                    self.types[i].look_again(name.clone());
                }
            }
            let unasked_listeners =
                kind == ResourceType::Listener && self.reconnected && !self.types[i].requested;
            settled[i] = !unasked_listeners && self.types[i].settled(found[i].as_ref());
        }
        found
    }

    /// See [`Ads::holds`]. Secrets are not what a DNS answer waits for (a proxy that asks
    /// for none, with mTLS off, would keep it waiting).
    pub(super) fn holds(&self, snapshot: &XdsSnapshot) -> bool {
        self.warming.is_empty()
            && ResourceType::ALL
                .into_iter()
                .filter(|kind| *kind != ResourceType::Secret)
                .all(|kind| {
                    self.types[kind.index()].in_sync(snapshot.of(kind), snapshot.whole(kind))
                })
    }

    /// The client acknowledged the in-flight response of `kind` (see [`TypeState::accept`]).
    /// With a cluster it drops the cluster's endpoints.
    pub(super) fn accept(
        &mut self,
        kind: ResourceType,
        snapshot: &XdsSnapshot,
    ) -> Option<Delivery> {
        let state = &mut self.types[kind.index()];
        let dropped: Vec<Arc<str>> = match (&state.in_flight, kind) {
            (Some(delivery), ResourceType::Cluster) => match &delivery.whole {
                Some((map, _)) => state
                    .client
                    .names()
                    .filter(|name| !map.contains_key(*name))
                    .cloned()
                    .collect(),
                None => delivery.removed.clone(),
            },
            _ => Vec::new(),
        };
        let delivery = state.accept(snapshot.of(kind), snapshot.whole(kind))?;
        match kind {
            ResourceType::Cluster => {
                // What it holds of clusters is known from now on (see `clusters_recreated`).
                self.clusters_unknown = false;
                self.recreated.extend(self.recreating.unasked.drain(..));
                self.recreating.clear();
            }
            ResourceType::Endpoint => self.recreating.endpoints_taken(&delivery),
            _ => {}
        }
        let endpoints = &mut self.types[ResourceType::Endpoint.index()];
        for name in dropped {
            // With its refusal: a cluster that comes back is new to the client.
            endpoints.forget(&name);
            self.warming.remove(&name);
            // Still subscribed (the request that drops it is on its way, or was stale and
            // ignored): looked at again, so that if the cluster comes back, so do they.
            if endpoints.interest.wants(&name) {
                endpoints.look_again(name);
            }
        }
        Some(delivery)
    }

    /// The client refused the in-flight response of `kind` (see [`TypeState::reject`]). With
    /// clusters, it re-created none of them: it holds their endpoints as it did, unless an
    /// endpoint response taken since says otherwise.
    pub(super) fn reject(&mut self, kind: ResourceType) -> Option<Delivery> {
        let delivery = self.types[kind.index()].reject()?;
        match kind {
            ResourceType::Cluster => {
                let endpoints = &mut self.types[ResourceType::Endpoint.index()];
                for held in self.recreating.held.drain(..) {
                    if endpoints.client.get(&held.name).is_none()
                        && endpoints.interest.wants(&held.name)
                    {
                        endpoints.client.insert(held);
                    }
                }
                self.recreating.clear();
            }
            ResourceType::Endpoint => self.recreating.endpoints_refused(&delivery),
            _ => {}
        }
        Some(delivery)
    }

    /// Of the clusters about to be sent, those the client holds as others: Envoy re-creates
    /// such a cluster and keeps the old one serving until the new one has its endpoints, and
    /// it acknowledges the clusters only then (or after its 15 s initial fetch timeout). So
    /// their endpoints go out again now, behind the clusters, not on the acknowledgement: on
    /// the acknowledgement a changed cluster took effect 15 s late.
    fn clusters_recreated(&mut self, sent: &[Arc<XdsResource>]) {
        // Not known what a reconnecting SotW client held: any may be re-created, by every
        // cluster response until one is accepted (a refused one re-creates nothing, and the
        // next may re-create what it held).
        let unknown = self.clusters_unknown;
        let clusters = &self.types[ResourceType::Cluster.index()];
        let recreated: Vec<Arc<str>> = sent
            .iter()
            .filter(|r| {
                unknown
                    || clusters
                        .client
                        .version(&r.name)
                        .is_some_and(|v| v != r.version)
            })
            .map(|r| r.name.clone())
            .collect();
        if !recreated.is_empty() {
            self.resend_endpoints_of(recreated);
        }
    }

    /// Endpoints of clusters the client re-creates on applying the cluster response about to
    /// be sent: it holds them no more, nor those of an endpoint response still in flight (sent
    /// before, it reaches the client first); a client that has not asked for endpoints on this
    /// stream yet is told when it does (its request, on its way, says it holds them).
    fn resend_endpoints_of(&mut self, names: Vec<Arc<str>>) {
        let endpoints = &mut self.types[ResourceType::Endpoint.index()];
        if !endpoints.requested {
            self.recreating.unasked.extend(names);
            return;
        }
        if let Some(delivery) = &endpoints.in_flight
            && self.recreating.in_flight.is_none()
        {
            self.recreating.in_flight = Some((delivery.nonce.clone(), Vec::new()));
        }
        for name in names {
            if let Some(held) = endpoints.client.get(&name) {
                self.recreating.held.push(held.clone());
            }
            // A version it refused for the cluster it had may suit the new one.
            endpoints.forget(&name);
            if let Some(delivery) = &mut endpoints.in_flight
                && let Some(at) = delivery.listed.iter().position(|r| r.name == name)
            {
                let resource = delivery.listed.remove(at);
                if let Some((_, taken)) = &mut self.recreating.in_flight {
                    taken.push(resource);
                }
            }
            endpoints.look_again(name);
        }
    }

    /// The first endpoint request of the stream was read: what it says the client holds of
    /// clusters re-created since (see [`Types::resend_endpoints_of`]) it holds no more.
    pub(super) fn endpoints_requested(&mut self) {
        let endpoints = &mut self.types[ResourceType::Endpoint.index()];
        for name in self.recreated.drain() {
            endpoints.client.remove(&name);
        }
        // Re-created by the cluster response still in flight: as when they were sent after
        // this request, held again if the client refuses it.
        for name in self.recreating.unasked.drain(..) {
            if let Some(held) = endpoints.client.get(&name) {
                self.recreating.held.push(held.clone());
                endpoints.client.remove(&name);
            }
        }
    }
}

mod warming;

#[cfg(test)]
mod tests;
