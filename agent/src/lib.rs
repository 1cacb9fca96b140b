//! Lattice node agent: watches the mesh (a mesh file or Kubernetes), translates it to Envoy
//! resources and DNS names, and serves them to the Envoys and pods on this node.
//!
//! Data flows one way: [`source`] → [`mesh`] snapshot → [`pipeline`] ([`translate`]) →
//! [`xds`] and DNS servers, with [`admin`] reading alongside.

pub mod admin;
pub mod config;
pub mod mesh;
pub mod metrics;
pub mod node_dns;
pub mod pipeline;
pub mod source;
pub mod translate;
pub mod xds;
