//! A `begin` that finds a completed record, a live in-flight one or another payload writes
//! nothing and takes no lock: it answers while another transaction holds the row locked, and
//! the session's write counters do not move.

mod common;

use std::time::Duration;

use idempotency_core::{BeginRequest, Claim, Fingerprint, Key, Scope, Store};
use idempotency_mysql::sqlx::{self, AssertSqlSafe, Connection, Row};
use idempotency_mysql::{MysqlOptions, MysqlStore};

fn request(key: &str, payload: &[u8]) -> BeginRequest {
    BeginRequest::new(
        Scope::new("reads").unwrap(),
        Key::new(key).unwrap(),
        Fingerprint::of_bytes(payload),
    )
    .lease(Duration::from_secs(600))
}

/// A record completed as `done` and one in flight as `running`.
async fn setup(store: &MysqlStore) {
    idempotency_testkit::completed(store, &request("done", b"a"), "charged").await;
    assert!(matches!(
        store.begin(&request("running", b"a")).await.unwrap(),
        Claim::Acquired(_)
    ));
}

async fn ask_all(store: &MysqlStore) -> (Claim, Claim, Claim) {
    (
        store.begin(&request("done", b"a")).await.unwrap(),
        store.begin(&request("running", b"a")).await.unwrap(),
        store.begin(&request("done", b"other")).await.unwrap(),
    )
}

fn check((replay, in_flight, mismatch): &(Claim, Claim, Claim)) {
    assert!(matches!(replay, Claim::Replay(_)), "{replay:?}");
    assert!(matches!(in_flight, Claim::InFlight { .. }), "{in_flight:?}");
    assert_eq!(*mismatch, Claim::Mismatch);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_conflicts_and_mismatches_answer_while_the_row_is_locked() {
    let store = common::fresh_store().await;
    setup(&store).await;

    // Another session locks both rows, as a long transaction would.
    let mut locker = sqlx::MySqlConnection::connect(&common::database_url())
        .await
        .unwrap();
    sqlx::raw_sql("BEGIN").execute(&mut locker).await.unwrap();
    let lock = format!(
        "SELECT 1 FROM {} WHERE scope = 'reads' AND `key` IN ('done', 'running') FOR UPDATE",
        store.table()
    );
    let locked = sqlx::query(AssertSqlSafe(lock))
        .fetch_all(&mut locker)
        .await
        .unwrap();
    assert_eq!(locked.len(), 2);

    let answers = tokio::time::timeout(Duration::from_secs(10), ask_all(&store)).await;
    sqlx::raw_sql("ROLLBACK").execute(&mut locker).await.unwrap();
    check(&answers.expect("a begin that changes nothing waited for another transaction's row lock"));
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
    setup(&store).await;
    let before = write_counters(&store).await;
    for _ in 0..333 {
        check(&ask_all(&store).await);
    }
    let after = write_counters(&store).await;
    assert_eq!(before.len(), 6, "{before:?}");
    assert_eq!(
        before, after,
        "999 answers without a write changed the write counters"
    );
}
