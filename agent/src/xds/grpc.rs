//! The ADS gRPC service, served on each connection by [`super::connection`]. It stands in for
//! the server that envoy-types generates, for two reasons:
//! - Requests: the generated server decodes state-of-the-world requests into the generated
//!   `DiscoveryRequest`, a `String` per resource name; this one decodes them into
//!   [`super::wire::SotwRequest`], whose names are kept as their wire bytes; Delta requests into
//!   [`super::wire::DeltaRequest`], whose `initial_resource_versions` are packed rather than a
//!   `HashMap` of `String`s. Both straight from the HTTP/2 frames, without tonic's copy of them
//!   into one buffer ([`super::inbound`]).
//! - Responses: tonic encodes a stream's messages into one buffer per stream, which keeps the
//!   capacity of the largest message it ever held for the life of the stream. A SotW cluster
//!   response at 10k services is about 3 MB, so a hundred streams kept about 140 MiB of buffers
//!   after the initial sync (the heap profile in docs/benchmarks.md). [`ResponseBody`] encodes
//!   each message into a buffer of its exact size, which is freed once h2 has sent it; a large
//!   message as three parts, its head shared with every stream that sends the same one
//!   ([`SharedHeads`]). A message is encoded only when hyper asks for more of the body, which
//!   it does once h2 has room for it (see `--xds-send-buffer-bytes`): a client that does not
//!   read holds the message being sent, not every message queued behind it.
//!
//! The routing (two method paths of `envoy.service.discovery.v3.AggregatedDiscoveryService`,
//! anything else `UNIMPLEMENTED`) and the codec defaults (no compression) are the generated
//! server's.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, ready};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body::Frame;
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use prometheus_client::metrics::gauge::Gauge;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tonic::codegen::{StdError, http};

use super::delta::DeltaStream;
use super::inbound::Inbound;
use super::response::{Framed, SharedHeads};
use super::server::XdsServer;
use super::sotw::SotwStream;
use super::stream::Ads;

const SOTW_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
const DELTA_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";

/// The body of every response the service sends.
pub type AdsBody = UnsyncBoxBody<Sent, Status>;

/// `AggregatedDiscoveryService`, both methods, served by an [`XdsServer`].
#[derive(Clone)]
pub struct AdsService {
    server: XdsServer,
}

impl AdsService {
    pub fn new(server: XdsServer) -> Self {
        AdsService { server }
    }

    pub(super) fn server(&self) -> &XdsServer {
        &self.server
    }

    /// Answers one call from `peer`: a stream of responses, or a status at once.
    pub fn call<B>(
        &self,
        request: http::Request<B>,
        peer: Option<SocketAddr>,
    ) -> http::Response<AdsBody>
    where
        B: http_body::Body + Send + 'static,
        B::Error: Into<StdError> + Send + 'static,
    {
        match request.uri().path() {
            SOTW_PATH => serve::<SotwStream, B>(&self.server, request, peer),
            DELTA_PATH => serve::<DeltaStream, B>(&self.server, request, peer),
            _ => Status::unimplemented("").into_http(),
        }
    }
}

/// gRPC's content type, and the header that names a message encoding.
const GRPC_CONTENT_TYPE: &str = "application/grpc";
const GRPC_ENCODING: &str = "grpc-encoding";

/// Serves one call of a method as a stream of `A`: requests read by [`Inbound`], responses
/// sent by [`ResponseBody`].
fn serve<A: Ads, B>(
    server: &XdsServer,
    request: http::Request<B>,
    peer: Option<SocketAddr>,
) -> http::Response<AdsBody>
where
    B: http_body::Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    // No compression is enabled, as in the generated server: a compressed request stream is
    // refused the way tonic refuses it.
    if let Some(encoding) = request.headers().get(GRPC_ENCODING)
        && encoding != "identity"
    {
        return Status::unimplemented(format!(
            "Content is compressed with `{}` which isn't supported",
            encoding.to_str().unwrap_or("?")
        ))
        .into_http();
    }
    let inbound = Inbound::<A::Decoder>::new(request.into_body());
    let opened = match server.open::<A>(peer, inbound) {
        Ok(opened) => opened,
        Err(status) => return status.into_http(),
    };
    let body = ResponseBody::new(
        opened.responses,
        opened.ending,
        server.shared_heads(),
        server.response_bytes(),
    );
    let mut response = http::Response::new(body.boxed_unsync());
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(GRPC_CONTENT_TYPE),
    );
    response
}

/// Response bytes on their way to the socket: counted in the gauge they were made with until
/// h2 has written them (or dropped them, with their stream).
#[derive(Debug)]
pub struct Sent {
    bytes: Bytes,
    gauge: Gauge,
}

impl Sent {
    fn new(bytes: Bytes, gauge: &Gauge) -> Self {
        gauge.inc_by(bytes.len() as i64);
        Sent {
            bytes,
            gauge: gauge.clone(),
        }
    }
}

impl Buf for Sent {
    fn remaining(&self) -> usize {
        self.bytes.len()
    }

    fn chunk(&self) -> &[u8] {
        &self.bytes
    }

    fn advance(&mut self, count: usize) {
        self.bytes.advance(count);
        self.gauge.dec_by(count as i64);
    }

    /// A slice of the bytes, not a copy.
    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        let bytes = self.bytes.split_to(len);
        self.gauge.dec_by(len as i64);
        bytes
    }
}

impl Drop for Sent {
    fn drop(&mut self) {
        self.gauge.dec_by(self.bytes.len() as i64);
    }
}

/// The body of one call's response: each message as a gRPC frame (see [`frame`]), then the
/// trailers with the status the stream ended with (`ending`).
struct ResponseBody<M> {
    responses: ReceiverStream<M>,
    ending: Arc<OnceLock<Status>>,
    heads: Arc<SharedHeads>,
    /// The parts of the current message not yet handed to h2.
    pending: VecDeque<Sent>,
    sent: Gauge,
    ended: bool,
}

impl<M> ResponseBody<M> {
    fn new(
        responses: ReceiverStream<M>,
        ending: Arc<OnceLock<Status>>,
        heads: Arc<SharedHeads>,
        sent: Gauge,
    ) -> Self {
        ResponseBody {
            responses,
            ending,
            heads,
            pending: VecDeque::new(),
            sent,
            ended: false,
        }
    }

    fn end(&mut self, status: Status) -> Result<Frame<Sent>, Status> {
        self.ended = true;
        let mut trailers = http::HeaderMap::new();
        status
            .add_header(&mut trailers)
            .map(|()| Frame::trailers(trailers))
    }
}

impl<M: Framed + Unpin> http_body::Body for ResponseBody<M> {
    type Data = Sent;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Sent>, Status>>> {
        let this = &mut *self;
        loop {
            if let Some(part) = this.pending.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(part))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            let status = match ready!(Pin::new(&mut this.responses).poll_next(cx)) {
                // Its parts are handed out at the top of the loop.
                Some(message) => {
                    let mut parts = VecDeque::new();
                    match frame(&message, &this.heads, &mut parts) {
                        Ok(()) => {
                            let sent = &this.sent;
                            this.pending
                                .extend(parts.into_iter().map(|part| Sent::new(part, sent)));
                            continue;
                        }
                        Err(status) => status,
                    }
                }
                // The stream's task sets its ending before it drops its sender; without one it
                // did not end as it should (it panicked): the proxy should retry.
                None => this.ending.get().cloned().unwrap_or_else(|| {
                    Status::unavailable("the ADS stream ended unexpectedly; reconnect")
                }),
            };
            return Poll::Ready(Some(this.end(status)));
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.pending.is_empty()
    }
}

/// One message as a gRPC length-prefixed frame (uncompressed), into `parts`: in one buffer of
/// exactly its size, or, when its head is large, as the prefix, the head shared with other
/// streams ([`SharedHeads`]) and the tail.
fn frame<M: Framed>(
    message: &M,
    heads: &SharedHeads,
    parts: &mut VecDeque<Bytes>,
) -> Result<(), Status> {
    let (head_len, tail_len) = (message.head_len(), message.tail_len());
    let len = head_len + tail_len;
    let prefix = u32::try_from(len).map_err(|_| {
        Status::resource_exhausted(format!("a response of {len} bytes exceeds gRPC's 4 GiB"))
    })?;
    if head_len < SharedHeads::MIN {
        heads.expire();
        let mut buf = BytesMut::with_capacity(5 + len);
        buf.put_u8(0);
        buf.put_u32(prefix);
        message.encode_head(&mut buf);
        message.encode_tail(&mut buf);
        parts.push_back(buf.freeze());
        return Ok(());
    }
    let mut start = BytesMut::with_capacity(5);
    start.put_u8(0);
    start.put_u32(prefix);
    parts.push_back(start.freeze());
    parts.push_back(heads.head(message, head_len));
    if tail_len > 0 {
        let mut tail = BytesMut::with_capacity(tail_len);
        message.encode_tail(&mut tail);
        parts.push_back(tail.freeze());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::future::poll_fn;

    use http_body::Body as _;
    use tokio::sync::mpsc;

    use envoy_types::pb::envoy::config::cluster::v3::Cluster;
    use prost::Message;

    use super::*;
    use crate::xds::SotwResponse;
    use crate::xds::snapshot::XdsResource;

    async fn frames(items: Vec<SotwResponse>) -> Vec<Frame<Bytes>> {
        frames_sharing(items, Some(Status::ok("")), Arc::default()).await
    }

    /// The frames of a body that sends `items`, then ends with `ending` (if set).
    async fn frames_sharing(
        items: Vec<SotwResponse>,
        ending: Option<Status>,
        heads: Arc<SharedHeads>,
    ) -> Vec<Frame<Bytes>> {
        let (tx, rx) = mpsc::channel(items.len().max(1));
        for item in items {
            tx.send(item).await.unwrap();
        }
        let end = Arc::new(OnceLock::new());
        if let Some(status) = ending {
            end.set(status).unwrap();
        }
        drop(tx);
        let gauge = Gauge::default();
        let mut body = ResponseBody::new(ReceiverStream::new(rx), end, heads, gauge.clone());
        let mut frames = Vec::new();
        while let Some(frame) = poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
            let frame = frame.unwrap().map_data(|mut sent| {
                assert!(gauge.get() >= sent.remaining() as i64, "counted until sent");
                sent.copy_to_bytes(sent.remaining())
            });
            frames.push(frame);
        }
        assert!(body.is_end_stream());
        assert_eq!(gauge.get(), 0, "every byte sent is uncounted");
        frames
    }

    fn response(nonce: &str) -> SotwResponse {
        SotwResponse {
            version_info: "v".repeat(300),
            nonce: nonce.to_string(),
            ..SotwResponse::default()
        }
    }

    fn status_of(frame: &Frame<Bytes>) -> &str {
        frame.trailers_ref().expect("trailers")["grpc-status"]
            .to_str()
            .unwrap()
    }

    #[tokio::test]
    async fn each_message_is_one_exact_frame_and_a_closed_stream_ends_with_ok() {
        let frames = frames(vec![response("1"), response("2")]).await;
        assert_eq!(frames.len(), 3);
        for (frame, nonce) in frames[..2].iter().zip(["1", "2"]) {
            let data = frame.data_ref().expect("a message");
            let message = response(nonce).encode_to_vec();
            assert_eq!(data[0], 0, "not compressed");
            assert_eq!(&data[1..5], (message.len() as u32).to_be_bytes());
            assert_eq!(&data[5..], message);
        }
        assert_eq!(status_of(&frames[2]), "0");
    }

    /// A response whose head is over [`SharedHeads::MIN`].
    fn large(resources: &[Arc<XdsResource>], nonce: &str) -> SotwResponse {
        SotwResponse {
            version_info: "7".to_string(),
            resources: resources.to_vec(),
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".to_string(),
            nonce: nonce.to_string(),
        }
    }

    fn clusters(n: usize) -> Vec<Arc<XdsResource>> {
        (0..n)
            .map(|i| {
                let name = format!("cluster-{i}-{}", "x".repeat(100));
                XdsResource::new(
                    name.clone(),
                    Cluster {
                        name,
                        ..Cluster::default()
                    },
                )
            })
            .collect()
    }

    #[tokio::test]
    async fn a_large_message_is_its_frame_in_parts_whose_head_streams_share() {
        let resources = clusters(1000);
        let heads = Arc::new(SharedHeads::default());
        let mut heads_sent = Vec::new();
        for nonce in ["1", "22"] {
            // One body per stream, both of one server.
            let frames = frames_sharing(
                vec![large(&resources, nonce)],
                Some(Status::ok("")),
                heads.clone(),
            )
            .await;
            assert_eq!(status_of(frames.last().unwrap()), "0");
            let parts: Vec<&Bytes> = frames[..frames.len() - 1]
                .iter()
                .map(|f| f.data_ref().expect("a part"))
                .collect();
            assert_eq!(parts.len(), 3, "prefix, head, tail");
            let whole: Vec<u8> = parts.iter().flat_map(|p| p.iter().copied()).collect();
            let message = large(&resources, nonce).encode_to_vec();
            assert!(message.len() > SharedHeads::MIN);
            assert_eq!(whole[0], 0, "not compressed");
            assert_eq!(&whole[1..5], (message.len() as u32).to_be_bytes());
            assert!(whole[5..] == message[..], "the parts are the message");
            heads_sent.push(parts[1].clone());
        }
        assert_eq!(
            heads_sent[0].as_ptr(),
            heads_sent[1].as_ptr(),
            "the second stream was sent the head the first encoded"
        );
        // The same names and contents, but other resources (a new snapshot's): encoded again.
        let frames = frames_sharing(
            vec![large(&clusters(1000), "3")],
            Some(Status::ok("")),
            heads,
        )
        .await;
        assert_ne!(
            frames[1].data_ref().unwrap().as_ptr(),
            heads_sent[0].as_ptr()
        );
    }

    #[tokio::test]
    async fn the_stream_ends_with_the_status_it_was_given_after_what_was_queued() {
        let frames = frames_sharing(
            vec![response("1")],
            Some(Status::permission_denied("not a pod of this node")),
            Arc::default(),
        )
        .await;
        assert_eq!(frames.len(), 2, "the queued response, then the status");
        let trailers = frames[1].trailers_ref().unwrap();
        assert_eq!(status_of(&frames[1]), "7");
        assert_eq!(trailers["grpc-message"], "not%20a%20pod%20of%20this%20node");

        let frames = frames_sharing(vec![], None, Arc::default()).await;
        assert_eq!(
            status_of(&frames[0]),
            "14",
            "no ending set: UNAVAILABLE, retry"
        );
    }

    #[tokio::test]
    async fn a_body_dropped_unsent_leaves_nothing_counted() {
        let (tx, rx) = mpsc::channel(4);
        let gauge = Gauge::default();
        let mut body = ResponseBody::new(
            ReceiverStream::new(rx),
            Arc::default(),
            Arc::default(),
            gauge.clone(),
        );
        tx.send(large(&clusters(1000), "1")).await.unwrap();
        let first = poll_fn(|cx| Pin::new(&mut body).poll_frame(cx))
            .await
            .unwrap()
            .unwrap();
        let whole = large(&clusters(1000), "1").encoded_len() as i64 + 5;
        assert_eq!(gauge.get(), whole, "the message, encoded, is counted");
        drop(body);
        assert_eq!(gauge.get(), 5, "only the part h2 holds");
        drop(first);
        assert_eq!(gauge.get(), 0);
    }
}
