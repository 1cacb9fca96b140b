//! The one end-to-end harness shared by every test across the parts: network namespaces,
//! a real Envoy, the real project binaries, and a fake Kubernetes API server that speaks the
//! real list/watch wire protocol.

pub mod ads_client;
pub mod ads_probe;
pub mod ads_tap;
pub mod agent;
pub mod bins;
pub mod dig;
pub mod dns_load;
pub mod envoy;
pub mod fake_apiserver;
pub mod injector;
pub mod iptables;
pub mod istio_ca;
pub mod k8s_objects;
pub mod kubelet;
pub mod manifests;
pub mod mesh_source;
pub mod netns;
pub mod node;
pub mod procstat;
pub mod raw_grpc;
pub mod sizing;
pub mod trusted;
pub mod wait;
