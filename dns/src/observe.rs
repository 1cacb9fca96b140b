//! What the server tells its owner about lookups of mesh names, and how the owner may hold an
//! answer back: the agent uses it to push a service to a pod's Envoy before the pod, which just
//! resolved the service's name, connects to it.

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;

/// A future an answer waits for.
pub type Hold = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Told of every answer from the zone for a name that has a
/// [`MeshRecord::Scope`](crate::MeshRecord::Scope).
pub trait LookupObserver: Send + Sync + 'static {
    /// `client` is about to get an answer for a name of `scope`. `None`: send it now; this is
    /// the common case and runs on the fast path, so it must be cheap. `Some(hold)`: send it
    /// when `hold` completes, which the observer bounds in time. Other queries are served
    /// meanwhile.
    fn looked_up(&self, client: IpAddr, scope: &Arc<str>) -> Option<Hold>;
}
