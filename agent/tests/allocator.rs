//! The agent runs on jemalloc with the options `main.rs` gives it: a background thread that
//! returns freed memory to the system within about a second. jemalloc prints the options in
//! effect when `stats_print` is on, which the environment can add without replacing the rest.

use std::process::Command;

#[test]
fn the_agent_runs_on_jemalloc_with_its_decay_options() {
    let out = Command::new(env!("CARGO_BIN_EXE_lattice-agent"))
        .arg("--help")
        .env("_RJEM_MALLOC_CONF", "stats_print:true")
        .output()
        .expect("run lattice-agent --help");
    assert!(out.status.success());
    let stats = String::from_utf8_lossy(&out.stderr);
    for option in [
        "opt.background_thread: true",
        "opt.dirty_decay_ms: 1000",
        "opt.muzzy_decay_ms: 0",
    ] {
        assert!(
            stats.contains(option),
            "{option} not in jemalloc's statistics:\n{stats:.2000}"
        );
    }
}
