//! Idempotent consumption against librdkafka's in-process Kafka cluster (`MockCluster`: consumer
//! groups with committed offsets, an idempotent producer), each test with a ledger of side
//! effects that must count exactly one per key: a producer that writes every event twice, a
//! consumer that dies between its handler and its commit, a reused key and a poison message.

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Cluster, committed_and_end};
use idempotency_consumer::{Backoff, Consumer, Delivery, Disposition, Handler, HandlerError, Processor};
use idempotency_core::{Attempt, Key, MemoryStore, Outcome};
use idempotency_kafka::{DEAD_OFFSET_HEADER, KafkaMessage, process, publish};
use rdkafka::consumer::{Consumer as _, StreamConsumer};

const TOPIC: &str = "payments";
const DEAD: &str = "payments.dead";
const PARTITIONS: i32 = 4;

/// The cluster with the topic and its dead-letter topic.
fn cluster() -> Cluster {
    Cluster::new(1, &[(TOPIC, PARTITIONS), (DEAD, 1)])
}

/// A member of `group` subscribed to `topic`.
fn subscribed(cluster: &Cluster, group: &str, topic: &str) -> StreamConsumer {
    let consumer: StreamConsumer = cluster.config(group).create().unwrap();
    consumer.subscribe(&[topic]).unwrap();
    consumer
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
    let cluster = cluster();
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
    let consumer = subscribed(&cluster, "twice", TOPIC);
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
    let (committed, end) = committed_and_end(&consumer, TOPIC, PARTITIONS);
    assert_eq!((committed, end), (100, 100));
}

/// A consumer that ran its handler and died before committing: the next consumer of the group
/// reads the messages again, and the record answers them without running the handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_dying_before_its_commit_costs_no_second_effect() {
    let cluster = cluster();
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
        let first = subscribed(&cluster, "crash", TOPIC);
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
    let second = subscribed(&cluster, "crash", TOPIC);
    let dispositions = consume(&second, &cluster, &processor, 20).await;
    assert!(dispositions.iter().all(|d| *d == Disposition::Ack));
    assert_eq!(charger.calls.load(Ordering::SeqCst), 20, "a message ran twice");
    assert!(charger.charges.lock().unwrap().values().all(|&n| n == 1));
    assert_eq!(committed_and_end(&second, TOPIC, PARTITIONS), (20, 20));
}

/// A key reused with another payload and a handler that panics every time go to the dead-letter
/// topic with their reasons and source; the consumer goes on with the next messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_key_and_a_poison_message_are_dead_lettered_and_consumption_goes_on() {
    let cluster = cluster();
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
    let consumer = subscribed(&cluster, "dead", TOPIC);
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
    assert_eq!(committed_and_end(&consumer, TOPIC, PARTITIONS), (4, 4));

    let reader = subscribed(&cluster, "dead-reader", DEAD);
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
