//! A `begin` that finds a completed record, a live in-flight one or another payload writes
//! nothing and takes no lock: it answers while another transaction holds the row locked, and
//! the session's write counters do not move.

use crate::common;

use idempotency_mysql::sqlx::{self, Row};
use idempotency_mysql::{MysqlOptions, MysqlStore};
use idempotency_testkit::sql::{ask_without_writing, record_done_and_running};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_conflicts_and_mismatches_answer_while_the_row_is_locked() {
    let store = common::fresh_store().await;
    idempotency_testkit::sql::reads_answer_while_the_rows_are_locked::<common::Sql>(&store).await;
}

/// The session's counters of rows updated and deleted and of writing statements and
/// transactions. (`Handler_write` is left out: `SHOW STATUS` itself writes a temporary table.)
async fn write_counters(store: &MysqlStore) -> Vec<(String, i64)> {
    let rows = sqlx::query(
        "SHOW SESSION STATUS WHERE Variable_name IN ('Handler_update', 'Handler_delete', 'Com_insert', 'Com_update', 'Com_delete', 'Com_begin')",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    rows.iter()
        .map(|row| {
            let name: String = row.try_get(0).unwrap();
            let value: String = row.try_get(1).unwrap();
            (name, value.parse().unwrap())
        })
        .collect()
}

#[tokio::test]
async fn a_thousand_replays_write_nothing() {
    let table = common::fresh_store().await.table().to_owned();
    // One connection, so that the session counters are the store's own.
    let options = MysqlOptions::from_url(&common::database_url())
        .unwrap()
        .table(&table)
        .unwrap()
        .max_connections(1)
        .lease_connections(0);
    let store = MysqlStore::connect_with(options).await.unwrap();
    record_done_and_running(&store).await;
    let before = write_counters(&store).await;
    for _ in 0..333 {
        ask_without_writing(&store).await;
    }
    let after = write_counters(&store).await;
    assert_eq!(before.len(), 6, "{before:?}");
    assert_eq!(
        before, after,
        "999 answers without a write changed the write counters"
    );
}
