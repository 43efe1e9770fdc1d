//! The server goes away mid-run: the store reaches MySQL through a loopback proxy that, in
//! the middle of the run, cuts every open connection and refuses new ones for 1.5 s. While it is
//! down, callers get typed, retryable errors; once it is back the pool reconnects by itself,
//! every key ends completed with its own outcome, and no operation ran twice — through the guard
//! and in same-transaction mode alike.
//!
//! A proxy rather than a restart of the server: the tests beside this one share the server.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_core::{
    Decision, Execution, Fingerprint, Guard, Key, Outcome, RecordState, Recorded, Scope, Store,
};
use idempotency_mysql::MysqlStore;
use idempotency_mysql::sqlx::{self, AssertSqlSafe};
use idempotency_testkit::TcpProxy;

const KEYS: usize = 120;
const WORKERS: usize = 6;

struct Run {
    store: MysqlStore,
    executions: Mutex<HashMap<String, u32>>,
    next: Mutex<Vec<Key>>,
}

/// A store on a table of its own that reaches the server through `proxy`.
async fn proxied_store(proxy: &TcpProxy) -> MysqlStore {
    common::proxied(&common::fresh_store().await, proxy, 8).await
}

/// Takes the server away after 300 ms for 1.5 s, probing the store all the while; returns how
/// many probes failed (each with a retryable error) while it was away.
async fn outage(proxy: &TcpProxy, store: &MysqlStore) -> u64 {
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.set_down(true);
    let back_at = tokio::time::Instant::now() + Duration::from_millis(1500);
    let probe = Key::new("probe").unwrap();
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

fn keys(prefix: &str) -> Vec<Key> {
    (0..KEYS)
        .map(|i| Key::new(format!("{prefix}-{i}")).unwrap())
        .collect()
}

fn count(run: &Run, key: &Key) {
    *run.executions.lock().unwrap().entry(key.to_string()).or_default() += 1;
}

async fn guard_worker(run: Arc<Run>, guard: Guard<MysqlStore>) {
    loop {
        let Some(key) = run.next.lock().unwrap().pop() else {
            return;
        };
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
                            count(&run, attempt.key());
                            // Slow enough that the run spans the outage.
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

async fn transaction_worker(run: Arc<Run>, table: Arc<str>) {
    loop {
        let Some(key) = run.next.lock().unwrap().pop() else {
            return;
        };
        loop {
            let table = Arc::clone(&table);
            let policy = |written: &Result<Outcome, sqlx::Error>| match written {
                Ok(outcome) => Decision::Complete(outcome.clone()),
                Err(_) => Decision::Release,
            };
            let result = Guard::new(run.store.clone())
                .run_in_transaction(
                    Scope::global(),
                    key.clone(),
                    Fingerprint::of_bytes(b"tx"),
                    policy,
                    move |tx, attempt| {
                        Box::pin(async move {
                            sqlx::query(AssertSqlSafe(format!(
                                "INSERT INTO {table} (idem_key) VALUES (?)"
                            )))
                            .bind(attempt.key().as_str())
                            .execute(&mut **tx)
                            .await?;
                            tokio::time::sleep(Duration::from_millis(40)).await;
                            Ok::<_, sqlx::Error>(Outcome::new(format!("done {}", attempt.key())))
                        })
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

async fn assert_all_completed_once(run: &Run, keys: &[Key]) {
    let executions = run.executions.lock().unwrap().clone();
    for key in keys {
        let record = run
            .store
            .get(&Scope::global(), key)
            .await
            .unwrap()
            .expect("record");
        let RecordState::Completed { outcome, .. } = record.state else {
            panic!("{key} not completed")
        };
        assert_eq!(outcome.as_bytes(), format!("done {key}").as_bytes());
        if !executions.is_empty() {
            assert_eq!(
                executions.get(key.as_str()),
                Some(&1),
                "{key} ran {:?} times",
                executions.get(key.as_str())
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_gives_errors_then_correct_results_and_no_duplicates() {
    let proxy = common::start_proxy().await;
    let store = proxied_store(&proxy).await;
    // The outage (1.5 s) is shorter than the lease (5 s): an outcome that could not be recorded
    // while the server was away is recorded when it is back, instead of running twice later.
    let guard = Guard::new(store.clone()).lease(Duration::from_secs(5));
    let guarded = keys("guarded");
    let run = Arc::new(Run {
        store: store.clone(),
        executions: Mutex::default(),
        next: Mutex::new(guarded.clone()),
    });
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| tokio::spawn(guard_worker(Arc::clone(&run), guard.clone())))
        .collect();
    let failed_probes = outage(&proxy, &store).await;
    for worker in workers {
        worker.await.unwrap();
    }
    assert!(failed_probes > 0, "the store answered while the server was away");
    assert_all_completed_once(&run, &guarded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_in_same_transaction_mode_writes_each_row_once() {
    let proxy = common::start_proxy().await;
    let store = proxied_store(&proxy).await;
    let table: Arc<str> = format!("{}_rows", store.table()).into();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {table} (idem_key VARCHAR(255) NOT NULL) ENGINE = InnoDB"
    )))
    .execute(store.pool())
    .await
    .unwrap();
    let transactional = keys("tx");
    let run = Arc::new(Run {
        store: store.clone(),
        executions: Mutex::default(),
        next: Mutex::new(transactional.clone()),
    });
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| tokio::spawn(transaction_worker(Arc::clone(&run), Arc::clone(&table))))
        .collect();
    let failed_probes = outage(&proxy, &store).await;
    for worker in workers {
        worker.await.unwrap();
    }
    assert!(failed_probes > 0, "the store answered while the server was away");
    assert_all_completed_once(&run, &transactional).await;
    let rows: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT idem_key, COUNT(*) FROM {table} GROUP BY idem_key"
    )))
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(rows.len(), KEYS, "every key must have its business row");
    assert!(
        rows.iter().all(|(_, n)| *n == 1),
        "duplicated business rows: {rows:?}"
    );
}
