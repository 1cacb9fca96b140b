//! Kubernetes objects as the fake API server takes them (JSON), built the way the tests and
//! benchmarks need them: Services, EndpointSlices of ready endpoints, a generated mesh, and the
//! Gateway API's routes and ReferenceGrants.

use std::net::Ipv4Addr;

use serde_json::{Value, json};

use crate::fake_apiserver::FakeApiServer;

pub fn service(namespace: &str, name: &str, ports: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"namespace": namespace, "name": name},
        "spec": {"ports": ports},
    })
}

pub fn slice(namespace: &str, name: &str, service: &str, ports: Value, endpoints: Value) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"namespace": namespace, "name": name,
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": ports,
        "endpoints": endpoints,
    })
}

pub fn http_route(namespace: &str, name: &str, parent_refs: Value, rules: Value) -> Value {
    route("HTTPRoute", namespace, name, parent_refs, rules)
}

pub fn grpc_route(namespace: &str, name: &str, parent_refs: Value, rules: Value) -> Value {
    route("GRPCRoute", namespace, name, parent_refs, rules)
}

fn route(kind: &str, namespace: &str, name: &str, parent_refs: Value, rules: Value) -> Value {
    json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": kind,
        "metadata": {"namespace": namespace, "name": name},
        "spec": {"parentRefs": parent_refs, "rules": rules},
    })
}

/// A route's parentRef to a Service (the mesh's parent), on one port or all of them.
pub fn service_parent(name: &str, port: Option<u16>) -> Value {
    let mut parent = json!({"group": "", "kind": "Service", "name": name});
    if let Some(port) = port {
        parent["port"] = port.into();
    }
    parent
}

pub fn reference_grant(namespace: &str, name: &str, from: Value, to: Value) -> Value {
    json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "ReferenceGrant",
        "metadata": {"namespace": namespace, "name": name},
        "spec": {"from": from, "to": to},
    })
}

/// Ready endpoints, one per address.
pub fn ready(ips: &[String]) -> Value {
    ips.iter()
        .map(|ip| json!({"addresses": [ip], "conditions": {"ready": true}}))
        .collect()
}

/// The `n`th address of 10.0.0.0/8.
pub fn ip(n: u32) -> String {
    Ipv4Addr::from(0x0a00_0000 + n).to_string()
}

/// Service `i` of a generated mesh: (namespace, name).
pub fn generated(i: usize) -> (String, String) {
    (format!("ns{}", i % 10), format!("svc{i}"))
}

/// The slice of generated service `i` (`svc<i>-a`, HTTP on 8080) with these endpoints.
pub fn generated_slice(i: usize, ips: &[String]) -> Value {
    let (namespace, name) = generated(i);
    slice(
        &namespace,
        &format!("{name}-a"),
        &name,
        json!([{"name": "http", "port": 8080}]),
        ready(ips),
    )
}

/// `services` Services (HTTP on 80) in 10 namespaces, each with one slice of `per` ready
/// endpoints: service `i` has addresses `ip(i * per) ..`.
pub fn populate(server: &FakeApiServer, services: usize, per: usize) -> anyhow::Result<()> {
    for i in 0..services {
        let (namespace, name) = generated(i);
        server.apply_json(service(
            &namespace,
            &name,
            json!([{"name": "http", "port": 80}]),
        ))?;
        let ips: Vec<String> = (0..per).map(|k| ip((i * per + k) as u32)).collect();
        server.apply_json(generated_slice(i, &ips))?;
    }
    Ok(())
}

/// The agent's `MeshAuthorization` kind, as the tests apply and delete it (the agent reads its
/// own type of it; `deploy/crds/meshauthorization.yaml` is its schema).
#[derive(kube::CustomResource, Clone, Debug, Default, serde::Deserialize, serde::Serialize)]
#[kube(
    group = "lattice.mlab.com",
    version = "v1alpha1",
    kind = "MeshAuthorization",
    plural = "meshauthorizations",
    namespaced,
    schema = "disabled"
)]
pub struct MeshAuthorizationSpec {
    #[serde(rename = "targetRef")]
    pub target_ref: Value,
    pub rules: Vec<Value>,
}

/// A `MeshAuthorization` of `namespace` for its Service `service`.
pub fn mesh_authorization(namespace: &str, name: &str, service: &str, rules: Value) -> Value {
    json!({
        "apiVersion": "lattice.mlab.com/v1alpha1",
        "kind": "MeshAuthorization",
        "metadata": {"namespace": namespace, "name": name},
        "spec": {"targetRef": {"kind": "Service", "name": service}, "rules": rules},
    })
}
