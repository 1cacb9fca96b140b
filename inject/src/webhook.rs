//! `lattice webhook`: the injector's process. It sets up what the API server needs to call it
//! (the Secret with its certificate, the CA bundle: [`lattice_inject::setup`]), or reads a
//! certificate it is given (cert-manager's), serves reviews over HTTPS
//! ([`lattice_inject::server`]), and checks again every `--recheck-secs`, serving a renewed
//! certificate from the next handshake on. SIGTERM or SIGINT: it stops accepting, lets open
//! reviews finish, and exits.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use lattice_inject::review::Policy;
use lattice_inject::server::{self, CertSlot, Metrics, Shared};
use lattice_inject::setup::{self, Target};
use tokio_util::sync::CancellationToken;

use crate::Template;

#[derive(Args)]
pub struct WebhookArgs {
    /// Where to serve HTTPS.
    #[arg(long, env = "LATTICE_INJECTOR_LISTEN", default_value = "0.0.0.0:8443")]
    listen: SocketAddr,
    /// The injector's namespace (its Service's and its Secret's); its pods, and those of the
    /// cluster's system namespaces, are never injected.
    #[arg(long, env = "POD_NAMESPACE", default_value = "lattice-system")]
    namespace: String,
    /// The Service the API server calls: the serving certificate's names.
    #[arg(long, default_value = "lattice-injector")]
    service: String,
    /// The Secret that holds the CA and the serving certificate.
    #[arg(long, default_value = "lattice-injector-tls")]
    secret: String,
    /// The MutatingWebhookConfiguration whose webhooks get the CA bundle.
    #[arg(long, default_value = "lattice-injector")]
    webhook_configuration: String,
    /// Serve this certificate (PEM, with its chain) instead of issuing one: for a certificate
    /// from cert-manager, whose CA injector then fills the bundle. Needs --tls-key-file.
    #[arg(long, requires = "tls_key_file")]
    tls_cert_file: Option<PathBuf>,
    /// The key of --tls-cert-file (PEM).
    #[arg(long, requires = "tls_cert_file")]
    tls_key_file: Option<PathBuf>,
    /// How often the certificate (and the bundle) are checked again.
    #[arg(long, default_value_t = 3600)]
    recheck_secs: u64,
    /// Log as JSON lines (`json`) or text (`text`).
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    /// Check the flags (and the Kubernetes client configuration) and exit.
    #[arg(long)]
    check_config: bool,
    #[command(flatten)]
    template: Template,
}

/// Where the certificate comes from.
enum Source {
    Issued {
        client: kube::Client,
        target: Target,
    },
    Files {
        cert: PathBuf,
        key: PathBuf,
    },
}

impl Source {
    /// The certificate and key to serve now (issued or renewed if due), and whether the API
    /// server can verify them (the bundle written).
    async fn current(&self) -> anyhow::Result<(String, String)> {
        match self {
            Source::Issued { client, target } => {
                let (chain, _) = setup::ensure_chain(client, target).await?;
                setup::ensure_bundle(client, target, &chain.ca_cert).await?;
                Ok((chain.cert, chain.key))
            }
            Source::Files { cert, key } => Ok((
                std::fs::read_to_string(cert)
                    .with_context(|| format!("reading {}", cert.display()))?,
                std::fs::read_to_string(key)
                    .with_context(|| format!("reading {}", key.display()))?,
            )),
        }
    }
}

pub fn run(args: WebhookArgs) -> anyhow::Result<()> {
    let subscriber = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        );
    if args.log_format == "json" {
        subscriber.json().init();
    } else {
        subscriber.init();
    }
    if args.recheck_secs == 0 {
        bail!("--recheck-secs must be at least 1");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(serve(args))
}

async fn serve(args: WebhookArgs) -> anyhow::Result<()> {
    let target = Target {
        namespace: args.namespace.clone(),
        service: args.service.clone(),
        secret: args.secret.clone(),
        webhook_configuration: args.webhook_configuration.clone(),
    };
    let source = match (&args.tls_cert_file, &args.tls_key_file) {
        (Some(cert), Some(key)) => Source::Files {
            cert: cert.clone(),
            key: key.clone(),
        },
        _ => {
            let config = kube::Config::infer()
                .await
                .context("no Kubernetes client configuration (in-cluster or KUBECONFIG)")?;
            // Building the client contacts nothing: --check-config can still stop below.
            let client =
                kube::Client::try_from(config).context("building the Kubernetes client")?;
            Source::Issued { client, target }
        }
    };
    if args.check_config {
        println!("lattice webhook: configuration ok");
        return Ok(());
    }
    let mut template = args.template.clone();
    if template.image.is_none()
        && let Source::Issued { client, .. } = &source
    {
        template.image = own_image(client, &args.namespace).await;
    }
    let policy = Arc::new(Policy {
        config: template.config(),
        own_namespace: args.namespace.clone(),
    });
    tracing::info!(image = %policy.config.image, envoy_image = %policy.config.envoy_image, "injecting");
    let shutdown = CancellationToken::new();
    let signals = signals(shutdown.clone());
    let ready = Arc::new(AtomicBool::new(false));
    // The first certificate before anything is served; the bundle is retried until written.
    let (cert, key) = first_certificate(&source, &shutdown).await?;
    let slot = CertSlot::new(&cert, &key)?;
    let metrics = Metrics::new();
    metrics.serving(&cert);
    ready.store(true, Ordering::Release);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    tracing::info!(addr = %listener.local_addr()?, namespace = %args.namespace, "lattice webhook serving");
    let shared = Shared {
        policy,
        metrics: metrics.clone(),
        ready,
    };
    let server = tokio::spawn(server::serve(
        listener,
        slot.server_config(),
        shared,
        shutdown.clone(),
    ));
    let recheck = Duration::from_secs(args.recheck_secs);
    loop {
        tokio::select! {
            () = tokio::time::sleep(recheck) => {}
            () = shutdown.cancelled() => break,
        }
        match source.current().await {
            Ok((cert, key)) => match slot.replace(&cert, &key) {
                Ok(()) => metrics.serving(&cert),
                Err(e) => {
                    tracing::warn!(error = %e, "the renewed certificate cannot be served; keeping the current one");
                }
            },
            Err(e) => {
                tracing::warn!(error = %e, "checking the certificate failed; trying again later")
            }
        }
    }
    let _ = server.await;
    signals.abort();
    tracing::info!("lattice webhook stopped");
    Ok(())
}

/// The image this pod runs `lattice` from (`POD_NAME` from the downward API names the pod):
/// lattice-init is in the same image, so an overlay that moves the image to another registry
/// moves what is injected with it. `None` when it cannot be read.
async fn own_image(client: &kube::Client, namespace: &str) -> Option<String> {
    let name = std::env::var("POD_NAME").ok().filter(|n| !n.is_empty())?;
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
        kube::Api::namespaced(client.clone(), namespace);
    match pods.get(&name).await {
        Ok(pod) => {
            let containers = pod.spec.map(|s| s.containers).unwrap_or_default();
            let runs_lattice = |c: &&k8s_openapi::api::core::v1::Container| {
                c.command
                    .as_ref()
                    .and_then(|c| c.first())
                    .is_some_and(|p| p == "lattice")
            };
            let image = containers
                .iter()
                .find(runs_lattice)
                .or(containers.first())
                .and_then(|c| c.image.clone());
            if image.is_none() {
                tracing::warn!(pod = %name, "this pod names no image: injecting the default");
            }
            image
        }
        Err(e) => {
            tracing::warn!(pod = %name, error = %e, "cannot read this pod for its image: injecting the default");
            None
        }
    }
}

/// The certificate to start with, retried with backoff while the cluster is not ready for it
/// (the webhook configuration not installed yet, the API unreachable), until shutdown.
async fn first_certificate(
    source: &Source,
    shutdown: &CancellationToken,
) -> anyhow::Result<(String, String)> {
    let mut delay = Duration::from_millis(200);
    loop {
        match source.current().await {
            Ok(found) => return Ok(found),
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?delay, "cannot set up the webhook's certificate yet");
            }
        }
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = shutdown.cancelled() => bail!("shut down before the certificate was set up"),
        }
        delay = (delay * 2).min(Duration::from_secs(10));
    }
}

/// Cancels `shutdown` on SIGTERM or SIGINT.
fn signals(shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::info!("shutting down: finishing open reviews");
        shutdown.cancel();
    })
}
