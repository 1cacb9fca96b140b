//! How ADS requests are read off the wire. Envoy repeats its whole subscription in every
//! state-of-the-world request, so at 10k services each endpoint ACK names 10k clusters. Decoded
//! through the generated `DiscoveryRequest`, that is 10k `String`s allocated and freed per ACK,
//! per stream, which a profile at that scale showed as the largest share of the agent's CPU per
//! change (`malloc`/`free` about 40 % of its samples, docs/benchmarks.md). [`SotwRequest`]
//! decodes the same message with the names kept as their bytes on the wire, so a stream
//! recognises an unchanged subscription by a hash of those bytes, without a string or a step
//! per name; a list the stream sent before is recognised by its bytes alone ([`SotwDecoder`]).
//! [`DeltaRequest`] does the same for what a reconnecting Delta client holds
//! (`initial_resource_versions`, 20k names and versions at that scale).
//!
//! Hand-written rather than generated: prost's generator has no per-field representation hook,
//! and the message is small and stable (xDS v3). Fields the agent does not use
//! (`resource_locators`, unknown fields) are skipped, as prost skips unknown fields.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::io::IoSlice;
use std::sync::{Arc, LazyLock, Mutex, PoisonError, Weak};

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::google::rpc::Status;
use prost::DecodeError;

use super::inbound::RequestDecoder;
use prost::bytes::{Buf, BufMut, Bytes};
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
/// length, bytes) one after another, every name checked as UTF-8 when read. Envoy sends the
/// same subscription in the same order on every ACK, so a stream recognises it by a hash of
/// these bytes, taken at once over them, without a step per name.
#[derive(Clone, Debug, Default)]
pub struct NameList {
    /// Field 3's entries as prost writes them (a one-byte key, the length as a minimal varint,
    /// the name), without the first entry's key (it is always [`NAME_KEY`], and it was read
    /// before the run that starts with the first length), so the same names in the same
    /// order are the same bytes however the message was split into chunks.
    entries: Entries,
    len: usize,
    /// How many names are 128 bytes or longer (a length of two bytes or more).
    long: usize,
    /// Reused for a name read through prost's path, so it costs no allocation of its own.
    scratch: String,
    /// The fingerprint, when it is known without hashing (see [`SotwDecoder`]).
    hash: Option<u64>,
    /// While a request is decoded: the lists its stream sent last, lent by the stream's
    /// [`SotwDecoder`].
    known: Vec<KnownList>,
}

/// A list of names a stream sent before, as [`SotwDecoder`] keeps it.
#[derive(Clone, Debug)]
struct KnownList {
    entries: Arc<[u8]>,
    len: usize,
    long: usize,
    hash: u64,
}

/// The entries' bytes: a list the stream sent before, shared; where they lay in the request's
/// buffer when a new list came as one run (one HTTP/2 frame holds it, see [`super::inbound`]);
/// or a buffer of their own.
#[derive(Clone, Debug)]
enum Entries {
    Shared(Bytes),
    /// A list the stream sent before ([`SotwDecoder`]).
    Known(Arc<[u8]>),
    Owned(Vec<u8>),
}

impl Default for Entries {
    fn default() -> Self {
        Entries::Owned(Vec::new())
    }
}

impl Entries {
    fn as_slice(&self) -> &[u8] {
        match self {
            Entries::Shared(bytes) => bytes,
            Entries::Known(known) => known,
            Entries::Owned(vec) => vec,
        }
    }

    /// The entries as a buffer of their own, to append to.
    fn owned(&mut self) -> &mut Vec<u8> {
        if !matches!(self, Entries::Owned(_)) {
            *self = Entries::Owned(self.as_slice().to_vec());
        }
        match self {
            Entries::Owned(vec) => vec,
            Entries::Shared(_) | Entries::Known(_) => unreachable!("made owned above"),
        }
    }
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
        let entries = self.entries.as_slice();
        // Without a name of 128 bytes or more, every key and length is one ASCII byte, so the
        // whole buffer is text: one UTF-8 check here (it was checked as read; this cannot
        // fail), then names are sliced from it at character boundaries (next to those ASCII
        // bytes), not checked one by one.
        let text = if self.long == 0 {
            std::str::from_utf8(entries).ok()
        } else {
            None
        };
        // `at`: where the next entry's length is (the first entry's key is not kept).
        let mut at = 0;
        std::iter::from_fn(move || {
            let (start, end) = match text {
                Some(_) => {
                    let len = usize::from(*entries.get(at)?);
                    (at + 1, at + 1 + len)
                }
                None => {
                    let mut rest = entries.get(at..)?;
                    let before = rest.len();
                    let len = prost::encoding::decode_varint(&mut rest).ok()?;
                    let start = at + before - rest.len();
                    (start, start + usize::try_from(len).ok()?)
                }
            };
            // Past this entry's name and the next one's key.
            at = end + 1;
            match text {
                Some(text) => text.get(start..end),
                None => std::str::from_utf8(entries.get(start..end)?).ok(),
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
        let hash = self
            .hash
            .unwrap_or_else(|| hash_entries(self.entries.as_slice()));
        (hash, self.len)
    }

    /// Whether the list was recognised as one its stream sent before (see [`SotwDecoder`]).
    pub fn is_known(&self) -> bool {
        matches!(self.entries, Entries::Known(_))
    }

    pub fn push(&mut self, name: &str) {
        self.hash = None;
        if name.len() >= 0x80 {
            self.long += 1;
        }
        let first = self.len == 0;
        let entries = self.entries.owned();
        if !first {
            entries.push(NAME_KEY);
        }
        encode_varint(name.len() as u64, entries);
        entries.extend_from_slice(name.as_bytes());
        self.len += 1;
    }

    fn clear(&mut self) {
        match &mut self.entries {
            Entries::Owned(vec) => vec.clear(),
            shared => *shared = Entries::default(),
        }
        self.len = 0;
        self.long = 0;
        self.hash = None;
    }

    /// If `buf` starts with a whole list this stream sent before (its entries, then the end
    /// of the message or another field), takes that list as this one: one comparison of the
    /// bytes, no walk over the entries, no UTF-8 check (those bytes were checked when first
    /// read), no hash.
    fn read_known(&mut self, buf: &mut impl Buf) -> bool {
        // The request's bytes as they lie, in HTTP/2 frames of 16 KiB (see
        // [`super::inbound`]): 256 of them cover tonic's 4 MiB limit on a message.
        let mut parts = [IoSlice::new(&[]); 256];
        let filled = buf.chunks_vectored(&mut parts);
        let (parts, remaining) = (&parts[..filled], buf.remaining());
        let Some(known) = self
            .known
            .iter()
            .find(|k| starts_with_list(parts, &k.entries, remaining))
        else {
            return false;
        };
        let n = known.entries.len();
        (self.len, self.long, self.hash) = (known.len, known.long, Some(known.hash));
        self.entries = Entries::Known(known.entries.clone());
        buf.advance(n);
        true
    }

    /// Reads, from the start of `buf`'s current chunk, the length and bytes of a
    /// `resource_names` entry whose key was just read, and the whole entries (key, length,
    /// bytes) that follow it, as long as each lies in the chunk and is shorter than 128 bytes
    /// (a one-byte length); returns whether it read anything (if not, the caller reads the
    /// entry its own way, with prost's bounds and UTF-8 errors). The run is checked as UTF-8 at
    /// once: keys and one-byte lengths are ASCII, a whole character each, so every name in a
    /// valid run starts and ends on a character boundary and is valid itself. A first run is
    /// taken as it lies in `buf` (`copy_to_bytes`, which the request's frames answer with a
    /// slice of one, [`super::inbound::Frames`]); a later one is copied after what was read
    /// before.
    fn read_run(&mut self, buf: &mut impl Buf) -> bool {
        let chunk = buf.chunk();
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
        if count == 0 {
            return false;
        }
        self.hash = None;
        if self.len == 0 {
            self.entries = Entries::Shared(buf.copy_to_bytes(last));
        } else {
            let owned = self.entries.owned();
            owned.push(NAME_KEY);
            owned.extend_from_slice(&chunk[..last]);
            buf.advance(last);
        }
        self.len += count;
        true
    }

    /// What [`prost::Message::encode_raw`] writes of these names: every entry, keys included.
    fn encode(&self, buf: &mut impl BufMut) {
        if self.len > 0 {
            buf.put_u8(NAME_KEY);
            buf.put_slice(self.entries.as_slice());
        }
    }

    fn encoded_len(&self) -> usize {
        match self.len {
            0 => 0,
            _ => 1 + self.entries.as_slice().len(),
        }
    }
}

/// The same names in the same order.
impl PartialEq for NameList {
    fn eq(&self, other: &Self) -> bool {
        self.entries.as_slice() == other.entries.as_slice()
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

/// Whether a buffer whose first bytes are `parts` (`remaining` in all) starts with the list
/// `entries` and not a longer one: after them, the end of the message or another field.
fn starts_with_list(parts: &[IoSlice<'_>], entries: &[u8], remaining: usize) -> bool {
    let mut matched = 0;
    for part in parts {
        let part: &[u8] = part;
        let take = part.len().min(entries.len() - matched);
        if part[..take] != entries[matched..matched + take] {
            return false;
        }
        matched += take;
        if matched == entries.len() && take < part.len() {
            return part[take] != NAME_KEY;
        }
    }
    // Matched up to the end of what was seen: a match if that is the end of the message.
    matched == entries.len() && remaining == entries.len()
}

/// The hash of a list's entries (see [`NameList::fingerprint`]).
fn hash_entries(entries: &[u8]) -> u64 {
    foldhash::fast::FixedState::default().hash_one(entries)
}

/// Decodes a SotW stream's requests, remembering the last few lists of names it sent. Envoy
/// repeats its whole subscription in every request of a type (10k names in each endpoint ACK
/// at 10k services), and a profile of the change phase at that scale had reading those names
/// (the walk over every entry, the UTF-8 check, the fingerprint's hash) at a sixth of the
/// agent's CPU. A list the stream sent before is now recognised by comparing its bytes with
/// the remembered ones, and carries that list's fingerprint; a new one is read as before and
/// remembered (copied once, so the request's buffer is not kept).
#[derive(Debug, Default)]
pub struct SotwDecoder {
    recent: Vec<KnownList>,
}

impl SotwDecoder {
    /// Lists remembered: one per type that names its resources (endpoints and routes) is what
    /// a proxy sends, with room to spare.
    const KEPT: usize = 4;
}

impl RequestDecoder for SotwDecoder {
    type Request = SotwRequest;

    fn decode(&mut self, buf: &mut impl Buf) -> Result<SotwRequest, DecodeError> {
        let mut request = SotwRequest::default();
        request.resource_names.known = std::mem::take(&mut self.recent);
        let merged = prost::Message::merge(&mut request, &mut *buf);
        let names = &mut request.resource_names;
        self.recent = std::mem::take(&mut names.known);
        merged?;
        if names.len > 0 && names.hash.is_none() {
            // Read again although known (it came split across chunks, or sent the same names
            // another way): the known one moves to the front.
            let entries = names.entries.as_slice();
            if let Some(at) = self.recent.iter().position(|k| *k.entries == *entries) {
                let known = self.recent.remove(at);
                names.hash = Some(known.hash);
                self.recent.insert(0, known);
                return Ok(request);
            }
            let hash = hash_entries(entries);
            let entries = share(entries, hash);
            names.hash = Some(hash);
            if self.recent.len() == Self::KEPT {
                self.recent.pop();
            }
            let (len, long) = (names.len, names.long);
            let known = KnownList {
                entries,
                len,
                long,
                hash,
            };
            self.recent.insert(0, known);
        }
        Ok(request)
    }
}

/// The lists of names the streams' decoders keep, shared between them: the proxies that want
/// every cluster send the same list (400 KB at 10k services), and fifty SotW streams keeping
/// a copy each had the agent's RSS 15 MiB higher.
static KNOWN_LISTS: LazyLock<Mutex<ListIndex>> = LazyLock::new(Mutex::default);

/// A list's hash and length → the list, while some decoder keeps it.
type ListIndex = HashMap<(u64, usize), Weak<[u8]>>;

/// `entries` (whose hash is `hash`) as a list some decoder keeps: the same allocation as
/// another's when some stream sent the same names.
fn share(entries: &[u8], hash: u64) -> Arc<[u8]> {
    let mut lists = KNOWN_LISTS.lock().unwrap_or_else(PoisonError::into_inner);
    let key = (hash, entries.len());
    if let Some(list) = lists.get(&key).and_then(Weak::upgrade)
        && *list == *entries
    {
        return list;
    }
    let list: Arc<[u8]> = Arc::from(entries);
    // Lists no decoder keeps any more go; a few per stream at most are alive.
    lists.retain(|_, list| list.strong_count() > 0);
    lists.insert(key, Arc::downgrade(&list));
    list
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
        self.resource_names.encode(buf);
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
                    let names = &mut self.resource_names;
                    if (names.len == 0 && names.read_known(buf)) || names.read_run(buf) {
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
        let names = self.resource_names.encoded_len();
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
    fn a_run_of_names_is_kept_where_it_lies_in_the_buffer() {
        let names: Vec<String> = (0..100).map(|i| format!("cluster-{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let bytes = Bytes::from(full_request(&refs).encode_to_vec());
        let ours = SotwRequest::decode(bytes.clone()).unwrap();
        let Entries::Shared(run) = &ours.resource_names.entries else {
            panic!("the names were copied out of the buffer");
        };
        assert!(bytes.as_ptr_range().contains(&run.as_ptr()));
        assert_eq!(ours.resource_names.iter().collect::<Vec<_>>(), refs);
        // Encoded again, it is the same request.
        assert_eq!(
            DiscoveryRequest::decode(ours.encode_to_vec().as_slice()).unwrap(),
            DiscoveryRequest {
                resource_locators: Vec::new(),
                ..full_request(&refs)
            }
        );
    }

    /// What a fresh decoder (no list known) reads of `bytes`.
    fn read_alone(bytes: &[u8]) -> SotwRequest {
        SotwDecoder::default().decode(&mut &bytes[..]).unwrap()
    }

    #[test]
    fn a_stream_decoder_knows_a_list_sent_again_and_reads_any_other() {
        let names: Vec<String> = (0..300).map(|i| format!("outbound|80||s{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let first = full_request(&refs).encode_to_vec();
        let mut decoder = SotwDecoder::default();
        let read = decoder.decode(&mut first.as_slice()).unwrap();
        assert_eq!(read.resource_names.iter().collect::<Vec<_>>(), refs);
        assert_eq!(decoder.recent.len(), 1);

        // Sent again: taken from what the decoder kept, with the same fingerprint, and the
        // request's other fields read as ever.
        let mut again = full_request(&refs);
        again.response_nonce = "13".into();
        let bytes = again.encode_to_vec();
        let known = decoder.decode(&mut bytes.as_slice()).unwrap();
        let Entries::Known(entries) = &known.resource_names.entries else {
            panic!("a known list was copied");
        };
        assert!(Arc::ptr_eq(entries, &decoder.recent[0].entries));
        // Another stream's decoder that reads the same list keeps the same copy of it.
        let mut other = SotwDecoder::default();
        other.decode(&mut first.as_slice()).unwrap();
        assert!(Arc::ptr_eq(&other.recent[0].entries, entries));
        assert_eq!(known.resource_names, read.resource_names);
        assert_eq!(
            known.resource_names.fingerprint(),
            read_alone(&bytes).resource_names.fingerprint()
        );
        assert_eq!(known.response_nonce, "13");
        assert_eq!(known, read_alone(&bytes));

        // Lists that start like the known one, or that it starts like, or that differ in one
        // byte: read as they are, whatever the split.
        let mut more = refs.clone();
        more.push("outbound|80||extra");
        let fewer = &refs[..299];
        let mut changed = refs.clone();
        changed[150] = "outbound|80||s15X";
        for other in [&more[..], fewer, &changed[..], &refs[..1], &[]] {
            let bytes = full_request(other).encode_to_vec();
            let decoded = decoder.decode(&mut bytes.as_slice()).unwrap();
            assert_eq!(decoded.resource_names.iter().collect::<Vec<_>>(), other);
            assert_eq!(
                decoded.resource_names.fingerprint(),
                read_alone(&bytes).resource_names.fingerprint()
            );
            for chained in every_split(&bytes) {
                let mut chained = chained;
                let decoded = decoder.decode(&mut chained).unwrap();
                assert_eq!(decoded.resource_names.iter().collect::<Vec<_>>(), other);
            }
        }
        // It keeps a few lists, the latest first.
        assert_eq!(decoder.recent.len(), SotwDecoder::KEPT);
        assert_eq!(decoder.recent[0].len, 1);

        // A list with a bad name is refused, known lists or not.
        let mut bad = first.clone();
        let at = bad.windows(4).position(|w| w == b"s150").unwrap();
        bad[at] = 0xff;
        assert!(decoder.decode(&mut bad.as_slice()).is_err());
        assert!(SotwDecoder::default().decode(&mut bad.as_slice()).is_err());
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
