//! Prometheus metrics, behind small recorder types the servers hold.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TypeLabel {
    pub r#type: &'static str,
}

/// What the xDS server records.
#[derive(Clone, Debug)]
pub struct XdsMetrics {
    pub connected_proxies: Gauge,
    pub pushes: Family<TypeLabel, Counter>,
    pub nacks: Family<TypeLabel, Counter>,
    pub snapshot_version: Gauge,
    /// From the moment a mesh change is seen to the moment a response carrying it is sent.
    pub push_latency: Histogram,
}

impl XdsMetrics {
    fn register(registry: &mut Registry) -> Self {
        let metrics = XdsMetrics {
            connected_proxies: Gauge::default(),
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
}

/// The registry and the recorders registered in it.
pub struct Metrics {
    registry: Registry,
    pub xds: XdsMetrics,
    pub dns: lattice_dns::DnsMetrics,
}

impl Metrics {
    pub fn new() -> Arc<Metrics> {
        let mut registry = Registry::default();
        let xds = XdsMetrics::register(&mut registry);
        let dns = lattice_dns::DnsMetrics::new(&mut registry);
        Arc::new(Metrics { registry, xds, dns })
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
