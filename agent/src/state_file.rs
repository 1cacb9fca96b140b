//! A JSON file in the state directory (`--state-dir`), as the address record, the node's last
//! mesh and the mesh files' copies keep theirs: read whole with a bound on its size, and
//! replaced whole through a temporary file of its own renamed over it, so a reader (the next
//! agent, or one overlapping during an upgrade) sees the old file or the new one, never half of
//! one. No fsync: the file
//! must outlive the agent, which the page cache does; a node that loses power restarts its
//! pods too.

use std::io::Write as _;
use std::path::Path;

use serde::Serialize;
use serde::de::DeserializeOwned;

/// The JSON value at `path`, if there is a file: `Ok(None)` when there is none, `Err` with the
/// reason (`what` names the file's kind: "not a record") when it cannot be read or is larger
/// than `max_bytes`.
pub fn read<T: DeserializeOwned>(
    path: &Path,
    max_bytes: u64,
    what: &str,
) -> Result<Option<T>, String> {
    let Some(text) = read_text(path, max_bytes, what)? else {
        return Ok(None);
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|err| format!("not {what}: {err}"))
}

/// The text at `path`, if there is a file: as [`read`], before it is decoded.
pub fn read_text(path: &Path, max_bytes: u64, what: &str) -> Result<Option<String>, String> {
    let file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(err) => return Err(format!("cannot open it: {err}")),
    };
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    if size > max_bytes {
        return Err(format!("{size} bytes, more than the {max_bytes} it may be"));
    }
    let mut text = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
    std::io::Read::read_to_end(&mut std::io::Read::take(file, max_bytes + 1), &mut text)
        .map_err(|err| format!("cannot read it: {err}"))?;
    // Checked as UTF-8 once, whole, rather than string by string as `from_slice` does: about
    // a tenth of reading a 50k-service last mesh was those checks.
    String::from_utf8(text)
        .map(Some)
        .map_err(|err| format!("not {what}: {}", err.utf8_error()))
}

/// Replaces the file at `path` with `value` as JSON, streamed through a temporary file
/// (`.<prefix>.*.tmp`) in the same directory, renamed over it.
pub fn replace(path: &Path, prefix: &str, value: &impl Serialize) -> Result<(), String> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)
        .map_err(|err| format!("cannot create {}: {err}", dir.display()))?;
    let file = tempfile::Builder::new()
        .prefix(&format!(".{prefix}."))
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(|err| format!("cannot create a file in {}: {err}", dir.display()))?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    serde_json::to_writer(&mut out, value).map_err(|err| format!("cannot write: {err}"))?;
    out.flush().map_err(|err| format!("cannot write: {err}"))?;
    let file = out
        .into_inner()
        .map_err(|err| format!("cannot write: {}", err.error()))?;
    file.persist(path)
        .map_err(|err| format!("cannot rename over it: {}", err.error))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_reads_back_and_one_that_is_not_utf8_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        assert_eq!(read::<Vec<String>>(&path, 1 << 10, "a list"), Ok(None));
        let written = vec!["ä".to_owned(), "b".to_owned()];
        replace(&path, "state", &written).unwrap();
        assert_eq!(read(&path, 1 << 10, "a list"), Ok(Some(written)));
        std::fs::write(&path, b"[\"\xff\"]").unwrap();
        let error = read::<Vec<String>>(&path, 1 << 10, "a list").unwrap_err();
        assert!(error.starts_with("not a list"), "{error}");
        assert!(
            read::<Vec<String>>(&path, 2, "a list").is_err(),
            "larger than allowed"
        );
    }
}
