//! One query to one upstream: over UDP from a fresh socket (a random source port per query), and
//! again over TCP when the UDP answer is truncated. Anything on the UDP socket that is not the
//! answer (late, spoofed, garbage) is ignored until the deadline.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};

use hickory_proto::op::{Message, MessageType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};
use tokio::time::Instant;

/// Receive buffer of a UDP exchange. Queries advertise 1232 bytes, so a larger answer breaks
/// the upstream's side of EDNS; one that fills this buffer is taken as truncated.
const UDP_BUFFER: usize = 4096;

/// Why one upstream gave no usable answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ExchangeError {
    #[error("no answer in time")]
    Timeout,
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("malformed answer: {0}")]
    Malformed(String),
}

impl ExchangeError {
    /// The `reason` label of the upstream failures counter.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            ExchangeError::Timeout => "timeout",
            ExchangeError::Io(_) => "io",
            ExchangeError::Malformed(_) => "malformed",
        }
    }
}

/// What an exchange brought back: the answer, and whether UDP truncated it first.
pub(crate) struct Exchanged {
    pub(crate) answer: Message,
    pub(crate) retried_over_tcp: bool,
}

/// Asks `upstream` `query` over UDP, then over TCP if the answer is truncated, by `deadline`.
pub(crate) async fn exchange(
    upstream: SocketAddr,
    query: &Message,
    deadline: Instant,
) -> Result<Exchanged, ExchangeError> {
    let bytes = query
        .to_vec()
        .map_err(|e| ExchangeError::Malformed(e.to_string()))?;
    let udp = tokio::time::timeout_at(deadline, udp_exchange(upstream, query, &bytes))
        .await
        .map_err(|_| ExchangeError::Timeout)??;
    if let Some(answer) = udp {
        return Ok(Exchanged {
            answer,
            retried_over_tcp: false,
        });
    }
    let answer = tokio::time::timeout_at(deadline, tcp_exchange(upstream, query, &bytes))
        .await
        .map_err(|_| ExchangeError::Timeout)??;
    Ok(Exchanged {
        answer,
        retried_over_tcp: true,
    })
}

/// True if `answer` answers `query`: same id, a response, same question (names compared without
/// case: some servers do not preserve it).
fn is_answer_to(answer: &Message, query: &Message) -> bool {
    answer.metadata.id == query.metadata.id
        && answer.metadata.message_type == MessageType::Response
        && answer.queries.len() == query.queries.len()
        && answer.queries.iter().zip(&query.queries).all(|(a, q)| {
            a.query_type() == q.query_type()
                && a.query_class() == q.query_class()
                && a.name().eq_ignore_root(q.name())
        })
}

/// The UDP answer, or `None` if it was truncated.
async fn udp_exchange(
    upstream: SocketAddr,
    query: &Message,
    bytes: &[u8],
) -> Result<Option<Message>, ExchangeError> {
    let local: SocketAddr = match upstream {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = UdpSocket::bind(local).await?;
    socket.connect(upstream).await?;
    socket.send(bytes).await?;
    let mut buf = vec![0; UDP_BUFFER];
    loop {
        let len = socket.recv(&mut buf).await?;
        match Message::from_vec(&buf[..len]) {
            Ok(answer) if is_answer_to(&answer, query) => {
                return Ok((!answer.metadata.truncation).then_some(answer));
            }
            // Cut by our buffer: whoever sent it, TCP tells.
            Err(_) if len == UDP_BUFFER && buf[..2] == bytes[..2] => return Ok(None),
            _ => {}
        }
    }
}

async fn tcp_exchange(
    upstream: SocketAddr,
    query: &Message,
    bytes: &[u8],
) -> Result<Message, ExchangeError> {
    let mut stream = TcpStream::connect(upstream).await?;
    let len = u16::try_from(bytes.len())
        .map_err(|_| ExchangeError::Malformed("query too long for TCP".into()))?;
    let mut framed = Vec::with_capacity(bytes.len() + 2);
    framed.extend_from_slice(&len.to_be_bytes());
    framed.extend_from_slice(bytes);
    stream.write_all(&framed).await?;
    let len = stream.read_u16().await?;
    let mut buf = vec![0; usize::from(len)];
    stream.read_exact(&mut buf).await?;
    let answer = Message::from_vec(&buf).map_err(|e| ExchangeError::Malformed(e.to_string()))?;
    if is_answer_to(&answer, query) {
        Ok(answer)
    } else {
        Err(ExchangeError::Malformed(
            "TCP answer does not match the query".into(),
        ))
    }
}
