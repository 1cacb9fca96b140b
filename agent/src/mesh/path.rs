//! Mesh paths (`/foo/bar/buzz`) and the DNS names derived from them.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use lattice_contract::{ZONE, ZONE_NAMESERVER_LABEL};

/// A service's place in the mesh: `/`-separated DNS labels, most general first.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct MeshPath(String);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PathError {
    #[error("mesh path {0:?} must start with '/' and have at least one segment, like /foo/bar")]
    Shape(String),
    #[error(
        "mesh path {path:?}: segment {segment:?} is not a DNS label (1-63 of a-z, 0-9 and '-', \
         not starting or ending with '-')"
    )]
    Segment { path: String, segment: String },
    #[error("mesh path {0:?} makes a DNS name longer than 253 characters")]
    TooLong(String),
    #[error(
        "mesh path {0:?} is reserved: its DNS name is the zone's name server; choose another path"
    )]
    Reserved(String),
}

impl MeshPath {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The segments, most general first: `/foo/bar/buzz` → foo, bar, buzz.
    pub fn segments(&self) -> impl DoubleEndedIterator<Item = &str> {
        self.0[1..].split('/')
    }

    /// The path reversed under the zone: `/foo/bar/buzz` → `buzz.bar.foo.system.internal`.
    pub fn dns_name(&self) -> String {
        let mut name = String::with_capacity(self.0.len() + ZONE.len() + 1);
        for segment in self.segments().rev() {
            name.push_str(segment);
            name.push('.');
        }
        name.push_str(ZONE);
        name
    }

    /// The path one level below: `/data/db` + `db-1` → `/data/db/db-1`, whose DNS name is
    /// `db-1.db.data.system.internal`. How a stateful service names its instances.
    pub fn child(&self, label: &str) -> Result<MeshPath, PathError> {
        let path = format!("{}/{label}", self.0);
        if !is_dns_label(label) {
            return Err(PathError::Segment {
                path,
                segment: label.to_string(),
            });
        }
        path.parse()
    }
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && !s.starts_with('-')
        && !s.ends_with('-')
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

impl FromStr for MeshPath {
    type Err = PathError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let Some(rest) = s.strip_prefix('/') else {
            return Err(PathError::Shape(s.to_string()));
        };
        if rest.is_empty() {
            return Err(PathError::Shape(s.to_string()));
        }
        if let Some(bad) = rest.split('/').find(|segment| !is_dns_label(segment)) {
            return Err(PathError::Segment {
                path: s.to_string(),
                segment: bad.to_string(),
            });
        }
        if rest == ZONE_NAMESERVER_LABEL {
            return Err(PathError::Reserved(s.to_string()));
        }
        let path = MeshPath(s.to_string());
        if path.dns_name().len() > 253 {
            return Err(PathError::TooLong(s.to_string()));
        }
        Ok(path)
    }
}

impl TryFrom<String> for MeshPath {
    type Error = PathError;

    fn try_from(value: String) -> Result<Self, Self::Error> {
        value.parse()
    }
}

impl From<MeshPath> for String {
    fn from(path: MeshPath) -> String {
        path.0
    }
}

impl fmt::Display for MeshPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_name_reverses_the_path_under_the_zone() {
        let path: MeshPath = "/foo/bar/buzz".parse().unwrap();
        assert_eq!(path.dns_name(), "buzz.bar.foo.system.internal");
        let path: MeshPath = "/default/web".parse().unwrap();
        assert_eq!(path.dns_name(), "web.default.system.internal");
    }

    #[test]
    fn a_child_is_one_valid_label_below() {
        let path: MeshPath = "/data/db".parse().unwrap();
        let child = path.child("db-1").unwrap();
        assert_eq!(child.dns_name(), "db-1.db.data.system.internal");
        for bad in ["", "Db-1", "db/1", "db.1", "-db"] {
            assert!(path.child(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn the_name_servers_path_is_reserved() {
        assert_eq!(
            "/ns".parse::<MeshPath>(),
            Err(PathError::Reserved("/ns".to_string()))
        );
        assert!("/ns/web".parse::<MeshPath>().is_ok());
        assert!("/web/ns".parse::<MeshPath>().is_ok());
    }

    #[test]
    fn rejects_paths_that_are_not_dns_labels() {
        for bad in [
            "",
            "/",
            "foo/bar",
            "/foo//bar",
            "/foo/",
            "/Foo",
            "/foo/-x",
            "/a_b",
            "/a.b",
        ] {
            assert!(
                bad.parse::<MeshPath>().is_err(),
                "{bad:?} should be rejected"
            );
        }
        let long = format!("/{}", vec!["a".repeat(63); 4].join("/"));
        assert!(matches!(
            long.parse::<MeshPath>(),
            Err(PathError::TooLong(_))
        ));
    }
}
