//! The agent's configuration: one struct, read from flags and `LATTICE_*` environment
//! variables, with the defaults of `docs/architecture.md`, logged once at start-up.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use serde::Serialize;

use lattice_contract::{ADMIN_PORT, DEFAULT_TRAP_CIDR, LOCAL_DNS_PORT, TrapCidrs, XDS_PORT};

#[derive(Clone, Copy, Debug, Default, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
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

    /// A directory for what must outlive the agent on this node: each pod's scope (the
    /// services it resolved), so that a restarted or upgraded agent gives every pod's Envoy
    /// what it held. The DaemonSet mounts the node's /run/lattice here. Without it, scopes live
    /// in memory only, and an agent restart drops what pods resolved.
    #[arg(long, env = "LATTICE_STATE_DIR", value_name = "DIR")]
    pub state_dir: Option<PathBuf>,

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

    /// Upstream DNS servers for every name outside the mesh (repeat or comma-separate; port 53
    /// unless given). Default: the nameservers of /etc/resolv.conf.
    #[arg(long, env = "LATTICE_UPSTREAM_DNS", value_delimiter = ',', value_name = "ADDR", value_parser = parse_upstream)]
    pub upstream_dns: Vec<SocketAddr>,

    /// Add this link-local address to the node (dummy link `lattice-dns0`, or `lo`) before the
    /// DNS server binds, and remove it on shutdown; pods use it as their nameserver. Needs
    /// CAP_NET_ADMIN. --dns-addr must listen on it. The manifests use 169.254.20.10.
    #[arg(long, env = "LATTICE_NODE_LOCAL_DNS", value_name = "ADDR")]
    pub node_local_dns: Option<std::net::IpAddr>,

    /// TTL, in seconds, of answers for mesh names.
    #[arg(long, env = "LATTICE_DNS_TTL", default_value_t = 30)]
    pub dns_ttl: u32,

    /// Least time between two pushes, in milliseconds: a lone mesh change goes out at once,
    /// changes that follow a push closer than this wait and go out together.
    #[arg(long, env = "LATTICE_DEBOUNCE_MS", default_value_t = 10)]
    pub debounce_ms: u64,

    /// Log format.
    #[arg(long, env = "LATTICE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Validate the configuration (and the mesh file, if any) and exit without serving.
    #[arg(long)]
    pub check_config: bool,
}

impl AgentConfig {
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
        assert_eq!(config.xds_max_names, crate::xds::DEFAULT_MAX_NAMES);
        assert_eq!(config.state_dir, None);
        assert_eq!(config.dns_addr.to_string(), "127.0.0.1:15053");
        assert_eq!(config.admin_addr.to_string(), "127.0.0.1:15020");
        assert_eq!(config.trap_cidr.to_string(), "240.240.0.0/16");
        assert_eq!(config.dns_ttl, 30);
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
