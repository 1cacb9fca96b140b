//! Who may hold an ADS stream: the proxies of this node's pods, and only as themselves.
//!
//! With Kubernetes and `--node-name`, the source watches this node's Pods and publishes a
//! [`PodDirectory`] (pod IP → pod). The xDS server checks every stream against it twice: when
//! the stream opens, before a byte of it is read, the peer's IP must be a pod of this node
//! ([`IdentityCheck::check_peer`]); on its first request, the node id the proxy sends must name
//! that pod (`<pod>.<namespace>`, as `lattice-init` writes it; [`IdentityCheck::verify`]). Pods on
//! the host network share the node's IP, so their proxies cannot be told apart: they are
//! refused unless `--allow-host-network-proxies`. With only a mesh file there are no pods to
//! check against: identity checking is off, and binding xDS to an address only this node
//! reaches is the protection.

use std::borrow::Cow;
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
    /// The pod's service account (`default` when its spec names none, as Kubernetes'
    /// admission sets it): its proxy's workload identity.
    pub service_account: Arc<str>,
    /// Whether the pod's inbound TCP is captured to its proxy, and in which mode: then its
    /// proxy gets an inbound listener.
    pub inbound: Option<InboundMode>,
    /// The kubelet's probes of its containers, sorted: what the inbound listener lets through
    /// without an identity when the pod is strict or its port has authorization rules.
    pub probes: Vec<InboundProbe>,
}

/// A kubelet probe that the pod's inbound listener must let through without an identity.
/// (A `tcpSocket` probe is none: Envoy takes every captured connection, so the kubelet's
/// connect succeeds whatever follows. An HTTPS `httpGet` is none either: it cannot be told
/// from any other TLS that is not the mesh's, so it is not let through.)
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct InboundProbe {
    pub port: u16,
    pub kind: ProbeKind,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum ProbeKind {
    /// An HTTP `httpGet`: a GET of this path (without its query).
    Http(Arc<str>),
    /// A `grpc` probe: the health service's Check, over HTTP/2 in plaintext.
    Grpc,
}

/// What a pod's inbound listener does with a connection that is not mesh mTLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum InboundMode {
    /// Handed to the app as it came: the default, while callers are not all in the mesh.
    Permissive,
    /// Refused: only callers with a mesh identity reach the app.
    Strict,
}

impl std::fmt::Display for InboundMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            InboundMode::Permissive => "permissive",
            InboundMode::Strict => "strict",
        })
    }
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

    /// Every pod at `ip` (several only on the host network, or while a pod that went keeps
    /// an address another was given).
    pub fn at(&self, ip: IpAddr) -> &[PodEntry] {
        self.by_ip
            .get(&ip.to_canonical())
            .map_or(&[], Vec::as_slice)
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
        /// As the proxy sent it, [`shown`].
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

/// What is known of a stream's peer when the stream opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// The address of a pod of this node (identity checking on); its first request must still
    /// name that pod.
    Pod,
    /// Identity checking is off: anyone who reaches the xDS address.
    Unchecked,
}

impl IdentityCheck {
    /// Whether a stream from `peer` may be read at all: with checking on, only one from the
    /// address of a pod of this node (not on the host network, unless allowed). Decided before
    /// any of the stream is read, so a stranger cannot make the agent hold anything.
    pub fn check_peer(&self, peer: Option<IpAddr>) -> Result<Standing, Refusal> {
        let IdentityCheck::Pods {
            pods,
            allow_host_network,
        } = self
        else {
            return Ok(Standing::Unchecked);
        };
        let directory = pods.borrow().clone().ok_or(Refusal::NotSynced)?;
        let ip = peer.ok_or(Refusal::NoPeer)?.to_canonical();
        let candidates = directory
            .by_ip
            .get(&ip)
            .ok_or(Refusal::UnknownPeer { ip })?;
        if candidates.iter().any(|p| p.host_network) && !allow_host_network {
            return Err(host_network(ip, candidates));
        }
        Ok(Standing::Pod)
    }

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
            return Err(host_network(ip, candidates));
        }
        candidates
            .iter()
            .find(|p| p.key.node_id() == node_id)
            .map(|p| Some(p.key.clone()))
            .ok_or_else(|| Refusal::WrongNodeId {
                node_id: shown(node_id).into_owned(),
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

fn host_network(ip: IpAddr, candidates: &[PodEntry]) -> Refusal {
    let pods = candidates
        .iter()
        .map(|p| p.key.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    Refusal::HostNetwork { ip, pods }
}

/// The most of a text a peer chose (a node id, a type URL, a NACK's error) that the agent
/// repeats, in a log line, a gRPC status or `/debug/xds`: a node id is `<pod>.<namespace>`,
/// at most 317 bytes, and an Envoy error message a line or two.
pub const SHOWN: usize = 512;

/// `text` as the agent shows what a peer chose: at most [`SHOWN`] bytes of it (cut on a
/// character boundary), and how much was left out. A peer that sends a node id of megabytes
/// gets neither the log nor its status echo that large.
pub fn shown(text: &str) -> Cow<'_, str> {
    if text.len() <= SHOWN {
        return Cow::Borrowed(text);
    }
    let mut end = SHOWN;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!(
        "{}… ({} more bytes)",
        &text[..end],
        text.len() - end
    ))
}

/// Logs events of a kind (a refusal's reason, a NACK) at most `burst` times per interval,
/// with how many were not logged: a misconfigured or hostile workload repeating itself in a
/// loop must not flood the agent's log.
#[derive(Debug)]
pub struct RateLimitedLog {
    interval: Duration,
    burst: u64,
    /// Per kind: when its interval began, how many were logged in it, how many not.
    last: Mutex<HashMap<&'static str, Window>>,
}

#[derive(Debug)]
struct Window {
    began: Instant,
    logged: u64,
    suppressed: u64,
}

impl Default for RateLimitedLog {
    fn default() -> Self {
        RateLimitedLog::with_burst(1)
    }
}

impl RateLimitedLog {
    /// `burst` lines of each kind per 10 s.
    pub fn with_burst(burst: u64) -> Self {
        RateLimitedLog {
            interval: Duration::from_secs(10),
            burst: burst.max(1),
            last: Mutex::new(HashMap::new()),
        }
    }

    /// `Some(n)`: log this refusal, and say `n` of its reason were not logged since the last.
    pub fn admit(&self, refusal: &Refusal) -> Option<u64> {
        self.admit_kind(refusal.reason())
    }

    /// `Some(n)`: log this event of `kind`, and say `n` like it were not logged since the last.
    pub fn admit_kind(&self, kind: &'static str) -> Option<u64> {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let window = last.entry(kind).or_insert(Window {
            began: now,
            logged: 0,
            suppressed: 0,
        });
        if now.duration_since(window.began) >= self.interval {
            window.began = now;
            window.logged = 0;
        }
        if window.logged >= self.burst {
            window.suppressed += 1;
            return None;
        }
        window.logged += 1;
        Some(std::mem::take(&mut window.suppressed))
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
            service_account: Arc::from("default"),
            inbound: None,
            probes: Vec::new(),
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
        assert_eq!(IdentityCheck::Off.check_peer(None), Ok(Standing::Unchecked));
        assert!(IdentityCheck::Off.subscribe().is_none());
    }

    #[test]
    fn a_peer_is_checked_by_its_address_alone_before_anything_is_read() {
        let (_tx, refusing) = check(Some(node_pods()), false);
        assert_eq!(refusing.check_peer(ip("10.0.0.2")), Ok(Standing::Pod));
        assert_eq!(
            refusing.check_peer(ip("::ffff:10.0.0.3")),
            Ok(Standing::Pod)
        );
        assert_eq!(
            refusing.check_peer(ip("10.9.9.9")).unwrap_err().reason(),
            "unknown_peer"
        );
        assert_eq!(refusing.check_peer(None), Err(Refusal::NoPeer));
        assert_eq!(
            refusing.check_peer(ip("192.168.1.5")).unwrap_err().reason(),
            "host_network"
        );
        let (_tx, allowing) = check(Some(node_pods()), true);
        assert_eq!(allowing.check_peer(ip("192.168.1.5")), Ok(Standing::Pod));
        let (_tx, unsynced) = check(None, false);
        assert_eq!(unsynced.check_peer(ip("10.0.0.2")), Err(Refusal::NotSynced));
    }

    #[test]
    fn what_a_peer_chose_is_shown_cut_short() {
        assert_eq!(shown("web-1.shop"), "web-1.shop");
        let long = "é".repeat(SHOWN);
        let cut = shown(&long);
        assert!(cut.len() < SHOWN + 32, "{}", cut.len());
        assert!(
            cut.ends_with(&format!("… ({} more bytes)", 2 * SHOWN - SHOWN)),
            "{cut}"
        );
        let (_tx, checking) = check(Some(node_pods()), false);
        let huge = "x".repeat(3 << 20);
        let refusal = checking.verify(ip("10.0.0.2"), Some(&huge)).unwrap_err();
        assert!(
            refusal.to_string().len() < 1024,
            "the node id is echoed whole"
        );
    }

    #[test]
    fn refusals_are_logged_once_per_reason_and_interval() {
        let log = RateLimitedLog::default();
        let unknown = Refusal::UnknownPeer {
            ip: "10.9.9.9".parse().unwrap(),
        };
        assert_eq!(log.admit(&unknown), Some(0));
        assert_eq!(log.admit(&unknown), None);
        assert_eq!(log.admit(&unknown), None);
        assert_eq!(log.admit(&Refusal::NoNodeId), Some(0), "another reason");
        let log = RateLimitedLog {
            interval: Duration::ZERO,
            ..log
        };
        assert_eq!(log.admit(&unknown), Some(2), "two were not logged");

        let bursty = RateLimitedLog::with_burst(3);
        let logged: Vec<_> = (0..5).map(|_| bursty.admit_kind("connected")).collect();
        assert_eq!(logged, [Some(0), Some(0), Some(0), None, None]);
    }
}
