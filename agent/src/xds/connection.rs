//! The xDS server's connections: accepted, capped per peer address and in all, read through a
//! buffer, served over HTTP/2 by hyper with keep-alive, and drained on shutdown.
//!
//! - **Caps.** A connection over a cap ([`super::admission`]) is never served: the agent
//!   answers each stream it opens with `RESOURCE_EXHAUSTED` and the cap, reading none of their
//!   bodies, and tells it to go away (GOAWAY) once its first stream came (or a quarter of a
//!   second passed). At most [`REFUSING`] connections are being refused at once, each for at
//!   most [`REFUSAL_GRACE`]; past that they are closed without a word.
//! - **HTTP/2.** hyper's server, with the limits of [`XdsLimits`]: streams per connection,
//!   header list and frame sizes, and the bytes h2 queues per stream for a client that does
//!   not read (`max_send_buf_size`). A PING goes out after a quiet interval, and a peer that
//!   does not answer within the timeout is closed (a pod whose network namespace vanished
//!   without a FIN, a client that stopped reading); TCP keep-alive backs it up.
//! - **Read-ahead.** h2 reads its socket into a buffer sized to the frame it is reading, about
//!   8 KiB at a time: a SotW endpoint ACK of 400 KB (10k names at 10k services) took about
//!   fifty `recv` calls, and at 50 SotW proxies a change cost the agent 2400 of them (`strace
//!   -c` on the agent during the change phase: 95,870 `recvfrom` in 3 s, the most frequent
//!   call by far). Each connection reads through a 64 KiB buffer, so one call takes what the
//!   socket holds, up to 64 KiB: one copy more in user space, far fewer calls into the kernel.
//!   The buffer is taken only once the socket is readable and given back once the socket has
//!   nothing more and h2 has taken what it holds: a connection that sends nothing holds none
//!   (a thousand idle or hostile connections held 64 MiB of them), and one that keeps sending
//!   reuses its buffer.
//! - **Shutdown.** The listener closes, every connection is told to go away (GOAWAY) while its
//!   streams end with `UNAVAILABLE` (the stream tasks watch the same token), and whatever has
//!   not ended at the drain deadline is closed.

use std::io;
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::server::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::Status;
use tonic::codegen::http;

use super::admission::{Over, Slot};
use super::grpc::{AdsBody, AdsService};
use super::limits::{CONNECTION_WINDOW, STREAM_WINDOW, XdsLimits};

/// Connections being refused at once; more are closed without a word.
pub const REFUSING: usize = 64;
/// How long a refused connection is given to send its streams and read their refusal.
pub const REFUSAL_GRACE: Duration = Duration::from_secs(1);
/// Streams a refused connection may open at once (each answered at once).
const REFUSED_STREAMS: u32 = 4;
/// How long a refused connection's first request is waited for before the GOAWAY.
const FIRST_REQUEST: Duration = Duration::from_millis(250);
/// TCP keep-alive probes, once the idle time is up: one every 10 s, three unanswered close
/// the connection.
const TCP_PROBE_INTERVAL: Duration = Duration::from_secs(10);
const TCP_PROBES: u32 = 3;

/// Serves ADS on every connection `accepted` yields (the agent's listeners through
/// `lattice_dns::handoff::incoming`, which ends once draining has taken their accept queues),
/// then waits for the connections, each of which drains on `shutdown` by its own deadline. A
/// connection that comes out of a queue after `shutdown` is told to go away at once, so its
/// proxy reconnects to the agent that took over the address.
pub async fn serve(
    accepted: impl Stream<Item = io::Result<(TcpStream, SocketAddr)>>,
    ads: AdsService,
    shutdown: CancellationToken,
) -> io::Result<()> {
    let limits = ads.server().limits().clone();
    let builder = Arc::new(http2_builder(&limits));
    let refusing = Arc::new(Semaphore::new(REFUSING));
    let mut connections = JoinSet::new();
    {
        let mut incoming = pin!(accepted);
        loop {
            tokio::select! {
                accepted = incoming.next() => match accepted {
                    Some(Ok((stream, peer))) => match tune(&stream, &limits) {
                        Ok(()) => accept(stream, peer, &ads, &builder, &refusing, &mut connections, &shutdown),
                        // The peer went away between accept and here.
                        Err(error) => tracing::debug!(%error, "xDS connection lost before it was served"),
                    },
                    // Out of file descriptors, or a connection reset before it was accepted:
                    // the next one may do.
                    Some(Err(error)) => {
                        tracing::debug!(%error, "xDS accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    None => break,
                },
                Some(_) = connections.join_next() => {}
            }
        }
    }
    while connections.join_next().await.is_some() {}
    Ok(())
}

/// Without Nagle's delay (a small push, one endpoint change, would otherwise wait for the
/// proxy's delayed ACK of the previous segment, tens of milliseconds), and with TCP keep-alive
/// under HTTP/2's PINGs: a peer whose network namespace vanished without a FIN is closed even
/// when it stopped answering in the middle of a write.
fn tune(stream: &TcpStream, limits: &XdsLimits) -> io::Result<()> {
    use nix::sys::socket::{setsockopt, sockopt};
    stream.set_nodelay(true)?;
    let secs = |d: Duration| u32::try_from(d.as_secs().max(1)).unwrap_or(u32::MAX);
    setsockopt(stream, sockopt::KeepAlive, &true)?;
    setsockopt(stream, sockopt::TcpKeepIdle, &secs(limits.tcp_keepalive))?;
    setsockopt(
        stream,
        sockopt::TcpKeepInterval,
        &secs(TCP_PROBE_INTERVAL.min(limits.tcp_keepalive)),
    )?;
    setsockopt(stream, sockopt::TcpKeepCount, &TCP_PROBES)?;
    Ok(())
}

fn http2_builder(limits: &XdsLimits) -> http2::Builder<TokioExecutor> {
    let mut builder = http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_concurrent_streams(limits.streams_per_connection)
        .max_send_buf_size(limits.send_buffer)
        .max_header_list_size(limits.max_header_list)
        .max_frame_size(limits.max_frame)
        .keep_alive_interval(limits.keepalive_interval)
        .keep_alive_timeout(limits.keepalive_timeout);
    builder
}

fn accept(
    stream: TcpStream,
    peer: SocketAddr,
    ads: &AdsService,
    builder: &Arc<http2::Builder<TokioExecutor>>,
    refusing: &Arc<Semaphore>,
    connections: &mut JoinSet<()>,
    shutdown: &CancellationToken,
) {
    let server = ads.server();
    match server.admission().connection(peer.ip()) {
        Ok(slot) => {
            server.metrics().connection_opened();
            let serving = serve_connection(
                stream,
                peer,
                slot,
                ads.clone(),
                builder.clone(),
                shutdown.clone(),
            );
            connections.spawn(serving);
        }
        Err(over) => {
            server.refused_connection(peer, &over);
            // Refusing holds a little (h2's buffers) for a little while; past the bound, the
            // socket closes unanswered.
            if let Ok(permit) = refusing.clone().try_acquire_owned() {
                tokio::spawn(async move {
                    refuse(stream, over).await;
                    drop(permit);
                });
            }
        }
    }
}

/// Answers every stream of a connection over a cap with `RESOURCE_EXHAUSTED` and why, and
/// tells it to go away (GOAWAY). A client sends its first request as soon as it has
/// connected; told to go away before it did, it would see a transport error instead of the
/// reason, so the GOAWAY waits for that first request, or [`FIRST_REQUEST`].
async fn refuse(stream: TcpStream, over: Over) {
    let refusal = || Status::resource_exhausted(over.to_string()).into_http::<()>();
    let answer = async {
        let mut connection = h2::server::Builder::new()
            .max_concurrent_streams(REFUSED_STREAMS)
            .handshake::<_, Bytes>(stream)
            .await?;
        if let Ok(Some(request)) = tokio::time::timeout(FIRST_REQUEST, connection.accept()).await {
            let (_, mut respond) = request?;
            // A stream the client reset meanwhile needs no answer.
            let _ = respond.send_response(refusal(), true);
        }
        connection.graceful_shutdown();
        while let Some(request) = connection.accept().await {
            let (_, mut respond) = request?;
            let _ = respond.send_response(refusal(), true);
        }
        Ok::<(), h2::Error>(())
    };
    if let Ok(Err(error)) = tokio::time::timeout(REFUSAL_GRACE, answer).await {
        tracing::debug!(%error, reason = over.reason(), "refusing an xDS connection");
    }
}

/// How a connection ended, for `lattice_xds_closed_connections_total`.
fn ended(outcome: &Result<(), hyper::Error>) -> &'static str {
    let error = match outcome {
        Ok(()) => return "closed",
        Err(error) if error.is_timeout() => return "keepalive_timeout",
        Err(error) if error.is_closed() || error.is_incomplete_message() => return "closed",
        Err(error) => error,
    };
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        if let Some(io) = cause.downcast_ref::<io::Error>() {
            // TCP gave up on the peer: its keep-alive probes, or its retransmissions, went
            // unanswered.
            return match io.kind() {
                io::ErrorKind::TimedOut => "tcp_timeout",
                _ => "io_error",
            };
        }
        if let Some(h2) = cause.downcast_ref::<h2::Error>()
            && !h2.is_io()
        {
            return "protocol_error";
        }
        source = cause.source();
    }
    "io_error"
}

/// Serves one connection until it ends, or until shutdown and then the drain deadline.
async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    slot: Slot,
    ads: AdsService,
    builder: Arc<http2::Builder<TokioExecutor>>,
    shutdown: CancellationToken,
) {
    let drain = ads.server().limits().drain;
    let metrics = ads.server().metrics().clone();
    let service = PeerService {
        ads,
        peer: Some(peer),
    };
    let mut connection =
        pin!(builder.serve_connection(TokioIo::new(ReadAhead::new(stream)), service));
    let how = tokio::select! {
        outcome = connection.as_mut() => ended(&outcome),
        () = shutdown.cancelled() => {
            connection.as_mut().graceful_shutdown();
            match tokio::time::timeout(drain, connection.as_mut()).await {
                Ok(_) => "drained",
                Err(_) => "drain_deadline",
            }
        }
    };
    if how != "closed" && how != "drained" {
        tracing::debug!(%peer, how, "xDS connection ended");
    }
    metrics.connection_closed(how);
    drop(slot);
}

/// The ADS service for one connection: each request knows its peer.
#[derive(Clone)]
struct PeerService {
    ads: AdsService,
    peer: Option<SocketAddr>,
}

impl hyper::service::Service<http::Request<Incoming>> for PeerService {
    type Response = http::Response<AdsBody>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn call(&self, request: http::Request<Incoming>) -> Self::Future {
        std::future::ready(Ok(self.ads.call(request, self.peer)))
    }
}

/// A proxy's connection: reads through a buffer held only while it holds bytes, writes
/// straight through.
pub struct ReadAhead {
    stream: TcpStream,
    /// What the last read of the socket took, from `taken` on not yet handed to h2; empty
    /// (no capacity) between reads.
    buffer: Vec<u8>,
    taken: usize,
}

impl ReadAhead {
    /// What one read of the socket may take.
    pub const BUFFER: usize = 64 << 10;

    pub fn new(stream: TcpStream) -> Self {
        ReadAhead {
            stream,
            buffer: Vec::new(),
            taken: 0,
        }
    }

    /// Bytes read from the socket and not yet handed on.
    #[cfg(test)]
    fn buffered(&self) -> usize {
        self.buffer.len() - self.taken
    }

    /// Hands on what the buffer holds, as much as `out` takes; empties it (keeping its
    /// capacity for the next read) once it is all handed on.
    fn hand_on(&mut self, out: &mut ReadBuf<'_>) {
        let count = out.remaining().min(self.buffer.len() - self.taken);
        out.put_slice(&self.buffer[self.taken..self.taken + count]);
        self.taken += count;
        if self.taken == self.buffer.len() {
            self.buffer.clear();
            self.taken = 0;
        }
    }
}

impl AsyncRead for ReadAhead {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.taken < this.buffer.len() {
            this.hand_on(out);
            return Poll::Ready(Ok(()));
        }
        if out.remaining() >= Self::BUFFER {
            return Pin::new(&mut this.stream).poll_read(cx, out);
        }
        loop {
            match this.stream.poll_read_ready(cx) {
                // A connection that waits for bytes gives its buffer back; one that keeps
                // reading keeps it, without an allocation per read.
                Poll::Pending => {
                    this.buffer = Vec::new();
                    return Poll::Pending;
                }
                Poll::Ready(Err(error)) => {
                    this.buffer = Vec::new();
                    return Poll::Ready(Err(error));
                }
                Poll::Ready(Ok(())) => {}
            }
            this.buffer.reserve_exact(Self::BUFFER);
            match this.stream.try_read_buf(&mut this.buffer) {
                // The end of the stream: nothing put in `out`.
                Ok(0) => {
                    this.buffer = Vec::new();
                    return Poll::Ready(Ok(()));
                }
                Ok(_) => {
                    this.hand_on(out);
                    return Poll::Ready(Ok(()));
                }
                // Readiness was stale: it is cleared, and the next look at it waits (and
                // gives the buffer back).
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                Err(error) => {
                    this.buffer = Vec::new();
                    return Poll::Ready(Err(error));
                }
            }
        }
    }
}

impl AsyncWrite for ReadAhead {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    #[tokio::test]
    async fn reads_ahead_of_what_h2_asks_for_and_writes_straight_through() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut client = TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        let mut server = ReadAhead::new(accepted);

        // 32 KiB in one write: on loopback, one segment, in the socket at once.
        let sent: Vec<u8> = (0..32_768u32).map(|i| (i % 251) as u8).collect();
        client.write_all(&sent).await.unwrap();
        client.shutdown().await.unwrap();
        server.stream.readable().await.unwrap();
        assert_eq!(server.buffer.capacity(), 0, "no buffer before a read");
        let mut small = [0u8; 8192];
        let mut got = Vec::new();
        let n = server.read(&mut small).await.unwrap();
        got.extend_from_slice(&small[..n]);
        // A plain socket would have given what was asked for and kept the rest.
        assert_eq!(server.buffered(), sent.len() - n, "one read took it all");
        loop {
            let n = server.read(&mut small).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&small[..n]);
        }
        assert_eq!(got, sent);
        assert_eq!(server.buffer.capacity(), 0, "none held at the end");

        server.write_all(b"answer").await.unwrap();
        server.flush().await.unwrap();
        let mut answer = [0u8; 6];
        client.read_exact(&mut answer).await.unwrap();
        assert_eq!(&answer, b"answer");
    }

    #[tokio::test]
    async fn a_connection_waiting_for_bytes_holds_no_buffer() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        let mut server = ReadAhead::new(accepted);
        let mut small = [0u8; 8192];
        let mut out = ReadBuf::new(&mut small);
        let waiting = std::future::poll_fn(|cx| {
            Poll::Ready(Pin::new(&mut server).poll_read(cx, &mut out).is_pending())
        })
        .await;
        assert!(waiting, "nothing was sent");
        assert_eq!(server.buffer.capacity(), 0, "no buffer while waiting");

        client.write_all(b"ten bytes!").await.unwrap();
        let mut got = [0u8; 10];
        server.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ten bytes!");
        let mut out = ReadBuf::new(&mut small);
        let waiting = std::future::poll_fn(|cx| {
            Poll::Ready(Pin::new(&mut server).poll_read(cx, &mut out).is_pending())
        })
        .await;
        assert!(waiting);
        assert_eq!(
            server.buffer.capacity(),
            0,
            "given back once the socket has nothing"
        );

        // A reader that takes more than the buffer at once reads the socket straight.
        let mut large = vec![0u8; ReadAhead::BUFFER];
        client.write_all(b"straight").await.unwrap();
        let n = server.read(&mut large).await.unwrap();
        assert_eq!(&large[..n], b"straight");
        assert_eq!(server.buffer.capacity(), 0);

        drop(client);
        assert_eq!(server.read(&mut small).await.unwrap(), 0, "the end");
        assert_eq!(server.buffer.capacity(), 0);
    }
}
