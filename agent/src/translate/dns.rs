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
