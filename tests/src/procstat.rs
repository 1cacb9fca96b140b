//! A process's memory and CPU as the kernel reports them (`/proc/<pid>/status` and `stat`), for
//! the benchmarks' figures.

/// USER_HZ: the unit of utime and stime in /proc/<pid>/stat, 100 on Linux.
const TICKS_PER_SECOND: f64 = 100.0;

/// A size field of /proc/<pid>/status (`VmRSS:`, `VmHWM:`), in MiB.
pub fn status_mib(pid: u32, field: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

/// The resident set (`VmRSS`), in MiB.
pub fn rss_mib(pid: u32) -> Option<f64> {
    status_mib(pid, "VmRSS:")
}

/// The most the resident set has been since the process started (`VmHWM`), in MiB.
pub fn peak_rss_mib(pid: u32) -> Option<f64> {
    status_mib(pid, "VmHWM:")
}

/// The fields of /proc/<pid>/stat after the command name (which may hold spaces): field 3
/// (state) first.
pub fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(
        stat.rsplit_once(')')?
            .1
            .split_whitespace()
            .map(str::to_string)
            .collect(),
    )
}

/// utime + stime of a process, in seconds.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let fields = stat_fields(pid)?;
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / TICKS_PER_SECOND)
}

/// Whether a child process runs (it stays a zombie until waited for).
pub fn running(pid: u32) -> bool {
    stat_fields(pid).is_some_and(|f| f.first().is_some_and(|state| state != "Z"))
}

/// The attackers' nice value (`LATTICE_BENCH_HOSTILE_NICE`, 19 by default): a hostile pod
/// that asks for no CPU (BestEffort) gets the kubelet's lowest CPU weight beside the agent's
/// request, which is what nice 19 is to the agent's threads on this machine. 0 lets the
/// attackers' own CPU compete with the agent and Envoy as equals.
pub fn attackers_nice() -> i32 {
    std::env::var("LATTICE_BENCH_HOSTILE_NICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(19)
}

/// Sets the calling thread's nice value (Linux: per thread).
pub fn lower_priority(nice: i32) {
    if nice == 0 {
        return;
    }
    let tid = nix::unistd::gettid().to_string();
    let reniced = std::process::Command::new("renice")
        .args(["-n", &nice.to_string(), "-p", &tid])
        .stdout(std::process::Stdio::null())
        .status();
    assert!(reniced.is_ok_and(|s| s.success()), "renice {tid}");
}
