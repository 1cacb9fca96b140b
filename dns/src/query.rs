//! The general query path: parses with `hickory_proto`, answers the zone and search-suffixed mesh
//! names, refuses other classes than IN outside the zone (CHAOS's `version.bind` and
//! `id.server` included: they would tell the upstream's version and name as this server's),
//! decides what is forwarded, and shapes every reply for the client's transport (EDNS echo,
//! truncation). The fast path in `fast.rs` must agree with it; `check_query` tests that.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use hickory_proto::op::{Edns, Message, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA, CNAME, MX, NS, SOA, SRV};
use hickory_proto::rr::{DNSClass, Name, RData, Record, RecordType};
use lattice_contract::ZONE;

use crate::table::{Lookup, NameEntry, NameTable, in_zone, nameserver_wire_name};
use crate::wire::{
    HEADER_LEN, MAX_UDP_PAYLOAD, Transport, lowercase_wire_name, opt_record, response_limit,
};

/// Settings of the local zone that do not come from the mesh.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ZoneSettings {
    pub(crate) ttl: u32,
    /// SOA minimum: how long resolvers cache NXDOMAIN and NODATA (RFC 2308).
    pub(crate) negative_ttl: u32,
    /// The address of `ns.system.internal`, the zone's NS and SOA name.
    pub(crate) nameserver: Option<IpAddr>,
}

#[derive(Debug)]
pub(crate) enum Outcome {
    Reply {
        bytes: Vec<u8>,
        rcode: ResponseCode,
        /// The [`MeshRecord::Scope`](crate::MeshRecord::Scope) of the mesh name answered.
        scope: Option<Arc<str>>,
    },
    /// Not ours: the forwarder answers it.
    Forward(Box<Message>),
    /// Not worth an answer (a response, or too short to carry an id).
    Drop,
}

/// Answers `query` from the zone, or says it must be forwarded or dropped.
pub(crate) fn handle(
    table: &NameTable,
    zone: ZoneSettings,
    query: &[u8],
    transport: Transport,
) -> Outcome {
    let Some(header) = query.get(..HEADER_LEN) else {
        return Outcome::Drop;
    };
    if header[2] & 0x80 != 0 {
        return Outcome::Drop;
    }
    let op_code = (header[2] >> 3) & 0x0f;
    if op_code != u8::from(OpCode::Query) {
        let edns = Message::from_vec(query).ok().and_then(|m| m.edns);
        return error_reply(header, edns.as_ref(), ResponseCode::NotImp);
    }
    // A message that does not parse may not have one valid OPT (RFC 6891 §6.1.1: two OPTs are
    // a FORMERR): the reply is the header alone.
    let Ok(request) = Message::from_vec(query) else {
        return error_reply(header, None, ResponseCode::FormErr);
    };
    if request.queries.len() != 1 {
        return error_reply(header, request.edns.as_ref(), ResponseCode::FormErr);
    }
    let limit = response_limit(&request, transport);
    if request.edns.as_ref().is_some_and(|e| e.version() > 0) {
        let mut reply = response_to(&request);
        reply.metadata.response_code = ResponseCode::BADVERS;
        return reply_outcome(&reply, limit);
    }
    let question = &request.queries[0];
    if matches!(
        question.query_type(),
        RecordType::AXFR | RecordType::IXFR | RecordType::OPT
    ) {
        let mut reply = response_to(&request);
        reply.metadata.response_code = if question.query_type() == RecordType::OPT {
            ResponseCode::FormErr
        } else {
            ResponseCode::Refused
        };
        return reply_outcome(&reply, limit);
    }
    match local_answer(table, zone, &request) {
        Some(reply) => {
            let rcode = reply.metadata.response_code;
            Outcome::Reply {
                bytes: encode(&reply, limit),
                rcode,
                scope: (rcode == ResponseCode::NoError)
                    .then(|| scope_of(table, question.name()))
                    .flatten(),
            }
        }
        None => Outcome::Forward(Box::new(request)),
    }
}

/// The scope of the mesh name a question asks about: its own, or that of the mesh name a
/// search-suffixed question is a CNAME to.
fn scope_of(table: &NameTable, name: &Name) -> Option<Arc<str>> {
    let key = lowercase_wire_name(name);
    match table.service(&key) {
        Some(entry) => entry.scope.clone(),
        None => {
            let (_, target) = search_suffixed_mesh_name(table, name)?;
            table.service(&target)?.scope.clone()
        }
    }
}

/// SERVFAIL for `request`: no upstream answered.
pub(crate) fn server_failure(request: &Message, transport: Transport) -> Vec<u8> {
    let mut reply = response_to(request);
    reply.metadata.response_code = ResponseCode::ServFail;
    encode(&reply, response_limit(request, transport))
}

fn reply_outcome(reply: &Message, limit: usize) -> Outcome {
    Outcome::Reply {
        bytes: encode(reply, limit),
        rcode: reply.metadata.response_code,
        scope: None,
    }
}

/// Encodes `reply`; if it is larger than `limit`, sends the header and question with TC set so the
/// client retries over TCP.
fn encode(reply: &Message, limit: usize) -> Vec<u8> {
    match reply.to_vec() {
        Ok(bytes) if bytes.len() <= limit => bytes,
        // Additional records are a courtesy (RFC 2181 9): drop them before truncating.
        Ok(_) if !reply.additionals.is_empty() => {
            let mut without = reply.clone();
            without.additionals.clear();
            encode(&without, limit)
        }
        Ok(_) => reply.truncate().to_vec().unwrap_or_default(),
        Err(error) => {
            tracing::warn!(%error, "cannot encode a DNS reply; sending SERVFAIL");
            let mut failure = reply.truncate();
            failure.metadata.truncation = false;
            failure.metadata.response_code = ResponseCode::ServFail;
            failure.to_vec().unwrap_or_default()
        }
    }
}

/// The reply to a query that cannot be parsed or is not a QUERY: the header, and an OPT if the
/// query had a valid one (RFC 6891 §6.1.1; a reply without one tells the client this server
/// lacks EDNS).
fn error_reply(header: &[u8], edns: Option<&Edns>, rcode: ResponseCode) -> Outcome {
    let mut bytes = vec![0; HEADER_LEN];
    bytes[..2].copy_from_slice(&header[..2]);
    // QR, the opcode and RD copied.
    bytes[2] = 0x80 | (header[2] & 0x79);
    bytes[3] = 0x80 | rcode.low();
    if let Some(edns) = edns {
        bytes[11] = 1;
        bytes.extend_from_slice(&opt_record(edns.flags().dnssec_ok));
    }
    Outcome::Reply {
        bytes,
        rcode,
        scope: None,
    }
}

fn echo_edns(request: &Message) -> Option<Edns> {
    request.edns.as_ref().map(|theirs| {
        let mut ours = Edns::new();
        ours.set_max_payload(MAX_UDP_PAYLOAD);
        ours.set_version(0);
        ours.set_dnssec_ok(theirs.flags().dnssec_ok);
        ours
    })
}

fn response_to(request: &Message) -> Message {
    let mut reply = Message::response(request.metadata.id, OpCode::Query);
    reply.metadata.recursion_desired = request.metadata.recursion_desired;
    reply.metadata.recursion_available = true;
    reply.metadata.checking_disabled = request.metadata.checking_disabled;
    reply.queries.clone_from(&request.queries);
    reply.edns = echo_edns(request);
    reply
}

/// The zone's answer, or `None` when the name is neither in the zone nor a search-suffixed
/// mesh name.
fn local_answer(table: &NameTable, zone: ZoneSettings, request: &Message) -> Option<Message> {
    let question = &request.queries[0];
    let key = lowercase_wire_name(question.name());
    let mut reply = response_to(request);
    if table.is_pending() && (in_zone(&key) || search_suffixed_target(question.name()).is_some()) {
        // Nothing of the zone is known yet: a failure the client retries, never an NXDOMAIN
        // it would cache as the name's absence.
        reply.metadata.response_code = ResponseCode::ServFail;
        return Some(reply);
    }
    if in_zone(&key) {
        reply.metadata.authoritative = true;
        if !matches!(question.query_class(), DNSClass::IN | DNSClass::ANY) {
            reply.metadata.response_code = ResponseCode::Refused;
            return Some(reply);
        }
        answer_in_zone(table, zone, question, &key, &mut reply);
        return Some(reply);
    }
    // Only the Internet class is forwarded: CHAOS names (`version.bind`, `id.server`) are
    // about the server asked, and the upstream's answers would pass for this server's.
    if question.query_class() != DNSClass::IN {
        reply.metadata.response_code = ResponseCode::Refused;
        return Some(reply);
    }
    let Some((target, target_key)) = search_suffixed_mesh_name(table, question.name()) else {
        if table.is_provisional() && search_suffixed_target(question.name()).is_some() {
            // Perhaps a mesh name the table does not hold yet: as a pending table would.
            reply.metadata.response_code = ResponseCode::ServFail;
            return Some(reply);
        }
        return None;
    };
    reply.add_answer(Record::from_rdata(
        question.name().clone(),
        zone.ttl,
        RData::CNAME(CNAME(target.clone())),
    ));
    if question.query_type() != RecordType::CNAME {
        let target_question = Query::query(target, question.query_type());
        answer_in_zone(table, zone, &target_question, &target_key, &mut reply);
    }
    Some(reply)
}

/// `buzz.bar.foo.system.internal.ns.svc.cluster.local` → `buzz.bar.foo.system.internal` if that
/// is a mesh name: the name up to and including the first run of the zone's labels, when labels
/// precede and follow that run.
fn search_suffixed_mesh_name(table: &NameTable, name: &Name) -> Option<(Name, Vec<u8>)> {
    let target = search_suffixed_target(name)?;
    let key = lowercase_wire_name(&target);
    table.service(&key)?;
    Some((target, key))
}

/// The name a search-suffixed name would stand for, mesh name or not (see
/// [`search_suffixed_mesh_name`]).
fn search_suffixed_target(name: &Name) -> Option<Name> {
    let labels: Vec<&[u8]> = name.iter().collect();
    let zone_labels = ZONE.split('.').count();
    let at = labels.windows(zone_labels).position(|window| {
        window
            .iter()
            .zip(ZONE.split('.'))
            .all(|(label, zone_label)| label.eq_ignore_ascii_case(zone_label.as_bytes()))
    })?;
    let mesh_labels = at + zone_labels;
    if at == 0 || mesh_labels >= labels.len() {
        return None;
    }
    let mut target = Name::from_labels(labels[..mesh_labels].iter().copied()).ok()?;
    target.set_fqdn(true);
    Some(target)
}

/// Adds the zone's records for `question` (whose lower-cased wire name is `key`) to `reply`.
fn answer_in_zone(
    table: &NameTable,
    zone: ZoneSettings,
    question: &Query,
    key: &[u8],
    reply: &mut Message,
) {
    let name = question.name();
    let qtype = question.query_type();
    let apex = apex();
    let soa = soa_record(&apex, table.serial(), zone);
    let records: Vec<Record> = if key == lowercase_wire_name(&apex) {
        let ns = Record::from_rdata(
            name.clone(),
            zone.ttl,
            RData::NS(NS(nameserver_name(&apex))),
        );
        let soa = Record::from_rdata(name.clone(), zone.ttl, soa.data.clone());
        // A null MX (RFC 7505): the zone takes no mail.
        let mx = Record::from_rdata(name.clone(), zone.ttl, RData::MX(MX::new(0, Name::root())));
        match qtype {
            RecordType::SOA => vec![soa],
            RecordType::MX => vec![mx],
            RecordType::NS => {
                // The name server's address goes along, as an authoritative server's does.
                reply.add_additionals(nameserver_records(
                    &nameserver_name(&apex),
                    zone,
                    RecordType::ANY,
                ));
                vec![ns]
            }
            RecordType::ANY => vec![soa, ns, mx],
            _ => Vec::new(),
        }
    } else if key == nameserver_wire_name() {
        nameserver_records(name, zone, qtype)
    } else {
        match table.lookup(key) {
            Lookup::Service(entry) => service_records(name, entry, qtype, zone.ttl),
            // A table that may be out of date says nothing about names it lacks: the client
            // retries rather than caching an absence that may be wrong.
            Lookup::EmptyNonTerminal | Lookup::Missing if table.is_provisional() => {
                reply.metadata.response_code = ResponseCode::ServFail;
                reply.metadata.authoritative = false;
                return;
            }
            Lookup::EmptyNonTerminal => Vec::new(),
            Lookup::Missing => {
                reply.metadata.response_code = ResponseCode::NXDomain;
                Vec::new()
            }
        }
    };
    if records.is_empty() {
        let mut negative = soa;
        negative.ttl = zone.ttl.min(zone.negative_ttl);
        reply.add_authority(negative);
    } else {
        // SRV targets are mesh names: their addresses go along, as Kubernetes DNS does, so
        // a client needs no second round trip.
        let additionals: Vec<Record> = records
            .iter()
            .filter_map(|record| match &record.data {
                RData::SRV(srv) => Some(srv.target.clone()),
                _ => None,
            })
            .filter_map(|target| {
                let entry = table.service(&lowercase_wire_name(&target))?;
                Some(service_records(&target, entry, RecordType::A, zone.ttl))
            })
            .flatten()
            .collect();
        reply.add_answers(records);
        reply.add_additionals(additionals);
    }
}

fn service_records(name: &Name, entry: &NameEntry, qtype: RecordType, ttl: u32) -> Vec<Record> {
    let a = |addr: &Ipv4Addr| Record::from_rdata(name.clone(), ttl, RData::A(A(*addr)));
    let aaaa = |addr: &Ipv6Addr| Record::from_rdata(name.clone(), ttl, RData::AAAA(AAAA(*addr)));
    let srv = |(priority, weight, port, target): &(u16, u16, u16, Name)| {
        Record::from_rdata(
            name.clone(),
            ttl,
            RData::SRV(SRV::new(*priority, *weight, *port, target.clone())),
        )
    };
    match qtype {
        RecordType::A => entry.v4.iter().map(a).collect(),
        RecordType::AAAA => entry.v6.iter().map(aaaa).collect(),
        RecordType::SRV => entry.srv.iter().map(srv).collect(),
        RecordType::ANY => entry
            .v4
            .iter()
            .map(a)
            .chain(entry.v6.iter().map(aaaa))
            .chain(entry.srv.iter().map(srv))
            .collect(),
        _ => Vec::new(),
    }
}

/// The name server's address records of type `qtype` (ANY: all), owned by `name`.
fn nameserver_records(name: &Name, zone: ZoneSettings, qtype: RecordType) -> Vec<Record> {
    let data = match zone.nameserver {
        Some(IpAddr::V4(v4)) if matches!(qtype, RecordType::A | RecordType::ANY) => RData::A(A(v4)),
        Some(IpAddr::V6(v6)) if matches!(qtype, RecordType::AAAA | RecordType::ANY) => {
            RData::AAAA(AAAA(v6))
        }
        _ => return Vec::new(),
    };
    vec![Record::from_rdata(name.clone(), zone.ttl, data)]
}

fn apex() -> Name {
    let mut apex = Name::from_ascii(ZONE).unwrap_or_else(|_| Name::root());
    apex.set_fqdn(true);
    apex
}

fn nameserver_name(apex: &Name) -> Name {
    apex.prepend_label("ns").unwrap_or_else(|_| apex.clone())
}

fn soa_record(apex: &Name, serial: u32, zone: ZoneSettings) -> Record {
    let hostmaster = apex
        .prepend_label("hostmaster")
        .unwrap_or_else(|_| apex.clone());
    // Nothing transfers the zone, so refresh, retry and expire mean nothing; they are the
    // values RFC 1912 recommends, so checkers have nothing to say about them.
    let soa = SOA::new(
        nameserver_name(apex),
        hostmaster,
        serial,
        14_400,
        3_600,
        604_800,
        zone.negative_ttl,
    );
    Record::from_rdata(apex.clone(), zone.ttl, RData::SOA(soa))
}
