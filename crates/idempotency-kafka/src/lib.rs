//! Idempotent Kafka consumption on the broker-neutral consumer core: a message's offset is
//! committed only after its outcome is recorded, and what would be a nack elsewhere keeps the
//! partition on the same message.
//!
//! - [`Worker`]: a member of a consumer group. Partitions are processed concurrently, each in
//!   order; offsets are committed in batches and only up to settled messages; revoked
//!   partitions settle and commit before they are released. This is what a service runs.
//! - [`process`]: one message through a [`Processor`], then a synchronous commit past it, for
//!   callers that drive their own consumer loop (call it for one partition's messages one
//!   after another).
//! - [`publish`] and [`idempotent_producer`]: events with their `Idempotency-Key`, from a
//!   producer whose own retries never duplicate a write.
//!
//! A same-transaction consumer ([`idempotency_consumer::TxConsumer`] on PostgreSQL) works with
//! both: the handler's rows, the record and its completion commit together, and the offset is
//! committed to Kafka after that commit. `docs/CONSUMERS.md` (the consumer guide) has the
//! whole contract.
//!
//! # What each disposition becomes
//!
//! Kafka has no per-message nack. [`process`] maps the core's dispositions so that no message is
//! ever skipped before its outcome is durable:
//!
//! | disposition | Kafka |
//! |---|---|
//! | `Ack` (executed and recorded, or a duplicate) | commit the offset after it (the [`Worker`]: in the next batch) |
//! | `Nack { after }` (in flight elsewhere, the store down, a handler's `Retry` below the limit, a panic below the limit) | wait `after`, then process **the same message** again: its partition waits, in order |
//! | `DeadLetter { reason }` (a reused key, no key, `Fatal`, the delivery limit) | produce a copy to the dead-letter topic with the reason, source topic, partition and offset headers, wait for the broker's acknowledgement, then commit past it |
//!
//! A consumer that dies after a handler ran and before its commit leaves the offset behind: the
//! next owner of the partition reads the message again, and the record answers it as a
//! duplicate without running the handler.
//!
//! # Keys
//!
//! By default the `Idempotency-Key` header (which the HTTP edge propagates with
//! `IdempotencyKey::message_key()` and [`publish`] sets). Kafka messages have no message id:
//! [`KafkaMessage`] offers the record key in its place, so `KeySource::MessageId` keys by the
//! record key. Never key by topic, partition and offset: a replay after a rebalance has the same
//! offset, but a producer's retry writes the same event at a new one.
//!
//! # Delivery counts
//!
//! Kafka does not count deliveries. [`process`] counts the attempts it makes at one message, so
//! the delivery limit applies within one consumer's run; after a restart or a rebalance, the
//! count starts again at 1 (the record still makes completed messages duplicates).

use std::time::Duration;

mod dead_letters;
mod source;
mod worker;
pub use source::{KafkaSource, SOURCE, producer_from_url, producer_from_url_with_defaults};
pub use worker::{DEFAULT_BATCH, DEFAULT_LINGER, DEFAULT_PREFETCH, DEFAULT_PREFETCH_BYTES, Worker};

/// The Kafka client this crate is built on, for its settings ([`rdkafka::ClientConfig`]) and
/// messages, at the version this crate uses.
pub use rdkafka;

pub use idempotency_consumer::adapter::{AdapterError, AdapterErrorKind};
use idempotency_consumer::adapter::{Broker, Pipeline};
use idempotency_consumer::{Delivery, Disposition, Processor, dead_letter_headers};
use idempotency_core::{IDEMPOTENCY_KEY_HEADER, Key};
use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

/// The header a dead letter carries its source partition in.
pub const DEAD_PARTITION_HEADER: &str = "Idempotency-Dead-Partition";

/// The header a dead letter carries its source offset in.
pub const DEAD_OFFSET_HEADER: &str = "Idempotency-Dead-Offset";

/// How long [`publish`] and a dead-letter produce wait for the broker's acknowledgement.
pub const PRODUCE_TIMEOUT: Duration = Duration::from_secs(30);

/// A Kafka message as a [`Delivery`].
#[derive(Debug)]
pub struct KafkaMessage {
    message: OwnedMessage,
    deliveries: u32,
    /// Where a worker's partition learns that the message is settled.
    progress: Option<std::sync::Arc<worker::Progress>>,
}

impl KafkaMessage {
    /// Wraps a message, on its first delivery.
    #[must_use]
    pub fn new(message: OwnedMessage) -> Self {
        Self {
            message,
            deliveries: 1,
            progress: None,
        }
    }

    /// A message of a worker's partition, whose settlement moves the partition's commit.
    pub(crate) fn tracked(message: OwnedMessage, progress: std::sync::Arc<worker::Progress>) -> Self {
        Self {
            progress: Some(progress),
            ..Self::new(message)
        }
    }

    /// Marks the message settled for its partition's next commit.
    fn settled(&self) {
        if let Some(progress) = &self.progress {
            progress.settled(self.message.offset());
        }
    }

    /// The rdkafka message.
    #[must_use]
    pub fn message(&self) -> &OwnedMessage {
        &self.message
    }
}

impl Delivery for KafkaMessage {
    fn header(&self, name: &str) -> Option<&[u8]> {
        let headers = self.message.headers()?;
        headers
            .iter()
            .find(|header| header.key.eq_ignore_ascii_case(name))
            .and_then(|header| header.value)
    }

    /// The record key, as text: Kafka has no message id.
    fn message_id(&self) -> Option<&str> {
        self.message.key().and_then(|key| std::str::from_utf8(key).ok())
    }

    fn record_key(&self) -> Option<&[u8]> {
        self.message.key()
    }

    fn payload(&self) -> &[u8] {
        self.message.payload().unwrap_or_default()
    }

    fn delivery_count(&self) -> u32 {
        self.deliveries
    }

    /// Every header with a value (Kafka allows a header without one, which is left out).
    fn headers(&self) -> Vec<(String, Vec<u8>)> {
        let Some(headers) = self.message.headers() else {
            return Vec::new();
        };
        headers
            .iter()
            .filter_map(|header| Some((header.key.to_owned(), header.value?.to_vec())))
            .collect()
    }
}

/// Why [`process`], [`publish`] or a [`Worker`] failed: the adapter error every broker shares,
/// with [`Broker::NAME`] `kafka`. Settings the client refuses are
/// [`Config`](AdapterErrorKind::Config), no broker answering at start
/// [`Unreachable`](AdapterErrorKind::Unreachable), a topic that does not exist
/// [`Refused`](AdapterErrorKind::Refused), an unacknowledged produce
/// [`Publish`](AdapterErrorKind::Publish) (an event) or [`Settle`](AdapterErrorKind::Settle) (a
/// dead letter), a failed offset commit [`Settle`](AdapterErrorKind::Settle). No offset was
/// committed past an unsettled message, so it is read again; the record makes that a duplicate.
#[deprecated(note = "the adapter error every broker shares is `AdapterError`: use that name")]
pub type KafkaAdapterError = AdapterError;

/// The broker's name in metrics and errors.
pub const BROKER: &str = "kafka";

/// A client error while doing `what`, as an error of `kind`.
pub(crate) fn kafka(
    kind: AdapterErrorKind,
    what: impl Into<String>,
) -> impl FnOnce(KafkaError) -> AdapterError {
    let what = what.into();
    move |error| AdapterError::new(kind, BROKER, format!("{what}: {error}")).with_source(error)
}

/// Kafka as the per-message pipeline sees it: only dead letters need the broker (a copy
/// produced to the dead-letter topic and acknowledged). An ack is the offset, committed by the
/// caller past settled messages; a nack holds the partition on the message, which the caller
/// processes again after the delay. A live member's partitions are never taken from it, so
/// there is no hold to keep alive.
#[derive(Clone, derive_more::Debug)]
pub struct KafkaBroker {
    #[debug(skip)]
    producer: FutureProducer,
    dead_letter_topic: String,
}

impl KafkaBroker {
    /// Dead-letters to `dead_letter_topic` with `producer`.
    #[must_use]
    pub fn new(producer: FutureProducer, dead_letter_topic: impl Into<String>) -> Self {
        Self {
            producer,
            dead_letter_topic: dead_letter_topic.into(),
        }
    }
}

impl Broker for KafkaBroker {
    type Message = KafkaMessage;
    const NAME: &'static str = BROKER;

    /// `Ack`: the message's offset becomes committable (the worker commits in batches).
    /// `Nack`: nothing; the caller processes the same message again after the delay.
    /// `DeadLetter`: an acknowledged copy to the dead-letter topic, then the offset becomes
    /// committable.
    async fn settle(&self, message: &KafkaMessage, disposition: &Disposition) -> Result<(), AdapterError> {
        match disposition {
            Disposition::Ack => message.settled(),
            Disposition::Nack { .. } => {}
            Disposition::DeadLetter { reason } => {
                dead_letter(&self.producer, &self.dead_letter_topic, message, reason).await?;
                message.settled();
            }
        }
        Ok(())
    }
}

/// Processes one message with `processor` until it is settled, then commits past it; returns
/// the final disposition (`Ack` or `DeadLetter`). See the [crate docs](crate) for what each
/// disposition becomes. Runs through the shared per-message [`Pipeline`] (named after the
/// topic).
///
/// # Errors
///
/// [`AdapterErrorKind::Settle`] when the dead-letter copy or the commit was not acknowledged:
/// nothing was committed past the message.
pub async fn process<P, C>(
    processor: &P,
    consumer: &C,
    producer: &FutureProducer,
    dead_letter_topic: &str,
    message: OwnedMessage,
) -> Result<Disposition, AdapterError>
where
    P: Processor<KafkaMessage>,
    C: Consumer,
{
    let pipeline = Pipeline::new(
        KafkaBroker::new(producer.clone(), dead_letter_topic),
        message.topic().to_owned(),
    );
    let mut message = KafkaMessage::new(message);
    loop {
        let disposition = pipeline.decide(processor, &message).await;
        pipeline.settle(&message, &disposition).await?;
        match disposition {
            Disposition::Nack { after } => {
                // No nack in Kafka: the partition waits on this message, in order.
                tokio::time::sleep(after).await;
                message.deliveries = message.deliveries.saturating_add(1);
            }
            settled => {
                commit_past(consumer, &message.message)?;
                return Ok(settled);
            }
        }
    }
}

/// Produces the dead-letter copy of `message` and waits for the acknowledgement.
async fn dead_letter(
    producer: &FutureProducer,
    topic: &str,
    message: &KafkaMessage,
    reason: &str,
) -> Result<(), AdapterError> {
    let original = &message.message;
    let mut headers = OwnedHeaders::new();
    if let Some(kept) = original.headers() {
        for header in kept.iter() {
            headers = headers.insert(Header {
                key: header.key,
                value: header.value,
            });
        }
    }
    let dead = dead_letter_headers(original.topic(), message.deliveries, reason);
    let partition = original.partition().to_string();
    let offset = original.offset().to_string();
    for (name, value) in dead.iter().map(|(name, value)| (*name, value.as_str())).chain([
        (DEAD_PARTITION_HEADER, partition.as_str()),
        (DEAD_OFFSET_HEADER, offset.as_str()),
    ]) {
        headers = headers.insert(Header {
            key: name,
            value: Some(value),
        });
    }
    let mut record = FutureRecord::to(topic)
        .payload(original.payload().unwrap_or_default())
        .headers(headers);
    if let Some(key) = original.key() {
        record = record.key(key);
    }
    producer
        .send(record, PRODUCE_TIMEOUT)
        .await
        .map(drop)
        .map_err(|(source, _)| {
            kafka(
                AdapterErrorKind::Settle,
                format!("a dead letter to {topic} was not acknowledged"),
            )(source)
        })
}

/// Commits the offset after `message` (Kafka commits the next position to read).
fn commit_past<C: Consumer>(consumer: &C, message: &OwnedMessage) -> Result<(), AdapterError> {
    let next = message.offset() + 1;
    let mut list = TopicPartitionList::new();
    let what = format!(
        "committing offset {next} of {}/{}",
        message.topic(),
        message.partition()
    );
    list.add_partition_offset(message.topic(), message.partition(), Offset::Offset(next))
        .map_err(kafka(AdapterErrorKind::Settle, what.clone()))?;
    consumer
        .commit(&list, CommitMode::Sync)
        .map_err(kafka(AdapterErrorKind::Settle, what))
}

/// Produces `payload` to `topic` with `key` as the `Idempotency-Key` header and `record_key` as
/// the message key (the aggregate id, for per-entity ordering), and waits for the broker's
/// acknowledgement; returns the partition and offset it was written at. Use a producer with
/// `enable.idempotence=true` ([`idempotent_producer`]): its own retries then never write an
/// event twice, and a retry of `publish` itself writes a copy the consumer's record answers.
///
/// # Errors
///
/// [`AdapterErrorKind::Publish`]: publishing again with the same key is safe.
pub async fn publish(
    producer: &FutureProducer,
    topic: &str,
    key: &Key,
    record_key: Option<&[u8]>,
    payload: &[u8],
) -> Result<(i32, i64), AdapterError> {
    let headers = OwnedHeaders::new().insert(Header {
        key: IDEMPOTENCY_KEY_HEADER,
        value: Some(key.as_str()),
    });
    let mut record = FutureRecord::to(topic).payload(payload).headers(headers);
    if let Some(record_key) = record_key {
        record = record.key(record_key);
    }
    producer
        .send(record, PRODUCE_TIMEOUT)
        .await
        .map(|delivery| (delivery.partition, delivery.offset))
        .map_err(|(source, _)| {
            kafka(
                AdapterErrorKind::Publish,
                format!("a produce to {topic} was not acknowledged"),
            )(source)
        })
}

/// An idempotent producer for `bootstrap_servers`: `enable.idempotence=true` (so the client's
/// own retries never duplicate a write), `acks=all`.
///
/// # Errors
///
/// The client's error for an invalid configuration.
pub fn idempotent_producer(bootstrap_servers: &str) -> Result<FutureProducer, KafkaError> {
    rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap_servers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()
}
