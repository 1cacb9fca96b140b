//! How ADS requests are read off the wire: hand-written decoders for the two request types,
//! because prost's generator has no per-field representation hook and the generated types
//! cost a `String` per resource name ([`names`]) and a `HashMap` of `String`s for a Delta
//! client's held versions ([`delta`]). The messages are small and stable (xDS v3). Fields the
//! agent does not use (`resource_locators`) are read as prost reads them and dropped; unknown
//! fields are skipped, as prost skips them. [`check_request`] holds both decoders to prost's
//! own on any bytes (the unit tests and the fuzz targets in `agent/fuzz` run it).

mod delta;
mod names;
mod sotw;

pub use delta::{DeltaRequest, VersionList};
pub use names::NameList;
pub use sotw::SotwRequest;

#[cfg(any(test, fuzzing))]
pub use check::{check_delta_request, check_request, check_sotw_request};

#[cfg(any(test, fuzzing))]
mod check {
    use std::collections::HashMap;

    use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
    use prost::Message;
    use prost::bytes::{Buf, Bytes};

    use super::{DeltaRequest, SotwRequest};

    /// Decodes `data` after its first byte as both request types with this module's decoders
    /// and with prost's generated types, whole and split in two chunks where the first byte
    /// says: no panic, the same success or failure, the same fields, and what ours encode
    /// again decodes to the same. Panics on any difference (a fuzz target's finding).
    pub fn check_request(data: &[u8]) {
        check_sotw_request(data);
        check_delta_request(data);
    }

    /// The first byte, and the rest of `data` as a buffer of two chunks split where it says.
    fn split(data: &[u8]) -> Option<(&[u8], impl Fn() -> prost::bytes::buf::Chain<Bytes, Bytes>)> {
        let (&split, data) = data.split_first()?;
        let (a, b) = data.split_at(usize::from(split).min(data.len()));
        let chunked = move || Bytes::copy_from_slice(a).chain(Bytes::copy_from_slice(b));
        Some((data, chunked))
    }

    /// [`check_request`] for the state-of-the-world request alone.
    pub fn check_sotw_request(data: &[u8]) {
        let Some((data, chunked)) = split(data) else {
            return;
        };
        let theirs = DiscoveryRequest::decode(data);
        for ours in [SotwRequest::decode(data), SotwRequest::decode(chunked())] {
            match (&ours, &theirs) {
                (Ok(ours), Ok(theirs)) => same_sotw(ours, theirs),
                (Err(_), Err(_)) => {}
                _ => panic!("sotw: ours {ours:?}, prost's {theirs:?}"),
            }
        }
        if let Ok(ours) = SotwRequest::decode(data) {
            let again = SotwRequest::decode(ours.encode_to_vec().as_slice());
            assert_eq!(again.as_ref().ok(), Some(&ours), "sotw re-encoded");
            assert_eq!(ours.encoded_len(), ours.encode_to_vec().len());
        }
    }

    /// [`check_request`] for the Delta request alone.
    pub fn check_delta_request(data: &[u8]) {
        let Some((data, chunked)) = split(data) else {
            return;
        };
        let theirs = DeltaDiscoveryRequest::decode(data);
        for ours in [DeltaRequest::decode(data), DeltaRequest::decode(chunked())] {
            match (&ours, &theirs) {
                (Ok(ours), Ok(theirs)) => same_delta(ours, theirs),
                (Err(_), Err(_)) => {}
                _ => panic!("delta: ours {ours:?}, prost's {theirs:?}"),
            }
        }
        if let Ok(ours) = DeltaRequest::decode(data) {
            let again = DeltaRequest::decode(ours.encode_to_vec().as_slice());
            assert_eq!(again.as_ref().ok(), Some(&ours), "delta re-encoded");
            assert_eq!(ours.encoded_len(), ours.encode_to_vec().len());
        }
    }

    fn same_sotw(ours: &SotwRequest, theirs: &DiscoveryRequest) {
        assert_eq!(ours.version_info, theirs.version_info);
        assert_eq!(ours.node, theirs.node);
        assert!(
            ours.resource_names
                .iter()
                .eq(theirs.resource_names.iter().map(String::as_str)),
            "names: ours {:?}, prost's {:?}",
            ours.resource_names.iter().collect::<Vec<_>>(),
            theirs.resource_names
        );
        assert_eq!(ours.resource_names.len(), theirs.resource_names.len());
        assert_eq!(ours.type_url, theirs.type_url);
        assert_eq!(ours.response_nonce, theirs.response_nonce);
        assert_eq!(ours.error_detail, theirs.error_detail);
    }

    fn same_delta(ours: &DeltaRequest, theirs: &DeltaDiscoveryRequest) {
        assert_eq!(ours.node, theirs.node);
        assert_eq!(ours.type_url, theirs.type_url);
        assert_eq!(
            ours.resource_names_subscribe.iter().collect::<Vec<_>>(),
            theirs.resource_names_subscribe
        );
        assert_eq!(
            ours.resource_names_unsubscribe,
            theirs.resource_names_unsubscribe
        );
        assert_eq!(ours.response_nonce, theirs.response_nonce);
        assert_eq!(ours.error_detail, theirs.error_detail);
        // Read in order, the last version of a name wins, as in the map.
        let versions: HashMap<&str, &str> = ours.initial_resource_versions.iter().collect();
        let expected: HashMap<&str, &str> = theirs
            .initial_resource_versions
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        assert_eq!(versions, expected);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use envoy_types::pb::envoy::config::core::v3::Node;
    use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, ResourceLocator};
    use envoy_types::pb::google::rpc::Status;
    use prost::Message;
    use prost::bytes::{Buf, Bytes};

    use super::*;

    /// `bytes` as tonic may hand them to a decoder: in two chunks, split at every place.
    fn every_split(bytes: &[u8]) -> impl Iterator<Item = impl Buf> + '_ {
        (0..bytes.len()).map(|split| {
            let (a, b) = bytes.split_at(split);
            Bytes::copy_from_slice(a).chain(Bytes::copy_from_slice(b))
        })
    }

    fn full_request(names: &[&str]) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: "v7".into(),
            node: Some(Node {
                id: "client-1.default".into(),
                cluster: "client".into(),
                ..Node::default()
            }),
            resource_names: names.iter().map(|n| n.to_string()).collect(),
            resource_locators: vec![ResourceLocator {
                name: "ignored".into(),
                ..ResourceLocator::default()
            }],
            type_url: "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment".into(),
            response_nonce: "12".into(),
            error_detail: Some(Status {
                code: 3,
                message: "bad".into(),
                details: Vec::new(),
            }),
        }
    }

    #[test]
    fn decodes_what_the_generated_type_encodes() {
        let names = ["outbound|80||a", "outbound|80||b", "ünïcode|1", ""];
        let generated = full_request(&names);
        let ours = SotwRequest::decode(generated.encode_to_vec().as_slice()).unwrap();
        assert_eq!(ours.version_info, generated.version_info);
        assert_eq!(ours.node, generated.node);
        assert_eq!(ours.resource_names.iter().collect::<Vec<_>>(), names);
        assert_eq!(ours.type_url, generated.type_url);
        assert_eq!(ours.response_nonce, generated.response_nonce);
        assert_eq!(ours.error_detail, generated.error_detail);

        // And back: what we encode is the generated message without the skipped locators.
        let again = DiscoveryRequest::decode(ours.encode_to_vec().as_slice()).unwrap();
        assert_eq!(ours.encoded_len(), ours.encode_to_vec().len());
        let mut expected = generated;
        expected.resource_locators.clear();
        assert_eq!(again, expected);
    }

    #[test]
    fn a_delta_request_decodes_as_the_generated_type_does() {
        use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
        let generated = DeltaDiscoveryRequest {
            node: full_request(&[]).node,
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            resource_names_subscribe: vec!["a|1".into(), "ü|2".into()],
            resource_names_unsubscribe: vec!["gone|3".into()],
            initial_resource_versions: [("a|1", "7"), ("b|2", ""), ("", "9")]
                .into_iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            response_nonce: "4".into(),
            error_detail: full_request(&[]).error_detail,
            resource_locators_subscribe: vec![ResourceLocator {
                name: "ignored".into(),
                ..ResourceLocator::default()
            }],
            ..DeltaDiscoveryRequest::default()
        };
        let bytes = generated.encode_to_vec();
        let ours = DeltaRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(ours.node, generated.node);
        assert_eq!(ours.type_url, generated.type_url);
        assert_eq!(
            ours.resource_names_subscribe.iter().collect::<Vec<_>>(),
            generated.resource_names_subscribe
        );
        assert_eq!(
            ours.resource_names_unsubscribe,
            generated.resource_names_unsubscribe
        );
        assert_eq!(ours.response_nonce, generated.response_nonce);
        assert_eq!(ours.error_detail, generated.error_detail);
        let mut versions: Vec<(&str, &str)> = ours.initial_resource_versions.iter().collect();
        versions.sort();
        assert_eq!(versions, [("", "9"), ("a|1", "7"), ("b|2", "")]);

        // And back, across every split of the buffer.
        let again = DeltaDiscoveryRequest::decode(ours.encode_to_vec().as_slice()).unwrap();
        assert_eq!(ours.encoded_len(), ours.encode_to_vec().len());
        let mut expected = generated;
        expected.resource_locators_subscribe.clear();
        assert_eq!(again, expected);
        for chained in every_split(&bytes) {
            assert_eq!(DeltaRequest::decode(chained).unwrap(), ours);
        }
        // A name given twice: read in order, the last version wins, as in the map.
        let twice: VersionList = [("x", "1"), ("x", "2")].into_iter().collect();
        let last: HashMap<&str, &str> = twice.iter().collect();
        assert_eq!(last["x"], "2");
        // Truncated.
        assert!(DeltaRequest::decode(&bytes[..bytes.len() - 3]).is_err());
    }

    /// Held versions in the form Envoy writes them are read a run at a time; an entry in any
    /// other form (its version left out, its fields reversed or repeated, another field, a
    /// name or an entry of 128 bytes or more) is read as the generated type reads it, whatever the split,
    /// and a bad one amid a run is rejected as it is alone.
    #[test]
    fn held_versions_read_alike_whatever_their_form_and_split() {
        use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
        fn field(tag: u8, bytes: &[u8]) -> Vec<u8> {
            let mut out = vec![(tag << 3) | 2];
            prost::encoding::encode_varint(bytes.len() as u64, &mut out);
            out.extend_from_slice(bytes);
            out
        }
        let entry = |parts: &[(u8, &str)]| {
            let inner: Vec<u8> = parts
                .iter()
                .flat_map(|(tag, text)| field(*tag, text.as_bytes()))
                .collect();
            field(5, &inner)
        };
        let (long, entry_long) = ("l".repeat(130), "e".repeat(110));
        let mut bytes = field(2, b"type.googleapis.com/envoy.config.cluster.v3.Cluster");
        for part in [
            entry(&[(1, "a"), (2, "1")]),
            entry(&[(1, "b"), (2, "2")]),
            entry(&[(1, "no-version")]),
            entry(&[(2, "3"), (1, "reversed")]),
            entry(&[(1, "c"), (2, "4")]),
            entry(&[(1, "twice"), (2, "5"), (2, "6")]),
            entry(&[(1, "other"), (3, "x"), (2, "7")]),
            entry(&[(1, &long), (2, "8")]),
            entry(&[(1, &entry_long), (2, "0123456789abcdef")]),
            entry(&[(1, "ü"), (2, "9")]),
            entry(&[(1, "a"), (2, "10")]),
            field(6, b"nonce"),
            entry(&[(1, "after"), (2, "11")]),
        ] {
            bytes.extend(part);
        }
        let generated = DeltaDiscoveryRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(generated.initial_resource_versions.len(), 11);
        assert_eq!(generated.initial_resource_versions["a"], "10");
        assert_eq!(generated.initial_resource_versions["twice"], "6");
        let expected: HashMap<&str, &str> = generated
            .initial_resource_versions
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        let whole = DeltaRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(
            whole.initial_resource_versions.len(),
            12,
            "a is listed twice"
        );
        for chained in every_split(&bytes) {
            let ours = DeltaRequest::decode(chained).unwrap();
            let versions: HashMap<&str, &str> = ours.initial_resource_versions.iter().collect();
            assert_eq!(versions, expected);
            assert_eq!(ours.response_nonce, "nonce");
            assert_eq!(ours, whole);
        }
        // The version of "c" (amid a run) made invalid UTF-8.
        let at = bytes.windows(3).position(|w| w == b"c\x12\x01").unwrap() + 3;
        bytes[at] = 0xff;
        assert!(DeltaDiscoveryRequest::decode(bytes.as_slice()).is_err());
        for chained in every_split(&bytes) {
            assert!(DeltaRequest::decode(chained).is_err());
        }
    }

    #[test]
    fn decodes_across_buffer_chunks() {
        // tonic hands the decoder a buffer of several chunks: a name may straddle two.
        let names: Vec<String> = (0..50).map(|i| format!("cluster-{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let bytes = full_request(&refs).encode_to_vec();
        for chained in every_split(&bytes) {
            let ours = SotwRequest::decode(chained).unwrap();
            assert_eq!(ours.resource_names.iter().collect::<Vec<_>>(), refs);
        }
    }

    /// Runs of names read at once end where a name is 128 bytes or longer, or where the chunk
    /// ends; whatever the split, the names are the generated type's, and a bad name in the
    /// middle of a run is rejected as it is alone.
    #[test]
    fn runs_of_names_read_alike_whatever_their_length_and_split() {
        let long = |n: usize| "x".repeat(n);
        let (l127, l128, l300) = (long(127), long(128), long(300));
        let names = ["a|1", "", &l127, "b|ü2", &l128, "c|3", &l300, "d|4", "e|5"];
        let bytes = full_request(&names).encode_to_vec();
        for chained in every_split(&bytes) {
            let ours = SotwRequest::decode(chained).unwrap();
            assert_eq!(ours.resource_names.iter().collect::<Vec<_>>(), names);
        }
        let mut bad = DiscoveryRequest {
            resource_names: vec!["abc".into(), "def".into(), "ghi".into()],
            ..DiscoveryRequest::default()
        }
        .encode_to_vec();
        let middle = bad.iter().position(|b| *b == b'e').unwrap();
        bad[middle] = 0xff;
        assert!(DiscoveryRequest::decode(bad.as_slice()).is_err());
        assert!(SotwRequest::decode(bad.as_slice()).is_err());
    }

    #[test]
    fn rejects_what_the_generated_type_rejects() {
        let mut bytes = DiscoveryRequest {
            resource_names: vec!["abc".into()],
            ..DiscoveryRequest::default()
        }
        .encode_to_vec();
        // The name's last byte becomes an invalid UTF-8 continuation.
        let last = bytes.len() - 1;
        bytes[last] = 0xff;
        assert!(DiscoveryRequest::decode(bytes.as_slice()).is_err());
        assert!(SotwRequest::decode(bytes.as_slice()).is_err());
        // Truncated.
        let good = full_request(&["a"]).encode_to_vec();
        assert!(SotwRequest::decode(&good[..good.len() - 3]).is_err());
    }

    #[test]
    fn a_run_of_names_is_kept_where_it_lies_in_the_buffer() {
        let names: Vec<String> = (0..100).map(|i| format!("cluster-{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let bytes = Bytes::from(full_request(&refs).encode_to_vec());
        let ours = SotwRequest::decode(bytes.clone()).unwrap();
        let run = ours
            .resource_names
            .borrowed()
            .expect("the names were copied out of the buffer");
        assert!(bytes.as_ptr_range().contains(&run.as_ptr()));
        assert_eq!(ours.resource_names.iter().collect::<Vec<_>>(), refs);
    }

    #[test]
    fn the_same_names_have_the_same_fingerprint_whatever_the_split() {
        let long = "l".repeat(200);
        let names = ["x", &long, "y", "zzzzzzzzzzz"];
        let pushed: NameList = names.into_iter().collect();
        let bytes = full_request(&names).encode_to_vec();
        for chained in every_split(&bytes) {
            let decoded = SotwRequest::decode(chained).unwrap();
            assert_eq!(decoded.resource_names.fingerprint(), pushed.fingerprint());
            assert_eq!(decoded.resource_names, pushed);
            assert_eq!(decoded.resource_names.len(), names.len());
        }
    }

    mod random {
        use envoy_types::pb::envoy::config::core::v3::Node;
        use envoy_types::pb::envoy::service::discovery::v3::{
            DeltaDiscoveryRequest, DiscoveryRequest,
        };
        use envoy_types::pb::google::rpc::Status;
        use proptest::prelude::*;
        use prost::Message;

        use super::super::check_request;

        /// Names as Envoy sends them and worse: empty, ASCII, multi-byte, and long enough for
        /// two-byte lengths.
        fn name() -> impl Strategy<Value = String> {
            prop_oneof![
                "[a-z.|0-9]{0,12}",
                "\\PC{0,6}",
                (120usize..140).prop_map(|n| "n".repeat(n)),
            ]
        }

        fn sotw() -> impl Strategy<Value = Vec<u8>> {
            (
                name(),
                proptest::collection::vec(name(), 0..40),
                name(),
                proptest::option::of(name()),
                any::<bool>(),
            )
                .prop_map(|(version, names, nonce, error, node)| {
                    DiscoveryRequest {
                        version_info: version,
                        node: node.then(|| Node {
                            id: "a.b".into(),
                            ..Node::default()
                        }),
                        resource_names: names,
                        type_url: "type.googleapis.com/x".into(),
                        response_nonce: nonce,
                        error_detail: error.map(|message| Status {
                            code: 3,
                            message,
                            details: Vec::new(),
                        }),
                        ..DiscoveryRequest::default()
                    }
                    .encode_to_vec()
                })
        }

        fn delta() -> impl Strategy<Value = Vec<u8>> {
            (
                proptest::collection::vec(name(), 0..20),
                proptest::collection::vec(name(), 0..5),
                proptest::collection::hash_map(name(), name(), 0..20),
                name(),
            )
                .prop_map(|(subscribe, unsubscribe, versions, nonce)| {
                    DeltaDiscoveryRequest {
                        type_url: "type.googleapis.com/x".into(),
                        resource_names_subscribe: subscribe,
                        resource_names_unsubscribe: unsubscribe,
                        initial_resource_versions: versions,
                        response_nonce: nonce,
                        ..DeltaDiscoveryRequest::default()
                    }
                    .encode_to_vec()
                })
        }

        /// A valid message with a few bytes changed, cut short or not, with a split point in
        /// front (what `check_request` reads from the first byte).
        fn mangled(valid: impl Strategy<Value = Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
            (
                valid,
                proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
                any::<prop::sample::Index>(),
                any::<bool>(),
                any::<u8>(),
            )
                .prop_map(|(mut bytes, edits, cut, truncate, split)| {
                    if !bytes.is_empty() {
                        for (at, byte) in edits {
                            let at = at.index(bytes.len());
                            bytes[at] = byte;
                        }
                        if truncate {
                            bytes.truncate(cut.index(bytes.len()));
                        }
                    }
                    let mut data = vec![split];
                    data.extend(bytes);
                    data
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// Any bytes: the decoders never panic and agree with prost's.
            #[test]
            fn any_bytes_decode_as_prost_decodes_them(
                data in prop_oneof![
                    proptest::collection::vec(any::<u8>(), 0..200),
                    mangled(sotw()),
                    mangled(delta()),
                ]
            ) {
                check_request(&data);
            }
        }
    }
}
