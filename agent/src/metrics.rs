//! The Prometheus registry: every part registers its recorders here and keeps them; `/metrics`
//! encodes the lot.

use std::sync::Arc;

use prometheus_client::registry::Registry;

use crate::mesh::MeshMetrics;
use crate::scope::ScopeMetrics;
use crate::trust::TrustMetrics;
use crate::xds::XdsMetrics;

/// The registry and the recorders registered in it.
pub struct Metrics {
    registry: Registry,
    pub mesh: MeshMetrics,
    pub xds: XdsMetrics,
    pub dns: lattice_dns::DnsMetrics,
    pub scope: ScopeMetrics,
    pub trust: TrustMetrics,
}

impl Metrics {
    pub fn new() -> Arc<Metrics> {
        let mut registry = Registry::default();
        let mesh = MeshMetrics::register(&mut registry);
        let xds = XdsMetrics::register(&mut registry);
        let dns = lattice_dns::DnsMetrics::new(&mut registry);
        let scope = ScopeMetrics::register(&mut registry);
        let trust = TrustMetrics::register(&mut registry);
        Arc::new(Metrics {
            registry,
            mesh,
            xds,
            dns,
            scope,
            trust,
        })
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
