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
//! - the first request of each type is always answered, even with nothing, so Envoy's
//!   initialisation never waits on us.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse, Resource,
};

use imbl::ordmap::DiffItem;

use crate::translate::envoy::{ResourceMap, ResourceType, XdsResource, XdsSnapshot};

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

/// Which resources of a type the client wants.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Interest {
    wildcard: bool,
    names: BTreeSet<String>,
}

impl Interest {
    fn wants(&self, name: &str) -> bool {
        self.wildcard || self.names.contains(name)
    }
}

// ---------------------------------------------------------------------------------------------
// State of the world
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct SotwType {
    /// Has the client asked for this type on this stream.
    requested: bool,
    interest: Interest,
    /// Nonce of the response in flight (sent, not yet ACKed or NACKed).
    pending: Option<String>,
    last_nonce: Option<String>,
    /// Version of the last response sent, and (clusters only: they alone decide what else
    /// to re-send) the per-resource versions it held.
    sent_version: Option<String>,
    sent: HashMap<String, String>,
    acked_version: Option<String>,
    /// The resources of this type the last push looked at, for the current interest: while
    /// the snapshot still holds the very same map, nothing can have changed, so an ACK or a
    /// snapshot that changed only other types costs nothing instead of a scan of the type.
    evaluated: Option<ResourceMap>,
    /// Send even if the content did not change (endpoints after their cluster changed).
    force: bool,
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
        let first = !state.requested;
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
            state.pending = None;
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
        state.requested = true;
        let interest = sotw_interest(kind, &request.resource_names);
        if interest != state.interest {
            state.interest = interest;
            state.evaluated = None;
        }
        if first {
            // Always answer the first request of a type on a stream.
            state.force = true;
        }
        (self.push(snapshot), events)
    }

    /// A new snapshot: push whatever changed for every requested type, in order.
    pub fn on_snapshot(&mut self, snapshot: &XdsSnapshot) -> Vec<DiscoveryResponse> {
        self.push(snapshot)
    }

    fn push(&mut self, snapshot: &XdsSnapshot) -> Vec<DiscoveryResponse> {
        let mut out = Vec::new();
        for kind in ResourceType::ALL {
            let state = &mut self.types[kind.index()];
            if !state.requested || state.pending.is_some() {
                continue;
            }
            let current = snapshot.of(kind);
            if !state.force && state.evaluated.as_ref().is_some_and(|e| e.ptr_eq(current)) {
                continue;
            }
            state.evaluated = Some(current.clone());
            let resources: Vec<&Arc<XdsResource>> = current
                .values()
                .filter(|r| state.interest.wants(&r.name))
                .collect();
            let version = content_version(&resources);
            if !state.force && state.sent_version.as_deref() == Some(version.as_str()) {
                continue;
            }
            let changed_clusters: Vec<String> = if kind == ResourceType::Cluster {
                resources
                    .iter()
                    .filter(|r| matches!(state.sent.get(&r.name), Some(v) if *v != r.version))
                    .map(|r| r.name.clone())
                    .collect()
            } else {
                Vec::new()
            };
            let nonce = nonce(&mut self.nonces);
            let state = &mut self.types[kind.index()];
            if kind == ResourceType::Cluster {
                state.sent = resources
                    .iter()
                    .map(|r| (r.name.clone(), r.version.clone()))
                    .collect();
            }
            state.sent_version = Some(version.clone());
            state.pending = Some(nonce.clone());
            state.last_nonce = Some(nonce.clone());
            state.force = false;
            out.push(DiscoveryResponse {
                version_info: version,
                resources: resources.iter().map(|r| r.body.clone()).collect(),
                type_url: kind.type_url().to_string(),
                nonce,
                ..DiscoveryResponse::default()
            });
            if !changed_clusters.is_empty() {
                self.types[ResourceType::Endpoint.index()].force = true;
            }
        }
        out
    }
}

fn sotw_interest(kind: ResourceType, names: &[String]) -> Interest {
    let wildcard =
        names.iter().any(|n| n == "*") || (names.is_empty() && kind.is_wildcard_by_default());
    Interest {
        wildcard,
        names: names.iter().filter(|n| *n != "*").cloned().collect(),
    }
}

/// The version of a SotW response: a hash of the names and versions it holds, so the same
/// content always carries the same version.
fn content_version(resources: &[&Arc<XdsResource>]) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for r in resources {
        for b in r
            .name
            .bytes()
            .chain([0])
            .chain(r.version.bytes())
            .chain([0])
        {
            hash = (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{hash:016x}")
}

// ---------------------------------------------------------------------------------------------
// Delta (incremental)
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct DeltaType {
    requested: bool,
    interest: Interest,
    /// What the client holds, by our knowledge: name → version.
    known: HashMap<String, String>,
    /// Explicitly subscribed names we already told the client do not exist.
    told_absent: HashSet<String>,
    pending: Option<String>,
    /// Versions sent in the in-flight response; a NACK leaves the client on its old ones.
    in_flight: HashMap<String, String>,
    /// The snapshot version of the in-flight response, reported on its ACK or NACK.
    in_flight_version: String,
    /// The resources this type was last reconciled against; the next push looks only at what
    /// differs from them, plus `dirty`. `None` means look at everything.
    synced: Option<ResourceMap>,
    /// Names to look at on the next push whatever the snapshot says (new subscriptions,
    /// endpoints to re-send).
    dirty: BTreeSet<String>,
    force: bool,
}

impl DeltaType {
    /// Of the named resources: the ones to send (wanted, and not at the version the client
    /// holds), the ones to remove (held but gone), and subscribed ones that do not exist and
    /// were not yet reported absent.
    fn delta_of<'a, 's>(
        &self,
        current: &'s ResourceMap,
        names: impl Iterator<Item = &'a String>,
    ) -> (Vec<&'s Arc<XdsResource>>, Vec<String>, Vec<String>) {
        let (mut changed, mut removed, mut absent) = (Vec::new(), Vec::new(), Vec::new());
        let mut seen = HashSet::new();
        for name in names {
            if !seen.insert(name.as_str()) {
                continue;
            }
            match current.get(name) {
                Some(resource)
                    if self.interest.wants(name)
                        && self.known.get(name) != Some(&resource.version) =>
                {
                    changed.push(resource);
                }
                Some(_) => {}
                None if self.known.contains_key(name) => removed.push(name.clone()),
                // Explicitly subscribed names that do not exist: say so once, so Envoy does
                // not wait for them until its fetch timeout.
                None if self.interest.names.contains(name) && !self.told_absent.contains(name) => {
                    absent.push(name.clone())
                }
                None => {}
            }
        }
        changed.sort_by(|a, b| a.name.cmp(&b.name));
        (changed, removed, absent)
    }
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

    /// The resources (and versions) the client holds of a type, as far as we know.
    pub fn known(&self, kind: ResourceType) -> &HashMap<String, String> {
        &self.types[kind.index()].known
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
        let state = &mut self.types[kind.index()];
        let mut events = Vec::new();

        if !state.requested {
            state.requested = true;
            state.force = true;
            // Legacy wildcard: the first request for a wildcard type that names nothing.
            state.interest.wildcard =
                request.resource_names_subscribe.is_empty() && kind.is_wildcard_by_default();
            state.known = request.initial_resource_versions.clone();
            state.synced = None;
        }
        for name in &request.resource_names_subscribe {
            if name == "*" {
                state.interest.wildcard = true;
                state.synced = None;
            } else if state.interest.names.insert(name.clone()) {
                state.told_absent.remove(name);
                state.dirty.insert(name.clone());
            }
        }
        for name in &request.resource_names_unsubscribe {
            if name == "*" {
                state.interest.wildcard = false;
            } else {
                state.interest.names.remove(name);
                state.told_absent.remove(name);
            }
            if !state.interest.wants(name) {
                state.known.remove(name);
            }
        }

        if !request.response_nonce.is_empty() {
            if state.pending.as_deref() == Some(request.response_nonce.as_str()) {
                state.pending = None;
                let sent = std::mem::take(&mut state.in_flight);
                match &request.error_detail {
                    Some(status) => events.push(Event::Nack {
                        kind,
                        version: std::mem::take(&mut state.in_flight_version),
                        error: status.message.clone(),
                    }),
                    None => events.push(Event::Ack {
                        kind,
                        version: std::mem::take(&mut state.in_flight_version),
                    }),
                }
                // Either way the client has seen these versions: after an ACK it holds them,
                // after a NACK re-sending the same bytes would only be rejected again. Names it
                // unsubscribed from meanwhile are gone from its view.
                let interest = &state.interest;
                state
                    .known
                    .extend(sent.into_iter().filter(|(name, _)| interest.wants(name)));
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
            if !state.requested || state.pending.is_some() {
                continue;
            }
            let current = snapshot.of(kind);
            let (changed, mut removed, absent) = match state.synced.take() {
                Some(synced) => {
                    // Only what changed since the last reconciled snapshot, plus names that
                    // need a look for other reasons: a push costs the change, not the mesh.
                    let mut names: BTreeSet<String> = std::mem::take(&mut state.dirty);
                    names.extend(synced.diff(current).map(|d| match d {
                        DiffItem::Add(name, _) | DiffItem::Remove(name, _) => name.clone(),
                        DiffItem::Update { new: (name, _), .. } => name.clone(),
                    }));
                    state.delta_of(current, names.iter())
                }
                None => {
                    state.dirty.clear();
                    state.delta_of(
                        current,
                        current
                            .keys()
                            .chain(state.known.keys())
                            .chain(state.interest.names.iter()),
                    )
                }
            };
            state.synced = Some(current.clone());
            if changed.is_empty() && removed.is_empty() && absent.is_empty() && !state.force {
                continue;
            }
            for name in &removed {
                state.known.remove(name);
            }
            state.told_absent.extend(absent.iter().cloned());
            removed.extend(absent);
            removed.sort();
            let changed_clusters: Vec<String> = if kind == ResourceType::Cluster {
                changed
                    .iter()
                    .filter(|r| state.known.contains_key(&r.name))
                    .map(|r| r.name.clone())
                    .collect()
            } else {
                Vec::new()
            };
            let nonce = nonce(&mut self.nonces);
            let state = &mut self.types[kind.index()];
            state.in_flight = changed
                .iter()
                .map(|r| (r.name.clone(), r.version.clone()))
                .collect();
            state.pending = Some(nonce.clone());
            state.in_flight_version = snapshot.version.to_string();
            state.force = false;
            out.push(DeltaDiscoveryResponse {
                system_version_info: snapshot.version.to_string(),
                resources: changed
                    .iter()
                    .map(|r| Resource {
                        name: r.name.clone(),
                        version: r.version.clone(),
                        resource: Some(r.body.clone()),
                        ..Resource::default()
                    })
                    .collect(),
                type_url: kind.type_url().to_string(),
                removed_resources: removed,
                nonce,
                ..DeltaDiscoveryResponse::default()
            });
            // Envoy re-creates a changed cluster and waits for its endpoints again.
            let endpoints = &mut self.types[ResourceType::Endpoint.index()];
            for name in changed_clusters {
                endpoints.known.remove(&name);
                endpoints.dirty.insert(name);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use envoy_types::pb::google::rpc::Status as RpcStatus;

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
        assert_eq!(out[0].resources.len(), 2);
        let (out, _) = stream.on_request(&ack(&out[0], &[BUZZ]), &snap);
        assert_eq!(
            out[0].resources.len(),
            1,
            "unsubscribed names leave the response"
        );
    }

    #[test]
    fn sotw_pushes_in_cds_eds_lds_rds_order_and_resends_endpoints_after_a_cluster_change() {
        let mut world = World::new();
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
            (BUZZ.to_string(), clusters[BUZZ].version.clone()),
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
            !stream.known(ResourceType::Endpoint).contains_key(BUZZ),
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
