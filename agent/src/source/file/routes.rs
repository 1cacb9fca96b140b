//! The `routes:` of a mesh-file service: the file's form of the routing rules, and their
//! validation into [`RouteRule`]s. Every error names the rule and the field
//! (`routes[1].backends[0].service: …`); the caller prefixes the service.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use serde::Deserialize;

use super::port_number;
use crate::mesh::route::{
    Backend, BackendTarget, HeaderEdits, MAX_WEIGHT, PathMatch, RequestMatch, RetryOn, RetryPolicy,
    RouteRule, RuleError, RuleSource, ValueCondition, ValueMatch,
};
use crate::mesh::{MeshPath, Protocol};

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct FileRoute {
    name: Option<String>,
    port: Option<i64>,
    #[serde(default)]
    matches: Vec<FileMatch>,
    #[serde(default)]
    backends: Vec<FileBackend>,
    timeout: Option<String>,
    backend_timeout: Option<String>,
    retry: Option<FileRetry>,
    #[serde(default)]
    request_headers: FileHeaderEdits,
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileMatch {
    path: Option<FilePath>,
    method: Option<String>,
    #[serde(default)]
    headers: Vec<FileCondition>,
    #[serde(default)]
    query: Vec<FileCondition>,
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct FilePath {
    exact: Option<String>,
    prefix: Option<String>,
    regex: Option<String>,
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileCondition {
    name: String,
    exact: Option<String>,
    regex: Option<String>,
    present: Option<bool>,
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileBackend {
    service: String,
    port: Option<i64>,
    weight: Option<i64>,
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileRetry {
    attempts: Option<i64>,
    on: Option<Vec<String>>,
    #[serde(default)]
    codes: Vec<i64>,
    backoff: Option<String>,
}

#[derive(Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileHeaderEdits {
    #[serde(default)]
    set: Vec<FileHeader>,
    #[serde(default)]
    add: Vec<FileHeader>,
    #[serde(default)]
    remove: Vec<String>,
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileHeader {
    name: String,
    value: String,
}

const METHODS: [&str; 9] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
];

/// The ports of every service in the file, by path, and their protocols.
pub(super) type PortIndex = BTreeMap<MeshPath, Vec<(u16, Protocol)>>;

/// The rules of the service at `parent`, validated against the ports of every service.
pub(super) fn rules(
    parent: &MeshPath,
    routes: Vec<FileRoute>,
    ports: &PortIndex,
) -> Result<Vec<RouteRule>, String> {
    if routes.is_empty() {
        return Ok(Vec::new());
    }
    let own_ports = ports.get(parent).map(Vec::as_slice).unwrap_or_default();
    if let Some((port, protocol)) = own_ports.iter().find(|(_, p)| !p.is_http()) {
        return Err(format!(
            "routes: routing rules need a service whose ports are all HTTP; port {port} is \
             {protocol}, so clients reach this service by an address of its own and its traffic \
             is proxied as TCP"
        ));
    }
    routes
        .into_iter()
        .enumerate()
        .map(|(i, route)| rule(i, route, own_ports, ports).map_err(|e| format!("routes[{i}]{e}")))
        .collect()
}

/// One rule; errors start with the field (`.backends[0].port: …`).
fn rule(
    index: usize,
    route: FileRoute,
    own_ports: &[(u16, Protocol)],
    ports: &PortIndex,
) -> Result<RouteRule, String> {
    let port = match route.port {
        None => None,
        Some(value) => {
            let port = port_number(value)
                .filter(|p| own_ports.iter().any(|(own, _)| own == p))
                .ok_or_else(|| {
                    format!(
                        ".port: the service has no port {value} (its ports: {})",
                        list(own_ports.iter().map(|(p, _)| p))
                    )
                })?;
            Some(port)
        }
    };
    let matches = if route.matches.is_empty() {
        vec![RequestMatch::any()]
    } else {
        route
            .matches
            .into_iter()
            .enumerate()
            .map(|(j, m)| request_match(m).map_err(|e| format!(".matches[{j}]{e}")))
            .collect::<Result<_, _>>()?
    };
    if route.backends.is_empty() {
        return Err(".backends: a rule needs at least one backend".to_string());
    }
    let backends = route
        .backends
        .into_iter()
        .enumerate()
        .map(|(j, b)| backend(b, ports).map_err(|e| format!(".backends[{j}]{e}")))
        .collect::<Result<_, _>>()?;
    let timeout = duration(route.timeout.as_deref()).map_err(|e| format!(".timeout: {e}"))?;
    let backend_timeout =
        duration(route.backend_timeout.as_deref()).map_err(|e| format!(".backendTimeout: {e}"))?;
    if let (Some(total), Some(each)) = (timeout, backend_timeout)
        && !total.is_zero()
        && each > total
    {
        return Err(format!(
            ".backendTimeout: {each:?} is longer than the rule's timeout {total:?}"
        ));
    }
    let retry = route
        .retry
        .map(|r| retry(r).map_err(|e| format!(".retry{e}")))
        .transpose()?;
    let request_headers =
        header_edits(route.request_headers).map_err(|e| format!(".requestHeaders{e}"))?;
    Ok(RouteRule {
        source: RuleSource::File {
            rule: index,
            name: route.name,
        },
        order: (None, String::new(), index),
        port,
        matches,
        backends,
        timeout,
        backend_timeout,
        retry,
        request_headers,
    })
}

fn request_match(m: FileMatch) -> Result<RequestMatch, String> {
    let path = match m.path {
        None => PathMatch::any(),
        Some(path) => path_match(path).map_err(|e| format!(".path{e}"))?,
    };
    let method = m
        .method
        .map(|method| {
            let upper = method.to_ascii_uppercase();
            METHODS
                .contains(&upper.as_str())
                .then_some(upper)
                .ok_or_else(|| format!(".method: {method:?} is not one of {}", METHODS.join(", ")))
        })
        .transpose()?;
    let headers = conditions(m.headers, true).map_err(|e| format!(".headers{e}"))?;
    let query = conditions(m.query, false).map_err(|e| format!(".query{e}"))?;
    Ok(RequestMatch {
        path,
        method,
        headers,
        query,
    })
}

fn path_match(path: FilePath) -> Result<PathMatch, String> {
    match (path.exact, path.prefix, path.regex) {
        (Some(exact), None, None) => PathMatch::exact(&exact).map_err(|e| format!(".exact: {e}")),
        (None, Some(prefix), None) => {
            PathMatch::prefix(&prefix).map_err(|e| format!(".prefix: {e}"))
        }
        (None, None, Some(regex)) => PathMatch::regex(&regex).map_err(|e| format!(".regex: {e}")),
        _ => Err(": give exactly one of exact, prefix, regex".to_string()),
    }
}

fn conditions(list: Vec<FileCondition>, headers: bool) -> Result<Vec<ValueCondition>, String> {
    let mut seen = HashSet::new();
    list.into_iter()
        .enumerate()
        .map(|(i, c)| {
            let at = |e: String| format!("[{i}]{e}");
            if !is_token(&c.name) {
                return Err(at(format!(".name: {:?} is not a valid name", c.name)));
            }
            // Header names are case-insensitive; query parameter names are not.
            let key = if headers {
                c.name.to_ascii_lowercase()
            } else {
                c.name.clone()
            };
            if !seen.insert(key) {
                return Err(at(format!(".name: {} is named twice", c.name)));
            }
            let value = match (c.exact, c.regex, c.present) {
                (Some(exact), None, None) => ValueMatch::Exact(exact),
                (None, Some(regex), None) => {
                    ValueMatch::regex(&regex).map_err(|e| at(format!(".regex: {e}")))?
                }
                (None, None, Some(true)) => ValueMatch::Present,
                _ => {
                    return Err(at(
                        ": give exactly one of exact, regex, present: true".to_string()
                    ));
                }
            };
            Ok(ValueCondition {
                name: c.name,
                value,
            })
        })
        .collect()
}

fn backend(b: FileBackend, ports: &PortIndex) -> Result<Backend, String> {
    let path: MeshPath = b.service.parse().map_err(|e| format!(".service: {e}"))?;
    let Some(backend_ports) = ports.get(&path) else {
        return Err(format!(".service: no service {path} in the mesh file"));
    };
    let port = match (b.port, backend_ports.as_slice()) {
        (Some(value), _) => port_number(value)
            .filter(|p| backend_ports.iter().any(|(own, _)| own == p))
            .ok_or_else(|| {
                format!(
                    ".port: service {path} has no port {value} (its ports: {})",
                    list(backend_ports.iter().map(|(p, _)| p))
                )
            })?,
        (None, [(only, _)]) => *only,
        (None, _) => {
            return Err(format!(
                ".port: service {path} has several ports ({}); say which",
                list(backend_ports.iter().map(|(p, _)| p))
            ));
        }
    };
    let weight = match b.weight {
        None => 1,
        Some(w) => u32::try_from(w)
            .ok()
            .filter(|w| *w <= MAX_WEIGHT)
            .ok_or_else(|| format!(".weight: {w} is out of range 0-{MAX_WEIGHT}"))?,
    };
    Ok(Backend {
        target: BackendTarget::Service { path, port },
        weight,
    })
}

fn retry(r: FileRetry) -> Result<RetryPolicy, String> {
    let on =
        r.on.map(|names| {
            names
                .iter()
                .enumerate()
                .map(|(i, name)| {
                    RetryOn::ALL
                        .into_iter()
                        .find(|o| o.as_str() == name)
                        .ok_or_else(|| {
                            format!(
                                ".on[{i}]: {name:?} is not one of {}",
                                list(RetryOn::ALL.iter().map(|o| o.as_str()))
                            )
                        })
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?;
    let backoff = duration(r.backoff.as_deref()).map_err(|e| format!(".backoff: {e}"))?;
    RetryPolicy::new(r.attempts, on, &r.codes, backoff).map_err(|e| match e {
        RuleError::RetryNothing => format!(": {e}"),
        e => format!(".{e}"),
    })
}

fn header_edits(edits: FileHeaderEdits) -> Result<HeaderEdits, String> {
    let mut seen = HashSet::new();
    let mut name = |field: &str, i: usize, name: &str| {
        if !is_token(name) {
            return Err(format!(
                ".{field}[{i}]: {name:?} is not a valid header name"
            ));
        }
        if !seen.insert(name.to_ascii_lowercase()) {
            return Err(format!(
                ".{field}[{i}]: header {name} is edited twice; give each header one edit"
            ));
        }
        Ok(())
    };
    let mut pairs = |field: &str, list: Vec<FileHeader>| {
        list.into_iter()
            .enumerate()
            .map(|(i, h)| name(field, i, &h.name).map(|()| (h.name, h.value)))
            .collect::<Result<Vec<_>, String>>()
    };
    let set = pairs("set", edits.set)?;
    let add = pairs("add", edits.add)?;
    for (i, header) in edits.remove.iter().enumerate() {
        name("remove", i, header)?;
    }
    Ok(HeaderEdits {
        set,
        add,
        remove: edits.remove,
    })
}

fn duration(text: Option<&str>) -> Result<Option<Duration>, String> {
    text.map(super::super::gateway_duration).transpose()
}

/// An HTTP token (RFC 9110): what a header or parameter name may be made of.
fn is_token(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn list<T: ToString>(items: impl Iterator<Item = T>) -> String {
    items.map(|i| i.to_string()).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::{Provider, ServiceSpec};

    fn parse(text: &str) -> Result<Vec<ServiceSpec>, String> {
        super::super::parse(
            text,
            &Provider::new("file:test"),
            &super::super::Limits::default(),
        )
    }

    const MESH: &str = r#"
services:
  - path: /shop/web
    ports:
      - {port: 8080, protocol: http}
      - {port: 9090, protocol: grpc}
    routes:
      - name: green-header
        port: 8080
        matches:
          - headers: [{name: X-Release, exact: green}]
          - path: {prefix: /green/}
            method: get
            query: [{name: a, regex: "[0-9]+"}, {name: b, present: true}]
        backends: [{service: /shop/web-green}]
        requestHeaders:
          set: [{name: x-set, value: one}]
          add: [{name: x-add, value: two}]
          remove: [x-remove]
      - backends:
          - {service: /shop/web-blue, port: 8080, weight: 90}
          - {service: /shop/web-green, weight: 10}
        timeout: 1m30s
        backendTimeout: 500ms
        retry: {attempts: 3, on: [5xx, reset], codes: [503], backoff: 25ms}
  - path: /shop/web-blue
    ports: [{port: 8080, protocol: http}, {port: 8443, protocol: http2}]
  - path: /shop/web-green
    ports: [{port: 8080, protocol: http}]
  - path: /shop/db
    ports: [{port: 5432, protocol: tcp}]
"#;

    fn web(specs: &[ServiceSpec]) -> &ServiceSpec {
        specs
            .iter()
            .find(|s| s.path.as_str() == "/shop/web")
            .unwrap()
    }

    #[test]
    fn reads_every_field() {
        let specs = parse(MESH).unwrap();
        let rules = &web(&specs).routes;
        assert_eq!(rules.len(), 2);
        let green = &rules[0];
        assert_eq!(
            green.source,
            RuleSource::File {
                rule: 0,
                name: Some("green-header".into())
            }
        );
        assert_eq!(green.port, Some(8080));
        assert_eq!(green.matches.len(), 2);
        assert_eq!(
            green.matches[0].path,
            PathMatch::any(),
            "headers only: any path"
        );
        assert_eq!(
            green.matches[0].headers,
            [ValueCondition {
                name: "X-Release".into(),
                value: ValueMatch::Exact("green".into())
            }]
        );
        let second = &green.matches[1];
        assert_eq!(
            second.path,
            PathMatch::Prefix("/green".into()),
            "trailing / dropped"
        );
        assert_eq!(second.method.as_deref(), Some("GET"));
        assert_eq!(second.query[0].value, ValueMatch::Regex("[0-9]+".into()));
        assert_eq!(second.query[1].value, ValueMatch::Present);
        assert_eq!(
            green.backends,
            [Backend {
                target: BackendTarget::Service {
                    path: "/shop/web-green".parse().unwrap(),
                    port: 8080
                },
                weight: 1
            }],
            "a backend with one port needs no port"
        );
        assert_eq!(green.request_headers.set, [("x-set".into(), "one".into())]);
        assert_eq!(green.request_headers.add, [("x-add".into(), "two".into())]);
        assert_eq!(green.request_headers.remove, ["x-remove"]);
        assert!(green.retry.is_none() && green.timeout.is_none());

        let split = &rules[1];
        assert_eq!(split.port, None);
        assert_eq!(split.matches, [RequestMatch::any()]);
        assert_eq!(
            split.backends.iter().map(|b| b.weight).collect::<Vec<_>>(),
            [90, 10]
        );
        assert_eq!(split.timeout, Some(Duration::from_secs(90)));
        assert_eq!(split.backend_timeout, Some(Duration::from_millis(500)));
        assert_eq!(
            split.retry,
            Some(RetryPolicy {
                attempts: 3,
                on: vec![RetryOn::ServerError, RetryOn::Reset],
                codes: vec![503],
                backoff: Some(Duration::from_millis(25)),
            })
        );
        assert_eq!(
            split.order,
            (None, String::new(), 1),
            "file order breaks ties"
        );
    }

    #[test]
    fn errors_name_the_service_the_rule_and_the_field() {
        let cases = [
            (
                "{service: /shop/web-green}",
                "{service: /shop/nope}",
                "services[0] (/shop/web).routes[0].backends[0].service: no service /shop/nope in \
                 the mesh file",
            ),
            (
                "weight: 90}",
                "weight: 1000001}",
                "services[0] (/shop/web).routes[1].backends[0].weight: 1000001 is out of range",
            ),
            (
                "port: 8080, weight: 90",
                "port: 8081, weight: 90",
                "routes[1].backends[0].port: service /shop/web-blue has no port 8081",
            ),
            (
                "{service: /shop/web-blue, port: 8080, weight: 90}",
                "{service: /shop/web-blue, weight: 90}",
                "routes[1].backends[0].port: service /shop/web-blue has several ports (8080, \
                 8443); say which",
            ),
            (
                "{port: 9090, protocol: grpc}",
                "{port: 9090, protocol: tcp}",
                "services[0] (/shop/web).routes: routing rules need a service whose ports are \
                 all HTTP; port 9090 is tcp",
            ),
            (
                "port: 8080\n        matches",
                "port: 8081\n        matches",
                "routes[0].port: the service has no port 8081",
            ),
            (
                r#"regex: "[0-9]+""#,
                r#"regex: "[0-9+""#,
                "routes[0].matches[1].query[0].regex: \"[0-9+\" is not a regular expression Envoy's RE2 reads",
            ),
            (
                "{prefix: /green/}",
                "{prefix: green}",
                "routes[0].matches[1].path.prefix: \"green\" must start with '/'",
            ),
            (
                "{prefix: /green/}",
                "{prefix: /a, exact: /b}",
                "routes[0].matches[1].path: give exactly one of exact, prefix, regex",
            ),
            (
                "method: get",
                "method: fetch",
                "routes[0].matches[1].method: \"fetch\"",
            ),
            (
                "timeout: 1m30s",
                "timeout: 90",
                "routes[1].timeout: \"90\" is not a duration",
            ),
            (
                "backendTimeout: 500ms",
                "backendTimeout: 2m",
                "routes[1].backendTimeout: 120s is longer than the rule's timeout 90s",
            ),
            (
                "on: [5xx, reset]",
                "on: [5xx, oops]",
                "routes[1].retry.on[1]: \"oops\"",
            ),
            (
                "codes: [503]",
                "codes: [200]",
                "routes[1].retry.codes[0]: 200",
            ),
            (
                "add: [{name: x-add, value: two}]",
                "add: [{name: x-set, value: two}]",
                "routes[0].requestHeaders.add[0]: header x-set is edited twice",
            ),
            (
                "[{name: X-Release, exact: green}]",
                "[{name: X-Release}]",
                "routes[0].matches[0].headers[0]: give exactly one of exact, regex, present",
            ),
            (
                "backends: [{service: /shop/web-green}]",
                "backends: []",
                "routes[0].backends: a rule needs at least one backend",
            ),
            ("timeout: 1m30s", "tmeout: 1m30s", "unknown field `tmeout`"),
        ];
        for (from, to, expected) in cases {
            assert!(MESH.contains(from), "{from:?} is not in the mesh");
            let err = parse(&MESH.replacen(from, to, 1)).unwrap_err();
            assert!(err.contains(expected), "expected {expected:?} in {err:?}");
        }
    }

    #[test]
    fn zero_weights_are_kept_and_send_nowhere() {
        let text = MESH.replace("weight: 90}", "weight: 0}").replace(
            "{service: /shop/web-green, weight: 10}",
            "{service: /shop/web-green, weight: 0}",
        );
        let specs = parse(&text).unwrap();
        assert!(web(&specs).routes[1].sends_nowhere());
        assert!(!web(&specs).routes[0].sends_nowhere());
    }
}
