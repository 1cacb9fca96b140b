//! Where the project's real binaries are. `cargo xtask test` builds them before the tests run;
//! `LATTICE_BIN_DIR` overrides the location.

use std::path::PathBuf;

/// Path of a workspace binary (`lattice-agent`, `lattice-init`), next to the test executable.
pub fn path(name: &str) -> PathBuf {
    let dir = match std::env::var_os("LATTICE_BIN_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => {
            // target/<profile>/deps/<test-exe> → target/<profile>
            let exe = std::env::current_exe().unwrap_or_default();
            exe.parent()
                .and_then(|deps| deps.parent())
                .map(PathBuf::from)
                .unwrap_or_default()
        }
    };
    let bin = dir.join(name);
    assert!(
        bin.exists(),
        "{} not found: build the binaries first (`cargo build --workspace --bins`, which \
         `cargo xtask test` does) or set LATTICE_BIN_DIR",
        bin.display()
    );
    bin
}
