//! Who holds which address in the trapped block. The block itself, and its rules, are part of
//! the contract every part shares ([`TrapCidrs`]).

use std::collections::{BTreeSet, HashMap};
use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use lattice_contract::TrapCidrs;

use super::{MeshPath, ServiceAddress};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AddressError {
    #[error(
        "no free address left in the trapped block {trap} for service {path}: widen --trap-cidr"
    )]
    Exhausted { trap: Ipv4Net, path: MeshPath },
}

/// Host addresses after the shared one, as offsets from the block's network address: the
/// addresses a service of its own may get (never the network, shared or broadcast address).
fn own_offsets(trap: &TrapCidrs) -> std::ops::Range<u32> {
    let size = 1u32 << (32 - trap.ipv4().prefix_len());
    2..size - 1
}

/// Assigns own addresses to services that need them, stable for as long as the service keeps
/// needing one. Allocation is round-robin from a cursor, so a just-released address is the
/// last to be handed out again: a client holding a stale DNS answer is unlikely to reach a
/// different service.
#[derive(Clone, Debug)]
pub struct AddressBook {
    trap: TrapCidrs,
    held: HashMap<MeshPath, u32>,
    used: BTreeSet<u32>,
    cursor: u32,
}

impl AddressBook {
    pub fn new(trap: TrapCidrs) -> Self {
        AddressBook {
            cursor: own_offsets(&trap).start,
            trap,
            held: HashMap::new(),
            used: BTreeSet::new(),
        }
    }

    pub fn trap(&self) -> &TrapCidrs {
        &self.trap
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
            trap: self.trap.ipv4(),
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
        let range = own_offsets(&self.trap);
        let start = self.cursor.clamp(range.start, range.end);
        (start..range.end)
            .chain(range.start..start)
            .find(|offset| !self.used.contains(offset))
    }

    fn ip(&self, offset: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.trap.ipv4().network()) + offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_hands_out_network_shared_or_broadcast() {
        let trap: TrapCidrs = "10.1.2.0/29".parse().unwrap();
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
