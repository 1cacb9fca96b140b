//! Reading the iptables rulesets of a network namespace, for the init tests and the init
//! benchmark: which backends (nft, legacy) are installed, `iptables-save` of one backend and
//! family without its timestamped comments, and every ruleset at once.

use crate::netns::Netns;

/// The address families `lattice-init` writes rules for.
pub const FAMILIES: [&str; 2] = ["iptables", "ip6tables"];

/// The backends whose `save` and `restore` binaries are installed for both families.
pub fn backends() -> Vec<&'static str> {
    let installed = |name: &str| {
        std::env::var_os("PATH")
            .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(name).is_file()))
    };
    ["nft", "legacy"]
        .into_iter()
        .filter(|backend| {
            FAMILIES.iter().all(|family| {
                installed(&format!("{family}-{backend}-save"))
                    && installed(&format!("{family}-{backend}-restore"))
            })
        })
        .collect()
}

/// `iptables-save` of one backend (`nft`, `legacy`) and family (`iptables`, `ip6tables`) in
/// `ns`, without the comment lines (they carry a timestamp).
pub fn save(ns: &Netns, backend: &str, family: &str) -> anyhow::Result<String> {
    let text = ns.exec(&format!("{family}-{backend}-save"), &[] as &[&str])?;
    Ok(text
        .lines()
        .filter(|line| !line.starts_with('#'))
        .map(|line| format!("{line}\n"))
        .collect())
}

/// Every ruleset in `ns`: each installed backend, both families, each under a header line.
pub fn snapshot(ns: &Netns) -> anyhow::Result<String> {
    let mut all = String::new();
    for backend in backends() {
        for family in FAMILIES {
            all.push_str(&format!(
                "== {family}-{backend}\n{}",
                save(ns, backend, family)?
            ));
        }
    }
    Ok(all)
}

/// `save` output without tables that hold no rules and no chains of their own: a table the
/// kernel instantiated for a run (empty built-in chains, ACCEPT) is not part of what init
/// installs, and no iptables command removes it again. Header lines of [`snapshot`] are kept.
pub fn without_empty_tables(save: &str) -> String {
    let mut kept = String::new();
    let mut section = String::new();
    let mut has_content = false;
    for line in save.lines() {
        if line.starts_with("== ") {
            kept.push_str(line);
            kept.push('\n');
            continue;
        }
        if line.starts_with('*') {
            section.clear();
            has_content = false;
        }
        section.push_str(line);
        section.push('\n');
        has_content |= line.starts_with("-A ") || (line.starts_with(':') && line.contains(" - ["));
        if line == "COMMIT" && has_content {
            kept.push_str(&section);
        }
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_tables_are_dropped_and_tables_with_rules_or_own_chains_kept() {
        let save = "== iptables-nft\n\
                    *filter\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n\
                    *nat\n:OUTPUT ACCEPT [0:0]\n-A OUTPUT -j LATTICE_OUTPUT\nCOMMIT\n\
                    == ip6tables-nft\n\
                    *nat\n:OUTPUT ACCEPT [0:0]\n:MINE - [0:0]\nCOMMIT\n\
                    *mangle\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n";
        assert_eq!(
            without_empty_tables(save),
            "== iptables-nft\n\
             *nat\n:OUTPUT ACCEPT [0:0]\n-A OUTPUT -j LATTICE_OUTPUT\nCOMMIT\n\
             == ip6tables-nft\n\
             *nat\n:OUTPUT ACCEPT [0:0]\n:MINE - [0:0]\nCOMMIT\n"
        );
    }
}
