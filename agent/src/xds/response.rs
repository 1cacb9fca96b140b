//! How responses go on the wire. The generated `DiscoveryResponse` and `DeltaDiscoveryResponse`
//! own their resources: building one meant cloning every resource's `Any` (its type URL and its
//! bytes, two allocations) for every stream, and the 16 responses a stream may queue each held
//! their own copy. At 10k services and a hundred proxies that is a million clones in an initial
//! sync; a profile showed the clone as a tenth of the agent's CPU (docs/benchmarks.md, version
//! F). [`SotwResponse`] and [`DeltaResponse`] hold the snapshot's resources by `Arc` and encode
//! them straight from there, to the same bytes as the generated types (the tests compare them).
//!
//! Encode-only and hand-written for the same reason as [`super::wire`]: prost's generator has no
//! hook for a field's representation. The server never decodes a response; `merge_field` skips
//! what it is given.

use std::sync::Arc;

use prost::DecodeError;
use prost::bytes::{Buf, BufMut};
use prost::encoding::{
    DecodeContext, WireType, encode_key, encode_varint, encoded_len_varint, key_len, message,
    skip_field, string,
};

use super::snapshot::XdsResource;
use super::wire::{encode_string, string_len};

/// An ADS `DiscoveryResponse` (envoy.service.discovery.v3) whose resources are shared.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SotwResponse {
    /// Field 1.
    pub version_info: String,
    /// Field 2: each resource's `Any`.
    pub resources: Vec<Arc<XdsResource>>,
    /// Field 4.
    pub type_url: String,
    /// Field 5.
    pub nonce: String,
}

/// An ADS `DeltaDiscoveryResponse` whose resources are shared.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeltaResponse {
    /// Field 1.
    pub system_version_info: String,
    /// Field 2: each a `Resource` with its name, version and `Any`.
    pub resources: Vec<Arc<XdsResource>>,
    /// Field 4.
    pub type_url: String,
    /// Field 5.
    pub nonce: String,
    /// Field 6.
    pub removed_resources: Vec<String>,
}

/// Neither response is ever decoded by the agent: every field is skipped.
fn skip(
    wire_type: WireType,
    tag: u32,
    buf: &mut impl Buf,
    ctx: DecodeContext,
) -> Result<(), DecodeError> {
    skip_field(wire_type, tag, buf, ctx)
}

impl prost::Message for SotwResponse {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        encode_string(1, &self.version_info, buf);
        for resource in &self.resources {
            message::encode(2, &resource.body, buf);
        }
        encode_string(4, &self.type_url, buf);
        encode_string(5, &self.nonce, buf);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        skip(wire_type, tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        string_len(1, &self.version_info)
            + self
                .resources
                .iter()
                .map(|r| message::encoded_len(2, &r.body))
                .sum::<usize>()
            + string_len(4, &self.type_url)
            + string_len(5, &self.nonce)
    }

    fn clear(&mut self) {
        *self = SotwResponse::default();
    }
}

/// A resource's version on the wire (16 hex digits), without a `String`.
fn version_digits(version: u64) -> [u8; 16] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    std::array::from_fn(|i| HEX[((version >> (60 - 4 * i)) & 0xf) as usize])
}

/// The length of a Delta `Resource` message: version (1), resource (2) and name (3). Fields go
/// out in the order of their numbers, as prost writes them.
fn delta_resource_len(resource: &XdsResource) -> usize {
    string_len(3, &resource.name) + key_len(1) + 1 + 16 + message::encoded_len(2, &resource.body)
}

impl prost::Message for DeltaResponse {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        encode_string(1, &self.system_version_info, buf);
        for resource in &self.resources {
            encode_key(2, WireType::LengthDelimited, buf);
            encode_varint(delta_resource_len(resource) as u64, buf);
            encode_key(1, WireType::LengthDelimited, buf);
            encode_varint(16, buf);
            buf.put_slice(&version_digits(resource.version));
            message::encode(2, &resource.body, buf);
            encode_string(3, &resource.name, buf);
        }
        encode_string(4, &self.type_url, buf);
        encode_string(5, &self.nonce, buf);
        string::encode_repeated(6, &self.removed_resources, buf);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        skip(wire_type, tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        string_len(1, &self.system_version_info)
            + self
                .resources
                .iter()
                .map(|r| {
                    let len = delta_resource_len(r);
                    key_len(2) + encoded_len_varint(len as u64) + len
                })
                .sum::<usize>()
            + string_len(4, &self.type_url)
            + string_len(5, &self.nonce)
            + string::encoded_len_repeated(6, &self.removed_resources)
    }

    fn clear(&mut self) {
        *self = DeltaResponse::default();
    }
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::config::cluster::v3::Cluster;
    use envoy_types::pb::envoy::service::discovery::v3::{
        DeltaDiscoveryResponse, DiscoveryResponse, Resource,
    };
    use prost::Message;

    use super::*;
    use crate::xds::snapshot::format_version;

    fn resources() -> Vec<Arc<XdsResource>> {
        ["a", "bb", &"long-name.".repeat(30), ""]
            .into_iter()
            .map(|name| {
                XdsResource::new(
                    name,
                    Cluster {
                        name: name.to_string(),
                        ..Cluster::default()
                    },
                )
            })
            .collect()
    }

    #[test]
    fn sotw_encodes_as_the_generated_type_does() {
        for (version, nonce, resources) in
            [("0123456789abcdef", "7", resources()), ("", "", Vec::new())]
        {
            let ours = SotwResponse {
                version_info: version.to_string(),
                resources: resources.clone(),
                type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".to_string(),
                nonce: nonce.to_string(),
            };
            let generated = DiscoveryResponse {
                version_info: version.to_string(),
                resources: resources.iter().map(|r| r.body.clone()).collect(),
                type_url: ours.type_url.clone(),
                nonce: nonce.to_string(),
                ..DiscoveryResponse::default()
            };
            assert!(ours.encode_to_vec() == generated.encode_to_vec());
            assert_eq!(ours.encoded_len(), generated.encoded_len());
        }
    }

    #[test]
    fn delta_encodes_as_the_generated_type_does() {
        let mut resources = resources();
        resources.push(Arc::new(XdsResource {
            name: "max".into(),
            version: u64::MAX,
            body: resources[0].body.clone(),
        }));
        resources.push(Arc::new(XdsResource {
            name: "zero".into(),
            version: 0,
            body: resources[0].body.clone(),
        }));
        let ours = DeltaResponse {
            system_version_info: "42".to_string(),
            resources: resources.clone(),
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".to_string(),
            removed_resources: vec!["gone".to_string(), String::new(), "x".repeat(200)],
            nonce: "9".to_string(),
        };
        let generated = DeltaDiscoveryResponse {
            system_version_info: "42".to_string(),
            resources: resources
                .iter()
                .map(|r| Resource {
                    name: r.name.to_string(),
                    version: format_version(r.version),
                    resource: Some(r.body.clone()),
                    ..Resource::default()
                })
                .collect(),
            type_url: ours.type_url.clone(),
            removed_resources: ours.removed_resources.clone(),
            nonce: "9".to_string(),
            ..DeltaDiscoveryResponse::default()
        };
        assert!(ours.encode_to_vec() == generated.encode_to_vec());
        assert_eq!(ours.encoded_len(), generated.encoded_len());
        assert_eq!(
            DeltaResponse::default().encode_to_vec(),
            DeltaDiscoveryResponse::default().encode_to_vec()
        );
    }

    #[test]
    fn version_digits_are_the_wire_version() {
        for version in [0, 1, 0xabc, 0x0123_4567_89ab_cdef, u64::MAX] {
            assert_eq!(
                std::str::from_utf8(&version_digits(version)).unwrap(),
                format_version(version)
            );
        }
    }
}
