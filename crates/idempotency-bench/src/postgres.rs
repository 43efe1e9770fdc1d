//! PostgreSQL store: begin→complete cycles per second at 1, 16 and 64 callers against the same
//! SQL issued directly on a pool of connections like the store's own (as many, taken back
//! without a ping: `idempotency_core::connections`), and a same-transaction cycle against the
//! bare business transaction, in one run.
//!
//! The server is `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`). The bench
//! works in a table of its own (`idempotency_bench.records_<pid>`), dropped at the end.

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{Fingerprint, Key, Scope, Token};
use idempotency_postgres::{Operation, PostgresOptions, PostgresStore};
use sqlx::{AssertSqlSafe, PgConnection};

use crate::measure::{RawConnections, runtime};
use crate::sql_store::{Engine, compare};
use idempotency_core::TxFuture;

const SCHEMA: &str = "idempotency_bench";

/// Connections for the store's operations, and as many for the raw statements; with the
/// same-transaction rows' connections (the store's sqlx pool, one per caller), under the
/// server's default limit (100 on PostgreSQL).
const POOL: u32 = 30;

pub(crate) fn run(window: Duration, rounds: usize) -> Result<(), String> {
    let runtime = runtime()?;
    runtime.block_on(run_async(window, rounds))
}

async fn run_async(window: Duration, rounds: usize) -> Result<(), String> {
    let url =
        std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let table = format!("records_{}", std::process::id());
    let options = PostgresOptions::from_url(&url)
        .and_then(|o| o.schema(SCHEMA))
        .and_then(|o| o.table(&table))
        .map_err(|e| e.to_string())?
        .max_connections(POOL);
    let store = PostgresStore::connect_with(options)
        .await
        .map_err(|e| format!("PostgreSQL at {url}: {e}"))?;
    // The raw statements' connections: as many as the store's, taken back the same way.
    let raw = RawConnections::new(store.pool().connect_options(), POOL);
    let target = Target {
        store: store.clone(),
        raw,
    };
    let business = format!("{SCHEMA}.charges_{}", std::process::id());
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {business} (id bigserial PRIMARY KEY, key text NOT NULL, cents int NOT NULL)"
    )))
    .execute(store.pool())
    .await
    .map_err(|e| e.to_string())?;

    let settings: Vec<(String, String)> = sqlx::query_as(
        "SELECT name, setting FROM pg_settings WHERE name IN
         ('server_version', 'synchronous_commit', 'fsync', 'shared_buffers', 'max_connections', 'wal_level')
         ORDER BY name",
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
    store: PostgresStore,
    raw: RawConnections<PgConnection>,
}

impl Engine for Target {
    type Store = PostgresStore;

    const NAME: &'static str = "PostgreSQL";

    fn store(&self) -> &PostgresStore {
        &self.store
    }

    /// The store's two statements, bound with the same values, each on a connection of `raw` (as
    /// the store takes one for `begin` and one for `complete`).
    async fn raw_cycle(&self, scope: &Scope, key: &Key) -> Result<(), String> {
        let (store, raw) = (&self.store, &self.raw);
        let token = Token::random().to_bytes();
        let fingerprint = Fingerprint::of_bytes(b"payload");
        let begin = store.sql(Operation::Begin).to_owned();
        raw.run(async |connection| {
            sqlx::query(AssertSqlSafe(begin))
                .bind(scope.as_str())
                .bind(key.as_str())
                .bind(&fingerprint.as_bytes()[..])
                .bind(&token[..])
                .bind(60_000_i64)
                .bind(0_i64)
                .fetch_optional(connection)
                .await
        })
        .await?;
        let complete = store.sql(Operation::Complete).to_owned();
        raw.run(async |connection| {
            sqlx::query(AssertSqlSafe(complete))
                .bind(scope.as_str())
                .bind(key.as_str())
                .bind(&token[..])
                .bind(&[0u8; 0][..])
                .bind(0_i64)
                .fetch_optional(connection)
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
        tx: &'t mut idempotency_postgres::PgTransaction,
        table: Arc<str>,
        key: Key,
    ) -> TxFuture<'t, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {table} (key, cents) VALUES ($1, 1000)"
            )))
            .bind(key.as_str())
            .execute(&mut **tx)
            .await
            .map(drop)
        })
    }
}
