//! The crate's one error type: why the DNS server could not bind or keep serving, or could not
//! find its upstream resolvers.

use std::net::SocketAddr;
use std::path::PathBuf;

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
    #[error(
        "another DNS server answers on {addr} (it said {rcode} to the zone's SOA, where a Lattice agent answers it): is NodeLocal DNSCache on this address? Give the agent another one (--dns-addr, --node-local-dns)"
    )]
    Foreign { addr: SocketAddr, rcode: String },
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
