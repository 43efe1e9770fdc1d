//! The transactional outbox: messages written in the business transaction, published by a relay
//! after it commits, with the outbox id as their `Idempotency-Key`.

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use idempotency_consumer::BoxError;
use idempotency_core::Key;

use crate::dialect::{Pending, Round};
use crate::wake::{self, Pace, pace_setters};
use crate::{Database, OutboxError, Tables, headers};

/// A message to publish when the caller's transaction commits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutgoingMessage {
    /// Where the relay's publisher sends it (a routing key, a subject, a topic).
    pub destination: String,
    /// The aggregate it belongs to: messages of one ordering key are published in the order
    /// they were enqueued.
    pub ordering_key: String,
    /// The `Idempotency-Key` consumers deduplicate it by; `None`: the relay's `<name>:<id>`.
    pub key: Option<Key>,
    /// The payload.
    pub payload: Vec<u8>,
    /// Headers to publish with it (the relay adds `Idempotency-Key`).
    pub headers: Vec<(String, Vec<u8>)>,
}

impl OutgoingMessage {
    /// A message for `destination`, ordered with the others of `ordering_key`.
    pub fn new(
        destination: impl Into<String>,
        ordering_key: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Self {
        Self {
            destination: destination.into(),
            ordering_key: ordering_key.into(),
            key: None,
            payload: payload.into(),
            headers: Vec::new(),
        }
    }

    /// Publishes it with `key` as its `Idempotency-Key` (an order id the consumers already
    /// know, say) instead of the relay's `<name>:<id>`.
    #[must_use]
    pub fn key(mut self, key: Key) -> Self {
        self.key = Some(key);
        self
    }

    /// Adds a header.
    #[must_use]
    pub fn header(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
}

/// A message the relay hands to its [`Publisher`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxMessage {
    /// The outbox row's id.
    pub id: i64,
    /// `<outbox>:<id>`: publish it as the `Idempotency-Key` (and as the broker's own dedup id
    /// where there is one), so that a republish after a relay crash is a duplicate.
    pub key: Key,
    /// Where to send it.
    pub destination: String,
    /// Its aggregate.
    pub ordering_key: String,
    /// The payload.
    pub payload: Vec<u8>,
    /// The headers it was enqueued with.
    pub headers: Vec<(String, Vec<u8>)>,
}

/// Sends outbox messages to a broker and returns once the broker has acknowledged each (a
/// publisher confirm, a JetStream ack, a Kafka delivery report).
pub trait Publisher: Send + Sync {
    /// Publishes `message`; `Ok` only once the broker has it.
    fn publish(&self, message: &OutboxMessage) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// Whether the broker can be reached now, for a readiness probe (`idem relay`'s
    /// `/readyz`): a publisher with a connection says whether it is up (and makes it again
    /// when it is not), one without asks the broker something cheap. By default, yes.
    fn reachable(&self) -> impl Future<Output = Result<(), BoxError>> + Send {
        std::future::ready(Ok(()))
    }
}

/// A shared publisher publishes as the publisher it points to.
impl<P: Publisher + ?Sized> Publisher for Arc<P> {
    fn publish(&self, message: &OutboxMessage) -> impl Future<Output = Result<(), BoxError>> + Send {
        (**self).publish(message)
    }

    fn reachable(&self) -> impl Future<Output = Result<(), BoxError>> + Send {
        (**self).reachable()
    }
}

/// The outbox table, for enqueueing in business transactions.
#[derive(Clone)]
pub struct Outbox {
    tables: Tables,
}

impl fmt::Debug for Outbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbox")
            .field("table", &self.tables.qualified_outbox())
            .finish_non_exhaustive()
    }
}

/// A connection an outbox message can be enqueued on, in the caller's transaction: a
/// PostgreSQL connection or transaction, and with the `mysql` feature a MySQL one.
pub trait OutboxConnection: sealed::Sealed + Send {
    /// Inserts `message` into `outbox` on this connection; its id. What
    /// [`Outbox::enqueue`] runs.
    #[doc(hidden)]
    fn insert<'a>(
        &'a mut self,
        outbox: &'a Outbox,
        message: &'a OutgoingMessage,
    ) -> BoxFuture<'a, Result<i64, OutboxError>>;
}

pub(crate) mod sealed {
    /// Only this crate's connections enqueue (`postgres.rs`, `mysql.rs`).
    pub trait Sealed {}
}

impl Outbox {
    /// The outbox in `tables` (which must exist: [`Tables::migrate`]).
    #[must_use]
    pub fn new(tables: Tables) -> Self {
        Self { tables }
    }

    /// The tables.
    #[must_use]
    pub fn tables(&self) -> &Tables {
        &self.tables
    }

    /// Writes `message` in the caller's transaction (a PostgreSQL transaction or connection,
    /// and with the `mysql` feature a MySQL one): it is published if and only if that
    /// transaction commits. Returns its id.
    ///
    /// # Errors
    ///
    /// [`OutboxError::Database`] (or [`OutboxError::MySql`]): roll the transaction back, as for
    /// any failed statement.
    pub async fn enqueue<C: OutboxConnection + ?Sized>(
        &self,
        tx: &mut C,
        message: &OutgoingMessage,
    ) -> Result<i64, OutboxError> {
        tx.insert(self, message).await
    }
}

/// How many failed publishes park an outbox row as dead, unless [`Relay::max_attempts`] says
/// otherwise.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 10;

/// Publishes pending outbox rows with a [`Publisher`] and marks them sent.
///
/// **Several relays may run.** Each round, a relay takes the ordering keys of the oldest pending
/// rows and tries a transaction-scoped advisory lock on each (`pg_try_advisory_xact_lock`; on
/// MySQL a named lock, `GET_LOCK`, released after the round's commit): a
/// key is published by one relay at a time, in id order, while different keys are published by
/// different relays in parallel. Rows are not claimed with `FOR UPDATE SKIP LOCKED`: skipping a
/// locked row would let another relay publish the next row of the same aggregate first. The
/// rows of a locked key are read again after the lock is taken, so a relay never publishes what
/// another has just marked sent.
///
/// A relay that crashes between a publish and its mark leaves the row pending: it is published
/// again, with the same `Idempotency-Key`, and the consumer's record answers the copy. A
/// publish that fails stops that key for the round (the rows after it wait, in order), records
/// the error on the row, and the round is retried with backoff: a broker outage grows the
/// backlog, which drains when the broker is back. A row that failed
/// [`max_attempts`](Self::max_attempts) times is parked as dead (`dead_at`), and the rows after
/// it in its group go on.
#[derive(Debug)]
pub struct Relay<P> {
    db: Database,
    outbox: Outbox,
    publisher: P,
    name: String,
    pace: Pace,
    max_attempts: u32,
}

impl<P: Publisher> Relay<P> {
    /// A relay of `outbox` on `database` (a `PgPool`, or with the `mysql` feature a
    /// `MySqlPool`), publishing with `publisher`. Defaults: batches of 100, polling every
    /// second, sent rows kept 7 days and cleaned up every minute.
    pub fn new(database: impl Into<Database>, outbox: Outbox, publisher: P) -> Self {
        let db = database.into();
        Self {
            name: db.qualified_outbox(&outbox.tables),
            db,
            outbox,
            publisher,
            pace: Pace::new(1, 100),
            max_attempts: DEFAULT_MAX_ATTEMPTS,
        }
    }

    /// How many failed publishes park a row as dead (default [`DEFAULT_MAX_ATTEMPTS`]): it
    /// stays in the table with its last error, its group goes on, and `idem outbox replay`
    /// makes it pending again.
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The prefix of the messages' keys (`<name>:<id>`), and the `outbox` label of the metrics;
    /// the qualified table name by default. Keep it unique among the outboxes feeding one
    /// consumer.
    #[must_use]
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The relay's name: the prefix of its keys and the `outbox` label of its metrics.
    #[must_use]
    pub fn label(&self) -> &str {
        &self.name
    }

    pace_setters!(
        batch: "How many rows one round publishes at most.",
        idle: "relays",
        notifications: "the default on PostgreSQL; MySQL has none, and relays on it poll",
        kept: "sent rows are kept",
    );

    /// One round: publishes up to a batch of pending rows whose ordering keys no other relay
    /// holds, marks them sent and commits. Returns how many were published.
    ///
    /// # Errors
    ///
    /// [`OutboxError::Database`]: nothing was marked (what was published is published again).
    /// [`OutboxError::Publish`] when every key of the round failed to publish (the broker is
    /// down); the errors are recorded on the rows.
    pub async fn relay_batch(&self) -> Result<usize, OutboxError> {
        Ok(self.round().await?.0)
    }

    /// One round (see [`relay_batch`](Self::relay_batch)): how many rows it published, and how
    /// many it parked as dead. A round that only parked rows made progress too: the rows after
    /// them are there to publish at once.
    async fn round(&self) -> Result<(usize, usize), OutboxError> {
        let (round, rows) = self
            .db
            .dialect()
            .round(&self.outbox.tables, self.pace.batch)
            .await?;
        self.publish(round, rows).await
    }

    /// Publishes the `rows` a round holds, in order per group, and finishes the round.
    async fn publish(
        &self,
        mut round: Box<dyn Round>,
        rows: Vec<Pending>,
    ) -> Result<(usize, usize), OutboxError> {
        let mut sent = Vec::new();
        let mut parked = 0;
        let mut stopped: HashSet<String> = HashSet::new();
        let mut last_error = None;
        for row in rows {
            if stopped.contains(&row.ordering_key) {
                continue;
            }
            let id = row.id;
            let key = match row.key {
                Some(text) => match Key::new(text) {
                    Ok(key) => key,
                    Err(error) => {
                        // No attempt can publish it: parked at once.
                        let why = format!("the row's key is not a valid Idempotency-Key: {error}");
                        self.failed(&mut round, id, &why, true).await?;
                        parked += 1;
                        continue;
                    }
                },
                None => Key::new(format!("{}:{id}", self.name)).map_err(|e| {
                    OutboxError::Invalid(format!(
                        "the relay's name {:?} makes an invalid key: {e}",
                        self.name
                    ))
                })?,
            };
            let headers = match headers::parse(&row.headers) {
                Ok(headers) => headers,
                Err(why) => {
                    // No attempt can publish it: parked at once, with the reason.
                    self.failed(&mut round, id, &why.to_string(), true).await?;
                    parked += 1;
                    continue;
                }
            };
            let message = OutboxMessage {
                id,
                key,
                destination: row.destination,
                ordering_key: row.ordering_key,
                payload: row.payload,
                headers,
            };
            match self.publisher.publish(&message).await {
                Ok(()) => sent.push(id),
                Err(error) => {
                    let text = error.to_string();
                    metrics::counter!("idempotency_outbox_relay_errors_total", "outbox" => self.name.clone())
                        .increment(1);
                    // Past the limit, the row is parked: its group goes on without it.
                    let dead = i64::from(row.attempts) + 1 >= i64::from(self.max_attempts);
                    self.failed(&mut round, id, &text, dead).await?;
                    if dead {
                        parked += 1;
                    } else {
                        tracing::warn!(outbox = %self.name, id, error = %text, "publish failed; the aggregate waits");
                        stopped.insert(message.ordering_key);
                    }
                    last_error = Some(text);
                }
            }
        }
        round.finish(&sent).await?;
        metrics::counter!("idempotency_outbox_published_total", "outbox" => self.name.clone())
            .increment(sent.len() as u64);
        match last_error {
            Some(error) if sent.is_empty() && parked == 0 => Err(OutboxError::Publish(error)),
            _ => Ok((sent.len(), parked)),
        }
    }

    /// Records a failed publish of row `id` (`why`), parked as dead when `dead`.
    async fn failed(
        &self,
        round: &mut Box<dyn Round>,
        id: i64,
        why: &str,
        dead: bool,
    ) -> Result<(), OutboxError> {
        round.failed(id, why, dead).await?;
        if dead {
            metrics::counter!("idempotency_outbox_dead_total", "outbox" => self.name.clone()).increment(1);
            tracing::warn!(outbox = %self.name, id, error = %why, "parked as dead: `idem outbox replay` sends it again after a fix; its group goes on");
        }
        Ok(())
    }

    /// Relays until `shutdown` completes, then finishes the round in progress and returns.
    /// Idle, it waits for the outbox's `NOTIFY` (sent by every enqueue when its transaction
    /// commits), or the poll interval at most.
    ///
    /// # Errors
    ///
    /// [`OutboxError::Database`] when the first connection for notifications fails. Later
    /// failures are logged and retried with backoff.
    pub async fn run_until<F>(&self, shutdown: F) -> Result<(), OutboxError>
    where
        F: Future<Output = ()> + Send,
    {
        let what = format!("outbox relay {}", self.name);
        let round = || async {
            let (sent, parked) = self.round().await?;
            Ok(sent + parked > 0)
        };
        let cleanup = || async {
            if let Err(error) =
                crate::admin::purge_sent(&self.db, &self.outbox.tables, self.pace.retention).await
            {
                tracing::warn!(outbox = %self.name, %error, "outbox cleanup failed");
            }
            match crate::admin::outbox_stats(&self.db, &self.outbox.tables).await {
                Ok(stats) => stats.show(&self.name),
                Err(error) => tracing::warn!(outbox = %self.name, %error, "outbox statistics failed"),
            }
        };
        let channel = self.outbox.tables.outbox_channel();
        let listen = self
            .db
            .dialect()
            .notifications()
            .filter(|_| self.pace.listen)
            .map(|pool| (pool, channel.as_str()));
        wake::run(listen, &what, &self.pace, round, cleanup, shutdown).await
    }
}
