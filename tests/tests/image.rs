//! The container image against the manifests that run it. The image is built as `cargo xtask
//! image` builds it (deploy/Dockerfile's runtime stage on the Debian base made locally with
//! mmdebstrap and cached, podman with `--pull=never` and no network) but from the tests' debug
//! binaries, which the workspace build of `cargo xtask test` made already: no second build.
//! Then every container command line of the rendered manifests (`deploy/`, and
//! `deploy/examples/` as the image's own `lattice inject` admits it) runs inside the image as the
//! manifests run it (user and group, runAsNonRoot, capabilities, no privilege escalation,
//! read-only root filesystem, environment, volumes, DNS, memory limit), each in a network
//! namespace the test makes (the node's for the agent, the pod's for the rest):
//! - the agent: `--check-config`; then serving a mesh file (the manifest's line plus
//!   `--mesh-file`), with its exec probes run in the container as the kubelet runs them,
//!   `/readyz` reached from outside the container, a mesh name answered on the node-local
//!   address it adds, and a clean exit on SIGTERM;
//! - the injector (`lattice webhook`): `--check-config`, and `lattice inject` over the example
//!   inside the image (its output is the pod the next step runs). Serving admission reviews
//!   needs a Kubernetes API server the container can reach, which this test does not give it;
//! - lattice-init in the example's pod, on each iptables backend: its rules checked from the
//!   app container of the same network namespace (a connection to a mesh address arrives at
//!   Envoy's port, its original destination kept), the bootstrap it wrote validated by a real
//!   Envoy with the sidecar's arguments.
//!
//! Needs root, podman, runc and mmdebstrap (`cargo xtask test` installs them) and a Debian
//! mirror the first time (the base is cached under the target directory for a week).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::core::v1::{Container, PodSpec};
use lattice_e2e::manifests::{self, command_line, container_env, image_name, pod_specs};
use lattice_e2e::netns::Netns;
use lattice_e2e::{bins, envoy, iptables, wait};
use serde_json::Value;
use xtask::image::{self, Labels, PROGRAMS, Podman};

/// The image under test, in the test's own podman storage.
const IMAGE: &str = "localhost/lattice:image-test";

/// Images the test does not run: the example's app, which is not ours.
const THIRD_PARTY: &[&str] = &["registry.k8s.io/e2e-test-images/agnhost"];

/// The mesh the agent serves: one HTTP service, so its name resolves to the shared address.
const MESH: &str = "services:\n  - path: /demo/web/echo\n    ports:\n      - port: 8080\n        \
                    protocol: http\n    endpoints:\n      - address: 10.0.0.9\n";
const MESH_NAME: &str = "echo.web.demo.system.internal";
const SHARED_ADDRESS: &str = "240.240.0.1";

/// Where the test's own files go inside a container (the manifests mount nothing here).
const TEST_DIR: &str = "/etc/lattice-test";

#[test]
fn every_manifest_command_line_runs_in_the_image() -> anyhow::Result<()> {
    let started = Instant::now();
    let podman = Podman::isolated()?;
    let dockerfile = std::fs::read_to_string(manifests::root().join(image::DOCKERFILE))?;
    let base = image::base(&image::cache_dir(), &image::runtime_packages(&dockerfile)?)?;
    podman.load(&base)?;
    let binaries: Vec<PathBuf> = PROGRAMS.iter().map(|p| bins::path(p)).collect();
    let labels = Labels::of_checkout();
    podman.build(&base, &binaries, &labels, IMAGE)?;
    eprintln!(
        "image built in {:?}: {:.1} MB on a {:.1} MB base (`cargo xtask image` gives the \
         compressed size)",
        started.elapsed(),
        podman.size(IMAGE)? as f64 / 1e6,
        podman.size(&base.name)? as f64 / 1e6
    );
    let image = ImageConfig::inspect(&podman, &labels)?;

    let files = tempfile::tempdir()?;
    std::fs::write(files.path().join("kubeconfig"), DUMMY_KUBECONFIG)?;
    std::fs::write(files.path().join("mesh.yaml"), MESH)?;
    std::fs::write(
        files.path().join("example.yaml"),
        manifests::render_text("deploy/examples")?,
    )?;
    let test_files = (files.path().to_path_buf(), TEST_DIR.to_string());

    let mut objects = manifests::documents(&manifests::render_text("deploy")?)?;
    let mut covered = BTreeSet::new();
    let mut example = None;
    // The deploy/ pods first: the injector's `lattice inject` makes the example's pod.
    for (owner, pod) in pod_specs(&objects)? {
        for container in pod.init_containers.iter().flatten().chain(&pod.containers) {
            let env = container_env(container)?;
            let (program, args) = command_line(container, &env)?;
            let what = format!("{owner} container {}", container.name);
            match (image_name(container).as_str(), program.as_str()) {
                ("lattice", "lattice-agent") => {
                    agent(&podman, &image, &pod, container, &test_files)
                        .with_context(|| what.clone())?;
                }
                ("lattice", "lattice") => {
                    let injected = injector(&podman, &image, &pod, container, &test_files)
                        .with_context(|| what.clone())?;
                    example = Some(injected);
                }
                (other, _) => bail!("{what}: image {other} running {program} is not covered"),
            }
            ensure!(
                args.iter().all(|a| !a.contains("$(")),
                "{what}: unexpanded {args:?}"
            );
            covered.insert(format!("{}: {program}", container.name));
        }
    }
    objects = example.context("no injector in deploy/ made the example's pod")?;
    for (owner, pod) in pod_specs(&objects)? {
        for container in pod.init_containers.iter().flatten().chain(&pod.containers) {
            let env = container_env(container)?;
            let (program, _) = command_line(container, &env)?;
            let what = format!("{owner} container {}", container.name);
            match (image_name(container).as_str(), program.as_str()) {
                ("lattice", "lattice-init") => {
                    for backend in iptables::backends() {
                        init_in_pod(&podman, &image, &pod, container, backend)
                            .with_context(|| format!("{what} on iptables-{backend}"))?;
                    }
                }
                // Envoy's image is not ours: the bootstrap lattice-init wrote is validated by
                // the machine's Envoy with this container's arguments, above.
                ("envoyproxy/envoy", "envoy") => {}
                (image, _) if THIRD_PARTY.contains(&image) => continue,
                (other, _) => bail!("{what}: image {other} running {program} is not covered"),
            }
            covered.insert(format!("{}: {program}", container.name));
        }
    }
    assert_eq!(
        covered,
        BTreeSet::from([
            "agent: lattice-agent".to_string(),
            "injector: lattice".to_string(),
            "lattice-init: lattice-init".to_string(),
            "lattice-proxy: envoy".to_string(),
        ])
    );
    eprintln!("image test done in {:?}", started.elapsed());
    Ok(())
}

/// What the built image says about itself.
struct ImageConfig {
    /// The default user, `uid[:gid]`.
    user: String,
}

impl ImageConfig {
    /// Reads the image's configuration and checks what the Dockerfile promises: a numeric
    /// non-root default user (so the kubelet can check runAsNonRoot) and the labels.
    fn inspect(podman: &Podman, labels: &Labels) -> anyhow::Result<ImageConfig> {
        let text = podman.output(&["image", "inspect", IMAGE])?;
        let inspected: Value = serde_json::from_str(&text)?;
        let config = &inspected[0]["Config"];
        let user = config["User"].as_str().unwrap_or_default().to_string();
        let uid: u32 = user
            .split(':')
            .next()
            .unwrap_or_default()
            .parse()
            .with_context(|| format!("the image's user {user:?} is not numeric"))?;
        ensure!(uid != 0, "the image's default user is root");
        let label = |name: &str| {
            config["Labels"][name]
                .as_str()
                .unwrap_or_default()
                .to_string()
        };
        assert_eq!(label("org.opencontainers.image.version"), labels.version);
        assert_eq!(label("org.opencontainers.image.revision"), labels.revision);
        Ok(ImageConfig { user })
    }

    fn uid(&self) -> i64 {
        self.user
            .split(':')
            .next()
            .and_then(|uid| uid.parse().ok())
            .unwrap_or(0)
    }
}

/// A kubeconfig that parses but points at nothing: `--check-config` builds the client config
/// without contacting the server.
const DUMMY_KUBECONFIG: &str = "apiVersion: v1\nkind: Config\nclusters:\n- name: none\n  \
                                cluster:\n    server: http://127.0.0.1:1\nusers:\n- name: none\n  \
                                user: {}\ncontexts:\n- name: none\n  context:\n    cluster: \
                                none\n    user: none\ncurrent-context: none\n";

/// Where a container of the test runs: the network namespace standing for the node's (host
/// network) or the pod's, the host directories standing for the pod's volumes, and the test's
/// own files.
struct Placement<'a> {
    netns: &'a Netns,
    volumes: &'a BTreeMap<String, PathBuf>,
    test_files: Option<&'a (PathBuf, String)>,
}

/// The fields of the pod's and the container's securityContext this test carries over to
/// podman; any other fails the test until it is emulated.
const POD_SECURITY: &[&str] = &["runAsUser", "runAsGroup", "runAsNonRoot", "seccompProfile"];
const CONTAINER_SECURITY: &[&str] = &[
    "runAsUser",
    "runAsGroup",
    "runAsNonRoot",
    "seccompProfile",
    "privileged",
    "allowPrivilegeEscalation",
    "readOnlyRootFilesystem",
    "capabilities",
];

fn keys_within(value: &Value, allowed: &[&str], what: &str) -> anyhow::Result<()> {
    for key in value.as_object().into_iter().flatten().map(|(k, _)| k) {
        ensure!(
            allowed.contains(&key.as_str()),
            "{what}.{key} is not emulated by the image test"
        );
    }
    Ok(())
}

/// `podman run` arguments (after `run`) that run `container` of `pod` as the kubelet would,
/// then `extra` arguments after the manifest's own.
fn run_args(
    image: &ImageConfig,
    pod: &PodSpec,
    container: &Container,
    place: &Placement,
    extra: &[String],
) -> anyhow::Result<Vec<String>> {
    let pod_security = serde_json::to_value(&pod.security_context)?;
    let security = serde_json::to_value(&container.security_context)?;
    keys_within(&pod_security, POD_SECURITY, "pod securityContext")?;
    keys_within(&security, CONTAINER_SECURITY, "securityContext")?;
    let field = |name: &str| {
        let own = &security[name];
        if own.is_null() {
            pod_security[name].clone()
        } else {
            own.clone()
        }
    };
    let mut args: Vec<String> = vec![
        format!("--network=ns:{}", place.netns.path().display()),
        "--stop-timeout=30".into(),
    ];
    let uid = field("runAsUser").as_i64();
    let gid = field("runAsGroup").as_i64();
    let effective = uid.unwrap_or(image.uid());
    if field("runAsNonRoot") == Value::Bool(true) {
        ensure!(
            effective != 0,
            "runAsNonRoot with uid 0: the kubelet would not start {}",
            container.name
        );
    }
    match (uid, gid) {
        (Some(uid), Some(gid)) => args.push(format!("--user={uid}:{gid}")),
        (Some(uid), None) => args.push(format!("--user={uid}")),
        (None, Some(gid)) => args.push(format!("--user={effective}:{gid}")),
        (None, None) => {}
    }
    ensure!(
        field("privileged") != Value::Bool(true),
        "privileged containers are not emulated"
    );
    if field("allowPrivilegeEscalation") == Value::Bool(false) {
        args.push("--security-opt=no-new-privileges".into());
    }
    match field("seccompProfile")["type"].as_str() {
        None | Some("RuntimeDefault") => {}
        Some("Unconfined") => args.push("--security-opt=seccomp=unconfined".into()),
        Some(other) => bail!("seccompProfile {other} is not emulated"),
    }
    if field("readOnlyRootFilesystem") == Value::Bool(true) {
        // podman adds writable tmpfs on /tmp, /run and /var/tmp to a read-only root; the
        // kubelet adds nothing.
        args.extend(["--read-only".into(), "--read-only-tmpfs=false".into()]);
    }
    let capabilities = &security["capabilities"];
    for cap in capabilities["drop"].as_array().into_iter().flatten() {
        args.push(format!("--cap-drop={}", cap.as_str().unwrap_or_default()));
    }
    for cap in capabilities["add"].as_array().into_iter().flatten() {
        args.push(format!("--cap-add={}", cap.as_str().unwrap_or_default()));
    }
    if let Some(memory) = container
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get("memory"))
    {
        let mib = memory
            .0
            .strip_suffix("Mi")
            .with_context(|| format!("memory limit {} not in Mi", memory.0))?;
        args.push(format!("--memory={mib}m"));
    }
    for (name, value) in container_env(container)? {
        args.push(format!("--env={name}={value}"));
    }
    for mount in container.volume_mounts.iter().flatten() {
        let volume = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == mount.name)
            .with_context(|| format!("no volume {}", mount.name))?;
        ensure!(
            volume.empty_dir.is_some() || volume.host_path.is_some(),
            "volume {} is neither emptyDir nor hostPath",
            volume.name
        );
        let host = place
            .volumes
            .get(&mount.name)
            .with_context(|| format!("the test made no directory for volume {}", mount.name))?;
        let mode = if mount.read_only == Some(true) {
            ":ro"
        } else {
            ""
        };
        args.push(format!(
            "--volume={}:{}{mode}",
            host.display(),
            mount.mount_path
        ));
    }
    if let Some((host, path)) = place.test_files {
        args.push(format!("--volume={}:{path}:ro", host.display()));
    }
    // The pod's DNS: its own dnsConfig with dnsPolicy None; otherwise the cluster DNS, which
    // this test does not run: a loopback address in the namespace, answering nothing.
    if pod.dns_policy.as_deref() == Some("None") {
        let config = pod
            .dns_config
            .as_ref()
            .context("dnsPolicy None without dnsConfig")?;
        for server in config.nameservers.iter().flatten() {
            args.push(format!("--dns={server}"));
        }
        for search in config.searches.iter().flatten() {
            args.push(format!("--dns-search={search}"));
        }
        for option in config.options.iter().flatten() {
            let name = option.name.clone().unwrap_or_default();
            args.push(match &option.value {
                Some(value) => format!("--dns-option={name}:{value}"),
                None => format!("--dns-option={name}"),
            });
        }
    } else {
        args.push("--dns=127.0.0.1".into());
    }
    let env = container_env(container)?;
    let (program, program_args) = command_line(container, &env)?;
    args.push(format!(
        "--entrypoint={}",
        serde_json::to_string(&[program])?
    ));
    args.push(IMAGE.into());
    args.extend(program_args);
    args.extend(extra.iter().cloned());
    Ok(args)
}

fn show(output: &Output) -> String {
    format!(
        "{}\nstdout: {}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// `podman run --rm` to completion; the output, whatever the status.
fn run_once(podman: &Podman, args: &[String]) -> anyhow::Result<Output> {
    podman
        .command()
        .args(["run", "--rm"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running podman")
}

/// Host directories for the pod's volumes.
fn volume_dirs(pod: &PodSpec, under: &Path) -> anyhow::Result<BTreeMap<String, PathBuf>> {
    let mut dirs = BTreeMap::new();
    for volume in pod.volumes.iter().flatten() {
        let dir = under.join(&volume.name);
        std::fs::create_dir_all(&dir)?;
        dirs.insert(volume.name.clone(), dir);
    }
    Ok(dirs)
}

/// A detached container, stopped and removed on drop (the podman storage's own drop removes
/// anything left as well).
struct Running<'a> {
    podman: &'a Podman,
    name: String,
}

impl Running<'_> {
    fn exec(&self, command: &[&str]) -> anyhow::Result<Output> {
        self.podman
            .command()
            .args(["exec", &self.name])
            .args(command)
            .output()
            .context("podman exec")
    }

    fn is_running(&self) -> bool {
        self.podman
            .output(&["inspect", "--format", "{{.State.Running}}", &self.name])
            .is_ok_and(|state| state.trim() == "true")
    }

    fn logs(&self) -> String {
        self.podman
            .command()
            .args(["logs", "--tail=40", &self.name])
            .output()
            .map(|o| {
                format!(
                    "{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                )
            })
            .unwrap_or_default()
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let _ = self
            .podman
            .command()
            .args(["rm", "--force", "--time=0", &self.name])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// The agent's exec probes (liveness, readiness), as `podman exec` of their commands: in the
/// container, with its user and capabilities, as the kubelet runs them.
fn exec_probes(container: &Container) -> anyhow::Result<Vec<(&'static str, Vec<String>)>> {
    let mut probes = Vec::new();
    for (what, probe) in [
        ("livenessProbe", &container.liveness_probe),
        ("readinessProbe", &container.readiness_probe),
    ] {
        let probe = probe.as_ref().with_context(|| format!("no {what}"))?;
        let command = probe
            .exec
            .as_ref()
            .and_then(|e| e.command.clone())
            .with_context(|| format!("the {what} is not an exec probe"))?;
        probes.push((what, command));
    }
    Ok(probes)
}

/// The DaemonSet's agent: `--check-config`, then serving a mesh file in a namespace standing for
/// the node's network, reached from outside the container.
fn agent(
    podman: &Podman,
    image: &ImageConfig,
    pod: &PodSpec,
    container: &Container,
    test_files: &(PathBuf, String),
) -> anyhow::Result<()> {
    ensure!(
        pod.host_network == Some(true),
        "the agent runs in the node's network"
    );
    let node = Netns::new("image-node")?;
    let dirs = tempfile::tempdir()?;
    let volumes = volume_dirs(pod, dirs.path())?;
    let place = Placement {
        netns: &node,
        volumes: &volumes,
        test_files: Some(test_files),
    };

    let mut check = run_args(
        image,
        pod,
        container,
        &place,
        &["--check-config".to_string()],
    )?;
    check.insert(0, format!("--env=KUBECONFIG={TEST_DIR}/kubeconfig"));
    let output = run_once(podman, &check)?;
    ensure!(output.status.success(), "--check-config\n{}", show(&output));

    let name = format!("lattice-image-agent-{}", std::process::id());
    let mut serve = run_args(
        image,
        pod,
        container,
        &place,
        &[format!("--mesh-file={TEST_DIR}/mesh.yaml")],
    )?;
    serve.splice(0..0, ["--detach".to_string(), format!("--name={name}")]);
    let started = Instant::now();
    let output = podman
        .command()
        .arg("run")
        .args(&serve)
        .output()
        .context("podman run")?;
    ensure!(output.status.success(), "podman run\n{}", show(&output));
    let running = Running { podman, name };

    // Ready as the kubelet sees it: every exec probe succeeds in the container.
    for (what, command) in exec_probes(container)? {
        let words: Vec<&str> = command.iter().map(String::as_str).collect();
        let passed = wait::until(what, Duration::from_secs(60), || {
            let output = running.exec(&words).map_err(|e| e.to_string())?;
            if output.status.success() {
                Ok(Ok(()))
            } else if !running.is_running() {
                // Exited: no probe will pass.
                Ok(Err(anyhow::anyhow!(
                    "the agent exited\nlogs:\n{}",
                    running.logs()
                )))
            } else {
                Err(format!("{}\nlogs:\n{}", show(&output), running.logs()))
            }
        })?;
        passed.with_context(|| format!("{what} {command:?}"))?;
    }
    let ready = started.elapsed();
    // From outside the container: the admin address in the node's network.
    let readyz = node.exec(
        "curl",
        &["-sf", "--max-time", "2", "http://127.0.0.1:15020/readyz"],
    )?;
    eprintln!("agent ready {ready:?} after `podman run`; /readyz from outside: {readyz:?}");
    // The node-local address the agent added (NET_ADMIN) and its DNS server on port 53 there
    // (NET_BIND_SERVICE), answering a name of the mesh file.
    let answer = node.exec(
        "dig",
        &[
            "+short",
            "+time=2",
            "+tries=1",
            "@169.254.20.10",
            MESH_NAME,
            "A",
        ],
    )?;
    assert_eq!(
        answer.trim(),
        SHARED_ADDRESS,
        "{MESH_NAME} from the agent's DNS"
    );

    // SIGTERM (what the kubelet sends): the agent drains and exits 0 within the grace period.
    let grace = pod
        .termination_grace_period_seconds
        .unwrap_or(30)
        .to_string();
    let output = podman
        .command()
        .args(["stop", "--time", &grace, &running.name])
        .output()?;
    ensure!(output.status.success(), "podman stop\n{}", show(&output));
    let code = podman.output(&["inspect", "--format", "{{.State.ExitCode}}", &running.name])?;
    assert_eq!(
        code.trim(),
        "0",
        "the agent's exit status on SIGTERM\n{}",
        running.logs()
    );
    Ok(())
}

/// The injector's container: `--check-config`, and `lattice inject` over the example inside the
/// image as the same user with the same restrictions. Returns the example as it admits it.
fn injector(
    podman: &Podman,
    image: &ImageConfig,
    pod: &PodSpec,
    container: &Container,
    test_files: &(PathBuf, String),
) -> anyhow::Result<Vec<Value>> {
    let netns = Netns::new("image-injector")?;
    let dirs = tempfile::tempdir()?;
    let volumes = volume_dirs(pod, dirs.path())?;
    let place = Placement {
        netns: &netns,
        volumes: &volumes,
        test_files: Some(test_files),
    };
    let mut check = run_args(image, pod, container, &place, &["--check-config".into()])?;
    check.insert(0, format!("--env=KUBECONFIG={TEST_DIR}/kubeconfig"));
    let output = run_once(podman, &check)?;
    ensure!(output.status.success(), "--check-config\n{}", show(&output));

    // The same container with `inject` for its command line.
    let mut inject = container.clone();
    inject.args = Some(vec![
        "inject".into(),
        "-f".into(),
        format!("{TEST_DIR}/example.yaml"),
    ]);
    inject.command = Some(vec!["lattice".into()]);
    let output = run_once(podman, &run_args(image, pod, &inject, &place, &[])?)?;
    ensure!(output.status.success(), "lattice inject\n{}", show(&output));
    manifests::documents(&String::from_utf8(output.stdout)?)
}

/// lattice-init in the example's pod on `backend`: the namespace already holds a rule of that
/// backend (as a node whose kube-proxy uses it), so `auto`, the manifests' choice, follows it.
/// Checked from the app container of the pod, then the bootstrap by a real Envoy.
fn init_in_pod(
    podman: &Podman,
    image: &ImageConfig,
    pod: &PodSpec,
    container: &Container,
    backend: &str,
) -> anyhow::Result<()> {
    let netns = Netns::new("image-pod")?;
    // The pod's interface and default route, so that traffic to the mesh's addresses is routed
    // (and then captured) rather than refused as unreachable: a veth pair to a namespace of
    // the test's that routes nowhere.
    let node = Netns::new("image-pod-node")?;
    netns.veth(
        "eth0",
        "10.244.0.7/24",
        &node,
        "veth-pod",
        Some("10.244.0.1/24"),
    )?;
    netns.ip(&["route", "add", "default", "via", "10.244.0.1"])?;
    // A nat rule of `backend`, as a CNI plugin's would be (and one that changes nothing).
    netns.exec(
        &format!("iptables-{backend}"),
        &[
            "-t",
            "nat",
            "-A",
            "POSTROUTING",
            "-o",
            "eth0",
            "-j",
            "RETURN",
        ],
    )?;
    let dirs = tempfile::tempdir()?;
    let volumes = volume_dirs(pod, dirs.path())?;
    let place = Placement {
        netns: &netns,
        volumes: &volumes,
        test_files: None,
    };
    let output = run_once(podman, &run_args(image, pod, container, &place, &[])?)?;
    ensure!(output.status.success(), "lattice-init\n{}", show(&output));
    for other in iptables::backends() {
        let rules = iptables::save(&netns, other, "iptables")?;
        ensure!(
            rules.contains("240.240.0.0/16") == (other == backend),
            "the capture rules belong in iptables-{backend} alone; iptables-{other} holds:\n{rules}"
        );
    }

    // Envoy's outbound port, in the pod's namespace: where captured connections arrive.
    let port = lattice_contract::ENVOY_OUTBOUND_PORT;
    let listener = netns.enter(|| TcpListener::bind(("0.0.0.0", port)))??;
    listener.set_nonblocking(true)?;
    // The app container's place in the pod, with its securityContext (the app's image is not
    // ours and cannot be pulled here: ours stands in, with bash for the connection).
    let app = pod
        .containers
        .iter()
        .find(|c| !image_name(c).starts_with("lattice") && c.name != "lattice-proxy")
        .context("no app container in the example's pod")?;
    let mut stand_in = app.clone();
    stand_in.command = Some(vec!["bash".into()]);
    stand_in.args = Some(vec![
        "-c".into(),
        format!("exec 3<>/dev/tcp/{SHARED_ADDRESS}/8080 && printf captured >&3"),
    ]);
    stand_in.image = Some(IMAGE.into());
    let output = run_once(podman, &run_args(image, pod, &stand_in, &place, &[])?)?;
    ensure!(
        output.status.success(),
        "the app's connection\n{}",
        show(&output)
    );
    let (mut stream, _) = wait::until(
        "the app's connection at Envoy's port",
        Duration::from_secs(10),
        || listener.accept().map_err(|e| e.to_string()),
    )?;
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut received = String::new();
    stream.read_to_string(&mut received)?;
    assert_eq!(received, "captured");
    let original = original_dst(&stream)?;
    assert_eq!(original, SocketAddr::from(([240, 240, 0, 1], 8080)));
    let _ = stream.write_all(b"");

    // The bootstrap lattice-init wrote into the shared volume, validated by a real Envoy with
    // the sidecar's arguments (its mount paths mapped to the volume's directory).
    let sidecar =
        manifests::init_container_running(pod, "envoy").context("no Envoy sidecar in the pod")?;
    let env = container_env(sidecar)?;
    let (_, args) = command_line(sidecar, &env)?;
    let mapped: Vec<String> = args
        .iter()
        .map(|arg| {
            let mut arg = arg.clone();
            for mount in sidecar.volume_mounts.iter().flatten() {
                if let Some(dir) = volumes.get(&mount.name) {
                    arg = arg.replace(&mount.mount_path, &dir.to_string_lossy());
                }
            }
            arg
        })
        .collect();
    let output = Command::new(envoy::binary())
        .args(["--mode", "validate"])
        .args(&mapped)
        .stdin(Stdio::null())
        .output()?;
    ensure!(
        output.status.success(),
        "envoy --mode validate on the bootstrap from the image\n{}",
        show(&output)
    );
    Ok(())
}

fn original_dst(stream: &std::net::TcpStream) -> anyhow::Result<SocketAddr> {
    use nix::sys::socket::{SockaddrIn, getsockopt, sockopt};
    let address = getsockopt(stream, sockopt::OriginalDst).context("SO_ORIGINAL_DST")?;
    Ok(SocketAddr::V4(SockaddrIn::from(address).into()))
}
