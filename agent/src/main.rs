//! `lattice-agent`: the node agent binary. Reads its configuration, binds every socket first
//! (so a bad address fails start-up, not a request later), starts the source, the pipeline
//! and the servers, and shuts them down in order on SIGTERM or Ctrl-C.
//!
//! A rolling upgrade runs two agents on a node for a while: the new one binds beside the old
//! (every socket the pods reach is shared with SO_REUSEPORT, see `lattice_dns::handoff`), takes
//! traffic once it is ready, and is then marked ready itself; the kubelet then sends the old
//! one SIGTERM, on which it drains: its DNS sockets and xDS listeners leave the ports' selection
//! without losing what they queued, every DNS query it received is answered, its TCP
//! connections close without a reset, and its ADS streams end so each Envoy reconnects, to the
//! new agent, keeping its configuration meanwhile. Then it exits, leaving the node-local
//! address to the new one.

use std::net::IpAddr;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use lattice_agent::admin::{self, AdminServer, AdminState};
use lattice_agent::catalog::{AddressRecordFile, Catalog, Feed, LastMeshFile};
use lattice_agent::config::{
    AgentConfig, LogFormat, PathClaimRule, ProxyScope, RequestBytes, XdsLimitFlags,
};
use lattice_agent::identity::{self, IdentityCheck};
use lattice_agent::mesh::locality::{ZoneSource, place_name};
use lattice_agent::mesh::{self, NodeLocality, Provider};
use lattice_agent::metrics::Metrics;
use lattice_agent::node_local_address;
use lattice_agent::readiness::Readiness;
use lattice_agent::scope::{ScopeRegistry, ScopeStore, ScopedPod};
use lattice_agent::source::{self, file::FileSource, kube::KubeSourceConfig};
use lattice_agent::translate::envoy::ExternalDns;
use lattice_agent::translate::pipeline::Pipeline;
use lattice_agent::trust::{Authority, LeafPolicy, NodeSecrets, SecretRef, switch_mesh_mtls};
use lattice_agent::xds::{
    AdsService, Caps, Limits, ProxyRegistry, RequestBound, XdsLimits, XdsServer,
};
use lattice_dns::handoff::{self, BoundTcp};
use lattice_dns::{DnsConfig, DnsServer};
use tokio::sync::watch;
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
/// to 186 MiB (docs/benchmarks.md, "Agent memory"). `_RJEM_MALLOC_CONF` in the environment still
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
    if let (Some(path), Some(socket)) = (&config.probe, &config.admin_socket) {
        return match admin::probe(socket, path) {
            Ok(body) => {
                print!("{body}");
                ExitCode::SUCCESS
            }
            Err(error) => {
                println!("{error}");
                ExitCode::FAILURE
            }
        };
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
    for (i, path) in config.mesh_files.iter().enumerate() {
        if config.mesh_files[..i].contains(path) {
            anyhow::bail!("--mesh-file {} is given twice", path.display());
        }
    }
    // Where mesh files' copies are kept; a check reads every file, never a copy of one.
    let copies_dir = config.state_dir.clone().filter(|_| !config.check_config);
    // Before any copy is written: nothing is served yet, and removing a few files is quick.
    if let Some(dir) = &copies_dir {
        match source::file::prune_copies(dir, &config.mesh_files) {
            Ok(0) => {}
            Ok(removed) => tracing::info!(
                removed,
                "mesh-file copies of files no longer given removed from the state directory"
            ),
            Err(error) => {
                tracing::warn!(%error, "cannot remove mesh-file copies of files no longer given")
            }
        }
    }
    // Off the runtime, and all at once: a file's items parse on every core, but cutting
    // them out and taking them into the file's mesh do not, and leave a core to the next
    // file. An error names the first file, in the order given, that has one.
    let loading: Vec<_> = config
        .mesh_files
        .iter()
        .map(|path| {
            let (path, trap, limits) = (
                path.clone(),
                config.trap_cidr.clone(),
                mesh_file_limits(&config),
            );
            let state_dir = copies_dir.clone();
            tokio::task::spawn_blocking(move || {
                FileSource::load(&path, trap, limits, state_dir.as_deref())
            })
        })
        .collect();
    let mut files = Vec::with_capacity(loading.len());
    for load in loading {
        files.push(load.await.context("loading a mesh file")??);
    }
    node_local_address::check_dns_addr(config.dns_addr, config.node_local_dns)?;
    if config.check_config {
        println!("configuration is valid");
        return Ok(());
    }

    // Cancelled first, on SIGTERM: the servers the pods reach stop taking work and finish
    // what they hold. Then `shutdown` stops everything else.
    let drain = CancellationToken::new();
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
    // Whether calls to meshed pods' services are mutual TLS: only where proxies are served
    // secrets, and then once the CA is read and as long as there is one (below).
    let (mesh_mtls_tx, mesh_mtls_rx) = watch::channel((!serves_secrets(&config)).then_some(false));
    let pipeline = pipeline
        .with_external_dns(external_dns)
        .with_capture_port(config.envoy_port)
        .with_inbound_listeners(serves_secrets(&config))
        .with_mesh_mtls(mesh_mtls_rx)
        .with_trust_domain(&config.trust_domain);

    // Bind everything before serving anything. The DNS and xDS servers may bind on the
    // node-local address, so it must exist first; it stays when the agent stops, for the agent
    // that follows.
    if let Some(address) = config.node_local_dns {
        node_local_address::install(address).await?;
    }
    let xds_context = || {
        format!(
            "cannot bind the xDS server on {} (--xds-addr)",
            config.xds_addr
        )
    };
    let xds_beside = handoff::tcp_in_use(config.xds_addr).with_context(xds_context)?;
    let xds_sockets =
        BoundTcp::bind(config.xds_addr, &handoff::online_cpus()).with_context(xds_context)?;
    if reachable_off_node(config.xds_addr.ip()) {
        tracing::warn!(
            xds = %config.xds_addr,
            "the xDS server is bound to an address other hosts may reach: anyone who reaches it \
             can read the mesh. Bind it to loopback or to the node-local address (--xds-addr)"
        );
    }
    if handoff::kernel_steers() == Some(false) && !handoff::migrates_requests() {
        tracing::warn!(
            "this kernel (before 6.1) cannot steer new connections away from a draining agent, \
             and net.ipv4.tcp_migrate_req is not 1: in an upgrade, a DNS or xDS connection that \
             arrives as the old agent closes its listeners may be reset. Set the sysctl on the node"
        );
    }
    let mut dns_config = DnsConfig::new(config.dns_addr, upstreams);
    dns_config.ttl = config.dns_ttl;
    dns_config.cache_entries = config.dns_cache_entries;
    dns_config.cache_bytes = config.dns_cache_bytes;
    dns_config.cache_entries_per_source = config.dns_cache_entries_per_source;
    // The zone's name server is the address pods reach this server at.
    if let Some(address) = config.node_local_dns {
        dns_config.nameserver = Some(address);
    }
    dns_config.forwards = config.dns_forwards;
    dns_config.forwards_per_source = config.dns_forwards_per_source;
    dns_config.refusals_per_source = config.dns_refusals_per_source;
    dns_config.tcp_connections = config.dns_tcp_connections;
    dns_config.tcp_connections_per_source = config.dns_tcp_connections_per_source;
    dns_config.tcp_idle_timeout = Duration::from_secs(config.dns_tcp_idle_timeout_secs);
    dns_config.tcp_lifetime = Duration::from_secs(config.dns_tcp_lifetime_secs);
    dns_config.tcp_pipeline = config.dns_tcp_pipeline;
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
            Arc::new(match config
                .state_dir
                .as_deref()
                .map(|dir| ScopeStore::open(&dir.join("scopes"))) {
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
    let (mut catalog, catalog_status) = Catalog::new(
        config.trap_cidr.clone(),
        feeds,
        &readiness,
        metrics.mesh.clone(),
    );
    if let Some(dir) = &config.state_dir {
        let (record, book) = AddressRecordFile::load(dir, &config.trap_cidr, metrics.mesh.clone());
        catalog = catalog
            .with_address_record(record, book)
            .with_last_mesh(LastMeshFile::in_dir(dir));
    }
    // The signer of workload certificates: Istio's certificate service where one is named,
    // else the CA's Secret where the agent watches Kubernetes.
    let istio_ca = config.istio_ca();
    let authority = Arc::new(Authority::new(
        config.trust_domain.clone(),
        kubernetes
            .as_ref()
            .filter(|_| istio_ca.is_none())
            .map(|_| SecretRef {
                namespace: config.ca_secret.0.clone(),
                name: config.ca_secret.1.clone(),
            }),
        metrics.trust.clone(),
    ));
    // Workload certificates, served over SDS to the proxies verified as this node's pods: only
    // where pods are checked (Kubernetes and a node name).
    let secrets = serves_secrets(&config).then(|| {
        let policy = LeafPolicy {
            lifetime: Duration::from_secs(config.leaf_lifetime_secs),
            ..LeafPolicy::default()
        };
        NodeSecrets::new(config.trust_domain.clone(), policy, metrics.trust.clone())
    });
    let admin_state = AdminState {
        mesh: mesh_rx.clone(),
        catalog: catalog_status.clone(),
        node: locality_rx.clone(),
        metrics: metrics.clone(),
        proxies: proxies.clone(),
        readiness: readiness.clone(),
        authority: authority.clone(),
        secrets: secrets.clone(),
    };
    let admin = AdminServer::bind(
        config.admin_addr,
        config.admin_socket.as_deref(),
        admin_state,
    )
    .await
    .with_context(|| {
        format!(
            "cannot bind the admin server on {} (--admin-addr)",
            config.admin_addr
        )
    })?;
    tracing::info!(
        xds = %xds_sockets.local_addr(),
        dns = %dns.local_addr(),
        admin = %admin.local_addr()?,
        "listening"
    );

    let mut tasks: JoinSet<anyhow::Result<&'static str>> = JoinSet::new();
    if let (Some(client), Some(secret)) = (&kubernetes, authority.secret()) {
        let (client, secret, authority, token) = (
            client.clone(),
            secret.clone(),
            authority.clone(),
            shutdown.clone(),
        );
        tasks.spawn(async move {
            source::kube::ca::watch_ca(client, secret, authority, token).await;
            Ok("issuer watch")
        });
    }
    if let Some(ca) = istio_ca {
        let (authority, token) = (authority.clone(), shutdown.clone());
        tasks.spawn(async move {
            lattice_agent::trust::follow_roots(Arc::new(ca), authority, token).await;
            Ok("certificate service roots")
        });
    }
    if secrets.is_some() {
        let (authority, waiting, metrics, token) = (
            authority.subscribe(),
            readiness.register("the workload CA"),
            metrics.trust.clone(),
            shutdown.clone(),
        );
        tasks.spawn(async move {
            let known = move || drop(waiting);
            switch_mesh_mtls(authority, mesh_mtls_tx, known, metrics, token).await;
            Ok("mesh mTLS switch")
        });
    }
    if let Some(secrets) = &secrets {
        let (secrets, authority, token) =
            (secrets.clone(), authority.subscribe(), shutdown.clone());
        tasks.spawn(async move {
            secrets.run(authority, token).await;
            Ok("workload certificates")
        });
    }
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
        let file = file.with_metrics(metrics.mesh.clone());
        tasks.spawn(async move {
            file.run(tx, token).await?;
            Ok("mesh-file source")
        });
    }
    if let Some(client) = kubernetes {
        let kube_config = KubeSourceConfig {
            namespaces: config.namespaces.clone(),
            trap: config.trap_cidr.clone(),
            path_claims: match config.path_claims {
                PathClaimRule::Granted => source::kube::PathClaims::Granted,
                PathClaimRule::Any => source::kube::PathClaims::Any,
            },
            path_grants: config.path_grants.clone(),
            rollback_check: (config.kube_rollback_check_secs > 0)
                .then(|| Duration::from_secs(config.kube_rollback_check_secs)),
            trust_domain: serves_secrets(&config).then(|| config.trust_domain.clone()),
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
    if let Some(dir) = &config.state_dir {
        let (file, mesh, status, metrics, token) = (
            LastMeshFile::in_dir(dir),
            mesh_rx.clone(),
            catalog_status.clone(),
            metrics.mesh.clone(),
            shutdown.clone(),
        );
        tasks.spawn(async move {
            file.keep(mesh, status, metrics, token).await;
            Ok("the node's last mesh")
        });
    }
    let token = shutdown.clone();
    tasks.spawn(async move {
        pipeline.run(token).await;
        Ok("pipeline")
    });
    let token = shutdown.clone();
    tasks.spawn(async move {
        admin.run(token).await?;
        Ok("admin server")
    });
    // The servers the pods reach, apart: on SIGTERM they drain while everything else runs.
    let mut servers: JoinSet<anyhow::Result<&'static str>> = JoinSet::new();
    let token = drain.clone();
    let dns = dns.on_open(move || drop(dns_ready));
    servers.spawn(async move {
        dns.run(token).await?;
        Ok("dns server")
    });
    let xds = XdsServer::new(published.xds, metrics.xds.clone(), proxies, drain.clone())
        .with_identity(identity)
        .with_limits(xds_limits(&config.xds_limits));
    let xds = match &scopes {
        Some(scopes) => xds.with_scopes(scopes.clone()),
        None => xds,
    };
    let xds = match secrets {
        Some(secrets) => xds.with_secrets(secrets),
        None => xds,
    };
    let token = drain.clone();
    servers.spawn(async move {
        if xds_beside {
            tracing::info!(xds = %xds_sockets.local_addr(), "another listener (the agent this one replaces) holds the xDS address: listening once this agent is ready");
            tokio::select! {
                () = readiness.ready_but(&["xds server", "dns server"]) => {}
                () = token.cancelled() => return Ok("xds server"),
            }
        }
        let listeners = xds_sockets
            .listen()
            .context("cannot listen on the xDS address")?;
        drop(xds_ready);
        let accepted = handoff::incoming(listeners, token.clone());
        lattice_agent::xds::connection::serve(accepted, AdsService::new(xds), token).await?;
        Ok("xds server")
    });

    let mut failure = None;
    tokio::select! {
        signal = shutdown_signal() => tracing::info!(signal, "shutting down: draining first"),
        Some(done) = tasks.join_next() => failure = Some(unexpected(done)),
        Some(done) = servers.join_next() => failure = Some(unexpected(done)),
    }
    drain.cancel();
    let drained = tokio::time::timeout(config.drain_timeout(), async {
        while let Some(done) = servers.join_next().await {
            if let Ok(Err(error)) = done {
                tracing::warn!("{}", report(error.as_ref()));
            }
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            timeout_secs = config.drain_timeout_secs,
            "still draining after --drain-timeout-secs; stopping anyway"
        );
        servers.shutdown().await;
    }
    shutdown.cancel();
    while let Some(done) = tasks.join_next().await {
        if let Ok(Err(error)) = done {
            tracing::warn!("{}", report(error.as_ref()));
        }
    }
    match failure {
        Some(error) => Err(error),
        None => {
            tracing::info!("stopped");
            Ok(())
        }
    }
}

/// Why a task that should run until shutdown ended.
fn unexpected(done: Result<anyhow::Result<&'static str>, tokio::task::JoinError>) -> anyhow::Error {
    match done {
        Ok(Ok(name)) => anyhow::anyhow!("{name} stopped unexpectedly"),
        Ok(Err(error)) => error,
        Err(join) => anyhow::anyhow!("a task panicked: {join}"),
    }
}

/// The xDS server's bounds, as the flags give them.
fn xds_limits(flags: &XdsLimitFlags) -> XdsLimits {
    let count = |n: u32| usize::try_from(n).unwrap_or(usize::MAX);
    let bytes = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
    XdsLimits {
        caps: Caps {
            connections: count(flags.xds_max_connections),
            connections_per_peer: count(flags.xds_max_connections_per_peer),
            streams: count(flags.xds_max_streams),
            streams_per_peer: count(flags.xds_max_streams_per_peer),
        },
        streams_per_connection: flags.xds_max_streams_per_connection,
        request: match flags.xds_max_request_bytes {
            RequestBytes::Auto => RequestBound::Auto,
            RequestBytes::Bytes(n) => RequestBound::Bytes(bytes(n)),
        },
        request_buffer: bytes(flags.xds_request_buffer_bytes),
        request_timeout: Duration::from_millis(flags.xds_request_timeout_ms),
        send_buffer: bytes(flags.xds_send_buffer_bytes),
        max_header_list: flags.xds_max_header_list_bytes,
        max_frame: flags.xds_max_frame_bytes,
        keepalive_interval: Duration::from_millis(flags.xds_keepalive_ms),
        keepalive_timeout: Duration::from_millis(flags.xds_keepalive_timeout_ms),
        tcp_keepalive: Duration::from_secs(flags.xds_tcp_keepalive_secs),
        drain: Duration::from_millis(flags.xds_drain_ms),
        names: Limits {
            max_names: flags.xds_max_names,
        },
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

/// Whether proxies verified as this node's pods are served workload certificates: only where
/// pods are checked (Kubernetes and a node name).
fn serves_secrets(config: &AgentConfig) -> bool {
    config.watches_kubernetes() && config.node_name.is_some()
}

/// The mesh file reader's bounds, from the flags.
fn mesh_file_limits(config: &AgentConfig) -> lattice_agent::source::file::Limits {
    lattice_agent::source::file::Limits {
        max_bytes: config.mesh_file_max_mib.saturating_mul(1 << 20),
        max_depth: config.mesh_file_max_depth,
        max_nodes: config.mesh_file_max_nodes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_xds_flags_defaults_are_the_servers() {
        let config = AgentConfig::try_parse_from(["lattice-agent"]).unwrap();
        assert_eq!(xds_limits(&config.xds_limits), XdsLimits::default());
    }
}
