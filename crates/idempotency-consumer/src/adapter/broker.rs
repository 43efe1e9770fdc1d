//! The broker-facing side of an adapter: the [`Broker`] trait a broker implements, the
//! [`AdapterError`] every broker returns, and the set-up retry.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::time::Duration;

use crate::{BoxError, Delivery, Disposition};

/// How long a settlement may take by default.
pub const DEFAULT_SETTLE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a message whose processor panicked waits before it is delivered again.
pub const PANIC_RETRY: Duration = Duration::from_secs(1);

/// A broker, as the per-message pipeline sees it: how to keep its hold on a message alive, and
/// how to carry a disposition out.
pub trait Broker: Send + Sync {
    /// The broker's message type.
    type Message: Delivery + Send + Sync;

    /// The broker's name in metrics and errors (`rabbitmq`, `nats`, `kafka`, `sqs`).
    const NAME: &'static str;

    /// How often the hold on a message being processed must be renewed; `None` (the default)
    /// when the broker holds it for as long as the consumer is connected (RabbitMQ) or never
    /// takes it back from a live member (Kafka).
    fn keep_alive_every(&self) -> Option<Duration> {
        None
    }

    /// Renews the hold on `message` once (a JetStream progress ack, an SQS visibility
    /// extension). Called every [`keep_alive_every`](Self::keep_alive_every) while the processor
    /// runs; a failure is counted and logged, and the next one is tried at the next interval.
    fn keep_alive(&self, message: &Self::Message) -> impl Future<Output = Result<(), AdapterError>> + Send {
        let _ = message;
        async { Ok(()) }
    }

    /// Carries `disposition` out on `message`: an ack only once the outcome is recorded (the
    /// pipeline calls this only after the processor answered), a delayed redelivery, or a
    /// dead-letter copy acknowledged by the broker before the original is let go.
    ///
    /// # Errors
    ///
    /// An [`AdapterError`] when the broker did not confirm it: the message must then come back
    /// (unacknowledged, its lease or visibility running out), never be lost.
    fn settle(
        &self,
        message: &Self::Message,
        disposition: &Disposition,
    ) -> impl Future<Output = Result<(), AdapterError>> + Send;

    /// Hands `message` back after its settlement failed or timed out, for a broker that would
    /// otherwise keep it with this consumer (RabbitMQ keeps an unacknowledged delivery on its
    /// channel until the channel closes). The default does nothing: JetStream's ack wait, SQS's
    /// visibility and Kafka's uncommitted offset bring the message back on their own.
    ///
    /// The pipeline waits for it at most the settle timeout, then abandons it: a hand-back is
    /// a courtesy (the broker brings the message back when the connection goes), and one that
    /// waits on a broker that does not answer must not keep the worker from noticing the loss.
    fn give_back(&self, message: &Self::Message) -> impl Future<Output = ()> + Send {
        let _ = message;
        async {}
    }
}

/// What kind of failure an [`AdapterError`] is, for deciding what to do about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AdapterErrorKind {
    /// The settings are incomplete or refused (a malformed URL, an unknown setting, no group
    /// or queue named): retrying cannot help.
    Config,
    /// No broker could be reached (at start; a worker that is running waits for its broker).
    Unreachable,
    /// The broker refused the consumer's setup (a queue declared with other arguments, a topic
    /// or stream that does not exist, a dead-letter destination nothing stores): retrying
    /// cannot help until someone changes the broker.
    Refused,
    /// A settlement (ack, nack, dead-letter copy) was refused, failed or timed out: the message
    /// comes back.
    Settle,
    /// The connection was lost while consuming.
    Lost,
    /// A publish (an event, a replayed dead letter) was not acknowledged by the broker:
    /// publishing again with the same key is safe.
    Publish,
}

impl AdapterErrorKind {
    /// The kind's name, for logs and metrics labels.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Config => "config",
            Self::Unreachable => "unreachable",
            Self::Refused => "refused",
            Self::Settle => "settle",
            Self::Lost => "lost",
            Self::Publish => "publish",
        }
    }
}

impl fmt::Display for AdapterErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A broker adapter's failure: its [kind](AdapterErrorKind), the broker, a message for people
/// (which already says what the underlying error said), and that error as the source.
///
/// ```
/// use idempotency_consumer::adapter::{AdapterError, AdapterErrorKind};
///
/// let error = AdapterError::new(AdapterErrorKind::Unreachable, "kafka", "no broker answered within 10s");
/// assert_eq!(error.to_string(), "kafka: no broker answered within 10s");
/// assert!(error.is_retryable());
/// assert_eq!(error.broker(), "kafka");
/// ```
pub struct AdapterError {
    kind: AdapterErrorKind,
    broker: &'static str,
    message: Cow<'static, str>,
    source: Option<BoxError>,
}

impl AdapterError {
    /// An error of `kind` on `broker` (its [`Broker::NAME`]), with a message for people.
    pub fn new(kind: AdapterErrorKind, broker: &'static str, message: impl Into<Cow<'static, str>>) -> Self {
        Self {
            kind,
            broker,
            message: message.into(),
            source: None,
        }
    }

    /// Attaches the underlying error.
    #[must_use]
    pub fn with_source(mut self, source: impl Into<BoxError>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// The same error, counted as `kind` (a failed ack is a settlement failure, whatever the
    /// client called it).
    #[must_use]
    pub fn into_kind(mut self, kind: AdapterErrorKind) -> Self {
        self.kind = kind;
        self
    }

    /// What kind of failure this is.
    #[must_use]
    pub fn kind(&self) -> AdapterErrorKind {
        self.kind
    }

    /// The broker's name.
    #[must_use]
    pub fn broker(&self) -> &'static str {
        self.broker
    }

    /// The message, without the broker's name.
    #[must_use]
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether trying again later may succeed: an unreachable broker, a lost connection, a
    /// failed settlement or publish may; settings or a setup the broker refused do not.
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        matches!(
            self.kind,
            AdapterErrorKind::Unreachable
                | AdapterErrorKind::Settle
                | AdapterErrorKind::Lost
                | AdapterErrorKind::Publish
        )
    }
}

impl fmt::Debug for AdapterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdapterError")
            .field("kind", &self.kind)
            .field("broker", &self.broker)
            .field("message", &self.message)
            .field("source", &self.source)
            .finish()
    }
}

impl fmt::Display for AdapterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.broker, self.message)
    }
}

impl std::error::Error for AdapterError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|source| source as &(dyn std::error::Error + 'static))
    }
}

/// Runs a worker's set-up (finding its queue, stream or consumer) until it succeeds or fails
/// for good; `None` when `shutdown` completes first.
///
/// A [retryable](AdapterError::is_retryable) failure (the broker not reachable yet, not
/// answering, unavailable for a moment, a connection lost on the way) is logged, counted in
/// `idempotency_consumer_set_up_failures_total{consumer, broker}` and tried again after
/// `backoff`'s delay, doubling; any other failure (settings, a refusal) is returned at once:
/// waiting cannot mend it. An attempt still running when `shutdown` completes is dropped: a
/// set-up has nothing in flight.
///
/// ```
/// use std::time::Duration;
/// use idempotency_consumer::Backoff;
/// use idempotency_consumer::adapter::{AdapterError, AdapterErrorKind, retry_set_up};
///
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// let backoff = Backoff { initial: Duration::from_millis(1), max: Duration::from_millis(5) };
/// let mut attempts = 0;
/// let found = retry_set_up("orders", "nats", backoff, std::future::pending(), || {
///     attempts += 1;
///     let answer = if attempts < 3 {
///         Err(AdapterError::new(AdapterErrorKind::Unreachable, "nats", "no answer"))
///     } else {
///         Ok("the consumer")
///     };
///     std::future::ready(answer)
/// })
/// .await;
/// assert_eq!(found.unwrap().unwrap(), "the consumer");
/// assert_eq!(attempts, 3);
/// # });
/// ```
pub async fn retry_set_up<T, A>(
    consumer: &str,
    broker: &'static str,
    backoff: crate::Backoff,
    shutdown: impl Future<Output = ()>,
    mut attempt: impl FnMut() -> A,
) -> Option<Result<T, AdapterError>>
where
    A: Future<Output = Result<T, AdapterError>>,
{
    let mut shutdown = std::pin::pin!(shutdown);
    let mut failures = 0_u32;
    loop {
        let answer = tokio::select! {
            answer = attempt() => answer,
            () = &mut shutdown => return None,
        };
        match answer {
            Err(error) if error.is_retryable() => {
                failures = failures.saturating_add(1);
                metrics::counter!(
                    "idempotency_consumer_set_up_failures_total",
                    "consumer" => consumer.to_owned(),
                    "broker" => broker,
                )
                .increment(1);
                tracing::warn!(consumer, broker, %error, failures, "set-up failed; trying again");
                tokio::select! {
                    () = tokio::time::sleep(backoff.delay(failures)) => {}
                    () = &mut shutdown => return None,
                }
            }
            answer => return Some(answer),
        }
    }
}
