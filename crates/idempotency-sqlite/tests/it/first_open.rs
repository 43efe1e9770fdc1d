//! Many stores opening one new file at once (replicas started together, a worker pool's
//! connections): every open succeeds and they share one schema; a lock held longer than the
//! busy timeout is a clear, retryable error after that timeout, not at once.

use std::time::Duration;

use idempotency_core::{BeginRequest, Claim, ErrorKind, Fingerprint, Key, Scope, Store, Token};
use idempotency_sqlite::{SqliteOptions, SqliteStore};

/// 16 stores open a new file at the same moment, 20 times: each open succeeds, and a key
/// begun through one store is in flight through every other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_opening_a_new_file_together_all_open_on_one_schema() {
    for round in 0..20 {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("idem.db").display());
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(16));
        let opening: Vec<_> = (0..16)
            .map(|_| {
                let (url, barrier) = (url.clone(), std::sync::Arc::clone(&barrier));
                tokio::spawn(async move {
                    barrier.wait().await;
                    SqliteStore::open(&url).await
                })
            })
            .collect();
        let mut stores = Vec::new();
        for (n, opened) in opening.into_iter().enumerate() {
            let opened = opened.await.unwrap();
            stores.push(opened.unwrap_or_else(|e| panic!("round {round}, store {n}: {e}")));
        }
        let request = BeginRequest::new(
            Scope::new("first-open").unwrap(),
            Key::new(format!("key-{round}")).unwrap(),
            Fingerprint::of_bytes(b"EUR 10"),
        );
        assert!(matches!(
            stores[0].begin(&request).await.unwrap(),
            Claim::Acquired(_)
        ));
        for store in &stores[1..] {
            let claim = store
                .begin(&request.clone().token(Token::random()))
                .await
                .unwrap();
            assert!(
                matches!(claim, Claim::InFlight { .. }),
                "round {round}: {claim:?}"
            );
        }
    }
}

/// Another process holding the write lock while a store opens a new file: the open waits
/// the busy timeout, then fails with a retryable timeout that names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_held_past_the_busy_timeout_is_a_timeout_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let holder = rusqlite::Connection::open(&path).unwrap();
    holder
        .execute_batch("BEGIN EXCLUSIVE; CREATE TABLE other (x);")
        .unwrap();
    let options = SqliteOptions::file(&path).busy_timeout(Duration::from_millis(300));
    let started = std::time::Instant::now();
    let error = SqliteStore::open_with(options).await.unwrap_err();
    let waited = started.elapsed();
    assert_eq!(error.kind(), ErrorKind::Timeout, "{error}");
    assert!(error.is_retryable(), "{error}");
    assert!(error.to_string().contains("busy_timeout_ms"), "{error}");
    // Not at once: the open waited for the lock (an ordering, not a measured speed).
    assert!(waited >= Duration::from_millis(300), "gave up after {waited:?}");
    holder.execute_batch("ROLLBACK").unwrap();
    drop(holder);
    SqliteStore::open(&format!("sqlite://{}", path.display()))
        .await
        .expect("opens once the lock is gone");
}
