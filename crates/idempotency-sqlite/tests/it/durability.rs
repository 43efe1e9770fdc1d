//! Durability: a process completes a record and is killed with SIGKILL; a new process opening
//! the same file gets `Replay` with the same outcome, and the in-flight record it left behind is
//! still in flight.
//!
//! The child is this test binary itself, started on the `child_process` test with an
//! environment variable that tells it where the database is.

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use idempotency_core::{BeginRequest, Claim, Fingerprint, Held, Key, Outcome, Scope, Store, Token};
use idempotency_sqlite::SqliteStore;

const CHILD_ENV: &str = "IDEMPOTENCY_SQLITE_DURABILITY_CHILD";
const READY: &str = "CHILD-COMPLETED-RECORD";

fn completed_request() -> BeginRequest {
    BeginRequest::new(
        Scope::new("payments").unwrap(),
        Key::new("charge-42").unwrap(),
        Fingerprint::of_bytes(b"EUR 10"),
    )
    .lease(Duration::from_secs(600))
}

fn in_flight_request() -> BeginRequest {
    BeginRequest::new(
        Scope::new("payments").unwrap(),
        Key::new("charge-43").unwrap(),
        Fingerprint::of_bytes(b"EUR 11"),
    )
    .lease(Duration::from_secs(600))
}

/// The child's body, not a test of its own: the parent starts this binary with `--ignored` on
/// this name. It completes one record, leaves one in flight, says so, then waits to be killed.
#[tokio::test]
#[ignore = "helper: the child process of a_completed_record_survives_sigkill"]
async fn child_process() {
    let Ok(url) = std::env::var(CHILD_ENV) else {
        return; // Not the child: nothing to do.
    };
    let store = SqliteStore::open(&url).await.expect("child opens the store");
    let request = completed_request();
    let Claim::Acquired(Held { token, .. }) = store.begin(&request).await.unwrap() else {
        panic!("acquire")
    };
    let done = store
        .complete(
            &idempotency_testkit::held(&request.scope, &request.key, token),
            Outcome::new("charge ch_1 succeeded"),
            request.retention,
        )
        .await
        .unwrap();
    assert!(!done.is_lease_lost());
    assert!(matches!(
        store.begin(&in_flight_request()).await.unwrap(),
        Claim::Acquired(_)
    ));
    // The parent kills this process as soon as it reads the line: nothing after `complete`
    // returned (no close, no checkpoint) gets to run.
    #[allow(clippy::print_stdout)]
    {
        println!("{READY}");
    }
    tokio::time::sleep(Duration::from_secs(120)).await;
    panic!("the parent did not kill the child");
}

#[tokio::test]
async fn a_completed_record_survives_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("durable.db").display());
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "durability::child_process",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &url)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the child process");
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let mut ready = false;
    for line in stdout.lines() {
        // libtest may print "test child_process ... " on the same line first.
        if line.expect("child output").contains(READY) {
            ready = true;
            break;
        }
    }
    assert!(ready, "the child exited before completing its record");
    child.kill().expect("SIGKILL the child");
    let status = child.wait().unwrap();
    assert_eq!(
        status.signal(),
        Some(9),
        "the child must die by SIGKILL, got {status:?}"
    );

    let store = SqliteStore::open(&url)
        .await
        .expect("a new process opens the same file");
    let duplicate = completed_request().token(Token::random());
    match store.begin(&duplicate).await.unwrap() {
        Claim::Replay(done) => {
            assert_eq!(done.outcome.as_bytes(), b"charge ch_1 succeeded");
            assert_eq!(done.attempt, 1);
        }
        other => panic!("the completed record was lost: {other:?}"),
    }
    let other = in_flight_request().token(Token::random());
    assert!(
        matches!(
            store.begin(&other).await.unwrap(),
            Claim::InFlight { attempt: 1, .. }
        ),
        "the killed process's in-flight record must still hold its lease"
    );
}
