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
    pushes: Family<TypeLabel, Counter>,
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
            pushes: Family::default(),
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
            "ADS streams refused by identity checking, by reason",
            metrics.refused.clone(),
        );
        xds.register(
            "pushes",
            "xDS responses sent, by type",
            metrics.pushes.clone(),
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

    /// A response of `kind` went out, carrying a mesh change taken at `changed_at`.
    pub fn pushed(&self, kind: ResourceType, changed_at: Instant) {
        self.pushes.get_or_create(&kind.into()).inc();
        self.push_latency
            .observe(changed_at.elapsed().as_secs_f64());
    }

    /// An ADS stream was refused for `reason` (identity checking).
    pub fn refused(&self, reason: &'static str) {
        self.refused.get_or_create(&ReasonLabel { reason }).inc();
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
