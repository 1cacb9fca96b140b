//! DNS clients that count, and an upstream resolver a test starts. [`DnsLoad`] sends a steady
//! load of queries from a pod's network namespace over UDP (one datagram per query, never
//! retried: a query without an answer is lost) and over persistent TCP connections (one query
//! at a time per connection, as `dig +keepopen`), checks every answer against the address it
//! expects, and counts what went wrong: lost queries, wrong answers, connections reset. A TCP
//! query whose connection the server closed with a FIN before answering is sent again on a
//! new connection, as RFC 7766 §6.2.4 asks of clients, and counted apart. [`Upstream`] answers
//! `q<k>.example.test` with an address derived from `k` (TTL 0, so nothing is cached).

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, Record, RecordType};

use crate::netns::join_path;

/// How long a query may wait for its answer before it counts as lost.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);

/// The forwarded name the [`Upstream`] answers for `k`, and the address it answers.
pub fn upstream_name(k: u32) -> (String, Ipv4Addr) {
    (
        format!("q{k}.example.test"),
        Ipv4Addr::new(198, 51, 100, (k % 200 + 1) as u8),
    )
}

/// What one transport's clients saw.
#[derive(Clone, Debug, Default)]
pub struct Tally {
    pub sent: u64,
    pub answered: u64,
    /// No answer within [`ANSWER_TIMEOUT`].
    pub lost: u64,
    /// An answer other than the expected address (SERVFAIL, NXDOMAIN, another address).
    pub wrong: u64,
    /// Connections reset (TCP): on a read, a write or a connect.
    pub resets: u64,
    /// Connections that could not be made (TCP).
    pub refused: u64,
    /// Queries sent again on a new connection because the server's FIN crossed them (TCP).
    pub retried_after_close: u64,
    /// Connections made again because the server had closed the last one (TCP).
    pub reconnects: u64,
    /// The first few problems, for the failure message.
    pub problems: Vec<String>,
}

impl Tally {
    fn problem(&mut self, text: String) {
        if self.problems.len() < 10 {
            self.problems.push(text);
        }
    }

    fn add(&mut self, other: Tally) {
        self.sent += other.sent;
        self.answered += other.answered;
        self.lost += other.lost;
        self.wrong += other.wrong;
        self.resets += other.resets;
        self.refused += other.refused;
        self.retried_after_close += other.retried_after_close;
        self.reconnects += other.reconnects;
        for problem in other.problems {
            self.problem(problem);
        }
    }

    /// Nothing lost, wrong, reset or refused.
    pub fn clean(&self) -> bool {
        self.lost == 0 && self.wrong == 0 && self.resets == 0 && self.refused == 0
    }
}

/// The outcome of a [`DnsLoad`].
#[derive(Clone, Debug, Default)]
pub struct DnsReport {
    pub udp: Tally,
    pub tcp: Tally,
    pub elapsed: Duration,
}

/// How a [`DnsLoad`] runs.
#[derive(Clone, Debug)]
pub struct DnsLoadPlan {
    pub server: SocketAddr,
    /// Names asked in turn, with the address each must resolve to.
    pub names: Vec<(String, Ipv4Addr)>,
    pub udp_qps: u32,
    pub udp_sockets: usize,
    pub tcp_qps: u32,
    pub tcp_connections: usize,
}

/// Clients sending a steady load until [`DnsLoad::stop`].
pub struct DnsLoad {
    stopping: Arc<AtomicBool>,
    udp: Vec<JoinHandle<Tally>>,
    tcp: Vec<JoinHandle<Tally>>,
    started: Instant,
}

impl DnsLoad {
    /// Starts the clients in the network namespace at `netns`.
    pub fn start(netns: &Path, plan: &DnsLoadPlan) -> DnsLoad {
        let stopping = Arc::new(AtomicBool::new(false));
        let names = Arc::new(plan.names.clone());
        let spawn = |k: usize, per_client: f64, tcp: bool| {
            let (netns, names, stop) = (netns.to_path_buf(), names.clone(), stopping.clone());
            let server = plan.server;
            std::thread::spawn(move || {
                let interval = Duration::from_secs_f64(1.0 / per_client.max(1.0));
                let client = Client {
                    netns,
                    server,
                    names,
                    offset: k * 7,
                    interval,
                    stop,
                };
                if tcp { client.tcp() } else { client.udp() }
            })
        };
        let udp = (0..plan.udp_sockets)
            .map(|k| spawn(k, f64::from(plan.udp_qps) / plan.udp_sockets as f64, false))
            .collect();
        let tcp = (0..plan.tcp_connections)
            .map(|k| {
                spawn(
                    k,
                    f64::from(plan.tcp_qps) / plan.tcp_connections as f64,
                    true,
                )
            })
            .collect();
        DnsLoad {
            stopping,
            udp,
            tcp,
            started: Instant::now(),
        }
    }

    /// Stops sending, waits for the answers still due, and returns what every client saw.
    pub fn stop(self) -> DnsReport {
        self.stopping.store(true, Ordering::Relaxed);
        let mut report = DnsReport {
            elapsed: self.started.elapsed(),
            ..DnsReport::default()
        };
        for (handles, tally) in [(self.udp, &mut report.udp), (self.tcp, &mut report.tcp)] {
            for handle in handles {
                match handle.join() {
                    Ok(one) => tally.add(one),
                    Err(_) => tally.problem("a client thread panicked".into()),
                }
            }
        }
        report
    }
}

struct Client {
    netns: PathBuf,
    server: SocketAddr,
    names: Arc<Vec<(String, Ipv4Addr)>>,
    offset: usize,
    interval: Duration,
    stop: Arc<AtomicBool>,
}

impl Client {
    fn name(&self, n: usize) -> &(String, Ipv4Addr) {
        &self.names[(self.offset + n) % self.names.len()]
    }

    /// One UDP socket: a query every `interval`, answers matched by id; unanswered after
    /// [`ANSWER_TIMEOUT`] is lost.
    fn udp(self) -> Tally {
        let mut tally = Tally::default();
        if let Err(e) = join_path(&self.netns) {
            tally.problem(format!("cannot enter the namespace: {e}"));
            tally.lost += 1;
            return tally;
        }
        let socket = match UdpSocket::bind("0.0.0.0:0") {
            Ok(socket) => socket,
            Err(e) => {
                tally.problem(format!("bind: {e}"));
                tally.lost += 1;
                return tally;
            }
        };
        let mut outstanding: HashMap<u16, (Instant, usize)> = HashMap::new();
        let mut next_send = Instant::now();
        let mut n = 0usize;
        let mut buf = [0u8; 4096];
        let mut stopped_at = None;
        loop {
            let now = Instant::now();
            if stopped_at.is_none() && self.stop.load(Ordering::Relaxed) {
                stopped_at = Some(now);
            }
            if stopped_at.is_none() && now >= next_send {
                let id = (n % 65536) as u16;
                let (name, _) = self.name(n);
                match query(id, name).map(|q| socket.send_to(&q, self.server)) {
                    Ok(Ok(_)) => {
                        outstanding.insert(id, (now, n));
                        tally.sent += 1;
                    }
                    Ok(Err(e)) | Err(e) => tally.problem(format!("send: {e}")),
                }
                n += 1;
                next_send += self.interval;
            }
            outstanding.retain(|_, (sent, k)| {
                let late = now.duration_since(*sent) > ANSWER_TIMEOUT;
                if late {
                    tally.lost += 1;
                    let name = self.names[(self.offset + *k) % self.names.len()].0.clone();
                    tally.problem(format!("UDP query for {name} unanswered"));
                }
                !late
            });
            if let Some(at) = stopped_at
                && (outstanding.is_empty() || now.duration_since(at) > ANSWER_TIMEOUT * 2)
            {
                tally.lost += outstanding.len() as u64;
                return tally;
            }
            let wait = next_send
                .saturating_duration_since(Instant::now())
                .max(Duration::from_micros(200));
            let _ = socket.set_read_timeout(Some(wait));
            if let Ok((len, _)) = socket.recv_from(&mut buf)
                && let Ok(reply) = Message::from_vec(&buf[..len])
                && let Some((_, k)) = outstanding.remove(&reply.metadata.id)
            {
                self.check(&reply, k, &mut tally, "UDP");
            }
        }
    }

    fn check(&self, reply: &Message, k: usize, tally: &mut Tally, transport: &str) {
        let (name, expected) = self.name(k);
        let got: Vec<Ipv4Addr> = reply
            .answers
            .iter()
            .filter_map(|r| match &r.data {
                RData::A(a) => Some(a.0),
                _ => None,
            })
            .collect();
        if reply.metadata.response_code == ResponseCode::NoError && got.contains(expected) {
            tally.answered += 1;
        } else {
            tally.wrong += 1;
            tally.problem(format!(
                "{transport} {name}: {} {got:?}, expected {expected}",
                reply.metadata.response_code
            ));
        }
    }

    /// One persistent TCP connection: a query every `interval`, waiting for each answer; the
    /// connection is made again when the server closes it.
    fn tcp(self) -> Tally {
        let mut tally = Tally::default();
        if let Err(e) = join_path(&self.netns) {
            tally.problem(format!("cannot enter the namespace: {e}"));
            tally.lost += 1;
            return tally;
        }
        let mut stream: Option<TcpStream> = None;
        let mut next_send = Instant::now();
        let mut n = 0usize;
        while !self.stop.load(Ordering::Relaxed) {
            let wait = next_send.saturating_duration_since(Instant::now());
            std::thread::sleep(wait);
            next_send += self.interval;
            let id = (n % 65536) as u16;
            let Ok(bytes) = query(id, &self.name(n).0) else {
                n += 1;
                continue;
            };
            tally.sent += 1;
            let deadline = Instant::now() + ANSWER_TIMEOUT;
            // The same query until it is answered, on as many connections as that takes.
            loop {
                if Instant::now() > deadline {
                    tally.lost += 1;
                    tally.problem(format!("TCP query for {} unanswered", self.name(n).0));
                    stream = None;
                    break;
                }
                // As a client reusing a connection does: one the server has closed (a FIN
                // waiting to be read) is not written to, but replaced.
                if stream.as_ref().is_some_and(closed_by_server) {
                    tally.reconnects += 1;
                    stream = None;
                }
                let conn = match stream.as_mut() {
                    Some(conn) => conn,
                    None => match TcpStream::connect_timeout(&self.server, ANSWER_TIMEOUT) {
                        Ok(conn) => stream.insert(conn),
                        Err(e) => {
                            if e.kind() == ErrorKind::ConnectionReset {
                                tally.resets += 1;
                            } else {
                                tally.refused += 1;
                            }
                            tally.problem(format!("TCP connect: {e}"));
                            std::thread::sleep(Duration::from_millis(10));
                            continue;
                        }
                    },
                };
                match exchange(conn, &bytes, deadline) {
                    Exchange::Answer(reply) if reply.metadata.id == id => {
                        self.check(&reply, n, &mut tally, "TCP");
                        break;
                    }
                    Exchange::Answer(reply) => {
                        tally.wrong += 1;
                        tally.problem(format!("TCP answer with id {}", reply.metadata.id));
                        break;
                    }
                    Exchange::Closed => {
                        // RFC 7766 §6.2.4: the server closed before answering; ask again.
                        tally.retried_after_close += 1;
                        stream = None;
                    }
                    Exchange::Reset(e) => {
                        tally.resets += 1;
                        tally.problem(format!("TCP reset: {e}"));
                        stream = None;
                    }
                    Exchange::TimedOut => {}
                }
            }
            n += 1;
        }
        tally
    }
}

/// Whether the server has closed `conn`: a read would return end-of-file now.
fn closed_by_server(conn: &TcpStream) -> bool {
    if conn.set_nonblocking(true).is_err() {
        return true;
    }
    let mut byte = [0u8; 1];
    let closed = matches!(conn.peek(&mut byte), Ok(0));
    let _ = conn.set_nonblocking(false);
    closed
}

enum Exchange {
    Answer(Message),
    /// The server closed its side (FIN) before answering.
    Closed,
    Reset(std::io::Error),
    TimedOut,
}

/// Writes `query` framed and reads one framed answer by `deadline`.
fn exchange(conn: &mut TcpStream, query: &[u8], deadline: Instant) -> Exchange {
    let reset = |e: std::io::Error| match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => Exchange::TimedOut,
        ErrorKind::UnexpectedEof => Exchange::Closed,
        _ => Exchange::Reset(e),
    };
    let mut framed = (query.len() as u16).to_be_bytes().to_vec();
    framed.extend_from_slice(query);
    if let Err(e) = conn.write_all(&framed) {
        // A write into a connection the server has shut down is still read (and dropped) by
        // the server; a failing write is a reset.
        return reset(e);
    }
    let timeout = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    if let Err(e) = conn.set_read_timeout(Some(timeout)) {
        return Exchange::Reset(e);
    }
    let mut len = [0u8; 2];
    if let Err(e) = conn.read_exact(&mut len) {
        return reset(e);
    }
    let mut body = vec![0u8; usize::from(u16::from_be_bytes(len))];
    if let Err(e) = conn.read_exact(&mut body) {
        return reset(e);
    }
    match Message::from_vec(&body) {
        Ok(reply) => Exchange::Answer(reply),
        Err(e) => Exchange::Reset(std::io::Error::other(e)),
    }
}

/// An A query for `name` with `id`, recursion desired.
pub fn query(id: u16, name: &str) -> std::io::Result<Vec<u8>> {
    let mut message = Message::new(id, MessageType::Query, OpCode::Query);
    message.metadata.recursion_desired = true;
    let name = Name::from_ascii(format!("{name}.")).map_err(std::io::Error::other)?;
    message.add_query(Query::query(name, RecordType::A));
    message.to_vec().map_err(std::io::Error::other)
}

/// A UDP resolver that answers `q<k>.example.test` A queries with
/// [`upstream_name`]'s address (TTL 0), and NXDOMAIN otherwise; it stops on drop.
pub struct Upstream {
    pub addr: SocketAddr,
    stopping: Arc<AtomicBool>,
    muted: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Upstream {
    /// Binds `addr`, inside the namespace at `netns` if given, and serves.
    pub fn start(netns: Option<&Path>, addr: SocketAddr) -> anyhow::Result<Upstream> {
        let socket = match netns {
            Some(netns) => crate::netns::enter_path(netns, || UdpSocket::bind(addr))??,
            None => UdpSocket::bind(addr)?,
        };
        socket.set_read_timeout(Some(Duration::from_millis(100)))?;
        let addr = socket.local_addr()?;
        let stopping = Arc::new(AtomicBool::new(false));
        let muted = Arc::new(AtomicBool::new(false));
        let (stop, mute) = (stopping.clone(), muted.clone());
        let thread = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while !stop.load(Ordering::Relaxed) {
                let Ok((len, peer)) = socket.recv_from(&mut buf) else {
                    continue;
                };
                if mute.load(Ordering::Relaxed) {
                    continue;
                }
                let Ok(query) = Message::from_vec(&buf[..len]) else {
                    continue;
                };
                if let Ok(reply) = upstream_answer(&query).to_vec() {
                    let _ = socket.send_to(&reply, peer);
                }
            }
        });
        Ok(Upstream {
            addr,
            stopping,
            muted,
            thread: Some(thread),
        })
    }

    /// Blackholed while muted: reads every query and answers none.
    pub fn mute(&self, muted: bool) {
        self.muted.store(muted, Ordering::Relaxed);
    }
}

fn upstream_answer(query: &Message) -> Message {
    let mut reply = Message::response(query.metadata.id, OpCode::Query);
    reply.metadata.recursion_desired = query.metadata.recursion_desired;
    reply.metadata.recursion_available = true;
    reply.queries.clone_from(&query.queries);
    let known = query.queries.first().and_then(|q| {
        let name = q.name().to_ascii().to_ascii_lowercase();
        let k: u32 = name
            .strip_prefix('q')?
            .strip_suffix(".example.test.")?
            .parse()
            .ok()?;
        (q.query_type() == RecordType::A).then(|| (q.name().clone(), upstream_name(k).1))
    });
    match known {
        Some((name, addr)) => {
            reply.add_answer(Record::from_rdata(name, 0, RData::A(A(addr))));
        }
        None => reply.metadata.response_code = ResponseCode::NXDomain,
    }
    reply
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
