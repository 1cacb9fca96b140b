//! Pods whose inbound listener takes mesh mTLS, and as whom: the pods the injector labelled for
//! inbound capture, read by a metadata-only watch filtered by that label (labels and
//! annotations, no spec or status: a few hundred bytes a pod on the wire, and what is kept is
//! a hash, a namespace and an identity, about 100 bytes a pod). A Service whose every endpoint
//! is such a pod is called over mesh mTLS, accepting their identities; one with any other
//! endpoint stays plaintext, which a permissive pod still takes.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tracing::warn;

use super::mapping::{ObjectKey, pod_ref};
use crate::trust::SpiffeId;

/// The label the injector sets on a pod whose inbound TCP it captures.
pub const MESHED_LABEL: &str = "lattice.mlab.com/inbound-capture";
/// The watch's label selector.
pub const MESHED_SELECTOR: &str = "lattice.mlab.com/inbound-capture=enabled";
/// The pod's service account, which the injector copies from its spec: a metadata-only watch
/// sees no spec.
pub const SERVICE_ACCOUNT_ANNOTATION: &str = "lattice.mlab.com/service-account";

/// A meshed pod as its watch reads it: its key, and its service account if it names one.
pub fn meshed_entry(meta: &ObjectMeta) -> (ObjectKey, Option<Arc<str>>) {
    let account = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(SERVICE_ACCOUNT_ANNOTATION))
        .map(|a| Arc::from(a.trim()));
    (ObjectKey::of(meta), account)
}

/// The meshed pods of the watched namespaces, by [`pod_ref`].
#[derive(Debug)]
pub struct MeshedPods {
    trust_domain: String,
    /// Pod → its namespace and SPIFFE ID.
    pods: HashMap<u64, (Arc<str>, Arc<str>)>,
    /// Pods that came, went or changed identity since [`MeshedPods::take_changed`].
    changed: HashSet<u64>,
}

impl MeshedPods {
    pub fn new(trust_domain: &str) -> Self {
        MeshedPods {
            trust_domain: trust_domain.to_string(),
            pods: HashMap::new(),
            changed: HashSet::new(),
        }
    }

    /// Sets one pod: meshed as `account`, or (`None`: gone, or naming no service account)
    /// not known to take mTLS.
    pub fn set(&mut self, key: &ObjectKey, account: Option<&str>) {
        let hash = pod_ref(&key.namespace, &key.name);
        let identity = account.and_then(|account| {
            match SpiffeId::new(&self.trust_domain, &key.namespace, account) {
                Ok(id) => Some(Arc::<str>::from(id.to_string())),
                Err(error) => {
                    warn!(pod = %key, %error, "a meshed pod's {SERVICE_ACCOUNT_ANNOTATION} makes no identity: its Services stay plaintext");
                    None
                }
            }
        });
        let now = identity.map(|id| (Arc::from(key.namespace.as_str()), id));
        let before = match &now {
            Some(entry) => self.pods.insert(hash, entry.clone()),
            None => self.pods.remove(&hash),
        };
        if before != now {
            self.changed.insert(hash);
        }
    }

    /// Makes the pods of `scope` (a namespace, or all) exactly `listed`: a re-list.
    pub fn replace(&mut self, scope: Option<&str>, listed: Vec<(ObjectKey, Option<Arc<str>>)>) {
        let keep: HashSet<u64> = listed
            .iter()
            .map(|(key, _)| pod_ref(&key.namespace, &key.name))
            .collect();
        let gone: Vec<u64> = self
            .pods
            .iter()
            .filter(|(hash, (namespace, _))| {
                scope.is_none_or(|s| s == &**namespace) && !keep.contains(*hash)
            })
            .map(|(hash, _)| *hash)
            .collect();
        for hash in gone {
            self.pods.remove(&hash);
            self.changed.insert(hash);
        }
        for (key, account) in listed {
            self.set(&key, account.as_deref());
        }
    }

    /// The pods that changed since the last call.
    pub fn take_changed(&mut self) -> HashSet<u64> {
        std::mem::take(&mut self.changed)
    }

    /// The identities a Service's endpoints present: every one's, sorted, when all of them
    /// are meshed pods; none when any is not (or there are none).
    pub fn identities(&self, pods: impl IntoIterator<Item = Option<u64>>) -> Vec<Arc<str>> {
        let mut identities: BTreeSet<Arc<str>> = BTreeSet::new();
        for pod in pods {
            match pod.and_then(|hash| self.pods.get(&hash)) {
                Some((_, identity)) => {
                    identities.insert(identity.clone());
                }
                None => return Vec::new(),
            }
        }
        identities.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_is_meshed_only_when_every_endpoint_is() {
        let mut pods = MeshedPods::new("cluster.local");
        let web = ObjectKey::new("shop", "web-1");
        let web2 = ObjectKey::new("shop", "web-2");
        pods.set(&web, Some("web"));
        pods.set(&web2, Some("web-v2"));
        let changed = pods.take_changed();
        assert_eq!(changed.len(), 2);
        let refs = |keys: &[&ObjectKey]| -> Vec<Option<u64>> {
            keys.iter()
                .map(|k| Some(pod_ref(&k.namespace, &k.name)))
                .collect()
        };
        let ids: Vec<String> = pods
            .identities(refs(&[&web, &web2, &web]))
            .iter()
            .map(|i| i.to_string())
            .collect();
        assert_eq!(
            ids,
            [
                "spiffe://cluster.local/ns/shop/sa/web",
                "spiffe://cluster.local/ns/shop/sa/web-v2"
            ]
        );
        let other = ObjectKey::new("shop", "legacy-0");
        assert!(pods.identities(refs(&[&web, &other])).is_empty());
        assert!(pods.identities([Some(1), None]).is_empty());
        assert!(pods.identities([]).is_empty());

        // A bad service account is no identity; a re-list drops what it does not name.
        pods.set(&web2, Some("Not_A_Name"));
        assert!(pods.identities(refs(&[&web2])).is_empty());
        pods.replace(Some("shop"), vec![(web2.clone(), Some(Arc::from("web")))]);
        assert!(pods.identities(refs(&[&web])).is_empty());
        assert_eq!(pods.identities(refs(&[&web2])).len(), 1);
        pods.set(&web2, None);
        assert!(pods.identities(refs(&[&web2])).is_empty());
    }
}
