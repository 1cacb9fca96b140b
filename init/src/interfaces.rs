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
}
