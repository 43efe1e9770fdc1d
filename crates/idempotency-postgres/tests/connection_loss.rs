//! The server goes away mid-run (`idempotency_testkit::outage`): the store reaches PostgreSQL
//! through a loopback proxy that cuts every connection and refuses new ones for 1.5 s; every
//! key still completes once, through the guard and in same-transaction mode.

mod common;

use std::sync::Arc;

use idempotency_core::{Attempt, TxFuture};
use idempotency_postgres::{PgTransaction, PostgresStore};
use idempotency_testkit::outage::BoxError;
use idempotency_testkit::{TcpProxy, outage};
use sqlx::AssertSqlSafe;

/// A store on a table of its own that reaches the server through `proxy`.
async fn proxied_store(proxy: &TcpProxy) -> PostgresStore {
    common::proxied(&common::fresh_store().await, proxy, 8).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_gives_errors_then_correct_results_and_no_duplicates() {
    let proxy = common::start_proxy().await;
    outage::guarded_run(proxied_store(&proxy).await, &proxy).await;
}

fn write_row<'t>(
    tx: &'t mut PgTransaction,
    attempt: Attempt,
    table: Arc<str>,
) -> TxFuture<'t, Result<(), BoxError>> {
    Box::pin(async move {
        sqlx::query(AssertSqlSafe(format!("INSERT INTO {table} (key) VALUES ($1)")))
            .bind(attempt.key().as_str())
            .execute(&mut **tx)
            .await
            .map(drop)
            .map_err(BoxError::from)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_in_same_transaction_mode_writes_each_row_once() {
    let proxy = common::start_proxy().await;
    let store = proxied_store(&proxy).await;
    let table = format!("{}_rows", store.table());
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE TABLE {table} (key text NOT NULL)")))
        .execute(store.pool())
        .await
        .unwrap();
    let pool = store.pool().clone();
    let count = format!("SELECT key, count(*) FROM {table} GROUP BY key");
    outage::transactional_run(store, &proxy, &table, write_row, async || {
        sqlx::query_as(AssertSqlSafe(count))
            .fetch_all(&pool)
            .await
            .unwrap()
    })
    .await;
}
