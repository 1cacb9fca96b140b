//! Who may hold an ADS stream: the proxies of this node's pods, and only as themselves.
//!
//! With Kubernetes and `--node-name`, the source watches this node's Pods and publishes a
//! [`PodDirectory`] (pod IP → pod). The xDS server checks every stream against it
//! ([`IdentityCheck::verify`]): the peer's IP must be a pod of this node, and the node id the
//! proxy sends must name that pod (`<pod>.<namespace>`, as `lattice-init` writes it). Pods on
//! the host network share the node's IP, so their proxies cannot be told apart: they are
//! refused unless `--allow-host-network-proxies`. With only a mesh file there are no pods to
//! check against: identity checking is off, and binding xDS to an address only this node
//! reaches is the protection.

use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

/// A pod of this node, by namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodKey {
    pub namespace: String,
    pub name: String,
}

impl PodKey {
    /// The node id its proxy must send: `<pod>.<namespace>`.
    pub fn node_id(&self) -> String {
        format!("{}.{}", self.name, self.namespace)
    }
}

impl fmt::Display for PodKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Pods named by namespace and name, as a mesh file's `clients:` names them: `shop/web-0`
/// (that pod), `shop/web-*` (a name prefix: a Deployment's or StatefulSet's pods) or `shop/*`
/// (every pod of the namespace).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodPattern {
    namespace: String,
    name: String,
    prefix: bool,
}

impl std::str::FromStr for PodPattern {
    type Err = String;

    fn from_str(pattern: &str) -> Result<Self, Self::Err> {
        let (namespace, name) = pattern
            .split_once('/')
            .ok_or_else(|| format!("{pattern:?} is not <namespace>/<pod name>"))?;
        let (name, prefix) = match name.strip_suffix('*') {
            Some(stem) => (stem, true),
            None => (name, false),
        };
        let valid = |part: &str| {
            part.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        };
        if namespace.is_empty() || !valid(namespace) || !valid(name) || (!prefix && name.is_empty())
        {
            return Err(format!(
                "{pattern:?} is not <namespace>/<pod name>, with an optional * at the end \
                 (lower-case letters, digits, - and .)"
            ));
        }
        Ok(PodPattern {
            namespace: namespace.to_string(),
            name: name.to_string(),
            prefix,
        })
    }
}

impl PodPattern {
    pub fn matches(&self, pod: &PodKey) -> bool {
        pod.namespace == self.namespace
            && if self.prefix {
                pod.name.starts_with(&self.name)
            } else {
                pod.name == self.name
            }
    }
}

/// A pod as identity checking needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodEntry {
    pub key: PodKey,
    pub ip: IpAddr,
    pub host_network: bool,
    /// Carried for proxy scoping: false when the pod opted out (its proxy holds the whole
    /// mesh), and the services it declared it uses, by DNS name.
    pub scoped: bool,
    pub uses: Vec<Arc<str>>,
}

/// This node's pods that may run a proxy (they have an IP and have not finished), by IP. Several
/// pods share an IP only on the host network.
#[derive(Clone, Debug, Default)]
pub struct PodDirectory {
    by_ip: HashMap<IpAddr, Vec<PodEntry>>,
}

impl PodDirectory {
    pub fn new(pods: impl IntoIterator<Item = PodEntry>) -> Self {
        let mut by_ip: HashMap<IpAddr, Vec<PodEntry>> = HashMap::new();
        for pod in pods {
            by_ip.entry(pod.ip.to_canonical()).or_default().push(pod);
        }
        for pods in by_ip.values_mut() {
            pods.sort_by(|a, b| a.key.cmp(&b.key));
        }
        PodDirectory { by_ip }
    }

    /// Every entry.
    pub fn entries(&self) -> impl Iterator<Item = &PodEntry> {
        self.by_ip.values().flatten()
    }

    /// The entry of `pod` at `ip`.
    pub fn entry(&self, pod: &PodKey, ip: IpAddr) -> Option<&PodEntry> {
        self.by_ip
            .get(&ip.to_canonical())?
            .iter()
            .find(|p| p.key == *pod)
    }

    /// Whether `pod` still runs at `ip`.
    pub fn holds(&self, pod: &PodKey, ip: IpAddr) -> bool {
        self.by_ip
            .get(&ip.to_canonical())
            .is_some_and(|pods| pods.iter().any(|p| p.key == *pod))
    }
}

pub type PodsTx = watch::Sender<Option<Arc<PodDirectory>>>;
pub type PodsRx = watch::Receiver<Option<Arc<PodDirectory>>>;

/// The channel from the pod watch to the xDS server; `None` until the first complete list.
pub fn channel() -> (PodsTx, PodsRx) {
    watch::channel(None)
}

/// Why a stream was refused. Each says what did not match, for the proxy's log (the gRPC
/// status message) and the agent's.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Not a denial: the pod list is not synced yet, so the proxy should retry.
    #[error("the agent has not synced this node's pods yet; retry")]
    NotSynced,
    #[error("the proxy sent no node id; lattice-init writes <pod>.<namespace>")]
    NoNodeId,
    #[error("the peer address is unknown")]
    NoPeer,
    #[error("{ip} is not the address of a running pod on this node")]
    UnknownPeer { ip: IpAddr },
    #[error(
        "node id {node_id:?} does not name the pod at {ip}, which is {pod} (node id {:?})",
        pod.node_id()
    )]
    WrongNodeId {
        node_id: String,
        ip: IpAddr,
        pod: PodKey,
    },
    #[error(
        "{ip} is the host network, shared by {pods}: a proxy there cannot be told apart from \
         the node's other processes; the agent refuses it unless --allow-host-network-proxies"
    )]
    HostNetwork { ip: IpAddr, pods: String },
    #[error("pod {pod} no longer runs at {ip} on this node")]
    Gone { pod: PodKey, ip: IpAddr },
}

impl Refusal {
    /// The metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::NotSynced => "not_synced",
            Refusal::NoNodeId => "no_node_id",
            Refusal::NoPeer => "no_peer",
            Refusal::UnknownPeer { .. } => "unknown_peer",
            Refusal::WrongNodeId { .. } => "wrong_node_id",
            Refusal::HostNetwork { .. } => "host_network",
            Refusal::Gone { .. } => "pod_gone",
        }
    }
}

/// How ADS streams are checked.
#[derive(Clone, Debug)]
pub enum IdentityCheck {
    /// Everyone who reaches the xDS address is served (mesh files only, or no --node-name).
    Off,
    /// Only this node's pods, as themselves.
    Pods {
        pods: PodsRx,
        allow_host_network: bool,
    },
}

impl IdentityCheck {
    /// The pod a stream from `peer` with `node_id` belongs to, or why it is refused. `Ok(None)`
    /// when checking is off.
    pub fn verify(
        &self,
        peer: Option<IpAddr>,
        node_id: Option<&str>,
    ) -> Result<Option<PodKey>, Refusal> {
        let IdentityCheck::Pods {
            pods,
            allow_host_network,
        } = self
        else {
            return Ok(None);
        };
        let directory = pods.borrow().clone().ok_or(Refusal::NotSynced)?;
        let ip = peer.ok_or(Refusal::NoPeer)?.to_canonical();
        let node_id = node_id.filter(|n| !n.is_empty()).ok_or(Refusal::NoNodeId)?;
        let candidates = directory
            .by_ip
            .get(&ip)
            .ok_or(Refusal::UnknownPeer { ip })?;
        if candidates.iter().any(|p| p.host_network) && !allow_host_network {
            let pods = candidates
                .iter()
                .map(|p| p.key.to_string())
                .collect::<Vec<_>>()
                .join(", ");
            return Err(Refusal::HostNetwork { ip, pods });
        }
        candidates
            .iter()
            .find(|p| p.key.node_id() == node_id)
            .map(|p| Some(p.key.clone()))
            .ok_or_else(|| Refusal::WrongNodeId {
                node_id: node_id.to_string(),
                ip,
                // One pod per IP off the host network; on it, name the first.
                pod: candidates[0].key.clone(),
            })
    }

    /// A receiver that changes when the pods do, to re-check a stream's pod; `None` when
    /// checking is off.
    pub fn subscribe(&self) -> Option<PodsRx> {
        match self {
            IdentityCheck::Off => None,
            IdentityCheck::Pods { pods, .. } => Some(pods.clone()),
        }
    }
}

/// Logs refusals at most once per reason per interval, with how many were not logged: a
/// misconfigured workload reconnecting in a loop must not flood the agent's log.
#[derive(Debug)]
pub struct RefusalLog {
    interval: Duration,
    last: Mutex<HashMap<&'static str, (Instant, u64)>>,
}

impl Default for RefusalLog {
    fn default() -> Self {
        RefusalLog {
            interval: Duration::from_secs(10),
            last: Mutex::new(HashMap::new()),
        }
    }
}

impl RefusalLog {
    /// `Some(n)`: log this one, and say `n` like it were not logged since the last.
    pub fn admit(&self, refusal: &Refusal) -> Option<u64> {
        self.admit_reason(refusal.reason())
    }

    /// [`RefusalLog::admit`] for a refusal known by its metric label alone.
    pub fn admit_reason(&self, reason: &'static str) -> Option<u64> {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        match last.get_mut(reason) {
            Some((at, suppressed)) if now.duration_since(*at) < self.interval => {
                *suppressed += 1;
                None
            }
            Some((at, suppressed)) => {
                let skipped = *suppressed;
                *at = now;
                *suppressed = 0;
                Some(skipped)
            }
            None => {
                last.insert(reason, (now, 0));
                Some(0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(namespace: &str, name: &str, ip: &str, host_network: bool) -> PodEntry {
        PodEntry {
            key: PodKey {
                namespace: namespace.to_string(),
                name: name.to_string(),
            },
            ip: ip.parse().unwrap(),
            host_network,
            scoped: true,
            uses: Vec::new(),
        }
    }

    #[test]
    fn pod_patterns_name_a_pod_a_prefix_or_a_namespace() {
        let key = |namespace: &str, name: &str| PodKey {
            namespace: namespace.to_string(),
            name: name.to_string(),
        };
        let web: PodPattern = "shop/web-*".parse().unwrap();
        assert!(web.matches(&key("shop", "web-7d9f-x2")));
        assert!(!web.matches(&key("shop", "worker-1")));
        assert!(!web.matches(&key("other", "web-1")));
        let one: PodPattern = "shop/web-0".parse().unwrap();
        assert!(one.matches(&key("shop", "web-0")) && !one.matches(&key("shop", "web-01")));
        let all: PodPattern = "shop/*".parse().unwrap();
        assert!(all.matches(&key("shop", "anything")));
        for bad in ["shop", "/web", "shop/", "shop/We*", "shop/w*b", "*/web"] {
            assert!(bad.parse::<PodPattern>().is_err(), "{bad}");
        }
    }

    fn check(pods: Option<Vec<PodEntry>>, allow_host_network: bool) -> (PodsTx, IdentityCheck) {
        let (tx, rx) = channel();
        tx.send_replace(pods.map(|p| Arc::new(PodDirectory::new(p))));
        (
            tx,
            IdentityCheck::Pods {
                pods: rx,
                allow_host_network,
            },
        )
    }

    fn node_pods() -> Vec<PodEntry> {
        vec![
            pod("shop", "web-1", "10.0.0.2", false),
            pod("shop", "cart-7", "10.0.0.3", false),
            pod("kube-system", "proxy", "192.168.1.5", true),
            pod("kube-system", "exporter", "192.168.1.5", true),
        ]
    }

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    #[test]
    fn the_right_pod_with_its_own_node_id_is_accepted() {
        let (_tx, check) = check(Some(node_pods()), false);
        let pod = check.verify(ip("10.0.0.2"), Some("web-1.shop")).unwrap();
        assert_eq!(pod.unwrap().to_string(), "shop/web-1");
        // An IPv4-mapped IPv6 peer is the same pod.
        assert!(
            check
                .verify(ip("::ffff:10.0.0.2"), Some("web-1.shop"))
                .is_ok()
        );
    }

    #[test]
    fn a_wrong_node_id_an_unknown_ip_or_no_node_id_is_refused_saying_what_did_not_match() {
        let (_tx, check) = check(Some(node_pods()), false);
        let err = check
            .verify(ip("10.0.0.2"), Some("cart-7.shop"))
            .unwrap_err();
        assert_eq!(err.reason(), "wrong_node_id");
        assert_eq!(
            err.to_string(),
            "node id \"cart-7.shop\" does not name the pod at 10.0.0.2, which is shop/web-1 \
             (node id \"web-1.shop\")"
        );
        let err = check
            .verify(ip("10.9.9.9"), Some("web-1.shop"))
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "10.9.9.9 is not the address of a running pod on this node"
        );
        assert_eq!(
            check.verify(ip("10.0.0.2"), Some("")).unwrap_err(),
            Refusal::NoNodeId
        );
        assert_eq!(
            check.verify(None, Some("web-1.shop")).unwrap_err(),
            Refusal::NoPeer
        );
    }

    #[test]
    fn host_network_pods_are_refused_unless_allowed() {
        let (_tx, refusing) = check(Some(node_pods()), false);
        let err = refusing
            .verify(ip("192.168.1.5"), Some("proxy.kube-system"))
            .unwrap_err();
        assert_eq!(err.reason(), "host_network");
        assert!(
            err.to_string().contains("--allow-host-network-proxies"),
            "{err}"
        );
        let (_tx, allowing) = check(Some(node_pods()), true);
        let pod = allowing
            .verify(ip("192.168.1.5"), Some("proxy.kube-system"))
            .unwrap();
        assert_eq!(pod.unwrap().name, "proxy");
    }

    #[test]
    fn nothing_is_decided_before_the_pods_are_synced_and_a_deleted_pod_is_noticed() {
        let (tx, check) = check(None, false);
        assert_eq!(
            check
                .verify(ip("10.0.0.2"), Some("web-1.shop"))
                .unwrap_err(),
            Refusal::NotSynced
        );
        tx.send_replace(Some(Arc::new(PodDirectory::new(node_pods()))));
        let pod = check
            .verify(ip("10.0.0.2"), Some("web-1.shop"))
            .unwrap()
            .unwrap();
        let mut changes = check.subscribe().unwrap();
        let mut without: Vec<PodEntry> = node_pods();
        without.retain(|p| p.key != pod);
        tx.send_replace(Some(Arc::new(PodDirectory::new(without))));
        assert!(changes.has_changed().unwrap());
        let directory = changes.borrow_and_update().clone().unwrap();
        assert!(!directory.holds(&pod, "10.0.0.2".parse().unwrap()));
    }

    #[test]
    fn checking_off_accepts_everyone() {
        assert_eq!(IdentityCheck::Off.verify(None, None), Ok(None));
        assert!(IdentityCheck::Off.subscribe().is_none());
    }

    #[test]
    fn refusals_are_logged_once_per_reason_and_interval() {
        let log = RefusalLog::default();
        let unknown = Refusal::UnknownPeer {
            ip: "10.9.9.9".parse().unwrap(),
        };
        assert_eq!(log.admit(&unknown), Some(0));
        assert_eq!(log.admit(&unknown), None);
        assert_eq!(log.admit(&unknown), None);
        assert_eq!(log.admit(&Refusal::NoNodeId), Some(0), "another reason");
        let log = RefusalLog {
            interval: Duration::ZERO,
            ..log
        };
        assert_eq!(log.admit(&unknown), Some(2), "two were not logged");
    }
}
