//! Protobuf fields written by hand, for the resources the translator writes straight to bytes
//! ([`super::assignment`], the plain virtual hosts of [`super::routes`]): keys of fields
//! numbered below 16 (one byte each), lengths, and length-delimited bodies.

use prost::encoding::{encode_varint, encoded_len_varint};

/// The key of length-delimited field `field` (below 16).
pub(super) const fn bytes_key(field: u8) -> u8 {
    field << 3 | 2
}

/// The key of varint field `field` (below 16).
pub(super) const fn varint_key(field: u8) -> u8 {
    field << 3
}

/// A length-delimited field whose body is `len` bytes: key, length, body.
pub(super) fn delimited_len(len: usize) -> usize {
    1 + encoded_len_varint(len as u64) + len
}

/// A singular string field of `s`, omitted when empty (proto3).
pub(super) fn string_field_len(s: &str) -> usize {
    if s.is_empty() {
        0
    } else {
        delimited_len(s.len())
    }
}

/// The key and length of a length-delimited field; its body follows.
pub(super) fn put_delimited(out: &mut Vec<u8>, key: u8, len: usize) {
    out.push(key);
    encode_varint(len as u64, out);
}

/// A length-delimited field of `text`, written even when empty (an element of a repeated
/// field, or a field the caller knows is not empty).
pub(super) fn put_text(out: &mut Vec<u8>, key: u8, text: &str) {
    put_delimited(out, key, text.len());
    out.extend_from_slice(text.as_bytes());
}
