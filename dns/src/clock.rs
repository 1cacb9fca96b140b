//! Time as the forwarder sees it: the age of cached answers and when a dead upstream is probed
//! again. The system clock in the agent; a manual one in tests, which move time by hand instead
//! of sleeping through a TTL.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The forwarder's clock ([`crate::DnsConfig::clock`]).
#[derive(Clone, Debug, Default)]
pub struct Clock {
    manual: Option<Arc<Manual>>,
}

#[derive(Debug)]
struct Manual {
    start: Instant,
    offset_nanos: AtomicU64,
}

impl Clock {
    /// The system's monotonic clock.
    pub fn system() -> Self {
        Self::default()
    }

    /// A clock that stands still until [`Clock::advance`] moves it; clones share it.
    pub fn manual() -> Self {
        Self {
            manual: Some(Arc::new(Manual {
                start: Instant::now(),
                offset_nanos: AtomicU64::new(0),
            })),
        }
    }

    /// Moves a manual clock forward by `by`; the system clock ignores it.
    pub fn advance(&self, by: Duration) {
        if let Some(manual) = &self.manual {
            let nanos = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
            manual.offset_nanos.fetch_add(nanos, Ordering::Relaxed);
        }
    }

    pub(crate) fn now(&self) -> Instant {
        match &self.manual {
            None => Instant::now(),
            Some(manual) => {
                manual.start + Duration::from_nanos(manual.offset_nanos.load(Ordering::Relaxed))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_advanced_and_clones_share_it() {
        let clock = Clock::manual();
        let copy = clock.clone();
        let start = clock.now();
        assert_eq!(clock.now(), start);
        copy.advance(Duration::from_secs(90));
        assert_eq!(clock.now() - start, Duration::from_secs(90));
        let system = Clock::system();
        let before = system.now();
        system.advance(Duration::from_secs(3600));
        assert!(system.now() - before < Duration::from_secs(3600));
    }
}
