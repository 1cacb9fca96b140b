//! The install manifests (`deploy/`, `deploy/examples/`) against the code they deploy. Each
//! test renders them with `kubectl kustomize`, as `kubectl apply -k` would, and:
//! (a) parses every object into k8s-openapi types, losing no field on the way;
//! (b) runs every container's command line from the manifests through the real binaries
//!     (`--check-config`; lattice-init for real in a network namespace; Envoy `--mode validate`
//!     on the bootstrap lattice-init wrote), so flags cannot drift from the code;
//! (c) checks the ClusterRole against the requests the real agent makes to a fake API server;
//! (d) checks the manifests' ports against the binaries' defaults and each other;
//! (e) checks that the example is a plain app in a labelled namespace, and that docs/install.md
//!     shows it as `lattice inject` (the webhook's template) admits it;
//! (f) checks the webhook configuration: pod creation only, failing closed, never the system
//!     namespaces;
//! (g) checks the injector's Role and ClusterRole against the requests the real injector makes.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Container, Namespace, PodSpec, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use lattice_e2e::agent::Agent;
use lattice_e2e::fake_apiserver::FakeApiServer;
use lattice_e2e::manifests::{self, command_line, container_env, image_name, pod_specs, root};
use lattice_e2e::netns::Netns;
use lattice_e2e::{bins, envoy, wait};
use serde::Deserialize;
use serde_json::Value;

/// Images the tests do not run: the example's app, which is not ours and has no flags of ours.
const THIRD_PARTY: &[&str] = &["registry.k8s.io/e2e-test-images/agnhost"];

/// `kubectl kustomize <root>/<dir>` as JSON objects.
fn render(dir: &str) -> anyhow::Result<Vec<Value>> {
    manifests::documents(&manifests::render_text(dir)?)
}

/// Both kustomizations: the agent's, and the example's as the injector admits its pods.
fn rendered() -> anyhow::Result<Vec<Value>> {
    let mut objects = render("deploy")?;
    objects.extend(injected(&render("deploy/examples")?)?);
    Ok(objects)
}

/// `objects` through the real `lattice inject`, as YAML documents.
fn injected(objects: &[Value]) -> anyhow::Result<Vec<Value>> {
    let input: Vec<String> = objects
        .iter()
        .map(serde_json::to_string)
        .collect::<Result<_, _>>()?;
    let mut child = Command::new(bins::path("lattice"))
        .args(["inject", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running lattice (cargo build --workspace --bins first)")?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(input.join("\n---\n").as_bytes())?;
    let output = child.wait_with_output()?;
    ensure!(output.status.success(), "lattice inject: {}", show(&output));
    let mut out = Vec::new();
    for document in serde_norway::Deserializer::from_str(&String::from_utf8(output.stdout)?) {
        out.push(Value::deserialize(document)?);
    }
    Ok(out)
}

fn kind(object: &Value) -> &str {
    object["kind"].as_str().unwrap_or_default()
}

fn named(object: &Value) -> String {
    format!(
        "{}/{}",
        kind(object),
        object["metadata"]["name"].as_str().unwrap_or("?")
    )
}

/// The one object of `kind_name` named `name`.
fn only<T: serde::de::DeserializeOwned>(objects: &[Value], kind_name: &str, name: &str) -> T {
    let mut all: Vec<&Value> = objects
        .iter()
        .filter(|o| kind(o) == kind_name && o["metadata"]["name"] == name)
        .collect();
    assert_eq!(all.len(), 1, "expected exactly one {kind_name} {name}");
    let object = all.remove(0);
    serde_json::from_value(object.clone()).unwrap_or_else(|e| panic!("{}: {e}", named(object)))
}

/// Parses `object` as `T` and serializes it back; a field the type does not know (a typo, a
/// wrong nesting) is dropped on the way and shows up as a difference.
fn round_trip<T: serde::de::DeserializeOwned + serde::Serialize>(
    object: &Value,
) -> anyhow::Result<()> {
    let parsed: T = serde_json::from_value(object.clone())
        .with_context(|| format!("{} does not parse", named(object)))?;
    let back = serde_json::to_value(&parsed)?;
    let mut lost = Vec::new();
    diff("", object, &back, &mut lost);
    ensure!(
        lost.is_empty(),
        "{}: fields unknown to k8s-openapi (misspelt or misplaced): {lost:?}",
        named(object)
    );
    Ok(())
}

fn diff(at: &str, original: &Value, back: &Value, lost: &mut Vec<String>) {
    match (original, back) {
        (Value::Object(a), Value::Object(b)) => {
            for (key, value) in a {
                match b.get(key) {
                    Some(other) => diff(&format!("{at}.{key}"), value, other, lost),
                    None => lost.push(format!("{at}.{key}")),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                diff(&format!("{at}[{i}]"), x, y, lost);
            }
        }
        // A schema's bounds are floats in k8s-openapi: 1 reads back as 1.0, the same number.
        (Value::Number(a), Value::Number(b)) if a.as_f64() == b.as_f64() => {}
        (a, b) if a != b => lost.push(format!("{at}: {a} became {b}")),
        _ => {}
    }
}

/// The MeshAuthorization CRD serves the group, version, kind and plural the fake API server
/// serves it at (where the end-to-end tests' real agent reads it), and its schema keeps what
/// the agent reads: every field of a rule, which its pruning would otherwise drop.
fn crd_serves_what_the_agent_reads(object: &Value) -> anyhow::Result<()> {
    let crd: CustomResourceDefinition = serde_json::from_value(object.clone())?;
    let spec = &crd.spec;
    let served = lattice_e2e::fake_apiserver::KINDS
        .iter()
        .find(|k| k.name == spec.names.kind)
        .context("the fake API server does not serve the CRD's kind")?;
    assert_eq!(spec.group, served.group);
    assert_eq!(spec.names.plural, served.plural);
    assert_eq!(spec.scope == "Namespaced", served.namespaced);
    let version = spec
        .versions
        .iter()
        .find(|v| v.name == served.version)
        .context("the version the agent reads is not served")?;
    assert!(version.served && version.storage);
    let schema = serde_json::to_value(&version.schema)?;
    let rule = &schema["openAPIV3Schema"]["properties"]["spec"]["properties"]["rules"]["items"]["properties"];
    for field in ["action", "from", "ports", "paths", "methods"] {
        assert!(
            rule.get(field).is_some(),
            "the schema prunes rules' {field}"
        );
    }
    for field in ["serviceAccount", "namespace", "identity"] {
        assert!(
            rule["from"]["items"]["properties"].get(field).is_some(),
            "the schema prunes from's {field}"
        );
    }
    Ok(())
}

#[test]
fn a_every_object_parses_into_k8s_openapi_types() -> anyhow::Result<()> {
    let objects = rendered()?;
    let mut kinds = BTreeMap::new();
    for object in &objects {
        match kind(object) {
            "Namespace" => round_trip::<Namespace>(object)?,
            "ServiceAccount" => round_trip::<ServiceAccount>(object)?,
            "ClusterRole" => round_trip::<ClusterRole>(object)?,
            "ClusterRoleBinding" => round_trip::<ClusterRoleBinding>(object)?,
            "Role" => round_trip::<Role>(object)?,
            "RoleBinding" => round_trip::<RoleBinding>(object)?,
            "DaemonSet" => round_trip::<DaemonSet>(object)?,
            "Deployment" => round_trip::<Deployment>(object)?,
            "Service" => round_trip::<Service>(object)?,
            "PodDisruptionBudget" => round_trip::<PodDisruptionBudget>(object)?,
            "MutatingWebhookConfiguration" => round_trip::<MutatingWebhookConfiguration>(object)?,
            "CustomResourceDefinition" => {
                round_trip::<CustomResourceDefinition>(object)?;
                crd_serves_what_the_agent_reads(object)?;
            }
            other => bail!("{}: no test covers kind {other}", named(object)),
        }
        *kinds.entry(kind(object).to_string()).or_insert(0) += 1;
    }
    let expected: BTreeMap<String, i32> = [
        ("ClusterRole", 2),
        ("ClusterRoleBinding", 2),
        ("CustomResourceDefinition", 1),
        ("Role", 2),
        ("RoleBinding", 2),
        ("DaemonSet", 1),
        ("Deployment", 2),
        ("MutatingWebhookConfiguration", 1),
        ("Namespace", 2),
        ("PodDisruptionBudget", 1),
        ("Service", 2),
        ("ServiceAccount", 2),
    ]
    .into_iter()
    .map(|(k, n)| (k.to_string(), n))
    .collect();
    assert_eq!(kinds, expected);

    // What the DaemonSet must be for the agent to work on every node, by field.
    let daemonset: DaemonSet = only(&objects, "DaemonSet", "lattice-agent");
    let spec = daemonset.spec.as_ref().context("DaemonSet spec")?;
    assert_eq!(
        spec.update_strategy
            .as_ref()
            .and_then(|s| s.type_.as_deref()),
        Some("RollingUpdate")
    );
    // An upgrade starts the new agent beside the old and never leaves a node without one.
    let rolling = spec
        .update_strategy
        .as_ref()
        .and_then(|s| s.rolling_update.as_ref())
        .context("no rollingUpdate")?;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    assert_eq!(rolling.max_surge, Some(IntOrString::Int(1)));
    assert_eq!(rolling.max_unavailable, Some(IntOrString::Int(0)));
    let pod = pod_spec_of(&spec.template.spec)?;
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(pod.dns_policy.as_deref(), Some("ClusterFirstWithHostNet"));
    let agent = &pod.containers[0];
    let fields = env_fields(agent);
    assert_eq!(
        fields.get("NODE_NAME").map(String::as_str),
        Some("spec.nodeName")
    );
    let resources = agent.resources.as_ref().context("agent resources")?;
    // The agent's memory is the sizing table's 10k row (docs/install.md), which the xDS
    // benchmark holds to what it measures.
    let ten_k = lattice_e2e::sizing::read(&root())?
        .into_iter()
        .find(|row| row.services == 10_000)
        .context("the sizing table has no 10k row")?;
    let mib = |quantities: &Option<BTreeMap<String, Quantity>>| -> anyhow::Result<f64> {
        let memory = quantities
            .as_ref()
            .and_then(|q| q.get("memory"))
            .context("no memory")?;
        let number = memory.0.strip_suffix("Mi").context("memory not in Mi")?;
        Ok(number.parse()?)
    };
    assert!(
        mib(&resources.requests)? >= ten_k.peak_mib,
        "the agent's memory request is below the 10k row's measured peak, {} MiB",
        ten_k.peak_mib
    );
    assert_eq!(
        mib(&resources.limits)?,
        ten_k.limit_mib,
        "the agent's memory limit is not the 10k row's"
    );
    let security = agent
        .security_context
        .as_ref()
        .context("agent securityContext")?;
    assert_eq!(security.read_only_root_filesystem, Some(true));
    assert_eq!(security.allow_privilege_escalation, Some(false));
    assert_ne!(security.privileged, Some(true));
    let caps = security
        .capabilities
        .as_ref()
        .context("agent capabilities")?;
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_string()][..]));
    let added: BTreeSet<&str> = caps.add.iter().flatten().map(String::as_str).collect();
    assert_eq!(added, BTreeSet::from(["NET_ADMIN", "NET_BIND_SERVICE"]));
    assert!(agent.liveness_probe.is_some() && agent.readiness_probe.is_some());

    // The example's pod: init with NET_ADMIN as root, Envoy as 1337, the shared emptyDir.
    let deployment: Deployment = only(&objects, "Deployment", "echo");
    let pod = pod_spec_of(&deployment.spec.as_ref().context("spec")?.template.spec)?;
    let init = pod
        .init_containers
        .iter()
        .flatten()
        .find(|c| c.name == "lattice-init")
        .context("lattice-init initContainer")?;
    let security = init
        .security_context
        .as_ref()
        .context("init securityContext")?;
    assert_eq!(security.run_as_user, Some(0));
    assert!(
        security
            .capabilities
            .as_ref()
            .and_then(|c| c.add.as_ref())
            .is_some_and(|add| add.iter().any(|c| c == "NET_ADMIN"))
    );
    let fields = env_fields(init);
    for (name, path) in [
        ("POD_NAME", "metadata.name"),
        ("POD_NAMESPACE", "metadata.namespace"),
    ] {
        assert_eq!(fields.get(name).map(String::as_str), Some(path), "{name}");
    }
    let service: Service = only(&objects, "Service", "echo");
    let path = service
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("lattice.mlab.com/path"))
        .context("the example Service has no lattice.mlab.com/path")?;
    assert!(path.starts_with('/'), "{path}");
    for port in service.spec.iter().flat_map(|s| s.ports.iter().flatten()) {
        assert!(port.name.as_deref().is_some_and(|n| n.starts_with("http")));
    }
    Ok(())
}

fn pod_spec_of(spec: &Option<PodSpec>) -> anyhow::Result<&PodSpec> {
    spec.as_ref().context("pod template without spec")
}

/// Env var name → downward-API field path, for the vars that come from one.
fn env_fields(container: &Container) -> BTreeMap<String, String> {
    container
        .env
        .iter()
        .flatten()
        .filter_map(|e| {
            let path = e
                .value_from
                .as_ref()?
                .field_ref
                .as_ref()?
                .field_path
                .clone();
            Some((e.name.clone(), path))
        })
        .collect()
}

fn run(mut command: Command) -> anyhow::Result<Output> {
    let shown = format!("{command:?}");
    command
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {shown}"))
}

fn show(output: &Output) -> String {
    format!(
        "{}\nstdout: {}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// A kubeconfig that parses but points at nothing: `--check-config` builds the client config
/// without contacting the server.
fn dummy_kubeconfig(dir: &Path) -> anyhow::Result<PathBuf> {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: none\n  cluster:\n    server: \
         http://127.0.0.1:1\nusers:\n- name: none\n  user: {}\ncontexts:\n- name: none\n  \
         context:\n    cluster: none\n    user: none\ncurrent-context: none\n",
    )?;
    Ok(path)
}

#[test]
fn b_every_container_command_line_is_accepted_by_the_real_binary() -> anyhow::Result<()> {
    let objects = rendered()?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dummy_kubeconfig(dir.path())?;
    let mut checked = BTreeSet::new();
    for (owner, pod) in pod_specs(&objects)? {
        let containers = pod.init_containers.iter().flatten().chain(&pod.containers);
        for container in containers {
            let env = container_env(container)?;
            let (program, args) = command_line(container, &env)?;
            let image = image_name(container);
            let what = format!(
                "{owner} container {}: {program} {}",
                container.name,
                args.join(" ")
            );
            match (image.as_str(), program.as_str()) {
                ("lattice", "lattice-agent" | "lattice-init") => {
                    let output = run(check_config(&program, &args, &env, &kubeconfig))?;
                    assert!(output.status.success(), "{what}\n{}", show(&output));
                }
                ("lattice", "lattice") => {
                    let mut command = Command::new(bins::path(&program));
                    command
                        .args(&args)
                        .arg("--check-config")
                        .env_clear()
                        .envs(env.iter().map(|(k, v)| (k, v)))
                        .env("KUBECONFIG", &kubeconfig);
                    let output = run(command)?;
                    assert!(output.status.success(), "{what}\n{}", show(&output));
                }
                ("envoyproxy/envoy", "envoy") => {
                    let output = validate_envoy(&pod, container, &args)?;
                    assert!(output.status.success(), "{what}\n{}", show(&output));
                }
                (image, _) if THIRD_PARTY.contains(&image) => continue,
                _ => panic!("{what}: image {image} with program {program} is not covered"),
            }
            checked.insert(container.name.clone());
        }
    }
    assert_eq!(
        checked,
        BTreeSet::from([
            "agent".into(),
            "injector".into(),
            "lattice-init".into(),
            "lattice-proxy".into()
        ])
    );
    Ok(())
}

/// `program` (one of ours) with a container's `args` and `env`, and `--check-config`: it reads
/// its configuration, says what is wrong, and exits.
fn check_config(
    program: &str,
    args: &[String],
    env: &[(String, String)],
    kubeconfig: &Path,
) -> Command {
    let mut command = Command::new(bins::path(program));
    command
        .args(args)
        .arg("--check-config")
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("KUBECONFIG", kubeconfig);
    command
}

/// Runs the pod's lattice-init for real in a fresh network namespace (as in the pod), with
/// the shared emptyDir mapped to a temp dir, then Envoy `--mode validate` with the sidecar's
/// arguments on the bootstrap init wrote.
fn validate_envoy(pod: &PodSpec, sidecar: &Container, args: &[String]) -> anyhow::Result<Output> {
    let volumes = tempfile::tempdir()?;
    let mapped = |container: &Container, word: &str| -> String {
        let mut word = word.to_string();
        for mount in container.volume_mounts.iter().flatten() {
            let dir = volumes.path().join(&mount.name);
            word = word.replace(&mount.mount_path, &dir.to_string_lossy());
        }
        word
    };
    for volume in pod.volumes.iter().flatten() {
        std::fs::create_dir_all(volumes.path().join(&volume.name))?;
    }
    let init = manifests::init_container_running(pod, "lattice-init")
        .context("no lattice-init in the pod that runs Envoy")?;
    let env = container_env(init)?;
    let (_, init_args) = command_line(init, &env)?;
    let netns = Netns::new("deploy-init")?;
    let mut command = netns.command(bins::path("lattice-init"));
    command
        .args(init_args.iter().map(|a| mapped(init, a)))
        .envs(env.iter().map(|(k, v)| (k, v)));
    let output = run(command)?;
    ensure!(
        output.status.success(),
        "lattice-init in a pod namespace\n{}",
        show(&output)
    );

    let args: Vec<String> = args.iter().map(|a| mapped(sidecar, a)).collect();
    let config = args
        .iter()
        .skip_while(|a| *a != "--config-path" && *a != "-c")
        .nth(1)
        .context("the sidecar's command line names no --config-path")?;
    let bootstrap: Value = serde_json::from_str(&std::fs::read_to_string(config)?)?;
    check_probes(sidecar, &bootstrap)?;
    let mut command = Command::new(envoy::binary());
    command.arg("--mode").arg("validate").args(&args);
    run(command)
}

/// The sidecar's startup and readiness probes ask the readiness endpoint of the bootstrap
/// lattice-init wrote: a static listener on the probe's port whose routes match its path. So
/// the app (started after the startup probe) starts only once Envoy holds its configuration.
fn check_probes(sidecar: &Container, bootstrap: &Value) -> anyhow::Result<()> {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    ensure!(
        sidecar.restart_policy.as_deref() == Some("Always"),
        "Envoy must be a native sidecar (an init container with restartPolicy Always)"
    );
    let probes = [
        ("startupProbe", &sidecar.startup_probe),
        ("readinessProbe", &sidecar.readiness_probe),
    ];
    for (what, probe) in probes {
        let get = probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
            .with_context(|| format!("the Envoy sidecar has no httpGet {what}"))?;
        let port = match &get.port {
            IntOrString::Int(port) => *port,
            IntOrString::String(name) => sidecar
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(name))
                .map(|p| p.container_port)
                .with_context(|| format!("{what}: no container port named {name}"))?,
        };
        let path = get.path.as_deref().unwrap_or("/");
        assert_eq!(
            port,
            i32::from(lattice_contract::ENVOY_READINESS_PORT),
            "{what}"
        );
        assert_eq!(path, lattice_contract::ENVOY_READINESS_PATH, "{what}");
        let listener = bootstrap["static_resources"]["listeners"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|l| l["address"]["socket_address"]["port_value"] == port)
            .with_context(|| format!("{what}: no listener on port {port} in the bootstrap"))?;
        let routes = &listener["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"]
            [0]["routes"];
        ensure!(
            routes
                .as_array()
                .into_iter()
                .flatten()
                .any(|r| r["match"]["path"] == path),
            "{what}: the listener on {port} has no route for {path}: {listener}"
        );
    }
    Ok(())
}

/// A TCP relay that records the request line of every HTTP request passing through.
struct RecordingProxy {
    addr: std::net::SocketAddr,
    requests: Arc<Mutex<Vec<String>>>,
}

impl RecordingProxy {
    fn start(upstream: std::net::SocketAddr) -> anyhow::Result<RecordingProxy> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let requests = Arc::new(Mutex::new(Vec::new()));
        let log = requests.clone();
        // Threads end when the test process does; the agent is killed first.
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                let log = log.clone();
                let (Ok(client_read), Ok(server_write)) = (client.try_clone(), server.try_clone())
                else {
                    continue;
                };
                std::thread::spawn(move || relay(client_read, server_write, Some(log)));
                std::thread::spawn(move || relay(server, client, None));
            }
        });
        Ok(RecordingProxy { addr, requests })
    }

    fn requests(&self) -> Vec<String> {
        self.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

fn relay(mut from: TcpStream, mut to: TcpStream, log: Option<Arc<Mutex<Vec<String>>>>) {
    let mut buf = [0u8; 16 * 1024];
    let mut pending: Vec<u8> = Vec::new();
    // Bytes of the current request's body still to pass over (its Content-Length).
    let mut body_left = 0usize;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(log) = &log {
            pending.extend_from_slice(&buf[..n]);
            loop {
                if body_left > 0 {
                    let skipped = body_left.min(pending.len());
                    pending.drain(..skipped);
                    body_left -= skipped;
                    if body_left > 0 {
                        break;
                    }
                }
                // A whole head: its request line, and the length of the body after it.
                let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") else {
                    break;
                };
                let head: Vec<u8> = pending.drain(..end + 4).collect();
                let head = String::from_utf8_lossy(&head);
                let mut lines = head.split("\r\n");
                let mut words = lines.next().unwrap_or_default().split(' ');
                if let (Some(method), Some(target), Some(version)) =
                    (words.next(), words.next(), words.next())
                    && version.starts_with("HTTP/")
                    && target.starts_with('/')
                    && let Ok(mut log) = log.lock()
                {
                    log.push(format!("{method} {target}"));
                }
                body_left = lines
                    .filter_map(|l| l.split_once(':'))
                    .find(|(name, _)| name.trim().eq_ignore_ascii_case("content-length"))
                    .and_then(|(_, value)| value.trim().parse().ok())
                    .unwrap_or(0);
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// `GET /apis/discovery.k8s.io/v1/namespaces/x/endpointslices?watch=true` → (group, resource,
/// verb, name) as RBAC sees it: GET is get, list or watch, POST create, PUT update.
fn rbac_request(request: &str) -> anyhow::Result<(String, String, String, String)> {
    let (method, target) = request.split_once(' ').context("request line")?;
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (group, rest) = match segments.as_slice() {
        ["api", _version, rest @ ..] => (String::new(), rest),
        ["apis", group, _version, rest @ ..] => (group.to_string(), rest),
        _ => bail!("not a resource request: {request}"),
    };
    let rest = match rest {
        ["namespaces", _ns, rest @ ..] if !rest.is_empty() => rest,
        rest => rest,
    };
    let (resource, name) = match rest {
        [resource] => (resource.to_string(), String::new()),
        [resource, name] => (resource.to_string(), name.to_string()),
        _ => bail!("unexpected resource path: {request}"),
    };
    let watch = query
        .split('&')
        .any(|p| p == "watch=true" || p == "watch=1");
    let verb = match (method, name.is_empty(), watch) {
        ("GET", _, true) => "watch",
        ("GET", false, false) => "get",
        ("GET", true, false) => "list",
        ("POST", true, _) => "create",
        ("PUT", false, _) => "update",
        _ => bail!("unexpected request: {request}"),
    };
    Ok((group, resource, verb.to_string(), name))
}

/// The agent's requests, which only read: (group, resource, verb).
fn rbac_of(request: &str) -> anyhow::Result<(String, String, String)> {
    ensure!(
        request.starts_with("GET "),
        "the agent made a request that is no read: {request}"
    );
    let (group, resource, verb, _) = rbac_request(request)?;
    Ok((group, resource, verb))
}

#[test]
fn c_cluster_role_grants_exactly_what_the_kubernetes_source_uses() -> anyhow::Result<()> {
    let objects = rendered()?;
    let role: ClusterRole = only(&objects, "ClusterRole", "lattice-agent");
    // The Role grants what the agent reads in its own namespace (the path grants ConfigMap).
    let own: Role = only(&objects, "Role", "lattice-agent");
    let own_binding: RoleBinding = only(&objects, "RoleBinding", "lattice-agent");
    assert_eq!(own_binding.role_ref.kind, "Role");
    assert_eq!(Some(own_binding.role_ref.name.clone()), own.metadata.name);
    assert_eq!(own.metadata.namespace.as_deref(), Some("lattice-system"));
    assert_eq!(own_binding.metadata.namespace, own.metadata.namespace);
    let mut granted = BTreeSet::new();
    for rule in role
        .rules
        .iter()
        .flatten()
        .chain(own.rules.iter().flatten())
    {
        assert!(rule.non_resource_urls.is_none(), "{rule:?}");
        // Names limit only the CA's Secret, the one Secret the agent reads.
        match rule.resources.as_deref() {
            Some([secrets]) if secrets == "secrets" => assert_eq!(
                rule.resource_names.as_deref(),
                Some(&["lattice-ca".to_string()][..]),
                "{rule:?}"
            ),
            _ => assert!(rule.resource_names.is_none(), "{rule:?}"),
        }
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    assert!(
                        ![group, resource, verb].iter().any(|s| s.contains('*')),
                        "wildcard in {rule:?}"
                    );
                    granted.insert((group.clone(), resource.clone(), verb.clone()));
                }
            }
        }
    }

    // The binding gives the role to the DaemonSet's service account, in its namespace.
    let binding: ClusterRoleBinding = only(&objects, "ClusterRoleBinding", "lattice-agent");
    let daemonset: DaemonSet = only(&objects, "DaemonSet", "lattice-agent");
    assert_eq!(binding.role_ref.kind, "ClusterRole");
    assert_eq!(Some(binding.role_ref.name), role.metadata.name);
    let pod = pod_spec_of(&daemonset.spec.as_ref().context("spec")?.template.spec)?;
    let subjects = binding.subjects.unwrap_or_default();
    assert_eq!(subjects.len(), 1);
    assert_eq!(subjects[0].kind, "ServiceAccount");
    assert_eq!(Some(&subjects[0].name), pod.service_account_name.as_ref());
    assert_eq!(subjects[0].namespace, daemonset.metadata.namespace);

    // What the real agent asks of the API, cluster-wide as the DaemonSet runs it.
    let api = FakeApiServer::start()?;
    let proxy = RecordingProxy::start(api.addr())?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        api.kubeconfig()
            .replace(&api.url(), &format!("http://{}", proxy.addr)),
    )?;
    let kubeconfig = kubeconfig.to_string_lossy().into_owned();
    // With NODE_NAME, as the DaemonSet sets it: the agent watches its node's Pods too.
    let agent = Agent::start_with_env(
        &[],
        &[("KUBECONFIG", kubeconfig.as_str()), ("NODE_NAME", "node-a")],
    );
    agent.wait_ready()?;
    // Ready means the initial lists are done; the watches that follow them start a moment
    // later, each on its own: wait until every list and watch granted has been used (or time
    // out, and the assertions below say which was not).
    let wanted: BTreeSet<(String, String, String)> =
        granted.iter().filter(|g| g.2 != "get").cloned().collect();
    let seen = |proxy: &RecordingProxy| -> Result<BTreeSet<(String, String, String)>, String> {
        proxy
            .requests()
            .iter()
            .map(|r| rbac_of(r))
            .collect::<anyhow::Result<_>>()
            .map_err(|e| e.to_string())
    };
    let _ = wait::until(
        "a list and a watch of every resource granted",
        Duration::from_secs(10),
        || {
            let used = seen(&proxy)?;
            if wanted.is_subset(&used) {
                Ok(())
            } else {
                Err(format!(
                    "{:?}",
                    wanted.difference(&used).collect::<Vec<_>>()
                ))
            }
        },
    );
    let used = seen(&proxy).map_err(anyhow::Error::msg)?;
    drop(agent);

    for request in &used {
        assert!(
            granted.contains(request),
            "the agent uses {request:?}, which the ClusterRole does not grant"
        );
    }
    let resources = |set: &BTreeSet<(String, String, String)>| -> BTreeSet<(String, String)> {
        set.iter().map(|(g, r, _)| (g.clone(), r.clone())).collect()
    };
    assert_eq!(
        resources(&granted),
        resources(&used),
        "resources granted vs used"
    );
    // Beyond what the watchers use, only `get` (debugging with the agent's identity).
    for grant in &granted {
        assert!(
            used.contains(grant) || grant.2 == "get",
            "{grant:?} is granted but never used"
        );
    }
    Ok(())
}

/// `[default: …]` values from a binary's `--help`, by long flag.
fn help_defaults(binary: &str) -> anyhow::Result<BTreeMap<String, String>> {
    let output = run({
        let mut command = Command::new(bins::path(binary));
        command.arg("--help");
        command
    })?;
    ensure!(
        output.status.success(),
        "{binary} --help\n{}",
        show(&output)
    );
    let text = String::from_utf8(output.stdout)?;
    let mut defaults = BTreeMap::new();
    let mut flag = None;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with('-') {
            flag = trimmed
                .split([' ', ','])
                .find(|w| w.starts_with("--"))
                .map(str::to_string);
        } else if let (Some(flag), Some(start)) = (&flag, trimmed.find("[default: ")) {
            let value = &trimmed[start + "[default: ".len()..];
            defaults.insert(flag.clone(), value.trim_end_matches(']').to_string());
        }
    }
    Ok(defaults)
}

/// A flag's value on a command line (`--flag=v` or `--flag v`), else the binary's default.
fn effective(args: &[String], flag: &str, defaults: &BTreeMap<String, String>) -> Option<String> {
    let mut words = args.iter();
    while let Some(word) = words.next() {
        if let Some(value) = word.strip_prefix(&format!("{flag}=")) {
            return Some(value.to_string());
        }
        if word == flag {
            return words.next().cloned();
        }
    }
    defaults.get(flag).cloned()
}

#[test]
fn d_ports_in_the_manifests_match_the_binaries() -> anyhow::Result<()> {
    let objects = rendered()?;
    let agent_defaults = help_defaults("lattice-agent")?;
    let init_defaults = help_defaults("lattice-init")?;
    let specs = pod_specs(&objects)?;

    let (_, node) = specs
        .iter()
        .find(|(owner, _)| owner.starts_with("DaemonSet/"))
        .context("no DaemonSet")?;
    let agent = &node.containers[0];
    let (_, args) = command_line(agent, &container_env(agent)?)?;
    let addr = |flag: &str| -> anyhow::Result<std::net::SocketAddr> {
        effective(&args, flag, &agent_defaults)
            .with_context(|| format!("{flag}: neither in the manifest nor a default"))?
            .parse()
            .with_context(|| format!("{flag} is not an address"))
    };
    // No declared ports: with hostNetwork they are host ports, and the scheduler would never
    // place an upgrade's new agent beside the old one (docs/install.md).
    assert_eq!(agent.ports, None, "the agent declares host ports");

    // xDS: the agent's default port.
    let xds = addr("--xds-addr")?;
    let default_xds: std::net::SocketAddr = agent_defaults["--xds-addr"].parse()?;
    assert_eq!(xds.port(), default_xds.port());

    // DNS: port 53 in a cluster (docs/architecture.md), UDP and TCP, on the node-local address.
    let dns = addr("--dns-addr")?;
    assert_eq!(dns.port(), 53);
    let node_local = effective(&args, "--node-local-dns", &agent_defaults)
        .context("the DaemonSet does not set --node-local-dns")?;
    assert_eq!(dns.ip().to_string(), node_local);
    assert_eq!(node_local, "169.254.20.10");

    // Admin on loopback; the probes ask this pod's agent on its own socket, which lies in a
    // volume of the pod's own, and the real binary answers them.
    let admin = addr("--admin-addr")?;
    assert_eq!(admin.to_string(), agent_defaults["--admin-addr"]);
    let socket = effective(&args, "--admin-socket", &agent_defaults)
        .context("the DaemonSet does not set --admin-socket")?;
    let mount = agent
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| Path::new(&socket).parent() == Some(Path::new(&m.mount_path)))
        .context("the admin socket's directory is not a volume")?;
    let volume = node
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .context("no volume for the admin socket")?;
    assert!(
        volume.empty_dir.is_some(),
        "the admin socket's volume is the pod's own"
    );
    // The agent drains within the grace period the kubelet gives it before SIGKILL.
    let drain: i64 = effective(&args, "--drain-timeout-secs", &agent_defaults)
        .context("--drain-timeout-secs")?
        .parse()?;
    assert!(node.termination_grace_period_seconds.unwrap_or(30) > drain);
    let running = Agent::start(&[
        "--mesh-file",
        &root().join("examples/mesh.yaml").to_string_lossy(),
    ]);
    running.wait_ready()?;
    for (probe, path) in [
        (&agent.liveness_probe, "/healthz"),
        (&agent.readiness_probe, "/readyz"),
    ] {
        let command = probe
            .as_ref()
            .and_then(|p| p.exec.as_ref())
            .and_then(|e| e.command.clone())
            .context("probe without exec")?;
        assert_eq!(command[0], "lattice-agent");
        assert_eq!(
            effective(&command, "--admin-socket", &BTreeMap::new()).as_deref(),
            Some(socket.as_str()),
            "{command:?}"
        );
        assert_eq!(
            effective(&command, "--probe", &BTreeMap::new()).as_deref(),
            Some(path)
        );
        // The same command, on a running agent's socket.
        let output = run({
            let mut c = Command::new(bins::path("lattice-agent"));
            c.args(
                command[1..]
                    .iter()
                    .map(|w| match w.strip_prefix("--admin-socket=") {
                        Some(_) => format!("--admin-socket={}", running.admin_socket().display()),
                        None => w.clone(),
                    }),
            );
            c
        })?;
        assert!(output.status.success(), "{command:?}: {}", show(&output));
    }

    // The mesh pod: init's xDS port is the agent's; Envoy runs as the UID init exempts; the
    // app asks the node-local address; the Service's named target port exists.
    let (_, pod) = specs
        .iter()
        .find(|(owner, _)| owner == "Deployment/echo")
        .context("no Deployment/echo")?;
    let init = pod
        .init_containers
        .iter()
        .flatten()
        .find(|c| c.name == "lattice-init")
        .context("lattice-init")?;
    let init_env = container_env(init)?;
    let (_, init_args) = command_line(init, &init_env)?;
    // Envoy connects where the agent serves: the node-local address, init's default.
    assert_eq!(xds.ip().to_string(), node_local, "the agent's --xds-addr");
    match effective(&init_args, "--xds-address", &init_defaults) {
        Some(address) => assert_eq!(address, xds.to_string()),
        // No default in --help (it is computed): the documented one.
        None => {
            let help = String::from_utf8(
                run({
                    let mut c = Command::new(bins::path("lattice-init"));
                    c.arg("--help");
                    c
                })?
                .stdout,
            )?;
            assert!(help.contains(&format!("`{xds}`")), "{help}");
        }
    }
    // The capture port: where init redirects is where the agent's listener listens.
    assert_eq!(
        effective(&init_args, "--envoy-port", &init_defaults),
        effective(&args, "--envoy-port", &agent_defaults),
        "lattice-init's --envoy-port and the agent's"
    );
    let envoy_uid: i64 = effective(&init_args, "--envoy-uid", &init_defaults)
        .context("--envoy-uid")?
        .parse()?;
    let sidecar = pod
        .init_containers
        .iter()
        .flatten()
        .chain(&pod.containers)
        .find(|c| image_name(c) == "envoyproxy/envoy")
        .context("no Envoy sidecar")?;
    assert_eq!(
        sidecar
            .security_context
            .as_ref()
            .and_then(|s| s.run_as_user),
        Some(envoy_uid)
    );
    let nameservers = pod
        .dns_config
        .as_ref()
        .and_then(|d| d.nameservers.clone())
        .unwrap_or_default();
    assert_eq!(nameservers, vec![node_local]);
    assert_eq!(pod.dns_policy.as_deref(), Some("None"));

    let service: Service = only(&objects, "Service", "echo");
    let named_ports: BTreeSet<String> = pod
        .containers
        .iter()
        .flat_map(|c| c.ports.iter().flatten())
        .filter_map(|p| p.name.clone())
        .collect();
    for port in service.spec.iter().flat_map(|s| s.ports.iter().flatten()) {
        if let Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(name)) =
            &port.target_port
        {
            assert!(
                named_ports.contains(name),
                "targetPort {name} not on any container"
            );
        }
    }
    Ok(())
}

#[test]
fn dockerfile_copies_only_paths_that_exist_and_ships_every_binary() -> anyhow::Result<()> {
    let dockerfile = std::fs::read_to_string(root().join("deploy/Dockerfile"))?;
    let mut final_copy = String::new();
    for line in dockerfile.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix("COPY ") else {
            continue;
        };
        if rest.starts_with("--from") {
            final_copy = rest.to_string();
            continue;
        }
        let words: Vec<&str> = rest.split_whitespace().collect();
        let (_, sources) = words.split_last().context("COPY without destination")?;
        for source in sources {
            assert!(
                root().join(source).exists(),
                "COPY {source}: no such path in the repository"
            );
        }
    }
    for binary in ["lattice-agent", "lattice-init", "lattice"] {
        assert!(
            final_copy
                .split_whitespace()
                .any(|w| w.ends_with(&format!("/{binary}"))),
            "the image ships no {binary}"
        );
    }
    assert!(
        dockerfile.contains("iptables"),
        "lattice-init needs iptables in the image"
    );

    // Every workspace member is copied, or cargo cannot load the workspace.
    let manifest = std::fs::read_to_string(root().join("Cargo.toml"))?;
    let members = manifest
        .lines()
        .find(|l| l.trim_start().starts_with("members"))
        .context("workspace members")?;
    for member in members.split('"').skip(1).step_by(2) {
        assert!(
            dockerfile.contains(&format!("COPY {member} {member}")),
            "workspace member {member} is not copied"
        );
    }
    Ok(())
}

/// The example is a plain app in a namespace labelled for injection, and docs/install.md's
/// copy of it as admitted is exactly what `lattice inject` (the webhook's template) makes of
/// it. The injected pod is what (b) runs: lattice-init in a network namespace, Envoy on its
/// bootstrap.
#[test]
fn e_the_example_is_plain_and_the_docs_show_it_as_injected() -> anyhow::Result<()> {
    let plain = render("deploy/examples")?;
    let namespace: Namespace = only(&plain, "Namespace", "lattice-demo");
    let label = namespace
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("lattice.mlab.com/inject"));
    assert_eq!(label.map(String::as_str), Some("enabled"));
    let deployment: Deployment = only(&plain, "Deployment", "echo");
    let pod = pod_spec_of(&deployment.spec.as_ref().context("spec")?.template.spec)?;
    assert!(pod.init_containers.is_none() && pod.volumes.is_none() && pod.dns_config.is_none());

    let admitted = injected(&plain)?;
    let deployment = admitted
        .iter()
        .find(|o| kind(o) == "Deployment")
        .context("the injected Deployment")?;
    let shown: Value = serde_norway::from_str(&install_guide_block("injected-example")?)?;
    assert_eq!(
        &shown, deployment,
        "docs/install.md's injected example differs from `kubectl kustomize deploy/examples | \
         lattice inject`: regenerate it"
    );
    Ok(())
}

/// The YAML block of docs/install.md after the comment `<!-- {marker}`.
fn install_guide_block(marker: &str) -> anyhow::Result<String> {
    let docs = std::fs::read_to_string(root().join("docs/install.md"))?;
    docs.split_once(&format!("<!-- {marker}"))
        .and_then(|(_, rest)| rest.split_once("```yaml\n"))
        .and_then(|(_, rest)| rest.split_once("```"))
        .map(|(block, _)| block.to_string())
        .with_context(|| format!("docs/install.md has no {marker} block"))
}

/// docs/install.md's patch for Istio's certificate service applies to the rendered DaemonSet,
/// which still parses, mounts what the agent's defaults read (`--istio-ca-token`,
/// `--istio-ca-roots`), and whose command line the real agent accepts.
#[test]
fn h_the_install_guides_istio_ca_patch_applies_and_the_agent_takes_it() -> anyhow::Result<()> {
    let objects = rendered()?;
    let mut daemonset = objects
        .iter()
        .find(|o| kind(o) == "DaemonSet")
        .context("the DaemonSet")?
        .clone();
    let patch: json_patch::Patch = serde_norway::from_str(&install_guide_block("istio-ca-patch")?)?;
    json_patch::patch(&mut daemonset, &patch)?;
    round_trip::<DaemonSet>(&daemonset)?;
    let parsed: DaemonSet = serde_json::from_value(daemonset)?;
    let pod = pod_spec_of(&parsed.spec.as_ref().context("spec")?.template.spec)?;
    let agent = pod
        .containers
        .iter()
        .find(|c| c.name == "agent")
        .context("the agent container")?;
    let env = container_env(agent)?;
    let (program, args) = command_line(agent, &env)?;
    let defaults = help_defaults("lattice-agent")?;
    for flag in ["--istio-ca-token", "--istio-ca-roots"] {
        let path = effective(&args, flag, &defaults).context(flag)?;
        let mounted = agent
            .volume_mounts
            .iter()
            .flatten()
            .any(|m| Path::new(&path).starts_with(&m.mount_path) && m.read_only == Some(true));
        ensure!(
            mounted,
            "{flag} {path} is on no read-only mount of the patched DaemonSet"
        );
    }
    let dir = tempfile::tempdir()?;
    let kubeconfig = dummy_kubeconfig(dir.path())?;
    let output = run(check_config(&program, &args, &env, &kubeconfig))?;
    ensure!(output.status.success(), "{}", show(&output));
    ensure!(
        args.iter()
            .any(|a| a.starts_with("--istio-ca-addr=https://")),
        "the patch names the service: {args:?}"
    );
    Ok(())
}

/// The webhook configuration sends pod creations only, never the system namespaces or the
/// injector's own, and fails closed: while no injector answers, pods of meshed namespaces are
/// not created (their controllers retry) rather than started outside the mesh.
#[test]
fn f_the_webhook_configuration_fails_closed_for_pod_creation_only() -> anyhow::Result<()> {
    let objects = rendered()?;
    let configuration: MutatingWebhookConfiguration =
        only(&objects, "MutatingWebhookConfiguration", "lattice-injector");
    let service: Service = only(&objects, "Service", "lattice-injector");
    let webhooks = configuration.webhooks.unwrap_or_default();
    assert_eq!(webhooks.len(), 2);
    for webhook in &webhooks {
        let name = &webhook.name;
        assert_eq!(webhook.failure_policy.as_deref(), Some("Fail"), "{name}");
        assert_eq!(
            webhook.side_effects, "None",
            "{name}: dry runs must be sent"
        );
        assert_eq!(webhook.admission_review_versions, ["v1"], "{name}");
        let rules = webhook.rules.clone().unwrap_or_default();
        assert_eq!(rules.len(), 1, "{name}");
        assert_eq!(
            rules[0].operations.as_deref(),
            Some(&["CREATE".to_string()][..])
        );
        assert_eq!(
            rules[0].resources.as_deref(),
            Some(&["pods".to_string()][..])
        );
        assert_eq!(rules[0].api_groups.as_deref(), Some(&[String::new()][..]));
        let target = webhook
            .client_config
            .service
            .as_ref()
            .context("a service")?;
        assert_eq!(Some(&target.name), service.metadata.name.as_ref());
        assert_eq!(Some(&target.namespace), service.metadata.namespace.as_ref());
        assert_eq!(target.path.as_deref(), Some("/inject"));
        let excluded: BTreeSet<String> = webhook
            .namespace_selector
            .iter()
            .flat_map(|s| s.match_expressions.iter().flatten())
            .filter(|e| e.key == "kubernetes.io/metadata.name" && e.operator == "NotIn")
            .flat_map(|e| e.values.clone().unwrap_or_default())
            .collect();
        for namespace in lattice_inject::review::SYSTEM_NAMESPACES
            .iter()
            .copied()
            .chain(["lattice-system"])
        {
            assert!(excluded.contains(namespace), "{name} may send {namespace}");
        }
        assert!(webhook.timeout_seconds.is_some_and(|t| t <= 10), "{name}");
    }
    // The Service's port reaches the injector's.
    let deployment: Deployment = only(&objects, "Deployment", "lattice-injector");
    let pod = pod_spec_of(&deployment.spec.as_ref().context("spec")?.template.spec)?;
    let container_ports: BTreeSet<String> = pod.containers[0]
        .ports
        .iter()
        .flatten()
        .filter_map(|p| p.name.clone())
        .collect();
    for port in service.spec.iter().flat_map(|s| s.ports.iter().flatten()) {
        assert_eq!(
            port.port, 443,
            "the API server calls port 443 unless told otherwise"
        );
        if let Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(name)) =
            &port.target_port
        {
            assert!(container_ports.contains(name), "targetPort {name}");
        }
    }
    let replicas = deployment.spec.as_ref().and_then(|s| s.replicas);
    assert_eq!(
        replicas,
        Some(2),
        "one replica down must not stop pod creation"
    );
    let budget: PodDisruptionBudget = only(&objects, "PodDisruptionBudget", "lattice-injector");
    assert_eq!(
        budget.spec.and_then(|s| s.min_available),
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(1))
    );
    Ok(())
}

/// The injector's Role and ClusterRole grant exactly what the real injector asks of the API:
/// its Secret created, read and renewed, its webhook configuration read and given the CA.
#[test]
fn g_the_injector_role_grants_exactly_what_it_uses() -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::Secret;
    let objects = rendered()?;
    let cluster_role: ClusterRole = only(&objects, "ClusterRole", "lattice-injector");
    let role: Role = only(&objects, "Role", "lattice-injector");
    assert_eq!(role.metadata.namespace.as_deref(), Some("lattice-system"));
    let rules: Vec<_> = cluster_role
        .rules
        .iter()
        .flatten()
        .chain(role.rules.iter().flatten())
        .cloned()
        .collect();
    let granted = |(group, resource, verb, name): &(String, String, String, String)| {
        rules.iter().any(|rule| {
            rule.api_groups.iter().flatten().any(|g| g == group)
                && rule.resources.iter().flatten().any(|r| r == resource)
                && rule.verbs.iter().any(|v| v == verb)
                && rule
                    .resource_names
                    .as_ref()
                    .is_none_or(|names| names.iter().any(|n| n == name))
        })
    };

    let api = FakeApiServer::start()?;
    let configuration = objects
        .iter()
        .find(|o| kind(o) == "MutatingWebhookConfiguration")
        .context("the webhook configuration")?;
    api.apply_json(configuration.clone())?;
    let proxy = RecordingProxy::start(api.addr())?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        api.kubeconfig()
            .replace(&api.url(), &format!("http://{}", proxy.addr)),
    )?;
    // Its own pod, as the Deployment makes it, for its image.
    let deployment = objects
        .iter()
        .find(|o| kind(o) == "Deployment" && o["metadata"]["name"] == "lattice-injector")
        .context("the injector's Deployment")?;
    api.apply_json(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "lattice-injector-6c9f7-x2k4q", "namespace": "lattice-system"},
        "spec": deployment["spec"]["template"]["spec"],
    }))?;
    let injector = lattice_e2e::injector::Injector::start_with_env(
        &kubeconfig.to_string_lossy(),
        &["--recheck-secs=1"],
        &[("POD_NAME", "lattice-injector-6c9f7-x2k4q")],
    )?;
    let has_bundle = |api: &FakeApiServer| -> Result<(), String> {
        let configurations = api
            .objects::<MutatingWebhookConfiguration>()
            .map_err(|e| e.to_string())?;
        let all = configurations
            .iter()
            .flat_map(|c| c.webhooks.iter().flatten())
            .all(|w| w.client_config.ca_bundle.is_some());
        if all {
            Ok(())
        } else {
            Err("no bundle yet".into())
        }
    };
    wait::until("the CA bundle", Duration::from_secs(20), || {
        has_bundle(&api).map_err(|e| format!("{e}\n{}", injector.log()))
    })?;
    // A serving certificate gone bad (say, cut short): the injector renews it in place.
    let mut secret = serde_json::to_value(
        api.objects::<Secret>()?
            .into_iter()
            .next()
            .context("the Secret")?,
    )?;
    secret["data"]["tls.crt"] = Value::String("bm90IGEgY2VydGlmaWNhdGU=".into());
    api.apply_json(secret)?;
    wait::until("the renewed Secret", Duration::from_secs(20), || {
        let secret = api.objects::<Secret>().map_err(|e| e.to_string())?;
        let cert = secret
            .first()
            .and_then(|s| s.data.as_ref())
            .and_then(|d| d.get("tls.crt"))
            .map(|c| c.0.clone())
            .unwrap_or_default();
        if cert.starts_with(b"-----BEGIN CERTIFICATE") {
            Ok(())
        } else {
            Err(format!("not renewed yet\n{}", injector.log()))
        }
    })?;
    drop(injector);

    let used: BTreeSet<_> = proxy
        .requests()
        .iter()
        .map(|r| rbac_request(r))
        .collect::<anyhow::Result<_>>()?;
    for request in &used {
        assert!(
            granted(request),
            "the injector uses {request:?}, which is not granted"
        );
    }
    let verbs = |set: &BTreeSet<(String, String, String, String)>| -> BTreeSet<(String, String)> {
        set.iter()
            .map(|(_, r, v, _)| (r.clone(), v.clone()))
            .collect()
    };
    let mut granted_verbs = BTreeSet::new();
    for rule in &rules {
        for resource in rule.resources.iter().flatten() {
            for verb in &rule.verbs {
                granted_verbs.insert((resource.clone(), verb.clone()));
            }
        }
    }
    assert_eq!(granted_verbs, verbs(&used), "granted vs used");
    Ok(())
}
