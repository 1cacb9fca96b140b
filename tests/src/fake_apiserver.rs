//! A fake Kubernetes API server that owns the wire protocol of two resources — core/v1 Services
//! and discovery.k8s.io/v1 EndpointSlices — over real HTTP on loopback, so the agent under test
//! talks to it through its real kube client and a kubeconfig.
//!
//! It keeps what an API server backed by etcd keeps: one global, monotonically increasing
//! resourceVersion, the current objects, and the history of changes since the last compaction.
//! Lists are paged (`limit`/`continue`, as kube's watcher asks for 500 at a time) from a
//! consistent snapshot; watches replay history after their `resourceVersion`, then stream live
//! events as chunked JSON lines, send BOOKMARKs when asked, end after `timeoutSeconds`, and answer
//! a version older than the compaction with an in-stream ERROR event carrying a 410 Status, as a
//! real API server does.
//!
//! The server runs on its own Tokio runtime, so tests drive it with plain (blocking) calls from
//! sync or async code alike.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{Context, bail};
use axum::body::Body;
use bytes::Bytes;
use futures::StreamExt;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnboundedReceiverStream;

/// How often open watches that asked for bookmarks get one.
const BOOKMARK_INTERVAL: Duration = Duration::from_secs(1);

/// The two resources the fake serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Service,
    EndpointSlice,
}

impl Kind {
    fn from_kind(kind: &str) -> Option<Kind> {
        match kind {
            "Service" => Some(Kind::Service),
            "EndpointSlice" => Some(Kind::EndpointSlice),
            _ => None,
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Kind::Service => "v1",
            Kind::EndpointSlice => "discovery.k8s.io/v1",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
        }
    }

    fn plural(self) -> &'static str {
        match self {
            Kind::Service => "services",
            Kind::EndpointSlice => "endpointslices",
        }
    }
}

/// Where an object lives: (kind, namespace, name). Ordered like etcd keys, so lists and
/// continue tokens are stable.
type Key = (Kind, String, String);

struct Stored {
    json: Bytes,
}

/// One change, serialized once as the watch line every watcher in scope receives.
struct Change {
    rv: u64,
    kind: Kind,
    namespace: String,
    line: Bytes,
}

struct Watcher {
    kind: Kind,
    namespace: Option<String>,
    bookmarks: bool,
    tx: mpsc::UnboundedSender<Bytes>,
}

impl Watcher {
    fn sees(&self, kind: Kind, namespace: &str) -> bool {
        self.kind == kind && self.namespace.as_deref().is_none_or(|ns| ns == namespace)
    }
}

/// A paged list in progress: the snapshot it pages through, as of `rv`.
struct Page {
    rv: u64,
    items: Arc<[Bytes]>,
}

#[derive(Default)]
struct Store {
    rv: u64,
    /// Versions below this are compacted away: watching from them gets 410.
    compacted: u64,
    next_uid: u64,
    objects: BTreeMap<Key, Stored>,
    history: Vec<Change>,
    watchers: Vec<Watcher>,
    pages: HashMap<u64, Page>,
    next_page: u64,
    requests: u64,
}

impl Store {
    fn push(&mut self, change: Change) {
        self.watchers.retain(|w| {
            !w.sees(change.kind, &change.namespace) || w.tx.send(change.line.clone()).is_ok()
        });
        self.history.push(change);
    }

    fn write(&mut self, kind: Kind, mut object: Value) -> anyhow::Result<u64> {
        let meta = object
            .get_mut("metadata")
            .and_then(Value::as_object_mut)
            .context("object has no metadata")?;
        let name = meta
            .get("name")
            .and_then(Value::as_str)
            .context("object has no metadata.name")?
            .to_string();
        let namespace = meta
            .get("namespace")
            .and_then(Value::as_str)
            .unwrap_or("default")
            .to_string();
        let key = (kind, namespace.clone(), name);
        let previous = self
            .objects
            .get(&key)
            .map(|s| serde_json::from_slice::<Value>(&s.json))
            .transpose()?;
        self.rv += 1;
        let rv = self.rv;
        meta.insert("namespace".into(), namespace.clone().into());
        meta.insert("resourceVersion".into(), rv.to_string().into());
        let (uid, created) = match &previous {
            Some(prev) => (
                prev["metadata"]["uid"].clone(),
                prev["metadata"]["creationTimestamp"].clone(),
            ),
            None => {
                self.next_uid += 1;
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_secs();
                (
                    format!("00000000-0000-0000-0000-{:012}", self.next_uid).into(),
                    rfc3339(now).into(),
                )
            }
        };
        meta.insert("uid".into(), uid);
        meta.insert("creationTimestamp".into(), created);
        if let Some(map) = object.as_object_mut() {
            map.insert("apiVersion".into(), kind.api_version().into());
            map.insert("kind".into(), kind.kind().into());
        }
        let json = Bytes::from(serde_json::to_vec(&object)?);
        let kind_of_event = if previous.is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        self.push(Change {
            rv,
            kind,
            namespace,
            line: event_line(kind_of_event, &json),
        });
        self.objects.insert(key, Stored { json });
        Ok(rv)
    }

    fn delete(&mut self, kind: Kind, namespace: &str, name: &str) -> anyhow::Result<bool> {
        let key = (kind, namespace.to_string(), name.to_string());
        let Some(stored) = self.objects.remove(&key) else {
            return Ok(false);
        };
        // The DELETED event carries the object at the version of its deletion.
        self.rv += 1;
        let mut object: Value = serde_json::from_slice(&stored.json)?;
        object["metadata"]["resourceVersion"] = self.rv.to_string().into();
        let json = serde_json::to_vec(&object)?;
        self.push(Change {
            rv: self.rv,
            kind,
            namespace: namespace.to_string(),
            line: event_line("DELETED", &json),
        });
        Ok(true)
    }

    fn in_scope<'a>(
        &'a self,
        kind: Kind,
        namespace: Option<&'a str>,
    ) -> impl Iterator<Item = &'a Bytes> + 'a {
        self.objects
            .range((kind, String::new(), String::new())..)
            .take_while(move |((k, _, _), _)| *k == kind)
            .filter(move |((_, ns, _), _)| namespace.is_none_or(|want| want == ns))
            .map(|(_, stored)| &stored.json)
    }
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

    /// Creates or replaces an object (a Service or an EndpointSlice from k8s-openapi). Returns
    /// its new resourceVersion.
    pub fn apply<K: k8s_openapi::Resource + Serialize>(&self, object: &K) -> anyhow::Result<u64> {
        self.apply_json(serde_json::to_value(object)?)
    }

    /// Creates or replaces an object given as JSON; `kind` says which resource it is.
    pub fn apply_json(&self, object: Value) -> anyhow::Result<u64> {
        let kind = object
            .get("kind")
            .and_then(Value::as_str)
            .and_then(Kind::from_kind)
            .with_context(|| format!("object kind must be Service or EndpointSlice: {object}"))?;
        lock(&self.store).write(kind, object)
    }

    /// Deletes an object; returns whether it existed.
    pub fn delete<K: k8s_openapi::Resource>(
        &self,
        namespace: &str,
        name: &str,
    ) -> anyhow::Result<bool> {
        let kind =
            Kind::from_kind(K::KIND).with_context(|| format!("{} is not served", K::KIND))?;
        lock(&self.store).delete(kind, namespace, name)
    }

    /// Every object of a kind, as stored now: the truth a test compares the agent against.
    pub fn objects<K: k8s_openapi::Resource + DeserializeOwned>(&self) -> anyhow::Result<Vec<K>> {
        let kind =
            Kind::from_kind(K::KIND).with_context(|| format!("{} is not served", K::KIND))?;
        let store = lock(&self.store);
        store
            .in_scope(kind, None)
            .map(|json| Ok(serde_json::from_slice(json)?))
            .collect()
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
        store.watchers.retain(|w| {
            if !w.bookmarks {
                return !w.tx.is_closed();
            }
            let object = json!({
                "kind": w.kind.kind(),
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
                    let service = hyper::service::service_fn(move |req| {
                        let store = store.clone();
                        async move { Ok::<_, Infallible>(handle(&store, req)) }
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

/// A parsed request path: which resource, in which namespace (None = all), which object.
struct Target {
    kind: Kind,
    namespace: Option<String>,
    name: Option<String>,
}

fn route(path: &str) -> Option<Target> {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let rest = match segments.as_slice() {
        ["api", "v1", rest @ ..] => (Kind::Service, rest),
        ["apis", "discovery.k8s.io", "v1", rest @ ..] => (Kind::EndpointSlice, rest),
        _ => return None,
    };
    let (kind, rest) = rest;
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] => (Some((*ns).to_string()), rest),
        rest => (None, rest),
    };
    match rest {
        [plural] if *plural == kind.plural() => Some(Target {
            kind,
            namespace,
            name: None,
        }),
        [plural, name] if *plural == kind.plural() && namespace.is_some() => Some(Target {
            kind,
            namespace,
            name: Some((*name).to_string()),
        }),
        _ => None,
    }
}

fn query(req: &Request<Incoming>) -> HashMap<String, String> {
    req.uri()
        .query()
        .unwrap_or_default()
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| match pair.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => (pair.to_string(), String::new()),
        })
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

fn handle(store: &Mutex<Store>, req: Request<Incoming>) -> Response<Body> {
    lock(store).requests += 1;
    if req.method() != http::Method::GET {
        return failure(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "the fake API server only serves get, list and watch",
        );
    }
    let Some(target) = route(req.uri().path()) else {
        return failure(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!(
                "the server could not find the requested resource {}",
                req.uri()
            ),
        );
    };
    let params = query(&req);
    for unsupported in ["labelSelector", "fieldSelector", "sendInitialEvents"] {
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
        return watch(store, &target, &params);
    }
    list(store, &target, &params)
}

fn get(store: &Mutex<Store>, target: &Target, name: &str) -> Response<Body> {
    let store = lock(store);
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
            &format!("{} {name:?} not found", target.kind.plural()),
        ),
    }
}

fn list(store: &Mutex<Store>, target: &Target, params: &HashMap<String, String>) -> Response<Body> {
    let limit = params
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0);
    let mut store = lock(store);
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
    body.extend_from_slice(
        format!(
            "{{\"kind\":\"{}List\",\"apiVersion\":\"{}\",\"metadata\":{metadata},\"items\":[",
            target.kind.kind(),
            target.kind.api_version()
        )
        .as_bytes(),
    );
    for (i, item) in items[offset.min(end)..end].iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(item);
    }
    body.extend_from_slice(b"]}");
    json_response(StatusCode::OK, body)
}

fn watch(
    store: &Mutex<Store>,
    target: &Target,
    params: &HashMap<String, String>,
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
        let namespace = target.namespace.as_deref();
        match from {
            // No version: the current state as synthetic ADDED events, then changes.
            None => {
                for json in store.in_scope(target.kind, namespace) {
                    let _ = tx.send(event_line("ADDED", json));
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
                    {
                        let _ = tx.send(change.line.clone());
                    }
                }
            }
        }
        store.watchers.push(Watcher {
            kind: target.kind,
            namespace: target.namespace.clone(),
            bookmarks,
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
        assert_eq!(get(&server, "/api/v1/pods").0, 404);
    }

    #[test]
    fn rfc3339_formats_known_instants() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
    }
}
