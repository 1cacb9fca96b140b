//! The xDS side: the snapshot of Envoy resources it serves, the per-stream ADS state machines
//! (state of the world and Delta) and the gRPC server that drives them.
//!
//! It knows nothing of the mesh model or of where the resources come from: the Envoy
//! translator produces an [`XdsSnapshot`] and publishes it on the [`snapshot::channel`].

pub mod admission;
pub mod connection;
mod delta;
mod grpc;
mod held;
mod inbound;
mod interest;
pub mod limits;
pub mod metrics;
pub mod parts;
mod proto;
mod resource;
mod response;
pub mod secrets;
pub mod server;
pub mod snapshot;
mod sotw;
mod stream;
#[cfg(test)]
mod testing;
mod view;
mod wire;

/// The mode and the probes [`InboundListeners`] builds a listener for.
pub use crate::identity::{InboundMode, InboundProbe, ProbeKind};
pub use admission::Caps;
pub use delta::DeltaStream;
pub use grpc::AdsService;
pub use limits::{RequestBound, XdsLimits};
pub use metrics::XdsMetrics;
pub use parts::{ListenerBase, Part, PartsIndex, ServiceParts};
pub use response::{DeltaResponse, SotwResponse};
pub use server::{ProxyRegistry, XdsServer};
pub use snapshot::InboundListeners;
pub use snapshot::{ResourceMap, ResourceType, XdsResource, XdsRx, XdsSnapshot, XdsTx};
pub use sotw::SotwStream;
pub use stream::{Ads, DEFAULT_MAX_NAMES, Event, Limits, Push};
pub use wire::{DeltaRequest, NameList, SotwRequest};
#[cfg(any(test, fuzzing))]
pub use wire::{check_delta_request, check_request, check_sotw_request};
