//! The state-of-the-world ADS machine (`StreamAggregatedResources`): every response of a type
//! carries a version for the client's whole view of that type (its digest, see
//! [`super::held`]). Clusters and listeners go out whole, endpoints and routes by change (see
//! [`super::stream`] for the rules both flavours keep).

use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use envoy_types::pb::envoy::config::core::v3::Node;

use super::held::ClientView;
use super::inbound::Presized;
use super::interest::Subscription;
use super::response::SotwResponse;
use super::snapshot::{
    NameSet, ResourceMap, ResourceType, TYPES, XdsResource, XdsSnapshot, entry_hash,
    format_version, parse_version,
};
use super::stream::{
    Ads, Delivery, Event, Flavour, Limits, Push, TypeDiff, TypeState, Types, nonce, too_many,
};
use super::wire::{NameList, SotwRequest};

/// What a SotW stream keeps per type beside [`TypeState`].
#[derive(Debug, Default)]
struct SotwExtra {
    /// The nonce of the last response of this type: a request that names it is current (an
    /// ACK or NACK while the response is in flight, a subscription update after).
    last_nonce: Option<String>,
    /// Of the names of the last request (see [`NameList::fingerprint`]).
    names_fingerprint: Option<(u64, usize)>,
    /// The version of this type the client holds: the one it reconnected with, or of the
    /// last response it acknowledged.
    held_version: String,
    /// A type sent by change: the stamp of its last response (see [`basis_of`]).
    stamped: String,
}

/// One `StreamAggregatedResources` stream.
#[derive(Debug, Default)]
pub struct SotwStream {
    pub(super) common: Types,
    extra: [SotwExtra; TYPES],
}

impl Ads for SotwStream {
    type Request = SotwRequest;
    type Response = SotwResponse;
    type Decoder = Presized<SotwRequest>;
    const MODE: &'static str = "sotw";

    fn new(limits: Limits) -> Self {
        SotwStream {
            common: Types::new(limits),
            extra: Default::default(),
        }
    }

    fn node(request: &SotwRequest) -> Option<&Node> {
        request.node.as_ref()
    }

    fn on_request(
        &mut self,
        request: &SotwRequest,
        snapshot: &XdsSnapshot,
    ) -> (Vec<Push<SotwResponse>>, Vec<Event>) {
        let Some(kind) = ResourceType::from_type_url(&request.type_url) else {
            let event = Event::UnknownType {
                type_url: request.type_url.clone(),
            };
            return (Vec::new(), vec![event]);
        };
        let limits = self.common.limits;
        if let Some(exhausted) = too_many(kind, request.resource_names.len(), limits) {
            return (Vec::new(), vec![exhausted]);
        }
        let mut events = Vec::new();
        let mut answered = None;
        let nonce = request.response_nonce.as_str();
        if !nonce.is_empty() {
            let stale = self.extra[kind.index()].last_nonce.as_deref() != Some(nonce);
            if stale {
                // It answers a response already superseded (Envoy sends a fresh request after
                // it handles the newer one). Its names still say what the client subscribes
                // to now: a name it dropped meanwhile, it holds no more, even if the next
                // request names it again.
                events.push(Event::StaleNonce {
                    kind,
                    nonce: nonce.to_string(),
                });
            }
            let state = self.common.of(kind);
            if !stale && state.in_flight.as_ref().is_some_and(|d| d.nonce == nonce) {
                let accepted = request.error_detail.is_none();
                let delivery = if accepted {
                    self.common.accept(kind, snapshot)
                } else {
                    self.common.reject(kind)
                };
                if let Some(delivery) = delivery {
                    if accepted {
                        self.extra[kind.index()].held_version = delivery.version.clone();
                    }
                    events.push(match &request.error_detail {
                        Some(status) => Event::Nack {
                            kind,
                            version: delivery.version.clone(),
                            error: status.message.clone(),
                        },
                        None => Event::Ack {
                            kind,
                            version: request.version_info.clone(),
                        },
                    });
                    answered = Some((delivery, accepted));
                }
            }
        }
        let first = !self.common.of(kind).requested;
        let state = self.common.of(kind);
        if first {
            // Always answer the first request of a type on a stream (but see `adopt_held`).
            state.requested = true;
            state.must_answer = true;
        }
        let extra = &mut self.extra[kind.index()];
        set_interest(state, extra, kind, &request.resource_names, snapshot, first);
        // What the response carried is settled by what the client names now: an endpoint it
        // stopped subscribing to before the response came, it dropped.
        if let Some((delivery, accepted)) = answered {
            self.common.answered(kind, &delivery, accepted);
        }
        let reconnect = first && nonce.is_empty() && !request.version_info.is_empty();
        if reconnect {
            self.common.reconnected = true;
            // None while it is on its way, or not known (not asked for on this stream yet).
            let basis = basis_of(kind).and_then(|basis| {
                let in_flight = self.common.of(basis).in_flight.is_some();
                let held = &self.extra[basis.index()].held_version;
                (!in_flight && !held.is_empty()).then(|| held.clone())
            });
            let state = self.common.of(kind);
            let held = Held {
                version: &request.version_info,
                basis: basis.as_deref(),
            };
            let adopted = adopt_held(state, kind, held, snapshot);
            if adopted {
                self.extra[kind.index()].held_version = request.version_info.clone();
            }
            if kind == ResourceType::Cluster && !adopted {
                self.common.clusters_unknown = true;
            }
        }
        if kind == ResourceType::Endpoint {
            if first {
                self.common.endpoints_requested();
            }
            self.common.endpoints_asked();
        }
        let state = self.common.of(kind);
        if let Err(exhausted) = state.check_names(kind, limits) {
            events.push(exhausted);
            return (Vec::new(), events);
        }
        (self.push(snapshot), events)
    }

    fn on_snapshot(&mut self, snapshot: &XdsSnapshot) -> Vec<Push<SotwResponse>> {
        self.push(snapshot)
    }

    fn holds(&self, snapshot: &XdsSnapshot) -> bool {
        self.common.holds(snapshot)
    }
}

impl SotwStream {
    fn push(&mut self, snapshot: &XdsSnapshot) -> Vec<Push<SotwResponse>> {
        let mut found = self.common.plan(snapshot, Flavour::Sotw);
        let mut out = Vec::new();
        for kind in ResourceType::ALL {
            let Some(found) = found[kind.index()].take() else {
                continue;
            };
            let whole = kind.is_state_of_the_world();
            // The stamp a response of a type sent by change carries: the version of the
            // clusters (listeners) the client holds. Not of those on their way: what they
            // drop (the endpoints of a cluster they re-create) the digest counts until their
            // ACK, so the client holding them says nothing of this digest.
            let stamp = basis_of(kind).map(|basis| &self.extra[basis.index()].held_version);
            // Once the client holds other clusters (listeners), an empty response says the
            // digest holds with them: a restart then finds it current (see `adopt_held`).
            let restamp = stamp.is_some_and(|stamp| {
                !stamp.is_empty() && *stamp != self.extra[kind.index()].stamped
            });
            // Without removals in the protocol, a type sent by change has nothing to say when
            // its resources only went away (Envoy drops them with their cluster or listener).
            let state = self.common.of(kind);
            if found.changed.is_empty()
                && found.removed.is_empty()
                && !state.must_answer
                && !restamp
            {
                continue;
            }
            let state = self.common.of(kind);
            let (resources, delivery) = if whole {
                whole_response(state, kind, snapshot, &found)
            } else {
                let digest = format_version(state.client.digest_after(&found.changed, []));
                let stamp = stamp.cloned().unwrap_or_default();
                let version = format!("{digest}{STAMP}{stamp}");
                self.extra[kind.index()].stamped = stamp;
                let state = self.common.of(kind);
                let delivery = Delivery {
                    nonce: String::new(),
                    listed: found.changed.clone(),
                    removed: Vec::new(),
                    whole: None,
                    narrowings: state.interest.narrowings(),
                    version,
                };
                (found.changed, delivery)
            };
            let nonce = nonce(&mut self.common.nonces);
            let version = delivery.version.clone();
            let state = self.common.of(kind);
            state.in_flight = Some(Delivery {
                nonce: nonce.clone(),
                ..delivery
            });
            state.must_answer = false;
            self.extra[kind.index()].last_nonce = Some(nonce.clone());
            out.push(Push {
                kind,
                response: SotwResponse {
                    version_info: version,
                    resources,
                    type_url: kind.type_url().to_string(),
                    nonce,
                },
            });
        }
        out
    }
}

/// A whole type's response: every resource the client wants, but that a version it refused is
/// replaced by the one it holds (or left out), and with the resources whose removal waits
/// (`found.deferred`, make before break) kept in. Its delivery says what the client then holds.
fn whole_response(
    state: &TypeState,
    kind: ResourceType,
    snapshot: &XdsSnapshot,
    found: &TypeDiff,
) -> (Vec<Arc<XdsResource>>, Delivery) {
    let current = snapshot.of(kind);
    let interest = &state.interest;
    let mut resources = Vec::with_capacity(current.len() + found.deferred.len());
    let mut substituted = false;
    for (name, resource) in current {
        if !interest.wants(name) {
            continue;
        }
        if state.rejected.get(name) == Some(&resource.version) {
            substituted = true;
            resources.extend(state.client.get(name).cloned());
        } else {
            resources.push(resource.clone());
        }
    }
    let kept = found
        .deferred
        .iter()
        .filter_map(|name| state.client.get(name));
    resources.extend(kept.cloned());
    let exact = interest.wildcard && !substituted && found.deferred.is_empty();
    let (whole, digest, removed) = if exact {
        let all = snapshot.whole(kind);
        (Some((current.clone(), all)), all.digest, Vec::new())
    } else {
        resources.sort_by(|a, b| a.name.cmp(&b.name));
        let digest = resources
            .iter()
            .fold(0, |digest, r| digest ^ entry_hash(&r.name, r.version));
        let sent: NameSet = resources.iter().map(|r| r.name.clone()).collect();
        let removed = state
            .client
            .names()
            .filter(|name| !sent.contains(*name))
            .cloned()
            .collect();
        (None, digest, removed)
    };
    let delivery = Delivery {
        nonce: String::new(),
        // The map in `whole` says what it carries.
        listed: if whole.is_some() {
            Vec::new()
        } else {
            resources.clone()
        },
        removed,
        whole,
        narrowings: state.interest.narrowings(),
        version: format!("{}{STAMP}{}", format_version(digest), made_at(current)),
    };
    (resources, delivery)
}

/// Between a version's digest and its stamp: for a whole type when its resources were made
/// ([`made_at`]), for a type sent by change the version of its basis ([`basis_of`]).
const STAMP: char = '.';

/// When the snapshot's map a whole type's response was made from was made: this process's
/// random epoch and a count of the maps it stamped. The same content made again (a cluster
/// changed and changed back is a new map) gets another stamp, as a stamp of its basis needs;
/// while every stream sent the same content from the very same map sends the same version,
/// whatever snapshot it was sent at, so they share its encoding
/// ([`super::response::SharedHeads`]) and an unchanged type keeps its version across
/// snapshots. (A response that is not the map itself, with a removal held back or a refused
/// version replaced, differs from it by its digest; from one map to the next, what it holds
/// back only goes.) The last few maps are kept to be recognised: a clone of a persistent map,
/// which shares its nodes.
fn made_at(map: &ResourceMap) -> String {
    const KEPT: usize = 8;
    static EPOCH: LazyLock<u32> =
        LazyLock::new(|| std::hash::RandomState::new().hash_one(0u8) as u32);
    static MADE: Mutex<(u64, VecDeque<(ResourceMap, u64)>)> = Mutex::new((0, VecDeque::new()));
    let mut made = MADE.lock().unwrap_or_else(PoisonError::into_inner);
    let (count, maps) = &mut *made;
    let known = maps.iter().find(|(kept, _)| kept.ptr_eq(map));
    let stamp = match known {
        Some((_, stamp)) => *stamp,
        None => {
            *count += 1;
            if maps.len() == KEPT {
                maps.pop_front();
            }
            maps.push_back((map.clone(), *count));
            *count
        }
    };
    format!("{:08x}-{stamp:x}", *EPOCH)
}

/// What a type sent by change depends on: Envoy drops an assignment when its cluster goes or
/// is re-created, and a route configuration when no listener names it any more. Secrets are
/// named by clusters and listeners alike: with no one basis, a reconnecting client's are never
/// taken on their digest, and go out again (two small resources).
fn basis_of(kind: ResourceType) -> Option<ResourceType> {
    match kind {
        ResourceType::Endpoint => Some(ResourceType::Cluster),
        ResourceType::Route => Some(ResourceType::Listener),
        ResourceType::Cluster | ResourceType::Listener | ResourceType::Secret => None,
    }
}

/// What a reconnecting client says it holds of a type: the version it last accepted, and, for
/// a type sent by change, the version of its basis it holds (none while one is on its way).
struct Held<'a> {
    version: &'a str,
    basis: Option<&'a str>,
}

/// A client that reconnects (to this agent after a restart, or to another agent of the same
/// build) sends the version it last accepted. Versions are digests of what a client holds, so
/// when it equals the digest of what the client wants now, the client already holds exactly
/// that: nothing is re-sent, and a whole type (clusters, listeners) is not answered at all (a
/// response would have to repeat every resource), as control planes do when the client is up
/// to date. Whether the client was found to hold what it wants.
///
/// Types sent by change are taken on their digest too, with a proviso. Envoy drops what it
/// stops subscribing to without changing the version it reports (an assignment when its
/// cluster goes or is re-created, a route configuration when no listener names it), so the
/// digest says what it held when it last accepted, not what it holds now. What makes it drop
/// them comes with clusters or listeners, though, so each of their responses is stamped with
/// the version of the clusters (listeners) it was sent after, and these versions differ
/// whenever their content was made again (see [`made_at`]): the digest is taken only when
/// the client still holds the very clusters (listeners) it held then, so it dropped nothing
/// since.
fn adopt_held(
    state: &mut TypeState,
    kind: ResourceType,
    held: Held<'_>,
    snapshot: &XdsSnapshot,
) -> bool {
    let Some((digest, stamp)) = held.version.split_once(STAMP) else {
        return false;
    };
    let based = match held.basis {
        _ if kind.is_state_of_the_world() => true,
        Some(basis) => stamp == basis,
        None => false,
    };
    if !based || parse_version(digest).is_none() {
        return false;
    }
    let interest = &state.interest;
    // Usually the client wants the whole type (Envoy subscribes to the endpoints of every
    // cluster it has, which `set_interest` has just held as the snapshot's index): then what
    // it should hold is the snapshot's map itself, whose digest is computed once per
    // snapshot, not once per stream.
    let wanted = if interest.wildcard || interest.names.is_all_of(snapshot.name_index(kind)) {
        ClientView::whole(snapshot.of(kind), snapshot.whole(kind))
    } else {
        let current = snapshot.names(kind, interest.names.len());
        let mut wanted = ClientView::default();
        for resource in interest.names.iter().filter_map(|n| current.get(n)) {
            wanted.insert(resource.clone());
        }
        wanted
    };
    if wanted.version_info() != digest {
        return false;
    }
    state.client = wanted;
    state.dirty.clear();
    state.backlog.clear();
    state.must_answer = !kind.is_state_of_the_world();
    true
}

/// Takes a SotW request's names as the type's subscription. Envoy repeats the whole list on every request (ten thousand names on each endpoint
/// ACK at that scale), so the usual case, the same list as last time, is recognised by its
/// fingerprint (a hash of the names' bytes as they came, see [`super::wire`]) without a lookup
/// per name; the same names in another order are compared name by name below.
fn set_interest(
    state: &mut TypeState,
    extra: &mut SotwExtra,
    kind: ResourceType,
    names: &NameList,
    snapshot: &XdsSnapshot,
    first: bool,
) {
    let fingerprint = names.fingerprint();
    if extra.names_fingerprint == Some(fingerprint) {
        return;
    }
    extra.names_fingerprint = Some(fingerprint);
    let stars = names.iter().filter(|n| *n == "*").count();
    // An empty list subscribes to a whole type only while the client has named nothing on
    // this stream (see `super::interest`); after that it means no interest.
    let legacy =
        (first || state.interest.legacy) && names.is_empty() && kind.is_wildcard_by_default();
    let wildcard = stars > 0 || legacy;
    let named = || names.iter().filter(|n| *n != "*");
    let named_count = names.len() - stars;
    let interest = &mut state.interest;
    interest.legacy = legacy;
    // A list with duplicates could pass this check while dropping a name; Envoy sends sets,
    // and the cost of a miss is only that a dropped name keeps being sent.
    if wildcard == interest.wildcard
        && named_count == interest.names.len()
        && named().all(|n| interest.names.contains(n))
    {
        return;
    }
    let listed = named().map(|name| (name, None));
    let fresh = match snapshot.every_resource(kind, named_count, listed) {
        // Every name of the type (Envoy's subscription to the endpoints of all its clusters):
        // the snapshot's index, shared.
        Some(index) => Subscription::whole(index.clone()),
        None => {
            let current = snapshot.names(kind, names.len());
            // Sized up front: collected from a filter, the set would grow by rehashing.
            let mut fresh = NameSet::with_capacity_and_hasher(names.len(), Default::default());
            for name in named() {
                let name = match interest.names.get(name) {
                    Some(held) => held.clone(),
                    None => state.unknown.intern(&current, name),
                };
                fresh.insert(name);
            }
            fresh.into_iter().collect()
        }
    };
    // Without a baseline the next push looks at everything anyway (see `look_again`), so the
    // new names are only told apart from none: a first subscription to every assignment of a
    // 50k-service mesh would otherwise clone each name's `Arc`, and drop it again.
    let queued = state.baseline.is_some() && wildcard == interest.wildcard;
    let (added, any_added): (Vec<Arc<str>>, bool) = if queued {
        let added: Vec<Arc<str>> = fresh
            .iter()
            .filter(|n| !interest.names.contains(n))
            .cloned()
            .collect();
        let any = !added.is_empty();
        (added, any)
    } else {
        (
            Vec::new(),
            fresh.iter().any(|n| !interest.names.contains(n)),
        )
    };
    let dropped: Vec<Arc<str>> = interest
        .names
        .iter()
        .filter(|n| !fresh.contains(n))
        .cloned()
        .collect();
    let was_wildcard = interest.wildcard;
    if wildcard != was_wildcard {
        state.baseline = None;
    }
    if !dropped.is_empty() || (was_wildcard && !wildcard) {
        interest.narrowed();
    }
    interest.wildcard = wildcard;
    interest.names = fresh;
    // A type sent by change loses what the client stopped naming: Envoy drops a resource it no
    // longer watches. A whole type holds what its responses carry (the next one is due).
    if !kind.is_state_of_the_world() {
        let mut unwanted = dropped;
        if was_wildcard && !wildcard {
            let interest = &state.interest;
            unwanted.extend(state.client.names().filter(|n| !interest.wants(n)).cloned());
        }
        for name in unwanted {
            if !state.interest.wants(&name) {
                state.forget(&name);
            }
        }
    }
    // A changed subscription is answered: whole types always, the others when names were added.
    state.must_answer |= kind.is_state_of_the_world() || any_added;
    for name in added {
        state.look_again(name);
    }
}
#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, HashMap};

    use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
    use envoy_types::pb::google::rpc::Status as RpcStatus;
    use prost::Message;

    use super::*;
    use crate::mesh::Protocol;
    use crate::xds::stream::RESPONSE_BUDGET;
    use crate::xds::testing::{
        BUZZ, CDS, EDS, LDS, OTHER, RDS, Tested, World, big_world, names_of, sotw,
    };

    fn nack(mut request: SotwRequest) -> SotwRequest {
        request.error_detail = Some(RpcStatus {
            code: 3,
            message: "bad cluster".to_string(),
            details: Vec::new(),
        });
        request
    }

    fn ack(response: &SotwResponse, names: &[&str]) -> SotwRequest {
        sotw(
            &response.type_url,
            names,
            &response.version_info,
            &response.nonce,
        )
    }

    /// The cluster names of the assignments in a SotW EDS response.
    fn assignments(response: &SotwResponse) -> Vec<String> {
        response
            .resources
            .iter()
            .map(|r| {
                ClusterLoadAssignment::decode(r.body.value.as_slice())
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
        let mut stream = Tested::<SotwStream>::default();
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

    /// A stream whose client holds buzz and other, their clusters and endpoints acknowledged:
    /// the world, the snapshot, the stream, and the versions it holds of clusters and endpoints.
    fn holding_two() -> (World, XdsSnapshot, Tested<SotwStream>, String, String) {
        let mut world = World::new();
        world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let snap = world.set("/foo/other", Protocol::Http, &["10.0.0.2:8080"]);
        let mut stream = Tested::<SotwStream>::default();
        let (cds, _) = stream.on_request(&sotw(CDS, &[], "", ""), &snap);
        stream.on_request(&ack(&cds[0], &[]), &snap);
        let (eds, _) = stream.on_request(&sotw(EDS, &[BUZZ, OTHER], "", ""), &snap);
        stream.on_request(&ack(&eds[0], &[BUZZ, OTHER]), &snap);
        let (cds_version, eds_version) = (cds[0].version_info.clone(), eds[0].version_info.clone());
        (world, snap, stream, cds_version, eds_version)
    }

    /// After an agent restart (a new stream, the same snapshot), a client that says which
    /// versions it holds gets nothing again: no clusters, and its endpoints answered empty
    /// (the first request of a type always is); one that holds something else gets it all.
    #[test]
    fn sotw_reconnect_with_the_versions_held_resends_nothing() {
        let (mut world, snap, _, cds_version, eds_version) = holding_two();
        let (cds_version, eds_version) = (&cds_version, &eds_version);

        let mut again = Tested::<SotwStream>::default();
        let (out, _) = again.on_request(&sotw(CDS, &[], cds_version, ""), &snap);
        assert!(out.is_empty(), "clusters held whole: no answer");
        let (out, _) = again.on_request(&sotw(EDS, &[BUZZ, OTHER], eds_version, ""), &snap);
        assert_eq!(out.len(), 1, "endpoints are answered");
        assert!(out[0].resources.is_empty(), "with nothing: it holds them");
        assert_eq!(&out[0].version_info, eds_version);
        // And it goes on from there: a change sends that change only.
        again.on_request(&ack(&out[0], &[BUZZ, OTHER]), &snap);
        let snap2 = world.set("/foo/other", Protocol::Http, &["10.0.0.3:8080"]);
        let out = again.on_snapshot(&snap2);
        assert_eq!(out.len(), 1);
        assert_eq!(assignments(&out[0]), [OTHER]);

        // Versions held of another mesh (endpoints changed while it was away), or of one
        // name fewer: everything it wants, as on a first connect.
        let mut stale = Tested::<SotwStream>::default();
        stale.on_request(&sotw(CDS, &[], cds_version, ""), &snap2);
        let (out, _) = stale.on_request(&sotw(EDS, &[BUZZ, OTHER], eds_version, ""), &snap2);
        assert_eq!(assignments(&out[0]), [BUZZ, OTHER]);
        let mut fewer = Tested::<SotwStream>::default();
        fewer.on_request(&sotw(CDS, &[], cds_version, ""), &snap);
        let (out, _) = fewer.on_request(&sotw(EDS, &[BUZZ], eds_version, ""), &snap);
        assert_eq!(assignments(&out[0]), [BUZZ]);
        let mut foreign = Tested::<SotwStream>::default();
        let (out, _) = foreign.on_request(&sotw(CDS, &[], "v1", ""), &snap);
        assert_eq!(out[0].resources.len(), 2);
    }

    /// Endpoints are taken on their digest only with the clusters they were sent after: a
    /// client whose clusters were sent again on this stream, or changed since its endpoints
    /// came (Envoy re-creates a changed cluster and drops its endpoints), gets them all.
    #[test]
    fn sotw_reconnect_resends_endpoints_unless_their_clusters_are_held_as_they_were() {
        let (mut world, _, mut stream, cds_version, eds_version) = holding_two();
        let eds_version = &eds_version;
        // The cluster changes shape, the client takes it; the agent dies before the endpoints
        // go again.
        let snap2 = world.set("/foo/other", Protocol::Http2, &["10.0.0.2:8080"]);
        let cds2 = stream.on_snapshot(&snap2);
        assert_eq!(cds2[0].type_url, CDS);

        // Reconnected holding the new clusters, with the endpoints of the old ones.
        let mut again = Tested::<SotwStream>::default();
        let (out, _) = again.on_request(&sotw(CDS, &[], &cds2[0].version_info, ""), &snap2);
        assert!(out.is_empty(), "clusters held whole");
        let (out, _) = again.on_request(&sotw(EDS, &[BUZZ, OTHER], eds_version, ""), &snap2);
        assert_eq!(assignments(&out[0]), [BUZZ, OTHER]);

        // Reconnected holding the old clusters: they go out first, then all the endpoints.
        let mut sent = Tested::<SotwStream>::default();
        let (out, _) = sent.on_request(&sotw(CDS, &[], &cds_version, ""), &snap2);
        assert_eq!(out[0].type_url, CDS);
        let (out, _) = sent.on_request(&sotw(EDS, &[BUZZ, OTHER], eds_version, ""), &snap2);
        assert_eq!(assignments(&out[0]), [BUZZ, OTHER]);
    }

    /// A list of every assignment is held as the snapshot's index, shared; a later list
    /// without one name drops that name, as with a set of its own.
    #[test]
    fn sotw_subscription_to_every_name_shares_the_index() {
        let mut world = World::new();
        let snap = world.add_many(1500);
        let all = names_of(&snap, ResourceType::Endpoint);
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        let mut stream = Tested::<SotwStream>::default();
        let (mut out, _) = stream.on_request(&sotw(EDS, &all, "", ""), &snap);
        let eds = ResourceType::Endpoint.index();
        let subscription = &stream.machine.common.types[eds].interest.names;
        assert!(subscription.is_all_of(snap.name_index(ResourceType::Endpoint)));
        let mut got = BTreeSet::new();
        while let Some(response) = out.pop() {
            got.extend(assignments(&response));
            (out, _) = stream.on_request(&ack(&response, &all), &snap);
        }
        assert_eq!(got.len(), all.len(), "every assignment");

        let (dropped, kept) = (
            "s7.many.system.internal|8080",
            "s8.many.system.internal|8080",
        );
        let fewer: Vec<&str> = all.iter().copied().filter(|n| *n != dropped).collect();
        stream.on_request(&sotw(EDS, &fewer, "", ""), &snap);
        let subscription = &stream.machine.common.types[eds].interest.names;
        assert!(!subscription.contains(dropped) && subscription.len() == fewer.len());
        world.set("/many/s7", Protocol::Http, &["10.9.9.7:8080"]);
        let snap2 = world.set("/many/s8", Protocol::Http, &["10.9.9.8:8080"]);
        let out = stream.on_snapshot(&snap2);
        let pushed: Vec<String> = out
            .iter()
            .filter(|r| r.type_url == EDS)
            .flat_map(assignments)
            .collect();
        assert_eq!(pushed, [kept], "the dropped name is not pushed");
    }

    #[test]
    fn sotw_first_request_is_answered_even_when_empty() {
        let mut world = World::new();
        let snap = world.snapshot();
        let mut stream = Tested::<SotwStream>::default();
        let (out, _) = stream.on_request(&sotw(CDS, &[], "", ""), &snap);
        assert_eq!(out.len(), 1);
        assert!(out[0].resources.is_empty());
    }

    #[test]
    fn sotw_ack_advances_and_one_response_in_flight_per_type() {
        let mut world = World::new();
        let snap1 = world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let mut stream = Tested::<SotwStream>::default();
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
        let mut stream = Tested::<SotwStream>::default();
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

        // Back to what the client holds (an HTTP/1 cluster, as TCP's is): nothing to send.
        let snap3 = world.set("/foo/bar/buzz", Protocol::Tcp, &["10.0.0.1:8080"]);
        assert!(stream.on_snapshot(&snap3).is_empty());
    }

    #[test]
    fn sotw_stale_nonce_is_ignored() {
        let mut world = World::new();
        let snap = world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let mut stream = Tested::<SotwStream>::default();
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
        let mut stream = Tested::<SotwStream>::default();
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
        let mut stream = Tested::<SotwStream>::default();
        let mut last: HashMap<&str, SotwResponse> = HashMap::new();
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
        // The cluster changes shape (HTTP → HTTP/2) but its endpoints do not: right behind the
        // new cluster, the unchanged endpoints again (Envoy warms the re-created cluster until
        // they come, and acknowledges the clusters only then).
        let snap2 = world.set("/foo/bar/buzz", Protocol::Http2, &["10.0.0.1:8080"]);
        let out = stream.on_snapshot(&snap2);
        let urls: Vec<&str> = out.iter().map(|r| r.type_url.as_str()).collect();
        assert_eq!(urls, [CDS, EDS], "the unchanged endpoints again");
        let digest = |version: &str| version.split_once(STAMP).unwrap().0.to_string();
        assert_eq!(
            digest(&out[1].version_info),
            digest(&last[EDS].version_info)
        );
        let (again, _) = stream.on_request(&ack(&out[0], &[]), &snap2);
        assert!(again.is_empty(), "not a second time on the ACK: {again:?}");
        let out = [out[1].clone()];

        // The service turns TCP and moves to an address of its own: CDS, EDS, LDS and RDS all
        // change, and go out in order, the listeners and routes once the clusters are held.
        // Sent before the clusters were acknowledged, they carried the old clusters' stamp:
        // an empty response restamps them.
        let (restamp, _) = stream.on_request(&ack(&out[0], &[BUZZ]), &snap2);
        assert_eq!(restamp.len(), 1);
        assert!(!carries(&restamp[0]), "{restamp:?}");
        stream.on_request(&ack(&restamp[0], &[BUZZ]), &snap2);
        let snap3 = world.set("/foo/bar/buzz", Protocol::Tcp, &["10.0.0.9:8080"]);
        let mut urls = Vec::new();
        let mut out = stream.on_snapshot(&snap3);
        while !out.is_empty() {
            let mut next = Vec::new();
            for r in &out {
                if carries(r) {
                    urls.push(r.type_url.clone());
                }
                let names: &[&str] = match r.type_url.as_str() {
                    EDS => &[BUZZ],
                    RDS => &["http.8080"],
                    _ => &[],
                };
                next.extend(stream.on_request(&ack(r, names), &snap3).0);
            }
            out = next;
        }
        assert_eq!(urls, [CDS, EDS, LDS, RDS]);
    }

    /// Whether a response says anything but a new stamp: an empty endpoint or route response
    /// follows an ACK of clusters or listeners (see `basis_of`).
    fn carries(response: &SotwResponse) -> bool {
        !response.resources.is_empty() || [CDS, LDS].contains(&response.type_url.as_str())
    }

    #[test]
    fn sotw_splits_large_endpoint_responses_and_sends_the_rest_after_the_ack() {
        let (_world, snap) = big_world(RESPONSE_BUDGET);
        let names = names_of(&snap, ResourceType::Endpoint);
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut stream = Tested::<SotwStream>::default();
        let (mut out, _) = stream.on_request(&sotw(EDS, &names, "", ""), &snap);
        let mut got = BTreeSet::new();
        let mut responses = 0;
        while let Some(response) = out.pop() {
            responses += 1;
            let bytes: usize = response.resources.iter().map(|r| r.body.value.len()).sum();
            assert!(bytes <= RESPONSE_BUDGET, "{bytes} bytes in one response");
            got.extend(assignments(&response));
            (out, _) = stream.on_request(&ack(&response, &names), &snap);
        }
        assert!(responses > 2);
        assert_eq!(got.len(), names.len());
    }

    /// The names a client of the whole mesh subscribes to for each type of `snap`.
    fn wanted(snap: &XdsSnapshot, type_url: &str) -> Vec<String> {
        match type_url {
            EDS => names_of(snap, ResourceType::Endpoint),
            RDS => names_of(snap, ResourceType::Route),
            _ => Vec::new(),
        }
    }

    /// ACKs `out` and whatever follows, as Envoy does as a client of the whole mesh: its
    /// endpoint subscription (`eds`) follows the clusters it holds; the responses seen, in
    /// order.
    fn ack_all(
        stream: &mut Tested<SotwStream>,
        snap: &XdsSnapshot,
        eds: &mut Vec<String>,
        out: Vec<SotwResponse>,
    ) -> Vec<SotwResponse> {
        let mut seen = Vec::new();
        let mut pending: std::collections::VecDeque<SotwResponse> = out.into();
        while let Some(response) = pending.pop_front() {
            let names = match response.type_url.as_str() {
                EDS => eds.clone(),
                url => wanted(snap, url),
            };
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let (more, _) = stream.on_request(&ack(&response, &names), snap);
            pending.extend(more);
            if response.type_url == CDS {
                let mut held: Vec<String> = cluster_names(&response)
                    .iter()
                    .map(|n| n.to_string())
                    .collect();
                held.sort();
                if held != *eds {
                    *eds = held;
                    let eds_state = &stream.machine.extra[ResourceType::Endpoint.index()];
                    let nonce = eds_state.last_nonce.clone().unwrap_or_default();
                    let names: Vec<&str> = eds.iter().map(String::as_str).collect();
                    let (more, _) = stream.on_request(&sotw(EDS, &names, "", &nonce), snap);
                    pending.extend(more);
                }
            }
            seen.push(response);
        }
        seen
    }

    /// A client of every type, in sync with `snap`, and its endpoint subscription.
    fn synced(snap: &XdsSnapshot) -> (Tested<SotwStream>, Vec<String>) {
        let mut stream = Tested::<SotwStream>::default();
        let mut eds = wanted(snap, EDS);
        for url in [CDS, EDS, LDS, RDS] {
            let names = if url == EDS {
                eds.clone()
            } else {
                wanted(snap, url)
            };
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let (out, _) = stream.on_request(&sotw(url, &names, "", ""), snap);
            ack_all(&mut stream, snap, &mut eds, out);
        }
        assert!(stream.machine.holds(snap));
        (stream, eds)
    }

    fn cluster_names(response: &SotwResponse) -> Vec<&str> {
        response.resources.iter().map(|r| &*r.name).collect()
    }

    /// A blue-green release's last step in one edit: the route flips to green and blue goes.
    /// Blue's cluster stays (the clusters, when sent, keep it) until the route configuration
    /// without it is acknowledged; a new cluster of the same edit is warm (its endpoints
    /// acknowledged) before any route may name it.
    #[test]
    fn sotw_removes_a_cluster_only_after_the_routes_that_named_it_are_acknowledged() {
        use crate::xds::testing::routed;
        let ep = |a: &str| vec![a.to_string()];
        let spec = |path: &str, address: &str, to: &[(&str, u16, u32)]| {
            let address = ep(address);
            let address: Vec<&str> = address.iter().map(String::as_str).collect();
            routed(path, 8080, Protocol::Http, &address, to)
        };
        let mut world = World::new();
        let snap = world.replace(vec![
            spec("/shop/web", "10.0.0.1:8080", &[("/shop/blue", 8080, 1)]),
            spec("/shop/blue", "10.0.0.2:8080", &[]),
            spec("/shop/green", "10.0.0.3:8080", &[]),
        ]);
        let (mut stream, mut eds) = synced(&snap);
        let blue = "blue.shop.system.internal|8080";
        let snap2 = world.replace(vec![
            spec("/shop/web", "10.0.0.1:8080", &[("/shop/green", 8080, 1)]),
            spec("/shop/green", "10.0.0.3:8080", &[]),
            spec("/shop/new", "10.0.0.4:8080", &[]),
        ]);
        let out = stream.on_snapshot(&snap2);
        let urls: Vec<&str> = out.iter().map(|r| r.type_url.as_str()).collect();
        assert_eq!(
            urls,
            [CDS],
            "the new cluster first, routes wait for it to warm"
        );
        assert!(cluster_names(&out[0]).contains(&blue), "blue is kept");
        assert!(cluster_names(&out[0]).contains(&"new.shop.system.internal|8080"));
        let seen = ack_all(&mut stream, &snap2, &mut eds, out);
        let order: Vec<(&str, bool)> = seen
            .iter()
            .filter(|r| carries(r))
            .map(|r| {
                (
                    r.type_url.as_str(),
                    r.type_url == CDS && cluster_names(r).contains(&blue),
                )
            })
            .collect();
        assert_eq!(
            order,
            [(CDS, true), (EDS, false), (RDS, false), (CDS, false)],
            "new's endpoints, then the route, then the clusters without blue"
        );
        assert!(stream.machine.holds(&snap2));
    }

    /// A refused version does not count as held: a DNS answer waiting for the proxy to hold
    /// the mesh is not freed by it, and it is not sent again until it changes.
    #[test]
    fn sotw_a_refused_resource_is_not_held() {
        let mut world = World::new();
        let snap = world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let (mut stream, mut eds) = synced(&snap);
        let snap2 = world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.2:8080"]);
        let out = stream.on_snapshot(&snap2);
        assert_eq!(out[0].type_url, EDS);
        let refused = nack(sotw(EDS, &[BUZZ], "", &out[0].nonce));
        let (again, _) = stream.on_request(&refused, &snap2);
        assert!(again.is_empty() && stream.on_snapshot(&snap2).is_empty());
        assert!(!stream.machine.holds(&snap2), "refused: not held");
        let snap3 = world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.3:8080"]);
        let out = stream.on_snapshot(&snap3);
        assert_eq!(assignments(&out[0]), [BUZZ], "new content goes out");
        ack_all(&mut stream, &snap3, &mut eds, out);
        assert!(stream.machine.holds(&snap3));
    }

    /// An empty list subscribes to a whole type only while the client has named nothing: once
    /// it named a cluster, an empty list is no interest, and the clusters it sends are none.
    #[test]
    fn sotw_an_empty_list_is_a_wildcard_only_before_any_name() {
        let mut world = World::new();
        world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let snap = world.set("/foo/other", Protocol::Http, &["10.0.0.2:8080"]);
        let mut stream = Tested::<SotwStream>::default();
        let (out, _) = stream.on_request(&sotw(CDS, &[], "", ""), &snap);
        assert_eq!(out[0].resources.len(), 2, "legacy wildcard");
        let (out, _) = stream.on_request(&ack(&out[0], &[BUZZ]), &snap);
        assert_eq!(
            cluster_names(&out[0]),
            [BUZZ],
            "named: no longer a wildcard"
        );
        let (out, _) = stream.on_request(&ack(&out[0], &[]), &snap);
        assert!(out[0].resources.is_empty(), "an empty list now: nothing");
        let (out, _) = stream.on_request(&ack(&out[0], &["*"]), &snap);
        assert_eq!(out[0].resources.len(), 2, "`*`: everything again");
    }

    /// More names than a stream may name in one type, or names no resource has past their byte
    /// budget, end the stream (RESOURCE_EXHAUSTED at the server).
    #[test]
    fn sotw_names_beyond_the_limits_end_the_stream() {
        let snap = World::new().add_many(3);
        let mut stream = SotwStream::new(Limits { max_names: 10 });
        let many: Vec<String> = (0..11).map(|i| format!("n{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let (out, events) = stream.on_request(&sotw(EDS, &many[..10], "", ""), &snap);
        assert!(!out.is_empty() && events.is_empty(), "ten are allowed");
        let (out, events) = stream.on_request(&sotw(EDS, &many, "", ""), &snap);
        assert!(out.is_empty());
        assert!(matches!(
            &events[..],
            [Event::Exhausted {
                kind: ResourceType::Endpoint,
                ..
            }]
        ));

        // Unknown names: their bytes are bounded, however few they are.
        let mut stream = SotwStream::default();
        let long: Vec<String> = (0..5)
            .map(|i| format!("{i}{}", "x".repeat(1 << 20)))
            .collect();
        let long: Vec<&str> = long.iter().map(String::as_str).collect();
        let (_, events) = stream.on_request(&sotw(EDS, &long[..3], "", ""), &snap);
        assert!(events.is_empty(), "3 MiB of names is within the budget");
        let (_, events) = stream.on_request(&sotw(EDS, &long, "", ""), &snap);
        assert!(
            matches!(&events[..], [Event::Exhausted { .. }]),
            "{events:?}"
        );
    }
}
