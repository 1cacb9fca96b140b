//! Services and EndpointSlices as the source reads them off the wire: only the fields the
//! mapping reads, under the API's own names, so that the watches of `kube::runtime` list and
//! watch them as they would k8s-openapi's types.
//!
//! k8s-openapi's types decode every field of every object into owned strings, maps and
//! vectors, only for the mapping to read a few of them and drop the rest with the page. In a
//! profile of a 50k-service restart, decoding and dropping them was the largest part of
//! listing. Here serde skips every field not named below without allocating, as it skips the
//! fields an API server adds that no client asked for (`managedFields`, kubectl's
//! last-applied annotation, a newer API's fields); the labels and annotations kept are only
//! those the mapping reads; an endpoint's addresses are read straight into IPv4 addresses.
//!
//! Where a field is missing or `null`, it reads as absent, as the mapping then treats it; only
//! a value of the wrong JSON type fails an object.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::net::Ipv4Addr;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};

use crate::in_place;
use crate::source::health::HEALTH_ANNOTATION;

/// The annotation that places a Service at a mesh path of its choosing.
pub const PATH_ANNOTATION: &str = "lattice.mlab.com/path";
/// The annotation that keeps the client's `Host` on requests to an ExternalName Service
/// (`keep`), instead of the default `rewrite` to the external name.
pub const HOST_HEADER_ANNOTATION: &str = "lattice.mlab.com/host-header";
/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// A Service: its metadata (with the annotations the mapping reads) and its spec.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ServiceObject {
    #[serde(default, deserialize_with = "meta::<NoKeys, ServiceAnnotations, _>")]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: Option<ServiceFields>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceFields {
    #[serde(rename = "type")]
    pub type_: Option<String>,
    pub external_name: Option<String>,
    #[serde(rename = "clusterIP")]
    pub cluster_ip: Option<String>,
    pub ports: Option<Vec<ServicePortFields>>,
    pub traffic_distribution: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServicePortFields {
    pub name: Option<String>,
    /// 0 when missing: a port the mapping skips.
    #[serde(default, deserialize_with = "or_default")]
    pub port: i32,
    pub protocol: Option<String>,
    pub app_protocol: Option<String>,
}

/// An EndpointSlice: its metadata (with the label that names its Service), its address type,
/// ports and endpoints.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SliceObject {
    #[serde(default, deserialize_with = "meta::<SliceLabels, NoKeys, _>")]
    pub metadata: ObjectMeta,
    pub address_type: Option<String>,
    pub ports: Option<Vec<SlicePortFields>>,
    pub endpoints: Option<Vec<EndpointFields>>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct SlicePortFields {
    pub name: Option<String>,
    pub port: Option<i32>,
    pub protocol: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointFields {
    pub addresses: Option<Addresses>,
    pub conditions: Option<ConditionFields>,
    pub hostname: Option<String>,
    pub zone: Option<String>,
    pub node_name: Option<String>,
    pub hints: Option<HintFields>,
    pub target_ref: Option<TargetRefFields>,
}

impl EndpointFields {
    /// The addresses that are IPv4; the mapping skips any other.
    pub fn addresses(&self) -> impl Iterator<Item = Ipv4Addr> + '_ {
        let addresses = self.addresses.as_ref();
        let first = addresses.and_then(|a| a.first.flatten());
        first
            .into_iter()
            .chain(addresses.into_iter().flat_map(|a| a.more.iter().copied()))
    }

    /// The first address, if there is one and it is IPv4: the one a hostname names.
    pub fn first_address(&self) -> Option<Ipv4Addr> {
        self.addresses.as_ref()?.first?
    }

    /// Whether the endpoint is a pod's, and if so the pod's name.
    pub fn pod_name(&self) -> Option<&str> {
        let target = self.target_ref.as_ref()?;
        target.kind?.0.then_some(target.name.as_deref()?)
    }
}

/// An endpoint's addresses, each read straight into an IPv4 address: the first as it came
/// (`None` when not IPv4), then the other IPv4 ones. EndpointSlice controllers write one
/// address per endpoint (the API allows up to 100, all of one pod), which is read with no
/// allocation.
#[derive(Clone, Debug, Default)]
pub struct Addresses {
    first: Option<Option<Ipv4Addr>>,
    more: Vec<Ipv4Addr>,
}

impl<'de> Deserialize<'de> for Addresses {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct List;
        impl<'de> Visitor<'de> for List {
            type Value = Addresses;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of addresses")
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Addresses, A::Error> {
                let mut addresses = Addresses {
                    first: seq.next_element::<Address>()?.map(|a| a.0),
                    more: Vec::new(),
                };
                while let Some(Address(address)) = seq.next_element()? {
                    addresses.more.extend(address);
                }
                Ok(addresses)
            }
        }
        deserializer.deserialize_seq(List)
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct ConditionFields {
    pub ready: Option<bool>,
    pub terminating: Option<bool>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HintFields {
    pub for_zones: Option<Vec<NameField>>,
    pub for_nodes: Option<Vec<NameField>>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct NameField {
    #[serde(default, deserialize_with = "or_default")]
    pub name: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct TargetRefFields {
    pub kind: Option<IsPod>,
    pub name: Option<String>,
}

/// Whether a kind is `Pod`, read without a string of its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IsPod(pub bool);

impl<'de> Deserialize<'de> for IsPod {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        in_place::read_str(deserializer, "a kind", |kind| IsPod(kind == "Pod"))
    }
}

/// An endpoint's address: IPv4, or `None` for anything else (the mapping skips it), read
/// without a string of its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Address(Option<Ipv4Addr>);

impl<'de> Deserialize<'de> for Address {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        in_place::read_str(deserializer, "an address", |text| {
            Address(text.parse().ok())
        })
    }
}

/// `null` read as the type's default, as a missing field is.
fn or_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// Which keys of a string map (labels, annotations) the mapping reads; the others are
/// skipped unread.
trait Keys {
    const KEYS: &'static [&'static str];
}

/// None: a map of which nothing is read.
struct NoKeys;

impl Keys for NoKeys {
    const KEYS: &'static [&'static str] = &[];
}

/// A Service's annotations: its path, host header and health.
struct ServiceAnnotations;

impl Keys for ServiceAnnotations {
    const KEYS: &'static [&'static str] =
        &[PATH_ANNOTATION, HOST_HEADER_ANNOTATION, HEALTH_ANNOTATION];
}

/// An EndpointSlice's labels: the one naming its Service.
struct SliceLabels;

impl Keys for SliceLabels {
    const KEYS: &'static [&'static str] = &[SERVICE_NAME_LABEL];
}

/// The metadata fields the source reads: identity, resourceVersion (the watches' own
/// bookkeeping), creation time (which of two claims wins) and the kept labels and annotations.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
#[serde(bound = "")]
struct MetaFields<L: Keys, A: Keys> {
    name: Option<String>,
    namespace: Option<String>,
    resource_version: Option<String>,
    creation_timestamp: Option<Time>,
    #[serde(default)]
    labels: Option<Entries<L>>,
    #[serde(default)]
    annotations: Option<Entries<A>>,
}

/// The metadata, with the labels `L` and the annotations `A` names.
fn meta<'de, L: Keys, A: Keys, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<ObjectMeta, D::Error> {
    let Some(fields) = Option::<MetaFields<L, A>>::deserialize(deserializer)? else {
        return Ok(ObjectMeta::default());
    };
    Ok(ObjectMeta {
        name: fields.name,
        namespace: fields.namespace,
        resource_version: fields.resource_version,
        creation_timestamp: fields.creation_timestamp,
        labels: fields.labels.map(|entries| entries.kept),
        annotations: fields.annotations.map(|entries| entries.kept),
        ..ObjectMeta::default()
    })
}

/// A string map of which only the entries under `S::KEYS` are kept; every other value is
/// skipped unread.
struct Entries<S> {
    kept: BTreeMap<String, String>,
    keys: PhantomData<S>,
}

impl<'de, S: Keys> Deserialize<'de> for Entries<S> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Map<S>(PhantomData<S>);
        impl<'de, S: Keys> Visitor<'de> for Map<S> {
            type Value = Entries<S>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map of strings")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entries<S>, A::Error> {
                let mut kept = BTreeMap::new();
                while let Some(key) = map.next_key::<Key<S>>()? {
                    match key.0 {
                        Some(key) => {
                            let value: Option<String> = map.next_value()?;
                            kept.insert(key.to_owned(), value.unwrap_or_default());
                        }
                        None => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(Entries {
                    kept,
                    keys: PhantomData,
                })
            }
        }
        deserializer.deserialize_map(Map(PhantomData))
    }
}

/// A map key: one of `S::KEYS`, or `None` for any other, read without a string of its own.
struct Key<S>(Option<&'static str>, PhantomData<S>);

impl<'de, S: Keys> Deserialize<'de> for Key<S> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        in_place::read_str(deserializer, "a string", |text| {
            Key(
                S::KEYS.iter().copied().find(|key| *key == text),
                PhantomData,
            )
        })
    }
}

/// Both kinds are listed and watched under the URLs, group and version of k8s-openapi's types.
macro_rules! read_as {
    ($object:ty, $api:ty) => {
        impl k8s_openapi::Resource for $object {
            const API_VERSION: &'static str = <$api as k8s_openapi::Resource>::API_VERSION;
            const GROUP: &'static str = <$api as k8s_openapi::Resource>::GROUP;
            const KIND: &'static str = <$api as k8s_openapi::Resource>::KIND;
            const VERSION: &'static str = <$api as k8s_openapi::Resource>::VERSION;
            const URL_PATH_SEGMENT: &'static str =
                <$api as k8s_openapi::Resource>::URL_PATH_SEGMENT;
            type Scope = <$api as k8s_openapi::Resource>::Scope;
        }

        impl k8s_openapi::Metadata for $object {
            type Ty = ObjectMeta;
            fn metadata(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn metadata_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

read_as!(ServiceObject, k8s_openapi::api::core::v1::Service);
read_as!(SliceObject, k8s_openapi::api::discovery::v1::EndpointSlice);

/// Reads an object as the source would read it off the wire: for tests, which build
/// k8s-openapi's objects.
#[cfg(test)]
pub fn read<T: serde::de::DeserializeOwned>(object: &impl serde::Serialize) -> T {
    serde_json::from_value(serde_json::to_value(object).expect("an object serializes"))
        .expect("the source reads what k8s-openapi writes")
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Service;
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::*;

    /// What an API server adds that the mapping never reads, in the places it adds it.
    fn noise() -> Value {
        json!({
            "uid": "0b9d7d3e-6f0a-4f41-9f0e-2f1f0f6a3c11",
            "generation": 3,
            "managedFields": [{
                "manager": "kubectl-client-side-apply",
                "operation": "Update",
                "fieldsType": "FieldsV1",
                "fieldsV1": {"f:metadata": {"f:annotations": {".": {}}}, "f:spec": {}},
            }],
            "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": "x", "uid": "u"}],
        })
    }

    fn with_noise(mut metadata: Value) -> Value {
        for (key, value) in noise().as_object().unwrap() {
            metadata[key] = value.clone();
        }
        metadata
    }

    #[test]
    fn a_service_keeps_only_what_the_mapping_reads() {
        let last_applied = "x".repeat(100_000);
        let object = json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": with_noise(json!({
                "name": "web", "namespace": "shop", "resourceVersion": "42",
                "creationTimestamp": "2024-01-01T00:00:00Z",
                "labels": {"app": "web"},
                "annotations": {
                    "kubectl.kubernetes.io/last-applied-configuration": last_applied,
                    PATH_ANNOTATION: "/shop/front",
                    HEALTH_ANNOTATION: null,
                },
            })),
            "spec": {
                "type": "ClusterIP", "clusterIP": "10.0.0.1", "clusterIPs": ["10.0.0.1"],
                "ports": [{"name": "http", "port": 80, "targetPort": "http", "appProtocol": "http"},
                          {"name": "dns", "port": 53, "protocol": "UDP"}],
                "selector": {"app": "web"},
                "sessionAffinity": "None",
                "trafficDistribution": "PreferClose",
            },
            "status": {"loadBalancer": {}},
        });
        let read: ServiceObject = serde_json::from_value(object).unwrap();
        let meta = &read.metadata;
        assert_eq!(meta.name.as_deref(), Some("web"));
        assert_eq!(meta.namespace.as_deref(), Some("shop"));
        assert_eq!(meta.resource_version.as_deref(), Some("42"));
        assert!(meta.creation_timestamp.is_some());
        assert!(meta.managed_fields.is_none() && meta.uid.is_none());
        assert_eq!(
            meta.labels,
            Some(BTreeMap::new()),
            "no label of a Service is read"
        );
        let annotations = meta.annotations.as_ref().unwrap();
        assert_eq!(
            annotations.iter().collect::<Vec<_>>(),
            [
                (&HEALTH_ANNOTATION.to_owned(), &String::new()),
                (&PATH_ANNOTATION.to_owned(), &"/shop/front".to_owned())
            ]
        );
        let spec = read.spec.unwrap();
        assert_eq!(spec.cluster_ip.as_deref(), Some("10.0.0.1"));
        assert_eq!(spec.traffic_distribution.as_deref(), Some("PreferClose"));
        let ports = spec.ports.unwrap();
        assert_eq!(ports.len(), 2);
        assert_eq!(ports[1].protocol.as_deref(), Some("UDP"));
    }

    #[test]
    fn nulls_and_missing_fields_read_as_absent() {
        let read: SliceObject = serde_json::from_value(json!({
            "metadata": {"name": "s", "labels": null, "annotations": null},
            "addressType": "IPv4",
            "ports": null,
            "endpoints": [{"addresses": ["10.0.0.1", "fd00::1", "10.0.0.2"],
                           "conditions": null, "hints": {"forZones": null},
                           "targetRef": {"kind": "Pod"}}],
        }))
        .unwrap();
        assert_eq!(read.metadata.labels, None);
        assert!(read.ports.is_none());
        let endpoint = &read.endpoints.as_ref().unwrap()[0];
        assert_eq!(
            endpoint.addresses().collect::<Vec<_>>(),
            [Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2)],
            "an address that is not IPv4 is skipped, not an error"
        );
        let empty: SliceObject =
            serde_json::from_value(json!({"metadata": null, "endpoints": null})).unwrap();
        assert!(empty.endpoints.is_none() && empty.metadata.name.is_none());
        let port: ServiceObject =
            serde_json::from_value(json!({"spec": {"ports": [{"port": null}]}})).unwrap();
        assert_eq!(port.spec.unwrap().ports.unwrap()[0].port, 0);
    }

    #[test]
    fn a_value_of_the_wrong_type_fails_the_object() {
        for object in [
            json!({"metadata": {"name": 7}}),
            json!({"metadata": {"annotations": {PATH_ANNOTATION: 7}}}),
            json!({"metadata": {"labels": ["a"]}}),
            json!({"spec": {"ports": [{"port": "80"}]}}),
        ] {
            assert!(
                serde_json::from_value::<ServiceObject>(object.clone()).is_err(),
                "{object}"
            );
        }
        assert!(
            serde_json::from_value::<SliceObject>(json!({"endpoints": [{"addresses": [1]}]}))
                .is_err()
        );
    }

    fn name() -> impl Strategy<Value = String> {
        "[a-z]{1,8}"
    }

    fn maybe<T: std::fmt::Debug + Clone + 'static>(
        value: impl Strategy<Value = T> + 'static,
    ) -> impl Strategy<Value = Option<T>> {
        proptest::option::of(value)
    }

    fn address() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<[u8; 4]>().prop_map(|b| Ipv4Addr::from(b).to_string()),
            Just("fd00::7".to_owned()),
            "[0-9.]{0,16}",
        ]
    }

    fn endpoint() -> impl Strategy<Value = Value> {
        (
            proptest::collection::vec(address(), 0..3),
            maybe((maybe(any::<bool>()), maybe(any::<bool>()))),
            (maybe(name()), maybe(name()), maybe(name())),
            maybe((
                proptest::collection::vec(name(), 0..2),
                proptest::collection::vec(name(), 0..2),
            )),
            maybe((maybe(prop_oneof![Just("Pod"), Just("Node")]), maybe(name()))),
        )
            .prop_map(
                |(addresses, conditions, (hostname, zone, node), hints, target)| {
                    let mut e = json!({"addresses": addresses, "extra": {"a": [1, 2]}});
                    if let Some((ready, terminating)) = conditions {
                        e["conditions"] = json!({"ready": ready, "serving": true,
                                              "terminating": terminating});
                    }
                    e["hostname"] = json!(hostname);
                    e["zone"] = json!(zone);
                    e["nodeName"] = json!(node);
                    if let Some((zones, nodes)) = hints {
                        let named = |names: Vec<String>| -> Value {
                            names
                                .into_iter()
                                .map(|name| json!({"name": name}))
                                .collect()
                        };
                        e["hints"] = json!({"forZones": named(zones), "forNodes": named(nodes)});
                    }
                    if let Some((kind, name)) = target {
                        e["targetRef"] = json!({"kind": kind, "name": name, "uid": "u"});
                    }
                    e
                },
            )
    }

    fn labels() -> impl Strategy<Value = BTreeMap<String, String>> {
        proptest::collection::btree_map(
            prop_oneof![
                Just(SERVICE_NAME_LABEL.to_owned()),
                Just(PATH_ANNOTATION.to_owned()),
                Just(HEALTH_ANNOTATION.to_owned()),
                name()
            ],
            name(),
            0..4,
        )
    }

    fn meta(
        name: String,
        labels: BTreeMap<String, String>,
        notes: BTreeMap<String, String>,
    ) -> Value {
        with_noise(json!({
            "name": name, "namespace": "ns", "resourceVersion": "7",
            "creationTimestamp": "2024-05-06T07:08:09Z",
            "labels": labels, "annotations": notes,
        }))
    }

    fn kept(
        map: &Option<BTreeMap<String, String>>,
        keys: &[&str],
    ) -> Option<BTreeMap<String, String>> {
        map.as_ref().map(|map| {
            map.iter()
                .filter(|(key, _)| keys.contains(&key.as_str()))
                .map(|(key, value)| (key.clone(), value.clone()))
                .collect()
        })
    }

    /// Identity, version, creation time and the kept entries, as k8s-openapi reads them.
    fn same_meta<L: Keys, A: Keys>(read: &ObjectMeta, full: &ObjectMeta) {
        assert_eq!(read.name, full.name);
        assert_eq!(read.namespace, full.namespace);
        assert_eq!(read.resource_version, full.resource_version);
        assert_eq!(read.creation_timestamp, full.creation_timestamp);
        assert_eq!(read.labels, kept(&full.labels, L::KEYS));
        assert_eq!(read.annotations, kept(&full.annotations, A::KEYS));
    }

    proptest! {
        /// Every field the mapping reads is what k8s-openapi's EndpointSlice reads from the
        /// same JSON.
        #[test]
        fn a_slice_reads_as_k8s_openapi_reads_it(
            name in name(),
            labels in labels(),
            notes in labels(),
            address_type in prop_oneof![Just("IPv4"), Just("IPv6"), Just("FQDN")],
            ports in proptest::collection::vec(
                (maybe(name()), maybe(0..70000i32), maybe(prop_oneof![Just("TCP"), Just("UDP")])),
                0..3,
            ),
            endpoints in proptest::collection::vec(endpoint(), 0..4),
        ) {
            let ports: Vec<Value> = ports
                .into_iter()
                .map(|(name, port, protocol)| json!({"name": name, "port": port,
                                                    "protocol": protocol}))
                .collect();
            let object = json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": meta(name, labels, notes),
                "addressType": address_type, "ports": ports, "endpoints": endpoints,
            });
            let full: EndpointSlice = serde_json::from_value(object.clone()).unwrap();
            let read: SliceObject = serde_json::from_value(object).unwrap();
            same_meta::<SliceLabels, NoKeys>(&read.metadata, &full.metadata);
            prop_assert_eq!(read.address_type.as_deref(), Some(full.address_type.as_str()));
            let read_ports = read.ports.unwrap_or_default();
            let full_ports = full.ports.unwrap_or_default();
            prop_assert_eq!(read_ports.len(), full_ports.len());
            for (read, full) in read_ports.iter().zip(&full_ports) {
                prop_assert_eq!(&read.name, &full.name);
                prop_assert_eq!(read.port, full.port);
                prop_assert_eq!(&read.protocol, &full.protocol);
            }
            let read_endpoints = read.endpoints.unwrap_or_default();
            prop_assert_eq!(read_endpoints.len(), full.endpoints.len());
            for (read, full) in read_endpoints.iter().zip(&full.endpoints) {
                let addresses: Vec<Ipv4Addr> =
                    full.addresses.iter().filter_map(|a| a.parse().ok()).collect();
                prop_assert_eq!(read.addresses().collect::<Vec<_>>(), addresses);
                prop_assert_eq!(
                    read.first_address(),
                    full.addresses.first().and_then(|a| a.parse().ok())
                );
                let conditions = full.conditions.as_ref();
                let read_conditions = read.conditions.as_ref();
                prop_assert_eq!(
                    read_conditions.and_then(|c| c.ready),
                    conditions.and_then(|c| c.ready)
                );
                prop_assert_eq!(
                    read_conditions.and_then(|c| c.terminating),
                    conditions.and_then(|c| c.terminating)
                );
                prop_assert_eq!(&read.hostname, &full.hostname);
                prop_assert_eq!(&read.zone, &full.zone);
                prop_assert_eq!(&read.node_name, &full.node_name);
                let zones = |h: Option<&HintFields>| -> Option<Vec<String>> {
                    h.and_then(|h| h.for_zones.as_ref())
                        .map(|z| z.iter().map(|z| z.name.clone()).collect())
                };
                let nodes = |h: Option<&HintFields>| -> Option<Vec<String>> {
                    h.and_then(|h| h.for_nodes.as_ref())
                        .map(|n| n.iter().map(|n| n.name.clone()).collect())
                };
                let full_hints = full.hints.as_ref();
                prop_assert_eq!(
                    zones(read.hints.as_ref()),
                    full_hints.and_then(|h| h.for_zones.as_ref())
                        .map(|z| z.iter().map(|z| z.name.clone()).collect())
                );
                prop_assert_eq!(
                    nodes(read.hints.as_ref()),
                    full_hints.and_then(|h| h.for_nodes.as_ref())
                        .map(|n| n.iter().map(|n| n.name.clone()).collect())
                );
                let pod = full
                    .target_ref
                    .as_ref()
                    .filter(|r| r.kind.as_deref() == Some("Pod"))
                    .and_then(|r| r.name.as_deref());
                prop_assert_eq!(read.pod_name(), pod);
            }
        }

        /// Every field the mapping reads is what k8s-openapi's Service reads from the same
        /// JSON.
        #[test]
        fn a_service_reads_as_k8s_openapi_reads_it(
            name in name(),
            labels in labels(),
            notes in labels(),
            type_ in maybe(prop_oneof![Just("ClusterIP"), Just("ExternalName")]),
            external in maybe(name()),
            cluster_ip in maybe(prop_oneof![Just("None"), Just("10.1.2.3")]),
            distribution in maybe(name()),
            ports in proptest::collection::vec(
                (maybe(name()), 0..70000i32, maybe(prop_oneof![Just("TCP"), Just("SCTP")]),
                 maybe(name())),
                0..3,
            ),
        ) {
            let ports: Vec<Value> = ports
                .into_iter()
                .map(|(name, port, protocol, app)| json!({"name": name, "port": port,
                     "protocol": protocol, "appProtocol": app, "targetPort": 8080}))
                .collect();
            let object = json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": meta(name, labels, notes),
                "spec": {"type": type_, "externalName": external, "clusterIP": cluster_ip,
                         "trafficDistribution": distribution, "ports": ports,
                         "selector": {"app": "x"}},
            });
            let full: Service = serde_json::from_value(object.clone()).unwrap();
            let read: ServiceObject = serde_json::from_value(object).unwrap();
            same_meta::<NoKeys, ServiceAnnotations>(&read.metadata, &full.metadata);
            let (read, full) = (read.spec.unwrap(), full.spec.unwrap());
            prop_assert_eq!(&read.type_, &full.type_);
            prop_assert_eq!(&read.external_name, &full.external_name);
            prop_assert_eq!(&read.cluster_ip, &full.cluster_ip);
            prop_assert_eq!(&read.traffic_distribution, &full.traffic_distribution);
            let (read_ports, full_ports) = (read.ports.unwrap(), full.ports.unwrap());
            prop_assert_eq!(read_ports.len(), full_ports.len());
            for (read, full) in read_ports.iter().zip(&full_ports) {
                prop_assert_eq!(&read.name, &full.name);
                prop_assert_eq!(read.port, full.port);
                prop_assert_eq!(&read.protocol, &full.protocol);
                prop_assert_eq!(&read.app_protocol, &full.app_protocol);
            }
        }
    }
}
