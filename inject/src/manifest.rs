//! Manifests as `kubectl apply` takes them: YAML documents separated by `---`, each an object
//! or a `List` of objects. [`apply`] runs the template over the pod template of every Pod,
//! Deployment, StatefulSet, DaemonSet, ReplicaSet, ReplicationController, Job and CronJob, and
//! leaves every other document as it was, byte for byte: a document is written again only when
//! one of its pods changed (then as YAML of its own: its keys sorted, its leading comments kept
//! and the others gone).

use serde_json::Value;

use crate::annotations::shown;
use crate::config::InjectConfig;
use crate::template::{self, NotInjected, Skip};

/// Why a manifest could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("document {index}: not YAML: {reason}")]
    Yaml { index: usize, reason: String },
    #[error("document {index} ({object}): the patch does not apply: {reason}")]
    Patch {
        index: usize,
        object: String,
        reason: String,
    },
    #[error("document {index} ({object}): cannot write it as YAML: {reason}")]
    Write {
        index: usize,
        object: String,
        reason: String,
    },
}

/// Which way to run the template.
#[derive(Clone, Copy, Debug)]
pub enum Direction<'a> {
    Inject {
        config: &'a InjectConfig,
        /// The namespace of objects that name none (as `kubectl apply -n` would put them).
        namespace: &'a str,
    },
    Uninject,
}

/// What happened to one pod template.
#[derive(Debug, PartialEq, Eq)]
pub struct Outcome {
    /// `kind/name` of the object (with its index in a `List`).
    pub object: String,
    pub result: Result<(), Left>,
}

/// Why a pod template was left as it was.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum Left {
    #[error("{0}")]
    Skipped(#[from] Skip),
    #[error("{0}")]
    NotInjected(#[from] NotInjected),
}

/// `text` with the template run over every pod template in it, and what happened to each.
pub fn apply(
    text: &str,
    direction: Direction<'_>,
) -> Result<(String, Vec<Outcome>), ManifestError> {
    let mut out = String::with_capacity(text.len() + text.len() / 2);
    let mut outcomes = Vec::new();
    for (index, (separator, body)) in documents(text).into_iter().enumerate() {
        out.push_str(separator);
        let blank = body.lines().all(|l| {
            let l = l.trim();
            l.is_empty() || l.starts_with('#')
        });
        if blank {
            out.push_str(body);
            continue;
        }
        let mut doc: Value = match serde_norway::from_str(body) {
            Ok(doc) => doc,
            Err(e) => {
                return Err(ManifestError::Yaml {
                    index,
                    reason: shown(&e.to_string()),
                });
            }
        };
        let object = describe(&doc);
        let changed = run(&mut doc, direction, &object, index, &mut outcomes)?;
        if !changed {
            out.push_str(body);
            continue;
        }
        let written = serde_norway::to_string(&doc).map_err(|e| ManifestError::Write {
            index,
            object: object.clone(),
            reason: shown(&e.to_string()),
        })?;
        // The document's leading comments (a Helm chart's `# Source:` line) stay with it.
        let comments = body
            .split_inclusive('\n')
            .take_while(|l| l.trim().is_empty() || l.trim_start().starts_with('#'))
            .map(str::len)
            .sum();
        out.push_str(&body[..comments]);
        out.push_str(&written);
        if !written.ends_with('\n') {
            out.push('\n');
        }
    }
    Ok((out, outcomes))
}

/// The documents of `text`, each with the separator line before it (empty for the first).
fn documents(text: &str) -> Vec<(&str, &str)> {
    let mut docs = Vec::new();
    let mut separator = (0, 0);
    let mut start = 0;
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        let bare = line.trim_end();
        let is_separator = bare == "---" || bare.starts_with("--- ") || bare.starts_with("---\t");
        if is_separator {
            if at > 0 {
                docs.push((&text[separator.0..separator.1], &text[start..at]));
            }
            separator = (at, at + line.len());
            start = at + line.len();
        }
        at += line.len();
    }
    docs.push((&text[separator.0..separator.1], &text[start..]));
    docs
}

/// Runs the template over `doc` (recursing into a `List`); whether anything changed.
fn run(
    doc: &mut Value,
    direction: Direction<'_>,
    object: &str,
    index: usize,
    outcomes: &mut Vec<Outcome>,
) -> Result<bool, ManifestError> {
    if doc["kind"] == "List"
        && let Some(items) = doc.get_mut("items").and_then(Value::as_array_mut)
    {
        let mut changed = false;
        for (k, item) in items.iter_mut().enumerate() {
            let object = format!("{object}[{k}] {}", describe(item));
            changed |= run(item, direction, &object, index, outcomes)?;
        }
        return Ok(changed);
    }
    let Some(path) = template_path(doc) else {
        return Ok(false);
    };
    let namespace = doc["metadata"]["namespace"].as_str().map(str::to_string);
    let Some(pod) = doc.pointer_mut(path) else {
        return Ok(false);
    };
    let patch = match direction {
        Direction::Inject {
            config,
            namespace: default,
        } => template::inject(pod, namespace.as_deref().unwrap_or(default), config)
            .map_err(Left::from),
        Direction::Uninject => template::uninject(pod).map_err(Left::from),
    };
    let patch = match patch {
        Ok(patch) => patch,
        Err(left) => {
            outcomes.push(Outcome {
                object: object.to_string(),
                result: Err(left),
            });
            return Ok(false);
        }
    };
    json_patch::patch(pod, &patch).map_err(|e| ManifestError::Patch {
        index,
        object: object.to_string(),
        reason: e.to_string(),
    })?;
    outcomes.push(Outcome {
        object: object.to_string(),
        result: Ok(()),
    });
    Ok(true)
}

/// Where an object of this kind keeps its pod (`metadata` and `spec`), as a JSON pointer.
fn template_path(doc: &Value) -> Option<&'static str> {
    Some(match doc["kind"].as_str()? {
        "Pod" => "",
        "Deployment"
        | "StatefulSet"
        | "DaemonSet"
        | "ReplicaSet"
        | "ReplicationController"
        | "Job" => "/spec/template",
        "CronJob" => "/spec/jobTemplate/spec/template",
        _ => return None,
    })
}

/// `kind/name`, for messages.
fn describe(doc: &Value) -> String {
    let kind = doc["kind"].as_str().unwrap_or("?");
    let name = doc["metadata"]["name"].as_str().unwrap_or("?");
    shown(&format!("{kind}/{name}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_keep_their_separators_and_bytes() {
        let text = "# head\na: 1\n---\nb: 2\n--- # c\nc: 3\n---\n";
        let docs = documents(text);
        assert_eq!(
            docs,
            vec![
                ("", "# head\na: 1\n"),
                ("---\n", "b: 2\n"),
                ("--- # c\n", "c: 3\n"),
                ("---\n", ""),
            ]
        );
        let joined: String = docs.iter().flat_map(|(s, b)| [*s, *b]).collect();
        assert_eq!(joined, text);
        assert_eq!(documents("---\na: 1\n"), vec![("---\n", "a: 1\n")]);
    }
}
