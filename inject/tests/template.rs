//! The pod template over real pod specs: what it adds, what it refuses, that it loses nothing
//! of the pod, that a second run changes nothing, and that `uninject` gives the pod back.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use lattice_inject::annotations::{BadAnnotation, INJECTED};
use lattice_inject::template::{INIT_CONTAINER, PROXY_CONTAINER, READY_PORT, RUN_VOLUME, VOLUME};
use lattice_inject::{InjectConfig, Skip, inject, uninject};
use proptest::prelude::*;
use serde_json::{Value, json};

fn yaml(text: &str) -> Value {
    serde_norway::from_str(text).unwrap()
}

/// `pod` (metadata and spec) injected, the patch applied to its JSON.
fn injected(pod: &Value, namespace: &str) -> Result<Value, Skip> {
    let patch = inject(pod, namespace, &InjectConfig::default())?;
    let mut out = pod.clone();
    json_patch::patch(&mut out, &patch).unwrap();
    Ok(out)
}

fn uninjected(pod: &Value) -> Value {
    let patch = uninject(pod).unwrap();
    let mut out = pod.clone();
    json_patch::patch(&mut out, &patch).unwrap();
    out
}

fn spec(pod: &Value) -> PodSpec {
    serde_json::from_value(pod["spec"].clone()).unwrap()
}

fn names(containers: &[Container]) -> Vec<&str> {
    containers.iter().map(|c| c.name.as_str()).collect()
}

/// A web Deployment's pod template as charts write them: two containers with named and
/// numbered ports, an init container of its own, a dnsConfig with an option, volumes.
const WEB: &str = r#"
metadata:
  labels: {app.kubernetes.io/name: web}
  annotations: {prometheus.io/scrape: "true"}
spec:
  serviceAccountName: web
  securityContext: {runAsNonRoot: true, runAsUser: 1000, fsGroup: 2000}
  initContainers:
    - name: migrate
      image: example/web:1.2
      command: ["/app/migrate"]
  containers:
    - name: web
      image: example/web:1.2
      ports:
        - {name: http, containerPort: 8080}
        - {containerPort: 9090, protocol: TCP}
      volumeMounts: [{name: cache, mountPath: /cache}]
    - name: log-shipper
      image: example/shipper:0.3
      securityContext: {runAsUser: 1001}
  volumes:
    - {name: cache, emptyDir: {}}
  dnsConfig:
    searches: [corp.example]
    options: [{name: edns0}]
"#;

#[test]
fn a_chart_pod_gets_the_mesh_first_and_keeps_everything_of_its_own() {
    let pod = yaml(WEB);
    let out = injected(&pod, "shop").unwrap();
    let spec = spec(&out);
    let init = spec.init_containers.as_deref().unwrap();
    // The mesh's init container first, Envoy next: the pod's own init container (a migration
    // that may dial a mesh service) runs once the proxy is up.
    assert_eq!(names(init), [INIT_CONTAINER, PROXY_CONTAINER, "migrate"]);
    assert_eq!(names(&spec.containers), ["web", "log-shipper"]);
    let volumes: Vec<&str> = spec
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    assert_eq!(volumes, ["cache", VOLUME, RUN_VOLUME]);
    assert_eq!(spec.dns_policy.as_deref(), Some("None"));
    let dns = spec.dns_config.unwrap();
    assert_eq!(dns.nameservers.unwrap(), ["169.254.20.10"]);
    assert_eq!(
        dns.searches.unwrap(),
        [
            "shop.svc.cluster.local",
            "svc.cluster.local",
            "cluster.local",
            "corp.example"
        ]
    );
    let options: Vec<_> = dns
        .options
        .unwrap()
        .into_iter()
        .map(|o| o.name.unwrap())
        .collect();
    assert_eq!(options, ["ndots", "edns0"]);
    // Everything that was there is there, unchanged.
    assert_eq!(out["spec"]["containers"], pod["spec"]["containers"]);
    assert_eq!(
        out["spec"]["securityContext"],
        pod["spec"]["securityContext"]
    );
    assert_eq!(
        out["spec"]["initContainers"][2],
        pod["spec"]["initContainers"][0]
    );
    // Its labels, and the one that says it is meshed: inbound capture is the default.
    let mut labels = pod["metadata"]["labels"].clone();
    labels["lattice.mlab.com/inbound-capture"] = json!("enabled");
    assert_eq!(out["metadata"]["labels"], labels);
    assert_eq!(
        out["metadata"]["annotations"]["prometheus.io/scrape"],
        "true"
    );
    assert!(out["metadata"]["annotations"][INJECTED].is_string());

    // The proxy as lattice-init exempts it, ready on the port its probes ask.
    let proxy = &init[1];
    let security = proxy.security_context.as_ref().unwrap();
    assert_eq!(security.run_as_user, Some(1337));
    assert_eq!(proxy.restart_policy.as_deref(), Some("Always"));
    let port = &proxy.ports.as_deref().unwrap()[0];
    assert_eq!(
        (port.name.as_deref(), port.container_port),
        (Some(READY_PORT), 15021)
    );
    // The pod's security context says runAsUser 1000: the mesh's containers set their own.
    assert_eq!(
        init[0].security_context.as_ref().unwrap().run_as_user,
        Some(0)
    );
}

#[test]
fn a_bare_pod_gets_every_field_it_lacks_and_parses_as_a_pod() {
    let pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "spec": {"containers": [{"name": "app", "image": "app"}]}
    });
    let out = injected(&pod, "default").unwrap();
    let typed: Pod = serde_json::from_value(out.clone()).unwrap();
    let spec = typed.spec.unwrap();
    assert_eq!(
        names(spec.init_containers.as_deref().unwrap()),
        [INIT_CONTAINER, PROXY_CONTAINER]
    );
    assert_eq!(spec.volumes.unwrap().len(), 2);
    assert!(typed.metadata.annotations.unwrap().contains_key(INJECTED));
    assert_eq!(uninjected(&out), pod);
}

#[test]
fn fields_the_kubernetes_types_do_not_know_survive() {
    let mut pod = yaml(WEB);
    pod["spec"]["containers"][0]["fieldFromTheFuture"] = json!({"keep": [1, 2]});
    pod["spec"]["specFieldFromTheFuture"] = json!(true);
    let out = injected(&pod, "shop").unwrap();
    assert_eq!(
        out["spec"]["containers"][0]["fieldFromTheFuture"],
        json!({"keep": [1, 2]})
    );
    assert_eq!(out["spec"]["specFieldFromTheFuture"], json!(true));
    assert_eq!(uninjected(&out), pod);
}

#[test]
fn a_second_run_changes_nothing() {
    let once = injected(&yaml(WEB), "shop").unwrap();
    assert_eq!(injected(&once, "shop"), Err(Skip::AlreadyInjected));
    // A pod put in the mesh by hand (lattice-init, no record) is in the mesh too.
    let by_hand = json!({"spec": {
        "initContainers": [{"name": "lattice-init", "image": "lattice"}],
        "containers": [{"name": "app", "image": "app"}]
    }});
    assert_eq!(injected(&by_hand, "shop"), Err(Skip::AlreadyInjected));
}

/// What a case is, the change it makes to a pod, and the refusal it expects.
type Case = (&'static str, Box<dyn Fn(&mut Value)>, fn(&Skip) -> bool);

#[test]
fn pods_the_mesh_cannot_take_are_left_alone_with_the_reason() {
    let base = || yaml(WEB);
    let cases: Vec<Case> = vec![
        (
            "host network",
            Box::new(|p| p["spec"]["hostNetwork"] = json!(true)),
            |s| matches!(s, Skip::HostNetwork),
        ),
        (
            "a container as the proxy's UID",
            Box::new(|p| p["spec"]["containers"][1]["securityContext"]["runAsUser"] = json!(1337)),
            |s| matches!(s, Skip::ProxyUid { container } if container == "log-shipper"),
        ),
        (
            "the pod as the proxy's UID, a container without its own",
            Box::new(|p| p["spec"]["securityContext"]["runAsUser"] = json!(1337)),
            |s| matches!(s, Skip::ProxyUid { container } if container == "migrate"),
        ),
        (
            "dnsPolicy Default",
            Box::new(|p| p["spec"]["dnsPolicy"] = json!("Default")),
            |s| matches!(s, Skip::DnsPolicy { policy } if policy == "Default"),
        ),
        (
            "nameservers of its own",
            Box::new(|p| p["spec"]["dnsConfig"]["nameservers"] = json!(["10.0.0.10"])),
            |s| matches!(s, Skip::DnsNameservers),
        ),
        (
            "a Windows node selector",
            Box::new(|p| p["spec"]["nodeSelector"] = json!({"kubernetes.io/os": "windows"})),
            |s| matches!(s, Skip::Windows),
        ),
        (
            "Windows as its OS",
            Box::new(|p| p["spec"]["os"] = json!({"name": "windows"})),
            |s| matches!(s, Skip::Windows),
        ),
        (
            "the mesh's volume name taken",
            Box::new(|p| p["spec"]["volumes"][0]["name"] = json!(VOLUME)),
            |s| matches!(s, Skip::NameTaken { what: "volume", .. }),
        ),
        (
            "lattice-init's volume name taken",
            Box::new(|p| p["spec"]["volumes"][0]["name"] = json!(RUN_VOLUME)),
            |s| matches!(s, Skip::NameTaken { what: "volume", .. }),
        ),
        (
            "the proxy's container name taken",
            Box::new(|p| p["spec"]["containers"][1]["name"] = json!(PROXY_CONTAINER)),
            |s| {
                matches!(
                    s,
                    Skip::NameTaken {
                        what: "container",
                        ..
                    }
                )
            },
        ),
        (
            "the readiness port's name taken",
            Box::new(|p| p["spec"]["containers"][0]["ports"][0]["name"] = json!(READY_PORT)),
            |s| {
                matches!(
                    s,
                    Skip::NameTaken {
                        what: "port name",
                        ..
                    }
                )
            },
        ),
        (
            "opted out",
            Box::new(|p| {
                p["metadata"]["annotations"]["lattice.mlab.com/inject"] = json!("disabled")
            }),
            |s| matches!(s, Skip::OptedOut),
        ),
        (
            "a proxy memory that is no quantity",
            Box::new(|p| {
                p["metadata"]["annotations"]["lattice.mlab.com/proxy-memory"] = json!("lots")
            }),
            |s| {
                matches!(
                    s,
                    Skip::BadAnnotation(BadAnnotation {
                        key: "lattice.mlab.com/proxy-memory",
                        ..
                    })
                )
            },
        ),
        (
            "no containers",
            Box::new(|p| p["spec"] = json!({"volumes": []})),
            |s| matches!(s, Skip::NotAPod(_)),
        ),
    ];
    for (what, change, expected) in cases {
        let mut pod = base();
        change(&mut pod);
        let skip = injected(&pod, "shop").expect_err(what);
        assert!(expected(&skip), "{what}: {skip:?}");
        assert!(!skip.to_string().is_empty());
    }
    // ClusterFirstWithHostNet without the host network is ClusterFirst: meshed.
    let mut pod = base();
    pod["spec"]["dnsPolicy"] = json!("ClusterFirstWithHostNet");
    assert!(injected(&pod, "shop").is_ok());
}

#[test]
fn annotations_steer_the_proxy() {
    let mut pod = yaml(WEB);
    let annotations = &mut pod["metadata"]["annotations"];
    annotations["lattice.mlab.com/proxy-cpu"] = json!("250m");
    annotations["lattice.mlab.com/proxy-memory"] = json!("128Mi");
    annotations["lattice.mlab.com/proxy-memory-limit"] = json!("1Gi");
    annotations["lattice.mlab.com/exclude-uids"] = json!("1001, 1002");
    annotations["lattice.mlab.com/xds-mode"] = json!("sotw");
    let out = injected(&pod, "shop").unwrap();
    let spec = spec(&out);
    let init = spec.init_containers.unwrap();
    let args = init[0].args.clone().unwrap();
    assert!(args.contains(&"--xds-mode=sotw".to_string()), "{args:?}");
    assert!(
        args.contains(&"--exclude-uid=1001,1002".to_string()),
        "{args:?}"
    );
    let resources = init[1].resources.clone().unwrap();
    let requests = resources.requests.unwrap();
    assert_eq!(requests["cpu"].0, "250m");
    assert_eq!(requests["memory"].0, "128Mi");
    assert_eq!(resources.limits.unwrap()["memory"].0, "1Gi");
}

#[test]
fn a_deployment_injected_parses_into_k8s_openapi_types_without_a_field_lost() {
    let mut deployment = json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": "web"}}, "template": yaml(WEB)}
    });
    let template = deployment["spec"]["template"].clone();
    deployment["spec"]["template"] = injected(&template, "shop").unwrap();
    let typed: Deployment = serde_json::from_value(deployment.clone()).unwrap();
    assert_eq!(serde_json::to_value(&typed).unwrap(), deployment);
}

/// A pod spec's shape: which optional fields it has, and how many of each list.
fn pod_strategy() -> impl Strategy<Value = Value> {
    (
        (any::<bool>(), any::<bool>(), 0..3usize),
        (0..3usize, 1..3usize, 0..3usize),
        (
            any::<bool>(),
            prop::option::of("ClusterFirst|ClusterFirstWithHostNet"),
        ),
        (any::<bool>(), any::<bool>()),
        (prop::option::of(prop::bool::ANY), any::<bool>()),
    )
        .prop_map(
            |(
                (metadata, annotations, labels),
                (init, containers, volumes),
                (dns, policy),
                (searches, options),
                (inbound, account),
            )| {
                let mut pod = json!({"spec": {}});
                if metadata {
                    pod["metadata"] = json!({"name": "p"});
                    if annotations {
                        pod["metadata"]["annotations"] = json!({"a": "1"});
                    }
                    // Inbound capture asked for, opted out of, or left to the default.
                    if let Some(inbound) = inbound {
                        pod["metadata"]["annotations"]["lattice.mlab.com/inbound-capture"] =
                            json!(if inbound { "enabled" } else { "disabled" });
                    }
                    if labels > 0 {
                        pod["metadata"]["labels"] = json!({"app": "x"});
                    }
                }
                if account {
                    pod["spec"]["serviceAccountName"] = json!("web");
                }
                let spec = &mut pod["spec"];
                if init > 0 {
                    spec["initContainers"] = (0..init)
                        .map(|i| json!({"name": format!("i{i}"), "image": "i"}))
                        .collect();
                }
                spec["containers"] = (0..containers)
                    .map(|i| json!({"name": format!("c{i}"), "image": "c"}))
                    .collect();
                if volumes > 0 {
                    spec["volumes"] = (0..volumes)
                        .map(|i| json!({"name": format!("v{i}"), "emptyDir": {}}))
                        .collect();
                }
                if let Some(policy) = policy {
                    spec["dnsPolicy"] = json!(policy);
                }
                if dns {
                    spec["dnsConfig"] = json!({});
                    if searches {
                        spec["dnsConfig"]["searches"] = json!(["corp.example"]);
                    }
                    if options {
                        spec["dnsConfig"]["options"] = json!([{"name": "ndots", "value": "2"}]);
                    }
                }
                pod
            },
        )
}

proptest! {
    /// Whatever the pod's shape: injected, it parses as a pod with the mesh's parts once;
    /// injected again, it is unchanged; uninjected, it is the pod it was.
    #[test]
    fn inject_then_uninject_is_the_pod_it_was(pod in pod_strategy()) {
        let out = injected(&pod, "ns").unwrap();
        let spec = spec(&out);
        let init = spec.init_containers.clone().unwrap();
        prop_assert_eq!(init.iter().filter(|c| c.name == INIT_CONTAINER).count(), 1);
        prop_assert_eq!(&init[1].name, PROXY_CONTAINER);
        prop_assert_eq!(injected(&out, "ns"), Err(Skip::AlreadyInjected));
        // Inbound capture: the label the agents select meshed pods by, and the service
        // account beside it.
        // The default, unless the pod opts out.
        let inbound = pod["metadata"]["annotations"]["lattice.mlab.com/inbound-capture"] != "disabled";
        let labelled = out["metadata"]["labels"]["lattice.mlab.com/inbound-capture"] == "enabled";
        prop_assert_eq!(labelled, inbound);
        if inbound {
            // The pod says it is captured, for agents that read only the annotation.
            prop_assert_eq!(
                out["metadata"]["annotations"]["lattice.mlab.com/inbound-capture"].as_str(),
                Some("enabled")
            );
            let account = pod["spec"]["serviceAccountName"].as_str().unwrap_or("default");
            prop_assert_eq!(
                out["metadata"]["annotations"]["lattice.mlab.com/service-account"].as_str(),
                Some(account)
            );
            prop_assert!(init[0].args.clone().unwrap().contains(&"--inbound-capture".to_string()));
        }
        prop_assert_eq!(uninjected(&out), pod);
    }
}
