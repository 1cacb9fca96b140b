//! SPIFFE IDs of workloads: `spiffe://<trust domain>/ns/<namespace>/sa/<service account>`, the
//! form Istio, Linkerd's SPIFFE mode and cert-manager's istio-csr use, so a peer that checks
//! one of theirs reads ours. The parts are checked as Kubernetes names (a namespace and a
//! service account are DNS labels or subdomains) and the trust domain as SPIFFE says (lower
//! case letters, digits, `.`, `-`, `_`), so a URI never needs escaping.

use std::fmt;

/// Why a SPIFFE ID was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SpiffeError {
    #[error("trust domain {0:?} is not lower-case letters, digits, '.', '-' or '_' (1 to 255)")]
    TrustDomain(String),
    #[error("{what} {name:?} is not a Kubernetes name")]
    Name { what: &'static str, name: String },
    #[error("{0:?} is not spiffe://<trust domain>/ns/<namespace>/sa/<service account>")]
    Form(String),
}

/// A workload's identity.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SpiffeId {
    trust_domain: String,
    namespace: String,
    service_account: String,
}

impl SpiffeId {
    pub fn new(
        trust_domain: &str,
        namespace: &str,
        service_account: &str,
    ) -> Result<SpiffeId, SpiffeError> {
        check_trust_domain(trust_domain)?;
        for (what, name, max) in [
            ("namespace", namespace, 63),
            ("service account", service_account, 253),
        ] {
            if !is_dns_name(name, max) {
                return Err(SpiffeError::Name {
                    what,
                    name: shown(name),
                });
            }
        }
        Ok(SpiffeId {
            trust_domain: trust_domain.to_string(),
            namespace: namespace.to_string(),
            service_account: service_account.to_string(),
        })
    }

    /// Reads `spiffe://<td>/ns/<ns>/sa/<sa>`.
    pub fn parse(uri: &str) -> Result<SpiffeId, SpiffeError> {
        let form = || SpiffeError::Form(shown(uri));
        let rest = uri.strip_prefix("spiffe://").ok_or_else(form)?;
        let mut parts = rest.split('/');
        match (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) {
            (Some(td), Some("ns"), Some(ns), Some("sa"), Some(sa), None) => {
                SpiffeId::new(td, ns, sa)
            }
            _ => Err(form()),
        }
    }

    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    pub fn service_account(&self) -> &str {
        &self.service_account
    }
}

impl fmt::Display for SpiffeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "spiffe://{}/ns/{}/sa/{}",
            self.trust_domain, self.namespace, self.service_account
        )
    }
}

/// Whether `trust_domain` is one: lower-case letters, digits, `.`, `-`, `_`, 1 to 255 of them.
pub fn check_trust_domain(trust_domain: &str) -> Result<(), SpiffeError> {
    let ok = !trust_domain.is_empty()
        && trust_domain.len() <= 255
        && trust_domain
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(SpiffeError::TrustDomain(shown(trust_domain)))
    }
}

/// A DNS-1123 subdomain of at most `max` bytes (a label when `max` is 63): what Kubernetes
/// allows as a namespace or service account name.
fn is_dns_name(name: &str, max: usize) -> bool {
    !name.is_empty()
        && name.len() <= max
        && name.split('.').all(|label| {
            let bytes = label.as_bytes();
            !bytes.is_empty()
                && bytes.len() <= 63
                && bytes
                    .iter()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
                && bytes[0] != b'-'
                && bytes[bytes.len() - 1] != b'-'
        })
        && (max > 63 || !name.contains('.'))
}

/// At most 64 characters of `text`, for a message.
fn shown(text: &str) -> String {
    match text.char_indices().nth(64) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_print_and_read_back() {
        let id = SpiffeId::new("cluster.local", "shop", "web").unwrap();
        assert_eq!(id.to_string(), "spiffe://cluster.local/ns/shop/sa/web");
        assert_eq!(SpiffeId::parse(&id.to_string()), Ok(id));
        let dotted = SpiffeId::new("mesh.example", "data", "db.reader").unwrap();
        assert_eq!(SpiffeId::parse(&dotted.to_string()), Ok(dotted));
    }

    #[test]
    fn what_no_kubernetes_name_or_trust_domain_can_be_is_refused() {
        for (td, ns, sa) in [
            ("", "ns", "sa"),
            ("Cluster.Local", "ns", "sa"),
            ("cluster.local/evil", "ns", "sa"),
            ("cluster.local", "", "sa"),
            ("cluster.local", "a.b", "sa"),
            ("cluster.local", "-ns", "sa"),
            ("cluster.local", "ns", "SA"),
            ("cluster.local", "ns", "sa/../x"),
            ("cluster.local", &"n".repeat(64), "sa"),
        ] {
            assert!(SpiffeId::new(td, ns, sa).is_err(), "{td} {ns} {sa}");
        }
        for uri in [
            "https://cluster.local/ns/a/sa/b",
            "spiffe://cluster.local/ns/a",
            "spiffe://cluster.local/ns/a/sa/b/c",
            "spiffe://cluster.local/sa/b/ns/a",
        ] {
            assert!(SpiffeId::parse(uri).is_err(), "{uri}");
        }
        let long = "x".repeat(10_000);
        let message = SpiffeId::new(&long, "a", "b").unwrap_err().to_string();
        assert!(message.len() < 200, "{message}");
    }
}
