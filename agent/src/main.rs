//! `lattice-agent`: the node agent binary. Reads its configuration, binds every socket first
//! (so a bad address fails start-up, not a request later), starts the source, the pipeline
//! and the servers, and shuts them down in order on SIGTERM or Ctrl-C.

use std::net::IpAddr;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use lattice_agent::admin::{AdminServer, AdminState};
use lattice_agent::catalog::{Catalog, Feed};
use lattice_agent::config::{AgentConfig, LogFormat, ProxyScope};
use lattice_agent::identity::{self, IdentityCheck};
use lattice_agent::mesh::locality::{ZoneSource, place_name};
use lattice_agent::mesh::{self, NodeLocality, Provider};
use lattice_agent::metrics::Metrics;
use lattice_agent::node_local_address::{self, NodeLocalAddress};
use lattice_agent::readiness::Readiness;
use lattice_agent::scope::{ScopeRegistry, ScopeStore, ScopedPod};
use lattice_agent::source::{self, file::FileSource, kube::KubeSourceConfig};
use lattice_agent::translate::envoy::ExternalDns;
use lattice_agent::translate::pipeline::Pipeline;
use lattice_agent::xds::{AdsService, Limits, ProxyRegistry, XdsServer};
use lattice_dns::{DnsConfig, DnsServer};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// jemalloc instead of glibc's malloc: it hands freed memory back to the system (glibc's arenas
/// keep the peak of the initial sync for the agent's life), and fragments less under many
/// threads allocating buffers of every size.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read once at its start: a background thread returns freed pages to the
/// system within about a second (`dirty_decay_ms`), and at once past that (`muzzy_decay_ms:0`),
/// instead of keeping them ten seconds and only while the agent allocates. At 10k services
/// with 100 proxies that took the RSS after the initial sync and the changes from 211–216 MiB
/// to 186 MiB (docs/benchmarks.md, version H). `_RJEM_MALLOC_CONF` in the environment still
/// overrides it.
///
/// jemalloc reads this C string through the symbol `malloc_conf` (prefixed `_rjem_` by
/// tikv-jemalloc-sys); exporting a symbol is what `unsafe_code` denies, and this one is the
/// documented way to configure jemalloc at build time.
#[allow(unsafe_code)]
#[unsafe(export_name = "_rjem_malloc_conf")]
static JEMALLOC_CONF: &[u8; 60] = b"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0\0";

fn main() -> ExitCode {
    let config = AgentConfig::parse();
    if let Some(Err(error)) = config.node_zone.as_deref().map(place_name) {
        use clap::CommandFactory as _;
        AgentConfig::command()
            .error(
                clap::error::ErrorKind::ValueValidation,
                format!("invalid value for --node-zone: {error}"),
            )
            .exit();
    }
    init_logging(config.log_format);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            tracing::error!(%error, "cannot start the async runtime");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            let text = report(error.as_ref());
            // In the log (JSON when asked for), and plainly, whatever RUST_LOG filters.
            tracing::error!("{text}");
            eprintln!("lattice-agent: {text}");
            ExitCode::FAILURE
        }
    }
}

/// An error and its causes on one line. The crate's errors already say their cause in their
/// message, so a cause is added only when the text so far does not hold it yet (anyhow's
/// `{:#}` would print it twice).
fn report(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = String::new();
    for cause in std::iter::successors(Some(error), |e| e.source()) {
        let cause = cause.to_string();
        if text.contains(&cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause);
    }
    text
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn run(config: AgentConfig) -> anyhow::Result<()> {
    let upstreams = if config.upstream_dns.is_empty() {
        lattice_dns::upstreams_from_resolv_conf(Path::new("/etc/resolv.conf"))?
    } else {
        config.upstream_dns.clone()
    };
    tracing::info!(
        config = %serde_json::to_string(&config).unwrap_or_default(),
        upstream_dns = ?upstreams,
        "lattice-agent starting"
    );

    // Providers, in rank order: Kubernetes first, then the mesh files as given. Every file
    // is loaded now, so a bad one fails start-up.
    let kubernetes = match config.watches_kubernetes() {
        true => Some(kube::Client::try_default().await.context(
            "cannot configure the Kubernetes client (no in-cluster config and no usable \
             KUBECONFIG); pass --mesh-file without --kubernetes to run without a cluster",
        )?),
        false => None,
    };
    let mut files = Vec::with_capacity(config.mesh_files.len());
    for (i, path) in config.mesh_files.iter().enumerate() {
        if config.mesh_files[..i].contains(path) {
            anyhow::bail!("--mesh-file {} is given twice", path.display());
        }
        files.push(FileSource::load(path, config.trap_cidr.clone())?);
    }
    node_local_address::check_dns_addr(config.dns_addr, config.node_local_dns)?;
    if config.check_config {
        println!("configuration is valid");
        return Ok(());
    }

    let shutdown = CancellationToken::new();
    let metrics = Metrics::new();
    let proxies = ProxyRegistry::default();
    let readiness = Readiness::new();
    let xds_ready = readiness.register("xds server");
    let dns_ready = readiness.register("dns server");
    // With Kubernetes and a node name, streams are checked against this node's pods: not
    // ready until they are listed.
    let mut pods_ready = kubernetes
        .as_ref()
        .and(config.node_name.as_ref())
        .map(|_| readiness.register("this node's pods"));
    let (mesh_tx, mesh_rx) = mesh::channel();
    let (locality_tx, locality_rx) = tokio::sync::watch::channel(None);
    let zone_lookup = match node_locality(&config, kubernetes.is_some()) {
        Some(locality) => {
            locality_tx.send_replace(Some(locality));
            None
        }
        None => Some(readiness.register("this node's zone")),
    };
    let (pipeline, published) = Pipeline::new(
        mesh_rx.clone(),
        locality_rx.clone(),
        config.debounce(),
        metrics.xds.clone(),
        metrics.mesh.clone(),
        &readiness,
    );
    let external_dns = ExternalDns {
        resolver: config.envoy_dns_resolver(),
    };
    tracing::info!(resolver = ?external_dns.resolver, "external services' host names are resolved by Envoy through this DNS server (None: the pod's resolv.conf)");
    let pipeline = pipeline.with_external_dns(external_dns);

    // Bind everything before serving anything. The DNS and xDS servers may bind on the
    // node-local address, so it must exist first. Dropped on an early return, it removes
    // itself.
    let node_dns = match config.node_local_dns {
        Some(address) => Some(NodeLocalAddress::install(address).await?),
        None => None,
    };
    let xds_listener = tokio::net::TcpListener::bind(config.xds_addr)
        .await
        .with_context(|| {
            format!(
                "cannot bind the xDS server on {} (--xds-addr)",
                config.xds_addr
            )
        })?;
    if reachable_off_node(config.xds_addr.ip()) {
        tracing::warn!(
            xds = %config.xds_addr,
            "the xDS server is bound to an address other hosts may reach: anyone who reaches it \
             can read the mesh. Bind it to loopback or to the node-local address (--xds-addr)"
        );
    }
    let mut dns_config = DnsConfig::new(config.dns_addr, upstreams);
    dns_config.ttl = config.dns_ttl;
    let mut dns = DnsServer::bind(dns_config, published.names, metrics.dns.clone()).await?;
    // Proxies hold what their pods use only when pods can be told apart: identity checking.
    let scopes = (kubernetes.is_some()
        && config.node_name.is_some()
        && config.proxy_scope == ProxyScope::Used)
        .then(|| {
            let registry = ScopeRegistry::new(
                Duration::from_millis(config.scope_wait_ms),
                metrics.scope.clone(),
            );
            Arc::new(match config.state_dir.as_deref().map(ScopeStore::open) {
                Some(Ok(store)) => registry.with_store(store),
                Some(Err(error)) => {
                    tracing::warn!(%error, "pod scopes are kept in memory only: an agent restart drops what pods resolved");
                    registry
                }
                None => registry,
            })
        });
    if let Some(scopes) = &scopes {
        dns = dns.with_observer(Arc::new(ScopeObserver(scopes.clone())));
        tracing::info!(
            wait_ms = config.scope_wait_ms,
            "each verified proxy holds the services its pod resolves or declares (--proxy-scope used)"
        );
    }
    let mut feeds = Vec::new();
    let (kube_tx, kube_rx) = mesh::provider::channel();
    if kubernetes.is_some() {
        feeds.push(Feed {
            provider: Provider::kubernetes(),
            reports: kube_rx,
        });
    }
    let mut file_txs = Vec::with_capacity(files.len());
    for file in &files {
        let (tx, rx) = mesh::provider::channel();
        feeds.push(Feed {
            provider: file.provider(),
            reports: rx,
        });
        file_txs.push(tx);
    }
    let (catalog, catalog_status) = Catalog::new(
        config.trap_cidr.clone(),
        feeds,
        &readiness,
        metrics.mesh.clone(),
    );
    let admin_state = AdminState {
        mesh: mesh_rx,
        catalog: catalog_status,
        node: locality_rx.clone(),
        metrics: metrics.clone(),
        proxies: proxies.clone(),
        readiness,
    };
    let admin = AdminServer::bind(config.admin_addr, admin_state)
        .await
        .with_context(|| {
            format!(
                "cannot bind the admin server on {} (--admin-addr)",
                config.admin_addr
            )
        })?;
    tracing::info!(
        xds = %xds_listener.local_addr()?,
        dns = %dns.local_addr(),
        admin = %admin.local_addr()?,
        "listening"
    );

    let mut tasks: JoinSet<anyhow::Result<&'static str>> = JoinSet::new();
    let identity = match (&kubernetes, &config.node_name) {
        (Some(client), Some(node)) => {
            let (pods_tx, pods_rx) = identity::channel();
            let pods_ready = pods_ready.take();
            let (client, node, token) = (client.clone(), node.clone(), shutdown.clone());
            tasks.spawn(async move {
                let mut synced = pods_tx.subscribe();
                let announce = async move {
                    let _ = synced.wait_for(Option::is_some).await;
                    drop(pods_ready);
                    std::future::pending::<()>().await
                };
                tokio::select! {
                    () = source::kube::pods::watch_pods(client, node, pods_tx, token) => {},
                    () = announce => {},
                }
                Ok("pod watch")
            });
            if let Some(scopes) = &scopes {
                tasks.spawn(follow_pods(scopes.clone(), pods_rx.clone()));
            }
            IdentityCheck::Pods {
                pods: pods_rx,
                allow_host_network: config.allow_host_network_proxies,
            }
        }
        (Some(_), None) => {
            tracing::warn!(
                "no --node-name (env NODE_NAME): proxy identity checking is off, and any \
                 client that reaches the xDS address is served the whole mesh"
            );
            IdentityCheck::Off
        }
        (None, _) => IdentityCheck::Off,
    };
    if let (Some(ready), Some(client), Some(node)) = (zone_lookup, &kubernetes, &config.node_name) {
        let (client, node, token) = (client.clone(), node.clone(), shutdown.clone());
        let mut known = locality_rx.clone();
        tasks.spawn(async move {
            let announce = async move {
                let _ = known.wait_for(Option::is_some).await;
                drop(ready);
                std::future::pending::<()>().await
            };
            tokio::select! {
                () = source::kube::node::read_zone(client, node, locality_tx, token.clone()) => {},
                () = announce => {},
            }
            // Read once: done, but the agent is not.
            token.cancelled().await;
            Ok("node zone lookup")
        });
    }
    for (file, tx) in files.into_iter().zip(file_txs) {
        let token = shutdown.clone();
        tasks.spawn(async move {
            file.run(tx, token).await?;
            Ok("mesh-file source")
        });
    }
    if let Some(client) = kubernetes {
        let kube_config = KubeSourceConfig {
            namespaces: config.namespaces.clone(),
            trap: config.trap_cidr.clone(),
        };
        let token = shutdown.clone();
        tasks.spawn(async move {
            source::kube::run(client, kube_config, kube_tx, token).await?;
            Ok("kubernetes source")
        });
    }
    let token = shutdown.clone();
    tasks.spawn(async move {
        catalog.run(mesh_tx, token).await;
        Ok("catalog")
    });
    let token = shutdown.clone();
    tasks.spawn(async move {
        pipeline.run(token).await;
        Ok("pipeline")
    });
    let token = shutdown.clone();
    tasks.spawn(async move {
        drop(dns_ready);
        dns.run(token).await?;
        Ok("dns server")
    });
    let token = shutdown.clone();
    tasks.spawn(async move {
        admin.run(token).await?;
        Ok("admin server")
    });
    let xds = XdsServer::new(
        published.xds,
        metrics.xds.clone(),
        proxies,
        shutdown.clone(),
    )
    .with_identity(identity)
    .with_limits(Limits {
        max_names: config.xds_max_names,
    });
    let xds = match &scopes {
        Some(scopes) => xds.with_scopes(scopes.clone()),
        None => xds,
    };
    let token = shutdown.clone();
    tasks.spawn(async move {
        drop(xds_ready);
        tonic::transport::Server::builder()
            .add_service(AdsService::new(xds))
            .serve_with_incoming_shutdown(
                lattice_agent::xds::connection::incoming(xds_listener),
                token.cancelled_owned(),
            )
            .await?;
        Ok("xds server")
    });

    let mut failure = None;
    tokio::select! {
        signal = shutdown_signal() => tracing::info!(signal, "shutting down"),
        Some(done) = tasks.join_next() => {
            failure = Some(match done {
                Ok(Ok(name)) => anyhow::anyhow!("{name} stopped unexpectedly"),
                Ok(Err(error)) => error,
                Err(join) => anyhow::anyhow!("a task panicked: {join}"),
            });
        }
    }
    shutdown.cancel();
    while let Some(done) = tasks.join_next().await {
        if let Ok(Err(error)) = done {
            tracing::warn!("{}", report(error.as_ref()));
        }
    }
    if let Some(node_dns) = node_dns
        && let Err(error) = node_dns.remove().await
    {
        tracing::warn!("{}", report(&error));
    }
    match failure {
        Some(error) => Err(error),
        None => {
            tracing::info!("stopped");
            Ok(())
        }
    }
}

/// This node's locality when it is known without asking Kubernetes: from `--node-zone`, or
/// unknown when there is no Node to read (`None`: read the Node's zone label).
fn node_locality(config: &AgentConfig, kubernetes: bool) -> Option<NodeLocality> {
    let name = config.node_name.as_deref().map(std::sync::Arc::from);
    // --node-zone was checked in main: an invalid one never gets here.
    if let Some(zone) = config.node_zone.as_deref().and_then(|z| place_name(z).ok()) {
        tracing::info!(%zone, "this node's zone, from --node-zone");
        return Some(NodeLocality::with_zone(name, zone, ZoneSource::Flag));
    }
    if kubernetes && name.is_some() {
        return None;
    }
    let why = if kubernetes {
        "no --node-zone, and no --node-name to read the Node's zone label"
    } else {
        "no --node-zone (NODE_ZONE)"
    };
    tracing::info!(
        "this node's zone is unknown ({why}): services are served without a zone preference"
    );
    Some(NodeLocality::without_zone(name, why))
}

/// Whether hosts other than this one may reach `ip`: anything but loopback and link-local
/// (the node-local address is link-local, so no router forwards to it).
fn reachable_off_node(ip: std::net::IpAddr) -> bool {
    match ip.to_canonical() {
        std::net::IpAddr::V4(v4) => !(v4.is_loopback() || v4.is_link_local()),
        std::net::IpAddr::V6(v6) => !(v6.is_loopback() || v6.is_unicast_link_local()),
    }
}

async fn shutdown_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers the agent can still be killed; it just cannot drain.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}

/// Keeps the scope registry's pods those of this node: a pod that goes loses its scope, a new
/// one starts with what it declares. Host-network pods are not scoped (their address is the
/// node's, shared).
async fn follow_pods(
    scopes: Arc<ScopeRegistry>,
    mut pods: identity::PodsRx,
) -> anyhow::Result<&'static str> {
    loop {
        let directory = pods.borrow_and_update().clone();
        if let Some(directory) = directory {
            scopes.set_pods(directory.entries().filter_map(ScopedPod::of));
        }
        if pods.changed().await.is_err() {
            return Ok("pod scopes");
        }
    }
}

/// The DNS server's lookups, reported to the scope registry.
struct ScopeObserver(Arc<ScopeRegistry>);

impl lattice_dns::LookupObserver for ScopeObserver {
    fn looked_up(&self, client: IpAddr, scope: &Arc<str>) -> Option<lattice_dns::Hold> {
        self.0
            .resolved(client, scope)
            .map(|wait| Box::pin(wait) as lattice_dns::Hold)
    }
}
