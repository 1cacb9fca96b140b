//! Only this node's pods get the mesh, and only as themselves: the agent runs as the DaemonSet
//! runs it (xDS and DNS on the node-local address 169.254.20.10, `NODE_NAME` set, Kubernetes
//! from the fake API server, which also serves this node's and another node's Pods through a
//! `spec.nodeName` field selector), and ADS streams come from real network namespaces.
//!
//! What fails when the feature breaks:
//! - the client pod's real Envoy (node id `client.default`, its Pod on this node) gets its
//!   config and routes a request; `/debug/xds` names its pod;
//! - a stream from an address that is a Pod of another node, or of no pod, is refused with
//!   PERMISSION_DENIED saying so; so is one from a pod of this node sending another pod's node
//!   id; the same pod with its own node id is served;
//! - a namespace that plays another node reaches no xDS server on the node's address, and one
//!   that routes to the node-local address anyway is refused as an unknown peer;
//! - deleting the client's Pod ends its stream (counted as `pod_gone`).
//!
//! Build the binaries first: `cargo build --workspace --bins`.

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Node as EnvoyNode;
use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
use lattice_e2e::ads_probe::first_delta_answer;
use lattice_e2e::agent::{Agent, AgentAddrs};
use lattice_e2e::fake_apiserver::FakeApiServer;
use lattice_e2e::netns::Netns;
use lattice_e2e::node::{ADMIN, Node};
use lattice_e2e::wait;
use serde_json::json;
use tonic::{Code, Status};

const NODE_LOCAL: Ipv4Addr = Ipv4Addr::new(169, 254, 20, 10);
const XDS: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(NODE_LOCAL), 15010);
const DNS: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(NODE_LOCAL), 53);
const CLUSTERS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const WITHIN: Duration = Duration::from_secs(15);

fn pod(name: &str, node: &str, ip: Ipv4Addr) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"namespace": "default", "name": name},
           "spec": {"nodeName": node, "containers": [{"name": "app", "image": "app"}]},
           "status": {"phase": "Running", "podIP": ip.to_string(),
                      "podIPs": [{"ip": ip.to_string()}]}})
}

/// Opens a Delta ADS stream from inside `netns` to `xds` as `node_id`, and returns the type of
/// the agent's first response, or the status that ended the stream.
fn first_answer(netns: &Netns, xds: SocketAddr, node_id: &str) -> Result<String, Status> {
    let request = DeltaDiscoveryRequest {
        node: Some(EnvoyNode {
            id: node_id.to_string(),
            ..EnvoyNode::default()
        }),
        type_url: CLUSTERS.to_string(),
        ..DeltaDiscoveryRequest::default()
    };
    first_delta_answer(netns, xds, request).map(|response| response.type_url)
}

fn refused(answer: Result<String, Status>, saying: &str) {
    match answer {
        Err(status) if status.code() == Code::PermissionDenied => assert!(
            status.message().contains(saying),
            "expected {saying:?} in {:?}",
            status.message()
        ),
        other => panic!("expected PERMISSION_DENIED saying {saying:?}, got {other:?}"),
    }
}

fn refusals(agent: &Agent, reason: &str) -> u64 {
    let (_, metrics) = agent.get("/metrics").unwrap();
    let prefix = format!("lattice_xds_refused_streams_total{{reason=\"{reason}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn only_this_nodes_pods_get_the_mesh_and_only_as_themselves() {
    let node = Node::new("idn").unwrap();
    let web = node.http_backend("web", 11, 8080).unwrap();
    let server = node.netns.enter(FakeApiServer::start).unwrap().unwrap();
    server
        .apply_json(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": "shop", "name": "web"},
            "spec": {"ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]},
        }))
        .unwrap();
    server
        .apply_json(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": "shop", "name": "web-1",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [web.pod.address.to_string()],
                           "conditions": {"ready": true}}],
        }))
        .unwrap();
    let this_node = "node-a";
    for (name, node_name, host) in [
        ("client", this_node, 2),
        ("batch", this_node, 4),
        ("intruder", "node-b", 3),
    ] {
        server
            .apply_json(pod(name, node_name, Ipv4Addr::new(10, 200, 0, host)))
            .unwrap();
    }
    let (_dir, kubeconfig) = server.kubeconfig_file().unwrap();
    let agent = node
        .agent_at(
            AgentAddrs {
                xds: XDS,
                dns: DNS,
                admin: ADMIN,
            },
            &["--node-local-dns", &NODE_LOCAL.to_string()],
            &[
                ("KUBECONFIG", kubeconfig.as_str()),
                ("NODE_NAME", this_node),
            ],
        )
        .unwrap();

    // The client pod's Envoy is served (it goes LIVE only once it holds its config) and routes.
    let client = node.client_of("client", 2, XDS, DNS).unwrap();
    // Its Envoy holds what its pod uses (tests/scope.rs): the app resolves the name first.
    let shared = SocketAddr::from((Ipv4Addr::new(240, 240, 0, 1), 8080));
    wait::until("web's name to resolve", WITHIN, || {
        client
            .resolve("web.shop.system.internal")
            .map_err(|e| e.to_string())
    })
    .unwrap();
    wait::until("a request through the client's Envoy", WITHIN, || {
        client.http(shared, "web.shop.system.internal:8080")
    })
    .unwrap();
    let (_, proxies) = agent.get("/debug/xds").unwrap();
    assert!(
        proxies.contains("\"pod\":\"default/client\""),
        "/debug/xds: {proxies}"
    );

    // A Pod of another node, and an address that is no pod at all.
    let intruder = node.pod("intruder", 3).unwrap();
    refused(
        first_answer(&intruder.netns, XDS, "intruder.default"),
        "10.200.0.3 is not the address of a running pod on this node",
    );
    let stranger = node.pod("stranger", 5).unwrap();
    refused(
        first_answer(&stranger.netns, XDS, "client.default"),
        "10.200.0.5 is not the address of a running pod on this node",
    );
    // A pod of this node, as another pod, then as itself.
    let batch = node.pod("batch", 4).unwrap();
    refused(
        first_answer(&batch.netns, XDS, "client.default"),
        "node id \"client.default\" does not name the pod at 10.200.0.4, which is default/batch",
    );
    match first_answer(&batch.netns, XDS, "batch.default") {
        Ok(type_url) => assert_eq!(type_url, CLUSTERS),
        Err(status) => panic!("batch as itself was refused: {status:?}"),
    }

    // Another node on the same network: nothing serves xDS on the node's own address, and
    // routing to the node-local address by hand only gets it refused.
    let other_node = node.pod("nodeb", 250).unwrap();
    other_node.netns.ip(&["route", "del", "default"]).unwrap();
    assert!(
        other_node
            .netns
            .enter(|| TcpStream::connect_timeout(
                &SocketAddr::from((lattice_e2e::node::NODE_IP, 15010)),
                Duration::from_secs(2)
            ))
            .unwrap()
            .is_err(),
        "the node's address serves xDS"
    );
    other_node
        .netns
        .ip(&[
            "route",
            "add",
            &format!("{NODE_LOCAL}/32"),
            "via",
            &lattice_e2e::node::NODE_IP.to_string(),
        ])
        .unwrap();
    refused(
        first_answer(&other_node.netns, XDS, "client.default"),
        "10.200.0.250 is not the address of a running pod on this node",
    );
    assert!(refusals(&agent, "unknown_peer") >= 3, "unknown_peer count");
    assert!(
        refusals(&agent, "wrong_node_id") >= 1,
        "wrong_node_id count"
    );

    // The client's Pod is deleted: its stream ends, and its Envoy's reconnects are refused.
    server
        .delete::<k8s_openapi::api::core::v1::Pod>("default", "client")
        .unwrap();
    wait::until(
        "the deleted pod's stream to end",
        WITHIN,
        || match refusals(&agent, "pod_gone") {
            0 => Err(agent.get("/debug/xds").map(|(_, b)| b).unwrap_or_default()),
            _ => Ok(()),
        },
    )
    .unwrap();
    drop(client);
}
