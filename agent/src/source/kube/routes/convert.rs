//! Route objects to entries: an HTTPRoute's or GRPCRoute's rules in the mesh model's terms (its
//! constructors validate them), parents and backends still Kubernetes references; and a
//! ReferenceGrant's from/to lists.

use std::collections::BTreeSet;
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

use super::super::mapping::ObjectKey;
use super::{
    BackendRef, GATEWAY_GROUP, GrantEntry, ParentRef, RouteEntry, RouteKey, RouteKind, RuleEntry,
};
use crate::mesh::route::{
    HeaderEdits, PathMatch, RequestMatch, RetryPolicy, RouteRule, RuleSource, ValueCondition,
    ValueMatch,
};

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
        ValueMatch::regex(value).map_err(|e| e.to_string())
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
    text.map(|text| crate::source::gateway_duration(text).map_err(|e| format!("{field}: {e}")))
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
                HttpRouteRulesMatchesPathType::Exact => PathMatch::exact(&value),
                HttpRouteRulesMatchesPathType::PathPrefix => PathMatch::prefix(&value),
                HttpRouteRulesMatchesPathType::RegularExpression => PathMatch::regex(&value),
            }
            .map_err(|e| format!("path: {e}"))?
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
            let codes: Vec<i64> = r.codes.iter().flatten().copied().collect();
            let backoff = duration("retry.backoff", r.backoff.as_deref())?;
            // The Gateway API asks for connection errors to be retried with any retry: the
            // default conditions.
            RetryPolicy::new(r.attempts, None, &codes, backoff).map_err(|e| format!("retry.{e}"))
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
                    PathMatch::Regex(format!("/[^/]+/{}", regex_syntax::escape(name)))
                }
                (service, name, true) => {
                    let regex = format!(
                        "/{}/{}",
                        service.unwrap_or("[^/]+"),
                        name.unwrap_or("[^/]+")
                    );
                    PathMatch::regex(&regex).map_err(|e| format!("method: {e}"))?
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
