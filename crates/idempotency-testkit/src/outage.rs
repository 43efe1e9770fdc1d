//! The server goes away mid-run, for stores on a server (PostgreSQL's and MySQL's): the store
//! reaches it through a [`TcpProxy`] that, in the middle of the run, cuts every open connection
//! and refuses new ones for 1.5 s. While it is down, callers get typed, retryable errors; once
//! it is back the pool reconnects by itself, every key ends completed with its own outcome, and
//! no operation ran twice — through the guard ([`guarded_run`]) and in same-transaction mode
//! ([`transactional_run`]) alike.
//!
//! A proxy rather than a restart of the server: the tests beside these share the server.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_core::{
    Attempt, Decision, Execution, Fingerprint, Guard, Key, Outcome, RecordState, Recorded, Scope, Store,
    TransactionalStore, TxFuture,
};

use crate::TcpProxy;

/// An operation's error, kept whole.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How many keys each run completes.
pub const KEYS: usize = 120;

/// How many workers complete them at once.
const WORKERS: usize = 6;

/// A run's shared state: the keys left, and how many times each operation ran (counted by
/// the guarded run; the transactional run counts business rows instead).
struct Run<S> {
    store: S,
    executions: Mutex<HashMap<String, u32>>,
    next: Mutex<Vec<Key>>,
}

impl<S: Store + Clone> Run<S> {
    fn new(store: &S, prefix: &str) -> (Arc<Self>, Vec<Key>) {
        let keys: Vec<Key> = (0..KEYS)
            .map(|i| Key::new(format!("{prefix}-{i}")).expect("a valid key"))
            .collect();
        let run = Self {
            store: store.clone(),
            executions: Mutex::default(),
            next: Mutex::new(keys.clone()),
        };
        (Arc::new(run), keys)
    }

    fn next(&self) -> Option<Key> {
        self.next.lock().unwrap().pop()
    }

    /// Every key completed with its own outcome (`done KEY`).
    async fn assert_all_completed(&self, keys: &[Key]) {
        for key in keys {
            let record = self
                .store
                .get(&Scope::global(), key)
                .await
                .unwrap()
                .expect("record");
            let RecordState::Completed { outcome, .. } = record.state else {
                panic!("{key} not completed")
            };
            assert_eq!(outcome.as_bytes(), format!("done {key}").as_bytes());
        }
    }

    /// Every key's operation counted as run exactly once.
    fn assert_each_executed_once(&self, keys: &[Key]) {
        let executions = self.executions.lock().unwrap();
        for key in keys {
            let ran = executions.get(key.as_str());
            assert_eq!(ran, Some(&1), "{key} ran {ran:?} times");
        }
    }
}

/// Takes the server away after 300 ms for 1.5 s, probing the store all the while; returns how
/// many probes failed (each with a retryable error) while it was away.
async fn outage<S: Store>(proxy: &TcpProxy, store: &S) -> u64 {
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.set_down(true);
    let back_at = tokio::time::Instant::now() + Duration::from_millis(1500);
    let probe = Key::new("probe").expect("a valid key");
    let mut failed = 0;
    while tokio::time::Instant::now() < back_at {
        if let Err(error) = store.get(&Scope::global(), &probe).await {
            assert!(error.is_retryable(), "an outage must be retryable: {error}");
            failed += 1;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    proxy.set_down(false);
    failed
}

/// [`KEYS`] keys run through the guard by six workers (each operation 40 ms, so that the run
/// spans the outage) while the server behind `proxy`, which `store` alone reaches it through,
/// goes away: every key completes once.
///
/// # Panics
///
/// When the store answers during the outage, an error is not retryable, or a key did not
/// complete exactly once.
pub async fn guarded_run<S: Store + Clone + Send + Sync + 'static>(store: S, proxy: &TcpProxy) {
    // The outage (1.5 s) is shorter than the lease (5 s): an outcome that could not be recorded
    // while the server was away is recorded when it is back, instead of running twice later.
    let guard = Guard::new(store.clone()).lease(Duration::from_secs(5));
    let (run, keys) = Run::new(&store, "guarded");
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| tokio::spawn(guard_worker(Arc::clone(&run), guard.clone())))
        .collect();
    let failed_probes = outage(proxy, &store).await;
    for worker in workers {
        worker.await.unwrap();
    }
    assert!(failed_probes > 0, "the store answered while the server was away");
    run.assert_all_completed(&keys).await;
    run.assert_each_executed_once(&keys);
}

async fn guard_worker<S: Store + Clone + Send + Sync + 'static>(run: Arc<Run<S>>, guard: Guard<S>) {
    while let Some(key) = run.next() {
        loop {
            let result = guard
                .run(
                    Scope::global(),
                    key.clone(),
                    Fingerprint::of_bytes(key.as_str().as_bytes()),
                    |value: &String| Decision::Complete(Outcome::new(value.clone())),
                    |attempt| {
                        let run = Arc::clone(&run);
                        async move {
                            *run.executions
                                .lock()
                                .unwrap()
                                .entry(attempt.key().to_string())
                                .or_default() += 1;
                            tokio::time::sleep(Duration::from_millis(40)).await;
                            format!("done {}", attempt.key())
                        }
                    },
                )
                .await;
            match result {
                Ok(Execution::Executed {
                    recorded: Recorded::Completed { .. },
                    ..
                })
                | Ok(Execution::Replayed(_)) => break,
                Ok(Execution::InFlight { retry_after, .. }) => tokio::time::sleep(retry_after).await,
                Ok(other) => panic!("{key}: {other:?}"),
                Err(error) => {
                    assert!(
                        error.is_retryable(),
                        "{key}: a cut connection must be retryable: {error}"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }
}

/// Writes one business row for the attempt's key into the table (the third argument) through
/// the transaction; an error's text is kept.
pub type WriteRow<S> = for<'t> fn(
    &'t mut <S as TransactionalStore>::Transaction,
    Attempt,
    Arc<str>,
) -> TxFuture<'t, Result<(), BoxError>>;

/// [`KEYS`] keys run in same-transaction mode by six workers, each writing one business row
/// into `table` with `write` in the record's transaction (then waiting 40 ms, so that the run
/// spans the outage), while the server behind `proxy` goes away: every key completes once,
/// and `rows` (the business rows per key, read after the run) finds exactly one row for each.
///
/// # Panics
///
/// As [`guarded_run`], and when a key has no business row or more than one.
pub async fn transactional_run<S>(
    store: S,
    proxy: &TcpProxy,
    table: &str,
    write: WriteRow<S>,
    rows: impl AsyncFnOnce() -> Vec<(String, i64)>,
) where
    S: TransactionalStore + Clone + Send + Sync + 'static,
{
    let (run, keys) = Run::new(&store, "tx");
    let table: Arc<str> = table.into();
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| tokio::spawn(transaction_worker(Arc::clone(&run), Arc::clone(&table), write)))
        .collect();
    let failed_probes = outage(proxy, &store).await;
    for worker in workers {
        worker.await.unwrap();
    }
    assert!(failed_probes > 0, "the store answered while the server was away");
    run.assert_all_completed(&keys).await;
    let rows = rows().await;
    assert_eq!(rows.len(), KEYS, "every key must have its business row");
    assert!(
        rows.iter().all(|(_, n)| *n == 1),
        "duplicated business rows: {rows:?}"
    );
}

async fn transaction_worker<S>(run: Arc<Run<S>>, table: Arc<str>, write: WriteRow<S>)
where
    S: TransactionalStore + Clone + Send + Sync + 'static,
{
    while let Some(key) = run.next() {
        loop {
            let policy = |written: &Result<Outcome, BoxError>| match written {
                Ok(outcome) => Decision::Complete(outcome.clone()),
                Err(_) => Decision::Release,
            };
            let result = Guard::new(run.store.clone())
                .run_in_transaction(
                    Scope::global(),
                    key.clone(),
                    Fingerprint::of_bytes(b"tx"),
                    policy,
                    {
                        let table = Arc::clone(&table);
                        move |tx, attempt| {
                            Box::pin(async move {
                                let done = format!("done {}", attempt.key());
                                write(tx, attempt, table).await?;
                                tokio::time::sleep(Duration::from_millis(40)).await;
                                Ok::<_, BoxError>(Outcome::new(done))
                            })
                        }
                    },
                )
                .await;
            match result {
                Ok(
                    Execution::Executed {
                        value: Ok(_),
                        recorded: Recorded::Completed { .. },
                        ..
                    }
                    | Execution::Replayed(_),
                ) => break,
                Ok(Execution::Executed {
                    recorded: Recorded::Failed(error),
                    ..
                })
                | Err(error) => {
                    assert!(
                        error.is_retryable(),
                        "{key}: a cut connection must be retryable: {error}"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Ok(Execution::Executed { value: Err(_), .. }) => {
                    // The business insert itself hit the cut connection: rolled back, retry.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Ok(other) => panic!("{key}: {other:?}"),
            }
        }
    }
}
