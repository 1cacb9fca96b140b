//! What the parts of the server share about the DNS wire format: the header size, the longest
//! name, the bounds of a reply and the OPT record it carries, the transport a reply goes back
//! over, and names in the lower-cased wire format that the name table and the forwarding
//! cache are keyed by.

use hickory_proto::op::Message;

/// Size of the message header (RFC 1035 §4.1.1); the question starts right after it.
pub(crate) const HEADER_LEN: usize = 12;

/// Longest wire-format name (RFC 1035 §3.1), including the root label.
pub(crate) const MAX_WIRE_NAME_LEN: usize = 255;

/// The UDP payload size this server advertises and the most it sends over UDP (DNS flag day 2020).
pub(crate) const MAX_UDP_PAYLOAD: u16 = 1232;

/// The UDP payload size every client accepts: the limit for a client without EDNS (RFC 1035
/// §4.2.1), and the least an EDNS client's advertised size counts as (RFC 6891 §6.2.5).
pub(crate) const MIN_UDP_PAYLOAD: u16 = 512;

/// Length of the OPT record a reply carries (RFC 6891 §6.1.2): root owner, type, payload size,
/// extended rcode, version, flags, empty rdata.
pub(crate) const OPT_LEN: usize = 11;

/// The OPT pseudo-record's type.
pub(crate) const TYPE_OPT: u16 = 41;

/// The OPT record of a reply: this server's payload size, version 0, the client's DO bit.
pub(crate) fn opt_record(dnssec_ok: bool) -> [u8; OPT_LEN] {
    let [type_hi, type_lo] = TYPE_OPT.to_be_bytes();
    let [size_hi, size_lo] = MAX_UDP_PAYLOAD.to_be_bytes();
    let flags = if dnssec_ok { 0x80 } else { 0 };
    [0, type_hi, type_lo, size_hi, size_lo, 0, 0, flags, 0, 0, 0]
}

/// The most a reply may carry: 64 KiB over TCP; over UDP the client's EDNS payload size, at least
/// `MIN_UDP_PAYLOAD` and at most what this server advertises.
pub(crate) fn response_limit(request: &Message, transport: Transport) -> usize {
    match transport {
        Transport::Tcp => usize::from(u16::MAX),
        Transport::Udp => usize::from(request.edns.as_ref().map_or(MIN_UDP_PAYLOAD, |e| {
            e.max_payload().clamp(MIN_UDP_PAYLOAD, MAX_UDP_PAYLOAD)
        })),
    }
}

/// How the reply reaches the client, which decides how large it may be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Transport {
    Udp,
    Tcp,
}

/// Lower-cased wire format of a dotted name (a trailing dot is allowed), or `None` if a label is
/// empty or longer than 63 bytes or the name is longer than 255 bytes.
pub(crate) fn lowercase_wire_name_from_dotted(name: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(name.len() + 2);
    lowercase_wire_name_into(name, &mut out).then_some(out)
}

/// [`lowercase_wire_name_from_dotted`] into `out` (cleared first), whose room is reused from
/// name to name; whether the name is valid.
pub(crate) fn lowercase_wire_name_into(name: &str, out: &mut Vec<u8>) -> bool {
    out.clear();
    let name = name.strip_suffix('.').unwrap_or(name);
    if !name.is_empty() {
        // By bytes: a dot is one byte in UTF-8, and splitting by `char` was a tenth of building
        // a 50k-service table (perf).
        for label in name.as_bytes().split(|&b| b == b'.') {
            let Some(len) = u8::try_from(label.len())
                .ok()
                .filter(|l| (1..=63).contains(l))
            else {
                return false;
            };
            out.push(len);
            out.extend(label.iter().map(u8::to_ascii_lowercase));
        }
    }
    out.push(0);
    out.len() <= MAX_WIRE_NAME_LEN
}

/// Lower-cased wire format of a parsed name.
pub(crate) fn lowercase_wire_name(name: &hickory_proto::rr::Name) -> Vec<u8> {
    let mut out = Vec::with_capacity(name.len() + 2);
    for label in name.iter() {
        out.push(label.len() as u8);
        out.extend(label.iter().map(u8::to_ascii_lowercase));
    }
    out.push(0);
    out
}
