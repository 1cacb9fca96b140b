//! Which clusters warm at the client: new to it, or held without endpoints, while their
//! endpoints are there to send ([`Types::plan`] holds listener and route changes back while
//! any does). Followed from when the client holds listeners or routes, and kept up to date by
//! what changed: the assignments between two snapshots, the clusters a response carried, the
//! endpoint subscription when it narrows.

use std::sync::Arc;

use imbl::ordmap::DiffItem;

use super::{Delivery, Types, diff_name};
use crate::xds::snapshot::{NameSet, ResourceMap, ResourceType, XdsResource, XdsSnapshot};

impl Types {
    /// Clusters about to be sent: those new to the client whose endpoints it will subscribe to
    /// warm until it holds them. Kept only once warming is followed (see
    /// [`Types::follow_warming`]).
    pub(super) fn clusters_sent(&mut self, sent: &[Arc<XdsResource>], snapshot: &XdsSnapshot) {
        if self.warming_checked.is_none() {
            return;
        }
        let [clusters, endpoints, ..] = &self.types;
        let assignments = snapshot.of(ResourceType::Endpoint);
        for resource in sent {
            let name = &resource.name;
            if clusters.client.get(name).is_none()
                && endpoints.client.get(name).is_none()
                && assignments.contains_key(name)
            {
                self.warming.insert(name.clone());
            }
        }
    }

    /// The client answered a response of `kind` (`accepted` it or not): the clusters that are
    /// no longer warming for it.
    pub(in crate::xds) fn answered(
        &mut self,
        kind: ResourceType,
        delivery: &Delivery,
        accepted: bool,
    ) {
        if kind == ResourceType::Cluster && accepted && self.warming_checked.is_some() {
            // Its endpoint request naming them is on its way.
            let sent = delivery.carried().map(|r| r.name.clone());
            self.acked_since_endpoints.extend(sent);
        }
        if self.warming.is_empty() {
            return;
        }
        match kind {
            // What it took, or refused while it wanted it (Envoy then gives up waiting).
            ResourceType::Endpoint => {
                let endpoints = &self.types[ResourceType::Endpoint.index()];
                for resource in delivery.carried() {
                    let name = &resource.name;
                    let settled = if accepted {
                        endpoints.client.get(name).is_some()
                    } else {
                        endpoints.interest.wants(name)
                    };
                    if settled {
                        self.warming.remove(name);
                    }
                }
            }
            ResourceType::Cluster => {
                if accepted {
                    for name in &delivery.removed {
                        self.warming.remove(name);
                    }
                } else {
                    let held = &self.types[ResourceType::Cluster.index()].client;
                    for resource in delivery.carried() {
                        if held.get(&resource.name).is_none() {
                            self.warming.remove(&resource.name);
                        }
                    }
                }
                // What it kept warming only while on its way is looked at again.
                let warming = &self.warming;
                let sent = delivery.carried().map(|r| &r.name);
                let recheck = sent.filter(|name| warming.contains(*name)).cloned();
                self.warming_recheck.extend(recheck);
            }
            ResourceType::Listener | ResourceType::Route | ResourceType::Secret => {}
        }
    }

    /// Starts following which clusters warm once something waits on them: the client asked
    /// for listeners or routes and holds some (or reconnected, when it may hold some). Until
    /// then its listeners and routes go at once (see [`Types::plan`]), so a first sync of the
    /// whole mesh keeps no set of every cluster, and looks up nothing per cluster for it. From
    /// then on: the clusters it holds or is being sent whose endpoints it does not hold warm
    /// (see [`Types::clusters_sent`]).
    pub(super) fn follow_warming(&mut self, snapshot: &XdsSnapshot) {
        let [clusters, endpoints, listeners, routes, _secrets] = &self.types;
        let asked = listeners.requested || routes.requested;
        let serving = self.reconnected || listeners.client.len() > 0 || routes.client.len() > 0;
        if self.warming_checked.is_some() || !asked || !serving {
            return;
        }
        let assignments = snapshot.of(ResourceType::Endpoint);
        let on_their_way = self.clusters_on_their_way();
        // Nothing on its way, no endpoint asked for and no cluster acknowledged since: no
        // cluster it holds can lack endpoints it waits for (see `lacks_endpoints`), and the
        // walk over them is skipped. The usual case of a reconnecting proxy that asks for
        // listeners before endpoints: the walk looked up each of 50k clusters (perf).
        let endpoints_unasked = !endpoints.interest.wildcard
            && endpoints.interest.names.is_empty()
            && self.acked_since_endpoints.is_empty();
        if on_their_way.is_empty() && endpoints_unasked {
            self.warming_checked = Some(assignments.clone());
            return;
        }
        // Being sent: its endpoints will be asked for. Held: only if they are, and unless it
        // holds every assignment of the snapshot (the usual end of a sync), when no cluster it
        // holds lacks any.
        let in_flight = clusters
            .in_flight
            .iter()
            .flat_map(|d| d.carried().map(|r| &r.name));
        let all_held = endpoints.client.is_based_on(assignments);
        let held = (!all_held)
            .then(|| clusters.client.names())
            .into_iter()
            .flatten();
        let lacking: Vec<Arc<str>> = in_flight
            .chain(held)
            .filter(|name| self.lacks_endpoints(name, assignments, &on_their_way, true))
            .cloned()
            .collect();
        self.warming.extend(lacking);
        self.warming_checked = Some(assignments.clone());
    }

    /// The clusters of the response in flight.
    fn clusters_on_their_way(&self) -> NameSet {
        let clusters = &self.types[ResourceType::Cluster.index()];
        let sent = clusters.in_flight.iter().flat_map(|d| d.carried());
        sent.map(|r| r.name.clone()).collect()
    }

    /// Whether the cluster `name` warms at the client: it holds it or is being sent it, it
    /// holds none of its endpoints, and they are there to send (in the snapshot, at a version
    /// it did not refuse) or may be by the time it has the cluster (still on its way). With
    /// `asked`, also that it asks for them, or has not said yet (a cluster not acknowledged,
    /// or acknowledged since its last endpoint request): for a cluster not warming already
    /// (one that is stops when its endpoints are not asked for, see
    /// [`Types::endpoints_asked`]).
    fn lacks_endpoints(
        &self,
        name: &Arc<str>,
        assignments: &ResourceMap,
        on_their_way: &NameSet,
        asked: bool,
    ) -> bool {
        let [clusters, endpoints, ..] = &self.types;
        let on_its_way = on_their_way.contains(name);
        let may_ask =
            !asked || self.acked_since_endpoints.contains(name) || endpoints.interest.wants(name);
        // A cluster whose endpoints are not asked for warms only while on its way (held, it
        // is not waited on, see below): known without the ordered lookups into the views and
        // the snapshot, one per cluster a reconnecting proxy holds when it asks for listeners
        // before it asks for endpoints.
        if !may_ask && !on_its_way {
            return false;
        }
        let held = clusters.client.get(name).is_some();
        let to_send = assignments
            .get(name)
            .is_some_and(|a| endpoints.rejected.get(name) != Some(&a.version));
        (held || on_its_way)
            && endpoints.client.get(name).is_none()
            && (to_send || on_its_way)
            && (may_ask || !held)
    }

    /// The client asked for endpoints: a cluster it holds (acknowledged) whose endpoints it
    /// does not ask for is not waited on (a client that never asks would otherwise hold back
    /// its listeners for good).
    /// Looks at every warming cluster only when the subscription may have lost names (or on
    /// the first endpoint request), otherwise at those acknowledged since the last one: a
    /// client repeats its endpoint subscription with every ACK.
    pub(in crate::xds) fn endpoints_asked(&mut self) {
        let acked = std::mem::take(&mut self.acked_since_endpoints);
        let endpoints = &self.types[ResourceType::Endpoint.index()];
        let narrowings = Some(endpoints.interest.narrowings());
        let narrowed = self.warming_narrowings != narrowings;
        self.warming_narrowings = narrowings;
        if self.warming.is_empty() {
            return;
        }
        let [clusters, endpoints, ..] = &self.types;
        let asked =
            |name: &Arc<str>| endpoints.interest.wants(name) || clusters.client.get(name).is_none();
        if narrowed {
            self.warming.retain(asked);
        } else {
            for name in acked {
                if !asked(&name) {
                    self.warming.remove(&name);
                }
            }
        }
    }

    /// Brings `warming` up to date with the assignments that changed since it last was, and
    /// with the clusters acknowledged since: a cluster warms again when the client holds it
    /// without endpoints and its assignment comes (back), and stops when its assignment goes
    /// (but while the cluster is on its way: it may be back before the client answers).
    pub(super) fn check_warming(&mut self, snapshot: &XdsSnapshot) {
        let Some(checked) = &self.warming_checked else {
            return;
        };
        let assignments = snapshot.of(ResourceType::Endpoint);
        let mut changed = Vec::new();
        if !checked.ptr_eq(assignments) {
            changed.extend(checked.diff(assignments).map(|item| match item {
                DiffItem::Add(name, _) => (name.clone(), true),
                other => (diff_name(other), false),
            }));
            self.warming_checked = Some(assignments.clone());
        }
        let recheck = std::mem::take(&mut self.warming_recheck);
        if changed.is_empty() && recheck.is_empty() {
            return;
        }
        let on_their_way = self.clusters_on_their_way();
        let changed = changed
            .into_iter()
            .chain(recheck.into_iter().map(|n| (n, false)));
        for (name, added) in changed {
            if !added && !self.warming.contains(&name) {
                continue;
            }
            if self.lacks_endpoints(&name, assignments, &on_their_way, added) {
                self.warming.insert(name);
            } else {
                self.warming.remove(&name);
            }
        }
    }
}
