//! The long-lived `Worker` against librdkafka's in-process cluster, each test with a ledger of
//! side effects that must count exactly one per key: a worker killed mid-stream, a rebalance
//! storm, brokers going down, dead letters, and the metrics.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{Cluster, Ledger, eventually};
use idempotency_consumer::{Backoff, Consumer, Delivery, Handler, HandlerError};
use idempotency_core::{Attempt, MemoryStore, Outcome};
use idempotency_kafka::{KafkaMessage, Worker};
use idempotency_testkit::brokers::{drained_partitions, spawn_until_stopped, stop_and_wait};
use rdkafka::Message;
use tokio::sync::Notify;

const LIMIT: Duration = Duration::from_secs(120);

/// Records one effect per call; the key `poison` panics, `hold` (when set) waits for
/// `release` before its effect, and every call waits while `closed` is true.
#[derive(Default)]
struct Charger {
    ledger: Ledger,
    hold: std::sync::Mutex<Option<String>>,
    holding: AtomicBool,
    release: Notify,
    pause: Duration,
    closed: tokio::sync::watch::Sender<bool>,
}

impl Handler<KafkaMessage> for Charger {
    async fn handle(&self, message: &KafkaMessage, attempt: &Attempt) -> Result<Outcome, HandlerError> {
        self.ledger.called();
        let key = attempt.key().as_str();
        if key == "poison" {
            panic!("poison message: cannot parse the payment");
        }
        let _ = self.closed.subscribe().wait_for(|closed| !closed).await;
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

    let second = start(
        &cluster,
        "killed",
        "orders",
        "killed-second",
        processor(&store, &charger),
    );
    eventually(LIMIT, "the group's offsets at the end", || {
        cluster.committed_and_end("killed", "orders", 4) == (40, 40)
    })
    .await;
    stop_all(vec![second]).await;
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
    let second = start(
        &cluster,
        "mid",
        "orders",
        "mid-second",
        processor(&store, &charger),
    );
    eventually(LIMIT, "the group's offsets at the end", || {
        cluster.committed_and_end("mid", "orders", 4) == (20, 20)
    })
    .await;
    stop_all(vec![second]).await;
    charger.ledger.assert_once_each(orders);
    // 20 first calls, and the held message's second.
    assert_eq!(charger.ledger.calls(), 21);
}

/// A running worker: the sender stops it.
type Running = (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), idempotency_kafka::AdapterError>>,
);

/// Starts a worker of `group` on `topic`.
fn start(cluster: &Cluster, group: &str, topic: &str, name: &str, processor: Arc<Processor>) -> Running {
    start_worker(Worker::new(cluster.config(group), topic, processor).name(name))
}

/// Starts `worker`, committing every 200 ms or 100 messages.
fn start_worker<P: idempotency_consumer::Processor<KafkaMessage> + 'static>(worker: Worker<P>) -> Running {
    // The process-wide recorder is installed before any worker creates its metrics.
    let _ = idempotency_testkit::recorded::global();
    let worker = worker.commit_every(Duration::from_millis(200), 100);
    spawn_until_stopped(|stopped| async move { worker.run_until(stopped).await })
}

/// Stops the workers, each settling and committing.
async fn stop_all(workers: Vec<Running>) {
    for (stop, running) in workers {
        stop_and_wait(stop, running).await.unwrap();
    }
}

/// 8 partitions, 3 workers in one group; one leaves and one joins while 2,000 keyed events
/// flow: every key runs exactly once, the group's offsets reach the end of every partition,
/// and nothing is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebalance_storm_runs_every_key_once() {
    let cluster = Cluster::new(1, &[("events", 8), ("events.dead", 1)]);
    let store = MemoryStore::new();
    let charger = Arc::new(Charger {
        pause: Duration::from_millis(1),
        ..Charger::default()
    });
    let processor = processor(&store, &charger);
    let events = keys("event", 2000);
    let mut workers: Vec<_> = ["storm-a", "storm-b", "storm-c"]
        .iter()
        .map(|name| start(&cluster, "storm", "events", name, Arc::clone(&processor)))
        .collect();
    cluster.publish_all("events", &events[..700]).await;
    eventually(LIMIT, "300 executed", || charger.ledger.keys() >= 300).await;
    // b leaves mid-stream: its partitions settle, commit, and move to a and c.
    let (stop, running) = workers.remove(1);
    stop_and_wait(stop, running).await.unwrap();
    cluster.publish_all("events", &events[700..1400]).await;
    // d joins mid-stream.
    workers.push(start(
        &cluster,
        "storm",
        "events",
        "storm-d",
        Arc::clone(&processor),
    ));
    cluster.publish_all("events", &events[1400..]).await;
    eventually(LIMIT, "the group's offsets at the end", || {
        cluster.committed_and_end("storm", "events", 8) == (2000, 2000)
    })
    .await;
    stop_all(workers).await;
    charger.ledger.assert_once_each(events);
    assert_eq!(
        cluster.committed_and_end("storm", "events.dead", 1),
        (0, 0),
        "dead letters"
    );
}

/// Large messages, a count bound they never reach (the default, 10,000) and a byte bound of
/// 64 KiB: the partition is paused at the broker once two of its 32 KiB messages wait, its
/// handlers held; released, it is resumed and drains to the end, each message run once. Without
/// the byte bound a worker would keep fetching large messages into memory up to the count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_is_paused_by_the_bytes_that_wait_not_only_by_their_count() {
    let cluster = Cluster::new(1, &[("large", 1), ("large.dead", 1)]);
    let documents = keys("document", 12);
    for key in &documents {
        cluster.publish("large", key, &[b'x'; 32 << 10]).await;
    }
    let (store, charger) = (MemoryStore::new(), Arc::new(Charger::default()));
    // Every call waits: the fetched messages stay queued.
    charger.closed.send_replace(true);
    let worker = start_worker(
        Worker::new(cluster.config("large"), "large", processor(&store, &charger))
            .name("large")
            .prefetch_bytes(64 << 10),
    );
    let metrics = idempotency_testkit::recorded::global;
    let labels = [("consumer", "large"), ("topic", "large")];
    eventually(LIMIT, "the partition paused at the broker by its bytes", || {
        metrics().gauge("idempotency_kafka_fetch_paused_partitions", &labels) == 1.0
    })
    .await;
    assert!(metrics().counter("idempotency_kafka_fetch_pauses_total", &labels) >= 1);
    charger.closed.send_replace(false);
    eventually(LIMIT, "the group's offsets at the end", || {
        cluster.committed_and_end("large", "large", 1) == (12, 12)
    })
    .await;
    eventually(LIMIT, "the partition fetched again", || {
        metrics().gauge("idempotency_kafka_fetch_paused_partitions", &labels) == 0.0
    })
    .await;
    stop_all(vec![worker]).await;
    charger.ledger.assert_once_each(documents);
}

/// A member whose six partitions are all paused at the broker (more fetched messages wait
/// than `prefetch`, its handlers held) when a second member joins: the rebalance hands
/// three of them back to it and moves three to the newcomer. Both drain what they got to the
/// end; when the newcomer leaves, the first member gets back the three it had paused before
/// the first rebalance, and drains them too. Liveness, not only safety: a member that never
/// reads a partition again loses nothing, and only the offsets reaching the end show it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_paused_before_a_rebalance_are_drained_by_whoever_gets_them() {
    const PARTITIONS: i32 = 6;
    let cluster = Cluster::new(1, &[("backlog", PARTITIONS), ("backlog.dead", 1)]);
    let publish = async |first: usize, last: usize| {
        for partition in 0..PARTITIONS {
            for n in first..last {
                cluster
                    .publish_to("backlog", partition, &format!("p{partition}-{n}"))
                    .await;
            }
        }
    };
    publish(0, 20).await;
    let store = MemoryStore::new();
    let (a, b) = (Arc::new(Charger::default()), Arc::new(Charger::default()));
    // The first member's calls wait: each partition's first message runs, the rest queue up.
    a.closed.send_replace(true);
    let member = |name: &str, charger: &Arc<Charger>| {
        Worker::new(cluster.config("paused"), "backlog", processor(&store, charger))
            .name(name)
            .prefetch(4)
    };
    let mut workers = vec![start_worker(member("paused-a", &a))];
    let metrics = idempotency_testkit::recorded::global;
    let labels = |consumer| [("consumer", consumer), ("topic", "backlog")];
    eventually(LIMIT, "all six partitions paused at the broker", || {
        metrics().gauge("idempotency_kafka_fetch_paused_partitions", &labels("paused-a")) == 6.0
    })
    .await;
    workers.push(start_worker(member("paused-b", &b)));
    let revoked = || {
        let mut labels = labels("paused-a").to_vec();
        labels.push(("kind", "revoke"));
        metrics().counter("idempotency_kafka_rebalances_total", &labels)
    };
    // The revocation waits for the held calls: let them finish once it has begun.
    eventually(LIMIT, "the first member's partitions revoked", || revoked() >= 1).await;
    a.closed.send_replace(false);
    eventually(LIMIT, "the group's offsets at the end", || {
        cluster.committed_and_end("paused", "backlog", PARTITIONS) == (120, 120)
    })
    .await;
    // Each member ran the rest of the partitions it got (the first messages ran in the first
    // member before the rebalance).
    let drained = |charger: &Charger| drained_partitions(charger.ledger.effects().into_keys());
    let (kept, moved) = (drained(&a), drained(&b));
    assert_eq!(kept.len(), 3, "the first member drained {kept:?}");
    assert_eq!(moved.len(), 3, "the newcomer drained {moved:?}");
    assert!(kept.iter().all(|p| !moved.contains(p)), "{kept:?} {moved:?}");

    // The newcomer leaves: the first member gets back the partitions it paused before.
    let (stop, running) = workers.remove(1);
    stop_and_wait(stop, running).await.unwrap();
    publish(20, 30).await;
    // A stall here is the bug this test exists for: say where each partition stands.
    let where_each_stands = || {
        let ran = |charger: &Charger, partition: i32| {
            let prefix = format!("p{partition}-");
            charger
                .ledger
                .effects()
                .keys()
                .filter(|key| key.starts_with(&prefix))
                .count()
        };
        let stands: Vec<String> = cluster
            .committed_and_end_each("paused", "backlog", PARTITIONS)
            .into_iter()
            .zip(0..)
            .map(|((committed, end), partition)| {
                format!(
                    "p{partition}: committed {committed} of {end}, ran {} in a, {} in b",
                    ran(&a, partition),
                    ran(&b, partition)
                )
            })
            .collect();
        format!(
            "the group's offsets at the end again; {}; paused at the broker {}",
            stands.join("; "),
            metrics().gauge("idempotency_kafka_fetch_paused_partitions", &labels("paused-a"))
        )
    };
    idempotency_testkit::eventually_explained(
        LIMIT,
        async || cluster.committed_and_end("paused", "backlog", PARTITIONS) == (180, 180),
        where_each_stands,
    )
    .await;
    stop_all(workers).await;
    let mut all = a.ledger.effects();
    for (key, count) in b.ledger.effects() {
        *all.entry(key).or_default() += count;
    }
    assert_eq!(all.len(), 180);
    assert!(all.values().all(|count| *count == 1), "a key ran twice");
    assert_eq!(drained(&a).len(), 6, "the first member drained {:?}", drained(&a));
}

/// Records the offsets it runs, per partition, in the order it runs them.
#[derive(Default)]
struct Recorder {
    ran: std::sync::Mutex<std::collections::HashMap<i32, Vec<i64>>>,
}

impl Handler<KafkaMessage> for Recorder {
    async fn handle(&self, message: &KafkaMessage, _: &Attempt) -> Result<Outcome, HandlerError> {
        self.ran
            .lock()
            .unwrap()
            .entry(message.message().partition())
            .or_default()
            .push(message.message().offset());
        // Slower than the fetches: the partitions' queues fill up and are paused again and again.
        tokio::time::sleep(Duration::from_millis(2)).await;
        Ok(Outcome::new(Vec::new()))
    }
}

/// A backlog on every partition, small fetches, a handler slower than them and a prefetch of
/// 2: every partition is paused at the broker and resumed again and again. Each resume starts
/// fetching again at once from the message after the last one handed out (a seek, since
/// librdkafka leaves a fetcher whose partitions were all paused asleep until its next periodic
/// wake-up), and the test shows what that must not cost: each message reaches its partition's
/// task once, in order, none skipped, none handed out twice. (What the seek saves is
/// throughput, measured in BENCHMARKS.md, Kafka, "Partitions paused and resumed".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_paused_after_every_fetch_runs_each_message_once_in_order() {
    const PARTITIONS: i32 = 4;
    const EACH: i64 = 500;
    let cluster = Cluster::new(1, &[("refetch", PARTITIONS), ("refetch.dead", 1)]);
    for n in 0..EACH {
        let keys: Vec<String> = (0..PARTITIONS)
            .map(|partition| format!("p{partition}-{n}"))
            .collect();
        futures_util::future::join_all(
            (0..PARTITIONS)
                .zip(&keys)
                .map(|(partition, key)| cluster.publish_to("refetch", partition, key)),
        )
        .await;
    }
    let recorder = Arc::new(Recorder::default());
    let processor = Arc::new(Consumer::new(
        "kafka-refetch-tests",
        MemoryStore::new(),
        Arc::clone(&recorder),
    ));
    let mut config = cluster.config("refetch");
    // Small fetches (librdkafka's smallest message limit): many pauses and resumes.
    config
        .set("max.partition.fetch.bytes", "300")
        .set("fetch.max.bytes", "1200")
        .set("message.max.bytes", "1200");
    let worker = start_worker(
        Worker::new(config, "refetch", processor)
            .name("refetch")
            .prefetch(2),
    );
    eventually(LIMIT, "the group's offsets at the end", || {
        cluster.committed_and_end("refetch", "refetch", PARTITIONS) == (EACH * 4, EACH * 4)
    })
    .await;
    stop_all(vec![worker]).await;
    let ran = recorder.ran.lock().unwrap();
    for partition in 0..PARTITIONS {
        let expected: Vec<i64> = (0..EACH).collect();
        assert_eq!(ran.get(&partition), Some(&expected), "partition {partition}");
    }
    let acked = idempotency_testkit::recorded::global().counter(
        "idempotency_kafka_messages_total",
        &[("consumer", "refetch"), ("topic", "refetch"), ("result", "acked")],
    );
    // A message handed to its task twice would be answered from the record and acked twice.
    assert_eq!(acked, 4 * EACH.unsigned_abs());
    let pauses = idempotency_testkit::recorded::global().counter(
        "idempotency_kafka_fetch_pauses_total",
        &[("consumer", "refetch"), ("topic", "refetch")],
    );
    assert!(
        pauses >= 8,
        "paused {pauses} times: not the many pauses this test is about"
    );
}

/// Each of three brokers goes down and comes back while events flow: no event is lost and
/// none runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokers_going_down_mid_stream_lose_nothing_and_run_nothing_twice() {
    let cluster = Cluster::new(3, &[("events", 6), ("events.dead", 1)]);
    let store = MemoryStore::new();
    let charger = Arc::new(Charger::default());
    let processor = processor(&store, &charger);
    let events = keys("event", 900);
    let workers: Vec<_> = ["outage-a", "outage-b"]
        .iter()
        .map(|name| start(&cluster, "outage", "events", name, Arc::clone(&processor)))
        .collect();
    cluster.publish_all("events", &events[..300]).await;
    eventually(LIMIT, "100 executed", || charger.ledger.keys() >= 100).await;
    for (broker, batch) in [
        (1, &events[300..500]),
        (2, &events[500..700]),
        (3, &events[700..]),
    ] {
        cluster.cluster.broker_down(broker).unwrap();
        // The idempotent producer holds and retries what the down broker leads.
        let publishing = cluster.publish_all("events", batch);
        let outage = async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            cluster.cluster.broker_up(broker).unwrap();
        };
        tokio::join!(publishing, outage);
    }
    eventually(LIMIT, "the group's offsets at the end", || {
        cluster.committed_and_end("outage", "events", 6) == (900, 900)
    })
    .await;
    stop_all(workers).await;
    charger.ledger.assert_once_each(events);
    assert_eq!(charger.ledger.calls(), 900);
}

/// A key reused with another payload and a handler that panics every time go to the
/// dead-letter topic (the panic after the delivery limit); the worker lives on, its partition
/// goes past them only once the dead letters are acknowledged, and every metric moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_leave_the_worker_running_and_the_metrics_move() {
    let cluster = Cluster::new(1, &[("payments", 2), ("payments.dead", 1)]);
    // One partition's order, by record key: the reuse and the poison come before a healthy one.
    for (key, payload) in [
        ("pay-1", "EUR 10"),
        ("pay-1", "EUR 99"),
        ("poison", "EUR ??"),
        ("pay-2", "EUR 20"),
    ] {
        let key = idempotency_core::Key::new(key).unwrap();
        idempotency_kafka::publish(
            &cluster.producer,
            "payments",
            &key,
            Some(b"account-1"),
            payload.as_bytes(),
        )
        .await
        .unwrap();
    }
    // Commits of this group fail twice before they succeed.
    cluster.cluster.request_errors(
        rdkafka::types::RDKafkaApiKey::OffsetCommit,
        &[rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_OFFSET_METADATA_TOO_LARGE; 2],
    );
    let (store, charger) = (MemoryStore::new(), Arc::new(Charger::default()));
    let worker = start(
        &cluster,
        "dead",
        "payments",
        "dead-letter-test",
        processor(&store, &charger),
    );
    let dead = cluster.read("payments.dead", 2).await;
    eventually(LIMIT, "the group's offsets at the end", || {
        cluster.committed_and_end("dead", "payments", 2) == (4, 4)
    })
    .await;
    // Still running: a later payment is processed.
    cluster.publish("payments", "pay-3", b"EUR 30").await;
    eventually(LIMIT, "pay-3 executed", || charger.ledger.keys() == 3).await;
    assert!(!worker.1.is_finished());
    stop_all(vec![worker]).await;

    let header = |message: &KafkaMessage, name: &str| {
        String::from_utf8_lossy(message.header(name).unwrap_or_default()).into_owned()
    };
    let dead: Vec<KafkaMessage> = dead.into_iter().map(KafkaMessage::new).collect();
    assert_eq!(header(&dead[0], "Idempotency-Key"), "pay-1");
    let all = dead[0].headers();
    assert!(
        all.contains(&("Idempotency-Key".to_owned(), b"pay-1".to_vec())),
        "{all:?}"
    );
    assert!(
        all.iter().any(|(name, _)| name == "Idempotency-Dead-Reason"),
        "{all:?}"
    );
    assert!(header(&dead[0], "Idempotency-Dead-Reason").contains("different payload"));
    assert_eq!(header(&dead[0], "Idempotency-Dead-Source"), "payments");
    // Both from account-1's partition: the reused key at offset 1, the poison at offset 2.
    let partition = header(&dead[0], "Idempotency-Dead-Partition");
    assert!(["0", "1"].contains(&partition.as_str()), "{partition}");
    assert_eq!(header(&dead[1], "Idempotency-Dead-Partition"), partition);
    assert_eq!(header(&dead[0], "Idempotency-Dead-Offset"), "1");
    assert_eq!(header(&dead[1], "Idempotency-Dead-Offset"), "2");
    // The consumer guide's header tables describe every header a dead letter carries.
    let guide = include_str!("../../../../docs/CONSUMERS.md");
    let written: Vec<_> = all
        .iter()
        .filter(|(name, _)| name.starts_with("Idempotency-Dead-"))
        .collect();
    assert_eq!(written.len(), 6, "{written:?}");
    for (name, _) in written {
        assert!(
            guide.contains(&format!("| `{name}` |")),
            "docs/CONSUMERS.md does not describe {name}"
        );
    }
    assert_eq!(header(&dead[1], "Idempotency-Key"), "poison");
    assert!(header(&dead[1], "Idempotency-Dead-Reason").starts_with("panic:"));
    assert_eq!(header(&dead[1], "Idempotency-Dead-Deliveries"), "3");
    charger
        .ledger
        .assert_once_each(["pay-1", "pay-2", "pay-3"].map(String::from));
    // pay-1, pay-2, pay-3, and the poison message three times.
    assert_eq!(charger.ledger.calls(), 6);

    let metrics = idempotency_testkit::recorded::global();
    let labels = |extra: (&'static str, &'static str)| {
        [("consumer", "dead-letter-test"), ("topic", "payments"), extra]
    };
    let messages = |result| metrics.counter("idempotency_kafka_messages_total", &labels(("result", result)));
    assert_eq!(messages("acked"), 3);
    assert_eq!(messages("dead_lettered"), 2);
    assert_eq!(
        messages("retried"),
        2,
        "the poison message's first two deliveries"
    );
    assert!(metrics.counter("idempotency_kafka_commits_total", &labels(("result", "ok"))) >= 1);
    assert_eq!(
        metrics.counter("idempotency_kafka_commits_total", &labels(("result", "failed"))),
        2
    );
    assert!(metrics.counter("idempotency_kafka_rebalances_total", &labels(("kind", "assign"))) >= 1);
    assert!(metrics.counter("idempotency_kafka_rebalances_total", &labels(("kind", "revoke"))) >= 1);
    let gauge = |name| metrics.gauge(name, &[("consumer", "dead-letter-test")]);
    assert_eq!(
        gauge("idempotency_kafka_paused_partitions"),
        0.0,
        "a partition still counted as held"
    );
    assert_eq!(gauge("idempotency_kafka_commit_lag"), 0.0);
}

/// Settings without a group, or with a setting librdkafka does not know, are refused with a
/// message that says which; a password in the settings never shows in the worker's `Debug`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_settings_are_refused_and_secrets_stay_hidden() {
    let (store, charger) = (MemoryStore::new(), Arc::new(Charger::default()));
    let mut no_group = rdkafka::ClientConfig::new();
    no_group.set("bootstrap.servers", "127.0.0.1:1");
    let worker = Worker::new(no_group, "orders", processor(&store, &charger));
    let error = worker.run_until(std::future::pending()).await.unwrap_err();
    assert!(error.to_string().contains("group.id"), "{error}");

    let mut unknown = rdkafka::ClientConfig::new();
    unknown
        .set("bootstrap.servers", "127.0.0.1:1")
        .set("group.id", "g")
        .set("no.such.setting", "1");
    let worker = Worker::new(unknown, "orders", processor(&store, &charger));
    let error = worker.run_until(std::future::pending()).await.unwrap_err();
    assert!(error.to_string().contains("no.such.setting"), "{error}");

    let mut secret = rdkafka::ClientConfig::new();
    secret
        .set("bootstrap.servers", "127.0.0.1:1")
        .set("group.id", "g")
        .set("sasl.password", "hunter2-secret");
    let worker = Worker::new(secret, "orders", processor(&store, &charger));
    let shown = format!("{worker:?}");
    assert!(!shown.contains("hunter2"), "{shown}");
    assert!(shown.contains("orders"), "{shown}");
}
