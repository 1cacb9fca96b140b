//! `dig` as the tests run it on the host's loopback, against servers on ports the kernel picked.
//!
//! dig sets SO_REUSEPORT on its UDP socket and lets the kernel pick its port, and the kernel's
//! UDP port search counts a port whose sockets all have SO_REUSEPORT, under the same user, as
//! free. A DNS server under test binds its port with SO_REUSEPORT too (so an upgrade can bind
//! beside it), so a root dig can be given the server's own port, join its group, and be
//! handed its own query (a test then reads a "reply" without QR, its cookie "echoed"). As
//! another user it cannot: the kernel never gives it a port a root socket holds. Servers on
//! port 53 in production are out of the ephemeral range and never meet this.

use std::process::Command;

/// `setpriv` runs dig as this user and group (`nobody`, `nogroup`).
const NOBODY: [&str; 3] = ["--reuid=65534", "--regid=65534", "--clear-groups"];

/// A `dig` command that runs as `nobody`; add its arguments.
pub fn command() -> Command {
    let mut command = Command::new("setpriv");
    command.args(NOBODY).arg("dig");
    command
}

#[cfg(test)]
mod tests {
    use std::net::UdpSocket;
    use std::os::fd::AsRawFd;

    use nix::sys::socket::{setsockopt, sockopt};

    /// The port of a root SO_REUSEPORT socket, as a server under test holds it, is one this dig
    /// cannot take even when asked for it, so the kernel's own pick never gives it either. (A
    /// root dig takes it, and the group's hash decides whether it reads its own query back.)
    #[test]
    fn dig_cannot_join_a_servers_reuseport_group() {
        let fd = nix::sys::socket::socket(
            nix::sys::socket::AddressFamily::Inet,
            nix::sys::socket::SockType::Datagram,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        setsockopt(&fd, sockopt::ReusePort, &true).unwrap();
        let server = UdpSocket::from(fd);
        let any = nix::sys::socket::SockaddrIn::new(127, 0, 0, 1, 0);
        nix::sys::socket::bind(server.as_raw_fd(), &any).unwrap();
        let port = server.local_addr().unwrap().port();
        let output = super::command()
            .args(["-b", &format!("127.0.0.1#{port}"), "@127.0.0.1"])
            .args(["-p", &port.to_string(), "+tries=1", "+time=1", "x.example"])
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&output.stdout);
        assert!(said.contains("address in use"), "{said}");
    }
}
