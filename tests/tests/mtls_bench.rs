//! What mesh mTLS costs beside plaintext, through real Envoys on the simulated node (figures
//! printed, never asserted): one meshed pod calls another, permissive, through two services
//! of the mesh file that reach the same pod, one of them naming its identity (mTLS) and the
//! other not (plaintext through the same inbound listener). Two loads, each a closed loop
//! from the calling pod (one request at a time, as fast as it goes), alternating plaintext and
//! mTLS for `LATTICE_BENCH_MTLS_ROUNDS` (2) rounds of `LATTICE_BENCH_MTLS_SECONDS` (5) each:
//!
//! - **requests**: HTTP over one kept-alive connection to the caller's Envoy, whose
//!   connection to the callee's Envoy is pooled: the cost of encrypting requests;
//! - **connections**: a new TCP connection per exchange (an echo), so a new upstream
//!   connection each time: the cost of a handshake. Paced at one every
//!   `LATTICE_BENCH_MTLS_CONNECT_EVERY_MS` (4): one pod opening connections to one other as
//!   fast as it can runs out of ports (each leaves a socket in TIME_WAIT for a minute, about
//!   470 a second from one address to one address), which resets the plaintext runs; so this
//!   load compares latency at one rate, and its rate is the pace.
//!
//! Reported per load and kind: exchanges per second, p50 and p99 latency, failures, and the
//! ratios mTLS / plaintext (`rps_ratio`, `p99_ratio`). `cargo xtask bench --only mtls` runs it
//! with release binaries.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use lattice_e2e::node::{LoadReport, Server};
use lattice_e2e::trusted::{TrustedNode, inbound_listening, pod};
use lattice_e2e::wait;
use serde_json::{Value, json};

const HTTP_PORT: u16 = 8080;
const ECHO_PORT: u16 = 7000;
const WEB: &str = "spiffe://cluster.local/ns/default/sa/web";

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Exchanges per second, latency percentiles (ms) and failures of a load's outcomes.
fn figures(reports: &[LoadReport], seconds: f64) -> Value {
    let mut took: Vec<f64> = reports
        .iter()
        .flat_map(|r| &r.outcomes)
        .filter(|o| o.result.is_ok())
        .map(|o| o.took.as_secs_f64() * 1000.0)
        .collect();
    took.sort_by(f64::total_cmp);
    let failed: usize = reports.iter().map(|r| r.failures().len()).sum();
    let first_failure = reports
        .iter()
        .flat_map(|r| r.failures())
        .find_map(|o| o.result.as_ref().err().cloned());
    let at = |q: f64| {
        took.get(((took.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    json!({
        "exchanges": took.len(),
        "per_second": took.len() as f64 / seconds,
        "p50_ms": at(0.5),
        "p99_ms": at(0.99),
        "failed": failed,
        "first_failure": first_failure,
    })
}

fn compared(plain: Value, mtls: Value) -> Value {
    let ratio = |field: &str| {
        mtls[field].as_f64().unwrap_or(f64::NAN) / plain[field].as_f64().unwrap_or(f64::NAN)
    };
    json!({
        "rps_ratio": ratio("per_second"),
        "p99_ratio": ratio("p99_ms"),
        "plaintext": plain,
        "mtls": mtls,
    })
}

#[test]
#[ignore = "a benchmark: cargo xtask bench --only mtls"]
fn mtls_against_plaintext_through_the_mesh() {
    let seconds = env_or("LATTICE_BENCH_MTLS_SECONDS", 5);
    let rounds = env_or("LATTICE_BENCH_MTLS_ROUNDS", 2);
    let connect_every = Duration::from_millis(env_or("LATTICE_BENCH_MTLS_CONNECT_EVERY_MS", 4));
    let (front_ip, web_ip) = (Ipv4Addr::new(10, 200, 0, 2), Ipv4Addr::new(10, 200, 0, 3));
    let objects = vec![
        pod("front", "front", front_ip, json!({})),
        pod(
            "web",
            "web",
            web_ip,
            json!({"lattice.mlab.com/inbound-capture": "enabled"}),
        ),
    ];
    let mut mesh = String::from("services:\n");
    for (name, port, protocol, identities) in [
        ("plain", HTTP_PORT, "http", ""),
        ("secure", HTTP_PORT, "http", WEB),
        ("echo-plain", ECHO_PORT, "tcp", ""),
        ("echo-secure", ECHO_PORT, "tcp", WEB),
    ] {
        mesh.push_str(&format!(
            "  - path: /bench/{name}\n    ports:\n      - port: {port}\n        protocol: {protocol}\n    endpoints:\n      - address: {web_ip}\n"
        ));
        if !identities.is_empty() {
            mesh.push_str(&format!("    identities: [{identities}]\n"));
        }
    }
    let trusted = TrustedNode::start("mtlsbench", objects, Some(&mesh)).unwrap();
    let web = trusted.pod("web", 3, &["--inbound-capture"]).unwrap();
    let _http = Server::http(&web.pod, "web", HTTP_PORT).unwrap();
    let _echo = Server::echo(&web.pod, ECHO_PORT).unwrap();
    wait::until("web's inbound listener", Duration::from_secs(20), || {
        inbound_listening(&web)
    })
    .unwrap();
    let front = trusted.pod("front", 2, &[]).unwrap();
    let address = |name: &str, port: u16| {
        let ip = front
            .resolve(&format!("{name}.bench.system.internal"))
            .unwrap();
        SocketAddr::from((ip, port))
    };
    let http = [
        ("plain", address("plain", HTTP_PORT)),
        ("secure", address("secure", HTTP_PORT)),
    ];
    let tcp = [
        ("echo-plain", address("echo-plain", ECHO_PORT)),
        ("echo-secure", address("echo-secure", ECHO_PORT)),
    ];
    // Every path answers before anything is timed.
    for (name, addr) in http {
        let host = format!("{name}.bench.system.internal:{HTTP_PORT}");
        wait::until(name, Duration::from_secs(20), || front.http(addr, &host)).unwrap();
    }
    for (name, addr) in tcp {
        wait::until(name, Duration::from_secs(20), || {
            front.tcp_exchange(addr, b"warm\n")
        })
        .unwrap();
    }
    let run = Duration::from_secs(seconds);
    let mut requests: [Vec<LoadReport>; 2] = Default::default();
    let mut connections: [Vec<LoadReport>; 2] = Default::default();
    for _ in 0..rounds {
        for (k, (name, addr)) in http.iter().enumerate() {
            let host = format!("{name}.bench.system.internal:{HTTP_PORT}");
            let load = front.load_keepalive(*addr, &host, Duration::ZERO);
            std::thread::sleep(run);
            requests[k].push(load.stop());
        }
        for (k, (_, addr)) in tcp.iter().enumerate() {
            let load = front.tcp_load(*addr, connect_every);
            std::thread::sleep(run);
            connections[k].push(load.stop());
        }
    }
    let total = (seconds * rounds) as f64;
    let [plain, secure] = requests;
    let [echo_plain, echo_secure] = connections;
    let report = json!({
        "seconds_per_kind": total,
        "requests": compared(figures(&plain, total), figures(&secure, total)),
        "connections": compared(figures(&echo_plain, total), figures(&echo_secure, total)),
    });
    println!("BENCH_MTLS_JSON {report}");
    // Envoy writes its access log a little after the connections; the mTLS runs were
    // mesh mTLS if it names the caller.
    let caller = "[lattice-inbound] mtls peer=spiffe://cluster.local/ns/default/sa/front";
    wait::until(
        "the caller's identity in the access log",
        Duration::from_secs(20),
        || {
            web.envoy_log()
                .contains(caller)
                .then_some(())
                .ok_or_else(|| "not yet".to_string())
        },
    )
    .unwrap();
}
