//! The statements that find records by key read them through the primary key whatever the
//! table's statistics. A connection caches a statement's generic plan; planned on a new table
//! (no statistics yet), a join of a batch's arrays with the table became a hash join over a
//! scan of the whole table, and every batch after it read every record as the table grew (a
//! guarded consumer on a new table slowed from 9,700 to 1,700 messages/s within 80,000
//! messages). Checked on the plans themselves, which no timing changes.

use crate::common;

use std::time::Duration;

use idempotency_core::{BeginRequest, Claim, Completion, Fenced, Fingerprint, Key, Outcome, Scope, Store};
use idempotency_postgres::sqlx::{self, AssertSqlSafe, Connection};
use idempotency_postgres::{Operation, PostgresStore};

/// Each statement that takes a key, with arguments of its parameters' types.
const STATEMENTS: &[(Operation, &str)] = &[
    (Operation::Peek, "'s', 'k'"),
    (Operation::Begin, "'s', 'k', '\\x00', '\\x00', 1, 1"),
    (Operation::Claim, "'s', 'k', '\\x00', '\\x00', 1, 1"),
    (Operation::Complete, "'s', 'k', '\\x00', '\\x00', 1"),
    (
        Operation::BeginMany,
        "'{s}', '{k}', ARRAY['\\x00'::bytea], ARRAY['\\x00'::bytea], '{1}', '{1}'",
    ),
    (
        Operation::CompleteMany,
        "'{s}', '{k}', ARRAY['\\x00'::bytea], ARRAY['\\x00'::bytea], '{1}'",
    ),
    (Operation::Release, "'s', 'k', '\\x00', '\\x00'"),
    (Operation::Extend, "'s', 'k', '\\x00', 1"),
    (Operation::Get, "'s', 'k'"),
];

#[tokio::test]
async fn records_are_found_through_the_primary_key_on_a_table_without_statistics() {
    // A new table: never analyzed, as the store creates it.
    let store = common::fresh_store().await;
    let table = store.table();
    let name = table.rsplit('.').next().unwrap();
    let mut wrong = Vec::new();
    for (operation, plan) in generic_plans(STATEMENTS, &store).await {
        let through_the_key = plan.iter().any(|line| line.contains(&format!("{name}_pkey")));
        let scan = plan
            .iter()
            .any(|line| line.contains(&format!("Seq Scan on {name}")));
        if scan || !through_the_key {
            wrong.push(format!("{operation:?}:\n{}", plan.join("\n")));
        }
    }
    assert!(
        wrong.is_empty(),
        "statements that scan the table or not through its primary key:\n{}",
        wrong.join("\n\n")
    );
}

/// The statements' generic plans (as a connection that prepared them now would keep them): for
/// each operation, the lines of its plan.
async fn generic_plans(
    statements: &[(Operation, &str)],
    store: &PostgresStore,
) -> Vec<(Operation, Vec<String>)> {
    let mut connection = sqlx::PgConnection::connect(&common::database_url())
        .await
        .unwrap();
    sqlx::raw_sql("SET plan_cache_mode = force_generic_plan")
        .execute(&mut connection)
        .await
        .unwrap();
    let mut plans = Vec::new();
    for (at, (operation, arguments)) in statements.iter().enumerate() {
        let prepare = format!("PREPARE statement_{at} AS {}", store.sql(*operation));
        sqlx::raw_sql(AssertSqlSafe(prepare))
            .execute(&mut connection)
            .await
            .unwrap_or_else(|e| panic!("{operation:?}: {e}"));
        let explain = format!("EXPLAIN EXECUTE statement_{at}({arguments})");
        let plan: Vec<String> = sqlx::query_scalar(AssertSqlSafe(explain))
            .fetch_all(&mut connection)
            .await
            .unwrap_or_else(|e| panic!("{operation:?}: {e}"));
        plans.push((*operation, plan));
    }
    plans
}

/// A store on a new table that only the store analyzes: autovacuum (where it runs) could
/// otherwise do it in the middle of a test.
async fn quiet_store() -> PostgresStore {
    let store = common::fresh_store().await;
    let quiet = format!("ALTER TABLE {} SET (autovacuum_enabled = false)", store.table());
    sqlx::raw_sql(AssertSqlSafe(quiet))
        .execute(store.pool())
        .await
        .unwrap();
    store
}

/// Whether `store`'s table has planner statistics.
async fn analyzed(store: &PostgresStore) -> bool {
    counted_rows(store).await >= 0.0
}

#[tokio::test]
async fn a_new_table_is_analyzed_once_a_thousand_keys_went_through_batches() {
    let store = quiet_store().await;
    assert!(!analyzed(&store).await, "a new table has no statistics");
    let scope = Scope::new("plans").unwrap();
    for batch in 0..32 {
        let requests: Vec<BeginRequest> = (0..32)
            .map(|i| {
                BeginRequest::new(
                    scope.clone(),
                    Key::new(format!("{batch}-{i}")).unwrap(),
                    Fingerprint::of_bytes(b""),
                )
            })
            .collect();
        let completions: Vec<Completion> = store
            .begin_many(&requests)
            .await
            .into_iter()
            .map(|claim| match claim.unwrap() {
                Claim::Acquired(held) => {
                    Completion::new(held, Outcome::new("done"), Duration::from_secs(600))
                }
                other => panic!("{other:?}"),
            })
            .collect();
        for done in store.complete_many(&completions).await {
            assert!(matches!(done.unwrap(), Fenced::Accepted(_)));
        }
        // 1,000 keys are reached within the 32nd batch: not before it.
        assert_eq!(analyzed(&store).await, batch == 31, "after batch {batch}");
    }
    assert_found_through_the_key(&store).await;
}

#[tokio::test]
async fn a_table_analyzed_while_empty_is_analyzed_again_once_a_thousand_keys_were_claimed() {
    let store = quiet_store().await;
    let table = store.table();
    // Statistics that say the table is empty, as a VACUUM or ANALYZE of a new or emptied table
    // leaves them: PostgreSQL then plans every lookup by key as a scan of the whole table.
    sqlx::raw_sql(AssertSqlSafe(format!("VACUUM ANALYZE {table}")))
        .execute(store.pool())
        .await
        .unwrap();
    assert_eq!(counted_rows(&store).await, 0.0);
    let scope = Scope::new("plans").unwrap();
    for i in 1..=1_000 {
        let request = BeginRequest::new(
            scope.clone(),
            Key::new(format!("k-{i}")).unwrap(),
            Fingerprint::of_bytes(b""),
        );
        let Claim::Acquired(held) = store.begin(&request).await.unwrap() else {
            panic!("a new key is acquired");
        };
        // Every tenth one stays in flight, as a busy table's records do.
        if i % 10 != 0 {
            let done = store
                .complete(&held, Outcome::new("done"), Duration::from_secs(600))
                .await
                .unwrap();
            assert!(matches!(done, Fenced::Accepted(_)));
        }
        if i == 999 {
            assert_eq!(
                counted_rows(&store).await,
                0.0,
                "analyzed before 1,000 keys were claimed"
            );
        }
    }
    let counted = counted_rows(&store).await;
    assert!(
        counted >= 900.0,
        "the statistics count {counted} records of 1,000"
    );
    assert_found_through_the_key(&store).await;
}

/// The records `store`'s table statistics count (`reltuples`; -1 when never analyzed).
async fn counted_rows(store: &PostgresStore) -> f32 {
    sqlx::query_scalar("SELECT reltuples FROM pg_class WHERE oid = to_regclass($1)")
        .bind(store.table())
        .fetch_one(store.pool())
        .await
        .unwrap()
}

/// Every statement that takes a key finds its record through the primary key, in the plan a
/// connection would keep for it now, and none scans the table or its expiry index.
async fn assert_found_through_the_key(store: &PostgresStore) {
    let name = store.table();
    let name = name.rsplit('.').next().unwrap();
    for (operation, plan) in generic_plans(STATEMENTS, store).await {
        assert!(
            plan.iter().any(|line| line.contains(&format!("{name}_pkey")))
                && !plan
                    .iter()
                    .any(|line| line.contains("Seq Scan") || line.contains(&format!("{name}_expiry"))),
            "{operation:?} on the analyzed table:\n{}",
            plan.join("\n")
        );
    }
}
