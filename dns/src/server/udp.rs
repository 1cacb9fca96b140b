//! One UDP socket's task: queries read in batches, the fast path's replies sent in batches, the
//! rest answered by the general path or forwarded in a task of its own (within the forwarding
//! budget). Draining takes the socket out of the port's selection and answers what it queued.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::ResponseCode;
use tokio::net::UdpSocket;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{Context, forward};
use crate::batch::{self, Inbox, Outbox};
use crate::budget::Limit;
use crate::error::DnsError;
use crate::fast;
use crate::handoff;
use crate::metrics::Served;
use crate::observe::Hold;
use crate::query::{self, Outcome};
use crate::table::NameTable;
use crate::wire::Transport;

/// Datagrams handled per wake-up of a UDP task before it lets other tasks run.
const UDP_BATCH: usize = 64;

/// After a socket has left the port's selection, how long datagrams the kernel was delivering
/// at that moment may still arrive on it.
const SETTLE: Duration = Duration::from_millis(50);

/// Serves `socket` until `drain` is cancelled, then drains it.
pub(super) async fn serve(
    socket: Arc<UdpSocket>,
    context: Arc<Context>,
    mut names: watch::Receiver<Arc<NameTable>>,
    drain: CancellationToken,
) -> Result<(), DnsError> {
    let mut table = names.borrow_and_update().clone();
    let mut batches = Batches {
        inbox: Inbox::new(),
        outbox: Outbox::new(),
        forwards: JoinSet::new(),
    };
    loop {
        tokio::select! {
            biased;
            () = drain.cancelled() => break,
            ready = socket.readable() => ready.map_err(|source| DnsError::Socket { protocol: "UDP", addr: socket_addr(&socket), source })?,
        }
        if names.has_changed().unwrap_or(false) {
            table = names.borrow_and_update().clone();
        }
        batches.serve(&socket, &context, &table, UDP_BATCH);
        while batches.forwards.try_join_next().is_some() {}
    }
    // Out of the selection first, so nothing new arrives; then everything queued is answered.
    if let Err(error) = handoff::leave_udp(&socket) {
        tracing::warn!(addr = %socket_addr(&socket), %error, "cannot take a DNS socket out of the port's selection; closing it as it is");
    }
    let table = names.borrow().clone();
    while batches.serve(&socket, &context, &table, usize::MAX) > 0 {}
    tokio::time::sleep(SETTLE).await;
    while batches.serve(&socket, &context, &table, usize::MAX) > 0 {}
    while batches.forwards.join_next().await.is_some() {}
    Ok(())
}

/// A socket's buffers and the replies it sends from tasks of their own.
struct Batches {
    inbox: Inbox,
    outbox: Outbox,
    /// Forwarded queries and held answers.
    forwards: JoinSet<()>,
}

impl Batches {
    /// Answers up to about `limit` queued datagrams; returns how many were read.
    fn serve(
        &mut self,
        socket: &Arc<UdpSocket>,
        context: &Arc<Context>,
        table: &NameTable,
        limit: usize,
    ) -> usize {
        let ttl = context.zone.ttl;
        let mut read = 0;
        let mut fast_replies = 0;
        while read < limit {
            let received = match self.inbox.receive(socket) {
                Ok(received) => received,
                Err(e) => {
                    // ICMP errors from earlier sends surface here; they concern that client only.
                    tracing::debug!(error = %e, "DNS UDP receive error");
                    break;
                }
            };
            read += received;
            for i in 0..received {
                let Some((query, peer)) = self.inbox.query(i) else {
                    context.metrics.dropped();
                    continue;
                };
                if let Some((n, scope)) =
                    fast::answer(table, ttl, query, Transport::Udp, self.outbox.slot())
                {
                    fast_replies += 1;
                    match context.hold(peer, scope) {
                        None => self.outbox.push(n, peer),
                        Some(hold) => {
                            let bytes = self.outbox.slot()[..n].to_vec();
                            self.forwards
                                .spawn(send_after(hold, socket.clone(), bytes, peer));
                        }
                    }
                    continue;
                }
                answer_slowly(socket, context, table, query, peer, &mut self.forwards);
            }
            self.outbox.flush(socket);
            if received < batch::BATCH {
                break;
            }
        }
        context.metrics.fast_replies(fast_replies);
        read
    }
}

/// A query the fast path does not answer: the general path, the forwarding cache, or an
/// upstream (in a task of its own, within the forwarding budget); its reply is sent alone.
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
            let source = peer.ip().to_canonical();
            let permit = match context.forwards.try_take(source) {
                Ok(permit) => permit,
                Err(limit) if !context.forwards.answers_refusal(source, limit) => {
                    let limit = Limit::ForwardsPerSourceUnanswered;
                    context.refusals.refused(limit, source, &context.metrics);
                    return;
                }
                Err(limit) => {
                    context.refusals.refused(limit, source, &context.metrics);
                    context
                        .metrics
                        .reply(ResponseCode::ServFail, Served::Forwarded);
                    send_udp(
                        socket,
                        &query::server_failure(&request, Transport::Udp),
                        peer,
                    );
                    return;
                }
            };
            let (socket, context) = (socket.clone(), context.clone());
            forwards.spawn(async move {
                let bytes = forward(&context, &request, source, Transport::Udp).await;
                drop(permit);
                if let Err(e) = socket.send_to(&bytes, peer).await {
                    tracing::debug!(%peer, error = %e, "cannot send a forwarded DNS answer");
                }
            });
        }
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
