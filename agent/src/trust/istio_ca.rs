//! Workload certificates from Istio's certificate service
//! (`istio.v1.auth.IstioCertificateService/CreateCertificate`), the opt-in signer: istiod or
//! cert-manager's istio-csr holds the CA's key, and the agent asks it for each identity of its
//! node's proxies as ztunnel does, impersonating the identity (`ImpersonatedIdentity` in the
//! request's metadata) and authenticated by its own projected service-account token
//! (`authorization: Bearer`). The service checks that a pod of that identity runs on the
//! agent's node; a compromised node can then get certificates only for what runs on it.
//!
//! The key never leaves the agent: each leaf is a fresh P-256 key and a CSR naming the SPIFFE
//! ID. The answer is checked before anything is handed to a proxy: the leaf is for that key
//! and names that identity and nothing else, is valid now, and chains to the trust bundle.
//! The bundle, which also checks the service's own certificate, is a PEM file (Istio's
//! `istio-ca-root-cert` ConfigMap, mounted), read again every few seconds.
//!
//! The three messages are written here with prost's derive rather than generated: they are
//! small, and generating them would need `protoc` on every machine that builds the agent.
//! `the_messages_are_the_protos_bytes` pins them to the proto's field numbers.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use hyper_util::rt::TokioIo;
use rcgen::{CertificateParams, DistinguishedName, KeyPair, PublicKeyData, SanType};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::ClientCertVerifier;
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};
use time::OffsetDateTime;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::{Channel, Endpoint, Uri};
use x509_parser::extensions::GeneralName;

use super::issuer::{Leaf, LeafPolicy, ders, parse, serial_hex};
use super::spiffe::SpiffeId;

/// `istio.v1.auth.IstioCertificateRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct IstioCertificateRequest {
    /// PEM.
    #[prost(string, tag = "1")]
    pub csr: String,
    /// Seconds.
    #[prost(int64, tag = "3")]
    pub validity_duration: i64,
    #[prost(message, optional, tag = "4")]
    pub metadata: Option<Struct>,
}

/// `istio.v1.auth.IstioCertificateResponse`: PEM, the leaf first, the root last.
#[derive(Clone, PartialEq, prost::Message)]
pub struct IstioCertificateResponse {
    #[prost(string, repeated, tag = "1")]
    pub cert_chain: Vec<String>,
}

/// The method's path.
pub const CREATE_CERTIFICATE: &str = "/istio.v1.auth.IstioCertificateService/CreateCertificate";
/// The metadata key of the identity asked for on a pod's behalf.
pub const IMPERSONATED_IDENTITY: &str = "ImpersonatedIdentity";

/// How long one request may take, connecting included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest token or roots file read.
const MOST_FILE_BYTES: u64 = 1 << 20;
/// The largest answer taken.
const MOST_ANSWER_BYTES: usize = 1 << 20;
/// A leaf may start this far after the agent's now (the service's clock ahead of it).
const SKEW: i64 = 60;
/// The most certificates an answer may hold.
const MOST_CHAIN: usize = 8;
/// How long a request may take in all, its answer's body included (tonic's timeouts bound
/// the wait for its headers only).
const WHOLE_REQUEST: Duration = Duration::from_secs(12);
/// HTTP/2 pings on the service's connection, so one that stalls is found and replaced.
const KEEPALIVE: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the service gave no leaf.
#[derive(Debug, thiserror::Error)]
pub enum IstioCaError {
    #[error("reading {path}: {why}")]
    File { path: String, why: String },
    #[error("the roots file holds no certificate the agent can use: {0}")]
    Roots(String),
    #[error("making the request: {0}")]
    Request(String),
    #[error("the certificate service refused: {code:?}: {message}")]
    Refused { code: tonic::Code, message: String },
    #[error("the certificate service cannot be reached: {0}")]
    Unavailable(String),
    #[error("the certificate service's answer is refused: {0}")]
    Answer(String),
}

impl IstioCaError {
    /// The metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            IstioCaError::File { .. } => "token",
            IstioCaError::Roots(_) => "roots",
            IstioCaError::Request(_) => "request",
            IstioCaError::Refused { .. } => "refused",
            IstioCaError::Unavailable(_) => "unavailable",
            IstioCaError::Answer(_) => "answer",
        }
    }
}

/// Where the service is and how the agent authenticates to it.
#[derive(Clone, Debug)]
pub struct IstioCaConfig {
    /// `https://host:port`.
    pub addr: Uri,
    /// The name the service's certificate must carry: the address's host unless given.
    pub server_name: String,
    /// The agent's projected service-account token, read for every request (kubelet rotates it).
    pub token_file: PathBuf,
    /// PEM: the roots of the mesh.
    pub roots_file: PathBuf,
}

/// A status message as the service sent it, cut short: it may be large, or say anything.
fn brief(message: &str) -> String {
    const MOST: usize = 200;
    match message.char_indices().nth(MOST) {
        Some((at, _)) => format!("{}…", &message[..at]),
        None => message.to_string(),
    }
}

pub(super) async fn read_bounded(path: &PathBuf) -> Result<Vec<u8>, IstioCaError> {
    use tokio::io::AsyncReadExt;
    let error = |why: String| IstioCaError::File {
        path: path.display().to_string(),
        why,
    };
    let file = tokio::fs::File::open(path)
        .await
        .map_err(|e| error(e.to_string()))?;
    let mut bytes = Vec::new();
    file.take(MOST_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .await
        .map_err(|e| error(e.to_string()))?;
    if bytes.len() as u64 > MOST_FILE_BYTES {
        return Err(error(format!("larger than {MOST_FILE_BYTES} bytes")));
    }
    Ok(bytes)
}

/// The service, with one version of the roots.
pub struct IstioCa {
    config: Arc<IstioCaConfig>,
    channel: Channel,
    /// DER of each root.
    roots: Vec<Vec<u8>>,
    bundle_pem: String,
    /// Checks a leaf's path to the roots, as a peer does.
    verifier: Arc<dyn ClientCertVerifier>,
    /// When the certificate that signed the last leaf ends (Unix seconds; 0 before the first).
    issuer_end: AtomicI64,
}

impl std::fmt::Debug for IstioCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IstioCa")
            .field("addr", &self.config.addr)
            .field("roots", &self.roots.len())
            .finish_non_exhaustive()
    }
}

impl IstioCa {
    /// The service at `config.addr`, its certificate checked against `roots_pem`, which is
    /// also the bundle handed to the proxies. Connects on first use.
    pub fn new(config: Arc<IstioCaConfig>, roots_pem: &[u8]) -> Result<IstioCa, IstioCaError> {
        let roots =
            ders(roots_pem, "the roots file").map_err(|e| IstioCaError::Roots(e.to_string()))?;
        let mut store = rustls::RootCertStore::empty();
        for root in &roots {
            store
                .add(root.clone().into())
                .map_err(|e| IstioCaError::Roots(e.to_string()))?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let store = Arc::new(store);
        let verifier = WebPkiClientVerifier::builder_with_provider(store.clone(), provider.clone())
            .build()
            .map_err(|e| IstioCaError::Roots(e.to_string()))?;
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| IstioCaError::Roots(e.to_string()))?
            .with_root_certificates(store)
            .with_no_client_auth();
        tls.alpn_protocols = vec![b"h2".to_vec()];
        let server_name = ServerName::try_from(config.server_name.clone())
            .map_err(|e| IstioCaError::Request(format!("--istio-ca-server-name: {e}")))?;
        let connector = tokio_rustls::TlsConnector::from(Arc::new(tls));
        let dial = tower::service_fn(move |uri: Uri| {
            let (connector, server_name) = (connector.clone(), server_name.clone());
            async move {
                let host = uri.host().unwrap_or_default();
                let host = host
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_string();
                let port = uri.port_u16().unwrap_or(443);
                let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
                tcp.set_nodelay(true)?;
                let tls = connector.connect(server_name, tcp).await?;
                Ok::<_, std::io::Error>(TokioIo::new(tls))
            }
        });
        let channel = Endpoint::from(config.addr.clone())
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            .http2_keep_alive_interval(KEEPALIVE)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .connect_with_connector_lazy(dial);
        let text = String::from_utf8_lossy(roots_pem);
        Ok(IstioCa {
            config,
            channel,
            roots,
            bundle_pem: format!("{}\n", text.trim_end()),
            verifier,
            issuer_end: AtomicI64::new(0),
        })
    }

    /// The trust bundle, PEM.
    pub fn bundle_pem(&self) -> &str {
        &self.bundle_pem
    }

    /// DER of each root.
    pub fn roots(&self) -> &[Vec<u8>] {
        &self.roots
    }

    /// When the certificate that signed the last leaf ends (Unix seconds), once one was.
    pub fn issuer_end(&self) -> Option<i64> {
        Some(self.issuer_end.load(Ordering::Relaxed)).filter(|end| *end != 0)
    }

    pub fn addr(&self) -> &Uri {
        &self.config.addr
    }

    /// Whether `other` checks against the same roots.
    pub fn same_roots(&self, other: &IstioCa) -> bool {
        self.roots == other.roots
    }

    /// A leaf for `id`: a fresh key, and the service's certificate for it, within
    /// [`WHOLE_REQUEST`].
    pub async fn sign(
        &self,
        id: &SpiffeId,
        policy: LeafPolicy,
        now: OffsetDateTime,
    ) -> Result<Leaf, IstioCaError> {
        tokio::time::timeout(WHOLE_REQUEST, self.ask(id, policy, now))
            .await
            .unwrap_or_else(|_| {
                Err(IstioCaError::Unavailable(format!(
                    "no whole answer within {WHOLE_REQUEST:?}"
                )))
            })
    }

    async fn ask(
        &self,
        id: &SpiffeId,
        policy: LeafPolicy,
        now: OffsetDateTime,
    ) -> Result<Leaf, IstioCaError> {
        let request_error = |e: rcgen::Error| IstioCaError::Request(e.to_string());
        let key = KeyPair::generate().map_err(request_error)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        let uri = id.to_string();
        params.subject_alt_names =
            vec![SanType::URI(uri.clone().try_into().map_err(request_error)?)];
        let csr = params
            .serialize_request(&key)
            .and_then(|csr| csr.pem())
            .map_err(request_error)?;
        let token = read_bounded(&self.config.token_file).await?;
        let token = String::from_utf8(token).map_err(|_| IstioCaError::File {
            path: self.config.token_file.display().to_string(),
            why: "not UTF-8".into(),
        })?;
        let metadata = Struct {
            fields: BTreeMap::from([(
                IMPERSONATED_IDENTITY.to_string(),
                Value {
                    kind: Some(Kind::StringValue(uri.clone())),
                },
            )])
            .into_iter()
            .collect(),
        };
        let mut request = tonic::Request::new(IstioCertificateRequest {
            csr,
            validity_duration: i64::try_from(policy.lifetime.as_secs()).unwrap_or(i64::MAX),
            metadata: Some(metadata),
        });
        let bearer =
            format!("Bearer {}", token.trim())
                .parse()
                .map_err(|_| IstioCaError::File {
                    path: self.config.token_file.display().to_string(),
                    why: "not a token an HTTP header can carry".into(),
                })?;
        request.metadata_mut().insert("authorization", bearer);
        request.set_timeout(REQUEST_TIMEOUT);

        let mut grpc = tonic::client::Grpc::new(self.channel.clone())
            .max_decoding_message_size(MOST_ANSWER_BYTES);
        grpc.ready()
            .await
            .map_err(|e| IstioCaError::Unavailable(brief(&e.to_string())))?;
        let codec =
            tonic_prost::ProstCodec::<IstioCertificateRequest, IstioCertificateResponse>::default();
        let answer = grpc
            .unary(
                request,
                PathAndQuery::from_static(CREATE_CERTIFICATE),
                codec,
            )
            .await
            .map_err(|status| {
                let message = brief(status.message());
                match status.code() {
                    tonic::Code::Unauthenticated
                    | tonic::Code::PermissionDenied
                    | tonic::Code::InvalidArgument
                    | tonic::Code::FailedPrecondition => IstioCaError::Refused {
                        code: status.code(),
                        message,
                    },
                    code => IstioCaError::Unavailable(format!("{code:?}: {message}")),
                }
            })?
            .into_inner();
        self.check(&answer, id, &key, now.unix_timestamp())
    }

    /// The leaf of an answer, if it is one for `key` and `id` alone that chains to the roots.
    /// The answer is the leaf, then what it chains through and the roots, in strings of one
    /// certificate or several (istiod sends its whole chain file, and its whole roots file,
    /// each as one).
    fn check(
        &self,
        answer: &IstioCertificateResponse,
        id: &SpiffeId,
        key: &KeyPair,
        now: i64,
    ) -> Result<Leaf, IstioCaError> {
        let refuse = |why: String| IstioCaError::Answer(why);
        let text: String = answer.cert_chain.iter().map(|c| format!("{c}\n")).collect();
        let chain = ders(text.as_bytes(), "the answer").map_err(|e| refuse(e.to_string()))?;
        if chain.len() > MOST_CHAIN {
            return Err(refuse(format!(
                "{} certificates, more than {MOST_CHAIN}",
                chain.len()
            )));
        }
        let leaf = parse(&chain[0], "the answer").map_err(|e| refuse(e.to_string()))?;
        if leaf.public_key().raw != key.subject_public_key_info().as_slice() {
            return Err(refuse("the leaf is not for the key asked with".into()));
        }
        let names: Vec<&GeneralName<'_>> = leaf
            .subject_alternative_name()
            .ok()
            .flatten()
            .map(|san| san.value.general_names.iter().collect())
            .unwrap_or_default();
        let wanted = id.to_string();
        if !matches!(names[..], [GeneralName::URI(uri)] if *uri == wanted) {
            return Err(refuse(format!(
                "the leaf names {} subject alternative names, not {wanted} alone",
                names.len()
            )));
        }
        if leaf.is_ca() {
            return Err(refuse("the leaf is a CA".into()));
        }
        let (not_before, not_after) = (
            leaf.validity().not_before.timestamp(),
            leaf.validity().not_after.timestamp(),
        );
        if not_before > now + SKEW || not_after <= now {
            return Err(refuse(format!(
                "the leaf is valid from {not_before} to {not_after}, not now ({now})"
            )));
        }
        // The path to the roots, as a peer builds it (webpki: signatures, CA constraints,
        // validity, client authentication), through any of the answer's other certificates.
        let intermediates: Vec<CertificateDer<'static>> = chain[1..]
            .iter()
            .filter(|der| !self.roots.contains(der))
            .map(|der| CertificateDer::from(der.clone()))
            .collect();
        let at = UnixTime::since_unix_epoch(Duration::from_secs(
            u64::try_from(now.max(not_before)).unwrap_or(0),
        ));
        self.verifier
            .verify_client_cert(&CertificateDer::from(chain[0].clone()), &intermediates, at)
            .map_err(|e| refuse(format!("the leaf does not chain to the roots: {e}")))?;
        // The issuer's end, for the metric: the certificate of the answer that signed the leaf.
        let signer_end = chain[1..]
            .iter()
            .filter_map(|der| parse(der, "the answer").ok())
            .find(|cert| leaf.verify_signature(Some(cert.public_key())).is_ok())
            .map(|cert| cert.validity().not_after.timestamp());
        if let Some(end) = signer_end {
            self.issuer_end.store(end, Ordering::Relaxed);
        }
        // Handed to the proxy: the leaf and the certificates it may chain through, as the
        // answer wrote them; not the roots (its peers hold those already).
        let blocks = pem_blocks(&text);
        let handed: String = blocks
            .iter()
            .zip(&chain)
            .enumerate()
            .filter(|(index, (_, der))| {
                *index == 0 || !(self.roots.contains(der) || self_signed(der))
            })
            .map(|(_, (block, _))| format!("{block}\n"))
            .collect();
        Ok(Leaf {
            chain_pem: handed,
            key_pem: key.serialize_pem(),
            not_after,
            serial: serial_hex(&leaf),
        })
    }
}

/// Whether a certificate is a root: its own issuer, signed by its own key.
fn self_signed(der: &[u8]) -> bool {
    parse(der, "the answer")
        .is_ok_and(|cert| cert.subject() == cert.issuer() && cert.verify_signature(None).is_ok())
}

/// The `CERTIFICATE` blocks of a PEM text, in order: those [`ders`] reads.
fn pem_blocks(text: &str) -> Vec<&str> {
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
    const END: &str = "-----END CERTIFICATE-----";
    let mut blocks = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(BEGIN) {
        let Some(length) = rest[start..].find(END) else {
            break;
        };
        let end = start + length + END.len();
        blocks.push(&rest[start..end]);
        rest = &rest[end..];
    }
    blocks
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    #[test]
    fn the_messages_are_the_protos_bytes() {
        // `csr = 1` (string), `validity_duration = 3` (int64), `metadata = 4` (Struct, whose
        // `fields = 1` is a map of string to Value, whose `string_value = 3`).
        let request = IstioCertificateRequest {
            csr: "C".into(),
            validity_duration: 60,
            metadata: Some(Struct {
                fields: [(
                    "k".to_string(),
                    Value {
                        kind: Some(Kind::StringValue("v".into())),
                    },
                )]
                .into_iter()
                .collect(),
            }),
        };
        let expected = [
            0x0a, 1, b'C', // csr
            0x18, 60, // validity_duration
            0x22, 10, // metadata, 10 bytes
            0x0a, 8, // fields entry, 8 bytes
            0x0a, 1, b'k', // key
            0x12, 3, // value, 3 bytes
            0x1a, 1, b'v', // string_value
        ];
        assert_eq!(request.encode_to_vec(), expected);
        // `cert_chain = 1`, repeated string.
        let response =
            IstioCertificateResponse::decode(&[0x0a, 1, b'a', 0x0a, 1, b'b'][..]).unwrap();
        assert_eq!(response.cert_chain, ["a", "b"]);
    }

    /// A root of its own, and leaves it signs for any key and URIs.
    struct TestCa {
        pem: String,
        issuer: rcgen::Issuer<'static, KeyPair>,
    }

    impl TestCa {
        /// A CA named `name`, signed by `by` (none: by itself, a root).
        fn made(name: &str, by: Option<&TestCa>) -> TestCa {
            let mut params = CertificateParams::default();
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, name);
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign];
            let key = KeyPair::generate().unwrap();
            let cert = match by {
                Some(by) => params.signed_by(&key, &by.issuer),
                None => params.self_signed(&key),
            };
            TestCa {
                pem: cert.unwrap().pem(),
                issuer: rcgen::Issuer::new(params, key),
            }
        }

        fn new(name: &str) -> TestCa {
            TestCa::made(name, None)
        }

        /// An intermediate CA under this one: its PEM is the intermediate's alone.
        fn intermediate(&self, name: &str) -> TestCa {
            TestCa::made(name, Some(self))
        }

        fn leaf(&self, key: &KeyPair, uris: &[&str], life: Duration) -> String {
            let mut params = CertificateParams::default();
            params.subject_alt_names = uris
                .iter()
                .map(|u| SanType::URI((*u).try_into().unwrap()))
                .collect();
            let now = OffsetDateTime::now_utc();
            params.not_before = now - Duration::from_secs(60);
            params.not_after = now + life;
            params.signed_by(key, &self.issuer).unwrap().pem()
        }
    }

    fn config() -> Arc<IstioCaConfig> {
        Arc::new(IstioCaConfig {
            addr: "https://istiod.istio-system.svc:15012".parse().unwrap(),
            server_name: "istiod.istio-system.svc".into(),
            token_file: "/nonexistent".into(),
            roots_file: "/nonexistent".into(),
        })
    }

    #[tokio::test]
    async fn an_answer_is_taken_only_for_the_key_and_identity_asked_and_chained_to_the_roots() {
        let ca = TestCa::new("mesh root");
        let service = IstioCa::new(config(), ca.pem.as_bytes()).unwrap();
        let id = SpiffeId::new("cluster.local", "shop", "cart").unwrap();
        let uri = id.to_string();
        let key = KeyPair::generate().unwrap();
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let answer = |chain: Vec<String>| IstioCertificateResponse { cert_chain: chain };
        let day = Duration::from_secs(86_400);

        // The leaf and the root, as istiod answers: the root is not handed on.
        let leaf = ca.leaf(&key, &[&uri], day);
        let taken = service
            .check(&answer(vec![leaf.clone(), ca.pem.clone()]), &id, &key, now)
            .unwrap();
        assert_eq!(taken.chain_pem.matches("BEGIN CERTIFICATE").count(), 1);
        assert!(taken.not_after > now + 3600);
        assert!(taken.key_pem.contains("PRIVATE KEY"));

        let refused = |chain: Vec<String>, saying: &str| {
            let error = service.check(&answer(chain), &id, &key, now).unwrap_err();
            assert!(
                error.to_string().contains(saying),
                "{error} does not say {saying}"
            );
            assert_eq!(error.reason(), "answer");
        };
        // As istiod answers during a root rotation: the leaf, its chain file (intermediate
        // and root) as one string, its roots file (two roots) as another. Handed on: the leaf
        // and the intermediate.
        let intermediate = ca.intermediate("mesh intermediate");
        let next_root = TestCa::new("next root");
        let istiod = vec![
            intermediate.leaf(&key, &[&uri], day),
            format!("{}{}", intermediate.pem, ca.pem),
            format!("{}{}", ca.pem, next_root.pem),
        ];
        let taken = service.check(&answer(istiod), &id, &key, now).unwrap();
        assert_eq!(taken.chain_pem.matches("BEGIN CERTIFICATE").count(), 2);
        assert!(taken.chain_pem.contains(intermediate.pem.trim_end()));
        assert!(!taken.chain_pem.contains(next_root.pem.trim_end()));
        // Without the intermediate, the leaf reaches no root.
        refused(
            vec![intermediate.leaf(&key, &[&uri], day), ca.pem.clone()],
            "does not chain to the roots",
        );

        refused(vec![], "holds no PEM certificate");
        refused(vec!["not PEM".into()], "holds no PEM certificate");
        let other_key = KeyPair::generate().unwrap();
        refused(
            vec![ca.leaf(&other_key, &[&uri], day)],
            "not for the key asked with",
        );
        refused(
            vec![ca.leaf(&key, &["spiffe://cluster.local/ns/shop/sa/pay"], day)],
            "not spiffe://cluster.local/ns/shop/sa/cart alone",
        );
        refused(
            vec![ca.leaf(&key, &[&uri, "spiffe://cluster.local/ns/x/sa/y"], day)],
            "names 2 subject alternative names",
        );
        let mut params = CertificateParams::default();
        params.subject_alt_names = vec![
            SanType::URI(uri.clone().try_into().unwrap()),
            SanType::DnsName("cart.shop.svc".try_into().unwrap()),
        ];
        let with_dns = params.signed_by(&key, &ca.issuer).unwrap().pem();
        refused(vec![with_dns], "names 2 subject alternative names");
        let stranger = TestCa::new("another root");
        refused(
            vec![stranger.leaf(&key, &[&uri], day), stranger.pem.clone()],
            "does not chain to the roots",
        );
        // Already over (its end before now).
        let mut params = CertificateParams::default();
        params.subject_alt_names = vec![SanType::URI(uri.clone().try_into().unwrap())];
        params.not_before = OffsetDateTime::now_utc() - day;
        params.not_after = OffsetDateTime::now_utc() - Duration::from_secs(60);
        let over = params.signed_by(&key, &ca.issuer).unwrap().pem();
        refused(vec![over], "not now");
    }

    #[test]
    fn a_status_message_is_cut_short() {
        assert_eq!(brief("short"), "short");
        let long = "é".repeat(500);
        assert_eq!(brief(&long).chars().count(), 201);
    }
}
