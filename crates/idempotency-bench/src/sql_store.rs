//! The comparison both SQL stores run (PostgreSQL's and MySQL's): begin→complete cycles per
//! second at 1, 16 and 64 callers against the same SQL issued directly on a pool of
//! connections like the store's own (as many, taken back without a ping:
//! `idempotency_core::connections`), replays against a raw `SELECT` by key, and a
//! same-transaction cycle against the bare business transaction, in one run. An engine gives
//! its statements ([`Engine`]); the tables and their order are the same for both.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    BeginRequest, Claim, Decision, Execution, Fingerprint, Guard, Key, Outcome, Recorded, Scope, Store,
    TransactionalStore, TxFuture,
};

use crate::measure::{alternate_async, cycle_key, cycles_per_second, store_cycle, versus};

/// What a SQL engine gives the comparison: its store and the statements run beside it.
pub(crate) trait Engine: Clone + Send + Sync + 'static {
    /// The store.
    type Store: TransactionalStore + Clone + Send + Sync + 'static;

    /// Its name in the tables' titles.
    const NAME: &'static str;

    /// The store under test.
    fn store(&self) -> &Self::Store;

    /// The store's statements for a new key, bound with the same values, on connections of
    /// the raw pool as the store takes them for `begin` and `complete`.
    fn raw_cycle(&self, scope: &Scope, key: &Key) -> impl Future<Output = Result<(), String>> + Send;

    /// The store's `get` statement for `(scope, key)` on a connection of the raw pool.
    fn raw_select(&self, scope: &Scope, key: &Key) -> impl Future<Output = Result<(), String>> + Send;

    /// Inserts one charge row for `key` into `table` through the record's transaction.
    fn insert<'t>(
        tx: &'t mut <Self::Store as TransactionalStore>::Transaction,
        table: Arc<str>,
        key: Key,
    ) -> TxFuture<'t, Result<(), sqlx::Error>>;

    /// The business transaction alone: BEGIN, the same insert, COMMIT, through the store's
    /// own transactions (its pool).
    fn business_cycle(&self, table: &Arc<str>, key: &Key) -> impl Future<Output = Result<(), String>> + Send {
        async move {
            let store = self.store();
            let mut tx = store.begin_transaction().await.map_err(|e| e.to_string())?;
            Self::insert(&mut tx, Arc::clone(table), key.clone())
                .await
                .map_err(|e| e.to_string())?;
            store.commit(tx).await.map_err(|e| e.to_string())
        }
    }
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
/// value), `pool` is the connections on each side, `business` the business table.
pub(crate) async fn compare<E: Engine>(
    engine: &E,
    settings: &[(String, String)],
    pool: u32,
    business: &str,
    window: Duration,
    rounds: usize,
) -> Result<(), String> {
    let name = E::NAME;
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
    let completed = completed_keys(engine.store(), 64 * 16).await?;
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
    engine: &E,
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
                    match engine.store().begin(&request).await.map_err(|e| e.to_string())? {
                        Claim::Replay(_) => Ok(()),
                        other => Err(format!("not a replay: {other:?}")),
                    }
                }
                Cycle::RawSelect => {
                    let (scope, key) = &completed[(caller * 16 + n) % completed.len()];
                    engine.raw_select(scope, key).await
                }
                Cycle::Store => store_cycle(engine.store(), scope, key).await,
                Cycle::RawSql => engine.raw_cycle(&scope, &key).await,
                Cycle::SameTransaction(table) => {
                    same_transaction_cycle::<E>(engine.store(), table, &scope, &key).await
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
            move |tx, attempt| E::insert(tx, table, attempt.key().clone()),
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
