//! Mesh snapshot → Envoy v3 resources (clusters, endpoints, the outbound listener, routes), as
//! the [`XdsSnapshot`] the xDS server hands out.
//!
//! Pure functions of the snapshot. [`EnvoyTranslator`] adds one thing on top: it remembers
//! what it built last time and reuses it for services that did not change, so the cost of a
//! change follows the size of the change, not the size of the mesh.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::cluster::v3::cluster::{
    ClusterDiscoveryType, DiscoveryType, DnsLookupFamily, EdsClusterConfig, RefreshRate,
};
use envoy_types::pb::envoy::config::cluster::v3::{
    CircuitBreakers, Cluster, OutlierDetection, circuit_breakers,
};
use envoy_types::pb::envoy::config::core::v3::HealthCheck;
use envoy_types::pb::envoy::config::core::v3::health_check::{
    self, HttpHealthCheck, TcpHealthCheck,
};
use envoy_types::pb::envoy::config::core::v3::{
    Address, AggregatedConfigSource, ApiVersion, ConfigSource, DnsResolverOptions,
    Http2ProtocolOptions, Locality, SocketAddress, TransportSocket, TypedExtensionConfig, address,
    config_source, socket_address,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints, lb_endpoint,
};
use envoy_types::pb::envoy::extensions::network::dns_resolver::cares::v3::CaresDnsResolverConfig;
use envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions;
use envoy_types::pb::envoy::extensions::upstreams::http::v3::http_protocol_options::{
    ExplicitHttpConfig, UpstreamProtocolOptions, explicit_http_config,
};
use envoy_types::pb::envoy::r#type::v3::{CodecClientType, Int64Range};
use envoy_types::pb::google::protobuf::{Any, Duration, UInt32Value};
use envoy_types::util::pack_any;
use imbl::ordmap::DiffItem;
use lattice_contract::CapturePort;
use prost::Message;

mod assignment;
pub mod authorization;
mod fields;
mod inbound;
mod listener;
mod mtls;
mod routes;

pub use inbound::INBOUND_LISTENER;
use listener::{SharedChains, chains_for, listener_base};
pub use routes::UNRESOLVED_BACKEND;

use crate::mesh::health::{ActiveCheck, CheckKind, HealthPolicy};
use crate::mesh::route::BackendTarget;
use crate::mesh::{
    HostHeader, MeshSnapshot, NodeLocality, Service, ServiceMap, ServicePort, TrafficDistribution,
};
use crate::parallel;
use crate::xds::snapshot::{ResourceMap, ResourceType, TYPES, XdsResource, XdsSnapshot, fnv1a};
use crate::xds::{PartsIndex, ServiceParts};

/// The one listener every captured connection lands on, on the capture port
/// ([`CapturePort`], `--envoy-port`), where iptables in the pod sends the trapped block.
pub const OUTBOUND_LISTENER: &str = "lattice-outbound";

/// `buzz.bar.foo.system.internal|8080`: readable in Envoy's stats and admin pages.
pub fn cluster_name(dns_name: &str, port: u16) -> String {
    format!("{dns_name}|{port}")
}

/// One route configuration per HTTP port on the shared address.
pub fn route_name(port: u16) -> String {
    format!("http.{port}")
}

/// How Envoy resolves the host names of external services.
///
/// Envoy's DNS clusters refresh on the record's TTL (`respect_dns_ttl`). Envoy has no ceiling
/// for that refresh, so the resolver given here should be the agent's own DNS server, which
/// cuts the TTLs it forwards (`lattice_dns::DnsConfig::max_forwarded_ttl`, 300 s); a TTL of 0
/// (or none) falls back to [`DNS_REFRESH`], and a failing lookup is retried from
/// [`DNS_FAILURE_REFRESH`] backing off to [`DNS_FAILURE_REFRESH_MAX`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExternalDns {
    /// The DNS server Envoy asks; `None` leaves Envoy on its default (the pod's
    /// `/etc/resolv.conf`, which in a mesh pod names the agent's node-local address anyway).
    pub resolver: Option<SocketAddr>,
}

/// Refresh of an external name whose record carries no TTL (0).
pub const DNS_REFRESH: std::time::Duration = std::time::Duration::from_secs(5);
/// First retry of a failed lookup of an external name.
pub const DNS_FAILURE_REFRESH: std::time::Duration = std::time::Duration::from_secs(1);
/// Longest wait between retries of a failing lookup.
pub const DNS_FAILURE_REFRESH_MAX: std::time::Duration = std::time::Duration::from_secs(10);

/// Keeps the last translation and updates it by what changed in the mesh: the persistent maps
/// make both the comparison and the snapshot handed out cost the size of the change.
pub struct EnvoyTranslator {
    /// This node, whose Envoys every assignment is for: it decides endpoint priorities.
    node: NodeLocality,
    /// How Envoy resolves the host names of external services.
    dns: ExternalDns,
    /// Where the capture listener listens in every pod.
    capture_port: CapturePort,
    /// Whether proxies are served their secrets and the inbound listeners of their pods: only
    /// then are the inbound listeners built and authorization rules enforced.
    inbound_listeners: bool,
    /// Whether a service with identities is called over mesh mTLS: only when proxies are
    /// served leaves (a CA is in use), since its clusters name the proxy's secrets.
    mesh_mtls: bool,
    /// The trust domain of the mesh's SPIFFE IDs, which authorization rules name.
    trust_domain: Arc<str>,
    /// The proxies' inbound listeners, with mesh mTLS on.
    inbound: Option<Arc<inbound::Inbound>>,
    /// The pods' policies, followed by the services with rules that change.
    policies: authorization::PolicyIndex,
    /// Whether it said that rules are enforced nowhere (mesh mTLS off).
    warned_unenforced: bool,
    mesh: Option<ServiceMap>,
    /// The mesh shape the listener and the routes were built for.
    shape_version: Option<u64>,
    resources: [ResourceMap; TYPES],
    /// Each service's share of the resources; the listener and the route configurations are
    /// composed from them, for the whole mesh here and for a proxy's view in the xDS server.
    parts: PartsIndex,
    /// The capture listener's chain of each port HTTP services share the block's shared
    /// address on.
    shared_chains: SharedChains,
}

impl Default for EnvoyTranslator {
    /// A translator for a node whose name and zone are unknown: no endpoint is preferred.
    fn default() -> Self {
        EnvoyTranslator::new(
            NodeLocality::without_zone(None, "unknown"),
            ExternalDns::default(),
        )
    }
}

impl EnvoyTranslator {
    pub fn new(node: NodeLocality, dns: ExternalDns) -> Self {
        EnvoyTranslator {
            node,
            dns,
            capture_port: CapturePort::default(),
            inbound_listeners: false,
            mesh_mtls: false,
            // `--trust-domain`'s default.
            trust_domain: Arc::from("cluster.local"),
            inbound: None,
            policies: authorization::PolicyIndex::default(),
            warned_unenforced: false,
            mesh: None,
            shape_version: None,
            resources: Default::default(),
            parts: PartsIndex::default(),
            shared_chains: SharedChains::default(),
        }
    }

    /// The capture listener on `port` instead of the default.
    pub fn with_capture_port(mut self, port: CapturePort) -> Self {
        self.capture_port = port;
        self
    }

    /// The inbound listeners of the pods that capture inbound, and the authorization rules
    /// they enforce: for an agent that serves verified proxies their secrets.
    pub fn with_inbound_listeners(mut self, on: bool) -> Self {
        self.inbound_listeners = on;
        self
    }

    /// Clusters of services whose endpoints name identities call them over mesh mTLS: for an
    /// agent that serves every verified proxy a leaf (it has a CA).
    pub fn with_mesh_mtls(mut self, on: bool) -> Self {
        self.mesh_mtls = on;
        self
    }

    /// Whether services with identities are called over mesh mTLS.
    pub fn mesh_mtls(&self) -> bool {
        self.mesh_mtls
    }

    /// The trust domain authorization rules' service accounts and namespaces are in.
    pub fn with_trust_domain(mut self, trust_domain: &str) -> Self {
        self.trust_domain = Arc::from(trust_domain);
        self
    }

    /// The node this translator prefers endpoints for.
    pub fn node(&self) -> &NodeLocality {
        &self.node
    }

    pub fn translate(&mut self, mesh: &MeshSnapshot) -> XdsSnapshot {
        let previous = self.mesh.take().unwrap_or_default();
        if self.parts.listener.is_none() {
            self.parts.listener = Some(listener_base(mesh, self.capture_port));
        }
        // Ports whose route configuration must be rebuilt though the shape did not change: a
        // service's routing rules changed, which is no more than an endpoint change elsewhere.
        let mut rerouted: BTreeSet<Arc<str>> = BTreeSet::new();
        let changes: Vec<_> = previous.diff(&mesh.services).collect();
        // The pods' policies follow the services with rules that changed, one by one.
        let policed = |s: &Service| !s.authorization.is_empty();
        let mut authorization_changed = false;
        for change in &changes {
            let (old, new) = match change {
                DiffItem::Add(_, service) => (None, Some(&***service)),
                DiffItem::Remove(_, service) => (Some(&***service), None),
                DiffItem::Update {
                    old: (_, old),
                    new: (_, new),
                } => {
                    let moved = old.authorization != new.authorization
                        || ((policed(old) || policed(new))
                            && (!old.same_endpoints(new) || old.unready != new.unready));
                    if !moved {
                        continue;
                    }
                    (Some(&***old), Some(&***new))
                }
            };
            if old.is_some_and(policed) || new.is_some_and(policed) {
                authorization_changed = true;
                self.policies.update(old, new);
            }
        }
        // The clusters and assignments of every added or changed service, built first: on
        // every core when there are many (the first snapshot builds 10k services' worth).
        // So are their parts (listener chains, virtual hosts), which a changed shape, routing
        // rules or clients call for: made serially, they were most of a 50k-service first
        // translation's one-core tail while the other core idled.
        self.shared_chains.follow(mesh.trap.shared(), &changes);
        let (dns, node, mtls) = (&self.dns, &self.node, self.mesh_mtls);
        let shared_chains = &self.shared_chains;
        let built = parallel::map_on_every_core(&changes, |change| match change {
            DiffItem::Add(_, service) => (
                Some(Built::of(service, true, dns, node, mtls)),
                Some(parts_of(service, shared_chains)),
            ),
            DiffItem::Update {
                old: (_, old),
                new: (_, new),
            } => {
                let same_shape = old.same_shape(new);
                let built = (!same_shape || !old.same_endpoints(new))
                    .then(|| Built::of(new, !same_shape, dns, node, mtls));
                let parts = (!same_shape || old.routes != new.routes || old.clients != new.clients)
                    .then(|| parts_of(new, shared_chains));
                (built, parts)
            }
            DiffItem::Remove(..) => (None, None),
        });
        for (change, (built, parts)) in changes.into_iter().zip(built) {
            match change {
                DiffItem::Add(_, service) => {
                    self.put_built(built);
                    self.insert_parts(service, parts);
                }
                DiffItem::Update {
                    old: (_, old),
                    new: (_, new),
                } => {
                    let same_shape = old.same_shape(new);
                    if !same_shape {
                        self.remove(old);
                    }
                    self.put_built(built);
                    if old.routes != new.routes {
                        rerouted.extend(new.ports.iter().map(|p| Arc::from(route_name(p.port))));
                    }
                    self.insert_parts(new, parts);
                }
                DiffItem::Remove(_, service) => {
                    self.remove(service);
                    self.parts.remove(service.dns_name.as_str());
                }
            }
        }
        // The listener depends on names, addresses and ports only; the routes on those and on
        // the services' routing rules.
        let all = || self.parts.services.values().map(|p| &**p);
        if self.shape_version != Some(mesh.shape_version) {
            // The listener base is set above, so there is always a listener.
            if let Some(listener) = self.parts.listener(all()) {
                self.resources[ResourceType::Listener.index()] =
                    ResourceMap::unit(listener.name.clone(), listener);
            }
            self.resources[ResourceType::Route.index()] = self.parts.route_map(all(), None);
            self.shape_version = Some(mesh.shape_version);
        } else if !rerouted.is_empty() {
            // Only when some rules changed: most changes are endpoints only, and the walk
            // over every service's virtual hosts was 2 % of the agent's CPU per change at 10k
            // services in a profile.
            let rebuilt = self.parts.route_map(all(), Some(&rerouted));
            let routes = &mut self.resources[ResourceType::Route.index()];
            for name in &rerouted {
                match rebuilt.get(name) {
                    Some(config) => routes.insert(name.clone(), config.clone()),
                    None => routes.remove(name),
                };
            }
        }
        self.mesh = Some(mesh.services.clone());
        if self.inbound_listeners {
            self.follow_authorization(authorization_changed);
        } else if authorization_changed
            && !self.warned_unenforced
            && mesh.services.values().any(|s| !s.authorization.is_empty())
        {
            self.warned_unenforced = true;
            tracing::warn!(
                "services have authorization rules, but no proxy is served secrets (Kubernetes and --node-name): no inbound listener enforces them"
            );
        }
        XdsSnapshot {
            version: mesh.version,
            resources: self.resources.clone(),
            parts: self.parts.clone(),
            changed_at: mesh.taken_at,
            indexes: Default::default(),
            inbound: self
                .inbound
                .clone()
                .map(|inbound| inbound as Arc<dyn crate::xds::InboundListeners>),
        }
    }

    /// Hands the pods' policies on to a new [`inbound::Inbound`] when they changed (or on the
    /// first snapshot), keeping what the last one built for pods whose policy stands.
    fn follow_authorization(&mut self, changed: bool) {
        let current = self.inbound.as_deref();
        if current.is_some() && !changed {
            return;
        }
        self.inbound = Some(Arc::new(inbound::Inbound::new(
            self.trust_domain.clone(),
            self.capture_port,
            self.policies.policies(),
            current,
        )));
    }

    /// Records what `service` adds to the listener and the route configurations, and its
    /// clusters, from `parts` (`None`: its parts stand as they are), named as the cluster map
    /// names them, sharing those strings.
    fn insert_parts(&mut self, service: &Service, parts: Option<ServiceParts>) {
        let Some(mut parts) = parts else { return };
        let clusters = &self.resources[ResourceType::Cluster.index()];
        for name in &mut parts.clusters {
            if let Some((key, _)) = clusters.get_key_value(&**name) {
                *name = key.clone();
            }
        }
        self.parts
            .insert(Arc::from(service.dns_name.as_str()), parts);
    }

    fn put_built(&mut self, built: Option<Built>) {
        let Some(built) = built else { return };
        if let Some(clusters) = built.clusters {
            self.put(ResourceType::Cluster, clusters);
        }
        self.put(ResourceType::Endpoint, built.endpoints);
    }

    /// Puts `resources` in place, keeping the one already there when its content is the same:
    /// of a service's assignments only those that changed are new, so nothing downstream
    /// looks at the rest (one instance of a stateful service moving touches one assignment).
    ///
    /// Inserted first and the held one put back when it is the same: a resource is new far
    /// more often than not (a first translation's every one), and looking first walked the
    /// map twice for each.
    fn put(&mut self, kind: ResourceType, resources: Vec<Arc<XdsResource>>) {
        let map = &mut self.resources[kind.index()];
        for resource in resources {
            let Some(held) = map.insert(resource.name.clone(), resource.clone()) else {
                continue;
            };
            if held.version == resource.version && held.body == resource.body {
                map.insert(held.name.clone(), held);
            }
        }
    }

    fn remove(&mut self, service: &Service) {
        for name in cluster_names(service) {
            self.resources[ResourceType::Cluster.index()].remove(name.as_str());
            self.resources[ResourceType::Endpoint.index()].remove(name.as_str());
        }
    }
}

/// A service's parts, but for the cluster names' keys (see `EnvoyTranslator::insert_parts`).
fn parts_of(service: &Service, shared_chains: &SharedChains) -> ServiceParts {
    ServiceParts {
        clusters: cluster_names(service)
            .map(|name| Arc::from(name.as_str()))
            .collect(),
        chains: chains_for(service, shared_chains),
        virtual_hosts: routes::virtual_hosts(service),
        backends: backends_of(service),
        clients: service.clients.clone(),
    }
}

/// A service's clusters (when its shape is new) and its endpoint assignments.
struct Built {
    clusters: Option<Vec<Arc<XdsResource>>>,
    endpoints: Vec<Arc<XdsResource>>,
}

impl Built {
    fn of(
        service: &Service,
        with_clusters: bool,
        dns: &ExternalDns,
        node: &NodeLocality,
        mtls: bool,
    ) -> Self {
        Built {
            clusters: with_clusters.then(|| clusters_for(service, dns, mtls)),
            endpoints: endpoints_for(service, node),
        }
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

/// Every cluster of a service: one per port, and for a stateful service one per instance and
/// port, which reaches exactly that instance.
fn cluster_names(service: &Service) -> impl Iterator<Item = String> + '_ {
    let instances = service.instances.iter().flat_map(move |instance| {
        service
            .ports
            .iter()
            .map(|port| cluster_name(&instance.dns_name, port.port))
    });
    service
        .ports
        .iter()
        .map(|port| cluster_name(&service.dns_name, port.port))
        .chain(instances)
}

fn clusters_for(service: &Service, dns: &ExternalDns, mtls: bool) -> Vec<Arc<XdsResource>> {
    let tls = (mtls && !service.identities.is_empty()).then(|| mtls::upstream(&service.identities));
    // An instance's cluster has one endpoint, which the client chose: it gets no health
    // policy, since ejecting or failing its only host helps nobody.
    let instances = service.instances.iter().flat_map(|instance| {
        service.ports.iter().map(|port| {
            let name = cluster_name(&instance.dns_name, port.port);
            XdsResource::new(name.clone(), cluster(name, port, None, dns, tls.clone()))
        })
    });
    service
        .ports
        .iter()
        .map(|port| {
            let name = cluster_name(&service.dns_name, port.port);
            // An HTTP check asks for what requests carry: an external service's one host name
            // when it rewrites Host to it, else the mesh name.
            let check_host = match port.hosts.iter().next() {
                Some(one)
                    if port.hosts.len() == 1 && service.host_header == HostHeader::Rewrite =>
                {
                    one.host.as_str()
                }
                _ => service.dns_name.as_str(),
            };
            let health = (check_host, &service.health);
            XdsResource::new(
                name.clone(),
                cluster(name, port, Some(health), dns, tls.clone()),
            )
        })
        .chain(instances)
        .collect()
}

/// `health`: the service's DNS name (the `Host` of HTTP checks) and its health policy.
fn cluster(
    name: String,
    port: &ServicePort,
    health: Option<(&str, &HealthPolicy)>,
    dns: &ExternalDns,
    tls: Option<TransportSocket>,
) -> Cluster {
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
    let outlier = health
        .and_then(|(_, policy)| policy.outlier.as_ref())
        .map(|policy| outlier_detection(policy, &name));
    let base = if port.is_external() {
        external_cluster(&name, port, dns)
    } else {
        Cluster {
            cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32)),
            eds_cluster_config: Some(EdsClusterConfig {
                eds_config: Some(ads()),
                service_name: String::new(),
            }),
            ..Cluster::default()
        }
    };
    Cluster {
        name,
        connect_timeout: Some(Duration {
            seconds: 1,
            nanos: 0,
        }),
        typed_extension_protocol_options: options,
        // Envoy allows 3 retries in flight per cluster by default: with a few concurrent
        // requests, the retries a route asks for would be silently dropped. A sidecar's
        // retries are bounded per request (the route's attempts), so no cluster-wide cap.
        circuit_breakers: Some(CircuitBreakers {
            thresholds: vec![circuit_breakers::Thresholds {
                max_retries: Some(UInt32Value { value: u32::MAX }),
                ..circuit_breakers::Thresholds::default()
            }],
            ..CircuitBreakers::default()
        }),
        outlier_detection: outlier,
        transport_socket: tls,
        health_checks: health
            .and_then(|(host, policy)| Some(health_check(policy.check.as_ref()?, host, port)))
            .into_iter()
            .collect(),
        ..base
    }
}

/// A cluster that resolves its host names itself: one name is a `LOGICAL_DNS` cluster (one
/// connection target, whatever the name answers with: a name that fronts a pool balances
/// itself), several a `STRICT_DNS` cluster (every address of every name is a host). Host
/// names cannot be pushed over EDS, so the assignment is inline and changes with the cluster.
///
/// The DNS settings are the `Cluster` fields Envoy has deprecated in favour of the
/// `envoy.clusters.dns` extension: they mean the same, and every Envoy since 1.20 takes them,
/// where the extension needs a recent one.
#[allow(deprecated)]
fn external_cluster(name: &str, port: &ServicePort, dns: &ExternalDns) -> Cluster {
    let kind = if port.hosts.len() == 1 {
        DiscoveryType::LogicalDns
    } else {
        DiscoveryType::StrictDns
    };
    let endpoints = port.hosts.iter().map(|h| Placed {
        address: socket_address(h.host.to_string(), h.port),
        zone: None,
        priority: 0,
    });
    Cluster {
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(kind as i32)),
        load_assignment: Some(load_assignment(name.to_string(), endpoints)),
        respect_dns_ttl: true,
        dns_refresh_rate: Some(duration(DNS_REFRESH)),
        dns_failure_refresh_rate: Some(RefreshRate {
            base_interval: Some(duration(DNS_FAILURE_REFRESH)),
            max_interval: Some(duration(DNS_FAILURE_REFRESH_MAX)),
        }),
        // The trapped mesh is IPv4; an external name with both families is reached over IPv4.
        dns_lookup_family: DnsLookupFamily::V4Preferred as i32,
        typed_dns_resolver_config: dns.resolver.map(|resolver| TypedExtensionConfig {
            name: "envoy.network.dns_resolver.cares".to_string(),
            typed_config: Some(typed(CaresDnsResolverConfig {
                resolvers: vec![socket_address(resolver.ip().to_string(), resolver.port())],
                use_resolvers_as_fallback: false,
                // The name is looked up as written: no search domains from resolv.conf.
                dns_resolver_options: Some(DnsResolverOptions {
                    no_default_search_domain: true,
                    ..DnsResolverOptions::default()
                }),
                ..CaresDnsResolverConfig::default()
            })),
        }),
        ..Cluster::default()
    }
}

fn duration(d: std::time::Duration) -> Duration {
    Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

/// The interval of `cluster`'s outlier sweeps: `interval`, longer by up to a fifth by a hash
/// of the cluster's name. Envoy sweeps each cluster's endpoints on a timer of the cluster's
/// own, started when the cluster first takes its endpoints, and a proxy of the whole mesh
/// takes 10k clusters' endpoints in a few responses: with one interval their sweeps came due
/// together, every 5 s, and held Envoy's main thread about 50 ms (100k endpoints), delaying
/// whatever configuration arrived meanwhile (docs/benchmarks.md, Envoy's stall). Spread over
/// a second, they drift apart from the first round on. Never shorter than asked, and the same
/// from every agent (FNV-1a, not a seeded hash), so the cluster's bytes do not differ.
fn sweep_interval(interval: std::time::Duration, cluster: &str) -> std::time::Duration {
    let spread = u64::try_from(interval.as_millis() / 5).unwrap_or(u64::MAX);
    let extra = fnv1a(cluster.as_bytes()) % spread.saturating_add(1);
    interval.saturating_add(std::time::Duration::from_millis(extra))
}

fn uint(value: u32) -> Option<UInt32Value> {
    Some(UInt32Value { value })
}

/// A count of 0 turns its trigger off (enforcement 0 %); success-rate ejection is off (see
/// [`crate::mesh::health::OutlierDetection`] for why).
fn outlier_detection(
    policy: &crate::mesh::health::OutlierDetection,
    cluster: &str,
) -> OutlierDetection {
    let enforce = |count: u32| uint(if count == 0 { 0 } else { 100 });
    let count = |count: u32| uint(count.max(1));
    OutlierDetection {
        consecutive_5xx: count(policy.consecutive_5xx),
        enforcing_consecutive_5xx: enforce(policy.consecutive_5xx),
        consecutive_gateway_failure: count(policy.consecutive_gateway_errors),
        enforcing_consecutive_gateway_failure: enforce(policy.consecutive_gateway_errors),
        // Connect failures, resets and timeouts are counted apart from the upstream's answers.
        split_external_local_origin_errors: true,
        consecutive_local_origin_failure: count(policy.consecutive_connect_failures),
        enforcing_consecutive_local_origin_failure: enforce(policy.consecutive_connect_failures),
        enforcing_success_rate: uint(0),
        enforcing_local_origin_success_rate: uint(0),
        interval: Some(duration(sweep_interval(policy.interval, cluster))),
        base_ejection_time: Some(duration(policy.ejection_time)),
        max_ejection_time: Some(duration(std::time::Duration::from_secs(300))),
        max_ejection_percent: uint(policy.max_ejection_percent),
        ..OutlierDetection::default()
    }
}

fn health_check(check: &ActiveCheck, host: &str, port: &ServicePort) -> HealthCheck {
    let checker = match &check.kind {
        CheckKind::Http { path, statuses } => {
            health_check::HealthChecker::HttpHealthCheck(HttpHealthCheck {
                host: host.to_string(),
                path: path.clone(),
                expected_statuses: statuses
                    .iter()
                    .map(|&(start, end)| Int64Range {
                        start: i64::from(start),
                        end: i64::from(end),
                    })
                    .collect(),
                codec_client_type: if port.protocol.is_http2() {
                    CodecClientType::Http2
                } else {
                    CodecClientType::Http1
                } as i32,
                ..HttpHealthCheck::default()
            })
        }
        // No payload: healthy when the connection opens.
        CheckKind::Tcp => health_check::HealthChecker::TcpHealthCheck(TcpHealthCheck::default()),
    };
    HealthCheck {
        timeout: Some(duration(check.timeout)),
        interval: Some(duration(check.interval)),
        // Envoy checks a cluster that has had no traffic yet only every 60 s by default: the
        // configured interval holds from the start instead.
        no_traffic_interval: Some(duration(check.interval)),
        unhealthy_threshold: uint(check.unhealthy_threshold),
        healthy_threshold: uint(check.healthy_threshold),
        health_checker: Some(checker),
        ..HealthCheck::default()
    }
}

fn endpoints_for(service: &Service, node: &NodeLocality) -> Vec<Arc<XdsResource>> {
    let instances = service.instances.iter().flat_map(|instance| {
        service.ports.iter().map(|port| {
            let name = cluster_name(&instance.dns_name, port.port);
            let endpoint = instance
                .endpoint(port.port)
                .map(|address| assignment::PlacedIp {
                    address,
                    zone: None,
                    priority: 0,
                });
            let assignment = assignment::encode(&name, endpoint);
            XdsResource::encoded::<ClusterLoadAssignment>(name, assignment)
        })
    });
    let distribution = preference(service);
    service
        .ports
        .iter()
        // An external port's assignment is inline in its cluster: nothing for EDS.
        .filter(|port| !port.is_external())
        .map(|port| {
            let name = cluster_name(&service.dns_name, port.port);
            let priorities = node.priorities(distribution, port.endpoints.iter());
            let endpoints =
                port.endpoints
                    .iter()
                    .zip(priorities)
                    .map(|(e, priority)| assignment::PlacedIp {
                        address: e.address,
                        zone: e.zone.as_deref(),
                        priority,
                    });
            let assignment = assignment::encode(&name, endpoints);
            XdsResource::encoded::<ClusterLoadAssignment>(name, assignment)
        })
        .chain(instances)
        .collect()
}

/// The preference a service's endpoints are ranked by. A service that Envoy cannot judge
/// unhealthy (neither outlier detection nor active checks) gets none: Envoy moves traffic to a
/// lower priority only when the preferred endpoints are unhealthy, so a dead preferred
/// endpoint would keep its traffic.
fn preference(service: &Service) -> TrafficDistribution {
    if service.health.outlier.is_none() && service.health.check.is_none() {
        return TrafficDistribution::Any;
    }
    service.traffic_distribution
}

/// One endpoint of an assignment as a message: where it is (a host name, in a DNS cluster's
/// inline assignment), its zone and its priority. Assignments of IPs, EDS's, are written
/// straight to bytes ([`assignment`]), the same bytes as this message's.
///
/// Nothing else: Envoy copies an endpoint's metadata into each of its hosts, and the
/// provider that reported each endpoint, which endpoints once carried as metadata for
/// operators, was a third of a 10k-service Envoy's initial sync (0.6 s of 2.1 s) and half the
/// bytes of an assignment, for a field Envoy never reads. `/debug/mesh` names each endpoint's
/// provider.
struct Placed<'a> {
    address: Address,
    zone: Option<&'a str>,
    priority: u32,
}

#[cfg(test)]
fn ip_address(address: SocketAddr) -> Address {
    socket_address(address.ip().to_string(), address.port())
}

/// The endpoints grouped by priority and zone (one `LocalityLbEndpoints` each, the zone as
/// its locality). Envoy sends a priority's share of traffic to its healthy endpoints and the
/// rest (all of it when they are unhealthy) to the next priority.
fn load_assignment<'a>(
    cluster_name: String,
    endpoints: impl IntoIterator<Item = Placed<'a>>,
) -> ClusterLoadAssignment {
    let mut groups: BTreeMap<(u32, Option<&str>), Vec<LbEndpoint>> = BTreeMap::new();
    for placed in endpoints {
        groups
            .entry((placed.priority, placed.zone))
            .or_default()
            .push(LbEndpoint {
                host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                    address: Some(placed.address),
                    ..Endpoint::default()
                })),
                ..LbEndpoint::default()
            });
    }
    // An assignment without endpoints keeps its one empty group.
    if groups.is_empty() {
        groups.insert((0, None), Vec::new());
    }
    ClusterLoadAssignment {
        cluster_name,
        endpoints: groups
            .into_iter()
            .map(|((priority, zone), lb_endpoints)| LocalityLbEndpoints {
                locality: zone.map(|zone| Locality {
                    zone: zone.to_string(),
                    ..Locality::default()
                }),
                lb_endpoints,
                priority,
                ..LocalityLbEndpoints::default()
            })
            .collect(),
        ..ClusterLoadAssignment::default()
    }
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

/// The services `service`'s routing rules send traffic to, by DNS name.
fn backends_of(service: &Service) -> Vec<Arc<str>> {
    let names: BTreeSet<String> = service
        .routes
        .iter()
        .flat_map(|rule| &rule.backends)
        .filter_map(|backend| match &backend.target {
            BackendTarget::Service { path, .. } => Some(path.dns_name()),
            BackendTarget::Unresolved { .. } => None,
        })
        .filter(|name| *name != service.dns_name)
        .collect();
    names
        .into_iter()
        .map(|name| Arc::from(name.as_str()))
        .collect()
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use envoy_types::pb::envoy::config::core::v3::transport_socket;
    use envoy_types::pb::envoy::config::listener::v3::{FilterChain, Listener};
    use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
        UpstreamTlsContext, common_tls_context,
    };
    use envoy_types::pb::envoy::r#type::matcher::v3::string_matcher;

    use super::listener::http_chain;
    use super::*;
    use crate::mesh::{EndpointSet, MeshState, Protocol, Provider, ServiceSpec};
    use crate::xds::Part;

    fn mesh(state: &mut MeshState, services: Vec<(&str, Vec<ServicePort>)>) -> Arc<MeshSnapshot> {
        let specs = services
            .into_iter()
            .map(|(path, ports)| ServiceSpec::new(path.parse().unwrap(), ports))
            .collect();
        state.replace_all(specs).unwrap();
        state.snapshot()
    }

    fn decode<M: Message + Default>(resource: &XdsResource) -> M {
        M::decode(resource.body.value.as_slice()).unwrap()
    }

    fn example(state: &mut MeshState) -> Arc<MeshSnapshot> {
        mesh(
            state,
            vec![
                (
                    "/foo/bar/buzz",
                    vec![ServicePort::parsed(
                        8080,
                        Protocol::Http,
                        &["10.0.0.1:9090", "10.0.0.2:9090"],
                    )],
                ),
                (
                    "/foo/greeter",
                    vec![ServicePort::parsed(
                        8080,
                        Protocol::Grpc,
                        &["10.0.0.3:50051"],
                    )],
                ),
                (
                    "/foo/db",
                    vec![ServicePort::parsed(5432, Protocol::Tcp, &["10.0.0.9:5432"])],
                ),
            ],
        )
    }

    #[test]
    fn services_on_a_shared_port_share_that_ports_chain() {
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        let http = |port| ServicePort::parsed(port, Protocol::Http, &["10.0.0.1:9090"]);
        let snapshot = mesh(
            &mut state,
            vec![
                ("/foo/a", vec![http(80)]),
                ("/foo/b", vec![http(8080), http(80)]),
                (
                    "/foo/db",
                    vec![ServicePort::parsed(5432, Protocol::Tcp, &["10.0.0.9:5432"])],
                ),
            ],
        );
        let mut translator = EnvoyTranslator::default();
        let xds = translator.translate(&snapshot);
        let shared = snapshot.trap.shared();
        let listener: Arc<str> = Arc::from(OUTBOUND_LISTENER);
        let expected = |port: u16| {
            let chain = http_chain(route_name(port), shared, port);
            Part::filter_chain(&listener, &chain.name, &chain)
        };
        let chains = |name: &str| xds.parts.services[name].chains.clone();
        assert_eq!(chains("a.foo.system.internal"), vec![expected(80)]);
        // A service's ports are in order.
        assert_eq!(
            chains("b.foo.system.internal"),
            vec![expected(80), expected(8080)]
        );
        // Made once: both services hold the very bytes of port 80's chain.
        assert_eq!(
            chains("a.foo.system.internal")[0].entry.as_ptr(),
            chains("b.foo.system.internal")[0].entry.as_ptr()
        );
        // A service with an address of its own has a chain of its own.
        let db = chains("db.foo.system.internal");
        assert_eq!(db.len(), 1);
        assert!(db[0].key.starts_with("tcp|"), "{}", db[0].key);
        // A later service on a port none had before gets that port's chain.
        let snapshot = mesh(
            &mut state,
            vec![
                ("/foo/a", vec![http(80)]),
                ("/foo/b", vec![http(8080), http(80)]),
                ("/foo/c", vec![http(9000)]),
            ],
        );
        let xds = translator.translate(&snapshot);
        assert_eq!(
            xds.parts.services["c.foo.system.internal"].chains,
            vec![expected(9000)]
        );
    }

    #[test]
    fn many_services_built_on_every_core_are_those_built_one_change_at_a_time() {
        let services = |n: usize| -> Vec<(String, Vec<ServicePort>)> {
            (0..n)
                .map(|i| {
                    let endpoints = [format!("10.1.{}.{}:8080", i / 250, i % 250)];
                    let endpoints: Vec<&str> = endpoints.iter().map(String::as_str).collect();
                    let protocol = [Protocol::Http, Protocol::Tcp, Protocol::Grpc][i % 3];
                    (
                        format!("/ns{}/svc{i}", i % 7),
                        vec![ServicePort::parsed(80, protocol, &endpoints)],
                    )
                })
                .collect()
        };
        let snapshot = |state: &mut MeshState, n: usize| {
            let all = services(n);
            mesh(
                state,
                all.iter()
                    .map(|(p, ports)| (p.as_str(), ports.clone()))
                    .collect(),
            )
        };
        let total = 3 * parallel::PARALLEL_FROM;
        let at_once = EnvoyTranslator::default().translate(&snapshot(
            &mut MeshState::new("240.240.0.0/16".parse().unwrap()),
            total,
        ));
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        let mut stepwise = EnvoyTranslator::default();
        let mut last = None;
        for n in (parallel::PARALLEL_FROM / 2..=total).step_by(parallel::PARALLEL_FROM / 2) {
            last = Some(stepwise.translate(&snapshot(&mut state, n)));
        }
        let last = last.unwrap();
        // The listener and the route configurations are composed of each service's parts,
        // built in the same parallel step as its clusters.
        for kind in [
            ResourceType::Cluster,
            ResourceType::Endpoint,
            ResourceType::Listener,
            ResourceType::Route,
        ] {
            let bodies = |xds: &XdsSnapshot| -> Vec<(Arc<str>, Vec<u8>)> {
                xds.of(kind)
                    .iter()
                    .map(|(name, r)| (name.clone(), r.body.value.clone()))
                    .collect()
            };
            if matches!(kind, ResourceType::Cluster | ResourceType::Endpoint) {
                assert_eq!(bodies(&at_once).len(), total);
            } else {
                assert!(!bodies(&at_once).is_empty(), "no {kind:?}");
            }
            assert!(bodies(&at_once) == bodies(&last), "{kind:?} differ");
        }
    }

    #[test]
    fn a_service_with_identities_is_called_over_mesh_mtls_only_when_secrets_are_served() {
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        let web = ServiceSpec::new(
            "/shop/web".parse().unwrap(),
            vec![ServicePort::parsed(
                8080,
                Protocol::Http,
                &["10.0.0.1:8080"],
            )],
        )
        .with_identities(vec![Arc::from("spiffe://cluster.local/ns/shop/sa/web")]);
        let plain = ServiceSpec::new(
            "/shop/db".parse().unwrap(),
            vec![ServicePort::parsed(5432, Protocol::Tcp, &["10.0.0.2:5432"])],
        );
        state.replace_all(vec![web, plain]).unwrap();
        let mesh = state.snapshot();
        let cluster = |translator: EnvoyTranslator, name: &str| -> Cluster {
            let mut translator = translator;
            decode(&translator.translate(&mesh).of(ResourceType::Cluster)[name])
        };
        let web = "web.shop.system.internal|8080";
        assert_eq!(
            cluster(EnvoyTranslator::default(), web).transport_socket,
            None
        );
        let tls = cluster(EnvoyTranslator::default().with_mesh_mtls(true), web)
            .transport_socket
            .expect("mesh mTLS");
        let Some(transport_socket::ConfigType::TypedConfig(any)) = tls.config_type else {
            panic!("no TLS context");
        };
        let context = UpstreamTlsContext::decode(any.value.as_slice()).unwrap();
        let common = context.common_tls_context.unwrap();
        assert_eq!(common.alpn_protocols, [lattice_contract::MESH_ALPN]);
        assert_eq!(common.tls_certificate_sds_secret_configs[0].name, "default");
        let Some(common_tls_context::ValidationContextType::CombinedValidationContext(combined)) =
            common.validation_context_type
        else {
            panic!("no validation");
        };
        assert_eq!(
            combined.validation_context_sds_secret_config.unwrap().name,
            "ROOTCA"
        );
        let sans = combined
            .default_validation_context
            .unwrap()
            .match_typed_subject_alt_names;
        assert_eq!(sans.len(), 1);
        assert_eq!(
            sans[0].matcher.as_ref().unwrap().match_pattern,
            Some(string_matcher::MatchPattern::Exact(
                "spiffe://cluster.local/ns/shop/sa/web".into()
            ))
        );
        let db = cluster(
            EnvoyTranslator::default().with_mesh_mtls(true),
            "db.shop.system.internal|5432",
        );
        assert_eq!(db.transport_socket, None, "no identities, no mTLS");
    }

    #[test]
    fn one_eds_cluster_and_assignment_per_service_port() {
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        let xds = EnvoyTranslator::default().translate(&example(&mut state));
        let names: Vec<&str> = xds.of(ResourceType::Cluster).keys().map(|k| &**k).collect();
        assert_eq!(
            names,
            [
                "buzz.bar.foo.system.internal|8080",
                "db.foo.system.internal|5432",
                "greeter.foo.system.internal|8080"
            ]
        );
        let buzz: Cluster =
            decode(&xds.of(ResourceType::Cluster)["buzz.bar.foo.system.internal|8080"]);
        assert_eq!(
            buzz.cluster_discovery_type,
            Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32))
        );
        assert!(matches!(
            buzz.eds_cluster_config
                .unwrap()
                .eds_config
                .unwrap()
                .config_source_specifier,
            Some(config_source::ConfigSourceSpecifier::Ads(_))
        ));
        assert!(
            buzz.typed_extension_protocol_options.is_empty(),
            "HTTP/1 upstream"
        );
        let greeter: Cluster =
            decode(&xds.of(ResourceType::Cluster)["greeter.foo.system.internal|8080"]);
        assert!(
            greeter
                .typed_extension_protocol_options
                .contains_key("envoy.extensions.upstreams.http.v3.HttpProtocolOptions"),
            "gRPC needs HTTP/2 upstream"
        );

        let cla: ClusterLoadAssignment =
            decode(&xds.of(ResourceType::Endpoint)["buzz.bar.foo.system.internal|8080"]);
        let addrs = cla_addresses(&cla);
        assert_eq!(
            addrs,
            ["10.0.0.1:9090", "10.0.0.2:9090"],
            "target ports, not service ports"
        );
        // Envoy copies an endpoint's metadata into each host: none is sent (Envoy reads none).
        for group in &cla.endpoints {
            assert_eq!(group.metadata, None);
            for endpoint in &group.lb_endpoints {
                assert_eq!(endpoint.metadata, None, "{endpoint:?}");
            }
        }
    }

    /// Each chain of the listener with the destination address and port it matches.
    fn chain_matches(listener: &Listener) -> impl Iterator<Item = (String, u32, &FilterChain)> {
        listener.filter_chains.iter().map(|c| {
            let m = c.filter_chain_match.as_ref().unwrap();
            (
                m.prefix_ranges[0].address_prefix.clone(),
                m.destination_port.as_ref().unwrap().value,
                c,
            )
        })
    }

    fn cla_addresses(cla: &ClusterLoadAssignment) -> Vec<String> {
        cla.endpoints[0]
            .lb_endpoints
            .iter()
            .map(|e| match &e.host_identifier {
                Some(lb_endpoint::HostIdentifier::Endpoint(ep)) => {
                    match &ep.address.as_ref().unwrap().address {
                        Some(address::Address::SocketAddress(sa)) => match sa.port_specifier {
                            Some(socket_address::PortSpecifier::PortValue(p)) => {
                                format!("{}:{p}", sa.address)
                            }
                            _ => panic!("no port"),
                        },
                        _ => panic!("not a socket address"),
                    }
                }
                _ => panic!("no endpoint"),
            })
            .collect()
    }

    fn stateful_db(state: &mut MeshState, db1_ip: &str) -> Arc<MeshSnapshot> {
        let instance = |name: &str, ip: &str, ready: bool| crate::mesh::InstanceSpec {
            name: name.to_string(),
            ready,
            endpoints: vec![
                (8080, format!("{ip}:8081").parse().unwrap()),
                (9042, format!("{ip}:9042").parse().unwrap()),
            ],
        };
        let spec = ServiceSpec::new(
            "/data/db".parse().unwrap(),
            vec![
                ServicePort::parsed(9042, Protocol::Tcp, &["10.1.0.10:9042"]),
                ServicePort::parsed(8080, Protocol::Http, &["10.1.0.10:8081"]),
            ],
        )
        .with_instances(vec![
            instance("db-0", "10.1.0.10", true),
            instance("db-1", db1_ip, false),
        ]);
        state.replace_all(vec![spec]).unwrap();
        state.snapshot()
    }

    #[test]
    fn every_instance_port_has_a_cluster_and_a_chain_that_reach_that_instance_alone() {
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        let mut translator = EnvoyTranslator::default();
        let mesh = stateful_db(&mut state, "10.1.0.11");
        let xds = translator.translate(&mesh);
        let names: Vec<&str> = xds.of(ResourceType::Cluster).keys().map(|k| &**k).collect();
        assert_eq!(
            names,
            [
                "db-0.db.data.system.internal|8080",
                "db-0.db.data.system.internal|9042",
                "db-1.db.data.system.internal|8080",
                "db-1.db.data.system.internal|9042",
                // The service's own clusters stay, for routes that send to it.
                "db.data.system.internal|8080",
                "db.data.system.internal|9042",
            ]
        );
        let endpoints = |xds: &XdsSnapshot, name: &str| {
            cla_addresses(&decode(&xds.of(ResourceType::Endpoint)[name]))
        };
        // An instance cluster has no health policy: its one host is the client's choice.
        let instance: Cluster =
            decode(&xds.of(ResourceType::Cluster)["db-0.db.data.system.internal|9042"]);
        assert!(instance.outlier_detection.is_none() && instance.health_checks.is_empty());
        // A not-ready instance is still reachable by its own name.
        assert_eq!(
            endpoints(&xds, "db-1.db.data.system.internal|8080"),
            ["10.1.0.11:8081"]
        );
        assert_eq!(
            endpoints(&xds, "db-0.db.data.system.internal|9042"),
            ["10.1.0.10:9042"]
        );

        let db = &mesh.services[&"/data/db".parse::<crate::mesh::MeshPath>().unwrap()];
        let listener: Listener = decode(&xds.of(ResourceType::Listener)[OUTBOUND_LISTENER]);
        let mut chains: Vec<(String, u32, String)> = chain_matches(&listener)
            .map(|(ip, port, chain)| (ip, port, chain.name.clone()))
            .collect();
        chains.sort();
        let mut expected = Vec::new();
        for instance in &db.instances {
            for port in [8080, 9042] {
                expected.push((
                    instance.address.to_string(),
                    port,
                    format!("tcp|{}|{port}", instance.dns_name),
                ));
            }
        }
        expected.sort();
        assert_eq!(chains, expected, "only instance addresses, every port");

        // db-1 moves to a new pod: only its assignments change; clusters and listener stay.
        let moved = stateful_db(&mut state, "10.1.0.99");
        let next = translator.translate(&moved);
        for kind in [ResourceType::Cluster, ResourceType::Listener] {
            for (name, resource) in xds.of(kind) {
                assert!(
                    Arc::ptr_eq(resource, &next.of(kind)[name]),
                    "{name} rebuilt"
                );
            }
        }
        assert_eq!(
            endpoints(&next, "db-1.db.data.system.internal|9042"),
            ["10.1.0.99:9042"]
        );
        assert!(Arc::ptr_eq(
            &xds.of(ResourceType::Endpoint)["db-0.db.data.system.internal|9042"],
            &next.of(ResourceType::Endpoint)["db-0.db.data.system.internal|9042"]
        ));
    }

    /// A cluster's outlier sweeps run at the policy's interval or up to a fifth later, by its
    /// name, so the clusters of a large mesh do not sweep all at once.
    #[test]
    fn outlier_sweeps_are_spread_by_cluster_name() {
        let interval = std::time::Duration::from_secs(5);
        let names: Vec<String> = (0..200)
            .map(|i| format!("s{i}.many.system.internal|8080"))
            .collect();
        let intervals: std::collections::BTreeSet<_> = names
            .iter()
            .map(|name| sweep_interval(interval, name))
            .collect();
        assert!(
            intervals
                .iter()
                .all(|d| *d >= interval && *d <= interval * 6 / 5),
            "{intervals:?}"
        );
        assert!(intervals.len() > 150, "{} distinct", intervals.len());
        assert_eq!(
            sweep_interval(interval, &names[7]),
            sweep_interval(interval, &names[7]),
            "the same for the same cluster"
        );
        let short = std::time::Duration::from_millis(3);
        assert_eq!(
            sweep_interval(short, &names[0]),
            short,
            "a fifth of 3 ms is 0"
        );
    }

    #[test]
    fn every_service_cluster_has_outlier_detection_and_active_checks_only_when_asked() {
        use crate::mesh::health::{ActiveCheck, CheckKind, HealthPolicy};
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        let checked = HealthPolicy {
            check: Some(ActiveCheck {
                kind: CheckKind::Http {
                    path: "/healthz".to_string(),
                    statuses: vec![(200, 300)],
                },
                interval: std::time::Duration::from_millis(1500),
                timeout: std::time::Duration::from_millis(500),
                healthy_threshold: 1,
                unhealthy_threshold: 2,
            }),
            outlier: None,
        };
        state
            .replace_all(vec![
                ServiceSpec::new(
                    "/a/plain".parse().unwrap(),
                    vec![ServicePort::parsed(8080, Protocol::Http, &["10.0.0.1:80"])],
                ),
                ServiceSpec::new(
                    "/a/checked".parse().unwrap(),
                    vec![ServicePort::parsed(8080, Protocol::Grpc, &["10.0.0.2:80"])],
                )
                .with_health(checked),
            ])
            .unwrap();
        let xds = EnvoyTranslator::default().translate(&state.snapshot());
        let plain: Cluster = decode(&xds.of(ResourceType::Cluster)["plain.a.system.internal|8080"]);
        let outlier = plain
            .outlier_detection
            .expect("outlier detection by default");
        let value = |v: Option<UInt32Value>| v.map(|v| v.value);
        assert_eq!(value(outlier.consecutive_5xx), Some(5));
        assert_eq!(
            value(outlier.enforcing_consecutive_gateway_failure),
            Some(100)
        );
        assert_eq!(value(outlier.enforcing_success_rate), Some(0));
        assert_eq!(value(outlier.max_ejection_percent), Some(50));
        assert!(outlier.split_external_local_origin_errors);
        let interval = outlier.interval.expect("an interval");
        assert!(
            interval.seconds == 5 || (interval.seconds == 6 && interval.nanos == 0),
            "5 s, spread by up to a fifth: {interval:?}"
        );
        assert!(
            plain.health_checks.is_empty(),
            "active checks are off by default"
        );

        let checked: Cluster =
            decode(&xds.of(ResourceType::Cluster)["checked.a.system.internal|8080"]);
        assert!(checked.outlier_detection.is_none(), "turned off");
        let check = &checked.health_checks[0];
        assert_eq!(
            check.interval,
            Some(Duration {
                seconds: 1,
                nanos: 500_000_000
            })
        );
        assert_eq!(check.no_traffic_interval, check.interval);
        assert_eq!(value(check.unhealthy_threshold), Some(2));
        let Some(health_check::HealthChecker::HttpHealthCheck(http)) = &check.health_checker else {
            panic!("an HTTP check: {check:?}")
        };
        assert_eq!(http.path, "/healthz");
        assert_eq!(http.host, "checked.a.system.internal");
        assert_eq!(
            http.codec_client_type,
            CodecClientType::Http2 as i32,
            "gRPC port"
        );
        assert_eq!(
            http.expected_statuses,
            [Int64Range {
                start: 200,
                end: 300
            }]
        );
    }

    /// Each group of an assignment: (priority, zone, addresses).
    fn groups(cla: &ClusterLoadAssignment) -> Vec<(u32, String, Vec<String>)> {
        cla.endpoints
            .iter()
            .map(|group| {
                let zone = group.locality.as_ref().map(|l| l.zone.clone());
                let single = ClusterLoadAssignment {
                    endpoints: vec![group.clone()],
                    ..ClusterLoadAssignment::default()
                };
                (
                    group.priority,
                    zone.unwrap_or_default(),
                    cla_addresses(&single),
                )
            })
            .collect()
    }

    /// `/a/<name>` on 8080 with three endpoints: .1 in zone a on node n1, .2 in zone a on n2,
    /// .3 in zone b.
    fn placed(name: &str, distribution: crate::mesh::TrafficDistribution) -> ServiceSpec {
        let endpoint = |ip: &str, zone: &str, node: &str| crate::mesh::Endpoint {
            zone: Some(Arc::from(zone)),
            node: Some(Arc::from(node)),
            ..crate::mesh::Endpoint::new(ip.parse().unwrap(), Provider::new("test"))
        };
        let endpoints = EndpointSet::new(vec![
            endpoint("10.0.0.1:80", "a", "n1"),
            endpoint("10.0.0.2:80", "a", "n2"),
            endpoint("10.0.0.3:80", "b", "n3"),
        ]);
        let port = ServicePort {
            name: None,
            port: 8080,
            protocol: Protocol::Http,
            endpoints,
            hosts: Default::default(),
        };
        ServiceSpec::new(format!("/a/{name}").parse().unwrap(), vec![port])
            .with_traffic_distribution(distribution)
    }

    fn strings(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn endpoint_priorities_follow_each_services_preference_for_this_node() {
        use crate::mesh::TrafficDistribution::{Any, PreferSameNode, PreferSameZone};
        use crate::mesh::locality::ZoneSource;
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        let blind = HealthPolicy {
            check: None,
            outlier: None,
        };
        state
            .replace_all(vec![
                placed("plain", Any),
                placed("zoned", PreferSameZone),
                placed("noded", PreferSameNode),
                placed("blind", PreferSameZone).with_health(blind),
            ])
            .unwrap();
        let mesh = state.snapshot();
        let here = NodeLocality::with_zone(Some(Arc::from("n1")), Arc::from("a"), ZoneSource::Flag);
        let mut translator = EnvoyTranslator::new(here, ExternalDns::default());
        let xds = translator.translate(&mesh);
        let of = |xds: &XdsSnapshot, name: &str| {
            groups(&decode(
                &xds.of(ResourceType::Endpoint)[&*format!("{name}.a.system.internal|8080")],
            ))
        };
        // No preference: one priority, zones still recorded as localities.
        assert_eq!(
            of(&xds, "plain"),
            [
                (0, "a".to_string(), strings(&["10.0.0.1:80", "10.0.0.2:80"])),
                (0, "b".to_string(), strings(&["10.0.0.3:80"])),
            ]
        );
        assert_eq!(
            of(&xds, "zoned"),
            [
                (0, "a".to_string(), strings(&["10.0.0.1:80", "10.0.0.2:80"])),
                (1, "b".to_string(), strings(&["10.0.0.3:80"])),
            ]
        );
        assert_eq!(
            of(&xds, "noded"),
            [
                (0, "a".to_string(), strings(&["10.0.0.1:80"])),
                (1, "a".to_string(), strings(&["10.0.0.2:80"])),
                (2, "b".to_string(), strings(&["10.0.0.3:80"])),
            ]
        );
        // Envoy could not see a preferred endpoint die: no preference.
        assert_eq!(of(&xds, "blind"), of(&xds, "plain"));

        // Unknown zone: PreferSameZone has nothing to go by; PreferSameNode still has the node.
        let blindfolded = NodeLocality::without_zone(Some(Arc::from("n1")), "no --node-zone");
        let unknown = EnvoyTranslator::new(blindfolded, ExternalDns::default()).translate(&mesh);
        assert_eq!(of(&unknown, "zoned"), of(&xds, "plain"));
        assert_eq!(
            of(&unknown, "noded"),
            [
                (0, "a".to_string(), strings(&["10.0.0.1:80"])),
                (1, "a".to_string(), strings(&["10.0.0.2:80"])),
                (1, "b".to_string(), strings(&["10.0.0.3:80"])),
            ]
        );

        // A preference changed alone re-sends that assignment only.
        state
            .replace_all(vec![
                placed("plain", PreferSameZone),
                placed("zoned", PreferSameZone),
                placed("noded", PreferSameNode),
                placed("blind", PreferSameZone).with_health(HealthPolicy {
                    check: None,
                    outlier: None,
                }),
            ])
            .unwrap();
        let next = translator.translate(&state.snapshot());
        assert_eq!(of(&next, "plain"), of(&xds, "zoned"));
        for (name, resource) in xds.of(ResourceType::Cluster) {
            assert!(Arc::ptr_eq(resource, &next.of(ResourceType::Cluster)[name]));
        }
        let changed: Vec<&str> = xds
            .of(ResourceType::Endpoint)
            .iter()
            .filter(|(name, r)| next.of(ResourceType::Endpoint)[*name].version != r.version)
            .map(|(name, _)| &**name)
            .collect();
        assert_eq!(changed, ["plain.a.system.internal|8080"]);
    }

    #[test]
    fn hints_naming_this_zone_or_node_rank_without_a_distribution() {
        use crate::mesh::locality::ZoneSource;
        let hinted = |ip: &str, zones: &[&str], nodes: &[&str]| crate::mesh::Endpoint {
            hints: Some(Arc::new(crate::mesh::Hints {
                for_zones: zones.iter().map(|z| Arc::from(*z)).collect(),
                for_nodes: nodes.iter().map(|n| Arc::from(*n)).collect(),
            })),
            ..crate::mesh::Endpoint::new(ip.parse().unwrap(), Provider::new("test"))
        };
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        let port = ServicePort {
            name: None,
            port: 8080,
            protocol: Protocol::Http,
            endpoints: EndpointSet::new(vec![
                hinted("10.0.0.1:80", &["b"], &[]),
                hinted("10.0.0.2:80", &["a"], &[]),
            ]),
            hosts: Default::default(),
        };
        state
            .replace_all(vec![ServiceSpec::new(
                "/a/web".parse().unwrap(),
                vec![port],
            )])
            .unwrap();
        let here = NodeLocality::with_zone(Some(Arc::from("n1")), Arc::from("a"), ZoneSource::Flag);
        let xds = EnvoyTranslator::new(here, ExternalDns::default()).translate(&state.snapshot());
        let cla: ClusterLoadAssignment =
            decode(&xds.of(ResourceType::Endpoint)["web.a.system.internal|8080"]);
        assert_eq!(
            groups(&cla),
            [
                (0, String::new(), strings(&["10.0.0.2:80"])),
                (1, String::new(), strings(&["10.0.0.1:80"])),
            ]
        );
    }

    /// An external service `/ext/<name>` on `port`, served by `hosts` on `target`.
    fn external(
        name: &str,
        port_number: u16,
        protocol: Protocol,
        hosts: &[&str],
        target: u16,
    ) -> ServiceSpec {
        let mut port = ServicePort::parsed(port_number, protocol, &[]);
        port.hosts = hosts
            .iter()
            .map(|h| crate::mesh::HostEndpoint {
                host: h.parse().unwrap(),
                port: target,
                provider: Provider::new("test"),
            })
            .collect();
        ServiceSpec::new(format!("/ext/{name}").parse().unwrap(), vec![port])
    }

    fn http_check() -> crate::mesh::HealthPolicy {
        use crate::mesh::health::{ActiveCheck, CheckKind};
        crate::mesh::HealthPolicy {
            check: Some(ActiveCheck {
                kind: CheckKind::Http {
                    path: "/healthz".to_string(),
                    statuses: vec![(200, 300)],
                },
                interval: std::time::Duration::from_secs(1),
                timeout: std::time::Duration::from_millis(500),
                healthy_threshold: 1,
                unhealthy_threshold: 2,
            }),
            outlier: None,
        }
    }

    #[allow(deprecated)]
    #[test]
    fn host_name_endpoints_make_dns_clusters_that_follow_the_ttl_through_the_agents_dns() {
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        state
            .replace_all(vec![
                external("one", 443, Protocol::Tcp, &["db.example.com"], 443),
                external(
                    "pool",
                    8080,
                    Protocol::Http,
                    &["a.example.com", "b.example.com"],
                    80,
                ),
            ])
            .unwrap();
        let resolver: SocketAddr = "10.200.0.1:53".parse().unwrap();
        let xds = EnvoyTranslator::new(
            NodeLocality::without_zone(None, "unknown"),
            ExternalDns {
                resolver: Some(resolver),
            },
        )
        .translate(&state.snapshot());
        assert!(
            xds.of(ResourceType::Endpoint).is_empty(),
            "host names cannot go over EDS"
        );
        let one: Cluster = decode(&xds.of(ResourceType::Cluster)["one.ext.system.internal|443"]);
        assert_eq!(
            one.cluster_discovery_type,
            Some(ClusterDiscoveryType::Type(DiscoveryType::LogicalDns as i32)),
            "one name fronts a pool"
        );
        assert!(one.eds_cluster_config.is_none());
        assert_eq!(
            cla_addresses(one.load_assignment.as_ref().unwrap()),
            ["db.example.com:443"]
        );
        assert!(one.respect_dns_ttl);
        assert_eq!(one.dns_refresh_rate, Some(duration(DNS_REFRESH)));
        let failure = one.dns_failure_refresh_rate.as_ref().unwrap();
        assert_eq!(failure.base_interval, Some(duration(DNS_FAILURE_REFRESH)));
        assert_eq!(
            failure.max_interval,
            Some(duration(DNS_FAILURE_REFRESH_MAX))
        );
        assert_eq!(one.dns_lookup_family, DnsLookupFamily::V4Preferred as i32);
        assert!(
            one.outlier_detection.is_some(),
            "health settings still apply"
        );
        let dns = one.typed_dns_resolver_config.as_ref().unwrap();
        let cares =
            CaresDnsResolverConfig::decode(dns.typed_config.as_ref().unwrap().value.as_slice())
                .unwrap();
        assert_eq!(cares.resolvers, [socket_address("10.200.0.1".into(), 53)]);
        assert!(!cares.use_resolvers_as_fallback);

        let pool: Cluster = decode(&xds.of(ResourceType::Cluster)["pool.ext.system.internal|8080"]);
        assert_eq!(
            pool.cluster_discovery_type,
            Some(ClusterDiscoveryType::Type(DiscoveryType::StrictDns as i32)),
            "every address of every name"
        );
        assert_eq!(
            cla_addresses(pool.load_assignment.as_ref().unwrap()),
            ["a.example.com:80", "b.example.com:80"]
        );

        // TCP (TLS included) is a plain TCP proxy: bytes, SNI with them, pass untouched.
        let listener: Listener = decode(&xds.of(ResourceType::Listener)[OUTBOUND_LISTENER]);
        let tcp: Vec<&str> = chain_matches(&listener)
            .filter(|(_, port, _)| *port == 443)
            .map(|(_, _, chain)| chain.filters[0].name.as_str())
            .collect();
        assert_eq!(tcp, ["envoy.filters.network.tcp_proxy"]);

        // Without a resolver, Envoy's default (the pod's resolv.conf).
        let xds = EnvoyTranslator::default().translate(&state.snapshot());
        let one: Cluster = decode(&xds.of(ResourceType::Cluster)["one.ext.system.internal|443"]);
        assert!(one.typed_dns_resolver_config.is_none());
    }

    #[test]
    fn a_changed_host_name_rebuilds_the_cluster() {
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        let mut translator = EnvoyTranslator::default();
        state
            .replace_all(vec![external(
                "db",
                5432,
                Protocol::Tcp,
                &["a.example.com"],
                5432,
            )])
            .unwrap();
        translator.translate(&state.snapshot());
        state
            .replace_all(vec![external(
                "db",
                5432,
                Protocol::Tcp,
                &["b.example.com"],
                5432,
            )])
            .unwrap();
        let xds = translator.translate(&state.snapshot());
        let db: Cluster = decode(&xds.of(ResourceType::Cluster)["db.ext.system.internal|5432"]);
        assert_eq!(
            cla_addresses(db.load_assignment.as_ref().unwrap()),
            ["b.example.com:5432"]
        );
    }

    #[test]
    fn http_to_an_external_service_rewrites_host_unless_it_keeps_the_clients() {
        use envoy_types::pb::envoy::config::route::v3::{RouteConfiguration, route, route_action};
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        state
            .replace_all(vec![
                external("rewrite", 8080, Protocol::Http, &["api.example.com"], 80)
                    .with_health(http_check()),
                external("keep", 8080, Protocol::Http, &["api.example.com"], 80)
                    .with_host_header(crate::mesh::HostHeader::Keep)
                    .with_health(http_check()),
                ServiceSpec::new(
                    "/a/plain".parse().unwrap(),
                    vec![ServicePort::parsed(8080, Protocol::Http, &["10.0.0.1:80"])],
                ),
            ])
            .unwrap();
        let xds = EnvoyTranslator::default().translate(&state.snapshot());
        let routes: RouteConfiguration = decode(&xds.of(ResourceType::Route)["http.8080"]);
        let rewrite = |vhost: &str| {
            let host = routes
                .virtual_hosts
                .iter()
                .find(|v| v.name == cluster_name(vhost, 8080))
                .unwrap();
            let Some(route::Action::Route(action)) = &host.routes[0].action else {
                panic!("a route action for {vhost}")
            };
            matches!(
                action.host_rewrite_specifier,
                Some(route_action::HostRewriteSpecifier::AutoHostRewrite(ref v)) if v.value
            )
        };
        assert!(rewrite("rewrite.ext.system.internal"), "the default");
        let checked = xds.of(ResourceType::Cluster);
        let check_host = |name: &str| {
            let cluster: Cluster = decode(&checked[name]);
            match cluster.health_checks[0].health_checker.clone() {
                Some(health_check::HealthChecker::HttpHealthCheck(http)) => http.host,
                other => panic!("an HTTP check: {other:?}"),
            }
        };
        assert_eq!(
            check_host("rewrite.ext.system.internal|8080"),
            "api.example.com",
            "checks carry the Host requests do"
        );
        assert_eq!(
            check_host("keep.ext.system.internal|8080"),
            "keep.ext.system.internal"
        );
        assert!(!rewrite("keep.ext.system.internal"));
        assert!(!rewrite("plain.a.system.internal"));
    }

    #[test]
    fn listener_picks_chains_by_destination_and_has_no_default() {
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        let mesh = example(&mut state);
        let db = mesh.services[&"/foo/db".parse::<crate::mesh::MeshPath>().unwrap()]
            .address
            .ip()
            .unwrap();
        let xds = EnvoyTranslator::default().translate(&mesh);
        let listener: Listener = decode(&xds.of(ResourceType::Listener)[OUTBOUND_LISTENER]);
        assert_eq!(
            listener.address,
            Some(socket_address("0.0.0.0".into(), 15001)),
            "the default capture port"
        );
        assert_eq!(
            listener.listener_filters[0].name,
            "envoy.filters.listener.original_dst"
        );
        assert!(
            listener.default_filter_chain.is_none(),
            "unmatched connections must be closed"
        );
        let chains: Vec<(String, u32, &str)> = chain_matches(&listener)
            .map(|(ip, port, chain)| (ip, port, chain.filters[0].name.as_str()))
            .collect();
        assert_eq!(
            chains,
            [
                (
                    "240.240.0.1".to_string(),
                    8080,
                    "envoy.filters.network.http_connection_manager"
                ),
                (db.to_string(), 5432, "envoy.filters.network.tcp_proxy"),
            ]
        );
        let moved = EnvoyTranslator::default()
            .with_capture_port("16001".parse().unwrap())
            .translate(&mesh);
        let listener: Listener = decode(&moved.of(ResourceType::Listener)[OUTBOUND_LISTENER]);
        assert_eq!(
            listener.address,
            Some(socket_address("0.0.0.0".into(), 16001)),
            "the capture listener follows --envoy-port"
        );
        let routes: RouteConfiguration = decode(&xds.of(ResourceType::Route)["http.8080"]);
        let domains: Vec<Vec<String>> = routes
            .virtual_hosts
            .iter()
            .map(|v| v.domains.clone())
            .collect();
        assert_eq!(
            domains,
            [
                vec![
                    "buzz.bar.foo.system.internal".to_string(),
                    "buzz.bar.foo.system.internal:8080".to_string()
                ],
                vec![
                    "greeter.foo.system.internal".to_string(),
                    "greeter.foo.system.internal:8080".to_string()
                ],
            ]
        );
    }

    #[test]
    fn an_empty_mesh_still_yields_a_valid_listener() {
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        let xds = EnvoyTranslator::default().translate(&mesh(&mut state, vec![]));
        let listener: Listener = decode(&xds.of(ResourceType::Listener)[OUTBOUND_LISTENER]);
        assert_eq!(listener.filter_chains.len(), 1);
        let m = listener.filter_chains[0]
            .filter_chain_match
            .as_ref()
            .unwrap();
        assert_eq!(
            m.prefix_ranges[0].address_prefix, "240.240.0.0",
            "never an assigned address"
        );
        // Nothing Envoy would wait for: no route configuration (a proxy scoped to nothing
        // holds none, and Delta Envoy would never finish starting).
        assert_eq!(
            listener.filter_chains[0].filters[0].name,
            "envoy.filters.network.tcp_proxy"
        );
        assert!(xds.of(ResourceType::Cluster).is_empty());
    }

    #[test]
    fn an_endpoint_change_reuses_everything_but_its_assignment() {
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        let mut translator = EnvoyTranslator::default();
        let first = translator.translate(&example(&mut state));
        let second = translator.translate(&mesh(
            &mut state,
            vec![
                (
                    "/foo/bar/buzz",
                    vec![ServicePort::parsed(
                        8080,
                        Protocol::Http,
                        &["10.0.0.1:9090"],
                    )],
                ),
                (
                    "/foo/greeter",
                    vec![ServicePort::parsed(
                        8080,
                        Protocol::Grpc,
                        &["10.0.0.3:50051"],
                    )],
                ),
                (
                    "/foo/db",
                    vec![ServicePort::parsed(5432, Protocol::Tcp, &["10.0.0.9:5432"])],
                ),
            ],
        ));
        for kind in [
            ResourceType::Cluster,
            ResourceType::Listener,
            ResourceType::Route,
        ] {
            for (name, resource) in first.of(kind) {
                assert!(
                    Arc::ptr_eq(resource, &second.of(kind)[name]),
                    "{name} was rebuilt"
                );
            }
        }
        let changed: Vec<&str> = first
            .of(ResourceType::Endpoint)
            .iter()
            .filter(|(name, r)| second.of(ResourceType::Endpoint)[*name].version != r.version)
            .map(|(name, _)| &**name)
            .collect();
        assert_eq!(changed, ["buzz.bar.foo.system.internal|8080"]);
        // Versions are content hashes: a fresh translator gives the same ones.
        let fresh = EnvoyTranslator::default().translate(&state.snapshot());
        for kind in ResourceType::ALL {
            for (name, resource) in second.of(kind) {
                assert_eq!(resource.version, fresh.of(kind)[name].version);
            }
        }
    }

    #[test]
    fn removing_a_service_removes_its_resources_and_routes() {
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        let mut translator = EnvoyTranslator::default();
        translator.translate(&example(&mut state));
        let after = translator.translate(&mesh(
            &mut state,
            vec![(
                "/foo/db",
                vec![ServicePort::parsed(5432, Protocol::Tcp, &["10.0.0.9:5432"])],
            )],
        ));
        assert_eq!(after.of(ResourceType::Cluster).len(), 1);
        assert_eq!(after.of(ResourceType::Endpoint).len(), 1);
        assert!(after.of(ResourceType::Route).is_empty());
        let listener: Listener = decode(&after.of(ResourceType::Listener)[OUTBOUND_LISTENER]);
        assert_eq!(listener.filter_chains.len(), 1);
    }
}
