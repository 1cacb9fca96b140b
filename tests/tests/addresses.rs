//! Stable addresses, end to end: the real agent, fed a mesh file of 1000 services with TCP
//! ports (each has an address of its own), asked with real `dig`. Services come and go while
//! it runs (so that some arrive after others that want the same address), and it is killed
//! and restarted 20 times with the file's services in another random order each time. Every
//! name keeps its address for as long as it exists, across every restart; no address is held
//! by two names.
//!
//! The block is a /20 (4093 addresses of their own) rather than the default /16, so that
//! names wanting the same address are common (about 120 pairs among 1000 names): which of
//! two names came first, and what was freed before, is then what the agent must remember.
//!
//! Build the binaries first: `cargo build --workspace --bins`.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::time::Duration;

use lattice_e2e::agent::Agent;
use lattice_e2e::wait;
use rand::SeedableRng as _;
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom as _, SliceRandom as _};

const SERVICES: usize = 1000;
const RESTARTS: usize = 20;
/// Services removed, and as many added, between two restarts.
const CHURN: usize = 30;
const BLOCK: &str = "240.240.0.0/20";

fn dns_name(i: usize) -> String {
    format!("s{i}.addr.system.internal")
}

/// The mesh file: services `/addr/s<i>` for each `i`, in a random order.
fn mesh_text(services: &BTreeSet<usize>, rng: &mut StdRng) -> String {
    let mut order: Vec<usize> = services.iter().copied().collect();
    order.shuffle(rng);
    let mut text = String::from("services:\n");
    for i in order {
        text.push_str(&format!(
            "  - path: /addr/s{i}\n    ports:\n      - port: 5432\n    endpoints:\n      - address: 10.0.0.1\n"
        ));
    }
    text
}

fn write_mesh(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Every name in `names`, asked of the agent in one `dig` batch: the A record of each that
/// has one.
fn lookup(agent: &Agent, names: &BTreeSet<usize>) -> BTreeMap<usize, Ipv4Addr> {
    let dir = tempfile::tempdir().unwrap();
    let batch = dir.path().join("names");
    let lines: String = names
        .iter()
        .map(|i| format!("{} A\n", dns_name(*i)))
        .collect();
    std::fs::write(&batch, lines).unwrap();
    let output = lattice_e2e::dig::command()
        .arg(format!("@{}", agent.dns.ip()))
        .args(["-p", &agent.dns.port().to_string()])
        .args(["+noall", "+answer", "+tries=2", "+time=2", "-f"])
        .arg(&batch)
        .output()
        .unwrap();
    let by_name: BTreeMap<String, usize> = names.iter().map(|i| (dns_name(*i), *i)).collect();
    let mut found = BTreeMap::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if let [name, _, _, "A", address] = fields[..]
            && let Some(i) = by_name.get(name.trim_end_matches('.'))
        {
            found.insert(*i, address.parse().unwrap());
        }
    }
    found
}

/// Waits until the agent answers for exactly `services` among `asked`, and returns their
/// addresses.
fn served(
    agent: &Agent,
    services: &BTreeSet<usize>,
    asked: &BTreeSet<usize>,
) -> BTreeMap<usize, Ipv4Addr> {
    wait::until(
        "the agent to serve the mesh file",
        Duration::from_secs(30),
        || {
            let found = lookup(agent, asked);
            let answered: BTreeSet<usize> = found.keys().copied().collect();
            if answered == *services {
                Ok(found)
            } else {
                Err(format!(
                    "{} answered, {} expected; {:?} missing, {:?} extra",
                    answered.len(),
                    services.len(),
                    services.difference(&answered).take(5).collect::<Vec<_>>(),
                    answered.difference(services).take(5).collect::<Vec<_>>()
                ))
            }
        },
    )
    .unwrap()
}

fn assert_distinct(addresses: &BTreeMap<usize, Ipv4Addr>) {
    let distinct: BTreeSet<&Ipv4Addr> = addresses.values().collect();
    assert_eq!(
        distinct.len(),
        addresses.len(),
        "an address held by two names"
    );
    let network = u32::from(Ipv4Addr::new(240, 240, 0, 0));
    for address in addresses.values() {
        let offset = u32::from(*address).wrapping_sub(network);
        assert!(
            (2..(1 << 12) - 1).contains(&offset),
            "{address} is not an own address of {BLOCK}"
        );
    }
}

#[test]
fn every_name_keeps_its_address_across_churn_and_twenty_restarts_in_random_order() {
    let seed: u64 = rand::random();
    println!("seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let mesh = dir.path().join("mesh.yaml");
    let state = dir.path().join("state");
    let mut services: BTreeSet<usize> = (0..SERVICES).collect();
    let mut next = SERVICES;
    write_mesh(&mesh, &mesh_text(&services, &mut rng));
    let mut agent = Agent::start(&[
        "--mesh-file",
        mesh.to_str().unwrap(),
        "--state-dir",
        state.to_str().unwrap(),
        "--trap-cidr",
        BLOCK,
    ]);
    agent.wait_ready().unwrap();
    let mut known = served(&agent, &services, &services);
    assert_distinct(&known);

    for round in 0..RESTARTS {
        // Churn while it runs: some leave, new ones arrive after everything else.
        let all: Vec<usize> = services.iter().copied().collect();
        let gone: BTreeSet<usize> = all.choose_multiple(&mut rng, CHURN).copied().collect();
        let came: BTreeSet<usize> = (next..next + CHURN).collect();
        next += CHURN;
        services = services.difference(&gone).chain(&came).copied().collect();
        write_mesh(&mesh, &mesh_text(&services, &mut rng));
        let asked: BTreeSet<usize> = services.union(&gone).copied().collect();
        let now = served(&agent, &services, &asked);
        for i in &gone {
            known.remove(i);
        }
        for (i, address) in &now {
            let before = *known.entry(*i).or_insert(*address);
            assert_eq!(
                *address, before,
                "round {round}: s{i} moved while the agent ran"
            );
        }
        assert_distinct(&now);

        // A crash and a restart, the file's services in another order.
        write_mesh(&mesh, &mesh_text(&services, &mut rng));
        agent.restart();
        agent.wait_ready().unwrap();
        let after = served(&agent, &services, &services);
        let moved: Vec<String> = after
            .iter()
            .filter(|(i, address)| known.get(i) != Some(address))
            .map(|(i, address)| format!("s{i} {:?} -> {address}", known.get(i)))
            .collect();
        assert!(
            moved.is_empty(),
            "restart {round}: {} names moved (seed {seed}): {moved:?}",
            moved.len()
        );
        assert_distinct(&after);
    }
}
