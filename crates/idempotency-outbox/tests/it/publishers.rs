//! The relay's NATS and Kafka publishers: the outbox key on every message, JetStream dropping a
//! republish by `Nats-Msg-Id`, and Kafka keeping an aggregate's events in order by record key.

use crate::common;

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

/// How long a publisher's first connection may take.
const CONNECT: Duration = Duration::from_secs(10);

/// Enqueues `count` messages to `destination` in one transaction.
async fn enqueue(
    pool: &idempotency_postgres::sqlx::PgPool,
    outbox: &Outbox,
    destination: &str,
    count: usize,
) {
    let mut tx = pool.begin().await.unwrap();
    for n in 0..count {
        let message = OutgoingMessage::new(destination, format!("order-{n}"), format!("event {n}"));
        outbox.enqueue(&mut tx, &message).await.unwrap();
    }
    tx.commit().await.unwrap();
}

/// The NATS server requiring TLS (`scripts/services nats-tls`), named as its certificate
/// names it.
fn nats_tls_url() -> String {
    std::env::var("NATS_TLS_URL").unwrap_or_else(|_| "tls://localhost:4223".into())
}

/// `NatsPublisher::connect` takes a source's connection parameters: over TLS with the test CA
/// and a client certificate every message reaches the stream; another CA and another name are
/// refused at connect with the cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_publisher_over_tls_delivers_and_another_ca_or_name_is_refused() {
    use idempotency_testkit::tls::file;

    let pool = pool().await;
    let (tables, _) = fresh(&pool).await;
    let suffix = tables.qualified_outbox().rsplit('_').next().unwrap().to_owned();
    let url = format!(
        "{}?ca={}&cert={}&key={}",
        nats_tls_url(),
        file("ca.pem"),
        file("client.pem"),
        file("client.key")
    );
    let client = idempotency_nats::connect_url(&url, CONNECT)
        .await
        .unwrap_or_else(|e| panic!("NATS with TLS is needed (scripts/services nats-tls): {e}"));
    let context = jetstream::new(client);
    let name = format!("OUTBOX_TLS_{suffix}");
    let subject = format!("outbox.tls.{suffix}");
    let mut stream = context
        .create_stream(jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            max_age: Duration::from_secs(600),
            ..Default::default()
        })
        .await
        .unwrap();
    let outbox = Outbox::new(tables.clone());
    enqueue(&pool, &outbox, &subject, 5).await;
    let publisher = NatsPublisher::connect(&url, CONNECT).await.unwrap();
    let relay = Relay::new(pool.clone(), outbox, publisher).name("nats-tls");
    assert_eq!(relay.relay_batch().await.unwrap(), 5);
    assert_eq!(stream.info().await.unwrap().state.messages, 5);
    context.delete_stream(&name).await.unwrap();

    for (url, cause) in [
        (
            format!("{}?ca={}", nats_tls_url(), file("other-ca.pem")),
            "UnknownIssuer",
        ),
        (
            format!("tls://127.0.0.1:4223?ca={}", file("ca.pem")),
            "not valid for name",
        ),
        (
            format!("{}?stream=S", nats_tls_url()),
            "unknown parameter `stream`",
        ),
        (
            format!("{}?ca=/nonexistent/ca.pem", nats_tls_url()),
            "`ca` /nonexistent/ca.pem: No such file",
        ),
    ] {
        let error = NatsPublisher::connect(&url, CONNECT).await.unwrap_err();
        assert!(error.to_string().contains(cause), "{url}: {error}");
    }
}

/// `KafkaPublisher::from_url` takes a source's librdkafka settings: over SASL_SSL with SCRAM
/// and the test CA (`scripts/services kafka-tls`) every message arrives with its outbox key;
/// with a wrong password nothing is delivered and every row stays pending.
#[cfg(all(feature = "kafka", feature = "tls"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_publisher_over_sasl_ssl_delivers_and_a_wrong_password_delivers_nothing() {
    use idempotency_outbox::{KafkaPublisher, outbox_stats};
    use idempotency_testkit::tls::file;
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::consumer::{Consumer, StreamConsumer};
    use rdkafka::message::{Headers, Message};
    use rdkafka::{ClientConfig, Offset, TopicPartitionList};

    let brokers = std::env::var("KAFKA_TLS_BROKERS").unwrap_or_else(|_| "localhost:9094".into());
    let security = [
        ("security.protocol", "SASL_SSL".to_owned()),
        ("sasl.mechanism", "SCRAM-SHA-512".to_owned()),
        ("ssl.ca.location", file("ca.pem")),
    ];
    let client = |password: &str| {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &brokers)
            .set("sasl.username", "idem")
            .set("sasl.password", password);
        for (name, value) in &security {
            config.set(*name, value);
        }
        config
    };
    let query: Vec<String> = security
        .iter()
        .map(|(name, value)| format!("{name}={value}"))
        .collect();
    // A refused login fails each delivery at its message timeout: short for the wrong password.
    let url = |password: &str, timeout_ms: u32| {
        format!(
            "kafka://idem:{password}@{brokers}?{}&message.timeout.ms={timeout_ms}",
            query.join("&")
        )
    };

    let pool = pool().await;
    let (tables, _) = fresh(&pool).await;
    let suffix = tables.qualified_outbox().rsplit('_').next().unwrap().to_owned();
    let topic = format!("outbox-tls-{suffix}");
    let admin: AdminClient<DefaultClientContext> = client("idem-test-password").create().unwrap();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let created = tokio::time::timeout(
        Duration::from_secs(30),
        admin.create_topics(&[NewTopic::new(&topic, 1, TopicReplication::Fixed(1))], &options),
    )
    .await
    .unwrap_or_else(|_| {
        panic!("the SASL_SSL Kafka broker at {brokers} is needed (scripts/services kafka-tls)")
    })
    .unwrap();
    created.into_iter().for_each(|result| {
        result.unwrap();
    });

    let outbox = Outbox::new(tables.clone());
    enqueue(&pool, &outbox, &topic, 4).await;
    let wrong = Relay::new(
        pool.clone(),
        outbox.clone(),
        KafkaPublisher::from_url(&url("not-the-password", 1500)).unwrap(),
    )
    .name("kafka-tls");
    assert!(wrong.relay_batch().await.is_err(), "a refused login delivered");
    assert_eq!(outbox_stats(&pool, &tables).await.unwrap().pending, 4);

    let relay = Relay::new(
        pool.clone(),
        outbox,
        KafkaPublisher::from_url(&url("idem-test-password", 30_000)).unwrap(),
    )
    .name("kafka-tls");
    assert_eq!(relay.relay_batch().await.unwrap(), 4);
    assert_eq!(outbox_stats(&pool, &tables).await.unwrap().pending, 0);

    let reader: StreamConsumer = client("idem-test-password")
        .set("group.id", format!("readers-{suffix}"))
        .create()
        .unwrap();
    let mut list = TopicPartitionList::new();
    list.add_partition_offset(&topic, 0, Offset::Beginning).unwrap();
    reader.assign(&list).unwrap();
    for n in 0..4 {
        let message = tokio::time::timeout(Duration::from_secs(30), reader.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(message.payload(), Some(format!("event {n}").as_bytes()));
        let key = message
            .headers()
            .unwrap()
            .iter()
            .find(|header| header.key == "Idempotency-Key")
            .and_then(|header| header.value)
            .unwrap();
        assert!(key.starts_with(b"kafka-tls:"), "{key:?}");
    }
}
