//! The pooled store.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::connections::AfterConnect;
use idempotency_core::machine::{self, Effect};
use idempotency_core::sql::admin;
use idempotency_core::sql::{self as sql_rows, Pools};
use idempotency_core::{
    Access, BeginRequest, Claim, Completion, ErrorKind, Fenced, Held, Key, Outcome, Record, RecordColumns,
    Scope, Store, StoreError, Timestamp, Token, begin_each, complete_each, stored_millis,
};
use sqlx::mysql::{MySqlConnectOptions, MySqlConnection, MySqlPool, MySqlRow};
use sqlx::{AssertSqlSafe, Connection, Executor, Row};

use crate::error::{DEADLOCK, DUPLICATE_KEY, map_error, number};
use crate::options::MysqlOptions;
use crate::sql::{self, Statements};

/// An operation whose SQL [`MysqlStore::sql`] shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Operation {
    /// Creating the table and its indexes.
    Migrate,
    /// `begin`'s first look, a consistent read of the record with the server's time: scope,
    /// key. A replay, an in-flight conflict and a mismatch are answered from it.
    Peek,
    /// Inserting the record of a new key: the record's twelve columns.
    Insert,
    /// `begin` on a record that must be written (expired, or a lease that ran out): the record
    /// under its row lock, with the time the lock was granted: scope, key.
    Lock,
    /// Writing the record decided under [`Operation::Lock`].
    Update,
    /// `complete`: retention ms, outcome, scope, key, token.
    Complete,
    /// `release`: [`Token::NONE`], scope, key, token.
    Release,
    /// `extend`: lease ms, lease ms, scope, key, token.
    Extend,
    /// `get`: scope, key.
    Get,
    /// `stats`: scope or NULL, twice.
    Stats,
    /// `list`: see the statement.
    List,
    /// `purge_expired`: limit.
    PurgeExpired,
}

/// How often `begin` starts over when a concurrent caller got there first (a duplicate key, a
/// deadlock victim); each round reads the record afresh, so one is almost always enough.
const BEGIN_TRIES: u32 = 8;

/// The name of the lock migrations run under (`GET_LOCK`), one for every table of a server.
const MIGRATION_LOCK: &str = "idempotency-migrate";

/// How long a migration waits for another instance's, in seconds.
const MIGRATION_LOCK_WAIT: i64 = 60;

/// What the clones of a store share.
#[derive(Debug)]
struct Shared {
    sql: Statements,
    /// `begin`s that InnoDB chose as a deadlock victim and that ran again.
    deadlock_retries: AtomicU64,
}

/// The MySQL and MariaDB store. Clones share the pool.
///
/// `begin` on an existing record is one consistent read (no lock, no write); a new key is that
/// read and one `INSERT`; only an expired record or a takeover is decided again in a
/// transaction under the row lock. `complete`, `release` and `extend` are one conditional
/// `UPDATE` each. [`MysqlStore::sql`] shows every statement.
#[derive(Debug, Clone)]
pub struct MysqlStore {
    pools: Pools<sqlx::MySql>,
    shared: Arc<Shared>,
}

impl MysqlStore {
    /// Connects to the database a `mysql://` URL names, with the default table
    /// (`idempotency_records`), and creates the table if needed.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::InvalidConfig`] for a malformed URL, an unknown database or rejected
    /// credentials; [`ErrorKind::Unavailable`] when the server cannot be reached;
    /// [`ErrorKind::Schema`] when a table of that name exists and is not a records table of
    /// this version.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(MysqlOptions::from_url(url)?).await
    }

    /// Connects with `options`.
    ///
    /// # Errors
    ///
    /// As [`MysqlStore::connect`].
    pub async fn connect_with(options: MysqlOptions) -> Result<Self, StoreError> {
        let mut pool = idempotency_core::sql::pool_options::<sqlx::MySql>(
            options.max_connections,
            options.acquire_timeout,
        );
        if options.access == Access::ReadOnly {
            pool = pool.after_connect(|connection, _| read_only_session(connection));
        }
        let pool = pool
            .connect_with(in_utc(options.connect.clone()))
            .await
            .map_err(|e| map_error("connect to MySQL", e))?;
        let store = Self::from_pool(pool, &options);
        options.prepare(store.check_table(), store.migrate()).await?;
        Ok(store)
    }

    /// A store on a pool the application already has. The table must exist (see
    /// [`MysqlStore::migrate`]).
    #[must_use]
    pub fn from_pool(pool: MySqlPool, options: &MysqlOptions) -> Self {
        // The store's own connections: in UTC whatever the application's pool says, and read-only
        // when the store was opened to read.
        let after_connect: Option<AfterConnect<MySqlConnection>> = (options.access == Access::ReadOnly)
            .then(|| -> AfterConnect<MySqlConnection> { Arc::new(read_only_session) });
        let utc = Arc::new(in_utc((*pool.connect_options()).clone()));
        Self {
            pools: Pools::new("mysql", pool, utc, after_connect, options.sizes(), map_error),
            shared: Arc::new(Shared {
                sql: Statements::new(&options.table),
                deadlock_retries: AtomicU64::new(0),
            }),
        }
    }

    /// The pool, for the application's own queries and for same-transaction operations.
    #[must_use]
    pub fn pool(&self) -> &MySqlPool {
        &self.pools.pool
    }

    /// The records table's name.
    #[must_use]
    pub fn table(&self) -> &str {
        &self.shared.sql.table
    }

    /// How many times a `begin` was chosen as a deadlock victim by InnoDB and ran again (also
    /// counted as `idempotency_mysql_deadlock_retries_total`).
    #[must_use]
    pub fn deadlock_retries(&self) -> u64 {
        self.shared.deadlock_retries.load(Ordering::Relaxed)
    }

    /// Creates the records table and its indexes if they are missing, under a named lock
    /// (`GET_LOCK`) so that many instances starting at once do not race. Safe to run at every
    /// start (`idem migrate` runs it).
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Schema`] when a table of that name exists and is not a records table of
    /// this version (a newer version's, or another application's); [`ErrorKind::Timeout`] when
    /// another instance held the lock for a minute; the server's error (for example an account
    /// without `CREATE`) otherwise.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut connection = self
            .pools
            .pool
            .acquire()
            .await
            .map_err(|e| map_error("get a connection for the migration", e))?;
        let locked: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, ?)")
            .bind(MIGRATION_LOCK)
            .bind(MIGRATION_LOCK_WAIT)
            .fetch_one(&mut *connection)
            .await
            .map_err(|e| map_error("lock the migration", e))?;
        if locked != Some(1) {
            return Err(StoreError::new(
                ErrorKind::Timeout,
                format!(
                    "another instance held the migration lock `{MIGRATION_LOCK}` for {MIGRATION_LOCK_WAIT} s"
                ),
            ));
        }
        let migrated = self.migrate_locked(&mut connection).await;
        let released = sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(MIGRATION_LOCK)
            .execute(&mut *connection)
            .await;
        migrated?;
        released.map_err(|e| map_error("release the migration lock", e))?;
        Ok(())
    }

    async fn migrate_locked(&self, connection: &mut MySqlConnection) -> Result<(), StoreError> {
        if let Some(comment) = self.table_comment(connection).await? {
            self.check_comment(&comment)?;
        }
        sqlx::raw_sql(AssertSqlSafe(Arc::clone(&self.shared.sql.create)))
            .execute(&mut *connection)
            .await
            .map_err(|e| map_error("create the records table", e))?;
        Ok(())
    }

    /// The comment of the records table, `None` when there is no such table.
    async fn table_comment(&self, connection: &mut MySqlConnection) -> Result<Option<String>, StoreError> {
        sqlx::query_scalar(
            "SELECT TABLE_COMMENT FROM information_schema.TABLES
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
        )
        .bind(self.table())
        .fetch_optional(connection)
        .await
        .map_err(|e| map_error("read the schema version", e))
    }

    fn check_comment(&self, comment: &str) -> Result<(), StoreError> {
        let current = sql_rows::version_comment(sql::SCHEMA_VERSION);
        if comment == current {
            return Ok(());
        }
        Err(StoreError::new(
            ErrorKind::Schema,
            format!(
                "table {} is marked {comment:?}; this version writes {current:?} (a newer version created it, or it is another application's table); nothing was changed",
                self.table()
            ),
        ))
    }

    /// Refuses a database without the records table, reading only.
    async fn check_table(&self) -> Result<(), StoreError> {
        let mut connection = self
            .pools
            .pool
            .acquire()
            .await
            .map_err(|e| map_error("get a connection", e))?;
        match self.table_comment(&mut connection).await? {
            Some(comment) => self.check_comment(&comment),
            None => {
                let database: Option<String> = sqlx::query_scalar("SELECT DATABASE()")
                    .fetch_one(&mut *connection)
                    .await
                    .ok()
                    .flatten();
                Err(StoreError::new(
                    ErrorKind::Schema,
                    format!(
                        "database {} has no table {}; nothing was created (`idem migrate` creates it)",
                        database.as_deref().unwrap_or("?"),
                        self.table()
                    ),
                ))
            }
        }
    }

    /// The SQL this store runs for `operation`, for `EXPLAIN`, a DBA's review, or issuing the
    /// same statement directly (the benchmark's baseline does). Every value is a bind parameter.
    #[must_use]
    pub fn sql(&self, operation: Operation) -> &str {
        let sql = &self.shared.sql;
        match operation {
            Operation::Migrate => &sql.create,
            Operation::Peek => &sql.peek,
            Operation::Insert => &sql.insert,
            Operation::Lock => &sql.lock,
            Operation::Update => &sql.update,
            Operation::Complete => &sql.complete,
            Operation::Release => &sql.admin.release,
            Operation::Extend => &sql.extend,
            Operation::Get => &sql.admin.get,
            Operation::Stats => &sql.admin.stats,
            Operation::List => &sql.admin.list,
            Operation::PurgeExpired => &sql.admin.purge,
        }
    }

    pub(crate) fn statements(&self) -> &Statements {
        &self.shared.sql
    }
}

/// Times are written and compared in UTC: `SYSDATE()` follows the session's zone.
fn in_utc(options: MySqlConnectOptions) -> MySqlConnectOptions {
    options.timezone(Some("+00:00".to_owned()))
}

/// Makes a new session read-only, for a store opened to read.
fn read_only_session(
    connection: &mut MySqlConnection,
) -> std::pin::Pin<Box<dyn Future<Output = Result<(), sqlx::Error>> + Send + '_>> {
    Box::pin(async move {
        connection.execute("SET SESSION TRANSACTION READ ONLY").await?;
        Ok(())
    })
}

/// Where `begin` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Within {
    /// A pooled connection in autocommit: a write that needs a lock gets a short transaction
    /// of its own, and a deadlock victim runs again.
    Autocommit,
    /// The caller's transaction (same-transaction mode): locks are held until it ends, and a
    /// deadlock (which rolled the whole transaction back) is the caller's to retry.
    Transaction,
}

/// A failure inside `begin`: the server's (which may call for another round) or a decoding one.
enum Failure {
    Sql(&'static str, sqlx::Error),
    Store(StoreError),
}

impl Failure {
    fn number(&self) -> Option<u16> {
        match self {
            Self::Sql(_, error) => number(error),
            Self::Store(_) => None,
        }
    }

    fn into_store(self) -> StoreError {
        match self {
            Self::Sql(doing, error) => map_error(doing, error),
            Self::Store(error) => error,
        }
    }
}

impl From<StoreError> for Failure {
    fn from(error: StoreError) -> Self {
        Self::Store(error)
    }
}

/// Which lock the locking read takes.
#[derive(Debug, Clone, Copy)]
enum Lock {
    Exclusive,
    Shared,
}

/// `begin` on one connection (a pooled one, or the caller's transaction).
///
/// The first statement is a consistent read of the record with the server's time: a replay, an
/// in-flight conflict and a mismatch cost that read and nothing else (no lock, no write). A new
/// key is inserted as the core's machine decided it; if a concurrent caller inserted it first
/// (duplicate key), the round starts again and reads that caller's record. Only an expired
/// record or a takeover is decided again under the row lock (`SELECT … FOR UPDATE`), with the
/// time at which the lock was granted.
pub(crate) async fn begin_on(
    connection: &mut MySqlConnection,
    store: &MysqlStore,
    request: &BeginRequest,
    within: Within,
) -> Result<Claim, StoreError> {
    let sql = store.statements();
    for round in 0..BEGIN_TRIES {
        let row = sqlx::query(AssertSqlSafe(Arc::clone(&sql.peek)))
            .bind(request.scope.as_str())
            .bind(request.key.as_str())
            .fetch_one(&mut *connection)
            .await
            .map_err(|e| map_error("begin", e))?;
        let now = Timestamp::from_unix_millis(row.try_get(0).map_err(|e| map_error("decode begin", e))?);
        let existing = decode_optional(&row, 1)?;
        let (claim, effect) = machine::begin(now, existing.as_ref(), request);
        let Effect::Put(record) = effect else {
            return Ok(claim);
        };
        let outcome = if existing.is_none() {
            match write(&mut *connection, sql, &record, false).await {
                Ok(()) => return Ok(claim),
                Err(error) if number(&error) == Some(DUPLICATE_KEY) && within == Within::Autocommit => {
                    continue;
                }
                // Inside a transaction the insert waited for the other caller's transaction to
                // end; the record it committed is read under a shared lock, which the other
                // duplicates can hold at the same time.
                Err(error) if number(&error) == Some(DUPLICATE_KEY) => {
                    decide_begin(&mut *connection, sql, request, Lock::Shared).await
                }
                Err(error) => return Err(map_error("begin", error)),
            }
        } else if within == Within::Transaction {
            decide_begin(&mut *connection, sql, request, Lock::Exclusive).await
        } else {
            in_own_transaction(&mut *connection, sql, request).await
        };
        match outcome {
            Ok(claim) => return Ok(claim),
            Err(failure) if within == Within::Autocommit && failure.number() == Some(DEADLOCK) => {
                store.shared.deadlock_retries.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("idempotency_mysql_deadlock_retries_total").increment(1);
                tracing::debug!(round, "begin was a deadlock victim; running it again");
                tokio::time::sleep(Duration::from_millis(1 << round.min(5))).await;
            }
            // The record vanished (purged) between the reads and another caller inserted it.
            Err(failure) if within == Within::Autocommit && failure.number() == Some(DUPLICATE_KEY) => {}
            Err(failure) => return Err(failure.into_store()),
        }
    }
    Err(StoreError::new(
        ErrorKind::Timeout,
        format!("begin did not settle after {BEGIN_TRIES} rounds under concurrent changes; retry"),
    ))
}

/// The locked decision in a short transaction of its own.
async fn in_own_transaction(
    connection: &mut MySqlConnection,
    sql: &Statements,
    request: &BeginRequest,
) -> Result<Claim, Failure> {
    let mut tx = connection
        .begin()
        .await
        .map_err(|e| Failure::Sql("begin a transaction", e))?;
    let claim = decide_begin(&mut tx, sql, request, Lock::Exclusive).await?;
    tx.commit().await.map_err(|e| Failure::Sql("commit begin", e))?;
    Ok(claim)
}

/// Reads the record under `lock` with the time the lock was granted, decides with the core's
/// machine and writes what it says, in the transaction `connection` is in.
async fn decide_begin(
    connection: &mut MySqlConnection,
    sql: &Statements,
    request: &BeginRequest,
    lock: Lock,
) -> Result<Claim, Failure> {
    let statement = match lock {
        Lock::Exclusive => &sql.lock,
        Lock::Shared => &sql.share,
    };
    let row = sqlx::query(AssertSqlSafe(Arc::clone(statement)))
        .bind(request.scope.as_str())
        .bind(request.key.as_str())
        .fetch_optional(&mut *connection)
        .await
        .map_err(|e| Failure::Sql("begin", e))?;
    let (now, existing) = match row {
        Some(row) => {
            let now: i64 = row.try_get(0).map_err(|e| map_error("decode begin", e))?;
            (now, Some(sql_rows::record(&row, 1)?))
        }
        None => {
            let now: i64 = sqlx::query_scalar(AssertSqlSafe(Arc::clone(&sql.admin.now)))
                .fetch_one(&mut *connection)
                .await
                .map_err(|e| Failure::Sql("read the server's clock", e))?;
            (now, None)
        }
    };
    let (claim, effect) = machine::begin(Timestamp::from_unix_millis(now), existing.as_ref(), request);
    if let Effect::Put(record) = effect {
        write(connection, sql, &record, existing.is_some())
            .await
            .map_err(|e| Failure::Sql("begin", e))?;
    }
    Ok(claim)
}

/// Writes `record`: an `UPDATE` of the row when it `existed` (under its lock), else an
/// `INSERT`.
async fn write(
    connection: &mut MySqlConnection,
    sql: &Statements,
    record: &Record,
    existed: bool,
) -> Result<(), sqlx::Error> {
    let columns = RecordColumns::of(record);
    let token = columns.token.to_bytes();
    let fingerprint = record.fingerprint.as_bytes();
    let statement = if existed { &sql.update } else { &sql.insert };
    let mut query = sqlx::query(AssertSqlSafe(Arc::clone(statement)));
    if !existed {
        query = query.bind(record.scope.as_str()).bind(record.key.as_str());
    }
    query = query
        .bind(&fingerprint[..])
        .bind(i64::from(record.attempt))
        .bind(record.created_at.unix_millis())
        .bind(record.expires_at.unix_millis())
        .bind(&token[..])
        .bind(columns.completed)
        .bind(columns.acquired_at)
        .bind(columns.lease_until)
        .bind(columns.completed_at)
        .bind(columns.outcome);
    if existed {
        query = query.bind(record.scope.as_str()).bind(record.key.as_str());
    }
    query.execute(connection).await.map(drop)
}

/// `complete` on one connection: one conditional `UPDATE`; when it changes nothing, a read
/// tells a retried `complete` by the completing token (accepted again) from a lost lease.
pub(crate) async fn complete_on(
    connection: &mut MySqlConnection,
    sql: &Statements,
    held: &Held,
    outcome: &Outcome,
    retention: Duration,
) -> Result<Fenced<Timestamp>, StoreError> {
    if held.token == Token::NONE {
        return Ok(Fenced::LeaseLost);
    }
    let token = held.token.to_bytes();
    let done = sqlx::query(AssertSqlSafe(Arc::clone(&sql.complete)))
        .bind(stored_millis(retention))
        .bind(outcome.as_bytes())
        .bind(held.scope.as_str())
        .bind(held.key.as_str())
        .bind(&token[..])
        .execute(&mut *connection)
        .await
        .map_err(|e| map_error("complete", e))?;
    if done.rows_affected() == 1 {
        return Ok(Fenced::Accepted(returned_time(done.last_insert_id())?));
    }
    let kept: Option<i64> = sqlx::query_scalar(AssertSqlSafe(Arc::clone(&sql.completed_by)))
        .bind(held.scope.as_str())
        .bind(held.key.as_str())
        .bind(&token[..])
        .fetch_optional(&mut *connection)
        .await
        .map_err(|e| map_error("complete", e))?;
    Ok(kept.map_or(Fenced::LeaseLost, |ms| {
        Fenced::Accepted(Timestamp::from_unix_millis(ms))
    }))
}

/// The time a statement handed back through `LAST_INSERT_ID(expr)`.
fn returned_time(millis: u64) -> Result<Timestamp, StoreError> {
    i64::try_from(millis)
        .ok()
        .filter(|ms| *ms > 0)
        .map(Timestamp::from_unix_millis)
        .ok_or_else(|| {
            StoreError::new(
                ErrorKind::Protocol,
                format!("the server returned {millis} as the new time (expected Unix milliseconds)"),
            )
        })
}

#[async_trait]
impl Store for MysqlStore {
    async fn begin(&self, request: &BeginRequest) -> Result<Claim, StoreError> {
        self.pools
            .run_new(async |connection| begin_on(connection, self, request, Within::Autocommit).await)
            .await
    }

    async fn complete(
        &self,
        held: &Held,
        outcome: Outcome,
        retention: Duration,
    ) -> Result<Fenced<Timestamp>, StoreError> {
        self.pools
            .run(async |connection| {
                complete_on(connection, self.statements(), held, &outcome, retention).await
            })
            .await
    }

    async fn release(&self, held: &Held) -> Result<Fenced<()>, StoreError> {
        admin::release(self, held).await
    }

    async fn extend(&self, held: &Held, lease: Duration) -> Result<Fenced<Timestamp>, StoreError> {
        if held.token == Token::NONE {
            return Ok(Fenced::LeaseLost);
        }
        let lease = stored_millis(lease);
        let done = self
            .pools
            .run(async |connection| {
                sqlx::query(AssertSqlSafe(Arc::clone(&self.statements().extend)))
                    .bind(lease)
                    .bind(lease)
                    .bind(held.scope.as_str())
                    .bind(held.key.as_str())
                    .bind(&held.token.to_bytes()[..])
                    .execute(connection)
                    .await
                    .map_err(|e| map_error("extend", e))
            })
            .await?;
        if done.rows_affected() == 1 {
            Ok(Fenced::Accepted(returned_time(done.last_insert_id())?))
        } else {
            Ok(Fenced::LeaseLost)
        }
    }

    async fn get(&self, scope: &Scope, key: &Key) -> Result<Option<Record>, StoreError> {
        admin::get(self, scope, key).await
    }

    /// One transaction on one connection for the whole batch: each request's statements as
    /// [`Store::begin`] runs them in a caller's transaction (a replay, an in-flight conflict or
    /// a mismatch still only reads), in [`lock_order`](idempotency_core::lock_order), then one
    /// commit.
    async fn begin_many(&self, requests: &[BeginRequest]) -> Vec<Result<Claim, StoreError>> {
        if requests.len() < 2 {
            return begin_each(self, requests).await;
        }
        self.pools
            .connections
            .batch(Some(&self.pools.lanes), self, requests, |tx, store, request| {
                Box::pin(begin_on(tx, store, request, Within::Transaction))
            })
            .await
    }

    /// One transaction on one connection for the whole batch, as [`Store::begin_many`].
    async fn complete_many(&self, completions: &[Completion]) -> Vec<Result<Fenced<Timestamp>, StoreError>> {
        if completions.len() < 2 {
            return complete_each(self, completions).await;
        }
        self.pools
            .connections
            .batch(None, self.statements(), completions, |tx, sql, c| {
                Box::pin(complete_on(tx, sql, &c.held, &c.outcome, c.retention))
            })
            .await
    }
}

idempotency_core::sql_store_admin!(MysqlStore {
    engine: sqlx::MySql,
    pools: |store| &store.pools,
    statements: |store| &store.shared.sql.admin,
});

/// Decodes the record columns of an outer join starting at column `at`: `None` when the
/// record's columns are NULL.
fn decode_optional(row: &MySqlRow, at: usize) -> Result<Option<Record>, StoreError> {
    let scope: Option<String> = row.try_get(at).map_err(|e| map_error("decode a record", e))?;
    scope.map(|_| sql_rows::record(row, at)).transpose()
}
