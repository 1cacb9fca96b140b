//! Who signs the node's leaves: the issuer of the CA's Secret, here ([`Issuer`]), or Istio's
//! certificate service, over the network ([`IstioCa`]). Either hands out the trust bundle
//! the proxies check their peers with.

use serde_json::{Value, json};
use time::OffsetDateTime;

use super::issuer::{Issuer, Leaf, LeafPolicy, parse};
use super::istio_ca::IstioCa;
use super::leaves::LeafError;
use super::spiffe::SpiffeId;

#[derive(Debug)]
pub enum Signer {
    /// The CA's key, from its Secret: signs on the spot.
    Local(Box<Issuer>),
    /// Istio's certificate service: a round trip per leaf.
    IstioCa(IstioCa),
}

impl Signer {
    /// A leaf for `id`, at `now` (Unix seconds).
    pub async fn sign(
        &self,
        id: &SpiffeId,
        policy: LeafPolicy,
        now: i64,
    ) -> Result<Leaf, LeafError> {
        match self {
            Signer::Local(issuer) => issue_at(issuer, id, policy, now),
            Signer::IstioCa(ca) => {
                let at =
                    OffsetDateTime::from_unix_timestamp(now).map_err(|_| LeafError::Clock(now))?;
                Ok(ca.sign(id, policy, at).await?)
            }
        }
    }

    /// The issuer, where signing takes no round trip: a new identity's leaf is then signed at
    /// once ([`issue_at`]), so that its proxy's first answer can carry it.
    pub fn local(&self) -> Option<&Issuer> {
        match self {
            Signer::Local(issuer) => Some(issuer),
            Signer::IstioCa(_) => None,
        }
    }

    /// The trust bundle, PEM.
    pub fn bundle_pem(&self) -> &str {
        match self {
            Signer::Local(issuer) => issuer.bundle_pem(),
            Signer::IstioCa(ca) => ca.bundle_pem(),
        }
    }

    /// When the issuer ends (Unix seconds): the Secret's, or the one that signed the service's
    /// last leaf.
    pub fn not_after(&self) -> Option<i64> {
        match self {
            Signer::Local(issuer) => Some(issuer.not_after()),
            Signer::IstioCa(ca) => ca.issuer_end(),
        }
    }

    /// Each root's subject and end (Unix seconds).
    pub fn roots(&self) -> Vec<(String, i64)> {
        match self {
            Signer::Local(issuer) => issuer.roots(),
            Signer::IstioCa(ca) => ca
                .roots()
                .iter()
                .filter_map(|der| parse(der, "a root").ok())
                .map(|root| {
                    (
                        root.subject().to_string(),
                        root.validity().not_after.timestamp(),
                    )
                })
                .collect(),
        }
    }

    /// Whether `other` signs with the same material: the same CA read again must not issue
    /// every leaf of the node again.
    pub fn same_as(&self, other: &Signer) -> bool {
        match (self, other) {
            (Signer::Local(a), Signer::Local(b)) => a.same_as(b),
            (Signer::IstioCa(a), Signer::IstioCa(b)) => a.same_roots(b) && a.addr() == b.addr(),
            _ => false,
        }
    }

    /// `/debug/identity`'s issuer.
    pub fn debug(&self) -> Value {
        let roots: Vec<Value> = self
            .roots()
            .into_iter()
            .map(|(subject, not_after)| json!({"subject": subject, "not_after": not_after}))
            .collect();
        match self {
            Signer::Local(issuer) => json!({
                "backend": "secret",
                "subject": issuer.subject(),
                "not_after": issuer.not_after(),
                "roots": roots,
            }),
            Signer::IstioCa(ca) => json!({
                "backend": "istio-ca",
                "addr": ca.addr().to_string(),
                "roots": roots,
            }),
        }
    }
}

/// A leaf for `id` from `issuer`, at `now` (Unix seconds).
pub(super) fn issue_at(
    issuer: &Issuer,
    id: &SpiffeId,
    policy: LeafPolicy,
    now: i64,
) -> Result<Leaf, LeafError> {
    let at = OffsetDateTime::from_unix_timestamp(now).map_err(|_| LeafError::Clock(now))?;
    Ok(issuer.issue(id, policy, at)?)
}
