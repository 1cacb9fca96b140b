//! The index against a plain model: random interleavings of Services and EndpointSlices
//! applied, moved between Services and deleted, each snapshot compared with what the model
//! says every Service's endpoints are.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use proptest::prelude::*;
use serde_json::json;

use super::mapping::{self, ObjectKey};
use super::objects::SERVICE_NAME_LABEL;
use super::tests::View;
use super::{MeshIndex, Ownership, objects};
use crate::mesh::MeshSnapshot;

const NAMESPACES: [&str; 2] = ["a", "b"];
const SERVICES: [&str; 3] = ["s0", "s1", "s2"];
const SLICES: [&str; 4] = ["x0", "x1", "x2", "x3"];
/// Port names: a Service's port and a slice's port meet by name.
const PORT_NAMES: [&str; 2] = ["http", "web"];

#[derive(Clone, Debug)]
enum Op {
    Service {
        namespace: usize,
        name: usize,
        port_name: usize,
    },
    DeleteService {
        namespace: usize,
        name: usize,
    },
    Slice {
        namespace: usize,
        name: usize,
        service: usize,
        port_name: usize,
        port: u16,
        /// The last octets of its ready endpoints' addresses.
        hosts: Vec<u8>,
    },
    DeleteSlice {
        namespace: usize,
        name: usize,
    },
    Snapshot,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..2usize, 0..3usize, 0..2usize).prop_map(|(namespace, name, port_name)| {
            Op::Service {
                namespace,
                name,
                port_name,
            }
        }),
        (0..2usize, 0..3usize).prop_map(|(namespace, name)| Op::DeleteService { namespace, name }),
        (
            0..2usize,
            0..4usize,
            0..3usize,
            0..2usize,
            prop_oneof![Just(8080u16), Just(9090)],
            proptest::collection::vec(1..6u8, 0..4),
        )
            .prop_map(
                |(namespace, name, service, port_name, port, hosts)| Op::Slice {
                    namespace,
                    name,
                    service,
                    port_name,
                    port,
                    hosts,
                }
            ),
        (0..2usize, 0..4usize).prop_map(|(namespace, name)| Op::DeleteSlice { namespace, name }),
        Just(Op::Snapshot),
    ]
}

/// A slice as the model keeps it: its Service, its port's name and number, its hosts.
type ModelSlice = (usize, usize, u16, Vec<u8>);

#[derive(Default)]
struct Model {
    /// (namespace, name) → its port's name.
    services: BTreeMap<(usize, usize), usize>,
    slices: BTreeMap<(usize, usize), ModelSlice>,
}

impl Model {
    fn view(&self) -> View {
        let mut view: View = self
            .services
            .iter()
            .map(|(&(namespace, name), &port_name)| {
                let endpoints: BTreeSet<SocketAddr> = self
                    .slices
                    .iter()
                    .filter(|((slice_ns, _), (service, slice_port_name, _, _))| {
                        *slice_ns == namespace && *service == name && *slice_port_name == port_name
                    })
                    .flat_map(|(_, (_, _, port, hosts))| {
                        hosts
                            .iter()
                            .map(|host| SocketAddr::from(([10, 0, 0, *host], *port)))
                    })
                    .collect();
                let protocol = mapping::port_protocol(None, Some(PORT_NAMES[port_name]));
                (
                    format!("/{}/{}", NAMESPACES[namespace], SERVICES[name]),
                    vec![(
                        80,
                        protocol,
                        endpoints.iter().map(ToString::to_string).collect(),
                    )],
                )
            })
            .collect();
        view.sort();
        view
    }
}

/// The snapshot's view in path order, as the model's.
fn view(snapshot: &MeshSnapshot) -> View {
    let mut view = super::tests::view(snapshot);
    view.sort();
    view
}

fn service(namespace: usize, name: usize, port_name: usize) -> Service {
    serde_json::from_value(json!({
        "metadata": {"namespace": NAMESPACES[namespace], "name": SERVICES[name],
                     "creationTimestamp": "2024-01-01T00:00:00Z"},
        "spec": {"ports": [{"name": PORT_NAMES[port_name], "port": 80}]},
    }))
    .unwrap()
}

fn slice(namespace: usize, name: usize, slice: &ModelSlice) -> EndpointSlice {
    let (service, port_name, port, hosts) = slice;
    let endpoints: Vec<_> = hosts
        .iter()
        .map(|host| json!({"addresses": [format!("10.0.0.{host}")], "conditions": {"ready": true}}))
        .collect();
    serde_json::from_value(json!({
        "metadata": {"namespace": NAMESPACES[namespace], "name": SLICES[name],
                     "labels": {SERVICE_NAME_LABEL: SERVICES[*service]}},
        "addressType": "IPv4",
        "ports": [{"name": PORT_NAMES[*port_name], "port": port}],
        "endpoints": endpoints,
    }))
    .unwrap()
}

fn key(namespace: usize, name: &str) -> ObjectKey {
    ObjectKey::new(NAMESPACES[namespace], name)
}

proptest! {
    /// Whatever order Services and slices come, move and go in, every snapshot holds each
    /// Service with the endpoints of exactly the slices that name it now, and a snapshot
    /// taken with no change since is not published.
    #[test]
    fn the_index_follows_services_and_slices_in_any_order(
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let mut index = MeshIndex::new("240.240.0.0/16".parse().unwrap(), Ownership::default());
        let mut model = Model::default();
        let mut published = view(&index.take_snapshot().expect("the first snapshot"));
        for op in ops.into_iter().chain([Op::Snapshot]) {
            match op {
                Op::Service { namespace, name, port_name } => {
                    model.services.insert((namespace, name), port_name);
                    let (key, mapped) = mapping::service_entry(&objects::read(&service(
                        namespace, name, port_name,
                    )));
                    index.apply_mapped_service(key, mapped);
                }
                Op::DeleteService { namespace, name } => {
                    model.services.remove(&(namespace, name));
                    index.delete_service(key(namespace, SERVICES[name]));
                }
                Op::Slice { namespace, name, service, port_name, port, hosts } => {
                    let held = (service, port_name, port, hosts);
                    let object = slice(namespace, name, &held);
                    model.slices.insert((namespace, name), held);
                    let (key, mapped) = mapping::slice_entry(&objects::read(&object));
                    index.apply_mapped_slice(key, mapped);
                }
                Op::DeleteSlice { namespace, name } => {
                    model.slices.remove(&(namespace, name));
                    index.delete_slice(key(namespace, SLICES[name]));
                }
                Op::Snapshot => {
                    let expected = model.view();
                    match index.take_snapshot() {
                        Some(snapshot) => published = view(&snapshot),
                        None => prop_assert_eq!(
                            &published, &expected, "nothing published, yet the model moved"
                        ),
                    }
                    prop_assert_eq!(&published, &expected);
                }
            }
        }
    }
}
