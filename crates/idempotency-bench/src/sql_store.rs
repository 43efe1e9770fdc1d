//! The comparison both SQL stores run (PostgreSQL's and MySQL's): begin→complete cycles per
//! second at 1, 16 and 64 callers against the same SQL issued directly on a pool of
//! connections like the store's own (as many, taken back without a ping:
//! `idempotency_core::connections`), replays against a raw `SELECT` by key, and a
//! same-transaction cycle against the bare business transaction, in one run. An engine gives
//! its statements ([`Engine`]); the tables and their order are the same for both.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use idempotency_core::sql::admin::{Engine as SqlEngine, Param};
use idempotency_core::{
    BeginRequest, Claim, Decision, Execution, Fingerprint, Guard, Key, Outcome, Recorded, Scope, Store,
    StoreError, TransactionalStore, TxFuture,
};
use sqlx::Database;

use crate::measure::{RawConnections, alternate_async, cycle_key, cycles_per_second, store_cycle, versus};

/// What a SQL engine gives the comparison: its store, its server's SQL for the business table
/// and the settings, and the store's statements run beside it.
pub(crate) trait Engine: Send + Sync + 'static {
    /// The store, whose transactions are the database's.
    type Store: TransactionalStore<Transaction = sqlx::Transaction<'static, Self::Database>>
        + Clone
        + Send
        + Sync
        + 'static;

    /// The sqlx database.
    type Database: SqlEngine;

    /// Its name in the tables' titles.
    const NAME: &'static str;

    /// The variable that names the server, and the server when it is not set.
    const URL: (&'static str, &'static str);

    /// Connections for the store's operations, and as many for the raw statements; with the
    /// same-transaction rows' connections (the store's sqlx pool, one per caller), under the
    /// server's default limit.
    const POOL: u32;

    /// Selects the server's settings worth printing: (name, value) text rows.
    const SETTINGS: &'static str;

    /// `CREATE TABLE` of the business table `table`: an `id` the server assigns, a key and
    /// `cents`.
    fn create_business(table: &str) -> String;

    /// Inserts a charge of 1,000 cents for the key (the only parameter) into `table`.
    fn insert_business(table: &str) -> String;

    /// The business table's name for this run.
    fn business_table() -> String;

    /// Connects the store on a records table of this run's own with [`POOL`](Self::POOL)
    /// connections.
    fn connect(url: &str) -> impl Future<Output = Result<Self::Store, String>> + Send;

    /// The store's pool.
    fn pool(store: &Self::Store) -> &sqlx::Pool<Self::Database>;

    /// The store's records table, as its SQL names it.
    fn records_table(store: &Self::Store) -> String;

    /// The store's statement for `get` (parameters scope, key).
    fn get_statement(store: &Self::Store) -> Arc<str>;

    /// The store's statements for a new key, bound with the same values, on connections of
    /// the raw pool as the store takes them for `begin` and `complete`.
    fn raw_cycle(
        store: &Self::Store,
        raw: &RawConnections<<Self::Database as Database>::Connection>,
        scope: &Scope,
        key: &Key,
    ) -> impl Future<Output = Result<(), String>> + Send;
}

/// The store under test, and as many raw connections like its own.
struct Target<E: Engine> {
    store: E::Store,
    raw: RawConnections<<E::Database as Database>::Connection>,
}

impl<E: Engine> Clone for Target<E> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            raw: self.raw.clone(),
        }
    }
}

impl<E: Engine> Target<E> {
    /// Runs `sql` without parameters on a raw connection.
    async fn execute(&self, sql: String) -> Result<(), String> {
        self.raw
            .run(async |connection| E::Database::execute(connection, sql.into(), &[], &[]).await)
            .await
            .map(drop)
    }

    /// The store's `get` statement for `(scope, key)` on a raw connection.
    async fn raw_select(&self, scope: &Scope, key: &Key) -> Result<(), String> {
        let get = E::get_statement(&self.store);
        let params = [Param::Text(Some(scope.as_str())), Param::Text(Some(key.as_str()))];
        self.raw
            .run(async |connection| {
                E::Database::fetch_optional(connection, get, &params, &[0, 1])
                    .await
                    .map(drop)
            })
            .await
    }

    /// The business transaction alone: BEGIN, the same insert, COMMIT, through the store's
    /// own transactions (its pool).
    async fn business_cycle(&self, table: &Arc<str>, key: &Key) -> Result<(), String> {
        let mut tx = self.store.begin_transaction().await.map_err(|e| e.to_string())?;
        insert::<E>(&mut tx, Arc::clone(table), key.clone())
            .await
            .map_err(|e| e.to_string())?;
        self.store.commit(tx).await.map_err(|e| e.to_string())
    }
}

/// Inserts one charge row for `key` into `table` through the record's transaction.
fn insert<'t, E: Engine>(
    tx: &'t mut sqlx::Transaction<'static, E::Database>,
    table: Arc<str>,
    key: Key,
) -> TxFuture<'t, Result<(), sqlx::Error>> {
    Box::pin(async move {
        let params = [Param::Text(Some(key.as_str()))];
        E::Database::execute(&mut **tx, E::insert_business(&table).into(), &params, &[0])
            .await
            .map(drop)
    })
}

/// Runs the comparison on `E`'s server (its variable, or the default): a records table and a
/// business table of the run's own, dropped at the end.
pub(crate) fn run<E: Engine>(window: Duration, rounds: usize) -> Result<(), String> {
    crate::measure::runtime()?.block_on(async {
        let url = std::env::var(E::URL.0).unwrap_or_else(|_| E::URL.1.into());
        let store = E::connect(&url).await?;
        let raw = RawConnections::new(E::pool(&store).connect_options(), E::POOL);
        let target = Target::<E> { store, raw };
        let business = E::business_table();
        target.execute(E::create_business(&business)).await?;
        let rows = target
            .raw
            .run(async |connection| E::Database::fetch_all(connection, E::SETTINGS.into(), &[], &[]).await)
            .await?;
        let settings = rows
            .iter()
            .map(|row| Ok((E::Database::text(row, 0)?, E::Database::text(row, 1)?)))
            .collect::<Result<Vec<_>, StoreError>>()
            .map_err(|e| e.to_string())?;
        compare(&target, &settings, &business, window, rounds).await?;
        target.execute(format!("DROP TABLE {business}")).await?;
        target
            .execute(format!("DROP TABLE {}", E::records_table(&target.store)))
            .await
    })
}

#[derive(Clone)]
enum Cycle {
    Store,
    RawSql,
    SameTransaction(Arc<str>),
    BusinessOnly(Arc<str>),
    /// `begin` on a completed record: a replay.
    Replay,
    /// The store's `get` statement on the same record.
    RawSelect,
}

/// Runs the three comparisons and prints their tables. `settings` are the server's (name,
/// value), `business` the business table.
async fn compare<E: Engine>(
    engine: &Target<E>,
    settings: &[(String, String)],
    business: &str,
    window: Duration,
    rounds: usize,
) -> Result<(), String> {
    let (name, pool) = (E::NAME, E::POOL);
    let settings = settings
        .iter()
        .map(|(n, v)| format!("{n}={v}"))
        .collect::<Vec<_>>()
        .join(", ");
    println!("\n## {name} store vs the same SQL on a pool like the store's: begin→complete cycles/s\n");
    println!(
        "Server settings: {settings}; {pool} connections for the store and {pool} for the raw statements.\n"
    );
    println!("| callers | store | raw SQL | store / raw | store min–max | raw min–max |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for callers in [1usize, 16, 64] {
        let rates = alternate_async(rounds, 2, |variant| {
            let cycle = if variant == 0 { Cycle::Store } else { Cycle::RawSql };
            measure(engine, callers, cycle, window, Arc::default())
        })
        .await?;
        println!("| {callers} | {} |", versus(&rates[0], &rates[1]));
    }

    println!(
        "\n## {name} replays: begin on a completed record vs a raw SELECT by key on a pool like the store's (operations/s)\n"
    );
    println!("| callers | store begin (replay) | raw SELECT | store / raw | store min–max | raw min–max |");
    println!("|---:|---:|---:|---:|---:|---:|");
    let completed = completed_keys(&engine.store, 64 * 16).await?;
    for callers in [1usize, 16, 64] {
        let rates = alternate_async(rounds, 2, |variant| {
            let cycle = if variant == 0 {
                Cycle::Replay
            } else {
                Cycle::RawSelect
            };
            measure(engine, callers, cycle, window, Arc::clone(&completed))
        })
        .await?;
        println!("| {callers} | {} |", versus(&rates[0], &rates[1]));
    }

    println!("\n## Same-transaction cycle vs the bare business transaction (transactions/s)\n");
    println!("| callers | with the record | business only | ratio | with min–max | business min–max |");
    println!("|---:|---:|---:|---:|---:|---:|");
    let business: Arc<str> = business.into();
    for callers in [1usize, 16] {
        let rates = alternate_async(rounds, 2, |variant| {
            let cycle = if variant == 0 {
                Cycle::SameTransaction(Arc::clone(&business))
            } else {
                Cycle::BusinessOnly(Arc::clone(&business))
            };
            measure(engine, callers, cycle, window, Arc::default())
        })
        .await?;
        println!("| {callers} | {} |", versus(&rates[0], &rates[1]));
    }
    Ok(())
}

/// `count` keys completed with an hour's retention, for the replay rows.
async fn completed_keys<S: Store>(store: &S, count: usize) -> Result<Arc<Vec<(Scope, Key)>>, String> {
    let mut keys = Vec::with_capacity(count);
    for i in 0..count {
        let (scope, key) = (Scope::new("replays").map_err(|e| e.to_string())?, Key::generate());
        let request = BeginRequest::new(scope.clone(), key.clone(), Fingerprint::of_bytes(b"payload"));
        let Claim::Acquired(held) = store.begin(&request).await.map_err(|e| e.to_string())? else {
            return Err(format!("replay key {i} was not acquired"));
        };
        let done = store
            .complete(&held, Outcome::new("done"), Duration::from_secs(3600))
            .await
            .map_err(|e| e.to_string())?;
        if done.is_lease_lost() {
            return Err(format!("replay key {i} lost its lease"));
        }
        keys.push((scope, key));
    }
    Ok(Arc::new(keys))
}

async fn measure<E: Engine>(
    engine: &Target<E>,
    callers: usize,
    cycle: Cycle,
    window: Duration,
    completed: Arc<Vec<(Scope, Key)>>,
) -> Result<f64, String> {
    let engine = engine.clone();
    cycles_per_second(callers, window, move |caller, n| {
        let (engine, cycle, completed) = (engine.clone(), cycle.clone(), Arc::clone(&completed));
        async move {
            // New keys every cycle: a key reused after its zero retention would be an expired
            // record, which `begin` claims with a second statement.
            let (scope, key) = (cycle_key(caller, n).0, Key::generate());
            match &cycle {
                Cycle::Replay => {
                    let (scope, key) = &completed[(caller * 16 + n) % completed.len()];
                    let request =
                        BeginRequest::new(scope.clone(), key.clone(), Fingerprint::of_bytes(b"payload"));
                    match engine.store.begin(&request).await.map_err(|e| e.to_string())? {
                        Claim::Replay(_) => Ok(()),
                        other => Err(format!("not a replay: {other:?}")),
                    }
                }
                Cycle::RawSelect => {
                    let (scope, key) = &completed[(caller * 16 + n) % completed.len()];
                    engine.raw_select(scope, key).await
                }
                Cycle::Store => store_cycle(&engine.store, scope, key).await,
                Cycle::RawSql => E::raw_cycle(&engine.store, &engine.raw, &scope, &key).await,
                Cycle::SameTransaction(table) => {
                    same_transaction_cycle::<E>(&engine.store, table, &scope, &key).await
                }
                Cycle::BusinessOnly(table) => engine.business_cycle(table, &key).await,
            }
        }
    })
    .await
}

async fn same_transaction_cycle<E: Engine>(
    store: &E::Store,
    table: &Arc<str>,
    scope: &Scope,
    key: &Key,
) -> Result<(), String> {
    let table = Arc::clone(table);
    // Zero retention, as `request`: the next cycle on this key claims it anew.
    let guard = Guard::new(store.clone()).retention(Duration::ZERO);
    let policy = |written: &Result<(), sqlx::Error>| match written {
        Ok(()) => Decision::Complete(Outcome::empty()),
        Err(_) => Decision::Release,
    };
    let run = guard
        .run_in_transaction(
            scope.clone(),
            key.clone(),
            Fingerprint::of_bytes(b"payload"),
            policy,
            move |tx, attempt| insert::<E>(tx, table, attempt.key().clone()),
        )
        .await
        .map_err(|e| e.to_string())?;
    match run {
        Execution::Executed {
            value: Ok(()),
            recorded: Recorded::Completed { .. },
            ..
        } => Ok(()),
        other => Err(format!("a same-transaction cycle did not execute: {other:?}")),
    }
}
