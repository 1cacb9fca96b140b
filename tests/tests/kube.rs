//! End-to-end tests of the Kubernetes source: the real `lattice-agent` binary, pointed through
//! a kubeconfig at the fake API server, which speaks the real list/watch wire protocol.
//!
//! The expected mesh is computed here, independently of the agent's code, from the objects the
//! fake server holds, and compared with the agent's `/debug/mesh`.
//!
//! Build the binary first: `cargo build -p lattice-agent --bins`. The scale test is ignored by
//! default: `cargo test -p lattice-e2e --test kube -- --ignored --nocapture scale`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use lattice_e2e::agent::Agent;
use lattice_e2e::envoy::{AdsMode, Envoy};
use lattice_e2e::fake_apiserver::FakeApiServer;
use lattice_e2e::k8s_objects::{ip, populate, ready, service, slice};
use lattice_e2e::wait;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

/// The watches the agent keeps open on a cluster-wide source: one per kind it reads.
/// Services, EndpointSlices, HTTPRoutes, GRPCRoutes, ReferenceGrants, MeshAuthorizations, the
/// path grants ConfigMap, and the Secret of the CA of workload certificates.
const WATCHES: usize = 8;
/// How long a change may take to show up in normal operation: the same bar as the data path's.
const FOLLOW: Duration = Duration::from_secs(1);
/// How long recovery from a fault may take: the watcher backs off (0.8 s doubling) on errors.
const RECOVER: Duration = Duration::from_secs(30);

const PATH_ANNOTATION: &str = "lattice.mlab.com/path";

/// The mesh as a source decides it: path → ports (port, protocol, sorted endpoints).
type Mesh = BTreeMap<String, Value>;

/// The expected mesh, from the objects the fake server holds, by the rules of
/// docs/kubernetes.md. Written without the agent's code, so a shared bug cannot hide.
fn truth(server: &FakeApiServer) -> Mesh {
    let services: Vec<Service> = server.objects().unwrap();
    let slices: Vec<EndpointSlice> = server.objects().unwrap();
    // (namespace, service name) → its IPv4 slices.
    let mut slices_of: BTreeMap<(String, String), Vec<&EndpointSlice>> = BTreeMap::new();
    for s in slices.iter().filter(|s| s.address_type == "IPv4") {
        if let Some(owner) = s
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("kubernetes.io/service-name"))
        {
            let namespace = s.metadata.namespace.clone().unwrap_or_default();
            slices_of
                .entry((namespace, owner.clone()))
                .or_default()
                .push(s);
        }
    }
    let mut mesh = Mesh::new();
    for svc in services {
        let spec = svc.spec.clone().unwrap_or_default();
        if spec.type_.as_deref() == Some("ExternalName") {
            continue;
        }
        let namespace = svc.metadata.namespace.clone().unwrap();
        let name = svc.metadata.name.clone().unwrap();
        let path = svc
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(PATH_ANNOTATION).cloned())
            .unwrap_or_else(|| format!("/{namespace}/{name}"));
        let mut ports = Vec::new();
        for port in spec.ports.unwrap_or_default() {
            if port.protocol.as_deref().is_some_and(|p| p != "TCP") {
                continue;
            }
            let port_name = port.name.clone().unwrap_or_default();
            let protocol = match (port.app_protocol.as_deref(), port_name.split('-').next()) {
                (Some("http"), _) => "http",
                (Some("kubernetes.io/h2c" | "http2"), _) => "http2",
                (Some("grpc"), _) => "grpc",
                (Some(_), _) => "tcp",
                (None, Some("http")) => "http",
                (None, Some("http2")) => "http2",
                (None, Some("grpc")) => "grpc",
                _ => "tcp",
            };
            let mut endpoints: Vec<SocketAddr> = Vec::new();
            let own = slices_of.get(&(namespace.clone(), name.clone()));
            for s in own.into_iter().flatten() {
                let Some(target) = s
                    .ports
                    .iter()
                    .flatten()
                    .find(|p| p.name.clone().unwrap_or_default() == port_name)
                    .and_then(|p| p.port)
                else {
                    continue;
                };
                for e in &s.endpoints {
                    let c = e.conditions.as_ref();
                    if c.and_then(|c| c.ready) == Some(false)
                        || c.and_then(|c| c.terminating) == Some(true)
                    {
                        continue;
                    }
                    for a in &e.addresses {
                        endpoints.push(SocketAddr::new(a.parse().unwrap(), target as u16));
                    }
                }
            }
            endpoints.sort();
            endpoints.dedup();
            // Every endpoint from the API server is reported as the kubernetes provider's.
            let endpoints: Vec<Value> = endpoints
                .iter()
                .map(|e| json!({"address": e.to_string(), "provider": "kubernetes"}))
                .collect();
            ports.push((
                port.port,
                json!({"port": port.port, "protocol": protocol, "endpoints": endpoints}),
            ));
        }
        ports.sort_by_key(|(port, _)| *port);
        mesh.insert(path, ports.into_iter().map(|(_, p)| p).collect());
    }
    mesh
}

/// The agent's `/debug/mesh`, reduced to what [`truth`] computes.
fn observed(agent: &Agent) -> Result<Mesh, String> {
    let mesh = agent.mesh().map_err(|e| e.to_string())?;
    let services = mesh["services"]
        .as_object()
        .ok_or("no services in /debug/mesh")?;
    Ok(services
        .iter()
        .map(|(path, s)| {
            let ports = s["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| json!({"port": p["port"], "protocol": p["protocol"], "endpoints": p["endpoints"]}))
                .collect();
            (path.clone(), ports)
        })
        .collect())
}

/// Waits until the agent's mesh equals the server's state; returns how long it took.
fn converge(agent: &Agent, server: &FakeApiServer, within: Duration, what: &str) -> Duration {
    let expected = truth(server);
    let start = Instant::now();
    let mut attempts = 0;
    let result = wait::until(what, within, || {
        attempts += 1;
        // A big mesh is a big /debug/mesh: poll it less often, so the poll is not the load.
        if expected.len() > 2000 && attempts > 1 {
            std::thread::sleep(Duration::from_millis(250));
        }
        let seen = observed(agent)?;
        if seen == expected {
            Ok(())
        } else {
            Err(diff(&expected, &seen))
        }
    });
    if let Err(err) = result {
        panic!("{err}\nagent log:\n{}", tail(&agent.log()));
    }
    start.elapsed()
}

fn diff(expected: &Mesh, seen: &Mesh) -> String {
    let mut out = Vec::new();
    for (path, want) in expected {
        match seen.get(path) {
            None => out.push(format!("missing {path}")),
            Some(got) if got != want => out.push(format!("{path}: want {want} got {got}")),
            _ => {}
        }
    }
    for path in seen.keys().filter(|p| !expected.contains_key(*p)) {
        out.push(format!("unexpected {path}"));
    }
    let total = out.len();
    out.truncate(5);
    format!("{total} differences: {}", out.join("; "))
}

fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(60)..].join("\n")
}

/// A fake API server and an agent watching it.
struct Cluster {
    server: FakeApiServer,
    _dir: tempfile::TempDir,
    agent: Agent,
}

impl Cluster {
    /// Starts the agent against `server`; `up` says whether to wait for readiness.
    fn start(server: FakeApiServer, up: bool) -> Cluster {
        Cluster::start_with(server, up, &[])
    }

    fn start_with(server: FakeApiServer, up: bool, args: &[&str]) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        server.write_kubeconfig(&kubeconfig).unwrap();
        let agent = Agent::start_with_env(args, &[("KUBECONFIG", kubeconfig.to_str().unwrap())]);
        if up {
            agent.wait_ready().unwrap();
        }
        Cluster {
            server,
            _dir: dir,
            agent,
        }
    }
}

fn seed(server: &FakeApiServer) {
    server
        .apply_json(service(
            "shop",
            "web",
            json!([{"name": "http", "port": 80, "targetPort": "web"}]),
        ))
        .unwrap();
    server
        .apply_json(slice(
            "shop",
            "web-1",
            "web",
            json!([{"name": "http", "port": 8080}]),
            ready(&[ip(1), ip(2)]),
        ))
        .unwrap();
    server
        .apply_json(service(
            "shop",
            "db",
            json!([{"name": "tcp-pg", "port": 5432}]),
        ))
        .unwrap();
    server
        .apply_json(slice(
            "shop",
            "db-1",
            "db",
            json!([{"name": "tcp-pg", "port": 5432}]),
            ready(&[ip(10)]),
        ))
        .unwrap();
}

/// One change applied to the server.
type Step = Box<dyn Fn(&FakeApiServer)>;

#[test]
fn services_and_slices_appear_and_changes_follow_within_a_second() {
    let server = FakeApiServer::start().unwrap();
    seed(&server);
    let cluster = Cluster::start(server, true);
    let (server, agent) = (&cluster.server, &cluster.agent);
    converge(agent, server, FOLLOW, "initial mesh");

    let mut steps: Vec<(&str, Step)> = vec![
        (
            "new service",
            Box::new(|s| {
                s.apply_json(service(
                    "shop",
                    "api",
                    json!([{"name": "grpc", "port": 9090}]),
                ))
                .unwrap();
            }),
        ),
        (
            "its slice",
            Box::new(|s| {
                s.apply_json(slice(
                    "shop",
                    "api-1",
                    "api",
                    json!([{"name": "grpc", "port": 9090}]),
                    ready(&[ip(20)]),
                ))
                .unwrap();
            }),
        ),
        (
            "a second slice of the same service, another target port",
            Box::new(|s| {
                s.apply_json(slice(
                    "shop",
                    "web-2",
                    "web",
                    json!([{"name": "http", "port": 8081}]),
                    ready(&[ip(3)]),
                ))
                .unwrap();
            }),
        ),
        (
            "an endpoint turns not ready, another terminating",
            Box::new(|s| {
                s.apply_json(slice(
                    "shop",
                    "web-1",
                    "web",
                    json!([{"name": "http", "port": 8080}]),
                    json!([
                        {"addresses": [ip(1)], "conditions": {"ready": false}},
                        {"addresses": [ip(2)], "conditions": {"ready": true, "terminating": true}},
                        {"addresses": [ip(4)]},
                    ]),
                ))
                .unwrap();
            }),
        ),
        (
            "an IPv6 slice is ignored",
            Box::new(|s| {
                let mut v6 = slice(
                    "shop",
                    "web-v6",
                    "web",
                    json!([{"name": "http", "port": 8080}]),
                    ready(&["fd00::1".into()]),
                );
                v6["addressType"] = "IPv6".into();
                s.apply_json(v6).unwrap();
            }),
        ),
        (
            "annotation moves a service",
            Box::new(|s| {
                let mut db = service("shop", "db", json!([{"name": "tcp-pg", "port": 5432}]));
                db["metadata"]["annotations"] = json!({PATH_ANNOTATION: "/shop/postgres/main"});
                s.apply_json(db).unwrap();
            }),
        ),
        (
            "slice deleted",
            Box::new(|s| {
                s.delete::<EndpointSlice>("shop", "web-2").unwrap();
            }),
        ),
        (
            "service deleted",
            Box::new(|s| {
                s.delete::<Service>("shop", "api").unwrap();
            }),
        ),
    ];
    for (what, change) in steps.drain(..) {
        change(server);
        let took = converge(agent, server, FOLLOW, what);
        println!("{what}: followed in {took:?}");
    }
    assert!(
        agent.log().contains("IPv6"),
        "the ignored IPv6 slice must be logged"
    );
}

#[test]
fn namespace_flag_limits_the_watch_and_relists_per_namespace() {
    let server = FakeApiServer::start().unwrap();
    seed(&server);
    let http = json!([{"name": "http", "port": 80}]);
    for ns in ["other", "third"] {
        server.apply_json(service(ns, "web", http.clone())).unwrap();
        server
            .apply_json(slice(ns, "web-1", "web", http.clone(), ready(&[ip(50)])))
            .unwrap();
    }
    let cluster = Cluster::start_with(server, true, &["--namespace=shop,other"]);
    let (server, agent) = (&cluster.server, &cluster.agent);
    let in_scope = |server: &FakeApiServer| -> Mesh {
        truth(server)
            .into_iter()
            .filter(|(path, _)| path.starts_with("/shop/") || path.starts_with("/other/"))
            .collect()
    };
    let check = |what: &str, within: Duration| {
        let expected = in_scope(server);
        wait::until(what, within, || {
            let seen = observed(agent)?;
            (seen == expected)
                .then_some(())
                .ok_or_else(|| diff(&expected, &seen))
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", tail(&agent.log())));
    };
    check("only the watched namespaces", FOLLOW);
    server
        .apply_json(service("third", "late", http.clone()))
        .unwrap();
    server
        .apply_json(service("other", "late", http.clone()))
        .unwrap();
    check(
        "a change in a watched namespace, none from the other",
        FOLLOW,
    );
    // A 410 re-lists each namespace's watch; neither wipes the other's services.
    server.expire_history();
    server.delete::<Service>("other", "late").unwrap();
    check("state after per-namespace re-lists", RECOVER);
}

/// Envoy's mesh clusters (`name|port`) and their endpoints.
fn envoy_clusters(envoy: &Envoy) -> Result<BTreeMap<String, Vec<String>>, String> {
    let mut clusters = envoy.cluster_endpoints()?;
    clusters.retain(|name, _| name.contains(".system.internal|"));
    Ok(clusters)
}

fn dig(agent: &Agent, name: &str) -> Option<String> {
    let out = lattice_e2e::dig::command()
        .args([
            &format!("@{}", agent.dns.ip()),
            "-p",
            &agent.dns.port().to_string(),
            "+short",
            "+tries=1",
            "+time=1",
            name,
        ])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (!text.is_empty()).then_some(text)
}

#[test]
fn kubernetes_services_reach_a_real_envoy_and_dns_within_a_second() {
    let server = FakeApiServer::start().unwrap();
    seed(&server);
    let cluster = Cluster::start(server, true);
    let (server, agent) = (&cluster.server, &cluster.agent);
    let envoy = Envoy::start("kube-test", agent.xds, AdsMode::Sotw);
    envoy.wait_live().unwrap();
    let wait_envoy = |what: &str, want: &[(&str, &[String])], within: Duration| {
        let want: BTreeMap<String, Vec<String>> = want
            .iter()
            .map(|(c, eps)| (c.to_string(), eps.to_vec()))
            .collect();
        let start = Instant::now();
        wait::until(what, within, || {
            let got = envoy_clusters(&envoy)?;
            (got == want).then_some(()).ok_or(format!("{got:?}"))
        })
        .unwrap_or_else(|e| panic!("{e}\nenvoy log:\n{}", tail(&envoy.log())));
        start.elapsed()
    };
    let ep = |n: u32, port: u16| format!("{}:{port}", ip(n));
    wait_envoy(
        "Envoy clusters from Kubernetes",
        &[
            ("db.shop.system.internal|5432", &[ep(10, 5432)]),
            ("web.shop.system.internal|80", &[ep(1, 8080), ep(2, 8080)]),
        ],
        Duration::from_secs(10),
    );
    assert_eq!(
        dig(agent, "web.shop.system.internal").as_deref(),
        Some("240.240.0.1")
    );

    server
        .apply_json(slice(
            "shop",
            "web-1",
            "web",
            json!([{"name": "http", "port": 8080}]),
            ready(&[ip(2), ip(3)]),
        ))
        .unwrap();
    server
        .apply_json(service(
            "shop",
            "api",
            json!([{"name": "http", "port": 8000}]),
        ))
        .unwrap();
    let took = wait_envoy(
        "Envoy follows a slice change and a new service",
        &[
            ("api.shop.system.internal|8000", &[]),
            ("db.shop.system.internal|5432", &[ep(10, 5432)]),
            ("web.shop.system.internal|80", &[ep(2, 8080), ep(3, 8080)]),
        ],
        FOLLOW,
    );
    println!("Envoy followed in {took:?}");
    let start = Instant::now();
    wait::until("DNS answers for the new service", FOLLOW, || {
        dig(agent, "api.shop.system.internal").ok_or_else(|| "no answer".to_string())
    })
    .unwrap();
    println!("DNS followed in {:?}", start.elapsed());
}

#[test]
fn faults_mid_run_end_with_the_agent_equal_to_the_server() {
    let server = FakeApiServer::start().unwrap();
    seed(&server);
    let cluster = Cluster::start(server, true);
    let (server, agent) = (&cluster.server, &cluster.agent);
    converge(agent, server, FOLLOW, "initial mesh");
    let mut n = 100;
    let mut churn = |server: &FakeApiServer| {
        n += 1;
        let name = format!("svc{n}");
        server
            .apply_json(service(
                "churn",
                &name,
                json!([{"name": "http", "port": 80}]),
            ))
            .unwrap();
        server
            .apply_json(slice(
                "churn",
                &format!("{name}-1"),
                &name,
                json!([{"name": "http", "port": 80}]),
                ready(&[ip(n)]),
            ))
            .unwrap();
        server
            .delete::<Service>("churn", &format!("svc{}", n - 1))
            .unwrap();
        server
            .apply_json(slice(
                "shop",
                "web-1",
                "web",
                json!([{"name": "http", "port": 8080}]),
                ready(&[ip(n), ip(n + 1000)]),
            ))
            .unwrap();
    };

    // 1. Every watch ends: the agent resumes from its last resourceVersion.
    let requests = server.requests();
    server.drop_watches();
    churn(server);
    converge(agent, server, RECOVER, "mesh after dropped watches");
    // Every kind the agent reads (WATCHES).
    wait::until("every watch reopened", RECOVER, || {
        (server.open_watches() == WATCHES)
            .then_some(())
            .ok_or(server.open_watches().to_string())
    })
    .unwrap();
    println!(
        "dropped watches: {} requests to recover",
        server.requests() - requests
    );

    // 2. History compacted: open watches get a 410 ERROR event; the agent re-lists.
    server.expire_history();
    churn(server);
    churn(server);
    converge(agent, server, RECOVER, "mesh after 410 Gone");
    assert!(
        agent.log().contains("too old resource version"),
        "the 410 must reach the agent:\n{}",
        tail(&agent.log())
    );

    // 3. The API server goes away while things change, then comes back on the same port.
    server.stop();
    churn(server);
    server.delete::<Service>("shop", "db").unwrap();
    server.restart().unwrap();
    converge(agent, server, RECOVER, "mesh after API server restart");

    // 4. Restart combined with compaction: the resume is refused and the re-list catches up.
    server.stop();
    churn(server);
    server.expire_history();
    server.restart().unwrap();
    converge(
        agent,
        server,
        RECOVER,
        "mesh after restart with compacted history",
    );

    // And normal operation continues at normal speed.
    churn(server);
    converge(agent, server, FOLLOW, "a change after the faults");
}

#[test]
fn api_server_down_at_start_keeps_readyz_false_then_recovers() {
    let server = FakeApiServer::start().unwrap();
    seed(&server);
    server.stop();
    let cluster = Cluster::start(server, false);
    let (server, agent) = (&cluster.server, &cluster.agent);
    // The agent says why it is not ready, and is not ready.
    wait::until("the agent to log the failed list", RECOVER, || {
        let log = agent.log();
        log.contains("retrying with backoff")
            .then_some(())
            .ok_or_else(|| tail(&log))
    })
    .unwrap();
    let (status, _) = agent.get("/readyz").unwrap();
    assert_ne!(status, 200, "ready without ever listing");
    let (status, body) = agent.get("/debug/mesh").unwrap();
    assert!(
        status != 200 || !body.contains("/shop/"),
        "published a mesh without listing: {body}"
    );
    // Still retrying a second time (backoff, not a give-up).
    wait::until("a second retry", RECOVER, || {
        let log = agent.log();
        (log.matches("retrying with backoff").count() >= 3)
            .then_some(())
            .ok_or_else(|| tail(&log))
    })
    .unwrap();
    assert_ne!(agent.get("/readyz").unwrap().0, 200);

    server.restart().unwrap();
    wait::until(
        "readyz after the API server came up",
        RECOVER,
        || match agent.get("/readyz") {
            Ok((200, _)) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    )
    .unwrap();
    converge(agent, server, FOLLOW, "mesh after a late API server");
}

/// Applies one random change; every kind of change the index handles.
fn random_update(server: &FakeApiServer, rng: &mut StdRng, services: usize, next_ip: &mut u32) {
    let i = rng.random_range(0..services);
    let name = format!("svc{i}");
    let namespace = format!("ns{}", i % 10);
    let mut ips = |count: usize| -> Vec<String> {
        (0..count)
            .map(|_| {
                *next_ip += 1;
                ip(*next_ip)
            })
            .collect()
    };
    match rng.random_range(0..8) {
        // New endpoints for the service's slice.
        0..=2 => {
            let count = rng.random_range(1..=10);
            server
                .apply_json(slice(
                    &namespace,
                    &format!("{name}-a"),
                    &name,
                    json!([{"name": "http", "port": 8080}]),
                    ready(&ips(count)),
                ))
                .unwrap();
        }
        // Some endpoints not ready or terminating.
        3 => {
            let endpoints: Vec<Value> = ips(4)
                .into_iter()
                .enumerate()
                .map(|(k, ip)| match k {
                    0 => json!({"addresses": [ip], "conditions": {"ready": false}}),
                    1 => json!({"addresses": [ip], "conditions": {"terminating": true, "ready": false}}),
                    _ => json!({"addresses": [ip]}),
                })
                .collect();
            server
                .apply_json(slice(
                    &namespace,
                    &format!("{name}-a"),
                    &name,
                    json!([{"name": "http", "port": 8080}]),
                    endpoints.into(),
                ))
                .unwrap();
        }
        // A second slice, or its removal.
        4 => {
            if rng.random_bool(0.5) {
                server
                    .apply_json(slice(
                        &namespace,
                        &format!("{name}-b"),
                        &name,
                        json!([{"name": "http", "port": 8081}]),
                        ready(&ips(2)),
                    ))
                    .unwrap();
            } else {
                server
                    .delete::<EndpointSlice>(&namespace, &format!("{name}-b"))
                    .unwrap();
            }
        }
        // The service's ports change shape.
        5 => {
            let ports = if rng.random_bool(0.5) {
                json!([{"name": "http", "port": 80}, {"name": "tcp-admin", "port": 9000}])
            } else {
                json!([{"name": "http", "port": 80, "appProtocol": "kubernetes.io/h2c"}])
            };
            server
                .apply_json(service(&namespace, &name, ports))
                .unwrap();
        }
        // Deleted, or back.
        6 => {
            if rng.random_bool(0.5) {
                server.delete::<Service>(&namespace, &name).unwrap();
            } else {
                server
                    .apply_json(service(
                        &namespace,
                        &name,
                        json!([{"name": "http", "port": 80}]),
                    ))
                    .unwrap();
            }
        }
        // Moved to an annotated path.
        _ => {
            let mut svc = service(&namespace, &name, json!([{"name": "http", "port": 80}]));
            svc["metadata"]["annotations"] =
                json!({PATH_ANNOTATION: format!("/{namespace}/moved/{name}")});
            server.apply_json(svc).unwrap();
        }
    }
}

#[test]
fn thousand_services_then_thousand_random_updates_end_at_the_truth() {
    let server = FakeApiServer::start().unwrap();
    populate(&server, 1000, 10).unwrap();
    let cluster = Cluster::start(server, true);
    let (server, agent) = (&cluster.server, &cluster.agent);
    converge(agent, server, RECOVER, "1000 services × 10 endpoints");
    let seed: u64 = rand::rng().random();
    println!("random updates with seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut next_ip = 1_000_000;
    for _ in 0..1000 {
        random_update(server, &mut rng, 1000, &mut next_ip);
    }
    let took = converge(agent, server, RECOVER, "mesh after 1000 random updates");
    println!("1000 random updates (seed {seed}) converged {took:?} after the last one");
}

/// The agent's resident set size, from /proc, found by its unique admin address.
fn agent_rss_kib(agent: &Agent) -> Option<u64> {
    let needle = format!("--admin-addr={}", agent.admin);
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline);
            if !cmdline.contains(&needle) || !cmdline.contains("lattice-agent") {
                return None;
            }
            let status = std::fs::read_to_string(entry.path().join("status")).ok()?;
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
}

/// Scale figures (printed, not asserted): time from start to ready and RSS with
/// `LATTICE_BENCH_SERVICES` services (default 10k) of 10 endpoints each. The last line is
/// JSON, for `cargo xtask bench`.
#[test]
#[ignore = "scale run; prints figures: cargo test -p lattice-e2e --test kube -- --ignored --nocapture scale"]
fn scale_10k_services_100k_endpoints_rss_and_time_to_ready() {
    let services: usize = std::env::var("LATTICE_BENCH_SERVICES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let per = 10;
    let server = FakeApiServer::start().unwrap();
    let populate_start = Instant::now();
    populate(&server, services, per).unwrap();
    println!(
        "populated {services} services in {:?}",
        populate_start.elapsed()
    );
    let start = Instant::now();
    let cluster = Cluster::start(server, false);
    let (server, agent) = (&cluster.server, &cluster.agent);
    wait::until(
        "agent ready at scale",
        Duration::from_secs(300),
        || match agent.get("/readyz") {
            Ok((200, _)) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    )
    .unwrap();
    let ready = start.elapsed();
    let rss_ready = agent_rss_kib(agent);
    converge(agent, server, RECOVER, "scale mesh");
    // Steady state after some churn, so the figure includes a few snapshot generations.
    let mut rng = StdRng::seed_from_u64(7);
    let mut next_ip = 10_000_000;
    for _ in 0..1000 {
        random_update(server, &mut rng, services, &mut next_ip);
    }
    let churn_start = Instant::now();
    converge(agent, server, RECOVER, "scale mesh after churn");
    let churn = churn_start.elapsed();
    let rss_after = agent_rss_kib(agent);
    let report = json!({
        "services": services,
        "endpoints": services * per,
        "start_to_ready_ms": ready.as_millis() as u64,
        "rss_at_ready_mib": rss_ready.map(|k| k as f64 / 1024.0),
        "rss_after_1000_updates_mib": rss_after.map(|k| k as f64 / 1024.0),
        "converge_after_1000_updates_ms": churn.as_millis() as u64,
    });
    println!("BENCH_KUBE_JSON {report}");
}

/// The `/debug/routes` JSON.
fn routes(agent: &Agent) -> Result<Value, String> {
    match agent.get("/debug/routes") {
        Ok((200, body)) => serde_json::from_str(&body).map_err(|e| e.to_string()),
        other => Err(format!("{other:?}")),
    }
}

#[test]
fn without_gateway_api_crds_the_agent_is_ready_and_reads_routes_once_they_appear() {
    use gateway_api::experimental::httproutes::HttpRoute;
    use gateway_api::grpcroutes::GrpcRoute;
    use gateway_api::referencegrants::ReferenceGrant;
    use lattice_e2e::k8s_objects::{http_route, service_parent};

    let server = FakeApiServer::start().unwrap();
    seed(&server);
    server
        .apply_json(service(
            "shop",
            "web-green",
            json!([{"name": "http", "port": 80}]),
        ))
        .unwrap();
    server.uninstall::<HttpRoute>().unwrap();
    server.uninstall::<GrpcRoute>().unwrap();
    server.uninstall::<ReferenceGrant>().unwrap();
    let cluster = Cluster::start(server, true);
    let (server, agent) = (&cluster.server, &cluster.agent);
    converge(agent, server, FOLLOW, "mesh without the Gateway API");
    let log = agent.log();
    assert!(
        log.contains("httproutes.gateway.networking.k8s.io") && log.contains("not installed"),
        "no clear line about the missing CRDs:\n{}",
        tail(&log)
    );

    // The CRDs arrive, then a route: it applies without a restart.
    server.install::<HttpRoute>().unwrap();
    server.install::<GrpcRoute>().unwrap();
    server.install::<ReferenceGrant>().unwrap();
    server
        .apply_json(http_route(
            "shop",
            "green",
            json!([service_parent("web", Some(80))]),
            json!([{"backendRefs": [{"name": "web-green", "port": 80}]}]),
        ))
        .unwrap();
    // And one the agent must refuse: its parent has a TCP port.
    server
        .apply_json(http_route(
            "shop",
            "on-db",
            json!([service_parent("db", None)]),
            json!([{"backendRefs": [{"name": "web-green", "port": 80}]}]),
        ))
        .unwrap();
    let seen = wait::until("the routes on /debug/routes", RECOVER, || {
        let routes = routes(agent)?;
        let applied =
            routes["services"][0]["rules"][0]["backends"][0]["target"]["path"] == "/shop/web-green";
        let refused = routes["rejected"][0]["route"] == "HTTPRoute shop/on-db";
        (applied && refused)
            .then_some(routes.clone())
            .ok_or(routes.to_string())
    })
    .unwrap();
    assert_eq!(seen["services"][0]["service"], "/shop/web");
    assert!(
        seen["rejected"][0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("tcp port (5432)")),
        "{seen}"
    );
    // The gauge is set when the snapshot is published, a moment after the routes' view.
    wait::until("the refusal counted in the metrics", RECOVER, || {
        let (_, metrics) = agent.get("/metrics").map_err(|e| e.to_string())?;
        metrics
            .contains("lattice_mesh_rejected_routes 1")
            .then_some(())
            .ok_or(metrics)
    })
    .unwrap();
    assert!(
        agent.log().contains("route refused"),
        "{}",
        tail(&agent.log())
    );

    // Deleting the route restores plain routing.
    server.delete::<HttpRoute>("shop", "green").unwrap();
    wait::until("the route gone from /debug/routes", RECOVER, || {
        let routes = routes(agent)?;
        routes["services"]
            .as_array()
            .is_some_and(Vec::is_empty)
            .then_some(())
            .ok_or(routes.to_string())
    })
    .unwrap();
}

/// The changes a restore undoes: a Service added, one deleted, endpoints moved.
fn changes_after_backup(server: &FakeApiServer) {
    server
        .apply_json(service(
            "shop",
            "cart",
            json!([{"name": "http", "port": 80}]),
        ))
        .unwrap();
    server.delete::<Service>("shop", "db").unwrap();
    server
        .apply_json(slice(
            "shop",
            "web-1",
            "web",
            json!([{"name": "http", "port": 8080}]),
            ready(&[ip(3)]),
        ))
        .unwrap();
}

#[test]
fn a_restore_from_backup_is_followed_to_the_restored_state() {
    let server = FakeApiServer::start().unwrap();
    seed(&server);
    let cluster = Cluster::start_with(server, true, &["--kube-rollback-check-secs", "1"]);
    let (server, agent) = (&cluster.server, &cluster.agent);
    converge(agent, server, FOLLOW, "initial mesh");
    let backup = server.backup();
    changes_after_backup(server);
    converge(agent, server, FOLLOW, "the changes after the backup");

    // Restored without etcd's revision bump: every version the watches resume from is ahead
    // of the server, which sends them nothing; a change after the restore reuses versions.
    server.restore(&backup);
    server
        .apply_json(service(
            "shop",
            "after",
            json!([{"name": "http", "port": 80}]),
        ))
        .unwrap();
    let took = converge(
        agent,
        server,
        RECOVER,
        "the restored state and the change after it",
    );
    println!("converged {took:?} after a restore without the revision bump");
    assert!(
        agent.log().contains("went back in time"),
        "{}",
        tail(&agent.log())
    );

    // Restored with it: every watch gets 410 and re-lists.
    let backup = server.backup();
    changes_after_backup(server);
    converge(agent, server, FOLLOW, "the changes after the second backup");
    server.restore_bumped(&backup, 1_000_000);
    let took = converge(agent, server, RECOVER, "the state restored with the bump");
    println!("converged {took:?} after a restore with the revision bump");
    // Each watch is fresh again once it has listed (after its backoff).
    wait::until("the provider fresh", RECOVER, || {
        let mesh = agent.mesh().map_err(|e| e.to_string())?;
        let stale = &mesh["providers"][0]["stale"];
        if stale.is_null() {
            Ok(())
        } else {
            Err(stale.to_string())
        }
    })
    .unwrap();
}

fn annotated_service(namespace: &str, name: &str, path: &str, created: &str) -> Value {
    let mut svc = service(namespace, name, json!([{"name": "http", "port": 80}]));
    svc["metadata"]["annotations"] = json!({PATH_ANNOTATION: path});
    svc["metadata"]["creationTimestamp"] = created.into();
    svc
}

/// Who holds `/payments/api`, and the refusals `/debug/mesh` lists.
fn payments_api(agent: &Agent) -> Result<(Option<Value>, Vec<Value>), String> {
    let mesh = agent.mesh().map_err(|e| e.to_string())?;
    let holder = mesh["services"].get("/payments/api").cloned();
    let refused = mesh["refused_paths"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    Ok((holder, refused))
}

#[test]
fn a_tenant_cannot_take_a_path_outside_its_grant() {
    let server = FakeApiServer::start().unwrap();
    // The tenant's claim is the older one.
    server
        .apply_json(annotated_service(
            "tenant",
            "grab",
            "/payments/api",
            "2020-01-01T00:00:00Z",
        ))
        .unwrap();
    server
        .apply_json(annotated_service(
            "payments",
            "gateway",
            "/payments/api",
            "2024-01-01T00:00:00Z",
        ))
        .unwrap();
    server
        .apply_json(slice(
            "payments",
            "gateway-1",
            "gateway",
            json!([{"name": "http", "port": 80}]),
            ready(&[ip(7)]),
        ))
        .unwrap();
    let cluster = Cluster::start(server, true);
    let (server, agent) = (&cluster.server, &cluster.agent);
    wait::until(
        "the payments team's Service at /payments/api",
        FOLLOW * 10,
        || {
            let (holder, refused) = payments_api(agent)?;
            let endpoints = holder.map(|h| h["ports"][0]["endpoints"].to_string());
            let tenant = refused.iter().find(|r| r["service"] == "tenant/grab");
            match (endpoints, tenant) {
                (Some(e), Some(r))
                    if e.contains(&ip(7))
                        && r["reason"]
                            .as_str()
                            .is_some_and(|r| r.contains("may claim paths under /tenant only")) =>
                {
                    Ok(())
                }
                other => Err(format!("{other:?}")),
            }
        },
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", tail(&agent.log())));
    let (_, metrics) = agent.get("/metrics").unwrap();
    assert!(
        metrics.lines().any(|l| l == "lattice_mesh_refused_paths 1"),
        "{metrics}"
    );

    // A cluster admin grants the tenant /payments: its older claim now wins.
    server
        .apply_json(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"namespace": "lattice-system", "name": "lattice-path-grants"},
            "data": {"tenant": "/payments"},
        }))
        .unwrap();
    wait::until("the granted tenant at /payments/api", FOLLOW * 10, || {
        let (_, refused) = payments_api(agent)?;
        match refused.as_slice() {
            [r] if r["service"] == "payments/gateway"
                && r["reason"]
                    .as_str()
                    .is_some_and(|r| r.contains("held by Service tenant/grab")) =>
            {
                Ok(())
            }
            other => Err(format!("{other:?}")),
        }
    })
    .unwrap();
}

#[test]
fn with_any_path_claims_the_oldest_claim_wins() {
    let server = FakeApiServer::start().unwrap();
    server
        .apply_json(annotated_service(
            "tenant",
            "grab",
            "/payments/api",
            "2020-01-01T00:00:00Z",
        ))
        .unwrap();
    server
        .apply_json(annotated_service(
            "payments",
            "gateway",
            "/payments/api",
            "2024-01-01T00:00:00Z",
        ))
        .unwrap();
    let cluster = Cluster::start_with(server, true, &["--path-claims", "any"]);
    wait::until("the tenant holds /payments/api", FOLLOW * 10, || {
        let (_, refused) = payments_api(&cluster.agent)?;
        match refused.as_slice() {
            [r] if r["service"] == "payments/gateway" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .unwrap();
}

/// A cluster of the `seed` Services whose agent has a state directory: the directory (first,
/// so that it is removed after the cluster stops), the cluster, and the path of the node's
/// last mesh in it.
fn seeded_with_state_dir() -> (tempfile::TempDir, Cluster, std::path::PathBuf) {
    let server = FakeApiServer::start().unwrap();
    seed(&server);
    let state = tempfile::tempdir().unwrap();
    let state_dir = state.path().to_str().unwrap();
    let cluster = Cluster::start_with(server, true, &["--state-dir", state_dir]);
    let last_mesh = state.path().join("mesh.json");
    (state, cluster, last_mesh)
}

/// After a crash, with the API server away, the restarted agent answers the names of the
/// node's last mesh at their addresses, fails every other mesh name retryably (never NXDOMAIN)
/// and is not ready; once the API server answers, the mesh is the cluster's again.
#[test]
fn a_restarted_agent_answers_the_nodes_last_mesh_until_the_api_server_answers() {
    let (_state, mut cluster, last_mesh) = seeded_with_state_dir();
    let (web, db) = ("web.shop.system.internal", "db.shop.system.internal");
    wait::until("the node's last mesh written", RECOVER, || {
        let text = std::fs::read_to_string(&last_mesh).unwrap_or_default();
        (text.contains("/shop/web") && text.contains("/shop/db"))
            .then_some(())
            .ok_or(text)
    })
    .unwrap();
    let before = (cluster.agent.dig_a(web), cluster.agent.dig_a(db));
    for (status, records) in [&before.0, &before.1] {
        assert_eq!(status, "NOERROR");
        assert_eq!(records.len(), 1, "{records:?}");
    }

    cluster.server.stop();
    cluster.agent.restart();
    let agent = &cluster.agent;
    wait::until("the last mesh's names answered", RECOVER, || {
        let now = (agent.dig_a(web), agent.dig_a(db));
        (now == before).then_some(()).ok_or(format!("{now:?}"))
    })
    .unwrap();
    let (status, _) = agent.dig_a("new.shop.system.internal");
    assert_eq!(status, "SERVFAIL", "a name the last mesh lacks may be new");
    assert_ne!(agent.get("/readyz").unwrap().0, 200, "ready before listing");
    let mesh = agent.mesh().unwrap();
    assert_eq!(mesh["provisional"], json!(true), "{mesh}");
    assert_eq!(mesh["last_mesh"]["restored"], json!(2), "{mesh}");

    // Meanwhile the cluster changed: a new service, and the database gone.
    add_new_service(&cluster.server);
    cluster.server.delete::<Service>("shop", "db").unwrap();
    cluster.server.restart().unwrap();
    agent.wait_ready().unwrap();
    wait::until("the cluster's mesh", RECOVER, || {
        let now = (agent.dig_a("new.shop.system.internal").0, agent.dig_a(db).0);
        (now == ("NOERROR".into(), "NXDOMAIN".into()))
            .then_some(())
            .ok_or(format!("{now:?}"))
    })
    .unwrap();
    assert_eq!(agent.dig_a(web), before.0);
    assert!(agent.mesh().unwrap().get("provisional").is_none());
}

/// A Service that `seed` does not make: `/shop/new`.
fn add_new_service(server: &FakeApiServer) {
    server
        .apply_json(service(
            "shop",
            "new",
            json!([{"name": "http", "port": 80}]),
        ))
        .unwrap();
}

/// A restart that changed nothing leaves the node's last mesh as it was: its first settled
/// mesh is the one read back, so the file is found current rather than written again. A
/// change after that is written as before.
#[test]
fn a_restart_that_changed_nothing_leaves_the_nodes_last_mesh_alone() {
    let (_state, mut cluster, last_mesh) = seeded_with_state_dir();
    // The agent says the file holds a settled mesh: written, or found to hold it already.
    let file_holds = |agent: &Agent, what: &str| {
        wait::until(what, RECOVER, || {
            let version = agent.metric("lattice_mesh_last_mesh_version");
            (version > 0.0)
                .then_some(())
                .ok_or(format!("version {version}"))
        })
        .unwrap();
    };
    file_holds(&cluster.agent, "the node's last mesh written");

    // The API server away until the file is read back, so the restarted agent takes it in
    // before the lists come.
    cluster.server.stop();
    cluster.agent.restart();
    let written = std::fs::metadata(&last_mesh)
        .and_then(|m| m.modified())
        .unwrap();
    let agent = &cluster.agent;
    wait::until("the last mesh read back", RECOVER, || {
        let mesh = agent.mesh().map_err(|e| e.to_string())?;
        (mesh["last_mesh"]["restored"] == json!(2))
            .then_some(())
            .ok_or(mesh.to_string())
    })
    .unwrap();
    cluster.server.restart().unwrap();
    agent.wait_ready().unwrap();
    file_holds(agent, "the file found current");
    let now = std::fs::metadata(&last_mesh)
        .and_then(|m| m.modified())
        .unwrap();
    assert_eq!(now, written, "the unchanged mesh was written again");

    add_new_service(&cluster.server);
    wait::until("the change written", RECOVER, || {
        let text = std::fs::read_to_string(&last_mesh).unwrap_or_default();
        text.contains("/shop/new").then_some(()).ok_or(text)
    })
    .unwrap();
}
