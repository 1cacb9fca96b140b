//! Owns the capture ruleset as text: config → the `iptables-restore` input that installs it, and
//! `iptables-save` output → what of ours is already installed. Pure: no processes, no kernel.
//!
//! Everything lives in the nat table, in chains of our own, each group reached by one jump from
//! a built-in chain: OUTPUT → LATTICE_OUTPUT (the app's connections into the trapped block) and,
//! with inbound capture, PREROUTING → LATTICE_INBOUND (connections arriving for the pod). A run
//! declares the chains it wants (which creates or flushes them under `--noflush`), refills them,
//! appends a jump only when `iptables-save` shows none, and removes the chains and jumps of ours
//! it no longer wants, so a re-run rewrites our chains and leaves the rest of the table alone.

use std::collections::BTreeMap;
use std::fmt;
use std::fmt::Write as _;

use crate::config::{CaptureConfig, InboundCapture, TrapCidr};

/// Our outbound entry chain, jumped to from OUTPUT.
pub const OUTPUT_CHAIN: &str = "LATTICE_OUTPUT";
/// Where captured outbound TCP is sent to Envoy's capture listener.
pub const REDIRECT_CHAIN: &str = "LATTICE_REDIRECT";
/// Our inbound entry chain, jumped to from PREROUTING.
pub const INBOUND_CHAIN: &str = "LATTICE_INBOUND";
/// Where captured inbound TCP is sent to Envoy's inbound listener.
pub const INBOUND_REDIRECT_CHAIN: &str = "LATTICE_IN_REDIRECT";
/// Every chain we own, in declaration order.
pub const OWNED_CHAINS: [&str; 4] = [
    OUTPUT_CHAIN,
    REDIRECT_CHAIN,
    INBOUND_CHAIN,
    INBOUND_REDIRECT_CHAIN,
];

/// A jump from a built-in chain of the nat table into one of our entry chains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    hook: &'static str,
    chain: &'static str,
}

/// Our entry points, in the order their jumps are written.
const ENTRIES: [Entry; 2] = [
    Entry {
        hook: "OUTPUT",
        chain: OUTPUT_CHAIN,
    },
    Entry {
        hook: "PREROUTING",
        chain: INBOUND_CHAIN,
    },
];

impl Entry {
    /// The jump as we write it, and as `iptables-save` prints it after `-A <hook> `.
    fn spec(self) -> String {
        format!("-j {}", self.chain)
    }
}

/// An address family: one restore transaction each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub const ALL: [Family; 2] = [Family::V4, Family::V6];

    fn loopback(self) -> &'static str {
        match self {
            Family::V4 => "127.0.0.0/8",
            Family::V6 => "::1/128",
        }
    }

    fn contains(self, cidr: &TrapCidr) -> bool {
        cidr.is_ipv6() == (self == Family::V6)
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        })
    }
}

/// The desired content of our chains for one family: rule specs per chain, written exactly as
/// `iptables-save` prints them so that an installed ruleset compares equal. A chain absent
/// here is one of ours that must not exist, its jump included.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureRules {
    pub family: Family,
    pub chains: BTreeMap<String, Vec<String>>,
}

impl CaptureRules {
    /// The rules for `family`, or `None` when no trapped block is of that family (then that
    /// family is not touched at all).
    pub fn for_family(config: &CaptureConfig, family: Family) -> Option<Self> {
        let blocks: Vec<&TrapCidr> = config.trap.iter().filter(|c| family.contains(c)).collect();
        if blocks.is_empty() {
            return None;
        }
        let mut output = Vec::new();
        let excluded_uids = std::iter::once(config.envoy_uid).chain(config.exclude_uids.clone());
        for uid in excluded_uids {
            output.push(format!("-m owner --uid-owner {uid} -j RETURN"));
        }
        for gid in &config.exclude_gids {
            output.push(format!("-m owner --gid-owner {gid} -j RETURN"));
        }
        // DNS before the loopback RETURN: a resolver on 127.0.0.1:53 is redirected too.
        if let Some(dns) = config
            .redirect_dns
            .filter(|dns| (family == Family::V6) == dns.0.is_ipv6())
        {
            let target = if dns.0.ip().is_loopback() {
                format!("-j REDIRECT --to-ports {}", dns.0.port())
            } else {
                format!("-j DNAT --to-destination {}", dns.0)
            };
            for proto in ["udp", "tcp"] {
                output.push(format!("-p {proto} -m {proto} --dport 53 {target}"));
            }
        }
        output.push(format!("-d {} -j RETURN", family.loopback()));
        for block in blocks {
            output.push(format!("-d {block} -p tcp -j {REDIRECT_CHAIN}"));
        }
        let mut chains = BTreeMap::from([
            (OUTPUT_CHAIN.to_owned(), output),
            (REDIRECT_CHAIN.to_owned(), vec![redirect(config.envoy_port)]),
        ]);
        if let Some(inbound) = &config.inbound {
            chains.extend(inbound_chains(inbound));
        }
        Some(Self { family, chains })
    }
}

fn redirect(port: u16) -> String {
    format!("-p tcp -j REDIRECT --to-ports {port}")
}

/// PREROUTING sees only what arrives from outside the pod: the app's own connections to its
/// address, and Envoy's to the app, take OUTPUT and are never matched here.
fn inbound_chains(inbound: &InboundCapture) -> [(String, Vec<String>); 2] {
    let mut entry: Vec<String> = inbound
        .exclude_ports
        .iter()
        .map(|port| format!("-p tcp -m tcp --dport {port} -j RETURN"))
        .collect();
    entry.push(format!("-p tcp -j {INBOUND_REDIRECT_CHAIN}"));
    [
        (INBOUND_CHAIN.to_owned(), entry),
        (
            INBOUND_REDIRECT_CHAIN.to_owned(),
            vec![redirect(inbound.port)],
        ),
    ]
}

/// A rule of a built-in chain that jumps to one of our entry chains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Jump {
    pub hook: String,
    /// The rule spec as `iptables-save` prints it after `-A <hook> `.
    pub spec: String,
}

/// What of ours one family's nat table holds, read from `iptables-save`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatState {
    /// Our chains that exist, with their rule specs in order.
    pub chains: BTreeMap<String, Vec<String>>,
    /// Rules of built-in chains that jump to our entry chains (normally one per entry in use).
    pub jumps: Vec<Jump>,
    /// Number of `-A` rules in every table of the dump, ours included: backend detection
    /// evidence.
    pub rule_count: usize,
}

impl NatState {
    /// Parses a full `iptables-save` dump (all tables); only the nat table holds our rules.
    pub fn parse(save: &str) -> Self {
        let mut state = Self::default();
        let mut in_nat = false;
        for line in save.lines().map(str::trim) {
            if let Some(table) = line.strip_prefix('*') {
                in_nat = table == "nat";
                continue;
            }
            if line.starts_with("-A ") {
                state.rule_count += 1;
            }
            if !in_nat {
                continue;
            }
            if let Some(decl) = line.strip_prefix(':') {
                let name = decl.split_whitespace().next().unwrap_or_default();
                if OWNED_CHAINS.contains(&name) {
                    state.chains.entry(name.to_owned()).or_default();
                }
            } else if let Some(rule) = line.strip_prefix("-A ") {
                let (chain, spec) = rule.split_once(' ').unwrap_or((rule, ""));
                if OWNED_CHAINS.contains(&chain) {
                    state
                        .chains
                        .entry(chain.to_owned())
                        .or_default()
                        .push(spec.to_owned());
                } else if ENTRIES
                    .iter()
                    .any(|entry| entry.hook == chain && jumps_to(spec, entry.chain))
                {
                    state.jumps.push(Jump {
                        hook: chain.to_owned(),
                        spec: spec.to_owned(),
                    });
                }
            }
        }
        state
    }

    /// Whether anything of ours is present.
    pub fn is_installed(&self) -> bool {
        !self.chains.is_empty() || !self.jumps.is_empty()
    }

    fn jumps_of(&self, entry: Entry) -> impl Iterator<Item = &Jump> {
        self.jumps
            .iter()
            .filter(move |jump| jump.hook == entry.hook && jumps_to(&jump.spec, entry.chain))
    }

    /// Whether the table already holds exactly `rules` with one plain jump per entry chain
    /// they use, and none to an entry chain they do not: a re-run has nothing to do.
    pub fn matches(&self, rules: &CaptureRules) -> bool {
        self.chains == rules.chains
            && ENTRIES.into_iter().all(|entry| {
                let jumps: Vec<&Jump> = self.jumps_of(entry).collect();
                if rules.chains.contains_key(entry.chain) {
                    jumps.len() == 1 && jumps[0].spec == entry.spec()
                } else {
                    jumps.is_empty()
                }
            })
    }

    /// The state right after [`transition_text`] took `self` to `chains`.
    fn after(&self, chains: &BTreeMap<String, Vec<String>>) -> Self {
        let mut jumps = Vec::new();
        for entry in ENTRIES {
            if !chains.contains_key(entry.chain) {
                continue;
            }
            let kept: Vec<Jump> = self.jumps_of(entry).cloned().collect();
            if kept.is_empty() {
                jumps.push(Jump {
                    hook: entry.hook.to_owned(),
                    spec: entry.spec(),
                });
            } else {
                jumps.extend(kept);
            }
        }
        Self {
            chains: chains.clone(),
            jumps,
            rule_count: self.rule_count,
        }
    }
}

fn jumps_to(spec: &str, chain: &str) -> bool {
    let mut words = spec.split_whitespace();
    while let Some(word) = words.next() {
        if (word == "-j" || word == "-g") && words.next() == Some(chain) {
            return true;
        }
    }
    false
}

/// Restore input that takes our part of the table from `current` to exactly `chains`: the
/// chains wanted are declared (created, or flushed) and filled, an entry chain wanted gets a
/// jump unless it has one, and every chain of ours not wanted is unhooked, flushed and
/// deleted. Jumps go before the chains they reach are flushed, and every flush before any
/// delete, since our chains reference each other. Rules we did not write are not named.
fn transition_text(chains: &BTreeMap<String, Vec<String>>, current: &NatState) -> String {
    let mut text = String::from("*nat\n");
    for entry in ENTRIES {
        if !chains.contains_key(entry.chain) {
            for jump in current.jumps_of(entry) {
                let _ = writeln!(text, "-D {} {}", jump.hook, jump.spec);
            }
        }
    }
    let stale: Vec<&str> = OWNED_CHAINS
        .into_iter()
        .filter(|chain| current.chains.contains_key(*chain) && !chains.contains_key(*chain))
        .collect();
    for chain in OWNED_CHAINS
        .into_iter()
        .filter(|chain| chains.contains_key(*chain))
        .chain(stale.iter().copied())
    {
        let _ = writeln!(text, ":{chain} - [0:0]");
    }
    for chain in OWNED_CHAINS {
        for spec in chains.get(chain).into_iter().flatten() {
            let _ = writeln!(text, "-A {chain} {spec}");
        }
    }
    for entry in ENTRIES {
        if chains.contains_key(entry.chain) && current.jumps_of(entry).next().is_none() {
            let _ = writeln!(text, "-A {} {}", entry.hook, entry.spec());
        }
    }
    for chain in stale {
        let _ = writeln!(text, "-X {chain}");
    }
    text.push_str("COMMIT\n");
    text
}

/// Restore input that installs `rules` over `current`, or `None` when they are already in place.
pub fn apply_text(rules: &CaptureRules, current: &NatState) -> Option<String> {
    if current.matches(rules) {
        return None;
    }
    Some(transition_text(&rules.chains, current))
}

/// Restore input that removes everything of ours in `current` (every jump to our entry chains,
/// then our chains), or `None` when nothing of ours is there.
pub fn cleanup_text(current: &NatState) -> Option<String> {
    if !current.is_installed() {
        return None;
    }
    Some(transition_text(&BTreeMap::new(), current))
}

/// Restore input that puts back `previous` after `rules` were applied over it: used to undo one
/// family when a later family fails, so that nothing is left half-applied.
pub fn rollback_text(previous: &NatState, rules: &CaptureRules) -> Option<String> {
    let applied = previous.after(&rules.chains);
    // A previous install missing a jump is not put back half: it is removed.
    let whole = ENTRIES.into_iter().all(|entry| {
        !previous.chains.contains_key(entry.chain) || previous.jumps_of(entry).next().is_some()
    });
    if previous.is_installed() && whole {
        Some(transition_text(&previous.chains, &applied))
    } else {
        cleanup_text(&applied)
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;
    use crate::config::{DnsTarget, InboundCapture};

    fn config(trap: &[&str]) -> CaptureConfig {
        CaptureConfig {
            trap: trap.iter().map(|t| TrapCidr::parse(t).unwrap()).collect(),
            envoy_port: 15001,
            envoy_uid: 1337,
            exclude_uids: vec![],
            exclude_gids: vec![],
            redirect_dns: None,
            inbound: None,
        }
    }

    fn text(config: &CaptureConfig, family: Family, current: &NatState) -> String {
        let rules = CaptureRules::for_family(config, family).unwrap();
        apply_text(&rules, current).unwrap()
    }

    #[test]
    fn golden_default_ipv4() {
        assert_eq!(
            text(
                &config(&["240.240.0.0/16"]),
                Family::V4,
                &NatState::default()
            ),
            "\
*nat
:LATTICE_OUTPUT - [0:0]
:LATTICE_REDIRECT - [0:0]
-A LATTICE_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A LATTICE_OUTPUT -d 127.0.0.0/8 -j RETURN
-A LATTICE_OUTPUT -d 240.240.0.0/16 -p tcp -j LATTICE_REDIRECT
-A LATTICE_REDIRECT -p tcp -j REDIRECT --to-ports 15001
-A OUTPUT -j LATTICE_OUTPUT
COMMIT
"
        );
    }

    #[test]
    fn golden_exclusions_and_dns_redirect() {
        let mut config = config(&["240.240.0.0/16"]);
        config.envoy_port = 16001;
        config.envoy_uid = 2000;
        config.exclude_uids = vec![0, 1000];
        config.exclude_gids = vec![3000];
        config.redirect_dns = Some(DnsTarget("10.0.0.10:53".parse().unwrap()));
        assert_eq!(
            text(&config, Family::V4, &NatState::default()),
            "\
*nat
:LATTICE_OUTPUT - [0:0]
:LATTICE_REDIRECT - [0:0]
-A LATTICE_OUTPUT -m owner --uid-owner 2000 -j RETURN
-A LATTICE_OUTPUT -m owner --uid-owner 0 -j RETURN
-A LATTICE_OUTPUT -m owner --uid-owner 1000 -j RETURN
-A LATTICE_OUTPUT -m owner --gid-owner 3000 -j RETURN
-A LATTICE_OUTPUT -p udp -m udp --dport 53 -j DNAT --to-destination 10.0.0.10:53
-A LATTICE_OUTPUT -p tcp -m tcp --dport 53 -j DNAT --to-destination 10.0.0.10:53
-A LATTICE_OUTPUT -d 127.0.0.0/8 -j RETURN
-A LATTICE_OUTPUT -d 240.240.0.0/16 -p tcp -j LATTICE_REDIRECT
-A LATTICE_REDIRECT -p tcp -j REDIRECT --to-ports 16001
-A OUTPUT -j LATTICE_OUTPUT
COMMIT
"
        );
    }

    #[test]
    fn golden_loopback_dns_target_is_a_port_redirect() {
        let mut config = config(&["240.240.0.0/16"]);
        config.redirect_dns = Some(DnsTarget("127.0.0.1:15053".parse().unwrap()));
        let text = text(&config, Family::V4, &NatState::default());
        assert!(
            text.contains(
                "-A LATTICE_OUTPUT -p udp -m udp --dport 53 -j REDIRECT --to-ports 15053\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn golden_dual_stack() {
        let mut config = config(&["240.240.0.0/16", "fd00:240::/64"]);
        config.redirect_dns = Some(DnsTarget("[fd00::a]:53".parse::<SocketAddr>().unwrap()));
        assert_eq!(
            text(&config, Family::V6, &NatState::default()),
            "\
*nat
:LATTICE_OUTPUT - [0:0]
:LATTICE_REDIRECT - [0:0]
-A LATTICE_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A LATTICE_OUTPUT -p udp -m udp --dport 53 -j DNAT --to-destination [fd00::a]:53
-A LATTICE_OUTPUT -p tcp -m tcp --dport 53 -j DNAT --to-destination [fd00::a]:53
-A LATTICE_OUTPUT -d ::1/128 -j RETURN
-A LATTICE_OUTPUT -d fd00:240::/64 -p tcp -j LATTICE_REDIRECT
-A LATTICE_REDIRECT -p tcp -j REDIRECT --to-ports 15001
-A OUTPUT -j LATTICE_OUTPUT
COMMIT
"
        );
        let v4 = text(&config, Family::V4, &NatState::default());
        assert!(
            !v4.contains("--dport 53"),
            "IPv6 DNS target leaked into IPv4: {v4}"
        );
        assert!(!v4.contains("fd00"), "{v4}");
    }

    #[test]
    fn ipv4_only_leaves_ipv6_alone() {
        assert_eq!(
            CaptureRules::for_family(&config(&["240.240.0.0/16"]), Family::V6),
            None
        );
    }

    const INSTALLED: &str = "\
# Generated by iptables-save v1.8.9
*filter
:INPUT ACCEPT [0:0]
-A INPUT -s 192.0.2.1/32 -j DROP
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:FOREIGN - [0:0]
:LATTICE_OUTPUT - [0:0]
:LATTICE_REDIRECT - [0:0]
-A OUTPUT -d 192.0.2.9/32 -j FOREIGN
-A OUTPUT -j LATTICE_OUTPUT
-A FOREIGN -j RETURN
-A LATTICE_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A LATTICE_OUTPUT -d 127.0.0.0/8 -j RETURN
-A LATTICE_OUTPUT -d 240.240.0.0/16 -p tcp -j LATTICE_REDIRECT
-A LATTICE_REDIRECT -p tcp -j REDIRECT --to-ports 15001
COMMIT
";

    #[test]
    fn rerun_over_identical_rules_is_a_no_op() {
        let state = NatState::parse(INSTALLED);
        assert_eq!(state.rule_count, 8);
        let rules = CaptureRules::for_family(&config(&["240.240.0.0/16"]), Family::V4).unwrap();
        assert_eq!(apply_text(&rules, &state), None);
    }

    #[test]
    fn golden_changed_rules_rewrite_chains_without_a_second_jump() {
        let state = NatState::parse(INSTALLED);
        let mut config = config(&["240.240.0.0/16"]);
        config.envoy_port = 15006;
        assert_eq!(
            text(&config, Family::V4, &state),
            "\
*nat
:LATTICE_OUTPUT - [0:0]
:LATTICE_REDIRECT - [0:0]
-A LATTICE_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A LATTICE_OUTPUT -d 127.0.0.0/8 -j RETURN
-A LATTICE_OUTPUT -d 240.240.0.0/16 -p tcp -j LATTICE_REDIRECT
-A LATTICE_REDIRECT -p tcp -j REDIRECT --to-ports 15006
COMMIT
"
        );
    }

    #[test]
    fn golden_cleanup_names_only_our_rules() {
        assert_eq!(
            cleanup_text(&NatState::parse(INSTALLED)).unwrap(),
            "\
*nat
-D OUTPUT -j LATTICE_OUTPUT
:LATTICE_OUTPUT - [0:0]
:LATTICE_REDIRECT - [0:0]
-X LATTICE_OUTPUT
-X LATTICE_REDIRECT
COMMIT
"
        );
        assert_eq!(cleanup_text(&NatState::default()), None);
    }

    #[test]
    fn rollback_of_a_fresh_install_is_a_cleanup() {
        let rules = CaptureRules::for_family(&config(&["240.240.0.0/16"]), Family::V4).unwrap();
        let rollback = rollback_text(&NatState::default(), &rules).unwrap();
        assert!(
            rollback.contains("-D OUTPUT -j LATTICE_OUTPUT\n"),
            "{rollback}"
        );
        assert!(rollback.contains("-X LATTICE_REDIRECT\n"), "{rollback}");
    }

    #[test]
    fn rollback_of_a_change_restores_the_previous_rules() {
        let previous = NatState::parse(INSTALLED);
        let mut config = config(&["240.240.0.0/16"]);
        config.envoy_port = 15006;
        let rules = CaptureRules::for_family(&config, Family::V4).unwrap();
        let rollback = rollback_text(&previous, &rules).unwrap();
        assert!(rollback.contains("--to-ports 15001\n"), "{rollback}");
        assert!(!rollback.contains("-A OUTPUT"), "{rollback}");
        assert!(!rollback.contains("-X"), "{rollback}");
    }

    #[test]
    fn foreign_jumps_with_matches_are_found() {
        let state = NatState::parse("*nat\n-A OUTPUT -p tcp -j LATTICE_OUTPUT\nCOMMIT\n");
        assert_eq!(
            state.jumps,
            [Jump {
                hook: "OUTPUT".into(),
                spec: "-p tcp -j LATTICE_OUTPUT".into()
            }]
        );
        let cleanup = cleanup_text(&state).unwrap();
        assert!(
            cleanup.contains("-D OUTPUT -p tcp -j LATTICE_OUTPUT\n"),
            "{cleanup}"
        );
    }
    fn inbound(config: &mut CaptureConfig, exclude: &[u16]) {
        config.inbound = Some(InboundCapture {
            port: 15006,
            exclude_ports: exclude.to_vec(),
        });
    }

    #[test]
    fn golden_inbound_capture() {
        let mut config = config(&["240.240.0.0/16"]);
        inbound(&mut config, &[15000, 15001, 15006, 15021]);
        assert_eq!(
            text(&config, Family::V4, &NatState::default()),
            "\
*nat
:LATTICE_OUTPUT - [0:0]
:LATTICE_REDIRECT - [0:0]
:LATTICE_INBOUND - [0:0]
:LATTICE_IN_REDIRECT - [0:0]
-A LATTICE_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A LATTICE_OUTPUT -d 127.0.0.0/8 -j RETURN
-A LATTICE_OUTPUT -d 240.240.0.0/16 -p tcp -j LATTICE_REDIRECT
-A LATTICE_REDIRECT -p tcp -j REDIRECT --to-ports 15001
-A LATTICE_INBOUND -p tcp -m tcp --dport 15000 -j RETURN
-A LATTICE_INBOUND -p tcp -m tcp --dport 15001 -j RETURN
-A LATTICE_INBOUND -p tcp -m tcp --dport 15006 -j RETURN
-A LATTICE_INBOUND -p tcp -m tcp --dport 15021 -j RETURN
-A LATTICE_INBOUND -p tcp -j LATTICE_IN_REDIRECT
-A LATTICE_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
-A OUTPUT -j LATTICE_OUTPUT
-A PREROUTING -j LATTICE_INBOUND
COMMIT
"
        );
    }

    /// `iptables-save` after the inbound install above, with a foreign rule beside ours.
    const INSTALLED_INBOUND: &str = "\
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:LATTICE_INBOUND - [0:0]
:LATTICE_IN_REDIRECT - [0:0]
:LATTICE_OUTPUT - [0:0]
:LATTICE_REDIRECT - [0:0]
-A PREROUTING -s 192.0.2.7/32 -j ACCEPT
-A PREROUTING -j LATTICE_INBOUND
-A OUTPUT -j LATTICE_OUTPUT
-A LATTICE_INBOUND -p tcp -m tcp --dport 15021 -j RETURN
-A LATTICE_INBOUND -p tcp -j LATTICE_IN_REDIRECT
-A LATTICE_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
-A LATTICE_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A LATTICE_OUTPUT -d 127.0.0.0/8 -j RETURN
-A LATTICE_OUTPUT -d 240.240.0.0/16 -p tcp -j LATTICE_REDIRECT
-A LATTICE_REDIRECT -p tcp -j REDIRECT --to-ports 15001
COMMIT
";

    #[test]
    fn an_inbound_install_reads_back_as_installed() {
        let mut config = config(&["240.240.0.0/16"]);
        inbound(&mut config, &[15021]);
        let rules = CaptureRules::for_family(&config, Family::V4).unwrap();
        let state = NatState::parse(INSTALLED_INBOUND);
        assert_eq!(state.jumps.len(), 2, "{:?}", state.jumps);
        assert_eq!(apply_text(&rules, &state), None);
        let after = state.after(&rules.chains);
        assert_eq!(after.chains, state.chains);
        assert_eq!(after.jumps.len(), 2, "no second jump: {:?}", after.jumps);
    }

    #[test]
    fn golden_turning_inbound_capture_off_removes_only_its_part() {
        let state = NatState::parse(INSTALLED_INBOUND);
        assert_eq!(
            text(&config(&["240.240.0.0/16"]), Family::V4, &state),
            "\
*nat
-D PREROUTING -j LATTICE_INBOUND
:LATTICE_OUTPUT - [0:0]
:LATTICE_REDIRECT - [0:0]
:LATTICE_INBOUND - [0:0]
:LATTICE_IN_REDIRECT - [0:0]
-A LATTICE_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A LATTICE_OUTPUT -d 127.0.0.0/8 -j RETURN
-A LATTICE_OUTPUT -d 240.240.0.0/16 -p tcp -j LATTICE_REDIRECT
-A LATTICE_REDIRECT -p tcp -j REDIRECT --to-ports 15001
-X LATTICE_INBOUND
-X LATTICE_IN_REDIRECT
COMMIT
"
        );
    }

    #[test]
    fn golden_cleanup_removes_both_entries() {
        assert_eq!(
            cleanup_text(&NatState::parse(INSTALLED_INBOUND)).unwrap(),
            "\
*nat
-D OUTPUT -j LATTICE_OUTPUT
-D PREROUTING -j LATTICE_INBOUND
:LATTICE_OUTPUT - [0:0]
:LATTICE_REDIRECT - [0:0]
:LATTICE_INBOUND - [0:0]
:LATTICE_IN_REDIRECT - [0:0]
-X LATTICE_OUTPUT
-X LATTICE_REDIRECT
-X LATTICE_INBOUND
-X LATTICE_IN_REDIRECT
COMMIT
"
        );
    }

    #[test]
    fn rollback_of_turning_inbound_on_puts_back_outbound_alone() {
        let previous = NatState::parse(INSTALLED);
        let mut config = config(&["240.240.0.0/16"]);
        inbound(&mut config, &[15021]);
        let rules = CaptureRules::for_family(&config, Family::V4).unwrap();
        let rollback = rollback_text(&previous, &rules).unwrap();
        assert!(
            rollback.contains("-D PREROUTING -j LATTICE_INBOUND\n"),
            "{rollback}"
        );
        assert!(rollback.contains("-X LATTICE_IN_REDIRECT\n"), "{rollback}");
        assert!(!rollback.contains("-D OUTPUT"), "{rollback}");
        assert!(!rollback.contains("-X LATTICE_OUTPUT"), "{rollback}");
        assert_eq!(
            previous.after(&rules.chains).after(&previous.chains).jumps,
            previous.jumps
        );
    }
}
