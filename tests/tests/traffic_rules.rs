//! Traffic rules proven with traffic, for both sources: requests from an app in a client pod,
//! through the real `lattice-init` capture and a real Envoy configured by the agent, counted at
//! identity backends. The same scenarios run with the rules written in a mesh file and as
//! HTTPRoute objects served by the fake API server to the agent's real kube client.
//!
//! Scenarios (each says what fails when the feature breaks):
//! - a 90/10 split: 2000 requests within binomial bounds (p < 0.001) of 90/10;
//! - a header match sends every matching request to green and none of the others;
//! - a live flip from 100/0 to 0/100 under more than 100 requests/s: no request fails, and none
//!   reaches blue later than 1 s after the change;
//! - retries: a backend that answers 503 to every other request; 3 retries on 503 → ≥ 99 % of
//!   1000 succeed, no retries → about half fail;
//! - a 500 ms timeout in front of a backend that answers after 2 s: 504 in 0.5–0.8 s;
//! - request header set/add/remove, as the Gateway API's MeshHTTPRouteRequestHeaderModifier;
//! - match precedence, as MeshHTTPRouteMatching, and query parameters, as
//!   MeshHTTPRouteQueryParamMatching (including 404 when a route is attached and nothing
//!   matches);
//! - removing the rules restores plain routing live.
//!
//! Build the binaries first: `cargo build --workspace --bins`. See the figures with
//! `cargo test -p lattice-e2e --test traffic_rules -- --nocapture`.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lattice_e2e::agent::Agent;
use lattice_e2e::k8s_objects::{http_route, service_parent};
use lattice_e2e::mesh_source::MeshSource as Source;
use lattice_e2e::node::{Backend, Behaviour, ClientPod, Node, Reply, Request};
use lattice_e2e::wait;
use serde_json::{Value, json};

/// One topology at a time: the bars below are about the mesh, not about two topologies'
/// Envoys competing for the same two cores.
static ONE_NODE: Mutex<()> = Mutex::new(());

const WEB: &str = "web.shop.system.internal";
const PORT: u16 = 8080;
const SHARED: Ipv4Addr = Ipv4Addr::new(240, 240, 0, 1);
/// How soon a rule change must reach the data path.
const FOLLOW: Duration = Duration::from_secs(1);
/// Between two requests of the steady stream: more than 100 requests a second.
const PACE: Duration = Duration::from_millis(5);
/// Two-sided z for p < 0.001.
const Z_999: f64 = 3.29;

/// The backends, by identity, and the services they make up (`/shop/<identity>`). `web` is the
/// parent: clients call it, its rules route.
const BACKENDS: [(&str, u8); 7] = [
    ("web", 11),
    ("blue", 12),
    ("green", 13),
    ("v1", 14),
    ("v2", 15),
    ("flaky", 16),
    ("slow", 17),
];

/// A rule, written once and rendered for either source.
#[derive(Clone, Default)]
struct Rule {
    matches: Vec<Match>,
    /// (service identity, weight)
    backends: Vec<(&'static str, u32)>,
    timeout: Option<&'static str>,
    /// Retries on 503.
    retries: Option<u32>,
    set: Vec<(&'static str, &'static str)>,
    add: Vec<(&'static str, &'static str)>,
    remove: Vec<&'static str>,
}

#[derive(Clone, Default)]
struct Match {
    /// ("exact" | "prefix", value)
    path: Option<(&'static str, &'static str)>,
    headers: Vec<(&'static str, &'static str)>,
    query: Vec<(&'static str, &'static str)>,
}

fn to(backends: &[(&'static str, u32)]) -> Rule {
    Rule {
        backends: backends.to_vec(),
        ..Rule::default()
    }
}

fn prefix(value: &'static str) -> Match {
    Match {
        path: Some(("prefix", value)),
        ..Match::default()
    }
}

fn regex(value: &'static str) -> Match {
    Match {
        path: Some(("regex", value)),
        ..Match::default()
    }
}

fn header(name: &'static str, value: &'static str) -> Match {
    Match {
        headers: vec![(name, value)],
        ..Match::default()
    }
}

fn query(name: &'static str, value: &'static str) -> Match {
    Match {
        query: vec![(name, value)],
        ..Match::default()
    }
}

impl Rule {
    fn when(mut self, matches: Vec<Match>) -> Rule {
        self.matches = matches;
        self
    }

    /// The rule as a mesh-file `routes:` entry.
    fn yaml(&self) -> Value {
        self.render(&Dialect {
            backends: "backends",
            backend: |name, weight| json!({"service": format!("/shop/{name}"), "weight": weight}),
            path: |kind, value| json!({kind: value}),
            value: "exact",
            query: "query",
            timeout: |timeout| ("timeout", timeout.into()),
            edits: |edits| ("requestHeaders", edits),
        })
    }

    /// The rule as an HTTPRoute rule.
    fn gateway(&self) -> Value {
        self.render(&Dialect {
            backends: "backendRefs",
            backend: |name, weight| json!({"name": name, "port": PORT, "weight": weight}),
            path: |kind, value| {
                let kind = match kind {
                    "exact" => "Exact",
                    "regex" => "RegularExpression",
                    _ => "PathPrefix",
                };
                json!({"type": kind, "value": value})
            },
            value: "value",
            query: "queryParams",
            timeout: |timeout| ("timeouts", json!({"request": timeout})),
            edits: |edits| {
                let filter =
                    json!({"type": "RequestHeaderModifier", "requestHeaderModifier": edits});
                ("filters", json!([filter]))
            },
        })
    }

    fn render(&self, dialect: &Dialect) -> Value {
        let mut rule = json!({});
        rule[dialect.backends] = self
            .backends
            .iter()
            .map(|(name, weight)| (dialect.backend)(name, *weight))
            .collect();
        let conditions = |list: &[(&str, &str)]| -> Value {
            list.iter()
                .map(|(name, value)| json!({"name": name, dialect.value: value}))
                .collect()
        };
        if !self.matches.is_empty() {
            rule["matches"] = self
                .matches
                .iter()
                .map(|m| {
                    let mut out = json!({});
                    if let Some((kind, value)) = m.path {
                        out["path"] = (dialect.path)(kind, value);
                    }
                    if !m.headers.is_empty() {
                        out["headers"] = conditions(&m.headers);
                    }
                    if !m.query.is_empty() {
                        out[dialect.query] = conditions(&m.query);
                    }
                    out
                })
                .collect();
        }
        if let Some(timeout) = self.timeout {
            let (field, value) = (dialect.timeout)(timeout);
            rule[field] = value;
        }
        if let Some(attempts) = self.retries {
            rule["retry"] = json!({"attempts": attempts, "codes": [503]});
        }
        if !(self.set.is_empty() && self.add.is_empty() && self.remove.is_empty()) {
            let edits = json!({
                "set": pairs(&self.set), "add": pairs(&self.add), "remove": self.remove,
            });
            let (field, value) = (dialect.edits)(edits);
            rule[field] = value;
        }
        rule
    }
}

/// How a source spells the parts of a rule (the mesh file's `routes:`, or an HTTPRoute's).
struct Dialect {
    backends: &'static str,
    backend: fn(&str, u32) -> Value,
    path: fn(&str, &str) -> Value,
    /// The key of a header or query condition's value.
    value: &'static str,
    query: &'static str,
    timeout: fn(&str) -> (&'static str, Value),
    edits: fn(Value) -> (&'static str, Value),
}

fn pairs(list: &[(&str, &str)]) -> Value {
    list.iter()
        .map(|(name, value)| json!({"name": name, "value": value}))
        .collect()
}

/// `web`'s rules in either source's terms.
trait Rules {
    fn name(&self) -> &'static str;
    fn set_rules(&self, backends: &[Backend], name: &str, rules: &[Rule]) -> Instant;
    fn route_names(&self, name: &str, count: usize) -> BTreeSet<String>;
}

impl Rules for Source {
    fn name(&self) -> &'static str {
        match self {
            Source::File(_) => "mesh file",
            Source::Kube { .. } => "HTTPRoute",
        }
    }

    /// Makes `web`'s rules exactly `rules` (none: plain routing), named `name` where the source
    /// names them; returns when the change was written.
    fn set_rules(&self, backends: &[Backend], name: &str, rules: &[Rule]) -> Instant {
        match self {
            Source::File(file) => {
                let services: Vec<Value> = backends
                    .iter()
                    .map(|b| {
                        let mut service = json!({
                            "path": format!("/shop/{}", b.identity),
                            "ports": [{"port": PORT, "protocol": "http"}],
                            "endpoints": [{"address": b.pod.address.to_string()}],
                        });
                        if b.identity == "web" && !rules.is_empty() {
                            service["routes"] = rules
                                .iter()
                                .enumerate()
                                .map(|(i, r)| {
                                    let mut rule = r.yaml();
                                    rule["name"] = format!("{name}-{i}").into();
                                    rule
                                })
                                .collect();
                        }
                        service
                    })
                    .collect();
                let text = serde_norway::to_string(&json!({ "services": services })).unwrap();
                file.write_text(&text).unwrap();
            }
            Source::Kube { server, .. } => {
                // A route of the same name is updated in place, as a user edits one.
                for old in server
                    .objects::<gateway_api::experimental::httproutes::HttpRoute>()
                    .unwrap()
                {
                    let old = old.metadata.name.unwrap_or_default();
                    if old != name || rules.is_empty() {
                        server
                            .delete::<gateway_api::experimental::httproutes::HttpRoute>(
                                "shop", &old,
                            )
                            .unwrap();
                    }
                }
                if !rules.is_empty() {
                    server
                        .apply_json(http_route(
                            "shop",
                            name,
                            json!([service_parent("web", None)]),
                            rules.iter().map(Rule::gateway).collect(),
                        ))
                        .unwrap();
                }
            }
        }
        Instant::now()
    }

    /// The names Envoy's routes carry for `rules` written by [`Rules::set_rules`].
    fn route_names(&self, name: &str, count: usize) -> BTreeSet<String> {
        (0..count)
            .map(|i| match self {
                Source::File(_) => format!("mesh file rule {i} ({name}-{i})"),
                Source::Kube { .. } => format!("HTTPRoute shop/{name} rule {i}"),
            })
            .collect()
    }
}

/// A node with the agent, a client pod and the backends. Fields drop top to bottom: the
/// client's Envoy first, the node last.
struct Fixture {
    client: ClientPod,
    agent: Agent,
    source: Source,
    backends: Vec<Backend>,
    _node: Node,
}

impl Fixture {
    fn build(label: &str, kubernetes: bool) -> Fixture {
        let node = Node::new(label).unwrap();
        let backends: Vec<Backend> = BACKENDS
            .iter()
            .map(|&(identity, host)| {
                let behaviour = match identity {
                    "flaky" => Behaviour::FailEveryOther,
                    "slow" => Behaviour::Slow(Duration::from_secs(2)),
                    _ => Behaviour::Answer,
                };
                node.http_backend_with(identity, host, PORT, behaviour)
                    .unwrap()
            })
            .collect();
        let source = Source::start(&node, kubernetes).unwrap();
        if let Source::Kube { server, .. } = &source {
            for backend in &backends {
                server
                    .apply_json(json!({
                        "apiVersion": "v1", "kind": "Service",
                        "metadata": {"namespace": "shop", "name": backend.identity},
                        "spec": {"ports": [{"name": "http", "port": PORT, "protocol": "TCP",
                                            "appProtocol": "http"}]},
                    }))
                    .unwrap();
                server
                    .apply_json(json!({
                        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                        "metadata": {"namespace": "shop", "name": format!("{}-1", backend.identity),
                                     "labels": {"kubernetes.io/service-name": backend.identity}},
                        "addressType": "IPv4",
                        "ports": [{"name": "http", "port": PORT, "protocol": "TCP"}],
                        "endpoints": [{"addresses": [backend.pod.address.to_string()],
                                       "conditions": {"ready": true}}],
                    }))
                    .unwrap();
            }
        }
        source.set_rules(&backends, "none", &[]);
        let agent = source.agent(&node).unwrap();
        let client = node.client("client", 2).unwrap();
        let fixture = Fixture {
            client,
            agent,
            source,
            backends,
            _node: node,
        };
        fixture.wait_routes(&BTreeSet::new(), "");
        fixture
    }

    fn backend(&self, identity: &str) -> &Backend {
        self.backends
            .iter()
            .find(|b| b.identity == identity)
            .unwrap()
    }

    fn web(&self) -> SocketAddr {
        SocketAddr::from((SHARED, PORT))
    }

    fn host(&self) -> String {
        format!("{WEB}:{PORT}")
    }

    /// Sets `web`'s rules and waits until the client's Envoy routes by exactly them; returns
    /// when the change was written and how long Envoy took to hold it.
    fn rules(&self, name: &str, rules: &[Rule]) -> (Instant, Duration) {
        self.rules_then(name, rules, "")
    }

    /// [`Fixture::rules`], also waiting for `web`'s virtual host to say `showing` (for an
    /// edit that keeps the rules' names).
    fn rules_then(&self, name: &str, rules: &[Rule], showing: &str) -> (Instant, Duration) {
        let at = self.source.set_rules(&self.backends, name, rules);
        let names = if rules.is_empty() {
            BTreeSet::new()
        } else {
            self.source.route_names(name, rules.len())
        };
        self.wait_routes(&names, showing);
        (at, at.elapsed())
    }

    /// Waits until the client's Envoy has `web`'s virtual host with routes named `names`
    /// (none: the plain route of a service without rules) and `showing` in its JSON.
    fn wait_routes(&self, names: &BTreeSet<String>, showing: &str) {
        wait::until(
            "web's routes in the client's Envoy",
            Duration::from_secs(30),
            || {
                let dump = self
                    .client
                    .envoy_admin("/config_dump?resource=dynamic_route_configs")?;
                let dump: Value = serde_json::from_str(&dump).map_err(|e| e.to_string())?;
                let host = dump["configs"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .flat_map(|c| {
                        c["route_config"]["virtual_hosts"]
                            .as_array()
                            .into_iter()
                            .flatten()
                    })
                    .find(|v| v["name"] == format!("{WEB}|{PORT}"));
                let seen: Option<BTreeSet<String>> = host.map(|v| {
                    v["routes"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|r| r["name"].as_str().map(str::to_string))
                        .collect()
                });
                match (seen, host) {
                    (Some(seen), Some(host))
                        if &seen == names && host.to_string().contains(showing) =>
                    {
                        Ok(())
                    }
                    (seen, _) => Err(format!("{seen:?}")),
                }
            },
        )
        .unwrap_or_else(|e| panic!("{e}\nagent log:\n{}", self.agent.log()));
    }

    fn send(&self, request: &Request) -> Reply {
        self.client
            .request(self.web(), &self.host(), request)
            .unwrap_or_else(|e| panic!("{request:?}: {e}"))
    }

    /// `count` requests, four at a time; by backend identity (or `status N` for a failure).
    fn count(&self, request: &Request, count: usize) -> BTreeMap<String, usize> {
        self.count_by(request, count, 4)
    }

    fn count_by(
        &self,
        request: &Request,
        count: usize,
        parallel: usize,
    ) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for reply in self
            .client
            .requests(self.web(), &self.host(), request, count, parallel)
        {
            let key = match reply {
                Ok(reply) if reply.status == 200 => reply.body,
                Ok(reply) => format!("status {}", reply.status),
                Err(e) => format!("error {e}"),
            };
            *out.entry(key).or_default() += 1;
        }
        out
    }
}

/// Whether `observed` of `n` trials lies within the two-sided p < 0.001 interval of a binomial
/// with probability `p` (normal approximation, good at these sizes: n·p·(1−p) ≥ 100).
fn within_binomial(observed: usize, n: usize, p: f64) -> bool {
    let mean = n as f64 * p;
    let sd = (n as f64 * p * (1.0 - p)).sqrt();
    (observed as f64 - mean).abs() <= Z_999 * sd
}

fn split(fx: &Fixture) {
    let (_, took) = fx.rules("split", &[to(&[("blue", 90), ("green", 10)])]);
    let n = 2000;
    let counts = fx.count(&Request::get("/"), n);
    let green = counts.get("green").copied().unwrap_or(0);
    let blue = counts.get("blue").copied().unwrap_or(0);
    assert_eq!(blue + green, n, "failures or other backends: {counts:?}");
    assert!(
        within_binomial(green, n, 0.1),
        "{green} of {n} to green is outside the p<0.001 bounds of 10 %: {counts:?}"
    );
    println!(
        "[{}] 90/10 split: {counts:?} of {n} (rule in Envoy {took:?} after the write)",
        fx.source.name()
    );
}

fn header_match(fx: &Fixture) {
    fx.rules(
        "header",
        &[
            to(&[("green", 1)]).when(vec![header("x-release", "green")]),
            to(&[("blue", 90), ("green", 10)]),
        ],
    );
    let with = fx.count(&Request::get("/").header("x-release", "green"), 200);
    assert_eq!(with.get("green"), Some(&200), "with the header: {with:?}");
    let without = fx.count(&Request::get("/").header("x-release", "blue"), 400);
    assert_eq!(
        without.values().sum::<usize>(),
        without.get("blue").unwrap_or(&0) + without.get("green").unwrap_or(&0),
        "{without:?}"
    );
    assert!(
        without.get("blue").copied().unwrap_or(0) > 300,
        "without the header, the split: {without:?}"
    );
    println!(
        "[{}] header match: with {with:?}, without {without:?}",
        fx.source.name()
    );
}

fn live_flip(fx: &Fixture) {
    let only = |backend: &str| format!("\"cluster\":\"{backend}.shop.system.internal|{PORT}\"");
    fx.rules_then("flip", &[to(&[("blue", 100), ("green", 0)])], &only("blue"));
    let (blue, green) = (fx.backend("blue"), fx.backend("green"));
    let load = fx.client.load(fx.web(), &fx.host(), PACE);
    let green_before = green.stats().served();
    let blue_before = blue.stats().served();
    wait::until("the stream to reach blue", Duration::from_secs(10), || {
        (blue.stats().served() > blue_before + 50)
            .then_some(())
            .ok_or_else(|| "not yet".to_string())
    })
    .unwrap();
    assert_eq!(
        green.stats().served(),
        green_before,
        "green got traffic at 100/0"
    );

    let (changed_at, took) = fx.rules_then(
        "flip",
        &[to(&[("blue", 0), ("green", 100)])],
        &only("green"),
    );
    // Keep the stream going past the bar, so a straggler would be seen.
    let green_now = green.stats().served();
    wait::until(
        "the stream on green past the bar",
        Duration::from_secs(10),
        || {
            (changed_at.elapsed() > 2 * FOLLOW && green.stats().served() > green_now + 100)
                .then_some(())
                .ok_or_else(|| "not yet".to_string())
        },
    )
    .unwrap();
    let report = load.stop();
    report.assert_no_failures();
    assert_eq!(
        report.by_backend().keys().collect::<Vec<_>>(),
        ["blue", "green"],
        "a request went elsewhere during the flip"
    );
    let last_blue = blue.stats().last().unwrap();
    let blue_after = last_blue.saturating_duration_since(changed_at);
    assert!(
        blue_after < FOLLOW,
        "blue got a request {blue_after:?} after the flip"
    );
    let first = report.outcomes.first().unwrap().at;
    let last = report.outcomes.last().unwrap().at;
    let rate = report.outcomes.len() as f64 / last.duration_since(first).as_secs_f64();
    assert!(rate >= 100.0, "the load was only {rate:.0} requests/s");
    println!(
        "[{}] flip under {rate:.0} req/s: {} requests, 0 failed; Envoy held the flip {took:?} \
         after the write; blue's last request {blue_after:?} after it; by backend {:?}",
        fx.source.name(),
        report.outcomes.len(),
        report.by_backend()
    );
}

/// One request at a time, so the backend's every-other failure is what each request meets: its
/// first try fails or succeeds, and a retry meets the other answer.
fn retries(fx: &Fixture) {
    fx.rules("no-retry", &[to(&[("flaky", 1)])]);
    let without = fx.count_by(&Request::get("/"), 1000, 1);
    let failed = without.get("status 503").copied().unwrap_or(0);
    assert!(
        (400..=600).contains(&failed),
        "without retries about half should fail: {without:?}"
    );
    fx.rules(
        "retry",
        &[Rule {
            retries: Some(3),
            ..to(&[("flaky", 1)])
        }],
    );
    let with = fx.count_by(&Request::get("/"), 1000, 1);
    let ok = with.get("flaky").copied().unwrap_or(0);
    assert!(ok >= 990, "with 3 retries on 503: {with:?}");
    println!(
        "[{}] retries: without {without:?}, with 3 retries {with:?}",
        fx.source.name()
    );
}

fn timeout(fx: &Fixture) {
    fx.rules(
        "timeout",
        &[Rule {
            timeout: Some("500ms"),
            ..to(&[("slow", 1)])
        }],
    );
    let reply = fx.send(&Request::get("/"));
    assert_eq!(reply.status, 504, "{reply:?}");
    // Envoy starts the timer from its event loop's cached clock, read before the loop last
    // slept, so it can fire some milliseconds before our clock says 500 ms; 450 ms is far
    // from the backend's 2 s and from no timeout at all.
    assert!(
        reply.took >= Duration::from_millis(450) && reply.took <= Duration::from_millis(800),
        "504 after {:?}",
        reply.took
    );
    println!("[{}] timeout: 504 after {:?}", fx.source.name(), reply.took);
}

fn header_edits(fx: &Fixture) {
    fx.rules(
        "edits",
        &[Rule {
            set: vec![("X-Header-Set", "set-overwrites-values")],
            add: vec![("X-Header-Add", "add-appends-values")],
            remove: vec!["X-Header-Remove"],
            ..to(&[("v1", 1)])
        }],
    );
    let reply = fx.send(
        &Request::get("/edits-probe")
            .header("x-header-set", "some-other-value")
            .header("x-header-add", "some-other-value")
            .header("x-header-remove", "val")
            .header("Some-Other-Header", "val"),
    );
    assert_eq!((reply.status, reply.body.as_str()), (200, "v1"));
    let head = fx
        .backend("v1")
        .stats()
        .heads()
        .into_iter()
        .rev()
        .find(|h| h.starts_with("GET /edits-probe"))
        .expect("the probe reached v1");
    let values = |name: &str| -> Vec<String> {
        head.lines()
            .filter_map(|l| l.split_once(':'))
            .filter(|(n, _)| n.trim().eq_ignore_ascii_case(name))
            .flat_map(|(_, v)| {
                v.split(',')
                    .map(|v| v.trim().to_string())
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    assert_eq!(values("x-header-set"), ["set-overwrites-values"], "{head}");
    assert_eq!(
        values("x-header-add"),
        ["some-other-value", "add-appends-values"],
        "{head}"
    );
    assert!(values("x-header-remove").is_empty(), "{head}");
    assert_eq!(values("some-other-header"), ["val"], "{head}");
    println!("[{}] header edits reached v1 as expected", fx.source.name());
}

fn matching(fx: &Fixture) {
    fx.rules(
        "matching",
        &[
            to(&[("v1", 1)]).when(vec![prefix("/"), header("version", "one")]),
            to(&[("v2", 1)]).when(vec![prefix("/v2"), header("version", "two")]),
        ],
    );
    let cases: [(&str, Option<&str>, &str); 9] = [
        ("/", None, "v1"),
        ("/example", None, "v1"),
        ("/", Some("one"), "v1"),
        ("/v2", None, "v2"),
        ("/v2/example", None, "v2"),
        ("/", Some("two"), "v2"),
        ("/v2/", None, "v2"),
        ("/v2example", None, "v1"),
        ("/foo/v2/example", None, "v1"),
    ];
    for (path, version, expected) in cases {
        let mut request = Request::get(path);
        if let Some(version) = version {
            request = request.header("version", version);
        }
        let reply = fx.send(&request);
        assert_eq!(
            (reply.status, reply.body.as_str()),
            (200, expected),
            "{path} version {version:?}"
        );
    }

    fx.rules(
        "query",
        &[
            to(&[("v1", 1)]).when(vec![query("animal", "whale")]),
            to(&[("v2", 1)]).when(vec![query("animal", "dolphin")]),
            to(&[("v1", 1)]).when(vec![prefix("/path5")]),
        ],
    );
    let cases: [(&str, u16, &str); 6] = [
        ("/?animal=whale", 200, "v1"),
        ("/?animal=dolphin", 200, "v2"),
        ("/?animal=whale&otherparam=irrelevant", 200, "v1"),
        ("/?color=blue", 404, ""),
        ("/?animal=whaledolphin", 404, ""),
        ("/path5?animal=dolphin", 200, "v1"),
    ];
    for (path, status, expected) in cases {
        let reply = fx.send(&Request::get(path));
        assert_eq!(reply.status, status, "{path}: {reply:?}");
        if status == 200 {
            assert_eq!(reply.body, expected, "{path}");
        }
    }
    println!(
        "[{}] matching: 9 precedence and 6 query cases as the conformance tests expect",
        fx.source.name()
    );
}

/// The largest path regex the agent takes: `/` and `[a-z]{0,n}` compile to at most
/// 2 * (1 + 2n + 4) RE2 instructions by the agent's bound, 998 for n = 247, under its 1000.
const LARGEST_REGEX: &str = "/[a-z]{0,247}";
/// One repetition more: 1002, refused.
const TOO_LARGE_REGEX: &str = "/[a-z]{0,248}";

fn regexes(fx: &Fixture) {
    fx.rules(
        "regex",
        &[
            to(&[("v1", 1)]).when(vec![regex(LARGEST_REGEX)]),
            to(&[("v2", 1)]).when(vec![prefix("/")]),
        ],
    );
    for (path, expected) in [("/abc", "v1"), ("/", "v1"), ("/a1", "v2"), ("/ABC", "v2")] {
        let reply = fx.send(&Request::get(path));
        assert_eq!(
            (reply.status, reply.body.as_str()),
            (200, expected),
            "{path}"
        );
    }
    // Envoy's warning level is the agent's bound: RE2 found the program no larger.
    let stats = fx.client.envoy_admin("/stats?filter=^re2\\.").unwrap();
    assert!(
        !stats
            .lines()
            .any(|l| l.starts_with("re2.exceeded_warn_level: ") && !l.ends_with(" 0")),
        "{stats}"
    );

    // One repetition more is refused, and alone: the port's route configuration keeps
    // serving what it had, and the refusal says why.
    let good = fx.source.route_names("regex", 2);
    match &fx.source {
        Source::File(_) => {
            fx.source.set_rules(
                &fx.backends,
                "regex",
                &[
                    to(&[("v1", 1)]).when(vec![regex(TOO_LARGE_REGEX)]),
                    to(&[("v2", 1)]).when(vec![prefix("/")]),
                ],
            );
            wait::until("the edit refused", Duration::from_secs(20), || {
                let mesh = fx.agent.mesh().map_err(|e| e.to_string())?;
                let reason = mesh["providers"][0]["stale"]["reason"].to_string();
                if reason.contains("at most 1000") {
                    Ok(())
                } else {
                    Err(reason)
                }
            })
            .unwrap();
        }
        Source::Kube { server, .. } => {
            server
                .apply_json(http_route(
                    "shop",
                    "too-large",
                    json!([service_parent("web", None)]),
                    json!([to(&[("v2", 1)])
                        .when(vec![regex(TOO_LARGE_REGEX)])
                        .gateway()]),
                ))
                .unwrap();
            wait::until("the route refused", Duration::from_secs(20), || {
                let (_, body) = fx.agent.get("/debug/routes").map_err(|e| e.to_string())?;
                let routes: Value = serde_json::from_str(&body).map_err(|e| e.to_string())?;
                let refused = routes["rejected"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|r| r["route"] == "HTTPRoute shop/too-large");
                match refused {
                    Some(r) if r["reason"].to_string().contains("at most 1000") => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            })
            .unwrap();
            server
                .delete::<gateway_api::experimental::httproutes::HttpRoute>("shop", "too-large")
                .unwrap();
        }
    }
    fx.wait_routes(&good, LARGEST_REGEX.trim_start_matches('/'));
    assert_eq!(fx.send(&Request::get("/abc")).body, "v1");
    let (_, metrics) = fx.agent.get("/metrics").unwrap();
    assert!(
        !metrics
            .lines()
            .any(|l| l.starts_with("lattice_xds_nacks_total") && !l.ends_with(" 0")),
        "no proxy NACKed a route configuration:\n{metrics}"
    );
    println!(
        "[{}] regexes: the largest accepted ({LARGEST_REGEX}) ACKed and matched by Envoy; \
         {TOO_LARGE_REGEX} refused alone",
        fx.source.name()
    );
}

fn rules_removed(fx: &Fixture) {
    fx.rules("back", &[to(&[("blue", 1)])]);
    assert_eq!(fx.send(&Request::get("/")).body, "blue");
    let (_, took) = fx.rules("none", &[]);
    let counts = fx.count(&Request::get("/"), 20);
    assert_eq!(counts.get("web"), Some(&20), "{counts:?}");
    println!(
        "[{}] rules removed: plain routing to web's own endpoint, {took:?} after the write",
        fx.source.name()
    );
}

fn scenarios(fx: &Fixture) {
    split(fx);
    header_match(fx);
    live_flip(fx);
    retries(fx);
    timeout(fx);
    header_edits(fx);
    matching(fx);
    regexes(fx);
    rules_removed(fx);
}

#[test]
fn traffic_rules_from_the_mesh_file() {
    let _one = ONE_NODE.lock().unwrap_or_else(|p| p.into_inner());
    let fx = Fixture::build("tr-file", false);
    scenarios(&fx);
}

#[test]
fn traffic_rules_from_httproutes() {
    let _one = ONE_NODE.lock().unwrap_or_else(|p| p.into_inner());
    let fx = Fixture::build("tr-kube", true);
    scenarios(&fx);
}
