//! The broker suite (`idempotency_testkit::adapter_suite!`) on librdkafka's in-process
//! cluster, each case on a cluster of its own: a three-partition topic, its dead-letter topic,
//! and a group whose dead members are noticed within seconds. The cluster has two brokers: the
//! first leads the topic and coordinates the group, the second leads the dead-letter topic, so
//! that a case can stall the dead-letter copies alone.

use crate::common;

use std::time::Duration;

use common::committed_and_end;
use idempotency_consumer::adapter::DEFAULT_SETTLE_TIMEOUT;
use idempotency_consumer::source::SourceKind;
use idempotency_core::IDEMPOTENCY_KEY_HEADER;
use idempotency_testkit::brokers::{
    BrokerHarness, BrokerSource, DeadLetter, Foreign, ForeignKeys, LIMIT, MessageIds,
};
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::mocking::{MockCluster, MockCoordinator};
use rdkafka::producer::{DefaultProducerContext, FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

const PARTITIONS: i32 = 3;

/// The workers' consumer group.
const GROUP: &str = "suite";

/// The broker that leads the topic and coordinates the group.
const WORK_BROKER: i32 = 1;

/// The broker that leads the dead-letter topic.
const DEAD_LETTER_BROKER: i32 = 2;

/// How late the dead-letter broker answers while stalled: well past the pipeline's settle
/// timeout, and then it answers.
const STALL: Duration = DEFAULT_SETTLE_TIMEOUT.saturating_mul(2);

struct Kafka;

struct Topic {
    // Declared first so that it is dropped first: it talks to the cluster.
    producer: FutureProducer,
    cluster: MockCluster<'static, DefaultProducerContext>,
}

impl BrokerHarness for Kafka {
    type Source = Topic;

    async fn source(&self, _case: &str) -> Topic {
        let cluster = MockCluster::new(2).expect("librdkafka's mock cluster");
        cluster.create_topic("work", PARTITIONS, 1).unwrap();
        cluster.create_topic("work.dead", 1, 1).unwrap();
        for partition in 0..PARTITIONS {
            cluster
                .partition_leader("work", partition, Some(WORK_BROKER))
                .unwrap();
        }
        cluster
            .partition_leader("work.dead", 0, Some(DEAD_LETTER_BROKER))
            .unwrap();
        cluster
            .coordinator(MockCoordinator::Group(GROUP.into()), WORK_BROKER)
            .unwrap();
        let producer = idempotency_kafka::idempotent_producer(&cluster.bootstrap_servers()).unwrap();
        Topic { producer, cluster }
    }
}

impl Topic {
    fn client(&self, group: &str) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", self.cluster.bootstrap_servers())
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest");
        config
    }
}

impl BrokerSource for Topic {
    fn kind(&self) -> SourceKind {
        idempotency_kafka::SOURCE
    }

    fn url(&self) -> String {
        format!(
            "kafka://{}?topic=work&group={GROUP}&session.timeout.ms=6000&heartbeat.interval.ms=500",
            self.cluster.bootstrap_servers()
        )
    }

    fn hold(&self) -> Option<Duration> {
        None
    }

    async fn publish(&self, key: Option<&str>, payload: &[u8]) {
        let mut record = FutureRecord::<[u8], [u8]>::to("work").payload(payload);
        if let Some(key) = key {
            let headers = OwnedHeaders::new().insert(Header {
                key: IDEMPOTENCY_KEY_HEADER,
                value: Some(key),
            });
            record = record.headers(headers).key(key.as_bytes());
        }
        self.producer.send(record, Duration::from_secs(30)).await.unwrap();
    }

    async fn publish_foreign(&self, message: Foreign<'_>) {
        let mut headers = OwnedHeaders::new();
        for (name, value) in message.headers {
            headers = headers.insert(Header {
                key: name,
                value: Some(*value),
            });
        }
        let mut record = FutureRecord::<str, [u8]>::to("work")
            .payload(message.payload)
            .headers(headers);
        if let Some(key) = message.record_key {
            record = record.key(key);
        }
        self.producer.send(record, Duration::from_secs(30)).await.unwrap();
    }

    fn foreign_keys(&self) -> ForeignKeys {
        ForeignKeys {
            message_id: MessageIds::Absent,
            record_key: true,
        }
    }

    async fn dead_letters(&self) -> Vec<DeadLetter> {
        let reader: StreamConsumer = self.client("dead-letter-readers").create().unwrap();
        let mut list = TopicPartitionList::new();
        list.add_partition_offset("work.dead", 0, Offset::Beginning)
            .unwrap();
        reader.assign(&list).unwrap();
        // As many as the topic holds, read up to its end (not until two quiet seconds pass:
        // the cases read the dead letters again and again while they wait for them).
        let (_, end) =
            tokio::task::block_in_place(|| reader.fetch_watermarks("work.dead", 0, Duration::from_secs(10)))
                .unwrap();
        let mut found = Vec::new();
        while found.len() < usize::try_from(end).unwrap() {
            let message = tokio::time::timeout(LIMIT, reader.recv())
                .await
                .expect("the dead letters up to the topic's end")
                .unwrap();
            let headers = message.headers().into_iter().flat_map(Headers::iter);
            found.push(DeadLetter::new(headers.map(|header| {
                let value = header.value.map(String::from_utf8_lossy).unwrap_or_default();
                (header.key.to_owned(), value.into_owned())
            })));
        }
        found
    }

    /// The group's committed offsets behind the partitions' ends.
    async fn outstanding(&self) -> u64 {
        let reader: BaseConsumer = self.client(GROUP).create().unwrap();
        tokio::task::spawn_blocking(move || {
            let (committed, end) = committed_and_end(&reader, "work", PARTITIONS);
            u64::try_from(end - committed).unwrap_or(0)
        })
        .await
        .unwrap()
    }

    /// The cluster answers for the dead-letter topic that the client may not write to it.
    async fn refuse_dead_letters(&self, refuse: bool) {
        let error = if refuse {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED
        } else {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR
        };
        self.cluster.topic_error("work.dead", error).unwrap();
    }

    /// The dead-letter topic's broker answers [`STALL`] late, or at once again. (A worker
    /// settles an ack in its own memory: what it commits, the poll thread commits later.)
    async fn stall(&self, stalled: bool) {
        let delay = if stalled { STALL } else { Duration::ZERO };
        self.cluster
            .broker_round_trip_time(DEAD_LETTER_BROKER, delay)
            .unwrap();
    }
}

idempotency_testkit::adapter_suite!(Kafka);
