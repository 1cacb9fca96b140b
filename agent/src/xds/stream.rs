//! What the per-stream ADS state machines share: the [`Ads`] trait the server drives them
//! through, and the per-type bookkeeping both flavours keep. The machines themselves are in
//! [`super::sotw`] and [`super::delta`]; neither does I/O: requests and snapshots in, responses
//! out.
//!
//! Rules they keep (from the xDS protocol):
//! - versions and nonces per type; an ACK (matching nonce, no error) advances, a NACK (matching
//!   nonce, error detail) keeps the client's last good version and is not answered with the
//!   same content again, a stale nonce is ignored (SotW) or only its subscription changes are
//!   taken (Delta, where requests are incremental);
//! - at most one un-ACKed response per type; a newer snapshot waits for the ACK;
//! - types go out in CDS → EDS → LDS → RDS order, and after a cluster changes its endpoints
//!   are sent again, because Envoy re-creates the cluster and waits for them;
//! - SotW: clusters and listeners go out whole (the protocol requires it: what a response
//!   leaves out is removed), endpoints and routes only where they changed (the protocol allows
//!   it: Envoy updates only the watched resources a response names), so an endpoint change
//!   costs one assignment per stream, not the whole mesh;
//! - the first request of each type is always answered, even with nothing, so Envoy's
//!   initialisation never waits on us.
//!
//! Both flavours keep, per type, what the client holds as far as we know, and look on each push
//! only at what differs between the last snapshot they reconciled and the current one: a push
//! costs the change, not the mesh. Names are the snapshot's shared `Arc<str>`s and versions are
//! numbers, so a stream's memory is a few words per resource it holds.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::Node;
use imbl::ordmap::DiffItem;

use super::inbound::RequestDecoder;
use super::snapshot::{
    NameIndex, ResourceMap, ResourceType, Whole, XdsResource, XdsSnapshot, entry_hash,
    format_version,
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

    fn node(request: &Self::Request) -> Option<&Node>;

    /// Handles a request; returns what to send (now, or after the in-flight response of a type
    /// is ACKed) and what happened.
    fn on_request(
        &mut self,
        request: &Self::Request,
        snapshot: &XdsSnapshot,
    ) -> (Vec<Push<Self::Response>>, Vec<Event>);

    /// A new snapshot: whatever changed for every requested type, in CDS → EDS → LDS → RDS
    /// order.
    fn on_snapshot(&mut self, snapshot: &XdsSnapshot) -> Vec<Push<Self::Response>>;

    /// Whether the client holds every resource of `snapshot`, acknowledged, with nothing in
    /// flight: what a DNS answer for a service new to the proxy waits for.
    fn holds(&self, snapshot: &XdsSnapshot) -> bool;
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
}

pub(super) fn nonce(counter: &mut u64) -> String {
    *counter += 1;
    counter.to_string()
}

/// Hash sets and maps of resource names, per stream: foldhash instead of std's SipHash, which
/// was 7 % of the agent's CPU in a 10k-service first sync (every name of a type is hashed a few
/// times per stream). Its per-process random seed still keeps a client from choosing colliding
/// names in advance.
pub(super) type NameSet = HashSet<Arc<str>, foldhash::fast::RandomState>;
pub(super) type NameMap<V> = HashMap<Arc<str>, V, foldhash::fast::RandomState>;

/// Which resources of a type the client wants.
#[derive(Debug, Default)]
pub(super) struct Interest {
    pub(super) wildcard: bool,
    pub(super) names: Subscription,
    /// How many times the interest may have lost names (see [`Interest::narrowed`]): what was
    /// found wanted at one count is still wanted while the count stands, so the resources of a
    /// response or a backlog are not looked up one by one again (a lookup per resource per
    /// stream was a tenth of the agent's CPU in a 10k-service sync).
    narrowings: u64,
}

/// The names a client subscribed to. Envoy subscribes to the endpoints of every cluster it has,
/// so a proxy of the whole mesh names every assignment of the snapshot (10k at 10k services): such
/// a subscription is held as the snapshot's name index itself (`base`, shared by every stream
/// that subscribed to the same snapshot's names), and later subscriptions and unsubscriptions as
/// differences. A set of its own per stream was about 280 KiB at 10k names.
#[derive(Debug, Default)]
pub(super) struct Subscription {
    base: Option<Arc<NameIndex>>,
    /// Subscribed, not in `base`.
    added: NameSet,
    /// In `base`, not subscribed.
    removed: NameSet,
}

impl Subscription {
    /// Every name of `index`.
    pub(super) fn whole(index: Arc<NameIndex>) -> Subscription {
        Subscription {
            base: Some(index),
            ..Subscription::default()
        }
    }

    /// The subscription's own `Arc` of a name.
    pub(super) fn get(&self, name: &str) -> Option<&Arc<str>> {
        match self.base.as_ref().and_then(|base| base.get_key_value(name)) {
            Some(_) if !self.removed.is_empty() && self.removed.contains(name) => None,
            Some((key, _)) => Some(key),
            None => self.added.get(name),
        }
    }

    /// Whether this is every name of `index` and nothing else, known without a lookup.
    pub(super) fn is_all_of(&self, index: &Arc<NameIndex>) -> bool {
        self.added.is_empty()
            && self.removed.is_empty()
            && self
                .base
                .as_ref()
                .is_some_and(|base| Arc::ptr_eq(base, index))
    }

    pub(super) fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// Adds a name; whether it was new.
    pub(super) fn insert(&mut self, name: Arc<str>) -> bool {
        if self
            .base
            .as_ref()
            .is_some_and(|base| base.contains_key(&name))
        {
            self.removed.remove(&name)
        } else {
            self.added.insert(name)
        }
    }

    /// Removes a name; whether it was there.
    pub(super) fn remove(&mut self, name: &str) -> bool {
        match self.base.as_ref().and_then(|base| base.get_key_value(name)) {
            Some((key, _)) => self.removed.insert(key.clone()),
            None => self.added.remove(name),
        }
    }

    /// When the names subscribed one by one have come to be every name of `index` and no
    /// other, holds them as the index. Envoy subscribes to the endpoints of each batch of
    /// clusters it receives, and a first sync's clusters come in several responses, so its
    /// subscription to the whole mesh grows request by request instead of arriving whole:
    /// 50 Delta clients at 10k services kept a set of their own each, about 280 KiB.
    pub(super) fn compact(&mut self, index: &Arc<NameIndex>) {
        if self.base.is_none()
            && self.removed.is_empty()
            && self.added.len() == index.len()
            && index.keys().all(|name| self.added.contains(name))
        {
            *self = Subscription::whole(index.clone());
        }
    }

    pub(super) fn len(&self) -> usize {
        self.base.as_ref().map_or(0, |base| base.len()) - self.removed.len() + self.added.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Arc<str>> {
        let based = self
            .base
            .iter()
            .flat_map(|base| base.keys())
            .filter(|name| self.removed.is_empty() || !self.removed.contains(*name));
        based.chain(&self.added)
    }
}

impl FromIterator<Arc<str>> for Subscription {
    fn from_iter<I: IntoIterator<Item = Arc<str>>>(names: I) -> Self {
        Subscription {
            added: names.into_iter().collect(),
            ..Subscription::default()
        }
    }
}

impl Interest {
    pub(super) fn wants(&self, name: &str) -> bool {
        self.wildcard || self.names.contains(name)
    }

    /// Says that names may have left the interest (an unsubscription, wildcard dropped, a
    /// replaced subscription). Every change that can lose a name calls this.
    pub(super) fn narrowed(&mut self) {
        self.narrowings += 1;
    }

    pub(super) fn narrowings(&self) -> u64 {
        self.narrowings
    }
}

/// The resources of one type a client holds (Delta: has ACKed or NACKed; SotW: was sent), by
/// version, and a digest of them all kept up to date entry by entry, which makes a content
/// version of the client's whole view without hashing the view.
///
/// Held as a snapshot map the client held entirely when it was last in sync (`base`, shared
/// with the snapshot: no memory of its own) and the names where it differs since (`changes`).
/// A client that holds the whole mesh costs a few words instead of a hash map of every name:
/// at 10k services and a hundred proxies those maps were a quarter of the agent's heap.
///
/// During a first sync the client receives the snapshot's resources in name order, a budget's
/// worth per response: it then holds the first part of a map, up to a name (`held`), which
/// grows response by response ([`ClientView::extend`]) instead of a map of its own growing by
/// a name at a time. Those maps, ten thousand names per type and stream until each stream was
/// in sync, were the largest part of the agent's peak heap at 10k services (heaptrack).
#[derive(Debug, Default)]
pub(super) struct ClientView {
    base: ResourceMap,
    /// How much of `base` the client holds, in its name order.
    held: Held,
    /// `Some(version)`: held at that version; `None`: in the held part of `base`, but not held.
    changes: NameMap<Option<u64>>,
    len: usize,
    digest: u64,
}

/// The part of a [`ClientView`]'s base the client holds.
#[derive(Debug, Default, PartialEq)]
enum Held {
    #[default]
    All,
    /// The names up to this one, included.
    Through(Arc<str>),
}

impl Held {
    fn covers(&self, name: &str) -> bool {
        match self {
            Held::All => true,
            Held::Through(last) => name <= &**last,
        }
    }
}

impl ClientView {
    pub(super) fn get(&self, name: &str) -> Option<u64> {
        match self.changes.get(name) {
            Some(held) => *held,
            None => self.based(name).map(|(_, r)| r.version),
        }
    }

    /// The entry of `name` in the part of the base the client holds.
    fn based(&self, name: &str) -> Option<(&Arc<str>, &Arc<XdsResource>)> {
        if !self.held.covers(name) {
            return None;
        }
        self.base.get_key_value(name)
    }

    /// The view of a client that holds exactly `current`, whose [`Whole`] is `whole`: the map
    /// itself, shared, and nothing of its own.
    pub(super) fn whole(current: &ResourceMap, whole: Whole) -> ClientView {
        ClientView {
            base: current.clone(),
            held: Held::All,
            changes: NameMap::default(),
            len: current.len(),
            digest: whole.digest,
        }
    }

    /// Whether the client holds exactly `current`, known without looking at any resource.
    pub(super) fn is_exactly(&self, current: &ResourceMap) -> bool {
        self.changes.is_empty() && self.held == Held::All && self.base.ptr_eq(current)
    }

    /// Room for `additional` more differences from the base: a reconnecting client names
    /// everything it holds at once (20k at 10k services), which would otherwise grow the map
    /// by rehashing it several times.
    pub(super) fn reserve(&mut self, additional: usize) {
        self.changes.reserve(additional);
    }

    /// The client now holds `sent` too, names in increasing order with the versions it was
    /// sent. When it held nothing, or the first part of `current` alone, and `sent` is the
    /// very next run of `current`'s entries, the part held grows by a name and no entry is
    /// made; otherwise each goes in through [`ClientView::insert`].
    pub(super) fn extend<'a>(
        &mut self,
        current: &ResourceMap,
        sent: impl Iterator<Item = (&'a Arc<str>, u64)> + Clone,
    ) {
        let Some(held) = self.next_run(current, sent.clone()) else {
            for (name, version) in sent {
                self.insert(name.clone(), version);
            }
            return;
        };
        for (name, version) in sent {
            self.digest ^= entry_hash(name, version);
            self.len += 1;
        }
        self.base = current.clone();
        self.held = held;
    }

    /// What the client holds of `current` once it also holds `sent`, when that is a first part
    /// of `current` (see [`ClientView::extend`]); `None` when `sent` is not the next run.
    fn next_run<'a>(
        &self,
        current: &ResourceMap,
        sent: impl Iterator<Item = (&'a Arc<str>, u64)>,
    ) -> Option<Held> {
        use std::ops::Bound;
        if !self.changes.is_empty() {
            return None;
        }
        let after = match &self.held {
            _ if self.len == 0 => Bound::Unbounded,
            Held::Through(last) if self.base.ptr_eq(current) => Bound::Excluded(&**last),
            _ => return None,
        };
        let mut entries = current.range::<_, str>((after, Bound::Unbounded));
        let mut last = None;
        for (name, version) in sent {
            let (key, resource) = entries.next()?;
            if **key != **name || resource.version != version {
                return None;
            }
            last = Some(key);
        }
        match (last?, entries.next()) {
            (_, None) => Some(Held::All),
            (last, Some(_)) => Some(Held::Through(last.clone())),
        }
    }

    pub(super) fn insert(&mut self, name: Arc<str>, version: u64) {
        use std::collections::hash_map::Entry;
        // One lookup into the base and one into the differences (an entry, hashed once).
        let based = self.based(&name).map(|(_, r)| r.version);
        let entry = self.changes.entry(name);
        let old = match &entry {
            Entry::Occupied(held) => *held.get(),
            Entry::Vacant(_) => based,
        };
        if old == Some(version) {
            return;
        }
        self.digest ^= entry_hash(entry.key(), version);
        match old {
            Some(old) => self.digest ^= entry_hash(entry.key(), old),
            None => self.len += 1,
        }
        match entry {
            Entry::Occupied(held) if based == Some(version) => {
                held.remove();
            }
            Entry::Occupied(mut held) => {
                held.insert(Some(version));
            }
            // Vacant: the base holds `old`, which is not `version`.
            Entry::Vacant(slot) => {
                slot.insert(Some(version));
            }
        }
    }

    pub(super) fn remove(&mut self, name: &str) {
        let Some(old) = self.get(name) else {
            return;
        };
        self.digest ^= entry_hash(name, old);
        self.len -= 1;
        match self.based(name) {
            Some((key, _)) => {
                let key = key.clone();
                self.changes.insert(key, None);
            }
            None => {
                self.changes.remove(name);
            }
        }
    }

    /// How many resources the client holds.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The names of what the client holds.
    pub(super) fn names(&self) -> impl Iterator<Item = &Arc<str>> {
        use std::ops::Bound;
        let range = match &self.held {
            Held::All => (Bound::Unbounded, Bound::Unbounded),
            Held::Through(last) => (Bound::Unbounded, Bound::Included(&**last)),
        };
        let based = self
            .base
            .range::<_, str>(range)
            .map(|(name, _)| name)
            .filter(|name| !matches!(self.changes.get(*name), Some(None)));
        let added = self
            .changes
            .iter()
            .filter(|(name, held)| held.is_some() && self.based(name).is_none())
            .map(|(name, _)| name);
        based.chain(added)
    }

    /// The client holds exactly `current`: keep that map as the base, and nothing of its own.
    pub(super) fn rebase(&mut self, current: &ResourceMap) {
        if self.is_exactly(current) {
            return;
        }
        self.base = current.clone();
        self.held = Held::All;
        // A new map, not a cleared one: a cleared map keeps its capacity.
        self.changes = NameMap::default();
        self.len = current.len();
    }

    pub(super) fn version_info(&self) -> String {
        format_version(self.digest)
    }
}

/// The most resource bytes a response that may be split carries (every Delta response; SotW
/// endpoints and routes, sent by change): the rest follows after the ACK. This paces a large
/// first sync and bounds the memory in flight.
///
/// SotW: Envoy's ACK of endpoints repeats its whole subscription (10k names at 10k services),
/// which the client builds and the agent reads for every response: a first sync of 6 MB of
/// assignments in 24 responses of 256 KiB made each SotW client send, and the agent read, 240k
/// names. In 1 MiB responses, at 10k services with 50 SotW clients: sync 4.5–5.0 → 3.2–3.9 s,
/// agent CPU to sync 2.85–3.16 → 2.13–2.83 s, peak RSS 250–254 → 251–262 MiB (2 MiB took the
/// peak to 348 MiB and 4 MiB to 401, for no shorter sync).
///
/// Delta kept 256 KiB while every stream's responses were buffers of their own; since the
/// streams of a sync share their large responses' bytes ([`super::response::SharedHeads`]) the
/// larger budget costs no memory: at 10k services with 100 clients and Envoy (twelve
/// interleaved pairs), agent CPU to sync 1.92 → 1.70 s on average, peak RSS 195–233 → 185–218
/// MiB.
pub(super) const RESPONSE_BUDGET: usize = 1 << 20;

/// How one type of the snapshot differs from what the client holds: what a push must say.
#[derive(Default)]
pub(super) struct TypeDiff {
    /// Wanted, and not at the version the client holds; sorted by name.
    pub(super) changed: Vec<Arc<XdsResource>>,
    /// Held by the client, but gone from the snapshot or no longer wanted.
    pub(super) removed: Vec<Arc<str>>,
    /// Subscribed by name, but not in the snapshot (and not held).
    pub(super) absent: Vec<Arc<str>>,
}

impl TypeDiff {
    pub(super) fn is_empty(&self) -> bool {
        self.changed.is_empty() && self.removed.is_empty() && self.absent.is_empty()
    }
}

/// Per type, the state both flavours keep for one stream.
#[derive(Debug, Default)]
pub(super) struct TypeState {
    /// Has the client asked for this type on this stream.
    pub(super) requested: bool,
    pub(super) interest: Interest,
    pub(super) client: ClientView,
    /// Nonce of the response in flight (sent, not yet ACKed or NACKed).
    pub(super) pending: Option<String>,
    /// The resources this type was last compared against; the next push looks only at what
    /// differs from them, plus `dirty`. `None` means look at everything.
    pub(super) baseline: Option<ResourceMap>,
    /// Names to look at on the next push whatever the snapshot says (new subscriptions,
    /// endpoints to re-send).
    pub(super) dirty: BTreeSet<Arc<str>>,
    /// Resources found to send that did not fit in the last response (see [`Self::limit`]),
    /// in name order. They stay valid until the snapshot changes them or the client's interest
    /// does, so the next response takes from here without looking at them again: a first sync
    /// of N resources in N/k responses costs O(N), not O(N²/k).
    pub(super) backlog: VecDeque<Arc<XdsResource>>,
    /// The interest's [`Interest::narrowings`] when every backlog resource was last known
    /// wanted.
    backlog_narrowings: u64,
    /// Answer on the next push even with nothing new.
    pub(super) must_answer: bool,
}

impl TypeState {
    /// How `current` differs from what the client holds and wants.
    pub(super) fn diff(&mut self, current: &ResourceMap) -> TypeDiff {
        let mut found = TypeDiff::default();
        let dirty = std::mem::take(&mut self.dirty);
        match self.baseline.replace(current.clone()) {
            // The very same map, nothing to re-check: an ACK, or a snapshot that changed
            // only other types, costs nothing.
            Some(baseline) if baseline.ptr_eq(current) && dirty.is_empty() => {}
            Some(baseline) => {
                let mut names = dirty;
                names.extend(baseline.diff(current).map(|d| match d {
                    DiffItem::Add(name, _) | DiffItem::Remove(name, _) => name.clone(),
                    DiffItem::Update { new: (name, _), .. } => name.clone(),
                }));
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
                self.backlog.clear();
                let mut names: NameSet = self.client.names().cloned().collect();
                names.extend(self.interest.names.iter().cloned());
                for name in &names {
                    self.classify(current, name, &mut found);
                }
                found.removed.sort();
                found.absent.sort();
            }
            None => {
                // Everything, most of the snapshot: one walk over it in name order (no lookup
                // into it per name, and `changed` comes out sorted), then what the client holds
                // or named that it lacks.
                self.backlog.clear();
                // How many of the client's names, and of the names it subscribed to, the walk
                // met: when all of them, none is missing from the snapshot, and the two lookups
                // per name below are skipped (at 10k, 20k ordered lookups per type and stream).
                let (mut held_met, mut named_met) = (0, 0);
                // A reconnected client found to hold exactly this map (see
                // `ClientView::whole`): its versions are the map's, no lookup per name.
                let exact = self.client.is_exactly(current);
                for (name, resource) in current {
                    let held = if exact {
                        Some(resource.version)
                    } else {
                        self.client.get(name)
                    };
                    held_met += usize::from(held.is_some());
                    if !self.interest.wildcard && self.interest.names.contains(name) {
                        named_met += 1;
                    }
                    if self.interest.wants(name) {
                        if held != Some(resource.version) {
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
                if named_met < self.interest.names.len() {
                    for name in self.interest.names.iter() {
                        if !current.contains_key(name) && self.client.get(name).is_none() {
                            found.absent.push(name.clone());
                        }
                    }
                }
                found.removed.sort();
                found.absent.sort();
                return found;
            }
        }
        found.changed.sort_by(|a, b| a.name.cmp(&b.name));
        found
    }

    /// Puts one name where it belongs in `found`, if anywhere.
    fn classify(&self, current: &ResourceMap, name: &Arc<str>, found: &mut TypeDiff) {
        let held = self.client.get(name);
        match current.get(name) {
            Some(resource) if self.interest.wants(name) && held != Some(resource.version) => {
                found.changed.push(resource.clone());
            }
            Some(_) if self.interest.wants(name) => {}
            _ if held.is_some() => found.removed.push(name.clone()),
            None if self.interest.names.contains(name) => found.absent.push(name.clone()),
            _ => {}
        }
    }

    /// Of the clusters about to be sent, the ones the client already holds at another version:
    /// Envoy re-creates those and waits for their endpoints again.
    pub(super) fn changed_clusters(
        &self,
        kind: ResourceType,
        changed: &[Arc<XdsResource>],
    ) -> Vec<Arc<str>> {
        if kind != ResourceType::Cluster {
            return Vec::new();
        }
        changed
            .iter()
            .filter(|r| self.client.get(&r.name).is_some())
            .map(|r| r.name.clone())
            .collect()
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
            for resource in changed.drain(keep..).rev() {
                self.backlog.push_front(resource);
            }
            return;
        }
        while let Some(next) = self.backlog.front() {
            if !changed.is_empty() && bytes + next.body.value.len() > RESPONSE_BUDGET {
                break;
            }
            bytes += next.body.value.len();
            changed.extend(self.backlog.pop_front());
        }
    }

    /// Nothing in flight or waiting, and the client holds every resource of `current` at its
    /// version (for endpoints and routes, it has subscribed to them all).
    pub(super) fn holds(&self, current: &ResourceMap) -> bool {
        self.pending.is_none()
            && self.backlog.is_empty()
            && (self.client.is_exactly(current)
                || current
                    .iter()
                    .all(|(name, resource)| self.client.get(name) == Some(resource.version)))
    }

    /// A push found nothing to send: when nothing is in flight or waiting and the client holds
    /// as many resources as `current` has, it holds exactly `current` (every one it wants at
    /// its version, none it should not), so its view becomes that map, shared.
    pub(super) fn settle(&mut self, current: &ResourceMap) {
        if self.pending.is_none()
            && self.backlog.is_empty()
            && self.dirty.is_empty()
            && self.client.len() == current.len()
        {
            self.client.rebase(current);
        }
    }

    /// Makes the next push look at `name` whatever the snapshot says. Without a baseline the
    /// next push is a full diff of everything the client names or holds, so nothing is queued:
    /// a first request naming 10k resources does not insert them one by one.
    pub(super) fn look_again(&mut self, name: Arc<str>) {
        if self.baseline.is_some() {
            self.dirty.insert(name);
        }
    }

    /// Makes the endpoints of re-created clusters go out again on the next push.
    pub(super) fn resend(&mut self, names: Vec<Arc<str>>) {
        for name in names {
            self.client.remove(&name);
            self.look_again(name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::Protocol;
    use crate::xds::testing::World;

    /// The same view built entry by entry, without a base.
    fn plain(view: &ClientView) -> ClientView {
        let mut plain = ClientView::default();
        for name in view.names() {
            plain.insert(name.clone(), view.get(name).unwrap());
        }
        plain
    }

    /// A subscription held as a snapshot's index, with names taken out and put back and one
    /// added, answers as a set of its own would.
    #[test]
    fn a_subscription_based_on_an_index_reads_as_a_set_of_its_own() {
        let snap = World::new().add_many(20);
        let index = snap.name_index(ResourceType::Endpoint).clone();
        let mut names = Subscription::whole(index.clone());
        let mut plain: NameSet = index.keys().cloned().collect();
        let some: Vec<Arc<str>> = index.keys().take(3).cloned().collect();
        for (name, present) in [(&some[0], false), (&some[1], false), (&some[0], true)] {
            if present {
                assert!(names.insert(name.clone()) && plain.insert(name.clone()));
            } else {
                assert!(names.remove(name) && plain.remove(name));
            }
        }
        assert!(!names.remove("absent|1"));
        assert!(names.insert(Arc::from("extra|1")) && plain.insert(Arc::from("extra|1")));
        assert!(!names.insert(some[2].clone()), "already there");
        assert_eq!(names.len(), plain.len());
        let listed: NameSet = names.iter().cloned().collect();
        assert_eq!(listed, plain);
        for name in index.keys().chain(&plain) {
            assert_eq!(names.contains(name), plain.contains(name), "{name}");
        }
        assert!(!names.contains(&some[1]) && names.contains("extra|1"));
        assert!(
            Arc::ptr_eq(names.get(&some[0]).unwrap(), &some[0]),
            "the index's own name"
        );
    }

    /// Everything `view` answers, as a view built entry by entry answers it.
    fn reads_as(view: &ClientView, plain: &ClientView, current: &ResourceMap) {
        assert_eq!(view.len(), plain.len());
        assert_eq!(view.version_info(), plain.version_info());
        for name in current.keys().map(|n| &**n).chain(["absent|1"]) {
            assert_eq!(view.get(name), plain.get(name), "{name}");
        }
        let mut names: Vec<&Arc<str>> = view.names().collect();
        let mut expected: Vec<&Arc<str>> = plain.names().collect();
        names.sort();
        expected.sort();
        assert_eq!(names, expected);
    }

    /// A first sync sent in name order, a budget's worth at a time, is held as a growing first
    /// part of the snapshot's map, with no entry of its own; anything else goes entry by entry.
    #[test]
    fn a_view_sent_in_order_holds_a_first_part_of_the_map() {
        let snap = World::new().add_many(20);
        let current = snap.of(ResourceType::Endpoint);
        let entries: Vec<(&Arc<str>, u64)> = current.iter().map(|(n, r)| (n, r.version)).collect();
        assert_eq!(entries.len(), 20);
        let mut view = ClientView::default();
        let mut plain = ClientView::default();
        for chunk in entries.chunks(6) {
            view.extend(current, chunk.iter().copied());
            for &(name, version) in chunk {
                plain.insert(name.clone(), version);
            }
            assert!(view.changes.is_empty(), "a part of the map, no entries");
            reads_as(&view, &plain, current);
        }
        assert!(view.is_exactly(current));

        // A gap, or a version other than the map's: entry by entry.
        let mut gap = ClientView::default();
        gap.extend(current, entries[..3].iter().copied());
        gap.extend(current, entries[4..6].iter().copied());
        assert_eq!(gap.changes.len(), 2);
        let mut plain = ClientView::default();
        for &(name, version) in entries[..3].iter().chain(&entries[4..6]) {
            plain.insert(name.clone(), version);
        }
        reads_as(&gap, &plain, current);
        let mut other = ClientView::default();
        other.extend(current, [(entries[0].0, entries[0].1 + 1)].into_iter());
        assert_eq!(other.changes.len(), 1);
        assert_eq!(other.get(entries[0].0), Some(entries[0].1 + 1));

        // A part held, then one of its names dropped and one past it added: entries on top,
        // and the part no longer grows (the next run goes entry by entry).
        let mut view = ClientView::default();
        view.extend(current, entries[..8].iter().copied());
        view.remove(entries[2].0);
        view.insert(entries[12].0.clone(), entries[12].1);
        let mut plain = ClientView::default();
        for &(name, version) in &entries[..8] {
            plain.insert(name.clone(), version);
        }
        plain.remove(entries[2].0);
        plain.insert(entries[12].0.clone(), entries[12].1);
        reads_as(&view, &plain, current);
        view.extend(current, entries[8..10].iter().copied());
        for &(name, version) in &entries[8..10] {
            plain.insert(name.clone(), version);
        }
        reads_as(&view, &plain, current);
        view.rebase(current);
        assert!(view.is_exactly(current) && view.len() == 20);
    }

    #[test]
    fn a_view_based_on_a_snapshot_map_reads_and_digests_as_one_built_entry_by_entry() {
        let mut world = World::new();
        world.set("/a/one", Protocol::Http, &["10.0.0.1:80"]);
        let snapshot = world.set("/a/two", Protocol::Http, &["10.0.0.2:80"]);
        let current = snapshot.of(ResourceType::Endpoint);
        let mut view = ClientView::default();
        for (name, resource) in current {
            view.insert(name.clone(), resource.version);
        }
        let digest = view.version_info();
        view.rebase(current);
        assert!(view.changes.is_empty() && view.base.ptr_eq(current));
        assert_eq!((view.len(), view.version_info()), (2, digest.clone()));

        // Changes on top of the base: one held at another version, one dropped, one added.
        let (one, two) = ("one.a.system.internal|8080", "two.a.system.internal|8080");
        view.insert(Arc::from(one), 7);
        view.remove(two);
        view.insert(Arc::from("three|8080"), 9);
        assert_eq!(view.get(one), Some(7));
        assert_eq!(view.get(two), None);
        assert_eq!(view.get("three|8080"), Some(9));
        let mut names: Vec<&str> = view.names().map(|n| &**n).collect();
        names.sort();
        assert_eq!(names, ["one.a.system.internal|8080", "three|8080"]);
        assert_eq!(view.len(), 2);
        assert_eq!(view.version_info(), plain(&view).version_info());
        // Undone: the base's versions again, and the same digest as before.
        view.insert(Arc::from(one), current[one].version);
        view.insert(Arc::from(two), current[two].version);
        view.remove("three|8080");
        assert_eq!(view.version_info(), digest);
        assert!(view.changes.is_empty(), "nothing of its own again");
    }
}
