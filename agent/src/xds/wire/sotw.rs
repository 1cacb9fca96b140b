//! The state-of-the-world request, `DiscoveryRequest`, with its resource names kept as their
//! wire bytes ([`NameList`]).

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::ResourceLocator;
use envoy_types::pb::google::rpc::Status;
use prost::DecodeError;
use prost::bytes::{Buf, BufMut};
use prost::encoding::{DecodeContext, WireType, message, skip_field, string};

use super::names::NameList;
use crate::xds::inbound::WithRoom;
use crate::xds::proto::{encode_string, string_len};

/// An ADS `DiscoveryRequest` (envoy.service.discovery.v3), with its resource names packed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SotwRequest {
    /// Field 1.
    pub version_info: String,
    /// Field 2.
    pub node: Option<Node>,
    /// Field 3, `resource_names`.
    pub resource_names: NameList,
    /// Field 4.
    pub type_url: String,
    /// Field 5.
    pub response_nonce: String,
    /// Field 6.
    pub error_detail: Option<Status>,
}

impl WithRoom for SotwRequest {
    fn with_room(len: usize) -> Self {
        SotwRequest {
            resource_names: NameList::with_room(len),
            ..SotwRequest::default()
        }
    }
}

impl prost::Message for SotwRequest {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        encode_string(1, &self.version_info, buf);
        if let Some(node) = &self.node {
            message::encode(2, node, buf);
        }
        // The names are kept as their entries on the wire.
        self.resource_names.encode(buf);
        encode_string(4, &self.type_url, buf);
        encode_string(5, &self.response_nonce, buf);
        if let Some(status) = &self.error_detail {
            message::encode(6, status, buf);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        match tag {
            1 => string::merge(wire_type, &mut self.version_info, buf, ctx),
            2 => message::merge(
                wire_type,
                self.node.get_or_insert_with(Node::default),
                buf,
                ctx,
            ),
            3 => self.resource_names.merge(wire_type, buf, ctx),
            4 => string::merge(wire_type, &mut self.type_url, buf, ctx),
            5 => string::merge(wire_type, &mut self.response_nonce, buf, ctx),
            6 => message::merge(
                wire_type,
                self.error_detail.get_or_insert_with(Status::default),
                buf,
                ctx,
            ),
            // `resource_locators`, unused: read as prost reads it (its errors are prost's),
            // and dropped.
            7 => message::merge(wire_type, &mut ResourceLocator::default(), buf, ctx),
            _ => skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        string_len(1, &self.version_info)
            + self.node.as_ref().map_or(0, |n| message::encoded_len(2, n))
            + self.resource_names.encoded_len()
            + string_len(4, &self.type_url)
            + string_len(5, &self.response_nonce)
            + self
                .error_detail
                .as_ref()
                .map_or(0, |s| message::encoded_len(6, s))
    }

    fn clear(&mut self) {
        self.version_info.clear();
        self.node = None;
        self.resource_names.clear();
        self.type_url.clear();
        self.response_nonce.clear();
        self.error_detail = None;
    }
}
