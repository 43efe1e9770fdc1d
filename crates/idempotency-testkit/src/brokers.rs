//! The broker suite: one list of cases every broker adapter passes, on its real broker, through
//! the adapter's own URL and worker ([`SourceKind::run`]) — what the conformance suite is for
//! stores.
//!
//! A broker crate implements [`BrokerHarness`] in its tests (a fresh queue, stream or topic per
//! case, a way to publish, to read the dead letters and to count what is not yet acknowledged)
//! and expands [`adapter_suite!`](crate::adapter_suite) with it; a case is added once, in
//! [`__with_adapter_cases!`](crate::__with_adapter_cases) and as a function here, and runs on
//! every broker. `docs/WRITING-AN-ADAPTER.md` describes the contract the cases check.
//!
//! Handlers read what to do from the payload: `ok` succeeds, `fail:N` fails its first `N` calls
//! with a retryable error, `panic` panics every time, `sleep:MS` takes that long, `hold` waits
//! until the case lets it go.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_consumer::adapter::AdapterError;
use idempotency_consumer::source::{AnyProcessor, Shutdown, SourceKind, SourceSettings};
use idempotency_consumer::{Backoff, Consumer, Delivery, Disposition, Handler, HandlerError, Processor};
use idempotency_core::{Attempt, MemoryStore, Outcome};
use tokio::sync::Notify;

use crate::FaultyStore;
use crate::wait::eventually;

/// How long a case waits for what it expects before it fails.
pub const LIMIT: Duration = Duration::from_secs(60);

/// The lease of the suite's consumers: a worker killed mid-call is taken over after it.
pub const LEASE: Duration = Duration::from_secs(3);

/// After how many deliveries a failing message is dead-lettered.
pub const MAX_DELIVERIES: u32 = 3;

/// One case's own source on a broker: a queue with its retry and dead-letter queues, a stream
/// with its durable consumer, a topic with its group and dead-letter topic, a queue and its
/// dead-letter queue.
#[allow(async_fn_in_trait)] // used through generics, never as `dyn`
pub trait BrokerSource {
    /// The broker crate's [`SourceKind`] (its `SOURCE`).
    fn kind(&self) -> SourceKind;

    /// The URL a worker consumes this source from.
    fn url(&self) -> String;

    /// How long the broker lets a delivered message be before it hands it to another consumer
    /// unless its hold is renewed (JetStream's ack wait, SQS's visibility timeout), when it
    /// does; the URL sets it short, so that the suite sees a handler outlive it.
    fn hold(&self) -> Option<Duration>;

    /// Publishes `payload` with `key` as its `Idempotency-Key` (`None`: a message without one).
    async fn publish(&self, key: Option<&str>, payload: &[u8]);

    /// The dead letters so far, in the order they were dead-lettered.
    async fn dead_letters(&self) -> Vec<DeadLetter>;

    /// Messages of the source not yet acknowledged (or committed past).
    async fn outstanding(&self) -> u64;

    /// Makes the dead-letter destination refuse copies (`true`: a deleted queue, a subject no
    /// stream stores, a topic the client may not write to) or take them again (`false`). The
    /// suite reads no dead letters while it refuses.
    async fn refuse_dead_letters(&self, refuse: bool);

    /// Publishes a message as a producer outside this toolkit would: with `message`'s headers
    /// and no `Idempotency-Key`, its message id and record key where the broker's messages have
    /// them settable ([`BrokerSource::foreign_keys`]); the others are left out.
    async fn publish_foreign(&self, message: Foreign<'_>);

    /// Which of a foreign producer's keys this broker's messages carry, besides headers and the
    /// payload.
    fn foreign_keys(&self) -> ForeignKeys;

    /// Makes the broker stop answering the worker, its connections kept open (`true`: as a
    /// network that drops every packet, or a hung broker, would), or answer again (`false`).
    /// At least the confirmations of dead-letter copies must be held back while it stalls
    /// (a proxy that forwards nothing, a cluster whose dead-letter broker answers late); what
    /// was held arrives once it answers again, or later in the broker's own time.
    async fn stall(&self, stalled: bool);
}

/// A message of a producer outside this toolkit (Debezium, a Go or Java service, a Kafka
/// producer keying its records): its key, if it has one, is wherever that producer put it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Foreign<'a> {
    /// Headers (message attributes on SQS).
    pub headers: &'a [(&'a str, &'a str)],
    /// The broker's message id (RabbitMQ's `message_id`, NATS's `Nats-Msg-Id`), where the
    /// producer sets it.
    pub message_id: Option<&'a str>,
    /// The record key (Kafka's).
    pub record_key: Option<&'a str>,
    /// The payload.
    pub payload: &'a [u8],
}

/// A broker's message id, as a foreign producer meets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageIds {
    /// The producer sets it (RabbitMQ, NATS).
    Set,
    /// The broker assigns one to each message it is sent, the same on every delivery of it
    /// (SQS's `MessageId`).
    Assigned,
    /// The broker's messages have none (Kafka's records).
    Absent,
}

/// The keys a broker's messages carry besides headers and the payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForeignKeys {
    /// Its message ids.
    pub message_id: MessageIds,
    /// Whether its records have keys (Kafka).
    pub record_key: bool,
}

/// A dead letter as the broker holds it: its headers (message attributes on SQS), as text.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct DeadLetter {
    /// Every header, by name.
    pub headers: std::collections::BTreeMap<String, String>,
}

impl DeadLetter {
    /// A dead letter with these headers.
    pub fn new<N: Into<String>, V: Into<String>>(headers: impl IntoIterator<Item = (N, V)>) -> Self {
        Self {
            headers: headers.into_iter().map(|(n, v)| (n.into(), v.into())).collect(),
        }
    }

    /// The header `name`, or `""` if it has none.
    #[must_use]
    pub fn header(&self, name: &str) -> &str {
        self.headers.get(name).map_or("", String::as_str)
    }

    /// Its `Idempotency-Key`.
    #[must_use]
    pub fn key(&self) -> &str {
        self.header(idempotency_core::IDEMPOTENCY_KEY_HEADER)
    }

    /// Its `Idempotency-Dead-Reason`.
    #[must_use]
    pub fn reason(&self) -> &str {
        self.header(idempotency_consumer::DEAD_LETTER_REASON_HEADER)
    }
}

/// A broker the suite runs on.
#[allow(async_fn_in_trait)] // used through generics, never as `dyn`
pub trait BrokerHarness: Sync {
    /// Its sources.
    type Source: BrokerSource;

    /// A new, empty source for the case `case` (a name unique to the run is the harness's to
    /// add).
    async fn source(&self, case: &str) -> Self::Source;
}

/// What the suite's handlers did: calls per key (with their attempt numbers) and effects per
/// key.
#[derive(Debug, Default)]
pub struct Ledger {
    calls: Mutex<HashMap<String, Vec<u32>>>,
    effects: Mutex<HashMap<String, u32>>,
    /// `hold` payloads wait for this.
    pub release: Notify,
    /// Whether a `hold` call is waiting.
    pub holding: AtomicBool,
}

impl Ledger {
    /// The attempt numbers of `key`'s calls, in order.
    #[must_use]
    pub fn calls(&self, key: &str) -> Vec<u32> {
        self.calls.lock().unwrap().get(key).cloned().unwrap_or_default()
    }

    /// How many effects `key` had.
    #[must_use]
    pub fn effects(&self, key: &str) -> u32 {
        self.effects.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    /// Every key with an effect, and how many.
    #[must_use]
    pub fn all_effects(&self) -> HashMap<String, u32> {
        self.effects.lock().unwrap().clone()
    }
}

/// The suite's handler; see the [module docs](self) for the payloads it understands.
#[derive(Debug, Clone, Default)]
pub struct Charger(pub Arc<Ledger>);

impl<M: Delivery + Sync> Handler<M> for Charger {
    async fn handle(&self, message: &M, attempt: &Attempt) -> Result<Outcome, HandlerError> {
        let key = attempt.key().to_string();
        let call = {
            let mut calls = self.0.calls.lock().unwrap();
            let calls = calls.entry(key.clone()).or_default();
            calls.push(attempt.number());
            calls.len()
        };
        let payload = String::from_utf8_lossy(message.payload()).into_owned();
        if payload == "panic" {
            panic!("poison message: cannot parse {key}");
        }
        if let Some(failing) = payload
            .strip_prefix("fail:")
            .and_then(|n| n.parse::<usize>().ok())
            && call <= failing
        {
            return Err(HandlerError::retry(format!("gateway timeout on call {call}")));
        }
        if let Some(ms) = payload.strip_prefix("sleep:").and_then(|ms| ms.parse().ok()) {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        if payload == "hold" {
            let released = self.0.release.notified();
            self.0.holding.store(true, Ordering::SeqCst);
            released.await;
        }
        *self.0.effects.lock().unwrap().entry(key).or_default() += 1;
        Ok(Outcome::new(payload))
    }
}

/// The suite's consumer named `name` over `store`: the suite's lease, a short backoff, the
/// suite's delivery limit.
pub fn consumer(
    name: &str,
    store: &FaultyStore<MemoryStore>,
    charger: &Charger,
) -> Consumer<FaultyStore<MemoryStore>, Charger> {
    Consumer::new(name.to_owned(), store.clone(), charger.clone())
        .lease(LEASE)
        .backoff(Backoff {
            initial: Duration::from_millis(50),
            max: Duration::from_millis(500),
        })
        .max_deliveries(MAX_DELIVERIES)
}

/// Spawns `run` with a shutdown future, as a worker's `run_until` takes one, and returns the
/// sender that completes it (as SIGTERM would; dropping it does too) with the task.
pub fn spawn_until_stopped<T, F>(
    run: impl FnOnce(Shutdown) -> F,
) -> (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<T>)
where
    F: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(run(Box::pin(async move {
        let _ = stopped.await;
    })));
    (stop, task)
}

/// Stops a worker spawned by [`spawn_until_stopped`] (completes its shutdown, as SIGTERM
/// would) and waits for it to end: what its `run_until` returned. A task that panicked panics
/// here with the same message.
///
/// # Panics
///
/// If the task panicked or was aborted, or had already ended (its shutdown receiver gone)
/// before it was told to stop.
pub async fn stop_and_wait<T>(
    stop: tokio::sync::oneshot::Sender<()>,
    running: tokio::task::JoinHandle<T>,
) -> T {
    let told = stop.send(()).is_ok();
    let ended = running.await;
    match ended {
        Ok(ended) if told => ended,
        Ok(_) => panic!("the worker had ended before it was told to stop"),
        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
        Err(error) => panic!("the worker's task: {error}"),
    }
}

/// The partitions (`p0`, `p1`, …) of which a message other than the first ran, sorted, from
/// the keys run, named `p{partition}-{n}`: what a member of a group drained past the first
/// messages it ran before a rebalance.
pub fn drained_partitions(keys: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut partitions: Vec<String> = keys
        .into_iter()
        .filter(|key| !key.ends_with("-0"))
        .filter_map(|key| key.split('-').next().map(str::to_owned))
        .collect();
    partitions.sort();
    partitions.dedup();
    partitions
}

/// A worker consuming a source through its broker crate's URL and worker.
#[derive(Debug)]
pub struct Running {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), AdapterError>>,
}

impl Running {
    /// Starts a worker named `name` on `source` with `processor`.
    pub fn start(source: &impl BrokerSource, name: &str, processor: AnyProcessor) -> Self {
        // The process-wide recorder, installed before the worker registers its metrics.
        let _ = crate::recorded::global();
        let settings = SourceSettings::new(name)
            .concurrency(8)
            .prefetch(8)
            .handler_timeout(Duration::from_secs(10))
            .start_check(Duration::from_secs(20));
        let (stop, task) =
            spawn_until_stopped(|stopped| (source.kind().run)(source.url(), settings, processor, stopped));
        Self {
            stop: Some(stop),
            task,
        }
    }

    /// Asks the worker to stop (as SIGTERM does): it takes no more messages, lets the running
    /// ones settle, and returns; its answer is returned.
    ///
    /// # Panics
    ///
    /// If the worker's task panicked.
    pub async fn stop(mut self) -> Result<(), AdapterError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.task).await.expect("the worker's task")
    }

    /// Kills the worker: its task is dropped where it is, as a crash would leave it.
    pub async fn kill(mut self) {
        self.task.abort();
        let _ = (&mut self.task).await;
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A unique consumer name for a case on a broker, for its metrics' labels.
fn name(source: &impl BrokerSource, case: &str) -> String {
    format!("suite-{}-{case}", source.kind().name)
}

/// Waits until the broker has nothing of `source` unacknowledged.
async fn until_settled(source: &impl BrokerSource) {
    eventually(LIMIT, "every message acknowledged", async || {
        source.outstanding().await == 0
    })
    .await;
}

/// The settlements the pipeline counted for `consumer` (a name unique to the case and the
/// broker: see [`name`]) with `result`.
fn settled(consumer: &str, result: &str) -> u64 {
    crate::recorded::global().counter(
        "idempotency_consumer_settled_total",
        &[("consumer", consumer), ("result", result)],
    )
}

/// Every message published twice: one effect per key, every copy acked, each settlement counted
/// by the shared pipeline.
pub async fn every_message_sent_twice_has_one_effect(harness: &impl BrokerHarness) {
    let source = harness.source("twice").await;
    let name = name(&source, "twice");
    let (store, charger) = (FaultyStore::new(MemoryStore::new()), Charger::default());
    let worker = Running::start(
        &source,
        &name,
        AnyProcessor::new(consumer(&name, &store, &charger)),
    );
    let keys: Vec<String> = (0..10).map(|n| format!("twice-{n}")).collect();
    for _ in 0..2 {
        for key in &keys {
            source.publish(Some(key), b"ok").await;
        }
    }
    eventually(LIMIT, "every copy acked", async || settled(&name, "acked") >= 20).await;
    until_settled(&source).await;
    worker.stop().await.expect("the worker stops cleanly");
    for key in &keys {
        assert_eq!(charger.0.effects(key), 1, "{key}");
        assert_eq!(charger.0.calls(key), [1], "{key}");
    }
    assert!(source.dead_letters().await.is_empty());
}

/// A processor that stops dead after its inner processor recorded the outcome of the message
/// whose key is `crash`, before the broker hears of it: the case then kills the worker.
struct CrashAfterRecord<P> {
    inner: P,
    recorded: Arc<Notify>,
    armed: AtomicBool,
}

impl<P: Processor<M>, M: Delivery + Sync> Processor<M> for CrashAfterRecord<P> {
    async fn process(&self, message: &M) -> Disposition {
        let disposition = self.inner.process(message).await;
        let crash = message.header(idempotency_core::IDEMPOTENCY_KEY_HEADER) == Some(b"crash".as_slice());
        if crash && disposition == Disposition::Ack && self.armed.swap(false, Ordering::SeqCst) {
            self.recorded.notify_one();
            std::future::pending::<()>().await;
        }
        disposition
    }
}

/// The worker dies after the outcome is recorded and before the broker acknowledged the
/// message: the message comes back to the next worker, which acks it from the record without
/// running the handler again.
pub async fn a_crash_after_the_record_and_before_the_ack_runs_nothing_twice(harness: &impl BrokerHarness) {
    let source = harness.source("crash").await;
    let name = name(&source, "crash");
    let (store, charger) = (FaultyStore::new(MemoryStore::new()), Charger::default());
    let recorded = Arc::new(Notify::new());
    let crashing = CrashAfterRecord {
        inner: consumer(&name, &store, &charger),
        recorded: Arc::clone(&recorded),
        armed: AtomicBool::new(true),
    };
    let first = Running::start(&source, &name, AnyProcessor::new(crashing));
    let waiting = recorded.notified();
    source.publish(Some("crash"), b"ok").await;
    tokio::time::timeout(LIMIT, waiting)
        .await
        .expect("the outcome recorded");
    first.kill().await;
    assert_eq!(charger.0.effects("crash"), 1);
    let second = Running::start(
        &source,
        &name,
        AnyProcessor::new(consumer(&name, &store, &charger)),
    );
    until_settled(&source).await;
    second.stop().await.expect("the worker stops cleanly");
    assert_eq!(charger.0.calls("crash"), [1], "the handler ran again");
    assert_eq!(charger.0.effects("crash"), 1);
}

/// The worker dies while the handler runs, before its outcome is recorded: the message was not
/// acknowledged, so it comes back to the next worker, which waits out the dead attempt's lease
/// and runs it as attempt 2. A worker that acknowledged before recording would have lost it.
pub async fn a_worker_killed_mid_call_leaves_the_message_to_the_next(harness: &impl BrokerHarness) {
    let source = harness.source("killed").await;
    let name = name(&source, "killed");
    let (store, charger) = (FaultyStore::new(MemoryStore::new()), Charger::default());
    let first = Running::start(
        &source,
        &name,
        AnyProcessor::new(consumer(&name, &store, &charger)),
    );
    source.publish(Some("killed"), b"hold").await;
    eventually(LIMIT, "the call started", async || {
        charger.0.holding.load(Ordering::SeqCst)
    })
    .await;
    first.kill().await;
    assert_eq!(charger.0.effects("killed"), 0);
    // The next worker's call does not hold: `hold` waits for a release that comes at once.
    charger.0.holding.store(false, Ordering::SeqCst);
    let second = Running::start(
        &source,
        &name,
        AnyProcessor::new(consumer(&name, &store, &charger)),
    );
    eventually(LIMIT, "the message run again", async || {
        if charger.0.holding.load(Ordering::SeqCst) {
            charger.0.release.notify_one();
        }
        charger.0.effects("killed") == 1
    })
    .await;
    until_settled(&source).await;
    second.stop().await.expect("the worker stops cleanly");
    assert_eq!(charger.0.calls("killed"), [1, 2], "the retry is attempt 2");
}

/// A handler three times as long as the broker's hold on its message (or 3 s where the broker
/// holds it for as long as the consumer lives): the handler runs once, and where the hold is
/// finite it is renewed while the call runs (counted by the pipeline). The renewal count is
/// what shows a broker whose hold is not renewed: the store alone keeps a second copy from
/// running, and whether a copy is handed out again depends on how fast the broker answers.
pub async fn a_handler_longer_than_the_brokers_hold_runs_once(harness: &impl BrokerHarness) {
    let source = harness.source("long").await;
    let name = name(&source, "long");
    let (store, charger) = (FaultyStore::new(MemoryStore::new()), Charger::default());
    let worker = Running::start(
        &source,
        &name,
        AnyProcessor::new(consumer(&name, &store, &charger)),
    );
    let takes = source.hold().unwrap_or(Duration::from_secs(1)) * 3;
    let payload = format!("sleep:{}", takes.as_millis());
    source.publish(Some("long"), payload.as_bytes()).await;
    eventually(LIMIT, "the long call recorded", async || {
        charger.0.effects("long") == 1
    })
    .await;
    until_settled(&source).await;
    worker.stop().await.expect("the worker stops cleanly");
    assert_eq!(charger.0.calls("long"), [1], "run again while it ran");
    if source.hold().is_some() {
        let kept = crate::recorded::global().counter(
            "idempotency_consumer_keep_alives_total",
            &[("consumer", name.as_str()), ("result", "ok")],
        );
        assert!(kept >= 2, "the hold was renewed {kept} times");
    }
}

/// A handler failing twice, then succeeding: called three times (attempts 1, 2, 3), one
/// effect, nothing dead-lettered.
pub async fn failing_twice_then_succeeding_is_retried_not_dead_lettered(harness: &impl BrokerHarness) {
    let source = harness.source("flaky").await;
    let name = name(&source, "flaky");
    let (store, charger) = (FaultyStore::new(MemoryStore::new()), Charger::default());
    let worker = Running::start(
        &source,
        &name,
        AnyProcessor::new(consumer(&name, &store, &charger)),
    );
    source.publish(Some("flaky"), b"fail:2").await;
    eventually(LIMIT, "the third call succeeded", async || {
        charger.0.effects("flaky") == 1
    })
    .await;
    until_settled(&source).await;
    worker.stop().await.expect("the worker stops cleanly");
    assert_eq!(charger.0.calls("flaky"), [1, 2, 3]);
    assert!(source.dead_letters().await.is_empty(), "dead-lettered");
}

/// A message without a key and a key reused with another payload are dead-lettered with their
/// reasons; the first use of the key runs once.
pub async fn missing_and_reused_keys_are_dead_lettered_with_their_reasons(harness: &impl BrokerHarness) {
    let source = harness.source("bad").await;
    let name = name(&source, "bad");
    let (store, charger) = (FaultyStore::new(MemoryStore::new()), Charger::default());
    let worker = Running::start(
        &source,
        &name,
        AnyProcessor::new(consumer(&name, &store, &charger)),
    );
    source.publish(None, b"ok").await;
    source.publish(Some("reused"), b"ok").await;
    eventually(LIMIT, "the first use recorded", async || {
        charger.0.effects("reused") == 1
    })
    .await;
    source.publish(Some("reused"), b"sleep:1").await;
    let dead = wait_for_dead_letters(&source, 2).await;
    until_settled(&source).await;
    worker.stop().await.expect("the worker stops cleanly");
    let mut dead: Vec<(&str, &str)> = dead.iter().map(|d| (d.key(), d.reason())).collect();
    // Dead letters are at least once, like deliveries: where the broker's hold ran out while
    // a slow server took the copy (SQS's visibility), a message may be dead-lettered twice.
    dead.sort_unstable();
    dead.dedup();
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert_eq!(dead[0], ("", "no Idempotency-Key header"), "{dead:?}");
    assert_eq!(dead[1].0, "reused", "{dead:?}");
    assert!(
        dead[1].1.contains("was first used with a different payload"),
        "{dead:?}"
    );
    assert_eq!(charger.0.calls("reused"), [1]);
}

/// Messages of producers outside this toolkit, keyed by a header of theirs, a member of their
/// JSON payload, the broker's message id or the record key (where the broker has them): each
/// key runs once however often it is sent (or, for an id the broker assigns, however often
/// it is delivered), and a message without the key, or whose payload is not JSON, is
/// dead-lettered with the reason.
pub async fn keys_from_producers_outside_the_toolkit_run_once(harness: &impl BrokerHarness) {
    use idempotency_consumer::KeySource;
    let pointer = idempotency_core::JsonPointer::new("/order/id").expect("a pointer");
    let probe = harness.source("foreign").await;
    let keys = probe.foreign_keys();
    drop(probe);
    let mut sources = vec![
        ("foreign-header", KeySource::Header("X-Request-Id".into())),
        ("foreign-json", KeySource::JsonPointer(pointer)),
    ];
    if keys.message_id != MessageIds::Absent {
        sources.push(("foreign-id", KeySource::MessageId));
    }
    if keys.record_key {
        sources.push(("foreign-record", KeySource::RecordKey));
    }
    for (case, key_source) in sources {
        let source = harness.source(case).await;
        let name = name(&source, case);
        let (store, charger) = (FaultyStore::new(MemoryStore::new()), Charger::default());
        let consumer = consumer(&name, &store, &charger).keys(key_source.clone());
        let worker = Running::start(&source, &name, AnyProcessor::new(consumer));
        let keyed = |key: &'static str| match &key_source {
            KeySource::Header(_) => Foreign {
                headers: if key == "ext-1" {
                    &[("X-Request-Id", "ext-1"), ("Content-Type", "text/plain")]
                } else {
                    &[("X-Request-Id", "ext-2"), ("Content-Type", "text/plain")]
                },
                payload: b"ok",
                ..Foreign::default()
            },
            KeySource::JsonPointer(_) => Foreign {
                payload: if key == "ext-1" {
                    br#"{"order":{"id":"ext-1"},"amount":10}"#
                } else {
                    br#"{"order":{"id":"ext-2"},"amount":20}"#
                },
                ..Foreign::default()
            },
            KeySource::RecordKey => Foreign {
                record_key: Some(key),
                payload: b"ok",
                ..Foreign::default()
            },
            _ => Foreign {
                message_id: Some(key),
                payload: b"ok",
                ..Foreign::default()
            },
        };
        let (missing, expected) = match &key_source {
            KeySource::Header(_) => (
                vec![Foreign {
                    headers: &[("Content-Type", "text/plain")],
                    payload: b"ok",
                    ..Foreign::default()
                }],
                vec!["no X-Request-Id header"],
            ),
            KeySource::JsonPointer(_) => (
                vec![
                    Foreign {
                        payload: br#"{"order":{},"amount":30}"#,
                        ..Foreign::default()
                    },
                    Foreign {
                        payload: b"amount=40",
                        ..Foreign::default()
                    },
                ],
                vec![
                    "invalid key in the JSON payload's member /order/id: the payload is not JSON",
                    "no key at /order/id in the JSON payload",
                ],
            ),
            KeySource::RecordKey => (
                vec![Foreign {
                    payload: b"ok",
                    ..Foreign::default()
                }],
                vec!["no record key"],
            ),
            _ if keys.message_id == MessageIds::Set => (
                vec![Foreign {
                    payload: b"ok",
                    ..Foreign::default()
                }],
                vec!["no message id"],
            ),
            // Every message has one: nothing to dead-letter.
            _ => (Vec::new(), Vec::new()),
        };
        if keys.message_id == MessageIds::Assigned && matches!(key_source, KeySource::MessageId) {
            // The id is the broker's, one per send: a message whose first call fails is run
            // again under the same key, as attempt 2, and has one effect.
            source
                .publish_foreign(Foreign {
                    payload: b"fail:1",
                    ..Foreign::default()
                })
                .await;
            eventually(LIMIT, "one effect under the broker's id", async || {
                charger.0.all_effects().values().sum::<u32>() == 1
            })
            .await;
            let effects = charger.0.all_effects();
            let (key, _) = effects.iter().next().expect("one key");
            assert_eq!(charger.0.calls(key), [1, 2], "{case}");
        } else {
            for key in ["ext-1", "ext-2", "ext-1", "ext-2"] {
                source.publish_foreign(keyed(key)).await;
            }
            for message in &missing {
                source.publish_foreign(*message).await;
            }
            let what = format!("{case}: both keys run");
            eventually(LIMIT, &what, async || {
                charger.0.effects("ext-1") == 1 && charger.0.effects("ext-2") == 1
            })
            .await;
        }
        let dead = wait_for_dead_letters(&source, expected.len()).await;
        until_settled(&source).await;
        worker.stop().await.expect("the worker stops cleanly");
        let mut reasons: Vec<&str> = dead.iter().map(DeadLetter::reason).collect();
        reasons.sort_unstable();
        reasons.dedup();
        assert_eq!(reasons.len(), expected.len(), "{case}: {reasons:?}");
        for (reason, expected) in reasons.iter().zip(&expected) {
            assert!(
                reason.starts_with(expected),
                "{case}: {reason:?} is not {expected:?}"
            );
        }
        let effects: u32 = charger.0.all_effects().values().sum();
        let runs = if expected.is_empty() && keys.message_id == MessageIds::Assigned {
            1
        } else {
            2
        };
        assert_eq!(
            effects,
            runs,
            "{case}: one effect per key, {:?}",
            charger.0.all_effects()
        );
    }
}

/// A message whose handler panics every time is dead-lettered after the delivery limit with a
/// reason starting `panic:` and what an operator needs beside it (where from, after how many
/// deliveries, when), and the worker goes on with the next message.
pub async fn a_poison_message_is_dead_lettered_and_the_worker_goes_on(harness: &impl BrokerHarness) {
    let source = harness.source("poison").await;
    let name = name(&source, "poison");
    let (store, charger) = (FaultyStore::new(MemoryStore::new()), Charger::default());
    let worker = Running::start(
        &source,
        &name,
        AnyProcessor::new(consumer(&name, &store, &charger)),
    );
    source.publish(Some("poison"), b"panic").await;
    let dead = wait_for_dead_letters(&source, 1).await;
    assert_eq!(dead[0].key(), "poison");
    assert!(dead[0].reason().starts_with("panic:"), "{dead:?}");
    assert!(
        dead[0].reason().contains("poison message: cannot parse poison"),
        "{dead:?}"
    );
    assert_dead_letter_history(&dead[0]);
    // At least the limit: a broker whose hold ran out while the worker was slow (SQS's
    // visibility, with a busy server) may deliver a copy once more around the dead-lettering.
    let calls = charger.0.calls("poison").len();
    assert!(
        calls >= MAX_DELIVERIES as usize,
        "dead-lettered after {calls} calls"
    );
    assert_eq!(charger.0.effects("poison"), 0);
    source.publish(Some("after"), b"ok").await;
    eventually(LIMIT, "the next message handled", async || {
        charger.0.effects("after") == 1
    })
    .await;
    until_settled(&source).await;
    worker.stop().await.expect("the worker stops cleanly");
}

/// While the store is unreachable, nothing runs and nothing is acked or lost: the messages come
/// back (twenty nacks, over more than a second of backoff), the worker is killed mid-outage,
/// and once the store is up the next worker runs each message once. A worker that acknowledged
/// (or, on Kafka, committed) a message before its outcome was recorded would have lost it here.
pub async fn the_store_unreachable_nacks_and_loses_nothing(harness: &impl BrokerHarness) {
    let source = harness.source("outage").await;
    let name = name(&source, "outage");
    let (store, charger) = (FaultyStore::new(MemoryStore::new()), Charger::default());
    store.set_down(true);
    let first = Running::start(
        &source,
        &name,
        AnyProcessor::new(consumer(&name, &store, &charger)),
    );
    let keys: Vec<String> = (0..5).map(|n| format!("outage-{n}")).collect();
    for key in &keys {
        source.publish(Some(key), b"ok").await;
    }
    eventually(LIMIT, "twenty nacks while the store is down", async || {
        settled(&name, "nacked") >= 20
    })
    .await;
    assert!(charger.0.all_effects().is_empty(), "ran without its record");
    first.kill().await;
    let second = Running::start(
        &source,
        &name,
        AnyProcessor::new(consumer(&name, &store, &charger)),
    );
    store.set_down(false);
    eventually(LIMIT, "every message handled", async || {
        keys.iter().all(|key| charger.0.effects(key) == 1)
    })
    .await;
    until_settled(&source).await;
    second.stop().await.expect("the worker stops cleanly");
    assert!(source.dead_letters().await.is_empty(), "dead-lettered");
    for key in &keys {
        assert_eq!(charger.0.calls(key), [1], "{key}");
    }
}

/// A shutdown while a handler runs: the worker takes no more messages, lets the call finish,
/// records and acknowledges it, then returns; the broker has nothing left.
pub async fn a_shutdown_lets_the_running_call_finish_and_settles_it(harness: &impl BrokerHarness) {
    let source = harness.source("drain").await;
    let name = name(&source, "drain");
    let (store, charger) = (FaultyStore::new(MemoryStore::new()), Charger::default());
    let worker = Running::start(
        &source,
        &name,
        AnyProcessor::new(consumer(&name, &store, &charger)),
    );
    source.publish(Some("drain"), b"hold").await;
    eventually(LIMIT, "the call started", async || {
        charger.0.holding.load(Ordering::SeqCst)
    })
    .await;
    // The worker is told to stop first; the call finishes after.
    let stopping = tokio::spawn(worker.stop());
    charger.0.release.notify_one();
    tokio::time::timeout(LIMIT, stopping)
        .await
        .expect("the worker stops after the call")
        .expect("the worker's task")
        .expect("the worker stops cleanly");
    assert_eq!(charger.0.effects("drain"), 1);
    until_settled(&source).await;
}

/// The broker stops answering just as a message is dead-lettered (a reused key): the copy's
/// confirmation does not come. The settlement is given up after the pipeline's settle timeout
/// and counted as failed, rather than holding the message's task for ever; once the broker
/// answers again, the message, never acknowledged, comes back and is dead-lettered. The key's
/// first use ran once and nothing is left outstanding. A broker adapter that waited for the
/// confirmation without a bound never counts the failure, and the case fails waiting for it.
pub async fn a_settlement_the_broker_never_answers_is_given_up_and_the_message_comes_back(
    harness: &impl BrokerHarness,
) {
    let source = harness.source("stall").await;
    let name = name(&source, "stall");
    let (store, charger) = (FaultyStore::new(MemoryStore::new()), Charger::default());
    let worker = Running::start(
        &source,
        &name,
        AnyProcessor::new(consumer(&name, &store, &charger)),
    );
    source.publish(Some("stalled"), b"ok").await;
    eventually(LIMIT, "the first use acked", async || {
        settled(&name, "acked") >= 1
    })
    .await;
    // The reused key's claim is held at the store until the broker stalls: its dead-letter
    // copy is the first thing the worker sends after that.
    let claims = store.calls(crate::faults::Op::Begin);
    let gate = store.hold_next(crate::faults::Op::Begin);
    source.publish(Some("stalled"), b"other").await;
    eventually(LIMIT, "the reused key's claim at the store", async || {
        store.calls(crate::faults::Op::Begin) > claims
    })
    .await;
    source.stall(true).await;
    gate.open();
    eventually(LIMIT, "the unanswered settlement given up", async || {
        settled(&name, "failed") >= 1
    })
    .await;
    source.stall(false).await;
    let dead = wait_for_dead_letters(&source, 1).await;
    until_settled(&source).await;
    worker.stop().await.expect("the worker stops cleanly");
    // At least once: the copy sent while the broker stalled may land as well as the next one.
    assert!(
        dead.iter()
            .all(|d| d.key() == "stalled" && d.reason().contains("was first used with a different payload")),
        "{dead:?}"
    );
    assert_eq!(charger.0.calls("stalled"), [1]);
    assert_eq!(charger.0.effects("stalled"), 1);
}

/// Not in the suite (Kafka decides a partition's messages in order, one batch at a time; SQS
/// one receive at a time): on a broker of independent messages (RabbitMQ, JetStream), a batch
/// whose claims wait for the store does not hold the next batch back. The first message's
/// claim is held at the store until the messages published after it have run: they can only
/// have run in a second batch in flight beside the first ([`BatchPlan`]). A worker that
/// decides one batch at a time never runs them, and the case fails waiting.
///
/// [`BatchPlan`]: idempotency_consumer::adapter::BatchPlan
pub async fn a_batch_waiting_for_the_store_does_not_hold_the_next_back(harness: &impl BrokerHarness) {
    let source = harness.source("overlap").await;
    let name = name(&source, "overlap");
    let (store, charger) = (FaultyStore::new(MemoryStore::new()), Charger::default());
    let gate = store.hold_next(crate::faults::Op::Begin);
    let worker = Running::start(
        &source,
        &name,
        AnyProcessor::new(consumer(&name, &store, &charger)),
    );
    source.publish(Some("overlap-held"), b"ok").await;
    eventually(LIMIT, "the first batch's claim at the store", async || {
        store.calls(crate::faults::Op::Begin) >= 1
    })
    .await;
    let next: Vec<String> = (0..3).map(|n| format!("overlap-next-{n}")).collect();
    for key in &next {
        source.publish(Some(key), b"ok").await;
    }
    eventually(
        LIMIT,
        "the later messages run while the first batch waits for the store",
        async || next.iter().all(|key| charger.0.effects(key) == 1),
    )
    .await;
    assert_eq!(charger.0.effects("overlap-held"), 0, "the held claim ran");
    gate.open();
    eventually(
        LIMIT,
        "the held message runs once its claim goes through",
        async || charger.0.effects("overlap-held") == 1,
    )
    .await;
    until_settled(&source).await;
    worker.stop().await.expect("the worker stops cleanly");
    for key in next.iter().map(String::as_str).chain(["overlap-held"]) {
        assert_eq!(charger.0.calls(key), [1], "{key}");
    }
}

/// A dead letter names its source, how often it was delivered (at least the limit) and when it
/// was dead-lettered (an HTTP date).
fn assert_dead_letter_history(dead: &DeadLetter) {
    use idempotency_consumer::{
        DEAD_LETTER_AT_HEADER, DEAD_LETTER_DELIVERIES_HEADER, DEAD_LETTER_SOURCE_HEADER,
    };
    assert!(!dead.header(DEAD_LETTER_SOURCE_HEADER).is_empty(), "{dead:?}");
    let deliveries: u32 = dead.header(DEAD_LETTER_DELIVERIES_HEADER).parse().unwrap_or(0);
    assert!(deliveries >= MAX_DELIVERIES, "{dead:?}");
    assert!(
        httpdate::parse_http_date(dead.header(DEAD_LETTER_AT_HEADER)).is_ok(),
        "{dead:?}"
    );
}

/// Ten keys, each published three times, consumed by four workers at once: one effect per key,
/// every copy acknowledged.
pub async fn a_storm_of_duplicates_across_four_workers_has_one_effect_per_key(harness: &impl BrokerHarness) {
    let source = harness.source("storm").await;
    let name = name(&source, "storm");
    let (store, charger) = (FaultyStore::new(MemoryStore::new()), Charger::default());
    let keys: Vec<String> = (0..10).map(|n| format!("storm-{n}")).collect();
    for _ in 0..3 {
        for key in &keys {
            source.publish(Some(key), b"sleep:20").await;
        }
    }
    let workers: Vec<Running> = (0..4)
        .map(|_| {
            Running::start(
                &source,
                &name,
                AnyProcessor::new(consumer(&name, &store, &charger)),
            )
        })
        .collect();
    eventually(LIMIT, "every copy acked", async || settled(&name, "acked") >= 30).await;
    until_settled(&source).await;
    for worker in workers {
        worker.stop().await.expect("the worker stops cleanly");
    }
    for key in &keys {
        assert_eq!(charger.0.effects(key), 1, "{key}");
    }
    assert_eq!(charger.0.all_effects().len(), keys.len());
    assert!(source.dead_letters().await.is_empty());
}

/// A handler that fails every call with a retryable error: retried with backoff up to the
/// delivery limit, then dead-lettered with the handler's last error as the reason and its
/// history; never run past the limit, never an effect.
pub async fn failing_every_time_is_dead_lettered_after_the_limit_with_the_reason(
    harness: &impl BrokerHarness,
) {
    let source = harness.source("hopeless").await;
    let name = name(&source, "hopeless");
    let (store, charger) = (FaultyStore::new(MemoryStore::new()), Charger::default());
    let worker = Running::start(
        &source,
        &name,
        AnyProcessor::new(consumer(&name, &store, &charger)),
    );
    source.publish(Some("hopeless"), b"fail:1000").await;
    let dead = wait_for_dead_letters(&source, 1).await;
    until_settled(&source).await;
    worker.stop().await.expect("the worker stops cleanly");
    // One dead letter, or a second copy where the broker's hold ran out while a slow server
    // took the first one (SQS's visibility): dead letters are at least once, like deliveries.
    assert!(dead.iter().all(|d| d.key() == "hopeless"), "{dead:?}");
    let reason = dead[0].reason();
    assert!(reason.starts_with("failed "), "{dead:?}");
    assert!(reason.contains("gateway timeout on call"), "{dead:?}");
    assert_dead_letter_history(&dead[0]);
    let calls = charger.0.calls("hopeless");
    assert!(
        calls.len() >= MAX_DELIVERIES as usize,
        "dead-lettered after {calls:?}"
    );
    assert_eq!(charger.0.effects("hopeless"), 0);
}

/// The dead-letter destination refuses the copy: the settlement fails (and is counted), the
/// message is not acknowledged and comes back, again and again; once the destination takes
/// copies, it is dead-lettered with its reason and acknowledged. A worker that let go of a
/// message whose copy was not confirmed would have lost it here.
pub async fn a_dead_letter_copy_refused_leaves_the_message_on_its_source(harness: &impl BrokerHarness) {
    let source = harness.source("refused").await;
    let name = name(&source, "refused");
    let (store, charger) = (FaultyStore::new(MemoryStore::new()), Charger::default());
    let worker = Running::start(
        &source,
        &name,
        AnyProcessor::new(consumer(&name, &store, &charger)),
    );
    // Refused once the worker runs: at its start it checks that the destination exists.
    source.publish(Some("first"), b"ok").await;
    eventually(LIMIT, "the worker running", async || {
        charger.0.effects("first") == 1
    })
    .await;
    source.refuse_dead_letters(true).await;
    source.publish(None, b"ok").await;
    // The one message failing twice: it came back after the first failure. (A broker that
    // let it go after a confirmed-but-dropped copy counts no failure at all.)
    eventually(LIMIT, "two failed settlements", async || {
        settled(&name, "failed") >= 2
    })
    .await;
    source.refuse_dead_letters(false).await;
    // Kept, not lost: it is dead-lettered once the destination takes copies.
    let dead = wait_for_dead_letters(&source, 1).await;
    until_settled(&source).await;
    worker.stop().await.expect("the worker stops cleanly");
    assert!(
        dead.iter().all(|d| d.reason() == "no Idempotency-Key header"),
        "{dead:?}"
    );
}

/// Waits until `source` has at least `count` dead letters; returns them.
async fn wait_for_dead_letters(source: &impl BrokerSource, count: usize) -> Vec<DeadLetter> {
    let mut dead = Vec::new();
    eventually(LIMIT, "the dead letters", async || {
        dead = source.dead_letters().await;
        dead.len() >= count
    })
    .await;
    dead
}

/// Expands to the broker suite for the harness expression `$harness`: one test per case.
#[macro_export]
macro_rules! adapter_suite {
    ($harness:expr) => {
        $crate::__with_adapter_cases!($crate::__adapter_case_tests!($harness));
    };
}

/// **The one list of broker cases**: calls `$callback!` with its tokens, a `;`, then every
/// case's name (a function of [`brokers`](crate::brokers)). A case listed here runs on every
/// broker.
#[doc(hidden)]
#[macro_export]
macro_rules! __with_adapter_cases {
    ($($callback:ident)::+ ! ( $($args:tt)* )) => {
        $($callback)::+! {
            $($args)*;
            every_message_sent_twice_has_one_effect,
            a_crash_after_the_record_and_before_the_ack_runs_nothing_twice,
            a_worker_killed_mid_call_leaves_the_message_to_the_next,
            a_handler_longer_than_the_brokers_hold_runs_once,
            failing_twice_then_succeeding_is_retried_not_dead_lettered,
            missing_and_reused_keys_are_dead_lettered_with_their_reasons,
            keys_from_producers_outside_the_toolkit_run_once,
            a_poison_message_is_dead_lettered_and_the_worker_goes_on,
            failing_every_time_is_dead_lettered_after_the_limit_with_the_reason,
            a_storm_of_duplicates_across_four_workers_has_one_effect_per_key,
            a_dead_letter_copy_refused_leaves_the_message_on_its_source,
            a_settlement_the_broker_never_answers_is_given_up_and_the_message_comes_back,
            the_store_unreachable_nacks_and_loses_nothing,
            a_shutdown_lets_the_running_call_finish_and_settles_it,
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __adapter_case_tests {
    ($harness:expr; $($case:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                $crate::brokers::$case(&$harness).await;
            }
        )*
    };
}
