//! The mesh file's part of `cargo xtask bench --only hostile`: the real agent (release; debug for a smoke run)
//! following a mesh file that is replaced by hostile YAML of 10 MB, beside an honest edit in
//! the same run:
//!
//! - **refusal**: from the rename of the hostile file into place to the provider showing the
//!   limit it broke on `/debug/mesh` (polled every 5 ms), for 5M levels of flow nesting, a
//!   "billion laughs" alias bomb, and 5M one-character scalars; the honest edit is timed the
//!   same way, to the new service on `/debug/mesh`;
//! - **SIGTERM mid-parse**: limits raised so that 100k levels of nesting reach the YAML parser
//!   (tens of seconds), SIGTERM once the file's thread has spent a second on it, and the time
//!   to the process's exit.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};

use lattice_e2e::agent::Agent;
use serde_json::{Value, json};

fn mesh(name: &str) -> String {
    format!("services:\n  - path: /bench/{name}\n    ports:\n      - port: 80\n")
}

fn replace(path: &Path, text: &str) -> anyhow::Result<Instant> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    let at = Instant::now();
    std::fs::rename(&tmp, path)?;
    Ok(at)
}

/// Polls `/debug/mesh` until `done` holds; the time since `from`.
fn until(agent: &Agent, from: Instant, done: impl Fn(&Value) -> bool) -> anyhow::Result<f64> {
    let deadline = from + Duration::from_secs(60);
    loop {
        if let Ok(mesh) = agent.mesh()
            && done(&mesh)
        {
            return Ok(from.elapsed().as_secs_f64() * 1000.0);
        }
        ensure!(Instant::now() < deadline, "no answer in 60 s");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn stale_with(expected: &'static str) -> impl Fn(&Value) -> bool {
    move |mesh| {
        mesh["providers"][0]["stale"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains(expected))
    }
}

fn serving(name: &str) -> impl Fn(&Value) -> bool {
    let path = format!("/bench/{name}");
    move |mesh| mesh["services"].get(&path).is_some() && mesh["providers"][0]["stale"].is_null()
}

fn thread_ticks(pid: u32, name: &str) -> Option<u64> {
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let task = task.ok()?.path();
        if std::fs::read_to_string(task.join("comm")).ok()?.trim() != name {
            continue;
        }
        let stat = std::fs::read_to_string(task.join("stat")).ok()?;
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let ticks = |i: usize| fields.get(i - 3)?.parse::<u64>().ok();
        return Some(ticks(14)? + ticks(15)?);
    }
    None
}

pub fn run(smoke: bool) -> anyhow::Result<Value> {
    let binary = xtask::built_executable("lattice-agent", !smoke)?;
    let work = crate::WorkDir::new("hostile-file")?;
    let path = work.path().join("mesh.yaml");
    std::fs::write(&path, mesh("start"))?;
    let file = path.to_string_lossy().into_owned();
    let agent = Agent::start_binary(&binary, &["--mesh-file", &file]);
    agent.wait_ready()?;

    let mut report = serde_json::Map::new();
    let honest = until(&agent, replace(&path, &mesh("honest"))?, serving("honest"))?;
    report.insert("honest_edit_ms".into(), json!(honest));

    let levels = 5_000_000;
    let deep = format!("services: {}{}\n", "[".repeat(levels), "]".repeat(levels));
    let mut bomb = String::from("a0: &a0 [lol]\n");
    for level in 1..10 {
        let refs = vec![format!("*a{}", level - 1); 10].join(", ");
        bomb.push_str(&format!("a{level}: &a{level} [{refs}]\n"));
    }
    bomb.push_str("services: *a9\n");
    let flood = format!("services: [{}]\n", vec!["1"; 5_000_000].join(","));
    let cases: [(&str, &String, &'static str); 3] = [
        ("deep_nesting_10mb", &deep, "nested deeper than"),
        ("alias_bomb", &bomb, "each alias counting"),
        ("flood_10mb", &flood, "YAML nodes"),
    ];
    for (name, text, expected) in cases {
        let took = until(&agent, replace(&path, text)?, stale_with(expected))?;
        eprintln!(
            "xtask: hostile-file {name} ({} bytes) refused in {took:.1} ms",
            text.len()
        );
        report.insert(
            format!("{name}_refused_ms"),
            json!({"ms": took, "bytes": text.len(), "vs_honest_edit": took / honest}),
        );
        // Back to a good file between cases.
        let label = name.replace('_', "-");
        until(&agent, replace(&path, &mesh(&label))?, serving(&label))?;
    }
    drop(agent);

    // SIGTERM while the parser works through 100k levels.
    std::fs::write(&path, mesh("start"))?;
    let mut agent = Agent::start_binary(
        &binary,
        &[
            "--mesh-file",
            &file,
            "--mesh-file-max-depth",
            "1000000",
            "--mesh-file-max-nodes",
            "100000000",
        ],
    );
    agent.wait_ready()?;
    let pid = agent.pid().context("the agent is not running")?;
    let before = thread_ticks(pid, "mesh-file").unwrap_or(0);
    let levels = 100_000;
    replace(
        &path,
        &format!("services: {}{}\n", "[".repeat(levels), "]".repeat(levels)),
    )?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while thread_ticks(pid, "mesh-file").unwrap_or(0) < before + 100 {
        ensure!(Instant::now() < deadline, "the parse never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    let asked = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid)?),
        nix::sys::signal::Signal::SIGTERM,
    )?;
    let status = loop {
        if let Some(status) = agent.exited() {
            break status;
        }
        ensure!(
            asked.elapsed() < Duration::from_secs(60),
            "no exit 60 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(2));
    };
    let exit_ms = asked.elapsed().as_secs_f64() * 1000.0;
    ensure!(status.success(), "the agent exited with {status:?}");
    eprintln!("xtask: hostile-file SIGTERM mid-parse: exit in {exit_ms:.1} ms");
    report.insert("sigterm_mid_parse_exit_ms".into(), json!(exit_ms));
    Ok(Value::Object(report))
}
