//! `idem keys release|forget|complete` through the binary, on every store it opens: each action
//! changes only what it says (checked through the library), refuses the states it does not
//! apply to and changes nothing then, and asks for a confirmation (standard input is not a
//! terminal here, so only `--yes` confirms).

use crate::common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::idem;
use idempotency::{
    BeginRequest, Claim, DynStore, Fenced, Fingerprint, Held, Key, Outcome, RecordState, Scope, Token,
};

const SCOPE: &str = "operators";

/// A key no other test or run uses.
fn fresh_key(what: &str) -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    format!("{what}-{nanos}-{}", std::process::id())
}

fn request(key: &str, lease: Duration) -> BeginRequest {
    BeginRequest::new(
        Scope::new(SCOPE).unwrap(),
        Key::new(key).unwrap(),
        Fingerprint::of_bytes(b"POST /charges {amount: 10}"),
    )
    .lease(lease)
}

async fn acquire(store: &DynStore, key: &str) -> Held {
    match store
        .begin(&request(key, Duration::from_secs(600)))
        .await
        .unwrap()
    {
        Claim::Acquired(held) => held,
        other => panic!("{key} was not free: {other:?}"),
    }
}

async fn completed(store: &DynStore, key: &str) -> Held {
    let held = acquire(store, key).await;
    let done = store
        .complete(&held, Outcome::new("charged"), Duration::from_secs(3600))
        .await
        .unwrap();
    assert!(!done.is_lease_lost());
    held
}

/// The attempt `held` can no longer complete: its answer is `LeaseLost`.
async fn completion_refused(store: &DynStore, held: &Held) {
    let late = store
        .complete(held, Outcome::new("late"), Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        late,
        Fenced::LeaseLost,
        "the running attempt's completion is refused"
    );
}

/// The next `begin` of `key` runs, as (attempt, recovered).
async fn next_attempt(store: &DynStore, key: &str) -> (u32, bool) {
    match store
        .begin(&request(key, Duration::from_secs(600)))
        .await
        .unwrap()
    {
        Claim::Acquired(held) => (held.attempt, held.recovered),
        other => panic!("expected {key} to run again, got {other:?}"),
    }
}

async fn record(store: &DynStore, key: &str) -> Option<idempotency::Record> {
    store
        .get(&Scope::new(SCOPE).unwrap(), &Key::new(key).unwrap())
        .await
        .unwrap()
}

/// `idem keys ACTION KEY --scope operators --store URL EXTRA…`: (exit code, stdout, stderr).
fn keys(url: &str, action: &str, key: &str, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec!["keys", action, key, "--scope", SCOPE, "--store", url];
    args.extend(extra);
    idem(&args)
}

fn refused(outcome: &(i32, String, String), says: &str) {
    let (code, out, err) = outcome;
    assert_eq!(*code, 1, "refused: {out}{err}");
    assert!(out.is_empty(), "nothing printed as changed: {out}");
    assert!(err.contains(says), "expected `{says}` in: {err}");
}

/// Release: refused without a confirmation, on a completed key and on a missing one; with
/// `--yes` the running attempt's completion gets `LeaseLost` and the next retry runs as
/// attempt 2, recovered.
async fn release_ends_the_running_attempt(url: &str) {
    let store = idempotency::open(url).await.unwrap();
    let key = fresh_key("release");
    let running = acquire(&store, &key).await;
    let before = record(&store, &key).await;

    refused(&keys(url, "release", &key, &[]), "pass --yes");
    assert_eq!(record(&store, &key).await, before, "unconfirmed: unchanged");

    let (code, out, err) = keys(url, "release", &key, &["--yes"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out,
        format!("released key {key}: attempt 1's lease ended; the next retry runs as attempt 2\n")
    );
    assert_eq!(
        err.matches("an operator changed a key's record").count(),
        1,
        "one audit line: {err}"
    );
    assert!(err.contains("action=\"release\""), "{err}");
    assert!(!err.contains(&key), "the key only truncated in the log: {err}");
    completion_refused(&store, &running).await;
    assert_eq!(next_attempt(&store, &key).await, (2, true));

    let done = fresh_key("release-done");
    completed(&store, &done).await;
    refused(
        &keys(url, "release", &done, &["--yes"]),
        "it is completed: no attempt holds it",
    );
    refused(
        &keys(url, "release", &fresh_key("absent"), &["--yes"]),
        "no record for key",
    );
}

/// Forget: a completed key runs again as a new first attempt; an in-flight one only with
/// `--force`, after which the running attempt's completion is refused.
async fn forget_lets_the_key_run_again(url: &str) {
    let store = idempotency::open(url).await.unwrap();
    let key = fresh_key("forget");
    completed(&store, &key).await;
    refused(&keys(url, "forget", &key, &[]), "pass --yes");
    assert!(record(&store, &key).await.is_some(), "unconfirmed: kept");
    let (code, out, err) = keys(url, "forget", &key, &["--yes", "--json"]);
    assert_eq!(code, 0, "{err}");
    let said: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(said["action"], "forget");
    assert_eq!(said["was"], "completed");
    assert_eq!(record(&store, &key).await, None);
    assert_eq!(next_attempt(&store, &key).await, (1, false));

    let running_key = fresh_key("forget-running");
    let running = acquire(&store, &running_key).await;
    refused(
        &keys(url, "forget", &running_key, &["--yes"]),
        "attempt 1 is running",
    );
    assert!(
        matches!(record(&store, &running_key).await.map(|r| r.state), Some(RecordState::InFlight { token, .. }) if token == running.token),
        "refused: kept"
    );
    let (code, out, err) = keys(url, "forget", &running_key, &["--yes", "--force"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with(&format!("forgot key {running_key}")), "{out}");
    completion_refused(&store, &running).await;
}

/// Complete: an outcome recorded by hand for a key whose attempt ended is replayed to the next
/// retry (the gateway's stored response, status, header and body); a running attempt is taken
/// over only with `--force`; a completed key and malformed flags are refused.
async fn complete_records_the_outcome_given(url: &str) {
    let store = idempotency::open(url).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let body = dir.path().join("body.json");
    std::fs::write(&body, br#"{"charge":"ch_1","status":"succeeded"}"#).unwrap();
    let body = body.to_str().unwrap();
    let response = [
        "--yes",
        "--status",
        "201",
        "--body",
        body,
        "--header",
        "Content-Type: application/json",
    ];

    let key = fresh_key("complete");
    let running = acquire(&store, &key).await;
    refused(&keys(url, "complete", &key, &response), "pass --force");
    assert!(!store.release(&running).await.unwrap().is_lease_lost());
    refused(
        &keys(
            url,
            "complete",
            &key,
            &["--yes", "--status", "201", "--body", body, "--header", "no colon"],
        ),
        "expected `Name: value`",
    );
    refused(
        &keys(
            url,
            "complete",
            &key,
            &["--yes", "--status", "201", "--body", "/nonexistent/body"],
        ),
        "--body /nonexistent/body",
    );
    let (code, out, err) = keys(url, "complete", &key, &response);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with(&format!("completed key {key} as attempt 2")),
        "{out}"
    );
    let Claim::Replay(done) = store
        .begin(&request(&key, Duration::from_secs(600)))
        .await
        .unwrap()
    else {
        panic!("the retry must replay the outcome given");
    };
    let Some(idempotency_http::StoredOutcome::Response {
        status,
        headers,
        body,
    }) = idempotency_http::StoredOutcome::decode(done.outcome.as_bytes())
    else {
        panic!("a stored response: {done:?}");
    };
    assert_eq!(status, 201);
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(&body[..], br#"{"charge":"ch_1","status":"succeeded"}"#);
    refused(&keys(url, "complete", &key, &response), "it is completed");

    let forced = fresh_key("complete-forced");
    let running = acquire(&store, &forced).await;
    let mut force = response.to_vec();
    force.push("--force");
    let (code, _, err) = keys(url, "complete", &forced, &force);
    assert_eq!(code, 0, "{err}");
    completion_refused(&store, &running).await;
    assert!(matches!(
        record(&store, &forced).await.map(|r| r.state),
        Some(RecordState::Completed { token, .. }) if token != running.token && token != Token::NONE
    ));
}

macro_rules! on_store {
    ($store:ident, $url:expr) => {
        mod $store {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn release_ends_the_running_attempt() {
                let (url, _keep) = $url;
                super::release_ends_the_running_attempt(&url).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn forget_lets_the_key_run_again() {
                let (url, _keep) = $url;
                super::forget_lets_the_key_run_again(&url).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn complete_records_the_outcome_given() {
                let (url, _keep) = $url;
                super::complete_records_the_outcome_given(&url).await;
            }
        }
    };
}

/// A SQLite file of the test's own (kept as long as the directory).
fn sqlite() -> (String, Option<tempfile::TempDir>) {
    let dir = tempfile::tempdir().unwrap();
    let url = common::sqlite_url(dir.path());
    (url, Some(dir))
}

fn env_or(name: &str, default: &str) -> (String, Option<tempfile::TempDir>) {
    (std::env::var(name).unwrap_or_else(|_| default.into()), None)
}

on_store!(sqlite, sqlite());
on_store!(
    postgres,
    env_or("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
);
on_store!(mysql, env_or("MYSQL_URL", "mysql://root@127.0.0.1:3306/test"));
on_store!(redis, env_or("REDIS_URL", "redis://127.0.0.1:6379"));
#[cfg(feature = "dynamodb")]
on_store!(dynamodb, {
    let endpoint = std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:5000".into());
    let url = format!(
        "dynamodb://keys_{}?region=us-east-1&endpoint={endpoint}",
        fresh_key("t")
    );
    (url, None::<tempfile::TempDir>)
});

/// From the outside: `idem keys release` while the gateway's upstream call runs. The running
/// attempt's completion is refused (its answer still reaches its client, nothing is stored), and
/// the client's retry runs as attempt 2 instead of waiting out the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_racing_a_running_request_hands_the_key_to_the_retry() {
    use std::sync::{Arc, Mutex};
    use tokio::sync::Notify;

    // The upstream: records each call's `Idempotency-Attempt`; the first call answers only
    // once the test lets it.
    let attempts: Arc<Mutex<Vec<String>>> = Arc::default();
    let (arrived, go) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let app = {
        let (attempts, arrived, go) = (Arc::clone(&attempts), Arc::clone(&arrived), Arc::clone(&go));
        axum::Router::new().route(
            "/charges",
            axum::routing::post(move |headers: http::HeaderMap| async move {
                let attempt = headers
                    .get("idempotency-attempt")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("-")
                    .to_owned();
                let first = {
                    let mut seen = attempts.lock().unwrap();
                    seen.push(attempt.clone());
                    seen.len() == 1
                };
                if first {
                    arrived.notify_one();
                    go.notified().await;
                }
                (http::StatusCode::CREATED, format!("charged by attempt {attempt}"))
            }),
        )
    };
    let upstream = common::serve_app(app).await;
    let (url, _dir) = sqlite();
    let addr = common::free_addr();
    let up = format!("http://{upstream}");
    let _gateway = common::start_gateway(
        addr,
        &["--upstream", &up, "--store", &url, "--lease", "10m"],
        true,
    )
    .await;
    let client = common::client();
    let key = fresh_key("racing");
    let headers = [("idempotency-key", key.as_str())];
    let first = {
        let (client, key) = (client.clone(), key.clone());
        tokio::spawn(async move {
            let headers = [("idempotency-key", key.as_str())];
            common::send(&client, addr, "POST", "/charges", &headers, b"{}").await
        })
    };
    arrived.notified().await;
    let (code, listed, err) = idem(&["keys", "list", "--store", &url, "--json"]);
    assert_eq!(code, 0, "{err}");
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
    let scope = listed["records"]
        .as_array()
        .and_then(|rows| rows.iter().find(|row| row["key"] == key.as_str()))
        .map(|row| row["scope"].as_str().unwrap().to_owned())
        .expect("the running request's record");
    let (code, out, err) = idem(&[
        "keys", "release", &key, "--scope", &scope, "--store", &url, "--yes",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with(&format!("released key {key}: attempt 1's lease ended")),
        "{out}"
    );

    go.notify_one();
    let first = first.await.unwrap();
    assert_eq!(
        first.status, 201,
        "the running attempt's answer reaches its client"
    );
    assert_eq!(&first.body[..], b"charged by attempt 1");
    let retry = common::send(&client, addr, "POST", "/charges", &headers, b"{}").await;
    assert_eq!(
        (retry.status, &retry.body[..]),
        (201, &b"charged by attempt 2"[..])
    );
    assert_eq!(retry.header("idempotent-replayed"), None);
    let replay = common::send(&client, addr, "POST", "/charges", &headers, b"{}").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        &replay.body[..],
        b"charged by attempt 2",
        "attempt 2's answer is the one stored"
    );
    assert_eq!(*attempts.lock().unwrap(), ["1", "2"]);
}

/// A PostgreSQL role that may only read the records: `idem keys forget` is refused by the
/// server, says why, exits 1, and the record stays as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_role_is_refused_and_nothing_changes() {
    use idempotency::postgres::sqlx;

    let (url, _) = env_or("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let store = idempotency::open(&url).await.unwrap();
    let key = fresh_key("read-only");
    completed(&store, &key).await;
    let before = record(&store, &key).await;

    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let reader = common::ReadOnlyRole::create(&pool, &url, "reader").await;
    let (code, out, err) = keys(&reader.url, "forget", &key, &["--yes"]);
    reader.drop(&pool).await;

    assert_eq!(code, 1, "{out}{err}");
    assert!(out.is_empty(), "nothing printed as changed: {out}");
    assert!(err.contains("permission denied"), "the server's reason: {err}");
    assert_eq!(record(&store, &key).await, before, "the record is unchanged");
}
