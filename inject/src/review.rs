//! One admission review: the API server sends a Pod being created, the injector answers with
//! the template's patch ([`crate::template::inject`]) or with the pod unchanged. A pod is never
//! refused: one the mesh cannot take is admitted as it is, with a warning `kubectl` shows
//! (`lattice: left out of the mesh: on the host network`), so a workload that cannot be
//! meshed still runs, and says why.
//!
//! Only pod creation is changed. An update is admitted unchanged (a pod's containers cannot
//! change after creation); so is a pod of a system namespace or of the injector's own, whatever
//! the webhook configuration's selectors say. A dry run gets the same answer as the real thing:
//! the webhook has no side effects. A pod opts out with the label or the annotation
//! `lattice.mlab.com/inject: disabled`.

use k8s_openapi::ByteString;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use serde_json::Value;

use crate::annotations::{INJECT, Wish, shown};
use crate::config::InjectConfig;
use crate::template::{self, Skip};

/// Namespaces whose pods are never changed: the cluster's own.
pub const SYSTEM_NAMESPACES: &[&str] = &["kube-system", "kube-public", "kube-node-lease"];

/// What the webhook decides with.
#[derive(Clone, Debug)]
pub struct Policy {
    pub config: InjectConfig,
    /// The injector's namespace: its own pods are never changed (it must start while it is
    /// down).
    pub own_namespace: String,
}

/// What became of a review, for the log and the metrics.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The pod was put in the mesh.
    Injected,
    /// The pod is as the mesh wants it (already in it, or opted out).
    Settled(Skip),
    /// The pod was admitted without the mesh, with a warning.
    Left(Skip),
    /// Not a pod creation the injector looks at (an update, another resource, a system
    /// namespace).
    Ignored(&'static str),
}

impl Verdict {
    /// The metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Verdict::Injected => "injected",
            Verdict::Settled(_) => "settled",
            Verdict::Left(_) => "left",
            Verdict::Ignored(_) => "ignored",
        }
    }
}

/// Why a request body was no review.
#[derive(Debug, thiserror::Error)]
#[error("not an AdmissionReview request: {0}")]
pub struct BadReview(String);

/// Answers the review in `body`: the response review's JSON, and what was decided.
pub fn review(body: &[u8], policy: &Policy) -> Result<(Vec<u8>, Verdict), BadReview> {
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_slice(body).map_err(|e| BadReview(shown(&e.to_string())))?;
    let request: AdmissionRequest<DynamicObject> =
        review
            .try_into()
            .map_err(|e: kube::core::admission::ConvertAdmissionReviewError| {
                BadReview(e.to_string())
            })?;
    let (response, verdict) = decide(&request, policy);
    let mut answer =
        serde_json::to_value(response.into_review()).map_err(|e| BadReview(e.to_string()))?;
    // kube-core serialises the patch as its `Vec<u8>`, a JSON array of numbers. Go's decoder
    // takes that too, but the API documents `patch` as base64 (`[]byte`), as every webhook
    // sends it and at a quarter of the size: written so here.
    if let Some(patch) = answer["response"].get_mut("patch")
        && let Ok(bytes) = serde_json::from_value::<Vec<u8>>(patch.clone())
    {
        *patch = serde_json::to_value(ByteString(bytes)).map_err(|e| BadReview(e.to_string()))?;
    }
    let out = serde_json::to_vec(&answer).map_err(|e| BadReview(e.to_string()))?;
    Ok((out, verdict))
}

fn decide(
    request: &AdmissionRequest<DynamicObject>,
    policy: &Policy,
) -> (AdmissionResponse, Verdict) {
    let allowed = AdmissionResponse::from(request);
    let is_pod = request.resource.group.is_empty()
        && request.resource.resource == "pods"
        && request.sub_resource.is_none();
    if !is_pod {
        return (allowed, Verdict::Ignored("not a pod"));
    }
    if request.operation != Operation::Create {
        return (allowed, Verdict::Ignored("not a creation"));
    }
    let namespace = request
        .namespace
        .clone()
        .or_else(|| {
            request
                .object
                .as_ref()
                .and_then(|o| o.metadata.namespace.clone())
        })
        .unwrap_or_else(|| "default".to_string());
    if SYSTEM_NAMESPACES.contains(&namespace.as_str()) || namespace == policy.own_namespace {
        return (
            allowed,
            Verdict::Ignored("a system namespace or the injector's own"),
        );
    }
    let Some(object) = &request.object else {
        return (allowed, Verdict::Ignored("no object"));
    };
    let opted_out = object
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(INJECT))
        .is_some_and(|v| Wish::parse(v) == Some(Wish::Disabled));
    if opted_out {
        return (allowed, Verdict::Settled(Skip::OptedOut));
    }
    let pod: Value = match serde_json::to_value(object) {
        Ok(pod) => pod,
        Err(e) => return (allowed, Verdict::Left(Skip::NotAPod(shown(&e.to_string())))),
    };
    match template::inject(&pod, &namespace, &policy.config) {
        Ok(patch) => match allowed.clone().with_patch(patch) {
            Ok(patched) => (patched, Verdict::Injected),
            Err(e) => (allowed, Verdict::Left(Skip::NotAPod(shown(&e.to_string())))),
        },
        Err(skip) if skip.is_settled() => (allowed, Verdict::Settled(skip)),
        Err(skip) => {
            let mut response = allowed;
            response.warnings = Some(vec![format!("lattice: left out of the mesh: {skip}")]);
            (response, Verdict::Left(skip))
        }
    }
}
