//! Putting workloads in the mesh without editing their pods by hand: the mesh's additions to a
//! pod as one template ([`template::inject`], a JSON Patch against the pod), the annotations
//! that steer it ([`annotations`]), manifests run through it ([`manifest`]) by the
//! `lattice inject` and `lattice uninject` commands, and the mutating admission webhook that
//! applies it to pods as they are created (`lattice webhook`: [`review`], [`server`], with
//! its certificate and CA bundle kept by [`certs`] and [`setup`]), and `lattice check`
//! ([`check`]). `docs/install.md` says what a meshed pod carries and why, and lists the
//! annotations.

pub mod annotations;
pub mod certs;
pub mod check;
pub mod config;
pub mod manifest;
pub mod review;
pub mod server;
pub mod setup;
pub mod template;

pub use config::{InjectConfig, ProxyResources};
pub use template::{NotInjected, Skip, inject, uninject};
