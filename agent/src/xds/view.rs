//! A proxy's view of a snapshot: only the services its pod uses and the services their routing
//! rules send to. It shares the snapshot's resources (nothing is copied but the listener's and
//! route configurations' bytes for what the view holds), and follows a new snapshot by what
//! changed in it, so an endpoint change costs a proxy that does not hold the service a lookup.

use std::collections::BTreeSet;
use std::sync::Arc;

use imbl::ordmap::DiffItem;

use super::snapshot::{NameSet, ResourceMap, ResourceType, TYPES, XdsSnapshot};
use crate::identity::PodKey;

#[derive(Debug, Default)]
pub(super) struct View {
    /// The services it holds.
    services: BTreeSet<Arc<str>>,
    /// Their clusters (and assignments, which have the same names).
    clusters: NameSet,
    /// The snapshot it was last made from, and what it made.
    source: Option<Arc<XdsSnapshot>>,
    made: Option<Arc<XdsSnapshot>>,
}

impl View {
    /// The services the view holds.
    pub(super) fn services(&self) -> impl Iterator<Item = &Arc<str>> {
        self.services.iter()
    }

    /// The resources of `snapshot` a proxy holds whose pod, `pod`, uses `wanted` (service DNS
    /// names): those, the services whose `clients:` name the pod, and their routes' backends.
    pub(super) fn update(
        &mut self,
        snapshot: &Arc<XdsSnapshot>,
        wanted: &BTreeSet<Arc<str>>,
        pod: Option<&PodKey>,
    ) -> Arc<XdsSnapshot> {
        let declared = pod
            .into_iter()
            .flat_map(|pod| snapshot.parts.declared_for(pod));
        let services = snapshot.parts.closure(wanted.iter().chain(declared));
        let (source, made) = match (&self.source, &self.made) {
            (Some(source), Some(made)) if services == self.services => (source, made),
            _ => return self.rebuild(snapshot, services),
        };
        if Arc::ptr_eq(source, snapshot) {
            return made.clone();
        }
        let parts_changed = !source.parts.services.ptr_eq(&snapshot.parts.services)
            && source
                .parts
                .services
                .diff(&snapshot.parts.services)
                .any(|d| services.contains(diff_key(&d)));
        if parts_changed {
            return self.rebuild(snapshot, services);
        }
        // The same services with the same parts: only their clusters' and assignments'
        // content can differ.
        let mut resources = made.resources.clone();
        for kind in [ResourceType::Cluster, ResourceType::Endpoint] {
            let (old, new) = (source.of(kind), snapshot.of(kind));
            if old.ptr_eq(new) {
                continue;
            }
            let held = &mut resources[kind.index()];
            for change in old.diff(new) {
                let name = diff_key(&change);
                if !self.clusters.contains(name) {
                    continue;
                }
                match new.get_key_value(name) {
                    Some((key, resource)) => held.insert(key.clone(), resource.clone()),
                    None => held.remove(name),
                };
            }
        }
        self.remember(snapshot, resources)
    }

    fn rebuild(
        &mut self,
        snapshot: &Arc<XdsSnapshot>,
        services: BTreeSet<Arc<str>>,
    ) -> Arc<XdsSnapshot> {
        let parts: Vec<_> = services
            .iter()
            .filter_map(|s| snapshot.parts.services.get(s))
            .map(|p| &**p)
            .collect();
        self.clusters = parts
            .iter()
            .flat_map(|p| p.clusters.iter().cloned())
            .collect();
        let mut resources: [ResourceMap; TYPES] = Default::default();
        for kind in [ResourceType::Cluster, ResourceType::Endpoint] {
            let all = snapshot.of(kind);
            resources[kind.index()] = self
                .clusters
                .iter()
                .filter_map(|name| all.get_key_value(name))
                .map(|(key, resource)| (key.clone(), resource.clone()))
                .collect();
        }
        if let Some(listener) = snapshot.parts.listener(parts.iter().copied()) {
            resources[ResourceType::Listener.index()] =
                ResourceMap::unit(listener.name.clone(), listener);
        }
        resources[ResourceType::Route.index()] =
            snapshot.parts.route_map(parts.iter().copied(), None);
        self.services = services;
        self.remember(snapshot, resources)
    }

    fn remember(
        &mut self,
        snapshot: &Arc<XdsSnapshot>,
        resources: [ResourceMap; TYPES],
    ) -> Arc<XdsSnapshot> {
        let made = Arc::new(XdsSnapshot {
            version: snapshot.version,
            resources,
            parts: Default::default(),
            changed_at: snapshot.changed_at,
            indexes: Default::default(),
            inbound: snapshot.inbound.clone(),
        });
        self.source = Some(snapshot.clone());
        self.made = Some(made.clone());
        made
    }
}

fn diff_key<'a, V>(change: &DiffItem<'a, 'a, Arc<str>, V>) -> &'a Arc<str> {
    match change {
        DiffItem::Add(name, _) | DiffItem::Remove(name, _) => name,
        DiffItem::Update { new: (name, _), .. } => name,
    }
}

#[cfg(test)]
mod tests {
    use crate::xds::wire::DeltaRequest;
    use envoy_types::pb::envoy::config::listener::v3::Listener;
    use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
    use prost::Message;

    use super::*;
    use crate::mesh::Protocol;
    use crate::xds::delta::DeltaStream;
    use crate::xds::stream::Ads;
    use crate::xds::testing::{CDS, EDS, LDS, RDS, World};

    fn wanted(names: &[&str]) -> BTreeSet<Arc<str>> {
        names.iter().map(|n| Arc::from(*n)).collect()
    }

    fn keys(map: &ResourceMap) -> Vec<&str> {
        map.keys().map(|k| &**k).collect()
    }

    fn listener_chains(view: &XdsSnapshot) -> Vec<String> {
        let listener = view.of(ResourceType::Listener).values().next().unwrap();
        Listener::decode(&listener.body.value[..])
            .unwrap()
            .filter_chains
            .into_iter()
            .map(|c| c.name)
            .collect()
    }

    fn virtual_hosts(view: &XdsSnapshot) -> Vec<String> {
        view.of(ResourceType::Route)
            .values()
            .flat_map(|r| {
                RouteConfiguration::decode(&r.body.value[..])
                    .unwrap()
                    .virtual_hosts
            })
            .map(|h| h.name)
            .collect()
    }

    const BUZZ: &str = "buzz.bar.foo.system.internal";
    const DB: &str = "db.foo.system.internal";

    fn world() -> (World, Arc<XdsSnapshot>) {
        let mut world = World::new();
        world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.1:80"]);
        world.set("/foo/other", Protocol::Http, &["10.0.0.2:80"]);
        let snapshot = world.set("/foo/db", Protocol::Tcp, &["10.0.0.3:8080"]);
        (world, Arc::new(snapshot))
    }

    #[test]
    fn a_view_holds_only_the_wanted_services_and_follows_their_changes_alone() {
        let (mut world, snapshot) = world();
        let mut view = View::default();
        let made = view.update(
            &snapshot,
            &wanted(&[BUZZ, "nothing.foo.system.internal"]),
            None,
        );
        let buzz = format!("{BUZZ}|8080");
        assert_eq!(keys(made.of(ResourceType::Cluster)), [buzz.as_str()]);
        assert_eq!(keys(made.of(ResourceType::Endpoint)), [buzz.as_str()]);
        assert_eq!(listener_chains(&made), ["http.8080"]);
        assert_eq!(virtual_hosts(&made), [buzz.as_str()]);
        // The whole mesh has more of each.
        assert_eq!(snapshot.of(ResourceType::Cluster).len(), 3);
        assert_eq!(virtual_hosts(&snapshot).len(), 2);

        // Another service's endpoints change: the view's maps stay the very same.
        let next = Arc::new(world.set("/foo/other", Protocol::Http, &["10.0.0.9:80"]));
        let same = view.update(&next, &wanted(&[BUZZ]), None);
        for kind in ResourceType::ALL {
            assert!(same.of(kind).ptr_eq(made.of(kind)), "{kind:?}");
        }
        // Its own change: only its assignment is new.
        let next = Arc::new(world.set("/foo/bar/buzz", Protocol::Http, &["10.0.0.8:80"]));
        let moved = view.update(&next, &wanted(&[BUZZ]), None);
        assert_ne!(
            moved.of(ResourceType::Endpoint)[buzz.as_str()].version,
            made.of(ResourceType::Endpoint)[buzz.as_str()].version
        );
        assert!(
            moved
                .of(ResourceType::Cluster)
                .ptr_eq(made.of(ResourceType::Cluster))
        );

        // A TCP service joins: its cluster and its own chain.
        let grown = view.update(&next, &wanted(&[BUZZ, DB]), None);
        assert_eq!(
            keys(grown.of(ResourceType::Cluster)),
            [buzz.as_str(), &format!("{DB}|8080")]
        );
        assert_eq!(
            listener_chains(&grown),
            ["http.8080", &format!("tcp|{DB}|8080")]
        );
        // It goes from the mesh: out of the view too.
        let gone = Arc::new(world.remove("/foo/db"));
        let shrunk = view.update(&gone, &wanted(&[BUZZ, DB]), None);
        assert_eq!(keys(shrunk.of(ResourceType::Cluster)), [buzz.as_str()]);
    }

    fn delta(type_url: &str, subscribe: &[&str], nonce: &str) -> DeltaRequest {
        DeltaRequest {
            type_url: type_url.to_string(),
            resource_names_subscribe: subscribe.iter().collect(),
            response_nonce: nonce.to_string(),
            ..DeltaRequest::default()
        }
    }

    #[test]
    fn a_stream_holds_its_view_only_once_every_type_is_acknowledged() {
        let (_world, snapshot) = world();
        let mut view = View::default();
        let made = view.update(&snapshot, &wanted(&[BUZZ]), None);
        let mut stream = DeltaStream::default();
        let buzz = format!("{BUZZ}|8080");
        assert!(!stream.holds(&made));
        let ack = |stream: &mut DeltaStream, request: DeltaRequest| {
            let (pushes, _) = stream.on_request(&request, &made);
            pushes
        };
        let cds = ack(&mut stream, delta(CDS, &[], ""));
        assert_eq!(cds.len(), 1);
        assert!(!stream.holds(&made), "CDS in flight");
        assert!(ack(&mut stream, delta(CDS, &[], &cds[0].response.nonce)).is_empty());
        assert!(!stream.holds(&made), "the assignment is not subscribed yet");
        let eds = ack(&mut stream, delta(EDS, &[&buzz], ""));
        ack(&mut stream, delta(EDS, &[], &eds[0].response.nonce));
        let lds = ack(&mut stream, delta(LDS, &[], ""));
        ack(&mut stream, delta(LDS, &[], &lds[0].response.nonce));
        assert!(
            !stream.holds(&made),
            "the route configuration is not subscribed yet"
        );
        let rds = ack(&mut stream, delta(RDS, &["http.8080"], ""));
        assert!(!stream.holds(&made), "RDS in flight");
        ack(&mut stream, delta(RDS, &[], &rds[0].response.nonce));
        assert!(stream.holds(&made));
    }
}
