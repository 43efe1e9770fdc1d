//! A `begin` that finds a completed record, a live in-flight one or another payload reads and
//! writes nothing: it answers while another transaction holds the row locked (the claiming
//! upsert it used to run first locked the row even when it changed nothing, so it waited).

mod common;

use std::time::Duration;

use idempotency_core::{BeginRequest, Claim, Fingerprint, Key, Scope, Store};
use idempotency_postgres::sqlx::{self, AssertSqlSafe, Connection};

fn request(key: &str, payload: &[u8]) -> BeginRequest {
    BeginRequest::new(
        Scope::new("reads").unwrap(),
        Key::new(key).unwrap(),
        Fingerprint::of_bytes(payload),
    )
    .lease(Duration::from_secs(600))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_conflicts_and_mismatches_answer_while_the_row_is_locked() {
    let store = common::fresh_store().await;
    idempotency_testkit::completed(&store, &request("done", b"a"), "charged").await;
    assert!(matches!(
        store.begin(&request("running", b"a")).await.unwrap(),
        Claim::Acquired(_)
    ));

    // Another session locks both rows, as a long transaction or a claiming upsert would.
    let mut locker = sqlx::PgConnection::connect(&common::database_url())
        .await
        .unwrap();
    sqlx::raw_sql("BEGIN").execute(&mut locker).await.unwrap();
    let lock = format!(
        "SELECT 1 FROM {} WHERE scope = 'reads' AND key IN ('done', 'running') FOR UPDATE",
        store.table()
    );
    let locked = sqlx::query(AssertSqlSafe(lock))
        .fetch_all(&mut locker)
        .await
        .unwrap();
    assert_eq!(locked.len(), 2);

    let answers = tokio::time::timeout(Duration::from_secs(10), async {
        (
            store.begin(&request("done", b"a")).await.unwrap(),
            store.begin(&request("running", b"a")).await.unwrap(),
            store.begin(&request("done", b"other")).await.unwrap(),
        )
    })
    .await;
    sqlx::raw_sql("ROLLBACK").execute(&mut locker).await.unwrap();
    let (replay, in_flight, mismatch) =
        answers.expect("a begin that changes nothing waited for another transaction's row lock");
    assert!(matches!(replay, Claim::Replay(_)), "{replay:?}");
    assert!(matches!(in_flight, Claim::InFlight { .. }), "{in_flight:?}");
    assert_eq!(mismatch, Claim::Mismatch);
}
