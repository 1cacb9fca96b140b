//! Following a mesh file through whatever replaces it: which directories to watch so that
//! every change to what the path reads raises an event, re-armed after each one.
//!
//! inotify watches a directory's inode, not its path, and follows no symlink after the watch
//! is made. So the watched set is worked out again after every event, from the path as it
//! resolves now: the directory of each hop of its symlink chain (a ConfigMap's
//! `mesh.yaml -> ..data/mesh.yaml`, `..data -> ..2026_…`; a file replaced by a link to
//! another directory), each by its real path; a directory that is not there is stood in for
//! by its nearest existing ancestor, whose events say when it comes back; a directory removed
//! and made again (another inode at the same path) is watched anew.

use std::collections::{BTreeMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, RwLock};

use notify::{RecursiveMode, Watcher};

/// Symlink hops followed before giving up, as the kernel's ELOOP limit.
const MAX_HOPS: usize = 40;

/// The directories watched for one file, and the paths whose events matter.
pub(super) struct Follow {
    path: PathBuf,
    watcher: Box<dyn Watcher + Send>,
    /// Each watched directory (real path) and the inode it had when the watch was made.
    watched: BTreeMap<PathBuf, (u64, u64)>,
    /// Shared with the watcher's callback: which event paths can change what the file reads.
    interest: Arc<RwLock<Interest>>,
}

/// What the callback compares event paths with.
#[derive(Default)]
pub(super) struct Interest {
    paths: HashSet<PathBuf>,
}

impl Interest {
    /// Whether an event on `path` may change what the followed file reads: a hop of its chain
    /// (or the missing directory that will hold one), a watched directory itself, or a
    /// ConfigMap's `..`-named entry, which kubelet swaps to update every key at once.
    pub(super) fn matters(&self, path: &Path) -> bool {
        self.paths.contains(path)
            || path
                .file_name()
                .is_some_and(|name| name.to_string_lossy().starts_with(".."))
    }
}

impl Follow {
    pub(super) fn new(
        path: &Path,
        watcher: Box<dyn Watcher + Send>,
        interest: Arc<RwLock<Interest>>,
    ) -> Self {
        Follow {
            path: path.to_path_buf(),
            watcher,
            watched: BTreeMap::new(),
            interest,
        }
    }

    /// Watches what the path resolves through now; `Err` says why the file cannot be followed
    /// (its directory is gone, or a watch failed), which the caller reports as stale.
    pub(super) fn update(&mut self) -> Result<(), String> {
        let plan = plan(&self.path);
        let mut wanted = BTreeMap::new();
        let mut problem = plan.problem;
        for dir in &plan.dirs {
            match std::fs::metadata(dir) {
                Ok(meta) => {
                    wanted.insert(dir.clone(), (meta.dev(), meta.ino()));
                }
                Err(error) => {
                    problem.get_or_insert_with(|| format!("{}: {error}", dir.display()));
                }
            }
        }
        let stale: Vec<PathBuf> = self
            .watched
            .iter()
            .filter(|(dir, identity)| wanted.get(*dir) != Some(*identity))
            .map(|(dir, _)| dir.clone())
            .collect();
        for dir in stale {
            // Gone already when its inode was deleted: nothing to undo then.
            let _ = self.watcher.unwatch(&dir);
            self.watched.remove(&dir);
        }
        for (dir, identity) in wanted {
            if self.watched.contains_key(&dir) {
                continue;
            }
            match self.watcher.watch(&dir, RecursiveMode::NonRecursive) {
                Ok(()) => {
                    self.watched.insert(dir, identity);
                }
                Err(error) => {
                    problem.get_or_insert_with(|| {
                        format!("cannot watch {} for changes: {error}", dir.display())
                    });
                }
            }
        }
        let mut paths = plan.interest;
        paths.extend(self.watched.keys().cloned());
        if let Ok(mut interest) = self.interest.write() {
            interest.paths = paths;
        }
        match problem {
            None => Ok(()),
            Some(problem) => Err(problem),
        }
    }

    #[cfg(test)]
    fn watched(&self) -> Vec<PathBuf> {
        self.watched.keys().cloned().collect()
    }
}

/// What following a path takes now.
struct Plan {
    /// Directories to watch, by their real paths.
    dirs: Vec<PathBuf>,
    /// The paths events will name for the hops (under the real directory paths).
    interest: HashSet<PathBuf>,
    /// Why the file cannot be followed whole, if so.
    problem: Option<String>,
}

fn plan(path: &Path) -> Plan {
    let mut plan = Plan {
        dirs: Vec::new(),
        interest: HashSet::new(),
        problem: None,
    };
    let mut hop = absolute(path);
    for _ in 0..MAX_HOPS {
        let (Some(parent), Some(name)) = (hop.parent(), hop.file_name()) else {
            break;
        };
        match std::fs::canonicalize(parent) {
            Ok(real) => {
                plan.interest.insert(real.join(name));
                plan.dirs.push(real);
            }
            Err(_) => {
                // Watch the nearest ancestor that exists, for the directory to come back.
                let (ancestor, missing) = nearest_existing(parent);
                plan.problem.get_or_insert_with(|| {
                    format!(
                        "directory {} does not exist; following {} until it does",
                        parent.display(),
                        ancestor.display()
                    )
                });
                if let Some(missing) = missing {
                    plan.interest.insert(ancestor.join(missing));
                }
                plan.dirs.push(ancestor);
                break;
            }
        }
        match std::fs::read_link(&hop) {
            Ok(target) => hop = normalize(&parent.join(target)),
            Err(_) => break,
        }
    }
    plan.dirs.sort();
    plan.dirs.dedup();
    plan
}

/// The deepest ancestor of `dir` that exists (by its real path), and the name under it that
/// does not.
fn nearest_existing(dir: &Path) -> (PathBuf, Option<std::ffi::OsString>) {
    let mut missing = None;
    let mut current = dir;
    loop {
        if let Ok(real) = std::fs::canonicalize(current) {
            return (real, missing);
        }
        missing = current.file_name().map(|n| n.to_os_string());
        match current.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => current = parent,
            _ => return (PathBuf::from("/"), missing),
        }
    }
}

fn absolute(path: &Path) -> PathBuf {
    if path.is_absolute() {
        normalize(path)
    } else {
        let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
        normalize(&cwd.join(path))
    }
}

/// `a/./b` and `a/x/../b` as `a/b`, lexically: a link target relative to its directory.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn follow(path: &Path) -> Follow {
        let interest = Arc::new(RwLock::new(Interest::default()));
        let watcher = notify::recommended_watcher(|_| {}).unwrap();
        Follow::new(path, Box::new(watcher), interest)
    }

    #[test]
    fn a_plain_file_is_followed_in_its_directory() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        let path = dir.path().join("mesh.yaml");
        std::fs::write(&path, "services: []").unwrap();
        let mut follow = follow(&path);
        follow.update().unwrap();
        assert_eq!(follow.watched(), std::slice::from_ref(&real));
        assert!(
            follow
                .interest
                .read()
                .unwrap()
                .matters(&real.join("mesh.yaml"))
        );
        assert!(
            !follow
                .interest
                .read()
                .unwrap()
                .matters(&real.join("other.yaml"))
        );
    }

    #[test]
    fn a_configmap_layout_watches_the_data_directory_as_it_is_swapped() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        std::fs::create_dir(real.join("..2026_01")).unwrap();
        std::fs::write(real.join("..2026_01/mesh.yaml"), "services: []").unwrap();
        std::os::unix::fs::symlink("..2026_01", real.join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/mesh.yaml", real.join("mesh.yaml")).unwrap();
        let mut follow = follow(&real.join("mesh.yaml"));
        follow.update().unwrap();
        assert_eq!(follow.watched(), [real.clone(), real.join("..2026_01")]);
        // kubelet's swap: a new directory, `..data` renamed over, the old one removed.
        std::fs::create_dir(real.join("..2026_02")).unwrap();
        std::fs::write(real.join("..2026_02/mesh.yaml"), "services: []").unwrap();
        std::os::unix::fs::symlink("..2026_02", real.join("..data_tmp")).unwrap();
        std::fs::rename(real.join("..data_tmp"), real.join("..data")).unwrap();
        std::fs::remove_dir_all(real.join("..2026_01")).unwrap();
        follow.update().unwrap();
        assert_eq!(follow.watched(), [real.clone(), real.join("..2026_02")]);
    }

    #[test]
    fn a_missing_directory_is_stood_in_for_by_its_ancestor_until_it_returns() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        let sub = real.join("config");
        std::fs::create_dir(&sub).unwrap();
        let mut follow = follow(&sub.join("mesh.yaml"));
        follow.update().unwrap();
        assert_eq!(follow.watched(), std::slice::from_ref(&sub));
        std::fs::remove_dir(&sub).unwrap();
        let err = follow.update().unwrap_err();
        assert!(err.contains("does not exist"), "{err}");
        assert_eq!(follow.watched(), std::slice::from_ref(&real));
        assert!(follow.interest.read().unwrap().matters(&sub));
        std::fs::create_dir(&sub).unwrap();
        follow.update().unwrap();
        assert_eq!(follow.watched(), std::slice::from_ref(&sub));
    }

    #[test]
    fn a_directory_made_again_is_watched_again() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        let sub = real.join("config");
        std::fs::create_dir(&sub).unwrap();
        let mut follow = follow(&sub.join("mesh.yaml"));
        follow.update().unwrap();
        let before = follow.watched[&sub];
        std::fs::rename(&sub, real.join("old")).unwrap();
        std::fs::create_dir(&sub).unwrap();
        follow.update().unwrap();
        assert_ne!(
            follow.watched[&sub], before,
            "the new inode is the one watched"
        );
    }

    #[test]
    fn a_link_to_another_directory_watches_that_one_too() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        std::fs::create_dir(real.join("a")).unwrap();
        std::fs::create_dir(real.join("b")).unwrap();
        std::fs::write(real.join("b/real.yaml"), "services: []").unwrap();
        std::os::unix::fs::symlink("../b/real.yaml", real.join("a/mesh.yaml")).unwrap();
        let mut follow = follow(&real.join("a/mesh.yaml"));
        follow.update().unwrap();
        assert_eq!(follow.watched(), [real.join("a"), real.join("b")]);
        assert!(
            follow
                .interest
                .read()
                .unwrap()
                .matters(&real.join("b/real.yaml"))
        );
    }
}
