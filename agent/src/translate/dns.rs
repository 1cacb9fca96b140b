//! Mesh snapshot → the DNS name table: every service's name and the address it resolves to.

use std::net::IpAddr;

use lattice_dns::NameTable;

use crate::mesh::MeshSnapshot;

pub fn name_table(mesh: &MeshSnapshot) -> NameTable {
    NameTable::new(
        mesh.services
            .values()
            .map(|s| (s.dns_name.clone(), IpAddr::V4(s.address.ip()))),
    )
}

/// Builds the name table when the mesh's shape changed, and only then: names and addresses
/// do not depend on endpoints, so an endpoint change leaves the table alone.
#[derive(Debug, Default)]
pub struct DnsTranslator {
    /// The mesh shape the last table was built for.
    shape_version: Option<u64>,
}

impl DnsTranslator {
    /// The table for `mesh`, or `None` when the last one still holds.
    pub fn translate(&mut self, mesh: &MeshSnapshot) -> Option<NameTable> {
        if self.shape_version == Some(mesh.shape_version) {
            return None;
        }
        self.shape_version = Some(mesh.shape_version);
        Some(name_table(mesh))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::{EndpointSet, MeshState, Protocol, ServicePort, ServiceSpec};

    fn spec(path: &str, protocol: Protocol, endpoint: &str) -> ServiceSpec {
        ServiceSpec::new(
            path.parse().unwrap(),
            vec![ServicePort {
                port: 8080,
                protocol,
                endpoints: EndpointSet::new(vec![endpoint.parse().unwrap()]),
            }],
        )
    }

    #[test]
    fn a_table_for_every_change_of_shape_and_none_for_endpoints() {
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        let mut dns = DnsTranslator::default();
        state
            .upsert(spec("/foo/bar/buzz", Protocol::Http, "10.0.0.1:80"))
            .unwrap();
        assert!(
            dns.translate(&state.snapshot()).is_some(),
            "the first table"
        );

        state
            .upsert(spec("/foo/bar/buzz", Protocol::Http, "10.0.0.2:80"))
            .unwrap();
        assert!(dns.translate(&state.snapshot()).is_none(), "endpoints only");

        // The service needs an address of its own now: a new answer for the same name.
        state
            .upsert(spec("/foo/bar/buzz", Protocol::Tcp, "10.0.0.2:80"))
            .unwrap();
        assert!(dns.translate(&state.snapshot()).is_some(), "a new address");

        state.remove(&"/foo/bar/buzz".parse().unwrap());
        assert!(dns.translate(&state.snapshot()).is_some(), "a service went");
        assert!(
            dns.translate(&state.snapshot()).is_none(),
            "nothing changed"
        );
    }
}
