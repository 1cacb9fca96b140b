//! The merge rules, I/O-free: provider reports in, one mesh state out.
//!
//! Per service path:
//! - defined by one provider: served as that provider says;
//! - defined by several: served as one service whose ports carry the union of their
//!   endpoints, when their **shape** agrees (the same port numbers with the same protocols,
//!   none of them stateful, and all of them external — endpoints known by host name — or none)
//!   and their routing rules, health policies, traffic distributions and `Host` header modes
//!   do not contradict each other (one may set them, or all the same). External services
//!   unite their host names as others unite their addresses: a port is one Envoy cluster,
//!   which cannot mix host names (resolved by Envoy) with addresses (pushed over EDS), so that
//!   mix is a conflict;
//! - when they disagree, the shape already served wins: providers that still agree with it
//!   keep their endpoints flowing; a provider that disagrees is a conflict (shown on
//!   `/debug/mesh`, counted, logged) and contributes what it last contributed while it agreed,
//!   or nothing if it never did. So a conflicting edit neither flaps the service nor half-merges
//!   into it. Only when no provider agrees with the served shape any more (every one changed
//!   it) does the service take the first provider's new shape.
//!
//! Before the first snapshot there is no served shape: the first provider in rank order sets it.
//! Since the first snapshot is merged only once every provider has reported, it does not depend
//! on the order in which they reported.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use imbl::ordmap::DiffItem;
use lattice_contract::TrapCidrs;
use serde::Serialize;

use super::{CatalogStatus, ProviderStatus};
use crate::mesh::health::HealthPolicy;
use crate::mesh::{
    AddressBook, EndpointSet, InstanceSpec, MeshPath, MeshSnapshot, MeshState, Protocol, Provider,
    ProviderReport, RejectedRoute, Service, ServicePort, ServiceSpec, Stale,
};
use crate::parallel;

/// A service path on which providers disagree.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Conflict {
    pub path: MeshPath,
    /// The providers whose definitions are served.
    pub serving: Vec<Provider>,
    /// The providers left out, and why.
    pub refused: Vec<Refused>,
    /// RFC 3339; unchanged while the same providers stay refused.
    pub since: String,
}

/// What one path merges to: see [`Merger::plan`].
struct Plan {
    /// Every provider's definition of the path, in provider order.
    definitions: Vec<(usize, Arc<Service>)>,
    /// Those that agree on the path's shape (or what agreed before, for one that no longer
    /// does), by provider.
    contributions: BTreeMap<usize, Arc<Service>>,
    refused: Vec<Refused>,
    spec: ServiceSpec,
    /// The mesh holds `spec` already ([`MeshState::holds`]): applying it upserts nothing.
    held: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Refused {
    pub provider: Provider,
    pub reason: String,
    /// Whether what it contributed before the conflict still serves.
    pub kept_previous: bool,
}

struct Slot {
    provider: Provider,
    report: ProviderReport,
}

/// Merges provider reports into one [`MeshState`].
pub struct Merger {
    slots: Vec<Slot>,
    state: MeshState,
    /// Per served path, each contributing provider's definition (by slot): what the served
    /// service was merged from. A fast hash, randomly seeded: a merge of 50k services looks
    /// every path up, and SipHash showed in its profile.
    contributions: HashMap<MeshPath, BTreeMap<usize, Arc<Service>>, foldhash::fast::RandomState>,
    conflicts: BTreeMap<MeshPath, Conflict>,
    /// Whether the first merge has happened (every provider had reported).
    merged: bool,
}

/// Ports and protocols, and whether the service is stateful: what several providers must
/// agree on to be served as one.
#[derive(PartialEq, Eq)]
struct Shape {
    ports: Vec<(u16, Protocol)>,
    stateful: bool,
    /// Its endpoints are host names.
    external: bool,
}

impl Shape {
    fn of(service: &Service) -> Shape {
        Shape {
            ports: service.ports.iter().map(|p| (p.port, p.protocol)).collect(),
            stateful: !service.instances.is_empty(),
            external: service.ports.iter().any(ServicePort::is_external),
        }
    }

    fn describe(&self) -> String {
        let ports: Vec<String> = self
            .ports
            .iter()
            .map(|(port, protocol)| format!("{port}/{protocol}"))
            .collect();
        let kind = match (self.stateful, self.external) {
            (true, _) => "stateful ",
            (false, true) => "external (host-name endpoints) ",
            (false, false) => "",
        };
        format!("{kind}ports [{}]", ports.join(", "))
    }
}

impl Merger {
    pub fn new(trap: TrapCidrs, providers: Vec<Provider>) -> Self {
        Merger {
            slots: providers
                .into_iter()
                .map(|provider| Slot {
                    provider,
                    report: ProviderReport::default(),
                })
                .collect(),
            state: MeshState::new(trap),
            contributions: HashMap::default(),
            conflicts: BTreeMap::new(),
            merged: false,
        }
    }

    /// Addresses start from `book` (restored from the node's record) instead of an empty one;
    /// only before the first merge.
    pub fn with_address_book(mut self, book: AddressBook) -> Self {
        if !self.merged {
            self.state = MeshState::with_address_book(book);
        }
        self
    }

    /// Starts from `specs`, the node's last mesh, served provisionally (see
    /// [`Merger::provisional_snapshot`]) until every provider has reported; only before the
    /// first merge and after the address book is restored, so each service gets its recorded
    /// address back. A service that no longer fits (an address or name it cannot have) is
    /// left out. Returns how many were taken.
    pub fn with_last_mesh(mut self, specs: Vec<ServiceSpec>) -> (Self, usize) {
        if self.merged {
            return (self, 0);
        }
        let mut taken = 0;
        for spec in specs {
            if self.state.upsert(spec).is_ok() {
                taken += 1;
            }
        }
        (self, taken)
    }

    /// Whether every provider has reported and their views were merged.
    pub fn has_merged(&self) -> bool {
        self.merged
    }

    /// The mesh read back from the node, while the providers are still to report: `None` once
    /// they have (or when there was none).
    pub fn provisional_snapshot(&mut self) -> Option<Arc<MeshSnapshot>> {
        if self.merged || self.state.is_empty() {
            return None;
        }
        let mut snapshot = Arc::unwrap_or_clone(self.state.snapshot());
        snapshot.provisional = true;
        Some(Arc::new(snapshot))
    }

    /// The trapped block the mesh's addresses are in.
    pub fn trap(&self) -> &TrapCidrs {
        self.state.address_book().trap()
    }

    /// Who holds which address in the merged mesh.
    pub fn address_book(&self) -> &AddressBook {
        self.state.address_book()
    }

    /// Takes a provider's report. Returns whether the merged mesh may have changed.
    pub fn update(&mut self, slot: usize, report: ProviderReport) -> bool {
        let Some(entry) = self.slots.get_mut(slot) else {
            return false;
        };
        let previous = std::mem::replace(&mut entry.report, report);
        let (old, new) = (previous.view, entry.report.view.clone());
        if !self.merged {
            if self.slots.iter().any(|s| s.report.view.is_none()) {
                return false;
            }
            // Every provider has reported: merge everything, in path order.
            let mut paths: Vec<MeshPath> = self
                .slots
                .iter()
                .filter_map(|s| s.report.view.as_ref())
                .flat_map(|v| v.services.keys().cloned())
                .collect();
            paths.sort();
            paths.dedup();
            // What the node's last mesh held that no provider has any more goes first, so its
            // names and addresses are free for the services that are here.
            let gone: Vec<MeshPath> = self
                .state
                .paths()
                .filter(|path| paths.binary_search(path).is_err())
                .cloned()
                .collect();
            for path in &gone {
                self.state.remove(path);
            }
            // Every path's plan on every core (50k at a large mesh's first merge, the one
            // stretch of an agent's restart where a core idled), then each put in order.
            let plans = parallel::map_on_every_core(&paths, |path| self.plan(path));
            for (path, plan) in paths.iter().zip(plans) {
                self.apply(path, plan);
            }
            self.merged = true;
            self.update_rejected_routes();
            return true;
        }
        let (Some(old), Some(new)) = (old, new) else {
            return false;
        };
        if Arc::ptr_eq(&old, &new) {
            return false;
        }
        let touched: Vec<MeshPath> = old
            .services
            .diff(&new.services)
            .map(|item| match item {
                DiffItem::Add(path, _) | DiffItem::Remove(path, _) => path.clone(),
                DiffItem::Update { new: (path, _), .. } => path.clone(),
            })
            .collect();
        for path in &touched {
            self.merge_path(path);
        }
        if !Arc::ptr_eq(&old.rejected_routes, &new.rejected_routes)
            || !Arc::ptr_eq(&old.refused_paths, &new.refused_paths)
        {
            self.update_rejected_routes();
        }
        true
    }

    /// The merged mesh, once every provider has reported.
    pub fn snapshot(&mut self) -> Option<Arc<MeshSnapshot>> {
        self.merged.then(|| self.state.snapshot())
    }

    pub fn status(&self) -> CatalogStatus {
        CatalogStatus {
            providers: self
                .slots
                .iter()
                .map(|slot| ProviderStatus {
                    name: slot.provider.clone(),
                    synced: slot.report.view.is_some(),
                    services: slot.report.view.as_ref().map_or(0, |v| v.services.len()),
                    stale: slot.report.stale.clone(),
                })
                .collect(),
            conflicts: self.conflicts.values().cloned().collect(),
            addresses: None,
            last_mesh: None,
        }
    }

    fn update_rejected_routes(&mut self) {
        let rejected: Vec<RejectedRoute> = self
            .slots
            .iter()
            .filter_map(|s| s.report.view.as_ref())
            .flat_map(|v| v.rejected_routes.iter().cloned())
            .collect();
        self.state.set_rejected_routes(rejected);
        let refused = self
            .slots
            .iter()
            .filter_map(|s| s.report.view.as_ref())
            .flat_map(|v| v.refused_paths.iter().cloned())
            .collect();
        self.state.set_refused_paths(refused);
    }

    /// Recomputes one path from every provider's current definition of it.
    fn merge_path(&mut self, path: &MeshPath) {
        let plan = self.plan(path);
        self.apply(path, plan);
    }

    /// What one path merges to from every provider's current definition of it, worked out
    /// without changing anything (so many paths' plans can be made at once): `None` when no
    /// provider defines it.
    fn plan(&self, path: &MeshPath) -> Option<Plan> {
        let definitions: Vec<(usize, Arc<Service>)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((i, s.report.view.as_ref()?.services.get(path)?.clone())))
            .collect();
        let (_, first) = definitions.first()?;
        // Before the first merge only the node's last mesh is served, and no proxy was given
        // it: the providers decide the shape as if it were not there.
        let served = self
            .state
            .service(path)
            .filter(|_| self.merged)
            .map(|s| Shape::of(s));
        let shape = match served {
            Some(shape) if definitions.iter().any(|(_, d)| Shape::of(d) == shape) => shape,
            _ => Shape::of(first),
        };
        let previous = self.contributions.get(path);
        let mut contributions: BTreeMap<usize, Arc<Service>> = BTreeMap::new();
        let mut refused = Vec::new();
        for (slot, definition) in &definitions {
            let verdict = agrees(&shape, &contributions, definition);
            let provider = &self.slots[*slot].provider;
            match verdict {
                Ok(()) => {
                    contributions.insert(*slot, definition.clone());
                }
                Err(reason) => {
                    let kept = previous
                        .and_then(|p| p.get(slot))
                        .filter(|before| agrees(&shape, &contributions, before).is_ok());
                    if let Some(before) = kept {
                        contributions.insert(*slot, before.clone());
                    }
                    refused.push(Refused {
                        provider: provider.clone(),
                        reason,
                        kept_previous: kept.is_some(),
                    });
                }
            }
        }
        let spec = merged_spec(path, &shape, &contributions);
        let held = self.state.holds(&spec);
        Some(Plan {
            definitions,
            contributions,
            refused,
            spec,
            held,
        })
    }

    /// Puts a path's [`Merger::plan`] in the merged mesh, and records its conflicts.
    fn apply(&mut self, path: &MeshPath, plan: Option<Plan>) {
        let Some(Plan {
            definitions,
            contributions,
            refused,
            spec,
            held,
        }) = plan
        else {
            self.state.remove(path);
            self.contributions.remove(path);
            self.resolve(path);
            return;
        };
        let upserted = if held {
            Ok(false)
        } else {
            self.state.upsert(spec)
        };
        if let Err(error) = upserted {
            if !self.merged {
                // Not what the node's last mesh said either.
                self.state.remove(path);
            }
            // Unservable as merged (an address or a name it cannot have): what served before
            // keeps serving, and the reason is shown like a conflict.
            let serving = self.serving(self.contributions.get(path));
            let refused = definitions
                .iter()
                .map(|(slot, _)| Refused {
                    provider: self.slots[*slot].provider.clone(),
                    reason: error.to_string(),
                    kept_previous: self.contributions.contains_key(path),
                })
                .collect();
            self.conflict(path, serving, refused);
            return;
        }
        let serving = self.serving(Some(&contributions));
        self.contributions.insert(path.clone(), contributions);
        if refused.is_empty() {
            self.resolve(path);
        } else {
            self.conflict(path, serving, refused);
        }
    }

    fn serving(&self, contributions: Option<&BTreeMap<usize, Arc<Service>>>) -> Vec<Provider> {
        contributions
            .into_iter()
            .flat_map(|c| c.keys())
            .map(|slot| self.slots[*slot].provider.clone())
            .collect()
    }

    fn conflict(&mut self, path: &MeshPath, serving: Vec<Provider>, refused: Vec<Refused>) {
        let refused_by = |c: &Conflict| -> Vec<Provider> {
            c.refused.iter().map(|r| r.provider.clone()).collect()
        };
        let since = match self.conflicts.get(path) {
            Some(old)
                if refused_by(old)
                    == refused
                        .iter()
                        .map(|r| r.provider.clone())
                        .collect::<Vec<_>>() =>
            {
                old.since.clone()
            }
            _ => Stale::now("").since,
        };
        let conflict = Conflict {
            path: path.clone(),
            serving,
            refused,
            since,
        };
        if self.conflicts.get(path) != Some(&conflict) {
            for refused in &conflict.refused {
                tracing::warn!(
                    path = %path,
                    provider = %refused.provider,
                    serving = ?conflict.serving.iter().map(Provider::as_str).collect::<Vec<_>>(),
                    kept_previous = refused.kept_previous,
                    "providers disagree on a service; the served definition stands: {}",
                    refused.reason
                );
            }
            self.conflicts.insert(path.clone(), conflict);
        }
    }

    fn resolve(&mut self, path: &MeshPath) {
        if self.conflicts.remove(path).is_some() {
            tracing::info!(path = %path, "providers agree on the service again");
        }
    }
}

/// Whether `definition` can join `contributions` (those already accepted, in rank order) in a
/// service of `shape`; if not, why.
fn agrees(
    shape: &Shape,
    contributions: &BTreeMap<usize, Arc<Service>>,
    definition: &Service,
) -> Result<(), String> {
    let own = Shape::of(definition);
    if own != *shape {
        return Err(format!(
            "it defines {}, the service is served with {}",
            own.describe(),
            shape.describe()
        ));
    }
    if shape.stateful && !contributions.is_empty() {
        return Err("a stateful service (named instances) comes from one provider".to_string());
    }
    if !definition.routes.is_empty()
        && contributions
            .values()
            .any(|c| !c.routes.is_empty() && c.routes != definition.routes)
    {
        return Err("its routing rules differ from another provider's".to_string());
    }
    if definition.health != HealthPolicy::default()
        && contributions
            .values()
            .any(|c| c.health != HealthPolicy::default() && c.health != definition.health)
    {
        return Err("its health policy differs from another provider's".to_string());
    }
    if !definition.traffic_distribution.is_any()
        && contributions.values().any(|c| {
            !c.traffic_distribution.is_any()
                && c.traffic_distribution != definition.traffic_distribution
        })
    {
        return Err(format!(
            "its traffic distribution {} differs from another provider's",
            definition.traffic_distribution
        ));
    }
    if shape.external
        && contributions
            .values()
            .any(|c| c.host_header != definition.host_header)
    {
        return Err("its Host header mode differs from another provider's".to_string());
    }
    Ok(())
}

/// The one service the contributions make: their shape, endpoints united in rank order, the
/// first port name, routing rules, health policy and traffic distribution any of them sets.
fn merged_spec(
    path: &MeshPath,
    shape: &Shape,
    contributions: &BTreeMap<usize, Arc<Service>>,
) -> ServiceSpec {
    let ports = shape
        .ports
        .iter()
        .map(|&(number, protocol)| {
            let of = || {
                contributions
                    .values()
                    .filter_map(move |c| c.ports.iter().find(|p| p.port == number))
            };
            ServicePort {
                port: number,
                name: of().find_map(|p| p.name.clone()),
                protocol,
                endpoints: if contributions.len() == 1 {
                    of().next().map(|p| p.endpoints.clone()).unwrap_or_default()
                } else {
                    EndpointSet::new(of().flat_map(|p| p.endpoints.iter().cloned()).collect())
                },
                hosts: if contributions.len() == 1 {
                    of().next().map(|p| p.hosts.clone()).unwrap_or_default()
                } else {
                    of().flat_map(|p| p.hosts.iter().cloned()).collect()
                },
            }
        })
        .collect();
    let routes = contributions
        .values()
        .find(|c| !c.routes.is_empty())
        .map(|c| c.routes.clone());
    let health = contributions
        .values()
        .map(|c| &c.health)
        .find(|h| **h != HealthPolicy::default())
        .cloned()
        .unwrap_or_default();
    let traffic_distribution = contributions
        .values()
        .map(|c| c.traffic_distribution)
        .find(|d| !d.is_any())
        .unwrap_or_default();
    let instances = contributions
        .values()
        .flat_map(|c| &c.instances)
        .map(|i| InstanceSpec {
            name: i.name.clone(),
            ready: i.ready,
            endpoints: i.endpoints.clone(),
        })
        .collect();
    let host_header = contributions
        .values()
        .next()
        .map(|c| c.host_header)
        .unwrap_or_default();
    // Every provider may name clients: they add up.
    let clients = contributions
        .values()
        .flat_map(|c| c.clients.iter().cloned())
        .collect();
    // So may identities: a client accepts any of them.
    let identities = contributions
        .values()
        .flat_map(|c| c.identities.iter().cloned())
        .collect();
    // And rules: a deny of any provider holds, and so does the allow list they make together.
    let authorization = contributions
        .values()
        .flat_map(|c| c.authorization.iter().cloned())
        .collect();
    let unready = contributions
        .values()
        .flat_map(|c| c.unready.iter().copied())
        .collect();
    let mut spec = ServiceSpec::new(path.clone(), ports)
        .with_clients(clients)
        .with_identities(identities)
        .with_authorization(authorization)
        .with_unready(unready)
        .with_health(health)
        .with_traffic_distribution(traffic_distribution)
        .with_instances(instances)
        .with_host_header(host_header);
    if let Some(routes) = routes {
        spec.routes = routes;
    }
    spec
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;
    use crate::mesh::{Endpoint, MeshState};

    fn trap() -> TrapCidrs {
        "240.240.0.0/16".parse().unwrap()
    }

    /// A provider's service: `ports` as (port, protocol), each served by `ips` at that port.
    fn service(
        provider: &Provider,
        path: &str,
        ports: &[(u16, Protocol)],
        ips: &[&str],
    ) -> ServiceSpec {
        let ports = ports
            .iter()
            .map(|&(port, protocol)| ServicePort {
                port,
                name: None,
                protocol,
                endpoints: ips
                    .iter()
                    .map(|ip| {
                        Endpoint::new(format!("{ip}:{port}").parse().unwrap(), provider.clone())
                    })
                    .collect(),
                hosts: Default::default(),
            })
            .collect();
        ServiceSpec::new(path.parse().unwrap(), ports)
    }

    /// A provider's whole view, as its source would publish it.
    fn view(specs: Vec<ServiceSpec>) -> ProviderReport {
        let mut state = MeshState::new(trap());
        state.replace_all(specs).unwrap();
        ProviderReport {
            view: Some(state.snapshot()),
            stale: None,
        }
    }

    fn providers() -> (Provider, Provider) {
        (Provider::kubernetes(), Provider::new("file:/etc/mesh.yaml"))
    }

    /// Each port's endpoints as "ip:port@provider", for `path` in the merged mesh.
    fn endpoints(merger: &mut Merger, path: &str) -> Vec<Vec<String>> {
        let mesh = merger.snapshot().expect("merged");
        mesh.services[&path.parse::<MeshPath>().unwrap()]
            .ports
            .iter()
            .map(|p| {
                p.endpoints
                    .iter()
                    .map(|e| format!("{}@{}", e.address, e.provider))
                    .collect()
            })
            .collect()
    }

    const HTTP: (u16, Protocol) = (80, Protocol::Http);

    /// A first merge of many paths (their plans made on every core) gives the mesh, and the
    /// conflicts, that the same views give merged path by path after an empty first merge.
    #[test]
    fn a_large_first_merge_is_the_path_by_path_merge() {
        let (kube, file) = providers();
        let n = 2 * crate::parallel::PARALLEL_FROM + 37;
        let path = |i: usize| format!("/a/s{i}");
        let kube_view: Vec<ServiceSpec> = (0..n)
            .map(|i| service(&kube, &path(i), &[HTTP], &["10.0.0.1"]))
            .collect();
        // Every third path agrees (its endpoints are united); every seventh disagrees.
        let file_view: Vec<ServiceSpec> = (0..n)
            .filter(|i| i % 3 == 0 || i % 7 == 0)
            .map(|i| {
                let port = if i % 7 == 0 {
                    (80, Protocol::Tcp)
                } else {
                    HTTP
                };
                service(&file, &path(i), &[port], &["10.0.0.2"])
            })
            .collect();
        let mut at_once = Merger::new(trap(), vec![kube.clone(), file.clone()]);
        at_once.update(1, view(file_view.clone()));
        at_once.update(0, view(kube_view.clone()));
        let mut path_by_path = Merger::new(trap(), vec![kube, file]);
        path_by_path.update(0, view(vec![]));
        path_by_path.update(1, view(vec![]));
        path_by_path.update(0, view(kube_view));
        path_by_path.update(1, view(file_view));
        let (a, b) = (
            at_once.snapshot().unwrap(),
            path_by_path.snapshot().unwrap(),
        );
        assert_eq!(a.services.len(), n);
        assert_eq!(a.services, b.services);
        let conflicts = |m: &Merger| -> Vec<String> {
            m.status()
                .conflicts
                .iter()
                .map(|c| c.path.to_string())
                .collect()
        };
        assert_eq!(
            conflicts(&at_once).len(),
            (0..n).filter(|i| i % 7 == 0).count()
        );
        assert_eq!(conflicts(&at_once), conflicts(&path_by_path));
    }

    #[test]
    fn nothing_is_published_before_every_provider_reported() {
        let (kube, file) = providers();
        let mut merger = Merger::new(trap(), vec![kube.clone(), file.clone()]);
        assert!(!merger.update(
            1,
            view(vec![service(&file, "/a/web", &[HTTP], &["10.0.0.9"])])
        ));
        assert!(merger.snapshot().is_none());
        assert!(merger.update(0, view(vec![])));
        assert_eq!(
            endpoints(&mut merger, "/a/web"),
            [["10.0.0.9:80@file:/etc/mesh.yaml"]]
        );
        let status = merger.status();
        assert!(status.providers.iter().all(|p| p.synced));
    }

    #[test]
    fn agreeing_providers_unite_their_endpoints_each_named_by_its_provider() {
        let (kube, file) = providers();
        let mut merger = Merger::new(trap(), vec![kube.clone(), file.clone()]);
        merger.update(
            0,
            view(vec![service(
                &kube,
                "/a/web",
                &[HTTP],
                &["10.0.0.1", "10.0.0.2"],
            )]),
        );
        merger.update(
            1,
            view(vec![service(
                &file,
                "/a/web",
                &[HTTP],
                &["10.0.0.9", "10.0.0.1"],
            )]),
        );
        assert_eq!(
            endpoints(&mut merger, "/a/web"),
            [[
                "10.0.0.1:80@kubernetes",
                "10.0.0.2:80@kubernetes",
                "10.0.0.9:80@file:/etc/mesh.yaml"
            ]],
            "an address both report is attributed to the first provider"
        );
        // The file drops its VM: only the file's part changes.
        merger.update(
            1,
            view(vec![service(&file, "/a/web", &[HTTP], &["10.0.0.1"])]),
        );
        assert_eq!(
            endpoints(&mut merger, "/a/web"),
            [["10.0.0.1:80@kubernetes", "10.0.0.2:80@kubernetes"]]
        );
        assert!(merger.status().conflicts.is_empty());
    }

    /// A provider's external service: `port` served by `hosts` on that port.
    fn external(provider: &Provider, path: &str, port: u16, hosts: &[&str]) -> ServiceSpec {
        let mut spec = service(provider, path, &[(port, Protocol::Tcp)], &[]);
        spec.ports[0].hosts = hosts
            .iter()
            .map(|h| crate::mesh::HostEndpoint {
                host: h.parse().unwrap(),
                port,
                provider: provider.clone(),
            })
            .collect();
        spec
    }

    fn host_endpoints(merger: &mut Merger, path: &str) -> Vec<String> {
        let snapshot = merger.snapshot().unwrap();
        snapshot.services[&path.parse::<MeshPath>().unwrap()].ports[0]
            .hosts
            .iter()
            .map(|h| format!("{}:{}@{}", h.host, h.port, h.provider))
            .collect()
    }

    #[test]
    fn external_services_unite_host_names_and_refuse_a_mix_with_addresses() {
        let (kube, file) = providers();
        let mut merger = Merger::new(trap(), vec![kube.clone(), file.clone()]);
        merger.update(
            0,
            view(vec![external(&kube, "/a/db", 5432, &["a.example.com"])]),
        );
        merger.update(
            1,
            view(vec![external(
                &file,
                "/a/db",
                5432,
                &["a.example.com", "b.example.com"],
            )]),
        );
        assert!(merger.status().conflicts.is_empty());
        assert_eq!(
            host_endpoints(&mut merger, "/a/db"),
            [
                "a.example.com:5432@kubernetes",
                "b.example.com:5432@file:/etc/mesh.yaml"
            ],
            "a name both report is kept once, from the first provider"
        );

        // The file turns the service into addresses: one cluster cannot hold both.
        merger.update(
            1,
            view(vec![service(
                &file,
                "/a/db",
                &[(5432, Protocol::Tcp)],
                &["10.0.0.9"],
            )]),
        );
        let conflicts = merger.status().conflicts;
        assert_eq!(conflicts.len(), 1);
        assert!(
            conflicts[0].refused[0].reason.contains("external"),
            "{:?}",
            conflicts[0].refused
        );
        let snapshot = merger.snapshot().unwrap();
        let db = &snapshot.services[&"/a/db".parse::<MeshPath>().unwrap()];
        assert!(db.ports[0].endpoints.is_empty(), "never half-merged");
        assert_eq!(db.ports[0].hosts.len(), 2, "what it served stays");

        // Host header modes must agree too.
        merger.update(
            1,
            view(vec![
                external(&file, "/a/db", 5432, &["b.example.com"])
                    .with_host_header(crate::mesh::HostHeader::Keep),
            ]),
        );
        let conflicts = merger.status().conflicts;
        assert!(
            conflicts[0].refused[0].reason.contains("Host header"),
            "{:?}",
            conflicts[0].refused
        );
    }

    #[test]
    fn a_conflicting_provider_is_reported_and_disturbs_nothing_served() {
        let (kube, file) = providers();
        let mut merger = Merger::new(trap(), vec![kube.clone(), file.clone()]);
        merger.update(
            0,
            view(vec![service(&kube, "/a/web", &[HTTP], &["10.0.0.1"])]),
        );
        merger.update(
            1,
            view(vec![service(&file, "/a/web", &[HTTP], &["10.0.0.9"])]),
        );
        let before = merger.snapshot().unwrap();
        let served = &before.services[&"/a/web".parse::<MeshPath>().unwrap()];

        // The file changes the port: refused, and its VM keeps serving as it did.
        merger.update(
            1,
            view(vec![service(
                &file,
                "/a/web",
                &[(81, Protocol::Http)],
                &["10.0.0.9"],
            )]),
        );
        let after = merger.snapshot().unwrap();
        assert!(Arc::ptr_eq(
            served,
            &after.services[&"/a/web".parse::<MeshPath>().unwrap()]
        ));
        let status = merger.status();
        let [conflict] = &status.conflicts[..] else {
            panic!("{status:?}")
        };
        assert_eq!(conflict.serving, [kube.clone(), file.clone()]);
        assert_eq!(conflict.refused[0].provider, file);
        assert!(conflict.refused[0].kept_previous);
        assert!(
            conflict.refused[0].reason.contains("81/http"),
            "{}",
            conflict.refused[0].reason
        );

        // Kubernetes endpoints keep flowing during the conflict.
        merger.update(
            0,
            view(vec![service(&kube, "/a/web", &[HTTP], &["10.0.0.2"])]),
        );
        assert_eq!(
            endpoints(&mut merger, "/a/web"),
            [["10.0.0.2:80@kubernetes", "10.0.0.9:80@file:/etc/mesh.yaml"]]
        );

        // The file agrees again: resolved.
        merger.update(
            1,
            view(vec![service(&file, "/a/web", &[HTTP], &["10.0.0.8"])]),
        );
        assert!(merger.status().conflicts.is_empty());
        assert_eq!(
            endpoints(&mut merger, "/a/web"),
            [["10.0.0.2:80@kubernetes", "10.0.0.8:80@file:/etc/mesh.yaml"]]
        );
    }

    #[test]
    fn a_provider_that_never_agreed_contributes_nothing_and_a_shape_everyone_left_is_replaced() {
        let (kube, file) = providers();
        let mut merger = Merger::new(trap(), vec![kube.clone(), file.clone()]);
        merger.update(
            0,
            view(vec![service(
                &kube,
                "/a/db",
                &[(5432, Protocol::Tcp)],
                &["10.0.0.1"],
            )]),
        );
        merger.update(
            1,
            view(vec![service(
                &file,
                "/a/db",
                &[(5432, Protocol::Http)],
                &["10.0.0.9"],
            )]),
        );
        assert_eq!(
            endpoints(&mut merger, "/a/db"),
            [["10.0.0.1:5432@kubernetes"]]
        );
        assert!(!merger.status().conflicts[0].refused[0].kept_previous);

        // Both move to 6432/tcp (kube first, then the file): one service again, no conflict.
        merger.update(
            0,
            view(vec![service(
                &kube,
                "/a/db",
                &[(6432, Protocol::Tcp)],
                &["10.0.0.1"],
            )]),
        );
        merger.update(
            1,
            view(vec![service(
                &file,
                "/a/db",
                &[(6432, Protocol::Tcp)],
                &["10.0.0.9"],
            )]),
        );
        assert_eq!(
            endpoints(&mut merger, "/a/db"),
            [[
                "10.0.0.1:6432@kubernetes",
                "10.0.0.9:6432@file:/etc/mesh.yaml"
            ]]
        );
        assert!(merger.status().conflicts.is_empty());

        // Gone from both: gone.
        merger.update(0, view(vec![]));
        merger.update(1, view(vec![]));
        assert!(merger.snapshot().unwrap().services.is_empty());
    }

    #[test]
    fn a_traffic_distribution_set_by_one_provider_holds_and_a_different_one_conflicts() {
        use crate::mesh::TrafficDistribution::{PreferSameNode, PreferSameZone};
        let (kube, file) = providers();
        let distribution = |merger: &mut Merger| {
            let mesh = merger.snapshot().expect("merged");
            mesh.services[&"/a/web".parse::<MeshPath>().unwrap()].traffic_distribution
        };
        let mut merger = Merger::new(trap(), vec![kube.clone(), file.clone()]);
        merger.update(
            0,
            view(vec![service(&kube, "/a/web", &[HTTP], &["10.0.0.1"])]),
        );
        // The file alone sets it: the merged service prefers, with both providers' endpoints.
        merger.update(
            1,
            view(vec![
                service(&file, "/a/web", &[HTTP], &["10.0.0.9"])
                    .with_traffic_distribution(PreferSameZone),
            ]),
        );
        assert_eq!(distribution(&mut merger), PreferSameZone);
        assert!(merger.status().conflicts.is_empty());
        // Kubernetes says the same: still one service.
        merger.update(
            0,
            view(vec![
                service(&kube, "/a/web", &[HTTP], &["10.0.0.1"])
                    .with_traffic_distribution(PreferSameZone),
            ]),
        );
        assert!(merger.status().conflicts.is_empty());
        assert_eq!(
            endpoints(&mut merger, "/a/web"),
            [["10.0.0.1:80@kubernetes", "10.0.0.9:80@file:/etc/mesh.yaml"]]
        );
        // The file changes its mind: a conflict; what it contributed before keeps serving,
        // and so does the distribution.
        merger.update(
            1,
            view(vec![
                service(&file, "/a/web", &[HTTP], &["10.0.0.8"])
                    .with_traffic_distribution(PreferSameNode),
            ]),
        );
        assert_eq!(distribution(&mut merger), PreferSameZone);
        let status = merger.status();
        let [conflict] = &status.conflicts[..] else {
            panic!("{status:?}")
        };
        assert_eq!(conflict.refused[0].provider, file);
        assert!(conflict.refused[0].kept_previous);
        assert!(
            conflict.refused[0].reason.contains("PreferSameNode"),
            "{}",
            conflict.refused[0].reason
        );
        assert_eq!(
            endpoints(&mut merger, "/a/web"),
            [["10.0.0.1:80@kubernetes", "10.0.0.9:80@file:/etc/mesh.yaml"]]
        );
    }

    #[test]
    fn staleness_is_reported_per_provider_and_keeps_the_view() {
        let (kube, file) = providers();
        let mut merger = Merger::new(trap(), vec![kube.clone(), file.clone()]);
        let kube_view = view(vec![service(&kube, "/a/web", &[HTTP], &["10.0.0.1"])]);
        merger.update(0, kube_view.clone());
        merger.update(1, view(vec![]));
        let mut stale = kube_view;
        stale.stale = Some(Stale::now("services watch: connection refused"));
        assert!(!merger.update(0, stale), "the same view: nothing to merge");
        let status = merger.status();
        assert_eq!(
            status.providers[0].stale.as_ref().unwrap().reason,
            "services watch: connection refused"
        );
        assert!(status.providers[1].stale.is_none());
        assert_eq!(
            endpoints(&mut merger, "/a/web"),
            [["10.0.0.1:80@kubernetes"]]
        );
    }

    /// Per port: its number, protocol and endpoints as "ip:port@provider".
    type Ports = Vec<(u16, Protocol, Vec<String>)>;

    /// What the merged mesh serves, without addresses (which depend on what came and went
    /// before: who was first at an address, what was set aside).
    fn served(merger: &mut Merger) -> Vec<(String, Ports)> {
        let mesh = merger.snapshot().expect("merged");
        mesh.services
            .values()
            .map(|s| {
                let ports = s
                    .ports
                    .iter()
                    .map(|p| {
                        let endpoints = p
                            .endpoints
                            .iter()
                            .map(|e| format!("{}@{}", e.address, e.provider));
                        (p.port, p.protocol, endpoints.collect())
                    })
                    .collect();
                (s.path.to_string(), ports)
            })
            .collect()
    }

    const SHAPES: [&[(u16, Protocol)]; 3] = [
        &[HTTP],
        &[(80, Protocol::Tcp)],
        &[HTTP, (81, Protocol::Grpc)],
    ];

    /// Path `/p/s<i>` in one of [`SHAPES`], served by `10.0.0.<host>` for each host.
    fn numbered(provider: &Provider, i: usize, shape: usize, hosts: &BTreeSet<u8>) -> ServiceSpec {
        let ips: Vec<String> = hosts.iter().map(|h| format!("10.0.0.{h}")).collect();
        let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
        service(provider, &format!("/p/s{i}"), SHAPES[shape], &ips)
    }

    fn hosts() -> impl Strategy<Value = BTreeSet<u8>> {
        proptest::collection::btree_set(1u8..6, 0..3)
    }

    /// A provider's view: for each of a few paths, maybe a service with one of a few shapes
    /// and some endpoints.
    fn arbitrary_view(provider: Provider) -> impl Strategy<Value = Vec<ServiceSpec>> {
        let path = proptest::option::of((0..SHAPES.len(), hosts()));
        proptest::collection::vec(path, 4).prop_map(move |paths| {
            let defined = paths.into_iter().enumerate();
            defined
                .filter_map(|(i, path)| {
                    path.map(|(shape, hosts)| numbered(&provider, i, shape, &hosts))
                })
                .collect()
        })
    }

    /// Every provider's view, agreeing: each path has one shape whoever defines it.
    fn agreeing_views() -> impl Strategy<Value = Vec<Vec<ServiceSpec>>> {
        let path = (
            0..SHAPES.len(),
            proptest::collection::vec(proptest::option::of(hosts()), 3),
        );
        proptest::collection::vec(path, 4).prop_map(|paths| {
            let providers = three_providers();
            (0..providers.len())
                .map(|slot| {
                    let defined = paths.iter().enumerate();
                    defined
                        .filter_map(|(i, (shape, by_provider))| {
                            Some(numbered(
                                &providers[slot],
                                i,
                                *shape,
                                by_provider[slot].as_ref()?,
                            ))
                        })
                        .collect()
                })
                .collect()
        })
    }

    fn three_providers() -> Vec<Provider> {
        vec![
            Provider::kubernetes(),
            Provider::new("file:/a"),
            Provider::new("file:/b"),
        ]
    }

    fn arbitrary_views() -> impl Strategy<Value = Vec<Vec<ServiceSpec>>> {
        three_providers()
            .into_iter()
            .map(arbitrary_view)
            .collect::<Vec<_>>()
    }

    fn has_conflicts(merger: &Merger) -> bool {
        !merger.status().conflicts.is_empty()
    }

    #[test]
    fn the_nodes_last_mesh_serves_until_every_provider_reported_and_keeps_what_is_unchanged() {
        let (kube, file) = providers();
        let web = service(&kube, "/shop/web", &[HTTP], &["10.0.0.1"]);
        let gone = service(&kube, "/shop/gone", &[(5432, Protocol::Tcp)], &["10.0.0.2"]);
        let db = service(&kube, "/shop/db", &[(5432, Protocol::Tcp)], &["10.0.0.3"]);
        let (mut merger, taken) = Merger::new(trap(), vec![kube.clone(), file.clone()])
            .with_last_mesh(vec![web.clone(), gone, db]);
        assert_eq!(taken, 3);
        assert!(
            merger.snapshot().is_none(),
            "nothing settled before the providers"
        );
        let last = merger.provisional_snapshot().expect("the last mesh");
        assert!(last.provisional);
        assert_eq!(last.services.len(), 3);

        // The database moved to another port, the gone service is gone, a new one came.
        let db = service(&kube, "/shop/db", &[(5433, Protocol::Tcp)], &["10.0.0.3"]);
        let new = service(&file, "/shop/new", &[HTTP], &["10.0.0.4"]);
        assert!(!merger.update(0, view(vec![web.clone(), db.clone()])));
        assert!(
            merger.provisional_snapshot().is_some(),
            "one provider is still to report"
        );
        assert!(merger.update(1, view(vec![new.clone()])));
        assert!(merger.provisional_snapshot().is_none());
        let settled = merger.snapshot().unwrap();
        assert!(!settled.provisional);
        let paths: Vec<String> = settled.services.keys().map(|p| p.to_string()).collect();
        assert_eq!(paths, ["/shop/db", "/shop/new", "/shop/web"]);
        let path: MeshPath = "/shop/web".parse().unwrap();
        assert!(
            Arc::ptr_eq(&last.services[&path], &settled.services[&path]),
            "an unchanged service is the same value: the translators reuse what they made of it"
        );

        // As if there had been no last mesh.
        let mut fresh = Merger::new(trap(), vec![kube, file]);
        fresh.update(0, view(vec![web, db]));
        fresh.update(1, view(vec![new]));
        assert_eq!(fresh.snapshot().unwrap().services, settled.services);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

        /// The first merged snapshot is the same, addresses included, whatever the order in
        /// which the providers report (and however often they re-report before the last).
        #[test]
        fn the_first_snapshot_does_not_depend_on_report_order(
            views in arbitrary_views(),
            order in Just(vec![0usize, 1, 2]).prop_shuffle(),
            early in proptest::collection::vec((0usize..3, arbitrary_views()), 0..3),
            last in proptest::option::of(arbitrary_views()),
        ) {
            let mut reference = Merger::new(trap(), three_providers());
            for (i, v) in views.iter().enumerate() {
                reference.update(i, view(v.clone()));
            }
            // And whatever the node's last mesh held: it leaves no trace.
            let mut shuffled = Merger::new(trap(), three_providers());
            if let Some(last) = last {
                shuffled = shuffled.with_last_mesh(last.into_iter().flatten().collect()).0;
            }
            // Early reports from a provider that reports again before the merge.
            for (slot, others) in early {
                if slot != order[2] {
                    shuffled.update(slot, view(others[slot].clone()));
                }
            }
            for &slot in &order {
                shuffled.update(slot, view(views[slot].clone()));
            }
            let (a, b) = (reference.snapshot().unwrap(), shuffled.snapshot().unwrap());
            prop_assert_eq!(&a.services, &b.services);
            prop_assert_eq!(reference.status().conflicts.len(), shuffled.status().conflicts.len());
        }

        /// After the first snapshot, providers that end up agreeing converge to the same
        /// mesh whatever they reported on the way and in which order.
        #[test]
        fn agreeing_providers_converge_whatever_the_history(
            initial in arbitrary_views(),
            history in proptest::collection::vec((0usize..3, arbitrary_views()), 0..6),
            last in agreeing_views(),
        ) {
            let mut fresh = Merger::new(trap(), three_providers());
            for (i, v) in last.iter().enumerate() {
                fresh.update(i, view(v.clone()));
            }
            prop_assert!(!has_conflicts(&fresh));
            let mut merger = Merger::new(trap(), three_providers());
            for (i, v) in initial.iter().enumerate() {
                merger.update(i, view(v.clone()));
            }
            for (slot, views) in history {
                merger.update(slot, view(views[slot].clone()));
            }
            for (i, v) in last.iter().enumerate() {
                merger.update(i, view(v.clone()));
            }
            prop_assert!(!has_conflicts(&merger), "{:?}", merger.status().conflicts);
            prop_assert_eq!(served(&mut merger), served(&mut fresh));
        }
    }
}
