//! This node's zone, from its Node object's `topology.kubernetes.io/zone` label, read with one
//! `get` on nodes at start.
//!
//! Read once, not watched: a node's zone is set when it joins and practically never changes
//! (moving a node to another zone means re-creating it, and its pods with it), and a watch on
//! Nodes would cost every agent a stream for a label that does not move. Restarting the agent
//! reads it again.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::mesh::locality::{NodeLocality, ZoneSource, place_name};

/// The well-known label that holds a node's zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// Failed attempts after which the agent serves without a zone (and keeps trying): an API
/// server that does not answer must not keep the node's Envoys waiting.
const ATTEMPTS_BEFORE_SERVING: u32 = 3;

/// This node's locality as its Node object says.
pub fn locality_of(name: &str, node: &Node) -> NodeLocality {
    let name_arc: Arc<str> = Arc::from(name);
    let label = node
        .metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get(ZONE_LABEL));
    match label.map(|zone| place_name(zone)) {
        Some(Ok(zone)) => NodeLocality::with_zone(Some(name_arc), zone, ZoneSource::NodeLabel),
        Some(Err(error)) => NodeLocality::without_zone(
            Some(name_arc),
            format!("node {name}: label {ZONE_LABEL}: {error}"),
        ),
        None => NodeLocality::without_zone(
            Some(name_arc),
            format!("node {name} has no {ZONE_LABEL} label (set --node-zone to give it)"),
        ),
    }
}

/// Whether a failed `get` will fail the same way again: the API server answered, and said no
/// (forbidden: the RBAC lacks `get` on nodes; not found: `--node-name` is wrong).
fn is_final(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if (400..500).contains(&status.code) && status.code != 429)
}

/// Reads node `name` and publishes its locality on `tx`, retrying with backoff while the API
/// server cannot be reached. After a few failed attempts, or an answer that will not change
/// (forbidden, not found), it publishes the node without a zone, so the agent serves without
/// zone preference rather than not at all; a later success still publishes the zone.
pub async fn read_zone(
    client: kube::Client,
    name: String,
    tx: watch::Sender<Option<NodeLocality>>,
    shutdown: CancellationToken,
) {
    let nodes: Api<Node> = Api::all(client);
    let mut delay = Duration::from_millis(500);
    for attempt in 1.. {
        let result = tokio::select! {
            () = shutdown.cancelled() => return,
            result = nodes.get(&name) => result,
        };
        let error = match result {
            Ok(node) => {
                let locality = locality_of(&name, &node);
                match (&locality.zone, &locality.note) {
                    (Some(zone), _) => {
                        info!(node = %name, %zone, "this node's zone, from its {ZONE_LABEL} label")
                    }
                    (None, note) => warn!(node = %name, "{}", note.as_deref().unwrap_or_default()),
                }
                tx.send_replace(Some(locality));
                return;
            }
            Err(error) => error,
        };
        let why = format!("cannot read node {name} for its zone: {error}");
        if is_final(&error) {
            let hint = "the agent needs get on nodes (see docs/kubernetes.md), or give --node-zone";
            let locality = NodeLocality::without_zone(Some(Arc::from(name.as_str())), &why);
            warn!("{why}; {hint}; serving without a zone preference");
            tx.send_replace(Some(locality));
            return;
        }
        warn!("{why}; retrying in {delay:?}");
        if attempt == ATTEMPTS_BEFORE_SERVING && tx.borrow().is_none() {
            warn!(
                node = %name,
                "serving without a zone preference until the node's zone can be read"
            );
            let locality = NodeLocality::without_zone(Some(Arc::from(name.as_str())), &why);
            tx.send_replace(Some(locality));
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_secs(30));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(labels: &[(&str, &str)]) -> Node {
        let mut node = Node::default();
        node.metadata.name = Some("n1".to_string());
        node.metadata.labels = Some(
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        node
    }

    #[test]
    fn the_zone_is_the_nodes_zone_label_and_its_absence_is_said() {
        let here = locality_of("n1", &node(&[(ZONE_LABEL, "europe-west1-b")]));
        assert_eq!(here.zone.as_deref(), Some("europe-west1-b"));
        assert_eq!(here.name.as_deref(), Some("n1"));
        assert_eq!(here.zone_source, ZoneSource::NodeLabel);

        let unlabelled = locality_of("n1", &node(&[("kubernetes.io/os", "linux")]));
        assert_eq!(unlabelled.zone, None);
        assert_eq!(unlabelled.zone_source, ZoneSource::Unknown);
        let note = unlabelled.note.unwrap();
        assert!(
            note.contains("node n1 has no topology.kubernetes.io/zone label"),
            "{note}"
        );

        let bad = locality_of("n1", &node(&[(ZONE_LABEL, "a zone")]));
        assert_eq!(bad.zone, None);
        assert!(bad.note.unwrap().contains("\"a zone\""));
    }
}
