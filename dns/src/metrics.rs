//! DNS metrics: replies by rcode and by where the answer came from; the forwarding cache (hits,
//! misses, evictions by reason, size) and coalesced queries; each upstream's queries, state and
//! smoothed round-trip time, upstream latency and failures; what the budgets turned away, and the
//! TCP connections. The counters the fast path touches are resolved once, so counting there is
//! one atomic add.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use hickory_proto::op::ResponseCode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Where an answer came from: the `source` label of the replies counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Served {
    Local,
    Forwarded,
    Cached,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReplyLabels {
    rcode: String,
    source: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UpstreamLabels {
    upstream: String,
}

/// Why the forwarding cache let an answer go: the `reason` label of its evictions counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Eviction {
    /// The cache (a shard of it) was full: least recently used out.
    Capacity,
    /// The client whose query cached it was at its quota and cached another.
    SourceQuota,
    /// Its TTL ran out.
    Expired,
}

/// Recorder for the DNS server's metrics, registered under `lattice_dns_`.
#[derive(Clone, Debug)]
pub struct DnsMetrics {
    replies: Family<ReplyLabels, Counter>,
    local_noerror: Counter,
    dropped: Counter,
    upstream_duration: Histogram,
    upstream_failures: Family<ReasonLabels, Counter>,
    upstream_truncated: Counter,
    upstream_queries: Family<UpstreamLabels, Counter>,
    upstream_up: Family<UpstreamLabels, Gauge>,
    upstream_srtt: Family<UpstreamLabels, Gauge<f64, AtomicU64>>,
    cache_hits: Counter,
    cache_misses: Counter,
    cache_evictions: Family<ReasonLabels, Counter>,
    cache_entries: Gauge,
    cache_bytes: Gauge,
    coalesced: Counter,
    limited: Family<ReasonLabels, Counter>,
    tcp_connections: Gauge,
    tcp_closed: Family<ReasonLabels, Counter>,
}

impl DnsMetrics {
    pub fn new(registry: &mut Registry) -> Self {
        let registry = registry.sub_registry_with_prefix("lattice_dns");
        let replies = Family::<ReplyLabels, Counter>::default();
        registry.register(
            "replies",
            "DNS replies sent, by rcode and by source (local: the mesh zone; forwarded: an upstream; cached: the forwarding cache)",
            replies.clone(),
        );
        let dropped = Counter::default();
        registry.register(
            "dropped",
            "DNS queries dropped without a reply (responses, runt packets, overload)",
            dropped.clone(),
        );
        let upstream_duration = Histogram::new(exponential_buckets(0.000_25, 2.0, 16));
        registry.register(
            "upstream_duration_seconds",
            "Time for an upstream to answer a forwarded query",
            upstream_duration.clone(),
        );
        let upstream_failures = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "upstream_failures",
            "Upstream exchanges that gave no usable answer, by reason (timeout, io, malformed, rcode)",
            upstream_failures.clone(),
        );
        let upstream_truncated = Counter::default();
        registry.register(
            "upstream_truncated",
            "Upstream UDP answers that were truncated and retried over TCP",
            upstream_truncated.clone(),
        );
        let upstream_queries = Family::<UpstreamLabels, Counter>::default();
        registry.register(
            "upstream_queries",
            "Queries sent to each upstream (probes of a down upstream included)",
            upstream_queries.clone(),
        );
        let upstream_up = Family::<UpstreamLabels, Gauge>::default();
        registry.register(
            "upstream_up",
            "1 while an upstream answers; 0 while it is down: skipped, and probed now and then",
            upstream_up.clone(),
        );
        let upstream_srtt = Family::<UpstreamLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "upstream_srtt_seconds",
            "Smoothed round-trip time of each upstream; upstreams that are up are asked fastest first",
            upstream_srtt.clone(),
        );
        let cache_hits = Counter::default();
        registry.register(
            "cache_hits",
            "Forwarded queries answered from the cache",
            cache_hits.clone(),
        );
        let cache_misses = Counter::default();
        registry.register(
            "cache_misses",
            "Forwarded queries the cache could not answer (each waited for an upstream)",
            cache_misses.clone(),
        );
        let cache_evictions = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "cache_evictions",
            "Answers the cache let go, by reason (capacity: it was full; source_quota: the client that cached it cached another at its quota; expired: its TTL ran out)",
            cache_evictions.clone(),
        );
        let cache_entries = Gauge::default();
        registry.register(
            "cache_entries",
            "Answers in the forwarding cache",
            cache_entries.clone(),
        );
        let cache_bytes = Gauge::default();
        registry.register(
            "cache_bytes",
            "Bytes the forwarding cache's answers take, as counted against its byte limit",
            cache_bytes.clone(),
        );
        let coalesced = Counter::default();
        registry.register(
            "coalesced",
            "Forwarded queries that joined an upstream query already under way for the same question instead of sending their own",
            coalesced.clone(),
        );
        let limited = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "limited",
            "Queries and connections turned away by a budget, by reason (forwards_per_source, forwards: a forwarded query got SERVFAIL; forwards_per_source_unanswered: over its source's SERVFAIL rate, dropped unanswered; tcp_connections_per_source, tcp_connections: a connection was refused; tcp_idle_evicted: an idle connection was closed for a new one)",
            limited.clone(),
        );
        let tcp_connections = Gauge::default();
        registry.register(
            "tcp_connections",
            "TCP connections open",
            tcp_connections.clone(),
        );
        let tcp_closed = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "tcp_closed",
            "TCP connections closed by the server, by reason (idle, lifetime, evicted, drain, oversized: a message over 4 KiB, stalled: the client did not read its answers)",
            tcp_closed.clone(),
        );
        let local_noerror = replies
            .get_or_create(&ReplyLabels {
                rcode: rcode_label(ResponseCode::NoError),
                source: "local",
            })
            .clone();
        Self {
            replies,
            local_noerror,
            dropped,
            upstream_duration,
            upstream_failures,
            upstream_truncated,
            upstream_queries,
            upstream_up,
            upstream_srtt,
            cache_hits,
            cache_misses,
            cache_evictions,
            cache_entries,
            cache_bytes,
            coalesced,
            limited,
            tcp_connections,
            tcp_closed,
        }
    }

    /// `count` NOERROR replies from the fast path.
    pub(crate) fn fast_replies(&self, count: u64) {
        self.local_noerror.inc_by(count);
    }

    pub(crate) fn reply(&self, rcode: ResponseCode, source: Served) {
        let source = match source {
            Served::Local => "local",
            Served::Forwarded => "forwarded",
            Served::Cached => "cached",
        };
        self.replies
            .get_or_create(&ReplyLabels {
                rcode: rcode_label(rcode),
                source,
            })
            .inc();
    }

    pub(crate) fn dropped(&self) {
        self.dropped.inc();
    }

    pub(crate) fn upstream_latency(&self, elapsed: Duration) {
        self.upstream_duration.observe(elapsed.as_secs_f64());
    }

    pub(crate) fn upstream_failure(&self, reason: &'static str) {
        self.upstream_failures
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    pub(crate) fn upstream_truncated(&self) {
        self.upstream_truncated.inc();
    }

    pub(crate) fn upstream_query(&self, upstream: SocketAddr) {
        self.upstream_queries
            .get_or_create(&UpstreamLabels {
                upstream: upstream.to_string(),
            })
            .inc();
    }

    pub(crate) fn upstream_state(&self, upstream: SocketAddr, up: bool, srtt: Option<Duration>) {
        let labels = UpstreamLabels {
            upstream: upstream.to_string(),
        };
        self.upstream_up.get_or_create(&labels).set(i64::from(up));
        if let Some(srtt) = srtt {
            self.upstream_srtt
                .get_or_create(&labels)
                .set(srtt.as_secs_f64());
        }
    }

    pub(crate) fn cache_hit(&self) {
        self.cache_hits.inc();
    }

    pub(crate) fn cache_miss(&self) {
        self.cache_misses.inc();
    }

    pub(crate) fn cache_evicted(&self, reason: Eviction, count: u64) {
        let reason = match reason {
            Eviction::Capacity => "capacity",
            Eviction::SourceQuota => "source_quota",
            Eviction::Expired => "expired",
        };
        self.cache_evictions
            .get_or_create(&ReasonLabels { reason })
            .inc_by(count);
    }

    /// The cache grew (or shrank) by `entries` answers and `bytes` bytes.
    pub(crate) fn cache_size(&self, entries: i64, bytes: i64) {
        self.cache_entries.inc_by(entries);
        self.cache_bytes.inc_by(bytes);
    }

    pub(crate) fn coalesced(&self) {
        self.coalesced.inc();
    }

    /// Counts a query or connection refused by a limit, under the limit's label (the budget's
    /// `Limit::label`).
    pub(crate) fn limited(&self, reason: &'static str) {
        self.limited.get_or_create(&ReasonLabels { reason }).inc();
    }

    pub(crate) fn tcp_connections(&self, open: usize) {
        self.tcp_connections
            .set(i64::try_from(open).unwrap_or(i64::MAX));
    }

    pub(crate) fn tcp_closed(&self, reason: &'static str) {
        self.tcp_closed
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }
}

/// The rcode's mnemonic as dig prints it (`NXDOMAIN`), or its number.
fn rcode_label(rcode: ResponseCode) -> String {
    match rcode {
        ResponseCode::NoError => "NOERROR".into(),
        ResponseCode::FormErr => "FORMERR".into(),
        ResponseCode::ServFail => "SERVFAIL".into(),
        ResponseCode::NXDomain => "NXDOMAIN".into(),
        ResponseCode::NotImp => "NOTIMP".into(),
        ResponseCode::Refused => "REFUSED".into(),
        ResponseCode::BADVERS => "BADVERS".into(),
        other => u16::from(other).to_string(),
    }
}
