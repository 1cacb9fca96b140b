//! xDS propagation and cost at scale (figures printed, never asserted): the real agent, fed a
//! generated mesh through the fake API server, serving synthetic ADS clients (half SotW, half
//! Delta). Measures the initial sync, the latency of single-endpoint changes until every
//! client has them, the bytes each change costs a client, and the agent's RSS and CPU; once at
//! a small baseline mesh and once at the full size, so the cost of one change can be compared.
//!
//! Ignored by default; `cargo xtask bench --only xds` runs it with a release agent. Sizes from
//! `LATTICE_BENCH_SERVICES` (10000), `LATTICE_BENCH_BASELINE_SERVICES` (100),
//! `LATTICE_BENCH_CLIENTS` (100), `LATTICE_BENCH_CHANGES` (1000), `LATTICE_BENCH_SOTW_PERCENT`
//! (50: the share of clients on SotW, the rest on Delta).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use lattice_e2e::ads_client::AdsClient;
use lattice_e2e::agent::Agent;
use lattice_e2e::envoy::AdsMode;
use lattice_e2e::fake_apiserver::FakeApiServer;
use lattice_e2e::k8s_objects::{generated, generated_slice, ip, populate};
use serde_json::{Value, json};

const PER_SERVICE: usize = 10;
const SYNC: Duration = Duration::from_secs(600);
const CHANGE: Duration = Duration::from_secs(60);
/// USER_HZ: the unit of utime and stime in /proc/<pid>/stat, 100 on Linux.
const TICKS_PER_SECOND: f64 = 100.0;

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

fn rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

/// utime + stime of a process, in seconds.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start at field 3 (state).
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / TICKS_PER_SECOND)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// `None` for no values (a run without SotW or without Delta clients).
fn mean(values: &[f64]) -> Option<f64> {
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

async fn connect(agent: &Agent, k: usize, mode: AdsMode) -> AdsClient {
    let deadline = Instant::now() + SYNC;
    loop {
        match AdsClient::connect(agent.xds, &format!("bench-{k}"), mode).await {
            Ok(client) => return client,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!("xDS not up yet: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("cannot connect to the agent's xDS: {e}\n{}", agent.log()),
        }
    }
}

/// One run: a mesh of `services`, `clients` clients, `changes` single-endpoint changes.
async fn run(services: usize, clients: usize, sotw: usize, changes: usize) -> Value {
    let server = FakeApiServer::start().unwrap();
    let populated = Instant::now();
    populate(&server, services, PER_SERVICE).unwrap();
    println!("{services} services populated in {:?}", populated.elapsed());
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig).unwrap();

    let start = Instant::now();
    let agent = Agent::start_with_env(&[], &[("KUBECONFIG", kubeconfig.to_str().unwrap())]);
    let pid = agent.pid().expect("the agent runs");
    // SotW and Delta clients interleaved, `sotw` of them SotW.
    let modes: Vec<AdsMode> = (0..clients)
        .map(|k| {
            if (k + 1) * sotw / clients.max(1) > k * sotw / clients.max(1) {
                AdsMode::Sotw
            } else {
                AdsMode::Delta
            }
        })
        .collect();
    let mut fleet = Vec::new();
    for (k, mode) in modes.iter().enumerate() {
        fleet.push(connect(&agent, k, *mode).await);
    }
    for client in &mut fleet {
        client
            .wait_for("every cluster's endpoints", SYNC, |v| {
                v.clusters.len() == services
                    && v.endpoints.len() == services
                    && v.endpoints.values().all(|(e, _)| e.len() == PER_SERVICE)
            })
            .await
            .unwrap_or_else(|e| panic!("{e}\nagent log:\n{}", agent.log()));
    }
    // When the last assignment reached the last client, not when this loop noticed it.
    let synced_at = fleet
        .iter()
        .filter_map(|c| c.with_view(|v| v.endpoints.values().map(|(_, at)| *at).max()))
        .max()
        .unwrap_or(start);
    let initial_sync = synced_at.duration_since(start);
    let rss_synced = rss_mib(pid);
    let cpu_synced = cpu_seconds(pid);
    println!("{clients} clients synced in {initial_sync:?}");

    let mut current: HashMap<usize, Vec<String>> = HashMap::new();
    let mut latencies_ms = Vec::with_capacity(changes);
    let mut bytes_sotw = Vec::new();
    let mut bytes_delta = Vec::new();
    let cpu_before_changes = cpu_seconds(pid);
    for k in 0..changes {
        // Spread over the mesh; one endpoint of the service replaced by a fresh address.
        let i = (k * 7919) % services;
        let ips = current.entry(i).or_insert_with(|| {
            (0..PER_SERVICE)
                .map(|e| ip((i * PER_SERVICE + e) as u32))
                .collect()
        });
        let fresh = ip(50_000_000 + k as u32);
        ips[k % PER_SERVICE] = fresh.clone();
        let fresh: SocketAddr = SocketAddr::new(fresh.parse().unwrap(), 8080);
        let name = cluster(i);
        let bytes_before: Vec<u64> = fleet.iter().map(|c| c.with_view(|v| v.bytes)).collect();
        let applied = Instant::now();
        server.apply_json(generated_slice(i, ips)).unwrap();
        for client in &mut fleet {
            client
                .wait_for(&format!("change {k} at {name}"), CHANGE, |v| {
                    v.endpoints_of(&name).is_some_and(|e| e.contains(&fresh))
                })
                .await
                .unwrap_or_else(|e| panic!("{e}\nagent log:\n{}", agent.log()));
        }
        let arrived = fleet
            .iter()
            .filter_map(|c| c.with_view(|v| v.endpoints.get(&name).map(|(_, at)| *at)))
            .max()
            .unwrap_or(applied);
        latencies_ms.push(arrived.duration_since(applied).as_secs_f64() * 1e3);
        for ((client, before), mode) in fleet.iter().zip(&bytes_before).zip(&modes) {
            let sent = (client.with_view(|v| v.bytes) - before) as f64;
            match mode {
                AdsMode::Sotw => bytes_sotw.push(sent),
                AdsMode::Delta => bytes_delta.push(sent),
            }
        }
    }
    let cpu_after = cpu_seconds(pid);
    let rss_after = rss_mib(pid);
    let mut sorted = latencies_ms.clone();
    sorted.sort_by(f64::total_cmp);
    let cpu_per_change_ms = match (cpu_before_changes, cpu_after) {
        (Some(a), Some(b)) if changes > 0 => Some((b - a) / changes as f64 * 1e3),
        _ => None,
    };
    let nacks: u64 = fleet.iter().map(|c| c.with_view(|v| v.nacks)).sum();
    json!({
        "services": services,
        "endpoints": services * PER_SERVICE,
        "clients": clients,
        "clients_sotw": modes.iter().filter(|m| matches!(m, AdsMode::Sotw)).count(),
        "clients_delta": modes.iter().filter(|m| matches!(m, AdsMode::Delta)).count(),
        "changes": changes,
        "initial_sync_ms": initial_sync.as_secs_f64() * 1e3,
        "change_to_all_clients_ms": {
            "p50": percentile(&sorted, 50.0),
            "p99": percentile(&sorted, 99.0),
            "max": sorted.last().copied(),
            "mean": mean(&sorted),
        },
        "bytes_per_change_per_client": {
            "sotw_mean": mean(&bytes_sotw),
            "delta_mean": mean(&bytes_delta),
            "delta_max": bytes_delta.iter().copied().reduce(f64::max),
        },
        "agent_rss_mib": {"synced": rss_synced, "after_changes": rss_after},
        "agent_cpu_s": {"to_sync": cpu_synced, "after_changes": cpu_after},
        "agent_cpu_ms_per_change": cpu_per_change_ms,
        "client_nacks": nacks,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "scale run; prints figures: cargo xtask bench --only xds"]
async fn xds_propagation_and_cost_at_scale() {
    let services = env_or("LATTICE_BENCH_SERVICES", 10_000);
    let baseline = env_or("LATTICE_BENCH_BASELINE_SERVICES", 100);
    let clients = env_or("LATTICE_BENCH_CLIENTS", 100);
    let changes = env_or("LATTICE_BENCH_CHANGES", 1000);
    let sotw = clients * env_or("LATTICE_BENCH_SOTW_PERCENT", 50).min(100) / 100;
    let small = run(baseline, clients, sotw, changes).await;
    println!("baseline: {small}");
    let large = run(services, clients, sotw, changes).await;
    println!("full: {large}");
    let ratio = |path: &[&str]| -> Option<f64> {
        let get = |v: &Value| path.iter().fold(v, |v, k| &v[*k]).as_f64();
        Some(get(&large)? / get(&small)?)
    };
    let report = json!({
        "baseline": small,
        "full": large,
        "cost_ratio_full_vs_baseline": {
            "latency_p50": ratio(&["change_to_all_clients_ms", "p50"]),
            "latency_p99": ratio(&["change_to_all_clients_ms", "p99"]),
            "agent_cpu_per_change": ratio(&["agent_cpu_ms_per_change"]),
            "delta_bytes_per_change": ratio(&["bytes_per_change_per_client", "delta_mean"]),
        },
    });
    println!("BENCH_XDS_JSON {report}");
}
