//! A gRPC client on bare HTTP/2 (the h2 crate), for what a well-behaved client never sends: a
//! stream that sends nothing, a message cut short, bytes that are no message, a client that
//! never reads. Each call is an HTTP/2 stream whose DATA the test writes byte for byte
//! ([`grpc_frame`] frames a message), and whose status it reads, from the response headers (a
//! status sent at once) or the trailers.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use bytes::Bytes;
use h2::client::{ResponseFuture, SendRequest};
use tokio::net::TcpSocket;

/// The ADS methods' paths.
pub const SOTW: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
pub const DELTA: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";

/// One HTTP/2 connection, closed when dropped.
pub struct RawConnection {
    send: SendRequest<Bytes>,
    connection: Option<tokio::task::JoinHandle<Result<(), h2::Error>>>,
    authority: SocketAddr,
}

impl Drop for RawConnection {
    fn drop(&mut self) {
        if let Some(connection) = &self.connection {
            connection.abort();
        }
    }
}

/// How to open a connection.
#[derive(Clone, Copy, Debug, Default)]
pub struct Connect {
    /// The source address (any of 127.0.0.0/8 works on loopback).
    pub bind: Option<IpAddr>,
    /// The flow-control window the client gives each stream: how much the server may send it
    /// before it reads (h2's default, 65535, when `None`).
    pub window: Option<u32>,
}

impl RawConnection {
    pub async fn connect(addr: SocketAddr, options: Connect) -> anyhow::Result<RawConnection> {
        let socket = match addr {
            SocketAddr::V4(_) => TcpSocket::new_v4()?,
            SocketAddr::V6(_) => TcpSocket::new_v6()?,
        };
        if let Some(ip) = options.bind {
            socket.bind(SocketAddr::new(ip, 0))?;
        }
        let tcp = tokio::time::timeout(Duration::from_secs(5), socket.connect(addr)).await??;
        let mut builder = h2::client::Builder::new();
        if let Some(window) = options.window {
            builder
                .initial_window_size(window)
                .initial_connection_window_size(window);
        }
        let (send, connection) = builder.handshake(tcp).await?;
        Ok(RawConnection {
            send,
            connection: Some(tokio::spawn(connection)),
            authority: addr,
        })
    }

    /// Opens a call of `path`: its request headers are sent, its body left open.
    pub async fn call(&mut self, path: &str) -> anyhow::Result<RawCall> {
        let mut send = self.send.clone().ready().await?;
        let request = http::Request::post(format!("http://{}{path}", self.authority))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())?;
        let (response, body) = send.send_request(request, false)?;
        self.send = send;
        Ok(RawCall {
            response: Some(response),
            body,
        })
    }

    /// How the connection ended (waits for it): `Ok` for a clean close.
    pub async fn closed(mut self, within: Duration) -> anyhow::Result<Result<(), h2::Error>> {
        let connection = self
            .connection
            .take()
            .ok_or_else(|| anyhow::anyhow!("the connection was already awaited"))?;
        Ok(tokio::time::timeout(within, connection).await??)
    }
}

/// One call: its request body, and the response to come.
pub struct RawCall {
    response: Option<ResponseFuture>,
    body: h2::SendStream<Bytes>,
}

/// A call's end: its gRPC status code and message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ended {
    pub code: i32,
    pub message: String,
    /// Bytes of messages received before the status.
    pub received: usize,
}

impl RawCall {
    /// Sends `bytes` as they are, leaving the body open (h2 queues what the server's window
    /// does not take yet).
    pub fn send(&mut self, bytes: &[u8]) -> anyhow::Result<()> {
        self.body.reserve_capacity(bytes.len());
        self.body.send_data(Bytes::copy_from_slice(bytes), false)?;
        Ok(())
    }

    /// Sends `bytes` as the server's flow control lets them go, a piece at a time, so the
    /// client queues little of its own.
    pub async fn send_paced(&mut self, bytes: &[u8]) -> anyhow::Result<()> {
        for piece in bytes.chunks(16 << 10) {
            self.body.reserve_capacity(piece.len());
            while self.body.capacity() < piece.len() {
                match std::future::poll_fn(|cx| self.body.poll_capacity(cx)).await {
                    Some(capacity) => drop(capacity?),
                    None => anyhow::bail!("the stream ended"),
                }
            }
            self.body.send_data(Bytes::copy_from_slice(piece), false)?;
        }
        Ok(())
    }

    /// The call's status, within `within`: from the response headers if it ended at once,
    /// else from the trailers, after reading (and counting) the messages before them.
    pub async fn ended(mut self, within: Duration) -> anyhow::Result<Ended> {
        let response = self
            .response
            .take()
            .ok_or_else(|| anyhow::anyhow!("the response was already taken"))?;
        let read = async move {
            let response = response.await?;
            let status = |headers: &http::HeaderMap| {
                let code = headers
                    .get("grpc-status")?
                    .to_str()
                    .ok()?
                    .parse::<i32>()
                    .ok()?;
                let message = headers
                    .get("grpc-message")
                    .and_then(|m| m.to_str().ok())
                    .map(percent_decoded)
                    .unwrap_or_default();
                Some((code, message))
            };
            if let Some((code, message)) = status(response.headers()) {
                return Ok(Ended {
                    code,
                    message,
                    received: 0,
                });
            }
            let mut body = response.into_body();
            let mut received = 0;
            while let Some(data) = body.data().await {
                let data = data?;
                received += data.len();
                let _ = body.flow_control().release_capacity(data.len());
            }
            let trailers = body
                .trailers()
                .await?
                .ok_or_else(|| anyhow::anyhow!("the response ended without trailers"))?;
            let (code, message) = status(&trailers)
                .ok_or_else(|| anyhow::anyhow!("no grpc-status in {trailers:?}"))?;
            Ok(Ended {
                code,
                message,
                received,
            })
        };
        tokio::time::timeout(within, read)
            .await
            .map_err(|_| anyhow::anyhow!("no status within {within:?}"))?
    }

    /// The response headers (the stream's start), leaving its body unread: a client that never
    /// reads. `None` when the call ended at once (a status in the headers). The call can still
    /// send.
    pub async fn start(&mut self, within: Duration) -> anyhow::Result<Option<h2::RecvStream>> {
        let response = self
            .response
            .take()
            .ok_or_else(|| anyhow::anyhow!("the response was already taken"))?;
        let response = tokio::time::timeout(within, response).await??;
        if response.headers().contains_key("grpc-status") {
            return Ok(None);
        }
        Ok(Some(response.into_body()))
    }
}

/// `message` as one gRPC frame: not compressed, its length, its bytes.
pub fn grpc_frame(message: &[u8]) -> Vec<u8> {
    let mut out = vec![0];
    out.extend_from_slice(
        &u32::try_from(message.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    out.extend_from_slice(message);
    out
}

/// A grpc-message header's text (percent-encoded on the wire).
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Ok(b) = u8::from_str_radix(&text[i + 1..i + 3], 16)
        {
            out.push(b);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
