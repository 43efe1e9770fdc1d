//! Shared test setup: the server URL and throwaway tables.

#![allow(dead_code, unreachable_pub)] // each test crate uses a part

use idempotency_postgres::sqlx;
use idempotency_postgres::{PostgresOptions, PostgresStore};
use idempotency_testkit::TcpProxy;

/// The server the tests use: `DATABASE_URL`, or the loopback default that `scripts/services`
/// starts.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// The schema every test table lives in.
pub const SCHEMA: &str = "idempotency_tests";

/// A store on a table of its own. Tables are named after their creation time; tables of runs
/// more than an hour old are dropped here, so a crashed run leaves nothing behind for long.
/// Panics when the server is unreachable: a test that cannot reach its server fails.
pub async fn fresh_store() -> PostgresStore {
    let table = idempotency_testkit::sql::fresh_table("t");
    let options = PostgresOptions::from_url(&database_url())
        .unwrap()
        .schema(SCHEMA)
        .unwrap()
        .table(&table)
        .unwrap()
        .max_connections(16);
    let store = PostgresStore::connect_with(options)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {} is needed for this test: {e}", database_url()));
    drop_old_tables(store.pool()).await;
    store
}

/// Drops the tables of [`SCHEMA`] of runs more than an hour old.
async fn drop_old_tables(pool: &sqlx::PgPool) {
    let tables: Vec<String> =
        sqlx::query_scalar("SELECT tablename::text FROM pg_tables WHERE schemaname = $1")
            .bind(SCHEMA)
            .fetch_all(pool)
            .await
            .unwrap();
    idempotency_testkit::sql::drop_outdated(pool, &tables, |table| format!("{SCHEMA}.{table}")).await;
}

/// A loopback proxy in front of the server, to cut its connections and take it away.
pub async fn start_proxy() -> TcpProxy {
    TcpProxy::in_front_of(&database_url()).await.unwrap().0
}

/// A second store on `store`'s table that reaches the server through `proxy`, with at most
/// `max_connections`. The pool waits at most 300 ms for a connection, so an outage shows as
/// errors rather than as waiting.
pub async fn proxied(store: &PostgresStore, proxy: &TcpProxy, max_connections: u32) -> PostgresStore {
    proxied_waiting(
        store,
        proxy,
        max_connections,
        std::time::Duration::from_millis(300),
    )
    .await
}

/// [`proxied`], waiting at most `wait` for a connection (through a slow proxy, opening one
/// takes several round trips).
pub async fn proxied_waiting(
    store: &PostgresStore,
    proxy: &TcpProxy,
    max_connections: u32,
    wait: std::time::Duration,
) -> PostgresStore {
    let options = proxied_options(store, proxy)
        .max_connections(max_connections)
        .acquire_timeout(wait);
    PostgresStore::connect_with(options).await.unwrap()
}

/// The options of a store on `store`'s table that reaches the server through `proxy`.
pub fn proxied_options(store: &PostgresStore, proxy: &TcpProxy) -> PostgresOptions {
    let qualified = store.table();
    let (schema, table) = qualified.split_once('.').unwrap();
    let mut options = PostgresOptions::from_url(&database_url())
        .unwrap()
        .schema(schema)
        .unwrap()
        .table(table)
        .unwrap();
    options.connect = options
        .connect
        .clone()
        .host("127.0.0.1")
        .port(proxy.addr().port());
    options
}

/// PostgreSQL's SQL for the test kit's business rows (`idempotency_testkit::sql`).
pub struct Sql;

impl idempotency_testkit::sql::Dialect for Sql {
    type Database = sqlx::Postgres;
    type Store = PostgresStore;

    const ID_COLUMN: &'static str = "bigserial PRIMARY KEY";
    const RETURNING_ID: &'static str = " RETURNING id";
    const INSERTED_ID: &'static str = "SELECT lastval()";
    const CONNECTION_ID: &'static str = "SELECT pg_backend_pid()::int8";
    const KEY_COLUMN: &'static str = "key";

    fn url() -> String {
        database_url()
    }

    fn pool(store: &PostgresStore) -> &sqlx::PgPool {
        store.pool()
    }

    fn records_table(store: &PostgresStore) -> String {
        store.table()
    }

    fn placeholder(n: usize) -> String {
        format!("${n}")
    }

    fn kill(id: i64) -> String {
        format!("SELECT pg_terminate_backend({id})::int::int8")
    }
}
