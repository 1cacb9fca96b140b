//! Gateway API routes for a mesh (the GAMMA binding): `HTTPRoute` and `GRPCRoute` objects whose
//! `parentRefs` name a core Service, and the `ReferenceGrant`s that let a route send traffic to
//! a Service in another namespace.
//!
//! Routes are mapped as they arrive into [`RouteEntry`]s: the rules in the mesh model's terms,
//! with the parents and backends still as Kubernetes references, because those resolve against
//! Services that come and go. [`RouteIndex`] keeps the entries and the grants, knows which
//! parents a change touches, and resolves a parent's rules and every rejection on demand.
//!
//! What a route may bind to, and what is refused with a reason (never half-applied):
//! - a parent must be a Service in the route's own namespace (a producer route); consumer
//!   routes, from another namespace, need a view per client namespace that the agent does not
//!   build yet;
//! - the parent must hold its mesh path and have only HTTP ports (a Service with a TCP port is
//!   reached by an address of its own and proxied as TCP), and a `port` must be one of its ports;
//! - a GRPCRoute and an HTTPRoute on the same Service port: the GRPCRoute wins, as the Gateway
//!   API orders route kinds;
//! - a rule the agent cannot express (a filter it does not implement, a bad regular expression
//!   or duration) rejects the whole route.
//!
//! A backend that does not resolve (no such Service or port, a kind other than Service, another
//! namespace without a ReferenceGrant that allows it) does not reject its route: its share of the
//! traffic answers 500, as the Gateway API specifies.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use gateway_api::experimental::httproutes::{
    HttpRoute, HttpRouteRules, HttpRouteRulesFiltersType, HttpRouteRulesMatches,
    HttpRouteRulesMatchesHeadersType, HttpRouteRulesMatchesPathType,
    HttpRouteRulesMatchesQueryParamsType,
};
use gateway_api::grpcroutes::{
    GrpcRoute, GrpcRouteRules, GrpcRouteRulesFiltersType, GrpcRouteRulesMatches,
    GrpcRouteRulesMatchesHeadersType, GrpcRouteRulesMatchesMethodType,
};
use gateway_api::referencegrants::ReferenceGrant;
use k8s_openapi::jiff::Timestamp;
use serde::Serialize;

use super::mapping::{ObjectKey, ServiceEntry};
use crate::mesh::route::{
    Backend, BackendTarget, DEFAULT_RETRY_ATTEMPTS, DEFAULT_RETRY_ON, HeaderEdits, PathMatch,
    RejectedRoute, RequestMatch, RetryPolicy, RouteRule, RuleSource, ValueCondition, ValueMatch,
    check_regex,
};

/// The API group of every Gateway API kind.
pub const GATEWAY_GROUP: &str = "gateway.networking.k8s.io";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum RouteKind {
    #[serde(rename = "HTTPRoute")]
    Http,
    #[serde(rename = "GRPCRoute")]
    Grpc,
}

impl RouteKind {
    pub fn as_str(self) -> &'static str {
        match self {
            RouteKind::Http => "HTTPRoute",
            RouteKind::Grpc => "GRPCRoute",
        }
    }
}

/// A route object's identity: its kind and namespace/name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RouteKey {
    pub kind: RouteKind,
    pub key: ObjectKey,
}

impl std::fmt::Display for RouteKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.kind.as_str(), self.key)
    }
}

/// A parentRef that names a Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParentRef {
    pub service: ObjectKey,
    pub port: Option<u16>,
}

/// A backendRef: a Service and port, or why it cannot be one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendRef {
    pub service: Result<ObjectKey, String>,
    pub port: Option<u16>,
    pub weight: u32,
}

/// A rule in the mesh model's terms, but for its backends, which are still references.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleEntry {
    /// Complete but for `backends`, which resolution fills in.
    pub rule: RouteRule,
    pub backends: Vec<BackendRef>,
}

/// What the index keeps of a route object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteEntry {
    pub parents: Vec<ParentRef>,
    /// The rules, or why the route cannot be used at all.
    pub rules: Result<Vec<RuleEntry>, String>,
}

/// What the index keeps of a ReferenceGrant: who may refer (group, kind, namespace) to what
/// in the grant's namespace (group, kind, name or every name).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrantEntry {
    pub from: Vec<(String, String, String)>,
    pub to: Vec<(String, String, Option<String>)>,
}

// ---------------------------------------------------------------------------------------------
// Mapping
// ---------------------------------------------------------------------------------------------

fn route_key(
    kind: RouteKind,
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> RouteKey {
    RouteKey {
        kind,
        key: ObjectKey::of(meta),
    }
}

/// Tie-breakers among equally specific matches: creation time, then namespace/name.
fn order(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    key: &ObjectKey,
) -> (Option<i64>, String) {
    let created: Option<Timestamp> = meta.creation_timestamp.as_ref().map(|t| t.0);
    (created.map(|t| t.as_second()), key.to_string())
}

/// A parentRef or backendRef, whatever route kind it comes from.
struct Reference<'a> {
    group: Option<&'a str>,
    kind: Option<&'a str>,
    name: &'a str,
    namespace: Option<&'a str>,
    port: Option<i32>,
    /// backendRefs only.
    weight: Option<i32>,
    has_filters: bool,
}

/// The fields of a parentRef or backendRef of any route kind, as a [`Reference`].
macro_rules! reference {
    (parent $p:expr) => {
        Reference {
            group: $p.group.as_deref(),
            kind: $p.kind.as_deref(),
            name: &$p.name,
            namespace: $p.namespace.as_deref(),
            port: $p.port,
            weight: None,
            has_filters: false,
        }
    };
    (backend $b:expr) => {
        Reference {
            group: $b.group.as_deref(),
            kind: $b.kind.as_deref(),
            name: &$b.name,
            namespace: $b.namespace.as_deref(),
            port: $b.port,
            weight: $b.weight,
            has_filters: $b.filters.as_ref().is_some_and(|f| !f.is_empty()),
        }
    };
}

/// The Service parents of a route; parents of other kinds (Gateways) are not the mesh's.
fn parents<'a>(
    route_namespace: &str,
    refs: impl Iterator<Item = Reference<'a>>,
) -> Result<Vec<ParentRef>, String> {
    let mut out = Vec::new();
    for r in refs {
        // The Gateway API's defaults are a Gateway parent: a Service must be named as such.
        if !r.group.unwrap_or(GATEWAY_GROUP).is_empty() || r.kind.unwrap_or("Gateway") != "Service"
        {
            continue;
        }
        let port = match r.port {
            None => None,
            Some(p) => Some(
                u16::try_from(p)
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| format!("parentRef {}: port {p} is out of range", r.name))?,
            ),
        };
        out.push(ParentRef {
            service: ObjectKey::new(r.namespace.unwrap_or(route_namespace), r.name),
            port,
        });
    }
    Ok(out)
}

fn backend_refs<'a>(
    route_namespace: &str,
    refs: impl Iterator<Item = Reference<'a>>,
) -> Result<Vec<BackendRef>, String> {
    refs.map(|r| {
        if r.has_filters {
            return Err(format!(
                "backendRef {}: filters on a backendRef are not supported",
                r.name
            ));
        }
        let weight = match r.weight {
            None => 1,
            Some(w) => u32::try_from(w)
                .ok()
                .filter(|w| *w <= crate::mesh::route::MAX_WEIGHT)
                .ok_or_else(|| format!("backendRef {}: weight {w} is out of range", r.name))?,
        };
        let service =
            if r.group.unwrap_or("").is_empty() && r.kind.unwrap_or("Service") == "Service" {
                Ok(ObjectKey::new(
                    r.namespace.unwrap_or(route_namespace),
                    r.name,
                ))
            } else {
                Err(format!(
                    "backendRef {} is a {}{}; only Services can be backends",
                    r.name,
                    r.kind.unwrap_or("Service"),
                    r.group
                        .filter(|g| !g.is_empty())
                        .map(|g| format!(".{g}"))
                        .unwrap_or_default()
                ))
            };
        let port = r
            .port
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0);
        Ok(BackendRef {
            service,
            port,
            weight,
        })
    })
    .collect()
}

fn value_match(value: &str, regex: bool) -> Result<ValueMatch, String> {
    if regex {
        check_regex(value)?;
        Ok(ValueMatch::Regex(value.to_string()))
    } else {
        Ok(ValueMatch::Exact(value.to_string()))
    }
}

/// Header or query conditions; of two naming the same header (or parameter), the first
/// counts, as the Gateway API says.
fn conditions(
    list: impl Iterator<Item = Result<ValueCondition, String>>,
    case_insensitive: bool,
) -> Result<Vec<ValueCondition>, String> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for condition in list {
        let condition = condition?;
        let key = if case_insensitive {
            condition.name.to_ascii_lowercase()
        } else {
            condition.name.clone()
        };
        if seen.insert(key) {
            out.push(condition);
        }
    }
    Ok(out)
}

fn duration(field: &str, text: Option<&str>) -> Result<Option<Duration>, String> {
    text.map(|text| super::super::gateway_duration(text).map_err(|e| format!("{field}: {e}")))
        .transpose()
}

/// A rule's RequestHeaderModifier, whatever the route kind; any other filter refuses the rule.
macro_rules! request_header_edits {
    ($rule:expr, $types:ident) => {{
        let mut edits = HeaderEdits::default();
        for filter in $rule.filters.iter().flatten() {
            match (&filter.r#type, &filter.request_header_modifier) {
                ($types::RequestHeaderModifier, Some(m)) => {
                    edits = HeaderEdits {
                        set: m
                            .set
                            .iter()
                            .flatten()
                            .map(|h| (h.name.clone(), h.value.clone()))
                            .collect(),
                        add: m
                            .add
                            .iter()
                            .flatten()
                            .map(|h| (h.name.clone(), h.value.clone()))
                            .collect(),
                        remove: m.remove.clone().unwrap_or_default(),
                    };
                }
                (other, _) => {
                    return Err(format!(
                        "filter {} is not supported by this mesh",
                        name_of(other)
                    ));
                }
            }
        }
        edits
    }};
}

/// The Gateway API name of an enum value (its serialized form).
fn name_of<T: Serialize + std::fmt::Debug>(value: &T) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{value:?}"))
}

fn http_match(m: &HttpRouteRulesMatches) -> Result<RequestMatch, String> {
    let path = match &m.path {
        None => PathMatch::any(),
        Some(path) => {
            let value = path.value.clone().unwrap_or_else(|| "/".to_string());
            match path
                .r#type
                .as_ref()
                .unwrap_or(&HttpRouteRulesMatchesPathType::PathPrefix)
            {
                HttpRouteRulesMatchesPathType::Exact => PathMatch::Exact(value),
                HttpRouteRulesMatchesPathType::PathPrefix => {
                    let trimmed = value.trim_end_matches('/');
                    PathMatch::Prefix(if trimmed.is_empty() {
                        "/".into()
                    } else {
                        trimmed.into()
                    })
                }
                HttpRouteRulesMatchesPathType::RegularExpression => {
                    check_regex(&value)?;
                    PathMatch::Regex(value)
                }
            }
        }
    };
    let method = m.method.as_ref().map(name_of);
    let headers = conditions(
        m.headers.iter().flatten().map(|h| {
            let regex = matches!(
                h.r#type,
                Some(HttpRouteRulesMatchesHeadersType::RegularExpression)
            );
            Ok(ValueCondition {
                name: h.name.clone(),
                value: value_match(&h.value, regex)?,
            })
        }),
        true,
    )?;
    let query = conditions(
        m.query_params.iter().flatten().map(|q| {
            let regex = matches!(
                q.r#type,
                Some(HttpRouteRulesMatchesQueryParamsType::RegularExpression)
            );
            Ok(ValueCondition {
                name: q.name.clone(),
                value: value_match(&q.value, regex)?,
            })
        }),
        false,
    )?;
    Ok(RequestMatch {
        path,
        method,
        headers,
        query,
    })
}

fn http_rule(namespace: &str, rule: &HttpRouteRules) -> Result<RuleEntry, String> {
    let matches = match rule.matches.as_deref() {
        None | Some([]) => vec![RequestMatch::any()],
        Some(matches) => matches.iter().map(http_match).collect::<Result<_, _>>()?,
    };
    let request_headers = request_header_edits!(rule, HttpRouteRulesFiltersType);
    let backends = backend_refs(
        namespace,
        rule.backend_refs
            .iter()
            .flatten()
            .map(|b| reference!(backend b)),
    )?;
    let timeouts = rule.timeouts.as_ref();
    let timeout = duration(
        "timeouts.request",
        timeouts.and_then(|t| t.request.as_deref()),
    )?;
    let backend_timeout = duration(
        "timeouts.backendRequest",
        timeouts.and_then(|t| t.backend_request.as_deref()),
    )?;
    let retry = rule
        .retry
        .as_ref()
        .map(|r| -> Result<RetryPolicy, String> {
            let attempts = match r.attempts {
                None => DEFAULT_RETRY_ATTEMPTS,
                Some(n) => {
                    u32::try_from(n).map_err(|_| format!("retry.attempts {n} is negative"))?
                }
            };
            let codes = r
                .codes
                .iter()
                .flatten()
                .map(|&c| {
                    u16::try_from(c)
                        .ok()
                        .filter(|c| (400..=599).contains(c))
                        .ok_or_else(|| format!("retry.codes: {c} is not an HTTP status 400-599"))
                })
                .collect::<Result<_, _>>()?;
            Ok(RetryPolicy {
                attempts,
                // The Gateway API asks for connection errors to be retried with any retry.
                on: DEFAULT_RETRY_ON.to_vec(),
                codes,
                backoff: duration("retry.backoff", r.backoff.as_deref())?,
            })
        })
        .transpose()?;
    Ok(rule_entry(
        matches,
        request_headers,
        backends,
        (timeout, backend_timeout),
        retry,
    ))
}

fn grpc_match(m: &GrpcRouteRulesMatches) -> Result<RequestMatch, String> {
    // A gRPC call is a POST to /<package.Service>/<Method>.
    let path = match &m.method {
        None => PathMatch::any(),
        Some(method) => {
            let regex = matches!(
                method.r#type,
                Some(GrpcRouteRulesMatchesMethodType::RegularExpression)
            );
            match (method.service.as_deref(), method.method.as_deref(), regex) {
                (None, None, _) => PathMatch::any(),
                (Some(service), Some(name), false) => {
                    PathMatch::Exact(format!("/{service}/{name}"))
                }
                (Some(service), None, false) => PathMatch::Prefix(format!("/{service}")),
                (None, Some(name), false) => {
                    PathMatch::Regex(format!("/[^/]+/{}", regex::escape(name)))
                }
                (service, name, true) => {
                    let regex = format!(
                        "/{}/{}",
                        service.unwrap_or("[^/]+"),
                        name.unwrap_or("[^/]+")
                    );
                    check_regex(&regex)?;
                    PathMatch::Regex(regex)
                }
            }
        }
    };
    let headers = conditions(
        m.headers.iter().flatten().map(|h| {
            let regex = matches!(
                h.r#type,
                Some(GrpcRouteRulesMatchesHeadersType::RegularExpression)
            );
            Ok(ValueCondition {
                name: h.name.clone(),
                value: value_match(&h.value, regex)?,
            })
        }),
        true,
    )?;
    Ok(RequestMatch {
        path,
        method: None,
        headers,
        query: Vec::new(),
    })
}

fn grpc_rule(namespace: &str, rule: &GrpcRouteRules) -> Result<RuleEntry, String> {
    let matches = match rule.matches.as_deref() {
        None | Some([]) => vec![RequestMatch::any()],
        Some(matches) => matches.iter().map(grpc_match).collect::<Result<_, _>>()?,
    };
    let request_headers = request_header_edits!(rule, GrpcRouteRulesFiltersType);
    let backends = backend_refs(
        namespace,
        rule.backend_refs
            .iter()
            .flatten()
            .map(|b| reference!(backend b)),
    )?;
    Ok(rule_entry(
        matches,
        request_headers,
        backends,
        (None, None),
        None,
    ))
}

/// A rule of either route kind, its source and order left for [`map_rules`] to stamp.
fn rule_entry(
    matches: Vec<RequestMatch>,
    request_headers: HeaderEdits,
    backends: Vec<BackendRef>,
    (timeout, backend_timeout): (Option<Duration>, Option<Duration>),
    retry: Option<RetryPolicy>,
) -> RuleEntry {
    RuleEntry {
        rule: RouteRule {
            source: RuleSource::File {
                rule: 0,
                name: None,
            },
            order: (None, String::new(), 0),
            port: None,
            matches,
            backends: Vec::new(),
            timeout,
            backend_timeout,
            retry,
            request_headers,
        },
        backends,
    }
}

/// Stamps each rule with its source and tie-breaking order.
fn map_rules(
    key: &RouteKey,
    (created, name): (Option<i64>, String),
    rules: Result<Vec<RuleEntry>, String>,
) -> Result<Vec<RuleEntry>, String> {
    let mut rules = rules?;
    for (i, entry) in rules.iter_mut().enumerate() {
        entry.rule.source = RuleSource::Kubernetes {
            kind: key.kind.as_str().to_string(),
            namespace: key.key.namespace.clone(),
            name: key.key.name.clone(),
            rule: i,
        };
        entry.rule.order = (created, name.clone(), i);
    }
    Ok(rules)
}

/// A public mapping function per route kind, over [`route_entry`].
macro_rules! route_entry_fn {
    ($(#[$doc:meta])* $name:ident, $route:ty, $kind:expr, $rule:ident) => {
        $(#[$doc])*
        pub fn $name(route: &$route) -> (RouteKey, RouteEntry) {
            let parent_refs = route.spec.parent_refs.iter().flatten();
            route_entry(
                $kind,
                &route.metadata,
                |namespace| parents(namespace, parent_refs.map(|p| reference!(parent p))),
                route.spec.rules.as_deref(),
                $rule,
            )
        }
    };
}

route_entry_fn!(
    /// Maps an HTTPRoute. A route without rules has the Gateway API's default rule: every
    /// request, and no backend (which answers 500).
    http_route_entry,
    HttpRoute,
    RouteKind::Http,
    http_rule
);

route_entry_fn!(
    /// Maps a GRPCRoute.
    grpc_route_entry,
    GrpcRoute,
    RouteKind::Grpc,
    grpc_rule
);

/// What both route kinds share: the key, the parents, the rules (the default one when there
/// are none), each stamped with its source and tie-breaking order.
fn route_entry<R: Default>(
    kind: RouteKind,
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    parents: impl FnOnce(&str) -> Result<Vec<ParentRef>, String>,
    rules: Option<&[R]>,
    map_rule: fn(&str, &R) -> Result<RuleEntry, String>,
) -> (RouteKey, RouteEntry) {
    let key = route_key(kind, meta);
    let namespace = key.key.namespace.as_str();
    let rules = match rules {
        None | Some([]) => map_rule(namespace, &R::default()).map(|r| vec![r]),
        Some(rules) => rules
            .iter()
            .enumerate()
            .map(|(i, r)| map_rule(namespace, r).map_err(|e| format!("rule {i}: {e}")))
            .collect(),
    };
    let entry = match parents(namespace) {
        Ok(parents) => RouteEntry {
            parents,
            rules: map_rules(&key, order(meta, &key.key), rules),
        },
        Err(reason) => RouteEntry {
            parents: Vec::new(),
            rules: Err(reason),
        },
    };
    (key, entry)
}

pub fn grant_entry(grant: &ReferenceGrant) -> (ObjectKey, GrantEntry) {
    let entry = GrantEntry {
        from: grant
            .spec
            .from
            .iter()
            .map(|f| (f.group.clone(), f.kind.clone(), f.namespace.clone()))
            .collect(),
        to: grant
            .spec
            .to
            .iter()
            .map(|t| (t.group.clone(), t.kind.clone(), t.name.clone()))
            .collect(),
    };
    (ObjectKey::of(&grant.metadata), entry)
}

// ---------------------------------------------------------------------------------------------
// Resolution
// ---------------------------------------------------------------------------------------------

/// What resolution needs to know of a Service: its entry, and whether it holds its mesh path
/// (a Service that lost a path conflict is not in the mesh).
pub type ServiceLookup<'a> = &'a dyn Fn(&ObjectKey) -> Option<(&'a ServiceEntry, bool)>;

/// Every route and grant, and who depends on whom.
#[derive(Debug, Default)]
pub struct RouteIndex {
    routes: BTreeMap<RouteKey, RouteEntry>,
    grants: HashMap<ObjectKey, GrantEntry>,
    /// Parent Service → the routes naming it.
    by_parent: HashMap<ObjectKey, BTreeSet<RouteKey>>,
    /// Backend Service → the routes sending to it.
    by_backend: HashMap<ObjectKey, BTreeSet<RouteKey>>,
}

impl RouteIndex {
    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }

    /// Sets (or, with `None`, deletes) a route; returns the parents whose rules may change.
    pub fn set_route(&mut self, key: RouteKey, entry: Option<RouteEntry>) -> BTreeSet<ObjectKey> {
        let old = match entry {
            Some(entry) => {
                let old = self.routes.insert(key.clone(), entry);
                if self.routes.get(&key) == old.as_ref() {
                    return BTreeSet::new();
                }
                old
            }
            None => self.routes.remove(&key),
        };
        let mut affected = BTreeSet::new();
        if let Some(old) = &old {
            for parent in &old.parents {
                unlink(&mut self.by_parent, &parent.service, &key);
                affected.insert(parent.service.clone());
            }
            for backend in backends(old) {
                unlink(&mut self.by_backend, backend, &key);
            }
        }
        if let Some(new) = self.routes.get(&key) {
            for parent in &new.parents {
                self.by_parent
                    .entry(parent.service.clone())
                    .or_default()
                    .insert(key.clone());
                affected.insert(parent.service.clone());
            }
            for backend in backends(new).cloned().collect::<Vec<_>>() {
                self.by_backend
                    .entry(backend)
                    .or_default()
                    .insert(key.clone());
            }
        }
        affected
    }

    /// Sets (or deletes) a grant; returns the parents whose backends may resolve differently.
    pub fn set_grant(&mut self, key: ObjectKey, entry: Option<GrantEntry>) -> BTreeSet<ObjectKey> {
        let changed = match entry {
            Some(entry) => self.grants.insert(key.clone(), entry.clone()) != Some(entry),
            None => self.grants.remove(&key).is_some(),
        };
        if !changed {
            return BTreeSet::new();
        }
        // Routes from other namespaces that send to this one.
        self.routes
            .iter()
            .filter(|(route, entry)| {
                backends(entry)
                    .any(|b| b.namespace == key.namespace && route.key.namespace != key.namespace)
            })
            .flat_map(|(_, entry)| entry.parents.iter().map(|p| p.service.clone()))
            .collect()
    }

    /// The keys of every route and grant in `scope` (a namespace, or all): for a re-list.
    pub fn route_keys(&self, kind: RouteKind, scope: Option<&str>) -> Vec<RouteKey> {
        self.routes
            .keys()
            .filter(|k| k.kind == kind && scope.is_none_or(|ns| ns == k.key.namespace))
            .cloned()
            .collect()
    }

    pub fn grant_keys(&self, scope: Option<&str>) -> Vec<ObjectKey> {
        self.grants
            .keys()
            .filter(|k| scope.is_none_or(|ns| ns == k.namespace))
            .cloned()
            .collect()
    }

    /// The parents of routes that send to `backend`: their rules resolve it.
    pub fn parents_sending_to(&self, backend: &ObjectKey) -> BTreeSet<ObjectKey> {
        self.by_backend
            .get(backend)
            .into_iter()
            .flatten()
            .filter_map(|key| self.routes.get(key))
            .flat_map(|entry| entry.parents.iter().map(|p| p.service.clone()))
            .collect()
    }

    /// The rules in effect for the Service `parent`, backends resolved.
    pub fn rules_for(&self, parent: &ObjectKey, lookup: ServiceLookup<'_>) -> Vec<RouteRule> {
        let mut rules = Vec::new();
        for key in self.by_parent.get(parent).into_iter().flatten() {
            let Some(entry) = self.routes.get(key) else {
                continue;
            };
            for parent_ref in entry.parents.iter().filter(|p| &p.service == parent) {
                if self.attach(key, entry, parent_ref, lookup).is_err() {
                    continue;
                }
                let Ok(route_rules) = &entry.rules else {
                    continue;
                };
                for rule in route_rules {
                    let mut resolved = rule.rule.clone();
                    resolved.port = parent_ref.port;
                    resolved.backends = rule
                        .backends
                        .iter()
                        .map(|b| Backend {
                            target: self.resolve(key, b, lookup),
                            weight: b.weight,
                        })
                        .collect();
                    rules.push(resolved);
                }
            }
        }
        rules
    }

    /// Every (route, parent) the agent refuses, and why.
    pub fn rejections(&self, lookup: ServiceLookup<'_>) -> Vec<RejectedRoute> {
        let mut out = Vec::new();
        for (key, entry) in &self.routes {
            if let Err(reason) = &entry.rules {
                out.push(RejectedRoute {
                    route: key.to_string(),
                    parent: None,
                    reason: reason.clone(),
                });
                continue;
            }
            for parent in &entry.parents {
                if let Err(reason) = self.attach(key, entry, parent, lookup) {
                    out.push(RejectedRoute {
                        route: key.to_string(),
                        parent: Some(match parent.port {
                            Some(port) => format!("Service {}:{port}", parent.service),
                            None => format!("Service {}", parent.service),
                        }),
                        reason,
                    });
                }
            }
        }
        out
    }

    /// Whether a route may bind to one of its parents, or why not.
    fn attach(
        &self,
        key: &RouteKey,
        entry: &RouteEntry,
        parent: &ParentRef,
        lookup: ServiceLookup<'_>,
    ) -> Result<(), String> {
        if let Err(reason) = &entry.rules {
            return Err(reason.clone());
        }
        if parent.service.namespace != key.key.namespace {
            return Err(format!(
                "consumer routes (a route in another namespace than its parent Service) are not \
                 supported yet; put the route in namespace {}",
                parent.service.namespace
            ));
        }
        let Some((service, holds_path)) = lookup(&parent.service) else {
            return Err(format!(
                "parent Service {} does not exist (or is not in the mesh: an ExternalName \
                 Service without TCP ports, or an invalid path annotation)",
                parent.service
            ));
        };
        if !holds_path {
            return Err(format!(
                "parent Service {} lost its mesh path {} to an older Service",
                parent.service, service.path
            ));
        }
        if let Some(port) = service.ports.iter().find(|p| !p.protocol.is_http()) {
            return Err(format!(
                "parent Service {} has a {} port ({}): routes need a Service whose ports are all \
                 HTTP (one with a TCP port is reached by an address of its own and proxied as TCP)",
                parent.service, port.protocol, port.port
            ));
        }
        if let Some(port) = parent.port
            && !service.ports.iter().any(|p| p.port == port)
        {
            return Err(format!(
                "parent Service {} has no port {port}",
                parent.service
            ));
        }
        if key.kind == RouteKind::Http {
            let overlaps =
                |p: Option<u16>| p.is_none() || parent.port.is_none() || p == parent.port;
            let grpc = self
                .by_parent
                .get(&parent.service)
                .into_iter()
                .flatten()
                .find(|other| {
                    other.kind == RouteKind::Grpc
                        && self.routes.get(other).is_some_and(|e| {
                            e.rules.is_ok()
                                && e.parents
                                    .iter()
                                    .any(|p| p.service == parent.service && overlaps(p.port))
                        })
                });
            if let Some(grpc) = grpc {
                return Err(format!(
                    "{grpc} is attached to the same Service port, and a GRPCRoute takes \
                     precedence over an HTTPRoute (Conflicted)"
                ));
            }
        }
        Ok(())
    }

    fn resolve(
        &self,
        route: &RouteKey,
        backend: &BackendRef,
        lookup: ServiceLookup<'_>,
    ) -> BackendTarget {
        let unresolved = |reason: String| BackendTarget::Unresolved { reason };
        let service = match &backend.service {
            Ok(service) => service,
            Err(reason) => return unresolved(reason.clone()),
        };
        if service.namespace != route.key.namespace && !self.granted(route, service) {
            return unresolved(format!(
                "no ReferenceGrant in namespace {} lets {} in {} refer to Service {}",
                service.namespace,
                route.kind.as_str(),
                route.key.namespace,
                service.name
            ));
        }
        let Some(port) = backend.port else {
            return unresolved(format!("backendRef to Service {service} needs a port"));
        };
        match lookup(service) {
            None => unresolved(format!("no Service {service} in the mesh")),
            Some((_, false)) => {
                unresolved(format!("Service {service} does not hold its mesh path"))
            }
            Some((entry, true)) if entry.ports.iter().any(|p| p.port == port) => {
                BackendTarget::Service {
                    path: entry.path.clone(),
                    port,
                }
            }
            Some(_) => unresolved(format!("Service {service} has no port {port}")),
        }
    }

    /// Whether a ReferenceGrant in the backend's namespace lets `route` refer to it.
    fn granted(&self, route: &RouteKey, backend: &ObjectKey) -> bool {
        self.grants
            .iter()
            .filter(|(key, _)| key.namespace == backend.namespace)
            .any(|(_, grant)| {
                grant.from.iter().any(|(group, kind, namespace)| {
                    group == GATEWAY_GROUP
                        && kind == route.kind.as_str()
                        && *namespace == route.key.namespace
                }) && grant.to.iter().any(|(group, kind, name)| {
                    group.is_empty()
                        && kind == "Service"
                        && name.as_ref().is_none_or(|n| *n == backend.name)
                })
            })
    }
}

fn backends(entry: &RouteEntry) -> impl Iterator<Item = &ObjectKey> {
    entry
        .rules
        .iter()
        .flatten()
        .flat_map(|r| &r.backends)
        .filter_map(|b| b.service.as_ref().ok())
}

fn unlink(map: &mut HashMap<ObjectKey, BTreeSet<RouteKey>>, service: &ObjectKey, route: &RouteKey) {
    if let Some(routes) = map.get_mut(service) {
        routes.remove(route);
        if routes.is_empty() {
            map.remove(service);
        }
    }
}
