//! What the xDS server hands out: the snapshot of every resource ([`super::resource`]: the five
//! types, encoded resources with content versions, re-exported here as the snapshot's
//! vocabulary) for one mesh version, and the channel it is published on. The Envoy translator
//! produces these (secrets aside: a proxy's are its own, added to its
//! view of the snapshot, see [`XdsSnapshot::with_secrets`]); the stream state machines only
//! read them.

use std::collections::{HashMap, HashSet};
use std::hash::BuildHasher;
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::Instant;

use tokio::sync::watch;

use super::parts::PartsIndex;

pub use super::resource::{
    ResourceMap, ResourceType, TYPES, XdsResource, fnv1a, format_version, parse_version,
};

/// Everything Envoy should have for one mesh snapshot.
#[derive(Debug)]
pub struct XdsSnapshot {
    /// The mesh snapshot version this was built from.
    pub version: u64,
    pub resources: [ResourceMap; TYPES],
    /// Each service's share of the resources, for proxies that hold only some services
    /// (`resources` holds every service's).
    pub parts: PartsIndex,
    /// When the mesh change behind it was taken, for the push-latency histogram.
    pub changed_at: Instant,
    /// Hash indexes of `resources`, built when first asked for (see [`Self::names`]).
    pub indexes: Indexes,
    /// The inbound listener of each proxy whose pod captures inbound; none when the agent
    /// serves no secrets (the listener's mTLS names them).
    pub inbound: Option<Arc<dyn InboundListeners>>,
}

/// Each proxy's inbound listener, by its pod's address and mode: what the translator makes of
/// the mesh's authorization rules for the pod at that address (every pod without rules gets
/// the same listener of its mode).
pub trait InboundListeners: std::fmt::Debug + Send + Sync {
    /// The listener of the pod at `pod`, in `mode`, letting the kubelet's `probes` through;
    /// `mtls`: whether its proxy holds its leaf (without, mesh mTLS is closed).
    fn listener(
        &self,
        pod: std::net::IpAddr,
        mode: crate::identity::InboundMode,
        probes: &[crate::identity::InboundProbe],
        mtls: bool,
    ) -> Arc<XdsResource>;
    /// How many authorization rules hold at the pod's ports, for `/debug/xds`.
    fn rules(&self, pod: std::net::IpAddr) -> usize;
}

impl XdsSnapshot {
    pub fn of(&self, kind: ResourceType) -> &ResourceMap {
        &self.resources[kind.index()]
    }

    /// This snapshot as one proxy sees it, with `secrets` its own and, when given, its inbound
    /// listener beside the others: everything else, and what was computed of it, shared (a
    /// push to a proxy with secrets costs what it costs any; a proxy holds a listener or two,
    /// so recomputing the listeners' indexes costs nothing).
    pub fn with_secrets(
        &self,
        secrets: ResourceMap,
        inbound: Option<&Arc<XdsResource>>,
    ) -> XdsSnapshot {
        let mut resources = self.resources.clone();
        resources[ResourceType::Secret.index()] = secrets;
        let mut indexes = self.indexes.clone();
        let mut own = vec![ResourceType::Secret];
        if let Some(listener) = inbound {
            resources[ResourceType::Listener.index()]
                .insert(listener.name.clone(), listener.clone());
            own.push(ResourceType::Listener);
        }
        for kind in own {
            indexes.names[kind.index()] = Arc::default();
            indexes.wholes[kind.index()] = Arc::default();
        }
        XdsSnapshot {
            version: self.version,
            resources,
            parts: self.parts.clone(),
            changed_at: self.changed_at,
            indexes,
            inbound: self.inbound.clone(),
        }
    }

    /// Looks up `count` names of a type. Many names at once (a stream's first request, which
    /// names or holds every resource at 10k services) go through a hash index of the type,
    /// built once per snapshot and shared by every stream; a profile of a reconnect at 10k
    /// services showed the ordered map's lookups (pointer chasing and string compares, 14 per
    /// name) as most of the agent's CPU. A few names use the ordered map itself.
    pub fn names(&self, kind: ResourceType, count: usize) -> Names<'_> {
        let map = self.of(kind);
        let index = (count >= BULK_LOOKUP).then(|| &**self.name_index(kind));
        Names { map, index }
    }

    /// The hash index of a type by name, built once per snapshot; shared, so a subscription
    /// to every name of the type can be the index itself (see `stream::Subscription`).
    pub fn name_index(&self, kind: ResourceType) -> &Arc<NameIndex> {
        self.indexes.names[kind.index()].get_or_init(|| {
            Arc::new(
                self.of(kind)
                    .iter()
                    .map(|(name, resource)| (name.clone(), resource.clone()))
                    .collect(),
            )
        })
    }

    /// The hash index of a type when it has been built (see [`XdsSnapshot::name_index`]).
    pub fn built_name_index(&self, kind: ResourceType) -> Option<&Arc<NameIndex>> {
        self.indexes.names[kind.index()].get()
    }

    /// When `listed` (`count` names, each with the version it must be at, if one matters)
    /// is every resource of a type, each once: the type's shared index. A Delta client that
    /// reconnects holding the whole type, or a proxy that subscribes to every assignment, is
    /// then held as the snapshot's own map or index instead of a set of its own. Told by
    /// XOR-ing keyed hashes of the names (and versions) as they came, against the same sums
    /// over the snapshot's (see [`Whole`]): no lookup per name (a lookup per name was most of
    /// a whole-mesh proxy's reconnect at 50k services, a cache miss or two each). A list that
    /// repeats one name and leaves another out does not add up. Only from [`BULK_LOOKUP`]
    /// names: below that a set of its own costs little.
    pub fn every_resource<'a>(
        &self,
        kind: ResourceType,
        count: usize,
        listed: impl IntoIterator<Item = (&'a str, Option<u64>)>,
    ) -> Option<&Arc<NameIndex>> {
        if count < BULK_LOOKUP || count != self.of(kind).len() {
            return None;
        }
        let (mut names, mut listing, mut versioned) = (0, 0, 0);
        for (name, version) in listed {
            let hash = name_hash(name);
            names ^= hash;
            if let Some(version) = version {
                listing ^= listing_hash(hash, version);
                versioned += 1;
            }
        }
        let whole = self.whole(kind);
        let versions_match = versioned == 0 || (versioned == count && listing == whole.listing);
        (names == whole.names && versions_match).then(|| self.name_index(kind))
    }

    /// The digest and the sums of a whole type (see [`Whole`]), computed once per snapshot
    /// and shared by every stream.
    pub fn whole(&self, kind: ResourceType) -> Whole {
        *self.indexes.wholes[kind.index()].get_or_init(|| {
            let mut whole = Whole::default();
            for resource in self.of(kind).values() {
                whole.add(resource);
            }
            whole
        })
    }
}

/// A whole type of a snapshot in a few words: what a client holding exactly all of it
/// reports as its version (`digest`, the XOR of [`entry_hash`] over every resource, as a client
/// view keeps it), and which names and versions make it up (`names`, `listing`: XORs of hashes
/// keyed per process, so a client cannot make up a list that adds up to them). A reconnecting
/// client that lists what it holds is recognised as holding the whole type by the same sums
/// over its list (see [`XdsSnapshot::every_resource`]): a list that repeats a name and leaves
/// another out does not add up (but for a 64-bit collision).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Whole {
    pub digest: u64,
    pub names: u64,
    pub listing: u64,
}

impl Whole {
    pub fn add(&mut self, resource: &Arc<XdsResource>) {
        self.digest ^= entry_hash(&resource.name, resource.version);
        let name = name_hash(&resource.name);
        self.names ^= name;
        self.listing ^= listing_hash(name, resource.version);
    }
}

/// The key of [`name_hash`] and [`listing_hash`]: random per process.
static LIST_KEY: LazyLock<foldhash::quality::RandomState> = LazyLock::new(Default::default);

/// One name's share of [`Whole::names`].
fn name_hash(name: &str) -> u64 {
    LIST_KEY.hash_one(name)
}

/// One name and version's share of [`Whole::listing`], from the name's [`name_hash`]: a name
/// is hashed once however it is counted (its bytes were most of the hashing of a reconnect's
/// list). Still keyed, so a made-up list does not add up but by a collision of the keyed
/// name hashes.
fn listing_hash(name_hash: u64, version: u64) -> u64 {
    LIST_KEY.hash_one((name_hash, version))
}

/// One entry's share of a client's version digest: the name's hash and the version, mixed so
/// that XOR-ing many of them does not cancel out structure. Stable across builds (FNV-1a), as a
/// SotW client sends its version back to a restarted agent.
pub fn entry_hash(name: &str, version: u64) -> u64 {
    mix(fnv1a(name.as_bytes()) ^ version.rotate_left(32))
}

/// splitmix64's finaliser.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// From this many names a lookup builds (or uses) the hash index. Below it, ordered lookups
/// cost less than building an index of a large type would; the figure is a judgement, not
/// tuned (a stream's first request at 10k services names 10k).
const BULK_LOOKUP: usize = 1024;

/// Hash sets and maps of resource names, per stream: foldhash instead of std's SipHash, which
/// was 7 % of the agent's CPU in a 10k-service first sync (every name of a type is hashed a few
/// times per stream). Its per-process random seed still keeps a client from choosing colliding
/// names in advance.
pub(super) type NameSet = HashSet<Arc<str>, foldhash::fast::RandomState>;
pub(super) type NameMap<V> = HashMap<Arc<str>, V, foldhash::fast::RandomState>;

pub type NameIndex = HashMap<Arc<str>, Arc<XdsResource>, foldhash::fast::RandomState>;

/// Per resource type, what is computed from a snapshot only when first asked for: a hash
/// index by name, and the type's [`Whole`]. Each behind an `Arc`, so that a proxy's view
/// with its secrets ([`XdsSnapshot::with_secrets`]) shares those of the other types.
#[derive(Clone, Default)]
pub struct Indexes {
    names: [Arc<OnceLock<Arc<NameIndex>>>; TYPES],
    wholes: [Arc<OnceLock<Whole>>; TYPES],
}

impl Indexes {
    /// Whether the index of a type has been built.
    pub fn built(&self, kind: ResourceType) -> bool {
        self.names[kind.index()].get().is_some()
    }
}

impl std::fmt::Debug for Indexes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let built: Vec<bool> = ResourceType::ALL.map(|kind| self.built(kind)).to_vec();
        f.debug_tuple("Indexes").field(&built).finish()
    }
}

/// Name lookups into one type of a snapshot (see [`XdsSnapshot::names`]).
pub struct Names<'a> {
    map: &'a ResourceMap,
    index: Option<&'a NameIndex>,
}

impl<'a> Names<'a> {
    pub fn get_key_value(&self, name: &str) -> Option<(&'a Arc<str>, &'a Arc<XdsResource>)> {
        match self.index {
            Some(index) => index.get_key_value(name),
            None => self.map.get_key_value(name),
        }
    }

    pub fn get(&self, name: &str) -> Option<&'a Arc<XdsResource>> {
        self.get_key_value(name).map(|(_, resource)| resource)
    }

    /// The snapshot's own `Arc` of a name, so per-stream sets share it instead of holding
    /// copies; a name the snapshot lacks gets an `Arc` of its own.
    pub fn intern(&self, name: &str) -> Arc<str> {
        self.get_key_value(name)
            .map_or_else(|| Arc::from(name), |(key, _)| key.clone())
    }
}

pub type XdsTx = watch::Sender<Option<Arc<XdsSnapshot>>>;
/// The published Envoy resources; `None` until the first mesh snapshot is translated, so no
/// proxy is ever answered from an empty or partial mesh.
pub type XdsRx = watch::Receiver<Option<Arc<XdsSnapshot>>>;

/// The channel from the translator to the xDS server.
pub fn channel() -> (XdsTx, XdsRx) {
    watch::channel(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::xds::testing::World;

    /// What a reconnecting whole-mesh proxy lists is recognised as the whole type only when
    /// it is exactly every name (at its version, when versions are listed), each once.
    #[test]
    fn every_resource_is_every_name_at_its_version_once() {
        let snap = World::new().add_many(BULK_LOOKUP);
        let kind = ResourceType::Cluster;
        let map = snap.of(kind);
        let listed: Vec<(&str, u64)> = map.iter().map(|(n, r)| (&**n, r.version)).collect();
        let every = |list: &[(&str, Option<u64>)]| {
            snap.every_resource(kind, list.len(), list.iter().copied())
                .is_some()
        };
        let versioned: Vec<(&str, Option<u64>)> =
            listed.iter().map(|&(n, v)| (n, Some(v))).collect();
        let names: Vec<(&str, Option<u64>)> = listed.iter().map(|&(n, _)| (n, None)).collect();
        assert!(every(&versioned), "every name at its version");
        assert!(every(&names), "every name");
        let mut reversed = versioned.clone();
        reversed.reverse();
        assert!(every(&reversed), "in any order");

        let mut stale = versioned.clone();
        stale[7].1 = stale[7].1.map(|v| v ^ 1);
        assert!(!every(&stale), "one version another");
        let mut repeated = names.clone();
        repeated[3] = repeated[4];
        assert!(!every(&repeated), "one name twice, another left out");
        let mut unknown = names.clone();
        unknown[5].0 = "not|a|cluster";
        assert!(!every(&unknown), "a name the snapshot lacks");
        let mut mixed = versioned.clone();
        mixed[9].1 = None;
        assert!(!every(&mixed), "versions for some names only");
        assert!(!every(&versioned[1..]), "one left out");
    }

    #[test]
    fn names_through_the_index_are_the_snapshots_own() {
        let snap = World::new().add_many(20);
        let map = snap.of(ResourceType::Cluster);
        for count in [1, BULK_LOOKUP] {
            let names = snap.names(ResourceType::Cluster, count);
            for (name, resource) in map {
                let (key, found) = names.get_key_value(name).unwrap();
                assert!(Arc::ptr_eq(key, name), "the snapshot's own name");
                assert!(Arc::ptr_eq(found, resource));
                assert!(Arc::ptr_eq(&names.intern(name), name));
            }
            assert!(names.get("absent|1").is_none());
            assert_eq!(&*names.intern("absent|1"), "absent|1");
            assert_eq!(
                snap.indexes.built(ResourceType::Cluster),
                count >= BULK_LOOKUP,
                "built for many names only"
            );
        }
        assert!(!snap.indexes.built(ResourceType::Endpoint));
    }
}
