//! Resources made of per-service parts, so that a proxy can be given a view of the mesh that
//! holds only the services its pod uses, without the translator building anything per proxy.
//!
//! The capture listener and the route configurations hold one repeated entry per service (a
//! listener filter chain, a virtual host). The translator encodes each service's entries once
//! ([`ServiceParts`]); a resource for any set of services is then its base (every other field)
//! followed by the entries of those services. Protobuf allows it: fields may come in any order,
//! and the entries of a repeated field add up wherever they appear, so the bytes of
//! `base ‖ entry ‖ entry` decode to the base with those entries. Composing a view costs copying
//! the bytes of what it holds, and nothing is decoded or re-encoded.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use bytes::Bytes;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::google::protobuf::Any;
use prost::Message;

use super::resource::{ResourceMap, ResourceType, XdsResource, content_hash};
use crate::identity::{PodKey, PodPattern};

/// `Listener.filter_chains`.
const LISTENER_FILTER_CHAINS: u32 = 3;
/// `RouteConfiguration.virtual_hosts`.
const ROUTE_VIRTUAL_HOSTS: u32 = 2;

/// One encoded entry of a repeated field of a composed resource.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    /// The resource it belongs to: the listener's name, or a route configuration's.
    pub resource: Arc<str>,
    /// Its name within that resource. Services may share an entry (every HTTP service on a
    /// port shares that port's filter chain): a resource holds each key once.
    pub key: Arc<str>,
    /// The field's tag, length and message, as they go on the wire.
    pub entry: Bytes,
}

impl Part {
    /// A listener filter chain.
    pub fn filter_chain(listener: &Arc<str>, key: &str, chain: &impl Message) -> Part {
        Part::new(listener, key, LISTENER_FILTER_CHAINS, chain)
    }

    /// A virtual host of the route configuration `route`.
    pub fn virtual_host(route: &str, key: &str, host: &impl Message) -> Part {
        Part::new(&Arc::from(route), key, ROUTE_VIRTUAL_HOSTS, host)
    }

    /// A virtual host of the route configuration `route`, already encoded (`host`: the
    /// `VirtualHost` message's bytes).
    pub fn virtual_host_encoded(route: &str, key: &str, host: &[u8]) -> Part {
        use prost::encoding::{WireType, encode_key, encode_varint};
        let mut entry = Vec::with_capacity(host.len() + 8);
        encode_key(ROUTE_VIRTUAL_HOSTS, WireType::LengthDelimited, &mut entry);
        encode_varint(host.len() as u64, &mut entry);
        entry.extend_from_slice(host);
        Part {
            resource: Arc::from(route),
            key: Arc::from(key),
            entry: entry.into(),
        }
    }

    fn new(resource: &Arc<str>, key: &str, field: u32, message: &impl Message) -> Part {
        let mut entry = Vec::with_capacity(message.encoded_len() + 8);
        prost::encoding::message::encode(field, message, &mut entry);
        Part {
            resource: resource.clone(),
            key: Arc::from(key),
            entry: entry.into(),
        }
    }
}

/// What one service adds to the resources a proxy holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceParts {
    /// Its clusters; those fed by EDS have an assignment of the same name.
    pub clusters: Vec<Arc<str>>,
    /// Its entries in the capture listener.
    pub chains: Vec<Part>,
    /// Its virtual hosts, in the route configurations of its ports.
    pub virtual_hosts: Vec<Part>,
    /// The services its routing rules send traffic to (their DNS names): a proxy that holds
    /// this service must hold those too.
    pub backends: Vec<Arc<str>>,
    /// Pods whose proxies hold it whether or not they resolve it ([`PodPattern`]s).
    pub clients: Vec<Arc<str>>,
}

/// Every service's parts and the bases they are composed on; shared between snapshots.
#[derive(Clone, Debug, Default)]
pub struct PartsIndex {
    /// By service DNS name, the key proxy scopes use.
    pub services: imbl::OrdMap<Arc<str>, Arc<ServiceParts>>,
    /// The capture listener without filter chains.
    pub listener: Option<ListenerBase>,
    /// The services each client pattern names (few patterns, each naming a few services), so
    /// that a proxy finds what is declared for its pod without looking at every service.
    pub clients: imbl::OrdMap<Arc<str>, imbl::OrdSet<Arc<str>>>,
}

/// The capture listener without its chains, and the chain it gets when no service gives it
/// one (Envoy refuses a listener without chains).
#[derive(Clone, Debug)]
pub struct ListenerBase {
    pub name: Arc<str>,
    pub base: Bytes,
    pub fallback: Part,
}

impl PartsIndex {
    /// Sets a service's parts: one walk down the map, not a removal before the insertion (a
    /// first translation inserts 50k services, each of which the removal looked for in vain).
    /// The clients of the parts replaced are forgotten before the new ones are named.
    pub fn insert(&mut self, service: Arc<str>, parts: ServiceParts) {
        let parts = Arc::new(parts);
        if let Some(old) = self.services.insert(service.clone(), parts.clone()) {
            self.forget_clients(&service, &old);
        }
        for client in &parts.clients {
            self.clients
                .entry(client.clone())
                .or_default()
                .insert(service.clone());
        }
    }

    /// Forgets a service's parts.
    pub fn remove(&mut self, service: &str) {
        if let Some(old) = self.services.remove(service) {
            self.forget_clients(service, &old);
        }
    }

    /// Takes `service` off the clients `old` named.
    fn forget_clients(&mut self, service: &str, old: &ServiceParts) {
        for client in &old.clients {
            if let Some(named) = self.clients.get_mut(client) {
                named.remove(service);
                if named.is_empty() {
                    self.clients.remove(client);
                }
            }
        }
    }

    /// The services whose `clients:` name `pod`.
    pub fn declared_for(&self, pod: &PodKey) -> impl Iterator<Item = &Arc<str>> {
        self.clients
            .iter()
            .filter(|(pattern, _)| {
                pattern
                    .parse::<PodPattern>()
                    .is_ok_and(|pattern| pattern.matches(pod))
            })
            .flat_map(|(_, services)| services.iter())
    }

    /// The services `wanted` names and, transitively, the backends their rules send to; names
    /// the index does not hold are left out.
    pub fn closure<'a>(
        &self,
        wanted: impl IntoIterator<Item = &'a Arc<str>>,
    ) -> BTreeSet<Arc<str>> {
        let mut held = BTreeSet::new();
        let mut next: Vec<Arc<str>> = wanted.into_iter().cloned().collect();
        while let Some(name) = next.pop() {
            if held.contains(&name) {
                continue;
            }
            if let Some((key, parts)) = self.services.get_key_value(&name) {
                held.insert(key.clone());
                next.extend(parts.backends.iter().cloned());
            }
        }
        held
    }

    /// The capture listener holding the chains of `services`.
    pub fn listener<'a>(
        &'a self,
        services: impl IntoIterator<Item = &'a ServiceParts>,
    ) -> Option<Arc<XdsResource>> {
        let base = self.listener.as_ref()?;
        let chains: BTreeMap<&Arc<str>, &Bytes> = services
            .into_iter()
            .flat_map(|s| &s.chains)
            .map(|part| (&part.key, &part.entry))
            .collect();
        let entries: Vec<&Bytes> = if chains.is_empty() {
            vec![&base.fallback.entry]
        } else {
            chains.into_values().collect()
        };
        Some(composed(
            ResourceType::Listener,
            base.name.clone(),
            &base.base,
            entries,
        ))
    }

    /// The route configurations holding the virtual hosts of `services`, one per port any of
    /// them has on the shared address; `only` limits them to these route configurations.
    pub fn route_map<'a>(
        &'a self,
        services: impl IntoIterator<Item = &'a ServiceParts>,
        only: Option<&BTreeSet<Arc<str>>>,
    ) -> ResourceMap {
        // Gathered in order, then each route's hosts sorted and deduplicated at once (the last
        // of a key wins, as in the listener): the services come sorted by name, which the
        // sort takes in one pass, where inserting 50k hosts one by one into a sorted map
        // compared each key about sixteen times.
        let mut by_route: BTreeMap<&Arc<str>, Vec<(&Arc<str>, &Bytes)>> = BTreeMap::new();
        for part in services.into_iter().flat_map(|s| &s.virtual_hosts) {
            if only.is_none_or(|only| only.contains(&part.resource)) {
                by_route
                    .entry(&part.resource)
                    .or_default()
                    .push((&part.key, &part.entry));
            }
        }
        by_route
            .into_iter()
            .map(|(name, hosts)| {
                let hosts: BTreeMap<&Arc<str>, &Bytes> = hosts.into_iter().collect();
                let base = RouteConfiguration {
                    name: name.to_string(),
                    ..RouteConfiguration::default()
                }
                .encode_to_vec();
                let config = composed(
                    ResourceType::Route,
                    name.clone(),
                    &base,
                    hosts.into_values().collect(),
                );
                (name.clone(), config)
            })
            .collect()
    }
}

/// `base ‖ entries`, as a resource whose version is the hash of those bytes like any other's.
fn composed(
    kind: ResourceType,
    name: Arc<str>,
    base: &[u8],
    entries: Vec<&Bytes>,
) -> Arc<XdsResource> {
    let mut value = Vec::with_capacity(base.len() + entries.iter().map(|e| e.len()).sum::<usize>());
    value.extend_from_slice(base);
    for entry in entries {
        value.extend_from_slice(entry);
    }
    Arc::new(XdsResource {
        name,
        version: content_hash(&value),
        body: Any {
            type_url: kind.type_url().to_string(),
            value,
        },
    })
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::config::listener::v3::{FilterChain, Listener};
    use envoy_types::pb::envoy::config::route::v3::VirtualHost;

    use super::*;

    fn host(name: &str) -> VirtualHost {
        VirtualHost {
            name: name.to_string(),
            domains: vec![name.to_string()],
            ..VirtualHost::default()
        }
    }

    fn service(hosts: &[(&str, &str)], backends: &[&str]) -> Arc<ServiceParts> {
        Arc::new(ServiceParts {
            clusters: Vec::new(),
            chains: hosts
                .iter()
                .map(|(route, _)| {
                    let chain = FilterChain {
                        name: (*route).to_string(),
                        ..FilterChain::default()
                    };
                    Part::filter_chain(&Arc::from("out"), route, &chain)
                })
                .collect(),
            virtual_hosts: hosts
                .iter()
                .map(|(route, name)| Part::virtual_host(route, name, &host(name)))
                .collect(),
            backends: backends.iter().map(|b| Arc::from(*b)).collect(),
            clients: Vec::new(),
        })
    }

    fn index() -> PartsIndex {
        let base = Listener {
            name: "out".to_string(),
            ..Listener::default()
        };
        let fallback = FilterChain {
            name: "unassigned".to_string(),
            ..FilterChain::default()
        };
        let name: Arc<str> = Arc::from("out");
        PartsIndex {
            services: [
                ("a", service(&[("http.80", "a:80")], &["b"])),
                (
                    "b",
                    service(&[("http.80", "b:80"), ("http.81", "b:81")], &["c"]),
                ),
                ("c", service(&[("http.81", "c:81")], &[])),
                ("d", service(&[("http.80", "d:80")], &["missing"])),
            ]
            .into_iter()
            .map(|(k, v)| (Arc::from(k), v))
            .collect(),
            clients: Default::default(),
            listener: Some(ListenerBase {
                name: name.clone(),
                base: base.encode_to_vec().into(),
                fallback: Part::filter_chain(&name, "unassigned", &fallback),
            }),
        }
    }

    fn names(set: &BTreeSet<Arc<str>>) -> Vec<&str> {
        set.iter().map(|s| &**s).collect()
    }

    #[test]
    fn the_closure_follows_backends_and_skips_what_does_not_exist() {
        let index = index();
        let wanted: Vec<Arc<str>> = vec![Arc::from("a")];
        assert_eq!(names(&index.closure(&wanted)), ["a", "b", "c"]);
        let wanted: Vec<Arc<str>> = vec![Arc::from("d"), Arc::from("nope")];
        assert_eq!(names(&index.closure(&wanted)), ["d"]);
    }

    #[test]
    fn clients_find_the_services_declared_for_a_pod_and_follow_changes() {
        let mut index = index();
        let parts = |clients: &[&str]| ServiceParts {
            clients: clients.iter().map(|c| Arc::from(*c)).collect(),
            ..ServiceParts::default()
        };
        index.insert(Arc::from("db"), parts(&["shop/web-*", "shop/batch-0"]));
        index.insert(Arc::from("cache"), parts(&["shop/web-*"]));
        let pod = |name: &str| PodKey {
            namespace: "shop".to_string(),
            name: name.to_string(),
        };
        let declared = |index: &PartsIndex, name: &str| -> BTreeSet<String> {
            index
                .declared_for(&pod(name))
                .map(|s| s.to_string())
                .collect()
        };
        assert_eq!(
            declared(&index, "web-1"),
            BTreeSet::from(["cache".into(), "db".into()])
        );
        assert_eq!(declared(&index, "batch-0"), BTreeSet::from(["db".into()]));
        assert!(declared(&index, "other").is_empty());
        // db stops naming web pods; cache goes.
        index.insert(Arc::from("db"), parts(&["shop/batch-0"]));
        index.remove("cache");
        assert!(declared(&index, "web-1").is_empty());
        // What db named before and names still stays.
        assert_eq!(declared(&index, "batch-0"), BTreeSet::from(["db".into()]));
        assert_eq!(index.clients.len(), 1);
    }

    #[test]
    fn composed_resources_decode_to_the_base_with_the_chosen_entries() {
        let index = index();
        let pick = |keys: &[&str]| -> Vec<&ServiceParts> {
            keys.iter().map(|k| &*index.services[*k]).collect()
        };
        let routes = index.route_map(pick(&["a", "b"]), None);
        let decoded: Vec<(String, Vec<String>)> = routes
            .values()
            .map(|r| {
                let config = RouteConfiguration::decode(&r.body.value[..]).unwrap();
                assert_eq!(r.name.as_ref(), config.name);
                assert_eq!(r.body.type_url, ResourceType::Route.type_url());
                (
                    config.name,
                    config.virtual_hosts.into_iter().map(|h| h.name).collect(),
                )
            })
            .collect();
        assert_eq!(
            decoded,
            [
                (
                    "http.80".to_string(),
                    vec!["a:80".to_string(), "b:80".to_string()]
                ),
                ("http.81".to_string(), vec!["b:81".to_string()]),
            ]
        );
        // A shared chain appears once; the version is the content's.
        let listener = index.listener(pick(&["a", "b", "d"])).unwrap();
        let decoded = Listener::decode(&listener.body.value[..]).unwrap();
        assert_eq!(decoded.name, "out");
        let chains: Vec<String> = decoded.filter_chains.into_iter().map(|c| c.name).collect();
        assert_eq!(chains, ["http.80", "http.81"]);
        assert_eq!(
            index.listener(pick(&["b", "a"])).unwrap().version,
            listener.version
        );
        // Nothing: the fallback chain, never no chain.
        let empty = index.listener(pick(&[])).unwrap();
        let decoded = Listener::decode(&empty.body.value[..]).unwrap();
        assert_eq!(decoded.filter_chains.len(), 1);
        assert_eq!(decoded.filter_chains[0].name, "unassigned");
        assert!(index.route_map(pick(&[]), None).is_empty());
    }
}
