//! Pure mapping from Kubernetes objects to the compact entries the index keeps: only the few
//! fields the mesh needs per endpoint (its IPv4 address, and its zone, node and hints, shared
//! where they repeat).

use std::net::Ipv4Addr;
use std::sync::Arc;

use k8s_openapi::jiff::Timestamp;

use super::KubeSourceError;
use super::objects::{
    EndpointFields, HOST_HEADER_ANNOTATION, PATH_ANNOTATION, SERVICE_NAME_LABEL, ServiceObject,
    SliceObject,
};
use crate::mesh::{
    HealthPolicy, Hints, HostHeader, HostName, MeshPath, Protocol, TrafficDistribution,
};
use crate::source::health::{HEALTH_ANNOTATION, from_annotation};

/// A namespaced object's identity.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    pub namespace: String,
    pub name: String,
}

impl ObjectKey {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        ObjectKey {
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// The API server always sets both on the objects it serves.
    pub(super) fn of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Self {
        ObjectKey::new(
            meta.namespace.clone().unwrap_or_default(),
            meta.name.clone().unwrap_or_default(),
        )
    }
}

impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One TCP port of a Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortEntry {
    /// The port name, which EndpointSlices use to say which target port serves it.
    pub name: Option<Box<str>>,
    pub port: u16,
    pub protocol: Protocol,
}

/// What the index keeps of a Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceEntry {
    pub path: MeshPath,
    /// Decides which of two Services claiming one path gets it: the oldest, as Gateway API
    /// resolves conflicts, so every node's agent picks the same one whatever order it saw them.
    pub created: Option<Timestamp>,
    pub ports: Box<[PortEntry]>,
    /// `clusterIP: None`: endpoints with a `hostname` (StatefulSet pods) are named instances.
    pub headless: bool,
    /// From the `lattice.mlab.com/health` annotation, else the defaults.
    pub health: HealthPolicy,
    /// `spec.trafficDistribution`; a value the mesh does not know is no preference.
    pub traffic_distribution: TrafficDistribution,
    /// An ExternalName Service's `spec.externalName`: every port's one endpoint, resolved by
    /// Envoy. Its EndpointSlices, if anyone made some, are ignored.
    pub external: Option<HostName>,
    /// From the `lattice.mlab.com/host-header` annotation; matters for ExternalName only.
    pub host_header: HostHeader,
}

/// What the index keeps of an IPv4 EndpointSlice: its Service, its ports by name, and the
/// addresses of its endpoints that serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceEntry {
    pub service: String,
    pub ports: Box<[(Option<Box<str>>, u16)]>,
    /// Sorted by address, one per address.
    pub endpoints: Box<[SliceEndpoint]>,
    /// Endpoints with a `hostname` that are not terminating, ready or not: the instances of a
    /// headless Service. Empty for the slices of most Services.
    pub named: Box<[NamedEndpoint]>,
    /// The addresses of its endpoints that are not ready or are terminating, sorted: sent no
    /// traffic, but their pods still take it dialled directly, so a Service's authorization
    /// rules cover them too. Empty for most slices most of the time.
    pub unready: Box<[Ipv4Addr]>,
}

/// An endpoint that serves, and where it runs (`zone`, `nodeName`, `hints`) where the slice
/// says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceEndpoint {
    pub ip: Ipv4Addr,
    pub zone: Option<Arc<str>>,
    pub node: Option<Arc<str>>,
    pub hints: Option<Arc<Hints>>,
    /// The pod behind it (its `targetRef`), as [`pod_ref`]: joined with the meshed pods to
    /// know whether it takes mesh mTLS, and as whom.
    pub pod: Option<u64>,
}

/// A pod as slices and the meshed pods' watch name it: a hash of `namespace/name`, eight bytes
/// per endpoint instead of the name (500k endpoints at 50k services). Two pods of one hash
/// would make a client expect the other's identity: a failed call, never a wrong peer.
pub fn pod_ref(namespace: &str, name: &str) -> u64 {
    // FNV-1a: stable, and cheap for a few dozen bytes.
    let bytes = namespace.bytes().chain([b'/']).chain(name.bytes());
    bytes.fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// An endpoint with a `hostname`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamedEndpoint {
    pub hostname: Box<str>,
    pub ip: Ipv4Addr,
    pub ready: bool,
    /// See [`SliceEndpoint::pod`].
    pub pod: Option<u64>,
}

impl SliceEntry {
    /// The endpoints' port number for the Service port named `name`.
    pub fn port_for(&self, name: Option<&str>) -> Option<u16> {
        self.ports
            .iter()
            .find(|(n, _)| n.as_deref() == name)
            .map(|(_, port)| *port)
    }
}

/// Why an EndpointSlice contributes nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SliceSkip {
    /// Not IPv4: the trapped mesh is IPv4, and mixing families would hand Envoy addresses
    /// of a family the service's clients never asked for.
    AddressType(String),
    /// No `kubernetes.io/service-name` label: not managed for a Service.
    NoService,
}

/// A Service's mesh port protocol: `appProtocol`, else the name's prefix before the first `-`
/// (`http`, `http2`, `grpc`, `tcp`), else TCP. An `appProtocol` the mesh does not know (say
/// `kubernetes.io/wss` or `mysql`) is opaque bytes to it: TCP.
pub fn port_protocol(app_protocol: Option<&str>, name: Option<&str>) -> Protocol {
    if let Some(app) = app_protocol.filter(|a| !a.is_empty()) {
        return app.parse().unwrap_or(Protocol::Tcp);
    }
    match name.and_then(|n| n.split('-').next()) {
        Some("http") => Protocol::Http,
        Some("http2") => Protocol::Http2,
        Some("grpc") => Protocol::Grpc,
        _ => Protocol::Tcp,
    }
}

fn non_empty(name: &Option<String>) -> Option<Box<str>> {
    name.as_deref().filter(|n| !n.is_empty()).map(Box::from)
}

fn is_tcp(protocol: &Option<String>) -> bool {
    protocol.as_deref().is_none_or(|p| p == "TCP")
}

/// A mapped Service: `Ok(None)` for one the mesh skips on purpose, `Err` for one it cannot map.
pub type MappedService = Result<Option<ServiceEntry>, KubeSourceError>;
/// A mapped EndpointSlice, or why it contributes nothing.
pub type MappedSlice = Result<SliceEntry, SliceSkip>;

/// Maps a Service. An ExternalName Service is a service whose every port is served by its
/// external name, which Envoy resolves; one without TCP ports is skipped (`Ok(None)`).
pub fn service_entry(service: &ServiceObject) -> (ObjectKey, MappedService) {
    let key = ObjectKey::of(&service.metadata);
    let mapped = map_service(&key, service);
    (key, mapped)
}

fn map_service(key: &ObjectKey, service: &ServiceObject) -> MappedService {
    let spec = service.spec.as_ref();
    let external = if spec.and_then(|s| s.type_.as_deref()) == Some("ExternalName") {
        let name = spec.and_then(|s| s.external_name.as_deref()).unwrap_or("");
        Some(
            name.parse::<HostName>()
                .map_err(|source| KubeSourceError::InvalidExternalName {
                    service: key.to_string(),
                    source,
                })?,
        )
    } else {
        None
    };
    let annotations = service.metadata.annotations.as_ref();
    let host_header = match annotations.and_then(|a| a.get(HOST_HEADER_ANNOTATION)) {
        None => HostHeader::default(),
        Some(value) => value
            .parse()
            .map_err(|source| KubeSourceError::InvalidHostHeader {
                service: key.to_string(),
                source,
            })?,
    };
    let annotation = annotations.and_then(|a| a.get(PATH_ANNOTATION));
    let health = match annotations.and_then(|a| a.get(HEALTH_ANNOTATION)) {
        None => HealthPolicy::default(),
        Some(value) => {
            from_annotation(value).map_err(|message| KubeSourceError::InvalidHealth {
                service: key.to_string(),
                message,
            })?
        }
    };
    let path = match annotation {
        Some(value) => value
            .parse()
            .map_err(|source| KubeSourceError::InvalidPath {
                service: key.to_string(),
                value: value.clone(),
                source,
            })?,
        // Namespaces and Service names are DNS labels, so this is a valid path; if the API
        // server ever let through something else, the error names the Service.
        None => format!("/{}/{}", key.namespace, key.name)
            .parse()
            .map_err(|source| KubeSourceError::InvalidPath {
                service: key.to_string(),
                value: format!("/{}/{}", key.namespace, key.name),
                source,
            })?,
    };
    // UDP and SCTP ports are outside the mesh: Envoy's capture listener is TCP.
    let ports = spec
        .and_then(|s| s.ports.as_ref())
        .into_iter()
        .flatten()
        .filter(|p| is_tcp(&p.protocol))
        .filter_map(|p| {
            Some(PortEntry {
                name: non_empty(&p.name),
                port: u16::try_from(p.port).ok().filter(|port| *port != 0)?,
                protocol: port_protocol(p.app_protocol.as_deref(), p.name.as_deref()),
            })
        })
        .collect::<Box<[PortEntry]>>();
    // An ExternalName Service without ports is a DNS alias only: nothing to route.
    if external.is_some() && ports.is_empty() {
        return Ok(None);
    }
    // The API server accepts only the values it knows (and PreferClose, the older name of
    // PreferSameZone); one added later is read as no preference, which never strands traffic.
    let traffic_distribution = spec
        .and_then(|s| s.traffic_distribution.as_deref())
        .and_then(|d| d.parse().ok())
        .unwrap_or_default();
    let entry = ServiceEntry {
        path,
        created: service.metadata.creation_timestamp.as_ref().map(|t| t.0),
        ports,
        headless: external.is_none() && spec.and_then(|s| s.cluster_ip.as_deref()) == Some("None"),
        health,
        traffic_distribution,
        external,
        host_header,
    };
    Ok(Some(entry))
}

/// Maps an EndpointSlice: the endpoints that are ready (unset counts as ready, as the API
/// documents) and not terminating.
pub fn slice_entry(slice: &SliceObject) -> (ObjectKey, MappedSlice) {
    (ObjectKey::of(&slice.metadata), map_slice(slice))
}

fn map_slice(slice: &SliceObject) -> MappedSlice {
    let address_type = slice.address_type.as_deref().unwrap_or_default();
    if address_type != "IPv4" {
        return Err(SliceSkip::AddressType(address_type.to_owned()));
    }
    let Some(service) = slice
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_NAME_LABEL))
    else {
        return Err(SliceSkip::NoService);
    };
    let ports = slice
        .ports
        .iter()
        .flatten()
        .filter(|p| is_tcp(&p.protocol))
        .filter_map(|p| {
            Some((
                non_empty(&p.name),
                u16::try_from(p.port?).ok().filter(|port| *port != 0)?,
            ))
        })
        .collect();
    let all = || slice.endpoints.iter().flatten();
    let ready = |e: &&EndpointFields| e.conditions.as_ref().and_then(|c| c.ready) != Some(false);
    let terminating =
        |e: &&EndpointFields| e.conditions.as_ref().and_then(|c| c.terminating) == Some(true);
    // Zone and node names repeat across a slice's endpoints: each is allocated once per slice.
    let mut names: Vec<Arc<str>> = Vec::new();
    let mut intern = |name: &str| -> Arc<str> {
        match names.iter().find(|n| &***n == name) {
            Some(held) => held.clone(),
            None => {
                let fresh: Arc<str> = Arc::from(name);
                names.push(fresh.clone());
                fresh
            }
        }
    };
    let namespace = slice.metadata.namespace.as_deref().unwrap_or_default();
    let pod = |e: &EndpointFields| e.pod_name().map(|name| pod_ref(namespace, name));
    let mut endpoints: Vec<SliceEndpoint> = Vec::new();
    for endpoint in all().filter(|e| ready(e) && !terminating(e)) {
        let zone = endpoint
            .zone
            .as_deref()
            .filter(|z| !z.is_empty())
            .map(&mut intern);
        let node = endpoint
            .node_name
            .as_deref()
            .filter(|n| !n.is_empty())
            .map(&mut intern);
        let hints = endpoint.hints.as_ref().and_then(|h| {
            let hints = Hints {
                for_zones: h
                    .for_zones
                    .iter()
                    .flatten()
                    .map(|z| intern(&z.name))
                    .collect(),
                for_nodes: h
                    .for_nodes
                    .iter()
                    .flatten()
                    .map(|n| intern(&n.name))
                    .collect(),
            };
            (!hints.is_empty()).then(|| Arc::new(hints))
        });
        for ip in endpoint.addresses() {
            endpoints.push(SliceEndpoint {
                ip,
                zone: zone.clone(),
                node: node.clone(),
                hints: hints.clone(),
                pod: pod(endpoint),
            });
        }
    }
    // Stable: of two entries for one address, the first in the slice is kept.
    endpoints.sort_by_key(|e| e.ip);
    endpoints.dedup_by_key(|e| e.ip);
    let mut unready: Vec<Ipv4Addr> = all()
        .filter(|e| !ready(e) || terminating(e))
        .flat_map(EndpointFields::addresses)
        .filter(|ip| endpoints.binary_search_by_key(ip, |e| e.ip).is_err())
        .collect();
    unready.sort_unstable();
    unready.dedup();
    // A terminating pod is on its way out; its successor (same hostname) takes over the name.
    let named = all()
        .filter(|e| !terminating(e))
        .filter_map(|e| {
            Some(NamedEndpoint {
                hostname: non_empty(&e.hostname)?,
                ip: e.first_address()?,
                ready: ready(&e),
                pod: pod(e),
            })
        })
        .collect();
    Ok(SliceEntry {
        service: service.clone(),
        ports,
        endpoints: endpoints.into(),
        unready: unready.into(),
        named,
    })
}
