//! The contract between the parts of the node agent: `lattice-agent`, `lattice-init` and the
//! DNS server, and the manifests and docs that configure them. Each value here is one that two
//! parts must agree on; a part that needs one takes it from here instead of writing it again.

mod port;
mod trap;

use std::net::Ipv4Addr;

pub use port::{CapturePort, CapturePortError};
pub use trap::{TrapCidr, TrapCidrError, TrapCidrs};

/// The DNS zone mesh names live under: service `/foo/bar/buzz` is `buzz.bar.foo.system.internal`.
pub const ZONE: &str = "system.internal";

/// The zone's name server is `ns.` before [`ZONE`]: the NS and SOA name, answered with the DNS
/// server's own address. No mesh path may take its name (`/ns`).
pub const ZONE_NAMESERVER_LABEL: &str = "ns";

/// The trapped block when `--trap-cidr` is not given. Class E: never routed anywhere, so a
/// connection that escapes capture fails instead of leaking to a real network.
pub const DEFAULT_TRAP_CIDR: &str = "240.240.0.0/16";

/// Envoy's outbound capture listener in the pod by default; iptables redirects the trapped
/// block to it. Both binaries take `--envoy-port` to move it ([`CapturePort`]).
pub const ENVOY_OUTBOUND_PORT: u16 = 15001;
/// Envoy's inbound listener in the pod: where `lattice-init --inbound-capture` redirects the
/// TCP that arrives for the pod, and where the agent's inbound listener listens. Fixed: no
/// flag moves it, so the two binaries cannot disagree.
pub const ENVOY_INBOUND_PORT: u16 = 15006;
/// The static cluster that hands an inbound connection to the app at its original destination:
/// in the bootstrap `lattice-init --inbound-capture` writes, named by the agent's inbound
/// listener.
pub const INBOUND_PASSTHROUGH_CLUSTER: &str = "lattice-inbound-passthrough";
/// The ALPN protocol one mesh proxy offers another over mutual TLS: the inbound listener tells
/// mesh mTLS from an app's own TLS by it.
pub const MESH_ALPN: &str = "lattice-mtls";
/// Envoy's admin interface in the pod, on loopback only.
pub const ENVOY_ADMIN_PORT: u16 = 15000;
/// Envoy's readiness endpoint in the pod, on every address: the kubelet probes it (the mesh
/// pod's startup probe, so that the app starts only once its proxy holds its configuration).
pub const ENVOY_READINESS_PORT: u16 = 15021;
/// The path of the readiness endpoint: 200 once Envoy holds its first configuration from the
/// agent (its server state is LIVE), 503 or no answer before, and while it drains.
pub const ENVOY_READINESS_PATH: &str = "/healthz/ready";
/// The UID Envoy runs as; its own connections are never captured.
pub const ENVOY_UID: u32 = 1337;

/// The agent's xDS (gRPC ADS) server on the node.
pub const XDS_PORT: u16 = 15010;
/// The agent's admin server (`/healthz`, `/readyz`, `/metrics`, `/debug/…`), on loopback.
pub const ADMIN_PORT: u16 = 15020;
/// The agent's DNS server for local runs (on 127.0.0.1); in a cluster it serves port 53.
pub const LOCAL_DNS_PORT: u16 = 15053;
/// The link-local address the agent adds to the node in a cluster: pods use it as their
/// nameserver, and their Envoys reach the agent's xDS server on it (lattice-init's default).
/// Link-local, so no router forwards it: only this node's pods reach it.
pub const NODE_LOCAL_DNS: Ipv4Addr = Ipv4Addr::new(169, 254, 20, 10);

/// The largest program a route's regular expression may compile to in RE2, Envoy's regex
/// engine, as the agent bounds it from above. The agent refuses a rule past it, and Envoy
/// counts one past it (`re2.max_program_size.warn_level`, stat `re2.exceeded_warn_level`):
/// a count there means the agent's bound was not one.
pub const REGEX_PROGRAM_SIZE: u64 = 1000;

/// The program size past which Envoy refuses a regular expression
/// (`re2.max_program_size.error_level`; Envoy's default, 100, is smaller than many path
/// patterns, and a refusal fails the whole route configuration it is in). Far above
/// [`REGEX_PROGRAM_SIZE`]: a backstop that no pattern the agent accepts comes near.
pub const ENVOY_REGEX_PROGRAM_SIZE_ERROR: u64 = 32 * REGEX_PROGRAM_SIZE;
