//! Providers: the sources the catalog merges (Kubernetes, each mesh file). Each publishes a
//! [`ProviderReport`] on a channel of its own: its latest complete view of the mesh, and
//! whether that view is still current.

use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use serde::Serialize;
use tokio::sync::watch;

use super::MeshSnapshot;

/// Which provider reported something: `kubernetes`, or `file:<path>` for a mesh file. Shown
/// on `/debug/mesh` and in Envoy's endpoint metadata, so an operator can tell where an address
/// came from.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct Provider(Arc<str>);

impl Provider {
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        Provider(name.into())
    }

    /// Shared: every Kubernetes endpoint names it, so it is allocated once.
    pub fn kubernetes() -> Self {
        static KUBERNETES: std::sync::LazyLock<Provider> =
            std::sync::LazyLock::new(|| Provider::new("kubernetes"));
        KUBERNETES.clone()
    }

    pub fn file(path: &std::path::Path) -> Self {
        Provider::new(format!("file:{}", path.display()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Read back (the node's last mesh), every endpoint names its provider: the names are shared
/// again, as the sources share them, rather than allocated once per endpoint. The name is
/// compared where the reader holds it ([`crate::in_place`]); a `Cow<str>` would have been an owned
/// copy per endpoint, 500k of them at 50k services.
impl<'de> serde::Deserialize<'de> for Provider {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Provider, D::Error> {
        thread_local! {
            static LAST: std::cell::RefCell<Option<Provider>> = const { std::cell::RefCell::new(None) };
        }
        crate::in_place::read_str(d, "a provider's name", |name| {
            if name == "kubernetes" {
                return Provider::kubernetes();
            }
            LAST.with_borrow_mut(|last| match last {
                Some(provider) if provider.as_str() == name => provider.clone(),
                _ => last.insert(Provider::new(name)).clone(),
            })
        })
    }
}

impl fmt::Display for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why a provider's view may be out of date, and since when. The view keeps serving: a
/// provider that cannot reach its source says so, it does not empty the mesh.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Stale {
    /// RFC 3339, UTC.
    pub since: String,
    pub reason: String,
}

impl Stale {
    pub fn now(reason: impl Into<String>) -> Self {
        let since = jiff::Timestamp::try_from(SystemTime::now())
            .map(|t| t.to_string())
            .unwrap_or_default();
        Stale {
            since,
            reason: reason.into(),
        }
    }
}

/// What a provider publishes: its latest complete view (none before its first), and whether
/// it is stale.
#[derive(Clone, Debug, Default)]
pub struct ProviderReport {
    pub view: Option<Arc<MeshSnapshot>>,
    pub stale: Option<Stale>,
}

pub type ProviderTx = watch::Sender<ProviderReport>;
pub type ProviderRx = watch::Receiver<ProviderReport>;

/// One provider's channel to the catalog.
pub fn channel() -> (ProviderTx, ProviderRx) {
    watch::channel(ProviderReport::default())
}

/// Publishing side helpers, so a source says what happened in one call.
pub trait Report {
    /// A new complete view (staleness is said separately: a source may publish what it has
    /// while part of it cannot be refreshed).
    fn view(&self, view: Arc<MeshSnapshot>);
    /// The view may be out of date. `since` stays at the first report until the provider
    /// recovers, so it says how long it has been stale; the reason is the latest.
    fn stale(&self, reason: impl Into<String>);
    /// The source is reachable again and the view is current.
    fn fresh(&self);
}

impl Report for ProviderTx {
    fn view(&self, view: Arc<MeshSnapshot>) {
        self.send_modify(|report| report.view = Some(view));
    }

    fn stale(&self, reason: impl Into<String>) {
        let reason = reason.into();
        self.send_if_modified(|report| match &mut report.stale {
            Some(stale) if stale.reason == reason => false,
            Some(stale) => {
                stale.reason = reason;
                true
            }
            None => {
                report.stale = Some(Stale::now(reason));
                true
            }
        });
    }

    fn fresh(&self) {
        self.send_if_modified(|report| report.stale.take().is_some());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn providers_read_back_share_their_names() {
        let read: Vec<Provider> = serde_json::from_str(
            r#"["kubernetes", "file:/a", "file:\/a", "file:/b", "kubernetes", "file:/b"]"#,
        )
        .unwrap();
        let names: Vec<&str> = read.iter().map(Provider::as_str).collect();
        assert_eq!(
            names,
            [
                "kubernetes",
                "file:/a",
                "file:/a",
                "file:/b",
                "kubernetes",
                "file:/b"
            ]
        );
        assert!(Arc::ptr_eq(&read[0].0, &Provider::kubernetes().0));
        assert!(
            Arc::ptr_eq(&read[1].0, &read[2].0),
            "an escaped name is the same"
        );
        assert!(Arc::ptr_eq(&read[3].0, &read[5].0));
        assert!(serde_json::from_str::<Provider>("7").is_err());
    }
}
