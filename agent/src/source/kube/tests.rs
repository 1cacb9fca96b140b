//! The source without I/O: fake objects applied to the index and the watch set, assertions on
//! the snapshots they publish.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::{Value, json};

use super::mapping::ObjectKey;
use super::*;
use crate::mesh::{MeshSnapshot, Protocol};

/// Whole objects straight into the index, as the watch streams hand them over mapped.
trait ApplyObjects {
    fn apply_service(&mut self, service: &Service);
    fn apply_slice(&mut self, slice: &EndpointSlice);
}

impl ApplyObjects for MeshIndex {
    fn apply_service(&mut self, service: &Service) {
        let (key, mapped) = mapping::service_entry(&objects::read(service));
        self.apply_mapped_service(key, mapped);
    }

    fn apply_slice(&mut self, slice: &EndpointSlice) {
        let (key, mapped) = mapping::slice_entry(&objects::read(slice));
        self.apply_mapped_slice(key, mapped);
    }
}

/// The older rule, under which these tests' Services claim paths outside their namespace.
fn any_claims() -> Ownership {
    Ownership {
        claims: PathClaims::Any,
        ..Ownership::default()
    }
}

fn trap() -> TrapCidrs {
    "240.240.0.0/16".parse().unwrap()
}

pub(super) fn service(namespace: &str, name: &str, ports: Value) -> Service {
    serde_json::from_value(json!({
        "metadata": {"namespace": namespace, "name": name,
                     "creationTimestamp": "2024-01-01T00:00:00Z"},
        "spec": {"ports": ports},
    }))
    .unwrap()
}

fn annotated(mut svc: Service, path: &str) -> Service {
    svc.metadata.annotations = Some([(PATH_ANNOTATION.to_string(), path.to_string())].into());
    svc
}

pub(super) fn slice(
    namespace: &str,
    name: &str,
    service: &str,
    ports: Value,
    endpoints: Value,
) -> EndpointSlice {
    serde_json::from_value(json!({
        "metadata": {"namespace": namespace, "name": name,
                     "labels": {SERVICE_NAME_LABEL: service}},
        "addressType": "IPv4",
        "ports": ports,
        "endpoints": endpoints,
    }))
    .unwrap()
}

pub(super) fn ready(ips: &[&str]) -> Value {
    ips.iter()
        .map(|ip| json!({"addresses": [ip], "conditions": {"ready": true}}))
        .collect()
}

/// path → [(port, protocol, endpoints)], the part of a snapshot a source decides.
pub(super) type View = Vec<(String, Vec<(u16, Protocol, Vec<String>)>)>;

pub(super) fn view(snapshot: &MeshSnapshot) -> View {
    snapshot
        .services
        .values()
        .map(|s| {
            let ports = s
                .ports
                .iter()
                .map(|p| {
                    (
                        p.port,
                        p.protocol,
                        p.endpoints.addresses().map(|a| a.to_string()).collect(),
                    )
                })
                .collect();
            (s.path.to_string(), ports)
        })
        .collect()
}

fn eps(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn snapshot(index: &mut MeshIndex) -> Arc<MeshSnapshot> {
    index.take_snapshot().expect("a change to publish")
}

#[test]
fn protocol_comes_from_app_protocol_then_name_prefix_then_tcp() {
    assert_eq!(
        port_protocol(Some("kubernetes.io/h2c"), Some("tcp")),
        Protocol::Http2
    );
    assert_eq!(port_protocol(Some("grpc"), None), Protocol::Grpc);
    assert_eq!(port_protocol(Some("mysql"), Some("http")), Protocol::Tcp);
    assert_eq!(port_protocol(None, Some("http-web")), Protocol::Http);
    assert_eq!(port_protocol(None, Some("http2")), Protocol::Http2);
    assert_eq!(port_protocol(None, Some("grpc-api")), Protocol::Grpc);
    assert_eq!(port_protocol(None, Some("httpx")), Protocol::Tcp);
    assert_eq!(port_protocol(None, Some("metrics")), Protocol::Tcp);
    assert_eq!(port_protocol(None, None), Protocol::Tcp);
}

#[test]
fn service_and_slices_map_to_ports_with_target_ports_by_name() {
    let mut index = MeshIndex::new(trap(), Ownership::default());
    index.apply_service(&service(
        "shop",
        "web",
        json!([
            {"name": "http", "port": 80, "targetPort": "web"},
            {"name": "grpc-api", "port": 9090, "targetPort": 9090},
            {"name": "db", "port": 5432, "appProtocol": "postgresql"},
            {"name": "dns", "port": 53, "protocol": "UDP"},
        ]),
    ));
    // The named target port resolves to different numbers in different slices.
    index.apply_slice(&slice(
        "shop",
        "web-a",
        "web",
        json!([{"name": "http", "port": 8080}, {"name": "grpc-api", "port": 9090}, {"name": "db", "port": 5432}]),
        ready(&["10.0.0.1", "10.0.0.2"]),
    ));
    index.apply_slice(&slice(
        "shop",
        "web-b",
        "web",
        json!([{"name": "http", "port": 8081}]),
        ready(&["10.0.1.1"]),
    ));
    let snap = snapshot(&mut index);
    assert_eq!(
        view(&snap),
        vec![(
            "/shop/web".to_string(),
            vec![
                (
                    80,
                    Protocol::Http,
                    eps(&["10.0.0.1:8080", "10.0.0.2:8080", "10.0.1.1:8081"])
                ),
                (
                    5432,
                    Protocol::Tcp,
                    eps(&["10.0.0.1:5432", "10.0.0.2:5432"])
                ),
                (
                    9090,
                    Protocol::Grpc,
                    eps(&["10.0.0.1:9090", "10.0.0.2:9090"])
                ),
            ]
        )]
    );
    let web = &snap.services[&"/shop/web".parse::<crate::mesh::MeshPath>().unwrap()];
    assert_eq!(web.dns_name, "web.shop.system.internal");
}

#[test]
fn unnamed_single_port_matches_the_unnamed_slice_port() {
    let mut index = MeshIndex::new(trap(), Ownership::default());
    index.apply_service(&service(
        "a",
        "one",
        json!([{"port": 80, "targetPort": 8080}]),
    ));
    index.apply_slice(&slice(
        "a",
        "one-x",
        "one",
        json!([{"name": "", "port": 8080}]),
        ready(&["10.0.0.9"]),
    ));
    assert_eq!(
        view(&snapshot(&mut index)),
        vec![(
            "/a/one".to_string(),
            vec![(80, Protocol::Tcp, eps(&["10.0.0.9:8080"]))]
        )]
    );
}

#[test]
fn only_ready_and_not_terminating_endpoints_serve() {
    let mut index = MeshIndex::new(trap(), Ownership::default());
    index.apply_service(&service("a", "web", json!([{"name": "http", "port": 80}])));
    index.apply_slice(&slice(
        "a",
        "web-1",
        "web",
        json!([{"name": "http", "port": 80}]),
        json!([
            {"addresses": ["10.0.0.1"]},
            {"addresses": ["10.0.0.2"], "conditions": {"ready": true}},
            {"addresses": ["10.0.0.3"], "conditions": {"ready": false}},
            {"addresses": ["10.0.0.4"], "conditions": {"ready": true, "terminating": true}},
            {"addresses": ["10.0.0.5"], "conditions": {"serving": true, "terminating": true}},
        ]),
    ));
    assert_eq!(
        view(&snapshot(&mut index)),
        vec![(
            "/a/web".to_string(),
            vec![(80, Protocol::Http, eps(&["10.0.0.1:80", "10.0.0.2:80"]))]
        )]
    );
}

#[test]
fn ipv6_slices_are_ignored_not_mixed() {
    let mut index = MeshIndex::new(trap(), Ownership::default());
    index.apply_service(&service("a", "web", json!([{"name": "http", "port": 80}])));
    index.apply_slice(&slice(
        "a",
        "web-4",
        "web",
        json!([{"name": "http", "port": 80}]),
        ready(&["10.0.0.1"]),
    ));
    let mut v6 = slice(
        "a",
        "web-6",
        "web",
        json!([{"name": "http", "port": 80}]),
        ready(&["fd00::1"]),
    );
    v6.address_type = "IPv6".into();
    index.apply_slice(&v6);
    assert_eq!(
        view(&snapshot(&mut index)),
        vec![(
            "/a/web".to_string(),
            vec![(80, Protocol::Http, eps(&["10.0.0.1:80"]))]
        )]
    );
}

fn external_name(namespace: &str, name: &str, host: &str, ports: Value) -> Service {
    let mut external = service(namespace, name, ports);
    let spec = external.spec.as_mut().unwrap();
    spec.type_ = Some("ExternalName".into());
    spec.external_name = Some(host.into());
    external
}

/// Each port's host-name endpoints as "host:port@provider", for `path`.
fn hosts(snapshot: &MeshSnapshot, path: &str) -> Vec<(u16, Vec<String>)> {
    snapshot.services[&path.parse::<crate::mesh::MeshPath>().unwrap()]
        .ports
        .iter()
        .map(|p| {
            let hosts = p
                .hosts
                .iter()
                .map(|h| format!("{}:{}@{}", h.host, h.port, h.provider));
            (p.port, hosts.collect())
        })
        .collect()
}

#[test]
fn headless_included_external_name_without_ports_skipped() {
    let mut index = MeshIndex::new(trap(), Ownership::default());
    let mut headless = service("a", "db", json!([{"name": "tcp", "port": 5432}]));
    headless.spec.as_mut().unwrap().cluster_ip = Some("None".into());
    index.apply_service(&headless);
    // A DNS alias only: nothing to route.
    index.apply_service(&external_name("a", "alias", "db.example.com", json!([])));
    assert_eq!(
        view(&snapshot(&mut index)),
        vec![("/a/db".to_string(), vec![(5432, Protocol::Tcp, vec![])])]
    );
}

#[test]
fn an_external_name_service_is_served_by_its_external_name_on_each_port() {
    let mut index = MeshIndex::new(trap(), any_claims());
    let external = external_name(
        "ext",
        "payments",
        "API.Payments.example.com.",
        json!([{"name": "https", "port": 443, "targetPort": 8443},
               {"name": "http", "port": 80}]),
    );
    index.apply_service(&annotated(external.clone(), "/partners/payments"));
    // A slice someone made for it is ignored: the external name is the endpoint.
    index.apply_slice(&slice(
        "ext",
        "payments-1",
        "payments",
        json!([{"name": "http", "port": 80}]),
        json!([{"addresses": ["10.0.0.1"]}]),
    ));
    let snap = snapshot(&mut index);
    assert_eq!(
        hosts(&snap, "/partners/payments"),
        [
            (
                80,
                vec!["api.payments.example.com:80@kubernetes".to_string()]
            ),
            // Clients dial the Service port; Kubernetes ignores targetPort for ExternalName.
            (
                443,
                vec!["api.payments.example.com:443@kubernetes".to_string()]
            ),
        ]
    );
    let service = &snap.services[&"/partners/payments"
        .parse::<crate::mesh::MeshPath>()
        .unwrap()];
    assert!(service.ports.iter().all(|p| p.endpoints.is_empty()));
    assert_eq!(service.host_header, crate::mesh::HostHeader::Rewrite);
    assert_eq!(service.dns_name, "payments.partners.system.internal");

    // The annotation keeps the client's Host (and without the path annotation, the Service
    // is at /<namespace>/<name>: payments.ext.system.internal).
    let mut keep = external.clone();
    keep.metadata.annotations =
        Some([(HOST_HEADER_ANNOTATION.to_string(), "keep".to_string())].into());
    index.apply_service(&keep);
    let snap = snapshot(&mut index);
    let service = &snap.services[&"/ext/payments".parse::<crate::mesh::MeshPath>().unwrap()];
    assert_eq!(service.host_header, crate::mesh::HostHeader::Keep);
}

#[test]
fn a_malformed_external_name_or_host_header_skips_the_service_with_a_reason() {
    let bad = external_name(
        "ext",
        "bad",
        "under_score.example.com",
        json!([{"port": 80}]),
    );
    let (_, mapped) = mapping::service_entry(&objects::read(&bad));
    let err = mapped.unwrap_err().to_string();
    assert!(
        err.contains("ext/bad") && err.contains("externalName"),
        "{err}"
    );
    let mut mode = external_name("ext", "mode", "db.example.com", json!([{"port": 80}]));
    mode.metadata.annotations =
        Some([(HOST_HEADER_ANNOTATION.to_string(), "upstream".to_string())].into());
    let (_, mapped) = mapping::service_entry(&objects::read(&mode));
    let err = mapped.unwrap_err().to_string();
    assert!(
        err.contains(HOST_HEADER_ANNOTATION) && err.contains("rewrite or keep"),
        "{err}"
    );
}

fn instances(snapshot: &MeshSnapshot, path: &str) -> Vec<(String, bool, Vec<String>)> {
    snapshot.services[&path.parse::<crate::mesh::MeshPath>().unwrap()]
        .instances
        .iter()
        .map(|i| {
            let endpoints = i.endpoints.iter().map(|(p, e)| format!("{p}->{e}"));
            (i.name.clone(), i.ready, endpoints.collect())
        })
        .collect()
}

#[test]
fn a_headless_services_hostnames_are_its_instances_ready_or_not() {
    let mut index = MeshIndex::new(trap(), Ownership::default());
    let mut db = service("data", "db", json!([{"name": "cql", "port": 9042}]));
    db.spec.as_mut().unwrap().cluster_ip = Some("None".into());
    index.apply_service(&db);
    let endpoint = |hostname: &str, ip: &str, ready: bool, terminating: bool| {
        json!({"addresses": [ip], "hostname": hostname,
               "conditions": {"ready": ready, "terminating": terminating}})
    };
    // One of db's slices, serving port cql on 19042.
    let db_slice = |name: &str, endpoints: Value| {
        slice(
            "data",
            name,
            "db",
            json!([{"name": "cql", "port": 19042}]),
            endpoints,
        )
    };
    index.apply_slice(&db_slice(
        "db-abc",
        json!([
            endpoint("db-0", "10.0.0.10", true, false),
            endpoint("db-1", "10.0.0.11", false, false),
            endpoint("db-2", "10.0.0.12", false, true),
        ]),
    ));
    let snap = snapshot(&mut index);
    assert_eq!(
        instances(&snap, "/data/db"),
        [
            (
                "db-0".to_string(),
                true,
                vec!["9042->10.0.0.10:19042".to_string()]
            ),
            // Not ready: still an instance, with its own name and address.
            (
                "db-1".to_string(),
                false,
                vec!["9042->10.0.0.11:19042".to_string()]
            ),
            // Terminating: on its way out, gone.
        ]
    );
    let service = &snap.services[&"/data/db".parse::<crate::mesh::MeshPath>().unwrap()];
    assert_eq!(service.address, crate::mesh::ServiceAddress::Instances);
    assert_eq!(service.ports[0].name.as_deref(), Some("cql"));
    let db1 = service.instances[1].address;

    // db-1 is rescheduled: a new pod IP in another slice while the old one terminates.
    index.apply_slice(&db_slice(
        "db-abc",
        json!([
            endpoint("db-0", "10.0.0.10", true, false),
            endpoint("db-1", "10.0.0.11", false, true),
        ]),
    ));
    index.apply_slice(&db_slice(
        "db-def",
        json!([endpoint("db-1", "10.0.7.7", true, false)]),
    ));
    let snap = snapshot(&mut index);
    let service = &snap.services[&"/data/db".parse::<crate::mesh::MeshPath>().unwrap()];
    assert_eq!(service.instances[1].address, db1, "same name, same address");
    assert_eq!(
        instances(&snap, "/data/db")[1],
        (
            "db-1".to_string(),
            true,
            vec!["9042->10.0.7.7:19042".to_string()]
        )
    );

    // The same hostnames behind a Service with a cluster IP are not instances.
    let mut index = MeshIndex::new(trap(), Ownership::default());
    index.apply_service(&service_with_ip());
    index.apply_slice(&slice(
        "data",
        "web-abc",
        "web",
        json!([{"name": "cql", "port": 19042}]),
        json!([endpoint("web-0", "10.0.0.20", true, false)]),
    ));
    assert!(instances(&snapshot(&mut index), "/data/web").is_empty());
}

fn service_with_ip() -> Service {
    let mut web = service("data", "web", json!([{"name": "cql", "port": 9042}]));
    web.spec.as_mut().unwrap().cluster_ip = Some("10.96.0.10".into());
    web
}

#[test]
fn the_health_annotation_sets_the_policy_and_a_bad_one_skips_the_service() {
    let mut index = MeshIndex::new(trap(), Ownership::default());
    let mut web = service("a", "web", json!([{"name": "http", "port": 80}]));
    web.metadata.annotations = Some(
        [(
            crate::source::health::HEALTH_ANNOTATION.to_string(),
            r#"{"check": {"http": {"path": "/healthz"}}}"#.to_string(),
        )]
        .into(),
    );
    index.apply_service(&web);
    let mut bad = service("a", "bad", json!([{"name": "http", "port": 80}]));
    bad.metadata.annotations = Some(
        [(
            crate::source::health::HEALTH_ANNOTATION.to_string(),
            "check: {}".to_string(),
        )]
        .into(),
    );
    index.apply_service(&bad);
    let snap = snapshot(&mut index);
    let paths: Vec<&str> = snap.services.keys().map(|p| p.as_str()).collect();
    assert_eq!(paths, ["/a/web"], "the bad annotation's Service is skipped");
    let health = &snap.services[&"/a/web".parse::<crate::mesh::MeshPath>().unwrap()].health;
    assert!(matches!(
        health.check.as_ref().map(|c| &c.kind),
        Some(crate::mesh::health::CheckKind::Http { path, .. }) if path == "/healthz"
    ));
    assert!(health.outlier.is_some(), "outlier detection stays on");
}

#[test]
fn annotation_sets_the_path_and_an_invalid_one_skips_the_service() {
    let mut index = MeshIndex::new(trap(), any_claims());
    let svc = service("a", "web", json!([{"name": "http", "port": 80}]));
    index.apply_service(&annotated(svc.clone(), "/foo/bar/buzz"));
    assert_eq!(view(&snapshot(&mut index))[0].0, "/foo/bar/buzz");
    // Turning the annotation invalid withdraws the service instead of keeping a stale one.
    index.apply_service(&annotated(svc.clone(), "/Foo_Bar"));
    assert!(view(&snapshot(&mut index)).is_empty());
    let (_, mapped) = mapping::service_entry(&objects::read(&annotated(svc, "nope")));
    let err = mapped.unwrap_err().to_string();
    assert!(err.contains("a/web") && err.contains("\"nope\""), "{err}");
}

#[test]
fn colliding_paths_go_to_the_oldest_service_and_pass_on_when_it_leaves() {
    let mut index = MeshIndex::new(trap(), any_claims());
    let mut young = annotated(
        service("b", "young", json!([{"name": "http", "port": 81}])),
        "/shared/name",
    );
    young.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        "2025-01-01T00:00:00Z".parse().unwrap(),
    ));
    index.apply_service(&young);
    index.apply_service(&annotated(
        service("a", "old", json!([{"name": "http", "port": 80}])),
        "/shared/name",
    ));
    let snap = snapshot(&mut index);
    assert_eq!(
        view(&snap),
        vec![(
            "/shared/name".to_string(),
            vec![(80, Protocol::Http, vec![])]
        )]
    );
    index.delete_service(ObjectKey::new("a", "old"));
    let snap = snapshot(&mut index);
    assert_eq!(
        view(&snap),
        vec![(
            "/shared/name".to_string(),
            vec![(81, Protocol::Http, vec![])]
        )]
    );
}

#[test]
fn slices_follow_their_service_label_and_deletes() {
    let mut index = MeshIndex::new(trap(), Ownership::default());
    index.apply_service(&service("a", "one", json!([{"name": "http", "port": 80}])));
    index.apply_service(&service("a", "two", json!([{"name": "http", "port": 80}])));
    let ports = json!([{"name": "http", "port": 80}]);
    index.apply_slice(&slice("a", "s", "one", ports.clone(), ready(&["10.0.0.1"])));
    let one = view(&snapshot(&mut index));
    assert_eq!(one[0].1[0].2, eps(&["10.0.0.1:80"]));
    index.apply_slice(&slice("a", "s", "two", ports, ready(&["10.0.0.1"])));
    let moved = view(&snapshot(&mut index));
    assert_eq!((moved[0].1[0].2.len(), moved[1].1[0].2.len()), (0, 1));
    index.delete_slice(ObjectKey::new("a", "s"));
    let gone = view(&snapshot(&mut index));
    assert!(gone.iter().all(|(_, ports)| ports[0].2.is_empty()));
    // An identical re-apply publishes nothing.
    index.apply_service(&service("a", "one", json!([{"name": "http", "port": 80}])));
    assert!(index.take_snapshot().is_none());
}

pub(super) fn scopes(namespaces: &[Option<&str>]) -> Vec<WatchScope> {
    namespaces
        .iter()
        .flat_map(|ns| {
            [Resource::Services, Resource::EndpointSlices].map(|resource| WatchScope {
                resource,
                namespace: ns.map(String::from),
            })
        })
        .collect()
}

pub(super) fn svc_change(event: watcher::Event<Service>) -> Result<Change, watcher::Error> {
    Ok(Change::of(read_event(event), Object::service))
}

pub(super) fn slice_change(event: watcher::Event<EndpointSlice>) -> Result<Change, watcher::Error> {
    Ok(Change::of(read_event(event), Object::slice))
}

/// An event of k8s-openapi's objects as the watch reads it off the wire.
fn read_event<K: serde::Serialize, T: serde::de::DeserializeOwned>(
    event: watcher::Event<K>,
) -> watcher::Event<T> {
    match event {
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitApply(object) => watcher::Event::InitApply(objects::read(&object)),
        watcher::Event::InitDone => watcher::Event::InitDone,
        watcher::Event::Apply(object) => watcher::Event::Apply(objects::read(&object)),
        watcher::Event::Delete(object) => watcher::Event::Delete(objects::read(&object)),
    }
}

#[test]
fn nothing_is_published_until_both_initial_lists_complete() {
    let mut watches = WatchSet::new(trap(), Ownership::default(), scopes(&[None]));
    watches.handle(0, svc_change(watcher::Event::Init));
    watches.handle(
        0,
        svc_change(watcher::Event::InitApply(service(
            "a",
            "web",
            json!([{"name": "http", "port": 80}]),
        ))),
    );
    watches.handle(0, svc_change(watcher::Event::InitDone));
    assert!(
        watches.publishable().is_none(),
        "services without their slices must not be published"
    );
    watches.handle(1, slice_change(watcher::Event::Init));
    watches.handle(
        1,
        slice_change(watcher::Event::InitApply(slice(
            "a",
            "web-1",
            "web",
            json!([{"name": "http", "port": 80}]),
            ready(&["10.0.0.1"]),
        ))),
    );
    assert!(watches.publishable().is_none());
    watches.handle(1, slice_change(watcher::Event::InitDone));
    let first = watches.publishable().expect("ready after both lists");
    assert_eq!(
        view(&first),
        vec![(
            "/a/web".to_string(),
            vec![(80, Protocol::Http, eps(&["10.0.0.1:80"]))]
        )]
    );
    // An empty cluster is ready too.
    let mut empty = WatchSet::new(trap(), Ownership::default(), scopes(&[None]));
    for watch in [0, 1] {
        empty.handle(
            watch,
            if watch == 0 {
                svc_change(watcher::Event::Init)
            } else {
                slice_change(watcher::Event::Init)
            },
        );
        empty.handle(
            watch,
            if watch == 0 {
                svc_change(watcher::Event::InitDone)
            } else {
                slice_change(watcher::Event::InitDone)
            },
        );
    }
    assert!(empty.publishable().is_some_and(|s| s.services.is_empty()));
}

#[test]
fn a_relist_replaces_its_scope_and_keeps_the_old_state_until_done() {
    let mut watches = WatchSet::new(
        trap(),
        Ownership::default(),
        scopes(&[Some("a"), Some("b")]),
    );
    let http = json!([{"name": "http", "port": 80}]);
    for (watch, ns) in [(0, "a"), (2, "b")] {
        watches.handle(watch, svc_change(watcher::Event::Init));
        watches.handle(
            watch,
            svc_change(watcher::Event::InitApply(service(ns, "keep", http.clone()))),
        );
        watches.handle(
            watch,
            svc_change(watcher::Event::InitApply(service(
                ns,
                "vanish",
                http.clone(),
            ))),
        );
        watches.handle(watch, svc_change(watcher::Event::InitDone));
        watches.handle(watch + 1, slice_change(watcher::Event::Init));
        watches.handle(watch + 1, slice_change(watcher::Event::InitDone));
    }
    let before = watches.publishable().unwrap();
    assert_eq!(before.services.len(), 4);
    // Namespace a re-lists (say after a 410): in the middle, the old state still stands.
    watches.handle(0, svc_change(watcher::Event::Init));
    watches.handle(
        0,
        svc_change(watcher::Event::InitApply(service(
            "a",
            "keep",
            http.clone(),
        ))),
    );
    watches.handle(
        0,
        svc_change(watcher::Event::InitApply(service("a", "new", http.clone()))),
    );
    assert!(watches.publishable().is_none());
    watches.handle(0, svc_change(watcher::Event::InitDone));
    let after = watches.publishable().unwrap();
    let paths: Vec<String> = after.services.keys().map(|p| p.to_string()).collect();
    assert_eq!(paths, ["/a/keep", "/a/new", "/b/keep", "/b/vanish"]);
    // Unchanged services are shared with the previous snapshot, not rebuilt.
    let keep: crate::mesh::MeshPath = "/b/keep".parse().unwrap();
    assert!(Arc::ptr_eq(&before.services[&keep], &after.services[&keep]));
    // Deletes and applies after the list.
    watches.handle(
        2,
        svc_change(watcher::Event::Delete(service("b", "vanish", http.clone()))),
    );
    watches.handle(
        2,
        svc_change(watcher::Event::Apply(service("b", "late", http))),
    );
    let last = watches.publishable().unwrap();
    let paths: Vec<String> = last.services.keys().map(|p| p.to_string()).collect();
    assert_eq!(paths, ["/a/keep", "/a/new", "/b/keep", "/b/late"]);
    assert!(last.version > after.version);
}

#[test]
fn trafficdistribution_and_each_endpoints_zone_node_and_hints_reach_the_mesh() {
    let mut index = MeshIndex::new(trap(), Ownership::default());
    let mut svc = service(
        "shop",
        "web",
        json!([{"name": "http", "port": 80, "protocol": "TCP"}]),
    );
    svc.spec.as_mut().unwrap().traffic_distribution = Some("PreferSameNode".to_string());
    index.apply_service(&svc);
    index.apply_slice(&slice(
        "shop",
        "web-1",
        "web",
        json!([{"name": "http", "port": 8080, "protocol": "TCP"}]),
        json!([
            {"addresses": ["10.0.0.1"], "zone": "a", "nodeName": "n1",
             "hints": {"forZones": [{"name": "a"}], "forNodes": [{"name": "n1"}]}},
            {"addresses": ["10.0.0.2"], "zone": "b", "nodeName": "n2"},
            {"addresses": ["10.0.0.3"]},
        ]),
    ));
    let snap = snapshot(&mut index);
    let web = &snap.services[&"/shop/web".parse::<crate::mesh::MeshPath>().unwrap()];
    assert_eq!(
        web.traffic_distribution,
        crate::mesh::TrafficDistribution::PreferSameNode
    );
    let places: Vec<String> = web.ports[0]
        .endpoints
        .iter()
        .map(|e| {
            let hints = e.hints.as_deref().map(|h| {
                let zones: Vec<&str> = h.for_zones.iter().map(|z| &**z).collect();
                let nodes: Vec<&str> = h.for_nodes.iter().map(|n| &**n).collect();
                format!("{zones:?}/{nodes:?}")
            });
            format!("{} {:?} {:?} {hints:?}", e.address, e.zone, e.node)
        })
        .collect();
    assert_eq!(
        places,
        [
            r#"10.0.0.1:8080 Some("a") Some("n1") Some("[\"a\"]/[\"n1\"]")"#,
            r#"10.0.0.2:8080 Some("b") Some("n2") None"#,
            "10.0.0.3:8080 None None None",
        ]
    );

    // PreferClose is PreferSameZone's older name; an unknown value is no preference; a
    // change of preference alone is a change to publish.
    for (value, expected) in [
        (Some("PreferFarAway"), crate::mesh::TrafficDistribution::Any),
        (
            Some("PreferClose"),
            crate::mesh::TrafficDistribution::PreferSameZone,
        ),
        (None, crate::mesh::TrafficDistribution::Any),
    ] {
        svc.spec.as_mut().unwrap().traffic_distribution = value.map(str::to_string);
        index.apply_service(&svc);
        let snap = snapshot(&mut index);
        let web = &snap.services[&"/shop/web".parse::<crate::mesh::MeshPath>().unwrap()];
        assert_eq!(web.traffic_distribution, expected, "{value:?}");
    }
}

fn versioned(mut svc: Service, version: u64) -> Service {
    svc.metadata.resource_version = Some(version.to_string());
    svc
}

/// Both watches of one namespace listed: Services `listed` (with their versions), no slices.
fn listed(listed: &[(&str, u64)]) -> WatchSet {
    let mut watches = WatchSet::new(trap(), Ownership::default(), scopes(&[None]));
    watches.handle(0, svc_change(watcher::Event::Init));
    for (name, version) in listed {
        let svc = versioned(service("a", name, json!([{"port": 80}])), *version);
        watches.handle(0, svc_change(watcher::Event::InitApply(svc)));
    }
    watches.handle(0, svc_change(watcher::Event::InitDone));
    watches.handle(1, slice_change(watcher::Event::Init));
    watches.handle(1, slice_change(watcher::Event::InitDone));
    assert!(watches.publishable().is_some());
    watches
}

#[test]
fn a_change_older_than_one_seen_before_means_the_server_went_back() {
    let mut watches = listed(&[("one", 5), ("two", 9)]);
    let later = versioned(service("a", "three", json!([{"port": 80}])), 10);
    watches.handle(0, svc_change(watcher::Event::Apply(later)));
    assert_eq!(
        watches.take_rollback(),
        None,
        "a change after the list is in order"
    );
    let older = versioned(service("a", "four", json!([{"port": 80}])), 7);
    watches.handle(0, svc_change(watcher::Event::Apply(older)));
    let reason = watches.take_rollback().expect("a step back");
    assert!(
        reason.contains("resourceVersion 7 after one at 10"),
        "{reason}"
    );
}

#[test]
fn a_server_behind_what_the_watches_saw_means_a_rollback_and_a_relist_published_whole() {
    let mut watches = listed(&[("one", 5), ("two", 9)]);
    watches.observe_revision(12);
    assert_eq!(watches.take_rollback(), None);
    watches.observe_revision(8);
    let reason = watches.take_rollback().expect("below 9");
    assert!(reason.contains("resourceVersion 8, below 9"), "{reason}");

    // Every watch lists again; nothing is published until all have, then the new state.
    watches.relist_all(reason);
    assert!(
        watches
            .failing()
            .unwrap()
            .starts_with("re-listing every resource")
    );
    watches.handle(0, svc_change(watcher::Event::Init));
    let restored = versioned(service("a", "one", json!([{"port": 81}])), 4);
    watches.handle(0, svc_change(watcher::Event::InitApply(restored)));
    watches.handle(0, svc_change(watcher::Event::InitDone));
    assert!(
        watches.publishable().is_none(),
        "the slices are not listed yet"
    );
    watches.handle(1, slice_change(watcher::Event::Init));
    watches.handle(1, slice_change(watcher::Event::InitDone));
    let snapshot = watches.publishable().expect("the restored state");
    let names: Vec<&str> = snapshot.services.keys().map(|p| p.as_str()).collect();
    assert_eq!(names, ["/a/one"]);
    assert_eq!(snapshot.services.values().next().unwrap().ports[0].port, 81);
    assert_eq!(watches.failing(), None);
    // Versions start again from the restored ones: a change at 5 is in order now.
    let next = versioned(service("a", "two", json!([{"port": 80}])), 5);
    watches.handle(0, svc_change(watcher::Event::Apply(next)));
    assert_eq!(watches.take_rollback(), None);
    watches.observe_revision(6);
    assert_eq!(watches.take_rollback(), None);
}

fn dated(svc: Service, created: &str) -> Service {
    let mut svc = svc;
    svc.metadata.creation_timestamp = Some(serde_json::from_value(json!(created)).unwrap());
    svc
}

fn ownership(claims: PathClaims, grants: &[(&str, &str)]) -> Ownership {
    let config_map: k8s_openapi::api::core::v1::ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "lattice-path-grants", "namespace": "lattice-system"},
        "data": grants.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
    }))
    .unwrap();
    Ownership {
        claims,
        grants: PathGrants::from_config_map(&config_map),
        grants_from: "lattice-system/lattice-path-grants".into(),
    }
}

/// The tenant's Service, older, and the payments team's, both claiming `/payments/api` by
/// annotation.
fn claimants(index: &mut MeshIndex) {
    let ports = json!([{"port": 80, "name": "http"}]);
    let tenant = dated(
        annotated(service("tenant", "grab", ports.clone()), "/payments/api"),
        "2020-01-01T00:00:00Z",
    );
    let payments = dated(
        annotated(service("payments", "gateway", ports), "/payments/api"),
        "2024-01-01T00:00:00Z",
    );
    index.apply_service(&tenant);
    index.apply_service(&payments);
}

fn holder(snapshot: &MeshSnapshot) -> Vec<(String, Vec<String>)> {
    let refused = snapshot
        .refused_paths
        .iter()
        .map(|r| format!("{} {}: {}", r.service, r.path, r.reason))
        .collect();
    let paths = snapshot.services.keys().map(|p| p.to_string()).collect();
    vec![("services".into(), paths), ("refused".into(), refused)]
}

#[test]
fn a_tenant_cannot_claim_a_path_outside_its_namespace_and_the_owner_gets_it() {
    let mut index = MeshIndex::new(trap(), ownership(PathClaims::Granted, &[]));
    claimants(&mut index);
    let seen = holder(&snapshot(&mut index));
    assert_eq!(seen[0].1, ["/payments/api"]);
    assert_eq!(seen[1].1.len(), 1, "{seen:?}");
    assert!(
        seen[1].1[0].starts_with(
            "tenant/grab /payments/api: namespace tenant may claim paths \
                                  under /tenant only"
        ),
        "{seen:?}"
    );
    // Which Service holds the path: the payments team's.
    let mut probe = MeshIndex::new(trap(), ownership(PathClaims::Granted, &[]));
    claimants(&mut probe);
    assert!(
        probe
            .lookup(&ObjectKey::new("payments", "gateway"))
            .unwrap()
            .1
    );

    // A grant makes the tenant's claim allowed; among allowed claims the oldest wins.
    index.set_grants(ownership(PathClaims::Granted, &[("tenant", "/payments")]).grants);
    let seen = holder(&snapshot(&mut index));
    assert!(index.lookup(&ObjectKey::new("tenant", "grab")).unwrap().1);
    assert_eq!(seen[1].1.len(), 1, "{seen:?}");
    assert!(
        seen[1].1[0].starts_with("payments/gateway /payments/api: held by Service tenant/grab")
    );
    // The grant revoked: back to the payments team.
    index.set_grants(PathGrants::default());
    snapshot(&mut index);
    assert!(
        index
            .lookup(&ObjectKey::new("payments", "gateway"))
            .unwrap()
            .1
    );
}

#[test]
fn a_services_own_path_beats_an_annotated_claim_on_it() {
    let mut index = MeshIndex::new(
        trap(),
        ownership(PathClaims::Granted, &[("shop", "/other")]),
    );
    let ports = json!([{"port": 80, "name": "http"}]);
    index.apply_service(&dated(
        annotated(service("other", "squatter", ports.clone()), "/other/web"),
        "2020-01-01T00:00:00Z",
    ));
    index.apply_service(&dated(
        service("other", "web", ports),
        "2024-01-01T00:00:00Z",
    ));
    snapshot(&mut index);
    assert!(index.lookup(&ObjectKey::new("other", "web")).unwrap().1);
}

#[test]
fn with_any_claims_the_oldest_wins_as_before() {
    let mut index = MeshIndex::new(trap(), ownership(PathClaims::Any, &[]));
    claimants(&mut index);
    let seen = holder(&snapshot(&mut index));
    assert!(index.lookup(&ObjectKey::new("tenant", "grab")).unwrap().1);
    assert!(
        seen[1].1[0].starts_with("payments/gateway /payments/api: held by Service tenant/grab")
    );
}

#[test]
fn a_service_whose_every_endpoint_is_a_meshed_pod_names_their_identities() {
    let mut index = MeshIndex::new(trap(), Ownership::default()).with_meshed_pods("cluster.local");
    index.apply_service(&service(
        "shop",
        "web",
        json!([{"name": "http", "port": 80}]),
    ));
    let endpoint = |ip: &str, pod: &str| {
        json!({"addresses": [ip], "conditions": {"ready": true},
               "targetRef": {"kind": "Pod", "namespace": "shop", "name": pod}})
    };
    index.apply_slice(&slice(
        "shop",
        "web-1",
        "web",
        json!([{"name": "http", "port": 8080}]),
        json!([endpoint("10.0.0.1", "web-a"), endpoint("10.0.0.2", "web-b")]),
    ));
    let mut last = snapshot(&mut index);
    let mut identities = |index: &mut MeshIndex| -> Vec<String> {
        if let Some(newer) = index.take_snapshot() {
            last = newer;
        }
        let path: crate::mesh::MeshPath = "/shop/web".parse().unwrap();
        last.services[&path]
            .identities
            .iter()
            .map(|i| i.to_string())
            .collect()
    };
    assert!(identities(&mut index).is_empty(), "no pod meshed yet");
    index.set_meshed_pod(&ObjectKey::new("shop", "web-a"), Some("web"));
    assert!(identities(&mut index).is_empty(), "web-b is not meshed");
    index.set_meshed_pod(&ObjectKey::new("shop", "web-b"), Some("web"));
    assert_eq!(
        identities(&mut index),
        ["spiffe://cluster.local/ns/shop/sa/web"]
    );
    // A re-list that no longer has web-b: plaintext again.
    index.replace_meshed_pods(
        Some("shop"),
        vec![(ObjectKey::new("shop", "web-a"), Some(Arc::from("web")))],
    );
    assert!(identities(&mut index).is_empty());
}

/// MeshAuthorization rules once listed stand through a 404 (an API server that has just
/// restarted answers so for custom resources a moment), reported stale; a kind that was never
/// there is an empty list.
#[test]
fn authorization_rules_stand_through_a_passing_404() {
    use super::authorizations::MeshAuthorization;
    let mut scopes = scopes(&[None]);
    scopes.push(WatchScope {
        resource: Resource::MeshAuthorizations,
        namespace: None,
    });
    let mut watches = WatchSet::new(trap(), Ownership::default(), scopes);
    let ports = json!([{"name": "http", "port": 80}]);
    watches.handle(0, svc_change(watcher::Event::Init));
    watches.handle(
        0,
        svc_change(watcher::Event::InitApply(service(
            "a",
            "web",
            ports.clone(),
        ))),
    );
    watches.handle(0, svc_change(watcher::Event::InitDone));
    watches.handle(1, slice_change(watcher::Event::Init));
    watches.handle(
        1,
        slice_change(watcher::Event::InitApply(slice(
            "a",
            "web-1",
            "web",
            ports,
            ready(&["10.0.0.1"]),
        ))),
    );
    watches.handle(1, slice_change(watcher::Event::InitDone));
    let policy: MeshAuthorization = serde_json::from_value(json!({
        "apiVersion": "lattice.mlab.com/v1alpha1", "kind": "MeshAuthorization",
        "metadata": {"namespace": "a", "name": "callers"},
        "spec": {"targetRef": {"kind": "Service", "name": "web"},
                 "rules": [{"from": [{"namespace": "a"}]}]},
    }))
    .unwrap();
    let change = |event| Ok(Change::of(event, Object::authorization));
    watches.handle(2, change(watcher::Event::Init));
    watches.handle(2, change(watcher::Event::InitApply(policy)));
    watches.handle(2, change(watcher::Event::InitDone));
    let rules = |snapshot: &MeshSnapshot| {
        snapshot
            .services
            .values()
            .map(|s| s.authorization.len())
            .sum::<usize>()
    };
    let first = watches.publishable().expect("every list done");
    assert_eq!(rules(&first), 1);

    let not_found = kube::core::Status {
        code: 404,
        ..kube::core::Status::default()
    };
    watches.handle(
        2,
        Err(watcher::Error::WatchFailed(kube::Error::Api(Box::new(
            not_found,
        )))),
    );
    assert!(
        watches.publishable().is_none_or(|s| rules(&s) == 1),
        "the rules stand"
    );
    assert!(
        watches.failing().is_some(),
        "and the view is reported stale"
    );
}
