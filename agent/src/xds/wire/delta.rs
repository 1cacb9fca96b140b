//! The incremental request, `DeltaDiscoveryRequest`, with `initial_resource_versions` packed: a
//! reconnecting client names every resource it holds with its version (20k at 10k services, per
//! stream); the generated type decodes them into a SipHash `HashMap` of `String` pairs grown
//! entry by entry, which a profile of the agent's restart showed among the Delta streams'
//! largest costs (docs/benchmarks.md, "Delta reconnects read packed").

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::ResourceLocator;
use envoy_types::pb::google::rpc::Status;
use prost::DecodeError;
use prost::bytes::{Buf, BufMut};
use prost::encoding::{
    DecodeContext, WireType, encode_key, encode_varint, encoded_len_varint, key_len, message,
    skip_field, string,
};

use crate::xds::proto::{encode_string, string_len};

/// An ADS `DeltaDiscoveryRequest` (envoy.service.discovery.v3) with `initial_resource_versions`
/// packed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeltaRequest {
    /// Field 1.
    pub node: Option<Node>,
    /// Field 2.
    pub type_url: String,
    /// Field 3, packed.
    pub resource_names_subscribe: PackedNames,
    /// Field 4.
    pub resource_names_unsubscribe: Vec<String>,
    /// Field 5, a map.
    pub initial_resource_versions: VersionList,
    /// Field 6.
    pub response_nonce: String,
    /// Field 7.
    pub error_detail: Option<Status>,
}

/// Names in one buffer, in the order received. A whole-mesh proxy's first endpoint request
/// subscribes to every cluster (50k names at 50k services): decoded as the generated type
/// does, a `String` each, allocated and freed once per name.
#[derive(Clone, Debug, Default)]
pub struct PackedNames {
    text: String,
    /// Per name, the end offset of it in `text`.
    ends: Vec<u32>,
    /// Reused for each name while decoding.
    scratch: String,
}

impl PackedNames {
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// The names, in the order received.
    pub fn iter(&self) -> impl Iterator<Item = &str> + '_ {
        let mut start = 0;
        self.ends.iter().map(move |&end| {
            let name = &self.text[start..end as usize];
            start = end as usize;
            name
        })
    }

    pub fn push(&mut self, name: &str) {
        // One gRPC message is bounded far below 4 GiB by its size limit.
        self.text.push_str(name);
        self.ends
            .push(u32::try_from(self.text.len()).unwrap_or(u32::MAX));
    }

    /// Reads one name of the field, as prost reads a repeated string's element.
    fn merge(
        &mut self,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        let mut name = std::mem::take(&mut self.scratch);
        name.clear();
        let merged = string::merge(wire_type, &mut name, buf, ctx);
        if merged.is_ok() {
            self.push(&name);
        }
        self.scratch = name;
        merged
    }

    fn encode(&self, tag: u32, buf: &mut impl BufMut) {
        // Every element, empty or not, as prost writes a repeated string.
        for name in self.iter() {
            encode_key(tag, WireType::LengthDelimited, buf);
            encode_varint(name.len() as u64, buf);
            buf.put_slice(name.as_bytes());
        }
    }

    fn encoded_len(&self, tag: u32) -> usize {
        self.iter()
            .map(|name| key_len(tag) + encoded_len_varint(name.len() as u64) + name.len())
            .sum()
    }
}

impl PartialEq for PackedNames {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text && self.ends == other.ends
    }
}

impl<S: AsRef<str>> FromIterator<S> for PackedNames {
    fn from_iter<I: IntoIterator<Item = S>>(names: I) -> Self {
        let mut list = PackedNames::default();
        for name in names {
            list.push(name.as_ref());
        }
        list
    }
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
        self.resource_names_subscribe.encode(3, buf);
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
            3 => self.resource_names_subscribe.merge(wire_type, buf, ctx),
            4 => string::merge_repeated(wire_type, &mut self.resource_names_unsubscribe, buf, ctx),
            5 => {
                let list = &mut self.initial_resource_versions;
                let mut entry = std::mem::take(&mut list.scratch);
                // A field an entry leaves out is empty, not the previous entry's.
                prost::Message::clear(&mut entry);
                // Read as length-delimited whatever wire type the key says, as prost reads a
                // map entry (its generated decoder does not check it).
                let _ = wire_type;
                let merged = message::merge(WireType::LengthDelimited, &mut entry, buf, ctx);
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
            // `resource_locators_subscribe` and `_unsubscribe`, unused: read as prost reads
            // them (their errors are prost's), and dropped.
            8 | 9 => message::merge(wire_type, &mut ResourceLocator::default(), buf, ctx),
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
            + self.resource_names_subscribe.encoded_len(3)
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
