//! `idem serve --config FILE`: settings and per-route policies in TOML, with the gateway and
//! two upstreams as processes of their own.

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::{calls, client, free_addr, idem, send, start_gateway, start_upstream};

/// The example file of `examples/idem.toml`, with `upstream`, the refunds route's upstream and
/// the store replaced, and top-level `retention` 2 s against the payments route's 60 s.
fn example(dir: &Path, upstream: &str, refunds: &str) -> String {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/idem.toml")).unwrap();
    let store = common::sqlite_url(dir);
    let text = text
        .replace("http://127.0.0.1:3000", upstream)
        .replace("http://127.0.0.1:4000", refunds)
        .replace("sqlite://idem.db", &store)
        .replace("retention = \"7d\"", "retention = \"60s\"")
        .replace(
            "scope-header = \"Authorization\"",
            "scope-header = \"Authorization\"\nretention = \"2s\"",
        );
    assert!(
        text.contains("retention = \"2s\"") && text.contains("retention = \"60s\""),
        "{text}"
    );
    let path = dir.join("idem.toml");
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_of_the_example_file_gets_its_own_policy() {
    let (_payments, upstream) = start_upstream();
    let (_refunds, refunds) = start_upstream();
    let dir = tempfile::tempdir().unwrap();
    let file = example(
        dir.path(),
        &format!("http://{upstream}"),
        &format!("http://{refunds}"),
    );
    let addr = free_addr();
    let _gateway = start_gateway(addr, &["--config", &file], true).await;
    let client = client();
    let json = [("content-type", "application/json")];

    // The published policy, route by route, then for the requests no route takes.
    let published = send(&client, addr, "GET", "/_idem/policy", &[], b"").await;
    assert_eq!(published.status, 200);
    let policy = published.json();
    let routes = policy["routes"].as_array().unwrap();
    assert_eq!(routes.len(), 4, "{policy}");
    let whole = serde_json::json!({ "method_and_target": true, "body": "whole", "members": [] });
    let payments = &routes[0];
    assert_eq!(payments["name"], "/v1/payments");
    assert_eq!(payments["path"], "/v1/payments");
    assert_eq!(payments["methods"], serde_json::json!(["POST"]));
    assert_eq!(payments["guarded"], true);
    assert_eq!(payments["guarded_methods"], serde_json::json!(["POST"]));
    assert_eq!(payments["key_header"], "Idempotency-Key");
    assert_eq!(payments["key_from"], serde_json::Value::Null);
    assert_eq!(payments["require_key"], true);
    assert_eq!(payments["retention_seconds"], 60.0);
    assert_eq!(payments["lease_seconds"], 30.0);
    assert_eq!(payments["wait_seconds"], serde_json::Value::Null);
    assert_eq!(
        payments["release_on"],
        serde_json::json!(["408", "409", "425", "429"])
    );
    assert_eq!(payments["fingerprint"], whole);
    let search = &routes[1];
    assert_eq!(search["path"], "/v1/search");
    assert_eq!(search["methods"], serde_json::Value::Null);
    assert_eq!(search["guarded"], false);
    assert_eq!(search["guarded_methods"], serde_json::json!([]));
    let orders = &routes[2];
    assert_eq!(orders["key_header"], "X-Request-Id");
    assert_eq!(orders["guarded_methods"], serde_json::json!(["POST", "PATCH"]));
    assert_eq!(orders["retention_seconds"], 2.0);
    assert_eq!(orders["require_key"], false);
    assert_eq!(
        orders["fingerprint"],
        serde_json::json!({ "method_and_target": true, "body": "members", "members": ["/amount", "/currency"] })
    );
    assert_eq!(routes[3]["key_from"], "/refund_id");
    assert_eq!(routes[3]["key_header"], "Idempotency-Key");
    let default = &policy["default"];
    assert_eq!(default["name"], "gateway");
    assert_eq!(default["path"], serde_json::Value::Null);
    assert_eq!(default["retention_seconds"], 2.0);
    assert_eq!(
        default["release_on"],
        serde_json::json!(["1xx", "3xx", "5xx", "408", "409", "425", "429"])
    );
    assert_eq!(default["fingerprint"], whole);

    // /v1/payments requires a key.
    let keyless = send(&client, addr, "POST", "/v1/payments", &json, br#"{"amount":10}"#).await;
    assert_eq!(keyless.status, 400);
    assert_eq!(keyless.json()["type"], "urn:idempotency:problem:missing-key");

    // 64 copies of one key at once: one execution.
    let copies: Vec<_> = (0..64)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move {
                send(
                    &client,
                    addr,
                    "POST",
                    "/v1/payments",
                    &[("idempotency-key", "pay-64")],
                    br#"{"amount":64}"#,
                )
                .await
                .status
            })
        })
        .collect();
    for copy in copies {
        let status = copy.await.unwrap();
        assert!(matches!(status, 201 | 409), "{status}");
    }
    assert_eq!(calls(&client, upstream, "pay-64").await, 1);

    // Retention: the route's 60 s against the top level's 2 s.
    let payment = [("idempotency-key", "pay-kept")];
    let unlisted = [("idempotency-key", "echo-gone")];
    assert_eq!(
        send(&client, addr, "POST", "/v1/payments", &payment, b"{}")
            .await
            .status,
        201
    );
    let first = send(&client, addr, "POST", "/echo", &unlisted, b"{}").await;
    assert_eq!(first.status, 201);
    let top = |response: &common::Seen| response.header("idempotency-key-expires").map(str::to_owned);
    assert!(top(&first).is_some());
    // The records' expiries are the stores' clock's: wait past the shorter one.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let kept = send(&client, addr, "POST", "/v1/payments", &payment, b"{}").await;
    assert_eq!(kept.header("idempotent-replayed"), Some("true"));
    let gone = send(&client, addr, "POST", "/echo", &unlisted, b"{}").await;
    assert_eq!(gone.header("idempotent-replayed"), None);
    assert_eq!(calls(&client, upstream, "pay-kept").await, 1);
    assert_eq!(calls(&client, upstream, "echo-gone").await, 2);
    // An unlisted path gets the top-level settings: guarded, replayed within its retention.
    let again = send(&client, addr, "POST", "/echo", &unlisted, b"{}").await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));

    // /v1/search is not guarded: two executions, nothing recorded.
    let search = [("idempotency-key", "search-1")];
    for _ in 0..2 {
        let found = send(&client, addr, "POST", "/v1/search", &search, br#"{"q":"x"}"#).await;
        assert_eq!(found.status, 201);
        assert_eq!(found.header("idempotent-replayed"), None);
    }
    assert_eq!(calls(&client, upstream, "search-1").await, 2);
    let store = common::sqlite_url(dir.path());
    let (code, listed, err) = idem(&["keys", "list", "--store", &store]);
    assert_eq!(code, 0, "{err}");
    assert!(!listed.contains("search-1"), "{listed}");
    assert!(listed.contains("pay-kept"), "{listed}");

    // /v1/orders: the key is X-Request-Id, and only amount and currency decide a mismatch.
    let order = [("x-request-id", "order-7"), ("content-type", "application/json")];
    let placed = send(
        &client,
        addr,
        "POST",
        "/v1/orders",
        &order,
        br#"{"amount":5,"currency":"EUR","note":"a"}"#,
    )
    .await;
    assert_eq!(placed.status, 201);
    let retried = send(
        &client,
        addr,
        "POST",
        "/v1/orders",
        &order,
        br#"{"amount":5,"currency":"EUR","note":"b"}"#,
    )
    .await;
    assert_eq!(retried.header("idempotent-replayed"), Some("true"));
    let other = send(
        &client,
        addr,
        "POST",
        "/v1/orders",
        &order,
        br#"{"amount":6,"currency":"EUR"}"#,
    )
    .await;
    assert_eq!(other.status, 422);
    assert_eq!(calls(&client, upstream, "order-7").await, 1);

    // /v1/refunds: another upstream, the key from the body.
    let refund = br#"{"refund_id":"re-1","amount":3}"#;
    let made = send(&client, addr, "POST", "/v1/refunds", &json, refund).await;
    assert_eq!(made.status, 201);
    assert_eq!(made.json()["key"], "re-1");
    let replayed = send(&client, addr, "POST", "/v1/refunds", &json, refund).await;
    assert_eq!(replayed.header("idempotent-replayed"), Some("true"));
    assert_eq!(calls(&client, refunds, "re-1").await, 1);
    assert_eq!(calls(&client, upstream, "re-1").await, 0);

    // A path that only starts like a route's is not that route's: /v1/payments-export gets the
    // top-level settings (no key required), and a dot segment does not slip past a route.
    let export = send(&client, addr, "POST", "/v1/payments-export", &[], b"{}").await;
    assert_eq!(export.status, 201);
    let dotted = send(&client, addr, "POST", "/v1/x/../payments", &[], b"{}").await;
    assert_eq!(dotted.status, 400, "{}", String::from_utf8_lossy(&dotted.body));
    let encoded = send(&client, addr, "POST", "/v1/%70ayments", &[], b"{}").await;
    assert_eq!(encoded.status, 400, "{}", String::from_utf8_lossy(&encoded.body));
}

/// `--check` on the example file: valid, with every setting's value and origin; a flag and a
/// variable win over the file.
#[test]
fn check_prints_the_effective_settings_and_where_they_come_from() {
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/idem.toml");
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["serve", "--config", file, "--check", "--lease", "45s"])
        .env("IDEM_WAIT", "3s")
        .env_remove("IDEM_RETENTION")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(text.contains("idem.toml: valid"), "{text}");
    let row = |name: &str| {
        text.lines()
            .find(|line| line.trim_start().starts_with(&format!("{name} ")))
            .map(|line| line.split_whitespace().collect::<Vec<_>>().join(" "))
            .unwrap_or_default()
    };
    assert_eq!(row("upstream"), "upstream http://127.0.0.1:3000 [file]");
    assert_eq!(row("scope-header"), "scope-header Authorization [file]");
    assert_eq!(row("lease"), "lease 45s [flag]");
    assert_eq!(row("wait"), "wait 3s [env]");
    assert_eq!(row("retention"), "retention 24h [default]");
    assert!(text.contains("routes (4;"), "{text}");
    assert!(
        text.contains("1. /v1/payments (name /v1/payments, line 12)"),
        "{text}"
    );
    // The payments route's own retention, and the lease it inherits from the flag.
    let payments = text
        .split("1. /v1/payments")
        .nth(1)
        .unwrap()
        .split("2. ")
        .next()
        .unwrap();
    let route_row = |name: &str| {
        payments
            .lines()
            .find(|line| line.trim_start().starts_with(&format!("{name} ")))
            .map(|line| line.split_whitespace().collect::<Vec<_>>().join(" "))
            .unwrap_or_default()
    };
    assert_eq!(route_row("retention"), "retention 7d [route, line 12]");
    assert_eq!(route_row("lease"), "lease 45s [gateway, flag]");
    assert_eq!(route_row("require-key"), "require-key true [route, line 12]");
    assert_eq!(route_row("key-header"), "key-header Idempotency-Key [default]");
    let orders = text.split("3. /v1/orders").nth(1).unwrap();
    assert!(orders.contains("fingerprint"), "{orders}");
    assert!(orders.contains("/amount,/currency  [route, line 23]"), "{orders}");
}

/// Every secret setting of `idem serve` ranks its sources as docs/HTTP.md states, highest
/// first: the flag, its `IDEM_*` variable, the variable's `_FILE`, the configuration file, the
/// default. `--check` names the source that won.
#[test]
fn a_secret_setting_ranks_flag_variable_its_file_the_config_file_then_the_default() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("store", "IDEM_STORE", "sqlite:///tmp/idem-from-"),
        ("scope-secret", "IDEM_SCOPE_SECRET", "a-scope-secret-from-"),
        ("admin-token", "IDEM_ADMIN_TOKEN", "an-admin-token-from-"),
        ("ui-database", "IDEM_UI_DATABASE", "postgres://app@db/idem-from-"),
    ];
    for (long, variable, prefix) in cases {
        let value = |source: &str| format!("{prefix}{source}");
        let config = dir.path().join(format!("{long}.toml"));
        std::fs::write(
            &config,
            format!(
                "upstream = \"http://127.0.0.1:3000\"\nadmin-listen = \"127.0.0.1:9\"\nui = true\n{long} = \"{}\"\n",
                value("config-file")
            ),
        )
        .unwrap();
        let secret = dir.path().join(format!("{long}.secret"));
        std::fs::write(&secret, format!("{}\n", value("secret-file"))).unwrap();
        let secret_file = (format!("{variable}_FILE"), secret.display().to_string());
        let in_variable = (variable.to_owned(), value("variable"));
        let flag = [format!("--{long}"), value("flag")];
        let check = |env: &[&(String, String)], flags: &[String]| {
            let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_idem"));
            command
                .args(["serve", "--config", config.to_str().unwrap(), "--check"])
                .args(flags);
            for (_, name, _) in cases {
                command.env_remove(name).env_remove(format!("{name}_FILE"));
            }
            for (name, value) in env {
                command.env(name, value);
            }
            let output = command.output().unwrap();
            let text = String::from_utf8_lossy(&output.stdout).into_owned();
            assert!(
                output.status.success(),
                "{long}: {text}{}",
                String::from_utf8_lossy(&output.stderr)
            );
            let row = text
                .lines()
                .find(|line| line.trim_start().starts_with(&format!("{long} ")))
                .unwrap_or_else(|| panic!("no {long} row: {text}"))
                .trim()
                .to_owned();
            let (shown, source) = row.rsplit_once("  [").unwrap();
            (shown.to_owned(), source.trim_end_matches(']').to_owned())
        };
        type Step<'a> = (&'a [&'a (String, String)], &'a [String], &'a str, &'a str);
        let steps: [Step<'_>; 5] = [
            (&[], &[], "file", "config-file"),
            (&[&secret_file], &[], "env file", "secret-file"),
            (&[&in_variable], &[], "env", "variable"),
            (&[&in_variable], &flag, "flag", "flag"),
            (&[&secret_file], &flag, "flag", "flag"),
        ];
        for (env, flags, source, from) in steps {
            let (shown, got) = check(env, flags);
            assert_eq!(got, source, "{long} with {env:?} {flags:?}: {shown}");
            // The URLs show which value won; the secrets are masked, their source says it.
            if matches!(long, "store" | "ui-database") {
                assert!(shown.contains(&format!("from-{from}")), "{long}: {shown}");
            } else {
                assert!(shown.ends_with("***"), "{long} is never shown: {shown}");
            }
        }
    }
}

/// Each kind of bad file stops `idem serve` (and `--check`) with exit code 1 and the file, the
/// line, the column and the reason.
#[test]
fn bad_files_are_refused_with_the_place_and_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let head = "upstream = \"http://127.0.0.1:3000\"\n";
    for (name, body, place, why) in [
        (
            "unknown-key",
            "retension = \"1h\"\n",
            ":2:1:",
            "unknown key `retension`",
        ),
        (
            "route-key",
            "[[route]]\npath = \"/a\"\nretries = 3\n",
            ":4:1:",
            "unknown field `retries`",
        ),
        (
            "no-path",
            "[[route]]\nmethods = [\"POST\"]\n",
            ":2:1:",
            "missing field `path`",
        ),
        (
            "duration",
            "[[route]]\npath = \"/a\"\nlease = \"soon\"\n",
            ":4:9:",
            "`lease`",
        ),
        (
            "top-duration",
            "retention = \"forever\"\n",
            ":2:1:",
            "--retention",
        ),
        (
            "pointer",
            "[[route]]\npath = \"/a\"\nkey-from = \"refund_id\"\n",
            ":4:12:",
            "not a JSON pointer",
        ),
        (
            "fingerprint",
            "[[route]]\npath = \"/a\"\nfingerprint = [\"amount\"]\n",
            ":4:15:",
            "not a JSON pointer",
        ),
        (
            "upstream",
            "[[route]]\npath = \"/a\"\nupstream = \"not a url\"\n",
            ":4:12:",
            "`upstream`",
        ),
        (
            "release-on",
            "[[route]]\npath = \"/a\"\nrelease-on = \"5xx,abc\"\n",
            ":4:14:",
            "`release-on`",
        ),
        (
            "methods",
            "[[route]]\npath = \"/a\"\nmethods = [\"P O S T\"]\n",
            ":4:12:",
            "`methods`",
        ),
        (
            "syntax",
            "[[route]\npath = \"/a\"\n",
            ":2:9:",
            "unclosed array table",
        ),
        ("switch", "require-key = \"yes\"\n", ":2:15:", "is a switch"),
    ] {
        let path = dir.path().join(format!("{name}.toml"));
        std::fs::write(&path, format!("{head}{body}")).unwrap();
        let path = path.display().to_string();
        for check in [true, false] {
            let mut args = vec!["serve", "--config", path.as_str(), "--store", "memory://"];
            if check {
                args.push("--check");
            }
            let (code, _, err) = idem(&args);
            assert_eq!(code, 1, "{name}: {err}");
            assert!(err.contains(&format!("{path}{place}")), "{name}: {err}");
            assert!(err.contains(why), "{name}: {err}");
        }
    }
    // An unreadable file.
    let (code, _, err) = idem(&["serve", "--config", "/nonexistent/idem.toml", "--check"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("/nonexistent/idem.toml: cannot be read"), "{err}");
}

/// A route an earlier one shadows is warned about, naming both lines.
#[test]
fn a_shadowed_route_is_warned_about_with_both_lines() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shadow.toml");
    std::fs::write(
        &path,
        "upstream = \"http://127.0.0.1:3000\"\n\n[[route]]\npath = \"/v1\"\n\n[[route]]\npath = \"/v1/payments\"\nmethods = [\"POST\"]\n",
    )
    .unwrap();
    let (code, out, err) = idem(&["serve", "--config", path.to_str().unwrap(), "--check"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(
            "the route /v1/payments is never reached: the route at line 3 (/v1) takes every request it would"
        ),
        "{out}"
    );
    assert!(out.contains("shadow.toml:6:"), "{out}");
}

/// A payment with `key` on /v1/payments: how many seconds its record is kept, from the
/// response's `Date` to its `Idempotency-Key-Expires`.
async fn payment_retained_for(client: &common::HttpClient, addr: std::net::SocketAddr, key: &str) -> u64 {
    let seen = send(
        client,
        addr,
        "POST",
        "/v1/payments",
        &[("idempotency-key", key)],
        b"{}",
    )
    .await;
    assert_eq!(seen.status, 201, "{key}");
    retained_for(&seen)
}

/// Seconds from the response's `Date` to its `Idempotency-Key-Expires`.
fn retained_for(seen: &common::Seen) -> u64 {
    let at = |name: &str| {
        httpdate::parse_http_date(seen.header(name).unwrap_or_else(|| panic!("no {name}"))).unwrap()
    };
    at("idempotency-key-expires")
        .duration_since(at("date"))
        .unwrap()
        .as_secs()
}

/// SIGHUP while 50 requests are in flight on /v1/payments and the file gives the route another
/// retention: none fails, and later requests get the new retention. A file that does not parse
/// keeps the running routes, and the metric and the log say so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_file_and_no_request_in_flight_fails() {
    let (_upstream, upstream) = start_upstream();
    let dir = tempfile::tempdir().unwrap();
    let up = format!("http://{upstream}");
    let file = example(dir.path(), &up, &up);
    let addr = free_addr();
    // The gateway's log, read as it comes.
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["serve", "--listen", &addr.to_string(), "--config", &file])
        .env("IDEM_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn({
        let log = std::sync::Arc::clone(&log);
        move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut log = log.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        }
    });
    let gateway = common::ready(common::Process { child }, addr, "idem serve").await;
    let client = client();
    let hangup = || {
        let status = std::process::Command::new("kill")
            .args(["-HUP", &gateway.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    };
    let before = payment_retained_for(&client, addr, "before").await;
    assert!((55..=60).contains(&before), "{before}");

    // 50 requests held by the upstream, then the file changes and SIGHUP comes.
    let keys: Vec<String> = (0..50).map(|n| format!("held-{n}")).collect();
    let held: Vec<_> = keys
        .iter()
        .map(|key| {
            let (client, key) = (client.clone(), key.clone());
            tokio::spawn(async move {
                send(
                    &client,
                    addr,
                    "POST",
                    "/v1/payments?ms=1500",
                    &[("idempotency-key", &key)],
                    b"{}",
                )
                .await
            })
        })
        .collect();
    for key in &keys {
        idempotency_testkit::eventually(
            Duration::from_secs(30),
            "the request reached the upstream",
            async || calls(&client, upstream, key).await == 1,
        )
        .await;
    }
    let text = std::fs::read_to_string(&file)
        .unwrap()
        .replace("retention = \"60s\"", "retention = \"3600s\"");
    std::fs::write(&file, text).unwrap();
    hangup();
    for request in held {
        let answered = request.await.unwrap();
        assert_eq!(
            answered.status,
            201,
            "{}",
            String::from_utf8_lossy(&answered.body)
        );
    }
    common::metric_at_least(addr, "idem_config_reloads_total", &[("result", "ok")], 1.0).await;
    let after = payment_retained_for(&client, addr, "after").await;
    assert!((3595..=3600).contains(&after), "{after}");
    for key in &keys {
        assert_eq!(calls(&client, upstream, key).await, 1, "{key}");
    }

    // A file that does not parse: the running routes stay (a key is still required there).
    std::fs::write(
        &file,
        "upstream = \"http://127.0.0.1:3000\"\n[[route]]\nretries = 3\n",
    )
    .unwrap();
    hangup();
    common::metric_at_least(addr, "idem_config_reloads_total", &[("result", "failed")], 1.0).await;
    let logged = format!("{file}:3:1: unknown field `retries`");
    idempotency_testkit::eventually(Duration::from_secs(30), "the failed reload logged", async || {
        log.lock().unwrap().contains(&logged)
    })
    .await;
    assert!(log.lock().unwrap().contains("the running configuration stays"));
    let keyless = send(&client, addr, "POST", "/v1/payments", &[], b"{}").await;
    assert_eq!(keyless.status, 400);
    let still = payment_retained_for(&client, addr, "still").await;
    assert!((3595..=3600).contains(&still), "{still}");
}
