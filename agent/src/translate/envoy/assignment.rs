//! A service port's endpoint assignment (`ClusterLoadAssignment`, EDS) written straight to its
//! protobuf bytes, the very bytes prost writes for [`super::load_assignment`]'s message (the
//! tests hold the two to it), so versions do not change with the writer.
//!
//! Why by hand: a 50k-service mesh has 500k endpoints, and building each as nested messages
//! (an `LbEndpoint`, its `Endpoint`, `Address` and `SocketAddress`, the address formatted into
//! a `String`) before prost measured and wrote them again level by level was a quarter of the
//! mesh's translation (perf, in a restart at 50k). The shape written is small and fixed: the
//! endpoints grouped by priority and zone, each an IP and a port.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::{IpAddr, SocketAddr};

use prost::encoding::{encode_varint, encoded_len_varint};

use super::fields::{
    bytes_key, delimited_len, put_delimited, put_text, string_field_len, varint_key,
};

/// One endpoint of an assignment: its address, zone and priority.
pub(super) struct PlacedIp<'a> {
    pub address: SocketAddr,
    pub zone: Option<&'a str>,
    pub priority: u32,
}

const KEY_1_BYTES: u8 = bytes_key(1);
const KEY_2_BYTES: u8 = bytes_key(2);
const KEY_3_VARINT: u8 = varint_key(3);
const KEY_5_VARINT: u8 = varint_key(5);

/// The encoded `ClusterLoadAssignment` of `cluster_name`: `endpoints` grouped by priority and
/// zone, one `LocalityLbEndpoints` each, in (priority, zone) order; an assignment without
/// endpoints keeps its one empty group. The same bytes as prost's encoding of
/// [`super::load_assignment`] for the same endpoints.
pub(super) fn encode<'a>(
    cluster_name: &str,
    endpoints: impl IntoIterator<Item = PlacedIp<'a>>,
) -> Vec<u8> {
    let mut groups: BTreeMap<(u32, Option<&str>), Vec<Endpoint>> = BTreeMap::new();
    for placed in endpoints {
        groups
            .entry((placed.priority, placed.zone))
            .or_default()
            .push(Endpoint::new(placed.address));
    }
    if groups.is_empty() {
        groups.insert((0, None), Vec::new());
    }
    let group_lens: Vec<usize> = groups
        .iter()
        .map(|(&(priority, zone), endpoints)| group_len(priority, zone, endpoints))
        .collect();
    let len = string_field_len(cluster_name)
        + group_lens
            .iter()
            .map(|&len| delimited_len(len))
            .sum::<usize>();
    let mut out = Vec::with_capacity(len);
    if !cluster_name.is_empty() {
        put_text(&mut out, KEY_1_BYTES, cluster_name);
    }
    for ((&(priority, zone), endpoints), &group) in groups.iter().zip(&group_lens) {
        put_delimited(&mut out, KEY_2_BYTES, group);
        if let Some(zone) = zone {
            // `Locality { zone (2) }`: present, even empty, whenever there is a zone.
            put_delimited(&mut out, KEY_1_BYTES, string_field_len(zone));
            if !zone.is_empty() {
                put_text(&mut out, KEY_2_BYTES, zone);
            }
        }
        for endpoint in endpoints {
            endpoint.put(&mut out);
        }
        if priority != 0 {
            out.push(KEY_5_VARINT);
            encode_varint(u64::from(priority), &mut out);
        }
    }
    debug_assert_eq!(out.len(), len);
    out
}

/// The length of one `LocalityLbEndpoints`.
fn group_len(priority: u32, zone: Option<&str>, endpoints: &[Endpoint]) -> usize {
    let locality = zone.map_or(0, |zone| delimited_len(string_field_len(zone)));
    let priority = if priority == 0 {
        0
    } else {
        1 + encoded_len_varint(u64::from(priority))
    };
    locality
        + endpoints
            .iter()
            .map(|e| delimited_len(e.lb_endpoint_len()))
            .sum::<usize>()
        + priority
}

/// An endpoint's address as text (at most 45 bytes: an IPv6 address) and its port.
struct Endpoint {
    ip: [u8; 45],
    ip_len: u8,
    port: u16,
}

impl Endpoint {
    fn new(address: SocketAddr) -> Self {
        let mut ip = [0u8; 45];
        let ip_len = match address.ip() {
            IpAddr::V4(v4) => write_ipv4(v4.octets(), &mut ip),
            IpAddr::V6(v6) => {
                let mut cursor = std::io::Cursor::new(&mut ip[..]);
                // Never more than 45 bytes.
                let _ = write!(cursor, "{v6}");
                cursor.position() as usize
            }
        };
        Endpoint {
            ip,
            ip_len: ip_len as u8,
            port: address.port(),
        }
    }

    fn ip(&self) -> &[u8] {
        &self.ip[..usize::from(self.ip_len)]
    }

    /// `SocketAddress { address (2), port_value (3) }`. The port is one of a oneof, so it is
    /// written even when 0.
    fn socket_address_len(&self) -> usize {
        delimited_len(self.ip().len()) + 1 + encoded_len_varint(u64::from(self.port))
    }

    /// `Address { socket_address (1) }`.
    fn address_len(&self) -> usize {
        delimited_len(self.socket_address_len())
    }

    /// `Endpoint { address (1) }`.
    fn endpoint_len(&self) -> usize {
        delimited_len(self.address_len())
    }

    /// `LbEndpoint { endpoint (1) }`.
    fn lb_endpoint_len(&self) -> usize {
        delimited_len(self.endpoint_len())
    }

    /// The `LbEndpoint` as an element of `lb_endpoints` (field 2).
    fn put(&self, out: &mut Vec<u8>) {
        let socket_address = self.socket_address_len();
        let address = delimited_len(socket_address);
        let endpoint = delimited_len(address);
        put_delimited(out, KEY_2_BYTES, delimited_len(endpoint));
        put_delimited(out, KEY_1_BYTES, endpoint);
        put_delimited(out, KEY_1_BYTES, address);
        put_delimited(out, KEY_1_BYTES, socket_address);
        put_delimited(out, KEY_2_BYTES, self.ip().len());
        out.extend_from_slice(self.ip());
        out.push(KEY_3_VARINT);
        encode_varint(u64::from(self.port), out);
    }
}

/// Writes `octets` as dotted decimal into `buf`; its length.
fn write_ipv4(octets: [u8; 4], buf: &mut [u8; 45]) -> usize {
    let mut at = 0;
    for (i, octet) in octets.into_iter().enumerate() {
        if i > 0 {
            buf[at] = b'.';
            at += 1;
        }
        if octet >= 100 {
            buf[at] = b'0' + octet / 100;
            at += 1;
        }
        if octet >= 10 {
            buf[at] = b'0' + octet / 10 % 10;
            at += 1;
        }
        buf[at] = b'0' + octet % 10;
        at += 1;
    }
    at
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use proptest::prelude::*;
    use prost::Message;

    use super::super::{Placed, ip_address, load_assignment};
    use super::*;

    const ZONES: [&str; 3] = ["", "zone-a", "zone-b"];

    fn address() -> impl Strategy<Value = SocketAddr> {
        // The edges often: a port of 0 is written all the same (a oneof), 65535 is the
        // longest varint.
        let port = || prop_oneof![1 => Just(0u16), 1 => Just(u16::MAX), 8 => any::<u16>()];
        prop_oneof![
            4 => (any::<[u8; 4]>(), port())
                .prop_map(|(ip, port)| SocketAddr::new(Ipv4Addr::from(ip).into(), port)),
            1 => (any::<[u16; 8]>(), port())
                .prop_map(|(ip, port)| SocketAddr::new(Ipv6Addr::from(ip).into(), port)),
        ]
    }

    proptest! {
        /// The bytes are prost's for the message the translator used to build: the same
        /// assignment, and the same version.
        #[test]
        fn writes_the_bytes_prost_writes_for_the_message(
            cluster in "[a-z0-9.|-]{0,40}",
            endpoints in proptest::collection::vec(
                (address(), proptest::option::of(0..ZONES.len()), 0u32..3),
                0..12,
            ),
        ) {
            let placed = || endpoints.iter().map(|&(address, zone, priority)| {
                (address, zone.map(|z| ZONES[z]), priority)
            });
            let ours = encode(
                &cluster,
                placed().map(|(address, zone, priority)| PlacedIp { address, zone, priority }),
            );
            let theirs = load_assignment(
                cluster.clone(),
                placed().map(|(address, zone, priority)| Placed {
                    address: ip_address(address),
                    zone,
                    priority,
                }),
            )
            .encode_to_vec();
            prop_assert_eq!(ours, theirs);
        }
    }

    /// The port is a oneof: prost writes it even when 0.
    #[test]
    fn a_port_of_zero_is_written() {
        let address = SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), 0);
        let ours = encode(
            "",
            [PlacedIp {
                address,
                zone: None,
                priority: 0,
            }],
        );
        let theirs = load_assignment(
            String::new(),
            [Placed {
                address: ip_address(address),
                zone: None,
                priority: 0,
            }],
        )
        .encode_to_vec();
        assert_eq!(ours, theirs);
    }

    #[test]
    fn every_octet_width_is_written_as_std_writes_it() {
        for octet in 0..=255u8 {
            let ip = Ipv4Addr::new(octet, 0, 10, octet);
            let mut buf = [0u8; 45];
            let len = write_ipv4(ip.octets(), &mut buf);
            assert_eq!(&buf[..len], ip.to_string().as_bytes());
        }
    }
}
