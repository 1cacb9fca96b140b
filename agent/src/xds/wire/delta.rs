//! The incremental request, `DeltaDiscoveryRequest`, with `initial_resource_versions` packed: a
//! reconnecting client names every resource it holds with its version (20k at 10k services, per
//! stream); the generated type decodes them into a SipHash `HashMap` of `String` pairs grown
//! entry by entry, which a profile of the agent's restart showed among the Delta streams'
//! largest costs (docs/benchmarks.md, "Agent restart"). Its subscriptions are
//! kept as a state-of-the-world request's names are ([`NameList`]), and both lists are read a
//! run of entries at a time where they lie whole in the buffer's current chunk.

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::ResourceLocator;
use envoy_types::pb::google::rpc::Status;
use prost::DecodeError;
use prost::bytes::{Buf, BufMut};
use prost::encoding::{
    DecodeContext, WireType, encode_key, encode_varint, encoded_len_varint, key_len, message,
    skip_field, string,
};

use super::names::NameList;
use crate::xds::inbound::WithRoom;
use crate::xds::proto::{encode_string, string_len};

/// Field 5 (`initial_resource_versions`), length-delimited: the key of each entry.
const VERSION_KEY: u8 = (5 << 3) | 2;
/// A map entry's key (1) and value (2), length-delimited: the name and its version.
const ENTRY_NAME_KEY: u8 = (1 << 3) | 2;
const ENTRY_VERSION_KEY: u8 = (2 << 3) | 2;

/// An ADS `DeltaDiscoveryRequest` (envoy.service.discovery.v3) with `initial_resource_versions`
/// packed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeltaRequest {
    /// Field 1.
    pub node: Option<Node>,
    /// Field 2.
    pub type_url: String,
    /// Field 3, packed.
    pub resource_names_subscribe: NameList,
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
    /// The bytes of text to make room for at the first entry: the length of the message the
    /// entries come in, which holds them all (see [`VersionList::with_room`]).
    room: usize,
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
    /// A list that makes room at its first entry for the entries of a message of `room`
    /// bytes, instead of growing as they come: its text at most that, and an entry's ends for
    /// every 32 bytes (an entry of this agent's versions is about 40 bytes or more on the
    /// wire; more entries only grow the list).
    pub fn with_room(room: usize) -> VersionList {
        VersionList {
            room,
            ..VersionList::default()
        }
    }

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
        if self.ends.capacity() == 0 {
            self.text.reserve(self.room);
            self.ends.reserve(self.room / 32);
        }
        self.text.push_str(name);
        let name_end = end(&self.text);
        self.text.push_str(version);
        self.ends.push((name_end, end(&self.text)));
    }

    /// Reads one entry of field 5, whose key was just read (as length-delimited whatever wire
    /// type the key says, as prost reads a map entry: its generated decoder does not check
    /// it), and the run of entries after it that lie whole in `buf`'s current chunk. An entry
    /// as Envoy and prost write it (its name, then its version, nothing else, each length one
    /// byte) is read in place; any other (a field left out or repeated, another field, a name
    /// of about 100 bytes or more, one across chunks, bad UTF-8) through prost's map-entry
    /// decoding, with its bounds and errors. At 50k services the
    /// entries read one by one through prost, each copied twice, were half of the agent's CPU
    /// while a hundred whole-mesh proxies reconnected (docs/benchmarks.md, "The 50k restart").
    fn merge(&mut self, buf: &mut impl Buf, ctx: DecodeContext) -> Result<(), DecodeError> {
        if self.read_run(buf) {
            return Ok(());
        }
        let mut entry = std::mem::take(&mut self.scratch);
        // A field an entry leaves out is empty, not the previous entry's.
        prost::Message::clear(&mut entry);
        let merged = message::merge(WireType::LengthDelimited, &mut entry, buf, ctx);
        if merged.is_ok() {
            self.push(&entry.name, &entry.version);
        }
        self.scratch = entry;
        merged
    }

    /// The entries read in place by [`VersionList::merge`]: whether it read any. The run
    /// stops before the first entry that is not whole in the chunk, not in the plain form, or
    /// with a length of two bytes or more, and after the last entry of the field (the next
    /// key is not field 5's). Every key and one-byte length is an ASCII byte, a whole
    /// character, so the run is checked as UTF-8 at once, as a run of SotW names is (see
    /// [`NameList`]): its names and versions start and end on character boundaries.
    fn read_run(&mut self, buf: &mut impl Buf) -> bool {
        let chunk = buf.chunk();
        // Where the run of entries within the first `limit` bytes ends (0: no entry).
        let run = |limit: usize| {
            let (mut at, mut last) = (0, 0);
            while let Some(entry) = short_entry(chunk, at, limit) {
                last = entry.end;
                if chunk.get(last) != Some(&VERSION_KEY) {
                    break;
                }
                at = last + 1;
            }
            last
        };
        let mut last = run(chunk.len());
        let text = match std::str::from_utf8(&chunk[..last]) {
            Ok(text) => text,
            // Up to the entry before the first invalid byte: the bad one is left to prost,
            // which rejects it.
            Err(error) => {
                last = run(error.valid_up_to());
                match std::str::from_utf8(&chunk[..last]) {
                    Ok(text) => text,
                    Err(_) => return false,
                }
            }
        };
        let mut at = 0;
        while let Some(entry) = short_entry(chunk, at, last) {
            // Slices of `text` at ASCII bytes, so at character boundaries.
            let (Some(name), Some(version)) = (text.get(entry.name), text.get(entry.version))
            else {
                break;
            };
            self.push(name, version);
            at = entry.end + 1;
        }
        buf.advance(last);
        last > 0
    }
}

/// Where an entry of the short, plain form lies: its name and version, and its end.
struct ShortEntry {
    name: std::ops::Range<usize>,
    version: std::ops::Range<usize>,
    end: usize,
}

/// The entry whose length is the byte at `at` in `chunk`, when it ends within `limit`, as its
/// name (field 1) then its version (field 2) and nothing else, with every length under 128
/// (one byte). Its text is not checked here.
fn short_entry(chunk: &[u8], at: usize, limit: usize) -> Option<ShortEntry> {
    let short = |at: usize| {
        chunk
            .get(at)
            .filter(|&&len| len < 0x80)
            .map(|&len| usize::from(len))
    };
    let end = at + 1 + short(at)?;
    let name_key = at + 1;
    if end > limit || chunk.get(name_key) != Some(&ENTRY_NAME_KEY) {
        return None;
    }
    let name = name_key + 2..name_key + 2 + short(name_key + 1)?;
    let version_key = name.end;
    if chunk.get(version_key) != Some(&ENTRY_VERSION_KEY) {
        return None;
    }
    let version = version_key + 2..version_key + 2 + short(version_key + 1)?;
    (version.end == end).then_some(ShortEntry { name, version, end })
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

/// A reconnect's message holds its subscription or its versions, or both: each may take the
/// whole message, and room not written to is never touched.
impl WithRoom for DeltaRequest {
    fn with_room(len: usize) -> Self {
        DeltaRequest {
            resource_names_subscribe: NameList::with_room(len),
            initial_resource_versions: VersionList::with_room(len),
            ..DeltaRequest::default()
        }
    }
}

impl prost::Message for DeltaRequest {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        if let Some(node) = &self.node {
            message::encode(1, node, buf);
        }
        encode_string(2, &self.type_url, buf);
        self.resource_names_subscribe.encode(buf);
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
            5 => self.initial_resource_versions.merge(buf, ctx),
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
            + self.resource_names_subscribe.encoded_len()
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
    use super::*;

    /// Room made for a message is made once, at the first entry: entries that fit in it never
    /// move the list's buffers. Without room, the same entries do.
    #[test]
    fn a_list_with_room_grows_in_place() {
        let entries: Vec<(String, String)> = (0..1000)
            .map(|i| (format!("outbound|80||s{i}.bar.foo"), format!("{i:016x}")))
            .collect();
        let fill = |list: &mut VersionList| {
            list.push(&entries[0].0, &entries[0].1);
            let (text, ends) = (list.text.as_ptr(), list.ends.as_ptr());
            for (name, version) in &entries[1..] {
                list.push(name, version);
            }
            (text == list.text.as_ptr(), ends == list.ends.as_ptr())
        };
        let wire_len = entries.len() * 48;
        assert_eq!(fill(&mut VersionList::with_room(wire_len)), (true, true));
        assert_eq!(fill(&mut VersionList::default()), (false, false));
    }
}
