//! Mesh-file source: a YAML file describing the whole mesh, followed live.
//!
//! The file is validated as a whole (the services, then their routing rules, which name other
//! services of the file), but an edit is read by the `services` items it changed and applied
//! as the services it removed and upserted ([`reader`]); a bad edit is logged and the last good
//! mesh keeps serving. Changes are seen through inotify on the file's directory, so editors
//! that replace the file and Kubernetes ConfigMap symlink swaps are both caught. With a state
//! directory, a start takes a file's services from its copy there when the file has not
//! changed since the copy was written ([`copy`]).

mod copy;
mod follow;
mod items;
mod limits;
mod reader;
mod routes;

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use lattice_contract::TrapCidrs;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

pub use copy::prune as prune_copies;
pub use limits::{DEFAULT_MAX_DEPTH, DEFAULT_MAX_MIB, DEFAULT_MAX_NODES, LimitError, Limits};

use crate::identity::PodPattern;
use crate::mesh::locality::place_name;
use crate::mesh::provider::Report as _;
use copy::{COPY_AFTER, Copying, FileCopy};
use reader::{Read, Reader};

use crate::mesh::{
    AddressError, Endpoint, HostEndpoint, HostHeader, HostName, InstanceSpec, MeshMetrics,
    MeshPath, MeshSnapshot, MeshState, Protocol, Provider, ProviderTx, ServicePort, ServiceSpec,
    TrafficDistribution,
};

#[derive(Debug, thiserror::Error)]
pub enum MeshFileError {
    #[error("cannot read mesh file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("mesh file {path} is not valid: {message}")]
    Syntax { path: PathBuf, message: String },
    #[error("mesh file {path} is refused: {source}")]
    Limit { path: PathBuf, source: LimitError },
    #[error("mesh file {path}: {source}")]
    Addresses { path: PathBuf, source: AddressError },
    #[error("cannot watch mesh file {path} for changes: {source}")]
    Watch {
        path: PathBuf,
        source: notify::Error,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MeshFile {
    /// Required, so an empty or truncated file is an error rather than an empty mesh: writing
    /// `services: []` is how to say "no services".
    services: Vec<FileService>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FileService {
    path: String,
    ports: Vec<FilePort>,
    #[serde(default)]
    endpoints: Vec<FileEndpoint>,
    #[serde(default)]
    routes: Vec<routes::FileRoute>,
    /// Active health checks and outlier detection (docs/mesh-file.md).
    health: Option<super::health::HealthSpec>,
    /// `PreferSameZone` or `PreferSameNode`: which endpoints clients prefer (Kubernetes'
    /// spelling and meaning).
    traffic_distribution: Option<String>,
    /// `rewrite` (the default) or `keep`: the `Host` HTTP requests to host-name endpoints
    /// carry upstream.
    host_header: Option<String>,
    /// Pods whose Envoys hold this service whether or not they resolve its name
    /// (`namespace/name`, `namespace/prefix*`).
    #[serde(default)]
    clients: Vec<String>,
    /// The SPIFFE IDs its endpoints' proxies present (`spiffe://<trust domain>/ns/<ns>/sa/<sa>`):
    /// clients call it over mesh mTLS and accept only these.
    #[serde(default)]
    identities: Vec<String>,
    /// Who may call its endpoints (docs/mesh-file.md).
    #[serde(default)]
    authorization: Vec<super::authorization::RuleSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FilePort {
    port: i64,
    /// Names the port in SRV records: `_<name>._tcp.<service name>`.
    name: Option<String>,
    #[serde(default = "default_protocol")]
    protocol: String,
    target_port: Option<i64>,
}

fn default_protocol() -> String {
    "tcp".to_string()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileEndpoint {
    address: String,
    /// Makes the endpoint a named instance of a stateful service: `name: db-1` is reachable
    /// as `db-1.<service name>` at an address of its own. All of a service's endpoints are
    /// named, or none.
    name: Option<String>,
    /// An endpoint that is not ready gets no load-balanced traffic and is left out of a
    /// stateful service's name; a named instance keeps its own name and address.
    #[serde(default = "ready_by_default")]
    ready: bool,
    /// The zone it runs in: Envoy's locality, and what PreferSameZone compares.
    zone: Option<String>,
    /// The node it runs in (as `--node-name` names nodes): what PreferSameNode compares.
    node: Option<String>,
}

fn ready_by_default() -> bool {
    true
}

/// Parses and validates mesh-file text as a whole, within `limits`. Errors name the service
/// and the field (or the line past a limit).
pub fn parse(text: &str, provider: &Provider, limits: &Limits) -> Result<Vec<ServiceSpec>, String> {
    limits::check(text, limits, 0).map_err(|e| e.to_string())?;
    let file: MeshFile = serde_norway::from_str(text).map_err(|e| e.to_string())?;
    let services = file
        .services
        .into_iter()
        .enumerate()
        .map(|(i, service)| read_service(i, service, provider))
        .collect::<Result<Vec<_>, _>>()?;
    assemble(&services)
}

/// One `services` item, validated on its own: its spec, and its rules as the file wrote them
/// (they name other services, so they are checked once every service is read: [`assemble`]).
struct ReadService {
    spec: ServiceSpec,
    routes: Vec<routes::FileRoute>,
}

/// Validates the `i`th service of the file, alone.
fn read_service(
    i: usize,
    service: FileService,
    provider: &Provider,
) -> Result<ReadService, String> {
    let at = format!("services[{i}]");
    let path: MeshPath = service
        .path
        .parse()
        .map_err(|e| format!("{at}.path: {e}"))?;
    let at = format!("{at} ({path})");
    if service.ports.is_empty() {
        return Err(format!("{at}.ports: a service needs at least one port"));
    }
    let health = super::health::policy(service.health).map_err(|e| format!("{at}.health.{e}"))?;
    let traffic_distribution = match &service.traffic_distribution {
        None => TrafficDistribution::Any,
        Some(value) => value
            .parse()
            .map_err(|e| format!("{at}.trafficDistribution: {e}"))?,
    };
    let mut endpoints = Vec::with_capacity(service.endpoints.len());
    let mut hosts: Vec<HostName> = Vec::new();
    let mut instances: Vec<(String, IpAddr, bool)> = Vec::new();
    // Not ready: sent no traffic, but covered by the service's authorization.
    let mut unready: Vec<IpAddr> = Vec::new();
    let named = service
        .endpoints
        .iter()
        .filter(|e| e.name.is_some())
        .count();
    if named != 0 && named != service.endpoints.len() {
        return Err(format!(
            "{at}.endpoints: {named} of {} endpoints have a name: name all of them (a \
                 stateful service's instances) or none",
            service.endpoints.len()
        ));
    }
    for (j, endpoint) in service.endpoints.iter().enumerate() {
        let ip: IpAddr = match endpoint.address.parse() {
            Ok(ip) => ip,
            Err(_) => {
                let host: HostName = endpoint.address.parse().map_err(|e| {
                    format!(
                        "{at}.endpoints[{j}].address: neither an IP address nor a host \
                             name: {e}"
                    )
                })?;
                if endpoint.name.is_some() {
                    return Err(format!(
                        "{at}.endpoints[{j}]: a host-name endpoint cannot be a named \
                             instance (an instance needs an address of its own)"
                    ));
                }
                if endpoint.ready {
                    hosts.push(host);
                }
                continue;
            }
        };
        if let Some(name) = &endpoint.name {
            path.child(name).map_err(|_| {
                format!(
                    "{at}.endpoints[{j}].name: {name:?} is not a DNS label (1-63 of a-z, \
                         0-9 and '-', not starting or ending with '-')"
                )
            })?;
            if instances.iter().any(|(n, _, _)| n == name) {
                return Err(format!(
                    "{at}.endpoints[{j}].name: {name:?} is listed twice"
                ));
            }
            instances.push((name.clone(), ip, endpoint.ready));
        }
        let place = |field: &str, value: &Option<String>| {
            value
                .as_deref()
                .map(place_name)
                .transpose()
                .map_err(|e| format!("{at}.endpoints[{j}].{field}: {e}"))
        };
        let zone = place("zone", &endpoint.zone)?;
        let node = place("node", &endpoint.node)?;
        if endpoint.ready {
            endpoints.push((ip, zone, node));
        } else {
            unready.push(ip);
        }
    }
    let ip_count = service.endpoints.len()
        - service
            .endpoints
            .iter()
            .filter(|e| e.address.parse::<IpAddr>().is_err())
            .count();
    let host_count = service.endpoints.len() - ip_count;
    if ip_count != 0 && host_count != 0 {
        return Err(format!(
            "{at}.endpoints: {ip_count} IP address(es) and {host_count} host name(s): a \
                 service's endpoints are all IP addresses or all host names (an external \
                 service); make two services"
        ));
    }
    let host_header = match &service.host_header {
        None => HostHeader::default(),
        Some(_) if host_count == 0 => {
            return Err(format!(
                "{at}.hostHeader: only a service whose endpoints are host names has one"
            ));
        }
        Some(mode) => mode.parse().map_err(|e| format!("{at}.hostHeader: {e}"))?,
    };
    let mut clients = Vec::with_capacity(service.clients.len());
    for (j, client) in service.clients.iter().enumerate() {
        client
            .parse::<PodPattern>()
            .map_err(|e| format!("{at}.clients[{j}]: {e}"))?;
        clients.push(std::sync::Arc::from(client.as_str()));
    }
    if host_count != 0 && !service.identities.is_empty() {
        return Err(format!(
            "{at}.identities: a service whose endpoints are host names is outside the mesh,              and its endpoints run no mesh proxy to present an identity"
        ));
    }
    let mut identities = Vec::with_capacity(service.identities.len());
    for (j, identity) in service.identities.iter().enumerate() {
        let id = crate::trust::SpiffeId::parse(identity)
            .map_err(|e| format!("{at}.identities[{j}]: {e}"))?;
        identities.push(std::sync::Arc::from(id.to_string().as_str()));
    }
    let mut ports = Vec::with_capacity(service.ports.len());
    let mut port_numbers = HashSet::new();
    for (j, port) in service.ports.iter().enumerate() {
        let number = port_number(port.port).ok_or_else(|| {
            format!(
                "{at}.ports[{j}].port: {} is out of range 1-65535",
                port.port
            )
        })?;
        if !port_numbers.insert(number) {
            return Err(format!(
                "{at}.ports[{j}].port: port {number} is listed twice"
            ));
        }
        let target = match port.target_port {
            None => number,
            Some(target) => port_number(target).ok_or_else(|| {
                format!("{at}.ports[{j}].targetPort: {target} is out of range 1-65535")
            })?,
        };
        let protocol: Protocol = port
            .protocol
            .parse()
            .map_err(|e| format!("{at}.ports[{j}].protocol: {e}"))?;
        if let Some(name) = &port.name
            && path.child(name).is_err()
        {
            return Err(format!(
                "{at}.ports[{j}].name: {name:?} is not a DNS label (1-63 of a-z, 0-9 and \
                     '-', not starting or ending with '-')"
            ));
        }
        ports.push(ServicePort {
            port: number,
            name: port.name.as_deref().map(Arc::from),
            protocol,
            endpoints: endpoints
                .iter()
                .map(|(ip, zone, node)| Endpoint {
                    zone: zone.clone(),
                    node: node.clone(),
                    ..Endpoint::new(SocketAddr::new(*ip, target), provider.clone())
                })
                .collect(),
            hosts: hosts
                .iter()
                .map(|host| HostEndpoint {
                    host: host.clone(),
                    port: target,
                    provider: provider.clone(),
                })
                .collect(),
        });
    }
    if host_count != 0 && !service.authorization.is_empty() {
        return Err(format!(
            "{at}.authorization: a service whose endpoints are host names is outside the mesh, \
             and its endpoints run no mesh proxy to enforce it"
        ));
    }
    let service_ports: Vec<u16> = ports.iter().map(|p| p.port).collect();
    let authorization = super::authorization::check(&service.authorization, &service_ports)
        .map_err(|e| format!("{at}.authorization{e}"))?;
    // Each service port and the port its endpoints serve it on.
    let targets: Vec<(u16, u16)> = ports
        .iter()
        .zip(&service.ports)
        .map(|(port, file_port)| {
            let target = file_port.target_port.and_then(port_number);
            (port.port, target.unwrap_or(port.port))
        })
        .collect();
    let at_targets = |ip: IpAddr| {
        targets
            .iter()
            .map(move |(port, target)| (*port, SocketAddr::new(ip, *target)))
    };
    // Covered by the service's rules, whichever provider gives them.
    let unready = unready.iter().flat_map(|ip| at_targets(*ip)).collect();
    let instances = instances
        .into_iter()
        .map(|(name, ip, ready)| InstanceSpec {
            name,
            ready,
            endpoints: at_targets(ip).collect(),
        })
        .collect();
    Ok(ReadService {
        spec: ServiceSpec::new(path, ports)
            .with_instances(instances)
            .with_health(health)
            .with_traffic_distribution(traffic_distribution)
            .with_host_header(host_header)
            .with_clients(clients)
            .with_identities(identities)
            .with_authorization(authorization)
            .with_unready(unready),
        routes: service.routes,
    })
}

/// The file's services in file order: each path at most once, and each service's rules checked
/// against the ports of every service.
fn assemble<S: std::borrow::Borrow<ReadService>>(
    services: &[S],
) -> Result<Vec<ServiceSpec>, String> {
    let at = |i: usize, path: &MeshPath| format!("services[{i}] ({path})");
    let mut seen = HashSet::with_capacity(services.len());
    for (i, service) in services.iter().enumerate() {
        let path = &service.borrow().spec.path;
        if !seen.insert(path) {
            return Err(format!(
                "{}: duplicate path {path}: each path may appear once",
                at(i, path)
            ));
        }
    }
    // Rules name other services and their ports; most files have few rules, and without any
    // the index is not built.
    let ports: routes::PortIndex = if services.iter().any(|s| !s.borrow().routes.is_empty()) {
        services
            .iter()
            .map(|s| {
                let spec = &s.borrow().spec;
                let ports = spec.ports.iter().map(|p| (p.port, p.protocol)).collect();
                (spec.path.clone(), ports)
            })
            .collect()
    } else {
        routes::PortIndex::new()
    };
    services
        .iter()
        .enumerate()
        .map(|(i, service)| {
            let ReadService { spec, routes } = service.borrow();
            if routes.is_empty() {
                return Ok(spec.clone());
            }
            let rules = routes::rules(&spec.path, routes.clone(), &ports)
                .map_err(|e| format!("{}.{e}", at(i, &spec.path)))?;
            Ok(spec.clone().with_routes(rules))
        })
        .collect()
}

/// Changes after which the file is whole again: closed after writing, created, renamed into
/// place or removed. Plain data writes are skipped, so a file is never read half-written.
fn is_complete_change(kind: &notify::EventKind) -> bool {
    use notify::event::{AccessKind, AccessMode, ModifyKind};
    match kind {
        notify::EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        notify::EventKind::Access(_) => false,
        notify::EventKind::Modify(ModifyKind::Data(_) | ModifyKind::Metadata(_)) => false,
        _ => true,
    }
}

/// A port number (1-65535) from the file's integer.
fn port_number(value: i64) -> Option<u16> {
    u16::try_from(value).ok().filter(|&p| p != 0)
}

/// The mesh-file source, loaded once (so a bad file fails start-up) and then followed.
pub struct FileSource {
    path: PathBuf,
    limits: Limits,
    reader: Reader,
    state: MeshState,
    /// The text the state was built from.
    text: String,
    /// The file's copy in the state directory, if the agent has one; written on the file's
    /// thread, at `SCHED_IDLE`.
    copy: Option<Copying>,
    /// Whether the state was taken from the copy rather than read from the text.
    from_copy: bool,
}

/// How long a file that cannot be followed (a watch failed) waits before trying again, beside
/// the events of the directories that are watched.
const RETRY_FOLLOW: Duration = Duration::from_secs(2);

/// What the follower thread is told.
enum Wake {
    /// Something the file reads may have changed.
    Look,
    /// The agent is stopping.
    Stop,
}

/// Where a look at the file left things, as the provider reports it.
#[derive(Clone, PartialEq, Eq)]
enum Outcome {
    Fresh,
    Stale(String),
}

impl FileSource {
    /// Loads the file and builds the first mesh. Fails on any error, naming the file. With
    /// `state_dir`, the services come from the file's copy there when it holds this very text,
    /// and the copy is written (by [`Self::run`]) when it did not.
    pub fn load(
        path: &Path,
        trap: TrapCidrs,
        limits: Limits,
        state_dir: Option<&Path>,
    ) -> Result<FileSource, MeshFileError> {
        let mut text = String::new();
        read_file(path, &limits, &mut text).map_err(|source| match source {
            ReadError::Io(source) => MeshFileError::Read {
                path: path.to_path_buf(),
                source,
            },
            ReadError::Limit(source) => MeshFileError::Limit {
                path: path.to_path_buf(),
                source,
            },
        })?;
        let copy = state_dir.and_then(|dir| FileCopy::new(dir, path, &trap, &limits));
        let reader = Reader::new(Provider::file(path), limits);
        let mut source = FileSource {
            path: path.to_path_buf(),
            limits,
            reader: match copy {
                Some(_) => reader.keeping_whole_reads(),
                None => reader,
            },
            state: MeshState::new(trap),
            text: String::new(),
            copy: copy.map(Copying::new),
            from_copy: false,
        };
        source.from_copy = source.take_copy(&text);
        if !source.from_copy {
            source.apply(&text)?;
            if let Some(copying) = &mut source.copy {
                copying.behind(Instant::now());
            }
        }
        source.text = text;
        Ok(source)
    }

    /// Counts its copy in `metrics` (`lattice_mesh_file_copies_behind`) from now on.
    pub fn with_metrics(mut self, metrics: MeshMetrics) -> Self {
        if let Some(copying) = &mut self.copy {
            copying.count_in(metrics);
        }
        self
    }

    /// Takes the services of the copy, if it holds those of `text`, into the state; whether
    /// it did. A copy that cannot be used is logged and left: the text is read instead.
    fn take_copy(&mut self, text: &str) -> bool {
        let Some(copy) = self.copy.as_ref().map(Copying::copy) else {
            return false;
        };
        let reason = match copy.take(&copy.key(text)) {
            Ok(None) => return false,
            Ok(Some(specs)) => match self.state.replace_all(specs) {
                Ok(()) => return true,
                Err(error) => error.to_string(),
            },
            Err(reason) => reason,
        };
        tracing::warn!(
            file = %self.path.display(),
            copy = %copy.path().display(),
            %reason,
            "the mesh file's copy in the state directory cannot be used; reading the file"
        );
        false
    }

    /// The state moved past what the copy holds: the copy is due [`COPY_AFTER`] from now,
    /// unless it is due already.
    fn copy_behind(&mut self) {
        if let Some(copying) = &mut self.copy {
            copying.behind(Instant::now() + COPY_AFTER);
        }
    }

    /// Writes the copy of the last good read, if it is due; on the file's own thread.
    fn write_copy(&mut self) {
        if let Some(copying) = &mut self.copy {
            copying.write(&self.path, self.reader.kept());
        }
    }

    /// When the copy is to be written, if it is behind.
    fn copy_due(&self) -> Option<Instant> {
        self.copy.as_ref().and_then(Copying::due)
    }

    /// Whether the loaded mesh was taken from the file's copy.
    pub fn from_copy(&self) -> bool {
        self.from_copy
    }

    /// The provider this file is: `file:<path>`.
    pub fn provider(&self) -> Provider {
        Provider::file(&self.path)
    }

    /// Publishes the loaded mesh, then every good edit, until shutdown. Reading and parsing
    /// run on a thread of their own, which shutdown does not wait for: a file that takes long
    /// to parse never holds up the runtime's other tasks, nor the agent's exit.
    pub async fn run(
        mut self,
        tx: ProviderTx,
        shutdown: CancellationToken,
    ) -> Result<(), MeshFileError> {
        let snapshot = self.state.snapshot();
        tracing::info!(
            file = %self.path.display(),
            services = snapshot.services.len(),
            endpoints = snapshot.endpoint_count(),
            from_copy = self.from_copy,
            "mesh file loaded"
        );
        tx.view(snapshot);

        let (wake_tx, wake_rx) = std::sync::mpsc::channel::<Wake>();
        let interest = Arc::new(RwLock::new(follow::Interest::default()));
        let events_tx = wake_tx.clone();
        let matters = interest.clone();
        let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            let relevant = match &event {
                Ok(event) => {
                    is_complete_change(&event.kind)
                        && (event.paths.is_empty()
                            || matters
                                .read()
                                .is_ok_and(|m| event.paths.iter().any(|p| m.matters(p))))
                }
                // Overflow or a failing watch: look again, which re-arms the watches.
                Err(_) => true,
            };
            if relevant {
                let _ = events_tx.send(Wake::Look);
            }
        })
        .map_err(|source| MeshFileError::Watch {
            path: self.path.clone(),
            source,
        })?;
        let follow = follow::Follow::new(&self.path, Box::new(watcher), interest);
        let path = self.path.clone();
        std::thread::Builder::new()
            .name("mesh-file".into())
            .spawn(move || {
                crate::parallel::yield_to_serving();
                self.follow(follow, tx, wake_rx)
            })
            .map_err(|source| MeshFileError::Read { path, source })?;
        shutdown.cancelled().await;
        let _ = wake_tx.send(Wake::Stop);
        Ok(())
    }

    /// The follower thread: looks at the file after each relevant event (and once at start),
    /// applies what changed, and says whether the view is current.
    fn follow(mut self, mut follow: follow::Follow, tx: ProviderTx, wake: Receiver<Wake>) {
        // Compared with what was loaded, not with what the file holds now: an edit made between
        // the load and the start of the watch raised no event, so the file is read once more
        // right away and such an edit is applied.
        let mut last_text = std::mem::take(&mut self.text);
        let mut last_outcome = Outcome::Fresh;
        // The file is read into the buffer of the text before the last (swapped below): at
        // 10k services a fresh 4 MB string per edit cost a page fault per 4 KiB page, 8 % of
        // the agent's CPU per edit (perf).
        let mut text = String::new();
        let mut following = Ok(());
        let mut look_now = true;
        loop {
            if self.copy_due().is_some_and(|due| Instant::now() >= due) {
                self.write_copy();
            }
            if !std::mem::take(&mut look_now) {
                let retry = following.is_err().then(|| Instant::now() + RETRY_FOLLOW);
                let next = match retry.into_iter().chain(self.copy_due()).min() {
                    None => wake.recv().map_err(|_| RecvTimeoutError::Disconnected),
                    Some(at) => wake.recv_timeout(at.saturating_duration_since(Instant::now())),
                };
                match next {
                    Ok(Wake::Stop) | Err(RecvTimeoutError::Disconnected) => return,
                    // The copy's time, the file followed: written above, nothing to look at.
                    Err(RecvTimeoutError::Timeout) if following.is_ok() => continue,
                    Ok(Wake::Look) | Err(RecvTimeoutError::Timeout) => {}
                }
                // Events that came meanwhile are answered by this one look.
                for queued in wake.try_iter() {
                    if matches!(queued, Wake::Stop) {
                        return;
                    }
                }
            }
            following = follow.update();
            if let Err(problem) = &following {
                tracing::warn!(file = %self.path.display(), %problem, "mesh file cannot be followed; keeping the last good mesh");
            }
            let outcome = match read_file(&self.path, &self.limits, &mut text) {
                Err(error) => {
                    tracing::warn!(file = %self.path.display(), %error, "cannot read mesh file; keeping the last good mesh");
                    // Read again when it is back, even with the same text as the last good.
                    last_text.clear();
                    Outcome::Stale(format!("cannot read the file: {error}"))
                }
                Ok(()) if text == last_text => last_outcome.clone(),
                Ok(()) => {
                    std::mem::swap(&mut last_text, &mut text);
                    match self.apply(&last_text) {
                        Ok(snapshot) => {
                            self.copy_behind();
                            tracing::info!(
                                file = %self.path.display(),
                                version = snapshot.version,
                                services = snapshot.services.len(),
                                endpoints = snapshot.endpoint_count(),
                                "mesh file changed"
                            );
                            tx.view(snapshot);
                            Outcome::Fresh
                        }
                        Err(error) => {
                            tracing::warn!(%error, "mesh file edit rejected; keeping the last good mesh");
                            Outcome::Stale(format!(
                                "edit rejected, the last good version serves: {error}"
                            ))
                        }
                    }
                }
            };
            last_outcome = outcome.clone();
            match (&outcome, &following) {
                (Outcome::Stale(reason), Err(problem)) => tx.stale(format!("{problem}; {reason}")),
                (Outcome::Stale(reason), Ok(())) => tx.stale(reason.clone()),
                (Outcome::Fresh, Err(problem)) => {
                    tx.stale(format!("edits may be missed: {problem}"))
                }
                (Outcome::Fresh, Ok(())) => tx.fresh(),
            }
        }
    }

    /// Reads `text` and applies it to the mesh state, all or nothing.
    fn apply(&mut self, text: &str) -> Result<Arc<MeshSnapshot>, MeshFileError> {
        let read = self
            .reader
            .read(text)
            .map_err(|message| MeshFileError::Syntax {
                path: self.path.clone(),
                message,
            })?;
        match read {
            Read::Whole(specs) => self.state.replace_all(specs),
            Read::Edit { removed, upserted } => self.state.apply(&removed, upserted),
        }
        .map_err(|source| MeshFileError::Addresses {
            path: self.path.clone(),
            source,
        })?;
        self.reader.commit();
        Ok(self.state.snapshot())
    }
}

#[derive(Debug, thiserror::Error)]
enum ReadError {
    #[error("{0}")]
    Io(std::io::Error),
    #[error("{0}")]
    Limit(LimitError),
}

/// Reads the file into `text`, refusing one larger than the limit before reading it whole.
fn read_file(path: &Path, limits: &Limits, text: &mut String) -> Result<(), ReadError> {
    use std::io::Read as _;
    text.clear();
    let file = std::fs::File::open(path).map_err(ReadError::Io)?;
    let too_large = || {
        ReadError::Limit(LimitError::TooLarge {
            limit: limits.max_bytes,
        })
    };
    if file.metadata().map_err(ReadError::Io)?.len() > limits.max_bytes {
        return Err(too_large());
    }
    // The length can grow between the look and the read: never read past the limit.
    file.take(limits.max_bytes.saturating_add(1))
        .read_to_string(text)
        .map_err(ReadError::Io)?;
    if text.len() as u64 > limits.max_bytes {
        text.clear();
        return Err(too_large());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<ServiceSpec>, String> {
        super::parse(text, &Provider::new("file:test"), &Limits::default())
    }

    /// One of everything a service can say: routes with every option, a stateful service,
    /// host names, health checks, locality, clients, identities and authorization.
    const EVERYTHING: &str = r#"
services:
  - path: /shop/web
    ports: [{port: 8080, protocol: http, targetPort: 9090}]
    trafficDistribution: PreferSameZone
    clients: [shop/web-*]
    identities: [spiffe://cluster.local/ns/shop/sa/web]
    authorization:
      - from: [{serviceAccount: shop/front}, {namespace: ops}, {identity: "spiffe://x.example/ns/a/sa/b"}]
        ports: [8080]
        paths: [/api/*, /health]
        methods: [GET]
      - action: deny
        from: [{namespace: guests}]
    endpoints:
      - {address: 10.200.0.3, zone: zone-b}
      - {address: 10.200.0.4, zone: zone-c, node: node-7}
      - {address: 10.200.0.9, ready: false}
    health:
      check:
        http: {path: /healthz, statuses: ["200-299"]}
        interval: 5s
        timeout: 1s
      outlier: {consecutive5xx: 7, ejectionTime: 20s}
    routes:
      - name: green-by-header
        port: 8080
        matches:
          - path: {regex: "/v[0-9]+"}
            method: GET
            headers: [{name: x-release, exact: green}]
            query: [{name: animal, present: true}]
        backends: [{service: /shop/web-green, weight: 3}, {service: /shop/web, weight: 1}]
        timeout: 10s
        backendTimeout: 2s
        retry: {attempts: 3, on: [5xx, reset], codes: [503], backoff: 25ms}
        requestHeaders:
          set: [{name: x-a, value: b}]
          add: [{name: x-b, value: c}]
          remove: [x-c]
  - path: /shop/web-green
    ports: [{port: 8080, protocol: http}]
    endpoints: [{address: 10.200.0.5}]
  - path: /data/db
    ports: [{port: 9042, name: cql}, {port: 8080, protocol: http, targetPort: 8081}]
    endpoints:
      - {address: 10.200.0.10, name: db-0}
      - {address: 10.200.0.11, name: db-1, ready: false}
  - path: /ext/billing
    hostHeader: keep
    ports: [{port: 80, protocol: http}]
    endpoints: [{address: api.billing.example.com}]
"#;

    /// The file at `dir/mesh.yaml` loaded with `state` as the state directory, if any.
    fn load_in(dir: &Path, state: Option<&Path>, limits: Limits) -> FileSource {
        FileSource::load(
            &dir.join("mesh.yaml"),
            "240.240.0.0/16".parse().unwrap(),
            limits,
            state,
        )
        .unwrap()
    }

    /// The one copy in `state`.
    fn copy_in(state: &Path) -> PathBuf {
        let copies: Vec<PathBuf> = std::fs::read_dir(state.join(copy::COPIES_DIR))
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .collect();
        assert_eq!(copies.len(), 1, "{copies:?}");
        copies[0].clone()
    }

    /// A start takes the services of an unchanged file from its copy, exactly as reading it
    /// gives them, and reads the file again after an edit or with other limits; for a file
    /// the reader reads whole (`EVERYTHING`) and one it cuts into items (`GOOD`).
    #[test]
    fn a_start_takes_an_unchanged_file_from_its_copy_and_reads_a_changed_one() {
        for (text, from, to) in [
            (EVERYTHING, "10.200.0.3,", "10.200.0.5,"),
            (GOOD, "10.200.0.9", "10.200.0.10"),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let state = dir.path().join("state");
            let services = |source: &mut FileSource| source.state.snapshot().services.clone();
            std::fs::write(dir.path().join("mesh.yaml"), text).unwrap();
            let mut read = load_in(dir.path(), Some(&state), Limits::default());
            assert!(!read.from_copy());
            assert!(
                !state.join(copy::COPIES_DIR).exists(),
                "written by the file's thread, not the load"
            );
            read.write_copy();
            copy_in(&state);

            let mut copied = load_in(dir.path(), Some(&state), Limits::default());
            assert!(copied.from_copy());
            assert_eq!(services(&mut copied), services(&mut read));
            assert!(copied.copy_due().is_none(), "nothing to write again");

            let other = Limits {
                max_nodes: 10_000,
                ..Limits::default()
            };
            assert!(!load_in(dir.path(), Some(&state), other).from_copy());

            assert!(text.contains(from));
            std::fs::write(dir.path().join("mesh.yaml"), text.replace(from, to)).unwrap();
            let mut changed = load_in(dir.path(), Some(&state), Limits::default());
            assert!(!changed.from_copy());
            let mut fresh = load_in(dir.path(), None, Limits::default());
            assert_eq!(services(&mut changed), services(&mut fresh));
            assert_ne!(services(&mut changed), services(&mut read));
            // Its copy replaces the one of the text before.
            changed.write_copy();
            let mut again = load_in(dir.path(), Some(&state), Limits::default());
            assert!(again.from_copy());
            assert_eq!(services(&mut again), services(&mut fresh));
            copy_in(&state);
        }
    }

    /// A copy that cannot be written stays counted behind and is tried again, until a write
    /// goes through.
    #[test]
    fn a_copy_that_cannot_be_written_is_tried_again_and_counted_behind() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        std::fs::write(dir.path().join("mesh.yaml"), EVERYTHING).unwrap();
        // A file where the copies' directory goes: no copy can be written.
        std::fs::create_dir_all(&state).unwrap();
        std::fs::write(state.join(copy::COPIES_DIR), "in the way").unwrap();
        let metrics = crate::metrics::Metrics::new();
        let behind = || metric_in(&metrics.encode(), "lattice_mesh_file_copies_behind");
        let mut source =
            load_in(dir.path(), Some(&state), Limits::default()).with_metrics(metrics.mesh.clone());
        assert_eq!(behind(), Some(1.0));
        source.write_copy();
        assert_eq!(behind(), Some(1.0), "still behind");
        assert!(source.copy_due().is_some(), "tried again");

        std::fs::remove_file(state.join(copy::COPIES_DIR)).unwrap();
        // Due again at once rather than in 5 s.
        source.copy.as_mut().unwrap().due_now();
        source.write_copy();
        assert_eq!(behind(), Some(0.0));
        assert!(source.copy_due().is_none());
        copy_in(&state);
    }

    /// A metric's value in a `/metrics` page.
    fn metric_in(text: &str, name: &str) -> Option<f64> {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))?
            .trim()
            .parse()
            .ok()
    }

    /// A copy that cannot be used (cut short, or not JSON) is left aside: the file is read.
    #[test]
    fn a_copy_that_cannot_be_used_is_left_aside() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        std::fs::write(dir.path().join("mesh.yaml"), EVERYTHING).unwrap();
        let mut read = load_in(dir.path(), Some(&state), Limits::default());
        read.write_copy();
        let copy = copy_in(&state);
        let whole = std::fs::read_to_string(&copy).unwrap();
        for broken in [&whole[..whole.len() / 2], "{\"key\": 7}", "\u{0}\u{ff}"] {
            std::fs::write(&copy, broken).unwrap();
            let mut again = load_in(dir.path(), Some(&state), Limits::default());
            assert!(!again.from_copy(), "{broken:.80}");
            assert_eq!(
                again.state.snapshot().services,
                read.state.snapshot().services
            );
        }
    }

    /// What the node's last mesh is made of: a spec written as JSON reads back the same,
    /// whatever it says.
    #[test]
    fn every_spec_reads_back_from_json_as_written() {
        let specs = parse(EVERYTHING).unwrap();
        let text = serde_json::to_string(&specs).unwrap();
        let read: Vec<ServiceSpec> = serde_json::from_str(&text).unwrap();
        assert_eq!(read, specs);
        assert_eq!(read[0].authorization.len(), 2);
        // Not ready: no traffic, but its rules cover it, at the port it serves.
        assert_eq!(
            read[0].unready,
            [(8080, "10.200.0.9:9090".parse().unwrap())]
        );
        assert_eq!(read[0].ports[0].endpoints.len(), 2);
        assert!(
            serde_json::from_str::<Vec<ServiceSpec>>(&text.replace("billing.example", "-x"))
                .is_err(),
            "a host name no source would take"
        );
    }

    pub(super) const GOOD: &str = r#"
services:
  - path: /foo/bar/buzz
    ports:
      - port: 8080
        protocol: http
        targetPort: 9090
    endpoints:
      - address: 10.200.0.3
      - address: 10.200.0.4
  - path: /foo/db
    ports:
      - port: 5432
        protocol: tcp
    endpoints:
      - address: 10.200.0.9
"#;

    #[test]
    fn parses_the_documented_format() {
        let specs = parse(GOOD).unwrap();
        assert_eq!(specs.len(), 2);
        let buzz = &specs[0];
        assert_eq!(buzz.path.as_str(), "/foo/bar/buzz");
        assert_eq!(buzz.ports[0].protocol, Protocol::Http);
        let endpoints: Vec<String> = buzz.ports[0]
            .endpoints
            .addresses()
            .map(|e| e.to_string())
            .collect();
        assert_eq!(endpoints, ["10.200.0.3:9090", "10.200.0.4:9090"]);
        assert!(specs[1].needs_own_address());
    }

    /// Each text is refused with an error that contains its expected part.
    fn refused<const N: usize>(cases: [(String, &str); N]) {
        for (text, expected) in cases {
            let err = parse(&text).unwrap_err();
            assert!(err.contains(expected), "expected {expected:?} in {err:?}");
        }
    }

    const EXTERNAL: &str = r#"
services:
  - path: /ext/payments
    ports:
      - port: 443
      - port: 80
        protocol: http
        targetPort: 8080
    endpoints:
      - address: api.payments.example.com
      - address: API2.payments.example.com.
"#;

    #[test]
    fn host_name_endpoints_make_an_external_service() {
        let specs = parse(EXTERNAL).unwrap();
        let payments = &specs[0];
        assert!(payments.is_external());
        assert_eq!(payments.host_header, HostHeader::Rewrite, "the default");
        let hosts: Vec<Vec<String>> = payments
            .ports
            .iter()
            .map(|p| {
                assert!(p.endpoints.is_empty());
                p.hosts
                    .iter()
                    .map(|h| format!("{}:{}@{}", h.host, h.port, h.provider))
                    .collect()
            })
            .collect();
        assert_eq!(
            hosts,
            [
                [
                    "api.payments.example.com:8080@file:test",
                    "api2.payments.example.com:8080@file:test"
                ],
                [
                    "api.payments.example.com:443@file:test",
                    "api2.payments.example.com:443@file:test"
                ],
            ]
        );
        let keep =
            parse(&EXTERNAL.replace("    ports:", "    hostHeader: keep\n    ports:")).unwrap();
        assert_eq!(keep[0].host_header, HostHeader::Keep);
    }

    #[test]
    fn host_name_endpoints_are_checked() {
        refused([
            (
                EXTERNAL.replace("api.payments", "api_v2.payments"),
                "services[0] (/ext/payments).endpoints[0].address: neither an IP \
                 address nor a host name: \"api_v2.payments.example.com\" is not a host name",
            ),
            (
                EXTERNAL.replace("api.payments.example.com", "10.0.0.999"),
                "the last label is all digits",
            ),
            (
                EXTERNAL.replace("API2.payments.example.com.", "10.0.0.9"),
                "endpoints: 1 IP address(es) and 1 host name(s)",
            ),
            (
                EXTERNAL
                    .replace(
                        "address: api.payments.example.com",
                        "address: api.payments.example.com\n        name: api-0",
                    )
                    .replace(
                        "address: API2.payments.example.com.",
                        "address: API2.payments.example.com.\n        name: api-1",
                    ),
                "endpoints[0]: a host-name endpoint cannot be a named instance",
            ),
            (
                EXTERNAL.replace("    ports:", "    hostHeader: upstream\n    ports:"),
                "hostHeader: unknown host header mode \"upstream\": expected rewrite or keep",
            ),
            (
                GOOD.replace(
                    "  - path: /foo/db",
                    "  - path: /foo/db\n    hostHeader: keep",
                ),
                "services[1] (/foo/db).hostHeader: only a service whose endpoints are host names",
            ),
        ]);
    }

    #[test]
    fn errors_name_the_service_and_field() {
        let cases = [
            (
                GOOD.replace("/foo/db", "/foo/bar/buzz"),
                "duplicate path /foo/bar/buzz",
            ),
            (
                GOOD.replace("10.200.0.9", "10.200.0.300"),
                "services[1] (/foo/db).endpoints[0].address",
            ),
            (
                GOOD.replace("5432", "70000"),
                "services[1] (/foo/db).ports[0].port: 70000 is out of range",
            ),
            (
                GOOD.replace("protocol: tcp", "protocol: udp"),
                "services[1] (/foo/db).ports[0].protocol: unknown protocol \"udp\"",
            ),
            (
                GOOD.replace("targetPort", "targetPrt"),
                "unknown field `targetPrt`",
            ),
            (GOOD.replace("/foo/db", "foo/db"), "services[1].path"),
            (GOOD.replace("9090", "0"), "targetPort: 0 is out of range"),
            ("services: [".to_string(), ""),
        ];
        refused(cases);
    }

    const STATEFUL: &str = r#"
services:
  - path: /data/db
    ports:
      - port: 9042
        name: cql
      - port: 8080
        protocol: http
        targetPort: 8081
    endpoints:
      - address: 10.200.0.10
        name: db-0
      - address: 10.200.0.11
        name: db-1
        ready: false
"#;

    #[test]
    fn named_endpoints_are_the_instances_of_a_stateful_service() {
        let specs = parse(STATEFUL).unwrap();
        let db = &specs[0];
        let instances: Vec<(&str, bool, Vec<String>)> = db
            .instances
            .iter()
            .map(|i| {
                let endpoints = i.endpoints.iter().map(|(p, e)| format!("{p}->{e}"));
                (i.name.as_str(), i.ready, endpoints.collect())
            })
            .collect();
        assert_eq!(
            instances,
            [
                (
                    "db-0",
                    true,
                    vec![
                        "8080->10.200.0.10:8081".to_string(),
                        "9042->10.200.0.10:9042".to_string()
                    ]
                ),
                (
                    "db-1",
                    false,
                    vec![
                        "8080->10.200.0.11:8081".to_string(),
                        "9042->10.200.0.11:9042".to_string()
                    ]
                ),
            ]
        );
        // The load-balanced endpoints are the ready ones; ports keep their names.
        let cql = db.ports.iter().find(|p| p.port == 9042).unwrap();
        assert_eq!(cql.name.as_deref(), Some("cql"));
        let endpoints: Vec<String> = cql.endpoints.addresses().map(|e| e.to_string()).collect();
        assert_eq!(endpoints, ["10.200.0.10:9042"]);
    }

    #[test]
    fn instance_names_are_checked() {
        let cases = [
            (
                STATEFUL.replace("        name: db-0\n", ""),
                "services[0] (/data/db).endpoints: 1 of 2 endpoints have a name",
            ),
            (
                STATEFUL.replace("name: db-1", "name: db-0"),
                "services[0] (/data/db).endpoints[1].name: \"db-0\" is listed twice",
            ),
            (
                STATEFUL.replace("name: db-1", "name: DB_1"),
                "services[0] (/data/db).endpoints[1].name: \"DB_1\" is not a DNS label",
            ),
            (
                STATEFUL.replace("name: cql", "name: c.q.l"),
                "services[0] (/data/db).ports[0].name: \"c.q.l\" is not a DNS label",
            ),
            (STATEFUL.replace("ready: false", "ready: maybe"), "ready"),
        ];
        refused(cases);
    }

    #[test]
    fn a_health_block_sets_the_policy_and_its_errors_name_the_service() {
        let text = GOOD.replace(
            "  - path: /foo/db\n",
            "  - path: /foo/db\n    health:\n      check: {tcp: {}, interval: 2s}\n      outlier: {enabled: false}\n",
        );
        let specs = parse(&text).unwrap();
        assert_eq!(specs[0].health, crate::mesh::HealthPolicy::default());
        let db = &specs[1].health;
        assert_eq!(
            db.check.as_ref().map(|c| c.interval),
            Some(std::time::Duration::from_secs(2))
        );
        assert_eq!(db.outlier, None);
        let err = parse(&text.replace("interval: 2s", "interval: 0s")).unwrap_err();
        assert!(
            err.contains("services[1] (/foo/db).health.check.interval: must be more than 0"),
            "{err}"
        );
    }

    #[test]
    fn clients_name_pods_and_a_bad_one_is_refused_with_its_place() {
        let specs = parse(
            "services:\n- path: /data/db\n  ports: [{port: 5432}]\n  \
             clients: [shop/web-*, shop/batch-0, shop/web-*]\n",
        )
        .unwrap();
        let clients: Vec<&str> = specs[0].clients.iter().map(|c| &**c).collect();
        assert_eq!(clients, ["shop/batch-0", "shop/web-*"]);
        let err = parse("services:\n- path: /data/db\n  ports: [{port: 5432}]\n  clients: [web]\n")
            .unwrap_err();
        assert!(err.contains("services[0] (/data/db).clients[0]"), "{err}");
        assert!(err.contains("<namespace>/<pod name>"), "{err}");
    }

    #[test]
    fn identities_are_spiffe_ids_of_pod_endpoints() {
        let specs = parse(
            "services:\n- path: /shop/web\n  ports: [{port: 8080}]\n  \
             endpoints: [{address: 10.0.0.1}]\n  \
             identities: [spiffe://cluster.local/ns/shop/sa/web, spiffe://cluster.local/ns/shop/sa/web]\n",
        )
        .unwrap();
        let identities: Vec<&str> = specs[0].identities.iter().map(|i| &**i).collect();
        assert_eq!(identities, ["spiffe://cluster.local/ns/shop/sa/web"]);
        let err =
            parse("services:\n- path: /shop/web\n  ports: [{port: 8080}]\n  identities: [web]\n")
                .unwrap_err();
        assert!(
            err.contains("services[0] (/shop/web).identities[0]"),
            "{err}"
        );
        let err = parse(
            "services:\n- path: /ext/api\n  ports: [{port: 443}]\n  \
             endpoints: [{address: api.example.com}]\n  \
             identities: [spiffe://cluster.local/ns/shop/sa/web]\n",
        )
        .unwrap_err();
        assert!(err.contains("host names is outside the mesh"), "{err}");
    }

    #[test]
    fn zones_nodes_and_a_traffic_distribution_are_read_and_checked() {
        let text = GOOD
            .replace(
                "      - address: 10.200.0.3\n",
                "      - address: 10.200.0.3\n        zone: europe-west1-b\n        node: node-1\n",
            )
            .replace(
                "  - path: /foo/bar/buzz\n",
                "  - path: /foo/bar/buzz\n    trafficDistribution: PreferSameZone\n",
            );
        let specs = parse(&text).unwrap();
        let buzz = &specs[0];
        assert_eq!(
            buzz.traffic_distribution,
            TrafficDistribution::PreferSameZone
        );
        assert_eq!(specs[1].traffic_distribution, TrafficDistribution::Any);
        let places: Vec<(Option<&str>, Option<&str>)> = buzz.ports[0]
            .endpoints
            .iter()
            .map(|e| (e.zone.as_deref(), e.node.as_deref()))
            .collect();
        assert_eq!(
            places,
            [(Some("europe-west1-b"), Some("node-1")), (None, None)]
        );
        refused([
            (
                text.replace("PreferSameZone", "preferSameZone"),
                "services[0] (/foo/bar/buzz).trafficDistribution: unknown traffic distribution \"preferSameZone\"",
            ),
            (
                text.replace("europe-west1-b", "\"europe west\""),
                "services[0] (/foo/bar/buzz).endpoints[0].zone: \"europe west\" is not a valid name",
            ),
            (
                text.replace("node-1", "-node"),
                "services[0] (/foo/bar/buzz).endpoints[0].node: \"-node\" is not a valid name",
            ),
        ]);
    }

    /// The watch starts after the load: an edit in between must not be lost.
    #[tokio::test]
    async fn an_edit_between_load_and_watch_is_applied() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mesh.yaml");
        std::fs::write(&path, GOOD).unwrap();
        let source = FileSource::load(
            &path,
            "240.240.0.0/16".parse().unwrap(),
            Limits::default(),
            None,
        )
        .unwrap();
        std::fs::write(&path, GOOD.replace("10.200.0.9", "10.200.0.10")).unwrap();
        let (tx, mut rx) = crate::mesh::provider::channel();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(source.run(tx, shutdown.clone()));
        let edited = tokio::time::timeout(std::time::Duration::from_secs(10), async {
            loop {
                let seen = rx.borrow_and_update().view.clone();
                if let Some(mesh) = seen {
                    let db = &mesh.services[&"/foo/db".parse::<MeshPath>().unwrap()];
                    let endpoints: Vec<String> = db.ports[0]
                        .endpoints
                        .addresses()
                        .map(|e| e.to_string())
                        .collect();
                    if endpoints == ["10.200.0.10:5432"] {
                        return;
                    }
                }
                rx.changed().await.unwrap();
            }
        })
        .await;
        shutdown.cancel();
        task.await.unwrap().unwrap();
        assert!(
            edited.is_ok(),
            "the edit made before the watch started was never applied"
        );
    }

    #[test]
    fn only_an_explicit_empty_list_is_an_empty_mesh() {
        assert!(parse("services: []").unwrap().is_empty());
        // An empty or truncated file is far more likely a write in progress than intent.
        assert!(parse("").is_err());
        assert!(parse("{}").unwrap_err().contains("services"));
    }
}
