//! How responses go on the wire. The generated `DiscoveryResponse` and `DeltaDiscoveryResponse`
//! own their resources: building one meant cloning every resource's `Any` (its type URL and its
//! bytes, two allocations) for every stream, and the 16 responses a stream may queue each held
//! their own copy. At 10k services and a hundred proxies that is a million clones in an initial
//! sync; a profile showed the clone as a tenth of the agent's CPU. [`SotwResponse`] and [`DeltaResponse`] hold the snapshot's resources by `Arc` and encode
//! them straight from there, to the same bytes as the generated types (the tests compare them).
//!
//! Encode-only and hand-written for the same reason as [`super::wire`]: prost's generator has no
//! hook for a field's representation. The server never decodes a response; `merge_field` skips
//! what it is given.
//!
//! A response is its head (every field before the nonce) and its tail (the nonce, and a Delta
//! response's removals). In an initial sync every proxy of a kind is sent the same heads: at
//! 10k services a hundred streams each encoded the same 5–6 MB, and that copy was a fifth of
//! the agent's CPU in the sync (perf). [`SharedHeads`] keeps a large head encoded once, for
//! every stream that sends the very same resources with the same version and type, for as long
//! as streams keep asking for it.

use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use prost::DecodeError;
use prost::bytes::{Buf, BufMut};
use prost::encoding::{
    DecodeContext, WireType, encode_key, encode_varint, encoded_len_varint, key_len, message,
    skip_field, string,
};

use super::proto::{encode_string, string_len};
use super::snapshot::XdsResource;

/// An ADS `DiscoveryResponse` (envoy.service.discovery.v3) whose resources are shared.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SotwResponse {
    /// Field 1.
    pub version_info: String,
    /// Field 2: each resource's `Any`.
    pub resources: Vec<Arc<XdsResource>>,
    /// Field 4.
    pub type_url: String,
    /// Field 5.
    pub nonce: String,
}

/// An ADS `DeltaDiscoveryResponse` whose resources are shared.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeltaResponse {
    /// Field 1.
    pub system_version_info: String,
    /// Field 2: each a `Resource` with its name, version and `Any`.
    pub resources: Vec<Arc<XdsResource>>,
    /// Field 4.
    pub type_url: String,
    /// Field 5.
    pub nonce: String,
    /// Field 6.
    pub removed_resources: Vec<String>,
}

/// Neither response is ever decoded by the agent: every field is skipped.
fn skip(
    wire_type: WireType,
    tag: u32,
    buf: &mut impl Buf,
    ctx: DecodeContext,
) -> Result<(), DecodeError> {
    skip_field(wire_type, tag, buf, ctx)
}

impl Framed for SotwResponse {
    const KIND: u8 = 0;

    fn head(&self) -> Head<'_> {
        Head {
            version: &self.version_info,
            type_url: &self.type_url,
            resources: &self.resources,
        }
    }

    fn encode_head(&self, buf: &mut impl BufMut) {
        encode_string(1, &self.version_info, buf);
        for resource in &self.resources {
            message::encode(2, &resource.body, buf);
        }
        encode_string(4, &self.type_url, buf);
    }

    fn head_len(&self) -> usize {
        string_len(1, &self.version_info)
            + self
                .resources
                .iter()
                .map(|r| message::encoded_len(2, &r.body))
                .sum::<usize>()
            + string_len(4, &self.type_url)
    }

    fn encode_tail(&self, buf: &mut impl BufMut) {
        encode_string(5, &self.nonce, buf);
    }

    fn tail_len(&self) -> usize {
        string_len(5, &self.nonce)
    }
}

impl prost::Message for SotwResponse {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        self.encode_head(buf);
        self.encode_tail(buf);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        skip(wire_type, tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        self.head_len() + self.tail_len()
    }

    fn clear(&mut self) {
        *self = SotwResponse::default();
    }
}

/// A resource's version on the wire (16 hex digits), without a `String`.
fn version_digits(version: u64) -> [u8; 16] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    std::array::from_fn(|i| HEX[((version >> (60 - 4 * i)) & 0xf) as usize])
}

/// The length of a Delta `Resource` message: version (1), resource (2) and name (3). Fields go
/// out in the order of their numbers, as prost writes them.
fn delta_resource_len(resource: &XdsResource) -> usize {
    string_len(3, &resource.name) + key_len(1) + 1 + 16 + message::encoded_len(2, &resource.body)
}

impl Framed for DeltaResponse {
    const KIND: u8 = 1;

    fn head(&self) -> Head<'_> {
        Head {
            version: &self.system_version_info,
            type_url: &self.type_url,
            resources: &self.resources,
        }
    }

    fn encode_head(&self, buf: &mut impl BufMut) {
        encode_string(1, &self.system_version_info, buf);
        for resource in &self.resources {
            encode_key(2, WireType::LengthDelimited, buf);
            encode_varint(delta_resource_len(resource) as u64, buf);
            encode_key(1, WireType::LengthDelimited, buf);
            encode_varint(16, buf);
            buf.put_slice(&version_digits(resource.version));
            message::encode(2, &resource.body, buf);
            encode_string(3, &resource.name, buf);
        }
        encode_string(4, &self.type_url, buf);
    }

    fn head_len(&self) -> usize {
        string_len(1, &self.system_version_info)
            + self
                .resources
                .iter()
                .map(|r| {
                    let len = delta_resource_len(r);
                    key_len(2) + encoded_len_varint(len as u64) + len
                })
                .sum::<usize>()
            + string_len(4, &self.type_url)
    }

    fn encode_tail(&self, buf: &mut impl BufMut) {
        encode_string(5, &self.nonce, buf);
        string::encode_repeated(6, &self.removed_resources, buf);
    }

    fn tail_len(&self) -> usize {
        string_len(5, &self.nonce) + string::encoded_len_repeated(6, &self.removed_resources)
    }
}

impl prost::Message for DeltaResponse {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        self.encode_head(buf);
        self.encode_tail(buf);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        skip(wire_type, tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        self.head_len() + self.tail_len()
    }

    fn clear(&mut self) {
        *self = DeltaResponse::default();
    }
}

/// A response as two parts: its head, the fields before the nonce, which streams sent the same
/// resources share, and its tail, the stream's own. Fields go out in the order of their
/// numbers, head then tail, as prost writes them.
pub trait Framed: prost::Message {
    /// Which response type this is; heads of different types are never shared.
    const KIND: u8;
    /// What makes two heads the same.
    fn head(&self) -> Head<'_>;
    /// How many resources it carries.
    fn resource_count(&self) -> usize {
        self.head().resources.len()
    }
    fn encode_head(&self, buf: &mut impl BufMut);
    fn head_len(&self) -> usize;
    fn encode_tail(&self, buf: &mut impl BufMut);
    fn tail_len(&self) -> usize;
}

/// A head's identity: its version, its type and the very same resources (by `Arc`), in order.
pub struct Head<'a> {
    version: &'a str,
    type_url: &'a str,
    resources: &'a [Arc<XdsResource>],
}

impl Head<'_> {
    fn fingerprint(&self, kind: u8) -> u64 {
        let mut hasher = foldhash::fast::FixedState::default().build_hasher();
        kind.hash(&mut hasher);
        self.version.hash(&mut hasher);
        self.type_url.hash(&mut hasher);
        for resource in self.resources {
            hasher.write_usize(Arc::as_ptr(resource) as usize);
        }
        hasher.finish()
    }
}

/// A head encoded once, with what it was encoded from. Holding the resources keeps their
/// addresses from being reused by other resources while the entry lives, so comparing
/// pointers is comparing contents.
struct SharedHead {
    fingerprint: u64,
    kind: u8,
    version: String,
    type_url: String,
    resources: Vec<Arc<XdsResource>>,
    bytes: Bytes,
    used: Instant,
}

impl SharedHead {
    fn is(&self, kind: u8, fingerprint: u64, head: &Head<'_>) -> bool {
        self.fingerprint == fingerprint
            && self.kind == kind
            && self.version == head.version
            && self.type_url == head.type_url
            && self.resources.len() == head.resources.len()
            && self
                .resources
                .iter()
                .zip(head.resources)
                .all(|(a, b)| Arc::ptr_eq(a, b))
    }
}

/// Large heads encoded once for every stream that sends them (see the top). An entry is dropped
/// once no stream asked for it for [`SharedHeads::IDLE`] (checked whenever a stream sends a
/// response), or to keep the total under [`SharedHeads::BUDGET`] (least recently used first).
#[derive(Default)]
pub struct SharedHeads {
    heads: Mutex<Vec<SharedHead>>,
    /// How many heads are kept, read without the lock.
    kept: AtomicUsize,
}

impl SharedHeads {
    /// Heads smaller than this are encoded per stream: the copy costs less than the lookup,
    /// and a change's responses (one resource or a few) never repeat it.
    pub const MIN: usize = 64 << 10;
    /// Streams of one sync ask for a head within a second or so of each other.
    const IDLE: Duration = Duration::from_secs(2);
    /// At 10k services the heads of one sync are about 6 MB per response type and kind.
    const BUDGET: usize = 64 << 20;

    /// `response`'s head, encoded: shared with the streams that sent the same one before.
    pub fn head<M: Framed>(&self, response: &M, len: usize) -> Bytes {
        let wanted = response.head();
        let fingerprint = wanted.fingerprint(M::KIND);
        let now = Instant::now();
        {
            let mut heads = self.lock();
            self.drop_idle(&mut heads, now);
            if let Some(known) = heads
                .iter_mut()
                .find(|h| h.is(M::KIND, fingerprint, &wanted))
            {
                known.used = now;
                return known.bytes.clone();
            }
        }
        // Encoded outside the lock: two streams may both encode a head first asked for at
        // once; the second insert replaces the first.
        let mut buf = BytesMut::with_capacity(len);
        response.encode_head(&mut buf);
        let bytes = buf.freeze();
        let mut heads = self.lock();
        heads.retain(|h| !h.is(M::KIND, fingerprint, &wanted));
        heads.push(SharedHead {
            fingerprint,
            kind: M::KIND,
            version: wanted.version.to_string(),
            type_url: wanted.type_url.to_string(),
            resources: wanted.resources.to_vec(),
            bytes: bytes.clone(),
            used: now,
        });
        let mut total: usize = heads.iter().map(|h| h.bytes.len()).sum();
        while total > Self::BUDGET {
            let Some(oldest) = (0..heads.len()).min_by_key(|&i| heads[i].used) else {
                break;
            };
            total -= heads.swap_remove(oldest).bytes.len();
        }
        self.kept.store(heads.len(), Ordering::Relaxed);
        bytes
    }

    /// Drops the heads no stream asked for lately: called for every response sent, so the
    /// sync's heads do not outlive it by more than [`SharedHeads::IDLE`] while streams run.
    pub fn expire(&self) {
        if self.kept.load(Ordering::Relaxed) == 0 {
            return;
        }
        self.drop_idle(&mut self.lock(), Instant::now());
    }

    fn drop_idle(&self, heads: &mut Vec<SharedHead>, now: Instant) {
        heads.retain(|h| now.saturating_duration_since(h.used) < Self::IDLE);
        self.kept.store(heads.len(), Ordering::Relaxed);
    }

    /// How many heads are kept (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<SharedHead>> {
        self.heads.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::config::cluster::v3::Cluster;
    use envoy_types::pb::envoy::service::discovery::v3::{
        DeltaDiscoveryResponse, DiscoveryResponse, Resource,
    };
    use prost::Message;

    use super::*;
    use crate::xds::snapshot::format_version;

    fn resources() -> Vec<Arc<XdsResource>> {
        ["a", "bb", &"long-name.".repeat(30), ""]
            .into_iter()
            .map(|name| {
                XdsResource::new(
                    name,
                    Cluster {
                        name: name.to_string(),
                        ..Cluster::default()
                    },
                )
            })
            .collect()
    }

    #[test]
    fn sotw_encodes_as_the_generated_type_does() {
        for (version, nonce, resources) in
            [("0123456789abcdef", "7", resources()), ("", "", Vec::new())]
        {
            let ours = SotwResponse {
                version_info: version.to_string(),
                resources: resources.clone(),
                type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".to_string(),
                nonce: nonce.to_string(),
            };
            let generated = DiscoveryResponse {
                version_info: version.to_string(),
                resources: resources.iter().map(|r| r.body.clone()).collect(),
                type_url: ours.type_url.clone(),
                nonce: nonce.to_string(),
                ..DiscoveryResponse::default()
            };
            assert!(ours.encode_to_vec() == generated.encode_to_vec());
            assert_eq!(ours.encoded_len(), generated.encoded_len());
        }
    }

    #[test]
    fn delta_encodes_as_the_generated_type_does() {
        let mut resources = resources();
        resources.push(Arc::new(XdsResource {
            name: "max".into(),
            version: u64::MAX,
            body: resources[0].body.clone(),
        }));
        resources.push(Arc::new(XdsResource {
            name: "zero".into(),
            version: 0,
            body: resources[0].body.clone(),
        }));
        let ours = DeltaResponse {
            system_version_info: "42".to_string(),
            resources: resources.clone(),
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".to_string(),
            removed_resources: vec!["gone".to_string(), String::new(), "x".repeat(200)],
            nonce: "9".to_string(),
        };
        let generated = DeltaDiscoveryResponse {
            system_version_info: "42".to_string(),
            resources: resources
                .iter()
                .map(|r| Resource {
                    name: r.name.to_string(),
                    version: format_version(r.version),
                    resource: Some(r.body.clone()),
                    ..Resource::default()
                })
                .collect(),
            type_url: ours.type_url.clone(),
            removed_resources: ours.removed_resources.clone(),
            nonce: "9".to_string(),
            ..DeltaDiscoveryResponse::default()
        };
        assert!(ours.encode_to_vec() == generated.encode_to_vec());
        assert_eq!(ours.encoded_len(), generated.encoded_len());
        assert_eq!(
            DeltaResponse::default().encode_to_vec(),
            DeltaDiscoveryResponse::default().encode_to_vec()
        );
    }

    #[test]
    fn a_head_is_shared_only_by_responses_of_the_same_kind_version_type_and_resources() {
        let heads = SharedHeads::default();
        let sotw = |version: &str, resources: Vec<Arc<XdsResource>>, nonce: &str| SotwResponse {
            version_info: version.to_string(),
            resources,
            type_url: "t".to_string(),
            nonce: nonce.to_string(),
        };
        let shared = |response: &SotwResponse| heads.head(response, response.head_len());
        let (a, b) = (resources(), resources());
        let first = shared(&sotw("1", a.clone(), "1"));
        assert_eq!(first[..], sotw("1", a.clone(), "").encode_to_vec()[..]);
        assert_eq!(shared(&sotw("1", a.clone(), "2")).as_ptr(), first.as_ptr());
        for other in [
            sotw("2", a.clone(), "1"),
            sotw("1", b, "1"),
            sotw("1", a[1..].to_vec(), "1"),
        ] {
            assert_ne!(shared(&other).as_ptr(), first.as_ptr());
        }
        let delta = DeltaResponse {
            system_version_info: "1".to_string(),
            resources: a,
            type_url: "t".to_string(),
            ..DeltaResponse::default()
        };
        assert_ne!(
            heads.head(&delta, delta.head_len()).as_ptr(),
            first.as_ptr()
        );
        assert_eq!(heads.len(), 5);
    }

    #[test]
    fn version_digits_are_the_wire_version() {
        for version in [0, 1, 0xabc, 0x0123_4567_89ab_cdef, u64::MAX] {
            assert_eq!(
                std::str::from_utf8(&version_digits(version)).unwrap(),
                format_version(version)
            );
        }
    }
}
