//! The pooled store.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::machine::{self, Effect};
use idempotency_core::sql::admin;
use idempotency_core::sql::{self as sql_rows, Pools, Sizes};
use idempotency_core::{
    Access, BeginRequest, Claim, Completion, ErrorKind, Fenced, Held, Key, Outcome, Record, RecordState,
    Scope, Store, StoreError, Timestamp, Token, begin_each, complete_each, failed_batch, stored_millis,
};
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{AssertSqlSafe, Row};

use crate::batch;
use crate::error::map_error;
use crate::options::PostgresOptions;
use crate::sql::{self, Statements};

/// An operation whose SQL [`PostgresStore::sql`] shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Operation {
    /// Creating the schema, table and indexes.
    Migrate,
    /// `begin`'s first look, a plain read of the record with the server's time: `$1` scope,
    /// `$2` key. A replay, an in-flight conflict and a mismatch are answered from it.
    Peek,
    /// `begin` when the first look found nothing (inserts the new key; returns a record a
    /// concurrent caller committed meanwhile, unlocked and unwritten): `$1` scope, `$2` key,
    /// `$3` fingerprint, `$4` token, `$5` lease ms, `$6` retention ms.
    Begin,
    /// `begin`'s claim of an expired record or a takeover, under the row lock: the same
    /// parameters as [`Operation::Begin`].
    Claim,
    /// `complete`: `$1` scope, `$2` key, `$3` token, `$4` outcome, `$5` retention ms.
    Complete,
    /// `release`: `$1` scope, `$2` key, `$3` token, `$4` [`Token::NONE`].
    Release,
    /// `extend`: `$1` scope, `$2` key, `$3` token, `$4` lease ms.
    Extend,
    /// `begin_many`'s one statement: arrays of scopes, keys, fingerprints, tokens, lease ms and
    /// retention ms (`$1`–`$6`, no key twice). Inserts the new keys and returns the others'
    /// records unwritten; a record that needs a claim is then claimed alone.
    BeginMany,
    /// `complete_many`'s one statement: arrays of scopes, keys, tokens, outcomes and
    /// retention ms (`$1`–`$5`, no key twice).
    CompleteMany,
    /// `get`: `$1` scope, `$2` key.
    Get,
    /// `stats`: `$1` scope or NULL.
    Stats,
    /// `list`: `$1` scope, `$2` completed, `$3` older-than ms, `$4`/`$5` resume after, `$6` limit.
    List,
    /// `purge_expired`: `$1` limit.
    PurgeExpired,
}

/// How often `begin` runs its statement again when a concurrent commit hid the record from the
/// statement's snapshot (each retry sees a newer snapshot, so one is almost always enough).
const BEGIN_TRIES: u32 = 8;

/// The PostgreSQL store. Clones share the pool.
///
/// Every operation is one statement (one round trip) decided by the server with its `now()`;
/// [`PostgresStore::sql`] shows each statement. `begin` on an existing record reads it without
/// a lock or a write; only a takeover or an expired record takes a second statement.
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pools: Pools<sqlx::Postgres>,
    sql: Arc<Statements>,
    /// Keys claimed, and whether the table's statistics were checked (see [`Statistics`]).
    statistics: Arc<Statistics>,
}

/// How many keys the store claims (`begin`, `begin_many`) before it makes sure its table's
/// planner statistics describe it.
const ANALYZE_AFTER: u64 = 1_000;

/// How many times its size at the last `VACUUM` or `ANALYZE` a table must have outgrown for its
/// statistics to count as out of date.
const STALE_GROWTH: i64 = 4;

/// The size, in pages, below which a table's statistics never count as out of date by growth.
const STALE_FLOOR_PAGES: i64 = 8;

/// A table the store has just created has no planner statistics until autovacuum first analyzes
/// it (up to a minute, or never where autovacuum is off), and a table vacuumed or analyzed while
/// empty has statistics that say so while it grows. Meanwhile PostgreSQL plans for the table it
/// believes in, and each connection keeps the plan it made for a statement: planned on a new
/// table, the batch statements read the table through its expiry index, every record of it for
/// every batch, while the table grew (a guarded consumer on a new table fell from 13,000 to
/// 2,000 messages/s within 160,000 messages); planned on a table analyzed while empty, every
/// statement that finds a record by key scans the whole table. After [`ANALYZE_AFTER`] keys
/// claimed the store (in its own transactions or the caller's) runs `ANALYZE` once if the table
/// was never analyzed or has grown past [`STALE_GROWTH`] times the size its statistics describe;
/// that also makes every connection plan its statements again. A role that does not own the
/// table is only warned, by the server, and the store logs it.
#[derive(Debug, Default)]
struct Statistics {
    /// Keys claimed through this store (`begin`, `begin_many`, and their same-transaction forms).
    claimed: AtomicU64,
    /// Whether the check ran.
    checked: AtomicBool,
}

impl PostgresStore {
    /// Connects to the database a `postgres://` URL names, with the default table
    /// (`public.idempotency_records`), and creates the schema if needed.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::InvalidConfig`] for a malformed URL, a missing database or rejected
    /// credentials; [`ErrorKind::Unavailable`] when the server cannot be reached.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(PostgresOptions::from_url(url)?).await
    }

    /// Connects with `options`.
    ///
    /// # Errors
    ///
    /// As [`PostgresStore::connect`].
    pub async fn connect_with(options: PostgresOptions) -> Result<Self, StoreError> {
        let mut connect = options.connect.clone();
        if options.access != Access::Create && connect.get_database().is_none() {
            return Err(StoreError::new(
                ErrorKind::InvalidConfig,
                "the PostgreSQL URL names no database (the server would pick the user's own): \
                 name the database the store lives in, postgres://HOST/DATABASE",
            ));
        }
        if options.access == Access::ReadOnly {
            connect = connect.options([("default_transaction_read_only", "on")]);
        }
        let pool = idempotency_core::sql::pool_options::<sqlx::Postgres>(
            options.max_connections,
            options.acquire_timeout,
        )
        .connect_with(connect)
        .await
        .map_err(|e| map_error("connect to PostgreSQL", e))?;
        let store = Self::from_pool(pool, &options);
        options.prepare(store.check_table(), store.migrate()).await?;
        Ok(store)
    }

    /// Refuses a database without the records table, reading only.
    async fn check_table(&self) -> Result<(), StoreError> {
        let table = self.table();
        let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(self.quoted_table())
            .fetch_one(&self.pools.pool)
            .await
            .map_err(|e| map_error("look for the records table", e))?;
        if exists {
            return Ok(());
        }
        let database: Option<String> = sqlx::query_scalar("SELECT current_database()::text")
            .fetch_one(&self.pools.pool)
            .await
            .ok();
        Err(StoreError::new(
            ErrorKind::Schema,
            format!(
                "database {} has no table {table}; nothing was created (`idem migrate` creates it)",
                database.unwrap_or_else(|| "?".into())
            ),
        ))
    }

    /// A store on a pool the application already has (no connection is made, no schema is
    /// created: call [`PostgresStore::migrate`] if needed).
    #[must_use]
    pub fn from_pool(pool: PgPool, options: &PostgresOptions) -> Self {
        // As many connections of its own as the pool has.
        let sizes = Sizes {
            max: pool.options().get_max_connections(),
            ..options.sizes()
        };
        let connect = pool.connect_options();
        Self {
            pools: Pools::new("postgres", pool, connect, None, sizes, map_error),
            sql: Arc::new(Statements::new(&options.schema, &options.table)),
            statistics: Arc::default(),
        }
    }

    /// The pool, for the application's own queries (same-transaction mode begins its
    /// transactions here).
    #[must_use]
    pub fn pool(&self) -> &PgPool {
        &self.pools.pool
    }

    /// `schema.table` of the records table.
    #[must_use]
    pub fn table(&self) -> String {
        format!("{}.{}", self.sql.schema, self.sql.table)
    }

    /// Creates the schema, the records table and its indexes if they are missing, under an
    /// advisory lock so that many instances starting at once do not race. Safe to run at every
    /// start (`idem migrate` runs it).
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Schema`] when the table exists from a newer version; the server's error
    /// (for example a role without `CREATE`) otherwise.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut tx = self
            .pools
            .pool
            .begin()
            .await
            .map_err(|e| map_error("begin the migration", e))?;
        // One lock for every migration, not one per table: `CREATE SCHEMA IF NOT EXISTS` and
        // `CREATE TABLE IF NOT EXISTS` race on the catalog's unique indexes when two sessions
        // run them at once, even for different tables of one schema.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idempotency-migrate'))")
            .execute(&mut *tx)
            .await
            .map_err(|e| map_error("lock the migration", e))?;
        let comment: Option<String> =
            sqlx::query_scalar("SELECT obj_description(to_regclass($1), 'pg_class')")
                .bind(self.table())
                .fetch_one(&mut *tx)
                .await
                .map_err(|e| map_error("read the schema version", e))?;
        if let Some(comment) = comment.as_deref() {
            let current = sql_rows::version_comment(sql::SCHEMA_VERSION);
            if comment != current {
                return Err(StoreError::new(
                    ErrorKind::Schema,
                    format!(
                        "{} is marked {comment:?}; this version writes {current:?} (a newer version created it, or it is another application's table)",
                        self.table()
                    ),
                ));
            }
        }
        sqlx::raw_sql(AssertSqlSafe(Arc::clone(&self.sql.create)))
            .execute(&mut *tx)
            .await
            .map_err(|e| map_error("create the records table", e))?;
        tx.commit()
            .await
            .map_err(|e| map_error("commit the migration", e))?;
        Ok(())
    }

    pub(crate) fn statements(&self) -> &Statements {
        &self.sql
    }

    /// The SQL this store runs for `operation`, for `EXPLAIN`, a DBA's review, or issuing the same
    /// statement directly (the benchmark's baseline does). Parameters are documented in the
    /// crate's `sql` module source; every value is a bind parameter.
    #[must_use]
    pub fn sql(&self, operation: Operation) -> &str {
        match operation {
            Operation::Migrate => &self.sql.create,
            Operation::Peek => &self.sql.peek,
            Operation::Begin => &self.sql.begin,
            Operation::Claim => &self.sql.claim,
            Operation::Complete => &self.sql.complete,
            Operation::Release => &self.sql.admin.release,
            Operation::Extend => &self.sql.extend,
            Operation::BeginMany => &self.sql.begin_many,
            Operation::CompleteMany => &self.sql.complete_many,
            Operation::Get => &self.sql.admin.get,
            Operation::Stats => &self.sql.admin.stats,
            Operation::List => &self.sql.admin.list,
            Operation::PurgeExpired => &self.sql.admin.purge,
        }
    }
}

/// `begin` on one connection (a pooled one, or the caller's transaction).
///
/// The first statement is a plain read of the record: a replay, an in-flight conflict and a
/// mismatch cost that read and nothing else (no row lock, no insertion planned, no write). When
/// there is no record, the next statement inserts the new key, or returns the record a
/// concurrent caller committed in between, again without locking or writing it. Only when the
/// model says the record must be written (it expired, or its lease ran out: a takeover) does
/// the claiming upsert run, which decides again under the row lock.
pub(crate) async fn begin_on(
    connection: &mut PgConnection,
    sql: &Statements,
    request: &BeginRequest,
) -> Result<Claim, StoreError> {
    let peeked = sqlx::query(AssertSqlSafe(Arc::clone(&sql.peek)))
        .bind(request.scope.as_str())
        .bind(request.key.as_str())
        .fetch_optional(&mut *connection)
        .await
        .map_err(|e| map_error("begin", e))?;
    let mut statement = &sql.begin;
    if let Some(row) = peeked {
        let record = sql_rows::record(&row, 0)?;
        let now = Timestamp::from_unix_millis(row.try_get(12).map_err(|e| map_error("decode begin", e))?);
        let (claim, effect) = machine::begin(now, Some(&record), request);
        if effect == Effect::None {
            return Ok(claim);
        }
        // Expired, or a lease that ran out: only the claiming upsert may write it.
        statement = &sql.claim;
    }
    for _ in 0..BEGIN_TRIES {
        let row = sqlx::query(AssertSqlSafe(Arc::clone(statement)))
            .bind(request.scope.as_str())
            .bind(request.key.as_str())
            .bind(&request.fingerprint.as_bytes()[..])
            .bind(&request.token.to_bytes()[..])
            .bind(stored_millis(request.lease))
            .bind(stored_millis(request.retention))
            .fetch_optional(&mut *connection)
            .await
            .map_err(|e| map_error("begin", e))?;
        // No row: a concurrent transaction committed the record after this statement's
        // snapshot was taken; the next run sees it.
        let Some(row) = row else { continue };
        let claimed: bool = row.try_get(0).map_err(|e| map_error("decode begin", e))?;
        let record = sql_rows::record(&row, 1)?;
        if claimed {
            let RecordState::InFlight { lease_until, .. } = record.state else {
                return Err(StoreError::new(
                    ErrorKind::Protocol,
                    "a claimed record is not in flight",
                ));
            };
            return Ok(Claim::Acquired(Held::acquired(
                request,
                record.attempt,
                lease_until,
            )));
        }
        let now = Timestamp::from_unix_millis(row.try_get(13).map_err(|e| map_error("decode begin", e))?);
        // Not claimed; the model says why (replay, in flight, mismatch, or this caller's own
        // earlier claim). If it would write, the record expired or its lease ran out: the
        // claiming upsert decides that under the row lock. If the upsert did not claim either,
        // the record changed in between or sits on a millisecond boundary: look again.
        let (claim, effect) = machine::begin(now, Some(&record), request);
        if effect == Effect::None {
            return Ok(claim);
        }
        if Arc::ptr_eq(statement, &sql.claim) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        statement = &sql.claim;
    }
    Err(StoreError::new(
        ErrorKind::Timeout,
        format!("begin did not settle after {BEGIN_TRIES} tries under concurrent changes; retry"),
    ))
}

/// `complete` on one connection.
pub(crate) async fn complete_on(
    connection: &mut PgConnection,
    sql: &Statements,
    held: &Held,
    outcome: &Outcome,
    retention: Duration,
) -> Result<Fenced<Timestamp>, StoreError> {
    if held.token == Token::NONE {
        return Ok(Fenced::LeaseLost);
    }
    let expires: Option<i64> = sqlx::query_scalar(AssertSqlSafe(Arc::clone(&sql.complete)))
        .bind(held.scope.as_str())
        .bind(held.key.as_str())
        .bind(&held.token.to_bytes()[..])
        .bind(outcome.as_bytes())
        .bind(stored_millis(retention))
        .fetch_optional(&mut *connection)
        .await
        .map_err(|e| map_error("complete", e))?;
    Ok(expires.map_or(Fenced::LeaseLost, |ms| {
        Fenced::Accepted(Timestamp::from_unix_millis(ms))
    }))
}

#[async_trait]
impl Store for PostgresStore {
    async fn begin(&self, request: &BeginRequest) -> Result<Claim, StoreError> {
        let claim = {
            self.pools
                .run_new(async |connection| begin_on(connection, &self.sql, request).await)
                .await
        };
        // As in `begin_many`: the one `ANALYZE` does not hold a place of new work.
        self.claimed(1).await;
        claim
    }

    async fn complete(
        &self,
        held: &Held,
        outcome: Outcome,
        retention: Duration,
    ) -> Result<Fenced<Timestamp>, StoreError> {
        self.pools
            .run(async |connection| complete_on(connection, &self.sql, held, &outcome, retention).await)
            .await
    }

    async fn release(&self, held: &Held) -> Result<Fenced<()>, StoreError> {
        admin::release(self, held).await
    }

    async fn extend(&self, held: &Held, lease: Duration) -> Result<Fenced<Timestamp>, StoreError> {
        if held.token == Token::NONE {
            return Ok(Fenced::LeaseLost);
        }
        let lease_until: Option<i64> = self
            .pools
            .run(async |connection| {
                sqlx::query_scalar(AssertSqlSafe(Arc::clone(&self.sql.extend)))
                    .bind(held.scope.as_str())
                    .bind(held.key.as_str())
                    .bind(&held.token.to_bytes()[..])
                    .bind(stored_millis(lease))
                    .fetch_optional(connection)
                    .await
                    .map_err(|e| map_error("extend", e))
            })
            .await?;
        Ok(lease_until.map_or(Fenced::LeaseLost, |ms| {
            Fenced::Accepted(Timestamp::from_unix_millis(ms))
        }))
    }

    async fn get(&self, scope: &Scope, key: &Key) -> Result<Option<Record>, StoreError> {
        admin::get(self, scope, key).await
    }

    /// One statement for the whole batch ([`Operation::BeginMany`]): the new keys are inserted
    /// and the others' records read, in one round trip and one commit; a replay, an in-flight
    /// conflict or a mismatch still only reads. A key that needs the claiming upsert (expired,
    /// or a takeover), or that the batch names twice, is then decided alone, as
    /// [`Store::begin`] decides it.
    async fn begin_many(&self, requests: &[BeginRequest]) -> Vec<Result<Claim, StoreError>> {
        if requests.len() < 2 {
            return begin_each(self, requests).await;
        }
        let lane = match self.pools.lanes.new_work().await {
            Ok(lane) => lane,
            Err(error) => return failed_batch(&error, requests.len()),
        };
        let answers = self
            .answers_on_one_connection(requests.len(), async |connection| {
                batch::begin_batch(connection, &self.sql, requests).await
            })
            .await;
        // The one `ANALYZE` (on the sqlx pool) does not hold a place of new work.
        drop(lane);
        self.claimed(requests.len()).await;
        answers
    }

    /// One statement for the whole batch ([`Operation::CompleteMany`]); a key the batch
    /// completes twice is then completed alone, as [`Store::complete`] does.
    async fn complete_many(&self, completions: &[Completion]) -> Vec<Result<Fenced<Timestamp>, StoreError>> {
        if completions.len() < 2 {
            return complete_each(self, completions).await;
        }
        self.answers_on_one_connection(completions.len(), async |connection| {
            batch::complete_batch(connection, &self.sql, completions).await
        })
        .await
    }
}

impl PostgresStore {
    /// Counts `keys` claimed; once [`ANALYZE_AFTER`] have been, makes sure the table's
    /// statistics describe it (see [`Statistics`]).
    pub(crate) async fn claimed(&self, keys: usize) {
        // Once checked, a claim reads one flag: no write to a shared counter on every `begin`.
        if self.statistics.checked.load(Ordering::Relaxed) {
            return;
        }
        let keys = u64::try_from(keys).unwrap_or(u64::MAX);
        if self.statistics.claimed.fetch_add(keys, Ordering::Relaxed) + keys >= ANALYZE_AFTER
            && !self.statistics.checked.swap(true, Ordering::Relaxed)
        {
            self.analyze_if_out_of_date().await;
        }
    }

    /// Runs `ANALYZE` on the table if its statistics are out of date (see [`Statistics`]), and
    /// logs what came of it: the store works without it, only slower until autovacuum analyzes.
    async fn analyze_if_out_of_date(&self) {
        match self.analyze_once().await {
            Ok(None) => {}
            Ok(Some(true)) => {
                tracing::info!(table = %self.table(), "analyzed the records table: its planner statistics were missing or out of date");
            }
            Ok(Some(false)) => tracing::warn!(
                table = %self.table(),
                "could not analyze the records table (a role that does not own it may not); autovacuum will"
            ),
            Err(error) => {
                tracing::warn!(table = %self.table(), %error, "could not analyze the records table");
            }
        }
    }

    /// `None` when the table's statistics describe it; otherwise runs `ANALYZE` and answers
    /// whether they do now (a role that does not own the table only gets a warning).
    async fn analyze_once(&self) -> Result<Option<bool>, sqlx::Error> {
        if !self.statistics_out_of_date().await? {
            return Ok(None);
        }
        sqlx::raw_sql(AssertSqlSafe(format!("ANALYZE {}", self.quoted_table())))
            .execute(&self.pools.pool)
            .await?;
        Ok(Some(!self.statistics_out_of_date().await?))
    }

    /// Whether the table was never analyzed, or has at least [`STALE_FLOOR_PAGES`] pages and
    /// more than [`STALE_GROWTH`] times the pages its statistics counted (`relpages`, as of its
    /// last `VACUUM` or `ANALYZE`).
    async fn statistics_out_of_date(&self) -> Result<bool, sqlx::Error> {
        let stale: Option<bool> = sqlx::query_scalar(
            "SELECT reltuples < 0 OR (pages >= $3 AND pages > $2 * relpages::int8)
             FROM (SELECT reltuples, relpages, pg_relation_size(oid) / current_setting('block_size')::int8 AS pages
                   FROM pg_class WHERE oid = to_regclass($1)) AS t",
        )
        .bind(self.quoted_table())
        .bind(STALE_GROWTH)
        .bind(STALE_FLOOR_PAGES)
        .fetch_optional(&self.pools.pool)
        .await?;
        Ok(stale == Some(true))
    }

    /// The records table with its schema, each name quoted.
    fn quoted_table(&self) -> String {
        format!("\"{}\".\"{}\"", self.sql.schema, self.sql.table)
    }

    /// Runs a batch on one connection: its answers, or, when no connection could be had,
    /// that failure as every call's answer. A connection on which any call failed is closed.
    async fn answers_on_one_connection<R>(
        &self,
        len: usize,
        batch: impl AsyncFnOnce(&mut PgConnection) -> Vec<Result<R, StoreError>>,
    ) -> Vec<Result<R, StoreError>> {
        let mut answered = None;
        let run = self
            .pools
            .run(async |connection| {
                let answers = batch(connection).await;
                let failure = answers.iter().find_map(|answer| answer.as_ref().err().cloned());
                answered = Some(answers);
                failure.map_or(Ok(()), Err)
            })
            .await;
        match (answered, run) {
            (Some(answers), _) => answers,
            (None, Err(error)) => failed_batch(&error, len),
            (None, Ok(())) => unreachable!("the batch ran"),
        }
    }
}

idempotency_core::sql_store_admin!(PostgresStore {
    engine: sqlx::Postgres,
    pools: |store| &store.pools,
    statements: |store| &store.sql.admin,
});
