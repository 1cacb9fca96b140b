//! The agent's default upstreams: the `nameserver` lines of a resolv.conf.

use std::net::{IpAddr, SocketAddr, SocketAddrV6};
use std::path::Path;

use crate::error::DnsError;

/// The nameservers of the resolv.conf at `path`, on port 53, in file order. Lines that are not
/// valid `nameserver ADDRESS` lines are skipped with a warning, as the C library does.
pub fn upstreams_from_resolv_conf(path: &Path) -> Result<Vec<SocketAddr>, DnsError> {
    let text = std::fs::read_to_string(path).map_err(|source| DnsError::ResolvConf {
        path: path.to_path_buf(),
        source,
    })?;
    let upstreams = parse_resolv_conf(&text);
    if upstreams.is_empty() {
        return Err(DnsError::NoNameservers {
            path: path.to_path_buf(),
        });
    }
    Ok(upstreams)
}

fn parse_resolv_conf(text: &str) -> Vec<SocketAddr> {
    let mut upstreams = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if words.next() != Some("nameserver") {
            continue;
        }
        let Some(address) = words.next() else {
            tracing::warn!(line, "resolv.conf nameserver line without an address");
            continue;
        };
        // IPv6 link-local servers carry a zone (`fe80::1%eth0`); a numeric zone is kept.
        let (ip, zone) = address.split_once('%').unwrap_or((address, ""));
        match ip.parse::<IpAddr>() {
            Ok(IpAddr::V6(v6)) => upstreams.push(SocketAddr::V6(SocketAddrV6::new(
                v6,
                53,
                0,
                zone.parse().unwrap_or(0),
            ))),
            Ok(ip) => upstreams.push(SocketAddr::new(ip, 53)),
            Err(_) => tracing::warn!(
                address,
                "resolv.conf nameserver is not an IP address; skipped"
            ),
        }
    }
    upstreams
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_nameservers_in_order() {
        let text = "# comment\nsearch ns.svc.cluster.local svc.cluster.local\nnameserver 10.96.0.10\nnameserver   fd00::53\nnameserver bogus\nnameserver\noptions ndots:5\n";
        let got = parse_resolv_conf(text);
        assert_eq!(
            got,
            vec![
                "10.96.0.10:53".parse().unwrap(),
                "[fd00::53]:53".parse().unwrap()
            ]
        );
    }

    #[test]
    fn errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("resolv.conf");
        std::fs::write(&empty, "search example\n").unwrap();
        let err = upstreams_from_resolv_conf(&empty).unwrap_err().to_string();
        assert!(err.contains("resolv.conf"), "{err}");
        let missing = dir.path().join("missing");
        let err = upstreams_from_resolv_conf(&missing)
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing"), "{err}");
    }
}
