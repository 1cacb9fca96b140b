//! Owns the netlink edge: the addresses configured on the pod's interfaces, read with rtnetlink,
//! so that init can refuse a trapped block that contains the pod's own address.

use std::net::IpAddr;

use futures::TryStreamExt as _;
use netlink_packet_route::address::AddressAttribute;

use crate::config::TrapCidr;

#[derive(Debug, thiserror::Error)]
pub enum InterfaceError {
    #[error("could not open a netlink socket to read the pod's addresses: {0}")]
    Socket(std::io::Error),
    #[error("could not list the pod's addresses over netlink: {0}")]
    Dump(rtnetlink::Error),
    #[error(
        "the pod's own address {address} is inside the trapped block {cidr}; every connection to it would be captured. Choose a --trap-cidr that no pod or node uses (the default 240.240.0.0/16 is never routed)"
    )]
    AddressInTrap { address: IpAddr, cidr: TrapCidr },
    #[error(
        "the pod has the {family} address {address} but no {family} --trap-cidr is given, so --inbound-capture installs no {family} rules and connections to that address would reach the app uncaptured; add a {family} trapped block"
    )]
    InboundFamilyUncovered {
        address: IpAddr,
        family: &'static str,
    },
}

/// Every address on every interface of this network namespace.
pub async fn addresses() -> Result<Vec<IpAddr>, InterfaceError> {
    let (connection, handle, _) = rtnetlink::new_connection().map_err(InterfaceError::Socket)?;
    let task = tokio::spawn(connection);
    let mut dump = handle.address().get().execute();
    let mut found = Vec::new();
    let result = loop {
        match dump.try_next().await {
            Ok(Some(message)) => {
                for attribute in message.attributes {
                    if let AddressAttribute::Address(ip) | AddressAttribute::Local(ip) = attribute {
                        found.push(ip);
                    }
                }
            }
            Ok(None) => break Ok(()),
            Err(err) => break Err(InterfaceError::Dump(err)),
        }
    };
    task.abort();
    result?;
    found.sort();
    found.dedup();
    Ok(found)
}

/// Refuses when any of `addresses` lies inside a trapped block.
pub fn check_outside_trap(addresses: &[IpAddr], trap: &[TrapCidr]) -> Result<(), InterfaceError> {
    for address in addresses {
        if let Some(cidr) = trap.iter().find(|cidr| cidr.net().contains(address)) {
            return Err(InterfaceError::AddressInTrap {
                address: *address,
                cidr: *cidr,
            });
        }
    }
    Ok(())
}

/// Refuses when inbound capture would leave one of the pod's reachable addresses uncaptured:
/// rules are installed per family of the trapped blocks, so a routable address of another
/// family would reach the app past Envoy. Loopback and link-local addresses are not reached
/// from other pods.
pub fn check_inbound_covered(
    addresses: &[IpAddr],
    trap: &[TrapCidr],
) -> Result<(), InterfaceError> {
    for address in addresses {
        let (reachable, family) = match address {
            IpAddr::V4(v4) => (!v4.is_loopback() && !v4.is_link_local(), "IPv4"),
            IpAddr::V6(v6) => (
                !v6.is_loopback() && !v6.is_unicast_link_local() && !v6.is_unspecified(),
                "IPv6",
            ),
        };
        if reachable && !trap.iter().any(|cidr| cidr.is_ipv6() == address.is_ipv6()) {
            return Err(InterfaceError::InboundFamilyUncovered {
                address: *address,
                family,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_inside_the_block_is_refused() {
        let trap = [TrapCidr::parse("240.240.0.0/16").unwrap()];
        let inside: Vec<IpAddr> = vec!["10.1.2.3".parse().unwrap(), "240.240.9.9".parse().unwrap()];
        let err = check_outside_trap(&inside, &trap).unwrap_err();
        assert!(err.to_string().contains("240.240.9.9"), "{err}");
        let outside: Vec<IpAddr> = vec!["10.1.2.3".parse().unwrap(), "::1".parse().unwrap()];
        check_outside_trap(&outside, &trap).unwrap();
    }

    #[test]
    fn inbound_capture_refuses_a_routable_address_of_an_uncaptured_family() {
        let v4_only = [TrapCidr::parse("240.240.0.0/16").unwrap()];
        let local: Vec<IpAddr> = ["10.1.2.3", "127.0.0.1", "::1", "fe80::1", "169.254.1.1"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        check_inbound_covered(&local, &v4_only).unwrap();
        let dual: Vec<IpAddr> = vec!["10.1.2.3".parse().unwrap(), "fd00:99::1".parse().unwrap()];
        let err = check_inbound_covered(&dual, &v4_only).unwrap_err();
        assert!(err.to_string().contains("fd00:99::1"), "{err}");
        let both = [
            TrapCidr::parse("240.240.0.0/16").unwrap(),
            TrapCidr::parse("fd00:240::/64").unwrap(),
        ];
        check_inbound_covered(&dual, &both).unwrap();
    }
}
