//! Workload identity: who a proxy is, and the certificates that say so. A workload's identity
//! is its service account as a SPIFFE ID ([`SpiffeId`]); a [`Signer`] signs short-lived leaves
//! for those identities, one per identity of the node ([`Leaves`]): an [`Issuer`] (an
//! intermediate CA and the trust bundle, as a `kubernetes.io/tls` Secret holds them), or
//! Istio's certificate service ([`IstioCa`]), which holds the CA's key elsewhere. [`NodeSecrets`] publishes each
//! identity's leaf and the bundle to the xDS streams verified as its proxies, which serve them
//! over SDS.
//!
//! Beside the data flow, as the `identity` module is: it depends on no stage.

mod authority;
mod issuer;
mod istio_ca;
mod leaves;
mod secrets;
mod signer;
mod spiffe;
mod switch;

pub use authority::{Authority, AuthorityState, SecretRef, TrustMetrics, follow_roots};
pub use issuer::{Issuer, IssuerError, Leaf, LeafPolicy};
pub use istio_ca::{IstioCa, IstioCaConfig, IstioCaError};
pub use leaves::{LeafError, Leaves};
pub use secrets::{NodeSecrets, ProxySecrets, SecretsRx, SecretsWatch};
pub use signer::Signer;
pub use spiffe::{SpiffeError, SpiffeId, check_trust_domain};
pub use switch::{MESH_MTLS_HOLD, switch_mesh_mtls};
