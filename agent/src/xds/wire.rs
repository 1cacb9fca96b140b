//! How ADS requests are read off the wire. Envoy repeats its whole subscription in every
//! state-of-the-world request, so at 10k services each endpoint ACK names 10k clusters. Decoded
//! through the generated `DiscoveryRequest`, that is 10k `String`s allocated and freed per ACK,
//! per stream, which a profile at that scale showed as the largest share of the agent's CPU per
//! change (`malloc`/`free` about 40 % of its samples, docs/benchmarks.md). [`SotwRequest`]
//! decodes the same message with the names kept as their bytes on the wire, copied a run at a
//! time into one buffer, so a stream recognises an unchanged subscription by a hash of that
//! buffer, without a string or a step per name.
//! [`DeltaRequest`] does the same for what a reconnecting Delta client holds
//! (`initial_resource_versions`, 20k names and versions at that scale).
//!
//! Hand-written rather than generated: prost's generator has no per-field representation hook,
//! and the message is small and stable (xDS v3). Fields the agent does not use
//! (`resource_locators`, unknown fields) are skipped, as prost skips unknown fields.

use std::hash::BuildHasher;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::google::rpc::Status;
use prost::DecodeError;
use prost::bytes::{Buf, BufMut};
use prost::encoding::{
    DecodeContext, WireType, encode_key, encode_varint, encoded_len_varint, key_len, message,
    skip_field, string,
};

/// An ADS `DiscoveryRequest` (envoy.service.discovery.v3), with its resource names packed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SotwRequest {
    /// Field 1.
    pub version_info: String,
    /// Field 2.
    pub node: Option<Node>,
    /// Field 3, `resource_names`.
    pub resource_names: NameList,
    /// Field 4.
    pub type_url: String,
    /// Field 5.
    pub response_nonce: String,
    /// Field 6.
    pub error_detail: Option<Status>,
}

/// A request's resource names as they came on the wire: each `resource_names` entry (key,
/// length, bytes) one after another in one buffer, every name checked as UTF-8 when read.
/// Envoy sends the same subscription in the same order on every ACK, so a stream recognises
/// it by a hash of these bytes, taken at once over the buffer, without a step per name.
#[derive(Clone, Debug, Default)]
pub struct NameList {
    /// Field 3's entries as prost writes them (a one-byte key, the length as a minimal varint,
    /// the name), so the same names in the same order are the same bytes however the message
    /// was split into chunks.
    wire: Vec<u8>,
    len: usize,
    /// How many names are 128 bytes or longer (a length of two bytes or more).
    long: usize,
    /// Reused for a name read through prost's path, so it costs no allocation of its own.
    scratch: String,
}

/// Field 3 (`resource_names`), length-delimited: the key of each entry.
const NAME_KEY: u8 = (3 << 3) | 2;

impl NameList {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The names in the order they came.
    pub fn iter(&self) -> impl Iterator<Item = &str> + Clone + '_ {
        // Without a name of 128 bytes or more, every key and length is one ASCII byte, so the
        // whole buffer is text: one UTF-8 check here (it was checked as read; this cannot
        // fail), then names are sliced from it at character boundaries (next to those ASCII
        // bytes), not checked one by one.
        let text = if self.long == 0 {
            std::str::from_utf8(&self.wire).ok()
        } else {
            None
        };
        let mut at = 0;
        std::iter::from_fn(move || {
            let wire = &self.wire;
            let (start, end) = match text {
                Some(_) => {
                    let len = usize::from(*wire.get(at + 1)?);
                    (at + 2, at + 2 + len)
                }
                None => {
                    let mut rest = wire.get(at + 1..)?;
                    let before = rest.len();
                    let len = prost::encoding::decode_varint(&mut rest).ok()?;
                    let start = at + 1 + before - rest.len();
                    (start, start + usize::try_from(len).ok()?)
                }
            };
            at = end;
            match text {
                Some(text) => text.get(start..end),
                None => std::str::from_utf8(wire.get(start..end)?).ok(),
            }
        })
    }

    /// Recognises the same names in the same order again: a hash of the entries and their
    /// count. Equal fingerprints of different lists are possible but improbable (64-bit hash);
    /// the stream that relies on it only skips re-reading an unchanged subscription, and a
    /// reordered list is only read again. A fixed seed is enough: the fingerprint is only
    /// compared with the same stream's previous request, so a client choosing colliding names
    /// could only confuse itself.
    pub fn fingerprint(&self) -> (u64, usize) {
        let hash = foldhash::fast::FixedState::default().hash_one(self.wire.as_slice());
        (hash, self.len)
    }

    pub fn push(&mut self, name: &str) {
        if name.len() >= 0x80 {
            self.long += 1;
        }
        self.wire.push(NAME_KEY);
        encode_varint(name.len() as u64, &mut self.wire);
        self.wire.extend_from_slice(name.as_bytes());
        self.len += 1;
    }

    fn clear(&mut self) {
        self.wire.clear();
        self.len = 0;
        self.long = 0;
    }

    /// Reads, from the start of `chunk`, the length and bytes of a `resource_names` entry
    /// whose key was just read, and the whole entries (key, length, bytes) that follow it, as
    /// long as each lies in `chunk` and is shorter than 128 bytes (a one-byte length); returns
    /// how many bytes it read, 0 when it read nothing (then the caller reads the entry its
    /// own way, with prost's bounds and UTF-8 errors). The run is checked as UTF-8 at once
    /// and copied at once: keys and one-byte lengths are ASCII, a whole character each, so
    /// every name in a valid run starts and ends on a character boundary and is valid itself.
    fn read_run(&mut self, chunk: &[u8]) -> usize {
        // The end of the entry whose length byte is at `at`, if it lies in the chunk.
        let entry = |at: usize| {
            let len = *chunk.get(at)?;
            let end = at + 1 + usize::from(len);
            (len < 0x80 && end <= chunk.len()).then_some(end)
        };
        let entries = |limit: usize| {
            let (mut at, mut count, mut last) = (0, 0, 0);
            while let Some(end) = entry(at).filter(|&end| end <= limit) {
                (count, last) = (count + 1, end);
                if chunk.get(end) != Some(&NAME_KEY) {
                    break;
                }
                at = end + 1;
            }
            (count, last)
        };
        let (mut count, mut last) = entries(chunk.len());
        if let Err(e) = std::str::from_utf8(&chunk[..last]) {
            // Up to the entry before the first invalid byte: the names before it are read
            // here, and the bad one is left to the caller, which rejects it (so a bad name
            // late in a long run costs one more pass, not one per name before it).
            (count, last) = entries(e.valid_up_to());
        }
        if count > 0 {
            self.wire.push(NAME_KEY);
            self.wire.extend_from_slice(&chunk[..last]);
            self.len += count;
        }
        last
    }
}

/// The same names in the same order.
impl PartialEq for NameList {
    fn eq(&self, other: &Self) -> bool {
        self.wire == other.wire
    }
}

impl<'a> FromIterator<&'a str> for NameList {
    fn from_iter<I: IntoIterator<Item = &'a str>>(names: I) -> Self {
        let mut list = NameList::default();
        for name in names {
            list.push(name);
        }
        list
    }
}

/// A proto3 string field: left out when empty, as prost writes it.
pub(super) fn encode_string(tag: u32, value: &str, buf: &mut impl BufMut) {
    if !value.is_empty() {
        encode_key(tag, WireType::LengthDelimited, buf);
        encode_varint(value.len() as u64, buf);
        buf.put_slice(value.as_bytes());
    }
}

/// The encoded length of what [`encode_string`] writes.
pub(super) fn string_len(tag: u32, value: &str) -> usize {
    if value.is_empty() {
        0
    } else {
        key_len(tag) + encoded_len_varint(value.len() as u64) + value.len()
    }
}

impl prost::Message for SotwRequest {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        encode_string(1, &self.version_info, buf);
        if let Some(node) = &self.node {
            message::encode(2, node, buf);
        }
        // The names are kept as their entries on the wire.
        buf.put_slice(&self.resource_names.wire);
        encode_string(4, &self.type_url, buf);
        encode_string(5, &self.response_nonce, buf);
        if let Some(status) = &self.error_detail {
            message::encode(6, status, buf);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        match tag {
            1 => string::merge(wire_type, &mut self.version_info, buf, ctx),
            2 => message::merge(
                wire_type,
                self.node.get_or_insert_with(Node::default),
                buf,
                ctx,
            ),
            3 => {
                // Envoy writes its names one after another, and most lie whole in the buffer's
                // current chunk: read the run of them in place, validated as UTF-8 and copied
                // into the list at once (a profile of the change phase at 10k services had the
                // per-name key, length and UTF-8 reads at a third of the agent's CPU, and then
                // the per-name hash and copy at a quarter).
                if wire_type == WireType::LengthDelimited {
                    let read = self.resource_names.read_run(buf.chunk());
                    if read > 0 {
                        buf.advance(read);
                        return Ok(());
                    }
                }
                // Else (a name across chunks, one of 128 bytes or more, or a bad one) prost's
                // own string decoding (bounds, UTF-8, its errors) into a reused buffer.
                let mut scratch = std::mem::take(&mut self.resource_names.scratch);
                let merged = string::merge(wire_type, &mut scratch, buf, ctx);
                if merged.is_ok() {
                    self.resource_names.push(&scratch);
                }
                self.resource_names.scratch = scratch;
                merged
            }
            4 => string::merge(wire_type, &mut self.type_url, buf, ctx),
            5 => string::merge(wire_type, &mut self.response_nonce, buf, ctx),
            6 => message::merge(
                wire_type,
                self.error_detail.get_or_insert_with(Status::default),
                buf,
                ctx,
            ),
            _ => skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        let names = self.resource_names.wire.len();
        string_len(1, &self.version_info)
            + self.node.as_ref().map_or(0, |n| message::encoded_len(2, n))
            + names
            + string_len(4, &self.type_url)
            + string_len(5, &self.response_nonce)
            + self
                .error_detail
                .as_ref()
                .map_or(0, |s| message::encoded_len(6, s))
    }

    fn clear(&mut self) {
        self.version_info.clear();
        self.node = None;
        self.resource_names.clear();
        self.type_url.clear();
        self.response_nonce.clear();
        self.error_detail = None;
    }
}

/// An ADS `DeltaDiscoveryRequest` (envoy.service.discovery.v3) with `initial_resource_versions`
/// packed. A reconnecting client names every resource it holds with its version (20k at 10k
/// services, per stream); the generated type decodes them into a SipHash `HashMap` of `String`
/// pairs grown entry by entry, which a profile of the agent's restart showed among the Delta
/// streams' largest costs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeltaRequest {
    /// Field 1.
    pub node: Option<Node>,
    /// Field 2.
    pub type_url: String,
    /// Field 3.
    pub resource_names_subscribe: Vec<String>,
    /// Field 4.
    pub resource_names_unsubscribe: Vec<String>,
    /// Field 5, a map.
    pub initial_resource_versions: VersionList,
    /// Field 6.
    pub response_nonce: String,
    /// Field 7.
    pub error_detail: Option<Status>,
}

/// Names and their versions in one buffer, in the order received. A name given twice is
/// listed twice; read in order, the last wins, as in the map the field is.
#[derive(Clone, Debug, Default)]
pub struct VersionList {
    text: String,
    /// Per entry, the end offsets of its name and of its version in `text`.
    ends: Vec<(u32, u32)>,
    /// Reused for each entry while decoding.
    scratch: VersionEntry,
}

/// One entry of the map field on the wire.
#[derive(Clone, PartialEq, prost::Message)]
struct VersionEntry {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(string, tag = "2")]
    version: String,
}

impl VersionList {
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// (name, version), in the order received.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> + '_ {
        let mut start = 0;
        self.ends.iter().map(move |&(name_end, version_end)| {
            let (name, version) = (
                &self.text[start..name_end as usize],
                &self.text[name_end as usize..version_end as usize],
            );
            start = version_end as usize;
            (name, version)
        })
    }

    pub fn push(&mut self, name: &str, version: &str) {
        // One gRPC message is bounded far below 4 GiB by its size limit.
        let end = |text: &String| u32::try_from(text.len()).unwrap_or(u32::MAX);
        self.text.push_str(name);
        let name_end = end(&self.text);
        self.text.push_str(version);
        self.ends.push((name_end, end(&self.text)));
    }
}

impl PartialEq for VersionList {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text && self.ends == other.ends
    }
}

impl<N: AsRef<str>, V: AsRef<str>> FromIterator<(N, V)> for VersionList {
    fn from_iter<I: IntoIterator<Item = (N, V)>>(entries: I) -> Self {
        let mut list = VersionList::default();
        for (name, version) in entries {
            list.push(name.as_ref(), version.as_ref());
        }
        list
    }
}

fn version_entry_len(name: &str, version: &str) -> usize {
    string_len(1, name) + string_len(2, version)
}

impl prost::Message for DeltaRequest {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        if let Some(node) = &self.node {
            message::encode(1, node, buf);
        }
        encode_string(2, &self.type_url, buf);
        string::encode_repeated(3, &self.resource_names_subscribe, buf);
        string::encode_repeated(4, &self.resource_names_unsubscribe, buf);
        for (name, version) in self.initial_resource_versions.iter() {
            // A map entry is a message of its key (1) and value (2).
            encode_key(5, WireType::LengthDelimited, buf);
            encode_varint(version_entry_len(name, version) as u64, buf);
            encode_string(1, name, buf);
            encode_string(2, version, buf);
        }
        encode_string(6, &self.response_nonce, buf);
        if let Some(status) = &self.error_detail {
            message::encode(7, status, buf);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        match tag {
            1 => message::merge(
                wire_type,
                self.node.get_or_insert_with(Node::default),
                buf,
                ctx,
            ),
            2 => string::merge(wire_type, &mut self.type_url, buf, ctx),
            3 => string::merge_repeated(wire_type, &mut self.resource_names_subscribe, buf, ctx),
            4 => string::merge_repeated(wire_type, &mut self.resource_names_unsubscribe, buf, ctx),
            5 => {
                let list = &mut self.initial_resource_versions;
                let mut entry = std::mem::take(&mut list.scratch);
                // A field an entry leaves out is empty, not the previous entry's.
                prost::Message::clear(&mut entry);
                let merged = message::merge(wire_type, &mut entry, buf, ctx);
                if merged.is_ok() {
                    list.push(&entry.name, &entry.version);
                }
                list.scratch = entry;
                merged
            }
            6 => string::merge(wire_type, &mut self.response_nonce, buf, ctx),
            7 => message::merge(
                wire_type,
                self.error_detail.get_or_insert_with(Status::default),
                buf,
                ctx,
            ),
            _ => skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        let versions: usize = self
            .initial_resource_versions
            .iter()
            .map(|(name, version)| {
                let len = version_entry_len(name, version);
                key_len(5) + encoded_len_varint(len as u64) + len
            })
            .sum();
        self.node.as_ref().map_or(0, |n| message::encoded_len(1, n))
            + string_len(2, &self.type_url)
            + string::encoded_len_repeated(3, &self.resource_names_subscribe)
            + string::encoded_len_repeated(4, &self.resource_names_unsubscribe)
            + versions
            + string_len(6, &self.response_nonce)
            + self
                .error_detail
                .as_ref()
                .map_or(0, |s| message::encoded_len(7, s))
    }

    fn clear(&mut self) {
        *self = DeltaRequest::default();
    }
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, ResourceLocator};
    use std::collections::HashMap;

    use prost::Message;
    use prost::bytes::Bytes;

    use super::*;

    /// `bytes` as tonic may hand them to a decoder: in two chunks, split at every place.
    fn every_split(bytes: &[u8]) -> impl Iterator<Item = impl Buf> + '_ {
        (0..bytes.len()).map(|split| {
            let (a, b) = bytes.split_at(split);
            Bytes::copy_from_slice(a).chain(Bytes::copy_from_slice(b))
        })
    }

    fn full_request(names: &[&str]) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: "v7".into(),
            node: Some(Node {
                id: "client-1.default".into(),
                cluster: "client".into(),
                ..Node::default()
            }),
            resource_names: names.iter().map(|n| n.to_string()).collect(),
            resource_locators: vec![ResourceLocator {
                name: "ignored".into(),
                ..ResourceLocator::default()
            }],
            type_url: "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment".into(),
            response_nonce: "12".into(),
            error_detail: Some(Status {
                code: 3,
                message: "bad".into(),
                details: Vec::new(),
            }),
        }
    }

    #[test]
    fn decodes_what_the_generated_type_encodes() {
        let names = ["outbound|80||a", "outbound|80||b", "ünïcode|1", ""];
        let generated = full_request(&names);
        let ours = SotwRequest::decode(generated.encode_to_vec().as_slice()).unwrap();
        assert_eq!(ours.version_info, generated.version_info);
        assert_eq!(ours.node, generated.node);
        assert_eq!(ours.resource_names.iter().collect::<Vec<_>>(), names);
        assert_eq!(ours.type_url, generated.type_url);
        assert_eq!(ours.response_nonce, generated.response_nonce);
        assert_eq!(ours.error_detail, generated.error_detail);

        // And back: what we encode is the generated message without the skipped locators.
        let again = DiscoveryRequest::decode(ours.encode_to_vec().as_slice()).unwrap();
        assert_eq!(ours.encoded_len(), ours.encode_to_vec().len());
        let mut expected = generated;
        expected.resource_locators.clear();
        assert_eq!(again, expected);
    }

    #[test]
    fn a_delta_request_decodes_as_the_generated_type_does() {
        use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
        let generated = DeltaDiscoveryRequest {
            node: full_request(&[]).node,
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            resource_names_subscribe: vec!["a|1".into(), "ü|2".into()],
            resource_names_unsubscribe: vec!["gone|3".into()],
            initial_resource_versions: [("a|1", "7"), ("b|2", ""), ("", "9")]
                .into_iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            response_nonce: "4".into(),
            error_detail: full_request(&[]).error_detail,
            resource_locators_subscribe: vec![ResourceLocator {
                name: "ignored".into(),
                ..ResourceLocator::default()
            }],
            ..DeltaDiscoveryRequest::default()
        };
        let bytes = generated.encode_to_vec();
        let ours = DeltaRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(ours.node, generated.node);
        assert_eq!(ours.type_url, generated.type_url);
        assert_eq!(
            ours.resource_names_subscribe,
            generated.resource_names_subscribe
        );
        assert_eq!(
            ours.resource_names_unsubscribe,
            generated.resource_names_unsubscribe
        );
        assert_eq!(ours.response_nonce, generated.response_nonce);
        assert_eq!(ours.error_detail, generated.error_detail);
        let mut versions: Vec<(&str, &str)> = ours.initial_resource_versions.iter().collect();
        versions.sort();
        assert_eq!(versions, [("", "9"), ("a|1", "7"), ("b|2", "")]);

        // And back, across every split of the buffer.
        let again = DeltaDiscoveryRequest::decode(ours.encode_to_vec().as_slice()).unwrap();
        assert_eq!(ours.encoded_len(), ours.encode_to_vec().len());
        let mut expected = generated;
        expected.resource_locators_subscribe.clear();
        assert_eq!(again, expected);
        for chained in every_split(&bytes) {
            assert_eq!(DeltaRequest::decode(chained).unwrap(), ours);
        }
        // A name given twice: read in order, the last version wins, as in the map.
        let twice: VersionList = [("x", "1"), ("x", "2")].into_iter().collect();
        let last: HashMap<&str, &str> = twice.iter().collect();
        assert_eq!(last["x"], "2");
        // Truncated.
        assert!(DeltaRequest::decode(&bytes[..bytes.len() - 3]).is_err());
    }

    #[test]
    fn decodes_across_buffer_chunks() {
        // tonic hands the decoder a buffer of several chunks: a name may straddle two.
        let names: Vec<String> = (0..50).map(|i| format!("cluster-{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let bytes = full_request(&refs).encode_to_vec();
        for chained in every_split(&bytes) {
            let ours = SotwRequest::decode(chained).unwrap();
            assert_eq!(ours.resource_names.iter().collect::<Vec<_>>(), refs);
        }
    }

    /// Runs of names read at once end where a name is 128 bytes or longer, or where the chunk
    /// ends; whatever the split, the names are the generated type's, and a bad name in the
    /// middle of a run is rejected as it is alone.
    #[test]
    fn runs_of_names_read_alike_whatever_their_length_and_split() {
        let long = |n: usize| "x".repeat(n);
        let (l127, l128, l300) = (long(127), long(128), long(300));
        let names = ["a|1", "", &l127, "b|ü2", &l128, "c|3", &l300, "d|4", "e|5"];
        let bytes = full_request(&names).encode_to_vec();
        for chained in every_split(&bytes) {
            let ours = SotwRequest::decode(chained).unwrap();
            assert_eq!(ours.resource_names.iter().collect::<Vec<_>>(), names);
        }
        let mut bad = DiscoveryRequest {
            resource_names: vec!["abc".into(), "def".into(), "ghi".into()],
            ..DiscoveryRequest::default()
        }
        .encode_to_vec();
        let middle = bad.iter().position(|b| *b == b'e').unwrap();
        bad[middle] = 0xff;
        assert!(DiscoveryRequest::decode(bad.as_slice()).is_err());
        assert!(SotwRequest::decode(bad.as_slice()).is_err());
    }

    #[test]
    fn rejects_what_the_generated_type_rejects() {
        let mut bytes = DiscoveryRequest {
            resource_names: vec!["abc".into()],
            ..DiscoveryRequest::default()
        }
        .encode_to_vec();
        // The name's last byte becomes an invalid UTF-8 continuation.
        let last = bytes.len() - 1;
        bytes[last] = 0xff;
        assert!(DiscoveryRequest::decode(bytes.as_slice()).is_err());
        assert!(SotwRequest::decode(bytes.as_slice()).is_err());
        // Truncated.
        let good = full_request(&["a"]).encode_to_vec();
        assert!(SotwRequest::decode(&good[..good.len() - 3]).is_err());
    }

    #[test]
    fn fingerprint_sees_a_change_whatever_the_split() {
        let a: NameList = ["x", "y", "zzzzzzzzzzz"].into_iter().collect();
        let reordered: NameList = ["zzzzzzzzzzz", "x", "y"].into_iter().collect();
        let changed: NameList = ["x", "y", "zzzzzzzzzzy"].into_iter().collect();
        let fewer: NameList = ["x", "y"].into_iter().collect();
        let moved: NameList = ["xy", "", "zzzzzzzzzzz"].into_iter().collect();
        for other in [&reordered, &changed, &fewer, &moved] {
            assert_ne!(a.fingerprint(), other.fingerprint());
        }
        // The same names read in runs, one by one, or across chunks: the same fingerprint.
        let long = "l".repeat(200);
        let names = ["x", &long, "y", "zzzzzzzzzzz"];
        let pushed: NameList = names.into_iter().collect();
        let bytes = full_request(&names).encode_to_vec();
        for chained in every_split(&bytes) {
            let decoded = SotwRequest::decode(chained).unwrap();
            assert_eq!(decoded.resource_names.fingerprint(), pushed.fingerprint());
            assert_eq!(decoded.resource_names, pushed);
            assert_eq!(decoded.resource_names.len(), names.len());
        }
    }
}
