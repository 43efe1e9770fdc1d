//! Shared test setup: the server URL and throwaway tables.

#![allow(dead_code, unreachable_pub)] // each test crate uses a part

use std::time::Duration;

use idempotency_mysql::sqlx;
use idempotency_mysql::{MysqlOptions, MysqlStore};
use idempotency_testkit::TcpProxy;

/// The server the tests use: `MYSQL_URL`, or the loopback default that `scripts/services`
/// starts (MariaDB, root without a password, database `test`).
pub fn database_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// A store on a table of its own (`t_…`, named by `idempotency_testkit::sql::fresh_table`:
/// tables of runs more than an hour old are dropped here). Panics when the server is unreachable: a test that cannot
/// reach its server fails.
pub async fn fresh_store() -> MysqlStore {
    store_on(&idempotency_testkit::sql::fresh_table("t"), 16).await
}

/// A store on `table` (created if missing) with at most `max_connections`.
pub async fn store_on(table: &str, max_connections: u32) -> MysqlStore {
    let options = MysqlOptions::from_url(&database_url())
        .unwrap()
        .table(table)
        .unwrap()
        .max_connections(max_connections);
    let store = MysqlStore::connect_with(options)
        .await
        .unwrap_or_else(|e| panic!("MySQL/MariaDB at {} is needed for this test: {e}", database_url()));
    drop_old_tables(store.pool()).await;
    store
}

/// Drops the tests' tables (`t_…`: the database is shared) of runs more than an hour old.
async fn drop_old_tables(pool: &sqlx::MySqlPool) {
    let mut tables: Vec<String> = sqlx::query_scalar(
        "SELECT CAST(TABLE_NAME AS CHAR) FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE()",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    tables.retain(|table| table.starts_with("t_"));
    idempotency_testkit::sql::drop_outdated(pool, &tables, str::to_owned).await;
}

/// A loopback proxy in front of the server, to cut its connections and take it away.
pub async fn start_proxy() -> TcpProxy {
    TcpProxy::in_front_of(&database_url()).await.unwrap().0
}

/// A second store on `store`'s table that reaches the server through `proxy`, with at most
/// `max_connections`. The pool waits at most 300 ms for a connection, so an outage shows as
/// errors rather than as waiting.
pub async fn proxied(store: &MysqlStore, proxy: &TcpProxy, max_connections: u32) -> MysqlStore {
    proxied_waiting(store, proxy, max_connections, Duration::from_millis(300)).await
}

/// [`proxied`], waiting at most `wait` for a connection (through a slow proxy, opening one
/// takes several round trips).
pub async fn proxied_waiting(
    store: &MysqlStore,
    proxy: &TcpProxy,
    max_connections: u32,
    wait: Duration,
) -> MysqlStore {
    let options = proxied_options(store, proxy)
        .max_connections(max_connections)
        .acquire_timeout(wait);
    MysqlStore::connect_with(options).await.unwrap()
}

/// The options of a store on `store`'s table that reaches the server through `proxy`.
pub fn proxied_options(store: &MysqlStore, proxy: &TcpProxy) -> MysqlOptions {
    let mut options = MysqlOptions::from_url(&database_url())
        .unwrap()
        .table(store.table())
        .unwrap();
    options.connect = options
        .connect
        .clone()
        .host("127.0.0.1")
        .port(proxy.addr().port());
    options
}

/// MySQL's SQL for the test kit's business rows (`idempotency_testkit::sql`).
pub struct Sql;

impl idempotency_testkit::sql::Dialect for Sql {
    type Database = sqlx::MySql;
    type Store = MysqlStore;

    const ID_COLUMN: &'static str = "BIGINT AUTO_INCREMENT PRIMARY KEY";
    const RETURNING_ID: &'static str = "";
    const INSERTED_ID: &'static str = "SELECT CAST(LAST_INSERT_ID() AS SIGNED)";
    const CONNECTION_ID: &'static str = "SELECT CAST(CONNECTION_ID() AS SIGNED)";
    const KEY_COLUMN: &'static str = "`key`";

    fn url() -> String {
        database_url()
    }

    fn pool(store: &MysqlStore) -> &sqlx::MySqlPool {
        store.pool()
    }

    fn records_table(store: &MysqlStore) -> String {
        store.table().to_owned()
    }

    fn placeholder(_: usize) -> String {
        "?".into()
    }

    fn kill(id: i64) -> String {
        format!("KILL {id}")
    }
}
