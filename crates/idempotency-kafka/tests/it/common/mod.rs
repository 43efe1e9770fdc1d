//! What the Kafka tests share: a mock cluster with its producer, consumer settings, the
//! group's committed offsets, and a ledger of side effects.

#![allow(dead_code, unreachable_pub)] // each test crate uses a part

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idempotency_core::{IDEMPOTENCY_KEY_HEADER, Key};
use idempotency_kafka::{idempotent_producer, publish};
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{DefaultProducerContext, FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

/// An in-process cluster and an idempotent producer on it.
pub struct Cluster {
    // Declared first so it is dropped last: the clients below talk to it.
    pub producer: FutureProducer,
    pub cluster: MockCluster<'static, DefaultProducerContext>,
}

impl Cluster {
    /// `brokers` brokers, and `topics` with their partition counts.
    pub fn new(brokers: i32, topics: &[(&str, i32)]) -> Self {
        let cluster = MockCluster::new(brokers).expect("librdkafka's mock cluster");
        for (topic, partitions) in topics {
            cluster.create_topic(topic, *partitions, 1).unwrap();
        }
        let producer = idempotent_producer(&cluster.bootstrap_servers()).unwrap();
        Self { producer, cluster }
    }

    /// Client settings for a member of `group`: no automatic commits, and a member that dies
    /// is out of the group within seconds rather than the default 45 s.
    pub fn config(&self, group: &str) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", self.cluster.bootstrap_servers())
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500");
        config
    }

    /// Publishes `payload` with `key` as its Idempotency-Key and its record key.
    pub async fn publish(&self, topic: &str, key: &str, payload: &[u8]) {
        let key = Key::new(key).unwrap();
        publish(
            &self.producer,
            topic,
            &key,
            Some(key.as_str().as_bytes()),
            payload,
        )
        .await
        .unwrap();
    }

    /// Publishes `key` (its Idempotency-Key and record key) to `partition` of `topic`.
    pub async fn publish_to(&self, topic: &str, partition: i32, key: &str) {
        let headers = OwnedHeaders::new().insert(Header {
            key: IDEMPOTENCY_KEY_HEADER,
            value: Some(key),
        });
        let record = FutureRecord::to(topic)
            .partition(partition)
            .key(key)
            .payload("EUR 10")
            .headers(headers);
        self.producer.send(record, Duration::from_secs(30)).await.unwrap();
    }

    /// Publishes one event per key of `keys` (each its own record key), all at once.
    pub async fn publish_all(&self, topic: &str, keys: &[String]) {
        futures_util::future::join_all(keys.iter().map(|key| self.publish(topic, key, b"EUR 10"))).await;
    }

    /// The first `count` messages of partition 0 of `topic`, read without joining a group.
    pub async fn read(&self, topic: &str, count: usize) -> Vec<OwnedMessage> {
        let reader: StreamConsumer = self.config("readers").create().unwrap();
        let mut list = TopicPartitionList::new();
        list.add_partition_offset(topic, 0, Offset::Beginning).unwrap();
        reader.assign(&list).unwrap();
        let mut messages = Vec::new();
        while messages.len() < count {
            let message = tokio::time::timeout(Duration::from_secs(30), reader.recv())
                .await
                .expect("a message within 30 s")
                .unwrap();
            messages.push(message.detach());
        }
        messages
    }

    /// The committed offsets of `group` summed over the partitions of `topic`, and the sum of
    /// their high watermarks.
    pub fn committed_and_end(&self, group: &str, topic: &str, partitions: i32) -> (i64, i64) {
        // A client of the group that does not join it: it only reads the group's offsets.
        let reader: BaseConsumer = self.config(group).create().unwrap();
        committed_and_end(&reader, topic, partitions)
    }

    /// The group's committed offset (0 when none is committed) and the high watermark of each
    /// of the first `partitions` partitions of `topic`, in partition order.
    pub fn committed_and_end_each(&self, group: &str, topic: &str, partitions: i32) -> Vec<(i64, i64)> {
        let reader: BaseConsumer = self.config(group).create().unwrap();
        committed_and_end_each(&reader, topic, partitions)
    }
}

/// `consumer`'s group's committed offsets summed over the partitions of `topic`, and the sum
/// of their high watermarks.
pub fn committed_and_end<C: Consumer>(consumer: &C, topic: &str, partitions: i32) -> (i64, i64) {
    committed_and_end_each(consumer, topic, partitions)
        .into_iter()
        .fold((0, 0), |(committed, end), (c, e)| (committed + c, end + e))
}

/// `consumer`'s group's committed offset (0 when none is committed) and the high watermark of
/// each of the first `partitions` partitions of `topic`, in partition order: the offsets in
/// one request, the watermarks one request each.
fn committed_and_end_each<C: Consumer>(consumer: &C, topic: &str, partitions: i32) -> Vec<(i64, i64)> {
    let mut list = TopicPartitionList::new();
    for partition in 0..partitions {
        list.add_partition(topic, partition);
    }
    let committed = consumer.committed_offsets(list, Duration::from_secs(10)).unwrap();
    (0..partitions)
        .map(|partition| {
            let committed = match committed
                .find_partition(topic, partition)
                .map(|found| found.offset())
            {
                Some(Offset::Offset(n)) => n,
                _ => 0,
            };
            let end = consumer
                .fetch_watermarks(topic, partition, Duration::from_secs(10))
                .unwrap()
                .1;
            (committed, end)
        })
        .collect()
}

/// Side effects by key, and handler calls.
#[derive(Default)]
pub struct Ledger {
    effects: Mutex<HashMap<String, u32>>,
    pub calls: AtomicU32,
}

impl Ledger {
    /// Counts a call.
    pub fn called(&self) {
        self.calls.fetch_add(1, Ordering::SeqCst);
    }

    /// Records one effect of `key`.
    pub fn effect(&self, key: &str) {
        *self.effects.lock().unwrap().entry(key.to_owned()).or_default() += 1;
    }

    /// The effects so far.
    pub fn effects(&self) -> HashMap<String, u32> {
        self.effects.lock().unwrap().clone()
    }

    /// How many keys had an effect.
    pub fn keys(&self) -> usize {
        self.effects.lock().unwrap().len()
    }

    /// Handler calls so far.
    pub fn calls(&self) -> u32 {
        self.calls.load(Ordering::SeqCst)
    }

    /// Asserts that every key of `expected` had exactly one effect, and no other key had any.
    pub fn assert_once_each(&self, expected: impl IntoIterator<Item = String>) {
        let effects = self.effects();
        let expected: std::collections::BTreeSet<String> = expected.into_iter().collect();
        let twice: Vec<_> = effects.iter().filter(|(_, n)| **n > 1).collect();
        assert!(twice.is_empty(), "executed more than once: {twice:?}");
        let missing: Vec<_> = expected
            .iter()
            .filter(|key| !effects.contains_key(*key))
            .collect();
        assert!(missing.is_empty(), "never executed: {missing:?}");
        assert_eq!(effects.len(), expected.len(), "unexpected keys executed");
    }
}

/// [`idempotency_testkit::eventually`] for the conditions these tests check without awaiting.
pub async fn eventually(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    idempotency_testkit::eventually(limit, what, async || done()).await;
}
