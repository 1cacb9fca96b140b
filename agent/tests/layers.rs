//! The agent's data flows one way: source → mesh → translate → the servers (xds, and the DNS
//! server in its own crate). This test holds the module tree to it: every `crate::<module>`
//! a product file names must be one its top-level module may depend on. Test code (from a
//! file's `#[cfg(test)]` module on, and the test-only `tests.rs`/`testing.rs` files) may reach
//! further, to build real inputs.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// What each top-level module may import from the crate. A stage imports the snapshot it reads
/// and the type it hands on, never a stage before it.
const ALLOWED: &[(&str, &[&str])] = &[
    ("config", &["trust"]),
    ("readiness", &[]),
    ("node_local_address", &[]),
    ("parallel", &[]),
    ("state_file", &[]),
    ("in_place", &[]),
    ("mesh", &["in_place"]),
    ("identity", &[]),
    ("trust", &[]),
    ("scope", &["identity"]),
    (
        "source",
        &[
            "mesh",
            "identity",
            "parallel",
            "trust",
            "in_place",
            "state_file",
        ],
    ),
    ("catalog", &["mesh", "readiness", "parallel", "state_file"]),
    ("translate", &["mesh", "xds", "readiness", "parallel"]),
    ("xds", &["identity", "scope", "trust"]),
    ("metrics", &["mesh", "xds", "scope", "trust"]),
    (
        "admin",
        &["catalog", "mesh", "metrics", "readiness", "xds", "trust"],
    ),
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The modules a piece of source names as `crate::<module>`, also inside `use crate::{a, b}`.
fn crate_modules(text: &str) -> BTreeSet<String> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut found = BTreeSet::new();
    for (at, _) in text.match_indices("crate::") {
        let rest = &text[at + "crate::".len()..];
        match rest.strip_prefix('{') {
            Some(group) => {
                let group = &group[..group.find('}').unwrap_or(group.len())];
                found.extend(group.split(',').map(|item| ident(item.trim())));
            }
            None => {
                found.insert(ident(rest));
            }
        }
    }
    found.retain(|m| !m.is_empty());
    found
}

#[test]
fn no_module_imports_a_stage_before_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let allowed: BTreeMap<&str, &[&str]> = ALLOWED.iter().copied().collect();
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut checked = 0;
    let mut violations = Vec::new();
    for path in files {
        let relative = path.strip_prefix(&src).unwrap();
        let file_name = relative.file_name().unwrap().to_string_lossy();
        if matches!(
            &*file_name,
            "main.rs" | "lib.rs" | "tests.rs" | "testing.rs"
        ) {
            continue;
        }
        let top = relative
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        let Some(may) = allowed.get(top.as_str()) else {
            violations.push(format!(
                "{}: module {top} has no place in the layer table; add it to ALLOWED",
                relative.display()
            ));
            continue;
        };
        let text = std::fs::read_to_string(&path).unwrap();
        let product = text.split("\n#[cfg(test)]").next().unwrap_or_default();
        for module in crate_modules(product) {
            if module != top && !may.contains(&module.as_str()) {
                violations.push(format!(
                    "{}: {top} imports crate::{module}",
                    relative.display()
                ));
            }
        }
        checked += 1;
    }
    assert!(checked > 20, "only {checked} files checked: is src/ there?");
    assert!(violations.is_empty(), "{}", violations.join("\n"));
}

#[test]
fn the_scanner_finds_grouped_and_inline_imports() {
    let found = crate_modules(
        "use crate::mesh::{A, B};\nuse crate::{xds, readiness::R};\nlet x = crate::source::f();",
    );
    assert_eq!(
        found.into_iter().collect::<Vec<_>>(),
        ["mesh", "readiness", "source", "xds"]
    );
}
