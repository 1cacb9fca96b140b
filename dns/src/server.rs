//! The DNS server: SO_REUSEPORT UDP sockets, each drained by its own task through the fast path,
//! and a TCP listener; both fall back to the general path and the forwarder. The name table is
//! read from a `watch` channel, so a new mesh snapshot takes effect on the next query. Answers
//! for names with a scope are reported to the [`LookupObserver`], if any, which may hold an
//! answer back; a held UDP answer is sent by a task of its own, so the socket goes on serving.

use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::{Message, ResponseCode};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, SockaddrStorage, setsockopt, sockopt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::batch::{self, Inbox, Outbox};
use crate::clock::Clock;
use crate::error::DnsError;
use crate::fast;
use crate::forward::Forwarder;
use crate::metrics::{DnsMetrics, Served};
use crate::observe::{Hold, LookupObserver};
use crate::query::{self, Outcome, ZoneSettings};
use crate::table::NameTable;
use crate::wire::Transport;

/// Datagrams handled per wake-up of a UDP task before it lets other tasks run.
const UDP_BATCH: usize = 64;

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
    /// UDP sockets sharing the port (SO_REUSEPORT), each served by its own task.
    pub udp_sockets: usize,
    /// Most forwarded UDP queries and TCP connections in flight; beyond it queries get SERVFAIL
    /// and connections are closed.
    pub max_in_flight: usize,
    /// A TCP connection with no query for this long is closed.
    pub tcp_idle_timeout: Duration,
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
            udp_sockets: std::thread::available_parallelism().map_or(1, usize::from),
            max_in_flight: 1024,
            tcp_idle_timeout: Duration::from_secs(10),
        }
    }
}

/// State shared by every socket task.
struct Context {
    /// Told of answers for names with a scope; may hold them back.
    observer: Option<Arc<dyn LookupObserver>>,
    zone: ZoneSettings,
    forwarder: Forwarder,
    metrics: DnsMetrics,
    in_flight: Arc<Semaphore>,
    tcp_idle_timeout: Duration,
}

/// A bound DNS server; `run` serves until cancelled.
pub struct DnsServer {
    udp: Vec<UdpSocket>,
    tcp: TcpListener,
    local_addr: SocketAddr,
    names: watch::Receiver<Arc<NameTable>>,
    /// Shared by the socket tasks once `run` starts them; until then the builder methods edit it.
    context: Context,
}

impl DnsServer {
    /// Binds the UDP sockets and the TCP listener on `config.listen`.
    pub async fn bind(
        config: DnsConfig,
        names: watch::Receiver<Arc<NameTable>>,
        metrics: DnsMetrics,
    ) -> Result<DnsServer, DnsError> {
        // With port 0 the kernel picks the UDP port; TCP may find it taken, so try a few.
        let attempts = if config.listen.port() == 0 { 8 } else { 1 };
        let mut last_error = None;
        for _ in 0..attempts {
            match bind_sockets(config.listen, config.udp_sockets.max(1)) {
                Ok((udp, tcp, local_addr)) => {
                    if config.upstreams.is_empty() {
                        tracing::warn!(%local_addr, "DNS server has no upstreams: names outside the mesh get SERVFAIL");
                    }
                    let context = Context {
                        observer: None,
                        zone: ZoneSettings {
                            ttl: config.ttl,
                            negative_ttl: config.negative_ttl,
                            nameserver: config.nameserver,
                        },
                        forwarder: Forwarder::new(&config, metrics.clone()),
                        metrics,
                        in_flight: Arc::new(Semaphore::new(config.max_in_flight.max(1))),
                        tcp_idle_timeout: config.tcp_idle_timeout,
                    };
                    tracing::info!(%local_addr, upstreams = ?config.upstreams, ttl = config.ttl, cache = config.cache, udp_sockets = udp.len(), "DNS server bound");
                    return Ok(DnsServer {
                        udp,
                        tcp,
                        local_addr,
                        names,
                        context,
                    });
                }
                Err(error) => last_error = Some(error),
            }
        }
        Err(last_error.unwrap_or(DnsError::Bind {
            protocol: "UDP",
            addr: config.listen,
            source: std::io::ErrorKind::AddrInUse.into(),
        }))
    }

    /// Tells `observer` of every answer for a name with a scope, and lets it hold answers
    /// back ([`LookupObserver`]). Without one, nothing is reported or held.
    pub fn with_observer(mut self, observer: Arc<dyn LookupObserver>) -> Self {
        self.context.observer = Some(observer);
        self
    }

    /// The bound address (UDP and TCP share the port).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves until `shutdown` is cancelled, or returns the error that stopped a socket.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), DnsError> {
        let context = Arc::new(self.context);
        let mut tasks = JoinSet::new();
        for socket in self.udp {
            tasks.spawn(serve_udp(
                Arc::new(socket),
                context.clone(),
                self.names.clone(),
                shutdown.clone(),
            ));
        }
        tasks.spawn(serve_tcp(
            self.tcp,
            context,
            self.names.clone(),
            shutdown.clone(),
        ));
        let result = tokio::select! {
            () = shutdown.cancelled() => Ok(()),
            Some(ended) = tasks.join_next() => match ended {
                Ok(result) => result,
                Err(error) => Err(DnsError::Task(error.to_string())),
            },
        };
        tasks.shutdown().await;
        result
    }
}

fn bind_sockets(
    listen: SocketAddr,
    udp_sockets: usize,
) -> Result<(Vec<UdpSocket>, TcpListener, SocketAddr), DnsError> {
    let first = reuseport_udp(listen)?;
    let local_addr = first.local_addr().map_err(|source| DnsError::Bind {
        protocol: "UDP",
        addr: listen,
        source,
    })?;
    let mut udp = vec![first];
    for _ in 1..udp_sockets {
        udp.push(reuseport_udp(local_addr)?);
    }
    let bind_error = |source| DnsError::Bind {
        protocol: "TCP",
        addr: local_addr,
        source,
    };
    let tcp = std::net::TcpListener::bind(local_addr).map_err(bind_error)?;
    tcp.set_nonblocking(true).map_err(bind_error)?;
    let tcp = TcpListener::from_std(tcp).map_err(bind_error)?;
    Ok((udp, tcp, local_addr))
}

/// A non-blocking UDP socket with SO_REUSEPORT, so several sockets share `addr` and the kernel
/// spreads datagrams across them.
fn reuseport_udp(addr: SocketAddr) -> Result<UdpSocket, DnsError> {
    let error = |source: std::io::Error| DnsError::Bind {
        protocol: "UDP",
        addr,
        source,
    };
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = nix::sys::socket::socket(
        family,
        SockType::Datagram,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| error(e.into()))?;
    setsockopt(&fd, sockopt::ReusePort, &true).map_err(|e| error(e.into()))?;
    // Bursts from many clients queue here instead of being dropped; a failure only costs capacity.
    if let Err(e) = setsockopt(&fd, sockopt::RcvBuf, &(4 << 20)) {
        tracing::debug!(%addr, error = %e, "cannot enlarge the DNS socket's receive buffer");
    }
    nix::sys::socket::bind(fd.as_raw_fd(), &SockaddrStorage::from(addr))
        .map_err(|e| error(e.into()))?;
    UdpSocket::from_std(std::net::UdpSocket::from(fd)).map_err(error)
}

async fn serve_udp(
    socket: Arc<UdpSocket>,
    context: Arc<Context>,
    mut names: watch::Receiver<Arc<NameTable>>,
    shutdown: CancellationToken,
) -> Result<(), DnsError> {
    let mut table = names.borrow_and_update().clone();
    let (mut inbox, mut outbox) = (Inbox::new(), Outbox::new());
    let mut forwards = JoinSet::new();
    let ttl = context.zone.ttl;
    loop {
        tokio::select! {
            biased;
            () = shutdown.cancelled() => return Ok(()),
            ready = socket.readable() => ready.map_err(|source| DnsError::Socket { protocol: "UDP", addr: socket_addr(&socket), source })?,
        }
        let mut fast_replies = 0;
        for _ in 0..UDP_BATCH / batch::BATCH {
            let received = match inbox.receive(&socket) {
                Ok(received) => received,
                Err(e) => {
                    // ICMP errors from earlier sends surface here; they concern that client only.
                    tracing::debug!(error = %e, "DNS UDP receive error");
                    break;
                }
            };
            if received == 0 {
                break;
            }
            if names.has_changed().unwrap_or(false) {
                table = names.borrow_and_update().clone();
            }
            for i in 0..received {
                let Some((query, peer)) = inbox.query(i) else {
                    context.metrics.dropped();
                    continue;
                };
                if let Some((n, scope)) =
                    fast::answer(&table, ttl, query, Transport::Udp, outbox.slot())
                {
                    fast_replies += 1;
                    match context.hold(peer, scope) {
                        None => outbox.push(n, peer),
                        Some(hold) => {
                            let (socket, bytes) = (socket.clone(), outbox.slot()[..n].to_vec());
                            forwards.spawn(send_after(hold, socket, bytes, peer));
                        }
                    }
                    continue;
                }
                answer_slowly(&socket, &context, &table, query, peer, &mut forwards);
            }
            outbox.flush(&socket);
            if received < batch::BATCH {
                break;
            }
        }
        context.metrics.fast_replies(fast_replies);
        while forwards.try_join_next().is_some() {}
    }
}

/// A query the fast path does not answer: the general path, the forwarding cache, or an
/// upstream (in a task of its own); its reply is sent alone.
fn answer_slowly(
    socket: &Arc<UdpSocket>,
    context: &Arc<Context>,
    table: &NameTable,
    query: &[u8],
    peer: SocketAddr,
    forwards: &mut JoinSet<()>,
) {
    match query::handle(table, context.zone, query, Transport::Udp) {
        Outcome::Reply {
            bytes,
            rcode,
            scope,
        } => {
            context.metrics.reply(rcode, Served::Local);
            match context.hold(peer, scope.as_ref()) {
                None => send_udp(socket, &bytes, peer),
                Some(hold) => {
                    forwards.spawn(send_after(hold, socket.clone(), bytes, peer));
                }
            }
        }
        Outcome::Drop => context.metrics.dropped(),
        Outcome::Forward(request) => {
            if let Some(hit) = context.forwarder.cached(&request, Transport::Udp) {
                context.metrics.reply(hit.rcode, hit.served);
                send_udp(socket, &hit.bytes, peer);
                return;
            }
            let Ok(permit) = context.in_flight.clone().try_acquire_owned() else {
                context
                    .metrics
                    .reply(ResponseCode::ServFail, Served::Forwarded);
                send_udp(
                    socket,
                    &query::server_failure(&request, Transport::Udp),
                    peer,
                );
                return;
            };
            let (socket, context) = (socket.clone(), context.clone());
            forwards.spawn(async move {
                let bytes = forward(&context, &request, peer.ip(), Transport::Udp).await;
                drop(permit);
                if let Err(e) = socket.send_to(&bytes, peer).await {
                    tracing::debug!(%peer, error = %e, "cannot send a forwarded DNS answer");
                }
            });
        }
    }
}

impl Context {
    /// What an answer for a name of `scope` to `peer` must wait for, if anything.
    fn hold(&self, peer: SocketAddr, scope: Option<&Arc<str>>) -> Option<Hold> {
        let (observer, scope) = (self.observer.as_ref()?, scope?);
        observer.looked_up(peer.ip().to_canonical(), scope)
    }
}

/// Sends a held answer once its hold ends; the socket task goes on meanwhile.
async fn send_after(hold: Hold, socket: Arc<UdpSocket>, bytes: Vec<u8>, peer: SocketAddr) {
    hold.await;
    if let Err(e) = socket.send_to(&bytes, peer).await {
        tracing::debug!(%peer, error = %e, "cannot send a held DNS answer");
    }
}

/// UDP replies are best effort: a full socket buffer drops the reply and the client retries.
fn send_udp(socket: &UdpSocket, bytes: &[u8], peer: SocketAddr) {
    if let Err(e) = socket.try_send_to(bytes, peer) {
        tracing::debug!(%peer, error = %e, "cannot send a DNS reply");
    }
}

fn socket_addr(socket: &UdpSocket) -> SocketAddr {
    socket
        .local_addr()
        .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)))
}

/// The client's answer to a query that is not the zone's: from the cache or an upstream, or
/// SERVFAIL.
async fn forward(
    context: &Context,
    request: &Message,
    client: IpAddr,
    transport: Transport,
) -> Vec<u8> {
    match context.forwarder.resolve(request, client, transport).await {
        Some(relayed) => {
            context.metrics.reply(relayed.rcode, relayed.served);
            relayed.bytes
        }
        None => {
            context
                .metrics
                .reply(ResponseCode::ServFail, Served::Forwarded);
            query::server_failure(request, transport)
        }
    }
}

async fn serve_tcp(
    listener: TcpListener,
    context: Arc<Context>,
    names: watch::Receiver<Arc<NameTable>>,
    shutdown: CancellationToken,
) -> Result<(), DnsError> {
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            accepted = listener.accept() => accepted,
        };
        while connections.try_join_next().is_some() {}
        match accepted {
            Ok((stream, peer)) => {
                let Ok(permit) = context.in_flight.clone().try_acquire_owned() else {
                    tracing::debug!(%peer, "too many DNS requests in flight; closing TCP connection");
                    continue;
                };
                let (context, names) = (context.clone(), names.clone());
                connections.spawn(async move {
                    if let Err(e) = serve_tcp_connection(stream, peer, &context, names).await {
                        tracing::debug!(%peer, error = %e, "DNS TCP connection ended");
                    }
                    drop(permit);
                });
            }
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "DNS TCP accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn serve_tcp_connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    context: &Context,
    names: watch::Receiver<Arc<NameTable>>,
) -> std::io::Result<()> {
    let mut out = vec![0u8; usize::from(u16::MAX)];
    loop {
        let Ok(len) = tokio::time::timeout(context.tcp_idle_timeout, stream.read_u16()).await
        else {
            return Ok(());
        };
        let len = match len {
            Ok(len) => usize::from(len),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        let mut query = vec![0; len];
        tokio::time::timeout(context.tcp_idle_timeout, stream.read_exact(&mut query))
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
        let table = names.borrow().clone();
        let (reply, hold) = if let Some((n, scope)) =
            fast::answer(&table, context.zone.ttl, &query, Transport::Tcp, &mut out)
        {
            context.metrics.fast_replies(1);
            (out[..n].to_vec(), context.hold(peer, scope))
        } else {
            match query::handle(&table, context.zone, &query, Transport::Tcp) {
                Outcome::Reply {
                    bytes,
                    rcode,
                    scope,
                } => {
                    context.metrics.reply(rcode, Served::Local);
                    (bytes, context.hold(peer, scope.as_ref()))
                }
                Outcome::Forward(request) => (
                    forward(context, &request, peer.ip(), Transport::Tcp).await,
                    None,
                ),
                Outcome::Drop => {
                    context.metrics.dropped();
                    return Ok(());
                }
            }
        };
        if let Some(hold) = hold {
            hold.await;
        }
        let Ok(reply_len) = u16::try_from(reply.len()) else {
            return Ok(());
        };
        let mut framed = Vec::with_capacity(reply.len() + 2);
        framed.extend_from_slice(&reply_len.to_be_bytes());
        framed.extend_from_slice(&reply);
        stream.write_all(&framed).await?;
    }
}
