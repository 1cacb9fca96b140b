//! Route configurations: one per HTTP port on the shared address (`http.<port>`), with one
//! virtual host per service on that port, matched by Host. A service without routing rules
//! sends every request to its own endpoints; a service with rules gets one Envoy route per
//! match, in precedence order ([`RouteTable`]), so the first Envoy route that matches is the
//! rule the Gateway API says should win.

use std::time::Duration as StdDuration;

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{
    DataSource, HeaderValue, HeaderValueOption, data_source,
};
use envoy_types::pb::envoy::config::route::v3::route_action::ClusterNotFoundResponseCode;
use envoy_types::pb::envoy::config::route::v3::weighted_cluster::ClusterWeight;
use envoy_types::pb::envoy::config::route::v3::{
    DirectResponseAction, HeaderMatcher, QueryParameterMatcher, RetryPolicy, Route, RouteAction,
    RouteMatch, VirtualHost, WeightedCluster, header_matcher, query_parameter_matcher,
    retry_policy, route, route_action, route_match,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{RegexMatcher, StringMatcher, string_matcher};
use envoy_types::pb::google::protobuf::{Duration, UInt32Value};

use super::{cluster_name, route_name};
use crate::mesh::route::{
    BackendTarget, HeaderEdits, PathMatch, RequestMatch, RouteRule, RouteTable, ValueCondition,
    ValueMatch,
};
use crate::mesh::{HostHeader, Service, ServiceAddress};
use crate::xds::Part;

/// A cluster name no resource ever has (real ones are `<name>|<port>`): the share of traffic
/// of a backend that could not be resolved goes here, and Envoy answers it with the route's
/// cluster-not-found code, 500.
pub const UNRESOLVED_BACKEND: &str = "lattice-unresolved-backend";

/// What a request gets when its rule sends nowhere (every weight 0, or no backend).
const NO_BACKEND_STATUS: u32 = 500;

/// A service's virtual hosts, one per port, each in the route configuration of its port
/// (`http.<port>`); none for a service that is not on the shared address.
pub fn virtual_hosts(service: &Service) -> Vec<Part> {
    if !matches!(service.address, ServiceAddress::Shared(_)) {
        return Vec::new();
    }
    service
        .ports
        .iter()
        .map(|port| {
            let table = RouteTable::new(&service.routes, port.port);
            if table.is_empty() && !rewrites_host(service) {
                let name = cluster_name(&service.dns_name, port.port);
                let host = plain_virtual_host(&service.dns_name, &name, port.port);
                return Part::virtual_host_encoded(&route_name(port.port), &name, &host);
            }
            let host = virtual_host(service, port.port, table);
            Part::virtual_host(&route_name(port.port), &host.name, &host)
        })
        .collect()
}

/// The one route of a service without routing rules: every path to its own cluster.
fn plain_route(cluster: String) -> Route {
    Route {
        r#match: Some(any_path()),
        action: Some(route::Action::Route(RouteAction {
            cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(cluster)),
            retry_policy: Some(default_retry(None)),
            ..RouteAction::default()
        })),
        ..Route::default()
    }
}

/// The encoded virtual host of a service without routing rules on `port` (`cluster`: its
/// cluster there), byte for byte what prost makes of [`virtual_host`]'s, written straight:
/// building and encoding the message was about a tenth of translating a 50k-service mesh
/// (perf), for the one shape nearly every service has. Fields in the order prost writes
/// them, by field number, oneofs among them (an action's cluster, 1, before its retry
/// policy, 9).
fn plain_virtual_host(dns_name: &str, cluster: &str, port: u16) -> Vec<u8> {
    use super::fields::{bytes_key, delimited_len, put_delimited, put_text};
    // The parts every such host shares, made once with prost: the route's match (field 1),
    // and its action's retry policy (field 9).
    static SHARED: std::sync::LazyLock<(Vec<u8>, Vec<u8>)> = std::sync::LazyLock::new(|| {
        let (mut matched, mut retry) = (Vec::new(), Vec::new());
        prost::encoding::message::encode(1, &any_path(), &mut matched);
        prost::encoding::message::encode(9, &default_retry(None), &mut retry);
        (matched, retry)
    });
    let (matched, retry) = &*SHARED;
    let with_port = format!("{dns_name}:{port}");
    // VirtualHost { name 1, domains 2, routes 3 { match 1, route 2 { cluster 1, retry 9 } } }
    let action_len = delimited_len(cluster.len()) + retry.len();
    let route_len = matched.len() + delimited_len(action_len);
    let host_len = delimited_len(cluster.len())
        + delimited_len(dns_name.len())
        + delimited_len(with_port.len())
        + delimited_len(route_len);
    let mut out = Vec::with_capacity(host_len);
    put_text(&mut out, bytes_key(1), cluster);
    put_text(&mut out, bytes_key(2), dns_name);
    put_text(&mut out, bytes_key(2), &with_port);
    put_delimited(&mut out, bytes_key(3), route_len);
    out.extend_from_slice(matched);
    put_delimited(&mut out, bytes_key(2), action_len);
    put_text(&mut out, bytes_key(1), cluster);
    out.extend_from_slice(retry);
    debug_assert_eq!(out.len(), host_len);
    out
}

/// The service's virtual host on `port` (`table`: its rules there), matched by `name` and
/// `name:port`.
fn virtual_host(service: &Service, port: u16, table: RouteTable) -> VirtualHost {
    let routes = if table.is_empty() {
        vec![plain_route(cluster_name(&service.dns_name, port))]
    } else {
        // A request that matches no rule falls off the end: Envoy answers 404, as the Gateway
        // API asks of a service with routes attached.
        table
            .entries
            .iter()
            .map(|(request, rule)| rule_route(request, rule))
            .collect()
    };
    let routes = if rewrites_host(service) {
        routes.into_iter().map(with_auto_host_rewrite).collect()
    } else {
        routes
    };
    VirtualHost {
        name: cluster_name(&service.dns_name, port),
        domains: vec![
            service.dns_name.clone(),
            format!("{}:{port}", service.dns_name),
        ],
        routes,
        ..VirtualHost::default()
    }
}

/// An external service sends the host name of the endpoint Envoy picked as `Host`, unless it
/// keeps the client's.
fn rewrites_host(service: &Service) -> bool {
    service.host_header == HostHeader::Rewrite && service.ports.iter().any(|p| p.is_external())
}

/// Envoy rewrites `Host` to the chosen upstream host's name, which only DNS clusters have: a
/// rule's backend in an ordinary cluster keeps the client's `Host`.
fn with_auto_host_rewrite(mut route: Route) -> Route {
    if let Some(route::Action::Route(action)) = &mut route.action {
        action.host_rewrite_specifier = Some(route_action::HostRewriteSpecifier::AutoHostRewrite(
            envoy_types::pb::google::protobuf::BoolValue { value: true },
        ));
    }
    route
}

fn any_path() -> RouteMatch {
    RouteMatch {
        path_specifier: Some(route_match::PathSpecifier::Prefix("/".to_string())),
        ..RouteMatch::default()
    }
}

/// Retries what cannot have reached the application, so an endpoint that is going away costs
/// a retry, not a failed request: what a rule without `retry` gets.
fn default_retry(per_try_timeout: Option<StdDuration>) -> RetryPolicy {
    RetryPolicy {
        retry_on: "connect-failure,refused-stream,reset-before-request".to_string(),
        num_retries: Some(UInt32Value { value: 2 }),
        per_try_timeout: per_try_timeout.filter(|d| !d.is_zero()).map(duration),
        ..RetryPolicy::default()
    }
}

fn rule_route(request: &RequestMatch, rule: &RouteRule) -> Route {
    let action = match route_action(rule) {
        Some(action) => route::Action::Route(action),
        None => route::Action::DirectResponse(DirectResponseAction {
            status: NO_BACKEND_STATUS,
            body: Some(DataSource {
                specifier: Some(data_source::Specifier::InlineString(
                    "no backend for this route\n".to_string(),
                )),
                ..DataSource::default()
            }),
            ..DirectResponseAction::default()
        }),
    };
    let edits: &HeaderEdits = &rule.request_headers;
    let header = |(name, value): &(String, String), action: HeaderAppendAction| HeaderValueOption {
        header: Some(HeaderValue {
            key: name.clone(),
            value: value.clone(),
            ..HeaderValue::default()
        }),
        append_action: action as i32,
        ..HeaderValueOption::default()
    };
    Route {
        name: rule.source.to_string(),
        r#match: Some(route_match(request)),
        action: Some(action),
        request_headers_to_add: edits
            .set
            .iter()
            .map(|h| header(h, HeaderAppendAction::OverwriteIfExistsOrAdd))
            .chain(
                edits
                    .add
                    .iter()
                    .map(|h| header(h, HeaderAppendAction::AppendIfExistsOrAdd)),
            )
            .collect(),
        request_headers_to_remove: edits.remove.clone(),
        ..Route::default()
    }
}

/// Where the rule sends a request, or `None` when it sends nowhere (then it answers 500).
fn route_action(rule: &RouteRule) -> Option<RouteAction> {
    // Envoy refuses weighted clusters that add up to 0, and a 0-weight entry carries nothing:
    // leave those out. Unresolved backends share one entry that no cluster answers to.
    let mut clusters: Vec<(String, u32)> = Vec::new();
    let mut unresolved = 0u32;
    for backend in rule.backends.iter().filter(|b| b.weight > 0) {
        match &backend.target {
            BackendTarget::Service { path, port } => {
                clusters.push((cluster_name(&path.dns_name(), *port), backend.weight));
            }
            BackendTarget::Unresolved { .. } => {
                unresolved = unresolved.saturating_add(backend.weight)
            }
        }
    }
    if clusters.is_empty() {
        return None;
    }
    let cluster_specifier = if let ([(name, _)], 0) = (clusters.as_slice(), unresolved) {
        route_action::ClusterSpecifier::Cluster(name.clone())
    } else {
        if unresolved > 0 {
            clusters.push((UNRESOLVED_BACKEND.to_string(), unresolved));
        }
        route_action::ClusterSpecifier::WeightedClusters(WeightedCluster {
            clusters: clusters
                .into_iter()
                .map(|(name, weight)| ClusterWeight {
                    name,
                    weight: Some(UInt32Value { value: weight }),
                    ..ClusterWeight::default()
                })
                .collect(),
            ..WeightedCluster::default()
        })
    };
    let retry_policy = match &rule.retry {
        None => default_retry(rule.backend_timeout),
        Some(retry) => {
            let mut on: Vec<&str> = retry.on.iter().map(|o| o.as_str()).collect();
            if !retry.codes.is_empty() {
                on.push("retriable-status-codes");
            }
            RetryPolicy {
                retry_on: on.join(","),
                num_retries: Some(UInt32Value {
                    value: retry.attempts,
                }),
                // Zero means no per-try limit, which Envoy says by leaving it out.
                per_try_timeout: rule.backend_timeout.filter(|d| !d.is_zero()).map(duration),
                retriable_status_codes: retry.codes.iter().map(|&c| u32::from(c)).collect(),
                retry_back_off: retry.backoff.map(|base| retry_policy::RetryBackOff {
                    base_interval: Some(duration(base)),
                    max_interval: None,
                }),
                ..RetryPolicy::default()
            }
        }
    };
    // With only a per-try timeout, Envoy's 15 s default for the whole request would cut the
    // tries short: lift it, the tries are bounded anyway.
    let timeout = match (rule.timeout, rule.backend_timeout) {
        (Some(timeout), _) => Some(duration(timeout)),
        (None, Some(_)) => Some(duration(StdDuration::ZERO)),
        (None, None) => None,
    };
    Some(RouteAction {
        cluster_specifier: Some(cluster_specifier),
        cluster_not_found_response_code: ClusterNotFoundResponseCode::InternalServerError as i32,
        timeout,
        retry_policy: Some(retry_policy),
        ..RouteAction::default()
    })
}

fn route_match(request: &RequestMatch) -> RouteMatch {
    let path_specifier = match &request.path {
        PathMatch::Exact(path) => route_match::PathSpecifier::Path(path.clone()),
        PathMatch::Prefix(prefix) if prefix == "/" => {
            route_match::PathSpecifier::Prefix(prefix.clone())
        }
        // Whole segments, as the Gateway API's PathPrefix: `/api` takes `/api/x`, not `/apix`.
        PathMatch::Prefix(prefix) => {
            route_match::PathSpecifier::PathSeparatedPrefix(prefix.clone())
        }
        PathMatch::Regex(regex) => route_match::PathSpecifier::SafeRegex(regex_matcher(regex)),
    };
    let method = request.method.iter().map(|method| HeaderMatcher {
        name: ":method".to_string(),
        header_match_specifier: Some(header_matcher::HeaderMatchSpecifier::StringMatch(
            string_matcher(&ValueMatch::Exact(method.clone())),
        )),
        ..HeaderMatcher::default()
    });
    let headers = request.headers.iter().map(|condition| HeaderMatcher {
        name: condition.name.clone(),
        header_match_specifier: Some(match &condition.value {
            ValueMatch::Present => header_matcher::HeaderMatchSpecifier::PresentMatch(true),
            value => header_matcher::HeaderMatchSpecifier::StringMatch(string_matcher(value)),
        }),
        ..HeaderMatcher::default()
    });
    RouteMatch {
        path_specifier: Some(path_specifier),
        headers: method.chain(headers).collect(),
        query_parameters: request.query.iter().map(query_matcher).collect(),
        ..RouteMatch::default()
    }
}

fn query_matcher(condition: &ValueCondition) -> QueryParameterMatcher {
    use query_parameter_matcher::QueryParameterMatchSpecifier;
    QueryParameterMatcher {
        name: condition.name.clone(),
        query_parameter_match_specifier: Some(match &condition.value {
            ValueMatch::Present => QueryParameterMatchSpecifier::PresentMatch(true),
            value => QueryParameterMatchSpecifier::StringMatch(string_matcher(value)),
        }),
    }
}

fn string_matcher(value: &ValueMatch) -> StringMatcher {
    let pattern = match value {
        ValueMatch::Exact(exact) => string_matcher::MatchPattern::Exact(exact.clone()),
        ValueMatch::Regex(regex) => string_matcher::MatchPattern::SafeRegex(regex_matcher(regex)),
        // Presence has matchers of its own; as a string it is "anything".
        ValueMatch::Present => string_matcher::MatchPattern::SafeRegex(regex_matcher(".*")),
    };
    StringMatcher {
        match_pattern: Some(pattern),
        ..StringMatcher::default()
    }
}

fn regex_matcher(regex: &str) -> RegexMatcher {
    RegexMatcher {
        regex: regex.to_string(),
        engine_type: None,
    }
}

fn duration(d: StdDuration) -> Duration {
    Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration as StdDuration;

    use prost::Message;

    use std::sync::Arc;

    use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;

    use super::*;
    use crate::mesh::MeshSnapshot;
    use crate::mesh::route::{Backend, RetryOn, RetryPolicy, test_rule};
    use crate::mesh::{EndpointSet, MeshState, Protocol, ServicePort, ServiceSpec};
    use crate::translate::envoy::EnvoyTranslator;
    use crate::xds::ResourceType;

    proptest::proptest! {
        /// A service without rules gets the bytes prost makes of its virtual host, names of
        /// every length (one- and two-byte lengths) and any port; a part of them, as the
        /// route configuration holds it, decodes as that host.
        #[test]
        fn a_plain_virtual_host_is_the_one_prost_makes(
            dns_name in "[a-z0-9.-]{1,200}",
            port: u16,
        ) {
            let cluster = cluster_name(&dns_name, port);
            let expected = VirtualHost {
                name: cluster.clone(),
                domains: vec![dns_name.clone(), format!("{dns_name}:{port}")],
                routes: vec![plain_route(cluster.clone())],
                ..VirtualHost::default()
            };
            let written = plain_virtual_host(&dns_name, &cluster, port);
            proptest::prop_assert_eq!(&written, &expected.encode_to_vec());
            let part = Part::virtual_host_encoded(&route_name(port), &cluster, &written);
            proptest::prop_assert_eq!(part, Part::virtual_host(&route_name(port), &cluster, &expected));
        }
    }

    fn port(number: u16) -> ServicePort {
        ServicePort {
            name: None,
            port: number,
            protocol: Protocol::Http,
            endpoints: EndpointSet::parsed(&["10.0.0.1:80"]),
            hosts: Default::default(),
        }
    }

    fn backend(path: &str, weight: u32) -> Backend {
        Backend {
            target: BackendTarget::Service {
                path: path.parse().unwrap(),
                port: 8080,
            },
            weight,
        }
    }

    fn rule(index: usize, request: RequestMatch, backends: Vec<Backend>) -> RouteRule {
        test_rule(index, vec![request], backends)
    }

    /// `/shop/web` with `rules` on port 8080 (and 9090), beside its two backends.
    fn mesh(state: &mut MeshState, rules: Vec<RouteRule>) -> Arc<MeshSnapshot> {
        let web = ServiceSpec::new("/shop/web".parse().unwrap(), vec![port(8080), port(9090)])
            .with_routes(rules);
        state
            .replace_all(vec![
                web,
                ServiceSpec::new("/shop/blue".parse().unwrap(), vec![port(8080)]),
                ServiceSpec::new("/shop/green".parse().unwrap(), vec![port(8080)]),
            ])
            .unwrap();
        state.snapshot()
    }

    fn state() -> MeshState {
        MeshState::new("240.240.0.0/16".parse().unwrap())
    }

    /// The Envoy routes of `/shop/web` on `port`.
    fn web_routes(mesh: &MeshSnapshot, port: u16) -> Vec<Route> {
        let xds = EnvoyTranslator::default().translate(mesh);
        let config = &xds.of(ResourceType::Route)[route_name(port).as_str()];
        let config = RouteConfiguration::decode(config.body.value.as_slice()).unwrap();
        config
            .virtual_hosts
            .into_iter()
            .find(|v| v.name == format!("web.shop.system.internal|{port}"))
            .unwrap()
            .routes
    }

    fn action(route: &Route) -> &RouteAction {
        match &route.action {
            Some(route::Action::Route(action)) => action,
            other => panic!("not a route action: {other:?}"),
        }
    }

    #[test]
    fn without_rules_a_service_sends_everything_to_its_own_cluster() {
        let routes = web_routes(&mesh(&mut state(), vec![]), 8080);
        assert_eq!(routes.len(), 1);
        assert_eq!(routes[0].r#match, Some(any_path()));
        assert_eq!(
            action(&routes[0]).cluster_specifier,
            Some(route_action::ClusterSpecifier::Cluster(
                "web.shop.system.internal|8080".into()
            ))
        );
    }

    #[test]
    fn every_field_of_a_rule_reaches_the_envoy_route() {
        let mut split = rule(
            0,
            RequestMatch {
                path: PathMatch::Prefix("/api".into()),
                method: Some("GET".into()),
                headers: vec![
                    ValueCondition {
                        name: "x-release".into(),
                        value: ValueMatch::Exact("green".into()),
                    },
                    ValueCondition {
                        name: "x-trace".into(),
                        value: ValueMatch::Present,
                    },
                ],
                query: vec![ValueCondition {
                    name: "animal".into(),
                    value: ValueMatch::Regex("wh.le".into()),
                }],
            },
            vec![backend("/shop/blue", 90), backend("/shop/green", 10)],
        );
        split.timeout = Some(StdDuration::from_millis(500));
        split.backend_timeout = Some(StdDuration::from_millis(200));
        split.retry = Some(RetryPolicy {
            attempts: 3,
            on: vec![RetryOn::ServerError, RetryOn::ConnectFailure],
            codes: vec![503],
            backoff: Some(StdDuration::from_millis(25)),
        });
        split.request_headers = HeaderEdits {
            set: vec![("x-set".into(), "one".into())],
            add: vec![("x-add".into(), "two".into())],
            remove: vec!["x-remove".into()],
        };
        let routes = web_routes(&mesh(&mut state(), vec![split]), 8080);
        assert_eq!(
            routes.len(),
            1,
            "a service with rules has no catch-all route"
        );
        let route = &routes[0];
        let m = route.r#match.as_ref().unwrap();
        assert_eq!(
            m.path_specifier,
            Some(route_match::PathSpecifier::PathSeparatedPrefix(
                "/api".into()
            ))
        );
        let headers: Vec<(&str, &Option<header_matcher::HeaderMatchSpecifier>)> = m
            .headers
            .iter()
            .map(|h| (h.name.as_str(), &h.header_match_specifier))
            .collect();
        assert_eq!(headers[0].0, ":method");
        assert_eq!(headers[1].0, "x-release");
        assert_eq!(
            headers[2],
            (
                "x-trace",
                &Some(header_matcher::HeaderMatchSpecifier::PresentMatch(true))
            )
        );
        assert_eq!(m.query_parameters[0].name, "animal");

        let action = action(route);
        let Some(route_action::ClusterSpecifier::WeightedClusters(weighted)) =
            &action.cluster_specifier
        else {
            panic!("not weighted: {action:?}")
        };
        let shares: Vec<(&str, u32)> = weighted
            .clusters
            .iter()
            .map(|c| (c.name.as_str(), c.weight.unwrap().value))
            .collect();
        assert_eq!(
            shares,
            [
                ("blue.shop.system.internal|8080", 90),
                ("green.shop.system.internal|8080", 10)
            ]
        );
        assert_eq!(
            action.timeout,
            Some(duration(StdDuration::from_millis(500)))
        );
        let retry = action.retry_policy.as_ref().unwrap();
        assert_eq!(retry.retry_on, "5xx,connect-failure,retriable-status-codes");
        assert_eq!(retry.num_retries, Some(UInt32Value { value: 3 }));
        assert_eq!(retry.retriable_status_codes, [503]);
        assert_eq!(
            retry.per_try_timeout,
            Some(duration(StdDuration::from_millis(200)))
        );
        assert_eq!(
            retry.retry_back_off.as_ref().unwrap().base_interval,
            Some(duration(StdDuration::from_millis(25)))
        );
        let edits: Vec<(&str, i32)> = route
            .request_headers_to_add
            .iter()
            .map(|h| (h.header.as_ref().unwrap().key.as_str(), h.append_action))
            .collect();
        assert_eq!(
            edits,
            [
                ("x-set", HeaderAppendAction::OverwriteIfExistsOrAdd as i32),
                ("x-add", HeaderAppendAction::AppendIfExistsOrAdd as i32)
            ]
        );
        assert_eq!(route.request_headers_to_remove, ["x-remove"]);
    }

    #[test]
    fn zero_weights_answer_500_and_unresolved_shares_too() {
        let zero = rule(
            0,
            RequestMatch {
                path: PathMatch::Exact("/zero".into()),
                ..RequestMatch::any()
            },
            vec![backend("/shop/blue", 0), backend("/shop/green", 0)],
        );
        let partly = rule(
            1,
            RequestMatch::any(),
            vec![
                backend("/shop/blue", 1),
                backend("/shop/green", 0),
                Backend {
                    target: BackendTarget::Unresolved {
                        reason: "no such service".into(),
                    },
                    weight: 1,
                },
            ],
        );
        let routes = web_routes(&mesh(&mut state(), vec![zero, partly]), 8080);
        assert!(matches!(
            &routes[0].action,
            Some(route::Action::DirectResponse(DirectResponseAction {
                status: 500,
                ..
            }))
        ));
        let action = action(&routes[1]);
        let Some(route_action::ClusterSpecifier::WeightedClusters(weighted)) =
            &action.cluster_specifier
        else {
            panic!("not weighted: {action:?}")
        };
        let names: Vec<&str> = weighted.clusters.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            ["blue.shop.system.internal|8080", UNRESOLVED_BACKEND],
            "no 0-weight entry"
        );
        assert_eq!(
            action.cluster_not_found_response_code,
            ClusterNotFoundResponseCode::InternalServerError as i32
        );
    }

    #[test]
    fn routes_go_in_precedence_order_and_only_to_their_port() {
        let prefix = |p: &str| RequestMatch {
            path: PathMatch::Prefix(p.into()),
            ..RequestMatch::any()
        };
        let mut on_9090 = rule(2, prefix("/only-9090"), vec![backend("/shop/blue", 1)]);
        on_9090.port = Some(9090);
        let rules = vec![
            rule(0, prefix("/"), vec![backend("/shop/blue", 1)]),
            rule(1, prefix("/v2"), vec![backend("/shop/green", 1)]),
            on_9090,
        ];
        let snapshot = mesh(&mut state(), rules);
        let paths = |port| -> Vec<Option<route_match::PathSpecifier>> {
            web_routes(&snapshot, port)
                .into_iter()
                .map(|r| r.r#match.unwrap().path_specifier)
                .collect()
        };
        assert_eq!(
            paths(8080),
            [
                Some(route_match::PathSpecifier::PathSeparatedPrefix(
                    "/v2".into()
                )),
                Some(route_match::PathSpecifier::Prefix("/".into()))
            ]
        );
        assert_eq!(paths(9090).len(), 3);
    }

    #[test]
    fn a_rule_change_rebuilds_only_the_route_configuration() {
        let mut state = state();
        let mut translator = EnvoyTranslator::default();
        let before = translator.translate(&mesh(
            &mut state,
            vec![rule(0, RequestMatch::any(), vec![backend("/shop/blue", 1)])],
        ));
        let after = translator.translate(&mesh(
            &mut state,
            vec![rule(
                0,
                RequestMatch::any(),
                vec![backend("/shop/green", 1)],
            )],
        ));
        for kind in [
            ResourceType::Cluster,
            ResourceType::Endpoint,
            ResourceType::Listener,
        ] {
            assert!(
                before.of(kind).ptr_eq(after.of(kind)),
                "{kind:?} changed with a rule"
            );
        }
        let changed: Vec<&str> = after
            .of(ResourceType::Route)
            .iter()
            .filter(|(name, r)| before.of(ResourceType::Route)[*name].version != r.version)
            .map(|(name, _)| &**name)
            .collect();
        assert_eq!(
            changed,
            ["http.8080", "http.9090"],
            "the parent's ports only"
        );
    }
}
