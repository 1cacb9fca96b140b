//! What the mesh holds, as gauges: recorded for each snapshot the translators take.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::MeshSnapshot;

#[derive(Clone, Debug, Default)]
pub struct MeshMetrics {
    services: Gauge,
    endpoints: Gauge,
    route_rules: Gauge,
    rejected_routes: Gauge,
    refused_paths: Gauge,
    conflicts: Gauge,
    stale_providers: Gauge,
    address_record_write_failures: Counter,
    last_mesh_write_failures: Counter,
    last_mesh_version: Gauge,
    file_copies_behind: Gauge,
}

impl MeshMetrics {
    /// Registers the mesh gauges (`lattice_mesh_*`) in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = MeshMetrics::default();
        let mesh = registry.sub_registry_with_prefix("lattice_mesh");
        mesh.register(
            "services",
            "Services in the mesh snapshot being served",
            metrics.services.clone(),
        );
        mesh.register(
            "endpoints",
            "Endpoints (service port and address pairs) in the mesh snapshot being served",
            metrics.endpoints.clone(),
        );
        mesh.register(
            "route_rules",
            "Routing rules in effect on the mesh's services",
            metrics.route_rules.clone(),
        );
        mesh.register(
            "rejected_routes",
            "Routes (and route parents) the agent refused; /debug/routes says why",
            metrics.rejected_routes.clone(),
        );
        mesh.register(
            "refused_paths",
            "Services left out of the mesh for the path they claim; /debug/mesh says why",
            metrics.refused_paths.clone(),
        );
        mesh.register(
            "conflicts",
            "Service paths on which providers disagree; /debug/mesh says how",
            metrics.conflicts.clone(),
        );
        mesh.register(
            "stale_providers",
            "Providers whose last good view serves while they cannot refresh it",
            metrics.stale_providers.clone(),
        );
        mesh.register(
            "address_record_write_failures",
            "Writes of the address record on the node (--state-dir) that failed; /debug/mesh says why",
            metrics.address_record_write_failures.clone(),
        );
        mesh.register(
            "last_mesh_write_failures",
            "Writes of the node's last mesh (--state-dir) that failed; the agent's log says why",
            metrics.last_mesh_write_failures.clone(),
        );
        mesh.register(
            "last_mesh_version",
            "Version of the mesh snapshot the node's last mesh (--state-dir) holds: written, or \
             found to hold it already; 0 until then",
            metrics.last_mesh_version.clone(),
        );
        mesh.register(
            "file_copies_behind",
            "Mesh files whose copy in --state-dir does not hold the text being served yet: \
             written at SCHED_IDLE after a start that read the file, and 5 s after an edit",
            metrics.file_copies_behind.clone(),
        );
        metrics
    }

    /// Counts a failed write of the address record.
    pub fn address_record_write_failed(&self) {
        self.address_record_write_failures.inc();
    }

    /// Counts a failed write of the node's last mesh.
    pub fn last_mesh_write_failed(&self) {
        self.last_mesh_write_failures.inc();
    }

    /// The node's last mesh holds the snapshot of `version`.
    pub fn last_mesh_holds(&self, version: u64) {
        self.last_mesh_version
            .set(i64::try_from(version).unwrap_or(i64::MAX));
    }

    /// A mesh file's copy fell behind the text being served.
    pub fn file_copy_behind(&self) {
        self.file_copies_behind.inc();
    }

    /// A mesh file's copy was written (or has nothing to hold); not after a failed write.
    pub fn file_copy_caught_up(&self) {
        self.file_copies_behind.dec();
    }

    /// Records what the catalog reports: paths in conflict and stale providers.
    pub fn observe_catalog(&self, conflicts: usize, stale_providers: usize) {
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.conflicts.set(count(conflicts));
        self.stale_providers.set(count(stale_providers));
    }

    /// Records `mesh`.
    pub fn observe(&self, mesh: &MeshSnapshot) {
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.services.set(count(mesh.services.len()));
        self.endpoints.set(count(mesh.endpoint_count()));
        self.route_rules.set(count(mesh.route_rule_count()));
        self.rejected_routes.set(count(mesh.rejected_routes.len()));
        self.refused_paths.set(count(mesh.refused_paths.len()));
    }
}
