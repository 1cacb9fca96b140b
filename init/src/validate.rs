//! Owns `--validate`: proof that the installed rules capture. A temporary listener takes Envoy's
//! port, this process dials an address in the trapped block, and the accepted connection must
//! carry that address as its `SO_ORIGINAL_DST`.

use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use nix::sys::socket::{SockaddrIn, SockaddrIn6, getsockopt, sockopt};

/// The port dialled inside the trapped block; any port is captured, this one is easy to spot.
pub const PROBE_PORT: u16 = 15999;

#[derive(Debug, thiserror::Error)]
pub enum ValidateError {
    #[error(
        "cannot listen on Envoy's port {port} for the self-check: {source}; stop whatever holds the port or drop --validate"
    )]
    Listen { port: u16, source: std::io::Error },
    #[error(
        "dialling {target} failed ({source}); the pod needs a route (usually its default route) that covers the trapped block"
    )]
    Dial {
        target: SocketAddr,
        source: std::io::Error,
    },
    #[error(
        "a connection to {target} did not arrive on port {port} within {timeout:?}: the capture rules are not in effect"
    )]
    NotCaptured {
        target: SocketAddr,
        port: u16,
        timeout: Duration,
    },
    #[error("the captured connection reports original destination {found}, expected {target}")]
    WrongOriginalDst {
        target: SocketAddr,
        found: SocketAddr,
    },
    #[error("could not read SO_ORIGINAL_DST of the captured connection: {0}")]
    OriginalDst(nix::Error),
    #[error("self-check socket error: {0}")]
    Io(std::io::Error),
}

/// Dials `target`, expecting the connection on `envoy_port`; returns the original destination.
pub fn check_capture(
    target: IpAddr,
    envoy_port: u16,
    timeout: Duration,
) -> Result<SocketAddr, ValidateError> {
    let any: IpAddr = match target {
        IpAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        IpAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let listener =
        TcpListener::bind((any, envoy_port)).map_err(|source| ValidateError::Listen {
            port: envoy_port,
            source,
        })?;
    listener.set_nonblocking(true).map_err(ValidateError::Io)?;
    let target = SocketAddr::new(target, PROBE_PORT);
    let client = TcpStream::connect_timeout(&target, timeout)
        .map_err(|source| ValidateError::Dial { target, source })?;
    let client_addr = client.local_addr().map_err(ValidateError::Io)?;

    let deadline = Instant::now() + timeout;
    let accepted = loop {
        match listener.accept() {
            Ok((stream, peer)) if peer == client_addr => break stream,
            Ok(_) => continue,
            Err(err) if err.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(ValidateError::NotCaptured {
                        target,
                        port: envoy_port,
                        timeout,
                    });
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(err) => return Err(ValidateError::Io(err)),
        }
    };
    let found = original_dst(&accepted)?;
    if found != target {
        return Err(ValidateError::WrongOriginalDst { target, found });
    }
    Ok(found)
}

/// The destination a REDIRECTed connection was dialled to, as the kernel's NAT recorded it.
pub fn original_dst(stream: &TcpStream) -> Result<SocketAddr, ValidateError> {
    match stream.local_addr().map_err(ValidateError::Io)? {
        SocketAddr::V4(_) => getsockopt(stream, sockopt::OriginalDst)
            .map(|raw| SocketAddr::from(SockaddrIn::from(raw)))
            .map_err(ValidateError::OriginalDst),
        SocketAddr::V6(_) => getsockopt(stream, sockopt::Ip6tOriginalDst)
            .map(|raw| SocketAddr::from(SockaddrIn6::from(raw)))
            .map_err(ValidateError::OriginalDst),
    }
}
