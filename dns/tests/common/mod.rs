//! Test harness: the DNS server in-process on 127.0.0.1:0, real `dig`/`kdig` as clients, and
//! upstreams on loopback (unbound, or a scripted Rust server). Nothing leaves the machine.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hickory_proto::op::Message;
use lattice_dns::{DnsConfig, DnsMetrics, DnsServer, LookupObserver, NameTable};
use prometheus_client::registry::Registry;
use tokio::net::UdpSocket;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub fn table(entries: &[(&str, &str)]) -> Arc<NameTable> {
    Arc::new(NameTable::new(
        entries
            .iter()
            .map(|(n, a)| (n.to_string(), a.parse::<IpAddr>().unwrap())),
    ))
}

pub struct Server {
    pub addr: SocketAddr,
    pub names: watch::Sender<Arc<NameTable>>,
    /// Set once the server takes traffic (`DnsServer::on_open`).
    pub opened: Arc<std::sync::atomic::AtomicBool>,
    registry: Arc<Registry>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    pub async fn start(entries: &[(&str, &str)], configure: impl FnOnce(&mut DnsConfig)) -> Self {
        Self::start_with(table(entries), configure, None).await
    }

    /// A server on `names`, telling `observer` of its lookups.
    pub async fn start_with(
        names: Arc<NameTable>,
        configure: impl FnOnce(&mut DnsConfig),
        observer: Option<Arc<dyn LookupObserver>>,
    ) -> Self {
        let server =
            Self::start_on("127.0.0.1:0".parse().unwrap(), names, configure, observer).await;
        // On a port of its own, a server takes traffic at once.
        eventually(Duration::from_secs(5), || async { server.is_open() }).await;
        server
    }

    /// A server on `listen` (which another may hold already: it then serves beside it).
    pub async fn start_on(
        listen: SocketAddr,
        names: Arc<NameTable>,
        configure: impl FnOnce(&mut DnsConfig),
        observer: Option<Arc<dyn LookupObserver>>,
    ) -> Self {
        let _ = tracing_subscriber::fmt()
            .with_env_filter("lattice_dns=debug")
            .with_test_writer()
            .try_init();
        let mut config = DnsConfig::new(listen, Vec::new());
        config.udp_sockets = 2;
        configure(&mut config);
        let mut registry = Registry::default();
        let metrics = DnsMetrics::new(&mut registry);
        let (names, rx) = watch::channel(names);
        let mut server = DnsServer::bind(config, rx, metrics).await.unwrap();
        if let Some(observer) = observer {
            server = server.with_observer(observer);
        }
        let addr = server.local_addr();
        let opened = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = opened.clone();
        let server = server.on_open(move || flag.store(true, std::sync::atomic::Ordering::SeqCst));
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        let task = tokio::spawn(async move { server.run(token).await.unwrap() });
        Self {
            addr,
            names,
            opened,
            registry: Arc::new(registry),
            shutdown,
            task,
        }
    }

    pub fn metrics(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).unwrap();
        out
    }

    /// Value of the metric line starting with `prefix` (name and labels), 0 if absent.
    pub fn metric(&self, prefix: &str) -> f64 {
        self.metrics()
            .lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .map_or(0.0, |v| v.parse().unwrap())
    }

    /// Drains the server (as on SIGTERM) and waits for it to finish.
    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(5), self.task)
            .await
            .unwrap()
            .unwrap();
    }

    pub fn is_open(&self) -> bool {
        self.opened.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Output of one `dig` run.
#[derive(Debug)]
pub struct Dig {
    pub text: String,
}

impl Dig {
    pub fn status(&self) -> &str {
        let at = self
            .text
            .find("status: ")
            .unwrap_or_else(|| panic!("no status in:\n{}", self.text))
            + 8;
        self.text[at..].split(',').next().unwrap()
    }

    pub fn flags(&self) -> Vec<&str> {
        let at = self
            .text
            .find(";; flags:")
            .unwrap_or_else(|| panic!("no flags in:\n{}", self.text))
            + 9;
        self.text[at..]
            .split(';')
            .next()
            .unwrap()
            .split_whitespace()
            .collect()
    }

    fn section(&self, title: &str) -> Vec<Vec<&str>> {
        let Some(at) = self.text.find(title) else {
            return Vec::new();
        };
        self.text[at..]
            .lines()
            .skip(1)
            .take_while(|l| !l.trim().is_empty())
            .map(|l| l.split_whitespace().collect())
            .collect()
    }

    /// Answer records as [name, ttl, class, type, data...].
    pub fn answers(&self) -> Vec<Vec<&str>> {
        self.section(";; ANSWER SECTION:")
    }

    pub fn authority(&self) -> Vec<Vec<&str>> {
        self.section(";; AUTHORITY SECTION:")
    }

    pub fn additional(&self) -> Vec<Vec<&str>> {
        self.section(";; ADDITIONAL SECTION:")
    }

    pub fn opt(&self) -> Option<&str> {
        let at = self.text.find("; EDNS: ")?;
        self.text[at..].lines().next()
    }
}

/// Runs `dig @addr -p port ARGS` with one try and a short timeout, as `nobody`: dig sets
/// SO_REUSEPORT and lets the kernel pick its port, which as root can be the server's own
/// (SO_REUSEPORT too), and dig is then handed its own query. As another user it cannot be
/// (see `tests/src/dig.rs`).
pub async fn dig(addr: SocketAddr, args: &[&str]) -> Dig {
    let output = tokio::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "dig"])
        .arg(format!("@{}", addr.ip()))
        .args(["-p", &addr.port().to_string(), "+tries=1", "+time=3"])
        .args(args)
        .output()
        .await
        .expect("dig runs");
    Dig {
        text: String::from_utf8_lossy(&output.stdout).into_owned(),
    }
}

/// Runs `kdig @addr -p port ARGS`.
pub async fn kdig(addr: SocketAddr, args: &[&str]) -> Dig {
    let output = tokio::process::Command::new("kdig")
        .arg(format!("@{}", addr.ip()))
        .args(["-p", &addr.port().to_string(), "+retry=0", "+time=3"])
        .args(args)
        .output()
        .await
        .expect("kdig runs");
    Dig {
        text: String::from_utf8_lossy(&output.stdout).into_owned(),
    }
}

/// Polls `check` until it returns true or `within` passes; returns the time it took.
pub async fn eventually<F, Fut>(within: Duration, mut check: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if check().await {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "condition not met within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn free_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// An unbound on loopback that answers only its local zones (everything else REFUSED, so it never
/// recurses to the Internet).
pub struct Unbound {
    pub addr: SocketAddr,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Unbound {
    /// Starts it on a free port. The port is picked by binding and closing a socket, so
    /// another test may bind it before unbound does: unbound binds it alone (`so-reuseport:
    /// no`, where its default would share it with a server of another test that set
    /// `SO_REUSEPORT`, the agent's own DNS server among them, and the kernel would split the
    /// queries between the two), and it is ready only when it gives its own probe answer. An
    /// unbound that could not bind exits, and another port is tried.
    pub async fn start(local_config: &str) -> Self {
        for _ in 0..5 {
            if let Some(unbound) = Self::try_start(local_config).await {
                return unbound;
            }
        }
        panic!("unbound did not start on any of five free ports");
    }

    async fn try_start(local_config: &str) -> Option<Self> {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let marker = format!("unbound-{}-{port}", std::process::id());
        let conf: PathBuf = dir.path().join("unbound.conf");
        let text = format!(
            "server:\n  interface: 127.0.0.1@{port}\n  port: {port}\n  so-reuseport: no\n  do-ip6: no\n  do-daemonize: no\n  chroot: \"\"\n  username: \"\"\n  directory: \"{dir}\"\n  pidfile: \"\"\n  use-syslog: no\n  logfile: \"\"\n  verbosity: 0\n  num-threads: 1\n  access-control: 127.0.0.0/8 allow\n  local-zone: \".\" refuse\n  local-zone: \"unbound-probe.invalid.\" static\n  local-data: \"unbound-probe.invalid. TXT {marker}\"\n{local_config}\nremote-control:\n  control-enable: no\n",
            dir = dir.path().display()
        );
        std::fs::write(&conf, text).unwrap();
        let child = Command::new("unbound")
            .args(["-d", "-c"])
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("unbound starts");
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let mut unbound = Self {
            addr,
            child,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if unbound.child.try_wait().ok().flatten().is_some() {
                return None;
            }
            let probe = dig(addr, &["+norec", "+short", "TXT", "unbound-probe.invalid"]).await;
            if probe.text.contains(&marker) {
                return Some(unbound);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("unbound on port {port} did not answer its probe within 10 s");
    }
}

impl Drop for Unbound {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A scripted UDP upstream on loopback: records every query and answers with `respond`
/// (`None`: stay silent).
pub struct ScriptedUpstream {
    pub addr: SocketAddr,
    pub queries: Arc<Mutex<Vec<Message>>>,
    task: tokio::task::JoinHandle<()>,
}

impl ScriptedUpstream {
    pub async fn start(respond: impl Fn(&Message) -> Option<Message> + Send + 'static) -> Self {
        let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let queries = Arc::new(Mutex::new(Vec::new()));
        let seen = queries.clone();
        let task = tokio::spawn(async move {
            let mut buf = vec![0; 65535];
            loop {
                let Ok((len, peer)) = socket.recv_from(&mut buf).await else {
                    return;
                };
                let Ok(query) = Message::from_vec(&buf[..len]) else {
                    continue;
                };
                let reply = respond(&query);
                seen.lock().unwrap().push(query);
                if let Some(reply) = reply {
                    let _ = socket.send_to(&reply.to_vec().unwrap(), peer).await;
                }
            }
        });
        Self {
            addr,
            queries,
            task,
        }
    }

    pub fn count(&self) -> usize {
        self.queries.lock().unwrap().len()
    }
}

impl Drop for ScriptedUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A UDP upstream on loopback that records every query at once but sends its answers (from
/// `respond`) only once [`GatedUpstream::open`] is called: a slow upstream whose slowness the
/// test ends, not a timer.
pub struct GatedUpstream {
    pub addr: SocketAddr,
    pub queries: Arc<Mutex<Vec<Message>>>,
    gate: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl GatedUpstream {
    pub async fn start(respond: impl Fn(&Message) -> Option<Message> + Send + 'static) -> Self {
        let socket = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
        let addr = socket.local_addr().unwrap();
        let queries = Arc::new(Mutex::new(Vec::new()));
        let seen = queries.clone();
        let (gate, _) = watch::channel(false);
        let opened = gate.clone();
        let task = tokio::spawn(async move {
            let mut buf = vec![0; 65535];
            loop {
                let Ok((len, peer)) = socket.recv_from(&mut buf).await else {
                    return;
                };
                let Ok(query) = Message::from_vec(&buf[..len]) else {
                    continue;
                };
                let reply = respond(&query);
                seen.lock().unwrap().push(query);
                let (socket, mut open) = (socket.clone(), opened.subscribe());
                tokio::spawn(async move {
                    if open.wait_for(|open| *open).await.is_ok()
                        && let Some(reply) = reply
                    {
                        let _ = socket.send_to(&reply.to_vec().unwrap(), peer).await;
                    }
                });
            }
        });
        Self {
            addr,
            queries,
            gate,
            task,
        }
    }

    /// Sends every answer held so far, and every later one at once.
    pub fn open(&self) {
        self.gate.send_replace(true);
    }

    pub fn count(&self) -> usize {
        self.queries.lock().unwrap().len()
    }
}

impl Drop for GatedUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}
