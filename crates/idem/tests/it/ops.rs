//! The operations commands against a store with records in every state: list (with paging),
//! get, stats, the stale-lease report, purge and migrate, as tables and as JSON.

use crate::common;

use std::time::Duration;

use common::idem;
use idempotency::{BeginRequest, Claim, Fingerprint, Key, Outcome, Scope, Store};

fn request(scope: &str, key: &str) -> BeginRequest {
    BeginRequest::new(
        Scope::new(scope).unwrap(),
        Key::new(key).unwrap(),
        Fingerprint::of_bytes(key.as_bytes()),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_see_and_maintain_the_records() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("ops.db").display());
    let (code, out, err) = idem(&["migrate", "--store", &url]);
    assert_eq!(code, 0, "{err}");
    assert!(out.ends_with("schema ready\n"), "{out}");

    let store = idempotency::open(&url).await.unwrap();
    // A crashed worker: in flight, its lease already over.
    let crashed = request("billing", "stuck-1").lease(Duration::from_millis(200));
    assert!(matches!(store.begin(&crashed).await.unwrap(), Claim::Acquired(_)));
    // A running one, with a long lease.
    let running = request("billing", "running-1").lease(Duration::from_secs(600));
    assert!(matches!(store.begin(&running).await.unwrap(), Claim::Acquired(_)));
    // Two completed ones, and one that has already expired.
    for (key, retention) in [("done-1", 3600), ("done-2", 3600), ("gone-1", 0)] {
        let done = request("shipping", key);
        let Claim::Acquired(held) = store.begin(&done).await.unwrap() else {
            panic!("acquire {key}")
        };
        let completed = store
            .complete(
                &held,
                Outcome::new(format!("outcome of {key}")),
                Duration::from_secs(retention),
            )
            .await
            .unwrap();
        assert!(!completed.is_lease_lost());
    }
    drop(store);
    tokio::time::sleep(Duration::from_millis(1200)).await;

    let json = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["--store", url.as_str(), "--json"]);
        let (code, out, err) = idem(&all);
        assert_eq!(code, 0, "{args:?}: {err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };

    let stats = json(&["keys", "stats"]);
    assert_eq!(stats["in_flight"], 2, "{stats}");
    assert_eq!(stats["stale_leases"], 1, "{stats}");
    assert_eq!(stats["completed"], 2, "{stats}");
    assert_eq!(stats["expired"], 1, "{stats}");

    // The stale-lease report: both have run for over a second; one lease is over.
    let report = json(&["inflight", "--older-than", "1s"]);
    assert_eq!(report["records"].as_array().unwrap().len(), 2, "{report}");
    assert_eq!(report["stale"], 1, "{report}");
    let (code, table, _) = idem(&["inflight", "--older-than", "1s", "--store", &url]);
    assert_eq!(code, 0);
    assert!(
        table.contains("stuck-1") && table.contains("lease expired"),
        "{table}"
    );
    assert!(table.contains("1 with an expired lease"), "{table}");
    let (_, none, _) = idem(&["inflight", "--older-than", "1h", "--store", &url]);
    assert_eq!(none, "no requests in flight for longer than 1h\n");

    // Listing by state, and paging one record at a time.
    let completed = json(&["keys", "list", "--state", "completed"]);
    let keys: Vec<&str> = completed["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["done-1", "done-2"]);
    let first = json(&["keys", "list", "--state", "completed", "--limit", "1"]);
    let next = &first["next_after"];
    let second = json(&[
        "keys",
        "list",
        "--state",
        "completed",
        "--limit",
        "1",
        "--after-scope",
        next["scope"].as_str().unwrap(),
        "--after-key",
        next["key"].as_str().unwrap(),
    ]);
    assert_eq!(second["records"][0]["key"], "done-2", "{second}");
    let (_, table, _) = idem(&[
        "keys",
        "list",
        "--state",
        "completed",
        "--limit",
        "1",
        "--store",
        &url,
    ]);
    assert!(
        table.contains("--after-scope 'shipping' --after-key 'done-1'"),
        "{table}"
    );

    // One record, with its outcome (not an HTTP response: shown as bytes).
    let record = json(&["keys", "get", "done-1", "--scope", "shipping"]);
    assert_eq!(record["state"], "completed");
    assert_eq!(record["outcome"]["kind"], "bytes");
    assert_eq!(record["outcome"]["text"], "outcome of done-1");

    // Purge removes the expired record only.
    let purged = json(&["keys", "purge"]);
    assert_eq!(purged["purged"], 1, "{purged}");
    let stats = json(&["keys", "stats"]);
    assert_eq!(
        (stats["expired"].as_u64(), stats["completed"].as_u64()),
        (Some(0), Some(2)),
        "{stats}"
    );
}

/// The SHA-256 of a file's bytes.
fn digest(path: &std::path::Path) -> Fingerprint {
    Fingerprint::of_bytes(&std::fs::read(path).unwrap())
}

/// The names in a directory.
fn entries(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// The operations commands never create or change a store: another application's SQLite file
/// is refused and left byte for byte as it was (no table, no pragma, no journal file), a
/// mistyped path is an error and creates no file, `memory://` is refused, and a PostgreSQL URL
/// without a database or a database without the table is refused with nothing created.
#[test]
fn inspection_never_writes_and_refuses_what_is_not_a_store() {
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("app.db");
    {
        let app = rusqlite::Connection::open(&other).unwrap();
        app.execute_batch(
            "CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT);
             INSERT INTO users VALUES (1, 'ada');",
        )
        .unwrap();
    }
    let (before, files) = (digest(&other), entries(dir.path()));
    let commands: [&[&str]; 5] = [
        &["keys", "get", "k"],
        &["keys", "list"],
        &["keys", "stats"],
        &["inflight"],
        &["keys", "purge"],
    ];
    let with_store = |command: &[&str], store: &str| -> (i32, String, String) {
        let mut args = command.to_vec();
        args.extend(["--store", store]);
        idem(&args)
    };
    let other_url = format!("sqlite://{}", other.display());
    for command in commands {
        let (code, out, err) = with_store(command, &other_url);
        assert_eq!(code, 1, "{command:?}: {out} {err}");
        assert!(
            err.contains("is not an idempotency store") && err.contains("left untouched"),
            "{command:?}: {err}"
        );
    }
    assert_eq!(digest(&other), before, "the other application's file changed");
    assert_eq!(entries(dir.path()), files, "files appeared next to it");

    let missing = dir.path().join("tpyo.db");
    let missing_url = format!("sqlite://{}", missing.display());
    for command in commands {
        let (code, _, err) = with_store(command, &missing_url);
        assert_eq!(code, 1, "{command:?}: {err}");
        assert!(err.contains("does not exist"), "{command:?}: {err}");
        assert!(!missing.exists(), "{command:?} created the file");
    }

    for command in commands {
        let (code, _, err) = with_store(command, "memory://");
        assert_eq!(code, 1, "{command:?}: {err}");
        assert!(err.contains("nothing to inspect"), "{command:?}: {err}");
    }

    let server = common::database_url();
    let (base, _database) = server.rsplit_once('/').unwrap();
    let (code, _, err) = with_store(&["keys", "stats"], base);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("names no database"), "{err}");
    // A database without the records table (`postgres`, where nothing of ours belongs):
    // refused twice over, so the first refusal created nothing.
    for _ in 0..2 {
        let (code, _, err) = with_store(&["keys", "list"], &format!("{base}/postgres"));
        assert_eq!(code, 1, "{err}");
        assert!(
            err.contains("has no table") && err.contains("nothing was created"),
            "{err}"
        );
    }
    // The same on MySQL/MariaDB: no database named, and a database (`mysql`) without the table.
    let server = std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let (base, _database) = server.rsplit_once('/').unwrap();
    let (code, _, err) = with_store(&["keys", "stats"], base);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("names no database"), "{err}");
    for _ in 0..2 {
        let (code, _, err) = with_store(&["keys", "list"], &format!("{base}/mysql"));
        assert_eq!(code, 1, "{err}");
        assert!(
            err.contains("has no table") && err.contains("nothing was created"),
            "{err}"
        );
    }
}

/// Every metric the code emits is listed in `docs/OPERATIONS.md`, and the guide lists none that
/// the code does not emit.
#[test]
fn the_operations_guide_lists_every_metric() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let guide = std::fs::read_to_string(root.join("docs/OPERATIONS.md")).unwrap();
    let mut emitted = std::collections::BTreeSet::new();
    let mut sources = vec![root.join("crates")];
    while let Some(path) = sources.pop() {
        if path.is_dir() {
            if path.ends_with("tests") || path.ends_with("target") {
                continue;
            }
            sources.extend(
                std::fs::read_dir(&path)
                    .unwrap()
                    .map(|entry| entry.unwrap().path()),
            );
            continue;
        }
        if path.extension().is_none_or(|ext| ext != "rs") {
            continue;
        }
        // A metric's name is a string literal `idempotency_…` or `idem_…` ending in `_total`
        // or `_seconds`, in a macro call or in a table of names a macro call reads, or any
        // such literal a `gauge!` or `histogram!` macro names.
        let text = std::fs::read_to_string(&path).unwrap();
        let mut pieces = text.split('"');
        let mut before = pieces.next().unwrap_or_default();
        while let (Some(literal), Some(after)) = (pieces.next(), pieces.next()) {
            let named = literal.starts_with("idempotency_") || literal.starts_with("idem_");
            let gauge = before.ends_with("gauge!(") || before.ends_with("histogram!(");
            before = after;
            let metric = gauge || literal.ends_with("_total") || literal.ends_with("_seconds");
            if named && metric && literal.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                emitted.insert(literal.to_owned());
            }
        }
    }
    assert!(emitted.len() >= 20, "{emitted:?}");
    for name in &emitted {
        assert!(
            guide.contains(&format!("`{name}`")),
            "{name} is not in docs/OPERATIONS.md"
        );
    }
    // The tables of the Metrics section name metrics (the Logs section's name log fields).
    let metrics = guide
        .split("\n## ")
        .find(|section| section.starts_with("Metrics"))
        .expect("docs/OPERATIONS.md has a Metrics section");
    for line in metrics.lines().filter(|line| line.starts_with("| `")) {
        let listed = line.trim_start_matches("| `").split('`').next().unwrap();
        assert!(
            emitted.contains(listed),
            "docs/OPERATIONS.md lists {listed}, which nothing emits"
        );
    }
}

/// `idem` with `args` and `env`: (exit code, stdout, stderr).
fn idem_with_env(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Container secrets: `IDEM_STORE_FILE` (and the other secrets' `_FILE`s) name a file holding
/// the value; the value never shows in help, and giving it twice, or an unreadable file, stops
/// the command with the variable and the path.
#[test]
fn secrets_come_from_files_and_never_show() {
    let dir = tempfile::tempdir().unwrap();
    let store_file = dir.path().join("store-url");
    let url = format!("sqlite://{}", dir.path().join("secret.db").display());
    std::fs::write(&store_file, format!("{url}\n")).unwrap();
    let store_file = store_file.to_str().unwrap();
    let (code, out, err) = idem_with_env(&["migrate"], &[("IDEM_STORE_FILE", store_file)]);
    assert_eq!(code, 0, "{err}");
    assert!(out.ends_with("schema ready\n"), "{out}");
    assert!(
        dir.path().join("secret.db").is_file(),
        "the store named in the file was not used"
    );

    let secret_file = dir.path().join("db-url");
    std::fs::write(&secret_file, "postgres://app:S3CRET@db/orders").unwrap();
    let secret_file = secret_file.to_str().unwrap();
    for command in ["serve", "consume", "keys stats", "inbox stats"] {
        let mut args: Vec<&str> = command.split(' ').collect();
        args.push("--help");
        let (code, out, err) = idem_with_env(
            &args,
            &[
                ("IDEM_STORE_FILE", secret_file),
                ("IDEM_DATABASE_FILE", secret_file),
                ("IDEM_FROM", "amqp://u:S3CRET@mq/%2f?queue=q"),
                ("IDEM_SCOPE_SECRET", "S3CRET-S3CRET-S3CRET"),
            ],
        );
        assert_eq!(code, 0, "{command}: {err}");
        assert!(
            !out.contains("S3CRET") && !err.contains("S3CRET"),
            "{command}: {out}"
        );
    }

    let (code, _, err) = idem_with_env(
        &["keys", "stats"],
        &[("IDEM_STORE_FILE", store_file), ("IDEM_STORE", "memory://")],
    );
    assert_eq!(code, 2);
    assert!(
        err.contains("IDEM_STORE and IDEM_STORE_FILE are both set"),
        "{err}"
    );
    let (code, _, err) = idem_with_env(&["keys", "stats"], &[("IDEM_STORE_FILE", "/nonexistent/url")]);
    assert_eq!(code, 2);
    assert!(
        err.contains("IDEM_STORE_FILE /nonexistent/url: No such file"),
        "{err}"
    );
}
