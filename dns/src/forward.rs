//! Forwarding to the upstream resolvers: UDP with a 1232-byte EDNS buffer, TCP when the answer is
//! truncated, failover across upstreams, SERVFAIL when none answers, and an optional TTL cache.

use std::collections::HashMap;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hickory_proto::op::{Edns, Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::{RData, Record};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};

use crate::metrics::{DnsMetrics, Served};
use crate::wire::{MAX_UDP_PAYLOAD, lowercase_wire_name};

/// Why one upstream gave no usable answer; the next upstream is tried.
#[derive(Debug, thiserror::Error)]
enum ExchangeError {
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("malformed answer: {0}")]
    Malformed(String),
}

pub(crate) struct Forwarder {
    upstreams: Vec<SocketAddr>,
    timeout: Duration,
    cache: Option<Cache>,
    /// Forwarded records' TTLs are cut to this.
    max_ttl: u32,
    metrics: DnsMetrics,
}

impl Forwarder {
    pub(crate) fn new(
        upstreams: Vec<SocketAddr>,
        timeout: Duration,
        cache_entries: Option<usize>,
        max_ttl: u32,
        metrics: DnsMetrics,
    ) -> Self {
        Self {
            upstreams,
            timeout,
            cache: cache_entries.map(Cache::new),
            max_ttl,
            metrics,
        }
    }

    /// The cached answer to `request`'s question, if there is a live one: no I/O, so the
    /// server answers it in line instead of in a task of its own.
    pub(crate) fn cached(&self, request: &Message) -> Option<Message> {
        let key = CacheKey::of(request)?;
        self.cache.as_ref()?.get(&key)
    }

    /// The upstream answer to `request`'s question, or `None` if no upstream answered.
    pub(crate) async fn resolve(&self, request: &Message) -> Option<(Message, Served)> {
        let key = CacheKey::of(request)?;
        if let Some(hit) = self.cache.as_ref().and_then(|c| c.get(&key)) {
            return Some((hit, Served::Cached));
        }
        let query = upstream_query(request);
        let mut last_answer = None;
        for upstream in &self.upstreams {
            let started = Instant::now();
            match self.exchange(*upstream, &query).await {
                Ok(answer) => {
                    self.metrics.upstream_latency(started.elapsed());
                    let rcode = answer.metadata.response_code;
                    // SERVFAIL and REFUSED are about that server, not the name: try the next one.
                    if matches!(rcode, ResponseCode::ServFail | ResponseCode::Refused) {
                        tracing::debug!(%upstream, %rcode, "upstream failed the query; trying the next");
                        self.metrics.upstream_failure("rcode");
                        last_answer = Some(answer);
                        continue;
                    }
                    let mut answer = answer;
                    cap_ttls(&mut answer, self.max_ttl);
                    if let Some(cache) = &self.cache {
                        cache.insert(key, &answer);
                    }
                    return Some((answer, Served::Forwarded));
                }
                Err(error) => {
                    tracing::debug!(%upstream, %error, "upstream exchange failed; trying the next");
                    self.metrics.upstream_failure(match error {
                        ExchangeError::Timeout(_) => "timeout",
                        ExchangeError::Io(_) => "io",
                        ExchangeError::Malformed(_) => "malformed",
                    });
                }
            }
        }
        last_answer.map(|a| (a, Served::Forwarded))
    }

    async fn exchange(
        &self,
        upstream: SocketAddr,
        query: &Message,
    ) -> Result<Message, ExchangeError> {
        let bytes = query
            .to_vec()
            .map_err(|e| ExchangeError::Malformed(e.to_string()))?;
        let answer = tokio::time::timeout(self.timeout, udp_exchange(upstream, query, &bytes))
            .await
            .map_err(|_| ExchangeError::Timeout(self.timeout))??;
        if !answer.metadata.truncation {
            return Ok(answer);
        }
        self.metrics.upstream_truncated();
        tokio::time::timeout(self.timeout, tcp_exchange(upstream, query, &bytes))
            .await
            .map_err(|_| ExchangeError::Timeout(self.timeout))?
    }
}

/// The query sent upstream: the client's question and RD/CD/DO bits, a fresh random id, and our
/// own EDNS (the client's options, such as cookies, are hop-by-hop).
fn upstream_query(request: &Message) -> Message {
    let mut query = Message::new(rand::random(), MessageType::Query, OpCode::Query);
    query.metadata.recursion_desired = request.metadata.recursion_desired;
    query.metadata.checking_disabled = request.metadata.checking_disabled;
    query.queries.clone_from(&request.queries);
    let mut edns = Edns::new();
    edns.set_max_payload(MAX_UDP_PAYLOAD);
    edns.set_version(0);
    edns.set_dnssec_ok(request.edns.as_ref().is_some_and(|e| e.flags().dnssec_ok));
    query.edns = Some(edns);
    query
}

/// True if `answer` answers `query`: same id, a response, same question (names compared without
/// case: some servers do not preserve it).
fn is_answer_to(answer: &Message, query: &Message) -> bool {
    answer.metadata.id == query.metadata.id
        && answer.metadata.message_type == MessageType::Response
        && answer.queries.len() == query.queries.len()
        && answer.queries.iter().zip(&query.queries).all(|(a, q)| {
            a.query_type() == q.query_type()
                && a.query_class() == q.query_class()
                && a.name().eq_ignore_root(q.name())
        })
}

async fn udp_exchange(
    upstream: SocketAddr,
    query: &Message,
    bytes: &[u8],
) -> Result<Message, ExchangeError> {
    let local: SocketAddr = match upstream {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = UdpSocket::bind(local).await?;
    socket.connect(upstream).await?;
    socket.send(bytes).await?;
    let mut buf = vec![0; usize::from(u16::MAX)];
    loop {
        let len = socket.recv(&mut buf).await?;
        // Anything that is not the answer (late, spoofed, garbage) is ignored; the timeout bounds us.
        if let Ok(answer) = Message::from_vec(&buf[..len])
            && is_answer_to(&answer, query)
        {
            return Ok(answer);
        }
    }
}

async fn tcp_exchange(
    upstream: SocketAddr,
    query: &Message,
    bytes: &[u8],
) -> Result<Message, ExchangeError> {
    let mut stream = TcpStream::connect(upstream).await?;
    let len = u16::try_from(bytes.len())
        .map_err(|_| ExchangeError::Malformed("query too long for TCP".into()))?;
    let mut framed = Vec::with_capacity(bytes.len() + 2);
    framed.extend_from_slice(&len.to_be_bytes());
    framed.extend_from_slice(bytes);
    stream.write_all(&framed).await?;
    let len = stream.read_u16().await?;
    let mut buf = vec![0; usize::from(len)];
    stream.read_exact(&mut buf).await?;
    let answer = Message::from_vec(&buf).map_err(|e| ExchangeError::Malformed(e.to_string()))?;
    if is_answer_to(&answer, query) {
        Ok(answer)
    } else {
        Err(ExchangeError::Malformed(
            "TCP answer does not match the query".into(),
        ))
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct CacheKey {
    name: Vec<u8>,
    qtype: u16,
    qclass: u16,
    dnssec_ok: bool,
    checking_disabled: bool,
    recursion_desired: bool,
}

impl CacheKey {
    fn of(request: &Message) -> Option<Self> {
        let question = request.queries.first()?;
        Some(Self {
            name: lowercase_wire_name(question.name()),
            qtype: question.query_type().into(),
            qclass: question.query_class().into(),
            dnssec_ok: request.edns.as_ref().is_some_and(|e| e.flags().dnssec_ok),
            checking_disabled: request.metadata.checking_disabled,
            recursion_desired: request.metadata.recursion_desired,
        })
    }
}

struct CacheEntry {
    answer: Message,
    stored: Instant,
    ttl: u32,
}

/// Upstream answers kept for their TTL: the smallest TTL of the answer section, or for negative
/// answers the SOA's TTL capped by its minimum (RFC 2308). Served TTLs count down.
struct Cache {
    capacity: usize,
    entries: Mutex<HashMap<CacheKey, CacheEntry>>,
}

impl Cache {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            entries: Mutex::new(HashMap::new()),
        }
    }

    fn get(&self, key: &CacheKey) -> Option<Message> {
        let mut entries = self.entries.lock().ok()?;
        let entry = entries.get(key)?;
        let age = u32::try_from(entry.stored.elapsed().as_secs()).unwrap_or(u32::MAX);
        if age >= entry.ttl {
            entries.remove(key);
            return None;
        }
        let mut answer = entry.answer.clone();
        for record in answer
            .answers
            .iter_mut()
            .chain(&mut answer.authorities)
            .chain(&mut answer.additionals)
        {
            record.ttl = record.ttl.saturating_sub(age);
        }
        Some(answer)
    }

    fn insert(&self, key: CacheKey, answer: &Message) {
        let Some(ttl) = cache_ttl(answer) else {
            return;
        };
        let Ok(mut entries) = self.entries.lock() else {
            return;
        };
        if entries.len() >= self.capacity {
            entries.retain(|_, e| e.stored.elapsed().as_secs() < u64::from(e.ttl));
            if entries.len() >= self.capacity {
                entries.clear();
            }
        }
        entries.insert(
            key,
            CacheEntry {
                answer: answer.clone(),
                stored: Instant::now(),
                ttl,
            },
        );
    }
}

/// Cuts every record's TTL to `max`: clients (Envoy's DNS clusters among them, which refresh
/// on the TTL) then look a name up again at least that often.
fn cap_ttls(answer: &mut Message, max: u32) {
    for record in answer
        .answers
        .iter_mut()
        .chain(answer.authorities.iter_mut())
        .chain(answer.additionals.iter_mut())
    {
        record.ttl = record.ttl.min(max);
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::Query;
    use hickory_proto::rr::rdata::{A, SOA};
    use hickory_proto::rr::{Name, RecordType};

    fn answer_with(ttl: u32) -> Message {
        let name = Name::from_ascii("www.example.test.").unwrap();
        let mut m = Message::response(1, OpCode::Query);
        m.add_query(Query::query(name.clone(), RecordType::A));
        m.add_answer(Record::from_rdata(
            name,
            ttl,
            RData::A(A([192, 0, 2, 1].into())),
        ));
        m
    }

    #[test]
    fn forwarded_ttls_are_capped() {
        let mut answer = answer_with(86_400);
        cap_ttls(&mut answer, 300);
        assert_eq!(answer.answers[0].ttl, 300);
        let mut short = answer_with(7);
        cap_ttls(&mut short, 300);
        assert_eq!(short.answers[0].ttl, 7, "shorter TTLs pass unchanged");
    }

    #[test]
    fn cache_ttl_is_the_smallest_answer_ttl_or_the_soa_minimum() {
        assert_eq!(cache_ttl(&answer_with(300)), Some(300));
        assert_eq!(cache_ttl(&answer_with(0)), None);
        let mut nx = Message::response(1, OpCode::Query);
        nx.metadata.response_code = ResponseCode::NXDomain;
        let zone = Name::from_ascii("example.test.").unwrap();
        let soa = SOA::new(zone.clone(), zone.clone(), 1, 1, 1, 1, 60);
        nx.add_authority(Record::from_rdata(zone, 3600, RData::SOA(soa)));
        assert_eq!(cache_ttl(&nx), Some(60));
        let mut fail = answer_with(300);
        fail.metadata.response_code = ResponseCode::ServFail;
        assert_eq!(cache_ttl(&fail), None);
    }

    #[test]
    fn cache_serves_within_ttl_only() {
        let cache = Cache::new(2);
        let request = answer_with(1);
        let key = CacheKey::of(&request).unwrap();
        cache.insert(key.clone(), &answer_with(300));
        assert_eq!(cache.get(&key).unwrap().answers[0].ttl, 300);
        let short = Cache::new(2);
        short.insert(key.clone(), &answer_with(1));
        short.entries.lock().unwrap().get_mut(&key).unwrap().stored -= Duration::from_secs(1);
        assert!(short.get(&key).is_none());
    }
}
