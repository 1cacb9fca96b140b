//! The annotations a pod (or its namespace, for `inject`) carries to steer its injection, all
//! under `lattice.mlab.com/`, and what each value may be. A value that does not parse refuses
//! the injection with the annotation named: a pod is meshed as asked or not at all.

use std::collections::BTreeMap;

/// `enabled` or `disabled`: on a pod, asks for injection or opts out (the opt-out wins over
/// the namespace's label); as a namespace label, injects every pod of the namespace.
pub const INJECT: &str = "lattice.mlab.com/inject";
/// What injection changed, so `lattice uninject` can restore the pod: set by the injector.
pub const INJECTED: &str = "lattice.mlab.com/injected";
/// The proxy's CPU request, memory request and memory limit (Kubernetes quantities).
pub const PROXY_CPU: &str = "lattice.mlab.com/proxy-cpu";
pub const PROXY_MEMORY: &str = "lattice.mlab.com/proxy-memory";
pub const PROXY_MEMORY_LIMIT: &str = "lattice.mlab.com/proxy-memory-limit";
/// More UIDs whose traffic is never captured (comma-separated), beside Envoy's own.
pub const EXCLUDE_UIDS: &str = "lattice.mlab.com/exclude-uids";
/// `enabled` (the default) or `disabled`: whether the TCP arriving for the pod is captured
/// too, and reaches the app through its proxy's inbound listener.
pub const INBOUND_CAPTURE: &str = "lattice.mlab.com/inbound-capture";
/// Ports whose inbound TCP reaches the app directly (comma-separated), beside the proxy's own;
/// not with inbound capture disabled.
pub const EXCLUDE_INBOUND_PORTS: &str = "lattice.mlab.com/exclude-inbound-ports";
/// Set by the injector on a pod whose inbound TCP it captures (`enabled`): the label the
/// agents' metadata-only watch of meshed pods selects.
pub const MESHED_LABEL: &str = "lattice.mlab.com/inbound-capture";
/// Set by the injector beside [`MESHED_LABEL`]: the pod's service account, which that watch
/// cannot read from the spec.
pub const SERVICE_ACCOUNT: &str = "lattice.mlab.com/service-account";
/// `delta` (the default) or `sotw`: the ADS flavour the proxy speaks.
pub const XDS_MODE: &str = "lattice.mlab.com/xds-mode";
/// Read by the agent, not the injector (`docs/kubernetes.md`): which services the pod's proxy
/// holds. The injector checks their values so a typo is refused at admission, not logged on
/// the node.
pub const SCOPE: &str = "lattice.mlab.com/scope";
/// `permissive` or `strict`: what the pod's inbound listener does with callers that are not
/// mesh mTLS.
pub const MTLS_MODE: &str = "lattice.mlab.com/mtls-mode";
pub const USES: &str = "lattice.mlab.com/uses";

/// The longest annotation value quoted back in a refusal.
const SHOWN: usize = 64;

/// The injection's wish as a value says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wish {
    Enabled,
    Disabled,
}

impl Wish {
    /// `enabled` / `disabled`; anything else is no wish (`None`) and is refused by the caller
    /// that reads it.
    pub fn parse(value: &str) -> Option<Wish> {
        match value.trim() {
            "enabled" => Some(Wish::Enabled),
            "disabled" => Some(Wish::Disabled),
            _ => None,
        }
    }
}

/// What a pod's annotations ask of its injection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Overrides {
    pub cpu: Option<String>,
    pub memory: Option<String>,
    pub memory_limit: Option<String>,
    pub exclude_uids: Vec<u32>,
    pub xds_mode: Option<&'static str>,
    pub inbound_capture: bool,
    pub exclude_inbound_ports: Vec<u16>,
}

/// What a pod without annotations of ours gets: inbound capture, and nothing else changed.
impl Default for Overrides {
    fn default() -> Self {
        Overrides {
            cpu: None,
            memory: None,
            memory_limit: None,
            exclude_uids: Vec::new(),
            xds_mode: None,
            inbound_capture: true,
            exclude_inbound_ports: Vec::new(),
        }
    }
}

impl Overrides {
    /// Reads `annotations`, refusing the first value that does not parse.
    pub fn read(annotations: &BTreeMap<String, String>) -> Result<Overrides, BadAnnotation> {
        let mut overrides = Overrides::default();
        for (key, slot) in [
            (PROXY_CPU, &mut overrides.cpu),
            (PROXY_MEMORY, &mut overrides.memory),
            (PROXY_MEMORY_LIMIT, &mut overrides.memory_limit),
        ] {
            if let Some(value) = annotations.get(key) {
                if !is_quantity(value.trim()) {
                    return Err(BadAnnotation::new(
                        key,
                        value,
                        "not a Kubernetes quantity (such as 100m or 128Mi)",
                    ));
                }
                *slot = Some(value.trim().to_string());
            }
        }
        if let Some(value) = annotations.get(EXCLUDE_UIDS) {
            overrides.exclude_uids =
                list(value, |uid: &u32| *uid != u32::MAX).ok_or_else(|| {
                    BadAnnotation::new(EXCLUDE_UIDS, value, "not a comma-separated list of UIDs")
                })?;
        }
        if let Some(value) = annotations.get(INBOUND_CAPTURE) {
            overrides.inbound_capture = match Wish::parse(value) {
                Some(wish) => wish == Wish::Enabled,
                None => {
                    return Err(BadAnnotation::new(
                        INBOUND_CAPTURE,
                        value,
                        "neither enabled nor disabled",
                    ));
                }
            };
        }
        if let Some(value) = annotations.get(EXCLUDE_INBOUND_PORTS) {
            if !overrides.inbound_capture {
                return Err(BadAnnotation::new(
                    EXCLUDE_INBOUND_PORTS,
                    value,
                    "given with lattice.mlab.com/inbound-capture: disabled",
                ));
            }
            overrides.exclude_inbound_ports =
                list(value, |port: &u16| *port != 0).ok_or_else(|| {
                    BadAnnotation::new(
                        EXCLUDE_INBOUND_PORTS,
                        value,
                        "not a comma-separated list of ports (1-65535)",
                    )
                })?;
        }
        if let Some(value) = annotations.get(XDS_MODE) {
            overrides.xds_mode = Some(match value.trim() {
                "delta" => "delta",
                "sotw" => "sotw",
                _ => {
                    return Err(BadAnnotation::new(
                        XDS_MODE,
                        value,
                        "neither delta nor sotw",
                    ));
                }
            });
        }
        if let Some(value) = annotations.get(SCOPE)
            && !matches!(value.trim(), "used" | "mesh")
        {
            return Err(BadAnnotation::new(SCOPE, value, "neither used nor mesh"));
        }
        if let Some(value) = annotations.get(MTLS_MODE)
            && !matches!(value.trim(), "permissive" | "strict")
        {
            return Err(BadAnnotation::new(
                MTLS_MODE,
                value,
                "neither permissive nor strict",
            ));
        }
        if let Some(value) = annotations.get(USES) {
            let paths = value
                .split([',', ' ', '\n', '\t'])
                .filter(|p| !p.is_empty());
            for path in paths {
                if !path.starts_with('/') || path.len() < 2 || path.contains("//") {
                    return Err(BadAnnotation::new(
                        USES,
                        value,
                        "an entry is not a mesh path such as /shop/web",
                    ));
                }
            }
        }
        Ok(overrides)
    }
}

/// A comma-separated list of numbers (blanks ignored), each one `valid`; `None` if any is not.
fn list<T: std::str::FromStr>(value: &str, valid: impl Fn(&T) -> bool) -> Option<Vec<T>> {
    value
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| item.parse::<T>().ok().filter(&valid))
        .collect()
}

/// An annotation whose value does not parse: which, its value (cut short) and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("annotation {key}: {value:?} is {why}")]
pub struct BadAnnotation {
    pub key: &'static str,
    pub value: String,
    pub why: &'static str,
}

impl BadAnnotation {
    pub fn new(key: &'static str, value: &str, why: &'static str) -> BadAnnotation {
        BadAnnotation {
            key,
            value: shown(value),
            why,
        }
    }
}

/// At most [`SHOWN`] characters of `value`, for a message.
pub(crate) fn shown(value: &str) -> String {
    match value.char_indices().nth(SHOWN) {
        Some((end, _)) => format!("{}…", &value[..end]),
        None => value.to_string(),
    }
}

/// A Kubernetes quantity: a decimal number (sign, digits, a fraction) and a suffix, binary
/// (`Ki`…`Ei`), decimal (`n`, `u`, `m`, `k`, `M`…`E`) or an exponent (`e3`). The API server's
/// own grammar; a value it would refuse is refused here first, with the annotation named.
pub fn is_quantity(text: &str) -> bool {
    let number_end = text
        .char_indices()
        .find(|(i, c)| !(c.is_ascii_digit() || *c == '.' || (*i == 0 && (*c == '+' || *c == '-'))))
        .map_or(text.len(), |(i, _)| i);
    let (number, suffix) = text.split_at(number_end);
    let digits = number.trim_start_matches(['+', '-']);
    let mut parts = digits.split('.');
    let whole = parts.next().unwrap_or_default();
    let fraction = parts.next();
    if parts.next().is_some() || (whole.is_empty() && fraction.is_none_or(str::is_empty)) {
        return false;
    }
    match suffix {
        "" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" | "n" | "u" | "m" | "k" | "M" | "G" | "T"
        | "P" | "E" => true,
        exponent => exponent
            .strip_prefix(['e', 'E'])
            .map(|e| e.trim_start_matches(['+', '-']))
            .is_some_and(|e| !e.is_empty() && e.chars().all(|c| c.is_ascii_digit())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_as_the_api_server_reads_them() {
        for good in [
            "100m", "1", "0.5", "128Mi", "1Gi", "1e3", "2E-2", ".5", "+1k", "5.",
        ] {
            assert!(is_quantity(good), "{good}");
        }
        for bad in [
            "", "m", "1mi", "1.2.3", "1 Gi", "Mi", "1e", "--1", "one", "1KB",
        ] {
            assert!(!is_quantity(bad), "{bad}");
        }
    }

    #[test]
    fn a_bad_value_is_refused_with_its_annotation_and_no_more_of_it_than_a_line() {
        let long = "x".repeat(10_000);
        let annotations = BTreeMap::from([(PROXY_MEMORY.to_string(), long)]);
        let Err(BadAnnotation { key, value, .. }) = Overrides::read(&annotations) else {
            panic!("refused");
        };
        assert_eq!(key, PROXY_MEMORY);
        assert!(value.len() < 100, "{value}");
        for (key, value) in [
            (EXCLUDE_UIDS, "1000,root"),
            (INBOUND_CAPTURE, "yes"),
            (MTLS_MODE, "STRICT"),
            (XDS_MODE, "grpc"),
            (SCOPE, "everything"),
            (USES, "/shop/web, shop"),
        ] {
            let annotations = BTreeMap::from([(key.to_string(), value.to_string())]);
            assert!(Overrides::read(&annotations).is_err(), "{key}: {value}");
        }
    }

    #[test]
    fn good_values_are_read() {
        let annotations = BTreeMap::from([
            (PROXY_CPU.to_string(), " 200m ".to_string()),
            (EXCLUDE_UIDS.to_string(), "1000, 1001".to_string()),
            (XDS_MODE.to_string(), "sotw".to_string()),
            (USES.to_string(), "/shop/web, /data/db".to_string()),
            (SCOPE.to_string(), "mesh".to_string()),
        ]);
        let overrides = Overrides::read(&annotations).unwrap_or_default();
        assert_eq!(overrides.cpu.as_deref(), Some("200m"));
        assert_eq!(overrides.exclude_uids, vec![1000, 1001]);
        assert!(overrides.inbound_capture, "inbound capture is the default");
        let off = BTreeMap::from([(INBOUND_CAPTURE.to_string(), "disabled".to_string())]);
        assert!(!Overrides::read(&off).unwrap().inbound_capture);
        assert_eq!(overrides.xds_mode, Some("sotw"));
    }

    #[test]
    fn inbound_ports_are_refused_with_inbound_capture_disabled() {
        let read = |pairs: &[(&str, &str)]| {
            let annotations: BTreeMap<String, String> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            Overrides::read(&annotations)
        };
        let on = read(&[
            (INBOUND_CAPTURE, "enabled"),
            (EXCLUDE_INBOUND_PORTS, "9090, 8081"),
        ])
        .unwrap();
        assert!(on.inbound_capture);
        assert_eq!(on.exclude_inbound_ports, vec![9090, 8081]);
        assert_eq!(
            read(&[(EXCLUDE_INBOUND_PORTS, "9090")])
                .unwrap()
                .exclude_inbound_ports,
            vec![9090],
            "captured by default"
        );
        for bad in [
            vec![
                (INBOUND_CAPTURE, "disabled"),
                (EXCLUDE_INBOUND_PORTS, "9090"),
            ],
            vec![(INBOUND_CAPTURE, "enabled"), (EXCLUDE_INBOUND_PORTS, "0")],
            vec![
                (INBOUND_CAPTURE, "enabled"),
                (EXCLUDE_INBOUND_PORTS, "http"),
            ],
        ] {
            let err = read(&bad).unwrap_err();
            assert_eq!(err.key, EXCLUDE_INBOUND_PORTS, "{bad:?}");
        }
    }
}
