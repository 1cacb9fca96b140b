// WARNING: generated file — do not edit
pub mod constants;
mod enum_defaults;
pub mod gatewayclasses;
pub mod gateways;
pub mod grpcroutes;
pub mod httproutes;
pub mod listenersets;
pub mod referencegrants;
pub mod tcproutes;
pub mod tlsroutes;
pub mod udproutes;
pub mod xbackendtrafficpolicies;
pub mod xmeshes;
