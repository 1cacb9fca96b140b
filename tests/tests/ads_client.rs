//! The synthetic ADS client of the harness against the real agent fed by the fake API server,
//! once over SotW and once over Delta: it syncs every cluster's endpoints, sees a single
//! endpoint change and a removed service, and the agent records its ACKs.
//!
//! Build the binary first: `cargo build -p lattice-agent --bins`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use lattice_e2e::ads_client::AdsClient;
use lattice_e2e::agent::Agent;
use lattice_e2e::envoy::AdsMode;
use lattice_e2e::fake_apiserver::FakeApiServer;
use lattice_e2e::k8s_objects::{generated, generated_slice, ip, populate};
use lattice_e2e::wait;

const WITHIN: Duration = Duration::from_secs(10);

fn cluster(i: usize) -> String {
    let (namespace, name) = generated(i);
    format!("{name}.{namespace}.system.internal|80")
}

fn at_8080(ips: &[String]) -> Vec<SocketAddr> {
    let mut out: Vec<SocketAddr> = ips
        .iter()
        .map(|ip| SocketAddr::new(ip.parse().unwrap(), 8080))
        .collect();
    out.sort();
    out
}

async fn sees_endpoint_changes(mode: AdsMode) {
    let server = FakeApiServer::start().unwrap();
    populate(&server, 3, 2).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig).unwrap();
    let agent = Agent::start_with_env(&[], &[("KUBECONFIG", kubeconfig.to_str().unwrap())]);
    agent.wait_ready().unwrap();

    let node = format!("ads-client-{mode:?}").to_lowercase();
    let mut client = AdsClient::connect(agent.xds, &node, mode).await.unwrap();
    let initial: Vec<Vec<SocketAddr>> = (0..3)
        .map(|i| at_8080(&[ip(i as u32 * 2), ip(i as u32 * 2 + 1)]))
        .collect();
    client
        // The listener follows the clusters and their endpoints (make before break).
        .wait_for(
            "3 clusters with their endpoints, and the listener",
            WITHIN,
            |v| {
                v.clusters.len() == 3
                    && (0..3).all(|i| v.endpoints_of(&cluster(i)) == Some(initial[i].as_slice()))
                    && v.listeners.len() == 1
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{:?}\nagent log:\n{}", client.view(), agent.log()));

    // The agent holds an ACK from this client for clusters, endpoints and the listener.
    wait::until(
        "/debug/xds to list the client's 3 ACKed types",
        WITHIN,
        || {
            let (_, body) = agent.get("/debug/xds").map_err(|e| e.to_string())?;
            let proxies: serde_json::Value =
                serde_json::from_str(&body).map_err(|e| e.to_string())?;
            let acked = proxies
                .as_array()
                .and_then(|p| p.iter().find(|p| p["node_id"] == node.as_str()))
                .and_then(|p| p["acked"].as_object().map(|a| a.len()));
            if acked == Some(3) { Ok(()) } else { Err(body) }
        },
    )
    .unwrap();

    // One endpoint of svc1 replaced: only its assignment changes, after the apply.
    let before = client.view();
    let applied = Instant::now();
    let moved = [ip(2), ip(1000)];
    server.apply_json(generated_slice(1, &moved)).unwrap();
    client
        .wait_for("svc1's new endpoint", WITHIN, |v| {
            v.endpoints_of(&cluster(1)) == Some(at_8080(&moved).as_slice())
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{:?}\nagent log:\n{}", client.view(), agent.log()));
    let after = client.view();
    assert!(after.endpoints[cluster(1).as_str()].1 >= applied);
    for i in [0, 2] {
        assert_eq!(
            after.endpoints[cluster(i).as_str()],
            before.endpoints[cluster(i).as_str()],
            "{} changed",
            cluster(i)
        );
    }
    assert!(after.bytes > before.bytes);

    // A second change arrives too: the client ACKed the first push (an un-ACKed type gets
    // nothing newer).
    let again = [ip(2), ip(1001)];
    server.apply_json(generated_slice(1, &again)).unwrap();
    client
        .wait_for("svc1's second new endpoint", WITHIN, |v| {
            v.endpoints_of(&cluster(1)) == Some(at_8080(&again).as_slice())
        })
        .await
        .unwrap();

    // A removed service takes its cluster and endpoints with it.
    let (namespace, name) = generated(2);
    server.delete::<Service>(&namespace, &name).unwrap();
    client
        .wait_for("svc2 gone", WITHIN, |v| {
            !v.clusters.contains(cluster(2).as_str()) && v.endpoints_of(&cluster(2)).is_none()
        })
        .await
        .unwrap();
    let view = client.view();
    assert_eq!(view.nacks, 0, "{view:?}");
    assert_eq!(view.acks, view.responses, "{view:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sotw_client_sees_an_endpoint_change_from_the_agent() {
    sees_endpoint_changes(AdsMode::Sotw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_client_sees_an_endpoint_change_from_the_agent() {
    sees_endpoint_changes(AdsMode::Delta).await;
}
