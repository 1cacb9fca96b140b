//! The real `lattice-agent` binary as a child process: free ports, log capture, readiness,
//! admin queries, restart, a successor beside it (an upgrade), and a kill on drop. Admin
//! queries go to the agent's own admin socket (`--admin-socket`), so two agents sharing their
//! ports in an upgrade are each asked about themselves.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::netns::{Netns, enter_path};
use crate::{bins, wait};

/// A port that was free a moment ago (the OS hands out ephemeral ports round-robin, so a
/// just-released one is not handed to someone else right away).
pub fn free_port() -> u16 {
    free_ports::<1>()[0]
}

/// `N` ports that were free a moment ago, all different: each is held until all are chosen
/// (two calls to [`free_port`] can get the same port back, which once gave an agent its xDS
/// and DNS ports alike).
pub fn free_ports<const N: usize>() -> [u16; N] {
    let held: Vec<TcpListener> = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("no free port on loopback"))
        .collect();
    std::array::from_fn(|k| {
        held[k]
            .local_addr()
            .expect("a bound listener has an address")
            .port()
    })
}

/// The three addresses an agent serves on.
#[derive(Clone, Copy, Debug)]
pub struct AgentAddrs {
    pub xds: SocketAddr,
    pub dns: SocketAddr,
    pub admin: SocketAddr,
}

/// Fresh ports on loopback.
fn loopback_addrs() -> AgentAddrs {
    let loopback = |port| SocketAddr::from(([127, 0, 0, 1], port));
    let [xds, dns, admin] = free_ports();
    AgentAddrs {
        xds: loopback(xds),
        dns: loopback(dns),
        admin: loopback(admin),
    }
}

pub struct Agent {
    child: Option<Child>,
    /// The `lattice-agent` executable: the workspace's ([`bins::path`]) unless given.
    binary: PathBuf,
    /// The network namespace the agent runs in (`/run/netns/<name>`); the host's when `None`.
    netns: Option<PathBuf>,
    args: Vec<String>,
    envs: Vec<(String, String)>,
    log: tempfile::NamedTempFile,
    /// Holds the agent's admin socket.
    run_dir: tempfile::TempDir,
    pub xds: SocketAddr,
    pub dns: SocketAddr,
    pub admin: SocketAddr,
}

impl Agent {
    /// Starts the agent on loopback with fresh ports and the given extra arguments.
    pub fn start(args: &[&str]) -> Agent {
        Agent::start_with_env(args, &[])
    }

    pub fn start_with_env(args: &[&str], envs: &[(&str, &str)]) -> Agent {
        let binary = bins::path("lattice-agent");
        Agent::launch(binary, None, loopback_addrs(), args, envs)
    }

    /// [`Agent::start`] from another `lattice-agent` executable, such as a release build.
    pub fn start_binary(binary: &Path, args: &[&str]) -> Agent {
        Agent::launch(binary.to_path_buf(), None, loopback_addrs(), args, &[])
    }

    /// Starts the agent inside the network namespace `netns` on the given addresses (which
    /// must exist in that namespace), as a node's agent runs in the node's network. Admin
    /// queries ([`Agent::get`]) are made from inside the namespace.
    pub fn start_in_netns(
        netns: &Netns,
        addrs: AgentAddrs,
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> Agent {
        let binary = bins::path("lattice-agent");
        Agent::launch(binary, Some(netns.path()), addrs, args, envs)
    }

    fn launch(
        binary: PathBuf,
        netns: Option<PathBuf>,
        addrs: AgentAddrs,
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> Agent {
        let mut agent = Agent {
            child: None,
            binary,
            netns,
            args: args.iter().map(|s| s.to_string()).collect(),
            envs: envs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            log: tempfile::NamedTempFile::new().expect("temp file for the agent log"),
            run_dir: tempfile::tempdir().expect("temp dir for the agent's admin socket"),
            xds: addrs.xds,
            dns: addrs.dns,
            admin: addrs.admin,
        };
        agent.spawn();
        agent
    }

    fn spawn(&mut self) {
        let log = self.log.reopen().expect("agent log");
        let mut command = match &self.netns {
            // `ip netns exec` execs the agent, so the child is the agent itself: kill and
            // SIGTERM reach it directly.
            Some(netns) => {
                let mut command = Command::new("ip");
                command
                    .args(["netns", "exec"])
                    .arg(netns.file_name().unwrap_or_default())
                    .arg(&self.binary);
                command
            }
            None => Command::new(&self.binary),
        };
        command
            .arg(format!("--xds-addr={}", self.xds))
            .arg(format!("--dns-addr={}", self.dns))
            .arg(format!("--admin-addr={}", self.admin))
            .arg(format!("--admin-socket={}", self.admin_socket().display()))
            .args(&self.args)
            .env("RUST_LOG", "info,lattice_agent=debug")
            .stdout(Stdio::null())
            .stderr(log);
        if !self.args.iter().any(|a| a.starts_with("--upstream-dns")) {
            // Never the machine's resolver: an address nothing listens on.
            command.arg("--upstream-dns=127.0.0.1:9");
        }
        for (k, v) in &self.envs {
            command.env(k, v);
        }
        self.child = Some(command.spawn().expect("start lattice-agent"));
    }

    /// Polls `/readyz` until it answers 200.
    pub fn wait_ready(&self) -> anyhow::Result<()> {
        wait::until("agent /readyz", Duration::from_secs(20), || {
            match self.get("/readyz") {
                Ok((200, _)) => Ok(()),
                Ok((status, body)) => Err(format!("{status} {body}")),
                Err(e) => Err(format!("{e}; log:\n{}", self.log())),
            }
        })
    }

    /// A GET on this agent's admin server (its own socket): (status, body).
    pub fn get(&self, path: &str) -> anyhow::Result<(u16, String)> {
        unix_http_get(&self.admin_socket(), path)
    }

    /// The value of the metric `name` (with its labels, as `/metrics` prints them); 0 when it
    /// is not there yet.
    pub fn metric(&self, name: &str) -> f64 {
        let Ok((_, text)) = self.get("/metrics") else {
            return 0.0;
        };
        metric_in(&text, name).unwrap_or(0.0)
    }

    /// A GET on the shared admin address, which either of two agents in an upgrade may answer.
    pub fn get_over_tcp(&self, path: &str) -> anyhow::Result<(u16, String)> {
        match &self.netns {
            Some(netns) => enter_path(netns, || http_get(self.admin, path))?,
            None => http_get(self.admin, path),
        }
    }

    /// The agent's admin socket (`--admin-socket`).
    pub fn admin_socket(&self) -> PathBuf {
        self.run_dir.path().join("admin.sock")
    }

    /// Starts a second agent beside this one, as the new pod of a rolling upgrade: the same
    /// arguments, environment, addresses and network namespace. It is not waited on: see
    /// [`Agent::wait_ready`].
    pub fn successor(&self) -> Agent {
        let mut next = Agent {
            child: None,
            binary: self.binary.clone(),
            netns: self.netns.clone(),
            args: self.args.clone(),
            envs: self.envs.clone(),
            log: tempfile::NamedTempFile::new().expect("temp file for the agent log"),
            run_dir: tempfile::tempdir().expect("temp dir for the agent's admin socket"),
            xds: self.xds,
            dns: self.dns,
            admin: self.admin,
        };
        next.spawn();
        next
    }

    /// `/debug/mesh` as JSON.
    pub fn mesh(&self) -> anyhow::Result<serde_json::Value> {
        let (status, body) = self.get("/debug/mesh")?;
        anyhow::ensure!(status == 200, "/debug/mesh answered {status}: {body}");
        Ok(serde_json::from_str(&body)?)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    pub fn log_path(&self) -> PathBuf {
        self.log.path().to_path_buf()
    }

    /// The agent's process id while it runs (the agent itself, also inside a namespace).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// Whether the process has ended, seen without reaping it (so through `&self`): it is gone
    /// from `/proc`, or a zombie there.
    pub fn has_exited(&self) -> bool {
        !self.pid().is_some_and(crate::procstat::running)
    }

    /// How the process ended, once it has.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Kills the agent hard (no graceful shutdown), as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(&mut self) -> anyhow::Result<std::process::ExitStatus> {
        let mut child = self
            .child
            .take()
            .ok_or_else(|| anyhow::anyhow!("agent not running"))?;
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id())?);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
        let status = wait::until("agent exit after SIGTERM", Duration::from_secs(10), || {
            child
                .try_wait()
                .map_err(|e| e.to_string())?
                .ok_or_else(|| "still running".to_string())
        })?;
        Ok(status)
    }

    /// `dig` of `name`'s A record at the agent's DNS server, asked once: the status
    /// (`NOERROR`, `SERVFAIL`…; `no answer` when none came) and the answer's records.
    pub fn dig_a(&self, name: &str) -> (String, Vec<String>) {
        let output = crate::dig::command()
            .args([
                &format!("@{}", self.dns.ip()),
                "-p",
                &self.dns.port().to_string(),
                "+tries=1",
                "+time=1",
                name,
                "A",
            ])
            .output()
            .expect("dig runs");
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        let status = dig_status(&text);
        let records = text
            .lines()
            .skip_while(|l| !l.starts_with(";; ANSWER SECTION"))
            .skip(1)
            .take_while(|l| !l.trim().is_empty())
            .filter_map(|l| l.split_whitespace().last().map(str::to_string))
            .collect();
        (status, records)
    }

    /// Kills and starts again on the same ports with the same arguments; how long the kill
    /// took, until the killed process was reaped (the kernel frees its memory meanwhile).
    pub fn restart(&mut self) -> Duration {
        let killed = Instant::now();
        self.kill();
        let gone = killed.elapsed();
        self.spawn();
        gone
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("--- lattice-agent log ---\n{}", self.log());
        }
    }
}

/// The value of the metric `name` (with its labels, as `/metrics` prints them) in `text`, a
/// `/metrics` page.
pub fn metric_in(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))?
        .trim()
        .parse()
        .ok()
}

/// `line` without its ANSI colour escapes (the agent colours its log even into a file).
pub fn without_colours(line: &str) -> String {
    let mut plain = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().find(|c| *c == 'm');
        } else {
            plain.push(c);
        }
    }
    plain
}

/// A field's value in a line of the agent's log, colours (ANSI escapes) taken out.
pub fn log_field(line: &str, name: &str) -> Option<String> {
    let plain = without_colours(line);
    let rest = plain.split(&format!("{name}=")).nth(1)?;
    rest.split_whitespace().next().map(str::to_string)
}

/// The status of a `dig` answer (`NOERROR`, `SERVFAIL`…), `no answer` when it holds none.
pub fn dig_status(text: &str) -> String {
    text.split("status: ")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .unwrap_or("no answer")
        .to_string()
}

/// Minimal blocking HTTP/1.1 GET with `Connection: close`: (status, body). Envoy's admin
/// refuses HTTP/1.0, and may answer chunked.
pub fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    exchange_get(stream, &addr.to_string(), path)
}

/// [`http_get`] over a Unix socket.
pub fn unix_http_get(socket: &Path, path: &str) -> anyhow::Result<(u16, String)> {
    let stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    exchange_get(stream, "localhost", path)
}

fn exchange_get(
    mut stream: impl Read + Write,
    host: &str,
    path: &str,
) -> anyhow::Result<(u16, String)> {
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let response = String::from_utf8_lossy(&raw);
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow::anyhow!("not an HTTP response: {response:.200}"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("not an HTTP response: {head:.200}"))?;
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase().starts_with("transfer-encoding:")
            && l.to_ascii_lowercase().contains("chunked")
    });
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_string()
    };
    Ok((status, body))
}

fn dechunk(mut rest: &str) -> anyhow::Result<String> {
    let mut out = String::new();
    loop {
        let (size, after) = rest
            .split_once("\r\n")
            .ok_or_else(|| anyhow::anyhow!("truncated chunked body"))?;
        let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)?;
        if size == 0 {
            return Ok(out);
        }
        anyhow::ensure!(after.len() >= size + 2, "truncated chunk");
        out.push_str(&after[..size]);
        rest = &after[size + 2..];
    }
}

/// Runs the agent to completion (for start-up failures): (exit code, stderr).
pub fn run_to_exit(args: &[&str]) -> (Option<i32>, String) {
    let output = Command::new(bins::path("lattice-agent"))
        .args(args)
        .output()
        .expect("run lattice-agent");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An agent that refuses to start is seen gone through `&self` (a benchmark waiting for its
    /// xDS stops at once instead of at its deadline), and a running one is not.
    #[test]
    fn an_agent_that_refuses_to_start_is_seen_exited() {
        let missing = tempfile::tempdir().expect("temp dir");
        let refused = Agent::start(&[
            "--mesh-file",
            missing
                .path()
                .join("absent.yaml")
                .to_str()
                .expect("UTF-8 path"),
        ]);
        wait::until("the refused agent exits", Duration::from_secs(20), || {
            if refused.has_exited() {
                Ok(())
            } else {
                Err("still running".to_string())
            }
        })
        .expect("the agent exits");

        let mesh = missing.path().join("mesh.yaml");
        std::fs::write(&mesh, "services: []\n").expect("mesh file");
        let running = Agent::start(&["--mesh-file", mesh.to_str().expect("UTF-8 path")]);
        running.wait_ready().expect("ready");
        assert!(!running.has_exited());
    }
}
