//! A synthetic ADS client that behaves like Envoy on the wire: it subscribes to all clusters
//! and listeners (wildcard), then to the endpoints of every cluster it holds, ACKs what it can
//! decode and NACKs what it cannot. Benchmarks run many of them against one agent; tests use
//! one to look at what is sent.
//!
//! The protocol rules it keeps, as Envoy does:
//! - SotW: clusters and listeners come whole, endpoints by change (an assignment a response
//!   does not name stays as it was); every request of a type carries the last version it accepted and the nonce of the
//!   last response it received of that type; a NACK carries the previous good version and an
//!   `error_detail`; an EDS request always names the whole current subscription, so the ACK of
//!   a response that crossed a subscription change carries the change.
//! - Delta: an ACK or NACK names the response's nonce; subscription changes are separate,
//!   incremental requests; a removed cluster's endpoints are unsubscribed.
//! - Reconnecting ([`AdsClient::reconnect`]), it says what it holds, as Envoy does after losing
//!   its control plane: SotW requests carry the last accepted version of each type (and EDS the
//!   clusters it holds), Delta requests the version of every resource it holds
//!   (`initial_resource_versions`) and subscribe again to the endpoints of its clusters.
//!   Both write these requests from parts encoded straight from the view (a whole-mesh client
//!   at 50k services names 100k versions), not through the generated types' maps and vectors
//!   of strings.
//!
//! [`Options`] make it more like a pod's Envoy behind an agent that checks identity: `bind`
//! gives its connection the pod's source address (any of 127.0.0.0/8 works on loopback without
//! setup), and `routes` makes it subscribe to the route configurations its listeners name
//! (RDS), as Envoy does; off by default, so a client that holds the whole mesh is not sent
//! every virtual host.
//!
//! The clients of one process share the decoding of clusters and assignments: identical bytes
//! decode identically, so each distinct resource is decoded once (see [`Shared`]). A benchmark
//! runs a hundred clients on the agent's two cores, and before, the clients' decoding of the
//! same 10k assignments a hundred times was most of the benchmark's own CPU during an initial
//! sync (25–27 CPU seconds against the agent's 5), so the sync figure measured the clients.
//! Responses are read into types of this module that leave each resource a slice of the
//! received bytes ([`RawAny`]), and what the memo keeps (names, endpoints) is shared by `Arc`
//! with every view that holds it: 30 % less of the benchmark's CPU in a 10k-service sync
//! (2.6–2.7 → 1.8–1.9 s), which the agent and Envoy share two cores with.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes};
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::{Node, address, socket_address};
use envoy_types::pb::envoy::config::endpoint::v3::{ClusterLoadAssignment, lb_endpoint};
use envoy_types::pb::envoy::config::listener::v3::{Listener, filter};
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, http_connection_manager,
};
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use prost::encoding::{DecodeContext, WireType, skip_field};
use prost::{DecodeError, Message};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::envoy::AdsMode;

pub const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
pub const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
pub const RDS: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
const HCM: &str = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";

/// A SotW response of 10k clusters is several MB; tonic's default cap is 4 MB.
const MAX_MESSAGE: usize = 256 << 20;

/// What a client holds, and what it took to get it.
///
/// Names are `Arc<str>`, shared by every client of the process that holds the same resource
/// (see [`Shared`]): a hundred clients holding 10k clusters and their endpoints made two
/// million `String`s in an initial sync otherwise.
#[derive(Clone, Debug, Default)]
pub struct ClientView {
    pub clusters: BTreeSet<Arc<str>>,
    /// Cluster → endpoint addresses (sorted), with when they last changed.
    pub endpoints: Assignments,
    pub listeners: BTreeSet<String>,
    /// With [`Options::routes`]: route configuration → its number of virtual hosts, with when
    /// it last changed.
    pub routes: BTreeMap<String, (usize, Instant)>,
    pub responses: u64,
    /// Encoded (protobuf) size of every response received, gRPC framing left out.
    pub bytes: u64,
    /// The same, per type URL.
    pub bytes_by_type: BTreeMap<String, u64>,
    pub acks: u64,
    pub nacks: u64,
    pub last_response: Option<Instant>,
    /// The types answered on the current stream, with when they first were.
    pub answered: BTreeMap<String, Instant>,
    /// SotW: the last version accepted per type.
    sotw_versions: HashMap<String, String>,
    /// SotW: the endpoint subscription as last sent, encoded. A reconnecting client sends it
    /// again as it is, as Envoy re-sends the request it keeps per type.
    sotw_endpoint_names: Option<Bytes>,
    /// Delta: per type, the version of every resource held.
    delta_versions: HashMap<String, Versions>,
    /// With [`Options::routes`]: the route configurations each listener names, and their
    /// union, the RDS subscription.
    listener_routes: BTreeMap<String, BTreeSet<String>>,
    route_names: BTreeSet<String>,
}

/// The assignments a client holds: cluster → endpoint addresses (sorted), with when they last
/// changed; read as the map, changed through its methods, which count the assignments of each
/// size as they go. Whether a client holds every assignment whole is then known without a
/// walk over them: the benchmark's checks walked 50k assignments per client per response
/// after an agent restart, a tenth of a core on the two the agent reconnects on (perf).
#[derive(Clone, Debug, Default)]
pub struct Assignments {
    map: BTreeMap<Arc<str>, (Arc<[SocketAddr]>, Instant)>,
    /// Endpoint count → how many assignments have it.
    sizes: HashMap<usize, usize>,
}

impl std::ops::Deref for Assignments {
    type Target = BTreeMap<Arc<str>, (Arc<[SocketAddr]>, Instant)>;

    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl Assignments {
    /// How many assignments hold exactly `endpoints` endpoints.
    pub fn of_size(&self, endpoints: usize) -> usize {
        self.sizes.get(&endpoints).copied().unwrap_or(0)
    }

    fn count(&mut self, size: usize, up: bool) {
        let count = self.sizes.entry(size).or_default();
        if up {
            *count += 1;
        } else {
            *count -= 1;
        }
    }

    fn insert(&mut self, cluster: Arc<str>, endpoints: Arc<[SocketAddr]>, at: Instant) {
        self.count(endpoints.len(), true);
        if let Some((old, _)) = self.map.insert(cluster, (endpoints, at)) {
            self.count(old.len(), false);
        }
    }

    fn remove(&mut self, cluster: &str) {
        if let Some((old, _)) = self.map.remove(cluster) {
            self.count(old.len(), false);
        }
    }

    fn retain(&mut self, mut keep: impl FnMut(&Arc<str>) -> bool) {
        let sizes = &mut self.sizes;
        self.map.retain(|name, (endpoints, _)| {
            let kept = keep(name);
            if !kept && let Some(count) = sizes.get_mut(&endpoints.len()) {
                *count -= 1;
            }
            kept
        });
    }
}

/// A Delta client's versions of the resources of one type it holds, by name, in name order,
/// with their encoded length as `initial_resource_versions`, kept as they change.
///
/// A reconnect writes every entry (100k at 50k services): walked in a hash map's order, each
/// entry's name and version were reads of memory far from the last, and the writing was two
/// fifths of the benchmark's own CPU in an agent restart (perf). In name order the names are
/// read in about the order they were allocated (a response's resources come sorted), and the
/// versions are in the entries themselves. The length is kept because the request is sized
/// before it is written: summed at the reconnect, it was a walk over every entry more, a
/// seventh of the benchmark's CPU in the restart (perf).
#[derive(Clone, Debug, Default)]
struct Versions {
    held: BTreeMap<Arc<str>, HeldVersion>,
    encoded_len: usize,
}

impl Versions {
    fn insert(&mut self, name: Arc<str>, version: HeldVersion) {
        let name_len = name.len();
        self.encoded_len += version_field_len(name_len, version.as_bytes().len());
        if let Some(old) = self.held.insert(name, version) {
            self.encoded_len -= version_field_len(name_len, old.as_bytes().len());
        }
    }

    fn remove(&mut self, name: &str) {
        if let Some(old) = self.held.remove(name) {
            self.encoded_len -= version_field_len(name.len(), old.as_bytes().len());
        }
    }

    fn iter(&self) -> impl Iterator<Item = (&Arc<str>, &HeldVersion)> {
        self.held.iter()
    }
}

impl Extend<(Arc<str>, HeldVersion)> for Versions {
    fn extend<I: IntoIterator<Item = (Arc<str>, HeldVersion)>>(&mut self, entries: I) {
        for (name, version) in entries {
            self.insert(name, version);
        }
    }
}

impl FromIterator<(Arc<str>, HeldVersion)> for Versions {
    fn from_iter<I: IntoIterator<Item = (Arc<str>, HeldVersion)>>(entries: I) -> Self {
        let mut versions = Versions::default();
        versions.extend(entries);
        versions
    }
}

/// A resource's version as a client holds it: in place when it is 16 bytes or fewer (the
/// agent's are 16 hex digits), else on the heap.
#[derive(Clone, Debug, PartialEq, Eq)]
enum HeldVersion {
    Inline { len: u8, bytes: [u8; 16] },
    Heap(Box<str>),
}

impl HeldVersion {
    /// The version's bytes, which a reconnect writes (UTF-8: made from a `String`).
    fn as_bytes(&self) -> &[u8] {
        match self {
            HeldVersion::Inline { len, bytes } => &bytes[..usize::from(*len)],
            HeldVersion::Heap(version) => version.as_bytes(),
        }
    }
}

impl From<String> for HeldVersion {
    fn from(version: String) -> Self {
        match u8::try_from(version.len()) {
            Ok(len) if len <= 16 => {
                let mut bytes = [0; 16];
                bytes[..version.len()].copy_from_slice(version.as_bytes());
                HeldVersion::Inline { len, bytes }
            }
            _ => HeldVersion::Heap(version.into_boxed_str()),
        }
    }
}

impl ClientView {
    /// The endpoints of a cluster, if the client holds any for it.
    pub fn endpoints_of(&self, cluster: &str) -> Option<&[SocketAddr]> {
        self.endpoints.get(cluster).map(|(e, _)| &e[..])
    }
}

/// How a client connects and what it subscribes to, beyond clusters, endpoints and listeners.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// The source address of its connection (the agent sees it as the peer's IP).
    pub bind: Option<IpAddr>,
    /// Subscribe to the route configurations its listeners name, as Envoy does.
    pub routes: bool,
}

pub struct AdsClient {
    view: Arc<Mutex<ClientView>>,
    /// Bumped by the current stream's task at each change of the view, and closed when the
    /// task ends: a waiter wakes for either.
    changed: watch::Receiver<u64>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
    xds: SocketAddr,
    node: Node,
    mode: AdsMode,
    options: Options,
}

impl AdsClient {
    pub async fn connect(
        xds: SocketAddr,
        node_id: &str,
        mode: AdsMode,
    ) -> anyhow::Result<AdsClient> {
        AdsClient::connect_with(xds, node_id, mode, Options::default()).await
    }

    /// Like [`AdsClient::connect`], with [`Options`].
    pub async fn connect_with(
        xds: SocketAddr,
        node_id: &str,
        mode: AdsMode,
        options: Options,
    ) -> anyhow::Result<AdsClient> {
        let view = Arc::new(Mutex::new(ClientView::default()));
        let node = Node {
            id: node_id.to_string(),
            cluster: "lattice".to_string(),
            ..Node::default()
        };
        let (task, changed) = open(xds, &node, mode, options, &view).await?;
        Ok(AdsClient {
            view,
            changed,
            task,
            xds,
            node,
            mode,
            options,
        })
    }

    pub fn mode(&self) -> AdsMode {
        self.mode
    }

    /// Whether the current stream has ended (the agent closed or refused it); see
    /// [`AdsClient::reconnect`].
    pub fn stream_ended(&self) -> bool {
        self.task.is_finished()
    }

    /// Ends the current stream, if it still runs, and opens a new one that says what the
    /// client holds (see the top). [`ClientView::answered`] starts again; nothing else in the
    /// view does. On error (nothing listens yet) the client is left disconnected: call again.
    pub async fn reconnect(&mut self) -> anyhow::Result<()> {
        self.task.abort();
        lock(&self.view).answered.clear();
        (self.task, self.changed) =
            open(self.xds, &self.node, self.mode, self.options, &self.view).await?;
        Ok(())
    }

    /// A copy of the whole view (large at scale; [`AdsClient::with_view`] reads in place).
    pub fn view(&self) -> ClientView {
        self.with_view(ClientView::clone)
    }

    pub fn with_view<T>(&self, read: impl FnOnce(&ClientView) -> T) -> T {
        read(&self.view.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Waits until `check` holds for the client's view; fails if the stream ends first.
    pub async fn wait_for(
        &mut self,
        what: &str,
        timeout: Duration,
        check: impl Fn(&ClientView) -> bool,
    ) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            // Marks the current value seen before checking, so a change after the check wakes us.
            self.changed.borrow_and_update();
            if self.with_view(&check) {
                return Ok(());
            }
            if self.task.is_finished() {
                return Err(self.stopped(what).await);
            }
            match tokio::time::timeout_at(deadline, self.changed.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(self.stopped(what).await),
                Err(_) => anyhow::bail!("timed out after {timeout:?} waiting for {what}"),
            }
        }
    }

    async fn stopped(&mut self, what: &str) -> anyhow::Error {
        let why = match (&mut self.task).await {
            Ok(Ok(())) => "the agent closed the stream".to_string(),
            Ok(Err(e)) => format!("{e:#}"),
            Err(e) => e.to_string(),
        };
        anyhow::anyhow!("ADS client stopped while waiting for {what}: {why}")
    }
}

impl Drop for AdsClient {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Connects to `xds` and runs a stream of `mode` on it: its task, and what it bumps at each
/// change of the view. The task holds the only sender, so a stream that ends (turned away,
/// say) wakes whoever waits on it, rather than leaving them to their deadline.
async fn open(
    xds: SocketAddr,
    node: &Node,
    mode: AdsMode,
    options: Options,
    view: &Arc<Mutex<ClientView>>,
) -> anyhow::Result<(
    tokio::task::JoinHandle<anyhow::Result<()>>,
    watch::Receiver<u64>,
)> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{xds}"))?
        .local_address(options.bind)
        .connect()
        .await?;
    let (bump, changed) = watch::channel(0u64);
    let (node, view) = (node.clone(), view.clone());
    let routes = options.routes;
    let task = match mode {
        AdsMode::Sotw => tokio::spawn(run_sotw(channel, node, routes, view, bump)),
        AdsMode::Delta => tokio::spawn(run_delta(channel, node, routes, view, bump)),
    };
    Ok((task, changed))
}

/// The route configurations a listener's HTTP connection managers name (RDS).
fn route_names(listener: &Listener) -> BTreeSet<String> {
    listener
        .filter_chains
        .iter()
        .chain(&listener.default_filter_chain)
        .flat_map(|chain| &chain.filters)
        .filter_map(|f| match &f.config_type {
            Some(filter::ConfigType::TypedConfig(any)) if any.type_url == HCM => {
                HttpConnectionManager::decode(any.value.as_slice()).ok()
            }
            _ => None,
        })
        .filter_map(|manager| match manager.route_specifier {
            Some(http_connection_manager::RouteSpecifier::Rds(rds)) => Some(rds.route_config_name),
            _ => None,
        })
        .collect()
}

/// Makes the RDS subscription the union of what the listeners name; the (subscribed,
/// unsubscribed) names when it changed. Routes no longer named are dropped.
fn follow_listeners(v: &mut ClientView) -> (Vec<String>, Vec<String>) {
    let wanted: BTreeSet<String> = v.listener_routes.values().flatten().cloned().collect();
    let subscribe: Vec<String> = wanted.difference(&v.route_names).cloned().collect();
    let unsubscribe: Vec<String> = v.route_names.difference(&wanted).cloned().collect();
    for name in &unsubscribe {
        v.routes.remove(name);
        if let Some(versions) = v.delta_versions.get_mut(RDS) {
            versions.remove(name.as_str());
        }
    }
    v.route_names = wanted;
    (subscribe, unsubscribe)
}

/// Route configurations received (each one a change: they come by change), with the number
/// of virtual hosts of each.
fn apply_routes(v: &mut ClientView, routes: Vec<(String, usize)>, now: Instant) {
    for (name, hosts) in routes {
        v.routes.insert(name, (hosts, now));
    }
}

/// An assignment's endpoint addresses, sorted.
pub(crate) fn endpoints_of(assignment: &ClusterLoadAssignment) -> Vec<SocketAddr> {
    let mut out: Vec<SocketAddr> = assignment
        .endpoints
        .iter()
        .flat_map(|locality| &locality.lb_endpoints)
        .filter_map(|lb| match &lb.host_identifier {
            Some(lb_endpoint::HostIdentifier::Endpoint(endpoint)) => endpoint.address.as_ref(),
            _ => None,
        })
        .filter_map(|addr| match &addr.address {
            Some(address::Address::SocketAddress(sa)) => {
                let port = match sa.port_specifier {
                    Some(socket_address::PortSpecifier::PortValue(p)) => u16::try_from(p).ok()?,
                    _ => return None,
                };
                Some(SocketAddr::new(sa.address.parse().ok()?, port))
            }
            _ => None,
        })
        .collect();
    out.sort();
    out
}

/// A resource's `Any` as the response carried it: its type URL and its bytes, both slices of
/// the buffer the response was decoded from (no copy, no allocation per resource).
#[derive(Clone, PartialEq, prost::Message)]
struct RawAny {
    #[prost(bytes = "bytes", tag = "1")]
    type_url: Bytes,
    #[prost(bytes = "bytes", tag = "2")]
    value: Bytes,
}

/// A SotW `DiscoveryResponse` with its resources left as they came: the generated type copies
/// every resource into an `Any` of its own (a `String` and a `Vec` each), which was the largest
/// part of the benchmark clients' decoding in an initial sync (perf).
#[derive(Clone, PartialEq, prost::Message)]
struct SotwResponse {
    #[prost(string, tag = "1")]
    version_info: String,
    #[prost(message, repeated, tag = "2")]
    resources: Vec<RawAny>,
    #[prost(string, tag = "4")]
    type_url: String,
    #[prost(string, tag = "5")]
    nonce: String,
}

/// A Delta `Resource`, its `Any` left as it came. Its other fields (aliases, TTL, cache
/// control, metadata) are skipped: the agent sends none.
#[derive(Clone, PartialEq, prost::Message)]
struct DeltaResource {
    #[prost(string, tag = "1")]
    version: String,
    #[prost(message, optional, tag = "2")]
    resource: Option<RawAny>,
    #[prost(string, tag = "3")]
    name: String,
}

/// A `DeltaDiscoveryResponse` of [`DeltaResource`]s.
#[derive(Clone, PartialEq, prost::Message)]
struct DeltaResponse {
    #[prost(string, tag = "1")]
    system_version_info: String,
    #[prost(message, repeated, tag = "2")]
    resources: Vec<DeltaResource>,
    #[prost(string, tag = "4")]
    type_url: String,
    #[prost(string, tag = "5")]
    nonce: String,
    #[prost(string, repeated, tag = "6")]
    removed_resources: Vec<String>,
}

/// What clients keep of a decoded resource, for each distinct encoding of it: a memo shared by
/// every client of the process. Bounded: emptied when it reaches [`Shared::LIMIT`] entries.
/// What it keeps is shared too (`Arc`s): a hit costs the lookup and two reference counts.
struct Shared<T> {
    /// Keyed by whole resources (hundreds of bytes each, a million lookups in a 10k-service
    /// sync of 100 clients): foldhash, as std's SipHash over those bytes was a tenth of the
    /// benchmark's own CPU in that sync (perf).
    decoded: Mutex<HashMap<Vec<u8>, Result<T, String>, foldhash::fast::RandomState>>,
}

impl<T: Clone> Shared<T> {
    const LIMIT: usize = 200_000;

    fn new() -> Self {
        Shared {
            decoded: Mutex::new(HashMap::default()),
        }
    }

    /// `read` applied to `any` decoded as an `M`, from the memo when these bytes were decoded
    /// before (by any client).
    fn get<M: Message + Default>(
        &self,
        any: &RawAny,
        type_url: &str,
        read: impl FnOnce(M) -> T,
    ) -> Result<T, String> {
        if any.type_url != type_url.as_bytes() {
            return decode::<M>(any, type_url).map(read);
        }
        if let Some(known) = lock(&self.decoded).get(any.value.as_ref()) {
            return known.clone();
        }
        let decoded = decode::<M>(any, type_url).map(read);
        let mut memo = lock(&self.decoded);
        if memo.len() >= Self::LIMIT {
            memo.clear();
        }
        memo.insert(any.value.to_vec(), decoded.clone());
        decoded
    }
}

/// A cluster's name.
fn cluster_name(any: &RawAny) -> Result<Arc<str>, String> {
    static SHARED: LazyLock<Shared<Arc<str>>> = LazyLock::new(Shared::new);
    SHARED.get(any, CDS, |cluster: Cluster| Arc::from(cluster.name))
}

/// An assignment as clients keep it: its cluster's name and its endpoints.
type Assignment = (Arc<str>, Arc<[SocketAddr]>);

/// An assignment's cluster name and endpoints.
fn assignment(any: &RawAny) -> Result<Assignment, String> {
    static SHARED: LazyLock<Shared<Assignment>> = LazyLock::new(Shared::new);
    SHARED.get(any, EDS, |cla: ClusterLoadAssignment| {
        let endpoints = endpoints_of(&cla);
        (Arc::from(cla.cluster_name), Arc::from(endpoints))
    })
}

/// A resource of the response's type, decoded; an error (for the NACK) otherwise.
fn decode<M: Message + Default>(any: &RawAny, type_url: &str) -> Result<M, String> {
    if any.type_url != type_url.as_bytes() {
        return Err(format!(
            "resource of type {} in a {type_url} response",
            String::from_utf8_lossy(&any.type_url)
        ));
    }
    M::decode(any.value.clone()).map_err(|e| format!("cannot decode a {type_url}: {e}"))
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Records a response of `encoded_len` bytes in the view and applies it; `Err` is the NACK's
/// message.
fn receive<T>(
    view: &Mutex<ClientView>,
    type_url: &str,
    encoded_len: usize,
    apply: impl FnOnce(&mut ClientView, Instant) -> Result<T, String>,
) -> Result<T, String> {
    let now = Instant::now();
    let mut v = lock(view);
    if !v.answered.contains_key(type_url) {
        v.answered.insert(type_url.to_string(), now);
    }
    v.responses += 1;
    v.bytes += encoded_len as u64;
    *v.bytes_by_type.entry(type_url.to_string()).or_default() += encoded_len as u64;
    v.last_response = Some(now);
    let outcome = apply(&mut v, now);
    match outcome {
        Ok(_) => v.acks += 1,
        Err(_) => v.nacks += 1,
    }
    outcome
}

/// The `error_detail` of a NACK.
fn rejection(message: String) -> RpcStatus {
    RpcStatus {
        code: tonic::Code::InvalidArgument as i32,
        message,
        ..RpcStatus::default()
    }
}

/// Per type on a SotW stream: the last version accepted and the last nonce received.
#[derive(Default)]
struct SotwType {
    version: String,
    nonce: String,
}

/// The subscriptions a SotW response changed: the whole new EDS and RDS name lists.
#[derive(Default)]
struct SotwSubscriptions {
    eds: Option<Vec<Arc<str>>>,
    rds: Option<Vec<String>>,
}

/// Applies a SotW response to the view; `Err` is the NACK's message. Returns the
/// subscriptions that changed.
fn apply_sotw(
    v: &mut ClientView,
    response: &SotwResponse,
    routes: bool,
    now: Instant,
) -> Result<SotwSubscriptions, String> {
    let mut out = SotwSubscriptions::default();
    match response.type_url.as_str() {
        CDS => {
            let clusters = response
                .resources
                .iter()
                .map(cluster_name)
                .collect::<Result<BTreeSet<Arc<str>>, String>>()?;
            if clusters == v.clusters {
                return Ok(out);
            }
            v.endpoints.retain(|name| clusters.contains(name));
            v.clusters = clusters;
            out.eds = Some(v.clusters.iter().cloned().collect());
            Ok(out)
        }
        EDS => {
            // Endpoints come by change: a response updates the assignments it holds and
            // leaves the others as they are, as Envoy does.
            let assignments = response
                .resources
                .iter()
                .map(assignment)
                .collect::<Result<Vec<_>, String>>()?;
            for (cluster, endpoints) in assignments {
                if v.endpoints_of(&cluster) != Some(&endpoints[..]) {
                    v.endpoints.insert(cluster, endpoints, now);
                }
            }
            Ok(out)
        }
        LDS => {
            let listeners = response
                .resources
                .iter()
                .map(|any| decode::<Listener>(any, LDS))
                .collect::<Result<Vec<_>, _>>()?;
            v.listeners = listeners.iter().map(|l| l.name.clone()).collect();
            if routes {
                v.listener_routes = listeners
                    .iter()
                    .map(|l| (l.name.clone(), route_names(l)))
                    .collect();
                let (subscribe, unsubscribe) = follow_listeners(v);
                if !subscribe.is_empty() || !unsubscribe.is_empty() {
                    out.rds = Some(v.route_names.iter().cloned().collect());
                }
            }
            Ok(out)
        }
        // Route configurations come by change, as endpoints do.
        RDS if routes => {
            let configs = response
                .resources
                .iter()
                .map(|any| decode::<RouteConfiguration>(any, RDS))
                .collect::<Result<Vec<_>, String>>()?;
            let configs = configs
                .into_iter()
                .map(|c| (c.name, c.virtual_hosts.len()))
                .collect();
            apply_routes(v, configs, now);
            Ok(out)
        }
        other => Err(format!("not subscribed to {other}")),
    }
}

/// The ADS method a SotW stream calls.
const SOTW_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";

/// A SotW `DiscoveryRequest` sent as parts already encoded: its own fields (`head`: version,
/// type, nonce, error), then the node and the resource names, shared between requests.
/// Protobuf fields may come in any order, so the three concatenated are the request.
#[derive(Clone, Debug, Default)]
struct EncodedRequest {
    head: Vec<u8>,
    node: Bytes,
    names: Bytes,
    /// A reconnecting Delta client's subscription and versions of one type, written from its
    /// view as the request is sent.
    held: Option<Held>,
}

/// What a reconnecting Delta client holds of one type (its subscription, and the version of
/// each resource held), written from its view straight into the request's buffer when the
/// request is sent ([`RequestCodec`]). Encoded into a buffer of their own first, then copied
/// into tonic's, the Delta clients' reconnects at 50k services wrote twice the 450 MB they
/// are, into fresh pages, on the two cores the agent restarts on (perf: the copy alone was a
/// sixth of the benchmark's own CPU in the restart). The view is read when the request is
/// written: until then it may still take the stream's first responses, as Envoy's would.
#[derive(Clone, Debug)]
struct Held {
    view: Arc<Mutex<ClientView>>,
    type_url: &'static str,
}

impl Held {
    /// Calls `f` with each name of the subscription written from `v`: the clusters for
    /// endpoints, the route configurations the listeners name for routes, none for the
    /// wildcard types.
    fn each_name(&self, v: &ClientView, mut f: impl FnMut(&str)) {
        match self.type_url {
            EDS => v.clusters.iter().for_each(|c| f(c)),
            RDS => v.route_names.iter().for_each(|r| f(r)),
            _ => {}
        }
    }

    /// The encoded length of what [`Held::put`] writes from `v`.
    fn encoded_len(&self, v: &ClientView) -> usize {
        let mut len = 0;
        self.each_name(v, |name| len += name_field_len(name));
        len + v
            .delta_versions
            .get(self.type_url)
            .map_or(0, |versions| versions.encoded_len)
    }

    /// Writes what a reconnecting client sends of its type beyond the request's own fields:
    /// its subscription (`resource_names_subscribe`, field 3, written as SotW's
    /// `resource_names`) and the version of each resource it holds
    /// (`initial_resource_versions`, a map, field 5). Each entry is written whole into a small
    /// buffer first, then into `buf` at once: tonic's buffer takes bytes through calls that
    /// each check its room, which byte by byte (keys and lengths) cost more than the copy.
    fn put(&self, v: &ClientView, buf: &mut impl BufMut) {
        let mut entry = Vec::with_capacity(256);
        self.each_name(v, |name| {
            entry.clear();
            put_names(&[name], &mut entry);
            buf.put_slice(&entry);
        });
        let Some(versions) = v.delta_versions.get(self.type_url) else {
            return;
        };
        for (name, version) in versions.iter() {
            let (name, version) = (name.as_bytes(), version.as_bytes());
            entry.clear();
            prost::encoding::encode_key(5, WireType::LengthDelimited, &mut entry);
            prost::encoding::encode_varint(
                version_entry_len(name.len(), version.len()) as u64,
                &mut entry,
            );
            for (tag, s) in [(1, name), (2, version)] {
                prost::encoding::encode_key(tag, WireType::LengthDelimited, &mut entry);
                prost::encoding::encode_varint(s.len() as u64, &mut entry);
                entry.extend_from_slice(s);
            }
            buf.put_slice(&entry);
        }
    }
}

impl EncodedRequest {
    /// Writes the request into `buf`, its length given first to `reserve` (room made at once):
    /// reads the view once for both.
    fn write<B: BufMut>(&self, buf: &mut B, reserve: fn(&mut B, usize)) {
        let view = self.held.as_ref().map(|held| (held, lock(&held.view)));
        let held_len = view.as_ref().map_or(0, |(held, v)| held.encoded_len(v));
        reserve(buf, self.own_len() + held_len);
        buf.put_slice(&self.head);
        buf.put_slice(&self.node);
        buf.put_slice(&self.names);
        if let Some((held, v)) = &view {
            held.put(v, buf);
        }
    }

    /// The length of the parts encoded ahead.
    fn own_len(&self) -> usize {
        self.head.len() + self.node.len() + self.names.len()
    }
}

impl Message for EncodedRequest {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        self.write(buf, |_, _| {});
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        // Only ever encoded.
        skip_field(wire_type, tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        let held = self
            .held
            .as_ref()
            .map_or(0, |held| held.encoded_len(&lock(&held.view)));
        self.own_len() + held
    }

    fn clear(&mut self) {
        *self = EncodedRequest::default();
    }
}

/// A `DiscoveryRequest`'s `node` (field 2), encoded.
fn node_field(node: &Node) -> Vec<u8> {
    DiscoveryRequest {
        node: Some(node.clone()),
        ..DiscoveryRequest::default()
    }
    .encode_to_vec()
}

/// A `DiscoveryRequest`'s `resource_names` (field 3), encoded.
fn names_field<S: AsRef<str>>(names: &[S]) -> Bytes {
    let mut buf = Vec::with_capacity(names_len(names));
    put_names(names, &mut buf);
    Bytes::from(buf)
}

/// The encoded length of [`names_field`].
fn names_len<S: AsRef<str>>(names: &[S]) -> usize {
    names.iter().map(|name| name_field_len(name.as_ref())).sum()
}

/// The encoded length of one name of `resource_names` (or Delta's
/// `resource_names_subscribe`): a length-delimited field of a one-byte key.
fn name_field_len(name: &str) -> usize {
    1 + prost::encoding::encoded_len_varint(name.len() as u64) + name.len()
}

fn put_names<S: AsRef<str>>(names: &[S], buf: &mut impl BufMut) {
    for name in names {
        let name = name.as_ref();
        prost::encoding::encode_key(3, WireType::LengthDelimited, buf);
        prost::encoding::encode_varint(name.len() as u64, buf);
        buf.put_slice(name.as_bytes());
    }
}

/// Opens the ADS method at `path` on `channel`: the requests `rx` yields, the responses read as
/// `R` (this module's types, which leave each resource as it came).
async fn ads_stream<R>(
    channel: tonic::transport::Channel,
    path: &'static str,
    rx: mpsc::UnboundedReceiver<EncodedRequest>,
) -> anyhow::Result<tonic::Streaming<R>>
where
    R: Message + Default + Send + 'static,
{
    let mut grpc = tonic::client::Grpc::new(channel).max_decoding_message_size(MAX_MESSAGE);
    grpc.ready().await?;
    let stream = grpc
        .streaming(
            tonic::Request::new(UnboundedReceiverStream::new(rx)),
            http::uri::PathAndQuery::from_static(path),
            RequestCodec::<R>::default(),
        )
        .await?;
    Ok(stream.into_inner())
}

async fn run_sotw(
    channel: tonic::transport::Channel,
    node: Node,
    routes: bool,
    view: Arc<Mutex<ClientView>>,
    bump: watch::Sender<u64>,
) -> anyhow::Result<()> {
    let (tx, rx) = mpsc::unbounded_channel();
    // What it holds from an earlier stream (nothing on the first): the versions it accepted,
    // and the clusters whose endpoints (and the route configurations) it wants.
    let held_routes: Vec<String> = lock(&view).route_names.iter().cloned().collect();
    let (mut types, kept, held) = {
        let v = lock(&view);
        let types = v
            .sotw_versions
            .iter()
            .map(|(type_url, version)| {
                let state = SotwType {
                    version: version.clone(),
                    nonce: String::new(),
                };
                (type_url.clone(), state)
            })
            .collect::<HashMap<String, SotwType>>();
        let kept = v.sotw_endpoint_names.clone();
        // The clusters, to encode, only when the client kept no subscription (none sent yet).
        let held: Vec<Arc<str>> = match kept {
            Some(_) => Vec::new(),
            None => v.clusters.iter().cloned().collect(),
        };
        (types, kept, held)
    };
    // Every request of the stream is written from parts encoded ahead: the node once, and each
    // subscription once when it changes. An endpoint ACK repeats the whole EDS subscription
    // (10k names at 10k services); built name by name, that was a fifth of the benchmark's
    // own CPU in the change phase (perf), on the two cores it shares with the agent.
    let node = Bytes::from(node_field(&node));
    let request = |state: &SotwType, type_url: &str, names: &Bytes| EncodedRequest {
        head: DiscoveryRequest {
            type_url: type_url.to_string(),
            version_info: state.version.clone(),
            response_nonce: state.nonce.clone(),
            ..DiscoveryRequest::default()
        }
        .encode_to_vec(),
        node: node.clone(),
        names: names.clone(),
        held: None,
    };
    for type_url in [CDS, LDS] {
        tx.send(request(
            types.entry(type_url.to_string()).or_default(),
            type_url,
            &Bytes::new(),
        ))?;
    }
    // The current EDS subscription, encoded; `None` until the first CDS response.
    let mut eds_names: Option<Bytes> = None;
    let names = kept.unwrap_or_else(|| names_field(&held));
    if !names.is_empty() {
        tx.send(request(
            types.entry(EDS.to_string()).or_default(),
            EDS,
            &names,
        ))?;
        eds_names = Some(names);
    }
    let mut rds_names: Option<Bytes> = None;
    if routes && !held_routes.is_empty() {
        let names = names_field(&held_routes);
        tx.send(request(
            types.entry(RDS.to_string()).or_default(),
            RDS,
            &names,
        ))?;
        rds_names = Some(names);
    }
    let mut stream = ads_stream::<SotwResponse>(channel, SOTW_PATH, rx).await?;
    while let Some(response) = stream.message().await? {
        let outcome = receive(
            &view,
            &response.type_url,
            response.encoded_len(),
            |v, now| {
                let outcome = apply_sotw(v, &response, routes, now);
                if outcome.is_ok() {
                    v.sotw_versions
                        .insert(response.type_url.clone(), response.version_info.clone());
                }
                outcome
            },
        );
        let state = types.entry(response.type_url.clone()).or_default();
        state.nonce = response.nonce.clone();
        let names = match response.type_url.as_str() {
            EDS => eds_names.clone().unwrap_or_default(),
            RDS => rds_names.clone().unwrap_or_default(),
            _ => Bytes::new(),
        };
        // An ACK carries the response's version, a NACK the last one accepted.
        if outcome.is_ok() {
            state.version = response.version_info.clone();
        }
        let mut ack = request(state, &response.type_url, &names);
        let subscribe = match outcome {
            Ok(subscribe) => subscribe,
            Err(message) => {
                // The NACK's status, a field of its own after those already encoded.
                let nack = DiscoveryRequest {
                    error_detail: Some(rejection(message)),
                    ..DiscoveryRequest::default()
                };
                nack.encode(&mut ack.head)?;
                SotwSubscriptions::default()
            }
        };
        tx.send(ack)?;
        if let Some(names) = subscribe.eds {
            let names = names_field(&names);
            let state = types.entry(EDS.to_string()).or_default();
            tx.send(request(state, EDS, &names))?;
            lock(&view).sotw_endpoint_names = Some(names.clone());
            eds_names = Some(names);
        }
        if let Some(names) = subscribe.rds {
            let names = names_field(&names);
            let state = types.entry(RDS.to_string()).or_default();
            tx.send(request(state, RDS, &names))?;
            rds_names = Some(names);
        }
        bump.send_modify(|n| *n += 1);
    }
    Ok(())
}

/// The subscription changes a Delta response made: (type URL, subscribe, unsubscribe).
type DeltaSubscriptions = Vec<(&'static str, Vec<String>, Vec<String>)>;

/// Applies a Delta response to the view; `Err` is the NACK's message. Returns the endpoint
/// (and route) subscription changes.
fn apply_delta(
    v: &mut ClientView,
    response: DeltaResponse,
    routes: bool,
    now: Instant,
) -> Result<DeltaSubscriptions, String> {
    let (mut subscribe, mut unsubscribe) = (Vec::new(), Vec::new());
    let mut more: DeltaSubscriptions = Vec::new();
    // Decode everything first: a NACKed response changes nothing. What was received: each
    // resource's name (the decoded resource's own, shared, where the two agree) and version.
    let mut received: Vec<(Arc<str>, HeldVersion)> = Vec::with_capacity(response.resources.len());
    match response.type_url.as_str() {
        CDS => {
            for r in response.resources {
                let Some(any) = &r.resource else { continue };
                let cluster = cluster_name(any)?;
                if *cluster != *r.name {
                    return Err(format!("resource {} holds cluster {cluster}", r.name));
                }
                received.push((cluster, r.version.into()));
            }
            for (name, _) in &received {
                if v.clusters.insert(name.clone()) {
                    subscribe.push(name.to_string());
                }
            }
            for name in &response.removed_resources {
                if v.clusters.remove(name.as_str()) {
                    v.endpoints.remove(name.as_str());
                    unsubscribe.push(name.clone());
                }
            }
        }
        EDS => {
            let mut assignments = Vec::with_capacity(response.resources.len());
            for r in response.resources {
                let Some(any) = &r.resource else { continue };
                let (cluster, endpoints) = assignment(any)?;
                let name = if *cluster == *r.name {
                    cluster
                } else {
                    Arc::from(r.name)
                };
                assignments.push((name.clone(), endpoints));
                received.push((name, r.version.into()));
            }
            for (name, endpoints) in assignments {
                if v.endpoints_of(&name) != Some(&endpoints[..]) {
                    v.endpoints.insert(name, endpoints, now);
                }
            }
            for name in &response.removed_resources {
                v.endpoints.remove(name.as_str());
            }
        }
        LDS => {
            let mut listeners = Vec::new();
            for r in response.resources {
                let Some(any) = &r.resource else { continue };
                listeners.push(decode::<Listener>(any, LDS)?);
                received.push((Arc::from(r.name), r.version.into()));
            }
            for (name, _) in &received {
                v.listeners.insert(name.to_string());
            }
            for name in &response.removed_resources {
                v.listeners.remove(name);
                v.listener_routes.remove(name);
            }
            if routes {
                for listener in &listeners {
                    v.listener_routes
                        .insert(listener.name.clone(), route_names(listener));
                }
                let (subscribe, unsubscribe) = follow_listeners(v);
                if !subscribe.is_empty() || !unsubscribe.is_empty() {
                    more.push((RDS, subscribe, unsubscribe));
                }
            }
        }
        RDS if routes => {
            let mut configs = Vec::new();
            for r in response.resources {
                let Some(any) = &r.resource else { continue };
                let config: RouteConfiguration = decode(any, RDS)?;
                configs.push((r.name.clone(), config.virtual_hosts.len()));
                received.push((Arc::from(r.name), r.version.into()));
            }
            apply_routes(v, configs, now);
            for name in &response.removed_resources {
                v.routes.remove(name);
            }
        }
        other => return Err(format!("not subscribed to {other}")),
    }
    let versions = v.delta_versions.entry(response.type_url).or_default();
    versions.extend(received);
    for name in &response.removed_resources {
        versions.remove(name.as_str());
    }
    if let Some(endpoints) = v.delta_versions.get_mut(EDS) {
        for name in &unsubscribe {
            endpoints.remove(name.as_str());
        }
    }
    if !subscribe.is_empty() || !unsubscribe.is_empty() {
        more.insert(0, (EDS, subscribe, unsubscribe));
    }
    Ok(more)
}

/// The ADS method a Delta stream calls.
const DELTA_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";

/// A map entry of `initial_resource_versions`, of a name and a version `name` and `version`
/// bytes long: a message of the key (field 1) and the value (field 2), each length-delimited.
fn version_entry_len(name: usize, version: usize) -> usize {
    [name, version]
        .iter()
        .map(|&len| 1 + prost::encoding::encoded_len_varint(len as u64) + len)
        .sum()
}

/// The encoded length of one entry of `initial_resource_versions` as a field (5) of the
/// request.
fn version_field_len(name: usize, version: usize) -> usize {
    let len = version_entry_len(name, version);
    1 + prost::encoding::encoded_len_varint(len as u64) + len
}

/// A Delta request: `head` encoded, followed by what the client holds of its type when
/// `held` (protobuf fields may come in any order).
fn delta_request(head: &DeltaDiscoveryRequest, held: Option<Held>) -> EncodedRequest {
    EncodedRequest {
        head: head.encode_to_vec(),
        node: Bytes::new(),
        names: Bytes::new(),
        held,
    }
}

/// The codec of both ADS methods: requests written by [`EncodedRequest::write`], sized at
/// once; responses read by prost.
struct RequestCodec<R>(std::marker::PhantomData<R>);

impl<R> Default for RequestCodec<R> {
    fn default() -> Self {
        RequestCodec(std::marker::PhantomData)
    }
}

impl<R: Message + Default + Send + 'static> tonic::codec::Codec for RequestCodec<R> {
    type Encode = EncodedRequest;
    type Decode = R;
    type Encoder = RequestEncoder;
    type Decoder = tonic_prost::ProstDecoder<R>;

    fn encoder(&mut self) -> RequestEncoder {
        RequestEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstCodec::<EncodedRequest, R>::default().decoder()
    }
}

struct RequestEncoder;

impl tonic::codec::Encoder for RequestEncoder {
    type Item = EncodedRequest;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        request: EncodedRequest,
        buf: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        request.write(buf, |buf, len| buf.reserve(len));
        Ok(())
    }
}

async fn run_delta(
    channel: tonic::transport::Channel,
    node: Node,
    routes: bool,
    view: Arc<Mutex<ClientView>>,
    bump: watch::Sender<u64>,
) -> anyhow::Result<()> {
    let (tx, rx) = mpsc::unbounded_channel();
    // What it holds from an earlier stream, encoded straight from the view as SotW's requests
    // are: a Delta client that holds a 50k-service mesh names 100k versions and 50k
    // subscriptions, and built as maps of strings they were most of the benchmark's own CPU
    // in an agent restart (perf), on the two cores it shares with the agent.
    let opening: Vec<EncodedRequest> = {
        let v = lock(&view);
        let request = |type_url: &'static str| {
            let head = DeltaDiscoveryRequest {
                node: Some(node.clone()),
                type_url: type_url.to_string(),
                ..DeltaDiscoveryRequest::default()
            };
            let held = Held {
                view: view.clone(),
                type_url,
            };
            delta_request(&head, Some(held))
        };
        // No names on the first request of a wildcard type: the legacy wildcard, as Envoy
        // sends; with the versions of what it holds from an earlier stream.
        let mut opening = vec![request(CDS), request(LDS)];
        if !v.clusters.is_empty() {
            opening.push(request(EDS));
        }
        if routes && !v.route_names.is_empty() {
            opening.push(request(RDS));
        }
        opening
    };
    for request in opening {
        tx.send(request)?;
    }
    let mut stream = ads_stream::<DeltaResponse>(channel, DELTA_PATH, rx).await?;
    while let Some(mut response) = stream.message().await? {
        let (type_url, len) = (response.type_url.clone(), response.encoded_len());
        let nonce = std::mem::take(&mut response.nonce);
        let outcome = receive(&view, &type_url, len, |v, now| {
            apply_delta(v, response, routes, now)
        });
        let mut ack = DeltaDiscoveryRequest {
            node: Some(node.clone()),
            type_url,
            response_nonce: nonce,
            ..DeltaDiscoveryRequest::default()
        };
        let changes = match outcome {
            Ok(changes) => changes,
            Err(message) => {
                ack.error_detail = Some(rejection(message));
                Vec::new()
            }
        };
        tx.send(delta_request(&ack, None))?;
        for (type_url, subscribe, unsubscribe) in changes {
            let request = DeltaDiscoveryRequest {
                node: Some(node.clone()),
                type_url: type_url.to_string(),
                resource_names_subscribe: subscribe,
                resource_names_unsubscribe: unsubscribe,
                ..DeltaDiscoveryRequest::default()
            };
            tx.send(delta_request(&request, None))?;
        }
        bump.send_modify(|n| *n += 1);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An ADS server that turns every stream away at once (UNAVAILABLE, trailers only), as the
    /// agent does before it has listed its node's pods.
    async fn turning_away() -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let Ok(mut connection) = h2::server::handshake(socket).await else {
                        return;
                    };
                    while let Some(Ok((_, mut respond))) = connection.accept().await {
                        let response = http::Response::builder()
                            .header("content-type", "application/grpc")
                            .header("grpc-status", "14")
                            .header("grpc-message", "not yet")
                            .body(())
                            .unwrap();
                        let _ = respond.send_response(response, true);
                    }
                });
            }
        });
        addr
    }

    /// A stream turned away wakes whoever waits on the client: the wait ends with the
    /// stream's end, not at its deadline.
    #[tokio::test]
    async fn a_wait_ends_when_the_stream_is_turned_away() {
        let xds = turning_away().await;
        for mode in [AdsMode::Sotw, AdsMode::Delta] {
            let mut client = AdsClient::connect(xds, "pod.ns", mode).await.unwrap();
            let error = client
                .wait_for("an answer", Duration::from_secs(60), |v| {
                    !v.answered.is_empty()
                })
                .await
                .unwrap_err();
            assert!(format!("{error:#}").contains("stopped"), "{error:#}");
            assert!(client.stream_ended());
            // And again after a reconnect, on the new stream.
            client.reconnect().await.unwrap();
            let error = client
                .wait_for("an answer", Duration::from_secs(60), |v| {
                    !v.answered.is_empty()
                })
                .await
                .unwrap_err();
            assert!(format!("{error:#}").contains("not yet"), "{error:#}");
        }
    }

    /// The counts by size follow every insert, replacement, removal and retain: they are
    /// those of the map, recounted after each step of a mixed sequence.
    #[test]
    fn assignment_sizes_follow_the_map() {
        let mut held = Assignments::default();
        let endpoints = |n: u16| -> Arc<[SocketAddr]> {
            (0..n)
                .map(|p| SocketAddr::from(([10, 0, 0, 1], p)))
                .collect()
        };
        let now = Instant::now();
        let mut state = 7u64;
        for step in 0..2000 {
            // A small LCG: reproducible, no dependency.
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let cluster: Arc<str> = Arc::from(format!("c{}", (state >> 33) % 40));
            match (state >> 20) % 5 {
                0 | 1 => held.insert(cluster, endpoints(((state >> 40) % 4) as u16), now),
                2 => held.remove(&cluster),
                3 => held.retain(|name| name.len() % 2 == (step % 2)),
                _ => {}
            }
            for size in 0..4 {
                let recount = held.values().filter(|(e, _)| e.len() == size).count();
                assert_eq!(held.of_size(size), recount, "size {size} at step {step}");
            }
        }
    }

    /// The length a client keeps of its versions is that of the entries it writes, through
    /// new names, versions replaced by longer and shorter ones (one over 127 bytes, so its
    /// entry's length takes two bytes), and removals.
    #[test]
    fn the_kept_length_of_versions_is_what_is_written() {
        let long = "v".repeat(200);
        let mut versions = Versions::default();
        let steps: [(&str, Option<&str>); 7] = [
            ("web", Some("v1")),
            ("db", Some("0123456789abcdef")),
            ("web", Some(&long)),
            ("cache", Some("v2")),
            ("db", None),
            ("web", Some("v3")),
            ("absent", None),
        ];
        let view = Arc::new(Mutex::new(ClientView::default()));
        let held = Held {
            view: view.clone(),
            type_url: CDS,
        };
        for (name, version) in steps {
            match version {
                Some(version) => versions.insert(Arc::from(name), version.to_string().into()),
                None => versions.remove(name),
            }
            lock(&view)
                .delta_versions
                .insert(CDS.to_string(), versions.clone());
            let mut written = Vec::new();
            held.put(&lock(&view), &mut written);
            assert_eq!(
                held.encoded_len(&lock(&view)),
                written.len(),
                "after {name}"
            );
        }
        let decoded = DeltaDiscoveryRequest::decode(
            {
                let mut written = Vec::new();
                held.put(&lock(&view), &mut written);
                written
            }
            .as_slice(),
        )
        .unwrap();
        let expected: HashMap<String, String> = [("cache", "v2"), ("web", "v3")]
            .map(|(n, v)| (n.into(), v.into()))
            .into();
        assert_eq!(decoded.initial_resource_versions, expected);
    }

    /// A reconnecting Delta client's request decodes as the request it stands for, written
    /// through the codec's path or prost's, with what its view holds when it is written.
    #[test]
    fn a_delta_reconnect_is_the_request_it_stands_for() {
        let versions: Versions = [("web", "v1"), ("db", "a-long-version-string")]
            .into_iter()
            .map(|(name, version)| (Arc::from(name), version.to_string().into()))
            .collect();
        let head = DeltaDiscoveryRequest {
            node: Some(Node {
                id: "bench-1".into(),
                ..Node::default()
            }),
            type_url: EDS.into(),
            ..DeltaDiscoveryRequest::default()
        };
        let view = Arc::new(Mutex::new(ClientView::default()));
        let held = Held {
            view: view.clone(),
            type_url: EDS,
        };
        let request = delta_request(&head, Some(held));
        {
            let mut v = lock(&view);
            v.clusters = ["web", "db"].into_iter().map(Arc::from).collect();
            v.delta_versions.insert(EDS.to_string(), versions.clone());
        }
        let mut written = Vec::new();
        request.write(&mut written, |buf, len| buf.reserve_exact(len));
        assert_eq!(written.len(), request.encoded_len());
        assert_eq!(written, request.encode_to_vec());
        let decoded = DeltaDiscoveryRequest::decode(written.as_slice()).unwrap();
        let expected = DeltaDiscoveryRequest {
            resource_names_subscribe: vec!["db".into(), "web".into()],
            initial_resource_versions: versions
                .iter()
                .map(|(name, version)| {
                    let version = String::from_utf8(version.as_bytes().to_vec()).unwrap();
                    (name.to_string(), version)
                })
                .collect(),
            ..head.clone()
        };
        assert_eq!(decoded, expected);
        let plain = delta_request(&head, None);
        assert_eq!(plain.encode_to_vec(), head.encode_to_vec());
    }
}
