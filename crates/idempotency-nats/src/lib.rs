//! Idempotent NATS JetStream consumers, on the broker-neutral rules of `idempotency-consumer`.
//!
//! * [`process`] runs a [`Processor`] (a consumer) on one JetStream message. While the handler runs it sends
//!   progress acks (`+WPI`), so a long handler does not have its message redelivered to another
//!   consumer. Then it carries out the [`Disposition`]:
//!   * `Ack` is a **double ack**, confirmed by the server, and only after the outcome is
//!     recorded;
//!   * `Nack { after }` is a `NAK` with that delay;
//!   * `DeadLetter { reason }` publishes the message to the dead-letter subject, with the reason
//!     in the `Idempotency-Dead-Reason` header, awaits the publish ack, and then `TERM`s the
//!     original.
//! * [`Worker`] runs [`process`] on a durable pull consumer, a bounded number of messages at a
//!   time, until it is told to stop (then the running messages settle first).
//! * [`publish`] sets both `Idempotency-Key` (for the consumer's record) and `Nats-Msg-Id` (the
//!   stream's own duplicate window, which drops a producer's retried publish at the server) and
//!   awaits the publish ack.
//!
//! The delivery count comes from the message's JetStream metadata, so backoff and the delivery
//! limit survive consumer restarts.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use async_nats::{HeaderMap, HeaderValue};
use bytes::Bytes;
use idempotency_consumer::IDEMPOTENCY_KEY_HEADER;
pub use idempotency_consumer::adapter::{AdapterError, AdapterErrorKind};
use idempotency_consumer::adapter::{Broker, Pipeline};
use idempotency_consumer::{
    DEAD_LETTER_REASON_HEADER, Delivery, Disposition, Processor, dead_letter_headers,
};
use idempotency_core::Key;

mod dead_letters;
mod source;
mod worker;
pub use source::{NatsSource, NatsTls, SOURCE, connect_url};
pub use worker::Worker;

/// The header a dead-lettered message carries its reason in.
pub const DEAD_REASON_HEADER: &str = DEAD_LETTER_REASON_HEADER;

/// A JetStream message as a [`Delivery`]: headers, `Nats-Msg-Id` as the message id, the payload,
/// and the delivery count from the JetStream metadata.
#[derive(Debug)]
pub struct NatsMessage {
    message: jetstream::Message,
    delivered: u32,
}

impl NatsMessage {
    /// Wraps a JetStream message.
    #[must_use]
    pub fn new(message: jetstream::Message) -> Self {
        let delivered = message
            .info()
            .ok()
            .and_then(|info| u32::try_from(info.delivered).ok())
            .unwrap_or(1)
            .max(1);
        Self { message, delivered }
    }

    /// The JetStream message.
    #[must_use]
    pub fn message(&self) -> &jetstream::Message {
        &self.message
    }
}

impl Delivery for NatsMessage {
    fn header(&self, name: &str) -> Option<&[u8]> {
        self.message
            .headers
            .as_ref()
            .and_then(|headers| headers.get(name))
            .map(|value| value.as_str().as_bytes())
    }

    fn message_id(&self) -> Option<&str> {
        self.message
            .headers
            .as_ref()
            .and_then(|headers| headers.get("Nats-Msg-Id"))
            .map(HeaderValue::as_str)
    }

    fn payload(&self) -> &[u8] {
        &self.message.payload
    }

    fn delivery_count(&self) -> u32 {
        self.delivered
    }

    /// Every header value, one entry per value of a repeated header.
    fn headers(&self) -> Vec<(String, Vec<u8>)> {
        let Some(headers) = self.message.headers.as_ref() else {
            return Vec::new();
        };
        headers
            .iter()
            .flat_map(|(name, values)| {
                values
                    .iter()
                    .map(move |value| (name.to_string(), value.as_str().as_bytes().to_vec()))
            })
            .collect()
    }
}

/// The durable consumer could not be found or created: the adapter error every broker shares,
/// naming the stream and the consumer ([`AdapterErrorKind::Refused`] when JetStream refused,
/// [`AdapterErrorKind::Unreachable`] when it did not answer or is unavailable for now).
#[deprecated(note = "the adapter error every broker shares is `AdapterError`: use that name")]
pub type WorkerError = AdapterError;

/// A JetStream operation that failed: the adapter error every broker shares, with
/// [`Broker::NAME`] `nats`. A settlement (an ack, a nak, a dead-letter copy) that was not
/// confirmed is [`Settle`](AdapterErrorKind::Settle): the message was not acknowledged, the
/// server redelivers it after its ack wait, and the record makes that redelivery a duplicate.
#[deprecated(note = "the adapter error every broker shares is `AdapterError`: use that name")]
pub type SettleError = AdapterError;

/// The broker's name in metrics and errors.
pub const BROKER: &str = "nats";

/// A client or server error while doing `what`, as an error of `kind`.
pub(crate) fn nats<E>(kind: AdapterErrorKind, what: &str) -> impl FnOnce(E) -> AdapterError
where
    E: std::error::Error + Send + Sync + 'static,
{
    move |error| AdapterError::new(kind, BROKER, format!("{what}: {error}")).with_source(error)
}

/// JetStream as the per-message pipeline sees it: where dead letters go, and how often a
/// message being processed gets a progress ack (`+WPI`), which restarts its ack wait.
#[derive(Debug, Clone)]
pub struct JetStream {
    jetstream: jetstream::Context,
    dead_letter_subject: String,
    progress_every: Duration,
}

impl JetStream {
    /// Dead-letters to `dead_letter_subject` through `jetstream`, and sends progress acks every
    /// `progress_every` (below the consumer's ack wait: a third of it is a good choice).
    #[must_use]
    pub fn new(
        jetstream: jetstream::Context,
        dead_letter_subject: impl Into<String>,
        progress_every: Duration,
    ) -> Self {
        Self {
            jetstream,
            dead_letter_subject: dead_letter_subject.into(),
            progress_every,
        }
    }
}

impl Broker for JetStream {
    type Message = NatsMessage;
    const NAME: &'static str = BROKER;

    fn keep_alive_every(&self) -> Option<Duration> {
        Some(self.progress_every)
    }

    async fn keep_alive(&self, message: &NatsMessage) -> Result<(), AdapterError> {
        message
            .message
            .ack_with(AckKind::Progress)
            .await
            .map_err(|e| AdapterError::new(AdapterErrorKind::Lost, BROKER, format!("a progress ack: {e}")))
    }

    async fn settle(&self, message: &NatsMessage, disposition: &Disposition) -> Result<(), AdapterError> {
        settle(&self.jetstream, &self.dead_letter_subject, message, disposition).await
    }
}

/// Processes one message with `consumer` and settles it, through the shared per-message
/// [`Pipeline`] (named after the message's subject); returns what was done.
///
/// `progress_every` should be below the consumer's ack wait (a third of it is a good choice).
///
/// # Errors
///
/// [`AdapterErrorKind::Settle`] when the ack, nak, or dead-letter publish could not be
/// confirmed, or took longer than the settle timeout.
pub async fn process<P>(
    consumer: &P,
    jetstream: &jetstream::Context,
    dead_letter_subject: &str,
    message: jetstream::Message,
    progress_every: Duration,
) -> Result<Disposition, AdapterError>
where
    P: Processor<NatsMessage>,
{
    let message = NatsMessage::new(message);
    let broker = JetStream::new(jetstream.clone(), dead_letter_subject, progress_every);
    let pipeline = Pipeline::new(broker, message.message.subject.to_string());
    pipeline.process(consumer, &message).await
}

/// Processes messages pulled together with `consumer` as one batch
/// ([`Pipeline::process_batch`]: their keys claimed in one store round trip, their outcomes
/// recorded in one more), then settles each as soon as its own outcome is recorded. Answers,
/// in order, what [`process`] answers for each.
pub async fn process_batch<P>(
    consumer: &P,
    jetstream: &jetstream::Context,
    dead_letter_subject: &str,
    messages: Vec<jetstream::Message>,
    progress_every: Duration,
) -> Vec<Result<Disposition, AdapterError>>
where
    P: Processor<NatsMessage>,
{
    let Some(first) = messages.first() else {
        return Vec::new();
    };
    let name = first.subject.to_string();
    let broker = JetStream::new(jetstream.clone(), dead_letter_subject, progress_every);
    let pipeline = Pipeline::new(broker, name);
    let messages: Vec<NatsMessage> = messages.into_iter().map(NatsMessage::new).collect();
    let batch: Vec<&NatsMessage> = messages.iter().collect();
    pipeline.process_batch(consumer, &batch).await
}

/// Carries out `disposition` on `message`.
///
/// # Errors
///
/// [`AdapterErrorKind::Settle`] when the server did not confirm it.
pub async fn settle(
    jetstream: &jetstream::Context,
    dead_letter_subject: &str,
    message: &NatsMessage,
    disposition: &Disposition,
) -> Result<(), AdapterError> {
    match disposition {
        Disposition::Ack => message
            .message
            .double_ack()
            .await
            .map_err(|e| settle_failed("the ack", &*e)),
        Disposition::Nack { after } => message
            .message
            .ack_with(AckKind::Nak(Some(*after)))
            .await
            .map_err(|e| settle_failed("the nak", &*e)),
        Disposition::DeadLetter { reason } => {
            let mut headers = message.message.headers.clone().unwrap_or_default();
            // The copy must not carry the original's Nats-Msg-Id: in a stream that holds both
            // subjects, the server's duplicate window would drop it as the original's duplicate.
            // A derived id still makes a repeated dead-lettering of this message a duplicate.
            if let Some(id) = headers.get("Nats-Msg-Id").map(|v| format!("dead:{}", v.as_str())) {
                headers.insert("Nats-Msg-Id", id.as_str());
            }
            let source = message.message.subject.as_str();
            for (name, value) in dead_letter_headers(source, message.delivery_count(), reason) {
                headers.insert(name, value.as_str());
            }
            jetstream
                .publish_with_headers(
                    dead_letter_subject.to_owned(),
                    headers,
                    message.message.payload.clone(),
                )
                .await
                .map_err(nats(AdapterErrorKind::Settle, "publishing a dead letter"))?
                .await
                .map_err(nats(AdapterErrorKind::Settle, "a dead letter's publish ack"))?;
            message
                .message
                .ack_with(AckKind::Term)
                .await
                .map_err(|e| settle_failed("terminating a dead-lettered message", &*e))
        }
    }
}

/// A settlement the client reported failed (its error type is boxed, not `'static` + `Sized`
/// everywhere): the text is kept.
fn settle_failed(what: &str, error: &(dyn std::error::Error + Send + Sync)) -> AdapterError {
    AdapterError::new(AdapterErrorKind::Settle, BROKER, format!("{what}: {error}"))
}

/// Moves up to `limit` dead letters of `stream` on `dead_letter_subject` back to the subject
/// each was consumed from (its `Idempotency-Dead-Source` header), after the cause is fixed;
/// returns how many it moved. Each copy keeps its payload and `Idempotency-Key`, loses the
/// dead-letter headers, and gets a `Nats-Msg-Id` of its own (`replay:<stream sequence>`), so the
/// stream's duplicate window does not drop it as the original. The dead letter is deleted from
/// the stream only after the copy is acknowledged: a crash in between leaves a duplicate, which
/// the record answers without running it twice.
///
/// # Errors
///
/// [`AdapterErrorKind::Refused`] when the stream cannot be read, [`AdapterErrorKind::Publish`]
/// when a copy was not acknowledged, [`AdapterErrorKind::Config`] when a dead letter has no
/// source; what was moved before stays moved.
pub async fn replay_dead_letters(
    jetstream: &jetstream::Context,
    stream: &str,
    dead_letter_subject: &str,
    limit: usize,
) -> Result<usize, AdapterError> {
    let stream = jetstream
        .get_stream(stream)
        .await
        .map_err(nats(AdapterErrorKind::Refused, &format!("stream {stream}")))?;
    dead_letters::NatsDeadLetters::new(jetstream.clone(), stream, dead_letter_subject.to_owned())
        .replay(limit)
        .await
}

/// Publishes `payload` with `key` as both `Idempotency-Key` and `Nats-Msg-Id`, and waits for
/// the stream's acknowledgement.
///
/// # Errors
///
/// [`AdapterErrorKind::Publish`]: the publish or its acknowledgement failed; publishing again
/// with the same key is safe.
pub async fn publish(
    jetstream: &jetstream::Context,
    subject: impl Into<String>,
    key: &Key,
    payload: Bytes,
) -> Result<jetstream::publish::PublishAck, AdapterError> {
    let mut headers = HeaderMap::new();
    headers.insert(IDEMPOTENCY_KEY_HEADER, key.as_str());
    headers.insert("Nats-Msg-Id", key.as_str());
    jetstream
        .publish_with_headers(subject.into(), headers, payload)
        .await
        .map_err(nats(AdapterErrorKind::Publish, "publishing"))?
        .await
        .map_err(nats(AdapterErrorKind::Publish, "a publish ack"))
}
