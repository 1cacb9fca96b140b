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

use crate::translate::envoy::{ResourceType, XdsResource, XdsSnapshot};

/// What a stream reports for logs, metrics and `/debug/xds`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Ack { kind: ResourceType, version: String },
    Nack { kind: ResourceType, version: String, error: String },
    StaleNonce { kind: ResourceType, nonce: String },
    UnknownType { type_url: String },
}

fn nonce(counter: &mut u64) -> String {
    *counter += 1;
    counter.to_string()
}

/// Which resources of a type the client wants.
#[derive(Debug, Default, Clone)]
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
    /// Version of the last response sent, and per-resource versions it held.
    sent_version: Option<String>,
    sent: HashMap<String, String>,
    acked_version: Option<String>,
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
        state.interest = sotw_interest(kind, &request.resource_names);
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
            let resources: Vec<&Arc<XdsResource>> = snapshot
                .of(kind)
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
            state.sent = resources
                .iter()
                .map(|r| (r.name.clone(), r.version.clone()))
                .collect();
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
    let wildcard = names.iter().any(|n| n == "*")
        || (names.is_empty() && kind.is_wildcard_by_default());
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
        for b in r.name.bytes().chain([0]).chain(r.version.bytes()).chain([0]) {
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
    force: bool,
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
        }
        for name in &request.resource_names_subscribe {
            if name == "*" {
                state.interest.wildcard = true;
            } else if state.interest.names.insert(name.clone()) {
                state.told_absent.remove(name);
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
                // after a NACK re-sending the same bytes would only be rejected again.
                state.known.extend(sent);
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
            let changed: Vec<&Arc<XdsResource>> = current
                .values()
                .filter(|r| state.interest.wants(&r.name))
                .filter(|r| state.known.get(&r.name) != Some(&r.version))
                .collect();
            let mut removed: Vec<String> = state
                .known
                .keys()
                .filter(|name| !current.contains_key(*name))
                .cloned()
                .collect();
            // Explicitly subscribed names that do not exist: say so once, so Envoy does not
            // wait for them until its fetch timeout.
            let absent: Vec<String> = state
                .interest
                .names
                .iter()
                .filter(|n| !current.contains_key(*n) && !state.known.contains_key(*n))
                .filter(|n| !state.told_absent.contains(*n))
                .cloned()
                .collect();
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
            }
        }
        out
    }
}
