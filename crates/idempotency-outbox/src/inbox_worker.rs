//! Competing inbox workers: batches claimed with `SKIP LOCKED`, woken by `LISTEN/NOTIFY`, with
//! polling as the fallback, and a cleanup task for the dedup window.

use std::future::Future;
use std::sync::Arc;

use crate::OutboxError;
use crate::inbox::{Inbox, InboxHandler, RetryPolicy};
use crate::wake::{self, Pace, pace_setters};

/// Runs an [`InboxHandler`] over an [`Inbox`] with competing workers.
///
/// - Each worker claims a batch of due messages with `FOR UPDATE SKIP LOCKED` (so workers in
///   this process and in others never take the same message), handles each in the transaction
///   that marks it, and commits the batch.
/// - Idle workers wait for the inbox's `NOTIFY` (sent when a message is stored or replayed), or
///   for the poll interval at most: a lost notification costs latency, never a message.
/// - A cleanup task deletes processed rows older than the retention (the dedup window), in
///   batches; dead rows stay until they are replayed or purged (`idem inbox`).
/// - Gauges of the backlog, the oldest pending message's age and the dead rows are refreshed
///   with each cleanup round.
///
/// A worker that crashes mid-batch leaves a transaction the server rolls back: the handler's
/// writes are undone and the messages are due again, so nothing is lost and nothing that
/// committed runs twice. A handler's side effects outside the transaction (an HTTP call) are
/// not covered by it: pass the message's key on to the service called. A message that kills
/// its worker's process every time is retried without end, since its attempt count is written
/// in the transaction that the crash rolls back: `idempotency_inbox_oldest_pending_seconds`
/// shows it.
#[derive(Debug)]
pub struct InboxWorker<H> {
    inbox: Inbox,
    handler: Arc<H>,
    retry: RetryPolicy,
    pace: Pace,
}

impl<H: InboxHandler + 'static> InboxWorker<H> {
    /// Workers of `inbox` running `handler`. Defaults: 1 worker, batches of 16, the default
    /// [`RetryPolicy`], polling every second, processed rows kept 7 days and cleaned up every
    /// minute.
    pub fn new(inbox: Inbox, handler: Arc<H>) -> Self {
        Self {
            inbox,
            handler,
            retry: RetryPolicy::default(),
            pace: Pace::new(1, 16),
        }
    }

    /// How many workers compete in this process.
    #[must_use]
    pub fn workers(mut self, workers: usize) -> Self {
        self.pace.loops = workers.max(1);
        self
    }

    /// How failed messages are retried.
    #[must_use]
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    pace_setters!(
        batch: "How many messages one transaction claims.",
        idle: "workers",
        notifications: "the default",
        kept: "processed rows are kept (the dedup window: a duplicate arriving later is stored and \
               handled again)",
    );

    /// Runs the workers and the cleanup until `shutdown` completes; then lets each worker
    /// finish its batch and returns.
    ///
    /// # Errors
    ///
    /// [`OutboxError::Database`] when the first connection for notifications fails. Later
    /// database failures are logged and retried with backoff.
    pub async fn run_until<F>(&self, shutdown: F) -> Result<(), OutboxError>
    where
        F: Future<Output = ()> + Send,
    {
        let what = format!("inbox {}", self.inbox.consumer());
        let round = || async {
            let claimed = self
                .inbox
                .process_batch(&*self.handler, self.pace.batch, &self.retry)
                .await?;
            Ok(claimed == self.pace.batch as usize)
        };
        let cleanup = || async {
            if let Err(error) = crate::admin::purge_processed(&self.inbox, self.pace.retention).await {
                tracing::warn!(consumer = %self.inbox.consumer(), %error, "inbox cleanup failed");
            }
            if let Err(error) = crate::admin::refresh_inbox_gauges(&self.inbox).await {
                tracing::warn!(consumer = %self.inbox.consumer(), %error, "inbox statistics failed");
            }
        };
        let channel = self.inbox.tables().inbox_channel();
        let listen = self.pace.listen.then_some((self.inbox.pool(), channel.as_str()));
        wake::run(listen, &what, &self.pace, round, cleanup, shutdown).await
    }
}
