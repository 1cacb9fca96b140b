//! The mesh model: what every source produces and every translator reads.
//!
//! Sources describe services as [`ServiceSpec`]s (path, ports, endpoints, and for a stateful
//! service its named instances) and hand them to a [`MeshState`], which assigns each service,
//! and each instance, its address from the trapped block and takes an immutable
//! [`MeshSnapshot`], published on the one [`channel`] every consumer reads. Nothing in here
//! knows about Kubernetes, files, Envoy or DNS.

mod address;
pub mod authorization;
pub mod health;
pub mod locality;
mod metrics;
mod path;
pub mod provider;
pub mod route;

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Instant;

use lattice_contract::TrapCidrs;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

pub use address::{AddressBook, AddressError, AddressRecord, RestoreReport};
pub use authorization::{Action, AuthorizationRule, Caller, PathMatch};
pub use health::HealthPolicy;
pub use locality::{Hints, NodeLocality, TrafficDistribution};
pub use metrics::MeshMetrics;
pub use path::{MeshPath, PathError};
pub use provider::{Provider, ProviderReport, ProviderRx, ProviderTx, Stale};
pub use route::{RejectedRoute, RouteRule, Rules};

/// How a service port speaks, which decides how Envoy routes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    Http,
    Http2,
    Grpc,
    Tcp,
}

impl Protocol {
    /// HTTP protocols are routed by Host header on the shared address; the rest need an
    /// address of their own.
    pub fn is_http(self) -> bool {
        !matches!(self, Protocol::Tcp)
    }

    /// Whether the upstream connection must be HTTP/2.
    pub fn is_http2(self) -> bool {
        matches!(self, Protocol::Http2 | Protocol::Grpc)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Http => "http",
            Protocol::Http2 => "http2",
            Protocol::Grpc => "grpc",
            Protocol::Tcp => "tcp",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A protocol name that is none of `http`, `http2`, `grpc`, `tcp`.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown protocol {0:?}: expected one of http, http2, grpc, tcp")]
pub struct UnknownProtocol(pub String);

impl FromStr for Protocol {
    type Err = UnknownProtocol;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "http" | "http1" | "http/1.1" => Ok(Protocol::Http),
            "http2" | "h2c" | "kubernetes.io/h2c" => Ok(Protocol::Http2),
            "grpc" => Ok(Protocol::Grpc),
            "tcp" => Ok(Protocol::Tcp),
            _ => Err(UnknownProtocol(s.to_string())),
        }
    }
}

/// One port of a service as a source describes it, with the endpoints that serve it.
///
/// Endpoints are full socket addresses because each port resolves its own target port (a
/// Kubernetes named port may map to different numbers on different endpoints).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServicePort {
    /// The port clients dial on the service's address.
    pub port: u16,
    /// The port's name, if the source gives one: SRV records (`_<name>._tcp.<service>`) are
    /// published for named ports.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<Arc<str>>,
    pub protocol: Protocol,
    /// Sorted and deduplicated, so equal sets compare equal.
    pub endpoints: EndpointSet,
    /// Endpoints known by host name (an external service), which Envoy resolves itself.
    /// Sorted and deduplicated; a port has these or IP `endpoints`, never both.
    #[serde(default, skip_serializing_if = "HostEndpoints::is_empty")]
    pub hosts: HostEndpoints,
}

impl ServicePort {
    /// Test fixture: `port` of `protocol` with endpoints at these addresses (`"10.0.0.1:80"`,
    /// see [`EndpointSet::parsed`]), no name and no host names.
    #[cfg(test)]
    pub fn parsed(port: u16, protocol: Protocol, endpoints: &[&str]) -> Self {
        ServicePort {
            port,
            name: None,
            protocol,
            endpoints: EndpointSet::parsed(endpoints),
            hosts: HostEndpoints::default(),
        }
    }

    /// Whether its endpoints are host names, resolved by Envoy: an external service's port.
    pub fn is_external(&self) -> bool {
        !self.hosts.is_empty()
    }
}

/// A DNS host name an external endpoint is reached by: `db.example.com`. Lowercase, without
/// the root's trailing dot; never an IP address.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct HostName(#[serde(deserialize_with = "host_name")] Arc<str>);

/// A host name read back (the node's last mesh) is checked as a source's is.
fn host_name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Arc<str>, D::Error> {
    let name = String::deserialize(d)?;
    name.parse::<HostName>()
        .map(|h| h.0)
        .map_err(serde::de::Error::custom)
}

/// Text that is not a host name, and why.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "{name:?} is not a host name ({reason}): expected dot-separated labels of 1-63 of a-z, 0-9 \
     and '-', not starting or ending with '-', at most 253 characters, the last label not all \
     digits"
)]
pub struct HostNameError {
    pub name: String,
    pub reason: &'static str,
}

impl HostName {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for HostName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for HostName {
    type Err = HostNameError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let error = |reason| HostNameError {
            name: s.to_string(),
            reason,
        };
        let name = s.strip_suffix('.').unwrap_or(s).to_ascii_lowercase();
        if name.is_empty() {
            return Err(error("empty"));
        }
        if name.len() > 253 {
            return Err(error("too long"));
        }
        if name.parse::<std::net::IpAddr>().is_ok() {
            return Err(error("an IP address"));
        }
        for label in name.split('.') {
            if label.is_empty() || label.len() > 63 {
                return Err(error("a label is empty or longer than 63"));
            }
            if !label
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            {
                return Err(error("a character other than a-z, 0-9, '-' and '.'"));
            }
            if label.starts_with('-') || label.ends_with('-') {
                return Err(error("a label starts or ends with '-'"));
            }
        }
        if name
            .rsplit('.')
            .next()
            .is_some_and(|last| last.bytes().all(|b| b.is_ascii_digit()))
        {
            return Err(error("the last label is all digits"));
        }
        Ok(HostName(name.into()))
    }
}

/// An endpoint known by host name and port, and the provider that reported it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct HostEndpoint {
    pub host: HostName,
    pub port: u16,
    pub provider: Provider,
}

/// The host-name endpoints of one service port: sorted by host and port, one per pair.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "Vec<HostEndpoint>")]
pub struct HostEndpoints(Arc<[HostEndpoint]>);

impl HostEndpoints {
    /// Where two entries share host and port, the first in the given order is kept, as in
    /// [`EndpointSet::new`].
    pub fn new(mut hosts: Vec<HostEndpoint>) -> Self {
        hosts.sort_by(|a, b| (&a.host, a.port).cmp(&(&b.host, b.port)));
        hosts.dedup_by(|a, b| a.host == b.host && a.port == b.port);
        HostEndpoints(hosts.into())
    }

    pub fn iter(&self) -> impl Iterator<Item = &HostEndpoint> {
        self.0.iter()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<Vec<HostEndpoint>> for HostEndpoints {
    fn from(hosts: Vec<HostEndpoint>) -> Self {
        HostEndpoints::new(hosts)
    }
}

impl FromIterator<HostEndpoint> for HostEndpoints {
    fn from_iter<I: IntoIterator<Item = HostEndpoint>>(iter: I) -> Self {
        HostEndpoints::new(iter.into_iter().collect())
    }
}

/// The `Host` an HTTP request to an external service carries upstream.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum HostHeader {
    /// The external host name (the endpoint Envoy picked): what a virtual-hosted upstream, a
    /// CDN or a TLS-terminating load balancer routes by. The mesh name the client used means
    /// nothing to it, so this is the default.
    #[default]
    Rewrite,
    /// The client's own `Host`, for an upstream that expects the mesh name or one the client
    /// sets itself.
    Keep,
}

/// A host-header mode that is neither `rewrite` nor `keep`.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown host header mode {0:?}: expected rewrite or keep")]
pub struct UnknownHostHeader(pub String);

impl FromStr for HostHeader {
    type Err = UnknownHostHeader;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "rewrite" => Ok(HostHeader::Rewrite),
            "keep" => Ok(HostHeader::Keep),
            _ => Err(UnknownHostHeader(s.to_string())),
        }
    }
}

/// One endpoint of a service port: where to connect, who said so, and where it runs.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Endpoint {
    pub address: SocketAddr,
    pub provider: Provider,
    /// The zone it runs in, where the provider knows (`topology.kubernetes.io/zone`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zone: Option<Arc<str>>,
    /// The node it runs on, where the provider knows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<Arc<str>>,
    /// The zones and nodes whose clients should prefer it (EndpointSlice hints).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hints: Option<Arc<Hints>>,
}

impl Endpoint {
    pub fn new(address: SocketAddr, provider: Provider) -> Self {
        Endpoint {
            address,
            provider,
            zone: None,
            node: None,
            hints: None,
        }
    }
}

/// The endpoints of one service port: sorted by address, one per address, shared cheaply.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "Vec<Endpoint>")]
pub struct EndpointSet(Arc<[Endpoint]>);

impl EndpointSet {
    /// Where two entries share an address, the first in the given order is kept: sources list
    /// the one they prefer first (the catalog lists providers in their configured order).
    pub fn new(mut endpoints: Vec<Endpoint>) -> Self {
        endpoints.sort_by_key(|e| e.address);
        endpoints.dedup_by_key(|e| e.address);
        EndpointSet(endpoints.into())
    }

    /// Test fixtures: endpoints at these addresses (`"10.0.0.1:80"`), from a `test` provider.
    #[cfg(test)]
    pub fn parsed(addresses: &[&str]) -> Self {
        let provider = Provider::new("test");
        addresses
            .iter()
            .map(|a| Endpoint::new(a.parse().expect("a socket address"), provider.clone()))
            .collect()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Endpoint> {
        self.0.iter()
    }

    /// The addresses alone, in order.
    pub fn addresses(&self) -> impl Iterator<Item = SocketAddr> + '_ {
        self.0.iter().map(|e| e.address)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<Vec<Endpoint>> for EndpointSet {
    fn from(endpoints: Vec<Endpoint>) -> Self {
        EndpointSet::new(endpoints)
    }
}

impl FromIterator<Endpoint> for EndpointSet {
    fn from_iter<I: IntoIterator<Item = Endpoint>>(iter: I) -> Self {
        EndpointSet::new(iter.into_iter().collect())
    }
}

/// One named instance of a stateful service, as a source describes it: a StatefulSet pod
/// behind a headless Service, or a mesh-file endpoint with a `name`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceSpec {
    /// A DNS label, unique within the service: `db-1`.
    pub name: String,
    /// Listed in the service name's answer. An instance that is not ready keeps its own name,
    /// address and clusters: a recovering replica must stay reachable by its peers.
    pub ready: bool,
    /// Where each service port reaches this instance: (service port, endpoint), by port.
    pub endpoints: Vec<(u16, SocketAddr)>,
}

/// A service as a source describes it, before it has an address.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceSpec {
    pub path: MeshPath,
    /// Sorted by port; ports are unique within a service.
    pub ports: Vec<ServicePort>,
    /// HTTP routing rules for requests sent to this service; none means every request goes to
    /// its own endpoints.
    pub routes: Rules,
    /// Named instances, by name. A service with instances is stateful: its name answers with
    /// the ready instances' addresses, and each instance has a name and address of its own.
    pub instances: Vec<InstanceSpec>,
    /// How its endpoints are judged healthy.
    pub health: HealthPolicy,
    /// Which endpoints a client should prefer (this node's, this zone's), if any.
    pub traffic_distribution: TrafficDistribution,
    /// The `Host` its HTTP requests carry upstream, for a service with host-name endpoints.
    pub host_header: HostHeader,
    /// Pods whose proxies hold this service whether or not they resolve it
    /// (`namespace/name`, `namespace/prefix*`), sorted; checked by the source.
    pub clients: Vec<Arc<str>>,
    /// The SPIFFE IDs its endpoints' proxies present, sorted: when there are any, clients
    /// call it over mesh mTLS and accept only these; checked by the source.
    pub identities: Vec<Arc<str>>,
    /// Who may call its endpoints, in canonical order (see [`authorization`]); none: anyone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub authorization: Vec<AuthorizationRule>,
    /// Endpoints that serve it but are not ready (starting, failing readiness, terminating),
    /// as (service port, endpoint), sorted: sent no traffic, but covered by its
    /// authorization, since their pods take calls dialled to them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unready: Vec<(u16, SocketAddr)>,
}

impl ServiceSpec {
    /// Builds a spec, sorting ports so equal services compare equal whatever the source order.
    pub fn new(path: MeshPath, mut ports: Vec<ServicePort>) -> Self {
        ports.sort_by_key(|p| p.port);
        ServiceSpec {
            path,
            ports,
            routes: Rules::from([]),
            instances: Vec::new(),
            health: HealthPolicy::default(),
            traffic_distribution: TrafficDistribution::Any,
            host_header: HostHeader::default(),
            clients: Vec::new(),
            identities: Vec::new(),
            authorization: Vec::new(),
            unready: Vec::new(),
        }
    }

    /// Endpoints that are not ready, which its rules cover all the same.
    pub fn with_unready(mut self, mut unready: Vec<(u16, SocketAddr)>) -> Self {
        unready.sort_unstable();
        unready.dedup();
        self.unready = unready;
        self
    }

    /// Who may call its endpoints.
    pub fn with_authorization(mut self, rules: Vec<AuthorizationRule>) -> Self {
        self.authorization = authorization::canonical(rules);
        self
    }

    /// The identities of its endpoints' proxies: it is called over mesh mTLS.
    pub fn with_identities(mut self, mut identities: Vec<Arc<str>>) -> Self {
        identities.sort();
        identities.dedup();
        self.identities = identities;
        self
    }

    /// Pods that use this service without resolving its name.
    pub fn with_clients(mut self, mut clients: Vec<Arc<str>>) -> Self {
        clients.sort();
        clients.dedup();
        self.clients = clients;
        self
    }

    pub fn with_traffic_distribution(mut self, distribution: TrafficDistribution) -> Self {
        self.traffic_distribution = distribution;
        self
    }

    pub fn with_host_header(mut self, host_header: HostHeader) -> Self {
        self.host_header = host_header;
        self
    }

    /// Whether any port's endpoints are host names.
    pub fn is_external(&self) -> bool {
        self.ports.iter().any(ServicePort::is_external)
    }

    pub fn with_health(mut self, health: HealthPolicy) -> Self {
        self.health = health;
        self
    }

    /// Makes the service stateful with these instances (sorted by name here).
    pub fn with_instances(mut self, mut instances: Vec<InstanceSpec>) -> Self {
        instances.sort_by(|a, b| a.name.cmp(&b.name));
        for instance in &mut instances {
            instance.endpoints.sort_unstable();
        }
        self.instances = instances;
        self
    }

    pub fn with_routes(mut self, routes: Vec<RouteRule>) -> Self {
        self.routes = routes.into();
        self
    }

    /// A service needs an address of its own as soon as one port is not HTTP: Envoy can only
    /// tell such services apart by destination address.
    pub fn needs_own_address(&self) -> bool {
        self.ports.iter().any(|p| !p.protocol.is_http())
    }
}

/// Where clients reach a service: the block's shared address, one of its own, or (a stateful
/// service) the addresses of its instances.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(tag = "kind", content = "ip", rename_all = "lowercase")]
pub enum ServiceAddress {
    Shared(Ipv4Addr),
    Own(Ipv4Addr),
    /// The service's name answers with its ready instances' addresses, as Kubernetes DNS
    /// does for a headless Service; it has no address of its own.
    Instances,
}

impl ServiceAddress {
    /// The one address the service's name resolves to, if it has one.
    pub fn ip(self) -> Option<Ipv4Addr> {
        match self {
            ServiceAddress::Shared(ip) | ServiceAddress::Own(ip) => Some(ip),
            ServiceAddress::Instances => None,
        }
    }
}

/// A named instance of a stateful service in a snapshot: its spec plus its name and address.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Instance {
    pub name: String,
    /// `/data/db/db-1`: what holds its address, and the name no service may take.
    #[serde(skip)]
    pub path: MeshPath,
    /// `db-1.db.data.system.internal` for instance `db-1` of `/data/db`.
    pub dns_name: String,
    /// Its own, from the trapped block; stable for as long as the instance exists.
    pub address: Ipv4Addr,
    pub ready: bool,
    /// What its readiness means for DNS, in words, for operators reading `/debug/mesh`.
    pub dns: &'static str,
    /// (service port, endpoint), by port.
    pub endpoints: Vec<(u16, SocketAddr)>,
}

impl Instance {
    fn dns_note(ready: bool) -> &'static str {
        if ready {
            "own name, and listed under the service name"
        } else {
            "own name only: left out of the service name's answer until ready"
        }
    }

    /// The endpoint that serves `port` on this instance, if any.
    pub fn endpoint(&self, port: u16) -> Option<SocketAddr> {
        self.endpoints
            .iter()
            .find(|(p, _)| *p == port)
            .map(|(_, endpoint)| *endpoint)
    }
}

/// A service in a snapshot: a spec plus its assigned address.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Service {
    pub path: MeshPath,
    /// `buzz.bar.foo.system.internal` for `/foo/bar/buzz`.
    pub dns_name: String,
    pub address: ServiceAddress,
    pub ports: Vec<ServicePort>,
    pub routes: Rules,
    /// A stateful service's instances, by name; empty for every other service.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub instances: Vec<Instance>,
    pub health: HealthPolicy,
    /// Shown only when the service asks for a preference.
    #[serde(skip_serializing_if = "TrafficDistribution::is_any")]
    pub traffic_distribution: TrafficDistribution,
    /// The `Host` its HTTP requests carry upstream when its endpoints are host names.
    pub host_header: HostHeader,
    /// Pods whose proxies hold it whether or not they resolve it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub clients: Vec<Arc<str>>,
    /// The SPIFFE IDs its endpoints present: called over mesh mTLS when there are any.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub identities: Vec<Arc<str>>,
    /// Who may call its endpoints; none: anyone.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub authorization: Vec<AuthorizationRule>,
    /// Endpoints not ready, which its rules cover (see [`ServiceSpec::unready`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unready: Vec<(u16, SocketAddr)>,
}

impl Service {
    /// Whether `spec` says what this service is, but for its address and instances (which the
    /// mesh assigns).
    fn described_by(&self, spec: &ServiceSpec) -> bool {
        self.ports == spec.ports
            && self.routes == spec.routes
            && self.health == spec.health
            && self.traffic_distribution == spec.traffic_distribution
            && self.host_header == spec.host_header
            && self.clients == spec.clients
            && self.identities == spec.identities
            && self.authorization == spec.authorization
            && self.unready == spec.unready
    }

    /// What a source would say to have this service served again (its address aside, which
    /// the address book keeps): how the node's last mesh is written down.
    pub fn spec(&self) -> ServiceSpec {
        ServiceSpec {
            path: self.path.clone(),
            ports: self.ports.clone(),
            routes: self.routes.clone(),
            instances: self
                .instances
                .iter()
                .map(|instance| InstanceSpec {
                    name: instance.name.clone(),
                    ready: instance.ready,
                    endpoints: instance.endpoints.clone(),
                })
                .collect(),
            health: self.health.clone(),
            traffic_distribution: self.traffic_distribution,
            host_header: self.host_header,
            clients: self.clients.clone(),
            identities: self.identities.clone(),
            authorization: self.authorization.clone(),
            unready: self.unready.clone(),
        }
    }

    /// Same names, addresses, readiness, health policy and ports (ignoring endpoints and
    /// routes): if two versions of a service have the same shape, only their endpoints or
    /// routes need pushing.
    /// An instance's readiness is shape because it decides the service name's DNS answer.
    pub fn same_shape(&self, other: &Service) -> bool {
        self.address == other.address
            && self.path == other.path
            && self.health == other.health
            && self.host_header == other.host_header
            && self.identities == other.identities
            && self.ports.len() == other.ports.len()
            && self
                .ports
                .iter()
                .zip(&other.ports)
                // Host names are shape: Envoy resolves them in the cluster itself, which has
                // no separate assignment to update.
                .all(|(a, b)| {
                    a.port == b.port
                        && a.protocol == b.protocol
                        && a.name == b.name
                        && a.hosts == b.hosts
                })
            && self.instances.len() == other.instances.len()
            && self
                .instances
                .iter()
                .zip(&other.instances)
                .all(|(a, b)| a.name == b.name && a.address == b.address && a.ready == b.ready)
    }

    /// Same endpoints on every port and every instance, preferred alike.
    pub fn same_endpoints(&self, other: &Service) -> bool {
        self.ports == other.ports
            && self.traffic_distribution == other.traffic_distribution
            && self.instances.len() == other.instances.len()
            && self
                .instances
                .iter()
                .zip(&other.instances)
                .all(|(a, b)| a.endpoints == b.endpoints)
    }
}

/// The services of a snapshot, by path. A persistent map: taking a snapshot, and comparing two
/// (`OrdMap::diff` skips shared subtrees), costs what changed, not the size of the mesh.
pub type ServiceMap = imbl::OrdMap<MeshPath, Arc<Service>>;

/// One immutable, consistent view of the mesh. Services are shared between snapshots when
/// unchanged (`Arc::ptr_eq` tells a translator it can reuse its previous output).
#[derive(Clone, Debug, Serialize)]
pub struct MeshSnapshot {
    /// Increases by one with every published change.
    pub version: u64,
    /// Increases by one with every change to the mesh's shape: a service came or went, or
    /// changed its name, address or ports. Endpoint changes leave it alone, so a translator
    /// whose output depends on the shape only (the DNS names, the capture listener) can skip
    /// them without comparing services.
    pub shape_version: u64,
    /// Read back from the node's last mesh at start, before every provider has reported:
    /// good enough to answer the names it holds, never pushed to a proxy (see the catalog's
    /// `last_mesh`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub provisional: bool,
    pub trap: TrapCidrs,
    pub services: ServiceMap,
    /// Routes the sources refused, and why: shown to operators, served to no proxy.
    pub rejected_routes: Arc<[RejectedRoute]>,
    /// Services a source left out of the mesh because of the path they claim, and why.
    pub refused_paths: Arc<[RefusedPath]>,
    /// When the source took this snapshot: where the push latency of what it changed starts.
    #[serde(skip)]
    pub taken_at: Instant,
    /// What the state counted as it changed ([`Totals`]).
    #[serde(skip)]
    totals: Totals,
}

impl MeshSnapshot {
    /// The endpoints and host names of every service's ports.
    pub fn endpoint_count(&self) -> usize {
        self.totals.endpoints
    }

    /// The routing rules of every service.
    pub fn route_rule_count(&self) -> usize {
        self.totals.route_rules
    }
}

/// A service a source left out of the mesh for the path it claims: one its namespace may not
/// claim, or one another service holds.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct RefusedPath {
    /// The service that claimed it: `namespace/name` for Kubernetes.
    pub service: String,
    pub path: String,
    pub reason: String,
}

/// Counts over every service, kept as services change: every snapshot is logged and measured
/// with them, and counting 10k services per change was a visible part of a mesh-file edit's
/// CPU (a profile at 10k services had `endpoint_count` alone at 5.8 %).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Totals {
    endpoints: usize,
    route_rules: usize,
}

impl Totals {
    fn of(service: &Service) -> Totals {
        Totals {
            endpoints: service
                .ports
                .iter()
                .map(|p| p.endpoints.len() + p.hosts.len())
                .sum(),
            route_rules: service.routes.len(),
        }
    }

    fn add(&mut self, service: &Service) {
        let other = Totals::of(service);
        self.endpoints += other.endpoints;
        self.route_rules += other.route_rules;
    }

    fn subtract(&mut self, service: &Service) {
        let other = Totals::of(service);
        self.endpoints -= other.endpoints;
        self.route_rules -= other.route_rules;
    }
}

/// The mutable side: sources apply changes here, then take a snapshot to publish.
///
/// Applying is incremental (one service at a time), so a single Kubernetes event costs one
/// service's work, and the address book keeps addresses stable across changes.
#[derive(Clone, Debug)]
pub struct MeshState {
    addresses: AddressBook,
    services: ServiceMap,
    /// Instance path (`/data/db/db-1`) → its service, so no service can take an instance's
    /// name and no instance a service's.
    /// Persistent, as the address book is, so that copying the state is cheap.
    instance_of: imbl::HashMap<MeshPath, MeshPath>,
    rejected_routes: Arc<[RejectedRoute]>,
    refused_paths: Arc<[RefusedPath]>,
    totals: Totals,
    version: u64,
    shape_version: u64,
    /// Something changed since the last snapshot.
    changed: bool,
    /// The shape changed since the last snapshot.
    reshaped: bool,
}

impl MeshState {
    pub fn new(trap: TrapCidrs) -> Self {
        MeshState::with_address_book(AddressBook::new(trap))
    }

    /// An empty state whose addresses start from `book` (one restored from the node's record).
    pub fn with_address_book(book: AddressBook) -> Self {
        MeshState {
            addresses: book,
            services: ServiceMap::new(),
            instance_of: imbl::HashMap::new(),
            rejected_routes: Arc::from([]),
            refused_paths: Arc::from([]),
            totals: Totals::default(),
            version: 0,
            shape_version: 0,
            changed: true,
            reshaped: true,
        }
    }

    /// Whether the mesh holds `spec` already, such that [`MeshState::upsert`] of it would
    /// change nothing and return `Ok(false)`. Read-only, so a merge can ask it for 50k paths
    /// on every core and upsert only what changed: upserting every unchanged service compared
    /// its ports and endpoints again on the merge's one serial thread, in the busiest second of
    /// a restart. Conservative: a service with instances (whose addresses upsert assigns) is
    /// never held.
    pub fn holds(&self, spec: &ServiceSpec) -> bool {
        let Some(existing) = self.services.get(&spec.path) else {
            return false;
        };
        let same_address = match existing.address {
            ServiceAddress::Shared(_) => !spec.needs_own_address(),
            ServiceAddress::Own(_) => spec.needs_own_address(),
            ServiceAddress::Instances => false,
        };
        same_address
            && spec.instances.is_empty()
            && existing.instances.is_empty()
            && !self.instance_of.contains_key(&spec.path)
            && existing.described_by(spec)
    }

    /// Adds or replaces one service. Returns false (and changes nothing) when it is identical
    /// to what is already there. On error nothing changes either.
    pub fn upsert(&mut self, spec: ServiceSpec) -> Result<bool, AddressError> {
        if let Some(service) = self.instance_of.get(&spec.path) {
            return Err(AddressError::NameTaken {
                path: spec.path.clone(),
                service: service.clone(),
            });
        }
        let instance_paths = spec
            .instances
            .iter()
            .map(|instance| {
                let path = spec.path.child(&instance.name).map_err(|source| {
                    AddressError::InstanceName {
                        service: spec.path.clone(),
                        instance: instance.name.clone(),
                        source,
                    }
                })?;
                if self.services.contains_key(&path) {
                    return Err(AddressError::NameTaken {
                        path,
                        service: spec.path.clone(),
                    });
                }
                Ok(path)
            })
            .collect::<Result<Vec<MeshPath>, AddressError>>()?;
        let existing = self.services.get(&spec.path).cloned();
        let instances = self.assign_instances(&spec, instance_paths)?;
        let address = if spec.instances.is_empty() {
            self.addresses
                .assign(&spec.path, spec.needs_own_address())?
        } else {
            self.addresses.release(&spec.path);
            ServiceAddress::Instances
        };
        // Instances the service no longer has free their names and addresses.
        if let Some(existing) = &existing {
            for gone in existing
                .instances
                .iter()
                .filter(|old| !instances.iter().any(|new| new.name == old.name))
            {
                self.addresses.release(&gone.path);
                self.instance_of.remove(&gone.path);
            }
        }
        for instance in &instances {
            self.instance_of
                .insert(instance.path.clone(), spec.path.clone());
        }
        if let Some(existing) = &existing
            && existing.address == address
            && existing.described_by(&spec)
            && existing.instances == instances
        {
            return Ok(false);
        }
        let service = Service {
            dns_name: spec.path.dns_name(),
            path: spec.path.clone(),
            address,
            ports: spec.ports,
            routes: spec.routes,
            instances,
            health: spec.health,
            traffic_distribution: spec.traffic_distribution,
            host_header: spec.host_header,
            clients: spec.clients,
            identities: spec.identities,
            authorization: spec.authorization,
            unready: spec.unready,
        };
        if let Some(existing) = &existing {
            self.totals.subtract(existing);
        }
        self.reshaped |= existing.is_none_or(|existing| !existing.same_shape(&service));
        self.totals.add(&service);
        self.services.insert(spec.path, Arc::new(service));
        self.changed = true;
        Ok(true)
    }

    /// Each instance of `spec` with its address: kept if it had one, else a new one. All or
    /// nothing: on exhaustion the addresses this call took are given back.
    fn assign_instances(
        &mut self,
        spec: &ServiceSpec,
        paths: Vec<MeshPath>,
    ) -> Result<Vec<Instance>, AddressError> {
        let mut taken = Vec::new();
        let mut instances = Vec::with_capacity(paths.len());
        for (instance, path) in spec.instances.iter().zip(paths) {
            let fresh = !self.instance_of.contains_key(&path);
            let address = match self.addresses.assign_own(&path) {
                Ok(address) => address,
                Err(err) => {
                    for path in &taken {
                        self.addresses.release(path);
                    }
                    return Err(err);
                }
            };
            instances.push(Instance {
                name: instance.name.clone(),
                dns_name: path.dns_name(),
                path: path.clone(),
                address,
                ready: instance.ready,
                dns: Instance::dns_note(instance.ready),
                endpoints: instance.endpoints.clone(),
            });
            if fresh {
                taken.push(path);
            }
        }
        Ok(instances)
    }

    /// Who holds which address: what the node's record is written from.
    pub fn address_book(&self) -> &AddressBook {
        &self.addresses
    }

    /// Whether it holds no service.
    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
    }

    /// Every service's path, in order.
    pub fn paths(&self) -> impl Iterator<Item = &MeshPath> {
        self.services.keys()
    }

    /// The service at `path`, as last upserted.
    pub fn service(&self, path: &MeshPath) -> Option<&Arc<Service>> {
        self.services.get(path)
    }

    /// Removes one service, freeing its address and its instances'. Returns whether it existed.
    pub fn remove(&mut self, path: &MeshPath) -> bool {
        self.addresses.release(path);
        let Some(service) = self.services.remove(path) else {
            return false;
        };
        self.totals.subtract(&service);
        for instance in &service.instances {
            self.addresses.release(&instance.path);
            self.instance_of.remove(&instance.path);
        }
        self.changed = true;
        self.reshaped = true;
        true
    }

    /// Makes the mesh exactly `specs` (the file source's whole-world view), touching only the
    /// services that differ. All-or-nothing: if any address cannot be assigned, nothing changes.
    pub fn replace_all(&mut self, specs: Vec<ServiceSpec>) -> Result<(), AddressError> {
        let keep: std::collections::HashSet<&MeshPath> = specs.iter().map(|s| &s.path).collect();
        let gone: Vec<MeshPath> = self
            .services
            .keys()
            .filter(|path| !keep.contains(path))
            .cloned()
            .collect();
        drop(keep);
        self.apply(&gone, specs)
    }

    /// Removes the services at `removed`, then upserts `upserted` (a mesh-file edit, read by
    /// what changed). All-or-nothing, as [`Self::replace_all`]; the copy this takes is cheap
    /// (persistent maps), so the cost is that of the services named.
    pub fn apply(
        &mut self,
        removed: &[MeshPath],
        upserted: Vec<ServiceSpec>,
    ) -> Result<(), AddressError> {
        let mut next = self.clone();
        // Release first, so a service that left frees its address for one that arrives.
        for path in removed {
            next.remove(path);
        }
        for spec in upserted {
            next.upsert(spec)?;
        }
        *self = next;
        Ok(())
    }

    /// Sets what the source refused of the routes it read (sorted, so equal sets compare equal).
    pub fn set_rejected_routes(&mut self, mut rejected: Vec<RejectedRoute>) {
        rejected.sort();
        if *self.rejected_routes != *rejected {
            self.rejected_routes = rejected.into();
            self.changed = true;
        }
    }

    /// Sets the services the source left out for the paths they claim (sorted, as above).
    pub fn set_refused_paths(&mut self, mut refused: Vec<RefusedPath>) {
        refused.sort();
        if *self.refused_paths != *refused {
            self.refused_paths = refused.into();
            self.changed = true;
        }
    }

    /// A snapshot of the current state, with a new version if anything changed since the last.
    pub fn snapshot(&mut self) -> Arc<MeshSnapshot> {
        if self.changed {
            self.version += 1;
            self.changed = false;
        }
        if self.reshaped {
            self.shape_version += 1;
            self.reshaped = false;
        }
        Arc::new(MeshSnapshot {
            version: self.version,
            shape_version: self.shape_version,
            provisional: false,
            trap: self.addresses.trap().clone(),
            services: self.services.clone(),
            rejected_routes: self.rejected_routes.clone(),
            refused_paths: self.refused_paths.clone(),
            taken_at: Instant::now(),
            totals: self.totals,
        })
    }
}

pub type MeshTx = watch::Sender<Option<Arc<MeshSnapshot>>>;
pub type MeshRx = watch::Receiver<Option<Arc<MeshSnapshot>>>;

/// The one channel from the sources to every consumer (the translators and the admin server).
/// Only complete, consistent snapshots are published on it; `None` means "nothing synced yet",
/// which keeps `/readyz` false.
pub fn channel() -> (MeshTx, MeshRx) {
    watch::channel(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(path: &str, protocol: Protocol) -> ServiceSpec {
        ServiceSpec::new(
            path.parse().unwrap(),
            vec![ServicePort {
                name: None,
                port: 8080,
                protocol,
                endpoints: EndpointSet::parsed(&["10.0.0.1:8080"]),
                hosts: HostEndpoints::default(),
            }],
        )
    }

    fn trap() -> TrapCidrs {
        "240.240.0.0/16".parse().unwrap()
    }

    #[test]
    fn host_names_are_lowercased_and_checked() {
        let name: HostName = "DB.Example.COM.".parse().unwrap();
        assert_eq!(name.as_str(), "db.example.com");
        assert_eq!("db".parse::<HostName>().unwrap().as_str(), "db");
        for (bad, reason) in [
            ("", "empty"),
            ("10.0.0.1", "an IP address"),
            ("::1", "an IP address"),
            ("a..b", "a label is empty"),
            ("-a.example.com", "starts or ends with '-'"),
            ("a_b.example.com", "a character"),
            ("example.123", "all digits"),
        ] {
            let err = bad.parse::<HostName>().unwrap_err();
            assert!(err.to_string().contains(reason), "{bad}: {err}");
        }
        assert!(
            format!("{}.com", "a".repeat(250))
                .parse::<HostName>()
                .is_err()
        );
        assert!(
            format!("{}.com", "a".repeat(64))
                .parse::<HostName>()
                .is_err()
        );
    }

    #[test]
    fn http_services_share_the_first_host_address() {
        let mut state = MeshState::new(trap());
        state.upsert(spec("/a/b", Protocol::Http)).unwrap();
        state.upsert(spec("/a/c", Protocol::Grpc)).unwrap();
        let snap = state.snapshot();
        let shared = ServiceAddress::Shared("240.240.0.1".parse().unwrap());
        assert!(snap.services.values().all(|s| s.address == shared));
    }

    #[test]
    fn tcp_services_get_distinct_own_addresses_stable_under_churn() {
        let mut state = MeshState::new(trap());
        for i in 0..50 {
            state
                .upsert(spec(&format!("/t/s{i}"), Protocol::Tcp))
                .unwrap();
        }
        let before = state.snapshot();
        let mut seen = std::collections::HashSet::new();
        for service in before.services.values() {
            let ServiceAddress::Own(ip) = service.address else {
                panic!("{} should have its own address", service.path)
            };
            assert_ne!(
                ip,
                Ipv4Addr::new(240, 240, 0, 1),
                "own address must not be the shared one"
            );
            assert!(seen.insert(ip), "address {ip} assigned twice");
        }
        // Churn: remove every other service, add new ones; survivors keep their addresses and
        // newcomers never collide with survivors.
        for i in (0..50).step_by(2) {
            assert!(state.remove(&format!("/t/s{i}").parse().unwrap()));
        }
        for i in 50..120 {
            state
                .upsert(spec(&format!("/t/s{i}"), Protocol::Tcp))
                .unwrap();
        }
        let after = state.snapshot();
        for (path, service) in &before.services {
            if let Some(now) = after.services.get(path) {
                assert_eq!(now.address, service.address, "{path} changed address");
            }
        }
        let mut ips: Vec<_> = after.services.values().map(|s| s.address.ip()).collect();
        ips.sort();
        ips.dedup();
        assert_eq!(ips.len(), after.services.len());
    }

    #[test]
    fn replace_all_changes_only_what_differs_and_is_atomic() {
        let mut state = MeshState::new("240.240.0.0/30".parse().unwrap());
        state
            .replace_all(vec![
                spec("/a/http", Protocol::Http),
                spec("/a/tcp", Protocol::Tcp),
            ])
            .unwrap();
        let first = state.snapshot();
        // An identical world publishes no new version and keeps the same Arcs.
        state
            .replace_all(vec![
                spec("/a/http", Protocol::Http),
                spec("/a/tcp", Protocol::Tcp),
            ])
            .unwrap();
        let second = state.snapshot();
        assert_eq!(first.version, second.version);
        assert!(Arc::ptr_eq(
            &first.services[&"/a/http".parse::<MeshPath>().unwrap()],
            &second.services[&"/a/http".parse::<MeshPath>().unwrap()]
        ));
        // /30 has two hosts: .1 is shared, .2 the only own address. A second TCP service
        // cannot fit, and the failed replace leaves the state untouched.
        let err = state
            .replace_all(vec![
                spec("/a/tcp", Protocol::Tcp),
                spec("/a/tcp2", Protocol::Tcp),
            ])
            .unwrap_err();
        assert!(err.to_string().contains("/a/tcp2"), "{err}");
        let third = state.snapshot();
        assert_eq!(third.version, second.version);
        assert!(
            third
                .services
                .contains_key(&"/a/http".parse::<MeshPath>().unwrap())
        );
    }

    /// The counts a snapshot carries are those of its services, however they changed.
    #[test]
    fn totals_follow_upserts_and_removals() {
        let recount = |mesh: &MeshSnapshot| {
            let endpoints = mesh
                .services
                .values()
                .flat_map(|s| &s.ports)
                .map(|p| p.endpoints.len() + p.hosts.len())
                .sum::<usize>();
            let rules = mesh
                .services
                .values()
                .map(|s| s.routes.len())
                .sum::<usize>();
            (endpoints, rules)
        };
        let counts = |mesh: &MeshSnapshot| (mesh.endpoint_count(), mesh.route_rule_count());
        let mut state = MeshState::new(trap());
        state.upsert(spec("/a/web", Protocol::Http)).unwrap();
        let mut two = spec("/a/two", Protocol::Http);
        two.ports[0].endpoints = EndpointSet::parsed(&["10.0.0.2:8080", "10.0.0.3:8080"]);
        state.upsert(two.clone()).unwrap();
        let both = state.snapshot();
        assert_eq!(counts(&both), recount(&both));
        assert_eq!(both.endpoint_count(), 3);
        two.ports[0].endpoints = EndpointSet::parsed(&["10.0.0.4:8080"]);
        state.upsert(two).unwrap();
        state.remove(&"/a/web".parse().unwrap());
        let after = state.snapshot();
        assert_eq!(counts(&after), recount(&after));
        assert_eq!(after.endpoint_count(), 1);
        // A failed change leaves the counts as they were.
        let mut full = MeshState::new("240.240.0.0/30".parse().unwrap());
        full.upsert(spec("/a/tcp", Protocol::Tcp)).unwrap();
        assert!(
            full.replace_all(vec![
                spec("/a/tcp2", Protocol::Tcp),
                spec("/a/tcp3", Protocol::Tcp)
            ])
            .is_err()
        );
        let kept = full.snapshot();
        assert_eq!(counts(&kept), recount(&kept));
    }

    #[test]
    fn a_spec_is_held_only_when_upserting_it_would_change_nothing() {
        let mut state = MeshState::new(trap());
        let web = spec("/a/web", Protocol::Http);
        let tcp = spec("/a/tcp", Protocol::Tcp);
        let db = stateful("/a/db", &[("db-0", "10.0.0.10", true)]);
        for s in [&web, &tcp, &db] {
            state.upsert(s.clone()).unwrap();
        }
        let mut moved = web.clone();
        moved.ports[0].endpoints = EndpointSet::parsed(&["10.0.0.2:8080"]);
        let mut unready = tcp.clone();
        unready.unready = vec![(8080, "10.0.0.9:8080".parse().unwrap())];
        let candidates = [
            (web.clone(), true),
            (tcp.clone(), true),
            // Instances: upsert assigns their addresses, so never held.
            (db.clone(), false),
            (moved, false),
            (unready, false),
            // Another address kind.
            (spec("/a/web", Protocol::Tcp), false),
            (spec("/a/tcp", Protocol::Http), false),
            (spec("/a/new", Protocol::Http), false),
        ];
        for (candidate, held) in candidates {
            assert_eq!(state.holds(&candidate), held, "{candidate:?}");
            if held {
                // And upserting it changes nothing, as holds() promises.
                let before = state.snapshot();
                assert!(matches!(state.upsert(candidate.clone()), Ok(false)));
                let after = state.snapshot();
                assert_eq!(after.version, before.version, "{candidate:?}");
            }
        }
    }

    #[test]
    fn shape_version_moves_with_names_addresses_and_ports_not_endpoints() {
        let mut state = MeshState::new(trap());
        state.upsert(spec("/a/web", Protocol::Http)).unwrap();
        let first = state.snapshot();

        let mut moved = spec("/a/web", Protocol::Http);
        moved.ports[0].endpoints = EndpointSet::parsed(&["10.0.0.2:8080"]);
        state.upsert(moved).unwrap();
        let endpoints = state.snapshot();
        assert_eq!(endpoints.version, first.version + 1);
        assert_eq!(
            endpoints.shape_version, first.shape_version,
            "endpoints only"
        );

        state.upsert(spec("/a/web", Protocol::Tcp)).unwrap();
        let protocol = state.snapshot();
        assert_eq!(protocol.shape_version, endpoints.shape_version + 1);
        state.upsert(spec("/a/other", Protocol::Http)).unwrap();
        let added = state.snapshot();
        assert_eq!(added.shape_version, protocol.shape_version + 1);
        state.remove(&"/a/other".parse().unwrap());
        let removed = state.snapshot();
        assert_eq!(removed.shape_version, added.shape_version + 1);
        assert_eq!(
            state.snapshot().shape_version,
            removed.shape_version,
            "nothing changed"
        );
    }

    fn stateful(path: &str, instances: &[(&str, &str, bool)]) -> ServiceSpec {
        spec(path, Protocol::Tcp).with_instances(
            instances
                .iter()
                .map(|(name, ip, ready)| InstanceSpec {
                    name: name.to_string(),
                    ready: *ready,
                    endpoints: vec![(8080, format!("{ip}:8080").parse().unwrap())],
                })
                .collect(),
        )
    }

    fn instance_addresses(snap: &MeshSnapshot, path: &str) -> Vec<(String, Ipv4Addr)> {
        snap.services[&path.parse::<MeshPath>().unwrap()]
            .instances
            .iter()
            .map(|i| (i.name.clone(), i.address))
            .collect()
    }

    #[test]
    fn instances_get_names_and_addresses_of_their_own_that_outlive_their_pod_ips() {
        let mut state = MeshState::new(trap());
        let three = [
            ("db-0", "10.0.0.10", true),
            ("db-1", "10.0.0.11", true),
            ("db-2", "10.0.0.12", false),
        ];
        state.upsert(stateful("/data/db", &three)).unwrap();
        let first = state.snapshot();
        let db = &first.services[&"/data/db".parse::<MeshPath>().unwrap()];
        assert_eq!(db.address, ServiceAddress::Instances);
        assert_eq!(db.instances[1].dns_name, "db-1.db.data.system.internal");
        let before = instance_addresses(&first, "/data/db");
        let mut ips: Vec<_> = before.iter().map(|(_, ip)| *ip).collect();
        ips.sort();
        ips.dedup();
        assert_eq!(ips.len(), 3, "distinct addresses: {before:?}");

        // db-1 moves to a new pod IP: same address, and only its endpoints changed.
        let moved = [three[0], ("db-1", "10.0.9.99", true), three[2]];
        state.upsert(stateful("/data/db", &moved)).unwrap();
        let after = state.snapshot();
        assert_eq!(instance_addresses(&after, "/data/db"), before);
        assert_eq!(after.shape_version, first.shape_version, "endpoints only");
        let db = &after.services[&"/data/db".parse::<MeshPath>().unwrap()];
        assert_eq!(
            db.instances[1].endpoint(8080),
            Some("10.0.9.99:8080".parse().unwrap())
        );

        // Readiness is shape: it changes the service name's answer.
        let ready = [
            three[0],
            ("db-1", "10.0.9.99", true),
            ("db-2", "10.0.0.12", true),
        ];
        state.upsert(stateful("/data/db", &ready)).unwrap();
        assert_eq!(state.snapshot().shape_version, first.shape_version + 1);
    }

    #[test]
    fn a_vanished_instance_frees_its_address_only_once_gone_and_gets_it_back_on_return() {
        let mut state = MeshState::new(trap());
        let both = [("db-0", "10.0.0.10", true), ("db-1", "10.0.0.11", true)];
        state.upsert(stateful("/data/db", &both)).unwrap();
        let db1 = instance_addresses(&state.snapshot(), "/data/db")[1].1;

        // db-1's pod is deleted: its address is free, but a newcomer gets a fresh one.
        state.upsert(stateful("/data/db", &both[..1])).unwrap();
        state.upsert(spec("/data/other", Protocol::Tcp)).unwrap();
        let snap = state.snapshot();
        let other = snap.services[&"/data/other".parse::<MeshPath>().unwrap()].address;
        assert_ne!(other.ip(), Some(db1));
        // Recreated under the same name (a StatefulSet pod): the same address again.
        state.upsert(stateful("/data/db", &both)).unwrap();
        assert_eq!(instance_addresses(&state.snapshot(), "/data/db")[1].1, db1);

        // Removing the service frees every instance address.
        assert!(state.remove(&"/data/db".parse().unwrap()));
        let snapshot = state.snapshot();
        let instances: usize = snapshot.services.values().map(|s| s.instances.len()).sum();
        assert_eq!(instances, 0);
    }

    #[test]
    fn a_service_and_an_instance_cannot_share_a_name() {
        let mut state = MeshState::new(trap());
        state
            .upsert(stateful("/data/db", &[("db-0", "10.0.0.10", true)]))
            .unwrap();
        let err = state
            .upsert(spec("/data/db/db-0", Protocol::Tcp))
            .unwrap_err();
        assert!(
            matches!(&err, AddressError::NameTaken { service, .. } if service.as_str() == "/data/db"),
            "{err}"
        );
        state.upsert(spec("/data/db/db-9", Protocol::Tcp)).unwrap();
        let err = state
            .upsert(stateful("/data/db", &[("db-9", "10.0.0.19", true)]))
            .unwrap_err();
        assert!(err.to_string().contains("/data/db/db-9"), "{err}");
        // The refused change left the service as it was.
        assert_eq!(
            instance_addresses(&state.snapshot(), "/data/db").len(),
            1,
            "db-0 only"
        );
    }

    #[test]
    fn removed_address_is_reused_only_after_release() {
        let mut state = MeshState::new("240.240.0.0/29".parse().unwrap());
        state.upsert(spec("/x/one", Protocol::Tcp)).unwrap();
        let one = state.snapshot().services[&"/x/one".parse::<MeshPath>().unwrap()].address;
        state.remove(&"/x/one".parse().unwrap());
        state.upsert(spec("/x/two", Protocol::Tcp)).unwrap();
        let two = state.snapshot().services[&"/x/two".parse::<MeshPath>().unwrap()].address;
        // Round-robin allocation avoids handing a just-freed address to a new service, so
        // clients holding a stale DNS answer do not reach the wrong service.
        assert_ne!(one, two);
    }
}
