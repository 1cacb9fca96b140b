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

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use crate::identity::PodEntry;

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
        metrics
    }
}

struct PodScope {
    scoped: bool,
    declared: Vec<Arc<str>>,
    scope: watch::Sender<Scope>,
    /// The newest generation the pod's proxy holds completely.
    acked: watch::Sender<u64>,
}

impl PodScope {
    fn new(pod: &ScopedPod) -> PodScope {
        let services: BTreeSet<Arc<str>> = pod.declared.iter().cloned().collect();
        PodScope {
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
}

impl ScopeRegistry {
    pub fn new(wait: Duration, metrics: ScopeMetrics) -> Self {
        ScopeRegistry {
            pods: RwLock::default(),
            wait,
            metrics,
        }
    }

    /// Makes the known pods exactly `pods`: a pod that stays keeps what it resolved, one that
    /// went away is forgotten, and a changed declaration adds to the scope.
    pub fn set_pods(&self, pods: impl IntoIterator<Item = ScopedPod>) {
        let mut known = self.pods.write().unwrap_or_else(|p| p.into_inner());
        let mut next = HashMap::new();
        for pod in pods {
            let ip = pod.ip.to_canonical();
            match known.remove(&ip) {
                Some(mut held) if held.scoped == pod.scoped => {
                    if held.declared != pod.declared {
                        held.add(&pod.declared);
                        held.declared = pod.declared;
                    }
                    next.insert(ip, held);
                }
                // New, or its opt-out changed: start afresh (a stream that follows the old
                // entry sees its sender go and is closed by its pod check anyway).
                _ => {
                    next.insert(ip, PodScope::new(&pod));
                }
            }
        }
        *known = next;
    }

    /// The scope the proxy of `pod` follows, or `None` when that proxy holds the whole mesh.
    /// A pod the registry does not know yet (its proxy connected before the pod list reached
    /// the registry) is added as it is.
    pub fn attach(&self, pod: &ScopedPod) -> Option<ScopeWatch> {
        let mut pods = self.pods.write().unwrap_or_else(|p| p.into_inner());
        let held = pods
            .entry(pod.ip.to_canonical())
            .or_insert_with(|| PodScope::new(pod));
        held.scoped.then(|| ScopeWatch {
            scope: held.scope.subscribe(),
            acked: held.acked.clone(),
        })
    }

    /// `client` resolved a name of `service`. `None` when nothing needs waiting for: the
    /// service was in its scope already (the common case: a read lock and a set lookup), the
    /// client is not a scoped pod, or no proxy follows its scope. Otherwise the service is added
    /// and the future ends when the pod's proxy holds it, or after the bounded wait.
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
}
