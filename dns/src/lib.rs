//! Lattice DNS: answers `*.system.internal` from the live mesh name table and forwards every other
//! name to the upstream resolvers. See issue 5 and `../shared/DESIGN.md`.

mod check;
mod fast;
mod forward;
mod metrics;
mod query;
mod resolv;
mod server;
mod table;
mod wire;

use std::net::SocketAddr;
use std::path::PathBuf;

pub use check::check_query;
pub use metrics::DnsMetrics;
pub use resolv::upstreams_from_resolv_conf;
pub use server::{DnsConfig, DnsServer};
pub use table::NameTable;

#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    #[error(
        "cannot bind the DNS {protocol} socket on {addr}: {source} (is another DNS server using this address? choose another with --dns-addr)"
    )]
    Bind {
        protocol: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("DNS {protocol} socket on {addr} failed: {source}")]
    Socket {
        protocol: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(
        "cannot read the resolver configuration {path}: {source} (pass --upstream-dns explicitly)"
    )]
    ResolvConf {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} has no usable `nameserver` line (pass --upstream-dns explicitly)")]
    NoNameservers { path: PathBuf },
    #[error("a DNS server task stopped unexpectedly: {0}")]
    Task(String),
}
