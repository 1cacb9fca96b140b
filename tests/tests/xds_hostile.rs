//! Hostile clients against the xDS server, beside an honest Envoy (figures printed, never
//! asserted): the real agent serving a generated mesh from a mesh file (identity checking
//! off, so any local process is a peer: the server's bounds are all that holds), one real Envoy
//! (Delta) whose endpoint changes are timed by its ACKs through a relay ([`AdsTap`]), as in
//! `xds_scale.rs`.
//!
//! Three phases: quiet (the honest Envoy alone, `changes` endpoint changes), under attack (the
//! same changes while every attack runs), and after (the attackers gone). The attacks, each a
//! task of this process on loopback, from addresses of their own (any of 127.0.0.0/8):
//! - `names`: one Delta stream subscribing to `names` endpoint names that do not exist, in
//!   requests of 50k, reading what it is sent;
//! - `streams`: `streams` streams from one address (connections of four streams each), each
//!   with a valid first request, never reading;
//! - `idle`: `idle` clients, each from an address of its own, that ask for clusters, listeners
//!   and every assignment and never read a byte;
//! - `silent`: `silent` streams (four per address) that never complete a first request, half
//!   sending nothing, half a prefix of 4 MB and 64 KiB of it, opened again as they are dropped;
//! - `garbage`: connections that send bytes that are no HTTP/2, one after another, `garbage`
//!   of them.
//!
//! Reported: the agent's RSS at the quiet run's peak and once it settled after it, its peak
//! under attack (both peaks sampled every 200 ms) and after the attackers went (once it stops
//! falling); the Envoy's change latency
//! quiet and under attack (p50, p99) and their ratio, and which changes under attack were the
//! slowest; the CPU the agent, Envoy and this process
//! (relay and attackers) took in each phase, in cores; the agent's refusal counters and
//! buffered-bytes gauges under attack. `LATTICE_BENCH_HOSTILE_ATTACKS` (comma-separated, all by
//! default) chooses the attacks; sizes from `LATTICE_BENCH_SERVICES` (10000),
//! `LATTICE_BENCH_CHANGES` (100), `LATTICE_BENCH_HOSTILE_NAMES` (10000000), `_STREAMS` (4000),
//! `_IDLE` (100), `_SILENT` (400), `_GARBAGE` (1000). `cargo xtask bench --only hostile` runs
//! it with a release agent.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use lattice_e2e::ads_client::{CDS, EDS, LDS};
use lattice_e2e::ads_tap::AdsTap;
use lattice_e2e::agent::{Agent, http_get};
use lattice_e2e::envoy::{AdsMode, Envoy};
use lattice_e2e::k8s_objects::{generated, ip};
use lattice_e2e::procstat;
use lattice_e2e::raw_grpc::{Connect, DELTA, RawConnection, SOTW, grpc_frame};
use prost::Message;
use serde_json::{Value, json};

const PER_SERVICE: usize = 10;
const SYNC: Duration = Duration::from_secs(600);
const CHANGE: Duration = Duration::from_secs(60);
/// Changes further apart than the agent's push rate limit (10 ms), so each is a lone change.
const CHANGE_SPACING: Duration = Duration::from_millis(50);
const MESH_CLUSTER: &str = ".system.internal|";

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn cluster(i: usize) -> String {
    let (namespace, name) = generated(i);
    format!("{name}.{namespace}.system.internal|80")
}

/// The generated mesh as a mesh file (as `xds_scale.rs` writes it): `/<namespace>/<name>`,
/// HTTP on 80, endpoints on 8080.
fn mesh_file(ips: &[Vec<String>]) -> String {
    use std::fmt::Write;
    let mut text = String::from("services:\n");
    for (i, ips) in ips.iter().enumerate() {
        let (namespace, name) = generated(i);
        let _ = write!(
            text,
            "  - path: /{namespace}/{name}\n    ports:\n      - port: 80\n        protocol: http\n        targetPort: 8080\n    endpoints:\n"
        );
        for ip in ips {
            let _ = writeln!(text, "      - address: {ip}");
        }
    }
    text
}

fn rss_mib(pid: u32) -> f64 {
    procstat::rss_mib(pid).unwrap_or(f64::NAN)
}

fn summary(values: &[f64]) -> Value {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let at = |p: f64| {
        let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
        sorted.get(rank.clamp(1, sorted.len().max(1)) - 1).copied()
    };
    json!({"p50": at(50.0), "p99": at(99.0), "max": sorted.last().copied(), "n": sorted.len()})
}

/// The agent's `lattice_xds_*` samples that say what it refused and holds.
fn xds_counters(agent: &Agent) -> Value {
    let Ok((_, text)) = agent.get("/metrics") else {
        return Value::Null;
    };
    let wanted = [
        "lattice_xds_refused_streams_total",
        "lattice_xds_refused_connections_total",
        "lattice_xds_closed_connections_total",
        "lattice_xds_connections ",
        "lattice_xds_connected_proxies ",
        "lattice_xds_request_buffered_bytes ",
        "lattice_xds_response_buffered_bytes ",
    ];
    let samples: BTreeMap<String, f64> = text
        .lines()
        .filter(|l| wanted.iter().any(|w| l.starts_with(w)))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_string(), value.parse().ok()?))
        })
        .collect();
    json!(samples)
}

fn metric(agent: &Agent, name: &str) -> f64 {
    let Ok((_, text)) = agent.get("/metrics") else {
        return f64::NAN;
    };
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

fn node(id: &str) -> Option<Node> {
    Some(Node {
        id: id.to_string(),
        cluster: "lattice".to_string(),
        ..Node::default()
    })
}

fn delta(request: DeltaDiscoveryRequest) -> Vec<u8> {
    grpc_frame(&request.encode_to_vec())
}

fn sotw(request: DiscoveryRequest) -> Vec<u8> {
    grpc_frame(&request.encode_to_vec())
}

/// An address of attack `attack` (a /16 of its own under 127/8), number `k`.
fn address(attack: u8, k: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(127, 10 + attack, 0, 0)) + 1 + k as u32)
}

fn from(ip: Ipv4Addr) -> Connect {
    Connect {
        bind: Some(IpAddr::V4(ip)),
        window: None,
    }
}

/// What an attack did, as it goes.
#[derive(Default)]
struct Tally {
    sent: AtomicU64,
    refused: AtomicU64,
    held: AtomicU64,
}

impl Tally {
    fn report(&self) -> Value {
        json!({
            "sent": self.sent.load(Ordering::Relaxed),
            "refused_or_ended": self.refused.load(Ordering::Relaxed),
            "held": self.held.load(Ordering::Relaxed),
        })
    }
}

/// `names` endpoint names that do not exist, subscribed to over one Delta stream.
async fn names_attack(xds: SocketAddr, names: usize, tally: Arc<Tally>) -> anyhow::Result<()> {
    let mut connection = RawConnection::connect(xds, from(address(0, 0))).await?;
    let mut call = connection.call(DELTA).await?;
    call.send(&delta(DeltaDiscoveryRequest {
        node: node("names.hostile"),
        type_url: CDS.to_string(),
        ..DeltaDiscoveryRequest::default()
    }))?;
    let mut body = match call.start(CHANGE).await? {
        Some(body) => body,
        None => {
            tally.refused.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
    };
    // What it is sent, read and dropped, so it is no client that does not read.
    tokio::spawn(async move {
        while let Some(Ok(data)) = body.data().await {
            let _ = body.flow_control().release_capacity(data.len());
        }
    });
    let mut sent = 0;
    while sent < names {
        let batch = (names - sent).min(50_000);
        let request = DeltaDiscoveryRequest {
            type_url: EDS.to_string(),
            resource_names_subscribe: (sent..sent + batch)
                .map(|i| format!("no-such-{i}"))
                .collect(),
            ..DeltaDiscoveryRequest::default()
        };
        if call.send_paced(&delta(request)).await.is_err() {
            tally.refused.fetch_add(1, Ordering::Relaxed);
            break;
        }
        sent += batch;
        tally.sent.store(sent as u64, Ordering::Relaxed);
    }
    tally.held.store(1, Ordering::Relaxed);
    // Held until the attack is aborted.
    let _held = (connection, call);
    std::future::pending::<()>().await;
    Ok(())
}

/// `streams` streams from one address, each with a valid first request, never read.
async fn streams_attack(xds: SocketAddr, streams: usize, tally: Arc<Tally>) {
    let mut held = Vec::new();
    let mut connections = Vec::new();
    let mut left = streams;
    while left > 0 {
        let Ok(mut connection) = RawConnection::connect(xds, from(address(1, 0))).await else {
            tally.refused.fetch_add(left as u64, Ordering::Relaxed);
            break;
        };
        for _ in 0..left.min(4) {
            left -= 1;
            tally.sent.fetch_add(1, Ordering::Relaxed);
            let Ok(mut call) = connection.call(DELTA).await else {
                tally.refused.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            let first = delta(DeltaDiscoveryRequest {
                node: node("streams.hostile"),
                type_url: CDS.to_string(),
                ..DeltaDiscoveryRequest::default()
            });
            if call.send(&first).is_err() {
                tally.refused.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            match call.start(Duration::from_secs(5)).await {
                Ok(Some(body)) => {
                    tally.held.fetch_add(1, Ordering::Relaxed);
                    held.push((call, body));
                }
                _ => {
                    tally.refused.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        connections.push(connection);
    }
    std::future::pending::<()>().await;
}

/// `idle` clients, each asking for everything and reading nothing.
async fn idle_attack(xds: SocketAddr, idle: usize, services: usize, tally: Arc<Tally>) {
    let mut held = Vec::new();
    let assignments: Vec<String> = (0..services).map(cluster).collect();
    for k in 0..idle {
        tally.sent.fetch_add(1, Ordering::Relaxed);
        let Ok(mut connection) = RawConnection::connect(xds, from(address(2, k))).await else {
            tally.refused.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let Ok(mut call) = connection.call(SOTW).await else {
            tally.refused.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        for (type_url, names) in [(CDS, &[][..]), (LDS, &[][..]), (EDS, &assignments[..])] {
            let _ = call.send(&sotw(DiscoveryRequest {
                node: node(&format!("idle-{k}.hostile")),
                type_url: type_url.to_string(),
                resource_names: names.to_vec(),
                ..DiscoveryRequest::default()
            }));
        }
        match call.start(CHANGE).await {
            Ok(Some(body)) => {
                tally.held.fetch_add(1, Ordering::Relaxed);
                held.push((connection, call, body));
            }
            _ => {
                tally.refused.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    std::future::pending::<()>().await;
}

/// `silent` streams that never complete a first request, opened again as they are dropped.
async fn silent_attack(xds: SocketAddr, silent: usize, tally: Arc<Tally>) {
    let mut tasks = tokio::task::JoinSet::new();
    for k in 0..silent {
        let tally = tally.clone();
        tasks.spawn(async move {
            loop {
                tally.sent.fetch_add(1, Ordering::Relaxed);
                let Ok(mut connection) = RawConnection::connect(xds, from(address(3, k / 4))).await
                else {
                    tally.refused.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                let Ok(mut call) = connection.call(DELTA).await else {
                    tally.refused.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                if k % 2 == 1 {
                    let mut start = vec![0];
                    start.extend_from_slice(&4_000_000u32.to_be_bytes());
                    start.extend_from_slice(&[0; 64 << 10]);
                    let _ = call.send(&start);
                }
                tally.held.fetch_add(1, Ordering::Relaxed);
                let _ = call.ended(Duration::from_secs(120)).await;
                tally.held.fetch_sub(1, Ordering::Relaxed);
                tally.refused.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// Connections that send bytes that are no HTTP/2, one after another.
async fn garbage_attack(xds: SocketAddr, garbage: usize, tally: Arc<Tally>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let bytes: Vec<u8> = (0..16 << 10)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    for k in 0..garbage {
        tally.sent.fetch_add(1, Ordering::Relaxed);
        let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
        let _ = socket.bind(SocketAddr::new(IpAddr::V4(address(4, k % 64)), 0));
        let Ok(mut stream) = socket.connect(xds).await else {
            continue;
        };
        let _ = stream.write_all(&bytes).await;
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut sink)).await;
        tally.refused.fetch_add(1, Ordering::Relaxed);
    }
    std::future::pending::<()>().await;
}

/// The honest Envoy's change latencies: `changes` single-endpoint changes, each timed from the
/// rename of the edited mesh file to Envoy's ACK of the response that carried it.
async fn changes(
    tap: &mut AdsTap,
    path: &std::path::Path,
    ips: &mut [Vec<String>],
    changes: usize,
    first: usize,
) -> Vec<f64> {
    let services = ips.len();
    let mut latencies = Vec::with_capacity(changes);
    for k in first..first + changes {
        let i = (k * 7919) % services;
        let fresh_ip = ip(50_000_000 + k as u32);
        ips[i][k % PER_SERVICE] = fresh_ip.clone();
        let tmp = path.with_extension("yaml.tmp");
        std::fs::write(&tmp, mesh_file(ips)).expect("write the mesh file");
        let applied = Instant::now();
        std::fs::rename(&tmp, path).expect("rename the mesh file");
        let fresh = SocketAddr::new(fresh_ip.parse().expect("an address"), 8080);
        let acked = tap
            .acked(&cluster(i), fresh, CHANGE)
            .await
            .unwrap_or_else(|e| panic!("change {k}: {e}"));
        latencies.push(acked.duration_since(applied).as_secs_f64() * 1e3);
        tokio::time::sleep_until((applied + CHANGE_SPACING).into()).await;
    }
    latencies
}

/// Samples the agent's RSS every 200 ms until dropped; the largest seen.
struct Sampler {
    peak: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Sampler {
    fn start(pid: u32) -> Sampler {
        let peak = Arc::new(AtomicU64::new(0));
        let seen = peak.clone();
        let task = tokio::spawn(async move {
            loop {
                let kib = (rss_mib(pid) * 1024.0) as u64;
                seen.fetch_max(kib, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        Sampler { peak, task }
    }

    fn peak_mib(&self) -> f64 {
        self.peak.load(Ordering::Relaxed) as f64 / 1024.0
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The `n` slowest of `latencies` (in the order they were made) as `[index, ms]`: whether the
/// slow changes are those at the attack's start or spread over it.
fn slowest(latencies: &[f64], n: usize) -> Value {
    let mut indexed: Vec<(usize, f64)> = latencies.iter().copied().enumerate().collect();
    indexed.sort_by(|a, b| b.1.total_cmp(&a.1));
    json!(indexed.into_iter().take(n).collect::<Vec<_>>())
}

/// Where the two cores went over a phase: CPU seconds per second of it, for the agent, Envoy,
/// and this process (the ADS relay and the attackers).
struct CpuShare {
    pids: [u32; 3],
    start: [f64; 3],
    began: Instant,
}

impl CpuShare {
    fn start(agent: u32, envoy: u32) -> CpuShare {
        let pids = [agent, envoy, std::process::id()];
        CpuShare {
            pids,
            start: pids.map(|pid| procstat::cpu_seconds(pid).unwrap_or(f64::NAN)),
            began: Instant::now(),
        }
    }

    fn cores(&self) -> Value {
        let wall = self.began.elapsed().as_secs_f64();
        let used: Vec<f64> = self
            .pids
            .iter()
            .zip(self.start)
            .map(|(&pid, start)| (procstat::cpu_seconds(pid).unwrap_or(f64::NAN) - start) / wall)
            .collect();
        json!({"agent": used[0], "envoy": used[1], "relay_and_attackers": used[2], "seconds": wall})
    }
}

/// The agent's RSS once it stops falling (jemalloc gives freed pages back within about a
/// second): two samples a second apart within 1 %, or the last after 30 s.
async fn settled_rss(pid: u32) -> f64 {
    let mut last = rss_mib(pid);
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = rss_mib(pid);
        if (last - now).abs() <= last * 0.01 {
            return now;
        }
        last = now;
    }
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "scale run; prints figures: cargo xtask bench --only hostile"]
async fn xds_hostile_clients_beside_an_honest_envoy() {
    let services = env_or("LATTICE_BENCH_SERVICES", 10_000);
    let change_count = env_or("LATTICE_BENCH_CHANGES", 100);
    let names = env_or("LATTICE_BENCH_HOSTILE_NAMES", 10_000_000);
    let streams = env_or("LATTICE_BENCH_HOSTILE_STREAMS", 4000);
    let idle = env_or("LATTICE_BENCH_HOSTILE_IDLE", 100);
    let silent = env_or("LATTICE_BENCH_HOSTILE_SILENT", 400);
    let garbage = env_or("LATTICE_BENCH_HOSTILE_GARBAGE", 1000);
    let attacks: Vec<String> = std::env::var("LATTICE_BENCH_HOSTILE_ATTACKS")
        .unwrap_or_else(|_| "names,streams,idle,silent,garbage".to_string())
        .split(',')
        .map(|a| a.trim().to_string())
        .filter(|a| !a.is_empty())
        .collect();

    let mut ips: Vec<Vec<String>> = (0..services)
        .map(|i| {
            (0..PER_SERVICE)
                .map(|e| ip((i * PER_SERVICE + e) as u32))
                .collect()
        })
        .collect();
    let dir = tempfile::tempdir().expect("a directory");
    let path = dir.path().join("mesh.yaml");
    std::fs::write(&path, mesh_file(&ips)).expect("write the mesh file");
    let agent = Agent::start(&["--mesh-file", path.to_str().expect("a path")]);
    agent
        .wait_ready()
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
    let pid = agent.pid().expect("the agent runs");

    let mut tap = AdsTap::start(agent.xds, AdsMode::Delta)
        .await
        .expect("start the ADS relay");
    let envoy = Envoy::start_edited("hostile-envoy", tap.addr, AdsMode::Delta, |bootstrap| {
        if let Some(dynamic) = bootstrap["dynamic_resources"].as_object_mut() {
            dynamic.remove("lds_config");
        }
    });
    let full = |cluster: &str, endpoints: &[SocketAddr]| {
        cluster.contains(MESH_CLUSTER) && endpoints.len() == PER_SERVICE
    };
    tap.watch()
        .holds_all(services, full, SYNC)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}\n{}", agent.log(), envoy.log()));
    println!("hostile: Envoy holds {services} services");

    // The honest run's peak is sampled as the attack's is: each change has the agent read and
    // translate the whole mesh file again, which the settled figure after it does not show.
    let envoy_pid = envoy.pid().expect("Envoy runs");
    let sampler = Sampler::start(pid);
    let cpu = CpuShare::start(pid, envoy_pid);
    let quiet = changes(&mut tap, &path, &mut ips, change_count, 0).await;
    let cpu_quiet = cpu.cores();
    let rss_quiet_peak = sampler.peak_mib();
    drop(sampler);
    let rss_quiet = settled_rss(pid).await;
    println!("hostile: quiet run done, agent RSS {rss_quiet:.1} MiB");

    let sampler = Sampler::start(pid);
    let cpu = CpuShare::start(pid, envoy_pid);
    let xds = agent.xds;
    let tallies: BTreeMap<&str, Arc<Tally>> = ["names", "streams", "idle", "silent", "garbage"]
        .into_iter()
        .map(|a| (a, Arc::new(Tally::default())))
        .collect();
    // The attackers run on threads of their own, as other pods' processes would: on this
    // test's runtime they queued the relay that times the honest Envoy's changes behind their
    // own bursts.
    let nice = procstat::attackers_nice();
    let attack_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("attacker")
        .on_thread_start(move || procstat::lower_priority(nice))
        .enable_all()
        .build()
        .expect("the attackers' runtime");
    let mut attackers = Vec::new();
    for attack in &attacks {
        let tally = tallies
            .get(attack.as_str())
            .unwrap_or_else(|| panic!("no attack {attack:?}"))
            .clone();
        let runtime = &attack_runtime;
        attackers.push(match attack.as_str() {
            "names" => runtime.spawn(async move {
                let _ = names_attack(xds, names, tally).await;
            }),
            "streams" => runtime.spawn(streams_attack(xds, streams, tally)),
            "idle" => runtime.spawn(idle_attack(xds, idle, services, tally)),
            "silent" => runtime.spawn(silent_attack(xds, silent, tally)),
            _ => runtime.spawn(garbage_attack(xds, garbage, tally)),
        });
    }
    let attacked = changes(&mut tap, &path, &mut ips, change_count, change_count).await;
    let cpu_attacked = cpu.cores();
    let under_attack = xds_counters(&agent);
    let rss_attack_peak = sampler.peak_mib();
    drop(sampler);
    for attacker in &attackers {
        attacker.abort();
    }
    for attacker in attackers {
        let _ = attacker.await;
    }
    attack_runtime.shutdown_background();
    // The attackers' streams end on the agent's side once their connections close: only the
    // honest Envoy's is left.
    let deadline = Instant::now() + CHANGE;
    while metric(&agent, "lattice_xds_connected_proxies") > 1.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rss_after = settled_rss(pid).await;
    let after = xds_counters(&agent);

    let p99 = |v: &[f64]| summary(v)["p99"].as_f64();
    let report = json!({
        "services": services,
        "endpoints": services * PER_SERVICE,
        "changes": change_count,
        "attacks": attacks,
        "attackers_nice": nice,
        "sizes": {"names": names, "streams": streams, "idle": idle, "silent": silent, "garbage": garbage},
        "agent_rss_mib": {
            "quiet": rss_quiet,
            "quiet_peak": rss_quiet_peak,
            "attack_peak": rss_attack_peak,
            "after": rss_after,
            "growth_under_attack": rss_attack_peak - rss_quiet,
            "growth_over_quiet_peak": rss_attack_peak - rss_quiet_peak,
            "after_vs_quiet": rss_after / rss_quiet,
        },
        "envoy_change_ms": {
            "quiet": summary(&quiet),
            "under_attack": summary(&attacked),
            "slowest_under_attack": slowest(&attacked, 3),
            "p99_ratio": p99(&attacked).zip(p99(&quiet)).map(|(a, q)| a / q),
        },
        "cpu_cores": {"quiet": cpu_quiet, "under_attack": cpu_attacked},
        "attackers": tallies.iter().map(|(name, tally)| (name.to_string(), tally.report())).collect::<serde_json::Map<_, _>>(),
        "agent_under_attack": under_attack,
        "agent_after": after,
        "envoy_admin_ok": http_get(envoy.admin, "/ready").map(|(status, _)| status == 200).unwrap_or(false),
    });
    println!("BENCH_HOSTILE_XDS_JSON {report}");
}
