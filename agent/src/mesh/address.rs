//! Who holds which address in the trapped block. The block itself, and its rules, are part of
//! the contract every part shares ([`TrapCidrs`]).

use std::net::Ipv4Addr;

use imbl::{HashMap, OrdSet};

use ipnet::Ipv4Net;
use lattice_contract::TrapCidrs;

use super::{MeshPath, PathError, ServiceAddress};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AddressError {
    #[error(
        "no free address left in the trapped block {trap} for service {path}: widen --trap-cidr"
    )]
    Exhausted { trap: Ipv4Net, path: MeshPath },
    #[error("service {service}: instance name {instance:?} is not usable: {source}")]
    InstanceName {
        service: MeshPath,
        instance: String,
        source: PathError,
    },
    #[error(
        "{path} is both an instance of service {service} and a service of its own: one DNS \
         name cannot mean both; rename one"
    )]
    NameTaken { path: MeshPath, service: MeshPath },
}

/// Host addresses after the shared one, as offsets from the block's network address: the
/// addresses a service of its own may get (never the network, shared or broadcast address).
fn own_offsets(trap: &TrapCidrs) -> std::ops::Range<u32> {
    let size = 1u32 << (32 - trap.ipv4().prefix_len());
    2..size - 1
}

/// Assigns own addresses to the services and stateful-service instances that need them
/// (holders, named by their mesh path), stable for as long as the holder keeps needing one.
///
/// Allocation is round-robin from a cursor, so a just-released address is the last to be
/// handed out again: a client holding a stale DNS answer is unlikely to reach a different
/// service. And a holder that comes back gets its last address again if nobody took it in
/// between: a StatefulSet pod that is deleted and recreated under the same name keeps its
/// instance address, which is what its peers remember.
///
/// Persistent maps, so that a copy is cheap: the mesh state copies the book to apply a change
/// all-or-nothing, and a mesh-file edit that touches one service must not cost a copy of
/// every holder.
#[derive(Clone, Debug)]
pub struct AddressBook {
    trap: TrapCidrs,
    held: HashMap<MeshPath, u32>,
    used: OrdSet<u32>,
    cursor: u32,
    /// Free addresses and who held each last; bounded by the block's size.
    last_holder: HashMap<u32, MeshPath>,
    last_address: HashMap<MeshPath, u32>,
}

impl AddressBook {
    pub fn new(trap: TrapCidrs) -> Self {
        AddressBook {
            cursor: own_offsets(&trap).start,
            trap,
            held: HashMap::new(),
            used: OrdSet::new(),
            last_holder: HashMap::new(),
            last_address: HashMap::new(),
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
        self.assign_own(path).map(ServiceAddress::Own)
    }

    /// An address of its own for `path` (kept if it already has one).
    pub fn assign_own(&mut self, path: &MeshPath) -> Result<Ipv4Addr, AddressError> {
        if let Some(&offset) = self.held.get(path) {
            return Ok(self.ip(offset));
        }
        let offset = match self.last_address.remove(path) {
            Some(offset) if !self.used.contains(&offset) => offset,
            _ => {
                let offset = self.next_free().ok_or_else(|| AddressError::Exhausted {
                    trap: self.trap.ipv4(),
                    path: path.clone(),
                })?;
                self.cursor = offset + 1;
                offset
            }
        };
        if let Some(previous) = self.last_holder.remove(&offset) {
            self.last_address.remove(&previous);
        }
        self.used.insert(offset);
        self.held.insert(path.clone(), offset);
        Ok(self.ip(offset))
    }

    pub fn release(&mut self, path: &MeshPath) {
        if let Some(offset) = self.held.remove(path) {
            self.used.remove(&offset);
            self.last_holder.insert(offset, path.clone());
            self.last_address.insert(path.clone(), offset);
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
            got.push(book.assign_own(&path).unwrap());
        }
        assert_eq!(got.first(), Some(&Ipv4Addr::new(10, 1, 2, 2)));
        assert_eq!(got.last(), Some(&Ipv4Addr::new(10, 1, 2, 6)));
        let path: MeshPath = "/s/full".parse().unwrap();
        assert!(matches!(
            book.assign(&path, true),
            Err(AddressError::Exhausted { .. })
        ));
    }

    #[test]
    fn a_holder_that_comes_back_gets_its_address_unless_it_was_taken() {
        let trap: TrapCidrs = "10.1.2.0/28".parse().unwrap();
        let mut book = AddressBook::new(trap);
        let path = |p: &str| p.parse::<MeshPath>().unwrap();
        let db1 = book.assign(&path("/d/db/db-1"), true).unwrap();
        book.assign(&path("/d/other"), true).unwrap();
        book.release(&path("/d/db/db-1"));
        // Something else arrives first: round-robin hands it a fresh address, not db-1's.
        let newcomer = book.assign(&path("/d/new"), true).unwrap();
        assert_ne!(newcomer, db1);
        assert_eq!(book.assign(&path("/d/db/db-1"), true).unwrap(), db1);

        // Once another holder has taken the freed address, the old holder gets a new one.
        book.release(&path("/d/db/db-1"));
        let mut taken_by = None;
        for i in 0..12 {
            let p = path(&format!("/d/fill{i}"));
            match book.assign(&p, true) {
                Ok(address) if address == db1 => taken_by = Some(p),
                Ok(_) => {}
                Err(_) => break,
            }
        }
        let taken_by = taken_by.expect("the block was filled, so db-1's address was reused");
        assert!(
            !book.last_address.contains_key(&path("/d/db/db-1")),
            "db-1 has no claim on an address someone else holds"
        );
        // The newest holder is the one that gets it back.
        book.release(&taken_by);
        book.release(&path("/d/other"));
        assert_eq!(book.assign(&taken_by, true).unwrap(), db1);
    }
}
