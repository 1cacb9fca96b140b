//! The bounds the xDS server keeps whatever a client sends, as one value the binary fills from
//! its flags (`docs/architecture.md` says why each default is what it is), and the largest
//! request a stream may send, which follows the mesh.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::admission::Caps;
use super::inbound::DEFAULT_MAX_MESSAGE;
use super::snapshot::XdsSnapshot;
use super::stream::Limits;

/// Every bound of the xDS server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XdsLimits {
    /// Connections and streams, per peer address and in all.
    pub caps: Caps,
    /// HTTP/2 streams one connection may have open at once.
    pub streams_per_connection: u32,
    /// The largest request a stream may send.
    pub request: RequestBound,
    /// Bytes of requests being read at once, over every stream.
    pub request_buffer: usize,
    /// How long a request may take to arrive whole: the first, from when the agent reads the
    /// stream; any other, from its first byte. Time waiting for `request_buffer` aside.
    pub request_timeout: Duration,
    /// Bytes h2 queues for one stream beyond what the peer has read (`max_send_buf_size`).
    pub send_buffer: usize,
    /// HTTP/2 header list and frame sizes the server accepts.
    pub max_header_list: u32,
    pub max_frame: u32,
    /// HTTP/2 PING every `keepalive_interval` without a frame from the peer; no answer within
    /// `keepalive_timeout` closes the connection.
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
    /// TCP keep-alive: idle time before the first probe.
    pub tcp_keepalive: Duration,
    /// On shutdown, how long connections have to end their streams before they are closed.
    pub drain: Duration,
    /// What one stream may make the agent keep (names per type).
    pub names: Limits,
}

impl Default for XdsLimits {
    /// The defaults of the agent's flags.
    fn default() -> Self {
        XdsLimits {
            caps: Caps {
                connections: 1024,
                connections_per_peer: 8,
                streams: 1024,
                streams_per_peer: 8,
            },
            streams_per_connection: 4,
            request: RequestBound::Auto,
            request_buffer: 64 << 20,
            request_timeout: Duration::from_secs(10),
            send_buffer: 400 << 10,
            max_header_list: 16 << 10,
            max_frame: 16 << 10,
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(20),
            tcp_keepalive: Duration::from_secs(60),
            drain: Duration::from_secs(5),
            names: Limits::default(),
        }
    }
}

/// HTTP/2 flow-control windows the server gives a proxy (hyper's defaults, set here so the
/// request budget can say what it leaves to them): what h2 holds of a stream's requests, and
/// of a connection's, while the agent does not read them.
pub const STREAM_WINDOW: u32 = 1 << 20;
pub const CONNECTION_WINDOW: u32 = 1 << 20;

/// The largest request a stream may send: a number of bytes, or `auto`, which follows the
/// mesh the agent serves (see [`RequestBound::of`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RequestBound {
    #[default]
    Auto,
    Bytes(usize),
}

/// What a proxy's node takes in a request, with room to spare: Envoy's lists every extension
/// it was built with (Envoy 1.40's first Delta request, its node and a cluster subscription,
/// is 61,154 bytes).
pub const NODE_ALLOWANCE: usize = 256 << 10;
/// A name in a request, beyond its own bytes: its field's tag and length (a SotW or Delta
/// subscription), or a Delta `initial_resource_versions` entry's tags, lengths and 16-digit
/// version.
const PER_NAME: usize = 32;
/// The largest requests name each resource of a type at most twice (a Delta reconnect's
/// endpoint request subscribes to every cluster's assignment and gives each one's version);
/// twice that again leaves room for a proxy that holds more than the mesh has now (services
/// removed while it was away).
const NAMINGS: usize = 4;

impl RequestBound {
    /// The largest request with `snapshot` served. `auto`: a node, and every resource of the
    /// largest type named [`NAMINGS`] times, and never less than gRPC's usual 4 MiB. A proxy
    /// of the whole mesh reconnecting over Delta lists every resource it holds, and Envoy puts
    /// its clusters' in its first request: at 50k services about 3 MB, and its endpoint
    /// request, every assignment subscribed and with its version, about 5 MB.
    fn of(&self, snapshot: &XdsSnapshot) -> usize {
        match *self {
            RequestBound::Bytes(bytes) => bytes,
            RequestBound::Auto => {
                let largest_type = snapshot
                    .resources
                    .iter()
                    .map(|map| map.keys().map(|name| name.len() + PER_NAME).sum::<usize>())
                    .max()
                    .unwrap_or(0);
                (NODE_ALLOWANCE + NAMINGS * largest_type).max(DEFAULT_MAX_MESSAGE)
            }
        }
    }
}

/// [`RequestBound::of`] the snapshot being served, worked out once per snapshot for every
/// stream.
#[derive(Debug, Default)]
pub struct RequestBounds {
    bound: RequestBound,
    /// The last snapshot asked about (held weakly: its address is not reused while this
    /// lives), and its bound.
    last: Mutex<Option<(Weak<XdsSnapshot>, usize)>>,
}

impl RequestBounds {
    pub fn new(bound: RequestBound) -> Self {
        RequestBounds {
            bound,
            last: Mutex::default(),
        }
    }

    pub fn of(&self, snapshot: &Arc<XdsSnapshot>) -> usize {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((known, bytes)) = &*last
            && std::ptr::eq(known.as_ptr(), Arc::as_ptr(snapshot))
        {
            return *bytes;
        }
        let bytes = self.bound.of(snapshot);
        *last = Some((Arc::downgrade(snapshot), bytes));
        bytes
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use envoy_types::pb::envoy::config::cluster::v3::Cluster;

    use super::*;
    use crate::xds::snapshot::{ResourceMap, ResourceType, TYPES, XdsResource};

    /// A snapshot of clusters named `names`, and nothing else.
    fn snapshot(names: impl IntoIterator<Item = String>) -> XdsSnapshot {
        let clusters: ResourceMap = names
            .into_iter()
            .map(|name| {
                let resource = XdsResource::new(name.clone(), Cluster::default());
                (Arc::from(name), resource)
            })
            .collect();
        let mut resources: [ResourceMap; TYPES] = Default::default();
        resources[ResourceType::Cluster.index()] = clusters;
        XdsSnapshot {
            version: 1,
            resources,
            parts: Default::default(),
            changed_at: Instant::now(),
            indexes: Default::default(),
            inbound: None,
        }
    }

    #[test]
    fn auto_follows_the_mesh_and_never_goes_below_grpcs_usual_limit() {
        let small = snapshot(["a|80".to_string()]);
        assert_eq!(RequestBound::Auto.of(&small), DEFAULT_MAX_MESSAGE);
        let name = |i: usize| format!("service-{i:06}.namespace.system.internal|8080");
        let large = snapshot((0..50_000).map(name));
        let bound = RequestBound::Auto.of(&large);
        // A Delta reconnect of the whole mesh: every cluster's name and 16-digit version.
        let reconnect = NODE_ALLOWANCE + 50_000 * (name(0).len() + 22);
        assert!(bound > 2 * reconnect, "{bound} vs {reconnect}");
        assert!(bound < 32 << 20, "{bound}");
        assert_eq!(RequestBound::Bytes(1 << 20).of(&large), 1 << 20);
    }

    #[test]
    fn the_bound_is_worked_out_once_per_snapshot() {
        let bounds = RequestBounds::new(RequestBound::Auto);
        let first = Arc::new(snapshot(["a|80".to_string()]));
        assert_eq!(bounds.of(&first), DEFAULT_MAX_MESSAGE);
        let second = Arc::new(snapshot((0..50_000).map(|i| format!("c{i}"))));
        let grown = bounds.of(&second);
        assert!(grown > DEFAULT_MAX_MESSAGE);
        assert_eq!(bounds.of(&second), grown);
        assert_eq!(bounds.of(&first), DEFAULT_MAX_MESSAGE);
    }
}
