//! The batch calls against the single calls on every store, in one run: keys claimed and
//! completed per second by callers that each hold a window of keys, as a consumer's partition
//! or fetch does, either one `begin` and one `complete` per key or one `begin_many` and one
//! `complete_many` per window.
//!
//! Servers: `DATABASE_URL` (PostgreSQL, default `postgres://postgres@127.0.0.1:5432/test`),
//! `MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`) and `REDIS_URL` (default
//! `redis://127.0.0.1:6379`); SQLite in a temporary directory. Each store works in a table or
//! a key prefix of its own, dropped or left to expire at the end (every record is kept for no
//! time).

use std::time::Duration;

use idempotency_core::{BeginRequest, Claim, Completion, Fingerprint, Outcome, Store};
use idempotency_mysql::{MysqlOptions, MysqlStore};
use idempotency_postgres::{PostgresOptions, PostgresStore};
use idempotency_redis::RedisStore;
use idempotency_sqlite::{SqliteOptions, SqliteStore};
use sqlx::AssertSqlSafe;

use crate::measure::{alternate_async, cycle_key, cycles_per_second, runtime, store_cycle, versus};

/// Callers at once: a consumer's partitions or concurrent fetches.
const CALLERS: [usize; 2] = [8, 32];

/// Keys in one caller's window (a fetch, a partition's claim-ahead window).
const WINDOW: usize = 32;

pub(crate) fn run(window: Duration, rounds: usize) -> Result<(), String> {
    let runtime = runtime()?;
    runtime.block_on(run_async(window, rounds))
}

async fn run_async(window: Duration, rounds: usize) -> Result<(), String> {
    println!(
        "\n## Batch calls vs single calls: keys claimed and completed per second, {WINDOW} keys per caller's window\n"
    );
    println!(
        "| store | callers | batch calls | single calls | batch / single | batch min–max | single min–max |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let id = std::process::id();

    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let sqlite = SqliteStore::open_with(SqliteOptions::file(dir.path().join("batches.db")))
        .await
        .map_err(|e| e.to_string())?;
    compare("SQLite", &sqlite, window, rounds).await?;

    let url =
        std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let options = PostgresOptions::from_url(&url)
        .and_then(|o| o.schema("idempotency_bench"))
        .and_then(|o| o.table(&format!("batches_{id}")))
        .map_err(|e| e.to_string())?
        .max_connections(40);
    let postgres = PostgresStore::connect_with(options)
        .await
        .map_err(|e| format!("PostgreSQL at {}: {e}", idempotency_core::redact_url(&url)))?;
    compare("PostgreSQL", &postgres, window, rounds).await?;
    drop_table(postgres.pool(), &postgres.table()).await?;

    let url = std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let options = MysqlOptions::from_url(&url)
        .and_then(|o| o.table(&format!("bench_batches_{id}")))
        .map_err(|e| e.to_string())?
        .max_connections(40);
    let mysql = MysqlStore::connect_with(options)
        .await
        .map_err(|e| format!("MySQL at {}: {e}", idempotency_core::redact_url(&url)))?;
    compare("MySQL", &mysql, window, rounds).await?;
    drop_table(mysql.pool(), mysql.table()).await?;

    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let redis = RedisStore::connect(&url)
        .await
        .and_then(|s| s.prefix(&format!("idem-bench-batches:{id}:")))
        .map_err(|e| format!("Redis at {}: {e}", idempotency_core::redact_url(&url)))?;
    compare("Redis", &redis, window, rounds).await
}

async fn drop_table<DB: sqlx::Database>(pool: &sqlx::Pool<DB>, table: &str) -> Result<(), String>
where
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
{
    sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(pool)
        .await
        .map(drop)
        .map_err(|e| e.to_string())
}

/// One table row per caller count: both variants alternated over `rounds`.
async fn compare<S: Store + Clone + 'static>(
    name: &str,
    store: &S,
    window: Duration,
    rounds: usize,
) -> Result<(), String> {
    for callers in CALLERS {
        let rates = alternate_async(rounds, 2, |variant| {
            let store = store.clone();
            async move {
                let windows = if variant == 0 {
                    cycles_per_second(callers, window, move |caller, n| {
                        let store = store.clone();
                        async move { batch_cycle(&store, caller, n).await }
                    })
                    .await?
                } else {
                    cycles_per_second(callers, window, move |caller, n| {
                        let store = store.clone();
                        async move {
                            for at in 0..WINDOW {
                                let (scope, key) = cycle_key(caller, n * WINDOW + at);
                                store_cycle(&store, scope, key).await?;
                            }
                            Ok(())
                        }
                    })
                    .await?
                };
                Ok(windows * WINDOW as f64)
            }
        })
        .await?;
        println!("| {name} | {callers} | {} |", versus(&rates[0], &rates[1]));
    }
    Ok(())
}

/// One window through the batch calls: `begin_many` over the caller's next [`WINDOW`] keys,
/// then `complete_many` of every one, each kept for no time (the next window on the same keys
/// finds them expired and claims them anew).
async fn batch_cycle<S: Store>(store: &S, caller: usize, n: usize) -> Result<(), String> {
    let requests: Vec<BeginRequest> = (0..WINDOW)
        .map(|at| {
            let (scope, key) = cycle_key(caller, n * WINDOW + at);
            BeginRequest::new(scope, key, Fingerprint::of_bytes(b"payload")).retention(Duration::ZERO)
        })
        .collect();
    let mut completions = Vec::with_capacity(WINDOW);
    for claim in store.begin_many(&requests).await {
        match claim.map_err(|e| e.to_string())? {
            Claim::Acquired(held) => {
                completions.push(Completion::new(held, Outcome::empty(), Duration::ZERO));
            }
            other => return Err(format!("a window's key was not acquired: {other:?}")),
        }
    }
    for done in store.complete_many(&completions).await {
        if done.map_err(|e| e.to_string())?.is_lease_lost() {
            return Err("a completion lost its lease".into());
        }
    }
    Ok(())
}
