//! Mesh mTLS as both ends speak it: the proxy's own leaf (SDS `default`), the peer checked
//! against the trust bundle (SDS `ROOTCA`) and by its SPIFFE ID, and the mesh ALPN
//! ([`MESH_ALPN`]), by which the inbound listener tells mesh mTLS from an app's own TLS.
//! Both secrets come over the proxy's own ADS stream, so a proxy that is served none (identity
//! checking off) must get neither end.

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{TransportSocket, transport_socket};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CertificateValidationContext, CommonTlsContext, DownstreamTlsContext, SdsSecretConfig,
    SubjectAltNameMatcher, TlsParameters, UpstreamTlsContext, common_tls_context,
    subject_alt_name_matcher, tls_parameters,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{StringMatcher, string_matcher};
use envoy_types::pb::google::protobuf::BoolValue;
use lattice_contract::MESH_ALPN;

use super::{ads, typed};
use crate::xds::secrets::{BUNDLE_SECRET, WORKLOAD_SECRET};

fn uri(pattern: string_matcher::MatchPattern) -> SubjectAltNameMatcher {
    SubjectAltNameMatcher {
        san_type: subject_alt_name_matcher::SanType::Uri as i32,
        matcher: Some(StringMatcher {
            match_pattern: Some(pattern),
            ..StringMatcher::default()
        }),
        ..SubjectAltNameMatcher::default()
    }
}

/// The proxy's leaf, the bundle, and the peer's URI SAN matched by `peers`.
fn common(peers: Vec<SubjectAltNameMatcher>) -> CommonTlsContext {
    let over_ads = |name: &str| SdsSecretConfig {
        name: name.to_string(),
        sds_config: Some(ads()),
    };
    CommonTlsContext {
        tls_certificate_sds_secret_configs: vec![over_ads(WORKLOAD_SECRET)],
        validation_context_type: Some(
            common_tls_context::ValidationContextType::CombinedValidationContext(
                common_tls_context::CombinedCertificateValidationContext {
                    default_validation_context: Some(CertificateValidationContext {
                        match_typed_subject_alt_names: peers,
                        ..CertificateValidationContext::default()
                    }),
                    validation_context_sds_secret_config: Some(over_ads(BUNDLE_SECRET)),
                    ..Default::default()
                },
            ),
        ),
        alpn_protocols: vec![MESH_ALPN.to_string()],
        // Both ends are Envoys of this mesh: no older peer to wait for.
        tls_params: Some(TlsParameters {
            tls_minimum_protocol_version: tls_parameters::TlsProtocol::TlSv13 as i32,
            tls_maximum_protocol_version: tls_parameters::TlsProtocol::TlSv13 as i32,
            ..TlsParameters::default()
        }),
        ..CommonTlsContext::default()
    }
}

/// The server end (the inbound listener): a client certificate required, of any SPIFFE ID of
/// `trust_domain`; authorization decides which ones go further.
pub(super) fn downstream(trust_domain: &str) -> DownstreamTlsContext {
    let in_trust_domain = uri(string_matcher::MatchPattern::Prefix(format!(
        "spiffe://{trust_domain}/"
    )));
    DownstreamTlsContext {
        common_tls_context: Some(common(vec![in_trust_domain])),
        require_client_certificate: Some(BoolValue { value: true }),
        ..DownstreamTlsContext::default()
    }
}

/// The client end (a cluster of a service whose endpoints present `identities`): the server
/// must present one of them exactly.
pub(super) fn upstream(identities: &[Arc<str>]) -> TransportSocket {
    let peers = identities
        .iter()
        .map(|id| uri(string_matcher::MatchPattern::Exact(id.to_string())))
        .collect();
    let context = UpstreamTlsContext {
        common_tls_context: Some(common(peers)),
        ..UpstreamTlsContext::default()
    };
    TransportSocket {
        name: "envoy.transport_sockets.tls".to_string(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(typed(context))),
    }
}
