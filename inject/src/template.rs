//! The mesh's additions to a pod, as one JSON Patch against the pod object (`/metadata`,
//! `/spec`): what the admission webhook answers and what `lattice inject` applies to a
//! workload's pod template. The additions:
//!
//! - the `lattice-init` init container, first: it writes Envoy's bootstrap to a shared
//!   `emptyDir` and installs the pod's iptables rules (as root, with `NET_ADMIN`, and
//!   `NET_RAW` for the legacy iptables backend), its node id from the downward API;
//! - the Envoy sidecar `lattice-proxy`, second, as a native sidecar (an init container with
//!   `restartPolicy: Always`) running as the UID `lattice-init` exempts from capture, with a
//!   startup probe on the bootstrap's readiness endpoint, so the pod's other init containers
//!   and its app start only once Envoy holds its configuration;
//! - the pod's DNS on the node-local address (`dnsPolicy: None`), with the search list
//!   `ClusterFirst` would have given it;
//! - the `lattice.mlab.com/injected` annotation: what the pod's DNS settings were, and which
//!   fields injection created, so that [`uninject`] gives back the pod as it was.
//!
//! The patch only adds to the pod (and sets its DNS fields): it is built from the pod's own
//! JSON, never by re-serialising a typed copy, so fields this crate's Kubernetes types do not
//! know survive it. A pod that cannot be meshed is left alone with the reason ([`Skip`]),
//! never half-changed; a pod already in the mesh (injected, or carrying `lattice-init` by
//! hand) is left as it is.

use std::collections::BTreeMap;

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation, RemoveOperation};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EnvVar, EnvVarSource, HTTPGetAction,
    ObjectFieldSelector, PodDNSConfig, PodDNSConfigOption, PodSpec, Probe, ResourceRequirements,
    SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use lattice_contract::{
    CapturePort, DEFAULT_TRAP_CIDR, ENVOY_READINESS_PATH, ENVOY_READINESS_PORT, ENVOY_UID,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::annotations::{
    BadAnnotation, INBOUND_CAPTURE, INJECT, INJECTED, MESHED_LABEL, Overrides, SERVICE_ACCOUNT,
    Wish, shown,
};
use crate::config::InjectConfig;

/// The init container that writes the bootstrap and the iptables rules.
pub const INIT_CONTAINER: &str = "lattice-init";
/// The Envoy sidecar.
pub const PROXY_CONTAINER: &str = "lattice-proxy";
/// The `emptyDir` the two share.
pub const VOLUME: &str = "lattice-bootstrap";
/// lattice-init's own `emptyDir`, its /run: iptables-legacy takes its lock in /run
/// (/run/xtables.lock), which the read-only root filesystem does not allow.
pub const RUN_VOLUME: &str = "lattice-init-run";
/// Where it is mounted, and the bootstrap in it.
const MOUNT: &str = "/etc/lattice";
const BOOTSTRAP: &str = "/etc/lattice/envoy.json";
/// How long a connection on a replaced listener may go on (Envoy's `--drain-time-s`): a
/// caller whose authorization was withdrawn keeps an open TCP connection at most this long.
pub const PROXY_DRAIN_SECONDS: u32 = 45;
/// The name of the proxy's readiness port (port names are unique in a pod, at most 15
/// characters).
pub const READY_PORT: &str = "lattice-ready";

/// Why a pod was left as it was.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Skip {
    #[error("already in the mesh")]
    AlreadyInjected,
    #[error("opted out ({INJECT}: disabled)")]
    OptedOut,
    #[error("on the host network: its traffic cannot be captured without capturing the node's")]
    HostNetwork,
    #[error("for Windows nodes: lattice-init and Envoy's image are Linux only")]
    Windows,
    #[error(
        "container {container} runs as UID {ENVOY_UID}, the proxy's: its traffic would never be \
         captured"
    )]
    ProxyUid { container: String },
    #[error(
        "dnsPolicy {policy} conflicts with the mesh's DNS (only ClusterFirst, the default, can be \
         replaced by the node-local nameserver)"
    )]
    DnsPolicy { policy: String },
    #[error("its dnsConfig names nameservers of its own; mesh names would not resolve")]
    DnsNameservers,
    #[error("its {what} {name} is taken: the mesh's additions need that name")]
    NameTaken {
        what: &'static str,
        name: &'static str,
    },
    #[error("{0}")]
    BadAnnotation(#[from] BadAnnotation),
    #[error("not a pod: {0}")]
    NotAPod(String),
}

impl Skip {
    /// Whether the pod is as the mesh wants it (nothing to do), as opposed to refused.
    pub fn is_settled(&self) -> bool {
        matches!(self, Skip::AlreadyInjected | Skip::OptedOut)
    }
}

/// Why [`uninject`] found nothing to undo.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NotInjected {
    #[error("not injected (no {INJECTED} annotation)")]
    Plain,
    #[error("its {INJECTED} annotation does not parse: {0}")]
    BadRecord(String),
    #[error("not a pod: {0}")]
    NotAPod(String),
}

/// In [`Record::created`]: the injector wrote the pod's [`INBOUND_CAPTURE`] annotation.
const CAPTURE_ANNOTATION_CREATED: &str = "annotations.inbound-capture";

/// What [`inject`] records in [`INJECTED`]: the pod's DNS settings before, and the fields it
/// created (absent before), which [`uninject`] removes again once the mesh's entries go.
#[derive(Debug, Default, Deserialize, Serialize, PartialEq)]
struct Record {
    #[serde(rename = "dnsPolicy", default)]
    dns_policy: Option<Value>,
    #[serde(rename = "dnsConfig", default)]
    dns_config: Option<Value>,
    #[serde(default)]
    created: Vec<String>,
}

/// The patch that puts `pod` (a Pod, or a workload's pod template: `metadata` and `spec`) in
/// the mesh, for a pod of `namespace`.
pub fn inject(pod: &Value, namespace: &str, config: &InjectConfig) -> Result<Patch, Skip> {
    let (meta, spec) = read(pod).map_err(Skip::NotAPod)?;
    let annotations = meta.annotations.clone().unwrap_or_default();
    if annotations.contains_key(INJECTED) || has_container(&spec, INIT_CONTAINER) {
        return Err(Skip::AlreadyInjected);
    }
    if let Some(value) = annotations.get(INJECT) {
        match Wish::parse(value) {
            Some(Wish::Disabled) => return Err(Skip::OptedOut),
            Some(Wish::Enabled) => {}
            None => {
                return Err(
                    BadAnnotation::new(INJECT, value, "neither enabled nor disabled").into(),
                );
            }
        }
    }
    check(&spec)?;
    let overrides = Overrides::read(&annotations)?;

    let raw_spec = &pod["spec"];
    let mut created = Vec::new();
    let mut ops = Vec::new();
    let init = to_value(&init_container(config, &overrides));
    let proxy = to_value(&proxy_container(config, &overrides));
    if raw_spec.get("initContainers").is_some_and(Value::is_array) {
        ops.push(add(&["spec", "initContainers", "0"], init));
        ops.push(add(&["spec", "initContainers", "1"], proxy));
    } else {
        created.push("initContainers".to_string());
        ops.push(add(&["spec", "initContainers"], json!([init, proxy])));
    }
    let volumes: Vec<Value> = [VOLUME, RUN_VOLUME]
        .iter()
        .map(|name| {
            to_value(&Volume {
                name: name.to_string(),
                empty_dir: Some(Default::default()),
                ..Volume::default()
            })
        })
        .collect();
    if raw_spec.get("volumes").is_some_and(Value::is_array) {
        for volume in volumes {
            ops.push(add(&["spec", "volumes", "-"], volume));
        }
    } else {
        created.push("volumes".to_string());
        ops.push(add(&["spec", "volumes"], Value::Array(volumes)));
    }
    ops.push(add(&["spec", "dnsPolicy"], json!("None")));
    ops.push(add(
        &["spec", "dnsConfig"],
        to_value(&dns_config(spec.dns_config.as_ref(), namespace, config)),
    ));

    let has_metadata = pod.get("metadata").is_some_and(Value::is_object);
    let has_annotations = pod["metadata"]
        .get("annotations")
        .is_some_and(Value::is_object);
    let has_labels = pod["metadata"].get("labels").is_some_and(Value::is_object);
    if !has_metadata {
        created.push("metadata".to_string());
    } else if !has_annotations {
        created.push("annotations".to_string());
    }
    // A pod whose inbound TCP is captured takes mesh mTLS: the agents find it by this label
    // (a metadata-only watch, which sees no spec, hence its service account beside it).
    let meshed = overrides.inbound_capture.then(|| {
        spec.service_account_name
            .clone()
            .filter(|name| !name.is_empty())
            .unwrap_or_else(|| "default".to_string())
    });
    if meshed.is_some() && has_metadata {
        if has_labels {
            ops.push(add(&["metadata", "labels", MESHED_LABEL], json!("enabled")));
        } else {
            created.push("labels".to_string());
            ops.push(add(
                &["metadata", "labels"],
                json!({MESHED_LABEL: "enabled"}),
            ));
        }
    }
    // Captured by default: the pod says so itself too, for an agent older than this injector,
    // which reads only the annotation (and would give the pod no inbound listener). Recorded,
    // so that uninjecting removes it and never a user's own.
    let capture_said = meshed.is_some() && !annotations.contains_key(INBOUND_CAPTURE);
    if capture_said {
        created.push(CAPTURE_ANNOTATION_CREATED.to_string());
    }
    let record = Record {
        dns_policy: raw_spec.get("dnsPolicy").cloned(),
        dns_config: raw_spec.get("dnsConfig").cloned(),
        created,
    };
    let text = serde_json::to_string(&record).unwrap_or_default();
    let mut ours = serde_json::Map::new();
    ours.insert(INJECTED.to_string(), json!(text));
    if let Some(account) = &meshed {
        ours.insert(SERVICE_ACCOUNT.to_string(), json!(account));
    }
    if capture_said {
        ours.insert(INBOUND_CAPTURE.to_string(), json!("enabled"));
    }
    if !has_metadata {
        let mut metadata = json!({"annotations": ours});
        if meshed.is_some() {
            metadata["labels"] = json!({MESHED_LABEL: "enabled"});
        }
        ops.push(add(&["metadata"], metadata));
    } else if !has_annotations {
        ops.push(add(&["metadata", "annotations"], Value::Object(ours)));
    } else {
        for (key, value) in ours {
            ops.push(add(&["metadata", "annotations", &key], value));
        }
    }
    Ok(Patch(ops))
}

/// The patch that takes `pod` out of the mesh again: the mesh's containers and volume
/// removed, its DNS settings and the fields injection created as they were.
pub fn uninject(pod: &Value) -> Result<Patch, NotInjected> {
    let text = pod["metadata"]["annotations"][INJECTED]
        .as_str()
        .ok_or(NotInjected::Plain)?;
    let record: Record =
        serde_json::from_str(text).map_err(|e| NotInjected::BadRecord(shown(&e.to_string())))?;
    let spec = pod
        .get("spec")
        .filter(|s| s.is_object())
        .ok_or_else(|| NotInjected::NotAPod("no spec".to_string()))?;
    let created = |field: &str| record.created.iter().any(|c| c == field);
    let mut ops = Vec::new();
    for (field, ours) in [
        ("initContainers", &[INIT_CONTAINER, PROXY_CONTAINER][..]),
        ("volumes", &[VOLUME, RUN_VOLUME][..]),
    ] {
        let Some(items) = spec.get(field).and_then(Value::as_array) else {
            continue;
        };
        let mine: Vec<usize> = items
            .iter()
            .enumerate()
            .filter(|(_, item)| item["name"].as_str().is_some_and(|n| ours.contains(&n)))
            .map(|(i, _)| i)
            .collect();
        if mine.len() == items.len() && created(field) {
            ops.push(remove(&["spec", field]));
        } else {
            // From the last, so each index is still the item's when its removal applies.
            for i in mine.into_iter().rev() {
                ops.push(remove(&["spec", field, &i.to_string()]));
            }
        }
    }
    for (field, before) in [
        ("dnsPolicy", &record.dns_policy),
        ("dnsConfig", &record.dns_config),
    ] {
        match before {
            Some(value) => ops.push(add(&["spec", field], value.clone())),
            None if spec.get(field).is_some() => ops.push(remove(&["spec", field])),
            None => {}
        }
    }
    let annotations = pod["metadata"]["annotations"].as_object();
    let our_account = annotations.is_some_and(|a| a.contains_key(SERVICE_ACCOUNT));
    let our_capture = created(CAPTURE_ANNOTATION_CREATED)
        && annotations.is_some_and(|a| a.contains_key(INBOUND_CAPTURE));
    let others = annotations.map_or(0, |a| {
        a.len() - 1 - usize::from(our_account) - usize::from(our_capture)
    });
    let labels = pod["metadata"]["labels"].as_object();
    let our_label = labels.is_some_and(|l| l.contains_key(MESHED_LABEL));
    let other_labels = labels.map_or(0, |l| l.len() - usize::from(our_label));
    let annotations_go = others == 0 && (created("annotations") || created("metadata"));
    let labels_go = our_label && other_labels == 0 && (created("labels") || created("metadata"));
    let fields = pod["metadata"].as_object().map_or(0, |m| m.len());
    let left = fields - usize::from(annotations_go) - usize::from(labels_go);
    if created("metadata") && annotations_go && left == 0 {
        ops.push(remove(&["metadata"]));
        return Ok(Patch(ops));
    }
    if annotations_go {
        ops.push(remove(&["metadata", "annotations"]));
    } else {
        ops.push(remove(&["metadata", "annotations", INJECTED]));
        if our_account {
            ops.push(remove(&["metadata", "annotations", SERVICE_ACCOUNT]));
        }
        if our_capture {
            ops.push(remove(&["metadata", "annotations", INBOUND_CAPTURE]));
        }
    }
    if labels_go {
        ops.push(remove(&["metadata", "labels"]));
    } else if our_label {
        ops.push(remove(&["metadata", "labels", MESHED_LABEL]));
    }
    Ok(Patch(ops))
}

/// The pod's metadata and spec as Kubernetes types, to look at (the patch is built from the
/// JSON itself).
fn read(pod: &Value) -> Result<(ObjectMeta, PodSpec), String> {
    let meta = match pod.get("metadata") {
        Some(meta) if !meta.is_null() => {
            ObjectMeta::deserialize(meta).map_err(|e| shown(&format!("metadata: {e}")))?
        }
        _ => ObjectMeta::default(),
    };
    let spec = pod
        .get("spec")
        .ok_or_else(|| "no spec".to_string())
        .and_then(|spec| PodSpec::deserialize(spec).map_err(|e| shown(&format!("spec: {e}"))))?;
    if spec.containers.is_empty() {
        return Err("no containers".to_string());
    }
    Ok((meta, spec))
}

fn has_container(spec: &PodSpec, name: &str) -> bool {
    let init = spec.init_containers.iter().flatten();
    init.chain(&spec.containers).any(|c| c.name == name)
}

/// What keeps a pod out of the mesh, if anything.
fn check(spec: &PodSpec) -> Result<(), Skip> {
    if spec.host_network == Some(true) {
        return Err(Skip::HostNetwork);
    }
    let windows_selector = spec
        .node_selector
        .as_ref()
        .and_then(|s| s.get("kubernetes.io/os"))
        .is_some_and(|os| os == "windows");
    let windows_os = spec.os.as_ref().is_some_and(|os| os.name == "windows");
    if windows_selector || windows_os {
        return Err(Skip::Windows);
    }
    let pod_uid = spec.security_context.as_ref().and_then(|s| s.run_as_user);
    let init = spec.init_containers.iter().flatten();
    for container in init.chain(&spec.containers) {
        let uid = container
            .security_context
            .as_ref()
            .and_then(|s| s.run_as_user)
            .or(pod_uid);
        if uid == Some(i64::from(ENVOY_UID)) {
            return Err(Skip::ProxyUid {
                container: shown(&container.name),
            });
        }
    }
    if let Some(policy) = &spec.dns_policy
        && !matches!(policy.as_str(), "ClusterFirst" | "ClusterFirstWithHostNet")
    {
        return Err(Skip::DnsPolicy {
            policy: shown(policy),
        });
    }
    if spec
        .dns_config
        .as_ref()
        .is_some_and(|c| c.nameservers.as_ref().is_some_and(|n| !n.is_empty()))
    {
        return Err(Skip::DnsNameservers);
    }
    for name in [VOLUME, RUN_VOLUME] {
        if spec.volumes.iter().flatten().any(|v| v.name == name) {
            return Err(Skip::NameTaken {
                what: "volume",
                name,
            });
        }
    }
    if has_container(spec, PROXY_CONTAINER) {
        return Err(Skip::NameTaken {
            what: "container",
            name: PROXY_CONTAINER,
        });
    }
    let init = spec.init_containers.iter().flatten();
    let port_taken = init
        .chain(&spec.containers)
        .flat_map(|c| c.ports.iter().flatten())
        .any(|p| p.name.as_deref() == Some(READY_PORT));
    if port_taken {
        return Err(Skip::NameTaken {
            what: "port name",
            name: READY_PORT,
        });
    }
    Ok(())
}

fn init_container(config: &InjectConfig, overrides: &Overrides) -> Container {
    let mut args = vec![format!("--bootstrap-out={BOOTSTRAP}")];
    if config.trap.to_string() != DEFAULT_TRAP_CIDR {
        args.push(format!("--trap-cidr={}", config.trap));
    }
    if config.envoy_port != CapturePort::default() {
        args.push(format!("--envoy-port={}", config.envoy_port));
    }
    if let Some(xds) = &config.xds_address {
        args.push(format!("--xds-address={xds}"));
    }
    if let Some(mode) = overrides.xds_mode {
        args.push(format!("--xds-mode={mode}"));
    }
    if !overrides.exclude_uids.is_empty() {
        let uids: Vec<String> = overrides.exclude_uids.iter().map(u32::to_string).collect();
        args.push(format!("--exclude-uid={}", uids.join(",")));
    }
    if overrides.inbound_capture {
        args.push("--inbound-capture".to_string());
        if !overrides.exclude_inbound_ports.is_empty() {
            let ports: Vec<String> = overrides
                .exclude_inbound_ports
                .iter()
                .map(u16::to_string)
                .collect();
            args.push(format!("--exclude-inbound-port={}", ports.join(",")));
        }
    }
    let field = |name: &str, path: &str| EnvVar {
        name: name.to_string(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.to_string(),
                ..ObjectFieldSelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    };
    Container {
        name: INIT_CONTAINER.to_string(),
        image: Some(config.image.clone()),
        command: Some(vec!["lattice-init".to_string()]),
        args: Some(args),
        // The node id the agent checks against the pod: <name>.<namespace>.
        env: Some(vec![
            field("POD_NAME", "metadata.name"),
            field("POD_NAMESPACE", "metadata.namespace"),
        ]),
        volume_mounts: Some(vec![
            VolumeMount {
                name: VOLUME.to_string(),
                mount_path: MOUNT.to_string(),
                ..VolumeMount::default()
            },
            VolumeMount {
                name: RUN_VOLUME.to_string(),
                mount_path: "/run".to_string(),
                ..VolumeMount::default()
            },
        ]),
        resources: Some(resources("10m", "16Mi", "64Mi")),
        security_context: Some(SecurityContext {
            run_as_user: Some(0),
            run_as_non_root: Some(false),
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_string()]),
                // NET_ADMIN changes the pod's nat table; NET_RAW only for the legacy backend
                // (iptables-legacy opens a raw socket, iptables-nft does not).
                add: Some(vec!["NET_ADMIN".to_string(), "NET_RAW".to_string()]),
            }),
            ..SecurityContext::default()
        }),
        ..Container::default()
    }
}

fn proxy_container(config: &InjectConfig, overrides: &Overrides) -> Container {
    let probe = |period: i32, failures: Option<i32>| Probe {
        http_get: Some(HTTPGetAction {
            path: Some(ENVOY_READINESS_PATH.to_string()),
            port: IntOrString::String(READY_PORT.to_string()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period),
        failure_threshold: failures,
        ..Probe::default()
    };
    let defaults = &config.proxy_resources;
    let pick = |given: &Option<String>, default: &String| given.clone().unwrap_or(default.clone());
    Container {
        name: PROXY_CONTAINER.to_string(),
        image: Some(config.envoy_image.clone()),
        // A native sidecar: started before the app, stopped after it.
        restart_policy: Some("Always".to_string()),
        command: Some(vec!["envoy".to_string()]),
        args: Some(vec![
            "--config-path".to_string(),
            BOOTSTRAP.to_string(),
            "--log-level".to_string(),
            config.proxy_log_level.clone(),
            // A sidecar is replaced, never hot-restarted: no shared memory needed.
            "--disable-hot-restart".to_string(),
            // A changed listener (an authorization rule, an inbound mode) takes over at once:
            // HTTP connections on the old one close after their next response, the rest
            // after the drain time, as Istio's sidecars do.
            "--drain-strategy".to_string(),
            "immediate".to_string(),
            "--drain-time-s".to_string(),
            PROXY_DRAIN_SECONDS.to_string(),
        ]),
        volume_mounts: Some(vec![VolumeMount {
            name: VOLUME.to_string(),
            mount_path: MOUNT.to_string(),
            read_only: Some(true),
            ..VolumeMount::default()
        }]),
        ports: Some(vec![ContainerPort {
            name: Some(READY_PORT.to_string()),
            container_port: i32::from(ENVOY_READINESS_PORT),
            protocol: Some("TCP".to_string()),
            ..ContainerPort::default()
        }]),
        // Up to 10 minutes for a first configuration (the node's agent may be starting too)
        // before the kubelet restarts Envoy; the pod's app starts only once this succeeds.
        startup_probe: Some(probe(1, Some(600))),
        // Not ready while Envoy drains, so the pod leaves its Services first.
        readiness_probe: Some(probe(5, None)),
        resources: Some(resources(
            &pick(&overrides.cpu, &defaults.cpu_request),
            &pick(&overrides.memory, &defaults.memory_request),
            &pick(&overrides.memory_limit, &defaults.memory_limit),
        )),
        security_context: Some(SecurityContext {
            run_as_user: Some(i64::from(ENVOY_UID)),
            run_as_group: Some(i64::from(ENVOY_UID)),
            run_as_non_root: Some(true),
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_string()]),
                add: None,
            }),
            ..SecurityContext::default()
        }),
        ..Container::default()
    }
}

fn resources(cpu: &str, memory: &str, memory_limit: &str) -> ResourceRequirements {
    let quantity = |q: &str| Quantity(q.to_string());
    ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_string(), quantity(cpu)),
            ("memory".to_string(), quantity(memory)),
        ])),
        limits: Some(BTreeMap::from([(
            "memory".to_string(),
            quantity(memory_limit),
        )])),
        ..ResourceRequirements::default()
    }
}

/// The node-local nameserver with the search list `ClusterFirst` gives a pod of `namespace`,
/// then the pod's own searches and options (its `ndots` wins over the default 5).
fn dns_config(own: Option<&PodDNSConfig>, namespace: &str, config: &InjectConfig) -> PodDNSConfig {
    let domain = &config.cluster_domain;
    let mut searches = vec![
        format!("{namespace}.svc.{domain}"),
        format!("svc.{domain}"),
        domain.clone(),
    ];
    for search in own.and_then(|c| c.searches.as_ref()).into_iter().flatten() {
        if !searches.contains(search) {
            searches.push(search.clone());
        }
    }
    let mut options: Vec<PodDNSConfigOption> =
        own.and_then(|c| c.options.clone()).unwrap_or_default();
    if !options.iter().any(|o| o.name.as_deref() == Some("ndots")) {
        options.insert(
            0,
            PodDNSConfigOption {
                name: Some("ndots".to_string()),
                value: Some("5".to_string()),
            },
        );
    }
    PodDNSConfig {
        nameservers: Some(vec![config.nameserver.to_string()]),
        searches: Some(searches),
        options: Some(options),
    }
}

fn to_value(value: &impl Serialize) -> Value {
    serde_json::to_value(value).unwrap_or(Value::Null)
}

fn pointer(tokens: &[&str]) -> PointerBuf {
    PointerBuf::from_tokens(tokens.iter().copied())
}

fn add(path: &[&str], value: Value) -> PatchOperation {
    PatchOperation::Add(AddOperation {
        path: pointer(path),
        value,
    })
}

fn remove(path: &[&str]) -> PatchOperation {
    PatchOperation::Remove(RemoveOperation {
        path: pointer(path),
    })
}
