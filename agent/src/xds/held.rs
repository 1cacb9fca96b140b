//! What one client holds of one resource type, exactly: for each name, the resource it was sent
//! and acknowledged (or, after a Delta reconnect, only the version it says it holds). Both ADS
//! machines keep one per type ([`ClientView`]); a state-of-the-world client's version of a type
//! is the view's digest, so two views holding the same versions have the same version string,
//! across pushes and agent restarts.
//!
//! Compared with a snapshot map by digest, not by count: the XOR of a hash of each entry's name
//! and version, kept up to date entry by entry. Versions are content hashes, so a view whose
//! length and digest equal a map's holds that map's content (but for a 64-bit collision, which
//! a client could only craft against itself: it would be sent less).

use std::sync::Arc;

use super::snapshot::{NameMap, ResourceMap, Whole, XdsResource, entry_hash, format_version};

/// The resources of one type a client holds (Delta: has acknowledged; SotW: was sent in an
/// acknowledged response).
///
/// Held as a snapshot map the client held entirely when it was last in sync (`base`, shared
/// with the snapshot: no memory of its own) and the names where it differs since (`changes`).
/// A client that holds the whole mesh costs a few words instead of a hash map of every name: at
/// 10k services and a hundred proxies those maps were a quarter of the agent's heap.
///
/// During a first sync the client receives the snapshot's resources in name order, a budget's
/// worth per response: it then holds the first part of a map, up to a name (`held`), which
/// grows response by response ([`ClientView::extend`]) instead of a map of its own growing by a
/// name at a time (docs/benchmarks.md, "Agent memory").
#[derive(Debug, Default)]
pub(super) struct ClientView {
    base: ResourceMap,
    /// How much of `base` the client holds, in its name order.
    held: Held,
    /// `Some(resource)`: held as that; `None`: in the held part of `base`, but not held.
    changes: NameMap<Option<Arc<XdsResource>>>,
    len: usize,
    digest: u64,
}

/// The part of a [`ClientView`]'s base the client holds.
#[derive(Debug, Default, PartialEq)]
enum Held {
    #[default]
    All,
    /// The names up to this one, included.
    Through(Arc<str>),
}

impl Held {
    fn covers(&self, name: &str) -> bool {
        match self {
            Held::All => true,
            Held::Through(last) => name <= &**last,
        }
    }
}

impl ClientView {
    /// What the client holds of `name`.
    pub(super) fn get(&self, name: &str) -> Option<&Arc<XdsResource>> {
        match self.changes.get(name) {
            Some(held) => held.as_ref(),
            None => self.based(name).map(|(_, r)| r),
        }
    }

    /// The version the client holds of `name`.
    pub(super) fn version(&self, name: &str) -> Option<u64> {
        self.get(name).map(|r| r.version)
    }

    /// The entry of `name` in the part of the base the client holds.
    fn based(&self, name: &str) -> Option<(&Arc<str>, &Arc<XdsResource>)> {
        if !self.held.covers(name) {
            return None;
        }
        self.base.get_key_value(name)
    }

    /// The view of a client that holds exactly `current`, whose [`Whole`] is `whole`: the map
    /// itself, shared, and nothing of its own.
    pub(super) fn whole(current: &ResourceMap, whole: Whole) -> ClientView {
        ClientView {
            base: current.clone(),
            held: Held::All,
            changes: NameMap::default(),
            len: current.len(),
            digest: whole.digest,
        }
    }

    /// Whether the client holds exactly `current`, known without looking at any resource: its
    /// very map, or as many resources with the same digest (see the top).
    pub(super) fn is_exactly(&self, current: &ResourceMap, whole: Whole) -> bool {
        self.is_based_on(current) || (self.len == current.len() && self.digest == whole.digest)
    }

    /// Whether the view is `current` itself, with nothing of its own.
    pub(super) fn is_based_on(&self, current: &ResourceMap) -> bool {
        self.changes.is_empty() && self.held == Held::All && self.base.ptr_eq(current)
    }

    /// When the client holds exactly `current`, keeps that map as the view and nothing of its
    /// own, so a client in sync costs no memory of its own.
    pub(super) fn compact(&mut self, current: &ResourceMap, whole: Whole) {
        if !self.is_based_on(current) && self.is_exactly(current, whole) {
            *self = ClientView::whole(current, whole);
        }
    }

    /// Room for `additional` more differences from the base: a reconnecting client names
    /// everything it holds at once, which would otherwise grow the map by rehashing it several
    /// times.
    pub(super) fn reserve(&mut self, additional: usize) {
        self.changes.reserve(additional);
    }

    /// The client now holds `sent` too, in increasing name order. When it held nothing, or the
    /// first part of `current` alone, and `sent` is the very next run of `current`'s entries,
    /// the part held grows and no entry is made; otherwise each goes in through
    /// [`ClientView::insert`].
    pub(super) fn extend<'a>(
        &mut self,
        current: &ResourceMap,
        sent: impl Iterator<Item = &'a Arc<XdsResource>> + Clone,
    ) {
        let Some(held) = self.next_run(current, sent.clone()) else {
            for resource in sent {
                self.insert(resource.clone());
            }
            return;
        };
        for resource in sent {
            self.digest ^= entry_hash(&resource.name, resource.version);
            self.len += 1;
        }
        self.base = current.clone();
        self.held = held;
    }

    /// What the client holds of `current` once it also holds `sent`, when that is a first part
    /// of `current` (see [`ClientView::extend`]); `None` when `sent` is not the next run.
    fn next_run<'a>(
        &self,
        current: &ResourceMap,
        sent: impl Iterator<Item = &'a Arc<XdsResource>>,
    ) -> Option<Held> {
        use std::ops::Bound;
        if !self.changes.is_empty() {
            return None;
        }
        let after = match &self.held {
            _ if self.len == 0 => Bound::Unbounded,
            Held::Through(last) if self.base.ptr_eq(current) => Bound::Excluded(&**last),
            _ => return None,
        };
        let mut entries = current.range::<_, str>((after, Bound::Unbounded));
        let mut last = None;
        for resource in sent {
            let (key, held) = entries.next()?;
            if **key != *resource.name || held.version != resource.version {
                return None;
            }
            last = Some(key);
        }
        match (last?, entries.next()) {
            (_, None) => Some(Held::All),
            (last, Some(_)) => Some(Held::Through(last.clone())),
        }
    }

    /// The client holds `resource` (under its name) now.
    pub(super) fn insert(&mut self, resource: Arc<XdsResource>) {
        use std::collections::hash_map::Entry;
        // One lookup into the base and one into the differences (an entry, hashed once).
        let based = self.based(&resource.name).map(|(_, r)| r.clone());
        let entry = self.changes.entry(resource.name.clone());
        let old = match &entry {
            Entry::Occupied(held) => held.get().clone(),
            Entry::Vacant(_) => based.clone(),
        };
        // Versions are content hashes: the same version is the same content, held already.
        if old
            .as_ref()
            .is_some_and(|old| old.version == resource.version)
        {
            return;
        }
        self.digest ^= entry_hash(entry.key(), resource.version);
        match &old {
            Some(old) => self.digest ^= entry_hash(entry.key(), old.version),
            None => self.len += 1,
        }
        let back_to_base = based.is_some_and(|b| b.version == resource.version);
        match entry {
            Entry::Occupied(held) if back_to_base => {
                held.remove();
            }
            Entry::Occupied(mut held) => {
                held.insert(Some(resource));
            }
            // Vacant: the base holds `old`, which is not `resource`.
            Entry::Vacant(slot) => {
                slot.insert(Some(resource));
            }
        }
    }

    /// The client no longer holds `name`.
    pub(super) fn remove(&mut self, name: &str) {
        let Some(old) = self.get(name).cloned() else {
            return;
        };
        self.digest ^= entry_hash(name, old.version);
        self.len -= 1;
        match self.based(name) {
            Some((key, _)) => {
                let key = key.clone();
                self.changes.insert(key, None);
            }
            None => {
                self.changes.remove(name);
            }
        }
    }

    /// How many resources the client holds.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The names of what the client holds.
    pub(super) fn names(&self) -> impl Iterator<Item = &Arc<str>> {
        use std::ops::Bound;
        let range = match &self.held {
            Held::All => (Bound::Unbounded, Bound::Unbounded),
            Held::Through(last) => (Bound::Unbounded, Bound::Included(&**last)),
        };
        let based = self
            .base
            .range::<_, str>(range)
            .map(|(name, _)| name)
            .filter(|name| !matches!(self.changes.get(*name), Some(None)));
        let added = self
            .changes
            .iter()
            .filter(|(name, held)| held.is_some() && self.based(name).is_none())
            .map(|(name, _)| name);
        based.chain(added)
    }

    /// The digest the view would have after the client also holds `sent` (replacing what it
    /// holds under those names) and drops `removed`: a SotW response's version, before the
    /// client acknowledges it.
    pub(super) fn digest_after<'a>(
        &self,
        sent: impl IntoIterator<Item = &'a Arc<XdsResource>>,
        removed: impl IntoIterator<Item = &'a Arc<str>>,
    ) -> u64 {
        let mut digest = self.digest;
        for name in removed {
            if let Some(old) = self.get(name) {
                digest ^= entry_hash(name, old.version);
            }
        }
        for resource in sent {
            if let Some(old) = self.get(&resource.name) {
                digest ^= entry_hash(&resource.name, old.version);
            }
            digest ^= entry_hash(&resource.name, resource.version);
        }
        digest
    }

    pub(super) fn version_info(&self) -> String {
        format_version(self.digest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::Protocol;
    use crate::xds::snapshot::ResourceType;
    use crate::xds::testing::World;

    /// The same view built entry by entry, without a base.
    fn plain(view: &ClientView) -> ClientView {
        let mut plain = ClientView::default();
        for name in view.names() {
            plain.insert(view.get(name).unwrap().clone());
        }
        plain
    }

    /// Everything `view` answers, as a view built entry by entry answers it.
    fn reads_as(view: &ClientView, plain: &ClientView, current: &ResourceMap) {
        assert_eq!(view.len(), plain.len());
        assert_eq!(view.version_info(), plain.version_info());
        for name in current.keys().map(|n| &**n).chain(["absent|1"]) {
            assert_eq!(view.version(name), plain.version(name), "{name}");
        }
        let mut names: Vec<&Arc<str>> = view.names().collect();
        let mut expected: Vec<&Arc<str>> = plain.names().collect();
        names.sort();
        expected.sort();
        assert_eq!(names, expected);
    }

    /// A first sync sent in name order, a budget's worth at a time, is held as a growing first
    /// part of the snapshot's map, with no entry of its own; anything else goes entry by entry.
    #[test]
    fn a_view_sent_in_order_holds_a_first_part_of_the_map() {
        let snap = World::new().add_many(20);
        let current = snap.of(ResourceType::Endpoint);
        let whole = snap.whole(ResourceType::Endpoint);
        let entries: Vec<&Arc<XdsResource>> = current.values().collect();
        assert_eq!(entries.len(), 20);
        let mut view = ClientView::default();
        let mut plain = ClientView::default();
        for chunk in entries.chunks(6) {
            view.extend(current, chunk.iter().copied());
            for &resource in chunk {
                plain.insert(resource.clone());
            }
            assert!(view.changes.is_empty(), "a part of the map, no entries");
            reads_as(&view, &plain, current);
        }
        assert!(view.is_based_on(current));
        assert!(plain.is_exactly(current, whole) && !plain.is_based_on(current));
        plain.compact(current, whole);
        assert!(plain.is_based_on(current), "compacted to the map itself");

        // A gap, or another resource under a name of the map: entry by entry.
        let mut gap = ClientView::default();
        gap.extend(current, entries[..3].iter().copied());
        gap.extend(current, entries[4..6].iter().copied());
        assert_eq!(gap.changes.len(), 2);
        let mut plain = ClientView::default();
        for &resource in entries[..3].iter().chain(&entries[4..6]) {
            plain.insert(resource.clone());
        }
        reads_as(&gap, &plain, current);
        assert!(!gap.is_exactly(current, whole));
        let stub = XdsResource::held_at(entries[0].name.clone(), entries[0].version + 1);
        let mut other = ClientView::default();
        other.extend(current, std::iter::once(&stub));
        assert_eq!(other.changes.len(), 1);
        assert_eq!(
            other.version(&entries[0].name),
            Some(entries[0].version + 1)
        );

        // A part held, then one of its names dropped and one past it added: entries on top,
        // and the part no longer grows (the next run goes entry by entry).
        let mut view = ClientView::default();
        view.extend(current, entries[..8].iter().copied());
        view.remove(&entries[2].name);
        view.insert(entries[12].clone());
        let mut plain = ClientView::default();
        for &resource in &entries[..8] {
            plain.insert(resource.clone());
        }
        plain.remove(&entries[2].name);
        plain.insert(entries[12].clone());
        reads_as(&view, &plain, current);
        view.extend(current, entries[8..10].iter().copied());
        for &resource in &entries[8..10] {
            plain.insert(resource.clone());
        }
        reads_as(&view, &plain, current);
    }

    #[test]
    fn a_view_based_on_a_snapshot_map_reads_and_digests_as_one_built_entry_by_entry() {
        let mut world = World::new();
        world.set("/a/one", Protocol::Http, &["10.0.0.1:80"]);
        let snapshot = world.set("/a/two", Protocol::Http, &["10.0.0.2:80"]);
        let current = snapshot.of(ResourceType::Endpoint);
        let whole = snapshot.whole(ResourceType::Endpoint);
        let mut view = ClientView::default();
        for resource in current.values() {
            view.insert(resource.clone());
        }
        let digest = view.version_info();
        assert_eq!(view.digest, whole.digest);
        view.compact(current, whole);
        assert!(view.changes.is_empty() && view.base.ptr_eq(current));
        assert_eq!((view.len(), view.version_info()), (2, digest.clone()));

        // Changes on top of the base: one held at another version, one dropped, one added.
        let (one, two) = ("one.a.system.internal|8080", "two.a.system.internal|8080");
        let sent = [
            XdsResource::held_at(Arc::from(one), 7),
            XdsResource::held_at(Arc::from("three|8080"), 9),
        ];
        let removed = [Arc::from(two)];
        let expected = view.digest_after(&sent, &removed);
        view.insert(sent[0].clone());
        view.remove(two);
        view.insert(sent[1].clone());
        assert_eq!(view.digest, expected, "digest_after foretells the digest");
        assert_eq!(view.version(one), Some(7));
        assert_eq!(view.version(two), None);
        assert_eq!(view.version("three|8080"), Some(9));
        let mut names: Vec<&str> = view.names().map(|n| &**n).collect();
        names.sort();
        assert_eq!(names, ["one.a.system.internal|8080", "three|8080"]);
        assert_eq!(view.len(), 2);
        assert_eq!(view.version_info(), plain(&view).version_info());
        assert!(!view.is_exactly(current, whole));
        // Undone: the base's resources again, and the same digest as before.
        view.insert(current[one].clone());
        view.insert(current[two].clone());
        view.remove("three|8080");
        assert_eq!(view.version_info(), digest);
        assert!(view.changes.is_empty(), "nothing of its own again");
        assert!(view.is_exactly(current, whole));
    }

    /// The same versions held as other resources (a Delta client's listed versions, or the
    /// same content made again by a later snapshot) are the same content: the view holds the
    /// map exactly, and compacts to it.
    #[test]
    fn the_same_versions_as_other_resources_hold_the_map_exactly() {
        let snapshot = World::new().add_many(5);
        let current = snapshot.of(ResourceType::Cluster);
        let whole = snapshot.whole(ResourceType::Cluster);
        let mut listed = ClientView::default();
        for resource in current.values() {
            listed.insert(XdsResource::held_at(
                resource.name.clone(),
                resource.version,
            ));
        }
        assert_eq!(listed.digest, whole.digest);
        assert!(listed.is_exactly(current, whole) && !listed.is_based_on(current));
        listed.compact(current, whole);
        assert!(listed.is_based_on(current));
        // One version other: not the map.
        let first = current.values().next().unwrap();
        listed.insert(XdsResource::held_at(first.name.clone(), first.version ^ 1));
        assert!(!listed.is_exactly(current, whole));
    }
}
