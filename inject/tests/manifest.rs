//! `lattice inject` and `lattice uninject`, the real binary, over a Helm-rendered chart of
//! several kinds (`tests/data/chart.yaml`): only pod templates change, everything else comes
//! out byte for byte, and uninject gives back the chart.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::process::{Command, Output, Stdio};

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use k8s_openapi::api::batch::v1::{CronJob, Job};
use k8s_openapi::api::core::v1::{Pod, PodSpec};
use lattice_inject::template::{INIT_CONTAINER, PROXY_CONTAINER};
use serde::Deserialize;
use serde_json::Value;

const CHART: &str = include_str!("data/chart.yaml");

/// Runs `lattice args…` with `input` on stdin, to its end.
fn run(args: &[&str], input: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lattice"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

/// Runs `lattice args…` with `input` on stdin, which must succeed: its stdout and stderr.
fn lattice(args: &[&str], input: &str) -> (String, String) {
    let output = run(args, input);
    let (stdout, stderr) = (
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    );
    assert!(output.status.success(), "lattice {args:?}: {stderr}");
    (stdout, stderr)
}

/// The documents of `text` (nulls for empty ones kept, so indexes line up).
fn documents(text: &str) -> Vec<Value> {
    serde_norway::Deserializer::from_str(text)
        .map(|d| Value::deserialize(d).unwrap())
        .collect()
}

/// The raw text of each document, separators included.
fn raw_documents(text: &str) -> Vec<String> {
    let mut docs = vec![String::new()];
    for line in text.split_inclusive('\n') {
        if line.trim_end() == "---" {
            docs.push(String::new());
        }
        docs.last_mut().unwrap().push_str(line);
    }
    if docs[0].is_empty() {
        docs.remove(0);
    }
    docs
}

fn meshed(spec: &PodSpec) -> bool {
    let init = spec.init_containers.iter().flatten();
    let names: Vec<&str> = init.map(|c| c.name.as_str()).collect();
    names.starts_with(&[INIT_CONTAINER, PROXY_CONTAINER])
}

#[test]
fn only_pod_templates_change_and_uninject_gives_the_chart_back() {
    let (out, stderr) = lattice(&["inject", "-n", "shop"], CHART);
    let before = documents(CHART);
    let after = documents(&out);
    assert_eq!(before.len(), after.len());

    // Every pod template is in the mesh but the host-network DaemonSet's and the Job that
    // opted out, which are reported with why.
    let kind = |d: &Value| d["kind"].as_str().unwrap_or_default().to_string();
    for doc in &after {
        let name = doc["metadata"]["name"].as_str().unwrap_or_default();
        match kind(doc).as_str() {
            "Deployment" => {
                let d: Deployment = serde_json::from_value(doc.clone()).unwrap();
                assert!(
                    meshed(d.spec.unwrap().template.spec.as_ref().unwrap()),
                    "{name}"
                );
            }
            "StatefulSet" => {
                let s: StatefulSet = serde_json::from_value(doc.clone()).unwrap();
                assert!(
                    meshed(s.spec.unwrap().template.spec.as_ref().unwrap()),
                    "{name}"
                );
            }
            "CronJob" => {
                let c: CronJob = serde_json::from_value(doc.clone()).unwrap();
                let job = c.spec.unwrap().job_template.spec.unwrap();
                assert!(meshed(job.template.spec.as_ref().unwrap()), "{name}");
            }
            "DaemonSet" => {
                let d: DaemonSet = serde_json::from_value(doc.clone()).unwrap();
                assert!(!meshed(d.spec.unwrap().template.spec.as_ref().unwrap()));
            }
            "Job" => {
                let j: Job = serde_json::from_value(doc.clone()).unwrap();
                assert!(!meshed(j.spec.unwrap().template.spec.as_ref().unwrap()));
            }
            "List" => {
                let pod: Pod = serde_json::from_value(doc["items"][0].clone()).unwrap();
                assert!(meshed(pod.spec.as_ref().unwrap()));
                let search = &pod.spec.unwrap().dns_config.unwrap().searches.unwrap()[0];
                assert_eq!(search, "tools.svc.cluster.local", "the pod's own namespace");
                assert_eq!(doc["items"][1], before[before.len() - 1]["items"][1]);
            }
            _ => {}
        }
    }
    assert!(
        stderr.contains("DaemonSet/shop-node-exporter: left as it is: on the host network"),
        "{stderr}"
    );
    assert!(
        stderr.contains("Job/shop-migrate: left as it is: opted out"),
        "{stderr}"
    );

    // Documents without a pod, and pods left alone, come out as they went in.
    let (raw_in, raw_out) = (raw_documents(CHART), raw_documents(&out));
    assert_eq!(raw_in.len(), raw_out.len());
    for (i, (a, b)) in raw_in.iter().zip(&raw_out).enumerate() {
        let kind = kind(&before[i.min(before.len() - 1)]);
        if matches!(
            kind.as_str(),
            "ServiceAccount"
                | "ConfigMap"
                | "Service"
                | "HorizontalPodAutoscaler"
                | "DaemonSet"
                | "Job"
        ) {
            assert_eq!(a, b, "document {i} ({kind}) is not byte for byte");
        }
    }

    // A second run changes nothing; uninject gives the chart back.
    let (again, _) = lattice(&["inject", "-n", "shop"], &out);
    assert_eq!(again, out);
    let (back, _) = lattice(&["uninject"], &out);
    assert_eq!(documents(&back), before);
}

#[test]
fn input_that_is_not_yaml_fails_and_says_where() {
    let output = run(&["inject", "-f", "/nonexistent/manifest.yaml"], "");
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("/nonexistent/manifest.yaml"));
    let output = run(&["inject"], "kind: Pod\n---\nkind: [unclosed\n");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("document 1"), "{stderr}");
    assert!(output.stdout.is_empty(), "nothing half-written");
}
