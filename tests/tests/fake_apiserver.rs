//! The fake API server's Gateway API kinds through the real kube client and kube-runtime's
//! watcher, decoded into the `gateway-api` crate's types: what the agent will see of
//! HTTPRoutes, GRPCRoutes and ReferenceGrants, and of a cluster without their CRDs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Debug;
use std::time::Duration;

use futures::{Stream, StreamExt};
use gateway_api::experimental::httproutes::HttpRoute;
use gateway_api::grpcroutes::GrpcRoute;
use gateway_api::referencegrants::ReferenceGrant;
use kube::api::{Api, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use lattice_e2e::fake_apiserver::FakeApiServer;
use lattice_e2e::k8s_objects::{grpc_route, http_route, reference_grant, service_parent};
use lattice_e2e::wait;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::UnboundedReceiverStream;

/// How long a change may take to reach a watcher; generous, as CI machines are slow.
const FOLLOW: Duration = Duration::from_secs(10);
/// How long a watcher may take to recover from failures: it backs off 0.8 s, doubling.
const RECOVER: Duration = Duration::from_secs(30);

async fn client(server: &FakeApiServer) -> Client {
    let kubeconfig = Kubeconfig::from_yaml(&server.kubeconfig()).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap();
    Client::try_from(config).unwrap()
}

/// An HTTPRoute on Service `web`'s port 80 that sends everything to `backend`.
fn route_to(namespace: &str, name: &str, backend: &str) -> Value {
    http_route(
        namespace,
        name,
        json!([service_parent("web", Some(80))]),
        json!([{"backendRefs": [{"name": backend, "port": 80}]}]),
    )
}

/// The first backend of a route's first rule.
fn backend(route: &HttpRoute) -> Option<&str> {
    let rule = route.spec.rules.as_ref()?.first()?;
    Some(rule.backend_refs.as_ref()?.first()?.name.as_str())
}

/// Polls the stream until `wanted` picks an item, or fails after `within` with what it saw.
async fn next_matching<T: Debug, R>(
    stream: &mut (impl Stream<Item = T> + Unpin),
    within: Duration,
    what: &str,
    mut wanted: impl FnMut(&T) -> Option<R>,
) -> R {
    let deadline = Instant::now() + within;
    let mut seen = Vec::new();
    loop {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(Some(item)) => match wanted(&item) {
                Some(found) => return found,
                None => seen.push(format!("{item:?}")),
            },
            Ok(None) => panic!("the stream ended waiting for {what}; saw {seen:#?}"),
            Err(_) => panic!("timed out after {within:?} waiting for {what}; saw {seen:#?}"),
        }
    }
}

/// Runs kube-runtime's watcher, with its default backoff, on its own task, so it keeps
/// watching while the test acts on the server.
fn spawn_watcher(api: Api<HttpRoute>) -> UnboundedReceiverStream<WatchEvent> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut events = watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(event) = events.next().await {
            if tx.send(event).is_err() {
                return;
            }
        }
    });
    UnboundedReceiverStream::new(rx)
}

type WatchEvent = Result<watcher::Event<HttpRoute>, watcher::Error>;

/// Whether the watcher failed to list or to watch because the server does not serve the kind.
fn failed_not_found(event: &WatchEvent) -> bool {
    matches!(
        event,
        Err(watcher::Error::InitialListFailed(err) | watcher::Error::WatchStartFailed(err))
            if is_not_found(err)
    )
}

fn is_not_found(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == 404 && status.reason == "NotFound")
}

#[tokio::test]
async fn lists_decode_into_gateway_api_types() {
    let server = FakeApiServer::start().unwrap();
    server
        .apply_json(route_to("shop", "web", "web-v2"))
        .unwrap();
    let mut dated = route_to("shop", "dated", "web-v1");
    dated["metadata"]["creationTimestamp"] = "2020-01-01T00:00:00Z".into();
    server.apply_json(dated).unwrap();
    server
        .apply_json(route_to("shop", "later", "web-v3"))
        .unwrap();
    server
        .apply_json(grpc_route(
            "shop",
            "rpc",
            json!([service_parent("rpc", None)]),
            json!([{"backendRefs": [{"name": "rpc-v2", "port": 9000}]}]),
        ))
        .unwrap();
    server
        .apply_json(reference_grant(
            "shop",
            "from-other",
            json!([{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute",
                    "namespace": "other"}]),
            json!([{"group": "", "kind": "Service", "name": "web"}]),
        ))
        .unwrap();
    let client = client(&server).await;

    let routes = Api::<HttpRoute>::all(client.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    let names: Vec<String> = routes.iter().map(ResourceExt::name_any).collect();
    assert_eq!(names, ["dated", "later", "web"]);
    let web = Api::<HttpRoute>::namespaced(client.clone(), "shop")
        .get("web")
        .await
        .unwrap();
    let parent = &web.spec.parent_refs.as_ref().unwrap()[0];
    assert_eq!(
        (
            parent.group.as_deref(),
            parent.kind.as_deref(),
            parent.name.as_str(),
            parent.port
        ),
        (Some(""), Some("Service"), "web", Some(80))
    );
    assert_eq!(backend(&web), Some("web-v2"));
    assert!(web.metadata.uid.is_some() && web.metadata.resource_version.is_some());

    // The agent orders routes by creation: a given timestamp is kept, and one applied later
    // is never created earlier.
    let created = |name: &str| {
        routes
            .iter()
            .find(|r| r.name_any() == name)
            .and_then(|r| r.metadata.creation_timestamp.clone())
            .unwrap()
            .0
    };
    assert_eq!(created("dated").to_string(), "2020-01-01T00:00:00Z");
    assert!(created("dated") < created("web"));
    assert!(created("web") <= created("later"));

    let rpcs = Api::<GrpcRoute>::namespaced(client.clone(), "shop")
        .list(&ListParams::default())
        .await
        .unwrap();
    assert_eq!(rpcs.items.len(), 1);
    let rpc = &rpcs.items[0];
    let parent = &rpc.spec.parent_refs.as_ref().unwrap()[0];
    assert_eq!((parent.name.as_str(), parent.port), ("rpc", None));
    let rule = &rpc.spec.rules.as_ref().unwrap()[0];
    assert_eq!(rule.backend_refs.as_ref().unwrap()[0].name, "rpc-v2");

    let grants = Api::<ReferenceGrant>::all(client)
        .list(&ListParams::default())
        .await
        .unwrap();
    assert_eq!(grants.items.len(), 1);
    let grant = &grants.items[0].spec;
    assert_eq!(
        (
            grant.from[0].kind.as_str(),
            grant.from[0].namespace.as_str()
        ),
        ("HTTPRoute", "other")
    );
    assert_eq!(
        (grant.to[0].kind.as_str(), grant.to[0].name.as_deref()),
        ("Service", Some("web"))
    );
}

#[tokio::test]
async fn watcher_sees_an_httproute_applied_modified_and_deleted() {
    let server = FakeApiServer::start().unwrap();
    let api = Api::<HttpRoute>::namespaced(client(&server).await, "shop");
    let mut events = spawn_watcher(api);
    next_matching(&mut events, FOLLOW, "the initial list", |e| {
        matches!(e, Ok(watcher::Event::InitDone)).then_some(())
    })
    .await;

    // Another namespace's route must not show up in this namespaced watch.
    server.apply_json(route_to("other", "web", "nope")).unwrap();
    server
        .apply_json(route_to("shop", "web", "web-v1"))
        .unwrap();
    let applied = next_matching(&mut events, FOLLOW, "the route applied", |e| match e {
        Ok(watcher::Event::Apply(route)) => Some(route.clone()),
        _ => None,
    })
    .await;
    assert_eq!(
        (applied.namespace().as_deref(), backend(&applied)),
        (Some("shop"), Some("web-v1"))
    );

    server
        .apply_json(route_to("shop", "web", "web-v2"))
        .unwrap();
    let modified = next_matching(&mut events, FOLLOW, "the route modified", |e| match e {
        Ok(watcher::Event::Apply(route)) => Some(route.clone()),
        _ => None,
    })
    .await;
    assert_eq!(backend(&modified), Some("web-v2"));
    assert_eq!(modified.metadata.uid, applied.metadata.uid);
    assert_eq!(
        modified.metadata.creation_timestamp,
        applied.metadata.creation_timestamp
    );

    assert!(server.delete::<HttpRoute>("shop", "web").unwrap());
    let deleted = next_matching(&mut events, FOLLOW, "the route deleted", |e| match e {
        Ok(watcher::Event::Delete(route)) => Some(route.name_any()),
        _ => None,
    })
    .await;
    assert_eq!(deleted, "web");
}

#[tokio::test]
async fn a_kind_uninstalled_at_start_is_404_until_installed() {
    let server = FakeApiServer::start().unwrap();
    server.uninstall::<HttpRoute>().unwrap();
    let client = client(&server).await;
    let api = Api::<HttpRoute>::all(client.clone());

    let err = api.list(&ListParams::default()).await.unwrap_err();
    assert!(is_not_found(&err), "{err:?}");
    // The other Gateway API kinds are still there.
    Api::<GrpcRoute>::all(client)
        .list(&ListParams::default())
        .await
        .unwrap();

    let mut events = spawn_watcher(api);
    next_matching(&mut events, FOLLOW, "the watcher's 404", |e| {
        failed_not_found(e).then_some(())
    })
    .await;

    server.install::<HttpRoute>().unwrap();
    server
        .apply_json(route_to("shop", "web", "web-v1"))
        .unwrap();
    let listed = next_matching(
        &mut events,
        RECOVER,
        "the route after install",
        |e| match e {
            // A relist between install and apply sees it as a watch event instead.
            Ok(watcher::Event::InitApply(route) | watcher::Event::Apply(route)) => {
                Some(route.name_any())
            }
            _ => None,
        },
    )
    .await;
    assert_eq!(listed, "web");
}

#[tokio::test]
async fn uninstalling_a_kind_ends_its_watches_and_installing_recovers_them() {
    let server = FakeApiServer::start().unwrap();
    server
        .apply_json(route_to("shop", "web", "web-v1"))
        .unwrap();
    let api = Api::<HttpRoute>::all(client(&server).await);
    let mut events = spawn_watcher(api);
    next_matching(&mut events, FOLLOW, "the initial list", |e| {
        matches!(e, Ok(watcher::Event::InitDone)).then_some(())
    })
    .await;
    wait::until_async("the watch to open", FOLLOW, || async {
        match server.open_watches() {
            1 => Ok(()),
            n => Err(format!("{n} open watches")),
        }
    })
    .await
    .unwrap();

    // As deleting the CRD: the route goes, then the watch ends and watching again gets 404.
    server.uninstall::<HttpRoute>().unwrap();
    let deleted = next_matching(&mut events, FOLLOW, "the route deleted", |e| match e {
        Ok(watcher::Event::Delete(route)) => Some(route.name_any()),
        _ => None,
    })
    .await;
    assert_eq!(deleted, "web");
    next_matching(&mut events, FOLLOW, "the watcher's 404", |e| {
        failed_not_found(e).then_some(())
    })
    .await;
    assert!(server.objects::<HttpRoute>().unwrap().is_empty());

    server.install::<HttpRoute>().unwrap();
    server
        .apply_json(route_to("shop", "back", "web-v2"))
        .unwrap();
    let listed = next_matching(
        &mut events,
        RECOVER,
        "the route after install",
        |e| match e {
            // A relist between install and apply sees it as a watch event instead.
            Ok(watcher::Event::InitApply(route) | watcher::Event::Apply(route)) => {
                Some(route.name_any())
            }
            _ => None,
        },
    )
    .await;
    assert_eq!(listed, "back");
}
