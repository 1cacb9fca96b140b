//! Sockets a successor binds beside. Every socket the node's pods reach (DNS over UDP and TCP,
//! and the agent's xDS listener) is bound with SO_REUSEPORT, so the next agent of a rolling
//! upgrade binds the same address while this one still serves, and the two hand the traffic
//! over without a datagram dropped or a connection reset:
//!
//! - **Bound, not open.** A socket is bound at start, so a bad address fails start-up, but a TCP
//!   socket listens only once [`BoundTcp::listen`] is called: until then the kernel never
//!   selects it. A UDP socket is selectable once bound; a successor leaves it unread until it is
//!   ready, so what lands there waits rather than being answered from an empty table.
//! - **Steered.** An open socket is given a CPU (`SO_INCOMING_CPU`), one socket per online CPU.
//!   Since Linux 6.1 the kernel's SO_REUSEPORT selection prefers a socket whose CPU is the one
//!   handling the packet, so the sockets of a ready agent take every new datagram and
//!   connection away from unsteered ones: a successor's bound sockets get nothing while its
//!   predecessor steers, and a predecessor that stops steering gets nothing more.
//! - **Leaving without losing.** Closing a UDP socket drops its queue, and closing a listener
//!   resets the connections in its accept queue. A UDP socket leaves the selection instead by
//!   being connected ([`leave_udp`]: the kernel skips connected sockets, yet what is already
//!   queued stays readable); a listener by no longer being steered ([`Listeners::leave`]), then
//!   having its accept queue taken ([`Listeners::try_accept`]) before it closes. On kernels
//!   before 6.1, setting `net.ipv4.tcp_migrate_req=1` on the node makes the kernel move what a
//!   closing listener still holds to a sibling instead.
//!
//! Tested against the kernel's behaviour in `tests/handoff.rs`.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;

use nix::sys::socket::{
    self, AddressFamily, Backlog, SockFlag, SockType, SockaddrStorage, setsockopt, sockopt,
};
use nix::{libc, setsockopt_impl, sockopt_impl};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio_util::sync::CancellationToken;

sockopt_impl!(
    /// `SO_INCOMING_CPU`: the CPU whose packets the kernel prefers to give this socket among
    /// those sharing its port (since Linux 6.1); -1 for none. nix does not name it.
    IncomingCpu,
    SetOnly,
    libc::SOL_SOCKET,
    libc::SO_INCOMING_CPU,
    i32
);

/// Pending connections a listener queues (the kernel caps it at `net.core.somaxconn`).
const BACKLOG: i32 = 1024;

/// The CPUs the kernel may handle packets on, from `/sys/devices/system/cpu/online` ("0-3,8"),
/// else as many as the process may use. One steered socket per CPU covers every one of them.
pub fn online_cpus() -> Vec<usize> {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|text| parse_cpu_list(text.trim()))
        .unwrap_or_else(|| {
            (0..std::thread::available_parallelism().map_or(1, usize::from)).collect()
        })
}

/// A kernel CPU list ("0-3,8,10-11") as CPU numbers; `None` if it does not parse.
fn parse_cpu_list(text: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in text.split(',') {
        match part.split_once('-') {
            Some((first, last)) => {
                let (first, last) = (first.parse().ok()?, last.parse::<usize>().ok()?);
                if last < first || last - first > 4096 {
                    return None;
                }
                cpus.extend(first..=last);
            }
            None => cpus.push(part.parse().ok()?),
        }
    }
    (!cpus.is_empty()).then_some(cpus)
}

/// Whether another UDP socket holds `addr` already (a predecessor, or some other server): a
/// plain bind fails. Port 0 is never held.
pub fn udp_in_use(addr: SocketAddr) -> io::Result<bool> {
    held_by_another(addr, SockType::Datagram)
}

/// Whether another listener holds `addr` already (a predecessor, or some other server). The
/// TIME_WAIT connections of an agent that died do not count: the probe takes SO_REUSEADDR,
/// which passes over them but not over a listener.
pub fn tcp_in_use(addr: SocketAddr) -> io::Result<bool> {
    held_by_another(addr, SockType::Stream)
}

fn held_by_another(addr: SocketAddr, kind: SockType) -> io::Result<bool> {
    if addr.port() == 0 {
        return Ok(false);
    }
    let probe = new_socket(addr, kind)?;
    if kind == SockType::Stream {
        setsockopt(&probe, sockopt::ReuseAddr, &true)?;
    }
    match socket::bind(probe.as_raw_fd(), &SockaddrStorage::from(addr)) {
        Ok(()) => Ok(false),
        Err(nix::errno::Errno::EADDRINUSE) => Ok(true),
        Err(e) => Err(e.into()),
    }
}

fn new_socket(addr: SocketAddr, kind: SockType) -> io::Result<OwnedFd> {
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    Ok(socket::socket(
        family,
        kind,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?)
}

/// A non-blocking socket of `kind` with SO_REUSEPORT (and SO_REUSEADDR for TCP), bound to `addr`;
/// port 0 stands for a port no socket holds (see [`free_port`]).
fn bind_shared(addr: SocketAddr, kind: SockType) -> io::Result<OwnedFd> {
    let addr = if addr.port() == 0 {
        free_port(addr)?
    } else {
        addr
    };
    let fd = new_socket(addr, kind)?;
    setsockopt(&fd, sockopt::ReusePort, &true)?;
    if kind == SockType::Stream {
        setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    }
    socket::bind(fd.as_raw_fd(), &SockaddrStorage::from(addr))?;
    Ok(fd)
}

/// `addr` with a port that neither a UDP socket nor a TCP one holds, for a DNS server's pair
/// of them. A port-0 bind with SO_REUSEPORT cannot be trusted to find one: the kernel's UDP
/// port search counts a port whose sockets all have SO_REUSEPORT, under the same user, as free,
/// so two servers of one process could share a port and each other's queries. A plain bind
/// gets a port of its own; it is let go at once, so the port is free unless another process
/// takes it in the moment before the caller binds it (the bind then fails, or, for a sibling
/// doing the same, is shared: at worst as rare as two random picks of one port).
fn free_port(addr: SocketAddr) -> io::Result<SocketAddr> {
    let mut last = None;
    for _ in 0..16 {
        let udp = new_socket(addr, SockType::Datagram)?;
        socket::bind(udp.as_raw_fd(), &SockaddrStorage::from(addr))?;
        let picked = local_addr(&udp)?;
        let tcp = new_socket(picked, SockType::Stream)?;
        match socket::bind(tcp.as_raw_fd(), &SockaddrStorage::from(picked)) {
            Ok(()) => return Ok(picked),
            Err(e) => last = Some(e),
        }
    }
    Err(last.map_or_else(|| io::ErrorKind::AddrInUse.into(), io::Error::from))
}

fn local_addr(fd: &impl AsFd) -> io::Result<SocketAddr> {
    let addr: SockaddrStorage = socket::getsockname(fd.as_fd().as_raw_fd())?;
    if let Some(v4) = addr.as_sockaddr_in() {
        return Ok(SocketAddr::V4((*v4).into()));
    }
    addr.as_sockaddr_in6()
        .map(|v6| SocketAddr::V6((*v6).into()))
        .ok_or_else(|| io::Error::other("socket has no IP address"))
}

/// Gives `socket` the CPU whose packets it should take (`None`: no preference). Setting it
/// fails only on kernels before 3.19; where the kernel ignores it for selection (before 6.1)
/// nothing is steered and the sockets share the traffic by hash, as before.
pub fn steer(socket: &impl AsFd, cpu: Option<usize>) -> io::Result<()> {
    let cpu = cpu
        .map_or(Ok(-1), i32::try_from)
        .map_err(io::Error::other)?;
    setsockopt(socket, IncomingCpu, &cpu)?;
    Ok(())
}

/// UDP sockets sharing one address, bound but not steered yet.
pub struct BoundUdp {
    sockets: Vec<UdpSocket>,
    local_addr: SocketAddr,
}

impl BoundUdp {
    /// Binds `count` sockets (at least one) on `addr`, each with a receive buffer of
    /// `receive_buffer` bytes where the kernel allows it.
    pub fn bind(addr: SocketAddr, count: usize, receive_buffer: usize) -> io::Result<BoundUdp> {
        let first = bind_shared(addr, SockType::Datagram)?;
        let local_addr = local_addr(&first)?;
        let mut fds = vec![first];
        for _ in 1..count.max(1) {
            fds.push(bind_shared(local_addr, SockType::Datagram)?);
        }
        let sockets = fds
            .into_iter()
            .map(|fd| {
                // Bursts queue here instead of being dropped; a failure only costs capacity.
                if let Err(e) = setsockopt(&fd, sockopt::RcvBuf, &receive_buffer) {
                    tracing::debug!(%local_addr, error = %e, "cannot enlarge a UDP socket's receive buffer");
                }
                UdpSocket::from_std(std::net::UdpSocket::from(fd))
            })
            .collect::<io::Result<_>>()?;
        Ok(BoundUdp {
            sockets,
            local_addr,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Steers the `k`-th socket to the `k`-th of `cpus` (sockets beyond stay unsteered) and
    /// returns them, to be read from now on.
    pub fn open(self, cpus: &[usize]) -> io::Result<Vec<UdpSocket>> {
        for (k, socket) in self.sockets.iter().enumerate() {
            steer(socket, cpus.get(k).copied())?;
        }
        Ok(self.sockets)
    }
}

/// Takes `socket` out of its SO_REUSEPORT group's selection, keeping what is queued on it
/// readable: the kernel skips connected sockets when it picks one for a datagram. It is
/// connected to its own address, which sends it nothing; replies still go out with `send_to`.
pub fn leave_udp(socket: &UdpSocket) -> io::Result<()> {
    let own = socket.local_addr()?;
    let peer = match own {
        SocketAddr::V4(v4) if v4.ip().is_unspecified() => {
            SocketAddr::from((Ipv4Addr::LOCALHOST, v4.port()))
        }
        SocketAddr::V6(v6) if v6.ip().is_unspecified() => {
            SocketAddr::from((Ipv6Addr::LOCALHOST, v6.port()))
        }
        own => own,
    };
    socket::connect(socket.as_raw_fd(), &SockaddrStorage::from(peer))?;
    Ok(())
}

/// TCP sockets sharing one address, one per CPU, bound but not listening: the kernel gives
/// them no connection until [`BoundTcp::listen`].
pub struct BoundTcp {
    sockets: Vec<(OwnedFd, Option<usize>)>,
    local_addr: SocketAddr,
}

impl BoundTcp {
    /// Binds one socket per CPU of `cpus` (one unsteered socket when it is empty) on `addr`.
    pub fn bind(addr: SocketAddr, cpus: &[usize]) -> io::Result<BoundTcp> {
        let mut wanted: Vec<Option<usize>> = cpus.iter().copied().map(Some).collect();
        if wanted.is_empty() {
            wanted.push(None);
        }
        let first = bind_shared(addr, SockType::Stream)?;
        let local_addr = local_addr(&first)?;
        let mut sockets = vec![(first, wanted[0])];
        for cpu in &wanted[1..] {
            sockets.push((bind_shared(local_addr, SockType::Stream)?, *cpu));
        }
        Ok(BoundTcp {
            sockets,
            local_addr,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Listens on every socket and steers each to its CPU: from now on the kernel hands them
    /// connections.
    pub fn listen(self) -> io::Result<Listeners> {
        let mut listeners = Vec::with_capacity(self.sockets.len());
        for (fd, cpu) in self.sockets {
            socket::listen(&fd, Backlog::new(BACKLOG).unwrap_or(Backlog::MAXCONN))?;
            steer(&fd, cpu)?;
            listeners.push(TcpListener::from_std(std::net::TcpListener::from(fd))?);
        }
        Ok(Listeners {
            listeners,
            next: AtomicUsize::new(0),
        })
    }
}

/// A listener on `addr` that another process (the next agent) can bind beside at once: for a
/// server whose clients may reach either, such as the agent's admin endpoints.
pub fn shared_listener(addr: SocketAddr) -> io::Result<TcpListener> {
    let fd = bind_shared(addr, SockType::Stream)?;
    socket::listen(&fd, Backlog::new(BACKLOG).unwrap_or(Backlog::MAXCONN))?;
    TcpListener::from_std(std::net::TcpListener::from(fd))
}

/// The listeners of one address, accepted from as one.
pub struct Listeners {
    listeners: Vec<TcpListener>,
    /// Where the next accept starts looking, so no listener starves the others.
    next: AtomicUsize,
}

impl Listeners {
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        match self.listeners.first() {
            Some(listener) => listener.local_addr(),
            None => Err(io::ErrorKind::NotConnected.into()),
        }
    }

    /// The next connection of any listener.
    pub fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<(TcpStream, SocketAddr)>> {
        let count = self.listeners.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        for k in 0..count {
            if let Poll::Ready(accepted) = self.listeners[(start + k) % count].poll_accept(cx) {
                return Poll::Ready(accepted);
            }
        }
        Poll::Pending
    }

    pub async fn accept(&self) -> io::Result<(TcpStream, SocketAddr)> {
        std::future::poll_fn(|cx| self.poll_accept(cx)).await
    }

    /// A connection already queued on one of the listeners, without waiting: `None` once every
    /// accept queue is empty.
    pub fn try_accept(&self) -> Option<io::Result<(TcpStream, SocketAddr)>> {
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        for listener in &self.listeners {
            if let Poll::Ready(accepted) = listener.poll_accept(&mut cx) {
                return Some(accepted);
            }
        }
        None
    }

    /// Stops steering: while a successor steers, the kernel gives these listeners no more
    /// connections; what they queued before is taken with [`Listeners::try_accept`].
    pub fn leave(&self) {
        for listener in &self.listeners {
            if let Err(e) = steer(listener, None) {
                tracing::debug!(error = %e, "cannot stop steering a listener");
            }
        }
    }
}

/// After listeners stop being steered, how long handshakes under way may still complete into
/// their accept queues.
const SETTLE: Duration = Duration::from_millis(50);

/// The connections accepted on `listeners` until `drain` is cancelled; then the listeners stop
/// being steered ([`Listeners::leave`]), what their accept queues hold comes out, and the stream
/// ends, closing them.
pub fn incoming(
    listeners: Listeners,
    drain: CancellationToken,
) -> impl Stream<Item = io::Result<(TcpStream, SocketAddr)>> {
    futures::stream::unfold(
        (listeners, drain, false),
        |(listeners, drain, draining)| async move {
            if !draining {
                tokio::select! {
                    biased;
                    () = drain.cancelled() => {
                        listeners.leave();
                        tokio::time::sleep(SETTLE).await;
                    }
                    accepted = listeners.accept() => return Some((accepted, (listeners, drain, false))),
                }
            }
            let queued = listeners.try_accept()?;
            Some((queued, (listeners, drain, true)))
        },
    )
}

/// Whether this kernel steers SO_REUSEPORT selection by `SO_INCOMING_CPU` (Linux 6.1 and
/// later), from `/proc/sys/kernel/osrelease`; `None` if it cannot tell.
pub fn kernel_steers() -> Option<bool> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()?;
    let mut numbers = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse::<u32>().ok());
    let (major, minor) = (numbers.next()??, numbers.next()??);
    Some((major, minor) >= (6, 1))
}

/// Whether the node's kernel migrates a closing listener's queue to a sibling
/// (`net.ipv4.tcp_migrate_req`, read in this network namespace).
pub fn migrates_requests() -> bool {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_migrate_req").is_ok_and(|v| v.trim() == "1")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_as_the_kernel_writes_them() {
        assert_eq!(parse_cpu_list("0"), Some(vec![0]));
        assert_eq!(parse_cpu_list("0-3"), Some(vec![0, 1, 2, 3]));
        assert_eq!(parse_cpu_list("0-1,4,6-7"), Some(vec![0, 1, 4, 6, 7]));
        assert_eq!(parse_cpu_list(""), None);
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
        assert!(!online_cpus().is_empty());
    }
}
