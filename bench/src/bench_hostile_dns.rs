//! The DNS half of `cargo xtask bench --only hostile`: the real agent (release; debug for a
//! smoke run) serving 10k mesh services from a mesh file, with two upstreams: one dead (a
//! socket that reads nothing, listed first) and one the benchmark answers from or blackholes.
//! Pods are loopback source addresses. In one run:
//!
//! - **quiet**: a pod's mesh-name queries over UDP and over TCP, the latency of each;
//! - **attack elsewhere**: the same attack (below) aimed at a second agent, the bystander, while
//!   the pod asks the first: what the attacker's threads and the bystander's work cost the
//!   pod's queries through the shared cores alone;
//! - **attack**: another address opens 5000 TCP connections and leaves them idle (more than
//!   the agent's caps allow: it closes what is over) and floods names no cache holds while the
//!   live upstream is blackholed too; the pod's mesh-name queries again, each answered or
//!   counted lost;
//! - **recovery**: the upstream answers again while the flood goes on: the time until a third
//!   pod's forwarded name is answered, and how many of its next ones are;
//! - **a dead upstream's cost**: a cache miss's latency with the dead upstream listed first,
//!   against the bystander, which lists only the live one.
//!
//! `LATTICE_BENCH_AGENT` names another agent binary (an older build to compare with);
//! `LATTICE_BENCH_HOSTILE_DNS_QUERIES` how many queries each figure takes (2000; 200 smoke).

use std::io::{self, Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd as _, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::bail;
use lattice_e2e::dns_load::{Upstream, query};
use nix::sys::socket::{
    AddressFamily, SockFlag, SockType, SockaddrIn, bind, connect, setsockopt, socket, sockopt,
};
use nix::sys::time::TimeVal;
use serde_json::{Value, json};

use lattice_e2e::agent::Agent;

/// The pod whose mesh-name queries are timed.
const POD: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
/// The pod whose forwarded names are timed.
const FORWARDING_POD: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);
/// The hostile pod.
const ATTACKER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 66);
/// How long a query is waited for before it counts as lost.
const QUERY_TIMEOUT: Duration = Duration::from_secs(2);

struct Sizes {
    services: u32,
    idle_tcp: usize,
    flood_qps: u64,
    queries: usize,
}

pub fn run(smoke: bool) -> anyhow::Result<Value> {
    let mut sizes = if smoke {
        Sizes {
            services: 100,
            idle_tcp: 200,
            flood_qps: 1_000,
            queries: 200,
        }
    } else {
        Sizes {
            services: 10_000,
            idle_tcp: 5_000,
            flood_qps: 10_000,
            queries: 2_000,
        }
    };
    if let Some(queries) = std::env::var("LATTICE_BENCH_HOSTILE_DNS_QUERIES")
        .ok()
        .and_then(|q| q.parse().ok())
    {
        sizes.queries = queries;
    }
    let binary = match std::env::var_os("LATTICE_BENCH_AGENT") {
        Some(path) => std::path::PathBuf::from(path),
        None => xtask::built_executable("lattice-agent", !smoke)?,
    };
    let work = crate::WorkDir::new("hostile-dns")?;
    let file = work.path().join("mesh.yaml");
    std::fs::write(&file, mesh(sizes.services))?;
    let file = file.to_string_lossy().into_owned();
    let names: Vec<String> = (0..sizes.services)
        .map(|i| format!("s{i}.hostile.system.internal"))
        .collect();
    // A dead upstream: its socket is bound (so nothing answers "port unreachable") and never read.
    let dead = UdpSocket::bind("127.0.0.1:0")?;
    let dead = dead.local_addr()?;
    let live = Upstream::start(None, "127.0.0.1:0".parse()?)?;

    // Also the bystander: the agent the same attack is aimed at while the pod asks the other,
    // so the machine's share of the slowdown (the attacker's threads and the bystander's work
    // on the same cores) is measured apart from the attacked server's.
    let start = |upstreams: String| {
        Agent::start_binary(
            &binary,
            &["--mesh-file", &file, &format!("--upstream-dns={upstreams}")],
        )
    };
    let bystander = start(live.addr.to_string());
    bystander.wait_ready()?;
    let live_only = forwarded(bystander.dns, FORWARDING_POD, 0, sizes.queries)?;
    let agent = start(format!("{dead},{}", live.addr));
    agent.wait_ready()?;
    let dead_first = forwarded(agent.dns, FORWARDING_POD, 1_000_000, sizes.queries)?;
    let quiet = mesh_queries(agent.dns, &names, sizes.queries)?;
    let rss_quiet = rss_mib(&agent);

    live.mute(true);
    let elsewhere = {
        let attack = Attack::start(bystander.dns, &sizes)?;
        let measured = mesh_queries(agent.dns, &names, sizes.queries)?;
        attack.stop();
        measured
    };
    drop(bystander);
    let attack = Attack::start(agent.dns, &sizes)?;
    let under_attack = mesh_queries(agent.dns, &names, sizes.queries)?;
    let blackholed = forwarded_once(agent.dns, FORWARDING_POD, 2_000_000)?;
    let rss_attack = rss_mib(&agent);
    live.mute(false);
    let recovery = recover(agent.dns, sizes.queries)?;
    let attacker = attack.stop();
    let (_, metrics) = agent.get("/metrics")?;
    let lines =
        |prefix: &str| -> Vec<&str> { metrics.lines().filter(|l| l.starts_with(prefix)).collect() };
    let limited = lines("lattice_dns_limited");
    let closed = lines("lattice_dns_tcp_closed");

    let ratio = |a: &Value, b: &Value| match (a.as_f64(), b.as_f64()) {
        (Some(a), Some(b)) if b > 0.0 => json!(a / b),
        _ => Value::Null,
    };
    let report = json!({
        "services": sizes.services,
        "attack": {
            "idle_tcp_connections": sizes.idle_tcp,
            "flood_qps": sizes.flood_qps,
            "attacker": attacker,
        },
        "mesh_names": {
            "quiet": quiet,
            "under_attack": under_attack,
            "attack_elsewhere": elsewhere,
            "udp_p99_ratio": ratio(&under_attack["udp"]["p99_ms"], &quiet["udp"]["p99_ms"]),
            "tcp_p99_ratio": ratio(&under_attack["tcp"]["p99_ms"], &quiet["tcp"]["p99_ms"]),
            "udp_p99_ratio_elsewhere": ratio(&elsewhere["udp"]["p99_ms"], &quiet["udp"]["p99_ms"]),
            "tcp_p99_ratio_elsewhere": ratio(&elsewhere["tcp"]["p99_ms"], &quiet["tcp"]["p99_ms"]),
        },
        "forwarded": {
            "while_blackholed": blackholed,
            "recovery": recovery,
            "miss_live_only": live_only,
            "miss_dead_upstream_first": dead_first,
            "miss_p50_ratio": ratio(&dead_first["p50_ms"], &live_only["p50_ms"]),
            "miss_p99_ratio": ratio(&dead_first["p99_ms"], &live_only["p99_ms"]),
        },
        "agent_rss_mib": { "quiet": rss_quiet, "under_attack": rss_attack },
        "limited": limited,
        "tcp_closed": closed,
    });
    print_summary(&report);
    Ok(report)
}

/// The agent's resident set, MiB.
fn rss_mib(agent: &Agent) -> Option<f64> {
    lattice_e2e::procstat::rss_mib(agent.pid()?)
}

fn mesh(services: u32) -> String {
    let mut text = String::from("services:\n");
    for i in 0..services {
        text.push_str(&format!(
            "  - path: /hostile/s{i}\n    ports:\n      - port: 80\n"
        ));
    }
    text
}

fn print_summary(r: &Value) {
    let f = |v: &Value| v.as_f64().map_or("-".into(), |x| format!("{x:.2}"));
    let m = &r["mesh_names"];
    let fw = &r["forwarded"];
    println!(
        "DNS, {} services, {} idle TCP connections and {} qps of uncached names from one \
         address: mesh names answered UDP {}/{} TCP {}/{}; p99 UDP {} ms quiet, {} under attack \
         ({}x); TCP {} ms, {} ({}x); with the attack aimed at another agent: UDP {} ms ({}x), \
         TCP {} ms ({}x)",
        r["services"],
        r["attack"]["idle_tcp_connections"],
        r["attack"]["flood_qps"],
        m["under_attack"]["udp"]["answered"],
        m["under_attack"]["udp"]["asked"],
        m["under_attack"]["tcp"]["answered"],
        m["under_attack"]["tcp"]["asked"],
        f(&m["quiet"]["udp"]["p99_ms"]),
        f(&m["under_attack"]["udp"]["p99_ms"]),
        f(&m["udp_p99_ratio"]),
        f(&m["quiet"]["tcp"]["p99_ms"]),
        f(&m["under_attack"]["tcp"]["p99_ms"]),
        f(&m["tcp_p99_ratio"]),
        f(&m["attack_elsewhere"]["udp"]["p99_ms"]),
        f(&m["udp_p99_ratio_elsewhere"]),
        f(&m["attack_elsewhere"]["tcp"]["p99_ms"]),
        f(&m["tcp_p99_ratio_elsewhere"]),
    );
    println!(
        "DNS forwarding: answered {} s after the upstream came back, then {}/{}; a miss with a \
         dead upstream listed first p50 {} ms p99 {} ms against {} / {} ms with the live one \
         alone ({}x, {}x)",
        f(&fw["recovery"]["first_answer_s"]),
        fw["recovery"]["answered"],
        fw["recovery"]["asked"],
        f(&fw["miss_dead_upstream_first"]["p50_ms"]),
        f(&fw["miss_dead_upstream_first"]["p99_ms"]),
        f(&fw["miss_live_only"]["p50_ms"]),
        f(&fw["miss_live_only"]["p99_ms"]),
        f(&fw["miss_p50_ratio"]),
        f(&fw["miss_p99_ratio"]),
    );
}

/// What a run of queries saw: how many were asked and answered, and the answered ones'
/// latency quantiles.
fn summary(asked: usize, mut latencies: Vec<Duration>) -> Value {
    latencies.sort_unstable();
    let at = |q: f64| {
        latencies
            .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
            .map(|d| d.as_secs_f64() * 1000.0)
    };
    json!({
        "asked": asked,
        "answered": latencies.len(),
        "p50_ms": at(0.50),
        "p99_ms": at(0.99),
        "max_ms": latencies.last().map(|d| d.as_secs_f64() * 1000.0),
    })
}

/// A reply's rcode and answer count, if `reply` answers query `id`.
fn reply_to(reply: &[u8], id: u16) -> Option<(u8, u16)> {
    if reply.len() < 12 || u16::from_be_bytes([reply[0], reply[1]]) != id {
        return None;
    }
    Some((reply[3] & 0x0f, u16::from_be_bytes([reply[6], reply[7]])))
}

/// Sends `name` from `socket` and waits for its reply; `None` when none came in time.
fn ask_udp(socket: &UdpSocket, id: u16, name: &str) -> anyhow::Result<Option<(u8, u16)>> {
    socket.send(&query(id, name)?)?;
    let deadline = Instant::now() + QUERY_TIMEOUT;
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(None);
        }
        socket.set_read_timeout(Some(left))?;
        match socket.recv(&mut buf) {
            // A late reply to an earlier query is skipped.
            Ok(len) => {
                if let Some(reply) = reply_to(&buf[..len], id) {
                    return Ok(Some(reply));
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
        }
    }
}

fn udp_from(source: Ipv4Addr, server: SocketAddr) -> anyhow::Result<UdpSocket> {
    let socket = UdpSocket::bind(SocketAddrV4::new(source, 0))?;
    socket.connect(server)?;
    Ok(socket)
}

/// A TCP connection from `source` (a pod's address on loopback) to `server`.
fn tcp_from(source: Ipv4Addr, server: SocketAddr) -> io::Result<TcpStream> {
    let SocketAddr::V4(server) = server else {
        return Err(io::ErrorKind::Unsupported.into());
    };
    let fd: OwnedFd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    // connect(2) gives up after SO_SNDTIMEO: a full accept queue must not hang the benchmark.
    setsockopt(&fd, sockopt::SendTimeout, &TimeVal::new(2, 0))?;
    bind(
        fd.as_raw_fd(),
        &SockaddrIn::from(SocketAddrV4::new(source, 0)),
    )?;
    connect(fd.as_raw_fd(), &SockaddrIn::from(server))?;
    Ok(TcpStream::from(fd))
}

/// One query over `stream`, framed as RFC 1035 §4.2.2 says; `None` when no reply came in time.
fn ask_tcp(stream: &mut TcpStream, id: u16, name: &str) -> io::Result<Option<(u8, u16)>> {
    let message = query(id, name)?;
    let mut framed = (message.len() as u16).to_be_bytes().to_vec();
    framed.extend_from_slice(&message);
    stream.set_read_timeout(Some(QUERY_TIMEOUT))?;
    stream.write_all(&framed)?;
    let mut len = [0u8; 2];
    match stream.read_exact(&mut len) {
        Ok(()) => {}
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            return Ok(None);
        }
        Err(e) => return Err(e),
    }
    let mut reply = vec![0u8; usize::from(u16::from_be_bytes(len))];
    stream.read_exact(&mut reply)?;
    Ok(reply_to(&reply, id))
}

/// `count` mesh-name queries from [`POD`] over UDP, then over one TCP connection (opened again
/// if the server closes it, which is counted).
fn mesh_queries(server: SocketAddr, names: &[String], count: usize) -> anyhow::Result<Value> {
    let answered = |reply: Option<(u8, u16)>| matches!(reply, Some((0, n)) if n > 0);
    let udp = udp_from(POD, server)?;
    let mut latencies = Vec::with_capacity(count);
    for i in 0..count {
        let started = Instant::now();
        if answered(ask_udp(&udp, i as u16, &names[i % names.len()])?) {
            latencies.push(started.elapsed());
        }
    }
    let udp = summary(count, latencies);

    let mut latencies = Vec::with_capacity(count);
    let mut reopened = 0;
    let mut stream = tcp_from(POD, server)?;
    for i in 0..count {
        let name = &names[(i * 7) % names.len()];
        let started = Instant::now();
        let reply = match ask_tcp(&mut stream, i as u16, name) {
            Ok(reply) => reply,
            // Closed by the server (idle or lifetime limit): a client opens another.
            Err(_) => {
                reopened += 1;
                stream = tcp_from(POD, server)?;
                ask_tcp(&mut stream, i as u16, name).unwrap_or(None)
            }
        };
        if answered(reply) {
            latencies.push(started.elapsed());
        }
    }
    let mut tcp = summary(count, latencies);
    tcp["reopened"] = json!(reopened);
    Ok(json!({ "udp": udp, "tcp": tcp }))
}

/// `count` forwarded names (each new, so each a cache miss) from `source`.
fn forwarded(
    server: SocketAddr,
    source: Ipv4Addr,
    first: u32,
    count: usize,
) -> anyhow::Result<Value> {
    let socket = udp_from(source, server)?;
    let mut latencies = Vec::with_capacity(count);
    for i in 0..count as u32 {
        let started = Instant::now();
        if let Some((0, n)) = ask_udp(&socket, i as u16, &format!("q{}.example.test", first + i))?
            && n > 0
        {
            latencies.push(started.elapsed());
        }
    }
    Ok(summary(count, latencies))
}

/// One forwarded name while no upstream answers: the reply (SERVFAIL is the right one) and
/// how long it took.
fn forwarded_once(server: SocketAddr, source: Ipv4Addr, k: u32) -> anyhow::Result<Value> {
    let socket = udp_from(source, server)?;
    let started = Instant::now();
    let reply = ask_udp(&socket, 7, &format!("q{k}.example.test"))?;
    Ok(json!({
        "rcode": reply.map(|(rcode, _)| rcode),
        "seconds": started.elapsed().as_secs_f64(),
    }))
}

/// From the moment the upstream answers again: the time until a forwarded name from
/// [`FORWARDING_POD`] is answered, then how many of the next `count` are.
fn recover(server: SocketAddr, count: usize) -> anyhow::Result<Value> {
    let socket = udp_from(FORWARDING_POD, server)?;
    let started = Instant::now();
    let mut k = 3_000_000u32;
    let first = loop {
        k += 1;
        if let Some((0, n)) = ask_udp(&socket, k as u16, &format!("q{k}.example.test"))?
            && n > 0
        {
            break started.elapsed();
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!("no forwarded name answered within 60 s of the upstream's return");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let after = forwarded(server, FORWARDING_POD, k + 1, count)?;
    Ok(json!({
        "first_answer_s": first.as_secs_f64(),
        "asked": after["asked"],
        "answered": after["answered"],
        "p99_ms": after["p99_ms"],
    }))
}

/// The hostile pod: idle TCP connections held open, and a flood of uncached names over UDP.
struct Attack {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    flood: Option<JoinHandle<()>>,
    connections: Vec<TcpStream>,
    refused: usize,
}

impl Attack {
    fn start(server: SocketAddr, sizes: &Sizes) -> anyhow::Result<Attack> {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let socket = UdpSocket::bind(SocketAddrV4::new(ATTACKER, 0))?;
        socket.connect(server)?;
        socket.set_nonblocking(true)?;
        let (stopping, counter, qps) = (stop.clone(), sent.clone(), sizes.flood_qps);
        let nice = lattice_e2e::procstat::attackers_nice();
        let flood = std::thread::spawn(move || {
            lattice_e2e::procstat::lower_priority(nice);
            let started = Instant::now();
            let mut k = 0u64;
            let mut buf = [0u8; 4096];
            while !stopping.load(Ordering::Relaxed) {
                // Paced to `qps`, in steps of a millisecond.
                let due = started.elapsed().as_secs_f64() * qps as f64;
                while (k as f64) < due {
                    if let Ok(q) = query(k as u16, &format!("f{k}.flood.test")) {
                        let _ = socket.send(&q);
                    }
                    k += 1;
                }
                counter.store(k, Ordering::Relaxed);
                while socket.recv(&mut buf).is_ok() {}
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        let mut connections = Vec::with_capacity(sizes.idle_tcp);
        let mut refused = 0;
        for _ in 0..sizes.idle_tcp {
            match tcp_from(ATTACKER, server) {
                Ok(stream) => connections.push(stream),
                Err(_) => refused += 1,
            }
        }
        // Let the flood fill the forwarder's budget before anything is measured.
        std::thread::sleep(Duration::from_secs(1));
        Ok(Attack {
            stop,
            sent,
            flood: Some(flood),
            connections,
            refused,
        })
    }

    /// Stops the flood; how many connections the agent still holds open for the attacker.
    fn stop(mut self) -> Value {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(flood) = self.flood.take() {
            let _ = flood.join();
        }
        let mut open = 0;
        for stream in &self.connections {
            let _ = stream.set_nonblocking(true);
            let mut byte = [0u8; 1];
            if matches!(stream.peek(&mut byte), Err(e) if e.kind() == io::ErrorKind::WouldBlock) {
                open += 1;
            }
        }
        json!({
            "connections_made": self.connections.len(),
            "connections_failed": self.refused,
            "connections_still_open": open,
            "flood_queries_sent": self.sent.load(Ordering::Relaxed),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_matched_to_their_query() {
        let mut reply = query(42, "a.example.test").unwrap();
        reply[3] = 0x02; // SERVFAIL
        assert_eq!(reply_to(&reply, 42), Some((2, 0)));
        assert_eq!(reply_to(&reply, 43), None);
        assert_eq!(reply_to(&reply[..5], 42), None);
    }

    #[test]
    fn quantiles_come_from_the_answered_queries() {
        let latencies = (1..=100).map(Duration::from_millis).collect();
        let s = summary(120, latencies);
        assert_eq!(s["asked"], 120);
        assert_eq!(s["answered"], 100);
        assert_eq!(s["p50_ms"], 51.0);
        assert_eq!(s["p99_ms"], 100.0);
    }
}
