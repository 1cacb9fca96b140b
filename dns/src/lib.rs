//! Lattice DNS: the DNS server the node agent runs for the pods on its node. A mesh service's name
//! (service `/foo/bar/buzz` is `buzz.bar.foo.system.internal`, in the zone
//! `lattice_contract::ZONE`) resolves to the service's address in the trapped block, which the
//! pod's Envoy captures; every other name is forwarded to the upstream resolvers, so the pods
//! resolve everything else as before.
//!
//! The agent builds a [`NameTable`] from each mesh snapshot and hands it to the [`DnsServer`]
//! through a `watch` channel, so a new snapshot takes effect on the next query. Queries for the
//! A records of mesh names take a fast path that copies precomputed records; everything else
//! takes a general path built on `hickory_proto`, which is the reference the fast path must agree
//! with. Both report the lookups of names that carry a scope to a [`LookupObserver`], which the
//! agent uses to give a pod's Envoy a service before the pod connects to it. How the DNS server
//! fits with the rest of the agent is in `docs/architecture.md`.

// The fuzz self-check is built only for the unit tests and for cargo-fuzz (`--cfg fuzzing`).
mod batch;
mod budget;
#[cfg(any(test, fuzzing))]
mod check;
mod clock;
mod config;
mod error;
mod fast;
mod forward;
pub mod handoff;
mod metrics;
mod observe;
mod query;
mod resolv;
mod server;
mod table;
mod wire;

#[cfg(any(test, fuzzing))]
pub use check::check_query;
pub use clock::Clock;
pub use config::DnsConfig;
pub use error::DnsError;
pub use metrics::DnsMetrics;
pub use observe::{Hold, LookupObserver};
pub use resolv::upstreams_from_resolv_conf;
pub use server::DnsServer;
pub use table::{MeshRecord, NameTable, SrvRecord};
