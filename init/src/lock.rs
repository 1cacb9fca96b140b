//! Owns the run lock: one `lattice-init` at a time changes a network namespace.
//!
//! Each run reads the namespace's rules, computes what is missing and applies it; two runs at
//! once would both find the jump missing and both add it. `iptables --wait` does not help: the
//! xtables lock is taken per command, not per run. So a run first binds an abstract unix
//! socket, `@lattice-init`. Abstract names live in the network namespace, not in a file
//! system, which is what the lock must cover: the rules belong to the namespace, and two
//! containers of one pod share the namespace but not `/run` (a lock file would need a volume
//! both mount, and the init container's root file system is read-only). The name is freed by
//! the kernel when the last descriptor of the socket closes, so a run killed with SIGKILL
//! frees it too; nothing is left behind to clean up, and the name goes with the namespace.
//!
//! The socket is created without close-on-exec, so the commands a run starts
//! (`iptables-restore`) hold it as well: a run killed while its `iptables-restore` commits
//! leaves the lock held until that commit is over, and the next run reads the rules after it.

use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, bind, socket};
use tracing::info;

/// The abstract socket name (without its leading NUL) that holds the lock.
pub const LOCK_NAME: &str = "lattice-init";

/// How long a run waits for another run in the same namespace before giving up. A run takes
/// well under a second; this is for one stuck in `iptables --wait` behind the node's own
/// iptables users.
pub const LOCK_WAIT: Duration = Duration::from_secs(60);

/// Between two attempts to take the lock.
const RETRY: Duration = Duration::from_millis(20);

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("cannot create the run lock's socket: {0}")]
    Socket(Errno),
    #[error(
        "another lattice-init has been running in this network namespace for {waited:?} (it holds the abstract socket @{LOCK_NAME}); find it with `ss -xlp | grep {LOCK_NAME}` in the pod's network namespace"
    )]
    Timeout { waited: Duration },
    #[error("cannot take the run lock (bind @{LOCK_NAME}): {0}")]
    Bind(Errno),
}

/// The lock, held until dropped (or until this process and every command it started exit).
#[derive(Debug)]
pub struct RunLock {
    _socket: OwnedFd,
}

impl RunLock {
    /// Takes the lock, waiting up to `wait` for another run to finish.
    pub fn acquire(wait: Duration) -> Result<RunLock, LockError> {
        RunLock::acquire_named(LOCK_NAME, wait)
    }

    fn acquire_named(name: &str, wait: Duration) -> Result<RunLock, LockError> {
        let address = UnixAddr::new_abstract(name.as_bytes()).map_err(LockError::Bind)?;
        let started = Instant::now();
        let mut announced = false;
        loop {
            // No SOCK_CLOEXEC: the commands this run starts inherit the lock (module comment).
            let socket = socket(
                AddressFamily::Unix,
                SockType::Datagram,
                SockFlag::empty(),
                None,
            )
            .map_err(LockError::Socket)?;
            match bind(std::os::fd::AsRawFd::as_raw_fd(&socket), &address) {
                Ok(()) => {
                    if announced {
                        info!(
                            waited_ms = started.elapsed().as_secs_f64() * 1000.0,
                            "the other lattice-init finished; this run goes on"
                        );
                    }
                    return Ok(RunLock { _socket: socket });
                }
                Err(Errno::EADDRINUSE) => {
                    let waited = started.elapsed();
                    if waited >= wait {
                        return Err(LockError::Timeout { waited });
                    }
                    if !announced {
                        info!(
                            "another lattice-init is running in this network namespace; waiting for it to finish"
                        );
                        announced = true;
                    }
                    std::thread::sleep(RETRY);
                }
                Err(other) => return Err(LockError::Bind(other)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Under a name of its own: the test runs in the machine's network namespace, where a
    /// real run may hold the real name.
    #[test]
    fn the_lock_excludes_a_second_holder_until_the_first_lets_go() {
        let name = format!("lattice-init-test-{}", std::process::id());
        let first = RunLock::acquire_named(&name, LOCK_WAIT).expect("the lock is free");
        let err = RunLock::acquire_named(&name, Duration::from_millis(60)).expect_err("held");
        assert!(
            matches!(err, LockError::Timeout { .. }),
            "{err}: the second run must time out"
        );
        drop(first);
        RunLock::acquire_named(&name, Duration::ZERO).expect("free once the holder let go");
    }
}
