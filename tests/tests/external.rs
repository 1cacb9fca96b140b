//! External (host-name) services end to end, for both sources: a mesh file that names its
//! endpoints by host name, and ExternalName Services served by the fake API server. The
//! external servers live outside the node's bridge, on hosts of a simulated internet
//! (203.0.113.0/24, TEST-NET-3) that the node reaches only through a namespace playing its
//! internet gateway ([`Node::internet`]; still no route out of the machine). A DNS server the
//! test starts (`unbound` with `local-data`, in the node, the agent's only upstream) resolves
//! their names, and a client pod reaches them by their mesh names through the agent's DNS, the
//! trapped address and a real Envoy, whose DNS clusters resolve the host names through the
//! agent's DNS too.
//!
//! What fails when the feature breaks:
//! - HTTP: `payments.ext.system.internal` reaches the backend behind `payments.example.test`,
//!   which sees `Host: payments.example.test` (rewritten by default); a service that keeps the
//!   client's Host delivers the mesh name instead;
//! - a record change: `payments.example.test` moves to another backend; every request reaches
//!   the new one within the bound the TTLs imply (the agent's cache, then Envoy's refresh);
//! - TLS passthrough: `openssl s_server` behind `secure.example.test` refuses any SNI but its own
//!   (`-servername_fatal`): a handshake through `secure.ext.system.internal` succeeds with that
//!   SNI and fails with another, so the client's SNI arrives intact and TLS is not terminated.
//!
//! Build the binaries first: `cargo build --workspace --bins`.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use lattice_e2e::mesh_source::MeshSource as Source;
use lattice_e2e::netns::Process;
use lattice_e2e::node::{Backend, ClientPod, Internet, Node};
use lattice_e2e::wait;
use serde_json::json;

/// One topology at a time: two cores are shared by every Envoy and agent of a test.
static ONE_NODE: Mutex<()> = Mutex::new(());

const HTTP_HOST: u8 = 31;
const TLS_HOST: u8 = 32;
/// Where `payments.example.test` moves.
const MOVED_HOST: u8 = 33;
/// The records' TTL, seconds.
const TTL: u64 = 2;
const HTTP_PORT: u16 = 8080;
const TLS_PORT: u16 = 8443;
/// Where unbound listens, on the node's loopback (the node namespace is the test's own).
const UNBOUND: &str = "127.0.0.1:5353";
const SETTLE: Duration = Duration::from_secs(20);

/// The mesh file's services: clients dial 80 and 443, the external servers listen on the
/// target ports.
const MESH: &str = "services:
  - path: /ext/payments
    ports: [{port: 80, protocol: http, targetPort: 8080}]
    endpoints: [{address: payments.example.test}]
  - path: /ext/payments-keep
    hostHeader: keep
    ports: [{port: 80, protocol: http, targetPort: 8080}]
    endpoints: [{address: payments.example.test}]
  - path: /ext/secure
    ports: [{port: 443, protocol: tcp, targetPort: 8443}]
    endpoints: [{address: secure.example.test}]
";

/// The same services as ExternalName Services in namespace `ext`. Kubernetes has clients dial
/// the external name on the Service's own port, so the ports are the servers'.
fn external_name_services(source: &Source) {
    let Source::Kube { server, .. } = source else {
        return;
    };
    let service = |name: &str, host: &str, port: u16, port_name: &str, keep: bool| {
        let annotations = if keep {
            json!({"lattice.mlab.com/host-header": "keep"})
        } else {
            json!({})
        };
        server
            .apply_json(json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"namespace": "ext", "name": name, "annotations": annotations},
                "spec": {"type": "ExternalName", "externalName": host,
                         "ports": [{"name": port_name, "port": port, "protocol": "TCP"}]},
            }))
            .unwrap();
    };
    service(
        "payments",
        "payments.example.test",
        HTTP_PORT,
        "http",
        false,
    );
    service(
        "payments-keep",
        "payments.example.test",
        HTTP_PORT,
        "http",
        true,
    );
    service("secure", "secure.example.test", TLS_PORT, "tls", false);
}

/// `unbound` in the node on [`UNBOUND`], answering the external names from `local-data` alone
/// (a static zone: it never asks anyone else), `payments.example.test` at the internet host
/// `203.0.113.<payments>`,
/// waited on until it answers so.
fn unbound(node: &Node, dir: &Path, payments: u8) -> anyhow::Result<Process> {
    let (ip, port) = UNBOUND.split_once(':').unwrap_or_default();
    let config = format!(
        "server:
  interface: {ip}
  port: {port}
  do-ip6: no
  do-daemonize: no
  username: \"\"
  chroot: \"\"
  directory: \"{dir}\"
  pidfile: \"\"
  use-syslog: no
  logfile: \"\"
  module-config: \"iterator\"
  access-control: 127.0.0.0/8 allow
  local-zone: \"example.test.\" static
  local-data: \"payments.example.test. {TTL} IN A 203.0.113.{payments}\"
  local-data: \"secure.example.test. {TTL} IN A 203.0.113.{TLS_HOST}\"
remote-control:
  control-enable: no
",
        dir = dir.display()
    );
    let path = dir.join("unbound.conf");
    std::fs::write(&path, config)?;
    let mut command = node.netns.command("unbound");
    command
        .arg("-d")
        .arg("-c")
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let process = node.netns.spawn(command)?;
    wait::until("unbound to answer", SETTLE, || {
        let output = node
            .netns
            .run(
                "dig",
                &["@127.0.0.1", "-p", port, "+short", "payments.example.test"],
            )
            .map_err(|e| e.to_string())?;
        let answer = String::from_utf8_lossy(&output.stdout).trim().to_string();
        if answer == format!("203.0.113.{payments}") {
            Ok(())
        } else {
            Err(format!("answered {answer:?}"))
        }
    })?;
    Ok(process)
}

/// A TLS server on an internet host of its own that completes a handshake only for the SNI
/// `secure.example.test`.
fn tls_server(
    internet: &Internet,
    dir: &Path,
) -> anyhow::Result<(lattice_e2e::node::Pod, Process)> {
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let output = std::process::Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
        .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"])
        .args(["-subj", "/CN=secure.example.test", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .stdin(Stdio::null())
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "openssl req: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let pod = internet.host("xt-tls", TLS_HOST)?;
    let mut command = pod.netns.command("openssl");
    command
        .args(["s_server", "-quiet", "-accept", &TLS_PORT.to_string()])
        .arg("-cert")
        .arg(&cert)
        .arg("-key")
        .arg(&key)
        .arg("-cert2")
        .arg(&cert)
        .arg("-key2")
        .arg(&key)
        .args(["-servername", "secure.example.test", "-servername_fatal"])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let process = pod.netns.spawn(command)?;
    Ok((pod, process))
}

/// A TLS handshake from the client to `target` sending `sni`: Ok, or the client's complaint.
fn handshake(client: &ClientPod, target: &str, sni: &str) -> Result<(), String> {
    let output = client
        .run(
            "timeout",
            &[
                "5",
                "openssl",
                "s_client",
                "-brief",
                "-connect",
                target,
                "-servername",
                sni,
            ],
        )
        .map_err(|e| e.to_string())?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

/// The `Host` of the last request `backend` saw.
fn last_host(backend: &Backend) -> Option<String> {
    let heads = backend.stats().heads();
    let head = heads.last()?;
    head.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.eq_ignore_ascii_case("host")
            .then(|| value.trim().to_string())
    })
}

#[test]
fn external_services_from_a_mesh_file() {
    scenario(false);
}

#[test]
fn external_name_services_from_kubernetes() {
    scenario(true);
}

/// External services are reached by mesh name, HTTP with Host rewritten (or kept), TLS with the
/// client's SNI intact.
fn scenario(kubernetes: bool) {
    let _one = ONE_NODE.lock().unwrap_or_else(|p| p.into_inner());
    let node = Node::new(if kubernetes { "xtk" } else { "xtf" }).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let dns = unbound(&node, dir.path(), HTTP_HOST).unwrap();
    let internet = node.internet("xt-gw").unwrap();
    let backend = internet
        .http_backend("xt-pay", HTTP_HOST, HTTP_PORT)
        .unwrap();
    let (_tls_pod, _tls) = tls_server(&internet, dir.path()).unwrap();
    let source = Source::start(&node, kubernetes).unwrap();
    let upstream = format!("--upstream-dns={UNBOUND}");
    let agent = match &source {
        Source::File(file) => {
            file.write_text(MESH).unwrap();
            let mesh = format!("--mesh-file={}", file.path().display());
            node.agent(&[&mesh, &upstream], &[]).unwrap()
        }
        Source::Kube { kubeconfig, .. } => {
            external_name_services(&source);
            node.agent(&[&upstream], &[("KUBECONFIG", kubeconfig)])
                .unwrap()
        }
    };
    let (http_port, tls_port) = if kubernetes {
        (HTTP_PORT, TLS_PORT)
    } else {
        (80, 443)
    };
    let client = node.client("xt-client", 2).unwrap();
    let diagnose = |what: &str| {
        format!(
            "{what}\nEnvoy endpoints: {:?}\nagent log:\n{}\nEnvoy log:\n{}",
            client.envoy_endpoints(),
            agent.log(),
            client.envoy_log()
        )
    };

    // HTTP: the mesh name through the pod's resolver (the agent), Host rewritten by default.
    let body = wait::until("payments by its mesh name", SETTLE, || {
        client.curl(&format!("http://payments.ext.system.internal:{http_port}/"))
    })
    .unwrap_or_else(|e| panic!("{}", diagnose(&e.to_string())));
    assert_eq!(body.trim(), "xt-pay");
    assert_eq!(
        last_host(&backend).as_deref(),
        Some("payments.example.test"),
        "the external name, as the upstream expects: {:?}",
        backend.stats().heads()
    );

    // The same upstream behind a service that keeps the client's Host (curl's: with the port
    // unless it is 80).
    let kept_host = match http_port {
        80 => "payments-keep.ext.system.internal".to_string(),
        port => format!("payments-keep.ext.system.internal:{port}"),
    };
    wait::until("payments-keep by its mesh name", SETTLE, || {
        client.curl(&format!(
            "http://payments-keep.ext.system.internal:{http_port}/"
        ))
    })
    .unwrap_or_else(|e| panic!("{}", diagnose(&e.to_string())));
    assert_eq!(
        last_host(&backend).as_deref(),
        Some(kept_host.as_str()),
        "{:?}",
        backend.stats().heads()
    );

    // TLS passthrough: the server accepts its own SNI only, so a handshake proves the client's
    // SNI arrived unchanged (and Envoy did not terminate TLS: it has no certificate).
    wait::until(
        "a TLS handshake with secure by its mesh name",
        SETTLE,
        || {
            handshake(
                &client,
                &format!("secure.ext.system.internal:{tls_port}"),
                "secure.example.test",
            )
        },
    )
    .unwrap_or_else(|e| panic!("{}", diagnose(&e.to_string())));
    let refused = handshake(
        &client,
        &format!("secure.ext.system.internal:{tls_port}"),
        "other.example.test",
    );
    assert!(
        refused.is_err(),
        "the server checks SNI, so a wrong one must fail: the check above means something"
    );

    // The record moves: once the agent's cached answer and Envoy's resolution have both had
    // their TTL, every request reaches the new address.
    let moved = internet
        .http_backend("xt-moved", MOVED_HOST, HTTP_PORT)
        .unwrap();
    drop(dns);
    let _dns = unbound(&node, dir.path(), MOVED_HOST).unwrap();
    let changed = std::time::Instant::now();
    // Straight to the trapped address, resolved once: a lookup through the pod's resolver can
    // lose a packet to the conntrack race of parallel A and AAAA queries (2 s each time), which
    // is not what is measured here.
    let address = SocketAddr::new(
        client
            .resolve("payments.ext.system.internal")
            .unwrap()
            .into(),
        http_port,
    );
    let host = format!("payments.ext.system.internal:{http_port}");
    // At most a TTL in the agent's cache, then a TTL until Envoy's next lookup, and a second
    // for the rest; Envoy's 5 s default refresh would miss it.
    let bound = Duration::from_secs(2 * TTL + 1);
    let followed = wait::until("traffic to follow the record", bound, || {
        match client.http(address, &host) {
            Ok(body) if body.trim() == "xt-moved" => Ok(changed.elapsed()),
            other => Err(format!("{other:?}")),
        }
    })
    .unwrap_or_else(|e| panic!("{}", diagnose(&e.to_string())));
    eprintln!("traffic followed the record change after {followed:?} (TTL {TTL} s)");
    let before = backend.stats().served();
    for _ in 0..10 {
        assert_eq!(client.http(address, &host).unwrap().trim(), "xt-moved");
    }
    assert_eq!(
        backend.stats().served(),
        before,
        "nothing reaches the old address"
    );
    assert!(moved.stats().served() >= 11);
}
