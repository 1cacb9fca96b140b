//! Translators: pure functions from a mesh snapshot to what the servers hand out.

pub mod dns;
pub mod envoy;
