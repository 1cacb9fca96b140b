//! A relay between a real Envoy and the agent's xDS port that watches the ADS conversation
//! going through it, so a benchmark can tell when Envoy *acknowledged* an endpoint change, or
//! the last assignment of its initial sync, without asking Envoy's admin. An xDS client ACKs a response once it has applied it (Envoy
//! updates a cluster's hosts on its main thread, then ACKs), so the ACK of the response that
//! carried an assignment is when Envoy holds it. At 10k clusters, Envoy's admin answers a
//! `/clusters` query filtered to one cluster in about 15 ms (it goes through every cluster),
//! on the same main thread that applies xDS: polled back to back, the probe kept that thread
//! busy and delayed the very updates it timed.
//!
//! The bytes are relayed unchanged, as they come; a copy of each direction is read as HTTP/2
//! frames (DATA frames only: headers and settings are not needed) carrying gRPC messages:
//! responses from the agent (which assignments each nonce carried) and requests from Envoy
//! (which nonces it ACKed, with no `error_detail`). A test can also hold Envoy's side back
//! ([`AdsTap::pause`]): what Envoy sends is read as it comes but reaches the agent only on
//! [`AdsTap::resume`], as a slow network would deliver it, which makes a race of the two sides
//! happen on purpose.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryResponse, DiscoveryResponse};
use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::ads_client::{EDS, endpoints_of};
use crate::envoy::AdsMode;

/// The client connection preface of HTTP/2, before its first frame.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const PADDED: u8 = 0x8;

/// The relay, listening on `addr`.
pub struct AdsTap {
    pub addr: SocketAddr,
    acks: TapWatch,
    task: tokio::task::JoinHandle<()>,
    /// Whether Envoy's bytes go on to the agent (see [`AdsTap::pause`]).
    open: Arc<watch::Sender<bool>>,
}

#[derive(Default)]
struct TapState {
    /// Nonce → the assignments (cluster, endpoints) its response carried, until ACKed.
    sent: HashMap<String, Vec<(String, Vec<SocketAddr>)>>,
    /// Cluster → the endpoints of the last assignment ACKed, and when.
    held: HashMap<String, (Vec<SocketAddr>, Instant)>,
    /// Something the relay could not read: reported by the next wait.
    error: Option<String>,
    /// Nonces of the agent's responses Envoy has not answered (ACK or NACK) yet.
    unanswered: HashSet<String>,
    /// Responses the agent sent.
    responses: u64,
}

impl AdsTap {
    /// Relays every connection made to it to `upstream`; `mode` is the ADS flavour Envoy
    /// speaks.
    pub async fn start(upstream: SocketAddr, mode: AdsMode) -> anyhow::Result<AdsTap> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(TapState::default()));
        let (bump, changed) = watch::channel(0u64);
        let bump = Arc::new(bump);
        let open = Arc::new(watch::Sender::new(true));
        let shared = state.clone();
        let gate = open.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (state, bump, gate) = (shared.clone(), bump.clone(), gate.subscribe());
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        relay(client, server, mode, state, bump, gate).await;
                    }
                });
            }
        });
        Ok(AdsTap {
            addr,
            acks: TapWatch { state, changed },
            task,
            open,
        })
    }

    /// Holds back what Envoy sends: read (and seen by the waits), not passed on to the agent.
    pub fn pause(&self) {
        self.open.send_replace(false);
    }

    /// Passes on what was held back, in order, and whatever Envoy sends next.
    pub fn resume(&self) {
        self.open.send_replace(true);
    }

    /// How many responses the agent has sent through the relay.
    pub fn responses(&self) -> u64 {
        let state = self.acks.state.lock().unwrap_or_else(|p| p.into_inner());
        state.responses
    }

    /// Waits up to `timeout` until the agent has sent more than `after` responses and Envoy has
    /// answered every one (whether or not the answers reached the agent).
    pub async fn answered(&mut self, after: u64, timeout: Duration) -> anyhow::Result<()> {
        let what = format!("every response after the first {after}");
        self.acks
            .wait_state(&what, timeout, |state| {
                (state.responses > after && state.unanswered.is_empty()).then(Instant::now)
            })
            .await
            .map(|_| ())
    }

    /// When Envoy ACKed a response that gave `cluster` an assignment listing `endpoint`
    /// (waits up to `timeout` for it).
    pub async fn acked(
        &mut self,
        cluster: &str,
        endpoint: SocketAddr,
        timeout: Duration,
    ) -> anyhow::Result<Instant> {
        let what = format!("{endpoint} in {cluster}");
        self.acks
            .wait(&what, timeout, |held| {
                held.get(cluster)
                    .filter(|(endpoints, _)| endpoints.contains(&endpoint))
                    .map(|(_, at)| *at)
            })
            .await
    }

    /// A handle that waits on what Envoy ACKed from another task.
    pub fn watch(&self) -> TapWatch {
        self.acks.clone()
    }
}

/// Waits on the ACKs an [`AdsTap`] sees, from any task.
#[derive(Clone)]
pub struct TapWatch {
    state: Arc<Mutex<TapState>>,
    changed: watch::Receiver<u64>,
}

impl TapWatch {
    /// When Envoy ACKed the last of the assignments that make `clusters` clusters hold what
    /// `full` wants (waits up to `timeout`): the moment Envoy held them all.
    pub async fn holds_all(
        &mut self,
        clusters: usize,
        full: impl Fn(&str, &[SocketAddr]) -> bool,
        timeout: Duration,
    ) -> anyhow::Result<Instant> {
        let what = format!("the assignments of {clusters} clusters");
        self.wait(&what, timeout, |held| {
            let mut count = 0;
            let mut last: Option<Instant> = None;
            for (cluster, (endpoints, at)) in held {
                if full(cluster, endpoints) {
                    count += 1;
                    last = Some(last.map_or(*at, |l| l.max(*at)));
                }
            }
            if count == clusters { last } else { None }
        })
        .await
    }

    /// Waits up to `timeout` until `done` finds what it looks for in the ACKed assignments,
    /// looking again after each message the relay reads.
    async fn wait(
        &mut self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&HashMap<String, (Vec<SocketAddr>, Instant)>) -> Option<Instant>,
    ) -> anyhow::Result<Instant> {
        self.wait_state(what, timeout, |state| done(&state.held))
            .await
    }

    async fn wait_state(
        &mut self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&TapState) -> Option<Instant>,
    ) -> anyhow::Result<Instant> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            self.changed.borrow_and_update();
            {
                let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(error) = &state.error {
                    anyhow::bail!("the ADS relay: {error}");
                }
                if let Some(at) = done(&state) {
                    return Ok(at);
                }
            }
            if tokio::time::timeout_at(deadline, self.changed.changed())
                .await
                .is_err()
            {
                anyhow::bail!("Envoy did not answer {what} within {timeout:?}");
            }
        }
    }
}

impl Drop for AdsTap {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Relays one connection both ways until either side closes it, reading each direction.
async fn relay(
    client: TcpStream,
    server: TcpStream,
    mode: AdsMode,
    state: Arc<Mutex<TapState>>,
    bump: Arc<watch::Sender<u64>>,
    gate: watch::Receiver<bool>,
) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let requests = pipe(client_read, server_write, Reader::new(true), Some(gate), {
        let (state, bump) = (state.clone(), bump.clone());
        move |message| {
            let read = on_request(mode, &message, &state, &bump);
            failed(read, &state, &bump);
        }
    });
    let responses = pipe(server_read, client_write, Reader::new(false), None, {
        let (state, bump) = (state.clone(), bump.clone());
        move |message| {
            let read = on_response(mode, &message, &state);
            failed(read, &state, &bump);
            bump.send_modify(|n| *n += 1);
        }
    });
    tokio::select! {
        () = requests => {}
        () = responses => {}
    }
}

/// Keeps what the relay could not read, for the next wait to report.
fn failed(read: Result<(), String>, state: &Mutex<TapState>, bump: &watch::Sender<u64>) {
    if let Err(error) = read {
        let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
        state.error.get_or_insert(error);
        drop(state);
        bump.send_modify(|n| *n += 1);
    }
}

/// Copies `from` to `to`, handing every gRPC message seen on the way to `on_message`; while
/// `gate` is closed, what is read is kept and passed on when it opens.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut reader: Reader,
    mut gate: Option<watch::Receiver<bool>>,
    mut on_message: impl FnMut(BytesMut),
) {
    let mut buf = vec![0u8; 256 << 10];
    let mut held = Vec::new();
    loop {
        let open = gate.as_ref().is_none_or(|g| *g.borrow());
        if open && !held.is_empty() {
            if to.write_all(&held).await.is_err() {
                return;
            }
            held.clear();
        }
        let read = match gate.as_mut().filter(|_| !open) {
            Some(g) => tokio::select! {
                read = from.read(&mut buf) => read,
                changed = g.changed() => {
                    if changed.is_err() {
                        gate = None;
                    }
                    continue;
                }
            },
            None => from.read(&mut buf).await,
        };
        let n = match read {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        for message in reader.feed(&buf[..n]) {
            on_message(message);
        }
        if open {
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        } else {
            held.extend_from_slice(&buf[..n]);
        }
    }
}

/// Reads HTTP/2 frames off one direction of a connection and gRPC messages out of their DATA.
struct Reader {
    /// Bytes of the client preface still to skip.
    preface: usize,
    buf: BytesMut,
    /// Per HTTP/2 stream, the gRPC bytes not yet a whole message.
    streams: HashMap<u32, BytesMut>,
}

impl Reader {
    fn new(client: bool) -> Self {
        Reader {
            preface: if client { PREFACE.len() } else { 0 },
            buf: BytesMut::new(),
            streams: HashMap::new(),
        }
    }

    fn feed(&mut self, bytes: &[u8]) -> Vec<BytesMut> {
        self.buf.extend_from_slice(bytes);
        let skip = self.preface.min(self.buf.len());
        self.buf.advance(skip);
        self.preface -= skip;
        let mut out = Vec::new();
        while self.buf.len() >= 9 {
            let len = (usize::from(self.buf[0]) << 16)
                | (usize::from(self.buf[1]) << 8)
                | usize::from(self.buf[2]);
            if self.buf.len() < 9 + len {
                break;
            }
            let (kind, flags) = (self.buf[3], self.buf[4]);
            let stream = u32::from_be_bytes([self.buf[5], self.buf[6], self.buf[7], self.buf[8]])
                & !(1 << 31);
            let mut frame = self.buf.split_to(9 + len);
            frame.advance(9);
            if kind != DATA {
                continue;
            }
            let mut payload = &frame[..];
            if flags & PADDED != 0 && !payload.is_empty() {
                let pad = usize::from(payload[0]);
                payload = &payload[1..payload.len().saturating_sub(pad).max(1)];
            }
            let grpc = self.streams.entry(stream).or_default();
            grpc.extend_from_slice(payload);
            while grpc.len() >= 5 {
                let len = u32::from_be_bytes([grpc[1], grpc[2], grpc[3], grpc[4]]) as usize;
                if grpc.len() < 5 + len {
                    break;
                }
                let mut message = grpc.split_to(5 + len);
                message.advance(5);
                out.push(message);
            }
        }
        out
    }
}

/// A response from the agent: note the assignments it carries under its nonce.
fn on_response(mode: AdsMode, message: &[u8], state: &Mutex<TapState>) -> Result<(), String> {
    let (type_url, nonce, resources): (String, String, Vec<Any>) = match mode {
        AdsMode::Delta => {
            let r = DeltaDiscoveryResponse::decode(message).map_err(|e| e.to_string())?;
            let any = r.resources.into_iter().filter_map(|r| r.resource).collect();
            (r.type_url, r.nonce, any)
        }
        AdsMode::Sotw => {
            let r = DiscoveryResponse::decode(message).map_err(|e| e.to_string())?;
            (r.type_url, r.nonce, r.resources)
        }
    };
    {
        let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
        state.responses += 1;
        state.unanswered.insert(nonce.clone());
    }
    if type_url != EDS {
        return Ok(());
    }
    let assignments = resources
        .iter()
        .map(|any| {
            let cla =
                ClusterLoadAssignment::decode(any.value.as_slice()).map_err(|e| e.to_string())?;
            let endpoints = endpoints_of(&cla);
            Ok((cla.cluster_name, endpoints))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
    state.sent.insert(nonce, assignments);
    Ok(())
}

/// What the relay reads of a `DeltaDiscoveryRequest`: whether it answers a response, and how.
/// The rest is skipped unread. Decoded whole, a reconnecting Envoy's 100k initial resource
/// versions made a map of 100k strings on every restart, about 45 ms of the benchmark's CPU
/// (perf) on the two cores the restart it times runs on.
#[derive(Clone, PartialEq, prost::Message)]
struct DeltaAnswer {
    #[prost(string, tag = "6")]
    response_nonce: String,
    #[prost(message, optional, tag = "7")]
    error_detail: Option<envoy_types::pb::google::rpc::Status>,
}

/// What the relay reads of a SotW `DiscoveryRequest` (see [`DeltaAnswer`]).
#[derive(Clone, PartialEq, prost::Message)]
struct SotwAnswer {
    #[prost(string, tag = "5")]
    response_nonce: String,
    #[prost(message, optional, tag = "6")]
    error_detail: Option<envoy_types::pb::google::rpc::Status>,
}

/// A request from Envoy: an ACK makes what its nonce carried held.
fn on_request(
    mode: AdsMode,
    message: &[u8],
    state: &Mutex<TapState>,
    bump: &watch::Sender<u64>,
) -> Result<(), String> {
    let now = Instant::now();
    let (nonce, nack) = match mode {
        AdsMode::Delta => {
            let r = DeltaAnswer::decode(message).map_err(|e| e.to_string())?;
            (r.response_nonce, r.error_detail.is_some())
        }
        AdsMode::Sotw => {
            let r = SotwAnswer::decode(message).map_err(|e| e.to_string())?;
            (r.response_nonce, r.error_detail.is_some())
        }
    };
    let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
    let answered = state.unanswered.remove(&nonce);
    let Some(assignments) = state.sent.remove(&nonce) else {
        drop(state);
        if answered {
            bump.send_modify(|n| *n += 1);
        }
        return Ok(());
    };
    if nack {
        state.error = Some(format!("Envoy NACKed the endpoints of nonce {nonce}"));
    } else {
        for (cluster, endpoints) in assignments {
            state.held.insert(cluster, (endpoints, now));
        }
    }
    drop(state);
    bump.send_modify(|n| *n += 1);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
    use envoy_types::pb::google::rpc::Status;

    #[test]
    fn an_answer_is_read_from_a_whole_request() {
        let nack = Some(Status {
            code: 3,
            message: "bad".into(),
            details: vec![],
        });
        let delta = DeltaDiscoveryRequest {
            type_url: "t".into(),
            resource_names_subscribe: vec!["a".into()],
            initial_resource_versions: [("a".to_string(), "1".to_string())].into(),
            response_nonce: "n1".into(),
            error_detail: nack.clone(),
            ..Default::default()
        };
        let read = DeltaAnswer::decode(delta.encode_to_vec().as_slice()).unwrap();
        assert_eq!(
            (read.response_nonce.as_str(), read.error_detail),
            ("n1", nack.clone())
        );
        let sotw = DiscoveryRequest {
            version_info: "v".into(),
            resource_names: vec!["a".into()],
            type_url: "t".into(),
            response_nonce: "n2".into(),
            error_detail: nack.clone(),
            ..Default::default()
        };
        let read = SotwAnswer::decode(sotw.encode_to_vec().as_slice()).unwrap();
        assert_eq!(
            (read.response_nonce.as_str(), read.error_detail),
            ("n2", nack)
        );
        let ack = DiscoveryRequest {
            response_nonce: "n3".into(),
            ..Default::default()
        };
        let read = SotwAnswer::decode(ack.encode_to_vec().as_slice()).unwrap();
        assert_eq!(
            (read.response_nonce.as_str(), read.error_detail),
            ("n3", None)
        );
    }
}
