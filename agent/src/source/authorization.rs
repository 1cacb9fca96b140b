//! Authorization rules as a mesh file and the `MeshAuthorization` resource write them, and
//! their check: both read the same shape, so a rule moves between them unchanged.
//!
//! ```yaml
//! - action: allow                  # allow (default) | deny
//!   from:                          # optional: the callers; absent, every caller
//!     - serviceAccount: shop/web   # <namespace>/<service account>, of the trust domain
//!     - namespace: billing         # every service account of the namespace
//!     - identity: spiffe://other.example/ns/x/sa/y
//!   ports: [8080]                  # optional: service ports; absent, every port
//!   paths: [/api/*, /health]       # optional (HTTP): exact, or a prefix ending in `*`
//!   methods: [GET, POST]           # optional (HTTP)
//! ```

use std::sync::Arc;

use serde::Deserialize;

use crate::mesh::{Action, AuthorizationRule, Caller, PathMatch};
use crate::trust::SpiffeId;

/// Bounds on what one service's rules may hold: an Envoy listener carries them for every
/// endpoint's proxy, so a typo or a hostile resource must not make them unbounded.
pub const MAX_RULES: usize = 64;
/// Per list of a rule (`from`, `ports`, `paths`, `methods`).
pub const MAX_ENTRIES: usize = 64;
const MAX_PATH: usize = 1024;
const MAX_METHOD: usize = 32;

/// A rule as written.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RuleSpec {
    #[serde(default = "allow")]
    pub action: Action,
    #[serde(default)]
    pub from: Vec<CallerSpec>,
    #[serde(default)]
    pub ports: Vec<i64>,
    #[serde(default)]
    pub paths: Vec<String>,
    #[serde(default)]
    pub methods: Vec<String>,
}

fn allow() -> Action {
    Action::Allow
}

/// One caller as written: exactly one of the three.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CallerSpec {
    pub identity: Option<String>,
    pub service_account: Option<String>,
    pub namespace: Option<String>,
}

/// Checks `rules` for a service whose ports are `service_ports`: the rules, or what is wrong
/// and where (`[2].from[0].serviceAccount: ...`).
pub fn check(rules: &[RuleSpec], service_ports: &[u16]) -> Result<Vec<AuthorizationRule>, String> {
    if rules.len() > MAX_RULES {
        return Err(format!(
            ": {} rules, more than the {MAX_RULES} a service may have",
            rules.len()
        ));
    }
    rules
        .iter()
        .enumerate()
        .map(|(i, rule)| check_rule(rule, service_ports).map_err(|e| format!("[{i}]{e}")))
        .collect()
}

fn check_rule(rule: &RuleSpec, service_ports: &[u16]) -> Result<AuthorizationRule, String> {
    for (what, len) in [
        ("from", rule.from.len()),
        ("ports", rule.ports.len()),
        ("paths", rule.paths.len()),
        ("methods", rule.methods.len()),
    ] {
        if len > MAX_ENTRIES {
            return Err(format!(
                ".{what}: {len} entries, more than the {MAX_ENTRIES} a rule may list"
            ));
        }
    }
    let mut from = rule
        .from
        .iter()
        .enumerate()
        .map(|(j, caller)| check_caller(caller).map_err(|e| format!(".from[{j}]{e}")))
        .collect::<Result<Vec<_>, _>>()?;
    let mut ports = Vec::with_capacity(rule.ports.len());
    for (j, &port) in rule.ports.iter().enumerate() {
        match u16::try_from(port) {
            Ok(port) if service_ports.contains(&port) => ports.push(port),
            _ => {
                return Err(format!(
                    ".ports[{j}]: {port} is not a port of the service ({service_ports:?})"
                ));
            }
        }
    }
    let mut paths = rule
        .paths
        .iter()
        .enumerate()
        .map(|(j, path)| check_path(path).map_err(|e| format!(".paths[{j}]: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    let mut methods = Vec::with_capacity(rule.methods.len());
    for (j, method) in rule.methods.iter().enumerate() {
        let ok = !method.is_empty()
            && method.len() <= MAX_METHOD
            && method.bytes().all(|b| b.is_ascii_uppercase());
        if !ok {
            return Err(format!(
                ".methods[{j}]: {:?} is not an HTTP method (1-{MAX_METHOD} of A-Z)",
                shown(method)
            ));
        }
        methods.push(Arc::from(method.as_str()));
    }
    ports.sort_unstable();
    ports.dedup();
    from.sort();
    from.dedup();
    paths.sort();
    paths.dedup();
    methods.sort();
    methods.dedup();
    Ok(AuthorizationRule {
        action: rule.action,
        from,
        ports,
        paths,
        methods,
    })
}

fn check_caller(caller: &CallerSpec) -> Result<Caller, String> {
    match (&caller.identity, &caller.service_account, &caller.namespace) {
        (Some(identity), None, None) => SpiffeId::parse(identity)
            .map(|id| Caller::Identity(id.to_string().into()))
            .map_err(|e| format!(".identity: {e}")),
        (None, Some(account), None) => {
            let (namespace, name) = account.split_once('/').ok_or_else(|| {
                format!(
                    ".serviceAccount: {:?} is not <namespace>/<service account>",
                    shown(account)
                )
            })?;
            // The trust domain does not matter to the check; the names do.
            SpiffeId::new("check", namespace, name).map_err(|e| format!(".serviceAccount: {e}"))?;
            Ok(Caller::ServiceAccount {
                namespace: namespace.into(),
                name: name.into(),
            })
        }
        (None, None, Some(namespace)) => {
            SpiffeId::new("check", namespace, "any").map_err(|e| format!(".namespace: {e}"))?;
            Ok(Caller::Namespace(namespace.as_str().into()))
        }
        _ => Err(": name exactly one of identity, serviceAccount and namespace".to_string()),
    }
}

/// `/a/b` (exact) or `/a/*`, `/a*` (prefix): printable ASCII without spaces, from `/`.
fn check_path(path: &str) -> Result<PathMatch, String> {
    let ok = path.starts_with('/')
        && path.len() <= MAX_PATH
        && path.bytes().all(|b| b.is_ascii_graphic())
        && !path[..path.len() - 1].contains('*');
    if !ok {
        return Err(format!(
            "{:?} is not a path (from '/', at most {MAX_PATH} printable characters without \
             spaces, '*' only at the end)",
            shown(path)
        ));
    }
    Ok(match path.strip_suffix('*') {
        Some(prefix) => PathMatch::Prefix(prefix.into()),
        None => PathMatch::Exact(path.into()),
    })
}

/// At most 64 characters of what a writer gave, for an error message.
fn shown(text: &str) -> String {
    text.chars().take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(yaml: &str) -> Result<Vec<AuthorizationRule>, String> {
        let specs: Vec<RuleSpec> = serde_norway::from_str(yaml).map_err(|e| e.to_string())?;
        check(&specs, &[80, 8080])
    }

    #[test]
    fn reads_each_caller_port_path_and_method() {
        let read = rules(
            "- from: [{serviceAccount: shop/web}, {namespace: billing}, \
             {identity: 'spiffe://other.example/ns/x/sa/y'}]\n  ports: [8080, 80, 8080]\n  \
             paths: [/api/*, /health]\n  methods: [POST, GET]\n- action: deny\n",
        )
        .unwrap();
        assert_eq!(read.len(), 2);
        let allow = &read[0];
        assert_eq!(allow.action, Action::Allow);
        assert_eq!(
            allow.from,
            [
                Caller::Identity("spiffe://other.example/ns/x/sa/y".into()),
                Caller::ServiceAccount {
                    namespace: "shop".into(),
                    name: "web".into()
                },
                Caller::Namespace("billing".into()),
            ]
        );
        assert_eq!(allow.ports, [80, 8080]);
        assert_eq!(
            allow.paths,
            [
                PathMatch::Exact("/health".into()),
                PathMatch::Prefix("/api/".into())
            ]
        );
        assert_eq!(&*allow.methods[0], "GET");
        assert!(allow.is_http() && allow.covers(80) && !allow.covers(443));
        let deny = &read[1];
        assert_eq!(deny.action, Action::Deny);
        assert!(deny.from.is_empty() && deny.covers(443) && !deny.is_http());
    }

    #[test]
    fn refuses_what_it_cannot_read_saying_where() {
        for (yaml, expected) in [
            (
                "- from: [{serviceAccount: web}]",
                "[0].from[0].serviceAccount",
            ),
            ("- from: [{namespace: Shop}]", "[0].from[0].namespace"),
            ("- from: [{identity: web}]", "[0].from[0].identity"),
            (
                "- from: [{namespace: a, serviceAccount: a/b}]",
                "[0].from[0]: name exactly one",
            ),
            ("- from: [{}]", "[0].from[0]: name exactly one"),
            ("- ports: [443]", "[0].ports[0]: 443 is not a port"),
            ("- ports: [-1]", "[0].ports[0]"),
            ("- paths: [api]", "[0].paths[0]"),
            ("- paths: ['/a b']", "[0].paths[0]"),
            ("- paths: ['/*/b']", "[0].paths[0]"),
            ("- methods: [get]", "[0].methods[0]"),
        ] {
            let err = rules(yaml).unwrap_err();
            assert!(err.starts_with(expected), "{yaml}: {err}");
        }
        for yaml in ["- action: permit", "- to: [x]"] {
            assert!(rules(yaml).is_err(), "{yaml}");
        }
        let many = "- {}\n".repeat(MAX_RULES + 1);
        assert!(rules(&many).unwrap_err().contains("more than the"));
        let methods = format!("- methods: [{}]", vec!["GET"; MAX_ENTRIES + 1].join(","));
        assert!(rules(&methods).unwrap_err().contains("more than the"));
    }
}
