//! `lattice check`: whether the mesh is installed and working on a cluster, from the
//! Kubernetes API alone, as `linkerd check` does: each check passes, warns or fails, and a
//! failure says what to look at. The checks, in order:
//!
//! - the node agent: its DaemonSet, ready on every Linux node; its ClusterRole, Role and
//!   bindings granting what `deploy/rbac.yaml` grants (the rules the agent needs; the deploy
//!   tests hold that file to the requests the agent makes);
//! - the sidecar injector: its webhook configuration, whose CA bundle is a CA valid now; ready
//!   endpoints behind its Service (what the API server calls); its serving certificate in its
//!   Secret signed by that CA and naming the Service;
//! - the Gateway API's CRDs, installed or not (either is fine: without them the agent serves
//!   no routes from HTTPRoutes and GRPCRoutes);
//! - every running mesh pod's Envoy ready, that is holding its configuration from its node's
//!   agent (the sidecar's readiness probe asks Envoy for that).

use std::collections::BTreeSet;
use std::fmt;

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams};
use serde::Deserialize;
use time::OffsetDateTime;

use crate::template::PROXY_CONTAINER;

/// The RBAC the agent needs, as `deploy/` installs it.
const AGENT_RBAC: &str = include_str!("../../deploy/rbac.yaml");

/// How a check came out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    Pass,
    /// Works, but worth knowing.
    Warn(String),
    /// Broken: what was found, and a hint.
    Fail {
        found: String,
        hint: String,
    },
}

/// One check's result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub section: &'static str,
    pub title: String,
    pub status: Status,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.status {
            Status::Pass => write!(f, "√ {}", self.title),
            Status::Warn(note) => write!(f, "‼ {}\n    {note}", self.title),
            Status::Fail { found, hint } => {
                write!(f, "× {}\n    {found}\n    hint: {hint}", self.title)
            }
        }
    }
}

/// Where the mesh is installed.
#[derive(Clone, Debug)]
pub struct Install {
    pub namespace: String,
    pub agent: String,
    pub injector: String,
    pub injector_secret: String,
}

impl Default for Install {
    fn default() -> Self {
        Install {
            namespace: "lattice-system".to_string(),
            agent: "lattice-agent".to_string(),
            injector: "lattice-injector".to_string(),
            injector_secret: "lattice-injector-tls".to_string(),
        }
    }
}

/// Runs every check.
pub async fn run(client: &kube::Client, install: &Install) -> Vec<Outcome> {
    let mut out = Vec::new();
    agent(client, install, &mut out).await;
    injector(client, install, &mut out).await;
    gateway_api(client, &mut out).await;
    pods(client, &mut out).await;
    out
}

fn pass(section: &'static str, title: impl Into<String>) -> Outcome {
    Outcome {
        section,
        title: title.into(),
        status: Status::Pass,
    }
}

fn fail(
    section: &'static str,
    title: impl Into<String>,
    found: impl Into<String>,
    hint: impl Into<String>,
) -> Outcome {
    Outcome {
        section,
        title: title.into(),
        status: Status::Fail {
            found: found.into(),
            hint: hint.into(),
        },
    }
}

const AGENT: &str = "lattice-agent";

async fn agent(client: &kube::Client, install: &Install, out: &mut Vec<Outcome>) {
    let ns = &install.namespace;
    let title = format!("the agent's DaemonSet {ns}/{} exists", install.agent);
    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), ns);
    let daemonset = match daemonsets.get_opt(&install.agent).await {
        Ok(Some(daemonset)) => {
            out.push(pass(AGENT, title));
            Some(daemonset)
        }
        Ok(None) => {
            out.push(fail(
                AGENT,
                title,
                "not found",
                "install it: kubectl apply -k deploy/",
            ));
            None
        }
        Err(e) => {
            out.push(fail(
                AGENT,
                title,
                format!("the Kubernetes API: {e}"),
                "check the kubeconfig (KUBECONFIG) and that the API server answers",
            ));
            return;
        }
    };
    if let Some(daemonset) = daemonset {
        let nodes: Api<Node> = Api::all(client.clone());
        let linux = match nodes.list(&ListParams::default()).await {
            Ok(list) => list
                .items
                .iter()
                .filter(|n| {
                    let os = n
                        .metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get("kubernetes.io/os"));
                    os.is_none_or(|os| os == "linux")
                })
                .count(),
            Err(_) => 0,
        };
        let status = daemonset.status.unwrap_or_default();
        let title = "an agent is ready on every Linux node";
        if linux > 0
            && status.number_ready as usize >= linux
            && status.number_unavailable.unwrap_or(0) == 0
        {
            out.push(pass(AGENT, title));
        } else {
            out.push(fail(
                AGENT,
                title,
                format!("{} ready of {linux} Linux nodes", status.number_ready),
                format!(
                    "kubectl -n {ns} get pods -l app.kubernetes.io/name={} -o wide; then the logs of a pod that is not ready",
                    install.agent
                ),
            ));
        }
    }
    out.push(agent_rbac(client, install).await);
}

/// The rules of `deploy/rbac.yaml`'s ClusterRole and Role.
fn required_rules() -> (Vec<PolicyRule>, Vec<PolicyRule>) {
    let (mut cluster, mut own) = (Vec::new(), Vec::new());
    for document in serde_norway::Deserializer::from_str(AGENT_RBAC) {
        let Ok(value) = serde_json::Value::deserialize(document) else {
            continue;
        };
        let rules = || -> Vec<PolicyRule> {
            serde_json::from_value(value["rules"].clone()).unwrap_or_default()
        };
        match value["kind"].as_str() {
            Some("ClusterRole") => cluster.extend(rules()),
            Some("Role") => own.extend(rules()),
            _ => {}
        }
    }
    (cluster, own)
}

/// Every (group, resource, verb) the rules grant.
fn grants(rules: &[PolicyRule]) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for rule in rules {
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    out.insert((group.clone(), resource.clone(), verb.clone()));
                }
            }
        }
    }
    out
}

/// Whether `granted` covers `wanted`, wildcards included.
fn covers(granted: &BTreeSet<(String, String, String)>, wanted: &(String, String, String)) -> bool {
    granted.iter().any(|(g, r, v)| {
        (g == &wanted.0 || g == "*") && (r == &wanted.1 || r == "*") && (v == &wanted.2 || v == "*")
    })
}

async fn agent_rbac(client: &kube::Client, install: &Install) -> Outcome {
    let ns = &install.namespace;
    let title = "the agent's RBAC grants what it needs";
    let (cluster_needed, own_needed) = required_rules();
    let roles: Api<ClusterRole> = Api::all(client.clone());
    let bindings: Api<ClusterRoleBinding> = Api::all(client.clone());
    let own_roles: Api<Role> = Api::namespaced(client.clone(), ns);
    let own_bindings: Api<RoleBinding> = Api::namespaced(client.clone(), ns);
    let name = &install.agent;
    let (role, binding, own_role, own_binding) = match (
        roles.get_opt(name).await,
        bindings.get_opt(name).await,
        own_roles.get_opt(name).await,
        own_bindings.get_opt(name).await,
    ) {
        (Ok(a), Ok(b), Ok(c), Ok(d)) => (a, b, c, d),
        _ => {
            return fail(
                AGENT,
                title,
                "cannot read the agent's roles and bindings",
                "run lattice check as a user who may read RBAC objects",
            );
        }
    };
    let mut missing = Vec::new();
    let account = |subjects: Option<&Vec<k8s_openapi::api::rbac::v1::Subject>>| {
        subjects.into_iter().flatten().any(|s| {
            s.kind == "ServiceAccount"
                && &s.name == name
                && s.namespace.as_deref() == Some(ns.as_str())
        })
    };
    let granted = grants(
        role.as_ref()
            .and_then(|r| r.rules.as_deref())
            .unwrap_or_default(),
    );
    for wanted in grants(&cluster_needed) {
        if !covers(&granted, &wanted) {
            missing.push(format!("{} {}.{}", wanted.2, wanted.1, wanted.0));
        }
    }
    let own_granted = grants(
        own_role
            .as_ref()
            .and_then(|r| r.rules.as_deref())
            .unwrap_or_default(),
    );
    for wanted in grants(&own_needed) {
        if !covers(&own_granted, &wanted) {
            missing.push(format!("{} {}.{} in {ns}", wanted.2, wanted.1, wanted.0));
        }
    }
    let bound = binding
        .as_ref()
        .is_some_and(|b| b.role_ref.name == *name && account(b.subjects.as_ref()));
    let own_bound = own_binding
        .as_ref()
        .is_some_and(|b| b.role_ref.name == *name && account(b.subjects.as_ref()));
    if !bound {
        missing.push(format!(
            "ClusterRoleBinding {name} to ServiceAccount {ns}/{name}"
        ));
    }
    if !own_bound && !own_needed.is_empty() {
        missing.push(format!(
            "RoleBinding {ns}/{name} to ServiceAccount {ns}/{name}"
        ));
    }
    if missing.is_empty() {
        pass(AGENT, title)
    } else {
        fail(
            AGENT,
            title,
            format!("missing: {}", missing.join(", ")),
            "apply deploy/rbac.yaml again (kubectl apply -k deploy/)",
        )
    }
}

const INJECTOR: &str = "lattice-injector";

async fn injector(client: &kube::Client, install: &Install, out: &mut Vec<Outcome>) {
    let ns = &install.namespace;
    let name = &install.injector;
    let configurations: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let title = format!("the webhook configuration {name} exists");
    let configuration = match configurations.get_opt(name).await {
        Ok(Some(c)) => {
            out.push(pass(INJECTOR, title));
            c
        }
        _ => {
            out.push(fail(
                INJECTOR,
                title,
                "not found",
                "install it: kubectl apply -k deploy/",
            ));
            return;
        }
    };
    let bundles: Vec<Vec<u8>> = configuration
        .webhooks
        .iter()
        .flatten()
        .filter(|w| {
            w.client_config
                .service
                .as_ref()
                .is_some_and(|s| &s.name == name && &s.namespace == ns)
        })
        .map(|w| {
            w.client_config
                .ca_bundle
                .clone()
                .map(|b| b.0)
                .unwrap_or_default()
        })
        .collect();
    let title = "its CA bundle is a CA valid now";
    let ca = bundles.first().cloned().unwrap_or_default();
    let verdict = if bundles.is_empty() {
        Err("no webhook calls the injector's Service".to_string())
    } else if bundles.iter().any(|b| b != &ca) {
        Err("its webhooks carry different bundles".to_string())
    } else if ca.is_empty() {
        Err("no CA bundle yet".to_string())
    } else {
        ca_left(&ca)
    };
    match verdict {
        Ok(days) if days < 30 => out.push(Outcome {
            section: INJECTOR,
            title: title.to_string(),
            status: Status::Warn(format!("the CA expires in {days} days: the injector replaces it when a third of its life is left; check its logs")),
        }),
        Ok(_) => out.push(pass(INJECTOR, title)),
        Err(found) => out.push(fail(
            INJECTOR,
            title,
            found,
            format!("the injector writes the bundle at start: kubectl -n {ns} logs deploy/{name}"),
        )),
    }

    let title = format!("the injector's Service {ns}/{name} has ready endpoints");
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), ns);
    let ready = match slices.list(&ListParams::default()).await {
        Ok(list) => list
            .items
            .iter()
            .filter(|s| {
                s.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get("kubernetes.io/service-name"))
                    == Some(name)
            })
            .flat_map(|s| &s.endpoints)
            .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) != Some(false))
            .count(),
        Err(_) => 0,
    };
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let available = deployments
        .get_opt(name)
        .await
        .ok()
        .flatten()
        .and_then(|d| d.status)
        .and_then(|s| s.available_replicas)
        .unwrap_or(0);
    if ready > 0 {
        out.push(pass(INJECTOR, title));
    } else {
        out.push(fail(
            INJECTOR,
            title,
            format!("none ({available} replicas available): pods of meshed namespaces cannot be created"),
            format!("kubectl -n {ns} get pods -l app.kubernetes.io/name={name}; kubectl -n {ns} logs deploy/{name}"),
        ));
    }

    let title = "its serving certificate is signed by that CA and names its Service";
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    match secrets.get_opt(&install.injector_secret).await {
        Ok(Some(secret)) => {
            let cert = secret.data.as_ref().and_then(|d| d.get("tls.crt")).map(|c| c.0.clone()).unwrap_or_default();
            let service = format!("{name}.{ns}.svc");
            match signed(&ca, &cert, &service) {
                Ok(()) => out.push(pass(INJECTOR, title)),
                Err(found) => out.push(fail(
                    INJECTOR,
                    title,
                    found,
                    format!("the injector renews it within --recheck-secs; if it does not: kubectl -n {ns} logs deploy/{name}"),
                )),
            }
        }
        Ok(None) => out.push(Outcome {
            section: INJECTOR,
            title: title.to_string(),
            status: Status::Warn(format!(
                "no Secret {ns}/{}: the certificate is not the injector's own (cert-manager?), not checked",
                install.injector_secret
            )),
        }),
        Err(e) => out.push(fail(INJECTOR, title, format!("cannot read the Secret: {e}"), "run lattice check as a user who may read it")),
    }
}

/// Days the CA in `pem` has left; an error when it is no CA or not valid now.
fn ca_left(pem: &[u8]) -> Result<i64, String> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(pem).map_err(|e| format!("not PEM: {e}"))?;
    let cert = pem
        .parse_x509()
        .map_err(|e| format!("not a certificate: {e}"))?;
    if !cert.is_ca() {
        return Err("not a CA certificate".to_string());
    }
    let now = OffsetDateTime::now_utc().unix_timestamp();
    let (start, end) = (
        cert.validity().not_before.timestamp(),
        cert.validity().not_after.timestamp(),
    );
    if now < start || now > end {
        return Err("the CA is not valid now".to_string());
    }
    Ok((end - now) / 86_400)
}

/// Whether `cert` (PEM) is signed by the CA in `ca` (PEM), valid now, and names `service`.
fn signed(ca: &[u8], cert: &[u8], service: &str) -> Result<(), String> {
    let (_, ca_pem) =
        x509_parser::pem::parse_x509_pem(ca).map_err(|e| format!("the bundle: {e}"))?;
    let ca = ca_pem
        .parse_x509()
        .map_err(|e| format!("the bundle: {e}"))?;
    let (_, pem) = x509_parser::pem::parse_x509_pem(cert).map_err(|e| format!("tls.crt: {e}"))?;
    let cert = pem.parse_x509().map_err(|e| format!("tls.crt: {e}"))?;
    cert.verify_signature(Some(ca.public_key())).map_err(|_| {
        "tls.crt is not signed by the bundle's CA: the API server would refuse it".to_string()
    })?;
    let now = OffsetDateTime::now_utc().unix_timestamp();
    if now > cert.validity().not_after.timestamp() {
        return Err("tls.crt has expired".to_string());
    }
    if !crate::certs::dns_names(&cert).iter().any(|n| n == service) {
        return Err(format!("tls.crt does not name {service}"));
    }
    Ok(())
}

const GATEWAY: &str = "gateway-api";

async fn gateway_api(client: &kube::Client, out: &mut Vec<Outcome>) {
    // Listed as dynamic objects: whether the CRD is there is all this asks.
    let kind = GroupVersionKind::gvk("gateway.networking.k8s.io", "v1", "HTTPRoute");
    let routes: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(&kind, "httproutes"),
    );
    let title = "the Gateway API's CRDs";
    match routes.list(&ListParams::default().limit(1)).await {
        Ok(_) => out.push(pass(GATEWAY, "the Gateway API's CRDs are installed: HTTPRoutes and GRPCRoutes are served")),
        Err(kube::Error::Api(status)) if status.code == 404 => out.push(Outcome {
            section: GATEWAY,
            title: title.to_string(),
            status: Status::Warn(
                "not installed: traffic rules come from mesh files only (install the Gateway API's CRDs for HTTPRoutes and GRPCRoutes)".to_string(),
            ),
        }),
        Err(e) => out.push(fail(GATEWAY, title, format!("cannot list HTTPRoutes: {e}"), "check the API server")),
    }
}

const PODS: &str = "mesh pods";

/// At most this many pods are named in a failure.
const SHOWN_PODS: usize = 10;

async fn pods(client: &kube::Client, out: &mut Vec<Outcome>) {
    let pods: Api<Pod> = Api::all(client.clone());
    let title = "every running mesh pod's Envoy holds its configuration";
    let list = match pods.list(&ListParams::default()).await {
        Ok(list) => list,
        Err(e) => {
            out.push(fail(
                PODS,
                title,
                format!("cannot list pods: {e}"),
                "run lattice check as a user who may list pods",
            ));
            return;
        }
    };
    let mut meshed = 0;
    let mut unready = Vec::new();
    for pod in &list.items {
        let is_meshed = pod.spec.as_ref().is_some_and(|s| {
            s.init_containers
                .iter()
                .flatten()
                .any(|c| c.name == PROXY_CONTAINER)
        });
        let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        if !is_meshed || !running {
            continue;
        }
        meshed += 1;
        let ready = pod
            .status
            .as_ref()
            .and_then(|s| s.init_container_statuses.as_ref())
            .and_then(|statuses| statuses.iter().find(|s| s.name == PROXY_CONTAINER))
            .is_some_and(|s| s.ready);
        if !ready {
            let ns = pod.metadata.namespace.clone().unwrap_or_default();
            let name = pod.metadata.name.clone().unwrap_or_default();
            let node = pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default();
            unready.push(format!("{ns}/{name} (node {node})"));
        }
    }
    if unready.is_empty() {
        out.push(pass(PODS, format!("{title} ({meshed} pods)")));
    } else {
        let count = unready.len();
        unready.truncate(SHOWN_PODS);
        out.push(fail(
            PODS,
            title,
            format!("{count} of {meshed} not ready: {}", unready.join(", ")),
            "kubectl -n <namespace> logs <pod> -c lattice-proxy, and the agent on its node: kubectl -n lattice-system logs <agent pod on that node>",
        ));
    }
}
