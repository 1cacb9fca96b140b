//! Authorization on the inbound listener: a service's rules ([`crate::mesh::authorization`])
//! compiled to Envoy's RBAC filters, in the inbound listener of every proxy whose pod is one
//! of the service's endpoints, at the port the endpoint serves.
//!
//! Each policed port of a pod gets its own filter chains ([`super::inbound`]), whose filters
//! run the deny rules first (an RBAC filter that refuses what any of them matches), then the
//! allow rules, if the port has any (one that refuses what none of them matches). An HTTP port
//! (`http`, `http2`, `grpc`) reads requests (Envoy's HTTP connection manager and HTTP RBAC
//! filter): a refused request gets 403, and rules may name paths and methods. Any other port,
//! or TLS that is not the mesh's, is read as a connection (the network RBAC filter): a
//! refused one is closed, and a rule that names paths or methods cannot be read there, so it
//! fails closed: an allow rule of that kind matches nothing and a deny rule matches whatever
//! its callers are.
//!
//! A caller is known by the SPIFFE ID of its mesh mTLS certificate; plaintext has none, so it
//! matches only rules without `from`.
//!
//! Envoy's RBAC config keeps policies in a map, which protobuf encodes in no fixed order: each
//! filter here holds one policy, so a listener's bytes, hence its version, depend only on the
//! rules.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::listener::v3::{Filter, filter};
use envoy_types::pb::envoy::config::rbac::v3::{
    Permission, Policy, Principal, Rbac as Rules, permission, principal, rbac,
};
use envoy_types::pb::envoy::config::route::v3::{HeaderMatcher, header_matcher};
use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::Rbac as HttpRbac;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpFilter, http_filter,
};
use envoy_types::pb::envoy::extensions::filters::network::rbac::v3::Rbac as NetworkRbac;
use envoy_types::pb::envoy::r#type::matcher::v3::{
    PathMatcher, StringMatcher, path_matcher, string_matcher,
};

use super::typed;
use crate::mesh::{Action, AuthorizationRule, Caller, PathMatch, Service};

/// What holds at one port of a pod (the port the endpoint serves).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortPolicy {
    /// Whether every service that reaches the pod at this port speaks HTTP there: then the
    /// port's chains read requests.
    pub http: bool,
    /// The rules of every service that reaches the pod at this port and covers it, each once,
    /// sorted. Shared by every endpoint of a service that is alone at its port (the usual
    /// case), so a service of many pods holds its rules once.
    pub rules: Arc<[AuthorizationRule]>,
    /// Whether a service that reaches the pod at this port has an allow rule (at this port or
    /// another): then what no allow rule here matches is refused.
    pub allow_list: bool,
}

/// Rules a service may have once its providers' add up: past it the service refuses every
/// call (the listener of each of its pods would carry them all).
pub const MAX_SERVICE_RULES: usize = 256;

/// What holds at a pod's policed ports, by port.
pub type PodPolicy = BTreeMap<u16, PortPolicy>;

/// The policies of every pod that is an endpoint of a service with rules, by address, from
/// all of `services` at once: what [`PolicyIndex`] holds, taken whole, for tests.
#[cfg(test)]
pub fn pod_policies<'a>(services: impl Iterator<Item = &'a Service>) -> HashMap<IpAddr, PodPolicy> {
    let mut index = PolicyIndex::default();
    for service in services {
        index.update(None, Some(service));
    }
    index
        .policies
        .iter()
        .map(|(ip, policy)| (*ip, (**policy).clone()))
        .collect()
}

/// Which service port says something: the service's DNS name and the port.
type Speaker = (Arc<str>, u16);

/// What the service ports that reach a pod port say there.
type Said = BTreeMap<Speaker, Contribution>;

/// What one port of one service says at one pod port.
#[derive(Clone, Debug, PartialEq)]
struct Contribution {
    http: bool,
    allow_list: bool,
    rules: Arc<[AuthorizationRule]>,
}

/// The pods' policies, followed service by service: a change costs the changed service's
/// endpoints, not every policed endpoint of the mesh (a full rebuild at 10k policed services of
/// 10 endpoints took 23-60 ms, plus 13-15 ms to hand on, per change).
#[derive(Clone, Debug, Default)]
pub struct PolicyIndex {
    /// What each service port says at each pod port: by pod address, pod port, then (service
    /// name, service port).
    contributions: HashMap<IpAddr, BTreeMap<u16, Said>>,
    /// Each pod's merged policy, persistent so that each snapshot's listeners share it; a
    /// pod whose policy did not change keeps its `Arc` (and its built listeners).
    policies: imbl::HashMap<IpAddr, Arc<PodPolicy>>,
}

impl PolicyIndex {
    /// A service changed from `old` to `new` (either absent: added or removed).
    pub fn update(&mut self, old: Option<&Service>, new: Option<&Service>) {
        let mut dirty = BTreeSet::new();
        // The rules each service port held: its new contributions share them where they did
        // not change, so the pods of a service keep one copy through its pods' comings and
        // goings.
        let mut held: HashMap<Speaker, Arc<[AuthorizationRule]>> = HashMap::new();
        if let Some(old) = old {
            for (ip, pod_port, key, _) in contributions_of(old) {
                if let Some(ports) = self.contributions.get_mut(&ip)
                    && let Some(at) = ports.get_mut(&pod_port)
                {
                    if let Some(removed) = at.remove(&key) {
                        held.entry(key).or_insert(removed.rules);
                    }
                    if at.is_empty() {
                        ports.remove(&pod_port);
                    }
                }
                dirty.insert(ip);
            }
        }
        if let Some(new) = new {
            for (ip, pod_port, key, mut contribution) in contributions_of(new) {
                if let Some(rules) = held.get(&key)
                    && *rules == contribution.rules
                {
                    contribution.rules = rules.clone();
                }
                self.contributions
                    .entry(ip)
                    .or_default()
                    .entry(pod_port)
                    .or_default()
                    .insert(key, contribution);
                dirty.insert(ip);
            }
        }
        for ip in dirty {
            self.recompute(ip);
        }
    }

    /// Every pod's policy now.
    pub fn policies(&self) -> imbl::HashMap<IpAddr, Arc<PodPolicy>> {
        self.policies.clone()
    }

    fn recompute(&mut self, ip: IpAddr) {
        let ports = match self.contributions.get(&ip) {
            Some(ports) if !ports.is_empty() => ports,
            _ => {
                self.contributions.remove(&ip);
                self.policies.remove(&ip);
                return;
            }
        };
        let policy: PodPolicy = ports
            .iter()
            .map(|(port, said)| (*port, merged(said.values())))
            .collect();
        if self.policies.get(&ip).is_none_or(|held| **held != policy) {
            self.policies.insert(ip, Arc::new(policy));
        }
    }
}

/// What several service ports say at one pod port, together: HTTP only if all speak it, an
/// allow list if any has one, their rules added up (shared when there is one).
fn merged<'a>(said: impl Iterator<Item = &'a Contribution>) -> PortPolicy {
    let said: Vec<&Contribution> = said.collect();
    if let [one] = said[..] {
        return PortPolicy {
            http: one.http,
            rules: one.rules.clone(),
            allow_list: one.allow_list,
        };
    }
    let mut rules: Vec<AuthorizationRule> =
        said.iter().flat_map(|c| c.rules.iter().cloned()).collect();
    rules.sort();
    rules.dedup();
    PortPolicy {
        http: said.iter().all(|c| c.http),
        rules: rules.into(),
        allow_list: said.iter().any(|c| c.allow_list),
    }
}

/// What `service` says at each pod port it reaches: (pod address, pod port, (service name,
/// service port), what). Nothing for a service without rules.
fn contributions_of(service: &Service) -> Vec<(IpAddr, u16, Speaker, Contribution)> {
    let mut out = Vec::new();
    if service.authorization.is_empty() {
        return out;
    }
    let refuse_all = [AuthorizationRule {
        action: Action::Deny,
        from: Vec::new(),
        ports: Vec::new(),
        paths: Vec::new(),
        methods: Vec::new(),
    }];
    let all: &[AuthorizationRule] = if service.authorization.len() > MAX_SERVICE_RULES {
        &refuse_all
    } else {
        &service.authorization
    };
    let allow_list = all.iter().any(|rule| rule.action == Action::Allow);
    let name: Arc<str> = Arc::from(service.dns_name.as_str());
    for port in &service.ports {
        // In canonical order, as the service's rules are.
        let rules: Arc<[AuthorizationRule]> = all
            .iter()
            .filter(|rule| rule.covers(port.port))
            .cloned()
            .collect();
        // A port no rule covers is closed all the same when the service allows by list.
        if rules.is_empty() && !allow_list {
            continue;
        }
        let contribution = Contribution {
            http: port.protocol.is_http(),
            allow_list,
            rules,
        };
        let of_port = |(p, _): &&(u16, std::net::SocketAddr)| *p == port.port;
        let endpoints = port
            .endpoints
            .iter()
            .map(|e| e.address)
            .chain(
                service
                    .instances
                    .iter()
                    .flat_map(|i| &i.endpoints)
                    .filter(of_port)
                    .map(|(_, address)| *address),
            )
            .chain(service.unready.iter().filter(of_port).map(|(_, a)| *a));
        for endpoint in endpoints {
            out.push((
                endpoint.ip(),
                endpoint.port(),
                (name.clone(), port.port),
                contribution.clone(),
            ));
        }
    }
    out
}

/// The RBAC filters of a chain that reads connections (see the module's documentation).
pub(super) fn network_filters(
    policy: &PortPolicy,
    trust_domain: &str,
    stat_prefix: &str,
) -> Vec<Filter> {
    compiled(policy, trust_domain, false)
        .into_iter()
        .map(|(action, rules)| Filter {
            name: "envoy.filters.network.rbac".to_string(),
            config_type: Some(filter::ConfigType::TypedConfig(typed(NetworkRbac {
                rules: Some(rules),
                // Under `tcp.inbound_`, which the bootstrap's statistics keep.
                stat_prefix: format!("tcp.{stat_prefix}.{action}."),
                ..NetworkRbac::default()
            }))),
        })
        .collect()
}

/// The RBAC filters of a chain that reads HTTP requests, before its router.
pub(super) fn http_filters(policy: &PortPolicy, trust_domain: &str) -> Vec<HttpFilter> {
    compiled(policy, trust_domain, true)
        .into_iter()
        .map(|(action, rules)| HttpFilter {
            name: "envoy.filters.http.rbac".to_string(),
            config_type: Some(http_filter::ConfigType::TypedConfig(typed(HttpRbac {
                rules: Some(rules),
                rules_stat_prefix: action.to_string(),
                ..HttpRbac::default()
            }))),
            ..HttpFilter::default()
        })
        .collect()
}

/// The deny filter's rules, if any rule denies, then the allow filter's, if any allows: each
/// with one policy whose principals are the rules (a principal of Envoy's RBAC can say paths
/// and methods too, so a rule is one principal). `http`: whether requests are read.
fn compiled(policy: &PortPolicy, trust_domain: &str, http: bool) -> Vec<(&'static str, Rules)> {
    let mut out = Vec::new();
    for (action, name, envoy_action) in [
        (Action::Deny, "deny", rbac::Action::Deny),
        (Action::Allow, "allow", rbac::Action::Allow),
    ] {
        let rules: Vec<&AuthorizationRule> = policy
            .rules
            .iter()
            .filter(|rule| rule.action == action)
            .collect();
        // No deny rule, no deny filter; no allow list, no allow filter (an allow list whose
        // rules do not cover this port, or all fail closed here, refuses everything).
        let wanted = match action {
            Action::Deny => !rules.is_empty(),
            Action::Allow => policy.allow_list || !rules.is_empty(),
        };
        if !wanted {
            continue;
        }
        let principals: Vec<Principal> = rules
            .iter()
            .filter_map(|rule| principal_of(rule, trust_domain, http))
            .collect();
        // An allow filter whose rules all fail closed here has no policy: it refuses all.
        let policies = if principals.is_empty() {
            HashMap::new()
        } else {
            HashMap::from([(
                name.to_string(),
                Policy {
                    permissions: vec![Permission {
                        rule: Some(permission::Rule::Any(true)),
                    }],
                    principals,
                    ..Policy::default()
                },
            )])
        };
        out.push((
            name,
            Rules {
                action: envoy_action as i32,
                policies,
                ..Rules::default()
            },
        ));
    }
    out
}

/// One rule as one principal: its callers, and, when requests are read, its paths and
/// methods. `None`: an allow rule that cannot be read on a connection (it matches nothing).
fn principal_of(rule: &AuthorizationRule, trust_domain: &str, http: bool) -> Option<Principal> {
    if rule.is_http() && !http && rule.action == Action::Allow {
        return None;
    }
    let mut all = Vec::new();
    if !rule.from.is_empty() {
        all.push(any_of(
            rule.from
                .iter()
                .map(|caller| authenticated(caller, trust_domain))
                .collect(),
        ));
    }
    if http {
        if !rule.paths.is_empty() {
            all.push(any_of(rule.paths.iter().map(path).collect()));
        }
        if !rule.methods.is_empty() {
            all.push(any_of(rule.methods.iter().map(|m| method(m)).collect()));
        }
    }
    Some(match all.len() {
        0 => identifier(principal::Identifier::Any(true)),
        1 => all.remove(0),
        _ => identifier(principal::Identifier::AndIds(principal::Set { ids: all })),
    })
}

fn identifier(id: principal::Identifier) -> Principal {
    Principal {
        identifier: Some(id),
    }
}

fn any_of(mut ids: Vec<Principal>) -> Principal {
    if ids.len() == 1 {
        return ids.remove(0);
    }
    identifier(principal::Identifier::OrIds(principal::Set { ids }))
}

fn matcher(pattern: string_matcher::MatchPattern) -> StringMatcher {
    StringMatcher {
        match_pattern: Some(pattern),
        ..StringMatcher::default()
    }
}

/// The caller's certificate's URI SAN: a SPIFFE ID exactly, or every service account of a
/// namespace (the prefix up to `/sa/`).
fn authenticated(caller: &Caller, trust_domain: &str) -> Principal {
    let pattern = match caller {
        Caller::Identity(id) => string_matcher::MatchPattern::Exact(id.to_string()),
        Caller::ServiceAccount { namespace, name } => string_matcher::MatchPattern::Exact(format!(
            "spiffe://{trust_domain}/ns/{namespace}/sa/{name}"
        )),
        Caller::Namespace(namespace) => string_matcher::MatchPattern::Prefix(format!(
            "spiffe://{trust_domain}/ns/{namespace}/sa/"
        )),
    };
    identifier(principal::Identifier::Authenticated(
        principal::Authenticated {
            principal_name: Some(matcher(pattern)),
        },
    ))
}

/// The request's path, without its query.
fn path(path: &PathMatch) -> Principal {
    let pattern = match path {
        PathMatch::Exact(p) => string_matcher::MatchPattern::Exact(p.to_string()),
        PathMatch::Prefix(p) => string_matcher::MatchPattern::Prefix(p.to_string()),
    };
    identifier(principal::Identifier::UrlPath(PathMatcher {
        rule: Some(path_matcher::Rule::Path(matcher(pattern))),
    }))
}

fn method(method: &str) -> Principal {
    identifier(principal::Identifier::Header(HeaderMatcher {
        name: ":method".to_string(),
        header_match_specifier: Some(header_matcher::HeaderMatchSpecifier::StringMatch(matcher(
            string_matcher::MatchPattern::Exact(method.to_string()),
        ))),
        ..HeaderMatcher::default()
    }))
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::Arc;

    use prost::Message;

    use super::*;
    use crate::mesh::{MeshState, Protocol, ServicePort, ServiceSpec};

    fn rule(action: Action, from: &[&str], ports: &[u16], methods: &[&str]) -> AuthorizationRule {
        AuthorizationRule {
            action,
            from: from
                .iter()
                .map(|ns| Caller::Namespace((*ns).into()))
                .collect(),
            ports: ports.to_vec(),
            paths: Vec::new(),
            methods: methods.iter().map(|m| Arc::from(*m)).collect(),
        }
    }

    fn services(specs: Vec<ServiceSpec>) -> Vec<Arc<Service>> {
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        for spec in specs {
            state.upsert(spec).unwrap();
        }
        state.snapshot().services.values().cloned().collect()
    }

    /// Rules reach the pods that are the service's endpoints, at the ports they serve, only
    /// for the service ports they cover; two services at one pod port add up, and a port that
    /// one of them speaks TCP on is read as connections.
    #[test]
    fn rules_reach_each_endpoint_at_the_port_it_serves() {
        let web_only = rule(Action::Allow, &["shop"], &[80], &[]);
        let every_port = rule(Action::Deny, &["guests"], &[], &["POST"]);
        let web = ServiceSpec::new(
            "/shop/web".parse().unwrap(),
            vec![
                ServicePort::parsed(80, Protocol::Http, &["10.0.0.1:8080", "10.0.0.2:8080"]),
                ServicePort::parsed(9000, Protocol::Tcp, &["10.0.0.1:9000"]),
            ],
        )
        .with_authorization(vec![web_only.clone(), every_port.clone()]);
        let raw = ServiceSpec::new(
            "/shop/raw".parse().unwrap(),
            vec![ServicePort::parsed(7000, Protocol::Tcp, &["10.0.0.2:8080"])],
        )
        .with_authorization(vec![rule(Action::Allow, &["ops"], &[], &[])]);
        let open = ServiceSpec::new(
            "/shop/open".parse().unwrap(),
            vec![ServicePort::parsed(80, Protocol::Http, &["10.0.0.3:80"])],
        );
        let services = services(vec![web, raw, open]);
        let pods = pod_policies(services.iter().map(|s| &**s));
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(pods.len(), 2, "{pods:?}");
        let first = &pods[&ip("10.0.0.1")];
        assert_eq!(first.keys().copied().collect::<Vec<_>>(), [8080, 9000]);
        assert!(first[&8080].http);
        assert_eq!(
            *first[&8080].rules,
            canonical(vec![web_only, every_port.clone()])
        );
        assert!(!first[&9000].http);
        assert_eq!(*first[&9000].rules, [every_port]);
        // The service allows by list, at 80 only: at 9000 every call is refused but denials.
        assert!(first[&9000].allow_list);
        let compiled = compiled(&first[&9000], "cluster.local", false);
        assert_eq!(compiled.len(), 2);
        assert_eq!(compiled[1].0, "allow");
        assert!(
            compiled[1].1.policies.is_empty(),
            "no allow rule covers 9000"
        );
        let second = &pods[&ip("10.0.0.2")][&8080];
        assert!(!second.http, "TCP for one service: read as connections");
        assert_eq!(second.rules.len(), 3);
    }

    fn canonical(rules: Vec<AuthorizationRule>) -> Vec<AuthorizationRule> {
        crate::mesh::authorization::canonical(rules)
    }

    /// Deny first, then allow; on a connection, an allow rule about requests matches nothing
    /// (no policy: refuses all) and a deny rule about requests matches its callers whatever
    /// they ask.
    #[test]
    fn rules_about_requests_fail_closed_on_connections() {
        let policy = PortPolicy {
            http: false,
            allow_list: true,
            rules: vec![
                rule(Action::Allow, &["shop"], &[], &["GET"]),
                rule(Action::Deny, &["guests"], &[], &["POST"]),
            ]
            .into(),
        };
        let compiled = compiled(&policy, "cluster.local", false);
        let actions: Vec<&str> = compiled.iter().map(|(a, _)| *a).collect();
        assert_eq!(actions, ["deny", "allow"]);
        let deny = &compiled[0].1.policies["deny"].principals[0];
        assert_eq!(
            deny,
            &authenticated(&Caller::Namespace("guests".into()), "cluster.local"),
            "the deny rule holds for its callers, whatever they ask"
        );
        assert!(compiled[1].1.policies.is_empty(), "allow matches nothing");
        let http = compiled_bytes(&PortPolicy {
            http: true,
            ..policy
        });
        assert!(!http.is_empty());
    }

    fn compiled_bytes(policy: &PortPolicy) -> Vec<Vec<u8>> {
        compiled(policy, "cluster.local", policy.http)
            .into_iter()
            .map(|(_, rules)| rules.encode_to_vec())
            .collect()
    }

    /// A listener's version is its bytes' hash: the same rules must make the same bytes.
    #[test]
    fn the_same_rules_make_the_same_bytes() {
        let policy = PortPolicy {
            http: true,
            allow_list: true,
            rules: (0..20)
                .map(|i| rule(Action::Allow, &[&format!("ns{i}")], &[], &["GET"]))
                .collect(),
        };
        let first = compiled_bytes(&policy);
        for _ in 0..20 {
            assert_eq!(compiled_bytes(&policy), first);
        }
    }

    /// One service of the model: which of three rule sets, which endpoints (of four pods, two
    /// ports each), which of them not ready, and its protocol.
    #[derive(Clone, Debug)]
    struct ModelService {
        rules: u8,
        endpoints: Vec<(u8, bool)>,
        http: bool,
        target: u16,
    }

    fn model_service() -> impl proptest::strategy::Strategy<Value = ModelService> {
        use proptest::prelude::*;
        (
            0u8..3,
            proptest::collection::vec((0u8..4, any::<bool>()), 0..4),
            any::<bool>(),
            prop_oneof![Just(8080u16), Just(9090u16)],
        )
            .prop_map(|(rules, endpoints, http, target)| ModelService {
                rules,
                endpoints,
                http,
                target,
            })
    }

    fn spec_of(i: usize, model: &ModelService) -> ServiceSpec {
        let address = |pod: u8| SocketAddr::from(([10, 0, 0, pod + 1], model.target));
        let ready: Vec<String> = model
            .endpoints
            .iter()
            .filter(|(_, ready)| *ready)
            .map(|(pod, _)| address(*pod).to_string())
            .collect();
        let ready: Vec<&str> = ready.iter().map(String::as_str).collect();
        let protocol = if model.http {
            Protocol::Http
        } else {
            Protocol::Tcp
        };
        let second: Vec<String> = model
            .endpoints
            .iter()
            .filter(|(_, ready)| *ready)
            .map(|(pod, _)| SocketAddr::from(([10, 0, 0, pod + 1], 7000)).to_string())
            .collect();
        let second: Vec<&str> = second.iter().map(String::as_str).collect();
        let ports = vec![
            ServicePort::parsed(80, protocol, &ready),
            ServicePort::parsed(81, Protocol::Tcp, &second),
        ];
        let rules = match model.rules {
            0 => Vec::new(),
            1 => vec![rule(Action::Allow, &["a"], &[], &[])],
            _ => vec![
                rule(Action::Deny, &["b"], &[80], &["POST"]),
                rule(Action::Allow, &[], &[], &["GET"]),
            ],
        };
        let unready = model
            .endpoints
            .iter()
            .filter(|(_, ready)| !*ready)
            .flat_map(|(pod, _)| {
                [
                    (80, address(*pod)),
                    (81, SocketAddr::from(([10, 0, 0, pod + 1], 7000))),
                ]
            })
            .collect();
        ServiceSpec::new(format!("/m/s{i}").parse().unwrap(), ports)
            .with_authorization(rules)
            .with_unready(unready)
    }

    /// The reference the index is checked against: every service's rules laid on its pods
    /// anew, the plainest way (a list per pod port, rules added when not there yet).
    fn reference(services: &[Arc<Service>]) -> HashMap<IpAddr, PodPolicy> {
        // By pod port: (HTTP, allow list, rules).
        type Laid = BTreeMap<u16, (bool, bool, Vec<AuthorizationRule>)>;
        let mut pods: HashMap<IpAddr, Laid> = HashMap::new();
        for service in services.iter().filter(|s| !s.authorization.is_empty()) {
            let allow_list = service
                .authorization
                .iter()
                .any(|r| r.action == Action::Allow);
            for port in &service.ports {
                let rules: Vec<&AuthorizationRule> = service
                    .authorization
                    .iter()
                    .filter(|r| r.covers(port.port))
                    .collect();
                if rules.is_empty() && !allow_list {
                    continue;
                }
                let mut endpoints: Vec<SocketAddr> =
                    port.endpoints.iter().map(|e| e.address).collect();
                for (p, address) in service
                    .instances
                    .iter()
                    .flat_map(|i| &i.endpoints)
                    .chain(&service.unready)
                {
                    if *p == port.port {
                        endpoints.push(*address);
                    }
                }
                for endpoint in endpoints {
                    let at = pods
                        .entry(endpoint.ip())
                        .or_default()
                        .entry(endpoint.port())
                        .or_insert((true, false, Vec::new()));
                    at.0 &= port.protocol.is_http();
                    at.1 |= allow_list;
                    for rule in &rules {
                        if !at.2.contains(rule) {
                            at.2.push((*rule).clone());
                        }
                    }
                }
            }
        }
        pods.into_iter()
            .map(|(ip, ports)| {
                let policy = ports
                    .into_iter()
                    .map(|(port, (http, allow_list, mut rules))| {
                        rules.sort();
                        let rules = rules.into();
                        (
                            port,
                            PortPolicy {
                                http,
                                rules,
                                allow_list,
                            },
                        )
                    })
                    .collect();
                (ip, policy)
            })
            .collect()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]

        /// The index followed change by change holds what a rebuild from every service holds,
        /// whatever the changes (services sharing pods and ports, rules coming and going,
        /// endpoints becoming ready or not).
        #[test]
        fn the_index_followed_by_changes_is_the_index_built_anew(
            ops in proptest::collection::vec(
                (0usize..4, proptest::option::of(model_service())),
                1..40,
            )
        ) {
            let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
            let mut index = PolicyIndex::default();
            let mut previous = state.snapshot();
            for (i, op) in ops {
                match op {
                    Some(model) => {
                        state.upsert(spec_of(i, &model)).unwrap();
                    }
                    None => {
                        state.remove(&format!("/m/s{i}").parse().unwrap());
                    }
                }
                let current = state.snapshot();
                for change in previous.services.diff(&current.services) {
                    match change {
                        imbl::ordmap::DiffItem::Add(_, new) => index.update(None, Some(new)),
                        imbl::ordmap::DiffItem::Remove(_, old) => index.update(Some(old), None),
                        imbl::ordmap::DiffItem::Update { old: (_, old), new: (_, new) } => {
                            index.update(Some(old), Some(new))
                        }
                    }
                }
                let followed: HashMap<IpAddr, PodPolicy> = index
                    .policies()
                    .iter()
                    .map(|(ip, p)| (*ip, (**p).clone()))
                    .collect();
                let all: Vec<Arc<Service>> = current.services.values().cloned().collect();
                proptest::prop_assert_eq!(&followed, &reference(&all));
                let anew = pod_policies(current.services.values().map(|s| &**s));
                proptest::prop_assert_eq!(followed, anew);
                previous = current;
            }
        }
    }
}
