//! The agent's DNS, end to end: the real `lattice-agent` driven by a mesh file, asked by the
//! real `dig`. Names follow the mesh live; other names go to the configured upstream (a tiny
//! server this test runs on loopback, never the machine's resolver).

use std::net::UdpSocket;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lattice_e2e::agent::Agent;
use lattice_e2e::wait;

fn dig(agent: &Agent, name: &str) -> String {
    let out = lattice_e2e::dig::command()
        .args([
            &format!("@{}", agent.dns.ip()),
            "-p",
            &agent.dns.port().to_string(),
            "+tries=1",
            "+time=1",
            name,
        ])
        .output()
        .expect("run dig");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn answer(output: &str) -> Option<String> {
    output
        .lines()
        .skip_while(|l| !l.starts_with(";; ANSWER SECTION"))
        .nth(1)
        .and_then(|l| l.split_whitespace().last())
        .map(str::to_string)
}

fn write(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

const MESH: &str = "services:
  - path: /foo/bar/buzz
    ports: [{port: 8080, protocol: http}]
    endpoints: [{address: 10.200.0.3}]
  - path: /foo/db
    ports: [{port: 5432, protocol: tcp}]
    endpoints: [{address: 10.200.0.9}]
";

/// Answers every query with NXDOMAIN and counts them: enough to see forwarding happen.
fn nxdomain_upstream() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = socket.local_addr().unwrap();
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = seen.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 1500];
        while let Ok((n, from)) = socket.recv_from(&mut buf) {
            if n < 12 {
                continue;
            }
            counter.fetch_add(1, Ordering::SeqCst);
            let mut reply = buf[..n].to_vec();
            reply[2] |= 0x80; // QR
            reply[3] = (reply[3] & 0xf0) | 3; // NXDOMAIN
            reply[6..12].fill(0); // no answer, authority or additional records
            reply[10..12].copy_from_slice(&[0, 0]);
            // Keep only header and question (drop the client's OPT record).
            let question_end = 12 + question_len(&reply[12..]);
            reply.truncate(question_end);
            let _ = socket.send_to(&reply, from);
        }
    });
    (addr, seen)
}

fn question_len(q: &[u8]) -> usize {
    let mut i = 0;
    while i < q.len() && q[i] != 0 {
        i += usize::from(q[i]) + 1;
    }
    (i + 5).min(q.len())
}

#[test]
fn mesh_names_resolve_follow_the_mesh_file_and_the_rest_is_forwarded() {
    let dir = tempfile::tempdir().unwrap();
    let mesh = dir.path().join("mesh.yaml");
    write(&mesh, MESH);
    let (upstream, forwarded) = nxdomain_upstream();
    let agent = Agent::start(&[
        "--mesh-file",
        mesh.to_str().unwrap(),
        &format!("--upstream-dns={upstream}"),
    ]);
    agent.wait_ready().unwrap();

    // HTTP services share the block's first address; a TCP service has its own.
    wait::until("buzz to resolve", Duration::from_secs(5), || {
        let out = dig(&agent, "buzz.bar.foo.system.internal");
        (answer(&out).as_deref() == Some("240.240.0.1"))
            .then_some(())
            .ok_or(out)
    })
    .unwrap();
    let db: std::net::Ipv4Addr = answer(&dig(&agent, "db.foo.system.internal"))
        .and_then(|a| a.parse().ok())
        .expect("db resolves to an address");
    assert!(
        db.octets()[..2] == [240, 240] && db != std::net::Ipv4Addr::new(240, 240, 0, 1),
        "db has an address of its own in the block: {db}"
    );
    assert!(dig(&agent, "nope.foo.system.internal").contains("status: NXDOMAIN"));

    // Live: a new service resolves within a second, a removed one is NXDOMAIN within a second.
    write(
        &mesh,
        &format!("{MESH}  - path: /foo/new\n    ports: [{{port: 80, protocol: http}}]\n"),
    );
    wait::until("new service to resolve", Duration::from_secs(1), || {
        let out = dig(&agent, "new.foo.system.internal");
        (answer(&out).as_deref() == Some("240.240.0.1"))
            .then_some(())
            .ok_or(out)
    })
    .unwrap();
    write(
        &mesh,
        "services:\n  - path: /foo/new\n    ports: [{port: 80, protocol: http}]\n",
    );
    wait::until(
        "removed service to be NXDOMAIN",
        Duration::from_secs(1),
        || {
            let out = dig(&agent, "buzz.bar.foo.system.internal");
            out.contains("status: NXDOMAIN").then_some(()).ok_or(out)
        },
    )
    .unwrap();

    // Everything else goes to --upstream-dns, and its NXDOMAIN comes back.
    assert_eq!(
        forwarded.load(Ordering::SeqCst),
        0,
        "mesh names must not be forwarded"
    );
    let out = dig(&agent, "example.org");
    assert!(out.contains("status: NXDOMAIN"), "{out}");
    assert!(
        forwarded.load(Ordering::SeqCst) >= 1,
        "example.org was not forwarded"
    );
}
