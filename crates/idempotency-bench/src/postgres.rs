//! PostgreSQL store: begin→complete cycles per second at 1, 16 and 64 callers against the same
//! SQL issued directly on a pool of connections like the store's own (as many, taken back
//! without a ping: `idempotency_core::connections`), replays against a raw `SELECT` by key, and
//! a same-transaction cycle against the bare business transaction, in one run.
//!
//! The server is `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`). The bench
//! works in tables of its own (`idempotency_bench.records_<pid>`, `idempotency_bench.charges_<pid>`),
//! dropped at the end.

use std::sync::Arc;

use idempotency_core::{Fingerprint, Key, Scope, Token};
use idempotency_postgres::{Operation, PostgresOptions, PostgresStore};
use sqlx::{AssertSqlSafe, PgConnection};

use crate::measure::RawConnections;
use crate::sql_store::Engine;

const SCHEMA: &str = "idempotency_bench";

/// PostgreSQL: 30 connections a side, under the server's default limit (100).
pub(crate) struct Postgres;

impl Engine for Postgres {
    type Store = PostgresStore;
    type Database = sqlx::Postgres;

    const NAME: &'static str = "PostgreSQL";
    const URL: (&'static str, &'static str) = ("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    const POOL: u32 = 30;
    const SETTINGS: &'static str = "SELECT name, setting FROM pg_settings WHERE name IN
         ('server_version', 'synchronous_commit', 'fsync', 'shared_buffers', 'max_connections', 'wal_level')
         ORDER BY name";

    fn create_business(table: &str) -> String {
        format!("CREATE TABLE {table} (id bigserial PRIMARY KEY, key text NOT NULL, cents int NOT NULL)")
    }

    fn insert_business(table: &str) -> String {
        format!("INSERT INTO {table} (key, cents) VALUES ($1, 1000)")
    }

    fn business_table() -> String {
        format!("{SCHEMA}.charges_{}", std::process::id())
    }

    async fn connect(url: &str) -> Result<PostgresStore, String> {
        let options = PostgresOptions::from_url(url)
            .and_then(|o| o.schema(SCHEMA))
            .and_then(|o| o.table(&format!("records_{}", std::process::id())))
            .map_err(|e| e.to_string())?
            .max_connections(Self::POOL);
        PostgresStore::connect_with(options)
            .await
            .map_err(|e| format!("PostgreSQL at {}: {e}", idempotency_core::redact_url(url)))
    }

    fn records_table(store: &PostgresStore) -> String {
        store.table()
    }

    fn pool(store: &PostgresStore) -> &sqlx::PgPool {
        store.pool()
    }

    fn get_statement(store: &PostgresStore) -> Arc<str> {
        store.sql(Operation::Get).into()
    }

    /// The store's two statements, bound with the same values, each on a connection of `raw` (as
    /// the store takes one for `begin` and one for `complete`).
    async fn raw_cycle(
        store: &PostgresStore,
        raw: &RawConnections<PgConnection>,
        scope: &Scope,
        key: &Key,
    ) -> Result<(), String> {
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
}
