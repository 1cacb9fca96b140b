//! The ports Envoy listens on in a mesh pod. The capture port is the one two binaries must
//! agree on: `lattice-init` redirects the trapped block to it, and the agent's capture
//! listener (the one listener it serves every proxy) listens on it. Both take `--envoy-port`
//! and parse it here, so they accept the same values and refuse the others in the same words.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::{ENVOY_ADMIN_PORT, ENVOY_INBOUND_PORT, ENVOY_OUTBOUND_PORT, ENVOY_READINESS_PORT};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CapturePortError {
    #[error(
        "--envoy-port {value:?} is not a port number; give the port of Envoy's capture listener (1-65535), default {ENVOY_OUTBOUND_PORT}"
    )]
    Syntax { value: String },
    #[error(
        "--envoy-port 0 is not a usable port; give the port of Envoy's capture listener (1-65535), default {ENVOY_OUTBOUND_PORT}"
    )]
    Zero,
    #[error(
        "--envoy-port {port} is Envoy's {role} port in the pod (the bootstrap lattice-init writes listens there); give another, default {ENVOY_OUTBOUND_PORT}"
    )]
    Taken { port: u16, role: &'static str },
}

/// The port of Envoy's capture listener in every mesh pod of a node: where `lattice-init`
/// redirects the trapped block, and where the agent's listener listens. Give both binaries the
/// same value (default [`ENVOY_OUTBOUND_PORT`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct CapturePort(u16);

impl CapturePort {
    pub fn new(port: u16) -> Result<Self, CapturePortError> {
        match port {
            0 => Err(CapturePortError::Zero),
            ENVOY_ADMIN_PORT => Err(CapturePortError::Taken {
                port,
                role: "admin",
            }),
            ENVOY_READINESS_PORT => Err(CapturePortError::Taken {
                port,
                role: "readiness",
            }),
            ENVOY_INBOUND_PORT => Err(CapturePortError::Taken {
                port,
                role: "inbound",
            }),
            port => Ok(CapturePort(port)),
        }
    }

    pub fn get(self) -> u16 {
        self.0
    }
}

impl Default for CapturePort {
    fn default() -> Self {
        CapturePort(ENVOY_OUTBOUND_PORT)
    }
}

impl fmt::Display for CapturePort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for CapturePort {
    type Err = CapturePortError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let port = text
            .trim()
            .parse::<u16>()
            .map_err(|_| CapturePortError::Syntax {
                value: text.to_owned(),
            })?;
        CapturePort::new(port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envoys_other_ports_and_non_ports_are_refused_with_the_value_named() {
        assert_eq!("15001".parse(), Ok(CapturePort::default()));
        assert_eq!(
            "16001".parse::<CapturePort>().map(CapturePort::get),
            Ok(16001)
        );
        for (value, needle) in [
            ("0", "--envoy-port 0"),
            ("15000", "admin port"),
            ("15021", "readiness port"),
            ("15006", "inbound port"),
            ("70000", "\"70000\" is not a port"),
            ("-1", "\"-1\" is not a port"),
            ("", "\"\" is not a port"),
            ("http", "\"http\" is not a port"),
        ] {
            let err = value.parse::<CapturePort>().unwrap_err().to_string();
            assert!(err.contains(needle), "{value:?}: {err}");
        }
    }
}
