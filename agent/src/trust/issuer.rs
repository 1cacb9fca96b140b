//! The issuer of workload certificates: a CA certificate with its chain, its key, and the
//! trust bundle, as a Secret of type `kubernetes.io/tls` holds them (`tls.crt` with the chain,
//! `tls.key`, `ca.crt` with one root or several): what a cert-manager `Certificate` with
//! `isCA: true` writes, so cert-manager can issue and rotate it.
//!
//! An issuer is checked whole before it is used: `tls.crt`'s first certificate is a CA whose
//! public key is `tls.key`'s, each certificate of the chain is signed by the next, the last by
//! a root of the bundle, and all are valid now. A leaf ([`Issuer::issue`]) is a fresh P-256 key
//! and a certificate naming one SPIFFE ID (a URI SAN and nothing else), for client and server
//! authentication, backdated for clocks behind the agent's and never outliving its issuer, as
//! Istio's and Linkerd's CAs do. Keys are PKCS#8 (cert-manager: `privateKey.encoding: PKCS8`).

use std::time::Duration;

use rcgen::{
    CertificateParams, DistinguishedName, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
    PublicKeyData, SanType,
};
use time::OffsetDateTime;
use x509_parser::certificate::X509Certificate;
use x509_parser::prelude::FromDer;

use super::spiffe::SpiffeId;

/// Why an issuer could not be used, or a leaf not issued.
#[derive(Debug, thiserror::Error)]
pub enum IssuerError {
    #[error("{what} holds no PEM certificate")]
    NoCertificate { what: &'static str },
    #[error("the Secret has no {key}")]
    Missing { key: &'static str },
    #[error("{what}: {why}")]
    Unreadable { what: &'static str, why: String },
    #[error(
        "tls.key is not a PKCS#8 P-256, P-384, Ed25519 or RSA key (cert-manager: privateKey.encoding: PKCS8)"
    )]
    Key,
    #[error("tls.key is not the key of tls.crt's first certificate")]
    KeyMismatch,
    #[error(
        "tls.crt's first certificate is not a CA (basic constraints CA:TRUE, may sign certificates)"
    )]
    NotCa,
    #[error("certificate {index} of tls.crt is not signed by the {by}")]
    Chain { index: usize, by: &'static str },
    #[error("{what} is not valid now (from {not_before} to {not_after}, Unix time)")]
    NotValid {
        what: String,
        not_before: i64,
        not_after: i64,
    },
    #[error("issuing: {0}")]
    Issue(#[from] rcgen::Error),
}

/// How leaves are made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeafPolicy {
    /// How long a leaf is valid (capped at the issuer's own end).
    pub lifetime: Duration,
    /// How far before now it starts, for clocks behind the agent's.
    pub backdate: Duration,
}

impl Default for LeafPolicy {
    /// A day, as Istio's, Linkerd's and OSM's workload certificates; five minutes back.
    fn default() -> Self {
        LeafPolicy {
            lifetime: Duration::from_secs(24 * 3600),
            backdate: Duration::from_secs(300),
        }
    }
}

/// A leaf: its certificate and the chain up to (not including) the root, its key, and when it
/// ends. Its `Debug` leaves the key out, so no log or panic message can carry it.
#[derive(Clone)]
pub struct Leaf {
    /// PEM: the leaf, then the issuer's chain.
    pub chain_pem: String,
    /// PEM, PKCS#8.
    pub key_pem: String,
    /// Unix seconds.
    pub not_after: i64,
    /// Hex, as openssl prints it.
    pub serial: String,
}

impl std::fmt::Debug for Leaf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leaf")
            .field("serial", &self.serial)
            .field("not_after", &self.not_after)
            .field("key_pem", &"[redacted]")
            .finish_non_exhaustive()
    }
}

/// A checked issuer.
pub struct Issuer {
    /// DER: the issuer's certificate, then what it chains through.
    chain: Vec<Vec<u8>>,
    /// The same, PEM, for leaves' chains.
    chain_pem: String,
    key: KeyPair,
    /// DER of each root of the trust bundle.
    roots: Vec<Vec<u8>>,
    bundle_pem: String,
    not_before: i64,
    not_after: i64,
    subject: String,
}

impl std::fmt::Debug for Issuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Issuer")
            .field("subject", &self.subject)
            .field("not_after", &self.not_after)
            .field("roots", &self.roots.len())
            .finish_non_exhaustive()
    }
}

pub(super) fn unreadable(what: &'static str, why: impl std::fmt::Display) -> IssuerError {
    IssuerError::Unreadable {
        what,
        why: why.to_string(),
    }
}

/// The DER certificates of a PEM text.
pub(super) fn ders(pem: &[u8], what: &'static str) -> Result<Vec<Vec<u8>>, IssuerError> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    let certs = CertificateDer::pem_slice_iter(pem)
        .map(|c| c.map(|c| c.to_vec()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| unreadable(what, e))?;
    if certs.is_empty() {
        return Err(IssuerError::NoCertificate { what });
    }
    Ok(certs)
}

pub(super) fn parse<'a>(
    der: &'a [u8],
    what: &'static str,
) -> Result<X509Certificate<'a>, IssuerError> {
    X509Certificate::from_der(der)
        .map(|(_, cert)| cert)
        .map_err(|e| unreadable(what, e))
}

/// Where `chain` (its first certificate first) does not hold together: the index of the first
/// certificate not signed by the next one, or, for the last, by a root of `roots`. `None`
/// when it reaches the roots.
pub(super) fn chain_break(
    chain: &[X509Certificate<'_>],
    roots: &[X509Certificate<'_>],
) -> Option<usize> {
    let signed = |cert: &X509Certificate<'_>, by: &X509Certificate<'_>| {
        cert.verify_signature(Some(by.public_key())).is_ok()
    };
    if let Some(index) = chain
        .windows(2)
        .position(|pair| !signed(&pair[0], &pair[1]))
    {
        return Some(index);
    }
    let last = chain.len().checked_sub(1)?;
    (!roots.iter().any(|root| signed(&chain[last], root))).then_some(last)
}

/// A certificate's serial in hex, as openssl prints it.
pub(super) fn serial_hex(cert: &X509Certificate<'_>) -> String {
    cert.raw_serial()
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect()
}

fn valid_at(cert: &X509Certificate<'_>, what: String, now: i64) -> Result<(), IssuerError> {
    let (not_before, not_after) = (
        cert.validity().not_before.timestamp(),
        cert.validity().not_after.timestamp(),
    );
    if now < not_before || now > not_after {
        return Err(IssuerError::NotValid {
            what,
            not_before,
            not_after,
        });
    }
    Ok(())
}

impl Issuer {
    /// The issuer of a Secret's `tls.crt`, `tls.key` and `ca.crt`, checked at `now`.
    pub fn from_secret(
        tls_crt: &[u8],
        tls_key: &[u8],
        ca_crt: &[u8],
        now: OffsetDateTime,
    ) -> Result<Issuer, IssuerError> {
        let now = now.unix_timestamp();
        let chain = ders(tls_crt, "tls.crt")?;
        let roots = ders(ca_crt, "ca.crt")?;
        let key_pem = std::str::from_utf8(tls_key).map_err(|e| unreadable("tls.key", e))?;
        let key = KeyPair::from_pem(key_pem).map_err(|_| IssuerError::Key)?;

        let parsed = chain
            .iter()
            .map(|der| parse(der, "tls.crt"))
            .collect::<Result<Vec<_>, _>>()?;
        let issuer = &parsed[0];
        if issuer.public_key().raw != key.subject_public_key_info().as_slice() {
            return Err(IssuerError::KeyMismatch);
        }
        let signs = issuer
            .key_usage()
            .ok()
            .flatten()
            .is_none_or(|usage| usage.value.key_cert_sign());
        if !issuer.is_ca() || !signs {
            return Err(IssuerError::NotCa);
        }
        for (index, cert) in parsed.iter().enumerate() {
            valid_at(cert, format!("certificate {index} of tls.crt"), now)?;
        }
        let parsed_roots = roots
            .iter()
            .map(|der| parse(der, "ca.crt"))
            .collect::<Result<Vec<_>, _>>()?;
        for (index, root) in parsed_roots.iter().enumerate() {
            valid_at(root, format!("root {index} of ca.crt"), now)?;
        }
        if let Some(index) = chain_break(&parsed, &parsed_roots) {
            let by = if index + 1 < parsed.len() {
                "next one"
            } else {
                "bundle's roots (ca.crt)"
            };
            return Err(IssuerError::Chain { index, by });
        }
        let (not_before, not_after) = (
            issuer.validity().not_before.timestamp(),
            issuer.validity().not_after.timestamp(),
        );
        let subject = issuer.subject().to_string();
        // The texts as given: each holds only certificates (they all parsed as such above).
        let text = |bytes: &[u8], what| {
            let text = std::str::from_utf8(bytes).map_err(|e| unreadable(what, e))?;
            Ok::<_, IssuerError>(format!("{}\n", text.trim_end()))
        };
        let chain_pem = text(tls_crt, "tls.crt")?;
        let bundle_pem = text(ca_crt, "ca.crt")?;
        drop(parsed);
        drop(parsed_roots);
        Ok(Issuer {
            chain,
            chain_pem,
            key,
            roots,
            bundle_pem,
            not_before,
            not_after,
            subject,
        })
    }

    /// A leaf for `id`, issued at `now`.
    pub fn issue(
        &self,
        id: &SpiffeId,
        policy: LeafPolicy,
        now: OffsetDateTime,
    ) -> Result<Leaf, IssuerError> {
        let issuer_start = OffsetDateTime::from_unix_timestamp(self.not_before).unwrap_or(now);
        let issuer_end = OffsetDateTime::from_unix_timestamp(self.not_after).unwrap_or(now);
        if now >= issuer_end {
            return Err(IssuerError::NotValid {
                what: "the issuer".to_string(),
                not_before: self.not_before,
                not_after: self.not_after,
            });
        }
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.subject_alt_names = vec![SanType::URI(id.to_string().try_into()?)];
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        params.not_before = (now - policy.backdate).max(issuer_start);
        params.not_after = (now + policy.lifetime).min(issuer_end);
        let key = KeyPair::generate()?;
        let issuer = rcgen::Issuer::from_ca_cert_der(&self.chain[0].as_slice().into(), &self.key)?;
        let cert = params.signed_by(&key, &issuer)?;
        let serial = serial_hex(&parse(cert.der(), "the leaf")?);
        Ok(Leaf {
            chain_pem: format!("{}{}", cert.pem(), self.chain_pem),
            key_pem: key.serialize_pem(),
            not_after: params.not_after.unix_timestamp(),
            serial,
        })
    }

    /// Whether `other` is the same material: chain, key and bundle. A Secret read again (a
    /// relist, an edit of its labels) makes a new `Issuer` of the same material, which must
    /// not re-issue every leaf of the node.
    pub fn same_as(&self, other: &Issuer) -> bool {
        self.chain == other.chain
            && self.roots == other.roots
            && self.key.serialize_der() == other.key.serialize_der()
    }

    /// The trust bundle, PEM.
    pub fn bundle_pem(&self) -> &str {
        &self.bundle_pem
    }

    /// The issuer's subject, for `/debug`.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// When the issuer ends (Unix seconds): no leaf outlives it.
    pub fn not_after(&self) -> i64 {
        self.not_after
    }

    /// Each root's subject and end (Unix seconds).
    pub fn roots(&self) -> Vec<(String, i64)> {
        self.roots
            .iter()
            .filter_map(|der| parse(der, "ca.crt").ok())
            .map(|root| {
                (
                    root.subject().to_string(),
                    root.validity().not_after.timestamp(),
                )
            })
            .collect()
    }
}

/// A self-signed root of ten years that is its own issuer, as of `now`: for the tests of what
/// issues with one.
#[cfg(test)]
pub(super) fn test_root(name: &str, now: OffsetDateTime) -> Issuer {
    let mut params = CertificateParams::default();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    params.is_ca = IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign];
    params.not_before = now - Duration::from_secs(86_400);
    params.not_after = now + Duration::from_secs(10 * 365 * 86_400);
    let key = KeyPair::generate().unwrap();
    let pem = params.self_signed(&key).unwrap().pem();
    Issuer::from_secret(
        pem.as_bytes(),
        key.serialize_pem().as_bytes(),
        pem.as_bytes(),
        now,
    )
    .unwrap()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rcgen::{BasicConstraints, DnType};
    use rustls::pki_types::{CertificateDer, UnixTime};
    use rustls::server::WebPkiClientVerifier;

    use super::*;

    const DAY: Duration = Duration::from_secs(24 * 3600);

    /// A CA: its params (to sign with), key and PEM.
    struct Ca {
        params: CertificateParams,
        key: KeyPair,
        pem: String,
    }

    fn ca(name: &str, lifetime: Duration, signer: Option<&Ca>) -> Ca {
        let now = OffsetDateTime::now_utc();
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(match signer {
            None => BasicConstraints::Unconstrained,
            Some(_) => BasicConstraints::Constrained(0),
        });
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params.not_before = now - DAY;
        params.not_after = now + lifetime;
        let key = KeyPair::generate().unwrap();
        let cert = match signer {
            None => params.self_signed(&key).unwrap(),
            Some(signer) => {
                let issuer = rcgen::Issuer::from_params(&signer.params, &signer.key);
                params.signed_by(&key, &issuer).unwrap()
            }
        };
        Ca {
            params,
            key,
            pem: cert.pem(),
        }
    }

    /// A root, an intermediate it signed (valid for `lifetime`), and the issuer they make.
    fn issuer(lifetime: Duration) -> (Ca, Ca, Issuer) {
        let root = ca("root", 3650 * DAY, None);
        let intermediate = ca("lattice intermediate", lifetime, Some(&root));
        let issuer = Issuer::from_secret(
            intermediate.pem.as_bytes(),
            intermediate.key.serialize_pem().as_bytes(),
            root.pem.as_bytes(),
            OffsetDateTime::now_utc(),
        )
        .unwrap();
        (root, intermediate, issuer)
    }

    fn der_chain(pem: &str) -> Vec<CertificateDer<'static>> {
        use rustls::pki_types::pem::PemObject;
        CertificateDer::pem_slice_iter(pem.as_bytes())
            .collect::<Result<_, _>>()
            .unwrap()
    }

    /// What a peer trusting `bundle` makes of `chain` as a client certificate (webpki's path
    /// building, as rustls and so Envoy's BoringSSL-based peers check it).
    fn verified_by(bundle: &str, chain: &str) -> Result<(), rustls::Error> {
        let mut roots = rustls::RootCertStore::empty();
        for root in der_chain(bundle) {
            roots.add(root).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .unwrap();
        let chain = der_chain(chain);
        verifier
            .verify_client_cert(&chain[0], &chain[1..], UnixTime::now())
            .map(|_| ())
    }

    fn id() -> SpiffeId {
        SpiffeId::new("cluster.local", "shop", "web").unwrap()
    }

    #[test]
    fn a_leaf_names_one_identity_and_chains_to_the_bundle() {
        let (_, intermediate, issuer) = issuer(365 * DAY);
        let now = OffsetDateTime::now_utc();
        let leaf = issuer.issue(&id(), LeafPolicy::default(), now).unwrap();
        verified_by(issuer.bundle_pem(), &leaf.chain_pem).unwrap();

        let ders = der_chain(&leaf.chain_pem);
        assert_eq!(ders.len(), 2, "the leaf and the intermediate, not the root");
        let (_, cert) = X509Certificate::from_der(&ders[0]).unwrap();
        let san = cert.subject_alternative_name().unwrap().unwrap();
        let names: Vec<String> = san
            .value
            .general_names
            .iter()
            .map(|n| n.to_string())
            .collect();
        assert_eq!(names, ["URI(spiffe://cluster.local/ns/shop/sa/web)"]);
        assert!(!cert.is_ca());
        let (start, end) = (
            cert.validity().not_before.timestamp(),
            cert.validity().not_after.timestamp(),
        );
        let now = now.unix_timestamp();
        assert_eq!(end - now, 24 * 3600, "a day");
        assert_eq!(now - start, 300, "backdated five minutes");
        // Never before the issuer's own start.
        let young = ca("young", 365 * DAY, None);
        let young_issuer = Issuer::from_secret(
            young.pem.as_bytes(),
            young.key.serialize_pem().as_bytes(),
            young.pem.as_bytes(),
            OffsetDateTime::now_utc() + DAY,
        )
        .unwrap();
        let early = young_issuer
            .issue(
                &id(),
                LeafPolicy::default(),
                OffsetDateTime::now_utc() - DAY + Duration::from_secs(60),
            )
            .unwrap();
        let early_der = der_chain(&early.chain_pem);
        let (_, early_cert) = X509Certificate::from_der(&early_der[0]).unwrap();
        assert_eq!(
            early_cert.validity().not_before.timestamp(),
            young_issuer.not_before,
            "clamped to the issuer's start"
        );
        assert_eq!(leaf.not_after, end);
        let intermediate_der = der_chain(&intermediate.pem);
        let (_, intermediate_cert) = X509Certificate::from_der(&intermediate_der[0]).unwrap();
        assert!(
            cert.verify_signature(Some(intermediate_cert.public_key()))
                .is_ok()
        );
        let key = KeyPair::from_pem(&leaf.key_pem).unwrap();
        assert_eq!(cert.public_key().raw, key.subject_public_key_info());
        // Each leaf its own key and serial.
        let other = issuer
            .issue(&id(), LeafPolicy::default(), OffsetDateTime::now_utc())
            .unwrap();
        assert_ne!(other.serial, leaf.serial);
        assert_ne!(other.key_pem, leaf.key_pem);
    }

    #[test]
    fn no_leaf_outlives_its_issuer_and_none_comes_from_an_issuer_past_its_end() {
        let (_, _, issuer) = issuer(3600 * Duration::from_secs(1) * 2);
        let now = OffsetDateTime::now_utc();
        let leaf = issuer.issue(&id(), LeafPolicy::default(), now).unwrap();
        assert_eq!(
            leaf.not_after,
            issuer.not_after(),
            "capped at the issuer's end"
        );
        let later = now + 3 * 3600 * Duration::from_secs(1);
        assert!(matches!(
            issuer.issue(&id(), LeafPolicy::default(), later),
            Err(IssuerError::NotValid { .. })
        ));
    }

    #[test]
    fn a_bundle_of_several_roots_trusts_leaves_of_each() {
        let old_root = ca("old root", 3650 * DAY, None);
        let new_root = ca("new root", 3650 * DAY, None);
        let intermediate = ca("intermediate", 365 * DAY, Some(&new_root));
        let bundle = format!("{}{}", old_root.pem, new_root.pem);
        let issuer = Issuer::from_secret(
            intermediate.pem.as_bytes(),
            intermediate.key.serialize_pem().as_bytes(),
            bundle.as_bytes(),
            OffsetDateTime::now_utc(),
        )
        .unwrap();
        assert_eq!(issuer.roots().len(), 2);
        let leaf = issuer
            .issue(&id(), LeafPolicy::default(), OffsetDateTime::now_utc())
            .unwrap();
        verified_by(issuer.bundle_pem(), &leaf.chain_pem).unwrap();
        assert!(
            verified_by(&old_root.pem, &leaf.chain_pem).is_err(),
            "not by the old root alone"
        );
    }

    #[test]
    fn an_issuer_that_does_not_hold_together_is_refused() {
        let root = ca("root", 3650 * DAY, None);
        let intermediate = ca("intermediate", 365 * DAY, Some(&root));
        let stranger = ca("stranger", 3650 * DAY, None);
        let now = OffsetDateTime::now_utc();
        let key = intermediate.key.serialize_pem();
        let try_with = |crt: &str, key: &str, bundle: &str, now| {
            Issuer::from_secret(crt.as_bytes(), key.as_bytes(), bundle.as_bytes(), now)
        };
        assert!(matches!(
            try_with(
                &intermediate.pem,
                &stranger.key.serialize_pem(),
                &root.pem,
                now
            ),
            Err(IssuerError::KeyMismatch)
        ));
        assert!(matches!(
            try_with(&intermediate.pem, &key, &stranger.pem, now),
            Err(IssuerError::Chain { .. })
        ));
        assert!(matches!(
            try_with("", &key, &root.pem, now),
            Err(IssuerError::NoCertificate { what: "tls.crt" })
        ));
        assert!(matches!(
            try_with(&intermediate.pem, "not a key", &root.pem, now),
            Err(IssuerError::Key)
        ));
        let later = now + 400 * DAY;
        assert!(matches!(
            try_with(&intermediate.pem, &key, &root.pem, later),
            Err(IssuerError::NotValid { .. })
        ));
        // A leaf cannot be an issuer.
        let (_, _, issuer) = issuer(365 * DAY);
        let leaf = issuer.issue(&id(), LeafPolicy::default(), now).unwrap();
        assert!(matches!(
            try_with(&leaf.chain_pem, &leaf.key_pem, issuer.bundle_pem(), now),
            Err(IssuerError::NotCa)
        ));
    }

    /// The same Secret read again is the same issuer; another key or another bundle is not.
    #[test]
    fn an_issuer_read_again_is_the_same_and_one_of_other_material_is_not() {
        let (root, intermediate, first) = issuer(365 * DAY);
        let read = |key: &KeyPair, bundle: &str| {
            Issuer::from_secret(
                intermediate.pem.as_bytes(),
                key.serialize_pem().as_bytes(),
                bundle.as_bytes(),
                OffsetDateTime::now_utc(),
            )
        };
        assert!(first.same_as(&read(&intermediate.key, &root.pem).unwrap()));
        let other = ca("other root", 3650 * DAY, None);
        let both = format!("{}{}", root.pem, other.pem);
        assert!(!first.same_as(&read(&intermediate.key, &both).unwrap()));
        let (_, _, another) = issuer(365 * DAY);
        assert!(!first.same_as(&another));
    }
}
