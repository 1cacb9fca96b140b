//! Which services each pod of this node uses, so that its Envoy holds those and nothing else.
//!
//! A pod's scope is what it declared (the pod annotation `lattice.mlab.com/uses`) and every
//! service it resolved through the agent's DNS (the query's source address is the pod's). A
//! service stays in the scope for the pod's life. The xDS stream of a verified proxy follows
//! its pod's scope ([`ScopeRegistry::attach`]); the DNS server reports lookups
//! ([`ScopeRegistry::resolved`]) and, for a name new to the pod, holds the answer until the
//! pod's Envoy has acknowledged the service (or a bounded wait ends), so that the pod's first
//! request to a name it just resolved finds the route in place.
//!
//! Pods that opted out (`lattice.mlab.com/scope: mesh`), proxies that cannot be identified
//! (identity checking off, host-network pods) and addresses that are not pods of this node are
//! not scoped: they hold the whole mesh, as before scoping.
//!
//! With a state directory ([`ScopeStore`]) each pod's scope outlives the agent: a service is
//! written there before the pod's Envoy is given it, and a restarted agent gives each pod that
//! still runs (same pod, same address) what it held, so no Envoy loses a service because the
//! agent restarted.

mod store;

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

pub use store::{ScopeStore, StoreError, Stored};

use crate::identity::{PodEntry, PodKey};

/// What a scoped proxy holds: the services (DNS names) its pod uses, and a generation that
/// moves with every addition.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scope {
    pub generation: u64,
    pub services: Arc<BTreeSet<Arc<str>>>,
}

/// A pod as scoping needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScopedPod {
    pub key: PodKey,
    pub ip: IpAddr,
    /// False when the pod opted out: its proxy holds the whole mesh.
    pub scoped: bool,
    /// The services it declared it uses, by DNS name.
    pub declared: Vec<Arc<str>>,
}

impl ScopedPod {
    /// A pod of the directory as scoping sees it; `None` on the host network, where the
    /// address is the node's and its proxies cannot be told apart.
    pub fn of(entry: &PodEntry) -> Option<ScopedPod> {
        (!entry.host_network).then(|| ScopedPod {
            key: entry.key.clone(),
            ip: entry.ip,
            scoped: entry.scoped,
            declared: entry.uses.clone(),
        })
    }
}

/// Counters of the DNS side of scoping.
#[derive(Clone, Debug, Default)]
pub struct ScopeMetrics {
    /// Lookups that added a service to a pod's scope.
    pub added: Counter,
    /// Of those, answers held until the pod's Envoy acknowledged the service.
    pub waited: Counter,
    /// Of those, answers sent when the wait ran out instead.
    pub timed_out: Counter,
    /// Writes to the state directory that failed (the scope is kept in memory only).
    pub store_errors: Counter,
}

impl ScopeMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = ScopeMetrics::default();
        registry.register(
            "lattice_scope_services_added",
            "Services added to a pod's scope by its DNS lookups",
            metrics.added.clone(),
        );
        registry.register(
            "lattice_scope_waits",
            "DNS answers held until the pod's Envoy held the service",
            metrics.waited.clone(),
        );
        registry.register(
            "lattice_scope_wait_timeouts",
            "DNS answers sent after the bounded wait, the pod's Envoy not holding the service yet",
            metrics.timed_out.clone(),
        );
        registry.register(
            "lattice_scope_store_errors",
            "Scope changes the agent could not write to its state directory",
            metrics.store_errors.clone(),
        );
        metrics
    }
}

struct PodScope {
    key: PodKey,
    scoped: bool,
    declared: Vec<Arc<str>>,
    scope: watch::Sender<Scope>,
    /// The newest generation the pod's proxy holds completely.
    acked: watch::Sender<u64>,
}

impl PodScope {
    /// A pod's scope: what it declares, and what it held before the agent restarted.
    fn new(pod: &ScopedPod, restored: BTreeSet<Arc<str>>) -> PodScope {
        let mut services = restored;
        services.extend(pod.declared.iter().cloned());
        PodScope {
            key: pod.key.clone(),
            scoped: pod.scoped,
            declared: pod.declared.clone(),
            scope: watch::Sender::new(Scope {
                generation: 1,
                services: Arc::new(services),
            }),
            acked: watch::Sender::new(0),
        }
    }

    /// Adds `services`; the new generation, when any was new.
    fn add(&self, services: &[Arc<str>]) -> Option<u64> {
        let mut added = None;
        self.scope.send_if_modified(|scope| {
            if services.iter().all(|s| scope.services.contains(s)) {
                return false;
            }
            let mut more = (*scope.services).clone();
            more.extend(services.iter().cloned());
            scope.services = Arc::new(more);
            scope.generation += 1;
            added = Some(scope.generation);
            true
        });
        added
    }
}

/// The scopes of this node's pods, by pod IP.
pub struct ScopeRegistry {
    pods: RwLock<HashMap<IpAddr, PodScope>>,
    /// The longest a DNS answer waits for the proxy.
    wait: Duration,
    metrics: ScopeMetrics,
    store: Option<ScopeStore>,
    /// The scopes read back from the store at start, until the first pod list says which of
    /// those pods still run.
    restored: Mutex<Option<HashMap<PodKey, Stored>>>,
    /// When a store error was last logged (at most one in [`STORE_LOG_INTERVAL`]).
    logged: Mutex<Option<Instant>>,
}

const STORE_LOG_INTERVAL: Duration = Duration::from_secs(10);

impl ScopeRegistry {
    pub fn new(wait: Duration, metrics: ScopeMetrics) -> Self {
        ScopeRegistry {
            pods: RwLock::default(),
            wait,
            metrics,
            store: None,
            restored: Mutex::new(None),
            logged: Mutex::new(None),
        }
    }

    /// Keeps each pod's scope in `store` too, and starts from what it holds: a pod of the
    /// first pod list with the same name and address gets back what it held.
    pub fn with_store(mut self, store: ScopeStore) -> Self {
        let restored = match store.load() {
            Ok(restored) => restored,
            Err(error) => {
                tracing::warn!(%error, "pod scopes kept before this start cannot be read; every pod starts from what it declares");
                HashMap::new()
            }
        };
        tracing::info!(
            pods = restored.len(),
            "pod scopes read back from the state directory"
        );
        self.restored = Mutex::new(Some(restored));
        self.store = Some(store);
        self
    }

    /// Makes the known pods exactly `pods`: a pod that stays keeps what it resolved, one that
    /// went away is forgotten, and a changed declaration adds to the scope.
    pub fn set_pods(&self, pods: impl IntoIterator<Item = ScopedPod>) {
        let mut known = self.pods.write().unwrap_or_else(|p| p.into_inner());
        // Only the first pod list restores: a pod missing from it is gone.
        let mut restored = lock(&self.restored).take();
        let mut next = HashMap::new();
        for pod in pods {
            let ip = pod.ip.to_canonical();
            match known.remove(&ip) {
                Some(mut held) if held.scoped == pod.scoped && held.key == pod.key => {
                    if held.declared != pod.declared {
                        held.add(&pod.declared);
                        held.declared = pod.declared;
                    }
                    next.insert(ip, held);
                }
                // New, or another pod at the address, or its opt-out changed: start afresh
                // (a stream that follows the old entry sees its sender go and is closed by its
                // pod check anyway).
                old => {
                    if let Some(old) = old {
                        self.forget(&old.key);
                    }
                    let back = restored.as_mut().and_then(|r| r.remove(&pod.key));
                    next.insert(ip, self.start(&pod, back));
                }
            }
        }
        for gone in known.values() {
            self.forget(&gone.key);
        }
        for gone in restored.iter().flat_map(|r| r.keys()) {
            self.forget(gone);
        }
        *known = next;
    }

    /// The scope of a pod new to the registry, with what it held before the agent started if
    /// the store has it (the same pod at the same address), written to the store.
    fn start(&self, pod: &ScopedPod, restored: Option<Stored>) -> PodScope {
        let ip = pod.ip.to_canonical();
        let services = restored
            .filter(|r| r.ip.to_canonical() == ip && pod.scoped)
            .map(|r| r.services)
            .unwrap_or_default();
        let scope = PodScope::new(pod, services);
        if let Some(store) = self.store.as_ref().filter(|_| pod.scoped) {
            let stored = Stored {
                ip,
                services: (*scope.scope.borrow().services).clone(),
            };
            let written = store.write(&pod.key, &stored);
            self.report(written);
        }
        scope
    }

    fn forget(&self, pod: &PodKey) {
        if let Some(store) = &self.store {
            self.report(store.forget(pod));
        }
    }

    /// Counts and logs (at a bounded rate) what the store could not do.
    fn report(&self, result: Result<(), StoreError>) {
        let Err(error) = result else {
            return;
        };
        self.metrics.store_errors.inc();
        let mut logged = lock(&self.logged);
        if logged.is_none_or(|at| at.elapsed() >= STORE_LOG_INTERVAL) {
            *logged = Some(Instant::now());
            tracing::warn!(%error, "a pod's scope is kept in memory only: an agent restart would drop what it resolved since");
        }
    }

    /// The scope the proxy of `pod` follows, or `None` when that proxy holds the whole mesh.
    /// A pod the registry does not know yet (its proxy connected before the pod list reached
    /// the registry) is added as it is.
    pub fn attach(&self, pod: &ScopedPod) -> Option<ScopeWatch> {
        let mut pods = self.pods.write().unwrap_or_else(|p| p.into_inner());
        let ip = pod.ip.to_canonical();
        if pods.get(&ip).is_none_or(|held| held.key != pod.key) {
            let back = lock(&self.restored)
                .as_mut()
                .and_then(|r| r.remove(&pod.key));
            if let Some(old) = pods.insert(ip, self.start(pod, back)) {
                self.forget(&old.key);
            }
        }
        let held = pods.get(&ip)?;
        held.scoped.then(|| ScopeWatch {
            scope: held.scope.subscribe(),
            acked: held.acked.clone(),
        })
    }

    /// `client` resolved a name of `service`. `None` when nothing needs waiting for: the
    /// service was in its scope already (the common case: a read lock and a set lookup), the
    /// client is not a scoped pod, or no proxy follows its scope. Otherwise the service is added
    /// (written to the store first, so a restarted agent gives it back) and the future ends
    /// when the pod's proxy holds it, or after the bounded wait.
    pub fn resolved(
        &self,
        client: IpAddr,
        service: &Arc<str>,
    ) -> Option<impl Future<Output = ()> + Send + 'static> {
        let pods = self.pods.read().unwrap_or_else(|p| p.into_inner());
        let pod = pods.get(&client.to_canonical()).filter(|p| p.scoped)?;
        if pod.scope.borrow().services.contains(service) {
            return None;
        }
        if let Some(store) = &self.store {
            self.report(store.append(&pod.key, service));
        }
        let generation = pod.add(std::slice::from_ref(service))?;
        self.metrics.added.inc();
        // No proxy follows this pod (its Envoy has not connected yet): its first sync will
        // hold the service, and there is nothing to wait for now.
        if pod.scope.receiver_count() == 0 {
            return None;
        }
        self.metrics.waited.inc();
        let mut acked = pod.acked.subscribe();
        let (wait, timed_out) = (self.wait, self.metrics.timed_out.clone());
        Some(async move {
            let held = acked.wait_for(|&acked| acked >= generation);
            if tokio::time::timeout(wait, held).await.is_err() {
                timed_out.inc();
            }
        })
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// A proxy's end of its pod's scope.
pub struct ScopeWatch {
    pub scope: watch::Receiver<Scope>,
    acked: watch::Sender<u64>,
}

impl ScopeWatch {
    /// The proxy holds everything of `generation`: DNS answers waiting for it may go.
    pub fn held(&self, generation: u64) {
        self.acked.send_if_modified(|acked| {
            let newer = generation > *acked;
            if newer {
                *acked = generation;
            }
            newer
        });
    }

    /// Whether a DNS answer may be waiting for this proxy to hold `generation`.
    pub fn awaited(&self, generation: u64) -> bool {
        *self.acked.borrow() < generation
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ip: &str, scoped: bool, declared: &[&str]) -> ScopedPod {
        ScopedPod {
            key: PodKey {
                namespace: "default".to_string(),
                name: format!("pod-{}", ip.replace('.', "-")),
            },
            ip: ip.parse().unwrap(),
            scoped,
            declared: declared.iter().map(|d| Arc::from(*d)).collect(),
        }
    }

    fn names(scope: &Scope) -> Vec<&str> {
        scope.services.iter().map(|s| &**s).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_name_waits_for_the_proxy_and_a_known_one_does_not() {
        let registry = ScopeRegistry::new(Duration::from_secs(1), ScopeMetrics::default());
        registry.set_pods([pod("10.0.0.5", true, &["db.data.system.internal"])]);
        let buzz: Arc<str> = Arc::from("buzz.bar.foo.system.internal");
        let client: IpAddr = "10.0.0.5".parse().unwrap();
        // Before a proxy follows the pod, the lookup is recorded and answered at once.
        assert!(registry.resolved(client, &buzz).is_none());
        let watch = registry.attach(&pod("10.0.0.5", true, &[])).unwrap();
        assert_eq!(
            names(&watch.scope.borrow()),
            ["buzz.bar.foo.system.internal", "db.data.system.internal"]
        );
        assert!(registry.resolved(client, &buzz).is_none(), "already held");
        // A new one waits until the proxy holds its generation.
        let web: Arc<str> = Arc::from("web.shop.system.internal");
        let wait = tokio::spawn(registry.resolved(client, &web).unwrap());
        let generation = watch.scope.borrow().generation;
        assert!(watch.awaited(generation));
        tokio::task::yield_now().await;
        assert!(!wait.is_finished());
        watch.held(generation);
        wait.await.unwrap();
        assert!(!watch.awaited(generation));
        assert_eq!(registry.metrics.timed_out.get(), 0);
        // A proxy that never holds it: the answer goes after the bounded wait, counted.
        let other: Arc<str> = Arc::from("other.shop.system.internal");
        registry.resolved(client, &other).unwrap().await;
        assert_eq!(registry.metrics.timed_out.get(), 1);
        assert_eq!(registry.metrics.added.get(), 3);
    }

    #[test]
    fn unscoped_pods_and_strangers_are_not_scoped() {
        let registry = ScopeRegistry::new(Duration::from_secs(1), ScopeMetrics::default());
        registry.set_pods([pod("10.0.0.5", false, &[]), pod("10.0.0.6", true, &[])]);
        let buzz: Arc<str> = Arc::from("buzz.bar.foo.system.internal");
        let ip = |ip: &str| -> IpAddr { ip.parse().unwrap() };
        // Opted out: whatever its proxy says when it connects.
        assert!(registry.attach(&pod("10.0.0.5", true, &[])).is_none());
        assert!(registry.resolved(ip("10.0.0.5"), &buzz).is_none());
        // Not a pod: its lookups are not recorded.
        assert!(registry.resolved(ip("10.0.0.7"), &buzz).is_none());
        assert_eq!(registry.metrics.added.get(), 0);
        assert!(registry.attach(&pod("10.0.0.6", true, &[])).is_some());
        // A pod whose proxy connects before the pod list reaches the registry is added.
        let early = registry.attach(&pod("10.0.0.8", true, &["db.data.system.internal"]));
        assert_eq!(early.unwrap().scope.borrow().services.len(), 1);
        assert!(
            registry.resolved(ip("10.0.0.8"), &buzz).is_none(),
            "no proxy follows it"
        );
        assert_eq!(registry.metrics.added.get(), 1);
    }

    #[test]
    fn a_pod_keeps_its_scope_while_it_lives_and_loses_it_when_it_goes() {
        let registry = ScopeRegistry::new(Duration::from_secs(1), ScopeMetrics::default());
        let client: IpAddr = "10.0.0.5".parse().unwrap();
        let buzz: Arc<str> = Arc::from("buzz.bar.foo.system.internal");
        registry.set_pods([pod("10.0.0.5", true, &[])]);
        let _ = registry.resolved(client, &buzz);
        // The pod list changes (another pod comes; this one declares more): it keeps buzz.
        registry.set_pods([
            pod("10.0.0.5", true, &["db.data.system.internal"]),
            pod("10.0.0.6", true, &[]),
        ]);
        let watch = registry.attach(&pod("10.0.0.5", true, &[])).unwrap();
        assert_eq!(
            names(&watch.scope.borrow()),
            ["buzz.bar.foo.system.internal", "db.data.system.internal"]
        );
        // It goes (its lookups are no longer recorded), and a new pod at its address starts
        // from nothing.
        registry.set_pods([pod("10.0.0.6", true, &[])]);
        assert!(registry.resolved(client, &buzz).is_none());
        registry.set_pods([pod("10.0.0.5", true, &[])]);
        let fresh = registry.attach(&pod("10.0.0.5", true, &[])).unwrap();
        assert!(fresh.scope.borrow().services.is_empty());
    }

    /// A restarted registry on the same state directory gives a pod that still runs, at the
    /// same address, what it resolved before; another pod at that address, or a pod that
    /// went, gets nothing back, and its file goes.
    #[test]
    fn scopes_outlive_the_registry_in_its_state_directory() {
        let dir = tempfile::tempdir().unwrap();
        let registry = |_: ()| {
            ScopeRegistry::new(Duration::from_secs(1), ScopeMetrics::default())
                .with_store(ScopeStore::open(dir.path()).unwrap())
        };
        let buzz: Arc<str> = Arc::from("buzz.bar.foo.system.internal");
        let web: Arc<str> = Arc::from("web.shop.system.internal");
        let first = registry(());
        first.set_pods([
            pod("10.0.0.5", true, &["db.data.system.internal"]),
            pod("10.0.0.6", true, &[]),
            pod("10.0.0.7", true, &[]),
            pod("10.0.0.8", false, &[]),
        ]);
        for ip in ["10.0.0.5", "10.0.0.6", "10.0.0.7", "10.0.0.8"] {
            let _ = first.resolved(ip.parse().unwrap(), &buzz);
        }
        let _ = first.resolved("10.0.0.5".parse().unwrap(), &web);
        drop(first);

        let again = registry(());
        let mut moved = pod("10.0.0.9", true, &[]);
        moved.key = pod("10.0.0.6", true, &[]).key;
        let mut replaced = pod("10.0.0.7", true, &[]);
        replaced.key.name = "other".to_string();
        again.set_pods([
            pod("10.0.0.5", true, &[]),
            moved.clone(),
            replaced.clone(),
            pod("10.0.0.8", false, &[]),
        ]);
        let scope = |pod: &ScopedPod| again.attach(pod).unwrap().scope.borrow().clone();
        assert_eq!(
            names(&scope(&pod("10.0.0.5", true, &[]))),
            [
                "buzz.bar.foo.system.internal",
                "db.data.system.internal",
                "web.shop.system.internal"
            ],
            "what it resolved, and what it declared then"
        );
        assert!(
            scope(&moved).services.is_empty(),
            "same pod, another address"
        );
        assert!(
            scope(&replaced).services.is_empty(),
            "another pod at the address"
        );
        assert!(again.attach(&pod("10.0.0.8", false, &[])).is_none());
        let kept: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(kept.len(), 3, "one file per scoped pod that runs: {kept:?}");
        assert_eq!(again.metrics.store_errors.get(), 0);
    }
}
