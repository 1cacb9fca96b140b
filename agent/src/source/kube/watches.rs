//! The watches the Kubernetes source runs, and their events as the source applies them: each
//! watch's objects mapped to compact entries as they arrive, on a task of the watch's own.

use std::pin::Pin;

use futures::{Stream, StreamExt};
use gateway_api::experimental::httproutes::HttpRoute;
use gateway_api::grpcroutes::GrpcRoute;
use gateway_api::referencegrants::ReferenceGrant;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};

use super::authorizations::{self, AuthorizationEntry, MeshAuthorization};
use super::mapping::{self, MappedService, MappedSlice, ObjectKey};
use super::meshed;
use super::objects::{ServiceObject, SliceObject};
use super::ownership::PathGrants;
use super::routes::{self, GrantEntry, RouteEntry, RouteKey};

/// The resources the source watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Resource {
    Services,
    EndpointSlices,
    HttpRoutes,
    GrpcRoutes,
    ReferenceGrants,
    PathGrants,
    MeshedPods,
    MeshAuthorizations,
}

impl Resource {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Resource::Services => "services",
            Resource::EndpointSlices => "endpointslices",
            Resource::HttpRoutes => "httproutes.gateway.networking.k8s.io",
            Resource::GrpcRoutes => "grpcroutes.gateway.networking.k8s.io",
            Resource::ReferenceGrants => "referencegrants.gateway.networking.k8s.io",
            Resource::PathGrants => "configmaps (path grants)",
            Resource::MeshedPods => "pods (meshed, metadata only)",
            Resource::MeshAuthorizations => "meshauthorizations.lattice.mlab.com",
        }
    }

    /// A resource whose CRD may not be installed: its absence is an empty list, not an error.
    /// The path grants may also be forbidden, to an agent whose role predates them.
    pub(super) fn is_optional(self) -> bool {
        !matches!(self, Resource::Services | Resource::EndpointSlices)
    }
}

/// Which objects one watch covers.
#[derive(Clone, Debug)]
pub(super) struct WatchScope {
    pub(super) resource: Resource,
    pub(super) namespace: Option<String>,
}

/// An object as the index keeps it. Watch events are mapped as they arrive, so whole
/// Kubernetes objects live only as long as one page of a list.
pub(super) enum Object {
    Service(ObjectKey, MappedService),
    Slice(ObjectKey, MappedSlice),
    Route(RouteKey, RouteEntry),
    Grant(ObjectKey, GrantEntry),
    PathGrants(PathGrants),
    MeshedPod(ObjectKey, Option<std::sync::Arc<str>>),
    Authorization(ObjectKey, AuthorizationEntry),
}

impl Object {
    pub(super) fn service(service: &ServiceObject) -> Object {
        let (key, mapped) = mapping::service_entry(service);
        Object::Service(key, mapped)
    }

    pub(super) fn slice(slice: &SliceObject) -> Object {
        let (key, mapped) = mapping::slice_entry(slice);
        Object::Slice(key, mapped)
    }

    pub(super) fn http_route(route: &HttpRoute) -> Object {
        let (key, entry) = routes::http_route_entry(route);
        Object::Route(key, entry)
    }

    pub(super) fn grpc_route(route: &GrpcRoute) -> Object {
        let (key, entry) = routes::grpc_route_entry(route);
        Object::Route(key, entry)
    }

    pub(super) fn grant(grant: &ReferenceGrant) -> Object {
        let (key, entry) = routes::grant_entry(grant);
        Object::Grant(key, entry)
    }

    pub(super) fn path_grants(config_map: &ConfigMap) -> Object {
        Object::PathGrants(PathGrants::from_config_map(config_map))
    }

    pub(super) fn authorization(object: &MeshAuthorization) -> Object {
        let (key, entry) = authorizations::authorization_entry(object);
        Object::Authorization(key, entry)
    }

    pub(super) fn meshed_pod(pod: &PartialObjectMeta<Pod>) -> Object {
        let (key, account) = meshed::meshed_entry(&pod.metadata);
        Object::MeshedPod(key, account)
    }
}

/// One watch event, mapped, with the object's resourceVersion where it is a number (as every
/// etcd-backed API server's is; an opaque one is not compared).
pub(super) enum Change {
    Init,
    InitApply(Object, Option<u64>),
    InitDone,
    Apply(Object, Option<u64>),
    Delete(Object, Option<u64>),
}

impl Change {
    pub(super) fn of<K: kube::Resource>(event: watcher::Event<K>, map: fn(&K) -> Object) -> Change {
        let version = |object: &K| {
            object
                .meta()
                .resource_version
                .as_deref()
                .and_then(|v| v.parse().ok())
        };
        match event {
            watcher::Event::Init => Change::Init,
            watcher::Event::InitApply(object) => Change::InitApply(map(&object), version(&object)),
            watcher::Event::InitDone => Change::InitDone,
            watcher::Event::Apply(object) => Change::Apply(map(&object), version(&object)),
            watcher::Event::Delete(object) => Change::Delete(map(&object), version(&object)),
        }
    }
}

/// One event of one watch: the watch's index in [`WatchSet`], and what it saw.
pub(super) type WatchEvent = (usize, Result<Change, watcher::Error>);

/// The watches being set up: their scopes, and their event streams tagged with their index.
#[derive(Default)]
pub(super) struct Watches {
    pub(super) scopes: Vec<WatchScope>,
    pub(super) streams: Vec<Pin<Box<dyn Stream<Item = WatchEvent> + Send>>>,
}

impl Watches {
    /// Every watch of every namespace, each starting with a list, and the path grants'
    /// ConfigMap (`namespace`, `name`) when given.
    pub(super) fn new(
        client: &kube::Client,
        namespaces: &[Option<String>],
        grants: Option<&(String, String)>,
        meshed_pods: bool,
    ) -> Watches {
        let mut watches = Watches::default();
        let all = watcher::Config::default();
        for namespace in namespaces {
            watches.add(client, namespace, Resource::Services, Object::service, &all);
            watches.add(
                client,
                namespace,
                Resource::EndpointSlices,
                Object::slice,
                &all,
            );
            watches.add(
                client,
                namespace,
                Resource::HttpRoutes,
                Object::http_route,
                &all,
            );
            watches.add(
                client,
                namespace,
                Resource::GrpcRoutes,
                Object::grpc_route,
                &all,
            );
            watches.add(
                client,
                namespace,
                Resource::ReferenceGrants,
                Object::grant,
                &all,
            );
            watches.add(
                client,
                namespace,
                Resource::MeshAuthorizations,
                Object::authorization,
                &all,
            );
        }
        if meshed_pods {
            let labelled = watcher::Config::default().labels(meshed::MESHED_SELECTOR);
            for namespace in namespaces {
                // Metadata only: `Api<PartialObjectMeta<_>>` asks for PartialObjectMetadata.
                watches.add::<PartialObjectMeta<Pod>>(
                    client,
                    namespace,
                    Resource::MeshedPods,
                    Object::meshed_pod,
                    &labelled,
                );
            }
        }
        if let Some((namespace, name)) = grants {
            let one = watcher::Config::default().fields(&format!("metadata.name={name}"));
            let namespace = Some(namespace.clone());
            watches.add(
                client,
                &namespace,
                Resource::PathGrants,
                Object::path_grants,
                &one,
            );
        }
        watches
    }

    fn add<K>(
        &mut self,
        client: &kube::Client,
        namespace: &Option<String>,
        resource: Resource,
        map: fn(&K) -> Object,
        config: &watcher::Config,
    ) where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + std::fmt::Debug
            + serde::de::DeserializeOwned
            + Send
            + 'static,
        K::DynamicType: Default,
    {
        let id = self.scopes.len();
        self.scopes.push(WatchScope {
            resource,
            namespace: namespace.clone(),
        });
        self.streams.push(on_a_task(
            watcher(api::<K>(client, namespace), config.clone())
                .default_backoff()
                .map(move |event| (id, event.map(|e| Change::of(e, map)))),
        ));
    }
}

/// Events a watch's task may have handed on and not yet applied: mapped objects, small.
const EVENTS_IN_FLIGHT: usize = 1024;

/// Drives one watch on a task of its own and hands its events on through a channel, in
/// order. Each watch's pages are read, decoded and mapped on whichever runtime worker is free,
/// so the Services and the EndpointSlices of a list decode on two cores at once instead of
/// taking turns in the one task that applies them. The task ends with its stream, or when the
/// receiver is dropped (a re-list replaces every watch).
fn on_a_task(
    stream: impl Stream<Item = WatchEvent> + Send + 'static,
) -> Pin<Box<dyn Stream<Item = WatchEvent> + Send>> {
    let (tx, rx) = tokio::sync::mpsc::channel(EVENTS_IN_FLIGHT);
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        loop {
            let event = tokio::select! {
                () = tx.closed() => return,
                event = stream.next() => event,
            };
            let Some(event) = event else { return };
            if tx.send(event).await.is_err() {
                return;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx).boxed()
}

pub(super) fn api<K>(client: &kube::Client, namespace: &Option<String>) -> Api<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}
