//! Who may claim which mesh path. A Service's own path, `/<namespace>/<name>`, is always its
//! own; a path claimed with the `lattice.mlab.com/path` annotation must lie under its
//! namespace's own prefix, `/<namespace>`, or under a prefix a cluster admin granted the
//! namespace in the grants ConfigMap of the agent's namespace (`lattice-system` in the
//! manifests), which tenants cannot edit: the annotation is the Service owner's to write, the
//! grant the cluster's. Among the Services that may claim a path, one whose own path it is
//! wins, then the oldest. `--path-claims any` is the older rule: any Service, any path, the
//! oldest wins.
//!
//! The ConfigMap's keys are namespaces, its values the prefixes granted to each,
//! comma- or space-separated:
//!
//! ```yaml
//! data:
//!   payments: /payments /billing
//!   shop: /store
//! ```

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use tracing::warn;

use super::mapping::ObjectKey;
use crate::mesh::MeshPath;

/// The rule for paths claimed by annotation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PathClaims {
    /// Under the Service's namespace, or a prefix granted to it.
    #[default]
    Granted,
    /// Anywhere; the oldest claim wins.
    Any,
}

/// The prefixes granted to each namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PathGrants(BTreeMap<String, Vec<MeshPath>>);

impl PathGrants {
    /// The grants a ConfigMap holds. An entry that is not a mesh path is logged and left out.
    pub fn from_config_map(config_map: &ConfigMap) -> PathGrants {
        let mut grants = BTreeMap::new();
        for (namespace, value) in config_map.data.iter().flatten() {
            let mut prefixes: Vec<MeshPath> = Vec::new();
            for entry in value
                .split([',', ' ', '\n', '\t'])
                .filter(|e| !e.is_empty())
            {
                match entry.parse::<MeshPath>() {
                    Ok(prefix) => prefixes.push(prefix),
                    Err(error) => warn!(
                        namespace = %namespace,
                        "path grant {:?} is not a mesh path ({error}); it grants nothing",
                        entry.chars().take(128).collect::<String>()
                    ),
                }
            }
            prefixes.sort();
            prefixes.dedup();
            grants.insert(namespace.clone(), prefixes);
        }
        PathGrants(grants)
    }

    fn of(&self, namespace: &str) -> &[MeshPath] {
        self.0.get(namespace).map(Vec::as_slice).unwrap_or_default()
    }
}

/// Whether `path` is the one a Service has without the annotation (`/<namespace>/<name>`).
/// Compared in place: it is asked of every Service of a list.
pub fn is_own_path(path: &str, key: &ObjectKey) -> bool {
    path.strip_prefix('/')
        .and_then(|rest| rest.strip_prefix(key.namespace.as_str()))
        .and_then(|rest| rest.strip_prefix('/'))
        == Some(key.name.as_str())
}

/// Whether the Service `key` may claim `path`, or why not.
pub fn may_claim(
    claims: PathClaims,
    grants: &PathGrants,
    grants_from: &str,
    key: &ObjectKey,
    path: &MeshPath,
) -> Result<(), String> {
    if claims == PathClaims::Any || is_own_path(path.as_str(), key) {
        return Ok(());
    }
    let namespace = format!("/{}", key.namespace);
    if under(path.as_str(), &namespace)
        || grants
            .of(&key.namespace)
            .iter()
            .any(|prefix| under(path.as_str(), prefix.as_str()))
    {
        return Ok(());
    }
    let mut allowed = vec![namespace];
    for prefix in grants.of(&key.namespace) {
        if !allowed.iter().any(|a| a == prefix.as_str()) {
            allowed.push(prefix.to_string());
        }
    }
    Err(format!(
        "namespace {} may claim paths under {} only; a cluster admin grants it more in \
         ConfigMap {grants_from}",
        key.namespace,
        allowed.join(", ")
    ))
}

/// Whether `path` is `prefix` or below it, by whole segments.
fn under(path: &str, prefix: &str) -> bool {
    path == prefix
        || path
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_services_own_path_is_its_namespace_then_its_name_exactly() {
        let key = ObjectKey::new("shop", "cart");
        assert!(is_own_path("/shop/cart", &key));
        for other in [
            "/shop/carts",
            "/shop/car",
            "/shopx/cart",
            "/shop/cart/x",
            "shop/cart",
            "/cart/shop",
            "/shop",
            "",
        ] {
            assert!(!is_own_path(other, &key), "{other}");
        }
    }

    fn grants(data: &[(&str, &str)]) -> PathGrants {
        let config_map: ConfigMap = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "lattice-path-grants", "namespace": "lattice-system"},
            "data": data.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>(),
        }))
        .unwrap();
        PathGrants::from_config_map(&config_map)
    }

    fn check(claims: PathClaims, grants: &PathGrants, service: &str, path: &str) -> bool {
        let (namespace, name) = service.split_once('/').unwrap();
        may_claim(
            claims,
            grants,
            "lattice-system/lattice-path-grants",
            &ObjectKey::new(namespace, name),
            &path.parse().unwrap(),
        )
        .is_ok()
    }

    #[test]
    fn a_namespace_claims_under_its_own_prefix_and_what_it_is_granted() {
        let grants = grants(&[
            ("payments", "/payments, /billing x/bad"),
            ("shop", "/store"),
        ]);
        let granted = PathClaims::Granted;
        assert!(check(granted, &grants, "tenant/web", "/tenant/web"));
        assert!(check(granted, &grants, "tenant/web", "/tenant/api/v2"));
        assert!(!check(granted, &grants, "tenant/web", "/payments/api"));
        assert!(!check(granted, &grants, "tenant/web", "/tenantx/api"));
        assert!(check(granted, &grants, "payments/api", "/payments/api"));
        assert!(check(granted, &grants, "payments/api", "/billing"));
        assert!(!check(granted, &grants, "payments/api", "/billingx"));
        assert!(check(granted, &grants, "shop/web", "/store/front"));
        assert!(!check(granted, &grants, "shop/web", "/payments"));
        // Anything, with the older rule.
        assert!(check(
            PathClaims::Any,
            &grants,
            "tenant/web",
            "/payments/api"
        ));
        let err = may_claim(
            granted,
            &grants,
            "lattice-system/lattice-path-grants",
            &ObjectKey::new("payments", "x"),
            &"/other".parse().unwrap(),
        )
        .unwrap_err();
        assert!(err.contains("under /payments, /billing only"), "{err}");
    }
}
