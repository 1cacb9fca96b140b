//! The node-local DNS address: a link-local address (the manifests use
//! [`lattice_contract::NODE_LOCAL_DNS`]) that the agent adds to the node with netlink before its
//! DNS server binds, and removes on shutdown, as NodeLocal DNSCache does. Pods reach it through their `dnsConfig`; being link-local, it is the
//! same on every node and never routed off the node.
//!
//! The address goes on a dummy link of our own ([`LINK_NAME`]), so removing the link removes
//! everything we added. Where dummy links are unavailable (no `dummy` kernel module, some
//! sandboxes), it goes on `lo` instead and only the address is removed.

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

/// The node-local address while it is installed. [`NodeLocalAddress::remove`] takes it away;
/// dropping it without that (an early return on a start-up error) removes it too.
#[derive(Debug)]
pub struct NodeLocalAddress {
    address: IpAddr,
    link: &'static str,
    link_index: u32,
    installed: bool,
}

impl NodeLocalAddress {
    /// Adds `address` (as a host route: /32 or /128) to [`LINK_NAME`], created if needed, or to
    /// `lo` where dummy links are unavailable. Idempotent: an address or link left behind by an
    /// agent that was killed is taken over.
    pub async fn install(address: IpAddr) -> Result<NodeLocalAddress, NodeLocalAddressError> {
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
        // From here on, a failure (or a drop) removes what was added.
        let installed = NodeLocalAddress {
            address,
            link,
            link_index,
            installed: true,
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
        Ok(installed)
    }

    /// Removes the address (and our dummy link). Call it after the DNS server has stopped.
    pub async fn remove(mut self) -> Result<(), NodeLocalAddressError> {
        self.installed = false;
        uninstall(self.address, self.link, self.link_index).await?;
        info!(address = %self.address, link = self.link, "node-local DNS address removed");
        Ok(())
    }
}

impl Drop for NodeLocalAddress {
    fn drop(&mut self) {
        if !self.installed {
            return;
        }
        // Drop cannot await, and may run inside a runtime that must not be blocked on, so the
        // removal gets a thread and a runtime of its own. Threads inherit the network
        // namespace, so it removes the same address.
        let (address, link, index) = (self.address, self.link, self.link_index);
        let removed = std::thread::scope(|scope| {
            scope
                .spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .map_err(NodeLocalAddressError::Connect)?;
                    runtime.block_on(uninstall(address, link, index))
                })
                .join()
        });
        match removed {
            Ok(Ok(())) => info!(%address, link, "node-local DNS address removed"),
            Ok(Err(error)) => warn!(%error, "node-local DNS address left in place"),
            Err(_) => warn!(%address, "node-local DNS address left in place: removal panicked"),
        }
    }
}

fn connect() -> Result<Handle, NodeLocalAddressError> {
    let (connection, handle, _) =
        rtnetlink::new_connection().map_err(NodeLocalAddressError::Connect)?;
    // The connection task ends when the last handle is dropped.
    tokio::spawn(connection);
    Ok(handle)
}

async fn uninstall(
    address: IpAddr,
    link: &'static str,
    index: u32,
) -> Result<(), NodeLocalAddressError> {
    let handle = connect()?;
    let netlink = |action| {
        move |source| NodeLocalAddressError::Netlink {
            action,
            address,
            source,
        }
    };
    if link == LINK_NAME {
        // Deleting our link deletes its addresses with it.
        return match handle.link().del(index).execute().await {
            Err(error) if is_not_found(&error) => Ok(()),
            other => other.map_err(netlink("delete the dummy link")),
        };
    }
    let found: Vec<_> = handle
        .address()
        .get()
        .set_link_index_filter(index)
        .set_address_filter(address)
        .execute()
        .try_collect()
        .await
        .map_err(netlink("look up the address"))?;
    for message in found {
        match handle.address().del(message).execute().await {
            Err(error) if is_not_found(&error) => {}
            other => other.map_err(netlink("delete the address"))?,
        }
    }
    Ok(())
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
        Some(code) if code == errno_value::ENODEV || code == errno_value::EADDRNOTAVAIL
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
    pub const EADDRNOTAVAIL: i32 = 99;
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
