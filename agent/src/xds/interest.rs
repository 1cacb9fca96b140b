//! Which resources of a type a client wants ([`Interest`]), and what its names may cost the
//! agent ([`UnknownNames`]).
//!
//! Wildcards follow the xDS protocol: a first request of a wildcard type (clusters, listeners)
//! that names nothing subscribes to everything ("legacy wildcard"), and stays so while the
//! client names nothing; `*` subscribes to everything explicitly. Once a client named anything,
//! an empty SotW list means no interest, and in Delta only `*` unsubscribed ends the wildcard.

use std::sync::Arc;

use super::snapshot::{NameIndex, NameSet, Names};

/// The most bytes of names one stream may make the agent keep per type beyond the snapshot's
/// own (names a client subscribes to or says it holds that no resource has). A client's known
/// names cost a pointer each (they are the snapshot's); these cost their bytes. Envoy names
/// unknown resources only for a moment (a removed cluster's endpoints until it unsubscribes);
/// a whole-mesh proxy reconnecting after half of a 50k-service mesh went holds 25k of them,
/// about 2.5 MiB per type (with [`NAME_OVERHEAD`]).
pub(super) const UNKNOWN_NAME_BYTES: usize = 4 << 20;

/// What an unknown name costs beyond its bytes, and is charged for: its `Arc`'s counts and
/// the allocator's rounding, and its entries in this set and in the stream's subscription (a
/// pointer, a length and a control byte each, at hashbrown's load factor). Charging the bytes
/// alone let a stream of short names keep four times the bound (300k names of 14 bytes, about
/// 20 MiB, under a 4 MiB bound).
pub(super) const NAME_OVERHEAD: usize = 64;

/// Which resources of a type the client wants.
#[derive(Debug, Default)]
pub(super) struct Interest {
    pub(super) wildcard: bool,
    /// Wildcard because the client has named nothing yet (see the top); ends at the first name.
    pub(super) legacy: bool,
    pub(super) names: Subscription,
    /// How many times the interest may have lost names (see [`Interest::narrowed`]): what was
    /// found wanted at one count is still wanted while the count stands, so the resources of a
    /// response or a backlog are not looked up one by one again (a lookup per resource per
    /// stream was a tenth of the agent's CPU in a 10k-service sync).
    narrowings: u64,
}

impl Interest {
    pub(super) fn wants(&self, name: &str) -> bool {
        self.wildcard || self.names.contains(name)
    }

    /// Says that names may have left the interest (an unsubscription, wildcard dropped, a
    /// replaced subscription). Every change that can lose a name calls this.
    pub(super) fn narrowed(&mut self) {
        self.narrowings += 1;
    }

    pub(super) fn narrowings(&self) -> u64 {
        self.narrowings
    }
}

/// The names a client subscribed to. Envoy subscribes to the endpoints of every cluster it has,
/// so a proxy of the whole mesh names every assignment of the snapshot (10k at 10k services): such
/// a subscription is held as the snapshot's name index itself (`base`, shared by every stream
/// that subscribed to the same snapshot's names), and later subscriptions and unsubscriptions as
/// differences. A set of its own per stream was about 280 KiB at 10k names.
#[derive(Debug, Default)]
pub(super) struct Subscription {
    base: Option<Arc<NameIndex>>,
    /// Subscribed, not in `base`.
    added: NameSet,
    /// In `base`, not subscribed.
    removed: NameSet,
}

impl Subscription {
    /// Every name of `index`.
    pub(super) fn whole(index: Arc<NameIndex>) -> Subscription {
        Subscription {
            base: Some(index),
            ..Subscription::default()
        }
    }

    /// The subscription's own `Arc` of a name.
    pub(super) fn get(&self, name: &str) -> Option<&Arc<str>> {
        match self.base.as_ref().and_then(|base| base.get_key_value(name)) {
            Some(_) if !self.removed.is_empty() && self.removed.contains(name) => None,
            Some((key, _)) => Some(key),
            None => self.added.get(name),
        }
    }

    /// Whether this is every name of `index` and nothing else, known without a lookup.
    pub(super) fn is_all_of(&self, index: &Arc<NameIndex>) -> bool {
        self.added.is_empty()
            && self.removed.is_empty()
            && self
                .base
                .as_ref()
                .is_some_and(|base| Arc::ptr_eq(base, index))
    }

    pub(super) fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// Adds a name; whether it was new.
    pub(super) fn insert(&mut self, name: Arc<str>) -> bool {
        if self
            .base
            .as_ref()
            .is_some_and(|base| base.contains_key(&name))
        {
            self.removed.remove(&name)
        } else {
            self.added.insert(name)
        }
    }

    /// Removes a name; whether it was there.
    pub(super) fn remove(&mut self, name: &str) -> bool {
        match self.base.as_ref().and_then(|base| base.get_key_value(name)) {
            Some((key, _)) => self.removed.insert(key.clone()),
            None => self.added.remove(name),
        }
    }

    /// When the names subscribed one by one have come to be every name of `index` and no
    /// other, holds them as the index. Envoy subscribes to the endpoints of each batch of
    /// clusters it receives, and a first sync's clusters come in several responses, so its
    /// subscription to the whole mesh grows request by request instead of arriving whole.
    pub(super) fn compact(&mut self, index: &Arc<NameIndex>) {
        if self.base.is_none()
            && self.removed.is_empty()
            && self.added.len() == index.len()
            && index.keys().all(|name| self.added.contains(name))
        {
            *self = Subscription::whole(index.clone());
        }
    }

    pub(super) fn len(&self) -> usize {
        self.base.as_ref().map_or(0, |base| base.len()) - self.removed.len() + self.added.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Arc<str>> {
        let based = self
            .base
            .iter()
            .flat_map(|base| base.keys())
            .filter(|name| self.removed.is_empty() || !self.removed.contains(*name));
        based.chain(&self.added)
    }
}

impl FromIterator<Arc<str>> for Subscription {
    fn from_iter<I: IntoIterator<Item = Arc<str>>>(names: I) -> Self {
        Subscription {
            added: names.into_iter().collect(),
            ..Subscription::default()
        }
    }
}

/// The names of one type a stream made `Arc`s of because the snapshot had no resource of that
/// name, one `Arc` per name (a name named again gets the same one), and what they cost (their
/// bytes and [`NAME_OVERHEAD`] each). A name
/// leaves once nothing of the stream holds it any more ([`UnknownNames::prune`]).
#[derive(Debug, Default)]
pub(super) struct UnknownNames {
    names: NameSet,
    bytes: usize,
}

impl UnknownNames {
    /// The stream's `Arc` of `name`: the snapshot's when it has the name.
    pub(super) fn intern(&mut self, current: &Names<'_>, name: &str) -> Arc<str> {
        if let Some((key, _)) = current.get_key_value(name) {
            return key.clone();
        }
        if let Some(known) = self.names.get(name) {
            return known.clone();
        }
        let name: Arc<str> = Arc::from(name);
        self.bytes += name.len() + NAME_OVERHEAD;
        self.names.insert(name.clone());
        name
    }

    /// Forgets the names only this set still holds; what those the stream holds cost.
    pub(super) fn prune(&mut self) -> usize {
        let bytes = &mut self.bytes;
        self.names.retain(|name| {
            let held = Arc::strong_count(name) > 1;
            if !held {
                *bytes -= name.len() + NAME_OVERHEAD;
            }
            held
        });
        self.bytes
    }

    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::xds::snapshot::ResourceType;
    use crate::xds::testing::World;

    /// A subscription held as a snapshot's index, with names taken out and put back and one
    /// added, answers as a set of its own would.
    #[test]
    fn a_subscription_based_on_an_index_reads_as_a_set_of_its_own() {
        let snap = World::new().add_many(20);
        let index = snap.name_index(ResourceType::Endpoint).clone();
        let mut names = Subscription::whole(index.clone());
        let mut plain: NameSet = index.keys().cloned().collect();
        let some: Vec<Arc<str>> = index.keys().take(3).cloned().collect();
        for (name, present) in [(&some[0], false), (&some[1], false), (&some[0], true)] {
            if present {
                assert!(names.insert(name.clone()) && plain.insert(name.clone()));
            } else {
                assert!(names.remove(name) && plain.remove(name));
            }
        }
        assert!(!names.remove("absent|1"));
        assert!(names.insert(Arc::from("extra|1")) && plain.insert(Arc::from("extra|1")));
        assert!(!names.insert(some[2].clone()), "already there");
        assert_eq!(names.len(), plain.len());
        let listed: NameSet = names.iter().cloned().collect();
        assert_eq!(listed, plain);
        for name in index.keys().chain(&plain) {
            assert_eq!(names.contains(name), plain.contains(name), "{name}");
        }
        assert!(!names.contains(&some[1]) && names.contains("extra|1"));
        assert!(
            Arc::ptr_eq(names.get(&some[0]).unwrap(), &some[0]),
            "the index's own name"
        );
    }

    /// Names the snapshot has cost nothing; others cost their bytes while the stream holds
    /// them, once however often they are named.
    #[test]
    fn unknown_names_are_counted_while_held() {
        let snap = World::new().add_many(3);
        let current = snap.names(ResourceType::Cluster, 1);
        let mut unknown = UnknownNames::default();
        let known = snap
            .of(ResourceType::Cluster)
            .keys()
            .next()
            .unwrap()
            .clone();
        assert!(Arc::ptr_eq(&unknown.intern(&current, &known), &known));
        assert_eq!(unknown.bytes(), 0);
        let held = unknown.intern(&current, "nowhere|1");
        let again = unknown.intern(&current, "nowhere|1");
        assert!(Arc::ptr_eq(&held, &again));
        let dropped = unknown.intern(&current, "gone|22");
        assert_eq!(unknown.bytes(), 9 + 7 + 2 * NAME_OVERHEAD);
        drop(dropped);
        assert_eq!(
            unknown.prune(),
            9 + NAME_OVERHEAD,
            "only what is still held"
        );
        drop((held, again));
        assert_eq!(unknown.prune(), 0);
    }
}
