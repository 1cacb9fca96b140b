//! Which upstream to ask: each upstream's smoothed round-trip time (an exponentially weighted
//! average, as hickory-resolver's name server pool and BIND keep one) and whether it is down.
//! Upstreams that are up are asked fastest first; one that gave no answer is down and is
//! skipped, except that now and then a query is also sent to it as a probe, in parallel with
//! the upstream that is up, so probing never makes a client wait. A probe that is answered
//! brings it back. When every upstream is down they are all asked at once: an outage is when
//! the first to come back must be found, and hedging on round-trip times that the outage's own
//! waits have stretched could leave all but the first unasked.
//!
//! Pure: time comes in as arguments, so tests drive it without sleeping.

use std::net::SocketAddr;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Weight of a new round-trip time in the average.
const SRTT_GAIN: f64 = 0.3;
/// The first probe of a down upstream comes this long after it went down; each failed probe
/// doubles the wait, up to [`PROBE_MAX`].
const PROBE_FIRST: Duration = Duration::from_secs(1);
const PROBE_MAX: Duration = Duration::from_secs(30);
/// The next upstream is asked too when the one asked has not answered within this many times
/// its smoothed round-trip time, and never sooner than [`HEDGE_MIN`] (a recursive upstream
/// that is fast on its cache takes longer on a miss).
const HEDGE_FACTOR: u32 = 4;
const HEDGE_MIN: Duration = Duration::from_millis(100);

/// What a forwarded query does: ask `order` one after the other, each when the one before
/// fails or is slow (or all of them at once when `at_once`), and send `probe` a copy at once.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) order: Vec<usize>,
    pub(crate) probe: Option<usize>,
    pub(crate) at_once: bool,
}

#[derive(Debug)]
pub(crate) struct Upstreams {
    addrs: Box<[SocketAddr]>,
    health: Box<[Mutex<Health>]>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Health {
    /// Smoothed round-trip time; `None` until the first answer.
    srtt: Option<Duration>,
    down: Option<Down>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Down {
    /// When the next probe may go.
    probe_at: Instant,
    /// How long after a failed probe the next one goes.
    backoff: Duration,
    probing: bool,
}

/// A change of an upstream's state, for the metrics and the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Transition {
    WentDown,
    CameBack,
}

impl Upstreams {
    pub(crate) fn new(addrs: Vec<SocketAddr>) -> Self {
        let health = addrs
            .iter()
            .map(|_| {
                Mutex::new(Health {
                    srtt: None,
                    down: None,
                })
            })
            .collect();
        Self {
            addrs: addrs.into_boxed_slice(),
            health,
        }
    }

    pub(crate) fn addr(&self, index: usize) -> SocketAddr {
        self.addrs[index]
    }

    pub(crate) fn len(&self) -> usize {
        self.addrs.len()
    }

    fn health(&self, index: usize) -> Health {
        *self.health[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn update<T>(&self, index: usize, f: impl FnOnce(&mut Health) -> T) -> T {
        // The closures below only assign fields: a poisoned lock still guards consistent data.
        f(&mut self.health[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner))
    }

    /// Whom a query asks at `now`. At most one probe per down upstream is out at a time.
    pub(crate) fn plan(&self, now: Instant) -> Plan {
        let health: Vec<Health> = (0..self.len()).map(|i| self.health(i)).collect();
        // Unmeasured upstreams first (they get measured), then by round-trip time; ties keep
        // the configured order.
        let by_speed = |indices: &mut Vec<usize>| {
            indices.sort_by_key(|&i| health[i].srtt.unwrap_or(Duration::ZERO));
        };
        let mut up: Vec<usize> = (0..self.len())
            .filter(|&i| health[i].down.is_none())
            .collect();
        if up.is_empty() {
            let mut all: Vec<usize> = (0..self.len()).collect();
            by_speed(&mut all);
            return Plan {
                order: all,
                probe: None,
                at_once: true,
            };
        }
        by_speed(&mut up);
        let probe = (0..self.len()).find(|&i| {
            self.update(i, |h| match &mut h.down {
                Some(down) if !down.probing && now >= down.probe_at => {
                    down.probing = true;
                    true
                }
                _ => false,
            })
        });
        Plan {
            order: up,
            probe,
            at_once: false,
        }
    }

    /// How long to wait for `index` before asking the next upstream as well, with `left` until
    /// the query's deadline and `unasked` upstreams after this one still to ask: at most an
    /// equal share of the time left each, so every upstream in the order is asked before the
    /// deadline however slow the ones before it have been.
    pub(crate) fn hedge_delay(&self, index: usize, left: Duration, unasked: usize) -> Duration {
        let srtt = self.health(index).srtt.unwrap_or(Duration::ZERO);
        let share = left / u32::try_from(unasked + 1).unwrap_or(u32::MAX);
        (srtt * HEDGE_FACTOR).max(HEDGE_MIN).min(share)
    }

    /// `index` answered after `rtt`.
    pub(crate) fn answered(&self, index: usize, rtt: Duration) -> Option<Transition> {
        self.update(index, |h| {
            h.srtt = Some(match h.srtt {
                None => rtt,
                Some(srtt) => srtt.mul_f64(1.0 - SRTT_GAIN) + rtt.mul_f64(SRTT_GAIN),
            });
            h.down.take().map(|_| Transition::CameBack)
        })
    }

    /// `index` was asked and did not answer (time-out, refused connection, garbage) at `now`.
    pub(crate) fn failed(&self, index: usize, now: Instant) -> Option<Transition> {
        self.update(index, |h| match &mut h.down {
            None => {
                h.down = Some(Down {
                    probe_at: now + PROBE_FIRST,
                    backoff: PROBE_FIRST,
                    probing: false,
                });
                Some(Transition::WentDown)
            }
            Some(down) => {
                if down.probing {
                    down.backoff = (down.backoff * 2).min(PROBE_MAX);
                    down.probing = false;
                }
                down.probe_at = now + down.backoff;
                None
            }
        })
    }

    /// `index` was slow enough that the next upstream was asked too: its round-trip time is at
    /// least `waited`, so the next query prefers a faster one.
    pub(crate) fn overtaken(&self, index: usize, waited: Duration) {
        self.update(index, |h| {
            if h.srtt.is_none_or(|srtt| srtt < waited) {
                h.srtt = Some(match h.srtt {
                    None => waited,
                    Some(srtt) => srtt.mul_f64(1.0 - SRTT_GAIN) + waited.mul_f64(SRTT_GAIN),
                });
            }
        });
    }

    /// (address, up, smoothed round-trip time) of every upstream, for the metrics.
    pub(crate) fn states(&self) -> impl Iterator<Item = (SocketAddr, bool, Option<Duration>)> + '_ {
        (0..self.len()).map(|i| {
            let h = self.health(i);
            (self.addrs[i], h.down.is_none(), h.srtt)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: u16) -> Upstreams {
        Upstreams::new(
            (1..=n)
                .map(|p| SocketAddr::from(([127, 0, 0, 1], p)))
                .collect(),
        )
    }

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn unmeasured_first_then_fastest_first() {
        let p = pool(3);
        let now = Instant::now();
        assert_eq!(
            p.plan(now).order,
            vec![0, 1, 2],
            "configured order to start with"
        );
        p.answered(0, 30 * MS);
        p.answered(1, 5 * MS);
        assert_eq!(
            p.plan(now).order,
            vec![2, 1, 0],
            "the unmeasured one, then by speed"
        );
        p.answered(2, 10 * MS);
        assert_eq!(p.plan(now).order, vec![1, 2, 0]);
    }

    #[test]
    fn an_overtaken_upstream_falls_behind_the_one_that_answered() {
        let p = pool(2);
        p.overtaken(0, HEDGE_MIN);
        p.answered(1, MS);
        assert_eq!(p.plan(Instant::now()).order, vec![1, 0]);
        // A known fast upstream is not slowed by being overtaken once by less than its time.
        p.overtaken(1, MS / 2);
        assert_eq!(p.health(1).srtt, Some(MS));
    }

    #[test]
    fn a_down_upstream_is_skipped_and_probed_with_backoff_until_it_answers() {
        let p = pool(2);
        let t0 = Instant::now();
        p.answered(1, 10 * MS);
        assert_eq!(p.failed(0, t0), Some(Transition::WentDown));
        assert_eq!(
            p.plan(t0),
            Plan {
                order: vec![1],
                probe: None,
                at_once: false,
            }
        );
        assert_eq!(p.plan(t0 + PROBE_FIRST - MS).probe, None);
        let t1 = t0 + PROBE_FIRST;
        assert_eq!(
            p.plan(t1),
            Plan {
                order: vec![1],
                probe: Some(0),
                at_once: false,
            }
        );
        assert_eq!(p.plan(t1).probe, None, "one probe out at a time");
        // The probe fails: the next waits twice as long.
        assert_eq!(p.failed(0, t1), None);
        assert_eq!(p.plan(t1 + 2 * PROBE_FIRST - MS).probe, None);
        let t2 = t1 + 2 * PROBE_FIRST;
        assert_eq!(p.plan(t2).probe, Some(0));
        assert_eq!(p.answered(0, 3 * MS), Some(Transition::CameBack));
        assert_eq!(
            p.plan(t2),
            Plan {
                order: vec![0, 1],
                probe: None,
                at_once: false,
            },
            "back, and faster"
        );
    }

    #[test]
    fn probe_backoff_stops_growing_at_its_ceiling() {
        let p = pool(2);
        let mut now = Instant::now();
        p.failed(0, now);
        for _ in 0..20 {
            now += PROBE_MAX;
            assert_eq!(p.plan(now).probe, Some(0));
            p.failed(0, now);
        }
        assert_eq!(p.plan(now + PROBE_MAX - MS).probe, None);
        assert_eq!(p.plan(now + PROBE_MAX).probe, Some(0));
    }

    #[test]
    fn with_every_upstream_down_all_are_asked() {
        let p = pool(2);
        let now = Instant::now();
        p.answered(0, 20 * MS);
        p.answered(1, 10 * MS);
        p.failed(0, now);
        p.failed(1, now);
        assert_eq!(
            p.plan(now),
            Plan {
                order: vec![1, 0],
                probe: None,
                at_once: true,
            }
        );
        assert_eq!(p.answered(1, MS), Some(Transition::CameBack));
        assert_eq!(p.plan(now).order, vec![1]);
    }

    #[test]
    fn hedging_waits_a_multiple_of_the_round_trip_within_bounds() {
        let p = pool(1);
        let timeout = Duration::from_secs(2);
        assert_eq!(p.hedge_delay(0, timeout, 0), HEDGE_MIN);
        p.answered(0, 200 * MS);
        assert_eq!(p.hedge_delay(0, timeout, 0), 800 * MS);
        p.answered(0, Duration::from_secs(5));
        assert_eq!(p.hedge_delay(0, timeout, 0), timeout);
    }

    #[test]
    fn hedging_leaves_each_upstream_still_to_ask_its_share_of_the_time_left() {
        let p = pool(3);
        let left = Duration::from_millis(1500);
        p.answered(0, Duration::from_secs(5));
        assert_eq!(
            p.hedge_delay(0, left, 2),
            500 * MS,
            "two more to ask: a third"
        );
        assert_eq!(
            p.hedge_delay(0, left, 1),
            750 * MS,
            "one more to ask: a half"
        );
        assert_eq!(
            p.hedge_delay(0, left, 0),
            left,
            "the last one: the whole time left"
        );
    }

    /// A slow first upstream is overtaken by the hedge, which stretches its round-trip time; a
    /// run of such queries still asks the second before the deadline every time.
    #[test]
    fn stretched_round_trip_times_never_leave_an_upstream_unasked() {
        let p = pool(2);
        let timeout = Duration::from_secs(2);
        for _ in 0..50 {
            let plan = p.plan(Instant::now());
            let first = plan.order[0];
            let waited = p.hedge_delay(first, timeout, plan.order.len() - 1);
            assert!(waited < timeout, "{waited:?}");
            p.overtaken(first, waited);
        }
    }
}
