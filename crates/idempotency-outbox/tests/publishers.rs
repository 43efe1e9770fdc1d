//! The relay's NATS and Kafka publishers: the outbox key on every message, JetStream dropping a
//! republish by `Nats-Msg-Id`, and Kafka keeping an aggregate's events in order by record key.

mod common;

use std::time::Duration;

use async_nats::jetstream;
use common::{fresh, pool};
use idempotency_outbox::{NatsPublisher, Outbox, OutgoingMessage, Relay};
use idempotency_postgres::sqlx::{self, AssertSqlSafe};

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// A relay that crashed before marking publishes everything again: the stream keeps one copy
/// of each message, and each carries its outbox key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_drops_a_republish_by_its_message_id() {
    let pool = pool().await;
    let (tables, _) = fresh(&pool).await;
    let suffix = tables.qualified_outbox().rsplit('_').next().unwrap().to_owned();
    let client = async_nats::connect(nats_url())
        .await
        .unwrap_or_else(|e| panic!("NATS at {} is needed for this test: {e}", nats_url()));
    let context = jetstream::new(client);
    let name = format!("OUTBOX_{suffix}");
    let subject = format!("outbox.{suffix}.orders");
    let mut stream = context
        .create_stream(jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            duplicate_window: Duration::from_secs(60),
            max_age: Duration::from_secs(600),
            ..Default::default()
        })
        .await
        .unwrap();
    let outbox = Outbox::new(tables.clone());
    let mut tx = pool.begin().await.unwrap();
    for n in 0..20 {
        let message = OutgoingMessage::new(&subject, format!("order-{}", n % 4), format!("event {n}"))
            .header("trace", "t-1");
        outbox.enqueue(&mut tx, &message).await.unwrap();
    }
    tx.commit().await.unwrap();
    let relay = Relay::new(pool.clone(), outbox, NatsPublisher::new(context.clone())).name("nats-test");
    assert_eq!(relay.relay_batch().await.unwrap(), 20);
    // As if the relay had died between publishing and marking.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "UPDATE {} SET sent_at = NULL",
        tables.qualified_outbox()
    )))
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(relay.relay_batch().await.unwrap(), 20);
    assert_eq!(
        stream.info().await.unwrap().state.messages,
        20,
        "the stream kept a republished copy"
    );
    let first = stream.get_raw_message(1).await.unwrap();
    let key = first.headers.get("Idempotency-Key").unwrap().as_str().to_owned();
    assert!(key.starts_with("nats-test:"), "{key}");
    assert_eq!(first.headers.get("Nats-Msg-Id").unwrap().as_str(), key);
    assert_eq!(first.headers.get("trace").unwrap().as_str(), "t-1");
    context.delete_stream(&name).await.unwrap();
}

/// Kafka: every aggregate's events arrive in order on one partition, keyed by the ordering key,
/// each with its outbox key.
#[cfg(feature = "kafka")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_keeps_each_aggregate_in_order_by_record_key() {
    use std::collections::HashMap;

    use idempotency_outbox::KafkaPublisher;
    use rdkafka::consumer::{Consumer, StreamConsumer};
    use rdkafka::message::{Headers, Message};
    use rdkafka::{ClientConfig, Offset, TopicPartitionList};

    let pool = pool().await;
    let (tables, _) = fresh(&pool).await;
    let cluster = rdkafka::mocking::MockCluster::new(1).unwrap();
    cluster.create_topic("orders", 3, 1).unwrap();
    let outbox = Outbox::new(tables.clone());
    let mut tx = pool.begin().await.unwrap();
    for n in 0..30 {
        let message = OutgoingMessage::new(
            "orders",
            format!("order-{}", n % 3),
            format!("{}/{}", n % 3, n / 3),
        );
        outbox.enqueue(&mut tx, &message).await.unwrap();
    }
    tx.commit().await.unwrap();
    let publisher = KafkaPublisher::new(&cluster.bootstrap_servers()).unwrap();
    let relay = Relay::new(pool.clone(), outbox, publisher).name("kafka-test");
    assert_eq!(relay.relay_batch().await.unwrap(), 30);

    let reader: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", cluster.bootstrap_servers())
        .set("group.id", "readers")
        .create()
        .unwrap();
    let mut list = TopicPartitionList::new();
    for partition in 0..3 {
        list.add_partition_offset("orders", partition, Offset::Beginning)
            .unwrap();
    }
    reader.assign(&list).unwrap();
    let mut next: HashMap<String, u32> = HashMap::new();
    let mut partitions: HashMap<String, i32> = HashMap::new();
    for _ in 0..30 {
        let message = tokio::time::timeout(Duration::from_secs(30), reader.recv())
            .await
            .unwrap()
            .unwrap();
        let record_key = String::from_utf8(message.key().unwrap().to_vec()).unwrap();
        let payload = String::from_utf8(message.payload().unwrap().to_vec()).unwrap();
        let sequence: u32 = payload.split_once('/').unwrap().1.parse().unwrap();
        let expected = next.entry(record_key.clone()).or_default();
        assert_eq!(sequence, *expected, "{record_key} out of order");
        *expected += 1;
        let partition = *partitions
            .entry(record_key.clone())
            .or_insert(message.partition());
        assert_eq!(partition, message.partition(), "{record_key} on two partitions");
        let headers = message.headers().unwrap();
        let key = headers
            .iter()
            .find(|header| header.key == "Idempotency-Key")
            .and_then(|header| header.value)
            .map(|value| String::from_utf8(value.to_vec()).unwrap())
            .unwrap();
        assert!(key.starts_with("kafka-test:"), "{key}");
    }
    assert!(next.values().all(|n| *n == 10), "{next:?}");
}
