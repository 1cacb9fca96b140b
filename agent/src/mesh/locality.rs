//! Where endpoints run and which of them a client on this node should prefer: a service's
//! traffic distribution, an endpoint's topology hints, this node's own name and zone, and the
//! priority each endpoint gets from them.
//!
//! The agent serves the Envoys of one node, so every client it serves shares the node's name
//! and zone: preferences are worked out here, once, as Envoy priorities. Every endpoint stays
//! in the assignment, the preferred ones at priority 0 and the rest below, so Envoy moves
//! traffic down a priority when the preferred endpoints are unhealthy: a preference can delay
//! failover by a health check or an outlier ejection, never prevent it.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::Endpoint;

/// What a service asks of the choice of endpoints (Kubernetes `spec.trafficDistribution`, the
/// mesh file's `trafficDistribution`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TrafficDistribution {
    /// No preference: every endpoint is equal.
    #[default]
    Any,
    /// Endpoints in this node's zone first, then the rest (`PreferClose` is its older name).
    PreferSameZone,
    /// Endpoints on this node first, then this node's zone, then the rest.
    PreferSameNode,
}

impl TrafficDistribution {
    pub fn is_any(&self) -> bool {
        *self == TrafficDistribution::Any
    }
}

/// A traffic distribution that is none of `PreferSameZone`, `PreferClose`, `PreferSameNode`.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "unknown traffic distribution {0:?}: expected PreferSameZone, PreferSameNode or PreferClose \
     (an older name of PreferSameZone)"
)]
pub struct UnknownDistribution(pub String);

impl FromStr for TrafficDistribution {
    type Err = UnknownDistribution;

    /// Kubernetes' spelling, exactly (the API server compares it so too).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "PreferSameZone" | "PreferClose" => Ok(TrafficDistribution::PreferSameZone),
            "PreferSameNode" => Ok(TrafficDistribution::PreferSameNode),
            _ => Err(UnknownDistribution(s.to_string())),
        }
    }
}

/// An endpoint's topology hints (EndpointSlice `hints.forZones`, `hints.forNodes`): the zones
/// and nodes whose clients should use it. Kubernetes writes them for Services that ask for a
/// topology preference; where present they say more than the endpoint's own zone (topology
/// aware routing may lend an endpoint to a neighbouring zone).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Hints {
    #[serde(default, skip_serializing_if = "<[_]>::is_empty")]
    pub for_zones: Box<[Arc<str>]>,
    #[serde(default, skip_serializing_if = "<[_]>::is_empty")]
    pub for_nodes: Box<[Arc<str>]>,
}

impl Hints {
    pub fn is_empty(&self) -> bool {
        self.for_zones.is_empty() && self.for_nodes.is_empty()
    }
}

/// A zone or node name that cannot be one: the rule of a Kubernetes label value (a zone is the
/// `topology.kubernetes.io/zone` label's value), widened to 253 characters for node names.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "{0:?} is not a valid name: 1-253 of A-Z, a-z, 0-9, '-', '_' and '.', starting and ending \
     with a letter or digit"
)]
pub struct InvalidPlace(pub String);

/// Checks a zone or node name, as the mesh file and `--node-zone` give them.
pub fn place_name(name: &str) -> Result<Arc<str>, InvalidPlace> {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    let valid = !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && edge(name.chars().next())
        && edge(name.chars().last());
    if valid {
        Ok(Arc::from(name))
    } else {
        Err(InvalidPlace(name.to_string()))
    }
}

/// Where the agent learnt its node's zone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ZoneSource {
    /// `--node-zone` (`NODE_ZONE`).
    Flag,
    /// The Node's `topology.kubernetes.io/zone` label.
    NodeLabel,
    /// Nowhere: it is unknown.
    Unknown,
}

/// This node as the translators see it: its name and zone where known.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NodeLocality {
    pub name: Option<Arc<str>>,
    pub zone: Option<Arc<str>>,
    pub zone_source: ZoneSource,
    /// Why the zone is unknown, for `/debug/mesh`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl NodeLocality {
    /// A node whose zone is unknown, and why.
    pub fn without_zone(name: Option<Arc<str>>, why: impl Into<String>) -> Self {
        NodeLocality {
            name,
            zone: None,
            zone_source: ZoneSource::Unknown,
            note: Some(format!(
                "{}: services that prefer the same zone, and zone hints, are served without a \
                 zone preference",
                why.into()
            )),
        }
    }

    pub fn with_zone(name: Option<Arc<str>>, zone: Arc<str>, source: ZoneSource) -> Self {
        NodeLocality {
            name,
            zone: Some(zone),
            zone_source: source,
            note: None,
        }
    }

    /// The priority of each of `endpoints` (same order) for a client on this node: 0 for the
    /// most preferred, dense (no level left empty). Every endpoint gets one, so every endpoint
    /// stays reachable.
    ///
    /// An endpoint is this node's when its node hints name this node (without node hints: when
    /// it runs here), and this zone's when its zone hints name this zone (without zone hints:
    /// when it runs in it). Which of these count: `PreferSameNode` both, `PreferSameZone` the
    /// zone; hints count by themselves too (Kubernetes writes them only for Services that ask
    /// for a preference, and kube-proxy follows them), node hints as node preference, zone
    /// hints as zone preference. A preference this node cannot tell (its zone or name unknown)
    /// is left out.
    pub fn priorities<'a>(
        &self,
        distribution: TrafficDistribution,
        endpoints: impl IntoIterator<Item = &'a Endpoint>,
    ) -> Vec<u32> {
        let endpoints: Vec<&Endpoint> = endpoints.into_iter().collect();
        let hinted =
            |f: fn(&Hints) -> bool| endpoints.iter().any(|e| e.hints.as_deref().is_some_and(f));
        let by_node = self.name.is_some()
            && (distribution == TrafficDistribution::PreferSameNode
                || hinted(|h| !h.for_nodes.is_empty()));
        let by_zone =
            self.zone.is_some() && (!distribution.is_any() || hinted(|h| !h.for_zones.is_empty()));
        let tiers: Vec<u32> = endpoints
            .iter()
            .map(|e| {
                if by_node && self.is_local(e) {
                    0
                } else if by_zone && self.is_in_zone(e) {
                    1
                } else {
                    2
                }
            })
            .collect();
        // Dense: the levels present, in order, become 0, 1, ….
        let mut present: Vec<u32> = tiers.clone();
        present.sort_unstable();
        present.dedup();
        tiers
            .iter()
            .map(|t| present.iter().position(|p| p == t).unwrap_or(0) as u32)
            .collect()
    }

    fn is_local(&self, endpoint: &Endpoint) -> bool {
        let Some(name) = &self.name else { return false };
        match endpoint.hints.as_deref() {
            Some(hints) if !hints.for_nodes.is_empty() => hints.for_nodes.contains(name),
            _ => endpoint.node.as_ref() == Some(name),
        }
    }

    fn is_in_zone(&self, endpoint: &Endpoint) -> bool {
        let Some(zone) = &self.zone else { return false };
        match endpoint.hints.as_deref() {
            Some(hints) if !hints.for_zones.is_empty() => hints.for_zones.contains(zone),
            _ => endpoint.zone.as_ref() == Some(zone),
        }
    }
}

impl fmt::Display for TrafficDistribution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TrafficDistribution::Any => "Any",
            TrafficDistribution::PreferSameZone => "PreferSameZone",
            TrafficDistribution::PreferSameNode => "PreferSameNode",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::Provider;

    fn endpoint(ip: u8, zone: Option<&str>, node: Option<&str>) -> Endpoint {
        let mut e = Endpoint::new(
            format!("10.0.0.{ip}:80").parse().unwrap(),
            Provider::new("test"),
        );
        e.zone = zone.map(Arc::from);
        e.node = node.map(Arc::from);
        e
    }

    fn hinted(mut e: Endpoint, zones: &[&str], nodes: &[&str]) -> Endpoint {
        e.hints = Some(Arc::new(Hints {
            for_zones: zones.iter().map(|z| Arc::from(*z)).collect(),
            for_nodes: nodes.iter().map(|n| Arc::from(*n)).collect(),
        }));
        e
    }

    fn here() -> NodeLocality {
        NodeLocality::with_zone(Some(Arc::from("n1")), Arc::from("a"), ZoneSource::Flag)
    }

    /// On n1 in zone a; in zone a on n2; in zone b; nowhere known.
    fn four() -> Vec<Endpoint> {
        vec![
            endpoint(1, Some("a"), Some("n1")),
            endpoint(2, Some("a"), Some("n2")),
            endpoint(3, Some("b"), Some("n3")),
            endpoint(4, None, None),
        ]
    }

    #[test]
    fn each_policy_ranks_this_node_then_this_zone_then_the_rest() {
        let endpoints = four();
        use TrafficDistribution::*;
        assert_eq!(here().priorities(Any, &endpoints), [0, 0, 0, 0]);
        assert_eq!(here().priorities(PreferSameZone, &endpoints), [0, 0, 1, 1]);
        assert_eq!(here().priorities(PreferSameNode, &endpoints), [0, 1, 2, 2]);
        // Levels are dense: nothing on this node, so this zone is 0.
        assert_eq!(
            here().priorities(PreferSameNode, &endpoints[1..]),
            [0, 1, 1]
        );
        // Nothing preferred at all: one level.
        assert_eq!(here().priorities(PreferSameZone, &endpoints[2..]), [0, 0]);
    }

    #[test]
    fn an_unknown_zone_or_name_drops_that_preference_only() {
        let endpoints = four();
        let no_zone = NodeLocality::without_zone(Some(Arc::from("n1")), "no --node-zone");
        use TrafficDistribution::*;
        assert_eq!(no_zone.priorities(PreferSameZone, &endpoints), [0, 0, 0, 0]);
        assert_eq!(no_zone.priorities(PreferSameNode, &endpoints), [0, 1, 1, 1]);
        assert!(no_zone.note.as_deref().unwrap().contains("no --node-zone"));
        let no_name = NodeLocality::with_zone(None, Arc::from("a"), ZoneSource::Flag);
        assert_eq!(no_name.priorities(PreferSameNode, &endpoints), [0, 0, 1, 1]);
    }

    #[test]
    fn hints_say_more_than_the_endpoints_own_place_and_count_by_themselves() {
        use TrafficDistribution::*;
        // Topology aware routing lent the zone-b endpoint to zone a, and kept 2 for zone c.
        let endpoints = vec![
            hinted(endpoint(1, Some("a"), Some("n1")), &["a"], &[]),
            hinted(endpoint(2, Some("a"), Some("n2")), &["c"], &[]),
            hinted(endpoint(3, Some("b"), Some("n3")), &["a"], &[]),
        ];
        assert_eq!(here().priorities(Any, &endpoints), [0, 1, 0]);
        assert_eq!(here().priorities(PreferSameZone, &endpoints), [0, 1, 0]);
        // Node hints name the nodes that should use the endpoint.
        let endpoints = vec![
            hinted(endpoint(1, Some("a"), Some("n9")), &["a"], &["n1"]),
            hinted(endpoint(2, Some("a"), Some("n1")), &["a"], &["n2"]),
            hinted(endpoint(3, Some("b"), Some("n3")), &["b"], &["n3"]),
        ];
        assert_eq!(here().priorities(Any, &endpoints), [0, 1, 2]);
    }

    #[test]
    fn names_follow_the_label_value_rule() {
        assert!(place_name("europe-west1-b").is_ok());
        assert!(place_name("node-1.example.com").is_ok());
        for bad in ["", "-a", "a-", "a b", "zone/1", &"x".repeat(254)] {
            assert!(place_name(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            "PreferClose".parse(),
            Ok(TrafficDistribution::PreferSameZone)
        );
        assert!("preferSameZone".parse::<TrafficDistribution>().is_err());
    }
}
