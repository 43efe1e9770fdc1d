//! MySQL/MariaDB store: begin→complete cycles per second at 1, 16 and 64 callers against the
//! same SQL issued directly on a pool of connections like the store's own (as many, taken back
//! without a ping: `idempotency_core::connections`), replays against a raw `SELECT` by key, and a
//! same-transaction cycle against the bare business transaction, in one run.
//!
//! The server is `MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`). The bench works in
//! tables of its own (`bench_records_<pid>`, `bench_charges_<pid>`), dropped at the end.

use std::sync::Arc;

use idempotency_core::{Fingerprint, Key, Scope, Token};
use idempotency_mysql::sqlx::{self, AssertSqlSafe, MySql, MySqlConnection};
use idempotency_mysql::{MysqlOptions, MysqlStore, Operation};

use crate::measure::RawConnections;
use crate::sql_store::Engine;

/// MySQL/MariaDB: 30 connections a side, under the server's default limit (151 on MariaDB).
pub(crate) struct Mysql;

impl Engine for Mysql {
    type Store = MysqlStore;
    type Database = MySql;

    const NAME: &'static str = "MySQL";
    const URL: (&'static str, &'static str) = ("MYSQL_URL", "mysql://root@127.0.0.1:3306/test");
    const POOL: u32 = 30;
    const SETTINGS: &'static str =
        "SELECT CAST(VARIABLE_NAME AS CHAR), CAST(VARIABLE_VALUE AS CHAR) FROM information_schema.GLOBAL_VARIABLES
         WHERE VARIABLE_NAME IN ('VERSION', 'INNODB_FLUSH_LOG_AT_TRX_COMMIT', 'SYNC_BINLOG', 'LOG_BIN',
                                 'INNODB_BUFFER_POOL_SIZE', 'MAX_CONNECTIONS', 'TRANSACTION_ISOLATION', 'TX_ISOLATION')
         ORDER BY VARIABLE_NAME";

    fn create_business(table: &str) -> String {
        format!(
            "CREATE TABLE {table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, idem_key VARCHAR(255) NOT NULL, cents INT NOT NULL) ENGINE = InnoDB"
        )
    }

    fn insert_business(table: &str) -> String {
        format!("INSERT INTO {table} (idem_key, cents) VALUES (?, 1000)")
    }

    fn business_table() -> String {
        format!("bench_charges_{}", std::process::id())
    }

    async fn connect(url: &str) -> Result<MysqlStore, String> {
        let options = MysqlOptions::from_url(url)
            .and_then(|o| o.table(&format!("bench_records_{}", std::process::id())))
            .map_err(|e| e.to_string())?
            .max_connections(Self::POOL);
        MysqlStore::connect_with(options)
            .await
            .map_err(|e| format!("MySQL at {}: {e}", idempotency_core::redact_url(url)))
    }

    fn records_table(store: &MysqlStore) -> String {
        store.table().to_owned()
    }

    fn pool(store: &MysqlStore) -> &sqlx::MySqlPool {
        store.pool()
    }

    fn get_statement(store: &MysqlStore) -> Arc<str> {
        store.sql(Operation::Get).into()
    }

    /// The store's three statements for a new key (the first look and the insert on one connection
    /// of `raw`, the completing update on another, as the store runs `begin` and `complete`),
    /// bound with the same values.
    async fn raw_cycle(
        store: &MysqlStore,
        raw: &RawConnections<MySqlConnection>,
        scope: &Scope,
        key: &Key,
    ) -> Result<(), String> {
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
}
