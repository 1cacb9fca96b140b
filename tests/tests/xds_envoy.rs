//! The agent's xDS server against a real Envoy, once over SotW (`GRPC`) and once over Delta
//! (`DELTA_GRPC`) ADS, fed by a mesh file; plus a synthetic client that NACKs.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use lattice_e2e::agent::{Agent, run_to_exit};
use lattice_e2e::envoy::{AdsMode, Envoy};
use lattice_e2e::wait;

/// Envoy's outbound listener binds the same port in every test: one Envoy at a time.
static ENVOY: Mutex<()> = Mutex::new(());

const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const BUZZ: &str = "buzz.bar.foo.system.internal|8080";
const DB: &str = "db.foo.system.internal|5432";
const NEW: &str = "new.foo.system.internal|8080";

/// The mesh file of these tests: service → endpoint addresses (HTTP on 8080, except db).
fn write_mesh(path: &Path, services: &[(&str, &[&str])]) {
    let mut text = String::from("services:\n");
    for (svc, endpoints) in services {
        let (port, protocol) = if *svc == "/foo/db" {
            (5432, "tcp")
        } else {
            (8080, "http")
        };
        text.push_str(&format!(
            "  - path: {svc}\n    ports:\n      - port: {port}\n        protocol: {protocol}\n    endpoints:\n"
        ));
        for e in *endpoints {
            text.push_str(&format!("      - address: {e}\n"));
        }
    }
    // Write-then-rename, as editors and ConfigMaps do, so the agent never reads half a file.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn expected(pairs: &[(&str, &[&str])]) -> BTreeMap<String, Vec<String>> {
    pairs
        .iter()
        .map(|(c, eps)| (c.to_string(), eps.iter().map(|e| e.to_string()).collect()))
        .collect()
}

/// Envoy's dynamic clusters and their endpoints (the static xDS cluster left out).
fn mesh_clusters(envoy: &Envoy) -> Result<BTreeMap<String, Vec<String>>, String> {
    let mut clusters = envoy.cluster_endpoints()?;
    clusters.retain(|name, _| name.contains(".system.internal|"));
    Ok(clusters)
}

fn wait_clusters(
    envoy: &Envoy,
    want: &BTreeMap<String, Vec<String>>,
    within: Duration,
) -> Duration {
    let start = Instant::now();
    wait::until("Envoy /clusters to match the mesh", within, || {
        let got = mesh_clusters(envoy)?;
        if &got == want {
            Ok(())
        } else {
            Err(format!("{got:?}"))
        }
    })
    .unwrap_or_else(|e| panic!("{e}\nenvoy log:\n{}", envoy.log()));
    start.elapsed()
}

fn dynamic<'a>(dump: &'a serde_json::Value, kind: &str) -> &'a serde_json::Value {
    dump["configs"]
        .as_array()
        .and_then(|configs| {
            configs.iter().find(|c| {
                c["@type"]
                    .as_str()
                    .is_some_and(|t| t.ends_with(&format!(".{kind}")))
            })
        })
        .unwrap_or_else(|| panic!("no {kind} in config_dump"))
}

/// The domains of every virtual host of Envoy's dynamic route configurations.
fn route_domains(envoy: &Envoy) -> Result<Vec<String>, String> {
    let dump = envoy.config_dump()?;
    let configs = dynamic(&dump, "RoutesConfigDump")["dynamic_route_configs"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    Ok(configs
        .iter()
        .flat_map(|c| {
            c["route_config"]["virtual_hosts"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .flat_map(|vh| vh["domains"].as_array().cloned().unwrap_or_default())
        .filter_map(|d| d.as_str().map(str::to_string))
        .collect())
}

fn converges_with_a_real_envoy(mode: AdsMode) {
    let _one_envoy = ENVOY.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let mesh = dir.path().join("mesh.yaml");
    write_mesh(
        &mesh,
        &[
            ("/foo/bar/buzz", &["10.200.0.3", "10.200.0.4"]),
            ("/foo/db", &["10.200.0.9"]),
        ],
    );
    let mut agent = Agent::start(&["--mesh-file", mesh.to_str().unwrap()]);
    agent.wait_ready().unwrap();
    let node = format!("test-{mode:?}").to_lowercase();
    let envoy = Envoy::start(&node, agent.xds, mode);
    envoy.wait_live().unwrap();

    // (a) clusters, endpoints, the listener and the routes.
    wait_clusters(
        &envoy,
        &expected(&[
            (BUZZ, &["10.200.0.3:8080", "10.200.0.4:8080"]),
            (DB, &["10.200.0.9:5432"]),
        ]),
        Duration::from_secs(5),
    );
    let dump = envoy.config_dump().unwrap();
    let listeners = &dynamic(&dump, "ListenersConfigDump")["dynamic_listeners"];
    assert_eq!(listeners[0]["name"], "lattice-outbound");
    let chains = listeners[0]["active_state"]["listener"]["filter_chains"]
        .as_array()
        .unwrap();
    let matches: Vec<String> = chains
        .iter()
        .map(|c| {
            let m = &c["filter_chain_match"];
            format!(
                "{}:{}",
                m["prefix_ranges"][0]["address_prefix"].as_str().unwrap(),
                m["destination_port"]
            )
        })
        .collect();
    // The TCP service's own address is derived from its name: ask the agent which it is.
    let shown = agent.mesh().unwrap();
    let db_address = shown["services"]["/foo/db"]["address"]["ip"]
        .as_str()
        .unwrap_or_else(|| panic!("no address for /foo/db in {shown}"))
        .to_string();
    assert_eq!(
        shown["services"]["/foo/bar/buzz"]["address"]["ip"], "240.240.0.1",
        "HTTP services share the block's first address"
    );
    assert_eq!(
        matches,
        ["240.240.0.1:8080".to_string(), format!("{db_address}:5432")]
    );
    let routes = &dynamic(&dump, "RoutesConfigDump")["dynamic_route_configs"][0]["route_config"];
    assert_eq!(routes["name"], "http.8080");
    assert_eq!(
        routes["virtual_hosts"][0]["domains"],
        serde_json::json!([
            "buzz.bar.foo.system.internal",
            "buzz.bar.foo.system.internal:8080"
        ])
    );

    // The agent sees the proxy and what it ACKed.
    wait::until(
        "/debug/xds to list the proxy with 4 ACKed types",
        Duration::from_secs(5),
        || {
            let (_, body) = agent.get("/debug/xds").map_err(|e| e.to_string())?;
            let proxies: serde_json::Value =
                serde_json::from_str(&body).map_err(|e| e.to_string())?;
            let acked = proxies
                .as_array()
                .and_then(|p| p.iter().find(|p| p["node_id"] == node.as_str()))
                .map(|p| p["acked"].as_object().map(|a| a.len()));
            if acked == Some(Some(4)) {
                Ok(())
            } else {
                Err(body)
            }
        },
    )
    .unwrap();

    // (b) live edits, each visible in Envoy within a second, with no Envoy restart.
    let steps: [&[(&str, &[&str])]; 4] = [
        // add an endpoint
        &[
            ("/foo/bar/buzz", &["10.200.0.3", "10.200.0.4", "10.200.0.5"]),
            ("/foo/db", &["10.200.0.9"]),
        ],
        // remove one
        &[
            ("/foo/bar/buzz", &["10.200.0.3", "10.200.0.5"]),
            ("/foo/db", &["10.200.0.9"]),
        ],
        // add a service
        &[
            ("/foo/bar/buzz", &["10.200.0.3", "10.200.0.5"]),
            ("/foo/db", &["10.200.0.9"]),
            ("/foo/new", &["10.200.0.7"]),
        ],
        // remove a service
        &[
            ("/foo/bar/buzz", &["10.200.0.3", "10.200.0.5"]),
            ("/foo/new", &["10.200.0.7"]),
        ],
    ];
    let wants = [
        expected(&[
            (
                BUZZ,
                &["10.200.0.3:8080", "10.200.0.4:8080", "10.200.0.5:8080"],
            ),
            (DB, &["10.200.0.9:5432"]),
        ]),
        expected(&[
            (BUZZ, &["10.200.0.3:8080", "10.200.0.5:8080"]),
            (DB, &["10.200.0.9:5432"]),
        ]),
        expected(&[
            (BUZZ, &["10.200.0.3:8080", "10.200.0.5:8080"]),
            (DB, &["10.200.0.9:5432"]),
            (NEW, &["10.200.0.7:8080"]),
        ]),
        expected(&[
            (BUZZ, &["10.200.0.3:8080", "10.200.0.5:8080"]),
            (NEW, &["10.200.0.7:8080"]),
        ]),
    ];
    for (step, want) in steps.iter().zip(&wants) {
        write_mesh(&mesh, step);
        let took = wait_clusters(&envoy, want, Duration::from_secs(1));
        eprintln!("{mode:?}: edit visible in Envoy after {took:?}");
    }

    // A bad edit is rejected and the last good mesh keeps serving.
    std::fs::write(
        &mesh,
        "services:\n  - path: /foo/bar/buzz\n    ports: [{port: 99999}]\n",
    )
    .unwrap();
    wait::until(
        "the agent to reject the bad edit",
        Duration::from_secs(5),
        || {
            let log = agent.log();
            if log.contains("mesh file edit rejected") && log.contains("99999 is out of range") {
                Ok(())
            } else {
                Err("no rejection logged".into())
            }
        },
    )
    .unwrap();
    assert_eq!(mesh_clusters(&envoy).unwrap(), wants[3]);
    let served = agent.mesh().unwrap();
    assert!(
        served["services"].get("/foo/new").is_some(),
        "last good mesh still served: {served}"
    );

    // (c) the agent dies: Envoy keeps its config; the agent comes back with a changed mesh and
    // Envoy reconnects and converges.
    agent.kill();
    assert_eq!(
        mesh_clusters(&envoy).unwrap(),
        wants[3],
        "Envoy dropped its config when the agent died"
    );
    write_mesh(
        &mesh,
        &[
            ("/foo/bar/buzz", &["10.200.0.6"]),
            ("/foo/db", &["10.200.0.9"]),
        ],
    );
    agent.restart();
    agent.wait_ready().unwrap();
    wait_clusters(
        &envoy,
        &expected(&[(BUZZ, &["10.200.0.6:8080"]), (DB, &["10.200.0.9:5432"])]),
        Duration::from_secs(15),
    );
    // Its routes follow its clusters: (d) restarts with nothing changed only once Envoy holds
    // them too (a restart before would rightly send them again).
    wait::until(
        "Envoy's routes to follow the mesh",
        Duration::from_secs(15),
        || {
            let domains = route_domains(&envoy)?;
            match domains
                .iter()
                .any(|d| d.starts_with("new.foo.system.internal"))
            {
                false => Ok(()),
                true => Err(format!("{domains:?}")),
            }
        },
    )
    .unwrap();
    let metrics = agent.get("/metrics").unwrap().1;
    assert!(
        metrics.contains("lattice_xds_connected_proxies 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("lattice_xds_pushes_total{type=\"cds\"}"),
        "{metrics}"
    );

    // (d) a restart with nothing changed: Envoy reconnects saying what it holds and is not
    // sent it again (Delta: initial_resource_versions; SotW: its versions are digests of what
    // it holds, so not even its clusters are answered, and its endpoints and routes are
    // answered with nothing), and the stream it is back on carries the next change.
    agent.restart();
    agent.wait_ready().unwrap();
    let reconnected = || {
        let metrics = agent.get("/metrics").map_err(|e| e.to_string())?.1;
        if metrics.contains("lattice_xds_connected_proxies 1") {
            Ok(metrics)
        } else {
            Err("Envoy not connected yet".to_string())
        }
    };
    wait::until("Envoy to reconnect", Duration::from_secs(15), reconnected).unwrap();
    let answered = || {
        let metrics = reconnected()?;
        let asked = ["eds", "rds"]
            .iter()
            .all(|kind| metrics.contains(&format!("lattice_xds_pushes_total{{type=\"{kind}\"}}")));
        if asked {
            Ok(metrics)
        } else {
            Err(format!("endpoints and routes not answered yet: {metrics}"))
        }
    };
    let metrics = wait::until(
        "Envoy's requests answered",
        Duration::from_secs(15),
        answered,
    )
    .unwrap();
    let sent: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("lattice_xds_resources_sent_total"))
        .collect();
    assert!(
        sent.iter().any(|l| l.contains("type=\"eds\"")),
        "no count of the endpoints sent: {metrics}"
    );
    assert!(
        sent.iter().all(|l| l.ends_with(" 0")),
        "resources sent again to an Envoy that held them: {sent:?}"
    );
    write_mesh(
        &mesh,
        &[
            ("/foo/bar/buzz", &["10.200.0.7"]),
            ("/foo/db", &["10.200.0.9"]),
        ],
    );
    wait_clusters(
        &envoy,
        &expected(&[(BUZZ, &["10.200.0.7:8080"]), (DB, &["10.200.0.9:5432"])]),
        Duration::from_secs(5),
    );
    let metrics = reconnected().unwrap();
    if mode == AdsMode::Sotw {
        assert!(
            !metrics.contains("lattice_xds_pushes_total{type=\"cds\"}"),
            "clusters were sent again to an Envoy that held them: {metrics}"
        );
    }
}

#[test]
fn envoy_over_sotw_ads_converges_follows_edits_and_survives_agent_restart() {
    converges_with_a_real_envoy(AdsMode::Sotw);
}

#[test]
fn envoy_over_delta_ads_converges_follows_edits_and_survives_agent_restart() {
    converges_with_a_real_envoy(AdsMode::Delta);
}

fn node() -> Option<Node> {
    Some(Node {
        id: "nacker".to_string(),
        cluster: "lattice".to_string(),
        ..Node::default()
    })
}

fn rejection() -> Option<RpcStatus> {
    Some(RpcStatus {
        code: 3,
        message: "synthetic rejection".to_string(),
        details: Vec::new(),
    })
}

/// An agent serving one service from a mesh file, for a hand-driven ADS client.
struct NackFixture {
    _dir: tempfile::TempDir,
    mesh: std::path::PathBuf,
    agent: Agent,
    client: AggregatedDiscoveryServiceClient<tonic::transport::Channel>,
}

impl NackFixture {
    async fn start() -> NackFixture {
        let dir = tempfile::tempdir().unwrap();
        let mesh = dir.path().join("mesh.yaml");
        write_mesh(&mesh, &[("/foo/bar/buzz", &["10.200.0.3"])]);
        let agent = Agent::start(&["--mesh-file", mesh.to_str().unwrap()]);
        tokio::task::block_in_place(|| agent.wait_ready()).unwrap();
        let client = AggregatedDiscoveryServiceClient::connect(format!("http://{}", agent.xds))
            .await
            .unwrap();
        NackFixture {
            _dir: dir,
            mesh,
            agent,
            client,
        }
    }

    /// Waits until the agent has counted the NACK, then adds a service to the mesh.
    async fn after_nack_change_the_mesh(&self) {
        wait::until_async("the NACK to be counted", Duration::from_secs(5), || async {
            let metrics = self.agent.get("/metrics").map_err(|e| e.to_string())?.1;
            if metrics.contains("lattice_xds_nacks_total{type=\"cds\"} 1") {
                Ok(())
            } else {
                Err(metrics)
            }
        })
        .await
        .unwrap();
        write_mesh(
            &self.mesh,
            &[
                ("/foo/bar/buzz", &["10.200.0.3"]),
                ("/foo/new", &["10.200.0.7"]),
            ],
        );
    }
}

/// (d) A client that NACKs is not sent the same response again: after the NACK, the next
/// thing on the stream is the response for the next mesh change, nothing in between.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nacking_sotw_client_is_not_sent_the_same_response_in_a_loop() {
    let mut fixture = NackFixture::start().await;
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let request = |nonce: &str, error| DiscoveryRequest {
        node: node(),
        type_url: CDS.into(),
        response_nonce: nonce.to_string(),
        error_detail: error,
        ..Default::default()
    };
    tx.send(request("", None)).await.unwrap();
    let mut responses = fixture
        .client
        .stream_aggregated_resources(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let first = responses.message().await.unwrap().unwrap();
    assert_eq!(first.resources.len(), 1);
    tx.send(request(&first.nonce, rejection())).await.unwrap();
    fixture.after_nack_change_the_mesh().await;
    let next = tokio::time::timeout(Duration::from_secs(5), responses.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_ne!(
        next.version_info, first.version_info,
        "the NACKed response was sent again"
    );
    assert_eq!(next.resources.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nacking_delta_client_is_not_sent_the_same_resources_in_a_loop() {
    let mut fixture = NackFixture::start().await;
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let request = |nonce: &str, error| DeltaDiscoveryRequest {
        node: node(),
        type_url: CDS.into(),
        response_nonce: nonce.to_string(),
        error_detail: error,
        ..Default::default()
    };
    tx.send(request("", None)).await.unwrap();
    let mut responses = fixture
        .client
        .delta_aggregated_resources(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let first = responses.message().await.unwrap().unwrap();
    assert_eq!(first.resources[0].name, BUZZ);
    tx.send(request(&first.nonce, rejection())).await.unwrap();
    fixture.after_nack_change_the_mesh().await;
    let next = tokio::time::timeout(Duration::from_secs(5), responses.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let names: Vec<&str> = next.resources.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        names,
        [NEW],
        "only the new cluster; the NACKed one must not come again"
    );
}

/// Responses over 64 KiB go out as a frame in three parts, the middle one encoded once for
/// every stream sent the same (the agent's `SharedHeads`): Envoy takes them over both
/// protocols, and holds every cluster with its endpoint.
#[test]
fn envoy_takes_large_responses_sent_in_parts() {
    let _one_envoy = ENVOY.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let mesh = dir.path().join("mesh.yaml");
    // 1000 clusters: the SotW cluster response and a Delta one (256 KiB) are both far over.
    let services: Vec<(String, [String; 1])> = (0..1000)
        .map(|i| {
            (
                format!("/large/s{i}"),
                [format!("10.201.{}.{}", i / 250, i % 250 + 1)],
            )
        })
        .collect();
    let endpoints: Vec<[&str; 1]> = services.iter().map(|(_, [e])| [e.as_str()]).collect();
    let pairs: Vec<(&str, &[&str])> = services
        .iter()
        .zip(&endpoints)
        .map(|((path, _), endpoints)| (path.as_str(), &endpoints[..]))
        .collect();
    write_mesh(&mesh, &pairs);
    let want: BTreeMap<String, Vec<String>> = services
        .iter()
        .map(|(path, [endpoint])| {
            let name = path
                .trim_start_matches('/')
                .rsplit('/')
                .collect::<Vec<_>>()
                .join(".");
            (
                format!("{name}.system.internal|8080"),
                vec![format!("{endpoint}:8080")],
            )
        })
        .collect();
    let agent = Agent::start(&["--mesh-file", mesh.to_str().unwrap()]);
    agent.wait_ready().unwrap();
    for mode in [AdsMode::Sotw, AdsMode::Delta] {
        let envoy = Envoy::start(&format!("large-{mode:?}"), agent.xds, mode);
        envoy.wait_live().unwrap();
        wait_clusters(&envoy, &want, Duration::from_secs(20));
    }
}

/// The bootstrap's statistics list, in a real Envoy: per mesh cluster only the two membership
/// gauges, against Envoy's ~150 with `--envoy-stats all` (the bootstrap without the list), of
/// which a cluster's traffic statistics are made only on its first request.
#[test]
fn envoy_keeps_only_the_mesh_statistics_unless_asked_for_all() {
    let _one_envoy = ENVOY.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let mesh = dir.path().join("mesh.yaml");
    write_mesh(&mesh, &[("/foo/bar/buzz", &["10.200.0.3", "10.200.0.4"])]);
    let agent = Agent::start(&["--mesh-file", mesh.to_str().unwrap()]);
    agent.wait_ready().unwrap();
    let want = expected(&[(BUZZ, &["10.200.0.3:8080", "10.200.0.4:8080"])]);
    // Stat names of the mesh cluster, and whether the xDS cluster and the server have theirs.
    let stats = |envoy: &Envoy| {
        let body = envoy.admin_get("/stats").unwrap();
        let prefix = format!("cluster.{BUZZ}.");
        let cluster: Vec<String> = body
            .lines()
            .filter_map(|l| l.strip_prefix(&prefix))
            .filter_map(|l| l.split(':').next())
            .map(String::from)
            .collect();
        let xds = body
            .lines()
            .any(|l| l.starts_with("cluster.lattice-xds.upstream_rq_total"));
        let server = body.lines().any(|l| l.starts_with("server.live"));
        (cluster, xds && server)
    };

    let envoy = Envoy::start("stats-mesh", agent.xds, AdsMode::Delta);
    envoy.wait_live().unwrap();
    wait_clusters(&envoy, &want, Duration::from_secs(5));
    let (cluster, own) = stats(&envoy);
    assert_eq!(
        cluster,
        ["membership_healthy", "membership_total"],
        "{cluster:?}"
    );
    assert!(own, "Envoy's own and the xDS cluster's statistics are kept");
    let body = envoy.admin_get("/stats").unwrap();
    for gauge in ["membership_total: 2", "membership_healthy: 2"] {
        let line = format!("cluster.{BUZZ}.{gauge}");
        assert!(body.lines().any(|l| l == line), "no {line}");
    }
    drop(envoy);

    let envoy = Envoy::start_edited("stats-all", agent.xds, AdsMode::Delta, |bootstrap| {
        bootstrap.as_object_mut().unwrap().remove("stats_config");
    });
    envoy.wait_live().unwrap();
    wait_clusters(&envoy, &want, Duration::from_secs(5));
    let (cluster, own) = stats(&envoy);
    assert!(
        cluster.len() > 50,
        "Envoy's default: {} per cluster: {cluster:?}",
        cluster.len()
    );
    // Its traffic statistics wait for its first request (`enable_deferred_creation_stats`),
    // as the xDS cluster's, which carries the ADS stream, show they then appear.
    assert!(
        !cluster.iter().any(|s| s == "upstream_rq_total"),
        "{cluster:?}"
    );
    assert!(own);
}

#[test]
fn a_malformed_mesh_file_fails_start_up_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = dir.path().join("bad.yaml");
    std::fs::write(
        &mesh,
        "services:\n  - path: /foo/bar\n    ports: [{port: 80, protocol: udp}]\n",
    )
    .unwrap();
    let (code, stderr) = run_to_exit(&[
        "--mesh-file",
        mesh.to_str().unwrap(),
        "--upstream-dns",
        "127.0.0.1:9",
        "--xds-addr",
        "127.0.0.1:0",
        "--admin-addr",
        "127.0.0.1:0",
        "--dns-addr",
        "127.0.0.1:0",
    ]);
    assert_ne!(code, Some(0));
    assert!(
        stderr.contains(mesh.to_str().unwrap()),
        "names the file: {stderr}"
    );
    assert!(
        stderr.contains("services[0] (/foo/bar).ports[0].protocol: unknown protocol \"udp\""),
        "{stderr}"
    );

    let (code, stderr) = run_to_exit(&["--mesh-file", "/nonexistent/mesh.yaml"]);
    assert_ne!(code, Some(0));
    assert!(
        stderr.contains("cannot read mesh file /nonexistent/mesh.yaml"),
        "{stderr}"
    );

    let (code, stderr) = run_to_exit(&["--trap-cidr", "240.240.0.0/33", "--mesh-file", "x"]);
    assert_eq!(code, Some(2), "usage errors exit 2: {stderr}");
    assert!(stderr.contains("240.240.0.0/33"), "{stderr}");
}

#[test]
fn sigterm_shuts_down_gracefully() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = dir.path().join("mesh.yaml");
    write_mesh(&mesh, &[("/foo/bar/buzz", &["10.200.0.3"])]);
    let mut agent = Agent::start(&["--mesh-file", mesh.to_str().unwrap()]);
    agent.wait_ready().unwrap();
    assert_eq!(agent.get("/healthz").unwrap().0, 200);
    let status = agent.terminate().unwrap();
    assert!(status.success(), "exit status {status}");
    let log = agent.log();
    assert!(
        log.contains("shutting down") && log.contains("stopped"),
        "{log}"
    );
}
