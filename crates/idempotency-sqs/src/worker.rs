//! The long-running consumer of one queue.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{
    DeleteMessageBatchRequestEntry, MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
};
use futures_util::FutureExt;
use idempotency_consumer::{
    Backoff, Delivery, Disposition, IDEMPOTENCY_KEY_HEADER, Processor, dead_letter_headers,
};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::task::JoinSet;

use idempotency_consumer::adapter::{AdapterError, AdapterErrorKind, Broker, Pipeline, retry_set_up};

use crate::{BROKER, SqsMessage, config, queue_name, sdk};

/// SQS's limits: messages per receive and per batch, the longest long poll, the longest
/// visibility timeout, message attributes per message.
const MAX_BATCH: usize = 10;
const MAX_WAIT: Duration = Duration::from_secs(20);
const MAX_VISIBILITY_SECS: u64 = 12 * 60 * 60;
const MAX_ATTRIBUTES: usize = 10;

/// How long a message whose dead-letter copy could not be sent stays away before it is tried
/// again.
const DEAD_LETTER_RETRY: Duration = Duration::from_secs(5);

/// Where dead letters go.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetters {
    /// Send a copy to the queue at this URL, with the reason in the `Idempotency-Dead-Reason`,
    /// `-Source`, `-Deliveries` and `-At` message attributes, then delete the original. The
    /// copy keeps the body and, within SQS's ten attributes a message, `Idempotency-Key` and
    /// the other attributes. To a FIFO dead-letter queue the copy goes in the original's
    /// message group (or `dead-letters`), deduplicated by the original's `MessageId`.
    Queue(String),
    /// Leave dead letters to the source queue's redrive policy: the message is made visible
    /// again at once, and SQS moves it to the policy's dead-letter queue once its receive count
    /// passes `maxReceiveCount`. The reason is logged, not attached (SQS moves the message as
    /// it is). The worker checks at start that the queue has a redrive policy.
    RedrivePolicy,
}

/// Consumes one queue with a [`Processor`]; see the [crate docs](crate).
///
/// ```no_run
/// use std::sync::Arc;
/// use idempotency_sqs::{DeadLetters, Worker};
/// # async fn example<P: idempotency_consumer::Processor<idempotency_sqs::SqsMessage> + 'static>(
/// #     client: aws_sdk_sqs::Client,
/// #     processor: P,
/// #     shutdown: impl Future<Output = ()> + Send,
/// # ) -> Result<(), idempotency_sqs::AdapterError> {
/// let queue = "https://sqs.eu-west-1.amazonaws.com/123456789012/payments";
/// let dead = DeadLetters::Queue("https://sqs.eu-west-1.amazonaws.com/123456789012/payments-dead".into());
/// let worker = Worker::new(client, queue, dead, Arc::new(processor))
///     .concurrency(32)
///     .visibility_timeout(std::time::Duration::from_secs(60));
/// worker.run_until(shutdown).await?; // SIGTERM, say: stop receiving, settle the running ones
/// # Ok(())
/// # }
/// ```
pub struct Worker<P> {
    shared: Shared,
    processor: Arc<P>,
    concurrency: usize,
    batch: usize,
    /// How many received messages of a standard queue are decided together.
    decided_together: usize,
    wait: Duration,
    /// With short polling: the pause after a receive that found nothing.
    idle: Duration,
    reconnect: Backoff,
    name: Option<String>,
}

/// What every message task needs (shared by them behind an `Arc` while the worker runs).
#[derive(Clone)]
struct Shared {
    client: Client,
    queue_url: String,
    queue: Arc<str>,
    fifo: bool,
    dead_letters: DeadLetters,
    visibility: Duration,
}

impl<P> fmt::Debug for Worker<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker")
            .field("queue_url", &self.shared.queue_url)
            .field("fifo", &self.shared.fifo)
            .field("dead_letters", &self.shared.dead_letters)
            .field("visibility", &self.shared.visibility)
            .field("heartbeat", &self.shared.heartbeat())
            .field("concurrency", &self.concurrency)
            .field("batch", &self.batch)
            .field("decided_together", &self.decided_together)
            .field("wait", &self.wait)
            .field("idle", &self.idle)
            .finish_non_exhaustive()
    }
}

impl<P: Processor<SqsMessage> + 'static> Worker<P> {
    /// A worker on the queue at `queue_url` (a FIFO queue when it ends in `.fifo`). Defaults:
    /// 10 messages at once, receives of up to 10 with a 20 s long poll, each receive of a
    /// standard queue decided as one batch, a 30 s visibility timeout extended every 10 s while
    /// a handler runs, receive errors retried from 100 ms doubling to 5 s.
    pub fn new(
        client: Client,
        queue_url: impl Into<String>,
        dead_letters: DeadLetters,
        processor: Arc<P>,
    ) -> Self {
        let queue_url = queue_url.into();
        Self {
            shared: Shared {
                client,
                queue: queue_name(&queue_url),
                fifo: queue_url.trim_end_matches('/').ends_with(".fifo"),
                queue_url,
                dead_letters,
                visibility: Duration::from_secs(30),
            },
            processor,
            concurrency: 10,
            batch: MAX_BATCH,
            decided_together: MAX_BATCH,
            wait: MAX_WAIT,
            idle: Duration::ZERO,
            reconnect: Backoff {
                initial: Duration::from_millis(100),
                max: Duration::from_secs(5),
            },
            name: None,
        }
    }

    /// How many messages (on a FIFO queue: message groups) are handled at once.
    #[must_use]
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency.max(1);
        self
    }

    /// The most messages one receive asks for (1 to 10): fetched ahead of processing.
    #[must_use]
    pub fn prefetch(mut self, batch: usize) -> Self {
        self.batch = batch.clamp(1, MAX_BATCH);
        self
    }

    /// How many messages of one receive of a standard queue are decided together (default
    /// 10, at most the receive's [`prefetch`](Self::prefetch)): the processor claims their keys
    /// in one store round trip and records their outcomes in one more
    /// ([`Processor::process_many`]), each message deleted once its own outcome is recorded; a
    /// nack, a dead letter or a panic of one never changes another's. `1` decides each on its
    /// own. A FIFO queue's messages are decided one after another within their group.
    #[must_use]
    pub fn batch(mut self, messages: usize) -> Self {
        self.decided_together = messages.max(1);
        self
    }

    /// How long a receive waits for messages (long polling; at most 20 s, whole seconds).
    #[must_use]
    pub fn wait_time(mut self, wait: Duration) -> Self {
        self.wait = wait.min(MAX_WAIT);
        self.idle = Duration::ZERO;
        self
    }

    /// Short polling instead of long polling: receives return at once, and after one that
    /// found nothing the worker pauses for `pause`. For local servers that answer one request
    /// at a time (moto, as `scripts/services` runs it), where a long poll would hold up every
    /// other client, heartbeats included. On SQS, long polling is cheaper: fewer, fuller
    /// receives, and no empty answers billed.
    #[must_use]
    pub fn short_polling(mut self, pause: Duration) -> Self {
        self.wait = Duration::ZERO;
        self.idle = pause;
        self
    }

    /// The visibility timeout the worker receives with (whole seconds, 1 s to 12 h), and
    /// extends to while a handler runs; the extensions come every third of it.
    #[must_use]
    pub fn visibility_timeout(mut self, visibility: Duration) -> Self {
        self.shared.visibility = Duration::from_secs(seconds(visibility).max(1));
        self
    }

    /// The name the metrics and logs carry (`consumer`); the queue's name by default.
    #[must_use]
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The wait between receive attempts after errors, and between attempts to reach the
    /// queues at the start.
    #[must_use]
    pub fn reconnect(mut self, backoff: Backoff) -> Self {
        self.reconnect = backoff;
        self
    }

    /// Consumes until `shutdown` completes, then stops receiving, lets the running handlers
    /// finish and settle (their visibility still extended), and flushes the pending deletes.
    ///
    /// Dropping the returned future instead is a crash: running handlers are abandoned, nothing
    /// more is deleted, and their messages come back after the visibility timeout, where the
    /// record decides. A receive cut short by `shutdown` may leave the messages it had
    /// fetched invisible until their visibility timeout; they are then delivered again.
    ///
    /// # Errors
    ///
    /// [`AdapterErrorKind::Refused`] when the queue or the dead-letter queue does not exist,
    /// [`AdapterErrorKind::Config`] when the queue has no redrive policy for
    /// [`DeadLetters::RedrivePolicy`] or SQS refuses the settings or credentials. Service errors
    /// while running are not returned: they are logged and counted, and the worker retries.
    pub async fn run_until<F>(&self, shutdown: F) -> Result<(), AdapterError>
    where
        F: Future<Output = ()> + Send,
    {
        let mut shutdown = std::pin::pin!(shutdown.fuse());
        let name = self.name.clone().unwrap_or_else(|| self.shared.queue.to_string());
        // The queues are checked first, waiting while SQS cannot be reached.
        match retry_set_up(&name, BROKER, self.reconnect, &mut shutdown, || self.check()).await {
            Some(checked) => checked?,
            None => return Ok(()),
        }
        let shared = Arc::new(self.shared.clone());
        let (deleter, batcher) = Deleter::start(Arc::clone(&shared));
        let batcher = AbortOnDrop(Some(batcher));
        let pipeline = Arc::new(Pipeline::new(
            SqsBroker {
                shared: Arc::clone(&shared),
                deleter,
            },
            name,
        ));
        let mut tasks = JoinSet::new();
        let permits = Arc::new(Semaphore::new(self.concurrency));
        let mut failures = 0_u32;
        tracing::info!(queue = %self.shared.queue, concurrency = self.concurrency, "consuming");
        loop {
            let first = tokio::select! {
                permit = Arc::clone(&permits).acquire_owned() => permit.expect("the semaphore is never closed"),
                () = &mut shutdown => break,
            };
            let want = (1 + permits.available_permits()).min(self.batch);
            let received = tokio::select! {
                received = self.receive(want) => received,
                () = &mut shutdown => break,
            };
            while let Some(ended) = tasks.try_join_next() {
                report_task_end(&self.shared.queue, ended);
            }
            match received {
                Ok(messages) if messages.is_empty() => {
                    failures = 0;
                    drop(first);
                    if !self.idle.is_zero() {
                        tokio::select! {
                            () = tokio::time::sleep(self.idle) => {}
                            () = &mut shutdown => break,
                        }
                    }
                }
                Ok(messages) => {
                    failures = 0;
                    let mut first = Some(first);
                    for unit in self.units(messages) {
                        // A batch of a standard queue holds a place per message; a FIFO
                        // group, whose messages run one after another, one.
                        let places = if self.shared.fifo { 1 } else { unit.len() };
                        let mut permit = match first.take() {
                            Some(permit) => permit,
                            None => Arc::clone(&permits)
                                .acquire_owned()
                                .await
                                .expect("the semaphore is never closed"),
                        };
                        if places > 1 {
                            let more = u32::try_from(places - 1).unwrap_or(u32::MAX);
                            permit.merge(
                                Arc::clone(&permits)
                                    .acquire_many_owned(more)
                                    .await
                                    .expect("the semaphore is never closed"),
                            );
                        }
                        let (pipeline, processor) = (Arc::clone(&pipeline), Arc::clone(&self.processor));
                        if self.shared.fifo || unit.len() == 1 {
                            tasks.spawn(run_unit(pipeline, processor, unit, permit));
                        } else {
                            tasks.spawn(run_batch(pipeline, processor, unit, permit));
                        }
                    }
                }
                Err(error) => {
                    drop(first);
                    failures = failures.saturating_add(1);
                    metrics::counter!("idempotency_sqs_receive_errors_total", "queue" => self.shared.queue.to_string())
                        .increment(1);
                    tracing::warn!(queue = %self.shared.queue, %error, "receive failed");
                    tokio::select! {
                        () = tokio::time::sleep(self.reconnect.delay(failures)) => {}
                        () = &mut shutdown => break,
                    }
                }
            }
        }
        tracing::info!(queue = %self.shared.queue, running = tasks.len(), "stopping: settling the running handlers");
        while let Some(ended) = tasks.join_next().await {
            report_task_end(&self.shared.queue, ended);
        }
        // The last handle on the delete queue: the batcher ends once it has sent what waits.
        drop(pipeline);
        if let Some(batcher) = batcher.take() {
            let _ = batcher.await;
        }
        Ok(())
    }

    /// Checks once that the queue and the dead-letter queue exist (or that the queue has a
    /// redrive policy, for [`DeadLetters::RedrivePolicy`]): a fail-fast check for the start of
    /// a service, since [`run_until`](Self::run_until) waits for a service it cannot reach.
    ///
    /// # Errors
    ///
    /// As [`run_until`](Self::run_until) returns them; a retryable
    /// [`AdapterErrorKind::Unreachable`] when the service could not be reached.
    pub async fn check(&self) -> Result<(), AdapterError> {
        let shared = &self.shared;
        let attributes = shared
            .client
            .get_queue_attributes()
            .queue_url(&shared.queue_url)
            .attribute_names(QueueAttributeName::RedrivePolicy)
            .send()
            .await
            .map_err(|e| sdk(AdapterErrorKind::Unreachable, "look up the queue", &e))?;
        match &shared.dead_letters {
            DeadLetters::RedrivePolicy => {
                let has_policy = attributes
                    .attributes()
                    .is_some_and(|a| a.contains_key(&QueueAttributeName::RedrivePolicy));
                if !has_policy {
                    return Err(config(format!(
                        "queue {} has no redrive policy: configure one, or give the worker a dead-letter queue",
                        shared.queue_url
                    )));
                }
            }
            DeadLetters::Queue(url) => {
                shared
                    .client
                    .get_queue_attributes()
                    .queue_url(url)
                    .attribute_names(QueueAttributeName::QueueArn)
                    .send()
                    .await
                    .map_err(|e| sdk(AdapterErrorKind::Unreachable, "look up the dead-letter queue", &e))?;
            }
        }
        Ok(())
    }

    async fn receive(&self, want: usize) -> Result<Vec<SqsMessage>, AdapterError> {
        let shared = &self.shared;
        let received = shared
            .client
            .receive_message()
            .queue_url(&shared.queue_url)
            .max_number_of_messages(i32::try_from(want).unwrap_or(10))
            .wait_time_seconds(i32::try_from(seconds(self.wait)).unwrap_or(20))
            .visibility_timeout(i32::try_from(seconds(shared.visibility)).unwrap_or(30))
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All")
            .send()
            .await
            .map_err(|e| sdk(AdapterErrorKind::Lost, "receive messages", &e))?;
        Ok(received
            .messages
            .unwrap_or_default()
            .into_iter()
            .map(SqsMessage::new)
            .collect())
    }

    /// What runs as one task: a batch of up to [`batch`](Self::batch) messages of a standard
    /// queue, decided together; each message group's messages, in the order received, on a
    /// FIFO queue.
    fn units(&self, messages: Vec<SqsMessage>) -> Vec<Vec<SqsMessage>> {
        if !self.shared.fifo {
            let mut units = Vec::new();
            let mut messages = messages.into_iter().peekable();
            while messages.peek().is_some() {
                units.push(messages.by_ref().take(self.decided_together).collect());
            }
            return units;
        }
        let mut groups: Vec<Vec<SqsMessage>> = Vec::new();
        for message in messages {
            let group = message.group_id().map(str::to_owned);
            match groups
                .iter_mut()
                .find(|unit| unit[0].group_id().map(str::to_owned) == group)
            {
                Some(unit) => unit.push(message),
                None => groups.push(vec![message]),
            }
        }
        groups
    }
}

fn report_task_end(queue: &str, ended: Result<(), tokio::task::JoinError>) {
    if let Err(error) = ended
        && error.is_panic()
    {
        tracing::error!(%queue, "a message task panicked; its message comes back after its visibility timeout");
    }
}

/// Handles a unit's messages in order. On a FIFO queue, a message left in the queue stops
/// the unit: the rest of its group go back with it, so the group resumes in order.
async fn run_unit<P: Processor<SqsMessage>>(
    pipeline: Arc<Pipeline<SqsBroker>>,
    processor: Arc<P>,
    unit: Vec<SqsMessage>,
    _permit: OwnedSemaphorePermit,
) {
    let shared = &pipeline.broker().shared;
    let queue = shared.queue.to_string();
    metrics::gauge!("idempotency_sqs_in_flight", "queue" => queue.clone()).increment(1.0);
    let mut messages = unit.into_iter();
    while let Some(message) = messages.next() {
        let disposition = pipeline.decide(&*processor, &message).await;
        let settled = pipeline.settle(&message, &disposition).await.is_ok();
        let left = shared.left(&disposition, settled);
        if let Some(after) = left
            && shared.fifo
        {
            for rest in messages.by_ref() {
                // Best effort: a message not returned comes back after its visibility timeout.
                let _ = shared.change_visibility(&rest, after).await;
                metrics::counter!("idempotency_sqs_messages_total", "queue" => queue.clone(), "result" => "returned")
                    .increment(1);
            }
        }
    }
    metrics::gauge!("idempotency_sqs_in_flight", "queue" => queue).decrement(1.0);
}

/// Decides a batch of a standard queue's messages together ([`Pipeline::process_batch`]),
/// each deleted (or returned, or dead-lettered) as soon as its own outcome is recorded.
async fn run_batch<P: Processor<SqsMessage>>(
    pipeline: Arc<Pipeline<SqsBroker>>,
    processor: Arc<P>,
    batch: Vec<SqsMessage>,
    _permits: OwnedSemaphorePermit,
) {
    let queue = pipeline.broker().shared.queue.to_string();
    let in_flight = metrics::gauge!("idempotency_sqs_in_flight", "queue" => queue);
    in_flight.increment(1.0);
    let messages: Vec<&SqsMessage> = batch.iter().collect();
    // Failed settlements are logged and counted by the pipeline: the message comes back after
    // its visibility timeout, and the record answers it.
    let _ = pipeline.process_batch(&*processor, &messages).await;
    in_flight.decrement(1.0);
}

/// SQS as the per-message pipeline sees it: the queue, where dead letters go, and the batched
/// deletes. A message's visibility is extended every third of the visibility timeout while it
/// is processed.
struct SqsBroker {
    shared: Arc<Shared>,
    deleter: Deleter,
}

impl Broker for SqsBroker {
    type Message = SqsMessage;
    const NAME: &'static str = BROKER;

    fn keep_alive_every(&self) -> Option<Duration> {
        Some(self.shared.heartbeat())
    }

    async fn keep_alive(&self, message: &SqsMessage) -> Result<(), AdapterError> {
        self.shared.extend(message).await
    }

    /// `Ack`: delete. `Nack`: visible again after the delay. `DeadLetter`: a copy to the
    /// dead-letter queue, then delete (a copy SQS did not take makes the message visible again
    /// after a pause, to be dead-lettered again), or, with the redrive policy, visible again at
    /// once for SQS to move.
    async fn settle(&self, message: &SqsMessage, disposition: &Disposition) -> Result<(), AdapterError> {
        let shared = &self.shared;
        let count = |result: &'static str| {
            metrics::counter!("idempotency_sqs_messages_total", "queue" => shared.queue.to_string(), "result" => result)
                .increment(1);
        };
        match disposition {
            Disposition::Ack => {
                count("acked");
                self.deleter.delete(message).await
            }
            Disposition::Nack { after } => {
                count("retried");
                shared.change_visibility(message, *after).await
            }
            Disposition::DeadLetter { reason } => match &shared.dead_letters {
                DeadLetters::Queue(url) => match shared.send_dead_letter(url, message, reason).await {
                    Ok(()) => {
                        count("dead_lettered");
                        self.deleter.delete(message).await
                    }
                    Err(error) => {
                        count("retried");
                        let _ = shared.change_visibility(message, DEAD_LETTER_RETRY).await;
                        Err(error)
                    }
                },
                DeadLetters::RedrivePolicy => {
                    count("dead_lettered");
                    tracing::warn!(
                        queue = %shared.queue,
                        id = message.sqs_message_id(),
                        receives = message.delivery_count(),
                        %reason,
                        "dead letter left to the queue's redrive policy"
                    );
                    shared.change_visibility(message, Duration::ZERO).await
                }
            },
        }
    }
}

impl Shared {
    /// How often a running handler's message has its visibility extended: a third of the
    /// timeout, so that two extensions can fail before the message is visible again.
    fn heartbeat(&self) -> Duration {
        self.visibility / 3
    }

    /// How long `message` stays away after `disposition` was carried out (`settled`) or not:
    /// `None` when it was deleted or handed to the dead-letter queue.
    fn left(&self, disposition: &Disposition, settled: bool) -> Option<Duration> {
        match (disposition, settled) {
            (Disposition::Ack, true) => None,
            (Disposition::Ack, false) => Some(self.visibility),
            (Disposition::Nack { after }, _) => Some(*after),
            (Disposition::DeadLetter { .. }, true) => match self.dead_letters {
                DeadLetters::Queue(_) => None,
                DeadLetters::RedrivePolicy => Some(Duration::ZERO),
            },
            (Disposition::DeadLetter { .. }, false) => Some(DEAD_LETTER_RETRY),
        }
    }

    /// Extends the message's visibility by the full timeout, from now.
    async fn extend(&self, message: &SqsMessage) -> Result<(), AdapterError> {
        let extended = self
            .client
            .change_message_visibility()
            .queue_url(&self.queue_url)
            .receipt_handle(message.receipt_handle())
            .visibility_timeout(i32::try_from(seconds(self.visibility)).unwrap_or(30))
            .send()
            .await
            .map(drop)
            .map_err(|e| sdk(AdapterErrorKind::Lost, "extend a message's visibility", &e));
        let result = if extended.is_ok() { "ok" } else { "failed" };
        metrics::counter!("idempotency_sqs_visibility_extensions_total", "queue" => self.queue.to_string(), "result" => result)
            .increment(1);
        extended
    }

    /// Makes the message visible again after `after` (whole seconds, at most 12 h); if SQS
    /// does not take it, the message comes back after its current visibility timeout instead.
    async fn change_visibility(&self, message: &SqsMessage, after: Duration) -> Result<(), AdapterError> {
        let secs = seconds(after).min(MAX_VISIBILITY_SECS);
        self.client
            .change_message_visibility()
            .queue_url(&self.queue_url)
            .receipt_handle(message.receipt_handle())
            .visibility_timeout(i32::try_from(secs).unwrap_or(0))
            .send()
            .await
            .map(drop)
            .map_err(|e| sdk(AdapterErrorKind::Settle, "change a message's visibility", &e))
    }

    /// Sends the dead-letter copy of `message` to `url`, and waits for SQS to accept it.
    async fn send_dead_letter(
        &self,
        url: &str,
        message: &SqsMessage,
        reason: &str,
    ) -> Result<(), AdapterError> {
        let mut send = self
            .client
            .send_message()
            .queue_url(url)
            .message_body(message.message().body().unwrap_or_default());
        let mut attributes = 0;
        for (name, value) in dead_letter_headers(&self.queue, message.delivery_count(), reason) {
            let value = if value.is_empty() { "-".to_owned() } else { value };
            send = send.message_attributes(name, string_attribute(value)?);
            attributes += 1;
        }
        if let Some(originals) = message.message().message_attributes() {
            let mut names: Vec<&String> = originals.keys().collect();
            // The key first: it is what a replay of the dead letter needs.
            names.sort_by_key(|name| (name.as_str() != IDEMPOTENCY_KEY_HEADER, name.as_str()));
            for name in names {
                if name.starts_with("Idempotency-Dead-") {
                    continue;
                }
                if attributes == MAX_ATTRIBUTES {
                    tracing::warn!(queue = %self.queue, attribute = %name, "dead letter copy: attribute dropped (SQS allows 10)");
                    continue;
                }
                send = send.message_attributes(name.clone(), originals[name].clone());
                attributes += 1;
            }
        }
        if url.trim_end_matches('/').ends_with(".fifo") {
            send = send
                .message_group_id(message.group_id().unwrap_or("dead-letters"))
                .message_deduplication_id(format!("dead-{}", message.sqs_message_id()));
        }
        send.send()
            .await
            .map_err(|e| sdk(AdapterErrorKind::Settle, "send a dead letter", &e))?;
        Ok(())
    }
}

fn string_attribute(value: String) -> Result<MessageAttributeValue, AdapterError> {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .map_err(|e| config(e.to_string()))
}

/// A duration in whole seconds, rounded up (SQS counts visibility in seconds).
fn seconds(duration: Duration) -> u64 {
    duration.as_secs() + u64::from(duration.subsec_nanos() > 0)
}

/// A delete waiting for its batch, and who to tell how it went.
type PendingDelete = (String, oneshot::Sender<Result<(), AdapterError>>);

/// Deletes messages in batches of up to ten: whatever is waiting when the previous batch's
/// answer arrives goes in the next one.
#[derive(Clone)]
struct Deleter {
    queue: Arc<str>,
    pending: mpsc::Sender<PendingDelete>,
}

impl Deleter {
    fn start(shared: Arc<Shared>) -> (Self, tokio::task::JoinHandle<()>) {
        let (pending, mut waiting) = mpsc::channel::<PendingDelete>(1024);
        let queue = Arc::clone(&shared.queue);
        let batcher = tokio::spawn(async move {
            let mut batch = Vec::with_capacity(MAX_BATCH);
            while waiting.recv_many(&mut batch, MAX_BATCH).await > 0 {
                let results = shared.delete_batch(&batch).await;
                for ((_, reply), result) in batch.drain(..).zip(results) {
                    let _ = reply.send(result);
                }
            }
        });
        (Self { queue, pending }, batcher)
    }

    /// Deletes `message`, and waits for SQS's answer; a failure is counted (the message comes
    /// back after its visibility timeout, and the record answers it).
    async fn delete(&self, message: &SqsMessage) -> Result<(), AdapterError> {
        let (reply, answer) = oneshot::channel();
        let stopped = || {
            AdapterError::new(
                AdapterErrorKind::Settle,
                BROKER,
                "delete: the delete batcher stopped",
            )
        };
        let result = match self
            .pending
            .send((message.receipt_handle().to_owned(), reply))
            .await
        {
            Ok(()) => answer.await.unwrap_or_else(|_| Err(stopped())),
            Err(_) => Err(stopped()),
        };
        metrics::counter!(
            "idempotency_sqs_deletes_total",
            "queue" => self.queue.to_string(),
            "result" => if result.is_ok() { "ok" } else { "failed" }
        )
        .increment(1);
        result
    }
}

impl Shared {
    /// One `DeleteMessageBatch`; the result of each entry, in order.
    async fn delete_batch(&self, batch: &[PendingDelete]) -> Vec<Result<(), AdapterError>> {
        let failed = |message: String| AdapterError::new(AdapterErrorKind::Settle, BROKER, message);
        let entries: Result<Vec<_>, _> = batch
            .iter()
            .enumerate()
            .map(|(index, (receipt, _))| {
                DeleteMessageBatchRequestEntry::builder()
                    .id(index.to_string())
                    .receipt_handle(receipt)
                    .build()
            })
            .collect();
        let answer = match entries {
            Ok(entries) => self
                .client
                .delete_message_batch()
                .queue_url(&self.queue_url)
                .set_entries(Some(entries))
                .send()
                .await
                .map_err(|e| {
                    sdk(AdapterErrorKind::Settle, "delete messages", &e)
                        .message()
                        .to_owned()
                }),
            Err(error) => Err(format!("delete messages: {error}")),
        };
        match answer {
            Ok(answer) => (0..batch.len())
                .map(|index| {
                    let id = index.to_string();
                    match answer.failed().iter().find(|failed| failed.id() == id) {
                        Some(entry) => Err(failed(format!(
                            "delete a message: {}: {}",
                            entry.code(),
                            entry.message().unwrap_or_default()
                        ))),
                        None => Ok(()),
                    }
                })
                .collect(),
            Err(message) => (0..batch.len()).map(|_| Err(failed(message.clone()))).collect(),
        }
    }
}

/// Aborts a task when dropped: the delete batcher of a worker whose `run_until` future was
/// dropped stops with it.
struct AbortOnDrop(Option<tokio::task::JoinHandle<()>>);

impl AbortOnDrop {
    fn take(mut self) -> Option<tokio::task::JoinHandle<()>> {
        self.0.take()
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(task) = &self.0 {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_durations_up_to_whole_seconds() {
        assert_eq!(seconds(Duration::ZERO), 0);
        assert_eq!(seconds(Duration::from_millis(1)), 1);
        assert_eq!(seconds(Duration::from_secs(2)), 2);
        assert_eq!(seconds(Duration::from_millis(2001)), 3);
    }
}
