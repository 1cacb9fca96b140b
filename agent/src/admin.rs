//! The admin HTTP server (node-local): health, readiness, metrics and debug views. Kept apart
//! from the data path so a slow scrape never delays a push. Its TCP port is shared
//! (SO_REUSEPORT) so an upgraded agent binds beside this one; the Unix socket, if any, is this
//! agent's alone, which is where the kubelet's probes ask (`--probe`).

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;

use crate::catalog::StatusRx;
use crate::mesh::{MeshRx, NodeLocality};
use crate::metrics::Metrics;
use crate::readiness::Readiness;
use crate::trust::{Authority, NodeSecrets};
use crate::xds::ProxyRegistry;

/// What the admin server reads: the agent's state, never a lock on the data path.
#[derive(Clone)]
pub struct AdminState {
    pub mesh: MeshRx,
    /// The providers the catalog merges, and where they disagree.
    pub catalog: StatusRx,
    /// This node's name and zone, which decide endpoint priorities (`None` until known).
    pub node: tokio::sync::watch::Receiver<Option<NodeLocality>>,
    pub metrics: Arc<Metrics>,
    pub proxies: ProxyRegistry,
    pub readiness: Readiness,
    /// The issuer of workload certificates, for `/debug/identity`.
    pub authority: Arc<Authority>,
    /// The leaves of this node's proxies, when the agent serves them.
    pub secrets: Option<NodeSecrets>,
}

pub struct AdminServer {
    listener: TcpListener,
    /// The agent's own socket and its path (removed when the server stops).
    socket: Option<(UnixListener, PathBuf)>,
    router: Router,
}

impl AdminServer {
    /// Binds `addr` (shared with a successor) and, if given, the Unix socket `socket` (a file
    /// left there by an earlier run of this pod's agent is replaced).
    pub async fn bind(
        addr: SocketAddr,
        socket: Option<&Path>,
        state: AdminState,
    ) -> std::io::Result<AdminServer> {
        let listener = lattice_dns::handoff::shared_listener(addr)?;
        let socket = match socket {
            Some(path) => {
                match std::fs::remove_file(path) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                    _ => {}
                }
                Some((UnixListener::bind(path)?, path.to_path_buf()))
            }
            None => None,
        };
        let router = Router::new()
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(readyz))
            .route("/metrics", get(metrics_text))
            .route("/debug/mesh", get(debug_mesh))
            .route("/debug/xds", get(debug_xds))
            .route("/debug/identity", get(debug_identity))
            .route("/debug/routes", get(debug_routes))
            .with_state(state);
        Ok(AdminServer {
            listener,
            socket,
            router,
        })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    pub async fn run(self, shutdown: CancellationToken) -> std::io::Result<()> {
        let stopped = shutdown.clone();
        let tcp = axum::serve(self.listener, self.router.clone())
            .with_graceful_shutdown(async move { stopped.cancelled().await });
        let Some((socket, path)) = self.socket else {
            return tcp.await;
        };
        let unix = axum::serve(socket, self.router)
            .with_graceful_shutdown(async move { shutdown.cancelled().await });
        let served = tokio::try_join!(tcp.into_future(), unix.into_future()).map(|_| ());
        let _ = std::fs::remove_file(path);
        served
    }
}

/// Why a probe ([`probe`]) failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("{0:?} is not an admin path (`/readyz`, `/healthz`)")]
    Path(String),
    #[error("cannot ask the agent on {socket}: {source}")]
    Io {
        socket: PathBuf,
        source: std::io::Error,
    },
    #[error("the agent answered {status}: {body}")]
    Status { status: String, body: String },
}

/// How long a probe waits for the agent: below the kubelet's default probe timeout (1 s).
const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(900);

/// Asks the agent listening on the Unix socket `socket` for `path`: the body if it answers
/// 200. The kubelet's exec probes run this (`lattice-agent --probe`), so each pod's probes
/// reach its own agent, whoever shares its TCP ports.
pub fn probe(socket: &Path, path: &str) -> Result<String, ProbeError> {
    use std::io::{Read, Write};
    if !path.starts_with('/') || path.len() > 256 || !path.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ProbeError::Path(path.chars().take(64).collect()));
    }
    let io = |source| ProbeError::Io {
        socket: socket.to_path_buf(),
        source,
    };
    let mut stream = std::os::unix::net::UnixStream::connect(socket).map_err(io)?;
    stream.set_read_timeout(Some(PROBE_TIMEOUT)).map_err(io)?;
    stream.set_write_timeout(Some(PROBE_TIMEOUT)).map_err(io)?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .map_err(io)?;
    let mut response = Vec::new();
    stream
        .take(64 << 10)
        .read_to_end(&mut response)
        .map_err(io)?;
    let response = String::from_utf8_lossy(&response);
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head.split_whitespace().nth(1).unwrap_or("no status");
    if status == "200" {
        Ok(body.to_string())
    } else {
        Err(ProbeError::Status {
            status: status.to_string(),
            body: body.trim().chars().take(512).collect(),
        })
    }
}

/// Ready once every component is: the servers bound, and the Envoy resources and DNS names of
/// the first complete mesh snapshot published.
async fn readyz(State(state): State<AdminState>) -> Response {
    let pending = state.readiness.pending();
    if !pending.is_empty() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: waiting for {}\n", pending.join(", ")),
        )
            .into_response();
    }
    let version = state.mesh.borrow().as_ref().map(|mesh| mesh.version);
    format!("ready: mesh version {}\n", version.unwrap_or_default()).into_response()
}

async fn metrics_text(State(state): State<AdminState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
        .into_response()
}

/// Where Envoy's view of endpoint health is: Envoy reports it to a control plane only over
/// HDS, which the agent does not serve, so an operator reads it from the proxy.
const HEALTH_NOTE: &str = "each service's health policy is under services.*.health; the health \
    of each endpoint as a pod's Envoy sees it is on that Envoy's admin port: curl \
    127.0.0.1:15000/clusters in the pod (health_flags per host: /failed_active_hc, \
    /failed_outlier_check), and stats cluster.<name>.outlier_detection.ejections_active";

/// The merged mesh, with the providers it came from (each endpoint names its own) and the
/// conflicts between them. Before every provider's first view: 503, with the providers, so an
/// operator sees which one is missing.
async fn debug_mesh(State(state): State<AdminState>) -> Response {
    let snapshot = state.mesh.borrow().clone();
    let catalog = state.catalog.borrow().clone();
    let Some(snapshot) = snapshot else {
        let body = serde_json::json!({
            "synced": false,
            "providers": catalog.providers,
        });
        return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
    };
    match serde_json::to_value(&*snapshot) {
        Ok(mut value) => {
            value["providers"] = serde_json::to_value(&catalog.providers).unwrap_or_default();
            value["conflicts"] = serde_json::to_value(&catalog.conflicts).unwrap_or_default();
            if let Some(addresses) = &catalog.addresses {
                value["addresses"] = serde_json::to_value(addresses).unwrap_or_default();
            }
            if let Some(last_mesh) = &catalog.last_mesh {
                value["last_mesh"] = serde_json::to_value(last_mesh).unwrap_or_default();
            }
            value["node"] = serde_json::to_value(&*state.node.borrow()).unwrap_or_default();
            value["health_note"] = HEALTH_NOTE.into();
            axum::Json(value).into_response()
        }
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{error}\n")).into_response(),
    }
}

/// The routing rules in effect, by parent service, with their sources, and every route the
/// sources refused, with the reason.
async fn debug_routes(State(state): State<AdminState>) -> Response {
    let Some(mesh) = state.mesh.borrow().clone() else {
        return (StatusCode::SERVICE_UNAVAILABLE, "mesh not synced yet\n").into_response();
    };
    let services: Vec<serde_json::Value> = mesh
        .services
        .values()
        .filter(|s| !s.routes.is_empty())
        .map(|s| {
            serde_json::json!({
                "service": s.path,
                "name": s.dns_name,
                "rules": s.routes,
            })
        })
        .collect();
    axum::Json(serde_json::json!({
        "version": mesh.version,
        "services": services,
        "rejected": mesh.rejected_routes,
    }))
    .into_response()
}

async fn debug_identity(State(state): State<AdminState>) -> Response {
    let mut shown = state.authority.debug();
    shown["leaves"] = state
        .secrets
        .as_ref()
        .map_or(serde_json::Value::Null, NodeSecrets::debug);
    axum::Json(shown).into_response()
}

async fn debug_xds(State(state): State<AdminState>) -> Response {
    axum::Json(state.proxies.list()).into_response()
}
