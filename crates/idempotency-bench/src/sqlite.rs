//! SQLite store: begin→complete cycles per second against the same SQL statements issued
//! directly, on the same connection (the store's own worker thread), in the same run.
//!
//! A store cycle is `begin` then `complete`: two round trips to the worker thread, each an
//! `IMMEDIATE` transaction of `SELECT` + upsert. The raw cycle sends the same two transactions
//! with the same statements ([`idempotency_sqlite::sql`]) and precomputed values; the ratio is
//! what the store's decoding, state machine and bookkeeping cost on top of SQLite.

use std::time::Duration;

use idempotency_core::{Fingerprint, Key, Scope, Token};
use idempotency_sqlite::rusqlite::{OptionalExtension, TransactionBehavior, params};
use idempotency_sqlite::{SqliteOptions, SqliteStore, Synchronous, sql};

use crate::measure::{alternate, cycle_key, cycles_per_second, runtime, store_cycle, versus};

pub(crate) fn run(window: Duration, rounds: usize) -> Result<(), String> {
    let runtime = runtime()?;
    println!("\n## SQLite store vs the same SQL on the same connection: begin→complete cycles/s\n");
    println!("| synchronous | callers | store | raw SQL | store / raw | store min–max | raw min–max |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for synchronous in [Synchronous::Normal, Synchronous::Full] {
        for callers in [1usize, 16] {
            let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
            let store = runtime
                .block_on(SqliteStore::open_with(
                    SqliteOptions::file(dir.path().join("bench.db")).synchronous(synchronous),
                ))
                .map_err(|e| e.to_string())?;
            let rates = alternate(rounds, 2, |variant| {
                runtime.block_on(measure(&store, callers, variant == 0, window))
            })?;
            let (store_rate, raw_rate) = (&rates[0], &rates[1]);
            println!(
                "| {synchronous:?} | {callers} | {} |",
                versus(store_rate, raw_rate)
            );
        }
    }
    run_group_commit(&runtime, window, rounds)
}

/// The store with group commit (the default `max_batch`) against the same store with one
/// transaction per transition (`max_batch=1`), `synchronous=FULL`, alternating in one run.
fn run_group_commit(
    runtime: &tokio::runtime::Runtime,
    window: Duration,
    rounds: usize,
) -> Result<(), String> {
    println!(
        "\n## SQLite group commit vs one transaction per transition (synchronous=FULL): begin→complete cycles/s\n"
    );
    println!("| callers | group commit | one transaction each | ratio | group min–max | one-each min–max |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for callers in [1usize, 16, 64] {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let open = |name: &str, batch: usize| {
            runtime
                .block_on(SqliteStore::open_with(
                    SqliteOptions::file(dir.path().join(name)).max_batch(batch),
                ))
                .map_err(|e| e.to_string())
        };
        let grouped = open("grouped.db", idempotency_sqlite::DEFAULT_MAX_BATCH)?;
        let single = open("single.db", 1)?;
        let rates = alternate(rounds, 2, |variant| {
            let store = if variant == 0 { &grouped } else { &single };
            runtime.block_on(measure(store, callers, true, window))
        })?;
        println!("| {callers} | {} |", versus(&rates[0], &rates[1]));
    }
    Ok(())
}

async fn measure(
    store: &SqliteStore,
    callers: usize,
    through_store: bool,
    window: Duration,
) -> Result<f64, String> {
    let store = store.clone();
    cycles_per_second(callers, window, move |caller, n| {
        let store = store.clone();
        async move {
            let (scope, key) = cycle_key(caller, n);
            if through_store {
                store_cycle(&store, scope, key).await
            } else {
                raw_cycle(&store, &scope, &key).await
            }
        }
    })
    .await
}

/// The same two transactions as a store cycle, with the values computed up front.
async fn raw_cycle(store: &SqliteStore, scope: &Scope, key: &Key) -> Result<(), String> {
    let fingerprint = Fingerprint::of_bytes(b"payload").as_bytes().to_vec();
    let token = Token::random().to_bytes().to_vec();
    for completed in [false, true] {
        let (scope, key, fingerprint, token) = (
            scope.to_string(),
            key.to_string(),
            fingerprint.clone(),
            token.clone(),
        );
        store
            .with_connection(move |connection| {
                let now = idempotency_core::Clock::now(&idempotency_core::SystemClock).unix_millis();
                let tx = connection.transaction_with_behavior(TransactionBehavior::Immediate)?;
                tx.prepare_cached(sql::SELECT_RECORD)?
                    .query_row(params![scope, key], |_| Ok(()))
                    .optional()?;
                let empty: &[u8] = &[];
                tx.prepare_cached(sql::UPSERT_RECORD)?.execute(params![
                    scope,
                    key,
                    fingerprint,
                    1,
                    now,
                    now,
                    token,
                    completed,
                    (!completed).then_some(now),
                    (!completed).then_some(now + 60_000),
                    completed.then_some(now),
                    completed.then_some(empty),
                ])?;
                tx.commit()
            })
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}
