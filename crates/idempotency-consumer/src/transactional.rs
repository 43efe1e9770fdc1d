//! Same-transaction consumers on the PostgreSQL store.
//!
//! When a message's side effect is a write to the same PostgreSQL database as the record (a
//! charge row, a ledger entry, an outbox row), the handler can write it **in the record's
//! transaction**: the claim, the business rows and the completion commit together or not at all.
//! A crash anywhere before the commit leaves nothing behind, and the redelivery runs from
//! scratch; a crash after it leaves a completed record, and the redelivery is acked as a
//! duplicate. No lease can expire under a running handler, since the uncommitted claim is
//! invisible: a concurrent duplicate waits on the row lock, then replays (or, after a
//! rollback, runs).
//!
//! ```no_run
//! use idempotency_consumer::{Delivery, HandlerError, Processor, TxConsumer, TxHandler};
//! use idempotency_core::Outcome;
//! use idempotency_postgres::sqlx::{self, PgConnection};
//! use idempotency_postgres::{PostgresStore, TxAttempt};
//!
//! struct RecordCharge;
//!
//! impl<M: Delivery + Sync> TxHandler<M> for RecordCharge {
//!     async fn handle(&self, message: &M, tx: &mut PgConnection, attempt: &TxAttempt) -> Result<Outcome, HandlerError> {
//!         let cents: i64 = std::str::from_utf8(message.payload())
//!             .ok()
//!             .and_then(|text| text.parse().ok())
//!             .ok_or_else(|| HandlerError::Fatal("the payload is not an amount in cents".into()))?;
//!         sqlx::query("INSERT INTO charges (key, cents) VALUES ($1, $2)")
//!             .bind(attempt.key.as_str())
//!             .bind(cents)
//!             .execute(&mut *tx)
//!             .await
//!             .map_err(|e| HandlerError::Retry(e.to_string()))?;
//!         Ok(Outcome::new("charged"))
//!     }
//! }
//!
//! # async fn example<M: Delivery + Sync>(store: PostgresStore, message: M) {
//! let consumer = TxConsumer::new("charges", store, RecordCharge);
//! let disposition = consumer.process(&message).await; // then ack, nack or dead-letter
//! # let _ = disposition;
//! # }
//! ```

use std::future::Future;

use idempotency_core::{BeginRequest, Fingerprint, Outcome, Token};
use idempotency_postgres::sqlx::{PgConnection, Postgres, Transaction};
use idempotency_postgres::{PostgresStore, TxAttempt, TxError, TxExecution, TxOperation};

use std::time::Duration;

use crate::{Backoff, Consumer, Delivery, Disposition, HandlerError, KeySource, Processor};

/// Handles messages of type `M` inside the record's transaction; runs at most once per key
/// while its outcome is retained, and its writes commit with the record.
pub trait TxHandler<M: ?Sized>: Send + Sync {
    /// Writes the side effect of `message` through `tx` and returns the outcome to keep for
    /// duplicates. On `Err`, everything it wrote is rolled back.
    fn handle(
        &self,
        message: &M,
        tx: &mut PgConnection,
        attempt: &TxAttempt,
    ) -> impl Future<Output = Result<Outcome, HandlerError>> + Send;
}

/// A consumer whose handler writes in the record's transaction; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct TxConsumer<H> {
    inner: Consumer<PostgresStore, H>,
}

impl<H> TxConsumer<H> {
    /// A consumer named `name` whose handler writes in the record's transaction on `store`.
    /// The defaults are those of [`Consumer::new`]; there is no lease to set, since an
    /// uncommitted claim cannot expire under its handler.
    ///
    /// # Panics
    ///
    /// If `name` is not a valid scope (1 to 255 bytes of visible ASCII).
    pub fn new(name: &'static str, store: PostgresStore, handler: H) -> Self {
        Self {
            inner: Consumer::new(name, store, handler),
        }
    }

    /// Where keys come from.
    #[must_use]
    pub fn keys(self, source: KeySource) -> Self {
        Self {
            inner: self.inner.keys(source),
        }
    }

    /// How long a completed key keeps replaying (default 7 days: DLQ replays come late).
    #[must_use]
    pub fn retention(self, retention: Duration) -> Self {
        Self {
            inner: self.inner.retention(retention),
        }
    }

    /// The redelivery backoff.
    #[must_use]
    pub fn backoff(self, backoff: Backoff) -> Self {
        Self {
            inner: self.inner.backoff(backoff),
        }
    }

    /// After how many deliveries a message whose handler keeps failing is dead-lettered.
    #[must_use]
    pub fn max_deliveries(self, deliveries: u32) -> Self {
        Self {
            inner: self.inner.max_deliveries(deliveries),
        }
    }

    /// The consumer's name.
    #[must_use]
    pub fn name(&self) -> &'static str {
        self.inner.name()
    }
}

/// One delivery's handler call, as an operation of the record's transaction.
struct Handle<'a, H, M> {
    handler: &'a H,
    message: &'a M,
}

impl<H, M> TxOperation for Handle<'_, H, M>
where
    H: TxHandler<M>,
    M: Sync,
{
    type Value = ();
    type Error = HandlerError;

    async fn run(
        self,
        tx: &mut Transaction<'static, Postgres>,
        attempt: TxAttempt,
    ) -> Result<((), Outcome), HandlerError> {
        let outcome = self.handler.handle(self.message, tx, &attempt).await?;
        Ok(((), outcome))
    }
}

impl<H, M> Processor<M> for TxConsumer<H>
where
    H: TxHandler<M>,
    M: Delivery + Sync,
{
    async fn process(&self, message: &M) -> Disposition {
        let Consumer {
            guard,
            handler,
            rules,
        } = &self.inner;
        let key = match rules.key(message) {
            Ok(key) => key,
            Err(dead) => return dead,
        };
        let request = BeginRequest {
            scope: rules.scope.clone(),
            key: key.clone(),
            fingerprint: Fingerprint::of_bytes(message.payload()),
            token: Token::random(),
            lease: guard.lease_duration(),
            retention: guard.retention_duration(),
        };
        let operation = Handle { handler, message };
        let deliveries = message.delivery_count();
        match guard
            .store()
            .run_operation_in_transaction(request, operation)
            .await
        {
            Ok(TxExecution::Executed { .. }) => rules.executed(),
            Ok(TxExecution::Replayed(_)) => rules.duplicate(),
            Ok(TxExecution::InFlight { retry_after, .. }) => rules.in_flight(retry_after),
            Ok(TxExecution::Mismatch) => rules.mismatch(&key),
            // Nothing committed, or the commit's fate is unknown: the redelivery runs or replays.
            Err(TxError::Store(error)) => rules.store_unavailable(&error, deliveries),
            Err(TxError::Operation(error)) => rules.failed(error, deliveries),
        }
    }
}
