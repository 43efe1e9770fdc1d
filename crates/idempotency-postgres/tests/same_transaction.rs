//! Same-transaction mode against the real server (`idempotency_testkit::same_transaction`):
//! the record and the business rows commit together or not at all.

mod common;

use std::sync::Arc;

use idempotency_core::{Key, TxFuture};
use idempotency_postgres::{PgTransaction, PostgresStore};
use idempotency_testkit::same_transaction::{BoxError, Business};
use sqlx::AssertSqlSafe;

/// Charges in a table of the test's own, in PostgreSQL's SQL.
#[derive(Clone)]
struct Charges;

impl Business<PostgresStore> for Charges {
    async fn create_table(&self, store: &PostgresStore) -> Arc<str> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let records = store.table();
        let suffix = records.rsplit('_').next().unwrap();
        let name = format!("{}.b_{now}_{suffix}", common::SCHEMA);
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE {name} (id bigserial PRIMARY KEY, key text NOT NULL, cents int NOT NULL)"
        )))
        .execute(store.pool())
        .await
        .unwrap();
        name.into()
    }

    fn insert<'t>(
        &self,
        tx: &'t mut PgTransaction,
        table: Arc<str>,
        key: Key,
        cents: i32,
    ) -> TxFuture<'t, Result<i64, BoxError>> {
        Box::pin(async move {
            let insert = format!("INSERT INTO {table} (key, cents) VALUES ($1, $2) RETURNING id");
            sqlx::query_scalar(AssertSqlSafe(insert))
                .bind(key.as_str())
                .bind(cents)
                .fetch_one(&mut **tx)
                .await
                .map_err(BoxError::from)
        })
    }

    async fn rows(&self, store: &PostgresStore, table: &str, key: &Key) -> i64 {
        let count = format!("SELECT count(*) FROM {table} WHERE key = $1");
        sqlx::query_scalar(AssertSqlSafe(count))
            .bind(key.as_str())
            .fetch_one(store.pool())
            .await
            .unwrap()
    }

    fn kill<'t>(&self, tx: &'t mut PgTransaction) -> TxFuture<'t, Result<(), BoxError>> {
        Box::pin(async move {
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut **tx)
                .await
                .map_err(BoxError::from)?;
            let killer = sqlx::PgPool::connect(&common::database_url()).await.unwrap();
            let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
                .bind(pid)
                .fetch_one(&killer)
                .await
                .unwrap();
            assert!(killed);
            killer.close().await;
            Ok(())
        })
    }
}

idempotency_testkit::same_transaction_suite!(common::fresh_store(), Charges);
