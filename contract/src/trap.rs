//! The trapped CIDR: the block mesh names resolve into and pods hand to Envoy. One set of rules
//! for every part that takes `--trap-cidr`, so the agent and `lattice-init` can never disagree
//! on which blocks are acceptable, or say it in different words.
//!
//! The rules:
//! - a block is written as its network address and prefix (`240.240.0.0/16`); host bits are
//!   refused, not silently dropped, because a typo there usually means a different block;
//! - IPv4 prefixes from /8 to /30, IPv6 from /32 to /126: wider would trap real networks,
//!   narrower leaves no room for the shared address and one address of a service's own;
//! - a block must not contain the loopback address;
//! - `--trap-cidr` lists exactly one IPv4 block and at most one IPv6 block, not overlapping.
//!   Mesh names resolve to IPv4 addresses from the IPv4 block. An IPv6 block is captured by
//!   `lattice-init` as well, so IPv6 traffic to it cannot leak, but the agent hands out no
//!   addresses from it (mesh names have no AAAA records).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::Serialize;

/// The prefix lengths a trapped block may have, per family.
const IPV4_PREFIXES: (u8, u8) = (8, 30);
const IPV6_PREFIXES: (u8, u8) = (32, 126);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TrapCidrError {
    #[error(
        "--trap-cidr {value:?} is not a CIDR block; give one like 240.240.0.0/16 or fd00:240::/64"
    )]
    Syntax { value: String },
    #[error(
        "--trap-cidr {value} is too wide to trap safely (shortest accepted prefix: /{min}); use a \
         small unrouted block such as 240.240.0.0/16"
    )]
    TooWide { value: String, min: u8 },
    #[error(
        "--trap-cidr {value} is too narrow (longest accepted prefix: /{max}): the block must hold \
         the shared address and at least one address for a service of its own"
    )]
    TooNarrow { value: String, max: u8 },
    #[error("--trap-cidr {value} has host bits set; give the network address: {network}")]
    HostBits { value: String, network: String },
    #[error(
        "--trap-cidr {value} contains the loopback address; choose a block outside 127.0.0.0/8 \
         and ::1"
    )]
    Loopback { value: String },
    #[error("--trap-cidr is empty; give at least one block, e.g. 240.240.0.0/16")]
    Empty,
    #[error("--trap-cidr blocks {first} and {second} overlap; give each block once")]
    Overlap { first: String, second: String },
    #[error(
        "--trap-cidr gives two {family} blocks, {first} and {second}; give at most one per \
         family (service addresses come from a single block)"
    )]
    SameFamily {
        family: &'static str,
        first: String,
        second: String,
    },
    #[error(
        "--trap-cidr {given} has no IPv4 block; mesh names resolve to IPv4 addresses, so add one \
         such as 240.240.0.0/16"
    )]
    NoIpv4 { given: String },
}

/// One validated trapped block (IPv4 or IPv6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TrapCidr(IpNet);

impl TrapCidr {
    pub fn parse(text: &str) -> Result<Self, TrapCidrError> {
        let value = text.trim();
        let net: IpNet = value.parse().map_err(|_| TrapCidrError::Syntax {
            value: value.to_owned(),
        })?;
        let ((min, max), loopback) = match net {
            IpNet::V4(_) => (IPV4_PREFIXES, IpAddr::V4(Ipv4Addr::LOCALHOST)),
            IpNet::V6(_) => (IPV6_PREFIXES, IpAddr::V6(Ipv6Addr::LOCALHOST)),
        };
        if net.prefix_len() < min {
            return Err(TrapCidrError::TooWide {
                value: value.to_owned(),
                min,
            });
        }
        if net.prefix_len() > max {
            return Err(TrapCidrError::TooNarrow {
                value: value.to_owned(),
                max,
            });
        }
        if net.trunc() != net {
            return Err(TrapCidrError::HostBits {
                value: value.to_owned(),
                network: net.trunc().to_string(),
            });
        }
        if net.contains(&loopback) {
            return Err(TrapCidrError::Loopback {
                value: value.to_owned(),
            });
        }
        Ok(TrapCidr(net))
    }

    pub fn net(&self) -> IpNet {
        self.0
    }

    pub fn is_ipv6(&self) -> bool {
        matches!(self.0, IpNet::V6(_))
    }

    /// The block's first host address (`240.240.0.1`): the address every all-HTTP service
    /// shares, and the one `lattice-init --validate` dials.
    pub fn first_host(&self) -> IpAddr {
        match self.0 {
            IpNet::V4(net) => IpAddr::V4(Ipv4Addr::from(u32::from(net.network()) + 1)),
            IpNet::V6(net) => IpAddr::V6(Ipv6Addr::from(u128::from(net.network()) + 1)),
        }
    }
}

impl fmt::Display for TrapCidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for TrapCidr {
    type Err = TrapCidrError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TrapCidr::parse(s)
    }
}

/// What `--trap-cidr` names as a whole: one IPv4 block and at most one IPv6 block.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(into = "String")]
pub struct TrapCidrs {
    /// Sorted, IPv4 first; the IPv4 block is always there.
    blocks: Vec<TrapCidr>,
}

impl TrapCidrs {
    /// Takes the values of `--trap-cidr`, each one block or a comma-separated list.
    pub fn parse<S: AsRef<str>>(values: &[S]) -> Result<Self, TrapCidrError> {
        let mut blocks = values
            .iter()
            .flat_map(|value| value.as_ref().split(','))
            .filter(|text| !text.trim().is_empty())
            .map(TrapCidr::parse)
            .collect::<Result<Vec<_>, _>>()?;
        blocks.sort();
        blocks.dedup();
        if blocks.is_empty() {
            return Err(TrapCidrError::Empty);
        }
        for (i, first) in blocks.iter().enumerate() {
            for second in &blocks[i + 1..] {
                if first.net().contains(&second.net()) || second.net().contains(&first.net()) {
                    return Err(TrapCidrError::Overlap {
                        first: first.to_string(),
                        second: second.to_string(),
                    });
                }
                if first.is_ipv6() == second.is_ipv6() {
                    return Err(TrapCidrError::SameFamily {
                        family: if first.is_ipv6() { "IPv6" } else { "IPv4" },
                        first: first.to_string(),
                        second: second.to_string(),
                    });
                }
            }
        }
        let trap = TrapCidrs { blocks };
        if trap.ipv4_block().is_none() {
            return Err(TrapCidrError::NoIpv4 {
                given: trap.to_string(),
            });
        }
        Ok(trap)
    }

    /// Every block, IPv4 first.
    pub fn blocks(&self) -> &[TrapCidr] {
        &self.blocks
    }

    fn ipv4_block(&self) -> Option<Ipv4Net> {
        self.blocks.iter().find_map(|block| match block.net() {
            IpNet::V4(net) => Some(net),
            IpNet::V6(_) => None,
        })
    }

    /// The IPv4 block, which mesh names resolve into.
    pub fn ipv4(&self) -> Ipv4Net {
        // `parse` refuses a list without an IPv4 block, and nothing else builds one.
        self.ipv4_block().unwrap_or_default()
    }

    /// The IPv6 block, when one is given.
    pub fn ipv6(&self) -> Option<Ipv6Net> {
        self.blocks.iter().find_map(|block| match block.net() {
            IpNet::V6(net) => Some(net),
            IpNet::V4(_) => None,
        })
    }

    /// The address every all-HTTP service shares: the IPv4 block's first host.
    pub fn shared(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.ipv4().network()) + 1)
    }
}

impl fmt::Display for TrapCidrs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, block) in self.blocks.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            block.fmt(f)?;
        }
        Ok(())
    }
}

impl FromStr for TrapCidrs {
    type Err = TrapCidrError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TrapCidrs::parse(&[s])
    }
}

impl From<TrapCidrs> for String {
    fn from(trap: TrapCidrs) -> String {
        trap.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_one_ipv4_block_and_one_ipv6_block() {
        let trap: TrapCidrs = "240.240.0.0/16".parse().unwrap();
        assert_eq!(trap.shared(), Ipv4Addr::new(240, 240, 0, 1));
        assert_eq!(trap.ipv6(), None);
        let trap = TrapCidrs::parse(&["fd00:240::/64", " 240.240.0.0/16"]).unwrap();
        assert_eq!(trap.to_string(), "240.240.0.0/16,fd00:240::/64");
        assert_eq!(trap.ipv4().to_string(), "240.240.0.0/16");
        assert_eq!(
            trap.blocks()[1].first_host().to_string(),
            "fd00:240::1",
            "the first host of an IPv6 block"
        );
        for edge in ["10.0.0.0/8", "240.240.0.0/30"] {
            assert!(edge.parse::<TrapCidrs>().is_ok(), "{edge}");
        }
    }

    #[test]
    fn refuses_with_the_value_named() {
        let cases = [
            ("banana", "\"banana\" is not a CIDR block"),
            ("240.240.0.0/40", "is not a CIDR block"),
            (
                "240.240.0.5/16",
                "has host bits set; give the network address: 240.240.0.0/16",
            ),
            ("240.0.0.0/4", "240.0.0.0/4 is too wide"),
            ("fd00::/16", "fd00::/16 is too wide"),
            ("240.240.0.0/31", "240.240.0.0/31 is too narrow"),
            ("240.1.2.3/32", "240.1.2.3/32 is too narrow"),
            ("fd00::/127", "fd00::/127 is too narrow"),
            ("127.0.0.0/8", "loopback"),
            ("", "is empty"),
            ("240.240.0.0/16,240.240.1.0/24", "overlap"),
            ("240.240.0.0/16,241.0.0.0/24", "two IPv4 blocks"),
            ("240.240.0.0/16,fd00:1::/64,fd00:2::/64", "two IPv6 blocks"),
            ("fd00:240::/64", "fd00:240::/64 has no IPv4 block"),
        ];
        for (value, needle) in cases {
            let err = value.parse::<TrapCidrs>().unwrap_err().to_string();
            assert!(err.contains(needle), "{value:?}: {err}");
            assert!(err.starts_with("--trap-cidr "), "{value:?}: {err}");
        }
    }
}
