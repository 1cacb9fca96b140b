//! The incremental request, `DeltaDiscoveryRequest`, with `initial_resource_versions` packed: a
//! reconnecting client names every resource it holds with its version (20k at 10k services, per
//! stream); the generated type decodes them into a SipHash `HashMap` of `String` pairs grown
//! entry by entry, which a profile of the agent's restart showed among the Delta streams'
//! largest costs (docs/benchmarks.md, "Agent restart"). Its subscriptions are
//! kept as a state-of-the-world request's names are ([`NameList`]), and both lists are read a
//! run of entries at a time where they lie whole in the buffer's current chunk.

use bytestring::ByteString;
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::ResourceLocator;
use envoy_types::pb::google::rpc::Status;
use prost::DecodeError;
use prost::bytes::{Buf, BufMut};
use prost::encoding::{
    DecodeContext, WireType, decode_key, encode_key, encode_varint, encoded_len_varint, key_len,
    message, skip_field, string,
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

/// Names and their versions in the order received. A name given twice is listed twice; read
/// in order, the last wins, as in the map the field is.
///
/// A run of entries read in place is kept where it lay: a slice of the request's frame (its
/// keys and lengths between the names and versions), not a copy. At 50k services a
/// whole-mesh proxy's reconnect lists 100k entries, 5 MB of names and versions; copied into
/// a buffer of their own, they were an eighth of the agent's CPU while a hundred proxies
/// reconnected, a third of that the page faults of the fresh buffer (docs/benchmarks.md,
/// "The 50k restart").
#[derive(Clone, Debug, Default)]
pub struct VersionList {
    /// The texts the entries lie in, in the order they were read.
    runs: Vec<Run>,
    /// Per entry, where its name and its version lie in its run's text.
    spans: Vec<Span>,
    /// Reused for each entry while decoding.
    scratch: VersionEntry,
    /// The bytes of the message the entries come in, which holds them all: room for their
    /// spans is made at the first entry (see [`VersionList::with_room`]).
    room: usize,
}

/// The text some entries lie in, and where their spans end in [`VersionList::spans`].
#[derive(Clone, Debug)]
struct Run {
    text: RunText,
    end: usize,
}

#[derive(Clone, Debug)]
enum RunText {
    /// Entries read in place: the bytes of the request they lay in (keys and lengths among
    /// them), checked as UTF-8 when read.
    Read(ByteString),
    /// Entries pushed one by one (read through prost, or made): their names and versions one
    /// after another.
    Pushed(String),
}

impl RunText {
    fn text(&self) -> &str {
        match self {
            RunText::Read(text) => text,
            RunText::Pushed(text) => text,
        }
    }
}

/// Where an entry's name and version lie in its run's text.
#[derive(Clone, Copy, Debug)]
struct Span {
    name: (u32, u32),
    version: (u32, u32),
}

impl Span {
    /// One gRPC message is bounded far below 4 GiB by its size limit.
    fn new(name: std::ops::Range<usize>, version: std::ops::Range<usize>) -> Span {
        let at = |offset: usize| u32::try_from(offset).unwrap_or(u32::MAX);
        Span {
            name: (at(name.start), at(name.end)),
            version: (at(version.start), at(version.end)),
        }
    }

    fn of<'t>(&self, text: &'t str) -> Option<(&'t str, &'t str)> {
        let range = |(start, end): (u32, u32)| start as usize..end as usize;
        Some((text.get(range(self.name))?, text.get(range(self.version))?))
    }
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
    /// bytes, instead of growing as they come: a span for every 32 bytes (an entry of this
    /// agent's versions is about 40 bytes or more on the wire; more entries only grow the
    /// list).
    pub fn with_room(room: usize) -> VersionList {
        VersionList {
            room,
            ..VersionList::default()
        }
    }

    pub fn len(&self) -> usize {
        self.spans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// (name, version), in the order received. A span lies on character boundaries of its
    /// run (see [`VersionList::read_run`]), so none is left out.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> + '_ {
        let mut start = 0;
        self.runs.iter().flat_map(move |run| {
            let text = run.text.text();
            let spans = self.spans.get(start..run.end).unwrap_or_default();
            start = run.end;
            spans.iter().filter_map(move |span| span.of(text))
        })
    }

    fn make_room(&mut self) {
        if self.spans.capacity() == 0 {
            self.spans.reserve(self.room / 32);
        }
    }

    pub fn push(&mut self, name: &str, version: &str) {
        self.make_room();
        if !matches!(
            self.runs.last(),
            Some(Run {
                text: RunText::Pushed(_),
                ..
            })
        ) {
            self.runs.push(Run {
                text: RunText::Pushed(String::new()),
                end: self.spans.len(),
            });
        }
        let Some(Run {
            text: RunText::Pushed(text),
            end,
        }) = self.runs.last_mut()
        else {
            unreachable!("a run of pushed entries was made last above");
        };
        let name_start = text.len();
        text.push_str(name);
        let version_start = text.len();
        text.push_str(version);
        self.spans.push(Span::new(
            name_start..version_start,
            version_start..text.len(),
        ));
        *end = self.spans.len();
    }

    /// Reads one entry of field 5, whose key was just read (as length-delimited whatever wire
    /// type the key says, as prost reads a map entry: its generated decoder does not check
    /// it), and the run of entries after it that lie whole in `buf`'s current chunk. An entry
    /// as Envoy and prost write it (its name, then its version, nothing else, each length one
    /// byte) is read in place; any other (a field left out or repeated, another field, a name
    /// of about 100 bytes or more, one across chunks) through prost's map-entry decoding,
    /// with its bounds and errors. At 50k services the
    /// entries read one by one through prost, each copied twice, were half of the agent's CPU
    /// while a hundred whole-mesh proxies reconnected (docs/benchmarks.md, "The 50k restart").
    fn merge(&mut self, buf: &mut impl Buf, ctx: DecodeContext) -> Result<(), DecodeError> {
        if self.read_run(buf, ctx.clone())? {
            return Ok(());
        }
        self.merge_entry(buf, ctx)
    }

    /// One entry, whose key was just read, through prost's map-entry decoding.
    fn merge_entry(&mut self, buf: &mut impl Buf, ctx: DecodeContext) -> Result<(), DecodeError> {
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
    /// key is not field 5's). The run is kept as it lies in `buf` (`copy_to_bytes`, which the
    /// request's frames answer with a slice of one, [`crate::xds::inbound::Frames`]) and
    /// checked as UTF-8 at once: every key and one-byte length is an ASCII byte, a whole
    /// character, so in a valid run every name and version starts and ends on a character
    /// boundary and is valid itself, and an invalid run has an invalid name or version. That
    /// one is rejected by prost, as it would be alone: the run is read again through it.
    fn read_run(&mut self, buf: &mut impl Buf, ctx: DecodeContext) -> Result<bool, DecodeError> {
        let chunk = buf.chunk();
        let first = self.spans.len();
        let (mut at, mut last) = (0, 0);
        // Room is made whether or not a run follows: without one, the entry is pushed.
        self.make_room();
        while let Some(entry) = short_entry(chunk, at, chunk.len()) {
            self.spans.push(Span::new(entry.name, entry.version));
            last = entry.end;
            if chunk.get(last) != Some(&VERSION_KEY) {
                break;
            }
            at = last + 1;
        }
        if last == 0 {
            return Ok(false);
        }
        let run = buf.copy_to_bytes(last);
        match ByteString::try_from(run.clone()) {
            Ok(text) => {
                self.runs.push(Run {
                    text: RunText::Read(text),
                    end: self.spans.len(),
                });
                Ok(true)
            }
            Err(_) => {
                self.spans.truncate(first);
                let mut run = run;
                self.merge_entry(&mut run, ctx.clone())?;
                while run.has_remaining() {
                    // Field 5's key, as the run ended each entry but its last with it.
                    decode_key(&mut run)?;
                    self.merge_entry(&mut run, ctx.clone())?;
                }
                Ok(true)
            }
        }
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

/// The same entries in the same order, however they were read.
impl PartialEq for VersionList {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
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

    /// Room made for a message is made once, at the first entry: spans of entries that fit
    /// in it never move. Without room, the same entries' spans do.
    #[test]
    fn a_list_with_room_grows_in_place() {
        let entries: Vec<(String, String)> = (0..1000)
            .map(|i| (format!("outbound|80||s{i}.bar.foo"), format!("{i:016x}")))
            .collect();
        let fill = |list: &mut VersionList| {
            list.push(&entries[0].0, &entries[0].1);
            let spans = list.spans.as_ptr();
            for (name, version) in &entries[1..] {
                list.push(name, version);
            }
            spans == list.spans.as_ptr()
        };
        let wire_len = entries.len() * 48;
        assert!(fill(&mut VersionList::with_room(wire_len)));
        assert!(!fill(&mut VersionList::default()));
    }

    /// A run of entries read in place is the request's bytes, not a copy of them; an entry
    /// that is not in the plain form is read by prost, and all come back in order.
    #[test]
    fn a_run_is_kept_where_it_lay() {
        use prost::bytes::Bytes;

        let entries: Vec<(String, String)> = (0..50)
            .map(|i| (format!("outbound|80||s{i}.bar.foo"), format!("{i:016x}")))
            .chain([("l".repeat(200), "7".to_string())])
            .chain((50..60).map(|i| (format!("s{i}"), format!("{i:016x}"))))
            .collect();
        let request = DeltaRequest {
            initial_resource_versions: entries.iter().cloned().collect(),
            ..DeltaRequest::default()
        };
        let wire = Bytes::from(prost::Message::encode_to_vec(&request));
        let mut buf = wire.clone();
        let read: DeltaRequest = prost::Message::decode(&mut buf).unwrap();
        let list = &read.initial_resource_versions;
        let expected: Vec<(&str, &str)> = entries
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        assert_eq!(list.iter().collect::<Vec<_>>(), expected);
        let kinds: Vec<bool> = list
            .runs
            .iter()
            .map(|run| match &run.text {
                RunText::Read(text) => {
                    let within = wire.as_ptr_range();
                    assert!(within.contains(&text.as_ptr()), "a slice of the request");
                    true
                }
                RunText::Pushed(_) => false,
            })
            .collect();
        assert_eq!(
            kinds,
            [true, false, true],
            "read, the long one by prost, read"
        );
    }
}
