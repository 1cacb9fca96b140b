//! The health policy as both sources write it: the mesh file's `health:` block, and the same
//! block as YAML or JSON in a Service's `lattice.mlab.com/health` annotation. One schema, one
//! validation, the same errors.

use serde::Deserialize;

use crate::mesh::health::{
    ActiveCheck, CheckKind, DEFAULT_HEALTHY_STATUSES, HealthPolicy, OutlierDetection,
};

/// The annotation that carries a Service's health policy.
pub const HEALTH_ANNOTATION: &str = "lattice.mlab.com/health";

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthSpec {
    check: Option<CheckSpec>,
    outlier: Option<OutlierSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct CheckSpec {
    http: Option<HttpCheckSpec>,
    tcp: Option<TcpCheckSpec>,
    interval: Option<String>,
    timeout: Option<String>,
    healthy_threshold: Option<u32>,
    unhealthy_threshold: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HttpCheckSpec {
    path: Option<String>,
    /// `"200"` or `"200-299"`, inclusive.
    statuses: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TcpCheckSpec {}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct OutlierSpec {
    enabled: Option<bool>,
    #[serde(rename = "consecutive5xx")]
    consecutive_5xx: Option<u32>,
    consecutive_gateway_errors: Option<u32>,
    consecutive_connect_failures: Option<u32>,
    interval: Option<String>,
    ejection_time: Option<String>,
    max_ejection_percent: Option<u32>,
}

/// The policy `spec` describes, over the defaults; errors name the field (`check.interval`).
pub fn policy(spec: Option<HealthSpec>) -> Result<HealthPolicy, String> {
    let spec = spec.unwrap_or_default();
    let check = spec.check.map(check).transpose()?;
    let outlier = match spec.outlier {
        None => Some(OutlierDetection::default()),
        Some(outlier) => outlier_detection(outlier)?,
    };
    Ok(HealthPolicy { check, outlier })
}

/// The policy in a `lattice.mlab.com/health` annotation (YAML, so JSON too).
pub fn from_annotation(text: &str) -> Result<HealthPolicy, String> {
    let spec: HealthSpec = serde_norway::from_str(text).map_err(|e| e.to_string())?;
    policy(Some(spec))
}

fn positive_duration(
    text: Option<String>,
    field: &str,
) -> Result<Option<std::time::Duration>, String> {
    let Some(text) = text else { return Ok(None) };
    let duration = super::gateway_duration(&text).map_err(|e| format!("{field}: {e}"))?;
    if duration.is_zero() {
        return Err(format!("{field}: must be more than 0"));
    }
    Ok(Some(duration))
}

fn at_least_one(value: Option<u32>, field: &str, default: u32) -> Result<u32, String> {
    match value {
        Some(0) => Err(format!("{field}: must be at least 1")),
        Some(n) => Ok(n),
        None => Ok(default),
    }
}

fn check(spec: CheckSpec) -> Result<ActiveCheck, String> {
    let kind = match (spec.http, spec.tcp) {
        (Some(http), None) => {
            let path = http.path.unwrap_or_else(|| "/".to_string());
            if !path.starts_with('/') || path.chars().any(char::is_whitespace) {
                return Err(format!(
                    "check.http.path: {path:?} must start with '/' and have no spaces"
                ));
            }
            let statuses = match http.statuses {
                None => vec![DEFAULT_HEALTHY_STATUSES],
                Some(list) if list.is_empty() => {
                    return Err("check.http.statuses: give at least one".to_string());
                }
                Some(list) => list
                    .iter()
                    .map(|s| status_range(s))
                    .collect::<Result<_, _>>()?,
            };
            CheckKind::Http { path, statuses }
        }
        (None, Some(_)) => CheckKind::Tcp,
        _ => return Err("check: give exactly one of http or tcp".to_string()),
    };
    let interval = positive_duration(spec.interval, "check.interval")?
        .unwrap_or(ActiveCheck::DEFAULT_INTERVAL);
    let timeout =
        positive_duration(spec.timeout, "check.timeout")?.unwrap_or(ActiveCheck::DEFAULT_TIMEOUT);
    Ok(ActiveCheck {
        kind,
        interval,
        timeout,
        healthy_threshold: at_least_one(
            spec.healthy_threshold,
            "check.healthyThreshold",
            ActiveCheck::DEFAULT_HEALTHY_THRESHOLD,
        )?,
        unhealthy_threshold: at_least_one(
            spec.unhealthy_threshold,
            "check.unhealthyThreshold",
            ActiveCheck::DEFAULT_UNHEALTHY_THRESHOLD,
        )?,
    })
}

/// `"200"` or `"200-299"` → the half-open range `[200, 300)`.
fn status_range(text: &str) -> Result<(u16, u16), String> {
    let bad =
        || format!("check.http.statuses: {text:?} is not a status or range like 200-299 (100-599)");
    let (start, end) = match text.split_once('-') {
        Some((a, b)) => (a.trim(), b.trim()),
        None => (text.trim(), text.trim()),
    };
    let start: u16 = start.parse().map_err(|_| bad())?;
    let end: u16 = end.parse().map_err(|_| bad())?;
    if !(100..=599).contains(&start) || !(100..=599).contains(&end) || start > end {
        return Err(bad());
    }
    Ok((start, end + 1))
}

fn outlier_detection(spec: OutlierSpec) -> Result<Option<OutlierDetection>, String> {
    if spec.enabled == Some(false) {
        return Ok(None);
    }
    let defaults = OutlierDetection::default();
    let percent = spec
        .max_ejection_percent
        .unwrap_or(defaults.max_ejection_percent);
    if percent > 100 {
        return Err(format!(
            "outlier.maxEjectionPercent: {percent} is more than 100"
        ));
    }
    Ok(Some(OutlierDetection {
        // 0 turns one trigger off.
        consecutive_5xx: spec.consecutive_5xx.unwrap_or(defaults.consecutive_5xx),
        consecutive_gateway_errors: spec
            .consecutive_gateway_errors
            .unwrap_or(defaults.consecutive_gateway_errors),
        consecutive_connect_failures: spec
            .consecutive_connect_failures
            .unwrap_or(defaults.consecutive_connect_failures),
        interval: positive_duration(spec.interval, "outlier.interval")?
            .unwrap_or(defaults.interval),
        ejection_time: positive_duration(spec.ejection_time, "outlier.ejectionTime")?
            .unwrap_or(defaults.ejection_time),
        max_ejection_percent: percent,
    }))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn defaults_have_outlier_detection_on_and_no_active_check() {
        let policy = policy(None).unwrap();
        assert_eq!(policy, HealthPolicy::default());
        assert!(policy.check.is_none());
        assert_eq!(policy.outlier, Some(OutlierDetection::default()));
    }

    #[test]
    fn a_full_block_from_an_annotation_in_yaml_or_json() {
        let yaml = "
check:
  http: {path: /healthz, statuses: ['200', '300-304']}
  interval: 1s
  timeout: 500ms
  healthyThreshold: 1
  unhealthyThreshold: 2
outlier:
  consecutive5xx: 3
  ejectionTime: 1m
  maxEjectionPercent: 100
";
        let policy = from_annotation(yaml).unwrap();
        let check = policy.check.unwrap();
        assert_eq!(
            check.kind,
            CheckKind::Http {
                path: "/healthz".to_string(),
                statuses: vec![(200, 201), (300, 305)]
            }
        );
        assert_eq!(check.interval, Duration::from_secs(1));
        assert_eq!(check.timeout, Duration::from_millis(500));
        assert_eq!((check.healthy_threshold, check.unhealthy_threshold), (1, 2));
        let outlier = policy.outlier.unwrap();
        assert_eq!(outlier.consecutive_5xx, 3);
        assert_eq!(outlier.ejection_time, Duration::from_secs(60));
        assert_eq!(outlier.max_ejection_percent, 100);
        assert_eq!(outlier.consecutive_gateway_errors, 3, "default kept");

        let json = r#"{"check": {"tcp": {}}, "outlier": {"enabled": false}}"#;
        let policy = from_annotation(json).unwrap();
        assert_eq!(policy.check.unwrap().kind, CheckKind::Tcp);
        assert_eq!(policy.outlier, None);
    }

    #[test]
    fn bad_values_are_refused_naming_the_field() {
        for (text, expected) in [
            ("check: {}", "check: give exactly one of http or tcp"),
            ("check: {http: {}, tcp: {}}", "exactly one"),
            (
                "check: {tcp: {}, interval: 0s}",
                "check.interval: must be more than 0",
            ),
            ("check: {tcp: {}, interval: soon}", "check.interval"),
            (
                "check: {tcp: {}, unhealthyThreshold: 0}",
                "check.unhealthyThreshold",
            ),
            ("check: {http: {path: healthz}}", "check.http.path"),
            (
                "check: {http: {statuses: ['99']}}",
                "check.http.statuses: \"99\"",
            ),
            (
                "check: {http: {statuses: ['299-200']}}",
                "check.http.statuses",
            ),
            (
                "outlier: {maxEjectionPercent: 101}",
                "outlier.maxEjectionPercent",
            ),
            ("outlier: {consecutive500: 1}", "unknown field"),
        ] {
            let err = from_annotation(text).unwrap_err();
            assert!(
                err.contains(expected),
                "{text}: expected {expected:?} in {err:?}"
            );
        }
    }
}
