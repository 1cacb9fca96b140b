//! The DNS server's configuration: where it listens, where it forwards, and the bounds of its
//! cache, its forwards and its TCP connections.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use crate::clock::Clock;
use crate::handoff;

/// Configuration of the DNS server.
#[derive(Clone, Debug)]
pub struct DnsConfig {
    /// UDP and TCP address; port 0 picks a free port (see `DnsServer::local_addr`).
    pub listen: SocketAddr,
    /// Servers that answer every name outside the mesh zone: those that answer asked fastest
    /// first, one that does not skipped and probed now and then.
    pub upstreams: Vec<SocketAddr>,
    /// The address of `ns.system.internal`, the zone's name server (the NS and SOA name): the
    /// address pods reach this server at. `None` when listening on every address: the name then
    /// exists without an address.
    pub nameserver: Option<IpAddr>,
    /// TTL of mesh records.
    pub ttl: u32,
    /// SOA minimum: how long clients cache NXDOMAIN and NODATA for mesh names.
    pub negative_ttl: u32,
    /// How long a forwarded query waits for the upstreams before the client gets SERVFAIL, and
    /// one upstream gets to answer before it counts as down.
    pub upstream_timeout: Duration,
    /// Cache forwarded answers for their TTL.
    pub cache: bool,
    /// Forwarded records' TTLs are cut to this many seconds, so a client that follows the TTL
    /// (Envoy's DNS clusters do) looks an external name up again at least this often.
    pub max_forwarded_ttl: u32,
    /// Most forwarded answers kept in the cache.
    pub cache_entries: usize,
    /// Most bytes the cached answers take (wire size plus bookkeeping).
    pub cache_bytes: usize,
    /// Most answers one client address may have put in the cache (and the same share of
    /// `cache_bytes`); beyond it, its new answers replace its own least recently used ones.
    pub cache_entries_per_source: usize,
    /// Time as the forwarder sees it (cache ages, upstream probes); tests use a manual clock.
    pub clock: Clock,
    /// UDP sockets sharing the port (SO_REUSEPORT), each served by its own task and steered to
    /// one CPU; by default one per online CPU.
    pub udp_sockets: usize,
    /// Most forwarded queries in flight; beyond it a forwarded query gets SERVFAIL.
    pub forwards: usize,
    /// Most forwarded queries in flight from one source address.
    pub forwards_per_source: usize,
    /// SERVFAILs a second a source over `forwards_per_source` is sent over UDP; its other
    /// queries are dropped unanswered (`budget.rs` says why).
    pub refusals_per_source: u32,
    /// Most TCP connections open; beyond it the connection idle longest is closed for a new
    /// one, or the new one refused when none is idle.
    pub tcp_connections: usize,
    /// Most TCP connections open from one source address; beyond it a new one is refused.
    pub tcp_connections_per_source: usize,
    /// A TCP connection with no query for this long is closed.
    pub tcp_idle_timeout: Duration,
    /// A TCP connection open this long is closed once its queries are answered.
    pub tcp_lifetime: Duration,
    /// Most queries of one TCP connection answered at once; beyond it the server reads no
    /// more of that connection until one is answered.
    pub tcp_pipeline: usize,
}

impl DnsConfig {
    pub fn new(listen: SocketAddr, upstreams: Vec<SocketAddr>) -> Self {
        Self {
            listen,
            upstreams,
            nameserver: (!listen.ip().is_unspecified()).then_some(listen.ip()),
            ttl: 30,
            negative_ttl: 30,
            upstream_timeout: Duration::from_secs(2),
            cache: true,
            max_forwarded_ttl: 300,
            cache_entries: 10_000,
            cache_bytes: 16 << 20,
            cache_entries_per_source: 1_250,
            clock: Clock::system(),
            udp_sockets: handoff::online_cpus().len(),
            forwards: 1024,
            forwards_per_source: 128,
            refusals_per_source: 100,
            tcp_connections: 1024,
            tcp_connections_per_source: 64,
            tcp_idle_timeout: Duration::from_secs(10),
            tcp_lifetime: Duration::from_secs(120),
            tcp_pipeline: 16,
        }
    }
}
