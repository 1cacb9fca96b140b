//! This node's Pods, for proxy identity: one cluster-wide watch with the field selector
//! `spec.nodeName=<node>`, so the agent holds its own node's pods only (a few hundred at most,
//! whatever the cluster's size), folded into the [`PodDirectory`] the xDS server checks
//! streams against. Nothing is published before the first complete list.

use std::collections::{BTreeMap, HashMap};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::identity::{
    InboundMode, InboundProbe, PodDirectory, PodEntry, PodKey, PodsTx, ProbeKind,
};
use crate::mesh::MeshPath;

/// The services a pod declares it uses, for a workload that connects without resolving their
/// names: mesh paths, separated by commas or spaces. Its Envoy holds them from the start.
pub const USES_ANNOTATION: &str = "lattice.mlab.com/uses";
/// `mesh`: the pod's Envoy holds the whole mesh instead of what the pod uses (`used`, the
/// default).
pub const SCOPE_ANNOTATION: &str = "lattice.mlab.com/scope";

/// `enabled`, as the pod's annotation or label: the pod's inbound TCP is captured to its proxy
/// (`lattice-init --inbound-capture`, which the injector adds unless the annotation says
/// `disabled`, labelling the pod so), so its proxy gets an inbound listener.
pub const INBOUND_CAPTURE_ANNOTATION: &str = "lattice.mlab.com/inbound-capture";
/// `permissive` (the default) or `strict`: whether the pod's inbound listener hands on
/// connections that are not mesh mTLS, or refuses them.
pub const MTLS_MODE_ANNOTATION: &str = "lattice.mlab.com/mtls-mode";

/// The entries of one pod: one per pod IP, while it may run a proxy (it has an IP and has not
/// finished). A pod that is Pending has one as soon as its sandbox is up, which is before its
/// containers start, so its proxy's first connection finds it.
pub fn pod_entries(pod: &Pod) -> Vec<PodEntry> {
    let key = PodKey {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        name: pod.metadata.name.clone().unwrap_or_default(),
    };
    let status = pod.status.as_ref();
    if matches!(
        status.and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    ) {
        return Vec::new();
    }
    let host_network = pod
        .spec
        .as_ref()
        .and_then(|s| s.host_network)
        .unwrap_or(false);
    let mut ips: Vec<&str> = status
        .and_then(|s| s.pod_ips.as_ref())
        .into_iter()
        .flatten()
        .map(|ip| ip.ip.as_str())
        .collect();
    if ips.is_empty() {
        ips.extend(status.and_then(|s| s.pod_ip.as_deref()));
    }
    let (scoped, uses) = scoping(pod, &key);
    let inbound = inbound_mode(pod, &key);
    let probes = if inbound.is_some() {
        probes(pod, &key)
    } else {
        Vec::new()
    };
    let service_account: std::sync::Arc<str> = pod
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.as_deref())
        .filter(|name| !name.is_empty())
        .unwrap_or("default")
        .into();
    ips.into_iter()
        .filter_map(|ip| ip.parse().ok())
        .map(|ip| PodEntry {
            key: key.clone(),
            ip,
            host_network,
            scoped,
            uses: uses.clone(),
            service_account: service_account.clone(),
            inbound,
            probes: probes.clone(),
        })
        .collect()
}

/// The pod's inbound mode when its inbound TCP is captured, as its own annotation says it
/// (`permissive` without one; see [`explicit_mode`] for its namespace's say). Captured: the
/// injector's label says so (it captures by default, and labels every pod it captures), or
/// the pod's annotation asks for it.
fn inbound_mode(pod: &Pod, key: &PodKey) -> Option<InboundMode> {
    fn said(map: Option<&std::collections::BTreeMap<String, String>>) -> Option<&str> {
        map.and_then(|m| m.get(INBOUND_CAPTURE_ANNOTATION))
            .map(|v| v.trim())
    }
    let (labelled, annotated) = (
        said(pod.metadata.labels.as_ref()),
        said(pod.metadata.annotations.as_ref()),
    );
    // The injector captures no pod whose annotation says `disabled`, whatever its labels.
    if annotated == Some("disabled")
        || (labelled != Some("enabled") && annotated != Some("enabled"))
    {
        return None;
    }
    Some(explicit_mode(pod, key).unwrap_or(InboundMode::Permissive))
}

/// The mode the pod's annotation names, if it names one.
fn explicit_mode(pod: &Pod, key: &PodKey) -> Option<InboundMode> {
    let value = pod
        .metadata
        .annotations
        .as_ref()?
        .get(MTLS_MODE_ANNOTATION)?;
    Some(read_mode(value, &format!("pod {key}")))
}

/// `permissive` or `strict`. An unknown mode is taken as `strict`: a typo must not open pods
/// to plaintext they meant to refuse.
fn read_mode(value: &str, whose: &str) -> InboundMode {
    match value.trim() {
        "permissive" => InboundMode::Permissive,
        "strict" => InboundMode::Strict,
        other => {
            let shown: String = other.chars().take(64).collect();
            warn!(
                value = shown,
                "{whose}: unknown {MTLS_MODE_ANNOTATION} (permissive or strict): taken as strict"
            );
            InboundMode::Strict
        }
    }
}

/// At most this many probes of a pod are kept: each is a filter chain or a rule of its
/// inbound listener.
const MAX_PROBES: usize = 16;
/// The longest probe path let through.
const MAX_PROBE_PATH: usize = 1024;

/// The kubelet's probes of the pod's containers (liveness, readiness, startup, of app and
/// sidecar containers) that its inbound listener must let through: HTTP, HTTPS and gRPC ones
/// at the pod's own address (a TCP probe passes anyway, see [`InboundProbe`]). A named port is
/// looked up among its container's ports; a probe of Envoy's own ports (the sidecar's
/// readiness) is Envoy's, and one whose port does not resolve, or of another host, is none
/// of the listener's.
fn probes(pod: &Pod, key: &PodKey) -> Vec<InboundProbe> {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    use lattice_contract::{ENVOY_ADMIN_PORT, ENVOY_INBOUND_PORT, ENVOY_READINESS_PORT};
    let Some(spec) = pod.spec.as_ref() else {
        return Vec::new();
    };
    let containers = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten());
    let mut found = Vec::new();
    for container in containers {
        let port_of = |port: &IntOrString| -> Option<u16> {
            let port = match port {
                IntOrString::Int(n) => u16::try_from(*n).ok(),
                IntOrString::String(name) => container
                    .ports
                    .iter()
                    .flatten()
                    .find(|p| p.name.as_deref() == Some(name.as_str()))
                    .and_then(|p| u16::try_from(p.container_port).ok()),
            }?;
            let envoys = [ENVOY_ADMIN_PORT, ENVOY_INBOUND_PORT, ENVOY_READINESS_PORT];
            (port != 0 && !envoys.contains(&port)).then_some(port)
        };
        let probes = [
            &container.liveness_probe,
            &container.readiness_probe,
            &container.startup_probe,
        ];
        for probe in probes.into_iter().flatten() {
            let (port, kind) = if let Some(get) = &probe.http_get {
                if get.host.as_deref().is_some_and(|h| !h.is_empty()) {
                    continue;
                }
                let https = get
                    .scheme
                    .as_deref()
                    .is_some_and(|s| s.eq_ignore_ascii_case("https"));
                if https {
                    // Not to be told from any other TLS that is not the mesh's: letting it
                    // through would let that through. Its port must be excluded from capture.
                    warn!(pod = %key, "an HTTPS probe is not let through the pod's inbound listener where plaintext is refused: probe over HTTP, or exclude its port from capture");
                    continue;
                }
                let path = get.path.as_deref().unwrap_or("");
                if path.len() > MAX_PROBE_PATH {
                    warn!(pod = %key, bytes = path.len(), "a probe's path is longer than {MAX_PROBE_PATH} bytes: its inbound listener does not let it through");
                    continue;
                }
                let kind = ProbeKind::Http(probe_path(path).into());
                (port_of(&get.port), kind)
            } else if let Some(grpc) = &probe.grpc {
                (port_of(&IntOrString::Int(grpc.port)), ProbeKind::Grpc)
            } else {
                continue;
            };
            if let Some(port) = port {
                found.push(InboundProbe { port, kind });
            }
        }
    }
    found.sort();
    found.dedup();
    found.truncate(MAX_PROBES);
    found
}

/// A probe's path as the inbound listener reads the kubelet's request: from `/`, without its
/// query, with slashes merged and `.` and `..` segments resolved (the listener normalises
/// request paths before its rules see them).
fn probe_path(path: &str) -> String {
    let path = path.split(['?', '#']).next().unwrap_or("");
    let mut segments: Vec<&str> = Vec::new();
    for segment in path.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            other => segments.push(other),
        }
    }
    let trailing = path.ends_with('/') && !segments.is_empty();
    let mut out = format!("/{}", segments.join("/"));
    if trailing {
        out.push('/');
    }
    out
}

/// Whether the pod's proxy is scoped, and the services (DNS names) it declares. A value the
/// agent cannot read is logged and leaves the pod on the whole mesh (an unknown scope) or
/// skips that entry (a path that is not one), so a typo costs memory, never a broken call.
fn scoping(pod: &Pod, key: &PodKey) -> (bool, Vec<std::sync::Arc<str>>) {
    let annotations = pod.metadata.annotations.as_ref();
    let annotation = |name: &str| annotations.and_then(|a| a.get(name)).map(String::as_str);
    let scoped = match annotation(SCOPE_ANNOTATION).map(str::trim) {
        None | Some("used") => true,
        Some("mesh") => false,
        Some(other) => {
            warn!(pod = %key, value = other, "unknown {SCOPE_ANNOTATION} (used or mesh): the pod's proxy holds the whole mesh");
            false
        }
    };
    let mut uses: Vec<std::sync::Arc<str>> = Vec::new();
    for path in annotation(USES_ANNOTATION)
        .unwrap_or_default()
        .split([',', ' ', '\n'])
        .filter(|p| !p.is_empty())
    {
        match path.parse::<MeshPath>() {
            Ok(path) => uses.push(path.dns_name().into()),
            Err(error) => {
                warn!(pod = %key, path, %error, "skipping an entry of {USES_ANNOTATION}: not a mesh path");
            }
        }
    }
    uses.sort();
    uses.dedup();
    (scoped, uses)
}

/// A pod as the directory is made of: its entries, and whether its own annotation names its
/// mode (else its namespace's label does, or `permissive`).
struct FollowedPod {
    entries: Vec<PodEntry>,
    explicit: bool,
}

impl FollowedPod {
    fn of(pod: &Pod) -> Option<(PodKey, FollowedPod)> {
        let entries = pod_entries(pod);
        let key = entries.first()?.key.clone();
        let explicit = explicit_mode(pod, &key).is_some();
        Some((key, FollowedPod { entries, explicit }))
    }
}

fn pod_key(pod: &Pod) -> PodKey {
    PodKey {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        name: pod.metadata.name.clone().unwrap_or_default(),
    }
}

/// The directory of `pods`, each captured pod without a mode of its own in its namespace's.
fn directory(
    pods: &BTreeMap<PodKey, FollowedPod>,
    namespaces: &HashMap<String, InboundMode>,
) -> PodDirectory {
    PodDirectory::new(pods.iter().flat_map(|(key, pod)| {
        let default = (!pod.explicit)
            .then(|| namespaces.get(&key.namespace).copied())
            .flatten();
        pod.entries.iter().map(move |entry| {
            let mut entry = entry.clone();
            if let (Some(mode), Some(_)) = (default, entry.inbound) {
                entry.inbound = Some(mode);
            }
            entry
        })
    }))
}

/// The namespaces whose label names a mode: the default of their captured pods.
fn namespace_mode(namespace: &PartialObjectMeta<Namespace>) -> (String, Option<InboundMode>) {
    let name = namespace.metadata.name.clone().unwrap_or_default();
    let mode = namespace
        .metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get(MTLS_MODE_ANNOTATION))
        .map(|value| read_mode(value, &format!("namespace {name}")));
    (name, mode)
}

/// Follows this node's pods, and the namespaces' modes, until shutdown, publishing the
/// directory once both are first listed and after every change. Watch failures are retried
/// with backoff; the last published directory keeps serving meanwhile. An agent that may not
/// read namespaces (a role that predates it) says so once and takes every namespace as
/// naming no mode.
pub async fn watch_pods(
    client: kube::Client,
    node: String,
    tx: PodsTx,
    shutdown: CancellationToken,
) {
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut events = watcher(Api::<Pod>::all(client.clone()), config)
        .default_backoff()
        .boxed();
    // Metadata only: `Api<PartialObjectMeta<_>>` asks for PartialObjectMetadata.
    let mut namespace_events = watcher(
        Api::<PartialObjectMeta<Namespace>>::all(client),
        watcher::Config::default(),
    )
    .default_backoff()
    .boxed();
    let mut pods: BTreeMap<PodKey, FollowedPod> = BTreeMap::new();
    // The pods of a re-list in progress: they replace `pods` whole when it completes.
    let mut relist: Option<BTreeMap<PodKey, FollowedPod>> = None;
    let mut namespaces: HashMap<String, InboundMode> = HashMap::new();
    let mut namespace_relist: Option<HashMap<String, InboundMode>> = None;
    let (mut synced, mut namespaces_synced) = (false, false);
    loop {
        let publish = tokio::select! {
            () = shutdown.cancelled() => return,
            event = events.next() => match event {
                Some(event) => {
                    let changed = match event {
                        Ok(watcher::Event::Init) => {
                            relist = Some(BTreeMap::new());
                            false
                        }
                        Ok(watcher::Event::InitApply(pod)) => {
                            if let (Some(relist), Some((key, followed))) =
                                (&mut relist, FollowedPod::of(&pod))
                            {
                                relist.insert(key, followed);
                            }
                            false
                        }
                        Ok(watcher::Event::InitDone) => {
                            pods = relist.take().unwrap_or_default();
                            if !synced {
                                info!(node = %node, pods = pods.len(), "this node's pods listed: proxy identity checking is on");
                            }
                            synced = true;
                            true
                        }
                        Ok(watcher::Event::Apply(pod)) => {
                            match FollowedPod::of(&pod) {
                                Some((key, followed)) => pods.insert(key, followed),
                                None => pods.remove(&pod_key(&pod)),
                            };
                            true
                        }
                        Ok(watcher::Event::Delete(pod)) => {
                            pods.remove(&pod_key(&pod));
                            true
                        }
                        Err(error) => {
                            warn!(%error, "watching this node's pods failed; retrying, proxies are checked against the last list");
                            false
                        }
                    };
                    changed && synced
                }
                None => return,
            },
            event = namespace_events.next() => match event {
                Some(event) => {
                    let changed = match event {
                        Ok(watcher::Event::Init) => {
                            namespace_relist = Some(HashMap::new());
                            false
                        }
                        Ok(watcher::Event::InitApply(namespace)) => {
                            if let (Some(relist), (name, Some(mode))) =
                                (&mut namespace_relist, namespace_mode(&namespace))
                            {
                                relist.insert(name, mode);
                            }
                            false
                        }
                        Ok(watcher::Event::InitDone) => {
                            namespaces = namespace_relist.take().unwrap_or_default();
                            namespaces_synced = true;
                            true
                        }
                        Ok(watcher::Event::Apply(namespace)) => {
                            let (name, mode) = namespace_mode(&namespace);
                            match mode {
                                Some(mode) => namespaces.insert(name, mode) != Some(mode),
                                None => namespaces.remove(&name).is_some(),
                            }
                        }
                        Ok(watcher::Event::Delete(namespace)) => {
                            let (name, _) = namespace_mode(&namespace);
                            namespaces.remove(&name).is_some()
                        }
                        Err(error) if super::status_code(&error) == Some(403) => {
                            if !namespaces_synced {
                                warn!("namespaces may not be read (403): no namespace's {MTLS_MODE_ANNOTATION} label is followed, until the agent's role grants list and watch on namespaces (deploy/rbac.yaml)");
                                namespaces_synced = true;
                                true
                            } else {
                                false
                            }
                        }
                        Err(error) => {
                            warn!(%error, "watching namespaces failed; retrying, their last modes stand");
                            false
                        }
                    };
                    changed && synced
                }
                None => return,
            },
        };
        if publish && namespaces_synced {
            let directory = directory(&pods, &namespaces);
            tx.send_replace(Some(std::sync::Arc::new(directory)));
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pod(value: serde_json::Value) -> Pod {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn a_pod_gives_an_entry_per_ip_until_it_finishes() {
        let running = pod(json!({
            "metadata": {"namespace": "shop", "name": "web-1"},
            "spec": {"nodeName": "node-a", "containers": []},
            "status": {"phase": "Running", "podIP": "10.0.0.2",
                       "podIPs": [{"ip": "10.0.0.2"}, {"ip": "fd00::2"}]},
        }));
        let entries = pod_entries(&running);
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].key.node_id(), "web-1.shop");
        assert!(!entries[0].host_network);

        let pending_without_ip = pod(json!({
            "metadata": {"namespace": "shop", "name": "web-2"},
            "spec": {"containers": []},
            "status": {"phase": "Pending"},
        }));
        assert!(pod_entries(&pending_without_ip).is_empty());

        let finished = pod(json!({
            "metadata": {"namespace": "shop", "name": "job"},
            "spec": {"containers": []},
            "status": {"phase": "Succeeded", "podIP": "10.0.0.3"},
        }));
        assert!(pod_entries(&finished).is_empty());

        let host = pod(json!({
            "metadata": {"namespace": "kube-system", "name": "proxy"},
            "spec": {"hostNetwork": true, "containers": []},
            "status": {"phase": "Running", "podIP": "192.168.1.5"},
        }));
        assert!(pod_entries(&host)[0].host_network);
    }

    #[test]
    fn annotations_declare_the_services_used_or_opt_out() {
        let annotated = |annotations: serde_json::Value| {
            pod_entries(&pod(json!({
                "metadata": {"namespace": "shop", "name": "web-1", "annotations": annotations},
                "spec": {"containers": []},
                "status": {"phase": "Running", "podIP": "10.0.0.2"},
            })))
            .remove(0)
        };
        let plain = annotated(json!({}));
        assert!(plain.scoped && plain.uses.is_empty());
        let declared =
            annotated(json!({USES_ANNOTATION: "/data/db, /foo/bar/buzz not/a/path /data/db"}));
        assert!(declared.scoped);
        let uses: Vec<&str> = declared.uses.iter().map(|u| &**u).collect();
        assert_eq!(
            uses,
            ["buzz.bar.foo.system.internal", "db.data.system.internal"]
        );
        assert!(!annotated(json!({SCOPE_ANNOTATION: "mesh"})).scoped);
        assert!(!annotated(json!({SCOPE_ANNOTATION: "everything"})).scoped);
        assert!(annotated(json!({SCOPE_ANNOTATION: "used"})).scoped);

        let inbound = |mode: Option<&str>| {
            let mut annotations = json!({INBOUND_CAPTURE_ANNOTATION: "enabled"});
            if let Some(mode) = mode {
                annotations[MTLS_MODE_ANNOTATION] = json!(mode);
            }
            annotated(annotations).inbound
        };
        assert_eq!(plain.inbound, None);
        assert_eq!(
            annotated(json!({MTLS_MODE_ANNOTATION: "strict"})).inbound,
            None,
            "a mode without inbound capture"
        );
        assert_eq!(inbound(None), Some(InboundMode::Permissive));
        assert_eq!(inbound(Some("strict")), Some(InboundMode::Strict));
        assert_eq!(
            inbound(Some("Strict!")),
            Some(InboundMode::Strict),
            "a typo closes, never opens"
        );
        // Captured by the injector's default: its label alone says so.
        let labelled = |labels: serde_json::Value| {
            pod_entries(&pod(json!({
                "metadata": {"namespace": "shop", "name": "web-1", "labels": labels,
                             "annotations": {MTLS_MODE_ANNOTATION: "strict"}},
                "spec": {"containers": []},
                "status": {"phase": "Running", "podIP": "10.0.0.2"},
            })))
            .remove(0)
            .inbound
        };
        assert_eq!(
            labelled(json!({INBOUND_CAPTURE_ANNOTATION: "enabled"})),
            Some(InboundMode::Strict)
        );
        assert_eq!(labelled(json!({INBOUND_CAPTURE_ANNOTATION: "no"})), None);
        let opted_out = pod(json!({
            "metadata": {"namespace": "shop", "name": "web-1",
                         "labels": {INBOUND_CAPTURE_ANNOTATION: "enabled"},
                         "annotations": {INBOUND_CAPTURE_ANNOTATION: "disabled"}},
            "spec": {"containers": []},
            "status": {"phase": "Running", "podIP": "10.0.0.2"},
        }));
        assert_eq!(pod_entries(&opted_out)[0].inbound, None, "opted out");
    }

    /// The probes its inbound listener lets through: by number or by the container's port
    /// name; an HTTP path from `/`, without its query, normalised; gRPC; no TCP one (it passes
    /// anyway), no HTTPS one (not to be told from other TLS), none of another host's or of
    /// Envoy's own port, and none of a pod that does not capture its inbound TCP.
    #[test]
    fn a_captured_pods_probes_are_read_off_its_containers() {
        let probed = |annotations: serde_json::Value| {
            pod_entries(&pod(json!({
                "metadata": {"namespace": "shop", "name": "web", "annotations": annotations},
                "spec": {"containers": [
                    {"name": "app", "ports": [{"name": "http", "containerPort": 8080}],
                     "readinessProbe": {"httpGet": {"port": "http", "path": "/./ready?full=1"}},
                     "livenessProbe": {"httpGet": {"port": 8443, "scheme": "HTTPS"}},
                     "startupProbe": {"tcpSocket": {"port": 7000}}},
                    {"name": "other",
                     "readinessProbe": {"grpc": {"port": 9090}},
                     "livenessProbe": {"httpGet": {"port": 8081, "host": "10.9.9.9"}},
                     "startupProbe": {"httpGet": {"port": "nope"}}},
                    {"name": "lattice-proxy", "restartPolicy": "Always",
                     "readinessProbe": {"httpGet": {"port": 15021, "path": "/ready"}},
                     "livenessProbe": {"httpGet": {"port": 8082, "path": "live//now/../"}}},
                ]},
                "status": {"phase": "Running", "podIP": "10.0.0.2"},
            })))
            .remove(0)
            .probes
        };
        let probe = |port: u16, kind: ProbeKind| InboundProbe { port, kind };
        assert_eq!(
            probed(json!({INBOUND_CAPTURE_ANNOTATION: "enabled"})),
            [
                probe(8080, ProbeKind::Http("/ready".into())),
                probe(8082, ProbeKind::Http("/live/".into())),
                probe(9090, ProbeKind::Grpc),
            ]
        );
        assert!(probed(json!({})).is_empty());
    }

    /// A captured pod without a mode of its own takes its namespace's; one with its own keeps
    /// it; a pod that does not capture has none whatever its namespace says.
    #[test]
    fn a_namespace_label_sets_the_mode_of_its_pods_without_one() {
        let followed = |name: &str, annotations: serde_json::Value| {
            FollowedPod::of(&pod(json!({
                "metadata": {"namespace": "shop", "name": name, "annotations": annotations},
                "spec": {"containers": []},
                "status": {"phase": "Running", "podIP": format!("10.0.0.{}", name.len())},
            })))
            .unwrap()
        };
        let pods: BTreeMap<PodKey, FollowedPod> = [
            followed("a", json!({INBOUND_CAPTURE_ANNOTATION: "enabled"})),
            followed(
                "bb",
                json!({INBOUND_CAPTURE_ANNOTATION: "enabled", MTLS_MODE_ANNOTATION: "permissive"}),
            ),
            followed("ccc", json!({})),
        ]
        .into_iter()
        .collect();
        let mode = |namespaces: &HashMap<String, InboundMode>, name: &str, ip: &str| {
            let directory = directory(&pods, namespaces);
            let key = PodKey {
                namespace: "shop".to_string(),
                name: name.to_string(),
            };
            directory.entry(&key, ip.parse().unwrap()).unwrap().inbound
        };
        let none = HashMap::new();
        let strict = HashMap::from([("shop".to_string(), InboundMode::Strict)]);
        assert_eq!(mode(&none, "a", "10.0.0.1"), Some(InboundMode::Permissive));
        assert_eq!(mode(&strict, "a", "10.0.0.1"), Some(InboundMode::Strict));
        assert_eq!(
            mode(&strict, "bb", "10.0.0.2"),
            Some(InboundMode::Permissive)
        );
        assert_eq!(mode(&strict, "ccc", "10.0.0.3"), None);
    }
}
