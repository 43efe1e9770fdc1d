//! Same-transaction consumers, on any [`TransactionalStore`] (PostgreSQL today).
//!
//! When a message's side effect is a write to the same database as the record (a
//! charge row, a ledger entry, an outbox row), the handler can write it **in the record's
//! transaction**: the claim, the business rows and the completion commit together or not at all.
//! A crash anywhere before the commit leaves nothing behind, and the redelivery runs from
//! scratch; a crash after it leaves a completed record, and the redelivery is acked as a
//! duplicate. No lease can expire under a running handler, since the uncommitted claim is
//! invisible: a concurrent duplicate waits on the row lock, then replays (or, after a
//! rollback, runs).
//!
//! The consumer is generic over the store, so this crate knows no database; with
//! `idempotency-postgres` the transaction is its `PgTransaction` and the handler writes with
//! `sqlx::query(…).execute(&mut **tx)` (that crate's docs show it whole). Here the handler works
//! on any store whose transaction can record a charge:
//!
//! ```
//! use idempotency_consumer::{Delivery, HandlerError, TxHandler};
//! use idempotency_core::{Attempt, Outcome, TransactionalStore};
//!
//! /// What the handler needs of the transaction.
//! trait Ledger: Send {
//!     fn insert_charge(&mut self, key: &str, cents: i64) -> impl Future<Output = std::io::Result<()>> + Send;
//! }
//!
//! struct RecordCharge;
//!
//! impl<M, S> TxHandler<M, S> for RecordCharge
//! where
//!     M: Delivery + Sync,
//!     S: TransactionalStore<Transaction: Ledger>,
//! {
//!     async fn handle(&self, message: &M, tx: &mut S::Transaction, attempt: &Attempt) -> Result<Outcome, HandlerError> {
//!         let cents: i64 = std::str::from_utf8(message.payload())
//!             .ok()
//!             .and_then(|text| text.parse().ok())
//!             .ok_or_else(|| HandlerError::fatal("the payload is not an amount in cents"))?;
//!         tx.insert_charge(attempt.key().as_str(), cents).await.map_err(HandlerError::retry)?;
//!         Ok(Outcome::new("charged"))
//!     }
//! }
//! // `TxConsumer::new("charges", store, RecordCharge)` then processes deliveries: its rows
//! // commit with the record, or not at all.
//! ```

use std::future::Future;
use std::time::Duration;

use idempotency_core::{Attempt, Fingerprint, Outcome, TransactionalStore, TxOperation};

use crate::{
    Backoff, Consumer, Delivery, Disposition, HandlerError, KeySource, Processor, complete_on_success,
};

/// Handles messages of type `M` inside the record's transaction on the store `S` (its
/// [`TransactionalStore::Transaction`]); runs at most once per key while its outcome is
/// retained, and its writes commit with the record.
pub trait TxHandler<M: ?Sized, S: TransactionalStore + ?Sized>: Send + Sync {
    /// Writes the side effect of `message` through `tx` and returns the outcome to keep for
    /// duplicates. On `Err`, everything it wrote is rolled back.
    fn handle(
        &self,
        message: &M,
        tx: &mut S::Transaction,
        attempt: &Attempt,
    ) -> impl Future<Output = Result<Outcome, HandlerError>> + Send;
}

/// A consumer whose handler writes in the record's transaction; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct TxConsumer<S, H> {
    pub(crate) inner: Consumer<S, H>,
}

impl<S: TransactionalStore, H> TxConsumer<S, H> {
    /// A consumer named `name` whose handler writes in the record's transaction on `store`.
    /// The defaults are those of [`Consumer::new`]; there is no lease to set, since an
    /// uncommitted claim cannot expire under its handler.
    ///
    /// # Panics
    ///
    /// If `name` is not a valid scope (1 to 255 bytes of visible ASCII).
    pub fn new(name: impl Into<metrics::SharedString>, store: S, handler: H) -> Self {
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

    /// How long a delivery whose key another (non-transactional) consumer holds waits for its
    /// outcome; see [`Consumer::in_flight_wait`]. Copies handled by transactional consumers
    /// wait on the record's row lock instead.
    #[must_use]
    pub fn in_flight_wait(self, wait: Duration) -> Self {
        Self {
            inner: self.inner.in_flight_wait(wait),
        }
    }

    /// The consumer's name.
    #[must_use]
    pub fn name(&self) -> &str {
        self.inner.name()
    }
}

/// One delivery's handler call, as an operation of the record's transaction.
pub(crate) struct Handle<'a, H, M> {
    pub(crate) handler: &'a H,
    pub(crate) message: &'a M,
}

impl<H, M, S> TxOperation<S> for Handle<'_, H, M>
where
    S: TransactionalStore,
    H: TxHandler<M, S>,
    M: Sync,
{
    type Value = Result<Outcome, HandlerError>;

    async fn run(self, tx: &mut S::Transaction, attempt: Attempt) -> Result<Outcome, HandlerError> {
        crate::catching_panics(self.handler.handle(self.message, tx, &attempt)).await
    }
}

impl<S, H, M> Processor<M> for TxConsumer<S, H>
where
    S: TransactionalStore,
    H: TxHandler<M, S>,
    M: Delivery + Sync,
{
    async fn process(&self, message: &M) -> Disposition {
        let Consumer {
            guard,
            handler,
            rules,
            ..
        } = &self.inner;
        let started = std::time::Instant::now();
        let key = match rules.key(message) {
            Ok(key) => key,
            Err(dead) => return dead,
        };
        let fingerprint = Fingerprint::of_bytes(message.payload());
        let run = self
            .inner
            .waiting(&key, || {
                guard.run_operation_in_transaction(
                    rules.scope.clone(),
                    key.clone(),
                    fingerprint,
                    complete_on_success,
                    Handle { handler, message },
                )
            })
            .await;
        rules.settle(run, &key, message, started)
    }

    /// One transaction for up to [`MOST_PER_TRANSACTION`](crate::MOST_PER_TRANSACTION)
    /// messages, a savepoint for each, one commit before any of their dispositions is handed
    /// over; see [`crate::transactional_batch`].
    fn process_many(&self, messages: &[&M], decided: &crate::Decisions) -> impl Future<Output = ()> + Send
    where
        M: Sync,
    {
        crate::transactional_batch::process_many(self, messages, decided)
    }
}
