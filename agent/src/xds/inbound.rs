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
//! compression flag, a four-byte length, the message. The rules are tonic's, with its messages:
//! a compressed message is refused (no compression is offered), a message over tonic's 4 MiB
//! default is refused, a body that ends inside a message is an error, and a cancelled body
//! ends the stream quietly.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::pin::Pin;

use bytes::{Buf, Bytes};
use http_body::Body;
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use prost::DecodeError;
use tonic::{Code, Status};

/// tonic's default limit on a decoded message.
const MAX_MESSAGE: usize = 4 << 20;
/// A gRPC message's prefix: compression flag and length.
const HEADER: usize = 5;

/// Decodes one stream's requests (one decoder per stream, so it may remember).
pub trait RequestDecoder: Default + Send + 'static {
    type Request;

    /// Decodes a whole message: `buf` holds exactly its bytes.
    fn decode(&mut self, buf: &mut impl Buf) -> Result<Self::Request, DecodeError>;
}

/// Decodes each message alone, with its prost implementation.
pub struct Plain<M>(std::marker::PhantomData<fn() -> M>);

impl<M> Default for Plain<M> {
    fn default() -> Self {
        Plain(std::marker::PhantomData)
    }
}

impl<M: prost::Message + Default + 'static> RequestDecoder for Plain<M> {
    type Request = M;

    fn decode(&mut self, buf: &mut impl Buf) -> Result<M, DecodeError> {
        M::decode(buf)
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
    ended: bool,
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
            ended: false,
        }
    }

    /// The next request; `None` when the client ended its stream. Cancel-safe: what was read
    /// stays in `self`.
    pub async fn message(&mut self) -> Result<Option<D::Request>, Status> {
        loop {
            if let Some(request) = self.decode()? {
                return Ok(Some(request));
            }
            if self.ended {
                return if self.held > 0 || self.message.is_some() {
                    Err(Status::internal("Unexpected EOF decoding stream."))
                } else {
                    Ok(None)
                };
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    // Trailers of a request carry nothing the agent reads.
                    if let Ok(data) = frame.into_data()
                        && !data.is_empty()
                    {
                        self.held += data.len();
                        self.frames.push_back(data);
                    }
                }
                // The client reset its stream: as tonic, an end rather than an error.
                Some(Err(status)) if status.code() == Code::Cancelled => {
                    self.ended = true;
                    self.frames.clear();
                    (self.held, self.message) = (0, None);
                }
                Some(Err(status)) => return Err(status),
                None => self.ended = true,
            }
        }
    }

    /// Decodes the next message if all of it is here.
    fn decode(&mut self) -> Result<Option<D::Request>, Status> {
        let len = match self.message {
            Some(len) => len,
            None if self.held < HEADER => return Ok(None),
            None => {
                let mut prefix = Frames::new(&mut self.frames, HEADER);
                let (flag, len) = (prefix.get_u8(), prefix.get_u32() as usize);
                self.held -= HEADER;
                match flag {
                    0 => {}
                    1 => {
                        return Err(Status::internal(
                            "protocol error: received message with compressed-flag but no \
                             grpc-encoding was specified",
                        ));
                    }
                    other => {
                        return Err(Status::internal(format!(
                            "protocol error: received message with invalid compression flag: \
                             {other} (valid flags are 0 and 1), while sending request"
                        )));
                    }
                }
                if len > MAX_MESSAGE {
                    return Err(Status::out_of_range(format!(
                        "Error, decoded message length too large: found {len} bytes, the \
                         limit is: {MAX_MESSAGE} bytes"
                    )));
                }
                self.message = Some(len);
                len
            }
        };
        if self.held < len {
            return Ok(None);
        }
        let mut message = Frames::new(&mut self.frames, len);
        let decoded = self.decoder.decode(&mut message);
        // A decoder that failed may have stopped short: the rest of its message goes.
        let rest = message.remaining();
        message.advance(rest);
        self.held -= len;
        self.message = None;
        decoded
            .map(Some)
            .map_err(|error| Status::internal(error.to_string()))
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

    use super::*;
    use crate::xds::wire::SotwRequest;

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
        while let Some(request) = inbound.message().await? {
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

            // As a SotW stream reads them, names packed: the same names across the frames.
            let read = read_all::<Plain<SotwRequest>>(&bytes, size).await.unwrap();
            let nonces: Vec<&str> = read.iter().map(|r| r.response_nonce.as_str()).collect();
            assert_eq!(nonces, ["1", "2", "", "3"]);
            assert_eq!(read[3].resource_names, read[0].resource_names);
            assert_eq!(
                read[3].resource_names.iter().collect::<Vec<_>>(),
                names.iter().map(String::as_str).collect::<Vec<_>>()
            );
        }
    }

    #[tokio::test]
    async fn refuses_what_tonic_refuses() {
        let message = request(&["a".into()], "1").encode_to_vec();
        let compressed = read_all::<Plain<DiscoveryRequest>>(&framed(1, &message), 3).await;
        assert_eq!(compressed.unwrap_err().code(), Code::Internal);
        let flag = read_all::<Plain<DiscoveryRequest>>(&framed(7, &message), 3).await;
        assert_eq!(flag.unwrap_err().code(), Code::Internal);

        let mut large = vec![0];
        large.extend_from_slice(&(MAX_MESSAGE as u32 + 1).to_be_bytes());
        let large = read_all::<Plain<DiscoveryRequest>>(&large, 5).await;
        assert_eq!(large.unwrap_err().code(), Code::OutOfRange);

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
        assert_eq!(bad.unwrap_err().code(), Code::Internal);
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
