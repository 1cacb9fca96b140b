//! Forwarding to the upstream resolvers: every name outside the zone. A query's answer comes
//! from the cache ([`cache`]) or from a *flight*: one upstream query per question at a time,
//! whose answer every client that asked the same question meanwhile gets, each with its own id
//! and letter case ([`answer`]). A flight asks the upstreams fastest first, the next one as soon
//! as one fails or as soon as one is slow ([`upstream`]), and gives SERVFAIL if none has
//! answered by the upstream timeout.
//!
//! hickory-resolver's name server pool does much of this (smoothed round-trip times, shared
//! in-flight lookups), but it answers lookups rather than relaying messages: it turns NXDOMAIN
//! and empty answers into errors and rebuilds responses, while a forwarder must pass on the
//! upstream's rcode, flags and sections as they are. Its ordering and coalescing are rebuilt
//! here on the same ideas, with time injected so tests can drive them.

pub(crate) mod answer;
mod cache;
mod exchange;
mod upstream;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use hickory_proto::op::{Edns, Message, MessageType, OpCode, ResponseCode};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::clock::Clock;
use crate::config::DnsConfig;
use crate::metrics::{DnsMetrics, Served};
use crate::wire::{MAX_UDP_PAYLOAD, Transport};
use answer::Answer;
use cache::{Cache, CacheKey, CacheLimits};
use exchange::{ExchangeError, Exchanged, exchange};
use upstream::{Transition, Upstreams};

/// What a flight brings back: the answer, or `None` when no upstream gave one.
type Flown = Option<Arc<Answer>>;

/// A reply for the client, ready to send.
#[derive(Debug)]
pub(crate) struct Relayed {
    pub(crate) bytes: Vec<u8>,
    pub(crate) rcode: ResponseCode,
    pub(crate) served: Served,
}

pub(crate) struct Forwarder {
    inner: Arc<Inner>,
}

struct Inner {
    upstreams: Upstreams,
    timeout: Duration,
    cache: Option<Cache>,
    /// The flights under way, by question; a flight removes itself once its answer is cached.
    flights: Mutex<HashMap<CacheKey, watch::Receiver<Option<Flown>>>>,
    /// Forwarded records' TTLs are cut to this.
    max_ttl: u32,
    metrics: DnsMetrics,
    clock: Clock,
}

impl Forwarder {
    pub(crate) fn new(config: &DnsConfig, metrics: DnsMetrics) -> Self {
        let cache = config.cache.then(|| {
            Cache::new(
                CacheLimits {
                    entries: config.cache_entries.max(1),
                    bytes: config.cache_bytes.max(1),
                    source_entries: config.cache_entries_per_source.max(1),
                    source_bytes: source_bytes(config),
                },
                metrics.clone(),
            )
        });
        let upstreams = Upstreams::new(config.upstreams.clone());
        for (addr, _, _) in upstreams.states() {
            metrics.upstream_state(addr, true, None);
        }
        Self {
            inner: Arc::new(Inner {
                upstreams,
                timeout: config.upstream_timeout,
                cache,
                flights: Mutex::new(HashMap::new()),
                max_ttl: config.max_forwarded_ttl,
                metrics,
                clock: config.clock.clone(),
            }),
        }
    }

    /// The reply to `request` from the cache, if it holds a live answer: no I/O, so the server
    /// answers it in line instead of in a task of its own.
    pub(crate) fn cached(&self, request: &Message, transport: Transport) -> Option<Relayed> {
        let key = CacheKey::of(request)?;
        self.inner.cached(&key, request, transport)
    }

    /// The reply to `request` from the cache or an upstream, or `None` if no upstream answered.
    /// `source` (the client's address) is charged for the answer in the cache.
    pub(crate) async fn resolve(
        &self,
        request: &Message,
        source: IpAddr,
        transport: Transport,
    ) -> Option<Relayed> {
        let key = CacheKey::of(request)?;
        let mut flight = {
            let mut flights = self.inner.flights();
            match flights.get(&key) {
                Some(flight) => {
                    self.inner.metrics.coalesced();
                    flight.clone()
                }
                None => {
                    // Under the flights' lock: a flight caches its answer before it leaves
                    // the map, so either it is still there or its answer is in the cache.
                    if let Some(hit) = self.inner.cached(&key, request, transport) {
                        return Some(hit);
                    }
                    let (tx, rx) = watch::channel(None);
                    flights.insert(key.clone(), rx.clone());
                    tokio::spawn(fly(self.inner.clone(), key, request.clone(), source, tx));
                    rx
                }
            }
        };
        if self.inner.cache.is_some() {
            self.inner.metrics.cache_miss();
        }
        // An error means the flight ended without an answer (it panicked): SERVFAIL.
        let flown = flight
            .wait_for(Option::is_some)
            .await
            .ok()?
            .clone()
            .flatten()?;
        Some(Relayed {
            bytes: flown.reply(request, 0, transport),
            rcode: flown.rcode(),
            served: Served::Forwarded,
        })
    }
}

/// Each client's share of the cache's bytes: its share of the entries.
fn source_bytes(config: &DnsConfig) -> usize {
    let share = config.cache_entries_per_source as f64 / config.cache_entries.max(1) as f64;
    ((config.cache_bytes as f64 * share.min(1.0)) as usize).max(1)
}

impl Inner {
    fn flights(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<CacheKey, watch::Receiver<Option<Flown>>>> {
        // Critical sections only look up, insert and remove: the map stays consistent.
        self.flights.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn cached(&self, key: &CacheKey, request: &Message, transport: Transport) -> Option<Relayed> {
        let hit = self.cache.as_ref()?.get(key, self.clock.now())?;
        self.metrics.cache_hit();
        Some(Relayed {
            bytes: hit.answer.reply(request, hit.age, transport),
            rcode: hit.answer.rcode(),
            served: Served::Cached,
        })
    }

    /// Asks the upstreams for `request`'s answer, by the timeout: fastest first, the next one at
    /// once when one fails or gives SERVFAIL/REFUSED (about that server, not the name), and
    /// also when one is slower than its usual time; all at once when every one is down. A due
    /// probe of a down upstream goes out beside the first. The first usable answer wins;
    /// exchanges still out finish on their own and report their upstream's health.
    async fn ask_upstreams(self: &Arc<Self>, request: &Message) -> Flown {
        let started = Instant::now();
        let deadline = started + self.timeout;
        let plan = self.upstreams.plan(self.clock.now());
        let (tx, mut results) = mpsc::channel(self.upstreams.len() + 1);
        let query = upstream_query(request);
        let probe = plan.probe;
        if let Some(probe) = probe {
            self.start(probe, &query, tx.clone());
        }
        let mut order = plan.order.into_iter();
        let mut outstanding = usize::from(probe.is_some());
        let mut hedge: Option<(usize, Instant, Duration)> = None;
        let mut last_failure: Option<Message> = None;
        if plan.at_once {
            for index in order.by_ref() {
                self.start(index, &query, tx.clone());
                outstanding += 1;
            }
        }
        let mut next = |outstanding: &mut usize, hedge: &mut Option<(usize, Instant, Duration)>| {
            *hedge = order.next().map(|index| {
                self.start(index, &query, tx.clone());
                *outstanding += 1;
                let now = Instant::now();
                let left = deadline.saturating_duration_since(now);
                let wait = self.upstreams.hedge_delay(index, left, order.len());
                (index, now + wait, wait)
            });
        };
        next(&mut outstanding, &mut hedge);
        while outstanding > 0 || hedge.is_some() {
            let hedge_at = hedge.map_or(deadline, |(_, at, _)| at.min(deadline));
            tokio::select! {
                Some((index, result)) = results.recv() => {
                    outstanding -= 1;
                    match result {
                        Some(answer) if !failing(&answer) => match Answer::from_upstream(answer, self.max_ttl) {
                            Ok(answer) => return Some(Arc::new(answer)),
                            Err(error) => tracing::debug!(%error, "cannot relay an upstream answer"),
                        },
                        Some(answer) => last_failure = Some(answer),
                        None => {}
                    }
                    // A failed probe changes nothing for this query: the upstreams that are up
                    // keep their turns.
                    if Some(index) != probe {
                        next(&mut outstanding, &mut hedge);
                    }
                }
                () = tokio::time::sleep_until(hedge_at), if hedge.is_some() => {
                    if Instant::now() >= deadline {
                        break;
                    }
                    if let Some((index, _, waited)) = hedge {
                        self.upstreams.overtaken(index, waited);
                    }
                    next(&mut outstanding, &mut hedge);
                }
                () = tokio::time::sleep_until(deadline) => break,
            }
        }
        last_failure.and_then(|answer| {
            Answer::from_upstream(answer, self.max_ttl)
                .ok()
                .map(Arc::new)
        })
    }

    /// Sends `query` to upstream `index` in a task of its own, which records the upstream's
    /// health and sends the outcome to `results` (if the flight still listens).
    fn start(
        self: &Arc<Self>,
        index: usize,
        query: &Message,
        results: mpsc::Sender<(usize, Option<Message>)>,
    ) {
        let mut query = query.clone();
        query.metadata.id = rand::random();
        let inner = self.clone();
        let upstream = self.upstreams.addr(index);
        self.metrics.upstream_query(upstream);
        tokio::spawn(async move {
            let started = Instant::now();
            let outcome = exchange(upstream, &query, started + inner.timeout).await;
            let result = inner.record(index, started.elapsed(), outcome);
            let _ = results.send((index, result)).await;
        });
    }

    /// Counts an exchange's outcome into the upstream's health and the metrics.
    fn record(
        &self,
        index: usize,
        elapsed: Duration,
        outcome: Result<Exchanged, ExchangeError>,
    ) -> Option<Message> {
        let upstream = self.upstreams.addr(index);
        let (transition, result) = match outcome {
            Ok(exchanged) => {
                self.metrics.upstream_latency(elapsed);
                if exchanged.retried_over_tcp {
                    self.metrics.upstream_truncated();
                }
                if failing(&exchanged.answer) {
                    let rcode = exchanged.answer.metadata.response_code;
                    tracing::debug!(%upstream, %rcode, "upstream failed the query; trying the next");
                    self.metrics.upstream_failure("rcode");
                }
                (
                    self.upstreams.answered(index, elapsed),
                    Some(exchanged.answer),
                )
            }
            Err(error) => {
                tracing::debug!(%upstream, %error, "upstream exchange failed");
                self.metrics.upstream_failure(error.reason());
                (self.upstreams.failed(index, self.clock.now()), None)
            }
        };
        match transition {
            Some(Transition::WentDown) => tracing::warn!(
                %upstream,
                "upstream DNS server gave no answer; asking the others, probing it now and then"
            ),
            Some(Transition::CameBack) => {
                tracing::info!(%upstream, "upstream DNS server answers again")
            }
            None => {}
        }
        if let Some((_, up, srtt)) = self.upstreams.states().nth(index) {
            self.metrics.upstream_state(upstream, up, srtt);
        }
        result
    }
}

/// A flight: asks the upstreams, caches the answer (charged to `source`, whose query started
/// it), leaves the map, then tells every waiter.
async fn fly(
    inner: Arc<Inner>,
    key: CacheKey,
    request: Message,
    source: IpAddr,
    waiters: watch::Sender<Option<Flown>>,
) {
    // Leaves the map however the flight ends, a panic included.
    struct Landing<'a>(&'a Inner, &'a CacheKey);
    impl Drop for Landing<'_> {
        fn drop(&mut self) {
            self.0.flights().remove(self.1);
        }
    }
    let landing = Landing(&inner, &key);
    let flown = inner.ask_upstreams(&request).await;
    if let (Some(answer), Some(cache)) = (&flown, &inner.cache)
        && let Some(ttl) = answer.cache_ttl()
    {
        // An IPv4 client of a dual-stack socket is one client whichever way it is written.
        let source = source.to_canonical();
        cache.insert(key.clone(), answer.clone(), ttl, source, inner.clock.now());
    }
    drop(landing);
    waiters.send_replace(Some(flown));
}

/// SERVFAIL and REFUSED are about the server that gave them, not the name: another may answer.
fn failing(answer: &Message) -> bool {
    matches!(
        answer.metadata.response_code,
        ResponseCode::ServFail | ResponseCode::Refused
    )
}

/// The query sent upstream: the client's question and RD/CD/DO bits, and our own EDNS (the
/// client's options, such as cookies, are hop-by-hop). Each exchange gives it a fresh id.
fn upstream_query(request: &Message) -> Message {
    let mut query = Message::new(0, MessageType::Query, OpCode::Query);
    query.metadata.recursion_desired = request.metadata.recursion_desired;
    query.metadata.checking_disabled = request.metadata.checking_disabled;
    query.queries.clone_from(&request.queries);
    let mut edns = Edns::new();
    edns.set_max_payload(MAX_UDP_PAYLOAD);
    edns.set_version(0);
    edns.set_dnssec_ok(request.edns.as_ref().is_some_and(|e| e.flags().dnssec_ok));
    query.edns = Some(edns);
    query
}
