//! The long-lived `Worker` against librdkafka's in-process cluster, each test with a ledger of
//! side effects that must count exactly one per key: a worker killed mid-stream, a rebalance
//! storm, brokers going down, dead letters, and the metrics.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{Cluster, Ledger, eventually};
use idempotency_consumer::{Backoff, Consumer, Delivery, Handler, HandlerError};
use idempotency_core::{Attempt, MemoryStore, Outcome};
use idempotency_kafka::{KafkaMessage, Worker};
use tokio::sync::Notify;

const LIMIT: Duration = Duration::from_secs(120);

/// Records one effect per call; the key `poison` panics, and `hold` (when set) waits for
/// `release` before its effect.
#[derive(Default)]
struct Charger {
    ledger: Ledger,
    hold: std::sync::Mutex<Option<String>>,
    holding: AtomicBool,
    release: Notify,
    pause: Duration,
}

impl Handler<KafkaMessage> for Charger {
    async fn handle(&self, message: &KafkaMessage, attempt: &Attempt) -> Result<Outcome, HandlerError> {
        self.ledger.called();
        let key = attempt.key().as_str();
        if key == "poison" {
            panic!("poison message: cannot parse the payment");
        }
        let hold = self.hold.lock().unwrap().as_deref() == Some(key);
        if hold {
            self.holding.store(true, Ordering::SeqCst);
            self.release.notified().await;
        }
        tokio::time::sleep(self.pause).await;
        self.ledger.effect(key);
        Ok(Outcome::new(message.payload().to_vec()))
    }
}

type Processor = Consumer<MemoryStore, Arc<Charger>>;

fn processor(store: &MemoryStore, charger: &Arc<Charger>) -> Arc<Processor> {
    Arc::new(
        Consumer::new("kafka-worker-tests", store.clone(), Arc::clone(charger))
            .lease(Duration::from_secs(2))
            .backoff(Backoff {
                initial: Duration::from_millis(20),
                max: Duration::from_millis(200),
            })
            .max_deliveries(3),
    )
}

fn keys(prefix: &str, count: usize) -> Vec<String> {
    (0..count).map(|n| format!("{prefix}-{n}")).collect()
}

/// A worker that ran every handler and was killed before any commit: the next worker of the
/// group reads everything again and answers it from the record, running no handler twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_before_its_commit_replays_without_running_again() {
    let cluster = Cluster::new(1, &[("orders", 4), ("orders.dead", 1)]);
    let orders = keys("order", 40);
    for key in &orders {
        cluster.publish("orders", key, b"EUR 10").await;
    }
    let (store, charger) = (MemoryStore::new(), Arc::new(Charger::default()));
    let first = Worker::new(cluster.config("killed"), "orders", processor(&store, &charger))
        // No batch is due before the kill.
        .commit_every(Duration::from_secs(3600), 1_000_000);
    let running = tokio::spawn(async move { first.run_until(std::future::pending()).await });
    eventually(LIMIT, "every order handled", || charger.ledger.keys() == 40).await;
    running.abort();
    let _ = running.await;
    assert_eq!(
        cluster.committed_and_end("killed", "orders", 4),
        (0, 40),
        "committed before the kill"
    );
    assert_eq!(charger.ledger.calls(), 40);

    let second = Worker::new(cluster.config("killed"), "orders", processor(&store, &charger));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move { second.run_until(async { drop(stopped.await) }).await });
    eventually(LIMIT, "the group's offsets at the end", || {
        cluster.committed_and_end("killed", "orders", 4) == (40, 40)
    })
    .await;
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert_eq!(
        charger.ledger.calls(),
        40,
        "a replayed order ran its handler again"
    );
    charger.ledger.assert_once_each(orders);
}

/// A worker killed while a handler runs, before its effect, with commits flowing: the message
/// is not committed, so the next worker reads it again and runs it once, after the dead
/// attempt's lease ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_handler_leaves_the_message_for_the_next() {
    let cluster = Cluster::new(1, &[("orders", 4), ("orders.dead", 1)]);
    let mut orders = keys("order", 19);
    for key in &orders {
        cluster.publish("orders", key, b"EUR 10").await;
    }
    // Last in its partition: every other message settles before the kill.
    cluster.publish("orders", "held", b"EUR 10").await;
    orders.push("held".into());
    let store = MemoryStore::new();
    let charger = Arc::new(Charger {
        hold: std::sync::Mutex::new(Some("held".into())),
        ..Charger::default()
    });
    let first = Worker::new(cluster.config("mid"), "orders", processor(&store, &charger))
        .commit_every(Duration::from_millis(10), 1);
    let running = tokio::spawn(async move { first.run_until(std::future::pending()).await });
    eventually(LIMIT, "19 committed, one held", || {
        charger.holding.load(Ordering::SeqCst) && cluster.committed_and_end("mid", "orders", 4).0 >= 19
    })
    .await;
    running.abort();
    let _ = running.await;
    assert_eq!(charger.ledger.keys(), 19);
    // Had the held message's offset been committed before its record, the next worker would
    // never read it, and it would never be executed.

    // The next worker's handler does not hold; it waits out the dead attempt's lease.
    *charger.hold.lock().unwrap() = None;
    let second = Worker::new(cluster.config("mid"), "orders", processor(&store, &charger));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move { second.run_until(async { drop(stopped.await) }).await });
    eventually(LIMIT, "the group's offsets at the end", || {
        cluster.committed_and_end("mid", "orders", 4) == (20, 20)
    })
    .await;
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
    charger.ledger.assert_once_each(orders);
    // 20 first calls, and the held message's second.
    assert_eq!(charger.ledger.calls(), 21);
}
