//! Same-transaction mode against the real server (`idempotency_testkit::same_transaction`):
//! the record and the business rows commit together or not at all.

mod common;

use std::sync::Arc;

use idempotency_core::{Key, TxFuture};
use idempotency_mysql::sqlx::{self, AssertSqlSafe};
use idempotency_mysql::{MysqlStore, MysqlTransaction};
use idempotency_testkit::same_transaction::{BoxError, Business};

/// Charges in a table of the test's own, in MySQL's SQL.
#[derive(Clone)]
struct Charges;

impl Business<MysqlStore> for Charges {
    async fn create_table(&self, store: &MysqlStore) -> Arc<str> {
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

    fn insert<'t>(
        &self,
        tx: &'t mut MysqlTransaction,
        table: Arc<str>,
        key: Key,
        cents: i32,
    ) -> TxFuture<'t, Result<i64, BoxError>> {
        Box::pin(async move {
            let insert = format!("INSERT INTO {table} (idem_key, cents) VALUES (?, ?)");
            let done = sqlx::query(AssertSqlSafe(insert))
                .bind(key.as_str())
                .bind(cents)
                .execute(&mut **tx)
                .await
                .map_err(BoxError::from)?;
            Ok(i64::try_from(done.last_insert_id()).expect("a row id"))
        })
    }

    async fn rows(&self, store: &MysqlStore, table: &str, key: &Key) -> i64 {
        let count = format!("SELECT COUNT(*) FROM {table} WHERE idem_key = ?");
        sqlx::query_scalar(AssertSqlSafe(count))
            .bind(key.as_str())
            .fetch_one(store.pool())
            .await
            .unwrap()
    }

    fn kill<'t>(&self, tx: &'t mut MysqlTransaction) -> TxFuture<'t, Result<(), BoxError>> {
        Box::pin(async move {
            let connection: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
                .fetch_one(&mut **tx)
                .await
                .map_err(BoxError::from)?;
            let killer = sqlx::MySqlPool::connect(&common::database_url()).await.unwrap();
            sqlx::raw_sql(AssertSqlSafe(format!("KILL {connection}")))
                .execute(&killer)
                .await
                .unwrap();
            killer.close().await;
            Ok(())
        })
    }
}

idempotency_testkit::same_transaction_suite!(common::fresh_store(), Charges);
