//! A long-lived member of a consumer group: partitions processed concurrently, each in order;
//! offsets committed in batches, and only up to messages whose outcome is recorded.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use idempotency_consumer::{Backoff, Decisions, Disposition, Processor};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::producer::FutureProducer;
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};
use tokio::runtime::Handle;
use tokio::sync::{Semaphore, mpsc, watch};
use tracing::Instrument;

use idempotency_consumer::adapter::{AdapterErrorKind, Pipeline};

use crate::{AdapterError, KafkaBroker, KafkaMessage, kafka};

/// How long one poll of the consumer waits for a message; also the longest a shutdown or an
/// abandoned worker waits to be noticed.
const POLL: Duration = Duration::from_millis(100);

/// How many messages of a partition a [`Worker`] decides together by default.
pub use idempotency_consumer::DEFAULT_BATCH;

/// How long a [`Worker`]'s batch waits for more messages by default.
pub use idempotency_consumer::DEFAULT_LINGER;

/// How many fetched messages a [`Worker`]'s partition queues by default before its fetching is
/// paused ([`Worker::prefetch`]). A pause costs librdkafka's fetched-ahead messages of the
/// partition, fetched again on the resume: on a backlog, 1,000 paused each partition every 500
/// messages and halved the batched worker's rate at 8 partitions (docs/BENCHMARKS.md, Kafka,
/// "Fewer pauses"); [`DEFAULT_PREFETCH_BYTES`] bounds the memory instead.
pub const DEFAULT_PREFETCH: usize = 10_000;

/// How many bytes of fetched messages a [`Worker`]'s partition queues by default before its
/// fetching is paused ([`Worker::prefetch_bytes`]): 4 MiB, so 16 partitions hold about 64 MiB
/// at most however large their messages (a partition is paused within one housekeeping round,
/// and a single message larger than the bound still runs).
pub const DEFAULT_PREFETCH_BYTES: usize = 4 << 20;

/// How often the poll thread paces partitions (pause and resume) and considers a commit.
const HOUSEKEEPING: Duration = Duration::from_millis(20);

/// How long the poll thread waits for the consumer to take the seek that restarts a resumed
/// partition's fetching (see [`Shared::refetch`]).
const SEEK_TIMEOUT: Duration = Duration::from_secs(1);

/// Client settings the dead-letter producer shares with the consumer: where the brokers are
/// and how to reach them.
const SHARED_SETTINGS: [&str; 5] = ["bootstrap.servers", "security.", "sasl.", "ssl.", "client."];

/// A member of a Kafka consumer group that processes one topic with a [`Processor`].
///
/// - **Order and concurrency**: the messages of one partition are processed one after another,
///   in order; up to [`concurrency`](Self::concurrency) partitions are processed
///   at the same time.
/// - **Commits**: an offset is committed only once every message before it in its partition
///   has been settled (its outcome recorded, or its dead-letter copy acknowledged), never
///   ahead. Commits are batched: every [`commit_every`](Self::commit_every) interval or count,
///   and on every revocation and on shutdown.
/// - **No nack in Kafka**: a message the core answers with `Nack` (the key in flight in another
///   consumer, the store unreachable, a handler's `Retry` below the delivery limit) holds its
///   partition, which retries the same message after the backoff; its later messages wait.
///   Nothing is ever skipped. A message to dead-letter is produced to the dead-letter topic
///   (default `<topic>.dead`) and the partition moves on only once the produce is
///   acknowledged; an unacknowledged one is produced again, with backoff.
/// - **Rebalances**: on revocation, the revoked partitions stop taking messages, their
///   running handlers are given [`settle_timeout`](Self::settle_timeout) to finish, what is
///   settled is committed, and only then are the partitions released. The next owner may read
///   the rest again; the record makes anything that completed a duplicate. A handler that
///   outlives the timeout keeps its lease (the core's guard heartbeats it); the next owner
///   waits on the key and then replays its outcome.
/// - **Polling**: a thread of the runtime's blocking pool polls the consumer all the time (it
///   never waits on a handler), so `max.poll.interval.ms` holds however long handlers run. A
///   partition with more than [`prefetch`](Self::prefetch) fetched messages, or
///   [`prefetch_bytes`](Self::prefetch_bytes) of them, waiting is paused at the broker until
///   it is below half of both, and then fetched again at once
///   from the message after the last one it took. A partition assigned to the
///   worker is always fetched from the start, whatever state an earlier assignment left it in
///   (librdkafka keeps a pause across a revocation).
///
/// ```no_run
/// use std::sync::Arc;
/// use idempotency_kafka::Worker;
/// use rdkafka::ClientConfig;
/// # async fn example<P: idempotency_consumer::Processor<idempotency_kafka::KafkaMessage> + 'static>(
/// #     processor: P,
/// #     shutdown: impl Future<Output = ()> + Send,
/// # ) -> Result<(), idempotency_kafka::AdapterError> {
/// let mut config = ClientConfig::new();
/// config.set("bootstrap.servers", "127.0.0.1:9092").set("group.id", "payments");
/// let worker = Worker::new(config, "payments", Arc::new(processor)).concurrency(8);
/// worker.run_until(shutdown).await?; // SIGTERM, say: settle, commit, leave the group
/// # Ok(())
/// # }
/// ```
///
/// # Metrics
///
/// Labelled with the worker's [`name`](Self::name) (`consumer`) and its `topic`:
/// `idempotency_kafka_messages_total{result}` (`acked`, `retried`, `dead_lettered`),
/// `idempotency_kafka_commits_total{result}` (`ok`, `failed`),
/// `idempotency_kafka_rebalances_total{kind}` (`assign`, `revoke`), and the gauges
/// `idempotency_kafka_commit_lag` (messages settled and not yet committed),
/// `idempotency_kafka_paused_partitions` (partitions held on a message being retried) and
/// `idempotency_kafka_fetch_paused_partitions` (partitions whose fetching is paused at the
/// broker because [`prefetch`](Self::prefetch) messages or
/// [`prefetch_bytes`](Self::prefetch_bytes) wait), and the counter
/// `idempotency_kafka_fetch_pauses_total` (how many times a partition was paused so).
pub struct Worker<P> {
    config: ClientConfig,
    topic: String,
    dead_letter_topic: String,
    processor: Arc<P>,
    name: Option<String>,
    options: Options,
}

/// The worker's tuning.
#[derive(Debug, Clone)]
struct Options {
    concurrency: usize,
    commit_interval: Duration,
    commit_count: u64,
    settle_timeout: Duration,
    prefetch: usize,
    prefetch_bytes: usize,
    batch: usize,
    linger: Duration,
    dead_letter_backoff: Backoff,
}

impl<P> fmt::Debug for Worker<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not the client settings: they may hold SASL passwords.
        f.debug_struct("Worker")
            .field("group", &self.config.get("group.id"))
            .field("topic", &self.topic)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<P: Processor<KafkaMessage> + 'static> Worker<P> {
    /// A worker for `topic` with the client settings `config`, which must name the brokers
    /// (`bootstrap.servers`) and the consumer group (`group.id`), and may hold any other
    /// librdkafka setting (security, timeouts). The worker sets `enable.auto.commit=false`,
    /// and `auto.offset.reset=earliest` unless `config` says otherwise: a new group reads
    /// what is already in the topic rather than losing it.
    ///
    /// Defaults: 16 partitions at once, commits every second or every 500 settled messages,
    /// 30 s for running handlers to settle on a revocation, up to [`DEFAULT_PREFETCH`] fetched
    /// messages and [`DEFAULT_PREFETCH_BYTES`] of them queued per partition, dead-letter topic
    /// `<topic>.dead`, name = the group id.
    pub fn new(config: ClientConfig, topic: impl Into<String>, processor: Arc<P>) -> Self {
        let topic = topic.into();
        Self {
            config,
            dead_letter_topic: format!("{topic}.dead"),
            topic,
            processor,
            name: None,
            options: Options {
                concurrency: 16,
                commit_interval: Duration::from_secs(1),
                commit_count: 500,
                settle_timeout: Duration::from_secs(30),
                prefetch: DEFAULT_PREFETCH,
                prefetch_bytes: DEFAULT_PREFETCH_BYTES,
                batch: DEFAULT_BATCH,
                linger: DEFAULT_LINGER,
                dead_letter_backoff: Backoff {
                    initial: Duration::from_millis(100),
                    max: Duration::from_secs(5),
                },
            },
        }
    }

    /// The name the metrics and logs carry (`consumer`); the group id by default.
    #[must_use]
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Where dead letters go (default `<topic>.dead`).
    #[must_use]
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = topic.into();
        self
    }

    /// How many partitions are processed at the same time (each one in order).
    #[must_use]
    pub fn concurrency(mut self, partitions: usize) -> Self {
        self.options.concurrency = partitions.max(1);
        self
    }

    /// Commit at least every `interval`, and as soon as `count` settled messages wait for a
    /// commit. A crash costs at most the uncommitted messages' redelivery, which the record
    /// answers without running their handlers again.
    #[must_use]
    pub fn commit_every(mut self, interval: Duration, count: u64) -> Self {
        self.options.commit_interval = interval;
        self.options.commit_count = count.max(1);
        self
    }

    /// How long a revocation or a shutdown waits for running handlers to settle (keep it near
    /// the consumer's lease, and below the group's `max.poll.interval.ms`).
    #[must_use]
    pub fn settle_timeout(mut self, timeout: Duration) -> Self {
        self.options.settle_timeout = timeout;
        self
    }

    /// How many fetched messages may wait in one partition before it is paused at the broker
    /// (default [`DEFAULT_PREFETCH`]; see also [`prefetch_bytes`](Self::prefetch_bytes)).
    #[must_use]
    pub fn prefetch(mut self, messages: usize) -> Self {
        self.options.prefetch = messages.max(2);
        self
    }

    /// How many bytes of fetched messages (keys and payloads) may wait in one partition before
    /// it is paused at the broker (default [`DEFAULT_PREFETCH_BYTES`]), whatever their count:
    /// the bound on the worker's memory when messages are large. A partition pauses at
    /// whichever of the two bounds it reaches first, and resumes once it is below half of
    /// both. A single message larger than the bound still runs: its partition pauses until
    /// it is settled.
    #[must_use]
    pub fn prefetch_bytes(mut self, bytes: usize) -> Self {
        self.options.prefetch_bytes = bytes.max(1);
        self
    }

    /// How many messages of a partition are decided together (default [`DEFAULT_BATCH`]): the
    /// processor claims their keys in one store round trip and records their outcomes in one
    /// more (see [`Processor::process_many`]), and their offsets become committable only
    /// then. Messages still run one after another, in partition order. `1` decides each
    /// message on its own.
    #[must_use]
    pub fn batch(mut self, messages: usize) -> Self {
        self.options.batch = messages.max(1);
        self
    }

    /// How long a batch waits for more messages when fewer than [`batch`](Self::batch) are
    /// queued (default [`DEFAULT_LINGER`]): a lone message is not delayed longer than this.
    #[must_use]
    pub fn linger(mut self, linger: Duration) -> Self {
        self.options.linger = linger;
        self
    }

    /// Asks the brokers for the metadata of the topic and the dead-letter topic, waiting at
    /// most `timeout` in all: a fail-fast check for the start of a service, since
    /// [`run_until`](Self::run_until) waits for brokers that are down (librdkafka reconnects)
    /// and for a topic that does not exist yet, and a dead letter to a missing topic holds its
    /// partition until the topic exists.
    ///
    /// # Errors
    ///
    /// [`AdapterErrorKind::Unreachable`] when no broker answered within `timeout` (with the last
    /// error librdkafka reported);
    /// [`AdapterErrorKind::Config`] when the client refuses a setting;
    /// [`AdapterErrorKind::Refused`] when a topic does not exist (or the client may not see it),
    /// and as soon as librdkafka reports a refused TLS handshake (a certificate it does not
    /// trust, a name that does not match) or a refused SASL authentication, with librdkafka's
    /// reason (which never holds the password).
    pub async fn check(&self, timeout: Duration) -> Result<(), AdapterError> {
        let consumer: BaseConsumer<CheckContext> =
            self.config
                .create_with_context(CheckContext::default())
                .map_err(kafka(AdapterErrorKind::Config, "the consumer"))?;
        let consumer = Arc::new(consumer);
        let deadline = Instant::now() + timeout;
        for topic in [&self.topic, &self.dead_letter_topic] {
            let metadata = loop {
                // Short requests, so that a refused handshake or login ends the check when
                // librdkafka reports it rather than at the deadline.
                let slice = deadline
                    .saturating_duration_since(Instant::now())
                    .min(CHECK_SLICE);
                let fetched = tokio::task::spawn_blocking({
                    let (consumer, topic) = (Arc::clone(&consumer), topic.clone());
                    move || {
                        let fetched = consumer.fetch_metadata(Some(&topic), slice);
                        // A consumer's errors (a refused handshake or login among them) come
                        // through its queue: serving it hands them to the context.
                        while consumer.poll(Duration::ZERO).is_some() {}
                        fetched
                    }
                })
                .await
                .map_err(|e| config_error(format!("the metadata request failed: {e}")))?;
                let error = match fetched {
                    Ok(metadata) => break metadata,
                    Err(error) => error,
                };
                if let Some(refusal) = consumer.context().refusal() {
                    return Err(refused(refusal));
                }
                if Instant::now() >= deadline {
                    let why = consumer
                        .context()
                        .last_error()
                        .map(|reason| format!(" (librdkafka: {reason})"))
                        .unwrap_or_default();
                    return Err(kafka(
                        AdapterErrorKind::Unreachable,
                        format!("no broker answered a metadata request within {timeout:?}{why}"),
                    )(error));
                }
            };
            let found = metadata
                .topics()
                .iter()
                .find(|found| found.name() == topic.as_str());
            match found.map(|found| (found.error(), found.partitions().is_empty())) {
                Some((None, false)) => {}
                Some((Some(error), _)) => {
                    return Err(refused(format!(
                        "topic {topic}: {}",
                        RDKafkaErrorCode::from(error)
                    )));
                }
                _ => return Err(refused(format!("topic {topic} does not exist"))),
            }
        }
        Ok(())
    }

    /// Joins the group and consumes until `shutdown` completes; then stops taking messages,
    /// lets the running handlers settle (up to the settle timeout), commits and leaves the
    /// group.
    ///
    /// Dropping the returned future instead (aborting its task) is a crash: the handlers are
    /// cancelled and nothing more is committed; the next owner reads the uncommitted messages
    /// again, and the record answers those that completed.
    ///
    /// # Errors
    ///
    /// [`AdapterErrorKind::Config`] when `config` names no group or the client refuses a
    /// setting, or the topic cannot be subscribed to. A broker that is down is not an error:
    /// librdkafka reconnects, and the partitions wait.
    pub async fn run_until<F>(&self, shutdown: F) -> Result<(), AdapterError>
    where
        F: Future<Output = ()> + Send,
    {
        let group = self
            .config
            .get("group.id")
            .ok_or_else(|| config_error("the client settings name no consumer group (group.id)".into()))?;
        let name = self.name.clone().unwrap_or_else(|| group.to_owned());
        let mut producer_config = ClientConfig::new();
        for (key, value) in self.config.config_map() {
            if SHARED_SETTINGS.iter().any(|shared| key.starts_with(shared)) {
                producer_config.set(key, value);
            }
        }
        let producer: FutureProducer = producer_config
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .create()
            .map_err(|e| config_error(format!("the dead-letter producer: {e}")))?;
        let shared = Arc::new(Shared {
            runtime: Handle::current(),
            processor: Arc::clone(&self.processor),
            pipeline: Pipeline::new(
                KafkaBroker::new(producer, self.dead_letter_topic.clone()),
                name.clone(),
            ),
            topic: self.topic.clone(),
            permits: Semaphore::new(self.options.concurrency),
            options: self.options.clone(),
            partitions: Mutex::new(HashMap::new()),
            abandoned: AtomicBool::new(false),
            metrics: Metrics::new(&name, &self.topic),
            name,
        });
        let mut config = self.config.clone();
        config.set("enable.auto.commit", "false");
        if config.get("auto.offset.reset").is_none() {
            config.set("auto.offset.reset", "earliest");
        }
        let consumer: BaseConsumer<WorkerContext<P>> = config
            .create_with_context(WorkerContext {
                shared: Arc::clone(&shared),
            })
            .map_err(|e| config_error(format!("the consumer: {e}")))?;
        consumer
            .subscribe(&[&self.topic])
            .map_err(|e| config_error(format!("subscribing to {}: {e}", self.topic)))?;
        tracing::info!(consumer = %shared.name, topic = %self.topic, "joining the consumer group");
        let stopping = Arc::new(AtomicBool::new(false));
        let abandon = Abandon(Some(Arc::clone(&shared)));
        let mut poller = tokio::task::spawn_blocking({
            let (shared, stopping) = (Arc::clone(&shared), Arc::clone(&stopping));
            move || poll(&consumer, &shared, &stopping)
        });
        let ended = tokio::select! {
            () = shutdown => None,
            ended = &mut poller => Some(ended),
        };
        stopping.store(true, Ordering::SeqCst);
        let ended = match ended {
            Some(ended) => ended,
            None => poller.await,
        };
        abandon.disarm();
        ended.map_err(|e| config_error(format!("the worker's poll thread failed: {e}")))
    }
}

/// Marks the worker abandoned when `run_until`'s future is dropped before it returned.
struct Abandon<P: Processor<KafkaMessage> + 'static>(Option<Arc<Shared<P>>>);

impl<P: Processor<KafkaMessage> + 'static> Abandon<P> {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl<P: Processor<KafkaMessage> + 'static> Drop for Abandon<P> {
    fn drop(&mut self) {
        if let Some(shared) = self.0.take() {
            shared.abandoned.store(true, Ordering::SeqCst);
            for task in shared
                .lock()
                .values()
                .filter_map(|partition| partition.task.as_ref())
            {
                task.abort();
            }
        }
    }
}

/// Polls until stopped or abandoned, routing messages to their partitions' tasks; then leaves
/// the group. Runs on a thread of the blocking pool, where the rebalance callbacks may wait.
fn poll<P: Processor<KafkaMessage> + 'static>(
    consumer: &BaseConsumer<WorkerContext<P>>,
    shared: &Arc<Shared<P>>,
    stopping: &AtomicBool,
) {
    let mut last_commit = Instant::now();
    let mut last_housekeeping = Instant::now();
    loop {
        if shared.abandoned.load(Ordering::SeqCst) {
            break;
        }
        if stopping.load(Ordering::SeqCst) {
            let all: Vec<_> = shared.lock().drain().collect();
            shared.settle_and_commit(consumer, all);
            tracing::info!(consumer = %shared.name, "stopped: settled, committed, leaving the group");
            break;
        }
        match consumer.poll(POLL) {
            Some(Ok(message)) => shared.route(message.detach()),
            Some(Err(error)) => tracing::warn!(consumer = %shared.name, %error, "Kafka consumer error"),
            None => {}
        }
        if last_housekeeping.elapsed() >= HOUSEKEEPING {
            shared.housekeeping(consumer, &mut last_commit);
            last_housekeeping = Instant::now();
        }
    }
    // Dropping the consumer (by the caller) closes it: the group is told, and the revocation
    // callback finds nothing left to settle.
}

/// The consumer's callbacks: partitions get a task on assignment and are settled and
/// committed on revocation.
struct WorkerContext<P: Processor<KafkaMessage> + 'static> {
    shared: Arc<Shared<P>>,
}

impl<P: Processor<KafkaMessage> + 'static> ClientContext for WorkerContext<P> {}

impl<P: Processor<KafkaMessage> + 'static> ConsumerContext for WorkerContext<P> {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(list) = rebalance {
            self.shared.metrics.revoked.increment(1);
            let revoked: Vec<_> = {
                let mut partitions = self.shared.lock();
                list.elements()
                    .iter()
                    .filter(|element| element.topic() == self.shared.topic)
                    .filter_map(|element| partitions.remove_entry(&element.partition()))
                    .collect()
            };
            tracing::info!(consumer = %self.shared.name, partitions = revoked.len(), "partitions revoked");
            self.shared.settle_and_commit(consumer, revoked);
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(list) => {
                self.shared.metrics.assigned.increment(1);
                let partitions: Vec<i32> = list
                    .elements()
                    .iter()
                    .filter(|element| element.topic() == self.shared.topic)
                    .map(|element| element.partition())
                    .collect();
                tracing::info!(consumer = %self.shared.name, ?partitions, "partitions assigned");
                Shared::assign(&self.shared, consumer, &partitions);
            }
            Rebalance::Revoke(_) => {}
            Rebalance::Error(error) => {
                tracing::warn!(consumer = %self.shared.name, %error, "rebalance failed");
            }
        }
    }
}

/// A settings error.
fn config_error(what: String) -> AdapterError {
    AdapterError::new(AdapterErrorKind::Config, crate::BROKER, what)
}

/// How long one metadata request of [`Worker::check`] waits before the check looks at what
/// librdkafka reported.
const CHECK_SLICE: Duration = Duration::from_millis(500);

/// The client context of [`Worker::check`]: it keeps the errors librdkafka reports (a TLS
/// handshake or a SASL login the broker refused, a listener that is not what the settings say)
/// with their reasons, and its log lines at error level; a metadata request that times out
/// carries neither.
#[derive(Default)]
struct CheckContext {
    errors: Mutex<Vec<(RDKafkaErrorCode, String)>>,
}

/// At most this many errors are kept.
const CHECK_KEPT: usize = 64;

impl CheckContext {
    fn keep(&self, code: RDKafkaErrorCode, reason: String) {
        let mut errors = self.errors.lock().unwrap_or_else(PoisonError::into_inner);
        if errors.len() < CHECK_KEPT {
            errors.push((code, reason));
        }
    }

    /// A refused TLS handshake or SASL authentication, with librdkafka's reason, if one was
    /// reported: those do not get better by waiting.
    fn refusal(&self) -> Option<String> {
        let errors = self.errors.lock().unwrap_or_else(PoisonError::into_inner);
        errors.iter().find_map(|(code, reason)| match code {
            RDKafkaErrorCode::SSL => Some(format!("the TLS connection was refused: {reason}")),
            RDKafkaErrorCode::Authentication | RDKafkaErrorCode::SaslAuthenticationFailed => {
                Some(format!("the SASL authentication was refused: {reason}"))
            }
            _ => None,
        })
    }

    /// The last reason librdkafka gave that says more than "all brokers are down".
    fn last_error(&self) -> Option<String> {
        let errors = self.errors.lock().unwrap_or_else(PoisonError::into_inner);
        let telling = errors
            .iter()
            .rev()
            .find(|(code, _)| *code != RDKafkaErrorCode::AllBrokersDown);
        telling.or(errors.last()).map(|(_, reason)| reason.clone())
    }
}

impl ClientContext for CheckContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, log_message: &str) {
        use rdkafka::config::RDKafkaLogLevel::{Alert, Critical, Emerg, Error};
        tracing::debug!(?level, fac, log_message, "librdkafka, during the start check");
        if matches!(level, Emerg | Alert | Critical | Error) {
            // The error event with its code may come late or not at all while librdkafka
            // suppresses identical errors; its log line says the same, in librdkafka's words.
            let reason = log_message
                .split_once("]: ")
                .map_or(log_message, |(_, reason)| reason);
            let code = if reason.contains("SSL handshake failed") {
                RDKafkaErrorCode::SSL
            } else if reason.contains("SASL authentication error") {
                RDKafkaErrorCode::Authentication
            } else {
                RDKafkaErrorCode::Fail
            };
            self.keep(code, reason.to_owned());
        }
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        tracing::debug!(%error, reason, "librdkafka reported an error during the start check");
        let code = error.rdkafka_error_code().unwrap_or(RDKafkaErrorCode::Fail);
        self.keep(code, reason.to_owned());
    }
}

impl ConsumerContext for CheckContext {}

/// The broker refused the setup (a topic it does not have).
fn refused(what: String) -> AdapterError {
    AdapterError::new(AdapterErrorKind::Refused, crate::BROKER, what)
}

/// What the poll thread, the callbacks and the partition tasks share.
struct Shared<P> {
    runtime: Handle,
    processor: Arc<P>,
    pipeline: Pipeline<KafkaBroker>,
    name: String,
    topic: String,
    options: Options,
    permits: Semaphore,
    partitions: Mutex<HashMap<i32, Partition>>,
    abandoned: AtomicBool,
    metrics: Metrics,
}

/// An assigned partition, as the poll thread sees it.
struct Partition {
    messages: mpsc::UnboundedSender<OwnedMessage>,
    progress: Arc<Progress>,
    /// The last offset committed (the next to read), or -1.
    committed: i64,
    stop: watch::Sender<bool>,
    /// The partition's task; taken when it is awaited.
    task: Option<tokio::task::JoinHandle<()>>,
    /// Whether fetching is paused at the broker (its queue was full), as the broker last
    /// accepted it.
    paused: bool,
}

/// What a partition's task reports to the poll thread.
#[derive(Debug)]
pub(crate) struct Progress {
    /// Messages routed to the task and not yet settled.
    queued: AtomicUsize,
    /// Their bytes ([`queued_size`]).
    queued_bytes: AtomicUsize,
    /// The offset after the last settled message (what to commit), or -1.
    settled: AtomicI64,
    /// Messages settled since the last commit.
    uncommitted: AtomicU64,
}

impl Progress {
    /// `offset`'s message is settled: the offset after it may be committed. Called by the
    /// pipeline's settlement ([`KafkaBroker`](crate::KafkaBroker)), which is the only way a
    /// message's offset becomes committable: never before its outcome is recorded or its
    /// dead-letter copy acknowledged.
    pub(crate) fn settled(&self, offset: i64) {
        self.settled.store(offset + 1, Ordering::SeqCst);
        self.uncommitted.fetch_add(1, Ordering::SeqCst);
    }
}

/// The worker's metrics, labelled once.
struct Metrics {
    acked: metrics::Counter,
    retried: metrics::Counter,
    dead_lettered: metrics::Counter,
    commits_ok: metrics::Counter,
    commits_failed: metrics::Counter,
    assigned: metrics::Counter,
    revoked: metrics::Counter,
    commit_lag: metrics::Gauge,
    paused: metrics::Gauge,
    fetch_paused: metrics::Gauge,
    fetch_pauses: metrics::Counter,
}

impl Metrics {
    fn new(name: &str, topic: &str) -> Self {
        let labels = [("consumer", name.to_owned()), ("topic", topic.to_owned())];
        let messages = |result: &'static str| {
            let mut labels = labels.to_vec();
            labels.push(("result", result.to_owned()));
            metrics::counter!("idempotency_kafka_messages_total", &labels)
        };
        let commits = |result: &'static str| {
            let mut labels = labels.to_vec();
            labels.push(("result", result.to_owned()));
            metrics::counter!("idempotency_kafka_commits_total", &labels)
        };
        let rebalances = |kind: &'static str| {
            let mut labels = labels.to_vec();
            labels.push(("kind", kind.to_owned()));
            metrics::counter!("idempotency_kafka_rebalances_total", &labels)
        };
        Self {
            acked: messages("acked"),
            retried: messages("retried"),
            dead_lettered: messages("dead_lettered"),
            commits_ok: commits("ok"),
            commits_failed: commits("failed"),
            assigned: rebalances("assign"),
            revoked: rebalances("revoke"),
            commit_lag: metrics::gauge!("idempotency_kafka_commit_lag", &labels),
            paused: metrics::gauge!("idempotency_kafka_paused_partitions", &labels),
            fetch_paused: metrics::gauge!("idempotency_kafka_fetch_paused_partitions", &labels),
            fetch_pauses: metrics::counter!("idempotency_kafka_fetch_pauses_total", &labels),
        }
    }
}

impl<P: Processor<KafkaMessage> + 'static> Shared<P> {
    fn lock(&self) -> MutexGuard<'_, HashMap<i32, Partition>> {
        self.partitions.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts a task for each newly assigned partition, and makes sure the broker fetches it.
    ///
    /// librdkafka keeps a partition's pause across its revocation and a later assignment: a
    /// partition this worker paused (its queue was full) and that comes back to it, in the next
    /// rebalance or much later, would start paused while its new task counts it as fetching,
    /// and nothing would ever resume it. A new task starts with an empty queue, so the
    /// partition is resumed: the worker's view is the one the broker is made to follow.
    fn assign(this: &Arc<Self>, consumer: &BaseConsumer<WorkerContext<P>>, assigned: &[i32]) {
        let mut partitions = this.lock();
        let mut fetch = TopicPartitionList::new();
        for &partition in assigned {
            if partitions.contains_key(&partition) {
                continue;
            }
            fetch.add_partition(&this.topic, partition);
            let (messages, receiver) = mpsc::unbounded_channel();
            let (stop, stopped) = watch::channel(false);
            let progress = Arc::new(Progress {
                queued: AtomicUsize::new(0),
                queued_bytes: AtomicUsize::new(0),
                settled: AtomicI64::new(-1),
                uncommitted: AtomicU64::new(0),
            });
            let task = this.runtime.spawn(Arc::clone(this).run_partition(
                partition,
                receiver,
                Arc::clone(&progress),
                stopped,
            ));
            partitions.insert(
                partition,
                Partition {
                    messages,
                    progress,
                    committed: -1,
                    stop,
                    task: Some(task),
                    paused: false,
                },
            );
        }
        if fetch.count() > 0
            && let Err(error) = consumer.resume(&fetch)
        {
            // Counted as paused, the partitions are resumed by the next housekeeping, as any
            // paused partition whose queue has drained.
            tracing::warn!(consumer = %this.name, %error, "could not resume newly assigned partitions; trying again");
            for element in fetch.elements() {
                if let Some(state) = partitions.get_mut(&element.partition()) {
                    state.paused = true;
                }
            }
        }
    }

    /// Hands a fetched message to its partition's task.
    fn route(&self, message: OwnedMessage) {
        let partitions = self.lock();
        match partitions.get(&message.partition()) {
            Some(state) if message.topic() == self.topic => {
                let size = queued_size(&message);
                state.progress.queued.fetch_add(1, Ordering::SeqCst);
                state.progress.queued_bytes.fetch_add(size, Ordering::SeqCst);
                if state.messages.send(message).is_err() {
                    state.progress.queued.fetch_sub(1, Ordering::SeqCst);
                    state.progress.queued_bytes.fetch_sub(size, Ordering::SeqCst);
                }
            }
            // Not assigned here (any more): left uncommitted, for the partition's owner.
            _ => {
                tracing::debug!(consumer = %self.name, partition = message.partition(), "message of a partition not held");
            }
        }
    }

    /// Pauses partitions whose queue is full, resumes those that drained, and commits when a
    /// batch is due.
    fn housekeeping(&self, consumer: &BaseConsumer<WorkerContext<P>>, last_commit: &mut Instant) {
        let mut partitions = self.lock();
        let (mut pause, mut resume) = (TopicPartitionList::new(), TopicPartitionList::new());
        for (&partition, state) in partitions.iter() {
            let queued = state.progress.queued.load(Ordering::SeqCst);
            let bytes = state.progress.queued_bytes.load(Ordering::SeqCst);
            let (messages, most) = (self.options.prefetch, self.options.prefetch_bytes);
            if !state.paused && (queued >= messages || bytes >= most) {
                pause.add_partition(&self.topic, partition);
            } else if state.paused && queued <= messages / 2 && bytes <= most / 2 {
                resume.add_partition(&self.topic, partition);
            }
        }
        for (list, paused) in [(&pause, true), (&resume, false)] {
            if list.count() == 0 {
                continue;
            }
            let done = if paused {
                consumer.pause(list)
            } else {
                consumer.resume(list)
            };
            match done {
                // Only what the broker took is recorded: a partition whose resume failed stays
                // counted as paused and is resumed by the next housekeeping.
                Ok(()) => {
                    for element in list.elements() {
                        if let Some(state) = partitions.get_mut(&element.partition()) {
                            state.paused = paused;
                        }
                    }
                    if paused {
                        self.metrics
                            .fetch_pauses
                            .increment(u64::try_from(list.count()).unwrap_or(u64::MAX));
                    } else {
                        self.refetch(consumer, list);
                    }
                }
                Err(error) => {
                    let what = if paused { "pause" } else { "resume" };
                    tracing::warn!(consumer = %self.name, %error, "could not {what} partitions");
                }
            }
        }
        let fetch_paused = partitions.values().filter(|state| state.paused).count();
        #[expect(clippy::cast_precision_loss, reason = "a gauge")]
        self.metrics.fetch_paused.set(fetch_paused as f64);
        let uncommitted = uncommitted(&partitions);
        let due = uncommitted >= self.options.commit_count
            || (uncommitted > 0 && last_commit.elapsed() >= self.options.commit_interval);
        if due {
            self.commit(consumer, partitions.iter_mut().map(|(p, state)| (*p, state)));
            *last_commit = Instant::now();
        }
        self.show_lag(&partitions);
    }

    /// Starts fetching the `resumed` partitions again now, from where the worker stands in
    /// each.
    ///
    /// A resume alone does not wake librdkafka's fetcher: when every partition it fetches for
    /// was paused, it sleeps until its next periodic wake-up (up to a second) before it fetches
    /// again, and a worker whose partitions all fill up (a backlog) would wait that long after
    /// every pause. A seek to the position the resume would fetch from anyway (the consumer's
    /// position: the offset after the last message it handed out; the pause dropped what was
    /// fetched ahead) restarts the fetch at once. The seek waits for the consumer to take it, so that
    /// nothing fetched before it is handed out after it and no message reaches a task twice;
    /// should the consumer not take it within [`SEEK_TIMEOUT`], a message may reach its task
    /// a second time and is answered from the record (its offset only ever moves the commit
    /// forward).
    fn refetch(&self, consumer: &BaseConsumer<WorkerContext<P>>, resumed: &TopicPartitionList) {
        // The consumer's position: the offset after the last message it handed out, which is
        // what a pause kept to fetch from. It is unknown (and the fetch starts from the
        // committed offset) before the partition's first message.
        let position = match consumer.position() {
            Ok(position) => position,
            Err(error) => {
                tracing::debug!(consumer = %self.name, %error, "resumed partitions were not fetched again at once");
                return;
            }
        };
        let mut seek = TopicPartitionList::new();
        for element in resumed.elements() {
            let next = position
                .find_partition(&self.topic, element.partition())
                .map(|found| found.offset());
            if let Some(Offset::Offset(next)) = next
                && let Err(error) =
                    seek.add_partition_offset(&self.topic, element.partition(), Offset::Offset(next))
            {
                tracing::warn!(consumer = %self.name, %error, "could not list a partition to fetch again");
            }
        }
        if seek.count() == 0 {
            return;
        }
        match consumer.seek_partitions(seek, SEEK_TIMEOUT) {
            Ok(sought) => {
                for element in sought.elements() {
                    if let Err(error) = element.error() {
                        // Resumed all the same: librdkafka fetches it after its next wake-up.
                        tracing::debug!(consumer = %self.name, partition = element.partition(), %error, "a resumed partition was not fetched again at once");
                    }
                }
            }
            Err(error) => {
                tracing::debug!(consumer = %self.name, %error, "resumed partitions were not fetched again at once");
            }
        }
    }

    /// Sets the commit-lag gauge from the partitions held.
    fn show_lag(&self, partitions: &HashMap<i32, Partition>) {
        #[expect(clippy::cast_precision_loss, reason = "a gauge")]
        self.metrics.commit_lag.set(uncommitted(partitions) as f64);
    }

    /// Commits the settled offsets of `partitions` that are ahead of their last commit.
    fn commit<'a>(
        &self,
        consumer: &BaseConsumer<WorkerContext<P>>,
        partitions: impl Iterator<Item = (i32, &'a mut Partition)>,
    ) {
        let mut list = TopicPartitionList::new();
        let mut committing = Vec::new();
        for (partition, state) in partitions {
            let settled = state.progress.settled.load(Ordering::SeqCst);
            if settled > state.committed {
                // The count is taken before the commit: messages settled meanwhile stay counted.
                let count = state.progress.uncommitted.load(Ordering::SeqCst);
                if let Err(error) = list.add_partition_offset(&self.topic, partition, Offset::Offset(settled))
                {
                    tracing::warn!(consumer = %self.name, %error, "could not list an offset to commit");
                    continue;
                }
                committing.push((state, settled, count));
            }
        }
        if committing.is_empty() {
            return;
        }
        match consumer.commit(&list, CommitMode::Sync) {
            Ok(()) => {
                self.metrics.commits_ok.increment(1);
                for (state, settled, count) in committing {
                    state.committed = settled;
                    state.progress.uncommitted.fetch_sub(count, Ordering::SeqCst);
                }
            }
            Err(error) => {
                // Kept for the next batch; a crash meanwhile costs redeliveries, not effects.
                self.metrics.commits_failed.increment(1);
                tracing::warn!(consumer = %self.name, %error, "offset commit failed");
            }
        }
    }

    /// Stops the tasks of `partitions`, waits for their running handlers (up to the settle
    /// timeout), and commits what they settled, unless the assignment was lost (another member
    /// owns the partitions and commits for them) or the worker was abandoned.
    fn settle_and_commit(
        &self,
        consumer: &BaseConsumer<WorkerContext<P>>,
        partitions: Vec<(i32, Partition)>,
    ) {
        if partitions.is_empty() {
            return;
        }
        for (_, state) in &partitions {
            let _ = state.stop.send(true);
        }
        let (mut tasks, mut states) = (Vec::new(), Vec::new());
        for (partition, mut state) in partitions {
            let Some(task) = state.task.take() else { continue };
            if self.abandoned.load(Ordering::SeqCst) {
                task.abort();
                continue;
            }
            tasks.push(task);
            states.push((partition, state));
        }
        if tasks.is_empty() {
            return;
        }
        let timeout = self.options.settle_timeout;
        let settled = self
            .runtime
            .block_on(async { tokio::time::timeout(timeout, futures_util::future::join_all(tasks)).await });
        if settled.is_err() {
            tracing::warn!(
                consumer = %self.name,
                ?timeout,
                "handlers still running after the settle timeout; the next owner waits on their keys"
            );
        }
        if consumer.assignment_lost() {
            tracing::warn!(consumer = %self.name, "assignment lost: nothing committed for the revoked partitions");
            self.show_lag(&self.lock());
            return;
        }
        self.commit(consumer, states.iter_mut().map(|(p, state)| (*p, state)));
        self.show_lag(&self.lock());
    }

    /// A partition's task: its messages one after another, in batches, until revoked.
    async fn run_partition(
        self: Arc<Self>,
        partition: i32,
        mut messages: mpsc::UnboundedReceiver<OwnedMessage>,
        progress: Arc<Progress>,
        mut stop: watch::Receiver<bool>,
    ) {
        let mut batch: VecDeque<KafkaMessage> = VecDeque::new();
        loop {
            if batch.is_empty() {
                let message = tokio::select! {
                    biased;
                    () = stopped(&mut stop) => return,
                    message = messages.recv() => match message {
                        Some(message) => message,
                        None => return,
                    },
                };
                batch.push_back(KafkaMessage::tracked(message, Arc::clone(&progress)));
            }
            self.fill(&mut batch, &mut messages, &progress).await;
            let offset = batch.front().map(|message| message.message.offset());
            let span = tracing::debug_span!("kafka_batch", consumer = %self.name, topic = %self.topic, partition, offset, messages = batch.len());
            if self
                .settle_batch(&mut batch, &progress, &mut stop)
                .instrument(span)
                .await
                .is_none()
            {
                // Revoked before it settled: left uncommitted, for the next owner.
                return;
            }
        }
    }

    /// Adds the partition's queued messages to `batch` up to the batch size (at most the
    /// prefetch), waiting up to the linger for more when it is not full. A message counts as
    /// queued (for pausing the partition's fetching) until it is settled.
    async fn fill(
        &self,
        batch: &mut VecDeque<KafkaMessage>,
        messages: &mut mpsc::UnboundedReceiver<OwnedMessage>,
        progress: &Arc<Progress>,
    ) {
        let size = self.options.batch.min(self.options.prefetch);
        let deadline = tokio::time::Instant::now() + self.options.linger;
        while batch.len() < size {
            let message = match messages.try_recv() {
                Ok(message) => message,
                Err(_) if size == 1 || self.options.linger.is_zero() => return,
                Err(_) => match tokio::time::timeout_at(deadline, messages.recv()).await {
                    Ok(Some(message)) => message,
                    Ok(None) | Err(_) => return,
                },
            };
            batch.push_back(KafkaMessage::tracked(message, Arc::clone(progress)));
        }
    }

    /// Decides and settles the messages of `batch` in order, until each is settled (`Ack`, or
    /// dead-lettered and acknowledged), or until the partition is stopped (`None`). Each is
    /// settled as soon as its disposition is handed over, while later ones may still run. A
    /// message answered with `Nack` holds the partition: it is decided again after the delay,
    /// with the messages after it.
    async fn settle_batch(
        &self,
        batch: &mut VecDeque<KafkaMessage>,
        progress: &Progress,
        stop: &mut watch::Receiver<bool>,
    ) -> Option<()> {
        let mut held = Held {
            gauge: &self.metrics.paused,
            holding: false,
        };
        while !batch.is_empty() {
            let _permit = tokio::select! {
                biased;
                () = stopped(stop) => return None,
                permit = self.permits.acquire() => permit.ok()?,
            };
            let messages: Vec<&KafkaMessage> = batch.iter().collect();
            let (decisions, dispositions) = Decisions::channel();
            let mut stopping = stop.clone();
            let decide = async {
                {
                    let run = async {
                        if self.options.batch == 1 {
                            decisions.send(self.pipeline.decide(&*self.processor, messages[0]).await);
                        } else {
                            self.pipeline
                                .decide_many(&*self.processor, &messages, &decisions)
                                .await;
                        }
                    };
                    tokio::pin!(run);
                    tokio::select! {
                        () = &mut run => {}
                        () = stopped(&mut stopping) => {
                            // Revoked or stopping: the batch ends after the running handler.
                            decisions.close();
                            run.await;
                        }
                    }
                }
                drop(decisions);
            };
            let settle = self.settle_decided(&messages, dispositions, &mut *stop, &mut held);
            let ((), settled) = tokio::join!(decide, settle);
            drop(messages);
            let settled_bytes: usize = batch
                .drain(..settled.count.min(batch.len()))
                .map(|message| queued_size(&message.message))
                .sum();
            progress.queued.fetch_sub(settled.count, Ordering::SeqCst);
            progress.queued_bytes.fetch_sub(settled_bytes, Ordering::SeqCst);
            if settled.stopped {
                return None;
            }
            if settled.count > 0 && settled.nack.is_none() {
                held.release();
            }
            if let Some(after) = settled.nack {
                // No nack in Kafka: the partition holds on this message, in order.
                held.hold();
                if let Some(message) = batch.front_mut() {
                    message.deliveries = message.deliveries.saturating_add(1);
                }
                wait(after, stop).await?;
            }
        }
        Some(())
    }

    /// Settles each disposition handed over, in order, on the batch's next message: acks are
    /// the offset's progress, a dead letter is produced until acknowledged; a nack ends it.
    async fn settle_decided(
        &self,
        messages: &[&KafkaMessage],
        mut dispositions: mpsc::UnboundedReceiver<Disposition>,
        stop: &mut watch::Receiver<bool>,
        held: &mut Held<'_>,
    ) -> Settled {
        let mut settled = Settled::default();
        while let Some(disposition) = dispositions.recv().await {
            let Some(message) = messages.get(settled.count) else {
                continue;
            };
            if settled.stopped || settled.nack.is_some() {
                // Drained, not settled: the batch's end is what the processor still finishes.
                continue;
            }
            match disposition {
                Disposition::Ack => {
                    // Nothing to ask the broker: the offset is committed with the next batch.
                    let _ = self.pipeline.settle(message, &Disposition::Ack).await;
                    self.metrics.acked.increment(1);
                    settled.count += 1;
                }
                Disposition::Nack { after } => {
                    let _ = self.pipeline.settle(message, &Disposition::Nack { after }).await;
                    self.metrics.retried.increment(1);
                    settled.nack = Some(after);
                }
                Disposition::DeadLetter { reason } => {
                    // The partition moves on only once the copy is acknowledged: an
                    // unacknowledged one is produced again (the pipeline counts and logs it).
                    let dead = Disposition::DeadLetter { reason };
                    let mut failures = 0_u32;
                    while self.pipeline.settle(message, &dead).await.is_err() {
                        failures = failures.saturating_add(1);
                        held.hold();
                        if wait(self.options.dead_letter_backoff.delay(failures), stop)
                            .await
                            .is_none()
                        {
                            settled.stopped = true;
                            break;
                        }
                    }
                    if !settled.stopped {
                        self.metrics.dead_lettered.increment(1);
                        settled.count += 1;
                    }
                }
            }
        }
        settled
    }
}

/// What [`Shared::settle_decided`] settled of a batch.
#[derive(Debug, Default)]
struct Settled {
    /// The messages settled, from the batch's start.
    count: usize,
    /// The delay of the message after them, answered with `Nack`.
    nack: Option<Duration>,
    /// The partition was stopped while a dead letter waited for its acknowledgement.
    stopped: bool,
}

/// Messages settled and not yet committed, over `partitions`.
fn uncommitted(partitions: &HashMap<i32, Partition>) -> u64 {
    partitions
        .values()
        .map(|state| state.progress.uncommitted.load(Ordering::SeqCst))
        .sum()
}

/// Counts a partition as paused while it holds on one message.
struct Held<'a> {
    gauge: &'a metrics::Gauge,
    holding: bool,
}

impl Held<'_> {
    fn hold(&mut self) {
        if !self.holding {
            self.gauge.increment(1.0);
            self.holding = true;
        }
    }
}

impl Held<'_> {
    /// The partition moved on: it holds no more.
    fn release(&mut self) {
        if self.holding {
            self.gauge.decrement(1.0);
            self.holding = false;
        }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

/// Resolves once the partition is told to stop (or its poll thread is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

/// Waits `after`; `None` when the partition is stopped first.
async fn wait(after: Duration, stop: &mut watch::Receiver<bool>) -> Option<()> {
    tokio::select! {
        biased;
        () = stopped(stop) => None,
        () = tokio::time::sleep(after) => Some(()),
    }
}

/// What a fetched message counts for [`Worker::prefetch_bytes`]: its key and payload.
fn queued_size(message: &OwnedMessage) -> usize {
    message.key().map_or(0, <[u8]>::len) + message.payload().map_or(0, <[u8]>::len)
}
