//! The sidecar injector (`lattice webhook`, the real binary) against the fake API server, spoken
//! to as the API server speaks to a webhook: AdmissionReviews over real TLS, its certificate
//! verified against the CA bundle the injector wrote into the webhook configuration of
//! `deploy/injector.yaml`, and each answer's patch applied and parsed into k8s-openapi types.
//!
//! Build the binaries first: `cargo build --workspace --bins`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Pod, Secret};
use lattice_e2e::fake_apiserver::FakeApiServer;
use lattice_e2e::injector::{Injector, SERVICE_NAME, outcome, request, review, tls_client};
use lattice_e2e::wait;
use lattice_inject::certs::Chain;
use serde::Deserialize;
use serde_json::{Value, json};

const H2_AND_H1: &[&[u8]] = &[b"h2", b"http/1.1"];

/// The webhook configuration as `deploy/` installs it.
fn configuration() -> Value {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/injector.yaml"),
    )
    .unwrap();
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap())
        .find(|doc| doc["kind"] == "MutatingWebhookConfiguration")
        .expect("deploy/injector.yaml has a MutatingWebhookConfiguration")
}

/// The CA bundle every webhook of the configuration carries, once they all carry the same one.
fn bundle(api: &FakeApiServer) -> Result<Vec<u8>, String> {
    let configurations = api
        .objects::<MutatingWebhookConfiguration>()
        .map_err(|e| e.to_string())?;
    let webhooks: Vec<_> = configurations
        .iter()
        .flat_map(|c| c.webhooks.iter().flatten())
        .collect();
    let bundles: Vec<_> = webhooks
        .iter()
        .map(|w| w.client_config.ca_bundle.clone())
        .collect();
    match bundles.first() {
        Some(Some(first))
            if bundles.len() == 2 && bundles.iter().all(|b| b.as_ref() == Some(first)) =>
        {
            Ok(first.0.clone())
        }
        _ => Err(format!(
            "bundles: {}",
            bundles.iter().filter(|b| b.is_some()).count()
        )),
    }
}

/// A plain pod, as a ReplicaSet creates it (a generated name, no node yet).
fn pod() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "echo-5d4f8-",
            "namespace": "lattice-demo",
            "labels": {"app.kubernetes.io/name": "echo", "pod-template-hash": "5d4f8"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "echo-5d4f8",
                "uid": "6e2b1c2a-0000-0000-0000-000000000001", "controller": true, "blockOwnerDeletion": true}]
        },
        "spec": {
            "containers": [{
                "name": "app",
                "image": "registry.k8s.io/e2e-test-images/agnhost:2.53",
                "args": ["netexec", "--http-port=8080"],
                "ports": [{"name": "http-echo", "containerPort": 8080, "protocol": "TCP"}],
                "resources": {},
                "terminationMessagePath": "/dev/termination-log",
                "terminationMessagePolicy": "File",
                "imagePullPolicy": "IfNotPresent"
            }],
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 30,
            "dnsPolicy": "ClusterFirst",
            "serviceAccountName": "default",
            "securityContext": {},
            "schedulerName": "default-scheduler",
            "enableServiceLinks": true,
            "preemptionPolicy": "PreemptLowerPriority"
        },
        "status": {}
    })
}

fn names(pod: &Pod) -> Vec<String> {
    let spec = pod.spec.as_ref().unwrap();
    spec.init_containers
        .iter()
        .flatten()
        .map(|c| c.name.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_one_ca_and_answer_reviews_over_verified_tls() {
    let api = FakeApiServer::start().unwrap();
    let (_dir, kubeconfig) = api.kubeconfig_file().unwrap();
    // The first replica starts before its webhook configuration exists: it waits for it.
    let first = Injector::start(&kubeconfig, &[]).unwrap();
    wait::until(
        "the first replica to find no configuration",
        Duration::from_secs(20),
        || {
            let log = first.log();
            if log.contains("does not exist") {
                Ok(())
            } else {
                Err(log)
            }
        },
    )
    .unwrap();
    assert!(bundle(&api).is_err());
    api.apply_json(configuration()).unwrap();
    // The second replica reads its own pod for the image to inject lattice-init from (an
    // overlay moved it to another registry).
    api.apply_json(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "lattice-injector-2", "namespace": "lattice-system"},
        "spec": {"containers": [{"name": "injector", "image": "registry.example/lattice:9.9.9",
            "command": ["lattice", "webhook"]}]}
    }))
    .unwrap();
    let second =
        Injector::start_with_env(&kubeconfig, &[], &[("POD_NAME", "lattice-injector-2")]).unwrap();
    let ca = wait::until_async(
        "both webhooks carry the CA",
        Duration::from_secs(20),
        || async { bundle(&api) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}\n{}", first.log(), second.log()));
    let secrets = api.objects::<Secret>().unwrap();
    assert_eq!(secrets.len(), 1, "one Secret for both replicas");
    let data = secrets[0].data.clone().unwrap();
    assert_eq!(data["ca.crt"].0, ca, "the bundle is the Secret's CA");
    assert_eq!(secrets[0].type_.as_deref(), Some("kubernetes.io/tls"));

    let trusted = tls_client(&ca, H2_AND_H1).unwrap();
    let mut served = Vec::new();
    for injector in [&first, &second] {
        let ready = wait::until_async("the injector is ready", Duration::from_secs(20), || async {
            match request(
                injector.addr,
                trusted.clone(),
                SERVICE_NAME,
                "GET",
                "/readyz",
                vec![],
            )
            .await
            {
                Ok((200, _, cert)) => Ok(cert),
                other => Err(format!("{other:?}")),
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", injector.log()));
        served.push(ready);
    }
    assert_eq!(
        served[0], served[1],
        "both replicas serve the Secret's certificate"
    );

    let post = |addr, body: &Value| {
        let body = serde_json::to_vec(body).unwrap();
        let trusted = trusted.clone();
        async move {
            request(addr, trusted, SERVICE_NAME, "POST", "/inject", body)
                .await
                .unwrap()
        }
    };

    // A pod created in a meshed namespace: patched, and the result is a valid Pod with the
    // mesh's parts, on either replica.
    let plain = pod();
    let mut patches = Vec::new();
    for injector in [&first, &second] {
        let (status, answer, _) = post(
            injector.addr,
            &review("CREATE", "lattice-demo", &plain, false),
        )
        .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
        let (response, patched) = outcome(&answer, &plain).unwrap();
        assert_eq!(response["allowed"], true);
        assert_eq!(response["uid"], "705ab4f5-6393-11e8-b7cc-42010a800002");
        let typed: Pod = serde_json::from_value(patched.clone()).unwrap();
        assert_eq!(names(&typed), ["lattice-init", "lattice-proxy"]);
        let spec = typed.spec.as_ref().unwrap();
        assert_eq!(spec.dns_policy.as_deref(), Some("None"));
        let searches = spec.dns_config.as_ref().unwrap().searches.clone().unwrap();
        assert_eq!(searches[0], "lattice-demo.svc.cluster.local");
        // Nothing of the pod is lost on the way.
        assert_eq!(
            patched["metadata"]["ownerReferences"],
            plain["metadata"]["ownerReferences"]
        );
        assert_eq!(patched["spec"]["containers"], plain["spec"]["containers"]);
        patches.push(typed);
    }
    let image = |pod: &Pod| {
        pod.spec.as_ref().unwrap().init_containers.as_ref().unwrap()[0]
            .image
            .clone()
    };
    assert_eq!(
        image(&patches[0]).as_deref(),
        Some(concat!("lattice:", env!("CARGO_PKG_VERSION")))
    );
    assert_eq!(
        image(&patches[1]).as_deref(),
        Some("registry.example/lattice:9.9.9")
    );
    let (_, answer, _) = post(first.addr, &review("CREATE", "lattice-demo", &plain, false)).await;
    let first_patch = outcome(&answer, &plain).unwrap().0["patch"].clone();

    // A dry run gets the same answer: the webhook has no side effects.
    let (_, answer, _) = post(first.addr, &review("CREATE", "lattice-demo", &plain, true)).await;
    assert_eq!(outcome(&answer, &plain).unwrap().0["patch"], first_patch);

    // Fields newer than the injector's types survive the patch.
    let mut future = pod();
    future["spec"]["containers"][0]["futureField"] = json!({"keep": true});
    future["spec"]["futureSpecField"] = json!([1, 2, 3]);
    let (_, answer, _) = post(
        first.addr,
        &review("CREATE", "lattice-demo", &future, false),
    )
    .await;
    let (_, patched) = outcome(&answer, &future).unwrap();
    assert_eq!(
        patched["spec"]["containers"][0]["futureField"],
        json!({"keep": true})
    );
    assert_eq!(patched["spec"]["futureSpecField"], json!([1, 2, 3]));
    assert_eq!(names(&serde_json::from_value(patched).unwrap()).len(), 2);

    // Admitted unchanged: an update, the system namespaces and the injector's own, a pod that
    // opts out by label.
    let mut opted_out = pod();
    opted_out["metadata"]["labels"]["lattice.mlab.com/inject"] = json!("disabled");
    for (operation, namespace, object) in [
        ("UPDATE", "lattice-demo", &plain),
        ("CREATE", "kube-system", &plain),
        ("CREATE", "lattice-system", &plain),
        ("CREATE", "lattice-demo", &opted_out),
    ] {
        let (status, answer, _) =
            post(first.addr, &review(operation, namespace, object, false)).await;
        assert_eq!(status, 200);
        let (response, patched) = outcome(&answer, object).unwrap();
        assert_eq!(response["allowed"], true, "{operation} {namespace}");
        assert!(
            response["patch"].is_null(),
            "{operation} {namespace}: {response}"
        );
        assert_eq!(&patched, object);
    }

    // A pod the mesh cannot take is admitted as it is, with a warning kubectl shows.
    let mut host = pod();
    host["spec"]["hostNetwork"] = json!(true);
    let (_, answer, _) = post(first.addr, &review("CREATE", "lattice-demo", &host, false)).await;
    let (response, _) = outcome(&answer, &host).unwrap();
    assert_eq!(response["allowed"], true);
    assert!(response["patch"].is_null());
    let warning = response["warnings"][0].as_str().unwrap_or_default();
    assert!(warning.contains("host network"), "{response}");

    // Over HTTP/1.1 too.
    let h1 = tls_client(&ca, &[b"http/1.1"]).unwrap();
    let body = serde_json::to_vec(&review("CREATE", "lattice-demo", &plain, false)).unwrap();
    let (status, answer, _) = request(first.addr, h1, SERVICE_NAME, "POST", "/inject", body)
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert_eq!(outcome(&answer, &plain).unwrap().0["patch"], first_patch);

    // What is no review is refused, and a body past the bound is not read.
    let (status, _, _) = request(
        first.addr,
        trusted.clone(),
        SERVICE_NAME,
        "POST",
        "/inject",
        b"{}".to_vec(),
    )
    .await
    .unwrap();
    assert_eq!(status, 400);
    let huge = vec![b' '; 5 << 20];
    let (status, _, _) = request(
        first.addr,
        trusted.clone(),
        SERVICE_NAME,
        "POST",
        "/inject",
        huge,
    )
    .await
    .unwrap();
    assert_eq!(status, 413);

    // A client that trusts another CA, or asks for another name, does not get through.
    let stranger = Chain::issue(&[SERVICE_NAME.to_string()]).unwrap();
    let untrusting = tls_client(stranger.ca_cert.as_bytes(), H2_AND_H1).unwrap();
    let refused = request(
        first.addr,
        untrusting,
        SERVICE_NAME,
        "GET",
        "/healthz",
        vec![],
    )
    .await;
    assert!(
        refused.is_err(),
        "a certificate from another CA was accepted"
    );
    let wrong_name = request(
        first.addr,
        trusted.clone(),
        "evil.example",
        "GET",
        "/healthz",
        vec![],
    )
    .await;
    assert!(
        wrong_name.is_err(),
        "the certificate was accepted for another name"
    );

    // Metrics count what was decided.
    let (_, metrics, _) = request(
        first.addr,
        trusted.clone(),
        SERVICE_NAME,
        "GET",
        "/metrics",
        vec![],
    )
    .await
    .unwrap();
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(
        metrics.contains(r#"lattice_injector_reviews_total{verdict="injected"} 5"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"lattice_injector_reviews_total{verdict="left"} 1"#),
        "{metrics}"
    );
    let expiry: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("lattice_injector_certificate_expiry_timestamp_seconds "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no expiry gauge:\n{metrics}"));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let days = (expiry - now) / 86_400.0;
    assert!(
        (360.0..=366.0).contains(&days),
        "the serving certificate expires in {days} days"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_certificate_is_served_from_the_next_handshake_and_sigterm_exits() {
    let api = FakeApiServer::start().unwrap();
    api.apply_json(configuration()).unwrap();
    let (_dir, kubeconfig) = api.kubeconfig_file().unwrap();
    let mut injector = Injector::start(&kubeconfig, &["--recheck-secs=1"]).unwrap();
    let ca = wait::until_async("the CA bundle", Duration::from_secs(20), || async {
        bundle(&api)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", injector.log()));
    let trusted = tls_client(&ca, H2_AND_H1).unwrap();
    let ask = || {
        request(
            injector.addr,
            trusted.clone(),
            SERVICE_NAME,
            "GET",
            "/healthz",
            vec![],
        )
    };
    let before = wait::until_async("the injector serves", Duration::from_secs(20), || async {
        ask()
            .await
            .map(|(_, _, cert)| cert)
            .map_err(|e| e.to_string())
    })
    .await
    .unwrap();

    // Another replica renewed the serving certificate (from the same CA) in the Secret.
    let secret = &api.objects::<Secret>().unwrap()[0];
    let chain = lattice_inject::setup::read(secret).unwrap();
    let names = [
        SERVICE_NAME.to_string(),
        format!("{SERVICE_NAME}.cluster.local"),
    ];
    let renewed = chain.renewed(&names).unwrap();
    let mut object = serde_json::to_value(secret).unwrap();
    object["data"]["tls.crt"] = json!(k8s_openapi::ByteString(renewed.cert.clone().into_bytes()));
    object["data"]["tls.key"] = json!(k8s_openapi::ByteString(renewed.key.clone().into_bytes()));
    api.apply_json(object).unwrap();
    let after = wait::until_async(
        "the renewed certificate is served",
        Duration::from_secs(20),
        || async {
            match ask().await {
                Ok((200, _, cert)) if cert != before => Ok(cert),
                other => Err(format!("{:?}", other.map(|(status, _, _)| status))),
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", injector.log()));
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let expected = CertificateDer::from_pem_slice(renewed.cert.as_bytes()).unwrap();
    assert_eq!(after, expected.to_vec());
    assert_eq!(bundle(&api).unwrap(), ca, "the bundle stays: same CA");

    // SIGTERM: it stops, and says so by exiting 0.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(injector.pid() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = wait::until("the injector exits", Duration::from_secs(10), || {
        injector.exited().ok_or_else(|| "running".to_string())
    })
    .unwrap();
    assert!(status.success(), "{status}\n{}", injector.log());
}

/// A plain pod through the webhook, then run on the simulated node exactly as admitted (the
/// injected commands, arguments, environment and users; the DNS as injected; the sidecar's
/// startup probe before the app): the app reaches a mesh service at its first request, through
/// its Envoy, running as the proxy's UID.
#[test]
fn an_injected_pod_runs_as_admitted_and_its_app_reaches_the_mesh_at_its_first_request() {
    use lattice_e2e::kubelet::KubeletPod;
    use lattice_e2e::node::{MeshFile, MeshService, NODE_IP, Node, XDS};

    let node = Node::new("inject").unwrap();
    let backend = node.http_backend("buzz-1", 10, 8080).unwrap();
    let mesh = MeshFile::new(&[MeshService {
        path: "/foo/bar/buzz".into(),
        port: 8080,
        protocol: "http".into(),
        endpoints: vec![backend.pod.address],
    }])
    .unwrap();
    let _agent = node
        .agent(&["--mesh-file", mesh.path().to_str().unwrap()], &[])
        .unwrap();

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let api = FakeApiServer::start().unwrap();
    api.apply_json(configuration()).unwrap();
    let (_dir, kubeconfig) = api.kubeconfig_file().unwrap();
    // The injector as this node's cluster would configure it: the agent at the node's address.
    let injector = Injector::start(
        &kubeconfig,
        &[
            &format!("--xds-address={XDS}"),
            &format!("--nameserver={NODE_IP}"),
        ],
    )
    .unwrap();
    let admitted: Pod = runtime.block_on(async {
        let ca = wait::until_async("the CA bundle", Duration::from_secs(20), || async {
            bundle(&api)
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", injector.log()));
        let trusted = tls_client(&ca, H2_AND_H1).unwrap();
        let plain = pod();
        let body = serde_json::to_vec(&review("CREATE", "lattice-demo", &plain, false)).unwrap();
        let (status, answer, _) =
            wait::until_async("a review answered", Duration::from_secs(20), || async {
                request(
                    injector.addr,
                    trusted.clone(),
                    SERVICE_NAME,
                    "POST",
                    "/inject",
                    body.clone(),
                )
                .await
                .map_err(|e| e.to_string())
            })
            .await
            .unwrap();
        assert_eq!(status, 200);
        serde_json::from_value(outcome(&answer, &plain).unwrap().1).unwrap()
    });
    let spec = admitted.spec.unwrap();

    let mut pod = KubeletPod::start(&node, "echo-5d4f8-abcde", "lattice-demo", 3, &spec)
        .unwrap_or_else(|e| panic!("{e}"));
    // The app's first instruction: a request by name, as its own user (captured; Envoy's
    // own UID is not).
    let url = "http://buzz.bar.foo.system.internal:8080/";
    let first = pod
        .run_as(
            "app",
            "curl",
            &["-4", "-sS", "--max-time", "5", "--fail", url],
        )
        .unwrap();
    assert!(
        first.status.success(),
        "the app's first request failed: {}\n{}",
        String::from_utf8_lossy(&first.stderr),
        pod.log("lattice-proxy")
    );
    assert_eq!(String::from_utf8_lossy(&first.stdout).trim(), "buzz-1");
    assert_eq!(backend.stats().served(), 1, "one request, through the mesh");
    assert_eq!(
        pod.sidecar_uid("lattice-proxy").unwrap(),
        1337,
        "Envoy runs as injected"
    );
    let init = &pod.init_output["lattice-init"];
    assert!(
        init.contains("240.240.0.0/16"),
        "lattice-init captured the trapped block: {init}"
    );
}

/// Given a certificate (cert-manager's, mounted from its Secret), the injector serves it and
/// writes neither a Secret nor the bundle: cert-manager's CA injector owns that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_given_certificate_is_served_and_the_cluster_left_alone() {
    let api = FakeApiServer::start().unwrap();
    api.apply_json(configuration()).unwrap();
    let (_dir, kubeconfig) = api.kubeconfig_file().unwrap();
    let issued = Chain::issue(&[SERVICE_NAME.to_string()]).unwrap();
    let files = tempfile::tempdir().unwrap();
    let (cert, key) = (files.path().join("tls.crt"), files.path().join("tls.key"));
    std::fs::write(&cert, &issued.cert).unwrap();
    std::fs::write(&key, &issued.key).unwrap();
    let injector = Injector::start(
        &kubeconfig,
        &[
            &format!("--tls-cert-file={}", cert.display()),
            &format!("--tls-key-file={}", key.display()),
        ],
    )
    .unwrap();
    let trusted = tls_client(issued.ca_cert.as_bytes(), H2_AND_H1).unwrap();
    let (status, _, _) =
        wait::until_async("the injector serves", Duration::from_secs(20), || async {
            request(
                injector.addr,
                trusted.clone(),
                SERVICE_NAME,
                "GET",
                "/readyz",
                vec![],
            )
            .await
            .map_err(|e| format!("{e}\n{}", injector.log()))
        })
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert!(
        api.objects::<Secret>().unwrap().is_empty(),
        "no Secret written"
    );
    assert!(bundle(&api).is_err(), "no bundle written");
}
