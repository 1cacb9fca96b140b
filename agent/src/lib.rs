//! Lattice node agent: watches the mesh (mesh files, Kubernetes, or both), translates it to
//! Envoy resources and DNS names, and serves them to the Envoys and pods on this node.
//!
//! Data flows one way, and the module tree reads in its order: each [`source`] (a provider)
//! → its own [`mesh`] view → the [`catalog`], which merges the views into one [`mesh`]
//! snapshot → [`translate`] → the [`xds`] server and the DNS server (`lattice_dns`). Each stage imports
//! the snapshot it reads and the type it hands on, never a stage before it: a source builds the
//! mesh model and knows nothing of translators; a translator reads the mesh and produces what a
//! server serves, and knows nothing of sources; the xDS server knows neither the mesh nor the
//! translators. Beside the flow: [`config`], [`identity`] (which proxies may connect: the
//! Kubernetes source feeds it, the xDS server checks against it), [`scope`] (which services
//! each pod uses: its declarations and its DNS lookups; the xDS server gives its proxy only those), [`trust`] (workload identities
//! and the issuer of their certificates), [`admin`] (which reads the mesh and the servers'
//! state), [`metrics`], [`readiness`] and [`node_local_address`]. `tests/layers.rs` holds the
//! rule.

pub mod admin;
pub mod catalog;
pub mod config;
pub mod identity;
pub mod in_place;
pub mod mesh;
pub mod metrics;
pub mod node_local_address;
pub mod parallel;
pub mod readiness;
pub mod scope;
pub mod source;
pub mod state_file;
pub mod translate;
pub mod trust;
pub mod xds;
