//! A proxy's SDS secrets as Envoy resources: its workload certificate and key (`default`) and
//! the trust bundle (`ROOTCA`), the names Istio's proxies ask for, so that the same cluster
//! and listener configuration serves every proxy and each gets its own content. They are added
//! to the proxy's view of the snapshot ([`XdsSnapshot::with_secrets`]) only for a stream
//! verified as a pod of this node, from that pod's service account; any other stream that asks
//! is answered with nothing.
//!
//! The key leaves the agent only here, inline in the `default` secret over the proxy's own
//! stream; `/debug/xds` shows versions, never content.

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{DataSource, data_source};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CertificateValidationContext, Secret, TlsCertificate, secret,
};

use super::snapshot::{ResourceMap, XdsResource};
use crate::trust::ProxySecrets;

/// The secret of a proxy's own certificate chain and key.
pub const WORKLOAD_SECRET: &str = "default";
/// The secret of the trust bundle its peers are checked against.
pub const BUNDLE_SECRET: &str = "ROOTCA";

fn inline(text: &str) -> Option<DataSource> {
    Some(DataSource {
        specifier: Some(data_source::Specifier::InlineString(text.to_string())),
        ..DataSource::default()
    })
}

/// The two secrets of `secrets`, as a proxy's view holds them.
pub(super) fn resources(secrets: &ProxySecrets) -> ResourceMap {
    let workload = Secret {
        name: WORKLOAD_SECRET.to_string(),
        r#type: Some(secret::Type::TlsCertificate(TlsCertificate {
            certificate_chain: inline(&secrets.leaf.chain_pem),
            private_key: inline(&secrets.leaf.key_pem),
            ..TlsCertificate::default()
        })),
    };
    let bundle = Secret {
        name: BUNDLE_SECRET.to_string(),
        r#type: Some(secret::Type::ValidationContext(
            CertificateValidationContext {
                trusted_ca: inline(&secrets.bundle_pem),
                ..CertificateValidationContext::default()
            },
        )),
    };
    [
        XdsResource::new(WORKLOAD_SECRET, workload),
        XdsResource::new(BUNDLE_SECRET, bundle),
    ]
    .into_iter()
    .map(|resource| (Arc::clone(&resource.name), resource))
    .collect()
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::mesh::Protocol;
    use crate::trust::{Leaf, SpiffeId};
    use crate::xds::snapshot::XdsSnapshot;
    use crate::xds::testing::{SDS, Tested, World, sotw};
    use crate::xds::{DeltaRequest, DeltaStream, SotwStream};

    fn secrets(serial: &str) -> ResourceMap {
        resources(&ProxySecrets {
            identity: SpiffeId::new("cluster.local", "shop", "cart").unwrap(),
            leaf: Arc::new(Leaf {
                chain_pem: format!("chain {serial}"),
                key_pem: format!("key {serial}"),
                not_after: 0,
                serial: serial.to_string(),
            }),
            bundle_pem: Arc::from("bundle"),
        })
    }

    fn snapshot() -> XdsSnapshot {
        World::new().set("/shop/cart", Protocol::Http, &["10.0.0.1:8080"])
    }

    fn names<'a>(resources: impl IntoIterator<Item = &'a Arc<XdsResource>>) -> Vec<&'a str> {
        resources.into_iter().map(|r| &*r.name).collect()
    }

    fn delta(subscribe: &[&str], nonce: &str) -> DeltaRequest {
        DeltaRequest {
            type_url: SDS.to_string(),
            resource_names_subscribe: subscribe.iter().collect(),
            response_nonce: nonce.to_string(),
            ..DeltaRequest::default()
        }
    }

    /// Delta: a proxy's secrets as it subscribes, a renewed leaf alone, and nothing to a
    /// stream whose view holds no secrets (one not verified as a pod's).
    #[test]
    fn delta_serves_the_secrets_of_the_view_and_a_renewal_alone() {
        let shared = snapshot();
        let view = shared.with_secrets(secrets("01"), None);
        let mut stream = Tested::<DeltaStream>::default();
        let (out, _) = stream.on_request(&delta(&[WORKLOAD_SECRET, BUNDLE_SECRET], ""), &view);
        assert_eq!(out.len(), 1);
        assert_eq!(names(&out[0].resources), [BUNDLE_SECRET, WORKLOAD_SECRET]);
        let (out, _) = stream.on_request(&delta(&[], &out[0].nonce), &view);
        assert!(out.is_empty());

        let renewed = shared.with_secrets(secrets("02"), None);
        let out = stream.on_snapshot(&renewed);
        assert_eq!(out.len(), 1);
        assert_eq!(
            names(&out[0].resources),
            [WORKLOAD_SECRET],
            "the bundle is unchanged"
        );
        let secret =
            envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret::decode(
                out[0].resources[0].body.value.as_slice(),
            )
            .unwrap();
        let Some(secret::Type::TlsCertificate(tls)) = secret.r#type else {
            panic!("a certificate: {secret:?}");
        };
        let chain = tls.certificate_chain.unwrap().specifier.unwrap();
        assert_eq!(
            chain,
            data_source::Specifier::InlineString("chain 02".into())
        );

        let mut stranger = Tested::<DeltaStream>::default();
        let (out, _) = stranger.on_request(&delta(&[WORKLOAD_SECRET], ""), &shared);
        assert!(
            out.iter().all(|r| r.resources.is_empty()),
            "no secret: {out:?}"
        );
    }

    /// State of the world: the secrets named, then the renewed one, and an empty answer to a
    /// stream without secrets.
    #[test]
    fn sotw_serves_the_secrets_of_the_view_and_a_renewal() {
        let shared = snapshot();
        let view = shared.with_secrets(secrets("01"), None);
        let mut stream = Tested::<SotwStream>::default();
        let both = [WORKLOAD_SECRET, BUNDLE_SECRET];
        let (out, _) = stream.on_request(&sotw(SDS, &both, "", ""), &view);
        assert_eq!(out.len(), 1);
        assert_eq!(names(&out[0].resources), [BUNDLE_SECRET, WORKLOAD_SECRET]);
        let ack = sotw(SDS, &both, &out[0].version_info, &out[0].nonce);
        let (out, _) = stream.on_request(&ack, &view);
        assert!(out.is_empty());

        let out = stream.on_snapshot(&shared.with_secrets(secrets("02"), None));
        assert_eq!(out.len(), 1);
        assert!(names(&out[0].resources).contains(&WORKLOAD_SECRET));

        let mut stranger = Tested::<SotwStream>::default();
        let (out, _) = stranger.on_request(&sotw(SDS, &[WORKLOAD_SECRET], "", ""), &shared);
        assert_eq!(out.len(), 1, "the first request of a type is answered");
        assert!(out[0].resources.is_empty(), "with nothing");
    }

    /// A proxy's view shares everything but its secrets with the snapshot every proxy is
    /// served, computed indexes included.
    #[test]
    fn a_view_with_secrets_shares_the_rest_of_the_snapshot() {
        let shared = snapshot();
        let index = shared.name_index(crate::xds::ResourceType::Cluster).clone();
        let view = shared.with_secrets(secrets("01"), None);
        assert!(Arc::ptr_eq(
            view.name_index(crate::xds::ResourceType::Cluster),
            &index
        ));
        for kind in crate::xds::ResourceType::ALL {
            if kind == crate::xds::ResourceType::Secret {
                assert_eq!(view.of(kind).len(), 2);
                assert!(shared.of(kind).is_empty());
            } else {
                assert!(view.of(kind).ptr_eq(shared.of(kind)));
            }
        }
    }
}
