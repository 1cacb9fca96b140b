//! The agent's configuration: one struct, read from flags and `LATTICE_*` environment
//! variables, with the defaults of `docs/architecture.md`, logged once at start-up.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use serde::Serialize;

use lattice_contract::{
    ADMIN_PORT, CapturePort, DEFAULT_TRAP_CIDR, LOCAL_DNS_PORT, TrapCidrs, XDS_PORT,
};

#[derive(Clone, Copy, Debug, Default, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Who may claim a mesh path with the lattice.mlab.com/path annotation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PathClaimRule {
    /// A Service under its namespace's prefix (/<namespace>/…) or a prefix granted to its
    /// namespace in the --path-grants ConfigMap; its own path /<namespace>/<name> always.
    #[default]
    Granted,
    /// Any Service, any path; the oldest claim wins (for installs that rely on it).
    Any,
}

/// What a verified proxy (a pod of this node, identity checking on) is served.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProxyScope {
    /// The services its pod uses: those it resolved through the agent's DNS, those its
    /// annotation lattice.mlab.com/uses declares, and the backends their routes send to.
    #[default]
    Used,
    /// Every service of the mesh.
    Mesh,
}

/// Lattice node agent: serves the mesh to this node's Envoys over ADS (SotW and Delta xDS),
/// answers `*.system.internal` DNS from it, and forwards every other name upstream.
///
/// The mesh comes from YAML mesh files (--mesh-file), followed live, or, without one, from the
/// Kubernetes API (in-cluster config or KUBECONFIG): Services (ExternalName ones as external
/// services, whose host names Envoy resolves) and EndpointSlices, and the Gateway
/// API's HTTPRoutes and GRPCRoutes on Services for traffic rules (when their CRDs are installed).
/// With --kubernetes, both: every provider's services are merged into one catalog.
#[derive(Clone, Debug, Parser, Serialize)]
#[command(name = "lattice-agent", version, about, long_about)]
pub struct AgentConfig {
    /// Serve the mesh described in this YAML file and follow its edits. Repeat for several
    /// files: they are merged with each other (and with Kubernetes, with --kubernetes) into one
    /// catalog. Without it, the agent watches Kubernetes.
    #[arg(long = "mesh-file", env = "LATTICE_MESH_FILE", value_name = "PATH")]
    pub mesh_files: Vec<PathBuf>,

    /// The largest mesh file read, in MiB; a larger one is refused (at start, or as an edit).
    #[arg(
        long,
        env = "LATTICE_MESH_FILE_MAX_MIB",
        default_value_t = 16,
        value_name = "MIB"
    )]
    pub mesh_file_max_mib: u64,

    /// How deep a mesh file's YAML may nest (collections in collections); a deeper one is
    /// refused. The parser's time grows with it, for every token.
    #[arg(
        long,
        env = "LATTICE_MESH_FILE_MAX_DEPTH",
        default_value_t = 64,
        value_name = "LEVELS"
    )]
    pub mesh_file_max_depth: usize,

    /// How many YAML nodes (scalars and collections) a mesh file may hold, each alias counting
    /// the nodes of its anchor; past it the file is refused, whatever its size.
    #[arg(
        long,
        env = "LATTICE_MESH_FILE_MAX_NODES",
        default_value_t = 2_000_000,
        value_name = "NODES"
    )]
    pub mesh_file_max_nodes: u64,

    /// Watch Kubernetes beside the mesh files (on by itself when no --mesh-file is given).
    #[arg(long, env = "LATTICE_KUBERNETES")]
    pub kubernetes: bool,

    /// Kubernetes namespaces to watch (repeat or comma-separate); all namespaces when empty.
    #[arg(
        long = "namespace",
        env = "LATTICE_NAMESPACES",
        value_delimiter = ',',
        value_name = "NS"
    )]
    pub namespaces: Vec<String>,

    /// Who may claim a mesh path by annotation: `granted`, a Service under its namespace's
    /// prefix or a prefix the --path-grants ConfigMap grants its namespace; `any`, every
    /// Service anywhere, the oldest claim winning.
    #[arg(long, env = "LATTICE_PATH_CLAIMS", value_enum, default_value_t = PathClaimRule::Granted)]
    pub path_claims: PathClaimRule,

    /// The ConfigMap (namespace/name) whose keys are namespaces and values the mesh path
    /// prefixes granted to each; read with --path-claims granted.
    #[arg(
        long,
        env = "LATTICE_PATH_GRANTS",
        default_value = "lattice-system/lattice-path-grants",
        value_name = "NAMESPACE/NAME",
        value_parser = parse_object_ref
    )]
    pub path_grants: (String, String),

    /// The trust domain of workload identities: a pod's is
    /// spiffe://<trust domain>/ns/<namespace>/sa/<service account>.
    #[arg(
        long,
        env = "LATTICE_TRUST_DOMAIN",
        default_value = "cluster.local",
        value_name = "DOMAIN",
        value_parser = parse_trust_domain
    )]
    pub trust_domain: String,

    /// The Secret (namespace/name, type kubernetes.io/tls: tls.crt with its chain, tls.key in
    /// PKCS#8, ca.crt the trust bundle) of the CA that signs workload certificates, as a
    /// cert-manager Certificate with isCA: true writes it. Watched by name (RBAC grants this
    /// Secret alone), held in memory, never written to the node; a version that does not hold
    /// together is refused and the one before stays in use. Absent: no workload certificates,
    /// and calls to meshed pods are plaintext.
    #[arg(
        long,
        env = "LATTICE_CA_SECRET",
        default_value = "lattice-system/lattice-ca",
        value_name = "NAMESPACE/NAME",
        value_parser = parse_object_ref
    )]
    pub ca_secret: (String, String),

    /// Istio's certificate service (https://HOST:PORT, as
    /// https://istiod.istio-system.svc:15012, or cert-manager's istio-csr): workload
    /// certificates are asked of it, on each pod's behalf, instead of signed with the CA's
    /// Secret, which is then not read. The service holds the CA's key and checks that a pod of
    /// each identity asked for runs on this node.
    #[arg(long, env = "LATTICE_ISTIO_CA_ADDR", value_name = "URL", value_parser = parse_istio_ca_addr)]
    pub istio_ca_addr: Option<String>,

    /// The name the certificate service's TLS certificate must carry; the host of
    /// --istio-ca-addr unless given.
    #[arg(long, env = "LATTICE_ISTIO_CA_SERVER_NAME", value_name = "NAME")]
    pub istio_ca_server_name: Option<String>,

    /// The agent's projected service-account token for the certificate service (audience
    /// istio-ca), read for every request.
    #[arg(
        long,
        env = "LATTICE_ISTIO_CA_TOKEN",
        default_value = "/var/run/secrets/tokens/istio-token",
        value_name = "PATH"
    )]
    pub istio_ca_token: PathBuf,

    /// The mesh's roots (PEM; Istio's istio-ca-root-cert ConfigMap, mounted): they check the
    /// certificate service's certificate and are the trust bundle handed to the proxies. Read
    /// again every 5 s.
    #[arg(
        long,
        env = "LATTICE_ISTIO_CA_ROOTS",
        default_value = "/var/run/secrets/istio/root-cert.pem",
        value_name = "PATH"
    )]
    pub istio_ca_roots: PathBuf,

    /// How long a workload certificate is valid, in seconds (capped at the issuer's own end):
    /// each is renewed once half of it is gone, plus up to a tenth at random. At least 60.
    #[arg(
        long,
        env = "LATTICE_LEAF_LIFETIME_SECS",
        default_value_t = 86_400,
        value_name = "SECONDS",
        value_parser = clap::value_parser!(u64).range(60..)
    )]
    pub leaf_lifetime_secs: u64,

    /// How often, in seconds, the agent compares the API server's current resourceVersion
    /// with the highest its watches have seen; one below it means the API server was restored
    /// from a backup, and every resource is listed again. 0: never.
    #[arg(
        long,
        env = "LATTICE_KUBE_ROLLBACK_CHECK_SECS",
        default_value_t = 60,
        value_name = "SECS"
    )]
    pub kube_rollback_check_secs: u64,

    /// Address of the gRPC ADS server the node's Envoys connect to. Loopback by default, for
    /// local runs; in a cluster the manifests use the node-local address (--node-local-dns),
    /// which only this node's pods reach. An address reachable from off the node is warned
    /// about at start.
    #[arg(long, env = "LATTICE_XDS_ADDR", default_value_t = SocketAddr::from((Ipv4Addr::LOCALHOST, XDS_PORT)))]
    pub xds_addr: SocketAddr,

    /// This node's name, as Kubernetes knows it (the manifests fill NODE_NAME from the downward
    /// API). With Kubernetes, the agent then watches this node's Pods and accepts an ADS stream
    /// only from one of them, sending its own node id (<pod>.<namespace>); without it,
    /// identity checking is off. It also says which endpoints run on this node, for Services
    /// that prefer them (trafficDistribution PreferSameNode, node hints, a mesh file's node:).
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    pub node_name: Option<String>,

    /// This node's zone. Endpoints in it are preferred for Services that ask for it
    /// (trafficDistribution PreferSameZone or PreferSameNode, or zone hints), while every other
    /// endpoint stays as failover. Without it, with Kubernetes and --node-name, the agent reads
    /// the Node's topology.kubernetes.io/zone label once at start; otherwise the zone is
    /// unknown and no service prefers by zone.
    #[arg(long, env = "NODE_ZONE", value_name = "ZONE")]
    pub node_zone: Option<String>,

    /// Accept ADS streams from pods on the host network. Such pods share the node's address,
    /// so the agent cannot tell their proxies from the node's other processes.
    #[arg(long, env = "LATTICE_ALLOW_HOST_NETWORK_PROXIES")]
    pub allow_host_network_proxies: bool,

    /// What the proxy of a verified pod holds: `used`, the services its pod resolved through
    /// this agent's DNS or declared (annotation lattice.mlab.com/uses) and their routes'
    /// backends; `mesh`, every service. A pod opts out with lattice.mlab.com/scope: mesh.
    /// Proxies that are not verified pods' always hold the whole mesh.
    #[arg(long, env = "LATTICE_PROXY_SCOPE", value_enum, default_value_t = ProxyScope::Used)]
    pub proxy_scope: ProxyScope,

    /// How long, in milliseconds, the DNS answer for a service new to a pod waits for the pod's
    /// Envoy to hold that service, so that the pod's first request finds it; after that the
    /// answer goes anyway (counted in lattice_scope_wait_timeouts_total).
    #[arg(
        long,
        env = "LATTICE_SCOPE_WAIT_MS",
        default_value_t = 1000,
        value_name = "MS"
    )]
    pub scope_wait_ms: u64,

    /// Address of the DNS server (UDP and TCP). In a cluster the manifests set port 53. Envoy's
    /// DNS clusters (external services' host names) resolve through it as pods reach it: on
    /// --node-local-dns, else here unless it is loopback or unspecified.
    #[arg(long, env = "LATTICE_DNS_ADDR", default_value_t = SocketAddr::from((Ipv4Addr::LOCALHOST, LOCAL_DNS_PORT)))]
    pub dns_addr: SocketAddr,

    /// Address of the admin server: /healthz /readyz /metrics /debug/mesh /debug/routes
    /// /debug/xds.
    #[arg(long, env = "LATTICE_ADMIN_ADDR", default_value_t = SocketAddr::from((Ipv4Addr::LOCALHOST, ADMIN_PORT)))]
    pub admin_addr: SocketAddr,

    /// The trapped IPv4 block mesh names resolve into, which pods send to Envoy; optionally an
    /// IPv6 block after a comma, accepted for lattice-init's sake (no mesh name resolves into
    /// it). Give lattice-init the same value.
    #[arg(long, env = "LATTICE_TRAP_CIDR", default_value = DEFAULT_TRAP_CIDR, value_name = "CIDR[,CIDR]", value_parser = parse_trap)]
    pub trap_cidr: TrapCidrs,

    /// Port of the capture listener the agent serves every proxy: where lattice-init redirects
    /// the trapped block in each pod, so give lattice-init the same --envoy-port. Not Envoy's
    /// admin (15000), readiness (15021) or inbound (15006) port.
    #[arg(long, env = "LATTICE_ENVOY_PORT", default_value_t = CapturePort::default(), value_name = "PORT")]
    pub envoy_port: CapturePort,

    /// Upstream DNS servers for every name outside the mesh (repeat or comma-separate; port 53
    /// unless given). Default: the nameservers of /etc/resolv.conf.
    #[arg(long, env = "LATTICE_UPSTREAM_DNS", value_delimiter = ',', value_name = "ADDR", value_parser = parse_upstream)]
    pub upstream_dns: Vec<SocketAddr>,

    /// Add this link-local address to the node (dummy link `lattice-dns0`, or `lo`) before the
    /// DNS server binds, and leave it there on shutdown, for the agent that follows; pods use
    /// it as their nameserver. Needs CAP_NET_ADMIN. --dns-addr must listen on it. The
    /// manifests use 169.254.20.10.
    #[arg(long, env = "LATTICE_NODE_LOCAL_DNS", value_name = "ADDR")]
    pub node_local_dns: Option<std::net::IpAddr>,

    /// A directory on the node for what must outlive the agent across restarts and upgrades:
    /// the address record (addresses.json), so that every name keeps its own address whatever
    /// order the providers report in after a restart, and each pod's scope (scopes/, the
    /// services it resolved), so that a restarted agent gives every pod's Envoy what it held,
    /// the last mesh (mesh.json, written at most every 5 s), which a restarted agent answers
    /// DNS from until its sources report, and each mesh file's services as last read
    /// (mesh-files/), which a restart takes instead of an unchanged file's YAML. Without it
    /// addresses are derived from the names alone (a name that had to move may move again),
    /// scopes live in memory only, a restarted agent answers no mesh name before its sources
    /// report, and every start reads the mesh files' YAML. The manifests mount the node's
    /// /run/lattice (a tmpfs: it goes with a reboot, as the pods do) at /var/lib/lattice.
    #[arg(long, env = "LATTICE_STATE_DIR", value_name = "DIR")]
    pub state_dir: Option<PathBuf>,

    /// TTL, in seconds, of answers for mesh names.
    #[arg(long, env = "LATTICE_DNS_TTL", default_value_t = 30)]
    pub dns_ttl: u32,

    /// Most answers for names outside the mesh the DNS cache keeps (least recently used out).
    #[arg(
        long,
        env = "LATTICE_DNS_CACHE_ENTRIES",
        default_value_t = 10_000,
        value_name = "N"
    )]
    pub dns_cache_entries: usize,

    /// Most bytes the DNS cache's answers take.
    #[arg(long, env = "LATTICE_DNS_CACHE_BYTES", default_value_t = 16 << 20, value_name = "BYTES")]
    pub dns_cache_bytes: usize,

    /// Most answers one client address may have in the DNS cache (and the same share of
    /// --dns-cache-bytes): one pod's unique names replace its own, never the others'.
    #[arg(
        long,
        env = "LATTICE_DNS_CACHE_ENTRIES_PER_SOURCE",
        default_value_t = 1_250,
        value_name = "N"
    )]
    pub dns_cache_entries_per_source: usize,
    /// Most forwarded DNS queries (names outside the mesh, not cached) in flight; beyond it a
    /// forwarded query gets SERVFAIL. Mesh names never wait on it.
    #[arg(
        long,
        env = "LATTICE_DNS_FORWARDS",
        default_value_t = 1024,
        value_name = "N"
    )]
    pub dns_forwards: usize,

    /// Most forwarded DNS queries in flight from one source address (a pod).
    #[arg(
        long,
        env = "LATTICE_DNS_FORWARDS_PER_SOURCE",
        default_value_t = 128,
        value_name = "N"
    )]
    pub dns_forwards_per_source: usize,

    /// SERVFAILs a second sent over UDP to a source over `--dns-forwards-per-source`; its other
    /// queries are dropped unanswered, as DNS response rate limiting does.
    #[arg(
        long,
        env = "LATTICE_DNS_REFUSALS_PER_SOURCE",
        default_value_t = 100,
        value_name = "N"
    )]
    pub dns_refusals_per_source: u32,

    /// Most DNS TCP connections open; beyond it the connection idle longest is closed for a
    /// new one, or the new one refused when none is idle.
    #[arg(
        long,
        env = "LATTICE_DNS_TCP_CONNECTIONS",
        default_value_t = 1024,
        value_name = "N"
    )]
    pub dns_tcp_connections: usize,

    /// Most DNS TCP connections open from one source address; beyond it a new one is refused.
    #[arg(
        long,
        env = "LATTICE_DNS_TCP_CONNECTIONS_PER_SOURCE",
        default_value_t = 64,
        value_name = "N"
    )]
    pub dns_tcp_connections_per_source: usize,

    /// A DNS TCP connection with no query for this many seconds is closed.
    #[arg(
        long,
        env = "LATTICE_DNS_TCP_IDLE_TIMEOUT_SECS",
        default_value_t = 10,
        value_name = "SECS"
    )]
    pub dns_tcp_idle_timeout_secs: u64,

    /// A DNS TCP connection open this many seconds is closed once its queries are answered.
    #[arg(
        long,
        env = "LATTICE_DNS_TCP_LIFETIME_SECS",
        default_value_t = 120,
        value_name = "SECS"
    )]
    pub dns_tcp_lifetime_secs: u64,

    /// Most queries of one DNS TCP connection answered at once (pipelined); beyond it the
    /// connection is read no further until one is answered.
    #[arg(
        long,
        env = "LATTICE_DNS_TCP_PIPELINE",
        default_value_t = 16,
        value_name = "N"
    )]
    pub dns_tcp_pipeline: usize,

    /// On SIGTERM, the longest the agent drains (answers the DNS queries it has received,
    /// closes TCP connections without a reset, ends ADS streams) before it exits anyway. Keep
    /// it below the pod's terminationGracePeriodSeconds.
    #[arg(
        long,
        env = "LATTICE_DRAIN_TIMEOUT_SECS",
        default_value_t = 20,
        value_name = "SECS"
    )]
    pub drain_timeout_secs: u64,

    /// Also serve the admin endpoints on this Unix socket. In the DaemonSet it lies in the
    /// pod's own emptyDir, so the kubelet's probes (`--probe`) reach this pod's agent even while
    /// an upgraded one shares its ports.
    #[arg(long, env = "LATTICE_ADMIN_SOCKET", value_name = "PATH")]
    pub admin_socket: Option<PathBuf>,

    /// Ask the running agent's admin socket (--admin-socket) for PATH (`/readyz`, `/healthz`)
    /// and exit 0 if it answers 200, 1 otherwise: the kubelet's exec probes.
    #[arg(long, value_name = "PATH", requires = "admin_socket")]
    pub probe: Option<String>,

    /// Least time between two pushes, in milliseconds: a lone mesh change goes out at once,
    /// changes that follow a push closer than this wait and go out together.
    #[arg(long, env = "LATTICE_DEBOUNCE_MS", default_value_t = 10)]
    pub debounce_ms: u64,

    #[command(flatten)]
    #[serde(flatten)]
    pub xds_limits: XdsLimitFlags,

    /// Log format.
    #[arg(long, env = "LATTICE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Validate the configuration (and the mesh file, if any) and exit without serving.
    #[arg(long)]
    pub check_config: bool,
}

/// The bounds of the xDS server, whatever a client sends. Each default fits a node of a few
/// hundred pods whose proxies hold a mesh of 50k services; docs/architecture.md says why.
#[derive(Clone, Debug, clap::Args, Serialize)]
pub struct XdsLimitFlags {
    /// The most resource names one ADS stream may subscribe to per type (and, with Delta, say
    /// it holds when it reconnects). A stream that names more ends with RESOURCE_EXHAUSTED,
    /// counted in lattice_xds_refused_streams_total{reason="too_many_names"}. The default
    /// fits a proxy of a whole mesh of 50k services with two ports each and as many instance
    /// clusters again.
    #[arg(
        long,
        env = "LATTICE_XDS_MAX_NAMES",
        default_value_t = 200_000,
        value_name = "N"
    )]
    pub xds_max_names: usize,

    /// Most xDS connections the agent holds at once.
    #[arg(long, env = "LATTICE_XDS_MAX_CONNECTIONS", default_value_t = 1024, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub xds_max_connections: u32,

    /// Most xDS connections from one address (a pod; a pod's Envoy holds one).
    #[arg(long, env = "LATTICE_XDS_MAX_CONNECTIONS_PER_PEER", default_value_t = 8, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub xds_max_connections_per_peer: u32,

    /// Most ADS streams the agent holds at once.
    #[arg(long, env = "LATTICE_XDS_MAX_STREAMS", default_value_t = 1024, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub xds_max_streams: u32,

    /// Most ADS streams from one address (a pod's Envoy holds one).
    #[arg(long, env = "LATTICE_XDS_MAX_STREAMS_PER_PEER", default_value_t = 8, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub xds_max_streams_per_peer: u32,

    /// Most HTTP/2 streams open at once on one xDS connection (SETTINGS_MAX_CONCURRENT_STREAMS).
    #[arg(long, env = "LATTICE_XDS_MAX_STREAMS_PER_CONNECTION", default_value_t = 4, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub xds_max_streams_per_connection: u32,

    /// Largest ADS request, in bytes, or `auto`: from the mesh served (a node, and every
    /// resource of the largest type named four times), at least 4 MiB.
    #[arg(long, env = "LATTICE_XDS_MAX_REQUEST_BYTES", default_value = "auto", value_name = "auto|BYTES", value_parser = parse_request_bytes)]
    pub xds_max_request_bytes: RequestBytes,

    /// Bytes of ADS requests being read at once, over every stream; a request waits for its
    /// share before its body is read.
    #[arg(long, env = "LATTICE_XDS_REQUEST_BUFFER_BYTES", default_value_t = 64 << 20, value_name = "BYTES", value_parser = clap::value_parser!(u64).range(1 << 20..))]
    pub xds_request_buffer_bytes: u64,

    /// Milliseconds an ADS request may take to arrive whole: a stream's first, from when the
    /// agent serves the mesh; any other, from its first byte. Time waiting for the request
    /// buffer does not count.
    #[arg(long, env = "LATTICE_XDS_REQUEST_TIMEOUT_MS", default_value_t = 10_000, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..))]
    pub xds_request_timeout_ms: u64,

    /// Bytes HTTP/2 queues per stream beyond what the proxy has read.
    #[arg(long, env = "LATTICE_XDS_SEND_BUFFER_BYTES", default_value_t = 400 << 10, value_name = "BYTES", value_parser = clap::value_parser!(u64).range(16 << 10..))]
    pub xds_send_buffer_bytes: u64,

    /// Largest HTTP/2 header list the xDS server accepts (SETTINGS_MAX_HEADER_LIST_SIZE).
    #[arg(long, env = "LATTICE_XDS_MAX_HEADER_LIST_BYTES", default_value_t = 16 << 10, value_name = "BYTES", value_parser = clap::value_parser!(u32).range(1024..))]
    pub xds_max_header_list_bytes: u32,

    /// Largest HTTP/2 frame the xDS server accepts (SETTINGS_MAX_FRAME_SIZE, 16384 to 16777215).
    #[arg(long, env = "LATTICE_XDS_MAX_FRAME_BYTES", default_value_t = 16 << 10, value_name = "BYTES", value_parser = clap::value_parser!(u32).range(16_384..=16_777_215))]
    pub xds_max_frame_bytes: u32,

    /// Milliseconds without a frame from a proxy before the agent sends an HTTP/2 PING.
    #[arg(long, env = "LATTICE_XDS_KEEPALIVE_MS", default_value_t = 30_000, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..))]
    pub xds_keepalive_ms: u64,

    /// Milliseconds a PING may go unanswered before the connection is closed.
    #[arg(long, env = "LATTICE_XDS_KEEPALIVE_TIMEOUT_MS", default_value_t = 20_000, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..))]
    pub xds_keepalive_timeout_ms: u64,

    /// Seconds a connection may idle before TCP keep-alive probes (every 10 s, three).
    #[arg(long, env = "LATTICE_XDS_TCP_KEEPALIVE_SECS", default_value_t = 60, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
    pub xds_tcp_keepalive_secs: u64,

    /// On shutdown, milliseconds the xDS connections have to end their streams before they
    /// are closed.
    #[arg(
        long,
        env = "LATTICE_XDS_DRAIN_MS",
        default_value_t = 5_000,
        value_name = "MS"
    )]
    pub xds_drain_ms: u64,
}

/// `--xds-max-request-bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RequestBytes {
    Auto,
    #[serde(untagged)]
    Bytes(u64),
}

fn parse_request_bytes(s: &str) -> Result<RequestBytes, String> {
    if s == "auto" {
        return Ok(RequestBytes::Auto);
    }
    match s.parse::<u64>() {
        Ok(bytes) if bytes >= 1024 => Ok(RequestBytes::Bytes(bytes)),
        _ => Err(format!(
            "{s:?} is neither `auto` nor a number of bytes (1024 or more)"
        )),
    }
}

impl AgentConfig {
    /// Istio's certificate service, where --istio-ca-addr names one.
    pub fn istio_ca(&self) -> Option<crate::trust::IstioCaConfig> {
        let addr: tonic::transport::Uri = self.istio_ca_addr.as_ref()?.parse().ok()?;
        let host = addr.host().unwrap_or_default();
        let server_name = self.istio_ca_server_name.clone().unwrap_or_else(|| {
            host.trim_start_matches('[')
                .trim_end_matches(']')
                .to_string()
        });
        Some(crate::trust::IstioCaConfig {
            addr,
            server_name,
            token_file: self.istio_ca_token.clone(),
            roots_file: self.istio_ca_roots.clone(),
        })
    }

    /// Whether Kubernetes is a provider: asked for, or no mesh file given.
    pub fn watches_kubernetes(&self) -> bool {
        self.kubernetes || self.mesh_files.is_empty()
    }

    /// The DNS server Envoy resolves external services' host names with: the agent's own, as
    /// the node's pods reach it (the node-local address, else --dns-addr unless it is loopback
    /// or unspecified, which a pod cannot reach), so lookups follow --upstream-dns and get the
    /// agent's TTL ceiling. `None`: the pod's resolv.conf.
    pub fn envoy_dns_resolver(&self) -> Option<SocketAddr> {
        if let Some(ip) = self.node_local_dns {
            return Some(SocketAddr::new(ip, self.dns_addr.port()));
        }
        let ip = self.dns_addr.ip();
        (!ip.is_loopback() && !ip.is_unspecified()).then_some(self.dns_addr)
    }

    pub fn debounce(&self) -> Duration {
        Duration::from_millis(self.debounce_ms)
    }

    pub fn drain_timeout(&self) -> Duration {
        Duration::from_secs(self.drain_timeout_secs)
    }
}

fn parse_object_ref(s: &str) -> Result<(String, String), String> {
    match s.split_once('/') {
        Some((namespace, name))
            if !namespace.is_empty() && !name.is_empty() && !name.contains('/') =>
        {
            Ok((namespace.to_string(), name.to_string()))
        }
        _ => Err(format!("{s:?} is not namespace/name")),
    }
}

fn parse_istio_ca_addr(s: &str) -> Result<String, String> {
    let uri: tonic::transport::Uri = s.parse().map_err(|e| format!("not a URL: {e}"))?;
    if uri.scheme_str() != Some("https") || uri.host().is_none_or(str::is_empty) {
        return Err("must be https://HOST[:PORT]".to_string());
    }
    if uri.path_and_query().is_some_and(|p| p.as_str() != "/") {
        return Err("must be https://HOST[:PORT], with no path".to_string());
    }
    Ok(s.to_string())
}

fn parse_trust_domain(s: &str) -> Result<String, String> {
    crate::trust::check_trust_domain(s)
        .map(|()| s.to_string())
        .map_err(|e| e.to_string())
}

fn parse_trap(s: &str) -> Result<TrapCidrs, String> {
    s.parse()
        .map_err(|e: lattice_contract::TrapCidrError| e.to_string())
}

fn parse_upstream(s: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = s.parse::<SocketAddr>() {
        return Ok(addr);
    }
    s.parse::<std::net::IpAddr>()
        .map(|ip| SocketAddr::new(ip, 53))
        .map_err(|_| format!("{s:?} is not an IP address or IP:port"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_design() {
        let config = AgentConfig::try_parse_from(["lattice-agent"]).unwrap();
        assert_eq!(config.xds_addr.to_string(), "127.0.0.1:15010");
        assert_eq!(config.node_name, None);
        assert_eq!(config.node_zone, None);
        assert!(config.mesh_files.is_empty() && !config.kubernetes);
        assert!(
            config.watches_kubernetes(),
            "Kubernetes when no mesh file is given"
        );
        assert!(!config.allow_host_network_proxies);
        assert_eq!(config.proxy_scope, ProxyScope::Used);
        assert_eq!(config.scope_wait_ms, 1000);
        assert_eq!(
            config.xds_limits.xds_max_names,
            crate::xds::DEFAULT_MAX_NAMES
        );
        assert_eq!(config.state_dir, None);
        assert_eq!(config.dns_addr.to_string(), "127.0.0.1:15053");
        assert_eq!(config.admin_addr.to_string(), "127.0.0.1:15020");
        assert_eq!(config.trap_cidr.to_string(), "240.240.0.0/16");
        assert_eq!(config.envoy_port.get(), 15001);
        assert_eq!(config.dns_ttl, 30);
        assert_eq!(config.dns_cache_entries, 10_000);
        assert_eq!(config.dns_cache_bytes, 16 << 20);
        assert_eq!(config.dns_cache_entries_per_source, 1_250);
        assert_eq!(config.dns_forwards, 1024);
        assert_eq!(config.dns_forwards_per_source, 128);
        assert_eq!(config.dns_refusals_per_source, 100);
        assert_eq!(config.dns_tcp_connections, 1024);
        assert_eq!(config.dns_tcp_connections_per_source, 64);
        assert_eq!(config.dns_tcp_idle_timeout_secs, 10);
        assert_eq!(config.dns_tcp_lifetime_secs, 120);
        assert_eq!(config.dns_tcp_pipeline, 16);
        assert_eq!(config.drain_timeout_secs, 20);
        assert_eq!(config.admin_socket, None);
        // The flags' defaults are the mesh file reader's own.
        assert_eq!(
            config.mesh_file_max_mib,
            crate::source::file::DEFAULT_MAX_MIB
        );
        assert_eq!(
            config.mesh_file_max_depth,
            crate::source::file::DEFAULT_MAX_DEPTH
        );
        assert_eq!(
            config.mesh_file_max_nodes,
            crate::source::file::DEFAULT_MAX_NODES
        );
        assert_eq!(config.xds_limits.xds_max_request_bytes, RequestBytes::Auto);
        assert_eq!(config.xds_limits.xds_max_streams_per_peer, 8);
    }

    #[test]
    fn xds_limits_refuse_what_cannot_work() {
        let parse = |args: &[&str]| {
            let mut all = vec!["lattice-agent"];
            all.extend_from_slice(args);
            AgentConfig::try_parse_from(all)
        };
        let config = parse(&["--xds-max-request-bytes", "8388608"]).unwrap();
        assert_eq!(
            config.xds_limits.xds_max_request_bytes,
            RequestBytes::Bytes(8 << 20)
        );
        for bad in [
            &["--xds-max-request-bytes", "lots"][..],
            &["--xds-max-request-bytes", "10"],
            &["--xds-max-streams", "0"],
            &["--xds-max-frame-bytes", "1000"],
            &["--xds-keepalive-ms", "0"],
        ] {
            let err = parse(bad).unwrap_err().to_string();
            assert!(err.contains(bad[1]), "{bad:?}: {err}");
        }
        let logged = serde_json::to_value(parse(&[]).unwrap()).unwrap();
        assert_eq!(logged["xds_max_request_bytes"], "auto");
        assert_eq!(logged["xds_max_streams"], 1024);
    }

    #[test]
    fn bad_input_is_refused_with_the_value_named() {
        let err = AgentConfig::try_parse_from(["lattice-agent", "--trap-cidr", "240.240.0.0/40"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("240.240.0.0/40"), "{err}");
        let err = AgentConfig::try_parse_from(["lattice-agent", "--upstream-dns", "resolver"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("resolver"), "{err}");
        assert!(AgentConfig::try_parse_from(["lattice-agent", "--no-such-flag"]).is_err());
        let config = AgentConfig::try_parse_from([
            "lattice-agent",
            "--upstream-dns",
            "127.0.0.1,[::1]:5353",
        ])
        .unwrap();
        assert_eq!(config.upstream_dns[0].to_string(), "127.0.0.1:53");
        assert_eq!(config.upstream_dns[1].to_string(), "[::1]:5353");
    }

    #[test]
    fn envoy_resolves_external_names_through_the_agents_dns_as_pods_reach_it() {
        let parse = |args: &[&str]| {
            let mut all = vec!["lattice-agent"];
            all.extend_from_slice(args);
            AgentConfig::try_parse_from(all)
                .unwrap()
                .envoy_dns_resolver()
        };
        assert_eq!(parse(&[]), None, "loopback is not the pod's");
        assert_eq!(parse(&["--dns-addr", "0.0.0.0:53"]), None);
        assert_eq!(
            parse(&["--dns-addr", "10.200.0.1:53"]),
            Some("10.200.0.1:53".parse().unwrap())
        );
        assert_eq!(
            parse(&[
                "--dns-addr",
                "0.0.0.0:53",
                "--node-local-dns",
                "169.254.20.10"
            ]),
            Some("169.254.20.10:53".parse().unwrap())
        );
    }
}
