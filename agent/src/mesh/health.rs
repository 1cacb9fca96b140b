//! How a service's endpoints are judged healthy: active checks (off unless asked for) and
//! passive outlier detection (on for every service, with defaults chosen for a mesh).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A service's health policy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthPolicy {
    /// Active checks that Envoy sends to every endpoint; `None`: off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub check: Option<ActiveCheck>,
    /// Passive: ejects endpoints that fail real requests; `None`: off.
    pub outlier: Option<OutlierDetection>,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        HealthPolicy {
            check: None,
            outlier: Some(OutlierDetection::default()),
        }
    }
}

/// An active health check.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActiveCheck {
    pub kind: CheckKind,
    #[serde(with = "millis")]
    pub interval: Duration,
    #[serde(with = "millis")]
    pub timeout: Duration,
    /// Passes in a row before an unhealthy endpoint gets traffic again.
    pub healthy_threshold: u32,
    /// Failures in a row before an endpoint stops getting traffic.
    pub unhealthy_threshold: u32,
}

impl ActiveCheck {
    pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(5);
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);
    pub const DEFAULT_HEALTHY_THRESHOLD: u32 = 2;
    pub const DEFAULT_UNHEALTHY_THRESHOLD: u32 = 3;
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckKind {
    /// `GET path`; healthy when the status is in one of `statuses` (half-open ranges
    /// `[start, end)`).
    Http {
        path: String,
        statuses: Vec<(u16, u16)>,
    },
    /// A TCP connection that opens.
    Tcp,
}

/// The HTTP statuses that pass a check when none are given: 2xx and 3xx.
pub const DEFAULT_HEALTHY_STATUSES: (u16, u16) = (200, 400);

/// Passive outlier detection: Envoy counts failures of real requests per endpoint and ejects
/// an endpoint for a while when they pile up.
///
/// Envoy's own defaults are not a mesh's: ejection by consecutive gateway errors and by
/// connect failures is off (only 5xx counts, and a dead endpoint's connect failures count as
/// 5xx after they happened), success-rate ejection is on (noise at a sidecar's low volume per
/// endpoint), an ejected endpoint stays out 30 s, and at most 10 % of endpoints may be out
/// (Envoy ejects one anyway). The mesh's defaults: 5 consecutive 5xx, 3 consecutive gateway
/// errors (502, 503, 504) or 3 consecutive connect failures eject; no success-rate ejection;
/// out for 15 s, doubling with each repeat up to 5 min; at most half the endpoints out, so a
/// two-endpoint service can lose its bad one and always keeps one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutlierDetection {
    pub consecutive_5xx: u32,
    pub consecutive_gateway_errors: u32,
    pub consecutive_connect_failures: u32,
    /// How often Envoy re-admits ejected endpoints whose time is up.
    #[serde(with = "millis")]
    pub interval: Duration,
    /// How long an endpoint stays out, times the number of times it was ejected.
    #[serde(with = "millis")]
    pub ejection_time: Duration,
    pub max_ejection_percent: u32,
}

impl Default for OutlierDetection {
    fn default() -> Self {
        OutlierDetection {
            consecutive_5xx: 5,
            consecutive_gateway_errors: 3,
            consecutive_connect_failures: 3,
            interval: Duration::from_secs(5),
            ejection_time: Duration::from_secs(15),
            max_ejection_percent: 50,
        }
    }
}

/// Durations as milliseconds in `/debug/mesh`.
mod millis {
    use std::time::Duration;

    pub fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        <u64 as serde::Deserialize>::deserialize(d).map(Duration::from_millis)
    }
}
