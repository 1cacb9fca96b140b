//! The Gateway API mapping without I/O: route, grant and Service objects applied to the index,
//! assertions on the rules and rejections of the snapshots it publishes.

use gateway_api::experimental::httproutes::HttpRoute;
use gateway_api::grpcroutes::GrpcRoute;
use gateway_api::referencegrants::ReferenceGrant;
use k8s_openapi::api::core::v1::Service;
use lattice_contract::TrapCidrs;
use serde_json::{Value, json};

use super::index::MeshIndex;
use super::mapping;
use super::routes::{grant_entry, grpc_route_entry, http_route_entry};
use crate::mesh::route::{BackendTarget, PathMatch, RouteRule, RuleSource, ValueMatch};
use crate::mesh::{MeshPath, MeshSnapshot};

fn index() -> MeshIndex {
    MeshIndex::new(
        "240.240.0.0/16".parse::<TrapCidrs>().unwrap(),
        super::Ownership::default(),
    )
}

fn service(index: &mut MeshIndex, namespace: &str, name: &str, ports: Value) {
    let service: Service = serde_json::from_value(json!({
        "metadata": {"namespace": namespace, "name": name,
                     "creationTimestamp": "2024-01-01T00:00:00Z"},
        "spec": {"ports": ports},
    }))
    .unwrap();
    let (key, mapped) = mapping::service_entry(&super::objects::read(&service));
    index.apply_mapped_service(key, mapped);
}

fn http(port: u16) -> Value {
    json!([{"name": "http", "port": port, "appProtocol": "http"}])
}

/// An HTTPRoute on Service `parent` (port optional), created at `created`.
fn http_route(
    namespace: &str,
    name: &str,
    created: &str,
    parent: Value,
    rules: Value,
) -> HttpRoute {
    serde_json::from_value(json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"namespace": namespace, "name": name, "creationTimestamp": created},
        "spec": {"parentRefs": [parent], "rules": rules},
    }))
    .unwrap()
}

fn parent(name: &str) -> Value {
    json!({"group": "", "kind": "Service", "name": name})
}

fn apply(index: &mut MeshIndex, route: &HttpRoute) {
    let (key, entry) = http_route_entry(route);
    index.apply_route(key, entry);
}

fn rules(snapshot: &MeshSnapshot, path: &str) -> Vec<RouteRule> {
    snapshot.services[&path.parse::<MeshPath>().unwrap()]
        .routes
        .to_vec()
}

/// Three HTTP Services in `shop`: web (the parent), blue and green.
fn shop() -> MeshIndex {
    let mut index = index();
    for name in ["web", "blue", "green"] {
        service(&mut index, "shop", name, http(8080));
    }
    index
}

#[test]
fn a_split_maps_to_weighted_service_backends_with_every_field() {
    let mut index = shop();
    apply(
        &mut index,
        &http_route(
            "shop",
            "canary",
            "2024-01-02T00:00:00Z",
            json!({"group": "", "kind": "Service", "name": "web", "port": 8080}),
            json!([{
                "matches": [{
                    "path": {"type": "PathPrefix", "value": "/api/"},
                    "method": "GET",
                    "headers": [{"name": "X-Release", "value": "gr.*", "type": "RegularExpression"},
                                {"name": "x-release", "value": "ignored: the first counts"}],
                    "queryParams": [{"name": "a", "value": "1"}],
                }],
                "backendRefs": [{"name": "blue", "port": 8080, "weight": 90},
                                {"name": "green", "port": 8080, "weight": 10}],
                "filters": [{"type": "RequestHeaderModifier", "requestHeaderModifier": {
                    "set": [{"name": "x-set", "value": "1"}],
                    "add": [{"name": "x-add", "value": "2"}],
                    "remove": ["x-remove"]}}],
                "timeouts": {"request": "2s", "backendRequest": "500ms"},
                "retry": {"attempts": 3, "codes": [503], "backoff": "25ms"},
            }]),
        ),
    );
    let snapshot = index.take_snapshot().unwrap();
    let rules = rules(&snapshot, "/shop/web");
    assert_eq!(rules.len(), 1);
    let rule = &rules[0];
    assert_eq!(
        rule.source,
        RuleSource::Kubernetes {
            kind: "HTTPRoute".into(),
            namespace: "shop".into(),
            name: "canary".into(),
            rule: 0
        }
    );
    assert_eq!(rule.port, Some(8080));
    let m = &rule.matches[0];
    assert_eq!(m.path, PathMatch::Prefix("/api".into()));
    assert_eq!(m.method.as_deref(), Some("GET"));
    assert_eq!(
        m.headers.len(),
        1,
        "the second condition on one header is dropped"
    );
    assert_eq!(m.headers[0].value, ValueMatch::Regex("gr.*".into()));
    assert_eq!(m.query[0].value, ValueMatch::Exact("1".into()));
    let targets: Vec<(&BackendTarget, u32)> = rule
        .backends
        .iter()
        .map(|b| (&b.target, b.weight))
        .collect();
    assert_eq!(
        targets,
        [
            (
                &BackendTarget::Service {
                    path: "/shop/blue".parse().unwrap(),
                    port: 8080
                },
                90
            ),
            (
                &BackendTarget::Service {
                    path: "/shop/green".parse().unwrap(),
                    port: 8080
                },
                10
            )
        ]
    );
    assert_eq!(rule.request_headers.set, [("x-set".into(), "1".into())]);
    assert_eq!(rule.request_headers.remove, ["x-remove"]);
    assert_eq!(rule.timeout, Some(std::time::Duration::from_secs(2)));
    assert_eq!(
        rule.backend_timeout,
        Some(std::time::Duration::from_millis(500))
    );
    let retry = rule.retry.as_ref().unwrap();
    assert_eq!((retry.attempts, retry.codes.as_slice()), (3, &[503][..]));
    assert!(snapshot.rejected_routes.is_empty());
}

#[test]
fn unknown_parent_is_refused_until_the_service_appears() {
    let mut index = shop();
    apply(
        &mut index,
        &http_route(
            "shop",
            "orphan",
            "2024-01-02T00:00:00Z",
            parent("nope"),
            json!([{"backendRefs": [{"name": "blue", "port": 8080}]}]),
        ),
    );
    let snapshot = index.take_snapshot().unwrap();
    assert_eq!(snapshot.rejected_routes.len(), 1);
    let rejected = &snapshot.rejected_routes[0];
    assert_eq!(rejected.route, "HTTPRoute shop/orphan");
    assert!(
        rejected.reason.contains("shop/nope does not exist"),
        "{rejected:?}"
    );

    service(&mut index, "shop", "nope", http(8080));
    let snapshot = index.take_snapshot().unwrap();
    assert!(snapshot.rejected_routes.is_empty());
    assert_eq!(
        rules(&snapshot, "/shop/nope").len(),
        1,
        "the route applies now"
    );
}

#[test]
fn a_missing_backend_is_a_500_share_that_resolves_when_it_appears() {
    let mut index = shop();
    apply(
        &mut index,
        &http_route(
            "shop",
            "split",
            "2024-01-02T00:00:00Z",
            parent("web"),
            json!([{"backendRefs": [{"name": "blue", "port": 8080},
                                    {"name": "missing", "port": 8080},
                                    {"name": "green", "port": 9999}]}]),
        ),
    );
    let snapshot = index.take_snapshot().unwrap();
    let targets: Vec<BackendTarget> = rules(&snapshot, "/shop/web")[0]
        .backends
        .iter()
        .map(|b| b.target.clone())
        .collect();
    assert!(matches!(targets[0], BackendTarget::Service { .. }));
    assert!(
        matches!(&targets[1], BackendTarget::Unresolved { reason } if reason.contains("no Service shop/missing")),
        "{targets:?}"
    );
    assert!(
        matches!(&targets[2], BackendTarget::Unresolved { reason } if reason.contains("no port 9999")),
        "{targets:?}"
    );
    assert!(
        snapshot.rejected_routes.is_empty(),
        "a bad backend does not reject its route"
    );

    service(&mut index, "shop", "missing", http(8080));
    let snapshot = index.take_snapshot().unwrap();
    assert!(matches!(
        rules(&snapshot, "/shop/web")[0].backends[1].target,
        BackendTarget::Service { .. }
    ));
}

#[test]
fn a_cross_namespace_backend_needs_a_reference_grant() {
    let mut index = shop();
    service(&mut index, "billing", "pay", http(8080));
    apply(
        &mut index,
        &http_route(
            "shop",
            "to-billing",
            "2024-01-02T00:00:00Z",
            parent("web"),
            json!([{"backendRefs": [{"name": "pay", "namespace": "billing", "port": 8080}]}]),
        ),
    );
    let target = |index: &mut MeshIndex| {
        let snapshot = index.take_snapshot().unwrap();
        rules(&snapshot, "/shop/web")[0].backends[0].target.clone()
    };
    assert!(
        matches!(target(&mut index), BackendTarget::Unresolved { reason } if reason.contains("no ReferenceGrant in namespace billing")),
    );

    let grant: ReferenceGrant = serde_json::from_value(json!({
        "metadata": {"namespace": "billing", "name": "from-shop"},
        "spec": {"from": [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "namespace": "shop"}],
                 "to": [{"group": "", "kind": "Service", "name": "pay"}]},
    }))
    .unwrap();
    let (key, entry) = grant_entry(&grant);
    index.apply_grant(key.clone(), entry);
    assert_eq!(
        target(&mut index),
        BackendTarget::Service {
            path: "/billing/pay".parse().unwrap(),
            port: 8080
        }
    );
    index.delete_grant(key);
    assert!(
        matches!(target(&mut index), BackendTarget::Unresolved { .. }),
        "access revoked"
    );
}

#[test]
fn two_routes_on_one_parent_merge_by_age_and_matches_by_precedence() {
    let mut index = shop();
    // The younger route is applied first; the older one's equal match must still come first.
    apply(
        &mut index,
        &http_route(
            "shop",
            "young",
            "2024-03-01T00:00:00Z",
            parent("web"),
            json!([{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                    "backendRefs": [{"name": "green", "port": 8080}]}]),
        ),
    );
    apply(
        &mut index,
        &http_route(
            "shop",
            "old",
            "2024-02-01T00:00:00Z",
            parent("web"),
            json!([{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                    "backendRefs": [{"name": "blue", "port": 8080}]},
                   {"matches": [{"path": {"type": "Exact", "value": "/v2"}}],
                    "backendRefs": [{"name": "green", "port": 8080}]}]),
        ),
    );
    let snapshot = index.take_snapshot().unwrap();
    let rules = rules(&snapshot, "/shop/web");
    let table = crate::mesh::route::RouteTable::new(&rules, 8080);
    let order: Vec<String> = table
        .entries
        .iter()
        .map(|(_, r)| r.source.to_string())
        .collect();
    assert_eq!(
        order,
        [
            "HTTPRoute shop/old rule 1",
            "HTTPRoute shop/old rule 0",
            "HTTPRoute shop/young rule 0"
        ]
    );
}

#[test]
fn what_a_route_may_not_bind_to_is_refused_with_the_reason() {
    let mut index = shop();
    service(
        &mut index,
        "shop",
        "db",
        json!([{"name": "tcp", "port": 5432}]),
    );
    let rule = json!([{"backendRefs": [{"name": "blue", "port": 8080}]}]);
    let created = "2024-01-02T00:00:00Z";
    apply(
        &mut index,
        &http_route("shop", "tcp-parent", created, parent("db"), rule.clone()),
    );
    apply(
        &mut index,
        &http_route(
            "other",
            "consumer",
            created,
            json!({"group": "", "kind": "Service", "name": "web", "namespace": "shop"}),
            rule.clone(),
        ),
    );
    apply(
        &mut index,
        &http_route(
            "shop",
            "bad-port",
            created,
            json!({"group": "", "kind": "Service", "name": "web", "port": 9}),
            rule.clone(),
        ),
    );
    apply(
        &mut index,
        &http_route(
            "shop",
            "bad-regex",
            created,
            parent("web"),
            json!([{"matches": [{"path": {"type": "RegularExpression", "value": "/v[0-9"}}],
                    "backendRefs": [{"name": "blue", "port": 8080}]}]),
        ),
    );
    apply(
        &mut index,
        &http_route(
            "shop",
            "redirect",
            created,
            parent("web"),
            json!([{"filters": [{"type": "RequestRedirect", "requestRedirect": {"hostname": "x"}}]}]),
        ),
    );
    let grpc: GrpcRoute = serde_json::from_value(json!({
        "metadata": {"namespace": "shop", "name": "grpc", "creationTimestamp": created},
        "spec": {"parentRefs": [parent("blue")],
                 "rules": [{"backendRefs": [{"name": "green", "port": 8080}]}]},
    }))
    .unwrap();
    let (key, entry) = grpc_route_entry(&grpc);
    index.apply_route(key, entry);
    apply(
        &mut index,
        &http_route("shop", "loses", created, parent("blue"), rule),
    );

    let snapshot = index.take_snapshot().unwrap();
    let reasons: Vec<(String, String)> = snapshot
        .rejected_routes
        .iter()
        .map(|r| (r.route.clone(), r.reason.clone()))
        .collect();
    let reason = |route: &str| {
        reasons
            .iter()
            .find(|(r, _)| r == route)
            .map(|(_, reason)| reason.as_str())
            .unwrap_or_else(|| panic!("{route} not refused: {reasons:?}"))
    };
    assert!(reason("HTTPRoute shop/tcp-parent").contains("has a tcp port (5432)"));
    assert!(reason("HTTPRoute other/consumer").contains("consumer routes"));
    assert!(reason("HTTPRoute shop/bad-port").contains("has no port 9"));
    assert!(
        reason("HTTPRoute shop/bad-regex").contains("not a regular expression Envoy's RE2 reads")
    );
    assert!(reason("HTTPRoute shop/redirect").contains("filter RequestRedirect is not supported"));
    assert!(reason("HTTPRoute shop/loses").contains("GRPCRoute shop/grpc"));
    assert_eq!(reasons.len(), 6, "{reasons:?}");
    // Nothing refused reached a service; the GRPCRoute did.
    assert!(rules(&snapshot, "/shop/db").is_empty());
    assert!(rules(&snapshot, "/shop/web").is_empty());
    assert_eq!(rules(&snapshot, "/shop/blue").len(), 1);
}

#[test]
fn grpc_methods_map_to_paths() {
    let mut index = shop();
    let grpc: GrpcRoute = serde_json::from_value(json!({
        "metadata": {"namespace": "shop", "name": "grpc", "creationTimestamp": "2024-01-02T00:00:00Z"},
        "spec": {"parentRefs": [parent("web")],
                 "rules": [{"matches": [
                     {"method": {"service": "pkg.Echo", "method": "Say"}},
                     {"method": {"service": "pkg.Echo"}},
                     {"method": {"method": "Say"}},
                     {"headers": [{"name": "x-test", "value": "a"}]}],
                   "backendRefs": [{"name": "blue", "port": 8080, "weight": 70},
                                   {"name": "echo-v3", "port": 8080, "weight": 0}]}]},
    }))
    .unwrap();
    let (key, entry) = grpc_route_entry(&grpc);
    index.apply_route(key, entry);
    let snapshot = index.take_snapshot().unwrap();
    let rules = rules(&snapshot, "/shop/web");
    let paths: Vec<&PathMatch> = rules[0].matches.iter().map(|m| &m.path).collect();
    assert_eq!(
        paths,
        [
            &PathMatch::Exact("/pkg.Echo/Say".into()),
            &PathMatch::Prefix("/pkg.Echo".into()),
            &PathMatch::Regex("/[^/]+/Say".into()),
            &PathMatch::any()
        ]
    );
    assert_eq!(
        rules[0].backends[1].weight, 0,
        "a missing 0-weight backend carries nothing"
    );
}
