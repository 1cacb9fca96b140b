//! `cargo xtask bench` — DNS: dnsperf against the lattice DNS server, unbound and
//! knot, all serving the same 1000 mesh names, each server pinned to core 0 and dnsperf to core 1,
//! in one run. Mesh names are compared across the three; forwarded names (a zone that knot serves
//! as the upstream) between lattice and unbound, both with warm caches.
//!
//! The lattice server is `dns/examples/bench_server.rs` (one thread, one UDP socket), built in
//! release mode (debug for a smoke run). Everything listens on 127.0.0.1 only.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::UdpSocket;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

const NAMES: u32 = 1000;
const SERVER_CORE: &str = "0";
const CLIENT_CORE: &str = "1";

/// Runs the benchmark and returns its figures; `smoke` runs each phase for one second.
pub fn run(smoke: bool) -> anyhow::Result<Value> {
    let seconds = if smoke { 1 } else { 10 };
    let work = crate::WorkDir::new("dns")?;
    let dir = work.path();
    write_files(dir)?;
    // Release for a measurement; debug for a smoke run, which only checks the bench works.
    // `LATTICE_BENCH_DNS_SERVER` names another build of it, such as an older one to compare.
    let bench_server = match std::env::var_os("LATTICE_BENCH_DNS_SERVER") {
        Some(path) => std::path::PathBuf::from(path),
        None => xtask::built_executable("bench_server", !smoke)?,
    };

    let knot_port = free_port()?;
    let knot = Server::start(
        "knot",
        Command::new("knotd")
            .arg("-c")
            .arg(knot_config(dir, knot_port)?),
        knot_port,
    )?;
    let unbound_port = free_port()?;
    let unbound = Server::start(
        "unbound",
        Command::new("unbound")
            .arg("-d")
            .arg("-c")
            .arg(unbound_config(dir, unbound_port, knot_port)?),
        unbound_port,
    )?;
    let lattice_port = free_port()?;
    let lattice = Server::start(
        "lattice",
        Command::new(&bench_server).args([
            "--listen",
            &format!("127.0.0.1:{lattice_port}"),
            "--names",
            &NAMES.to_string(),
            "--upstream",
            &format!("127.0.0.1:{knot_port}"),
        ]),
        lattice_port,
    )?;

    let mesh_queries = dir.join("mesh.queries");
    let forwarded_queries = dir.join("forwarded.queries");
    let mut results = serde_json::Map::new();
    let mut mesh = serde_json::Map::new();
    for server in [&lattice, &unbound, &knot] {
        mesh.insert(
            server.name.into(),
            dnsperf(server, &mesh_queries, seconds, Load::Saturate)?,
        );
    }
    let mut forwarded = serde_json::Map::new();
    for server in [&lattice, &unbound] {
        // One pass to fill the cache, so both serve forwarded names from memory.
        dnsperf_once(server.port, &forwarded_queries)?;
        forwarded.insert(
            server.name.into(),
            dnsperf(server, &forwarded_queries, seconds, Load::Saturate)?,
        );
    }
    // Latency compared at the same offered load: half of the slowest server's saturation rate,
    // so the figures measure service time rather than queueing.
    let slowest = ["lattice", "unbound", "knot"]
        .iter()
        .filter_map(|s| mesh[*s]["qps"].as_f64())
        .fold(f64::INFINITY, f64::min);
    let rate = ((slowest / 2.0) as u64).max(1000);
    // Tail latency moves from run to run on a shared machine: the servers take turns, round
    // after round, and each figure is the median of its rounds.
    let rounds = std::env::var("LATTICE_BENCH_DNS_ROUNDS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(if smoke { 1 } else { 3 })
        .max(1);
    let mut runs: BTreeMap<&str, Vec<Value>> = BTreeMap::new();
    for _ in 0..rounds {
        for server in [&lattice, &unbound, &knot] {
            let run = dnsperf(server, &mesh_queries, seconds.min(5), Load::Rate(rate))?;
            runs.entry(server.name).or_default().push(run);
        }
    }
    let latency: serde_json::Map<String, Value> = runs
        .into_iter()
        .map(|(name, runs)| (name.to_string(), medians(runs)))
        .collect();
    // Forwarded names the same way, from the two caches (warmed again: lattice caps TTLs at
    // 300 s), at half the slower one's saturation rate.
    let forwarded_rate = ((["lattice", "unbound"]
        .iter()
        .filter_map(|s| forwarded[*s]["qps"].as_f64())
        .fold(f64::INFINITY, f64::min)
        / 2.0) as u64)
        .max(1000);
    let mut runs: BTreeMap<&str, Vec<Value>> = BTreeMap::new();
    for _ in 0..rounds {
        for server in [&lattice, &unbound] {
            dnsperf_once(server.port, &forwarded_queries)?;
            let run = dnsperf(
                server,
                &forwarded_queries,
                seconds.min(5),
                Load::Rate(forwarded_rate),
            )?;
            runs.entry(server.name).or_default().push(run);
        }
    }
    let forwarded_latency: serde_json::Map<String, Value> = runs
        .into_iter()
        .map(|(name, runs)| (name.to_string(), medians(runs)))
        .collect();
    // And at saturation, where queueing (in the server or in dnsperf) is part of the figure.
    let mut saturated_latency = serde_json::Map::new();
    for server in [&lattice, &unbound, &knot] {
        saturated_latency.insert(
            server.name.into(),
            dnsperf(server, &mesh_queries, seconds.min(5), Load::SaturateTimed)?,
        );
    }
    let ratio = |section: &serde_json::Map<String, Value>, a: &str, b: &str, key: &str| {
        let (a, b) = (
            section[a][key].as_f64().unwrap_or(0.0),
            section[b][key].as_f64().unwrap_or(0.0),
        );
        if b > 0.0 { json!(a / b) } else { Value::Null }
    };
    results.insert(
        "ratios".into(),
        json!({
            "mesh_qps_lattice_over_unbound": ratio(&mesh, "lattice", "unbound", "qps"),
            "mesh_qps_lattice_over_knot": ratio(&mesh, "lattice", "knot", "qps"),
            "mesh_queries_per_cpu_second_lattice_over_unbound":
                ratio(&mesh, "lattice", "unbound", "queries_per_server_cpu_second"),
            "mesh_queries_per_cpu_second_lattice_over_knot":
                ratio(&mesh, "lattice", "knot", "queries_per_server_cpu_second"),
            "forwarded_qps_lattice_over_unbound": ratio(&forwarded, "lattice", "unbound", "qps"),
            "forwarded_p99_latency_lattice_over_unbound":
                ratio(&forwarded_latency, "lattice", "unbound", "p99_ms"),
            "p99_latency_lattice_over_unbound": ratio(&latency, "lattice", "unbound", "p99_ms"),
            "p99_latency_lattice_over_knot": ratio(&latency, "lattice", "knot", "p99_ms"),
            "saturated_p99_latency_lattice_over_unbound":
                ratio(&saturated_latency, "lattice", "unbound", "p99_ms"),
            "saturated_p99_latency_lattice_over_knot":
                ratio(&saturated_latency, "lattice", "knot", "p99_ms"),
        }),
    );
    results.insert("mesh_names_saturated".into(), Value::Object(mesh));
    results.insert("forwarded_names_saturated".into(), Value::Object(forwarded));
    results.insert(
        format!("mesh_names_latency_at_{rate}_qps"),
        Value::Object(latency),
    );
    results.insert(
        format!("forwarded_names_latency_at_{forwarded_rate}_qps"),
        Value::Object(forwarded_latency),
    );
    results.insert(
        "mesh_names_latency_saturated".into(),
        Value::Object(saturated_latency),
    );
    results.insert(
        "setup".into(),
        json!({
            "names": NAMES,
            "seconds_per_phase": seconds,
            "latency_rounds": rounds,
            "server_core": SERVER_CORE,
            "dnsperf_core": CLIENT_CORE,
            "lattice": format!(
                "dns/examples/bench_server.rs ({}, current-thread runtime, one SO_REUSEPORT socket)",
                if smoke { "debug" } else { "release" }
            ),
            "unbound": "num-threads 1, module-config iterator, local-data for the mesh, forward-zone to knot",
            "knot": "udp-workers 1, zone files for the mesh and the forwarded zone",
            "versions": {
                "unbound": xtask::version_of("unbound", &["-V"]),
                "knot": xtask::version_of("knotd", &["-V"]),
                "dnsperf": xtask::version_of("dnsperf", &["-h"]),
            },
        }),
    );
    drop((lattice, unbound, knot));
    print_table(
        &results,
        &format!("mesh_names_latency_at_{rate}_qps"),
        &format!("forwarded_names_latency_at_{forwarded_rate}_qps"),
    );
    Ok(Value::Object(results))
}

/// The figures as a table: per server, saturated qps for mesh and forwarded names and the
/// latency of mesh names at the common rate; then the ratios.
fn print_table(
    results: &serde_json::Map<String, Value>,
    latency_key: &str,
    forwarded_latency_key: &str,
) {
    let num = |v: &Value, digits: usize| v.as_f64().map_or("-".into(), |x| format!("{x:.digits$}"));
    let header = [
        "mesh qps",
        "server CPU %",
        "mesh q/CPU-s",
        "forwarded qps",
        "mesh p50 ms",
        "mesh p99 ms",
        "mesh p999 ms",
        "sat. p99 ms",
        "sat. lost",
    ];
    println!(
        "{:<8} {}",
        "dns",
        header.map(|h| format!("{h:>13}")).join(" ")
    );
    for server in ["lattice", "unbound", "knot"] {
        let mesh = &results["mesh_names_saturated"][server];
        let latency = &results[latency_key][server];
        let cells = [
            num(&mesh["qps"], 0),
            num(&mesh["server_cpu_percent"], 0),
            num(&mesh["queries_per_server_cpu_second"], 0),
            num(&results["forwarded_names_saturated"][server]["qps"], 0),
            num(&latency["p50_ms"], 3),
            num(&latency["p99_ms"], 3),
            num(&latency["p999_ms"], 3),
            num(
                &results["mesh_names_latency_saturated"][server]["p99_ms"],
                3,
            ),
            num(
                &results["mesh_names_latency_saturated"][server]["queries_lost"],
                0,
            ),
        ];
        println!(
            "{server:<8} {}",
            cells.map(|c| format!("{c:>13}")).join(" ")
        );
    }
    let ratios = &results["ratios"];
    println!(
        "lattice vs unbound: mesh qps {}× (per server CPU-second {}×), forwarded qps {}×, mesh p99 {}×; \
         vs knot: mesh qps {}× (per server CPU-second {}×), mesh p99 {}× (latency at {}, median of \
         the rounds); saturated p99 {}× unbound, {}× knot",
        num(&ratios["mesh_qps_lattice_over_unbound"], 2),
        num(
            &ratios["mesh_queries_per_cpu_second_lattice_over_unbound"],
            2
        ),
        num(&ratios["forwarded_qps_lattice_over_unbound"], 2),
        num(&ratios["p99_latency_lattice_over_unbound"], 2),
        num(&ratios["mesh_qps_lattice_over_knot"], 2),
        num(&ratios["mesh_queries_per_cpu_second_lattice_over_knot"], 2),
        num(&ratios["p99_latency_lattice_over_knot"], 2),
        latency_key
            .trim_start_matches("mesh_names_latency_at_")
            .replace('_', " "),
        num(&ratios["saturated_p99_latency_lattice_over_unbound"], 2),
        num(&ratios["saturated_p99_latency_lattice_over_knot"], 2),
    );
    let forwarded = &results[forwarded_latency_key];
    println!(
        "forwarded names, cached, at {}: p50 / p99 / p999 ms lattice {} / {} / {}, unbound {} / {} / {}; p99 {}× unbound",
        forwarded_latency_key
            .trim_start_matches("forwarded_names_latency_at_")
            .replace('_', " "),
        num(&forwarded["lattice"]["p50_ms"], 3),
        num(&forwarded["lattice"]["p99_ms"], 3),
        num(&forwarded["lattice"]["p999_ms"], 3),
        num(&forwarded["unbound"]["p50_ms"], 3),
        num(&forwarded["unbound"]["p99_ms"], 3),
        num(&forwarded["unbound"]["p999_ms"], 3),
        num(&ratios["forwarded_p99_latency_lattice_over_unbound"], 2),
    );
}

/// A server under test, pinned to the server core, killed on drop.
struct Server {
    name: &'static str,
    port: u16,
    child: Child,
}

impl Server {
    fn start(name: &'static str, command: &mut Command, port: u16) -> anyhow::Result<Self> {
        let program = command.get_program().to_owned();
        let args: Vec<_> = command.get_args().map(ToOwned::to_owned).collect();
        let child = Command::new("taskset")
            .args(["-c", SERVER_CORE])
            .arg(&program)
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {name} ({})", program.to_string_lossy()))?;
        Server::answering(name, child, port)
    }

    /// `child`, once it answers the first mesh name on `port`.
    fn answering(name: &'static str, child: Child, port: u16) -> anyhow::Result<Self> {
        let mut server = Self { name, port, child };
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let probe = lattice_e2e::dig::command()
                .args([
                    "@127.0.0.1",
                    "-p",
                    &port.to_string(),
                    "+tries=1",
                    "+time=1",
                    "svc0.ns0.system.internal",
                ])
                .output()?;
            if String::from_utf8_lossy(&probe.stdout).contains("status: NOERROR") {
                return Ok(server);
            }
            if let Some(status) = server.child.try_wait()? {
                bail!("{name} exited before answering: {status}");
            }
            if Instant::now() > deadline {
                bail!("{name} did not answer svc0.ns0.system.internal on port {port} within 15 s");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(UdpSocket::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn mesh_name(i: u32) -> String {
    format!("svc{i}.ns{}.system.internal", i % 10)
}

fn mesh_addr(i: u32) -> String {
    format!("240.240.{}.{}", i / 250, i % 250 + 1)
}

fn write_files(dir: &Path) -> anyhow::Result<()> {
    let mut mesh_zone = String::from(
        "$ORIGIN system.internal.\n$TTL 30\n@ SOA ns hostmaster 1 3600 600 86400 30\n@ NS ns\nns A 127.0.0.1\n",
    );
    let mut forwarded_zone = String::from(
        "$ORIGIN bench.example.\n$TTL 3600\n@ SOA ns hostmaster 1 3600 600 86400 300\n@ NS ns\nns A 127.0.0.1\n",
    );
    let (mut mesh_queries, mut forwarded_queries) = (String::new(), String::new());
    for i in 0..NAMES {
        writeln!(mesh_zone, "{}. A {}", mesh_name(i), mesh_addr(i))?;
        writeln!(forwarded_zone, "host{i} A 192.0.2.{}", i % 250 + 1)?;
        writeln!(mesh_queries, "{} A", mesh_name(i))?;
        writeln!(forwarded_queries, "host{i}.bench.example A")?;
    }
    std::fs::write(dir.join("system.internal.zone"), mesh_zone)?;
    std::fs::write(dir.join("bench.example.zone"), forwarded_zone)?;
    std::fs::write(dir.join("mesh.queries"), mesh_queries)?;
    std::fs::write(dir.join("forwarded.queries"), forwarded_queries)?;
    Ok(())
}

fn knot_config(dir: &Path, port: u16) -> anyhow::Result<PathBuf> {
    let d = dir.display();
    let text = format!(
        "server:\n    listen: 127.0.0.1@{port}\n    rundir: {d}\n    user: root:root\n    udp-workers: 1\n    tcp-workers: 1\n    background-workers: 1\n\
         database:\n    storage: {d}\n\
         log:\n  - target: stderr\n    any: warning\n\
         zone:\n  - domain: system.internal\n    file: {d}/system.internal.zone\n  - domain: bench.example\n    file: {d}/bench.example.zone\n"
    );
    let path = dir.join("knot.conf");
    std::fs::write(&path, text)?;
    Ok(path)
}

fn unbound_config(dir: &Path, port: u16, upstream_port: u16) -> anyhow::Result<PathBuf> {
    let mut text = format!(
        "server:\n  interface: 127.0.0.1@{port}\n  port: {port}\n  do-ip6: no\n  do-daemonize: no\n  chroot: \"\"\n  username: \"\"\n  directory: \"{d}\"\n  pidfile: \"\"\n  use-syslog: no\n  logfile: \"\"\n  verbosity: 0\n  num-threads: 1\n  module-config: \"iterator\"\n  access-control: 127.0.0.0/8 allow\n  do-not-query-localhost: no\n  qname-minimisation: no\n  local-zone: \".\" refuse\n  local-zone: \"bench.example.\" transparent\n  local-zone: \"system.internal.\" static\n  local-data: \"system.internal. 30 IN SOA ns.system.internal. hostmaster.system.internal. 1 3600 600 86400 30\"\n",
        d = dir.display()
    );
    for i in 0..NAMES {
        writeln!(
            text,
            "  local-data: \"{}. 30 IN A {}\"",
            mesh_name(i),
            mesh_addr(i)
        )?;
    }
    write!(
        text,
        "forward-zone:\n  name: \"bench.example.\"\n  forward-addr: 127.0.0.1@{upstream_port}\nremote-control:\n  control-enable: no\n"
    )?;
    let path = dir.join("unbound.conf");
    std::fs::write(&path, text)?;
    Ok(path)
}

fn dnsperf_command(port: u16, queries: &Path) -> Command {
    let mut command = Command::new("taskset");
    command
        .args([
            "-c",
            CLIENT_CORE,
            "dnsperf",
            "-s",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-d",
        ])
        .arg(queries)
        .args(["-c", "20", "-q", "500", "-t", "2"]);
    command
}

fn dnsperf_once(port: u16, queries: &Path) -> anyhow::Result<()> {
    let status = dnsperf_command(port, queries)
        .args(["-n", "1"])
        .stdout(Stdio::null())
        .status()?;
    anyhow::ensure!(
        status.success(),
        "dnsperf warm-up against port {port} failed"
    );
    Ok(())
}

/// CPU time a process has used so far, in seconds: the run time of all its threads, from
/// `/proc/<pid>/task/*/schedstat` (nanoseconds).
fn cpu_seconds(pid: u32) -> Option<f64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut nanos = 0u64;
    for task in tasks.flatten() {
        let schedstat = std::fs::read_to_string(task.path().join("schedstat")).ok()?;
        nanos += schedstat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(nanos as f64 / 1e9)
}

/// How hard a dnsperf run pushes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Load {
    /// As fast as dnsperf goes: queries per second.
    Saturate,
    /// As fast as dnsperf goes, with each query's latency (`-v`, which costs dnsperf some of
    /// its rate): the tail under saturation.
    SaturateTimed,
    /// This many queries per second, with each query's latency.
    Rate(u64),
}

/// Per figure, the median of the runs' values; the runs themselves under `rounds`.
fn medians(runs: Vec<Value>) -> Value {
    let mut result = serde_json::Map::new();
    for key in ["p50_ms", "p99_ms", "p999_ms", "qps", "offered_qps"] {
        let mut values: Vec<f64> = runs.iter().filter_map(|r| r[key].as_f64()).collect();
        values.sort_by(f64::total_cmp);
        if !values.is_empty() {
            result.insert(key.into(), json!(values[values.len() / 2]));
        }
    }
    result.insert("rounds".into(), Value::Array(runs));
    Value::Object(result)
}

/// One dnsperf run against `server`: saturating (`rate` None) or at a fixed rate with
/// per-query latencies (`-v`), from which the percentiles come. Also how busy the server's
/// core was: if well under 100% while saturating, dnsperf on its one core was the limit, and
/// the queries answered per CPU-second of the server compare the servers' efficiency.
fn dnsperf(server: &Server, queries: &Path, seconds: u64, load: Load) -> anyhow::Result<Value> {
    let port = server.port;
    let mut command = dnsperf_command(port, queries);
    command.args(["-l", &seconds.to_string()]);
    match load {
        Load::Saturate => {}
        Load::SaturateTimed => {
            command.arg("-v");
        }
        Load::Rate(rate) => {
            command.args(["-Q", &rate.to_string(), "-v"]);
        }
    }
    let cpu_before = cpu_seconds(server.child.id());
    let output = command
        .output()
        .context("running dnsperf (apt install dnsperf)")?;
    let server_cpu = cpu_seconds(server.child.id())
        .zip(cpu_before)
        .map(|(after, before)| after - before);
    let text = String::from_utf8_lossy(&output.stdout);
    anyhow::ensure!(
        output.status.success(),
        "dnsperf against port {port} failed:\n{text}"
    );
    let field = |label: &str| -> Option<f64> {
        let line = text.lines().find(|l| l.trim_start().starts_with(label))?;
        line.split(':')
            .nth(1)?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    let completed = field("Queries completed");
    // The load lasts dnsperf's run time; the wait for lost queries after it is idle.
    let run_time = field("Run time (s)").unwrap_or(seconds as f64);
    let mut result = json!({
        "qps": field("Queries per second"),
        "avg_latency_ms": field("Average Latency (s)").map(|s| s * 1000.0),
        "queries_completed": completed,
        "queries_lost": field("Queries lost"),
        "server_cpu_percent": server_cpu.map(|cpu| cpu / run_time * 100.0),
        "queries_per_server_cpu_second": completed
            .zip(server_cpu)
            .filter(|(_, cpu)| *cpu > 0.0)
            .map(|(queries, cpu)| queries / cpu),
    });
    if load != Load::Saturate {
        let mut latencies: Vec<f64> = text
            .lines()
            .filter(|l| l.starts_with("> "))
            .filter_map(|l| l.split_whitespace().last()?.parse().ok())
            .collect();
        latencies.sort_by(f64::total_cmp);
        let percentile = |p: f64| -> Option<f64> {
            let last = latencies.len().checked_sub(1)?;
            Some(latencies[((last as f64) * p).round() as usize] * 1000.0)
        };
        if let Load::Rate(rate) = load {
            result["offered_qps"] = json!(rate);
        }
        result["p50_ms"] = json!(percentile(0.50));
        result["p99_ms"] = json!(percentile(0.99));
        result["p999_ms"] = json!(percentile(0.999));
    }
    Ok(result)
}

// ---------------------------------------------------------------------------------------------
// DNS during a large translation (`--only translate`). Self-contained below this line: its own
// helpers (fmt, env_or, free_tcp_port, logged_translations); it shares only Server, dnsperf,
// medians, mesh_name, NAMES, free_port and Load with the comparison above.
// ---------------------------------------------------------------------------------------------

/// `cargo xtask bench --only translate`: the real agent's DNS latency while it translates a
/// 10k-service mesh, against the same agent quiet, in one run. The agent (release; debug for a
/// smoke run; `LATTICE_BENCH_AGENT` names another binary, such as an older build to compare
/// with) serves a mesh file of `services` HTTP services; dnsperf asks 1000 of their names at a
/// fixed rate, in turns: quiet, then while the file is rewritten every `REWRITE` with every
/// service's port changed (so each rewrite makes the agent parse, merge and translate every
/// service anew: clusters, endpoints, the listener, the routes and the name table), and so on
/// for `rounds` rounds. Each figure is the median of the rounds. Everything listens on
/// 127.0.0.1 only; the agent's upstream DNS is an address nothing listens on.
pub fn during_translation(smoke: bool) -> anyhow::Result<Value> {
    const REWRITE: Duration = Duration::from_millis(500);
    let services: usize = env_or(
        "LATTICE_BENCH_TRANSLATE_SERVICES",
        if smoke { 1000 } else { 10_000 },
    );
    let seconds: u64 = env_or(
        "LATTICE_BENCH_TRANSLATE_SECONDS",
        if smoke { 2 } else { 10 },
    );
    let rounds: usize = env_or("LATTICE_BENCH_TRANSLATE_ROUNDS", if smoke { 1 } else { 3 });
    let rate: u64 = env_or("LATTICE_BENCH_TRANSLATE_QPS", 2000);
    let agent_binary = match std::env::var_os("LATTICE_BENCH_AGENT") {
        Some(path) => PathBuf::from(path),
        None => xtask::built_executable("lattice-agent", !smoke)?,
    };
    let work = crate::WorkDir::new("translate")?;
    let dir = work.path();
    let mesh = dir.join("mesh.yaml");
    let write_mesh = |port: u16| -> anyhow::Result<()> {
        let mut text = String::from("services:\n");
        for i in 0..services {
            let i = u32::try_from(i)?;
            writeln!(
                text,
                "  - path: /ns{}/svc{i}\n    ports:\n      - {{port: {port}, protocol: http}}\n    endpoints:\n      - address: 10.1.{}.{}",
                i % 10,
                i / 250 % 250,
                i % 250 + 1
            )?;
        }
        let tmp = dir.join("mesh.tmp");
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, &mesh)?;
        Ok(())
    };
    write_mesh(8080)?;
    let queries = dir.join("mesh.queries");
    let names: String = (0..NAMES.min(u32::try_from(services)?))
        .map(|i| format!("{} A\n", mesh_name(i)))
        .collect();
    std::fs::write(&queries, names)?;

    let [dns_port, xds_port, admin_port] = [free_port()?, free_tcp_port()?, free_tcp_port()?];
    let log_path = dir.join("agent.log");
    // Not pinned: the agent's threads (the runtime's workers, the translators) use both cores,
    // as on a node.
    let child = Command::new(&agent_binary)
        .arg("--mesh-file")
        .arg(&mesh)
        .arg(format!("--dns-addr=127.0.0.1:{dns_port}"))
        .arg(format!("--xds-addr=127.0.0.1:{xds_port}"))
        .arg(format!("--admin-addr=127.0.0.1:{admin_port}"))
        .arg("--upstream-dns=127.0.0.1:9")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path)?)
        .spawn()
        .with_context(|| format!("starting {}", agent_binary.display()))?;
    let agent = Server::answering("lattice-agent", child, dns_port)?;

    let mut quiet_runs = Vec::new();
    let mut busy_runs = Vec::new();
    let mut translations = Vec::new();
    for _ in 0..rounds {
        quiet_runs.push(dnsperf(&agent, &queries, seconds, Load::Rate(rate))?);
        let log_before = std::fs::metadata(&log_path).map(|m| m.len()).unwrap_or(0);
        let stop = std::sync::atomic::AtomicBool::new(false);
        let busy = std::thread::scope(|scope| -> anyhow::Result<Value> {
            let writer = scope.spawn(|| -> anyhow::Result<usize> {
                let mut rewrites = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    write_mesh(if rewrites % 2 == 0 { 8081 } else { 8080 })?;
                    rewrites += 1;
                    std::thread::sleep(REWRITE);
                }
                // Back to the quiet mesh's shape.
                if rewrites % 2 == 1 {
                    write_mesh(8080)?;
                }
                Ok(rewrites)
            });
            let run = dnsperf(&agent, &queries, seconds, Load::Rate(rate));
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            writer
                .join()
                .map_err(|_| anyhow::anyhow!("the mesh file writer panicked"))??;
            run
        })?;
        busy_runs.push(busy);
        translations.extend(logged_translations(&log_path, log_before)?);
        // The next quiet phase starts once the last rewrite is translated: no new log line
        // for twice the longest translation seen (a debug build's take seconds).
        let longest = translations
            .iter()
            .map(|(_, ms)| *ms)
            .fold(1000.0, f64::max);
        settle(&log_path, Duration::from_secs_f64(2.0 * longest / 1000.0))?;
    }
    drop(agent);
    let (quiet, busy) = (medians(quiet_runs), medians(busy_runs));
    let ratio = |key: &str| {
        let (q, b) = (
            quiet[key].as_f64().unwrap_or(0.0),
            busy[key].as_f64().unwrap_or(0.0),
        );
        if q > 0.0 { json!(b / q) } else { Value::Null }
    };
    let large: Vec<f64> = translations
        .iter()
        .filter(|(count, _)| *count == services)
        .map(|(_, ms)| *ms)
        .collect();
    let mean = |values: &[f64]| {
        (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
    };
    let report = json!({
        "services": services,
        "offered_qps": rate,
        "seconds_per_phase": seconds,
        "rounds": rounds,
        "rewrite_every_ms": REWRITE.as_millis(),
        "agent": agent_binary.display().to_string(),
        "quiet": quiet,
        "during_translation": busy,
        "p99_during_over_quiet": ratio("p99_ms"),
        "p999_during_over_quiet": ratio("p999_ms"),
        "translations_of_every_service": large.len(),
        "translate_ms_mean": mean(&large),
        "translate_ms_max": large.iter().copied().fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x)))),
    });
    println!(
        "dns during a {services}-service translation: p99 {} ms quiet, {} ms during ({}×); p99.9 {} ms, {} ms ({}×); {} translations of every service, {} ms each on average",
        fmt(&quiet["p99_ms"], 3),
        fmt(&busy["p99_ms"], 3),
        fmt(&report["p99_during_over_quiet"], 2),
        fmt(&quiet["p999_ms"], 3),
        fmt(&busy["p999_ms"], 3),
        fmt(&report["p999_during_over_quiet"], 2),
        large.len(),
        fmt(&report["translate_ms_mean"], 1),
    );
    Ok(report)
}

fn fmt(value: &Value, digits: usize) -> String {
    value
        .as_f64()
        .map_or("-".into(), |x| format!("{x:.digits$}"))
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn free_tcp_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The agent's "serving mesh snapshot" lines written after `from` bytes of its log: (services,
/// translate_ms) of each.
fn logged_translations(log: &Path, from: u64) -> anyhow::Result<Vec<(usize, f64)>> {
    let text = std::fs::read(log)?;
    let from = usize::try_from(from)?.min(text.len());
    let field = |line: &str, key: &str| -> Option<String> {
        let rest = line.split(&format!("{key}=")).nth(1)?;
        rest.split_whitespace().next().map(str::to_string)
    };
    Ok(String::from_utf8_lossy(&text[from..])
        .lines()
        .filter(|l| l.contains("serving mesh snapshot"))
        .filter_map(|l| {
            let l = lattice_e2e::agent::without_colours(l);
            let l = l.as_str();
            Some((
                field(l, "services")?.parse().ok()?,
                field(l, "translate_ms")?.parse().ok()?,
            ))
        })
        .collect())
}

/// Waits until the agent's log has not grown for `window`: its last change is applied.
fn settle(log: &Path, window: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut size = std::fs::metadata(log)?.len();
    loop {
        std::thread::sleep(window);
        let now = std::fs::metadata(log)?.len();
        if now == size {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the agent never settled; see {}",
            log.display()
        );
        size = now;
    }
}
