//! Network namespaces for end-to-end tests: the only place tests get a network to change.
//!
//! A [`Netns`] is a fresh namespace (`ip netns add lattice-test-<label>-<random>`) with `lo` up,
//! deleted again when dropped, also when the test panics. Everything a test does to the network
//! happens inside namespaces it created: commands run through `ip netns exec`
//! ([`Netns::command`], [`Netns::exec`]), sockets are opened from a thread that joined the
//! namespace ([`Netns::enter`]; a socket stays in the namespace it was created in, so it can be
//! used from any thread afterwards), and links are made with [`Netns::veth`] and
//! [`Netns::bridge`]. The host's own interfaces, routes and rules are never touched.
//!
//! Topologies compose from these pieces. A data-path test builds a "node" namespace with a
//! bridge and one veth per "pod" namespace:
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use lattice_e2e::netns::Netns;
//! let node = Netns::new("node")?;
//! node.bridge("br0", "10.200.0.1/24")?;
//! let pod = Netns::new("pod")?;
//! pod.veth("eth0", "10.200.0.3/24", &node, "veth-pod1", None)?;
//! node.attach("veth-pod1", "br0")?;
//! pod.ip(&["route", "add", "default", "via", "10.200.0.1"])?;
//! # Ok(()) }
//! ```
//!
//! Processes started with [`Netns::spawn`] are killed when their [`Process`] guard drops; drop
//! processes before their namespace (declare the namespace first).

use std::ffi::OsStr;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};

use anyhow::{Context as _, bail};
use nix::sched::{CloneFlags, setns};

/// A network namespace owned by one test; deleted on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates `lattice-test-<label>-<random>` and brings its loopback up.
    pub fn new(label: &str) -> anyhow::Result<Self> {
        let name = format!("lattice-test-{label}-{:08x}", rand::random::<u32>());
        host_command("ip", &["netns", "add", &name])?;
        // From here on, Drop deletes the namespace even if the next step fails.
        let netns = Self { name };
        netns.ip(&["link", "set", "lo", "up"])?;
        Ok(netns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace file that [`setns`] joins.
    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// `ip netns exec <name> <program>`: a command that runs inside the namespace, ready for
    /// more arguments, environment and stdio settings.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.name]).arg(program);
        command
    }

    /// Runs `program args` inside the namespace and returns its output, whatever its status.
    pub fn run<S: AsRef<OsStr>>(&self, program: &str, args: &[S]) -> anyhow::Result<Output> {
        self.command(program)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running {program} in {}", self.name))
    }

    /// Runs `program args` inside the namespace; fails with its stderr unless it succeeds.
    /// Returns stdout.
    pub fn exec<S: AsRef<OsStr>>(&self, program: &str, args: &[S]) -> anyhow::Result<String> {
        let output = self.run(program, args)?;
        checked(&format!("{program} (in {})", self.name), output)
    }

    /// `ip <args>` inside the namespace.
    pub fn ip(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut full = vec!["-n", &self.name];
        full.extend_from_slice(args);
        host_command("ip", &full)
    }

    /// Runs `f` on a thread that has joined this namespace and returns its result. Sockets
    /// created by `f` belong to the namespace.
    pub fn enter<T, F>(&self, f: F) -> anyhow::Result<T>
    where
        T: Send,
        F: FnOnce() -> T + Send,
    {
        enter_path(&self.path(), f)
    }

    /// A veth pair: `name` here with `address` (CIDR) and `peer_name` in `peer`, optionally with
    /// `peer_address`. Both ends are up. The pair never exists in the host namespace.
    pub fn veth(
        &self,
        name: &str,
        address: &str,
        peer: &Netns,
        peer_name: &str,
        peer_address: Option<&str>,
    ) -> anyhow::Result<()> {
        self.ip(&[
            "link", "add", name, "type", "veth", "peer", "name", peer_name, "netns", &peer.name,
        ])?;
        self.add_address(name, address)?;
        self.ip(&["link", "set", name, "up"])?;
        if let Some(peer_address) = peer_address {
            peer.add_address(peer_name, peer_address)?;
        }
        peer.ip(&["link", "set", peer_name, "up"])?;
        Ok(())
    }

    /// Adds `address` (CIDR) to `device`. IPv6 addresses skip duplicate address detection so
    /// they are usable at once.
    pub fn add_address(&self, device: &str, address: &str) -> anyhow::Result<()> {
        let mut args = vec!["addr", "add", address, "dev", device];
        if address.contains(':') {
            args.push("nodad");
        }
        self.ip(&args).map(drop)
    }

    /// A bridge `name` with `address` (CIDR), up.
    ///
    /// The bridge gets a MAC address of its own. Without one, Linux gives it the lowest MAC
    /// among its ports and changes it as pods come and go; the pods' ARP caches then hold a
    /// MAC nobody answers to, and traffic to the bridge's address (the agent's DNS and xDS)
    /// is lost until their entries expire, tens of seconds later.
    pub fn bridge(&self, name: &str, address: &str) -> anyhow::Result<()> {
        let mac = bridge_mac();
        self.ip(&["link", "add", name, "address", &mac, "type", "bridge"])?;
        self.add_address(name, address)?;
        self.ip(&["link", "set", name, "up"]).map(drop)
    }

    /// Enslaves `device` to `bridge`.
    pub fn attach(&self, device: &str, bridge: &str) -> anyhow::Result<()> {
        self.ip(&["link", "set", device, "master", bridge])
            .map(drop)
    }

    /// Starts `command` (build it with [`Netns::command`]); killed when the guard drops.
    pub fn spawn(&self, mut command: Command) -> anyhow::Result<Process> {
        let child = command
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("spawning {command:?} in {}", self.name))?;
        Ok(Process { child })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting the namespace removes every link, address, route and rule made inside it.
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// A child process owned by a test: killed and reaped on drop.
#[derive(Debug)]
pub struct Process {
    child: Child,
}

impl Process {
    pub fn child(&mut self) -> &mut Child {
        &mut self.child
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `f` on a thread that has joined the namespace at `path` (`/run/netns/<name>`) and
/// returns its result: [`Netns::enter`] for code that knows a namespace only by its path, such
/// as a process guard that outlives the borrow of its [`Netns`].
pub fn enter_path<T, F>(path: &Path, f: F) -> anyhow::Result<T>
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                join(&file, path)?;
                Ok(f())
            })
            .join()
            .map_err(|_| anyhow::anyhow!("closure in namespace {} panicked", path.display()))?
    })
}

/// Moves the calling thread into the namespace at `path` for the rest of its life. For
/// long-running threads (servers, load generators) started by the harness itself; anything
/// else should use [`Netns::enter`], which confines the switch to one closure.
pub fn join_path(path: &Path) -> anyhow::Result<()> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    join(&file, path)
}

fn join(file: &File, path: &Path) -> anyhow::Result<()> {
    setns(file, CloneFlags::CLONE_NEWNET)
        .map_err(|err| anyhow::anyhow!("setns into {}: {err}", path.display()))
}

fn host_command(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {program} {}", args.join(" ")))?;
    checked(&format!("{program} {}", args.join(" ")), output)
}

fn checked(what: &str, output: Output) -> anyhow::Result<String> {
    if !output.status.success() {
        bail!(
            "{what} failed ({}): {}{}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim(),
            String::from_utf8_lossy(&output.stdout).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// A locally administered unicast MAC, distinct per bridge made by this process and across
/// processes (the pid), so test runs side by side never share one.
fn bridge_mac() -> String {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed).to_be_bytes();
    let pid = std::process::id().to_be_bytes();
    format!(
        "02:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        pid[1], pid[2], pid[3], n[0], n[1]
    )
}
