//! `idem serve` as a separate process in front of an upstream process: what a client of the
//! gateway sees, what the upstream receives, and what bad input gets.

use crate::common;

use std::time::Duration;

use common::{Fronted, calls, client, free_addr, idem, send, start_gateway, start_upstream};

/// With a base path on the upstream, `..` segments (plain or percent-encoded) are resolved
/// before the base is prefixed: no request target leaves the base.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dot_segments_cannot_leave_the_upstream_base_path() {
    let (_upstream, upstream) = start_upstream();
    let addr = free_addr();
    let up = format!("http://{upstream}/api");
    let _gateway = start_gateway(addr, &["--upstream", &up, "--store", "memory://"], true).await;
    let client = client();
    for (sent, arrived) in [
        ("/orders/1", "/api/orders/1"),
        ("/../internal/admin", "/api/internal/admin"),
        ("/a/../../internal/admin", "/api/internal/admin"),
        ("/%2e%2e/internal/admin", "/api/internal/admin"),
        ("/%2E%2e/%2e/internal/./admin/", "/api/internal/admin/"),
        ("/a/b/..", "/api/a/"),
    ] {
        let got = send(&client, addr, "GET", sent, &[], b"").await;
        assert_eq!(String::from_utf8_lossy(&got.body), arrived, "{sent}");
    }
}

/// `idem serve --store dynamodb://…` against the local AWS server: the second request is a
/// replay, the upstream ran once, and the operations commands read the same record.
#[cfg(feature = "dynamodb")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_on_a_dynamodb_table() {
    let endpoint = std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:5000".into());
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let store = format!("dynamodb://gateway_{nonce}?region=us-east-1&endpoint={endpoint}");
    let (code, _, stderr) = idem(&["keys", "stats", "--store", &store]);
    assert_ne!(code, 0, "a missing table must not be created by inspection");
    assert!(stderr.contains("does not exist"), "{stderr}");
    let gateway = Fronted::start(Some(&store), &[], true).await;
    let (addr, upstream) = (gateway.addr, gateway.upstream);
    let client = client();
    let key = [("idempotency-key", "ddb-order-1")];
    let first = send(&client, addr, "POST", "/echo", &key, br#"{"amount":10}"#).await;
    assert_eq!(first.status, 201);
    let replay = send(&client, addr, "POST", "/echo", &key, br#"{"amount":10}"#).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, first.body);
    assert_eq!(calls(&client, upstream, "ddb-order-1").await, 1);
    let (code, stdout, stderr) = idem(&["keys", "stats", "--store", &store]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("completed"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_conflicts_mismatches_and_forwards_the_key_and_attempt() {
    let gateway = Fronted::sqlite(&[]).await;
    let (addr, upstream, store) = (gateway.addr, gateway.upstream, &gateway.store);
    let client = client();
    let key = [
        ("idempotency-key", "order-1"),
        ("content-type", "application/json"),
    ];

    // First request: runs once, with the key and attempt forwarded.
    let first = send(&client, addr, "POST", "/echo", &key, br#"{"amount":10}"#).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.json()["key"], "order-1");
    assert_eq!(first.json()["attempt"], "1");
    assert_eq!(first.header("set-cookie"), Some("session=abc; HttpOnly"));
    assert!(first.header("idempotency-key-expires").is_some());

    // The retry: the stored response, without Set-Cookie, and the upstream did not run again.
    let replay = send(&client, addr, "POST", "/echo", &key, br#"{"amount":10}"#).await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("x-upstream"), Some("yes"));
    assert_eq!(
        replay.header("set-cookie"),
        None,
        "Set-Cookie must not be replayed"
    );
    assert_eq!(calls(&client, upstream, "order-1").await, 1);

    // Another payload under the same key: 422, and nothing runs.
    let reused = send(&client, addr, "POST", "/echo", &key, br#"{"amount":99}"#).await;
    assert_eq!(reused.status, 422);
    assert_eq!(reused.json()["type"], "urn:idempotency:problem:key-reused");
    assert_eq!(calls(&client, upstream, "order-1").await, 1);

    // A duplicate while the first is still running: 409 with Retry-After.
    let slow_key = [("idempotency-key", "order-2")];
    let running = {
        let client = client.clone();
        tokio::spawn(async move { send(&client, addr, "POST", "/slow?ms=800", &slow_key, b"x").await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let conflict = send(&client, addr, "POST", "/slow?ms=800", &slow_key, b"x").await;
    assert_eq!(conflict.status, 409);
    assert!(conflict.header("retry-after").is_some());
    assert_eq!(running.await.unwrap().status, 201);
    assert_eq!(calls(&client, upstream, "order-2").await, 1);

    // Malformed and duplicated keys: 400.
    let malformed = send(
        &client,
        addr,
        "POST",
        "/echo",
        &[("idempotency-key", "\"unterminated")],
        b"x",
    )
    .await;
    assert_eq!(malformed.status, 400);
    assert_eq!(malformed.json()["type"], "urn:idempotency:problem:invalid-key");

    // A 5xx releases the key: the retry runs again, as attempt 2 (the first may have partly
    // run), and is stored.
    let flaky = [("idempotency-key", "order-3")];
    assert_eq!(
        send(&client, addr, "POST", "/flaky", &flaky, b"x").await.status,
        503
    );
    let retried = send(&client, addr, "POST", "/flaky", &flaky, b"x").await;
    assert_eq!(retried.status, 201);
    assert_eq!(retried.json()["calls"], 2);
    assert_eq!(
        retried.json()["attempt"],
        "2",
        "a released key ran again as if it were new"
    );
    assert_eq!(
        send(&client, addr, "POST", "/flaky", &flaky, b"x")
            .await
            .header("idempotent-replayed"),
        Some("true")
    );
    assert_eq!(calls(&client, upstream, "order-3").await, 2);

    // A chunked upstream response within the limit is stored and replayed.
    let big = [("idempotency-key", "order-4")];
    let first = send(&client, addr, "POST", "/big?bytes=5000", &big, b"").await;
    let replay = send(&client, addr, "POST", "/big?bytes=5000", &big, b"").await;
    assert_eq!((first.body.len(), replay.body.len()), (5000, 5000));
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(calls(&client, upstream, "order-4").await, 1);

    // The gateway's attempt header cannot be forged: an unguarded request's own value is dropped.
    let forged = send(
        &client,
        addr,
        "POST",
        "/echo",
        &[("idempotency-attempt", "7")],
        b"no key",
    )
    .await;
    assert_eq!(forged.status, 201);
    assert_eq!(
        forged.json()["attempt"],
        "-",
        "a client's Idempotency-Attempt reached the upstream"
    );

    // GET is not guarded by default: it passes through untouched.
    let get = send(
        &client,
        addr,
        "GET",
        "/calls?key=order-1",
        &[("idempotency-key", "g")],
        b"",
    )
    .await;
    assert_eq!(String::from_utf8_lossy(&get.body), "1");

    // The operations CLI sees the records the gateway wrote.
    let (code, out, err) = idem(&["keys", "get", "order-1", "--store", store, "--json"]);
    assert_eq!(code, 0, "{err}");
    let record: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(record["state"], "completed");
    assert_eq!(record["outcome"]["status"], 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scopes_wait_mode_required_keys_and_body_limits() {
    let flags = [
        "--scope-header",
        "Authorization",
        "--wait",
        "5s",
        "--require-key",
        "--max-body",
        "1KiB",
    ];
    let gateway = Fronted::start(Some("memory://"), &flags, true).await;
    let addr = gateway.addr;
    let client = client();

    // Two tenants, one key: two executions, each forwarded with its own scoped key.
    let alice = [("idempotency-key", "k1"), ("authorization", "Bearer alice")];
    let bob = [("idempotency-key", "k1"), ("authorization", "Bearer bob")];
    let a = send(&client, addr, "POST", "/echo", &alice, b"same").await;
    let b = send(&client, addr, "POST", "/echo", &bob, b"same").await;
    assert_eq!((a.status, b.status), (201, 201));
    let (a_key, b_key) = (
        a.json()["key"].as_str().unwrap().to_owned(),
        b.json()["key"].as_str().unwrap().to_owned(),
    );
    assert_ne!(a_key, b_key);
    assert!(
        a_key.ends_with(":k1") && !a_key.contains("alice"),
        "scoped by a hash, not the secret: {a_key}"
    );
    assert_eq!(b.header("idempotent-replayed"), None);

    // Wait mode: a duplicate of a running request waits and gets the replay, not 409.
    let slow = [("idempotency-key", "k2"), ("authorization", "Bearer alice")];
    let running = {
        let client = client.clone();
        tokio::spawn(async move { send(&client, addr, "POST", "/slow?ms=600", &slow, b"x").await })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    let waited = send(&client, addr, "POST", "/slow?ms=600", &slow, b"x").await;
    assert_eq!(waited.status, 201);
    assert_eq!(waited.header("idempotent-replayed"), Some("true"));
    assert_eq!(running.await.unwrap().body, waited.body);

    // A key is required: 400 without one.
    let missing = send(
        &client,
        addr,
        "POST",
        "/echo",
        &[("authorization", "Bearer alice")],
        b"x",
    )
    .await;
    assert_eq!(missing.status, 400);
    assert_eq!(missing.json()["type"], "urn:idempotency:problem:missing-key");

    // A body over the limit: 413, and the upstream never sees it.
    let large = vec![b'x'; 4096];
    let too_large = send(
        &client,
        addr,
        "POST",
        "/echo",
        &[("idempotency-key", "k3"), ("authorization", "Bearer alice")],
        &large,
    )
    .await;
    assert_eq!(too_large.status, 413);
    assert_eq!(too_large.json()["type"], "urn:idempotency:problem:body-too-large");

    // The gateway's own endpoints.
    let health = send(&client, addr, "GET", "/_idem/healthz", &[], b"").await;
    assert_eq!(health.status, 200);
    let metrics = send(&client, addr, "GET", "/_idem/metrics", &[], b"").await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(text.contains("idempotency_"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_upstream_is_a_502_problem_and_releases_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::sqlite_url(dir.path());
    let nowhere = format!("http://{}", free_addr());
    let addr = free_addr();
    let gateway = start_gateway(addr, &["--upstream", &nowhere, "--store", &store], true).await;
    let client = client();
    let key = [("idempotency-key", "order-9")];
    let seen = send(&client, addr, "POST", "/echo", &key, b"x").await;
    assert_eq!(seen.status, 502);
    assert_eq!(
        seen.json()["type"],
        "urn:idempotency:problem:upstream-unreachable"
    );
    // Released, not stored: the retry tries the upstream again rather than replaying the 502.
    let again = send(&client, addr, "POST", "/echo", &key, b"x").await;
    assert_eq!(again.status, 502);
    assert_eq!(again.header("idempotent-replayed"), None);
    drop(gateway);
    // The record stays, held by no attempt: the next try is attempt 3.
    let (code, out, err) = idem(&["keys", "get", "order-9", "--store", &store, "--json"]);
    assert_eq!(code, 0, "{err}");
    let record: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (
            record["state"].as_str(),
            record["attempt"].as_u64(),
            record["held_by"].as_str()
        ),
        (Some("in_flight"), Some(2), Some("nobody (released)")),
        "{record}"
    );
}

/// `--release-on` without `5xx` (Stripe's choice): the upstream's 503 is final and replayed,
/// and the request does not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_release_policy_is_a_flag() {
    let gateway = Fronted::sqlite(&["--release-on", "408,409,425,429"]).await;
    let (addr, upstream) = (gateway.addr, gateway.upstream);
    let client = client();
    let key = [("idempotency-key", "stripe-1")];
    let first = send(&client, addr, "POST", "/flaky", &key, b"x").await;
    assert_eq!(first.status, 503);
    let again = send(&client, addr, "POST", "/flaky", &key, b"x").await;
    assert_eq!(again.status, 503);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(calls(&client, upstream, "stripe-1").await, 1);
}

#[test]
fn bad_input_gets_clear_errors() {
    let up = ["serve", "--upstream", "http://127.0.0.1:1"];
    let nonsense: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--lease", "0s"], "out of range for --lease"),
        (
            vec!["--lease", "18446744073709551615s"],
            "out of range for --lease",
        ),
        (vec!["--retention", "0s"], "out of range for --retention"),
        (vec!["--retention", "3000000d"], "out of range for --retention"),
        (
            vec!["--upstream-timeout", "0s"],
            "out of range for --upstream-timeout",
        ),
        (vec!["--max-body", "0"], "out of range for a size limit"),
        (
            vec!["--header-timeout", "0s"],
            "out of range for a client timeout",
        ),
        (vec!["--body-timeout", "2h"], "out of range for a client timeout"),
        (vec!["--drain-timeout", "2h"], "out of range for --drain-timeout"),
        (vec!["--max-connections", "0"], "--max-connections"),
        (vec!["--release-on", "6xx"], "`6xx` is not an HTTP status"),
        (vec!["--wait", "0s"], "out of range for --wait"),
    ];
    for (flags, expected) in nonsense {
        let args: Vec<&str> = up.iter().copied().chain(flags.iter().copied()).collect();
        let (got, _, err) = idem(&args);
        assert_eq!(got, 2, "{flags:?}: {err}");
        assert!(err.contains(expected), "{flags:?}: {err}");
        assert!(!err.contains("panicked"), "{flags:?}: {err}");
    }
    let cases: &[(&[&str], i32, &str)] = &[
        (
            &["serve", "--upstream", "http://127.0.0.1:1", "--frobnicate"],
            2,
            "unexpected argument '--frobnicate'",
        ),
        (&["serve"], 2, "--upstream <UPSTREAM>"),
        (
            &[
                "serve",
                "--upstream",
                "http://127.0.0.1:1",
                "--no-migrate",
                "--store",
                "sqlite:///nonexistent-dir/x.db",
            ],
            1,
            "does not exist (`idem migrate --store",
        ),
        (
            &[
                "serve",
                "--upstream",
                "http://127.0.0.1:1",
                "--max-buffered",
                "1KiB",
            ],
            2,
            "--max-buffered is smaller than --max-body",
        ),
        (
            &[
                "serve",
                "--upstream",
                "http://127.0.0.1:1",
                "--scope-secret",
                "hunter2",
            ],
            2,
            "error: --scope-secret: the scope secret is 7 bytes long; at least 16 bytes are needed",
        ),
        (
            &["serve", "--upstream", "http://127.0.0.1:1", "--lease", "5x"],
            2,
            "unknown unit `x`",
        ),
        (
            &["serve", "--upstream", "http://127.0.0.1:1", "--lease", "soon"],
            2,
            "`soon` is not a duration",
        ),
        (
            &[
                "serve",
                "--upstream",
                "http://127.0.0.1:1",
                "--max-body",
                "1 zillion",
            ],
            2,
            "unknown unit `zillion`",
        ),
        (
            &[
                "serve",
                "--upstream",
                "http://127.0.0.1:1",
                "--methods",
                "POST,FETCH",
            ],
            2,
            "`FETCH` is not an HTTP method",
        ),
        (
            &["serve", "--upstream", "ftp://example.com"],
            2,
            "must be an http:// or https:// URL",
        ),
        (
            &[
                "serve",
                "--upstream",
                "https://example.com",
                "--upstream-client-cert",
                "/etc/idem/client.pem",
            ],
            2,
            "--upstream-client-key",
        ),
        (
            &[
                "serve",
                "--upstream",
                "http://127.0.0.1:1",
                "--listen",
                "localhost",
            ],
            2,
            "invalid socket address",
        ),
        (
            &[
                "serve",
                "--upstream",
                "http://127.0.0.1:1",
                "--store",
                "mongodb://x",
            ],
            1,
            "mongodb",
        ),
        (
            &["keys", "stats", "--store", "postgres://u:hunter2@127.0.0.1:1/x"],
            1,
            "store postgres://u:***@127.0.0.1:1/x",
        ),
        (
            &["keys", "list", "--store", "memory://", "--state", "sleeping"],
            2,
            "invalid value 'sleeping'",
        ),
        (
            &["keys", "get", "bad key", "--store", "memory://"],
            1,
            "invalid key `bad key`",
        ),
        (
            &["keys", "get", "absent", "--store", "memory://"],
            1,
            "`memory://` is a store inside one process",
        ),
        (
            &["inflight", "--older-than=-1m", "--store", "memory://"],
            2,
            "not a duration",
        ),
        (&["demo", "--requests", "many"], 2, "invalid value 'many'"),
    ];
    for (args, code, expected) in cases {
        let (got, out, err) = idem(args);
        assert_eq!(got, *code, "{args:?}: stdout {out} stderr {err}");
        assert!(
            err.contains(expected),
            "{args:?}: expected `{expected}` in: {err}"
        );
        assert!(!err.contains("hunter2"), "a password was echoed: {err}");
    }
    // Environment variables are validated like flags.
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["serve", "--upstream", "http://127.0.0.1:1"])
        .env("IDEM_RETENTION", "forever")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("`forever` is not a duration"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoints_can_have_a_listener_of_their_own() {
    let (_upstream, upstream) = start_upstream();
    let up = format!("http://{upstream}");
    let (addr, admin) = (free_addr(), free_addr());
    let admin_text = admin.to_string();
    let _gateway = start_gateway(
        addr,
        &[
            "--upstream",
            &up,
            "--store",
            "memory://",
            "--admin-listen",
            &admin_text,
        ],
        false,
    )
    .await;
    let client = client();
    let mut health = None;
    for _ in 0..100 {
        health = common::try_send(&client, admin, "GET", "/healthz", &[], b"").await;
        if health.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(health.expect("the admin listener answers").status, 200);
    let metrics = send(&client, admin, "GET", "/metrics", &[], b"").await;
    assert_eq!(metrics.status, 200);
    assert_eq!(metrics.header("content-type"), Some("text/plain; version=0.0.4"));
    // With an admin listener, the main listener reserves no prefix: everything is proxied.
    let proxied = send(&client, addr, "GET", "/_idem/healthz", &[], b"").await;
    assert_eq!(proxied.status, 404, "the upstream answered, not the gateway");
}

/// Scopes are an HMAC of the normalised credential under one secret that gateways on one store
/// share (generated by the first and kept in the store, or given with `--scope-secret`), and a
/// global-scope client cannot forge the key another scope forwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scopes_are_keyed_shared_and_cannot_be_forged() {
    let (_upstream, upstream) = start_upstream();
    let dir = tempfile::tempdir().unwrap();
    let (store, up) = (common::sqlite_url(dir.path()), format!("http://{upstream}"));
    let scoped = [
        "--upstream",
        up.as_str(),
        "--store",
        store.as_str(),
        "--scope-header",
        "Authorization",
    ];
    let (a, b) = (free_addr(), free_addr());
    let _gateway_a = start_gateway(a, &scoped, true).await;
    let _gateway_b = start_gateway(b, &scoped, true).await;
    let client = client();

    // Through gateway A, then the retry through gateway B with the scheme in another case and
    // more spaces: one scope, one run.
    let first = send(
        &client,
        a,
        "POST",
        "/echo",
        &[("idempotency-key", "k1"), ("authorization", "Bearer alice")],
        b"x",
    )
    .await;
    let retry = send(
        &client,
        b,
        "POST",
        "/echo",
        &[("idempotency-key", "k1"), ("authorization", "bearer   alice")],
        b"x",
    )
    .await;
    assert_eq!((first.status, retry.status), (201, 201));
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    let forwarded = first.json()["key"].as_str().unwrap().to_owned();
    assert_eq!(calls(&client, upstream, &forwarded).await, 1);

    // The scope is keyed: not the plain SHA-256 a password could be guessed from.
    let (scope, key) = forwarded.split_once(':').unwrap();
    assert_eq!((scope.len(), key), (64, "k1"));
    assert_ne!(scope, idempotency::Scope::digest(b"Bearer alice").as_str());
    assert_ne!(scope, idempotency::Scope::digest(b"bearer alice").as_str());

    // A client without credentials sending alice's forwarded form as its key: a key of its own.
    let forged = send(
        &client,
        a,
        "POST",
        "/echo",
        &[("idempotency-key", &forwarded)],
        b"x",
    )
    .await;
    assert_eq!(forged.status, 201);
    assert_eq!(forged.header("idempotent-replayed"), None);
    assert_eq!(forged.json()["key"], format!("{scope}%3Ak1"));
    assert_eq!(calls(&client, upstream, &forwarded).await, 1);
    // Requests without the header share the global scope (docs/HTTP.md says so): another
    // caller without credentials sending that key gets the first one's response.
    let anonymous = send(
        &client,
        b,
        "POST",
        "/echo",
        &[("idempotency-key", &forwarded)],
        b"x",
    )
    .await;
    assert_eq!(anonymous.header("idempotent-replayed"), Some("true"));

    // The kept secret is in the store, and the operations CLI does not show it.
    let (code, out, err) = idem(&[
        "keys",
        "get",
        "scope-secret-v1",
        "--scope",
        "idempotency.internal",
        "--store",
        &store,
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let record: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (record["state"].as_str(), record["outcome"]["kind"].as_str()),
        (Some("completed"), Some("secret"))
    );
    assert_eq!(record["outcome"]["len"], 32);

    // A secret given on the command line keys the scope with it.
    let c = free_addr();
    let secret = "a shared secret of 32 bytes, ok!";
    let given = [
        "--upstream",
        up.as_str(),
        "--store",
        "memory://",
        "--scope-header",
        "Authorization",
        "--scope-secret",
        secret,
    ];
    let _gateway_c = start_gateway(c, &given, true).await;
    let seen = send(
        &client,
        c,
        "POST",
        "/echo",
        &[("idempotency-key", "k2"), ("authorization", " Bearer  alice ")],
        b"x",
    )
    .await;
    let expected = idempotency::ScopeSecret::new(secret)
        .unwrap()
        .scope(b"bearer alice");
    assert_eq!(seen.json()["key"], format!("{expected}:k2"));
}

/// `/_idem/healthz` reports a store whose reads work and whose writes fail (here SQLite refusing
/// every write, as on a full disk), and reports it healthy again once writes work, without any
/// request to prove it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_reflects_failing_store_writes() {
    let gateway = Fronted::sqlite(&[]).await;
    let (addr, dir) = (gateway.addr, &gateway.dir);
    let client = client();
    let health = || send(&client, addr, "GET", "/_idem/healthz", &[], b"");
    assert_eq!(health().await.status, 200);

    let db = rusqlite::Connection::open(dir.path().join("idem.db")).unwrap();
    db.busy_timeout(Duration::from_secs(5)).unwrap();
    db.execute_batch(
        "CREATE TRIGGER full_disk_insert BEFORE INSERT ON idempotency_records
             BEGIN SELECT RAISE(FAIL, 'database or disk is full'); END;
         CREATE TRIGGER full_disk_update BEFORE UPDATE ON idempotency_records
             BEGIN SELECT RAISE(FAIL, 'database or disk is full'); END;",
    )
    .unwrap();
    // Reads still work, so the health check said ok until a write failed.
    assert_eq!(health().await.status, 200);
    let refused = send(&client, addr, "POST", "/echo", &[("idempotency-key", "k1")], b"x").await;
    assert_eq!(refused.status, 503, "{:?}", refused.body);
    let sick = health().await;
    assert_eq!(sick.status, 503);
    let detail = sick.json()["detail"].as_str().unwrap_or_default().to_owned();
    assert!(
        detail.contains("failed in a row") && detail.contains("disk is full"),
        "{detail}"
    );

    db.execute_batch("DROP TRIGGER full_disk_insert; DROP TRIGGER full_disk_update;")
        .unwrap();
    assert_eq!(health().await.status, 200, "a probe write works again");
    let served = send(&client, addr, "POST", "/echo", &[("idempotency-key", "k1")], b"x").await;
    assert_eq!(served.status, 201);
}
