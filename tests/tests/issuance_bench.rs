//! Benchmark: workload certificates for a node's pods at once. The real agent, as a node's
//! agent (`NODE_NAME`), reads the node's pods and the CA's Secret from the fake API server;
//! each pod (its own service account, its own address on 127.0.0.0/8) opens a verified Delta
//! ADS stream from its address at the same moment.
//!
//! Two rounds, in one run: the streams asking for clusters while there is no CA (the cost of
//! opening and verifying the streams alone), then, with the CA's Secret applied, new streams
//! asking for their secrets (`default` and `ROOTCA`), each answered once its leaf is issued.
//! Reported: the agent's CPU per round and their ratio, and the time from a round's start
//! until each pod holds its certificate (median and last, over every round). Then the same
//! certificates from Istio's certificate service (the in-repo server of its API, in this
//! process) with a second agent: a key and a CSR per leaf, a request over TLS, and the answer
//! checked, against signing on the spot.
//!
//! Run through `cargo xtask bench --only issuance` (`bench/src/bench_issuance.rs`);
//! `LATTICE_BENCH_ISSUANCE_PODS` (110, the kubelet's default most pods a node) sets the pods,
//! `LATTICE_BENCH_ISSUANCE_ROUNDS` (5) how many times each round runs.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::Node as EnvoyNode;
use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use lattice_e2e::agent::{Agent, http_get};
use lattice_e2e::fake_apiserver::FakeApiServer;
use lattice_e2e::istio_ca::IstioCaServer;
use lattice_e2e::procstat::cpu_seconds;
use lattice_e2e::trusted::ca_secret;
use lattice_e2e::wait;
use lattice_inject::certs::Chain;
use serde_json::{Value, json};

const NODE: &str = "bench-node";
const CLUSTERS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const SECRETS: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
/// How long a stream may wait for what it asked.
const ANSWER: Duration = Duration::from_secs(30);

fn size(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Pod `k`'s address: 127.77.0.1 on.
fn pod_ip(k: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 77, (k / 250) as u8, (k % 250 + 1) as u8)
}

/// A running Pod of the node, with a service account of its own.
fn pod(k: usize) -> Value {
    let ip = pod_ip(k).to_string();
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"namespace": "default", "name": format!("pod-{k}")},
           "spec": {"nodeName": NODE, "serviceAccountName": format!("sa-{k}"),
                    "containers": [{"name": "app", "image": "app"}]},
           "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}})
}

/// Pod `k`'s stream: asks for `names` of `type_url` (none: every one), ACKs each answer, and
/// returns once an answer names `until` (or, without one, at the first answer).
async fn ask(
    xds: SocketAddr,
    k: usize,
    type_url: &str,
    names: &[&str],
    until: Option<&str>,
) -> Result<Instant, String> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{xds}"))
        .map_err(|e| e.to_string())?
        .local_address(Some(IpAddr::V4(pod_ip(k))))
        .connect()
        .await
        .map_err(|e| format!("pod {k}: connect: {e}"))?;
    let mut client = AggregatedDiscoveryServiceClient::new(channel);
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let first = DeltaDiscoveryRequest {
        node: Some(EnvoyNode {
            id: format!("pod-{k}.default"),
            ..EnvoyNode::default()
        }),
        type_url: type_url.to_string(),
        resource_names_subscribe: names.iter().map(|n| n.to_string()).collect(),
        ..DeltaDiscoveryRequest::default()
    };
    tx.send(first).map_err(|e| e.to_string())?;
    let mut stream = client
        .delta_aggregated_resources(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await
        .map_err(|e| format!("pod {k}: {e}"))?
        .into_inner();
    loop {
        let response = tokio::time::timeout(ANSWER, stream.message())
            .await
            .map_err(|_| format!("pod {k}: nothing within {ANSWER:?}"))?
            .map_err(|e| format!("pod {k}: {e}"))?
            .ok_or(format!("pod {k}: the stream ended"))?;
        let at = Instant::now();
        if until.is_none_or(|name| response.resources.iter().any(|r| r.name == name)) {
            return Ok(at);
        }
        let ack = DeltaDiscoveryRequest {
            type_url: type_url.to_string(),
            response_nonce: response.nonce,
            ..DeltaDiscoveryRequest::default()
        };
        tx.send(ack).map_err(|e| e.to_string())?;
    }
}

/// Every pod asks at once; the agent's CPU seconds meanwhile and when each was answered.
async fn round(
    agent: &Agent,
    pods: usize,
    type_url: &'static str,
    names: &'static [&'static str],
    until: Option<&'static str>,
) -> (f64, Vec<Duration>) {
    let pid = agent.pid().expect("the agent runs");
    let cpu_before = cpu_seconds(pid).expect("the agent's CPU");
    let start = Instant::now();
    let xds = agent.xds;
    let asks: Vec<_> = (0..pods)
        .map(|k| tokio::spawn(ask(xds, k, type_url, names, until)))
        .collect();
    let mut took = Vec::with_capacity(pods);
    for asked in asks {
        let at = asked
            .await
            .expect("a pod's task")
            .unwrap_or_else(|e| panic!("{e}\nagent log:\n{}", agent.log()));
        took.push(at.duration_since(start));
    }
    let cpu = cpu_seconds(pid).expect("the agent's CPU") - cpu_before;
    took.sort();
    (cpu, took)
}

/// `rounds` rounds of every pod asking for its secrets: each pod's leaf, issued when its
/// stream is verified and sent once it asks; forgotten when its stream ends, so every round
/// issues them all again. The agent's CPU a round, on average, and when each pod was
/// certified, over every round.
async fn certificate_rounds(agent: &Agent, pods: usize, rounds: usize) -> (f64, Vec<Duration>) {
    let (mut cpu, mut certified) = (0.0, Vec::new());
    for _ in 0..rounds {
        let secrets = &["default", "ROOTCA"];
        let (spent, took) = round(agent, pods, SECRETS, secrets, Some("default")).await;
        cpu += spent / rounds as f64;
        certified.extend(took);
        wait::until("every leaf forgotten", Duration::from_secs(30), || {
            let (_, body) = http_get(agent.admin, "/debug/identity").map_err(|e| e.to_string())?;
            let shown: Value = serde_json::from_str(&body).map_err(|e| e.to_string())?;
            (shown["leaves"].as_array().is_some_and(Vec::is_empty))
                .then_some(())
                .ok_or(body)
        })
        .unwrap();
    }
    certified.sort();
    (cpu, certified)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: cargo xtask bench --only issuance"]
async fn certificates_for_a_nodes_pods_at_once() {
    let pods = size("LATTICE_BENCH_ISSUANCE_PODS", 110);
    // The agent's CPU is counted in clock ticks (10 ms): rounds add up to a readable figure.
    let rounds = size("LATTICE_BENCH_ISSUANCE_ROUNDS", 5).max(1);
    let server = FakeApiServer::start().unwrap();
    for k in 0..pods {
        server.apply_json(pod(k)).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig).unwrap();
    let env = [
        ("KUBECONFIG", kubeconfig.to_str().unwrap()),
        ("NODE_NAME", NODE),
    ];
    let agent = Agent::start_with_env(&[], &env);
    agent.wait_ready().unwrap();

    // The streams alone: verified, answered, no CA to issue with.
    let (mut stream_cpu, mut streams) = (0.0, Vec::new());
    for _ in 0..rounds {
        let (cpu, took) = round(&agent, pods, CLUSTERS, &[], None).await;
        stream_cpu += cpu / rounds as f64;
        streams.extend(took);
    }
    streams.sort();

    let chain = Chain::issue(&["unused.example".to_string()]).unwrap();
    server.apply_json(ca_secret(&chain, &[&chain])).unwrap();
    wait::until("the agent's issuer", Duration::from_secs(30), || {
        let (_, body) = http_get(agent.admin, "/debug/identity").map_err(|e| e.to_string())?;
        let shown: Value = serde_json::from_str(&body).map_err(|e| e.to_string())?;
        (!shown["issuer"].is_null()).then_some(()).ok_or(body)
    })
    .unwrap();
    let (issue_cpu, certified) = certificate_rounds(&agent, pods, rounds).await;
    drop(agent);

    // The same leaves from Istio's certificate service.
    let ca = IstioCaServer::start().unwrap();
    for k in 0..pods {
        ca.pod(
            &format!("spiffe://cluster.local/ns/default/sa/sa-{k}"),
            NODE,
        );
    }
    let (flags, _) = ca.agent_flags(NODE, dir.path()).unwrap();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let agent = Agent::start_with_env(&flags, &env);
    agent.wait_ready().unwrap();
    wait::until(
        "the agent's certificate service",
        Duration::from_secs(30),
        || {
            let (_, body) = http_get(agent.admin, "/debug/identity").map_err(|e| e.to_string())?;
            body.contains("istio-ca").then_some(()).ok_or(body)
        },
    )
    .unwrap();
    let (remote_cpu, remote) = certificate_rounds(&agent, pods, rounds).await;
    assert!(
        ca.issued().len() >= pods * rounds,
        "the service issued {} leaves",
        ca.issued().len()
    );

    let median = |took: &[Duration]| ms(took[took.len() / 2]);
    let report = json!({
        "pods": pods,
        "rounds": rounds,
        "streams_only": {
            "agent_cpu_s": stream_cpu,
            "all_answered_ms": streams.last().map(|d| ms(*d)),
            "p50_ms": median(&streams),
        },
        "with_certificates": {
            "agent_cpu_s": issue_cpu,
            "agent_cpu_ms_per_pod": issue_cpu * 1e3 / pods as f64,
            "all_certified_ms": certified.last().map(|d| ms(*d)),
            "p50_ms": median(&certified),
        },
        "cpu_ratio": issue_cpu / stream_cpu.max(0.01),
        "with_istio_ca": {
            "agent_cpu_s": remote_cpu,
            "agent_cpu_ms_per_pod": remote_cpu * 1e3 / pods as f64,
            "all_certified_ms": remote.last().map(|d| ms(*d)),
            "p50_ms": median(&remote),
        },
        "istio_ca_cpu_ratio": remote_cpu / issue_cpu.max(0.01),
    });
    println!("BENCH_ISSUANCE_JSON {report}");
}
