//! A proxy's inbound listener: where `lattice-init --inbound-capture` sends the TCP that
//! arrives for its pod, on [`ENVOY_INBOUND_PORT`]. It is not part of the mesh snapshot: a
//! proxy gets it in its own view, beside its secrets, when its pod asks for inbound capture,
//! in the pod's mode (`identity::InboundMode`).
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

use envoy_types::pb::envoy::config::accesslog::v3::{AccessLog, access_log};
use envoy_types::pb::envoy::config::core::v3::{
    DataSource, SubstitutionFormatString, TrafficDirection, TransportSocket, data_source,
    substitution_format_string, transport_socket,
};
use envoy_types::pb::envoy::config::listener::v3::{
    Filter, FilterChain, FilterChainMatch, Listener, ListenerFilter, filter, listener_filter,
};
use envoy_types::pb::envoy::extensions::access_loggers::stream::v3::{
    StderrAccessLog, stderr_access_log,
};
use envoy_types::pb::envoy::extensions::filters::listener::original_dst::v3::OriginalDst;
use envoy_types::pb::envoy::extensions::filters::listener::tls_inspector::v3::TlsInspector;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{
    TcpProxy, UpstreamConnectMode, tcp_proxy,
};
use envoy_types::pb::google::protobuf::{Duration, UInt32Value};
use lattice_contract::{
    CapturePort, ENVOY_ADMIN_PORT, ENVOY_INBOUND_PORT, ENVOY_READINESS_PORT,
    INBOUND_PASSTHROUGH_CLUSTER,
};

use super::{mtls, socket_address, typed};
use crate::xds::InboundListeners;
use crate::xds::snapshot::XdsResource;

/// The inbound listener's name in every proxy.
pub const INBOUND_LISTENER: &str = "lattice-inbound";

/// How long the tls_inspector waits for a client's first bytes. A protocol whose server
/// speaks first (SMTP, MySQL) sends nothing, so after this the connection goes on as
/// plaintext: in permissive mode such a port answers this much later (exclude it from capture
/// to avoid that), in strict mode it is refused.
const FIRST_BYTES_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The inbound listener in each mode, built once: every proxy in a mode gets the same bytes.
/// For proxies whose peers' SPIFFE IDs are in `trust_domain`, in pods whose capture port is
/// `capture`.
pub fn inbound_listeners(trust_domain: &str, capture: CapturePort) -> InboundListeners {
    let build =
        |strict| XdsResource::new(INBOUND_LISTENER, listener(strict, trust_domain, capture));
    InboundListeners {
        permissive: build(false),
        strict: build(true),
    }
}

/// `strict`: what is not mesh mTLS is refused; else it is handed on as it came.
fn listener(strict: bool, trust_domain: &str, capture: CapturePort) -> Listener {
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
            filter_chain_match: Some(FilterChainMatch {
                destination_port: Some(UInt32Value {
                    value: u32::from(port),
                }),
                ..FilterChainMatch::default()
            }),
            // A cluster no proxy has: the connection is closed.
            filters: vec![tcp_proxy(Handoff::Refuse)],
            ..FilterChain::default()
        })
        .collect();
    filter_chains.push(FilterChain {
        name: "mtls".to_string(),
        filter_chain_match: Some(FilterChainMatch {
            transport_protocol: "tls".to_string(),
            application_protocols: vec![lattice_contract::MESH_ALPN.to_string()],
            ..FilterChainMatch::default()
        }),
        transport_socket: Some(TransportSocket {
            name: "envoy.transport_sockets.tls".to_string(),
            config_type: Some(transport_socket::ConfigType::TypedConfig(typed(
                mtls::downstream(trust_domain),
            ))),
        }),
        filters: vec![tcp_proxy(Handoff::Mtls)],
        ..FilterChain::default()
    });
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
}

impl Handoff {
    /// Its name in the statistics (`tcp.inbound_<name>`) and the access log.
    fn name(self) -> &'static str {
        match self {
            Handoff::Refuse => "envoy_port",
            Handoff::Mtls => "mtls",
            Handoff::Plaintext => "plaintext",
        }
    }
}

fn tcp_proxy(handoff: Handoff) -> Filter {
    let stat_prefix = handoff.name();
    let logged = handoff != Handoff::Refuse;
    let cluster = match handoff {
        Handoff::Refuse => "lattice-inbound-refused",
        Handoff::Mtls | Handoff::Plaintext => INBOUND_PASSTHROUGH_CLUSTER,
    };
    let access_log = if logged {
        vec![AccessLog {
            name: "envoy.access_loggers.stderr".to_string(),
            config_type: Some(access_log::ConfigType::TypedConfig(typed(
                StderrAccessLog {
                    access_log_format: Some(stderr_access_log::AccessLogFormat::LogFormat(
                        SubstitutionFormatString {
                            format: Some(substitution_format_string::Format::TextFormatSource(
                                DataSource {
                                    specifier: Some(data_source::Specifier::InlineString(format!(
                                        "[{INBOUND_LISTENER}] {stat_prefix} peer=%DOWNSTREAM_PEER_URI_SAN% from=%DOWNSTREAM_REMOTE_ADDRESS% to=%UPSTREAM_HOST% flags=%RESPONSE_FLAGS% received=%BYTES_RECEIVED% sent=%BYTES_SENT%\n"
                                    ))),
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
        Handoff::Refuse | Handoff::Plaintext => (UpstreamConnectMode::Immediate as i32, None),
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

#[cfg(test)]
mod tests {
    use lattice_contract::MESH_ALPN;
    use prost::Message;

    use super::*;
    use crate::identity::InboundMode;

    fn decoded(mode: InboundMode) -> Listener {
        let listeners = inbound_listeners("cluster.local", CapturePort::default());
        Listener::decode(listeners.get(mode).body.value.as_slice()).unwrap()
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
}
