//! The one-way flow from the mesh snapshots to what the servers hand out: runs the
//! translators on the latest snapshot and publishes their results, at most once per debounce
//! period, so a burst of changes goes out in few pushes while a lone change goes out at once.
//! Each translator decides from the snapshot alone what it must rebuild.
//!
//! The translators run on a thread of their own ([`BulkThread`]), not on the async runtime:
//! a 10k-service translation takes about 150 ms of CPU, during which a runtime worker could
//! serve neither DNS nor xDS. The pipeline task only waits for it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lattice_contract::CapturePort;
use lattice_dns::NameTable;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::dns::DnsTranslator;
use super::envoy::{EnvoyTranslator, ExternalDns};
use crate::mesh::{MeshMetrics, MeshRx, MeshSnapshot, NodeLocality};
use crate::parallel::{BulkThread, PARALLEL_FROM, Retiring};
use crate::readiness::{Readiness, ReadyToken};
use crate::xds::snapshot::XdsSnapshot;
use crate::xds::{self, XdsMetrics, XdsRx, XdsTx};

/// What the pipeline publishes, for the servers to read.
pub struct Published {
    pub xds: XdsRx,
    pub names: watch::Receiver<Arc<NameTable>>,
}

/// This node's name and zone, which decide endpoint priorities; `None` until known (the
/// pipeline translates nothing before, so the first push already prefers what it should).
pub type LocalityRx = watch::Receiver<Option<NodeLocality>>;

/// Whether services with identities are called over mesh mTLS (the agent has a CA, so every
/// verified proxy is served a leaf); `None` until known: the pipeline settles nothing before,
/// so no proxy is pushed plaintext clusters that the CA, read a moment later, takes back.
pub type MeshMtlsRx = watch::Receiver<Option<bool>>;

pub struct Pipeline {
    mesh: MeshRx,
    locality: LocalityRx,
    debounce: Duration,
    xds: XdsTx,
    names: watch::Sender<Arc<NameTable>>,
    metrics: XdsMetrics,
    mesh_metrics: MeshMetrics,
    /// Held until the first translation of each kind is published.
    xds_ready: Option<ReadyToken>,
    names_ready: Option<ReadyToken>,
    envoy: EnvoySettings,
    mesh_mtls: MeshMtlsRx,
}

/// What every Envoy translator of the pipeline is made with.
#[derive(Clone)]
struct EnvoySettings {
    external_dns: ExternalDns,
    capture_port: CapturePort,
    inbound_listeners: bool,
    trust_domain: Arc<str>,
}

impl Pipeline {
    pub fn new(
        mesh: MeshRx,
        locality: LocalityRx,
        debounce: Duration,
        metrics: XdsMetrics,
        mesh_metrics: MeshMetrics,
        readiness: &Readiness,
    ) -> (Pipeline, Published) {
        let (xds, xds_rx) = xds::snapshot::channel();
        let (names, names_rx) = watch::channel(Arc::new(NameTable::pending()));
        let pipeline = Pipeline {
            mesh,
            locality,
            debounce,
            xds,
            names,
            metrics,
            mesh_metrics,
            xds_ready: Some(readiness.register("envoy resources")),
            names_ready: Some(readiness.register("dns names")),
            envoy: EnvoySettings {
                external_dns: ExternalDns::default(),
                capture_port: CapturePort::default(),
                inbound_listeners: false,
                // `--trust-domain`'s default.
                trust_domain: "cluster.local".into(),
            },
            mesh_mtls: watch::channel(Some(false)).1,
        };
        let published = Published {
            xds: xds_rx,
            names: names_rx,
        };
        (pipeline, published)
    }

    /// How Envoy resolves external services' host names.
    pub fn with_external_dns(mut self, external_dns: ExternalDns) -> Self {
        self.envoy.external_dns = external_dns;
        self
    }

    /// Where the capture listener listens in every pod (`--envoy-port`).
    pub fn with_capture_port(mut self, port: CapturePort) -> Self {
        self.envoy.capture_port = port;
        self
    }

    /// Pods that capture inbound get their inbound listeners, with the authorization rules:
    /// for an agent that serves verified proxies their secrets.
    pub fn with_inbound_listeners(mut self, on: bool) -> Self {
        self.envoy.inbound_listeners = on;
        self
    }

    /// Services whose endpoints name identities are called over mesh mTLS while `on` says
    /// so (off without it).
    pub fn with_mesh_mtls(mut self, on: MeshMtlsRx) -> Self {
        self.mesh_mtls = on;
        self
    }

    /// The trust domain authorization rules' service accounts and namespaces are in.
    pub fn with_trust_domain(mut self, trust_domain: &str) -> Self {
        self.envoy.trust_domain = trust_domain.into();
        self
    }

    pub async fn run(mut self, shutdown: CancellationToken) {
        // At normal policy until the first settled snapshot is out: until then every proxy
        // waits for it, and DNS answers from the node's last mesh at most.
        let thread = match BulkThread::spawn_urgent("lattice-translate") {
            Ok(thread) => thread,
            Err(error) => {
                tracing::error!(%error, "the translators cannot run");
                return;
            }
        };
        let mut translators = Some(Translators {
            envoy: None,
            dns: DnsTranslator::default(),
            settings: self.envoy.clone(),
        });
        // A snapshot may already be waiting (the file source publishes before we start).
        self.mesh.mark_changed();
        // The locality's sender goes away once the node's zone is settled; the mTLS switch's
        // when it cannot change.
        let mut relocatable = true;
        let mut switchable = true;
        let mut last_push: Option<tokio::time::Instant> = None;
        let mut replaced = Replaced::default();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                // Servers let go of what was replaced when they next look: free it then.
                () = tokio::time::sleep(RELEASE_EVERY), if !replaced.is_empty() => {
                    replaced.release(&thread);
                    continue;
                }
                changed = self.mesh.changed() => if changed.is_err() { return },
                changed = self.locality.changed(), if relocatable => {
                    relocatable = changed.is_ok();
                    if !relocatable {
                        continue;
                    }
                }
                changed = self.mesh_mtls.changed(), if switchable => {
                    switchable = changed.is_ok();
                    if !switchable {
                        continue;
                    }
                }
            }
            // A rate limit, not a delay: a change goes out at once unless the last push was
            // less than a debounce period ago; then it waits for the period to end, and
            // whatever else arrives meanwhile goes out with it in one push.
            if let Some(ready) = last_push.map(|at| at + self.debounce) {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep_until(ready) => {}
                }
            }
            let translating = Instant::now();
            let mesh = self.mesh.borrow_and_update().clone();
            let Some(node) = self.locality.borrow_and_update().clone() else {
                continue;
            };
            let mtls = *self.mesh_mtls.borrow_and_update();
            let Some(mesh) = mesh else {
                continue;
            };
            // Taken out and put back by every run: only the thread touches it meanwhile.
            let Some(mut state) = translators.take() else {
                return;
            };
            replaced.release(&thread);
            if mesh.provisional {
                let Some(back) = self
                    .translate_last_mesh(
                        &thread,
                        &shutdown,
                        state,
                        &mesh,
                        node,
                        mtls,
                        &mut replaced,
                    )
                    .await
                else {
                    return;
                };
                translators = Some(back);
                replaced.mesh.retire(mesh);
                continue;
            }
            let Some(mtls) = mtls else {
                translators = Some(state);
                tracing::debug!(
                    "the mesh waits for the CA to be read: whether calls to meshed pods are mutual TLS"
                );
                continue;
            };
            let snapshot = mesh.clone();
            let job = run_job(&thread, &shutdown, move || {
                let translated = state.translate(&snapshot, node, mtls);
                (state, translated)
            });
            let Some((state, translated)) = job.await else {
                return;
            };
            translators = Some(state);
            let names = translated.names.map(Arc::new).or_else(|| {
                // Unchanged since the node's last mesh: the same table, now current.
                let current = self.names.borrow();
                current
                    .is_provisional()
                    .then(|| Arc::new(current.settled()))
            });
            if let Some(names) = names {
                replaced.names.retire(self.names.send_replace(names));
                self.names_ready.take();
            }
            if let Some(xds) = self.xds.send_replace(Some(Arc::new(translated.xds))) {
                replaced.xds.retire(xds);
            }
            self.xds_ready.take();
            thread.settle();
            last_push = Some(tokio::time::Instant::now());
            self.metrics.serving(mesh.version);
            self.mesh_metrics.observe(&mesh);
            tracing::info!(
                version = mesh.version,
                services = mesh.services.len(),
                endpoints = mesh.endpoint_count(),
                translate_ms = translating.elapsed().as_secs_f64() * 1e3,
                "serving mesh snapshot"
            );
            replaced.mesh.retire(mesh);
        }
    }
}

impl Pipeline {
    /// The node's last mesh: its names answer meanwhile, built first. Then, unless the settled
    /// mesh is already here, its Envoy resources, which stay with the translators as the base
    /// the settled mesh is translated against and go to no proxy (one may hold a newer mesh);
    /// not before it is known whether calls are mutual TLS, since a base made the other way
    /// would be of no use. `None` on shutdown or when the thread is gone.
    #[allow(clippy::too_many_arguments)]
    async fn translate_last_mesh(
        &self,
        thread: &BulkThread,
        shutdown: &CancellationToken,
        mut state: Translators,
        mesh: &Arc<MeshSnapshot>,
        node: NodeLocality,
        mtls: Option<bool>,
        replaced: &mut Replaced,
    ) -> Option<Translators> {
        let started = Instant::now();
        let snapshot = mesh.clone();
        let (back, names) = run_job(thread, shutdown, move || {
            let names = state.dns.translate(&snapshot);
            (state, names)
        })
        .await?;
        state = back;
        if let Some(names) = names {
            replaced
                .names
                .retire(self.names.send_replace(Arc::new(names.provisional())));
        }
        tracing::info!(
            version = mesh.version,
            services = mesh.services.len(),
            names_ms = started.elapsed().as_secs_f64() * 1e3,
            "answering DNS from the node's last mesh until the sources report"
        );
        let Some(mtls) = mtls else {
            return Some(state);
        };
        if self.mesh.has_changed().unwrap_or(true) {
            return Some(state);
        }
        let snapshot = mesh.clone();
        let started = Instant::now();
        let (back, xds) = run_job(thread, shutdown, move || {
            let xds = state.envoy_for(node, mtls).translate(&snapshot);
            (state, xds)
        })
        .await?;
        tracing::info!(
            version = mesh.version,
            services = mesh.services.len(),
            envoy_ms = started.elapsed().as_secs_f64() * 1e3,
            "the node's last mesh translated: the base the settled mesh is translated against"
        );
        thread.drop_later(xds);
        Some(back)
    }
}

/// Runs `job` on the translation thread; `None` on shutdown or when the thread is gone.
async fn run_job<R: Send + 'static>(
    thread: &BulkThread,
    shutdown: &CancellationToken,
    job: impl FnOnce() -> R + Send + 'static,
) -> Option<R> {
    tokio::select! {
        () = shutdown.cancelled() => None,
        done = thread.run(job) => match done {
            Ok(done) => Some(done),
            Err(error) => {
                tracing::error!(%error, "the translators stopped");
                None
            }
        },
    }
}

/// How often what was replaced is looked at again while a server still holds some of it.
const RELEASE_EVERY: Duration = Duration::from_secs(1);

/// What the pipeline published (or translated) and has since replaced, held until the servers
/// have let go of it and then freed on the translation thread: the last reference to a
/// 10k-service table or snapshot is not dropped on a DNS thread or a runtime worker.
#[derive(Default)]
struct Replaced {
    names: Retiring<NameTable>,
    xds: Retiring<XdsSnapshot>,
    mesh: Retiring<MeshSnapshot>,
}

impl Replaced {
    fn is_empty(&self) -> bool {
        self.names.is_empty() && self.xds.is_empty() && self.mesh.is_empty()
    }

    fn release(&mut self, thread: &BulkThread) {
        let released = (
            self.names.released(),
            self.xds.released(),
            self.mesh.released(),
        );
        if !(released.0.is_empty() && released.1.is_empty() && released.2.is_empty()) {
            thread.drop_later(released);
        }
    }
}

/// What the translators keep from one run to the next; moved to the translation thread for a
/// run and back.
struct Translators {
    /// Made for the node's locality, and made anew when it changes.
    envoy: Option<EnvoyTranslator>,
    dns: DnsTranslator,
    settings: EnvoySettings,
}

/// One run's output.
struct Translated {
    xds: XdsSnapshot,
    /// `None` when the names did not change.
    names: Option<NameTable>,
}

impl Translators {
    /// The Envoy translator for `node`'s locality and mesh mTLS on or off.
    fn envoy_for(&mut self, node: NodeLocality, mtls: bool) -> &mut EnvoyTranslator {
        envoy_for(&mut self.envoy, node, mtls, &self.settings)
    }

    fn translate(&mut self, mesh: &MeshSnapshot, node: NodeLocality, mtls: bool) -> Translated {
        let envoy = envoy_for(&mut self.envoy, node, mtls, &self.settings);
        let dns = &mut self.dns;
        if dns.is_current(mesh) || mesh.services.len() < PARALLEL_FROM {
            return Translated {
                xds: envoy.translate(mesh),
                names: dns.translate(mesh),
            };
        }
        // A new name table of a large mesh (the first snapshot above all: about a fifth of
        // its translation at 50k services) is built beside the Envoy resources, on a thread
        // of its own, while most of the Envoy translation runs on one core.
        std::thread::scope(|scope| {
            let names = scope.spawn(|| dns.translate(mesh));
            let xds = envoy.translate(mesh);
            match names.join() {
                Ok(names) => Translated { xds, names },
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }
}

/// The translator in `slot` if it was made for `node`'s locality and `mtls`, else a new one:
/// another locality changes every priority, and mesh mTLS turned on or off every meshed
/// service's clusters, so everything is translated anew (versions are content hashes, so only
/// what changed is pushed).
fn envoy_for<'a>(
    slot: &'a mut Option<EnvoyTranslator>,
    node: NodeLocality,
    mtls: bool,
    settings: &EnvoySettings,
) -> &'a mut EnvoyTranslator {
    if slot
        .as_ref()
        .is_some_and(|envoy| *envoy.node() != node || envoy.mesh_mtls() != mtls)
    {
        *slot = None;
    }
    slot.get_or_insert_with(|| {
        tracing::info!(
            node = node.name.as_deref().unwrap_or("-"),
            zone = node.zone.as_deref().unwrap_or("-"),
            mesh_mtls = mtls,
            "endpoint priorities follow this node; services of meshed pods are called over mutual TLS if mesh_mtls"
        );
        EnvoyTranslator::new(node, settings.external_dns.clone())
            .with_capture_port(settings.capture_port)
            .with_inbound_listeners(settings.inbound_listeners)
            .with_mesh_mtls(mtls)
            .with_trust_domain(&settings.trust_domain)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::{self, EndpointSet, MeshState, MeshTx, Protocol, ServicePort, ServiceSpec};
    use crate::metrics::Metrics;
    use crate::xds::ResourceType;

    const PERIOD: Duration = Duration::from_millis(100);

    /// A pipeline reading `mesh` and `locality`, and the readiness it reports to.
    fn pipeline(
        mesh: MeshRx,
        locality: LocalityRx,
        debounce: Duration,
    ) -> (Pipeline, Published, Readiness) {
        let readiness = Readiness::new();
        let metrics = Metrics::new();
        let (pipeline, out) = Pipeline::new(
            mesh,
            locality,
            debounce,
            metrics.xds.clone(),
            metrics.mesh.clone(),
            &readiness,
        );
        (pipeline, out, readiness)
    }

    /// An HTTP service at `path` on port 8080 with one endpoint.
    fn http_service(path: &str, endpoint: &str) -> ServiceSpec {
        ServiceSpec::new(
            path.parse().unwrap(),
            vec![ServicePort {
                name: None,
                port: 8080,
                protocol: Protocol::Http,
                endpoints: EndpointSet::parsed(&[endpoint]),
                hosts: Default::default(),
            }],
        )
    }

    fn publish(state: &mut MeshState, mesh: &MeshTx, endpoint: &str) -> u64 {
        state
            .upsert(http_service("/foo/bar/buzz", endpoint))
            .unwrap();
        let snapshot = state.snapshot();
        let version = snapshot.version;
        mesh.send_replace(Some(snapshot));
        version
    }

    /// The clock is paused: time moves only when every task waits, so "no time passed" is
    /// exact and a sleep of the period is the period.
    #[tokio::test(start_paused = true)]
    async fn a_lone_change_goes_out_at_once_and_a_burst_is_coalesced() {
        let (mesh, mesh_rx) = mesh::channel();
        let (_locality, locality_rx) =
            watch::channel(Some(NodeLocality::without_zone(None, "a test")));
        let (pipeline, mut out, readiness) = pipeline(mesh_rx, locality_rx, PERIOD);
        assert_eq!(readiness.pending(), ["dns names", "envoy resources"]);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(pipeline.run(shutdown.clone()));
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        let pushed = |out: &mut Published| {
            let xds = out.xds.borrow_and_update();
            let xds = xds.as_ref().expect("a snapshot");
            (xds.version, xds.of(ResourceType::Endpoint).len())
        };

        let start = tokio::time::Instant::now();
        let v1 = publish(&mut state, &mesh, "10.0.0.1:80");
        out.xds.changed().await.unwrap();
        assert_eq!(start.elapsed(), Duration::ZERO, "the first change waited");
        assert_eq!(pushed(&mut out), (v1, 1));
        assert!(
            readiness.pending().is_empty(),
            "not ready after the first snapshot: {:?}",
            readiness.pending()
        );

        // Long after the last push: at once again.
        tokio::time::sleep(PERIOD * 3).await;
        let start = tokio::time::Instant::now();
        let v2 = publish(&mut state, &mesh, "10.0.0.2:80");
        out.xds.changed().await.unwrap();
        assert_eq!(start.elapsed(), Duration::ZERO, "a lone change waited");
        assert_eq!(pushed(&mut out).0, v2);

        // Right after a push, two changes: they wait out the period and go out as one.
        publish(&mut state, &mesh, "10.0.0.3:80");
        tokio::task::yield_now().await;
        let v4 = publish(&mut state, &mesh, "10.0.0.4:80");
        out.xds.changed().await.unwrap();
        assert_eq!(
            start.elapsed(),
            PERIOD,
            "the burst did not wait for the period"
        );
        assert_eq!(
            pushed(&mut out).0,
            v4,
            "the burst went out in more than one push"
        );

        shutdown.cancel();
        task.await.unwrap();
        assert!(
            !out.xds.has_changed().unwrap_or(false),
            "a push after the burst"
        );
    }

    #[tokio::test]
    async fn the_nodes_last_mesh_answers_names_and_reaches_no_proxy_until_it_is_settled() {
        let (mesh, mesh_rx) = mesh::channel();
        let (_locality, locality_rx) =
            watch::channel(Some(NodeLocality::without_zone(None, "a test")));
        let (pipeline, mut out, readiness) = pipeline(mesh_rx, locality_rx, Duration::ZERO);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(pipeline.run(shutdown.clone()));
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        state
            .upsert(http_service("/foo/bar/buzz", "10.0.0.1:80"))
            .unwrap();
        let mut last = Arc::unwrap_or_clone(state.snapshot());
        last.provisional = true;
        mesh.send_replace(Some(Arc::new(last)));
        out.names.changed().await.unwrap();
        assert!(out.names.borrow_and_update().is_provisional());
        assert!(
            out.xds.borrow().is_none(),
            "a proxy was offered the last mesh"
        );
        assert_eq!(readiness.pending(), ["dns names", "envoy resources"]);

        // Settled and unchanged: the same names, now current, and the resources go out.
        mesh.send_replace(Some(state.snapshot()));
        out.xds.changed().await.unwrap();
        assert!(out.names.borrow_and_update().is_settled());
        assert!(readiness.pending().is_empty(), "{:?}", readiness.pending());
        shutdown.cancel();
        task.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_is_translated_before_the_nodes_locality_and_a_new_one_translates_again() {
        let (mesh, mesh_rx) = mesh::channel();
        let (locality, locality_rx) = watch::channel(None);
        let (pipeline, mut out, readiness) = pipeline(mesh_rx, locality_rx, PERIOD);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(pipeline.run(shutdown.clone()));
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        // A service that prefers its clients' zone, with an endpoint in zone a and one in b.
        let zoned = |ip: &str, zone: &str| crate::mesh::Endpoint {
            zone: Some(Arc::from(zone)),
            ..crate::mesh::Endpoint::new(ip.parse().unwrap(), crate::mesh::Provider::new("test"))
        };
        let spec = ServiceSpec::new(
            "/foo/zoned".parse().unwrap(),
            vec![ServicePort {
                name: None,
                port: 8080,
                protocol: Protocol::Http,
                endpoints: EndpointSet::new(vec![
                    zoned("10.0.0.1:80", "a"),
                    zoned("10.0.0.2:80", "b"),
                ]),
                hosts: Default::default(),
            }],
        )
        .with_traffic_distribution(crate::mesh::TrafficDistribution::PreferSameZone);
        state.upsert(spec).unwrap();
        mesh.send_replace(Some(state.snapshot()));
        tokio::time::sleep(PERIOD * 3).await;
        assert!(out.xds.borrow().is_none(), "translated before the locality");
        assert!(!readiness.pending().is_empty());
        // Each endpoint's priority in the zoned service's assignment.
        let priorities = |out: &mut Published| -> Vec<(String, u32)> {
            use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
            use prost::Message as _;
            let xds = out.xds.borrow_and_update();
            let xds = xds.as_ref().expect("a snapshot");
            let resource = &xds.of(ResourceType::Endpoint)["zoned.foo.system.internal|8080"];
            let cla = ClusterLoadAssignment::decode(resource.body.value.as_slice()).unwrap();
            let mut found: Vec<(String, u32)> = cla
                .endpoints
                .iter()
                .map(|group| {
                    (
                        group.locality.clone().unwrap_or_default().zone,
                        group.priority,
                    )
                })
                .collect();
            found.sort();
            found
        };

        locality.send_replace(Some(NodeLocality::without_zone(None, "a test")));
        out.xds.changed().await.unwrap();
        assert!(
            priorities(&mut out)
                .iter()
                .all(|(_, priority)| *priority == 0),
            "no zone known: nothing is preferred"
        );
        // The zone becomes known: translated again, without a mesh change, and zone a is now
        // preferred.
        locality.send_replace(Some(NodeLocality::with_zone(
            None,
            Arc::from("a"),
            crate::mesh::locality::ZoneSource::NodeLabel,
        )));
        out.xds.changed().await.unwrap();
        assert_eq!(
            priorities(&mut out),
            [("a".to_string(), 0), ("b".to_string(), 1)],
            "this node's zone first"
        );
        // The locality's sender goes (the lookup is done): mesh changes still go out.
        drop(locality);
        let version = publish(&mut state, &mesh, "10.0.0.2:80");
        out.xds.changed().await.unwrap();
        assert_eq!(out.xds.borrow().as_ref().map(|x| x.version), Some(version));
        shutdown.cancel();
        task.await.unwrap();
    }

    /// A running pipeline whose mTLS switch is not known yet, and the mesh state it is fed
    /// from, holding `/shop/web`, whose endpoint presents an identity.
    struct Switched {
        mesh: MeshTx,
        switch: watch::Sender<Option<bool>>,
        out: Published,
        readiness: Readiness,
        state: MeshState,
        shutdown: CancellationToken,
        task: tokio::task::JoinHandle<()>,
    }

    fn switched() -> Switched {
        let (mesh, mesh_rx) = mesh::channel();
        let (locality, locality_rx) =
            watch::channel(Some(NodeLocality::without_zone(None, "a test")));
        let (switch, switch_rx) = watch::channel(None);
        let (pipeline, out, readiness) = pipeline(mesh_rx, locality_rx, PERIOD);
        let pipeline = pipeline.with_mesh_mtls(switch_rx);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(pipeline.run(shutdown.clone()));
        // The locality stays known (its sender going means that).
        drop(locality);
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        state
            .upsert(
                http_service("/shop/web", "10.0.0.1:8080")
                    .with_identities(vec![Arc::from("spiffe://cluster.local/ns/shop/sa/web")]),
            )
            .unwrap();
        Switched {
            mesh,
            switch,
            out,
            readiness,
            state,
            shutdown,
            task,
        }
    }

    /// Whether `/shop/web`'s cluster, as last published, is called over mutual TLS.
    fn web_is_mtls(out: &mut Published) -> bool {
        use envoy_types::pb::envoy::config::cluster::v3::Cluster;
        use prost::Message as _;
        let xds = out.xds.borrow_and_update();
        let xds = xds.as_ref().expect("a snapshot");
        let resource = &xds.of(ResourceType::Cluster)["web.shop.system.internal|8080"];
        Cluster::decode(resource.body.value.as_slice())
            .unwrap()
            .transport_socket
            .is_some()
    }

    /// Until the agent knows whether it has a CA, nothing settled goes out (plaintext clusters
    /// for a meshed service would be taken back a moment later); then a meshed service's
    /// clusters follow the switch both ways, without a mesh change, and the switch's sender
    /// going away does not stop the pipeline.
    #[tokio::test(start_paused = true)]
    async fn calls_to_meshed_services_wait_for_the_ca_and_follow_it_both_ways() {
        let Switched {
            mesh,
            switch,
            mut out,
            readiness,
            mut state,
            shutdown,
            task,
        } = switched();
        mesh.send_replace(Some(state.snapshot()));
        tokio::time::sleep(PERIOD * 3).await;
        assert!(out.xds.borrow().is_none(), "settled before the CA was read");
        assert!(readiness.pending().contains(&"envoy resources".to_string()));
        switch.send_replace(Some(true));
        out.xds.changed().await.unwrap();
        assert!(web_is_mtls(&mut out), "a CA: mutual TLS");
        switch.send_replace(Some(false));
        out.xds.changed().await.unwrap();
        assert!(!web_is_mtls(&mut out), "no CA any more: plaintext");
        switch.send_replace(Some(true));
        out.xds.changed().await.unwrap();
        assert!(web_is_mtls(&mut out), "a CA again");
        drop(switch);
        let version = publish(&mut state, &mesh, "10.0.0.2:8080");
        out.xds.changed().await.unwrap();
        assert_eq!(out.xds.borrow().as_ref().map(|x| x.version), Some(version));
        assert!(web_is_mtls(&mut out));
        shutdown.cancel();
        task.await.unwrap();
    }

    /// The node's last mesh answers names while the CA is not known yet, and still reaches no
    /// proxy once it is; the settled mesh then goes out with the switch as it is.
    #[tokio::test(start_paused = true)]
    async fn the_nodes_last_mesh_answers_names_before_the_ca_is_known() {
        let Switched {
            mesh,
            switch,
            mut out,
            readiness,
            mut state,
            shutdown,
            task,
        } = switched();
        let mut last = Arc::unwrap_or_clone(state.snapshot());
        last.provisional = true;
        mesh.send_replace(Some(Arc::new(last)));
        out.names.changed().await.unwrap();
        assert!(out.names.borrow_and_update().is_provisional());
        switch.send_replace(Some(true));
        tokio::time::sleep(PERIOD * 3).await;
        assert!(
            out.xds.borrow().is_none(),
            "a proxy was offered the last mesh"
        );
        assert_eq!(readiness.pending(), ["dns names", "envoy resources"]);

        mesh.send_replace(Some(state.snapshot()));
        out.xds.changed().await.unwrap();
        assert!(out.names.borrow_and_update().is_settled());
        assert!(web_is_mtls(&mut out), "mutual TLS, as the switch says");
        assert!(readiness.pending().is_empty());
        shutdown.cancel();
        task.await.unwrap();
    }

    /// A DNS thread holds the table it answers from until it takes the next one: the pipeline
    /// must hold the replaced one too, or that thread's letting go frees it (milliseconds for
    /// a large mesh, with its socket unread). Freed once the reader lets go.
    #[tokio::test]
    async fn a_replaced_name_table_is_not_freed_by_its_last_reader() {
        let (mesh, mesh_rx) = mesh::channel();
        let (_locality, locality_rx) =
            watch::channel(Some(NodeLocality::without_zone(None, "a test")));
        let (pipeline, mut out, _readiness) = pipeline(mesh_rx, locality_rx, Duration::ZERO);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(pipeline.run(shutdown.clone()));
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        publish(&mut state, &mesh, "10.0.0.1:80");
        out.names.changed().await.unwrap();
        let held = out.names.borrow_and_update().clone();
        assert!(!held.is_pending());

        // Another service: another name table.
        state
            .upsert(http_service("/foo/bar/other", "10.0.0.2:80"))
            .unwrap();
        mesh.send_replace(Some(state.snapshot()));
        out.names.changed().await.unwrap();
        assert!(!Arc::ptr_eq(&held, &out.names.borrow_and_update()));
        assert_eq!(
            Arc::strong_count(&held),
            2,
            "the pipeline let go of the replaced table before its reader did"
        );

        let freed = Arc::downgrade(&held);
        drop(held);
        let deadline = Instant::now() + Duration::from_secs(10);
        while freed.upgrade().is_some() {
            assert!(
                Instant::now() < deadline,
                "the replaced table was never freed"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        shutdown.cancel();
        task.await.unwrap();
    }
}
