//! Readiness: the agent is ready when every component that must be in place before it can
//! serve has said so. Each such component holds a [`ReadyToken`] and drops it when it is
//! ready (a server once it is bound and serving, the translators once they have published the
//! first complete snapshot); `/readyz` is true once no token is left. A component that is
//! never registered cannot hold readiness back, and one that fails before it is ready keeps
//! the agent unready, which is what a probe should see.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

/// The components not ready yet, by name (a name may be registered more than once).
#[derive(Clone, Debug, Default)]
pub struct Readiness(Arc<Inner>);

#[derive(Debug, Default)]
struct Inner {
    pending: Mutex<BTreeMap<Cow<'static, str>, usize>>,
    /// Bumped whenever a token drops, for [`Readiness::ready_but`].
    changed: watch::Sender<u64>,
}

impl Readiness {
    pub fn new() -> Self {
        Readiness::default()
    }

    /// A token that holds readiness back until it is dropped.
    pub fn register(&self, component: impl Into<Cow<'static, str>>) -> ReadyToken {
        let component = component.into();
        *self.lock().entry(component.clone()).or_default() += 1;
        ReadyToken {
            readiness: self.clone(),
            component,
        }
    }

    /// The components still not ready, sorted; empty when the agent is ready.
    pub fn pending(&self) -> Vec<String> {
        self.lock().keys().map(|k| k.to_string()).collect()
    }

    /// Completes once every component is ready but those named in `but` (the servers that
    /// wait for the rest before they take traffic).
    pub async fn ready_but(&self, but: &[&str]) {
        let mut changed = self.0.changed.subscribe();
        loop {
            if self.lock().keys().all(|k| but.contains(&k.as_ref())) {
                return;
            }
            if changed.changed().await.is_err() {
                return;
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<Cow<'static, str>, usize>> {
        // A panic while holding this lock leaves a consistent map (each change is one step).
        self.0
            .pending
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }
}

/// Held by a component until it is ready; dropping it marks the component ready.
#[derive(Debug)]
#[must_use = "readiness is reached when the token is dropped: keep it until the component is ready"]
pub struct ReadyToken {
    readiness: Readiness,
    component: Cow<'static, str>,
}

impl Drop for ReadyToken {
    fn drop(&mut self) {
        let mut pending = self.readiness.lock();
        if let Some(count) = pending.get_mut(&self.component) {
            *count -= 1;
            if *count == 0 {
                pending.remove(&self.component);
            }
        }
        drop(pending);
        self.readiness.0.changed.send_modify(|n| *n += 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_once_every_token_is_dropped() {
        let readiness = Readiness::new();
        assert!(readiness.pending().is_empty(), "nothing registered");
        let xds = readiness.register("xds server");
        let names = readiness.register("dns names");
        let names_again = readiness.register("dns names");
        assert_eq!(readiness.pending(), ["dns names", "xds server"]);
        drop(names);
        assert_eq!(
            readiness.pending(),
            ["dns names", "xds server"],
            "one of two tokens of a component is not the component"
        );
        drop(names_again);
        drop(xds);
        assert!(readiness.pending().is_empty());
    }

    #[tokio::test]
    async fn ready_but_waits_for_every_other_component() {
        let readiness = Readiness::new();
        let server = readiness.register("xds server");
        let names = readiness.register("dns names");
        let waiting = tokio::spawn({
            let readiness = readiness.clone();
            async move { readiness.ready_but(&["xds server"]).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "dns names is not ready");
        drop(names);
        waiting.await.unwrap();
        assert_eq!(readiness.pending(), ["xds server"]);
        drop(server);
    }
}
