//! The agent's zone as third-party checkers see it: dnsviz and Zonemaster run against the real
//! `lattice-agent`, delegated to from a fake root (a real knot) in a network namespace with only
//! loopback, so no query can leave it; and the ISC EDNS-compliance checks and CHAOS queries
//! asked with dig. Only the findings a private, unsigned, one-server zone must have are
//! allowed; anything else fails the test.
//!
//! The namespace: the agent's DNS on 127.0.0.2:53 (so `ns.system.internal` is 127.0.0.2), the
//! root on 127.0.0.3:53 delegating `system.internal` to `ns.system.internal` with that glue,
//! and the agent forwarding other names to the root.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use lattice_e2e::agent::{Agent, AgentAddrs};
use lattice_e2e::netns::{Netns, Process};
use lattice_e2e::wait;

const AGENT_DNS: &str = "127.0.0.2";
const ROOT: &str = "127.0.0.3";

const MESH: &str = "services:
  - path: /foo/bar/buzz
    ports: [{port: 8080, protocol: http, name: web}]
    endpoints: [{address: 10.200.0.3}]
  - path: /foo/db
    ports: [{port: 5432, protocol: tcp}]
    endpoints: [{address: 10.200.0.9}]
";

/// What dnsviz may report about this zone: the test's loopback addresses are private.
const DNSVIZ_ALLOWED: &[&str] = &["GLUE_PRIVATE_IP", "NS_NAME_PRIVATE_IP"];

/// What Zonemaster may report (test case, tag), and why each must be.
const ZONEMASTER_ALLOWED: &[(&str, &str)] = &[
    // The name server's address is the test's loopback: private, with no reverse name.
    ("ADDRESS01", "NAMESERVER_IP_PRIVATE_NETWORK"),
    ("ADDRESS02", "NAMESERVER_IP_WITHOUT_REVERSE"),
    // One agent per node answers the zone: one name server, one address family.
    ("DELEGATION01", "NOT_ENOUGH_NS_DEL"),
    ("DELEGATION01", "NOT_ENOUGH_NS_CHILD"),
    ("DELEGATION01", "NOT_ENOUGH_IPV4_NS_DEL"),
    ("DELEGATION01", "NOT_ENOUGH_IPV4_NS_CHILD"),
    ("DELEGATION01", "NO_IPV6_NS_DEL"),
    ("DELEGATION01", "NO_IPV6_NS_CHILD"),
    // Unsigned by design.
    ("DNSSEC07", "NEITHER_DNSKEY_NOR_DS"),
    ("UNSPECIFIED", "NOT_SIGNED"),
    // The agent is its pods' resolver: it recurses (forwards) for every other name.
    ("NAMESERVER01", "IS_A_RECURSOR"),
    // The zone takes no mail (its apex has a null MX), so the SOA's mailbox cannot either.
    ("SYNTAX06", "RNAME_MAIL_DOMAIN_INVALID"),
    // The SOA minimum is the negative TTL, 30 s, so a new mesh name resolves within 30 s.
    ("ZONE06", "SOA_DEFAULT_TTL_MAXIMUM_VALUE_LOWER"),
];

/// The namespace, the fake root and the agent; dropped in reverse order.
struct CheckedZone {
    dir: tempfile::TempDir,
    agent: Agent,
    _root: Process,
    netns: Netns,
}

impl CheckedZone {
    fn start() -> CheckedZone {
        let netns = Netns::new("dnscheck").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let root = start_root(&netns, dir.path());
        let mesh = dir.path().join("mesh.yaml");
        std::fs::write(&mesh, MESH).unwrap();
        let loopback = |port| SocketAddr::from(([127, 0, 0, 1], port));
        let agent = Agent::start_in_netns(
            &netns,
            AgentAddrs {
                xds: loopback(15010),
                dns: format!("{AGENT_DNS}:53").parse().unwrap(),
                admin: loopback(15020),
            },
            &[
                "--mesh-file",
                mesh.to_str().unwrap(),
                &format!("--upstream-dns={ROOT}:53"),
            ],
            &[],
        );
        agent.wait_ready().unwrap();
        CheckedZone {
            dir,
            agent,
            _root: root,
            netns,
        }
    }

    /// `dig @127.0.0.2 ARGS` inside the namespace.
    fn dig(&self, args: &[&str]) -> String {
        let output = self
            .netns
            .run(
                "dig",
                &[&[&format!("@{AGENT_DNS}"), "+tries=1", "+time=2"], args].concat(),
            )
            .unwrap();
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// The value of the agent's metric line starting with `prefix`, 0 if absent.
    fn metric(&self, prefix: &str) -> f64 {
        let (_, body) = self.agent.get("/metrics").unwrap();
        body.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .map_or(0.0, |v| v.parse().unwrap())
    }
}

/// knot serving a root zone that delegates `system.internal` to the agent.
fn start_root(netns: &Netns, dir: &Path) -> Process {
    let d = dir.display();
    std::fs::write(
        dir.join("root.zone"),
        format!(
            ". 86400 IN SOA a.root-test. hostmaster.root-test. 1 14400 3600 604800 86400\n\
             . 86400 IN NS a.root-test.\n\
             a.root-test. 86400 IN A {ROOT}\n\
             system.internal. 86400 IN NS ns.system.internal.\n\
             ns.system.internal. 86400 IN A {AGENT_DNS}\n"
        ),
    )
    .unwrap();
    let conf = dir.join("knot.conf");
    std::fs::write(
        &conf,
        format!(
            "server:\n    listen: {ROOT}@53\n    rundir: {d}\n    user: root:root\n\
             database:\n    storage: {d}\n\
             log:\n  - target: stderr\n    any: warning\n\
             zone:\n  - domain: .\n    file: {d}/root.zone\n"
        ),
    )
    .unwrap();
    let mut command = netns.command("knotd");
    command.arg("-c").arg(&conf);
    let root = netns.spawn(command).unwrap();
    wait::until("the fake root to answer", Duration::from_secs(10), || {
        let out = netns
            .run(
                "dig",
                &[&format!("@{ROOT}"), "+tries=1", "+time=1", ".", "SOA"],
            )
            .map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.contains("status: NOERROR").then_some(()).ok_or(text)
    })
    .unwrap();
    root
}

/// Every error and warning code in dnsviz's assessment, with where it was found.
fn dnsviz_findings(json: &serde_json::Value, path: &str, out: &mut Vec<(String, String)>) {
    match json {
        serde_json::Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("errors" | "warnings", serde_json::Value::Array(findings)) => {
                        for finding in findings {
                            let code = finding["code"].as_str().unwrap_or("?").to_string();
                            out.push((code, format!("{path} {key}")));
                        }
                    }
                    _ => dnsviz_findings(value, &format!("{path}/{key}"), out),
                }
            }
        }
        serde_json::Value::Array(items) => {
            for item in items {
                dnsviz_findings(item, path, out);
            }
        }
        _ => {}
    }
}

#[test]
fn dnsviz_and_zonemaster_find_only_what_a_private_unsigned_one_server_zone_must_have() {
    let zone = CheckedZone::start();
    let probe = zone.dir.path().join("probe.json");
    let grok = zone.dir.path().join("grok.json");
    let output = zone
        .netns
        .run(
            "dnsviz",
            &[
                "probe",
                "-4",
                "-A",
                "-E",
                "-n",
                "-x",
                &format!(".:a.root-test={ROOT}"),
                "-o",
                probe.to_str().unwrap(),
                "system.internal",
            ],
        )
        .unwrap();
    assert!(output.status.success(), "dnsviz probe: {output:?}");
    let output = zone
        .netns
        .run(
            "dnsviz",
            &[
                "grok",
                "-r",
                probe.to_str().unwrap(),
                "-o",
                grok.to_str().unwrap(),
            ],
        )
        .unwrap();
    assert!(output.status.success(), "dnsviz grok: {output:?}");
    let assessment: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&grok).unwrap()).unwrap();
    assert!(
        assessment.get("system.internal.").is_some(),
        "dnsviz assessed the zone: {assessment}"
    );
    let mut findings = Vec::new();
    dnsviz_findings(&assessment, "", &mut findings);
    eprintln!("dnsviz: {findings:?}");
    let unexpected: Vec<_> = findings
        .iter()
        .filter(|(code, _)| !DNSVIZ_ALLOWED.contains(&code.as_str()))
        .collect();
    assert!(
        unexpected.is_empty(),
        "dnsviz found {unexpected:?} in {assessment:#}"
    );

    let hints = zone.dir.path().join("root.hints");
    std::fs::write(
        &hints,
        format!(". 3600000 IN NS a.root-test.\na.root-test. 3600000 IN A {ROOT}\n"),
    )
    .unwrap();
    let output = zone
        .netns
        .run(
            "zonemaster-cli",
            &[
                "--hints",
                hints.to_str().unwrap(),
                "--no-ipv6",
                "--raw",
                "--show-testcase",
                "--level",
                "NOTICE",
                "--no-progress",
                "system.internal",
            ],
        )
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "zonemaster-cli: {output:?}");
    eprintln!("Zonemaster:\n{text}");
    // Lines: seconds, level, test case, tag, arguments.
    let findings: Vec<(&str, &str, &str)> = text
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let (_, level, case, tag) =
                (words.next()?, words.next()?, words.next()?, words.next()?);
            ["CRITICAL", "ERROR", "WARNING", "NOTICE"]
                .contains(&level)
                .then_some((level, case, tag))
        })
        .collect();
    assert!(
        findings.contains(&("ERROR", "ADDRESS01", "NAMESERVER_IP_PRIVATE_NETWORK")),
        "Zonemaster reached the agent's name server:\n{text}"
    );
    let unexpected: Vec<_> = findings
        .iter()
        .filter(|(_, case, tag)| !ZONEMASTER_ALLOWED.contains(&(case, tag)))
        .collect();
    assert!(
        unexpected.is_empty(),
        "Zonemaster found {unexpected:?}:\n{text}"
    );
}

/// The dig answer's status, whether it carries an OPT record, and its EDNS line.
fn status_and_opt(out: &str) -> (String, Option<String>) {
    let status = lattice_e2e::agent::dig_status(out);
    let opt = out
        .lines()
        .find(|l| l.starts_with("; EDNS:"))
        .map(str::to_string);
    (status, opt)
}

#[test]
fn edns_compliance_and_chaos_as_the_isc_checks_and_rfc_4892_ask() {
    let zone = CheckedZone::start();
    // The name server's name resolves to the address the agent answers on.
    let out = zone.dig(&["+norec", "ns.system.internal", "A"]);
    assert!(
        out.contains("ns.system.internal.\t30\tIN\tA\t127.0.0.2"),
        "{out}"
    );
    let out = zone.dig(&["+norec", "system.internal", "NS"]);
    assert!(out.contains("flags: qr aa"), "{out}");
    assert!(
        out.contains("ns.system.internal.\t30\tIN\tA\t127.0.0.2"),
        "the address goes along as additional data: {out}"
    );

    // A reply to a query with OPT carries OPT (RFC 6891 §6.1.1), header-only errors included,
    // and never the client's unknown options.
    // (what, dig arguments, status, whether the query also makes sense without EDNS)
    for (what, args, status, plain_too) in [
        (
            "opcode 15",
            &["+opcode=15", "+header-only"][..],
            "NOTIMP",
            true,
        ),
        (
            "NOTIFY",
            &["+opcode=4", "system.internal", "SOA"][..],
            "NOTIMP",
            true,
        ),
        (
            "UPDATE",
            &["+opcode=5", "system.internal", "SOA"][..],
            "NOTIMP",
            true,
        ),
        ("STATUS", &["+opcode=2", "+header-only"][..], "NOTIMP", true),
        ("no question", &["+header-only"][..], "FORMERR", true),
        (
            "cookie probe",
            &["+header-only", "+cookie"][..],
            "FORMERR",
            false,
        ),
        (
            "edns1",
            &["+edns=1", "+noednsneg", "system.internal", "SOA"][..],
            "BADVERS",
            false,
        ),
        (
            "unknown option",
            &["+ednsopt=100", "system.internal", "SOA"][..],
            "NOERROR",
            false,
        ),
    ] {
        let out = zone.dig(&[&["+norec", "+edns=0"], args].concat());
        let (got, opt) = status_and_opt(&out);
        assert_eq!(got, status, "{what}: {out}");
        let opt = opt.unwrap_or_else(|| panic!("{what}: no OPT in the reply: {out}"));
        assert!(opt.contains("version: 0"), "{what}: {opt}");
        assert!(
            !out.contains("OPT=100"),
            "{what}: the unknown option came back: {out}"
        );
        if plain_too {
            let out = zone.dig(&[&["+norec", "+noedns"], args].concat());
            let (got, opt) = status_and_opt(&out);
            assert_eq!(
                (got.as_str(), opt),
                (status, None),
                "{what} without EDNS: {out}"
            );
        }
    }

    // CHAOS names are answered here, never by the upstream in the agent's name.
    let asked = zone.metric("lattice_dns_upstream_queries_total");
    for name in [
        "version.bind",
        "hostname.bind",
        "id.server",
        "version.server",
    ] {
        let out = zone.dig(&["+norec", "CH", "TXT", name]);
        assert_eq!(status_and_opt(&out).0, "REFUSED", "{name}: {out}");
        assert!(!out.contains("ANSWER: 1"), "{name}: {out}");
    }
    assert_eq!(
        zone.metric("lattice_dns_upstream_queries_total"),
        asked,
        "no CHAOS query was forwarded"
    );
    // Other names still are, to the root here.
    let out = zone.dig(&["www.example.test"]);
    assert_eq!(status_and_opt(&out).0, "NXDOMAIN", "{out}");
    assert!(zone.metric("lattice_dns_upstream_queries_total") > asked);
}
