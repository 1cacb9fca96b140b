//! The state-of-the-world ADS machine (`StreamAggregatedResources`): every response of a type
//! carries a version for the client's whole view of that type. Clusters and listeners go out
//! whole, endpoints and routes by change (see [`super::stream`] for the rules both flavours
//! keep).

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::Node;

use super::response::SotwResponse;
use super::snapshot::{ResourceType, XdsSnapshot, parse_version};
use super::stream::{Ads, ClientView, Event, NameSet, Push, Subscription, TypeState, nonce};
use super::wire::{NameList, SotwDecoder, SotwRequest};

#[derive(Debug, Default)]
struct SotwTypeState {
    /// What both flavours keep.
    common: TypeState,
    last_nonce: Option<String>,
    /// Version of the last response sent.
    sent_version: Option<String>,
    /// Of the names of the last request (see [`NameList::fingerprint`]).
    names_fingerprint: Option<(u64, usize)>,
}

/// One `StreamAggregatedResources` stream.
#[derive(Debug, Default)]
pub struct SotwStream {
    types: [SotwTypeState; 4],
    nonces: u64,
}

impl Ads for SotwStream {
    type Request = SotwRequest;
    type Response = SotwResponse;
    type Decoder = SotwDecoder;
    const MODE: &'static str = "sotw";

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
            state.common.pending = None;
            match &request.error_detail {
                Some(status) => events.push(Event::Nack {
                    kind,
                    version: state.sent_version.clone().unwrap_or_default(),
                    error: status.message.clone(),
                }),
                None => events.push(Event::Ack {
                    kind,
                    version: request.version_info.clone(),
                }),
            }
        }
        let first = !state.common.requested;
        if first {
            // Always answer the first request of a type on a stream (but see below).
            state.common.requested = true;
            state.common.must_answer = true;
        }
        set_sotw_interest(state, kind, &request.resource_names, snapshot);
        if first && request.response_nonce.is_empty() {
            adopt_held(state, kind, &request.version_info, snapshot);
        }
        (self.push(snapshot), events)
    }

    fn on_snapshot(&mut self, snapshot: &XdsSnapshot) -> Vec<Push<SotwResponse>> {
        self.push(snapshot)
    }

    fn holds(&self, snapshot: &XdsSnapshot) -> bool {
        ResourceType::ALL
            .into_iter()
            .all(|kind| self.types[kind.index()].common.holds(snapshot.of(kind)))
    }
}

impl SotwStream {
    fn push(&mut self, snapshot: &XdsSnapshot) -> Vec<Push<SotwResponse>> {
        let mut out = Vec::new();
        for kind in ResourceType::ALL {
            let common = &mut self.types[kind.index()].common;
            if !common.requested || common.pending.is_some() {
                continue;
            }
            let current = snapshot.of(kind);
            let mut found = common.diff(current);
            let whole = kind.is_state_of_the_world();
            if !whole {
                common.limit(&mut found.changed);
            }
            // Without removals in the protocol, a type sent by change has nothing to say when
            // its resources only went away (Envoy drops them with their cluster or listener).
            if found.changed.is_empty()
                && (found.removed.is_empty() || !whole)
                && !common.must_answer
            {
                if found.is_empty() {
                    common.settle(current);
                }
                continue;
            }
            let resend = common.changed_clusters(kind, &found.changed);
            for name in &found.removed {
                common.client.remove(name);
            }
            common
                .client
                .extend(current, found.changed.iter().map(|r| (&r.name, r.version)));
            let resources = if whole {
                current
                    .values()
                    .filter(|r| common.interest.wants(&r.name))
                    .cloned()
                    .collect()
            } else {
                found.changed
            };
            let version = common.client.version_info();
            let nonce = nonce(&mut self.nonces);
            let state = &mut self.types[kind.index()];
            state.common.pending = Some(nonce.clone());
            state.common.must_answer = false;
            state.last_nonce = Some(nonce.clone());
            state.sent_version = Some(version.clone());
            out.push(Push {
                kind,
                response: SotwResponse {
                    version_info: version,
                    resources,
                    type_url: kind.type_url().to_string(),
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

/// A client that reconnects (to this agent after a restart, or to another agent of the same
/// build) sends the version it last accepted. Versions are digests of what a client holds, so
/// when it equals the digest of what the client wants now, the client already holds exactly
/// that: nothing is re-sent. A type sent by change (endpoints, routes) is answered with no
/// resources, which changes nothing; a whole type is not answered at all (a response would
/// have to repeat every resource), as control planes do when the client is up to date.
fn adopt_held(
    state: &mut SotwTypeState,
    kind: ResourceType,
    version: &str,
    snapshot: &XdsSnapshot,
) {
    if parse_version(version).is_none() {
        return;
    }
    let common = &mut state.common;
    let interest = &common.interest;
    // Usually the client wants the whole type (Envoy subscribes to the endpoints of every
    // cluster it has, which `set_sotw_interest` has just held as the snapshot's index): then
    // what it should hold is the snapshot's map itself, whose digest is computed once per
    // snapshot, not once per stream.
    let wanted = if interest.wildcard || interest.names.is_all_of(snapshot.name_index(kind)) {
        ClientView::whole(snapshot.of(kind), snapshot.whole(kind))
    } else {
        let current = snapshot.names(kind, interest.names.len());
        let mut wanted = ClientView::default();
        for resource in interest.names.iter().filter_map(|n| current.get(n)) {
            wanted.insert(resource.name.clone(), resource.version);
        }
        wanted
    };
    if wanted.version_info() != version {
        return;
    }
    common.client = wanted;
    common.dirty.clear();
    common.backlog.clear();
    common.must_answer = !kind.is_state_of_the_world();
    state.sent_version = Some(version.to_string());
}

/// Takes a SotW request's names as the type's subscription. Envoy repeats the whole list on
/// every request (ten thousand names on each endpoint ACK at that scale), so the usual case,
/// the same list as last time, is recognised by its fingerprint (a hash of the names' bytes as
/// they came, see [`super::wire`]) without a lookup per name; the same names in another order
/// are compared name by name below.
fn set_sotw_interest(
    state: &mut SotwTypeState,
    kind: ResourceType,
    names: &NameList,
    snapshot: &XdsSnapshot,
) {
    let fingerprint = names.fingerprint();
    if state.names_fingerprint == Some(fingerprint) {
        return;
    }
    state.names_fingerprint = Some(fingerprint);
    let common = &mut state.common;
    let stars = names.iter().filter(|n| *n == "*").count();
    let wildcard = stars > 0 || (names.is_empty() && kind.is_wildcard_by_default());
    let named = || names.iter().filter(|n| *n != "*");
    let named_count = names.len() - stars;
    let interest = &mut common.interest;
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
            fresh.extend(named().map(|n| {
                interest
                    .names
                    .get(n)
                    .cloned()
                    .unwrap_or_else(|| current.intern(n))
            }));
            fresh.into_iter().collect()
        }
    };
    let added: Vec<Arc<str>> = fresh
        .iter()
        .filter(|n| !interest.names.contains(n))
        .cloned()
        .collect();
    let dropped: Vec<Arc<str>> = interest
        .names
        .iter()
        .filter(|n| !fresh.contains(n))
        .cloned()
        .collect();
    if wildcard != interest.wildcard {
        common.baseline = None;
    }
    if !dropped.is_empty() || (interest.wildcard && !wildcard) {
        interest.narrowed();
    }
    interest.wildcard = wildcard;
    interest.names = fresh;
    for name in dropped {
        if !interest.wants(&name) {
            common.client.remove(&name);
        }
    }
    // A changed subscription is answered: whole types always, the others when names were added.
    common.must_answer |= kind.is_state_of_the_world() || !added.is_empty();
    for name in added {
        common.look_again(name);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, HashMap};

    use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
    use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
    use envoy_types::pb::google::rpc::Status as RpcStatus;
    use prost::Message;

    use super::*;
    use crate::mesh::Protocol;
    use crate::xds::stream::RESPONSE_BUDGET;
    use crate::xds::testing::{
        BUZZ, CDS, EDS, LDS, OTHER, RDS, Tested, World, big_world, names_of,
    };

    /// A request as Envoy sends it, read as the server reads it.
    fn sotw(type_url: &str, names: &[&str], version: &str, nonce: &str) -> SotwRequest {
        let sent = DiscoveryRequest {
            type_url: type_url.to_string(),
            resource_names: names.iter().map(|s| s.to_string()).collect(),
            version_info: version.to_string(),
            response_nonce: nonce.to_string(),
            ..DiscoveryRequest::default()
        };
        SotwRequest::decode(sent.encode_to_vec().as_slice()).unwrap()
    }

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

    /// After an agent restart (a new stream, the same snapshot), a client that says which
    /// versions it holds gets nothing again; one that holds something else gets it all.
    #[test]
    fn sotw_reconnect_with_the_versions_held_resends_nothing() {
        let mut world = World::new();
        world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:8080"]);
        let snap = world.set("/foo/other", Protocol::Http, &["10.0.0.2:8080"]);
        let mut stream = Tested::<SotwStream>::default();
        let (cds, _) = stream.on_request(&sotw(CDS, &[], "", ""), &snap);
        stream.on_request(&ack(&cds[0], &[]), &snap);
        let (eds, _) = stream.on_request(&sotw(EDS, &[BUZZ, OTHER], "", ""), &snap);
        stream.on_request(&ack(&eds[0], &[BUZZ, OTHER]), &snap);
        let (cds_version, eds_version) = (&cds[0].version_info, &eds[0].version_info);

        let mut again = Tested::<SotwStream>::default();
        let (out, _) = again.on_request(&sotw(CDS, &[], cds_version, ""), &snap);
        assert!(out.is_empty(), "clusters held whole: no answer");
        let (out, _) = again.on_request(&sotw(EDS, &[BUZZ, OTHER], eds_version, ""), &snap);
        assert_eq!(out.len(), 1, "endpoints are answered");
        assert!(out[0].resources.is_empty(), "with nothing in it");
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
        let (out, _) = stale.on_request(&sotw(EDS, &[BUZZ, OTHER], eds_version, ""), &snap2);
        assert_eq!(assignments(&out[0]), [BUZZ, OTHER]);
        let mut fewer = Tested::<SotwStream>::default();
        let (out, _) = fewer.on_request(&sotw(EDS, &[BUZZ], eds_version, ""), &snap);
        assert_eq!(assignments(&out[0]), [BUZZ]);
        let mut foreign = Tested::<SotwStream>::default();
        let (out, _) = foreign.on_request(&sotw(CDS, &[], "v1", ""), &snap);
        assert_eq!(out[0].resources.len(), 2);
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
        let subscription = &stream.machine.types[eds].common.interest.names;
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
        let subscription = &stream.machine.types[eds].common.interest.names;
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

        // New content does go out.
        let snap3 = world.set("/foo/bar/buzz", Protocol::Tcp, &["10.0.0.1:8080"]);
        assert_eq!(stream.on_snapshot(&snap3).len(), 1);
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
}
