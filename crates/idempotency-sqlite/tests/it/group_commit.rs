//! Group commit: transitions queued together share one write transaction, a failing one rolls
//! back alone, and no caller is ever answered for a write that a crash then loses.
//!
//! The crash test's child is this test binary itself, started on the `churning_child` test with
//! an environment variable naming the database: it runs begin→complete cycles from 32 tasks and
//! prints a line for every answer it got, until the parent kills it with SIGKILL.

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    BeginRequest, Claim, Fingerprint, Key, Outcome, RecordState, Scope, Store, StoreError, Token,
};
use idempotency_sqlite::{SqliteOptions, SqliteStore};

const CHILD_ENV: &str = "IDEMPOTENCY_SQLITE_GROUP_COMMIT_CHILD";

fn request(key: &str) -> BeginRequest {
    BeginRequest::new(
        Scope::new("group").unwrap(),
        Key::new(key).unwrap(),
        Fingerprint::of_bytes(key.as_bytes()),
    )
    .lease(Duration::from_secs(600))
}

/// Holds the store's write connection until `release` is sent (or dropped), so that whatever
/// is sent to the writer meanwhile queues up and forms one group.
fn block_the_writer(store: &SqliteStore) -> (std::sync::mpsc::Sender<()>, tokio::task::JoinHandle<()>) {
    let (release, wait) = std::sync::mpsc::channel::<()>();
    let store = store.clone();
    let blocked = tokio::spawn(async move {
        store
            .with_connection(move |_| {
                let _ = wait.recv();
            })
            .await
            .unwrap();
    });
    (release, blocked)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transitions_queued_together_commit_together_and_a_failing_one_rolls_back_alone() {
    let metrics = idempotency_testkit::recorded::global();
    drop(metrics);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("group.db");
    let store = SqliteStore::open_with(SqliteOptions::file(&path)).await.unwrap();
    let keys: Vec<String> = (0..20).map(|i| format!("charge-{i}")).collect();
    let mut held = Vec::new();
    for key in &keys {
        let Claim::Acquired(h) = store.begin(&request(key)).await.unwrap() else {
            panic!("{key} not acquired")
        };
        held.push(h);
    }
    // A record the decoder refuses: its fingerprint is not 32 bytes.
    store
        .with_connection(|connection| {
            connection
                .execute(
                    "INSERT INTO idempotency_records (scope, key, fingerprint, attempt, created_at, \
                     expires_at, token, completed, acquired_at, lease_until) \
                     VALUES ('group', 'broken', x'00', 1, 0, 9999999999999, zeroblob(16), 0, 0, 9999999999999)",
                    [],
                )
                .unwrap();
        })
        .await
        .unwrap();

    let (release, blocked) = block_the_writer(&store);
    let mut completions = Vec::new();
    for h in held {
        let store = store.clone();
        completions.push(tokio::spawn(async move {
            store
                .complete(
                    &h,
                    Outcome::new(format!("done {}", h.key)),
                    Duration::from_secs(3600),
                )
                .await
        }));
    }
    let broken = {
        let store = store.clone();
        tokio::spawn(async move {
            let held = idempotency_testkit::held(
                &Scope::new("group").unwrap(),
                &Key::new("broken").unwrap(),
                Token::random(),
            );
            store
                .complete(&held, Outcome::new("x"), Duration::from_secs(60))
                .await
        })
    };
    // Let every completion reach the writer's queue, then let the writer go.
    tokio::time::sleep(Duration::from_millis(500)).await;
    release.send(()).unwrap();
    blocked.await.unwrap();

    let error: StoreError = broken.await.unwrap().unwrap_err();
    assert_eq!(error.kind(), idempotency_core::ErrorKind::Corrupt, "{error}");
    for completion in completions {
        assert!(
            !completion.await.unwrap().unwrap().is_lease_lost(),
            "a completion beside the broken one was refused"
        );
    }
    let largest = idempotency_testkit::recorded::global()
        .histogram_max("idempotency_sqlite_group_size", &[])
        .unwrap_or(0.0);
    assert!(
        largest >= 10.0,
        "the completions did not share a transaction: largest group {largest}"
    );

    // On disk, from a store opened afresh: all twenty completed.
    drop(store);
    let reopened = SqliteStore::open_with(SqliteOptions::file(&path)).await.unwrap();
    for key in &keys {
        assert!(
            matches!(reopened.begin(&request(key)).await.unwrap(), Claim::Replay(_)),
            "{key} was not completed on disk"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_transaction_per_transition_when_groups_are_off() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}?max_batch=1", dir.path().join("single.db").display());
    let store = SqliteStore::open(&url).await.unwrap();
    let (release, blocked) = block_the_writer(&store);
    let mut begins = Vec::new();
    for i in 0..10 {
        let store = store.clone();
        begins.push(tokio::spawn(async move {
            store.begin(&request(&format!("single-{i}"))).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    release.send(()).unwrap();
    blocked.await.unwrap();
    for begin in begins {
        assert!(matches!(begin.await.unwrap().unwrap(), Claim::Acquired(_)));
    }
}

/// The child's body, not a test of its own: begin→complete cycles from 32 tasks, a line on
/// stdout for every answer, until killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::print_stdout)] // the answers go to the parent through stdout
#[ignore = "helper: the child process of answered_writes_survive_sigkill_mid_group"]
async fn churning_child() {
    let Ok(url) = std::env::var(CHILD_ENV) else {
        return; // Not the child: nothing to do.
    };
    let store = SqliteStore::open(&url).await.expect("the child opens the store");
    let mut tasks = Vec::new();
    for task in 0..32 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            for n in 0.. {
                let key = format!("t{task}-n{n}");
                let Ok(Claim::Acquired(held)) = store.begin(&request(&key)).await else {
                    continue;
                };
                println!("ACQUIRED {key}");
                if let Ok(done) = store
                    .complete(&held, Outcome::new(key.clone()), Duration::from_secs(3600))
                    .await
                    && !done.is_lease_lost()
                {
                    println!("COMPLETED {key}");
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answered_writes_survive_sigkill_mid_group() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("crash.db").display());
    let (mut acquired, mut completed) = (HashSet::new(), HashSet::new());
    for round in 0..5 {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "group_commit::churning_child",
                "--exact",
                "--ignored",
                "--nocapture",
            ])
            .env(CHILD_ENV, &url)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        // Kill it at a different point of its stream each round, while groups are committing.
        let until = 400 + round * 250;
        let mut seen = 0;
        while seen < until {
            let Some(line) = lines.next() else { break };
            let line = line.unwrap();
            if let Some(key) = line.strip_prefix("ACQUIRED ") {
                acquired.insert(key.to_owned());
            } else if let Some(key) = line.strip_prefix("COMPLETED ") {
                completed.insert(key.to_owned());
            } else {
                continue;
            }
            seen += 1;
        }
        child.kill().unwrap();
        child.wait().unwrap();
        // What the child printed before the kill but after `until` is not read: unread
        // answers are not checked.
        assert!(
            seen >= until,
            "round {round}: the child stopped after {seen} answers"
        );
    }
    let store = Arc::new(SqliteStore::open(&url).await.unwrap());
    let mut missing = Vec::new();
    for key in &acquired {
        match store
            .get(&Scope::new("group").unwrap(), &Key::new(key.as_str()).unwrap())
            .await
            .unwrap()
        {
            None => missing.push(format!("{key}: acquired, no record")),
            Some(record) => {
                let is_completed = matches!(record.state, RecordState::Completed { .. });
                if completed.contains(key) && !is_completed {
                    missing.push(format!("{key}: completed, but on disk {:?}", record.state));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "{} answered writes are not on disk after SIGKILL: {:?}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    eprintln!(
        "5 SIGKILLs: {} acquisitions and {} completions answered, every one on disk",
        acquired.len(),
        completed.len()
    );
}
