//! The webhook's serving certificate, issued by the injector itself: the API server calls a
//! webhook only over TLS, verified against the `caBundle` of its configuration. The injector
//! keeps a CA of its own (ten years) and a serving certificate it signs (one year, for the
//! Service's DNS names), all in one Secret of type `kubernetes.io/tls` (`tls.crt`, `tls.key`,
//! `ca.crt`, and `ca.key`), so every replica serves the same chain and the `caBundle` names one
//! CA. The serving certificate is renewed from the same CA when a third of its life is left;
//! the CA itself is replaced only when it is near its end or unreadable, and then the bundle
//! with it.
//!
//! ECDSA P-256 keys (rcgen's default with ring), which the API server's Go TLS accepts.

use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use time::OffsetDateTime;

/// How long a serving certificate is valid.
pub const SERVING_LIFETIME: Duration = Duration::from_secs(365 * 24 * 3600);
/// How long the CA is valid.
pub const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Issued a little in the past, so a node whose clock is behind still accepts it.
const BACKDATE: Duration = Duration::from_secs(3600);

/// Why a certificate could not be issued or read.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("issuing a certificate: {0}")]
    Issue(#[from] rcgen::Error),
    #[error("the Secret has no {0}")]
    Missing(&'static str),
    #[error("{what} is not a PEM certificate: {why}")]
    Unreadable { what: &'static str, why: String },
}

/// A CA, and a serving certificate it signed, as PEM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    pub ca_cert: String,
    pub ca_key: String,
    pub cert: String,
    pub key: String,
}

/// Secret keys (a `kubernetes.io/tls` Secret's two, and the CA's).
pub const TLS_CRT: &str = "tls.crt";
pub const TLS_KEY: &str = "tls.key";
pub const CA_CRT: &str = "ca.crt";
pub const CA_KEY: &str = "ca.key";

impl Chain {
    /// A new CA and a serving certificate for `dns_names`.
    pub fn issue(dns_names: &[String]) -> Result<Chain, CertError> {
        let now = OffsetDateTime::now_utc();
        let mut params = CertificateParams::default();
        params.distinguished_name = name("lattice-injector CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params.not_before = now - BACKDATE;
        params.not_after = now + CA_LIFETIME;
        let ca_key = KeyPair::generate()?;
        let ca_cert = params.self_signed(&ca_key)?;
        let issuer = Issuer::new(params, &ca_key);
        let (cert, key) = serving(dns_names, &issuer)?;
        Ok(Chain {
            ca_cert: ca_cert.pem(),
            ca_key: ca_key.serialize_pem(),
            cert,
            key,
        })
    }

    /// This chain with a new serving certificate for `dns_names`, from the same CA.
    pub fn renewed(&self, dns_names: &[String]) -> Result<Chain, CertError> {
        let ca_key = KeyPair::from_pem(&self.ca_key)?;
        let issuer = Issuer::from_ca_cert_pem(&self.ca_cert, &ca_key)?;
        let (cert, key) = serving(dns_names, &issuer)?;
        Ok(Chain {
            cert,
            key,
            ..self.clone()
        })
    }

    /// What is left to do with this chain for a webhook at `dns_names`, `now`.
    pub fn check(&self, dns_names: &[String], now: OffsetDateTime) -> Result<Health, CertError> {
        let ca_pem = pem(&self.ca_cert, CA_CRT)?;
        let ca = ca_pem.parse_x509().map_err(|e| unreadable(CA_CRT, e))?;
        if needs_renewal(&ca, now) {
            return Ok(Health::ReplaceCa);
        }
        let Ok(serving_pem) = pem(&self.cert, TLS_CRT) else {
            return Ok(Health::RenewServing);
        };
        let Ok(serving) = serving_pem.parse_x509() else {
            return Ok(Health::RenewServing);
        };
        let named = self::dns_names(&serving);
        let names_covered = dns_names.iter().all(|n| named.contains(n));
        let signed = serving.verify_signature(Some(ca.public_key())).is_ok();
        if needs_renewal(&serving, now) || !names_covered || !signed {
            return Ok(Health::RenewServing);
        }
        Ok(Health::Good)
    }
}

/// What a chain needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    Good,
    /// A new serving certificate from the same CA (the bundle stays).
    RenewServing,
    /// A new CA (and the bundle with it).
    ReplaceCa,
}

fn name(common: &str) -> DistinguishedName {
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, common);
    name
}

fn serving(
    dns_names: &[String],
    issuer: &Issuer<'_, &KeyPair>,
) -> Result<(String, String), CertError> {
    let now = OffsetDateTime::now_utc();
    let mut params = CertificateParams::new(dns_names.to_vec())?;
    params.distinguished_name = name(dns_names.first().map_or("lattice-injector", String::as_str));
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.not_before = now - BACKDATE;
    params.not_after = now + SERVING_LIFETIME;
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// When the (first) certificate of `pem` expires, in Unix seconds.
pub fn expiry(pem: &str) -> Option<i64> {
    let pem = self::pem(pem, TLS_CRT).ok()?;
    let cert = pem.parse_x509().ok()?;
    Some(cert.validity().not_after.timestamp())
}

fn unreadable(what: &'static str, why: impl std::fmt::Display) -> CertError {
    CertError::Unreadable {
        what,
        why: why.to_string(),
    }
}

fn pem(text: &str, what: &'static str) -> Result<x509_parser::pem::Pem, CertError> {
    let (_, pem) =
        x509_parser::pem::parse_x509_pem(text.as_bytes()).map_err(|e| unreadable(what, e))?;
    Ok(pem)
}

/// The DNS names of a certificate's subject alternative names.
pub(crate) fn dns_names(cert: &x509_parser::certificate::X509Certificate<'_>) -> Vec<String> {
    use x509_parser::extensions::GeneralName;
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::DNSName(name) => Some(name.to_string()),
            _ => None,
        })
        .collect()
}

/// Not yet valid, or with less than a third of its life left.
fn needs_renewal(
    cert: &x509_parser::certificate::X509Certificate<'_>,
    now: OffsetDateTime,
) -> bool {
    let (start, end) = (
        cert.validity().not_before.timestamp(),
        cert.validity().not_after.timestamp(),
    );
    let now = now.unix_timestamp();
    now < start || (end - now) * 3 < end - start
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        vec![
            "lattice-injector.lattice-system.svc".to_string(),
            "lattice-injector.lattice-system.svc.cluster.local".to_string(),
        ]
    }

    #[test]
    fn a_chain_is_good_until_a_third_of_its_life_is_left() {
        let chain = Chain::issue(&names()).unwrap();
        let now = OffsetDateTime::now_utc();
        assert_eq!(chain.check(&names(), now).unwrap(), Health::Good);
        let late = now + SERVING_LIFETIME * 7 / 10;
        assert_eq!(chain.check(&names(), late).unwrap(), Health::RenewServing);
        let very_late = now + CA_LIFETIME * 7 / 10;
        assert_eq!(chain.check(&names(), very_late).unwrap(), Health::ReplaceCa);
        let other = vec!["other.lattice-system.svc".to_string()];
        assert_eq!(chain.check(&other, now).unwrap(), Health::RenewServing);
    }

    #[test]
    fn a_renewed_chain_keeps_its_ca() {
        let chain = Chain::issue(&names()).unwrap();
        let renewed = chain.renewed(&names()).unwrap();
        assert_eq!(renewed.ca_cert, chain.ca_cert);
        assert_ne!(renewed.cert, chain.cert);
        let now = OffsetDateTime::now_utc();
        assert_eq!(renewed.check(&names(), now).unwrap(), Health::Good);
        // Signed by another CA: renewed from this one.
        let stranger = Chain::issue(&names()).unwrap();
        let mixed = Chain {
            cert: stranger.cert,
            ..chain
        };
        assert_eq!(mixed.check(&names(), now).unwrap(), Health::RenewServing);
    }

    #[test]
    fn garbage_is_unreadable() {
        let chain = Chain {
            ca_cert: "nope".to_string(),
            ..Chain::issue(&names()).unwrap()
        };
        assert!(chain.check(&names(), OffsetDateTime::now_utc()).is_err());
    }
}
