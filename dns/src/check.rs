//! The query path's self-check: the entry point of the cargo-fuzz target (`dns/fuzz`), also run
//! over random input by the unit tests so the normal suite exercises it. Built only for those two
//! (`cfg(test)`, or `cfg(fuzzing)` as cargo-fuzz sets it), never into the agent.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, OnceLock};

use hickory_proto::op::{Message, MessageType};

use crate::fast;
use crate::forward::answer::Answer;
use crate::query::{self, Outcome, ZoneSettings};
use crate::table::{MeshRecord, NameTable};
use crate::wire::{self, MAX_UDP_PAYLOAD, MIN_UDP_PAYLOAD, Transport};

fn table() -> &'static NameTable {
    static TABLE: OnceLock<NameTable> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut entries: Vec<(String, IpAddr)> = vec![
            (
                "buzz.bar.foo.system.internal".into(),
                IpAddr::V4(Ipv4Addr::new(240, 240, 0, 1)),
            ),
            (
                "db.foo.system.internal".into(),
                IpAddr::V4(Ipv4Addr::new(240, 240, 0, 2)),
            ),
            (
                "db.foo.system.internal".into(),
                "fd00::2".parse().unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            ),
            (
                "v6.system.internal".into(),
                "fd00::3".parse().unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            ),
        ];
        entries.extend((0..100).map(|i| {
            (
                "many.system.internal".to_string(),
                IpAddr::V4(Ipv4Addr::new(240, 240, 1, i)),
            )
        }));
        // Scopes, so the fast and general paths are held to report the same one.
        let scopes = ["buzz.bar.foo.system.internal", "db.foo.system.internal"]
            .map(|name| (name.to_string(), MeshRecord::Scope(Arc::from(name))));
        NameTable::from_records(
            entries
                .into_iter()
                .map(|(name, address)| (name, MeshRecord::Address(address)))
                .chain(scopes),
        )
    })
}

/// Runs `data` through the query path as a query over UDP and TCP, and as an upstream answer to
/// a forwarded query (fresh and aged in the cache), and panics if an invariant breaks:
/// - nothing panics, whatever the input;
/// - every reply parses, carries the query's id, is a response, and fits the client's UDP limit;
/// - whatever the fast path answers, the general path answers the same.
pub fn check_query(data: &[u8]) {
    let table = table();
    let zone = ZoneSettings {
        ttl: 30,
        negative_ttl: 15,
        nameserver: Some(IpAddr::V4(Ipv4Addr::new(169, 254, 20, 10))),
    };
    let mut out = [0u8; u16::MAX as usize];
    for transport in [Transport::Udp, Transport::Tcp] {
        let fast = fast::answer(table, zone.ttl, data, transport, &mut out);
        let general = query::handle(table, zone, data, transport);
        if let Outcome::Reply { bytes, .. } = &general {
            check_reply(data, bytes, transport);
        }
        if let Some((len, fast_scope)) = fast {
            let Outcome::Reply { bytes, scope, .. } = &general else {
                panic!("the fast path answered {data:02x?} but the general path gave {general:?}");
            };
            let fast_reply = Message::from_vec(&out[..len]);
            let general_reply = Message::from_vec(bytes);
            assert!(
                fast_reply.is_ok(),
                "fast path reply does not parse: {:02x?}",
                &out[..len]
            );
            assert_eq!(
                fast_reply.ok(),
                general_reply.ok(),
                "fast and general paths disagree on {data:02x?}"
            );
            assert_eq!(fast_scope, scope.as_ref(), "scopes of {data:02x?}");
        }
        if let Outcome::Forward(request) = general
            && let Ok(mut upstream) = Message::from_vec(data)
        {
            // The forwarder only accepts responses; pretend this one is.
            upstream.metadata.message_type = MessageType::Response;
            if let Ok(answer) = Answer::from_upstream(upstream, 300) {
                for age in [0, 7, u32::MAX] {
                    check_reply(data, &answer.reply(&request, age, transport), transport);
                }
            }
        }
    }
}

fn check_reply(query: &[u8], reply: &[u8], transport: Transport) {
    let parsed = Message::from_vec(reply);
    assert!(
        parsed.is_ok(),
        "reply does not parse: {reply:02x?} (query {query:02x?})"
    );
    let Ok(parsed) = parsed else { return };
    assert_eq!(
        reply.get(..2),
        query.get(..2),
        "reply id differs from the query's"
    );
    assert_eq!(parsed.metadata.message_type, MessageType::Response);
    if transport == Transport::Udp {
        assert!(
            reply.len() <= usize::from(MAX_UDP_PAYLOAD),
            "UDP reply of {} bytes",
            reply.len()
        );
        let limit = Message::from_vec(query).map_or(usize::from(MIN_UDP_PAYLOAD), |q| {
            wire::response_limit(&q, transport)
        });
        assert!(
            reply.len() <= limit,
            "UDP reply of {} bytes over the client's limit {limit}",
            reply.len()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Queries that reach the interesting branches, mutated byte by byte.
    fn seeds() -> Vec<Vec<u8>> {
        let mut seeds = Vec::new();
        for (name, qtype) in [
            ("buzz.bar.foo.system.internal.", 1u16),
            ("BuZz.bar.foo.system.internal.", 1),
            ("many.system.internal.", 1),
            ("db.foo.system.internal.", 28),
            ("v6.system.internal.", 1),
            ("system.internal.", 6),
            ("nope.system.internal.", 1),
            ("buzz.bar.foo.system.internal.ns.svc.cluster.local.", 1),
            ("example.com.", 1),
        ] {
            for edns in [false, true] {
                let mut m = Message::query();
                let name = hickory_proto::rr::Name::from_ascii(name).unwrap();
                m.add_query(hickory_proto::op::Query::query(name, qtype.into()));
                if edns {
                    let mut e = hickory_proto::op::Edns::new();
                    e.set_max_payload(4096);
                    m.set_edns(e);
                }
                seeds.push(m.to_vec().unwrap());
            }
        }
        seeds
    }

    #[test]
    fn seeds_pass_the_check() {
        for seed in seeds() {
            check_query(&seed);
        }
    }

    #[test]
    fn random_and_mutated_queries_pass_the_check() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let seeds = seeds();
        for i in 0..20_000 {
            let mut data = if i % 4 == 0 {
                let len = rng.random_range(0..64);
                (0..len).map(|_| rng.random()).collect()
            } else {
                seeds[i % seeds.len()].clone()
            };
            for _ in 0..rng.random_range(1..4) {
                if data.is_empty() {
                    break;
                }
                let at = rng.random_range(0..data.len());
                match rng.random_range(0..3) {
                    0 => data[at] = rng.random(),
                    1 => data.truncate(at),
                    _ => data.insert(at, rng.random()),
                }
            }
            check_query(&data);
        }
    }
}
