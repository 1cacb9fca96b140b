//! DNS over TCP (RFC 7766): connections admitted within the TCP budget, each served by a task
//! of its own that answers pipelined queries concurrently (answers go out as they are ready,
//! matched by their id, as §6.2.1.1 allows), up to a pipeline limit past which it reads no more
//! until an answer goes out. A connection is closed when idle, when it has lived its lifetime,
//! when its slot is given to a new one, or when the server drains; always the same way, so a
//! client never sees a reset: every query already received is answered, then the server shuts
//! its side (FIN) and reads, discarding, until the client closes too. A query that crosses that
//! FIN goes unanswered, and the client retries it on a new connection (§6.2.4).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use hickory_proto::op::ResponseCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Context, forward};
use crate::budget::TcpSlot;
use crate::error::DnsError;
use crate::fast;
use crate::handoff::{self, Listeners};
use crate::metrics::Served;
use crate::query::{self, Outcome};
use crate::table::NameTable;
use crate::wire::Transport;

/// The largest query taken: a question and an OPT record are far below it (the UDP path keeps
/// the same bound). A longer message closes the connection.
const QUERY_MAX: usize = 4096;

/// Bytes read from the socket at a time.
const READ_CHUNK: usize = 4096;

/// Room for a fast-path answer (a mesh name's A records); a longer one takes the general path.
const FAST_ANSWER_MAX: usize = 2048;

/// Room made for a read when the buffer is full: a query and then some. A connection that
/// waits holds no more than this.
const FIRST_READ: usize = 512;

/// How long a closing connection waits for its client to close its side, reading and
/// discarding: past it the socket is closed whatever the client does.
const LINGER: Duration = Duration::from_secs(2);

/// A connection accepted while draining waits this long for its first query, which its
/// client is about to send.
const FIRST_QUERY_WAIT: Duration = Duration::from_millis(500);

/// Refused connections waiting for their client to close; beyond it a refused connection is
/// closed at once.
const LINGERING_REFUSALS: usize = 256;

/// Accepts on `listeners` until `drain` is cancelled; then takes what their accept queues hold
/// (`handoff::incoming`), closes them, and waits for every connection to close.
pub(super) async fn serve(
    listeners: Listeners,
    context: Arc<Context>,
    names: watch::Receiver<Arc<NameTable>>,
    drain: CancellationToken,
) -> Result<(), DnsError> {
    let mut connections = JoinSet::new();
    let refusals = Arc::new(Semaphore::new(LINGERING_REFUSALS));
    let incoming = handoff::incoming(listeners, drain.clone());
    tokio::pin!(incoming);
    loop {
        tokio::select! {
            accepted = incoming.next() => match accepted {
                Some(Ok((stream, peer))) => {
                    admit(stream, peer, &context, &names, &drain, &refusals, &mut connections);
                }
                Some(Err(e)) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "DNS TCP accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                None => break,
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    while connections.join_next().await.is_some() {}
    Ok(())
}

fn admit(
    stream: TcpStream,
    peer: SocketAddr,
    context: &Arc<Context>,
    names: &watch::Receiver<Arc<NameTable>>,
    drain: &CancellationToken,
    refusals: &Arc<Semaphore>,
    connections: &mut JoinSet<()>,
) {
    let source = peer.ip().to_canonical();
    match context.tcp.admit(source) {
        Ok(slot) => {
            let connection = Connection {
                stream,
                peer,
                source,
                context: context.clone(),
                names: names.clone(),
                slot,
                buffer: Vec::new(),
                pending: JoinSet::new(),
                out: Vec::new(),
                queries: 0,
                idle: false,
            };
            connections.spawn(connection.serve(drain.clone()));
        }
        Err(limit) => {
            context.refusals.refused(limit, source, &context.metrics);
            if let Ok(permit) = refusals.clone().try_acquire_owned() {
                connections.spawn(async move {
                    refuse(stream).await;
                    drop(permit);
                });
            }
        }
    }
}

/// Closes a connection over budget without a reset where the client allows it: shuts its side
/// at once, and reads whatever the client sent until it closes too.
async fn refuse(mut stream: TcpStream) {
    if stream.shutdown().await.is_err() {
        return;
    }
    linger(&mut stream).await;
}

/// Reads and discards until the client closes, or [`LINGER`] passes: a socket closed with
/// unread data sends a reset, so whatever the client sent after the server's FIN is read first.
async fn linger(stream: &mut TcpStream) {
    let mut sink = [0u8; READ_CHUNK];
    let _ = tokio::time::timeout(LINGER, async {
        while let Ok(n) = stream.read(&mut sink).await {
            if n == 0 {
                return;
            }
        }
    })
    .await;
}

/// Why a connection closes: the `reason` label of `lattice_dns_tcp_closed_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Close {
    /// The client closed its side.
    Client,
    Idle,
    Lifetime,
    Evicted,
    Drain,
    /// A message too long for a query: the framing cannot be trusted past it.
    Oversized,
    /// The client did not take its answers in time.
    Stalled,
    /// The socket failed.
    Failed,
}

impl Close {
    fn label(self) -> &'static str {
        match self {
            Close::Client => "client",
            Close::Idle => "idle",
            Close::Lifetime => "lifetime",
            Close::Evicted => "evicted",
            Close::Drain => "drain",
            Close::Oversized => "oversized",
            Close::Stalled => "stalled",
            Close::Failed => "failed",
        }
    }
}

struct Connection {
    stream: TcpStream,
    peer: SocketAddr,
    source: IpAddr,
    context: Arc<Context>,
    names: watch::Receiver<Arc<NameTable>>,
    slot: TcpSlot,
    /// Read and not yet taken as queries: at most one partial message and one read's worth.
    buffer: Vec<u8>,
    /// Answers under way (forwarded queries, held answers), written as each is ready.
    pending: JoinSet<Vec<u8>>,
    /// Fast-path answers are written here after two bytes for their length (made on the first).
    out: Vec<u8>,
    /// Queries taken so far.
    queries: u64,
    /// Whether the budget was told this connection is idle.
    idle: bool,
}

impl Connection {
    async fn serve(mut self, drain: CancellationToken) {
        let limits = self.context.tcp_limits;
        let lifetime = tokio::time::sleep(limits.lifetime);
        tokio::pin!(lifetime);
        let mut idle_deadline = Instant::now() + limits.idle_timeout;
        let reason = loop {
            match self.take_queries(limits.pipeline).await {
                Ok(true) => idle_deadline = Instant::now() + limits.idle_timeout,
                Ok(false) => {}
                Err(reason) => break reason,
            }
            let idle = self.pending.is_empty() && self.buffer.is_empty();
            if idle && self.buffer.capacity() > READ_CHUNK {
                // A burst's buffer is not kept by a connection that waits.
                self.buffer = Vec::new();
            }
            self.mark_idle(idle);
            if self.buffer.capacity() == self.buffer.len() {
                self.buffer.reserve(FIRST_READ);
            }
            tokio::select! {
                biased;
                () = drain.cancelled() => break Close::Drain,
                () = self.slot.evicted() => break Close::Evicted,
                Some(done) = self.pending.join_next(), if !self.pending.is_empty() => {
                    let Ok(answer) = done else { continue };
                    if let Err(reason) = self.write(&answer).await {
                        break reason;
                    }
                    idle_deadline = Instant::now() + limits.idle_timeout;
                }
                read = self.stream.read_buf(&mut self.buffer), if self.pending.len() < limits.pipeline => match read {
                    Ok(0) => break Close::Client,
                    Ok(_) => self.mark_idle(false),
                    Err(_) => break Close::Failed,
                },
                () = tokio::time::sleep_until(idle_deadline), if self.pending.is_empty() => break Close::Idle,
                () = &mut lifetime => break Close::Lifetime,
            }
        };
        self.close(reason).await;
    }

    fn mark_idle(&mut self, idle: bool) {
        if idle != self.idle {
            self.idle = idle;
            if idle {
                self.slot.idle();
            } else {
                self.slot.busy();
            }
        }
    }

    /// Takes every whole query in the buffer while fewer than `pipeline` answers are under way;
    /// true if it took any.
    async fn take_queries(&mut self, pipeline: usize) -> Result<bool, Close> {
        let mut took = false;
        while self.pending.len() < pipeline {
            let Some(&[high, low]) = self.buffer.get(..2) else {
                break;
            };
            let len = usize::from(u16::from_be_bytes([high, low]));
            if len > QUERY_MAX {
                return Err(Close::Oversized);
            }
            if self.buffer.len() < 2 + len {
                break;
            }
            let query: Vec<u8> = self.buffer.drain(..2 + len).skip(2).collect();
            self.queries += 1;
            took = true;
            self.answer(&query).await?;
        }
        Ok(took)
    }

    /// Answers `query` now (the zone, the cache, SERVFAIL over budget) or starts its answer
    /// (an upstream, a held answer).
    async fn answer(&mut self, query: &[u8]) -> Result<(), Close> {
        let context = self.context.clone();
        let table = self.names.borrow().clone();
        if self.out.is_empty() {
            self.out = vec![0; 2 + FAST_ANSWER_MAX];
        }
        if let Some((n, scope)) = fast::answer(
            &table,
            context.zone.ttl,
            query,
            Transport::Tcp,
            &mut self.out[2..],
        ) {
            context.metrics.fast_replies(1);
            match context.hold(self.peer, scope) {
                None => return self.write_fast(n).await,
                Some(hold) => {
                    let answer = self.out[2..2 + n].to_vec();
                    self.pending.spawn(async move {
                        hold.await;
                        answer
                    });
                    return Ok(());
                }
            }
        }
        match query::handle(&table, context.zone, query, Transport::Tcp) {
            Outcome::Reply {
                bytes,
                rcode,
                scope,
            } => {
                context.metrics.reply(rcode, Served::Local);
                match context.hold(self.peer, scope.as_ref()) {
                    None => self.write(&bytes).await,
                    Some(hold) => {
                        self.pending.spawn(async move {
                            hold.await;
                            bytes
                        });
                        Ok(())
                    }
                }
            }
            Outcome::Forward(request) => {
                if let Some(hit) = context.forwarder.cached(&request, Transport::Tcp) {
                    context.metrics.reply(hit.rcode, hit.served);
                    return self.write(&hit.bytes).await;
                }
                let source = self.source;
                match context.forwards.try_take(source) {
                    Ok(permit) => {
                        self.pending.spawn(async move {
                            let answer = forward(&context, &request, source, Transport::Tcp).await;
                            drop(permit);
                            answer
                        });
                        Ok(())
                    }
                    Err(limit) => {
                        context
                            .refusals
                            .refused(limit, self.source, &context.metrics);
                        context
                            .metrics
                            .reply(ResponseCode::ServFail, Served::Forwarded);
                        self.write(&query::server_failure(&request, Transport::Tcp))
                            .await
                    }
                }
            }
            // A response or a runt: nothing to answer; the connection goes on.
            Outcome::Drop => {
                context.metrics.dropped();
                Ok(())
            }
        }
    }

    /// Writes the fast-path answer of `len` bytes in `out`, framed.
    async fn write_fast(&mut self, len: usize) -> Result<(), Close> {
        let Ok(framed_len) = u16::try_from(len) else {
            return Ok(());
        };
        self.out[..2].copy_from_slice(&framed_len.to_be_bytes());
        let idle_timeout = self.context.tcp_limits.idle_timeout;
        match tokio::time::timeout(idle_timeout, self.stream.write_all(&self.out[..2 + len])).await
        {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(Close::Failed),
            Err(_) => Err(Close::Stalled),
        }
    }

    /// Writes `answer`, framed; an answer too long for TCP's framing is dropped.
    async fn write(&mut self, answer: &[u8]) -> Result<(), Close> {
        let Ok(len) = u16::try_from(answer.len()) else {
            return Ok(());
        };
        let mut framed = Vec::with_capacity(answer.len() + 2);
        framed.extend_from_slice(&len.to_be_bytes());
        framed.extend_from_slice(answer);
        let idle_timeout = self.context.tcp_limits.idle_timeout;
        match tokio::time::timeout(idle_timeout, self.stream.write_all(&framed)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(Close::Failed),
            Err(_) => Err(Close::Stalled),
        }
    }

    /// Closes the connection for `reason` without a reset: answers every query already
    /// received, shuts the server's side, then reads until the client closes too.
    async fn close(mut self, reason: Close) {
        self.context.metrics.tcp_closed(reason.label());
        if matches!(reason, Close::Stalled | Close::Failed) {
            // The client is not reading, or the socket is gone: nothing can be answered.
            return;
        }
        if reason != Close::Oversized && self.finish(reason).await.is_err() {
            return;
        }
        if self.stream.shutdown().await.is_err() {
            return;
        }
        linger(&mut self.stream).await;
    }

    /// Answers what the client sent before the server closes: what is in the socket now (and,
    /// for a connection that has sent nothing yet while draining, its first query), then
    /// every answer under way.
    async fn finish(&mut self, reason: Close) -> Result<(), Close> {
        if reason != Close::Client {
            self.read_available()?;
            if reason == Close::Drain && self.queries == 0 && !self.has_whole_query() {
                let _ = tokio::time::timeout(FIRST_QUERY_WAIT, self.read_first_query()).await;
            }
        }
        let pipeline = self.context.tcp_limits.pipeline;
        loop {
            match self.take_queries(pipeline).await {
                Ok(_) => {}
                // Framing lost: what came before is answered, the rest cannot be.
                Err(Close::Oversized) => self.buffer.clear(),
                Err(other) => return Err(other),
            }
            match self.pending.join_next().await {
                Some(Ok(answer)) => self.write(&answer).await?,
                Some(Err(_)) => {}
                None if self.has_whole_query() => {}
                None => return Ok(()),
            }
        }
    }

    /// Reads what the socket holds now, without waiting.
    fn read_available(&mut self) -> Result<(), Close> {
        let mut chunk = [0u8; READ_CHUNK];
        loop {
            match self.stream.try_read(&mut chunk) {
                Ok(0) => return Ok(()),
                Ok(n) => self.buffer.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(_) => return Err(Close::Failed),
            }
            // A client that keeps sending is answered up to here; the rest crosses the FIN.
            if self.buffer.len() > QUERY_MAX * 4 {
                return Ok(());
            }
        }
    }

    async fn read_first_query(&mut self) {
        let mut chunk = [0u8; READ_CHUNK];
        while !self.has_whole_query() && self.buffer.len() <= QUERY_MAX + 2 {
            match self.stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => self.buffer.extend_from_slice(&chunk[..n]),
            }
        }
    }

    fn has_whole_query(&self) -> bool {
        match self.buffer.get(..2) {
            Some(&[high, low]) => {
                self.buffer.len() >= 2 + usize::from(u16::from_be_bytes([high, low]))
            }
            _ => false,
        }
    }
}
