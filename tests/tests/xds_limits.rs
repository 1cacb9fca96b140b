//! The xDS server's bounds, proven by the attack failing: the real agent, real sockets, and
//! clients that misbehave on purpose (bare HTTP/2 from [`lattice_e2e::raw_grpc`] where a
//! well-behaved client cannot):
//!
//! - identity checking on, a stream from an address that is no pod of the node is refused
//!   with `PERMISSION_DENIED` while it has sent nothing but its headers; a pod is held to its
//!   caps on streams and connections (`RESOURCE_EXHAUSTED`, and a GOAWAY that gRPC reads as
//!   `RESOURCE_EXHAUSTED` for a connection), and gets its slots back when its streams end;
//! - a stream that sends nothing, or only part of its first request, is ended at the deadline,
//!   and the bytes it made the agent hold are given back;
//! - a request over the limit is refused from its length prefix alone, one that does not
//!   decode with `INVALID_ARGUMENT`, a compressed one with `INTERNAL`;
//! - clients that never read hold at most what the bound says (the agent's own gauge of
//!   response bytes not yet written), and give it back when they go;
//! - on SIGTERM, streams end with `UNAVAILABLE` and the agent exits within its drain deadline
//!   even with a client that never reads;
//! - a pod whose network namespace goes silent (every packet dropped, no FIN) is reaped by
//!   HTTP/2 keep-alive: its stream, its `/debug/xds` entry and its gauge go;
//! - a verified proxy of the whole mesh reconnects over Delta with a request larger than
//!   gRPC's usual 4 MiB (every resource it holds), and is served.
//!
//! Each refusal is checked in `lattice_xds_refused_streams_total{reason}` or
//! `lattice_xds_refused_connections_total{reason}`. Build the binaries first:
//! `cargo build --workspace --bins`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Node as EnvoyNode;
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use lattice_e2e::ads_client::{AdsClient, CDS, EDS, LDS, Options};
use lattice_e2e::agent::Agent;
use lattice_e2e::envoy::AdsMode;
use lattice_e2e::fake_apiserver::FakeApiServer;
use lattice_e2e::node::{MeshFile, MeshService, Node, XDS};
use lattice_e2e::raw_grpc::{Connect, DELTA, RawConnection, SOTW, grpc_frame};
use lattice_e2e::wait;
use prost::Message;
use serde_json::json;

const WITHIN: Duration = Duration::from_secs(15);
const NODE_NAME: &str = "node-a";
const NAMESPACE: &str = "lim";

const INVALID_ARGUMENT: i32 = 3;
const DEADLINE_EXCEEDED: i32 = 4;
const PERMISSION_DENIED: i32 = 7;
const RESOURCE_EXHAUSTED: i32 = 8;
const INTERNAL: i32 = 13;
const UNAVAILABLE: i32 = 14;

/// A mesh file of `count` HTTP services, `/lim/s<i>`, one endpoint each.
fn mesh(count: usize) -> MeshFile {
    let services: Vec<MeshService> = (0..count)
        .map(|i| MeshService {
            path: format!("/lim/s{i}"),
            port: 8080,
            protocol: "http".to_string(),
            endpoints: vec![Ipv4Addr::new(10, 201, (i / 250) as u8, (i % 250) as u8 + 1)],
        })
        .collect();
    MeshFile::new(&services).unwrap()
}

/// A Pod of this node at `ip`.
fn pod(name: &str, ip: Ipv4Addr, scope: Option<&str>) -> serde_json::Value {
    let mut annotations = serde_json::Map::new();
    if let Some(scope) = scope {
        annotations.insert("lattice.mlab.com/scope".into(), scope.into());
    }
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"namespace": NAMESPACE, "name": name, "annotations": annotations},
           "spec": {"nodeName": NODE_NAME, "containers": [{"name": "app", "image": "app"}]},
           "status": {"phase": "Running", "podIP": ip.to_string(),
                      "podIPs": [{"ip": ip.to_string()}]}})
}

/// The agent on loopback checking identity against the fake API server's pods (`pods`, each
/// at its own loopback address), serving `mesh`, with `args`.
struct Checked {
    agent: Agent,
    _server: FakeApiServer,
    _kubeconfig: tempfile::TempDir,
}

fn checked_agent(mesh: &MeshFile, pods: &[serde_json::Value], args: &[&str]) -> Checked {
    let server = FakeApiServer::start().unwrap();
    for pod in pods {
        server.apply_json(pod.clone()).unwrap();
    }
    let (dir, kubeconfig) = server.kubeconfig_file().unwrap();
    let path = mesh.path().to_string_lossy().into_owned();
    let mut all = vec!["--mesh-file", &path, "--kubernetes"];
    all.extend_from_slice(args);
    let agent = Agent::start_with_env(
        &all,
        &[
            ("KUBECONFIG", kubeconfig.as_str()),
            ("NODE_NAME", NODE_NAME),
        ],
    );
    agent.wait_ready().unwrap();
    Checked {
        agent,
        _server: server,
        _kubeconfig: dir,
    }
}

fn file_agent(mesh: &MeshFile, args: &[&str]) -> Agent {
    let path = mesh.path().to_string_lossy().into_owned();
    let mut all = vec!["--mesh-file", &path];
    all.extend_from_slice(args);
    let agent = Agent::start(&all);
    agent.wait_ready().unwrap();
    agent
}

/// A metric's value (0 when it has no sample yet): `name` with its labels, as exposed.
fn metric(agent: &Agent, name: &str) -> f64 {
    let (_, text) = agent.get("/metrics").unwrap();
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

fn refused(agent: &Agent, reason: &str) -> f64 {
    metric(
        agent,
        &format!("lattice_xds_refused_streams_total{{reason=\"{reason}\"}}"),
    )
}

fn wait_metric(agent: &Agent, name: &str, what: &str, ok: impl Fn(f64) -> bool) {
    wait::until(what, WITHIN, || {
        let value = metric(agent, name);
        if ok(value) {
            Ok(())
        } else {
            Err(format!("{name} = {value}"))
        }
    })
    .unwrap_or_else(|e| panic!("{e}\nagent log:\n{}", agent.log()));
}

fn node(id: &str) -> Option<EnvoyNode> {
    Some(EnvoyNode {
        id: id.to_string(),
        cluster: "lattice".to_string(),
        ..EnvoyNode::default()
    })
}

/// A Delta request for clusters (wildcard), with `node_id`, framed.
fn delta_clusters(node_id: &str) -> Vec<u8> {
    grpc_frame(
        &DeltaDiscoveryRequest {
            node: node(node_id),
            type_url: CDS.to_string(),
            ..DeltaDiscoveryRequest::default()
        }
        .encode_to_vec(),
    )
}

fn pod_ip(host: u8) -> Ipv4Addr {
    Ipv4Addr::new(127, 1, 0, host)
}

fn from(ip: Ipv4Addr) -> Connect {
    Connect {
        bind: Some(IpAddr::V4(ip)),
        window: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_are_refused_before_anything_is_read_and_pods_are_held_to_their_caps() {
    let mesh = mesh(2);
    let web = pod_ip(1);
    let checked = checked_agent(
        &mesh,
        &[pod("web-0", web, None)],
        &[
            "--xds-max-streams-per-peer=2",
            "--xds-max-connections-per-peer=2",
            "--xds-request-timeout-ms=60000",
        ],
    );
    let agent = &checked.agent;

    // A stranger's stream: its headers only, and the refusal comes back at once.
    let stranger = Ipv4Addr::new(127, 9, 0, 1);
    let mut connection = RawConnection::connect(agent.xds, from(stranger))
        .await
        .unwrap();
    let ended = connection
        .call(DELTA)
        .await
        .unwrap()
        .ended(WITHIN)
        .await
        .unwrap();
    assert_eq!(ended.code, PERMISSION_DENIED, "{ended:?}");
    assert!(
        ended
            .message
            .contains("127.9.0.1 is not the address of a running pod on this node"),
        "{ended:?}"
    );
    assert_eq!(refused(agent, "unknown_peer"), 1.0);

    // The pod: two streams are held (waiting for their first request), the third is over
    // the cap at once.
    let mut first = RawConnection::connect(agent.xds, from(web)).await.unwrap();
    let held = [
        first.call(DELTA).await.unwrap(),
        first.call(SOTW).await.unwrap(),
    ];
    wait_metric(agent, "lattice_xds_connected_proxies", "two streams", |v| {
        v == 2.0
    });
    let ended = first
        .call(DELTA)
        .await
        .unwrap()
        .ended(WITHIN)
        .await
        .unwrap();
    assert_eq!(ended.code, RESOURCE_EXHAUSTED, "{ended:?}");
    assert!(
        ended.message.contains("holds 2 ADS streams already"),
        "{ended:?}"
    );
    assert_eq!(refused(agent, "streams_per_peer"), 1.0);

    // Connections: the second is taken; the third has its stream refused, and is told to go
    // away.
    let mut second = RawConnection::connect(agent.xds, from(web)).await.unwrap();
    let mut third = RawConnection::connect(agent.xds, from(web)).await.unwrap();
    let ended = third
        .call(DELTA)
        .await
        .unwrap()
        .ended(WITHIN)
        .await
        .unwrap();
    assert_eq!(ended.code, RESOURCE_EXHAUSTED, "{ended:?}");
    assert!(
        ended.message.contains("holds 2 connections already"),
        "{ended:?}"
    );
    third.closed(WITHIN).await.unwrap().unwrap();
    // A gRPC client sees the same.
    let status = tonic_call(agent.xds, web).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("holds 2 connections"),
        "{status:?}"
    );
    // (tonic's channel may try again once more on its own.)
    let refused_connections = metric(
        agent,
        "lattice_xds_refused_connections_total{reason=\"connections_per_peer\"}",
    );
    assert!(refused_connections >= 2.0, "{refused_connections}");

    // The first connection's streams end: their slots come back, and the pod's Envoy, with its
    // own node id, is served on the second connection.
    drop(held);
    drop(first);
    wait_metric(
        agent,
        "lattice_xds_connected_proxies",
        "the streams to end",
        |v| v == 0.0,
    );
    let mut call = second.call(DELTA).await.unwrap();
    call.send(&delta_clusters("web-0.lim")).unwrap();
    let body = call.start(WITHIN).await.unwrap();
    assert!(body.is_some(), "the pod's stream ended at once");
    wait_metric(
        agent,
        "lattice_xds_connected_proxies",
        "the pod's stream",
        |v| v == 1.0,
    );
}

/// A tonic client's first answer on a stream from `bind` (the status that ended it, if any).
async fn tonic_call(xds: SocketAddr, bind: Ipv4Addr) -> Result<(), tonic::Status> {
    use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{xds}"))
        .map_err(|e| tonic::Status::internal(e.to_string()))?
        .local_address(Some(IpAddr::V4(bind)))
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut client = AggregatedDiscoveryServiceClient::new(channel);
    let request = DeltaDiscoveryRequest {
        node: node("web-0.lim"),
        type_url: CDS.to_string(),
        ..DeltaDiscoveryRequest::default()
    };
    let mut stream = client
        .delta_aggregated_resources(tokio_stream::iter([request]))
        .await?
        .into_inner();
    stream.message().await.map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_never_comes_or_never_completes_is_dropped_at_the_deadline() {
    let mesh = mesh(2);
    let agent = file_agent(&mesh, &["--xds-request-timeout-ms=1000"]);
    let mut connection = RawConnection::connect(agent.xds, Connect::default())
        .await
        .unwrap();
    let silent = connection.call(DELTA).await.unwrap();
    let mut partial = connection.call(SOTW).await.unwrap();
    // A length prefix of 2,000,000 bytes (more than a stream's HTTP/2 window, so the budget
    // is charged), and 1,000 of them.
    let mut start = vec![0];
    start.extend_from_slice(&2_000_000u32.to_be_bytes());
    start.extend_from_slice(&[0; 1000]);
    partial.send(&start).unwrap();
    // A whole first request, then the beginning of a second one.
    let mut later = connection.call(DELTA).await.unwrap();
    later.send(&delta_clusters("later")).unwrap();
    later.send(&start).unwrap();

    let (silent, partial, later) = tokio::join!(
        silent.ended(WITHIN),
        partial.ended(WITHIN),
        later.ended(WITHIN)
    );
    for ended in [silent.unwrap(), partial.unwrap()] {
        assert_eq!(ended.code, DEADLINE_EXCEEDED, "{ended:?}");
        assert!(
            ended.message.contains("no complete first request"),
            "{ended:?}"
        );
    }
    let later = later.unwrap();
    assert_eq!(later.code, DEADLINE_EXCEEDED, "{later:?}");
    assert!(later.received > 0, "its first request was answered");
    assert_eq!(refused(&agent, "first_request_timeout"), 2.0);
    assert_eq!(refused(&agent, "request_timeout"), 1.0);
    // What the cut requests held is given back, and the streams are gone.
    wait_metric(
        &agent,
        "lattice_xds_request_buffered_bytes",
        "no request bytes held",
        |v| v == 0.0,
    );
    wait_metric(&agent, "lattice_xds_connected_proxies", "no stream", |v| {
        v == 0.0
    });
}

/// While a large request is being read (more than a stream's HTTP/2 window), the agent holds
/// its length against the shared budget: the gauge shows it, and it is given back when the
/// stream goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_being_read_is_held_against_the_budget_until_its_stream_goes() {
    let mesh = mesh(2);
    let agent = file_agent(&mesh, &["--xds-request-timeout-ms=60000"]);
    let mut connection = RawConnection::connect(agent.xds, Connect::default())
        .await
        .unwrap();
    let mut partial = connection.call(DELTA).await.unwrap();
    let mut start = vec![0];
    start.extend_from_slice(&2_000_000u32.to_be_bytes());
    start.extend_from_slice(&[0; 10]);
    partial.send(&start).unwrap();
    wait_metric(
        &agent,
        "lattice_xds_request_buffered_bytes",
        "2,000,000 bytes held",
        |v| v == 2_000_000.0,
    );
    // A small request (within the stream's HTTP/2 window) is not charged, and waits for nothing.
    let mut small = connection.call(DELTA).await.unwrap();
    small.send(&delta_clusters("small")).unwrap();
    assert!(small.start(WITHIN).await.unwrap().is_some());
    drop(partial);
    drop(connection);
    wait_metric(
        &agent,
        "lattice_xds_request_buffered_bytes",
        "none held",
        |v| v == 0.0,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_end_their_stream_with_the_status_that_says_why() {
    let mesh = mesh(2);
    let agent = file_agent(&mesh, &["--xds-max-request-bytes=65536"]);
    let mut connection = RawConnection::connect(agent.xds, Connect::default())
        .await
        .unwrap();

    // Bytes that are no DeltaDiscoveryRequest.
    let mut call = connection.call(DELTA).await.unwrap();
    call.send(&grpc_frame(&[0xff, 0xff, 0xff])).unwrap();
    let ended = call.ended(WITHIN).await.unwrap();
    assert_eq!(ended.code, INVALID_ARGUMENT, "{ended:?}");
    assert_eq!(refused(&agent, "undecodable"), 1.0);

    // A length prefix over the limit, and nothing else: refused from the prefix alone.
    let mut call = connection.call(SOTW).await.unwrap();
    let mut prefix = vec![0];
    prefix.extend_from_slice(&65_537u32.to_be_bytes());
    call.send(&prefix).unwrap();
    let ended = call.ended(WITHIN).await.unwrap();
    assert_eq!(ended.code, RESOURCE_EXHAUSTED, "{ended:?}");
    assert!(ended.message.contains("65537 bytes"), "{ended:?}");
    assert_eq!(refused(&agent, "request_too_large"), 1.0);

    // A message flagged compressed, which no encoding was agreed for.
    let mut call = connection.call(SOTW).await.unwrap();
    let mut compressed = grpc_frame(&[]);
    compressed[0] = 1;
    call.send(&compressed).unwrap();
    assert_eq!(call.ended(WITHIN).await.unwrap().code, INTERNAL);
    assert_eq!(refused(&agent, "malformed"), 1.0);

    // The connection is still good for a proxy that behaves.
    let mut call = connection.call(SOTW).await.unwrap();
    let request = DiscoveryRequest {
        node: node("good"),
        type_url: CDS.to_string(),
        ..DiscoveryRequest::default()
    };
    call.send(&grpc_frame(&request.encode_to_vec())).unwrap();
    assert!(call.start(WITHIN).await.unwrap().is_some());

    // Bytes that are no HTTP/2 at all: the connection is closed, counted.
    let mut garbage = tokio::net::TcpStream::connect(agent.xds).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut garbage, &[0x55; 4096])
        .await
        .unwrap();
    wait_metric(
        &agent,
        "lattice_xds_closed_connections_total{reason=\"protocol_error\"}",
        "the garbage connection closed",
        |v| v >= 1.0,
    );
}

/// Names per stream per type: a Delta stream that subscribes to more than `--xds-max-names`
/// endpoint names, or a SotW stream that asks for more, ends with RESOURCE_EXHAUSTED, counted;
/// a stream within the cap is served on the same connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_naming_more_than_the_cap_is_refused_and_counted() {
    let mesh = mesh(2);
    let agent = file_agent(&mesh, &["--xds-max-names=100"]);
    let mut connection = RawConnection::connect(agent.xds, Connect::default())
        .await
        .unwrap();
    let names = |count: usize| -> Vec<String> {
        (0..count)
            .map(|i| format!("x{i}.lim.system.internal|8080"))
            .collect()
    };
    // A SotW endpoint request naming `count` resources, framed.
    let sotw = |node_id: &str, count: usize| {
        let request = DiscoveryRequest {
            node: node(node_id),
            type_url: EDS.to_string(),
            resource_names: names(count),
            ..DiscoveryRequest::default()
        };
        grpc_frame(&request.encode_to_vec())
    };

    let mut call = connection.call(DELTA).await.unwrap();
    let request = DeltaDiscoveryRequest {
        node: node("greedy-delta"),
        type_url: EDS.to_string(),
        resource_names_subscribe: names(101),
        ..DeltaDiscoveryRequest::default()
    };
    call.send(&grpc_frame(&request.encode_to_vec())).unwrap();
    let ended = call.ended(WITHIN).await.unwrap();
    assert_eq!(ended.code, RESOURCE_EXHAUSTED, "{ended:?}");
    assert_eq!(refused(&agent, "too_many_names"), 1.0);

    let mut call = connection.call(SOTW).await.unwrap();
    call.send(&sotw("greedy-sotw", 101)).unwrap();
    let ended = call.ended(WITHIN).await.unwrap();
    assert_eq!(ended.code, RESOURCE_EXHAUSTED, "{ended:?}");
    assert_eq!(refused(&agent, "too_many_names"), 2.0);

    // At the cap, a stream is served.
    let mut call = connection.call(SOTW).await.unwrap();
    call.send(&sotw("modest", 100)).unwrap();
    assert!(call.start(WITHIN).await.unwrap().is_some());
    assert_eq!(refused(&agent, "too_many_names"), 2.0);
}

/// Clients that never read: each holds at most the response h2 is sending it, the next one
/// hyper has taken, and h2's send buffer (`--xds-send-buffer-bytes`); what they hold comes
/// back when they go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_never_read_hold_at_most_the_bound_and_give_it_back() {
    const CLIENTS: usize = 20;
    const SEND_BUFFER: usize = 16 << 10;
    let mesh = mesh(2000);
    let agent = file_agent(
        &mesh,
        &[
            &format!("--xds-send-buffer-bytes={SEND_BUFFER}"),
            "--xds-max-connections-per-peer=100",
            "--xds-max-streams-per-peer=100",
        ],
    );
    // What one client is sent: the whole mesh's clusters, listeners and endpoints.
    let mut reader = AdsClient::connect(agent.xds, "reader", AdsMode::Sotw)
        .await
        .unwrap();
    reader
        .wait_for("the whole mesh", WITHIN, |v| v.endpoints.len() == 2000)
        .await
        .unwrap();
    let largest = reader.with_view(|v| v.bytes_by_type.values().copied().max().unwrap_or(0));
    drop(reader);
    wait_metric(
        &agent,
        "lattice_xds_connected_proxies",
        "the reader gone",
        |v| v == 0.0,
    );

    let pushes = |kind: &str| {
        metric(
            &agent,
            &format!("lattice_xds_pushes_total{{type=\"{kind}\"}}"),
        )
    };
    // Listeners wait for the clusters' ACK (make before break), which these clients never
    // send: what each is pushed at once is its clusters and their endpoints.
    let before = ["cds", "eds"].map(pushes);
    let mut idle = Vec::new();
    for k in 0..CLIENTS {
        let mut connection = RawConnection::connect(agent.xds, Connect::default())
            .await
            .unwrap();
        let mut call = connection.call(SOTW).await.unwrap();
        for type_url in [CDS, LDS, EDS] {
            let request = DiscoveryRequest {
                node: node(&format!("idle-{k}")),
                type_url: type_url.to_string(),
                resource_names: if type_url == EDS {
                    (0..2000)
                        .map(|i| format!("s{i}.lim.system.internal|8080"))
                        .collect()
                } else {
                    Vec::new()
                },
                ..DiscoveryRequest::default()
            };
            call.send(&grpc_frame(&request.encode_to_vec())).unwrap();
        }
        let body = call.start(WITHIN).await.unwrap();
        idle.push((connection, call, body));
    }
    // Every client was pushed its clusters and endpoints; none read them.
    wait::until("every client's pushes", WITHIN, || {
        let now = ["cds", "eds"].map(pushes);
        let all = now
            .iter()
            .zip(before)
            .all(|(now, then)| *now >= then + CLIENTS as f64);
        if all {
            Ok(())
        } else {
            Err(format!("{now:?} after {before:?}"))
        }
    })
    .unwrap();
    let bound = CLIENTS * (2 * largest as usize + SEND_BUFFER);
    let held = metric(&agent, "lattice_xds_response_buffered_bytes");
    assert!(held > 0.0, "nothing held for clients that read nothing");
    assert!(
        held <= bound as f64,
        "{held} bytes held for {CLIENTS} clients, over {bound}"
    );
    drop(idle);
    wait_metric(
        &agent,
        "lattice_xds_response_buffered_bytes",
        "nothing held",
        |v| v == 0.0,
    );
    wait_metric(&agent, "lattice_xds_connected_proxies", "no stream", |v| {
        v == 0.0
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sigterm_streams_end_unavailable_and_a_client_that_never_reads_does_not_hold_the_exit() {
    let mesh = mesh(2000);
    let mut agent = file_agent(&mesh, &["--xds-drain-ms=1000"]);
    let request = |id: &str| {
        grpc_frame(
            &DiscoveryRequest {
                node: node(id),
                type_url: CDS.to_string(),
                ..DiscoveryRequest::default()
            }
            .encode_to_vec(),
        )
    };
    let mut reading = RawConnection::connect(agent.xds, Connect::default())
        .await
        .unwrap();
    let mut call = reading.call(SOTW).await.unwrap();
    call.send(&request("reader")).unwrap();
    let status = tokio::spawn(call.ended(Duration::from_secs(30)));

    let mut stuck = RawConnection::connect(agent.xds, Connect::default())
        .await
        .unwrap();
    let mut call = stuck.call(SOTW).await.unwrap();
    call.send(&request("stuck")).unwrap();
    let _unread = call.start(WITHIN).await.unwrap();
    wait_metric(
        &agent,
        "lattice_xds_pushes_total{type=\"cds\"}",
        "both pushed",
        |v| v >= 2.0,
    );

    let exit = tokio::task::spawn_blocking(move || {
        let status = agent.terminate();
        (agent, status)
    })
    .await
    .unwrap();
    let (agent, exited) = exit;
    let exited = exited.unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
    assert!(exited.success(), "{exited}\n{}", agent.log());
    let ended = status.await.unwrap().unwrap();
    assert_eq!(ended.code, UNAVAILABLE, "{ended:?}");
    assert!(ended.received > 0, "the reader got its clusters first");
}

/// A pod's network namespace goes silent (every packet dropped inside it: no FIN, no RST, as
/// when it is torn down under a live connection): the agent's PINGs go unanswered, and the
/// stream, its `/debug/xds` entry and its gauge go.
#[test]
fn a_peer_that_vanishes_without_a_fin_is_reaped_by_http2_keepalive() {
    let keepalive = [
        "--xds-keepalive-ms=500",
        "--xds-keepalive-timeout-ms=1000",
        "--xds-tcp-keepalive-secs=1000",
    ];
    reaped_when_silent("reap-h2", &keepalive, "keepalive_timeout");
}

/// The same with HTTP/2 keep-alive out of the way: TCP keep-alive's probes go unanswered.
#[test]
fn a_peer_that_vanishes_without_a_fin_is_reaped_by_tcp_keepalive() {
    let keepalive = ["--xds-keepalive-ms=1000000", "--xds-tcp-keepalive-secs=1"];
    reaped_when_silent("reap-tcp", &keepalive, "tcp_timeout");
}

fn reaped_when_silent(label: &str, keepalive: &[&str], how: &str) {
    let node = Node::new(label).unwrap();
    let mesh = mesh(2);
    let path = mesh.path().to_string_lossy().into_owned();
    let mut args = vec!["--mesh-file", &path];
    args.extend_from_slice(keepalive);
    let agent = node.agent(&args, &[]).unwrap();
    let pod = node.pod(&format!("{label}-pod"), 5).unwrap();

    // An ADS client in the pod's namespace, on a thread of its own until told to stop.
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<anyhow::Result<()>>();
    let netns = pod.netns.path();
    let client = std::thread::spawn(move || {
        let run = || -> anyhow::Result<()> {
            lattice_e2e::netns::join_path(&netns)?;
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async {
                let mut client = AdsClient::connect(XDS, "reap-pod.lim", AdsMode::Delta).await?;
                client
                    .wait_for("the mesh", WITHIN, |v| v.endpoints.len() == 2)
                    .await?;
                let _ = ready_tx.send(Ok(()));
                // Hold the client (and its socket) until the test is done.
                tokio::task::spawn_blocking(move || stop_rx.recv())
                    .await?
                    .ok();
                drop(client);
                Ok(())
            })
        };
        if let Err(error) = run() {
            let _ = ready_tx.send(Err(error));
        }
    });
    ready_rx.recv().unwrap().unwrap();
    let proxies = |agent: &Agent| {
        agent
            .get("/debug/xds")
            .map(|(_, body)| body)
            .unwrap_or_default()
    };
    assert!(
        proxies(&agent).contains("10.200.0.5"),
        "{}",
        proxies(&agent)
    );
    assert_eq!(metric(&agent, "lattice_xds_connected_proxies"), 1.0);

    // Silence: nothing in or out of the pod.
    for chain in ["INPUT", "OUTPUT"] {
        pod.netns
            .exec("iptables", &["-I", chain, "-j", "DROP"])
            .unwrap();
    }
    wait::until("the silent pod's stream to be reaped", WITHIN, || {
        let listed = proxies(&agent);
        let gauge = metric(&agent, "lattice_xds_connected_proxies");
        if !listed.contains("10.200.0.5") && gauge == 0.0 {
            Ok(())
        } else {
            Err(format!("{gauge} streams; /debug/xds {listed}"))
        }
    })
    .unwrap_or_else(|e| panic!("{e}\nagent log:\n{}", agent.log()));
    assert_eq!(
        metric(
            &agent,
            &format!("lattice_xds_closed_connections_total{{reason=\"{how}\"}}")
        ),
        1.0
    );
    let _ = stop_tx.send(());
    client.join().unwrap();
}

/// Services whose cluster names are long (about 200 bytes), so a mesh of a few thousand makes
/// a Delta reconnect's endpoint request (every cluster subscribed, every held assignment's
/// version) larger than gRPC's usual 4 MiB.
fn long_named_mesh(count: usize) -> MeshFile {
    let label = |c: char| c.to_string().repeat(60);
    let services: Vec<MeshService> = (0..count)
        .map(|i| MeshService {
            path: format!("/{}/{}/{}{i:05}", label('a'), label('b'), &label('c')[..55]),
            port: 8080,
            protocol: "http".to_string(),
            endpoints: vec![Ipv4Addr::new(10, 201, (i / 250) as u8, (i % 250) as u8 + 1)],
        })
        .collect();
    MeshFile::new(&services).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verified_whole_mesh_proxy_reconnects_with_every_resource_it_holds() {
    const SERVICES: usize = 10_000;
    let mesh = long_named_mesh(SERVICES);
    let ip = pod_ip(7);
    let mut checked = checked_agent(&mesh, &[pod("whole-0", ip, Some("mesh"))], &[]);
    let options = Options {
        bind: Some(IpAddr::V4(ip)),
        routes: false,
    };
    let mut client =
        AdsClient::connect_with(checked.agent.xds, "whole-0.lim", AdsMode::Delta, options)
            .await
            .unwrap();
    let whole = |v: &lattice_e2e::ads_client::ClientView| {
        v.clusters.len() == SERVICES && v.endpoints.len() == SERVICES
    };
    client
        .wait_for("the whole mesh", Duration::from_secs(120), whole)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", checked.agent.log()));
    // What its endpoint request will say on reconnecting: every cluster, subscribed, and
    // every assignment with its version.
    let request = client.with_view(|v| {
        v.clusters
            .iter()
            .map(|name| 2 * name.len() + 16 + 8)
            .sum::<usize>()
    });
    assert!(
        request > 4 << 20,
        "a reconnect of {request} bytes proves nothing"
    );

    // The agent restarts; the proxy reconnects saying what it holds, and is served.
    checked.agent.restart();
    checked.agent.wait_ready().unwrap();
    reconnect(&mut client).await;
    client
        .wait_for("answers on the new stream", Duration::from_secs(60), |v| {
            v.answered.contains_key(EDS) && whole(v)
        })
        .await
        .unwrap_or_else(|e| {
            let too_large = refused(&checked.agent, "request_too_large");
            panic!("{e}; requests refused as too large: {too_large}")
        });
    assert_eq!(refused(&checked.agent, "request_too_large"), 0.0);
    assert!(!client.stream_ended());
}

/// Reconnects until the restarted agent takes the connection.
async fn reconnect(client: &mut AdsClient) {
    let deadline = tokio::time::Instant::now() + WITHIN;
    while let Err(error) = client.reconnect().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the client did not reconnect: {error}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
