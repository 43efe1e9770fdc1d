//! Idempotent consumption against the real NATS JetStream server (`NATS_URL`, default
//! `nats://127.0.0.1:4222`, which `scripts/services` starts): a crash before the ack, a storm of
//! duplicates across ten consumers, retries with backoff, dead-lettering with reasons, a
//! store outage, a poison message, progress acks under a slow handler, and publish dedup.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer::PullConsumer};
use bytes::Bytes;
use futures_util::StreamExt;
use idempotency_consumer::{Backoff, Consumer, Delivery, Disposition, Handler, HandlerError, Processor};
use idempotency_core::{Attempt, Key, MemoryStore, Outcome};
use idempotency_nats::{DEAD_REASON_HEADER, NatsMessage, process, publish, replay_dead_letters};
use idempotency_testkit::FaultyStore;

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

struct Setup {
    js: jetstream::Context,
    stream: String,
    work: String,
    dead: String,
    workers: PullConsumer,
}

impl Setup {
    async fn new() -> Self {
        let client = async_nats::connect(nats_url())
            .await
            .unwrap_or_else(|e| panic!("NATS JetStream at {} is needed for this test: {e}", nats_url()));
        let js = jetstream::new(client);
        let id = Key::generate().as_str().replace('-', "");
        let stream = format!("IDEM_{id}");
        let (work, dead) = (format!("idem.{id}.work"), format!("idem.{id}.dead"));
        let created = js
            .create_stream(jetstream::stream::Config {
                name: stream.clone(),
                subjects: vec![work.clone(), dead.clone()],
                duplicate_window: Duration::from_secs(60),
                max_age: Duration::from_secs(600),
                ..Default::default()
            })
            .await
            .unwrap();
        let workers = created
            .create_consumer(jetstream::consumer::pull::Config {
                durable_name: Some("workers".into()),
                filter_subject: work.clone(),
                ack_wait: Duration::from_secs(1),
                ..Default::default()
            })
            .await
            .unwrap();
        Self {
            js,
            stream,
            work,
            dead,
            workers,
        }
    }

    /// Dead-lettered messages: (key, reason, source, deliveries, when).
    async fn dead_letters(&self, expected: usize) -> Vec<(String, String, String, String, String)> {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        let reader: PullConsumer = stream
            .create_consumer(jetstream::consumer::pull::Config {
                filter_subject: self.dead.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        let mut found = Vec::new();
        let mut batch = reader
            .fetch()
            .max_messages(expected.max(1))
            .expires(Duration::from_secs(2))
            .messages()
            .await
            .unwrap();
        while let Some(Ok(message)) = batch.next().await {
            let headers = message.headers.clone().unwrap_or_default();
            let header = |name: &str| {
                headers
                    .get(name)
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default()
            };
            found.push((
                header("Idempotency-Key"),
                header(DEAD_REASON_HEADER),
                header("Idempotency-Dead-Source"),
                header("Idempotency-Dead-Deliveries"),
                header("Idempotency-Dead-At"),
            ));
            message.ack().await.unwrap();
        }
        found
    }

    /// Whether every work message has been settled.
    async fn drained(&self) -> bool {
        let mut workers = self.workers.clone();
        let info = workers.info().await.unwrap();
        info.num_pending == 0 && info.num_ack_pending == 0
    }

    async fn cleanup(self) {
        let _ = self.js.delete_stream(&self.stream).await;
    }
}

/// Charges once per successful call; counts side effects per key.
#[derive(Default)]
struct Charger {
    charges: Mutex<HashMap<String, u32>>,
    calls: AtomicU32,
    fail_first: u32,
    /// How long each call takes.
    hold: Duration,
    /// The key whose every call panics, and how many calls it got.
    poison: Option<&'static str>,
    poison_calls: AtomicU32,
}

impl Handler<NatsMessage> for Charger {
    async fn handle(&self, message: &NatsMessage, attempt: &Attempt) -> Result<Outcome, HandlerError> {
        if self.poison == Some(attempt.key().as_str()) {
            self.poison_calls.fetch_add(1, Ordering::SeqCst);
            panic!("poison message: cannot parse the payment");
        }
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        tokio::time::sleep(self.hold).await;
        if call <= self.fail_first {
            return Err(HandlerError::retry(format!("gateway timeout on call {call}")));
        }
        *self
            .charges
            .lock()
            .unwrap()
            .entry(attempt.key().to_string())
            .or_default() += 1;
        Ok(Outcome::new(message.message().payload.clone()))
    }
}

type TestConsumer = Consumer<FaultyStore<MemoryStore>, Arc<Charger>>;

fn consumer(charger: &Arc<Charger>, store: &FaultyStore<MemoryStore>) -> Arc<TestConsumer> {
    Arc::new(
        Consumer::new("nats-tests", store.clone(), Arc::clone(charger))
            .backoff(Backoff {
                initial: Duration::from_millis(100),
                max: Duration::from_secs(1),
            })
            .max_deliveries(4),
    )
}

/// Runs a worker on the durable consumer until `stop`.
fn worker(setup: &Setup, consumer: Arc<TestConsumer>, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<()> {
    let (workers, js, dead) = (setup.workers.clone(), setup.js.clone(), setup.dead.clone());
    tokio::spawn(async move {
        let mut messages = workers.messages().await.unwrap();
        while !stop.load(Ordering::SeqCst) {
            if let Ok(Some(Ok(message))) =
                tokio::time::timeout(Duration::from_millis(100), messages.next()).await
            {
                let _ = process(&consumer, &js, &dead, message, Duration::from_millis(300)).await;
            }
        }
    })
}

async fn publish_copy(
    js: &jetstream::Context,
    subject: &str,
    key: Option<&str>,
    msg_id: &str,
    payload: &str,
) {
    let mut headers = HeaderMap::new();
    if let Some(key) = key {
        headers.insert("Idempotency-Key", key);
    }
    headers.insert("Nats-Msg-Id", msg_id);
    js.publish_with_headers(subject.to_owned(), headers, Bytes::from(payload.to_owned()))
        .await
        .unwrap()
        .await
        .unwrap();
}

async fn until(mut done: impl AsyncFnMut() -> bool, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        if done().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_before_the_ack_is_redelivered_and_not_run_again() {
    let setup = Setup::new().await;
    let (charger, store) = (Arc::new(Charger::default()), FaultyStore::new(MemoryStore::new()));
    let consumer = consumer(&charger, &store);
    publish(
        &setup.js,
        setup.work.clone(),
        &Key::new("pay-1").unwrap(),
        Bytes::from_static(b"EUR 10"),
    )
    .await
    .unwrap();

    // The first consumer performs the side effect and records it, then its process dies: its
    // connection is gone and the message is never acknowledged.
    {
        let client = async_nats::connect(nats_url()).await.unwrap();
        let js = jetstream::new(client.clone());
        let stream = js.get_stream(&setup.stream).await.unwrap();
        let doomed: PullConsumer = stream.get_consumer("workers").await.unwrap();
        let mut batch = doomed.fetch().max_messages(1).messages().await.unwrap();
        let message = NatsMessage::new(batch.next().await.unwrap().unwrap());
        // Every header, for adapters that keep messages whole (the inbox).
        assert!(
            message
                .headers()
                .contains(&("Idempotency-Key".to_owned(), b"pay-1".to_vec())),
            "{:?}",
            message.headers()
        );
        let verdict = consumer.process(&message).await;
        assert_eq!(verdict, Disposition::Ack, "the first delivery runs");
        drop(batch);
        drop(client);
    }
    assert_eq!(charger.charges.lock().unwrap().get("pay-1"), Some(&1));

    // The broker redelivers after the ack wait; the record makes it a duplicate.
    let stop = Arc::new(AtomicBool::new(false));
    let running = worker(&setup, Arc::clone(&consumer), Arc::clone(&stop));
    assert!(
        until(async || setup.drained().await, Duration::from_secs(10)).await,
        "the redelivery was not acked"
    );
    stop.store(true, Ordering::SeqCst);
    running.await.unwrap();
    assert_eq!(
        charger.charges.lock().unwrap().get("pay-1"),
        Some(&1),
        "the side effect ran twice"
    );
    assert_eq!(charger.calls.load(Ordering::SeqCst), 1);
    setup.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_duplicates_across_ten_consumers_charges_each_key_once() {
    let setup = Setup::new().await;
    let (charger, store) = (Arc::new(Charger::default()), FaultyStore::new(MemoryStore::new()));
    let consumer = consumer(&charger, &store);
    let keys: Vec<String> = (0..20).map(|i| format!("order-{i}")).collect();
    // Three copies of every message, each with its own Nats-Msg-Id, so the server's own dedup
    // window does not hide them: only the consumer's record can.
    for copy in 0..3 {
        for key in &keys {
            publish_copy(
                &setup.js,
                &setup.work,
                Some(key),
                &format!("{key}-copy-{copy}"),
                "EUR 10",
            )
            .await;
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let running: Vec<_> = (0..10)
        .map(|_| worker(&setup, Arc::clone(&consumer), Arc::clone(&stop)))
        .collect();
    assert!(
        until(async || setup.drained().await, Duration::from_secs(30)).await,
        "not every message was acked"
    );
    stop.store(true, Ordering::SeqCst);
    for worker in running {
        worker.await.unwrap();
    }
    let charges = charger.charges.lock().unwrap().clone();
    assert_eq!(charges.len(), keys.len());
    assert!(
        charges.values().all(|n| *n == 1),
        "a key was charged twice: {charges:?}"
    );
    setup.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_retried_with_backoff_then_dead_lettered_with_the_reason() {
    let setup = Setup::new().await;
    let stop = Arc::new(AtomicBool::new(false));
    // Fails twice, then succeeds: one side effect.
    let (charger, store) = (
        Arc::new(Charger {
            fail_first: 2,
            ..Charger::default()
        }),
        FaultyStore::new(MemoryStore::new()),
    );
    let running = worker(&setup, consumer(&charger, &store), Arc::clone(&stop));
    publish(
        &setup.js,
        setup.work.clone(),
        &Key::new("flaky").unwrap(),
        Bytes::from_static(b"EUR 10"),
    )
    .await
    .unwrap();
    assert!(until(async || setup.drained().await, Duration::from_secs(10)).await);
    stop.store(true, Ordering::SeqCst);
    running.await.unwrap();
    assert_eq!(charger.calls.load(Ordering::SeqCst), 3);
    assert_eq!(charger.charges.lock().unwrap().get("flaky"), Some(&1));

    // Always fails: dead-lettered after four deliveries, with the reason.
    let stop = Arc::new(AtomicBool::new(false));
    let (charger, store) = (
        Arc::new(Charger {
            fail_first: u32::MAX,
            ..Charger::default()
        }),
        FaultyStore::new(MemoryStore::new()),
    );
    let running = worker(&setup, consumer(&charger, &store), Arc::clone(&stop));
    publish(
        &setup.js,
        setup.work.clone(),
        &Key::new("hopeless").unwrap(),
        Bytes::from_static(b"EUR 10"),
    )
    .await
    .unwrap();
    assert!(until(async || setup.drained().await, Duration::from_secs(15)).await);
    stop.store(true, Ordering::SeqCst);
    running.await.unwrap();
    assert_eq!(
        charger.calls.load(Ordering::SeqCst),
        4,
        "one call per delivery, up to the limit"
    );
    let dead = setup.dead_letters(1).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, "hopeless");
    assert!(dead[0].1.contains("failed 4 deliveries"), "{dead:?}");
    setup.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_key_and_a_reused_key_are_dead_lettered_not_dropped() {
    let setup = Setup::new().await;
    let (charger, store) = (Arc::new(Charger::default()), FaultyStore::new(MemoryStore::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let running = worker(&setup, consumer(&charger, &store), Arc::clone(&stop));
    publish_copy(&setup.js, &setup.work, None, "no-key", "EUR 10").await;
    publish_copy(&setup.js, &setup.work, Some("pay-7"), "pay-7-a", "EUR 10").await;
    assert!(until(async || setup.drained().await, Duration::from_secs(10)).await);
    publish_copy(&setup.js, &setup.work, Some("pay-7"), "pay-7-b", "EUR 99").await;
    assert!(until(async || setup.drained().await, Duration::from_secs(10)).await);
    stop.store(true, Ordering::SeqCst);
    running.await.unwrap();
    let mut dead = setup.dead_letters(2).await;
    dead.sort();
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert!(
        dead[0].0.is_empty() && dead[0].1 == "no Idempotency-Key header",
        "{dead:?}"
    );
    assert!(
        dead[1].0 == "pay-7" && dead[1].1.contains("different payload"),
        "{dead:?}"
    );
    assert_eq!(charger.charges.lock().unwrap().get("pay-7"), Some(&1));
    setup.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_store_is_down_nothing_is_acked_or_lost() {
    let setup = Setup::new().await;
    let (charger, store) = (Arc::new(Charger::default()), FaultyStore::new(MemoryStore::new()));
    store.set_down(true);
    let stop = Arc::new(AtomicBool::new(false));
    let running = worker(&setup, consumer(&charger, &store), Arc::clone(&stop));
    for i in 0..5 {
        publish(
            &setup.js,
            setup.work.clone(),
            &Key::new(format!("pay-{i}")).unwrap(),
            Bytes::from_static(b"EUR 10"),
        )
        .await
        .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !setup.drained().await,
        "messages were acked while the store was down"
    );
    assert_eq!(charger.calls.load(Ordering::SeqCst), 0);
    store.set_down(false);
    assert!(
        until(async || setup.drained().await, Duration::from_secs(15)).await,
        "not processed after recovery"
    );
    stop.store(true, Ordering::SeqCst);
    running.await.unwrap();
    let charges = charger.charges.lock().unwrap().clone();
    assert_eq!(charges.len(), 5);
    assert!(charges.values().all(|n| *n == 1), "{charges:?}");
    setup.cleanup().await;
}

/// A handler that panics on one message every time: the worker keeps consuming the others
/// throughout (each charged exactly once), and the poison message is dead-lettered with reason
/// `panic` after exactly `max_deliveries` (4) attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_is_dead_lettered_and_the_worker_keeps_consuming() {
    let setup = Setup::new().await;
    let charger = Arc::new(Charger {
        poison: Some("poison"),
        ..Charger::default()
    });
    let store = FaultyStore::new(MemoryStore::new());
    let stop = Arc::new(AtomicBool::new(false));
    let running = worker(&setup, consumer(&charger, &store), Arc::clone(&stop));
    publish_copy(&setup.js, &setup.work, Some("poison"), "poison", "EUR ??").await;
    let healthy: Vec<String> = (0..30).map(|i| format!("order-{i}")).collect();
    for key in &healthy {
        publish_copy(&setup.js, &setup.work, Some(key), key, "EUR 10").await;
    }
    assert!(until(async || setup.drained().await, Duration::from_secs(20)).await);
    assert!(!running.is_finished(), "the worker stopped");
    stop.store(true, Ordering::SeqCst);
    running.await.unwrap();
    assert_eq!(
        charger.poison_calls.load(Ordering::SeqCst),
        4,
        "exactly max_deliveries attempts"
    );
    let charges = charger.charges.lock().unwrap().clone();
    assert_eq!(charges.len(), healthy.len(), "{charges:?}");
    assert!(charges.values().all(|&n| n == 1), "{charges:?}");
    let dead = setup.dead_letters(1).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, "poison");
    assert!(dead[0].1.starts_with("panic:"), "{dead:?}");
    // What an operator needs to look at it and replay it: where from, how often, when.
    assert_eq!(
        (dead[0].2.as_str(), dead[0].3.as_str()),
        (setup.work.as_str(), "4"),
        "{dead:?}"
    );
    assert!(httpdate::parse_http_date(&dead[0].4).is_ok(), "{dead:?}");

    // The fix is deployed (the handler no longer panics on it): the dead letter goes back to
    // its subject and is charged once; the dead-letter subject is empty after.
    let fixed = Arc::new(Charger::default());
    let stop = Arc::new(AtomicBool::new(false));
    let running = worker(&setup, consumer(&fixed, &store), Arc::clone(&stop));
    let moved = replay_dead_letters(&setup.js, &setup.stream, &setup.dead, 10)
        .await
        .unwrap();
    assert_eq!(moved, 1);
    assert!(
        until(
            async || fixed.charges.lock().unwrap().get("poison") == Some(&1),
            Duration::from_secs(10)
        )
        .await
    );
    stop.store(true, Ordering::SeqCst);
    running.await.unwrap();
    assert!(setup.dead_letters(1).await.is_empty());
    setup.cleanup().await;
}

/// A handler that runs for 2.5 s, longer than the consumer's 1 s `ack_wait`: the progress acks
/// sent while it runs keep the server from redelivering it, and it runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_longer_than_ack_wait_runs_once_thanks_to_progress_acks() {
    let setup = Setup::new().await;
    let charger = Arc::new(Charger {
        hold: Duration::from_millis(2500),
        ..Charger::default()
    });
    let store = FaultyStore::new(MemoryStore::new());
    let stop = Arc::new(AtomicBool::new(false));
    // Two workers: a redelivery would go to the idle one at once.
    let first = worker(&setup, consumer(&charger, &store), Arc::clone(&stop));
    let second = worker(&setup, consumer(&charger, &store), Arc::clone(&stop));
    publish_copy(&setup.js, &setup.work, Some("slow"), "slow", "EUR 10").await;
    assert!(until(async || setup.drained().await, Duration::from_secs(15)).await);
    stop.store(true, Ordering::SeqCst);
    first.await.unwrap();
    second.await.unwrap();
    assert_eq!(charger.calls.load(Ordering::SeqCst), 1);
    // The consumer's delivery sequence counts redeliveries too: one delivery in all. (Without
    // the progress acks the server redelivers after 1 s; the record keeps that copy from
    // running, but it is a redelivery all the same.)
    let mut workers = setup.workers.clone();
    let info = workers.info().await.unwrap();
    assert_eq!(
        info.delivered.consumer_sequence, 1,
        "redelivered while it ran: {info:?}"
    );
    setup.cleanup().await;
}

/// Two publishes with the same `Nats-Msg-Id` within the stream's duplicate window are one
/// stream message, as `publish` relies on.
#[tokio::test]
async fn publishes_with_one_message_id_make_one_stream_message() {
    let setup = Setup::new().await;
    let key = Key::new("publish-once").unwrap();
    for _ in 0..3 {
        publish(&setup.js, setup.work.clone(), &key, Bytes::from_static(b"EUR 10"))
            .await
            .unwrap();
    }
    publish_copy(&setup.js, &setup.work, Some("other"), "other", "EUR 20").await;
    let mut stream = setup.js.get_stream(&setup.stream).await.unwrap();
    let info = stream.info().await.unwrap();
    assert_eq!(info.state.messages, 2, "{:?}", info.state);
    setup.cleanup().await;
}
