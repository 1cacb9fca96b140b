//! The leaves the node's proxies hold, one per identity: pods of one service account on the
//! node share it, as ztunnel's do. A leaf is issued when an identity is first wanted, renewed
//! once half its life is gone (plus up to a tenth of it, at random, so a node's leaves do not
//! all renew at once: Istio's `SECRET_GRACE_PERIOD_RATIO` with its jitter), and forgotten when
//! no pod of the node has that identity any more.
//!
//! A renewal that fails keeps the leaf it would have replaced, which stays valid until its own
//! end, and is tried again with backoff (doubling from a second, capped at a minute and, while
//! the leaf lasts, at a second before its end); a signer outage shorter than what is left of a
//! leaf's life fails nothing.
//!
//! Time is passed in (Unix seconds), so the schedule is tested against a plain model without
//! waiting.

use std::collections::HashMap;
use std::sync::Arc;

use super::issuer::{IssuerError, Leaf, LeafPolicy};
use super::istio_ca::IstioCaError;
use super::spiffe::SpiffeId;

/// The first retry after a failed issue, and the most between two.
const FIRST_RETRY: i64 = 1;
const MOST_RETRY: i64 = 60;

/// One identity's leaf and its schedule.
#[derive(Clone, Debug)]
struct Entry {
    leaf: Option<Arc<Leaf>>,
    /// When to issue next (renew, or retry).
    due: i64,
    /// Failures since the last issue that worked.
    failures: u32,
    /// Being issued: the ticket it was handed out with ([`Leaves::take_due`]).
    in_flight: Option<Ticket>,
}

/// What an identity is handed out for issuing with, and given back with: the signer's
/// generation, and a serial of its own, so that what comes back of a request made before the
/// identity was forgotten and wanted again is not taken for the new request's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    generation: u64,
    serial: u64,
}

/// Why an identity has no leaf.
#[derive(Debug, thiserror::Error)]
pub enum LeafError {
    #[error("no issuer (the CA's Secret is absent or was never readable)")]
    NoIssuer,
    #[error(transparent)]
    Issuer(#[from] IssuerError),
    #[error(transparent)]
    IstioCa(#[from] IstioCaError),
    #[error("the clock reads {0}, past what a certificate can say")]
    Clock(i64),
}

impl LeafError {
    /// The metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            LeafError::NoIssuer => "no_issuer",
            LeafError::Issuer(_) => "issuer",
            LeafError::IstioCa(error) => error.reason(),
            LeafError::Clock(_) => "clock",
        }
    }
}

/// The leaves of the node's identities, and when each is issued next. Issuing itself is the
/// caller's (it may take a network round trip): [`Leaves::take_due`] hands out what is due,
/// [`Leaves::record`] takes back what came of it.
#[derive(Debug)]
pub struct Leaves {
    policy: LeafPolicy,
    entries: HashMap<SpiffeId, Entry>,
    /// The signer's generation: a leaf issued by a signer since replaced is issued again.
    generation: u64,
    /// The last ticket's serial.
    tickets: u64,
    /// The jitter's source: a small xorshift, seeded per agent, so two agents do not renew in
    /// step; not for anything secret.
    state: u64,
}

impl Leaves {
    pub fn new(policy: LeafPolicy, seed: u64) -> Leaves {
        Leaves {
            policy,
            entries: HashMap::new(),
            generation: 0,
            tickets: 0,
            state: seed | 1,
        }
    }

    pub fn policy(&self) -> LeafPolicy {
        self.policy
    }

    /// `id` is wanted from `now` on: due at once if it was not wanted yet.
    pub fn want(&mut self, id: &SpiffeId, now: i64) {
        self.entries.entry(id.clone()).or_insert(Entry {
            leaf: None,
            due: now,
            failures: 0,
            in_flight: None,
        });
    }

    /// The leaf `id` holds now, if any is valid.
    pub fn current(&self, id: &SpiffeId, now: i64) -> Option<Arc<Leaf>> {
        self.entries
            .get(id)
            .and_then(|e| e.leaf.clone())
            .filter(|leaf| leaf.not_after > now)
    }

    /// Up to `most` identities due at `now` and not being issued already, now being issued,
    /// each with its ticket for [`Leaves::record`].
    pub fn take_due(&mut self, now: i64, most: usize) -> Vec<(SpiffeId, Ticket)> {
        let mut due: Vec<(i64, &SpiffeId)> = self
            .entries
            .iter()
            .filter(|(_, e)| e.due <= now && e.in_flight.is_none())
            .map(|(id, e)| (e.due, id))
            .collect();
        // The longest waiting first, so a bound on issues at once starves no one.
        due.sort_unstable();
        let due: Vec<SpiffeId> = due
            .into_iter()
            .take(most)
            .map(|(_, id)| id.clone())
            .collect();
        due.into_iter()
            .filter_map(|id| {
                let ticket = self.take(&id, now)?;
                Some((id, ticket))
            })
            .collect()
    }

    /// Takes `id` alone, as [`Leaves::take_due`] would, if it is due at `now` and not being
    /// issued already.
    pub fn take(&mut self, id: &SpiffeId, now: i64) -> Option<Ticket> {
        let entry = self.entries.get_mut(id)?;
        if entry.due > now || entry.in_flight.is_some() {
            return None;
        }
        self.tickets += 1;
        let ticket = Ticket {
            generation: self.generation,
            serial: self.tickets,
        };
        entry.in_flight = Some(ticket);
        Some(ticket)
    }

    /// What came of issuing `id` (handed out with `ticket`) at `now`: a new leaf is held and
    /// renewed once half its life is gone; a failure keeps the leaf held and retries with
    /// backoff. `Ok(true)` when `id` holds a new leaf; `Ok(false)` when the ticket is no
    /// longer the identity's (forgotten since, maybe wanted again).
    pub fn record(
        &mut self,
        id: &SpiffeId,
        ticket: Ticket,
        issued: Result<Leaf, LeafError>,
        now: i64,
    ) -> Result<bool, LeafError> {
        let jitter = self.jitter();
        let current = self.generation;
        let Some(entry) = self
            .entries
            .get_mut(id)
            .filter(|e| e.in_flight == Some(ticket))
        else {
            return issued.map(|_| false);
        };
        entry.in_flight = None;
        if ticket.generation != current {
            // Issued by a signer since replaced: taken only when it is all there is, and
            // issued again at once by the one in use.
            entry.due = now;
            return match issued {
                Ok(leaf) if entry.leaf.as_ref().is_none_or(|l| l.not_after <= now) => {
                    entry.leaf = Some(Arc::new(leaf));
                    Ok(true)
                }
                Ok(_) => Ok(false),
                Err(error) => Err(error),
            };
        }
        match issued {
            Ok(leaf) => {
                // Renew once half of its own life is gone, plus the jitter: a leaf capped at
                // its issuer's end renews in time too.
                let life = (leaf.not_after - now).max(0);
                entry.due = now + life / 2 + (life / 10) * jitter / 1000;
                entry.failures = 0;
                entry.leaf = Some(Arc::new(leaf));
                Ok(true)
            }
            Err(error) => {
                let backoff = (FIRST_RETRY << entry.failures.min(16)).min(MOST_RETRY);
                entry.failures = entry.failures.saturating_add(1);
                // The last try a second before the leaf ends, while it still serves; after
                // its end, the backoff alone, so a long outage is not asked every second.
                let end = entry.leaf.as_ref().map_or(i64::MAX, |l| l.not_after);
                entry.due = if end > now {
                    (now + backoff).min((end - 1).max(now + 1))
                } else {
                    now + backoff
                };
                Err(error)
            }
        }
    }

    /// Another signer: every leaf is issued again now (leaves of the one before may chain to
    /// a root being dropped); those being issued by the one before, once they come back.
    pub fn renew_all(&mut self, now: i64) {
        self.generation += 1;
        for entry in self.entries.values_mut() {
            entry.due = entry.due.min(now);
        }
    }

    /// When the next leaf not being issued is due, if any.
    pub fn next_due(&self) -> Option<i64> {
        self.entries
            .values()
            .filter(|e| e.in_flight.is_none())
            .map(|e| e.due)
            .min()
    }

    /// `id` is no one's on this node any more.
    pub fn forget(&mut self, id: &SpiffeId) {
        self.entries.remove(id);
    }

    /// Each identity with a leaf, and when that leaf ends.
    pub fn ends(&self) -> Vec<(SpiffeId, i64)> {
        let mut ends: Vec<(SpiffeId, i64)> = self
            .entries
            .iter()
            .filter_map(|(id, e)| e.leaf.as_ref().map(|leaf| (id.clone(), leaf.not_after)))
            .collect();
        ends.sort();
        ends
    }

    /// A number in 0..1000.
    fn jitter(&mut self) -> i64 {
        let mut x = self.state;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.state = x;
        i64::try_from(x % 1000).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::time::Duration;

    use super::*;
    use crate::trust::issuer::Issuer;
    use proptest::prelude::*;
    use time::OffsetDateTime;

    const LIFE: i64 = 3600;

    fn issuer(now: OffsetDateTime) -> Issuer {
        super::super::issuer::test_root("test CA", now)
    }

    /// Issuing on the spot, as the local signer does.
    fn issue(
        issuer: Option<&Issuer>,
        id: &SpiffeId,
        policy: LeafPolicy,
        now: i64,
    ) -> Result<Leaf, LeafError> {
        crate::trust::signer::issue_at(issuer.ok_or(LeafError::NoIssuer)?, id, policy, now)
    }

    impl Leaves {
        /// The leaf of `id` at `now`, issued first if it has none yet.
        fn get(
            &mut self,
            id: &SpiffeId,
            issuer: Option<&Issuer>,
            now: i64,
        ) -> Result<Arc<Leaf>, LeafError> {
            self.want(id, now);
            if let Some(leaf) = self.current(id, now) {
                return Ok(leaf);
            }
            // Asked for now, as a new stream's identity is.
            if let Some(entry) = self.entries.get_mut(id) {
                entry.due = entry.due.min(now);
            }
            let Some(ticket) = self.take(id, now) else {
                return Err(LeafError::NoIssuer);
            };
            let issued = issue(issuer, id, self.policy, now);
            self.record(id, ticket, issued, now)?;
            self.current(id, now).ok_or(LeafError::NoIssuer)
        }

        /// Issues, on the spot, whatever is due at `now`.
        fn renew_due(
            &mut self,
            issuer: Option<&Issuer>,
            now: i64,
        ) -> (Vec<SpiffeId>, Vec<(SpiffeId, LeafError)>) {
            let (mut renewed, mut failed) = (Vec::new(), Vec::new());
            for (id, ticket) in self.take_due(now, usize::MAX) {
                let issued = issue(issuer, &id, self.policy, now);
                match self.record(&id, ticket, issued, now) {
                    Ok(_) => renewed.push(id),
                    Err(error) => failed.push((id, error)),
                }
            }
            (renewed, failed)
        }
    }

    fn id(k: u8) -> SpiffeId {
        SpiffeId::new("cluster.local", "ns", &format!("sa{k}")).unwrap()
    }

    fn policy() -> LeafPolicy {
        LeafPolicy {
            lifetime: Duration::from_secs(LIFE as u64),
            backdate: Duration::ZERO,
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Want(u8),
        /// Seconds, at most a quarter of a leaf's life.
        Advance(u16),
        Down,
        Up,
        Forget(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0..4u8).prop_map(Op::Want),
            6 => (1..=(LIFE as u16 / 4)).prop_map(Op::Advance),
            1 => Just(Op::Down),
            1 => Just(Op::Up),
            1 => (0..4u8).prop_map(Op::Forget),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Against a plain model: a wanted identity never loses a leaf that is still valid
        /// (whatever the signer does); with the signer up since it was wanted, it always holds
        /// one; a minute after the signer comes back, every wanted identity holds one again;
        /// renewal is scheduled before the leaf's end; a forgotten identity holds none.
        #[test]
        fn leaves_follow_the_model(ops in prop::collection::vec(op(), 1..80), seed in any::<u64>()) {
            let start = OffsetDateTime::now_utc();
            let ca = issuer(start);
            let mut leaves = Leaves::new(policy(), seed);
            let mut now = start.unix_timestamp();
            let mut up = true;
            let mut up_since = now;
            // Model: wanted identities, since when (with the signer up throughout, or None),
            // and the end of the last leaf seen for each.
            let mut wanted: BTreeMap<u8, Option<i64>> = BTreeMap::new();
            let mut last_end: BTreeMap<u8, i64> = BTreeMap::new();
            let mut forgotten: BTreeSet<u8> = BTreeSet::new();
            for op in ops {
                let signer = up.then_some(&ca);
                match op {
                    Op::Want(k) => {
                        forgotten.remove(&k);
                        let got = leaves.get(&id(k), signer, now);
                        match (&got, up) {
                            (Ok(leaf), _) => { last_end.insert(k, leaf.not_after); }
                            (Err(_), true) => prop_assert!(false, "the signer is up and {k} got no leaf"),
                            (Err(_), false) => prop_assert!(last_end.get(&k).is_none_or(|end| *end <= now)),
                        }
                        wanted.entry(k).or_insert(if up { Some(now) } else { None });
                    }
                    Op::Advance(dt) => {
                        now += i64::from(dt);
                        let _ = leaves.renew_due(signer, now);
                    }
                    Op::Down => {
                        up = false;
                        for since in wanted.values_mut() { *since = None; }
                    }
                    Op::Up => {
                        if !up { up_since = now; }
                        up = true;
                    }
                    Op::Forget(k) => {
                        leaves.forget(&id(k));
                        wanted.remove(&k);
                        last_end.remove(&k);
                        forgotten.insert(k);
                    }
                }
                for (&k, since) in &wanted {
                    let current = leaves.current(&id(k), now);
                    if let Some(leaf) = &current {
                        prop_assert!(leaf.not_after > now);
                        last_end.insert(k, leaf.not_after);
                    }
                    if let Some(end) = last_end.get(&k) && *end > now {
                        prop_assert!(current.is_some(), "{k} lost a leaf valid until {end} at {now}");
                    }
                    if since.is_some() && up {
                        prop_assert!(current.is_some(), "{k}: the signer was up throughout");
                    }
                    if up && now - up_since >= MOST_RETRY && matches!(op, Op::Advance(_)) {
                        prop_assert!(current.is_some(), "{k}: the signer is back since {up_since}");
                    }
                    let entry = &leaves.entries[&id(k)];
                    // Renewal is planned before the leaf's end; retries after failures may
                    // reach it.
                    if let Some(leaf) = &entry.leaf && leaf.not_after > now {
                        prop_assert!(
                            entry.due < leaf.not_after || (entry.failures > 0 && entry.due <= leaf.not_after),
                            "{k} renews only after its end"
                        );
                    }
                }
                for &k in &forgotten {
                    prop_assert!(leaves.current(&id(k), now).is_none());
                }
            }
        }
    }

    #[test]
    fn a_leaf_being_issued_is_handed_out_once_and_one_from_a_replaced_signer_is_issued_again() {
        let start = OffsetDateTime::now_utc();
        let (old, new) = (issuer(start), issuer(start));
        let now = start.unix_timestamp();
        let mut leaves = Leaves::new(policy(), 3);
        leaves.want(&id(0), now);
        leaves.want(&id(1), now);
        // At most what was asked for, and nothing twice while it is being issued.
        let first = leaves.take_due(now, 1).remove(0);
        let second = leaves.take_due(now, 8);
        assert_eq!(second.len(), 1);
        let second = second[0].clone();
        assert_ne!(first.0, second.0);
        assert!(leaves.take_due(now, 8).is_empty());
        assert_eq!(
            leaves.next_due(),
            None,
            "nothing due but what is being issued"
        );

        // The signer is replaced while both are out: the old one's leaf is taken, as it is all
        // there is, and issued again at once; a failure is issued again at once too.
        leaves.renew_all(now);
        let issued = issue(Some(&old), &first.0, policy(), now);
        assert!(leaves.record(&first.0, first.1, issued, now).unwrap());
        let stale = leaves.current(&first.0, now).expect("held meanwhile");
        assert!(
            leaves
                .record(&second.0, second.1, Err(LeafError::NoIssuer), now)
                .is_err()
        );
        let again = leaves.take_due(now, 8);
        assert_eq!(again.len(), 2, "both issued again by the new signer");
        for (id, ticket) in &again {
            let issued = issue(Some(&new), id, policy(), now);
            assert!(leaves.record(id, *ticket, issued, now).unwrap());
        }
        assert_ne!(leaves.current(&first.0, now).unwrap().serial, stale.serial);

        // A leaf issued for an identity since forgotten is dropped; one asked for before it
        // was forgotten and wanted again is not taken for the new request's.
        leaves.want(&id(2), now);
        let (gone, before) = leaves.take_due(now, 8).remove(0);
        leaves.forget(&id(2));
        leaves.want(&id(2), now);
        let (_, after) = leaves.take_due(now, 8).remove(0);
        let issued = issue(Some(&new), &gone, policy(), now);
        assert!(!leaves.record(&gone, before, issued, now).unwrap());
        assert!(leaves.current(&id(2), now).is_none());
        assert!(
            leaves.take_due(now, 8).is_empty(),
            "the new request is still out"
        );
        let issued = issue(Some(&new), &gone, policy(), now);
        assert!(leaves.record(&gone, after, issued, now).unwrap());
    }

    #[test]
    fn after_its_leaf_ends_an_identity_is_retried_by_the_backoff_alone() {
        let start = OffsetDateTime::now_utc();
        let ca = issuer(start);
        let now = start.unix_timestamp();
        let mut leaves = Leaves::new(policy(), 5);
        let leaf = leaves.get(&id(0), Some(&ca), now).unwrap();
        // The signer out from the renewal on, until well past the leaf's end.
        let mut at = leaves.next_due().unwrap();
        let mut tries = Vec::new();
        while at < leaf.not_after + 600 {
            let (_, failed) = leaves.renew_due(None, at);
            if !failed.is_empty() {
                tries.push(at);
            }
            at = leaves.next_due().unwrap().max(at + 1);
        }
        let after_end: Vec<i64> = tries
            .iter()
            .copied()
            .filter(|t| *t >= leaf.not_after)
            .collect();
        assert!(
            after_end.windows(2).all(|w| w[1] - w[0] >= MOST_RETRY),
            "retried faster than the backoff after the end: {after_end:?}"
        );
        assert!(
            tries.contains(&(leaf.not_after - 1)),
            "the last try before the end"
        );
    }

    #[test]
    fn renewal_comes_after_half_the_life_and_failures_back_off() {
        let start = OffsetDateTime::now_utc();
        let ca = issuer(start);
        let now = start.unix_timestamp();
        let mut leaves = Leaves::new(policy(), 7);
        let first = leaves.get(&id(0), Some(&ca), now).unwrap();
        let due = leaves.next_due().unwrap();
        assert!(
            (now + LIFE / 2..=now + LIFE * 6 / 10).contains(&due),
            "{}",
            due - now
        );
        // Not before it is due.
        assert!(leaves.renew_due(Some(&ca), due - 1).0.is_empty());
        // The signer is out: the leaf stays, retries back off 1, 2, 4 … seconds.
        let (renewed, failed) = leaves.renew_due(None, due);
        assert!(renewed.is_empty() && failed.len() == 1);
        assert_eq!(failed[0].1.reason(), "no_issuer");
        assert_eq!(leaves.next_due(), Some(due + 1));
        let _ = leaves.renew_due(None, due + 1);
        assert_eq!(leaves.next_due(), Some(due + 3));
        assert_eq!(
            leaves.current(&id(0), due + 3).unwrap().serial,
            first.serial
        );
        // Back: a new leaf.
        let (renewed, _) = leaves.renew_due(Some(&ca), due + 3);
        assert_eq!(renewed, vec![id(0)]);
        assert_ne!(
            leaves.current(&id(0), due + 3).unwrap().serial,
            first.serial
        );
        assert_eq!(leaves.ends().len(), 1);
    }
}
