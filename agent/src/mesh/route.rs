//! HTTP routing rules: what a service that carries rules does with a request sent to it —
//! which requests a rule takes (matches), where it sends them (weighted backends, other mesh
//! services), and how (timeout, retries, request header edits).
//!
//! The semantics are those of the Gateway API's HTTPRoute (and GRPCRoute, which maps onto the
//! same model), whatever the source: several matches in a rule are OR-ed, the conditions of one
//! match AND-ed; a request goes to the first matching rule in [precedence](RouteTable) order;
//! a service with rules answers 404 to a request no rule matches; a rule whose backends all
//! weigh 0 (or that has none) answers 500, and the share of a backend that cannot be resolved
//! answers 500 as well.

use std::cmp::{Ordering, Reverse};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use super::MeshPath;

/// Where a rule was written.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(tag = "source", rename_all = "lowercase")]
pub enum RuleSource {
    /// The mesh file: the rule's index in its service's `routes:` and its name, if any.
    File { rule: usize, name: Option<String> },
    /// A Gateway API route object (`HTTPRoute` or `GRPCRoute`) and the rule's index in it.
    Kubernetes {
        kind: String,
        namespace: String,
        name: String,
        rule: usize,
    },
}

impl fmt::Display for RuleSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RuleSource::File {
                rule,
                name: Some(name),
            } => write!(f, "mesh file rule {rule} ({name})"),
            RuleSource::File { rule, name: None } => write!(f, "mesh file rule {rule}"),
            RuleSource::Kubernetes {
                kind,
                namespace,
                name,
                rule,
            } => write!(f, "{kind} {namespace}/{name} rule {rule}"),
        }
    }
}

/// How a request's path must look.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PathMatch {
    /// The whole path, case-sensitive, query string aside.
    Exact(String),
    /// A prefix of whole path segments: `/api` takes `/api` and `/api/x`, not `/apix`. A
    /// trailing `/` in the prefix is not significant.
    Prefix(String),
    /// A regular expression (RE2 syntax) the whole path must match.
    Regex(String),
}

impl PathMatch {
    /// What every request matches.
    pub fn any() -> PathMatch {
        PathMatch::Prefix("/".to_string())
    }
}

/// How a header or query parameter value must look.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ValueMatch {
    Exact(String),
    /// A regular expression (RE2 syntax) the whole value must match.
    Regex(String),
    /// Present, whatever its value.
    Present,
}

/// A condition on one header (name case-insensitive) or query parameter (name exact).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct ValueCondition {
    pub name: String,
    pub value: ValueMatch,
}

/// One way a request can match a rule: every condition must hold.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct RequestMatch {
    pub path: PathMatch,
    /// An HTTP method, upper case.
    pub method: Option<String>,
    pub headers: Vec<ValueCondition>,
    pub query: Vec<ValueCondition>,
}

impl RequestMatch {
    /// The match a rule without matches has: every request.
    pub fn any() -> RequestMatch {
        RequestMatch {
            path: PathMatch::any(),
            method: None,
            headers: Vec::new(),
            query: Vec::new(),
        }
    }

    /// The Gateway API's precedence between matches, most specific first: an exact path, then
    /// a regular expression (the specification leaves its place to implementations), then the
    /// longest prefix; then a method; then more header conditions; then more query conditions.
    fn specificity(&self) -> impl Ord {
        let (rank, prefix_len) = match &self.path {
            PathMatch::Exact(_) => (0, 0),
            PathMatch::Regex(_) => (1, 0),
            PathMatch::Prefix(prefix) => (2, prefix.trim_end_matches('/').len()),
        };
        (
            rank,
            Reverse(prefix_len),
            self.method.is_none(),
            Reverse(self.headers.len()),
            Reverse(self.query.len()),
        )
    }
}

/// Where a share of a rule's traffic goes.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum BackendTarget {
    /// Another mesh service's port (its endpoints: backends are not routed again).
    Service { path: MeshPath, port: u16 },
    /// A backend the source could not resolve (a missing service, a reference not allowed):
    /// its share of the traffic answers 500.
    Unresolved { reason: String },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Backend {
    pub target: BackendTarget,
    /// A share of the rule's traffic: weight over the sum of the rule's weights. 0 sends none.
    pub weight: u32,
}

/// The most a backend may weigh (the Gateway API's bound).
pub const MAX_WEIGHT: u32 = 1_000_000;

/// Tries after the first when a rule asks for retries but not how many.
pub const DEFAULT_RETRY_ATTEMPTS: u32 = 2;

/// What is retried when a rule asks for retries but not on what: failures of the connection,
/// which the Gateway API asks every retry to cover.
pub const DEFAULT_RETRY_ON: [RetryOn; 3] = [
    RetryOn::ConnectFailure,
    RetryOn::RefusedStream,
    RetryOn::Reset,
];

/// When a failed attempt is tried again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RetryOn {
    /// Any 5xx answer, and no answer at all.
    #[serde(rename = "5xx")]
    ServerError,
    /// 502, 503 and 504, and no answer at all.
    GatewayError,
    /// The connection to the backend could not be made.
    ConnectFailure,
    /// The backend reset or closed the connection, or did not answer in time.
    Reset,
    /// An HTTP/2 backend refused the stream.
    RefusedStream,
}

impl RetryOn {
    pub const ALL: [RetryOn; 5] = [
        RetryOn::ServerError,
        RetryOn::GatewayError,
        RetryOn::ConnectFailure,
        RetryOn::Reset,
        RetryOn::RefusedStream,
    ];

    /// The name in the mesh file, which is also Envoy's.
    pub fn as_str(self) -> &'static str {
        match self {
            RetryOn::ServerError => "5xx",
            RetryOn::GatewayError => "gateway-error",
            RetryOn::ConnectFailure => "connect-failure",
            RetryOn::Reset => "reset",
            RetryOn::RefusedStream => "refused-stream",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct RetryPolicy {
    /// Tries after the first.
    pub attempts: u32,
    pub on: Vec<RetryOn>,
    /// Answers with these statuses are tried again too.
    pub codes: Vec<u16>,
    /// The base of the wait between tries: Envoy waits a random time below (2^n − 1) times
    /// this before the n-th retry, at most ten times this.
    #[serde(with = "millis_opt")]
    pub backoff: Option<Duration>,
}

/// Edits to the request's headers before it is sent to a backend.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize)]
pub struct HeaderEdits {
    /// Replace every value of the header with this one (or add it).
    pub set: Vec<(String, String)>,
    /// Add this value after any the request has.
    pub add: Vec<(String, String)>,
    pub remove: Vec<String>,
}

impl HeaderEdits {
    pub fn is_empty(&self) -> bool {
        self.set.is_empty() && self.add.is_empty() && self.remove.is_empty()
    }
}

/// One routing rule of a service.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct RouteRule {
    pub source: RuleSource,
    /// Breaks ties between rules whose matches are equally specific: the Gateway API's
    /// creation time (seconds since the epoch; none for the mesh file), then the route's
    /// `namespace/name`, then the rule's index in it.
    pub order: (Option<i64>, String, usize),
    /// The service port the rule applies to; every HTTP port when `None`.
    pub port: Option<u16>,
    /// At least one (a rule written without matches takes every request).
    pub matches: Vec<RequestMatch>,
    pub backends: Vec<Backend>,
    /// The whole request, retries included; zero disables it. `None`: Envoy's default (15 s).
    #[serde(with = "millis_opt")]
    pub timeout: Option<Duration>,
    /// Each attempt.
    #[serde(with = "millis_opt")]
    pub backend_timeout: Option<Duration>,
    /// `None`: the mesh's default, which retries only what cannot have reached the backend.
    pub retry: Option<RetryPolicy>,
    pub request_headers: HeaderEdits,
}

impl RouteRule {
    pub fn applies_to(&self, port: u16) -> bool {
        self.port.is_none_or(|p| p == port)
    }

    /// Whether no backend would get traffic: then every request the rule takes answers 500.
    pub fn sends_nowhere(&self) -> bool {
        self.backends.iter().all(|b| b.weight == 0)
    }
}

/// The rules of one service, as the snapshot shares them.
pub type Rules = Arc<[RouteRule]>;

/// The matches of a service's rules that apply to one port, in the order a proxy must try
/// them: the first that matches a request decides.
pub struct RouteTable<'a> {
    pub entries: Vec<(&'a RequestMatch, &'a RouteRule)>,
}

impl<'a> RouteTable<'a> {
    pub fn new(rules: &'a [RouteRule], port: u16) -> RouteTable<'a> {
        let mut entries: Vec<(usize, &RequestMatch, &RouteRule)> = rules
            .iter()
            .filter(|rule| rule.applies_to(port))
            .flat_map(|rule| {
                rule.matches
                    .iter()
                    .enumerate()
                    .map(move |(i, m)| (i, m, rule))
            })
            .collect();
        entries.sort_by(|(ia, a, ra), (ib, b, rb)| {
            a.specificity()
                .cmp(&b.specificity())
                .then_with(|| ra.order.cmp(&rb.order))
                .then_with(|| ia.cmp(ib))
        });
        RouteTable {
            entries: entries.into_iter().map(|(_, m, r)| (m, r)).collect(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// A regular expression a proxy can run: RE2 syntax, which the `regex` crate shares.
pub fn check_regex(pattern: &str) -> Result<(), String> {
    regex::Regex::new(pattern)
        .map(drop)
        .map_err(|e| format!("{pattern:?} is not a valid regular expression: {e}"))
}

/// A service's rule, or a whole route, that a source refused, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RejectedRoute {
    /// What was refused: `HTTPRoute shop/canary`, say.
    pub route: String,
    /// The parent service it was meant for, when known.
    pub parent: Option<String>,
    pub reason: String,
}

impl PartialOrd for RejectedRoute {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for RejectedRoute {
    fn cmp(&self, other: &Self) -> Ordering {
        (&self.route, &self.parent, &self.reason).cmp(&(&other.route, &other.parent, &other.reason))
    }
}

/// Durations as milliseconds in `/debug` JSON.
mod millis_opt {
    use std::time::Duration;

    use serde::Serializer;

    pub fn serialize<S: Serializer>(value: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(d) => s.serialize_some(&(d.as_millis() as u64)),
            None => s.serialize_none(),
        }
    }
}

/// Rules for tests: the `index`th rule of a mesh file, with nothing but matches and backends.
#[cfg(test)]
pub fn test_rule(index: usize, matches: Vec<RequestMatch>, backends: Vec<Backend>) -> RouteRule {
    RouteRule {
        source: RuleSource::File {
            rule: index,
            name: None,
        },
        order: (None, String::new(), index),
        port: None,
        matches,
        backends,
        timeout: None,
        backend_timeout: None,
        retry: None,
        request_headers: HeaderEdits::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(index: usize, matches: Vec<RequestMatch>) -> RouteRule {
        test_rule(index, matches, Vec::new())
    }

    fn path(path: PathMatch) -> RequestMatch {
        RequestMatch {
            path,
            ..RequestMatch::any()
        }
    }

    fn header(name: &str, value: &str) -> ValueCondition {
        ValueCondition {
            name: name.to_string(),
            value: ValueMatch::Exact(value.to_string()),
        }
    }

    #[test]
    fn precedence_is_exact_regex_longest_prefix_method_headers_query_then_order() {
        let prefix = |p: &str| path(PathMatch::Prefix(p.to_string()));
        let rules = vec![
            rule(0, vec![prefix("/")]),
            rule(
                1,
                vec![RequestMatch {
                    headers: vec![header("version", "two")],
                    ..prefix("/")
                }],
            ),
            rule(
                2,
                vec![prefix("/v2/"), path(PathMatch::Exact("/v2".into()))],
            ),
            rule(3, vec![path(PathMatch::Regex("/v[0-9]".into()))]),
            rule(
                4,
                vec![RequestMatch {
                    method: Some("GET".into()),
                    ..prefix("/")
                }],
            ),
            rule(
                5,
                vec![RequestMatch {
                    query: vec![header("animal", "whale")],
                    ..prefix("/")
                }],
            ),
            rule(6, vec![prefix("/")]),
        ];
        let table = RouteTable::new(&rules, 8080);
        let order: Vec<(usize, &PathMatch)> = table
            .entries
            .iter()
            .map(|(m, r)| (r.order.2, &m.path))
            .collect();
        assert_eq!(
            order.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            [2, 3, 2, 4, 1, 5, 0, 6],
            "{order:?}"
        );
    }

    #[test]
    fn rules_for_other_ports_are_left_out() {
        let mut on_80 = rule(0, vec![RequestMatch::any()]);
        on_80.port = Some(80);
        let rules = vec![on_80, rule(1, vec![RequestMatch::any()])];
        assert_eq!(RouteTable::new(&rules, 80).entries.len(), 2);
        assert_eq!(RouteTable::new(&rules, 8080).entries.len(), 1);
    }

    #[test]
    fn regexes_are_checked() {
        assert!(check_regex("/v[0-9]+").is_ok());
        assert!(check_regex("/v[0-9").unwrap_err().contains("/v[0-9"));
    }
}
