//! The xDS side: the per-stream ADS state machines and the gRPC server that drives them.

pub mod server;
pub mod stream;

pub use server::{ProxyRegistry, XdsServer};
