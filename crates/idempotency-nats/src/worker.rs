//! A long-running consumer of one durable JetStream pull consumer.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::context::GetStreamErrorKind;
use async_nats::jetstream::stream::ConsumerErrorKind;
use async_nats::jetstream::{self, consumer::PullConsumer};
use futures_util::StreamExt;
use futures_util::future::FutureExt;
use idempotency_consumer::{Backoff, Processor};

use idempotency_consumer::adapter::{AdapterError, AdapterErrorKind, Flow, Pipeline, retry_set_up};

use crate::{BROKER, JetStream, NatsMessage};

/// Consumes a durable pull consumer with a [`Processor`], up to `concurrency` messages at a
/// time, each through [`process`](crate::process) (progress acks while it runs, the disposition carried out
/// after the outcome is recorded). Messages are pulled `concurrency` at a time, so none waits
/// in the client past its ack wait.
///
/// ```no_run
/// use std::sync::Arc;
/// use idempotency_nats::Worker;
/// # async fn example<P: idempotency_consumer::Processor<idempotency_nats::NatsMessage>>(
/// #     jetstream: async_nats::jetstream::Context,
/// #     processor: P,
/// #     shutdown: impl Future<Output = ()> + Send,
/// # ) -> Result<(), idempotency_nats::AdapterError> {
/// Worker::new(jetstream, "PAYMENTS", "charges", "payments.dead", Arc::new(processor))
///     .concurrency(32)
///     .run_until(shutdown) // SIGTERM, say: stop pulling, settle the running ones
///     .await?;
/// # Ok(())
/// # }
/// ```
#[derive(derive_more::Debug)]
pub struct Worker<P> {
    #[debug(skip)]
    jetstream: jetstream::Context,
    stream: String,
    consumer: String,
    dead_letter_subject: String,
    #[debug(skip)]
    processor: Arc<P>,
    flow: Flow,
    ack_wait: Duration,
    filter_subject: Option<String>,
}

impl<P: Processor<NatsMessage>> Worker<P> {
    /// A worker on the durable pull consumer `consumer` of `stream` (created with explicit
    /// acks if it does not exist), dead-lettering to `dead_letter_subject`. Defaults:
    /// concurrency 16, batches of up to [`DEFAULT_BATCH`](idempotency_consumer::DEFAULT_BATCH)
    /// (at most the prefetch) lingering [`DEFAULT_LINGER`](idempotency_consumer::DEFAULT_LINGER),
    /// an ack wait of 30 s for a consumer it creates.
    pub fn new(
        jetstream: jetstream::Context,
        stream: impl Into<String>,
        consumer: impl Into<String>,
        dead_letter_subject: impl Into<String>,
        processor: Arc<P>,
    ) -> Self {
        Self {
            jetstream,
            stream: stream.into(),
            consumer: consumer.into(),
            dead_letter_subject: dead_letter_subject.into(),
            processor,
            flow: Flow::default(),
            ack_wait: Duration::from_secs(30),
            filter_subject: None,
        }
    }

    idempotency_consumer::flow_setters! {
        messages: "messages",
        name: "the durable consumer's",
        concurrency: "How many messages are handled at once (default 16).",
        prefetch: "How many messages one pull asks for (by default the concurrency). More than \
                   the concurrency makes messages wait in the client, their ack wait running; \
                   progress acks start only once a message is handled.",
    }

    /// The ack wait of a consumer the worker creates (an existing one keeps its own); progress
    /// acks go out every third of it while a message is handled.
    #[must_use]
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait.max(Duration::from_millis(300));
        self
    }

    /// The subject a consumer the worker creates takes its messages from (by default the whole
    /// stream). It must not match the dead-letter subject.
    #[must_use]
    pub fn filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.filter_subject = Some(subject.into());
        self
    }

    /// Finds (or creates) the durable consumer; the error names the stream and consumer. A
    /// consumer that would receive its own dead letters is refused: each dead letter would be
    /// handled again, and dead-lettered again, without end.
    ///
    /// # Errors
    ///
    /// [`AdapterError`] when the stream does not exist or the consumer cannot be made
    /// ([`AdapterErrorKind::Refused`]), or when JetStream did not answer in time, the request
    /// could not be sent or JetStream is unavailable for now (no leader, say):
    /// [`AdapterErrorKind::Unreachable`], which may pass.
    pub async fn consumer(&self) -> Result<PullConsumer, AdapterError> {
        let fail_as = |kind: AdapterErrorKind, why: String| {
            AdapterError::new(
                kind,
                BROKER,
                format!(
                    "JetStream consumer {:?} of stream {:?}: {why}",
                    self.consumer, self.stream
                ),
            )
        };
        let fail = |why: String| fail_as(AdapterErrorKind::Refused, why);
        let stream = self.jetstream.get_stream(&self.stream).await.map_err(|e| {
            let kind = match e.kind() {
                GetStreamErrorKind::Request => AdapterErrorKind::Unreachable,
                GetStreamErrorKind::JetStream(api) if unavailable(&api) => AdapterErrorKind::Unreachable,
                _ => AdapterErrorKind::Refused,
            };
            fail_as(kind, format!("the stream cannot be found: {e}"))
        })?;
        let stores_dead_letters = stream
            .cached_info()
            .config
            .subjects
            .iter()
            .any(|subject| subject_matches(subject, &self.dead_letter_subject));
        let consumer: PullConsumer = stream
            .get_or_create_consumer(
                &self.consumer,
                jetstream::consumer::pull::Config {
                    durable_name: Some(self.consumer.clone()),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ack_wait: self.ack_wait,
                    filter_subject: self.filter_subject.clone().unwrap_or_default(),
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| {
                let kind = match e.kind() {
                    ConsumerErrorKind::TimedOut | ConsumerErrorKind::Request => AdapterErrorKind::Unreachable,
                    ConsumerErrorKind::JetStream(api) if unavailable(&api) => AdapterErrorKind::Unreachable,
                    _ => AdapterErrorKind::Refused,
                };
                let why = format!("the consumer cannot be found or created: {e}");
                fail_as(kind, why)
            })?;
        let config = &consumer.cached_info().config;
        let mut filters: Vec<&str> = config.filter_subjects.iter().map(String::as_str).collect();
        if !config.filter_subject.is_empty() {
            filters.push(&config.filter_subject);
        }
        let receives_dead_letters = stores_dead_letters
            && (filters.is_empty()
                || filters
                    .iter()
                    .any(|filter| subject_matches(filter, &self.dead_letter_subject)));
        if receives_dead_letters {
            return Err(fail(format!(
                "it would receive its own dead letters (subject {:?}): give it a filter subject that leaves them out, or dead-letter to another stream",
                self.dead_letter_subject
            )));
        }
        Ok(consumer)
    }

    /// Consumes until `shutdown` completes, then stops pulling, lets the running messages
    /// settle and returns. A lost connection is waited for (the client reconnects by itself),
    /// also at the start: finding the consumer is tried again (with backoff, from 100 ms
    /// doubling to 5 s) while JetStream does not answer or is unavailable.
    ///
    /// # Errors
    ///
    /// [`AdapterError`] when JetStream refuses the consumer at the start: the stream does not
    /// exist, the consumer cannot be made, or it would receive its own dead letters.
    pub async fn run_until<F>(&self, shutdown: F) -> Result<(), AdapterError>
    where
        F: Future<Output = ()> + Send,
    {
        let shutdown = Box::pin(shutdown).shared();
        let name = self.flow.name_or(&self.consumer);
        let concurrency = self.flow.concurrency.unwrap_or(16);
        let prefetch = self.flow.prefetch.unwrap_or(concurrency);
        let found = retry_set_up(&name, BROKER, SET_UP_BACKOFF, shutdown.clone(), || {
            self.consumer()
        })
        .await;
        let consumer = match found {
            Some(found) => found?,
            None => return Ok(()),
        };
        let progress_every = consumer.cached_info().config.ack_wait / 3;
        let broker = JetStream::new(
            self.jetstream.clone(),
            self.dead_letter_subject.clone(),
            progress_every,
        );
        let pipeline = Pipeline::new(broker, name);
        tracing::info!(stream = %self.stream, consumer = %self.consumer, "consuming");
        while shutdown.peek().is_none() {
            let messages = consumer
                .stream()
                .max_messages_per_batch(prefetch)
                .messages()
                .await;
            let messages = match messages {
                Ok(messages) => messages,
                Err(error) => {
                    tracing::warn!(%error, "pulling from JetStream failed; trying again");
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                        () = shutdown.clone() => break,
                    }
                }
            };
            let messages = messages
                .take_until(shutdown.clone())
                .filter_map(|message| {
                    std::future::ready(match message {
                        Ok(message) => Some(NatsMessage::new(message)),
                        Err(error) => {
                            tracing::warn!(%error, "a pulled message failed");
                            None
                        }
                    })
                })
                // Boxed: the combinators' closures otherwise keep the future from being
                // proved `Send` for every lifetime.
                .boxed();
            // A failed settlement is logged and counted by the pipeline: unsettled, the message
            // comes back after its ack wait and the record answers it.
            pipeline
                .run(&*self.processor, messages, &self.flow, prefetch, concurrency)
                .await;
        }
        Ok(())
    }
}

/// Whether the subject `pattern` (with NATS wildcards: `*` one token, `>` the rest) matches the
/// literal `subject`. (A dozen lines: the NATS client exposes no matcher.)
fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut subject = subject.split('.');
    for token in pattern.split('.') {
        match (token, subject.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (token, Some(part)) if token == part => {}
            _ => return false,
        }
    }
    subject.next().is_none()
}

/// The wait between attempts to find the consumer while JetStream does not answer.
const SET_UP_BACKOFF: Backoff = Backoff {
    initial: Duration::from_millis(100),
    max: Duration::from_secs(5),
};

/// Whether a JetStream API error says JetStream is unavailable for now (a 503: no leader, the
/// system not ready), which passes, rather than a refusal.
fn unavailable(api: &jetstream::Error) -> bool {
    api.code() == 503
}

#[cfg(test)]
mod tests {
    use super::subject_matches;

    #[test]
    fn subjects_match_nats_wildcards() {
        assert!(subject_matches("orders.dead", "orders.dead"));
        assert!(subject_matches("orders.*", "orders.dead"));
        assert!(subject_matches("orders.>", "orders.dead.eu"));
        assert!(subject_matches(">", "orders"));
        assert!(!subject_matches("orders.work", "orders.dead"));
        assert!(!subject_matches("orders.*", "orders.dead.eu"));
        assert!(!subject_matches("orders.dead.eu", "orders.dead"));
        assert!(!subject_matches("orders.>", "orders"));
    }
}
