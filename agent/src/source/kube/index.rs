//! The Kubernetes index: compact Service and EndpointSlice entries, which Service holds each
//! mesh path, and the [`MeshState`] they feed. Each change recomputes only the Services it
//! touches; a re-list replaces one watch's scope at once, removing what vanished.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;

use k8s_openapi::jiff::Timestamp;
use lattice_contract::TrapCidrs;
use tracing::{debug, info, warn};

use super::KubeSourceError;
use super::authorizations::{AuthorizationEntry, AuthorizationIndex};
use super::mapping::{MappedService, MappedSlice, ObjectKey, ServiceEntry, SliceEntry, SliceSkip};
use super::meshed::MeshedPods;
use super::ownership::{self, PathClaims, PathGrants};
use super::routes::{GrantEntry, RouteEntry, RouteIndex, RouteKey, RouteKind};
use crate::mesh::{
    Endpoint, EndpointSet, HostEndpoint, InstanceSpec, MeshPath, MeshSnapshot, MeshState, Provider,
    RefusedPath, RejectedRoute, ServicePort, ServiceSpec,
};
use crate::parallel;

/// A Service's claim on a path; the smallest claim holds it: a Service's own path before a
/// path claimed by annotation (with `--path-claims granted`), then the oldest, then by
/// namespace/name.
type Claim = (bool, Option<Timestamp>, ObjectKey);

/// Who may claim which path ([`ownership`]), and where the grants come from.
#[derive(Debug, Clone, Default)]
pub struct Ownership {
    pub claims: PathClaims,
    pub grants: PathGrants,
    /// The grants ConfigMap, `namespace/name`, as refusals name it.
    pub grants_from: String,
}

/// Keyed by what the API server names: a fast hash, randomly seeded (SipHash, in
/// applying a 50k-service list: about 6% of it).
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
type Set<K> = HashSet<K, foldhash::fast::RandomState>;

#[derive(Debug)]
pub struct MeshIndex {
    services: Map<ObjectKey, ServiceEntry>,
    slices: Map<ObjectKey, SliceEntry>,
    /// Service → names of its slices (same namespace).
    slices_of: Map<ObjectKey, BTreeSet<String>>,
    claims: Map<MeshPath, BTreeSet<Claim>>,
    ownership: Ownership,
    /// Services whose path their namespace may not claim, and why.
    refused: BTreeMap<ObjectKey, (MeshPath, String)>,
    /// Paths more than one Service claims.
    contested: BTreeSet<MeshPath>,
    /// The claims changed since the refusals were last worked out.
    claims_changed: bool,
    /// Slices skipped as not IPv4, so each is logged once.
    skipped: Set<ObjectKey>,
    routes: RouteIndex,
    /// What was refused of the routes at the last snapshot, to log changes once.
    rejected: Vec<RejectedRoute>,
    mesh: MeshState,
    /// Paths to recompute in the mesh at the next snapshot, each once, in the order they were
    /// first touched: a list touches each Service twice, once for itself and once for its
    /// slices (about 0.1 s of CPU at 50k services when each touch recomputed).
    stale: Vec<MeshPath>,
    /// The paths in `stale`, to mark each once.
    stale_set: Set<MeshPath>,
    changed: bool,
    /// The pods that take mesh mTLS, when the agent serves certificates: a Service all of
    /// whose endpoints are such pods is called over mTLS.
    meshed: Option<MeshedPods>,
    /// The `MeshAuthorization`s, by the Service each attaches to.
    authorizations: AuthorizationIndex,
}

impl MeshIndex {
    pub fn new(trap: TrapCidrs, ownership: Ownership) -> Self {
        MeshIndex {
            services: Map::default(),
            slices: Map::default(),
            slices_of: Map::default(),
            claims: Map::default(),
            ownership,
            refused: BTreeMap::new(),
            contested: BTreeSet::new(),
            claims_changed: false,
            skipped: Set::default(),
            routes: RouteIndex::default(),
            rejected: Vec::new(),
            mesh: MeshState::new(trap),
            stale: Vec::new(),
            stale_set: HashSet::default(),
            changed: true,
            meshed: None,
            authorizations: AuthorizationIndex::default(),
        }
    }

    /// A `MeshAuthorization` came or changed, or (`None`) went.
    pub fn set_authorization(&mut self, key: ObjectKey, entry: Option<AuthorizationEntry>) {
        let affected = self.authorizations.set(key, entry);
        self.refresh_services(affected.into_iter().collect());
    }

    /// Makes the `MeshAuthorization`s in `scope` exactly `listed`: a re-list, or (empty) the
    /// CRD going away.
    pub fn replace_authorizations(
        &mut self,
        scope: Option<&str>,
        listed: Vec<(ObjectKey, AuthorizationEntry)>,
    ) {
        let keep: HashSet<&ObjectKey> = listed.iter().map(|(k, _)| k).collect();
        let gone: Vec<ObjectKey> = self
            .authorizations
            .keys(scope)
            .into_iter()
            .filter(|k| !keep.contains(k))
            .collect();
        for key in gone {
            self.set_authorization(key, None);
        }
        for (key, entry) in listed {
            self.set_authorization(key, Some(entry));
        }
    }

    /// Follows which pods take mesh mTLS, their identities in `trust_domain`.
    pub fn with_meshed_pods(mut self, trust_domain: &str) -> Self {
        self.meshed = Some(MeshedPods::new(trust_domain));
        self
    }

    /// A meshed pod came or changed (`account`: its service account), or went (`None`).
    pub fn set_meshed_pod(&mut self, key: &ObjectKey, account: Option<&str>) {
        if let Some(meshed) = &mut self.meshed {
            meshed.set(key, account);
        }
    }

    /// Makes the meshed pods in `scope` (a namespace, or all) exactly `listed`: a re-list.
    pub fn replace_meshed_pods(
        &mut self,
        scope: Option<&str>,
        listed: Vec<(ObjectKey, Option<Arc<str>>)>,
    ) {
        if let Some(meshed) = &mut self.meshed {
            meshed.replace(scope, listed);
        }
    }

    /// Recomputes the Services with an endpoint whose pod came, went or changed identity
    /// since the last time: one pass over the endpoints' pod hashes per batch of changes.
    fn refresh_meshed(&mut self) {
        let Some(changed) = self.meshed.as_mut().map(MeshedPods::take_changed) else {
            return;
        };
        if changed.is_empty() {
            return;
        }
        let affected: BTreeSet<ObjectKey> = self
            .slices
            .iter()
            .filter(|(_, slice)| {
                slice
                    .endpoints
                    .iter()
                    .filter_map(|e| e.pod)
                    .chain(slice.named.iter().filter_map(|e| e.pod))
                    .any(|pod| changed.contains(&pod))
            })
            .map(|(key, slice)| ObjectKey::new(key.namespace.as_str(), slice.service.as_str()))
            .collect();
        self.refresh_services(affected);
    }

    pub fn apply_mapped_service(&mut self, key: ObjectKey, mapped: MappedService) {
        let entry = match mapped {
            Ok(entry) => {
                if entry.is_none() {
                    debug!(service = %key, "skipping ExternalName service without TCP ports");
                }
                entry
            }
            Err(err) => {
                warn!("skipping service: {err}");
                None
            }
        };
        self.set_service(key, entry);
    }

    pub fn delete_service(&mut self, key: ObjectKey) {
        self.set_service(key, None);
    }

    pub fn apply_mapped_slice(&mut self, key: ObjectKey, mapped: MappedSlice) {
        match mapped {
            Ok(entry) => {
                self.skipped.remove(&key);
                self.set_slice(key, Some(entry));
            }
            Err(skip) => {
                if self.skipped.insert(key.clone()) {
                    match skip {
                        SliceSkip::AddressType(family) => info!(
                            slice = %key,
                            "ignoring {family} EndpointSlice: the trapped mesh is IPv4 only"
                        ),
                        SliceSkip::NoService => debug!(
                            slice = %key,
                            "ignoring EndpointSlice without a service-name label"
                        ),
                    }
                }
                self.set_slice(key, None);
            }
        }
    }

    pub fn delete_slice(&mut self, key: ObjectKey) {
        self.skipped.remove(&key);
        self.set_slice(key, None);
    }

    /// Makes the Services in `scope` (a namespace, or all) exactly `listed`: a re-list.
    pub fn replace_services(
        &mut self,
        scope: Option<&str>,
        listed: Vec<(ObjectKey, MappedService)>,
    ) {
        let gone = gone_from(self.services.keys(), scope, &listed);
        // Removals first, so a path a vanished Service held is free for a listed one.
        for key in gone {
            self.delete_service(key);
        }
        // Room for the list at once: growing through 50k Services rehashed the map several
        // times in an agent restart's busiest second (perf).
        self.services
            .reserve(listed.len().saturating_sub(self.services.len()));
        for (key, mapped) in listed {
            self.apply_mapped_service(key, mapped);
        }
    }

    /// Makes the EndpointSlices in `scope` (a namespace, or all) exactly `listed`: a re-list.
    pub fn replace_slices(&mut self, scope: Option<&str>, listed: Vec<(ObjectKey, MappedSlice)>) {
        let gone = gone_from(self.slices.keys().chain(&self.skipped), scope, &listed);
        for key in gone {
            self.delete_slice(key);
        }
        self.slices
            .reserve(listed.len().saturating_sub(self.slices.len()));
        // Most Services have one slice.
        self.slices_of
            .reserve(listed.len().saturating_sub(self.slices_of.len()));
        for (key, mapped) in listed {
            self.apply_mapped_slice(key, mapped);
        }
    }

    pub fn apply_route(&mut self, key: RouteKey, entry: RouteEntry) {
        let affected = self.routes.set_route(key, Some(entry));
        self.refresh_services(affected);
    }

    pub fn delete_route(&mut self, key: RouteKey) {
        let affected = self.routes.set_route(key, None);
        self.refresh_services(affected);
    }

    /// Makes the routes of `kind` in `scope` exactly `listed`: a re-list, or (empty) the
    /// route kind's CRD going away.
    pub fn replace_routes(
        &mut self,
        kind: RouteKind,
        scope: Option<&str>,
        listed: Vec<(RouteKey, RouteEntry)>,
    ) {
        let keep: HashSet<&RouteKey> = listed.iter().map(|(k, _)| k).collect();
        let gone: Vec<RouteKey> = self
            .routes
            .route_keys(kind, scope)
            .into_iter()
            .filter(|k| !keep.contains(k))
            .collect();
        for key in gone {
            self.delete_route(key);
        }
        for (key, entry) in listed {
            self.apply_route(key, entry);
        }
    }

    pub fn apply_grant(&mut self, key: ObjectKey, entry: GrantEntry) {
        let affected = self.routes.set_grant(key, Some(entry));
        self.refresh_services(affected);
    }

    pub fn delete_grant(&mut self, key: ObjectKey) {
        let affected = self.routes.set_grant(key, None);
        self.refresh_services(affected);
    }

    pub fn replace_grants(&mut self, scope: Option<&str>, listed: Vec<(ObjectKey, GrantEntry)>) {
        let keep: HashSet<&ObjectKey> = listed.iter().map(|(k, _)| k).collect();
        let gone: Vec<ObjectKey> = self
            .routes
            .grant_keys(scope)
            .into_iter()
            .filter(|k| !keep.contains(k))
            .collect();
        for key in gone {
            self.delete_grant(key);
        }
        for (key, entry) in listed {
            self.apply_grant(key, entry);
        }
    }

    /// Sets the path grants (none when their ConfigMap is absent): every Service's claim is
    /// judged again.
    pub fn set_grants(&mut self, grants: PathGrants) {
        if self.ownership.grants == grants {
            return;
        }
        self.ownership.grants = grants;
        if self.ownership.claims == PathClaims::Any {
            return;
        }
        let services: Vec<(ObjectKey, ServiceEntry)> = self
            .services
            .iter()
            .map(|(k, e)| (k.clone(), e.clone()))
            .collect();
        for (key, entry) in services {
            self.unclaim(&key, &entry);
            self.claim(&key, &entry);
            self.refresh(&entry.path);
        }
    }

    /// How many paths the next snapshot recomputes.
    pub fn stale_count(&self) -> usize {
        self.stale.len()
    }

    /// A snapshot to publish, if anything changed since the last one taken.
    pub fn take_snapshot(&mut self) -> Option<Arc<MeshSnapshot>> {
        self.refresh_meshed();
        self.update_rejections();
        self.update_refused_paths();
        self.recompute_stale();
        if !self.changed {
            return None;
        }
        self.changed = false;
        Some(self.mesh.snapshot())
    }

    /// Works out what is refused of the routes now, logs what changed (one line per route
    /// and parent that is newly refused or no longer is) and hands it to the mesh.
    fn update_rejections(&mut self) {
        if self.routes.is_empty() && self.rejected.is_empty() {
            return;
        }
        let lookup = |key: &ObjectKey| self.lookup(key);
        let mut rejected = self.routes.rejections(&lookup);
        rejected.sort();
        if rejected == self.rejected {
            return;
        }
        for gone in self.rejected.iter().filter(|r| !rejected.contains(r)) {
            info!(route = %gone.route, parent = gone.parent.as_deref().unwrap_or("-"), "route no longer refused");
        }
        for new in rejected.iter().filter(|r| !self.rejected.contains(r)) {
            warn!(route = %new.route, parent = new.parent.as_deref().unwrap_or("-"), reason = %new.reason, "route refused; it is ignored");
        }
        self.mesh.set_rejected_routes(rejected.clone());
        self.rejected = rejected;
        self.changed = true;
    }

    /// Works out which Services are left out for their path, when a claim changed.
    fn update_refused_paths(&mut self) {
        if !std::mem::take(&mut self.claims_changed) {
            return;
        }
        let mut refused: Vec<RefusedPath> = self
            .refused
            .iter()
            .map(|(key, (path, reason))| RefusedPath {
                service: key.to_string(),
                path: path.to_string(),
                reason: reason.clone(),
            })
            .collect();
        for path in &self.contested {
            let Some(claims) = self.claims.get(path) else {
                continue;
            };
            let mut claims = claims.iter();
            let Some((_, _, owner)) = claims.next() else {
                continue;
            };
            for (_, _, loser) in claims {
                refused.push(RefusedPath {
                    service: loser.to_string(),
                    path: path.to_string(),
                    reason: format!(
                        "held by Service {owner} (its own path, or else the oldest claim wins)"
                    ),
                });
            }
        }
        self.mesh.set_refused_paths(refused);
        self.changed = true;
    }

    /// Puts the Service's claim on its path, or records why it may not have it.
    fn claim(&mut self, key: &ObjectKey, entry: &ServiceEntry) {
        self.claims_changed = true;
        let Ownership {
            claims,
            grants,
            grants_from,
        } = &self.ownership;
        if let Err(reason) = ownership::may_claim(*claims, grants, grants_from, key, &entry.path) {
            warn!(service = %key, path = %entry.path, "mesh path refused: {reason}");
            self.refused
                .insert(key.clone(), (entry.path.clone(), reason));
            return;
        }
        let annotated =
            *claims == PathClaims::Granted && !ownership::is_own_path(entry.path.as_str(), key);
        let held = self.claims.entry(entry.path.clone()).or_default();
        held.insert((annotated, entry.created, key.clone()));
        if held.len() > 1 {
            self.contested.insert(entry.path.clone());
            let mut claimants = held.iter().map(|(_, _, k)| k);
            if let Some(owner) = claimants.next() {
                for loser in claimants {
                    warn!(
                        "{}",
                        KubeSourceError::PathTaken {
                            path: entry.path.to_string(),
                            service: loser.to_string(),
                            owner: owner.to_string(),
                        }
                    );
                }
            }
        }
    }

    /// Takes the Service's claim (or its refusal) back.
    fn unclaim(&mut self, key: &ObjectKey, entry: &ServiceEntry) {
        self.claims_changed = true;
        self.refused.remove(key);
        if let Some(claims) = self.claims.get_mut(&entry.path) {
            claims.retain(|(_, _, k)| k != key);
            if claims.len() < 2 {
                self.contested.remove(&entry.path);
            }
            if claims.is_empty() {
                self.claims.remove(&entry.path);
            }
        }
    }

    /// A Service and whether it holds its mesh path.
    pub(super) fn lookup(&self, key: &ObjectKey) -> Option<(&ServiceEntry, bool)> {
        let entry = self.services.get(key)?;
        let holds = self
            .claims
            .get(&entry.path)
            .and_then(|claims| claims.first())
            .is_some_and(|(_, _, owner)| owner == key);
        Some((entry, holds))
    }

    fn refresh_services(&mut self, services: BTreeSet<ObjectKey>) {
        for service in services {
            if let Some(path) = self.services.get(&service).map(|s| s.path.clone()) {
                self.refresh(&path);
            }
        }
    }

    pub fn service_count(&self) -> usize {
        self.services.len()
    }

    pub fn endpoint_count(&self) -> usize {
        self.slices.values().map(|s| s.endpoints.len()).sum()
    }

    fn set_service(&mut self, key: ObjectKey, entry: Option<ServiceEntry>) {
        let old = match &entry {
            Some(entry) => self.services.insert(key.clone(), entry.clone()),
            None => self.services.remove(&key),
        };
        if old == entry {
            return;
        }
        if let Some(old) = &old {
            self.unclaim(&key, old);
            if entry.as_ref().is_none_or(|e| e.path != old.path) {
                self.refresh(&old.path);
            }
        }
        if let Some(entry) = &entry {
            self.claim(&key, entry);
            self.refresh(&entry.path);
        }
        // Routes that send to this Service resolve it anew.
        if !self.routes.is_empty() {
            let parents = self.routes.parents_sending_to(&key);
            self.refresh_services(parents);
        }
    }

    fn set_slice(&mut self, key: ObjectKey, entry: Option<SliceEntry>) {
        // Compared where it is held, and moved in, not cloned: a first list's 50k slices are
        // applied one after another while a core idles (perf), so each copy and allocation
        // spared shortens the agent's start.
        let held = self.slices.get(&key);
        if held == entry.as_ref() {
            return;
        }
        let service_of =
            |slice: &SliceEntry| ObjectKey::new(key.namespace.as_str(), &*slice.service);
        let old_service = held.map(service_of);
        let new_service = entry.as_ref().map(service_of);
        let name = key.name.clone();
        match entry {
            Some(entry) => self.slices.insert(key, entry),
            None => self.slices.remove(&key),
        };
        if let Some(service) = &old_service
            && old_service != new_service
        {
            if let Some(names) = self.slices_of.get_mut(service) {
                names.remove(&name);
                if names.is_empty() {
                    self.slices_of.remove(service);
                }
            }
            self.refresh_service(service);
        }
        if let Some(service) = new_service {
            self.refresh_service(&service);
            self.slices_of.entry(service).or_default().insert(name);
        }
    }

    /// Marks the path `service` holds, if it holds one.
    fn refresh_service(&mut self, service: &ObjectKey) {
        if let Some(path) = self.services.get(service).map(|s| s.path.clone()) {
            self.refresh(&path);
        }
    }

    /// Marks `path` for [`Self::recompute`] at the next snapshot.
    fn refresh(&mut self, path: &MeshPath) {
        // Looked up first: a list marks each path twice (its Service, its slices), and the
        // second mark need not copy the path.
        if !self.stale_set.contains(path) {
            self.stale_set.insert(path.clone());
            self.stale.push(path.clone());
        }
    }

    fn recompute_stale(&mut self) {
        let stale = std::mem::take(&mut self.stale);
        self.stale_set.clear();
        // The specs of many paths (a first list's: every Service) on every core, then put in
        // the mesh in order: built one after another, they were most of the one stretch of an
        // agent's start at 50k services where a core idled (perf).
        let specs = parallel::map_on_every_core(&stale, |path| self.owner_spec(path));
        for (path, spec) in stale.iter().zip(specs) {
            self.recompute(path, spec);
        }
    }

    /// The spec of the Service that holds `path`, if one does.
    fn owner_spec(&self, path: &MeshPath) -> Option<ServiceSpec> {
        let (_, _, owner) = self.claims.get(path)?.first()?;
        self.spec(owner)
    }

    /// Puts `spec`, the Service that holds `path` (none: the path is removed), in the mesh.
    fn recompute(&mut self, path: &MeshPath, spec: Option<ServiceSpec>) {
        let changed = match spec {
            Some(spec) => match self.mesh.upsert(spec) {
                Ok(changed) => changed,
                Err(source) => {
                    warn!(
                        "{}",
                        KubeSourceError::Address {
                            path: path.to_string(),
                            source
                        }
                    );
                    self.mesh.remove(path)
                }
            },
            None => self.mesh.remove(path),
        };
        self.changed |= changed;
    }

    /// The mesh spec of one Service: each port's endpoints from every slice of the Service,
    /// at the target port that slice gives for the port's name.
    fn spec(&self, key: &ObjectKey) -> Option<ServiceSpec> {
        let entry = self.services.get(key)?;
        let slices: Vec<&SliceEntry> = self
            .slices_of
            .get(key)
            .into_iter()
            .flatten()
            .filter_map(|name| {
                self.slices
                    .get(&ObjectKey::new(key.namespace.as_str(), name.as_str()))
            })
            .collect();
        let ports = entry
            .ports
            .iter()
            .map(|port| {
                let endpoints = slices
                    .iter()
                    .filter_map(|slice| Some((slice, slice.port_for(port.name.as_deref())?)))
                    .flat_map(|(slice, target)| {
                        slice.endpoints.iter().map(move |e| Endpoint {
                            zone: e.zone.clone(),
                            node: e.node.clone(),
                            hints: e.hints.clone(),
                            ..Endpoint::new(
                                SocketAddr::new(e.ip.into(), target),
                                Provider::kubernetes(),
                            )
                        })
                    })
                    .collect();
                // Clients of an ExternalName Service dial the external name on the Service's
                // own port (Kubernetes ignores targetPort there).
                let hosts = entry
                    .external
                    .iter()
                    .map(|host| HostEndpoint {
                        host: host.clone(),
                        port: port.port,
                        provider: Provider::kubernetes(),
                    })
                    .collect();
                ServicePort {
                    port: port.port,
                    name: port.name.as_deref().map(Arc::from),
                    protocol: port.protocol,
                    endpoints: if entry.external.is_some() {
                        EndpointSet::default()
                    } else {
                        EndpointSet::new(endpoints)
                    },
                    hosts,
                }
            })
            .collect();
        let identities = match &self.meshed {
            Some(meshed) if entry.external.is_none() => {
                meshed.identities(slices.iter().flat_map(|slice| {
                    let named = if entry.headless {
                        &slice.named[..]
                    } else {
                        &[]
                    };
                    slice
                        .endpoints
                        .iter()
                        .map(|e| e.pod)
                        .chain(named.iter().map(|e| e.pod))
                }))
            }
            _ => Vec::new(),
        };
        let port_numbers: Vec<u16> = entry.ports.iter().map(|p| p.port).collect();
        let authorization = match entry.external {
            // An ExternalName Service runs no mesh proxy to enforce rules.
            Some(_) => Vec::new(),
            None => self.authorizations.rules_for(key, &port_numbers),
        };
        // Not ready, so sent nothing, but dialled directly all the same: the service's rules
        // cover them, whichever provider gives the rules.
        let unready = entry
            .ports
            .iter()
            .flat_map(|port| {
                slices.iter().flat_map(move |slice| {
                    let target = slice.port_for(port.name.as_deref());
                    slice.unready.iter().filter_map(move |ip| {
                        Some((port.port, SocketAddr::new((*ip).into(), target?)))
                    })
                })
            })
            .collect();
        let mut spec = ServiceSpec::new(entry.path.clone(), ports)
            .with_identities(identities)
            .with_authorization(authorization)
            .with_unready(unready)
            .with_health(entry.health.clone())
            .with_traffic_distribution(entry.traffic_distribution)
            .with_host_header(entry.host_header);
        if entry.headless {
            spec = spec.with_instances(instances(entry, &slices));
        }
        if self.routes.is_empty() {
            return Some(spec);
        }
        let lookup = |key: &ObjectKey| self.lookup(key);
        Some(spec.with_routes(self.routes.rules_for(key, &lookup)))
    }
}

/// The named instances of a headless Service: each endpoint with a hostname, reaching every
/// port its slice serves. While a pod is replaced two endpoints may briefly share a hostname:
/// the ready one wins, then the one in the first slice by name, so every agent picks alike.
fn instances(entry: &ServiceEntry, slices: &[&SliceEntry]) -> Vec<InstanceSpec> {
    let mut by_name: BTreeMap<&str, InstanceSpec> = BTreeMap::new();
    for slice in slices {
        for named in &slice.named {
            if by_name
                .get(&*named.hostname)
                .is_some_and(|held| held.ready || !named.ready)
            {
                continue;
            }
            let endpoints = entry
                .ports
                .iter()
                .filter_map(|port| {
                    let target = slice.port_for(port.name.as_deref())?;
                    Some((port.port, SocketAddr::new(named.ip.into(), target)))
                })
                .collect();
            by_name.insert(
                &named.hostname,
                InstanceSpec {
                    name: named.hostname.to_string(),
                    ready: named.ready,
                    endpoints,
                },
            );
        }
    }
    by_name.into_values().collect()
}

/// The keys of `held` in `scope` that `listed` no longer has: what a re-list removes. The
/// listed keys are borrowed, not copied (a first list of 50k Services copied every key into a
/// set of its own), and nothing is looked up when the index holds nothing yet.
fn gone_from<'a, T>(
    held: impl Iterator<Item = &'a ObjectKey>,
    scope: Option<&str>,
    listed: &[(ObjectKey, T)],
) -> Vec<ObjectKey> {
    let mut held = held.filter(|k| in_scope(scope, k)).peekable();
    if held.peek().is_none() {
        return Vec::new();
    }
    let keep: HashSet<&ObjectKey, foldhash::fast::RandomState> =
        listed.iter().map(|(k, _)| k).collect();
    held.filter(|k| !keep.contains(k)).cloned().collect()
}

fn in_scope(scope: Option<&str>, key: &ObjectKey) -> bool {
    scope.is_none_or(|ns| ns == key.namespace)
}
