//! An upstream answer as the forwarder keeps it: its wire bytes, encoded once, and where each
//! record's TTL sits. The reply to a client is a copy of those bytes with the client's id, its
//! question's letter case, the TTLs counted down and the client's OPT written in, cut to the
//! client's size limit; no `Message` is built or cloned per reply, from the cache or not.

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::{RData, Record};

use crate::wire::{HEADER_LEN, Transport, opt_record, response_limit};

/// The TC bit in the third header byte.
const TC: u8 = 0x02;

/// Why an upstream answer cannot be relayed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AnswerError {
    #[error("cannot encode the upstream answer: {0}")]
    Encode(String),
    #[error("the encoded upstream answer does not parse back into one question and three sections")]
    Layout,
}

/// An upstream answer ready to be relayed to any client that asked its question.
#[derive(Debug)]
pub(crate) struct Answer {
    /// The upstream's message without OPT and TSIG (both are hop-by-hop), its records' TTLs cut to
    /// the forwarder's ceiling, owners equal to the question name spelled as the question is, so
    /// the encoder compresses them to a pointer at the question.
    wire: Box<[u8]>,
    /// Where the question ends: a truncated reply is the header and the question.
    question_end: usize,
    /// Where the additional section starts: it is the first thing dropped from a reply too large.
    additional_at: usize,
    /// Offset of every record's TTL, in message order.
    ttls: Box<[u16]>,
    rcode: ResponseCode,
    /// How long the answer may be cached (RFC 2308 for negative answers); `None`: not at all.
    cache_ttl: Option<u32>,
}

impl Answer {
    /// `upstream`'s answer with every record's TTL cut to `max_ttl`.
    pub(crate) fn from_upstream(mut upstream: Message, max_ttl: u32) -> Result<Self, AnswerError> {
        let rcode = upstream.metadata.response_code;
        let question = upstream.queries.first().map(|q| q.name().clone());
        for record in upstream
            .answers
            .iter_mut()
            .chain(&mut upstream.authorities)
            .chain(&mut upstream.additionals)
        {
            record.ttl = record.ttl.min(max_ttl);
            // Some servers do not keep the question's letter case in the owner; spelled as the
            // question, the owner becomes a pointer to it, which a reply rewrites per client.
            if let Some(question) = &question
                && record.name.eq_ignore_root(question)
                && !record.name.eq_case(question)
            {
                record.name = question.clone();
            }
        }
        let cache_ttl = cache_ttl(&upstream);
        upstream.edns = None;
        upstream.signature = None;
        let wire = upstream
            .to_vec()
            .map_err(|e| AnswerError::Encode(e.to_string()))?
            .into_boxed_slice();
        let layout = Layout::of(&wire).ok_or(AnswerError::Layout)?;
        Ok(Self {
            wire,
            question_end: layout.question_end,
            additional_at: layout.additional_at,
            ttls: layout.ttls.into_boxed_slice(),
            rcode,
            cache_ttl,
        })
    }

    pub(crate) fn rcode(&self) -> ResponseCode {
        self.rcode
    }

    pub(crate) fn cache_ttl(&self) -> Option<u32> {
        self.cache_ttl
    }

    /// Bytes this answer holds, counted against the cache's byte limits.
    pub(crate) fn size(&self) -> usize {
        std::mem::size_of::<Self>() + self.wire.len() + 2 * self.ttls.len()
    }

    /// The reply to `request`, `age` seconds after the answer arrived: the request's id and
    /// question (its letter case), TTLs less `age`, an OPT if the request had one (RFC 6891
    /// §6.1.1; never the client's options), and no larger than the transport allows: without
    /// the additional section first, else the header and question with TC set.
    pub(crate) fn reply(&self, request: &Message, age: u32, transport: Transport) -> Vec<u8> {
        let opt = request
            .edns
            .as_ref()
            .map(|edns| opt_record(edns.flags().dnssec_ok));
        let opt_len = opt.map_or(0, |o| o.len());
        let limit = response_limit(request, transport);
        let (cut, counts, truncated) = if self.wire.len() + opt_len <= limit {
            (self.wire.len(), None, false)
        } else if self.additional_at + opt_len <= limit {
            (
                self.additional_at,
                Some([self.count(6), self.count(8), 0]),
                false,
            )
        } else {
            (self.question_end, Some([0, 0, 0]), true)
        };
        let mut out = Vec::with_capacity(cut + opt_len);
        out.extend_from_slice(&self.wire[..cut]);
        out[..2].copy_from_slice(&request.metadata.id.to_be_bytes());
        if truncated {
            out[2] |= TC;
        }
        self.spell_question_as(request, &mut out);
        if let Some([answers, authorities, additionals]) = counts {
            out[6..8].copy_from_slice(&answers.to_be_bytes());
            out[8..10].copy_from_slice(&authorities.to_be_bytes());
            out[10..12].copy_from_slice(&additionals.to_be_bytes());
        }
        for &at in self.ttls.iter() {
            let at = usize::from(at);
            let Some(field) = out.get_mut(at..at + 4) else {
                break;
            };
            let ttl = u32::from_be_bytes([field[0], field[1], field[2], field[3]]);
            field.copy_from_slice(&ttl.saturating_sub(age).to_be_bytes());
        }
        if let Some(opt) = opt {
            let additionals = u16::from_be_bytes([out[10], out[11]]).saturating_add(1);
            out[10..12].copy_from_slice(&additionals.to_be_bytes());
            out.extend_from_slice(&opt);
        }
        out
    }

    fn count(&self, at: usize) -> u16 {
        u16::from_be_bytes([self.wire[at], self.wire[at + 1]])
    }

    /// Writes the request's question name over the stored one: the same name, maybe in other
    /// letter case, so the same length. Owners that point at it follow.
    fn spell_question_as(&self, request: &Message, out: &mut [u8]) {
        let Some(question) = request.queries.first() else {
            return;
        };
        let stored = &mut out[HEADER_LEN..self.question_end.saturating_sub(4)];
        let mut at = 0;
        for label in question.name().iter() {
            let end = at + 1 + label.len();
            if stored.get(at).map(|&len| usize::from(len)) != Some(label.len()) {
                return;
            }
            match stored.get_mut(at + 1..end) {
                Some(slot) if slot.eq_ignore_ascii_case(label) => slot.copy_from_slice(label),
                _ => return,
            }
            at = end;
        }
    }
}

/// How long an upstream answer may be cached: the smallest TTL of its answer section, or for a
/// negative answer its SOA's TTL capped by the SOA minimum (RFC 2308). Truncated answers,
/// failures and TTL 0 are not cached.
fn cache_ttl(answer: &Message) -> Option<u32> {
    if answer.metadata.truncation {
        return None;
    }
    let negative = |answer: &Message| {
        answer
            .authorities
            .iter()
            .find_map(|r: &Record| match &r.data {
                RData::SOA(soa) => Some(r.ttl.min(soa.minimum)),
                _ => None,
            })
    };
    let ttl = match answer.metadata.response_code {
        ResponseCode::NoError if !answer.answers.is_empty() => {
            answer.answers.iter().map(|r| r.ttl).min()
        }
        ResponseCode::NoError | ResponseCode::NXDomain => negative(answer),
        _ => None,
    }?;
    (ttl > 0).then_some(ttl)
}

/// Where things are in an encoded message.
#[derive(Debug, PartialEq, Eq)]
struct Layout {
    question_end: usize,
    additional_at: usize,
    ttls: Vec<u16>,
}

impl Layout {
    /// The layout of `wire`, or `None` unless it holds one question and records that end
    /// exactly where the message does.
    fn of(wire: &[u8]) -> Option<Self> {
        let count = |at: usize| -> Option<u16> {
            Some(u16::from_be_bytes([*wire.get(at)?, *wire.get(at + 1)?]))
        };
        if count(4)? != 1 {
            return None;
        }
        let sections = [count(6)?, count(8)?, count(10)?];
        let mut pos = skip_name(wire, HEADER_LEN)? + 4;
        let question_end = pos;
        let mut additional_at = pos;
        let mut ttls = Vec::with_capacity(sections.iter().map(|&n| usize::from(n)).sum());
        for (section, records) in sections.into_iter().enumerate() {
            if section == 2 {
                additional_at = pos;
            }
            for _ in 0..records {
                pos = skip_name(wire, pos)?;
                // type 2, class 2, TTL 4, rdlength 2.
                let ttl_at = pos + 4;
                let rdlength = usize::from(count(pos + 8)?);
                pos += 10 + rdlength;
                ttls.push(u16::try_from(ttl_at).ok()?);
            }
        }
        (pos == wire.len()).then_some(Self {
            question_end,
            additional_at,
            ttls,
        })
    }
}

/// The offset just past the name at `pos`: its labels up to the root label or a compression
/// pointer.
fn skip_name(wire: &[u8], mut pos: usize) -> Option<usize> {
    loop {
        let len = *wire.get(pos)?;
        match len & 0xc0 {
            0x00 if len == 0 => return Some(pos + 1),
            0x00 => pos += 1 + usize::from(len),
            0xc0 => return wire.get(pos + 1).map(|_| pos + 2),
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::MAX_UDP_PAYLOAD;
    use hickory_proto::op::{Edns, OpCode, Query};
    use hickory_proto::rr::rdata::{A, SOA, TXT};
    use hickory_proto::rr::{Name, RecordType};

    fn name(s: &str) -> Name {
        Name::from_ascii(s).unwrap()
    }

    fn request(qname: &str, edns: Option<u16>) -> Message {
        let mut m = Message::query();
        m.metadata.id = 0x4242;
        m.metadata.recursion_desired = true;
        m.add_query(Query::query(name(qname), RecordType::A));
        if let Some(size) = edns {
            let mut e = Edns::new();
            e.set_max_payload(size);
            m.set_edns(e);
        }
        m
    }

    fn upstream(qname: &str, owner: &str, ttl: u32) -> Message {
        let mut m = Message::response(7, OpCode::Query);
        m.metadata.recursion_available = true;
        m.add_query(Query::query(name(qname), RecordType::A));
        m.add_answer(Record::from_rdata(
            name(owner),
            ttl,
            RData::A(A([192, 0, 2, 1].into())),
        ));
        let mut e = Edns::new();
        e.set_max_payload(4096);
        m.set_edns(e);
        m
    }

    #[test]
    fn a_reply_carries_the_clients_id_case_edns_and_aged_ttls() {
        // The upstream lost the question's case in the owner; the reply spells it as each client.
        let answer = Answer::from_upstream(
            upstream("Www.Example.test.", "www.example.test.", 86_400),
            300,
        )
        .unwrap();
        assert_eq!(answer.cache_ttl(), Some(300));
        let client = request("WWW.example.TEST.", Some(4096));
        let reply = Message::from_vec(&answer.reply(&client, 100, Transport::Udp)).unwrap();
        assert_eq!(reply.metadata.id, 0x4242);
        assert_eq!(reply.queries[0].name().to_ascii(), "WWW.example.TEST.");
        assert_eq!(reply.answers[0].name.to_ascii(), "WWW.example.TEST.");
        assert_eq!(reply.answers[0].ttl, 200, "300 capped, less 100 s of age");
        let edns = reply.edns.expect("the client sent EDNS");
        assert_eq!(edns.max_payload(), MAX_UDP_PAYLOAD);
        assert!(edns.options().as_ref().is_empty());
        let plain = Message::from_vec(&answer.reply(
            &request("www.example.test.", None),
            0,
            Transport::Udp,
        ))
        .unwrap();
        assert!(plain.edns.is_none(), "no EDNS in, none out");
        assert_eq!(plain.answers[0].ttl, 300);
        assert_eq!(plain.answers[0].name.to_ascii(), "www.example.test.");
    }

    #[test]
    fn a_reply_too_large_loses_its_additionals_then_everything_but_the_question() {
        let mut m = upstream("big.example.test.", "big.example.test.", 60);
        for i in 0..4 {
            let text = format!("{i}{}", "x".repeat(150));
            m.add_additional(Record::from_rdata(
                name("extra.example.test."),
                60,
                RData::TXT(TXT::new(vec![text])),
            ));
        }
        let answer = Answer::from_upstream(m.clone(), 300).unwrap();
        let big = Message::from_vec(&answer.reply(
            &request("big.example.test.", Some(1232)),
            0,
            Transport::Udp,
        ))
        .unwrap();
        assert_eq!(big.additionals.len(), 4);
        // 512 bytes without EDNS: the additionals go, the answer stays.
        let small = Message::from_vec(&answer.reply(
            &request("big.example.test.", None),
            0,
            Transport::Udp,
        ))
        .unwrap();
        assert!(small.additionals.is_empty() && small.answers.len() == 1);
        assert!(!small.metadata.truncation);
        for i in 0..8 {
            m.add_answer(Record::from_rdata(
                name("big.example.test."),
                60,
                RData::TXT(TXT::new(vec![format!("{i}{}", "y".repeat(200))])),
            ));
        }
        let answer = Answer::from_upstream(m, 300).unwrap();
        let bytes = answer.reply(&request("BIG.example.test.", Some(1232)), 5, Transport::Udp);
        let truncated = Message::from_vec(&bytes).unwrap();
        assert!(truncated.metadata.truncation);
        assert!(truncated.answers.is_empty() && truncated.additionals.is_empty());
        assert_eq!(truncated.queries[0].name().to_ascii(), "BIG.example.test.");
        assert!(truncated.edns.is_some(), "OPT kept in a truncated reply");
        let tcp = Message::from_vec(&answer.reply(
            &request("big.example.test.", Some(1232)),
            5,
            Transport::Tcp,
        ))
        .unwrap();
        assert_eq!(tcp.answers.len(), 9);
        assert!(tcp.answers.iter().all(|r| r.ttl == 55));
    }

    #[test]
    fn negative_answers_cache_for_the_soa_minimum_and_failures_not_at_all() {
        let mut nx = Message::response(1, OpCode::Query);
        nx.add_query(Query::query(name("nope.example.test."), RecordType::A));
        nx.metadata.response_code = ResponseCode::NXDomain;
        let zone = name("example.test.");
        let soa = SOA::new(zone.clone(), zone.clone(), 1, 1, 1, 1, 60);
        nx.add_authority(Record::from_rdata(zone, 3600, RData::SOA(soa)));
        let answer = Answer::from_upstream(nx, 300).unwrap();
        assert_eq!(answer.cache_ttl(), Some(60));
        assert_eq!(answer.rcode(), ResponseCode::NXDomain);
        let reply = Message::from_vec(&answer.reply(
            &request("nope.example.test.", None),
            10,
            Transport::Udp,
        ))
        .unwrap();
        assert_eq!(reply.authorities[0].ttl, 290, "3600 capped to 300, less 10");
        let mut fail = upstream("a.example.test.", "a.example.test.", 300);
        fail.metadata.response_code = ResponseCode::ServFail;
        assert_eq!(Answer::from_upstream(fail, 300).unwrap().cache_ttl(), None);
        let zero = upstream("a.example.test.", "a.example.test.", 0);
        assert_eq!(Answer::from_upstream(zero, 300).unwrap().cache_ttl(), None);
    }

    #[test]
    fn layout_rejects_what_does_not_end_where_the_message_does() {
        let wire = upstream("a.example.test.", "a.example.test.", 1)
            .to_vec()
            .unwrap();
        assert!(Layout::of(&wire).is_some());
        assert!(Layout::of(&wire[..wire.len() - 1]).is_none());
        let mut longer = wire.clone();
        longer.push(0);
        assert!(Layout::of(&longer).is_none());
        assert!(Layout::of(&wire[..5]).is_none());
    }
}
