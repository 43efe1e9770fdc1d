//! A `begin` that InnoDB picks as a deadlock victim runs again by itself, and is counted.
//!
//! The deadlock is built on purpose: another session holds the gap of the expiry index where a
//! takeover's new expiry goes, the takeover holds the record's row lock and waits for that gap,
//! and the other session then asks for the row. The other session has written many rows, so
//! InnoDB rolls the takeover back, the smaller transaction.

use crate::common;

use std::time::Duration;

use idempotency_core::{BeginRequest, Claim, Fingerprint, Held, Key, Scope, Store};
use idempotency_mysql::sqlx::{self, AssertSqlSafe, Connection};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_victim_runs_again_and_is_counted() {
    let store = common::fresh_store().await;
    let key = Key::new("deadlocked").unwrap();
    let request =
        |lease| BeginRequest::new(Scope::global(), key.clone(), Fingerprint::of_bytes(b"p")).lease(lease);
    // A record whose lease ran out: the next begin takes it over under the row lock.
    assert!(matches!(
        store.begin(&request(Duration::from_millis(1))).await.unwrap(),
        Claim::Acquired(_)
    ));
    tokio::time::sleep(Duration::from_millis(20)).await;

    let mut other = sqlx::MySqlConnection::connect(&common::database_url())
        .await
        .unwrap();
    let scratch = format!("{}_heavy", store.table());
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {scratch} (n INT) ENGINE = InnoDB"
    )))
    .execute(&mut other)
    .await
    .unwrap();
    sqlx::raw_sql("BEGIN").execute(&mut other).await.unwrap();
    for n in 0..200 {
        sqlx::query(AssertSqlSafe(format!("INSERT INTO {scratch} VALUES (?)")))
            .bind(n)
            .execute(&mut other)
            .await
            .unwrap();
    }
    // The gap after the last expiry (the expired record's), where every later expiry goes,
    // without the record itself: a range with a constant bound, which the index seeks to.
    sqlx::query(AssertSqlSafe(format!(
        "SELECT 1 FROM {} FORCE INDEX (expiry) WHERE expires_at > '2999-01-01 00:00:00' FOR UPDATE",
        store.table()
    )))
    .fetch_all(&mut other)
    .await
    .unwrap();

    let takeover = tokio::spawn({
        let (store, request) = (store.clone(), request(Duration::from_secs(60)));
        async move { store.begin(&request).await }
    });
    // Once the takeover holds the row (it is writing it), asking for the row closes the cycle,
    // and InnoDB rolls the takeover back.
    let watcher = store.pool().clone();
    let table = store.table().to_owned();
    idempotency_testkit::eventually(Duration::from_secs(20), "the takeover writes the row", async || {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE CONCAT('UPDATE ', ?, ' SET %')",
        )
        .bind(&table)
        .fetch_one(&watcher)
        .await
        .unwrap();
        waiting == 1
    })
    .await;
    let row = format!(
        "SELECT 1 FROM {} WHERE scope = '' AND `key` = 'deadlocked' FOR UPDATE",
        store.table()
    );
    sqlx::query(AssertSqlSafe(row))
        .fetch_all(&mut other)
        .await
        .expect("the heavier transaction is not the victim");
    assert!(!takeover.is_finished(), "the takeover waits for the row again");
    sqlx::raw_sql("ROLLBACK").execute(&mut other).await.unwrap();

    let claim = takeover
        .await
        .unwrap()
        .expect("the victim ran again instead of failing");
    assert!(
        matches!(
            claim,
            Claim::Acquired(Held {
                attempt: 2,
                recovered: true,
                ..
            })
        ),
        "{claim:?}"
    );
    assert_eq!(store.deadlock_retries(), 1);
    sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {scratch}")))
        .execute(store.pool())
        .await
        .unwrap();
}
