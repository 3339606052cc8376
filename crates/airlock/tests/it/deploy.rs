//! `deploy/kubernetes`, checked offline: the manifests against the Kubernetes API schemas
//! (`kubernetes-validate`, installed by scripts/test-deps.sh), the kustomization against the
//! files beside it, every `AIRLOCK_*` variable against the flags the binary takes, and the
//! pods' sizes through `airlock preflight`.

use crate::cli::airlock;
use std::path::{Path, PathBuf};
use std::process::Command;

fn kubernetes_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kubernetes")
}

/// (file name, text) of each manifest (every `.yaml` but the kustomization).
fn manifests() -> Vec<(String, String)> {
    let mut manifests: Vec<(String, String)> = std::fs::read_dir(kubernetes_dir())
        .expect("deploy/kubernetes")
        .map(|entry| entry.expect("entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "yaml"))
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(&path).expect("manifest"))
        })
        .filter(|(name, _)| name != "kustomization.yaml")
        .collect();
    manifests.sort();
    manifests
}

#[test]
fn kubernetes_manifests_match_the_api_schemas() {
    let files: Vec<PathBuf> = manifests()
        .iter()
        .map(|(name, _)| kubernetes_dir().join(name))
        .collect();
    assert_eq!(files.len(), 3, "router, prefill and decode: {files:?}");
    let output = Command::new("kubernetes-validate")
        .args(["--strict", "--kubernetes-version", "1.30.0"])
        .args(&files)
        .output()
        .unwrap_or_else(|error| {
            panic!("kubernetes-validate does not run ({error}): run scripts/test-deps.sh")
        });
    let report = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{report}");
    // Three resources per file (workload, Service, PodDisruptionBudget), each checked.
    assert_eq!(
        report.matches(" passed for resource ").count(),
        9,
        "{report}"
    );
}

#[test]
fn the_kustomization_lists_every_manifest() {
    let text = std::fs::read_to_string(kubernetes_dir().join("kustomization.yaml"))
        .expect("kustomization.yaml");
    let listed: Vec<String> = text
        .lines()
        .skip_while(|line| line.trim() != "resources:")
        .skip(1)
        .map_while(|line| line.trim().strip_prefix("- ").map(str::to_string))
        .collect();
    let files: Vec<String> = manifests().into_iter().map(|(name, _)| name).collect();
    let mut sorted = listed.clone();
    sorted.sort();
    assert_eq!(sorted, files, "resources: {listed:?}");
}

/// Every variable a container sets is one its subcommand reads: a typo would otherwise be
/// ignored silently by Kubernetes and by the binary.
#[test]
fn every_variable_in_the_manifests_is_a_flag_of_its_subcommand() {
    for (name, text) in manifests() {
        let subcommand = text
            .lines()
            .find_map(|line| line.trim().strip_prefix("args: [\""))
            .and_then(|rest| rest.split('"').next())
            .unwrap_or_else(|| panic!("{name}: no args"))
            .to_string();
        let help = airlock()
            .args([&subcommand, "--help"])
            .output()
            .expect("airlock runs");
        let help = String::from_utf8_lossy(&help.stdout).into_owned();
        let variables: Vec<&str> = text
            .lines()
            .filter_map(|line| line.trim().strip_prefix("- name: AIRLOCK_"))
            .collect();
        assert!(variables.len() >= 5, "{name}: {variables:?}");
        for variable in variables {
            assert!(
                help.contains(&format!("[env: AIRLOCK_{variable}=")),
                "{name}: `airlock {subcommand}` takes no AIRLOCK_{variable}"
            );
        }
    }
}

/// The workers' pools and memory limits are the ones `preflight.toml` describes, and that
/// file passes `airlock preflight` (each pool holds a request of the context length, and
/// weights + pool + buffers fit the limit).
#[test]
fn the_worker_pods_are_sized_as_preflight_checks() {
    let preflight = kubernetes_dir().join("preflight.toml");
    let toml = std::fs::read_to_string(&preflight).expect("preflight.toml");
    for (name, text) in manifests() {
        let Some(role) = ["prefill", "decode"]
            .into_iter()
            .find(|role| name == format!("{role}.yaml"))
        else {
            continue;
        };
        let value_after = |marker: &str| -> String {
            let mut lines = text.lines().skip_while(|l| !l.contains(marker));
            lines.next();
            let line = lines.next().unwrap_or_default().trim().to_string();
            line.trim_start_matches("value: ")
                .trim_matches('"')
                .to_string()
        };
        let kv_memory = value_after("name: AIRLOCK_KV_MEMORY");
        let limit = text
            .lines()
            .skip_while(|l| l.trim() != "limits:")
            .nth(1)
            .and_then(|l| l.trim().strip_prefix("memory: "))
            .expect("a memory limit")
            .replace("Gi", "GiB");
        let node = toml
            .split("[[node]]")
            .find(|node| node.contains(&format!("role = \"{role}\"")))
            .expect("a preflight node per role");
        assert!(
            node.contains(&format!("kv_memory = \"{kv_memory}\"")),
            "{role}: {node}"
        );
        assert!(
            node.contains(&format!("memory = \"{limit}\"")),
            "{role}: {node}"
        );
    }
    let output = airlock()
        .arg("preflight")
        .arg(&preflight)
        .output()
        .expect("airlock runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("preflight ok: 2 nodes"), "{stdout}");
}

/// Every series the Grafana dashboard (`deploy/grafana/airlock.json`) queries is one a
/// running router exports, so no panel stays empty for want of a renamed metric.
#[test]
fn the_grafana_dashboard_queries_only_metrics_the_router_exports() {
    use crate::harness::{completion, post, runtime, start, Mode, Options};
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/grafana/airlock.json");
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("dashboard")).expect("JSON");
    let exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|panel| panel["targets"].as_array().expect("targets").clone())
        .map(|target| target["expr"].as_str().expect("expr").to_string())
        .collect();
    let mut names: Vec<String> = exprs
        .iter()
        .flat_map(|expr| {
            expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|word| word.starts_with("airlock_"))
                .map(|word| word.trim_end_matches("_bucket").to_string())
                .collect::<Vec<_>>()
        })
        .collect();
    names.sort();
    names.dedup();
    assert!(names.len() >= 20, "{names:?}");
    let server = start(Options::new(Mode::Disaggregated));
    let page = runtime().block_on(async {
        let answer = post(&server.url, "/v1/completions", completion("Hello", 4)).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        crate::harness::metrics(&server.url).await
    });
    for name in names {
        assert!(
            page.lines()
                .any(|line| line.starts_with(&format!("# TYPE {name} "))),
            "the dashboard queries {name}, which /metrics does not export"
        );
    }
}
