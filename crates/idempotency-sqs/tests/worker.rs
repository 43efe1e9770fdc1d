//! The SQS worker against the local server, with a side-effect ledger: duplicates, handlers
//! that outlive the visibility timeout, a worker killed mid-handler, dead letters, panics and
//! FIFO order.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{
    Counting, Ledger, Running, attribute, client, depth, drain, queues, stop_all, two_workers, worker,
};
use idempotency_consumer::{Backoff, Consumer, Delivery, Handler, HandlerError};
use idempotency_core::{Attempt, Key, MemoryStore, Outcome};
use idempotency_sqs::{Producer, SqsMessage};
use idempotency_testkit::eventually;

/// Charges a card: the side effect is a ledger entry. `slow` sleeps; `panic` panics; the first
/// attempt of `hang` never ends.
#[derive(Clone, Default)]
struct Charge {
    ledger: Ledger,
    slow: Duration,
    hang_first: Arc<AtomicBool>,
    starts: Arc<Mutex<Vec<(String, u32, Instant)>>>,
}

impl Handler<SqsMessage> for Charge {
    async fn handle(&self, message: &SqsMessage, attempt: &Attempt) -> Result<Outcome, HandlerError> {
        let body = String::from_utf8_lossy(message.payload()).into_owned();
        let key = attempt.key().as_str().to_owned();
        assert!(body != "panic", "the card service answered garbage");
        self.starts
            .lock()
            .unwrap()
            .push((key.clone(), attempt.number(), Instant::now()));
        if body == "hang" && !self.hang_first.swap(true, Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(self.slow).await;
        self.ledger.record(&key);
        Ok(Outcome::new(format!("charged {body}")))
    }
}

fn key(text: &str) -> Key {
    Key::new(text).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_sent_twice_has_one_effect() {
    let client = client();
    let (source, dead) = queues(&client, "dup").await;
    let charge = Charge::default();
    // A copy that arrives while the first runs is held back for the backoff's maximum at most.
    let consumer = Consumer::new("sqs-dup", MemoryStore::new(), charge.clone()).backoff(Backoff {
        initial: Duration::from_millis(100),
        max: Duration::from_secs(1),
    });
    let (counting, counts) = Counting::new(consumer);
    let processor = Arc::new(counting);
    let producer = Producer::new(client.clone(), &source);
    let mut ids = std::collections::HashSet::new();
    for i in 0..40 {
        for _ in 0..2 {
            ids.insert(
                producer
                    .send(&key(&format!("order-{i}")), format!("{i}"))
                    .await
                    .unwrap(),
            );
        }
    }
    assert_eq!(ids.len(), 80, "every send has its own MessageId");
    let workers = two_workers(&client, (&source, &dead), &processor, Duration::from_secs(5));
    eventually(Duration::from_secs(60), "the queue to empty", || async {
        charge.ledger.keys() == 40 && depth(&client, &source).await == 0
    })
    .await;
    stop_all(workers).await;
    for i in 0..40 {
        assert_eq!(charge.ledger.effects(&format!("order-{i}")), 1, "order-{i}");
    }
    assert_eq!(charge.ledger.total(), 40);
    let deliveries: u32 = counts.lock().unwrap().deliveries.values().sum();
    // Both copies of each, and again each copy that arrived while its twin ran (held back).
    assert!(deliveries >= 80, "only {deliveries} deliveries of 80 messages");
    assert!(drain(&client, &dead).await.is_empty());
}

/// A handler that runs three times the visibility timeout keeps its message: the heartbeat
/// extends the visibility, so the second worker never gets it, and it runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_three_times_the_visibility_timeout_is_not_delivered_in_parallel() {
    // The recorder must be in place before the worker creates its metrics.
    let _ = idempotency_testkit::recorded::global();
    let client = client();
    let (source, dead) = queues(&client, "slow").await;
    let charge = Charge {
        slow: Duration::from_secs(6),
        ..Charge::default()
    };
    let consumer =
        Consumer::new("sqs-slow", MemoryStore::new(), charge.clone()).lease(Duration::from_secs(30));
    let (counting, counts) = Counting::new(consumer);
    let processor = Arc::new(counting);
    let visibility = Duration::from_secs(2);
    let workers = two_workers(&client, (&source, &dead), &processor, visibility);
    Producer::new(client.clone(), &source)
        .send(&key("slow-charge"), "slow")
        .await
        .unwrap();
    eventually(Duration::from_secs(60), "the slow charge", || async {
        charge.ledger.total() == 1 && depth(&client, &source).await == 0
    })
    .await;
    // Two more visibility timeouts: a copy the heartbeat failed to hold would show up now.
    tokio::time::sleep(2 * visibility).await;
    stop_all(workers).await;
    let counts = counts.lock().unwrap();
    assert_eq!(counts.deliveries["slow-charge"], 1, "delivered more than once");
    assert_eq!(counts.most_at_once["slow-charge"], 1);
    assert_eq!(charge.ledger.effects("slow-charge"), 1);
    let queue_name = source.rsplit('/').next().unwrap();
    let extended = idempotency_testkit::recorded::global().counter(
        "idempotency_sqs_visibility_extensions_total",
        &[("queue", queue_name), ("result", "ok")],
    );
    assert!(extended >= 2, "only {extended} visibility extensions in 6 s");
}

/// A worker killed mid-handler: the message comes back after the visibility timeout, the record's
/// live lease holds it off (it waits on the record, no second run), and attempt 2 runs once the
/// lease is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_handler_leaves_the_message_to_the_records_lease() {
    const LEASE: Duration = Duration::from_secs(6);
    let client = client();
    let (source, dead) = queues(&client, "kill").await;
    let store = MemoryStore::new();
    let charge = Charge::default();
    let consumer = |name| Consumer::new(name, store.clone(), charge.clone()).lease(LEASE);
    let visibility = Duration::from_secs(2);
    let first = Running::start(worker(
        &client,
        &source,
        &dead,
        Arc::new(consumer("sqs-kill")),
        visibility,
    ));
    Producer::new(client.clone(), &source)
        .send(&key("hang-charge"), "hang")
        .await
        .unwrap();
    eventually(Duration::from_secs(30), "the first attempt to start", || async {
        !charge.starts.lock().unwrap().is_empty()
    })
    .await;
    first.kill();
    let (counting, counts) = Counting::new(consumer("sqs-kill"));
    let second = Running::start(worker(&client, &source, &dead, Arc::new(counting), visibility));
    eventually(Duration::from_secs(60), "attempt 2 to complete", || async {
        charge.ledger.total() == 1 && depth(&client, &source).await == 0
    })
    .await;
    second.stop().await;
    let starts = charge.starts.lock().unwrap().clone();
    assert_eq!(starts.len(), 2, "{starts:?}");
    assert_eq!((starts[0].1, starts[1].1), (1, 2), "attempts {starts:?}");
    let gap = starts[1].2 - starts[0].2;
    assert!(
        gap >= LEASE - Duration::from_millis(500),
        "attempt 2 started {gap:?} after attempt 1, inside its {LEASE:?} lease"
    );
    // The redelivery reached the second worker inside the lease and waited on the record
    // (the gap above): it was neither run nor acked before the lease ended.
    let deliveries = counts.lock().unwrap().deliveries["hang-charge"];
    assert!(deliveries >= 1, "the second worker never saw the message");
    assert_eq!(charge.ledger.effects("hang-charge"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reused_keys_and_missing_keys_are_dead_lettered_with_their_reasons() {
    let client = client();
    let (source, dead) = queues(&client, "bad").await;
    let charge = Charge::default();
    let consumer = Arc::new(Consumer::new("sqs-bad", MemoryStore::new(), charge.clone()));
    let producer = Producer::new(client.clone(), &source);
    producer.send(&key("charge-1"), "EUR 10").await.unwrap();
    let running = Running::start(worker(
        &client,
        &source,
        &dead,
        Arc::clone(&consumer),
        Duration::from_secs(5),
    ));
    eventually(Duration::from_secs(30), "charge-1", || async {
        charge.ledger.total() == 1
    })
    .await;
    producer.send(&key("charge-1"), "EUR 99").await.unwrap();
    client
        .send_message()
        .queue_url(&source)
        .message_body("no key at all")
        .send()
        .await
        .unwrap();
    eventually(Duration::from_secs(30), "the queue to empty", || async {
        depth(&client, &source).await == 0
    })
    .await;
    running.stop().await;
    let mut letters = drain(&client, &dead).await;
    letters.sort_by_key(|m| m.body().unwrap_or_default().to_owned());
    assert_eq!(letters.len(), 2, "{letters:?}");
    assert_eq!(letters[0].body(), Some("EUR 99"));
    assert!(
        attribute(&letters[0], "Idempotency-Dead-Reason")
            .unwrap()
            .contains("different payload"),
        "{letters:?}"
    );
    assert_eq!(attribute(&letters[0], "Idempotency-Key"), Some("charge-1"));
    assert_eq!(letters[1].body(), Some("no key at all"));
    assert_eq!(
        attribute(&letters[1], "Idempotency-Dead-Reason"),
        Some("no Idempotency-Key header"),
        "{letters:?}"
    );
    let source_name = source.rsplit('/').next().unwrap();
    for letter in &letters {
        assert_eq!(attribute(letter, "Idempotency-Dead-Source"), Some(source_name));
        assert_eq!(attribute(letter, "Idempotency-Dead-Deliveries"), Some("1"));
        assert!(
            attribute(letter, "Idempotency-Dead-At")
                .unwrap()
                .ends_with(" GMT")
        );
    }
    assert_eq!(charge.ledger.effects("charge-1"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_is_dead_lettered_and_the_worker_keeps_going() {
    let _ = idempotency_testkit::recorded::global();
    let client = client();
    let (source, dead) = queues(&client, "panic").await;
    let charge = Charge::default();
    let consumer = Consumer::new("sqs-panic", MemoryStore::new(), charge.clone())
        .max_deliveries(3)
        .backoff(Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(100),
        });
    let running = Running::start(worker(
        &client,
        &source,
        &dead,
        Arc::new(consumer),
        Duration::from_secs(5),
    ));
    let producer = Producer::new(client.clone(), &source);
    producer.send(&key("poison"), "panic").await.unwrap();
    let letters = Arc::new(Mutex::new(Vec::new()));
    eventually(
        Duration::from_secs(60),
        "the poison message to be dead-lettered",
        || {
            let (client, dead, letters) = (client.clone(), dead.clone(), Arc::clone(&letters));
            async move {
                let found = drain(&client, &dead).await;
                let mut letters = letters.lock().unwrap();
                letters.extend(found);
                !letters.is_empty()
            }
        },
    )
    .await;
    let letters = letters.lock().unwrap().clone();
    assert!(running.is_running(), "the worker stopped after a panic");
    producer.send(&key("after-poison"), "EUR 5").await.unwrap();
    eventually(Duration::from_secs(30), "the next message", || async {
        charge.ledger.effects("after-poison") == 1
    })
    .await;
    running.stop().await;
    assert_eq!(letters.len(), 1);
    let reason = attribute(&letters[0], "Idempotency-Dead-Reason").unwrap();
    assert!(reason.starts_with("panic:"), "{reason}");
    assert_eq!(attribute(&letters[0], "Idempotency-Dead-Deliveries"), Some("3"));
    assert_eq!(charge.ledger.effects("poison"), 0);
    assert_eq!(depth(&client, &source).await, 0);
    let metrics = idempotency_testkit::recorded::global();
    let queue_name = source.rsplit('/').next().unwrap();
    let messages = |result| {
        metrics.counter(
            "idempotency_sqs_messages_total",
            &[("queue", queue_name), ("result", result)],
        )
    };
    assert_eq!(
        (messages("acked"), messages("retried"), messages("dead_lettered")),
        (1, 2, 1)
    );
    let deletes = metrics.counter(
        "idempotency_sqs_deletes_total",
        &[("queue", queue_name), ("result", "ok")],
    );
    assert_eq!(deletes, 2, "the acked message and the dead letter's original");
    assert_eq!(
        metrics.gauge("idempotency_sqs_in_flight", &[("queue", queue_name)]),
        0.0
    );
}

/// A queue that does not exist is a configuration error at start; one deleted while the worker
/// runs makes receives fail, which are counted and retried, and the worker stops cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_queues_are_named_and_receive_failures_counted() {
    let _ = idempotency_testkit::recorded::global();
    let client = client();
    let (source, dead) = queues(&client, "gone").await;
    let consumer = Arc::new(Consumer::new("sqs-gone", MemoryStore::new(), Charge::default()));
    let missing = format!("{source}-missing");
    let error = worker(
        &client,
        &missing,
        &dead,
        Arc::clone(&consumer),
        Duration::from_secs(5),
    )
    .run_until(std::future::pending())
    .await
    .unwrap_err();
    assert!(!error.is_retryable(), "{error}");
    assert!(error.to_string().contains("look up the queue"), "{error}");
    let error = worker(
        &client,
        &source,
        &format!("{dead}-missing"),
        Arc::clone(&consumer),
        Duration::from_secs(5),
    )
    .run_until(std::future::pending())
    .await
    .unwrap_err();
    assert!(
        error.to_string().contains("look up the dead-letter queue"),
        "{error}"
    );
    let error = idempotency_sqs::Worker::new(
        client.clone(),
        &source,
        idempotency_sqs::DeadLetters::RedrivePolicy,
        Arc::clone(&consumer),
    )
    .run_until(std::future::pending())
    .await
    .unwrap_err();
    assert!(error.to_string().contains("has no redrive policy"), "{error}");

    let running = Running::start(worker(&client, &source, &dead, consumer, Duration::from_secs(5)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    client.delete_queue().queue_url(&source).send().await.unwrap();
    let queue_name = source.rsplit('/').next().unwrap().to_owned();
    eventually(Duration::from_secs(30), "a counted receive failure", || {
        let queue_name = queue_name.clone();
        async move {
            idempotency_testkit::recorded::global()
                .counter("idempotency_sqs_receive_errors_total", &[("queue", &queue_name)])
                > 0
        }
    })
    .await;
    assert!(running.is_running(), "a failing receive stopped the worker");
    running.stop().await;
}

/// Four message groups, 25 messages each, two workers with eight slots each: every group's
/// effects happen in the order its messages were sent, and each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_queue_keeps_each_groups_order_under_concurrency() {
    const GROUPS: usize = 4;
    const EACH: usize = 25;
    let client = client();
    let (source, dead) = queues(&client, "order.fifo").await;
    let charge = Charge {
        slow: Duration::from_millis(3),
        ..Charge::default()
    };
    let producer = Producer::new(client.clone(), &source);
    for i in 0..EACH {
        for group in 0..GROUPS {
            let name = format!("g{group}-{i:02}");
            producer
                .send_in_group(&key(&name), &format!("customer-{group}"), name.clone())
                .await
                .unwrap();
        }
    }
    // The same key sent again within the window: SQS drops it at the send.
    producer
        .send_in_group(&key("g0-00"), "customer-0", "g0-00")
        .await
        .unwrap();
    assert_eq!(
        depth(&client, &source).await,
        u64::try_from(GROUPS * EACH).unwrap(),
        "the resent key was not dropped by its MessageDeduplicationId"
    );
    let consumer = Arc::new(Consumer::new("sqs-fifo", MemoryStore::new(), charge.clone()));
    let workers = two_workers(&client, (&source, &dead), &consumer, Duration::from_secs(5));
    eventually(Duration::from_secs(60), "every group", || async {
        charge.ledger.total() == u32::try_from(GROUPS * EACH).unwrap() && depth(&client, &source).await == 0
    })
    .await;
    stop_all(workers).await;
    let order = charge.ledger.order();
    for group in 0..GROUPS {
        let seen: Vec<&String> = order
            .iter()
            .filter(|key| key.starts_with(&format!("g{group}-")))
            .collect();
        let sent: Vec<String> = (0..EACH).map(|i| format!("g{group}-{i:02}")).collect();
        assert_eq!(
            seen,
            sent.iter().collect::<Vec<_>>(),
            "group {group} out of order"
        );
    }
    assert!(drain(&client, &dead).await.is_empty());
}
