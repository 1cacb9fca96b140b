//! What the xDS side records, behind recorder methods: callers say what happened, this module
//! knows the metric names and labels.

use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::ResourceType;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TypeLabel {
    r#type: &'static str,
}

impl From<ResourceType> for TypeLabel {
    fn from(kind: ResourceType) -> Self {
        TypeLabel {
            r#type: kind.short(),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

/// The xDS recorders; cheap to clone (each metric is shared).
#[derive(Clone, Debug)]
pub struct XdsMetrics {
    connected_proxies: Gauge,
    refused: Family<ReasonLabel, Counter>,
    connections: Gauge,
    refused_connections: Family<ReasonLabel, Counter>,
    closed_connections: Family<ReasonLabel, Counter>,
    /// Bytes of requests being read, taken from the shared request budget.
    request_bytes: Gauge,
    /// Bytes of responses encoded and not yet written to a socket.
    response_bytes: Gauge,
    pushes: Family<TypeLabel, Counter>,
    resources_sent: Family<TypeLabel, Counter>,
    nacks: Family<TypeLabel, Counter>,
    snapshot_version: Gauge,
    /// From the moment a mesh change is taken to the moment a response carrying it is sent.
    push_latency: Histogram,
}

impl XdsMetrics {
    /// Registers the xDS metrics (`lattice_xds_*`) in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = XdsMetrics {
            connected_proxies: Gauge::default(),
            refused: Family::default(),
            connections: Gauge::default(),
            refused_connections: Family::default(),
            closed_connections: Family::default(),
            request_bytes: Gauge::default(),
            response_bytes: Gauge::default(),
            pushes: Family::default(),
            resources_sent: Family::default(),
            nacks: Family::default(),
            snapshot_version: Gauge::default(),
            push_latency: Histogram::new([
                0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
            ]),
        };
        let xds = registry.sub_registry_with_prefix("lattice_xds");
        xds.register(
            "connected_proxies",
            "ADS streams currently open",
            metrics.connected_proxies.clone(),
        );
        xds.register(
            "refused_streams",
            "ADS streams refused or ended by the server, by reason: identity checking, a cap, \
             a request too large or that does not decode, no first request in time",
            metrics.refused.clone(),
        );
        xds.register(
            "connections",
            "xDS connections currently open",
            metrics.connections.clone(),
        );
        xds.register(
            "refused_connections",
            "xDS connections refused at once for a cap, by reason",
            metrics.refused_connections.clone(),
        );
        xds.register(
            "closed_connections",
            "xDS connections that ended, by how: the peer closed it, its keep-alive PING went \
             unanswered, TCP gave up on it (keep-alive probes or retransmissions), a protocol \
             or I/O error, or the agent's shutdown (drained in time, or closed at the drain \
             deadline)",
            metrics.closed_connections.clone(),
        );
        xds.register(
            "request_buffered_bytes",
            "Bytes of requests being read, held against --xds-request-buffer-bytes",
            metrics.request_bytes.clone(),
        );
        xds.register(
            "response_buffered_bytes",
            "Bytes of responses encoded and not yet written to a socket, summed over streams",
            metrics.response_bytes.clone(),
        );
        xds.register(
            "pushes",
            "xDS responses sent, by type",
            metrics.pushes.clone(),
        );
        xds.register(
            "resources_sent",
            "Resources carried by xDS responses, by type (a reconnecting proxy that holds what \
             it wants is sent none)",
            metrics.resources_sent.clone(),
        );
        xds.register(
            "nacks",
            "xDS responses rejected by a proxy, by type",
            metrics.nacks.clone(),
        );
        xds.register(
            "snapshot_version",
            "Version of the mesh snapshot being served",
            metrics.snapshot_version.clone(),
        );
        xds.register(
            "push_latency_seconds",
            "Seconds from a mesh change to a response carrying it",
            metrics.push_latency.clone(),
        );
        metrics
    }

    pub fn stream_opened(&self) {
        self.connected_proxies.inc();
    }

    pub fn stream_closed(&self) {
        self.connected_proxies.dec();
    }

    /// A response of `kind` with `resources` went out, carrying a mesh change taken at
    /// `changed_at`.
    pub fn pushed(&self, kind: ResourceType, resources: usize, changed_at: Instant) {
        self.pushes.get_or_create(&kind.into()).inc();
        self.resources_sent
            .get_or_create(&kind.into())
            .inc_by(resources as u64);
        // A secret changes with its leaf, not with the mesh: it has no mesh-change latency.
        if kind != ResourceType::Secret {
            self.push_latency
                .observe(changed_at.elapsed().as_secs_f64());
        }
    }

    /// An ADS stream was refused, or ended by the server, for `reason`.
    pub fn refused(&self, reason: &'static str) {
        self.refused.get_or_create(&ReasonLabel { reason }).inc();
    }

    pub fn connection_opened(&self) {
        self.connections.inc();
    }

    /// A connection ended, as `how` says.
    pub fn connection_closed(&self, how: &'static str) {
        self.connections.dec();
        self.closed_connections
            .get_or_create(&ReasonLabel { reason: how })
            .inc();
    }

    /// A connection was refused at once, over the cap `reason` names.
    pub fn connection_refused(&self, reason: &'static str) {
        self.refused_connections
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// Request bytes taken from (positive) or given back to (negative) the shared budget.
    pub fn request_bytes_held(&self, delta: i64) {
        self.request_bytes.inc_by(delta);
    }

    /// The gauge of response bytes waiting for the socket, for what carries them there.
    pub fn response_bytes(&self) -> Gauge {
        self.response_bytes.clone()
    }

    pub fn nacked(&self, kind: ResourceType) {
        self.nacks.get_or_create(&kind.into()).inc();
    }

    /// The translator published the resources of mesh snapshot `version`.
    pub fn serving(&self, version: u64) {
        self.snapshot_version
            .set(i64::try_from(version).unwrap_or(i64::MAX));
    }
}
