//! The issuer's Secret (`--ca-secret`), watched by name, each version handed to the
//! [`Authority`]. One object, by a `metadata.name` field selector, so RBAC can grant this
//! Secret alone (`resourceNames`), list and watch included.

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::trust::{Authority, SecretRef};

/// Follows `secret` until shutdown. Watch failures are retried with backoff; the issuer read
/// before stays in use meanwhile.
pub async fn watch_ca(
    client: kube::Client,
    secret: SecretRef,
    authority: std::sync::Arc<Authority>,
    shutdown: CancellationToken,
) {
    let config = watcher::Config::default().fields(&format!("metadata.name={}", secret.name));
    let mut events = watcher(Api::<Secret>::namespaced(client, &secret.namespace), config)
        .default_backoff()
        .boxed();
    // Whether the Secret appeared in the list in progress.
    let mut in_list = false;
    loop {
        let event = tokio::select! {
            () = shutdown.cancelled() => return,
            event = events.next() => match event {
                Some(event) => event,
                None => return,
            },
        };
        match event {
            Ok(watcher::Event::Init) => in_list = false,
            Ok(watcher::Event::InitApply(object)) => {
                in_list = true;
                read(&authority, &object);
            }
            Ok(watcher::Event::InitDone) => {
                if !in_list {
                    authority.gone();
                }
                authority.listed();
            }
            Ok(watcher::Event::Apply(object)) => read(&authority, &object),
            Ok(watcher::Event::Delete(_)) => authority.gone(),
            Err(error) => {
                warn!(%error, %secret, "watching the issuer's Secret failed; retrying, the issuer read before stays in use");
                // Refused, not unreachable: no RBAC grant. Waiting for it would keep the
                // agent from ever serving; an API server that does not answer keeps the
                // providers from listing anyway.
                if super::status_code(&error) == Some(403) {
                    authority.unreadable("the API server refuses to let the agent read it (403)");
                }
            }
        }
    }
}

fn read(authority: &Authority, secret: &Secret) {
    let data = secret.data.clone().unwrap_or_default();
    let field = |key: &'static str| data.get(key).map(|bytes| bytes.0.as_slice());
    match (field("tls.crt"), field("tls.key"), field("ca.crt")) {
        (Some(crt), Some(key), Some(ca)) => authority.seen(crt, key, ca),
        (None, _, _) => authority.incomplete("tls.crt"),
        (_, None, _) => authority.incomplete("tls.key"),
        (_, _, None) => authority.incomplete("ca.crt"),
    }
}
