//! Authorization: which callers may reach a service's endpoints, through the inbound listener
//! of each endpoint's proxy (`translate::envoy::authorization`).
//!
//! A service's rules are read together: a call that a `deny` rule matches is refused; else, if
//! the service has any `allow` rule, a call that none matches is refused (plaintext included,
//! since it has no identity to match); a service with no rules lets every call through. The
//! sources check what they read (`source::authorization`); these are the checked values.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// What a rule does with the calls it matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    Allow,
    Deny,
}

/// A caller a rule names, by the SPIFFE ID its certificate presents over mesh mTLS.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Caller {
    /// One SPIFFE ID, exactly (of any trust domain).
    Identity(Arc<str>),
    /// A service account of the agent's trust domain.
    ServiceAccount { namespace: Arc<str>, name: Arc<str> },
    /// Every service account of a namespace of the agent's trust domain.
    Namespace(Arc<str>),
}

/// A request path a rule names (HTTP ports only).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum PathMatch {
    /// `/health`: this path only.
    Exact(Arc<str>),
    /// `/api/*`: every path that starts with `/api/`.
    Prefix(Arc<str>),
}

/// One rule of a service's authorization.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct AuthorizationRule {
    pub action: Action,
    /// The callers it matches, sorted; empty: every caller, plaintext included.
    pub from: Vec<Caller>,
    /// The service ports it covers (the ports clients dial), sorted; empty: every port.
    pub ports: Vec<u16>,
    /// The request paths it matches, sorted; empty: every path.
    pub paths: Vec<PathMatch>,
    /// The request methods it matches (upper case), sorted; empty: every method.
    pub methods: Vec<Arc<str>>,
}

impl AuthorizationRule {
    /// Whether it looks into requests: then it needs an HTTP port to be read as written (see
    /// `translate::envoy::authorization` for what it does on a TCP port).
    pub fn is_http(&self) -> bool {
        !self.paths.is_empty() || !self.methods.is_empty()
    }

    /// Whether it covers the service port `port`.
    pub fn covers(&self, port: u16) -> bool {
        self.ports.is_empty() || self.ports.binary_search(&port).is_ok()
    }
}

/// A service's rules in a canonical order, so equal sets compare equal whatever the sources'
/// order.
pub fn canonical(mut rules: Vec<AuthorizationRule>) -> Vec<AuthorizationRule> {
    rules.sort();
    rules.dedup();
    rules
}
