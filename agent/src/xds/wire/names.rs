//! A state-of-the-world request's resource names kept as they came on the wire. Envoy repeats
//! its whole subscription in every request of a type (10k names in each endpoint ACK at 10k
//! services, for a proxy of the whole mesh): decoded as a `String` each, that was most of the
//! agent's CPU per change (docs/benchmarks.md). Kept as their bytes, the names cost one copy
//! (or none: a slice of the request's frame), and the stream recognises an unchanged
//! subscription by one hash of those bytes ([`NameList::fingerprint`]).

use std::hash::BuildHasher;

use prost::DecodeError;
use prost::bytes::{Buf, BufMut, Bytes};
use prost::encoding::{DecodeContext, WireType, encode_varint, string};

/// Field 3 (`resource_names` of a state-of-the-world request, `resource_names_subscribe` of
/// a Delta one), length-delimited: the key of each entry.
pub(super) const NAME_KEY: u8 = (3 << 3) | 2;

/// A request's resource names as they came on the wire: each `resource_names` entry (key,
/// length, bytes) one after another, every name checked as UTF-8 when read.
#[derive(Clone, Debug, Default)]
pub struct NameList {
    /// Field 3's entries as prost writes them (a one-byte key, the length as a minimal varint,
    /// the name), without the first entry's key (always [`NAME_KEY`], read before the run
    /// that starts with the first length), so the same names in the same order are the same
    /// bytes however the message was split into chunks.
    entries: Entries,
    len: usize,
    /// How many names are 128 bytes or longer (a length of two bytes or more).
    long: usize,
    /// The room made at once when the entries first get a buffer of their own: the length of
    /// the message they come in, which holds them all (see [`NameList::with_room`]).
    room: usize,
    /// Reused for a name read through prost's path, so it costs no allocation of its own.
    scratch: String,
}

/// The entries' bytes: where they lay in the request's buffer when the list came as one run
/// (one HTTP/2 frame holds it, see [`super::super::inbound`]), or a buffer of their own.
#[derive(Clone, Debug)]
enum Entries {
    Borrowed(Bytes),
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
            Entries::Borrowed(bytes) => bytes,
            Entries::Owned(vec) => vec,
        }
    }

    /// The entries as a buffer of their own, to append to, with room for `room` bytes when it
    /// is first made.
    fn owned(&mut self, room: usize) -> &mut Vec<u8> {
        if let Entries::Borrowed(bytes) = self {
            let mut owned = Vec::with_capacity(room.max(bytes.len()));
            owned.extend_from_slice(bytes);
            *self = Entries::Owned(owned);
        }
        match self {
            Entries::Owned(vec) => {
                if vec.capacity() == 0 {
                    vec.reserve(room);
                }
                vec
            }
            Entries::Borrowed(_) => unreachable!("made owned above"),
        }
    }
}

impl NameList {
    /// A list that makes room for `room` bytes of entries at once when they first need a
    /// buffer of their own (read across frames, or pushed), instead of growing it as they come.
    pub fn with_room(room: usize) -> NameList {
        NameList {
            room,
            ..NameList::default()
        }
    }

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
                    (start, start.checked_add(usize::try_from(len).ok()?)?)
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
        let hash = foldhash::fast::FixedState::default().hash_one(self.entries.as_slice());
        (hash, self.len)
    }

    pub fn push(&mut self, name: &str) {
        if name.len() >= 0x80 {
            self.long += 1;
        }
        let first = self.len == 0;
        let entries = self.entries.owned(self.room);
        if !first {
            entries.push(NAME_KEY);
        }
        encode_varint(name.len() as u64, entries);
        entries.extend_from_slice(name.as_bytes());
        self.len += 1;
    }

    pub(super) fn clear(&mut self) {
        match &mut self.entries {
            Entries::Owned(vec) => vec.clear(),
            borrowed => *borrowed = Entries::default(),
        }
        self.len = 0;
        self.long = 0;
    }

    /// Reads one entry of field 3, whose key was just read, and the run of entries after it
    /// that lie whole in `buf`'s current chunk. Envoy writes its names one after another, and
    /// most lie whole in the chunk: read in place, validated as UTF-8 and copied into the list
    /// at once (docs/benchmarks.md, "The cost of a change with SotW clients"). Else (a name
    /// across chunks, one of 128 bytes or more, or a bad one) prost's own string decoding
    /// (bounds, UTF-8, its errors) into a reused buffer.
    pub(super) fn merge(
        &mut self,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        if wire_type == WireType::LengthDelimited && self.read_run(buf) {
            return Ok(());
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        let merged = string::merge(wire_type, &mut scratch, buf, ctx);
        if merged.is_ok() {
            self.push(&scratch);
        }
        self.scratch = scratch;
        merged
    }

    /// Reads, from the start of `buf`'s current chunk, the length and bytes of a
    /// `resource_names` entry whose key was just read, and the whole entries (key, length,
    /// bytes) that follow it, as long as each lies in the chunk and is shorter than 128 bytes
    /// (a one-byte length); returns whether it read anything (if not, the caller reads the
    /// entry its own way, with prost's bounds and UTF-8 errors). The run is checked as UTF-8 at
    /// once: keys and one-byte lengths are ASCII, a whole character each, so every name in a
    /// valid run starts and ends on a character boundary and is valid itself. A first run is
    /// taken as it lies in `buf` (`copy_to_bytes`, which the request's frames answer with a
    /// slice of one, [`super::super::inbound::Frames`]); a later one is copied after what was
    /// read before.
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
        if self.len == 0 {
            self.entries = Entries::Borrowed(buf.copy_to_bytes(last));
        } else {
            let owned = self.entries.owned(self.room);
            owned.push(NAME_KEY);
            owned.extend_from_slice(&chunk[..last]);
            buf.advance(last);
        }
        self.len += count;
        true
    }

    /// The entries, when they are a slice of the request's buffer (for tests).
    #[cfg(test)]
    pub(super) fn borrowed(&self) -> Option<&Bytes> {
        match &self.entries {
            Entries::Borrowed(bytes) => Some(bytes),
            Entries::Owned(_) => None,
        }
    }

    /// What [`prost::Message::encode_raw`] writes of these names: every entry, keys included.
    pub(super) fn encode(&self, buf: &mut impl BufMut) {
        if self.len > 0 {
            buf.put_u8(NAME_KEY);
            buf.put_slice(self.entries.as_slice());
        }
    }

    pub(super) fn encoded_len(&self) -> usize {
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

impl<S: AsRef<str>> FromIterator<S> for NameList {
    fn from_iter<I: IntoIterator<Item = S>>(names: I) -> Self {
        let mut list = NameList::default();
        for name in names {
            list.push(name.as_ref());
        }
        list
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Room made for a message is made once, when the entries first get a buffer of their
    /// own: names that fit in it never move it. Without room, the same names do.
    #[test]
    fn a_list_with_room_grows_in_place() {
        let names: Vec<String> = (0..1000).map(|i| format!("outbound|80||s{i}")).collect();
        let fill = |list: &mut NameList| {
            list.push(&names[0]);
            let first = list.entries.as_slice().as_ptr();
            for name in &names[1..] {
                list.push(name);
            }
            first == list.entries.as_slice().as_ptr()
        };
        assert!(fill(&mut NameList::with_room(names.len() * 24)));
        assert!(!fill(&mut NameList::default()));
    }

    #[test]
    fn fingerprint_sees_a_change() {
        let a: NameList = ["x", "y", "zzzzzzzzzzz"].into_iter().collect();
        let reordered: NameList = ["zzzzzzzzzzz", "x", "y"].into_iter().collect();
        let changed: NameList = ["x", "y", "zzzzzzzzzzy"].into_iter().collect();
        let fewer: NameList = ["x", "y"].into_iter().collect();
        let moved: NameList = ["xy", "", "zzzzzzzzzzz"].into_iter().collect();
        for other in [&reordered, &changed, &fewer, &moved] {
            assert_ne!(a.fingerprint(), other.fingerprint());
        }
        let again: NameList = ["x", "y", "zzzzzzzzzzz"].into_iter().collect();
        assert_eq!(a.fingerprint(), again.fingerprint());
        assert_eq!(a, again);
    }
}
