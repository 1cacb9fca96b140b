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

use serde::{Deserialize, Serialize};

use super::MeshPath;

mod re2;

/// Why a rule's part is not one the mesh can serve; the sources prefix the field it came from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    #[error("{0:?} must start with '/'")]
    NotAbsolute(String),
    #[error("{pattern:?} is not a regular expression Envoy's RE2 reads: {reason}")]
    Regex { pattern: String, reason: String },
    #[error(
        "{pattern:?} compiles to an RE2 program of up to {size} instructions; the mesh takes \
         at most {limit} (a shorter pattern, fewer or smaller repetitions)"
    )]
    RegexTooLarge {
        pattern: String,
        size: u64,
        limit: u64,
    },
    #[error("attempts: {0} is out of range 0-{MAX_RETRY_ATTEMPTS}")]
    RetryAttempts(i64),
    #[error("codes[{index}]: {code} is not an HTTP status 400-599")]
    RetryCode { index: usize, code: i64 },
    #[error("give at least one condition (on) or status (codes) to retry")]
    RetryNothing,
}

/// The most of a pattern an error quotes: patterns come from tenants, and a log line or a
/// `/debug` view must not grow with them.
const QUOTED_PATTERN: usize = 120;

fn quoted(pattern: &str) -> String {
    match pattern.char_indices().nth(QUOTED_PATTERN) {
        Some((end, _)) => format!("{}…", &pattern[..end]),
        None => pattern.to_string(),
    }
}

/// Where a rule was written.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
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
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
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

    pub fn exact(path: &str) -> Result<PathMatch, RuleError> {
        absolute(path)?;
        Ok(PathMatch::Exact(path.to_string()))
    }

    /// A prefix, without the trailing `/`s that do not change what it matches.
    pub fn prefix(prefix: &str) -> Result<PathMatch, RuleError> {
        absolute(prefix)?;
        let trimmed = prefix.trim_end_matches('/');
        Ok(PathMatch::Prefix(if trimmed.is_empty() {
            "/".to_string()
        } else {
            trimmed.to_string()
        }))
    }

    pub fn regex(pattern: &str) -> Result<PathMatch, RuleError> {
        check_regex(pattern)?;
        Ok(PathMatch::Regex(pattern.to_string()))
    }
}

fn absolute(path: &str) -> Result<(), RuleError> {
    if path.starts_with('/') {
        Ok(())
    } else {
        Err(RuleError::NotAbsolute(quoted(path)))
    }
}

/// How a header or query parameter value must look.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ValueMatch {
    Exact(String),
    /// A regular expression (RE2 syntax) the whole value must match.
    Regex(String),
    /// Present, whatever its value.
    Present,
}

impl ValueMatch {
    pub fn regex(pattern: &str) -> Result<ValueMatch, RuleError> {
        check_regex(pattern)?;
        Ok(ValueMatch::Regex(pattern.to_string()))
    }
}

/// A condition on one header (name case-insensitive) or query parameter (name exact).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ValueCondition {
    pub name: String,
    pub value: ValueMatch,
}

/// One way a request can match a rule: every condition must hold.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
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
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum BackendTarget {
    /// Another mesh service's port (its endpoints: backends are not routed again).
    Service { path: MeshPath, port: u16 },
    /// A backend the source could not resolve (a missing service, a reference not allowed):
    /// its share of the traffic answers 500.
    Unresolved { reason: String },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Backend {
    pub target: BackendTarget,
    /// A share of the rule's traffic: weight over the sum of the rule's weights. 0 sends none.
    pub weight: u32,
}

/// The most a backend may weigh (the Gateway API's bound).
pub const MAX_WEIGHT: u32 = 1_000_000;

/// Tries after the first when a rule asks for retries but not how many.
pub const DEFAULT_RETRY_ATTEMPTS: u32 = 2;

/// The most tries after the first a rule may ask for.
pub const MAX_RETRY_ATTEMPTS: u32 = 100;

/// What is retried when a rule asks for retries but not on what: failures of the connection,
/// which the Gateway API asks every retry to cover.
pub const DEFAULT_RETRY_ON: [RetryOn; 3] = [
    RetryOn::ConnectFailure,
    RetryOn::RefusedStream,
    RetryOn::Reset,
];

/// When a failed attempt is tried again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
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

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
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

impl RetryPolicy {
    /// A rule's retries: `attempts` defaults to [`DEFAULT_RETRY_ATTEMPTS`], `on` to
    /// [`DEFAULT_RETRY_ON`]; `codes` are statuses 400-599. Conditions are kept sorted, once each.
    pub fn new(
        attempts: Option<i64>,
        on: Option<Vec<RetryOn>>,
        codes: &[i64],
        backoff: Option<Duration>,
    ) -> Result<RetryPolicy, RuleError> {
        let attempts = match attempts {
            None => DEFAULT_RETRY_ATTEMPTS,
            Some(n) => u32::try_from(n)
                .ok()
                .filter(|n| *n <= MAX_RETRY_ATTEMPTS)
                .ok_or(RuleError::RetryAttempts(n))?,
        };
        let mut on = on.unwrap_or_else(|| DEFAULT_RETRY_ON.to_vec());
        on.sort();
        on.dedup();
        let codes = codes
            .iter()
            .enumerate()
            .map(|(index, &code)| {
                u16::try_from(code)
                    .ok()
                    .filter(|c| (400..=599).contains(c))
                    .ok_or(RuleError::RetryCode { index, code })
            })
            .collect::<Result<Vec<_>, _>>()?;
        if on.is_empty() && codes.is_empty() {
            return Err(RuleError::RetryNothing);
        }
        Ok(RetryPolicy {
            attempts,
            on,
            codes,
            backoff,
        })
    }
}

/// Edits to the request's headers before it is sent to a backend.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
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
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
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

/// A regular expression every proxy runs: RE2's syntax, and a program no larger than
/// [`lattice_contract::REGEX_PROGRAM_SIZE`] (bounded from above: [`re2`]). Refused here, a
/// pattern refuses its rule; sent to Envoy, it would have refused the whole route
/// configuration of its port, for every service on it.
pub fn check_regex(pattern: &str) -> Result<(), RuleError> {
    let size = re2::program_size(pattern).map_err(|reason| RuleError::Regex {
        pattern: quoted(pattern),
        reason,
    })?;
    let limit = lattice_contract::REGEX_PROGRAM_SIZE;
    if size > limit {
        return Err(RuleError::RegexTooLarge {
            pattern: quoted(pattern),
            size,
            limit,
        });
    }
    Ok(())
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

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Duration>, D::Error> {
        <Option<u64> as serde::Deserialize>::deserialize(d).map(|ms| ms.map(Duration::from_millis))
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
    fn regexes_are_checked_against_re2_and_the_size_limit() {
        assert!(check_regex("/v[0-9]+").is_ok());
        let err = check_regex("/v[0-9").unwrap_err().to_string();
        assert!(err.contains("\"/v[0-9\""), "{err}");
        let err = check_regex("[a&&b]").unwrap_err().to_string();
        assert!(err.contains("RE2 has no class set operations"), "{err}");
        // The limit: [a-z]{0,n} costs 2n instructions, doubled, and 8 more.
        let limit = lattice_contract::REGEX_PROGRAM_SIZE;
        let largest = (limit - 8) / 4;
        assert!(check_regex(&format!("[a-z]{{0,{largest}}}")).is_ok());
        let err = check_regex(&format!("[a-z]{{0,{}}}", largest + 1))
            .unwrap_err()
            .to_string();
        assert!(err.contains(&format!("at most {limit}")), "{err}");
        // A tenant-sized pattern is quoted in part.
        let long = "a".repeat(10_000) + "[";
        let err = check_regex(&long).unwrap_err().to_string();
        assert!(err.len() < 400, "{err}");
    }

    #[test]
    fn prefixes_lose_their_trailing_slashes_and_paths_must_be_absolute() {
        assert_eq!(
            PathMatch::prefix("/api/").unwrap(),
            PathMatch::Prefix("/api".into())
        );
        assert_eq!(PathMatch::prefix("///").unwrap(), PathMatch::any());
        assert_eq!(
            PathMatch::exact("api"),
            Err(RuleError::NotAbsolute("api".into()))
        );
        assert!(PathMatch::prefix("api").is_err());
    }

    #[test]
    fn retry_policies_default_and_check_their_parts() {
        let policy = RetryPolicy::new(None, None, &[503], None).unwrap();
        assert_eq!(policy.attempts, DEFAULT_RETRY_ATTEMPTS);
        let mut defaults = DEFAULT_RETRY_ON.to_vec();
        defaults.sort();
        assert_eq!(policy.on, defaults);
        assert_eq!(policy.codes, [503]);
        assert_eq!(
            RetryPolicy::new(Some(101), None, &[], None),
            Err(RuleError::RetryAttempts(101))
        );
        assert_eq!(
            RetryPolicy::new(Some(-1), None, &[], None),
            Err(RuleError::RetryAttempts(-1))
        );
        assert_eq!(
            RetryPolicy::new(None, None, &[200], None),
            Err(RuleError::RetryCode {
                index: 0,
                code: 200
            })
        );
        assert_eq!(
            RetryPolicy::new(None, Some(Vec::new()), &[], None),
            Err(RuleError::RetryNothing)
        );
        let on = RetryPolicy::new(
            Some(0),
            Some(vec![RetryOn::Reset, RetryOn::ServerError, RetryOn::Reset]),
            &[],
            None,
        )
        .unwrap();
        assert_eq!(on.on, [RetryOn::ServerError, RetryOn::Reset]);
    }
}
