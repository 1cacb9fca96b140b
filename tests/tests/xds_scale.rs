//! xDS propagation and cost at scale (figures printed, never asserted): the real agent serving
//! a generated mesh (N services × 10 endpoints) to synthetic ADS clients (half SotW, half
//! Delta) and to one real Envoy. The mesh reaches the agent through each of its sources in
//! turn:
//!
//! - `kube`: the Kubernetes source, fed by the fake API server; a change is one EndpointSlice
//!   applied, and its clock starts just before the apply;
//! - `file`: the mesh file (`--mesh-file`); a change is an edit of the file, written whole to a
//!   temporary file next to it and renamed into place (as editors and ConfigMaps do, so the
//!   agent never reads half a file), and its clock starts just before the rename.
//!
//! Measures the initial sync, the latency of single-endpoint changes until every client and
//! Envoy hold the new endpoint, the bytes each change costs a client, and the agent's RSS and
//! CPU (and Envoy's RSS); once at a small baseline mesh and once at the full size, so the cost
//! of one change can be compared. Last, the agent is killed (SIGKILL) and started again, and
//! every synthetic client reconnects with what it holds (Delta: `initial_resource_versions`;
//! SotW: its versions and its EDS subscription): `restart.consistent_ms` is kill → every client
//! answered and holding the whole mesh (`restart.agent_ready_ms`: kill → the new agent's
//! `/readyz`, its own start), `restart.bytes_per_delta_client` (and
//! `_sotw_`) what a client received again although nothing had changed.
//!
//! Envoy is watched through its admin API, with queries that stay cheap at 10k clusters: for
//! the initial sync, `/ready` and then the `membership_total` gauges (`usedonly`, gauges only)
//! until every mesh cluster holds all its endpoints; for a change, `/clusters` filtered to the
//! changed cluster, polled every millisecond until it lists the new endpoint. Its times are
//! when the answer that showed the change arrived, so they include up to one poll; the report
//! gives the poll's duration. Envoy gets the bootstrap `lattice-init` writes without LDS: the
//! agent's capture listener binds 0.0.0.0:15001, and the benchmark stays on loopback; clusters
//! and endpoints are what it measures.
//!
//! Changes are at least 25 ms apart, so each is a lone change for the agent's push rate limit
//! (`--debounce-ms`, 10 ms).
//!
//! Ignored by default; `cargo xtask bench --only xds` runs it with a release agent. Sizes from
//! `LATTICE_BENCH_SERVICES` (10000), `LATTICE_BENCH_BASELINE_SERVICES` (100),
//! `LATTICE_BENCH_CLIENTS` (100), `LATTICE_BENCH_CHANGES` (1000), `LATTICE_BENCH_SOTW_PERCENT`
//! (50: the share of clients on SotW, the rest on Delta); `LATTICE_BENCH_SOURCES` (`kube,file`)
//! chooses the sources, `LATTICE_BENCH_ENVOY` (`delta`) Envoy's ADS flavour: `delta`, `sotw`,
//! or `none` for no Envoy.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use lattice_e2e::ads_client::{AdsClient, ClientView, EDS};
use lattice_e2e::agent::{Agent, http_get};
use lattice_e2e::envoy::{AdsMode, Envoy};
use lattice_e2e::fake_apiserver::FakeApiServer;
use lattice_e2e::k8s_objects::{generated, generated_slice, ip, populate};
use serde_json::{Value, json};

const PER_SERVICE: usize = 10;
const SYNC: Duration = Duration::from_secs(600);
const CHANGE: Duration = Duration::from_secs(60);
/// The least time between two changes. The agent pushes at most once per `--debounce-ms`
/// (10 ms by default) and coalesces what comes faster; changes further apart than that are
/// each a lone change, whose latency is what the figures are about. Back to back, every
/// change would wait out the previous push's period instead.
const CHANGE_SPACING: Duration = Duration::from_millis(25);
/// How often Envoy's admin is asked whether it holds a change.
const ENVOY_POLL: Duration = Duration::from_millis(1);
/// USER_HZ: the unit of utime and stime in /proc/<pid>/stat, 100 on Linux.
const TICKS_PER_SECOND: f64 = 100.0;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Where the agent reads the mesh from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    Kube,
    File,
}

/// `LATTICE_BENCH_SOURCES`: a comma-separated list of `kube` and `file`, run in that order.
fn sources() -> Vec<Source> {
    let list = std::env::var("LATTICE_BENCH_SOURCES").unwrap_or_else(|_| "kube,file".into());
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| match s {
            "kube" => Source::Kube,
            "file" => Source::File,
            other => panic!("LATTICE_BENCH_SOURCES: unknown source {other:?} (kube, file)"),
        })
        .collect()
}

/// `LATTICE_BENCH_ENVOY`: the real Envoy's ADS flavour, or `none` for no Envoy.
fn envoy_mode() -> Option<AdsMode> {
    match std::env::var("LATTICE_BENCH_ENVOY").as_deref() {
        Err(_) | Ok("delta") => Some(AdsMode::Delta),
        Ok("sotw") => Some(AdsMode::Sotw),
        Ok("none") => None,
        Ok(other) => panic!("LATTICE_BENCH_ENVOY: unknown {other:?} (delta, sotw, none)"),
    }
}

fn cluster(i: usize) -> String {
    let (namespace, name) = generated(i);
    format!("{name}.{namespace}.system.internal|80")
}

/// The generated mesh, and the source that hands it to the agent.
struct Feed {
    /// Every service's endpoint addresses as the source last said; service `i` starts with
    /// `ip(i * PER_SERVICE) ..`, as [`populate`] makes them.
    ips: Vec<Vec<String>>,
    sink: Sink,
    /// Holds the kubeconfig or the mesh file.
    dir: tempfile::TempDir,
}

enum Sink {
    Kube(FakeApiServer),
    /// The mesh file.
    File(PathBuf),
}

impl Feed {
    /// The whole mesh of `services`, in place where `source` reads it.
    fn new(source: Source, services: usize) -> Feed {
        let ips: Vec<Vec<String>> = (0..services)
            .map(|i| {
                (0..PER_SERVICE)
                    .map(|e| ip((i * PER_SERVICE + e) as u32))
                    .collect()
            })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let written = Instant::now();
        let sink = match source {
            Source::Kube => {
                let server = FakeApiServer::start().unwrap();
                populate(&server, services, PER_SERVICE).unwrap();
                server
                    .write_kubeconfig(&dir.path().join("kubeconfig"))
                    .unwrap();
                Sink::Kube(server)
            }
            Source::File => {
                let path = dir.path().join("mesh.yaml");
                std::fs::write(&path, mesh_file(&ips)).unwrap();
                Sink::File(path)
            }
        };
        println!(
            "{source:?}: {services} services written in {:?}",
            written.elapsed()
        );
        Feed { ips, sink, dir }
    }

    fn start_agent(&self) -> Agent {
        match &self.sink {
            Sink::Kube(_) => {
                let kubeconfig = self.dir.path().join("kubeconfig");
                Agent::start_with_env(&[], &[("KUBECONFIG", kubeconfig.to_str().unwrap())])
            }
            Sink::File(path) => Agent::start(&["--mesh-file", path.to_str().unwrap()]),
        }
    }

    /// Replaces endpoint `slot` of service `i` by `fresh` at the source; returns when the
    /// change was made: just before the apply, or just before the rename that puts the edited
    /// file in place (writing the temporary file is the editor's time, not the agent's).
    fn change(&mut self, i: usize, slot: usize, fresh: String) -> Instant {
        self.ips[i][slot] = fresh;
        match &self.sink {
            Sink::Kube(server) => {
                let at = Instant::now();
                server.apply_json(generated_slice(i, &self.ips[i])).unwrap();
                at
            }
            Sink::File(path) => {
                // Not a name the agent's watcher takes for the file (nor a `..` ConfigMap one).
                let tmp = path.with_extension("yaml.tmp");
                std::fs::write(&tmp, mesh_file(&self.ips)).unwrap();
                let at = Instant::now();
                std::fs::rename(&tmp, path).unwrap();
                at
            }
        }
    }
}

/// The generated mesh as a mesh file: the services [`populate`] makes (`/<namespace>/<name>`,
/// HTTP on 80, endpoints on 8080), so both sources give the agent the same clusters.
fn mesh_file(ips: &[Vec<String>]) -> String {
    use std::fmt::Write;
    let mut text = String::with_capacity(64 + ips.len() * (140 + PER_SERVICE * 30));
    text.push_str("services:\n");
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

/// The fields of /proc/<pid>/stat after the command name (which may hold spaces): field 3
/// (state) first.
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(
        stat.rsplit_once(')')?
            .1
            .split_whitespace()
            .map(str::to_string)
            .collect(),
    )
}

/// utime + stime of a process, in seconds.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let fields = stat_fields(pid)?;
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / TICKS_PER_SECOND)
}

/// Whether a child process runs (it stays a zombie until waited for).
fn running(pid: u32) -> bool {
    stat_fields(pid).is_some_and(|f| f.first().is_some_and(|state| state != "Z"))
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

/// p50, p99, max and mean of some milliseconds.
fn summary(values: &[f64]) -> Value {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    json!({
        "p50": percentile(&sorted, 50.0),
        "p99": percentile(&sorted, 99.0),
        "max": sorted.last().copied(),
        "mean": mean(&sorted),
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
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

/// The run's real Envoy, on the bootstrap `lattice-init` writes minus LDS (see the top).
fn start_envoy(xds: SocketAddr, mode: AdsMode) -> Envoy {
    Envoy::start_edited("bench-envoy", xds, mode, |bootstrap| {
        if let Some(dynamic) = bootstrap["dynamic_resources"].as_object_mut() {
            dynamic.remove("lds_config");
        }
    })
}

/// A query-string value, percent-encoded.
fn query_value(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// An RE2 pattern matching exactly `name`.
fn exactly(name: &str) -> String {
    let escaped: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_string()
            } else {
                format!("\\{c}")
            }
        })
        .collect();
    format!("^{escaped}$")
}

/// A GET on Envoy's admin that must answer 200; says whether Envoy still runs if not.
fn envoy_get(admin: SocketAddr, pid: u32, path: &str) -> Result<String, String> {
    match http_get(admin, path) {
        Ok((200, body)) => Ok(body),
        Ok((status, body)) => Err(format!("{path}: {status} {body:.300}")),
        Err(e) if running(pid) => Err(format!("{path}: {e}")),
        Err(e) => Err(format!("Envoy exited ({path}: {e})")),
    }
}

/// Polls Envoy until it is LIVE and each of the `services` mesh clusters holds all its
/// endpoints; when the answer that showed it arrived.
fn envoy_synced(admin: SocketAddr, pid: u32, services: usize) -> anyhow::Result<Instant> {
    let gauges = format!(
        "/stats?usedonly&type=Gauges&filter={}",
        query_value(r"\.membership_total$")
    );
    let full = format!(".membership_total: {PER_SERVICE}");
    lattice_e2e::wait::until("Envoy to hold every cluster's endpoints", SYNC, || {
        envoy_get(admin, pid, "/ready")?;
        let body = envoy_get(admin, pid, &gauges)?;
        let held = body
            .lines()
            .filter(|l| l.contains(".system.internal|") && l.ends_with(&full))
            .count();
        if held == services {
            Ok(Instant::now())
        } else {
            Err(format!(
                "{held} of {services} clusters with {PER_SERVICE} endpoints"
            ))
        }
    })
}

/// Polls Envoy's `/clusters`, filtered to `cluster`, every [`ENVOY_POLL`] until it lists
/// `endpoint`; when the answer that showed it arrived, and how long each poll took.
fn envoy_holds(
    admin: SocketAddr,
    pid: u32,
    cluster: &str,
    endpoint: SocketAddr,
) -> Result<(Instant, Vec<Duration>), String> {
    let path = format!("/clusters?filter={}", query_value(&exactly(cluster)));
    let host = format!("{cluster}::{endpoint}::");
    let deadline = Instant::now() + CHANGE;
    let mut polls = Vec::new();
    loop {
        let asked = Instant::now();
        let answer = envoy_get(admin, pid, &path);
        polls.push(asked.elapsed());
        let last = match answer {
            Ok(body) if body.lines().any(|l| l.starts_with(&host)) => {
                return Ok((Instant::now(), polls));
            }
            Ok(body) => format!("{body:.600}"),
            Err(e) => e,
        };
        if Instant::now() >= deadline {
            return Err(format!(
                "Envoy did not list {endpoint} in {cluster} within {CHANGE:?}; last seen: {last}"
            ));
        }
        std::thread::sleep(ENVOY_POLL);
    }
}

/// What a run measures of its Envoy.
#[derive(Default)]
struct EnvoyFigures {
    change_ms: Vec<f64>,
    poll_ms: Vec<f64>,
}

/// One run: a mesh of `services` through `source`, `clients` clients, `changes`
/// single-endpoint changes, and Envoy unless `envoy_mode` is `None`.
async fn run(
    source: Source,
    services: usize,
    clients: usize,
    sotw: usize,
    changes: usize,
    envoy_mode: Option<AdsMode>,
) -> Value {
    let mut feed = Feed::new(source, services);

    let start = Instant::now();
    let mut agent = feed.start_agent();
    let pid = agent.pid().expect("the agent runs");
    // SotW and Delta clients interleaved, `sotw` of them SotW.
    let modes: Vec<AdsMode> = (0..clients)
        .map(|k| {
            if (k + 1) * sotw / clients > k * sotw / clients {
                AdsMode::Sotw
            } else {
                AdsMode::Delta
            }
        })
        .collect();
    let mut fleet = Vec::new();
    let mut envoy = None;
    for (k, mode) in modes.iter().enumerate() {
        fleet.push(connect(&agent, k, *mode).await);
        if k == 0 {
            // Once the first client is in, the agent's xDS answers: Envoy starts now, so its
            // sync is not stretched by its reconnect back-off.
            envoy = envoy_mode.map(|mode| start_envoy(agent.xds, mode));
        }
    }
    let envoy_pid = envoy.as_ref().map(|e| e.pid().expect("Envoy runs"));
    let envoy_sync = envoy.as_ref().zip(envoy_pid).map(|(envoy, envoy_pid)| {
        let admin = envoy.admin;
        tokio::task::spawn_blocking(move || envoy_synced(admin, envoy_pid, services))
    });
    for client in &mut fleet {
        client
            .wait_for("every cluster's endpoints", SYNC, |v| {
                holds_everything(v, services)
            })
            .await
            .unwrap_or_else(|e| panic!("{e}\nagent log:\n{}", agent.log()));
    }
    // When the last assignment reached the last client, not when this loop noticed it.
    let clients_synced_at = fleet
        .iter()
        .filter_map(|c| c.with_view(|v| v.endpoints.values().map(|(_, at)| *at).max()))
        .max()
        .unwrap_or(start);
    let envoy_synced_at = match envoy_sync {
        Some(wait) => Some(
            wait.await
                .expect("the Envoy sync poll")
                .unwrap_or_else(|e| panic!("{e}\nagent log:\n{}", agent.log())),
        ),
        None => None,
    };
    let synced_at = clients_synced_at.max(envoy_synced_at.unwrap_or(start));
    let rss_synced = rss_mib(pid);
    let cpu_synced = cpu_seconds(pid);
    let envoy_rss_synced = envoy_pid.and_then(rss_mib);
    println!(
        "{source:?}: {clients} clients synced in {:?}, Envoy in {:?}",
        clients_synced_at.duration_since(start),
        envoy_synced_at.map(|at| at.duration_since(start))
    );

    let mut latencies_ms = Vec::with_capacity(changes);
    let mut client_latencies_ms = Vec::with_capacity(changes);
    let mut envoy_figures = EnvoyFigures::default();
    let mut bytes_sotw = Vec::new();
    let mut bytes_delta = Vec::new();
    let cpu_before_changes = cpu_seconds(pid);
    let mut last_change: Option<Instant> = None;
    for k in 0..changes {
        if let Some(at) = last_change {
            tokio::time::sleep_until((at + CHANGE_SPACING).into()).await;
        }
        // Spread over the mesh; one endpoint of the service replaced by a fresh address.
        let i = (k * 7919) % services;
        let fresh_ip = ip(50_000_000 + k as u32);
        let fresh = SocketAddr::new(fresh_ip.parse().unwrap(), 8080);
        let name = cluster(i);
        let bytes_before: Vec<u64> = fleet.iter().map(|c| c.with_view(|v| v.bytes)).collect();
        let applied = feed.change(i, k % PER_SERVICE, fresh_ip);
        last_change = Some(applied);
        let envoy_wait = envoy.as_ref().zip(envoy_pid).map(|(envoy, envoy_pid)| {
            let (admin, name) = (envoy.admin, name.clone());
            tokio::task::spawn_blocking(move || envoy_holds(admin, envoy_pid, &name, fresh))
        });
        for client in &mut fleet {
            client
                .wait_for(&format!("change {k} at {name}"), CHANGE, |v| {
                    v.endpoints_of(&name).is_some_and(|e| e.contains(&fresh))
                })
                .await
                .unwrap_or_else(|e| panic!("{e}\nagent log:\n{}", agent.log()));
        }
        let mut arrived = fleet
            .iter()
            .filter_map(|c| c.with_view(|v| v.endpoints.get(&name).map(|(_, at)| *at)))
            .max()
            .unwrap_or(applied);
        client_latencies_ms.push(ms(arrived.duration_since(applied)));
        if let Some(wait) = envoy_wait {
            let (at, polls) = wait
                .await
                .expect("the Envoy poll")
                .unwrap_or_else(|e| panic!("change {k}: {e}\nagent log:\n{}", agent.log()));
            envoy_figures.change_ms.push(ms(at.duration_since(applied)));
            envoy_figures.poll_ms.extend(polls.into_iter().map(ms));
            arrived = arrived.max(at);
        }
        latencies_ms.push(ms(arrived.duration_since(applied)));
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
    let cpu_per_change_ms = match (cpu_before_changes, cpu_after) {
        (Some(a), Some(b)) if changes > 0 => Some((b - a) / changes as f64 * 1e3),
        _ => None,
    };
    let restart = restart(&mut agent, &mut fleet, &modes, services).await;
    let nacks: u64 = fleet.iter().map(|c| c.with_view(|v| v.nacks)).sum();
    let envoy_report = envoy_mode.map(|mode| {
        json!({
            "mode": format!("{mode:?}").to_lowercase(),
            "initial_sync_ms": envoy_synced_at.map(|at| ms(at.duration_since(start))),
            "change_ms": summary(&envoy_figures.change_ms),
            "admin_poll_ms": summary(&envoy_figures.poll_ms),
            "rss_mib": {
                "synced": envoy_rss_synced,
                "after_changes": envoy_pid.and_then(rss_mib),
            },
        })
    });
    json!({
        "source": format!("{source:?}").to_lowercase(),
        "services": services,
        "endpoints": services * PER_SERVICE,
        "clients": clients,
        "clients_sotw": modes.iter().filter(|m| matches!(m, AdsMode::Sotw)).count(),
        "clients_delta": modes.iter().filter(|m| matches!(m, AdsMode::Delta)).count(),
        "changes": changes,
        "initial_sync_ms": ms(synced_at.duration_since(start)),
        "initial_sync_synthetic_clients_ms": ms(clients_synced_at.duration_since(start)),
        "change_to_all_clients_ms": summary(&latencies_ms),
        "change_to_synthetic_clients_ms": summary(&client_latencies_ms),
        "bytes_per_change_per_client": {
            "sotw_mean": mean(&bytes_sotw),
            "delta_mean": mean(&bytes_delta),
            "delta_max": bytes_delta.iter().copied().reduce(f64::max),
        },
        "agent_rss_mib": {"synced": rss_synced, "after_changes": rss_after},
        "agent_cpu_s": {"to_sync": cpu_synced, "after_changes": cpu_after},
        "agent_cpu_ms_per_change": cpu_per_change_ms,
        "client_nacks": nacks,
        "restart": restart,
        "envoy": envoy_report,
    })
}

/// Whether a client holds the whole generated mesh of `services`.
fn holds_everything(v: &ClientView, services: usize) -> bool {
    v.clusters.len() == services
        && v.endpoints.len() == services
        && v.endpoints.values().all(|(e, _)| e.len() == PER_SERVICE)
}

/// An agent upgrade on a busy node: kill -9 the agent, start it again on the same addresses,
/// and every client reconnects (retrying until the new agent listens) saying what it holds.
/// A client is consistent again once its new stream has answered its endpoint request, the
/// last it sends on connecting (the agent takes a stream's requests in order, so whatever it
/// had to say about clusters and listeners came before; up to date, a SotW client is sent
/// no clusters or listeners at all), and it still holds the whole mesh. Nothing changed
/// meanwhile, so everything a client receives is re-sent.
async fn restart(
    agent: &mut Agent,
    fleet: &mut [AdsClient],
    modes: &[AdsMode],
    services: usize,
) -> Value {
    let bytes_before: Vec<u64> = fleet.iter().map(|c| c.with_view(|v| v.bytes)).collect();
    let killed = Instant::now();
    agent.restart();
    let deadline = killed + SYNC;
    // When the new agent is ready (its first snapshot translated): the part of the figure
    // that is the agent's own start, before any stream is served.
    let admin = agent.admin;
    let ready = tokio::task::spawn_blocking(move || {
        loop {
            if matches!(http_get(admin, "/readyz"), Ok((200, _))) || Instant::now() > deadline {
                return Instant::now();
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    for client in fleet.iter_mut() {
        while let Err(e) = client.reconnect().await {
            assert!(
                Instant::now() < deadline,
                "cannot reconnect to the restarted agent: {e}\n{}",
                agent.log()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    for client in fleet.iter_mut() {
        client
            .wait_for("consistency after the restart", SYNC, |v| {
                v.answered.contains_key(EDS) && holds_everything(v, services)
            })
            .await
            .unwrap_or_else(|e| panic!("{e}\nagent log:\n{}", agent.log()));
    }
    let consistent_at = fleet
        .iter()
        .filter_map(|c| c.with_view(|v| v.answered.values().max().copied()))
        .max()
        .unwrap_or(killed);
    let ready = ready.await.expect("the readiness poll");
    let (mut sotw, mut delta) = (Vec::new(), Vec::new());
    for ((client, before), mode) in fleet.iter().zip(&bytes_before).zip(modes) {
        let sent = (client.with_view(|v| v.bytes) - before) as f64;
        match mode {
            AdsMode::Sotw => sotw.push(sent),
            AdsMode::Delta => delta.push(sent),
        }
    }
    println!(
        "restart: every client consistent {:?} after kill -9",
        consistent_at.duration_since(killed)
    );
    json!({
        "consistent_ms": ms(consistent_at.duration_since(killed)),
        "agent_ready_ms": ms(ready.duration_since(killed)),
        "bytes_per_delta_client": mean(&delta),
        "bytes_per_delta_client_max": delta.iter().copied().reduce(f64::max),
        "bytes_per_sotw_client": mean(&sotw),
    })
}

/// The baseline and full runs of one source, and how the cost of a change compares.
fn section(small: Value, large: Value) -> Value {
    let ratio = |path: &[&str]| -> Option<f64> {
        let get = |v: &Value| path.iter().fold(v, |v, k| &v[*k]).as_f64();
        Some(get(&large)? / get(&small)?)
    };
    let ratios = json!({
        "latency_p50": ratio(&["change_to_all_clients_ms", "p50"]),
        "latency_p99": ratio(&["change_to_all_clients_ms", "p99"]),
        "agent_cpu_per_change": ratio(&["agent_cpu_ms_per_change"]),
        "delta_bytes_per_change": ratio(&["bytes_per_change_per_client", "delta_mean"]),
    });
    json!({"baseline": small, "full": large, "cost_ratio_full_vs_baseline": ratios})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "scale run; prints figures: cargo xtask bench --only xds"]
async fn xds_propagation_and_cost_at_scale() {
    let services = env_or("LATTICE_BENCH_SERVICES", 10_000);
    let baseline = env_or("LATTICE_BENCH_BASELINE_SERVICES", 100);
    let clients = env_or("LATTICE_BENCH_CLIENTS", 100).max(1);
    let changes = env_or("LATTICE_BENCH_CHANGES", 1000);
    let sotw = clients * env_or("LATTICE_BENCH_SOTW_PERCENT", 50).min(100) / 100;
    let envoy = envoy_mode();
    let sources = sources();
    let mut report = serde_json::Map::new();
    for &source in &sources {
        let small = run(source, baseline, clients, sotw, changes, envoy).await;
        println!("{source:?} baseline: {small}");
        let large = run(source, services, clients, sotw, changes, envoy).await;
        println!("{source:?} full: {large}");
        let section = section(small, large);
        match source {
            // The Kubernetes source's figures stay at the top, where they have always been.
            Source::Kube => report.extend(section.as_object().cloned().unwrap_or_default()),
            Source::File => {
                report.insert("mesh_file".into(), section);
            }
        }
    }
    if envoy.is_some() {
        let version = std::process::Command::new(lattice_e2e::envoy::binary())
            .arg("--version")
            .output()
            .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
            .unwrap_or_default();
        report.insert("envoy_version".into(), version.into());
    }
    report.insert(
        "sources".into(),
        sources
            .iter()
            .map(|s| format!("{s:?}").to_lowercase())
            .collect(),
    );
    println!("BENCH_XDS_JSON {}", Value::Object(report));
}
