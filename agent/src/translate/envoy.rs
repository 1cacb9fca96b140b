//! Mesh snapshot → Envoy v3 resources (clusters, endpoints, the outbound listener, routes).
//!
//! Pure functions of the snapshot. [`EnvoyTranslator`] adds one thing on top: it remembers
//! what it built last time and reuses it for services that did not change, so the cost of a
//! change follows the size of the change, not the size of the mesh.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::Ipv4Addr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::cluster::v3::cluster::{
    ClusterDiscoveryType, DiscoveryType, EdsClusterConfig,
};
use envoy_types::pb::envoy::config::core::v3::{
    Address, AggregatedConfigSource, ApiVersion, CidrRange, ConfigSource, Http2ProtocolOptions,
    SocketAddress, TrafficDirection, address, config_source, socket_address,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints, lb_endpoint,
};
use envoy_types::pb::envoy::config::listener::v3::{
    Filter, FilterChain, FilterChainMatch, Listener, ListenerFilter, filter, listener_filter,
};
use envoy_types::pb::envoy::config::route::v3::{
    RetryPolicy, Route, RouteAction, RouteConfiguration, RouteMatch, VirtualHost, route,
    route_action, route_match,
};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::listener::original_dst::v3::OriginalDst;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, HttpFilter, Rds, http_connection_manager, http_filter,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{TcpProxy, tcp_proxy};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions;
use envoy_types::pb::envoy::extensions::upstreams::http::v3::http_protocol_options::{
    ExplicitHttpConfig, UpstreamProtocolOptions, explicit_http_config,
};
use envoy_types::pb::google::protobuf::{Any, Duration, UInt32Value};
use envoy_types::util::pack_any;
use prost::Message;

use crate::mesh::{MeshPath, MeshSnapshot, Service, ServiceAddress, ServicePort};

/// The one listener every captured connection lands on.
pub const OUTBOUND_LISTENER: &str = "lattice-outbound";
/// The port that listener binds; iptables in the pod redirects the trapped block to it.
pub const OUTBOUND_PORT: u16 = 15001;

/// The four resource types, in the order Envoy must receive them (CDS → EDS → LDS → RDS), so a
/// listener never points at a cluster or route that does not exist yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ResourceType {
    Cluster = 0,
    Endpoint = 1,
    Listener = 2,
    Route = 3,
}

impl ResourceType {
    pub const ALL: [ResourceType; 4] = [
        ResourceType::Cluster,
        ResourceType::Endpoint,
        ResourceType::Listener,
        ResourceType::Route,
    ];

    pub fn type_url(self) -> &'static str {
        match self {
            ResourceType::Cluster => "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            ResourceType::Endpoint => {
                "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
            }
            ResourceType::Listener => "type.googleapis.com/envoy.config.listener.v3.Listener",
            ResourceType::Route => "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
        }
    }

    pub fn from_type_url(url: &str) -> Option<ResourceType> {
        ResourceType::ALL.into_iter().find(|t| t.type_url() == url)
    }

    /// Short name for logs and metrics.
    pub fn short(self) -> &'static str {
        match self {
            ResourceType::Cluster => "cds",
            ResourceType::Endpoint => "eds",
            ResourceType::Listener => "lds",
            ResourceType::Route => "rds",
        }
    }

    /// Clusters and listeners are fetched as a whole (wildcard); endpoints and routes by name.
    pub fn is_wildcard_by_default(self) -> bool {
        matches!(self, ResourceType::Cluster | ResourceType::Listener)
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// One encoded Envoy resource. Its version is a hash of its bytes, so equal content has equal
/// versions, across pushes and across agent restarts (which makes Delta reconnects cheap).
#[derive(Debug, PartialEq)]
pub struct XdsResource {
    pub name: String,
    pub version: String,
    pub body: Any,
}

impl XdsResource {
    fn new<M: Message + prost::Name>(name: String, message: M) -> Arc<XdsResource> {
        let body = pack_any(message);
        let version = format!("{:016x}", fnv1a(&body.value));
        Arc::new(XdsResource { name, version, body })
    }
}

/// FNV-1a: stable across builds and platforms, unlike std's hasher, and fast enough for the
/// few kilobytes a resource holds.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// All resources of one type, by name.
pub type ResourceMap = BTreeMap<String, Arc<XdsResource>>;

/// Everything Envoy should have for one mesh snapshot.
#[derive(Debug, Default)]
pub struct XdsSnapshot {
    /// The mesh snapshot version this was built from.
    pub version: u64,
    pub resources: [ResourceMap; 4],
    /// When the mesh change behind it was first seen, for the push-latency histogram.
    pub seen_at: Option<std::time::Instant>,
}

impl XdsSnapshot {
    pub fn of(&self, kind: ResourceType) -> &ResourceMap {
        &self.resources[kind.index()]
    }
}

/// `buzz.bar.foo.system.internal|8080`: readable in Envoy's stats and admin pages.
pub fn cluster_name(service: &Service, port: u16) -> String {
    format!("{}|{}", service.dns_name, port)
}

/// One route configuration per HTTP port on the shared address.
pub fn route_name(port: u16) -> String {
    format!("http.{port}")
}

/// Remembers the last translation per service, so unchanged services cost nothing.
#[derive(Default)]
pub struct EnvoyTranslator {
    services: HashMap<MeshPath, Translated>,
    listener_and_routes: Option<(Arc<XdsResource>, ResourceMap)>,
}

struct Translated {
    service: Arc<Service>,
    clusters: Vec<Arc<XdsResource>>,
    endpoints: Vec<Arc<XdsResource>>,
}

impl EnvoyTranslator {
    pub fn translate(&mut self, mesh: &MeshSnapshot) -> XdsSnapshot {
        let before = self.services.len();
        self.services.retain(|path, _| mesh.services.contains_key(path));
        // Any removed, added or reshaped service changes the listener and routes; endpoint
        // changes alone do not.
        let mut shape_changed = self.services.len() != before;

        let mut out = XdsSnapshot {
            version: mesh.version,
            ..XdsSnapshot::default()
        };
        for (path, service) in &mesh.services {
            let translated = match self.services.remove(path) {
                Some(prev) if Arc::ptr_eq(&prev.service, service) => prev,
                Some(prev) if prev.service.same_shape(service) => Translated {
                    service: service.clone(),
                    clusters: prev.clusters,
                    endpoints: endpoints_for(service),
                },
                _ => {
                    shape_changed = true;
                    Translated {
                        service: service.clone(),
                        clusters: clusters_for(service),
                        endpoints: endpoints_for(service),
                    }
                }
            };
            for resource in &translated.clusters {
                out.resources[ResourceType::Cluster.index()]
                    .insert(resource.name.clone(), resource.clone());
            }
            for resource in &translated.endpoints {
                out.resources[ResourceType::Endpoint.index()]
                    .insert(resource.name.clone(), resource.clone());
            }
            self.services.insert(path.clone(), translated);
        }

        if shape_changed || self.listener_and_routes.is_none() {
            let listener = outbound_listener(mesh);
            let routes = route_configs(mesh)
                .into_iter()
                .map(|r| (r.name.clone(), r))
                .collect();
            self.listener_and_routes = Some((listener, routes));
        }
        if let Some((listener, routes)) = &self.listener_and_routes {
            out.resources[ResourceType::Listener.index()]
                .insert(listener.name.clone(), listener.clone());
            out.resources[ResourceType::Route.index()] = routes.clone();
        }
        out
    }
}

fn ads() -> ConfigSource {
    ConfigSource {
        resource_api_version: ApiVersion::V3 as i32,
        config_source_specifier: Some(config_source::ConfigSourceSpecifier::Ads(
            AggregatedConfigSource {},
        )),
        ..ConfigSource::default()
    }
}

fn clusters_for(service: &Service) -> Vec<Arc<XdsResource>> {
    service
        .ports
        .iter()
        .map(|port| XdsResource::new(cluster_name(service, port.port), cluster(service, port)))
        .collect()
}

fn cluster(service: &Service, port: &ServicePort) -> Cluster {
    let mut options = HashMap::new();
    if port.protocol.is_http2() {
        let http2 = HttpProtocolOptions {
            upstream_protocol_options: Some(UpstreamProtocolOptions::ExplicitHttpConfig(
                ExplicitHttpConfig {
                    protocol_config: Some(
                        explicit_http_config::ProtocolConfig::Http2ProtocolOptions(
                            Http2ProtocolOptions::default(),
                        ),
                    ),
                },
            )),
            ..HttpProtocolOptions::default()
        };
        options.insert(
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions".to_string(),
            pack_any(http2),
        );
    }
    Cluster {
        name: cluster_name(service, port.port),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32)),
        eds_cluster_config: Some(EdsClusterConfig {
            eds_config: Some(ads()),
            service_name: String::new(),
        }),
        connect_timeout: Some(Duration {
            seconds: 1,
            nanos: 0,
        }),
        typed_extension_protocol_options: options,
        ..Cluster::default()
    }
}

fn endpoints_for(service: &Service) -> Vec<Arc<XdsResource>> {
    service
        .ports
        .iter()
        .map(|port| {
            let name = cluster_name(service, port.port);
            let assignment = ClusterLoadAssignment {
                cluster_name: name.clone(),
                endpoints: vec![LocalityLbEndpoints {
                    lb_endpoints: port
                        .endpoints
                        .iter()
                        .map(|addr| LbEndpoint {
                            host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(
                                Endpoint {
                                    address: Some(socket_address(
                                        addr.ip().to_string(),
                                        addr.port(),
                                    )),
                                    ..Endpoint::default()
                                },
                            )),
                            ..LbEndpoint::default()
                        })
                        .collect(),
                    ..LocalityLbEndpoints::default()
                }],
                ..ClusterLoadAssignment::default()
            };
            XdsResource::new(name, assignment)
        })
        .collect()
}

fn socket_address(ip: String, port: u16) -> Address {
    Address {
        address: Some(address::Address::SocketAddress(SocketAddress {
            address: ip,
            port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(port))),
            ..SocketAddress::default()
        })),
    }
}

fn typed<M: Message + prost::Name>(message: M) -> Any {
    pack_any(message)
}

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

fn http_chain(name: String, ip: Ipv4Addr, port: u16) -> FilterChain {
    let manager = HttpConnectionManager {
        stat_prefix: name.clone(),
        codec_type: http_connection_manager::CodecType::Auto as i32,
        route_specifier: Some(http_connection_manager::RouteSpecifier::Rds(Rds {
            config_source: Some(ads()),
            route_config_name: route_name(port),
        })),
        http_filters: vec![HttpFilter {
            name: "envoy.filters.http.router".to_string(),
            config_type: Some(http_filter::ConfigType::TypedConfig(typed(Router::default()))),
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

fn tcp_chain(service: &Service, ip: Ipv4Addr, port: u16) -> FilterChain {
    let cluster = cluster_name(service, port);
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

/// The capture listener. Connections keep their original destination (restored by the
/// original_dst listener filter) and pick a chain by it: the shared address and a port → HTTP
/// routing by Host; a service's own address and a port → straight TCP proxy. There is no
/// default chain, so Envoy closes anything else instead of passing it through.
pub fn outbound_listener(mesh: &MeshSnapshot) -> Arc<XdsResource> {
    let shared = mesh.trap.shared();
    let http_ports: BTreeSet<u16> = mesh
        .services
        .values()
        .filter(|s| matches!(s.address, ServiceAddress::Shared(_)))
        .flat_map(|s| s.ports.iter().map(|p| p.port))
        .collect();
    let mut chains: Vec<FilterChain> = http_ports
        .iter()
        .map(|&port| http_chain(route_name(port), shared, port))
        .collect();
    for service in mesh.services.values() {
        if let ServiceAddress::Own(ip) = service.address {
            chains.extend(service.ports.iter().map(|p| tcp_chain(service, ip, p.port)));
        }
    }
    if chains.is_empty() {
        // Envoy rejects a listener without chains. This one matches only the block's network
        // address, which is never assigned, so it is never hit and nothing is passed through.
        chains.push(http_chain("unassigned".to_string(), mesh.trap.net().network(), 1));
    }
    let listener = Listener {
        name: OUTBOUND_LISTENER.to_string(),
        address: Some(socket_address("0.0.0.0".to_string(), OUTBOUND_PORT)),
        traffic_direction: TrafficDirection::Outbound as i32,
        listener_filters: vec![ListenerFilter {
            name: "envoy.filters.listener.original_dst".to_string(),
            config_type: Some(listener_filter::ConfigType::TypedConfig(typed(
                OriginalDst::default(),
            ))),
            ..ListenerFilter::default()
        }],
        filter_chains: chains,
        ..Listener::default()
    };
    XdsResource::new(OUTBOUND_LISTENER.to_string(), listener)
}

/// One route configuration per HTTP port on the shared address, one virtual host per service,
/// matched by `name` and `name:port`.
pub fn route_configs(mesh: &MeshSnapshot) -> Vec<Arc<XdsResource>> {
    let mut by_port: BTreeMap<u16, Vec<VirtualHost>> = BTreeMap::new();
    for service in mesh.services.values() {
        if !matches!(service.address, ServiceAddress::Shared(_)) {
            continue;
        }
        for port in &service.ports {
            by_port.entry(port.port).or_default().push(virtual_host(service, port.port));
        }
    }
    by_port
        .into_iter()
        .map(|(port, virtual_hosts)| {
            let name = route_name(port);
            let config = RouteConfiguration {
                name: name.clone(),
                virtual_hosts,
                ..RouteConfiguration::default()
            };
            XdsResource::new(name, config)
        })
        .collect()
}

fn virtual_host(service: &Service, port: u16) -> VirtualHost {
    let cluster = cluster_name(service, port);
    VirtualHost {
        name: cluster.clone(),
        domains: vec![service.dns_name.clone(), format!("{}:{port}", service.dns_name)],
        routes: vec![Route {
            r#match: Some(RouteMatch {
                path_specifier: Some(route_match::PathSpecifier::Prefix("/".to_string())),
                ..RouteMatch::default()
            }),
            action: Some(route::Action::Route(RouteAction {
                cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(cluster)),
                // Retry what cannot have reached the application, so an endpoint that is
                // going away costs a retry, not a failed request.
                retry_policy: Some(RetryPolicy {
                    retry_on: "connect-failure,refused-stream,reset-before-request".to_string(),
                    num_retries: Some(UInt32Value { value: 2 }),
                    ..RetryPolicy::default()
                }),
                ..RouteAction::default()
            })),
            ..Route::default()
        }],
        ..VirtualHost::default()
    }
}
