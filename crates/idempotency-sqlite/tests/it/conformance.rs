//! The SQLite store passes the conformance suite and the model-based property test: on a manual
//! clock (every timestamp compared with the model) with group commit, and on the system clock
//! with one transaction per transition (`max_batch=1`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idempotency_core::ManualClock;
use idempotency_sqlite::{SqliteOptions, SqliteStore};
use idempotency_testkit::{Harness, TimeControl};
use tempfile::TempDir;

#[derive(Debug)]
struct SqliteHarness {
    dir: TempDir,
    files: AtomicUsize,
    clock: Option<ManualClock>,
}

impl SqliteHarness {
    fn manual() -> Self {
        Self::with_clock(Some(ManualClock::new()))
    }

    fn system() -> Self {
        Self::with_clock(None)
    }

    fn with_clock(clock: Option<ManualClock>) -> Self {
        Self {
            dir: tempfile::tempdir().expect("temporary directory"),
            files: AtomicUsize::new(0),
            clock,
        }
    }
}

#[async_trait::async_trait]
impl Harness for SqliteHarness {
    type Store = SqliteStore;

    async fn store(&self) -> SqliteStore {
        let n = self.files.fetch_add(1, Ordering::SeqCst);
        let mut options = SqliteOptions::file(self.dir.path().join(format!("store-{n}.db")));
        if let Some(clock) = &self.clock {
            options = options.clock(Arc::new(clock.clone()));
        } else {
            options = options.max_batch(1);
        }
        SqliteStore::open_with(options)
            .await
            .expect("open the SQLite store")
    }

    fn time(&self) -> TimeControl {
        match &self.clock {
            Some(clock) => TimeControl::Manual(clock.clone()),
            None => TimeControl::real(),
        }
    }
}

idempotency_testkit::conformance_suite!(SqliteHarness::manual());

mod system_clock {
    use super::*;

    idempotency_testkit::conformance_suite!(SqliteHarness::system());
}

/// Two stores on one file are two connections, as two processes would be: the write lock, not
/// the worker thread, must serialize them.
mod two_connections {
    use super::*;
    use idempotency_core::{BeginRequest, Claim, Fingerprint, Key, Scope, Store, Token};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn race_64_begins_across_two_connections_exactly_one_acquires() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shared.db");
        let a = SqliteStore::open_with(SqliteOptions::file(&path)).await.unwrap();
        let b = SqliteStore::open_with(SqliteOptions::file(&path)).await.unwrap();
        for round in 0..100 {
            let request = BeginRequest::new(Scope::global(), Key::generate(), Fingerprint::of_bytes(b"x"));
            let barrier = Arc::new(tokio::sync::Barrier::new(64));
            let racers: Vec<_> = (0..64)
                .map(|i| {
                    let store = if i % 2 == 0 { a.clone() } else { b.clone() };
                    let request = request.clone().token(Token::random());
                    let barrier = Arc::clone(&barrier);
                    tokio::spawn(async move {
                        barrier.wait().await;
                        store.begin(&request).await.expect("begin")
                    })
                })
                .collect();
            let mut acquired = 0;
            for racer in racers {
                if matches!(racer.await.unwrap(), Claim::Acquired(_)) {
                    acquired += 1;
                }
            }
            assert_eq!(acquired, 1, "round {round}");
        }
    }
}
