//! Mesh snapshot → the DNS name table: every service's name and the address it resolves to;
//! for a stateful service, every instance's name and address, and the ready instances'
//! addresses under the service's name; SRV records for named ports, in Kubernetes DNS's shape.

use std::borrow::Cow;
use std::net::IpAddr;
use std::sync::Arc;

use lattice_dns::{MeshRecord, NameTable, SrvRecord};

use crate::mesh::{MeshSnapshot, Service};

pub fn name_table(mesh: &MeshSnapshot) -> NameTable {
    // Most services have a name and one named port's SRV owner.
    NameTable::from_records_sized(
        mesh.services.len() * 2,
        mesh.services.values().flat_map(|s| records(s)),
    )
}

/// The records of one service, as (name, record), each name's one after another (the table
/// reads them as one name) and its scope after the record that makes it exist (the table puts
/// it on at once), borrowing the names the service has.
fn records(service: &Service) -> Vec<(Cow<'_, str>, MeshRecord)> {
    let mut out = Vec::new();
    let own = || Cow::Borrowed(service.dns_name.as_str());
    // Every name of the service reports its lookups as the service's, which is what a pod's
    // proxy must then hold (see the agent's scope module).
    let scope: Arc<str> = Arc::from(service.dns_name.as_str());
    let scoped = || MeshRecord::Scope(scope.clone());
    let address = |ip: std::net::Ipv4Addr| MeshRecord::Address(IpAddr::V4(ip));
    // SRV targets: the service itself, or each ready instance (as Kubernetes DNS does for a
    // headless Service), sharing the weight equally.
    let targets: Vec<&str> = match service.address.ip() {
        Some(ip) => {
            out.push((own(), address(ip)));
            out.push((own(), scoped()));
            vec![service.dns_name.as_str()]
        }
        None => {
            // The name exists even when no instance is ready: NODATA, not NXDOMAIN.
            out.push((own(), MeshRecord::Exists));
            out.push((own(), scoped()));
            for instance in service.instances.iter().filter(|i| i.ready) {
                out.push((own(), address(instance.address)));
            }
            service
                .instances
                .iter()
                .filter(|i| i.ready)
                .map(|i| i.dns_name.as_str())
                .collect()
        }
    };
    for instance in &service.instances {
        let name = || Cow::Borrowed(instance.dns_name.as_str());
        out.push((name(), address(instance.address)));
        out.push((name(), scoped()));
    }
    let weight = u16::try_from(100 / targets.len().max(1))
        .unwrap_or(1)
        .max(1);
    for port in &service.ports {
        let Some(name) = &port.name else { continue };
        let owner = format!("_{name}._tcp.{}", service.dns_name);
        out.push((Cow::Owned(owner.clone()), MeshRecord::Exists));
        out.push((Cow::Owned(owner.clone()), scoped()));
        for target in &targets {
            out.push((
                Cow::Owned(owner.clone()),
                MeshRecord::Srv(SrvRecord {
                    priority: 0,
                    weight,
                    port: port.port,
                    target: (*target).to_string(),
                }),
            ));
        }
    }
    out
}

/// Builds the name table when the mesh's shape changed, and only then: names and addresses
/// do not depend on endpoints, so an endpoint change leaves the table alone.
#[derive(Debug, Default)]
pub struct DnsTranslator {
    /// The mesh shape the last table was built for.
    shape_version: Option<u64>,
}

impl DnsTranslator {
    /// Whether the last table still holds for `mesh`.
    pub fn is_current(&self, mesh: &MeshSnapshot) -> bool {
        self.shape_version == Some(mesh.shape_version)
    }

    /// The table for `mesh`, or `None` when the last one still holds.
    pub fn translate(&mut self, mesh: &MeshSnapshot) -> Option<NameTable> {
        if self.is_current(mesh) {
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
                name: None,
                port: 8080,
                protocol,
                endpoints: EndpointSet::parsed(&[endpoint]),
                hosts: Default::default(),
            }],
        )
    }

    #[test]
    fn a_stateful_service_answers_with_ready_instances_and_srv_for_named_ports() {
        use crate::mesh::InstanceSpec;
        let mut state = MeshState::new("240.240.0.0/16".parse().unwrap());
        let instance = |name: &str, ip: &str, ready: bool| InstanceSpec {
            name: name.to_string(),
            ready,
            endpoints: vec![(9042, format!("{ip}:9042").parse().unwrap())],
        };
        let mut db = spec("/data/db", Protocol::Tcp, "10.0.0.10:9042");
        db.ports[0].port = 9042;
        db.ports[0].name = Some("cql".into());
        state
            .upsert(db.with_instances(vec![
                instance("db-0", "10.0.0.10", true),
                instance("db-1", "10.0.0.11", false),
            ]))
            .unwrap();
        let mut web = spec("/a/web", Protocol::Http, "10.0.0.1:80");
        web.ports[0].name = Some("http".into());
        state.upsert(web).unwrap();
        let mesh = state.snapshot();
        let service = |path: &str| &mesh.services[&path.parse::<crate::mesh::MeshPath>().unwrap()];
        let db = service("/data/db");
        let (db0, db1) = (db.instances[0].address, db.instances[1].address);
        let owned = |records: Vec<(Cow<'_, str>, MeshRecord)>| -> Vec<(String, MeshRecord)> {
            records
                .into_iter()
                .map(|(name, record)| (name.into_owned(), record))
                .collect()
        };
        let mut got = owned(records(db));
        got.sort_by(|a, b| format!("{a:?}").cmp(&format!("{b:?}")));
        let a = |ip: std::net::Ipv4Addr| MeshRecord::Address(IpAddr::V4(ip));
        let srv = |target: &str| {
            MeshRecord::Srv(SrvRecord {
                priority: 0,
                weight: 100,
                port: 9042,
                target: target.to_string(),
            })
        };
        let mut expected = vec![
            ("db.data.system.internal".to_string(), MeshRecord::Exists),
            // Not ready: left out of the service's answer, but keeps its own name.
            ("db-0.db.data.system.internal".to_string(), a(db0)),
            ("db-1.db.data.system.internal".to_string(), a(db1)),
            ("db.data.system.internal".to_string(), a(db0)),
            (
                "_cql._tcp.db.data.system.internal".to_string(),
                MeshRecord::Exists,
            ),
            (
                "_cql._tcp.db.data.system.internal".to_string(),
                srv("db-0.db.data.system.internal"),
            ),
        ];
        // Every name of the service, instances' and SRV's included, reports its lookups as
        // the service's.
        let scope = MeshRecord::Scope(std::sync::Arc::from("db.data.system.internal"));
        for name in [
            "db.data.system.internal",
            "db-0.db.data.system.internal",
            "db-1.db.data.system.internal",
            "_cql._tcp.db.data.system.internal",
        ] {
            expected.push((name.to_string(), scope.clone()));
        }
        expected.sort_by(|a, b| format!("{a:?}").cmp(&format!("{b:?}")));
        assert_eq!(got, expected);

        // A service with an address: SRV points at the service's own name.
        let web = service("/a/web");
        assert!(owned(records(web)).contains(&(
            "_http._tcp.web.a.system.internal".to_string(),
            MeshRecord::Srv(SrvRecord {
                priority: 0,
                weight: 100,
                port: 8080,
                target: "web.a.system.internal".to_string(),
            })
        )));
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
