//! DNS keeps answering while a large translation runs. The real agent starts on a mesh file of
//! 10,000 services with one runtime worker thread (`TOKIO_WORKER_THREADS=1`), so that anything
//! run on the runtime would hold the DNS server too. From the moment its DNS socket answers, a
//! client asks a mesh name over and over, each query waiting up to a second, until the name
//! resolves (the first translation is published); then the file is replaced by 10,000 other
//! services and the client asks one of the new names until it resolves (the edit is read,
//! merged and translated). Every query is answered, before the name exists (the agent says it
//! has no such name) and after: the parsing, the merge and the translation ran off the runtime.
//! The benchmark (`cargo xtask bench --only translate`) measures what it costs in latency.
//!
//! Build the binaries first: `cargo build --workspace --bins`.

use std::net::{Ipv4Addr, UdpSocket};
use std::time::{Duration, Instant};

use lattice_e2e::agent::{Agent, log_field};

const SERVICES: usize = 10_000;
const SHARED: Ipv4Addr = Ipv4Addr::new(240, 240, 0, 1);
/// An unanswered query: a second is what a stub resolver typically waits before retrying.
const ANSWER_WITHIN: Duration = Duration::from_secs(1);

fn query(id: u16, name: &str) -> Vec<u8> {
    let mut packet = id.to_be_bytes().to_vec();
    // Recursion desired, one question.
    packet.extend([0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.split('.') {
        packet.push(u8::try_from(label.len()).unwrap());
        packet.extend(label.as_bytes());
    }
    packet.extend([0, 0, 1, 0, 1]);
    packet
}

/// What a reply says: its rcode and, for an answer, the last A record's address.
fn read_reply(id: u16, reply: &[u8]) -> Option<(u8, Option<Ipv4Addr>)> {
    if reply.len() < 12 || reply[..2] != id.to_be_bytes() {
        return None;
    }
    let rcode = reply[3] & 0x0f;
    let answers = u16::from_be_bytes([reply[6], reply[7]]);
    let tail: [u8; 4] = reply[reply.len() - 4..].try_into().ok()?;
    Some((rcode, (answers > 0).then(|| Ipv4Addr::from(tail))))
}

/// A mesh file of `SERVICES` HTTP services under `/<namespace>/`, written whole at once.
fn write_mesh(path: &std::path::Path, namespace: &str) {
    let mut text = String::from("services:\n");
    for i in 0..SERVICES {
        text.push_str(&format!(
            "  - path: /{namespace}/s{i}\n    ports:\n      - {{port: 8080, protocol: http}}\n    endpoints:\n      - address: 10.0.{}.{}\n",
            i / 250,
            i % 250 + 1
        ));
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// What a client saw while asking for a name until it resolved.
struct Asked {
    /// Queries answered without an address (no such name yet).
    answered_before: usize,
    /// Queries not answered within [`ANSWER_WITHIN`].
    unanswered: Vec<String>,
}

/// Asks `name` over and over, one query at a time, until it resolves to [`SHARED`].
fn ask_until_served(agent: &Agent, socket: &UdpSocket, name: &str, first_id: u16) -> Asked {
    let started = Instant::now();
    let mut asked = Asked {
        answered_before: 0,
        unanswered: Vec::new(),
    };
    let mut id = first_id;
    let mut buf = [0u8; 512];
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the agent never served {name}; log:\n{}",
            agent.log()
        );
        id = id.wrapping_add(1);
        socket.send(&query(id, name)).unwrap();
        let sent = Instant::now();
        let reply = loop {
            match socket.recv(&mut buf) {
                Ok(len) => match read_reply(id, &buf[..len]) {
                    Some(reply) => break Ok(reply),
                    // A late answer to an earlier query: keep waiting for this one.
                    None => continue,
                },
                Err(err) => break Err(err),
            }
        };
        match reply {
            Ok((_, Some(address))) => {
                assert_eq!(address, SHARED, "{name}");
                return asked;
            }
            Ok((_, None)) => asked.answered_before += 1,
            // Not bound yet: the agent is still reading its mesh file.
            Err(err)
                if err.kind() == std::io::ErrorKind::ConnectionRefused
                    && asked.answered_before == 0 =>
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(err) => asked.unanswered.push(format!(
                "{name} query {id} at {:?}: {err} after {:?}",
                sent.duration_since(started),
                sent.elapsed()
            )),
        }
    }
}

/// The `translate_ms` of the `nth` "serving mesh snapshot" line, once it is logged.
fn translate_ms(agent: &Agent, nth: usize) -> String {
    let line = lattice_e2e::wait::until(
        "the translation's log line",
        Duration::from_secs(10),
        || {
            agent
                .log()
                .lines()
                .filter(|l| l.contains("serving mesh snapshot"))
                .nth(nth)
                .map(str::to_string)
                .ok_or_else(|| "not yet".to_string())
        },
    )
    .unwrap();
    log_field(&line, "translate_ms").unwrap_or_else(|| "?".into())
}

#[test]
fn dns_answers_every_query_while_ten_thousand_services_are_translated() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = dir.path().join("mesh.yaml");
    write_mesh(&mesh, "t");
    let agent = Agent::start_with_env(
        &["--mesh-file", mesh.to_str().unwrap()],
        &[("TOKIO_WORKER_THREADS", "1")],
    );
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    socket.connect(agent.dns).unwrap();
    socket.set_read_timeout(Some(ANSWER_WITHIN)).unwrap();

    // The first snapshot: merged and translated while DNS already answers.
    let first = ask_until_served(&agent, &socket, "s1.t.system.internal", 0);
    let first_ms = translate_ms(&agent, 0);
    println!(
        "start: {} queries answered before the first table, the first translation took \
         {first_ms} ms; unanswered: {}",
        first.answered_before,
        first.unanswered.len()
    );
    // An edit of every service: read from the file, merged and translated.
    write_mesh(&mesh, "u");
    let edit = ask_until_served(&agent, &socket, "s1.u.system.internal", 10_000);
    let edit_ms = translate_ms(&agent, 1);
    println!(
        "edit: {} queries answered before the new names, their translation took {edit_ms} ms; \
         unanswered: {}",
        edit.answered_before,
        edit.unanswered.len()
    );

    assert!(
        first.answered_before > 0 && edit.answered_before > 0,
        "no query was asked before a table was published: the test proved nothing"
    );
    assert!(
        first.unanswered.is_empty() && edit.unanswered.is_empty(),
        "queries went unanswered during the translations ({first_ms} ms, {edit_ms} ms): {:?}",
        [first.unanswered, edit.unanswered].concat()
    );
}
