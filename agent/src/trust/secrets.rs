//! The secrets of the node's proxies: for each identity a proxy of the node was verified as,
//! its leaf and the trust bundle, published to every stream of that identity
//! ([`NodeSecrets::watch`]) and followed as leaves renew and the issuer changes. An identity
//! is wanted while a verified stream of it lives, and forgotten (its leaf with it) when the
//! last one ends: the agent never holds a leaf for an identity no proxy of its node has.
//!
//! Leaves are issued by one task ([`NodeSecrets::run`]), outside the lock: a remote signer
//! takes a round trip per leaf, so up to [`MOST_IN_FLIGHT`] are asked for at once, and a
//! stream verified as a new identity waits for its leaf (Envoy waits for its secrets) rather
//! than for the leaves of others.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;

use serde_json::{Value, json};
use time::OffsetDateTime;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use super::authority::{AuthorityState, IdentityLabel, ReasonLabel, TrustMetrics};
use super::issuer::{Leaf, LeafPolicy};
use super::leaves::{LeafError, Leaves, Ticket};
use super::signer::{Signer, issue_at};
use super::spiffe::SpiffeId;

/// What a proxy of one identity is handed: its leaf and the bundle its peers are checked
/// against.
#[derive(Debug)]
pub struct ProxySecrets {
    pub identity: SpiffeId,
    pub leaf: Arc<Leaf>,
    /// PEM: every root of the trust bundle.
    pub bundle_pem: Arc<str>,
}

/// The renewing task's shortest and longest wait between two looks at what is due.
const LEAST_WAIT: Duration = Duration::from_secs(1);
const MOST_WAIT: Duration = Duration::from_secs(60);
/// Failures to issue are logged at most once per this interval, with the count of the rest.
const WARN_EVERY: Duration = Duration::from_secs(10);
/// The most leaves being issued at once: a node's pods starting together (110 at most by
/// default) do not open as many requests to a remote signer.
const MOST_IN_FLIGHT: usize = 16;

/// A leaf being issued: for whom, its ticket, and what came of it.
type Issuing = Pin<Box<dyn Future<Output = (SpiffeId, Ticket, Result<Leaf, LeafError>)> + Send>>;

type SecretsTx = watch::Sender<Option<Arc<ProxySecrets>>>;
/// An identity's secrets; `None` while it has no leaf (no issuer yet, or issuing failed).
pub type SecretsRx = watch::Receiver<Option<Arc<ProxySecrets>>>;

/// The node's secrets, shared by the xDS streams and the task that renews them.
#[derive(Clone)]
pub struct NodeSecrets {
    inner: Arc<Inner>,
}

struct Inner {
    trust_domain: String,
    state: Mutex<State>,
    /// Wakes the issuing task: an identity was added, so the next due time may be sooner.
    added: Notify,
    metrics: TrustMetrics,
    /// When a failure to issue was last logged, and how many were not since.
    warned: Mutex<(Option<std::time::Instant>, u64)>,
}

struct State {
    leaves: Leaves,
    signer: Option<Arc<Signer>>,
    slots: HashMap<SpiffeId, Slot>,
}

struct Slot {
    tx: SecretsTx,
    /// Live streams of this identity.
    streams: usize,
}

/// One stream's hold on an identity's secrets: the identity stays wanted while it lives.
pub struct SecretsWatch {
    pub rx: SecretsRx,
    identity: SpiffeId,
    inner: Arc<Inner>,
}

impl Drop for SecretsWatch {
    fn drop(&mut self) {
        let mut state = lock(&self.inner.state);
        let Some(slot) = state.slots.get_mut(&self.identity) else {
            return;
        };
        slot.streams -= 1;
        if slot.streams == 0 {
            state.slots.remove(&self.identity);
            state.leaves.forget(&self.identity);
            self.inner.metrics.leaf_expiry.remove(&IdentityLabel {
                identity: self.identity.to_string(),
            });
        }
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn now() -> i64 {
    OffsetDateTime::now_utc().unix_timestamp()
}

impl NodeSecrets {
    pub fn new(trust_domain: String, policy: LeafPolicy, metrics: TrustMetrics) -> NodeSecrets {
        // The jitter's seed: this process's start, so two agents do not renew in step.
        let seed = u64::from(std::process::id()) ^ now().unsigned_abs().rotate_left(17);
        NodeSecrets {
            inner: Arc::new(Inner {
                trust_domain,
                state: Mutex::new(State {
                    leaves: Leaves::new(policy, seed),
                    signer: None,
                    slots: HashMap::new(),
                }),
                added: Notify::new(),
                metrics,
                warned: Mutex::new((None, 0)),
            }),
        }
    }

    pub fn trust_domain(&self) -> &str {
        &self.inner.trust_domain
    }

    /// The secrets of `identity`, for a stream verified as one of its proxies: issued at once
    /// by the issuing task if the identity has no leaf yet.
    pub fn watch(&self, identity: SpiffeId) -> SecretsWatch {
        let mut state = lock(&self.inner.state);
        let state = &mut *state;
        let rx = match state.slots.get_mut(&identity) {
            Some(slot) => {
                slot.streams += 1;
                slot.tx.subscribe()
            }
            None => {
                let tx = watch::channel(None).0;
                let rx = tx.subscribe();
                state
                    .slots
                    .insert(identity.clone(), Slot { tx, streams: 1 });
                let now = now();
                state.leaves.want(&identity, now);
                // A local signer signs at once, so the proxy's first answer carries its leaf;
                // a remote one is asked by the issuing task.
                let policy = state.leaves.policy();
                if let Some(signer) = state.signer.clone()
                    && let Some(issuer) = signer.local()
                    && let Some(ticket) = state.leaves.take(&identity, now)
                {
                    let issued = issue_at(issuer, &identity, policy, now);
                    let recorded = state.leaves.record(&identity, ticket, issued, now);
                    self.inner.issued(state, &identity, recorded.err());
                }
                rx
            }
        };
        self.inner.added.notify_one();
        SecretsWatch {
            rx,
            identity,
            inner: self.inner.clone(),
        }
    }

    /// Issues and renews leaves when due and follows the signer, until `shutdown`.
    pub async fn run(
        self,
        mut authority: watch::Receiver<AuthorityState>,
        shutdown: CancellationToken,
    ) {
        let mut signer = authority.borrow_and_update().signer.clone();
        self.inner.new_signer(signer.clone());
        let mut issuing: FuturesUnordered<Issuing> = FuturesUnordered::new();
        loop {
            let next = {
                let mut state = lock(&self.inner.state);
                let state = &mut *state;
                let now = now();
                let room = MOST_IN_FLIGHT.saturating_sub(issuing.len());
                for (identity, ticket) in state.leaves.take_due(now, room) {
                    let Some(signer) = state.signer.clone() else {
                        let recorded =
                            state
                                .leaves
                                .record(&identity, ticket, Err(LeafError::NoIssuer), now);
                        self.inner.issued(state, &identity, recorded.err());
                        continue;
                    };
                    let policy = state.leaves.policy();
                    issuing.push(Box::pin(async move {
                        let issued = signer.sign(&identity, policy, now).await;
                        (identity, ticket, issued)
                    }));
                }
                state.leaves.next_due()
            };
            // Unix seconds to a wait: at least a second, so a leaf that cannot outlive its
            // issuer's last second is not issued again in a loop; at most a minute, so a clock
            // step or a paused machine is caught up with.
            let wait = next.map_or(MOST_WAIT, |due| {
                Duration::from_secs(u64::try_from(due - now()).unwrap_or(0))
                    .clamp(LEAST_WAIT, MOST_WAIT)
            });
            tokio::select! {
                Some((identity, ticket, issued)) = issuing.next(), if !issuing.is_empty() => {
                    let mut state = lock(&self.inner.state);
                    let state = &mut *state;
                    let recorded = state.leaves.record(&identity, ticket, issued, now());
                    if matches!(recorded, Ok(true))
                        && let Some(end) = state.signer.as_ref().and_then(|s| s.not_after())
                    {
                        self.inner.metrics.issuer_expiry.set(end);
                    }
                    self.inner.issued(state, &identity, recorded.err());
                }
                changed = authority.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let latest = authority.borrow_and_update().signer.clone();
                    let same = match (&signer, &latest) {
                        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                        (None, None) => true,
                        _ => false,
                    };
                    if !same {
                        signer = latest;
                        self.inner.new_signer(signer.clone());
                    }
                }
                () = tokio::time::sleep(wait) => {}
                () = self.inner.added.notified() => {}
                () = shutdown.cancelled() => return,
            }
        }
    }

    /// `/debug/identity`'s leaves: each identity with a leaf, its serial, its end, and how
    /// many streams hold it.
    pub fn debug(&self) -> Value {
        let state = lock(&self.inner.state);
        let now = now();
        let mut leaves: Vec<Value> = state
            .slots
            .iter()
            .map(|(identity, slot)| {
                let leaf = state.leaves.current(identity, now);
                json!({
                    "identity": identity.to_string(),
                    "streams": slot.streams,
                    "serial": leaf.as_ref().map(|l| l.serial.clone()),
                    "not_after": leaf.as_ref().map(|l| l.not_after),
                })
            })
            .collect();
        leaves.sort_by(|a, b| a["identity"].as_str().cmp(&b["identity"].as_str()));
        Value::Array(leaves)
    }
}

impl Inner {
    /// Another signer (or none): every leaf is issued again by it (by the issuing task), and
    /// every identity's secrets published with its bundle. With none, leaves held stay in use
    /// until they end.
    fn new_signer(&self, signer: Option<Arc<Signer>>) {
        let mut state = lock(&self.state);
        state.signer = signer;
        if state.signer.is_some() {
            // Every wanted identity has an entry (made by `watch`, issued or not): all of them
            // are issued again, those that had no leaf yet (no signer until now) included.
            state.leaves.renew_all(now());
        }
    }

    /// Publishes `identity`'s secrets after an issue (`failed`: why it failed; its leaf
    /// before, if any, stays).
    fn issued(&self, state: &mut State, identity: &SpiffeId, failed: Option<LeafError>) {
        if let Some(error) = failed {
            self.metrics
                .leaf_failures
                .get_or_create(&ReasonLabel {
                    reason: error.reason(),
                })
                .inc();
            if !matches!(error, LeafError::NoIssuer) {
                let mut warned = self.warned.lock().unwrap_or_else(|p| p.into_inner());
                let due = warned.0.is_none_or(|at| at.elapsed() >= WARN_EVERY);
                if due {
                    let suppressed = std::mem::take(&mut warned.1);
                    warned.0 = Some(std::time::Instant::now());
                    tracing::warn!(%identity, %error, suppressed, "a workload certificate could not be issued; the one held, if any, stays in use");
                } else {
                    warned.1 += 1;
                }
            }
        }
        let Some(slot) = state.slots.get(identity) else {
            return;
        };
        let leaf = state.leaves.current(identity, now());
        let secrets = match (leaf, &state.signer) {
            (Some(leaf), Some(signer)) => {
                self.metrics
                    .leaf_expiry
                    .get_or_create(&IdentityLabel {
                        identity: identity.to_string(),
                    })
                    .set(leaf.not_after);
                Some(Arc::new(ProxySecrets {
                    identity: identity.clone(),
                    leaf,
                    bundle_pem: Arc::from(signer.bundle_pem()),
                }))
            }
            // A leaf with its signer gone keeps the bundle it was published with.
            (Some(leaf), None) => slot.tx.borrow().as_ref().map(|held| {
                Arc::new(ProxySecrets {
                    identity: identity.clone(),
                    leaf,
                    bundle_pem: held.bundle_pem.clone(),
                })
            }),
            (None, _) => None,
        };
        slot.tx.send_if_modified(|held| {
            let same = match (&*held, &secrets) {
                (Some(a), Some(b)) => Arc::ptr_eq(&a.leaf, &b.leaf) && a.bundle_pem == b.bundle_pem,
                (None, None) => true,
                _ => false,
            };
            if !same {
                *held = secrets;
            }
            !same
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn issuer(name: &str) -> Arc<Signer> {
        Arc::new(Signer::Local(Box::new(super::super::issuer::test_root(
            name,
            OffsetDateTime::now_utc(),
        ))))
    }

    fn id(sa: &str) -> SpiffeId {
        SpiffeId::new("cluster.local", "shop", sa).unwrap()
    }

    async fn changed(rx: &mut SecretsRx) -> Option<Arc<ProxySecrets>> {
        tokio::time::timeout(Duration::from_secs(10), rx.changed())
            .await
            .expect("a change within 10 s")
            .unwrap();
        rx.borrow_and_update().clone()
    }

    #[tokio::test]
    async fn an_identity_gets_its_leaf_once_an_issuer_comes_and_a_new_one_when_it_changes() {
        let secrets = NodeSecrets::new(
            "cluster.local".into(),
            LeafPolicy::default(),
            TrustMetrics::default(),
        );
        let (authority, rx) = watch::channel(AuthorityState::default());
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(secrets.clone().run(rx, shutdown.clone()));

        let mut cart = secrets.watch(id("cart"));
        assert!(cart.rx.borrow_and_update().is_none(), "no issuer yet");

        let first = issuer("first CA");
        authority.send_modify(|s| s.signer = Some(first.clone()));
        let got = changed(&mut cart.rx).await.expect("a leaf");
        assert_eq!(got.identity, id("cart"));
        assert_eq!(&*got.bundle_pem, first.bundle_pem());
        assert!(got.leaf.chain_pem.contains("BEGIN CERTIFICATE"));

        // A second stream of the identity shares the leaf; another identity gets its own.
        let again = secrets.watch(id("cart"));
        let shared = again.rx.borrow().clone().unwrap();
        assert!(Arc::ptr_eq(&shared.leaf, &got.leaf));
        let pay = secrets.watch(id("pay"));
        let other = pay.rx.borrow().clone().expect("issued at once");
        assert_ne!(other.leaf.serial, got.leaf.serial);

        // A new issuer: every leaf again, with its bundle.
        let second = issuer("second CA");
        authority.send_modify(|s| s.signer = Some(second.clone()));
        let renewed = changed(&mut cart.rx).await.expect("a leaf");
        assert_ne!(renewed.leaf.serial, got.leaf.serial);
        assert_eq!(&*renewed.bundle_pem, second.bundle_pem());

        // The issuer gone: the leaf held stays.
        authority.send_modify(|s| s.signer = None);
        // Nothing is published: the window only bounds the wait for a change that must not come.
        let unchanged = tokio::time::timeout(Duration::from_millis(500), cart.rx.changed()).await;
        assert!(unchanged.is_err(), "the issuer's going changed the secrets");
        let kept = cart.rx.borrow().clone().expect("kept");
        assert!(Arc::ptr_eq(&kept.leaf, &renewed.leaf));

        // The last stream of an identity gone: forgotten.
        drop((cart, again));
        let shown = secrets.debug();
        let identities: Vec<&str> = shown
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["identity"].as_str().unwrap())
            .collect();
        assert_eq!(identities, ["spiffe://cluster.local/ns/shop/sa/pay"]);

        shutdown.cancel();
        task.await.unwrap();
    }
}
