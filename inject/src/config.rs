//! What the pod additions are made from, beside the pod itself: the images, the values the
//! agent and `lattice-init` must agree on (from `lattice-contract`), the cluster's DNS domain
//! and the proxy's resources. The defaults are those of `deploy/`: a pod injected with them
//! works with the DaemonSet as shipped.

use std::net::Ipv4Addr;

use lattice_contract::{CapturePort, DEFAULT_TRAP_CIDR, NODE_LOCAL_DNS, TrapCidrs};

/// Everything the template takes that is not in the pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InjectConfig {
    /// The image with `lattice-init` (the project's image, as the DaemonSet's).
    pub image: String,
    /// Envoy's image.
    pub envoy_image: String,
    /// The trapped blocks `lattice-init` captures; the agent's `--trap-cidr` must be the same.
    pub trap: TrapCidrs,
    /// The capture port `lattice-init` redirects to; the agent's `--envoy-port` must be the same.
    pub envoy_port: CapturePort,
    /// The agent's ADS address as Envoy dials it (`host:port`); `None` keeps `lattice-init`'s
    /// default, the node-local address.
    pub xds_address: Option<String>,
    /// The nameserver pods ask: the agent's node-local address.
    pub nameserver: Ipv4Addr,
    /// The cluster's DNS domain, for the search list a pod would have had (`cluster.local`).
    pub cluster_domain: String,
    /// Envoy's log level.
    pub proxy_log_level: String,
    /// The proxy's resources unless the pod's annotations say otherwise.
    pub proxy_resources: ProxyResources,
}

/// The Envoy sidecar's resources, as Kubernetes quantities.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyResources {
    pub cpu_request: String,
    pub memory_request: String,
    pub memory_limit: String,
}

/// The project's image of this release, as `deploy/` names it (kustomize sets the tag there).
pub const IMAGE: &str = concat!("lattice:", env!("CARGO_PKG_VERSION"));

/// Envoy's image, the release the project is tested with.
pub const ENVOY_IMAGE: &str = "envoyproxy/envoy:v1.40.0";

impl Default for InjectConfig {
    fn default() -> Self {
        InjectConfig {
            image: IMAGE.to_string(),
            envoy_image: ENVOY_IMAGE.to_string(),
            trap: TrapCidrs::parse(&[DEFAULT_TRAP_CIDR])
                .unwrap_or_else(|e| unreachable!("the contract's default trap CIDR is valid: {e}")),
            envoy_port: CapturePort::default(),
            xds_address: None,
            nameserver: NODE_LOCAL_DNS,
            cluster_domain: "cluster.local".to_string(),
            proxy_log_level: "info".to_string(),
            proxy_resources: ProxyResources {
                cpu_request: "50m".to_string(),
                memory_request: "64Mi".to_string(),
                memory_limit: "256Mi".to_string(),
            },
        }
    }
}
