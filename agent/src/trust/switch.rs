//! Whether calls to the services of meshed pods are mutual TLS: while the agent has a CA to
//! give every proxy its leaf, followed from the [`Authority`](super::Authority)'s state with a
//! hold, so that a CA appearing or going is seen by every agent of the cluster before calls
//! change, and a Secret deleted and created again changes nothing.

use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{AuthorityState, TrustMetrics};

/// How long a CA must have appeared, or have gone, before calls to meshed pods change: long
/// enough for every agent of the cluster to read the change and give its proxies their leaves
/// (a callee without its leaf closes mesh mTLS), and for a Secret deleted and created again
/// (`kubectl replace --force`, a chart reinstalled) to change nothing.
pub const MESH_MTLS_HOLD: Duration = Duration::from_secs(10);

/// Turns mesh mTLS on while there is a CA and off while there is none: at once the first time
/// the CA's Secret is looked up (`known` is called then: the agent is not ready before), then
/// once a change
/// has held for [`MESH_MTLS_HOLD`]. Off, calls to meshed pods are plaintext, which their
/// inbound listeners take in permissive mode and refuse in strict mode: a cluster without a CA
/// works as it did before pods were meshed, and a deleted CA is said loudly (its leaves stay
/// until they end, but no proxy is given one without a CA).
pub async fn switch_mesh_mtls(
    mut authority: watch::Receiver<AuthorityState>,
    switch: watch::Sender<Option<bool>>,
    known: impl FnOnce(),
    metrics: TrustMetrics,
    shutdown: CancellationToken,
) {
    let mut known = Some(known);
    let apply = |on: bool| {
        metrics.set_mesh_mtls(on);
        switch.send_replace(Some(on));
        if on {
            tracing::info!("mesh mTLS on: services of meshed pods are called over mutual TLS");
        } else {
            tracing::warn!(
                "mesh mTLS off: no CA, so services of meshed pods are called in plaintext (permissive pods take it, strict pods refuse it)"
            );
        }
    };
    // A change that waits out the hold: the state it goes to, and when.
    let mut pending: Option<(bool, tokio::time::Instant)> = None;
    loop {
        let wanted = authority.borrow_and_update().mesh_mtls();
        let current = *switch.borrow();
        match (current, wanted) {
            (_, None) => {}
            (None, Some(on)) => {
                if let Some(known) = known.take() {
                    known();
                }
                apply(on);
            }
            (Some(now), Some(on)) if now == on => {
                if pending.take().is_some() {
                    tracing::info!(
                        mesh_mtls = on,
                        "the CA is back as it was: calls to meshed pods stay as they are"
                    );
                }
            }
            (Some(_), Some(on)) => {
                if pending.is_none_or(|(to, _)| to != on) {
                    pending = Some((on, tokio::time::Instant::now() + MESH_MTLS_HOLD));
                    tracing::info!(
                        mesh_mtls = on,
                        hold_secs = MESH_MTLS_HOLD.as_secs(),
                        "the CA changed: calls to meshed pods follow if it holds"
                    );
                }
            }
        }
        let due = pending.map(|(_, at)| at);
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = authority.changed() => if changed.is_err() { return },
            () = tokio::time::sleep_until(due.unwrap_or_else(tokio::time::Instant::now)), if due.is_some() => {
                if let Some((on, _)) = pending.take() {
                    apply(on);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use crate::trust::authority::tests::ca;
    use crate::trust::{Authority, SecretRef};

    /// The first lookup of the CA decides at once (and makes the agent ready); a change after
    /// it takes effect once it has held for the hold, so a Secret deleted and created again
    /// changes nothing.
    #[tokio::test(start_paused = true)]
    async fn mesh_mtls_follows_the_ca_at_once_first_then_once_a_change_holds() {
        let metrics = TrustMetrics::register(&mut prometheus_client::registry::Registry::default());
        let authority = Authority::new(
            "cluster.local".into(),
            Some(SecretRef {
                namespace: "lattice-system".into(),
                name: "lattice-ca".into(),
            }),
            metrics.clone(),
        );
        let known = Arc::new(AtomicBool::new(false));
        let (switch, mut rx) = watch::channel(None);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(switch_mesh_mtls(
            authority.subscribe(),
            switch,
            {
                let known = known.clone();
                move || known.store(true, Ordering::Relaxed)
            },
            metrics.clone(),
            shutdown.clone(),
        ));
        let settle = || tokio::time::sleep(Duration::from_millis(1));
        settle().await;
        assert_eq!(*rx.borrow_and_update(), None);
        assert!(!known.load(Ordering::Relaxed));

        authority.listed();
        settle().await;
        assert_eq!(*rx.borrow_and_update(), Some(false), "at once: no CA");
        assert!(known.load(Ordering::Relaxed));

        let (crt, key) = ca();
        authority.seen(crt.as_bytes(), key.as_bytes(), crt.as_bytes());
        tokio::time::sleep(MESH_MTLS_HOLD - Duration::from_secs(1)).await;
        assert_eq!(*rx.borrow(), Some(false), "not before the hold");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(*rx.borrow_and_update(), Some(true), "the CA held");

        authority.gone();
        tokio::time::sleep(MESH_MTLS_HOLD / 2).await;
        authority.seen(crt.as_bytes(), key.as_bytes(), crt.as_bytes());
        tokio::time::sleep(MESH_MTLS_HOLD * 2).await;
        assert!(
            !rx.has_changed().unwrap(),
            "deleted and created again: no change"
        );

        authority.gone();
        tokio::time::sleep(MESH_MTLS_HOLD + Duration::from_secs(1)).await;
        assert_eq!(*rx.borrow_and_update(), Some(false), "gone for good");
        shutdown.cancel();
        task.await.unwrap();
    }
}
