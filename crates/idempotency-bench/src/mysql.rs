//! MySQL/MariaDB store: begin→complete cycles per second at 1, 16 and 64 callers against the
//! same SQL issued directly on a pool of connections like the store's own (as many, taken back
//! without a ping: `idempotency_core::connections`), replays against a raw `SELECT` by key, and a
//! same-transaction cycle against the bare business transaction, in one run.
//!
//! The server is `MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`). The bench works in
//! tables of its own (`bench_records_<pid>`, `bench_charges_<pid>`), dropped at the end.

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{Fingerprint, Key, Scope, Token};
use idempotency_mysql::sqlx::{self, AssertSqlSafe, MySqlConnection};
use idempotency_mysql::{MysqlOptions, MysqlStore, Operation};

use crate::measure::{RawConnections, runtime};
use crate::sql_store::{Engine, compare};
use idempotency_core::TxFuture;

/// Connections for the store's operations, and as many for the raw statements; with the
/// same-transaction rows' connections (the store's sqlx pool, one per caller), under the
/// server's default limit (151 on MariaDB; PostgreSQL's bench keeps the same numbers under 100).
const POOL: u32 = 30;

pub(crate) fn run(window: Duration, rounds: usize) -> Result<(), String> {
    let runtime = runtime()?;
    runtime.block_on(run_async(window, rounds))
}

async fn run_async(window: Duration, rounds: usize) -> Result<(), String> {
    let url = std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let table = format!("bench_records_{}", std::process::id());
    let options = MysqlOptions::from_url(&url)
        .and_then(|o| o.table(&table))
        .map_err(|e| e.to_string())?
        .max_connections(POOL);
    let store = MysqlStore::connect_with(options)
        .await
        .map_err(|e| format!("MySQL at {}: {e}", idempotency_core::redact_url(&url)))?;
    // The raw statements' connections: as many as the store's, taken back the same way.
    let raw = RawConnections::new(store.pool().connect_options(), POOL);
    let target = Target {
        store: store.clone(),
        raw,
    };
    let business = format!("bench_charges_{}", std::process::id());
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {business} (id BIGINT AUTO_INCREMENT PRIMARY KEY, idem_key VARCHAR(255) NOT NULL, cents INT NOT NULL) ENGINE = InnoDB"
    )))
    .execute(store.pool())
    .await
    .map_err(|e| e.to_string())?;

    let settings: Vec<(String, String)> = sqlx::query_as(
        "SELECT CAST(VARIABLE_NAME AS CHAR), CAST(VARIABLE_VALUE AS CHAR) FROM information_schema.GLOBAL_VARIABLES
         WHERE VARIABLE_NAME IN ('VERSION', 'INNODB_FLUSH_LOG_AT_TRX_COMMIT', 'SYNC_BINLOG', 'LOG_BIN',
                                 'INNODB_BUFFER_POOL_SIZE', 'MAX_CONNECTIONS', 'TRANSACTION_ISOLATION', 'TX_ISOLATION')
         ORDER BY VARIABLE_NAME",
    )
    .fetch_all(store.pool())
    .await
    .map_err(|e| e.to_string())?;
    compare(&target, &settings, POOL, &business, window, rounds).await?;

    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE {business}; DROP TABLE {}",
        store.table()
    )))
    .execute(store.pool())
    .await
    .map_err(|e| e.to_string())?;
    Ok(())
}

/// The store, and connections like its own for the raw statements.
#[derive(Clone)]
struct Target {
    store: MysqlStore,
    raw: RawConnections<MySqlConnection>,
}

impl Engine for Target {
    type Store = MysqlStore;

    const NAME: &'static str = "MySQL";

    fn store(&self) -> &MysqlStore {
        &self.store
    }

    /// The store's three statements for a new key (the first look and the insert on one connection
    /// of `raw`, the completing update on another, as the store runs `begin` and `complete`),
    /// bound with the same values.
    async fn raw_cycle(&self, scope: &Scope, key: &Key) -> Result<(), String> {
        let (store, raw) = (&self.store, &self.raw);
        let token = Token::random().to_bytes();
        let fingerprint = Fingerprint::of_bytes(b"payload");
        let (peek, insert) = (
            store.sql(Operation::Peek).to_owned(),
            store.sql(Operation::Insert).to_owned(),
        );
        raw.run(async |connection| {
            let now: i64 = sqlx::query(AssertSqlSafe(peek))
                .bind(scope.as_str())
                .bind(key.as_str())
                .fetch_one(&mut *connection)
                .await
                .and_then(|row| sqlx::Row::try_get(&row, 0))?;
            sqlx::query(AssertSqlSafe(insert))
                .bind(scope.as_str())
                .bind(key.as_str())
                .bind(&fingerprint.as_bytes()[..])
                .bind(1_i64)
                .bind(now)
                .bind(now + 60_000)
                .bind(&token[..])
                .bind(false)
                .bind(Some(now))
                .bind(Some(now + 60_000))
                .bind(None::<i64>)
                .bind(None::<&[u8]>)
                .execute(connection)
                .await
        })
        .await?;
        let complete = store.sql(Operation::Complete).to_owned();
        raw.run(async |connection| {
            sqlx::query(AssertSqlSafe(complete))
                .bind(0_i64)
                .bind(&[0u8; 0][..])
                .bind(scope.as_str())
                .bind(key.as_str())
                .bind(&token[..])
                .execute(connection)
                .await
        })
        .await?;
        Ok(())
    }

    async fn raw_select(&self, scope: &Scope, key: &Key) -> Result<(), String> {
        let get = self.store.sql(Operation::Get).to_owned();
        self.raw
            .run(async |connection| {
                sqlx::query(AssertSqlSafe(get))
                    .bind(scope.as_str())
                    .bind(key.as_str())
                    .fetch_optional(connection)
                    .await
                    .map(drop)
            })
            .await
    }

    fn insert<'t>(
        tx: &'t mut idempotency_mysql::MysqlTransaction,
        table: Arc<str>,
        key: Key,
    ) -> TxFuture<'t, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {table} (idem_key, cents) VALUES (?, 1000)"
            )))
            .bind(key.as_str())
            .execute(&mut **tx)
            .await
            .map(drop)
        })
    }
}
