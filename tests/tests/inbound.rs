//! Inbound capture and the inbound listener: a mesh pod whose `lattice-init` ran with
//! `--inbound-capture` gets, from the agent running as the DaemonSet runs it (node-local
//! address, `NODE_NAME`, the fake API server with this node's Pods and the CA's Secret), an
//! inbound listener that terminates mesh mTLS in front of its app. Callers are a plain pod of
//! the node with `openssl s_client` and `curl`, and the node itself (the kubelet's probes).
//!
//! What fails when the feature breaks:
//! - a caller with a certificate of the mesh's CA for a SPIFFE ID of the trust domain, offering
//!   the mesh ALPN, reaches the app through the pod's Envoy, which presents the pod's own
//!   identity's leaf and logs the caller's SPIFFE ID;
//! - a certificate of another CA, one of another trust domain, or none at all, is refused and
//!   never reaches the app;
//! - plaintext (a non-mesh caller, the kubelet's probe) reaches the app through Envoy in
//!   permissive mode and is refused in strict mode; the mode follows the pod's annotation live.
//!
//! Build the binaries first: `cargo build --workspace --bins`.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use lattice_e2e::agent::Agent;
use lattice_e2e::netns::Netns;
use lattice_e2e::node::{ClientPod, Server};
use lattice_e2e::trusted::{TrustedNode, ca_secret, inbound_listening, openssl, pod};
use lattice_e2e::wait;
use lattice_inject::certs::Chain;
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(20);
const APP_PORT: u16 = 8080;
const MESH_ALPN: &str = lattice_contract::MESH_ALPN;
const REQUEST: &str = "GET / HTTP/1.1\r\nHost: app\r\nConnection: close\r\n\r\n";

/// A pod whose inbound TCP is captured, in `mode` (none: the default, permissive).
fn captured(name: &str, account: &str, ip: Ipv4Addr, mode: Option<&str>) -> Value {
    let mut annotations = json!({"lattice.mlab.com/inbound-capture": "enabled"});
    if let Some(mode) = mode {
        annotations["lattice.mlab.com/mtls-mode"] = json!(mode);
    }
    pod(name, account, ip, annotations)
}

/// A caller's certificate and key, signed by `ca` for the URI SAN `uri`: file paths.
struct Caller {
    cert: String,
    key: String,
}

fn caller_cert(dir: &Path, name: &str, ca: &Chain, uri: &str) -> Caller {
    let file = |suffix: &str| dir.join(format!("{name}.{suffix}")).display().to_string();
    let (ca_cert, ca_key) = (file("ca.pem"), file("ca.key"));
    std::fs::write(&ca_cert, &ca.ca_cert).unwrap();
    std::fs::write(&ca_key, &ca.ca_key).unwrap();
    let (csr, cert, key) = (file("csr"), file("pem"), file("key"));
    let run = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let san = format!("subjectAltName=URI:{uri}");
    run(&[
        "req",
        "-new",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        &key,
        "-out",
        &csr,
        "-subj",
        "/O=lattice-test",
        "-addext",
        &san,
    ]);
    run(&[
        "x509",
        "-req",
        "-in",
        &csr,
        "-CA",
        &ca_cert,
        "-CAkey",
        &ca_key,
        "-CAcreateserial",
        "-days",
        "1",
        "-copy_extensions",
        "copy",
        "-out",
        &cert,
    ]);
    Caller { cert, key }
}

/// The mesh's trust bundle as a file, and a caller of the mesh (the service account `caller`
/// of `default`), in `dir`.
fn mesh_caller(dir: &Path, chain: &Chain) -> (String, Caller) {
    let bundle = dir.join("bundle.pem");
    std::fs::write(&bundle, &chain.ca_cert).unwrap();
    let caller = caller_cert(
        dir,
        "caller",
        chain,
        "spiffe://cluster.local/ns/default/sa/caller",
    );
    (bundle.display().to_string(), caller)
}

/// One HTTP request over mesh mTLS from `netns` to `target`, presenting `caller` (or no
/// certificate), checking the server's leaf against `bundle`: the response, or why not.
fn mtls_request(
    netns: &Netns,
    target: SocketAddr,
    caller: Option<&Caller>,
    bundle: &str,
) -> Result<String, String> {
    let target = target.to_string();
    let mut args = vec![
        "s_client",
        "-connect",
        &target,
        "-alpn",
        MESH_ALPN,
        "-CAfile",
        bundle,
        "-verify_return_error",
        "-ign_eof",
        "-quiet",
    ];
    if let Some(caller) = caller {
        args.extend(["-cert", &caller.cert, "-key", &caller.key]);
    }
    let out = openssl(netns, &args, REQUEST)?;
    if out.contains("HTTP/1.1 200") {
        Ok(out)
    } else {
        Err(format!("no answer: {out}"))
    }
}

/// The certificate the pod's inbound listener presents to a mesh caller.
fn presented_uri(netns: &Netns, target: SocketAddr, caller: &Caller) -> Result<String, String> {
    let target = target.to_string();
    let shown = openssl(
        netns,
        &[
            "s_client",
            "-connect",
            &target,
            "-alpn",
            MESH_ALPN,
            "-cert",
            &caller.cert,
            "-key",
            &caller.key,
        ],
        "",
    )?;
    let pem = shown
        .split("-----BEGIN CERTIFICATE-----")
        .nth(1)
        .and_then(|rest| rest.split("-----END CERTIFICATE-----").next())
        .ok_or_else(|| format!("no certificate: {shown}"))?;
    let pem = format!("-----BEGIN CERTIFICATE-----{pem}-----END CERTIFICATE-----\n");
    let text = openssl(netns, &["x509", "-noout", "-ext", "subjectAltName"], &pem)?;
    Ok(text.trim().to_string())
}

/// A plain HTTP request from `netns` to `target`: the body, or why not.
fn plaintext(netns: &Netns, target: SocketAddr) -> Result<String, String> {
    let url = format!("http://{target}/");
    let out = netns
        .command("curl")
        .args(["-sS", "--max-time", "5", "--fail", &url])
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[test]
fn mesh_mtls_reaches_the_app_and_plaintext_follows_the_pods_mode() {
    let (web_ip, vault_ip) = (Ipv4Addr::new(10, 200, 0, 2), Ipv4Addr::new(10, 200, 0, 3));
    let objects = vec![
        captured("web", "web", web_ip, None),
        captured("vault", "vault", vault_ip, Some("strict")),
    ];
    let trusted = TrustedNode::start("inbound", objects, None).unwrap();
    let TrustedNode {
        node,
        server,
        chain,
        agent,
        ..
    } = &trusted;

    let web = trusted.pod("web", 2, &["--inbound-capture"]).unwrap();
    let vault = trusted.pod("vault", 3, &["--inbound-capture"]).unwrap();
    let web_app = Server::http(&web.pod, "web", APP_PORT).unwrap();
    let vault_app = Server::http(&vault.pod, "vault", APP_PORT).unwrap();
    for pod in [&web, &vault] {
        wait::until("the inbound listener", WITHIN, || inbound_listening(pod))
            .unwrap_or_else(|e| panic!("{e}\n{}\n{}", agent.log(), pod.envoy_log()));
    }
    let outsider = node.pod("outsider", 4).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (bundle, caller) = mesh_caller(dir.path(), chain);
    let (web_at, vault_at) = (
        SocketAddr::from((web_ip, APP_PORT)),
        SocketAddr::from((vault_ip, APP_PORT)),
    );

    // Mesh mTLS: the app answers, the pod presents its own identity, Envoy logs the caller's.
    for (target, app, pod, name) in [
        (web_at, &web_app, &web, "web"),
        (vault_at, &vault_app, &vault, "vault"),
    ] {
        let before = app.stats.served();
        let answer = mtls_request(&outsider.netns, target, Some(&caller), &bundle)
            .unwrap_or_else(|e| panic!("{name}: {e}\n{}", pod.envoy_log()));
        assert!(answer.trim_end().ends_with(name), "{answer}");
        assert_eq!(app.stats.served(), before + 1);
        let presented = presented_uri(&outsider.netns, target, &caller).unwrap();
        assert!(
            presented.ends_with(&format!("URI:spiffe://cluster.local/ns/default/sa/{name}")),
            "{name} presents {presented}"
        );
        wait::until("the caller's identity in the access log", WITHIN, || {
            let log = pod.envoy_log();
            let line = log
                .lines()
                .find(|l| l.contains("[lattice-inbound] mtls"))
                .ok_or("no mtls line")?;
            if line.contains("peer=spiffe://cluster.local/ns/default/sa/caller")
                && line.contains(&format!("to={}", target))
            {
                Ok(())
            } else {
                Err(line.to_string())
            }
        })
        .unwrap();
    }

    // Callers the mesh does not vouch for: refused, and the app never sees them.
    let other_ca = Chain::issue(&["unused.example".to_string()]).unwrap();
    let impostor = caller_cert(
        dir.path(),
        "impostor",
        &other_ca,
        "spiffe://cluster.local/ns/default/sa/caller",
    );
    let foreign = caller_cert(
        dir.path(),
        "foreign",
        chain,
        "spiffe://elsewhere.example/ns/default/sa/caller",
    );
    let before = web_app.stats.served();
    for (what, who) in [
        ("another CA", Some(&impostor)),
        ("another trust domain", Some(&foreign)),
        ("no certificate", None),
    ] {
        let refused = mtls_request(&outsider.netns, web_at, who, &bundle);
        assert!(refused.is_err(), "{what}: {refused:?}");
    }
    assert_eq!(
        web_app.stats.served(),
        before,
        "a refused caller reached the app"
    );

    // Plaintext: through Envoy in permissive mode (from a pod, and from the node as the
    // kubelet's probes come), refused in strict mode.
    assert_eq!(plaintext(&outsider.netns, web_at).unwrap(), "web");
    assert_eq!(plaintext(&node.netns, web_at).unwrap(), "web");
    wait::until("the plaintext call in the access log", WITHIN, || {
        let log = web.envoy_log();
        log.lines()
            .any(|l| l.contains("[lattice-inbound] plaintext peer=- from=10.200.0.4"))
            .then_some(())
            .ok_or(log)
    })
    .unwrap();
    let before = vault_app.stats.served();
    assert!(plaintext(&outsider.netns, vault_at).is_err());
    assert_eq!(
        vault_app.stats.served(),
        before,
        "strict let plaintext through"
    );
    // What an operator reads off each Envoy: connections per chain, refusals by the listener.
    let counter = |pod: &ClientPod, name: &str| -> u64 {
        let stats = pod.envoy_admin(&format!("/stats?filter=^{name}$")).unwrap();
        stats
            .rsplit(": ")
            .next()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name}: {stats}"))
    };
    assert!(counter(&web, "tcp.inbound_mtls.downstream_cx_total") >= 1);
    assert!(counter(&web, "tcp.inbound_plaintext.downstream_cx_total") >= 2);
    assert!(counter(&vault, "listener.0.0.0.0_15006.no_filter_chain_match") >= 1);

    // The mode follows the pod's annotation, live: web turns strict, vault permissive.
    server
        .apply_json(captured("web", "web", web_ip, Some("strict")))
        .unwrap();
    server
        .apply_json(captured("vault", "vault", vault_ip, Some("permissive")))
        .unwrap();
    wait::until("web strict", WITHIN, || {
        match plaintext(&outsider.netns, web_at) {
            Err(_) => Ok(()),
            Ok(body) => Err(body),
        }
    })
    .unwrap();
    wait::until("vault permissive", WITHIN, || {
        plaintext(&outsider.netns, vault_at)
    })
    .unwrap();
    mtls_request(&outsider.netns, web_at, Some(&caller), &bundle).unwrap();

    let (_, proxies) = agent.get("/debug/xds").unwrap();
    assert!(proxies.contains("\"inbound\":\"strict\""), "{proxies}");
}

/// The mesh file: `/shop/web`, whose endpoint presents `web`'s identity, and
/// `/shop/impostor`, the same endpoint said to present `billing`'s.
fn mesh_services(endpoint: Ipv4Addr) -> String {
    let mut text = String::from("services:\n");
    for (name, account) in [("web", "web"), ("impostor", "billing")] {
        text.push_str(&format!(
            "  - path: /shop/{name}\n    ports:\n      - port: {APP_PORT}\n        protocol: http\n    endpoints:\n      - address: {endpoint}\n    identities: [spiffe://cluster.local/ns/default/sa/{account}]\n"
        ));
    }
    text
}

/// Two meshed pods: `front` calls `web` by its mesh name, its Envoy over mesh mTLS to web's
/// inbound listener. On the node's bridge the request never crosses in plaintext, web's Envoy
/// logs front's SPIFFE ID; through a service that says web's pod presents another identity,
/// front's Envoy refuses web's certificate and the app is not reached.
#[test]
fn two_meshed_pods_talk_mutual_tls_with_their_identities_checked() {
    let (front_ip, web_ip) = (Ipv4Addr::new(10, 200, 0, 2), Ipv4Addr::new(10, 200, 0, 3));
    let objects = vec![
        pod("front", "front", front_ip, json!({})),
        captured("web", "web", web_ip, None),
    ];
    let trusted = TrustedNode::start("mtls", objects, Some(&mesh_services(web_ip))).unwrap();
    let agent = &trusted.agent;
    let web = trusted.pod("web", 3, &["--inbound-capture"]).unwrap();
    let app = Server::http(&web.pod, "web", APP_PORT).unwrap();
    wait::until("web's inbound listener", WITHIN, || inbound_listening(&web))
        .unwrap_or_else(|e| panic!("{e}\n{}\n{}", agent.log(), web.envoy_log()));
    let front = trusted.pod("front", 2, &[]).unwrap();

    // What crosses the wire into web's pod on its app port.
    let dir = tempfile::tempdir().unwrap();
    let pcap = dir.path().join("wire.pcap");
    let started = dir.path().join("tcpdump.log");
    let mut command = web.pod.netns.command("tcpdump");
    command
        .args(["-i", "eth0", "--immediate-mode", "-U", "-n", "-w"])
        .arg(&pcap)
        .arg(format!("tcp port {APP_PORT}"))
        .stderr(std::fs::File::create(&started).unwrap());
    let mut capture = web.pod.netns.spawn(command).unwrap();
    wait::until("tcpdump listening", WITHIN, || {
        let log = std::fs::read_to_string(&started).unwrap_or_default();
        log.contains("listening on").then_some(()).ok_or(log)
    })
    .unwrap();

    let url = format!("http://web.shop.system.internal:{APP_PORT}/");
    let body = wait::until("front's request to web", WITHIN, || front.curl(&url))
        .unwrap_or_else(|e| panic!("{e}\n{}\n{}", agent.log(), front.envoy_log()));
    assert_eq!(body.trim(), "web");
    assert_eq!(app.stats.served(), 1);
    wait::until("front's identity in web's access log", WITHIN, || {
        let log = web.envoy_log();
        log.lines()
            .any(|l| {
                l.contains("[lattice-inbound] mtls peer=spiffe://cluster.local/ns/default/sa/front")
            })
            .then_some(())
            .ok_or(log)
    })
    .unwrap();
    // SIGINT, not the guard's SIGKILL: tcpdump writes what it buffered only as it exits.
    let tcpdump = nix::unistd::Pid::from_raw(capture.child().id() as i32);
    nix::sys::signal::kill(tcpdump, nix::sys::signal::Signal::SIGINT).unwrap();
    capture.child().wait().unwrap();
    let read = std::process::Command::new("tcpdump")
        .args(["-n", "-A", "-r"])
        .arg(&pcap)
        .output()
        .unwrap();
    let wire = String::from_utf8_lossy(&read.stdout);
    assert!(
        wire.contains(MESH_ALPN),
        "no mesh TLS handshake on the wire:\n{wire}\n{}",
        std::fs::read_to_string(&started).unwrap_or_default()
    );
    for plain in ["GET / HTTP", "Host: web.shop", "\r\nweb"] {
        assert!(
            !wire.contains(plain),
            "{plain:?} crossed in plaintext:\n{wire}"
        );
    }

    // The same pod through a service that says its endpoint is another identity: front's
    // Envoy refuses the certificate web presents, and the app sees nothing.
    let impostor = format!("http://impostor.shop.system.internal:{APP_PORT}/");
    let refused = front.curl(&impostor);
    assert!(refused.is_err(), "{refused:?}");
    assert_eq!(
        app.stats.served(),
        1,
        "a refused server was sent the request"
    );
}

/// `front` and `web` (pod objects, web's at `web_ip`), and the Service `default/web` with its
/// EndpointSlice, whose one endpoint names web's pod.
fn front_and_web(front: Value, web: Value, web_ip: Ipv4Addr) -> Vec<Value> {
    let ports = json!([{"name": "http", "port": APP_PORT, "appProtocol": "http"}]);
    let endpoints = json!([{"addresses": [web_ip.to_string()], "conditions": {"ready": true},
                            "targetRef": {"kind": "Pod", "namespace": "default", "name": "web"}}]);
    vec![
        front,
        web,
        lattice_e2e::k8s_objects::service("default", "web", ports),
        lattice_e2e::k8s_objects::slice(
            "default",
            "web-1",
            "web",
            json!([{"name": "http", "port": APP_PORT}]),
            endpoints,
        ),
    ]
}

/// Every call of [`calling_throughout`] passed; `log` says why when not.
fn assert_every_call_passed(results: &[Result<String, String>], log: &str) {
    let failed: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        failed.is_empty(),
        "{} of {} calls failed, first: {:?}\n{log}",
        failed.len(),
        results.len(),
        failed.first(),
    );
}

/// A pod as the injector admits it with inbound capture: the label the agents' metadata-only
/// watch selects, and its service account beside it (`labelled: false`: not yet meshed).
fn meshed_pod(name: &str, account: &str, ip: Ipv4Addr, labelled: bool) -> Value {
    let mut object = captured(name, account, ip, None);
    if labelled {
        object["metadata"]["labels"] = json!({"lattice.mlab.com/inbound-capture": "enabled"});
        object["metadata"]["annotations"]["lattice.mlab.com/service-account"] = json!(account);
    }
    object
}

/// The same two pods with the mesh from Kubernetes: the Service `default/web` and its
/// EndpointSlice, whose endpoint names web's pod. Until web's pod is labelled as meshed,
/// front calls it in plaintext (web is permissive, so the call passes); once it is, the
/// agent follows the label and front's calls are mesh mTLS with web's identity checked.
#[test]
fn a_kubernetes_service_of_meshed_pods_is_called_over_mutual_tls() {
    let (front_ip, web_ip) = (Ipv4Addr::new(10, 200, 0, 2), Ipv4Addr::new(10, 200, 0, 3));
    let objects = front_and_web(
        pod("front", "front", front_ip, json!({})),
        meshed_pod("web", "web", web_ip, false),
        web_ip,
    );
    let trusted = TrustedNode::start("mtlskube", objects, None).unwrap();
    let (server, agent) = (&trusted.server, &trusted.agent);
    let web = trusted.pod("web", 3, &["--inbound-capture"]).unwrap();
    let app = Server::http(&web.pod, "web", APP_PORT).unwrap();
    wait::until("web's inbound listener", WITHIN, || inbound_listening(&web)).unwrap();
    let front = trusted.pod("front", 2, &[]).unwrap();
    let url = format!("http://web.default.system.internal:{APP_PORT}/");
    // Calls from front reach web's app, and web's Envoy logged a connection of front's
    // taken as `chain` after the first `from` bytes of its log. Not its last line: a pooled
    // connection is logged once, when it opens, and the plaintext one a switch to mTLS
    // replaces may be logged closing after the first mTLS one opened.
    let called_as = |chain: &str, from: (usize, usize)| {
        let before = app.stats.served();
        wait::until(&format!("a {chain} call from front"), WITHIN, || {
            let body = front.curl(&url)?;
            let taken = front_taken_since(&web, from.0, chain);
            if body.trim() == "web" && taken {
                Ok(())
            } else {
                Err(format!("{body:?}, taken as {chain}: {taken}"))
            }
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", held_by_front(agent, &front, &web, from)));
        assert!(app.stats.served() > before);
    };
    called_as("plaintext", (0, 0));

    let since = (web.envoy_log().len(), agent.log().len());
    server
        .apply_json(meshed_pod("web", "web", web_ip, true))
        .unwrap();
    called_as(
        "mtls peer=spiffe://cluster.local/ns/default/sa/front",
        since,
    );
    let (_, mesh) = agent.get("/debug/mesh").unwrap();
    assert!(
        mesh.contains("spiffe://cluster.local/ns/default/sa/web"),
        "/debug/mesh shows the Service's identities: {mesh}"
    );
}

/// Whether web's Envoy took a call of front's (10.200.0.2) as `chain` after the first `from`
/// bytes of its log.
fn front_taken_since(web: &ClientPod, from: usize, chain: &str) -> bool {
    let log = web.envoy_log();
    log.get(from..).unwrap_or_default().lines().any(|l| {
        l.contains(&format!("[lattice-inbound] {chain} ")) && l.contains("from=10.200.0.2")
    })
}

/// Why front's calls are not yet what a test waits for, shortest first (a CI summary keeps a
/// failure's head): the identities of the agent's services, its streams, front's Envoy's
/// clusters still warming and its certificates, then web's Envoy's inbound lines and the
/// agent's log, each after the first `from` bytes of its log.
fn held_by_front(
    agent: &Agent,
    front: &ClientPod,
    web: &ClientPod,
    from: (usize, usize),
) -> String {
    let get = |path: &str| {
        agent
            .get(path)
            .map_or_else(|e| e.to_string(), |(_, body)| body)
    };
    let mesh = get("/debug/mesh");
    let identities = serde_json::from_str::<Value>(&mesh).map_or(mesh, |mesh| {
        let services = mesh["services"].as_object().into_iter().flatten();
        let shown: Vec<String> = services
            .map(|(name, s)| format!("{name}: {}", s["identities"]))
            .collect();
        format!("version {}, {}", mesh["version"], shown.join(", "))
    });
    let since = |log: String, from: usize| log.get(from..).map(str::to_string).unwrap_or(log);
    let inbound: Vec<String> = since(web.envoy_log(), from.0)
        .lines()
        .filter(|l| l.contains("[lattice-inbound]"))
        .map(str::to_string)
        .collect();
    format!(
        "agent's mesh: {identities:.2000}\nagent /debug/xds: {:.2000}\n\
         front's warming clusters: {:.3000}\nfront's certificates (trusted CAs, leaf serial): {:?}\n\
         web's inbound lines since: {:.2000}\nagent log since:\n{}",
        get("/debug/xds"),
        front
            .envoy_admin("/config_dump?resource=dynamic_warming_clusters")
            .unwrap_or_else(|e| e),
        envoy_certs(front),
        inbound.join("\n"),
        since(agent.log(), from.1),
    )
}

/// What an Envoy's `/certs` says of its `ROOTCA` and `default`: how many trusted CAs, and the
/// leaf's serial.
fn envoy_certs(pod: &ClientPod) -> Result<(usize, String), String> {
    let certs: Value =
        serde_json::from_str(&pod.envoy_admin("/certs")?).map_err(|e| e.to_string())?;
    let mut roots = 0;
    let mut leaf = String::new();
    for entry in certs["certificates"].as_array().into_iter().flatten() {
        roots = roots.max(entry["ca_cert"].as_array().map_or(0, Vec::len));
        if let Some(serial) = entry["cert_chain"][0]["serial_number"].as_str() {
            leaf = serial.to_string();
        }
    }
    if leaf.is_empty() {
        return Err(format!("no leaf yet: {certs}"));
    }
    Ok((roots, leaf))
}

/// A root rotated in three steps (the new root added to the bundle, the issuer switched to it,
/// the old root dropped) while a meshed pod opens a new TCP connection to another every 20 ms,
/// each one a fresh mTLS handshake between their Envoys: no connection fails, no pod restarts,
/// and each Envoy follows every step over SDS.
#[test]
fn a_root_rotated_in_three_steps_fails_no_mtls_connection() {
    let (front_ip, web_ip) = (Ipv4Addr::new(10, 200, 0, 2), Ipv4Addr::new(10, 200, 0, 3));
    let objects = vec![
        pod("front", "front", front_ip, json!({})),
        captured("web", "web", web_ip, Some("strict")),
    ];
    let mesh = format!(
        "services:\n  - path: /shop/echo\n    ports:\n      - port: 7000\n        protocol: tcp\n    endpoints:\n      - address: {web_ip}\n    identities: [spiffe://cluster.local/ns/default/sa/web]\n"
    );
    let trusted = TrustedNode::start("rotate", objects, Some(&mesh)).unwrap();
    let (server, agent, old) = (&trusted.server, &trusted.agent, &trusted.chain);
    let web = trusted.pod("web", 3, &["--inbound-capture"]).unwrap();
    let echo = Server::echo(&web.pod, 7000).unwrap();
    wait::until("web's inbound listener", WITHIN, || inbound_listening(&web)).unwrap();
    let front = trusted.pod("front", 2, &[]).unwrap();
    let address = front.resolve("echo.shop.system.internal").unwrap();
    let target = SocketAddr::from((address, 7000));
    wait::until("a first echo over mTLS", WITHIN, || {
        front.tcp_exchange(target, b"hello\n")
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
    let load = front.tcp_load(target, Duration::from_millis(20));
    let pods = [&front, &web];
    let settled = |what: &str, check: &dyn Fn(usize, &str) -> bool| {
        for pod in pods {
            wait::until(what, WITHIN, || {
                let (roots, leaf) = envoy_certs(pod)?;
                check(roots, &leaf)
                    .then_some(())
                    .ok_or(format!("{roots} roots, leaf {leaf}"))
            })
            .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
        }
    };
    let served = |what: &str| {
        let before = echo.stats.served();
        wait::until(what, WITHIN, || {
            (echo.stats.served() > before + 10)
                .then_some(())
                .ok_or_else(|| "not yet".to_string())
        })
        .unwrap();
    };
    served("connections before the rotation");
    let leaves: Vec<String> = pods.iter().map(|p| envoy_certs(p).unwrap().1).collect();

    let new = Chain::issue(&["unused.example".to_string()]).unwrap();
    server.apply_json(ca_secret(old, &[old, &new])).unwrap();
    settled("the new root beside the old", &|roots, _| roots == 2);
    served("connections with both roots");

    server.apply_json(ca_secret(&new, &[old, &new])).unwrap();
    for (pod, before) in pods.iter().zip(&leaves) {
        wait::until("a leaf of the new issuer", WITHIN, || {
            let (_, leaf) = envoy_certs(pod)?;
            (leaf != *before).then_some(()).ok_or(leaf)
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
    }
    served("connections with leaves of the new issuer");

    server.apply_json(ca_secret(&new, &[&new])).unwrap();
    settled("the old root dropped", &|roots, _| roots == 1);
    served("connections with the new root alone");

    let report = load.stop();
    println!(
        "{} connections across a root rotation: {} failed",
        report.outcomes.len(),
        report.failures().len()
    );
    report.assert_no_failures();
    let (_, mesh_state) = agent.get("/debug/identity").unwrap();
    assert!(!mesh_state.contains("PRIVATE KEY"));
}

/// What `curl` gets from `url` in `netns` with `stdin` sent: (HTTP status, body), status 0
/// when no HTTP answer came (a `telnet://` URL reads whatever comes back).
fn curl(netns: &Netns, url: &str, stdin: &str) -> (u16, String) {
    use std::io::Write as _;
    let mut child = netns
        .command("curl")
        .args(["-s", "--max-time", "3", "-w", "\n%{http_code}", url])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let _ = child.stdin.take().unwrap().write_all(stdin.as_bytes());
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// The kubelet's probes of a strict pod, from the node in plaintext as the kubelet sends them:
/// the HTTP readiness probe's GET of its path reaches the app, anything else in plaintext at
/// that port gets 403; the TCP liveness probe's port takes plaintext as it comes; a port no
/// probe names stays closed to plaintext; mesh mTLS reaches every port.
#[test]
fn the_kubelets_probes_pass_a_strict_pod() {
    let ip = Ipv4Addr::new(10, 200, 0, 2);
    let mut object = captured("web", "web", ip, Some("strict"));
    object["spec"]["containers"] = json!([{
        "name": "app", "image": "app",
        "ports": [{"name": "http", "containerPort": APP_PORT}],
        "readinessProbe": {"httpGet": {"port": "http", "path": "/healthz"}},
        "livenessProbe": {"tcpSocket": {"port": 7000}},
    }]);
    let trusted = TrustedNode::start("probes", vec![object], None).unwrap();
    let (node, agent, chain) = (&trusted.node, &trusted.agent, &trusted.chain);
    let web = trusted.pod("web", 2, &["--inbound-capture"]).unwrap();
    let app = Server::http(&web.pod, "web", APP_PORT).unwrap();
    let _echo = Server::echo(&web.pod, 7000).unwrap();
    let _unprobed = Server::http(&web.pod, "unprobed", 9000).unwrap();
    wait::until("web's inbound listener", WITHIN, || inbound_listening(&web))
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));

    let probe = format!("http://{ip}:{APP_PORT}/healthz");
    wait::until("the readiness probe", WITHIN, || {
        match curl(&node.netns, &probe, "") {
            (200, body) if body.trim() == "web" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .unwrap_or_else(|e| panic!("{e}\n{}\n{}", agent.log(), web.envoy_log()));
    let served = app.stats.served();
    let (status, _) = curl(&node.netns, &format!("http://{ip}:{APP_PORT}/admin"), "");
    assert_eq!(status, 403, "plaintext other than the probe's GET");
    assert_eq!(
        app.stats.served(),
        served,
        "a refused request reached the app"
    );
    let (_, echoed) = curl(&node.netns, &format!("telnet://{ip}:7000"), "alive\n");
    assert!(
        echoed.is_empty(),
        "the TCP probe's port took plaintext: {echoed}"
    );
    let (status, body) = curl(&node.netns, &format!("http://{ip}:9000/"), "");
    assert!(
        status == 0 && body.is_empty(),
        "an unprobed port took plaintext: {status} {body}"
    );

    let dir = tempfile::tempdir().unwrap();
    let (bundle, caller) = mesh_caller(dir.path(), chain);
    for (port, name) in [(APP_PORT, "web"), (9000, "unprobed")] {
        let answer = mtls_request(
            &node.netns,
            SocketAddr::from((ip, port)),
            Some(&caller),
            &bundle,
        )
        .unwrap_or_else(|e| panic!("mTLS to {port}: {e}"));
        assert!(answer.trim_end().ends_with(name), "{answer}");
    }
}

/// Before a captured pod's proxy holds its leaf (here: no CA at all, then one), its inbound
/// listener is there all the same: a permissive pod takes plaintext and a strict one its
/// kubelet's probe, neither takes what starts mesh mTLS; once the CA comes, mTLS reaches both.
#[test]
fn a_captured_pod_is_reachable_by_its_mode_before_it_holds_a_leaf() {
    let (web_ip, vault_ip) = (Ipv4Addr::new(10, 200, 0, 2), Ipv4Addr::new(10, 200, 0, 3));
    let mut vault = captured("vault", "vault", vault_ip, Some("strict"));
    vault["spec"]["containers"] = json!([{
        "name": "app", "image": "app",
        "readinessProbe": {"httpGet": {"port": APP_PORT, "path": "/healthz"}},
    }]);
    let objects = vec![captured("web", "web", web_ip, None), vault];
    let trusted = TrustedNode::start_without_ca("noleaf", objects).unwrap();
    let (node, server, agent, chain) = (
        &trusted.node,
        &trusted.server,
        &trusted.agent,
        &trusted.chain,
    );
    let web = trusted.pod("web", 2, &["--inbound-capture"]).unwrap();
    let vault = trusted.pod("vault", 3, &["--inbound-capture"]).unwrap();
    let _web_app = Server::http(&web.pod, "web", APP_PORT).unwrap();
    let vault_app = Server::http(&vault.pod, "vault", APP_PORT).unwrap();
    for pod in [&web, &vault] {
        wait::until("the inbound listener, without a leaf", WITHIN, || {
            inbound_listening(pod)
        })
        .unwrap_or_else(|e| panic!("{e}\n{}\n{}", agent.log(), pod.envoy_log()));
    }
    let outsider = node.pod("outsider", 4).unwrap();
    let (web_at, vault_at) = (
        SocketAddr::from((web_ip, APP_PORT)),
        SocketAddr::from((vault_ip, APP_PORT)),
    );
    // Mesh mTLS is closed at once, never handed to the app as bytes it cannot read: Envoy
    // logs every connection it hands on, and logs none.
    let dir = tempfile::tempdir().unwrap();
    let (bundle, caller) = mesh_caller(dir.path(), chain);
    for target in [web_at, vault_at] {
        assert!(mtls_request(&outsider.netns, target, Some(&caller), &bundle).is_err());
    }
    for pod in [&web, &vault] {
        let log = pod.envoy_log();
        assert!(
            !log.contains("[lattice-inbound]"),
            "mesh TLS was handed to the app: {log}"
        );
    }
    assert_eq!(plaintext(&outsider.netns, web_at).unwrap(), "web");
    wait::until("the plaintext connection in web's log", WITHIN, || {
        let log = web.envoy_log();
        log.contains("[lattice-inbound] plaintext")
            .then_some(())
            .ok_or(log)
    })
    .unwrap();
    let probe = format!("http://{vault_ip}:{APP_PORT}/healthz");
    match curl(&node.netns, &probe, "") {
        (200, body) if body.trim() == "vault" => {}
        other => panic!("the strict pod's probe: {other:?}\n{}", vault.envoy_log()),
    }
    let vault_served = vault_app.stats.served();
    assert!(
        plaintext(&outsider.netns, vault_at).is_err(),
        "strict took plaintext"
    );
    assert_eq!(vault_app.stats.served(), vault_served);

    // The CA comes: both pods get their leaves, and mesh mTLS reaches their apps.
    server.apply_json(ca_secret(chain, &[chain])).unwrap();
    for (target, name) in [(web_at, "web"), (vault_at, "vault")] {
        let answer = wait::until("mTLS once the CA is there", WITHIN, || {
            mtls_request(&outsider.netns, target, Some(&caller), &bundle)
        })
        .unwrap_or_else(|e| panic!("{name}: {e}\n{}", agent.log()));
        assert!(answer.trim_end().ends_with(name), "{answer}");
    }
}

/// The namespace `default` labelled with the mTLS mode `mode`.
fn namespace(mode: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace",
           "metadata": {"name": "default", "labels": {"lattice.mlab.com/mtls-mode": mode}}})
}

/// A namespace's label sets the mode of its captured pods that name none, live; a pod's own
/// annotation wins over it.
#[test]
fn a_namespace_label_sets_the_mode_of_its_pods() {
    let (web_ip, vault_ip) = (Ipv4Addr::new(10, 200, 0, 2), Ipv4Addr::new(10, 200, 0, 3));
    let objects = vec![
        namespace("strict"),
        captured("web", "web", web_ip, None),
        captured("vault", "vault", vault_ip, Some("permissive")),
    ];
    let trusted = TrustedNode::start("nsmode", objects, None).unwrap();
    let (node, server, agent) = (&trusted.node, &trusted.server, &trusted.agent);
    let web = trusted.pod("web", 2, &["--inbound-capture"]).unwrap();
    let vault = trusted.pod("vault", 3, &["--inbound-capture"]).unwrap();
    let _web_app = Server::http(&web.pod, "web", APP_PORT).unwrap();
    let _vault_app = Server::http(&vault.pod, "vault", APP_PORT).unwrap();
    for pod in [&web, &vault] {
        wait::until("the inbound listener", WITHIN, || inbound_listening(pod))
            .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
    }
    let outsider = node.pod("outsider", 4).unwrap();
    let (web_at, vault_at) = (
        SocketAddr::from((web_ip, APP_PORT)),
        SocketAddr::from((vault_ip, APP_PORT)),
    );
    assert_eq!(
        wait::until("vault permissive", WITHIN, || plaintext(
            &outsider.netns,
            vault_at
        ))
        .unwrap(),
        "vault",
        "the pod's own mode wins"
    );
    assert!(
        plaintext(&outsider.netns, web_at).is_err(),
        "web takes its namespace's strict mode"
    );
    let (_, proxies) = agent.get("/debug/xds").unwrap();
    assert!(proxies.contains("\"inbound\":\"strict\""), "{proxies}");

    server.apply_json(namespace("permissive")).unwrap();
    assert_eq!(
        wait::until("web permissive", WITHIN, || plaintext(
            &outsider.netns,
            web_at
        ))
        .unwrap(),
        "web"
    );
}

/// `pod` as the injector admits it with no annotation of ours, and whether it gave
/// `lattice-init` `--inbound-capture`.
fn injected_by_default(pod: &Value) -> (Value, bool) {
    use lattice_inject::config::InjectConfig;
    use lattice_inject::template::inject;
    let patch = inject(pod, "default", &InjectConfig::default()).expect("injected");
    let mut out = pod.clone();
    json_patch::patch(&mut out, &patch).unwrap();
    let captures = out["spec"]["initContainers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["args"].as_array())
        .flatten()
        .any(|arg| arg == "--inbound-capture");
    (out, captures)
}

/// Inbound capture is the injector's default, and costs a cluster without a CA nothing: two
/// pods injected with no annotation of ours are both captured and labelled as meshed, yet
/// without a CA the agent has their Services called in plaintext, which the permissive pod
/// takes (before, every call to a meshed pod was mutual TLS with no leaf to make it, and
/// failed). The CA created, calls turn to mutual TLS with the caller's identity; the CA
/// deleted, back to plaintext rather than failing.
#[test]
fn pods_captured_by_default_talk_plaintext_without_a_ca_and_mutual_tls_with_one() {
    let (front_ip, web_ip) = (Ipv4Addr::new(10, 200, 0, 2), Ipv4Addr::new(10, 200, 0, 3));
    let (front_pod, front_captures) =
        injected_by_default(&pod("front", "front", front_ip, json!({})));
    let (web_pod, web_captures) = injected_by_default(&pod("web", "web", web_ip, json!({})));
    assert!(front_captures && web_captures, "not captured by default");
    assert_eq!(
        web_pod["metadata"]["labels"]["lattice.mlab.com/inbound-capture"],
        "enabled"
    );
    let objects = front_and_web(front_pod, web_pod, web_ip);
    let trusted = TrustedNode::start_without_ca("bydefault", objects).unwrap();
    let (server, agent, chain) = (&trusted.server, &trusted.agent, &trusted.chain);
    let web = trusted.pod("web", 3, &["--inbound-capture"]).unwrap();
    let app = Server::http(&web.pod, "web", APP_PORT).unwrap();
    let front = trusted.pod("front", 2, &["--inbound-capture"]).unwrap();
    for pod in [&web, &front] {
        wait::until("the inbound listener", WITHIN, || inbound_listening(pod))
            .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
    }
    // As `/debug/identity` and the metric show it.
    let mesh_mtls = || -> Value {
        let (_, identity) = agent.get("/debug/identity").unwrap();
        let identity: Value = serde_json::from_str(&identity).unwrap();
        let gauge = agent.metric("lattice_identity_mesh_mtls");
        assert_eq!(identity["mesh_mtls"] == json!(true), gauge == 1.0);
        identity["mesh_mtls"].clone()
    };
    let taken_as = |from: usize, chain: &str, within: Duration| {
        wait::until(&format!("a {chain} call from front"), within, || {
            front_taken_since(&web, from, chain)
                .then_some(())
                .ok_or_else(|| "not yet".to_string())
        })
        .unwrap_or_else(|e| panic!("{e}\n{}\n{}", agent.log(), web.envoy_log()));
    };
    let host = "web.default.system.internal";
    let web_at = SocketAddr::from((front.resolve(host).unwrap(), APP_PORT));
    let served = app.stats.served();
    let delete_ca = || {
        server
            .delete::<k8s_openapi::api::core::v1::Secret>("lattice-system", "lattice-ca")
            .unwrap()
    };
    let results = calling_throughout(&front, web_at, host, |calls| {
        taken_as(0, "plaintext", WITHIN);
        assert_eq!(mesh_mtls(), json!(false));
        let (_, mesh) = agent.get("/debug/mesh").unwrap();
        assert!(
            mesh.contains("spiffe://cluster.local/ns/default/sa/web"),
            "the Service names its meshed pod's identity all the same: {mesh}"
        );

        // The CA created: once it has held, calls are mTLS with front's identity.
        server.apply_json(ca_secret(chain, &[chain])).unwrap();
        let mtls = "mtls peer=spiffe://cluster.local/ns/default/sa/front";
        taken_as(web.envoy_log().len(), mtls, HOLD + WITHIN);
        assert_eq!(mesh_mtls(), json!(true));

        // Deleted, and created again once the agent has seen it gone: nothing changes,
        // through more than the hold.
        let mark = web.envoy_log().len();
        assert!(delete_ca());
        wait::until("the agent sees the CA gone", WITHIN, || {
            let (_, identity) = agent.get("/debug/identity").map_err(|e| e.to_string())?;
            let identity: Value = serde_json::from_str(&identity).map_err(|e| e.to_string())?;
            (identity["present"] == json!(false))
                .then_some(())
                .ok_or(identity.to_string())
        })
        .unwrap();
        server.apply_json(ca_secret(chain, &[chain])).unwrap();
        more_calls(calls, "calls through the hold", HOLD_CALLS);
        assert!(
            !front_taken_since(&web, mark, "plaintext"),
            "{}",
            web.envoy_log()
        );
        assert_eq!(mesh_mtls(), json!(true));

        // Deleted for good: once that has held, plaintext again, which web takes.
        assert!(delete_ca());
        taken_as(web.envoy_log().len(), "plaintext", HOLD + WITHIN);
        assert_eq!(mesh_mtls(), json!(false));
        more_calls(calls, "calls in plaintext", 10);
    });
    assert_every_call_passed(&results, &agent.log());
    assert!(app.stats.served() >= served + results.len() as u64);
}

/// How long the agent holds a change of CA before calls follow it (`MESH_MTLS_HOLD`).
const HOLD: Duration = Duration::from_secs(10);
/// Calls at one every 20 ms (and the time each takes) that outlast [`HOLD`].
const HOLD_CALLS: usize = 600;

/// Calls `host` at `to` from `from`, one every 20 ms, while `during` runs, which is given how
/// many calls have been made so far; every call's result.
fn calling_throughout(
    from: &ClientPod,
    to: SocketAddr,
    host: &str,
    during: impl FnOnce(&dyn Fn() -> usize),
) -> Vec<Result<String, String>> {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};
    let results: Mutex<Vec<Result<String, String>>> = Mutex::new(Vec::new());
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let result = from.http(to, host);
                results.lock().unwrap().push(result);
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let calls = || results.lock().unwrap().len();
        // Whatever `during` asserts, the caller stops.
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| during(&calls)));
        stop.store(true, Ordering::Relaxed);
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
    });
    results.into_inner().unwrap()
}

/// Waits until `more` calls beyond those made so far are made.
fn more_calls(calls: &dyn Fn() -> usize, what: &str, more: usize) {
    let from = calls();
    wait::until(what, HOLD + WITHIN, || {
        (calls() >= from + more)
            .then_some(())
            .ok_or(format!("{} calls", calls()))
    })
    .unwrap();
}

/// A restarted agent pushes nothing before it knows whether it has a CA: if it did, its first
/// push would turn calls to meshed pods to plaintext until the CA's Secret was read, and a
/// strict pod would refuse them. Here the Secret cannot be read at all while the agent
/// restarts (its kind answers 404): a request from front to the strict pod web every 20 ms,
/// through the kill -9, the new agent waiting for the CA (not ready, and saying so), and the
/// CA readable again, all pass, and web's Envoy takes none of them in plaintext.
#[test]
fn a_restarted_agent_never_calls_a_strict_pod_in_plaintext() {
    let (front_ip, web_ip) = (Ipv4Addr::new(10, 200, 0, 2), Ipv4Addr::new(10, 200, 0, 3));
    let strict = json!({"lattice.mlab.com/mtls-mode": "strict"});
    let (front_pod, _) = injected_by_default(&pod("front", "front", front_ip, json!({})));
    let (web_pod, _) = injected_by_default(&pod("web", "web", web_ip, strict));
    let objects = front_and_web(front_pod, web_pod, web_ip);
    let mut trusted = TrustedNode::start("restartca", objects, None).unwrap();
    let web = trusted.pod("web", 3, &["--inbound-capture"]).unwrap();
    let _app = Server::http(&web.pod, "web", APP_PORT).unwrap();
    let front = trusted.pod("front", 2, &["--inbound-capture"]).unwrap();
    let host = "web.default.system.internal";
    let web_at = SocketAddr::from((front.resolve(host).unwrap(), APP_PORT));
    wait::until("an mTLS call from front", WITHIN, || {
        front.http(web_at, host)?;
        web.envoy_log()
            .contains("[lattice-inbound] mtls peer=spiffe://cluster.local/ns/default/sa/front")
            .then_some(())
            .ok_or_else(|| "not mTLS yet".to_string())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", trusted.agent.log()));

    let results = calling_throughout(&front, web_at, host, |calls| {
        more_calls(calls, "calls before the restart", 10);
        trusted
            .server
            .uninstall::<k8s_openapi::api::core::v1::Secret>()
            .unwrap();
        trusted.agent.restart();
        // Waiting for the CA, and for nothing else: its mesh translated but held back.
        wait::until("the new agent waiting for the CA", WITHIN, || match trusted
            .agent
            .get("/readyz")
        {
            Ok((503, body))
                if body.contains("the workload CA")
                    && body.contains("envoy resources")
                    && !body.contains("provider") =>
            {
                Ok(())
            }
            other => Err(format!("{other:?}")),
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", trusted.agent.log()));
        more_calls(calls, "calls while the CA cannot be read", 50);
        assert_ne!(trusted.agent.get("/readyz").unwrap().0, 200);
        trusted
            .server
            .install::<k8s_openapi::api::core::v1::Secret>()
            .unwrap();
        trusted
            .server
            .apply_json(ca_secret(&trusted.chain, &[&trusted.chain]))
            .unwrap();
        trusted.agent.wait_ready().unwrap();
        more_calls(calls, "calls once the CA is read again", 50);
    });
    assert_every_call_passed(&results, &trusted.agent.log());
    let log = web.envoy_log();
    assert!(
        !log.lines()
            .any(|l| l.contains("[lattice-inbound] plaintext") && l.contains("from=10.200.0.2")),
        "web took front's call in plaintext: {log}"
    );
}
