//! This node's Pods, for proxy identity: one cluster-wide watch with the field selector
//! `spec.nodeName=<node>`, so the agent holds its own node's pods only (a few hundred at most,
//! whatever the cluster's size), folded into the [`PodDirectory`] the xDS server checks
//! streams against. Nothing is published before the first complete list.

use std::collections::BTreeMap;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::identity::{InboundMode, InboundProbe, PodDirectory, PodEntry, PodKey, PodsTx};
use crate::mesh::MeshPath;

/// The services a pod declares it uses, for a workload that connects without resolving their
/// names: mesh paths, separated by commas or spaces. Its Envoy holds them from the start.
pub const USES_ANNOTATION: &str = "lattice.mlab.com/uses";
/// `mesh`: the pod's Envoy holds the whole mesh instead of what the pod uses (`used`, the
/// default).
pub const SCOPE_ANNOTATION: &str = "lattice.mlab.com/scope";

/// `enabled`: the pod's inbound TCP is captured to its proxy (`lattice-init
/// --inbound-capture`, which the injector adds for this annotation), so its proxy gets an
/// inbound listener.
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

/// The pod's inbound mode when it asks for inbound capture. An unknown mode is taken as
/// `strict`: a typo must not open the pod to plaintext it meant to refuse.
fn inbound_mode(pod: &Pod, key: &PodKey) -> Option<InboundMode> {
    let annotations = pod.metadata.annotations.as_ref()?;
    if annotations
        .get(INBOUND_CAPTURE_ANNOTATION)
        .map(|v| v.trim())
        != Some("enabled")
    {
        return None;
    }
    Some(
        match annotations.get(MTLS_MODE_ANNOTATION).map(|v| v.trim()) {
            None | Some("permissive") => InboundMode::Permissive,
            Some("strict") => InboundMode::Strict,
            Some(other) => {
                let shown: String = other.chars().take(64).collect();
                warn!(pod = %key, value = shown, "unknown {MTLS_MODE_ANNOTATION} (permissive or strict): the pod's inbound listener is strict");
                InboundMode::Strict
            }
        },
    )
}

/// At most this many probes of a pod are kept: each is a filter chain or a rule of its
/// inbound listener.
const MAX_PROBES: usize = 16;
/// The longest probe path let through.
const MAX_PROBE_PATH: usize = 1024;

/// The kubelet's probes of the pod's containers (liveness, readiness, startup, of app and
/// sidecar containers), as its inbound listener must let them through. A named port is
/// looked up among its container's ports; a probe of another host than the pod's, or whose
/// port does not resolve, is not the listener's.
fn probes(pod: &Pod, key: &PodKey) -> Vec<InboundProbe> {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
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
            match port {
                IntOrString::Int(n) => u16::try_from(*n).ok().filter(|n| *n != 0),
                IntOrString::String(name) => container
                    .ports
                    .iter()
                    .flatten()
                    .find(|p| p.name.as_deref() == Some(name.as_str()))
                    .and_then(|p| u16::try_from(p.container_port).ok()),
            }
        };
        let probes = [
            &container.liveness_probe,
            &container.readiness_probe,
            &container.startup_probe,
        ];
        for probe in probes.into_iter().flatten() {
            if let Some(get) = &probe.http_get {
                if get.host.as_deref().is_some_and(|h| !h.is_empty()) {
                    continue;
                }
                let https = get
                    .scheme
                    .as_deref()
                    .is_some_and(|s| s.eq_ignore_ascii_case("https"));
                let path = get.path.as_deref().unwrap_or("/");
                let path = path.split(['?', '#']).next().unwrap_or("/");
                let path = if path.starts_with('/') { path } else { "/" };
                if path.len() > MAX_PROBE_PATH {
                    warn!(pod = %key, bytes = path.len(), "a probe's path is longer than {MAX_PROBE_PATH} bytes: its inbound listener does not let it through");
                    continue;
                }
                if let Some(port) = port_of(&get.port) {
                    found.push(InboundProbe {
                        port,
                        path: (!https).then(|| std::sync::Arc::from(path)),
                    });
                }
            } else if let Some(tcp) = &probe.tcp_socket {
                if tcp.host.as_deref().is_some_and(|h| !h.is_empty()) {
                    continue;
                }
                if let Some(port) = port_of(&tcp.port) {
                    found.push(InboundProbe { port, path: None });
                }
            } else if let Some(grpc) = &probe.grpc
                && let Ok(port) = u16::try_from(grpc.port)
            {
                found.push(InboundProbe { port, path: None });
            }
        }
    }
    found.sort();
    found.dedup();
    found.truncate(MAX_PROBES);
    found
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

/// Follows this node's pods until shutdown, publishing the directory after the first
/// complete list and after every change. Watch failures are retried with backoff; the last
/// published directory keeps serving meanwhile.
pub async fn watch_pods(
    client: kube::Client,
    node: String,
    tx: PodsTx,
    shutdown: CancellationToken,
) {
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut events = watcher(Api::<Pod>::all(client), config)
        .default_backoff()
        .boxed();
    let mut pods: BTreeMap<PodKey, Vec<PodEntry>> = BTreeMap::new();
    // The pods of a re-list in progress: they replace `pods` whole when it completes.
    let mut relist: Option<BTreeMap<PodKey, Vec<PodEntry>>> = None;
    let mut synced = false;
    loop {
        let event = tokio::select! {
            () = shutdown.cancelled() => return,
            event = events.next() => match event {
                Some(event) => event,
                None => return,
            },
        };
        let publish = match event {
            Ok(watcher::Event::Init) => {
                relist = Some(BTreeMap::new());
                false
            }
            Ok(watcher::Event::InitApply(pod)) => {
                if let Some(relist) = &mut relist {
                    let entries = pod_entries(&pod);
                    if let Some(first) = entries.first() {
                        relist.insert(first.key.clone(), entries);
                    }
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
                let entries = pod_entries(&pod);
                let key = PodKey {
                    namespace: pod.metadata.namespace.clone().unwrap_or_default(),
                    name: pod.metadata.name.clone().unwrap_or_default(),
                };
                if entries.is_empty() {
                    pods.remove(&key);
                } else {
                    pods.insert(key, entries);
                }
                synced
            }
            Ok(watcher::Event::Delete(pod)) => {
                pods.remove(&PodKey {
                    namespace: pod.metadata.namespace.clone().unwrap_or_default(),
                    name: pod.metadata.name.clone().unwrap_or_default(),
                });
                synced
            }
            Err(error) => {
                warn!(%error, "watching this node's pods failed; retrying, proxies are checked against the last list");
                false
            }
        };
        if publish {
            let directory = PodDirectory::new(pods.values().flatten().cloned());
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
    }

    /// The probes its inbound listener lets through: by number or by the container's port
    /// name; an HTTP path without its query; HTTPS, TCP and gRPC as connections; none of
    /// another host's, and none of a pod that does not capture its inbound TCP.
    #[test]
    fn a_captured_pods_probes_are_read_off_its_containers() {
        let probed = |annotations: serde_json::Value| {
            pod_entries(&pod(json!({
                "metadata": {"namespace": "shop", "name": "web", "annotations": annotations},
                "spec": {"containers": [
                    {"name": "app", "ports": [{"name": "http", "containerPort": 8080}],
                     "readinessProbe": {"httpGet": {"port": "http", "path": "/ready?full=1"}},
                     "livenessProbe": {"httpGet": {"port": 8443, "scheme": "HTTPS"}},
                     "startupProbe": {"tcpSocket": {"port": 7000}}},
                    {"name": "other",
                     "readinessProbe": {"grpc": {"port": 9090}},
                     "livenessProbe": {"httpGet": {"port": 8081, "host": "10.9.9.9"}},
                     "startupProbe": {"httpGet": {"port": "nope"}}},
                ]},
                "status": {"phase": "Running", "podIP": "10.0.0.2"},
            })))
            .remove(0)
            .probes
        };
        let probe = |port: u16, path: Option<&str>| InboundProbe {
            port,
            path: path.map(std::sync::Arc::from),
        };
        assert_eq!(
            probed(json!({INBOUND_CAPTURE_ANNOTATION: "enabled"})),
            [
                probe(7000, None),
                probe(8080, Some("/ready")),
                probe(8443, None),
                probe(9090, None),
            ]
        );
        assert!(probed(json!({})).is_empty());
    }
}
