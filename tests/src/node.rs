//! A simulated Kubernetes node for data-path tests: a "node" network namespace with a bridge
//! and no route out of the machine, the agent running inside it, and "pod" namespaces on the
//! bridge — a client pod set up the way a mesh pod is (the real `lattice-init`, then a real
//! Envoy as UID 1337 on the bootstrap init wrote, its resolver on the agent's DNS), backend pods
//! with HTTP servers that answer with their identity, and a raw TCP echo.
//!
//! ```text
//!  node netns: br0 10.200.0.1/24, agent xDS :15010 + DNS :53 on 10.200.0.1, admin 127.0.0.1:15020
//!    ├── client pod 10.200.0.2: iptables (lattice-init) → Envoy :15001 (uid 1337)
//!    ├── backend pods 10.200.0.1x:8080 (HTTP, answer "<identity>")
//!    └── echo pod 10.200.0.2x (raw TCP echo)
//! ```
//!
//! Every piece is a guard: processes are killed and namespaces deleted on drop, also when a test
//! panics. Declare the [`Node`] first so it drops last. Traffic only ever goes to addresses of
//! these namespaces: the node has no default route, and the agent's upstream DNS is an address
//! nothing listens on unless a test says otherwise.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context as _;

use crate::agent::{Agent, AgentAddrs, http_get};
use crate::netns::{Netns, Process, enter_path, join_path};
use crate::{bins, envoy, wait};

/// The node's address on its pod bridge; the agent serves xDS and DNS here.
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 1);
/// The agent's xDS address in the node, as a DaemonSet with hostNetwork would serve it.
pub const XDS: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(NODE_IP), 15010);
/// The agent's DNS address in the node.
pub const DNS: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(NODE_IP), 53);
/// The agent's admin address, on the node's loopback.
pub const ADMIN: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 15020);
/// The UID Envoy runs as in a mesh pod (its traffic is never captured).
pub const ENVOY_UID: u32 = 1337;
/// Envoy's admin port inside a pod (loopback only).
pub const ENVOY_ADMIN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 15000);

/// Timeouts for one request from a pod: bounded, so nothing a test does can hang.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// The node: its network namespace, with a bridge `br0` at [`NODE_IP`] and nothing else.
pub struct Node {
    pub netns: Netns,
    next_port: AtomicU32,
}

impl Node {
    pub fn new(label: &str) -> anyhow::Result<Node> {
        let netns = Netns::new(label)?;
        netns.bridge("br0", &format!("{NODE_IP}/24"))?;
        Ok(Node {
            netns,
            next_port: AtomicU32::new(0),
        })
    }

    /// A pod namespace on the node's bridge at `10.200.0.<host>`, its default route via the node.
    pub fn pod(&self, label: &str, host: u8) -> anyhow::Result<Pod> {
        let address = Ipv4Addr::new(10, 200, 0, host);
        let netns = Netns::new(label)?;
        let port = format!("vp{}", self.next_port.fetch_add(1, Ordering::Relaxed));
        netns.veth("eth0", &format!("{address}/24"), &self.netns, &port, None)?;
        self.netns.attach(&port, "br0")?;
        netns.ip(&["route", "add", "default", "via", &NODE_IP.to_string()])?;
        Ok(Pod { netns, address })
    }

    /// Starts the real agent in the node namespace on [`XDS`], [`DNS`] and [`ADMIN`], and waits
    /// until it is ready.
    pub fn agent(&self, args: &[&str], envs: &[(&str, &str)]) -> anyhow::Result<Agent> {
        let addrs = AgentAddrs {
            xds: XDS,
            dns: DNS,
            admin: ADMIN,
        };
        self.agent_at(addrs, args, envs)
    }

    /// [`Node::agent`] on other addresses, as a DaemonSet serving on the node-local address.
    pub fn agent_at(
        &self,
        addrs: AgentAddrs,
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> anyhow::Result<Agent> {
        let agent = Agent::start_in_netns(&self.netns, addrs, args, envs);
        agent.wait_ready()?;
        Ok(agent)
    }

    /// A backend pod serving HTTP on `port` that answers every request with `identity`.
    pub fn http_backend(&self, identity: &str, host: u8, port: u16) -> anyhow::Result<Backend> {
        self.http_backend_with(identity, host, port, Behaviour::Answer)
    }

    /// A backend pod serving HTTP on `port` that answers with `identity` as `behaviour` says.
    pub fn http_backend_with(
        &self,
        identity: &str,
        host: u8,
        port: u16,
        behaviour: Behaviour,
    ) -> anyhow::Result<Backend> {
        Backend::http(self.pod(identity, host)?, identity, port, behaviour)
    }

    /// A backend pod with a raw TCP echo on `port`.
    pub fn tcp_echo(&self, identity: &str, host: u8, port: u16) -> anyhow::Result<Backend> {
        let pod = self.pod(identity, host)?;
        let server = Server::start(&pod, port, serve_echo)?;
        Ok(Backend {
            server,
            identity: identity.to_string(),
            pod,
            healthy: Arc::new(AtomicBool::new(true)),
        })
    }

    /// A backend pod that answers every TCP connection on `port` with `<identity> <its address>`
    /// once the client has sent its request and shut down its side: which pod a connection
    /// reached, whatever sits in between.
    pub fn tcp_identity(&self, identity: &str, host: u8, port: u16) -> anyhow::Result<Backend> {
        let pod = self.pod(identity, host)?;
        let answer = format!("{identity} {}\n", pod.address);
        let server = Server::start(&pod, port, move |mut stream, stats| {
            stats.record();
            let _ = std::io::copy(&mut stream, &mut std::io::sink());
            let _ = stream.write_all(answer.as_bytes());
            let _ = stream.shutdown(Shutdown::Write);
        })?;
        Ok(Backend {
            server,
            identity: identity.to_string(),
            pod,
            healthy: Arc::new(AtomicBool::new(true)),
        })
    }

    /// A mesh client pod: `lattice-init`, then Envoy as UID 1337, waited on until LIVE (so the
    /// agent must be serving). See [`ClientPod`].
    pub fn client(&self, label: &str, host: u8) -> anyhow::Result<ClientPod> {
        ClientPod::start(self, label, host, XDS, DNS, &[])
    }

    /// [`Node::client`] whose Envoy and resolver use the agent at `xds` and `dns`.
    pub fn client_of(
        &self,
        label: &str,
        host: u8,
        xds: SocketAddr,
        dns: SocketAddr,
    ) -> anyhow::Result<ClientPod> {
        ClientPod::start(self, label, host, xds, dns, &[])
    }

    /// [`Node::client`] whose Envoy is started but not waited for, as the kubelet starts a
    /// native sidecar: the test decides what to wait for ([`ClientPod::probe_ready`]).
    pub fn client_starting(&self, label: &str, host: u8) -> anyhow::Result<ClientPod> {
        ClientPod::launch(self, label, host, XDS, DNS, &[])
    }

    /// [`Node::client_of`] with more `lattice-init` flags (`--xds-mode=sotw`).
    pub fn client_with(
        &self,
        label: &str,
        host: u8,
        (xds, dns): (SocketAddr, SocketAddr),
        init_args: &[&str],
    ) -> anyhow::Result<ClientPod> {
        ClientPod::start(self, label, host, xds, dns, init_args)
    }

    /// [`Node::client_of`] whose bootstrap, as `lattice-init` wrote it, `edit` changes before
    /// Envoy starts (a listener of the test's own, say).
    pub fn client_editing(
        &self,
        label: &str,
        host: u8,
        (xds, dns): (SocketAddr, SocketAddr),
        edit: &dyn Fn(&mut serde_json::Value),
    ) -> anyhow::Result<ClientPod> {
        let client = ClientPod::launch_editing(self, label, host, (xds, dns), &[], Some(edit))?;
        client.wait_live()?;
        Ok(client)
    }
}

/// The node's end of its link to the internet gateway ([`Node::internet`]).
const UPLINK_NODE: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 1);
/// The gateway's end of that link.
const UPLINK_GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 2);
/// The pods' block, which the gateway routes back to the node.
const POD_BLOCK: &str = "10.200.0.0/24";
/// "The internet": TEST-NET-3 (RFC 5737), documentation only, routed nowhere.
pub const INTERNET_BLOCK: &str = "203.0.113.0/24";
/// The gateway's address on the internet side.
const INTERNET_GATEWAY: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);

impl Node {
    /// The internet beyond the node: a namespace that plays its internet gateway, linked to
    /// the node, and behind it hosts on [`INTERNET_BLOCK`] ([`Internet::host`]). The node
    /// routes that block, and only that block, through the gateway, and forwards its pods'
    /// traffic there; the gateway has no other link, so nothing leaves the machine.
    ///
    /// ```text
    ///  node netns ── uplink 10.201.0.1 ─ 10.201.0.2 ── gateway netns (forwards)
    ///                                                    └── inet0 203.0.113.1/24
    ///                                                          └── hosts 203.0.113.x
    /// ```
    pub fn internet(&self, label: &str) -> anyhow::Result<Internet> {
        let gateway = Netns::new(label)?;
        gateway.veth(
            "up0",
            &format!("{UPLINK_GATEWAY}/30"),
            &self.netns,
            "uplink",
            Some(&format!("{UPLINK_NODE}/30")),
        )?;
        gateway.bridge("inet0", &format!("{INTERNET_GATEWAY}/24"))?;
        gateway.ip(&["route", "add", POD_BLOCK, "via", &UPLINK_NODE.to_string()])?;
        for netns in [&gateway, &self.netns] {
            netns.exec("sysctl", &["-qw", "net.ipv4.ip_forward=1"])?;
        }
        self.netns.ip(&[
            "route",
            "add",
            INTERNET_BLOCK,
            "via",
            &UPLINK_GATEWAY.to_string(),
        ])?;
        Ok(Internet {
            gateway,
            next_port: AtomicU32::new(0),
        })
    }
}

/// The gateway namespace and the internet behind it ([`Node::internet`]).
pub struct Internet {
    pub gateway: Netns,
    next_port: AtomicU32,
}

impl Internet {
    /// A host namespace on the internet at `203.0.113.<host>`, its default route via the
    /// gateway: outside the node's bridge, reached from the node only through the gateway.
    pub fn host(&self, label: &str, host: u8) -> anyhow::Result<Pod> {
        let address = Ipv4Addr::new(203, 0, 113, host);
        let netns = Netns::new(label)?;
        let port = format!("ip{}", self.next_port.fetch_add(1, Ordering::Relaxed));
        netns.veth("eth0", &format!("{address}/24"), &self.gateway, &port, None)?;
        self.gateway.attach(&port, "inet0")?;
        netns.ip(&[
            "route",
            "add",
            "default",
            "via",
            &INTERNET_GATEWAY.to_string(),
        ])?;
        Ok(Pod { netns, address })
    }

    /// An HTTP server on an internet host that answers every request with `identity`.
    pub fn http_backend(&self, identity: &str, host: u8, port: u16) -> anyhow::Result<Backend> {
        Backend::http(
            self.host(identity, host)?,
            identity,
            port,
            Behaviour::Answer,
        )
    }
}

/// A pod: its namespace and its address (on the node's bridge, or an internet host's).
pub struct Pod {
    pub netns: Netns,
    pub address: Ipv4Addr,
}

/// How an HTTP backend answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Behaviour {
    /// `200` with its identity.
    Answer,
    /// `503` to every other request it serves (the 1st, 3rd, …), `200` to the rest: exactly
    /// half fail, whatever the load.
    FailEveryOther,
    /// `200` with its identity, after this long.
    Slow(Duration),
    /// `503` to every request.
    Fail,
}

/// The request heads a backend keeps, newest last: enough for a test to read what the last
/// requests carried, bounded so a load test does not grow it.
const KEPT_HEADS: usize = 64;

/// What a backend server saw: requests (HTTP) or connections (echo), and when.
#[derive(Default)]
pub struct Stats {
    served: AtomicU64,
    times: Mutex<(Option<Instant>, Option<Instant>)>,
    heads: Mutex<std::collections::VecDeque<String>>,
}

impl Stats {
    /// Counts one request (or connection); returns how many came before it.
    fn record(&self) -> u64 {
        let before = self.served.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let mut times = self.times.lock().unwrap_or_else(|p| p.into_inner());
        times.0.get_or_insert(now);
        times.1 = Some(now);
        before
    }

    fn keep_head(&self, head: String) {
        let mut heads = self.heads.lock().unwrap_or_else(|p| p.into_inner());
        if heads.len() == KEPT_HEADS {
            heads.pop_front();
        }
        heads.push_back(head);
    }

    /// The request heads (request line and headers, as received) of the last requests.
    pub fn heads(&self) -> Vec<String> {
        let heads = self.heads.lock().unwrap_or_else(|p| p.into_inner());
        heads.iter().cloned().collect()
    }

    pub fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }

    pub fn first(&self) -> Option<Instant> {
        self.times.lock().unwrap_or_else(|p| p.into_inner()).0
    }

    pub fn last(&self) -> Option<Instant> {
        self.times.lock().unwrap_or_else(|p| p.into_inner()).1
    }
}

/// A TCP server in a pod: a listener made inside the pod's namespace, an accept thread, a
/// thread per connection. Dropping it stops accepting (shutdown wakes the blocked accept).
pub struct Server {
    listener: Arc<TcpListener>,
    stopping: Arc<AtomicBool>,
    accepting: Option<JoinHandle<()>>,
    pub stats: Arc<Stats>,
}

impl Server {
    /// An HTTP server in a pod that is also something else (a mesh pod, whose app it plays),
    /// answering every request with `identity`, as [`Backend::http`] does.
    pub fn http(pod: &Pod, identity: &str, port: u16) -> anyhow::Result<Server> {
        let answer = identity.to_string();
        let healthy = Arc::new(AtomicBool::new(true));
        Server::start(pod, port, move |stream, stats| {
            serve_http(stream, &answer, stats, Behaviour::Answer, &healthy)
        })
    }

    /// A TCP echo server in a pod that is also something else, as [`Node::tcp_echo`]'s.
    pub fn echo(pod: &Pod, port: u16) -> anyhow::Result<Server> {
        Server::start(pod, port, serve_echo)
    }

    fn start<H>(pod: &Pod, port: u16, handler: H) -> anyhow::Result<Server>
    where
        H: Fn(TcpStream, &Stats) + Send + Sync + 'static,
    {
        let listener = Arc::new(
            pod.netns
                .enter(|| TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)))?
                .with_context(|| format!("binding :{port} in {}", pod.netns.name()))?,
        );
        let stats = Arc::new(Stats::default());
        let stopping = Arc::new(AtomicBool::new(false));
        let handler = Arc::new(handler);
        let accepting = {
            let (listener, stats, stopping) = (listener.clone(), stats.clone(), stopping.clone());
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    if stopping.load(Ordering::Relaxed) {
                        return;
                    }
                    let Ok(stream) = stream else { continue };
                    let (stats, handler) = (stats.clone(), handler.clone());
                    std::thread::spawn(move || {
                        // A connection that idles longer than this is given up on, so no
                        // thread outlives its test by much.
                        let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
                        handler(stream, &stats);
                    });
                }
            })
        };
        Ok(Server {
            listener,
            stopping,
            accepting: Some(accepting),
            stats,
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Relaxed);
        // shutdown(2) on a listening socket makes a blocked accept(2) return (EINVAL).
        let _ =
            nix::sys::socket::shutdown(self.listener.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        if let Some(thread) = self.accepting.take() {
            let _ = thread.join();
        }
    }
}

/// HTTP/1.1 with keep-alive (Envoy pools its upstream connections): every request is answered
/// with the identity as the body, as `behaviour` says. `GET /healthz` is the health check:
/// `200` or `503` as `healthy` says, and not counted in `stats`, which count real traffic.
fn serve_http(
    stream: TcpStream,
    identity: &str,
    stats: &Stats,
    behaviour: Behaviour,
    healthy: &AtomicBool,
) {
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    loop {
        let mut close = false;
        let mut saw_request = false;
        let mut head = String::new();
        loop {
            let mut line = String::new();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let line = line.trim_end();
            if line.is_empty() {
                if saw_request {
                    break;
                }
                continue;
            }
            saw_request = true;
            head.push_str(line);
            head.push('\n');
            let lower = line.to_ascii_lowercase();
            if lower.starts_with("connection:") && lower.contains("close") {
                close = true;
            }
        }
        let status = if head.starts_with("GET /healthz ") {
            if healthy.load(Ordering::SeqCst) {
                "200 OK"
            } else {
                "503 Service Unavailable"
            }
        } else {
            let before = stats.record();
            stats.keep_head(head);
            match behaviour {
                Behaviour::FailEveryOther if before.is_multiple_of(2) => "503 Service Unavailable",
                Behaviour::Fail => "503 Service Unavailable",
                Behaviour::Slow(delay) => {
                    std::thread::sleep(delay);
                    "200 OK"
                }
                _ => "200 OK",
            }
        };
        let body = format!("{identity}\n");
        let response = format!(
            "HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n{}\r\n{body}",
            body.len(),
            if close { "connection: close\r\n" } else { "" }
        );
        if writer.write_all(response.as_bytes()).is_err() || close {
            return;
        }
    }
}

fn serve_echo(mut stream: TcpStream, stats: &Stats) {
    stats.record();
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let _ = std::io::copy(&mut stream, &mut writer);
    let _ = writer.shutdown(Shutdown::Write);
}

/// A backend pod and its server. The server drops (stops) before the pod's namespace goes.
pub struct Backend {
    pub server: Server,
    pub identity: String,
    pub pod: Pod,
    /// What an HTTP backend answers to `GET /healthz`.
    healthy: Arc<AtomicBool>,
}

impl Backend {
    /// An HTTP server in `pod` on `port` that answers with `identity` as `behaviour` says.
    pub fn http(pod: Pod, identity: &str, port: u16, behaviour: Behaviour) -> anyhow::Result<Self> {
        let answer = identity.to_string();
        let healthy = Arc::new(AtomicBool::new(true));
        let health = healthy.clone();
        let server = Server::start(&pod, port, move |stream, stats| {
            serve_http(stream, &answer, stats, behaviour, &health)
        })?;
        Ok(Backend {
            server,
            identity: identity.to_string(),
            pod,
            healthy,
        })
    }

    pub fn stats(&self) -> &Stats {
        &self.server.stats
    }

    /// Makes an HTTP backend's health check (`GET /healthz`) pass or fail; real requests are
    /// answered as before.
    pub fn set_healthy(&self, healthy: bool) {
        self.healthy.store(healthy, Ordering::SeqCst);
    }
}

/// One HTTP/1.1 GET with the kubelet's default probe timeout (one second to connect, one for
/// the answer): `Ok(body)` on 200.
pub(crate) fn probe(target: SocketAddr, path: &str) -> Result<String, String> {
    const TIMEOUT: Duration = Duration::from_secs(1);
    let mut stream = TcpStream::connect_timeout(&target, TIMEOUT).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(TIMEOUT))
        .map_err(|e| e.to_string())?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {target}\r\nUser-Agent: kube-probe/1.33\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    if head.starts_with("HTTP/1.1 200") {
        Ok(body.to_string())
    } else {
        Err(format!("{head:.200}"))
    }
}

/// The real UID of process `pid`, from `/proc/<pid>/status`.
pub(crate) fn process_uid(pid: u32) -> anyhow::Result<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|uids| uids.split_whitespace().next())
        .and_then(|uid| uid.parse().ok())
        .with_context(|| format!("no Uid line in /proc/{pid}/status"))
}

/// `/etc/netns/<name>/resolv.conf`, which `ip netns exec` mounts over `/etc/resolv.conf`;
/// removed on drop.
pub(crate) struct ResolvConf {
    dir: PathBuf,
}

impl ResolvConf {
    fn write(netns: &Netns, nameserver: Ipv4Addr) -> anyhow::Result<ResolvConf> {
        ResolvConf::write_text(
            netns,
            &format!("nameserver {nameserver}\noptions timeout:2 attempts:1\n"),
        )
    }

    /// `text` as the namespace's resolv.conf.
    pub(crate) fn write_text(netns: &Netns, text: &str) -> anyhow::Result<ResolvConf> {
        let dir = Path::new("/etc/netns").join(netns.name());
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let guard = ResolvConf { dir };
        std::fs::write(guard.dir.join("resolv.conf"), text)?;
        Ok(guard)
    }
}

impl Drop for ResolvConf {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A mesh client pod, set up as the real thing: `lattice-init` (capture of the trapped block to
/// Envoy, DNS redirected to the agent, the Envoy bootstrap written with the node as xDS server),
/// then Envoy as UID 1337 on that bootstrap, and a resolv.conf naming the agent's DNS.
/// Fields drop in order: Envoy, resolv.conf, the namespace, the bootstrap directory.
pub struct ClientPod {
    envoy: Process,
    _resolv: ResolvConf,
    pub pod: Pod,
    /// What `lattice-init` printed (its rules and the bootstrap summary).
    pub init_output: String,
    dir: tempfile::TempDir,
}

impl ClientPod {
    fn start(
        node: &Node,
        label: &str,
        host: u8,
        xds: SocketAddr,
        dns: SocketAddr,
        init_args: &[&str],
    ) -> anyhow::Result<ClientPod> {
        let client = ClientPod::launch(node, label, host, xds, dns, init_args)?;
        client.wait_live()?;
        Ok(client)
    }

    fn launch(
        node: &Node,
        label: &str,
        host: u8,
        xds: SocketAddr,
        dns: SocketAddr,
        init_args: &[&str],
    ) -> anyhow::Result<ClientPod> {
        ClientPod::launch_editing(node, label, host, (xds, dns), init_args, None)
    }

    fn launch_editing(
        node: &Node,
        label: &str,
        host: u8,
        (xds, dns): (SocketAddr, SocketAddr),
        init_args: &[&str],
        edit: Option<&dyn Fn(&mut serde_json::Value)>,
    ) -> anyhow::Result<ClientPod> {
        let pod = node.pod(label, host)?;
        let std::net::IpAddr::V4(nameserver) = dns.ip() else {
            anyhow::bail!("the pods' nameserver is IPv4: {dns}");
        };
        let resolv = ResolvConf::write(&pod.netns, nameserver)?;
        let dir = tempfile::tempdir()?;
        let bootstrap = dir.path().join("envoy.json");
        let init = pod
            .netns
            .command(bins::path("lattice-init"))
            .arg(format!("--xds-address={xds}"))
            .arg(format!("--node-id={label}.default"))
            .arg(format!("--redirect-dns={dns}"))
            .args(init_args)
            .arg("--bootstrap-out")
            .arg(&bootstrap)
            .stdin(Stdio::null())
            .output()
            .context("running lattice-init")?;
        anyhow::ensure!(
            init.status.success(),
            "lattice-init failed ({}): {}",
            init.status,
            String::from_utf8_lossy(&init.stderr)
        );
        let init_output = format!(
            "{}{}",
            String::from_utf8_lossy(&init.stdout),
            String::from_utf8_lossy(&init.stderr)
        );
        if let Some(edit) = edit {
            let mut written: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&bootstrap)?)?;
            edit(&mut written);
            std::fs::write(&bootstrap, serde_json::to_vec_pretty(&written)?)?;
        }
        // Envoy runs unprivileged: it must be able to read its bootstrap.
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        std::fs::set_permissions(&bootstrap, std::fs::Permissions::from_mode(0o644))?;
        let log = std::fs::File::create(dir.path().join("envoy.log"))?;
        let mut command = pod.netns.command("setpriv");
        command
            .args([
                format!("--reuid={ENVOY_UID}"),
                format!("--regid={ENVOY_UID}"),
                "--clear-groups".to_string(),
                "--".to_string(),
            ])
            .arg(envoy::binary())
            .arg("-c")
            .arg(&bootstrap)
            .args(envoy::ARGS)
            .stdout(Stdio::null())
            .stderr(log);
        let envoy = pod.netns.spawn(command)?;
        Ok(ClientPod {
            envoy,
            _resolv: resolv,
            pod,
            init_output,
            dir,
        })
    }

    /// The kubelet's HTTP probe of Envoy's readiness endpoint, made as the kubelet makes it:
    /// from the node, to the pod's address, with its default one-second timeout. `Ok` with the
    /// body on 200; anything else (no connection, no answer in time, another status) is a
    /// failed probe.
    pub fn probe_ready(&self, node: &Node) -> Result<String, String> {
        let target = SocketAddr::from((self.pod.address, lattice_contract::ENVOY_READINESS_PORT));
        let path = lattice_contract::ENVOY_READINESS_PATH;
        node.netns
            .enter(|| probe(target, path))
            .map_err(|e| e.to_string())?
    }

    /// Envoy's server state from its admin (`PRE_INITIALIZING`, `INITIALIZING`, `LIVE`, …).
    pub fn envoy_state(&self) -> Result<String, String> {
        let body = self.envoy_admin("/server_info")?;
        let info: serde_json::Value = serde_json::from_str(&body).map_err(|e| e.to_string())?;
        info["state"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| format!("no state in {body:.200}"))
    }

    pub fn netns(&self) -> &Netns {
        &self.pod.netns
    }

    /// The real UID Envoy runs as, from `/proc/<pid>/status` (`ip netns exec` and `setpriv`
    /// exec in turn, so the child is Envoy itself).
    pub fn envoy_uid(&mut self) -> anyhow::Result<u32> {
        process_uid(self.envoy.child().id())
    }

    /// The Envoy bootstrap `lattice-init` wrote.
    pub fn bootstrap(&self) -> anyhow::Result<String> {
        Ok(std::fs::read_to_string(self.dir.path().join("envoy.json"))?)
    }

    pub fn envoy_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default()
    }

    /// A GET on the pod's Envoy admin (loopback in the pod).
    pub fn envoy_admin(&self, path: &str) -> Result<String, String> {
        match enter_path(&self.pod.netns.path(), || http_get(ENVOY_ADMIN, path)) {
            Ok(Ok((200, body))) => Ok(body),
            Ok(Ok((status, body))) => Err(format!("{status}: {body:.300}")),
            Ok(Err(err)) | Err(err) => Err(err.to_string()),
        }
    }

    fn wait_live(&self) -> anyhow::Result<()> {
        wait::until("client Envoy LIVE", Duration::from_secs(60), || {
            let body = self.envoy_admin("/server_info")?;
            if body.contains("\"LIVE\"") {
                Ok(())
            } else {
                Err(format!("{body:.300}\nlog:\n{}", self.envoy_log()))
            }
        })
    }

    /// Envoy's endpoints per mesh cluster, from `/clusters`.
    pub fn envoy_endpoints(&self) -> Result<BTreeMap<String, Vec<String>>, String> {
        let body = self.envoy_admin("/clusters")?;
        let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for line in body.lines() {
            let parts: Vec<&str> = line.split("::").collect();
            if parts.len() >= 3 && parts[0].contains(".system.internal|") {
                let endpoints = out.entry(parts[0].to_string()).or_default();
                if parts[2] == "cx_active" {
                    endpoints.push(parts[1].to_string());
                }
            }
        }
        for endpoints in out.values_mut() {
            endpoints.sort();
        }
        Ok(out)
    }

    /// Runs `program args` in the pod (as root, so captured like an app).
    pub fn run(&self, program: &str, args: &[&str]) -> anyhow::Result<Output> {
        self.pod.netns.run(program, args)
    }

    /// `curl` from the pod: the body, or curl's complaint.
    pub fn curl(&self, url: &str) -> Result<String, String> {
        let output = self
            .run("curl", &["-4", "-sS", "--max-time", "5", "--fail", url])
            .map_err(|e| e.to_string())?;
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        } else {
            Err(format!(
                "curl {url}: {}{}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ))
        }
    }

    /// `dig` through the pod's resolver: (status, A records, query wall time).
    pub fn dig(&self, name: &str) -> anyhow::Result<DigAnswer> {
        let start = Instant::now();
        let output = self.run("dig", &["+time=2", "+tries=1", name, "A"])?;
        let took = start.elapsed();
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        let status = crate::agent::dig_status(&text);
        let mut addresses = Vec::new();
        let mut in_answer = false;
        for line in text.lines() {
            if line.starts_with(";; ANSWER SECTION") {
                in_answer = true;
            } else if line.trim().is_empty() {
                in_answer = false;
            } else if in_answer {
                let fields: Vec<&str> = line.split_whitespace().collect();
                if fields.len() >= 5 && fields[3] == "A" {
                    addresses.push(fields[4].parse()?);
                }
            }
        }
        Ok(DigAnswer {
            status,
            addresses,
            took,
            text,
        })
    }

    /// The one A record of `name`, from the pod's resolver.
    pub fn resolve(&self, name: &str) -> anyhow::Result<Ipv4Addr> {
        let answer = self.dig(name)?;
        match answer.addresses.as_slice() {
            [one] if answer.status == "NOERROR" => Ok(*one),
            _ => anyhow::bail!("{name} did not resolve to one address:\n{}", answer.text),
        }
    }

    /// One HTTP GET from an app in the pod to `addr` (a trapped address) with `Host: host`; the
    /// body on 200.
    pub fn http(&self, addr: SocketAddr, host: &str) -> Result<String, String> {
        enter_path(&self.pod.netns.path(), || one_request(addr, host)).map_err(|e| e.to_string())?
    }

    /// One request from an app in the pod to `addr` with `Host: host`: whatever the status.
    pub fn request(
        &self,
        addr: SocketAddr,
        host: &str,
        request: &Request,
    ) -> Result<Reply, String> {
        enter_path(&self.pod.netns.path(), || exchange(addr, host, request))
            .map_err(|e| e.to_string())?
    }

    /// `count` requests from the pod, over `parallel` threads (each one connection at a time),
    /// in no particular order.
    pub fn requests(
        &self,
        addr: SocketAddr,
        host: &str,
        request: &Request,
        count: usize,
        parallel: usize,
    ) -> Vec<Result<Reply, String>> {
        let netns = self.pod.netns.path();
        let parallel = parallel.max(1);
        std::thread::scope(|scope| {
            let threads: Vec<_> = (0..parallel)
                .map(|i| {
                    let share = count / parallel + usize::from(i < count % parallel);
                    let netns = &netns;
                    scope.spawn(move || -> Vec<Result<Reply, String>> {
                        if let Err(e) = join_path(netns) {
                            return vec![Err(e.to_string()); share];
                        }
                        (0..share).map(|_| exchange(addr, host, request)).collect()
                    })
                })
                .collect();
            threads
                .into_iter()
                .flat_map(|t| t.join().unwrap_or_default())
                .collect()
        })
    }

    /// Sends `payload` over one TCP connection from the pod to `addr` and returns what comes
    /// back before the peer closes.
    pub fn tcp_exchange(&self, addr: SocketAddr, payload: &[u8]) -> Result<Vec<u8>, String> {
        enter_path(&self.pod.netns.path(), || echo(addr, payload)).map_err(|e| e.to_string())?
    }

    /// A steady stream of GETs from the pod to `addr` with `Host: host`, one connection each,
    /// about every `interval`, until [`Load::stop`].
    pub fn load(&self, addr: SocketAddr, host: &str, interval: Duration) -> Load {
        let host = host.to_string();
        Load::start(self.pod.netns.path(), interval, move || {
            one_request(addr, &host)
        })
    }

    /// A steady stream of TCP exchanges from the pod to `addr` (an echo), one connection each,
    /// about every `interval`, until [`Load::stop`]: each sends a numbered line and must get it
    /// back whole.
    pub fn tcp_load(&self, addr: SocketAddr, interval: Duration) -> Load {
        let mut n = 0u64;
        Load::start(self.pod.netns.path(), interval, move || {
            n += 1;
            let sent = format!("ping {n}\n");
            let back = echo(addr, sent.as_bytes())?;
            if back == sent.as_bytes() {
                Ok(sent.trim().to_string())
            } else {
                Err(format!(
                    "sent {sent:?}, got {:?}",
                    String::from_utf8_lossy(&back)
                ))
            }
        })
    }

    /// [`ClientPod::load`] over one kept-alive connection, as an app with a connection pool
    /// sends: a new connection only when Envoy closes the last, and a request that met a
    /// connection closed before any answer sent once more on a new one (what HTTP clients do
    /// for an idempotent request on a reused connection).
    pub fn load_keepalive(&self, addr: SocketAddr, host: &str, interval: Duration) -> Load {
        let mut pooled = KeptAlive::new(addr, host.to_string());
        Load::start(self.pod.netns.path(), interval, move || pooled.get())
    }
}

impl Drop for ClientPod {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- client Envoy log ---\n{}", self.envoy_log());
        }
    }
}

/// A `dig` result.
#[derive(Debug)]
pub struct DigAnswer {
    pub status: String,
    pub addresses: Vec<Ipv4Addr>,
    pub took: Duration,
    pub text: String,
}

/// What one request got: the status and body of the response, and how long it took.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: u16,
    pub body: String,
    pub took: Duration,
}

/// One request, the way an app sends it: a new connection, `Connection: close`, the method and
/// path of `request` and its headers.
fn exchange(addr: SocketAddr, host: &str, request: &Request) -> Result<Reply, String> {
    let start = Instant::now();
    let mut stream = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
        .map_err(|e| format!("connect {addr}: {e}"))?;
    stream
        .set_read_timeout(Some(IO_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let mut head = format!("GET {} HTTP/1.1\r\nHost: {host}\r\n", request.path);
    for (name, value) in &request.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("Connection: close\r\n\r\n");
    stream
        .write_all(head.as_bytes())
        .map_err(|e| format!("write: {e}"))?;
    let mut raw = Vec::new();
    stream
        .read_to_end(&mut raw)
        .map_err(|e| format!("read: {e}"))?;
    let response = String::from_utf8_lossy(&raw);
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("not an HTTP response: {response:?}"))?;
    let status_line = head.lines().next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status in {status_line:?}"))?;
    Ok(Reply {
        status,
        body: body.trim().to_string(),
        took: start.elapsed(),
    })
}

/// Sends `payload` over a new connection to `addr`, shuts down writing, and returns what
/// comes back before the peer closes.
fn echo(addr: SocketAddr, payload: &[u8]) -> Result<Vec<u8>, String> {
    let mut stream =
        TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(IO_TIMEOUT))
        .map_err(|e| e.to_string())?;
    stream.write_all(payload).map_err(|e| e.to_string())?;
    stream
        .shutdown(Shutdown::Write)
        .map_err(|e| e.to_string())?;
    let mut back = Vec::new();
    stream.read_to_end(&mut back).map_err(|e| e.to_string())?;
    Ok(back)
}

/// One GET of `/`: the body on 200, an error otherwise.
fn one_request(addr: SocketAddr, host: &str) -> Result<String, String> {
    let reply = exchange(addr, host, &Request::get("/"))?;
    if reply.status != 200 {
        return Err(format!("{}: {:.200}", reply.status, reply.body));
    }
    Ok(reply.body)
}

/// A GET with a path and headers.
#[derive(Clone, Debug, Default)]
pub struct Request {
    pub path: String,
    pub headers: Vec<(String, String)>,
}

impl Request {
    pub fn get(path: &str) -> Request {
        Request {
            path: path.to_string(),
            headers: Vec::new(),
        }
    }

    pub fn header(mut self, name: &str, value: &str) -> Request {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }
}

/// What one request of a [`Load`] got.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub at: Instant,
    /// How long the request took.
    pub took: Duration,
    pub result: Result<String, String>,
}

/// A background stream of requests from a pod.
pub struct Load {
    stopping: Arc<AtomicBool>,
    thread: Option<JoinHandle<Vec<Outcome>>>,
}

impl Load {
    fn start(
        netns: PathBuf,
        interval: Duration,
        mut request: impl FnMut() -> Result<String, String> + Send + 'static,
    ) -> Load {
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = stopping.clone();
        let thread = std::thread::spawn(move || {
            let mut outcomes = Vec::new();
            if let Err(err) = join_path(&netns) {
                outcomes.push(Outcome {
                    at: Instant::now(),
                    took: Duration::ZERO,
                    result: Err(err.to_string()),
                });
                return outcomes;
            }
            while !stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                let result = request();
                outcomes.push(Outcome {
                    at: started,
                    took: started.elapsed(),
                    result,
                });
                // Pacing, not waiting for a condition: a steady rate without starving the
                // Envoy and servers that share the cores.
                std::thread::sleep(interval.saturating_sub(started.elapsed()));
            }
            outcomes
        });
        Load {
            stopping,
            thread: Some(thread),
        }
    }

    /// Stops the stream and returns every outcome in order.
    pub fn stop(mut self) -> LoadReport {
        self.stopping.store(true, Ordering::Relaxed);
        let outcomes = self
            .thread
            .take()
            .and_then(|thread| thread.join().ok())
            .unwrap_or_default();
        LoadReport { outcomes }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One kept-alive HTTP/1.1 connection and the GETs sent on it.
struct KeptAlive {
    addr: SocketAddr,
    host: String,
    connection: Option<BufReader<TcpStream>>,
}

/// Why a request on a kept-alive connection got no answer.
enum Unanswered {
    /// The connection closed before any byte of an answer: worth one more try.
    Closed(String),
    Failed(String),
}

impl KeptAlive {
    fn new(addr: SocketAddr, host: String) -> KeptAlive {
        KeptAlive {
            addr,
            host,
            connection: None,
        }
    }

    /// One GET of `/`: the body on 200, an error otherwise.
    fn get(&mut self) -> Result<String, String> {
        let reused = self.connection.is_some();
        match self.exchange() {
            Err(Unanswered::Closed(_)) if reused => {
                self.connection = None;
                self.exchange()
                    .map_err(|(Unanswered::Closed(e) | Unanswered::Failed(e))| e)
            }
            other => other.map_err(|(Unanswered::Closed(e) | Unanswered::Failed(e))| e),
        }
    }

    fn exchange(&mut self) -> Result<String, Unanswered> {
        let failed = |e: String| Unanswered::Failed(e);
        if self.connection.is_none() {
            let stream = TcpStream::connect_timeout(&self.addr, CONNECT_TIMEOUT)
                .map_err(|e| failed(format!("connect {}: {e}", self.addr)))?;
            stream
                .set_read_timeout(Some(IO_TIMEOUT))
                .map_err(|e| failed(e.to_string()))?;
            self.connection = Some(BufReader::new(stream));
        }
        let Some(reader) = self.connection.as_mut() else {
            return Err(failed("no connection".into()));
        };
        let request = format!("GET / HTTP/1.1\r\nHost: {}\r\n\r\n", self.host);
        if let Err(e) = reader.get_mut().write_all(request.as_bytes()) {
            self.connection = None;
            return Err(Unanswered::Closed(format!("write: {e}")));
        }
        let answer = read_answer(reader);
        match &answer {
            Ok((_, _, close)) if !close => {}
            _ => self.connection = None,
        }
        let (status, body, _) = answer?;
        if status != 200 {
            return Err(failed(format!("{status}: {body:.200}")));
        }
        Ok(body.trim().to_string())
    }
}

/// One HTTP/1.1 answer: status, body, and whether the connection closes after it.
fn read_answer(reader: &mut BufReader<TcpStream>) -> Result<(u16, String, bool), Unanswered> {
    let failed = |e: String| Unanswered::Failed(e);
    let mut status_line = String::new();
    match reader.read_line(&mut status_line) {
        Ok(0) => return Err(Unanswered::Closed("closed before an answer".into())),
        Err(e) => return Err(Unanswered::Closed(format!("read: {e}"))),
        Ok(_) => {}
    }
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| failed(format!("no status in {status_line:?}")))?;
    let (mut length, mut chunked, mut close) = (None, false, false);
    loop {
        let mut line = String::new();
        if reader
            .read_line(&mut line)
            .map_err(|e| failed(e.to_string()))?
            == 0
        {
            return Err(failed("closed inside the headers".into()));
        }
        let line = line.trim_end().to_ascii_lowercase();
        if line.is_empty() {
            break;
        }
        if let Some(value) = line.strip_prefix("content-length:") {
            length = value.trim().parse::<usize>().ok();
        } else if line.starts_with("transfer-encoding:") && line.contains("chunked") {
            chunked = true;
        } else if line.starts_with("connection:") && line.contains("close") {
            close = true;
        }
    }
    let mut body = Vec::new();
    if chunked {
        loop {
            let mut size = String::new();
            reader
                .read_line(&mut size)
                .map_err(|e| failed(e.to_string()))?;
            let size = usize::from_str_radix(size.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|e| failed(format!("chunk size: {e}")))?;
            let mut chunk = vec![0; size + 2];
            reader
                .read_exact(&mut chunk)
                .map_err(|e| failed(e.to_string()))?;
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    } else if let Some(length) = length {
        body.resize(length, 0);
        reader
            .read_exact(&mut body)
            .map_err(|e| failed(e.to_string()))?;
    } else {
        reader
            .read_to_end(&mut body)
            .map_err(|e| failed(e.to_string()))?;
        close = true;
    }
    Ok((status, String::from_utf8_lossy(&body).into_owned(), close))
}

/// The outcomes of a [`Load`].
pub struct LoadReport {
    pub outcomes: Vec<Outcome>,
}

impl LoadReport {
    pub fn failures(&self) -> Vec<&Outcome> {
        self.outcomes.iter().filter(|o| o.result.is_err()).collect()
    }

    /// Panics, naming the first failure, unless every request succeeded.
    pub fn assert_no_failures(&self) {
        let failures = self.failures();
        assert!(
            failures.is_empty(),
            "{} of {} requests failed, first: {:?}",
            failures.len(),
            self.outcomes.len(),
            failures.first()
        );
    }

    /// Answers per backend identity.
    pub fn by_backend(&self) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for outcome in &self.outcomes {
            if let Ok(identity) = &outcome.result {
                *out.entry(identity.clone()).or_default() += 1;
            }
        }
        out
    }
}

/// A mesh file for the agent's `--mesh-file`, rewritten whole with write-then-rename (as
/// editors and ConfigMaps do) so the agent never reads half of it.
pub struct MeshFile {
    path: PathBuf,
    _dir: tempfile::TempDir,
}

/// One service of a mesh file: one port.
#[derive(Clone, Debug)]
pub struct MeshService {
    pub path: String,
    pub port: u16,
    pub protocol: String,
    pub endpoints: Vec<Ipv4Addr>,
}

impl MeshFile {
    pub fn new(services: &[MeshService]) -> anyhow::Result<MeshFile> {
        let dir = tempfile::tempdir()?;
        let file = MeshFile {
            path: dir.path().join("mesh.yaml"),
            _dir: dir,
        };
        file.write(services)?;
        Ok(file)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn write(&self, services: &[MeshService]) -> anyhow::Result<()> {
        self.write_text(&render(services))
    }

    /// Replaces the file with `text`, whole.
    pub fn write_text(&self, text: &str) -> anyhow::Result<()> {
        let tmp = self.path.with_extension("tmp");
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, &self.path)?;
        Ok(())
    }
}

/// The mesh file text for `services`.
pub fn render(services: &[MeshService]) -> String {
    let mut text = String::from("services:\n");
    for service in services {
        text.push_str(&format!(
            "  - path: {}\n    ports:\n      - port: {}\n        protocol: {}\n    endpoints:\n",
            service.path, service.port, service.protocol
        ));
        for endpoint in &service.endpoints {
            text.push_str(&format!("      - address: {endpoint}\n"));
        }
    }
    text
}
