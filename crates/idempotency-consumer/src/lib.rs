//! Broker-neutral idempotent message consumption ([`guide`]): what to do with one delivered
//! message, decided by the idempotency record, so that a broker adapter only has to carry the
//! decision out (ack, nack with a delay, dead-letter).
//!
//! Brokers deliver at least once: a consumer that crashes after its side effect and before its
//! ack gets the message again, a rebalance replays, a dead-letter queue is replayed days later.
//! [`Consumer::process`] runs the handler at most once per key and answers with a
//! [`Disposition`] that follows these rules:
//!
//! | the record says | the handler | disposition |
//! |---|---|---|
//! | no key on the message | — | `DeadLetter` (or, if configured, keyed by content hash) |
//! | first delivery of the key | runs; `Ok` | `complete`, **then** `Ack`: never ack before the record is durable |
//! | | `Err(Retry)` | `release`, then `Nack` with exponential backoff; `DeadLetter` after the delivery limit |
//! | | `Err(Fatal)` | `release`, then `DeadLetter` with the reason |
//! | completed (a duplicate) | — | `Ack`, no side effect |
//! | in flight (another copy runs) | — | waits up to [`Consumer::in_flight_wait`] for that copy's outcome (woken at once when it runs in this consumer), then `Ack` as a duplicate; still in flight: `Nack` with a delay, never ack (if the holder dies, the message must still be processed) |
//! | key reused with another payload | — | `DeadLetter` with the reason |
//! | store unreachable | — | `Nack` with a delay (fail closed) |
//!
//! Keys come from the `Idempotency-Key` header by default (the HTTP edge propagates its key into
//! the messages it publishes), or from the message id, a function of the message, or the content
//! hash. Never from a delivery tag or a redelivery-specific id: a redelivery gets a new one.
//!
//! Broker adapters implement [`Delivery`] for their message type and map the [`Disposition`] to
//! their acknowledgements.
//!
//! ```
//! use idempotency_consumer::{Consumer, Delivery, Disposition, Handler, HandlerError, Processor};
//! use idempotency_core::{Attempt, MemoryStore, Outcome};
//!
//! struct Message { key: Vec<u8>, payload: Vec<u8>, deliveries: u32 }
//!
//! impl Delivery for Message {
//!     fn header(&self, name: &str) -> Option<&[u8]> {
//!         (name == "Idempotency-Key").then_some(self.key.as_slice())
//!     }
//!     fn message_id(&self) -> Option<&str> { None }
//!     fn payload(&self) -> &[u8] { &self.payload }
//!     fn delivery_count(&self) -> u32 { self.deliveries }
//! }
//!
//! struct SendInvoice;
//!
//! impl Handler<Message> for SendInvoice {
//!     async fn handle(&self, message: &Message, _attempt: &Attempt) -> Result<Outcome, HandlerError> {
//!         // Send the e-mail here; a transient failure would be `Err(HandlerError::retry(..))`.
//!         Ok(Outcome::new(format!("sent {} bytes", message.payload.len())))
//!     }
//! }
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! let consumer = Consumer::new("invoices", MemoryStore::new(), SendInvoice);
//! let message = Message { key: b"invoice-42".to_vec(), payload: b"...".to_vec(), deliveries: 1 };
//! assert_eq!(consumer.process(&message).await, Disposition::Ack); // sent, then acked
//! let redelivered = Message { deliveries: 2, ..message };
//! assert_eq!(consumer.process(&redelivered).await, Disposition::Ack); // acked, not sent again
//! # });
//! ```
//!
//! # Metrics
//!
//! `idempotency_consumer_messages_total{consumer, result}` with `result` one of `executed`,
//! `duplicate`, `in_flight`, `retried`, `dead_lettered`, `store_unavailable`;
//! `idempotency_consumer_panics_total{consumer}` counts handler panics (each also counted as
//! `retried` or `dead_lettered`); the guard's own metrics are labelled with the consumer's name
//! as well.

use std::fmt;
use std::future::Future;

use metrics::SharedString;

use futures_util::FutureExt;
use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    Attempt, DEFAULT_CONSUMER_RETENTION, Decision, Execution, Fingerprint, Guard, JsonKeyError, JsonPointer,
    Key, Outcome, Recorded, Scope, Store, StoreError,
};

/// The consumer guide (`docs/CONSUMERS.md`): the ack rules, keys, same-transaction consumers,
/// the adapters and the metrics.
#[doc = include_str!("../../../docs/CONSUMERS.md")]
pub mod guide {}

/// The adapter guide (`docs/WRITING-AN-ADAPTER.md`): how a broker's adapter is written on the
/// kit, and the broker suite it must pass.
#[doc = include_str!("../../../docs/WRITING-AN-ADAPTER.md")]
pub mod writing_an_adapter {}

pub mod adapter;
mod batch;
pub mod dead_letters;
pub mod source;
pub mod transactional;
pub mod transactional_batch;
pub use transactional::{TxConsumer, TxHandler};
pub use transactional_batch::MOST_PER_TRANSACTION;

/// The header that carries the key by default.
pub use idempotency_core::IDEMPOTENCY_KEY_HEADER;

/// The header a dead-lettered message carries its reason in, on every broker.
pub const DEAD_LETTER_REASON_HEADER: &str = "Idempotency-Dead-Reason";

/// Where a dead-lettered message was consumed from (the queue, or the subject).
pub const DEAD_LETTER_SOURCE_HEADER: &str = "Idempotency-Dead-Source";

/// How many times a dead-lettered message had been delivered.
pub const DEAD_LETTER_DELIVERIES_HEADER: &str = "Idempotency-Dead-Deliveries";

/// When a message was dead-lettered, as an HTTP-date (`Sun, 22 Nov 2026 19:29:42 GMT`).
pub const DEAD_LETTER_AT_HEADER: &str = "Idempotency-Dead-At";

/// The headers every adapter adds to a dead-lettered copy, so that an operator looking at a
/// dead-letter queue sees why, from where, after how many deliveries and when, and can replay
/// the message to its source after a fix: [`DEAD_LETTER_REASON_HEADER`],
/// [`DEAD_LETTER_SOURCE_HEADER`], [`DEAD_LETTER_DELIVERIES_HEADER`], [`DEAD_LETTER_AT_HEADER`].
///
/// ```
/// use idempotency_consumer::dead_letter_headers;
///
/// let headers = dead_letter_headers("payments", 5, "failed 5 deliveries, the last with: timeout");
/// assert_eq!(headers[0], ("Idempotency-Dead-Reason", "failed 5 deliveries, the last with: timeout".to_owned()));
/// assert_eq!(headers[1], ("Idempotency-Dead-Source", "payments".to_owned()));
/// assert_eq!(headers[2], ("Idempotency-Dead-Deliveries", "5".to_owned()));
/// assert!(headers[3].1.ends_with(" GMT"));
/// ```
#[must_use]
pub fn dead_letter_headers(source: &str, deliveries: u32, reason: &str) -> [(&'static str, String); 4] {
    // Header values are one line: a multi-line reason (a panic message, say) is folded.
    let reason = reason.replace(['\r', '\n'], " ");
    [
        (DEAD_LETTER_REASON_HEADER, reason),
        (DEAD_LETTER_SOURCE_HEADER, source.to_owned()),
        (DEAD_LETTER_DELIVERIES_HEADER, deliveries.to_string()),
        (
            DEAD_LETTER_AT_HEADER,
            httpdate::fmt_http_date(std::time::SystemTime::now()),
        ),
    ]
}

/// A delivered message, as a broker adapter presents it.
pub trait Delivery {
    /// A header's value (case-sensitive name, as the broker stores it).
    fn header(&self, name: &str) -> Option<&[u8]>;
    /// The producer-assigned message id, if any.
    fn message_id(&self) -> Option<&str>;
    /// The record key, on brokers whose records have one (Kafka's): `None` by default.
    fn record_key(&self) -> Option<&[u8]> {
        None
    }
    /// The payload.
    fn payload(&self) -> &[u8];
    /// How many times this message has been delivered, this delivery included (1 the first time).
    fn delivery_count(&self) -> u32;
    /// The payload's media type: by default a `content-type` (or `Content-Type`) header in
    /// UTF-8; brokers with a property of their own for it (AMQP's `content_type`) answer from
    /// that.
    fn content_type(&self) -> Option<&str> {
        self.header("content-type")
            .or_else(|| self.header("Content-Type"))
            .and_then(|value| std::str::from_utf8(value).ok())
    }
    /// Every header, as name and raw value, for adapters that keep a message whole (the inbox
    /// stores them with the payload). None by default.
    fn headers(&self) -> Vec<(String, Vec<u8>)> {
        Vec::new()
    }
}

/// A function that finds a message's key (`None`: the message has none).
pub type KeyFn = Arc<dyn Fn(&dyn Delivery) -> Option<Key> + Send + Sync>;

/// Where the key of a message comes from.
#[derive(Clone)]
#[non_exhaustive]
pub enum KeySource {
    /// A header (default: `Idempotency-Key`).
    Header(String),
    /// The producer-assigned message id.
    MessageId,
    /// The record key (Kafka's): for producers that key their records by the operation.
    RecordKey,
    /// A member of the JSON payload ([`Key::from_json`]: a string, or a number's text), as the
    /// HTTP layer's `key_from`: for producers that carry their key in the body.
    JsonPointer(JsonPointer),
    /// `sha256:` of the payload: for producers that cannot set a key, when the payload alone
    /// identifies the operation. Two different operations with identical payloads become one.
    ContentHash,
    /// A function of the message.
    Custom(KeyFn),
}

impl fmt::Debug for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Header(name) => write!(f, "Header({name:?})"),
            Self::MessageId => f.write_str("MessageId"),
            Self::RecordKey => f.write_str("RecordKey"),
            Self::JsonPointer(pointer) => write!(f, "JsonPointer({:?})", pointer.as_str()),
            Self::ContentHash => f.write_str("ContentHash"),
            Self::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

/// Why a message has no usable key.
#[derive(Debug, Clone, PartialEq, Eq)]
enum KeyProblem {
    Missing,
    Invalid(String),
}

impl KeySource {
    /// The key of `message`, or why it has none usable: the reason a dead letter carries.
    ///
    /// ```
    /// use idempotency_consumer::{Delivery, KeySource};
    ///
    /// struct Bare;
    /// impl Delivery for Bare {
    ///     fn header(&self, _: &str) -> Option<&[u8]> { None }
    ///     fn message_id(&self) -> Option<&str> { Some("order 7") }
    ///     fn payload(&self) -> &[u8] { b"" }
    ///     fn delivery_count(&self) -> u32 { 1 }
    /// }
    ///
    /// let missing = KeySource::Header("Idempotency-Key".into()).find(&Bare).unwrap_err();
    /// assert_eq!(missing, "no Idempotency-Key header");
    /// let invalid = KeySource::MessageId.find(&Bare).unwrap_err();
    /// assert!(invalid.to_string().starts_with("invalid key in the message id: "), "{invalid}");
    /// ```
    ///
    /// # Errors
    ///
    /// A [`NoKey`] whose text is the reason, when the key is missing or invalid.
    pub fn find(&self, message: &dyn Delivery) -> Result<Key, NoKey> {
        self.key_of(message).map_err(|problem| {
            NoKey(match problem {
                KeyProblem::Missing => self.missing(),
                KeyProblem::Invalid(why) => format!("invalid key in {}: {why}", self.place()),
            })
        })
    }

    /// What a dead letter says of a message without a key: where the key was looked for, in
    /// words (never a Rust value).
    fn missing(&self) -> String {
        match self {
            Self::Header(name) => format!("no {name} header"),
            Self::MessageId => "no message id (the consumer keys messages by it)".to_owned(),
            Self::RecordKey => "no record key (the consumer keys messages by it)".to_owned(),
            Self::JsonPointer(pointer) => format!(
                "no key at {} in the JSON payload (the consumer keys messages by it)",
                pointer.as_str()
            ),
            // Not reached: every payload has a hash.
            Self::ContentHash => "no key could be made from the payload".to_owned(),
            Self::Custom(_) => "no key: the consumer's key function found none".to_owned(),
        }
    }

    /// Where the key comes from, for a reason's text.
    fn place(&self) -> String {
        match self {
            Self::Header(name) => format!("the {name} header"),
            Self::MessageId => "the message id".to_owned(),
            Self::RecordKey => "the record key".to_owned(),
            Self::JsonPointer(pointer) => format!("the JSON payload's member {}", pointer.as_str()),
            Self::ContentHash => "the payload's hash".to_owned(),
            Self::Custom(_) => "the key function's answer".to_owned(),
        }
    }

    fn key_of(&self, message: &dyn Delivery) -> Result<Key, KeyProblem> {
        match self {
            Self::Header(name) => {
                let raw = message.header(name).ok_or(KeyProblem::Missing)?;
                Key::from_bytes(raw).map_err(|e| KeyProblem::Invalid(e.to_string()))
            }
            Self::MessageId => {
                let id = message.message_id().ok_or(KeyProblem::Missing)?;
                Key::new(id).map_err(|e| KeyProblem::Invalid(e.to_string()))
            }
            Self::RecordKey => {
                let raw = message.record_key().ok_or(KeyProblem::Missing)?;
                Key::from_bytes(raw).map_err(|e| KeyProblem::Invalid(e.to_string()))
            }
            Self::JsonPointer(pointer) => match Key::from_json(message.payload(), pointer) {
                Ok(Some(key)) => Ok(key),
                Ok(None) => Err(KeyProblem::Missing),
                Err(JsonKeyError::NotJson(why)) => {
                    Err(KeyProblem::Invalid(format!("the payload is not JSON ({why})")))
                }
                Err(error) => Err(KeyProblem::Invalid(error.to_string())),
            },
            Self::ContentHash => Ok(
                Key::new(format!("sha256:{}", Fingerprint::of_bytes(message.payload())))
                    .map_err(|e| KeyProblem::Invalid(e.to_string()))?,
            ),
            Self::Custom(extract) => extract(message).ok_or(KeyProblem::Missing),
        }
    }
}

/// Why a message has no usable key: the reason its dead letter carries, written for people
/// (`no Idempotency-Key header`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NoKey(String);

impl NoKey {
    /// The reason, as a dead letter carries it.
    #[must_use]
    pub fn into_reason(self) -> String {
        self.0
    }
}

impl PartialEq<&str> for NoKey {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

/// The redelivery backoff: core's one backoff policy.
pub use idempotency_core::Backoff;

/// What the broker adapter must do with the message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Disposition {
    /// Acknowledge: the operation is recorded as done (now, or earlier by another delivery).
    Ack,
    /// Return the message to the broker, to be delivered again after `after`.
    Nack {
        /// How long to wait before the redelivery.
        after: Duration,
    },
    /// Move the message to the dead-letter destination, with the reason.
    DeadLetter {
        /// Why, for operators and for whoever replays the dead-letter queue.
        reason: String,
    },
}

/// Any error a handler fails with, kept as the source of a [`HandlerError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A handler's failure: what it means for the message, and the error that caused it.
///
/// ```
/// use idempotency_consumer::HandlerError;
///
/// let timeout = std::io::Error::new(std::io::ErrorKind::TimedOut, "gateway timed out");
/// let error = HandlerError::retry(timeout);
/// assert_eq!(error.to_string(), "gateway timed out");
/// assert!(HandlerError::fatal("card declined").is_fatal());
/// ```
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// A transient failure (a timeout, a 503 downstream): release the key and retry later.
    #[error(transparent)]
    Retry(BoxError),
    /// A permanent failure (invalid payload, a rejected charge): retrying cannot help;
    /// dead-letter the message.
    #[error(transparent)]
    Fatal(BoxError),
    /// The handler panicked (the consumer caught it; the key was released). Retried like
    /// [`HandlerError::Retry`], and dead-lettered with a reason starting `panic:` once the
    /// message reaches the delivery limit, so a poison message never takes a worker down.
    #[error("the handler panicked: {0}")]
    Panicked(String),
}

impl HandlerError {
    /// A transient failure caused by `error` (an error value or a message).
    pub fn retry(error: impl Into<BoxError>) -> Self {
        Self::Retry(error.into())
    }

    /// A permanent failure caused by `error` (an error value or a message).
    pub fn fatal(error: impl Into<BoxError>) -> Self {
        Self::Fatal(error.into())
    }

    /// Whether retrying cannot help.
    #[must_use]
    pub fn is_fatal(&self) -> bool {
        matches!(self, Self::Fatal(_))
    }
}

/// Handles messages of type `M`; runs at most once per key while its outcome is retained.
pub trait Handler<M: ?Sized>: Send + Sync {
    /// Performs the side effect of `message` and returns the outcome to keep for duplicates.
    fn handle(
        &self,
        message: &M,
        attempt: &Attempt,
    ) -> impl Future<Output = Result<Outcome, HandlerError>> + Send;
}

/// A shared handler handles as the handler it points to.
impl<M: ?Sized + Sync, H: Handler<M> + ?Sized> Handler<M> for Arc<H> {
    fn handle(
        &self,
        message: &M,
        attempt: &Attempt,
    ) -> impl Future<Output = Result<Outcome, HandlerError>> + Send {
        (**self).handle(message, attempt)
    }
}

/// Decides what to do with one delivered message: [`Consumer`] with a [`Handler`], and (with
/// the `postgres` feature) a consumer whose handler writes in the record's transaction. Broker
/// adapters take any processor.
pub trait Processor<M: ?Sized>: Send + Sync {
    /// Decides what to do with `message`, running the handler if this delivery acquires the key.
    fn process(&self, message: &M) -> impl Future<Output = Disposition> + Send;

    /// Decides `messages`, which arrived together, in their order, handing each disposition
    /// to `decided` as soon as it is final, in the batch's order: every message, or, for an
    /// [ordered](Decisions::is_ordered) batch, every message up to the first one answered with
    /// [`Disposition::Nack`], which ends the batch (the messages after it did not run and hold
    /// nothing; the caller offers them again); in both, up to the first one after the caller
    /// [closed](Decisions::close) `decided`. For a non-empty batch not closed
    /// before it started, at least one disposition is handed. A message's failure, panic or
    /// dead letter never changes the answers of its neighbours.
    ///
    /// The default decides them one by one with [`process`](Self::process); [`Consumer`]
    /// claims the batch's keys in one store round trip and records their outcomes together,
    /// before it hands their dispositions over (so before any ack).
    fn process_many(&self, messages: &[&M], decided: &Decisions) -> impl Future<Output = ()> + Send
    where
        M: Sync,
    {
        process_each(self, messages, decided)
    }
}

/// [`Processor::process_many`] as single calls: each message of `messages` decided with
/// [`Processor::process`], in order, until one ends an ordered batch (a nack) or `decided` is
/// closed. The default of
/// `process_many`, for a processor that overrides it for some messages only.
pub async fn process_each<P, M>(processor: &P, messages: &[&M], decided: &Decisions)
where
    P: Processor<M> + ?Sized,
    M: ?Sized + Sync,
{
    for message in messages {
        if decided.is_closed() {
            break;
        }
        let disposition = processor.process(message).await;
        let ends = decided.ends(&disposition);
        decided.send(disposition);
        if ends {
            break;
        }
    }
}

/// Where [`Processor::process_many`] hands the dispositions of a batch, in order, each as
/// soon as it is final: a broker's worker settles the first messages of a batch (and commits
/// their offsets) while later ones still run.
#[derive(Debug, Clone)]
pub struct Decisions {
    sender: tokio::sync::mpsc::UnboundedSender<Disposition>,
    sent: Arc<std::sync::atomic::AtomicUsize>,
    closed: Arc<std::sync::atomic::AtomicBool>,
    ordered: bool,
}

impl Decisions {
    /// A new sink for an ordered batch (a Kafka partition's messages), and the receiver that
    /// gets its dispositions in the order they were handed. A nack ends an ordered batch:
    /// nothing after it is decided, since the broker delivers it again before them.
    #[must_use]
    pub fn channel() -> (Self, tokio::sync::mpsc::UnboundedReceiver<Disposition>) {
        Self::new(true)
    }

    /// A new sink for a batch whose messages are independent (RabbitMQ, NATS JetStream, SQS:
    /// each is acknowledged on its own): a nack does not end it, every message is decided.
    #[must_use]
    pub fn unordered() -> (Self, tokio::sync::mpsc::UnboundedReceiver<Disposition>) {
        Self::new(false)
    }

    fn new(ordered: bool) -> (Self, tokio::sync::mpsc::UnboundedReceiver<Disposition>) {
        let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
        (
            Self {
                sender,
                sent: Arc::default(),
                closed: Arc::default(),
                ordered,
            },
            receiver,
        )
    }

    /// Whether a nack ends the batch ([`Decisions::channel`]) or not ([`Decisions::unordered`]).
    #[must_use]
    pub fn is_ordered(&self) -> bool {
        self.ordered
    }

    /// Whether `disposition` ends the batch: a nack of an ordered one.
    #[must_use]
    pub fn ends(&self, disposition: &Disposition) -> bool {
        self.ordered && matches!(disposition, Disposition::Nack { .. })
    }

    /// Hands the next message's disposition over (dropped if the receiver is gone).
    pub fn send(&self, disposition: Disposition) {
        self.sent.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let _ = self.sender.send(disposition);
    }

    /// Asks the processor to end the batch before its next handler (the worker is stopping:
    /// a revocation, a shutdown). What runs finishes and is handed over.
    pub fn close(&self) {
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether the batch is to end before its next handler.
    #[must_use]
    pub fn is_closed(&self) -> bool {
        self.closed.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// How many dispositions were handed so far.
    #[must_use]
    pub fn count(&self) -> usize {
        self.sent.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A shared processor processes as the processor it points to.
impl<M: ?Sized + Sync, P: Processor<M> + ?Sized> Processor<M> for Arc<P> {
    fn process(&self, message: &M) -> impl Future<Output = Disposition> + Send {
        (**self).process(message)
    }

    fn process_many(&self, messages: &[&M], decided: &Decisions) -> impl Future<Output = ()> + Send {
        (**self).process_many(messages, decided)
    }
}

/// Runs a handler's future, turning a panic into [`HandlerError::Panicked`] with the panic's
/// message: the guard then releases the key, and the delivery counts as a failed one. Other
/// runners of handlers (the inbox's workers) use it too, so that a panic reads the same
/// everywhere.
///
/// ```
/// use idempotency_consumer::{HandlerError, catching_panics};
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let failed = catching_panics(async {
///     if true {
///         panic!("the card service answered garbage");
///     }
///     Ok::<(), HandlerError>(())
/// })
/// .await;
/// assert_eq!(
///     failed.unwrap_err().to_string(),
///     "the handler panicked: the card service answered garbage"
/// );
/// # });
/// ```
///
/// # Errors
///
/// The handler's own error, or [`HandlerError::Panicked`].
pub async fn catching_panics<T>(
    handle: impl Future<Output = Result<T, HandlerError>>,
) -> Result<T, HandlerError> {
    match std::panic::AssertUnwindSafe(handle).catch_unwind().await {
        Ok(result) => result,
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_owned());
            Err(HandlerError::Panicked(message))
        }
    }
}

/// The handler's outcome is recorded when it succeeded; a failure releases the key (or, in a
/// transaction, rolls everything back).
fn complete_on_success(result: &Result<Outcome, HandlerError>) -> Decision {
    match result {
        Ok(outcome) => Decision::Complete(outcome.clone()),
        Err(_) => Decision::Release,
    }
}

/// The ack rules shared by every kind of consumer: key extraction, backoff, the delivery limit,
/// dead-letter reasons and metrics.
#[derive(Debug, Clone)]
struct Rules {
    name: SharedString,
    scope: Scope,
    keys: KeySource,
    backoff: Backoff,
    max_deliveries: u32,
    in_flight_wait: Duration,
    /// How keys appear in the per-message log event.
    key_log: idempotency_core::KeyLog,
}

impl Rules {
    fn count(&self, result: &'static str) {
        metrics::counter!("idempotency_consumer_messages_total", "consumer" => self.name.clone(), "result" => result)
            .increment(1);
    }

    /// The message's key, or the dead-letter disposition of a message without a usable one.
    fn key(&self, message: &dyn Delivery) -> Result<Key, Disposition> {
        self.keys.find(message).map_err(|reason| {
            let reason = reason.into_reason();
            self.count("dead_lettered");
            tracing::warn!(consumer = &*self.name, %reason, "dead-lettering a message");
            Disposition::DeadLetter { reason }
        })
    }

    fn store_unavailable(&self, error: &dyn fmt::Display, deliveries: u32) -> Disposition {
        self.count("store_unavailable");
        tracing::warn!(consumer = &*self.name, %error, "store unavailable; requeueing");
        Disposition::Nack {
            after: self.backoff.delay(deliveries),
        }
    }

    fn executed(&self) -> Disposition {
        self.count("executed");
        Disposition::Ack
    }

    fn duplicate(&self) -> Disposition {
        self.count("duplicate");
        Disposition::Ack
    }

    fn in_flight(&self, retry_after: Duration) -> Disposition {
        self.count("in_flight");
        Disposition::Nack {
            after: retry_after.clamp(self.backoff.initial, self.backoff.max),
        }
    }

    fn mismatch(&self, key: &Key) -> Disposition {
        self.count("dead_lettered");
        Disposition::DeadLetter {
            reason: format!(
                "idempotency key {} was first used with a different payload",
                key.redacted()
            ),
        }
    }

    /// The disposition of a message after the guard ran (or did not run) its handler: the one
    /// place the ack rules read an [`Execution`], for every kind of consumer. Logs the
    /// message's `info` event (target `idempotency_consumer::message`): the consumer, the key
    /// as `key_log` shows it, the attempt, the guard's decision, the disposition, the
    /// deliveries, the time since `started` and the W3C trace id of its `traceparent` header.
    fn settle<V>(
        &self,
        run: Result<Execution<Result<V, HandlerError>>, StoreError>,
        key: &Key,
        message: &dyn Delivery,
        started: std::time::Instant,
    ) -> Disposition {
        let deliveries = message.delivery_count();
        let (decision, attempt, disposition) = match run {
            Err(error) => ("store-error", 0, self.store_unavailable(&error, deliveries)),
            Ok(Execution::Replayed(_)) => ("replayed", 0, self.duplicate()),
            Ok(Execution::InFlight { retry_after, .. }) => ("in-flight", 0, self.in_flight(retry_after)),
            Ok(Execution::Mismatch) => ("mismatch", 0, self.mismatch(key)),
            Ok(Execution::Executed {
                value,
                recorded,
                attempt,
                ..
            }) => match (value, recorded) {
                (Ok(_), Recorded::Completed { .. }) => ("acquired", attempt, self.executed()),
                // Another delivery took the key over while this one ran; that delivery's outcome
                // stands, and this copy of the message is a duplicate.
                (Ok(_), Recorded::LeaseLost) => ("unknown", attempt, self.duplicate()),
                // The side effect happened but is not recorded (or, impossibly with this
                // policy, was released or left unknown): never ack an outcome that is not durable. In a
                // transaction, nothing committed (or the commit's fate is unknown): the
                // redelivery runs or replays.
                (Ok(_), recorded @ (Recorded::Failed(_) | Recorded::Released | Recorded::Unknown)) => {
                    tracing::error!(consumer = &*self.name, ?recorded, "outcome not recorded");
                    let disposition =
                        self.store_unavailable(&"the outcome could not be recorded", deliveries);
                    ("store-error", attempt, disposition)
                }
                (Err(error), _) => ("released", attempt, self.failed(error, deliveries)),
            },
        };
        let settled = match &disposition {
            Disposition::Ack => "ack",
            Disposition::Nack { .. } => "nack",
            Disposition::DeadLetter { .. } => "dead-letter",
        };
        let trace_id = message
            .header("traceparent")
            .and_then(idempotency_core::trace::trace_id);
        tracing::info!(
            target: "idempotency_consumer::message",
            consumer = &*self.name,
            key = %key.logged(self.key_log),
            attempt,
            decision,
            disposition = settled,
            deliveries,
            total_ms = started.elapsed().as_secs_f64() * 1000.0,
            trace_id,
            "message"
        );
        disposition
    }

    fn failed(&self, error: HandlerError, deliveries: u32) -> Disposition {
        match error {
            HandlerError::Fatal(reason) => {
                self.count("dead_lettered");
                Disposition::DeadLetter {
                    reason: reason.to_string(),
                }
            }
            HandlerError::Panicked(message) => {
                metrics::counter!("idempotency_consumer_panics_total", "consumer" => self.name.clone())
                    .increment(1);
                tracing::error!(consumer = &*self.name, deliveries, %message, "the handler panicked");
                if deliveries >= self.max_deliveries {
                    self.count("dead_lettered");
                    Disposition::DeadLetter {
                        reason: format!(
                            "panic: the handler panicked on {deliveries} deliveries, the last time with: {message}"
                        ),
                    }
                } else {
                    self.count("retried");
                    Disposition::Nack {
                        after: self.backoff.delay(deliveries),
                    }
                }
            }
            HandlerError::Retry(reason) if deliveries >= self.max_deliveries => {
                self.count("dead_lettered");
                Disposition::DeadLetter {
                    reason: format!("failed {deliveries} deliveries, the last with: {reason}"),
                }
            }
            HandlerError::Retry(_) => {
                self.count("retried");
                Disposition::Nack {
                    after: self.backoff.delay(deliveries),
                }
            }
        }
    }
}

/// Processes deliveries for one consumer; see the [crate docs](crate).
#[derive(Debug, Clone)]
pub struct Consumer<S, H> {
    guard: Guard<S>,
    handler: H,
    rules: Rules,
    linger: Duration,
}

impl<S: Store, H> Consumer<S, H> {
    /// A consumer named `name` (its records' scope and its metrics label) over `store`.
    /// Defaults: key from the `Idempotency-Key` header, lease 60 s, retention 7 days, backoff
    /// 1 s doubling to 5 min, dead-letter after 5 deliveries.
    ///
    /// # Panics
    ///
    /// If `name` is not a valid scope (1 to 255 bytes of visible ASCII).
    pub fn new(name: impl Into<SharedString>, store: S, handler: H) -> Self {
        let name = name.into();
        Self {
            guard: Guard::new(store)
                .name(name.clone())
                .retention(DEFAULT_CONSUMER_RETENTION),
            handler,
            rules: Rules {
                scope: Scope::new(&*name)
                    .unwrap_or_else(|e| panic!("consumer name {name:?} is not a valid scope: {e}")),
                name,
                keys: KeySource::Header(IDEMPOTENCY_KEY_HEADER.into()),
                backoff: Backoff::default(),
                max_deliveries: 5,
                in_flight_wait: DEFAULT_IN_FLIGHT_WAIT,
                key_log: idempotency_core::KeyLog::Plain,
            },
            linger: DEFAULT_LINGER,
        }
    }

    /// How long a delivery whose key is in flight (another copy of the message is being
    /// handled) waits for that copy's outcome before it is put back (default 5 s). It is woken
    /// at once when the other copy is handled by this consumer (or a clone), and reads the
    /// record again every 20 to 250 ms otherwise; the outcome, once recorded, acks it as a
    /// duplicate. `Duration::ZERO` puts it back at once. While it waits it holds its place
    /// like a running handler (a prefetch slot, a Kafka partition).
    #[must_use]
    pub fn in_flight_wait(mut self, wait: Duration) -> Self {
        self.rules.in_flight_wait = wait;
        self
    }

    /// How long, in a batch ([`Processor::process_many`]), the outcomes already run wait for
    /// the next handler before they are recorded (default [`DEFAULT_LINGER`]): a slow handler
    /// never holds its predecessors' acks back longer than this and one store round trip.
    #[must_use]
    pub fn linger(mut self, linger: Duration) -> Self {
        self.linger = linger;
        self
    }

    /// How keys appear in the per-message log event and the guard's warnings (default
    /// [`KeyLog::Plain`](idempotency_core::KeyLog::Plain): truncated past 16 bytes).
    #[must_use]
    pub fn log_keys(mut self, how: idempotency_core::KeyLog) -> Self {
        self.rules.key_log = how;
        self.guard = self.guard.log_keys(how);
        self
    }

    /// Where keys come from.
    #[must_use]
    pub fn keys(mut self, source: KeySource) -> Self {
        self.rules.keys = source;
        self
    }

    /// The lease of a running handler (heartbeats keep it alive).
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.guard = self.guard.lease(lease);
        self
    }

    /// How long a completed key keeps replaying (default 7 days: DLQ replays come late).
    #[must_use]
    pub fn retention(mut self, retention: Duration) -> Self {
        self.guard = self.guard.retention(retention);
        self
    }

    /// The redelivery backoff.
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.rules.backoff = backoff;
        self
    }

    /// After how many deliveries a message whose handler keeps failing is dead-lettered.
    #[must_use]
    pub fn max_deliveries(mut self, deliveries: u32) -> Self {
        self.rules.max_deliveries = deliveries.max(1);
        self
    }

    /// The consumer's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.rules.name
    }

    /// Calls `run` (one guarded attempt at `key`) again while it answers that the key is in
    /// flight, for up to the in-flight wait (see [`Consumer::in_flight_wait`]), and returns the
    /// last answer: the one place both kinds of consumer wait for another copy's outcome.
    async fn waiting<V, Fut>(
        &self,
        key: &Key,
        mut run: impl FnMut() -> Fut,
    ) -> Result<Execution<V>, StoreError>
    where
        Fut: Future<Output = Result<Execution<V>, StoreError>>,
    {
        let mut waiting = None;
        loop {
            let answer = run().await;
            if let Ok(Execution::InFlight { retry_after, .. }) = &answer {
                let waiting = waiting.get_or_insert_with(|| {
                    self.guard
                        .wait_in_flight(&self.rules.scope, key, self.rules.in_flight_wait)
                });
                if waiting.again(*retry_after).await {
                    continue;
                }
            }
            return answer;
        }
    }
}

/// How many messages a broker's worker decides together by default (where it batches: Kafka).
pub const DEFAULT_BATCH: usize = 64;

/// How long the outcomes of a batch wait for the next handler by default
/// ([`Consumer::linger`]).
pub const DEFAULT_LINGER: Duration = Duration::from_millis(5);

/// How long a delivery of a key in flight waits for its outcome by default.
pub const DEFAULT_IN_FLIGHT_WAIT: Duration = Duration::from_secs(5);

impl<S, H, M> Processor<M> for Consumer<S, H>
where
    S: Store,
    H: Handler<M>,
    M: Delivery + Sync,
{
    async fn process(&self, message: &M) -> Disposition {
        let started = std::time::Instant::now();
        let key = match self.rules.key(message) {
            Ok(key) => key,
            Err(dead) => return dead,
        };
        self.process_keyed(message, key, started).await
    }

    fn process_many(&self, messages: &[&M], decided: &Decisions) -> impl Future<Output = ()> + Send {
        batch::process_many(self, messages, decided)
    }
}

impl<S: Store, H> Consumer<S, H> {
    /// [`Processor::process`] of a message whose key is known: one guarded run, waiting while
    /// its key is in flight.
    async fn process_keyed<M>(&self, message: &M, key: Key, started: std::time::Instant) -> Disposition
    where
        H: Handler<M>,
        M: Delivery + Sync,
    {
        let rules = &self.rules;
        let fingerprint = Fingerprint::of_bytes(message.payload());
        let run = self
            .waiting(&key, || {
                self.guard.run(
                    rules.scope.clone(),
                    key.clone(),
                    fingerprint,
                    complete_on_success,
                    |attempt| async move { catching_panics(self.handler.handle(message, &attempt)).await },
                )
            })
            .await;
        rules.settle(run, &key, message, started)
    }
}
