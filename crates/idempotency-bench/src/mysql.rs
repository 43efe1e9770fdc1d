//! MySQL/MariaDB store: begin→complete cycles per second at 1, 16 and 64 callers against the
//! same SQL issued directly on a pool of connections like the store's own (as many, taken back
//! without a ping: `idempotency_core::connections`), replays against a raw `SELECT` by key, and a
//! same-transaction cycle against the bare business transaction, in one run.
//!
//! The server is `MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`). The bench works in
//! tables of its own (`bench_records_<pid>`, `bench_charges_<pid>`), dropped at the end.

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    Decision, Execution, Fingerprint, Guard, Key, Outcome, Recorded, Scope, Store, Token,
};
use idempotency_mysql::sqlx::{self, AssertSqlSafe, MySqlConnection, MySqlPool};
use idempotency_mysql::{MysqlOptions, MysqlStore, Operation};

use crate::measure::{
    RawConnections, alternate_async, cycle_key, cycles_per_second, runtime, store_cycle, versus,
};

/// Connections for the store's operations, and as many for the raw statements; with the
/// same-transaction rows' connections (the store's sqlx pool, one per caller), under the
/// server's default limit (151 on MariaDB; PostgreSQL's bench keeps the same numbers under 100).
const POOL: u32 = 30;

pub(crate) fn run(window: Duration, rounds: usize) -> Result<(), String> {
    let runtime = runtime()?;
    runtime.block_on(run_async(window, rounds))
}

async fn run_async(window: Duration, rounds: usize) -> Result<(), String> {
    let url = std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let table = format!("bench_records_{}", std::process::id());
    let options = MysqlOptions::from_url(&url)
        .and_then(|o| o.table(&table))
        .map_err(|e| e.to_string())?
        .max_connections(POOL);
    let store = MysqlStore::connect_with(options)
        .await
        .map_err(|e| format!("MySQL at {}: {e}", idempotency_core::redact_url(&url)))?;
    // The raw statements' connections: as many as the store's, taken back the same way.
    let raw = RawConnections::new(store.pool().connect_options(), POOL);
    let target = Target {
        store: store.clone(),
        raw,
    };
    let business = format!("bench_charges_{}", std::process::id());
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {business} (id BIGINT AUTO_INCREMENT PRIMARY KEY, idem_key VARCHAR(255) NOT NULL, cents INT NOT NULL) ENGINE = InnoDB"
    )))
    .execute(store.pool())
    .await
    .map_err(|e| e.to_string())?;

    let settings: Vec<(String, String)> = sqlx::query_as(
        "SELECT CAST(VARIABLE_NAME AS CHAR), CAST(VARIABLE_VALUE AS CHAR) FROM information_schema.GLOBAL_VARIABLES
         WHERE VARIABLE_NAME IN ('VERSION', 'INNODB_FLUSH_LOG_AT_TRX_COMMIT', 'SYNC_BINLOG', 'LOG_BIN',
                                 'INNODB_BUFFER_POOL_SIZE', 'MAX_CONNECTIONS', 'TRANSACTION_ISOLATION', 'TX_ISOLATION')
         ORDER BY VARIABLE_NAME",
    )
    .fetch_all(store.pool())
    .await
    .map_err(|e| e.to_string())?;
    println!("\n## MySQL store vs the same SQL on a pool like the store's: begin→complete cycles/s\n");
    println!(
        "Server settings: {}; {POOL} connections for the store and {POOL} for the raw statements.\n",
        settings
            .iter()
            .map(|(n, v)| format!("{n}={v}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("| callers | store | raw SQL | store / raw | store min–max | raw min–max |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for callers in [1usize, 16, 64] {
        let rates = alternate_async(rounds, 2, |variant| {
            measure(&target, callers, Cycle::of(variant), window)
        })
        .await?;
        let (ours, raw) = (&rates[0], &rates[1]);
        println!("| {callers} | {} |", versus(ours, raw));
    }

    println!(
        "\n## MySQL replays: begin on a completed record vs a raw SELECT by key on a pool like the store's (operations/s)\n"
    );
    println!("| callers | store begin (replay) | raw SELECT | store / raw | store min–max | raw min–max |");
    println!("|---:|---:|---:|---:|---:|---:|");
    let completed = completed_keys(&store, 64 * 16).await?;
    for callers in [1usize, 16, 64] {
        let rates = alternate_async(rounds, 2, |variant| {
            let cycle = if variant == 0 {
                Cycle::Replay
            } else {
                Cycle::RawSelect
            };
            measure_on(&target, callers, cycle, window, Arc::clone(&completed))
        })
        .await?;
        let (ours, raw) = (&rates[0], &rates[1]);
        println!("| {callers} | {} |", versus(ours, raw));
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
            measure(&target, callers, cycle, window)
        })
        .await?;
        let (ours, bare) = (&rates[0], &rates[1]);
        println!("| {callers} | {} |", versus(ours, bare));
    }

    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE {business}; DROP TABLE {}",
        store.table()
    )))
    .execute(store.pool())
    .await
    .map_err(|e| e.to_string())?;
    Ok(())
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

/// `count` keys completed with an hour's retention, for the replay rows.
async fn completed_keys(store: &MysqlStore, count: usize) -> Result<Arc<Vec<(Scope, Key)>>, String> {
    let mut keys = Vec::with_capacity(count);
    for i in 0..count {
        let (scope, key) = (Scope::new("replays").map_err(|e| e.to_string())?, Key::generate());
        let request = idempotency_core::BeginRequest::new(
            scope.clone(),
            key.clone(),
            Fingerprint::of_bytes(b"payload"),
        );
        let idempotency_core::Claim::Acquired(held) =
            store.begin(&request).await.map_err(|e| e.to_string())?
        else {
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

/// The store, and connections like its own for the raw statements.
#[derive(Clone)]
struct Target {
    store: MysqlStore,
    raw: RawConnections<MySqlConnection>,
}

impl Cycle {
    fn of(variant: usize) -> Self {
        if variant == 0 { Self::Store } else { Self::RawSql }
    }
}

async fn measure(target: &Target, callers: usize, cycle: Cycle, window: Duration) -> Result<f64, String> {
    measure_on(target, callers, cycle, window, Arc::new(Vec::new())).await
}

async fn measure_on(
    target: &Target,
    callers: usize,
    cycle: Cycle,
    window: Duration,
    completed: Arc<Vec<(Scope, Key)>>,
) -> Result<f64, String> {
    let Target { store, raw } = target.clone();
    cycles_per_second(callers, window, move |caller, n| {
        let (store, raw, cycle, completed) =
            (store.clone(), raw.clone(), cycle.clone(), Arc::clone(&completed));
        async move {
            // New keys every cycle: a key reused after its zero retention would be an expired
            // record, which `begin` claims with a second statement.
            let (scope, key) = (cycle_key(caller, n).0, Key::generate());
            match &cycle {
                Cycle::Replay => {
                    let (scope, key) = &completed[(caller * 16 + n) % completed.len()];
                    let request = idempotency_core::BeginRequest::new(
                        scope.clone(),
                        key.clone(),
                        Fingerprint::of_bytes(b"payload"),
                    );
                    match store.begin(&request).await.map_err(|e| e.to_string())? {
                        idempotency_core::Claim::Replay(_) => Ok(()),
                        other => Err(format!("not a replay: {other:?}")),
                    }
                }
                Cycle::RawSelect => {
                    let (scope, key) = &completed[(caller * 16 + n) % completed.len()];
                    let get = store.sql(Operation::Get).to_owned();
                    raw.run(async |connection| {
                        sqlx::query(AssertSqlSafe(get))
                            .bind(scope.as_str())
                            .bind(key.as_str())
                            .fetch_optional(connection)
                            .await
                            .map(drop)
                    })
                    .await
                }
                Cycle::Store => store_cycle(&store, scope, key).await,
                Cycle::RawSql => raw_cycle(&store, &raw, &scope, &key).await,
                Cycle::SameTransaction(table) => same_transaction_cycle(&store, table, &scope, &key).await,
                Cycle::BusinessOnly(table) => business_cycle(store.pool(), table, &key).await,
            }
        }
    })
    .await
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

async fn same_transaction_cycle(
    store: &MysqlStore,
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
            move |tx, attempt| {
                Box::pin(async move {
                    sqlx::query(AssertSqlSafe(format!(
                        "INSERT INTO {table} (idem_key, cents) VALUES (?, 1000)"
                    )))
                    .bind(attempt.key().as_str())
                    .execute(&mut **tx)
                    .await
                    .map(drop)
                })
            },
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

/// The business transaction alone: BEGIN, the same insert, COMMIT.
async fn business_cycle(pool: &MySqlPool, table: &str, key: &Key) -> Result<(), String> {
    let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {table} (idem_key, cents) VALUES (?, 1000)"
    )))
    .bind(key.as_str())
    .execute(&mut *tx)
    .await
    .map_err(|e| e.to_string())?;
    tx.commit().await.map_err(|e| e.to_string())
}
