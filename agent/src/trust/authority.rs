//! The issuer in use, followed live from its Secret (`--ca-secret`, by
//! `source::kube::ca`): what `/debug/identity` shows and the metrics count.
//!
//! A Secret that does not hold together (a key that is not the CA's, a chain that does not
//! reach the bundle, an expired CA) is refused with the reason, and the issuer read before
//! stays in use: a bad edit of the Secret must not stop certificates. A deleted Secret takes
//! the issuer away (leaves already issued keep their lifetime): deleting it is how an operator
//! stops issuance.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use time::OffsetDateTime;
use tokio::sync::watch;

use super::issuer::{Issuer, IssuerError};
use super::istio_ca::{IstioCa, IstioCaConfig, IstioCaError, read_bounded};
use super::signer::Signer;
use tokio_util::sync::CancellationToken;

/// Where the issuer's Secret is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SecretRef {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for SecretRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RootLabel {
    root: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ReasonLabel {
    pub(super) reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct IdentityLabel {
    pub(super) identity: String,
}

/// `lattice_identity_*`.
#[derive(Clone, Debug, Default)]
pub struct TrustMetrics {
    pub(super) issuer_expiry: Gauge,
    root_expiry: Family<RootLabel, Gauge>,
    refusals: Family<ReasonLabel, Counter>,
    pub(super) leaf_expiry: Family<IdentityLabel, Gauge>,
    pub(super) leaf_failures: Family<ReasonLabel, Counter>,
    mesh_mtls: Gauge,
}

impl TrustMetrics {
    /// Whether services of meshed pods are called over mutual TLS.
    pub fn set_mesh_mtls(&self, on: bool) {
        self.mesh_mtls.set(i64::from(on));
    }

    pub fn register(registry: &mut Registry) -> TrustMetrics {
        let metrics = TrustMetrics::default();
        let identity = registry.sub_registry_with_prefix("lattice_identity");
        identity.register(
            "issuer_expiry_timestamp_seconds",
            "When the issuer of workload certificates expires (Unix time); 0 with no issuer",
            metrics.issuer_expiry.clone(),
        );
        identity.register(
            "root_expiry_timestamp_seconds",
            "When each root of the trust bundle expires (Unix time), by subject",
            metrics.root_expiry.clone(),
        );
        identity.register(
            "issuer_refusals",
            "Versions of the issuer's Secret refused, by reason (the issuer before stays in use)",
            metrics.refusals.clone(),
        );
        identity.register(
            "leaf_expiry_timestamp_seconds",
            "When the leaf of each identity of this node's proxies expires (Unix time)",
            metrics.leaf_expiry.clone(),
        );
        identity.register(
            "leaf_failures",
            "Leaves that could not be issued or renewed, by reason (a leaf held stays in use)",
            metrics.leaf_failures.clone(),
        );
        identity.register(
            "mesh_mtls",
            "1 while services of meshed pods are called over mutual TLS (a CA is in use), else 0",
            metrics.mesh_mtls.clone(),
        );
        metrics
    }
}

/// What is known of the issuer.
#[derive(Clone, Debug, Default)]
pub struct AuthorityState {
    pub signer: Option<Arc<Signer>>,
    /// Why the Secret's last version was refused, if it was.
    pub refused: Option<String>,
    /// Whether the Secret exists (as last listed or watched).
    pub present: bool,
    /// Whether the Secret has been listed at all.
    pub listed: bool,
}

impl AuthorityState {
    /// Whether proxies call the services of meshed pods over mutual TLS: when there is a CA to
    /// issue every proxy its leaf. `None` until the Secret (or the roots file) is first read.
    pub fn mesh_mtls(&self) -> Option<bool> {
        self.listed.then_some(self.signer.is_some())
    }
}

/// The issuer in use, for the rest of the agent to read.
#[derive(Debug)]
pub struct Authority {
    trust_domain: String,
    secret: Option<SecretRef>,
    tx: watch::Sender<AuthorityState>,
    metrics: TrustMetrics,
}

impl Authority {
    /// Following `secret` (none: mesh files only, no issuer).
    pub fn new(
        trust_domain: String,
        secret: Option<SecretRef>,
        metrics: TrustMetrics,
    ) -> Authority {
        Authority {
            trust_domain,
            secret,
            tx: watch::channel(AuthorityState::default()).0,
            metrics,
        }
    }

    pub fn secret(&self) -> Option<&SecretRef> {
        self.secret.as_ref()
    }

    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    pub fn subscribe(&self) -> watch::Receiver<AuthorityState> {
        self.tx.subscribe()
    }

    /// A version of the Secret: its `tls.crt`, `tls.key` and `ca.crt`.
    pub fn seen(&self, tls_crt: &[u8], tls_key: &[u8], ca_crt: &[u8]) {
        match Issuer::from_secret(tls_crt, tls_key, ca_crt, OffsetDateTime::now_utc()) {
            Ok(issuer) => {
                tracing::debug!(issuer = %issuer.subject(), roots = issuer.roots().len(), not_after = issuer.not_after(), "the CA's Secret read");
                self.use_signer(Signer::Local(Box::new(issuer)));
            }
            Err(error) => self.refuse(&error),
        }
        self.record();
    }

    /// Istio's certificate service, with a version of the roots file.
    pub fn istio_ca(&self, ca: IstioCa) {
        tracing::debug!(ca = %ca.addr(), roots = ca.roots().len(), "the roots file read");
        self.use_signer(Signer::IstioCa(ca));
        self.tx.send_modify(|state| state.listed = true);
        self.record();
    }

    /// A version of the roots file that cannot be used, or the file unreadable: the signer
    /// in use, if any, stays.
    pub fn refuse_roots(&self, error: &IstioCaError) {
        self.metrics
            .refusals
            .get_or_create(&ReasonLabel { reason: "roots" })
            .inc();
        tracing::warn!(%error, "the roots of Istio's certificate service are refused; those read before, if any, stay in use");
        self.tx.send_modify(|state| {
            state.refused = Some(error.to_string());
            state.listed = true;
        });
    }

    fn use_signer(&self, signer: Signer) {
        let same = self
            .tx
            .borrow()
            .signer
            .as_ref()
            .is_some_and(|held| held.same_as(&signer));
        if !same {
            tracing::info!(signer = %signer.debug(), "workload certificates are issued by this CA");
        }
        // The same CA read again keeps the signer in use (its `Arc`), so nothing that follows
        // it sees a new one.
        self.tx.send_if_modified(|state| {
            let changed = !same || state.refused.is_some() || !state.present;
            if !same {
                state.signer = Some(Arc::new(signer));
            }
            state.refused = None;
            state.present = true;
            changed
        });
    }

    /// A version of the Secret that lacks a key.
    pub fn incomplete(&self, missing: &'static str) {
        let error = IssuerError::Missing { key: missing };
        self.refuse(&error);
        self.record();
    }

    fn refuse(&self, error: &IssuerError) {
        let reason = match error {
            IssuerError::NoCertificate { .. }
            | IssuerError::Unreadable { .. }
            | IssuerError::Missing { .. } => "unreadable",
            IssuerError::Key => "key",
            IssuerError::KeyMismatch => "key_mismatch",
            IssuerError::NotCa => "not_ca",
            IssuerError::Chain { .. } => "chain",
            IssuerError::NotValid { .. } => "not_valid",
            IssuerError::Issue(_) => "other",
        };
        self.metrics
            .refusals
            .get_or_create(&ReasonLabel { reason })
            .inc();
        let secret = self
            .secret
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default();
        tracing::warn!(%secret, %error, "the issuer's Secret is refused; the issuer read before stays in use");
        self.tx.send_modify(|state| {
            state.refused = Some(error.to_string());
            state.present = true;
        });
    }

    /// The Secret is gone: no issuer.
    pub fn gone(&self) {
        let was = self.tx.borrow().signer.is_some();
        if was {
            tracing::warn!(secret = %self.secret.as_ref().map(ToString::to_string).unwrap_or_default(), "the issuer's Secret was deleted: no workload certificates are issued until it is back");
        }
        self.tx.send_modify(|state| {
            state.signer = None;
            state.refused = None;
            state.present = false;
        });
        self.record();
    }

    /// The Secret cannot be read at all (the API server refuses the agent, as a missing RBAC
    /// grant does): before it was ever listed, taken as no CA, so the agent does not wait for
    /// it forever; afterwards the issuer read before stays in use.
    pub fn unreadable(&self, why: &str) {
        let first = self.tx.send_if_modified(|state| {
            if state.listed {
                return false;
            }
            state.listed = true;
            state.refused = Some(why.to_string());
            true
        });
        if first {
            tracing::warn!(secret = %self.secret.as_ref().map(ToString::to_string).unwrap_or_default(), why, "the issuer Secret cannot be read: workload certificates are off until it can be");
        }
    }

    /// The Secret was listed (whether it exists or not).
    pub fn listed(&self) {
        let first = !self.tx.borrow().listed;
        self.tx.send_modify(|state| state.listed = true);
        if first && !self.tx.borrow().present {
            tracing::info!(secret = %self.secret.as_ref().map(ToString::to_string).unwrap_or_default(), "no issuer Secret: workload certificates are off until it exists");
        }
    }

    fn record(&self) {
        let state = self.tx.borrow().clone();
        self.metrics.root_expiry.clear();
        match &state.signer {
            Some(signer) => {
                // Istio's certificate service: known from its first leaf on (set there).
                if let Some(end) = signer.not_after() {
                    self.metrics.issuer_expiry.set(end);
                }
                for (root, not_after) in signer.roots() {
                    self.metrics
                        .root_expiry
                        .get_or_create(&RootLabel { root })
                        .set(not_after);
                }
            }
            None => {
                self.metrics.issuer_expiry.set(0);
            }
        }
    }

    /// `/debug/identity`.
    pub fn debug(&self) -> Value {
        let state = self.tx.borrow().clone();
        let issuer = state.signer.as_ref().map(|signer| signer.debug());
        json!({
            "trust_domain": self.trust_domain,
            "secret": self.secret.as_ref().map(ToString::to_string),
            "listed": state.listed,
            "present": state.present,
            "mesh_mtls": state.mesh_mtls(),
            "issuer": issuer,
            "refused": state.refused,
        })
    }
}

/// How often the roots file of Istio's certificate service is read again. Kubelet refreshes a
/// mounted ConfigMap about once a minute, so a few seconds add nothing noticeable, and a read
/// needs no watch to break.
const ROOTS_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Follows the roots file: each new version makes a signer of the service with it. A version
/// that cannot be used, or a file gone, is warned about and the one before stays in use.
pub async fn follow_roots(
    config: Arc<IstioCaConfig>,
    authority: Arc<Authority>,
    shutdown: CancellationToken,
) {
    let mut last: Option<Vec<u8>> = None;
    let mut failing = false;
    loop {
        match read_bounded(&config.roots_file).await {
            Ok(bytes) if last.as_ref() != Some(&bytes) => {
                match IstioCa::new(config.clone(), &bytes) {
                    Ok(ca) => authority.istio_ca(ca),
                    Err(error) => authority.refuse_roots(&error),
                }
                last = Some(bytes);
                failing = false;
            }
            Ok(_) => failing = false,
            Err(error) => {
                if !failing {
                    authority.refuse_roots(&error);
                }
                failing = true;
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(ROOTS_EVERY) => {}
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use prometheus_client::registry::Registry;
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, KeyUsagePurpose};

    use super::*;

    fn authority() -> Authority {
        Authority::new(
            "cluster.local".into(),
            Some(SecretRef {
                namespace: "lattice-system".into(),
                name: "lattice-ca".into(),
            }),
            TrustMetrics::register(&mut Registry::default()),
        )
    }

    /// A self-signed CA's certificate and PKCS#8 key, as PEM.
    pub(in crate::trust) fn ca() -> (String, String) {
        let mut params = CertificateParams::default();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    #[test]
    fn calls_are_mutual_tls_while_there_is_a_ca_and_unknown_before_it_is_read() {
        let authority = authority();
        let state = authority.subscribe();
        let mtls = || state.borrow().mesh_mtls();
        assert_eq!(mtls(), None, "not read yet");
        authority.listed();
        assert_eq!(mtls(), Some(false), "listed, no Secret");
        let (crt, key) = ca();
        authority.seen(crt.as_bytes(), key.as_bytes(), crt.as_bytes());
        assert_eq!(mtls(), Some(true));
        authority.incomplete("tls.key");
        assert_eq!(mtls(), Some(true), "a bad version keeps the CA in use");
        authority.unreadable("403");
        assert_eq!(mtls(), Some(true), "a refused watch keeps the CA in use");
        authority.gone();
        assert_eq!(mtls(), Some(false), "deleted");
    }

    #[test]
    fn a_secret_the_agent_may_not_read_is_no_ca_rather_than_a_wait() {
        let authority = authority();
        let state = authority.subscribe();
        authority.unreadable("403");
        assert_eq!(state.borrow().mesh_mtls(), Some(false));
        assert!(state.borrow().refused.is_some());
        let (crt, key) = ca();
        authority.seen(crt.as_bytes(), key.as_bytes(), crt.as_bytes());
        assert_eq!(state.borrow().mesh_mtls(), Some(true), "readable later");
    }
}
