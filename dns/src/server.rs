//! The DNS server: UDP sockets sharing the port, each drained on its own thread through the
//! fast path (`server/udp.rs`), and TCP listeners, one per CPU, a task per connection
//! (`server/tcp.rs`); both fall back to the general path and the forwarder. The name table is
//! read from a `watch` channel, so a new mesh snapshot takes effect on the next query. Answers
//! for names with a scope are reported to the [`LookupObserver`], if any, which may hold an
//! answer back; a held answer is sent by a task of its own, so the socket goes on serving.
//! Forwarded queries and TCP connections each draw on a budget of their own (`budget.rs`).
//!
//! Its life, for a rolling upgrade without a lost query (`handoff.rs`): every socket is bound
//! with SO_REUSEPORT at [`DnsServer::bind`]; [`DnsServer::run`] opens them at once, or, when
//! another server (the agent it replaces) holds the address, only once the first name table is
//! published; cancelling `run`'s token drains it: its sockets leave the port's selection, every
//! query already received is answered, and TCP connections are closed without a reset.

mod tcp;
mod udp;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RecordType};
use lattice_contract::ZONE;
use tokio::net::UdpSocket;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::budget::{ForwardBudget, RefusalLog, TcpBudget};
use crate::config::DnsConfig;
use crate::error::DnsError;
use crate::forward::Forwarder;
use crate::handoff::{self, BoundTcp, BoundUdp};
use crate::metrics::{DnsMetrics, Served};
use crate::observe::{Hold, LookupObserver};
use crate::query::{self, ZoneSettings};
use crate::table::NameTable;
use crate::wire::Transport;

/// Each UDP socket's receive buffer: bursts from many clients queue instead of being dropped.
const UDP_RECEIVE_BUFFER: usize = 4 << 20;

/// How a TCP connection is served.
#[derive(Clone, Copy, Debug)]
struct TcpLimits {
    idle_timeout: Duration,
    lifetime: Duration,
    pipeline: usize,
}

/// State shared by every socket task.
struct Context {
    /// Told of answers for names with a scope; may hold them back.
    observer: Option<Arc<dyn LookupObserver>>,
    zone: ZoneSettings,
    forwarder: Forwarder,
    metrics: DnsMetrics,
    forwards: Arc<ForwardBudget>,
    tcp: Arc<TcpBudget>,
    tcp_limits: TcpLimits,
    refusals: RefusalLog,
}

impl Context {
    /// What an answer for a name of `scope` to `peer` must wait for, if anything.
    fn hold(&self, peer: SocketAddr, scope: Option<&Arc<str>>) -> Option<Hold> {
        let (observer, scope) = (self.observer.as_ref()?, scope?);
        observer.looked_up(peer.ip().to_canonical(), scope)
    }
}

/// Called once the server takes traffic.
type OnOpen = Box<dyn FnOnce() + Send>;

/// A bound DNS server; `run` serves until cancelled.
pub struct DnsServer {
    udp: BoundUdp,
    tcp: BoundTcp,
    local_addr: SocketAddr,
    /// Another server held the address at bind: take traffic only once the table is known.
    beside: bool,
    names: watch::Receiver<Arc<NameTable>>,
    /// Shared by the socket tasks once `run` starts them; until then the builder methods edit it.
    context: Context,
    on_open: Option<OnOpen>,
}

impl DnsServer {
    /// Binds the UDP sockets and the TCP listeners on `config.listen`. When another server
    /// holds the address already, it must be a Lattice agent (the one this one replaces):
    /// any other DNS server there is an error.
    pub async fn bind(
        config: DnsConfig,
        names: watch::Receiver<Arc<NameTable>>,
        metrics: DnsMetrics,
    ) -> Result<DnsServer, DnsError> {
        let bind_error = |protocol| {
            move |source| DnsError::Bind {
                protocol,
                addr: config.listen,
                source,
            }
        };
        let beside = handoff::udp_in_use(config.listen).map_err(bind_error("UDP"))?
            || handoff::tcp_in_use(config.listen).map_err(bind_error("TCP"))?;
        if beside {
            check_predecessor(config.listen).await?;
        }
        let cpus = handoff::online_cpus();
        // With port 0 a port free for both is picked, and another process may take it for
        // TCP before it is bound: try a few.
        let attempts = if config.listen.port() == 0 { 8 } else { 1 };
        let mut last_error = None;
        for _ in 0..attempts {
            let udp = match BoundUdp::bind(config.listen, config.udp_sockets, UDP_RECEIVE_BUFFER) {
                Ok(udp) => udp,
                Err(source) => {
                    last_error = Some(bind_error("UDP")(source));
                    continue;
                }
            };
            let local_addr = udp.local_addr();
            let tcp = match BoundTcp::bind(local_addr, &cpus) {
                Ok(tcp) => tcp,
                Err(source) => {
                    last_error = Some(DnsError::Bind {
                        protocol: "TCP",
                        addr: local_addr,
                        source,
                    });
                    continue;
                }
            };
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
                forwards: ForwardBudget::new(
                    config.forwards,
                    config.forwards_per_source,
                    config.refusals_per_source,
                    config.clock.clone(),
                ),
                tcp: TcpBudget::new(
                    config.tcp_connections,
                    config.tcp_connections_per_source,
                    metrics.clone(),
                ),
                tcp_limits: TcpLimits {
                    idle_timeout: config.tcp_idle_timeout,
                    lifetime: config.tcp_lifetime,
                    pipeline: config.tcp_pipeline.max(1),
                },
                refusals: RefusalLog::default(),
                metrics,
            };
            tracing::info!(%local_addr, upstreams = ?config.upstreams, ttl = config.ttl, cache = config.cache, udp_sockets = config.udp_sockets.max(1), beside, "DNS server bound");
            return Ok(DnsServer {
                udp,
                tcp,
                local_addr,
                beside,
                names,
                context,
                on_open: None,
            });
        }
        Err(last_error.unwrap_or(DnsError::Bind {
            protocol: "TCP",
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

    /// Calls `opened` once the server takes traffic (see [`DnsServer::run`]).
    pub fn on_open(mut self, opened: impl FnOnce() + Send + 'static) -> Self {
        self.on_open = Some(Box::new(opened));
        self
    }

    /// The bound address (UDP and TCP share the port).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves until `drain` is cancelled, then drains and returns; or returns the error that
    /// stopped a socket.
    ///
    /// It takes traffic at once, answering names of the zone SERVFAIL until the first table is
    /// published (after a crash, forwarded names work meanwhile); or, when it was bound beside
    /// another server (the agent it replaces), only once that first table is there, so it never
    /// takes a query the other could answer better. Draining: the UDP sockets leave the port's
    /// selection and every datagram queued on them is answered; the listeners stop taking
    /// connections and hand over their accept queue; every TCP connection has what it sent
    /// answered and is then closed with a FIN, never a reset.
    pub async fn run(self, drain: CancellationToken) -> Result<(), DnsError> {
        let mut names = self.names;
        if self.beside {
            tracing::info!(addr = %self.local_addr, "another DNS server (the agent this one replaces) holds the address: taking traffic once the first name table is published");
            loop {
                if names.borrow_and_update().is_settled() {
                    break;
                }
                tokio::select! {
                    changed = names.changed() => if changed.is_err() { return Ok(()) },
                    () = drain.cancelled() => return Ok(()),
                }
            }
        }
        let socket_error = |protocol| {
            let addr = self.local_addr;
            move |source| DnsError::Socket {
                protocol,
                addr,
                source,
            }
        };
        let cpus = handoff::online_cpus();
        let udp = self.udp.open(&cpus).map_err(socket_error("UDP"))?;
        let listeners = self.tcp.listen().map_err(socket_error("TCP"))?;
        tracing::info!(addr = %self.local_addr, "DNS server taking queries");
        if let Some(opened) = self.on_open {
            opened();
        }
        let context = Arc::new(self.context);
        // The UDP threads outlive an aborted task: on an error they are stopped by this token.
        let udp_drain = drain.child_token();
        let _stop_udp = udp_drain.clone().drop_guard();
        let mut tasks = JoinSet::new();
        for (k, socket) in udp.into_iter().enumerate() {
            let socket = socket.into_std().map_err(socket_error("UDP"))?;
            let (context, names, drain) = (context.clone(), names.clone(), udp_drain.clone());
            let thread = udp_thread(k, self.local_addr, socket, context, names, drain);
            tasks.spawn(thread.map_err(socket_error("UDP"))?);
        }
        tasks.spawn(tcp::serve(listeners, context, names, drain));
        while let Some(ended) = tasks.join_next().await {
            let error = match ended {
                Ok(Ok(())) => continue,
                Ok(Err(error)) => error,
                Err(error) => DnsError::Task(error.to_string()),
            };
            tasks.shutdown().await;
            return Err(error);
        }
        tracing::info!(addr = %self.local_addr, "DNS server drained");
        Ok(())
    }
}

/// Serves the `k`-th UDP socket on a thread of its own, with a single-threaded runtime of its
/// own, as Knot and NSD give each socket of a SO_REUSEPORT group a thread: a burst on one socket
/// wakes that thread alone (a task of the agent's multi-threaded runtime, woken, also wakes a
/// second worker to steal work), and no xDS or translation task queues ahead of a datagram.
/// Forwarded queries run on the socket's thread too; the TCP connections stay on the agent's
/// runtime. The future it returns ends with the thread's `serve`.
fn udp_thread(
    k: usize,
    addr: SocketAddr,
    socket: std::net::UdpSocket,
    context: Arc<Context>,
    names: watch::Receiver<Arc<NameTable>>,
    drain: CancellationToken,
) -> std::io::Result<impl std::future::Future<Output = Result<(), DnsError>> + use<>> {
    let (done, ended) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(format!("dns-udp-{k}"))
        .spawn(move || {
            let socket_error = |source| DnsError::Socket {
                protocol: "UDP",
                addr,
                source,
            };
            let served = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(socket_error)
                .and_then(|runtime| {
                    // A task, not `block_on`'s own future: the scheduler then polls it as it
                    // polls the forwards it spawns, checking the socket between them.
                    runtime.block_on(async move {
                        let socket = UdpSocket::from_std(socket).map_err(socket_error)?;
                        tokio::spawn(udp::serve(Arc::new(socket), context, names, drain))
                            .await
                            .map_err(|error| DnsError::Task(error.to_string()))?
                    })
                });
            let _ = done.send(served);
        })?;
    Ok(async move {
        ended.await.unwrap_or_else(|_| {
            Err(DnsError::Task(
                "a DNS UDP thread ended without a result (it panicked)".into(),
            ))
        })
    })
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

/// How long the server that holds the address has to say who it is.
const PREDECESSOR_TIMEOUT: Duration = Duration::from_millis(500);

/// Checks that the server holding `addr` is a Lattice agent (it answers the zone's SOA
/// authoritatively), so this one never shares the port with, say, NodeLocal DNSCache on the
/// same address. A server that does not answer (an agent draining, whose sockets have left
/// the port) is taken for the agent it is most likely to be.
async fn check_predecessor(addr: SocketAddr) -> Result<(), DnsError> {
    let target = match addr {
        SocketAddr::V4(v4) if v4.ip().is_unspecified() => {
            SocketAddr::from((Ipv4Addr::LOCALHOST, v4.port()))
        }
        SocketAddr::V6(v6) if v6.ip().is_unspecified() => {
            SocketAddr::from((Ipv6Addr::LOCALHOST, v6.port()))
        }
        other => other,
    };
    match tokio::time::timeout(PREDECESSOR_TIMEOUT, ask_zone_soa(target)).await {
        Ok(Ok(answer)) if answers_the_zone(&answer) => Ok(()),
        // An agent that has no table yet fails the zone: not proof either way.
        Ok(Ok(answer)) if answer.metadata.response_code == ResponseCode::ServFail => {
            tracing::info!(%addr, "the server holding the DNS address fails the zone (an agent starting?); serving beside it");
            Ok(())
        }
        Ok(Ok(answer)) => Err(DnsError::Foreign {
            addr,
            rcode: answer.metadata.response_code.to_string(),
        }),
        Ok(Err(error)) => {
            tracing::info!(%addr, %error, "the server holding the DNS address does not answer; serving beside it");
            Ok(())
        }
        Err(_) => {
            tracing::info!(%addr, "the server holding the DNS address does not answer; serving beside it");
            Ok(())
        }
    }
}

fn zone_apex() -> Option<Name> {
    let mut apex = Name::from_ascii(ZONE).ok()?;
    apex.set_fqdn(true);
    Some(apex)
}

async fn ask_zone_soa(target: SocketAddr) -> std::io::Result<Message> {
    let local: SocketAddr = match target.ip() {
        IpAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        IpAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = UdpSocket::bind(local).await?;
    socket.connect(target).await?;
    let mut query = Message::new(rand::random(), MessageType::Query, OpCode::Query);
    query.add_query(Query::query(
        zone_apex().ok_or_else(|| std::io::Error::other("invalid zone"))?,
        RecordType::SOA,
    ));
    socket
        .send(&query.to_vec().map_err(std::io::Error::other)?)
        .await?;
    let mut buf = vec![0; 4096];
    loop {
        let len = socket.recv(&mut buf).await?;
        if let Ok(answer) = Message::from_vec(&buf[..len])
            && answer.metadata.id == query.metadata.id
        {
            return Ok(answer);
        }
    }
}

/// An authoritative answer with the zone's SOA: what a Lattice agent says.
fn answers_the_zone(answer: &Message) -> bool {
    answer.metadata.response_code == ResponseCode::NoError
        && answer.metadata.authoritative
        && answer.answers.iter().any(|record| {
            record.record_type() == RecordType::SOA
                && zone_apex().is_some_and(|apex| record.name.eq_ignore_root(&apex))
        })
}
