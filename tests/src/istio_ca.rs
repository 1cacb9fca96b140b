//! Istio's certificate service (`istio.v1.auth.IstioCertificateService/CreateCertificate`),
//! as istiod serves it to a node agent: the stand-in for istiod, which cannot run here. It is
//! written from the API's proto (istio/api, `security/v1alpha1/ca.proto`), not from the
//! agent's client, and checks what istiod checks of a caller that impersonates:
//!
//! - the caller's bearer token is one it knows (istiod asks the API server's TokenReview), and
//!   names the node the caller runs on;
//! - the identity asked for (`ImpersonatedIdentity` in the request's metadata) has a pod on
//!   that node (istiod's `CA_TRUSTED_NODE_ACCOUNTS` check);
//! - the CSR names that identity and nothing else.
//!
//! It then signs with its root for the validity asked (capped), for server and client
//! authentication, and answers as istiod does: the leaf, its chain file as one string (here
//! the root alone, which signs), and its roots file as another, which here holds a second
//! root, as during a root rotation. It serves TLS with a certificate for [`SERVER_NAME`], from the same root. A test can
//! take it down (every call `UNAVAILABLE`) and up again, and read what it issued and refused.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::Context as _;
use envoy_types::pb::google::protobuf::{Struct, value::Kind};
use hyper::server::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};
use lattice_inject::certs::Chain;
use rcgen::{CertificateSigningRequestParams, KeyPair, SanType};
use tonic::server::UnaryService;
use tonic::{Request, Response, Status};

/// The name on the service's certificate.
pub const SERVER_NAME: &str = "istiod.istio-system.svc";
/// The longest leaf it signs.
const MOST_LIFE: Duration = Duration::from_secs(24 * 3600);

/// `istio.v1.auth.IstioCertificateRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CertificateRequest {
    #[prost(string, tag = "1")]
    pub csr: String,
    #[prost(int64, tag = "3")]
    pub validity_duration: i64,
    #[prost(message, optional, tag = "4")]
    pub metadata: Option<Struct>,
}

/// `istio.v1.auth.IstioCertificateResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CertificateResponse {
    #[prost(string, repeated, tag = "1")]
    pub cert_chain: Vec<String>,
}

const PATH: &str = "/istio.v1.auth.IstioCertificateService/CreateCertificate";

#[derive(Default)]
struct State {
    /// Bearer token → the node its holder runs on.
    tokens: HashMap<String, String>,
    /// (SPIFFE ID, node) of each pod.
    pods: Vec<(String, String)>,
    down: bool,
    /// Identity and serial (hex) of each leaf signed.
    issued: Vec<(String, String)>,
    /// Identity asked for (or `-`) and why, of each call refused.
    refused: Vec<(String, String)>,
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

/// The running service.
pub struct IstioCaServer {
    runtime: Option<tokio::runtime::Runtime>,
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    /// The mesh's root (PEM), which signs the leaves and the service's certificate.
    pub root_pem: String,
}

impl Drop for IstioCaServer {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl IstioCaServer {
    /// Listens on 127.0.0.1 of the calling thread's network namespace.
    pub fn start() -> anyhow::Result<IstioCaServer> {
        let chain = Chain::issue(&[SERVER_NAME.to_string()])?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("istio-ca")
            .enable_all()
            .build()?;
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
        let signer = Arc::new(Signer::new(&chain)?);
        let tls = tls_config(&chain)?;
        let (accepting, signing) = (state.clone(), signer);
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("the listener");
            let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let (acceptor, state, signer) =
                    (acceptor.clone(), accepting.clone(), signing.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service = hyper::service::service_fn(move |request| {
                        let (state, signer) = (state.clone(), signer.clone());
                        async move { Ok::<_, Infallible>(route(request, state, signer).await) }
                    });
                    let _ = http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        Ok(IstioCaServer {
            runtime: Some(runtime),
            addr,
            state,
            root_pem: chain.ca_cert,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// An agent of `node` as a client of this service: the service takes a token as that
    /// node's, written with its roots into `dir`; the agent's flags, and the roots file.
    pub fn agent_flags(&self, node: &str, dir: &Path) -> anyhow::Result<(Vec<String>, PathBuf)> {
        const TOKEN: &str = "agent-token";
        self.token(TOKEN, node);
        let (roots, token) = (dir.join("istio-roots.pem"), dir.join("istio-token"));
        std::fs::write(&roots, &self.root_pem)?;
        std::fs::write(&token, format!("{TOKEN}\n"))?;
        let flags = vec![
            format!("--istio-ca-addr=https://{}", self.addr),
            format!("--istio-ca-server-name={SERVER_NAME}"),
            format!("--istio-ca-roots={}", roots.display()),
            format!("--istio-ca-token={}", token.display()),
        ];
        Ok((flags, roots))
    }

    /// The holder of `token` runs on `node`.
    pub fn token(&self, token: &str, node: &str) {
        lock(&self.state)
            .tokens
            .insert(token.to_string(), node.to_string());
    }

    /// A pod of `identity` (a SPIFFE ID) runs on `node`.
    pub fn pod(&self, identity: &str, node: &str) {
        lock(&self.state)
            .pods
            .push((identity.to_string(), node.to_string()));
    }

    /// Every call answered `UNAVAILABLE` (down) or served (up).
    pub fn set_down(&self, down: bool) {
        lock(&self.state).down = down;
    }

    /// Identity and serial of each leaf signed.
    pub fn issued(&self) -> Vec<(String, String)> {
        lock(&self.state).issued.clone()
    }

    /// Identity and reason of each call refused.
    pub fn refused(&self) -> Vec<(String, String)> {
        lock(&self.state).refused.clone()
    }
}

fn tls_config(chain: &Chain) -> anyhow::Result<rustls::ServerConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_slice_iter(chain.cert.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .context("the service's certificate")?;
    let key = PrivateKeyDer::from_pem_slice(chain.key.as_bytes()).context("its key")?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// The root's key, to sign with.
struct Signer {
    issuer: rcgen::Issuer<'static, KeyPair>,
    root_pem: String,
    /// A root of the service's roots file that is not the agent's.
    next_root_pem: String,
}

impl Signer {
    fn new(chain: &Chain) -> anyhow::Result<Signer> {
        let key = KeyPair::from_pem(&chain.ca_key)?;
        Ok(Signer {
            issuer: rcgen::Issuer::from_ca_cert_pem(&chain.ca_cert, key)?,
            root_pem: chain.ca_cert.clone(),
            next_root_pem: Chain::issue(&[SERVER_NAME.to_string()])?.ca_cert,
        })
    }
}

async fn route(
    request: hyper::Request<hyper::body::Incoming>,
    state: Arc<Mutex<State>>,
    signer: Arc<Signer>,
) -> hyper::Response<tonic::body::Body> {
    if request.uri().path() != PATH {
        return Status::unimplemented(request.uri().path().to_string()).into_http();
    }
    let codec = tonic_prost::ProstCodec::<CertificateResponse, CertificateRequest>::default();
    let mut grpc = tonic::server::Grpc::new(codec);
    grpc.unary(CreateCertificate { state, signer }, request)
        .await
}

struct CreateCertificate {
    state: Arc<Mutex<State>>,
    signer: Arc<Signer>,
}

impl UnaryService<CertificateRequest> for CreateCertificate {
    type Response = CertificateResponse;
    type Future = std::future::Ready<Result<Response<CertificateResponse>, Status>>;

    fn call(&mut self, request: Request<CertificateRequest>) -> Self::Future {
        let answer = create(&self.state, &self.signer, &request);
        if let Err(status) = &answer {
            let asked = impersonated(request.get_ref()).unwrap_or("-").to_string();
            lock(&self.state)
                .refused
                .push((asked, status.message().to_string()));
        }
        std::future::ready(answer.map(Response::new))
    }
}

fn impersonated(request: &CertificateRequest) -> Option<&str> {
    let value = request
        .metadata
        .as_ref()?
        .fields
        .get("ImpersonatedIdentity")?;
    match &value.kind {
        Some(Kind::StringValue(id)) => Some(id),
        _ => None,
    }
}

fn create(
    state: &Mutex<State>,
    signer: &Signer,
    request: &Request<CertificateRequest>,
) -> Result<CertificateResponse, Status> {
    let (node, known) = {
        let state = lock(state);
        if state.down {
            return Err(Status::unavailable("down, as the test asked"));
        }
        let token = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| Status::unauthenticated("no bearer token"))?;
        let node = state.tokens.get(token).cloned().ok_or_else(|| {
            Status::unauthenticated("the token is not one of a trusted node agent")
        })?;
        (node, state.pods.clone())
    };
    let body = request.get_ref();
    let id = impersonated(body)
        .ok_or_else(|| Status::invalid_argument("no ImpersonatedIdentity"))?
        .to_string();
    if !known.iter().any(|(pod, on)| *pod == id && *on == node) {
        return Err(Status::permission_denied(format!(
            "no pod of {id} runs on {node}"
        )));
    }
    let csr = CertificateSigningRequestParams::from_pem(&body.csr)
        .map_err(|e| Status::invalid_argument(format!("the CSR: {e}")))?;
    let sans: Vec<String> = csr
        .params
        .subject_alt_names
        .iter()
        .map(|san| match san {
            SanType::URI(uri) => uri.as_str().to_string(),
            other => format!("{other:?}"),
        })
        .collect();
    if sans != [id.clone()] {
        return Err(Status::invalid_argument(format!(
            "the CSR names {sans:?}, not {id}"
        )));
    }
    let life = u64::try_from(body.validity_duration)
        .ok()
        .filter(|secs| *secs > 0)
        .map_or(MOST_LIFE, Duration::from_secs)
        .min(MOST_LIFE);
    let now = time::OffsetDateTime::now_utc();
    let mut params = csr.params;
    params.not_before = now - Duration::from_secs(60);
    params.not_after = now + life;
    params.use_authority_key_identifier_extension = true;
    params.extended_key_usages = vec![
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let cert = params
        .signed_by(&csr.public_key, &signer.issuer)
        .map_err(|e| Status::internal(e.to_string()))?;
    let serial = {
        use x509_parser::prelude::FromDer;
        let (_, parsed) = x509_parser::certificate::X509Certificate::from_der(cert.der())
            .map_err(|e| Status::internal(e.to_string()))?;
        parsed
            .raw_serial()
            .iter()
            .map(|b| format!("{b:02X}"))
            .collect::<String>()
    };
    lock(state).issued.push((id, serial));
    Ok(CertificateResponse {
        cert_chain: vec![
            cert.pem(),
            signer.root_pem.clone(),
            format!("{}{}", signer.root_pem, signer.next_root_pem),
        ],
    })
}
