//! The trapped block and who holds which address in it.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use ipnet::Ipv4Net;
use serde::Serialize;

use super::{MeshPath, ServiceAddress};

/// The IPv4 block whose traffic pods hand to Envoy. The first host address is shared by all
/// HTTP services; the rest are handed out to services that need their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(into = "String")]
pub struct TrapCidr(Ipv4Net);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AddressError {
    #[error("trapped CIDR {0:?} is not an IPv4 block like 240.240.0.0/16")]
    Cidr(String),
    #[error(
        "trapped CIDR {0} is too wide or too narrow: use a prefix between /8 and /30 (so it \
         holds a shared address and at least one more)"
    )]
    Prefix(Ipv4Net),
    #[error(
        "no free address left in the trapped block {trap} for service {path}: widen --trap-cidr"
    )]
    Exhausted { trap: Ipv4Net, path: MeshPath },
}

impl TrapCidr {
    pub fn net(self) -> Ipv4Net {
        self.0
    }

    /// The address every all-HTTP service resolves to: the block's first host.
    pub fn shared(self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.0.network()) + 1)
    }

    /// Host addresses after the shared one, as offsets from the network address.
    fn own_offsets(self) -> std::ops::Range<u32> {
        let size = 1u32 << (32 - self.0.prefix_len());
        2..size - 1
    }
}

impl FromStr for TrapCidr {
    type Err = AddressError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let net: Ipv4Net = s.parse().map_err(|_| AddressError::Cidr(s.to_string()))?;
        if !(8..=30).contains(&net.prefix_len()) {
            return Err(AddressError::Prefix(net));
        }
        Ok(TrapCidr(net.trunc()))
    }
}

impl fmt::Display for TrapCidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl From<TrapCidr> for String {
    fn from(trap: TrapCidr) -> String {
        trap.to_string()
    }
}

/// Assigns own addresses to services that need them, stable for as long as the service keeps
/// needing one. Allocation is round-robin from a cursor, so a just-released address is the
/// last to be handed out again: a client holding a stale DNS answer is unlikely to reach a
/// different service.
#[derive(Clone, Debug)]
pub struct AddressBook {
    trap: TrapCidr,
    held: HashMap<MeshPath, u32>,
    used: BTreeSet<u32>,
    cursor: u32,
}

impl AddressBook {
    pub fn new(trap: TrapCidr) -> Self {
        AddressBook {
            trap,
            held: HashMap::new(),
            used: BTreeSet::new(),
            cursor: trap.own_offsets().start,
        }
    }

    pub fn trap(&self) -> TrapCidr {
        self.trap
    }

    /// The address for `path`: the shared one, or its own (kept if it already has one).
    pub fn assign(
        &mut self,
        path: &MeshPath,
        needs_own: bool,
    ) -> Result<ServiceAddress, AddressError> {
        if !needs_own {
            self.release(path);
            return Ok(ServiceAddress::Shared(self.trap.shared()));
        }
        if let Some(&offset) = self.held.get(path) {
            return Ok(ServiceAddress::Own(self.ip(offset)));
        }
        let offset = self.next_free().ok_or_else(|| AddressError::Exhausted {
            trap: self.trap.net(),
            path: path.clone(),
        })?;
        self.used.insert(offset);
        self.held.insert(path.clone(), offset);
        self.cursor = offset + 1;
        Ok(ServiceAddress::Own(self.ip(offset)))
    }

    pub fn release(&mut self, path: &MeshPath) {
        if let Some(offset) = self.held.remove(path) {
            self.used.remove(&offset);
        }
    }

    fn next_free(&self) -> Option<u32> {
        let range = self.trap.own_offsets();
        let start = self.cursor.clamp(range.start, range.end);
        (start..range.end)
            .chain(range.start..start)
            .find(|offset| !self.used.contains(offset))
    }

    fn ip(&self, offset: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.trap.net().network()) + offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_bounds_the_block() {
        let trap: TrapCidr = "240.240.0.0/16".parse().unwrap();
        assert_eq!(trap.shared(), Ipv4Addr::new(240, 240, 0, 1));
        assert_eq!(
            "240.240.7.9/16".parse::<TrapCidr>().unwrap(),
            trap,
            "host bits are dropped"
        );
        assert!(matches!(
            "240.0.0.0/4".parse::<TrapCidr>(),
            Err(AddressError::Prefix(_))
        ));
        assert!(matches!(
            "240.240.0.0/31".parse::<TrapCidr>(),
            Err(AddressError::Prefix(_))
        ));
        assert!(matches!(
            "nonsense".parse::<TrapCidr>(),
            Err(AddressError::Cidr(_))
        ));
        assert!(matches!(
            "fd00::/64".parse::<TrapCidr>(),
            Err(AddressError::Cidr(_))
        ));
    }

    #[test]
    fn never_hands_out_network_shared_or_broadcast() {
        let trap: TrapCidr = "10.1.2.0/29".parse().unwrap();
        let mut book = AddressBook::new(trap);
        let mut got = Vec::new();
        for i in 0..5 {
            let path: MeshPath = format!("/s/{i}").parse().unwrap();
            got.push(book.assign(&path, true).unwrap().ip());
        }
        assert_eq!(got.first(), Some(&Ipv4Addr::new(10, 1, 2, 2)));
        assert_eq!(got.last(), Some(&Ipv4Addr::new(10, 1, 2, 6)));
        let path: MeshPath = "/s/full".parse().unwrap();
        assert!(matches!(
            book.assign(&path, true),
            Err(AddressError::Exhausted { .. })
        ));
    }
}
