//! The fast path: A queries for mesh names answered by copying precomputed records, without
//! parsing into `hickory_proto` types or allocating. Anything it does not fully understand returns
//! `None` and goes to the general path, which is the reference this path must agree with.

use std::sync::Arc;

use crate::table::{A_RR_LEN, A_RR_TTL_OFFSET, Lookup, NameTable};
use crate::wire::{
    HEADER_LEN, MAX_UDP_PAYLOAD, MAX_WIRE_NAME_LEN, MIN_UDP_PAYLOAD, OPT_LEN, TYPE_OPT, Transport,
    opt_record,
};

const TYPE_A: u16 = 1;
const CLASS_IN: u16 = 1;

/// Writes the answer to `query` into `out` and returns its length and the name's scope, if
/// `query` is a plain `QUERY` for the A record of a mesh name that has IPv4 addresses and the
/// answer fits in `out` and, over UDP, in the client's limit.
pub(crate) fn answer<'t>(
    table: &'t NameTable,
    ttl: u32,
    query: &[u8],
    transport: Transport,
    out: &mut [u8],
) -> Option<(usize, Option<&'t Arc<str>>)> {
    let header = query.get(..HEADER_LEN)?;
    // QR=0, opcode QUERY, AA=0, TC=0; Z=0 and RCODE=0.
    if header[2] & 0xfe != 0 || header[3] & 0x4f != 0 {
        return None;
    }
    let [qdcount, ancount, nscount, arcount] =
        [4, 6, 8, 10].map(|at| u16::from_be_bytes([header[at], header[at + 1]]));
    if qdcount != 1 || ancount != 0 || nscount != 0 || arcount > 1 {
        return None;
    }
    let mut key = [0u8; MAX_WIRE_NAME_LEN];
    let mut pos = HEADER_LEN;
    loop {
        let len = usize::from(*query.get(pos)?);
        // Compression pointers and extended labels are left to the general path.
        if len > 63 || pos - HEADER_LEN + len + 1 > MAX_WIRE_NAME_LEN {
            return None;
        }
        let label = query.get(pos..=pos + len)?;
        for (k, b) in key[pos - HEADER_LEN..].iter_mut().zip(label) {
            *k = b.to_ascii_lowercase();
        }
        pos += len + 1;
        if len == 0 {
            break;
        }
    }
    let name_end = pos;
    let qtype = u16::from_be_bytes([*query.get(pos)?, *query.get(pos + 1)?]);
    let qclass = u16::from_be_bytes([*query.get(pos + 2)?, *query.get(pos + 3)?]);
    pos += 4;
    if qtype != TYPE_A || qclass != CLASS_IN {
        return None;
    }
    let question_end = pos;
    // The only additional record understood here is a version-0 OPT with no extended rcode.
    let mut dnssec_ok = false;
    let mut client_limit = usize::from(MIN_UDP_PAYLOAD);
    if arcount == 1 {
        let opt = query.get(pos..pos + OPT_LEN)?;
        if opt[0] != 0
            || u16::from_be_bytes([opt[1], opt[2]]) != TYPE_OPT
            || opt[5] != 0
            || opt[6] != 0
        {
            return None;
        }
        client_limit = usize::from(u16::from_be_bytes([opt[3], opt[4]]))
            .clamp(usize::from(MIN_UDP_PAYLOAD), usize::from(MAX_UDP_PAYLOAD));
        dnssec_ok = opt[7] & 0x80 != 0;
        let rdlen = usize::from(u16::from_be_bytes([opt[9], opt[10]]));
        pos += OPT_LEN;
        let mut options = query.get(pos..pos + rdlen)?;
        // Options are not interpreted (none changes an A answer) but must be well-formed.
        while !options.is_empty() {
            let option_len = usize::from(u16::from_be_bytes([*options.get(2)?, *options.get(3)?]));
            options = options.get(4 + option_len..)?;
        }
        pos += rdlen;
    }
    if pos != query.len() {
        return None;
    }
    let Lookup::Service(entry) = table.lookup(&key[..name_end - HEADER_LEN]) else {
        return None;
    };
    if entry.v4.is_empty() {
        return None;
    }
    let edns = arcount == 1;
    let len = question_end + entry.a_records.len() + if edns { OPT_LEN } else { 0 };
    if (transport == Transport::Udp && len > client_limit) || len > out.len() {
        return None;
    }
    let answer_count = u16::try_from(entry.v4.len()).ok()?;
    let out = &mut out[..len];
    out[..2].copy_from_slice(&header[..2]);
    // QR, AA, RD copied; RA; CD copied.
    out[2] = 0x84 | (header[2] & 0x01);
    out[3] = 0x80 | (header[3] & 0x10);
    out[4..6].copy_from_slice(&1u16.to_be_bytes());
    out[6..8].copy_from_slice(&answer_count.to_be_bytes());
    out[8..10].copy_from_slice(&[0, 0]);
    out[10..12].copy_from_slice(&u16::from(edns).to_be_bytes());
    // The question is copied as sent, so the client sees its own letter case (0x20 encoding).
    out[HEADER_LEN..question_end].copy_from_slice(&query[HEADER_LEN..question_end]);
    let answers = &mut out[question_end..question_end + entry.a_records.len()];
    answers.copy_from_slice(&entry.a_records);
    let ttl = ttl.to_be_bytes();
    for record in answers.chunks_exact_mut(A_RR_LEN) {
        record[A_RR_TTL_OFFSET..A_RR_TTL_OFFSET + 4].copy_from_slice(&ttl);
    }
    if edns {
        out[len - OPT_LEN..len].copy_from_slice(&opt_record(dnssec_ok));
    }
    Some((len, entry.scope.as_ref()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::{Edns, Message, Query};
    use hickory_proto::rr::{Name, RecordType};

    fn table() -> NameTable {
        NameTable::new([(
            "buzz.bar.foo.system.internal".to_string(),
            "240.240.0.1".parse().unwrap(),
        )])
    }

    fn query(name: &str, qtype: RecordType, edns: bool) -> Vec<u8> {
        let mut m = Message::query();
        m.metadata.recursion_desired = true;
        m.add_query(Query::query(Name::from_ascii(name).unwrap(), qtype));
        if edns {
            m.set_edns(Edns::new());
        }
        m.to_vec().unwrap()
    }

    #[test]
    fn answers_a_queries_for_mesh_names_with_the_query_id_case_and_ttl() {
        let mut out = [0u8; 512];
        for edns in [false, true] {
            let q = query("BUZZ.bar.foo.system.internal.", RecordType::A, edns);
            let (len, _) =
                answer(&table(), 42, &q, Transport::Udp, &mut out).expect("fast path answers");
            let reply = Message::from_vec(&out[..len]).unwrap();
            assert_eq!(reply.metadata.id, u16::from_be_bytes([q[0], q[1]]));
            assert!(reply.metadata.authoritative && reply.metadata.recursion_desired);
            assert_eq!(
                reply.queries[0].name().to_ascii(),
                "BUZZ.bar.foo.system.internal."
            );
            assert_eq!(reply.answers[0].ttl, 42);
            assert_eq!(reply.answers[0].data.to_string(), "240.240.0.1");
            assert_eq!(reply.edns.is_some(), edns);
        }
    }

    #[test]
    fn leaves_everything_else_to_the_general_path() {
        let mut out = [0u8; 512];
        let t = table();
        for q in [
            query("buzz.bar.foo.system.internal.", RecordType::AAAA, false),
            query("nope.system.internal.", RecordType::A, false),
            query("example.com.", RecordType::A, false),
        ] {
            assert!(answer(&t, 30, &q, Transport::Udp, &mut out).is_none());
        }
        let mut notify = query("buzz.bar.foo.system.internal.", RecordType::A, false);
        notify[2] |= 4 << 3;
        assert!(answer(&t, 30, &notify, Transport::Udp, &mut out).is_none());
    }
}
