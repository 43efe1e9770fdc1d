//! What one database does for the outbox, behind one trait: the relay, the operations functions
//! and the migrations ask [`Database::dialect`](crate::Database) and never name a database
//! themselves. PostgreSQL's statements are in `postgres.rs`, MySQL's and MariaDB's in
//! `mysql.rs`; a third database is a third file implementing [`Dialect`] for its pool, and one
//! arm where the dialect is chosen.

use std::future::Future;
use std::time::Duration;

use futures_util::future::BoxFuture;
use idempotency_postgres::sqlx::{self, PgPool};

use crate::{OutboxError, Tables};

/// How many rows one cleanup statement deletes: small enough to hold no lock for long.
pub(crate) const PURGE_BATCH: i64 = 1000;

/// One database's outbox statements. Every method does what the public function of the same
/// name (or [`Relay`](crate::Relay)'s round) documents, on this database.
pub(crate) trait Dialect: Send + Sync {
    /// The outbox table's name as this database's statements use it.
    fn qualified_outbox(&self, tables: &Tables) -> String;

    /// Whether the database answers a `SELECT 1` now.
    fn reachable(&self) -> Answer<'_, ()>;

    /// Creates (or upgrades) the outbox table under the migration lock.
    fn migrate<'a>(&'a self, tables: &'a Tables) -> Answer<'a, ()>;

    /// Checks that the outbox table exists and carries this version's mark.
    fn check<'a>(&'a self, tables: &'a Tables) -> Answer<'a, ()>;

    /// Begins a relay round: holds the groups of up to `batch` of the oldest pending rows that
    /// no other relay holds, and reads their pending rows in id order.
    fn round<'a>(&'a self, tables: &'a Tables, batch: u32) -> Answer<'a, Held>;

    /// Rows in id order: pending and dead ones, and with `all` the sent ones too; `limit` at most.
    fn list<'a>(&'a self, tables: &'a Tables, all: bool, limit: i64) -> Answer<'a, Vec<OutboxRow>>;

    /// The counts of the table.
    fn stats<'a>(&'a self, tables: &'a Tables) -> Answer<'a, OutboxStats>;

    /// Makes dead rows pending again (all, or the one with `id`), their attempts reset, and
    /// wakes the relays where the database can; how many.
    fn replay<'a>(&'a self, tables: &'a Tables, id: Option<i64>) -> Answer<'a, u64>;

    /// Deletes, in batches of [`PURGE_BATCH`], the `rows` older than `age`; pending rows never.
    fn purge<'a>(&'a self, tables: &'a Tables, rows: Purge, age: Duration) -> Answer<'a, u64>;

    /// The pool whose notifications wake an idle relay, on a database that sends them (`NOTIFY`
    /// on PostgreSQL); `None`: relays poll.
    fn notifications(&self) -> Option<&PgPool> {
        None
    }
}

/// What a dialect's statements answer, later.
pub(crate) type Answer<'a, T> = BoxFuture<'a, Result<T, OutboxError>>;

/// A round's hold on its groups, and their pending rows in id order.
pub(crate) type Held = (Box<dyn Round>, Vec<Pending>);

/// `(round, rows)` as a [`Held`].
pub(crate) fn held<R: Round>((round, rows): (R, Vec<Pending>)) -> Held {
    (Box::new(round), rows)
}

/// Which rows a purge deletes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Purge {
    /// Published rows whose `sent_at` is older than the age.
    Sent,
    /// Dead rows parked at least the age ago.
    Dead,
}

impl Purge {
    /// What a failed purge was doing, for its error.
    pub(crate) fn what(self) -> &'static str {
        match self {
            Self::Sent => "purge sent outbox rows",
            Self::Dead => "purge dead outbox rows",
        }
    }
}

/// A relay round's hold on the table, in one database's dialect: its groups are held and its
/// transaction open until [`finish`](Self::finish); dropped before, nothing it did is kept.
pub(crate) trait Round: Send + 'static {
    /// Records a failed publish of row `id`, parked as dead when `dead`.
    fn failed<'b>(&'b mut self, id: i64, why: &'b str, dead: bool) -> Answer<'b, ()>;

    /// Marks the rows `sent`, commits and lets the groups go.
    fn finish(self: Box<Self>, sent: &[i64]) -> Answer<'_, ()>;
}

/// A pending row's columns as the claim statements of every database select them: `id`,
/// `ordering_key`, `destination`, `key`, `payload`, `headers` (as text), `attempts`.
pub(crate) type PendingColumns = (i64, String, String, Option<String>, Vec<u8>, String, i32);

/// A pending row as a relay round reads it.
pub(crate) struct Pending {
    pub(crate) id: i64,
    pub(crate) ordering_key: String,
    pub(crate) destination: String,
    pub(crate) key: Option<String>,
    pub(crate) payload: Vec<u8>,
    /// The `headers` column as text.
    pub(crate) headers: String,
    /// Failed publishes so far.
    pub(crate) attempts: i32,
}

impl From<PendingColumns> for Pending {
    fn from((id, ordering_key, destination, key, payload, headers, attempts): PendingColumns) -> Self {
        Self {
            id,
            ordering_key,
            destination,
            key,
            payload,
            headers,
            attempts,
        }
    }
}

/// An outbox row, as operators see it.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxRow {
    /// The row's id.
    pub id: i64,
    /// Its aggregate.
    pub ordering_key: String,
    /// Where it goes.
    pub destination: String,
    /// Its `Idempotency-Key`, when the row names one (else the relay's `<name>:<id>`).
    pub key: Option<String>,
    /// Whether it was published.
    pub sent: bool,
    /// Whether it failed too often and was parked (`idem outbox replay` sends it again).
    pub dead: bool,
    /// Publish attempts.
    pub attempts: i32,
    /// The last failed publish's error.
    pub last_error: Option<String>,
    /// Seconds since it was enqueued.
    pub age_seconds: f64,
}

/// A listed row's columns as the list statements of every database select them: `id`,
/// `ordering_key`, `destination`, `key`, `sent` and `dead` (0 or 1), `attempts`, `last_error`,
/// the age in seconds.
pub(crate) type RowColumns = (
    i64,
    String,
    String,
    Option<String>,
    i64,
    i64,
    i32,
    Option<String>,
    f64,
);

impl From<RowColumns> for OutboxRow {
    fn from(
        (id, ordering_key, destination, key, sent, dead, attempts, last_error, age_seconds): RowColumns,
    ) -> Self {
        Self {
            id,
            ordering_key,
            destination,
            key,
            sent: sent != 0,
            dead: dead != 0,
            attempts,
            last_error,
            age_seconds,
        }
    }
}

/// The outbox's backlog.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxStats {
    /// Rows not yet published (dead ones aside).
    pub pending: i64,
    /// Rows published and kept until the retention.
    pub sent: i64,
    /// Rows parked after failing too often.
    pub dead: i64,
    /// The oldest pending row's age in seconds.
    pub oldest_pending_seconds: Option<f64>,
}

/// The counts' columns as the stats statements of every database select them: pending, sent,
/// dead, the oldest pending row's age in seconds.
pub(crate) type StatsColumns = (i64, i64, i64, Option<f64>);

impl From<StatsColumns> for OutboxStats {
    fn from((pending, sent, dead, oldest_pending_seconds): StatsColumns) -> Self {
        Self {
            pending,
            sent,
            dead,
            oldest_pending_seconds,
        }
    }
}

impl OutboxStats {
    /// Sets the relay's gauges.
    pub(crate) fn show(&self, outbox: &str) {
        #[expect(clippy::cast_precision_loss, reason = "a gauge")]
        metrics::gauge!("idempotency_outbox_backlog", "outbox" => outbox.to_owned()).set(self.pending as f64);
        #[expect(clippy::cast_precision_loss, reason = "a gauge")]
        metrics::gauge!("idempotency_outbox_dead", "outbox" => outbox.to_owned()).set(self.dead as f64);
        metrics::gauge!("idempotency_outbox_oldest_pending_seconds", "outbox" => outbox.to_owned())
            .set(self.oldest_pending_seconds.unwrap_or(0.0));
    }
}

/// Whether the database behind `executor` answers a `SELECT 1` now.
pub(crate) async fn select_one<'e, E: sqlx::Executor<'e>>(executor: E) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(sqlx::AssertSqlSafe("SELECT 1"))
        .execute(executor)
        .await
        .map(drop)
}

/// Runs `delete` (one batch of at most [`PURGE_BATCH`] rows: short locks) until a batch deletes
/// fewer; how many in all.
pub(crate) async fn in_batches<F, D>(mut delete: F) -> Result<u64, OutboxError>
where
    F: FnMut() -> D,
    D: Future<Output = Result<u64, OutboxError>>,
{
    let mut purged = 0;
    loop {
        let done = delete().await?;
        purged += done;
        if done < PURGE_BATCH.unsigned_abs() {
            return Ok(purged);
        }
    }
}
