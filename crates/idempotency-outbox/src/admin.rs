//! What operators see and do: listing, showing, replaying and purging inbox rows, the outbox's
//! backlog, and the background cleanups and gauges built on the same queries.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use idempotency_postgres::sqlx::{self, AssertSqlSafe, PgPool, Row};

use crate::dialect::{OutboxRow, OutboxStats, PURGE_BATCH, Purge, in_batches};
use crate::inbox::Inbox;
use crate::{Database, OutboxError, Tables, headers};

/// An inbox row's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InboxState {
    /// Waiting for a worker (or for its next attempt).
    Pending,
    /// Handled; kept for the dedup window.
    Processed,
    /// Parked after its last attempt, or a fatal error: replay it after a fix.
    Dead,
}

impl InboxState {
    /// The state's name in the table and on the command line.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Processed => "processed",
            Self::Dead => "dead",
        }
    }
}

impl fmt::Display for InboxState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A text that names no inbox state.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an inbox state (pending, processed, dead)")]
pub struct UnknownInboxState(String);

impl FromStr for InboxState {
    type Err = UnknownInboxState;

    fn from_str(text: &str) -> Result<Self, UnknownInboxState> {
        match text {
            "pending" => Ok(Self::Pending),
            "processed" => Ok(Self::Processed),
            "dead" => Ok(Self::Dead),
            other => Err(UnknownInboxState(other.to_owned())),
        }
    }
}

/// An inbox row, as operators see it.
#[derive(Debug, Clone, PartialEq)]
pub struct InboxRow {
    /// The row's id.
    pub id: i64,
    /// The consumer it belongs to.
    pub consumer: String,
    /// The idempotency key.
    pub key: String,
    /// Its state.
    pub state: InboxState,
    /// Attempts made.
    pub attempts: i32,
    /// The last attempt's error, if it failed.
    pub last_error: Option<String>,
    /// Seconds since it was received (by the server's clock).
    pub age_seconds: f64,
    /// The payload's size in bytes.
    pub payload_bytes: i64,
    /// The payload and headers ([`inbox_show`] only).
    pub payload: Option<Vec<u8>>,
    /// The headers ([`inbox_show`] only).
    pub headers: Vec<(String, Vec<u8>)>,
}

fn inbox_row(row: &sqlx::postgres::PgRow, whole: bool) -> Result<InboxRow, OutboxError> {
    let state: String = row.get("state");
    Ok(InboxRow {
        id: row.get("id"),
        consumer: row.get("consumer"),
        key: row.get("key"),
        state: state
            .parse()
            .map_err(|e: UnknownInboxState| OutboxError::Schema(e.to_string()))?,
        attempts: row.get("attempts"),
        last_error: row.get("last_error"),
        age_seconds: row.get("age_seconds"),
        payload_bytes: row.get("payload_bytes"),
        payload: whole.then(|| row.get("payload")),
        headers: if whole {
            headers::from_text(row.get("headers"))
        } else {
            Vec::new()
        },
    })
}

const INBOX_COLUMNS: &str = "id, consumer, key, state, attempts, last_error, \
    extract(epoch FROM now() - received_at)::float8 AS age_seconds, octet_length(payload)::int8 AS payload_bytes";

/// Inbox rows in id order, filtered by state and consumer, at most `limit`.
///
/// # Errors
///
/// [`OutboxError::Database`].
pub async fn inbox_list(
    pool: &PgPool,
    tables: &Tables,
    state: Option<InboxState>,
    consumer: Option<&str>,
    limit: i64,
) -> Result<Vec<InboxRow>, OutboxError> {
    let sql = format!(
        "SELECT {INBOX_COLUMNS} FROM {} WHERE ($1::text IS NULL OR state = $1) AND ($2::text IS NULL OR consumer = $2)
         ORDER BY id LIMIT $3",
        tables.qualified_inbox()
    );
    let rows = sqlx::query(AssertSqlSafe(sql))
        .bind(state.map(InboxState::as_str))
        .bind(consumer)
        .bind(limit)
        .fetch_all(pool)
        .await
        .map_err(OutboxError::db("list the inbox"))?;
    rows.iter().map(|row| inbox_row(row, false)).collect()
}

/// One inbox row with its payload and headers.
///
/// # Errors
///
/// [`OutboxError::Database`].
pub async fn inbox_show(
    pool: &PgPool,
    tables: &Tables,
    consumer: &str,
    key: &str,
) -> Result<Option<InboxRow>, OutboxError> {
    let sql = format!(
        "SELECT {INBOX_COLUMNS}, payload, headers::text AS headers FROM {} WHERE consumer = $1 AND key = $2",
        tables.qualified_inbox()
    );
    let row = sqlx::query(AssertSqlSafe(sql))
        .bind(consumer)
        .bind(key)
        .fetch_optional(pool)
        .await
        .map_err(OutboxError::db("read the inbox row"))?;
    row.map(|row| inbox_row(&row, true)).transpose()
}

/// Puts dead rows back to pending with their attempts reset, due now, and wakes the workers;
/// all dead rows of `consumer` (or of every consumer), or the one of `key`. Returns how many.
///
/// # Errors
///
/// [`OutboxError::Database`].
pub async fn inbox_replay(
    pool: &PgPool,
    tables: &Tables,
    consumer: Option<&str>,
    key: Option<&str>,
) -> Result<u64, OutboxError> {
    let sql = format!(
        "WITH replayed AS (
             UPDATE {} SET state = 'pending', attempts = 0, next_attempt_at = now(), finished_at = NULL
             WHERE state = 'dead' AND ($1::text IS NULL OR consumer = $1) AND ($2::text IS NULL OR key = $2)
             RETURNING 1)
         SELECT count(*)::int8, pg_notify('{}', '')::text FROM replayed",
        tables.qualified_inbox(),
        tables.inbox_channel()
    );
    let (count, _): (i64, Option<String>) = sqlx::query_as(AssertSqlSafe(sql))
        .bind(consumer)
        .bind(key)
        .fetch_one(pool)
        .await
        .map_err(OutboxError::db("replay dead inbox rows"))?;
    Ok(count.unsigned_abs())
}

/// Deletes rows in `state` (never pending ones: they are not done) finished more than
/// `older_than` ago, in batches. Returns how many.
///
/// # Errors
///
/// [`OutboxError::Invalid`] for `pending`; [`OutboxError::Database`].
pub async fn inbox_purge(
    pool: &PgPool,
    tables: &Tables,
    state: InboxState,
    consumer: Option<&str>,
    older_than: Duration,
) -> Result<u64, OutboxError> {
    if state == InboxState::Pending {
        return Err(OutboxError::Invalid(
            "pending inbox rows are not purged: they have not been handled".into(),
        ));
    }
    let table = tables.qualified_inbox();
    let sql = format!(
        "DELETE FROM {table} WHERE id IN (
             SELECT id FROM {table} WHERE state = $1 AND ($2::text IS NULL OR consumer = $2)
             AND finished_at < now() - make_interval(secs => $3) LIMIT {PURGE_BATCH})"
    );
    in_batches(|| async {
        Ok(sqlx::query(AssertSqlSafe(sql.as_str()))
            .bind(state.as_str())
            .bind(consumer)
            .bind(older_than.as_secs_f64())
            .execute(pool)
            .await
            .map_err(OutboxError::db("purge inbox rows"))?
            .rows_affected())
    })
    .await
}

/// The cleanup of an inbox worker: processed rows past the dedup window.
pub(crate) async fn purge_processed(inbox: &Inbox, retention: Duration) -> Result<u64, OutboxError> {
    let purged = inbox_purge(
        inbox.pool(),
        inbox.tables(),
        InboxState::Processed,
        Some(inbox.consumer()),
        retention,
    )
    .await?;
    metrics::counter!("idempotency_inbox_purged_total", "consumer" => inbox.consumer().to_owned())
        .increment(purged);
    Ok(purged)
}

/// Counts of one consumer's inbox (or every consumer's).
#[derive(Debug, Clone, PartialEq)]
pub struct InboxStats {
    /// Rows waiting for a worker.
    pub pending: i64,
    /// Rows handled and kept for the dedup window.
    pub processed: i64,
    /// Rows parked.
    pub dead: i64,
    /// The oldest pending row's age in seconds.
    pub oldest_pending_seconds: Option<f64>,
}

/// The inbox's counts.
///
/// # Errors
///
/// [`OutboxError::Database`].
pub async fn inbox_stats(
    pool: &PgPool,
    tables: &Tables,
    consumer: Option<&str>,
) -> Result<InboxStats, OutboxError> {
    let sql = format!(
        "SELECT count(*) FILTER (WHERE state = 'pending'), count(*) FILTER (WHERE state = 'processed'),
                count(*) FILTER (WHERE state = 'dead'),
                extract(epoch FROM now() - min(received_at) FILTER (WHERE state = 'pending'))::float8
         FROM {} WHERE $1::text IS NULL OR consumer = $1",
        tables.qualified_inbox()
    );
    let (pending, processed, dead, oldest_pending_seconds) = sqlx::query_as(AssertSqlSafe(sql))
        .bind(consumer)
        .fetch_one(pool)
        .await
        .map_err(OutboxError::db("count the inbox"))?;
    Ok(InboxStats {
        pending,
        processed,
        dead,
        oldest_pending_seconds,
    })
}

/// Refreshes an inbox worker's gauges.
pub(crate) async fn refresh_inbox_gauges(inbox: &Inbox) -> Result<(), OutboxError> {
    let stats = inbox_stats(inbox.pool(), inbox.tables(), Some(inbox.consumer())).await?;
    let consumer = inbox.consumer().to_owned();
    #[expect(clippy::cast_precision_loss, reason = "gauges")]
    {
        metrics::gauge!("idempotency_inbox_backlog", "consumer" => consumer.clone())
            .set(stats.pending as f64);
        metrics::gauge!("idempotency_inbox_dead", "consumer" => consumer.clone()).set(stats.dead as f64);
    }
    metrics::gauge!("idempotency_inbox_oldest_pending_seconds", "consumer" => consumer)
        .set(stats.oldest_pending_seconds.unwrap_or(0.0));
    Ok(())
}

/// Outbox rows in id order (pending and dead ones, and with `all` the sent ones too), at most
/// `limit`.
///
/// # Errors
///
/// [`OutboxError::Database`] (or [`OutboxError::MySql`]).
pub async fn outbox_list(
    database: impl Into<Database>,
    tables: &Tables,
    all: bool,
    limit: i64,
) -> Result<Vec<OutboxRow>, OutboxError> {
    database.into().dialect().list(tables, all, limit).await
}

/// The outbox's counts.
///
/// # Errors
///
/// [`OutboxError::Database`] (or [`OutboxError::MySql`]).
pub async fn outbox_stats(
    database: impl Into<Database>,
    tables: &Tables,
) -> Result<OutboxStats, OutboxError> {
    database.into().dialect().stats(tables).await
}

/// Makes dead outbox rows pending again (all of them, or the one with `id`), their attempts
/// reset, so that the relay publishes them in their group's order among the rows still pending.
/// Returns how many. On PostgreSQL the relays are woken at once; on MySQL they find the rows at
/// their next poll.
///
/// # Errors
///
/// [`OutboxError::Database`] (or [`OutboxError::MySql`]).
pub async fn outbox_replay(
    database: impl Into<Database>,
    tables: &Tables,
    id: Option<i64>,
) -> Result<u64, OutboxError> {
    database.into().dialect().replay(tables, id).await
}

/// Deletes dead outbox rows parked at least `older_than` ago, in batches. Returns how many.
///
/// # Errors
///
/// [`OutboxError::Database`] (or [`OutboxError::MySql`]).
pub async fn outbox_purge_dead(
    database: impl Into<Database>,
    tables: &Tables,
    older_than: Duration,
) -> Result<u64, OutboxError> {
    database
        .into()
        .dialect()
        .purge(tables, Purge::Dead, older_than)
        .await
}

/// Deletes sent rows older than `retention`, in batches. Returns how many.
///
/// # Errors
///
/// [`OutboxError::Database`] (or [`OutboxError::MySql`]).
pub async fn purge_sent(
    database: impl Into<Database>,
    tables: &Tables,
    retention: Duration,
) -> Result<u64, OutboxError> {
    database
        .into()
        .dialect()
        .purge(tables, Purge::Sent, retention)
        .await
}
