//! The example manifests under `deploy/`: the Kubernetes ones pass the Kubernetes schema check
//! (`kubernetes-validate --strict`, offline schemas, which `scripts/services` installs into a
//! virtual environment of its own), and every manifest says what `idem` understands: its
//! arguments are flags `idem` accepts (run through the binary), its probes are the endpoints
//! `idem` serves on the port its `--admin-listen` names, its secrets are mounted where the
//! `*_FILE` variables point, and it asks for resources and runs as a non-root user.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The virtual environment with `kubernetes-validate` and PyYAML.
fn tools() -> PathBuf {
    std::env::var_os("IDEM_TOOLS_VENV").map_or_else(
        || {
            let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
            PathBuf::from(home).join(".local/share/idem/tools-venv")
        },
        PathBuf::from,
    )
}

fn tool(name: &str) -> PathBuf {
    let path = tools().join("bin").join(name);
    assert!(
        path.is_file(),
        "{} is missing: scripts/services tools installs it",
        path.display()
    );
    path
}

/// Every document of the YAML file at `path`, as JSON.
fn documents(path: &Path) -> Vec<Value> {
    let output = Command::new(tool("python"))
        .args([
            "-c",
            "import json, sys, yaml; print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))",
        ])
        .arg(path)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

/// The value of `--NAME=VALUE` among `args`.
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .find_map(|arg| arg.strip_prefix(&format!("--{name}=")))
}

/// Runs `idem` with `args` and the `*_FILE` variables pointing at files holding `files`'
/// values; returns its exit code and standard error.
fn run_idem(args: &[String], files: &[(&str, &str)]) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
    command
        .args(args)
        .env_remove("IDEM_STORE")
        .env("IDEM_LOG", "error");
    for (variable, value) in files {
        let path = dir.path().join(variable);
        std::fs::write(&path, value).unwrap();
        command.env(variable, &path);
    }
    let output = command.output().unwrap();
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn the_kubernetes_manifests_pass_the_schema_check() {
    let manifests: Vec<PathBuf> = std::fs::read_dir(repository().join("deploy/kubernetes"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "yaml"))
        .collect();
    assert!(manifests.len() >= 2, "{manifests:?}");
    let output = Command::new(tool("kubernetes-validate"))
        .arg("--strict")
        .args(&manifests)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&output.stdout) + String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{said}");
    assert!(!said.contains("ERROR"), "{said}");
}

/// The `idem` containers of a manifest's Deployments, with their pod spec.
fn idem_containers(documents: &[Value]) -> Vec<(Value, Value)> {
    documents
        .iter()
        .filter(|document| document["kind"] == "Deployment")
        .flat_map(|deployment| {
            let pod = deployment["spec"]["template"]["spec"].clone();
            pod["containers"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|container| container["image"].as_str().unwrap().contains("idem"))
                .map(|container| (container.clone(), pod.clone()))
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn every_idem_container_is_one_idem_runs_with_its_probes_secrets_and_resources() {
    let mut seen = Vec::new();
    for name in ["gateway-sidecar.yaml", "consume.yaml"] {
        let documents = documents(&repository().join("deploy/kubernetes").join(name));
        let containers = idem_containers(&documents);
        assert_eq!(containers.len(), 1, "{name}: one idem container");
        for (container, pod) in containers {
            let args: Vec<String> = container["args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|arg| arg.as_str().unwrap().to_owned())
                .collect();
            let command = args[0].clone();
            seen.push(command.clone());
            // The probes: idem's endpoints, on the port --admin-listen names.
            let admin_port = flag(&args, "admin-listen")
                .and_then(|addr| addr.rsplit_once(':'))
                .map(|(_, port)| port.parse::<u64>().unwrap())
                .expect("an admin listener for the probes");
            let ports = container["ports"].as_array().unwrap();
            let prefix = if command == "serve" { "" } else { "/_idem" };
            for (probe, path) in [("livenessProbe", "livez"), ("readinessProbe", "readyz")] {
                let get = &container[probe]["httpGet"];
                assert_eq!(get["path"], format!("{prefix}/{path}"), "{name}: {probe}");
                let port = ports.iter().find(|port| port["name"] == get["port"]).unwrap();
                assert_eq!(port["containerPort"], admin_port, "{name}: {probe}'s port");
            }
            // The secrets: each *_FILE variable points into a mounted Secret.
            let mounts = container["volumeMounts"].as_array().unwrap();
            let mut files = Vec::new();
            for variable in container["env"].as_array().unwrap() {
                let variable_name = variable["name"].as_str().unwrap();
                let Some(stripped) = variable_name.strip_suffix("_FILE") else {
                    continue;
                };
                let path = variable["value"].as_str().unwrap();
                let mount = mounts
                    .iter()
                    .find(|mount| path.starts_with(mount["mountPath"].as_str().unwrap()))
                    .unwrap_or_else(|| panic!("{name}: {path} is in no mounted volume"));
                let volume = pod["volumes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|volume| volume["name"] == mount["name"])
                    .unwrap();
                let secret = volume["secret"]["secretName"].as_str().unwrap();
                let key = path.rsplit('/').next().unwrap();
                let holder = documents
                    .iter()
                    .find(|document| document["kind"] == "Secret" && document["metadata"]["name"] == secret)
                    .unwrap_or_else(|| panic!("{name}: no Secret {secret}"));
                assert!(
                    holder["stringData"][key].is_string(),
                    "{name}: {secret} has no {key}"
                );
                files.push((variable_name, stripped));
            }
            assert!(
                files.iter().any(|(variable, _)| *variable == "IDEM_STORE_FILE"),
                "{name}"
            );
            assert!(container["resources"]["requests"]["cpu"].is_string(), "{name}");
            assert!(container["resources"]["requests"]["memory"].is_string(), "{name}");
            assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{name}");
            // The arguments are flags idem accepts: the gateway checks them with --check, the
            // consumer gets as far as its broker (which does not exist here: exit 1, not 2).
            let values: Vec<(&str, &str)> = files
                .iter()
                .map(|(variable, _)| {
                    let value = match *variable {
                        "IDEM_STORE_FILE" => "memory://",
                        "IDEM_FROM_FILE" => "amqp://guest:guest@127.0.0.1:1/%2f?queue=payments",
                        other => panic!("{name}: no test value for {other}"),
                    };
                    (*variable, value)
                })
                .collect();
            let (code, err) = if command == "serve" {
                let config = tempfile::NamedTempFile::new().unwrap();
                let mut checked = args.clone();
                checked.push(format!("--config={}", config.path().display()));
                checked.push("--check".into());
                run_idem(&checked, &values)
            } else {
                run_idem(&args, &values)
            };
            let expected = if command == "serve" { 0 } else { 1 };
            assert_eq!(code, expected, "{name}: idem {args:?}: {err}");
        }
    }
    seen.sort();
    assert_eq!(seen, ["consume", "serve"]);
}

#[test]
fn the_compose_file_runs_the_gateway_on_postgres_with_its_secret() {
    let deploy = repository().join("deploy");
    let compose = documents(&deploy.join("compose.yaml")).remove(0);
    let services = &compose["services"];
    let idem = &services["idem"];
    let args: Vec<String> = idem["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|arg| arg.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(args[0], "serve");
    let upstream = flag(&args, "upstream").unwrap();
    let service = upstream.trim_start_matches("http://").split(':').next().unwrap();
    assert!(
        services[service].is_object(),
        "the upstream {service} is a service"
    );
    assert_eq!(idem["depends_on"]["postgres"]["condition"], "service_healthy");
    assert!(services["postgres"]["healthcheck"]["test"].is_array());
    let store_file = idem["environment"]["IDEM_STORE_FILE"].as_str().unwrap();
    let secret = store_file.rsplit('/').next().unwrap();
    let file = compose["secrets"][secret]["file"].as_str().unwrap();
    let url = std::fs::read_to_string(deploy.join(file)).unwrap();
    assert!(url.starts_with("postgres://"), "{url}");
    assert!(
        url.contains("@postgres:5432/"),
        "the store is the compose file's postgres: {url}"
    );
    let config = tempfile::NamedTempFile::new().unwrap();
    let mut checked = args.clone();
    checked.push(format!("--config={}", config.path().display()));
    checked.push("--check".into());
    let (code, err) = run_idem(&checked, &[("IDEM_STORE_FILE", url.trim())]);
    assert_eq!(code, 0, "idem {args:?}: {err}");
}
