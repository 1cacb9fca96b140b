//! Translators: pure functions from a mesh snapshot to what the servers hand out (the Envoy
//! resources of [`crate::xds`], the DNS name table of [`lattice_dns`]), and the pipeline that
//! runs them on every snapshot and publishes the results.

pub mod dns;
pub mod envoy;
pub mod pipeline;
