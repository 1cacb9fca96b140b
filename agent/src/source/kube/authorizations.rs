//! `MeshAuthorization` (`lattice.mlab.com/v1alpha1`, schema in
//! `deploy/crds/meshauthorization.yaml`): a Service's authorization rules from Kubernetes, in
//! the mesh file's shape ([`crate::source::authorization`]), attached to one Service of the
//! resource's own namespace by `targetRef`, as the Gateway API attaches policies.
//!
//! ```yaml
//! apiVersion: lattice.mlab.com/v1alpha1
//! kind: MeshAuthorization
//! metadata: {namespace: shop, name: web-callers}
//! spec:
//!   targetRef: {kind: Service, name: web}
//!   rules:
//!     - from: [{serviceAccount: shop/front}]
//! ```
//!
//! A Service's rules are those of every resource that targets it. A resource whose rules do not
//! read (or name a port the Service lacks) fails closed: its Service refuses every call until
//! it is fixed, since skipping it would open what it meant to close. Each such resource is
//! logged once per change.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Mutex;

use kube::CustomResource;
use serde::{Deserialize, Serialize};
use tracing::warn;

use super::mapping::ObjectKey;
use crate::mesh::{Action, AuthorizationRule};
use crate::source::authorization::{self as rules, RuleSpec};

#[derive(CustomResource, Clone, Debug, Default, Deserialize, Serialize)]
#[kube(
    group = "lattice.mlab.com",
    version = "v1alpha1",
    kind = "MeshAuthorization",
    plural = "meshauthorizations",
    namespaced,
    schema = "disabled"
)]
pub struct MeshAuthorizationSpec {
    #[serde(default, rename = "targetRef")]
    pub target_ref: TargetRef,
    /// Read one by one, so that a rule that does not read is this resource's error, not its
    /// watch's (which would stop reading every resource of the kind).
    #[serde(default)]
    pub rules: Vec<serde_json::Value>,
}

/// The Service a resource attaches to (Gateway API's `LocalPolicyTargetReference`).
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct TargetRef {
    #[serde(default)]
    pub group: String,
    #[serde(default)]
    pub kind: String,
    #[serde(default)]
    pub name: String,
}

/// A resource as the index keeps it.
#[derive(Clone, Debug, PartialEq)]
pub struct AuthorizationEntry {
    /// The Service it attaches to, if its `targetRef` names one.
    pub target: Option<ObjectKey>,
    /// Its rules, or why they do not read.
    pub rules: Result<Vec<RuleSpec>, String>,
}

/// Maps a resource as its watch delivers it.
pub fn authorization_entry(object: &MeshAuthorization) -> (ObjectKey, AuthorizationEntry) {
    let key = ObjectKey::of(&object.metadata);
    let target_ref = &object.spec.target_ref;
    let target = (target_ref.group.is_empty()
        && target_ref.kind == "Service"
        && !target_ref.name.is_empty())
    .then(|| ObjectKey::new(key.namespace.as_str(), target_ref.name.as_str()));
    let rules = object
        .spec
        .rules
        .iter()
        .enumerate()
        .map(|(i, rule)| {
            serde_json::from_value::<RuleSpec>(rule.clone())
                .map_err(|e| format!("spec.rules[{i}]: {e}"))
        })
        .collect();
    (key, AuthorizationEntry { target, rules })
}

/// Every resource, and which Services each attaches to.
#[derive(Debug, Default)]
pub struct AuthorizationIndex {
    entries: BTreeMap<ObjectKey, AuthorizationEntry>,
    by_target: BTreeMap<ObjectKey, BTreeSet<ObjectKey>>,
    /// Resources whose error was logged, until they change (read where Services are built,
    /// which takes the index shared).
    warned: Mutex<HashSet<ObjectKey>>,
}

impl AuthorizationIndex {
    /// Sets (or, `None`, removes) one resource: the Services whose rules it changed.
    pub fn set(&mut self, key: ObjectKey, entry: Option<AuthorizationEntry>) -> Vec<ObjectKey> {
        let mut affected = Vec::new();
        if let Some(old) = self.entries.remove(&key) {
            if entry.as_ref() == Some(&old) {
                self.entries.insert(key, old);
                return affected;
            }
            if let Some(target) = old.target {
                if let Some(keys) = self.by_target.get_mut(&target) {
                    keys.remove(&key);
                    if keys.is_empty() {
                        self.by_target.remove(&target);
                    }
                }
                affected.push(target);
            }
        }
        self.warned
            .get_mut()
            .unwrap_or_else(|poison| poison.into_inner())
            .remove(&key);
        if let Some(entry) = entry {
            match &entry.target {
                Some(target) => {
                    self.by_target
                        .entry(target.clone())
                        .or_default()
                        .insert(key.clone());
                    affected.push(target.clone());
                }
                None => warn!(
                    resource = %key,
                    "MeshAuthorization attaches to nothing: spec.targetRef must name a Service \
                     (kind: Service, group \"\") of its namespace"
                ),
            }
            self.entries.insert(key, entry);
        }
        affected
    }

    /// The resources in `scope` (a namespace, or all), for a re-list.
    pub fn keys(&self, scope: Option<&str>) -> Vec<ObjectKey> {
        self.entries
            .keys()
            .filter(|k| scope.is_none_or(|ns| ns == k.namespace))
            .cloned()
            .collect()
    }

    /// The rules of the Service `service`, whose ports are `ports`: every resource's that
    /// attaches to it; a resource that does not read refuses every call.
    pub fn rules_for(&self, service: &ObjectKey, ports: &[u16]) -> Vec<AuthorizationRule> {
        let Some(keys) = self.by_target.get(service) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for key in keys {
            let Some(entry) = self.entries.get(key) else {
                continue;
            };
            let checked = entry.rules.clone().and_then(|specs| {
                rules::check(&specs, ports).map_err(|e| format!("spec.rules{e}"))
            });
            match checked {
                Ok(rules) => out.extend(rules),
                Err(error) => {
                    let first = self
                        .warned
                        .lock()
                        .unwrap_or_else(|poison| poison.into_inner())
                        .insert(key.clone());
                    if first {
                        warn!(
                            resource = %key,
                            service = %service,
                            "MeshAuthorization does not read ({error}): the Service refuses \
                             every call until it is fixed"
                        );
                    }
                    out.push(refuse_all());
                }
            }
        }
        out
    }
}

/// What a resource that does not read stands for: every call refused.
fn refuse_all() -> AuthorizationRule {
    AuthorizationRule {
        action: Action::Deny,
        from: Vec::new(),
        ports: Vec::new(),
        paths: Vec::new(),
        methods: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn object(name: &str, spec: serde_json::Value) -> MeshAuthorization {
        serde_json::from_value(json!({
            "apiVersion": "lattice.mlab.com/v1alpha1",
            "kind": "MeshAuthorization",
            "metadata": {"namespace": "shop", "name": name},
            "spec": spec,
        }))
        .unwrap()
    }

    /// Rules attach to their Service; two resources add up; a bad one refuses all; removing it
    /// gives the Service back its other rules only.
    #[test]
    fn a_services_rules_are_every_resources_that_targets_it_failing_closed() {
        let web = ObjectKey::new("shop", "web");
        let mut index = AuthorizationIndex::default();
        let good = object(
            "front",
            json!({"targetRef": {"kind": "Service", "name": "web"},
                   "rules": [{"from": [{"serviceAccount": "shop/front"}], "ports": [80]}]}),
        );
        let (key, entry) = authorization_entry(&good);
        assert_eq!(index.set(key, Some(entry)), std::slice::from_ref(&web));
        let rules = index.rules_for(&web, &[80]);
        assert_eq!(rules.len(), 1);
        assert_eq!(rules[0].action, Action::Allow);

        let bad = object(
            "typo",
            json!({"targetRef": {"kind": "Service", "name": "web"},
                   "rules": [{"form": [{"namespace": "ops"}]}]}),
        );
        let (bad_key, entry) = authorization_entry(&bad);
        assert!(entry.rules.is_err());
        index.set(bad_key.clone(), Some(entry));
        assert!(index.rules_for(&web, &[80]).contains(&refuse_all()));
        // A port the Service lacks is the resource's error too.
        assert!(
            index
                .rules_for(&web, &[8080])
                .iter()
                .all(|r| *r == refuse_all())
        );

        assert_eq!(index.set(bad_key, None), std::slice::from_ref(&web));
        assert_eq!(index.rules_for(&web, &[80]).len(), 1);
        assert!(
            index
                .rules_for(&ObjectKey::new("shop", "other"), &[80])
                .is_empty()
        );

        let elsewhere = object(
            "gateway",
            json!({"targetRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                 "name": "web"}, "rules": []}),
        );
        let (key, entry) = authorization_entry(&elsewhere);
        assert_eq!(entry.target, None);
        assert!(index.set(key, Some(entry)).is_empty());
    }
}
