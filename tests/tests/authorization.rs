//! Authorization: a service's rules, from the mesh file, enforced by the inbound listener of
//! its endpoint's pod (a real Envoy on the simulated node), against real callers: two meshed
//! pods of their own service accounts calling over mesh mTLS, and a plain pod in plaintext.
//!
//! What fails when the feature breaks:
//! - the allowed service account's requests reach the app, with its SPIFFE ID in
//!   `x-forwarded-client-cert`; a request a deny rule names gets 403;
//! - another service account's requests get 403 and plaintext too (the service has an allow
//!   rule), and never reach the app;
//! - at a TCP port, the allowed caller's connection is echoed, the other's is closed;
//! - Envoy counts the denials, `/debug/xds` shows the proxy's rules;
//! - the rules removed from the file, the refused caller passes, live.
//!
//! Build the binaries first: `cargo build --workspace --bins`.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use lattice_e2e::node::{ClientPod, Server};
use lattice_e2e::trusted::{TrustedNode, inbound_listening, pod};
use lattice_e2e::wait;
use serde_json::json;

const WITHIN: Duration = Duration::from_secs(20);
const WEB_PORT: u16 = 8080;
const ECHO_PORT: u16 = 7000;

/// `/shop/web` (HTTP) and `/shop/echo` (TCP), both served by the pod at `endpoint` as the
/// service account `web`, with `rules` under each when given.
fn mesh(endpoint: Ipv4Addr, rules: Option<(&str, &str)>) -> String {
    let service = |name: &str, port: u16, protocol: &str, rules: Option<&str>| {
        let mut text = format!(
            "  - path: /shop/{name}\n    ports:\n      - port: {port}\n        protocol: {protocol}\n    endpoints:\n      - address: {endpoint}\n    identities: [spiffe://cluster.local/ns/default/sa/web]\n"
        );
        if let Some(rules) = rules {
            text.push_str("    authorization:\n");
            text.push_str(rules);
        }
        text
    };
    let (web, echo) = match rules {
        Some((web, echo)) => (Some(web), Some(echo)),
        None => (None, None),
    };
    format!(
        "services:\n{}{}",
        service("web", WEB_PORT, "http", web),
        service("echo", ECHO_PORT, "tcp", echo)
    )
}

const WEB_RULES: &str = "      - from: [{serviceAccount: default/front}]\n      - action: deny\n        methods: [DELETE]\n      - action: deny\n        paths: [/admin/*]\n";
const ECHO_RULES: &str = "      - from: [{serviceAccount: default/front}]\n";

/// `curl` with `method` from `pod`'s network: the HTTP status (0: no response). The path is
/// sent as written (`--path-as-is`), as a client that means to slip past a rule sends it.
fn status(netns: &lattice_e2e::netns::Netns, method: &str, url: &str) -> u16 {
    let output = netns
        .run(
            "curl",
            &[
                "-4",
                "-s",
                "--path-as-is",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                "5",
                "-X",
                method,
                url,
            ],
        )
        .unwrap();
    String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .unwrap_or(0)
}

/// The value of Envoy's counter `name` in `pod`, 0 when it has none yet.
fn counter(pod: &ClientPod, name: &str) -> u64 {
    let stats = pod
        .envoy_admin(&format!("/stats?filter=^{name}$"))
        .unwrap_or_default();
    stats
        .rsplit(": ")
        .next()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn a_services_rules_refuse_other_callers_and_follow_the_file_live() {
    let (front_ip, guest_ip, web_ip) = (
        Ipv4Addr::new(10, 200, 0, 2),
        Ipv4Addr::new(10, 200, 0, 3),
        Ipv4Addr::new(10, 200, 0, 4),
    );
    let objects = vec![
        pod("front", "front", front_ip, json!({})),
        pod("guest", "guest", guest_ip, json!({})),
        pod(
            "web",
            "web",
            web_ip,
            json!({"lattice.mlab.com/inbound-capture": "enabled"}),
        ),
    ];
    let text = mesh(web_ip, Some((WEB_RULES, ECHO_RULES)));
    let trusted = TrustedNode::start("authz", objects, Some(&text)).unwrap();
    let agent = &trusted.agent;
    let web = trusted.pod("web", 4, &["--inbound-capture"]).unwrap();
    let app = Server::http(&web.pod, "web", WEB_PORT).unwrap();
    let _echo = Server::echo(&web.pod, ECHO_PORT).unwrap();
    wait::until("web's inbound listener", WITHIN, || inbound_listening(&web))
        .unwrap_or_else(|e| panic!("{e}\n{}\n{}", agent.log(), web.envoy_log()));
    let front = trusted.pod("front", 2, &[]).unwrap();
    let guest = trusted.pod("guest", 3, &[]).unwrap();
    let outsider = trusted.node.pod("outsider", 5).unwrap();
    let url = format!("http://web.shop.system.internal:{WEB_PORT}/api/items");

    // The allowed caller: through, its identity forwarded to the app.
    let body = wait::until("front's request to web", WITHIN, || front.curl(&url))
        .unwrap_or_else(|e| panic!("{e}\n{}\n{}", agent.log(), web.envoy_log()));
    assert_eq!(body.trim(), "web");
    let head = app.stats.heads().pop().unwrap_or_default().to_lowercase();
    assert!(
        head.contains("x-forwarded-client-cert:")
            && head.contains("uri=spiffe://cluster.local/ns/default/sa/front"),
        "the app is told who called: {head}"
    );

    // What the rules refuse never reaches the app.
    let served = app.stats.served();
    assert_eq!(status(&front.pod.netns, "DELETE", &url), 403, "deny rule");
    // A path rule holds however the path is spelt: the rules read it as the app will.
    let base = format!("http://web.shop.system.internal:{WEB_PORT}");
    for path in [
        "/admin/x",
        "//admin/x",
        "/api/../admin/x",
        "/./admin/x",
        "/admin%2Fx",
    ] {
        let code = status(&front.pod.netns, "GET", &format!("{base}{path}"));
        assert!(code == 403 || code == 400, "{path}: {code}");
    }
    assert_eq!(status(&guest.pod.netns, "GET", &url), 403, "not allowed");
    let direct = format!("http://{web_ip}:{WEB_PORT}/api/items");
    assert_eq!(
        status(&outsider.netns, "GET", &direct),
        403,
        "plaintext matches no allow rule"
    );
    assert_eq!(
        app.stats.served(),
        served,
        "a refused request reached the app"
    );

    // A TCP port: the allowed caller is echoed, the other's connection closed.
    let echo_at = SocketAddr::from((
        front.resolve("echo.shop.system.internal").unwrap(),
        ECHO_PORT,
    ));
    let echoed = wait::until("front's echo", WITHIN, || {
        front.tcp_exchange(echo_at, b"hello\n")
    })
    .unwrap();
    assert_eq!(echoed, b"hello\n");
    // Guest resolves it first, so that its own Envoy holds the service (each proxy holds what
    // its pod uses) and the refusal is web's.
    guest.resolve("echo.shop.system.internal").unwrap();
    wait::until("guest's Envoy holding echo", WITHIN, || {
        let clusters = guest.envoy_admin("/clusters")?;
        clusters
            .contains("echo.shop.system.internal|7000::")
            .then_some(())
            .ok_or(clusters)
    })
    .unwrap();
    let refused = guest.tcp_exchange(echo_at, b"hello\n");
    assert!(
        refused.as_deref().map_or(true, <[u8]>::is_empty),
        "guest echoed: {refused:?}"
    );

    // What an operator sees: Envoy's denial counters, the proxy's rules in /debug/xds.
    let denied_http = [
        "mtls_8080.rbac.allow",
        "mtls_8080.rbac.deny",
        "plaintext_8080.rbac.allow",
    ]
    .iter()
    .map(|filter| counter(&web, &format!("http.inbound_{filter}.denied")))
    .sum::<u64>();
    assert!(
        denied_http >= 3,
        "HTTP denials counted: {denied_http}\n{}",
        web.envoy_admin("/stats?filter=rbac").unwrap_or_default()
    );
    wait::until("the TCP denial counted", WITHIN, || {
        let denied = counter(&web, "tcp.inbound_mtls_7000.allow.rbac.denied");
        (denied >= 1).then_some(()).ok_or(denied.to_string())
    })
    .unwrap_or_else(|e| {
        panic!(
            "{e}\n{}\n{}",
            web.envoy_admin("/stats?filter=rbac").unwrap_or_default(),
            web.envoy_log()
        )
    });
    let (_, proxies) = agent.get("/debug/xds").unwrap();
    assert!(
        proxies.contains("\"authorization_rules\":4"),
        "web's proxy shows its rules: {proxies}"
    );

    // The rules removed: open again, live, without a restart.
    trusted
        .mesh
        .as_ref()
        .unwrap()
        .write_text(&mesh(web_ip, None))
        .unwrap();
    wait::until("guest let through", WITHIN, || guest.curl(&url))
        .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
    // A connection front's Envoy opened before is drained: its next response closes it.
    wait::until("front's DELETE let through", WITHIN, || {
        match status(&front.pod.netns, "DELETE", &url) {
            200 => Ok(()),
            other => Err(other.to_string()),
        }
    })
    .unwrap();
    assert_eq!(guest.tcp_exchange(echo_at, b"hello\n").unwrap(), b"hello\n");
}

/// A pod as the injector admits it with inbound capture, labelled as meshed.
fn meshed_pod(name: &str, ip: Ipv4Addr) -> serde_json::Value {
    let mut object = pod(
        name,
        name,
        ip,
        json!({"lattice.mlab.com/inbound-capture": "enabled",
               "lattice.mlab.com/service-account": name}),
    );
    object["metadata"]["labels"] = json!({"lattice.mlab.com/inbound-capture": "enabled"});
    object
}

/// The same rules from Kubernetes: a `MeshAuthorization` attached to the Service `default/web`
/// (whose EndpointSlice names web's meshed pod), read through the agent's real watch of the
/// fake API server. The allowed service account passes, another gets 403; a second resource
/// that does not read closes the Service to everyone (fail closed); deleting both opens it.
#[test]
fn a_mesh_authorization_resource_protects_its_service() {
    use lattice_e2e::k8s_objects::{self, MeshAuthorization, mesh_authorization};
    let (front_ip, guest_ip, web_ip, starting_ip) = (
        Ipv4Addr::new(10, 200, 0, 2),
        Ipv4Addr::new(10, 200, 0, 3),
        Ipv4Addr::new(10, 200, 0, 4),
        Ipv4Addr::new(10, 200, 0, 6),
    );
    let ports = json!([{"name": "http", "port": WEB_PORT, "appProtocol": "http"}]);
    // `web-starting` serves the Service but is not ready yet: sent no traffic, but dialled
    // directly it must be as closed as its ready sibling.
    let endpoints = json!([
        {"addresses": [web_ip.to_string()], "conditions": {"ready": true},
         "targetRef": {"kind": "Pod", "namespace": "default", "name": "web"}},
        {"addresses": [starting_ip.to_string()], "conditions": {"ready": false},
         "targetRef": {"kind": "Pod", "namespace": "default", "name": "web-starting"}},
    ]);
    let objects = vec![
        pod("front", "front", front_ip, json!({})),
        pod("guest", "guest", guest_ip, json!({})),
        meshed_pod("web", web_ip),
        meshed_pod("web-starting", starting_ip),
        k8s_objects::service("default", "web", ports),
        k8s_objects::slice(
            "default",
            "web-1",
            "web",
            json!([{"name": "http", "port": WEB_PORT}]),
            endpoints,
        ),
        mesh_authorization(
            "default",
            "web-callers",
            "web",
            json!([{"from": [{"serviceAccount": "default/front"}]}]),
        ),
    ];
    let trusted = TrustedNode::start("authzkube", objects, None).unwrap();
    let (server, agent) = (&trusted.server, &trusted.agent);
    let web = trusted.pod("web", 4, &["--inbound-capture"]).unwrap();
    let app = Server::http(&web.pod, "web", WEB_PORT).unwrap();
    wait::until("web's inbound listener", WITHIN, || inbound_listening(&web)).unwrap();
    let front = trusted.pod("front", 2, &[]).unwrap();
    let guest = trusted.pod("guest", 3, &[]).unwrap();
    let url = format!("http://web.default.system.internal:{WEB_PORT}/");
    let status_of = |pod: &ClientPod| status(&pod.pod.netns, "GET", &url);
    let becomes = |what: &str, pod: &ClientPod, wanted: u16| {
        wait::until(what, WITHIN, || match status_of(pod) {
            code if code == wanted => Ok(()),
            code => Err(code.to_string()),
        })
        .unwrap_or_else(|e| panic!("{e}\n{}\n{}", agent.log(), web.envoy_log()));
    };
    becomes("front let through", &front, 200);
    becomes("guest refused", &guest, 403);
    let starting = trusted
        .pod("web-starting", 6, &["--inbound-capture"])
        .unwrap();
    let _starting_app = Server::http(&starting.pod, "web-starting", WEB_PORT).unwrap();
    wait::until("web-starting's inbound listener", WITHIN, || {
        inbound_listening(&starting)
    })
    .unwrap();
    let outsider = trusted.node.pod("outsider", 5).unwrap();
    let direct = format!("http://{starting_ip}:{WEB_PORT}/");
    assert_eq!(
        status(&outsider.netns, "GET", &direct),
        403,
        "a pod not ready yet is covered by its Service's rules"
    );

    server
        .apply_json(mesh_authorization(
            "default",
            "typo",
            "web",
            json!([{"form": [{"namespace": "default"}]}]),
        ))
        .unwrap();
    becomes(
        "front refused by a resource that does not read",
        &front,
        403,
    );
    let served = app.stats.served();
    assert_eq!(status_of(&front), 403);
    assert_eq!(
        app.stats.served(),
        served,
        "a refused request reached the app"
    );
    assert!(
        agent.log().contains("MeshAuthorization does not read"),
        "the agent says why"
    );

    for name in ["web-callers", "typo"] {
        server.delete::<MeshAuthorization>("default", name).unwrap();
    }
    becomes("guest let through", &guest, 200);
}
