//! `idem consume` from Kafka: the binary as a process of its own, a member of a consumer group
//! on librdkafka's in-process cluster (which listens on loopback ports like a real one), and an
//! HTTP handler with a ledger of every call.

use crate::common;

use std::time::Duration;

use common::consume::{self, Broker};
use idempotency::Key;
use idempotency_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idempotency_kafka::rdkafka::client::DefaultClientContext;
use idempotency_kafka::rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use idempotency_kafka::rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use idempotency_kafka::rdkafka::mocking::MockCluster;
use idempotency_kafka::rdkafka::producer::{DefaultProducerContext, FutureProducer, FutureRecord};
use idempotency_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use idempotency_testkit::brokers::drained_partitions;

/// The work topic's partitions.
const PARTITIONS: i32 = 3;

/// The SASL_SSL broker of `scripts/services kafka-tls` (TLS with the test CA's localhost
/// certificate, SCRAM users).
fn tls_brokers() -> String {
    std::env::var("KAFKA_TLS_BROKERS").unwrap_or_else(|_| "localhost:9094".into())
}

/// The SCRAM user and password `scripts/services kafka-tls` makes.
const TLS_USER: &str = "idem";
const TLS_PASSWORD: &str = "idem-test-password";

/// A Kafka cluster with a work topic of the test's own and its dead-letter topic: librdkafka's
/// in-process cluster, or the SASL_SSL broker.
struct Kafka {
    // Declared first so it is dropped first: it talks to the cluster.
    producer: FutureProducer,
    /// The in-process cluster, kept running while the test lasts.
    _cluster: Option<MockCluster<'static, DefaultProducerContext>>,
    brokers: String,
    /// The librdkafka settings every client of the cluster needs (TLS, SASL).
    security: Vec<(&'static str, String)>,
    topic: String,
}

impl Kafka {
    fn new() -> Self {
        let cluster = MockCluster::new(1).expect("librdkafka's mock cluster");
        let topic = format!("payments-{}", Key::generate());
        cluster.create_topic(&topic, PARTITIONS, 1).unwrap();
        cluster.create_topic(&format!("{topic}.dead"), 1, 1).unwrap();
        let brokers = cluster.bootstrap_servers();
        let producer = idempotency_kafka::idempotent_producer(&brokers).unwrap();
        Self {
            producer,
            _cluster: Some(cluster),
            brokers,
            security: Vec::new(),
            topic,
        }
    }

    /// The SASL_SSL broker, SCRAM-SHA-512, verifying its certificate with the test CA; the
    /// topics are created through it.
    async fn sasl_ssl() -> Self {
        let security = vec![
            ("security.protocol", "SASL_SSL".to_owned()),
            ("sasl.mechanism", "SCRAM-SHA-512".to_owned()),
            ("sasl.username", TLS_USER.to_owned()),
            ("sasl.password", TLS_PASSWORD.to_owned()),
            ("ssl.ca.location", idempotency_testkit::tls::file("ca.pem")),
        ];
        let mut kafka = Self {
            producer: ClientConfig::new().create().unwrap(),
            _cluster: None,
            brokers: tls_brokers(),
            security,
            topic: format!("payments-{}", Key::generate()),
        };
        let admin: AdminClient<DefaultClientContext> = kafka.client().create().unwrap();
        let dead = format!("{}.dead", kafka.topic);
        let topics = [
            NewTopic::new(&kafka.topic, PARTITIONS, TopicReplication::Fixed(1)),
            NewTopic::new(&dead, 1, TopicReplication::Fixed(1)),
        ];
        let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        let created = tokio::time::timeout(Duration::from_secs(30), admin.create_topics(&topics, &options))
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "the SASL_SSL Kafka broker at {} is needed for this test (scripts/services kafka-tls)",
                    kafka.brokers
                )
            })
            .unwrap();
        for result in created {
            result.unwrap();
        }
        kafka.producer = kafka
            .client()
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .create()
            .unwrap();
        kafka
    }

    /// Client settings for the cluster.
    fn client(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.brokers);
        for (name, value) in &self.security {
            config.set(*name, value);
        }
        config
    }

    /// `--from` for a member of `group`, with the security settings and `more`.
    fn url(&self, group: &str, more: &str) -> String {
        self.url_with(&self.brokers, group, &[]) + more
    }

    /// `--from` for a member of `group` at `brokers`, with the security settings but for those
    /// `changed` gives another value.
    fn url_with(&self, brokers: &str, group: &str, changed: &[(&str, &str)]) -> String {
        let mut url = format!("kafka://{brokers}?topic={}&group={group}", self.topic);
        for (name, value) in &self.security {
            let value = changed
                .iter()
                .find(|(changed, _)| changed == name)
                .map_or(value.as_str(), |(_, value)| value);
            let value = percent_encoding::utf8_percent_encode(value, percent_encoding::NON_ALPHANUMERIC);
            url.push_str(&format!("&{name}={value}"));
        }
        url
    }

    /// Publishes `payload` with `key` (its `Idempotency-Key` and record key) to `partition`.
    async fn publish_to(&self, partition: i32, key: &str, payload: &[u8]) {
        let headers = OwnedHeaders::new().insert(Header {
            key: "Idempotency-Key",
            value: Some(key),
        });
        let record = FutureRecord::to(&self.topic)
            .partition(partition)
            .key(key)
            .payload(payload)
            .headers(headers);
        self.producer.send(record, Duration::from_secs(30)).await.unwrap();
    }
}

impl Broker for Kafka {
    fn source_name(&self) -> String {
        self.topic.clone()
    }

    /// A group whose dead members are noticed within seconds (the default is 45 s).
    fn from(&self) -> String {
        self.url("idem", "&session.timeout.ms=6000&heartbeat.interval.ms=500")
    }

    /// The killed member's partitions move once the group notices it is gone (the 6 s session
    /// timeout); a 12 s lease is still running then.
    fn kill_lease(&self) -> Duration {
        Duration::from_secs(12)
    }

    async fn publish(&self, key: &str, payload: &[u8]) {
        let key = Key::new(key).unwrap();
        // The key is also the record key: copies of one message share a partition.
        idempotency_kafka::publish(
            &self.producer,
            &self.topic,
            &key,
            Some(key.as_str().as_bytes()),
            payload,
        )
        .await
        .unwrap();
    }

    /// Each copy to a partition of its own: copies in one partition are handled in order.
    async fn publish_in_order(&self, key: &str, payload: &[u8]) {
        self.publish_to(0, key, payload).await;
    }

    async fn publish_copy(&self, key: &str, payload: &[u8], copy: i32) {
        self.publish_to(copy % PARTITIONS, key, payload).await;
    }

    async fn dead_letters(&self) -> Vec<(String, String)> {
        let reader: StreamConsumer = self
            .client()
            .set("group.id", "dead-letter-readers")
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        let mut list = TopicPartitionList::new();
        list.add_partition_offset(&format!("{}.dead", self.topic), 0, Offset::Beginning)
            .unwrap();
        reader.assign(&list).unwrap();
        let mut found = Vec::new();
        while let Ok(Ok(message)) = tokio::time::timeout(Duration::from_secs(2), reader.recv()).await {
            let header = |name: &str| {
                message
                    .headers()
                    .and_then(|headers| headers.iter().find(|header| header.key == name))
                    .and_then(|header| header.value)
                    .map(|value| String::from_utf8_lossy(value).into_owned())
                    .unwrap_or_default()
            };
            found.push((header("Idempotency-Key"), header("Idempotency-Dead-Reason")));
        }
        found
    }

    /// The group's committed offsets behind the partitions' ends.
    async fn outstanding(&self) -> u64 {
        let reader: BaseConsumer = self.client().set("group.id", "idem").create().unwrap();
        let topic = self.topic.clone();
        tokio::task::spawn_blocking(move || {
            let mut list = TopicPartitionList::new();
            for partition in 0..PARTITIONS {
                list.add_partition(&topic, partition);
            }
            let committed = reader.committed_offsets(list, Duration::from_secs(10)).unwrap();
            (0..PARTITIONS)
                .map(|partition| {
                    let (_, end) = reader
                        .fetch_watermarks(&topic, partition, Duration::from_secs(10))
                        .unwrap();
                    let done = match committed.find_partition(&topic, partition).map(|p| p.offset()) {
                        Some(Offset::Offset(offset)) => offset,
                        _ => 0,
                    };
                    u64::try_from(end - done).unwrap()
                })
                .sum()
        })
        .await
        .unwrap()
    }

    /// The records in the dead-letter topic (a listing commits nothing, and Kafka deletes no
    /// record: this is what a listing must leave as it was).
    async fn dead_depth(&self) -> u64 {
        let reader: BaseConsumer = self.client().set("group.id", "depth").create().unwrap();
        let dead = format!("{}.dead", self.topic);
        tokio::task::spawn_blocking(move || {
            let (low, high) = reader
                .fetch_watermarks(&dead, 0, Duration::from_secs(10))
                .unwrap();
            u64::try_from(high - low).unwrap()
        })
        .await
        .unwrap()
    }

    fn missing_source(&self) -> String {
        format!(
            "kafka://{}?topic=missing-{}&group=idem",
            self.brokers,
            Key::generate()
        )
    }
}

common::consume::scenarios!(_name => Kafka::new());

/// Two `idem consume` members with `--prefetch 4` and a backlog of 20 messages a partition:
/// while the first member's calls wait, its three partitions are paused at the broker; a second
/// member joins, and the rebalance hands some of them back to the first and moves the others.
/// Both members call the handler for the rest of what they got, and every partition's
/// committed offset reaches its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_paused_before_a_rebalance_are_drained_after_it() {
    let kafka = Kafka::new();
    for partition in 0..PARTITIONS {
        for n in 0..20 {
            kafka
                .publish_to(partition, &format!("p{partition}-{n}"), b"charge")
                .await;
        }
    }
    let (first, second) = (consume::Ledger::default(), consume::Ledger::default());
    first.closed.send_replace(true);
    let dir = tempfile::tempdir().unwrap();
    let store = common::sqlite_url(dir.path());
    let settings = ["--store", store.as_str(), "--prefetch", "4"];
    let (admin_a, admin_b) = (common::free_addr(), common::free_addr());
    let handler_a = consume::start_handler(first.clone()).await;
    let _a = consume::start(&kafka, handler_a, admin_a, &settings).await;
    let client = common::client();
    let gauge = async |admin, name| common::metric(&client, admin, name, &[]).await;
    idempotency_testkit::eventually(
        Duration::from_secs(60),
        "the first member's partitions paused",
        async || gauge(admin_a, "idempotency_kafka_fetch_paused_partitions").await == f64::from(PARTITIONS),
    )
    .await;
    let handler_b = consume::start_handler(second.clone()).await;
    let _b = consume::start(&kafka, handler_b, admin_b, &settings).await;
    common::metric_at_least(
        admin_a,
        "idempotency_kafka_rebalances_total",
        &[("kind", "revoke")],
        1.0,
    )
    .await;
    // The revocation waits for the held calls: they finish once it has begun.
    first.closed.send_replace(false);
    idempotency_testkit::eventually(
        Duration::from_secs(120),
        "every partition committed to its end",
        async || kafka.outstanding().await == 0,
    )
    .await;
    let drained = |ledger: &consume::Ledger| drained_partitions(ledger.keys());
    let (kept, moved) = (drained(&first), drained(&second));
    assert!(!kept.is_empty(), "the first member drained no partition");
    assert!(!moved.is_empty(), "the second member drained no partition");
    assert_eq!(kept.len() + moved.len(), 3, "{kept:?} {moved:?}");
    for partition in 0..PARTITIONS {
        for n in 0..20 {
            let key = format!("p{partition}-{n}");
            let calls = first.calls(&key).len() + second.calls(&key).len();
            assert_eq!(calls, 1, "{key} was called {calls} times");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_brokers_missing_topics_and_refused_settings_are_clear_errors() {
    let kafka = Kafka::new();
    let unreachable = common::free_addr();
    for (from, why) in [
        (
            format!("kafka://{unreachable}?topic={}&group=g", kafka.topic),
            "no broker answered",
        ),
        (
            format!("kafka://{}?topic=no-such-topic&group=g", kafka.brokers),
            "topic no-such-topic",
        ),
        (
            format!(
                "kafka://{}?topic={}&group=g&dead_letter=no-such-dead",
                kafka.brokers, kafka.topic
            ),
            "topic no-such-dead",
        ),
        (
            format!(
                "kafka://u:s3cret@{}?topic={}&group=g&no.such.setting=1",
                kafka.brokers, kafka.topic
            ),
            "no.such.setting",
        ),
        (
            format!(
                "kafka://{}?topic={}&group=g&security.protocol=SASL_PLAINTEXT&sasl.mechanism=GSSAPI",
                kafka.brokers, kafka.topic
            ),
            "GSSAPI",
        ),
    ] {
        consume::refused_at_start(&kafka, &from, &[], &[why], &["s3cret", TLS_PASSWORD]);
    }
    // The longest handler timeout makes settings librdkafka accepts: the start gets as far as
    // the topic check.
    let from = format!("kafka://{}?topic=no-such-topic&group=g", kafka.brokers);
    let longest = ["--handler-timeout", "24h"];
    consume::refused_at_start(&kafka, &from, &longest, &["topic no-such-topic"], &[]);
}

/// Over SASL_SSL with SCRAM-SHA-512 to a broker that requires both (`scripts/services
/// kafka-tls`), its certificate verified with the test CA and its name: three copies of every
/// message, one handler call per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_sasl_ssl_with_scram_every_message_published_three_times_is_handled_once() {
    consume::three_copies_run_once(&Kafka::sasl_ssl().await).await;
}

/// A wrong password (SCRAM-SHA-512 and -256), a CA that did not sign the broker's certificate,
/// a name the certificate does not carry and a plain client on the TLS listener each stop
/// `idem consume` at start, with librdkafka's reason and without the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_ca_or_name_stops_the_consumer_at_start_with_the_cause() {
    let kafka = Kafka::sasl_ssl().await;
    let other_ca = idempotency_testkit::tls::file("other-ca.pem");
    let (_, port) = kafka.brokers.rsplit_once(':').unwrap();
    let by_address = format!("127.0.0.1:{port}");
    let brokers = kafka.brokers.as_str();
    for (from, why) in [
        // SCRAM-SHA-256 logs in as well: the start gets as far as the topics.
        (
            kafka.url_with(brokers, "g", &[("sasl.mechanism", "SCRAM-SHA-256")])
                + "&dead_letter=no-such-dead",
            "topic no-such-dead",
        ),
        (
            kafka.url_with(brokers, "g", &[("sasl.password", "wrong-s3cret")]),
            "the SASL authentication was refused",
        ),
        (
            kafka.url_with(
                brokers,
                "g",
                &[
                    ("sasl.password", "wrong-s3cret"),
                    ("sasl.mechanism", "SCRAM-SHA-256"),
                ],
            ),
            "the SASL authentication was refused",
        ),
        (
            kafka.url_with(brokers, "g", &[("ssl.ca.location", &other_ca)]),
            "the TLS connection was refused",
        ),
        (
            kafka.url_with(&by_address, "g", &[]),
            "the TLS connection was refused",
        ),
        (
            kafka.url_with(brokers, "g", &[("security.protocol", "SASL_PLAINTEXT")]),
            "no broker answered",
        ),
    ] {
        consume::refused_at_start(&kafka, &from, &[], &[why], &["s3cret", TLS_PASSWORD]);
    }
}

/// `idem consume --from FROM` stops at start with exit code 1 and `why` in its error, which
/// holds no password of the tests (`s3cret`, the SASL_SSL user's).
/// `kill -9` in the middle of a batch ([`consume::kill_9_in_the_middle_of_a_batch`]), on one
/// partition: its six messages are queued together, so the two after the long call were
/// claimed by the dead process's batch, and the next process runs them as attempt 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_in_the_middle_of_a_batch_reruns_only_what_was_not_recorded() {
    let (ledger, keys) = consume::kill_9_in_the_middle_of_a_batch(&Kafka::new()).await;
    for key in &keys[4..] {
        assert_eq!(
            ledger.calls(key),
            vec![2],
            "{key}: claimed by the dead process's batch, run once by the next as attempt 2"
        );
    }
}

/// `--key-from message-id` on Kafka: records have no message id, so the consumer refuses to
/// start and names what to use instead, before it reaches any broker.
#[test]
fn a_message_id_key_on_kafka_is_refused_with_the_alternatives() {
    let (code, _, err) = common::idem(&[
        "consume",
        "--from",
        "kafka://127.0.0.1:1?topic=payments&group=idem",
        "--to",
        "http://127.0.0.1:1/m",
        "--store",
        "memory://",
        "--key-from",
        "message-id",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("Kafka records have no message id; use record-key, or header:NAME"),
        "{err}"
    );
}
