//! Mesh sources: where the mesh comes from (a mesh file, or Kubernetes). A source builds
//! [`crate::mesh::MeshState`] from what it watches and publishes only complete, consistent
//! snapshots on the mesh channel.

pub mod file;
pub mod kube;
