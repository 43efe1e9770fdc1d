//! What the inbox and outbox tests share: the server, throwaway tables, a ledger table.

#![allow(dead_code, unreachable_pub)] // each test crate uses a part

use std::future::Future;

use idempotency_outbox::{InboxHandler, InboxMessage, Tables};
use idempotency_postgres::PgTransaction;
use idempotency_postgres::sqlx::{self, AssertSqlSafe, PgPool};

/// The schema every test table lives in.
pub const SCHEMA: &str = "idempotency_outbox_tests";

/// The server: `DATABASE_URL`, or the loopback default `scripts/services` starts.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// A pool on the server; panics when it is unreachable.
pub async fn pool() -> PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(16)
        .connect(&database_url())
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {} is needed for this test: {e}", database_url()))
}

/// Fresh inbox and outbox tables, migrated, and a ledger table (`key`, `consumer`, no unique
/// constraint: a double would show as two rows). Tables of runs more than an hour old are
/// dropped here.
pub async fn fresh(pool: &PgPool) -> (Tables, String) {
    let suffix = idempotency_testkit::sql::fresh_suffix();
    let tables = Tables::default()
        .schema(SCHEMA)
        .unwrap()
        .inbox(&format!("inbox_{suffix}"))
        .unwrap()
        .outbox(&format!("outbox_{suffix}"))
        .unwrap();
    tables.migrate(pool).await.unwrap();
    let ledger = format!("{SCHEMA}.ledger_{suffix}");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {ledger} (key text NOT NULL, consumer text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"
    )))
    .execute(pool)
    .await
    .unwrap();
    drop_old_tables(pool).await;
    (tables, ledger)
}

/// Drops the tables of [`SCHEMA`] of runs more than an hour old.
async fn drop_old_tables(pool: &PgPool) {
    let tables: Vec<String> =
        sqlx::query_scalar("SELECT tablename::text FROM pg_tables WHERE schemaname = $1")
            .bind(SCHEMA)
            .fetch_all(pool)
            .await
            .unwrap();
    idempotency_testkit::sql::drop_outdated(pool, &tables, |table| format!("{SCHEMA}.{table}")).await;
}

/// Rows in the ledger, and distinct keys among them.
pub async fn ledger_counts(pool: &PgPool, ledger: &str) -> (i64, i64) {
    sqlx::query_as(AssertSqlSafe(format!(
        "SELECT count(*), count(DISTINCT key) FROM {ledger}"
    )))
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Writes one ledger row per message, in the inbox's transaction.
pub struct LedgerHandler {
    pub ledger: String,
}

impl InboxHandler for LedgerHandler {
    async fn handle(
        &self,
        message: &InboxMessage,
        tx: &mut PgTransaction,
    ) -> Result<(), idempotency_consumer::HandlerError> {
        record(tx, &self.ledger, &message.key).await
    }
}

/// Writes `key`'s ledger row through `tx`.
pub async fn record(
    tx: &mut PgTransaction,
    ledger: &str,
    key: &str,
) -> Result<(), idempotency_consumer::HandlerError> {
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {ledger} (key, consumer) VALUES ($1, 'inbox')"
    )))
    .bind(key)
    .execute(&mut **tx)
    .await
    .map_err(idempotency_consumer::HandlerError::retry)?;
    Ok(())
}

/// A relay or an inbox worker running in the background until [`stop`](Self::stop).
pub struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), idempotency_outbox::OutboxError>>,
}

impl Running {
    /// Spawns `run` (a `run_until`), with the future that completes when stopped.
    pub fn spawn<F, R>(run: F) -> Self
    where
        F: FnOnce(std::pin::Pin<Box<dyn Future<Output = ()> + Send>>) -> R,
        R: Future<Output = Result<(), idempotency_outbox::OutboxError>> + Send + 'static,
    {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(run(Box::pin(async { drop(stopped.await) })));
        Self { stop, task }
    }

    /// Stops it and waits for the round in progress; panics if it failed.
    pub async fn stop(self) {
        self.stop.send(()).unwrap();
        self.task.await.unwrap().unwrap();
    }
}

/// Two relays made by `relay` take over from `killed` (a relay hung in the middle of a
/// round), which is then killed as a crash would; once the outbox of `tables` on `database`
/// has nothing pending, both stop. What the killed relay held, the others publish.
pub async fn take_over<P: idempotency_outbox::Publisher + 'static>(
    database: idempotency_outbox::Database,
    tables: &Tables,
    killed: tokio::task::JoinHandle<Result<(), idempotency_outbox::OutboxError>>,
    relay: impl Fn() -> idempotency_outbox::Relay<P>,
) {
    let relays: Vec<_> = (0..2)
        .map(|_| {
            let relay = relay();
            Running::spawn(|stopped| async move { relay.run_until(stopped).await })
        })
        .collect();
    killed.abort();
    let _ = killed.await;
    idempotency_testkit::eventually(std::time::Duration::from_secs(120), "the outbox drained", || {
        let (database, tables) = (database.clone(), tables.clone());
        async move {
            idempotency_outbox::outbox_stats(database, &tables)
                .await
                .unwrap()
                .pending
                == 0
        }
    })
    .await;
    for running in relays {
        running.stop().await;
    }
}
