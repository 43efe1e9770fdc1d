//! Idempotent consumption against librdkafka's in-process Kafka cluster (`MockCluster`: consumer
//! groups with committed offsets, an idempotent producer), each test with a ledger of side
//! effects that must count exactly one per key: a producer that writes every event twice, a
//! consumer that dies between its handler and its commit, a reused key and a poison message.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_consumer::{Backoff, Consumer, Delivery, Disposition, Handler, HandlerError, Processor};
use idempotency_core::{Attempt, Key, MemoryStore, Outcome};
use idempotency_kafka::{DEAD_OFFSET_HEADER, KafkaMessage, idempotent_producer, process, publish};
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::FutureProducer;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

const TOPIC: &str = "payments";
const DEAD: &str = "payments.dead";
const PARTITIONS: i32 = 4;

struct Cluster {
    // Declared first so it is dropped last: the clients below talk to it.
    producer: FutureProducer,
    cluster: MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
}

impl Cluster {
    fn new() -> Self {
        let cluster = MockCluster::new(1).expect("librdkafka's mock cluster");
        cluster.create_topic(TOPIC, PARTITIONS, 1).unwrap();
        cluster.create_topic(DEAD, 1, 1).unwrap();
        let producer = idempotent_producer(&cluster.bootstrap_servers()).unwrap();
        Self { producer, cluster }
    }

    fn consumer(&self, group: &str, topic: &str) -> StreamConsumer {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.cluster.bootstrap_servers())
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            // A consumer that dies is out of the group within seconds, not the default 45 s.
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500")
            .create()
            .unwrap();
        consumer.subscribe(&[topic]).unwrap();
        consumer
    }

    /// The group's committed offsets summed over the topic's partitions, and the sum of the
    /// partitions' high watermarks.
    fn committed_and_end(&self, consumer: &StreamConsumer) -> (i64, i64) {
        let mut list = TopicPartitionList::new();
        for partition in 0..PARTITIONS {
            list.add_partition(TOPIC, partition);
        }
        let committed = consumer
            .committed_offsets(list, Duration::from_secs(5))
            .unwrap()
            .elements()
            .iter()
            .map(|element| match element.offset() {
                Offset::Offset(n) => n,
                _ => 0,
            })
            .sum();
        let end = (0..PARTITIONS)
            .map(|partition| {
                consumer
                    .fetch_watermarks(TOPIC, partition, Duration::from_secs(5))
                    .unwrap()
                    .1
            })
            .sum();
        (committed, end)
    }
}

/// Charges once per call, by key; the poison key panics every time.
#[derive(Default)]
struct Charger {
    charges: Mutex<HashMap<String, u32>>,
    calls: AtomicU32,
}

impl Handler<KafkaMessage> for Charger {
    async fn handle(&self, message: &KafkaMessage, attempt: &Attempt) -> Result<Outcome, HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if attempt.key().as_str() == "poison" {
            panic!("poison message: cannot parse the payment");
        }
        *self
            .charges
            .lock()
            .unwrap()
            .entry(attempt.key().to_string())
            .or_default() += 1;
        Ok(Outcome::new(message.payload().to_vec()))
    }
}

type TestConsumer = Consumer<MemoryStore, Arc<Charger>>;

fn processor(store: &MemoryStore, charger: &Arc<Charger>) -> TestConsumer {
    Consumer::new("kafka-tests", store.clone(), Arc::clone(charger))
        .backoff(Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(50),
        })
        .max_deliveries(3)
}

/// Receives and processes `count` messages, one after another; returns the dispositions.
async fn consume(
    consumer: &StreamConsumer,
    cluster: &Cluster,
    processor: &TestConsumer,
    count: usize,
) -> Vec<Disposition> {
    let mut dispositions = Vec::new();
    while dispositions.len() < count {
        let message = tokio::time::timeout(Duration::from_secs(60), consumer.recv())
            .await
            .expect("a message within 60 s")
            .unwrap()
            .detach();
        dispositions.push(
            process(processor, consumer, &cluster.producer, DEAD, message)
                .await
                .unwrap(),
        );
    }
    dispositions
}

/// A producer that writes every event twice (as a producer retry above the client does): each
/// event has one effect, the copies are acked as duplicates, and the group's committed offsets
/// reach the end of every partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_written_twice_has_one_effect() {
    let cluster = Cluster::new();
    for n in 0..50 {
        let key = Key::new(format!("pay-{n}")).unwrap();
        for _ in 0..2 {
            publish(
                &cluster.producer,
                TOPIC,
                &key,
                Some(key.as_str().as_bytes()),
                b"EUR 10",
            )
            .await
            .unwrap();
        }
    }
    let (store, charger) = (MemoryStore::new(), Arc::new(Charger::default()));
    let consumer = cluster.consumer("twice", TOPIC);
    let dispositions = consume(&consumer, &cluster, &processor(&store, &charger), 100).await;
    assert!(
        dispositions.iter().all(|d| *d == Disposition::Ack),
        "{dispositions:?}"
    );
    let charges = charger.charges.lock().unwrap().clone();
    assert_eq!(charges.len(), 50);
    assert!(charges.values().all(|&n| n == 1), "{charges:?}");
    assert_eq!(
        charger.calls.load(Ordering::SeqCst),
        50,
        "the copies ran the handler"
    );
    let (committed, end) = cluster.committed_and_end(&consumer);
    assert_eq!((committed, end), (100, 100));
}

/// A consumer that ran its handler and died before committing: the next consumer of the group
/// reads the messages again, and the record answers them without running the handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_dying_before_its_commit_costs_no_second_effect() {
    let cluster = Cluster::new();
    for n in 0..20 {
        let key = Key::new(format!("order-{n}")).unwrap();
        publish(&cluster.producer, TOPIC, &key, None, b"EUR 10")
            .await
            .unwrap();
    }
    let (store, charger) = (MemoryStore::new(), Arc::new(Charger::default()));
    let processor = processor(&store, &charger);
    {
        // The first consumer handles every message and records it, and dies before committing.
        let first = cluster.consumer("crash", TOPIC);
        for _ in 0..20 {
            let message = tokio::time::timeout(Duration::from_secs(20), first.recv())
                .await
                .unwrap()
                .unwrap()
                .detach();
            assert_eq!(
                processor.process(&KafkaMessage::new(message)).await,
                Disposition::Ack
            );
        }
    }
    assert_eq!(charger.calls.load(Ordering::SeqCst), 20);
    let second = cluster.consumer("crash", TOPIC);
    let dispositions = consume(&second, &cluster, &processor, 20).await;
    assert!(dispositions.iter().all(|d| *d == Disposition::Ack));
    assert_eq!(charger.calls.load(Ordering::SeqCst), 20, "a message ran twice");
    assert!(charger.charges.lock().unwrap().values().all(|&n| n == 1));
    assert_eq!(cluster.committed_and_end(&second), (20, 20));
}

/// A key reused with another payload and a handler that panics every time go to the dead-letter
/// topic with their reasons and source; the consumer goes on with the next messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_key_and_a_poison_message_are_dead_lettered_and_consumption_goes_on() {
    let cluster = Cluster::new();
    // One partition's order, by record key: the reuse and the poison come before a healthy one.
    let record_key = Some(&b"account-1"[..]);
    let key = |text: &str| Key::new(text).unwrap();
    publish(&cluster.producer, TOPIC, &key("pay-1"), record_key, b"EUR 10")
        .await
        .unwrap();
    publish(&cluster.producer, TOPIC, &key("pay-1"), record_key, b"EUR 99")
        .await
        .unwrap();
    publish(&cluster.producer, TOPIC, &key("poison"), record_key, b"EUR ??")
        .await
        .unwrap();
    publish(&cluster.producer, TOPIC, &key("pay-2"), record_key, b"EUR 20")
        .await
        .unwrap();
    let (store, charger) = (MemoryStore::new(), Arc::new(Charger::default()));
    let consumer = cluster.consumer("dead", TOPIC);
    let dispositions = consume(&consumer, &cluster, &processor(&store, &charger), 4).await;
    assert_eq!(dispositions[0], Disposition::Ack);
    assert!(
        matches!(&dispositions[1], Disposition::DeadLetter { reason } if reason.contains("different payload"))
    );
    assert!(matches!(&dispositions[2], Disposition::DeadLetter { reason } if reason.starts_with("panic:")));
    assert_eq!(dispositions[3], Disposition::Ack);
    let charges = charger.charges.lock().unwrap().clone();
    assert_eq!(charges, HashMap::from([("pay-1".into(), 1), ("pay-2".into(), 1)]));
    // pay-1, pay-2, and the poison message three times (the delivery limit).
    assert_eq!(charger.calls.load(Ordering::SeqCst), 5);
    assert_eq!(cluster.committed_and_end(&consumer), (4, 4));

    let reader = cluster.consumer("dead-reader", DEAD);
    let mut dead = Vec::new();
    while dead.len() < 2 {
        let message = tokio::time::timeout(Duration::from_secs(20), reader.recv())
            .await
            .unwrap()
            .unwrap()
            .detach();
        let message = KafkaMessage::new(message);
        let text =
            |name: &str| String::from_utf8_lossy(message.header(name).unwrap_or_default()).into_owned();
        dead.push((
            text("Idempotency-Key"),
            text("Idempotency-Dead-Reason"),
            text("Idempotency-Dead-Source"),
            text(DEAD_OFFSET_HEADER),
            text("Idempotency-Dead-Deliveries"),
        ));
    }
    assert_eq!(
        (dead[0].0.as_str(), dead[0].2.as_str(), dead[0].3.as_str()),
        ("pay-1", TOPIC, "1"),
        "{dead:?}"
    );
    assert!(dead[0].1.contains("different payload"), "{dead:?}");
    assert_eq!(
        (dead[1].0.as_str(), dead[1].3.as_str(), dead[1].4.as_str()),
        ("poison", "2", "3"),
        "{dead:?}"
    );
    assert!(dead[1].1.starts_with("panic:"), "{dead:?}");
}
