//! What the sqlx-based stores (PostgreSQL, MySQL) share once their server has answered
//! (feature `sqlx`): classifying sqlx's errors, decoding the rows every such store selects in
//! the same column order, and the reads and the purge those rows come from ([`admin`]).
//!
//! The stores differ in their statements (one statement per operation on PostgreSQL, a read
//! then a write under a row lock on MySQL), their placeholders and their servers' error codes;
//! they do not differ in what a row means. A store selects, from column `at`:
//!
//! | offset | record ([`record`]) | summary ([`summary`], `at` = 0) |
//! | --- | --- | --- |
//! | 0, 1 | scope, key (text) | scope, key |
//! | 2 | fingerprint (bytes) | fingerprint |
//! | 3 | attempt (`i64`) | attempt |
//! | 4, 5 | created, expires (Unix ms, `i64`) | created, expires |
//! | 6 | token (bytes) | completed (bool) |
//! | 7 | completed (bool) | acquired ms or NULL |
//! | 8, 9, 10 | acquired, lease until, completed ms or NULL | lease until, completed ms, outcome length (`i64`) or NULL |
//! | 11 | outcome (bytes) or NULL | |
//!
//! and [`stats`] reads expired, in flight, stale leases, completed (counts), the oldest
//! acquisition in flight (ms or NULL) and the server's time (ms). Integers are read as `i64`
//! on every server: a store whose column is narrower casts it in the statement.

pub mod admin;

use std::time::Duration;

use futures_util::future::BoxFuture;
use sqlx::error::DatabaseError;
use sqlx::{ColumnIndex, Decode, Row, Type};

use crate::connections::{AfterConnect, Connections, MapError};
use crate::{
    ErrorKind, Fenced, Fingerprint, Lanes, Outcome, Record, RecordParts, RecordSummary, Stats, StoreError,
    Timestamp, Token, redact_url,
};

/// Classifies `error`; `doing` says what the store was doing, `server` classifies the server's
/// own errors (by SQLSTATE, error number…) into a kind and a message. Messages never contain a
/// password: sqlx does not put one in its errors, and URLs are redacted before they get here.
pub fn map_error(
    doing: &str,
    error: sqlx::Error,
    server: impl FnOnce(&dyn DatabaseError) -> (ErrorKind, String),
) -> StoreError {
    let (kind, detail) = match &error {
        sqlx::Error::Database(db) => server(db.as_ref()),
        sqlx::Error::Io(io) => (ErrorKind::Unavailable, format!("connection failed: {io}")),
        sqlx::Error::Tls(tls) => (ErrorKind::Unavailable, format!("TLS failed: {tls}")),
        sqlx::Error::PoolTimedOut => (
            ErrorKind::Timeout,
            "no pooled connection became free in time (pool exhausted or server unreachable)".into(),
        ),
        sqlx::Error::PoolClosed => (ErrorKind::Unavailable, "the connection pool is closed".into()),
        sqlx::Error::WorkerCrashed => (ErrorKind::Unavailable, "the connection's worker crashed".into()),
        sqlx::Error::Configuration(e) => (ErrorKind::InvalidConfig, e.to_string()),
        sqlx::Error::Protocol(message) => (ErrorKind::Unavailable, format!("protocol error: {message}")),
        sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_) | sqlx::Error::ColumnNotFound(_) => {
            (ErrorKind::Protocol, error.to_string())
        }
        _ => (ErrorKind::Backend, error.to_string()),
    };
    StoreError::new(kind, format!("{doing}: {detail}")).with_source(error)
}

/// Runs a batch in one transaction on `connection`: `each` for every call (with `store`, what
/// the calls share, such as the store's statements), in [`lock_order`](crate::lock_order) (so
/// that two batches never deadlock on each other), then one commit; the answers come back in
/// the batch's order. A failure of any call or of the commit ends the transaction unfinished
/// (the connection rolls it back) and is the answer of the whole batch: none of its writes
/// took effect, or, when the commit failed, which did is unknown, as for a single call that
/// fails.
///
/// # Errors
///
/// The first failure: beginning the transaction, a call, or the commit (`map_error` names the
/// server's).
pub async fn in_one_transaction<DB, X, T, R>(
    connection: &mut DB::Connection,
    store: &X,
    batch: &[T],
    map_error: MapError,
    mut each: impl for<'c> FnMut(&'c mut DB::Connection, &'c X, &'c T) -> BoxFuture<'c, Result<R, StoreError>>
    + Send,
) -> Result<Vec<R>, StoreError>
where
    DB: sqlx::Database,
    X: Sync + ?Sized,
    T: crate::BatchCall + Sync,
    R: Send,
{
    use sqlx::Connection as _;

    let mut tx = connection
        .begin()
        .await
        .map_err(|e| map_error("begin a batch's transaction", e))?;
    let mut answers: Vec<Option<R>> = std::iter::repeat_with(|| None).take(batch.len()).collect();
    for at in crate::lock_order(batch) {
        answers[at] = Some(each(&mut tx, store, &batch[at]).await?);
    }
    tx.commit().await.map_err(|e| map_error("commit a batch", e))?;
    Ok(answers
        .into_iter()
        .map(|answer| answer.unwrap_or_else(|| unreachable!("lock_order names every call once")))
        .collect())
}

/// What [`savepoint`] does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Savepoint {
    /// Sets the savepoint (`SAVEPOINT`).
    Set,
    /// Undoes what the transaction wrote since the latest one (`ROLLBACK TO SAVEPOINT`).
    RollBack,
}

/// Sets, or rolls back to, the savepoint a same-transaction batch sets before each operation
/// ([`TransactionalStore::savepoint`](crate::TransactionalStore::savepoint)), on the
/// transaction's `connection`. The statement is the same on PostgreSQL and MySQL.
///
/// # Errors
///
/// The server's, as `map_error` names it.
pub async fn savepoint<DB>(
    connection: &mut DB::Connection,
    action: Savepoint,
    map_error: MapError,
) -> Result<(), StoreError>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let (statement, doing) = match action {
        Savepoint::Set => ("SAVEPOINT idempotency_operation", "set a savepoint"),
        Savepoint::RollBack => (
            "ROLLBACK TO SAVEPOINT idempotency_operation",
            "roll back to the savepoint",
        ),
    };
    sqlx::raw_sql(statement)
        .execute(connection)
        .await
        .map(drop)
        .map_err(|e| map_error(doing, e))
}

/// The answer of a fenced write that touches at most one row (a release, a withdrawal): the
/// token held the record when it wrote one.
pub fn fenced_by_rows(rows_affected: u64) -> Fenced<()> {
    Fenced::accepted_if(rows_affected == 1)
}

/// Takes back a claim made in the transaction `connection` is in
/// ([`TransactionalStore::withdraw_in`](crate::TransactionalStore::withdraw_in)): a first
/// attempt's record is deleted ([`admin::Action::Withdraw`]), as if the key had never been
/// claimed; a later attempt's is released ([`admin::release_on`]), since the record of the
/// attempts before it must stay. Withdrawn when the token still held the record;
/// [`Fenced::LeaseLost`] when it no longer did.
///
/// # Errors
///
/// The server's, as the store's [`map_error`](crate::connections::Connections::map_error) classifies them.
pub async fn withdraw<S: admin::SqlActions>(
    store: &S,
    connection: &mut <S::Engine as sqlx::Database>::Connection,
    held: &crate::Held,
) -> Result<Fenced<()>, StoreError> {
    if held.attempt != 1 {
        return admin::release_on(store, connection, held).await;
    }
    let token = held.token.to_bytes();
    let params = [
        admin::Param::Text(Some(held.scope.as_str())),
        admin::Param::Text(Some(held.key.as_str())),
        admin::Param::Bytes(Some(&token[..])),
    ];
    admin::fenced_write(
        store,
        connection,
        admin::Action::Withdraw,
        "withdraw a claim",
        &params,
    )
    .await
}

/// The options of an SQL store's pool: at most `max_connections`, waiting at most
/// `acquire_timeout` for one, and no ping before each statement: it doubles the round trips
/// of a replay. A connection the server closed fails its next statement with a retryable
/// error and is dropped from the pool (each store's `tests/it/connection_loss.rs`).
#[must_use]
pub fn pool_options<DB: sqlx::Database>(
    max_connections: u32,
    acquire_timeout: Duration,
) -> sqlx::pool::PoolOptions<DB> {
    sqlx::pool::PoolOptions::new()
        .test_before_acquire(false)
        .max_connections(max_connections)
        .acquire_timeout(acquire_timeout)
}

/// How a sqlx-based store sizes what it runs on: at most `max` connections of its own,
/// `reserved` of them kept for lease-keeping ([`Lanes`]), and how long an operation waits
/// for one. The options' [`sql_pool_options!`](crate::sql_pool_options) setters set them;
/// `sizes()` reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizes {
    /// The most connections the store's operations use.
    pub max: u32,
    /// The connections kept for lease-keeping.
    pub reserved: u32,
    /// How long an operation waits for a connection, and new work for its lane.
    pub wait: Duration,
}

/// What a sqlx-based store runs on.
#[derive(Debug)]
pub struct Pools<DB: sqlx::Database> {
    /// The application's pool: its transactions (and the store's same-transaction operations)
    /// and the schema's creation run here.
    pub pool: sqlx::Pool<DB>,
    /// The store's own operations run here: connections that go back without a ping.
    pub connections: Connections<DB::Connection>,
    /// `begin` and the reads take a place here; lease-keeping does not, so the store always
    /// has connections left for it.
    pub lanes: Lanes,
}

impl<DB: sqlx::Database> Clone for Pools<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            connections: self.connections.clone(),
            lanes: self.lanes.clone(),
        }
    }
}

impl<DB: sqlx::Database> Pools<DB> {
    /// Beside the application's `pool`: connections of the store's own, as many as `sizes`
    /// says, opened with `options` (the pool's, or the store's own variant of them) and
    /// prepared by `after_connect`, replaced once older than the pool's `max_lifetime`, and
    /// [`Lanes`] over them. `store` labels the connections' metrics (`postgres`, `mysql`);
    /// `map_error` names a failure to connect.
    #[must_use]
    pub fn new(
        store: &'static str,
        pool: sqlx::Pool<DB>,
        options: std::sync::Arc<<DB::Connection as sqlx::Connection>::Options>,
        after_connect: Option<AfterConnect<DB::Connection>>,
        sizes: Sizes,
        map_error: MapError,
    ) -> Self {
        let connections = Connections::new(
            store,
            options,
            after_connect,
            usize::try_from(sizes.max).unwrap_or(usize::MAX),
            sizes.wait,
            pool.options().get_max_lifetime(),
            map_error,
        );
        Self {
            pool,
            connections,
            lanes: Lanes::new(sizes.max, sizes.reserved, sizes.wait),
        }
    }

    /// Runs `operation` on one of the store's [`connections`](Self::connections) without a
    /// lane: lease-keeping (`complete`, `extend`, `release`) never waits behind new work.
    ///
    /// # Errors
    ///
    /// As [`Connections::run`].
    pub async fn run<T>(
        &self,
        operation: impl AsyncFnOnce(&mut DB::Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.connections.run(operation).await
    }

    /// Runs new work (`begin`, a read) on one of the store's connections, after its place in
    /// the [`lanes`](Self::lanes).
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Overloaded`] when no lane became free within the wait; as
    /// [`Connections::run`] otherwise.
    pub async fn run_new<T>(
        &self,
        operation: impl AsyncFnOnce(&mut DB::Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let _lane = self.lanes.new_work().await?;
        self.connections.run(operation).await
    }
}

/// A store URL's connection options, as the SQL stores read them: the scheme must be one of
/// `schemes`, and the driver (`parse`) is handed the URL under the first of them (so
/// `mariadb://` reads as `mysql://`); then the PEM files its `pem_parameters` name are checked
/// ([`check_pem_files`]). `engine` names the server in errors.
///
/// # Errors
///
/// [`ErrorKind::InvalidConfig`] for another scheme, a URL the driver refuses or a PEM file
/// that cannot be read. No message contains the password.
pub fn parse_url<O>(
    url: &str,
    engine: &str,
    schemes: &[&str],
    pem_parameters: &[&str],
    parse: impl FnOnce(&str) -> Result<O, sqlx::Error>,
) -> Result<O, StoreError> {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    if !schemes.contains(&scheme) {
        let schemes: Vec<String> = schemes.iter().map(|scheme| format!("{scheme}://")).collect();
        return Err(StoreError::new(
            ErrorKind::InvalidConfig,
            format!("`{}` is not a {} URL", redact_url(url), schemes.join(" or ")),
        ));
    }
    let options = parse(&format!("{}://{rest}", schemes[0])).map_err(|error| {
        StoreError::new(
            ErrorKind::InvalidConfig,
            format!(
                "malformed {engine} URL `{}`: {}",
                redact_url(url),
                redact_url(&error.to_string())
            ),
        )
    })?;
    check_pem_files(url, pem_parameters)?;
    Ok(options)
}

/// The group-commit parameters of a SQL store's URL, and the URL without them (the driver's
/// parameters left exactly as given):
///
/// | parameter | meaning | default |
/// | --- | --- | --- |
/// | `batch=on\|off` | concurrent `begin`s and `complete`s go to the store in batches ([`GroupCommit`](crate::GroupCommit)) | `default` |
/// | `batch_linger=DURATION` | how long the first call of a window waits for others at the most (`0ms` to `1s`) | `1ms` |
/// | `batch_max=N` | the most calls in one batch (1 to 1000) | 64 |
/// | `batch_in_flight=N` | calls or batches of each kind at the store at once (1 to 64) | 2 |
///
/// `None` when batching is off.
///
/// ```
/// use std::time::Duration;
///
/// let (url, group) = idempotency_core::sql::group_commit_parameters(
///     "postgres://db/app?sslmode=require&batch=on&batch_linger=2ms",
///     false,
/// )?;
/// assert_eq!(url, "postgres://db/app?sslmode=require");
/// assert_eq!(group.map(|settings| settings.linger), Some(Duration::from_millis(2)));
/// # Ok::<(), idempotency_core::StoreError>(())
/// ```
///
/// # Errors
///
/// [`ErrorKind::InvalidConfig`] naming the parameter and what it takes, for a value out of
/// range or a `batch_*` setting on a URL whose `batch` is off.
pub fn group_commit_parameters(
    url: &str,
    default: bool,
) -> Result<(String, Option<crate::GroupSettings>), StoreError> {
    let refuse = |why: String| StoreError::new(ErrorKind::InvalidConfig, why);
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), default.then(crate::GroupSettings::default)));
    };
    let mut on = default;
    let mut settings = crate::GroupSettings::default();
    let mut tuned = None;
    let mut rest = Vec::new();
    for pair in query.split('&') {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let number = |low: usize, high: usize| {
            value
                .parse::<usize>()
                .ok()
                .filter(|n| (low..=high).contains(n))
                .ok_or_else(|| {
                    refuse(format!(
                        "`{name}` is a whole number from {low} to {high}, not `{value}`"
                    ))
                })
        };
        match name {
            "batch" => {
                on = match value {
                    "on" => true,
                    "off" => false,
                    other => return Err(refuse(format!("`batch` is `on` or `off`, not `{other}`"))),
                };
            }
            "batch_linger" => {
                let linger = crate::units::parse_duration(value)
                    .ok()
                    .filter(|linger| *linger <= crate::group_commit::MAX_LINGER)
                    .ok_or_else(|| {
                        refuse(format!(
                            "`batch_linger` is a duration from 0ms to 1s, not `{value}`"
                        ))
                    })?;
                settings = settings.linger(linger);
                tuned = Some(name);
            }
            "batch_max" => {
                settings = settings.max_batch(number(1, crate::group_commit::MAX_BATCH)?);
                tuned = Some(name);
            }
            "batch_in_flight" => {
                settings = settings.in_flight(number(1, crate::group_commit::MAX_IN_FLIGHT)?);
                tuned = Some(name);
            }
            _ => rest.push(pair),
        }
    }
    if let (false, Some(name)) = (on, tuned) {
        return Err(refuse(format!(
            "`{name}` tunes batching, which this URL turns off (`batch=off`)"
        )));
    }
    let url = if rest.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", rest.join("&"))
    };
    Ok((url, on.then_some(settings)))
}

/// Checks the PEM files a connection URL names (its query parameters in `parameters`, such as
/// `sslrootcert`): each must be a readable file holding a PEM block. The driver would otherwise
/// find out only when it connects, and say "No such file or directory" without the file.
///
/// # Errors
///
/// [`ErrorKind::InvalidConfig`] naming the parameter, the path and the reason (never the file's
/// content).
pub fn check_pem_files(url: &str, parameters: &[&str]) -> Result<(), StoreError> {
    let Some((_, query)) = url.split_once('?') else {
        return Ok(());
    };
    for pair in query.split('&') {
        let Some((name, value)) = pair.split_once('=') else {
            continue;
        };
        if !parameters.contains(&name) || value.is_empty() {
            continue;
        }
        let path = percent_decoded(value);
        let refuse =
            |why: String| StoreError::new(ErrorKind::InvalidConfig, format!("`{name}` {path}: {why}"));
        crate::pem::check_file(path.as_ref()).map_err(|why| refuse(why.to_string()))?;
    }
    Ok(())
}

/// `text` with its `%XX` escapes decoded (and `+` left as it is, as in a URL's path).
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| char::from(b).to_digit(16);
        match (
            bytes[i],
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(high), Some(low)) => {
                out.push(u8::try_from(high * 16 + low).unwrap_or(b'?'));
                i += 3;
            }
            (byte, _, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The columns of a record in the order [`record`] decodes them (the table above), selected
/// from the table's alias `r`: `key` and `attempt` as the engine must name them (quoted, cast to
/// a 64-bit integer) and each time through `ms`, the engine's expression for its Unix
/// milliseconds.
///
/// ```
/// let ms = |column: &str| format!("ms({column})");
/// let columns = idempotency_core::sql::record_columns("r.key", "r.attempt", ms);
/// assert!(columns.starts_with("r.scope, r.key, r.fingerprint, r.attempt, ms(r.created_at), "));
/// assert!(columns.ends_with(", ms(r.completed_at), r.outcome"));
/// ```
pub fn record_columns(key: &str, attempt: &str, ms: impl Fn(&str) -> String) -> String {
    format!(
        "r.scope, {key}, r.fingerprint, {attempt}, {}, {}, r.token, r.completed, {}, {}, {}, r.outcome",
        ms("r.created_at"),
        ms("r.expires_at"),
        ms("r.acquired_at"),
        ms("r.lease_until"),
        ms("r.completed_at"),
    )
}

/// The comment that marks a records table of schema `version` on the servers that keep it in
/// the table's comment (PostgreSQL, MySQL): `migrate` writes it, and a store refuses a table
/// whose comment is another version's.
#[must_use]
pub fn version_comment(version: u32) -> String {
    format!("idempotency records v{version}")
}

/// Column `index` of `row` as `T`; a decode error is [`ErrorKind::Protocol`], saying `doing`.
pub(crate) fn column<'r, R, T>(row: &'r R, index: usize, doing: &str) -> Result<T, StoreError>
where
    R: Row,
    usize: ColumnIndex<R>,
    T: Decode<'r, R::Database> + Type<R::Database>,
{
    row.try_get(index)
        .map_err(|e| map_error(doing, e, |db| (ErrorKind::Backend, db.message().to_owned())))
}

const DECODE: &str = "decode a record";

/// The record columns from column `at` to `completed`, then the state's times starting `times`
/// columns after `at` (8 in a record, 7 in a summary).
fn parts<'r, R>(row: &'r R, at: usize, times: usize) -> Result<RecordParts, StoreError>
where
    R: Row,
    usize: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    bool: Decode<'r, R::Database> + Type<R::Database>,
{
    let fingerprint: Vec<u8> = column(row, at + 2, DECODE)?;
    Ok(RecordParts {
        scope: column(row, at, DECODE)?,
        key: column(row, at + 1, DECODE)?,
        fingerprint: Fingerprint::from_slice(&fingerprint)?,
        attempt: column(row, at + 3, DECODE)?,
        created_at: column(row, at + 4, DECODE)?,
        expires_at: column(row, at + 5, DECODE)?,
        completed: column(row, at + times - 1, DECODE)?,
        acquired_at: column(row, at + times, DECODE)?,
        lease_until: column(row, at + times + 1, DECODE)?,
        completed_at: column(row, at + times + 2, DECODE)?,
    })
}

/// The record whose twelve columns start at column `at` (see the table above).
///
/// # Errors
///
/// [`ErrorKind::Protocol`] when a column does not decode; [`ErrorKind::Corrupt`] when the
/// columns are not a valid record.
pub fn record<'r, R>(row: &'r R, at: usize) -> Result<Record, StoreError>
where
    R: Row,
    usize: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    bool: Decode<'r, R::Database> + Type<R::Database>,
{
    let parts = parts(row, at, 8)?;
    let token: Vec<u8> = column(row, at + 6, DECODE)?;
    let outcome: Option<Vec<u8>> = column(row, at + 11, DECODE)?;
    Ok(parts.into_record(Token::from_slice(&token)?, outcome.map(Outcome::new))?)
}

/// The summary a `list` row holds (see the table above).
///
/// # Errors
///
/// As [`record`].
pub fn summary<'r, R>(row: &'r R) -> Result<RecordSummary, StoreError>
where
    R: Row,
    usize: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    bool: Decode<'r, R::Database> + Type<R::Database>,
{
    let parts = parts(row, 0, 7)?;
    let len: Option<i64> = column(row, 10, DECODE)?;
    Ok(parts.into_summary(len)?)
}

/// The statistics a `stats` row holds (see above); a negative count reads as 0.
///
/// # Errors
///
/// [`ErrorKind::Protocol`] when a column does not decode.
pub fn stats<'r, R>(row: &'r R) -> Result<Stats, StoreError>
where
    R: Row,
    usize: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    const DOING: &str = "decode stats";
    let count = |i: usize| -> Result<u64, StoreError> {
        let n: i64 = column(row, i, DOING)?;
        Ok(u64::try_from(n).unwrap_or(0))
    };
    let oldest: Option<i64> = column(row, 4, DOING)?;
    let now = Timestamp::from_unix_millis(column(row, 5, DOING)?);
    Ok(Stats {
        expired: count(0)?,
        in_flight: count(1)?,
        stale_leases: count(2)?,
        completed: count(3)?,
        oldest_in_flight: oldest.map(|ms| now.since(Timestamp::from_unix_millis(ms))),
    })
}

/// Implements `Debug` for a sqlx-based store's options without the credentials: the server's
/// host, port and database from the options' `connect` (whose own `Debug`, the driver's, prints
/// the password), then the fields named. As `idempotency-mysql` expands it:
///
/// ```text
/// idempotency_core::sql_options_debug!(MysqlOptions {
///     table, max_connections, acquire_timeout, lease_connections, migrate, access
/// });
/// ```
#[macro_export]
macro_rules! sql_options_debug {
    ($options:ident { $($field:ident),* $(,)? }) => {
        impl ::std::fmt::Debug for $options {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.debug_struct(stringify!($options))
                    .field("host", &self.connect.get_host())
                    .field("port", &self.connect.get_port())
                    .field("database", &self.connect.get_database())
                    $(.field(stringify!($field), &self.$field))*
                    .finish()
            }
        }
    };
}

/// A sqlx-based store's options at their defaults, written once: the fields named, then the
/// records table `idempotency_records`, 16 connections of which 4 kept for lease-keeping, a 5 s
/// wait for a connection, `migrate` on, [`Access::Create`](crate::Access::Create) and no group
/// commit. As
/// `idempotency-postgres` expands it:
///
/// ```text
/// idempotency_core::sql_options_defaults!(Self {
///     connect,
///     schema: Identifier::new("public").expect("a valid identifier"),
/// })
/// ```
#[macro_export]
macro_rules! sql_options_defaults {
    ($options:ident { $($field:ident $(: $value:expr)?),* $(,)? }) => {
        $options {
            $($field $(: $value)?,)*
            table: $crate::Identifier::new("idempotency_records").expect("a valid identifier"),
            max_connections: 16,
            acquire_timeout: ::std::time::Duration::from_secs(5),
            lease_connections: 4,
            migrate: true,
            access: $crate::Access::Create,
            group_commit: None,
        }
    };
}

/// The builder methods every sqlx-based store's options share, written once: `table`,
/// `max_connections`, `lease_connections`, `acquire_timeout`, `access` and `migrate`, the
/// `sizes()` they set and, for the store's `connect`, a crate-private `prepare`; for a
/// struct with the fields `table: Identifier`, `max_connections: u32`, `lease_connections: u32`,
/// `acquire_timeout: Duration`, `access: Access` and `migrate: bool`. Expanded inside the
/// options' `impl` block, as `idempotency-postgres` and `idempotency-mysql` do:
///
/// ```text
/// impl PostgresOptions {
///     idempotency_core::sql_pool_options!();
/// }
/// ```
#[macro_export]
macro_rules! sql_pool_options {
    () => {
        /// Sets the records table.
        ///
        /// # Errors
        ///
        /// As [`Identifier::new`](idempotency_core::Identifier::new).
        pub fn table(mut self, table: &str) -> ::std::result::Result<Self, $crate::StoreError> {
            self.table = $crate::Identifier::new(table)?;
            Ok(self)
        }

        /// Sets the pool size, and keeps a quarter of it (at least 1) for lease-keeping.
        #[must_use]
        pub fn max_connections(mut self, max: u32) -> Self {
            self.max_connections = max.max(1);
            self.lease_connections = (self.max_connections / 4).max(1);
            self
        }

        /// Sets how many connections are kept for lease-keeping (call after
        /// [`max_connections`](Self::max_connections)); new work keeps at least one.
        #[must_use]
        pub fn lease_connections(mut self, reserved: u32) -> Self {
            self.lease_connections = reserved;
            self
        }

        /// Sets how long an operation waits for a pooled connection.
        #[must_use]
        pub fn acquire_timeout(mut self, timeout: ::std::time::Duration) -> Self {
            self.acquire_timeout = timeout;
            self
        }

        /// The sizes of the store's connections and lanes, as set.
        #[must_use]
        pub fn sizes(&self) -> $crate::sql::Sizes {
            $crate::sql::Sizes {
                max: self.max_connections,
                reserved: self.lease_connections,
                wait: self.acquire_timeout,
            }
        }

        /// What `connect` does once its pool is up, as these options say: with
        /// [`Access::Create`](idempotency_core::Access::Create) it runs `migration` (unless
        /// `migrate` is false); with any other access only `check_table`, which refuses a
        /// database without the records table and creates nothing.
        pub(crate) async fn prepare(
            &self,
            check_table: impl ::std::future::Future<Output = ::std::result::Result<(), $crate::StoreError>>,
            migration: impl ::std::future::Future<Output = ::std::result::Result<(), $crate::StoreError>>,
        ) -> ::std::result::Result<(), $crate::StoreError> {
            if self.access != $crate::Access::Create {
                check_table.await
            } else if self.migrate {
                migration.await
            } else {
                Ok(())
            }
        }

        /// Sets what connecting may do.
        #[must_use]
        pub fn access(mut self, access: $crate::Access) -> Self {
            self.access = access;
            self
        }

        /// Sets whether `connect` creates the table, or upgrades it, before it answers (the
        /// default: yes); with `false` the table is used as it is.
        #[must_use]
        pub fn migrate(mut self, migrate: bool) -> Self {
            self.migrate = migrate;
            self
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(error: sqlx::Error) -> ErrorKind {
        map_error("test", error, |_| unreachable!("not a server error")).kind()
    }

    #[test]
    fn group_commit_parameters_are_taken_out_of_the_url_and_the_rest_is_left_as_given() {
        let read = |url: &str, default| group_commit_parameters(url, default).expect(url);
        // Off by default: the URL is the driver's, exactly as given.
        assert_eq!(
            read("postgres://u:p@db/app?sslmode=require", false),
            ("postgres://u:p@db/app?sslmode=require".into(), None)
        );
        assert_eq!(
            read("mysql://db/app", true),
            ("mysql://db/app".into(), Some(crate::GroupSettings::default()))
        );
        let (url, settings) = read(
            "mysql://db/app?batch=on&ssl-mode=required&batch_max=16&batch_linger=0ms&batch_in_flight=4",
            false,
        );
        assert_eq!(url, "mysql://db/app?ssl-mode=required");
        let settings = settings.expect("on");
        assert_eq!(
            (settings.max_batch, settings.linger, settings.in_flight),
            (16, Duration::ZERO, 4)
        );
        assert_eq!(
            read("postgres://db/app?batch=off", true),
            ("postgres://db/app".into(), None)
        );
    }

    #[test]
    fn malformed_group_commit_parameters_are_refused_naming_the_parameter() {
        for (url, says) in [
            (
                "postgres://db/app?batch=yes",
                "`batch` is `on` or `off`, not `yes`",
            ),
            ("postgres://db/app?batch", "`batch` is `on` or `off`, not ``"),
            (
                "postgres://db/app?batch=on&batch_max=0",
                "`batch_max` is a whole number from 1 to 1000, not `0`",
            ),
            (
                "postgres://db/app?batch=on&batch_max=1001",
                "from 1 to 1000, not `1001`",
            ),
            ("postgres://db/app?batch=on&batch_max=-3", "not `-3`"),
            (
                "postgres://db/app?batch=on&batch_in_flight=65",
                "`batch_in_flight` is a whole number from 1 to 64",
            ),
            (
                "postgres://db/app?batch=on&batch_linger=2s",
                "`batch_linger` is a duration from 0ms to 1s, not `2s`",
            ),
            ("postgres://db/app?batch=on&batch_linger=fast", "not `fast`"),
            (
                "postgres://db/app?batch=on&batch_linger=99999999999999999999d",
                "from 0ms to 1s",
            ),
            (
                "postgres://db/app?batch_max=8",
                "`batch_max` tunes batching, which this URL turns off",
            ),
            (
                "postgres://db/app?batch=on&batch_linger=1ms&batch=off",
                "`batch_linger` tunes batching",
            ),
        ] {
            let error = group_commit_parameters(url, false).expect_err(url);
            assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{url}");
            assert!(error.to_string().contains(says), "{url}: {error}");
        }
    }

    #[test]
    fn store_urls_are_checked_before_the_driver_sees_them_and_never_echo_passwords() {
        const SCHEMES: [&str; 2] = ["mysql", "mariadb"];
        let seen = parse_url("mariadb://app:s3cret@db/x", "MySQL", &SCHEMES, &[], |url| {
            Ok(url.to_owned())
        });
        assert_eq!(
            seen.unwrap(),
            "mysql://app:s3cret@db/x",
            "the driver gets the first scheme"
        );

        // The message of a refused URL: always a configuration error, never the password.
        let refused = |url: &str, pem: &[&str], driver: fn(&str) -> Result<(), sqlx::Error>| {
            let error = parse_url(url, "MySQL", &SCHEMES, pem, driver).unwrap_err();
            assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{url}");
            assert!(!error.to_string().contains("s3cret"), "{url}: {error}");
            error.to_string()
        };
        let foreign = refused("postgres://app:s3cret@db/x", &[], |_| {
            unreachable!("a foreign scheme never reaches the driver")
        });
        assert!(
            foreign.contains("is not a mysql:// or mariadb:// URL"),
            "{foreign}"
        );
        let malformed = refused("mysql://app:s3cret@db:port/x", &[], |_| {
            Err(sqlx::Error::Configuration(
                "bad port in mysql://app:s3cret@db:port/x".into(),
            ))
        });
        assert!(
            malformed.contains("malformed MySQL URL `mysql://app:***@db:port/x`"),
            "{malformed}"
        );
        let missing = refused("mysql://db/x?ssl-ca=/nonexistent/ca.pem", &["ssl-ca"], |_| Ok(()));
        assert!(missing.contains("/nonexistent/ca.pem"), "{missing}");
    }

    #[test]
    fn errors_without_a_server_code_map_to_kinds() {
        assert_eq!(kind(sqlx::Error::PoolTimedOut), ErrorKind::Timeout);
        assert_eq!(kind(sqlx::Error::PoolClosed), ErrorKind::Unavailable);
        assert_eq!(kind(sqlx::Error::Protocol("eof".into())), ErrorKind::Unavailable);
        assert_eq!(
            kind(sqlx::Error::ColumnNotFound("scope".into())),
            ErrorKind::Protocol
        );
        assert_eq!(
            kind(sqlx::Error::Io(std::io::Error::from(
                std::io::ErrorKind::ConnectionRefused
            ))),
            ErrorKind::Unavailable
        );
        assert_eq!(kind(sqlx::Error::RowNotFound), ErrorKind::Backend);
    }

    #[test]
    fn certificate_files_named_in_a_url_are_checked_with_the_path_and_the_reason() {
        let dir = std::env::temp_dir().join(format!("idem-pem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (pem, text) = (dir.join("ca.pem"), dir.join("not a pem.txt"));
        std::fs::write(
            &pem,
            "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        std::fs::write(&text, "S3CRET").unwrap();
        let names = ["sslrootcert", "sslkey"];
        let url = |query: String| format!("postgres://h/db?sslmode=verify-full&{query}");
        assert!(check_pem_files(&url(format!("sslrootcert={}", pem.display())), &names).is_ok());
        assert!(check_pem_files("postgres://h/db", &names).is_ok());
        let missing = check_pem_files(&url("sslrootcert=/nonexistent/ca.pem".into()), &names).unwrap_err();
        assert_eq!(missing.kind(), ErrorKind::InvalidConfig);
        assert!(
            missing
                .to_string()
                .contains("`sslrootcert` /nonexistent/ca.pem: No such file"),
            "{missing}"
        );
        let escaped = text.display().to_string().replace(' ', "%20");
        let not_pem = check_pem_files(&url(format!("sslkey={escaped}")), &names).unwrap_err();
        assert!(
            not_pem.to_string().contains("not a pem.txt: not a PEM file"),
            "{not_pem}"
        );
        assert!(!not_pem.to_string().contains("S3CRET"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_message_says_what_the_store_was_doing() {
        let error = map_error("read the server's clock", sqlx::Error::PoolClosed, |_| {
            unreachable!("not a server error")
        });
        assert_eq!(
            error.to_string(),
            "store unavailable: read the server's clock: the connection pool is closed"
        );
    }
}
