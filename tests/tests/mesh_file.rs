//! The mesh file against what an operator's tools and a hostile edit do to it, through the real
//! agent binary: hostile YAML refused with the limit it broke while the last good mesh serves;
//! SIGTERM honoured in the middle of a long parse; and following that survives the directory
//! being removed and made again, a ConfigMap's symlink swap, the file replaced by a symlink to
//! another directory, and the file deleted and written again, each followed by an edit that
//! reaches `/debug/mesh`; a file that cannot be followed is reported stale, then recovers; a
//! restart takes an unchanged file from its copy in the state directory, and never the copy
//! of a file edited meanwhile.
//!
//! Build the binaries first: `cargo build --workspace --bins`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lattice_e2e::agent::Agent;
use lattice_e2e::wait;

/// A mesh of one service, named `name`.
fn mesh(name: &str) -> String {
    format!("services:\n  - path: /files/{name}\n    ports:\n      - port: 80\n")
}

/// The services `/debug/mesh` shows.
fn services(agent: &Agent) -> Result<Vec<String>, String> {
    let mesh = agent.mesh().map_err(|e| e.to_string())?;
    Ok(mesh["services"]
        .as_object()
        .map(|s| s.keys().cloned().collect())
        .unwrap_or_default())
}

/// Why the file's provider is stale, if it is.
fn stale(agent: &Agent) -> Result<Option<String>, String> {
    let mesh = agent.mesh().map_err(|e| e.to_string())?;
    Ok(mesh["providers"][0]["stale"]["reason"]
        .as_str()
        .map(str::to_string))
}

fn wait_for_service(agent: &Agent, name: &str) {
    let path = format!("/files/{name}");
    wait::until(
        &format!("{path} on /debug/mesh"),
        Duration::from_secs(20),
        || {
            let seen = services(agent)?;
            if seen == [path.clone()] && stale(agent)?.is_none() {
                Ok(())
            } else {
                Err(format!("{seen:?}, stale: {:?}", stale(agent)))
            }
        },
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
}

fn wait_for_stale(agent: &Agent, expected: &str) -> String {
    wait::until(
        &format!("the provider stale with {expected:?}"),
        Duration::from_secs(20),
        || match stale(agent)? {
            Some(reason) if reason.contains(expected) => Ok(reason),
            other => Err(format!("{other:?}")),
        },
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()))
}

/// Writes `text` to `path` as editors do: a new file renamed over the old.
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn agent(path: &Path, extra: &[&str]) -> Agent {
    let file = path.to_string_lossy().into_owned();
    let mut args = vec!["--mesh-file", file.as_str()];
    args.extend_from_slice(extra);
    let agent = Agent::start(&args);
    agent.wait_ready().unwrap();
    agent
}

#[test]
fn hostile_files_are_refused_and_the_last_good_mesh_serves() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mesh.yaml");
    std::fs::write(&path, mesh("good")).unwrap();
    let agent = agent(&path, &[]);
    wait_for_service(&agent, "good");

    // 10 MB of nesting, 5M levels.
    let levels = 5_000_000;
    let deep = format!("services: {}{}\n", "[".repeat(levels), "]".repeat(levels));
    replace(&path, &deep);
    wait_for_stale(
        &agent,
        "nested deeper than 64 levels (--mesh-file-max-depth)",
    );
    assert_eq!(services(&agent).unwrap(), ["/files/good"]);

    // A billion laughs: ten levels of ten aliases each, a few hundred bytes.
    let mut bomb = String::from("a0: &a0 [lol]\n");
    for level in 1..10 {
        let refs = vec![format!("*a{}", level - 1); 10].join(", ");
        bomb.push_str(&format!("a{level}: &a{level} [{refs}]\n"));
    }
    bomb.push_str("services: *a9\n");
    replace(&path, &bomb);
    wait_for_stale(
        &agent,
        "YAML nodes, each alias counting the nodes of its anchor",
    );

    // Past the size limit (1 MiB here): refused before it is read whole.
    let agent_small = {
        let small = dir.path().join("small.yaml");
        std::fs::write(&small, mesh("small")).unwrap();
        let agent = self::agent(&small, &["--mesh-file-max-mib", "1"]);
        let mut large = mesh("small");
        large.push_str(&format!("# {}\n", "x".repeat(2 << 20)));
        replace(&small, &large);
        wait_for_stale(&agent, "larger than the 1048576 bytes");
        assert_eq!(services(&agent).unwrap(), ["/files/small"]);
        agent
    };
    drop(agent_small);

    // A good edit after them all is applied, and the provider is fresh again.
    replace(&path, &mesh("better"));
    wait_for_service(&agent, "better");
}

/// Field `n` (numbered from 1, as in proc(5)) of the `stat` of the agent's thread named `name`.
fn thread_stat(pid: u32, name: &str, n: usize) -> Option<u64> {
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let task = task.ok()?.path();
        let comm = std::fs::read_to_string(task.join("comm")).unwrap_or_default();
        // The kernel keeps a thread's name to 15 bytes.
        if comm.trim() != &name[..name.len().min(15)] {
            continue;
        }
        let stat = std::fs::read_to_string(task.join("stat")).ok()?;
        // Fields after the command's closing parenthesis, the second, start at the third.
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        return fields.get(n.checked_sub(3)?)?.parse().ok();
    }
    None
}

/// The agent's thread named `name`: its CPU time (user and system ticks).
fn thread_ticks(pid: u32, name: &str) -> Option<u64> {
    Some(thread_stat(pid, name, 14)? + thread_stat(pid, name, 15)?)
}

/// Once the agent serves, the threads its start waited on (merging, translating) run at
/// `SCHED_IDLE`, behind the threads that serve DNS and xDS: a later translation must not
/// delay a query.
#[test]
fn once_the_agent_serves_its_bulk_threads_yield_to_serving() {
    /// `SCHED_IDLE` in `stat`'s `policy` field (the 41st).
    const SCHED_IDLE: u64 = 5;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mesh.yaml");
    std::fs::write(&path, mesh("idle")).unwrap();
    let agent = agent(&path, &[]);
    let pid = agent.pid().unwrap();
    wait::until(
        "the merging and translating threads at SCHED_IDLE",
        Duration::from_secs(10),
        || {
            let policies = ["lattice-merge", "lattice-translate"]
                .map(|name| (name, thread_stat(pid, name, 41)));
            if policies
                .iter()
                .all(|(_, policy)| *policy == Some(SCHED_IDLE))
            {
                Ok(())
            } else {
                Err(format!("{policies:?}"))
            }
        },
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
}

#[test]
fn sigterm_during_a_long_parse_exits_promptly() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mesh.yaml");
    std::fs::write(&path, mesh("good")).unwrap();
    // Limits raised so far that a deep document goes to the parser: 100k levels of flow
    // nesting take it tens of seconds.
    let mut agent = agent(
        &path,
        &[
            "--mesh-file-max-depth",
            "1000000",
            "--mesh-file-max-nodes",
            "100000000",
        ],
    );
    wait_for_service(&agent, "good");
    let pid = agent.pid().unwrap();
    let before = thread_ticks(pid, "mesh-file").unwrap_or(0);
    let levels = 100_000;
    replace(
        &path,
        &format!("services: {}{}\n", "[".repeat(levels), "]".repeat(levels)),
    );
    // The parse is under way once the file's thread has spent a second of CPU on it.
    let ticks_per_second = 100;
    wait::until(
        "the parse under way",
        Duration::from_secs(20),
        || match thread_ticks(pid, "mesh-file") {
            Some(now) if now >= before + ticks_per_second => Ok(()),
            other => Err(format!("{other:?} ticks")),
        },
    )
    .unwrap();
    let asked = Instant::now();
    let status = agent.terminate().unwrap();
    let took = asked.elapsed();
    println!("exit {took:?} after SIGTERM, mid-parse");
    assert!(status.success(), "{status:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    let log = agent.log();
    assert!(
        !log.contains("mesh file edit rejected") && !log.contains("mesh file changed"),
        "the parse had finished before the exit, the test proves nothing:\n{log}"
    );
}

#[test]
fn the_directory_removed_and_made_again_is_followed_and_reported_meanwhile() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("config");
    std::fs::create_dir(&dir).unwrap();
    let path = dir.join("mesh.yaml");
    std::fs::write(&path, mesh("one")).unwrap();
    let agent = agent(&path, &[]);
    wait_for_service(&agent, "one");

    std::fs::remove_dir_all(&dir).unwrap();
    let reason = wait_for_stale(&agent, "does not exist");
    println!("stale: {reason}");
    assert_eq!(
        services(&agent).unwrap(),
        ["/files/one"],
        "the last good mesh serves"
    );

    std::fs::create_dir(&dir).unwrap();
    std::fs::write(&path, mesh("two")).unwrap();
    wait_for_service(&agent, "two");
    // And edits after it.
    replace(&path, &mesh("three"));
    wait_for_service(&agent, "three");
}

/// A ConfigMap volume as kubelet writes it: the keys link into `..data`, which links to a
/// timestamped directory, swapped whole on update.
struct ConfigMapVolume {
    dir: PathBuf,
    version: u32,
}

impl ConfigMapVolume {
    fn new(dir: &Path, text: &str) -> Self {
        let mut volume = ConfigMapVolume {
            dir: dir.to_path_buf(),
            version: 0,
        };
        volume.update(text);
        std::os::unix::fs::symlink("..data/mesh.yaml", dir.join("mesh.yaml")).unwrap();
        volume
    }

    fn update(&mut self, text: &str) {
        let old = format!("..2026_{:02}", self.version);
        self.version += 1;
        let new = format!("..2026_{:02}", self.version);
        std::fs::create_dir(self.dir.join(&new)).unwrap();
        std::fs::write(self.dir.join(&new).join("mesh.yaml"), text).unwrap();
        std::os::unix::fs::symlink(&new, self.dir.join("..data_tmp")).unwrap();
        std::fs::rename(self.dir.join("..data_tmp"), self.dir.join("..data")).unwrap();
        let _ = std::fs::remove_dir_all(self.dir.join(old));
    }
}

#[test]
fn a_configmap_swap_is_followed_every_time() {
    let dir = tempfile::tempdir().unwrap();
    let mut volume = ConfigMapVolume::new(dir.path(), &mesh("one"));
    let agent = agent(&dir.path().join("mesh.yaml"), &[]);
    wait_for_service(&agent, "one");
    for name in ["two", "three", "four"] {
        volume.update(&mesh(name));
        wait_for_service(&agent, name);
    }
}

#[test]
fn a_file_replaced_by_a_symlink_or_deleted_and_written_again_is_followed() {
    let root = tempfile::tempdir().unwrap();
    let here = root.path().join("here");
    let there = root.path().join("there");
    std::fs::create_dir(&here).unwrap();
    std::fs::create_dir(&there).unwrap();
    let path = here.join("mesh.yaml");
    std::fs::write(&path, mesh("one")).unwrap();
    let agent = agent(&path, &[]);
    wait_for_service(&agent, "one");

    // The file replaced by a link to a file in another directory.
    let real = there.join("real.yaml");
    std::fs::write(&real, mesh("two")).unwrap();
    std::os::unix::fs::symlink(&real, here.join("link.tmp")).unwrap();
    std::fs::rename(here.join("link.tmp"), &path).unwrap();
    wait_for_service(&agent, "two");
    // Edits of the linked file, where it is, are followed.
    replace(&real, &mesh("three"));
    wait_for_service(&agent, "three");
    std::fs::write(&real, mesh("four")).unwrap();
    wait_for_service(&agent, "four");

    // The file deleted, then written again.
    std::fs::remove_file(&path).unwrap();
    wait_for_stale(&agent, "cannot read the file");
    std::fs::write(&path, mesh("five")).unwrap();
    wait_for_service(&agent, "five");
}

/// Several files are loaded together, and the agent starts only if every one is good; when
/// some are not, the error names the first of them in the order given, whichever failed first.
#[test]
fn of_several_files_the_first_bad_one_in_the_order_given_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.to_string_lossy().into_owned()
    };
    let one = write("one.yaml", &mesh("one"));
    let two = write("two.yaml", &mesh("two"));
    let unclosed = write("unclosed.yaml", "services: [\n");
    let pathless = write("pathless.yaml", "services:\n  - ports:\n      - port: 80\n");
    let check = |files: &[&str]| {
        let mut command = std::process::Command::new(lattice_e2e::bins::path("lattice-agent"));
        command.arg("--check-config");
        for file in files {
            command.args(["--mesh-file", file]);
        }
        let output = command.output().unwrap();
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        (output.status.success(), said)
    };
    let (ok, said) = check(&[&one, &two]);
    assert!(ok && said.contains("configuration is valid"), "{said}");
    for (files, named, not) in [
        ([&one, &unclosed, &pathless], &unclosed, &pathless),
        ([&one, &pathless, &unclosed], &pathless, &unclosed),
    ] {
        let (ok, said) = check(&files.map(String::as_str));
        assert!(!ok, "{said}");
        // The error the agent exits with (its log echoes every file in its configuration).
        let error = said
            .lines()
            .rfind(|line| line.starts_with("lattice-agent: "))
            .unwrap_or_else(|| panic!("no error line: {said}"));
        assert!(error.contains(named.as_str()), "names {named}: {error}");
        assert!(!error.contains(not.as_str()), "names only {named}: {error}");
    }
}

/// Whether the running agent took its file from the file's copy: `from_copy` on the load it
/// logged, the first in the log, which each start writes again from its beginning.
fn from_copy(agent: &Agent) -> Option<String> {
    let log = agent.log();
    let line = log.lines().find(|line| line.contains("mesh file loaded"))?;
    lattice_e2e::agent::log_field(line, "from_copy")
}

/// Starts `agent` again, waits until it serves `/files/{name}`, and says whether it took the
/// file from its copy.
fn restarted(agent: &mut Agent, name: &str) -> Option<String> {
    agent.restart();
    agent.wait_ready().unwrap();
    wait_for_service(agent, name);
    from_copy(agent)
}

/// Waits until the file's copy holds the text being served.
fn wait_for_copy(agent: &Agent) {
    wait::until("the file's copy", Duration::from_secs(30), || {
        let (_, metrics) = agent.get("/metrics").map_err(|e| e.to_string())?;
        match lattice_e2e::agent::metric_in(&metrics, "lattice_mesh_file_copies_behind") {
            Some(0.0) => Ok(()),
            behind => Err(format!("copies behind: {behind:?}")),
        }
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", agent.log()));
}

/// With a state directory, a restart takes the services of a file that has not changed from
/// the file's copy there (written after a start that read the file, and after an edit), and
/// reads a file edited while the agent was down: the edit is what serves, never the copy of
/// the text before it. The copy of a file the agent is not given any more is removed.
#[test]
fn a_restart_takes_an_unchanged_file_from_its_copy_and_reads_an_edited_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mesh.yaml");
    let state = dir.path().join("state");
    replace(&path, &mesh("first"));
    let state_arg = state.to_string_lossy().into_owned();
    let mut agent = agent(&path, &["--state-dir", &state_arg]);
    wait_for_service(&agent, "first");
    assert_eq!(from_copy(&agent).as_deref(), Some("false"));
    // Written after the start, on the file's own thread.
    wait_for_copy(&agent);
    assert_eq!(restarted(&mut agent, "first").as_deref(), Some("true"));

    // An edit while the agent runs: its copy is written 5 s later, and a restart takes it.
    replace(&path, &mesh("second"));
    wait_for_service(&agent, "second");
    wait_for_copy(&agent);
    assert_eq!(restarted(&mut agent, "second").as_deref(), Some("true"));

    // An edit while the agent is down: the copy is of the text before it, and is not taken.
    agent.kill();
    replace(&path, &mesh("third"));
    assert_eq!(restarted(&mut agent, "third").as_deref(), Some("false"));

    // Given another file, the agent removes the copy of the one it is not given any more.
    let copies = state.join("mesh-files");
    let copies_now = || -> Vec<PathBuf> {
        std::fs::read_dir(&copies)
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .collect()
    };
    let before = copies_now();
    assert_eq!(before.len(), 1, "{before:?}");
    drop(agent);
    let other = dir.path().join("other.yaml");
    replace(&other, &mesh("other"));
    let agent = self::agent(&other, &["--state-dir", &state_arg]);
    wait_for_service(&agent, "other");
    assert!(
        !before[0].exists(),
        "{:?} left: {:?}",
        before[0],
        copies_now()
    );
}
