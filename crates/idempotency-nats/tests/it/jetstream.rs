//! What is JetStream's own, against the real server (`NATS_URL`, default
//! `nats://127.0.0.1:4222`, which `scripts/services` starts): a dead letter's own message id
//! and its replay, progress acks counted by the consumer's delivery sequence, and publish
//! dedup. What every broker must do is the broker suite's (`tests/suite.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer::PullConsumer};
use bytes::Bytes;
use futures_util::StreamExt;
use idempotency_consumer::{Backoff, Consumer};
use idempotency_core::{Key, MemoryStore};
use idempotency_nats::{DEAD_REASON_HEADER, process, publish, replay_dead_letters};
use idempotency_testkit::brokers::{Charger, spawn_until_stopped, stop_and_wait};
use idempotency_testkit::{FaultyStore, TcpProxy};

use idempotency_testkit::nats::{TestStream, header};

struct Setup {
    test: TestStream,
    workers: PullConsumer,
}

impl Setup {
    async fn new() -> Self {
        let test = TestStream::new("idem", |config| config.duplicate_window = Duration::from_secs(60)).await;
        let workers = test
            .created
            .create_consumer(jetstream::consumer::pull::Config {
                durable_name: Some("workers".into()),
                filter_subject: test.work.clone(),
                ack_wait: Duration::from_secs(1),
                ..Default::default()
            })
            .await
            .unwrap();
        Self { test, workers }
    }

    /// Dead-lettered messages: (key, reason, source, deliveries, when).
    async fn dead_letters(&self) -> Vec<(String, String, String, String, String)> {
        let dead = self.test.dead_letters().await;
        let fields = |headers: &HeaderMap| {
            (
                header(headers, "Idempotency-Key"),
                header(headers, DEAD_REASON_HEADER),
                header(headers, "Idempotency-Dead-Source"),
                header(headers, "Idempotency-Dead-Deliveries"),
                header(headers, "Idempotency-Dead-At"),
            )
        };
        dead.iter().map(fields).collect()
    }

    /// Whether every work message has been settled.
    async fn drained(&self) -> bool {
        let mut workers = self.workers.clone();
        let info = workers.info().await.unwrap();
        info.num_pending == 0 && info.num_ack_pending == 0
    }

    async fn cleanup(self) {
        let _ = self.test.js.delete_stream(&self.test.stream).await;
    }
}

type TestConsumer = Consumer<FaultyStore<MemoryStore>, Charger>;

fn consumer(charger: &Charger, store: &FaultyStore<MemoryStore>) -> Arc<TestConsumer> {
    Arc::new(
        Consumer::new("nats-tests", store.clone(), charger.clone())
            .backoff(Backoff {
                initial: Duration::from_millis(100),
                max: Duration::from_secs(1),
            })
            .max_deliveries(4),
    )
}

/// Runs a worker on the durable consumer until `stop`.
fn worker(setup: &Setup, consumer: Arc<TestConsumer>, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<()> {
    let (workers, js, dead) = (
        setup.workers.clone(),
        setup.test.js.clone(),
        setup.test.dead.clone(),
    );
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

/// A handler that panics on one message every time: the worker keeps consuming the others
/// throughout (each charged exactly once), and the poison message is dead-lettered with reason
/// `panic` after exactly `max_deliveries` (4) attempts.
/// A poison message published with `publish` (its key as `Nats-Msg-Id`) into a stream with a
/// duplicate window: its dead-letter copy needs a message id of its own, or the stream drops it
/// as a duplicate and the message is lost. After the fix, the dead letter goes back to its
/// subject and runs once; the dead-letter subject is empty after. (The rest of a poison
/// message's story is the broker suite's.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_copy_has_its_own_message_id_and_is_replayed_after_the_fix() {
    let setup = Setup::new().await;
    let (charger, store) = (Charger::default(), FaultyStore::new(MemoryStore::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let running = worker(&setup, consumer(&charger, &store), Arc::clone(&stop));
    // Fails its first four calls: dead-lettered after the fourth delivery, run by the fifth.
    publish_copy(
        &setup.test.js,
        &setup.test.work,
        Some("poison"),
        "poison",
        "fail:4",
    )
    .await;
    assert!(until(async || setup.drained().await, Duration::from_secs(20)).await);
    stop.store(true, Ordering::SeqCst);
    running.await.unwrap();
    assert_eq!(
        charger.0.calls("poison").len(),
        4,
        "exactly max_deliveries attempts"
    );
    let dead = setup.dead_letters().await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, "poison");
    assert!(dead[0].1.starts_with("failed 4 deliveries"), "{dead:?}");
    // What an operator needs to look at it and replay it: where from, how often, when.
    assert_eq!(
        (dead[0].2.as_str(), dead[0].3.as_str()),
        (setup.test.work.as_str(), "4"),
        "{dead:?}"
    );
    assert!(httpdate::parse_http_date(&dead[0].4).is_ok(), "{dead:?}");

    // The cause is fixed (its next call succeeds): replayed, charged once.
    let stop = Arc::new(AtomicBool::new(false));
    let running = worker(&setup, consumer(&charger, &store), Arc::clone(&stop));
    let moved = replay_dead_letters(&setup.test.js, &setup.test.stream, &setup.test.dead, 10)
        .await
        .unwrap();
    assert_eq!(moved, 1);
    assert!(until(async || charger.0.effects("poison") == 1, Duration::from_secs(10)).await);
    stop.store(true, Ordering::SeqCst);
    running.await.unwrap();
    assert!(setup.dead_letters().await.is_empty());
    setup.cleanup().await;
}

/// A handler that runs for 2.5 s, longer than the consumer's 1 s `ack_wait`: the progress acks
/// sent while it runs keep the server from redelivering it, and it runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_longer_than_ack_wait_runs_once_thanks_to_progress_acks() {
    let setup = Setup::new().await;
    let charger = Charger::default();
    let store = FaultyStore::new(MemoryStore::new());
    let stop = Arc::new(AtomicBool::new(false));
    // Two workers: a redelivery would go to the idle one at once.
    let first = worker(&setup, consumer(&charger, &store), Arc::clone(&stop));
    let second = worker(&setup, consumer(&charger, &store), Arc::clone(&stop));
    publish_copy(
        &setup.test.js,
        &setup.test.work,
        Some("slow"),
        "slow",
        "sleep:2500",
    )
    .await;
    assert!(until(async || setup.drained().await, Duration::from_secs(15)).await);
    stop.store(true, Ordering::SeqCst);
    first.await.unwrap();
    second.await.unwrap();
    assert_eq!(charger.0.calls("slow"), [1]);
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
        publish(
            &setup.test.js,
            setup.test.work.clone(),
            &key,
            Bytes::from_static(b"EUR 10"),
        )
        .await
        .unwrap();
    }
    publish_copy(&setup.test.js, &setup.test.work, Some("other"), "other", "EUR 20").await;
    let mut stream = setup.test.js.get_stream(&setup.test.stream).await.unwrap();
    let info = stream.info().await.unwrap();
    assert_eq!(info.state.messages, 2, "{:?}", info.state);
    setup.cleanup().await;
}

/// A connection lost while the worker finds its consumer (the stream's info, the consumer's
/// creation, the first pull) is waited for, not taken for a refusal: the client connects
/// again, the JetStream request that got no answer times out, and the worker tries again and
/// consumes. The proxy cuts at each of the worker's first requests in turn, whatever the
/// timing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_while_the_worker_starts_is_waited_for() {
    let setup = Setup::new().await;
    let (charger, store) = (Charger::default(), FaultyStore::new(MemoryStore::new()));
    let (proxy, proxied) = TcpProxy::in_front_of(&idempotency_testkit::nats::nats_url())
        .await
        .unwrap();
    let connect = async || {
        let client = async_nats::connect(proxied.as_str()).await.unwrap();
        // A request whose answer the cut lost times out after this, and is tried again.
        let mut js = jetstream::new(client);
        js.set_timeout(Duration::from_millis(500));
        js
    };
    let start = |js: jetstream::Context, consumer_name: String| {
        let worker = idempotency_nats::Worker::new(
            js,
            setup.test.stream.clone(),
            consumer_name,
            setup.test.dead.clone(),
            consumer(&charger, &store),
        )
        .filter_subject(setup.test.work.clone());
        spawn_until_stopped(|stopped| async move { worker.run_until(stopped).await })
    };
    // The worker's requests until it consumes, counted on one left alone: at least the
    // stream's info, the consumer's creation and a pull.
    publish_copy(&setup.test.js, &setup.test.work, Some("probe"), "probe", "EUR 1").await;
    let js = connect().await;
    let before = proxy.round_trips();
    let (stop, running) = start(js, "probe".into());
    let counted = async || charger.0.effects("probe") == 1;
    assert!(
        until(counted, Duration::from_secs(10)).await,
        "the worker never consumed"
    );
    let requests = proxy.round_trips() - before;
    stop_and_wait(stop, running).await.unwrap();
    assert!(requests >= 3, "{requests} requests");
    for step in 1..=3 {
        let key = format!("cut-at-{step}");
        publish_copy(&setup.test.js, &setup.test.work, Some(&key), &key, "EUR 1").await;
        let js = connect().await;
        let accepted = proxy.accepted();
        proxy.cut_at_round_trip(Some(proxy.round_trips() + step));
        let (stop, running) = start(js, key.clone());
        let consumed = async || charger.0.effects(&key) == 1;
        assert!(
            until(consumed, Duration::from_secs(20)).await,
            "cut at the worker's request {step}: never consumed"
        );
        assert!(proxy.accepted() > accepted, "request {step}: the cut happened");
        stop_and_wait(stop, running)
            .await
            .unwrap_or_else(|e| panic!("cut at the worker's request {step}: {e}"));
    }
    setup.cleanup().await;
}
