//! The mesh name table: an immutable index from lower-cased wire-format names to addresses, with the
//! A answer records of every name encoded once so the fast path only copies bytes; which names
//! are in the zone at all; and the scope each name's lookups are reported under (see
//! `observe.rs`), which is not a record and never makes a name exist. The zone's own names, its
//! apex and its name server `ns.system.internal`, are the zone's and never a mesh name.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use hickory_proto::rr::Name;
use lattice_contract::ZONE;

use crate::wire::{lowercase_wire_name_from_dotted, lowercase_wire_name_into};

/// Size of one A record in an answer whose owner is the question name (compression pointer to
/// offset 12): pointer 2, type 2, class 2, TTL 4, rdlength 2, address 4.
pub(crate) const A_RR_LEN: usize = 16;
/// Offset of the TTL inside such a record; the table stores 0 there and the server patches it.
pub(crate) const A_RR_TTL_OFFSET: usize = 6;

/// What a mesh name holds, as the agent hands it to [`NameTable::from_records`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MeshRecord {
    /// An A or AAAA record.
    Address(IpAddr),
    /// An SRV record (RFC 2782), as Kubernetes DNS publishes for named ports.
    Srv(SrvRecord),
    /// The name exists but holds nothing (yet): NODATA, not NXDOMAIN. A stateful service none
    /// of whose instances is ready.
    Exists,
    /// Not a record: answers for this name are reported to the server's
    /// [`crate::LookupObserver`] under this key (the agent's: the service the name belongs
    /// to). It never makes a name exist: it is ignored for a name without other records, in
    /// whatever order the records come. A name given several scopes keeps the last one.
    Scope(Arc<str>),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SrvRecord {
    pub priority: u16,
    pub weight: u16,
    pub port: u16,
    /// A name without the trailing dot: `db-1.db.data.system.internal`.
    pub target: String,
}

/// The records of one mesh name.
#[derive(Debug, Default)]
pub(crate) struct NameEntry {
    pub(crate) v4: Vec<Ipv4Addr>,
    pub(crate) v6: Vec<Ipv6Addr>,
    /// The A records of `v4`, wire-encoded with a pointer to the question name and TTL 0.
    pub(crate) a_records: Box<[u8]>,
    /// (priority, weight, port, target).
    pub(crate) srv: Vec<(u16, u16, u16, Name)>,
    /// What lookups of this name are reported as ([`MeshRecord::Scope`]).
    pub(crate) scope: Option<Arc<str>>,
}

/// What the table knows about a name inside the zone.
#[derive(Debug)]
pub(crate) enum Lookup<'a> {
    Service(&'a NameEntry),
    /// A name with no records of its own that has service names below it (RFC 8020: NODATA,
    /// not NXDOMAIN).
    EmptyNonTerminal,
    Missing,
}

/// The `*.system.internal` names of the mesh. Built once per mesh snapshot and shared as
/// `Arc<NameTable>`; the DNS server swaps whole tables, never edits one.
#[derive(Debug)]
pub struct NameTable {
    /// Shared by a provisional table and the same table settled ([`NameTable::settled`]).
    records: Arc<Records>,
    /// Not the mesh's yet (see [`NameTable::pending`]).
    pending: bool,
    /// The mesh's as last known, not yet confirmed (see [`NameTable::provisional`]).
    provisional: bool,
}

/// Filled with the mesh's names, which a query only looks up: a fast hash, randomly seeded.
/// SipHash was a sixth of building the table at 50k services.
type Hasher = foldhash::fast::RandomState;

#[derive(Debug)]
struct Records {
    names: HashMap<Box<[u8]>, NameEntry, Hasher>,
    empty_non_terminals: HashSet<Box<[u8]>, Hasher>,
    serial: u32,
}

/// Writes the table's key for a mesh name (lower-cased wire form) into `key`; `false`, with a
/// warning, for a name it cannot hold.
fn mesh_key(name: &str, zone: &[u8], key: &mut Vec<u8>) -> bool {
    if !lowercase_wire_name_into(name, key) {
        tracing::warn!(%name, "skipping mesh name: not a valid DNS name");
        return false;
    }
    if key == zone || !in_zone(key) {
        tracing::warn!(%name, zone = ZONE, "skipping mesh name: not below the zone");
        return false;
    }
    if key == NAMESERVER_WIRE {
        tracing::warn!(%name, "skipping mesh name: it is the zone's name server, whose address is the DNS server's own (rename the service)");
        return false;
    }
    true
}

impl NameTable {
    /// The table before the mesh is known: it holds no name, and every name of the zone is
    /// answered SERVFAIL (retryable) rather than NXDOMAIN, which resolvers would cache as the
    /// name's absence. A server given it also waits for the first real table before it
    /// takes traffic from a predecessor (see `DnsServer::run`).
    pub fn pending() -> Self {
        Self {
            pending: true,
            ..Self::new(Vec::new())
        }
    }

    /// Whether this is the table before the mesh is known ([`NameTable::pending`]).
    pub fn is_pending(&self) -> bool {
        self.pending
    }

    /// This table, as one of a mesh that may have changed since (the agent's last mesh, read
    /// back at start while its sources are listed): the names it holds are answered, and every
    /// other name of the zone SERVFAIL, as by a pending table, never NXDOMAIN (the name may
    /// have been added since). A server bound beside another waits for a table that is not
    /// provisional, as for one that is not pending.
    pub fn provisional(mut self) -> Self {
        self.provisional = true;
        self
    }

    /// The same names as a current table: what a provisional table becomes once its mesh is
    /// confirmed unchanged. Shares the records.
    pub fn settled(&self) -> Self {
        NameTable {
            records: Arc::clone(&self.records),
            pending: self.pending,
            provisional: false,
        }
    }

    /// Whether this table may be out of date ([`NameTable::provisional`]).
    pub fn is_provisional(&self) -> bool {
        self.provisional
    }

    /// Whether this is the mesh's current table: neither pending nor provisional.
    pub fn is_settled(&self) -> bool {
        !self.pending && !self.provisional
    }

    /// `entries`: fully qualified names without the trailing dot (`buzz.bar.foo.system.internal`)
    /// and their addresses. A name may appear several times (several addresses, IPv4 and IPv6).
    /// Names outside `system.internal`, the apex itself, the name server's name
    /// (`ns.system.internal`, the mesh path `/ns`) and names that are not valid DNS names are
    /// skipped with a warning: the table is built from a mesh that was already validated.
    pub fn new(entries: impl IntoIterator<Item = (String, IpAddr)>) -> Self {
        Self::from_records(
            entries
                .into_iter()
                .map(|(name, addr)| (name, MeshRecord::Address(addr))),
        )
    }

    /// Like [`NameTable::new`], with every kind of [`MeshRecord`]. An SRV record whose target
    /// is not a valid name is skipped with a warning.
    pub fn from_records<N: AsRef<str>>(entries: impl IntoIterator<Item = (N, MeshRecord)>) -> Self {
        let entries = entries.into_iter();
        let names = entries.size_hint().0 / 2;
        Self::from_records_sized(names, entries)
    }

    /// [`NameTable::from_records`] for about `names` names: the table is sized once rather
    /// than grown, and rehashed, as it fills. Names may be borrowed; the records of one name
    /// given one after another are read as one name (its wire form made once).
    pub fn from_records_sized<N: AsRef<str>>(
        names: usize,
        entries: impl IntoIterator<Item = (N, MeshRecord)>,
    ) -> Self {
        let zone = lowercase_wire_name_from_dotted(ZONE).unwrap_or_default();
        let mut names: HashMap<Box<[u8]>, NameEntry, Hasher> =
            HashMap::with_capacity_and_hasher(names, Hasher::default());
        // A scope goes on its name's entry; one that comes before any other record of its
        // name waits until every name is known (one alone makes no name exist). The last one of
        // a name wins: a waiting one only ever came before those put on at once.
        let mut waiting_scopes = Vec::new();
        // The last name read, and whether its key (in `key`) is one the table can hold: the
        // records of one name, one after another, make its key once.
        let mut last: Option<(N, bool)> = None;
        let mut key = Vec::with_capacity(64);
        for (name, record) in entries {
            if last
                .as_ref()
                .is_none_or(|(last, _)| last.as_ref() != name.as_ref())
            {
                let valid = mesh_key(name.as_ref(), &zone, &mut key);
                last = Some((name, valid));
            }
            let Some((name, true)) = &last else {
                continue;
            };
            if let MeshRecord::Scope(scope) = record {
                match names.get_mut(key.as_slice()) {
                    Some(entry) => entry.scope = Some(scope),
                    None => waiting_scopes.push((Box::<[u8]>::from(key.as_slice()), scope)),
                }
                continue;
            }
            let entry = match names.get_mut(key.as_slice()) {
                Some(entry) => entry,
                None => names.entry(Box::from(key.as_slice())).or_default(),
            };
            match record {
                MeshRecord::Address(IpAddr::V4(v4)) if !entry.v4.contains(&v4) => entry.v4.push(v4),
                MeshRecord::Address(IpAddr::V6(v6)) if !entry.v6.contains(&v6) => entry.v6.push(v6),
                MeshRecord::Srv(srv) => match Name::from_ascii(&srv.target) {
                    Ok(mut target) => {
                        target.set_fqdn(true);
                        let record = (srv.priority, srv.weight, srv.port, target);
                        if !entry.srv.contains(&record) {
                            entry.srv.push(record);
                        }
                    }
                    Err(_) => {
                        let name = name.as_ref();
                        tracing::warn!(%name, target = %srv.target, "skipping SRV record: target is not a valid name")
                    }
                },
                MeshRecord::Address(_) | MeshRecord::Exists | MeshRecord::Scope(_) => {}
            }
        }
        for (key, scope) in waiting_scopes.into_iter().rev() {
            if let Some(entry) = names.get_mut(&key) {
                entry.scope.get_or_insert(scope);
            }
        }
        let mut empty_non_terminals: HashSet<Box<[u8]>, Hasher> = HashSet::default();
        for (key, entry) in &mut names {
            entry.a_records = encode_a_records(&entry.v4);
            let mut rest: &[u8] = key;
            // Walk up from the name to the apex; every ancestor strictly between is a
            // non-terminal. One already known has its own ancestors known: most names share
            // their namespace's, so the walk usually ends at the first.
            while let Some((&len, tail)) = rest.split_first() {
                rest = tail.get(usize::from(len)..).unwrap_or_default();
                if rest.len() <= zone.len() || empty_non_terminals.contains(rest) {
                    break;
                }
                empty_non_terminals.insert(Box::<[u8]>::from(rest));
            }
        }
        empty_non_terminals.retain(|k| !names.contains_key(k));
        let serial = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| (d.as_secs() & u64::from(u32::MAX)) as u32)
            .unwrap_or(1);
        Self {
            records: Arc::new(Records {
                names,
                empty_non_terminals,
                serial,
            }),
            pending: false,
            provisional: false,
        }
    }

    /// SOA serial of this table: the second it was built, so a newer table has a larger serial.
    pub(crate) fn serial(&self) -> u32 {
        self.records.serial
    }

    /// `key` is a lower-cased wire-format name below the zone.
    pub(crate) fn lookup(&self, key: &[u8]) -> Lookup<'_> {
        if let Some(entry) = self.records.names.get(key) {
            Lookup::Service(entry)
        } else if self.records.empty_non_terminals.contains(key) {
            Lookup::EmptyNonTerminal
        } else {
            Lookup::Missing
        }
    }

    /// The entry of a service name; `key` is a lower-cased wire-format name.
    pub(crate) fn service(&self, key: &[u8]) -> Option<&NameEntry> {
        self.records.names.get(key)
    }
}

fn encode_a_records(addrs: &[Ipv4Addr]) -> Box<[u8]> {
    let mut out = Vec::with_capacity(addrs.len() * A_RR_LEN);
    for addr in addrs {
        out.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 0, 0, 4]);
        out.extend_from_slice(&addr.octets());
    }
    out.into_boxed_slice()
}

/// `ZONE` in wire format; a unit test checks the two agree.
const ZONE_WIRE: &[u8] = b"\x06system\x08internal\x00";

/// The zone's name server, `ns.` before `ZONE`, in wire format: the NS and SOA name, whose
/// address is the DNS server's own.
const NAMESERVER_WIRE: &[u8] = b"\x02ns\x06system\x08internal\x00";

pub(crate) fn nameserver_wire_name() -> &'static [u8] {
    NAMESERVER_WIRE
}

/// True if the lower-cased wire name `key` is the zone apex or below it.
pub(crate) fn in_zone(key: &[u8]) -> bool {
    if key == ZONE_WIRE {
        return true;
    }
    // Below the apex only if the suffix starts on a label boundary.
    let mut rest = key;
    while let Some((&len, tail)) = rest.split_first() {
        if rest == ZONE_WIRE {
            return true;
        }
        if len == 0 {
            return false;
        }
        rest = tail.get(usize::from(len)..).unwrap_or_default();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use lattice_contract::ZONE_NAMESERVER_LABEL;

    fn table() -> NameTable {
        NameTable::new([
            (
                "buzz.bar.foo.system.internal".to_string(),
                "240.240.0.1".parse().unwrap(),
            ),
            (
                "Buzz.Bar.Foo.system.internal.".to_string(),
                "240.240.0.2".parse().unwrap(),
            ),
            (
                "buzz.bar.foo.system.internal".to_string(),
                "fd00::1".parse().unwrap(),
            ),
            (
                "db.foo.system.internal".to_string(),
                "240.240.0.3".parse().unwrap(),
            ),
            ("example.com".to_string(), "192.0.2.1".parse().unwrap()),
            ("system.internal".to_string(), "192.0.2.1".parse().unwrap()),
            ("xsystem.internal".to_string(), "192.0.2.1".parse().unwrap()),
            (
                "bad..system.internal".to_string(),
                "192.0.2.1".parse().unwrap(),
            ),
        ])
    }

    #[test]
    fn indexes_names_case_insensitively_and_skips_foreign_ones() {
        let t = table();
        assert_eq!(t.records.names.len(), 2, "distinct names");
        let key = lowercase_wire_name_from_dotted("BUZZ.bar.foo.system.internal").unwrap();
        let Lookup::Service(e) = t.lookup(&key) else {
            panic!("buzz missing")
        };
        assert_eq!(e.v4.len(), 2);
        assert_eq!(e.v6.len(), 1);
        assert_eq!(e.a_records.len(), 2 * A_RR_LEN);
        assert_eq!(&e.a_records[12..16], &[240, 240, 0, 1]);
    }

    #[test]
    fn a_scope_marks_an_existing_name_and_makes_none_exist() {
        let (first, last): (Arc<str>, Arc<str>) = (Arc::from("first"), Arc::from("last"));
        let scope = |name: &str, key: &Arc<str>| (name.to_string(), MeshRecord::Scope(key.clone()));
        // The scopes come before the address they mark: the order of records is arbitrary.
        let t = NameTable::from_records([
            scope("db.foo.system.internal", &first),
            scope("db.foo.system.internal", &last),
            (
                "db.foo.system.internal".to_string(),
                MeshRecord::Address("240.240.0.3".parse().unwrap()),
            ),
            scope("ghost.elsewhere.system.internal", &first),
        ]);
        let key = lowercase_wire_name_from_dotted("db.foo.system.internal").unwrap();
        let Lookup::Service(entry) = t.lookup(&key) else {
            panic!("db missing")
        };
        assert_eq!(entry.scope.as_ref(), Some(&last), "the last scope wins");
        // A name with a scope only is not there, and neither are its ancestors.
        for name in [
            "ghost.elsewhere.system.internal",
            "elsewhere.system.internal",
        ] {
            let key = lowercase_wire_name_from_dotted(name).unwrap();
            assert!(matches!(t.lookup(&key), Lookup::Missing), "{name}");
        }
        assert_eq!(t.records.names.len(), 1);

        // One before the name's address, one after it: still the last.
        let address = MeshRecord::Address("240.240.0.3".parse().unwrap());
        for (records, expected) in [
            (
                vec![
                    scope("db.foo.system.internal", &first),
                    ("db.foo.system.internal".to_string(), address.clone()),
                    scope("db.foo.system.internal", &last),
                ],
                &last,
            ),
            (
                vec![
                    ("db.foo.system.internal".to_string(), address.clone()),
                    scope("db.foo.system.internal", &last),
                    scope("db.foo.system.internal", &first),
                ],
                &first,
            ),
        ] {
            let t = NameTable::from_records(records);
            let Lookup::Service(entry) = t.lookup(&key) else {
                panic!("db missing")
            };
            assert_eq!(entry.scope.as_ref(), Some(expected), "the last scope wins");
        }
    }

    #[test]
    fn ancestors_are_empty_non_terminals() {
        let t = table();
        for name in ["bar.foo.system.internal", "foo.system.internal"] {
            let key = lowercase_wire_name_from_dotted(name).unwrap();
            assert!(matches!(t.lookup(&key), Lookup::EmptyNonTerminal), "{name}");
        }
        let key = lowercase_wire_name_from_dotted("nope.system.internal").unwrap();
        assert!(matches!(t.lookup(&key), Lookup::Missing));
    }

    #[test]
    fn zone_wire_is_the_contract_zone() {
        assert_eq!(
            lowercase_wire_name_from_dotted(ZONE).as_deref(),
            Some(ZONE_WIRE)
        );
        assert_eq!(
            lowercase_wire_name_from_dotted(&format!("{ZONE_NAMESERVER_LABEL}.{ZONE}")).as_deref(),
            Some(NAMESERVER_WIRE)
        );
    }

    #[test]
    fn the_name_servers_name_is_never_a_mesh_name() {
        let t = NameTable::new([
            (
                "NS.system.internal".to_string(),
                "240.240.0.9".parse().unwrap(),
            ),
            (
                "a.ns.system.internal".to_string(),
                "240.240.0.8".parse().unwrap(),
            ),
        ]);
        let ns = lowercase_wire_name_from_dotted("ns.system.internal").unwrap();
        assert!(t.service(&ns).is_none());
        assert!(
            matches!(t.lookup(&ns), Lookup::EmptyNonTerminal),
            "a name below it still makes it exist"
        );
    }

    #[test]
    fn zone_membership_respects_label_boundaries() {
        let yes = [
            "system.internal",
            "a.system.internal",
            "A.B.system.internal",
        ];
        for n in yes {
            assert!(in_zone(&lowercase_wire_name_from_dotted(n).unwrap()), "{n}");
        }
        let no = [
            "xsystem.internal",
            "internal",
            "system.internal.example",
            ".",
        ];
        for n in no {
            assert!(
                !in_zone(&lowercase_wire_name_from_dotted(n).unwrap()),
                "{n}"
            );
        }
    }
}
