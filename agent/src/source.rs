//! Mesh sources: where the mesh comes from (a mesh file, or Kubernetes). A source builds
//! [`crate::mesh::MeshState`] from what it watches and publishes only complete, consistent
//! snapshots on the mesh channel.

pub mod authorization;
pub mod file;
pub mod health;
pub mod kube;

use std::time::Duration;

/// A Gateway API duration (GEP-2257: `500ms`, `1m30s`; units h, m, s, ms), the form both
/// sources write durations in.
fn gateway_duration(text: &str) -> Result<Duration, String> {
    use std::str::FromStr;
    gateway_api::Duration::from_str(text)
        .map(|d| Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
        .map_err(|e| format!("{text:?} is not a duration like 500ms or 1m30s: {e}"))
}
