//! The incremental ADS machine (`DeltaAggregatedResources`): subscriptions change by name,
//! responses carry only what changed and what was removed, each resource with its own version
//! (see [`super::stream`] for the rules both flavours keep).

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::Node;

use super::held::ClientView;
use super::inbound::Presized;
use super::interest::{Subscription, UnknownNames};
use super::response::DeltaResponse;
use super::snapshot::{
    NameSet, Names, ResourceType, TYPES, XdsResource, XdsSnapshot, parse_version,
};
use super::stream::{Ads, Delivery, Event, Flavour, Limits, Push, Types, nonce, too_many};
use super::wire::{DeltaRequest, VersionList};

/// What a Delta stream keeps per type beside [`TypeState`].
#[derive(Debug, Default)]
struct DeltaExtra {
    /// Explicitly subscribed names we already told the client do not exist.
    told_absent: NameSet,
}

/// One `DeltaAggregatedResources` stream.
#[derive(Debug, Default)]
pub struct DeltaStream {
    pub(super) common: Types,
    extra: [DeltaExtra; TYPES],
}

impl Ads for DeltaStream {
    type Request = DeltaRequest;
    type Response = DeltaResponse;
    type Decoder = Presized<DeltaRequest>;
    const MODE: &'static str = "delta";

    fn new(limits: Limits) -> Self {
        DeltaStream {
            common: Types::new(limits),
            extra: Default::default(),
        }
    }

    fn node(request: &DeltaRequest) -> Option<&Node> {
        request.node.as_ref()
    }

    fn on_request(
        &mut self,
        request: &DeltaRequest,
        snapshot: &XdsSnapshot,
    ) -> (Vec<Push<DeltaResponse>>, Vec<Event>) {
        let Some(kind) = ResourceType::from_type_url(&request.type_url) else {
            let event = Event::UnknownType {
                type_url: request.type_url.clone(),
            };
            return (Vec::new(), vec![event]);
        };
        let limits = self.common.limits;
        let subscribe = &request.resource_names_subscribe;
        let listed = request.initial_resource_versions.len();
        if let Some(exhausted) = too_many(kind, subscribe.len().max(listed), limits) {
            return (Vec::new(), vec![exhausted]);
        }
        let current = snapshot.names(kind, listed + subscribe.len());
        let state = self.common.of(kind);
        let told_absent = &mut self.extra[kind.index()].told_absent;
        let mut events = Vec::new();
        let mut reconnected = false;
        let first = !state.requested;

        if first {
            state.requested = true;
            state.must_answer = true;
            // Legacy wildcard: the first request for a wildcard type that names nothing.
            let legacy = subscribe.is_empty() && kind.is_wildcard_by_default();
            state.interest.wildcard = legacy;
            state.interest.legacy = legacy;
            // A reconnecting client says what it holds. A version this agent did not make
            // (another control plane's) matches nothing, so the resource is sent again.
            state.client = held_view(
                &request.initial_resource_versions,
                &current,
                snapshot,
                kind,
                &mut state.unknown,
            );
            state.baseline = None;
            reconnected = listed > 0;
        } else if state.interest.legacy && !subscribe.is_empty() {
            // Named something: an empty subscription no longer means everything; the wildcard
            // itself stays until `*` is unsubscribed.
            state.interest.legacy = false;
        }
        let everything = state.interest.names.is_empty().then(|| {
            let names = subscribe.iter().map(|name| (name, None));
            snapshot.every_resource(kind, subscribe.len(), names)
        });
        if let Some(Some(index)) = everything {
            // A first subscription to every name of the type (Envoy's to the endpoints of all
            // its clusters): the snapshot's index, shared. Nothing was subscribed before, so
            // nothing was told absent, and without a baseline nothing is queued.
            state.interest.names = Subscription::whole(index.clone());
            told_absent.clear();
            state.baseline = None;
        } else {
            for name in subscribe.iter() {
                if name == "*" {
                    state.interest.wildcard = true;
                    state.baseline = None;
                } else if !state.interest.names.contains(name) {
                    let name = state.unknown.intern(&current, name);
                    state.interest.names.insert(name.clone());
                    told_absent.remove(&name);
                    state.look_again(name);
                }
            }
            // Counted first: the index is built only for a subscription as large as the type.
            let names = &mut state.interest.names;
            if !subscribe.is_empty() && names.len() == snapshot.of(kind).len() {
                names.compact(snapshot.name_index(kind));
            }
        }
        if !request.resource_names_unsubscribe.is_empty() {
            state.interest.narrowed();
        }
        for name in &request.resource_names_unsubscribe {
            if name == "*" {
                // What it held through the wildcard alone, it dropped with it.
                state.interest.wildcard = false;
                state.interest.legacy = false;
                let interest = &state.interest;
                let unnamed: Vec<Arc<str>> = state
                    .client
                    .names()
                    .filter(|n| !interest.wants(n))
                    .cloned()
                    .collect();
                for name in unnamed {
                    state.forget(&name);
                }
                continue;
            }
            let named = state.interest.names.get(name).cloned();
            state.interest.names.remove(name);
            told_absent.remove(name.as_str());
            match named {
                // Still wanted through the wildcard: the client dropped it, and is told its
                // state again (as the protocol asks of a name unsubscribed under a wildcard).
                Some(name) if state.interest.wildcard => {
                    state.forget(&name);
                    state.look_again(name);
                }
                _ if state.interest.wildcard => {}
                _ => state.forget(name),
            }
        }
        if reconnected {
            self.common.reconnected = true;
        }
        if kind == ResourceType::Endpoint {
            if first {
                self.common.endpoints_requested();
            }
            self.common.endpoints_asked();
        }

        if !request.response_nonce.is_empty() {
            let state = self.common.of(kind);
            if state
                .in_flight
                .as_ref()
                .is_some_and(|d| d.nonce == request.response_nonce)
            {
                let accepted = request.error_detail.is_none();
                let delivery = if accepted {
                    self.common.accept(kind, snapshot)
                } else {
                    self.common.reject(kind)
                };
                if let Some(delivery) = delivery {
                    events.push(match &request.error_detail {
                        Some(status) => Event::Nack {
                            kind,
                            version: delivery.version.clone(),
                            error: status.message.clone(),
                        },
                        None => Event::Ack {
                            kind,
                            version: delivery.version.clone(),
                        },
                    });
                    self.common.answered(kind, &delivery, accepted);
                }
            } else {
                events.push(Event::StaleNonce {
                    kind,
                    nonce: request.response_nonce.clone(),
                });
            }
        }
        if let Err(exhausted) = self.common.of(kind).check_names(kind, limits) {
            events.push(exhausted);
            return (Vec::new(), events);
        }
        (self.push(snapshot), events)
    }

    fn on_snapshot(&mut self, snapshot: &XdsSnapshot) -> Vec<Push<DeltaResponse>> {
        self.push(snapshot)
    }

    fn holds(&self, snapshot: &XdsSnapshot) -> bool {
        self.common.holds(snapshot)
    }
}

/// What a reconnecting client says it holds, as a view: the snapshot's resource where the
/// version is the snapshot's, a resource known only by its version otherwise. Usually it holds
/// exactly the whole type of the current snapshot (nothing changed while it was away, or it
/// reconnected to another agent of the same mesh): then the view is the snapshot's map itself,
/// with no map built (a profile of a restart at 10k services had building these views entry by
/// entry as a fifth of the agent's CPU).
fn held_view(
    listed: &VersionList,
    current: &Names<'_>,
    snapshot: &XdsSnapshot,
    kind: ResourceType,
    unknown: &mut UnknownNames,
) -> ClientView {
    // A version this agent did not make (another control plane's) matches nothing.
    let version = |version: &str| parse_version(version).unwrap_or(u64::MAX);
    let held = listed.iter().map(|(name, v)| (name, Some(version(v))));
    if snapshot.every_resource(kind, listed.len(), held).is_some() {
        return ClientView::whole(snapshot.of(kind), snapshot.whole(kind));
    }
    let mut view = ClientView::default();
    view.reserve(listed.len());
    for (name, v) in listed.iter() {
        let v = version(v);
        let resource = match current.get_key_value(name) {
            Some((_, resource)) if resource.version == v => resource.clone(),
            Some((name, _)) => XdsResource::held_at(name.clone(), v),
            None => XdsResource::held_at(unknown.intern(current, name), v),
        };
        view.insert(resource);
    }
    view
}

impl DeltaStream {
    fn push(&mut self, snapshot: &XdsSnapshot) -> Vec<Push<DeltaResponse>> {
        let mut found = self.common.plan(snapshot, Flavour::Delta);
        let mut out = Vec::new();
        for kind in ResourceType::ALL {
            let Some(mut found) = found[kind.index()].take() else {
                continue;
            };
            // Explicitly subscribed names that do not exist: say so once, so Envoy does not
            // wait for them until its fetch timeout.
            let told_absent = &mut self.extra[kind.index()].told_absent;
            found.absent.retain(|name| !told_absent.contains(name));
            if found.is_empty() && !self.common.of(kind).must_answer {
                continue;
            }
            let told_absent = &mut self.extra[kind.index()].told_absent;
            told_absent.extend(found.absent.iter().cloned());
            let mut removed: Vec<String> = found
                .removed
                .iter()
                .chain(&found.absent)
                .map(|name| name.to_string())
                .collect();
            removed.sort();
            let nonce = nonce(&mut self.common.nonces);
            let version = snapshot.version.to_string();
            let state = self.common.of(kind);
            state.in_flight = Some(Delivery {
                nonce: nonce.clone(),
                listed: found.changed.clone(),
                removed: found.removed,
                whole: None,
                narrowings: state.interest.narrowings(),
                version: version.clone(),
            });
            state.must_answer = false;
            out.push(Push {
                kind,
                response: DeltaResponse {
                    system_version_info: version,
                    resources: found.changed,
                    type_url: kind.type_url().to_string(),
                    removed_resources: removed,
                    nonce,
                },
            });
        }
        out
    }
}
#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet, HashMap};

    use envoy_types::pb::google::rpc::Status as RpcStatus;

    use super::*;
    use crate::mesh::Protocol;
    use crate::xds::stream::RESPONSE_BUDGET;
    use crate::xds::testing::{BUZZ, CDS, EDS, LDS, RDS, Tested, World, big_world, names_of};

    fn delta(
        type_url: &str,
        subscribe: &[&str],
        unsubscribe: &[&str],
        nonce: &str,
    ) -> DeltaRequest {
        DeltaRequest {
            type_url: type_url.to_string(),
            resource_names_subscribe: subscribe.iter().collect(),
            resource_names_unsubscribe: unsubscribe.iter().map(|s| s.to_string()).collect(),
            response_nonce: nonce.to_string(),
            ..DeltaRequest::default()
        }
    }

    fn names(response: &DeltaResponse) -> Vec<&str> {
        response.resources.iter().map(|r| &*r.name).collect()
    }

    #[test]
    fn delta_splits_a_large_response_and_sends_the_rest_after_the_ack() {
        let (_world, snap) = big_world(RESPONSE_BUDGET);
        let mut stream = Tested::<DeltaStream>::default();
        let (mut out, _) = stream.on_request(&delta(EDS, &["*"], &[], ""), &snap);
        let mut got = BTreeSet::new();
        while let Some(response) = out.pop() {
            let bytes: usize = response.resources.iter().map(|r| r.body.value.len()).sum();
            assert!(bytes <= RESPONSE_BUDGET, "{bytes} bytes in one response");
            assert!(!response.resources.is_empty());
            got.extend(names(&response).into_iter().map(str::to_string));
            (out, _) = stream.on_request(&delta(EDS, &[], &[], &response.nonce), &snap);
        }
        let all: BTreeSet<String> = names_of(&snap, ResourceType::Endpoint)
            .into_iter()
            .collect();
        assert_eq!(got, all);
    }

    /// What did not fit in a response waits in the stream's backlog; a snapshot that changes,
    /// removes or adds resources meanwhile, and an unsubscribe, are honoured for those too.
    #[test]
    fn delta_split_sync_follows_changes_made_before_the_rest_is_sent() {
        let (mut world, snap) = big_world(RESPONSE_BUDGET);
        let new = "new.big.system.internal|8080";
        let mut wanted = names_of(&snap, ResourceType::Endpoint);
        wanted.push(new.to_string());
        let wanted: Vec<&str> = wanted.iter().map(String::as_str).collect();
        let mut stream = Tested::<DeltaStream>::default();
        let (out, _) = stream.on_request(&delta(EDS, &wanted, &[], ""), &snap);
        let first = out[0].clone();
        let sent: BTreeSet<&str> = names(&first).into_iter().collect();
        // The last names sort last: still waiting.
        let changed = "s99.big.system.internal|8080";
        let removed = "s98.big.system.internal|8080";
        let dropped = "s97.big.system.internal|8080";
        for name in [changed, removed, dropped] {
            assert!(
                !sent.contains(name),
                "{name} went out in the first response"
            );
        }
        world.set("/big/s99", Protocol::Http, &["10.9.9.9:8080"]);
        world.remove("/big/s98");
        let snap2 = world.set("/big/new", Protocol::Http, &["10.9.9.8:8080"]);
        // Arrives while the first response is in flight: nothing goes out until its ACK.
        assert!(stream.on_snapshot(&snap2).is_empty());
        let (mut out, _) = stream.on_request(&delta(EDS, &[], &[dropped], &first.nonce), &snap2);
        let mut got: BTreeMap<String, Vec<u8>> = first
            .resources
            .iter()
            .map(|r| (r.name.to_string(), r.body.value.clone()))
            .collect();
        while let Some(response) = out.pop() {
            for r in &response.resources {
                let previous = got.insert(r.name.to_string(), r.body.value.clone());
                assert!(previous.is_none(), "{} sent twice", r.name);
            }
            (out, _) = stream.on_request(&delta(EDS, &[], &[], &response.nonce), &snap2);
        }
        let expected: BTreeMap<String, Vec<u8>> = snap2
            .of(ResourceType::Endpoint)
            .iter()
            .filter(|(name, _)| &***name != dropped)
            .map(|(name, r)| (name.to_string(), r.body.value.clone()))
            .collect();
        assert!(got.contains_key(new));
        assert!(!got.contains_key(removed) && !got.contains_key(dropped));
        assert_eq!(got, expected, "every resource once, at its latest content");
    }

    /// A resource the client unsubscribes from in the very request that ACKs the response
    /// carrying it is not held: subscribing to it again sends it again.
    #[test]
    fn delta_a_resource_unsubscribed_with_its_ack_is_not_held() {
        let (_world, snap) = big_world(RESPONSE_BUDGET);
        let wanted = names_of(&snap, ResourceType::Endpoint);
        let wanted: Vec<&str> = wanted.iter().map(String::as_str).collect();
        let mut stream = Tested::<DeltaStream>::default();
        let (out, _) = stream.on_request(&delta(EDS, &wanted, &[], ""), &snap);
        let first = out[0].clone();
        let name = first.resources[0].name.to_string();
        let (mut out, _) = stream.on_request(&delta(EDS, &[], &[&name], &first.nonce), &snap);
        while let Some(response) = out.pop() {
            assert!(!names(&response).contains(&name.as_str()));
            (out, _) = stream.on_request(&delta(EDS, &[], &[], &response.nonce), &snap);
        }
        let (out, _) = stream.on_request(&delta(EDS, &[&name], &[], ""), &snap);
        assert_eq!(out.len(), 1);
        assert_eq!(names(&out[0]), [name.as_str()]);
    }

    #[test]
    fn delta_sends_only_changes_and_removals() {
        let mut world = World::new();
        world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let snap = world.set("/foo/other", Protocol::Http, &["10.0.0.2:8080"]);
        let mut stream = Tested::<DeltaStream>::default();
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
        let mut stream = Tested::<DeltaStream>::default();
        let (out, _) = stream.on_request(&delta(EDS, &[BUZZ, "missing|1"], &[], ""), &snap);
        assert_eq!(names(&out[0]), [BUZZ]);
        assert_eq!(out[0].removed_resources, ["missing|1"]);
        stream.on_request(&delta(EDS, &[], &[], &out[0].nonce), &snap);

        // A name subscribed later, with nothing else changed, is sent on its own.
        let other = "other.foo.system.internal|8080";
        let (out, _) = stream.on_request(&delta(EDS, &[other], &[], ""), &snap);
        assert_eq!(names(&out[0]), [other]);
        stream.on_request(&delta(EDS, &[], &[], &out[0].nonce), &snap);

        // Unsubscribed names are no longer pushed when they change.
        stream.on_request(&delta(EDS, &[], &[BUZZ], ""), &snap);
        let snap2 = world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.7:8080"]);
        assert!(stream.on_snapshot(&snap2).is_empty());

        // Explicit wildcard subscription brings in everything not yet known.
        let (out, _) = stream.on_request(&delta(EDS, &["*"], &[], ""), &snap2);
        assert_eq!(names(&out[0]), [BUZZ]);
    }

    #[test]
    fn delta_reconnect_uses_initial_resource_versions() {
        let mut world = World::new();
        world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let snap = world.set("/foo/other", Protocol::Http, &["10.0.0.2:8080"]);
        let clusters = snap.of(ResourceType::Cluster);
        let mut request = delta(CDS, &[], &[], "");
        request.initial_resource_versions = [
            (BUZZ.to_string(), clusters[BUZZ].version_string()),
            (
                "other.foo.system.internal|8080".to_string(),
                "stale".to_string(),
            ),
            ("gone|1".to_string(), "v".to_string()),
        ]
        .into_iter()
        .collect();
        let mut stream = Tested::<DeltaStream>::default();
        let (out, _) = stream.on_request(&request, &snap);
        assert_eq!(
            names(&out[0]),
            ["other.foo.system.internal|8080"],
            "only what differs"
        );
        // What it held and is gone goes once its listeners (on their way) are in sync.
        assert!(out[0].removed_resources.is_empty());
        assert_eq!(
            removals_after_the_listeners(&mut stream, &snap, out),
            [(CDS, "gone|1".to_string())]
        );
    }

    /// Acknowledges `out`, asks for listeners (as a reconnecting Envoy does right after its
    /// clusters) and acknowledges what follows: the removals sent, in order.
    fn removals_after_the_listeners(
        stream: &mut Tested<DeltaStream>,
        snap: &XdsSnapshot,
        out: Vec<DeltaResponse>,
    ) -> Vec<(&'static str, String)> {
        let mut seen = ack_all(stream, snap, out);
        let (out, _) = stream.on_request(&delta(LDS, &[], &[], ""), snap);
        seen.extend(ack_all(stream, snap, out));
        seen.iter()
            .flat_map(|r| {
                let url = [CDS, EDS, LDS, RDS]
                    .into_iter()
                    .find(|u| *u == r.type_url)
                    .unwrap();
                r.removed_resources.iter().map(move |n| (url, n.clone()))
            })
            .collect()
    }

    /// A reconnect that names more than a few names looks them up through the snapshot's hash
    /// index, with the same outcome as the ordered lookups above.
    #[test]
    fn delta_reconnect_at_scale_goes_through_the_index_alike() {
        let mut world = World::new();
        let snap = world.add_many(1500);
        let clusters = snap.of(ResourceType::Cluster);
        let mut held: HashMap<String, String> = clusters
            .values()
            .map(|r| (r.name.to_string(), r.version_string()))
            .collect();
        let stale = "s7.many.system.internal|8080";
        held.insert(stale.to_string(), "stale".to_string());
        held.insert("gone|1".to_string(), "v".to_string());
        let mut request = delta(CDS, &[], &[], "");
        request.initial_resource_versions = held.into_iter().collect();
        let mut stream = Tested::<DeltaStream>::default();
        let (cds, _) = stream.on_request(&request, &snap);
        assert!(snap.indexes.built(ResourceType::Cluster));
        assert_eq!(names(&cds[0]), [stale], "only what differs");

        // Every assignment held and subscribed, and one name that does not exist.
        let assignments = snap.of(ResourceType::Endpoint);
        let mut subscribe: Vec<&str> = assignments.keys().map(|n| &**n).collect();
        subscribe.push("absent|1");
        let mut request = delta(EDS, &subscribe, &[], "");
        request.initial_resource_versions = assignments
            .values()
            .map(|r| (r.name.to_string(), r.version_string()))
            .collect();
        let (eds, _) = stream.on_request(&request, &snap);
        // Nothing again but the endpoints of the cluster it held as another: it re-creates
        // that cluster.
        assert_eq!(names(&eds[0]), [stale], "only the re-created cluster's");
        let mut out = cds;
        out.extend(eds);
        let removals = removals_after_the_listeners(&mut stream, &snap, out);
        assert_eq!(
            removals,
            [(CDS, "gone|1".to_string()), (EDS, "absent|1".to_string())]
        );
        // The cluster it held as another it re-created: its endpoints went out again, alone.
        let sent = &stream.machine.common.types[ResourceType::Endpoint.index()];
        assert!(
            sent.client
                .is_exactly(assignments, snap.whole(ResourceType::Endpoint))
        );
    }

    /// A client that lists exactly the snapshot's clusters holds the snapshot's own map, with
    /// the digest a view built name by name has; a list as long that repeats one name and
    /// leaves another out is not taken for it, and the one left out is sent.
    #[test]
    fn delta_reconnect_holding_the_whole_type_shares_the_snapshots_map() {
        let mut world = World::new();
        let snap = world.add_many(1500);
        let clusters = snap.of(ResourceType::Cluster);
        let listed: Vec<(String, String)> = clusters
            .values()
            .map(|r| (r.name.to_string(), r.version_string()))
            .collect();
        let mut request = delta(CDS, &[], &[], "");
        request.initial_resource_versions = listed.iter().cloned().collect();
        let mut stream = Tested::<DeltaStream>::default();
        let (out, _) = stream.on_request(&request, &snap);
        assert!(out[0].resources.is_empty() && out[0].removed_resources.is_empty());
        let view = &stream.machine.common.types[ResourceType::Cluster.index()].client;
        assert!(view.is_based_on(clusters), "the snapshot's map, shared");
        let mut by_name = ClientView::default();
        for resource in clusters.values() {
            by_name.insert(resource.clone());
        }
        assert_eq!(view.version_info(), by_name.version_info());
        assert_eq!(view.len(), clusters.len());

        let left_out = listed[7].0.clone();
        let mut repeated = listed.clone();
        repeated[7] = listed[8].clone();
        request.initial_resource_versions = repeated.iter().cloned().collect();
        let mut stream = Tested::<DeltaStream>::default();
        let (out, _) = stream.on_request(&request, &snap);
        assert_eq!(names(&out[0]), [left_out.as_str()], "only the one left out");
    }

    /// A first subscription to every assignment is the snapshot's index, shared; one that
    /// repeats a name and leaves another out is not, until a later request names that one;
    /// unsubscribing from one name of a shared subscription stops its changes, as with a set
    /// of its own.
    #[test]
    fn delta_subscription_to_every_name_shares_the_index() {
        let mut world = World::new();
        let snap = world.add_many(1500);
        let all = names_of(&snap, ResourceType::Endpoint);
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        let mut repeated = all.clone();
        repeated[3] = all[4];
        let mut other = Tested::<DeltaStream>::default();
        other.on_request(&delta(EDS, &repeated, &[], ""), &snap);
        let subscription = &other.machine.common.types[ResourceType::Endpoint.index()]
            .interest
            .names;
        assert!(!subscription.is_all_of(snap.name_index(ResourceType::Endpoint)));
        assert!(!subscription.contains(all[3]) && subscription.len() == all.len() - 1);
        // The one left out, in a later request (Envoy subscribes batch by batch, as clusters
        // arrive): every name now, held as the index.
        other.on_request(&delta(EDS, &[all[3]], &[], ""), &snap);
        let subscription = &other.machine.common.types[ResourceType::Endpoint.index()]
            .interest
            .names;
        assert!(subscription.is_all_of(snap.name_index(ResourceType::Endpoint)));
        assert!(subscription.contains(all[3]) && subscription.len() == all.len());

        let mut stream = Tested::<DeltaStream>::default();
        let (mut out, _) = stream.on_request(&delta(EDS, &all, &[], ""), &snap);
        let subscription = &stream.machine.common.types[ResourceType::Endpoint.index()]
            .interest
            .names;
        assert!(subscription.is_all_of(snap.name_index(ResourceType::Endpoint)));
        let mut got = 0;
        while let Some(response) = out.pop() {
            got += response.resources.len();
            (out, _) = stream.on_request(&delta(EDS, &[], &[], &response.nonce), &snap);
        }
        assert_eq!(got, all.len(), "every assignment once");

        let (dropped, kept) = (
            "s7.many.system.internal|8080",
            "s8.many.system.internal|8080",
        );
        stream.on_request(&delta(EDS, &[], &[dropped], ""), &snap);
        world.set("/many/s7", Protocol::Http, &["10.9.9.7:8080"]);
        let snap2 = world.set("/many/s8", Protocol::Http, &["10.9.9.8:8080"]);
        let out = stream.on_snapshot(&snap2);
        let eds: Vec<&str> = out
            .iter()
            .filter(|r| r.type_url == EDS)
            .flat_map(names)
            .collect();
        assert_eq!(eds, [kept], "the unsubscribed name is not pushed");
    }

    #[test]
    fn delta_nack_is_not_looped_and_stale_nonce_still_updates_subscriptions() {
        let mut world = World::new();
        let snap = world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let mut stream = Tested::<DeltaStream>::default();
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
            stream.machine.common.types[ResourceType::Endpoint.index()]
                .client
                .get(BUZZ)
                .is_none(),
            "the unsubscribe in the stale-nonce request must stick"
        );
    }

    #[test]
    fn delta_resends_endpoints_of_a_changed_cluster() {
        let mut world = World::new();
        let snap = world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let mut stream = Tested::<DeltaStream>::default();
        let (out, _) = stream.on_request(&delta(CDS, &[], &[], ""), &snap);
        stream.on_request(&delta(CDS, &[], &[], &out[0].nonce), &snap);
        let (out, _) = stream.on_request(&delta(EDS, &[BUZZ], &[], ""), &snap);
        stream.on_request(&delta(EDS, &[], &[], &out[0].nonce), &snap);

        let snap2 = world.set("/foo/bar/buzz", Protocol::Grpc, &["10.0.0.1:8080"]);
        let out = stream.on_snapshot(&snap2);
        let urls: Vec<&str> = out.iter().map(|r| r.type_url.as_str()).collect();
        // Right behind the cluster its endpoints again: Envoy warms the re-created cluster
        // until they come, and acknowledges the clusters only then.
        assert_eq!(urls, [CDS, EDS]);
        assert_eq!(names(&out[1]), [BUZZ]);
        let (again, _) = stream.on_request(&delta(CDS, &[], &[], &out[0].nonce), &snap2);
        assert!(again.is_empty(), "not a second time on the ACK: {again:?}");
    }

    #[test]
    fn delta_changes_made_while_a_response_is_in_flight_go_out_after_its_ack() {
        let mut world = World::new();
        let snap = world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let mut stream = Tested::<DeltaStream>::default();
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
            snap3.of(ResourceType::Endpoint)[BUZZ].version,
            "the latest version, not an intermediate one"
        );
        stream.on_request(&delta(EDS, &[], &[], &out[0].nonce), &snap3);
        assert!(
            stream.on_snapshot(&snap3).is_empty(),
            "nothing left to send"
        );
    }

    /// ACKs `out` and whatever follows; the responses seen, in order. Endpoints and routes are
    /// subscribed as they are named, as Envoy does.
    fn ack_all(
        stream: &mut Tested<DeltaStream>,
        snap: &XdsSnapshot,
        out: Vec<DeltaResponse>,
    ) -> Vec<DeltaResponse> {
        let mut seen = Vec::new();
        let mut pending: std::collections::VecDeque<DeltaResponse> = out.into();
        while let Some(response) = pending.pop_front() {
            let (more, _) =
                stream.on_request(&delta(&response.type_url, &[], &[], &response.nonce), snap);
            pending.extend(more);
            seen.push(response);
        }
        seen
    }

    fn synced(snap: &XdsSnapshot) -> Tested<DeltaStream> {
        let mut stream = Tested::<DeltaStream>::default();
        for (url, kind) in [
            (CDS, None),
            (EDS, Some(ResourceType::Endpoint)),
            (LDS, None),
            (RDS, Some(ResourceType::Route)),
        ] {
            let names = kind.map(|k| names_of(snap, k)).unwrap_or_default();
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let (out, _) = stream.on_request(&delta(url, &names, &[], ""), snap);
            ack_all(&mut stream, snap, out);
        }
        assert!(stream.machine.holds(snap));
        stream
    }

    /// Make before break in Delta: a backend's port moves (a new cluster, the old one to go)
    /// with the route that names it. The new cluster, its endpoints (once subscribed) and the
    /// routes go first, in that order; the old cluster's removal waits for the routes'
    /// acknowledgement, and its endpoints' removal for the clusters'.
    #[test]
    fn delta_a_port_change_goes_cluster_endpoints_routes_then_removals() {
        use crate::xds::testing::routed;
        let mut world = World::new();
        let specs = |port: u16| {
            vec![
                routed(
                    "/shop/web",
                    8080,
                    Protocol::Http,
                    &["10.0.0.1:8080"],
                    &[("/shop/api", port, 1)],
                ),
                routed("/shop/api", port, Protocol::Http, &["10.0.0.2:8080"], &[]),
            ]
        };
        let snap = world.replace(specs(8080));
        let mut stream = synced(&snap);
        let snap2 = world.replace(specs(9090));
        let (old, new) = (
            "api.shop.system.internal|8080",
            "api.shop.system.internal|9090",
        );
        let out = stream.on_snapshot(&snap2);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].type_url.as_str(), names(&out[0])), (CDS, vec![new]));
        assert!(
            out[0].removed_resources.is_empty(),
            "the old cluster stays for now"
        );
        let (more, _) = stream.on_request(&delta(CDS, &[], &[], &out[0].nonce), &snap2);
        assert!(
            more.is_empty(),
            "routes wait for the new cluster's endpoints"
        );
        // Envoy subscribes to the new cluster's endpoints.
        let (out, _) = stream.on_request(&delta(EDS, &[new], &[], ""), &snap2);
        let seen = ack_all(&mut stream, &snap2, out);
        let steps: Vec<(&str, Vec<&str>, Vec<&str>)> = seen
            .iter()
            .map(|r| {
                let removed = r.removed_resources.iter().map(String::as_str).collect();
                (r.type_url.as_str(), names(r), removed)
            })
            .collect();
        assert_eq!(steps[0], (EDS, vec![new], vec![]));
        let (routes_at, cds_at, eds_at) = (
            steps.iter().position(|s| s.0 == RDS).unwrap(),
            steps
                .iter()
                .position(|s| s.0 == CDS && s.2 == [old])
                .unwrap(),
            steps
                .iter()
                .position(|s| s.0 == EDS && s.2 == [old])
                .unwrap(),
        );
        assert!(routes_at < cds_at && cds_at < eds_at, "{steps:?}");
    }

    /// After `*` is unsubscribed, what the client held through the wildcard alone is gone from
    /// its view: no removal is sent for it later.
    #[test]
    fn delta_what_a_dropped_wildcard_held_is_not_removed_again() {
        let mut world = World::new();
        world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let snap = world.set("/foo/other", Protocol::Http, &["10.0.0.2:8080"]);
        let mut stream = Tested::<DeltaStream>::default();
        let (out, _) = stream.on_request(&delta(EDS, &["*", BUZZ], &[], ""), &snap);
        ack_all(&mut stream, &snap, out);
        stream.on_request(&delta(EDS, &[], &["*"], ""), &snap);
        let snap2 = world.remove("/foo/other");
        let out = stream.on_snapshot(&snap2);
        assert!(
            out.iter().all(|r| r.removed_resources.is_empty()),
            "{out:?}"
        );
        let view = &stream.machine.common.types[ResourceType::Endpoint.index()].client;
        assert_eq!(view.names().map(|n| &**n).collect::<Vec<_>>(), [BUZZ]);
    }

    /// A reconnect listing more held names than a stream may name per type, or a subscription
    /// that grows past it, ends the stream.
    #[test]
    fn delta_names_beyond_the_limit_end_the_stream() {
        let snap = World::new().add_many(3);
        let limits = Limits { max_names: 10 };
        let mut stream = DeltaStream::new(limits);
        let mut request = delta(CDS, &[], &[], "");
        request.initial_resource_versions = (0..11)
            .map(|i| (format!("c{i}"), "1".to_string()))
            .collect();
        let (out, events) = stream.on_request(&request, &snap);
        assert!(out.is_empty());
        assert!(matches!(
            &events[..],
            [Event::Exhausted {
                kind: ResourceType::Cluster,
                ..
            }]
        ));

        let mut stream = DeltaStream::new(limits);
        let names: Vec<String> = (0..11).map(|i| format!("e{i}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let (_, events) = stream.on_request(&delta(EDS, &names[..6], &[], ""), &snap);
        assert!(events.is_empty());
        let (_, events) = stream.on_request(&delta(EDS, &names[6..], &[], ""), &snap);
        assert!(
            matches!(&events[..], [Event::Exhausted { .. }]),
            "{events:?}"
        );
    }
}
