//! Wire conformance: EDNS echo, truncation, malformed input, opcodes, and surviving garbage.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{Server, dig, kdig};
use rand::{Rng, SeedableRng};
use tokio::net::UdpSocket;

fn mesh() -> Vec<(String, String)> {
    let mut mesh = vec![(
        "buzz.bar.foo.system.internal".to_string(),
        "240.240.0.1".to_string(),
    )];
    // 60 A records: about 1 kB, over 512 bytes but under 1232.
    mesh.extend((0..60).map(|i| ("wide.system.internal".to_string(), format!("240.240.1.{i}"))));
    mesh
}

async fn start() -> Server {
    let mesh = mesh();
    let entries: Vec<(&str, &str)> = mesh.iter().map(|(n, a)| (n.as_str(), a.as_str())).collect();
    Server::start(&entries, |_| {}).await
}

/// Sends raw bytes over UDP and returns the reply, if one comes within 500 ms.
async fn raw_query(addr: SocketAddr, bytes: &[u8]) -> Option<Vec<u8>> {
    let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    socket.send_to(bytes, addr).await.unwrap();
    let mut buf = vec![0; 65535];
    let (len, _) = tokio::time::timeout(Duration::from_millis(500), socket.recv_from(&mut buf))
        .await
        .ok()?
        .unwrap();
    Some(buf[..len].to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edns_opt_is_echoed_with_the_do_bit_and_absent_without_edns() {
    let server = start().await;
    let d = dig(server.addr, &["buzz.bar.foo.system.internal"]).await;
    assert_eq!(
        d.opt(),
        Some("; EDNS: version: 0, flags:; udp: 1232"),
        "{}",
        d.text
    );
    let d = dig(server.addr, &["+dnssec", "nope.system.internal"]).await;
    assert_eq!(
        d.opt(),
        Some("; EDNS: version: 0, flags: do; udp: 1232"),
        "{}",
        d.text
    );
    let d = dig(server.addr, &["+noedns", "buzz.bar.foo.system.internal"]).await;
    assert_eq!(d.opt(), None, "{}", d.text);
    let d = dig(
        server.addr,
        &[
            "+edns=1",
            "+noednsnegotiation",
            "buzz.bar.foo.system.internal",
        ],
    )
    .await;
    assert_eq!(d.status(), "BADVERS", "{}", d.text);
    assert!(
        d.opt().is_some_and(|o| o.contains("version: 0")),
        "{}",
        d.text
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_answers_over_the_client_limit_are_truncated() {
    let server = start().await;
    // Plain DNS: 512 bytes, so 60 A records do not fit.
    let d = dig(server.addr, &["+noedns", "+ignore", "wide.system.internal"]).await;
    assert!(d.flags().contains(&"tc"), "{}", d.text);
    assert!(d.answers().is_empty(), "{}", d.text);
    // dig then retries over TCP and gets everything.
    let d = dig(server.addr, &["+noedns", "wide.system.internal"]).await;
    assert_eq!(d.answers().len(), 60, "{}", d.text);
    // With EDNS (1232 bytes) it fits over UDP.
    let d = kdig(
        server.addr,
        &["+notcp", "+bufsize=1232", "+ignore", "wide.system.internal"],
    )
    .await;
    let flags = d
        .text
        .lines()
        .find(|l| l.starts_with(";; Flags:"))
        .expect("kdig prints flags");
    assert!(
        flags.contains(" qr") && !flags.contains(" tc"),
        "{}",
        d.text
    );
    assert_eq!(d.text.matches("240.240.1.").count(), 60, "{}", d.text);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_opcodes_get_notimp() {
    let server = start().await;
    let d = dig(server.addr, &["+opcode=2", "buzz.bar.foo.system.internal"]).await;
    assert_eq!(d.status(), "NOTIMP", "{}", d.text);
    let d = dig(
        server.addr,
        &["+opcode=4", "+tcp", "buzz.bar.foo.system.internal"],
    )
    .await;
    assert_eq!(d.status(), "NOTIMP", "{}", d.text);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_queries_get_formerr_or_are_dropped() {
    let server = start().await;
    // No question at all.
    let d = dig(
        server.addr,
        &["+header-only", "buzz.bar.foo.system.internal"],
    )
    .await;
    assert_eq!(d.status(), "FORMERR", "{}", d.text);
    // The header promises a question that is cut short.
    let truncated = [
        0xab, 0xcd, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0, 4, b'b', b'u',
    ];
    let reply = raw_query(server.addr, &truncated)
        .await
        .expect("a FORMERR reply");
    assert_eq!(&reply[..2], &[0xab, 0xcd], "the id is echoed");
    assert_eq!(reply[2] & 0x80, 0x80, "it is a response");
    assert_eq!(reply[3] & 0x0f, 1, "FORMERR");
    // Too short to carry an id, or a response: nothing to answer.
    assert!(raw_query(server.addr, &[1, 2, 3]).await.is_none());
    let mut response = truncated;
    response[2] |= 0x80;
    assert!(raw_query(server.addr, &response).await.is_none());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn still_answers_after_a_burst_of_random_bytes() {
    let server = start().await;
    let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(53);
    for i in 0..5_000 {
        let len = rng.random_range(0..600);
        let mut bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        // Half of them look like queries, to get past the first checks.
        if i % 2 == 0 && bytes.len() > 3 {
            bytes[2] &= 0x07;
        }
        socket.send_to(&bytes, server.addr).await.unwrap();
    }
    // The same over TCP: garbage then a hang-up.
    for _ in 0..20 {
        use tokio::io::AsyncWriteExt;
        let mut stream = tokio::net::TcpStream::connect(server.addr).await.unwrap();
        let bytes: Vec<u8> = (0..rng.random_range(0..300))
            .map(|_| rng.random())
            .collect();
        let _ = stream.write_all(&bytes).await;
    }
    for transport in ["+notcp", "+tcp"] {
        let d = dig(server.addr, &[transport, "buzz.bar.foo.system.internal"]).await;
        assert_eq!(d.answers()[0][4], "240.240.0.1", "{}", d.text);
    }
    server.stop().await;
}
