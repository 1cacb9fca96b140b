//! The real agent for the benchmarks that drive one on loopback: started from a built binary,
//! ready when `/readyz` says so, killed when dropped.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use lattice_e2e::agent::{free_ports, http_get};
use serde_json::Value;

pub struct Agent {
    pub child: Child,
    pub admin: SocketAddr,
    pub dns: SocketAddr,
}

impl Agent {
    /// Starts `binary` on free loopback ports with `args`; without an `--upstream-dns` among
    /// them, names outside the zone go to a closed port (refused at once).
    pub fn start(binary: &Path, args: &[&str]) -> anyhow::Result<Agent> {
        let [xds, dns, admin] = free_ports();
        let loopback = |port| SocketAddr::from(([127, 0, 0, 1], port));
        let mut command = Command::new(binary);
        command
            .arg(format!("--xds-addr={}", loopback(xds)))
            .arg(format!("--dns-addr={}", loopback(dns)))
            .arg(format!("--admin-addr={}", loopback(admin)));
        if !args.iter().any(|a| a.starts_with("--upstream-dns")) {
            command.arg("--upstream-dns=127.0.0.1:9");
        }
        let child = command
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting lattice-agent")?;
        let agent = Agent {
            child,
            admin: loopback(admin),
            dns: loopback(dns),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !matches!(http_get(agent.admin, "/readyz"), Ok((200, _))) {
            ensure!(Instant::now() < deadline, "the agent never got ready");
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(agent)
    }

    pub fn mesh(&self) -> anyhow::Result<Value> {
        let (_, body) = http_get(self.admin, "/debug/mesh")?;
        Ok(serde_json::from_str(&body)?)
    }

    /// The lines of `/metrics` that start with `prefix`.
    pub fn metrics(&self, prefix: &str) -> anyhow::Result<Vec<String>> {
        let (_, body) = http_get(self.admin, "/metrics")?;
        Ok(body
            .lines()
            .filter(|l| l.starts_with(prefix))
            .map(str::to_string)
            .collect())
    }

    /// The agent's resident set, MiB.
    pub fn rss_mib(&self) -> Option<f64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        let kib: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kib / 1024.0)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
