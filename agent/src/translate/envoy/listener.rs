//! The capture listener: the one listener every trapped connection lands on, and each
//! service's filter chains in it, picked by the connection's original destination.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{CidrRange, TrafficDirection};
use envoy_types::pb::envoy::config::listener::v3::{
    Filter, FilterChain, FilterChainMatch, Listener, ListenerFilter, filter, listener_filter,
};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::listener::original_dst::v3::OriginalDst;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, HttpFilter, Rds, http_connection_manager, http_filter,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{TcpProxy, tcp_proxy};
use envoy_types::pb::google::protobuf::UInt32Value;
use imbl::ordmap::DiffItem;
use lattice_contract::CapturePort;
use prost::Message;

use super::{OUTBOUND_LISTENER, ads, cluster_name, route_name, socket_address, typed};
use crate::mesh::{MeshSnapshot, Service, ServiceAddress};
use crate::xds::{ListenerBase, Part};

fn host_range(ip: Ipv4Addr) -> CidrRange {
    CidrRange {
        address_prefix: ip.to_string(),
        prefix_len: Some(UInt32Value { value: 32 }),
    }
}

fn chain_match(ip: Ipv4Addr, port: u16) -> FilterChainMatch {
    FilterChainMatch {
        destination_port: Some(UInt32Value {
            value: u32::from(port),
        }),
        prefix_ranges: vec![host_range(ip)],
        ..FilterChainMatch::default()
    }
}

pub(super) fn http_chain(name: String, ip: Ipv4Addr, port: u16) -> FilterChain {
    let manager = HttpConnectionManager {
        stat_prefix: name.clone(),
        codec_type: http_connection_manager::CodecType::Auto as i32,
        route_specifier: Some(http_connection_manager::RouteSpecifier::Rds(Rds {
            config_source: Some(ads()),
            route_config_name: route_name(port),
        })),
        http_filters: vec![HttpFilter {
            name: "envoy.filters.http.router".to_string(),
            config_type: Some(http_filter::ConfigType::TypedConfig(typed(
                Router::default(),
            ))),
            ..HttpFilter::default()
        }],
        ..HttpConnectionManager::default()
    };
    FilterChain {
        name,
        filter_chain_match: Some(chain_match(ip, port)),
        filters: vec![Filter {
            name: "envoy.filters.network.http_connection_manager".to_string(),
            config_type: Some(filter::ConfigType::TypedConfig(typed(manager))),
        }],
        ..FilterChain::default()
    }
}

/// A chain that passes connections to `ip:port` to the cluster of `dns_name` and `port`.
fn tcp_chain(dns_name: &str, ip: Ipv4Addr, port: u16) -> FilterChain {
    let cluster = cluster_name(dns_name, port);
    let proxy = TcpProxy {
        stat_prefix: cluster.clone(),
        cluster_specifier: Some(tcp_proxy::ClusterSpecifier::Cluster(cluster.clone())),
        ..TcpProxy::default()
    };
    FilterChain {
        name: format!("tcp|{cluster}"),
        filter_chain_match: Some(chain_match(ip, port)),
        filters: vec![Filter {
            name: "envoy.filters.network.tcp_proxy".to_string(),
            config_type: Some(filter::ConfigType::TypedConfig(typed(proxy))),
        }],
        ..FilterChain::default()
    }
}

/// A service's chains in the capture listener. Connections keep their original destination
/// (restored by the original_dst listener filter) and pick a chain by it: the shared address
/// and a port → HTTP routing by Host (one chain per port, which every service on the shared
/// address with that port shares); a service's or an instance's own address and a port →
/// straight TCP proxy.
pub(super) fn chains_for(service: &Service, shared_chains: &SharedChains) -> Vec<Part> {
    let mut chains = Vec::new();
    match service.address {
        ServiceAddress::Shared(_) => {
            chains.extend(service.ports.iter().map(|port| shared_chains.of(port.port)));
        }
        ServiceAddress::Own(ip) => chains.extend(
            service
                .ports
                .iter()
                .map(|port| listener_part(tcp_chain(&service.dns_name, ip, port.port))),
        ),
        ServiceAddress::Instances => {}
    }
    // An instance's address reaches that instance alone, on every port of its service.
    // HTTP ports are passed through as bytes too: a client that picked one instance wants
    // no load balancing, and HTTP/1, HTTP/2 and gRPC all cross a TCP proxy unchanged.
    for instance in &service.instances {
        chains.extend(
            service.ports.iter().map(|port| {
                listener_part(tcp_chain(&instance.dns_name, instance.address, port.port))
            }),
        );
    }
    chains
}

/// The chain every HTTP service on a port shares, made once per port rather than once per
/// service: at 50k services on one port, making each service its own copy of the same chain
/// was a fifth of a first translation (perf).
#[derive(Default)]
pub(super) struct SharedChains {
    /// The shared address the chains match.
    shared: Option<Ipv4Addr>,
    /// By port. At most one per port, made as services on it arrive.
    chains: HashMap<u16, Part>,
}

impl SharedChains {
    /// Has a chain for every port `changes` put a service with the shared address on,
    /// matching `shared`.
    pub(super) fn follow(
        &mut self,
        shared: Ipv4Addr,
        changes: &[DiffItem<'_, '_, crate::mesh::MeshPath, Arc<Service>>],
    ) {
        if self.shared != Some(shared) {
            self.shared = Some(shared);
            self.chains.clear();
        }
        for change in changes {
            let service = match change {
                DiffItem::Add(_, service)
                | DiffItem::Update {
                    new: (_, service), ..
                } => service,
                DiffItem::Remove(..) => continue,
            };
            if !matches!(service.address, ServiceAddress::Shared(_)) {
                continue;
            }
            for port in &service.ports {
                self.chains
                    .entry(port.port)
                    .or_insert_with(|| shared_chain(shared, port.port));
            }
        }
    }

    /// The chain of `port`, which [`SharedChains::follow`] made (made here otherwise).
    fn of(&self, port: u16) -> Part {
        self.chains
            .get(&port)
            .cloned()
            .unwrap_or_else(|| shared_chain(self.shared.unwrap_or(Ipv4Addr::UNSPECIFIED), port))
    }
}

/// The chain of HTTP services on `shared` and `port`: routed by Host ([`http_chain`]).
fn shared_chain(shared: Ipv4Addr, port: u16) -> Part {
    listener_part(http_chain(route_name(port), shared, port))
}

/// `chain`, encoded as the capture listener holds it.
fn listener_part(chain: FilterChain) -> Part {
    Part::filter_chain(&Arc::from(OUTBOUND_LISTENER), &chain.name, &chain)
}

/// The capture listener without chains: the chains are each service's ([`chains_for`]).
/// There is no default chain, so Envoy closes anything no chain matches instead of passing it
/// through. A listener with no service's chain gets one that matches only the block's network
/// address, which is never assigned: Envoy rejects a listener without chains.
pub(super) fn listener_base(mesh: &MeshSnapshot, port: CapturePort) -> ListenerBase {
    let listener = Listener {
        name: OUTBOUND_LISTENER.to_string(),
        address: Some(socket_address("0.0.0.0".to_string(), port.get())),
        traffic_direction: TrafficDirection::Outbound as i32,
        listener_filters: vec![ListenerFilter {
            name: "envoy.filters.listener.original_dst".to_string(),
            config_type: Some(listener_filter::ConfigType::TypedConfig(typed(
                OriginalDst::default(),
            ))),
            ..ListenerFilter::default()
        }],
        ..Listener::default()
    };
    let name: Arc<str> = Arc::from(OUTBOUND_LISTENER);
    // A TCP proxy to a cluster that never exists, not an HTTP chain: an HTTP chain would make
    // Envoy wait for a route configuration that no view holds, and never finish starting.
    let proxy = TcpProxy {
        stat_prefix: "unassigned".to_string(),
        cluster_specifier: Some(tcp_proxy::ClusterSpecifier::Cluster(
            "lattice-unassigned".to_string(),
        )),
        ..TcpProxy::default()
    };
    let fallback = FilterChain {
        name: "unassigned".to_string(),
        filter_chain_match: Some(chain_match(mesh.trap.ipv4().network(), 1)),
        filters: vec![Filter {
            name: "envoy.filters.network.tcp_proxy".to_string(),
            config_type: Some(filter::ConfigType::TypedConfig(typed(proxy))),
        }],
        ..FilterChain::default()
    };
    ListenerBase {
        fallback: Part::filter_chain(&name, &fallback.name, &fallback),
        name,
        base: listener.encode_to_vec().into(),
    }
}
