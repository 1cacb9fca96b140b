//! The sidecar injector (`lattice webhook`) as a process of the test, and a client that speaks
//! to it as the API server does: an AdmissionReview POSTed over TLS, the server's certificate
//! verified against a CA bundle and the Service's DNS name, over HTTP/2 or HTTP/1.1 as ALPN
//! settles it.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::Value;

use crate::bins;

/// The name the API server calls the injector by (its Service's), which its certificate names.
pub const SERVICE_NAME: &str = "lattice-injector.lattice-system.svc";

/// A running `lattice webhook`, killed on drop.
pub struct Injector {
    child: Child,
    log: tempfile::NamedTempFile,
    pub addr: SocketAddr,
}

impl Injector {
    /// Starts `lattice webhook` on a free loopback port with `kubeconfig` and `args`.
    pub fn start(kubeconfig: &str, args: &[&str]) -> anyhow::Result<Injector> {
        Injector::start_with_env(kubeconfig, args, &[])
    }

    /// [`Injector::start`] with more environment (`POD_NAME`, as the downward API sets it).
    pub fn start_with_env(
        kubeconfig: &str,
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> anyhow::Result<Injector> {
        let addr = free_port()?;
        let log = tempfile::NamedTempFile::new()?;
        let child = Command::new(bins::path("lattice"))
            .arg("webhook")
            .arg(format!("--listen={addr}"))
            .args(args)
            .env("KUBECONFIG", kubeconfig)
            .env("POD_NAMESPACE", "lattice-system")
            .env("RUST_LOG", "info,lattice_inject=debug")
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log.reopen()?)
            .spawn()
            .context("starting lattice webhook (cargo build --workspace --bins first)")?;
        Ok(Injector { child, log, addr })
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process has exited, and how.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

impl Drop for Injector {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> anyhow::Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?)
}

/// A TLS client that trusts `bundle` (PEM) alone.
pub fn tls_client(bundle: &[u8], alpn: &[&[u8]]) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(bundle) {
        roots.add(cert.context("a certificate of the bundle")?)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    // Every connection a full handshake: a resumed one would show the certificate of the
    // session it resumes, not the one served now.
    config.resumption = rustls::client::Resumption::disabled();
    Ok(Arc::new(config))
}

/// One request to the injector at `addr` as `server_name`, over TLS with `client`: the status,
/// the body, and the certificate the server presented (DER).
pub async fn request(
    addr: SocketAddr,
    client: Arc<rustls::ClientConfig>,
    server_name: &str,
    method: &str,
    path: &str,
    body: Vec<u8>,
) -> anyhow::Result<(u16, Bytes, Vec<u8>)> {
    let tcp = tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr))
        .await
        .context("connect timed out")??;
    let connector = tokio_rustls::TlsConnector::from(client);
    let name = ServerName::try_from(server_name.to_string())?;
    let tls = tokio::time::timeout(Duration::from_secs(5), connector.connect(name, tcp))
        .await
        .context("TLS handshake timed out")??;
    let (_, session) = tls.get_ref();
    let presented = session
        .peer_certificates()
        .and_then(|certs| certs.first())
        .map(|cert| cert.to_vec())
        .unwrap_or_default();
    let h2 = session.alpn_protocol() == Some(b"h2");
    let request = http::Request::builder()
        .method(method)
        .uri(format!("https://{server_name}{path}"))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))?;
    let io = TokioIo::new(tls);
    let response = if h2 {
        let (mut sender, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
        tokio::spawn(conn);
        sender.send_request(request).await?
    } else {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
        tokio::spawn(conn);
        sender.send_request(request).await?
    };
    let status = response.status().as_u16();
    let body = tokio::time::timeout(Duration::from_secs(10), response.into_body().collect())
        .await
        .context("the response body timed out")??
        .to_bytes();
    Ok((status, body, presented))
}

/// An AdmissionReview request for `object` (a Pod's JSON) as the API server sends it.
pub fn review(operation: &str, namespace: &str, object: &Value, dry_run: bool) -> Value {
    serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": object["metadata"]["name"].as_str().unwrap_or_default(),
            "namespace": namespace,
            "operation": operation,
            "userInfo": {
                "username": "system:serviceaccount:kube-system:replicaset-controller",
                "uid": "3a7e2e2c-0000-0000-0000-000000000000",
                "groups": ["system:serviceaccounts", "system:authenticated"]
            },
            "object": object,
            "oldObject": if operation == "UPDATE" { object.clone() } else { Value::Null },
            "dryRun": dry_run,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
        }
    })
}

/// The response of a review: its `response`, and the object with its patch applied (the
/// object itself when there is none).
pub fn outcome(answer: &[u8], object: &Value) -> anyhow::Result<(Value, Value)> {
    let review: Value = serde_json::from_slice(answer).context("the answer is not JSON")?;
    let response = review["response"].clone();
    if review["kind"] != "AdmissionReview" || response.is_null() {
        bail!("not an AdmissionReview response: {review}");
    }
    let mut patched = object.clone();
    if !response["patch"].is_null() {
        if response["patchType"] != "JSONPatch" {
            bail!("patchType {} is not JSONPatch", response["patchType"]);
        }
        // `[]byte` on the wire: base64, as k8s-openapi's ByteString reads it.
        let bytes: k8s_openapi::ByteString = serde_json::from_value(response["patch"].clone())?;
        let ops: json_patch::Patch = serde_json::from_slice(&bytes.0)?;
        json_patch::patch(&mut patched, &ops)?;
    }
    Ok((response, patched))
}
