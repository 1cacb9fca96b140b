//! The install manifests as the cluster would see them: rendered with `kubectl kustomize` (as
//! `kubectl apply -k` renders them), their pod templates, and each container's environment and
//! command line as the kubelet builds them (downward API filled in, `$(VAR)` expanded).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, ensure};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Container, PodSpec};
use serde::Deserialize;
use serde_json::Value;

/// Values the kubelet would give the downward-API fields the manifests use.
pub const DOWNWARD: &[(&str, &str)] = &[
    ("spec.nodeName", "node-a"),
    ("status.hostIP", "10.0.0.5"),
    ("metadata.name", "echo-5d4f8-abcde"),
    ("metadata.namespace", "lattice-demo"),
];

/// The workspace root (this crate's parent directory).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// `kubectl kustomize <root>/<dir>` as YAML text.
pub fn render_text(dir: &str) -> anyhow::Result<String> {
    let output = Command::new("kubectl")
        .arg("kustomize")
        .arg(root().join(dir))
        .stdin(Stdio::null())
        .output()
        .context("running kubectl kustomize (kubectl must be installed)")?;
    ensure!(
        output.status.success(),
        "kubectl kustomize {dir}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?)
}

/// The documents of a YAML stream, empty ones left out.
pub fn documents(text: &str) -> anyhow::Result<Vec<Value>> {
    let mut objects = Vec::new();
    for document in serde_norway::Deserializer::from_str(text) {
        let value = Value::deserialize(document)?;
        if !value.is_null() {
            objects.push(value);
        }
    }
    Ok(objects)
}

fn kind(object: &Value) -> &str {
    object["kind"].as_str().unwrap_or_default()
}

/// Every pod template in `objects` (DaemonSets and Deployments): (owner, spec).
pub fn pod_specs(objects: &[Value]) -> anyhow::Result<Vec<(String, PodSpec)>> {
    let mut specs = Vec::new();
    for object in objects {
        let name = object["metadata"]["name"].as_str().unwrap_or("?");
        let spec = match kind(object) {
            "DaemonSet" => serde_json::from_value::<DaemonSet>(object.clone())?
                .spec
                .and_then(|s| s.template.spec),
            "Deployment" => serde_json::from_value::<Deployment>(object.clone())?
                .spec
                .and_then(|s| s.template.spec),
            _ => continue,
        };
        let spec = spec.with_context(|| format!("{}/{name} has no pod spec", kind(object)))?;
        specs.push((format!("{}/{name}", kind(object)), spec));
    }
    Ok(specs)
}

/// The init container of `pod` whose command names `program` (lattice-init, Envoy's native
/// sidecar).
pub fn init_container_running<'a>(pod: &'a PodSpec, program: &str) -> Option<&'a Container> {
    pod.init_containers
        .iter()
        .flatten()
        .find(|c| c.command.iter().flatten().any(|w| w == program))
}

/// A container's environment as the kubelet builds it, with the downward API filled in.
pub fn container_env(container: &Container) -> anyhow::Result<Vec<(String, String)>> {
    let mut env = Vec::new();
    for var in container.env.iter().flatten() {
        let value = match (&var.value, &var.value_from) {
            (Some(value), _) => expand(value, &env),
            (None, Some(from)) => {
                let path = from
                    .field_ref
                    .as_ref()
                    .map(|f| f.field_path.as_str())
                    .context("only fieldRef env sources are emulated")?;
                DOWNWARD
                    .iter()
                    .find(|(p, _)| *p == path)
                    .map(|(_, v)| v.to_string())
                    .with_context(|| format!("no emulated value for fieldRef {path}"))?
            }
            (None, None) => String::new(),
        };
        env.push((var.name.clone(), value));
    }
    Ok(env)
}

/// The kubelet's `$(VAR)` expansion in command and args: defined vars are replaced, `$$` is a
/// literal `$`, anything else is left as written.
pub fn expand(text: &str, env: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(inner) = after.strip_prefix('(')
            && let Some(end) = inner.find(')')
            && let Some((_, value)) = env.iter().rev().find(|(k, _)| *k == inner[..end])
        {
            out.push_str(value);
            rest = &inner[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// (program, arguments) after expansion; the manifests must name the program.
pub fn command_line(
    container: &Container,
    env: &[(String, String)],
) -> anyhow::Result<(String, Vec<String>)> {
    let mut words: Vec<String> = container
        .command
        .iter()
        .flatten()
        .chain(container.args.iter().flatten())
        .map(|w| expand(w, env))
        .collect();
    ensure!(
        !words.is_empty(),
        "container {} relies on the image's entrypoint; the manifests must name the program",
        container.name
    );
    let program = words.remove(0);
    Ok((program, words))
}

/// The image's name without its tag (`lattice:0.1.0` → `lattice`).
pub fn image_name(container: &Container) -> String {
    let image = container.image.clone().unwrap_or_default();
    let slash = image.rfind('/').map_or(0, |i| i + 1);
    match image[slash..].find(':') {
        Some(colon) => image[..slash + colon].to_string(),
        None => image,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expansion_follows_the_kubelet() {
        let env = vec![("A".to_string(), "x".to_string())];
        assert_eq!(expand("$(A)-$(B)-$$(A)-$", &env), "x-$(B)-$(A)-$");
    }
}
