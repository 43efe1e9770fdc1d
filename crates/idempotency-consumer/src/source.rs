//! Consuming from a broker named by URL: each broker crate declares its URL schemes, what its
//! URLs look like and how to run a consumer on one (a [`SourceKind`]), and a [`Sources`]
//! registry of the kinds a program was built with picks one by the URL's scheme — what
//! `StoreKind` and `Registry` are for stores.
//!
//! Adding a broker is one `SourceKind` in its own crate and one line where the registry is
//! built; nothing else changes. A source runs any processor of any broker's messages through
//! [`AnyProcessor`], so that a program builds one processor (the `idem consume` HTTP handler
//! under the guard) without knowing which broker it will be given to.
//!
//! ```
//! use idempotency_consumer::source::Sources;
//!
//! let sources = Sources::new().unavailable(&["kafka"], "this build has no kafka:// sources");
//! let error = sources.parse("kafka://127.0.0.1:9092?topic=t&group=g").unwrap_err();
//! assert!(error.to_string().contains("this build has no kafka:// sources"));
//! let error = sources.parse("user:s3cret@host").unwrap_err();
//! assert!(!error.to_string().contains("s3cret"));
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use idempotency_core::registry::{NoKind, Schemes, UrlKind};

use crate::adapter::{AdapterError, AdapterErrorKind};
use crate::{Decisions, Delivery, Disposition, Processor};

/// What a source's consumer needs besides its URL.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SourceSettings {
    /// The consumer's name: its metrics' `consumer` label.
    pub name: String,
    /// How many messages are processed at the same time (RabbitMQ and JetStream: the
    /// deliveries in flight; Kafka: the partitions processed at once; SQS: the messages).
    pub concurrency: usize,
    /// How many fetched messages may wait ahead of processing (RabbitMQ: the prefetch; JetStream:
    /// a pull's batch; Kafka: the messages queued per partition before it is paused; SQS: a
    /// receive's batch, at most 10).
    pub prefetch: usize,
    /// How many messages are decided together, where the source batches (Kafka: the queued
    /// messages of a partition, at most the prefetch); 1 decides each alone.
    pub batch: usize,
    /// How long a batch waits for more messages when fewer are queued.
    pub linger: Duration,
    /// The longest a handler may run: the broker's hold on a message (a poll interval, an ack
    /// wait) is set to outlast it where it is the source's to set.
    pub handler_timeout: Duration,
    /// How long the checks at start wait for the broker to answer.
    pub start_check: Duration,
}

impl SourceSettings {
    /// Settings for the consumer `name`: 16 at once, 16 prefetched, batches of
    /// [`DEFAULT_BATCH`](crate::DEFAULT_BATCH) lingering [`DEFAULT_LINGER`](crate::DEFAULT_LINGER),
    /// a 30 s handler timeout and 10 s for the checks at start.
    #[must_use]
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            concurrency: 16,
            prefetch: 16,
            batch: crate::DEFAULT_BATCH,
            linger: crate::DEFAULT_LINGER,
            handler_timeout: Duration::from_secs(30),
            start_check: Duration::from_secs(10),
        }
    }

    /// How many messages are processed at the same time.
    #[must_use]
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency.max(1);
        self
    }

    /// How many fetched messages may wait ahead of processing.
    #[must_use]
    pub fn prefetch(mut self, prefetch: usize) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// How many messages are decided together (at least 1), and how long a batch waits for more.
    #[must_use]
    pub fn batch(mut self, messages: usize, linger: Duration) -> Self {
        self.batch = messages.max(1);
        self.linger = linger;
        self
    }

    /// The longest a handler may run.
    #[must_use]
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = timeout;
        self
    }

    /// How long the checks at start wait for the broker.
    #[must_use]
    pub fn start_check(mut self, timeout: Duration) -> Self {
        self.start_check = timeout;
        self
    }
}

/// What a parsed source URL says of itself, before anything connects.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SourceInfo {
    /// Where messages come from, as dead letters and handlers name it (the queue, the
    /// `STREAM/CONSUMER`, the topic).
    pub source: String,
}

impl SourceInfo {
    /// A source named `source`.
    #[must_use]
    pub fn new(source: impl Into<String>) -> Self {
        Self {
            source: source.into(),
        }
    }
}

/// A future that ends a consumer when it completes (SIGTERM, say).
pub type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The future [`SourceKind::run`] returns.
pub type RunFuture = Pin<Box<dyn Future<Output = Result<(), AdapterError>> + Send>>;

/// A kind of message source that URLs can name: its name, its schemes, what its URLs look
/// like, and how to parse one and run a consumer on it.
#[derive(Clone, Copy, derive_more::Debug)]
pub struct SourceKind {
    /// The broker's name (also the feature that builds it into `idem`).
    pub name: &'static str,
    /// The URL schemes it answers to, without `:`.
    pub schemes: &'static [&'static str],
    /// What a URL looks like, one line (`kafka://HOST:PORT?topic=TOPIC&group=GROUP`).
    #[debug(skip)]
    pub example: &'static str,
    /// Every URL parameter, a line each, for a `--help` that names them.
    #[debug(skip)]
    pub parameters: &'static str,
    /// Parses a URL without connecting. Errors never echo a password.
    #[debug(skip)]
    pub parse: fn(&str) -> Result<SourceInfo, AdapterError>,
    /// Connects to the broker the URL names, checks that what it names exists, and consumes
    /// with the processor until the shutdown future completes; then lets the running messages
    /// settle and returns.
    #[debug(skip)]
    pub run: fn(String, SourceSettings, AnyProcessor, Shutdown) -> RunFuture,
    /// Connects to the broker the URL names and opens the dead-letter destination its
    /// consumer writes to, checking that it (and the source a replay goes to) exists.
    #[debug(skip)]
    pub dead_letters: fn(String) -> crate::dead_letters::OpenFuture,
}

impl UrlKind for SourceKind {
    fn schemes(&self) -> &'static [&'static str] {
        self.schemes
    }

    fn example(&self) -> &'static str {
        self.example
    }
}

/// The source kinds a program can consume from; see the [module docs](self).
#[derive(Debug, Clone, Default)]
pub struct Sources {
    schemes: Schemes<SourceKind>,
}

impl Sources {
    idempotency_core::schemes_builders!(SourceKind, "source", "consume from");

    /// The kinds, in the order they were added.
    #[must_use]
    pub fn kinds(&self) -> &[SourceKind] {
        self.schemes.kinds()
    }

    /// The kind named `name` (`kafka`), if this registry has it.
    #[must_use]
    pub fn named(&self, name: &str) -> Option<&SourceKind> {
        self.kinds()
            .iter()
            .find(|kind| kind.name.eq_ignore_ascii_case(name))
    }

    /// The kind `url` names, by its scheme.
    ///
    /// # Errors
    ///
    /// [`AdapterErrorKind::Config`] for a URL without a scheme, an unknown scheme, or one this
    /// program cannot consume from (the message says why).
    pub fn kind(&self, url: &str) -> Result<&SourceKind, AdapterError> {
        let scheme = url
            .split_once("://")
            .map(|(scheme, _)| scheme)
            .unwrap_or_default();
        let expected = || self.schemes.expected("nothing: no source is built in");
        let message = match self.schemes.find(scheme) {
            Ok(kind) => return Ok(kind),
            Err(NoKind::NotAScheme) => format!("not a source URL; expected {}", expected()),
            Err(NoKind::Unavailable(why)) => why.to_owned(),
            Err(NoKind::Unknown(scheme)) => format!("unknown scheme `{scheme}`; expected {}", expected()),
        };
        Err(AdapterError::new(AdapterErrorKind::Config, "source", message))
    }

    /// Parses `url` with its kind's parser.
    ///
    /// # Errors
    ///
    /// As [`Sources::kind`], or the parser's error.
    pub fn parse(&self, url: &str) -> Result<SourceInfo, AdapterError> {
        (self.kind(url)?.parse)(url)
    }

    /// One line per kind: its example URL.
    #[must_use]
    pub fn examples(&self) -> Vec<&'static str> {
        self.kinds().iter().map(|kind| kind.example).collect()
    }
}

/// A source URL's query parameters (percent-decoded), taken one by one; what is left is
/// refused, so that a misspelt parameter is an error rather than a silent default. For the
/// parsers of broker crates.
///
/// ```
/// use std::time::Duration;
/// use idempotency_consumer::source::Params;
///
/// let mut params = Params::new("nats", "stream=S&ack_wait=2m&typo=1");
/// assert_eq!(params.take("stream").as_deref(), Some("S"));
/// let wait = params.duration("ack_wait", (Duration::from_secs(1), Duration::from_secs(3600)), "must be from 1s to 1h");
/// assert_eq!(wait.unwrap(), Some(Duration::from_secs(120)));
/// let error = params.finish("stream, ack_wait").unwrap_err();
/// assert_eq!(error.to_string(), "nats: unknown parameter `typo` (stream, ack_wait)");
/// ```
#[derive(Debug, Clone)]
pub struct Params {
    broker: &'static str,
    values: BTreeMap<String, String>,
}

impl Params {
    /// The parameters of `query` (what follows the `?`), for `broker`'s errors.
    #[must_use]
    pub fn new(broker: &'static str, query: &str) -> Self {
        Self {
            broker,
            values: url::form_urlencoded::parse(query.as_bytes())
                .into_owned()
                .collect(),
        }
    }

    /// The parameter `name`, unless absent or empty.
    pub fn take(&mut self, name: &str) -> Option<String> {
        self.values.remove(name).filter(|value| !value.is_empty())
    }

    /// A duration parameter (`30s`, `5m`, see [`idempotency_core::units`]) within `range`;
    /// `why` says what the range is.
    ///
    /// # Errors
    ///
    /// [`AdapterErrorKind::Config`] naming the parameter and its value.
    pub fn duration(
        &mut self,
        name: &str,
        (min, max): (Duration, Duration),
        why: &str,
    ) -> Result<Option<Duration>, AdapterError> {
        let Some(text) = self.take(name) else {
            return Ok(None);
        };
        let duration = idempotency_core::units::parse_duration(&text)
            .map_err(|e| self.error(format!("{name}={text}: {e}")))?;
        if duration < min || duration > max {
            return Err(self.error(format!("{name}={text}: {why}")));
        }
        Ok(Some(duration))
    }

    /// A parameter naming a PEM file (a CA, a client certificate or key): it must be a readable
    /// file with a PEM block, checked now rather than when the client first connects.
    ///
    /// # Errors
    ///
    /// [`AdapterErrorKind::Config`] naming the parameter, the path and the reason (never the
    /// file's content).
    pub fn pem_file(&mut self, name: &str) -> Result<Option<std::path::PathBuf>, AdapterError> {
        let Some(path) = self.take(name) else {
            return Ok(None);
        };
        idempotency_core::pem::check_file(path.as_ref())
            .map_err(|why| self.error(format!("`{name}` {path}: {why}")))?;
        Ok(Some(path.into()))
    }

    /// Refuses any parameter not taken; `known` lists those that are.
    ///
    /// # Errors
    ///
    /// [`AdapterErrorKind::Config`] naming the first unknown parameter.
    pub fn finish(self, known: &str) -> Result<(), AdapterError> {
        match self.values.keys().next() {
            Some(unknown) => Err(self.error(format!("unknown parameter `{unknown}` ({known})"))),
            None => Ok(()),
        }
    }

    /// The parameters not taken, for a source that passes them on (Kafka's client settings).
    #[must_use]
    pub fn into_rest(self) -> BTreeMap<String, String> {
        self.values
    }

    /// A settings error of this broker's.
    #[must_use]
    pub fn error(&self, message: String) -> AdapterError {
        AdapterError::new(AdapterErrorKind::Config, self.broker, message)
    }
}

/// What follows `scheme://` in `url`, when `url` starts with it (in any case).
#[must_use]
pub fn strip_scheme<'a>(url: &'a str, scheme: &str) -> Option<&'a str> {
    let (head, rest) = url.split_once("://")?;
    head.eq_ignore_ascii_case(scheme).then_some(rest)
}

/// Any broker's message, as [`AnyProcessor`] hands it on: a [`Delivery`] whose type is known
/// only at run time.
#[derive(Clone, Copy)]
pub struct AnyMessage<'a>(&'a (dyn Delivery + Sync));

impl fmt::Debug for AnyMessage<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AnyMessage")
            .field("deliveries", &self.0.delivery_count())
            .finish_non_exhaustive()
    }
}

impl Delivery for AnyMessage<'_> {
    fn header(&self, name: &str) -> Option<&[u8]> {
        self.0.header(name)
    }
    fn message_id(&self) -> Option<&str> {
        self.0.message_id()
    }
    fn record_key(&self) -> Option<&[u8]> {
        self.0.record_key()
    }
    fn payload(&self) -> &[u8] {
        self.0.payload()
    }
    fn delivery_count(&self) -> u32 {
        self.0.delivery_count()
    }
    fn content_type(&self) -> Option<&str> {
        self.0.content_type()
    }
    fn headers(&self) -> Vec<(String, Vec<u8>)> {
        self.0.headers()
    }
}

/// What a processor of [`AnyMessage`]s is to a source: the future of one message, or of a
/// batch.
trait ProcessAny: Send + Sync {
    fn process_any<'a>(
        &'a self,
        message: &'a (dyn Delivery + Sync),
    ) -> Pin<Box<dyn Future<Output = Disposition> + Send + 'a>>;

    fn process_many_any<'a>(
        &'a self,
        messages: &'a [&'a (dyn Delivery + Sync)],
        decided: &'a Decisions,
    ) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>>;
}

impl<P> ProcessAny for P
where
    P: for<'m> Processor<AnyMessage<'m>>,
{
    fn process_any<'a>(
        &'a self,
        message: &'a (dyn Delivery + Sync),
    ) -> Pin<Box<dyn Future<Output = Disposition> + Send + 'a>> {
        Box::pin(async move { self.process(&AnyMessage(message)).await })
    }

    fn process_many_any<'a>(
        &'a self,
        messages: &'a [&'a (dyn Delivery + Sync)],
        decided: &'a Decisions,
    ) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>> {
        Box::pin(async move {
            let wrapped: Vec<AnyMessage<'a>> = messages.iter().map(|message| AnyMessage(*message)).collect();
            let batch: Vec<&AnyMessage<'a>> = wrapped.iter().collect();
            self.process_many(&batch, decided).await;
        })
    }
}

/// A processor that takes any broker's messages: what a [`SourceKind`] is given to run, since
/// the program that builds the processor does not know the broker.
///
/// ```
/// use idempotency_consumer::{Consumer, Delivery, Handler, HandlerError};
/// use idempotency_consumer::source::AnyProcessor;
/// use idempotency_core::{Attempt, MemoryStore, Outcome};
///
/// struct Log;
/// impl<M: Delivery + Sync> Handler<M> for Log {
///     async fn handle(&self, message: &M, _: &Attempt) -> Result<Outcome, HandlerError> {
///         Ok(Outcome::new(message.payload().to_vec()))
///     }
/// }
///
/// let any = AnyProcessor::new(Consumer::new("log", MemoryStore::new(), Log));
/// # let _ = any;
/// ```
#[derive(Clone)]
pub struct AnyProcessor(Arc<dyn ProcessAny>);

impl fmt::Debug for AnyProcessor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AnyProcessor")
    }
}

impl AnyProcessor {
    /// Wraps a processor of [`AnyMessage`]s (a [`Consumer`](crate::Consumer) whose handler
    /// takes any [`Delivery`]).
    pub fn new<P>(processor: P) -> Self
    where
        P: for<'m> Processor<AnyMessage<'m>> + 'static,
    {
        Self(Arc::new(processor))
    }
}

impl<M: Delivery + Sync> Processor<M> for AnyProcessor {
    async fn process(&self, message: &M) -> Disposition {
        self.0.process_any(message).await
    }

    async fn process_many(&self, messages: &[&M], decided: &Decisions) {
        let batch: Vec<&(dyn Delivery + Sync)> = messages
            .iter()
            .map(|message| *message as &(dyn Delivery + Sync))
            .collect();
        self.0.process_many_any(&batch, decided).await;
    }
}
