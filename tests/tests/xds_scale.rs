//! xDS propagation and cost at scale (figures printed, never asserted): the real agent serving
//! a generated mesh (N services × 10 endpoints) to synthetic ADS clients (half SotW, half
//! Delta) and to one real Envoy. The mesh reaches the agent through each of its sources in
//! turn:
//!
//! - `kube`: the Kubernetes source, fed by the fake API server; a change is one EndpointSlice
//!   applied, and its clock starts just before the apply;
//! - `file`: mesh files (`--mesh-file`, one per 10k services); a change is an edit of the file
//!   that holds the service, written whole to a temporary file next to it and renamed into
//!   place (as editors and ConfigMaps do, so the agent never reads half a file), and its clock
//!   starts just before the rename.
//!
//! Measures the initial sync, the latency of single-endpoint changes until every client and
//! Envoy hold the new endpoint, the bytes each change costs a client, and the agent's RSS and
//! CPU (and Envoy's RSS); once at a small baseline mesh and once at the full size, so the cost
//! of one change can be compared. Last, once the node's last mesh (and, with mesh files, each
//! file's copy) is on disk (written after the changes: `restart.last_mesh_wait_ms`), the agent
//! is killed (SIGKILL) and started again, and
//! every synthetic client reconnects with what it holds (Delta: `initial_resource_versions`;
//! SotW: its versions and its EDS subscription): `restart.consistent_ms` is kill → every client
//! answered and holding the whole mesh (`restart.agent_ready_ms`: kill → the new agent's
//! `/readyz`, its own start; `restart.agent_cpu_s`: the new agent's CPU seconds at ready and
//! at consistent; `restart.harness_cpu_s`: this process's meanwhile, its clients'), done
//! `LATTICE_BENCH_RESTARTS` times, the median run reported and every run's figures in
//! `restart.runs`; `restart.api_server_away` (the Kubernetes source: kill -9 with the API
//! server stopped, `dns_ms` until a mesh name is answered from the node's last mesh, and that
//! no name was denied nor the agent ready meanwhile), `restart.bytes_per_delta_client` (and
//! `_sotw_`) what a client received again although nothing had changed.
//!
//! Envoy is timed through its ACKs: it reaches the agent through a relay that reads the ADS
//! conversation ([`AdsTap`]), and an assignment has reached Envoy when Envoy ACKs the response
//! that carried it (Envoy applies an assignment, then ACKs it). Its initial sync ends with the
//! ACK that makes every mesh cluster hold all its endpoints; then its admin API checks it
//! (`/ready`, and the `membership_total` gauges, `usedonly`, gauges only), once, and the report
//! gives how long that took (`envoy.initial_sync_check_ms`). A change has reached Envoy with
//! the ACK of the response that carried it. Both were polled through the admin API before: a
//! query costs Envoy's main thread, the thread that applies xDS, about 15 ms (`/clusters`) to
//! 40 ms (the gauges) at 10k clusters, so the probe delayed what it timed. Once the changes
//! are over, one `/clusters` query checks that Envoy lists every change's endpoint.
//! (The scoped run, whose Envoy holds 20 clusters, still polls `/clusters` filtered to the
//! changed one, every millisecond; its times include up to one poll, and the report gives the
//! poll's duration.) Envoy gets the bootstrap `lattice-init` writes without LDS: the
//! agent's capture listener binds 0.0.0.0:15001, and the benchmark stays on loopback; clusters
//! and endpoints are what it measures.
//!
//! Changes are at least 25 ms apart, so each is a lone change for the agent's push rate limit
//! (`--debounce-ms`, 10 ms).
//!
//! **Scoped run** (Kubernetes source only, `LATTICE_BENCH_SCOPED=0` skips it): the
//! full-size mesh again, but the agent runs as on a node (`NODE_NAME` set), so it checks each
//! stream's identity and each proxy holds only what its pod uses. Every synthetic client plays
//! a pod of that node: the fake API server lists a Pod per client whose IP is a loopback
//! address of its own (client `k` at 127.1.0.0 + 1 + k; all of 127.0.0.0/8 is local, no setup),
//! the client's gRPC connection and its DNS queries come from that address, and its node id
//! names the pod. The real Envoy is the pod at 127.0.1.200 (`upstream_bind_config` on its xDS
//! cluster), whose DNS queries this process sends from that address. Each client (and Envoy)
//! connects with nothing in scope, then resolves its `LATTICE_BENCH_SCOPE` (20) names at once
//! through the agent's DNS, as an app starting up does; each answer is held until its proxy
//! holds the service. The scopes are windows of a sequence spread over the mesh, each starting
//! `scope / 5` after the previous client's, so a service is in about five clients' scopes. The
//! clients follow route configurations (RDS) as Envoy does, since a scoped proxy holds the
//! view when every type is acknowledged. Measured: initial sync (agent start → every client
//! and Envoy hold every cluster and assignment of their scope: the arrival of the last one, as
//! in the unscoped runs), bytes per client at sync, agent and Envoy RSS, the same changes but
//! of services in some clients' scopes (latency until every client that holds the service,
//! and Envoy if it does, holds the new endpoint; how many clients received anything, against
//! how many hold it), and DNS: one client at a time, a first lookup of a name new to it (its
//! stream connected and ACKing; the answer waits for its proxy) and the same lookup repeated,
//! `LATTICE_BENCH_DNS_LOOKUPS` (10) names per client. No restart. Envoy has no LDS, so the
//! agent never sees it hold a view (listeners and routes are part of it): the answers to its
//! lookups wait out `--scope-wait-ms`, which does not delay what Envoy receives. With an
//! Envoy, an empty one (admin only) is started after the scoped run for its RSS
//! (`envoy_rss_empty_mib`): Envoy's own footprint, which `scoped_vs_full.envoy_rss_over_empty_*`
//! takes off both the scoped and the unscoped figure before comparing them.
//!
//! Ignored by default; `cargo xtask bench --only xds` runs it with a release agent. Sizes from
//! `LATTICE_BENCH_SERVICES` (10000), `LATTICE_BENCH_BASELINE_SERVICES` (100),
//! `LATTICE_BENCH_CLIENTS` (100), `LATTICE_BENCH_CHANGES` (1000), `LATTICE_BENCH_SOTW_PERCENT`
//! (50: the share of clients on SotW, the rest on Delta), `LATTICE_BENCH_SCOPE` (20),
//! `LATTICE_BENCH_DNS_LOOKUPS` (10), `LATTICE_BENCH_RESTARTS` (3: restarts, the median
//! reported); `LATTICE_BENCH_RESTART_LOG` (a path: each restarted agent's log is written
//! there, the run's number appended: `PATH.1`, `PATH.2`…); `LATTICE_BENCH_SOURCES`
//! (`kube,file`) chooses the sources, `LATTICE_BENCH_ENVOY` (`delta`) Envoy's ADS flavour:
//! `delta`, `sotw`, or `none` for no Envoy; `LATTICE_BENCH_SCOPED` (`1`) the scoped run.

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use lattice_e2e::ads_client::{AdsClient, ClientView, EDS, Options, RDS};
use lattice_e2e::ads_tap::AdsTap;
use lattice_e2e::agent::{Agent, http_get, metric_in};
use lattice_e2e::envoy::{AdsMode, Envoy};
use lattice_e2e::fake_apiserver::FakeApiServer;
use lattice_e2e::k8s_objects::{generated, generated_slice, ip, populate};
use lattice_e2e::procstat::{cpu_seconds, peak_rss_mib, rss_mib, running};
use lattice_e2e::wait::Poll;
use serde_json::{Value, json};

/// jemalloc for the benchmark's own process, as the agent has: its 100 synthetic clients
/// allocate a string per resource name they hold, send or receive, and with glibc's malloc
/// that was a third of the harness's CPU in a 10k-service sync (perf), on the same two cores
/// as the agent it measures.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

const PER_SERVICE: usize = 10;
/// What the name of every mesh cluster (`<dns name>|<port>`) contains, and no other's.
const MESH_CLUSTER: &str = ".system.internal|";
const SYNC: Duration = Duration::from_secs(600);
const CHANGE: Duration = Duration::from_secs(60);
/// The least time between two changes. The agent pushes at most once per `--debounce-ms`
/// (10 ms by default) and coalesces what comes faster; changes further apart than that are
/// each a lone change, whose latency is what the figures are about. Back to back, every
/// change would wait out the previous push's period instead.
const CHANGE_SPACING: Duration = Duration::from_millis(25);
/// How often Envoy's admin is asked whether it holds a change.
const ENVOY_POLL: Duration = Duration::from_millis(1);
/// The scoped run's node, and the namespace of its pods.
const NODE: &str = "bench-node";
const POD_NAMESPACE: &str = "bench";
/// The scoped run's Envoy: its pod and its address.
const ENVOY_POD: &str = "bench-envoy";
const ENVOY_IP: Ipv4Addr = Ipv4Addr::new(127, 0, 1, 200);
/// How long a DNS query waits for its answer (a held one waits at most `--scope-wait-ms`).
const DNS_TIMEOUT: Duration = Duration::from_secs(5);

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

/// `LATTICE_BENCH_OUTLIER`: `off` turns the mesh's default outlier detection off for every
/// service of the mesh files (what it costs Envoy at 50k clusters); the Kubernetes source
/// keeps it.
fn outlier_detection() -> bool {
    match std::env::var("LATTICE_BENCH_OUTLIER").as_deref() {
        Err(_) | Ok("on") => true,
        Ok("off") => false,
        Ok(other) => panic!("LATTICE_BENCH_OUTLIER: unknown {other:?} (on, off)"),
    }
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
    format!("{}|80", dns_name(i))
}

/// The DNS name of generated service `i` (mesh path `/<namespace>/<name>`).
fn dns_name(i: usize) -> String {
    let (namespace, name) = generated(i);
    format!("{name}.{namespace}.system.internal")
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
    /// The mesh files, each of [`FILE_SERVICES`] services at most.
    File(Vec<PathBuf>),
}

/// Services per mesh file: a mesh larger than this is written as several files, as a user
/// splits one larger than the agent reads (`--mesh-file-max-mib`, 16 MiB by default: a
/// 50k-service file is about 20 MB). A 10k-service file is about 4 MB.
const FILE_SERVICES: usize = 10_000;

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
                let paths = (0..services.div_ceil(FILE_SERVICES))
                    .map(|f| {
                        let path = dir.path().join(format!("mesh-{f}.yaml"));
                        std::fs::write(&path, mesh_file(&ips, f)).unwrap();
                        path
                    })
                    .collect();
                Sink::File(paths)
            }
        };
        println!(
            "{source:?}: {services} services written in {:?}",
            written.elapsed()
        );
        Feed { ips, sink, dir }
    }

    /// The agent, with a state directory as the DaemonSet gives it: what it keeps there (the
    /// addresses, the last mesh) is part of its restart.
    fn start_agent(&self) -> Agent {
        let state = self.dir.path().join("state");
        let state = ["--state-dir", state.to_str().unwrap()];
        match &self.sink {
            Sink::Kube(_) => {
                let kubeconfig = self.dir.path().join("kubeconfig");
                Agent::start_with_env(&state, &[("KUBECONFIG", kubeconfig.to_str().unwrap())])
            }
            Sink::File(paths) => {
                let mut args = state.to_vec();
                for path in paths {
                    args.extend(["--mesh-file", path.to_str().unwrap()]);
                }
                Agent::start(&args)
            }
        }
    }

    /// The agent of node [`NODE`] on the Kubernetes source: identity checking, and scoped
    /// proxies.
    fn start_node_agent(&self) -> Agent {
        let kubeconfig = self.dir.path().join("kubeconfig");
        Agent::start_with_env(
            &[],
            &[
                ("KUBECONFIG", kubeconfig.to_str().unwrap()),
                ("NODE_NAME", NODE),
            ],
        )
    }

    fn server(&self) -> &FakeApiServer {
        match &self.sink {
            Sink::Kube(server) => server,
            Sink::File(_) => panic!("the mesh file has no API server"),
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
            Sink::File(paths) => {
                // Only the file that holds service `i` is edited.
                let file = i / FILE_SERVICES;
                let path = &paths[file];
                // Not a name the agent's watcher takes for the file (nor a `..` ConfigMap one).
                let tmp = path.with_extension("yaml.tmp");
                std::fs::write(&tmp, mesh_file(&self.ips, file)).unwrap();
                let at = Instant::now();
                std::fs::rename(&tmp, path).unwrap();
                at
            }
        }
    }
}

/// Mesh file `file` of the generated mesh: its share of the services [`populate`] makes
/// (`/<namespace>/<name>`, HTTP on 80, endpoints on 8080), so both sources give the agent the
/// same clusters.
fn mesh_file(ips: &[Vec<String>], file: usize) -> String {
    use std::fmt::Write;
    let first = file * FILE_SERVICES;
    let ips = &ips[first..ips.len().min(first + FILE_SERVICES)];
    let outlier = outlier_detection();
    let mut text = String::with_capacity(64 + ips.len() * (140 + PER_SERVICE * 30));
    text.push_str("services:\n");
    for (i, ips) in (first..).zip(ips) {
        let (namespace, name) = generated(i);
        let _ = write!(
            text,
            "  - path: /{namespace}/{name}\n    ports:\n      - port: 80\n        protocol: http\n        targetPort: 8080\n    endpoints:\n"
        );
        for ip in ips {
            let _ = writeln!(text, "      - address: {ip}");
        }
        if !outlier {
            text.push_str("    health:\n      outlier:\n        enabled: false\n");
        }
    }
    text
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
    // Each from an address of its own, as each pod's proxy is: the agent holds one address
    // to a few connections (--xds-max-connections-per-peer).
    let options = Options {
        bind: Some(IpAddr::V4(client_ip(k))),
        routes: false,
    };
    connect_by(agent, &format!("bench-{k}"), mode, options, deadline).await
}

/// A client of node id `node_id`, connected once the agent's xDS answers, before `deadline`.
async fn connect_by(
    agent: &Agent,
    node_id: &str,
    mode: AdsMode,
    options: Options,
    deadline: Instant,
) -> AdsClient {
    loop {
        match AdsClient::connect_with(agent.xds, node_id, mode, options).await {
            Ok(client) => return client,
            // An agent that refused its start-up (a bad flag, a file it will not read) is
            // not waited on for the whole sync.
            Err(e) if agent.has_exited() => {
                panic!("the agent exited before serving xDS ({e})\n{}", agent.log())
            }
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

/// What the wait for Envoy's sync found, if there is an Envoy; its failure ends the benchmark
/// with the agent's log.
async fn envoy_sync_end<T>(
    wait: Option<tokio::task::JoinHandle<anyhow::Result<T>>>,
    agent: &Agent,
) -> Option<T> {
    let wait = wait?;
    Some(
        wait.await
            .expect("the wait for Envoy's sync")
            .unwrap_or_else(|e| panic!("{e:#}\nagent log:\n{}", agent.log())),
    )
}

/// Checks through Envoy's admin (polling until the deadline) that it is LIVE and each of the
/// `services` mesh clusters holds all its endpoints.
fn envoy_synced(admin: SocketAddr, pid: u32, services: usize) -> anyhow::Result<()> {
    envoy_holds_clusters(admin, pid, &format!("all {services} clusters"), |held| {
        held.len() == services
    })
    .map(drop)
}

/// Polls Envoy until it is LIVE and `done` holds for the mesh clusters that hold all their
/// endpoints (read from the `membership_total` gauges); when the answer that showed it
/// arrived.
fn envoy_holds_clusters(
    admin: SocketAddr,
    pid: u32,
    what: &str,
    done: impl Fn(&BTreeSet<&str>) -> bool,
) -> anyhow::Result<Instant> {
    let gauges = format!(
        "/stats?usedonly&type=Gauges&filter={}",
        query_value(r"\.membership_total$")
    );
    let full = format!(".membership_total: {PER_SERVICE}");
    // An Envoy that has exited never will: the benchmark ends at once with its log.
    let get = |path: &str| {
        envoy_get(admin, pid, path).map_err(|e| {
            if running(pid) {
                Poll::Again(e)
            } else {
                Poll::Never(e)
            }
        })
    };
    lattice_e2e::wait::until_or_stop(&format!("Envoy to hold {what}"), SYNC, || {
        get("/ready")?;
        let body = get(&gauges)?;
        let held: BTreeSet<&str> = body
            .lines()
            .filter(|l| l.contains(MESH_CLUSTER))
            .filter_map(|l| l.strip_suffix(&full))
            .map(|l| l.strip_prefix("cluster.").unwrap_or(l))
            .collect();
        if done(&held) {
            Ok(Instant::now())
        } else {
            Err(Poll::Again(format!(
                "{} clusters with {PER_SERVICE} endpoints: {:.300}",
                held.len(),
                held.iter().copied().collect::<Vec<_>>().join(" ")
            )))
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

/// Checks, in one query of Envoy's admin, that each cluster `changes` touched lists the
/// endpoint its last change put in.
fn envoy_lists_changes(
    admin: SocketAddr,
    pid: u32,
    changes: &[(String, SocketAddr)],
) -> Result<(), String> {
    let last: HashMap<&str, SocketAddr> = changes.iter().map(|(c, e)| (c.as_str(), *e)).collect();
    if last.is_empty() {
        return Ok(());
    }
    let names: Vec<String> = last.keys().map(|c| exactly(c)).collect();
    let body = envoy_get(
        admin,
        pid,
        &format!("/clusters?filter={}", query_value(&names.join("|"))),
    )?;
    let missing: Vec<String> = last
        .iter()
        .filter(|(cluster, endpoint)| {
            let host = format!("{cluster}::{endpoint}::");
            !body.lines().any(|l| l.starts_with(&host))
        })
        .map(|(cluster, endpoint)| format!("{endpoint} in {cluster}"))
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "Envoy ACKed but does not list {}",
            missing.join(", ")
        ))
    }
}

/// What a run measures of its Envoy.
#[derive(Default)]
struct EnvoyFigures {
    change_ms: Vec<f64>,
    poll_ms: Vec<f64>,
}

/// SotW and Delta clients interleaved, `sotw` of them SotW.
fn modes(clients: usize, sotw: usize) -> Vec<AdsMode> {
    (0..clients)
        .map(|k| {
            if (k + 1) * sotw / clients > k * sotw / clients {
                AdsMode::Sotw
            } else {
                AdsMode::Delta
            }
        })
        .collect()
}

/// The mean bytes received so far per SotW and per Delta client, of every type and without
/// route configurations: `{sotw_mean, delta_mean, ..._without_routes}`.
fn bytes_per_client(fleet: &[AdsClient]) -> Value {
    let (mut sotw, mut delta) = (Vec::new(), Vec::new());
    let (mut sotw_bare, mut delta_bare) = (Vec::new(), Vec::new());
    for client in fleet {
        let (all, routes) = client.with_view(|v| {
            let routes = v.bytes_by_type.get(RDS).copied().unwrap_or(0);
            (v.bytes as f64, (v.bytes - routes) as f64)
        });
        match client.mode() {
            AdsMode::Sotw => {
                sotw.push(all);
                sotw_bare.push(routes);
            }
            AdsMode::Delta => {
                delta.push(all);
                delta_bare.push(routes);
            }
        }
    }
    json!({
        "sotw_mean": mean(&sotw),
        "delta_mean": mean(&delta),
        "sotw_mean_without_routes": mean(&sotw_bare),
        "delta_mean_without_routes": mean(&delta_bare),
    })
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

    // The benchmark's own CPU (the synthetic clients, the fake API server) shares the two cores
    // with the agent: how much of the sync it took is reported beside the agent's.
    let harness_cpu_start = cpu_seconds(std::process::id());
    let start = Instant::now();
    let mut agent = feed.start_agent();
    let pid = agent.pid().expect("the agent runs");
    let modes = modes(clients, sotw);
    let mut fleet = Vec::new();
    let mut envoy = None;
    let mut tap = None;
    for (k, mode) in modes.iter().enumerate() {
        fleet.push(connect(&agent, k, *mode).await);
        if k == 0
            && let Some(mode) = envoy_mode
        {
            // Once the first client is in, the agent's xDS answers: Envoy starts now, so its
            // sync is not stretched by its reconnect back-off. It reaches the agent through
            // the relay that sees its ACKs.
            let relay = AdsTap::start(agent.xds, mode)
                .await
                .expect("start the ADS relay");
            envoy = Some(start_envoy(relay.addr, mode));
            tap = Some(relay);
        }
    }
    let envoy_pid = envoy.as_ref().map(|e| e.pid().expect("Envoy runs"));
    let envoy_sync =
        envoy
            .as_ref()
            .zip(envoy_pid)
            .zip(tap.as_ref())
            .map(|((envoy, envoy_pid), tap)| {
                let admin = envoy.admin;
                let mut acks = tap.watch();
                tokio::spawn(async move {
                    // Timed by Envoy's ACKs; its admin is asked once they say it holds
                    // everything, to check they told the truth (and how long an answer takes).
                    let full = |cluster: &str, endpoints: &[SocketAddr]| {
                        cluster.contains(MESH_CLUSTER) && endpoints.len() == PER_SERVICE
                    };
                    let at = acks.holds_all(services, full, SYNC).await?;
                    let asked = Instant::now();
                    tokio::task::spawn_blocking(move || envoy_synced(admin, envoy_pid, services))
                        .await??;
                    Ok((at, asked.elapsed()))
                })
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
    let envoy_sync = envoy_sync_end(envoy_sync, &agent).await;
    let envoy_synced_at = envoy_sync.map(|(at, _)| at);
    let synced_at = clients_synced_at.max(envoy_synced_at.unwrap_or(start));
    let bytes_at_sync = bytes_per_client(&fleet);
    let rss_synced = rss_mib(pid);
    let cpu_synced = cpu_seconds(pid);
    let harness_cpu_to_sync = cpu_seconds(std::process::id())
        .zip(harness_cpu_start)
        .map(|(now, then)| now - then);
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
    // Each change's cluster and new endpoint.
    let mut changed: Vec<(String, SocketAddr)> = Vec::with_capacity(changes);
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
        changed.push((name.clone(), fresh));
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
            .filter_map(|c| c.with_view(|v| v.endpoints.get(name.as_str()).map(|(_, at)| *at)))
            .max()
            .unwrap_or(applied);
        client_latencies_ms.push(ms(arrived.duration_since(applied)));
        if let Some(tap) = &mut tap {
            let at = tap
                .acked(&name, fresh, CHANGE)
                .await
                .unwrap_or_else(|e| panic!("change {k}: {e}\nagent log:\n{}", agent.log()));
            envoy_figures.change_ms.push(ms(at.duration_since(applied)));
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
    let rss_peak = peak_rss_mib(pid);
    // What Envoy ACKed it holds: every change's endpoint, in one look at its clusters now
    // that the changes are over (a look per change would load the thread that applies them).
    if let Some((envoy, envoy_pid)) = envoy.as_ref().zip(envoy_pid) {
        envoy_lists_changes(envoy.admin, envoy_pid, &changed)
            .unwrap_or_else(|e| panic!("{e}\nagent log:\n{}", agent.log()));
    }
    let cpu_per_change_ms = match (cpu_before_changes, cpu_after) {
        (Some(a), Some(b)) if changes > 0 => Some((b - a) / changes as f64 * 1e3),
        _ => None,
    };
    let mut restart = restarts(&mut agent, &mut fleet, &modes, services).await;
    if matches!(feed.sink, Sink::Kube(_)) {
        restart["api_server_away"] =
            crash_with_the_api_server_away(&mut agent, feed.server()).await;
    }
    let nacks: u64 = fleet.iter().map(|c| c.with_view(|v| v.nacks)).sum();
    let envoy_report = envoy_mode.map(|mode| {
        json!({
            "mode": format!("{mode:?}").to_lowercase(),
            "initial_sync_ms": envoy_synced_at.map(|at| ms(at.duration_since(start))),
            "initial_sync_timed_by": "ack",
            "initial_sync_check_ms": envoy_sync.map(|(_, check)| ms(check)),
            "change_ms": summary(&envoy_figures.change_ms),
            "change_timed_by": "ack",
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
        "bytes_per_client_at_sync": {
            "sotw_mean": bytes_at_sync["sotw_mean"],
            "delta_mean": bytes_at_sync["delta_mean"],
        },
        "bytes_per_change_per_client": {
            "sotw_mean": mean(&bytes_sotw),
            "delta_mean": mean(&bytes_delta),
            "delta_max": bytes_delta.iter().copied().reduce(f64::max),
        },
        "agent_rss_mib": {
            "synced": rss_synced,
            "after_changes": rss_after,
            "peak": rss_peak,
            "restarted_peak": restart["restarted_peak_rss_mib"],
        },
        "agent_cpu_s": {"to_sync": cpu_synced, "after_changes": cpu_after},
        "harness_cpu_s_to_sync": harness_cpu_to_sync,
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
        && v.endpoints.of_size(PER_SERVICE) == services
}

/// The restart below, `LATTICE_BENCH_RESTARTS` times (3): on two shared cores one restart's
/// figure varies by about half a second from run to run, so the report is the run whose
/// `consistent_ms` is the median (its own ready time, CPU and bytes), with every run's
/// figures in `runs`.
async fn restarts(
    agent: &mut Agent,
    fleet: &mut [AdsClient],
    modes: &[AdsMode],
    services: usize,
) -> Value {
    let count = env_or("LATTICE_BENCH_RESTARTS", 3).max(1);
    let mut runs = Vec::with_capacity(count);
    for run in 1..=count {
        runs.push(restart(agent, fleet, modes, services, run).await);
    }
    // The most each restarted agent held, over its start and what followed until it was
    // killed in turn (or until now, for the last): a restart peaks above an agent that has
    // run a while, and the memory limit must hold it (a restart that is killed for memory
    // loops). The first run's killed agent is the one that synced and took the changes.
    let restarted_peak = runs[1..]
        .iter()
        .map(|run| run["killed_peak_rss_mib"].as_f64())
        .chain([agent.pid().and_then(peak_rss_mib)])
        .flatten()
        .reduce(f64::max);
    let figures: Vec<Value> = runs
        .iter()
        .map(|run| {
            json!({
                "consistent_ms": run["consistent_ms"],
                "agent_ready_ms": run["agent_ready_ms"],
                "reaped_ms": run["reaped_ms"],
                "killed_rss_mib": run["killed_rss_mib"],
                "killed_peak_rss_mib": run["killed_peak_rss_mib"],
                "agent_cpu_s": run["agent_cpu_s"],
                "harness_cpu_s": run["harness_cpu_s"],
            })
        })
        .collect();
    runs.sort_by(|a, b| {
        let at = |run: &Value| run["consistent_ms"].as_f64().unwrap_or(f64::NAN);
        at(a).total_cmp(&at(b))
    });
    let mut median = runs.swap_remove(count / 2);
    median["runs"] = figures.into();
    median["restarted_peak_rss_mib"] = restarted_peak.into();
    median
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
    run: usize,
) -> Value {
    // A crash of an agent that has run a while: its node's last mesh (and its mesh files'
    // copies) are on disk. Written at most every 5 s on a thread that yields to every other,
    // they may not be yet right after a large sync on a busy machine; then the figure would
    // be that of a node's first start.
    let last_mesh_wait = wait_for_last_mesh(agent.admin).await;
    let bytes_before: Vec<u64> = fleet.iter().map(|c| c.with_view(|v| v.bytes)).collect();
    // This process's CPU meanwhile: its 100 clients rebuild and send what they hold on the
    // two cores the agent starts on.
    let harness_before = cpu_seconds(std::process::id());
    let rss_before = agent.pid().and_then(rss_mib);
    let peak_before = agent.pid().and_then(peak_rss_mib);
    let killed = Instant::now();
    let reaped = agent.restart();
    let pid = agent.pid();
    let deadline = killed + SYNC;
    // When the new agent is ready (its first snapshot translated): the part of the figure
    // that is the agent's own start, before any stream is served; and its CPU until then.
    let admin = agent.admin;
    let ready = tokio::task::spawn_blocking(move || {
        loop {
            if matches!(http_get(admin, "/readyz"), Ok((200, _))) || Instant::now() > deadline {
                return (Instant::now(), pid.and_then(cpu_seconds));
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
    let cpu_consistent = pid.and_then(cpu_seconds);
    let harness_cpu = cpu_seconds(std::process::id())
        .zip(harness_before)
        .map(|(after, before)| after - before);
    let (ready, cpu_ready) = ready.await.expect("the readiness poll");
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
    // The restarted agent's own account of its start (the node's last mesh read, the lists,
    // the first translation), for whoever profiles it.
    if let Ok(path) = std::env::var("LATTICE_BENCH_RESTART_LOG")
        && let Err(e) = std::fs::write(format!("{path}.{run}"), agent.log())
    {
        eprintln!("LATTICE_BENCH_RESTART_LOG: cannot write {path}: {e}");
    }
    let figures = json!({
        "last_mesh_wait_ms": last_mesh_wait.map(ms),
        "consistent_ms": ms(consistent_at.duration_since(killed)),
        "agent_ready_ms": ms(ready.duration_since(killed)),
        "killed_rss_mib": rss_before,
        "killed_peak_rss_mib": peak_before,
        "reaped_ms": ms(reaped),
        "agent_cpu_s": {"ready": cpu_ready, "consistent": cpu_consistent},
        "harness_cpu_s": harness_cpu,
        "bytes_per_delta_client": mean(&delta),
        "bytes_per_delta_client_max": delta.iter().copied().reduce(f64::max),
        "bytes_per_sotw_client": mean(&sotw),
    });
    figures
}

/// Waits until the agent says the node's last mesh holds the mesh it serves (written, or
/// found to hold it already after a restart), so that it holds the mesh as the changes left
/// it, and, with mesh files, that each file's copy holds the text it serves; how long that
/// took, or `None` when it was not within a minute (the restart then goes ahead without it).
async fn wait_for_last_mesh(admin: SocketAddr) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(60) {
        let current = tokio::task::spawn_blocking(move || {
            let (_, text) = http_get(admin, "/metrics").ok()?;
            let held = metric_in(&text, "lattice_mesh_last_mesh_version")?;
            let copies_behind = metric_in(&text, "lattice_mesh_file_copies_behind")?;
            Some(
                held > 0.0
                    && Some(held) == metric_in(&text, "lattice_xds_snapshot_version")
                    && copies_behind == 0.0,
            )
        })
        .await;
        if matches!(current, Ok(Some(true))) {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// A crash while the API server cannot be reached: kill -9, the API server stopped, the agent
/// started again; kill → the first answer for a mesh name (`dns_ms`: the node's last mesh, as
/// the agent cannot list anything), whether a name the mesh lacks was denied meanwhile
/// (`nxdomain_meanwhile`: it must not be, as it may be new), then the API server back and the
/// agent ready again. `dns_ms` is null when no mesh name was answered within [`DNS_AWAY`].
async fn crash_with_the_api_server_away(agent: &mut Agent, server: &FakeApiServer) -> Value {
    const DNS_AWAY: Duration = Duration::from_secs(10);
    server.stop();
    let killed = Instant::now();
    agent.restart();
    let mut resolver = Resolver::bind(Ipv4Addr::LOCALHOST, agent.dns).await;
    let name = dns_name(7);
    let mut answered = None;
    while answered.is_none() && killed.elapsed() < DNS_AWAY {
        // Asked again after 20 ms without an answer: the agent may not have bound yet.
        match resolver.answer(&name, Duration::from_millis(20)).await {
            Some((0, true, at)) => answered = Some(at),
            // SERVFAIL before the last mesh is read.
            Some(_) => tokio::time::sleep(Duration::from_millis(2)).await,
            None => {}
        }
    }
    let absent = format!("absent.{}", dns_name(7));
    let nxdomain = resolver
        .answer(&absent, DNS_TIMEOUT)
        .await
        .map(|(rcode, _, _)| rcode);
    let ready_before = matches!(http_get(agent.admin, "/readyz"), Ok((200, _)));
    server
        .restart()
        .unwrap_or_else(|e| panic!("the API server does not come back: {e}"));
    agent
        .wait_ready()
        .unwrap_or_else(|e| panic!("{e}\nagent log:\n{}", agent.log()));
    let dns_ms = answered.map(|at| ms(at.duration_since(killed)));
    println!("restart with the API server away: a mesh name answered after {dns_ms:?} ms");
    json!({
        "dns_ms": dns_ms,
        "nxdomain_meanwhile": nxdomain == Some(3),
        "ready_meanwhile": ready_before,
    })
}

/// Which services each pod of the scoped run uses, and which it will look up fresh.
struct Plan {
    /// Client `k`'s services.
    scopes: Vec<Vec<usize>>,
    /// Envoy's services.
    envoy: Vec<usize>,
    /// Every service in some client's or Envoy's scope, sorted: what the changes pick from.
    used: Vec<usize>,
    /// Service → the clients whose scope holds it.
    holders: HashMap<usize, Vec<usize>>,
    /// Client `k`'s names for the DNS measurement: in no scope, and each client's its own
    /// while the mesh is large enough.
    fresh: Vec<Vec<usize>>,
}

impl Plan {
    /// Scopes of `scope` services, as windows of one sequence spread over the mesh (a stride
    /// coprime with 10ⁿ): client `k`'s window starts `scope / 5` after client `k - 1`'s, so a
    /// service is in about five clients' scopes; Envoy's window is among the middle clients'.
    fn new(services: usize, clients: usize, scope: usize, lookups: usize) -> Plan {
        let scope = scope.clamp(1, services);
        let step = (scope / 5).max(1);
        let spread = |x: usize| (x * 7919) % services;
        let window = |from: usize| -> Vec<usize> {
            let mut out = Vec::with_capacity(scope);
            for x in from.. {
                let i = spread(x);
                if !out.contains(&i) {
                    out.push(i);
                }
                if out.len() == scope || x >= from + services {
                    break;
                }
            }
            out
        };
        let scopes: Vec<Vec<usize>> = (0..clients).map(|k| window(k * step)).collect();
        let envoy = window(clients / 2 * step + step / 2);
        let mut holders: HashMap<usize, Vec<usize>> = HashMap::new();
        for (k, services) in scopes.iter().enumerate() {
            for &i in services {
                holders.entry(i).or_default().push(k);
            }
        }
        let used: BTreeSet<usize> = scopes.iter().flatten().chain(&envoy).copied().collect();
        let past = (clients.saturating_sub(1)) * step + scope;
        let fresh = (0..clients)
            .map(|k| {
                let mut out: Vec<usize> = Vec::with_capacity(lookups);
                for x in past + k * lookups.. {
                    if out.len() == lookups || x >= past + k * lookups + services {
                        break;
                    }
                    let i = spread(x);
                    if !scopes[k].contains(&i) && !out.contains(&i) {
                        out.push(i);
                    }
                }
                out
            })
            .collect();
        Plan {
            scopes,
            envoy,
            used: used.into_iter().collect(),
            holders,
            fresh,
        }
    }
}

/// Client `k`'s address: its pod's IP.
fn client_ip(k: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(127, 1, 0, 0)) + 1 + k as u32)
}

fn client_pod(k: usize) -> String {
    format!("bench-{k}")
}

/// A running Pod of [`NODE`] at `ip`.
fn pod(name: &str, ip: Ipv4Addr) -> Value {
    let ip = ip.to_string();
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"namespace": POD_NAMESPACE, "name": name},
           "spec": {"nodeName": NODE, "containers": [{"name": "app", "image": "app"}]},
           "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}})
}

/// A DNS query for `name` A, recursion desired.
fn dns_query(id: u16, name: &str) -> Vec<u8> {
    let mut query = Vec::with_capacity(18 + name.len());
    query.extend_from_slice(&id.to_be_bytes());
    // RD; one question.
    query.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.split('.') {
        query.push(label.len() as u8);
        query.extend_from_slice(label.as_bytes());
    }
    query.push(0);
    // A, IN.
    query.extend_from_slice(&[0, 1, 0, 1]);
    query
}

/// A DNS response's id, and whether it answers (NOERROR with at least one record).
fn dns_reply(packet: &[u8]) -> Option<(u16, bool)> {
    if packet.len() < 12 || packet[2] & 0x80 == 0 {
        return None;
    }
    let id = u16::from_be_bytes([packet[0], packet[1]]);
    let answers = u16::from_be_bytes([packet[6], packet[7]]);
    Some((id, packet[3] & 0x0f == 0 && answers > 0))
}

/// A pod's resolver: UDP queries to the agent's DNS from the pod's address.
struct Resolver {
    socket: tokio::net::UdpSocket,
    dns: SocketAddr,
    id: u16,
}

/// One lookup: how long it took, whether it answered with an address, and when the answer
/// arrived.
struct Lookup {
    took: Duration,
    answered: bool,
    at: Instant,
}

impl Resolver {
    async fn bind(ip: Ipv4Addr, dns: SocketAddr) -> Resolver {
        let socket = tokio::net::UdpSocket::bind((ip, 0))
            .await
            .unwrap_or_else(|e| panic!("cannot bind a UDP socket on {ip}: {e}"));
        Resolver { socket, dns, id: 0 }
    }

    async fn send(&mut self, name: &str) -> Result<u16, String> {
        self.id = self.id.wrapping_add(1);
        self.socket
            .send_to(&dns_query(self.id, name), self.dns)
            .await
            .map_err(|e| format!("sending a query for {name}: {e}"))?;
        Ok(self.id)
    }

    /// The next response, if one comes within `timeout`: (id, answered, when).
    async fn receive(&self, timeout: Duration) -> Result<Option<(u16, bool, Instant)>, String> {
        let mut buf = [0u8; 1500];
        match tokio::time::timeout(timeout, self.socket.recv_from(&mut buf)).await {
            Err(_) => Ok(None),
            Ok(Err(e)) => Err(format!("receiving DNS answers: {e}")),
            Ok(Ok((len, _))) => Ok(dns_reply(&buf[..len]).map(|(id, ok)| (id, ok, Instant::now()))),
        }
    }

    /// One query for `name`, if answered within `timeout`: the response code, whether it
    /// holds an address, and when it came.
    async fn answer(&mut self, name: &str, timeout: Duration) -> Option<(u8, bool, Instant)> {
        let id = self.send(name).await.ok()?;
        let mut buf = [0u8; 1500];
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let received = tokio::time::timeout(left, self.socket.recv_from(&mut buf)).await;
            let (len, _) = match received {
                Ok(Ok(received)) => received,
                // Refused (nothing bound yet: the port's ICMP error), or no answer in time.
                Ok(Err(_)) | Err(_) => return None,
            };
            let packet = &buf[..len];
            if let Some((got, answered)) = dns_reply(packet)
                && got == id
            {
                return Some((packet[3] & 0x0f, answered, Instant::now()));
            }
        }
    }

    /// One query for `name`, not repeated: its answer, or an error after [`DNS_TIMEOUT`].
    async fn lookup(&mut self, name: &str) -> Result<Lookup, String> {
        let sent = Instant::now();
        let id = self.send(name).await?;
        let deadline = sent + DNS_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.receive(left).await? {
                Some((got, answered, at)) if got == id => {
                    return Ok(Lookup {
                        took: at.duration_since(sent),
                        answered,
                        at,
                    });
                }
                // A late answer to an earlier query.
                Some(_) => {}
                None => return Err(format!("no answer for {name} within {DNS_TIMEOUT:?}")),
            }
        }
    }

    /// Resolves `names` all at once, as an app starting up does; a name that does not resolve
    /// (the agent does not serve the mesh yet) or is not answered within [`DNS_TIMEOUT`] is
    /// asked again, until `deadline`.
    async fn resolve_all(&mut self, names: &[String], deadline: Instant) -> Result<(), String> {
        let mut unresolved: BTreeSet<usize> = (0..names.len()).collect();
        let mut asked: HashMap<u16, usize> = HashMap::new();
        let mut to_ask: Vec<usize> = unresolved.iter().copied().collect();
        while !unresolved.is_empty() {
            if Instant::now() >= deadline {
                let left: Vec<&str> = unresolved.iter().map(|&n| names[n].as_str()).collect();
                return Err(format!("{} names did not resolve: {left:?}", left.len()));
            }
            for n in to_ask.drain(..) {
                let id = self.send(&names[n]).await?;
                asked.insert(id, n);
            }
            match self.receive(DNS_TIMEOUT).await? {
                None => {
                    asked.clear();
                    to_ask = unresolved.iter().copied().collect();
                }
                Some((id, answered, _)) => match asked.remove(&id) {
                    Some(n) if answered => {
                        unresolved.remove(&n);
                    }
                    Some(n) => {
                        tracing::debug!("{} did not resolve yet", names[n]);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        to_ask.push(n);
                    }
                    None => {}
                },
            }
        }
        Ok(())
    }
}

/// Connects client `k` as its pod and waits for its stream's first answer: before the agent
/// has listed its node's pods it turns streams away (UNAVAILABLE), and the client tries
/// again, as Envoy does.
async fn connect_pod(agent: &Agent, k: usize, mode: AdsMode) -> AdsClient {
    let deadline = Instant::now() + SYNC;
    let options = Options {
        bind: Some(IpAddr::V4(client_ip(k))),
        routes: true,
    };
    let node_id = format!("{}.{POD_NAMESPACE}", client_pod(k));
    let mut client = connect_by(agent, &node_id, mode, options, deadline).await;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match client
            .wait_for("its stream's first answer", left, |v| {
                !v.answered.is_empty()
            })
            .await
        {
            Ok(()) => return client,
            Err(e)
                if client.stream_ended()
                    && !format!("{e:#}").contains(tonic::Code::PermissionDenied.description())
                    && Instant::now() < deadline =>
            {
                tracing::debug!("client {k} turned away: {e:#}");
                tokio::time::sleep(Duration::from_millis(20)).await;
                while let Err(e) = client.reconnect().await {
                    assert!(
                        Instant::now() < deadline,
                        "cannot reconnect: {e}\n{}",
                        agent.log()
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            Err(e) => panic!("client {k} ({node_id}): {e:#}\nagent log:\n{}", agent.log()),
        }
    }
}

/// Whether a client holds every cluster of `clusters` with all its endpoints.
fn holds_scope(v: &ClientView, clusters: &[String]) -> bool {
    clusters.iter().all(|c| {
        v.clusters.contains(c.as_str()) && v.endpoints_of(c).is_some_and(|e| e.len() == PER_SERVICE)
    })
}

/// When the last assignment of `clusters` reached the client.
fn scope_arrival(client: &AdsClient, clusters: &[String]) -> Option<Instant> {
    client.with_view(|v| {
        clusters
            .iter()
            .filter_map(|c| v.endpoints.get(c.as_str()).map(|(_, at)| *at))
            .max()
    })
}

/// The run's real Envoy as the pod [`ENVOY_POD`] at [`ENVOY_IP`]: its node id names the pod and
/// its xDS connection comes from the pod's address.
fn start_pod_envoy(xds: SocketAddr, mode: AdsMode) -> Envoy {
    let node_id = format!("{ENVOY_POD}.{POD_NAMESPACE}");
    Envoy::start_edited(&node_id, xds, mode, |bootstrap| {
        if let Some(dynamic) = bootstrap["dynamic_resources"].as_object_mut() {
            dynamic.remove("lds_config");
        }
        let bind = json!({"source_address": {"address": ENVOY_IP.to_string(), "port_value": 0}});
        for cluster in bootstrap["static_resources"]["clusters"]
            .as_array_mut()
            .into_iter()
            .flatten()
        {
            cluster["upstream_bind_config"] = bind.clone();
        }
    })
}

/// `/debug/xds` of the agent: its connected proxies.
fn proxies(admin: SocketAddr) -> Result<Vec<Value>, String> {
    let (status, body) = http_get(admin, "/debug/xds").map_err(|e| e.to_string())?;
    if status != 200 {
        return Err(format!("/debug/xds: {status} {body:.300}"));
    }
    let value: Value = serde_json::from_str(&body).map_err(|e| e.to_string())?;
    match value {
        Value::Array(list) => Ok(list),
        other => Ok(other["proxies"].as_array().cloned().unwrap_or_default()),
    }
}

/// Envoy's pod resolves its names once its stream follows its pod's scope (the registry
/// knows the pod then; the answers wait out `--scope-wait-ms`, Envoy having no listeners), and
/// Envoy holds them: when the answer that showed it arrived.
async fn envoy_scope_sync(
    agent_admin: SocketAddr,
    dns: SocketAddr,
    envoy: (SocketAddr, u32),
    services: Vec<usize>,
) -> anyhow::Result<Instant> {
    let deadline = Instant::now() + SYNC;
    let node_id = format!("{ENVOY_POD}.{POD_NAMESPACE}");
    lattice_e2e::wait::until_async("Envoy's stream to follow its pod's scope", SYNC, || {
        let node_id = node_id.clone();
        async move {
            let list = tokio::task::spawn_blocking(move || proxies(agent_admin))
                .await
                .map_err(|e| e.to_string())??;
            let attached = list
                .iter()
                .any(|p| p["node_id"] == node_id.as_str() && p["scope"].is_array());
            if attached {
                Ok(())
            } else {
                Err(format!(
                    "{} proxies, not {node_id} with a scope",
                    list.len()
                ))
            }
        }
    })
    .await?;
    let names: Vec<String> = services.iter().map(|&i| dns_name(i)).collect();
    let lookups = tokio::spawn(async move {
        Resolver::bind(ENVOY_IP, dns)
            .await
            .resolve_all(&names, deadline)
            .await
    });
    let clusters: BTreeSet<String> = services.iter().map(|&i| cluster(i)).collect();
    let (admin, pid) = envoy;
    let synced = tokio::task::spawn_blocking(move || {
        envoy_holds_clusters(admin, pid, "its pod's services", |held| {
            clusters.iter().all(|c| held.contains(c.as_str()))
        })
    })
    .await??;
    lookups.await?.map_err(anyhow::Error::msg)?;
    Ok(synced)
}

/// The agent's scope counters (`lattice_scope_*_total`).
fn scope_counters(agent: &Agent) -> Value {
    let metrics = agent
        .get("/metrics")
        .map(|(_, body)| body)
        .unwrap_or_default();
    let counter = |name: &str| -> Option<f64> {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
    };
    json!({
        "added": counter("lattice_scope_services_added_total"),
        "waited": counter("lattice_scope_waits_total"),
        "timed_out": counter("lattice_scope_wait_timeouts_total"),
    })
}

/// `after - before` for each counter of [`scope_counters`].
fn counters_since(before: &Value, after: &Value) -> Value {
    let get = |v: &Value, k: &str| v[k].as_f64();
    let diff = |k: &str| get(after, k).zip(get(before, k)).map(|(a, b)| a - b);
    json!({"added": diff("added"), "waited": diff("waited"), "timed_out": diff("timed_out")})
}

/// The scoped run (see the top): the mesh of `services` from the API server, the agent as
/// node [`NODE`]'s, `clients` pods each using `scope` services, then `changes` endpoint changes
/// of used services, then `lookups` fresh names per client.
async fn scoped_run(
    services: usize,
    clients: usize,
    sotw: usize,
    changes: usize,
    (scope, lookups): (usize, usize),
    envoy_mode: Option<AdsMode>,
) -> Value {
    let mut feed = Feed::new(Source::Kube, services);
    let plan = Plan::new(services, clients, scope, lookups);
    {
        let server = feed.server();
        server
            .apply_json(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}))
            .unwrap();
        for k in 0..clients {
            server
                .apply_json(pod(&client_pod(k), client_ip(k)))
                .unwrap();
        }
        if envoy_mode.is_some() {
            server.apply_json(pod(ENVOY_POD, ENVOY_IP)).unwrap();
        }
    }
    let clusters_of =
        |services: &[usize]| -> Vec<String> { services.iter().map(|&i| cluster(i)).collect() };
    let scope_clusters: Vec<Vec<String>> = plan.scopes.iter().map(|s| clusters_of(s)).collect();

    let start = Instant::now();
    let agent = feed.start_node_agent();
    let pid = agent.pid().expect("the agent runs");
    let modes = modes(clients, sotw);
    // The first client in means the agent serves (its pods listed, the mesh known): Envoy
    // starts now, so its sync is not stretched by its reconnect back-off.
    let mut fleet = vec![connect_pod(&agent, 0, modes[0]).await];
    let envoy = envoy_mode.map(|mode| start_pod_envoy(agent.xds, mode));
    let envoy_pid = envoy.as_ref().map(|e| e.pid().expect("Envoy runs"));
    let envoy_sync = envoy.as_ref().zip(envoy_pid).map(|(envoy, envoy_pid)| {
        tokio::spawn(envoy_scope_sync(
            agent.admin,
            agent.dns,
            (envoy.admin, envoy_pid),
            plan.envoy.clone(),
        ))
    });
    fleet.extend(
        futures::future::join_all((1..clients).map(|k| connect_pod(&agent, k, modes[k]))).await,
    );
    let mut resolvers = Vec::with_capacity(clients);
    for k in 0..clients {
        resolvers.push(Resolver::bind(client_ip(k), agent.dns).await);
    }
    // Every pod resolves its names at once, and its proxy comes to hold them.
    let deadline = Instant::now() + SYNC;
    let syncs = fleet
        .iter_mut()
        .zip(resolvers.iter_mut())
        .zip(&plan.scopes)
        .zip(&scope_clusters)
        .map(|(((client, resolver), services), clusters)| async move {
            let names: Vec<String> = services.iter().map(|&i| dns_name(i)).collect();
            resolver.resolve_all(&names, deadline).await?;
            let left = deadline.saturating_duration_since(Instant::now());
            client
                .wait_for("its scope", left, |v| holds_scope(v, clusters))
                .await
                .map_err(|e| format!("{e:#}"))
        });
    for (k, outcome) in futures::future::join_all(syncs)
        .await
        .into_iter()
        .enumerate()
    {
        if let Err(e) = outcome {
            panic!("client {k}: {e}\nagent log:\n{}", agent.log());
        }
    }
    let clients_synced_at = fleet
        .iter()
        .zip(&scope_clusters)
        .filter_map(|(c, clusters)| scope_arrival(c, clusters))
        .max()
        .unwrap_or(start);
    let envoy_synced_at = envoy_sync_end(envoy_sync, &agent).await;
    let synced_at = clients_synced_at.max(envoy_synced_at.unwrap_or(start));
    let bytes_at_sync = bytes_per_client(&fleet);
    let rss_synced = rss_mib(pid);
    let cpu_synced = cpu_seconds(pid);
    let envoy_rss_synced = envoy_pid.and_then(rss_mib);
    let counters_synced = scope_counters(&agent);
    // Whether the scope applies: each client holds its services and nothing else.
    let held: Vec<usize> = fleet
        .iter()
        .map(|c| c.with_view(|v| v.clusters.len()))
        .collect();
    let listed = proxies(agent.admin).unwrap_or_default();
    let proxies_scoped = listed.iter().filter(|p| p["scope"].is_array()).count();
    println!(
        "scoped: {clients} clients synced in {:?}, Envoy in {:?}; clusters per client {:?}..{:?}; \
         {proxies_scoped} of {} proxies scoped",
        clients_synced_at.duration_since(start),
        envoy_synced_at.map(|at| at.duration_since(start)),
        held.iter().min(),
        held.iter().max(),
        listed.len(),
    );

    // Endpoint changes of services in some clients' scopes.
    let mut latencies_ms = Vec::with_capacity(changes);
    let mut client_latencies_ms = Vec::with_capacity(changes);
    let mut envoy_figures = EnvoyFigures::default();
    let (mut bytes_sotw, mut bytes_delta, mut bytes_others) = (Vec::new(), Vec::new(), Vec::new());
    let (mut holding_total, mut received_total, mut others_received) = (0usize, 0usize, 0usize);
    let mut mismatched = 0usize;
    let cpu_before_changes = cpu_seconds(pid);
    // The change waiting for its accounting: the bytes before it, and who holds it. A client's
    // bytes are read just before the next change (or after the spacing, for the last), so
    // whatever the change sent anyone is counted.
    let mut pending: Option<(Vec<u64>, BTreeSet<usize>)> = None;
    let mut settle = |fleet: &[AdsClient], pending: Option<(Vec<u64>, BTreeSet<usize>)>| {
        let Some((before, holders)) = pending else {
            return;
        };
        let mut received = 0;
        for (k, client) in fleet.iter().enumerate() {
            let sent = (client.with_view(|v| v.bytes) - before[k]) as f64;
            received += usize::from(sent > 0.0);
            if holders.contains(&k) {
                match client.mode() {
                    AdsMode::Sotw => bytes_sotw.push(sent),
                    AdsMode::Delta => bytes_delta.push(sent),
                }
            } else {
                bytes_others.push(sent);
                others_received += usize::from(sent > 0.0);
            }
        }
        holding_total += holders.len();
        received_total += received;
        mismatched += usize::from(received != holders.len());
    };
    let mut last_change: Option<Instant> = None;
    let mut envoy_changes = 0usize;
    for k in 0..changes {
        if let Some(at) = last_change {
            tokio::time::sleep_until((at + CHANGE_SPACING).into()).await;
        }
        settle(&fleet, pending.take());
        let i = plan.used[(k * 7919) % plan.used.len()];
        let fresh_ip = ip(50_000_000 + k as u32);
        let fresh = SocketAddr::new(fresh_ip.parse().unwrap(), 8080);
        let name = cluster(i);
        let holders: BTreeSet<usize> = plan
            .holders
            .get(&i)
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .collect();
        let in_envoy = plan.envoy.contains(&i);
        let bytes_before: Vec<u64> = fleet.iter().map(|c| c.with_view(|v| v.bytes)).collect();
        let applied = feed.change(i, k % PER_SERVICE, fresh_ip);
        last_change = Some(applied);
        let envoy_wait =
            envoy
                .as_ref()
                .zip(envoy_pid)
                .filter(|_| in_envoy)
                .map(|(envoy, envoy_pid)| {
                    let (admin, name) = (envoy.admin, name.clone());
                    tokio::task::spawn_blocking(move || envoy_holds(admin, envoy_pid, &name, fresh))
                });
        for &h in &holders {
            fleet[h]
                .wait_for(&format!("change {k} at {name}"), CHANGE, |v| {
                    v.endpoints_of(&name).is_some_and(|e| e.contains(&fresh))
                })
                .await
                .unwrap_or_else(|e| panic!("client {h}: {e}\nagent log:\n{}", agent.log()));
        }
        let mut arrived = holders
            .iter()
            .filter_map(|&h| {
                fleet[h].with_view(|v| v.endpoints.get(name.as_str()).map(|(_, at)| *at))
            })
            .max()
            .unwrap_or(applied);
        if !holders.is_empty() {
            client_latencies_ms.push(ms(arrived.duration_since(applied)));
        }
        if let Some(wait) = envoy_wait {
            let (at, polls) = wait
                .await
                .expect("the Envoy poll")
                .unwrap_or_else(|e| panic!("change {k}: {e}\nagent log:\n{}", agent.log()));
            envoy_figures.change_ms.push(ms(at.duration_since(applied)));
            envoy_figures.poll_ms.extend(polls.into_iter().map(ms));
            envoy_changes += 1;
            arrived = arrived.max(at);
        }
        latencies_ms.push(ms(arrived.duration_since(applied)));
        pending = Some((bytes_before, holders));
    }
    if let Some(at) = last_change {
        tokio::time::sleep_until((at + CHANGE_SPACING).into()).await;
    }
    settle(&fleet, pending.take());
    let cpu_after = cpu_seconds(pid);
    let rss_after = rss_mib(pid);
    let envoy_rss_after = envoy_pid.and_then(rss_mib);
    let cpu_per_change_ms = match (cpu_before_changes, cpu_after) {
        (Some(a), Some(b)) if changes > 0 => Some((b - a) / changes as f64 * 1e3),
        _ => None,
    };
    println!(
        "scoped: {changes} changes, p50 {:?} ms; {received_total} clients received of \
         {holding_total} holding",
        summary(&latencies_ms)["p50"]
    );

    // DNS: one client at a time, a name new to it, then the same name again.
    let counters_before_dns = scope_counters(&agent);
    let (mut first, mut repeated) = (Vec::new(), Vec::new());
    let (mut first_sotw, mut first_delta) = (Vec::new(), Vec::new());
    let (mut held_at_answer, mut unanswered) = (0usize, Vec::new());
    for (k, (client, resolver)) in fleet.iter().zip(resolvers.iter_mut()).enumerate() {
        for &i in &plan.fresh[k] {
            let (name, cluster) = (dns_name(i), cluster(i));
            let lookup = resolver
                .lookup(&name)
                .await
                .unwrap_or_else(|e| panic!("client {k}: {e}\nagent log:\n{}", agent.log()));
            if !lookup.answered {
                unanswered.push(name.clone());
            }
            first.push(ms(lookup.took));
            match client.mode() {
                AdsMode::Sotw => first_sotw.push(ms(lookup.took)),
                AdsMode::Delta => first_delta.push(ms(lookup.took)),
            }
            // Its proxy held the service's endpoints when the answer came.
            let held = client.with_view(|v| {
                v.endpoints
                    .get(cluster.as_str())
                    .is_some_and(|(e, at)| e.len() == PER_SERVICE && *at <= lookup.at)
            });
            held_at_answer += usize::from(held);
            let again = resolver
                .lookup(&name)
                .await
                .unwrap_or_else(|e| panic!("client {k}: {e}\nagent log:\n{}", agent.log()));
            if !again.answered {
                unanswered.push(name);
            }
            repeated.push(ms(again.took));
        }
    }
    let counters_after_dns = scope_counters(&agent);
    let first_summary = summary(&first);
    let repeated_summary = summary(&repeated);
    let p99_difference = first_summary["p99"]
        .as_f64()
        .zip(repeated_summary["p99"].as_f64())
        .map(|(a, b)| a - b);
    println!(
        "scoped DNS: {} first lookups p50/p99 {}/{} ms, repeated {}/{} ms; {held_at_answer} \
         held by the proxy at the answer",
        first.len(),
        first_summary["p50"],
        first_summary["p99"],
        repeated_summary["p50"],
        repeated_summary["p99"],
    );
    let nacks: u64 = fleet.iter().map(|c| c.with_view(|v| v.nacks)).sum();
    let envoy_report = envoy_mode.map(|mode| {
        json!({
            "mode": format!("{mode:?}").to_lowercase(),
            "scope": plan.envoy.len(),
            "initial_sync_ms": envoy_synced_at.map(|at| ms(at.duration_since(start))),
            "changes_in_scope": envoy_changes,
            "change_ms": summary(&envoy_figures.change_ms),
            "admin_poll_ms": summary(&envoy_figures.poll_ms),
            "rss_mib": {"synced": envoy_rss_synced, "after_changes": envoy_rss_after},
        })
    });
    let holding_mean = (changes > 0).then(|| holding_total as f64 / changes as f64);
    json!({
        "source": "kube",
        "services": services,
        "endpoints": services * PER_SERVICE,
        "clients": clients,
        "clients_sotw": modes.iter().filter(|m| matches!(m, AdsMode::Sotw)).count(),
        "clients_delta": modes.iter().filter(|m| matches!(m, AdsMode::Delta)).count(),
        "scope": plan.scopes.first().map_or(0, Vec::len),
        "services_in_some_scope": plan.used.len(),
        "changes": changes,
        "initial_sync_ms": ms(synced_at.duration_since(start)),
        "initial_sync_synthetic_clients_ms": ms(clients_synced_at.duration_since(start)),
        "clusters_per_client": {"min": held.iter().min(), "max": held.iter().max()},
        "proxies_scoped": proxies_scoped,
        "proxies_connected": listed.len(),
        "bytes_per_client_at_sync": bytes_at_sync,
        "change_to_all_holders_ms": summary(&latencies_ms),
        "change_to_synthetic_holders_ms": summary(&client_latencies_ms),
        "change_receivers": {
            "clients_holding_mean": holding_mean,
            "clients_holding_total": holding_total,
            "clients_received_total": received_total,
            "other_clients_received_total": others_received,
            "changes_where_received_differs": mismatched,
        },
        "bytes_per_change_per_holder": {
            "sotw_mean": mean(&bytes_sotw),
            "delta_mean": mean(&bytes_delta),
            "delta_max": bytes_delta.iter().copied().reduce(f64::max),
        },
        "bytes_per_change_per_other_client": mean(&bytes_others),
        "agent_rss_mib": {"synced": rss_synced, "after_changes": rss_after, "after_dns": rss_mib(pid)},
        "agent_cpu_s": {"to_sync": cpu_synced, "after_changes": cpu_after},
        "agent_cpu_ms_per_change": cpu_per_change_ms,
        "client_nacks": nacks,
        "scope_counters": {
            "at_sync": counters_synced,
            "dns_phase": counters_since(&counters_before_dns, &counters_after_dns),
        },
        "dns": {
            "lookups": first.len(),
            "first_ms": first_summary,
            "repeated_ms": repeated_summary,
            "p99_first_minus_repeated_ms": p99_difference,
            "first_sotw_ms": summary(&first_sotw),
            "first_delta_ms": summary(&first_delta),
            "held_by_proxy_at_answer": held_at_answer,
            "unanswered": unanswered,
        },
        "envoy": envoy_report,
    })
}

/// The RSS of an Envoy that holds nothing (admin only, the benchmark's arguments), once it is
/// ready: Envoy's own footprint, which no control plane can take off a proxy's RSS.
fn empty_envoy_rss_mib() -> Option<f64> {
    let dir = tempfile::tempdir().ok()?;
    let admin = SocketAddr::from(([127, 0, 0, 1], lattice_e2e::agent::free_port()));
    let bootstrap = dir.path().join("empty.json");
    let config = json!({
        "node": {"id": "empty", "cluster": "lattice"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin.port()}}},
    });
    std::fs::write(&bootstrap, config.to_string()).ok()?;
    let envoy = Envoy::start_with_bootstrap(&bootstrap, admin, dir);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !matches!(http_get(admin, "/ready"), Ok((200, _))) {
        if Instant::now() > deadline {
            eprintln!("the empty Envoy never became ready:\n{}", envoy.log());
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    envoy.pid().and_then(rss_mib)
}

/// The scoped run against the full one, both at full size: scoped / full.
fn scoped_vs_full(full: &Value, scoped: &Value, empty: Option<f64>) -> Value {
    let ratio = |full_path: &[&str], scoped_path: &[&str]| -> Option<f64> {
        let get = |v: &Value, path: &[&str]| path.iter().fold(v, |v, k| &v[*k]).as_f64();
        Some(get(scoped, scoped_path)? / get(full, full_path)?)
    };
    let same = |path: &[&str]| ratio(path, path);
    let over_empty = |path: &[&str]| -> Option<f64> {
        let get = |v: &Value| path.iter().fold(v, |v, k| &v[*k]).as_f64();
        let empty = empty?;
        Some((get(scoped)? - empty) / (get(full)? - empty))
    };
    json!({
        "bytes_at_sync_sotw": ratio(&["bytes_per_client_at_sync", "sotw_mean"], &["bytes_per_client_at_sync", "sotw_mean"]),
        "bytes_at_sync_delta": ratio(&["bytes_per_client_at_sync", "delta_mean"], &["bytes_per_client_at_sync", "delta_mean"]),
        "bytes_at_sync_sotw_without_routes": ratio(&["bytes_per_client_at_sync", "sotw_mean"], &["bytes_per_client_at_sync", "sotw_mean_without_routes"]),
        "bytes_at_sync_delta_without_routes": ratio(&["bytes_per_client_at_sync", "delta_mean"], &["bytes_per_client_at_sync", "delta_mean_without_routes"]),
        "envoy_rss_synced": same(&["envoy", "rss_mib", "synced"]),
        "envoy_rss_after_changes": same(&["envoy", "rss_mib", "after_changes"]),
        // What the configuration costs Envoy, over an empty Envoy's own footprint.
        "envoy_rss_over_empty_synced": over_empty(&["envoy", "rss_mib", "synced"]),
        "envoy_rss_over_empty_after_changes": over_empty(&["envoy", "rss_mib", "after_changes"]),
        "agent_rss_synced": same(&["agent_rss_mib", "synced"]),
        "agent_rss_after_changes": same(&["agent_rss_mib", "after_changes"]),
        "initial_sync": same(&["initial_sync_ms"]),
        "change_p50": ratio(&["change_to_all_clients_ms", "p50"], &["change_to_all_holders_ms", "p50"]),
        "change_p99": ratio(&["change_to_all_clients_ms", "p99"], &["change_to_all_holders_ms", "p99"]),
        "agent_cpu_per_change": same(&["agent_cpu_ms_per_change"]),
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
    let scope = env_or("LATTICE_BENCH_SCOPE", 20);
    let lookups = env_or("LATTICE_BENCH_DNS_LOOKUPS", 10);
    let scoped = std::env::var("LATTICE_BENCH_SCOPED").map_or(true, |v| v.trim() != "0");
    let envoy = envoy_mode();
    let sources = sources();
    let mut report = serde_json::Map::new();
    for &source in &sources {
        let small = run(source, baseline, clients, sotw, changes, envoy).await;
        println!("{source:?} baseline: {small}");
        let large = run(source, services, clients, sotw, changes, envoy).await;
        println!("{source:?} full: {large}");
        // Only the Kubernetes source has pods, so only it can be scoped.
        let scoped = if scoped && source == Source::Kube {
            let sizes = (scope, lookups);
            let figures = scoped_run(services, clients, sotw, changes, sizes, envoy).await;
            println!("{source:?} scoped: {figures}");
            let empty = envoy.and_then(|_| empty_envoy_rss_mib());
            let ratios = scoped_vs_full(&large, &figures, empty);
            Some((figures, ratios, empty))
        } else {
            None
        };
        let section = section(small, large);
        match source {
            // The Kubernetes source's figures stay at the top, where they have always been.
            Source::Kube => report.extend(section.as_object().cloned().unwrap_or_default()),
            Source::File => {
                report.insert("mesh_file".into(), section);
            }
        }
        if let Some((figures, ratios, empty)) = scoped {
            report.insert("scoped".into(), figures);
            report.insert("scoped_vs_full".into(), ratios);
            report.insert("envoy_rss_empty_mib".into(), empty.into());
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
