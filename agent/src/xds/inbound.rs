//! A stream's requests, read off its HTTP/2 body. tonic's `Streaming` copies every DATA frame
//! into one buffer before it decodes a message; a profile of the change phase at 10k services
//! (50 SotW proxies, each endpoint ACK 400 KB of names) had that copy at 14 % of the agent's
//! CPU, the largest share after the kernel's own copy out of the socket. [`Inbound`] keeps the
//! frames as h2 hands them over (each a slice of h2's read buffer) and decodes a message
//! straight from them ([`Frames`]): a run of names that lies in one frame is kept as a slice of
//! it ([`super::wire::NameList`]), and nothing is copied.
//!
//! Written for this rather than taken from tonic: tonic's decoder interface hands the decoder
//! its own contiguous buffer, which is the copy. The gRPC framing is small: a one-byte
//! compression flag, a four-byte length, the message. A compressed message is refused (no
//! compression is offered), a body that ends inside a message is an error, and a cancelled
//! body ends the stream quietly, as tonic does. What a client may make the agent hold is
//! bounded twice, before any of a message's body is read: by the stream's limit on one message
//! (its length prefix over it ends the stream with `RESOURCE_EXHAUSTED`), and by the
//! [`RequestBudget`] every stream shares; and for how long: a message must arrive whole within
//! the stream's timeout of its first byte (the first one, of the stream being read), time spent
//! waiting for the budget aside, or the stream ends with `DEADLINE_EXCEEDED`. A message that
//! does not decode ends the stream with `INVALID_ARGUMENT`.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes};
use http_body::Body;
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use prost::DecodeError;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tonic::{Code, Status};

use super::metrics::XdsMetrics;

/// The limit on one message until the stream is given its own: tonic's default.
pub const DEFAULT_MAX_MESSAGE: usize = 4 << 20;
/// A gRPC message's prefix: compression flag and length.
const HEADER: usize = 5;

/// Why a stream's requests could not be read.
#[derive(Debug, thiserror::Error)]
pub enum InboundError {
    #[error("a request of {len} bytes is over this stream's limit of {limit} bytes")]
    TooLarge { len: usize, limit: usize },
    #[error(
        "a request of {len} bytes is over what the agent buffers for all streams at once \
         ({budget} bytes, --xds-request-buffer-bytes)"
    )]
    OverBudget { len: usize, budget: usize },
    #[error("the request does not decode: {0}")]
    Undecodable(#[from] DecodeError),
    #[error(
        "protocol error: received message with compressed-flag but no grpc-encoding was \
         specified"
    )]
    Compressed,
    #[error(
        "protocol error: received message with invalid compression flag: {0} (valid flags \
         are 0 and 1)"
    )]
    InvalidFlag(u8),
    #[error("Unexpected EOF decoding stream.")]
    Truncated,
    #[error(
        "no complete {} request within {timeout:?} (--xds-request-timeout-ms)",
        if *.first { "first" } else { "" }
    )]
    TooSlow { timeout: Duration, first: bool },
    #[error("{0}")]
    Transport(Status),
}

impl InboundError {
    /// The status that ends the stream.
    pub fn status(&self) -> Status {
        let message = self.to_string();
        match self {
            InboundError::TooLarge { .. } | InboundError::OverBudget { .. } => {
                Status::resource_exhausted(message)
            }
            InboundError::Undecodable(_) => Status::invalid_argument(message),
            InboundError::TooSlow { .. } => Status::deadline_exceeded(message),
            // As gRPC's protocol and tonic say.
            InboundError::Compressed | InboundError::InvalidFlag(_) | InboundError::Truncated => {
                Status::internal(message)
            }
            InboundError::Transport(status) => status.clone(),
        }
    }

    /// The label it is counted under among refused streams; `None` for a transport failure
    /// (a connection that broke), which refuses nothing.
    pub fn reason(&self) -> Option<&'static str> {
        match self {
            InboundError::TooLarge { .. } => Some("request_too_large"),
            InboundError::OverBudget { .. } => Some("request_over_budget"),
            InboundError::Undecodable(_) => Some("undecodable"),
            InboundError::Compressed | InboundError::InvalidFlag(_) => Some("malformed"),
            InboundError::TooSlow { first: true, .. } => Some("first_request_timeout"),
            InboundError::TooSlow { first: false, .. } => Some("request_timeout"),
            InboundError::Truncated | InboundError::Transport(_) => None,
        }
    }
}

/// The bytes of large requests being read, shared by every stream: a message larger than
/// `exempt` takes its length from the budget once its length prefix is read, before its body
/// is, and gives it back when it is decoded (or its stream ends). A stream that finds the
/// budget spent waits, reading nothing more, so h2's flow control holds its client back; the
/// budget is fair (first come, first served), so a reconnecting proxy's large request is not
/// starved by smaller ones. Messages up to `exempt` (h2's window on a stream: what h2 holds of
/// a stream the agent does not read anyway) never wait: an ACK is not queued behind a
/// reconnect, nor behind a client that stalls a large request.
#[derive(Debug)]
pub struct RequestBudget {
    bytes: Arc<Semaphore>,
    total: usize,
    exempt: usize,
    metrics: Option<XdsMetrics>,
}

impl RequestBudget {
    pub fn new(total: usize, exempt: usize, metrics: Option<XdsMetrics>) -> Arc<Self> {
        let total = total.clamp(1, Semaphore::MAX_PERMITS);
        Arc::new(RequestBudget {
            bytes: Arc::new(Semaphore::new(total)),
            total,
            exempt,
            metrics,
        })
    }

    /// `len` bytes of the budget, once they are free.
    async fn reserve(&self, len: usize) -> Result<Reservation, InboundError> {
        let over = || InboundError::OverBudget {
            len,
            budget: self.total,
        };
        let n = u32::try_from(len).map_err(|_| over())?;
        if len > self.total {
            return Err(over());
        }
        let permit = self
            .bytes
            .clone()
            .acquire_many_owned(n)
            .await
            .map_err(|_| over())?;
        if let Some(metrics) = &self.metrics {
            metrics.request_bytes_held(len as i64);
        }
        Ok(Reservation {
            _permit: permit,
            len,
            metrics: self.metrics.clone(),
        })
    }

    /// Bytes reserved right now.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.total - self.bytes.available_permits()
    }
}

/// A message's share of the [`RequestBudget`], given back on drop.
#[derive(Debug)]
struct Reservation {
    _permit: OwnedSemaphorePermit,
    len: usize,
    metrics: Option<XdsMetrics>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(metrics) = &self.metrics {
            metrics.request_bytes_held(-(self.len as i64));
        }
    }
}

/// Decodes one stream's requests (one decoder per stream, so it may remember).
pub trait RequestDecoder: Default + Send + 'static {
    type Request;

    /// Decodes a whole message: `buf` holds exactly its bytes.
    fn decode(&mut self, buf: &mut impl Buf) -> Result<Self::Request, DecodeError>;
}

/// Decodes each message alone, with its prost implementation (the tests' messages).
#[cfg(test)]
pub struct Plain<M>(std::marker::PhantomData<fn() -> M>);

#[cfg(test)]
impl<M> Default for Plain<M> {
    fn default() -> Self {
        Plain(std::marker::PhantomData)
    }
}

#[cfg(test)]
impl<M: prost::Message + Default + 'static> RequestDecoder for Plain<M> {
    type Request = M;

    fn decode(&mut self, buf: &mut impl Buf) -> Result<M, DecodeError> {
        M::decode(buf)
    }
}

/// A request that makes room, before it is read, for what a message of `len` bytes may hold.
pub trait WithRoom: prost::Message + Default {
    fn with_room(len: usize) -> Self;
}

/// Decodes each message alone into a request with room made for it first ([`WithRoom`]): a
/// whole-mesh proxy's reconnect lists 9 MB of names and versions at 50k services, and lists
/// grown as they were read were copied each time they doubled, into fresh pages (perf: a
/// fifth of decoding a restart's reconnects).
pub struct Presized<M>(std::marker::PhantomData<fn() -> M>);

impl<M> Default for Presized<M> {
    fn default() -> Self {
        Presized(std::marker::PhantomData)
    }
}

impl<M: WithRoom + 'static> RequestDecoder for Presized<M> {
    type Request = M;

    fn decode(&mut self, buf: &mut impl Buf) -> Result<M, DecodeError> {
        let mut request = M::with_room(buf.remaining());
        request.merge(buf)?;
        Ok(request)
    }
}

/// The requests of one stream.
pub struct Inbound<D> {
    body: Pin<Box<UnsyncBoxBody<Bytes, Status>>>,
    decoder: D,
    frames: VecDeque<Bytes>,
    /// Bytes held in `frames`.
    held: usize,
    /// The length of the message being read, once its prefix was.
    message: Option<usize>,
    /// That message's share of the budget, once it has it.
    reserved: Option<Reservation>,
    /// The longest message this stream may send.
    limit: usize,
    budget: Option<Arc<RequestBudget>>,
    /// How long a message may take to arrive whole; `None`: as long as it likes.
    timeout: Option<Duration>,
    /// The clock of the message being read, once it began (or the stream was read).
    clock: Option<Clock>,
    /// No message was read yet.
    first: bool,
    ended: bool,
}

/// When a message began to arrive, and how long of that it spent waiting for the budget.
#[derive(Clone, Copy, Debug)]
struct Clock {
    began: Instant,
    waited: Duration,
    /// Waiting for the budget since.
    waiting: Option<Instant>,
}

impl Clock {
    fn new() -> Self {
        Clock {
            began: Instant::now(),
            waited: Duration::ZERO,
            waiting: None,
        }
    }

    fn deadline(&self, timeout: Duration) -> Instant {
        self.began + self.waited + timeout
    }
}

impl<D: RequestDecoder> Inbound<D> {
    pub fn new<B>(body: B) -> Self
    where
        B: Body + Send + 'static,
        B::Error: Into<tonic::codegen::StdError> + Send + 'static,
    {
        // Each frame's data as `Bytes`: for hyper's body, the very slice h2 handed over.
        let body = body
            .map_frame(|frame| frame.map_data(|mut data| data.copy_to_bytes(data.remaining())))
            .map_err(|error| Status::from_error(error.into()));
        Inbound {
            body: Box::pin(UnsyncBoxBody::new(body)),
            decoder: D::default(),
            frames: VecDeque::new(),
            held: 0,
            message: None,
            reserved: None,
            limit: DEFAULT_MAX_MESSAGE,
            budget: None,
            timeout: None,
            clock: None,
            first: true,
            ended: false,
        }
    }

    /// Ends the stream when a message takes longer than `timeout` to arrive whole.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Starts the first message's clock: the stream is being read, and it must come.
    pub fn expect_message(&mut self) {
        self.clock.get_or_insert_with(Clock::new);
    }

    /// Reads each message's body only once `budget` has room for it.
    pub fn with_budget(mut self, budget: Arc<RequestBudget>) -> Self {
        self.budget = Some(budget);
        self
    }

    /// The longest message this stream may send from its next message on.
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
    }

    /// The next request; `None` when the client ended its stream. Cancel-safe: what was read
    /// (and the budget a message was given, and its clock) stays in `self`.
    pub async fn message(&mut self) -> Result<Option<D::Request>, InboundError> {
        loop {
            if let Some(len) = self.prefix()? {
                if self.reserved.is_none()
                    && let Some(budget) = &self.budget
                    && len > budget.exempt
                {
                    // Time spent waiting for the budget is not the client's.
                    let clock = self.clock.get_or_insert_with(Clock::new);
                    clock.waiting.get_or_insert_with(Instant::now);
                    let reservation = budget.reserve(len).await?;
                    if let Some(since) = clock.waiting.take() {
                        clock.waited += since.elapsed();
                    }
                    self.reserved = Some(reservation);
                }
                if self.held >= len {
                    return self.decode(len).map(Some);
                }
            }
            if self.ended {
                return if self.held > 0 || self.message.is_some() {
                    Err(InboundError::Truncated)
                } else {
                    Ok(None)
                };
            }
            let deadline = self
                .timeout
                .zip(self.clock)
                .map(|(timeout, clock)| clock.deadline(timeout));
            let frame = match deadline {
                Some(deadline) => tokio::select! {
                    frame = self.body.frame() => frame,
                    () = tokio::time::sleep_until(deadline) => {
                        return Err(InboundError::TooSlow {
                            timeout: self.timeout.unwrap_or_default(),
                            first: self.first,
                        });
                    }
                },
                None => self.body.frame().await,
            };
            match frame {
                Some(Ok(frame)) => {
                    // Trailers of a request carry nothing the agent reads.
                    if let Ok(data) = frame.into_data()
                        && !data.is_empty()
                    {
                        self.clock.get_or_insert_with(Clock::new);
                        self.held += data.len();
                        self.frames.push_back(data);
                    }
                }
                // The client reset its stream: as tonic, an end rather than an error.
                Some(Err(status)) if status.code() == Code::Cancelled => {
                    self.ended = true;
                    self.frames.clear();
                    (self.held, self.message, self.reserved, self.clock) = (0, None, None, None);
                }
                Some(Err(status)) => return Err(InboundError::Transport(status)),
                None => self.ended = true,
            }
        }
    }

    /// The length of the message being read, once its prefix is here; refused when over the
    /// limit, before any of its body is read.
    fn prefix(&mut self) -> Result<Option<usize>, InboundError> {
        if let Some(len) = self.message {
            return Ok(Some(len));
        }
        if self.held < HEADER {
            return Ok(None);
        }
        let mut prefix = Frames::new(&mut self.frames, HEADER);
        let (flag, len) = (prefix.get_u8(), prefix.get_u32() as usize);
        self.held -= HEADER;
        match flag {
            0 => {}
            1 => return Err(InboundError::Compressed),
            other => return Err(InboundError::InvalidFlag(other)),
        }
        if len > self.limit {
            return Err(InboundError::TooLarge {
                len,
                limit: self.limit,
            });
        }
        self.message = Some(len);
        Ok(Some(len))
    }

    /// Decodes the message of `len` bytes, all of which is here.
    fn decode(&mut self, len: usize) -> Result<D::Request, InboundError> {
        let mut message = Frames::new(&mut self.frames, len);
        let decoded = self.decoder.decode(&mut message);
        // A decoder that failed may have stopped short: the rest of its message goes.
        let rest = message.remaining();
        message.advance(rest);
        self.held -= len;
        (self.message, self.reserved) = (None, None);
        self.first = false;
        // What is left of the frames is the next message's beginning.
        self.clock = (self.held > 0).then(Clock::new);
        Ok(decoded?)
    }
}

/// The first `left` bytes of a queue of frames, read as one buffer: a frame at a time
/// (`chunk`), or all of them at once (`chunks_vectored`, which lets a decoder compare bytes
/// across frames before it reads any); `copy_to_bytes` within a frame is a slice of it.
pub struct Frames<'a> {
    frames: &'a mut VecDeque<Bytes>,
    left: usize,
}

impl<'a> Frames<'a> {
    /// `frames` must hold at least `left` bytes, in frames that are not empty.
    pub fn new(frames: &'a mut VecDeque<Bytes>, left: usize) -> Self {
        debug_assert!(frames.iter().map(Bytes::len).sum::<usize>() >= left);
        Frames { frames, left }
    }
}

impl Buf for Frames<'_> {
    fn remaining(&self) -> usize {
        self.left
    }

    fn chunk(&self) -> &[u8] {
        match self.frames.front() {
            Some(frame) => &frame[..frame.len().min(self.left)],
            None => &[],
        }
    }

    fn chunks_vectored<'b>(&'b self, dst: &mut [IoSlice<'b>]) -> usize {
        let mut left = self.left;
        let mut filled = 0;
        for (slot, frame) in dst.iter_mut().zip(self.frames.iter()) {
            if left == 0 {
                break;
            }
            let take = frame.len().min(left);
            *slot = IoSlice::new(&frame[..take]);
            left -= take;
            filled += 1;
        }
        filled
    }

    fn advance(&mut self, mut count: usize) {
        assert!(count <= self.left, "advance past the end of the message");
        self.left -= count;
        while count > 0 {
            let Some(front) = self.frames.front_mut() else {
                unreachable!("the frames hold the message");
            };
            if count < front.len() {
                front.advance(count);
                return;
            }
            count -= front.len();
            self.frames.pop_front();
        }
    }

    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        assert!(len <= self.left, "copy past the end of the message");
        match self.frames.front_mut() {
            Some(front) if len <= front.len() => {
                self.left -= len;
                let bytes = front.split_to(len);
                if front.is_empty() {
                    self.frames.pop_front();
                }
                bytes
            }
            _ => {
                let mut out = bytes::BytesMut::with_capacity(len);
                while out.len() < len {
                    let chunk = self.chunk();
                    let take = chunk.len().min(len - out.len());
                    out.extend_from_slice(&chunk[..take]);
                    self.advance(take);
                }
                out.freeze()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
    use http_body::Frame;
    use http_body_util::StreamBody;
    use prost::Message;
    use tokio_stream::StreamExt as _;

    use super::*;
    use crate::xds::wire::{DeltaRequest, SotwRequest};

    /// A gRPC message: flag, length, bytes.
    fn framed(flag: u8, message: &[u8]) -> Vec<u8> {
        let mut out = vec![flag];
        out.extend_from_slice(&(message.len() as u32).to_be_bytes());
        out.extend_from_slice(message);
        out
    }

    /// A request body that hands `bytes` over in frames of `size` bytes.
    fn body(bytes: &[u8], size: usize) -> impl Body<Data = Bytes, Error = Infallible> + use<> {
        let frames: Vec<Result<Frame<Bytes>, Infallible>> = bytes
            .chunks(size)
            .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        StreamBody::new(tokio_stream::iter(frames))
    }

    fn request(names: &[String], nonce: &str) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: "3".into(),
            resource_names: names.to_vec(),
            type_url: "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment".into(),
            response_nonce: nonce.into(),
            ..DiscoveryRequest::default()
        }
    }

    /// Every request of `bytes` sent in frames of `size`, as the stream reads them.
    async fn read_all<D: RequestDecoder>(
        bytes: &[u8],
        size: usize,
    ) -> Result<Vec<D::Request>, Status> {
        let mut inbound = Inbound::<D>::new(body(bytes, size));
        let mut out = Vec::new();
        while let Some(request) = inbound.message().await.map_err(|e| e.status())? {
            out.push(request);
        }
        Ok(out)
    }

    #[tokio::test]
    async fn messages_read_alike_however_the_frames_cut_them() {
        let names: Vec<String> = (0..300).map(|i| format!("outbound|80||s{i}")).collect();
        let first = request(&names, "1").encode_to_vec();
        let second = request(&names[..200], "2").encode_to_vec();
        let third = request(&names, "3").encode_to_vec();
        let empty = DiscoveryRequest::default().encode_to_vec();
        let mut bytes = framed(0, &first);
        for message in [&second, &empty, &third] {
            bytes.extend(framed(0, message));
        }
        for size in [1, 5, 7, 1000, 16 << 10, bytes.len()] {
            let read = read_all::<Plain<DiscoveryRequest>>(&bytes, size)
                .await
                .unwrap();
            let expected = [&first, &second, &empty, &third]
                .map(|m| DiscoveryRequest::decode(m.as_slice()).unwrap());
            assert_eq!(read, expected, "frames of {size} bytes");

            // As a SotW stream reads them, names packed in room made for the message: the
            // same names across the frames.
            let read = read_all::<Presized<SotwRequest>>(&bytes, size)
                .await
                .unwrap();
            let nonces: Vec<&str> = read.iter().map(|r| r.response_nonce.as_str()).collect();
            assert_eq!(nonces, ["1", "2", "", "3"]);
            assert_eq!(read[3].resource_names, read[0].resource_names);
            assert_eq!(
                read[3].resource_names.iter().collect::<Vec<_>>(),
                names.iter().map(String::as_str).collect::<Vec<_>>()
            );
        }
    }

    /// A Delta reconnect, read as a Delta stream reads it (room made for the message, then
    /// its subscription and versions read a run at a time), holds every name and version
    /// however the frames cut it, and one with fewer entries than the room guessed too.
    #[tokio::test]
    async fn a_delta_reconnect_reads_alike_however_the_frames_cut_it() {
        use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
        let names: Vec<String> = (0..300).map(|i| format!("outbound|80||s{i}")).collect();
        let versions: Vec<(String, String)> = names
            .iter()
            .enumerate()
            .map(|(i, name)| (name.clone(), format!("{i:016x}")))
            .collect();
        let reconnect = DeltaDiscoveryRequest {
            resource_names_subscribe: names.clone(),
            initial_resource_versions: versions.iter().cloned().collect(),
            ..DeltaDiscoveryRequest::default()
        };
        let small = DeltaDiscoveryRequest {
            initial_resource_versions: versions[..1].iter().cloned().collect(),
            ..DeltaDiscoveryRequest::default()
        };
        let mut bytes = framed(0, &reconnect.encode_to_vec());
        bytes.extend(framed(0, &small.encode_to_vec()));
        for size in [1, 7, 1000, 16 << 10, bytes.len()] {
            let read = read_all::<Presized<DeltaRequest>>(&bytes, size)
                .await
                .unwrap();
            let subscribed: Vec<&str> = read[0].resource_names_subscribe.iter().collect();
            assert_eq!(subscribed, names, "frames of {size} bytes");
            let mut held: Vec<(String, String)> = read[0]
                .initial_resource_versions
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect();
            held.sort();
            let mut expected = versions.clone();
            expected.sort();
            assert_eq!(held, expected, "frames of {size} bytes");
            let one: Vec<(&str, &str)> = read[1].initial_resource_versions.iter().collect();
            assert_eq!(one, [(names[0].as_str(), "0000000000000000")]);
        }
    }

    #[tokio::test]
    async fn refuses_what_grpc_refuses_and_what_does_not_decode_as_invalid() {
        let message = request(&["a".into()], "1").encode_to_vec();
        let compressed = read_all::<Plain<DiscoveryRequest>>(&framed(1, &message), 3).await;
        assert_eq!(compressed.unwrap_err().code(), Code::Internal);
        let flag = read_all::<Plain<DiscoveryRequest>>(&framed(7, &message), 3).await;
        assert_eq!(flag.unwrap_err().code(), Code::Internal);

        let whole = framed(0, &message);
        for cut in [1, HEADER, whole.len() - 1] {
            let ended = read_all::<Plain<DiscoveryRequest>>(&whole[..cut], 2).await;
            let error = ended.unwrap_err();
            assert_eq!(error.code(), Code::Internal);
            assert!(error.message().contains("Unexpected EOF"), "{error}");
        }

        // A message that does not decode, then a good one: the error comes first.
        let mut bad = framed(0, &[0xff, 0xff]);
        bad.extend(framed(0, &message));
        let bad = read_all::<Plain<DiscoveryRequest>>(&bad, 3).await;
        assert_eq!(bad.unwrap_err().code(), Code::InvalidArgument);
    }

    #[tokio::test]
    async fn a_message_over_the_limit_is_refused_before_its_body_is_read() {
        let message = request(&["a".repeat(100)], "1").encode_to_vec();
        let bytes = framed(0, &message);
        // At the limit: read.
        let mut inbound = Inbound::<Plain<DiscoveryRequest>>::new(body(&bytes, 7));
        inbound.set_limit(message.len());
        assert!(inbound.message().await.unwrap().is_some());
        // One byte over: refused with only the prefix read (the body here never ends, so
        // reading it would hang).
        let prefix = tokio_stream::iter([Ok::<_, Infallible>(Frame::data(
            Bytes::copy_from_slice(&bytes[..HEADER]),
        ))])
        .chain(tokio_stream::pending());
        let mut inbound = Inbound::<Plain<DiscoveryRequest>>::new(StreamBody::new(prefix));
        inbound.set_limit(message.len() - 1);
        let error = inbound.message().await.unwrap_err();
        assert_eq!(error.status().code(), Code::ResourceExhausted);
        assert_eq!(error.reason(), Some("request_too_large"));
        assert!(
            error
                .to_string()
                .contains(&format!("{} bytes", message.len())),
            "{error}"
        );
    }

    #[tokio::test]
    async fn a_reset_stream_ends_quietly_and_gives_back_its_budget() {
        let budget = RequestBudget::new(1000, 0, None);
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut inbound = Inbound::<Plain<DiscoveryRequest>>::new(StreamBody::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
        .with_budget(budget.clone());
        // A prefix promising 600 bytes, and 100 of them.
        let mut start = vec![0];
        start.extend_from_slice(&600u32.to_be_bytes());
        start.extend_from_slice(&[0; 100]);
        tx.send(Ok(Frame::data(Bytes::from(start)))).await.unwrap();
        tokio::select! {
            _ = inbound.message() => panic!("a message of 100 bytes out of 600"),
            () = tokio::task::yield_now() => {}
        }
        assert_eq!(budget.held(), 600, "the message holds its length");
        tx.send(Err(Status::cancelled("reset"))).await.unwrap();
        assert!(inbound.message().await.unwrap().is_none());
        assert_eq!(budget.held(), 0);
    }

    /// The second stream's message waits for the budget the first one's holds, reading none of
    /// its body meanwhile; it is read once the first is decoded.
    #[tokio::test]
    async fn a_message_waits_for_the_budget_without_reading_its_body() {
        let message = request(&["a".repeat(500)], "1").encode_to_vec();
        let bytes = framed(0, &message);
        let budget = RequestBudget::new(message.len() + message.len() / 2, 0, None);
        let (first_tx, first_rx) = tokio::sync::mpsc::channel(4);
        let mut first = Inbound::<Plain<DiscoveryRequest>>::new(StreamBody::new(
            tokio_stream::wrappers::ReceiverStream::new(first_rx),
        ))
        .with_budget(budget.clone());
        first_tx
            .send(Ok::<_, Infallible>(Frame::data(Bytes::copy_from_slice(
                &bytes[..HEADER + 10],
            ))))
            .await
            .unwrap();
        tokio::select! {
            _ = first.message() => panic!("incomplete"),
            () = tokio::task::yield_now() => {}
        }
        assert_eq!(budget.held(), message.len());

        let (second_tx, second_rx) = tokio::sync::mpsc::channel::<Result<_, Infallible>>(4);
        let mut second = Inbound::<Plain<DiscoveryRequest>>::new(StreamBody::new(
            tokio_stream::wrappers::ReceiverStream::new(second_rx),
        ))
        .with_budget(budget.clone());
        second_tx
            .send(Ok(Frame::data(Bytes::copy_from_slice(&bytes[..HEADER]))))
            .await
            .unwrap();
        second_tx
            .send(Ok(Frame::data(Bytes::copy_from_slice(&bytes[HEADER..]))))
            .await
            .unwrap();
        tokio::select! {
            _ = second.message() => panic!("read past the budget"),
            () = tokio::task::yield_now() => {}
        }
        assert_eq!(second.held, 0, "nothing of its body was taken from h2");

        first_tx
            .send(Ok(Frame::data(Bytes::copy_from_slice(
                &bytes[HEADER + 10..],
            ))))
            .await
            .unwrap();
        assert!(first.message().await.unwrap().is_some());
        assert!(second.message().await.unwrap().is_some());
        assert_eq!(budget.held(), 0);

        // A message no larger than what the budget exempts is read, spent budget or not.
        let exempting = RequestBudget::new(2 * message.len(), message.len(), None);
        let (hold_tx, hold) = fed();
        let mut hold = hold.with_budget(exempting.clone());
        let all = 2 * message.len() as u32;
        hold_tx.send(Ok(prefix(all))).await.unwrap();
        tokio::select! {
            _ = hold.message() => panic!("incomplete"),
            () = tokio::task::yield_now() => {}
        }
        assert_eq!(exempting.held(), 2 * message.len(), "spent");
        let mut small = Inbound::<Plain<DiscoveryRequest>>::new(body(&bytes, 100))
            .with_budget(exempting.clone());
        assert!(small.message().await.unwrap().is_some());

        // A message larger than the whole budget could never be read: refused at once.
        let mut huge = Inbound::<Plain<DiscoveryRequest>>::new(body(&framed(0, &[0; 4000]), 5))
            .with_budget(budget);
        let error = huge.message().await.unwrap_err();
        assert_eq!(error.status().code(), Code::ResourceExhausted);
        assert_eq!(error.reason(), Some("request_over_budget"));
    }

    type Feed = tokio::sync::mpsc::Sender<Result<Frame<Bytes>, Infallible>>;

    /// A stream whose body comes from the test, frame by frame.
    fn fed() -> (Feed, Inbound<Plain<DiscoveryRequest>>) {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        (tx, Inbound::new(body))
    }

    fn prefix(len: u32) -> Frame<Bytes> {
        let mut bytes = vec![0];
        bytes.extend_from_slice(&len.to_be_bytes());
        Frame::data(Bytes::from(bytes))
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_must_arrive_whole_in_time_but_waiting_for_the_budget_does_not_count() {
        let second = Duration::from_secs(1);
        // Nothing at all: the first request's clock runs from when the stream is read.
        let (_silent_tx, silent) = fed();
        let mut silent = silent.with_timeout(second);
        silent.expect_message();
        let error = silent.message().await.unwrap_err();
        assert_eq!(error.reason(), Some("first_request_timeout"));
        assert_eq!(error.status().code(), Code::DeadlineExceeded);

        // One stream holds most of the budget with a request it never finishes (for 5 s);
        // another's request waits for the budget meanwhile, then comes whole half a second
        // after it got it: in time, the wait aside.
        let budget = RequestBudget::new(1000, 0, None);
        let (hog_tx, hog) = fed();
        let mut hog = hog.with_budget(budget.clone()).with_timeout(5 * second);
        hog_tx.send(Ok(prefix(800))).await.unwrap();
        let hog = tokio::spawn(async move { hog.message().await.map(|_| ()) });
        tokio::task::yield_now().await;
        assert_eq!(budget.held(), 800);

        let message = request(&["a".repeat(400)], "1").encode_to_vec();
        let (waiter_tx, waiter) = fed();
        let mut waiter = waiter.with_budget(budget.clone()).with_timeout(second);
        waiter_tx
            .send(Ok(prefix(message.len() as u32)))
            .await
            .unwrap();
        let waiter = tokio::spawn(async move { waiter.message().await });
        tokio::time::sleep(Duration::from_millis(5500)).await;
        let error = hog.await.unwrap().unwrap_err();
        assert_eq!(error.reason(), Some("first_request_timeout"));
        waiter_tx
            .send(Ok(Frame::data(Bytes::from(message))))
            .await
            .unwrap();
        let read = waiter.await.unwrap();
        assert!(
            read.unwrap().is_some(),
            "the wait for the budget was counted"
        );

        // A later request's clock starts at its first byte; between requests, none runs.
        let (tx, inbound) = fed();
        let mut inbound = inbound.with_timeout(second);
        let whole = framed(0, &request(&[], "1").encode_to_vec());
        tx.send(Ok(Frame::data(Bytes::from(whole)))).await.unwrap();
        assert!(inbound.message().await.unwrap().is_some());
        let idle = tokio::spawn(async move {
            let ended = inbound.message().await;
            (inbound, ended)
        });
        tokio::time::sleep(10 * second).await;
        assert!(!idle.is_finished(), "an idle stream is no late request");
        tx.send(Ok(prefix(100))).await.unwrap();
        let (_, ended) = idle.await.unwrap();
        assert_eq!(ended.unwrap_err().reason(), Some("request_timeout"));
    }

    #[test]
    fn frames_read_as_one_buffer() {
        let mut frames: VecDeque<Bytes> = [&b"abc"[..], b"de", b"fghij"]
            .into_iter()
            .map(Bytes::from_static)
            .collect();
        let mut buf = Frames::new(&mut frames, 9);
        assert_eq!(buf.chunk(), b"abc");
        let mut parts = [IoSlice::new(&[]); 4];
        let filled = buf.chunks_vectored(&mut parts);
        let seen: Vec<&[u8]> = parts[..filled].iter().map(|p| &**p).collect();
        assert_eq!(seen, [&b"abc"[..], b"de", b"fghi"]);
        // Within a frame, a slice of it; across frames, a copy; never past the message.
        assert_eq!(buf.copy_to_bytes(2), "ab");
        assert_eq!(buf.copy_to_bytes(3), "cde");
        buf.advance(1);
        assert_eq!(buf.chunk(), b"ghi");
        assert_eq!(buf.remaining(), 3);
        buf.advance(3);
        assert_eq!(buf.remaining(), 0);
        assert_eq!(frames, [Bytes::from_static(b"j")]);
    }
}
