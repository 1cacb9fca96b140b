//! Owns the command line: the flags (also read from `LATTICE_*` environment variables), their
//! defaults, and their validation into one immutable [`InitConfig`]. Nothing here touches the
//! system, so every refusal for bad input happens before any change.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use clap::{ArgAction, Parser, ValueEnum};
use lattice_contract::{
    CapturePort, DEFAULT_TRAP_CIDR, ENVOY_ADMIN_PORT, ENVOY_INBOUND_PORT, ENVOY_READINESS_PORT,
    ENVOY_UID, NODE_LOCAL_DNS, TrapCidrError, TrapCidrs, XDS_PORT,
};

pub use lattice_contract::TrapCidr;

/// `(uid_t)-1`: the kernel's "no id", never a real owner.
const NO_ID: u32 = u32::MAX;

/// `lattice-init`: write the Envoy bootstrap and install the iptables rules that send TCP for the
/// trapped CIDR to Envoy. Run as root with NET_ADMIN inside the pod's network namespace.
///
/// Exit codes: 0 success; 1 the environment refused (missing binary or kernel table, pod address
/// inside the trapped block, iptables failure); 2 invalid flags; 3 `--validate` found that capture
/// does not work.
#[derive(Debug, Parser)]
#[command(name = "lattice-init", version)]
pub struct Args {
    /// Trapped block(s) to capture: one IPv4 block (the one lattice-agent resolves mesh names
    /// into, so give both the same value), and optionally one IPv6 block, which adds the
    /// matching ip6tables rules. Repeat the flag or give a comma list.
    #[arg(
        long,
        env = "LATTICE_TRAP_CIDR",
        value_delimiter = ',',
        default_value = DEFAULT_TRAP_CIDR
    )]
    pub trap_cidr: Vec<String>,

    /// Port of Envoy's capture listener, where the trapped block is redirected: the agent's
    /// listener is on its own --envoy-port, so give both the same value. Not Envoy's admin
    /// (15000), readiness (15021) or inbound (15006) port.
    #[arg(long, env = "LATTICE_ENVOY_PORT", default_value_t = CapturePort::default(), value_name = "PORT")]
    pub envoy_port: CapturePort,

    /// UID Envoy runs as; its traffic is never captured.
    #[arg(long, env = "LATTICE_ENVOY_UID", default_value_t = ENVOY_UID)]
    pub envoy_uid: u32,

    /// More UIDs whose traffic is never captured (repeat or comma list).
    #[arg(long, env = "LATTICE_EXCLUDE_UID", value_delimiter = ',')]
    pub exclude_uid: Vec<u32>,

    /// GIDs whose traffic is never captured (repeat or comma list).
    #[arg(long, env = "LATTICE_EXCLUDE_GID", value_delimiter = ',')]
    pub exclude_gid: Vec<u32>,

    /// The node agent's xDS server, HOST:PORT. Default: the node-local address the agent
    /// serves xDS on in a cluster, `169.254.20.10:15010`, which only this node's pods reach.
    #[arg(long, env = "LATTICE_XDS_ADDRESS")]
    pub xds_address: Option<String>,

    /// xDS protocol variant Envoy uses over ADS.
    #[arg(long, env = "LATTICE_XDS_MODE", value_enum, default_value_t = XdsMode::Delta)]
    pub xds_mode: XdsMode,

    /// Which statistics Envoy keeps: `mesh` (its own, the xDS connection's, listeners', and
    /// per mesh cluster only how many endpoints it has and how many are healthy) or `all`
    /// (Envoy's default, about 150 per cluster: at 10k clusters about 1.7 s more to take them
    /// and 120 MiB more). With either, a cluster's traffic statistics are made on its first
    /// request.
    #[arg(long, env = "LATTICE_ENVOY_STATS", value_enum, default_value_t = EnvoyStats::Mesh)]
    pub envoy_stats: EnvoyStats,

    /// Envoy node id. Default: `$POD_NAME.$POD_NAMESPACE`.
    #[arg(long, env = "LATTICE_NODE_ID")]
    pub node_id: Option<String>,

    /// Where to write the Envoy bootstrap (JSON). Without it no bootstrap is written.
    #[arg(long, env = "LATTICE_BOOTSTRAP_OUT")]
    pub bootstrap_out: Option<PathBuf>,

    /// Also capture the TCP that arrives for the pod: every port but Envoy's own and those of
    /// --exclude-inbound-port is redirected to Envoy's inbound listener (port 15006), which
    /// hands it to the app on its original port. Covers each family a trapped block is given
    /// for; a pod with an address of another family is refused, since that family would
    /// reach the app uncaptured.
    #[arg(long, env = "LATTICE_INBOUND_CAPTURE", action = ArgAction::SetTrue)]
    pub inbound_capture: bool,

    /// Ports whose inbound TCP reaches the app directly, never Envoy (repeat or comma list),
    /// beside Envoy's own (admin, capture, inbound, readiness). Only with --inbound-capture.
    #[arg(
        long,
        env = "LATTICE_EXCLUDE_INBOUND_PORT",
        value_delimiter = ',',
        value_name = "PORT"
    )]
    pub exclude_inbound_port: Vec<u16>,

    /// Send DNS (UDP and TCP port 53) from non-excluded UIDs to the node agent's DNS at ADDR:PORT.
    /// Applies to the address family of ADDR only.
    #[arg(long, env = "LATTICE_REDIRECT_DNS")]
    pub redirect_dns: Option<String>,

    /// iptables backend: `auto` follows the rules the namespace already holds.
    #[arg(long, env = "LATTICE_IPTABLES_BACKEND", value_enum, default_value_t = BackendChoice::Auto)]
    pub iptables_backend: BackendChoice,

    /// Print the rules and the bootstrap; change nothing.
    #[arg(long, env = "LATTICE_DRY_RUN", action = ArgAction::SetTrue,
          conflicts_with_all = ["cleanup", "check_config", "validate"])]
    pub dry_run: bool,

    /// Remove exactly the rules init installed (our chains and the jump to them), nothing else.
    #[arg(long, env = "LATTICE_CLEANUP", action = ArgAction::SetTrue,
          conflicts_with_all = ["check_config", "validate"])]
    pub cleanup: bool,

    /// After applying, prove with a temporary listener that a connection into the trapped block
    /// lands on the Envoy port with the right original destination (exit code 3 if not).
    #[arg(long, env = "LATTICE_VALIDATE", action = ArgAction::SetTrue)]
    pub validate: bool,

    /// Parse and validate the flags, then exit 0 without touching the system. Values that only
    /// exist inside a pod (`POD_NAME`, `POD_NAMESPACE`) may be absent.
    #[arg(long, env = "LATTICE_CHECK_CONFIG", action = ArgAction::SetTrue,
          conflicts_with = "validate")]
    pub check_config: bool,
}

/// SotW (`GRPC`) or incremental (`DELTA_GRPC`) ADS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum XdsMode {
    Delta,
    Sotw,
}

/// Which statistics the bootstrap lets Envoy keep ([`crate::bootstrap`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EnvoyStats {
    Mesh,
    All,
}

/// Which iptables implementation to drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    Auto,
    Nft,
    Legacy,
}

/// What this run does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Apply { validate: bool },
    DryRun,
    Cleanup,
    CheckConfig,
}

/// Where the DNS redirect sends queries. A loopback target becomes a REDIRECT (port only), any
/// other address a DNAT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DnsTarget(pub SocketAddr);

/// The node agent's xDS endpoint as written into the bootstrap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum XdsHost {
    Ip(IpAddr),
    Name(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XdsAddress {
    pub host: XdsHost,
    pub port: u16,
}

impl XdsAddress {
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let bad = || ConfigError::XdsAddress {
            value: text.to_owned(),
        };
        if let Ok(addr) = text.parse::<SocketAddr>() {
            if addr.port() == 0 {
                return Err(bad());
            }
            return Ok(Self {
                host: XdsHost::Ip(addr.ip()),
                port: addr.port(),
            });
        }
        let (host, port) = text.rsplit_once(':').ok_or_else(bad)?;
        let port: u16 = port.parse().map_err(|_| bad())?;
        let label_ok = |label: &str| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        };
        if port == 0 || host.len() > 253 || !host.split('.').all(label_ok) {
            return Err(bad());
        }
        Ok(Self {
            host: XdsHost::Name(host.to_owned()),
            port,
        })
    }
}

impl fmt::Display for XdsAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            XdsHost::Ip(ip) => SocketAddr::new(*ip, self.port).fmt(f),
            XdsHost::Name(name) => write!(f, "{name}:{}", self.port),
        }
    }
}

/// Everything the iptables rules depend on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureConfig {
    pub trap: Vec<TrapCidr>,
    pub envoy_port: u16,
    pub envoy_uid: u32,
    pub exclude_uids: Vec<u32>,
    pub exclude_gids: Vec<u32>,
    pub redirect_dns: Option<DnsTarget>,
    /// Inbound capture, when asked for.
    pub inbound: Option<InboundCapture>,
}

/// What of the pod's inbound TCP is redirected to Envoy's inbound listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboundCapture {
    /// Where it is redirected: [`ENVOY_INBOUND_PORT`].
    pub port: u16,
    /// Destination ports left alone, sorted: Envoy's own, then the pod's.
    pub exclude_ports: Vec<u16>,
}

impl CaptureConfig {
    pub fn has_ipv4(&self) -> bool {
        self.trap.iter().any(|cidr| !cidr.is_ipv6())
    }

    pub fn has_ipv6(&self) -> bool {
        self.trap.iter().any(TrapCidr::is_ipv6)
    }
}

/// Everything the Envoy bootstrap depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootstrapConfig {
    pub node_id: String,
    pub xds: XdsAddress,
    pub mode: XdsMode,
    pub stats: EnvoyStats,
    /// Whether inbound capture is on: then Envoy gets the cluster that hands inbound
    /// connections to the app.
    pub inbound: bool,
}

/// The resolved, validated configuration of one run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitConfig {
    pub capture: CaptureConfig,
    /// `None` when the node id or xDS address cannot be resolved and nothing needs them.
    pub bootstrap: Option<BootstrapConfig>,
    pub bootstrap_out: Option<PathBuf>,
    pub backend: BackendChoice,
    pub action: Action,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error(transparent)]
    Trap(#[from] TrapCidrError),
    #[error(
        "--envoy-uid {0} is not allowed: 0 would exempt every root process from capture and 4294967295 is not a uid; give the uid Envoy runs as (default 1337)"
    )]
    EnvoyUid(u32),
    #[error("--exclude-{kind} 4294967295 is not a valid {kind}; give a real numeric {kind}")]
    ExcludedId { kind: &'static str },
    #[error(
        "--redirect-dns {value:?} is not ADDR:PORT with a non-zero port; give e.g. 10.0.0.10:53 or [fd00::a]:53"
    )]
    DnsTarget { value: String },
    #[error(
        "--redirect-dns {value} is {family} but no {family} --trap-cidr is given, so no {family} rules are installed; add a {family} block or use an address of the other family"
    )]
    DnsFamily { value: String, family: &'static str },
    #[error(
        "--xds-address {value:?} is not HOST:PORT with a non-zero port; give e.g. 10.0.0.1:15010"
    )]
    XdsAddress { value: String },
    #[error("--node-id {value:?} must be non-empty without whitespace, e.g. <pod>.<namespace>")]
    NodeId { value: String },
    #[error(
        "--exclude-inbound-port 0 is not a port; give the ports whose inbound TCP must reach the app directly (1-65535)"
    )]
    InboundPortZero,
    #[error(
        "--exclude-inbound-port is given without --inbound-capture; add --inbound-capture, or drop the ports"
    )]
    InboundPortsWithoutCapture,
    #[error("the Envoy bootstrap needs {missing}; set it, or drop --bootstrap-out")]
    BootstrapIncomplete { missing: &'static str },
}

impl InitConfig {
    /// Validates the parsed flags. `env` reads the pod environment (`POD_NAME`,
    /// `POD_NAMESPACE`); it is a parameter so that tests need no process environment.
    pub fn from_args(
        args: Args,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let action = if args.dry_run {
            Action::DryRun
        } else if args.cleanup {
            Action::Cleanup
        } else if args.check_config {
            Action::CheckConfig
        } else {
            Action::Apply {
                validate: args.validate,
            }
        };
        let capture = capture_config(&args)?;

        let xds = match &args.xds_address {
            Some(flag) => Some(XdsAddress::parse(flag)?),
            None => Some(XdsAddress {
                host: XdsHost::Ip(IpAddr::V4(NODE_LOCAL_DNS)),
                port: XDS_PORT,
            }),
        };
        let node_id = match (&args.node_id, env("POD_NAME"), env("POD_NAMESPACE")) {
            (Some(flag), _, _) => Some(flag.clone()),
            (None, Some(pod), Some(namespace)) => Some(format!("{pod}.{namespace}")),
            _ => None,
        };
        if let Some(id) = &node_id
            && (id.is_empty() || id.chars().any(char::is_whitespace))
        {
            return Err(ConfigError::NodeId { value: id.clone() });
        }
        let needs_bootstrap =
            args.bootstrap_out.is_some() && matches!(action, Action::Apply { .. } | Action::DryRun);
        let bootstrap = match (node_id, xds) {
            (Some(node_id), Some(xds)) => Some(BootstrapConfig {
                node_id,
                xds,
                mode: args.xds_mode,
                stats: args.envoy_stats,
                inbound: args.inbound_capture,
            }),
            (None, _) if needs_bootstrap => {
                return Err(ConfigError::BootstrapIncomplete {
                    missing: "a node id (--node-id, or POD_NAME and POD_NAMESPACE)",
                });
            }
            (_, None) if needs_bootstrap => {
                return Err(ConfigError::BootstrapIncomplete {
                    missing: "the agent's xDS address (--xds-address)",
                });
            }
            _ => None,
        };
        Ok(Self {
            capture,
            bootstrap,
            bootstrap_out: args.bootstrap_out,
            backend: args.iptables_backend,
            action,
        })
    }
}

fn capture_config(args: &Args) -> Result<CaptureConfig, ConfigError> {
    let trap = TrapCidrs::parse(&args.trap_cidr)?.blocks().to_vec();
    if args.envoy_uid == 0 || args.envoy_uid == NO_ID {
        return Err(ConfigError::EnvoyUid(args.envoy_uid));
    }
    let ids = |list: &[u32], kind: &'static str| -> Result<Vec<u32>, ConfigError> {
        if list.contains(&NO_ID) {
            return Err(ConfigError::ExcludedId { kind });
        }
        let mut ids = list.to_vec();
        ids.sort_unstable();
        ids.dedup();
        Ok(ids)
    };
    let mut exclude_uids = ids(&args.exclude_uid, "uid")?;
    exclude_uids.retain(|uid| *uid != args.envoy_uid);
    let exclude_gids = ids(&args.exclude_gid, "gid")?;

    let inbound = inbound_capture(args)?;

    let capture = CaptureConfig {
        trap,
        envoy_port: args.envoy_port.get(),
        envoy_uid: args.envoy_uid,
        exclude_uids,
        exclude_gids,
        redirect_dns: None,
        inbound,
    };
    let redirect_dns = match &args.redirect_dns {
        None => None,
        Some(text) => {
            let addr = text
                .trim()
                .parse::<SocketAddr>()
                .ok()
                .filter(|addr| addr.port() != 0)
                .ok_or_else(|| ConfigError::DnsTarget {
                    value: text.clone(),
                })?;
            let (covered, family) = match addr {
                SocketAddr::V4(_) => (capture.has_ipv4(), "IPv4"),
                SocketAddr::V6(_) => (capture.has_ipv6(), "IPv6"),
            };
            if !covered {
                return Err(ConfigError::DnsFamily {
                    value: addr.to_string(),
                    family,
                });
            }
            Some(DnsTarget(addr))
        }
    };
    Ok(CaptureConfig {
        redirect_dns,
        ..capture
    })
}

fn inbound_capture(args: &Args) -> Result<Option<InboundCapture>, ConfigError> {
    if !args.inbound_capture {
        if !args.exclude_inbound_port.is_empty() {
            return Err(ConfigError::InboundPortsWithoutCapture);
        }
        return Ok(None);
    }
    if args.exclude_inbound_port.contains(&0) {
        return Err(ConfigError::InboundPortZero);
    }
    // Envoy's own ports are never the app's: the kubelet reaches readiness directly, and a
    // connection redirected to the inbound or capture port would be handed back to Envoy.
    let own = [
        ENVOY_ADMIN_PORT,
        args.envoy_port.get(),
        ENVOY_INBOUND_PORT,
        ENVOY_READINESS_PORT,
    ];
    let mut exclude_ports: Vec<u16> = own
        .into_iter()
        .chain(args.exclude_inbound_port.iter().copied())
        .collect();
    exclude_ports.sort_unstable();
    exclude_ports.dedup();
    Ok(Some(InboundCapture {
        port: ENVOY_INBOUND_PORT,
        exclude_ports,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<InitConfig, ConfigError> {
        let args =
            Args::try_parse_from(std::iter::once("lattice-init").chain(args.iter().copied()))
                .expect("flags parse");
        InitConfig::from_args(args, |name| match name {
            "POD_NAME" => Some("web-0".into()),
            "POD_NAMESPACE" => Some("shop".into()),
            _ => None,
        })
    }

    #[test]
    fn defaults_follow_the_design() {
        let config = parse(&["--bootstrap-out", "/tmp/b.json"]).unwrap();
        assert_eq!(
            config.capture.trap,
            vec![TrapCidr::parse("240.240.0.0/16").unwrap()]
        );
        assert_eq!(config.capture.envoy_port, 15001);
        assert_eq!(config.capture.envoy_uid, 1337);
        let bootstrap = config.bootstrap.unwrap();
        assert_eq!(bootstrap.node_id, "web-0.shop");
        assert_eq!(bootstrap.xds.to_string(), "169.254.20.10:15010");
        assert_eq!(bootstrap.mode, XdsMode::Delta);
        assert_eq!(config.action, Action::Apply { validate: false });
        assert_eq!(config.backend, BackendChoice::Auto);
    }

    #[test]
    fn trap_cidr_takes_repeats_and_comma_lists() {
        let config = parse(&[
            "--trap-cidr",
            "fd00:240::/64",
            "--trap-cidr",
            "240.240.0.0/16",
        ])
        .unwrap();
        let blocks: Vec<String> = config
            .capture
            .trap
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(blocks, ["240.240.0.0/16", "fd00:240::/64"]);
        assert!(config.capture.has_ipv6());
    }

    #[test]
    fn bad_inputs_are_refused_with_the_input_named() {
        let cases: &[(&[&str], &str)] = &[
            (&["--trap-cidr", "nonsense"], "\"nonsense\" is not a CIDR"),
            (&["--trap-cidr", "240.240.0.1/16"], "240.240.0.0/16"),
            (&["--trap-cidr", "0.0.0.0/0"], "too wide"),
            (&["--trap-cidr", "10.0.0.0/7"], "too wide"),
            (&["--trap-cidr", "fd00::/16"], "too wide"),
            (&["--trap-cidr", "127.0.0.0/8"], "loopback"),
            (&["--trap-cidr", "240.240.0.0/16,240.240.1.0/24"], "overlap"),
            (&["--trap-cidr", ""], "empty"),
            (&["--envoy-uid", "0"], "--envoy-uid 0"),
            (&["--envoy-uid", "4294967295"], "--envoy-uid 4294967295"),
            (&["--exclude-gid", "4294967295"], "--exclude-gid"),
            (&["--redirect-dns", "10.0.0.10"], "--redirect-dns"),
            (&["--redirect-dns", "10.0.0.10:0"], "--redirect-dns"),
            (&["--redirect-dns", "[fd00::a]:53"], "no IPv6 --trap-cidr"),
            (&["--xds-address", "10.0.0.1"], "--xds-address"),
            (&["--xds-address", "bad host:15010"], "--xds-address"),
            (&["--node-id", "a b"], "--node-id"),
            (
                &["--inbound-capture", "--exclude-inbound-port", "8080,0"],
                "--exclude-inbound-port 0",
            ),
            (
                &["--exclude-inbound-port", "8080"],
                "without --inbound-capture",
            ),
        ];
        for (args, needle) in cases {
            let err = parse(args).expect_err(&format!("{args:?} must be refused"));
            assert!(err.to_string().contains(needle), "{args:?}: {err}");
        }
    }

    #[test]
    fn out_of_range_numbers_fail_at_parse_time() {
        for args in [
            ["--envoy-port", "70000"],
            ["--envoy-port", "0"],
            ["--envoy-port", "15021"],
            ["--envoy-uid", "abc"],
        ] {
            assert!(
                Args::try_parse_from(std::iter::once("lattice-init").chain(args)).is_err(),
                "{args:?}"
            );
        }
    }

    #[test]
    fn inbound_capture_always_spares_envoys_own_ports() {
        assert_eq!(parse(&[]).unwrap().capture.inbound, None);
        let config = parse(&[
            "--inbound-capture",
            "--envoy-port",
            "16001",
            "--exclude-inbound-port",
            "9090,8081",
            "--exclude-inbound-port",
            "15021",
        ])
        .unwrap();
        assert_eq!(
            config.capture.inbound,
            Some(InboundCapture {
                port: 15006,
                exclude_ports: vec![8081, 9090, 15000, 15006, 15021, 16001],
            })
        );
    }

    #[test]
    fn xds_address_accepts_names_and_ipv6() {
        let name = XdsAddress::parse("lattice-agent.lattice-system:15010").unwrap();
        assert_eq!(
            name.host,
            XdsHost::Name("lattice-agent.lattice-system".into())
        );
        let v6 = XdsAddress::parse("[fd00::1]:15010").unwrap();
        assert_eq!(v6.to_string(), "[fd00::1]:15010");
    }

    #[test]
    fn bootstrap_inputs_are_only_required_when_a_bootstrap_is_written() {
        let args =
            Args::try_parse_from(["lattice-init", "--bootstrap-out", "/tmp/b.json"]).unwrap();
        let err = InitConfig::from_args(args, |_| None).unwrap_err();
        assert!(
            matches!(err, ConfigError::BootstrapIncomplete { .. }),
            "{err}"
        );

        let args = Args::try_parse_from(["lattice-init"]).unwrap();
        assert_eq!(
            InitConfig::from_args(args, |_| None).unwrap().bootstrap,
            None
        );

        let args = Args::try_parse_from([
            "lattice-init",
            "--check-config",
            "--bootstrap-out",
            "/b.json",
        ])
        .unwrap();
        let config = InitConfig::from_args(args, |_| None).unwrap();
        assert_eq!(config.action, Action::CheckConfig);
    }

    #[test]
    fn modes_are_exclusive() {
        assert!(Args::try_parse_from(["lattice-init", "--dry-run", "--cleanup"]).is_err());
        assert!(Args::try_parse_from(["lattice-init", "--cleanup", "--validate"]).is_err());
    }

    #[test]
    fn envoy_uid_is_not_repeated_in_the_exclusions() {
        let config = parse(&["--exclude-uid", "1337,1000,1000", "--exclude-gid", "7"]).unwrap();
        assert_eq!(config.capture.exclude_uids, vec![1000]);
        assert_eq!(config.capture.exclude_gids, vec![7]);
    }
}
