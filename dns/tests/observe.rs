//! Lookups of names with a scope are reported to the server's observer, with the client's
//! address, over both paths and both transports; an answer the observer holds goes out when the
//! hold ends, and other clients are answered meanwhile. Real `dig` clients; a second client
//! is a second loopback address (`dig -b 127.0.0.2`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Server, dig};
use lattice_dns::{Hold, LookupObserver, MeshRecord, NameTable, SrvRecord};
use tokio::sync::Notify;

/// Records every report; holds answers for the scope `held` until `release` is notified.
#[derive(Default)]
struct Recorder {
    seen: Mutex<Vec<(IpAddr, String)>>,
    release: Arc<Notify>,
}

impl LookupObserver for Recorder {
    fn looked_up(&self, client: IpAddr, scope: &Arc<str>) -> Option<Hold> {
        self.seen.lock().unwrap().push((client, scope.to_string()));
        if &**scope != "held" {
            return None;
        }
        let release = self.release.clone();
        Some(Box::pin(async move { release.notified().await }))
    }
}

impl Recorder {
    /// The scopes reported since the last call, all for 127.0.0.1 (as an IPv4 address: one
    /// that reaches a dual-stack socket must be reported as such, not IPv4-mapped).
    fn take(&self) -> Vec<String> {
        self.take_with_clients()
            .into_iter()
            .map(|(client, scope)| {
                assert_eq!(client, IpAddr::V4(Ipv4Addr::LOCALHOST), "{scope}");
                scope
            })
            .collect()
    }

    fn take_with_clients(&self) -> Vec<(IpAddr, String)> {
        std::mem::take(&mut *self.seen.lock().unwrap())
    }
}

fn names() -> Arc<NameTable> {
    let scope = |name: &str, key: &str| (name.to_string(), MeshRecord::Scope(Arc::from(key)));
    let address =
        |name: &str, ip: &str| (name.to_string(), MeshRecord::Address(ip.parse().unwrap()));
    Arc::new(NameTable::from_records([
        address("buzz.bar.foo.system.internal", "240.240.0.1"),
        scope("buzz.bar.foo.system.internal", "buzz"),
        (
            "_http._tcp.buzz.bar.foo.system.internal".to_string(),
            MeshRecord::Srv(SrvRecord {
                priority: 0,
                weight: 100,
                port: 8080,
                target: "buzz.bar.foo.system.internal".to_string(),
            }),
        ),
        scope("_http._tcp.buzz.bar.foo.system.internal", "buzz"),
        address("plain.system.internal", "240.240.0.2"),
        address("held.system.internal", "240.240.0.3"),
        scope("held.system.internal", "held"),
    ]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookups_of_scoped_names_are_reported_on_every_path() {
    let recorder = Arc::new(Recorder::default());
    let server = Server::start_with(names(), |_| {}, Some(recorder.clone())).await;
    for (args, reported) in [
        // The fast path (UDP and TCP), the general path (AAAA: NODATA; SRV), a search-suffixed
        // name (CNAME to the mesh name).
        (
            vec!["+notcp", "buzz.bar.foo.system.internal", "A"],
            vec!["buzz"],
        ),
        (
            vec!["+tcp", "buzz.bar.foo.system.internal", "A"],
            vec!["buzz"],
        ),
        (vec!["buzz.bar.foo.system.internal", "AAAA"], vec!["buzz"]),
        (
            vec!["_http._tcp.buzz.bar.foo.system.internal", "SRV"],
            vec!["buzz"],
        ),
        (
            vec![
                "buzz.bar.foo.system.internal.default.svc.cluster.local",
                "A",
            ],
            vec!["buzz"],
        ),
        // No scope, no such name, or no answer (another class): nothing reported.
        (vec!["plain.system.internal", "A"], vec![]),
        (vec!["nope.system.internal", "A"], vec![]),
        (
            vec!["-c", "CH", "buzz.bar.foo.system.internal", "A"],
            vec![],
        ),
    ] {
        let d = dig(server.addr, &args).await;
        let status = if args.contains(&"nope.system.internal") {
            "NXDOMAIN"
        } else if args.contains(&"CH") {
            "REFUSED"
        } else {
            "NOERROR"
        };
        assert_eq!(d.status(), status, "{args:?}: {}", d.text);
        assert_eq!(recorder.take(), reported, "{args:?}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_answer_waits_for_its_hold_and_others_are_answered_meanwhile() {
    let recorder = Arc::new(Recorder::default());
    // One UDP socket: with several, the kernel may give the other client's query to another
    // socket, and a socket stuck waiting for a hold would go unnoticed.
    let server = Server::start_with(names(), |c| c.udp_sockets = 1, Some(recorder.clone())).await;
    let other = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
    for transport in ["+notcp", "+tcp"] {
        let addr = server.addr;
        let mut held = tokio::spawn(async move {
            dig(addr, &[transport, "+time=10", "held.system.internal", "A"]).await
        });
        // Reported, so the answer is being held.
        common::eventually(Duration::from_secs(5), || async {
            recorder
                .seen
                .lock()
                .unwrap()
                .iter()
                .any(|(_, s)| s == "held")
        })
        .await;
        assert!(
            tokio::time::timeout(Duration::from_millis(300), &mut held)
                .await
                .is_err(),
            "{transport}: the held answer went out before its hold ended"
        );
        // Another client's query goes through meanwhile, on the same socket.
        let d = dig(
            server.addr,
            &[
                "-b",
                "127.0.0.2",
                transport,
                "buzz.bar.foo.system.internal",
                "A",
            ],
        )
        .await;
        assert_eq!(d.status(), "NOERROR", "{transport}: {}", d.text);
        assert!(
            !held.is_finished(),
            "{transport}: the held answer went out before its hold ended"
        );
        recorder.release.notify_one();
        let d = tokio::time::timeout(Duration::from_secs(5), held)
            .await
            .expect("the held answer goes out once its hold ends")
            .unwrap();
        assert_eq!(d.status(), "NOERROR", "{transport}: {}", d.text);
        assert!(d.text.contains("240.240.0.3"), "{}", d.text);
        // Each reported with its own client.
        assert_eq!(
            recorder.take_with_clients(),
            vec![
                (IpAddr::V4(Ipv4Addr::LOCALHOST), "held".to_string()),
                (other, "buzz".to_string()),
            ],
            "{transport}"
        );
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipv4_client_of_a_dual_stack_server_is_reported_by_its_ipv4_address() {
    let recorder = Arc::new(Recorder::default());
    let server = Server::start_with(
        names(),
        |c| c.listen = "[::]:0".parse().unwrap(),
        Some(recorder.clone()),
    )
    .await;
    // The sockets see ::ffff:127.0.0.1; the observer must be told 127.0.0.1, the pod's address.
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, server.addr.port()));
    for transport in ["+notcp", "+tcp"] {
        // The fast path (A) and the general path (AAAA).
        for qtype in ["A", "AAAA"] {
            let d = dig(addr, &[transport, "buzz.bar.foo.system.internal", qtype]).await;
            assert_eq!(d.status(), "NOERROR", "{transport} {qtype}: {}", d.text);
            assert_eq!(recorder.take(), vec!["buzz"], "{transport} {qtype}");
        }
    }
    server.stop().await;
}
