//! A proxy's inbound listener: where `lattice-init --inbound-capture` sends the TCP that
//! arrives for its pod, on [`ENVOY_INBOUND_PORT`]. It is not one of the mesh's resources:
//! each Envoy snapshot carries an [`Inbound`], from which a proxy gets its pod's listener in
//! its own view, beside its secrets, when its pod asks for inbound capture: for the pod's mode
//! (`identity::InboundMode`), its address's authorization rules ([`super::authorization`]),
//! and its kubelet probes.
//!
//! A connection keeps its original destination (the original_dst listener filter) and picks a
//! chain by what it starts with (the tls_inspector):
//! - TLS offering the mesh ALPN ([`MESH_ALPN`]): mutual TLS, terminated with the proxy's own
//!   certificate (SDS `default`); the client must present a certificate that chains to the
//!   trust bundle (SDS `ROOTCA`) and names a SPIFFE ID of the trust domain;
//! - anything else (plaintext, or an app's own TLS): handed on as it is in `permissive` mode,
//!   refused (closed unanswered) in `strict` mode;
//! - a connection for one of Envoy's own ports: closed, since handing it to the app at its
//!   original destination would hand it back to Envoy.
//!
//! What passes goes to the app at its original destination through the bootstrap's static
//! [`INBOUND_PASSTHROUGH_CLUSTER`], and a line goes to Envoy's stderr with the caller's
//! SPIFFE ID (`-` for plaintext) when the app's side is connected, and another when the
//! connection ends.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use envoy_types::pb::envoy::config::accesslog::v3::{AccessLog, access_log};
use envoy_types::pb::envoy::config::core::v3::{
    DataSource, SubstitutionFormatString, TrafficDirection, TransportSocket, data_source,
    substitution_format_string, transport_socket,
};
use envoy_types::pb::envoy::config::listener::v3::{
    Filter, FilterChain, FilterChainMatch, Listener, ListenerFilter, filter, listener_filter,
};
use envoy_types::pb::envoy::config::route::v3::{
    Route, RouteAction, RouteConfiguration, RouteMatch, VirtualHost, route, route_action,
    route_match,
};
use envoy_types::pb::envoy::extensions::access_loggers::stream::v3::{
    StderrAccessLog, stderr_access_log,
};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::listener::original_dst::v3::OriginalDst;
use envoy_types::pb::envoy::extensions::filters::listener::tls_inspector::v3::TlsInspector;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, HttpFilter, http_connection_manager, http_filter,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{
    TcpProxy, UpstreamConnectMode, tcp_proxy,
};
use envoy_types::pb::google::protobuf::{BoolValue, Duration, UInt32Value};
use lattice_contract::{
    CapturePort, ENVOY_ADMIN_PORT, ENVOY_INBOUND_PORT, ENVOY_READINESS_PORT,
    INBOUND_PASSTHROUGH_CLUSTER,
};

use super::authorization::{self, PodPolicy, PortPolicy};
use super::{mtls, socket_address, typed};
use crate::mesh::{Action, AuthorizationRule, PathMatch};
use crate::xds::snapshot::XdsResource;
use crate::xds::{InboundListeners, InboundMode, InboundProbe, ProbeKind};

/// The inbound listener's name in every proxy.
pub const INBOUND_LISTENER: &str = "lattice-inbound";

/// How long the tls_inspector waits for a client's first bytes. A protocol whose server
/// speaks first (SMTP, MySQL) sends nothing, so after this the connection goes on as
/// plaintext: in permissive mode such a port answers this much later (exclude it from capture
/// to avoid that), in strict mode it is refused.
const FIRST_BYTES_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The inbound listener of a pod in `strict` mode or not, for proxies whose peers' SPIFFE IDs
/// are in `trust_domain`, in pods whose capture port is `capture`, with `policy` at its policed
/// ports (see [`super::authorization`]) and the kubelet's `probes` let through.
///
/// `strict`: what is not mesh mTLS is refused; else it is handed on as it came.
///
/// `mtls`: whether the proxy holds its leaf. Until it does (no CA yet, its leaf being issued,
/// or refused), mesh mTLS is closed at once rather than waited for, and the rest goes as the
/// mode says, so a permissive pod takes plaintext from its first moment and a strict one its
/// kubelet's probes.
pub(super) fn listener(
    strict: bool,
    trust_domain: &str,
    capture: CapturePort,
    policy: Option<&PodPolicy>,
    probes: &[InboundProbe],
    mtls: bool,
) -> Listener {
    let own_ports = [
        ENVOY_ADMIN_PORT,
        capture.get(),
        ENVOY_INBOUND_PORT,
        ENVOY_READINESS_PORT,
    ];
    let mut filter_chains: Vec<FilterChain> = own_ports
        .into_iter()
        .map(|port| FilterChain {
            name: format!("envoy-port-{port}"),
            filter_chain_match: Some(port_match(port)),
            // A cluster no proxy has: the connection is closed.
            filters: vec![tcp_proxy(Handoff::Refuse)],
            ..FilterChain::default()
        })
        .collect();
    filter_chains.push(mesh_chain(
        "mtls".to_string(),
        None,
        trust_domain,
        mtls,
        || vec![tcp_proxy(Handoff::Mtls)],
    ));
    // Ports with chains of their own: those with rules, and, in strict mode, those the
    // kubelet probes (in permissive mode its plaintext passes the default chain).
    let mut ports: BTreeSet<u16> = policy.into_iter().flatten().map(|(p, _)| *p).collect();
    if strict {
        ports.extend(probes.iter().map(|p| p.port));
    }
    for port in ports {
        if own_ports.contains(&port) {
            continue;
        }
        let at: Vec<&InboundProbe> = probes.iter().filter(|p| p.port == port).collect();
        let policy = policy.and_then(|p| p.get(&port));
        filter_chains.extend(port_chains(strict, trust_domain, port, policy, &at, mtls));
    }
    // Strict: no default chain, so Envoy closes the connection (`no_filter_chain_match` in
    // its listener statistics).
    let default_filter_chain = (!strict).then(|| FilterChain {
        name: "plaintext".to_string(),
        filters: vec![tcp_proxy(Handoff::Plaintext)],
        ..FilterChain::default()
    });
    Listener {
        name: INBOUND_LISTENER.to_string(),
        address: Some(socket_address("0.0.0.0".to_string(), ENVOY_INBOUND_PORT)),
        traffic_direction: TrafficDirection::Inbound as i32,
        listener_filters: vec![
            listener_filter(
                "envoy.filters.listener.original_dst",
                typed(OriginalDst::default()),
            ),
            listener_filter(
                "envoy.filters.listener.tls_inspector",
                typed(TlsInspector::default()),
            ),
        ],
        listener_filters_timeout: Some(Duration {
            seconds: FIRST_BYTES_WAIT.as_secs() as i64,
            nanos: 0,
        }),
        continue_on_listener_filters_timeout: true,
        filter_chains,
        default_filter_chain,
        ..Listener::default()
    }
}

/// The chains of a port with rules or probes to let through. Envoy picks a chain by
/// destination port first and never goes back to a less specific one: once a port has chains
/// of its own, every kind of connection to it needs one, or it falls to the listener's default
/// chain, past the rules. So, beside mesh mTLS: in permissive mode, plaintext and TLS that is
/// not the mesh's (read as a connection); in strict mode, only what the kubelet's probes need,
/// and what finds no chain is closed, as at every other port.
///
/// The kubelet calls without an identity, from the node. An HTTP probe's GET of its path, and
/// a gRPC probe's health Check, pass an HTTP chain of the port (whatever else comes in
/// plaintext gets 403 in strict mode, or what the rules say).
fn port_chains(
    strict: bool,
    trust_domain: &str,
    port: u16,
    policy: Option<&PortPolicy>,
    probes: &[&InboundProbe],
    mtls: bool,
) -> Vec<FilterChain> {
    let reads = |handoff: Handoff, policy: &PortPolicy| -> Vec<Filter> {
        if policy.http && handoff != Handoff::OtherTls {
            return vec![http_manager(handoff, port, policy, trust_domain)];
        }
        let mut filters = authorization::network_filters(
            policy,
            trust_domain,
            &format!("inbound_{}_{port}", handoff.name()),
        );
        filters.push(tcp_proxy(handoff));
        filters
    };
    // What the kubelet sends in plaintext, as rules any caller passes.
    let mut probed = Vec::new();
    let paths: Vec<PathMatch> = probes
        .iter()
        .filter_map(|p| match &p.kind {
            ProbeKind::Http(path) => Some(PathMatch::Exact(path.clone())),
            _ => None,
        })
        .collect();
    let allowing = |paths: Vec<PathMatch>, method: &str| AuthorizationRule {
        action: Action::Allow,
        from: Vec::new(),
        ports: Vec::new(),
        paths,
        methods: vec![Arc::from(method)],
    };
    if !paths.is_empty() {
        probed.push(allowing(paths, "GET"));
    }
    if probes.iter().any(|p| p.kind == ProbeKind::Grpc) {
        let check = PathMatch::Exact(Arc::from(GRPC_HEALTH_CHECK));
        probed.push(allowing(vec![check], "POST"));
    }
    let mut chains = vec![mesh_chain(
        format!("mtls-{port}"),
        Some(port),
        trust_domain,
        mtls,
        || match policy {
            Some(policy) => reads(Handoff::Mtls, policy),
            None => vec![tcp_proxy(Handoff::Mtls)],
        },
    )];
    let other_tls = if strict {
        None
    } else {
        policy.map(|policy| reads(Handoff::OtherTls, policy))
    };
    let plaintext = if !probed.is_empty() {
        // The probes prove the port speaks HTTP, whatever its services say. In strict mode
        // they are all plaintext may do; otherwise they join the rules, where the rules refuse
        // what they do not allow (beside deny rules alone, any call passes anyway).
        let (mut rules, allow_list) = match policy {
            Some(policy) if !strict => (policy.rules.to_vec(), policy.allow_list),
            _ => (Vec::new(), true),
        };
        if allow_list {
            rules.extend(probed);
        }
        let policy = PortPolicy {
            http: true,
            rules: rules.into(),
            allow_list,
        };
        Some(vec![http_manager(
            Handoff::Plaintext,
            port,
            &policy,
            trust_domain,
        )])
    } else if strict {
        None
    } else {
        policy.map(|policy| reads(Handoff::Plaintext, policy))
    };
    if let Some(filters) = other_tls {
        chains.push(FilterChain {
            name: format!("other-tls-{port}"),
            filter_chain_match: Some(FilterChainMatch {
                transport_protocol: "tls".to_string(),
                ..port_match(port)
            }),
            filters,
            ..FilterChain::default()
        });
    }
    if let Some(filters) = plaintext {
        chains.push(FilterChain {
            name: format!("plaintext-{port}"),
            filter_chain_match: Some(port_match(port)),
            filters,
            ..FilterChain::default()
        });
    }
    chains
}

/// The path of the gRPC health service's Check, which a `grpc` probe calls.
const GRPC_HEALTH_CHECK: &str = "/grpc.health.v1.Health/Check";

fn port_match(port: u16) -> FilterChainMatch {
    FilterChainMatch {
        destination_port: Some(UInt32Value {
            value: u32::from(port),
        }),
        ..FilterChainMatch::default()
    }
}

/// TLS offering the mesh ALPN, at `port` or any.
fn mesh_match(port: Option<u16>) -> FilterChainMatch {
    FilterChainMatch {
        transport_protocol: "tls".to_string(),
        application_protocols: vec![lattice_contract::MESH_ALPN.to_string()],
        ..port.map(port_match).unwrap_or_default()
    }
}

/// The chain of mesh mTLS (at `port`, or any): terminated and read by `filters` when the
/// proxy holds its leaf, else closed (no certificate to answer with, and handing the
/// handshake to the app would only confuse it).
fn mesh_chain(
    name: String,
    port: Option<u16>,
    trust_domain: &str,
    mtls: bool,
    filters: impl FnOnce() -> Vec<Filter>,
) -> FilterChain {
    let (transport_socket, filters) = if mtls {
        (Some(mtls_socket(trust_domain)), filters())
    } else {
        (None, vec![tcp_proxy(Handoff::Refuse)])
    };
    FilterChain {
        name,
        filter_chain_match: Some(mesh_match(port)),
        transport_socket,
        filters,
        ..FilterChain::default()
    }
}

fn mtls_socket(trust_domain: &str) -> TransportSocket {
    TransportSocket {
        name: "envoy.transport_sockets.tls".to_string(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(typed(
            mtls::downstream(trust_domain),
        ))),
    }
}

/// Reads the requests of a policed HTTP port: its rules, then on to the app at the
/// connection's original destination. A mesh caller's SPIFFE ID reaches the app in
/// `x-forwarded-client-cert` (`URI=...`); whatever a caller sent in that header is dropped.
fn http_manager(handoff: Handoff, port: u16, policy: &PortPolicy, trust_domain: &str) -> Filter {
    let mut http_filters = authorization::http_filters(policy, trust_domain);
    http_filters.push(HttpFilter {
        name: "envoy.filters.http.router".to_string(),
        config_type: Some(http_filter::ConfigType::TypedConfig(typed(
            Router::default(),
        ))),
        ..HttpFilter::default()
    });
    let to_app = Route {
        r#match: Some(RouteMatch {
            path_specifier: Some(route_match::PathSpecifier::Prefix("/".to_string())),
            ..RouteMatch::default()
        }),
        action: Some(route::Action::Route(RouteAction {
            cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(
                INBOUND_PASSTHROUGH_CLUSTER.to_string(),
            )),
            // As long as the app takes: the caller's own Envoy keeps the route's timeout.
            timeout: Some(Duration::default()),
            ..RouteAction::default()
        })),
        ..Route::default()
    };
    let mtls = handoff == Handoff::Mtls;
    let manager = HttpConnectionManager {
        stat_prefix: format!("inbound_{}_{port}", handoff.name()),
        codec_type: http_connection_manager::CodecType::Auto as i32,
        route_specifier: Some(http_connection_manager::RouteSpecifier::RouteConfig(
            RouteConfiguration {
                name: INBOUND_LISTENER.to_string(),
                virtual_hosts: vec![VirtualHost {
                    name: "app".to_string(),
                    domains: vec!["*".to_string()],
                    routes: vec![to_app],
                    ..VirtualHost::default()
                }],
                ..RouteConfiguration::default()
            },
        )),
        http_filters,
        forward_client_cert_details: if mtls {
            http_connection_manager::ForwardClientCertDetails::SanitizeSet
        } else {
            http_connection_manager::ForwardClientCertDetails::Sanitize
        } as i32,
        set_current_client_cert_details: mtls.then(|| {
            http_connection_manager::SetCurrentClientCertDetails {
                uri: true,
                ..Default::default()
            }
        }),
        // Rules read the path as the app will: `/a/../b`, `//b` and `%2F` must not reach
        // the app past a rule about `/b` (RFC 3986 normalisation, merged slashes, escaped
        // slashes refused), as Istio's and Linkerd's inbound proxies do.
        normalize_path: Some(BoolValue { value: true }),
        merge_slashes: true,
        path_with_escaped_slashes_action:
            http_connection_manager::PathWithEscapedSlashesAction::RejectRequest as i32,
        // A passthrough in all but the rules: WebSocket upgrades go on, and a quiet stream is
        // the app's to time out, as with the TCP handoff.
        upgrade_configs: vec![http_connection_manager::UpgradeConfig {
            upgrade_type: "websocket".to_string(),
            ..Default::default()
        }],
        stream_idle_timeout: Some(Duration::default()),
        access_log: access_log(&format!(
            "[{INBOUND_LISTENER}] {} peer=%DOWNSTREAM_PEER_URI_SAN% from=%DOWNSTREAM_REMOTE_ADDRESS% to=%UPSTREAM_HOST% request=%REQ(:METHOD)% %REQ(:PATH)% code=%RESPONSE_CODE% flags=%RESPONSE_FLAGS%\n",
            handoff.name()
        )),
        ..HttpConnectionManager::default()
    };
    Filter {
        name: "envoy.filters.network.http_connection_manager".to_string(),
        config_type: Some(filter::ConfigType::TypedConfig(typed(manager))),
    }
}

fn listener_filter(name: &str, config: envoy_types::pb::google::protobuf::Any) -> ListenerFilter {
    ListenerFilter {
        name: name.to_string(),
        config_type: Some(listener_filter::ConfigType::TypedConfig(config)),
        ..ListenerFilter::default()
    }
}

/// What a chain does with its connections.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Handoff {
    /// Closes them: a proxy to a cluster no proxy has.
    Refuse,
    /// Hands them to the app once the mesh mTLS handshake is over.
    Mtls,
    /// Hands them to the app as they came.
    Plaintext,
    /// Hands on TLS that is not the mesh's (an app's own) as it came: at a policed port, where
    /// it needs a chain of its own.
    OtherTls,
}

impl Handoff {
    /// Its name in the statistics (`tcp.inbound_<name>`) and the access log.
    fn name(self) -> &'static str {
        match self {
            Handoff::Refuse => "envoy_port",
            Handoff::Mtls => "mtls",
            Handoff::Plaintext => "plaintext",
            Handoff::OtherTls => "other_tls",
        }
    }
}

fn tcp_proxy(handoff: Handoff) -> Filter {
    let stat_prefix = handoff.name();
    let logged = handoff != Handoff::Refuse;
    let cluster = match handoff {
        Handoff::Refuse => "lattice-inbound-refused",
        Handoff::Mtls | Handoff::Plaintext | Handoff::OtherTls => INBOUND_PASSTHROUGH_CLUSTER,
    };
    let access_log = if logged {
        access_log(&format!(
            "[{INBOUND_LISTENER}] {stat_prefix} peer=%DOWNSTREAM_PEER_URI_SAN% from=%DOWNSTREAM_REMOTE_ADDRESS% to=%UPSTREAM_HOST% flags=%RESPONSE_FLAGS% received=%BYTES_RECEIVED% sent=%BYTES_SENT%\n"
        ))
    } else {
        Vec::new()
    };
    // A mesh caller reaches the app only once its certificate is checked: the app's side is
    // not connected before the handshake is over (and what the caller sends meanwhile is
    // held, up to `max_early_data_bytes`). Plaintext connects at once.
    let (upstream_connect_mode, max_early_data_bytes) = match handoff {
        Handoff::Mtls => (
            UpstreamConnectMode::OnDownstreamTlsHandshake as i32,
            Some(UInt32Value { value: 64 * 1024 }),
        ),
        Handoff::Refuse | Handoff::Plaintext | Handoff::OtherTls => {
            (UpstreamConnectMode::Immediate as i32, None)
        }
    };
    let proxy = TcpProxy {
        stat_prefix: format!("inbound_{stat_prefix}"),
        upstream_connect_mode,
        max_early_data_bytes,
        cluster_specifier: Some(tcp_proxy::ClusterSpecifier::Cluster(cluster.to_string())),
        // A line once the app's side is connected, not only when the connection ends: a
        // calling proxy keeps its connections open for many requests.
        access_log_options: logged.then(|| tcp_proxy::TcpAccessLogOptions {
            flush_access_log_on_connected: true,
            ..tcp_proxy::TcpAccessLogOptions::default()
        }),
        access_log,
        ..TcpProxy::default()
    };
    Filter {
        name: "envoy.filters.network.tcp_proxy".to_string(),
        config_type: Some(filter::ConfigType::TypedConfig(typed(proxy))),
    }
}

/// The inbound listeners of one translation: one per mode shared by every pod without rules
/// or probes to let through, and one per pod, mode and probes otherwise, built when a proxy of
/// that pod first asks (a node runs a few of the mesh's pods; the policies cover them all).
#[derive(Debug)]
pub struct Inbound {
    trust_domain: Arc<str>,
    capture: CapturePort,
    /// The listeners shared by pods without rules or probes to let through, by
    /// [`shared_index`]: permissive or strict, with the proxy's leaf or not yet.
    shared: [Arc<XdsResource>; 4],
    /// The policed pods' policies (shared with the translator's index).
    pods: imbl::HashMap<IpAddr, Arc<PodPolicy>>,
    /// The listeners built for pods of their own, kept across translations while the pod's
    /// policy stands.
    built: Mutex<HashMap<ListenerKey, Arc<XdsResource>>>,
}

/// A pod's listener is its policy's (by its address), its mode's (strict or not), its
/// probes', and whether its proxy holds its leaf.
type ListenerKey = (IpAddr, bool, Vec<InboundProbe>, bool);

fn shared_index(strict: bool, mtls: bool) -> usize {
    usize::from(strict) * 2 + usize::from(mtls)
}

/// Listeners kept at most: several times a node's pods; past it, they are built again as
/// their proxies ask (addresses are reused, so old entries would otherwise pile up).
const MAX_BUILT: usize = 2048;

impl Inbound {
    /// For `pods`' policies (see [`authorization::PolicyIndex`]). What `previous` built for a
    /// pod whose policy did not change (the same `Arc`) is kept, so its proxies see no change.
    pub fn new(
        trust_domain: Arc<str>,
        capture: CapturePort,
        pods: imbl::HashMap<IpAddr, Arc<PodPolicy>>,
        previous: Option<&Inbound>,
    ) -> Inbound {
        let shared = match previous {
            Some(previous) => previous.shared.clone(),
            None => [(false, false), (false, true), (true, false), (true, true)].map(
                |(strict, mtls)| {
                    XdsResource::new(
                        INBOUND_LISTENER,
                        listener(strict, &trust_domain, capture, None, &[], mtls),
                    )
                },
            ),
        };
        let built = match previous {
            Some(previous) => {
                let mut built = lock(&previous.built).clone();
                built.retain(
                    |(ip, _, _, _), _| match (previous.pods.get(ip), pods.get(ip)) {
                        (None, None) => true,
                        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                        _ => false,
                    },
                );
                built
            }
            None => HashMap::new(),
        };
        Inbound {
            trust_domain,
            capture,
            shared,
            pods,
            built: Mutex::new(built),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

impl InboundListeners for Inbound {
    fn listener(
        &self,
        pod: IpAddr,
        mode: InboundMode,
        probes: &[InboundProbe],
        mtls: bool,
    ) -> Arc<XdsResource> {
        let strict = mode == InboundMode::Strict;
        let policy = self.pods.get(&pod);
        // Probes need chains of their own only where plaintext is refused.
        if policy.is_none() && (!strict || probes.is_empty()) {
            return self.shared[shared_index(strict, mtls)].clone();
        }
        let key = (pod, strict, probes.to_vec(), mtls);
        let mut built = lock(&self.built);
        if let Some(listener) = built.get(&key) {
            return listener.clone();
        }
        let listener = XdsResource::new(
            INBOUND_LISTENER,
            listener(
                strict,
                &self.trust_domain,
                self.capture,
                policy.map(|p| &**p),
                probes,
                mtls,
            ),
        );
        if built.len() >= MAX_BUILT {
            built.clear();
        }
        built.insert(key, listener.clone());
        listener
    }

    fn rules(&self, pod: IpAddr) -> usize {
        self.pods
            .get(&pod)
            .map_or(0, |p| p.values().map(|port| port.rules.len()).sum())
    }
}

/// A line to Envoy's stderr per connection or request, in `format`.
fn access_log(format: &str) -> Vec<AccessLog> {
    vec![AccessLog {
        name: "envoy.access_loggers.stderr".to_string(),
        config_type: Some(access_log::ConfigType::TypedConfig(typed(
            StderrAccessLog {
                access_log_format: Some(stderr_access_log::AccessLogFormat::LogFormat(
                    SubstitutionFormatString {
                        format: Some(substitution_format_string::Format::TextFormatSource(
                            DataSource {
                                specifier: Some(data_source::Specifier::InlineString(
                                    format.to_string(),
                                )),
                                ..DataSource::default()
                            },
                        )),
                        ..SubstitutionFormatString::default()
                    },
                )),
            },
        ))),
        ..AccessLog::default()
    }]
}

#[cfg(test)]
mod tests {
    use lattice_contract::MESH_ALPN;

    use super::*;
    use crate::xds::InboundMode;

    fn decoded(mode: InboundMode) -> Listener {
        listener(
            mode == InboundMode::Strict,
            "cluster.local",
            CapturePort::default(),
            None,
            &[],
            true,
        )
    }

    #[test]
    fn strict_has_no_plaintext_chain_and_permissive_hands_plaintext_on() {
        let strict = decoded(InboundMode::Strict);
        assert_eq!(strict.default_filter_chain, None);
        let permissive = decoded(InboundMode::Permissive);
        assert_eq!(
            permissive
                .default_filter_chain
                .as_ref()
                .map(|c| c.name.clone()),
            Some("plaintext".to_string())
        );
        for listener in [strict, permissive] {
            let names: Vec<&str> = listener
                .filter_chains
                .iter()
                .map(|c| c.name.as_str())
                .collect();
            assert_eq!(
                names,
                [
                    "envoy-port-15000",
                    "envoy-port-15001",
                    "envoy-port-15006",
                    "envoy-port-15021",
                    "mtls"
                ]
            );
            let mtls = listener.filter_chains.last().unwrap();
            let matched = mtls.filter_chain_match.as_ref().unwrap();
            assert_eq!(matched.application_protocols, [MESH_ALPN]);
        }
    }

    /// Until its proxy holds its leaf, a pod's listener closes mesh mTLS, at every port, and
    /// needs no secret (Envoy would wait for it); the rest goes as the mode says.
    #[test]
    fn without_its_leaf_a_pod_closes_mesh_mtls_and_takes_the_rest_by_its_mode() {
        let rule = AuthorizationRule {
            action: Action::Deny,
            from: Vec::new(),
            ports: Vec::new(),
            paths: Vec::new(),
            methods: vec![Arc::from("DELETE")],
        };
        let policy: PodPolicy = [(
            8080,
            PortPolicy {
                http: true,
                rules: vec![rule].into(),
                allow_list: false,
            },
        )]
        .into();
        let probes = [InboundProbe {
            port: 9090,
            kind: ProbeKind::Http(Arc::from("/healthz")),
        }];
        for strict in [false, true] {
            let built = listener(
                strict,
                "cluster.local",
                CapturePort::default(),
                Some(&policy),
                &probes,
                false,
            );
            // No TLS anywhere, so no secret named: Envoy would wait for it.
            assert!(
                built
                    .filter_chains
                    .iter()
                    .all(|c| c.transport_socket.is_none())
            );
            for chain in &built.filter_chains {
                let mesh = chain
                    .filter_chain_match
                    .as_ref()
                    .is_some_and(|m| m.application_protocols == [MESH_ALPN]);
                if mesh {
                    assert!(chain.transport_socket.is_none(), "{}", chain.name);
                    assert_eq!(
                        chain.filters,
                        [tcp_proxy(Handoff::Refuse)],
                        "{}",
                        chain.name
                    );
                }
            }
            let names: Vec<&str> = built
                .filter_chains
                .iter()
                .map(|c| c.name.as_str())
                .collect();
            assert!(
                names.contains(&"mtls") && names.contains(&"mtls-8080"),
                "{names:?}"
            );
            assert!(names.contains(&"plaintext-9090") == strict, "{names:?}");
            assert_eq!(built.default_filter_chain.is_some(), !strict);
        }
    }

    /// A policed port has chains of its own for every kind of connection in permissive mode
    /// (else what has none falls to the default chain, past the rules), and for mesh mTLS
    /// only in strict mode; an HTTP port reads requests, a TCP one connections.
    #[test]
    fn a_policed_port_has_a_chain_for_every_kind_of_connection() {
        use crate::mesh::{Action, AuthorizationRule};
        let rule = AuthorizationRule {
            action: Action::Allow,
            from: Vec::new(),
            ports: Vec::new(),
            paths: Vec::new(),
            methods: Vec::new(),
        };
        let policy: PodPolicy = [
            (
                8080,
                PortPolicy {
                    http: true,
                    rules: vec![rule.clone()].into(),
                    allow_list: true,
                },
            ),
            (
                5432,
                PortPolicy {
                    http: false,
                    rules: vec![rule].into(),
                    allow_list: true,
                },
            ),
        ]
        .into();
        let chains = |strict, probes: &[InboundProbe]| {
            let listener = listener(
                strict,
                "cluster.local",
                CapturePort::default(),
                Some(&policy),
                probes,
                true,
            );
            listener
                .filter_chains
                .into_iter()
                .skip(5)
                .map(|c| {
                    let filters: Vec<String> = c.filters.iter().map(|f| f.name.clone()).collect();
                    (c.name, filters.join(","))
                })
                .collect::<Vec<_>>()
        };
        let hcm = "envoy.filters.network.http_connection_manager";
        let tcp = "envoy.filters.network.rbac,envoy.filters.network.tcp_proxy";
        let pairs = |list: &[(&str, &str)]| -> Vec<(String, String)> {
            list.iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect()
        };
        assert_eq!(
            chains(false, &[]),
            pairs(&[
                ("mtls-5432", tcp),
                ("other-tls-5432", tcp),
                ("plaintext-5432", tcp),
                ("mtls-8080", hcm),
                ("other-tls-8080", tcp),
                ("plaintext-8080", hcm),
            ])
        );
        assert_eq!(
            chains(true, &[]),
            pairs(&[("mtls-5432", tcp), ("mtls-8080", hcm)])
        );

        // The kubelet's probes: an HTTP one's GET and a gRPC one's Check pass a strict pod's
        // plaintext chain; a permissive pod's unpoliced ports need nothing.
        let probes = [
            InboundProbe {
                port: 8080,
                kind: ProbeKind::Http(Arc::from("/healthz")),
            },
            InboundProbe {
                port: 9000,
                kind: ProbeKind::Grpc,
            },
        ];
        let proxy = "envoy.filters.network.tcp_proxy";
        assert_eq!(
            chains(true, &probes),
            pairs(&[
                ("mtls-5432", tcp),
                ("mtls-8080", hcm),
                ("plaintext-8080", hcm),
                ("mtls-9000", proxy),
                ("plaintext-9000", hcm),
            ])
        );
        assert_eq!(
            chains(false, &probes).len(),
            6,
            "permissive: the policed ports only"
        );
    }

    /// A pod whose policy did not change (the same `Arc`) keeps the listener built for it.
    #[test]
    fn an_unchanged_pod_keeps_its_listener() {
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let policy = |ns: &str| -> Arc<PodPolicy> {
            let port = PortPolicy {
                http: true,
                allow_list: true,
                rules: vec![AuthorizationRule {
                    action: Action::Allow,
                    from: vec![crate::mesh::Caller::Namespace(ns.into())],
                    ports: Vec::new(),
                    paths: Vec::new(),
                    methods: Vec::new(),
                }]
                .into(),
            };
            Arc::new(PodPolicy::from([(8080, port)]))
        };
        let pods = |policy: &Arc<PodPolicy>| imbl::HashMap::from(vec![(ip, policy.clone())]);
        let capture = CapturePort::default();
        let a = policy("a");
        let first = Inbound::new("cluster.local".into(), capture, pods(&a), None);
        let built = first.listener(ip, InboundMode::Strict, &[], true);
        assert_eq!(first.rules(ip), 1);
        let same = Inbound::new("cluster.local".into(), capture, pods(&a), Some(&first));
        assert!(Arc::ptr_eq(
            &built,
            &same.listener(ip, InboundMode::Strict, &[], true)
        ));
        let changed = Inbound::new(
            "cluster.local".into(),
            capture,
            pods(&policy("b")),
            Some(&same),
        );
        assert_ne!(
            changed.listener(ip, InboundMode::Strict, &[], true).version,
            built.version
        );
        let other: IpAddr = "10.0.0.9".parse().unwrap();
        assert!(Arc::ptr_eq(
            &changed.listener(other, InboundMode::Strict, &[], true),
            &first.shared[shared_index(true, true)]
        ));
        assert_eq!(changed.rules(other), 0);
    }
}
