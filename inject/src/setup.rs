//! What the injector keeps in the cluster so the API server can call it, without a manual
//! step: the Secret with its CA and serving certificate ([`crate::certs`]), and the CA in the
//! `caBundle` of each webhook of its MutatingWebhookConfiguration that calls its Service.
//!
//! Several replicas start at once and agree without a lock: each reads the Secret and creates
//! it only if absent, and every write carries the resourceVersion it read, so of two replicas
//! that race, one write wins and the other, refused with a conflict, reads the winner's and
//! uses it. The bundle is written only when it differs, the same way.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ObjectMeta, PostParams};
use time::OffsetDateTime;

use crate::certs::{CA_CRT, CA_KEY, CertError, Chain, Health, TLS_CRT, TLS_KEY};

/// Writes that lose a race are retried this many times.
const ATTEMPTS: usize = 5;

/// Where the injector's cluster state lives.
#[derive(Clone, Debug)]
pub struct Target {
    /// The injector's namespace, its Service's and its Secret's.
    pub namespace: String,
    pub service: String,
    pub secret: String,
    /// The MutatingWebhookConfiguration whose webhooks call the Service.
    pub webhook_configuration: String,
}

impl Target {
    /// The names the API server calls the Service by.
    pub fn dns_names(&self) -> Vec<String> {
        let (service, namespace) = (&self.service, &self.namespace);
        vec![
            format!("{service}.{namespace}.svc"),
            format!("{service}.{namespace}.svc.cluster.local"),
        ]
    }
}

/// Why the cluster state could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("the Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Cert(#[from] CertError),
    #[error(
        "MutatingWebhookConfiguration {0} does not exist (it is part of deploy/; install it \
         first)"
    )]
    NoConfiguration(String),
    #[error("MutatingWebhookConfiguration {name} has no webhook calling Service {service}")]
    NoWebhook { name: String, service: String },
    #[error("{what} kept changing under us ({ATTEMPTS} attempts)")]
    Contended { what: &'static str },
}

/// The chain in the Secret: read, created if absent, renewed if due. Returns it, and whether
/// this call wrote it.
pub async fn ensure_chain(
    client: &kube::Client,
    target: &Target,
) -> Result<(Chain, bool), SetupError> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &target.namespace);
    let names = target.dns_names();
    for _ in 0..ATTEMPTS {
        let Some(current) = secrets.get_opt(&target.secret).await? else {
            let chain = Chain::issue(&names)?;
            match secrets
                .create(&PostParams::default(), &secret(target, &chain, None))
                .await
            {
                Ok(_) => {
                    tracing::info!(secret = %target.secret, "issued the webhook's CA and serving certificate");
                    return Ok((chain, true));
                }
                Err(e) if is_conflict(&e) => continue,
                Err(e) => return Err(e.into()),
            }
        };
        let (next, why) = match read(&current) {
            Some(chain) => match chain.check(&names, OffsetDateTime::now_utc()) {
                Ok(Health::Good) => return Ok((chain, false)),
                Ok(Health::RenewServing) => (chain.renewed(&names)?, "serving certificate due"),
                Ok(Health::ReplaceCa) => (Chain::issue(&names)?, "CA due"),
                Err(e) => (Chain::issue(&names)?, unreadable(&e)),
            },
            None => (Chain::issue(&names)?, "the Secret lacks a key"),
        };
        let version = current.metadata.resource_version.clone();
        match secrets
            .replace(
                &target.secret,
                &PostParams::default(),
                &secret(target, &next, version),
            )
            .await
        {
            Ok(_) => {
                tracing::info!(secret = %target.secret, why, "renewed the webhook's certificate");
                return Ok((next, true));
            }
            Err(e) if is_conflict(&e) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(SetupError::Contended { what: "the Secret" })
}

fn unreadable(error: &CertError) -> &'static str {
    tracing::warn!(%error, "the Secret's CA is unreadable: replacing it");
    "unreadable CA"
}

/// The CA in the `caBundle` of every webhook of the configuration that calls the Service.
/// Returns whether it was written.
pub async fn ensure_bundle(
    client: &kube::Client,
    target: &Target,
    ca_pem: &str,
) -> Result<bool, SetupError> {
    let configurations: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let bundle = ByteString(ca_pem.as_bytes().to_vec());
    for _ in 0..ATTEMPTS {
        let Some(mut configuration) = configurations
            .get_opt(&target.webhook_configuration)
            .await?
        else {
            return Err(SetupError::NoConfiguration(
                target.webhook_configuration.clone(),
            ));
        };
        let mut ours = 0;
        let mut changed = false;
        for webhook in configuration.webhooks.iter_mut().flatten() {
            let calls_us = webhook
                .client_config
                .service
                .as_ref()
                .is_some_and(|s| s.name == target.service && s.namespace == target.namespace);
            if !calls_us {
                continue;
            }
            ours += 1;
            if webhook.client_config.ca_bundle.as_ref() != Some(&bundle) {
                webhook.client_config.ca_bundle = Some(bundle.clone());
                changed = true;
            }
        }
        if ours == 0 {
            return Err(SetupError::NoWebhook {
                name: target.webhook_configuration.clone(),
                service: format!("{}/{}", target.namespace, target.service),
            });
        }
        if !changed {
            return Ok(false);
        }
        match configurations
            .replace(
                &target.webhook_configuration,
                &PostParams::default(),
                &configuration,
            )
            .await
        {
            Ok(_) => {
                tracing::info!(configuration = %target.webhook_configuration, webhooks = ours, "wrote the CA bundle");
                return Ok(true);
            }
            Err(e) if is_conflict(&e) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(SetupError::Contended {
        what: "the MutatingWebhookConfiguration",
    })
}

/// A create that found the name taken, or an update that found a newer version.
fn is_conflict(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 409)
}

/// The chain a Secret holds, if it has every key.
pub fn read(secret: &Secret) -> Option<Chain> {
    let data = secret.data.as_ref()?;
    let text = |key: &str| {
        data.get(key)
            .and_then(|bytes| String::from_utf8(bytes.0.clone()).ok())
    };
    Some(Chain {
        ca_cert: text(CA_CRT)?,
        ca_key: text(CA_KEY)?,
        cert: text(TLS_CRT)?,
        key: text(TLS_KEY)?,
    })
}

fn secret(target: &Target, chain: &Chain, resource_version: Option<String>) -> Secret {
    let bytes = |text: &str| ByteString(text.as_bytes().to_vec());
    Secret {
        metadata: ObjectMeta {
            name: Some(target.secret.clone()),
            namespace: Some(target.namespace.clone()),
            resource_version,
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/name".to_string(),
                "lattice-injector".to_string(),
            )])),
            ..ObjectMeta::default()
        },
        type_: Some("kubernetes.io/tls".to_string()),
        data: Some(BTreeMap::from([
            (TLS_CRT.to_string(), bytes(&chain.cert)),
            (TLS_KEY.to_string(), bytes(&chain.key)),
            (CA_CRT.to_string(), bytes(&chain.ca_cert)),
            (CA_KEY.to_string(), bytes(&chain.ca_key)),
        ])),
        ..Secret::default()
    }
}
