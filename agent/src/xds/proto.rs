//! Protobuf field helpers the hand-written request and response codecs share, written as
//! prost writes the same fields, so the bytes equal the generated types' (their tests compare
//! them).

use prost::bytes::BufMut;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};

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
