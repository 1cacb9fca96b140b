//! The node-local DNS address: a link-local address (the manifests use
//! [`lattice_contract::NODE_LOCAL_DNS`]) that the agent adds to the node with netlink before its
//! DNS server binds, as NodeLocal DNSCache does. Pods reach it through their `dnsConfig`; being
//! link-local, it is the same on every node and never routed off the node.
//!
//! The agent never removes it, on SIGTERM or otherwise (NodeLocal DNSCache's `-skipteardown`):
//! in a rolling upgrade the next agent serves on it while this one drains, and removing it
//! would cut the node's DNS off from both. Adding it is idempotent, so a restarted or upgraded
//! agent takes over what its predecessor left. Uninstalling removes it by hand
//! (docs/install.md).
//!
//! The address goes on a dummy link of our own ([`LINK_NAME`]), so removing the link removes
//! everything we added. Where dummy links are unavailable (no `dummy` kernel module, some
//! sandboxes), it goes on `lo` instead.

use std::net::{IpAddr, SocketAddr};

use futures::TryStreamExt;
use rtnetlink::{Handle, LinkDummy, LinkUnspec};
use tracing::{info, warn};

/// The dummy link the address lives on; ours by name, so a leftover one (after a crash) is reused.
pub const LINK_NAME: &str = "lattice-dns0";

const LOOPBACK: &str = "lo";

#[derive(Debug, thiserror::Error)]
pub enum NodeLocalAddressError {
    #[error(
        "cannot open a netlink socket ({0}); adding the node-local DNS address needs \
         CAP_NET_ADMIN, or drop --node-local-dns"
    )]
    Connect(std::io::Error),
    #[error(
        "cannot {action} for the node-local DNS address {address}; the agent needs \
         CAP_NET_ADMIN in the node's network namespace, or drop --node-local-dns"
    )]
    Netlink {
        action: &'static str,
        address: IpAddr,
        source: rtnetlink::Error,
    },
    #[error(
        "link {0} vanished while the node-local DNS address was being added; restart the agent"
    )]
    LinkGone(&'static str),
    #[error(
        "--dns-addr {dns_addr} does not listen on --node-local-dns {address}: pods querying \
         {address} would get no answer; set --dns-addr to {address}:53 (or 0.0.0.0:53)"
    )]
    Mismatch {
        dns_addr: SocketAddr,
        address: IpAddr,
    },
}

/// Checks that the DNS server will listen on the node-local address, so `--check-config`
/// catches manifests where the two drifted apart.
pub fn check_dns_addr(
    dns_addr: SocketAddr,
    address: Option<IpAddr>,
) -> Result<(), NodeLocalAddressError> {
    match address {
        Some(address) if dns_addr.ip() != address && !dns_addr.ip().is_unspecified() => {
            Err(NodeLocalAddressError::Mismatch { dns_addr, address })
        }
        _ => Ok(()),
    }
}

/// Adds `address` (as a host route: /32 or /128) to [`LINK_NAME`], created if needed, or to
/// `lo` where dummy links are unavailable, and returns the link it is on. Idempotent: an
/// address or link left by an earlier agent is taken over.
pub async fn install(address: IpAddr) -> Result<&'static str, NodeLocalAddressError> {
    let handle = connect()?;
    let netlink = |action| {
        move |source| NodeLocalAddressError::Netlink {
            action,
            address,
            source,
        }
    };
    let (link, link_index) = match link_index(&handle, LINK_NAME)
        .await
        .map_err(netlink("look up the dummy link"))?
    {
        Some(index) => (LINK_NAME, index),
        None => match handle
            .link()
            .add(LinkDummy::new(LINK_NAME).up().build())
            .execute()
            .await
        {
            Ok(()) => {
                let index = link_index(&handle, LINK_NAME)
                    .await
                    .map_err(netlink("look up the new dummy link"))?
                    .ok_or(NodeLocalAddressError::LinkGone(LINK_NAME))?;
                (LINK_NAME, index)
            }
            Err(error) if is_permission_denied(&error) => {
                return Err(netlink("create the dummy link")(error));
            }
            Err(error) => {
                warn!(
                    %error,
                    "dummy links are unavailable here; putting the node-local DNS address on lo"
                );
                let index = link_index(&handle, LOOPBACK)
                    .await
                    .map_err(netlink("look up lo"))?
                    .ok_or(NodeLocalAddressError::LinkGone(LOOPBACK))?;
                (LOOPBACK, index)
            }
        },
    };
    handle
        .link()
        .set(LinkUnspec::new_with_index(link_index).up().build())
        .execute()
        .await
        .map_err(netlink("bring the link up"))?;
    handle
        .address()
        .add(link_index, address, host_prefix(address))
        .replace()
        .execute()
        .await
        .map_err(netlink("add the address"))?;
    info!(%address, link, "node-local DNS address installed");
    Ok(link)
}

fn connect() -> Result<Handle, NodeLocalAddressError> {
    let (connection, handle, _) =
        rtnetlink::new_connection().map_err(NodeLocalAddressError::Connect)?;
    // The connection task ends when the last handle is dropped.
    tokio::spawn(connection);
    Ok(handle)
}

async fn link_index(handle: &Handle, name: &str) -> Result<Option<u32>, rtnetlink::Error> {
    match handle
        .link()
        .get()
        .match_name(name)
        .execute()
        .try_next()
        .await
    {
        Ok(link) => Ok(link.map(|link| link.header.index)),
        Err(error) if is_not_found(&error) => Ok(None),
        Err(error) => Err(error),
    }
}

fn host_prefix(address: IpAddr) -> u8 {
    match address {
        IpAddr::V4(_) => 32,
        IpAddr::V6(_) => 128,
    }
}

fn errno(error: &rtnetlink::Error) -> Option<i32> {
    match error {
        rtnetlink::Error::NetlinkError(message) => message.to_io().raw_os_error(),
        _ => None,
    }
}

fn is_not_found(error: &rtnetlink::Error) -> bool {
    matches!(
        errno(error),
        Some(code) if code == errno_value::ENODEV
    )
}

fn is_permission_denied(error: &rtnetlink::Error) -> bool {
    matches!(
        errno(error),
        Some(code) if code == errno_value::EPERM || code == errno_value::EACCES
    )
}

/// The errno values we tell apart, from `asm-generic/errno-base.h` and `errno.h` (the same on
/// every Linux architecture the agent targets).
mod errno_value {
    pub const EPERM: i32 = 1;
    pub const EACCES: i32 = 13;
    pub const ENODEV: i32 = 19;
}

#[cfg(test)]
mod tests {
    use lattice_contract::NODE_LOCAL_DNS;

    use super::*;

    const DEFAULT_ADDRESS: IpAddr = IpAddr::V4(NODE_LOCAL_DNS);

    #[test]
    fn dns_must_listen_on_the_node_local_address() {
        let on = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert!(check_dns_addr(on("169.254.20.10:53"), Some(DEFAULT_ADDRESS)).is_ok());
        assert!(check_dns_addr(on("0.0.0.0:53"), Some(DEFAULT_ADDRESS)).is_ok());
        assert!(check_dns_addr(on("127.0.0.1:15053"), None).is_ok());
        let err = check_dns_addr(on("127.0.0.1:53"), Some(DEFAULT_ADDRESS))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("127.0.0.1:53") && err.contains("169.254.20.10"),
            "{err}"
        );
    }

    #[test]
    fn host_prefixes() {
        assert_eq!(host_prefix(DEFAULT_ADDRESS), 32);
        assert_eq!(host_prefix("fd00::53".parse().unwrap()), 128);
    }
}
