//! The node-local DNS address (`--node-local-dns`), end to end: the real agent in a "node"
//! network namespace adds the address with netlink before its DNS server binds, a "pod"
//! namespace routed through the node resolves mesh names on it, and it stays after SIGTERM for
//! the agent that follows.
//! Dummy links may be unavailable (no `dummy` module); the agent then uses `lo`, and the tests
//! accept either link but require the one the agent names in its log.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use lattice_e2e::agent::{free_ports, http_get};
use lattice_e2e::bins;
use lattice_e2e::netns::{Netns, Process};
use lattice_e2e::wait;

const NODE_LOCAL: &str = "169.254.20.10";
const DUMMY_LINK: &str = "lattice-dns0";

const MESH: &str = "services:
  - path: /foo/bar/buzz
    ports:
      - port: 8080
        protocol: http
    endpoints:
      - address: 10.200.0.3
";

/// The agent running in `node`, with its log in a temp file.
struct NodeAgent {
    process: Option<Process>,
    log: tempfile::NamedTempFile,
    admin: SocketAddr,
    dns_port: u16,
    _mesh: tempfile::NamedTempFile,
}

impl NodeAgent {
    fn start(node: &Netns) -> anyhow::Result<NodeAgent> {
        let mesh = tempfile::NamedTempFile::new()?;
        std::fs::write(mesh.path(), MESH)?;
        let log = tempfile::NamedTempFile::new()?;
        // The namespace is fresh, so any port is free in it.
        let [dns_port, admin_port, xds_port] = free_ports();
        let admin = SocketAddr::from(([127, 0, 0, 1], admin_port));
        let mut command = node.command(bins::path("lattice-agent"));
        command
            .arg(format!("--mesh-file={}", mesh.path().display()))
            .arg(format!("--node-local-dns={NODE_LOCAL}"))
            .arg(format!("--dns-addr={NODE_LOCAL}:{dns_port}"))
            .arg(format!("--admin-addr={admin}"))
            .arg(format!("--xds-addr=127.0.0.1:{xds_port}"))
            // Never the machine's resolver: an address nothing listens on.
            .arg("--upstream-dns=127.0.0.1:9")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log.reopen()?);
        let process = node.spawn(command)?;
        let agent = NodeAgent {
            process: Some(process),
            log,
            admin,
            dns_port,
            _mesh: mesh,
        };
        wait::until(
            "agent /readyz in the node",
            Duration::from_secs(20),
            || match node.enter(|| http_get(agent.admin, "/readyz")) {
                Ok(Ok((200, _))) => Ok(()),
                other => Err(format!("{other:?}; log:\n{}", agent.log())),
            },
        )?;
        Ok(agent)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    /// The link the agent says it put the address on.
    fn link(&self) -> anyhow::Result<String> {
        let log = self.log();
        let line = log
            .lines()
            .find(|l| l.contains("node-local DNS address installed"))
            .ok_or_else(|| anyhow::anyhow!("no install line in the agent log:\n{log}"))?;
        Ok(if line.contains(DUMMY_LINK) {
            DUMMY_LINK.to_string()
        } else {
            "lo".to_string()
        })
    }

    fn terminate(&mut self) -> anyhow::Result<ExitStatus> {
        let mut process = self
            .process
            .take()
            .ok_or_else(|| anyhow::anyhow!("agent not running"))?;
        // `ip netns exec` execs the agent, so this pid is the agent's.
        let pid = nix::unistd::Pid::from_raw(i32::try_from(process.child().id())?);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
        wait::until("agent exit after SIGTERM", Duration::from_secs(10), || {
            process
                .child()
                .try_wait()
                .map_err(|e| e.to_string())?
                .ok_or_else(|| "still running".to_string())
        })
    }

    /// SIGKILL, as a crash or an OOM kill would: no clean-up runs.
    fn kill(&mut self) -> anyhow::Result<()> {
        let mut process = self
            .process
            .take()
            .ok_or_else(|| anyhow::anyhow!("agent not running"))?;
        process.child().kill()?;
        process.child().wait()?;
        Ok(())
    }
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- lattice-agent log ---\n{}", self.log());
        }
    }
}

/// `ip -o addr show` lines in `netns` that carry the node-local address.
fn node_local_lines(netns: &Netns) -> anyhow::Result<Vec<String>> {
    let out = netns.ip(&["-o", "addr", "show"])?;
    Ok(out
        .lines()
        .filter(|l| l.contains(&format!(" {NODE_LOCAL}/32 ")))
        .map(str::to_string)
        .collect())
}

fn has_dummy_link(netns: &Netns) -> anyhow::Result<bool> {
    Ok(netns
        .ip(&["-o", "link", "show"])?
        .lines()
        .any(|l| l.contains(&format!(" {DUMMY_LINK}:"))))
}

fn dig(netns: &Netns, port: u16, name: &str) -> anyhow::Result<String> {
    let out = netns.exec(
        "dig",
        &[
            "+short",
            "+time=2",
            "+tries=1",
            &format!("@{NODE_LOCAL}"),
            "-p",
            &port.to_string(),
            name,
            "A",
        ],
    )?;
    Ok(out.trim().to_string())
}

/// A "pod" namespace whose default route goes through the node, as a CNI sets it up.
fn pod_of(node: &Netns) -> anyhow::Result<Netns> {
    let pod = Netns::new("pod")?;
    pod.veth(
        "eth0",
        "10.200.0.3/24",
        node,
        "veth-pod",
        Some("10.200.0.1/24"),
    )?;
    pod.ip(&["route", "add", "default", "via", "10.200.0.1"])?;
    Ok(pod)
}

#[test]
fn node_local_address_exists_while_the_agent_runs_and_answers_pods() -> anyhow::Result<()> {
    let node = Netns::new("node")?;
    let pod = pod_of(&node)?;
    assert!(node_local_lines(&node)?.is_empty());

    let mut agent = NodeAgent::start(&node)?;
    let link = agent.link()?;
    let lines = node_local_lines(&node)?;
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].split_whitespace().nth(1) == Some(link.as_str()),
        "address not on {link}: {lines:?}"
    );
    if link == DUMMY_LINK {
        assert!(has_dummy_link(&node)?);
    }

    // In the node, and from a pod routed through it: the trapped shared address for a mesh
    // name, as `dnsConfig: nameservers: [169.254.20.10]` makes pods ask.
    assert_eq!(
        dig(&node, agent.dns_port, "buzz.bar.foo.system.internal")?,
        "240.240.0.1"
    );
    assert_eq!(
        dig(&pod, agent.dns_port, "buzz.bar.foo.system.internal")?,
        "240.240.0.1"
    );

    // SIGTERM leaves the address to the agent that follows (an upgrade's new agent serves on
    // it while this one drains): still there, and the next agent answers on it.
    let status = agent.terminate()?;
    assert!(status.success(), "{status}; log:\n{}", agent.log());
    assert_eq!(
        node_local_lines(&node)?,
        lines,
        "the address stays after SIGTERM"
    );
    let next = NodeAgent::start(&node)?;
    assert_eq!(
        dig(&pod, next.dns_port, "buzz.bar.foo.system.internal")?,
        "240.240.0.1"
    );
    Ok(())
}

#[test]
fn an_address_left_by_a_killed_agent_is_taken_over() -> anyhow::Result<()> {
    let node = Netns::new("node")?;
    let mut crashed = NodeAgent::start(&node)?;
    crashed.kill()?;
    // Nothing ran on SIGKILL: the address is still there.
    assert_eq!(node_local_lines(&node)?.len(), 1);

    let mut agent = NodeAgent::start(&node)?;
    assert_eq!(node_local_lines(&node)?.len(), 1, "installed twice");
    assert_eq!(
        dig(&node, agent.dns_port, "buzz.bar.foo.system.internal")?,
        "240.240.0.1"
    );
    assert!(agent.terminate()?.success(), "log:\n{}", agent.log());
    assert_eq!(node_local_lines(&node)?.len(), 1, "left for the next agent");
    Ok(())
}

#[test]
fn check_config_adds_nothing_and_refuses_a_dns_addr_off_the_address() -> anyhow::Result<()> {
    let node = Netns::new("node")?;
    let mesh = tempfile::NamedTempFile::new()?;
    std::fs::write(mesh.path(), MESH)?;
    let run = |dns_addr: &str| check_config(&node, mesh.path(), &format!("--dns-addr={dns_addr}"));

    let (ok, out) = run(&format!("{NODE_LOCAL}:53"))?;
    assert!(ok, "{out}");
    let (ok, out) = run("0.0.0.0:53")?;
    assert!(ok, "{out}");
    assert!(node_local_lines(&node)?.is_empty());
    assert!(!has_dummy_link(&node)?);

    let (ok, out) = run("127.0.0.1:53")?;
    assert!(!ok, "a DNS server off the node-local address was accepted");
    assert!(
        out.contains("127.0.0.1:53") && out.contains(NODE_LOCAL),
        "{out}"
    );
    Ok(())
}

#[test]
fn without_net_admin_start_up_fails_and_says_why() -> anyhow::Result<()> {
    let node = Netns::new("node")?;
    let mesh = tempfile::NamedTempFile::new()?;
    std::fs::write(mesh.path(), MESH)?;
    let [dns_port, admin_port, xds_port] = free_ports();
    // setpriv drops CAP_NET_ADMIN from the bounding set, so even root lacks it after exec.
    let output = node
        .command("setpriv")
        .args(["--bounding-set=-net_admin", "--inh-caps=-net_admin", "--"])
        .arg(bins::path("lattice-agent"))
        .arg(format!("--mesh-file={}", mesh.path().display()))
        .arg(format!("--node-local-dns={NODE_LOCAL}"))
        .arg(format!("--dns-addr={NODE_LOCAL}:{dns_port}"))
        .arg(format!("--admin-addr=127.0.0.1:{admin_port}"))
        .arg(format!("--xds-addr=127.0.0.1:{xds_port}"))
        .arg("--upstream-dns=127.0.0.1:9")
        .stdin(Stdio::null())
        .output()?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "started without CAP_NET_ADMIN");
    assert!(stderr.contains("CAP_NET_ADMIN"), "{stderr}");
    assert!(node_local_lines(&node)?.is_empty());
    assert!(!has_dummy_link(&node)?);
    Ok(())
}

/// `lattice-agent --check-config --node-local-dns …` in `netns`: (success, stdout + stderr).
fn check_config(netns: &Netns, mesh: &Path, dns_flag: &str) -> anyhow::Result<(bool, String)> {
    let output = netns
        .command(bins::path("lattice-agent"))
        .arg(format!("--mesh-file={}", mesh.display()))
        .arg(format!("--node-local-dns={NODE_LOCAL}"))
        .arg(dns_flag)
        .arg("--check-config")
        .stdin(Stdio::null())
        .output()?;
    Ok((
        output.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ),
    ))
}
