//! The routes and grants the agent knows, which parents each touches, and their resolution
//! against the Services of the moment: a parent's rules, backends resolved, and every refusal
//! with its reason.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::super::mapping::{ObjectKey, ServiceEntry};
use super::{BackendRef, GATEWAY_GROUP, GrantEntry, ParentRef, RouteEntry, RouteKey, RouteKind};
use crate::mesh::route::{Backend, BackendTarget, RejectedRoute, RouteRule};

/// What resolution needs to know of a Service: its entry, and whether it holds its mesh path
/// (a Service that lost a path conflict is not in the mesh).
pub type ServiceLookup<'a> = &'a dyn Fn(&ObjectKey) -> Option<(&'a ServiceEntry, bool)>;

/// Every route and grant, and who depends on whom.
#[derive(Debug, Default)]
pub struct RouteIndex {
    routes: BTreeMap<RouteKey, RouteEntry>,
    grants: HashMap<ObjectKey, GrantEntry>,
    /// Parent Service → the routes naming it.
    by_parent: HashMap<ObjectKey, BTreeSet<RouteKey>>,
    /// Backend Service → the routes sending to it.
    by_backend: HashMap<ObjectKey, BTreeSet<RouteKey>>,
}

impl RouteIndex {
    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }

    /// Sets (or, with `None`, deletes) a route; returns the parents whose rules may change.
    pub fn set_route(&mut self, key: RouteKey, entry: Option<RouteEntry>) -> BTreeSet<ObjectKey> {
        let old = match entry {
            Some(entry) => {
                let old = self.routes.insert(key.clone(), entry);
                if self.routes.get(&key) == old.as_ref() {
                    return BTreeSet::new();
                }
                old
            }
            None => self.routes.remove(&key),
        };
        let mut affected = BTreeSet::new();
        if let Some(old) = &old {
            for parent in &old.parents {
                unlink(&mut self.by_parent, &parent.service, &key);
                affected.insert(parent.service.clone());
            }
            for backend in backends(old) {
                unlink(&mut self.by_backend, backend, &key);
            }
        }
        if let Some(new) = self.routes.get(&key) {
            for parent in &new.parents {
                self.by_parent
                    .entry(parent.service.clone())
                    .or_default()
                    .insert(key.clone());
                affected.insert(parent.service.clone());
            }
            for backend in backends(new).cloned().collect::<Vec<_>>() {
                self.by_backend
                    .entry(backend)
                    .or_default()
                    .insert(key.clone());
            }
        }
        affected
    }

    /// Sets (or deletes) a grant; returns the parents whose backends may resolve differently.
    pub fn set_grant(&mut self, key: ObjectKey, entry: Option<GrantEntry>) -> BTreeSet<ObjectKey> {
        let changed = match entry {
            Some(entry) => self.grants.insert(key.clone(), entry.clone()) != Some(entry),
            None => self.grants.remove(&key).is_some(),
        };
        if !changed {
            return BTreeSet::new();
        }
        // Routes from other namespaces that send to this one.
        self.routes
            .iter()
            .filter(|(route, entry)| {
                backends(entry)
                    .any(|b| b.namespace == key.namespace && route.key.namespace != key.namespace)
            })
            .flat_map(|(_, entry)| entry.parents.iter().map(|p| p.service.clone()))
            .collect()
    }

    /// The keys of every route and grant in `scope` (a namespace, or all): for a re-list.
    pub fn route_keys(&self, kind: RouteKind, scope: Option<&str>) -> Vec<RouteKey> {
        self.routes
            .keys()
            .filter(|k| k.kind == kind && scope.is_none_or(|ns| ns == k.key.namespace))
            .cloned()
            .collect()
    }

    pub fn grant_keys(&self, scope: Option<&str>) -> Vec<ObjectKey> {
        self.grants
            .keys()
            .filter(|k| scope.is_none_or(|ns| ns == k.namespace))
            .cloned()
            .collect()
    }

    /// The parents of routes that send to `backend`: their rules resolve it.
    pub fn parents_sending_to(&self, backend: &ObjectKey) -> BTreeSet<ObjectKey> {
        self.by_backend
            .get(backend)
            .into_iter()
            .flatten()
            .filter_map(|key| self.routes.get(key))
            .flat_map(|entry| entry.parents.iter().map(|p| p.service.clone()))
            .collect()
    }

    /// The rules in effect for the Service `parent`, backends resolved.
    pub fn rules_for(&self, parent: &ObjectKey, lookup: ServiceLookup<'_>) -> Vec<RouteRule> {
        let mut rules = Vec::new();
        for key in self.by_parent.get(parent).into_iter().flatten() {
            let Some(entry) = self.routes.get(key) else {
                continue;
            };
            for parent_ref in entry.parents.iter().filter(|p| &p.service == parent) {
                if self.attach(key, entry, parent_ref, lookup).is_err() {
                    continue;
                }
                let Ok(route_rules) = &entry.rules else {
                    continue;
                };
                for rule in route_rules {
                    let mut resolved = rule.rule.clone();
                    resolved.port = parent_ref.port;
                    resolved.backends = rule
                        .backends
                        .iter()
                        .map(|b| Backend {
                            target: self.resolve(key, b, lookup),
                            weight: b.weight,
                        })
                        .collect();
                    rules.push(resolved);
                }
            }
        }
        rules
    }

    /// Every (route, parent) the agent refuses, and why.
    pub fn rejections(&self, lookup: ServiceLookup<'_>) -> Vec<RejectedRoute> {
        let mut out = Vec::new();
        for (key, entry) in &self.routes {
            if let Err(reason) = &entry.rules {
                out.push(RejectedRoute {
                    route: key.to_string(),
                    parent: None,
                    reason: reason.clone(),
                });
                continue;
            }
            for parent in &entry.parents {
                if let Err(reason) = self.attach(key, entry, parent, lookup) {
                    out.push(RejectedRoute {
                        route: key.to_string(),
                        parent: Some(match parent.port {
                            Some(port) => format!("Service {}:{port}", parent.service),
                            None => format!("Service {}", parent.service),
                        }),
                        reason,
                    });
                }
            }
        }
        out
    }

    /// Whether a route may bind to one of its parents, or why not.
    fn attach(
        &self,
        key: &RouteKey,
        entry: &RouteEntry,
        parent: &ParentRef,
        lookup: ServiceLookup<'_>,
    ) -> Result<(), String> {
        if let Err(reason) = &entry.rules {
            return Err(reason.clone());
        }
        if parent.service.namespace != key.key.namespace {
            return Err(format!(
                "consumer routes (a route in another namespace than its parent Service) are not \
                 supported yet; put the route in namespace {}",
                parent.service.namespace
            ));
        }
        let Some((service, holds_path)) = lookup(&parent.service) else {
            return Err(format!(
                "parent Service {} does not exist (or is not in the mesh: an ExternalName \
                 Service without TCP ports, or an invalid path annotation)",
                parent.service
            ));
        };
        if !holds_path {
            return Err(format!(
                "parent Service {} lost its mesh path {} to an older Service",
                parent.service, service.path
            ));
        }
        if let Some(port) = service.ports.iter().find(|p| !p.protocol.is_http()) {
            return Err(format!(
                "parent Service {} has a {} port ({}): routes need a Service whose ports are all \
                 HTTP (one with a TCP port is reached by an address of its own and proxied as TCP)",
                parent.service, port.protocol, port.port
            ));
        }
        if let Some(port) = parent.port
            && !service.ports.iter().any(|p| p.port == port)
        {
            return Err(format!(
                "parent Service {} has no port {port}",
                parent.service
            ));
        }
        if key.kind == RouteKind::Http {
            let overlaps =
                |p: Option<u16>| p.is_none() || parent.port.is_none() || p == parent.port;
            let grpc = self
                .by_parent
                .get(&parent.service)
                .into_iter()
                .flatten()
                .find(|other| {
                    other.kind == RouteKind::Grpc
                        && self.routes.get(other).is_some_and(|e| {
                            e.rules.is_ok()
                                && e.parents
                                    .iter()
                                    .any(|p| p.service == parent.service && overlaps(p.port))
                        })
                });
            if let Some(grpc) = grpc {
                return Err(format!(
                    "{grpc} is attached to the same Service port, and a GRPCRoute takes \
                     precedence over an HTTPRoute (Conflicted)"
                ));
            }
        }
        Ok(())
    }

    fn resolve(
        &self,
        route: &RouteKey,
        backend: &BackendRef,
        lookup: ServiceLookup<'_>,
    ) -> BackendTarget {
        let unresolved = |reason: String| BackendTarget::Unresolved { reason };
        let service = match &backend.service {
            Ok(service) => service,
            Err(reason) => return unresolved(reason.clone()),
        };
        if service.namespace != route.key.namespace && !self.granted(route, service) {
            return unresolved(format!(
                "no ReferenceGrant in namespace {} lets {} in {} refer to Service {}",
                service.namespace,
                route.kind.as_str(),
                route.key.namespace,
                service.name
            ));
        }
        let Some(port) = backend.port else {
            return unresolved(format!("backendRef to Service {service} needs a port"));
        };
        match lookup(service) {
            None => unresolved(format!("no Service {service} in the mesh")),
            Some((_, false)) => {
                unresolved(format!("Service {service} does not hold its mesh path"))
            }
            Some((entry, true)) if entry.ports.iter().any(|p| p.port == port) => {
                BackendTarget::Service {
                    path: entry.path.clone(),
                    port,
                }
            }
            Some(_) => unresolved(format!("Service {service} has no port {port}")),
        }
    }

    /// Whether a ReferenceGrant in the backend's namespace lets `route` refer to it.
    fn granted(&self, route: &RouteKey, backend: &ObjectKey) -> bool {
        self.grants
            .iter()
            .filter(|(key, _)| key.namespace == backend.namespace)
            .any(|(_, grant)| {
                grant.from.iter().any(|(group, kind, namespace)| {
                    group == GATEWAY_GROUP
                        && kind == route.kind.as_str()
                        && *namespace == route.key.namespace
                }) && grant.to.iter().any(|(group, kind, name)| {
                    group.is_empty()
                        && kind == "Service"
                        && name.as_ref().is_none_or(|n| *n == backend.name)
                })
            })
    }
}

fn backends(entry: &RouteEntry) -> impl Iterator<Item = &ObjectKey> {
    entry
        .rules
        .iter()
        .flatten()
        .flat_map(|r| &r.backends)
        .filter_map(|b| b.service.as_ref().ok())
}

fn unlink(map: &mut HashMap<ObjectKey, BTreeSet<RouteKey>>, service: &ObjectKey, route: &RouteKey) {
    if let Some(routes) = map.get_mut(service) {
        routes.remove(route);
        if routes.is_empty() {
            map.remove(service);
        }
    }
}
