//! Workload identity: who a proxy is, and the certificates that say so. A workload's identity
//! is its service account as a SPIFFE ID ([`SpiffeId`]); an [`Issuer`] (an intermediate CA and
//! the trust bundle, as a `kubernetes.io/tls` Secret holds them) signs short-lived leaves for
//! those identities, one per identity of the node ([`Leaves`]). No proxy is served a leaf
//! yet: the leaves and the bundle are what SDS is to hand a verified proxy.
//!
//! Beside the data flow, as the `identity` module is: it depends on no stage.

mod authority;
mod issuer;
mod leaves;
mod spiffe;

pub use authority::{Authority, AuthorityState, SecretRef, TrustMetrics};
pub use issuer::{Issuer, IssuerError, Leaf, LeafPolicy};
pub use leaves::{LeafError, Leaves};
pub use spiffe::{SpiffeError, SpiffeId, check_trust_domain};
