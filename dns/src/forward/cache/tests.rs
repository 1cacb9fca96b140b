//! The cache against its bounds, and against a plain model under random operations.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};

use hickory_proto::op::{Message, OpCode, Query};
use hickory_proto::rr::rdata::TXT;
use hickory_proto::rr::{Name, RData, Record, RecordType};
use prometheus_client::registry::Registry;
use proptest::prelude::*;

use super::*;

fn request(name: &str) -> Message {
    let mut m = Message::query();
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(
        Name::from_ascii(name).unwrap(),
        RecordType::TXT,
    ));
    m
}

fn key(name: &str) -> CacheKey {
    CacheKey::of(&request(name)).unwrap()
}

/// An answer to `name` whose text is `len` bytes.
fn answer(name: &str, len: usize) -> Arc<Answer> {
    let mut m = Message::response(1, OpCode::Query);
    let owner = Name::from_ascii(name).unwrap();
    m.add_query(Query::query(owner.clone(), RecordType::TXT));
    m.add_answer(Record::from_rdata(
        owner,
        300,
        RData::TXT(TXT::new(
            "x".repeat(len)
                .as_bytes()
                .chunks(250)
                .map(|c| String::from_utf8_lossy(c).into_owned())
                .collect(),
        )),
    ));
    Arc::new(Answer::from_upstream(m, 300).unwrap())
}

fn source(n: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, n))
}

fn cache(limits: CacheLimits) -> (Cache, Registry) {
    let mut registry = Registry::default();
    let metrics = DnsMetrics::new(&mut registry);
    (Cache::new(limits, metrics), registry)
}

fn metric(registry: &Registry, prefix: &str) -> f64 {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .map_or(0.0, |v| v.parse().unwrap())
}

fn roomy(entries: usize, source_entries: usize) -> CacheLimits {
    CacheLimits {
        entries,
        bytes: usize::MAX / 2,
        source_entries,
        source_bytes: usize::MAX / 2,
    }
}

/// Entries, bytes and per-source counts as the shards hold them, checked against their lists.
fn census(cache: &Cache) -> (usize, usize, HashMap<IpAddr, usize>) {
    let (mut entries, mut bytes, mut sources) = (0, 0, HashMap::new());
    for shard in cache.shards.iter() {
        let shard = shard.lock().unwrap();
        let mut walked = 0;
        let mut at = shard.recency.head;
        while let Some(slot) = shard.slot(at) {
            walked += 1;
            *sources.entry(slot.source).or_insert(0) += 1;
            at = slot.shard.next;
        }
        assert_eq!(walked, shard.entries, "the recency list holds every entry");
        assert_eq!(shard.index.len(), shard.entries);
        for (source, owner) in &shard.owners {
            let mut own = 0;
            let mut at = owner.list.head;
            while let Some(slot) = shard.slot(at) {
                assert_eq!(slot.source, *source);
                own += 1;
                at = slot.own.next;
            }
            assert_eq!(own, owner.entries, "{source}'s list holds its entries");
            assert!(owner.entries <= shard.limits.source_entries);
            assert!(owner.bytes <= shard.limits.source_bytes);
        }
        assert!(shard.entries <= shard.limits.entries);
        assert!(shard.bytes <= shard.limits.bytes);
        entries += shard.entries;
        bytes += shard.bytes;
    }
    (entries, bytes, sources)
}

#[test]
fn least_recently_used_goes_first() {
    let (c, registry) = cache(roomy(3, 3));
    let now = Instant::now();
    for name in ["a.test.", "b.test.", "c.test."] {
        c.insert(key(name), answer(name, 10), 300, source(1), now);
    }
    assert!(c.get(&key("a.test."), now).is_some());
    c.insert(key("d.test."), answer("d.test.", 10), 300, source(1), now);
    assert!(
        c.get(&key("b.test."), now).is_none(),
        "b was least recently used"
    );
    for name in ["a.test.", "c.test.", "d.test."] {
        assert!(c.get(&key(name), now).is_some(), "{name}");
    }
    assert_eq!(
        metric(
            &registry,
            "lattice_dns_cache_evictions_total{reason=\"source_quota\"}"
        ),
        1.0
    );
    assert_eq!(metric(&registry, "lattice_dns_cache_entries"), 3.0);
}

#[test]
fn a_flood_of_unique_names_from_one_source_leaves_the_others_entries_alone() {
    let (c, registry) = cache(roomy(200, 25));
    assert_eq!(c.shards.len(), 1, "one shard: the quota is exact");
    let now = Instant::now();
    let theirs: Vec<String> = (0..100).map(|i| format!("app{i}.example.")).collect();
    for (i, name) in theirs.iter().enumerate() {
        c.insert(
            key(name),
            answer(name, 20),
            300,
            source(2 + (i % 5) as u8),
            now,
        );
    }
    for i in 0..20_000 {
        let name = format!("flood{i}.attacker.example.");
        c.insert(key(&name), answer(&name, 20), 300, source(1), now);
    }
    for name in &theirs {
        assert!(c.get(&key(name), now).is_some(), "{name} was flushed");
    }
    let (entries, _, sources) = census(&c);
    assert_eq!(
        sources[&source(1)],
        25,
        "the flood keeps its quota's worth, its latest"
    );
    assert_eq!(entries, 125);
    assert!(c.get(&key("flood19999.attacker.example."), now).is_some());
    assert!(c.get(&key("flood0.attacker.example."), now).is_none());
    assert_eq!(
        metric(
            &registry,
            "lattice_dns_cache_evictions_total{reason=\"source_quota\"}"
        ),
        (20_000 - 25) as f64
    );
    assert_eq!(
        metric(
            &registry,
            "lattice_dns_cache_evictions_total{reason=\"capacity\"}"
        ),
        0.0
    );
}

#[test]
fn answers_expire_after_their_ttl_and_age_meanwhile() {
    let (c, registry) = cache(roomy(10, 10));
    let now = Instant::now();
    c.insert(key("a.test."), answer("a.test.", 10), 60, source(1), now);
    let hit = c
        .get(&key("a.test."), now + Duration::from_millis(59_999))
        .unwrap();
    assert_eq!(hit.age, 59);
    assert!(
        c.get(&key("a.test."), now + Duration::from_secs(60))
            .is_none()
    );
    assert_eq!(
        metric(
            &registry,
            "lattice_dns_cache_evictions_total{reason=\"expired\"}"
        ),
        1.0
    );
    assert_eq!(census(&c).0, 0);
    assert_eq!(metric(&registry, "lattice_dns_cache_bytes"), 0.0);
}

#[test]
fn bytes_are_bounded_whatever_the_answers_size() {
    // The largest entry of the test: the longest name.
    let big = entry_size(&key("n99.test."), &answer("n99.test.", 4000));
    let limits = CacheLimits {
        entries: 200,
        bytes: 10 * big,
        source_entries: 200,
        source_bytes: 5 * big,
    };
    let (c, _) = cache(limits);
    let now = Instant::now();
    for i in 0..100u8 {
        let name = format!("n{i}.test.");
        c.insert(key(&name), answer(&name, 4000), 300, source(i % 4), now);
    }
    let (entries, bytes, sources) = census(&c);
    assert!(bytes <= 10 * big, "{bytes}");
    assert_eq!(entries, 10);
    assert!(sources.values().all(|&n| n <= 5));
    // An answer larger than a client's share is not cached at all.
    let huge = answer("huge.test.", 60_000);
    c.insert(key("huge.test."), huge, 300, source(9), now);
    assert!(c.get(&key("huge.test."), now).is_none());
}

#[test]
fn a_large_cache_is_sharded_and_still_within_its_limits() {
    let limits = CacheLimits {
        entries: 10_000,
        bytes: 16 << 20,
        source_entries: 1_250,
        source_bytes: 2 << 20,
    };
    let (c, _) = cache(limits);
    assert_eq!(c.shards.len(), MAX_SHARDS);
    let now = Instant::now();
    for i in 0..40_000u32 {
        let name = format!("n{i}.test.");
        c.insert(
            key(&name),
            answer(&name, 50),
            300,
            source((i % 64) as u8),
            now,
        );
    }
    let (entries, bytes, sources) = census(&c);
    // Each shard rounds its part up: at most one entry more per shard.
    assert!(entries <= limits.entries + MAX_SHARDS, "{entries}");
    assert!(entries >= limits.entries * 9 / 10, "{entries}");
    assert!(bytes <= limits.bytes + MAX_SHARDS);
    assert!(
        sources
            .values()
            .all(|&n| n <= limits.source_entries + MAX_SHARDS)
    );
}

#[test]
fn a_new_answer_replaces_the_old_one_for_the_same_question() {
    let (c, _) = cache(roomy(10, 10));
    let now = Instant::now();
    c.insert(key("a.test."), answer("a.test.", 10), 60, source(1), now);
    c.insert(
        key("A.test."),
        answer("a.test.", 30),
        60,
        source(2),
        now + Duration::from_secs(5),
    );
    let (entries, _, sources) = census(&c);
    assert_eq!(entries, 1);
    assert_eq!(
        sources.get(&source(1)),
        None,
        "charged to the second client now"
    );
    assert_eq!(
        c.get(&key("a.test."), now + Duration::from_secs(6))
            .unwrap()
            .age,
        1
    );
}

/// The cache as a list in recency order, its rules applied by brute force.
#[derive(Debug, Default)]
struct Model {
    /// (key, source, size, stored, expires), most recently used first.
    entries: Vec<(u8, u8, usize, u64, u64)>,
}

impl Model {
    fn get(&mut self, key: u8, now: u64) -> Option<u64> {
        let at = self.entries.iter().position(|e| e.0 == key)?;
        let entry = self.entries.remove(at);
        if now >= entry.4 {
            return None;
        }
        self.entries.insert(0, entry);
        Some(now - entry.3)
    }

    fn insert(&mut self, limits: CacheLimits, entry: (u8, u8, usize, u64, u64)) {
        self.entries.retain(|e| e.0 != entry.0);
        let (source, size) = (entry.1, entry.2);
        if size > limits.bytes || size > limits.source_bytes {
            return;
        }
        loop {
            let own: Vec<usize> = (0..self.entries.len())
                .filter(|&i| self.entries[i].1 == source)
                .collect();
            let own_bytes: usize = own.iter().map(|&i| self.entries[i].2).sum();
            if own.len() < limits.source_entries && own_bytes + size <= limits.source_bytes {
                break;
            }
            self.entries.remove(*own.last().unwrap());
        }
        while !self.entries.is_empty()
            && (self.entries.len() >= limits.entries
                || self.entries.iter().map(|e| e.2).sum::<usize>() + size > limits.bytes)
        {
            self.entries.pop();
        }
        self.entries.insert(0, entry);
    }
}

#[derive(Clone, Debug)]
enum Op {
    Insert {
        key: u8,
        source: u8,
        len: usize,
        ttl: u32,
    },
    Get {
        key: u8,
    },
    Advance {
        seconds: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..24, 0u8..4, prop::sample::select(vec![10usize, 200, 900]), 1u32..40)
            .prop_map(|(key, source, len, ttl)| Op::Insert { key, source, len, ttl }),
        3 => (0u8..24).prop_map(|key| Op::Get { key }),
        1 => (0u64..15).prop_map(|seconds| Op::Advance { seconds }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Hits, misses and ages agree with the model whatever the interleaving, and every bound
    /// holds after every step.
    #[test]
    fn the_cache_behaves_as_its_model(ops in prop::collection::vec(op(), 1..250)) {
        let unit = entry_size(&key("k0.test."), &answer("k0.test.", 200));
        let limits = CacheLimits {
            entries: 8,
            bytes: 9 * unit,
            source_entries: 4,
            source_bytes: 5 * unit,
        };
        let (c, _) = cache(limits);
        prop_assert_eq!(c.shards.len(), 1);
        let mut model = Model::default();
        let start = Instant::now();
        let mut now = 0u64;
        for op in ops {
            let at = start + Duration::from_secs(now);
            match op {
                Op::Insert { key: k, source: s, len, ttl } => {
                    let name = format!("k{k}.test.");
                    let a = answer(&name, len);
                    let size = entry_size(&key(&name), &a);
                    c.insert(key(&name), a, ttl, source(s), at);
                    model.insert(limits, (k, s, size, now, now + u64::from(ttl)));
                }
                Op::Get { key: k } => {
                    let got = c.get(&key(&format!("k{k}.test.")), at).map(|h| u64::from(h.age));
                    prop_assert_eq!(got, model.get(k, now), "get k{}", k);
                }
                Op::Advance { seconds } => now += seconds,
            }
            let (entries, bytes, _) = census(&c);
            prop_assert_eq!(entries, model.entries.len());
            prop_assert_eq!(bytes, model.entries.iter().map(|e| e.2).sum::<usize>());
        }
    }
}
