//! `cargo xtask manifests [--out DIR] [--image IMAGE]`: renders the kustomize base in `deploy/`
//! (the agent and the sidecar injector) and `deploy/examples/` (a mesh service, in a namespace
//! labelled for injection) to plain YAML, for
//! users who apply manifests without kustomize. With `--image`, each is rendered through a
//! throw-away overlay that sets the image, exactly as a user's own overlay would.

use std::path::{Component, Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

/// The image name the manifests use for lattice-agent and lattice-init (deploy/Dockerfile).
const IMAGE_NAME: &str = "lattice";

/// (file written under `--out`, kustomization directory under the workspace root).
const RENDERS: &[(&str, &str)] = &[
    ("lattice.yaml", "deploy"),
    ("lattice-example.yaml", "deploy/examples"),
];

pub fn run(out: Option<&Path>, image: Option<&str>) -> anyhow::Result<()> {
    let root = super::workspace_root();
    let image = image.map(ImageRef::parse).transpose()?;
    let mut rendered = Vec::new();
    for (file, dir) in RENDERS {
        let base = root.join(dir);
        let yaml = match &image {
            None => kustomize(&base)?,
            Some(image) => {
                let overlay = Overlay::new(&base, image)?;
                kustomize(&overlay.dir)?
            }
        };
        rendered.push((*file, yaml));
    }
    match out {
        None => {
            let documents: Vec<&str> = rendered.iter().map(|(_, yaml)| yaml.as_str()).collect();
            print!("{}", documents.join("---\n"));
        }
        Some(dir) => {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create --out directory {}", dir.display()))?;
            for (file, yaml) in &rendered {
                let path = dir.join(file);
                std::fs::write(&path, yaml)
                    .with_context(|| format!("cannot write {}", path.display()))?;
                println!("{}", path.display());
            }
        }
    }
    Ok(())
}

fn kustomize(dir: &Path) -> anyhow::Result<String> {
    let output = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .context("cannot run `kubectl kustomize`; install kubectl (it renders offline)")?;
    if !output.status.success() {
        bail!(
            "`kubectl kustomize {}` failed: {}",
            dir.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    String::from_utf8(output.stdout).context("kubectl kustomize printed something other than UTF-8")
}

/// `--image`: `[REGISTRY/]NAME[:TAG][@DIGEST]`, as kustomize's `images:` entry wants it.
#[derive(Debug, PartialEq)]
struct ImageRef {
    name: String,
    tag: Option<String>,
    digest: Option<String>,
}

impl ImageRef {
    fn parse(image: &str) -> anyhow::Result<ImageRef> {
        let (rest, digest) = match image.split_once('@') {
            Some((rest, digest)) => (rest, Some(digest.to_string())),
            None => (image, None),
        };
        // A ':' after the last '/' starts the tag; one before it is a registry port.
        let slash = rest.rfind('/').map_or(0, |i| i + 1);
        let (name, tag) = match rest[slash..].rfind(':') {
            Some(colon) => (
                &rest[..slash + colon],
                Some(rest[slash + colon + 1..].to_string()),
            ),
            None => (rest, None),
        };
        let valid = |s: &str| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-/:".contains(c))
        };
        if !valid(name)
            || tag.as_deref().is_some_and(|t| !valid(t))
            || digest.as_deref().is_some_and(|d| !d.contains(':'))
        {
            bail!(
                "--image {image:?} is not an image reference like registry.example/lattice:0.1.0"
            );
        }
        Ok(ImageRef {
            name: name.to_string(),
            tag,
            digest,
        })
    }

    /// The `images:` entry; JSON is YAML, so no quoting rules to get wrong.
    fn kustomize_entry(&self) -> serde_json::Value {
        let mut entry = serde_json::json!({ "name": IMAGE_NAME, "newName": self.name });
        if let Some(tag) = &self.tag {
            entry["newTag"] = tag.clone().into();
        }
        if let Some(digest) = &self.digest {
            entry["digest"] = digest.clone().into();
        }
        entry
    }
}

/// A temporary kustomization over one base that only sets the image; removed on drop.
struct Overlay {
    dir: PathBuf,
}

impl Overlay {
    fn new(base: &Path, image: &ImageRef) -> anyhow::Result<Overlay> {
        let base = base
            .canonicalize()
            .with_context(|| format!("no kustomization at {}", base.display()))?;
        let dir = std::env::temp_dir().join(format!(
            "lattice-manifests-{}-{}",
            std::process::id(),
            base.file_name().and_then(|n| n.to_str()).unwrap_or("base")
        ));
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let overlay = Overlay { dir };
        let dir = overlay.dir.canonicalize()?;
        // kustomize refuses absolute resource paths.
        let kustomization = serde_json::json!({
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [relative(&dir, &base)],
            "images": [image.kustomize_entry()],
        });
        std::fs::write(
            overlay.dir.join("kustomization.yaml"),
            serde_json::to_string_pretty(&kustomization)?,
        )?;
        Ok(overlay)
    }
}

impl Drop for Overlay {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `to` relative to `from`; both absolute and canonical.
fn relative(from: &Path, to: &Path) -> String {
    let from: Vec<Component> = from.components().collect();
    let to: Vec<Component> = to.components().collect();
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut path = PathBuf::new();
    for _ in common..from.len() {
        path.push("..");
    }
    for component in &to[common..] {
        path.push(component);
    }
    path.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_references() {
        let image = ImageRef::parse("registry.example:5000/team/lattice:1.2.3").unwrap();
        assert_eq!(image.name, "registry.example:5000/team/lattice");
        assert_eq!(image.tag.as_deref(), Some("1.2.3"));
        let image = ImageRef::parse("registry.example:5000/lattice").unwrap();
        assert_eq!(image.name, "registry.example:5000/lattice");
        assert_eq!(image.tag, None);
        let image = ImageRef::parse("lattice@sha256:abcd").unwrap();
        assert_eq!(image.digest.as_deref(), Some("sha256:abcd"));
        assert!(ImageRef::parse("").is_err());
        assert!(ImageRef::parse("lattice:").is_err());
        assert!(ImageRef::parse("bad image").is_err());
    }

    #[test]
    fn relative_paths() {
        assert_eq!(
            relative(Path::new("/tmp/x"), Path::new("/work/main/deploy")),
            "../../work/main/deploy"
        );
        assert_eq!(relative(Path::new("/a/b"), Path::new("/a/c")), "../c");
    }
}
