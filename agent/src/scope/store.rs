//! Each pod's resolved services kept on the node, so that a restarted agent (a crash, an
//! upgrade) gives every pod's Envoy what it held before: a file per pod in the state directory,
//! `<namespace>_<name>` (neither part can hold `_`), a header and then one service's DNS name
//! per line, appended as the pod resolves it, before its Envoy is given it.
//!
//! ```text
//! lattice-scope 1
//! ip 10.200.0.2
//! web.shop.system.internal
//! ```
//!
//! A line cut short by a crash (no newline) is ignored; a file that does not read as this
//! format is ignored and replaced. What the agent cannot write is counted and logged, and the
//! agent goes on with the scope in memory.

use std::collections::{BTreeSet, HashMap};
use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::identity::PodKey;

const HEADER: &str = "lattice-scope 1";
/// No file of a pod's scope is larger: every service of a 50k-service mesh, at the longest
/// DNS name, is 13 MB. A larger file is not read.
const MAX_FILE: u64 = 16 << 20;
/// No DNS name is longer.
const MAX_NAME: usize = 253;

/// What went wrong with the state directory.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state directory {dir}: {source}")]
    Dir {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("scope file {path}: {source}")]
    File {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A pod's scope as the store read it back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    pub ip: IpAddr,
    pub services: BTreeSet<Arc<str>>,
}

/// The directory of scope files.
#[derive(Debug)]
pub struct ScopeStore {
    dir: PathBuf,
}

impl ScopeStore {
    /// The store in `dir`, made if missing (readable by the agent only: it names what each pod
    /// talks to).
    pub fn open(dir: &Path) -> Result<ScopeStore, StoreError> {
        use std::os::unix::fs::DirBuilderExt as _;
        let made = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir);
        made.map_err(|source| StoreError::Dir {
            dir: dir.to_path_buf(),
            source,
        })?;
        Ok(ScopeStore {
            dir: dir.to_path_buf(),
        })
    }

    /// The file of `pod`; `None` for a name that could not be a pod's (Kubernetes names are
    /// lower-case DNS names: this keeps any other out of the path).
    fn path(&self, pod: &PodKey) -> Option<PathBuf> {
        let valid = |part: &str| {
            !part.is_empty()
                && part.len() <= MAX_NAME
                && part
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
                && !part.starts_with('.')
        };
        (valid(&pod.namespace) && valid(&pod.name))
            .then(|| self.dir.join(format!("{}_{}", pod.namespace, pod.name)))
    }

    /// Every pod's scope the directory holds; what does not read is left out.
    pub fn load(&self) -> Result<HashMap<PodKey, Stored>, StoreError> {
        let entries = std::fs::read_dir(&self.dir).map_err(|source| StoreError::Dir {
            dir: self.dir.clone(),
            source,
        })?;
        let mut out = HashMap::new();
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some((namespace, pod)) = name.to_str().and_then(|n| n.split_once('_')) else {
                continue;
            };
            let key = PodKey {
                namespace: namespace.to_string(),
                name: pod.to_string(),
            };
            if self.path(&key).is_none() {
                continue;
            }
            let small = entry
                .metadata()
                .is_ok_and(|m| m.is_file() && m.len() <= MAX_FILE);
            let text = small
                .then(|| std::fs::read_to_string(entry.path()).ok())
                .flatten();
            if let Some(stored) = text.as_deref().and_then(parse) {
                out.insert(key, stored);
            }
        }
        Ok(out)
    }

    /// Writes `pod`'s file anew: its address and `services`.
    pub fn write(&self, pod: &PodKey, stored: &Stored) -> Result<(), StoreError> {
        let Some(path) = self.path(pod) else {
            return Ok(());
        };
        let mut text = format!("{HEADER}\nip {}\n", stored.ip);
        for service in &stored.services {
            text.push_str(service);
            text.push('\n');
        }
        // Through a file of its own and a rename: a crash leaves the old file or the new one.
        let temporary = path.with_extension("new");
        let written =
            std::fs::write(&temporary, text).and_then(|()| std::fs::rename(&temporary, &path));
        written.map_err(|source| StoreError::File { path, source })
    }

    /// Adds `service` to `pod`'s file.
    pub fn append(&self, pod: &PodKey, service: &str) -> Result<(), StoreError> {
        let Some(path) = self.path(pod) else {
            return Ok(());
        };
        // One write of a whole line, appended: lines from concurrent lookups do not mix.
        let appended = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut file| file.write_all(format!("{service}\n").as_bytes()));
        appended.map_err(|source| StoreError::File { path, source })
    }

    /// Removes `pod`'s file.
    pub fn forget(&self, pod: &PodKey) -> Result<(), StoreError> {
        let Some(path) = self.path(pod) else {
            return Ok(());
        };
        match std::fs::remove_file(&path) {
            Err(source) if source.kind() != std::io::ErrorKind::NotFound => {
                Err(StoreError::File { path, source })
            }
            _ => Ok(()),
        }
    }
}

/// A scope file's text, if it is one: whole lines only.
fn parse(text: &str) -> Option<Stored> {
    let mut lines = text
        .split_inclusive('\n')
        .filter_map(|l| l.strip_suffix('\n'));
    if lines.next()? != HEADER {
        return None;
    }
    let ip = lines.next()?.strip_prefix("ip ")?.parse().ok()?;
    let services = lines
        .filter(|line| {
            !line.is_empty() && line.len() <= MAX_NAME && !line.contains(char::is_whitespace)
        })
        .map(Arc::from)
        .collect();
    Some(Stored { ip, services })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> PodKey {
        PodKey {
            namespace: "shop".to_string(),
            name: name.to_string(),
        }
    }

    #[test]
    fn scopes_written_appended_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let store = ScopeStore::open(&dir.path().join("state")).unwrap();
        let stored = Stored {
            ip: "10.0.0.5".parse().unwrap(),
            services: [Arc::from("a.shop.system.internal")].into(),
        };
        store.write(&key("web-0"), &stored).unwrap();
        store
            .append(&key("web-0"), "b.shop.system.internal")
            .unwrap();
        store.write(&key("web-1"), &stored).unwrap();
        let loaded = store.load().unwrap();
        assert_eq!(loaded.len(), 2);
        let web0 = &loaded[&key("web-0")];
        assert_eq!(web0.ip, stored.ip);
        let names: Vec<&str> = web0.services.iter().map(|s| &**s).collect();
        assert_eq!(names, ["a.shop.system.internal", "b.shop.system.internal"]);

        // A line cut short is left out; a file that is not a scope file is ignored.
        let path = dir.path().join("state/shop_web-0");
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str("c.shop.sys");
        std::fs::write(&path, text).unwrap();
        std::fs::write(dir.path().join("state/shop_junk"), "hello\n").unwrap();
        let loaded = store.load().unwrap();
        assert_eq!(loaded[&key("web-0")].services.len(), 2);
        assert!(!loaded.contains_key(&key("junk")));

        store.forget(&key("web-0")).unwrap();
        store.forget(&key("web-0")).unwrap();
        assert_eq!(store.load().unwrap().len(), 1);
    }

    #[test]
    fn names_that_are_no_pods_stay_out_of_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let store = ScopeStore::open(dir.path()).unwrap();
        let stored = Stored {
            ip: "10.0.0.5".parse().unwrap(),
            services: BTreeSet::new(),
        };
        for bad in ["../x", "a/b", "", "..", "UP"] {
            store.write(&key(bad), &stored).unwrap();
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        // Appending to a pod with no file is an error, not a new file without a header.
        assert!(store.append(&key("nobody"), "a.b").is_err());
    }
}
