//! The incremental ADS machine (`DeltaAggregatedResources`): subscriptions change by name,
//! responses carry only what changed and what was removed, each resource with its own version
//! (see [`super::stream`] for the rules both flavours keep).

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::Node;

use super::inbound::Plain;
use super::response::DeltaResponse;
use super::snapshot::{Names, ResourceType, XdsSnapshot, parse_version};
use super::stream::{Ads, ClientView, Event, NameSet, Push, Subscription, TypeState, nonce};
use super::wire::{DeltaRequest, VersionList};

#[derive(Debug, Default)]
struct DeltaTypeState {
    /// What both flavours keep.
    common: TypeState,
    /// Explicitly subscribed names we already told the client do not exist.
    told_absent: NameSet,
    /// Versions sent in the in-flight response; a NACK leaves the client on its old ones.
    in_flight: Vec<(Arc<str>, u64)>,
    /// The snapshot version of the in-flight response, reported on its ACK or NACK.
    in_flight_version: String,
    /// The interest's narrowings when the in-flight response was sent: while they stand, every
    /// resource in it is still wanted.
    in_flight_narrowings: u64,
}

/// One `DeltaAggregatedResources` stream.
#[derive(Debug, Default)]
pub struct DeltaStream {
    types: [DeltaTypeState; 4],
    nonces: u64,
}

impl Ads for DeltaStream {
    type Request = DeltaRequest;
    type Response = DeltaResponse;
    type Decoder = Plain<DeltaRequest>;
    const MODE: &'static str = "delta";

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
        let current = snapshot.names(
            kind,
            request.initial_resource_versions.len() + request.resource_names_subscribe.len(),
        );
        let state = &mut self.types[kind.index()];
        let common = &mut state.common;
        let mut events = Vec::new();

        if !common.requested {
            common.requested = true;
            common.must_answer = true;
            // Legacy wildcard: the first request for a wildcard type that names nothing.
            common.interest.wildcard =
                request.resource_names_subscribe.is_empty() && kind.is_wildcard_by_default();
            // A reconnecting client says what it holds. A version this agent did not make
            // (another control plane's) matches nothing, so the resource is sent again.
            common.client = held_view(&request.initial_resource_versions, &current, snapshot, kind);
            common.baseline = None;
        }
        let subscribe = &request.resource_names_subscribe;
        let everything = common.interest.names.is_empty().then(|| {
            let names = subscribe.iter().map(|name| (name.as_str(), None));
            snapshot.every_resource(kind, subscribe.len(), names)
        });
        if let Some(Some(index)) = everything {
            // A first subscription to every name of the type (Envoy's to the endpoints of all
            // its clusters): the snapshot's index, shared. Nothing was subscribed before, so
            // nothing was told absent, and without a baseline nothing is queued.
            common.interest.names = Subscription::whole(index.clone());
            state.told_absent.clear();
            common.baseline = None;
        } else {
            for name in subscribe {
                if name == "*" {
                    common.interest.wildcard = true;
                    common.baseline = None;
                } else if !common.interest.names.contains(name.as_str()) {
                    let name = current.intern(name);
                    common.interest.names.insert(name.clone());
                    state.told_absent.remove(&name);
                    common.look_again(name);
                }
            }
            // Counted first: the index is built only for a subscription as large as the type.
            let names = &mut common.interest.names;
            if !subscribe.is_empty() && names.len() == snapshot.of(kind).len() {
                names.compact(snapshot.name_index(kind));
            }
        }
        if !request.resource_names_unsubscribe.is_empty() {
            common.interest.narrowed();
        }
        for name in &request.resource_names_unsubscribe {
            if name == "*" {
                common.interest.wildcard = false;
            } else {
                common.interest.names.remove(name.as_str());
                state.told_absent.remove(name.as_str());
            }
            if !common.interest.wants(name) {
                common.client.remove(name);
            }
        }

        if !request.response_nonce.is_empty() {
            if common.pending.as_deref() == Some(request.response_nonce.as_str()) {
                common.pending = None;
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
                let in_flight = std::mem::take(&mut state.in_flight);
                if state.in_flight_narrowings == common.interest.narrowings() {
                    let sent = in_flight.iter().map(|(name, version)| (name, *version));
                    common.client.extend(snapshot.of(kind), sent);
                } else {
                    for (name, version) in in_flight {
                        if common.interest.wants(&name) {
                            common.client.insert(name, version);
                        }
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

    fn on_snapshot(&mut self, snapshot: &XdsSnapshot) -> Vec<Push<DeltaResponse>> {
        self.push(snapshot)
    }

    fn holds(&self, snapshot: &XdsSnapshot) -> bool {
        ResourceType::ALL
            .into_iter()
            .all(|kind| self.types[kind.index()].common.holds(snapshot.of(kind)))
    }
}

/// What a reconnecting client says it holds, as a view. Usually it holds exactly the whole
/// type of the current snapshot (nothing changed while it was away, or it reconnected to
/// another agent of the same mesh): then the view is the snapshot's map itself, with no map
/// built. A profile of a restart at 10k services had building these views entry by entry as a
/// fifth of the agent's CPU.
fn held_view(
    listed: &VersionList,
    current: &Names<'_>,
    snapshot: &XdsSnapshot,
    kind: ResourceType,
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
        view.insert(current.intern(name), version(v));
    }
    view
}

impl DeltaStream {
    fn push(&mut self, snapshot: &XdsSnapshot) -> Vec<Push<DeltaResponse>> {
        let mut out = Vec::new();
        for kind in ResourceType::ALL {
            let state = &mut self.types[kind.index()];
            let common = &mut state.common;
            if !common.requested || common.pending.is_some() {
                continue;
            }
            let mut found = common.diff(snapshot.of(kind));
            // Explicitly subscribed names that do not exist: say so once, so Envoy does not
            // wait for them until its fetch timeout.
            found
                .absent
                .retain(|name| !state.told_absent.contains(name));
            common.limit(&mut found.changed);
            if found.is_empty() && !common.must_answer {
                common.settle(snapshot.of(kind));
                continue;
            }
            let resend = common.changed_clusters(kind, &found.changed);
            for name in &found.removed {
                common.client.remove(name);
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
            state.in_flight_narrowings = state.common.interest.narrowings();
            state.common.pending = Some(nonce.clone());
            state.common.must_answer = false;
            let version = snapshot.version.to_string();
            state.in_flight_version = version.clone();
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
            self.types[ResourceType::Endpoint.index()]
                .common
                .resend(resend);
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
    use crate::xds::testing::{BUZZ, CDS, EDS, Tested, World, big_world, names_of};

    fn delta(
        type_url: &str,
        subscribe: &[&str],
        unsubscribe: &[&str],
        nonce: &str,
    ) -> DeltaRequest {
        DeltaRequest {
            type_url: type_url.to_string(),
            resource_names_subscribe: subscribe.iter().map(|s| s.to_string()).collect(),
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
        assert_eq!(out[0].removed_resources, ["gone|1"]);
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
        let (out, _) = stream.on_request(&request, &snap);
        assert!(snap.indexes.built(ResourceType::Cluster));
        assert_eq!(names(&out[0]), [stale], "only what differs");
        assert_eq!(out[0].removed_resources, ["gone|1"]);

        // Every assignment held and subscribed, and one name that does not exist.
        let assignments = snap.of(ResourceType::Endpoint);
        let mut subscribe: Vec<&str> = assignments.keys().map(|n| &**n).collect();
        subscribe.push("absent|1");
        let mut request = delta(EDS, &subscribe, &[], "");
        request.initial_resource_versions = assignments
            .values()
            .map(|r| (r.name.to_string(), r.version_string()))
            .collect();
        let (out, _) = stream.on_request(&request, &snap);
        assert!(out[0].resources.is_empty(), "nothing to send again");
        assert_eq!(out[0].removed_resources, ["absent|1"]);
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
        let view = &stream.machine.types[ResourceType::Cluster.index()]
            .common
            .client;
        assert!(view.is_exactly(clusters), "the snapshot's map, shared");
        let mut by_name = ClientView::default();
        for resource in clusters.values() {
            by_name.insert(resource.name.clone(), resource.version);
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
        let subscription = &other.machine.types[ResourceType::Endpoint.index()]
            .common
            .interest
            .names;
        assert!(!subscription.is_all_of(snap.name_index(ResourceType::Endpoint)));
        assert!(!subscription.contains(all[3]) && subscription.len() == all.len() - 1);
        // The one left out, in a later request (Envoy subscribes batch by batch, as clusters
        // arrive): every name now, held as the index.
        other.on_request(&delta(EDS, &[all[3]], &[], ""), &snap);
        let subscription = &other.machine.types[ResourceType::Endpoint.index()]
            .common
            .interest
            .names;
        assert!(subscription.is_all_of(snap.name_index(ResourceType::Endpoint)));
        assert!(subscription.contains(all[3]) && subscription.len() == all.len());

        let mut stream = Tested::<DeltaStream>::default();
        let (mut out, _) = stream.on_request(&delta(EDS, &all, &[], ""), &snap);
        let subscription = &stream.machine.types[ResourceType::Endpoint.index()]
            .common
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
            stream.machine.types[ResourceType::Endpoint.index()]
                .common
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
        assert_eq!(urls, [CDS, EDS]);
        assert_eq!(names(&out[1]), [BUZZ]);
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
}
