//! The store: one connection owned by one worker thread.

use std::fmt;
use std::sync::{Arc, mpsc};
use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::machine::{self, Effect};
use idempotency_core::{
    Access, BeginRequest, Claim, Clock, ErrorKind, Fenced, Fingerprint, Held, Key, ListFilter, Outcome,
    Record, RecordParts, RecordState, RecordSummary, Scope, StateFilter, Stats, Store, StoreAdmin,
    StoreError, Timestamp, Token, duration_millis,
};
use rusqlite::{Connection, OpenFlags, OptionalExtension, Row, TransactionBehavior, params};

use crate::options::{Location, SqliteOptions};
use crate::sql;

type Job = Box<dyn FnOnce(&mut Connection) + Send>;

/// The SQLite store. Clones share one connection and its worker thread.
///
/// All operations run on a dedicated thread that owns the connection: writes of one process are
/// serialized there without lock contention, and every write is an `IMMEDIATE` transaction, so
/// writers in *other* processes (the operations CLI, a second gateway on the same file) wait on
/// the busy timeout instead of failing on a read-to-write upgrade. The thread ends when the last
/// clone is dropped.
///
/// ```
/// use idempotency_core::{BeginRequest, Claim, Fingerprint, Held, Key, Scope, Store};
/// use idempotency_sqlite::SqliteStore;
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let dir = tempfile::tempdir()?;
/// let store = SqliteStore::open(&format!("sqlite://{}/idem.db", dir.path().display())).await?;
/// let request = BeginRequest::new(Scope::global(), Key::new("order-1")?, Fingerprint::of_bytes(b"pay"));
/// assert!(matches!(store.begin(&request).await?, Claim::Acquired(Held { attempt: 1, .. })));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

struct Inner {
    jobs: mpsc::Sender<Job>,
    clock: Arc<dyn Clock>,
    location: Location,
}

impl fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStore")
            .field("location", &self.inner.location)
            .finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// Opens (creating if needed) the store named by a `sqlite:` URL; see
    /// [`SqliteOptions::from_url`].
    ///
    /// # Errors
    ///
    /// [`ErrorKind::InvalidConfig`] for a malformed URL or a missing directory,
    /// [`ErrorKind::ReadOnly`] for a file the store cannot write, [`ErrorKind::Corrupt`] for a
    /// file that is not a (healthy) SQLite database, [`ErrorKind::Schema`] for a database written
    /// by a newer version or by another application.
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        Self::open_with(SqliteOptions::from_url(url)?).await
    }

    /// A private in-memory store (for tests; nothing survives the process).
    ///
    /// # Errors
    ///
    /// Only if SQLite itself cannot start.
    pub async fn in_memory() -> Result<Self, StoreError> {
        Self::open_with(SqliteOptions::memory()).await
    }

    /// Opens the store described by `options`.
    ///
    /// # Errors
    ///
    /// As [`SqliteStore::open`].
    pub async fn open_with(options: SqliteOptions) -> Result<Self, StoreError> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let (opened, opening) = tokio::sync::oneshot::channel();
        let location = options.location.clone();
        let clock = Arc::clone(&options.clock);
        let name = match &location {
            Location::File(_) => "idempotency-sqlite",
            Location::Memory => "idempotency-sqlite-mem",
        };
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let mut connection = match open_connection(&options) {
                    Ok(connection) => {
                        let _ = opened.send(Ok(()));
                        connection
                    }
                    Err(error) => {
                        let _ = opened.send(Err(error));
                        return;
                    }
                };
                while let Ok(job) = queue.recv() {
                    // A panicking job (a bug, or a `with_connection` closure) must not take the
                    // store down for every later caller: its caller sees its reply channel
                    // closed, and the connection is returned to autocommit for the next job.
                    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(&mut connection)));
                    if ran.is_err() {
                        tracing::error!("a SQLite store operation panicked; rolling back and carrying on");
                        if !connection.is_autocommit() {
                            let _ = connection.execute_batch("ROLLBACK");
                        }
                    }
                }
            })
            .map_err(|e| {
                StoreError::new(ErrorKind::Backend, "cannot start the SQLite thread").with_source(e)
            })?;
        opening.await.map_err(|_| stopped())??;
        tracing::debug!(?location, "SQLite store opened");
        Ok(Self {
            inner: Arc::new(Inner {
                jobs,
                clock,
                location,
            }),
        })
    }

    /// Runs `f` on the store's connection, on the thread that serializes all of this store's
    /// operations, and returns its result.
    ///
    /// For diagnostics, maintenance queries and benchmarks that must share the store's
    /// connection. `f` must not leave a transaction open, and must not modify
    /// `idempotency_records` behind the store's back.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Unavailable`] if the store's thread has stopped.
    pub async fn with_connection<R, F>(&self, f: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&mut Connection) -> R + Send + 'static,
    {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.inner
            .jobs
            .send(Box::new(move |connection| {
                let _ = reply.send(f(connection));
            }))
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())
    }

    async fn run<R, F>(&self, f: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&mut Connection, &dyn Clock) -> Result<R, StoreError> + Send + 'static,
    {
        let clock = Arc::clone(&self.inner.clock);
        self.with_connection(move |connection| f(connection, &*clock))
            .await?
    }

    /// Runs one state-machine transition in an `IMMEDIATE` transaction: read the record, decide
    /// with [`machine`], write the effect, commit. The time is read after the write lock is held,
    /// so transitions are ordered by the time they were decided at.
    async fn transition<R, F>(&self, scope: &Scope, key: &Key, step: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(Timestamp, Option<&Record>) -> (R, Effect) + Send + 'static,
    {
        let (scope, key) = (scope.clone(), key.clone());
        self.run(move |connection, clock| {
            let tx = connection
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(|e| map_error("begin a write transaction", e))?;
            let now = clock.now();
            let existing = select_record(&tx, &scope, &key)?;
            let (answer, effect) = step(now, existing.as_ref());
            match effect {
                Effect::None => {}
                Effect::Put(record) => upsert_record(&tx, &record)?,
            }
            tx.commit().map_err(|e| map_error("commit", e))?;
            Ok(answer)
        })
        .await
    }
}

#[async_trait]
impl Store for SqliteStore {
    async fn begin(&self, request: &BeginRequest) -> Result<Claim, StoreError> {
        let request = request.clone();
        let (scope, key) = (request.scope.clone(), request.key.clone());
        self.transition(&scope, &key, move |now, record| {
            machine::begin(now, record, &request)
        })
        .await
    }

    async fn complete(
        &self,
        held: &Held,
        outcome: Outcome,
        retention: Duration,
    ) -> Result<Fenced<Timestamp>, StoreError> {
        let token = held.token;
        self.transition(&held.scope, &held.key, move |now, record| {
            machine::complete(now, record, token, outcome, retention)
        })
        .await
    }

    async fn release(&self, held: &Held) -> Result<Fenced<()>, StoreError> {
        let token = held.token;
        self.transition(&held.scope, &held.key, move |now, record| {
            machine::release(now, record, token)
        })
        .await
    }

    async fn extend(&self, held: &Held, lease: Duration) -> Result<Fenced<Timestamp>, StoreError> {
        let token = held.token;
        self.transition(&held.scope, &held.key, move |now, record| {
            machine::extend(now, record, token, lease)
        })
        .await
    }

    async fn get(&self, scope: &Scope, key: &Key) -> Result<Option<Record>, StoreError> {
        let (scope, key) = (scope.clone(), key.clone());
        self.run(move |connection, clock| {
            let now = clock.now();
            Ok(select_record(connection, &scope, &key)?.filter(|record| !record.is_expired(now)))
        })
        .await
    }
}

#[async_trait]
impl StoreAdmin for SqliteStore {
    async fn now(&self) -> Result<Timestamp, StoreError> {
        Ok(self.inner.clock.now())
    }

    async fn stats(&self, scope: Option<&Scope>) -> Result<Stats, StoreError> {
        let scope = scope.cloned();
        self.run(move |connection, clock| {
            let now = clock.now();
            let mut statement = connection
                .prepare_cached(sql::STATS)
                .map_err(|e| map_error("prepare stats", e))?;
            statement
                .query_row(
                    params![now.unix_millis(), scope.as_ref().map(Scope::as_str)],
                    |row| {
                        let oldest: Option<i64> = row.get(4)?;
                        Ok(Stats {
                            expired: count(row.get(0)?),
                            in_flight: count(row.get(1)?),
                            stale_leases: count(row.get(2)?),
                            completed: count(row.get(3)?),
                            oldest_in_flight: oldest.map(|t| now.since(Timestamp::from_unix_millis(t))),
                        })
                    },
                )
                .map_err(|e| map_error("read stats", e))
        })
        .await
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordSummary>, StoreError> {
        let filter = filter.clone();
        self.run(move |connection, clock| {
            let now = clock.now();
            let state = filter.state.map(|state| match state {
                StateFilter::InFlight => 0,
                StateFilter::Completed => 1,
            });
            let started_by = filter
                .older_than
                .map(|age| now.unix_millis().saturating_sub(duration_millis(age)));
            let (after_scope, after_key) = match &filter.after {
                Some((scope, key)) => (Some(scope.as_str()), Some(key.as_str())),
                None => (None, None),
            };
            let limit = i64::try_from(filter.limit).unwrap_or(i64::MAX);
            let mut statement = connection
                .prepare_cached(sql::LIST)
                .map_err(|e| map_error("prepare list", e))?;
            let rows = statement
                .query_map(
                    params![
                        now.unix_millis(),
                        filter.scope.as_ref().map(Scope::as_str),
                        state,
                        started_by,
                        after_scope,
                        after_key,
                        limit
                    ],
                    |row| Ok(decode_summary(row)),
                )
                .map_err(|e| map_error("list records", e))?;
            let mut found = Vec::new();
            for row in rows {
                found.push(row.map_err(|e| map_error("list records", e))??);
            }
            Ok(found)
        })
        .await
    }

    async fn purge_expired(&self, limit: u64) -> Result<u64, StoreError> {
        self.run(move |connection, clock| {
            let tx = connection
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(|e| map_error("begin a write transaction", e))?;
            let limit = i64::try_from(limit).unwrap_or(i64::MAX);
            let purged = tx
                .prepare_cached(sql::PURGE_EXPIRED)
                .and_then(|mut statement| statement.execute(params![clock.now().unix_millis(), limit]))
                .map_err(|e| map_error("purge expired records", e))?;
            tx.commit().map_err(|e| map_error("commit", e))?;
            Ok(purged as u64)
        })
        .await
    }
}

fn stopped() -> StoreError {
    StoreError::new(
        ErrorKind::Unavailable,
        "the SQLite store did not answer (its worker thread stopped, or the operation panicked)",
    )
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn open_connection(options: &SqliteOptions) -> Result<Connection, StoreError> {
    let flags = match options.access {
        Access::Create => OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE,
        Access::Existing => OpenFlags::SQLITE_OPEN_READ_WRITE,
        _ => OpenFlags::SQLITE_OPEN_READ_ONLY,
    } | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let connection = match &options.location {
        Location::Memory if options.access != Access::Create => {
            return Err(StoreError::new(
                ErrorKind::InvalidConfig,
                "a private in-memory database exists only in the process that created it: nothing to inspect",
            ));
        }
        Location::Memory => Connection::open_in_memory_with_flags(flags),
        Location::File(path) => {
            check_file(path, options.access)?;
            Connection::open_with_flags(path, flags)
        }
    }
    .map_err(|e| map_error(&format!("open {}", describe(&options.location)), e))?;
    connection
        .busy_timeout(options.busy_timeout)
        .map_err(|e| map_error("set the busy timeout", e))?;
    if options.access != Access::Create {
        // Before any pragma that writes: the file must be a store of ours, as it is.
        verify(&connection, &options.location)?;
        if options.access == Access::ReadOnly {
            return Ok(connection);
        }
    }
    if let Location::File(_) = options.location {
        let mode: String = connection
            .query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))
            .map_err(|e| map_error(&format!("open {}", describe(&options.location)), e))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StoreError::new(
                ErrorKind::Backend,
                format!(
                    "{} cannot use write-ahead logging (journal mode is {mode})",
                    describe(&options.location)
                ),
            ));
        }
    }
    connection
        .execute_batch(&format!("PRAGMA synchronous = {};", options.synchronous.pragma()))
        .map_err(|e| map_error("set synchronous", e))?;
    if options.access == Access::Create {
        migrate(&connection)?;
    }
    Ok(connection)
}

/// Refuses a database that is not an idempotency store of this schema version, reading only.
fn verify(connection: &Connection, location: &Location) -> Result<(), StoreError> {
    let version: i64 = connection
        .query_row("PRAGMA user_version", [], |row| row.get(0))
        .map_err(|e| map_error("read the schema version", e))?;
    let application: i64 = connection
        .query_row("PRAGMA application_id", [], |row| row.get(0))
        .map_err(|e| map_error("read the application id", e))?;
    if application == sql::APPLICATION_ID && version == sql::SCHEMA_VERSION {
        return Ok(());
    }
    Err(StoreError::new(
        ErrorKind::Schema,
        format!(
            "{} is not an idempotency store of this version (application_id {application:#x}, \
             user_version {version}); it was left untouched (`idem migrate` creates a store)",
            describe(location)
        ),
    ))
}

/// Refuses a file marked read-only before SQLite opens it for writing: a process running as
/// root would otherwise write to it anyway, against its owner's intent. Unless the store may be
/// created, a missing file is refused too (SQLite would create an empty one).
fn check_file(path: &std::path::Path, access: Access) -> Result<(), StoreError> {
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => Err(StoreError::new(
            ErrorKind::InvalidConfig,
            format!("{} is a directory, not a database file", path.display()),
        )),
        Ok(meta) if meta.permissions().readonly() && access != Access::ReadOnly => Err(StoreError::new(
            ErrorKind::ReadOnly,
            format!("{} is read-only; the store must write to it", path.display()),
        )),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && access != Access::Create => {
            Err(StoreError::new(
                ErrorKind::InvalidConfig,
                format!(
                    "{} does not exist (`idem migrate --store sqlite://{}` creates a store there)",
                    path.display(),
                    path.display()
                ),
            ))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
            match parent {
                Some(dir) if !dir.is_dir() => Err(StoreError::new(
                    ErrorKind::InvalidConfig,
                    format!(
                        "cannot create {}: directory {} does not exist",
                        path.display(),
                        dir.display()
                    ),
                )),
                _ => Ok(()),
            }
        }
        Err(e) => Err(
            StoreError::new(ErrorKind::Backend, format!("cannot inspect {}", path.display())).with_source(e),
        ),
    }
}

fn describe(location: &Location) -> String {
    match location {
        Location::File(path) => path.display().to_string(),
        Location::Memory => "the in-memory database".into(),
    }
}

fn migrate(connection: &Connection) -> Result<(), StoreError> {
    let version: i64 = connection
        .query_row("PRAGMA user_version", [], |row| row.get(0))
        .map_err(|e| map_error("read the schema version", e))?;
    let application: i64 = connection
        .query_row("PRAGMA application_id", [], |row| row.get(0))
        .map_err(|e| map_error("read the application id", e))?;
    if version != 0 && application != sql::APPLICATION_ID {
        return Err(StoreError::new(
            ErrorKind::Schema,
            format!(
                "the database belongs to another application (application_id {application:#x}, user_version {version})"
            ),
        ));
    }
    match version {
        sql::SCHEMA_VERSION => Ok(()),
        0 => {
            connection
                .execute_batch(&format!(
                    "BEGIN IMMEDIATE;
                     {}
                     PRAGMA application_id = {};
                     PRAGMA user_version = {};
                     COMMIT;",
                    sql::SCHEMA_V1,
                    sql::APPLICATION_ID,
                    sql::SCHEMA_VERSION
                ))
                .map_err(|e| {
                    let _ = connection.execute_batch("ROLLBACK");
                    map_error("create the schema", e)
                })?;
            tracing::info!(version = sql::SCHEMA_VERSION, "created the SQLite schema");
            Ok(())
        }
        newer => Err(StoreError::new(
            ErrorKind::Schema,
            format!(
                "the database has schema version {newer}, newer than this version understands ({})",
                sql::SCHEMA_VERSION
            ),
        )),
    }
}

fn select_record(connection: &Connection, scope: &Scope, key: &Key) -> Result<Option<Record>, StoreError> {
    let mut statement = connection
        .prepare_cached(sql::SELECT_RECORD)
        .map_err(|e| map_error("prepare select", e))?;
    statement
        .query_row(params![scope.as_str(), key.as_str()], |row| {
            Ok(decode_record(row))
        })
        .optional()
        .map_err(|e| map_error("read a record", e))?
        .transpose()
}

fn upsert_record(connection: &Connection, record: &Record) -> Result<(), StoreError> {
    let (token, completed, acquired_at, lease_until, completed_at, outcome) = match &record.state {
        RecordState::InFlight {
            token,
            acquired_at,
            lease_until,
        } => (token, false, Some(*acquired_at), Some(*lease_until), None, None),
        RecordState::Completed {
            token,
            outcome,
            completed_at,
        } => (
            token,
            true,
            None,
            None,
            Some(*completed_at),
            Some(outcome.as_bytes()),
        ),
    };
    let mut statement = connection
        .prepare_cached(sql::UPSERT_RECORD)
        .map_err(|e| map_error("prepare upsert", e))?;
    statement
        .execute(params![
            record.scope.as_str(),
            record.key.as_str(),
            &record.fingerprint.as_bytes()[..],
            record.attempt,
            record.created_at.unix_millis(),
            record.expires_at.unix_millis(),
            &token.to_bytes()[..],
            completed,
            acquired_at.map(Timestamp::unix_millis),
            lease_until.map(Timestamp::unix_millis),
            completed_at.map(Timestamp::unix_millis),
            outcome,
        ])
        .map_err(|e| map_error("write a record", e))?;
    Ok(())
}

/// The record columns of `SELECT_RECORD` and `LIST`; `at` is the index of `completed` (`LIST`
/// has no token column before it).
fn decode_parts(row: &Row<'_>, at: usize) -> Result<RecordParts, StoreError> {
    let read = |e| map_error("decode a record", e);
    let fingerprint: Vec<u8> = row.get(2).map_err(read)?;
    Ok(RecordParts {
        scope: row.get(0).map_err(read)?,
        key: row.get(1).map_err(read)?,
        fingerprint: Fingerprint::from_slice(&fingerprint)?,
        attempt: row.get(3).map_err(read)?,
        created_at: row.get(4).map_err(read)?,
        expires_at: row.get(5).map_err(read)?,
        completed: row.get(at).map_err(read)?,
        acquired_at: row.get(at + 1).map_err(read)?,
        lease_until: row.get(at + 2).map_err(read)?,
        completed_at: row.get(at + 3).map_err(read)?,
    })
}

fn decode_record(row: &Row<'_>) -> Result<Record, StoreError> {
    let read = |e| map_error("decode a record", e);
    let parts = decode_parts(row, 7)?;
    let token: Vec<u8> = row.get(6).map_err(read)?;
    let outcome: Option<Vec<u8>> = row.get(11).map_err(read)?;
    Ok(parts.into_record(Token::from_slice(&token)?, outcome.map(Outcome::new))?)
}

fn decode_summary(row: &Row<'_>) -> Result<RecordSummary, StoreError> {
    let parts = decode_parts(row, 6)?;
    let outcome_len = row.get(10).map_err(|e| map_error("decode a record", e))?;
    Ok(parts.into_summary(outcome_len)?)
}

/// Classifies a SQLite error; `doing` says what the store was doing.
pub(crate) fn map_error(doing: &str, error: rusqlite::Error) -> StoreError {
    use rusqlite::ErrorCode;
    let kind = match &error {
        rusqlite::Error::SqliteFailure(failure, _) => match failure.code {
            ErrorCode::NotADatabase | ErrorCode::DatabaseCorrupt => ErrorKind::Corrupt,
            ErrorCode::ReadOnly | ErrorCode::PermissionDenied => ErrorKind::ReadOnly,
            ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked => ErrorKind::Timeout,
            ErrorCode::CannotOpen => ErrorKind::InvalidConfig,
            _ => ErrorKind::Backend,
        },
        rusqlite::Error::InvalidColumnType(..) | rusqlite::Error::FromSqlConversionFailure(..) => {
            ErrorKind::Corrupt
        }
        _ => ErrorKind::Backend,
    };
    let hint = match kind {
        ErrorKind::Corrupt => " (the file is not a healthy SQLite database)",
        ErrorKind::Timeout => " (another process holds the write lock; retry later)",
        _ => "",
    };
    StoreError::new(kind, format!("{doing}: {error}{hint}")).with_source(error)
}
