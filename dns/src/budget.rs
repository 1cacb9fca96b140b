//! What one pod may take of the DNS server, so no pod can take it from the others: forwarded
//! queries in flight and TCP connections each have a budget of their own, per source address
//! and in total. Mesh names answered from the table never touch either (a UDP query for one
//! needs no budget at all; a TCP connection needs a connection slot, not a forwarding one).
//!
//! Over a budget a forwarded query gets SERVFAIL at once (retryable, and it costs the node
//! little), and a new TCP connection is refused. A source over its own forwarding budget is
//! sent at most `refusals_per_source` SERVFAILs a second over UDP; its other queries are
//! dropped unanswered, as Unbound's `ip-ratelimit` and BIND's response rate limiting do: a
//! reply costs the node a send as dear as the query's receive, and a source that keeps its
//! whole budget in flight and asks on is flooding, not waiting for an answer. Over TCP every
//! query is answered (a connection's pipeline already bounds what it may ask).
//!
//! A connection over the total while some connection sits idle takes that one's slot instead:
//! the idle connection longest unused is closed (RFC 7766 §6.2.3 lets a server close idle
//! connections when it needs the resources, and a client must expect it), because that costs
//! its client one reconnect later, while a refusal fails a query the new client has in hand.
//! Over its own source's budget a connection is refused even when the source has idle ones: a
//! source competes only with itself there, and closing its idle connections would let it churn
//! through connections for free.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::metrics::DnsMetrics;

/// Why a query or a connection was turned away: the `reason` label of
/// `lattice_dns_limited_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Limit {
    /// A source had `forwards_per_source` forwarded queries in flight.
    ForwardsPerSource,
    /// As [`Limit::ForwardsPerSource`], over UDP once the source had been sent its
    /// `refusals_per_source` SERVFAILs of the second: dropped unanswered.
    ForwardsPerSourceUnanswered,
    /// The node had `forwards` forwarded queries in flight.
    Forwards,
    /// A source had `tcp_connections_per_source` connections open.
    TcpPerSource,
    /// The node had `tcp_connections` connections open, none of them idle.
    Tcp,
    /// An idle connection closed to make room for a new one.
    TcpIdleEvicted,
}

impl Limit {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Limit::ForwardsPerSource => "forwards_per_source",
            Limit::ForwardsPerSourceUnanswered => "forwards_per_source_unanswered",
            Limit::Forwards => "forwards",
            Limit::TcpPerSource => "tcp_connections_per_source",
            Limit::Tcp => "tcp_connections",
            Limit::TcpIdleEvicted => "tcp_idle_evicted",
        }
    }
}

/// Counts per source and in total; an entry goes when its count does.
#[derive(Debug, Default)]
struct Counts {
    total: usize,
    by_source: HashMap<IpAddr, usize>,
}

impl Counts {
    fn take(&mut self, source: IpAddr) {
        self.total += 1;
        *self.by_source.entry(source).or_default() += 1;
    }

    fn give_back(&mut self, source: IpAddr) {
        self.total = self.total.saturating_sub(1);
        if let Some(count) = self.by_source.get_mut(&source) {
            *count -= 1;
            if *count == 0 {
                self.by_source.remove(&source);
            }
        }
    }

    fn of(&self, source: IpAddr) -> usize {
        self.by_source.get(&source).copied().unwrap_or(0)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every change under these locks is a single step: a panic leaves consistent counts.
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// Forwarded queries in flight, per source and in total, and the SERVFAILs a source over its
/// own budget may still be sent over UDP.
#[derive(Debug)]
pub(crate) struct ForwardBudget {
    total: usize,
    per_source: usize,
    refusals_per_source: u32,
    clock: Clock,
    state: Mutex<ForwardState>,
}

#[derive(Debug, Default)]
struct ForwardState {
    counts: Counts,
    /// Only for sources over their budget, so never more than `total / per_source` entries:
    /// an entry goes with the source's last forward in flight.
    refusals: HashMap<IpAddr, Allowance>,
}

/// A token bucket of `refusals_per_source` a second, as deep: a source that has just reached
/// its budget gets a second's worth of SERVFAILs at once.
#[derive(Debug)]
struct Allowance {
    tokens: f64,
    at: Instant,
}

impl ForwardBudget {
    pub(crate) fn new(
        total: usize,
        per_source: usize,
        refusals_per_source: u32,
        clock: Clock,
    ) -> Arc<Self> {
        Arc::new(ForwardBudget {
            total: total.max(1),
            per_source: per_source.max(1),
            refusals_per_source,
            clock,
            state: Mutex::new(ForwardState::default()),
        })
    }

    /// A slot for one forwarded query of `source`, given back when the permit drops.
    pub(crate) fn try_take(self: &Arc<Self>, source: IpAddr) -> Result<ForwardPermit, Limit> {
        let mut state = lock(&self.state);
        if state.counts.of(source) >= self.per_source {
            return Err(Limit::ForwardsPerSource);
        }
        if state.counts.total >= self.total {
            return Err(Limit::Forwards);
        }
        state.counts.take(source);
        Ok(ForwardPermit {
            budget: self.clone(),
            source,
        })
    }

    /// Whether a UDP query of `source` refused for `limit` gets its SERVFAIL: always, but
    /// for a source over its own budget, which has `refusals_per_source` a second.
    pub(crate) fn answers_refusal(&self, source: IpAddr, limit: Limit) -> bool {
        if limit != Limit::ForwardsPerSource {
            return true;
        }
        let rate = f64::from(self.refusals_per_source);
        let now = self.clock.now();
        let mut state = lock(&self.state);
        if state.counts.of(source) < self.per_source {
            // Its forwards came back meanwhile: it is no longer over.
            return true;
        }
        let allowance = state.refusals.entry(source).or_insert(Allowance {
            tokens: rate,
            at: now,
        });
        let refill = now.saturating_duration_since(allowance.at).as_secs_f64() * rate;
        allowance.tokens = (allowance.tokens + refill).min(rate);
        allowance.at = now;
        if allowance.tokens >= 1.0 {
            allowance.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[derive(Debug)]
pub(crate) struct ForwardPermit {
    budget: Arc<ForwardBudget>,
    source: IpAddr,
}

impl Drop for ForwardPermit {
    fn drop(&mut self) {
        let mut state = lock(&self.budget.state);
        state.counts.give_back(self.source);
        if state.counts.of(self.source) == 0 {
            state.refusals.remove(&self.source);
        }
    }
}

/// One open connection, as the table sees it.
#[derive(Debug)]
struct Connection {
    source: IpAddr,
    /// Since when it has had nothing to read or answer; `None` while busy.
    idle_since: Option<Instant>,
    /// Cancelled to ask it to close (its slot was given to another).
    evict: CancellationToken,
}

#[derive(Debug, Default)]
struct TcpState {
    counts: Counts,
    open: HashMap<u64, Connection>,
    next_id: u64,
}

/// The open TCP connections, per source and in total, with which of them are idle.
#[derive(Debug)]
pub(crate) struct TcpBudget {
    total: usize,
    per_source: usize,
    state: Mutex<TcpState>,
    metrics: DnsMetrics,
}

impl TcpBudget {
    pub(crate) fn new(total: usize, per_source: usize, metrics: DnsMetrics) -> Arc<Self> {
        Arc::new(TcpBudget {
            total: total.max(1),
            per_source: per_source.max(1),
            state: Mutex::new(TcpState::default()),
            metrics,
        })
    }

    /// A slot for a new connection from `source`, taking an idle connection's when the total
    /// is reached (that one is asked to close, and counted).
    pub(crate) fn admit(self: &Arc<Self>, source: IpAddr) -> Result<TcpSlot, Limit> {
        let mut state = lock(&self.state);
        if state.counts.of(source) >= self.per_source {
            return Err(Limit::TcpPerSource);
        }
        if state.counts.total >= self.total {
            let oldest = state
                .open
                .iter()
                .filter_map(|(id, c)| Some((c.idle_since?, *id)))
                .min();
            let Some((_, id)) = oldest else {
                return Err(Limit::Tcp);
            };
            if let Some(evicted) = state.open.remove(&id) {
                state.counts.give_back(evicted.source);
                evicted.evict.cancel();
                self.metrics.limited(Limit::TcpIdleEvicted.label());
            }
        }
        let id = state.next_id;
        state.next_id += 1;
        state.counts.take(source);
        let evict = CancellationToken::new();
        state.open.insert(
            id,
            Connection {
                source,
                idle_since: None,
                evict: evict.clone(),
            },
        );
        self.metrics.tcp_connections(state.counts.total);
        Ok(TcpSlot {
            budget: self.clone(),
            id,
            evict,
        })
    }

    fn set_idle(&self, id: u64, idle: bool) {
        if let Some(connection) = lock(&self.state).open.get_mut(&id) {
            connection.idle_since = idle.then(Instant::now);
        }
    }
}

/// A connection's place in the [`TcpBudget`], given back when it drops.
#[derive(Debug)]
pub(crate) struct TcpSlot {
    budget: Arc<TcpBudget>,
    id: u64,
    evict: CancellationToken,
}

impl TcpSlot {
    /// The connection has nothing to read or answer: it may be evicted from now on.
    pub(crate) fn idle(&self) {
        self.budget.set_idle(self.id, true);
    }

    /// The connection is reading or answering a query.
    pub(crate) fn busy(&self) {
        self.budget.set_idle(self.id, false);
    }

    /// Completes when the connection's slot was given to another: it should close.
    pub(crate) async fn evicted(&self) {
        self.evict.cancelled().await;
    }
}

impl Drop for TcpSlot {
    fn drop(&mut self) {
        let mut state = lock(&self.budget.state);
        if let Some(connection) = state.open.remove(&self.id) {
            state.counts.give_back(connection.source);
        }
        self.budget.metrics.tcp_connections(state.counts.total);
    }
}

/// Logs refusals at most once per [`RefusalLog::EVERY`] per reason, with how many were not
/// logged since: a flood of refusals must not become a flood of log lines.
#[derive(Debug, Default)]
pub(crate) struct RefusalLog {
    last: Mutex<HashMap<Limit, (Instant, u64)>>,
}

impl RefusalLog {
    const EVERY: Duration = Duration::from_secs(10);

    /// Counts a refusal for `limit` and logs it if none was logged lately.
    pub(crate) fn refused(&self, limit: Limit, source: IpAddr, metrics: &DnsMetrics) {
        metrics.limited(limit.label());
        let mut last = lock(&self.last);
        let now = Instant::now();
        let entry = last.entry(limit).or_insert((now - Self::EVERY, 0));
        if now.duration_since(entry.0) < Self::EVERY {
            entry.1 += 1;
            return;
        }
        let suppressed = std::mem::take(&mut entry.1);
        entry.0 = now;
        drop(last);
        tracing::warn!(
            %source,
            reason = limit.label(),
            suppressed,
            "DNS over budget: {}",
            match limit {
                Limit::ForwardsPerSource | Limit::Forwards =>
                    "a forwarded query got SERVFAIL",
                Limit::ForwardsPerSourceUnanswered =>
                    "a forwarded query was dropped unanswered (over its source's SERVFAIL rate)",
                Limit::TcpPerSource | Limit::Tcp => "a TCP connection was refused",
                Limit::TcpIdleEvicted => "an idle TCP connection was closed",
            }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::registry::Registry;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn forwards_are_bounded_per_source_and_in_total_and_given_back() {
        let budget = ForwardBudget::new(3, 2, 100, Clock::manual());
        let a1 = budget.try_take(ip(1)).unwrap();
        let _a2 = budget.try_take(ip(1)).unwrap();
        assert_eq!(
            budget.try_take(ip(1)).unwrap_err(),
            Limit::ForwardsPerSource
        );
        let _b1 = budget.try_take(ip(2)).unwrap();
        assert_eq!(budget.try_take(ip(3)).unwrap_err(), Limit::Forwards);
        drop(a1);
        assert!(budget.try_take(ip(3)).is_ok(), "a slot given back is free");
    }

    #[test]
    fn a_source_over_its_budget_is_answered_at_its_refusal_rate_until_its_forwards_return() {
        let clock = Clock::manual();
        let budget = ForwardBudget::new(10, 2, 4, clock.clone());
        let answered = |source| {
            (0..100)
                .filter(|_| budget.answers_refusal(source, Limit::ForwardsPerSource))
                .count()
        };
        // Under its budget (and over the total, which is no fault of its own): always.
        assert_eq!(answered(ip(1)), 100);
        assert!(budget.answers_refusal(ip(1), Limit::Forwards));
        let first = budget.try_take(ip(1)).unwrap();
        let second = budget.try_take(ip(1)).unwrap();
        // Over it: a second's worth at once, then the rate.
        assert_eq!(answered(ip(1)), 4);
        assert!(budget.answers_refusal(ip(1), Limit::Forwards));
        clock.advance(Duration::from_millis(500));
        assert_eq!(answered(ip(1)), 2);
        clock.advance(Duration::from_secs(60));
        assert_eq!(answered(ip(1)), 4, "the bucket is a second deep");
        assert_eq!(answered(ip(2)), 100, "another source is not limited");
        // Its forwards back, its allowance goes with them; over again, a fresh one.
        drop(first);
        assert_eq!(answered(ip(1)), 100);
        drop(second);
        assert!(lock(&budget.state).refusals.is_empty());
        let _held = (
            budget.try_take(ip(1)).unwrap(),
            budget.try_take(ip(1)).unwrap(),
        );
        assert_eq!(answered(ip(1)), 4);
    }

    #[test]
    fn a_new_connection_over_the_total_takes_the_oldest_idle_ones_slot() {
        let metrics = DnsMetrics::new(&mut Registry::default());
        let budget = TcpBudget::new(2, 2, metrics);
        let first = budget.admit(ip(1)).unwrap();
        let second = budget.admit(ip(2)).unwrap();
        assert_eq!(budget.admit(ip(3)).unwrap_err(), Limit::Tcp, "none idle");
        second.idle();
        first.idle();
        let third = budget.admit(ip(3)).unwrap();
        assert!(
            second.evict.is_cancelled(),
            "the oldest idle one is asked to close"
        );
        assert!(!first.evict.is_cancelled());
        drop(second);
        assert_eq!(
            lock(&budget.state).counts.total,
            2,
            "its slot was already given"
        );
        drop((first, third));
        assert_eq!(lock(&budget.state).counts.total, 0);
        assert!(lock(&budget.state).counts.by_source.is_empty());
    }

    #[test]
    fn a_source_at_its_budget_is_refused_even_with_idle_connections() {
        let metrics = DnsMetrics::new(&mut Registry::default());
        let budget = TcpBudget::new(10, 1, metrics);
        let only = budget.admit(ip(1)).unwrap();
        only.idle();
        assert_eq!(budget.admit(ip(1)).unwrap_err(), Limit::TcpPerSource);
        assert!(!only.evict.is_cancelled());
        assert!(budget.admit(ip(2)).is_ok());
    }
}
