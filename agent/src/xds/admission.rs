//! How many connections and ADS streams the xDS server holds, per peer address and in all, and
//! the slots that hold them: a connection or a stream over a cap is turned away before any of
//! it is read, and a slot is given back when what holds it is dropped, however it ends (a
//! panic included).
//!
//! A pod's Envoy holds one connection and one stream; a peer address is a pod. The caps per
//! peer keep one pod (or, with identity checking off, one local address) from taking what the
//! node's other pods need; the totals bound the agent whatever the number of addresses.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// Which cap a connection or stream was over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Over {
    #[error("{peer} holds {cap} connections already, the most one address may")]
    ConnectionsPerPeer { peer: IpAddr, cap: usize },
    #[error("the agent holds {cap} xDS connections already, the most it takes")]
    Connections { cap: usize },
    #[error("{peer} holds {cap} ADS streams already, the most one address may")]
    StreamsPerPeer { peer: IpAddr, cap: usize },
    #[error("the agent holds {cap} ADS streams already, the most it takes")]
    Streams { cap: usize },
}

impl Over {
    /// The metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            Over::ConnectionsPerPeer { .. } => "connections_per_peer",
            Over::Connections { .. } => "connections_total",
            Over::StreamsPerPeer { .. } => "streams_per_peer",
            Over::Streams { .. } => "streams_total",
        }
    }
}

/// The caps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    pub connections: usize,
    pub connections_per_peer: usize,
    pub streams: usize,
    pub streams_per_peer: usize,
}

/// What is held: connections and streams, per peer address and in all.
#[derive(Debug)]
pub struct Admission {
    caps: Caps,
    connections: Arc<Mutex<Held>>,
    streams: Arc<Mutex<Held>>,
}

impl Admission {
    pub fn new(caps: Caps) -> Self {
        Admission {
            caps,
            connections: Arc::default(),
            streams: Arc::default(),
        }
    }

    /// A slot for a connection from `peer`, held until dropped.
    pub fn connection(&self, peer: IpAddr) -> Result<Slot, Over> {
        let (total, per_peer) = (self.caps.connections, self.caps.connections_per_peer);
        take(&self.connections, peer, total, per_peer).map_err(|full| match full {
            Full::Total => Over::Connections { cap: total },
            Full::Peer => Over::ConnectionsPerPeer {
                peer,
                cap: per_peer,
            },
        })
    }

    /// A slot for an ADS stream from `peer`, held until dropped.
    pub fn stream(&self, peer: IpAddr) -> Result<Slot, Over> {
        let (total, per_peer) = (self.caps.streams, self.caps.streams_per_peer);
        take(&self.streams, peer, total, per_peer).map_err(|full| match full {
            Full::Total => Over::Streams { cap: total },
            Full::Peer => Over::StreamsPerPeer {
                peer,
                cap: per_peer,
            },
        })
    }

    /// Connections and streams held right now.
    pub fn held(&self) -> (usize, usize) {
        (lock(&self.connections).total, lock(&self.streams).total)
    }
}

#[derive(Debug, Default)]
struct Held {
    total: usize,
    /// Only addresses that hold something: an entry goes with its last slot.
    by_peer: HashMap<IpAddr, usize>,
}

enum Full {
    Total,
    Peer,
}

fn lock(held: &Mutex<Held>) -> std::sync::MutexGuard<'_, Held> {
    held.lock().unwrap_or_else(|poison| poison.into_inner())
}

fn take(
    held: &Arc<Mutex<Held>>,
    peer: IpAddr,
    total: usize,
    per_peer: usize,
) -> Result<Slot, Full> {
    let peer = peer.to_canonical();
    let mut guard = lock(held);
    if guard.total >= total {
        return Err(Full::Total);
    }
    let count = guard.by_peer.entry(peer).or_insert(0);
    if *count >= per_peer {
        return Err(Full::Peer);
    }
    *count += 1;
    guard.total += 1;
    Ok(Slot {
        held: held.clone(),
        peer,
    })
}

/// A connection's or a stream's place under the caps, given back on drop.
#[derive(Debug)]
pub struct Slot {
    held: Arc<Mutex<Held>>,
    peer: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = lock(&self.held);
        held.total = held.total.saturating_sub(1);
        if let Some(count) = held.by_peer.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                held.by_peer.remove(&self.peer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn caps() -> Caps {
        Caps {
            connections: 3,
            connections_per_peer: 2,
            streams: 3,
            streams_per_peer: 2,
        }
    }

    #[test]
    fn a_peer_gets_its_share_and_the_total_bounds_all_peers() {
        let admission = Admission::new(caps());
        let a1 = admission.stream(ip("10.0.0.1")).unwrap();
        let _a2 = admission.stream(ip("::ffff:10.0.0.1")).unwrap();
        assert_eq!(
            admission.stream(ip("10.0.0.1")).unwrap_err(),
            Over::StreamsPerPeer {
                peer: ip("10.0.0.1"),
                cap: 2
            }
        );
        let _b1 = admission.stream(ip("10.0.0.2")).unwrap();
        let over = admission.stream(ip("10.0.0.3")).unwrap_err();
        assert_eq!(over.reason(), "streams_total");
        // A slot given back is free again, for its peer and for the others.
        drop(a1);
        let _c1 = admission.stream(ip("10.0.0.3")).unwrap();
        assert_eq!(admission.held(), (0, 3));
        // Connections are counted apart from streams.
        let _conn = admission.connection(ip("10.0.0.1")).unwrap();
        assert_eq!(admission.held(), (1, 3));
    }

    #[test]
    fn slots_come_back_when_their_holder_panics() {
        let admission = Arc::new(Admission::new(caps()));
        let held = admission.clone();
        let panicked = std::thread::spawn(move || {
            let _slot = held.connection(ip("10.0.0.1")).unwrap();
            panic!("a stream task's bug");
        })
        .join();
        assert!(panicked.is_err());
        assert_eq!(admission.held(), (0, 0));
        assert!(
            lock(&admission.connections).by_peer.is_empty(),
            "no entry left"
        );
    }
}
