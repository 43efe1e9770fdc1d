//! The deployment we ship, read against what it runs: the Kubernetes manifests under
//! `deploy/kubernetes` pass the Kubernetes schema check (`kubernetes-validate --strict`, offline
//! schemas, which `scripts/services` installs into a virtual environment of its own), and every
//! one says what `idem` and the image understand:
//!
//! - its `idem` arguments are flags `idem` accepts (run through the binary);
//! - its probes are the endpoints `idem` serves on the port its `--admin-listen` names, and a
//!   readiness probe needs more than one failure;
//! - every `*_FILE` variable points into a mounted Secret that the manifest's set-up commands
//!   create with that key, and the file is readable by the container's user, given the pod's
//!   security context (the image runs as 65532);
//! - every CA a URL names is mounted;
//! - every object is in the namespace its DNS names assume;
//! - a local image is not pulled; an application beside a gateway or a consumer outlives its
//!   drain; a consumer calls the application, not a gateway in front of it;
//! - nothing in `deploy/` carries a credential.
//!
//! The compose file runs the repository's own example upstream, generates its secrets, and
//! probes `idem` with `idem probe`; the example upstream runs behind the gateway here. The
//! Containerfile declares the store's volume and builds every source.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The image's user and group (`deploy/image/passwd`, the Containerfile's `USER`).
const IMAGE_USER: u64 = 65532;

/// The namespace the manifests and their DNS names use.
const NAMESPACE: &str = "payments";

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

fn manifests() -> Vec<PathBuf> {
    let mut manifests: Vec<PathBuf> = std::fs::read_dir(repository().join("deploy/kubernetes"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "yaml"))
        .collect();
    manifests.sort();
    manifests
}

#[test]
fn the_kubernetes_manifests_pass_the_schema_check() {
    let manifests = manifests();
    assert!(manifests.len() >= 4, "{manifests:?}");
    let output = Command::new(tool("kubernetes-validate"))
        .arg("--strict")
        .args(&manifests)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&output.stdout) + String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{said}");
    assert!(!said.contains("ERROR"), "{said}");
}

/// What a manifest's set-up comments tell its reader to create first: Secrets (name → key →
/// value) and ConfigMaps (name → keys), from `kubectl -n NS create secret generic NAME
/// --from-literal=KEY='VALUE'` and `kubectl -n NS create configmap NAME --from-file=KEY=PATH`.
#[derive(Debug, Default)]
struct SetUp {
    secrets: BTreeMap<String, BTreeMap<String, String>>,
    config_maps: BTreeMap<String, Vec<String>>,
}

impl SetUp {
    fn of(text: &str) -> Self {
        // The comment lines, with their continuations joined.
        let joined = text
            .lines()
            .filter_map(|line| line.strip_prefix('#'))
            .map(|line| line.trim().trim_end_matches('\\').trim().to_owned())
            .collect::<Vec<_>>()
            .join(" ");
        let mut set_up = Self::default();
        for command in joined.split("kubectl ").skip(1) {
            let words: Vec<&str> = command.split_whitespace().collect();
            if words.first() == Some(&"apply") {
                continue;
            }
            assert_eq!(words.get(..2), Some(&["-n", NAMESPACE][..]), "kubectl {command}");
            match words.get(2..5) {
                Some(["create", "secret", "generic"]) => {
                    let keys = set_up.secrets.entry(words[5].to_owned()).or_default();
                    for word in &words[6..] {
                        if let Some((key, value)) = word
                            .strip_prefix("--from-literal=")
                            .and_then(|kv| kv.split_once('='))
                        {
                            keys.insert(key.to_owned(), value.trim_matches('\'').to_owned());
                        }
                    }
                }
                Some(["create", "configmap", name]) => {
                    let keys = set_up.config_maps.entry((*name).to_owned()).or_default();
                    for word in &words[5..] {
                        if let Some((key, _)) = word
                            .strip_prefix("--from-file=")
                            .and_then(|kv| kv.split_once('='))
                        {
                            keys.push(key.to_owned());
                        }
                    }
                }
                _ => {}
            }
        }
        set_up
    }
}

/// Whether a file of `mode`, owned by root and by the group `group`, is readable by `uid` in
/// the groups `gids`.
fn readable(mode: u64, group: u64, uid: u64, gids: &[u64]) -> bool {
    (uid == 0 && mode & 0o400 != 0) || (gids.contains(&group) && mode & 0o040 != 0) || mode & 0o004 != 0
}

/// The files a URL names as a CA (`sslrootcert=`, `ssl-ca=`, `cacertfile=`, `ca=`,
/// `ssl.ca.location=`).
fn ca_files(url: &str) -> Vec<String> {
    let Some((_, query)) = url.split_once('?') else {
        return Vec::new();
    };
    query
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .filter(|(name, _)| {
            matches!(
                *name,
                "sslrootcert" | "ssl-ca" | "cacertfile" | "ca" | "ssl.ca.location"
            )
        })
        .map(|(_, path)| path.to_owned())
        .collect()
}

/// Whether `url` verifies its server's certificate against a host only a private CA can vouch
/// for: an in-cluster name (`….svc`, `….svc.cluster.local`), which no public CA signs.
fn verifies_a_cluster_name(url: &str) -> bool {
    let Ok(parsed) = url::Url::parse(url) else {
        return false;
    };
    let in_cluster = parsed
        .host_str()
        .is_some_and(|host| host.ends_with(".svc") || host.ends_with(".svc.cluster.local"));
    let verifies = match parsed.scheme() {
        "postgres" | "postgresql" => parsed
            .query_pairs()
            .any(|(name, value)| name == "sslmode" && value.starts_with("verify")),
        "mysql" | "mariadb" => parsed
            .query_pairs()
            .any(|(name, value)| name == "ssl-mode" && value.to_ascii_uppercase().starts_with("VERIFY")),
        "amqps" | "rediss" | "https" | "tls" => true,
        _ => false,
    };
    in_cluster && verifies
}

/// A test value for the `*_FILE` variable `variable`: a URL of the right kind whose server does
/// not exist.
fn test_value(variable: &str) -> &'static str {
    match variable {
        "IDEM_STORE_FILE" => "memory://",
        "IDEM_FROM_FILE" => "amqp://guest:guest@127.0.0.1:1/%2f?queue=payments",
        "IDEM_DATABASE_FILE" => "postgres://relay@127.0.0.1:1/payments",
        "IDEM_RELAY_TO_FILE" => "amqp://relay@127.0.0.1:1/%2f?exchange=events",
        other => panic!("no test value for {other}"),
    }
}

/// A duration flag's seconds (`30s`, `5s`).
fn seconds(text: &str) -> u64 {
    text.strip_suffix('s')
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{text}"))
}

#[test]
#[allow(clippy::too_many_lines)]
fn every_idem_container_starts_as_written() {
    let mut seen = Vec::new();
    for path in manifests() {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&path).unwrap();
        let set_up = SetUp::of(&text);
        let documents = documents(&path);
        for document in &documents {
            assert_ne!(
                document["kind"], "Secret",
                "{name}: no Secret in a manifest (its values would be committed, and applied over the real ones)"
            );
            if document["kind"] == "Namespace" {
                assert_eq!(document["metadata"]["name"], NAMESPACE, "{name}");
            } else {
                assert_eq!(
                    document["metadata"]["namespace"], NAMESPACE,
                    "{name}: {}",
                    document["metadata"]["name"]
                );
            }
        }
        // The services' DNS names are in the manifests' namespace.
        for url in set_up.secrets.values().flat_map(BTreeMap::values) {
            if let Some(at) = url.find(".svc") {
                let namespace = url[..at].rsplit('.').next().unwrap();
                assert_eq!(namespace, NAMESPACE, "{name}: {url}");
            }
        }
        for deployment in documents
            .iter()
            .filter(|document| document["kind"] == "Deployment")
        {
            let pod = &deployment["spec"]["template"]["spec"];
            let containers = pod["containers"].as_array().unwrap();
            let idem: Vec<&Value> = containers
                .iter()
                .filter(|container| container["image"].as_str().unwrap().contains("idem"))
                .collect();
            assert_eq!(idem.len(), 1, "{name}: one idem container");
            let container = idem[0];
            let args: Vec<String> = container["args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|arg| arg.as_str().unwrap().to_owned())
                .collect();
            let command = args[0].clone();
            seen.push(command.clone());
            // A local image is never pulled.
            if container["image"].as_str().unwrap().starts_with("localhost/") {
                assert_eq!(container["imagePullPolicy"], "IfNotPresent", "{name}");
            }
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
            let threshold = container["readinessProbe"]["failureThreshold"]
                .as_u64()
                .unwrap_or(3);
            assert!(
                threshold >= 2,
                "{name}: one failed check takes every replica out at a store blip"
            );
            // Who the container runs as: the pod's or its own security context, else the image's user.
            let security = |field: &str| {
                container["securityContext"][field]
                    .as_u64()
                    .or_else(|| pod["securityContext"][field].as_u64())
            };
            let uid = security("runAsUser").unwrap_or(IMAGE_USER);
            let gid = security("runAsGroup").unwrap_or(IMAGE_USER);
            let fs_group = pod["securityContext"]["fsGroup"].as_u64();
            let mut gids = vec![gid];
            gids.extend(fs_group);
            assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{name}");
            // The mounted volumes, by mount path.
            let volumes = mounted(pod, container["volumeMounts"].as_array().unwrap());
            // The secrets: each *_FILE variable points into a mounted Secret the set-up makes
            // with that key, readable by the container's user.
            let mut files = Vec::new();
            for variable in container["env"].as_array().unwrap() {
                let variable_name = variable["name"].as_str().unwrap();
                if !variable_name.ends_with("_FILE") {
                    continue;
                }
                let path = variable["value"].as_str().unwrap();
                let volume = volume_for(&volumes, path, &name);
                let secret = volume["secret"]["secretName"]
                    .as_str()
                    .unwrap_or_else(|| panic!("{name}: {path} is not in a Secret"));
                let key = path.rsplit('/').next().unwrap();
                let value = set_up
                    .secrets
                    .get(secret)
                    .and_then(|keys| keys.get(key))
                    .unwrap_or_else(|| panic!("{name}: the set-up makes no Secret {secret} with {key}"));
                let mode = volume["secret"]["defaultMode"].as_u64().unwrap_or(0o644);
                assert!(
                    readable(mode, fs_group.unwrap_or(0), uid, &gids),
                    "{name}: {path} (mode {mode:o}, group {fs_group:?}) cannot be read by uid {uid} in {gids:?}"
                );
                // A verified in-cluster name needs a CA of the cluster's own, named in the URL.
                assert!(
                    !verifies_a_cluster_name(value) || !ca_files(value).is_empty(),
                    "{name}: {variable_name} verifies an in-cluster name no public CA signs, and names no CA"
                );
                // Every CA the URL names is mounted, from a ConfigMap the set-up makes.
                for ca in ca_files(value) {
                    let holder = volume_for(&volumes, &ca, &name);
                    let map = holder["configMap"]["name"]
                        .as_str()
                        .or_else(|| holder["secret"]["secretName"].as_str())
                        .unwrap();
                    let key = ca.rsplit('/').next().unwrap();
                    let made = set_up
                        .config_maps
                        .get(map)
                        .is_some_and(|keys| keys.iter().any(|k| k == key))
                        || set_up.secrets.get(map).is_some_and(|keys| keys.contains_key(key));
                    assert!(made, "{name}: the set-up makes no {map} with {key}");
                    let mode = holder["configMap"]["defaultMode"]
                        .as_u64()
                        .or_else(|| holder["secret"]["defaultMode"].as_u64())
                        .unwrap_or(0o644);
                    assert!(readable(mode, fs_group.unwrap_or(0), uid, &gids), "{name}: {ca}");
                }
                files.push(variable_name);
            }
            assert!(!files.is_empty(), "{name}: its secrets come from files");
            assert!(container["resources"]["requests"]["cpu"].is_string(), "{name}");
            assert!(container["resources"]["requests"]["memory"].is_string(), "{name}");
            // Beside the application: it outlives idem's drain, and is called directly.
            let drain = match command.as_str() {
                "serve" => {
                    seconds(flag(&args, "drain-delay").unwrap_or("0s"))
                        + seconds(flag(&args, "drain-timeout").unwrap_or("30s"))
                }
                "consume" => seconds(flag(&args, "handler-timeout").unwrap_or("30s")),
                _ => 0,
            };
            let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
            for application in containers
                .iter()
                .filter(|c| !c["image"].as_str().unwrap().contains("idem"))
            {
                let wait = application["lifecycle"]["preStop"]["sleep"]["seconds"]
                    .as_u64()
                    .unwrap_or_else(|| panic!("{name}: the application has no preStop wait"));
                assert!(
                    wait > drain,
                    "{name}: the application stops before idem has drained ({wait} s ≤ {drain} s)"
                );
                assert!(
                    grace > wait,
                    "{name}: the grace period ends before the preStop wait does"
                );
            }
            if command == "consume" {
                let to = flag(&args, "to").unwrap();
                assert!(
                    to.starts_with("http://127.0.0.1:"),
                    "{name}: the handler is the application beside it: {to}"
                );
            }
            // The arguments are flags idem accepts: the gateway checks them with --check, the
            // others get as far as their servers (which do not exist here: exit 1, not 2).
            let values: Vec<(&str, &str)> = files
                .iter()
                .map(|variable| (*variable, test_value(variable)))
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
    assert_eq!(seen, ["consume", "relay", "serve"]);
}

/// The pod's volumes by mount path, for [`volume_for`].
fn mounted(pod: &Value, mounts: &[Value]) -> Vec<(String, Value)> {
    mounts
        .iter()
        .map(|mount| {
            let volume = pod["volumes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|volume| volume["name"] == mount["name"])
                .unwrap()
                .clone();
            (mount["mountPath"].as_str().unwrap().to_owned(), volume)
        })
        .collect()
}

/// The volume mounted where `path` is (`name` is the manifest's, for the message).
fn volume_for(volumes: &[(String, Value)], path: &str, name: &str) -> Value {
    volumes
        .iter()
        .find(|(mounted, _)| path.starts_with(&format!("{mounted}/")))
        .map(|(_, volume)| volume.clone())
        .unwrap_or_else(|| panic!("{name}: the CA {path} is in no mounted volume"))
}

/// Nothing under `deploy/` carries a credential: a URL's password is `PASSWORD` (a placeholder
/// the reader replaces) or made at first use.
#[test]
fn no_credential_is_committed() {
    let mut files = Vec::new();
    let mut dirs = vec![repository().join("deploy")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                files.push(path);
            }
        }
    }
    assert!(
        !repository().join("deploy/secrets").exists(),
        "deploy/secrets is gone"
    );
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        for (at, _) in text.match_indices("://") {
            let authority: String = text[at + 3..]
                .chars()
                .take_while(|c| !matches!(c, '/' | '?' | '\'' | '"' | ' ' | '\n'))
                .collect();
            let Some((user, _)) = authority.split_once('@') else {
                continue;
            };
            if let Some((_, password)) = user.split_once(':') {
                assert!(
                    password == "PASSWORD" || password == "%s",
                    "{}: a password is committed in {authority}",
                    file.display()
                );
            }
        }
        for word in ["change-me", "changeme", "secret123"] {
            assert!(!text.contains(word), "{}: {word}", file.display());
        }
    }
}

#[test]
fn the_compose_file_runs_the_example_upstream_with_secrets_made_at_first_use() {
    let deploy = repository().join("deploy");
    let compose = documents(&deploy.join("compose.yaml")).remove(0);
    let services = &compose["services"];
    let idem = &services["idem"];
    assert_eq!(idem["image"], "localhost/idem:latest");
    let args: Vec<String> = idem["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|arg| arg.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(args[0], "serve");
    // The upstream is the repository's example service, run from a stock image.
    let upstream = flag(&args, "upstream").unwrap();
    let service = upstream.trim_start_matches("http://").split(':').next().unwrap();
    let payments = &services[service];
    let source = payments["volumes"][0]
        .as_str()
        .unwrap()
        .split(':')
        .next()
        .unwrap();
    assert!(deploy.join(source).join("payments.py").is_file(), "{source}");
    assert!(
        payments["image"]
            .as_str()
            .unwrap()
            .starts_with("docker.io/library/python:")
    );
    assert_eq!(idem["depends_on"]["postgres"]["condition"], "service_healthy");
    assert_eq!(idem["depends_on"][service]["condition"], "service_healthy");
    // The store's URL is a file the `secrets` service writes into a volume idem mounts.
    let store_file = idem["environment"]["IDEM_STORE_FILE"].as_str().unwrap();
    let (mounted, file) = store_file.rsplit_once('/').unwrap();
    let volume = idem["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .find_map(|spec| spec.strip_suffix(":ro")?.strip_suffix(&format!(":{mounted}")))
        .unwrap_or_else(|| panic!("{mounted} is mounted read-only"));
    let maker = &services["secrets"];
    assert!(
        maker["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|spec| spec.as_str().unwrap().starts_with(&format!("{volume}:"))),
        "the secrets service writes the {volume} volume"
    );
    let script = maker["command"][0].as_str().unwrap();
    assert!(script.contains(&format!("> {file}")), "{script}");
    assert!(
        script.contains(&format!("chown {IMAGE_USER}:{IMAGE_USER} {file}")),
        "{script}"
    );
    assert_eq!(
        services["postgres"]["depends_on"]["secrets"]["condition"], "service_completed_successfully",
        "PostgreSQL starts once its password is made"
    );
    assert!(compose["volumes"][volume].is_object() || compose["volumes"][volume].is_null());
    // The image has no shell: its health check is `idem probe` on the admin listener's readyz.
    let health: Vec<&str> = idem["healthcheck"]["test"]
        .as_array()
        .unwrap()
        .iter()
        .map(|part| part.as_str().unwrap())
        .collect();
    let admin = flag(&args, "admin-listen").unwrap().rsplit_once(':').unwrap().1;
    assert_eq!(
        health,
        [
            "CMD",
            "/usr/local/bin/idem",
            "probe",
            &format!("http://127.0.0.1:{admin}/readyz")
        ]
    );
    let config = tempfile::NamedTempFile::new().unwrap();
    let mut checked = args.clone();
    checked.push(format!("--config={}", config.path().display()));
    checked.push("--check".into());
    let (code, err) = run_idem(
        &checked,
        &[("IDEM_STORE_FILE", "postgres://idem:x@postgres:5432/idem")],
    );
    assert_eq!(code, 0, "idem {args:?}: {err}");
}

/// The compose file's pair run here: the example upstream under the host's Python, and the
/// gateway with the compose file's arguments in front of it (on SQLite): a payment retried
/// with its key is charged once, and the upstream's lookup finds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_upstream_charges_once_behind_the_gateway() {
    let port = common::free_addr().port();
    let script = repository().join("examples/compose-upstream/payments.py");
    let mut upstream = common::Process {
        child: Command::new("python3")
            .arg(&script)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .spawn()
            .expect("python3 runs the example upstream"),
    };
    let client = common::client();
    let up = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    idempotency_testkit::eventually(
        std::time::Duration::from_secs(20),
        "the example upstream answers",
        async || {
            common::try_send(&client, up, "GET", "/healthz", &[], b"")
                .await
                .is_some_and(|seen| seen.status == 200)
        },
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let store = common::sqlite_url(dir.path());
    let upstream_url = format!("http://127.0.0.1:{port}");
    let listen = common::free_addr();
    let _gateway = common::start_gateway(
        listen,
        &[
            "--upstream",
            &upstream_url,
            "--store",
            &store,
            "--reconcile",
            "GET /charges/by-key/{key}",
        ],
        true,
    )
    .await;
    let body = br#"{"amount_cents":1000}"#;
    let headers = [
        ("idempotency-key", "order-1"),
        ("content-type", "application/json"),
    ];
    let first = common::send(&client, listen, "POST", "/charges", &headers, body).await;
    let retry = common::send(&client, listen, "POST", "/charges", &headers, body).await;
    assert_eq!((first.status, retry.status), (201, 201), "{:?}", first.body);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(first.json()["id"], retry.json()["id"]);
    let found = common::send(&client, up, "GET", "/charges/by-key/order-1", &[], b"").await;
    assert_eq!((found.status, &found.json()["id"]), (200, &first.json()["id"]));
    upstream.kill9();
}

#[test]
fn the_containerfile_keeps_the_store_on_a_volume_and_builds_every_source() {
    let file = std::fs::read_to_string(repository().join("Containerfile")).unwrap();
    assert!(file.contains("USER 65532:65532"), "the image's user");
    assert!(file.contains("VOLUME /var/lib/idem"), "the store's volume");
    assert!(file.contains("WORKDIR /var/lib/idem"), "the default store on it");
    assert!(
        file.contains("--features dynamodb,sqs,kafka-static"),
        "every source, Kafka included"
    );
    assert!(file.contains("TARGETARCH"), "the architecture picks the target");
    let ignored = std::fs::read_to_string(repository().join(".containerignore")).unwrap();
    for excluded in ["target/", ".git/"] {
        assert!(
            ignored.lines().any(|line| line == excluded),
            "{excluded} in .containerignore"
        );
    }
    let image = std::fs::read_to_string(repository().join("scripts/image")).unwrap();
    assert!(
        image.contains("--features dynamodb,sqs,kafka-static"),
        "scripts/image builds what the Containerfile does"
    );
}
