//! The forwarding cache: upstream answers kept for their TTL, bounded in entries and in bytes,
//! least recently used out first, and fair between clients: each answer is charged to the
//! client whose query fetched it, and a client at its quota makes room from its own entries,
//! so one pod asking for endless unique names churns its own share and never flushes the
//! node's cache.
//!
//! Shards by key hash, each behind its own mutex, so hits on different names do not contend;
//! a hit takes the answer's `Arc`, never a copy of the answer. Within a shard, entries sit on
//! two intrusive lists over a slab (recency for the shard, recency per client), so every
//! operation is O(1) whatever the load.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use hickory_proto::op::Message;

use super::answer::Answer;
use crate::metrics::{DnsMetrics, Eviction};
use crate::wire::lowercase_wire_name;

/// Bytes an entry costs beyond its answer and its key: the slab slot, the index entry and the
/// client's bookkeeping, rounded up.
const ENTRY_OVERHEAD: usize = 256;
/// Entries per shard below which the cache is not split further.
const MIN_SHARD_ENTRIES: usize = 256;
const MAX_SHARDS: usize = 16;

/// What distinguishes cached answers: the question, and the request bits that change the
/// upstream's answer (DO brings signatures, CD unvalidated data, RD recursion).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct CacheKey {
    name: Box<[u8]>,
    qtype: u16,
    qclass: u16,
    dnssec_ok: bool,
    checking_disabled: bool,
    recursion_desired: bool,
}

impl CacheKey {
    pub(crate) fn of(request: &Message) -> Option<Self> {
        let question = request.queries.first()?;
        Some(Self {
            name: lowercase_wire_name(question.name()).into_boxed_slice(),
            qtype: question.query_type().into(),
            qclass: question.query_class().into(),
            dnssec_ok: request.edns.as_ref().is_some_and(|e| e.flags().dnssec_ok),
            checking_disabled: request.metadata.checking_disabled,
            recursion_desired: request.metadata.recursion_desired,
        })
    }
}

/// The cache's bounds; each is at least 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CacheLimits {
    pub(crate) entries: usize,
    pub(crate) bytes: usize,
    /// The most entries, and bytes, one client's queries may have put in the cache.
    pub(crate) source_entries: usize,
    pub(crate) source_bytes: usize,
}

impl CacheLimits {
    /// The same bounds cut into `shards` parts, rounded up.
    fn per_shard(self, shards: usize) -> Self {
        let part = |n: usize| n.div_ceil(shards).max(1);
        Self {
            entries: part(self.entries),
            bytes: part(self.bytes),
            source_entries: part(self.source_entries),
            source_bytes: part(self.source_bytes),
        }
    }
}

/// A live cached answer and how old it is, in whole seconds.
pub(crate) struct Hit {
    pub(crate) answer: Arc<Answer>,
    pub(crate) age: u32,
}

pub(crate) struct Cache {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    metrics: DnsMetrics,
}

impl Cache {
    pub(crate) fn new(limits: CacheLimits, metrics: DnsMetrics) -> Self {
        let shards = (limits.entries / MIN_SHARD_ENTRIES)
            .clamp(1, MAX_SHARDS)
            .next_power_of_two()
            .min(MAX_SHARDS);
        let per_shard = limits.per_shard(shards);
        Self {
            shards: (0..shards)
                .map(|_| Mutex::new(Shard::new(per_shard)))
                .collect(),
            hasher: RandomState::new(),
            metrics,
        }
    }

    /// The live answer for `key` at `now`; an expired one is dropped.
    pub(crate) fn get(&self, key: &CacheKey, now: Instant) -> Option<Hit> {
        let mut shard = self.shard(key);
        let hit = shard.get(key, now);
        self.account(&mut shard);
        hit
    }

    /// Keeps `answer` for `ttl` seconds from `now`, charged to `source`, if it fits the limits.
    pub(crate) fn insert(
        &self,
        key: CacheKey,
        answer: Arc<Answer>,
        ttl: u32,
        source: IpAddr,
        now: Instant,
    ) {
        let mut shard = self.shard(&key);
        shard.insert(key, answer, ttl, source, now);
        self.account(&mut shard);
    }

    fn shard(&self, key: &CacheKey) -> MutexGuard<'_, Shard> {
        // Hash bits above those the shard's own map is likely to use first.
        let hash = self.hasher.hash_one(key);
        let index = (hash >> 48) as usize & (self.shards.len() - 1);
        // Nothing in a shard's critical sections panics (no indexing past a checked slot, no
        // unwrap), so a poisoned lock still guards a consistent shard.
        self.shards[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves what the shard counted since the last call into the metrics.
    fn account(&self, shard: &mut Shard) {
        let changes = std::mem::take(&mut shard.changes);
        for (reason, count) in [
            (Eviction::Capacity, changes.capacity),
            (Eviction::SourceQuota, changes.source_quota),
            (Eviction::Expired, changes.expired),
        ] {
            if count > 0 {
                self.metrics.cache_evicted(reason, count);
            }
        }
        if changes.entries != 0 || changes.bytes != 0 {
            self.metrics.cache_size(changes.entries, changes.bytes);
        }
    }
}

/// What a shard did since it was last accounted for.
#[derive(Debug, Default)]
struct Changes {
    capacity: u64,
    source_quota: u64,
    expired: u64,
    entries: i64,
    bytes: i64,
}

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Links {
    prev: u32,
    next: u32,
}

const UNLINKED: Links = Links {
    prev: NIL,
    next: NIL,
};

/// A list threaded through the slab: head is the most recently used.
#[derive(Clone, Copy, Debug)]
struct List {
    head: u32,
    tail: u32,
}

const EMPTY: List = List {
    head: NIL,
    tail: NIL,
};

/// Which of a slot's two links a list runs through.
#[derive(Clone, Copy)]
enum Thread {
    Shard,
    Source,
}

struct Slot {
    key: CacheKey,
    answer: Arc<Answer>,
    stored: Instant,
    expires: Instant,
    source: IpAddr,
    size: usize,
    shard: Links,
    own: Links,
}

impl Slot {
    fn links(&mut self, thread: Thread) -> &mut Links {
        match thread {
            Thread::Shard => &mut self.shard,
            Thread::Source => &mut self.own,
        }
    }
}

/// One client's entries in a shard.
#[derive(Debug)]
struct Owner {
    list: List,
    entries: usize,
    bytes: usize,
}

struct Shard {
    limits: CacheLimits,
    index: HashMap<CacheKey, u32>,
    slots: Vec<Option<Slot>>,
    free: Vec<u32>,
    recency: List,
    owners: HashMap<IpAddr, Owner>,
    entries: usize,
    bytes: usize,
    changes: Changes,
}

impl Shard {
    fn new(limits: CacheLimits) -> Self {
        Self {
            limits,
            index: HashMap::new(),
            slots: Vec::new(),
            free: Vec::new(),
            recency: EMPTY,
            owners: HashMap::new(),
            entries: 0,
            bytes: 0,
            changes: Changes::default(),
        }
    }

    fn get(&mut self, key: &CacheKey, now: Instant) -> Option<Hit> {
        let index = *self.index.get(key)?;
        let slot = self.slot(index)?;
        if now >= slot.expires {
            self.remove(index, Some(Eviction::Expired));
            return None;
        }
        let (answer, stored, source) = (slot.answer.clone(), slot.stored, slot.source);
        let age =
            u32::try_from(now.saturating_duration_since(stored).as_secs()).unwrap_or(u32::MAX);
        let mut recency = self.recency;
        self.unlink(&mut recency, index, Thread::Shard);
        self.push_front(&mut recency, index, Thread::Shard);
        self.recency = recency;
        if let Some(mut list) = self.owners.get(&source).map(|o| o.list) {
            self.unlink(&mut list, index, Thread::Source);
            self.push_front(&mut list, index, Thread::Source);
            if let Some(owner) = self.owners.get_mut(&source) {
                owner.list = list;
            }
        }
        Some(Hit { answer, age })
    }

    fn insert(
        &mut self,
        key: CacheKey,
        answer: Arc<Answer>,
        ttl: u32,
        source: IpAddr,
        now: Instant,
    ) {
        if let Some(old) = self.index.get(&key).copied() {
            self.remove(old, None);
        }
        let size = entry_size(&key, &answer);
        if size > self.limits.bytes || size > self.limits.source_bytes {
            return;
        }
        // The client makes room from its own entries first, least recently used out.
        while let Some(owner) = self.owners.get(&source) {
            if owner.entries < self.limits.source_entries
                && owner.bytes + size <= self.limits.source_bytes
            {
                break;
            }
            let victim = owner.list.tail;
            let reason = self.reason(victim, now, Eviction::SourceQuota);
            if !self.remove(victim, Some(reason)) {
                break;
            }
        }
        while self.entries > 0
            && (self.entries >= self.limits.entries || self.bytes + size > self.limits.bytes)
        {
            let victim = self.recency.tail;
            let reason = self.reason(victim, now, Eviction::Capacity);
            if !self.remove(victim, Some(reason)) {
                break;
            }
        }
        let slot = Slot {
            key: key.clone(),
            answer,
            stored: now,
            expires: now + Duration::from_secs(u64::from(ttl)),
            source,
            size,
            shard: UNLINKED,
            own: UNLINKED,
        };
        let index = match self.free.pop() {
            Some(index) => {
                self.slots[index as usize] = Some(slot);
                index
            }
            None => {
                // Never more slots than the entry limit, which is far below u32::MAX.
                let Ok(index) = u32::try_from(self.slots.len()) else {
                    return;
                };
                self.slots.push(Some(slot));
                index
            }
        };
        self.index.insert(key, index);
        let mut recency = self.recency;
        self.push_front(&mut recency, index, Thread::Shard);
        self.recency = recency;
        let mut list = self.owners.get(&source).map_or(EMPTY, |o| o.list);
        self.push_front(&mut list, index, Thread::Source);
        let owner = self.owners.entry(source).or_insert(Owner {
            list: EMPTY,
            entries: 0,
            bytes: 0,
        });
        owner.list = list;
        owner.entries += 1;
        owner.bytes += size;
        self.entries += 1;
        self.bytes += size;
        self.changes.entries += 1;
        self.changes.bytes += size as i64;
    }

    /// Why `victim` goes: it had expired anyway, or `otherwise`.
    fn reason(&self, victim: u32, now: Instant, otherwise: Eviction) -> Eviction {
        match self.slot(victim) {
            Some(slot) if now >= slot.expires => Eviction::Expired,
            _ => otherwise,
        }
    }

    fn slot(&self, index: u32) -> Option<&Slot> {
        self.slots.get(index as usize)?.as_ref()
    }

    fn slot_mut(&mut self, index: u32) -> Option<&mut Slot> {
        self.slots.get_mut(index as usize)?.as_mut()
    }

    /// Takes the entry at `index` out of every list and count; `reason` is counted if given.
    /// False if there was no entry there.
    fn remove(&mut self, index: u32, reason: Option<Eviction>) -> bool {
        let Some((source, size)) = self.slot(index).map(|s| (s.source, s.size)) else {
            return false;
        };
        let mut recency = self.recency;
        self.unlink(&mut recency, index, Thread::Shard);
        self.recency = recency;
        if let Some(mut list) = self.owners.get(&source).map(|o| o.list) {
            self.unlink(&mut list, index, Thread::Source);
            let emptied = match self.owners.get_mut(&source) {
                Some(owner) => {
                    owner.list = list;
                    owner.entries -= 1;
                    owner.bytes -= size;
                    owner.entries == 0
                }
                None => false,
            };
            if emptied {
                self.owners.remove(&source);
            }
        }
        if let Some(slot) = self.slots.get_mut(index as usize).and_then(Option::take) {
            self.index.remove(&slot.key);
        }
        self.free.push(index);
        self.entries -= 1;
        self.bytes -= size;
        self.changes.entries -= 1;
        self.changes.bytes -= size as i64;
        match reason {
            Some(Eviction::Capacity) => self.changes.capacity += 1,
            Some(Eviction::SourceQuota) => self.changes.source_quota += 1,
            Some(Eviction::Expired) => self.changes.expired += 1,
            None => {}
        }
        true
    }

    fn unlink(&mut self, list: &mut List, index: u32, thread: Thread) {
        let Some(links) = self.slot_mut(index).map(|s| *s.links(thread)) else {
            return;
        };
        match self.slot_mut(links.prev) {
            Some(prev) => prev.links(thread).next = links.next,
            None => list.head = links.next,
        }
        match self.slot_mut(links.next) {
            Some(next) => next.links(thread).prev = links.prev,
            None => list.tail = links.prev,
        }
        if let Some(slot) = self.slot_mut(index) {
            *slot.links(thread) = UNLINKED;
        }
    }

    fn push_front(&mut self, list: &mut List, index: u32, thread: Thread) {
        let old_head = list.head;
        if let Some(slot) = self.slot_mut(index) {
            *slot.links(thread) = Links {
                prev: NIL,
                next: old_head,
            };
        }
        match self.slot_mut(old_head) {
            Some(head) => head.links(thread).prev = index,
            None => list.tail = index,
        }
        list.head = index;
    }
}

/// What an entry costs against the byte limits.
pub(crate) fn entry_size(key: &CacheKey, answer: &Answer) -> usize {
    ENTRY_OVERHEAD + 2 * key.name.len() + answer.size()
}

#[cfg(test)]
mod tests;
