//! Same-transaction mode against the real server: the record and the business rows commit
//! together or not at all.

mod common;

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    Attempt, BeginRequest, Claim, Decision, ErrorKind, Execution, Fingerprint, Guard, Held, Key, Outcome,
    Recorded, Scope, Store, StoreError, Token, TransactionalStore, TxFuture,
};
use idempotency_mysql::sqlx::{self, AssertSqlSafe};
use idempotency_mysql::{MysqlStore, MysqlTransaction};

/// A business table of the test's own, next to the records table.
async fn charges_table(store: &MysqlStore) -> Arc<str> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let name = format!("b_{now}_{}", store.table().rsplit('_').next().unwrap());
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {name} (id BIGINT AUTO_INCREMENT PRIMARY KEY, idem_key VARCHAR(255) NOT NULL, cents INT NOT NULL) ENGINE = InnoDB"
    )))
    .execute(store.pool())
    .await
    .unwrap();
    name.into()
}

async fn rows_for(store: &MysqlStore, table: &str, key: &Key) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM {table} WHERE idem_key = ?"
    )))
    .bind(key.as_str())
    .fetch_one(store.pool())
    .await
    .unwrap()
}

/// Inserts one charge row through `tx`; its id.
async fn insert_charge(
    tx: &mut MysqlTransaction,
    table: &str,
    key: &Key,
    cents: i32,
) -> Result<i64, sqlx::Error> {
    let done = sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {table} (idem_key, cents) VALUES (?, ?)"
    )))
    .bind(key.as_str())
    .bind(cents)
    .execute(&mut **tx)
    .await?;
    Ok(i64::try_from(done.last_insert_id()).expect("a row id"))
}

fn request(key: &Key) -> BeginRequest {
    BeginRequest::new(
        Scope::new("payments").unwrap(),
        key.clone(),
        Fingerprint::of_bytes(b"EUR 10"),
    )
}

/// Why a same-transaction run wrote nothing.
#[derive(Debug)]
enum TxError {
    /// The database failed: nothing committed (or the commit's fate is unknown).
    Store(StoreError),
    /// The operation failed; everything was rolled back.
    Operation(#[allow(dead_code)] sqlx::Error),
}

/// Runs `operation` through the guard in same-transaction mode with `fingerprint`: a row id
/// is completed with the id as the outcome, an error rolls back. The answer is the guard's, with
/// the two ways of writing nothing as errors.
async fn guarded<F>(
    store: &MysqlStore,
    key: &Key,
    fingerprint: &[u8],
    operation: F,
) -> Result<Execution<i64>, TxError>
where
    F: for<'t> FnOnce(&'t mut MysqlTransaction, Attempt) -> TxFuture<'t, Result<i64, sqlx::Error>>
        + Send
        + 'static,
{
    let policy = |row: &Result<i64, sqlx::Error>| match row {
        Ok(id) => Decision::Complete(Outcome::new(id.to_string())),
        Err(_) => Decision::Release,
    };
    let request = request(key);
    let run = Guard::new(store.clone())
        .run_in_transaction(
            request.scope,
            request.key,
            Fingerprint::of_bytes(fingerprint),
            policy,
            operation,
        )
        .await
        .map_err(TxError::Store)?;
    Ok(match run {
        Execution::Executed {
            value,
            attempt,
            recovered,
            recorded,
        } => match (value, recorded) {
            (Err(error), _) => return Err(TxError::Operation(error)),
            (Ok(_), Recorded::Failed(error)) => return Err(TxError::Store(error)),
            (Ok(id), recorded) => Execution::Executed {
                value: id,
                attempt,
                recovered,
                recorded,
            },
        },
        Execution::Replayed(done) => Execution::Replayed(done),
        Execution::InFlight { attempt, retry_after } => Execution::InFlight { attempt, retry_after },
        Execution::Mismatch => Execution::Mismatch,
    })
}

/// The operation every test runs: insert one charge row, store its id as the outcome.
async fn charge(
    store: &MysqlStore,
    table: Arc<str>,
    key: &Key,
    hold: Duration,
) -> Result<Execution<i64>, TxError> {
    guarded(store, key, b"EUR 10", move |tx, attempt| {
        Box::pin(async move {
            let id = insert_charge(tx, &table, attempt.key(), 1000).await?;
            tokio::time::sleep(hold).await;
            Ok(id)
        })
    })
    .await
}

fn outcome_of(run: &Execution<i64>) -> String {
    match run {
        Execution::Executed { value, .. } => value.to_string(),
        Execution::Replayed(done) => String::from_utf8(done.outcome.as_bytes().to_vec()).unwrap(),
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_deliveries_write_the_business_row_once_and_agree() {
    let store = common::fresh_store().await;
    let table = charges_table(&store).await;
    for round in 0..5 {
        let key = Key::generate();
        let barrier = Arc::new(tokio::sync::Barrier::new(64));
        let deliveries: Vec<_> = (0..64)
            .map(|_| {
                let (store, table, key, barrier) = (
                    store.clone(),
                    Arc::clone(&table),
                    key.clone(),
                    Arc::clone(&barrier),
                );
                tokio::spawn(async move {
                    barrier.wait().await;
                    charge(&store, table, &key, Duration::from_millis(50)).await
                })
            })
            .collect();
        let mut executed = 0;
        let mut outcomes = Vec::new();
        for delivery in deliveries {
            let run = delivery.await.unwrap().expect("no delivery may fail");
            if matches!(run, Execution::Executed { .. }) {
                executed += 1;
            }
            outcomes.push(outcome_of(&run));
        }
        assert_eq!(executed, 1, "round {round}: {executed} deliveries executed");
        assert!(
            outcomes.iter().all(|o| o == &outcomes[0]),
            "round {round}: outcomes differ: {outcomes:?}"
        );
        assert_eq!(
            rows_for(&store, &table, &key).await,
            1,
            "round {round}: business rows"
        );
    }
}

#[tokio::test]
async fn an_operation_error_leaves_neither_record_nor_row_and_the_retry_runs() {
    let store = common::fresh_store().await;
    let table = charges_table(&store).await;
    let key = Key::generate();
    let failed = guarded(&store, &key, b"EUR 10", {
        let table = Arc::clone(&table);
        move |tx, attempt| {
            Box::pin(async move {
                insert_charge(tx, &table, attempt.key(), 1000).await?;
                Err::<i64, _>(sqlx::Error::Protocol("the card was declined".into()))
            })
        }
    })
    .await;
    assert!(matches!(failed, Err(TxError::Operation(_))), "{failed:?}");
    assert_eq!(
        rows_for(&store, &table, &key).await,
        0,
        "the business row must roll back"
    );
    assert_eq!(
        store.get(&request(&key).scope, &key).await.unwrap(),
        None,
        "no record may remain"
    );

    let retried = charge(&store, Arc::clone(&table), &key, Duration::ZERO)
        .await
        .unwrap();
    assert!(
        matches!(retried, Execution::Executed { attempt: 1, .. }),
        "{retried:?}"
    );
    assert_eq!(rows_for(&store, &table, &key).await, 1);
}

#[tokio::test]
async fn a_connection_killed_mid_transaction_leaves_nothing_and_the_retry_succeeds() {
    let store = common::fresh_store().await;
    let table = charges_table(&store).await;
    let key = Key::generate();
    let killer = store.pool().clone();
    let cut = guarded(&store, &key, b"EUR 10", {
        let table = Arc::clone(&table);
        move |tx, attempt| {
            Box::pin(async move {
                let id = insert_charge(tx, &table, attempt.key(), 1000).await?;
                let connection: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
                    .fetch_one(&mut **tx)
                    .await?;
                // Another session kills this transaction's connection after the business
                // write, before the completion and the commit.
                sqlx::raw_sql(AssertSqlSafe(format!("KILL {connection}")))
                    .execute(&killer)
                    .await?;
                Ok::<_, sqlx::Error>(id)
            })
        }
    })
    .await;
    match cut {
        Err(TxError::Store(error)) => {
            assert!(
                error.is_retryable(),
                "a killed connection must be retryable: {error}"
            );
            assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
        }
        other => panic!("expected a store error, got {other:?}"),
    }
    assert_eq!(
        rows_for(&store, &table, &key).await,
        0,
        "the business row must not survive"
    );
    assert_eq!(
        store.get(&request(&key).scope, &key).await.unwrap(),
        None,
        "no record may remain"
    );

    let retried = charge(&store, Arc::clone(&table), &key, Duration::ZERO)
        .await
        .unwrap();
    assert!(
        matches!(retried, Execution::Executed { attempt: 1, .. }),
        "{retried:?}"
    );
    assert_eq!(rows_for(&store, &table, &key).await, 1);
}

#[tokio::test]
async fn a_transaction_the_caller_holds_commits_the_record_with_its_rows() {
    let store = common::fresh_store().await;
    let table = charges_table(&store).await;

    let key = Key::generate();
    let mut tx = store.pool().begin().await.unwrap();
    let Claim::Acquired(held) = store.begin_in(&mut tx, &request(&key)).await.unwrap() else {
        panic!("acquire")
    };
    insert_charge(&mut tx, &table, &key, 500).await.unwrap();
    let scope = request(&key).scope;
    let done = store
        .complete_in(&mut tx, &held, &Outcome::new("ok"), Duration::from_secs(3600))
        .await
        .unwrap();
    assert!(!done.is_lease_lost());
    assert_eq!(
        store.get(&scope, &key).await.unwrap(),
        None,
        "invisible before the commit"
    );
    tx.commit().await.unwrap();
    let Claim::Replay(replayed) = store.begin(&request(&key).token(Token::random())).await.unwrap() else {
        panic!("replay after commit")
    };
    assert_eq!(replayed.outcome.as_bytes(), b"ok");

    // The caller rolls back: nothing remains, and the key is free.
    let other = Key::generate();
    let mut tx = store.pool().begin().await.unwrap();
    assert!(matches!(
        store.begin_in(&mut tx, &request(&other)).await.unwrap(),
        Claim::Acquired(_)
    ));
    tx.rollback().await.unwrap();
    assert_eq!(store.get(&scope, &other).await.unwrap(), None);
    assert!(matches!(
        store.begin(&request(&other)).await.unwrap(),
        Claim::Acquired(Held { attempt: 1, .. })
    ));
}

#[tokio::test]
async fn a_key_held_outside_a_transaction_is_respected() {
    let store = common::fresh_store().await;
    let table = charges_table(&store).await;
    let key = Key::generate();
    let held = request(&key);
    let Claim::Acquired(holder) = store.begin(&held).await.unwrap() else {
        panic!("acquire")
    };
    let run = charge(&store, Arc::clone(&table), &key, Duration::ZERO)
        .await
        .unwrap();
    assert!(matches!(run, Execution::InFlight { attempt: 1, .. }), "{run:?}");
    assert_eq!(rows_for(&store, &table, &key).await, 0);

    let _ = store
        .complete(&holder, Outcome::new("elsewhere"), Duration::from_secs(60))
        .await
        .unwrap();
    let run = charge(&store, Arc::clone(&table), &key, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(outcome_of(&run), "elsewhere");

    let run = guarded(&store, &key, b"EUR 99", |_tx, _attempt| {
        Box::pin(async { Ok::<_, sqlx::Error>(0) })
    })
    .await
    .unwrap();
    assert!(matches!(run, Execution::Mismatch), "{run:?}");
}
