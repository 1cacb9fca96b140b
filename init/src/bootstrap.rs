//! Owns the Envoy v3 bootstrap: config → JSON value. Pure; writing the file is the caller's job.
//!
//! Envoy gets only what it needs to reach the node agent: the node identity, admin on loopback,
//! one static HTTP/2 cluster for the agent's xDS, and ADS for clusters and listeners. Both
//! subscriptions have `initial_fetch_timeout: 0s`, which Envoy defines as "wait indefinitely
//! for the first response" (the default, 15s, would let Envoy go live on a partial config).
//!
//! The connection to the agent is kept alive on both layers, so a path to the agent that dies
//! without a FIN or RST (a conntrack entry lost, the node-local address moved) is noticed and
//! Envoy reconnects: an HTTP/2 PING after 30 s without a frame, the connection aborted when one
//! goes unanswered for 10 s (the agent answers from its connection task, whatever its streams
//! are doing), and TCP keep-alive probes after 60 s idle, every 10 s, three of them. The agent
//! pings too, and waits longer for an answer: Envoy answers on its main thread, the thread that
//! applies a large config, which can take seconds.
//!
//! Statistics: Envoy keeps about 150 per cluster by default, and a proxy of a large mesh holds
//! a cluster per service port. With 10k clusters that was most of the time Envoy took to take
//! them (6.7–6.8 s, against 2.8–2.9 s with the list below) and 280 MiB of its memory
//! (docs/benchmarks.md). So, as Istio's sidecars do by default, the bootstrap keeps Envoy's
//! own statistics, the xDS connection's and the listeners', and per mesh cluster only its
//! endpoint count and healthy count; `--envoy-stats all` keeps Envoy's default. With either,
//! a cluster's traffic statistics are made on its first request: 10k clusters took a lone
//! Envoy 2.8 s with them made up front, 2.5 s without (2.1 s with no per-cluster gauges at
//! all: a `suffix` pattern makes Envoy spell out every statistic's name to match it). A
//! cluster's copy on each worker thread waits for its first request too (2–3 % of the sync
//! and 11 MiB with one worker, more with more).
//!
//! Readiness: the kubelet cannot reach the admin interface (loopback only, and it would give
//! away everything), so a static listener on [`ENVOY_READINESS_PORT`] answers one path,
//! [`ENVOY_READINESS_PATH`], by asking the admin's `/ready`: 200 once Envoy's server state is
//! LIVE, which with the subscriptions above means it holds its first clusters and listener from
//! the agent; 503 while it drains. Before that the listener does not even accept: Envoy starts
//! accepting on every listener only once it is initialized. A mesh pod's startup probe on it
//! keeps the app from starting before its proxy can carry a request.

use lattice_contract::{
    ENVOY_ADMIN_PORT, ENVOY_READINESS_PATH, ENVOY_READINESS_PORT, ENVOY_REGEX_PROGRAM_SIZE_ERROR,
    INBOUND_PASSTHROUGH_CLUSTER, REGEX_PROGRAM_SIZE,
};
use serde_json::{Value, json};

use crate::config::{BootstrapConfig, EnvoyStats, XdsHost, XdsMode};

/// The Envoy node cluster every Lattice sidecar reports.
pub const NODE_CLUSTER: &str = "lattice";
/// The static cluster that points at the node agent's xDS server.
pub const XDS_CLUSTER: &str = "lattice-xds";
/// Envoy admin: loopback only, so nothing outside the pod reaches it.
pub const ADMIN_ADDRESS: &str = "127.0.0.1";
/// HTTP/2 keep-alive on the xDS connection: a PING after this long without a frame…
pub const XDS_PING_INTERVAL: &str = "30s";
/// …and the connection aborted when it goes unanswered this long.
pub const XDS_PING_TIMEOUT: &str = "10s";
/// TCP keep-alive on the xDS connection: idle seconds before the first probe, seconds between
/// probes, probes unanswered before the connection is closed.
pub const XDS_TCP_KEEPALIVE: (u32, u32, u32) = (60, 10, 3);
/// The static listener that answers the kubelet's readiness probe.
pub const READINESS_LISTENER: &str = "lattice-readiness";
/// The static cluster that points at Envoy's own admin, for the readiness listener alone.
pub const ADMIN_CLUSTER: &str = "lattice-admin";

/// The bootstrap for `config`, ready to serialize.
pub fn bootstrap(config: &BootstrapConfig) -> Value {
    let api_type = match config.mode {
        XdsMode::Delta => "DELTA_GRPC",
        XdsMode::Sotw => "GRPC",
    };
    let (address, cluster_type) = match &config.xds.host {
        XdsHost::Ip(ip) => (ip.to_string(), "STATIC"),
        XdsHost::Name(name) => (name.clone(), "LOGICAL_DNS"),
    };
    let from_ads = json!({
        "ads": {},
        "resource_api_version": "V3",
        "initial_fetch_timeout": "0s",
    });
    let (keepalive_time, keepalive_interval, keepalive_probes) = XDS_TCP_KEEPALIVE;
    let mut value = json!({
        "node": {
            "id": config.node_id,
            "cluster": NODE_CLUSTER,
        },
        "admin": {
            "address": socket_address(ADMIN_ADDRESS, ENVOY_ADMIN_PORT),
        },
        "dynamic_resources": {
            "ads_config": {
                "api_type": api_type,
                "transport_api_version": "V3",
                "grpc_services": [{ "envoy_grpc": { "cluster_name": XDS_CLUSTER } }],
                // The agent knows a stream's proxy from its first request. Envoy's node
                // lists every extension it was built with, about 60 KB, which it would
                // otherwise encode, and the agent decode, in every request: every ACK.
                "set_node_on_first_message_only": true,
            },
            "cds_config": from_ads.clone(),
            "lds_config": from_ads,
        },
        "static_resources": {
            "clusters": [{
                "name": XDS_CLUSTER,
                "type": cluster_type,
                "connect_timeout": "1s",
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": { "http2_protocol_options": {
                            "connection_keepalive": {
                                "interval": XDS_PING_INTERVAL,
                                "timeout": XDS_PING_TIMEOUT,
                            },
                        } },
                    },
                },
                "upstream_connection_options": {
                    "tcp_keepalive": {
                        "keepalive_time": keepalive_time,
                        "keepalive_interval": keepalive_interval,
                        "keepalive_probes": keepalive_probes,
                    },
                },
                "load_assignment": {
                    "cluster_name": XDS_CLUSTER,
                    "endpoints": [{
                        "lb_endpoints": [{
                            "endpoint": { "address": socket_address(&address, config.xds.port) },
                        }],
                    }],
                },
            }],
        },
    });
    // A cluster's traffic statistics (most of the ~150) are made on its first request, not
    // when the cluster arrives, and so is its copy on each worker thread: a proxy of a large
    // mesh sends traffic to few of its clusters.
    value["deferred_stat_options"] = json!({ "enable_deferred_creation_stats": true });
    value["cluster_manager"] = json!({ "enable_deferred_cluster_creation": true });
    if config.stats == EnvoyStats::Mesh {
        value["stats_config"] = mesh_stats();
    }
    value["static_resources"]["listeners"] = json!([readiness_listener()]);
    if let Some(clusters) = value["static_resources"]["clusters"].as_array_mut() {
        clusters.push(admin_cluster());
    }
    if config.inbound
        && let Some(clusters) = value["static_resources"]["clusters"].as_array_mut()
    {
        clusters.push(inbound_passthrough_cluster());
    }
    value["layered_runtime"] = regex_runtime();
    value
}

/// Where the agent's inbound listener hands a connection once it has terminated mesh mTLS (or
/// accepted plaintext): the app, at the address and port the connection was for. Static, so
/// no proxy's CDS carries it. Envoy's UID is never captured, so the connection is not
/// redirected again. Requests read at a port with authorization rules go on in the protocol
/// they came in (HTTP/1.1, or HTTP/2 for gRPC and h2c).
fn inbound_passthrough_cluster() -> Value {
    json!({
        "name": INBOUND_PASSTHROUGH_CLUSTER,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "use_downstream_protocol_config": {},
            },
        },
    })
}

/// Envoy refuses a route regex whose RE2 program is larger than 100 by default, and the
/// refusal fails the whole route configuration it is in. The agent refuses a rule whose
/// pattern may compile past [`REGEX_PROGRAM_SIZE`]; Envoy's own refusal is set far above it,
/// and its warning (counted in `re2.exceeded_warn_level`) at it: a count there means the
/// agent let through a pattern larger than it meant to.
fn regex_runtime() -> Value {
    json!({ "layers": [{
        "name": "lattice",
        "static_layer": {
            "re2.max_program_size.error_level": ENVOY_REGEX_PROGRAM_SIZE_ERROR,
            "re2.max_program_size.warn_level": REGEX_PROGRAM_SIZE,
        },
    }] })
}

/// Answers `GET` [`ENVOY_READINESS_PATH`] on every address of the pod with the admin's `/ready`,
/// and nothing else (404): the one admin page the pod's network may see.
fn readiness_listener() -> Value {
    json!({
        "name": READINESS_LISTENER,
        "address": socket_address("0.0.0.0", ENVOY_READINESS_PORT),
        "filter_chains": [{
            "filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                    "stat_prefix": "readiness",
                    "route_config": {
                        "name": READINESS_LISTENER,
                        "virtual_hosts": [{
                            "name": "readiness",
                            "domains": ["*"],
                            "routes": [{
                                "match": { "path": ENVOY_READINESS_PATH },
                                "route": {
                                    "cluster": ADMIN_CLUSTER,
                                    "prefix_rewrite": "/ready",
                                    "timeout": "1s",
                                },
                            }],
                        }],
                    },
                    "http_filters": [{
                        "name": "envoy.filters.http.router",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
                        },
                    }],
                },
            }],
        }],
    })
}

fn admin_cluster() -> Value {
    json!({
        "name": ADMIN_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": ADMIN_CLUSTER,
            "endpoints": [{
                "lb_endpoints": [{
                    "endpoint": { "address": socket_address(ADMIN_ADDRESS, ENVOY_ADMIN_PORT) },
                }],
            }],
        },
    })
}

/// The statistics `--envoy-stats mesh` keeps: those that do not grow with the mesh, and two
/// gauges per cluster that say whether a service is reachable.
fn mesh_stats() -> Value {
    let prefixes = [
        "server.",
        "cluster_manager.",
        "listener_manager.",
        "control_plane.",
        "listener.",
        "http.",
        "re2.",
        // The inbound listener's TCP proxies: mTLS and plaintext connections, per chain.
        "tcp.inbound_",
    ];
    let mut patterns: Vec<Value> = prefixes.iter().map(|p| json!({ "prefix": p })).collect();
    patterns.push(json!({ "prefix": format!("cluster.{XDS_CLUSTER}.") }));
    for gauge in [".membership_total", ".membership_healthy"] {
        patterns.push(json!({ "suffix": gauge }));
    }
    json!({ "stats_matcher": { "inclusion_list": { "patterns": patterns } } })
}

fn socket_address(address: &str, port: u16) -> Value {
    json!({ "socket_address": { "address": address, "port_value": port } })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::XdsAddress;

    fn config(mode: XdsMode, xds: &str) -> BootstrapConfig {
        BootstrapConfig {
            node_id: "web-0.shop".into(),
            xds: XdsAddress::parse(xds).unwrap(),
            mode,
            stats: EnvoyStats::Mesh,
            inbound: false,
        }
    }

    #[test]
    fn inbound_capture_adds_the_passthrough_cluster() {
        let names = |value: &Value| -> Vec<String> {
            value["static_resources"]["clusters"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["name"].as_str().unwrap().to_string())
                .collect()
        };
        let mut config = config(XdsMode::Delta, "10.0.0.1:15010");
        assert!(!names(&bootstrap(&config)).contains(&INBOUND_PASSTHROUGH_CLUSTER.to_string()));
        config.inbound = true;
        let value = bootstrap(&config);
        let cluster = value["static_resources"]["clusters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == INBOUND_PASSTHROUGH_CLUSTER)
            .unwrap();
        assert_eq!(cluster["type"], "ORIGINAL_DST");
    }

    #[test]
    fn golden_delta_bootstrap() {
        let expected = json!({
            "node": { "id": "web-0.shop", "cluster": "lattice" },
            "admin": { "address": { "socket_address": { "address": "127.0.0.1", "port_value": 15000 } } },
            "dynamic_resources": {
                "ads_config": {
                    "api_type": "DELTA_GRPC",
                    "transport_api_version": "V3",
                    "grpc_services": [{ "envoy_grpc": { "cluster_name": "lattice-xds" } }],
                    "set_node_on_first_message_only": true
                },
                "cds_config": { "ads": {}, "resource_api_version": "V3", "initial_fetch_timeout": "0s" },
                "lds_config": { "ads": {}, "resource_api_version": "V3", "initial_fetch_timeout": "0s" }
            },
            "static_resources": { "clusters": [{
                "name": "lattice-xds",
                "type": "STATIC",
                "connect_timeout": "1s",
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": { "http2_protocol_options": {
                            "connection_keepalive": { "interval": "30s", "timeout": "10s" }
                        } }
                    }
                },
                "upstream_connection_options": { "tcp_keepalive": {
                    "keepalive_time": 60, "keepalive_interval": 10, "keepalive_probes": 3
                } },
                "load_assignment": {
                    "cluster_name": "lattice-xds",
                    "endpoints": [{ "lb_endpoints": [{ "endpoint": { "address": {
                        "socket_address": { "address": "10.0.0.1", "port_value": 15010 }
                    } } }] }]
                }
            }, {
                "name": "lattice-admin",
                "type": "STATIC",
                "connect_timeout": "1s",
                "load_assignment": {
                    "cluster_name": "lattice-admin",
                    "endpoints": [{ "lb_endpoints": [{ "endpoint": { "address": {
                        "socket_address": { "address": "127.0.0.1", "port_value": 15000 }
                    } } }] }]
                }
            }],
            "listeners": [{
                "name": "lattice-readiness",
                "address": { "socket_address": { "address": "0.0.0.0", "port_value": 15021 } },
                "filter_chains": [{ "filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "readiness",
                        "route_config": {
                            "name": "lattice-readiness",
                            "virtual_hosts": [{
                                "name": "readiness",
                                "domains": ["*"],
                                "routes": [{
                                    "match": { "path": "/healthz/ready" },
                                    "route": { "cluster": "lattice-admin", "prefix_rewrite": "/ready", "timeout": "1s" }
                                }]
                            }]
                        },
                        "http_filters": [{
                            "name": "envoy.filters.http.router",
                            "typed_config": { "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router" }
                        }]
                    }
                }] }]
            }] },
            "deferred_stat_options": { "enable_deferred_creation_stats": true },
            "cluster_manager": { "enable_deferred_cluster_creation": true },
            "layered_runtime": { "layers": [{ "name": "lattice", "static_layer": {
                "re2.max_program_size.error_level": 32000,
                "re2.max_program_size.warn_level": 1000
            } }] },
            "stats_config": { "stats_matcher": { "inclusion_list": { "patterns": [
                { "prefix": "server." },
                { "prefix": "cluster_manager." },
                { "prefix": "listener_manager." },
                { "prefix": "control_plane." },
                { "prefix": "listener." },
                { "prefix": "http." },
                { "prefix": "re2." },
                { "prefix": "tcp.inbound_" },
                { "prefix": "cluster.lattice-xds." },
                { "suffix": ".membership_total" },
                { "suffix": ".membership_healthy" }
            ] } } }
        });
        assert_eq!(
            bootstrap(&config(XdsMode::Delta, "10.0.0.1:15010")),
            expected
        );
    }

    #[test]
    fn all_stats_leaves_envoys_default() {
        let mut all = config(XdsMode::Delta, "10.0.0.1:15010");
        all.stats = EnvoyStats::All;
        assert!(bootstrap(&all).get("stats_config").is_none());
    }

    #[test]
    fn sotw_uses_plain_grpc() {
        let value = bootstrap(&config(XdsMode::Sotw, "10.0.0.1:15010"));
        assert_eq!(value["dynamic_resources"]["ads_config"]["api_type"], "GRPC");
    }

    #[test]
    fn a_host_name_is_resolved_by_envoy() {
        let value = bootstrap(&config(
            XdsMode::Delta,
            "lattice-agent.lattice-system:15010",
        ));
        let cluster = &value["static_resources"]["clusters"][0];
        assert_eq!(cluster["type"], "LOGICAL_DNS");
        let address = &cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
            ["socket_address"];
        assert_eq!(address["address"], "lattice-agent.lattice-system");
    }

    #[test]
    fn ipv6_agent_address_is_bare() {
        let value = bootstrap(&config(XdsMode::Delta, "[fd00::1]:15010"));
        let address = &value["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]
            ["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
        assert_eq!(address["address"], "fd00::1");
    }
}
