//! Who holds which address in the trapped block. The block itself, and its rules, are part of
//! the contract every part shares ([`TrapCidrs`]).
//!
//! A holder (a service that needs an address of its own, or a stateful service's instance,
//! named by its mesh path) keeps its address for as long as it exists, whatever the order in
//! which providers report it, across restarts and upgrades of the agent:
//!
//! - **Derived from the name.** A path's candidates are fixed by a hash of the path: a few
//!   pseudo-random places in the block, then every address from the first one on. A holder
//!   takes its first candidate that nobody holds and that is not set aside (below). In a
//!   /16 with 1000 holders, 98.5 % of paths get their first candidate, so most addresses are
//!   the same on every node and after any restart, record or not.
//! - **Persisted on the node.** Two paths may want the same address; the second moves to its
//!   next candidate, so which one moves depends on which came first. The book's
//!   [`AddressRecord`] (every holder and every address set aside) is written on the node
//!   before a snapshot using a new address is published, and an agent that starts restores it:
//!   every recorded holder gets its address back, whatever order it arrives in, and nobody else
//!   can take it meanwhile.
//! - **Freed addresses are set aside.** A freed address keeps the name of its last holder and is
//!   not given to another path while any other address is free, until a quarter of the
//!   block's own addresses (at most [`MAX_SET_ASIDE`]) have been freed after it: a client
//!   holding a stale DNS answer (TTL 30 s) is unlikely to reach another service, and a holder
//!   that comes back (a StatefulSet pod deleted and recreated under its name) gets its address
//!   back, which is what its peers remember. Only when every other address is held or set
//!   aside is the longest-freed one given out.
//!
//! Persistent maps, so that a copy is cheap: the mesh state copies the book to apply a change
//! all-or-nothing, and a mesh-file edit that touches one service must not cost a copy of every
//! holder.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use imbl::{HashMap, OrdMap};
use ipnet::Ipv4Net;
use lattice_contract::TrapCidrs;
use serde::{Deserialize, Serialize};

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

/// The most freed addresses set aside for their last holders; beyond it the longest-freed is
/// forgotten. Bounds the book's memory in a large block (a /8 has 16M addresses).
pub const MAX_SET_ASIDE: usize = 65_536;

/// Pseudo-random candidates tried before the walk through the block.
const SCATTERED_CANDIDATES: u64 = 8;

/// The version of [`AddressRecord`]'s format.
pub const RECORD_FORMAT: u32 = 1;

/// Host addresses after the shared one, as offsets from the block's network address: the
/// addresses a service of its own may get (never the network, shared or broadcast address).
fn own_offsets(trap: &TrapCidrs) -> std::ops::Range<u32> {
    let size = 1u32 << (32 - trap.ipv4().prefix_len());
    2..size - 1
}

/// FNV-1a of the path, then a 64-bit finalizer (splitmix64's) so every bit of the result
/// depends on every byte. Frozen: another function would move every address not in a record.
fn path_hash(path: &MeshPath) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in path.as_str().bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    mix(hash)
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Assigns own addresses to the holders that need them (module comment).
#[derive(Clone, Debug)]
pub struct AddressBook {
    trap: TrapCidrs,
    held: HashMap<MeshPath, u32>,
    holders: HashMap<u32, MeshPath>,
    /// Addresses set aside, by when they were freed (oldest first).
    set_aside: OrdMap<u64, u32>,
    /// Each set-aside address: when it was freed, and by whom.
    freed_by: HashMap<u32, (u64, MeshPath)>,
    /// Each last holder of a set-aside address: that address.
    last_address: HashMap<MeshPath, u32>,
    /// Orders the releases.
    releases: u64,
    /// Moves with every change to who holds what or what is set aside: what a record follows.
    revision: u64,
}

impl AddressBook {
    pub fn new(trap: TrapCidrs) -> Self {
        AddressBook {
            trap,
            held: HashMap::new(),
            holders: HashMap::new(),
            set_aside: OrdMap::new(),
            freed_by: HashMap::new(),
            last_address: HashMap::new(),
            releases: 0,
            revision: 0,
        }
    }

    /// A book that gives every holder in `record` its recorded address back, whatever order
    /// they arrive in: they are set aside for them, the holders as the most recently freed
    /// (in path order), after the record's own set-aside addresses. Entries this block cannot
    /// hold (outside its own addresses, an address twice, a path twice, a path that does not
    /// parse) are left out and counted in the report.
    pub fn restore(trap: TrapCidrs, record: &AddressRecord) -> (Self, RestoreReport) {
        let mut book = AddressBook::new(trap);
        let mut report = RestoreReport::default();
        if record.format != RECORD_FORMAT {
            report.refused = Some(format!(
                "format {} (this agent reads format {RECORD_FORMAT})",
                record.format
            ));
            return (book, report);
        }
        if record.block != book.trap.ipv4().to_string() {
            report.refused = Some(format!(
                "it was written for the trapped block {}, this agent uses {}",
                record.block,
                book.trap.ipv4()
            ));
            return (book, report);
        }
        let entries = record
            .freed
            .iter()
            .map(|(path, ip)| (path, ip))
            .chain(&record.held);
        for (path, ip) in entries {
            let parsed = path.parse::<MeshPath>().ok();
            let offset = book.offset_of(*ip);
            match (parsed, offset) {
                (Some(path), Some(offset))
                    if !book.freed_by.contains_key(&offset)
                        && !book.last_address.contains_key(&path) =>
                {
                    book.set_aside_for(path, offset);
                    report.restored += 1;
                }
                _ => report.dropped += 1,
            }
        }
        (book, report)
    }

    /// What to write on the node so that a restarted agent gives every holder its address back.
    pub fn record(&self) -> AddressRecord {
        let held = self
            .held
            .iter()
            .map(|(path, offset)| (path.to_string(), self.ip(*offset)))
            .collect();
        let freed = self
            .set_aside
            .values()
            .filter_map(|offset| {
                let (_, path) = self.freed_by.get(offset)?;
                Some((path.to_string(), self.ip(*offset)))
            })
            .collect();
        AddressRecord {
            format: RECORD_FORMAT,
            block: self.trap.ipv4().to_string(),
            held,
            freed,
        }
    }

    /// Moves with every change that the record must follow.
    pub fn revision(&self) -> u64 {
        self.revision
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
        let offset = match self.last_address.get(path) {
            Some(&offset) => offset,
            None => self
                .first_free_candidate(path)
                .or_else(|| self.set_aside.values().next().copied())
                .ok_or_else(|| AddressError::Exhausted {
                    trap: self.trap.ipv4(),
                    path: path.clone(),
                })?,
        };
        self.unset(offset);
        self.held.insert(path.clone(), offset);
        self.holders.insert(offset, path.clone());
        self.revision += 1;
        Ok(self.ip(offset))
    }

    pub fn release(&mut self, path: &MeshPath) {
        let Some(offset) = self.held.remove(path) else {
            return;
        };
        self.holders.remove(&offset);
        self.set_aside_for(path.clone(), offset);
        let limit = self.set_aside_limit();
        while self.set_aside.len() > limit {
            let Some(&oldest) = self.set_aside.values().next() else {
                break;
            };
            self.unset(oldest);
        }
    }

    /// The address `path` gets when it is the first to want it: its first candidate, where the
    /// agent places it unless another path was there first.
    pub fn derived(trap: &TrapCidrs, path: &MeshPath) -> Ipv4Addr {
        let book = AddressBook::new(trap.clone());
        let offset = book
            .candidates(path)
            .next()
            .unwrap_or(own_offsets(trap).start);
        book.ip(offset)
    }

    /// How many freed addresses stay set aside: a quarter of the block's own addresses, at
    /// most [`MAX_SET_ASIDE`], so that three quarters are always there for placement by name.
    fn set_aside_limit(&self) -> usize {
        let own = own_offsets(&self.trap).len();
        (own / 4).min(MAX_SET_ASIDE)
    }

    fn set_aside_for(&mut self, path: MeshPath, offset: u32) {
        let order = self.releases;
        self.releases += 1;
        self.set_aside.insert(order, offset);
        self.freed_by.insert(offset, (order, path.clone()));
        self.last_address.insert(path, offset);
        self.revision += 1;
    }

    /// Ends `offset`'s being set aside, if it is.
    fn unset(&mut self, offset: u32) {
        if let Some((order, path)) = self.freed_by.remove(&offset) {
            self.set_aside.remove(&order);
            self.last_address.remove(&path);
            self.revision += 1;
        }
    }

    fn first_free_candidate(&self, path: &MeshPath) -> Option<u32> {
        self.candidates(path).find(|offset| {
            !self.holders.contains_key(offset) && !self.freed_by.contains_key(offset)
        })
    }

    /// `path`'s candidates, in order: a few scattered by the hash, then every own address from
    /// the first candidate on, wrapping around.
    fn candidates(&self, path: &MeshPath) -> impl Iterator<Item = u32> {
        let range = own_offsets(&self.trap);
        let first_own = range.start;
        // A block is at most a /30 (the contract), so it has at least one own address.
        let count = u64::from(range.end - range.start).max(1);
        let hash = path_hash(path);
        let at = move |pick: u64| {
            // Below the block's size, which fits in 32 bits: the conversion cannot fail.
            first_own + u32::try_from(pick % count).unwrap_or(0)
        };
        let scattered = (0..SCATTERED_CANDIDATES)
            .map(move |k| at(mix(hash ^ k.wrapping_mul(0x9e37_79b9_7f4a_7c15))));
        let walk = (0..count).map(move |k| at(hash % count + k));
        scattered.chain(walk)
    }

    fn offset_of(&self, ip: Ipv4Addr) -> Option<u32> {
        let offset = u32::from(ip).checked_sub(u32::from(self.trap.ipv4().network()))?;
        own_offsets(&self.trap).contains(&offset).then_some(offset)
    }

    fn ip(&self, offset: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.trap.ipv4().network()) + offset)
    }
}

/// The book as written on the node (JSON): every holder's address, and the addresses set
/// aside with their last holders, longest-freed first.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AddressRecord {
    pub format: u32,
    /// The trapped IPv4 block the addresses are in: a record of another block is not used.
    pub block: String,
    pub held: BTreeMap<String, Ipv4Addr>,
    pub freed: Vec<(String, Ipv4Addr)>,
}

/// What [`AddressBook::restore`] made of a record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreReport {
    /// Entries whose addresses are set aside for their holders.
    pub restored: usize,
    /// Entries left out: outside the block's own addresses, repeated, or not a mesh path.
    pub dropped: usize,
    /// Why the whole record was left out, if it was.
    pub refused: Option<String>,
}

#[cfg(test)]
mod tests;
