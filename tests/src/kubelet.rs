//! A pod spec run on the simulated node the way the kubelet runs it, so a test can take a pod
//! as the sidecar injector admitted it and find out whether it works: the commands, arguments,
//! environment and users the spec says, nothing the harness adds.
//!
//! - Volumes: each `emptyDir` a fresh directory (mode 0777, as the kubelet makes them), and a
//!   container's mount path replaced by it wherever the container's command line names it.
//! - Environment: `value`s, and the downward API's `metadata.name` and `metadata.namespace`.
//! - Init containers in order: a plain one runs to completion (and must succeed); a native
//!   sidecar (`restartPolicy: Always`) is started, and the next one waits for its startup probe
//!   (`httpGet`, polled from the node to the pod's address, as the kubelet polls it).
//! - Each as the UID and GID of its security context (the pod's where it sets none), with
//!   `setpriv`; `envoy` is the Envoy the tests run.
//! - DNS: `dnsPolicy: None`'s `dnsConfig` as the pod's resolv.conf.
//!
//! The app itself is the test's: [`KubeletPod::run_as`] runs a program as the app container's
//! user in the pod.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::{Container, PodSpec, Probe};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::netns::Process;
use crate::node::{Node, Pod, ResolvConf, probe, process_uid};
use crate::{envoy, wait};

/// How long a startup probe may take to pass.
const STARTUP: Duration = Duration::from_secs(60);

/// A pod started from its spec. Fields drop in order: the sidecars, resolv.conf, the pod's
/// namespace, the volumes.
pub struct KubeletPod {
    sidecars: Vec<(String, Process)>,
    _resolv: Option<ResolvConf>,
    pub pod: Pod,
    spec: PodSpec,
    volumes: tempfile::TempDir,
    /// What each init container that ran to completion printed, by name.
    pub init_output: BTreeMap<String, String>,
}

impl KubeletPod {
    /// Starts `spec` as pod `name` of `namespace`, at host `host` of the node's bridge; returns
    /// once every init container has run or, for a sidecar, passed its startup probe.
    pub fn start(
        node: &Node,
        name: &str,
        namespace: &str,
        host: u8,
        spec: &PodSpec,
    ) -> anyhow::Result<KubeletPod> {
        let pod = node.pod(name, host)?;
        let volumes = tempfile::tempdir()?;
        for volume in spec.volumes.iter().flatten() {
            if volume.empty_dir.is_none() {
                bail!(
                    "volume {}: only emptyDir volumes are simulated",
                    volume.name
                );
            }
            let dir = volumes.path().join(&volume.name);
            std::fs::create_dir_all(&dir)?;
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777))?;
        }
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(volumes.path(), std::fs::Permissions::from_mode(0o755))?;
        let resolv = match spec.dns_policy.as_deref() {
            Some("None") => Some(ResolvConf::write_text(&pod.netns, &resolv_conf(spec)?)?),
            _ => None,
        };
        let mut started = KubeletPod {
            sidecars: Vec::new(),
            _resolv: resolv,
            pod,
            spec: spec.clone(),
            volumes,
            init_output: BTreeMap::new(),
        };
        for container in spec.init_containers.iter().flatten() {
            let command = started.command(container, name, namespace)?;
            if container.restart_policy.as_deref() == Some("Always") {
                let log = std::fs::File::create(started.log_path(&container.name))?;
                let mut command = command;
                command.stdout(Stdio::null()).stderr(log);
                let process = started.pod.netns.spawn(command)?;
                started.sidecars.push((container.name.clone(), process));
                if let Some(startup) = &container.startup_probe {
                    started.wait_probe(node, container, startup)?;
                }
            } else {
                let mut command = command;
                let output = command
                    .stdin(Stdio::null())
                    .output()
                    .with_context(|| format!("running init container {}", container.name))?;
                let text = format!(
                    "{}{}",
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                );
                if !output.status.success() {
                    bail!(
                        "init container {} failed ({}): {text}",
                        container.name,
                        output.status
                    );
                }
                started.init_output.insert(container.name.clone(), text);
            }
        }
        Ok(started)
    }

    /// The real UID sidecar `name` runs as, from `/proc/<pid>/status` (`ip netns exec` and
    /// `setpriv` exec in turn, so the child is the sidecar's program itself).
    pub fn sidecar_uid(&mut self, name: &str) -> anyhow::Result<u32> {
        let (_, process) = self
            .sidecars
            .iter_mut()
            .find(|(n, _)| n == name)
            .with_context(|| format!("no sidecar {name}"))?;
        process_uid(process.child().id())
    }

    /// The log of sidecar `name`.
    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.log_path(name)).unwrap_or_default()
    }

    fn log_path(&self, name: &str) -> PathBuf {
        self.volumes.path().join(format!("{name}.log"))
    }

    /// Runs `program args` in the pod as container `container`'s user, to completion.
    pub fn run_as(&self, container: &str, program: &str, args: &[&str]) -> anyhow::Result<Output> {
        let container = self
            .spec
            .containers
            .iter()
            .chain(self.spec.init_containers.iter().flatten())
            .find(|c| c.name == container)
            .with_context(|| format!("no container {container}"))?;
        let mut command = self.as_user(container);
        command.arg(program).args(args);
        Ok(command.stdin(Stdio::null()).output()?)
    }

    /// `setpriv` in the pod's namespace as `container`'s user (plain root when it is 0).
    fn as_user(&self, container: &Container) -> Command {
        let pod_security = self.spec.security_context.as_ref();
        let own = container.security_context.as_ref();
        let uid = own
            .and_then(|s| s.run_as_user)
            .or(pod_security.and_then(|s| s.run_as_user))
            .unwrap_or(0);
        let gid = own
            .and_then(|s| s.run_as_group)
            .or(pod_security.and_then(|s| s.run_as_group))
            .unwrap_or(uid);
        let mut command = self.pod.netns.command("setpriv");
        command.args([
            format!("--reuid={uid}"),
            format!("--regid={gid}"),
            "--clear-groups".to_string(),
            "--".to_string(),
        ]);
        command
    }

    /// The container's command line as the kubelet runs it: its command and arguments, mount
    /// paths mapped to the pod's volumes, the environment it declares.
    fn command(
        &self,
        container: &Container,
        name: &str,
        namespace: &str,
    ) -> anyhow::Result<Command> {
        let mut words: Vec<String> = container.command.clone().unwrap_or_default();
        words.extend(container.args.clone().unwrap_or_default());
        let mapped: Vec<String> = words
            .iter()
            .map(|word| {
                container
                    .volume_mounts
                    .iter()
                    .flatten()
                    .fold(word.clone(), |w, mount| {
                        let dir = self.volumes.path().join(&mount.name);
                        w.replace(&mount.mount_path, &dir.to_string_lossy())
                    })
            })
            .collect();
        let (program, args) = mapped
            .split_first()
            .context("a container without a command")?;
        let program = match program.as_str() {
            "envoy" => envoy::binary().to_string_lossy().into_owned(),
            "lattice-init" => crate::bins::path("lattice-init")
                .to_string_lossy()
                .into_owned(),
            other => other.to_string(),
        };
        let mut command = self.as_user(container);
        command.arg(program).args(args).env_clear();
        command.env("PATH", std::env::var_os("PATH").unwrap_or_default());
        for var in container.env.iter().flatten() {
            let value = match (&var.value, &var.value_from) {
                (Some(value), _) => value.clone(),
                (None, Some(from)) => {
                    match from.field_ref.as_ref().map(|f| f.field_path.as_str()) {
                        Some("metadata.name") => name.to_string(),
                        Some("metadata.namespace") => namespace.to_string(),
                        other => bail!("env {}: {other:?} is not simulated", var.name),
                    }
                }
                (None, None) => String::new(),
            };
            command.env(&var.name, value);
        }
        Ok(command)
    }

    fn wait_probe(
        &self,
        node: &Node,
        container: &Container,
        startup: &Probe,
    ) -> anyhow::Result<()> {
        let get = startup
            .http_get
            .as_ref()
            .context("only httpGet probes are simulated")?;
        let port = match &get.port {
            IntOrString::Int(port) => u16::try_from(*port)?,
            IntOrString::String(port_name) => container
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(port_name))
                .map(|p| p.container_port)
                .with_context(|| format!("no port {port_name}"))
                .and_then(|p| Ok(u16::try_from(p)?))?,
        };
        let path = get.path.clone().unwrap_or_else(|| "/".to_string());
        let target = std::net::SocketAddr::from((self.pod.address, port));
        wait::until(
            &format!("{}'s startup probe", container.name),
            STARTUP,
            || {
                node.netns
                    .enter(|| probe(target, &path))
                    .map_err(|e| e.to_string())?
                    .map_err(|e| format!("{e}\n{}", self.log(&container.name)))
            },
        )?;
        Ok(())
    }
}

/// The resolv.conf a `dnsPolicy: None` pod gets from its `dnsConfig`.
fn resolv_conf(spec: &PodSpec) -> anyhow::Result<String> {
    let config = spec
        .dns_config
        .as_ref()
        .context("dnsPolicy None without dnsConfig")?;
    let mut text = String::new();
    for server in config.nameservers.iter().flatten() {
        text.push_str(&format!("nameserver {server}\n"));
    }
    let searches = config.searches.clone().unwrap_or_default();
    if !searches.is_empty() {
        text.push_str(&format!("search {}\n", searches.join(" ")));
    }
    let options: Vec<String> = config
        .options
        .iter()
        .flatten()
        .filter_map(|o| {
            let name = o.name.as_ref()?;
            Some(match &o.value {
                Some(value) => format!("{name}:{value}"),
                None => name.clone(),
            })
        })
        .collect();
    if !options.is_empty() {
        text.push_str(&format!("options {}\n", options.join(" ")));
    }
    Ok(text)
}
