//! The inbox: messages stored in PostgreSQL before the broker is acknowledged, then handled once
//! each, in the transaction that marks them processed.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use idempotency_consumer::{
    Backoff, Delivery, Disposition, HandlerError, KeySource, Processor, catching_panics,
};
use idempotency_core::{Fingerprint, Key, Scope};
use idempotency_postgres::PgTransaction;
use idempotency_postgres::sqlx::{self, AssertSqlSafe, PgPool, Row};

use crate::{OutboxError, Tables, headers};

/// What [`Inbox::receive`] did with a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Received {
    /// Stored: a worker will handle it.
    Stored,
    /// The key was stored before with the same payload: nothing to do (acknowledge it).
    Duplicate,
    /// The key was stored before with another payload: a reused key (dead-letter it).
    Mismatch,
}

/// A message as the inbox holds it, handed to an [`InboxHandler`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxMessage {
    /// The row's id (the order of arrival).
    pub id: i64,
    /// The idempotency key.
    pub key: String,
    /// The payload.
    pub payload: Vec<u8>,
    /// The headers it arrived with.
    pub headers: Vec<(String, Vec<u8>)>,
    /// This attempt's number (1 the first time).
    pub attempt: u32,
}

/// Handles inbox messages in the transaction that marks them processed: its writes through
/// `tx` commit with the mark, or not at all.
pub trait InboxHandler: Send + Sync {
    /// Handles `message`. On `Err`, everything written through `tx` is rolled back: `Retry` (and
    /// a panic) schedules another attempt with backoff, `Fatal` parks the message as `dead`.
    fn handle(
        &self,
        message: &InboxMessage,
        tx: &mut PgTransaction,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// One consumer's inbox: the rows of one table that carry its name.
#[derive(Clone)]
pub struct Inbox {
    pool: PgPool,
    tables: Tables,
    consumer: Arc<str>,
    sql: Arc<Statements>,
}

impl fmt::Debug for Inbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inbox")
            .field("table", &self.tables.qualified_inbox())
            .field("consumer", &self.consumer)
            .finish_non_exhaustive()
    }
}

/// The inbox's statements, built once.
struct Statements {
    receive: String,
    stored: String,
    claim: String,
    processed: String,
    retry: String,
    dead: String,
}

impl Inbox {
    /// The inbox of `consumer` (1 to 255 bytes of visible ASCII, like a scope) in `tables`, on
    /// `pool`. The tables must exist ([`Tables::migrate`]).
    ///
    /// # Errors
    ///
    /// [`OutboxError::Invalid`] for an invalid consumer name.
    pub fn new(pool: PgPool, tables: Tables, consumer: &str) -> Result<Self, OutboxError> {
        if consumer.is_empty() {
            return Err(OutboxError::Invalid("the consumer name is empty".into()));
        }
        Scope::new(consumer).map_err(|e| OutboxError::Invalid(format!("consumer name {consumer:?}: {e}")))?;
        let table = tables.qualified_inbox();
        let channel = tables.inbox_channel();
        let sql = Statements {
            receive: format!(
                "INSERT INTO {table} (consumer, key, fingerprint, payload, headers) VALUES ($1, $2, $3, $4, $5::jsonb)
                 ON CONFLICT (consumer, key) DO NOTHING
                 RETURNING id, pg_notify('{channel}', consumer)::text"
            ),
            stored: format!("SELECT fingerprint FROM {table} WHERE consumer = $1 AND key = $2"),
            claim: format!(
                "SELECT id, key, payload, headers::text AS headers, attempts FROM {table}
                 WHERE consumer = $1 AND state = 'pending' AND next_attempt_at <= now()
                 ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED"
            ),
            processed: format!(
                "UPDATE {table} SET state = 'processed', attempts = attempts + 1, last_error = NULL, finished_at = now()
                 WHERE id = $1"
            ),
            retry: format!(
                "UPDATE {table} SET attempts = attempts + 1, last_error = $2,
                 next_attempt_at = now() + make_interval(secs => $3) WHERE id = $1"
            ),
            dead: format!(
                "UPDATE {table} SET state = 'dead', attempts = attempts + 1, last_error = $2, finished_at = now()
                 WHERE id = $1"
            ),
        };
        Ok(Self {
            pool,
            tables,
            consumer: consumer.into(),
            sql: Arc::new(sql),
        })
    }

    /// The consumer's name.
    #[must_use]
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The tables.
    #[must_use]
    pub fn tables(&self) -> &Tables {
        &self.tables
    }

    /// The pool.
    #[must_use]
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Stores a message under `key` (one statement: `INSERT … ON CONFLICT DO NOTHING`, which
    /// wakes idle workers when it commits). Acknowledge the broker's message only once this
    /// returns `Stored` or `Duplicate`.
    ///
    /// # Errors
    ///
    /// [`OutboxError::Database`]: nothing was stored; do not acknowledge.
    pub async fn receive(
        &self,
        key: &Key,
        payload: &[u8],
        message_headers: &[(String, Vec<u8>)],
    ) -> Result<Received, OutboxError> {
        let fingerprint = Fingerprint::of_bytes(payload).to_string();
        let inserted = sqlx::query(AssertSqlSafe(self.sql.receive.as_str()))
            .bind(&*self.consumer)
            .bind(key.as_str())
            .bind(&fingerprint)
            .bind(payload)
            .bind(headers::to_json(message_headers).to_string())
            .fetch_optional(&self.pool)
            .await
            .map_err(OutboxError::db("store the message in the inbox"))?;
        if inserted.is_some() {
            metrics::counter!("idempotency_inbox_received_total", "consumer" => self.consumer.to_string(), "result" => "stored").increment(1);
            return Ok(Received::Stored);
        }
        let stored: Option<String> = sqlx::query_scalar(AssertSqlSafe(self.sql.stored.as_str()))
            .bind(&*self.consumer)
            .bind(key.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(OutboxError::db("read the stored message"))?;
        let received = match stored {
            Some(stored) if stored == fingerprint => Received::Duplicate,
            Some(_) => Received::Mismatch,
            // Purged between the two statements: the window had passed, store it again.
            None => return Box::pin(self.receive(key, payload, message_headers)).await,
        };
        let result = if received == Received::Duplicate {
            "duplicate"
        } else {
            "mismatch"
        };
        metrics::counter!("idempotency_inbox_received_total", "consumer" => self.consumer.to_string(), "result" => result).increment(1);
        Ok(received)
    }

    /// One round of a worker: claims up to `batch` due messages (`FOR UPDATE SKIP LOCKED`, so
    /// competing workers take different ones), handles each in a savepoint of one transaction,
    /// marks each processed, retried or dead, and commits. Returns how many it claimed.
    ///
    /// # Errors
    ///
    /// [`OutboxError::Database`]: the transaction rolled back; the messages stay pending, and
    /// their handlers' writes are undone.
    pub async fn process_batch<H: InboxHandler>(
        &self,
        handler: &H,
        batch: u32,
        retry: &RetryPolicy,
    ) -> Result<usize, OutboxError> {
        let mut tx = self
            .pool
            .begin()
            .await
            .map_err(OutboxError::db("begin an inbox batch"))?;
        let rows = sqlx::query(AssertSqlSafe(self.sql.claim.as_str()))
            .bind(&*self.consumer)
            .bind(i64::from(batch))
            .fetch_all(&mut *tx)
            .await
            .map_err(OutboxError::db("claim inbox messages"))?;
        let claimed = rows.len();
        for row in rows {
            let attempts: i32 = row.get("attempts");
            let message = InboxMessage {
                id: row.get("id"),
                key: row.get("key"),
                payload: row.get("payload"),
                headers: headers::from_text(row.get("headers")),
                attempt: u32::try_from(attempts).unwrap_or(0).saturating_add(1),
            };
            self.handle_one(handler, &mut tx, &message, retry).await?;
        }
        tx.commit()
            .await
            .map_err(OutboxError::db("commit an inbox batch"))?;
        Ok(claimed)
    }

    /// Handles one claimed message in a savepoint and marks it.
    async fn handle_one<H: InboxHandler>(
        &self,
        handler: &H,
        tx: &mut PgTransaction,
        message: &InboxMessage,
        retry: &RetryPolicy,
    ) -> Result<(), OutboxError> {
        let consumer = self.consumer.to_string();
        sqlx::query("SAVEPOINT inbox_handler")
            .execute(&mut **tx)
            .await
            .map_err(OutboxError::db("open the handler's savepoint"))?;
        let result = catching_panics(handler.handle(message, tx)).await;
        let error = match result {
            Ok(()) => {
                sqlx::query("RELEASE SAVEPOINT inbox_handler")
                    .execute(&mut **tx)
                    .await
                    .map_err(OutboxError::db("release the handler's savepoint"))?;
                sqlx::query(AssertSqlSafe(self.sql.processed.as_str()))
                    .bind(message.id)
                    .execute(&mut **tx)
                    .await
                    .map_err(OutboxError::db("mark the message processed"))?;
                metrics::counter!("idempotency_inbox_messages_total", "consumer" => consumer, "result" => "processed").increment(1);
                return Ok(());
            }
            Err(error) => error,
        };
        sqlx::query("ROLLBACK TO SAVEPOINT inbox_handler")
            .execute(&mut **tx)
            .await
            .map_err(OutboxError::db("roll the handler's writes back"))?;
        let text = match &error {
            HandlerError::Panicked(text) => format!("panic: {text}"),
            other => other.to_string(),
        };
        if error.is_fatal() || message.attempt >= retry.max_attempts {
            let reason = if error.is_fatal() {
                text
            } else {
                format!("failed {} attempts, the last with: {text}", message.attempt)
            };
            tracing::warn!(consumer = %self.consumer, key = %message.key, %reason, "inbox message dead");
            sqlx::query(AssertSqlSafe(self.sql.dead.as_str()))
                .bind(message.id)
                .bind(&reason)
                .execute(&mut **tx)
                .await
                .map_err(OutboxError::db("park the message as dead"))?;
            metrics::counter!("idempotency_inbox_messages_total", "consumer" => consumer, "result" => "dead")
                .increment(1);
        } else {
            let delay = retry.backoff.delay(message.attempt);
            tracing::info!(consumer = %self.consumer, key = %message.key, error = %text, ?delay, "inbox message retried later");
            sqlx::query(AssertSqlSafe(self.sql.retry.as_str()))
                .bind(message.id)
                .bind(&text)
                .bind(delay.as_secs_f64())
                .execute(&mut **tx)
                .await
                .map_err(OutboxError::db("schedule the next attempt"))?;
            metrics::counter!("idempotency_inbox_messages_total", "consumer" => consumer, "result" => "retried").increment(1);
        }
        Ok(())
    }
}

/// How failed messages are retried.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// The wait before the next attempt, by attempt number.
    pub backoff: Backoff,
    /// After how many attempts a message is parked as `dead`.
    pub max_attempts: u32,
}

impl Default for RetryPolicy {
    /// 1 s doubling to 5 min; dead after 5 attempts.
    fn default() -> Self {
        Self {
            backoff: Backoff::default(),
            max_attempts: 5,
        }
    }
}

/// Feeds an [`Inbox`] from a broker: a [`Processor`] for the broker crates' workers and
/// `process` functions. A message is acknowledged only once it is stored (or was already); a
/// key reused with another payload, or a message without a usable key, is dead-lettered with
/// the reason; a database failure requeues it.
#[derive(Debug, Clone)]
pub struct InboxReceiver {
    inbox: Inbox,
    keys: KeySource,
    backoff: Backoff,
}

impl InboxReceiver {
    /// Stores into `inbox`, with keys from the `Idempotency-Key` header.
    #[must_use]
    pub fn new(inbox: Inbox) -> Self {
        Self {
            inbox,
            keys: KeySource::Header(idempotency_core::IDEMPOTENCY_KEY_HEADER.into()),
            backoff: Backoff::default(),
        }
    }

    /// Where keys come from.
    #[must_use]
    pub fn keys(mut self, keys: KeySource) -> Self {
        self.keys = keys;
        self
    }

    /// The requeue backoff when the database fails.
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }
}

impl<M: Delivery + Sync> Processor<M> for InboxReceiver {
    async fn process(&self, message: &M) -> Disposition {
        let key = match self.keys.find(message) {
            Ok(key) => key,
            Err(reason) => {
                metrics::counter!("idempotency_inbox_received_total", "consumer" => self.inbox.consumer.to_string(), "result" => "no_key").increment(1);
                return Disposition::DeadLetter {
                    reason: reason.into_reason(),
                };
            }
        };
        match self
            .inbox
            .receive(&key, message.payload(), &message.headers())
            .await
        {
            Ok(Received::Stored | Received::Duplicate) => Disposition::Ack,
            Ok(Received::Mismatch) => Disposition::DeadLetter {
                reason: format!(
                    "the idempotency key {:?} was received before with a different payload",
                    key.as_str()
                ),
            },
            Err(error) => {
                tracing::warn!(consumer = %self.inbox.consumer, %error, "inbox unavailable; requeueing");
                Disposition::Nack {
                    after: self.backoff.delay(message.delivery_count()),
                }
            }
        }
    }
}
