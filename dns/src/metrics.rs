//! DNS metrics: replies by rcode and by where the answer came from, upstream latency and failures,
//! what the budgets turned away, and the TCP connections. The counters the fast path touches are
//! resolved once, so counting there is one atomic add.

use std::time::Duration;

use hickory_proto::op::ResponseCode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::budget::Limit;

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

/// Recorder for the DNS server's metrics, registered under `lattice_dns_`.
#[derive(Clone, Debug)]
pub struct DnsMetrics {
    replies: Family<ReplyLabels, Counter>,
    local_noerror: Counter,
    dropped: Counter,
    upstream_duration: Histogram,
    upstream_failures: Family<ReasonLabels, Counter>,
    upstream_truncated: Counter,
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
        let limited = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "limited",
            "Queries and connections turned away by a budget, by reason (forwards_per_source, forwards: a forwarded query got SERVFAIL; tcp_connections_per_source, tcp_connections: a connection was refused; tcp_idle_evicted: an idle connection was closed for a new one)",
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

    pub(crate) fn limited(&self, limit: Limit) {
        self.limited
            .get_or_create(&ReasonLabels {
                reason: limit.label(),
            })
            .inc();
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
