//! Gateway API routes for a mesh (the GAMMA binding): `HTTPRoute` and `GRPCRoute` objects whose
//! `parentRefs` name a core Service, and the `ReferenceGrant`s that let a route send traffic to
//! a Service in another namespace.
//!
//! Routes are mapped as they arrive into [`RouteEntry`]s: the rules in the mesh model's terms,
//! with the parents and backends still as Kubernetes references, because those resolve against
//! Services that come and go. [`RouteIndex`] keeps the entries and the grants, knows which
//! parents a change touches, and resolves a parent's rules and every rejection on demand.
//!
//! What a route may bind to, and what is refused with a reason (never half-applied):
//! - a parent must be a Service in the route's own namespace (a producer route); consumer
//!   routes, from another namespace, need a view per client namespace that the agent does not
//!   build yet;
//! - the parent must hold its mesh path and have only HTTP ports (a Service with a TCP port is
//!   reached by an address of its own and proxied as TCP), and a `port` must be one of its ports;
//! - a GRPCRoute and an HTTPRoute on the same Service port: the GRPCRoute wins, as the Gateway
//!   API orders route kinds;
//! - a rule the agent cannot express (a filter it does not implement, a bad regular expression
//!   or duration) rejects the whole route.
//!
//! A backend that does not resolve (no such Service or port, a kind other than Service, another
//! namespace without a ReferenceGrant that allows it) does not reject its route: its share of the
//! traffic answers 500, as the Gateway API specifies.

mod convert;
mod index;

use serde::Serialize;

use super::mapping::ObjectKey;
use crate::mesh::route::RouteRule;

pub use convert::{grant_entry, grpc_route_entry, http_route_entry};
pub use index::RouteIndex;

/// The API group of every Gateway API kind.
pub const GATEWAY_GROUP: &str = "gateway.networking.k8s.io";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum RouteKind {
    #[serde(rename = "HTTPRoute")]
    Http,
    #[serde(rename = "GRPCRoute")]
    Grpc,
}

impl RouteKind {
    pub fn as_str(self) -> &'static str {
        match self {
            RouteKind::Http => "HTTPRoute",
            RouteKind::Grpc => "GRPCRoute",
        }
    }
}

/// A route object's identity: its kind and namespace/name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RouteKey {
    pub kind: RouteKind,
    pub key: ObjectKey,
}

impl std::fmt::Display for RouteKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.kind.as_str(), self.key)
    }
}

/// A parentRef that names a Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParentRef {
    pub service: ObjectKey,
    pub port: Option<u16>,
}

/// A backendRef: a Service and port, or why it cannot be one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendRef {
    pub service: Result<ObjectKey, String>,
    pub port: Option<u16>,
    pub weight: u32,
}

/// A rule in the mesh model's terms, but for its backends, which are still references.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleEntry {
    /// Complete but for `backends`, which resolution fills in.
    pub rule: RouteRule,
    pub backends: Vec<BackendRef>,
}

/// What the index keeps of a route object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteEntry {
    pub parents: Vec<ParentRef>,
    /// The rules, or why the route cannot be used at all.
    pub rules: Result<Vec<RuleEntry>, String>,
}

/// What the index keeps of a ReferenceGrant: who may refer (group, kind, namespace) to what
/// in the grant's namespace (group, kind, name or every name).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrantEntry {
    pub from: Vec<(String, String, String)>,
    pub to: Vec<(String, String, Option<String>)>,
}
