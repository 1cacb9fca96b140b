//! A fake Kubernetes API server that owns the wire protocol of a table of resources — core/v1
//! Services, discovery.k8s.io/v1 EndpointSlices, the Gateway API's HTTPRoutes, GRPCRoutes and
//! ReferenceGrants, core/v1 Pods, ConfigMaps, Secrets and Nodes, admissionregistration's
//! MutatingWebhookConfigurations, apps' DaemonSets and Deployments, and RBAC's roles and
//! bindings (see [`KINDS`]) — over real HTTP on loopback, so the agent
//! and the injector under test talk to it through their real kube client and a kubeconfig.
//!
//! Reads are get, list and watch; writes are create (POST to a collection: 409 AlreadyExists
//! if the name is taken) and update (PUT to an object: 404 if it is absent, 409 Conflict if
//! the body's resourceVersion is not the stored one, the optimistic concurrency a real server
//! keeps).
//!
//! It keeps what an API server backed by etcd keeps: one global, monotonically increasing
//! resourceVersion, the current objects, and the history of changes since the last compaction.
//! Lists are paged (`limit`/`continue`) from a consistent snapshot, except those at
//! `resourceVersion=0`, which a real server answers whole from its watch cache (kube's watcher
//! lists that way, with a limit of 500 it then ignores); watches replay history after their `resourceVersion`, then stream live
//! events as chunked JSON lines, send BOOKMARKs when asked, end after `timeoutSeconds`, and answer
//! a version older than the compaction with an in-stream ERROR event carrying a 410 Status, as a
//! real API server does.
//!
//! The store can be backed up and restored ([`FakeApiServer::restore`]), as etcd is, with or
//! without the revision bump that makes every watch re-list.
//!
//! A kind can be uninstalled and installed again ([`FakeApiServer::uninstall`]), as the Gateway
//! API's CRDs are on a real cluster: while absent its paths answer 404 as unknown paths do.
//!
//! The server runs on its own Tokio runtime, so tests drive it with plain (blocking) calls from
//! sync or async code alike.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use axum::body::Body;
use bytes::Bytes;
use futures::StreamExt;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnboundedReceiverStream;

/// How often open watches that asked for bookmarks get one.
const BOOKMARK_INTERVAL: Duration = Duration::from_secs(1);

const GATEWAY_API: &str = "gateway.networking.k8s.io";

/// Every resource the fake serves. Routing, list, watch, get, bookmarks, apply and
/// install/uninstall all go by this table: serving another kind is one entry here.
pub static KINDS: &[Kind] = &[
    Kind::namespaced("", "v1", "Service", "services"),
    Kind::namespaced("discovery.k8s.io", "v1", "EndpointSlice", "endpointslices"),
    Kind::namespaced(GATEWAY_API, "v1", "HTTPRoute", "httproutes"),
    Kind::namespaced(GATEWAY_API, "v1", "GRPCRoute", "grpcroutes"),
    Kind::namespaced(GATEWAY_API, "v1", "ReferenceGrant", "referencegrants"),
    Kind::namespaced(
        "lattice.mlab.com",
        "v1alpha1",
        "MeshAuthorization",
        "meshauthorizations",
    ),
    Kind::namespaced("", "v1", "Pod", "pods"),
    Kind::namespaced("", "v1", "ConfigMap", "configmaps"),
    Kind::namespaced("", "v1", "Secret", "secrets"),
    Kind::cluster_scoped("", "v1", "Node", "nodes"),
    Kind::cluster_scoped("", "v1", "Namespace", "namespaces"),
    Kind::cluster_scoped(
        "admissionregistration.k8s.io",
        "v1",
        "MutatingWebhookConfiguration",
        "mutatingwebhookconfigurations",
    ),
    Kind::namespaced("apps", "v1", "DaemonSet", "daemonsets"),
    Kind::namespaced("apps", "v1", "Deployment", "deployments"),
    Kind::cluster_scoped(RBAC, "v1", "ClusterRole", "clusterroles"),
    Kind::cluster_scoped(RBAC, "v1", "ClusterRoleBinding", "clusterrolebindings"),
    Kind::namespaced(RBAC, "v1", "Role", "roles"),
    Kind::namespaced(RBAC, "v1", "RoleBinding", "rolebindings"),
];

const RBAC: &str = "rbac.authorization.k8s.io";

/// A resource the fake serves, as API discovery describes it.
#[derive(Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Kind {
    /// The API group; "" is the core group, served under `/api` rather than `/apis`.
    pub group: &'static str,
    pub version: &'static str,
    /// The kind, as in an object's `kind` field.
    pub name: &'static str,
    /// The resource, as in the request path.
    pub plural: &'static str,
    pub namespaced: bool,
}

impl Kind {
    const fn namespaced(
        group: &'static str,
        version: &'static str,
        name: &'static str,
        plural: &'static str,
    ) -> Kind {
        Kind {
            group,
            version,
            name,
            plural,
            namespaced: true,
        }
    }

    const fn cluster_scoped(
        group: &'static str,
        version: &'static str,
        name: &'static str,
        plural: &'static str,
    ) -> Kind {
        Kind {
            group,
            version,
            name,
            plural,
            namespaced: false,
        }
    }

    /// The kind a Rust type (k8s-openapi or a kube `CustomResource`) stands for.
    pub fn of<K: kube::Resource<DynamicType = ()>>() -> anyhow::Result<&'static Kind> {
        let (group, version, name) = (K::group(&()), K::version(&()), K::kind(&()));
        KINDS
            .iter()
            .find(|k| k.group == group && k.version == version && k.name == name)
            .with_context(|| {
                format!(
                    "{name} ({}) is not served by the fake API server",
                    K::api_version(&())
                )
            })
    }

    /// The kind an object's `kind` field names; kind names are unique across [`KINDS`].
    fn named(name: &str) -> Option<&'static Kind> {
        KINDS.iter().find(|k| k.name == name)
    }

    /// The kind a request path addresses.
    fn at(group: &str, version: &str, plural: &str) -> Option<&'static Kind> {
        KINDS
            .iter()
            .find(|k| k.group == group && k.version == version && k.plural == plural)
    }

    /// The `apiVersion` of its objects: `group/version`, or just `version` in the core group.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// How the real API server names the resource in messages: `plural` or `plural.group`.
    fn qualified_plural(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }
}

/// Where an object lives: (kind, namespace, name); the namespace is "" for cluster-scoped
/// kinds. Ordered like etcd keys, so lists and continue tokens are stable.
type Key = (&'static Kind, String, String);

#[derive(Clone)]
struct Stored {
    json: Bytes,
}

/// One change, serialized once as the watch line every watcher in scope receives; a watcher
/// with a field selector gets the line its selector makes of it ([`Change::line_for`]).
#[derive(Clone)]
struct Change {
    rv: u64,
    kind: &'static Kind,
    namespace: String,
    line: Bytes,
    /// ADDED, MODIFIED or DELETED, and the object after the change (for DELETED, as deleted).
    event: &'static str,
    object: Bytes,
    /// The object before a MODIFIED change.
    before: Option<Bytes>,
}

impl Change {
    /// The line a watcher with `selector` receives, if any. As on a real API server, an object
    /// that comes to match is ADDED, and one that stops matching is DELETED, for that watcher.
    fn line_for(&self, selector: &FieldSelector) -> Option<Bytes> {
        if selector.is_empty() {
            return Some(self.line.clone());
        }
        let now = selector.matches(&self.object);
        let before = self.before.as_ref().is_some_and(|b| selector.matches(b));
        let event = match (self.event, before, now) {
            ("MODIFIED", false, true) => "ADDED",
            ("MODIFIED", true, false) => "DELETED",
            (_, _, true) => self.event,
            _ => return None,
        };
        Some(event_line(event, &self.object))
    }
}

/// A `fieldSelector`: `path=value` and `path!=value` terms (`==` too), comma-separated, all of
/// which must hold. A path is a dotted JSON path (`spec.nodeName`, `metadata.name`); a missing
/// field reads as "".
#[derive(Clone, Debug, Default)]
struct FieldSelector(Vec<(Vec<String>, bool, String)>);

impl FieldSelector {
    fn parse(text: &str) -> Result<FieldSelector, String> {
        Self::terms(text, "field", |path| {
            path.split('.').map(str::to_string).collect()
        })
    }

    /// A `labelSelector` of equality terms (`key=value`, `key==value`, `key!=value`), read as
    /// terms on `metadata.labels`; set-based terms are refused, as this server does not
    /// implement them.
    fn parse_labels(text: &str) -> Result<FieldSelector, String> {
        Self::terms(text, "label", |key| {
            vec!["metadata".into(), "labels".into(), key.to_string()]
        })
    }

    /// Comma-separated `left=value`, `left==value` and `left!=value` terms, each `left` read
    /// as a JSON path by `path`.
    fn terms(
        text: &str,
        kind: &str,
        path: impl Fn(&str) -> Vec<String>,
    ) -> Result<FieldSelector, String> {
        let mut terms = Vec::new();
        for term in text.split(',').filter(|t| !t.is_empty()) {
            let split = if let Some((l, v)) = term.split_once("!=") {
                Some((l, false, v))
            } else if let Some((l, v)) = term.split_once("==") {
                Some((l, true, v))
            } else {
                term.split_once('=').map(|(l, v)| (l, true, v))
            };
            // Set-based terms (`in`, `notin`, `exists`) are not implemented here.
            let Some((left, equal, value)) =
                split.filter(|(l, _, v)| !l.contains(' ') && !v.contains(['(', ')', ' ']))
            else {
                return Err(format!(
                    "{kind} selector term {term:?}: the fake API server supports equality terms only"
                ));
            };
            terms.push((path(left), equal, value.to_string()));
        }
        Ok(FieldSelector(terms))
    }

    /// Both selectors' terms: an object must match all of them.
    fn and(mut self, other: FieldSelector) -> FieldSelector {
        self.0.extend(other.0);
        self
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn matches(&self, json: &[u8]) -> bool {
        if self.is_empty() {
            return true;
        }
        let Ok(object) = serde_json::from_slice::<Value>(json) else {
            return false;
        };
        self.0.iter().all(|(path, equal, value)| {
            let field = path
                .iter()
                .try_fold(&object, |v, key| v.get(key))
                .and_then(Value::as_str)
                .unwrap_or_default();
            (field == value) == *equal
        })
    }
}

struct Watcher {
    kind: &'static Kind,
    namespace: Option<String>,
    selector: FieldSelector,
    /// The client asked for metadata only (PartialObjectMetadata).
    metadata_only: bool,
    bookmarks: bool,
    /// The version the watch started from: as a real API server's watch cache, it sends only
    /// changes after it, and bookmarks once the store has reached it.
    from: u64,
    tx: mpsc::UnboundedSender<Bytes>,
}

impl Watcher {
    fn sees(&self, kind: &Kind, namespace: &str) -> bool {
        self.kind == kind && self.namespace.as_deref().is_none_or(|ns| ns == namespace)
    }
}

/// A paged list in progress: the snapshot it pages through, as of `rv`.
struct Page {
    rv: u64,
    /// The resource listed, so uninstalling it can drop the lists in progress.
    kind: &'static Kind,
    items: Arc<[Bytes]>,
}

#[derive(Default)]
struct Store {
    rv: u64,
    /// Versions below this are compacted away: watching from them gets 410.
    compacted: u64,
    next_uid: u64,
    /// The latest creationTimestamp the fake handed out (seconds since the epoch).
    last_created: u64,
    objects: BTreeMap<Key, Stored>,
    history: Vec<Change>,
    watchers: Vec<Watcher>,
    pages: HashMap<u64, Page>,
    next_page: u64,
    requests: u64,
    /// Kinds uninstalled by the test, as a CRD that is not installed: their paths are 404.
    absent: BTreeSet<&'static Kind>,
}

impl Store {
    fn push(&mut self, change: Change) {
        self.watchers.retain(|w| {
            if !w.sees(change.kind, &change.namespace) || change.rv <= w.from {
                return true;
            }
            match change.line_for(&w.selector) {
                Some(line) if w.metadata_only => w.tx.send(metadata_line(&line)).is_ok(),
                Some(line) => w.tx.send(line).is_ok(),
                None => true,
            }
        });
        self.history.push(change);
    }

    fn ensure_installed(&self, kind: &Kind) -> anyhow::Result<()> {
        ensure!(
            !self.absent.contains(kind),
            "{} ({}) is uninstalled on the fake API server; install it first",
            kind.name,
            kind.api_version()
        );
        Ok(())
    }

    fn write(&mut self, kind: &'static Kind, mut object: Value) -> anyhow::Result<u64> {
        self.ensure_installed(kind)?;
        let meta = object
            .get_mut("metadata")
            .and_then(Value::as_object_mut)
            .context("object has no metadata")?;
        let name = meta
            .get("name")
            .and_then(Value::as_str)
            .context("object has no metadata.name")?
            .to_string();
        let namespace = if kind.namespaced {
            let namespace = meta
                .get("namespace")
                .and_then(Value::as_str)
                .unwrap_or("default")
                .to_string();
            meta.insert("namespace".into(), namespace.clone().into());
            namespace
        } else {
            // Cluster-scoped objects have no namespace, whatever the applied JSON says.
            meta.remove("namespace");
            String::new()
        };
        let key = (kind, namespace.clone(), name);
        let previous = self
            .objects
            .get(&key)
            .map(|s| serde_json::from_slice::<Value>(&s.json))
            .transpose()?;
        let (uid, created) = match &previous {
            // As on a real server, both are set on create and never change after.
            Some(prev) => (
                prev["metadata"]["uid"].clone(),
                prev["metadata"]["creationTimestamp"].clone(),
            ),
            None => {
                let created = match meta.get("creationTimestamp") {
                    // A test may date an object itself (to order routes, say): kept as given.
                    Some(given @ Value::String(_)) => {
                        serde_json::from_value::<Time>(given.clone()).with_context(|| {
                            format!("metadata.creationTimestamp {given} is not an RFC 3339 time")
                        })?;
                        given.clone()
                    }
                    _ => {
                        // Whole seconds, as the API serializes them. Never earlier than one
                        // handed out before, so objects applied one after another never appear
                        // created in the reverse order, even if the wall clock steps back.
                        let now = std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .unwrap_or_default()
                            .as_secs()
                            .max(self.last_created);
                        self.last_created = now;
                        rfc3339(now).into()
                    }
                };
                self.next_uid += 1;
                (
                    format!("00000000-0000-0000-0000-{:012}", self.next_uid).into(),
                    created,
                )
            }
        };
        self.rv += 1;
        let rv = self.rv;
        meta.insert("resourceVersion".into(), rv.to_string().into());
        meta.insert("uid".into(), uid);
        meta.insert("creationTimestamp".into(), created);
        if let Some(map) = object.as_object_mut() {
            map.insert("apiVersion".into(), kind.api_version().into());
            map.insert("kind".into(), kind.name.into());
        }
        let json = Bytes::from(serde_json::to_vec(&object)?);
        let kind_of_event = if previous.is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        let before = self.objects.get(&key).map(|s| s.json.clone());
        self.push(Change {
            rv,
            kind,
            namespace,
            line: event_line(kind_of_event, &json),
            event: kind_of_event,
            object: json.clone(),
            before,
        });
        self.objects.insert(key, Stored { json });
        Ok(rv)
    }

    fn delete(&mut self, kind: &'static Kind, namespace: &str, name: &str) -> anyhow::Result<bool> {
        let key = (kind, namespace.to_string(), name.to_string());
        let Some(stored) = self.objects.remove(&key) else {
            return Ok(false);
        };
        // The DELETED event carries the object at the version of its deletion.
        self.rv += 1;
        let mut object: Value = serde_json::from_slice(&stored.json)?;
        object["metadata"]["resourceVersion"] = self.rv.to_string().into();
        let json = Bytes::from(serde_json::to_vec(&object)?);
        self.push(Change {
            rv: self.rv,
            kind,
            namespace: namespace.to_string(),
            line: event_line("DELETED", &json),
            event: "DELETED",
            object: json,
            before: None,
        });
        Ok(true)
    }

    /// What deleting a CRD does: its objects are deleted (a DELETED event each to open
    /// watches), then its watches end and its paths are gone.
    fn uninstall(&mut self, kind: &'static Kind) -> anyhow::Result<()> {
        if !self.absent.insert(kind) {
            return Ok(());
        }
        let keys: Vec<Key> = self
            .objects
            .range((kind, String::new(), String::new())..)
            .take_while(|((k, _, _), _)| *k == kind)
            .map(|(key, _)| key.clone())
            .collect();
        for (_, namespace, name) in keys {
            self.delete(kind, &namespace, &name)?;
        }
        // Dropping a watcher's sender ends its stream after the events already queued.
        self.watchers.retain(|w| w.kind != kind);
        self.pages.retain(|_, page| page.kind != kind);
        Ok(())
    }

    fn in_scope<'a>(
        &'a self,
        kind: &'static Kind,
        namespace: Option<&'a str>,
    ) -> impl Iterator<Item = &'a Bytes> + 'a {
        self.objects
            .range((kind, String::new(), String::new())..)
            .take_while(move |((k, _, _), _)| *k == kind)
            .filter(move |((_, ns, _), _)| namespace.is_none_or(|want| want == ns))
            .map(|(_, stored)| &stored.json)
    }
}

/// An object as a metadata-only client sees it: `PartialObjectMetadata`, its metadata alone.
fn partial_metadata(object: &[u8]) -> Vec<u8> {
    let metadata = serde_json::from_slice::<Value>(object)
        .ok()
        .and_then(|mut v| v.get_mut("metadata").map(Value::take))
        .unwrap_or_else(|| json!({}));
    json!({
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": metadata,
    })
    .to_string()
    .into_bytes()
}

/// A watch event line for a metadata-only watcher: its object as [`partial_metadata`];
/// errors as they are.
fn metadata_line(line: &Bytes) -> Bytes {
    let Ok(mut event) = serde_json::from_slice::<Value>(line) else {
        return line.clone();
    };
    if event["type"] == "ERROR" {
        return line.clone();
    }
    let object = event["object"].to_string();
    event["object"] =
        serde_json::from_slice(&partial_metadata(object.as_bytes())).unwrap_or(Value::Null);
    let mut out = event.to_string().into_bytes();
    out.push(b'\n');
    out.into()
}

/// The store as `backup` has it; every watch ends (its client resumes from its version).
fn restore_into(store: &mut Store, backup: &Backup) {
    store.rv = backup.rv;
    store.compacted = backup.compacted;
    store.objects = backup.objects.clone();
    store.history = backup.history.clone();
    store.pages.clear();
    store.watchers.clear();
}

fn event_line(kind: &str, object: &[u8]) -> Bytes {
    let mut line = Vec::with_capacity(object.len() + 32);
    line.extend_from_slice(b"{\"type\":\"");
    line.extend_from_slice(kind.as_bytes());
    line.extend_from_slice(b"\",\"object\":");
    line.extend_from_slice(object);
    line.extend_from_slice(b"}\n");
    line.into()
}

fn status(code: StatusCode, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    })
}

/// What a real API server answers for a path it serves no resource at, such as the resource
/// of a CRD that is not installed: clients (kube's `Error::Api`) see a 404 NotFound.
fn unknown_resource() -> Response<Body> {
    let mut body = status(
        StatusCode::NOT_FOUND,
        "NotFound",
        "the server could not find the requested resource",
    );
    body["details"] = json!({});
    json_response(StatusCode::NOT_FOUND, body.to_string())
}

fn gone_status() -> Value {
    status(
        StatusCode::GONE,
        "Expired",
        "too old resource version: the requested version has been compacted",
    )
}

/// Seconds since the epoch as RFC 3339 (UTC), without pulling in a date crate.
fn rfc3339(secs: u64) -> String {
    let days = secs / 86_400;
    let rem = secs % 86_400;
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// A copy of the store, as an etcd snapshot: [`FakeApiServer::backup`].
pub struct Backup {
    rv: u64,
    compacted: u64,
    objects: BTreeMap<Key, Stored>,
    history: Vec<Change>,
}

/// The fake API server. Dropping it stops it.
pub struct FakeApiServer {
    runtime: Option<tokio::runtime::Runtime>,
    store: Arc<Mutex<Store>>,
    addr: SocketAddr,
    serving: Mutex<Option<JoinHandle<()>>>,
    bookmarks: JoinHandle<()>,
}

impl FakeApiServer {
    /// Starts serving on 127.0.0.1 on an ephemeral port.
    pub fn start() -> anyhow::Result<FakeApiServer> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("fake-apiserver")
            .enable_all()
            .build()?;
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let store = Arc::new(Mutex::new(Store::default()));
        let bookmarks = runtime.spawn(send_bookmarks(store.clone()));
        let server = FakeApiServer {
            runtime: Some(runtime),
            store,
            addr,
            serving: Mutex::new(None),
            bookmarks,
        };
        server.serve(listener)?;
        Ok(server)
    }

    fn serve(&self, listener: std::net::TcpListener) -> anyhow::Result<()> {
        listener.set_nonblocking(true)?;
        let runtime = self
            .runtime
            .as_ref()
            .context("fake API server runtime is gone")?;
        let store = self.store.clone();
        let task = runtime.spawn(accept(listener, store));
        if let Some(old) = lock(&self.serving).replace(task) {
            old.abort();
        }
        Ok(())
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops serving: closes the listener and every open connection (watches end mid-stream,
    /// new connections are refused). Objects and history are kept, as etcd keeps them.
    pub fn stop(&self) {
        if let Some(task) = lock(&self.serving).take() {
            task.abort();
        }
        lock(&self.store).watchers.clear();
        // Wait until the aborted accept loop has released the port, so a restart can bind it.
        for _ in 0..100 {
            if std::net::TcpStream::connect(self.addr).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Serves again on the same port, with the same objects and history.
    pub fn restart(&self) -> anyhow::Result<()> {
        self.stop();
        let mut last = None;
        for _ in 0..100 {
            match std::net::TcpListener::bind(self.addr) {
                Ok(listener) => return self.serve(listener),
                Err(err) => last = Some(err),
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!("cannot rebind {}: {last:?}", self.addr)
    }

    /// Ends every open watch cleanly (the chunked stream terminates), as an API server does
    /// when it closes watches on a rolling restart or at `timeoutSeconds`.
    pub fn drop_watches(&self) {
        lock(&self.store).watchers.clear();
    }

    /// Compacts history: every resourceVersion handed out so far becomes too old. Open watches
    /// receive an ERROR event with a 410 Status and end; resuming from any earlier version gets
    /// the same; paged lists in progress get 410 on their next page.
    pub fn expire_history(&self) {
        let mut store = lock(&self.store);
        store.rv += 1;
        store.compacted = store.rv;
        store.history.clear();
        store.pages.clear();
        let line = error_line(&gone_status());
        for watcher in store.watchers.drain(..) {
            let _ = watcher.tx.send(line.clone());
        }
    }

    /// What etcd holds now, to [`FakeApiServer::restore`] later.
    pub fn backup(&self) -> Backup {
        let store = lock(&self.store);
        Backup {
            rv: store.rv,
            compacted: store.compacted,
            objects: store.objects.clone(),
            history: store.history.clone(),
        }
    }

    /// An API server restored from `backup`, as after `etcdutl snapshot restore` and a restart
    /// of the API server: the objects and resourceVersions of the backup (every version since
    /// it handed out again, for other changes), open watches and paged lists ended. A watch
    /// that resumes from a version the restored store has not reached is served as a real
    /// API server's watch cache serves it: accepted, and sent nothing until the store passes
    /// that version, then only what comes after it.
    pub fn restore(&self, backup: &Backup) {
        restore_into(&mut lock(&self.store), backup);
    }

    /// [`FakeApiServer::restore`] as etcd's documented procedure does it
    /// (`--bump-revision <bump> --mark-compacted`): versions go on from `bump` past the
    /// backup's, and every earlier one is compacted, so a watch resuming from one gets 410.
    /// One step under the lock, as a restore is: a watch that reconnected between a plain
    /// restore and the bump would wait, unanswered, for versions that never come.
    pub fn restore_bumped(&self, backup: &Backup, bump: u64) {
        let mut store = lock(&self.store);
        restore_into(&mut store, backup);
        store.rv = backup.rv + bump;
        store.compacted = store.rv;
        store.history.clear();
    }

    /// How many watches are open now.
    pub fn open_watches(&self) -> usize {
        let mut store = lock(&self.store);
        store.watchers.retain(|w| !w.tx.is_closed());
        store.watchers.len()
    }

    /// How many HTTP requests have been served so far.
    pub fn requests(&self) -> u64 {
        lock(&self.store).requests
    }

    /// The latest resourceVersion.
    pub fn resource_version(&self) -> u64 {
        lock(&self.store).rv
    }

    /// Creates or replaces an object of a served kind (a k8s-openapi type or a Gateway API
    /// `CustomResource`). Returns its new resourceVersion.
    pub fn apply<K: kube::Resource + Serialize>(&self, object: &K) -> anyhow::Result<u64> {
        self.apply_json(serde_json::to_value(object)?)
    }

    /// Creates or replaces an object given as JSON; `kind` says which resource it is (and
    /// `apiVersion`, if given, must be the served one).
    ///
    /// As on a real server, the server sets resourceVersion on every apply, and uid and
    /// creationTimestamp on create, which later applies keep. Unlike a real server, a
    /// `metadata.creationTimestamp` the object carries when created is kept, so a test can
    /// date objects (to order routes, say). Otherwise it is the time of the apply in whole
    /// seconds, never earlier than one handed out before: objects applied within one second
    /// tie, as they may on a real server.
    ///
    /// Fails for an uninstalled kind, as applying a custom resource whose CRD is not installed
    /// does.
    pub fn apply_json(&self, object: Value) -> anyhow::Result<u64> {
        let name = object
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let kind = Kind::named(name).with_context(|| {
            let served: Vec<&str> = KINDS.iter().map(|k| k.name).collect();
            format!("object kind must be one of {served:?}: {object}")
        })?;
        if let Some(api_version) = object.get("apiVersion") {
            ensure!(
                *api_version == kind.api_version(),
                "the fake API server serves {} as {}, not {api_version}",
                kind.name,
                kind.api_version()
            );
        }
        lock(&self.store).write(kind, object)
    }

    /// Deletes an object; returns whether it existed. `namespace` is ignored for
    /// cluster-scoped kinds. Fails for an uninstalled kind.
    pub fn delete<K: kube::Resource<DynamicType = ()>>(
        &self,
        namespace: &str,
        name: &str,
    ) -> anyhow::Result<bool> {
        let kind = Kind::of::<K>()?;
        let namespace = if kind.namespaced { namespace } else { "" };
        let mut store = lock(&self.store);
        store.ensure_installed(kind)?;
        store.delete(kind, namespace, name)
    }

    /// Every object of a kind, as stored now: the truth a test compares the agent against.
    /// An uninstalled kind has none.
    pub fn objects<K: kube::Resource<DynamicType = ()> + DeserializeOwned>(
        &self,
    ) -> anyhow::Result<Vec<K>> {
        let kind = Kind::of::<K>()?;
        let store = lock(&self.store);
        store
            .in_scope(kind, None)
            .map(|json| Ok(serde_json::from_slice(json)?))
            .collect()
    }

    /// Takes a kind away, as deleting its CRD does on a real cluster: its objects are deleted
    /// (open watches get a DELETED event for each), then its open watches end, and from then
    /// on list, watch and get of it answer 404 with the Status a real API server sends for a
    /// path it does not serve — what clients see on a cluster without the CRD. Applying or
    /// deleting objects of it fails until it is installed again. Meant for the Gateway API
    /// kinds; call it before starting the agent to start on a cluster without them.
    pub fn uninstall<K: kube::Resource<DynamicType = ()>>(&self) -> anyhow::Result<()> {
        lock(&self.store).uninstall(Kind::of::<K>()?)
    }

    /// Serves a kind again after [`FakeApiServer::uninstall`], empty until objects of it are
    /// applied. Every served kind is installed at start.
    pub fn install<K: kube::Resource<DynamicType = ()>>(&self) -> anyhow::Result<()> {
        let kind = Kind::of::<K>()?;
        lock(&self.store).absent.remove(kind);
        Ok(())
    }

    /// A kubeconfig that points a kube client at this server (plain HTTP, no credentials).
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             users:\n- name: fake\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    \
             cluster: fake\n    user: fake\n    namespace: default\ncurrent-context: fake\n",
            self.url()
        )
    }

    pub fn write_kubeconfig(&self, path: &Path) -> anyhow::Result<()> {
        std::fs::write(path, self.kubeconfig())
            .with_context(|| format!("writing kubeconfig {}", path.display()))
    }

    /// A kubeconfig for this server in a new temporary directory (removed when the returned
    /// guard drops), and its path for `KUBECONFIG`.
    pub fn kubeconfig_file(&self) -> anyhow::Result<(tempfile::TempDir, String)> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("kubeconfig");
        self.write_kubeconfig(&path)?;
        Ok((dir, path.to_string_lossy().into_owned()))
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.bookmarks.abort();
        if let Some(task) = lock(&self.serving).take() {
            task.abort();
        }
        // Dropping a runtime inside an async test would block; let it wind down on its own.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// A poisoned lock only means another test thread panicked; the store itself stays usable.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn error_line(status: &Value) -> Bytes {
    event_line("ERROR", status.to_string().as_bytes())
}

async fn send_bookmarks(store: Arc<Mutex<Store>>) {
    let mut tick = tokio::time::interval(BOOKMARK_INTERVAL);
    loop {
        tick.tick().await;
        let mut store = lock(&store);
        let rv = store.rv.to_string();
        let now = store.rv;
        store.watchers.retain(|w| {
            if !w.bookmarks || now < w.from {
                return !w.tx.is_closed();
            }
            let object = json!({
                "kind": w.kind.name,
                "apiVersion": w.kind.api_version(),
                "metadata": {"resourceVersion": rv},
            });
            w.tx.send(event_line("BOOKMARK", object.to_string().as_bytes()))
                .is_ok()
        });
    }
}

async fn accept(listener: std::net::TcpListener, store: Arc<Mutex<Store>>) {
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        return;
    };
    // Connections live in this set, so aborting the accept loop closes them all.
    let mut connections = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                // As the real API server (Go sets TCP_NODELAY by default): a watch event is
                // one small write, which Nagle would hold for the client's delayed ACK.
                let _ = stream.set_nodelay(true);
                let store = store.clone();
                connections.spawn(async move {
                    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let store = store.clone();
                        async move {
                            let response = match *req.method() {
                                http::Method::POST | http::Method::PUT => write(&store, req).await,
                                _ => handle(&store, req),
                            };
                            Ok::<_, Infallible>(response)
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// A parsed request path: which resource, in which namespace (None = all, or cluster-scoped),
/// which object.
struct Target {
    kind: &'static Kind,
    namespace: Option<String>,
    name: Option<String>,
}

/// Parses `/api/<version>/...` (core) and `/apis/<group>/<version>/...`, then
/// `[namespaces/<ns>/]<plural>[/<name>]`.
fn route(path: &str) -> Option<Target> {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segments.as_slice() {
        ["api", version, rest @ ..] => ("", *version, rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] => (Some((*ns).to_string()), rest),
        rest => (None, rest),
    };
    let (plural, name) = match rest {
        [plural] => (*plural, None),
        [plural, name] => (*plural, Some((*name).to_string())),
        _ => return None,
    };
    let kind = Kind::at(group, version, plural)?;
    // A namespaced object is addressed within its namespace; a cluster-scoped kind has none.
    let addressable = if kind.namespaced {
        name.is_none() || namespace.is_some()
    } else {
        namespace.is_none()
    };
    addressable.then_some(Target {
        kind,
        namespace,
        name,
    })
}

/// The query parameters, percent-decoded (a field selector's `=` arrives as `%3D`).
fn query(req: &Request<Incoming>) -> HashMap<String, String> {
    form_urlencoded::parse(req.uri().query().unwrap_or_default().as_bytes())
        .into_owned()
        .collect()
}

fn json_response(code: StatusCode, body: impl Into<Body>) -> Response<Body> {
    let mut response = Response::new(body.into());
    *response.status_mut() = code;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

fn failure(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    json_response(code, status(code, reason, message).to_string())
}

/// The largest body a write may carry (a real server's limit is about 3 MiB).
const MAX_WRITE: usize = 3 << 20;

/// A create (POST to a collection) or an update (PUT to an object).
async fn write(store: &Mutex<Store>, req: Request<Incoming>) -> Response<Body> {
    use http_body_util::BodyExt;
    lock(store).requests += 1;
    let method = req.method().clone();
    let Some(target) = route(req.uri().path()) else {
        return unknown_resource();
    };
    let limited = http_body_util::Limited::new(req.into_body(), MAX_WRITE);
    let body = match limited.collect().await {
        Ok(body) => body.to_bytes(),
        Err(e) => return failure(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
    };
    let mut object: Value = match serde_json::from_slice(&body) {
        Ok(object @ Value::Object(_)) => object,
        _ => {
            return failure(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "the body is no object",
            );
        }
    };
    if let Some(kind) = object.get("kind").and_then(Value::as_str)
        && kind != target.kind.name
    {
        let message = format!("the body is a {kind}, the path is {}", target.kind.plural);
        return failure(StatusCode::BAD_REQUEST, "BadRequest", &message);
    }
    let name = object["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    if name.is_empty() {
        return failure(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            "metadata.name is required",
        );
    }
    if let Some(namespace) = &target.namespace {
        object["metadata"]["namespace"] = namespace.clone().into();
    }
    let mut store = lock(store);
    if store.absent.contains(target.kind) {
        return unknown_resource();
    }
    let key = (
        target.kind,
        target.namespace.clone().unwrap_or_default(),
        name.clone(),
    );
    let stored_rv = store.objects.get(&key).map(|stored| {
        serde_json::from_slice::<Value>(&stored.json)
            .map(|v| {
                v["metadata"]["resourceVersion"]
                    .as_str()
                    .map(str::to_string)
            })
            .unwrap_or_default()
    });
    let what = format!("{} {name:?}", target.kind.qualified_plural());
    let code = match (&method, &target.name, stored_rv) {
        (&http::Method::POST, None, None) => StatusCode::CREATED,
        (&http::Method::POST, None, Some(_)) => {
            return failure(
                StatusCode::CONFLICT,
                "AlreadyExists",
                &format!("{what} already exists"),
            );
        }
        (&http::Method::PUT, Some(path_name), _) if *path_name != name => {
            let message = format!("the name in the body is not the path's ({path_name})");
            return failure(StatusCode::BAD_REQUEST, "BadRequest", &message);
        }
        (&http::Method::PUT, Some(_), None) => {
            return failure(
                StatusCode::NOT_FOUND,
                "NotFound",
                &format!("{what} not found"),
            );
        }
        (&http::Method::PUT, Some(_), Some(current)) => {
            let given = object["metadata"]["resourceVersion"].as_str();
            if given.is_some_and(|given| Some(given) != current.as_deref()) {
                let message = format!(
                    "Operation cannot be fulfilled on {what}: the object has been modified; \
                     please apply your changes to the latest version and try again"
                );
                return failure(StatusCode::CONFLICT, "Conflict", &message);
            }
            StatusCode::OK
        }
        _ => {
            return failure(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                "the fake API server creates with POST to a collection and updates with PUT",
            );
        }
    };
    if let Err(e) = store.write(target.kind, object) {
        return failure(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", &e.to_string());
    }
    match store.objects.get(&key) {
        Some(stored) => json_response(code, stored.json.clone()),
        None => failure(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            "not stored",
        ),
    }
}

fn handle(store: &Mutex<Store>, req: Request<Incoming>) -> Response<Body> {
    lock(store).requests += 1;
    if req.method() != http::Method::GET {
        return failure(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "the fake API server serves get, list, watch, create (POST) and update (PUT)",
        );
    }
    let Some(target) = route(req.uri().path()) else {
        return unknown_resource();
    };
    let params = query(&req);
    let selector = FieldSelector::parse(params.get("fieldSelector").map_or("", String::as_str))
        .and_then(|fields| {
            let labels = params.get("labelSelector").map_or("", String::as_str);
            Ok(fields.and(FieldSelector::parse_labels(labels)?))
        });
    let selector = match selector {
        Ok(selector) => selector,
        Err(message) => return failure(StatusCode::BAD_REQUEST, "BadRequest", &message),
    };
    // kube's metadata watcher asks for PartialObjectMetadata(List): metadata only.
    let metadata_only = req
        .headers()
        .get(http::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|accept| accept.contains("as=PartialObjectMetadata"));
    for unsupported in ["sendInitialEvents"] {
        if params.get(unsupported).is_some_and(|v| !v.is_empty()) {
            return failure(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &format!("{unsupported} is not supported by the fake API server"),
            );
        }
    }
    if let Some(name) = &target.name {
        return get(store, &target, name);
    }
    if matches!(params.get("watch").map(String::as_str), Some("1" | "true")) {
        return watch(store, &target, &params, selector, metadata_only);
    }
    list(store, &target, &params, &selector, metadata_only)
}

fn get(store: &Mutex<Store>, target: &Target, name: &str) -> Response<Body> {
    let store = lock(store);
    if store.absent.contains(target.kind) {
        return unknown_resource();
    }
    let key = (
        target.kind,
        target.namespace.clone().unwrap_or_default(),
        name.to_string(),
    );
    match store.objects.get(&key) {
        Some(stored) => json_response(StatusCode::OK, stored.json.clone()),
        None => failure(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("{} {name:?} not found", target.kind.qualified_plural()),
        ),
    }
}

fn list(
    store: &Mutex<Store>,
    target: &Target,
    params: &HashMap<String, String>,
    selector: &FieldSelector,
    metadata_only: bool,
) -> Response<Body> {
    // `resourceVersion=0` ("any"): a real API server answers from its watch cache, which does
    // not paginate: `limit` is ignored and the whole list comes in one response (kube-apiserver
    // since 1.13, kubernetes/kubernetes#70735; the semantics are spelled out in
    // kubernetes/enhancements#2467). kube's watcher and client-go's reflectors list that way.
    let from_cache = params.get("resourceVersion").is_some_and(|rv| rv == "0")
        && params
            .get("resourceVersionMatch")
            .is_none_or(|m| m != "Exact");
    let limit = params
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0 && !from_cache);
    let mut store = lock(store);
    if store.absent.contains(target.kind) {
        return unknown_resource();
    }
    let (page_id, rv, items, offset) = match params.get("continue").filter(|c| !c.is_empty()) {
        Some(token) => {
            let parsed = token
                .split_once('-')
                .and_then(|(id, offset)| Some((id.parse::<u64>().ok()?, offset.parse().ok()?)));
            let Some((id, offset)) = parsed else {
                return failure(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    &format!("continue token {token:?} is not one this server issued"),
                );
            };
            let Some(page) = store.pages.get(&id) else {
                return failure(
                    StatusCode::GONE,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list \
                     result. You can start a new list without the continue parameter.",
                );
            };
            (id, page.rv, page.items.clone(), offset)
        }
        None => {
            let items: Arc<[Bytes]> = store
                .in_scope(target.kind, target.namespace.as_deref())
                .filter(|json| selector.matches(json))
                .cloned()
                .collect();
            store.next_page += 1;
            (store.next_page, store.rv, items, 0)
        }
    };
    let end = limit.map_or(items.len(), |l| (offset + l).min(items.len()));
    let more = end < items.len();
    if more {
        store.pages.insert(
            page_id,
            Page {
                rv,
                kind: target.kind,
                items: items.clone(),
            },
        );
    } else {
        store.pages.remove(&page_id);
    }
    drop(store);

    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if more {
        metadata["continue"] = format!("{page_id}-{end}").into();
        metadata["remainingItemCount"] = (items.len() - end).into();
    }
    let mut body = Vec::with_capacity(
        items[offset.min(end)..end]
            .iter()
            .map(Bytes::len)
            .sum::<usize>()
            + 256,
    );
    let (kind, api_version) = if metadata_only {
        (
            "PartialObjectMetadata".to_string(),
            "meta.k8s.io/v1".to_string(),
        )
    } else {
        (target.kind.name.to_string(), target.kind.api_version())
    };
    body.extend_from_slice(
        format!(
            "{{\"kind\":\"{kind}List\",\"apiVersion\":\"{api_version}\",\"metadata\":{metadata},\"items\":["
        )
        .as_bytes(),
    );
    for (i, item) in items[offset.min(end)..end].iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        if metadata_only {
            body.extend_from_slice(&partial_metadata(item));
        } else {
            body.extend_from_slice(item);
        }
    }
    body.extend_from_slice(b"]}");
    json_response(StatusCode::OK, body)
}

fn watch(
    store: &Mutex<Store>,
    target: &Target,
    params: &HashMap<String, String>,
    selector: FieldSelector,
    metadata_only: bool,
) -> Response<Body> {
    let from = match params.get("resourceVersion").map(String::as_str) {
        None | Some("" | "0") => None,
        Some(rv) => match rv.parse::<u64>() {
            Ok(rv) => Some(rv),
            Err(_) => {
                return failure(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    &format!("resourceVersion {rv:?} is not a number"),
                );
            }
        },
    };
    let timeout = params
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map(Duration::from_secs);
    let bookmarks = matches!(
        params.get("allowWatchBookmarks").map(String::as_str),
        Some("1" | "true")
    );
    let (tx, rx) = mpsc::unbounded_channel();
    {
        let mut store = lock(store);
        if store.absent.contains(target.kind) {
            return unknown_resource();
        }
        let namespace = target.namespace.as_deref();
        match from {
            // No version: the current state as synthetic ADDED events, then changes.
            None => {
                for json in store
                    .in_scope(target.kind, namespace)
                    .filter(|json| selector.matches(json))
                {
                    let line = event_line("ADDED", json);
                    let _ = tx.send(if metadata_only {
                        metadata_line(&line)
                    } else {
                        line
                    });
                }
            }
            Some(rv) if rv < store.compacted => {
                let _ = tx.send(error_line(&gone_status()));
                drop(tx);
                return json_response(
                    StatusCode::OK,
                    Body::from_stream(UnboundedReceiverStream::new(rx).map(Ok::<_, Infallible>)),
                );
            }
            Some(rv) => {
                let start = store.history.partition_point(|c| c.rv <= rv);
                for change in &store.history[start..] {
                    if change.kind == target.kind
                        && namespace.is_none_or(|ns| ns == change.namespace)
                        && let Some(line) = change.line_for(&selector)
                    {
                        let _ = tx.send(if metadata_only {
                            metadata_line(&line)
                        } else {
                            line
                        });
                    }
                }
            }
        }
        store.watchers.push(Watcher {
            kind: target.kind,
            namespace: target.namespace.clone(),
            selector,
            metadata_only,
            bookmarks,
            from: from.unwrap_or(0),
            tx,
        });
    }
    let events = UnboundedReceiverStream::new(rx).map(Ok::<_, Infallible>);
    let body = match timeout {
        Some(timeout) => Body::from_stream(events.take_until(tokio::time::sleep(timeout))),
        None => Body::from_stream(events),
    };
    json_response(StatusCode::OK, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Read, Write};

    fn service(namespace: &str, name: &str, port: u16) -> Value {
        json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"ports": [{"name": "http", "port": port}]},
        })
    }

    /// HTTP/1.0 GET, so the body is delimited by the connection closing (no chunk parsing).
    fn request(server: &FakeApiServer, path: &str) -> std::net::TcpStream {
        let mut stream = std::net::TcpStream::connect(server.addr()).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        write!(stream, "GET {path} HTTP/1.0\r\nHost: fake\r\n\r\n").unwrap();
        stream
    }

    fn get(server: &FakeApiServer, path: &str) -> (u16, Value) {
        let mut response = String::new();
        request(server, path).read_to_string(&mut response).unwrap();
        let (head, body) = response.split_once("\r\n\r\n").unwrap();
        let code = head.split(' ').nth(1).unwrap().parse().unwrap();
        (code, serde_json::from_str(body).unwrap())
    }

    /// `method path` with a JSON body, over HTTP/1.0: the status and the body.
    fn send(server: &FakeApiServer, method: &str, path: &str, body: &Value) -> (u16, Value) {
        let mut stream = std::net::TcpStream::connect(server.addr()).unwrap();
        let body = body.to_string();
        write!(
            stream,
            "{method} {path} HTTP/1.0\r\nHost: fake\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        let (head, body) = response.split_once("\r\n\r\n").unwrap();
        let code = head.split(' ').nth(1).unwrap().parse().unwrap();
        (code, serde_json::from_str(body).unwrap())
    }

    #[test]
    fn create_and_update_keep_optimistic_concurrency() {
        let server = FakeApiServer::start().unwrap();
        let secrets = "/api/v1/namespaces/lattice-system/secrets";
        let secret = |data: &str| json!({"metadata": {"name": "tls"}, "data": {"k": data}});
        let (code, created) = send(&server, "POST", secrets, &secret("YQ=="));
        assert_eq!(code, 201, "{created}");
        assert_eq!(created["metadata"]["namespace"], "lattice-system");
        assert_eq!(created["kind"], "Secret");
        let rv = created["metadata"]["resourceVersion"].clone();
        let (code, taken) = send(&server, "POST", secrets, &secret("Yg=="));
        assert_eq!(
            (code, taken["reason"].as_str()),
            (409, Some("AlreadyExists"))
        );

        let path = format!("{secrets}/tls");
        let mut update = secret("Yw==");
        update["metadata"]["resourceVersion"] = rv.clone();
        let (code, updated) = send(&server, "PUT", &path, &update);
        assert_eq!(code, 200, "{updated}");
        assert_eq!(updated["data"]["k"], "Yw==");
        assert_eq!(updated["metadata"]["uid"], created["metadata"]["uid"]);
        // The same resourceVersion again: someone else's update came first.
        let (code, stale) = send(&server, "PUT", &path, &update);
        assert_eq!((code, stale["reason"].as_str()), (409, Some("Conflict")));
        let (code, _) = send(&server, "PUT", &format!("{secrets}/other"), &secret("YQ=="));
        assert_eq!(code, 400, "the body's name is not the path's");
        let mut absent = secret("YQ==");
        absent["metadata"]["name"] = "other".into();
        let (code, _) = send(&server, "PUT", &format!("{secrets}/other"), &absent);
        assert_eq!(code, 404);
        let (code, got) = get(&server, &path);
        assert_eq!((code, &got["data"]["k"]), (200, &json!("Yw==")));

        let hooks = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations";
        let hook = json!({"metadata": {"name": "lattice-injector"}, "webhooks": []});
        let (code, created) = send(&server, "POST", hooks, &hook);
        assert_eq!(code, 201, "{created}");
        assert!(
            created["metadata"].get("namespace").is_none(),
            "cluster-scoped"
        );
    }

    /// Reads watch events (one JSON object a line) until `n` have arrived.
    fn events(reader: &mut BufReader<std::net::TcpStream>, n: usize) -> Vec<Value> {
        let mut out = Vec::new();
        let mut line = String::new();
        while out.len() < n {
            line.clear();
            assert!(
                reader.read_line(&mut line).unwrap() > 0,
                "stream ended early: {out:?}"
            );
            if let Ok(event) = serde_json::from_str::<Value>(line.trim()) {
                out.push(event);
            }
        }
        out
    }

    fn watch(server: &FakeApiServer, path: &str) -> BufReader<std::net::TcpStream> {
        let mut reader = BufReader::new(request(server, path));
        let mut line = String::new();
        loop {
            line.clear();
            reader.read_line(&mut line).unwrap();
            if line == "\r\n" {
                return reader;
            }
            if line.starts_with("HTTP/") {
                assert!(line.contains(" 200 "), "{line}");
            }
        }
    }

    fn names(list: &Value) -> Vec<String> {
        list["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["metadata"]["name"].as_str().unwrap().to_string())
            .collect()
    }

    #[test]
    fn lists_are_paged_consistently_and_scoped_by_namespace() {
        let server = FakeApiServer::start().unwrap();
        for i in 0..5 {
            server
                .apply_json(service("a", &format!("s{i}"), 80))
                .unwrap();
        }
        server.apply_json(service("b", "other", 80)).unwrap();
        let (code, all) = get(&server, "/api/v1/services");
        assert_eq!(code, 200);
        assert_eq!(all["kind"], "ServiceList");
        assert_eq!(all["metadata"]["resourceVersion"], "6");
        assert_eq!(names(&all).len(), 6);
        let (_, ns) = get(&server, "/api/v1/namespaces/b/services");
        assert_eq!(names(&ns), ["other"]);

        let (_, first) = get(&server, "/api/v1/namespaces/a/services?limit=2");
        assert_eq!(names(&first), ["s0", "s1"]);
        // A write between pages does not show up: pages come from one snapshot.
        server.apply_json(service("a", "s9", 80)).unwrap();
        let token = first["metadata"]["continue"].as_str().unwrap();
        let (_, second) = get(
            &server,
            &format!("/api/v1/namespaces/a/services?limit=2&continue={token}"),
        );
        assert_eq!(names(&second), ["s2", "s3"]);
        assert_eq!(second["metadata"]["resourceVersion"], "6");
        let token = second["metadata"]["continue"].as_str().unwrap();
        let (_, third) = get(
            &server,
            &format!("/api/v1/namespaces/a/services?limit=2&continue={token}"),
        );
        assert_eq!(names(&third), ["s4"]);
        assert!(third["metadata"].get("continue").is_none());

        // resourceVersion=0, as kube's watcher lists: from the "watch cache", whole.
        let (_, cached) = get(
            &server,
            "/api/v1/namespaces/a/services?limit=2&resourceVersion=0&resourceVersionMatch=NotOlderThan",
        );
        assert_eq!(names(&cached), ["s0", "s1", "s2", "s3", "s4", "s9"]);
        assert!(cached["metadata"].get("continue").is_none());

        // Expired continue tokens are 410.
        let (_, first) = get(&server, "/api/v1/services?limit=2");
        server.expire_history();
        let token = first["metadata"]["continue"].as_str().unwrap();
        let (code, status) = get(
            &server,
            &format!("/api/v1/services?limit=2&continue={token}"),
        );
        assert_eq!((code, status["code"].as_u64()), (410, Some(410)));
    }

    #[test]
    fn watch_replays_history_then_streams_live_events() {
        let server = FakeApiServer::start().unwrap();
        let rv = server.apply_json(service("a", "one", 80)).unwrap();
        server.apply_json(service("a", "one", 81)).unwrap();
        server.apply_json(service("b", "elsewhere", 80)).unwrap();
        let mut reader = watch(
            &server,
            &format!(
                "/api/v1/namespaces/a/services?watch=true&resourceVersion={rv}&timeoutSeconds=30"
            ),
        );
        let replayed = events(&mut reader, 1);
        assert_eq!(replayed[0]["type"], "MODIFIED");
        assert_eq!(replayed[0]["object"]["spec"]["ports"][0]["port"], 81);
        server
            .delete::<k8s_openapi::api::core::v1::Service>("a", "one")
            .unwrap();
        let deleted = events(&mut reader, 1);
        assert_eq!(deleted[0]["type"], "DELETED");
        assert_eq!(
            deleted[0]["object"]["metadata"]["resourceVersion"],
            server.resource_version().to_string()
        );
        // Dropping watches ends the stream cleanly.
        server.drop_watches();
        let mut rest = String::new();
        reader.read_to_string(&mut rest).unwrap();
        assert_eq!(rest, "");
    }

    fn pod(name: &str, node: &str, ip: &str) -> Value {
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"namespace": "a", "name": name},
               "spec": {"nodeName": node},
               "status": {"podIP": ip, "phase": "Running"}})
    }

    #[test]
    fn field_selectors_filter_lists_and_watches_as_objects_come_and_go() {
        let server = FakeApiServer::start().unwrap();
        server.apply_json(pod("p1", "node-a", "10.0.0.1")).unwrap();
        server.apply_json(pod("p2", "node-b", "10.0.0.2")).unwrap();
        let selector = "fieldSelector=spec.nodeName%3Dnode-a";
        let (code, list) = get(&server, &format!("/api/v1/pods?{selector}"));
        assert_eq!(code, 200);
        assert_eq!(names(&list), ["p1"]);
        let (_, not) = get(
            &server,
            "/api/v1/pods?fieldSelector=spec.nodeName!%3Dnode-a",
        );
        assert_eq!(names(&not), ["p2"]);
        let (code, _) = get(&server, "/api/v1/pods?fieldSelector=spec.nodeName");
        assert_eq!(code, 400);

        let rv = server.resource_version();
        let mut reader = watch(
            &server,
            &format!("/api/v1/pods?watch=true&resourceVersion={rv}&{selector}"),
        );
        // p2 moves to node-a: ADDED for this watcher; p1 leaves: DELETED; others unseen.
        server.apply_json(pod("p2", "node-a", "10.0.0.2")).unwrap();
        server.apply_json(pod("p3", "node-b", "10.0.0.3")).unwrap();
        server.apply_json(pod("p1", "node-b", "10.0.0.1")).unwrap();
        let seen: Vec<(String, String)> = events(&mut reader, 2)
            .iter()
            .map(|e| {
                let name = e["object"]["metadata"]["name"].as_str().unwrap();
                (e["type"].as_str().unwrap().to_string(), name.to_string())
            })
            .collect();
        assert_eq!(
            seen,
            [
                ("ADDED".to_string(), "p2".to_string()),
                ("DELETED".to_string(), "p1".to_string())
            ]
        );
    }

    #[test]
    fn expired_versions_get_an_in_stream_410() {
        let server = FakeApiServer::start().unwrap();
        let rv = server.apply_json(service("a", "one", 80)).unwrap();
        let mut open = watch(
            &server,
            &format!("/api/v1/services?watch=1&resourceVersion={rv}"),
        );
        server.expire_history();
        let error = events(&mut open, 1);
        assert_eq!(error[0]["type"], "ERROR");
        assert_eq!(error[0]["object"]["code"], 410);
        let mut resumed = watch(
            &server,
            &format!("/api/v1/services?watch=1&resourceVersion={rv}"),
        );
        assert_eq!(events(&mut resumed, 1)[0]["object"]["reason"], "Expired");
        // The current version still works.
        let now = server.resource_version();
        let mut fresh = watch(
            &server,
            &format!(
                "/apis/discovery.k8s.io/v1/endpointslices?watch=1&resourceVersion={now}&allowWatchBookmarks=true"
            ),
        );
        let bookmark = events(&mut fresh, 1);
        assert_eq!(bookmark[0]["type"], "BOOKMARK");
        assert_eq!(
            bookmark[0]["object"]["metadata"]["resourceVersion"],
            now.to_string()
        );
    }

    #[test]
    fn a_restore_serves_watches_from_the_future_as_a_watch_cache_does() {
        let server = FakeApiServer::start().unwrap();
        server.apply_json(service("a", "one", 80)).unwrap();
        let backup = server.backup();
        server.apply_json(service("a", "two", 80)).unwrap();
        let ahead = server.apply_json(service("a", "three", 80)).unwrap();
        server.restore(&backup);
        assert_eq!(server.resource_version(), backup.rv);
        let (_, list) = get(&server, "/api/v1/services");
        assert_eq!(names(&list), ["one"]);
        // A watch resuming from the version the store has not reached yet: nothing until the
        // store passes it, changes after it only; the restored state never.
        let mut resumed = watch(
            &server,
            &format!("/api/v1/services?watch=1&resourceVersion={ahead}"),
        );
        for name in ["four", "five"] {
            server.apply_json(service("a", name, 80)).unwrap();
        }
        assert!(server.resource_version() == ahead);
        server.apply_json(service("a", "six", 80)).unwrap();
        let seen = events(&mut resumed, 1);
        assert_eq!(seen[0]["object"]["metadata"]["name"], "six", "{seen:?}");

        // With the revision bump, every earlier version is compacted: 410.
        server.restore_bumped(&backup, 1000);
        assert_eq!(server.resource_version(), backup.rv + 1000);
        let mut old = watch(
            &server,
            &format!("/api/v1/services?watch=1&resourceVersion={ahead}"),
        );
        assert_eq!(events(&mut old, 1)[0]["object"]["code"], 410);
    }

    #[test]
    fn watch_ends_after_timeout_seconds() {
        let server = FakeApiServer::start().unwrap();
        let mut reader = watch(
            &server,
            "/api/v1/services?watch=true&resourceVersion=0&timeoutSeconds=1",
        );
        let mut rest = String::new();
        reader.read_to_string(&mut rest).unwrap();
        assert_eq!(rest, "");
    }

    #[test]
    fn stop_and_restart_keep_the_port_and_the_objects() {
        let server = FakeApiServer::start().unwrap();
        server.apply_json(service("a", "one", 80)).unwrap();
        let mut reader = watch(&server, "/api/v1/services?watch=true&resourceVersion=1");
        server.stop();
        let mut rest = String::new();
        let _ = reader.read_to_string(&mut rest);
        assert!(std::net::TcpStream::connect(server.addr()).is_err());
        server.restart().unwrap();
        let (code, list) = get(&server, "/api/v1/services");
        assert_eq!(code, 200);
        assert_eq!(names(&list), ["one"]);
        assert!(server.kubeconfig().contains(&server.url()));
    }

    #[test]
    fn endpointslices_round_trip_through_k8s_openapi_types() {
        use k8s_openapi::api::discovery::v1::EndpointSlice;
        let server = FakeApiServer::start().unwrap();
        let slice: EndpointSlice = serde_json::from_value(json!({
            "metadata": {"name": "web-1", "namespace": "a",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.0.0.1"]}],
            "ports": [{"name": "http", "port": 8080}],
        }))
        .unwrap();
        server.apply(&slice).unwrap();
        let (_, one) = get(
            &server,
            "/apis/discovery.k8s.io/v1/namespaces/a/endpointslices/web-1",
        );
        assert_eq!(one["kind"], "EndpointSlice");
        assert_eq!(one["endpoints"][0]["addresses"][0], "10.0.0.1");
        let stored = server.objects::<EndpointSlice>().unwrap();
        assert_eq!(stored.len(), 1);
        assert_eq!(stored[0].metadata.resource_version.as_deref(), Some("1"));
        assert_eq!(
            get(
                &server,
                "/apis/discovery.k8s.io/v1/namespaces/a/endpointslices/nope"
            )
            .0,
            404
        );
        assert_eq!(get(&server, "/api/v1/persistentvolumes").0, 404);
    }

    const GATEWAY: &str = "/apis/gateway.networking.k8s.io/v1";

    fn web_route(namespace: &str, name: &str) -> Value {
        crate::k8s_objects::http_route(
            namespace,
            name,
            json!([crate::k8s_objects::service_parent("web", Some(80))]),
            json!([{"backendRefs": [{"name": "web-v2", "port": 80}]}]),
        )
    }

    #[test]
    fn gateway_api_kinds_are_served_under_their_group() {
        use crate::k8s_objects::{grpc_route, reference_grant, service_parent};
        let server = FakeApiServer::start().unwrap();
        server.apply_json(web_route("shop", "web")).unwrap();
        server.apply_json(web_route("other", "web")).unwrap();
        server
            .apply_json(grpc_route(
                "shop",
                "rpc",
                json!([service_parent("rpc", None)]),
                json!([]),
            ))
            .unwrap();
        server
            .apply_json(reference_grant(
                "shop",
                "allow",
                json!([{"group": GATEWAY_API, "kind": "HTTPRoute", "namespace": "other"}]),
                json!([{"group": "", "kind": "Service"}]),
            ))
            .unwrap();

        let (code, all) = get(&server, &format!("{GATEWAY}/httproutes"));
        assert_eq!(code, 200);
        assert_eq!(all["kind"], "HTTPRouteList");
        assert_eq!(all["apiVersion"], "gateway.networking.k8s.io/v1");
        assert_eq!(names(&all), ["web", "web"]);
        let (_, shop) = get(&server, &format!("{GATEWAY}/namespaces/shop/httproutes"));
        assert_eq!(names(&shop), ["web"]);
        let (code, web) = get(
            &server,
            &format!("{GATEWAY}/namespaces/shop/httproutes/web"),
        );
        assert_eq!(code, 200);
        assert_eq!(web["kind"], "HTTPRoute");
        assert_eq!(web["spec"]["parentRefs"][0]["kind"], "Service");
        assert_eq!(
            web["metadata"]["uid"],
            "00000000-0000-0000-0000-000000000001"
        );
        assert_eq!(web["metadata"]["resourceVersion"], "1");
        assert!(web["metadata"]["creationTimestamp"].is_string());
        let (_, rpcs) = get(&server, &format!("{GATEWAY}/grpcroutes"));
        assert_eq!(
            (rpcs["kind"].as_str(), names(&rpcs)),
            (Some("GRPCRouteList"), vec!["rpc".to_string()])
        );
        let (_, grants) = get(
            &server,
            &format!("{GATEWAY}/namespaces/shop/referencegrants"),
        );
        assert_eq!(names(&grants), ["allow"]);

        let (code, missing) = get(
            &server,
            &format!("{GATEWAY}/namespaces/shop/httproutes/nope"),
        );
        assert_eq!(code, 404);
        assert_eq!(
            missing["message"],
            "httproutes.gateway.networking.k8s.io \"nope\" not found"
        );
        // Only the served version: v1beta1 is neither routed nor accepted.
        assert_eq!(
            get(
                &server,
                "/apis/gateway.networking.k8s.io/v1beta1/httproutes"
            )
            .0,
            404
        );
        let mut beta = web_route("shop", "beta");
        beta["apiVersion"] = "gateway.networking.k8s.io/v1beta1".into();
        assert!(server.apply_json(beta).is_err());
    }

    #[test]
    fn creation_timestamps_are_kept_when_given_and_never_go_back() {
        let server = FakeApiServer::start().unwrap();
        let mut dated = web_route("shop", "dated");
        dated["metadata"]["creationTimestamp"] = "2020-01-01T00:00:00Z".into();
        server.apply_json(dated.clone()).unwrap();
        // Re-applying does not move it, whatever the object says (as on a real server).
        dated["metadata"]["creationTimestamp"] = "2021-01-01T00:00:00Z".into();
        server.apply_json(dated).unwrap();
        let (_, stored) = get(
            &server,
            &format!("{GATEWAY}/namespaces/shop/httproutes/dated"),
        );
        assert_eq!(
            stored["metadata"]["creationTimestamp"],
            "2020-01-01T00:00:00Z"
        );

        let mut bad = web_route("shop", "bad");
        bad["metadata"]["creationTimestamp"] = "yesterday".into();
        let rv = server.resource_version();
        assert!(server.apply_json(bad).is_err());
        assert_eq!(
            server.resource_version(),
            rv,
            "a refused apply is no change"
        );

        // A clock that stepped back: later objects still are not created earlier.
        let ahead = 4_102_444_800; // 2100-01-01
        lock(&server.store).last_created = ahead;
        server.apply_json(web_route("shop", "later")).unwrap();
        let (_, later) = get(
            &server,
            &format!("{GATEWAY}/namespaces/shop/httproutes/later"),
        );
        assert_eq!(
            later["metadata"]["creationTimestamp"],
            "2100-01-01T00:00:00Z"
        );
    }

    #[test]
    fn an_uninstalled_kind_is_an_unknown_path_until_installed() {
        use gateway_api::experimental::httproutes::HttpRoute;
        let server = FakeApiServer::start().unwrap();
        server.apply_json(web_route("shop", "web")).unwrap();
        server.apply_json(service("shop", "web", 80)).unwrap();
        let mut open = watch(
            &server,
            &format!("{GATEWAY}/namespaces/shop/httproutes?watch=1&resourceVersion=2"),
        );
        let mut services = watch(&server, "/api/v1/services?watch=1&resourceVersion=2");

        server.uninstall::<HttpRoute>().unwrap();
        // As a CRD's deletion: its objects go first, then its watches end.
        let deleted = events(&mut open, 1);
        assert_eq!(deleted[0]["type"], "DELETED");
        assert_eq!(deleted[0]["object"]["metadata"]["name"], "web");
        let mut rest = String::new();
        open.read_to_string(&mut rest).unwrap();
        assert_eq!(rest, "");

        let unknown = json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": "the server could not find the requested resource",
            "reason": "NotFound", "details": {}, "code": 404});
        for path in [
            format!("{GATEWAY}/httproutes"),
            format!("{GATEWAY}/namespaces/shop/httproutes"),
            format!("{GATEWAY}/httproutes?watch=1"),
            format!("{GATEWAY}/namespaces/shop/httproutes/web"),
            "/api/v1/persistentvolumes".to_string(),
        ] {
            assert_eq!(get(&server, &path), (404, unknown.clone()), "{path}");
        }
        assert!(server.apply_json(web_route("shop", "web")).is_err());
        assert!(server.delete::<HttpRoute>("shop", "web").is_err());
        assert!(server.objects::<HttpRoute>().unwrap().is_empty());
        // Other kinds go on: their watches stay open and their paths are served.
        assert_eq!(get(&server, &format!("{GATEWAY}/grpcroutes")).0, 200);
        server.apply_json(service("shop", "late", 80)).unwrap();
        assert_eq!(
            events(&mut services, 1)[0]["object"]["metadata"]["name"],
            "late"
        );

        server.install::<HttpRoute>().unwrap();
        let (code, empty) = get(&server, &format!("{GATEWAY}/httproutes"));
        assert_eq!((code, names(&empty)), (200, vec![]));
        server.apply_json(web_route("shop", "again")).unwrap();
        let (_, again) = get(&server, &format!("{GATEWAY}/httproutes"));
        assert_eq!(names(&again), ["again"]);
    }

    #[test]
    fn cluster_scoped_kinds_have_no_namespace() {
        let server = FakeApiServer::start().unwrap();
        server
            .apply_json(json!({"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": "node-a", "namespace": "ignored"}}))
            .unwrap();
        let (code, nodes) = get(&server, "/api/v1/nodes");
        assert_eq!((code, names(&nodes)), (200, vec!["node-a".to_string()]));
        let (code, node) = get(&server, "/api/v1/nodes/node-a");
        assert_eq!(code, 200);
        assert!(node["metadata"].get("namespace").is_none(), "{node}");
        assert_eq!(get(&server, "/api/v1/namespaces/ignored/nodes").0, 404);
        assert!(
            server
                .delete::<k8s_openapi::api::core::v1::Node>("whatever", "node-a")
                .unwrap()
        );
    }

    #[test]
    fn rfc3339_formats_known_instants() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
    }
}
