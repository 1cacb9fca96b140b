//! The per-stream ADS state machines, with no I/O: requests and snapshots in, responses out.
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

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse, Resource,
};

use imbl::ordmap::DiffItem;

use crate::translate::envoy::{
    ResourceMap, ResourceType, XdsResource, XdsSnapshot, fnv1a, format_version, parse_version,
};

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

fn nonce(counter: &mut u64) -> String {
    *counter += 1;
    counter.to_string()
}

/// A name as the current snapshot spells it (sharing its allocation), or a new one for names
/// the snapshot does not hold.
fn intern(current: &ResourceMap, name: &str) -> Arc<str> {
    current
        .get_key_value(name)
        .map_or_else(|| Arc::from(name), |(key, _)| key.clone())
}

/// Which resources of a type the client wants.
#[derive(Debug, Default)]
struct Interest {
    wildcard: bool,
    names: HashSet<Arc<str>>,
}

impl Interest {
    fn wants(&self, name: &str) -> bool {
        self.wildcard || self.names.contains(name)
    }
}

/// The resources of one type a client holds (Delta: has ACKed or NACKed; SotW: was sent), by
/// version, and a digest of them all kept up to date entry by entry, which makes a content
/// version of the client's whole view without hashing the view.
#[derive(Debug, Default)]
struct Held {
    versions: HashMap<Arc<str>, u64>,
    digest: u64,
}

impl Held {
    fn get(&self, name: &str) -> Option<u64> {
        self.versions.get(name).copied()
    }

    fn insert(&mut self, name: Arc<str>, version: u64) {
        self.digest ^= entry_hash(&name, version);
        if let Some(old) = self.versions.insert(name.clone(), version) {
            self.digest ^= entry_hash(&name, old);
        }
    }

    fn remove(&mut self, name: &str) {
        if let Some((name, old)) = self.versions.remove_entry(name) {
            self.digest ^= entry_hash(&name, old);
        }
    }

    fn version_info(&self) -> String {
        format_version(self.digest)
    }
}

/// One entry's share of the digest: the name's hash and the version, mixed (splitmix64's
/// finaliser) so that XOR-ing many of them does not cancel out structure.
fn entry_hash(name: &str, version: u64) -> u64 {
    let mut x = fnv1a(name.as_bytes()) ^ version.rotate_left(32);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The most resource bytes a response carries when the protocol lets us split it (every Delta
/// response, SotW endpoints and routes): the rest follows after the ACK. Besides pacing a large
/// first sync, this bounds the memory a stream keeps, because the gRPC encoder holds on to a
/// buffer the size of the largest message its stream ever sent.
const RESPONSE_BUDGET: usize = 256 << 10;

/// What a push found for one type.
#[derive(Default)]
struct Reconciled {
    /// Wanted, and not at the version the client holds; sorted by name.
    changed: Vec<Arc<XdsResource>>,
    /// Held by the client, but gone from the snapshot or no longer wanted.
    removed: Vec<Arc<str>>,
    /// Subscribed by name, but not in the snapshot (and not held).
    absent: Vec<Arc<str>>,
}

impl Reconciled {
    fn is_empty(&self) -> bool {
        self.changed.is_empty() && self.removed.is_empty() && self.absent.is_empty()
    }
}

/// Per type, what both flavours track.
#[derive(Debug, Default)]
struct Tracked {
    /// Has the client asked for this type on this stream.
    requested: bool,
    interest: Interest,
    held: Held,
    /// Nonce of the response in flight (sent, not yet ACKed or NACKed).
    pending: Option<String>,
    /// The resources this type was last reconciled against; the next push looks only at what
    /// differs from them, plus `dirty`. `None` means look at everything.
    synced: Option<ResourceMap>,
    /// Names to look at on the next push whatever the snapshot says (new subscriptions,
    /// endpoints to re-send).
    dirty: BTreeSet<Arc<str>>,
    /// Answer on the next push even with nothing new.
    force: bool,
}

impl Tracked {
    fn reconcile(&mut self, current: &ResourceMap) -> Reconciled {
        let mut found = Reconciled::default();
        let dirty = std::mem::take(&mut self.dirty);
        match self.synced.replace(current.clone()) {
            // The very same map, nothing to re-check: an ACK, or a snapshot that changed
            // only other types, costs nothing.
            Some(synced) if synced.ptr_eq(current) && dirty.is_empty() => {}
            Some(synced) => {
                let mut names = dirty;
                names.extend(synced.diff(current).map(|d| match d {
                    DiffItem::Add(name, _) | DiffItem::Remove(name, _) => name.clone(),
                    DiffItem::Update { new: (name, _), .. } => name.clone(),
                }));
                for name in &names {
                    self.look(current, name, &mut found);
                }
            }
            None => {
                let mut names: HashSet<Arc<str>> = self.held.versions.keys().cloned().collect();
                if self.interest.wildcard {
                    names.extend(current.keys().cloned());
                } else {
                    names.extend(self.interest.names.iter().cloned());
                }
                for name in &names {
                    self.look(current, name, &mut found);
                }
                found.removed.sort();
                found.absent.sort();
            }
        }
        found.changed.sort_by(|a, b| a.name.cmp(&b.name));
        found
    }

    fn look(&self, current: &ResourceMap, name: &Arc<str>, found: &mut Reconciled) {
        let held = self.held.get(name);
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
    fn changed_clusters(&self, kind: ResourceType, changed: &[Arc<XdsResource>]) -> Vec<Arc<str>> {
        if kind != ResourceType::Cluster {
            return Vec::new();
        }
        changed
            .iter()
            .filter(|r| self.held.get(&r.name).is_some())
            .map(|r| r.name.clone())
            .collect()
    }

    /// Keeps in `changed` the first resources up to [`RESPONSE_BUDGET`] bytes (at least one)
    /// and leaves the rest for the next push, after this response's ACK.
    fn limit(&mut self, changed: &mut Vec<Arc<XdsResource>>) {
        let mut bytes = 0;
        let keep = changed
            .iter()
            .position(|r| {
                bytes += r.body.value.len();
                bytes > RESPONSE_BUDGET
            })
            .map_or(changed.len(), |at| at.max(1));
        self.dirty
            .extend(changed.drain(keep..).map(|r| r.name.clone()));
    }

    /// Makes the endpoints of re-created clusters go out again on the next push.
    fn resend(&mut self, names: Vec<Arc<str>>) {
        for name in names {
            self.held.remove(&name);
            self.dirty.insert(name);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// State of the world
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct SotwType {
    tracked: Tracked,
    last_nonce: Option<String>,
    /// Version of the last response sent.
    sent_version: Option<String>,
    acked_version: Option<String>,
    /// Of the names of the last request (see [`fingerprint`]).
    names_fingerprint: Option<(u64, usize)>,
}

/// One `StreamAggregatedResources` stream.
#[derive(Debug, Default)]
pub struct SotwStream {
    types: [SotwType; 4],
    nonces: u64,
}

impl SotwStream {
    pub fn new() -> Self {
        SotwStream::default()
    }

    /// The version the client last ACKed for a type.
    pub fn acked(&self, kind: ResourceType) -> Option<&str> {
        self.types[kind.index()].acked_version.as_deref()
    }

    /// Handles a request; returns what to send (now or after the in-flight response is ACKed)
    /// and what happened.
    pub fn on_request(
        &mut self,
        request: &DiscoveryRequest,
        snapshot: &XdsSnapshot,
    ) -> (Vec<DiscoveryResponse>, Vec<Event>) {
        let Some(kind) = ResourceType::from_type_url(&request.type_url) else {
            let event = Event::UnknownType {
                type_url: request.type_url.clone(),
            };
            return (Vec::new(), vec![event]);
        };
        let state = &mut self.types[kind.index()];
        let mut events = Vec::new();
        if !request.response_nonce.is_empty() {
            if state.last_nonce.as_deref() != Some(request.response_nonce.as_str()) {
                // Envoy sends a fresh request after it handles our newer response; this one
                // answers something already superseded.
                events.push(Event::StaleNonce {
                    kind,
                    nonce: request.response_nonce.clone(),
                });
                return (Vec::new(), events);
            }
            state.tracked.pending = None;
            match &request.error_detail {
                Some(status) => events.push(Event::Nack {
                    kind,
                    version: state.sent_version.clone().unwrap_or_default(),
                    error: status.message.clone(),
                }),
                None => {
                    state.acked_version = Some(request.version_info.clone());
                    events.push(Event::Ack {
                        kind,
                        version: request.version_info.clone(),
                    });
                }
            }
        }
        if !state.tracked.requested {
            // Always answer the first request of a type on a stream.
            state.tracked.requested = true;
            state.tracked.force = true;
        }
        set_sotw_interest(state, kind, &request.resource_names, snapshot.of(kind));
        (self.push(snapshot), events)
    }

    /// A new snapshot: push whatever changed for every requested type, in order.
    pub fn on_snapshot(&mut self, snapshot: &XdsSnapshot) -> Vec<DiscoveryResponse> {
        self.push(snapshot)
    }

    fn push(&mut self, snapshot: &XdsSnapshot) -> Vec<DiscoveryResponse> {
        let mut out = Vec::new();
        for kind in ResourceType::ALL {
            let tracked = &mut self.types[kind.index()].tracked;
            if !tracked.requested || tracked.pending.is_some() {
                continue;
            }
            let current = snapshot.of(kind);
            let mut found = tracked.reconcile(current);
            let whole = kind.is_state_of_the_world();
            if !whole {
                tracked.limit(&mut found.changed);
            }
            // Without removals in the protocol, a type sent by change has nothing to say when
            // its resources only went away (Envoy drops them with their cluster or listener).
            if found.changed.is_empty() && (found.removed.is_empty() || !whole) && !tracked.force {
                continue;
            }
            let resend = tracked.changed_clusters(kind, &found.changed);
            for name in &found.removed {
                tracked.held.remove(name);
            }
            for resource in &found.changed {
                tracked.held.insert(resource.name.clone(), resource.version);
            }
            let resources = if whole {
                current
                    .values()
                    .filter(|r| tracked.interest.wants(&r.name))
                    .map(|r| r.body.clone())
                    .collect()
            } else {
                found.changed.iter().map(|r| r.body.clone()).collect()
            };
            let version = tracked.held.version_info();
            let nonce = nonce(&mut self.nonces);
            let state = &mut self.types[kind.index()];
            state.tracked.pending = Some(nonce.clone());
            state.tracked.force = false;
            state.last_nonce = Some(nonce.clone());
            state.sent_version = Some(version.clone());
            out.push(DiscoveryResponse {
                version_info: version,
                resources,
                type_url: kind.type_url().to_string(),
                nonce,
                ..DiscoveryResponse::default()
            });
            self.types[ResourceType::Endpoint.index()]
                .tracked
                .resend(resend);
        }
        out
    }
}

/// A cheap, order-independent fingerprint of a list of names: the sum of a fast per-name
/// hash, and the count.
fn fingerprint(names: &[String]) -> (u64, usize) {
    let sum = names.iter().fold(0u64, |sum, name| {
        let bytes = name.as_bytes();
        let mut h = (bytes.len() as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let word = u64::from_le_bytes(chunk.try_into().unwrap_or_default());
            h = (h ^ word)
                .wrapping_mul(0xff51_afd7_ed55_8ccd)
                .rotate_left(29);
        }
        for &b in chunks.remainder() {
            h = (h ^ u64::from(b)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        }
        sum.wrapping_add(h ^ (h >> 32))
    });
    (sum, names.len())
}

/// Takes a SotW request's names as the type's subscription. Envoy repeats the whole list on
/// every request (ten thousand names on each endpoint ACK at that scale), so the usual case,
/// the same list as last time, is recognised by its fingerprint without a lookup per name.
fn set_sotw_interest(
    state: &mut SotwType,
    kind: ResourceType,
    names: &[String],
    current: &ResourceMap,
) {
    let fingerprint = fingerprint(names);
    if state.names_fingerprint == Some(fingerprint) {
        return;
    }
    state.names_fingerprint = Some(fingerprint);
    let tracked = &mut state.tracked;
    let wildcard =
        names.iter().any(|n| n == "*") || (names.is_empty() && kind.is_wildcard_by_default());
    let named = || names.iter().filter(|n| *n != "*");
    let interest = &mut tracked.interest;
    // A list with duplicates could pass this check while dropping a name; Envoy sends sets,
    // and the cost of a miss is only that a dropped name keeps being sent.
    if wildcard == interest.wildcard
        && named().count() == interest.names.len()
        && named().all(|n| interest.names.contains(n.as_str()))
    {
        return;
    }
    let fresh: HashSet<Arc<str>> = named()
        .map(|n| {
            interest
                .names
                .get(n.as_str())
                .cloned()
                .unwrap_or_else(|| intern(current, n))
        })
        .collect();
    let added: Vec<Arc<str>> = fresh.difference(&interest.names).cloned().collect();
    let dropped: Vec<Arc<str>> = interest.names.difference(&fresh).cloned().collect();
    if wildcard != interest.wildcard {
        tracked.synced = None;
    }
    interest.wildcard = wildcard;
    interest.names = fresh;
    for name in dropped {
        if !interest.wants(&name) {
            tracked.held.remove(&name);
        }
    }
    // A changed subscription is answered: whole types always, the others when names were added.
    tracked.force |= kind.is_state_of_the_world() || !added.is_empty();
    tracked.dirty.extend(added);
}

// ---------------------------------------------------------------------------------------------
// Delta (incremental)
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct DeltaType {
    tracked: Tracked,
    /// Explicitly subscribed names we already told the client do not exist.
    told_absent: HashSet<Arc<str>>,
    /// Versions sent in the in-flight response; a NACK leaves the client on its old ones.
    in_flight: Vec<(Arc<str>, u64)>,
    /// The snapshot version of the in-flight response, reported on its ACK or NACK.
    in_flight_version: String,
}

/// One `DeltaAggregatedResources` stream.
#[derive(Debug, Default)]
pub struct DeltaStream {
    types: [DeltaType; 4],
    nonces: u64,
}

impl DeltaStream {
    pub fn new() -> Self {
        DeltaStream::default()
    }

    /// The version of a resource the client holds, as far as we know.
    pub fn holds(&self, kind: ResourceType, name: &str) -> Option<u64> {
        self.types[kind.index()].tracked.held.get(name)
    }

    pub fn on_request(
        &mut self,
        request: &DeltaDiscoveryRequest,
        snapshot: &XdsSnapshot,
    ) -> (Vec<DeltaDiscoveryResponse>, Vec<Event>) {
        let Some(kind) = ResourceType::from_type_url(&request.type_url) else {
            let event = Event::UnknownType {
                type_url: request.type_url.clone(),
            };
            return (Vec::new(), vec![event]);
        };
        let current = snapshot.of(kind);
        let state = &mut self.types[kind.index()];
        let tracked = &mut state.tracked;
        let mut events = Vec::new();

        if !tracked.requested {
            tracked.requested = true;
            tracked.force = true;
            // Legacy wildcard: the first request for a wildcard type that names nothing.
            tracked.interest.wildcard =
                request.resource_names_subscribe.is_empty() && kind.is_wildcard_by_default();
            // A reconnecting client says what it holds. A version this agent did not make
            // (another control plane's) matches nothing, so the resource is sent again.
            for (name, version) in &request.initial_resource_versions {
                let version = parse_version(version).unwrap_or(u64::MAX);
                tracked.held.insert(intern(current, name), version);
            }
            tracked.synced = None;
        }
        for name in &request.resource_names_subscribe {
            if name == "*" {
                tracked.interest.wildcard = true;
                tracked.synced = None;
            } else if !tracked.interest.names.contains(name.as_str()) {
                let name = intern(current, name);
                tracked.interest.names.insert(name.clone());
                state.told_absent.remove(&name);
                tracked.dirty.insert(name);
            }
        }
        for name in &request.resource_names_unsubscribe {
            if name == "*" {
                tracked.interest.wildcard = false;
            } else {
                tracked.interest.names.remove(name.as_str());
                state.told_absent.remove(name.as_str());
            }
            if !tracked.interest.wants(name) {
                tracked.held.remove(name);
            }
        }

        if !request.response_nonce.is_empty() {
            if tracked.pending.as_deref() == Some(request.response_nonce.as_str()) {
                tracked.pending = None;
                let version = std::mem::take(&mut state.in_flight_version);
                match &request.error_detail {
                    Some(status) => events.push(Event::Nack {
                        kind,
                        version,
                        error: status.message.clone(),
                    }),
                    None => events.push(Event::Ack { kind, version }),
                }
                // Either way the client has seen these versions: after an ACK it holds them,
                // after a NACK re-sending the same bytes would only be rejected again. Names it
                // unsubscribed from meanwhile are gone from its view.
                for (name, version) in std::mem::take(&mut state.in_flight) {
                    if tracked.interest.wants(&name) {
                        tracked.held.insert(name, version);
                    }
                }
            } else {
                events.push(Event::StaleNonce {
                    kind,
                    nonce: request.response_nonce.clone(),
                });
            }
        }
        (self.push(snapshot), events)
    }

    pub fn on_snapshot(&mut self, snapshot: &XdsSnapshot) -> Vec<DeltaDiscoveryResponse> {
        self.push(snapshot)
    }

    fn push(&mut self, snapshot: &XdsSnapshot) -> Vec<DeltaDiscoveryResponse> {
        let mut out = Vec::new();
        for kind in ResourceType::ALL {
            let state = &mut self.types[kind.index()];
            let tracked = &mut state.tracked;
            if !tracked.requested || tracked.pending.is_some() {
                continue;
            }
            let mut found = tracked.reconcile(snapshot.of(kind));
            // Explicitly subscribed names that do not exist: say so once, so Envoy does not
            // wait for them until its fetch timeout.
            found
                .absent
                .retain(|name| !state.told_absent.contains(name));
            tracked.limit(&mut found.changed);
            if found.is_empty() && !tracked.force {
                continue;
            }
            let resend = tracked.changed_clusters(kind, &found.changed);
            for name in &found.removed {
                tracked.held.remove(name);
            }
            state.told_absent.extend(found.absent.iter().cloned());
            let mut removed: Vec<String> = found
                .removed
                .iter()
                .chain(&found.absent)
                .map(|name| name.to_string())
                .collect();
            removed.sort();
            let nonce = nonce(&mut self.nonces);
            let state = &mut self.types[kind.index()];
            state.in_flight = found
                .changed
                .iter()
                .map(|r| (r.name.clone(), r.version))
                .collect();
            state.tracked.pending = Some(nonce.clone());
            state.tracked.force = false;
            let version = snapshot.version.to_string();
            state.in_flight_version = version.clone();
            out.push(DeltaDiscoveryResponse {
                system_version_info: version,
                resources: found
                    .changed
                    .iter()
                    .map(|r| Resource {
                        name: r.name.to_string(),
                        version: r.version_string(),
                        resource: Some(r.body.clone()),
                        ..Resource::default()
                    })
                    .collect(),
                type_url: kind.type_url().to_string(),
                removed_resources: removed,
                nonce,
                ..DeltaDiscoveryResponse::default()
            });
            self.types[ResourceType::Endpoint.index()]
                .tracked
                .resend(resend);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, HashMap};

    use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
    use envoy_types::pb::google::rpc::Status as RpcStatus;
    use prost::Message;

    use super::*;
    use crate::mesh::{EndpointSet, MeshState, Protocol, ServicePort, ServiceSpec};
    use crate::translate::envoy::EnvoyTranslator;

    const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
    const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
    const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
    const RDS: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";

    /// A little mesh that can be edited, and its translations.
    struct World {
        state: MeshState,
        translator: EnvoyTranslator,
    }

    impl World {
        fn new() -> Self {
            World {
                state: MeshState::new("240.240.0.0/16".parse().unwrap()),
                translator: EnvoyTranslator::default(),
            }
        }

        fn set(&mut self, path: &str, protocol: Protocol, endpoints: &[&str]) -> XdsSnapshot {
            let spec = ServiceSpec::new(
                path.parse().unwrap(),
                vec![ServicePort {
                    port: 8080,
                    protocol,
                    endpoints: EndpointSet::new(
                        endpoints.iter().map(|e| e.parse().unwrap()).collect(),
                    ),
                }],
            );
            self.state.upsert(spec).unwrap();
            self.snapshot()
        }

        fn remove(&mut self, path: &str) -> XdsSnapshot {
            self.state.remove(&path.parse().unwrap());
            self.snapshot()
        }

        fn snapshot(&mut self) -> XdsSnapshot {
            let mesh = self.state.snapshot();
            self.translator.translate(&mesh).xds
        }
    }

    fn sotw(type_url: &str, names: &[&str], version: &str, nonce: &str) -> DiscoveryRequest {
        DiscoveryRequest {
            type_url: type_url.to_string(),
            resource_names: names.iter().map(|s| s.to_string()).collect(),
            version_info: version.to_string(),
            response_nonce: nonce.to_string(),
            ..DiscoveryRequest::default()
        }
    }

    fn nack(mut request: DiscoveryRequest) -> DiscoveryRequest {
        request.error_detail = Some(RpcStatus {
            code: 3,
            message: "bad cluster".to_string(),
            details: Vec::new(),
        });
        request
    }

    fn ack(response: &DiscoveryResponse, names: &[&str]) -> DiscoveryRequest {
        sotw(
            &response.type_url,
            names,
            &response.version_info,
            &response.nonce,
        )
    }

    const BUZZ: &str = "buzz.bar.foo.system.internal|8080";
    const OTHER: &str = "other.foo.system.internal|8080";

    /// The cluster names of the assignments in a SotW EDS response.
    fn assignments(response: &DiscoveryResponse) -> Vec<String> {
        response
            .resources
            .iter()
            .map(|any| {
                ClusterLoadAssignment::decode(any.value.as_slice())
                    .unwrap()
                    .cluster_name
            })
            .collect()
    }

    #[test]
    fn sotw_sends_endpoints_by_change_and_clusters_whole() {
        let mut world = World::new();
        world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let snap = world.set("/foo/other", Protocol::Http, &["10.0.0.2:8080"]);
        let mut stream = SotwStream::new();
        let (out, _) = stream.on_request(&sotw(CDS, &[], "", ""), &snap);
        stream.on_request(&ack(&out[0], &[]), &snap);
        let (out, _) = stream.on_request(&sotw(EDS, &[BUZZ, OTHER], "", ""), &snap);
        assert_eq!(
            assignments(&out[0]),
            [BUZZ, OTHER],
            "first answer: all of them"
        );
        let eds1 = out[0].clone();
        stream.on_request(&ack(&eds1, &[BUZZ, OTHER]), &snap);

        // One endpoint changes: one assignment goes out, under a new version.
        let snap2 = world.set("/foo/other", Protocol::Http, &["10.0.0.3:8080"]);
        let out = stream.on_snapshot(&snap2);
        assert_eq!(out.len(), 1);
        assert_eq!(assignments(&out[0]), [OTHER]);
        assert_ne!(out[0].version_info, eds1.version_info);

        // The version is the content of the client's whole view: back to the same endpoints,
        // back to the same version.
        stream.on_request(&ack(&out[0], &[BUZZ, OTHER]), &snap2);
        let snap3 = world.set("/foo/other", Protocol::Http, &["10.0.0.2:8080"]);
        let out = stream.on_snapshot(&snap3);
        assert_eq!(assignments(&out[0]), [OTHER]);
        assert_eq!(out[0].version_info, eds1.version_info);
        stream.on_request(&ack(&out[0], &[BUZZ, OTHER]), &snap3);

        // A new service: clusters go out whole, old ones included; its endpoints are not sent
        // before the client asks for them.
        let snap4 = world.set("/foo/third", Protocol::Http, &["10.0.0.4:8080"]);
        let out = stream.on_snapshot(&snap4);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].type_url, CDS);
        assert_eq!(out[0].resources.len(), 3);
    }

    #[test]
    fn sotw_first_request_is_answered_even_when_empty() {
        let mut world = World::new();
        let snap = world.snapshot();
        let mut stream = SotwStream::new();
        let (out, _) = stream.on_request(&sotw(CDS, &[], "", ""), &snap);
        assert_eq!(out.len(), 1);
        assert!(out[0].resources.is_empty());
    }

    #[test]
    fn sotw_ack_advances_and_one_response_in_flight_per_type() {
        let mut world = World::new();
        let snap1 = world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let mut stream = SotwStream::new();
        let (out, _) = stream.on_request(&sotw(CDS, &[], "", ""), &snap1);
        let cds1 = out.into_iter().next().unwrap();
        assert_eq!(cds1.resources.len(), 1);

        // A change while CDS is un-ACKed waits for the ACK.
        let snap2 = world.set("/foo/other", Protocol::Http, &["10.0.0.2:8080"]);
        assert!(
            stream.on_snapshot(&snap2).is_empty(),
            "second CDS before the first was ACKed"
        );

        let (out, events) = stream.on_request(&ack(&cds1, &[]), &snap2);
        assert!(
            matches!(&events[..], [Event::Ack { kind: ResourceType::Cluster, version }] if *version == cds1.version_info)
        );
        assert_eq!(
            stream.acked(ResourceType::Cluster),
            Some(cds1.version_info.as_str())
        );
        assert_eq!(out.len(), 1, "the pending change goes out after the ACK");
        assert_eq!(out[0].resources.len(), 2);
        assert_ne!(out[0].version_info, cds1.version_info);
    }

    #[test]
    fn sotw_nack_keeps_last_good_and_is_not_answered_with_the_same_content() {
        let mut world = World::new();
        let snap = world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let mut stream = SotwStream::new();
        let (out, _) = stream.on_request(&sotw(CDS, &[], "", ""), &snap);
        let cds1 = &out[0];
        stream.on_request(&ack(cds1, &[]), &snap);

        let snap2 = world.set("/foo/bar/buzz", Protocol::Grpc, &["10.0.0.1:8080"]);
        let out = stream.on_snapshot(&snap2);
        let cds2 = &out[0];
        let (out, events) = stream.on_request(
            &nack(sotw(CDS, &[], &cds1.version_info, &cds2.nonce)),
            &snap2,
        );
        assert!(
            out.is_empty(),
            "NACKed content must not be sent again: {out:?}"
        );
        assert!(matches!(&events[..], [Event::Nack { error, .. }] if error == "bad cluster"));
        assert_eq!(
            stream.acked(ResourceType::Cluster),
            Some(cds1.version_info.as_str())
        );
        assert!(stream.on_snapshot(&snap2).is_empty());

        // New content does go out.
        let snap3 = world.set("/foo/bar/buzz", Protocol::Tcp, &["10.0.0.1:8080"]);
        assert_eq!(stream.on_snapshot(&snap3).len(), 1);
    }

    #[test]
    fn sotw_stale_nonce_is_ignored() {
        let mut world = World::new();
        let snap = world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let mut stream = SotwStream::new();
        let (out, _) = stream.on_request(&sotw(CDS, &[], "", ""), &snap);
        let first = out[0].clone();
        stream.on_request(&ack(&first, &[]), &snap);
        let snap2 = world.set("/foo/x", Protocol::Http, &["10.0.0.3:8080"]);
        let second = stream.on_snapshot(&snap2).remove(0);
        // An old nonce: neither an ACK of the second response nor a reason to answer.
        let (out, events) = stream.on_request(&ack(&first, &[]), &snap2);
        assert!(out.is_empty());
        assert!(matches!(&events[..], [Event::StaleNonce { .. }]));
        assert_eq!(
            stream.acked(ResourceType::Cluster),
            Some(first.version_info.as_str())
        );
        let (_, events) = stream.on_request(&ack(&second, &[]), &snap2);
        assert!(matches!(&events[..], [Event::Ack { .. }]));
    }

    #[test]
    fn sotw_eds_sends_only_requested_names_and_follows_subscription_changes() {
        let mut world = World::new();
        world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let snap = world.set("/foo/other", Protocol::Http, &["10.0.0.2:8080"]);
        let mut stream = SotwStream::new();
        let (out, _) = stream.on_request(&sotw(EDS, &[BUZZ], "", ""), &snap);
        assert_eq!(out[0].resources.len(), 1);
        let (out, _) = stream.on_request(
            &ack(&out[0], &[BUZZ, "other.foo.system.internal|8080"]),
            &snap,
        );
        assert_eq!(out.len(), 1, "a new subscription is answered");
        assert_eq!(
            assignments(&out[0]),
            ["other.foo.system.internal|8080"],
            "endpoints go out by change: only the new name"
        );
        // Dropping a name needs no answer; the dropped name is no longer pushed.
        let (out, _) = stream.on_request(&ack(&out[0], &[BUZZ]), &snap);
        assert!(out.is_empty(), "{out:?}");
        let snap2 = world.set("/foo/other", Protocol::Http, &["10.0.0.3:8080"]);
        assert!(stream.on_snapshot(&snap2).is_empty());
    }

    #[test]
    fn sotw_pushes_in_cds_eds_lds_rds_order_and_resends_endpoints_after_a_cluster_change() {
        let mut world = World::new();
        // Another HTTP service keeps the route configuration alive (and changing) throughout.
        world.set("/foo/web", Protocol::Http, &["10.0.0.8:8080"]);
        let snap = world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let mut stream = SotwStream::new();
        let mut last: HashMap<&str, DiscoveryResponse> = HashMap::new();
        for (url, names) in [
            (CDS, vec![]),
            (EDS, vec![BUZZ]),
            (LDS, vec![]),
            (RDS, vec!["http.8080"]),
        ] {
            let (out, _) = stream.on_request(&sotw(url, &names, "", ""), &snap);
            let response = out.into_iter().next().unwrap();
            stream.on_request(&ack(&response, &names), &snap);
            last.insert(url, response);
        }
        // The cluster changes shape (HTTP → HTTP/2) but its endpoints do not.
        let snap2 = world.set("/foo/bar/buzz", Protocol::Http2, &["10.0.0.1:8080"]);
        let out = stream.on_snapshot(&snap2);
        let urls: Vec<&str> = out.iter().map(|r| r.type_url.as_str()).collect();
        assert_eq!(
            urls,
            [CDS, EDS],
            "CDS first, then the unchanged endpoints again"
        );
        assert_eq!(out[1].version_info, last[EDS].version_info);

        // The service turns TCP and moves to an address of its own: CDS, EDS, LDS and RDS all
        // change, and go out in order.
        for r in &out {
            let names: &[&str] = if r.type_url == EDS { &[BUZZ] } else { &[] };
            stream.on_request(&ack(r, names), &snap2);
        }
        let snap3 = world.set("/foo/bar/buzz", Protocol::Tcp, &["10.0.0.9:8080"]);
        let urls: Vec<String> = stream
            .on_snapshot(&snap3)
            .into_iter()
            .map(|r| r.type_url)
            .collect();
        assert_eq!(urls, [CDS, EDS, LDS, RDS]);
    }

    fn delta(
        type_url: &str,
        subscribe: &[&str],
        unsubscribe: &[&str],
        nonce: &str,
    ) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            type_url: type_url.to_string(),
            resource_names_subscribe: subscribe.iter().map(|s| s.to_string()).collect(),
            resource_names_unsubscribe: unsubscribe.iter().map(|s| s.to_string()).collect(),
            response_nonce: nonce.to_string(),
            ..DeltaDiscoveryRequest::default()
        }
    }

    fn names(response: &DeltaDiscoveryResponse) -> Vec<&str> {
        response.resources.iter().map(|r| r.name.as_str()).collect()
    }

    /// A mesh whose endpoints add up to more than one response's budget.
    fn big_world() -> (World, XdsSnapshot) {
        let mut world = World::new();
        let endpoints: Vec<String> = (0..200)
            .map(|i| format!("10.1.{}.{}:8080", i / 250, i % 250))
            .collect();
        let endpoints: Vec<&str> = endpoints.iter().map(String::as_str).collect();
        for k in 0..150 {
            world.set(&format!("/big/s{k}"), Protocol::Http, &endpoints);
        }
        let snap = world.snapshot();
        let total: usize = snap
            .of(ResourceType::Endpoint)
            .values()
            .map(|r| r.body.value.len())
            .sum();
        assert!(
            total > 2 * RESPONSE_BUDGET,
            "the mesh is too small: {total} bytes"
        );
        (world, snap)
    }

    #[test]
    fn delta_splits_a_large_response_and_sends_the_rest_after_the_ack() {
        let (_world, snap) = big_world();
        let mut stream = DeltaStream::new();
        let (mut out, _) = stream.on_request(&delta(EDS, &["*"], &[], ""), &snap);
        let mut got = BTreeSet::new();
        while let Some(response) = out.pop() {
            let bytes: usize = response
                .resources
                .iter()
                .map(|r| r.resource.as_ref().unwrap().value.len())
                .sum();
            assert!(bytes <= RESPONSE_BUDGET, "{bytes} bytes in one response");
            assert!(!response.resources.is_empty());
            got.extend(names(&response).into_iter().map(str::to_string));
            (out, _) = stream.on_request(&delta(EDS, &[], &[], &response.nonce), &snap);
        }
        let all: BTreeSet<String> = snap
            .of(ResourceType::Endpoint)
            .keys()
            .map(|k| k.to_string())
            .collect();
        assert_eq!(got, all);
    }

    #[test]
    fn sotw_splits_large_endpoint_responses_and_sends_the_rest_after_the_ack() {
        let (_world, snap) = big_world();
        let names: Vec<String> = snap
            .of(ResourceType::Endpoint)
            .keys()
            .map(|k| k.to_string())
            .collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut stream = SotwStream::new();
        let (mut out, _) = stream.on_request(&sotw(EDS, &names, "", ""), &snap);
        let mut got = BTreeSet::new();
        let mut responses = 0;
        while let Some(response) = out.pop() {
            responses += 1;
            let bytes: usize = response.resources.iter().map(|r| r.value.len()).sum();
            assert!(bytes <= RESPONSE_BUDGET, "{bytes} bytes in one response");
            got.extend(assignments(&response));
            (out, _) = stream.on_request(&ack(&response, &names), &snap);
        }
        assert!(responses > 2);
        assert_eq!(got.len(), names.len());
    }

    #[test]
    fn delta_sends_only_changes_and_removals() {
        let mut world = World::new();
        world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let snap = world.set("/foo/other", Protocol::Http, &["10.0.0.2:8080"]);
        let mut stream = DeltaStream::new();
        let (out, _) = stream.on_request(&delta(CDS, &[], &[], ""), &snap);
        assert_eq!(out[0].resources.len(), 2, "legacy wildcard gets everything");
        stream.on_request(&delta(CDS, &[], &[], &out[0].nonce), &snap);

        // An endpoint change touches no cluster: nothing for CDS.
        let snap2 = world.set(
            "/foo/bar/buzz",
            Protocol::Http,
            &["10.0.0.1:8080", "10.0.0.5:8080"],
        );
        assert!(stream.on_snapshot(&snap2).is_empty());

        // A new service is sent alone; a removed one is named in removed_resources.
        let snap3 = world.set("/foo/third", Protocol::Http, &["10.0.0.3:8080"]);
        let out = stream.on_snapshot(&snap3);
        assert_eq!(names(&out[0]), ["third.foo.system.internal|8080"]);
        stream.on_request(&delta(CDS, &[], &[], &out[0].nonce), &snap3);
        let snap4 = world.remove("/foo/other");
        let out = stream.on_snapshot(&snap4);
        assert!(out[0].resources.is_empty());
        assert_eq!(out[0].removed_resources, ["other.foo.system.internal|8080"]);
    }

    #[test]
    fn delta_honours_subscriptions_and_reports_absent_names() {
        let mut world = World::new();
        world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let snap = world.set("/foo/other", Protocol::Http, &["10.0.0.2:8080"]);
        let mut stream = DeltaStream::new();
        let (out, _) = stream.on_request(&delta(EDS, &[BUZZ, "missing|1"], &[], ""), &snap);
        assert_eq!(names(&out[0]), [BUZZ]);
        assert_eq!(out[0].removed_resources, ["missing|1"]);
        stream.on_request(&delta(EDS, &[], &[], &out[0].nonce), &snap);

        // Unsubscribed names are no longer pushed when they change.
        stream.on_request(&delta(EDS, &[], &[BUZZ], ""), &snap);
        let snap2 = world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.7:8080"]);
        assert!(stream.on_snapshot(&snap2).is_empty());

        // Explicit wildcard subscription brings in everything not yet known.
        let (out, _) = stream.on_request(&delta(EDS, &["*"], &[], ""), &snap2);
        let mut got = names(&out[0]);
        got.sort();
        assert_eq!(got, [BUZZ, "other.foo.system.internal|8080"]);
    }

    #[test]
    fn delta_reconnect_uses_initial_resource_versions() {
        let mut world = World::new();
        world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let snap = world.set("/foo/other", Protocol::Http, &["10.0.0.2:8080"]);
        let clusters = snap.of(ResourceType::Cluster);
        let mut request = delta(CDS, &[], &[], "");
        request.initial_resource_versions = HashMap::from([
            (BUZZ.to_string(), clusters[BUZZ].version_string()),
            (
                "other.foo.system.internal|8080".to_string(),
                "stale".to_string(),
            ),
            ("gone|1".to_string(), "v".to_string()),
        ]);
        let mut stream = DeltaStream::new();
        let (out, _) = stream.on_request(&request, &snap);
        assert_eq!(
            names(&out[0]),
            ["other.foo.system.internal|8080"],
            "only what differs"
        );
        assert_eq!(out[0].removed_resources, ["gone|1"]);
    }

    #[test]
    fn delta_nack_is_not_looped_and_stale_nonce_still_updates_subscriptions() {
        let mut world = World::new();
        let snap = world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let mut stream = DeltaStream::new();
        let (out, _) = stream.on_request(&delta(CDS, &[], &[], ""), &snap);
        let mut rejected = delta(CDS, &[], &[], &out[0].nonce);
        rejected.error_detail = Some(RpcStatus {
            code: 3,
            message: "no".to_string(),
            details: Vec::new(),
        });
        let (again, events) = stream.on_request(&rejected, &snap);
        assert!(
            again.is_empty(),
            "the same resources must not be re-sent after a NACK"
        );
        assert!(matches!(&events[..], [Event::Nack { .. }]));
        assert!(stream.on_snapshot(&snap).is_empty());

        let (out, _) = stream.on_request(&delta(EDS, &[BUZZ], &[], ""), &snap);
        let pending = out[0].nonce.clone();
        // A request with an old nonce still changes subscriptions (delta requests are
        // incremental), but does not ACK the pending response.
        let (out, events) = stream.on_request(&delta(EDS, &[], &[BUZZ], "stale"), &snap);
        assert!(out.is_empty());
        assert!(matches!(&events[..], [Event::StaleNonce { .. }]));
        stream.on_request(&delta(EDS, &[], &[], &pending), &snap);
        assert!(
            stream.holds(ResourceType::Endpoint, BUZZ).is_none(),
            "the unsubscribe in the stale-nonce request must stick"
        );
    }

    #[test]
    fn delta_resends_endpoints_of_a_changed_cluster() {
        let mut world = World::new();
        let snap = world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let mut stream = DeltaStream::new();
        let (out, _) = stream.on_request(&delta(CDS, &[], &[], ""), &snap);
        stream.on_request(&delta(CDS, &[], &[], &out[0].nonce), &snap);
        let (out, _) = stream.on_request(&delta(EDS, &[BUZZ], &[], ""), &snap);
        stream.on_request(&delta(EDS, &[], &[], &out[0].nonce), &snap);

        let snap2 = world.set("/foo/bar/buzz", Protocol::Grpc, &["10.0.0.1:8080"]);
        let out = stream.on_snapshot(&snap2);
        let urls: Vec<&str> = out.iter().map(|r| r.type_url.as_str()).collect();
        assert_eq!(urls, [CDS, EDS]);
        assert_eq!(names(&out[1]), [BUZZ]);
    }

    #[test]
    fn delta_changes_made_while_a_response_is_in_flight_go_out_after_its_ack() {
        let mut world = World::new();
        let snap = world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let mut stream = DeltaStream::new();
        let (out, _) = stream.on_request(&delta(EDS, &[BUZZ], &[], ""), &snap);
        let pending = out[0].nonce.clone();
        // Two changes while the first response is un-ACKed: nothing goes out yet.
        let snap2 = world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.2:8080"]);
        assert!(stream.on_snapshot(&snap2).is_empty());
        let snap3 = world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.3:8080"]);
        assert!(stream.on_snapshot(&snap3).is_empty());
        let (out, _) = stream.on_request(&delta(EDS, &[], &[], &pending), &snap3);
        assert_eq!(names(&out[0]), [BUZZ]);
        assert_eq!(
            out[0].resources[0].version,
            snap3.of(ResourceType::Endpoint)[BUZZ].version_string(),
            "the latest version, not an intermediate one"
        );
        stream.on_request(&delta(EDS, &[], &[], &out[0].nonce), &snap3);
        assert!(
            stream.on_snapshot(&snap3).is_empty(),
            "nothing left to send"
        );
    }
}
