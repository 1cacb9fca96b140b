//! Fixtures for the stream state machines' tests: a little mesh that can be edited and its real
//! translations, and a stream wrapped the way the server drives it.

use super::snapshot::{ResourceType, TYPES, XdsSnapshot};
use super::stream::{Ads, Event};
use super::wire::SotwRequest;
use std::sync::Arc;

use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use prost::Message;

use crate::mesh::route::{Backend, BackendTarget, RequestMatch, test_rule};
use crate::mesh::{EndpointSet, MeshPath, MeshState, Protocol, ServicePort, ServiceSpec};
use crate::translate::envoy::EnvoyTranslator;

pub(super) const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub(super) const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
pub(super) const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
pub(super) const RDS: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
pub(super) const SDS: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";

/// A SotW request as Envoy sends it, read as the server reads it.
pub(super) fn sotw(type_url: &str, names: &[&str], version: &str, nonce: &str) -> SotwRequest {
    let sent = DiscoveryRequest {
        type_url: type_url.to_string(),
        resource_names: names.iter().map(|s| s.to_string()).collect(),
        version_info: version.to_string(),
        response_nonce: nonce.to_string(),
        ..DiscoveryRequest::default()
    };
    SotwRequest::decode(sent.encode_to_vec().as_slice()).unwrap()
}

/// A little mesh that can be edited, and its translations.
pub(super) struct World {
    state: MeshState,
    translator: EnvoyTranslator,
    /// The services [`World::replace`] set.
    paths: Vec<MeshPath>,
}

impl World {
    pub(super) fn new() -> Self {
        World {
            state: MeshState::new("240.240.0.0/16".parse().unwrap()),
            translator: EnvoyTranslator::default(),
            paths: Vec::new(),
        }
    }

    pub(super) fn set(
        &mut self,
        path: &str,
        protocol: Protocol,
        endpoints: &[&str],
    ) -> XdsSnapshot {
        let spec = ServiceSpec::new(
            path.parse().unwrap(),
            vec![ServicePort {
                name: None,
                port: 8080,
                protocol,
                endpoints: EndpointSet::parsed(endpoints),
                hosts: Default::default(),
            }],
        );
        self.state.upsert(spec).unwrap();
        self.snapshot()
    }

    /// `count` more HTTP services, `/many/s<i>`, translated once.
    pub(super) fn add_many(&mut self, count: usize) -> XdsSnapshot {
        for i in 0..count {
            let spec = ServiceSpec::new(
                format!("/many/s{i}").parse().unwrap(),
                vec![ServicePort {
                    name: None,
                    port: 8080,
                    protocol: Protocol::Http,
                    endpoints: EndpointSet::parsed(&["10.0.0.1:8080"]),
                    hosts: Default::default(),
                }],
            );
            self.state.upsert(spec).unwrap();
        }
        self.snapshot()
    }

    /// Makes the mesh exactly `specs` (services not among them go), translated once.
    pub(super) fn replace(&mut self, specs: Vec<ServiceSpec>) -> XdsSnapshot {
        let paths: Vec<_> = specs.iter().map(|s| s.path.clone()).collect();
        for old in std::mem::take(&mut self.paths) {
            if !paths.contains(&old) {
                self.state.remove(&old);
            }
        }
        for spec in specs {
            self.state.upsert(spec).unwrap();
        }
        self.paths = paths;
        self.snapshot()
    }

    pub(super) fn remove(&mut self, path: &str) -> XdsSnapshot {
        self.state.remove(&path.parse().unwrap());
        self.snapshot()
    }

    pub(super) fn snapshot(&mut self) -> XdsSnapshot {
        let mesh = self.state.snapshot();
        self.translator.translate(&mesh)
    }
}

pub(super) const BUZZ: &str = "buzz.bar.foo.system.internal|8080";
pub(super) const OTHER: &str = "other.foo.system.internal|8080";
/// A mesh whose endpoints add up to more than one response's budget.
/// The names of one type of `snap`, owned: tests hand them to requests as `&str`s.
pub(super) fn names_of(snap: &XdsSnapshot, kind: ResourceType) -> Vec<String> {
    snap.of(kind).keys().map(|name| name.to_string()).collect()
}

pub(super) fn big_world(budget: usize) -> (World, XdsSnapshot) {
    let mut world = World::new();
    let endpoints: Vec<String> = (0..200)
        .map(|i| format!("10.1.{}.{}:8080", i / 250, i % 250))
        .collect();
    let endpoints: Vec<&str> = endpoints.iter().map(String::as_str).collect();
    // Services of the same size, as many as make the assignments more than twice `budget`,
    // and at least 150 (s0 … s149: tests rely on s97 … s99 sorting last).
    let one = World::new()
        .set("/big/s0", Protocol::Http, &endpoints)
        .of(ResourceType::Endpoint)
        .values()
        .map(|r| r.body.value.len())
        .sum::<usize>();
    for k in 0..(2 * budget / one + 1).max(150) {
        world.set(&format!("/big/s{k}"), Protocol::Http, &endpoints);
    }
    let snap = world.snapshot();
    let total: usize = snap
        .of(ResourceType::Endpoint)
        .values()
        .map(|r| r.body.value.len())
        .sum();
    assert!(total > 2 * budget, "the mesh is too small: {total} bytes");
    (world, snap)
}

/// The type URL a response carries.
pub(super) trait TypeUrl {
    fn type_url(&self) -> &str;
}

impl TypeUrl for super::SotwResponse {
    fn type_url(&self) -> &str {
        &self.type_url
    }
}

impl TypeUrl for super::DeltaResponse {
    fn type_url(&self) -> &str {
        &self.type_url
    }
}

/// A stream machine under test, driven as the server drives it: each push's type is checked
/// against its response, and the last version the client ACKed per type is kept from the
/// events, as `/debug/xds` keeps it.
#[derive(Default)]
pub(super) struct Tested<A: Ads> {
    pub(super) machine: A,
    acked: [Option<String>; TYPES],
}

impl<A: Ads> Tested<A>
where
    A::Response: TypeUrl,
{
    pub(super) fn on_request(
        &mut self,
        request: &A::Request,
        snapshot: &XdsSnapshot,
    ) -> (Vec<A::Response>, Vec<Event>) {
        let (pushes, events) = self.machine.on_request(request, snapshot);
        for event in &events {
            if let Event::Ack { kind, version } = event {
                self.acked[kind.index()] = Some(version.clone());
            }
        }
        (Self::responses(pushes), events)
    }

    pub(super) fn on_snapshot(&mut self, snapshot: &XdsSnapshot) -> Vec<A::Response> {
        Self::responses(self.machine.on_snapshot(snapshot))
    }

    /// The version the client last ACKed for a type.
    pub(super) fn acked(&self, kind: ResourceType) -> Option<&str> {
        self.acked[kind.index()].as_deref()
    }

    fn responses(pushes: Vec<super::stream::Push<A::Response>>) -> Vec<A::Response> {
        pushes
            .into_iter()
            .map(|push| {
                assert_eq!(push.kind.type_url(), push.response.type_url());
                push.response
            })
            .collect()
    }
}

/// A service `path` on `port` with `protocol`, its endpoints `endpoints`, every request routed
/// to `backends` (service path, port, weight), or to itself without any.
pub(super) fn routed(
    path: &str,
    port: u16,
    protocol: Protocol,
    endpoints: &[&str],
    backends: &[(&str, u16, u32)],
) -> ServiceSpec {
    let mut spec = ServiceSpec::new(
        path.parse().unwrap(),
        vec![ServicePort {
            name: None,
            port,
            protocol,
            endpoints: EndpointSet::parsed(endpoints),
            hosts: Default::default(),
        }],
    );
    if !backends.is_empty() {
        let backends = backends
            .iter()
            .map(|(path, port, weight)| Backend {
                target: BackendTarget::Service {
                    path: path.parse().unwrap(),
                    port: *port,
                },
                weight: *weight,
            })
            .collect();
        spec.routes = Arc::from([test_rule(0, vec![RequestMatch::any()], backends)]);
    }
    spec
}
