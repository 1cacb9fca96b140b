//! End-to-end tests of the real `lattice-init` binary, run inside network namespaces these tests
//! create: real iptables (both backends where installed), real connections, real Envoy.
//!
//! Build the binary first: `cargo build -p lattice-init --bins`. Apply and re-run times are
//! printed; see them with `cargo test -p lattice-e2e --test init -- --nocapture`.

use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use lattice_e2e::iptables::{self, without_empty_tables};
use lattice_e2e::netns::Netns;
use lattice_e2e::{bins, envoy, wait};
use nix::sys::socket::{SockaddrIn, SockaddrIn6, getsockopt, sockopt};

const TIMEOUT: Duration = Duration::from_secs(10);
const APP_UID: &str = "1000";
const ENVOY_UID: &str = "1337";

/// The backends whose binaries are installed: every test that touches rules runs on each.
fn backends() -> Vec<&'static str> {
    let found = iptables::backends();
    assert!(!found.is_empty(), "no iptables backend installed");
    found
}

/// `iptables-save` of one backend and family, without the timestamped comment lines.
fn save(ns: &Netns, backend: &str, family: &str) -> String {
    iptables::save(ns, backend, family).unwrap()
}

/// Every ruleset in the namespace: both backends, both families.
fn snapshot(ns: &Netns) -> String {
    iptables::snapshot(ns).unwrap()
}

/// Runs `lattice-init args` in `ns`; returns its output and wall time (process start to exit).
fn init(ns: &Netns, args: &[&str]) -> (Output, Duration) {
    let started = Instant::now();
    let output = ns
        .command(bins::path("lattice-init"))
        .args(args)
        .env("RUST_LOG", "info")
        .env_remove("HOST_IP")
        .env_remove("POD_NAME")
        .env_remove("POD_NAMESPACE")
        .output()
        .unwrap();
    (output, started.elapsed())
}

fn init_ok(ns: &Netns, args: &[&str]) -> (Output, Duration) {
    let (output, took) = init(ns, args);
    assert!(
        output.status.success(),
        "lattice-init {args:?} failed ({}):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    (output, took)
}

fn ms(duration: Duration) -> String {
    format!("{:.1} ms", duration.as_secs_f64() * 1000.0)
}

/// A pod namespace wired to a "remote" namespace that really owns the first trapped addresses
/// (240.240.0.1, fd00:240::1), so an uncaptured connection there visibly lands on the remote.
struct Topology {
    pod: Netns,
    remote: Netns,
}

impl Topology {
    fn new(label: &str) -> Self {
        let pod = Netns::new(label).unwrap();
        let remote = Netns::new(&format!("{label}-remote")).unwrap();
        pod.veth(
            "eth0",
            "10.99.0.1/24",
            &remote,
            "eth0",
            Some("10.99.0.2/24"),
        )
        .unwrap();
        pod.add_address("eth0", "fd00:99::1/64").unwrap();
        remote.add_address("eth0", "fd00:99::2/64").unwrap();
        remote.add_address("lo", "240.240.0.1/32").unwrap();
        remote.add_address("lo", "fd00:240::1/128").unwrap();
        pod.ip(&["route", "add", "240.240.0.0/16", "via", "10.99.0.2"])
            .unwrap();
        pod.ip(&["-6", "route", "add", "fd00:240::/64", "via", "fd00:99::2"])
            .unwrap();
        Self { pod, remote }
    }
}

/// A non-blocking listener on `addr` inside `ns`. An IPv6 one is IPv6-only, so it shares its
/// port with an IPv4 listener (a dual-stack `[::]` would take the IPv4 port too).
fn listen(ns: &Netns, addr: &str) -> TcpListener {
    let addr: SocketAddr = addr.parse().unwrap();
    let listener = ns.enter(move || bind_listener(addr)).unwrap().unwrap();
    listener.set_nonblocking(true).unwrap();
    listener
}

fn bind_listener(addr: SocketAddr) -> nix::Result<TcpListener> {
    use nix::sys::socket::{
        AddressFamily, Backlog, SockFlag, SockType, SockaddrStorage, bind, listen, setsockopt,
        socket,
    };
    let family = match addr {
        SocketAddr::V4(_) => AddressFamily::Inet,
        SocketAddr::V6(_) => AddressFamily::Inet6,
    };
    let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    if addr.is_ipv6() {
        setsockopt(&fd, sockopt::Ipv6V6Only, &true)?;
    }
    bind(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrStorage::from(addr),
    )?;
    listen(&fd, Backlog::new(64)?)?;
    Ok(TcpListener::from(fd))
}

/// Connects from `uid` in `ns` to `host:port` with a shell client (a separate process, so the
/// uid is real) and returns whether the connection was established.
fn connect_as(ns: &Netns, uid: &str, host: &str, port: u16) -> bool {
    let output = ns
        .command("timeout")
        .args([
            "5",
            "setpriv",
            "--reuid",
            uid,
            "--regid",
            uid,
            "--clear-groups",
        ])
        .args([
            "bash",
            "-c",
            "exec 3<>/dev/tcp/$0/$1",
            host,
            &port.to_string(),
        ])
        .output()
        .unwrap();
    output.status.success()
}

fn accept(listener: &TcpListener, what: &str) -> TcpStream {
    wait::until(what, TIMEOUT, || match listener.accept() {
        Ok((stream, _)) => Ok(stream),
        Err(err) => Err(err.to_string()),
    })
    .unwrap()
}

fn assert_nothing_pending(listener: &TcpListener, what: &str) {
    match listener.accept() {
        Err(err) if err.kind() == ErrorKind::WouldBlock => {}
        Ok((stream, peer)) => panic!(
            "{what}: unexpected connection from {peer} to {:?}",
            stream.local_addr()
        ),
        Err(err) => panic!("{what}: {err}"),
    }
}

fn original_dst(stream: &TcpStream) -> SocketAddr {
    match stream.local_addr().unwrap() {
        SocketAddr::V4(_) => {
            SockaddrIn::from(getsockopt(stream, sockopt::OriginalDst).unwrap()).into()
        }
        SocketAddr::V6(_) => {
            SockaddrIn6::from(getsockopt(stream, sockopt::Ip6tOriginalDst).unwrap()).into()
        }
    }
}

/// (a) app traffic to 240.240.0.1:8080 lands on 15001 with that original destination;
/// (b) the same from the Envoy UID reaches the real destination; (c) other addresses are not
/// captured. On each backend.
#[test]
fn capture_sends_app_traffic_to_envoy_and_spares_envoy_and_other_addresses() {
    for backend in backends() {
        let net = Topology::new("capture");
        let envoy = listen(&net.pod, "0.0.0.0:15001");
        let remote = listen(&net.remote, "0.0.0.0:8080");
        init_ok(&net.pod, &["--iptables-backend", backend]);

        assert!(
            connect_as(&net.pod, APP_UID, "240.240.0.1", 8080),
            "{backend}: app connect"
        );
        let captured = accept(&envoy, "captured connection on 15001");
        assert_eq!(
            original_dst(&captured),
            "240.240.0.1:8080".parse::<SocketAddr>().unwrap(),
            "{backend}: SO_ORIGINAL_DST"
        );
        assert_nothing_pending(&remote, "app traffic must not reach the remote");

        assert!(
            connect_as(&net.pod, ENVOY_UID, "240.240.0.1", 8080),
            "{backend}: envoy connect"
        );
        let direct = accept(&remote, "Envoy-UID connection on the remote");
        assert_eq!(direct.local_addr().unwrap().to_string(), "240.240.0.1:8080");
        assert_nothing_pending(&envoy, "Envoy-UID traffic must not be captured");

        assert!(
            connect_as(&net.pod, APP_UID, "10.99.0.2", 8080),
            "{backend}: other address"
        );
        let other = accept(&remote, "connection to a non-trapped address on the remote");
        assert_eq!(other.local_addr().unwrap().to_string(), "10.99.0.2:8080");
        assert_nothing_pending(&envoy, "non-trapped traffic must not be captured");
    }
}

/// (d) a re-run leaves `iptables-save` byte-identical; (e) `--cleanup` restores the previous
/// ruleset exactly, and foreign rules survive throughout. Prints apply and re-run times.
#[test]
fn rerun_is_byte_identical_and_cleanup_restores_the_previous_ruleset() {
    for backend in backends() {
        let pod = Netns::new("idempotent").unwrap();
        let ipt = format!("iptables-{backend}");
        for rule in [
            "-t nat -N FOREIGN",
            "-t nat -A FOREIGN -j RETURN",
            "-t nat -A OUTPUT -d 192.0.2.9/32 -j FOREIGN",
            "-t nat -A OUTPUT -p udp --dport 9999 -j RETURN",
            "-t filter -A OUTPUT -d 192.0.2.10/32 -j DROP",
        ] {
            pod.exec(&ipt, &rule.split(' ').collect::<Vec<_>>())
                .unwrap();
        }
        let before = snapshot(&pod);

        let (applied, apply) = init_ok(&pod, &["--iptables-backend", backend]);
        let installed = snapshot(&pod);
        let ours = save(&pod, backend, "iptables");
        assert!(
            ours.contains("-A OUTPUT -j LATTICE_OUTPUT\n"),
            "{backend}: {ours}"
        );
        assert!(ours.contains("-A LATTICE_REDIRECT -p tcp -j REDIRECT --to-ports 15001\n"));
        for foreign in before.lines().filter(|line| line.starts_with("-A ")) {
            assert!(installed.contains(foreign), "{backend}: lost {foreign:?}");
        }

        let (rerun_output, rerun) = init_ok(&pod, &["--iptables-backend", backend]);
        assert_eq!(
            snapshot(&pod),
            installed,
            "{backend}: re-run changed the ruleset"
        );
        let (auto_output, auto_rerun) = init_ok(&pod, &[]);
        assert_eq!(
            snapshot(&pod),
            installed,
            "{backend}: auto re-run changed the ruleset"
        );
        let log = String::from_utf8_lossy(&auto_output.stderr);
        assert!(log.contains("nothing to apply"), "{backend}: {log}");

        // A tampered chain is rewritten (not appended to) back to the same bytes.
        pod.exec(
            &ipt,
            &[
                "-t",
                "nat",
                "-I",
                "LATTICE_OUTPUT",
                "1",
                "-d",
                "192.0.2.77/32",
                "-j",
                "RETURN",
            ],
        )
        .unwrap();
        let (rewritten, rewrite) = init_ok(&pod, &["--iptables-backend", backend]);
        assert_eq!(
            snapshot(&pod),
            installed,
            "{backend}: rewriting a tampered chain did not restore it"
        );

        assert!(
            log.contains(&format!("backend={backend}")),
            "{backend}: {log}"
        );

        // A changed config rewrites our chains in place: still one jump.
        init_ok(
            &pod,
            &["--iptables-backend", backend, "--envoy-port", "16001"],
        );
        let changed = save(&pod, backend, "iptables");
        assert_eq!(changed.matches("-j LATTICE_OUTPUT").count(), 1, "{changed}");
        assert!(changed.contains("--to-ports 16001\n"), "{changed}");

        let (_, cleanup) = init_ok(&pod, &["--cleanup"]);
        assert_eq!(
            snapshot(&pod),
            before,
            "{backend}: cleanup did not restore the ruleset"
        );
        let (_, cleanup_again) = init_ok(&pod, &["--cleanup"]);
        assert_eq!(
            snapshot(&pod),
            before,
            "{backend}: second cleanup changed something"
        );
        println!(
            "lattice-init timings ({backend}; process wall time, in-process time in brackets): \
             apply {} [{}], re-run {} [{}], auto-detect re-run {}, re-run rewriting a tampered \
             chain {} [{}], cleanup {}, no-op cleanup {}",
            ms(apply),
            logged_elapsed(&applied),
            ms(rerun),
            logged_elapsed(&rerun_output),
            ms(auto_rerun),
            ms(rewrite),
            logged_elapsed(&rewritten),
            ms(cleanup),
            ms(cleanup_again)
        );
    }
}

/// The `elapsed_ms` that `lattice-init` logs for its own work (config to rules in place).
fn logged_elapsed(output: &Output) -> String {
    let log = String::from_utf8_lossy(&output.stderr);
    log.split("elapsed_ms=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|value| value.parse::<f64>().ok())
        .map_or("?".into(), |value| format!("{value:.1} ms"))
}

/// (f) every bad input exits non-zero, names the problem, and leaves every ruleset unchanged,
/// both on a fresh namespace and over an existing install.
#[test]
fn bad_inputs_exit_nonzero_and_change_nothing() {
    let pod = Netns::new("badinput").unwrap();
    let empty_path = tempfile::tempdir().unwrap();
    let cases: &[(&[&str], i32, &str)] = &[
        (&["--trap-cidr", "240.240.0.0/4"], 2, "too wide"),
        (&["--trap-cidr", "banana"], 2, "banana"),
        (&["--trap-cidr", "240.240.0.1/16"], 2, "host bits"),
        (&["--trap-cidr", "240.240.0.0/16,fd00::/8"], 2, "too wide"),
        (&["--envoy-port", "0"], 2, "--envoy-port"),
        (&["--envoy-port", "70000"], 2, "--envoy-port"),
        (&["--envoy-uid", "0"], 2, "--envoy-uid"),
        (&["--envoy-uid", "nobody"], 2, "--envoy-uid"),
        (&["--exclude-uid", "4294967295"], 2, "--exclude-uid"),
        (&["--redirect-dns", "10.0.0.10"], 2, "--redirect-dns"),
        (
            &[
                "--xds-address",
                "10.0.0.1",
                "--node-id",
                "a.b",
                "--bootstrap-out",
                "/tmp/x",
            ],
            2,
            "--xds-address",
        ),
        (
            &["--bootstrap-out", "/tmp/lattice-unused.json"],
            2,
            "node id",
        ),
        (&["--iptables-backend", "bogus"], 2, "--iptables-backend"),
    ];
    for round in ["fresh", "installed"] {
        if round == "installed" {
            init_ok(&pod, &[]);
        }
        let before = snapshot(&pod);
        for (args, code, needle) in cases {
            let (output, _) = init(&pod, args);
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert_eq!(
                output.status.code(),
                Some(*code),
                "{round} {args:?}: {stderr}"
            );
            assert!(stderr.contains(needle), "{round} {args:?}: {stderr}");
            assert_eq!(
                snapshot(&pod),
                before,
                "{round} {args:?} changed the ruleset"
            );
        }

        // Needed binaries missing.
        let output = pod
            .command("env")
            .arg(format!("PATH={}", empty_path.path().display()))
            .arg(bins::path("lattice-init"))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            output.status.code(),
            Some(1),
            "{round} no binaries: {stderr}"
        );
        assert!(stderr.contains("install the iptables package"), "{stderr}");
        let output = pod
            .command("env")
            .arg(format!("PATH={}", empty_path.path().display()))
            .arg(bins::path("lattice-init"))
            .args(["--iptables-backend", "legacy"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("iptables-legacy-save not found"),
            "{stderr}"
        );
        assert_eq!(
            snapshot(&pod),
            before,
            "{round}: missing binaries changed the ruleset"
        );

        // The pod's own address inside the trapped block.
        pod.add_address("lo", "240.240.7.7/16").unwrap();
        let (output, _) = init(&pod, &[]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            output.status.code(),
            Some(1),
            "{round} pod address: {stderr}"
        );
        assert!(stderr.contains("240.240.7.7"), "{stderr}");
        assert_eq!(
            snapshot(&pod),
            before,
            "{round}: refused run changed the ruleset"
        );
        pod.ip(&["addr", "del", "240.240.7.7/16", "dev", "lo"])
            .unwrap();
    }
}

/// (g) a real Envoy accepts the bootstrap `lattice-init` writes, in both xDS modes; and it
/// would notice a broken one.
#[test]
fn envoy_validates_the_written_bootstrap() {
    let dir = tempfile::tempdir().unwrap();
    let pod = Netns::new("bootstrap").unwrap();
    for mode in ["delta", "sotw"] {
        let path = dir.path().join(format!("{mode}.json"));
        let out = path.to_str().unwrap();
        let (output, _) = {
            let started = Instant::now();
            let output = pod
                .command(bins::path("lattice-init"))
                .args(["--bootstrap-out", out, "--xds-mode", mode])
                .env("POD_NAME", "web-0")
                .env("POD_NAMESPACE", "shop")
                .output()
                .unwrap();
            (output, started.elapsed())
        };
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let bootstrap: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(bootstrap["node"]["id"], "web-0.shop");
        assert_eq!(bootstrap["node"]["cluster"], "lattice");
        let api_type = if mode == "delta" {
            "DELTA_GRPC"
        } else {
            "GRPC"
        };
        assert_eq!(
            bootstrap["dynamic_resources"]["ads_config"]["api_type"],
            api_type
        );
        for config in ["cds_config", "lds_config"] {
            assert_eq!(
                bootstrap["dynamic_resources"][config]["initial_fetch_timeout"],
                "0s"
            );
        }
        let xds = &bootstrap["static_resources"]["clusters"][0];
        assert_eq!(xds["name"], "lattice-xds");
        // The default: the node-local address, which only this node's pods reach.
        assert_eq!(
            xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
                ["address"],
            "169.254.20.10"
        );
        assert_eq!(
            xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
                ["port_value"],
            15010
        );
        envoy_validate(&path).unwrap_or_else(|err| panic!("{mode}: {err}"));
    }

    let mut broken: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("delta.json")).unwrap())
            .unwrap();
    broken["dynamic_resources"]["ads_config"]["api_type"] = "NOT_A_TYPE".into();
    let path = dir.path().join("broken.json");
    std::fs::write(&path, broken.to_string()).unwrap();
    assert!(
        envoy_validate(&path).is_err(),
        "Envoy's validate mode accepted a broken bootstrap"
    );
}

fn envoy_validate(path: &Path) -> Result<(), String> {
    let output = std::process::Command::new(envoy::binary())
        .args(["--mode", "validate", "--log-level", "warn", "-c"])
        .arg(path)
        .output()
        .map_err(|err| err.to_string())?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "envoy --mode validate failed ({}): {}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

/// The written bootstrap runs a real Envoy inside the pod namespace: the admin API answers on
/// 127.0.0.1:15000 only, reports the node id and cluster, and Envoy waits for the agent's
/// clusters instead of going live.
#[test]
fn envoy_runs_with_the_bootstrap_and_keeps_admin_on_loopback() {
    let net = Topology::new("envoyrun");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("envoy.json");
    init_ok(
        &net.pod,
        &[
            "--bootstrap-out",
            path.to_str().unwrap(),
            "--node-id",
            "web-0.shop",
            "--xds-address",
            "10.99.0.2:15010",
        ],
    );
    let mut command = net.pod.command(envoy::binary());
    command
        .args(["--disable-hot-restart", "--log-level", "warn", "-c"])
        .arg(&path)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let _envoy = net.pod.spawn(command).unwrap();

    // No agent answers, so CDS has no first response and Envoy waits in PRE_INITIALIZING. (That
    // the wait is unbounded, `initial_fetch_timeout: 0s`, is asserted on the JSON above; proving
    // it here would take longer than Envoy's 15 s default.)
    let info = wait::until("Envoy admin /server_info", Duration::from_secs(30), || {
        let body = net
            .pod
            .enter(|| http_get("127.0.0.1:15000", "/server_info"))
            .map_err(|err| err.to_string())??;
        serde_json::from_str::<serde_json::Value>(&body).map_err(|err| err.to_string())
    })
    .unwrap();
    assert_eq!(info["node"]["id"], "web-0.shop", "{info}");
    assert_eq!(info["node"]["cluster"], "lattice", "{info}");
    assert_eq!(
        info["state"], "PRE_INITIALIZING",
        "Envoy must wait for the agent's clusters: {info}"
    );

    let from_outside = net
        .remote
        .enter(|| TcpStream::connect_timeout(&"10.99.0.1:15000".parse().unwrap(), TIMEOUT))
        .unwrap();
    assert!(
        from_outside.is_err(),
        "Envoy admin is reachable from outside the pod"
    );
}

/// A minimal HTTP/1.1 GET (one request, connection closed) returning the body, or why it failed.
fn http_get(addr: &str, path: &str) -> Result<String, String> {
    use std::io::{Read as _, Write as _};
    let mut stream = TcpStream::connect(addr).map_err(|err| err.to_string())?;
    stream
        .set_read_timeout(Some(TIMEOUT))
        .map_err(|err| err.to_string())?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|err| err.to_string())?;
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .map_err(|err| err.to_string())?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or("no HTTP header end")?;
    if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
        return Err(head.lines().next().unwrap_or_default().to_owned());
    }
    if !head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return Ok(body.to_owned());
    }
    let mut decoded = String::new();
    let mut rest = body;
    loop {
        let (size, after) = rest.split_once("\r\n").ok_or("truncated chunk")?;
        let size = usize::from_str_radix(size.trim(), 16).map_err(|err| err.to_string())?;
        if size == 0 {
            return Ok(decoded);
        }
        let chunk = after.get(..size).ok_or("truncated chunk")?;
        decoded.push_str(chunk);
        rest = after.get(size + 2..).ok_or("truncated chunk")?;
    }
}

/// (h) with both backends installed, `auto` follows the rules the namespace already holds and
/// says why; the other backend is left untouched.
#[test]
fn auto_backend_follows_existing_rules() {
    let backends = backends();
    if backends.len() < 2 {
        println!("only {backends:?} installed: detection between two backends not testable");
        return;
    }
    for (holder, other) in [("legacy", "nft"), ("nft", "legacy")] {
        let pod = Netns::new("detect").unwrap();
        pod.exec(
            &format!("iptables-{holder}"),
            &[
                "-t",
                "filter",
                "-A",
                "OUTPUT",
                "-d",
                "192.0.2.1/32",
                "-j",
                "DROP",
            ],
        )
        .unwrap();
        let other_before = save(&pod, other, "iptables");
        let (output, _) = init_ok(&pod, &[]);
        let log = String::from_utf8_lossy(&output.stderr);
        assert!(log.contains(&format!("backend={holder}")), "{log}");
        assert!(log.contains("more rules"), "the log must say why: {log}");
        assert!(save(&pod, holder, "iptables").contains("-A OUTPUT -j LATTICE_OUTPUT"));
        assert_eq!(
            save(&pod, other, "iptables"),
            other_before,
            "{other} was touched"
        );
    }
}

/// An IPv6 block adds the matching ip6tables rules and captures IPv6 connections; an IPv4-only
/// run leaves IPv6 untouched.
#[test]
fn ipv6_block_is_captured_and_ipv4_only_leaves_ipv6_alone() {
    for backend in backends() {
        let net = Topology::new("ipv6");
        let ip6_before = save(&net.pod, backend, "ip6tables");
        init_ok(&net.pod, &["--iptables-backend", backend]);
        assert_eq!(
            save(&net.pod, backend, "ip6tables"),
            ip6_before,
            "{backend}: IPv4-only"
        );

        init_ok(
            &net.pod,
            &[
                "--iptables-backend",
                backend,
                "--trap-cidr",
                "240.240.0.0/16,fd00:240::/64",
            ],
        );
        let v6 = save(&net.pod, backend, "ip6tables");
        assert!(
            v6.contains("-A LATTICE_OUTPUT -d fd00:240::/64 -p tcp -j LATTICE_REDIRECT"),
            "{v6}"
        );

        let envoy = listen(&net.pod, "[::]:15001");
        let remote = listen(&net.remote, "[::]:8080");
        assert!(
            connect_as(&net.pod, APP_UID, "fd00:240::1", 8080),
            "{backend}: app connect"
        );
        let captured = accept(&envoy, "captured IPv6 connection on 15001");
        assert_eq!(
            original_dst(&captured),
            "[fd00:240::1]:8080".parse::<SocketAddr>().unwrap()
        );
        assert!(
            connect_as(&net.pod, ENVOY_UID, "fd00:240::1", 8080),
            "{backend}: envoy"
        );
        accept(&remote, "Envoy-UID IPv6 connection on the remote");
        assert_nothing_pending(&envoy, "Envoy-UID IPv6 traffic must not be captured");

        init_ok(&net.pod, &["--cleanup"]);
        assert_eq!(
            without_empty_tables(&save(&net.pod, backend, "ip6tables")),
            ip6_before,
            "{backend}: v6 cleanup"
        );
    }
}

/// `--validate` proves capture after applying; when capture cannot work it fails with its own
/// exit code (3).
#[test]
fn validate_flag_checks_capture_with_a_distinct_exit_code() {
    for backend in backends() {
        let net = Topology::new("validate");
        let (output, _) = init_ok(&net.pod, &["--iptables-backend", backend, "--validate"]);
        let log = String::from_utf8_lossy(&output.stderr);
        assert!(log.contains("original_dst=240.240.0.1:15999"), "{log}");

        // Envoy's port taken: the probe cannot listen.
        let _busy = listen(&net.pod, "0.0.0.0:15001");
        let (output, _) = init(&net.pod, &["--iptables-backend", backend, "--validate"]);
        assert_eq!(
            output.status.code(),
            Some(3),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    // No route into the trapped block: the probe cannot be sent.
    let pod = Netns::new("validate-noroute").unwrap();
    let (output, _) = init(&pod, &["--validate"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("route"), "{stderr}");
}

/// `--dry-run` prints the rules and the bootstrap and changes nothing, not even the bootstrap
/// file.
#[test]
fn dry_run_prints_rules_and_bootstrap_and_changes_nothing() {
    let pod = Netns::new("dryrun").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("bootstrap.json");
    let before = snapshot(&pod);
    let (output, _) = init_ok(
        &pod,
        &[
            "--dry-run",
            "--trap-cidr",
            "240.240.0.0/16,fd00:240::/64",
            "--node-id",
            "web-0.shop",
            "--xds-address",
            "10.99.0.2:15010",
            "--bootstrap-out",
            out.to_str().unwrap(),
        ],
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("-A LATTICE_OUTPUT -d 240.240.0.0/16 -p tcp -j LATTICE_REDIRECT"));
    assert!(stdout.contains("-A LATTICE_OUTPUT -d fd00:240::/64 -p tcp -j LATTICE_REDIRECT"));
    assert!(stdout.contains("\"web-0.shop\""), "{stdout}");
    assert_eq!(snapshot(&pod), before);
    assert!(!out.exists(), "--dry-run wrote the bootstrap");

    let (output, _) = init_ok(
        &pod,
        &["--check-config", "--bootstrap-out", "/nonexistent/b.json"],
    );
    assert!(output.stdout.is_empty());
    assert_eq!(snapshot(&pod), before, "--check-config changed the ruleset");
}

/// `--redirect-dns` sends port 53 from app UIDs to the agent's DNS, never from the Envoy UID.
#[test]
fn dns_redirect_sends_app_queries_to_the_agent() {
    let net = Topology::new("dns");
    init_ok(&net.pod, &["--redirect-dns", "127.0.0.1:15053"]);
    let agent = net
        .pod
        .enter(|| UdpSocket::bind("0.0.0.0:15053"))
        .unwrap()
        .unwrap();
    agent.set_read_timeout(Some(TIMEOUT)).unwrap();
    let agent_tcp = listen(&net.pod, "0.0.0.0:15053");
    let remote = listen(&net.remote, "0.0.0.0:53");

    let send = |uid: &str, payload: &str| {
        let script = format!("echo {payload} >/dev/udp/10.99.0.2/53");
        let status = net
            .pod
            .command("setpriv")
            .args([
                "--reuid",
                uid,
                "--regid",
                uid,
                "--clear-groups",
                "bash",
                "-c",
                &script,
            ])
            .status()
            .unwrap();
        assert!(status.success());
    };
    send(APP_UID, "from-app");
    let mut buf = [0u8; 64];
    let (len, _) = agent.recv_from(&mut buf).unwrap();
    assert_eq!(&buf[..len], b"from-app\n");

    assert!(
        connect_as(&net.pod, APP_UID, "10.99.0.2", 53),
        "app TCP DNS"
    );
    let redirected = accept(&agent_tcp, "app TCP DNS on the agent's port");
    assert_eq!(
        original_dst(&redirected),
        "10.99.0.2:53".parse::<SocketAddr>().unwrap()
    );
    assert_nothing_pending(&remote, "app TCP DNS must not reach the remote");

    assert!(
        connect_as(&net.pod, ENVOY_UID, "10.99.0.2", 53),
        "Envoy TCP DNS"
    );
    accept(&remote, "Envoy-UID DNS on the remote");
    assert_nothing_pending(&agent_tcp, "Envoy-UID DNS must not be redirected");
}

/// Concurrent runs in one network namespace take turns, and killed ones leave nothing half
/// done: `RUNS` runs started at once, every third killed with SIGKILL a few milliseconds in
/// (mid-run: reading the rules, in `iptables-restore`, or writing the bootstrap), then one more
/// run. Every run that was not killed succeeds; the namespace then holds exactly the rule set
/// one run installs in a fresh namespace (one jump, our chains once), and the bootstrap is
/// whole and valid for a real Envoy, with no temporary file left beside it. On each backend.
#[test]
fn concurrent_and_killed_runs_leave_one_rule_set_and_a_whole_bootstrap() {
    const RUNS: usize = 12;
    for backend in backends() {
        let reference = Netns::new("concurrent-ref").unwrap();
        init_ok(&reference, &["--iptables-backend", backend]);
        let one_run = snapshot(&reference);
        drop(reference);

        let pod = Netns::new("concurrent").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let bootstrap = dir.path().join("envoy.json");
        let args = [
            "--iptables-backend",
            backend,
            "--node-id",
            "web-0.shop",
            "--bootstrap-out",
            bootstrap.to_str().unwrap(),
        ];
        let mut children: Vec<std::process::Child> = (0..RUNS)
            .map(|_| {
                pod.command(bins::path("lattice-init"))
                    .args(args)
                    .env("RUST_LOG", "info")
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        // `ip netns exec` execs lattice-init, so each child is the run itself.
        for (k, child) in children.iter_mut().enumerate().filter(|(k, _)| k % 3 == 0) {
            std::thread::sleep(Duration::from_millis(2 * k as u64));
            let _ = child.kill();
        }
        for (k, child) in children.into_iter().enumerate() {
            let output = child.wait_with_output().unwrap();
            if k % 3 != 0 {
                assert!(
                    output.status.success(),
                    "{backend}: run {k} failed ({}):\n{}",
                    output.status,
                    String::from_utf8_lossy(&output.stderr)
                );
            }
        }
        assert_eq!(
            snapshot(&pod),
            one_run,
            "{backend}: concurrent runs left other than one rule set"
        );

        init_ok(&pod, &args);
        assert_eq!(
            snapshot(&pod),
            one_run,
            "{backend}: the final run left other than one rule set"
        );
        envoy_validate(&bootstrap).unwrap_or_else(|err| panic!("{backend}: {err}"));
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&bootstrap).unwrap().permissions().mode();
        assert_eq!(
            mode & 0o777,
            0o644,
            "{backend}: Envoy (another user) must be able to read the bootstrap"
        );
        let left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name != "envoy.json")
            .collect();
        assert!(left.is_empty(), "{backend}: files left behind: {left:?}");
    }
}

/// Inbound capture: a connection from outside the pod to an app port lands on Envoy's inbound
/// listener (15006) with the app's address as its original destination, in both families;
/// an excluded port and Envoy's readiness port reach their listeners directly, as do the
/// app's own and Envoy's connections to the pod's address. Turning it off again removes only
/// its chains and jump; a pod with an address of a family no trapped block covers is refused
/// and left as it was. On each backend.
#[test]
fn inbound_capture_sends_arriving_tcp_to_envoy_and_spares_excluded_ports() {
    for backend in backends() {
        let net = Topology::new("inbound");
        let before = snapshot(&net.pod);
        let (refused, _) = init(
            &net.pod,
            &["--iptables-backend", backend, "--inbound-capture"],
        );
        assert_eq!(refused.status.code(), Some(1), "{backend}: a v6 address");
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(stderr.contains("fd00:99::1"), "{backend}: {stderr}");
        assert_eq!(snapshot(&net.pod), before, "{backend}: refused, untouched");

        let dual = "240.240.0.0/16,fd00:240::/64";
        let args = [
            "--iptables-backend",
            backend,
            "--trap-cidr",
            dual,
            "--inbound-capture",
            "--exclude-inbound-port",
            "9090",
        ];
        init_ok(&net.pod, &args);
        let (rerun, _) = init_ok(&net.pod, &args);
        assert!(
            String::from_utf8_lossy(&rerun.stderr).contains("nothing to apply"),
            "{backend}: a re-run is a no-op"
        );

        // Each family's listeners are bound once, side by side, for the whole test: rebinding a
        // port between rounds can meet the previous round's sockets still closing.
        let families = [("10.99.0.1", "0.0.0.0"), ("fd00:99::1", "[::]")].map(|(pod_ip, any)| {
            let bound = |port: u16| listen(&net.pod, &format!("{any}:{port}"));
            (
                pod_ip,
                [bound(15006), bound(8080), bound(9090), bound(15021)],
            )
        });
        for (pod_ip, [inbound, app, excluded, readiness]) in &families {
            let pod_ip = *pod_ip;

            assert!(connect_as(&net.remote, APP_UID, pod_ip, 8080), "{backend}");
            let captured = accept(inbound, "inbound connection on 15006");
            let want = SocketAddr::new(pod_ip.parse().unwrap(), 8080);
            assert_eq!(original_dst(&captured), want, "{backend}: SO_ORIGINAL_DST");
            assert_nothing_pending(app, "inbound traffic must not reach the app directly");

            for (port, listener) in [(9090, excluded), (15021, readiness)] {
                assert!(connect_as(&net.remote, APP_UID, pod_ip, port), "{backend}");
                let direct = accept(listener, "an excluded port's connection");
                assert_eq!(direct.local_addr().unwrap().port(), port);
            }
            for uid in [APP_UID, ENVOY_UID] {
                assert!(connect_as(&net.pod, uid, pod_ip, 8080), "{backend}");
                accept(app, "the pod's own connection to its address");
            }
            assert_nothing_pending(inbound, "only arriving traffic is captured");
        }

        init_ok(
            &net.pod,
            &["--iptables-backend", backend, "--trap-cidr", dual],
        );
        let off = save(&net.pod, backend, "iptables");
        assert!(!off.contains("LATTICE_IN"), "{backend}: {off}");
        assert!(
            off.contains("-A OUTPUT -j LATTICE_OUTPUT\n"),
            "{backend}: {off}"
        );
        let (_, [inbound, app, ..]) = &families[0];
        assert!(connect_as(&net.remote, APP_UID, "10.99.0.1", 8080));
        accept(app, "with inbound capture off, the app");
        assert_nothing_pending(inbound, "inbound capture is off");

        init_ok(&net.pod, &["--cleanup"]);
        assert_eq!(
            without_empty_tables(&snapshot(&net.pod)),
            without_empty_tables(&before),
            "{backend}: cleanup"
        );
    }
}
