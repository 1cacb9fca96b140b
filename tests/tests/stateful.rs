//! Stateful services proven with traffic, for both sources: three instances `db-0`, `db-1`,
//! `db-2` of `/data/db`, each a pod that answers a TCP connection with its name and address,
//! reached by a client app through the real `lattice-init` capture and a real Envoy configured
//! by the agent. The instances come from a mesh file's named endpoints, and from a headless
//! Service whose EndpointSlice endpoints carry hostnames, served by the fake API server to the
//! agent's real kube client.
//!
//! What fails when the feature breaks:
//! - `db-1.db.data.system.internal` must reach db-1 on 100 of 100 connections (load balancing
//!   across instances, or a wrong chain, shows up as another pod's answer);
//! - db-1 moves to a new pod IP (a new backend namespace): the same name must keep the same
//!   trapped address and reach the new pod within 1 s of the change;
//! - the service name answers with the three instance addresses, then two while db-2 is not
//!   ready, and db-2 stays reachable by its own name meanwhile; SRV lists the ready instances.
//!
//! Build the binaries first: `cargo build --workspace --bins`.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lattice_e2e::agent::Agent;
use lattice_e2e::mesh_source::MeshSource as Source;
use lattice_e2e::node::{Backend, ClientPod, Node};
use lattice_e2e::wait;
use serde_json::{Value, json};

/// One topology at a time: two cores are shared by every Envoy and agent of a test.
static ONE_NODE: Mutex<()> = Mutex::new(());

const PORT: u16 = 7000;
const SERVICE: &str = "db.data.system.internal";
const SRV_NAME: &str = "_peer._tcp.db.data.system.internal";
/// How soon an instance's move must reach the data path.
const FOLLOW: Duration = Duration::from_secs(1);
/// Connections opened after db-1 moves: every PROBE_EVERY, for 2 × FOLLOW.
const PROBE_EVERY: Duration = Duration::from_millis(25);
const PROBES: u32 = 80;
/// How long the mesh may take to settle after a start or a change that is not timed.
const SETTLE: Duration = Duration::from_secs(15);

/// One instance as the source publishes it.
#[derive(Clone, Copy)]
struct Published {
    name: &'static str,
    address: Ipv4Addr,
    ready: bool,
}

/// `/data/db` in either source's terms.
trait Db {
    fn name(&self) -> &'static str;
    /// Makes `/data/db`'s instances exactly `instances`.
    fn publish(&self, instances: &[Published]);
}

/// The source, with the headless Service `data/db` in place for Kubernetes.
fn start(node: &Node, kubernetes: bool) -> Source {
    let source = Source::start(node, kubernetes).unwrap();
    if let Source::Kube { server, .. } = &source {
        server
            .apply_json(json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"namespace": "data", "name": "db"},
                "spec": {"clusterIP": "None",
                         "ports": [{"name": "peer", "port": PORT, "protocol": "TCP"}]},
            }))
            .unwrap();
    }
    source
}

impl Db for Source {
    fn name(&self) -> &'static str {
        match self {
            Source::File(_) => "mesh file",
            Source::Kube { .. } => "headless Service",
        }
    }

    fn publish(&self, instances: &[Published]) {
        match self {
            Source::File(file) => {
                let endpoints: Vec<Value> = instances
                    .iter()
                    .map(|i| json!({"address": i.address.to_string(), "name": i.name, "ready": i.ready}))
                    .collect();
                let mesh = json!({"services": [{
                    "path": "/data/db",
                    "ports": [{"port": PORT, "protocol": "tcp", "name": "peer"}],
                    "endpoints": endpoints,
                }]});
                file.write_text(&serde_norway::to_string(&mesh).unwrap())
                    .unwrap();
            }
            Source::Kube { server, .. } => {
                // As the EndpointSlice controller writes a StatefulSet's endpoints.
                let endpoints: Vec<Value> = instances
                    .iter()
                    .map(|i| {
                        json!({"addresses": [i.address.to_string()], "hostname": i.name,
                               "conditions": {"ready": i.ready, "serving": i.ready,
                                              "terminating": false}})
                    })
                    .collect();
                server
                    .apply_json(json!({
                        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                        "metadata": {"namespace": "data", "name": "db-x7k2p",
                                     "labels": {"kubernetes.io/service-name": "db"}},
                        "addressType": "IPv4",
                        "ports": [{"name": "peer", "port": PORT, "protocol": "TCP"}],
                        "endpoints": endpoints,
                    }))
                    .unwrap();
            }
        }
    }
}

/// Fields drop top to bottom: the client's Envoy first. The node is declared before the
/// fixture, so it drops last.
struct Fixture {
    client: ClientPod,
    agent: Agent,
    source: Source,
}

impl Fixture {
    /// What one connection to `addr` from the client app gets back: `<name> <pod address>`.
    fn connect(&self, addr: Ipv4Addr) -> Result<String, String> {
        let back = self
            .client
            .tcp_exchange(SocketAddr::from((addr, PORT)), b"hello\n")?;
        Ok(String::from_utf8_lossy(&back).trim().to_string())
    }

    fn addresses(&self, name: &str) -> Result<BTreeSet<Ipv4Addr>, String> {
        let answer = self.client.dig(name).map_err(|e| e.to_string())?;
        if answer.status != "NOERROR" {
            return Err(answer.text);
        }
        Ok(answer.addresses.into_iter().collect())
    }

    /// The one address `name` resolves to. A query lost on the way (UDP, a busy machine) is
    /// asked again, as a resolver would; a wrong answer is not retried away, since the
    /// caller compares it.
    fn resolve(&self, name: &str) -> Ipv4Addr {
        wait::until(&format!("{name} to resolve"), SETTLE, || {
            self.client.resolve(name).map_err(|e| e.to_string())
        })
        .unwrap()
    }

    /// The instance's trapped address, once connecting to it reaches `expected`.
    fn reachable(&self, instance: &str, expected: &str) -> Ipv4Addr {
        let name = format!("{instance}.{SERVICE}");
        wait::until(&format!("{name} to reach {expected}"), SETTLE, || {
            let ip = self.client.resolve(&name).map_err(|e| e.to_string())?;
            match self.connect(ip)? {
                answer if answer == expected => Ok(ip),
                other => Err(format!("{ip} answered {other:?}")),
            }
        })
        .unwrap()
    }

    /// The SRV records of the named port, as `<port> <target>`.
    fn srv(&self) -> BTreeSet<String> {
        let output = self
            .client
            .run("dig", &["+short", SRV_NAME, "SRV"])
            .unwrap();
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                Some(format!("{} {}", fields.get(2)?, fields.get(3)?))
            })
            .collect()
    }
}

fn answer(backend: &Backend) -> String {
    format!("{} {}", backend.identity, backend.pod.address)
}

fn instances_keep_their_names_and_addresses(kubernetes: bool) {
    let _one = ONE_NODE.lock().unwrap_or_else(|p| p.into_inner());
    let label = if kubernetes { "stk" } else { "stf" };
    let node = Node::new(label).unwrap();
    let mut pods: Vec<Backend> = [("db-0", 30), ("db-1", 31), ("db-2", 32)]
        .into_iter()
        .map(|(name, host)| node.tcp_identity(name, host, PORT).unwrap())
        .collect();
    let source = start(&node, kubernetes);
    let published = |pods: &[Backend], ready: [bool; 3]| -> Vec<Published> {
        ["db-0", "db-1", "db-2"]
            .iter()
            .zip(ready)
            .map(|(name, ready)| {
                let pod = pods.iter().find(|p| p.identity == *name).unwrap();
                Published {
                    name,
                    address: pod.pod.address,
                    ready,
                }
            })
            .collect()
    };
    source.publish(&published(&pods, [true; 3]));
    let agent = source.agent(&node).unwrap();
    let client = node.client("client", 2).unwrap();
    let fixture = Fixture {
        client,
        agent,
        source,
    };
    let which = fixture.source.name();

    // Every instance by its own name, at an address of its own.
    let addresses: Vec<Ipv4Addr> = pods
        .iter()
        .map(|pod| fixture.reachable(&pod.identity, &answer(pod)))
        .collect();
    let distinct: BTreeSet<Ipv4Addr> = addresses.iter().copied().collect();
    assert_eq!(distinct.len(), 3, "{which}: {addresses:?}");

    // 100 of 100 connections to db-1 reach db-1, and no other instance sees one.
    let before: Vec<u64> = pods.iter().map(|p| p.stats().served()).collect();
    let db1 = addresses[1];
    let answers: Vec<Result<String, String>> = (0..100).map(|_| fixture.connect(db1)).collect();
    let wrong: Vec<&Result<String, String>> = answers
        .iter()
        .filter(|a| **a != Ok(answer(&pods[1])))
        .collect();
    assert!(
        wrong.is_empty(),
        "{which}: {} of 100 reached the wrong place, the first: {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(3)]
    );
    let after: Vec<u64> = pods.iter().map(|p| p.stats().served()).collect();
    assert_eq!(after[1] - before[1], 100, "{which}: db-1's own count");
    assert_eq!(
        (after[0] - before[0], after[2] - before[2]),
        (0, 0),
        "{which}: connections that reached db-0, db-2"
    );

    // The service name lists every ready instance; SRV points at their names.
    assert_eq!(fixture.addresses(SERVICE).unwrap(), distinct, "{which}");
    let srv: BTreeSet<String> = pods
        .iter()
        .map(|p| format!("{PORT} {}.{SERVICE}.", p.identity))
        .collect();
    assert_eq!(fixture.srv(), srv, "{which}: SRV {SRV_NAME}");

    // db-1 is rescheduled: its pod goes, a new one comes up elsewhere under the same name.
    drop(pods.remove(1));
    pods.insert(1, node.tcp_identity("db-1", 41, PORT).unwrap());
    let moved_at = Instant::now();
    fixture.source.publish(&published(&pods, [true; 3]));
    // New connections are opened every PROBE_EVERY, each on its own thread: one that Envoy
    // sends to the old pod's address waits out its connect timeout, and must not hold up the
    // next.
    let expected = answer(&pods[1]);
    let probes: Vec<(Duration, Result<String, String>)> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..PROBES)
            .map(|i| {
                let start = moved_at + PROBE_EVERY * i;
                std::thread::sleep(start.saturating_duration_since(Instant::now()));
                let fixture = &fixture;
                scope.spawn(move || (start - moved_at, fixture.connect(db1)))
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let first = probes
        .iter()
        .find(|(_, got)| got.as_ref() == Ok(&expected))
        .map(|(at, _)| *at);
    println!(
        "{which}: db-1 first reached at its new pod by a connection opened {first:?} after the change"
    );
    let late: Vec<&(Duration, Result<String, String>)> = probes
        .iter()
        .filter(|(at, got)| *at >= FOLLOW && got.as_ref() != Ok(&expected))
        .collect();
    assert!(
        first.is_some() && late.is_empty(),
        "{which}: connections opened {FOLLOW:?} or more after db-1 moved must reach its new pod; \
         these did not: {late:?}"
    );
    assert_eq!(
        fixture.resolve(&format!("db-1.{SERVICE}")),
        db1,
        "{which}: same name, same address"
    );

    // db-2 stops being ready: out of the service's answer, still reachable by its own name.
    fixture
        .source
        .publish(&published(&pods, [true, true, false]));
    let ready: BTreeSet<Ipv4Addr> = [addresses[0], addresses[1]].into();
    wait::until(
        &format!("{which}: {SERVICE} without db-2"),
        SETTLE,
        || match fixture.addresses(SERVICE)? {
            listed if listed == ready => Ok(()),
            listed => Err(format!("{listed:?}")),
        },
    )
    .unwrap();
    assert_eq!(
        fixture.resolve(&format!("db-2.{SERVICE}")),
        addresses[2],
        "{which}: db-2 keeps its name and address"
    );
    assert_eq!(
        fixture.connect(addresses[2]),
        Ok(answer(&pods[2])),
        "{which}"
    );
    // And the operator can see why.
    let mesh = fixture.agent.mesh().unwrap();
    let db2 = &mesh["services"]["/data/db"]["instances"][2];
    assert_eq!(db2["name"], "db-2", "{which}: {mesh}");
    assert_eq!(db2["ready"], false, "{which}: {db2}");
    assert!(
        db2["dns"]
            .as_str()
            .unwrap_or_default()
            .contains("left out of the service name"),
        "{which}: {db2}"
    );
    let srv: BTreeSet<String> = pods[..2]
        .iter()
        .map(|p| format!("{PORT} {}.{SERVICE}.", p.identity))
        .collect();
    assert_eq!(fixture.srv(), srv, "{which}: SRV without db-2");
}

#[test]
fn instances_from_the_mesh_file() {
    instances_keep_their_names_and_addresses(false);
}

#[test]
fn instances_from_a_headless_service() {
    instances_keep_their_names_and_addresses(true);
}
