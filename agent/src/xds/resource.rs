//! The resources the xDS server hands out, one at a time: the five types, each resource
//! encoded once with the content version it is known by, and how versions are written and read.
//! The snapshot ([`super::snapshot`]) holds them by type and name; the shared parts of the
//! capture listener ([`super::parts`]) are made of them.

use std::sync::Arc;

use envoy_types::pb::google::protobuf::Any;
use envoy_types::util::pack_any;
use prost::Message;

/// How many resource types there are.
pub const TYPES: usize = 5;

/// The resource types. [`ResourceType::ALL`] is the order Envoy must receive them in (SDS →
/// CDS → EDS → LDS → RDS), so a cluster or listener never points at a secret, cluster or
/// route that does not exist yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ResourceType {
    Cluster = 0,
    Endpoint = 1,
    Listener = 2,
    Route = 3,
    /// A proxy's certificate and key (`default`) and the trust bundle (`ROOTCA`): each proxy's
    /// own, never in the snapshot every proxy shares.
    Secret = 4,
}

impl ResourceType {
    pub const ALL: [ResourceType; TYPES] = [
        ResourceType::Secret,
        ResourceType::Cluster,
        ResourceType::Endpoint,
        ResourceType::Listener,
        ResourceType::Route,
    ];

    pub fn type_url(self) -> &'static str {
        match self {
            ResourceType::Cluster => "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            ResourceType::Endpoint => {
                "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
            }
            ResourceType::Listener => "type.googleapis.com/envoy.config.listener.v3.Listener",
            ResourceType::Route => "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
            ResourceType::Secret => {
                "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
            }
        }
    }

    pub fn from_type_url(url: &str) -> Option<ResourceType> {
        ResourceType::ALL.into_iter().find(|t| t.type_url() == url)
    }

    /// Short name for logs and metrics.
    pub fn short(self) -> &'static str {
        match self {
            ResourceType::Cluster => "cds",
            ResourceType::Endpoint => "eds",
            ResourceType::Listener => "lds",
            ResourceType::Route => "rds",
            ResourceType::Secret => "sds",
        }
    }

    /// Clusters and listeners are fetched as a whole (wildcard); endpoints, routes and secrets
    /// by name.
    pub fn is_wildcard_by_default(self) -> bool {
        matches!(self, ResourceType::Cluster | ResourceType::Listener)
    }

    /// In SotW, a response of these types must hold every resource the client should have
    /// (what it leaves out is removed); responses of the others may hold only what changed.
    pub fn is_state_of_the_world(self) -> bool {
        self.is_wildcard_by_default()
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// One encoded Envoy resource. Its version is a hash of its bytes, so equal content has equal
/// versions, across pushes and across agent restarts (which makes Delta reconnects cheap).
/// The name is shared (not copied) by every map and every stream that refers to it: at 10k
/// resources and a hundred proxies, per-stream copies of names would dominate the memory.
#[derive(Debug, PartialEq)]
pub struct XdsResource {
    pub name: Arc<str>,
    pub version: u64,
    pub body: Any,
}

impl XdsResource {
    pub fn new<M: Message + prost::Name>(
        name: impl Into<Arc<str>>,
        message: M,
    ) -> Arc<XdsResource> {
        let body = pack_any(message);
        let version = content_hash(&body.value);
        Arc::new(XdsResource {
            name: name.into(),
            version,
            body,
        })
    }

    /// A resource of type `M` written already: `value` is the message's encoding.
    pub fn encoded<M: prost::Name>(name: impl Into<Arc<str>>, value: Vec<u8>) -> Arc<XdsResource> {
        let version = content_hash(&value);
        Arc::new(XdsResource {
            name: name.into(),
            version,
            body: Any {
                type_url: M::type_url(),
                value,
            },
        })
    }

    /// A resource known only by its name and version: what a reconnecting Delta client says it
    /// holds of a version no snapshot here has. Never sent (it has no content); held so that
    /// what the client holds is known exactly.
    pub fn held_at(name: Arc<str>, version: u64) -> Arc<XdsResource> {
        Arc::new(XdsResource {
            name,
            version,
            body: Any::default(),
        })
    }

    /// The version as it goes on the wire.
    pub fn version_string(&self) -> String {
        format_version(self.version)
    }
}

/// Versions on the wire are 16 hex digits.
pub fn format_version(version: u64) -> String {
    format!("{version:016x}")
}

/// The inverse of [`format_version`]; `None` for a version this agent did not make (of
/// another length, with another digit, upper case or a sign). By hand, through a table and
/// without a branch per digit: a reconnecting whole-mesh proxy lists 100k versions at 50k
/// services, and both `u64::from_str_radix` and a `match` per digit spent most of their time
/// in mispredicted branches (whether a digit is a number or a letter is random), the `match`
/// about 70 ns a version and 0.34 s of the agent's CPU in a 50k restart (perf).
pub fn parse_version(version: &str) -> Option<u64> {
    let digits: &[u8; 16] = version.as_bytes().try_into().ok()?;
    let (mut value, mut seen) = (0u64, 0u8);
    for &digit in digits {
        let nibble = HEX_DIGIT[usize::from(digit)];
        seen |= nibble;
        value = value << 4 | u64::from(nibble & 0xf);
    }
    (seen & NOT_HEX == 0).then_some(value)
}

/// [`HEX_DIGIT`]'s mark of a byte that is not a lower-case hex digit.
const NOT_HEX: u8 = 0x10;

/// Each byte's value as a lower-case hex digit, or [`NOT_HEX`].
const HEX_DIGIT: [u8; 256] = {
    let mut table = [NOT_HEX; 256];
    let mut value = 0;
    while value < 16 {
        let digit = if value < 10 {
            b'0' + value
        } else {
            b'a' + value - 10
        };
        table[digit as usize] = value;
        value += 1;
    }
    table
};

/// A resource's version: XXH3 (64 bits) of its bytes, stable across builds and platforms
/// (a specified algorithm, unseeded), as a version must be for a restarted agent to recognise
/// what a proxy holds. At 50k services a first translation hashes about 55 MB; byte-at-a-time
/// FNV-1a took a tenth of it (perf), XXH3 takes a few milliseconds.
pub fn content_hash(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// FNV-1a: stable across builds and platforms, unlike std's hasher; for names, a few dozen
/// bytes.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// All resources of one type, by name. Persistent: a snapshot shares what did not change with
/// the one before it, and two snapshots are compared by what differs.
pub type ResourceMap = imbl::OrdMap<Arc<str>, Arc<XdsResource>>;

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// A version reads back as the number it was made from, and a string this agent does
        /// not make (another length, a digit out of range or beside one, upper case, a sign, a
        /// byte past ASCII) as none: the hand-written reading agrees with the library's, made
        /// strict.
        #[test]
        fn a_version_reads_back_and_nothing_else_does(value: u64, text in "[+0-9a-fA-Fg /:@`\u{80}-\u{ff}]{14,18}") {
            proptest::prop_assert_eq!(parse_version(&format_version(value)), Some(value));
            let strict = text.len() == 16
                && text.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
            let expected = strict.then(|| u64::from_str_radix(&text, 16).ok()).flatten();
            proptest::prop_assert_eq!(parse_version(&text), expected);
        }
    }
}
