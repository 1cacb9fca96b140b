//! The webhook's HTTPS server: `POST /inject` answers admission reviews
//! ([`crate::review`]), `GET /healthz` and `/readyz` the kubelet's probes, `GET /metrics`
//! Prometheus. HTTP/1.1 and HTTP/2 over TLS (the API server speaks either), with the serving
//! certificate read at each handshake from a [`CertSlot`], so a renewed certificate is served
//! without a restart.
//!
//! Bounded whatever a client sends: at most [`MAX_CONNECTIONS`] connections, a TLS handshake
//! within [`HANDSHAKE_TIMEOUT`], a request's headers within [`HEADER_TIMEOUT`], a review body of
//! at most [`MAX_BODY`] (a Pod is at most about 1.5 MB in etcd). On shutdown it stops
//! accepting and lets open connections finish what they were asked, for up to [`DRAIN`].

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::review::{self, Policy};

/// Connections open at once; more wait in the kernel's accept queue.
pub const MAX_CONNECTIONS: usize = 256;
/// Time for a client to complete its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Time for a request's headers to arrive.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest review body read.
pub const MAX_BODY: usize = 4 << 20;
/// On shutdown, how long open connections have to finish.
pub const DRAIN: Duration = Duration::from_secs(5);

/// Why the serving certificate could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("the serving certificate: {0}")]
    Certificate(String),
    #[error("the serving key: {0}")]
    Key(String),
}

/// The certificate served, replaced when renewed.
#[derive(Debug)]
pub struct CertSlot(RwLock<Arc<CertifiedKey>>);

impl CertSlot {
    pub fn new(cert_pem: &str, key_pem: &str) -> Result<Arc<CertSlot>, TlsError> {
        Ok(Arc::new(CertSlot(RwLock::new(certified(
            cert_pem, key_pem,
        )?))))
    }

    /// Serves `cert_pem` from the next handshake on.
    pub fn replace(&self, cert_pem: &str, key_pem: &str) -> Result<(), TlsError> {
        let key = certified(cert_pem, key_pem)?;
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = key;
        Ok(())
    }

    /// A TLS configuration serving this slot's certificate, HTTP/2 or HTTP/1.1 by ALPN.
    pub fn server_config(self: &Arc<Self>) -> Arc<ServerConfig> {
        let mut config = ServerConfig::builder()
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Arc::new(config)
    }
}

impl ResolvesServerCert for CertSlot {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.read().unwrap_or_else(|p| p.into_inner()).clone())
    }
}

fn certified(cert_pem: &str, key_pem: &str) -> Result<Arc<CertifiedKey>, TlsError> {
    let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Certificate(e.to_string()))?;
    if chain.is_empty() {
        return Err(TlsError::Certificate(
            "no certificate in the PEM".to_string(),
        ));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| TlsError::Key(e.to_string()))?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&key)
        .map_err(|e| TlsError::Key(e.to_string()))?;
    Ok(Arc::new(CertifiedKey::new(chain, signing)))
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VerdictLabel {
    verdict: &'static str,
}

/// The injector's metrics.
#[derive(Clone, Default)]
pub struct Metrics {
    reviews: Family<VerdictLabel, Counter>,
    refused: Counter,
    /// When the serving certificate expires (Unix seconds).
    expiry: Gauge,
    /// Filled once, when made; only read after.
    registry: Arc<Registry>,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut metrics = Metrics::default();
        let mut registry = Registry::default();
        {
            let sub = registry.sub_registry_with_prefix("lattice_injector");
            sub.register(
                "reviews",
                "Admission reviews answered, by verdict: injected, settled (already in the mesh \
                 or opted out), left (admitted without the mesh, with a warning), ignored (not a \
                 pod creation the injector changes)",
                metrics.reviews.clone(),
            );
            sub.register(
                "certificate_expiry_timestamp_seconds",
                "When the serving certificate expires (Unix time): it is renewed when a third of \
                 its life is left, so an alert well before that says renewal fails",
                metrics.expiry.clone(),
            );
            sub.register(
                "bad_requests",
                "Requests refused: not a review, too large, or not POST /inject",
                metrics.refused.clone(),
            );
        }
        metrics.registry = Arc::new(registry);
        metrics
    }

    /// The serving certificate now served, `cert_pem`.
    pub fn serving(&self, cert_pem: &str) {
        if let Some(expiry) = crate::certs::expiry(cert_pem) {
            self.expiry.set(expiry);
        }
    }

    fn encode(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// What the server shares with the rest of the injector.
#[derive(Clone, Debug)]
pub struct Shared {
    pub policy: Arc<Policy>,
    pub metrics: Metrics,
    /// `/readyz` answers 200 once this is set: the API server can verify the certificate
    /// served (its CA is in the webhook configuration's bundle).
    pub ready: Arc<AtomicBool>,
}

/// Serves until `shutdown` is cancelled, then drains.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    shared: Shared,
    shutdown: CancellationToken,
) {
    let acceptor = TlsAcceptor::from(tls);
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let permit = tokio::select! {
            permit = slots.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
            () = shutdown.cancelled() => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        let (acceptor, shared, shutdown) = (acceptor.clone(), shared.clone(), shutdown.clone());
        connections.spawn(async move {
            let _permit = permit;
            connection(stream, peer, acceptor, shared, shutdown).await;
        });
        while connections.try_join_next().is_some() {}
    }
    drop(listener);
    let drained = tokio::time::timeout(DRAIN, async {
        while connections.join_next().await.is_some() {}
    });
    if drained.await.is_err() {
        tracing::info!(
            open = connections.len(),
            "closing the connections left at the drain deadline"
        );
        connections.shutdown().await;
    }
}

async fn connection(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    acceptor: TlsAcceptor,
    shared: Shared,
    shutdown: CancellationToken,
) {
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            tracing::debug!(%peer, error = %e, "TLS handshake failed");
            return;
        }
        Err(_) => {
            tracing::debug!(%peer, "TLS handshake timed out");
            return;
        }
    };
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let shared = shared.clone();
        async move { Ok::<_, std::convert::Infallible>(handle(request, &shared).await) }
    });
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT);
    let conn = builder.serve_connection(TokioIo::new(tls), service);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        result = conn.as_mut() => {
            if let Err(e) = result {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        }
        () = shutdown.cancelled() => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}

async fn handle(request: Request<Incoming>, shared: &Shared) -> Response<Full<Bytes>> {
    let (policy, metrics) = (&shared.policy, &shared.metrics);
    let text = |code: StatusCode, body: &str| {
        let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
        *response.status_mut() = code;
        response
    };
    match (request.method(), request.uri().path()) {
        (&Method::GET, "/healthz") => text(StatusCode::OK, "ok\n"),
        (&Method::GET, "/readyz") if shared.ready.load(Ordering::Acquire) => {
            text(StatusCode::OK, "ok\n")
        }
        (&Method::GET, "/readyz") => text(
            StatusCode::SERVICE_UNAVAILABLE,
            "the CA bundle is not written yet\n",
        ),
        (&Method::GET, "/metrics") => text(StatusCode::OK, &metrics.encode()),
        (&Method::POST, "/inject") => {
            let body = match Limited::new(request.into_body(), MAX_BODY).collect().await {
                Ok(body) => body.to_bytes(),
                Err(e) => {
                    metrics.refused.inc();
                    let code = if e
                        .downcast_ref::<http_body_util::LengthLimitError>()
                        .is_some()
                    {
                        StatusCode::PAYLOAD_TOO_LARGE
                    } else {
                        StatusCode::BAD_REQUEST
                    };
                    return text(code, "the review could not be read\n");
                }
            };
            match review::review(&body, policy) {
                Ok((answer, verdict)) => {
                    metrics
                        .reviews
                        .get_or_create(&VerdictLabel {
                            verdict: verdict.label(),
                        })
                        .inc();
                    tracing::debug!(?verdict, "review answered");
                    let mut response = Response::new(Full::new(Bytes::from(answer)));
                    response.headers_mut().insert(
                        http::header::CONTENT_TYPE,
                        http::HeaderValue::from_static("application/json"),
                    );
                    response
                }
                Err(e) => {
                    metrics.refused.inc();
                    text(StatusCode::BAD_REQUEST, &format!("{e}\n"))
                }
            }
        }
        _ => {
            metrics.refused.inc();
            text(StatusCode::NOT_FOUND, "not found\n")
        }
    }
}
