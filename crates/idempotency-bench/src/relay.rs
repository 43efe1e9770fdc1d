//! `relay`: rows per second the outbox relay (`idem relay`'s) publishes to each destination,
//! against the same publisher publishing the same messages in a loop, without the table, in the
//! same run.
//!
//! Each measurement writes the rows first (not timed; 10 ordering groups), then times
//! `Relay::relay_batch` rounds of 100 from the first until one finds nothing: lock the groups,
//! read the rows, publish each and wait for the destination's confirmation, mark them sent,
//! commit. The loop publishes as many messages, one after another, each confirmed. The two
//! alternate in every round, destination after destination.
//!
//! | destination | the confirmation |
//! |---|---|
//! | RabbitMQ (a queue, through the default exchange) | a publisher confirm |
//! | NATS JetStream (a stream on loopback) | the stream's publish acknowledgement |
//! | Kafka (librdkafka's mock cluster, in process; 3 partitions) | a delivery report, `acks=all` |
//! | SQS (the local AWS server) | the `SendMessage` answer |
//! | a webhook (axum on loopback, answering `200`) | the `2xx` |

use crate::servers::{amqp_url, env_or, rabbit_queue};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idempotency_consumer::BoxError;
use idempotency_core::Key;
use idempotency_outbox::{
    AmqpPublisher, Database, KafkaPublisher, NatsPublisher, Outbox, OutboxConnection, OutboxMessage,
    OutgoingMessage, Publisher, Relay, SqsPublisher, Tables,
};
use sqlx::{AssertSqlSafe, MySqlPool, PgPool};

use crate::measure::{Samples, per_second, rate, runtime};

/// Rows per measurement (SQS: [`SQS_ROWS`]).
const ROWS: usize = 3000;

/// Rows per SQS measurement: the local AWS server answers a few hundred requests a second.
const SQS_ROWS: usize = 300;

/// Posts each message to a URL with its key as `Idempotency-Key`: what `idem relay`'s webhook
/// destination does, over plain HTTP.
struct Webhook {
    client: Client<HttpConnector, Full<bytes::Bytes>>,
    url: String,
}

impl Publisher for Webhook {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), BoxError> {
        let request = http::Request::post(&self.url)
            .header("idempotency-key", message.key.as_str())
            .header(http::header::CONTENT_TYPE, "application/octet-stream")
            .body(Full::new(bytes::Bytes::from(message.payload.clone())))?;
        let answer = self.client.request(request).await?;
        if answer.status().is_success() {
            Ok(())
        } else {
            Err(format!("the webhook answered {}", answer.status()).into())
        }
    }
}

/// A destination: its name in the table, the publisher, where rows go, and how many rows a
/// measurement has.
struct Destination {
    name: &'static str,
    publisher: Arc<dyn DynPublisher>,
    destination: String,
    rows: usize,
    /// For SQS: a queue of its own for every measurement (the local AWS server slows down as
    /// a queue fills).
    sqs: Option<aws_sdk_sqs::Client>,
}

impl Destination {
    /// Where a measurement's messages go.
    async fn target(&self, measurement: &str) -> Result<String, String> {
        let Some(client) = &self.sqs else {
            return Ok(self.destination.clone());
        };
        Ok(client
            .create_queue()
            .queue_name(format!("{}-{measurement}", self.destination))
            .send()
            .await
            .map_err(|e| {
                format!(
                    "the local AWS server: {}",
                    aws_sdk_sqs::error::DisplayErrorContext(e)
                )
            })?
            .queue_url()
            .unwrap_or_default()
            .to_owned())
    }
}

/// [`Publisher`] as a trait object (its method returns `impl Future`).
trait DynPublisher: Send + Sync {
    fn publish_boxed<'a>(
        &'a self,
        message: &'a OutboxMessage,
    ) -> futures_util::future::BoxFuture<'a, Result<(), BoxError>>;
}

impl<P: Publisher> DynPublisher for P {
    fn publish_boxed<'a>(
        &'a self,
        message: &'a OutboxMessage,
    ) -> futures_util::future::BoxFuture<'a, Result<(), BoxError>> {
        Box::pin(self.publish(message))
    }
}

/// A [`DynPublisher`] shared with a relay.
struct Shared(Arc<dyn DynPublisher>);

impl Publisher for Shared {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), BoxError> {
        self.0.publish_boxed(message).await
    }
}

pub(crate) fn run_relay(rounds: usize) -> Result<(), String> {
    runtime()?.block_on(async {
        let tag = std::process::id();
        let pg_pool = PgPool::connect(&env_or("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test"))
            .await
            .map_err(|e| format!("PostgreSQL: {e}"))?;
        let my_url = env_or("MYSQL_URL", "mysql://root@127.0.0.1:3306/test");
        let my_pool = MySqlPool::connect(&my_url)
            .await
            .map_err(|e| format!("MySQL at {my_url}: {e}"))?;
        let tables = Tables::default()
            .schema("idempotency_bench")
            .and_then(|t| t.outbox(&format!("relay_{tag}")))
            .map_err(|e| e.to_string())?;
        tables.migrate_outbox(&pg_pool).await.map_err(|e| e.to_string())?;
        let my_tables = Tables::default()
            .outbox(&format!("idem_bench_relay_{tag}"))
            .map_err(|e| e.to_string())?;
        my_tables.migrate_outbox(&my_pool).await.map_err(|e| e.to_string())?;

        // RabbitMQ.
        let amqp = amqp_url();
        let queue = format!("idem-bench-relay-{tag}");
        let (_connection, channel) = rabbit_queue(&queue).await?;
        let rabbit: Arc<dyn DynPublisher> = Arc::new(AmqpPublisher::new(amqp.clone(), ""));

        // NATS JetStream.
        let nats_url = env_or("NATS_URL", "nats://127.0.0.1:4222");
        let client = async_nats::connect(&nats_url)
            .await
            .map_err(|e| format!("NATS at {nats_url}: {e}"))?;
        let jetstream = async_nats::jetstream::new(client);
        let stream = format!("IDEMBENCH_RELAY_{tag}");
        let subject = format!("idembench.relay.{tag}");
        jetstream
            .create_stream(async_nats::jetstream::stream::Config {
                name: stream.clone(),
                subjects: vec![subject.clone()],
                storage: async_nats::jetstream::stream::StorageType::Memory,
                ..Default::default()
            })
            .await
            .map_err(|e| e.to_string())?;

        // Kafka.
        let cluster = rdkafka::mocking::MockCluster::new(1).map_err(|e| e.to_string())?;
        let topic = format!("idem-bench-relay-{tag}");
        cluster.create_topic(&topic, 3, 1).map_err(|e| e.to_string())?;
        // As `idem relay --to kafka://…` builds it.
        let kafka = KafkaPublisher::from_url(&format!("kafka://{}", cluster.bootstrap_servers()))
            .map_err(|e| e.to_string())?;

        // SQS.
        let sqs = aws_sdk_sqs::Client::from_conf(
            aws_sdk_sqs::Config::builder()
                .behavior_version_latest()
                .http_client(idempotency_sqs::http_client())
                .endpoint_url(env_or("AWS_ENDPOINT_URL", "http://127.0.0.1:5000"))
                .region(aws_sdk_sqs::config::Region::new("us-east-1"))
                .credentials_provider(aws_sdk_sqs::config::Credentials::new(
                    env_or("AWS_ACCESS_KEY_ID", "test"),
                    env_or("AWS_SECRET_ACCESS_KEY", "test"),
                    None,
                    None,
                    "idem-bench",
                ))
                .build(),
        );

        // A webhook.
        let posted = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&posted);
        let app = axum::Router::new().route(
            "/events",
            axum::routing::post(move || {
                counter.fetch_add(1, Ordering::Relaxed);
                async { "ok" }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| e.to_string())?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        tokio::spawn(async move { axum::serve(listener, app).await });
        let webhook = Webhook {
            client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
            url: format!("http://{addr}/events"),
        };

        let destinations = [
            Destination {
                name: "RabbitMQ",
                publisher: Arc::clone(&rabbit),
                destination: queue.clone(),
                rows: ROWS,
                sqs: None,
            },
            Destination {
                name: "NATS JetStream",
                publisher: Arc::new(NatsPublisher::new(jetstream.clone())),
                destination: subject.clone(),
                rows: ROWS,
                sqs: None,
            },
            Destination {
                name: "Kafka (mock cluster)",
                publisher: Arc::new(kafka),
                destination: topic.clone(),
                rows: ROWS,
                sqs: None,
            },
            Destination {
                name: "SQS (local AWS server)",
                publisher: Arc::new(SqsPublisher::new(sqs.clone())),
                destination: format!("idem-bench-relay-{tag}"),
                rows: SQS_ROWS,
                sqs: Some(sqs.clone()),
            },
            Destination {
                name: "webhook (HTTP/1.1, loopback)",
                publisher: Arc::new(webhook),
                destination: String::new(),
                rows: ROWS,
                sqs: None,
            },
        ];
        println!(
            "\n## Outbox relay vs the same publisher in a loop, per destination: rows/s ({ROWS} rows a measurement, SQS {SQS_ROWS}; 10 groups; batches of 100)\n"
        );
        println!("| destination | outbox | relay rows/s | min–max | loop msg/s | min–max | relay / loop |");
        println!("|---|---|---:|---:|---:|---:|---:|");
        let mysql = Database::MySql(my_pool.clone());
        let postgres = Database::Postgres(pg_pool.clone());
        let runs: Vec<(&Destination, &str, &Database, &Tables)> = destinations
            .iter()
            .map(|d| (d, "PostgreSQL", &postgres, &tables))
            .chain(std::iter::once((&destinations[0], "MySQL", &mysql, &my_tables)))
            .collect();
        let mut results: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); runs.len()];
        for round in 0..rounds {
            for ((destination, _, database, tables), (relayed, looped)) in runs.iter().zip(&mut results) {
                let first = destination.target(&format!("{round}-relay")).await?;
                relayed.push(relayed_per_second(database, tables, destination, &first).await?);
                let second = destination.target(&format!("{round}-loop")).await?;
                looped.push(looped_per_second(destination, &second, round).await?);
                if destination.sqs.is_some() {
                    for queue in [first, second] {
                        let _ = sqs.delete_queue().queue_url(queue).send().await;
                    }
                }
                channel
                    .queue_purge(queue.as_str().into(), lapin::options::QueuePurgeOptions::default())
                    .await
                    .map_err(|e| e.to_string())?;
            }
        }
        for ((destination, outbox, _, _), (relayed, looped)) in runs.iter().zip(results) {
            let (relayed, looped) = (Samples::of(relayed), Samples::of(looped));
            println!(
                "| {} | {outbox} | {} | {} | {} | {} | {:.2}× |",
                destination.name,
                per_second(relayed.median),
                relayed.spread(),
                per_second(looped.median),
                looped.spread(),
                relayed.median / looped.median
            );
        }
        println!(
            "\n(the webhook received {} posts in all)",
            posted.load(Ordering::Relaxed)
        );
        let _ = channel
            .queue_delete(queue.as_str().into(), lapin::options::QueueDeleteOptions::default())
            .await;
        let _ = jetstream.delete_stream(&stream).await;
        let _ = sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS {}",
            tables.qualified_outbox()
        )))
        .execute(&pg_pool)
        .await;
        let _ = sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS idem_bench_relay_{tag}"
        )))
        .execute(&my_pool)
        .await;
        Ok(())
    })
}

/// Writes the destination's rows (not timed), then times a relay from its first round until a
/// round finds nothing.
async fn relayed_per_second(
    database: &Database,
    tables: &Tables,
    to: &Destination,
    target: &str,
) -> Result<f64, String> {
    let outbox = Outbox::new(tables.clone());
    let messages: Vec<OutgoingMessage> = (0..to.rows)
        .map(|n| OutgoingMessage::new(target, format!("agg-{}", n % 10), "{}"))
        .collect();
    match database {
        Database::Postgres(pool) => {
            let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
            enqueue_all(&outbox, &mut tx, &messages).await?;
            tx.commit().await.map_err(|e| e.to_string())?;
        }
        Database::MySql(pool) => {
            let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
            enqueue_all(&outbox, &mut tx, &messages).await?;
            tx.commit().await.map_err(|e| e.to_string())?;
        }
        _ => return Err("a database this bench does not know".into()),
    }
    let relay = Relay::new(database.clone(), outbox, Shared(Arc::clone(&to.publisher))).notifications(false);
    let started = Instant::now();
    let mut relayed = 0;
    loop {
        let sent = relay.relay_batch().await.map_err(|e| e.to_string())?;
        if sent == 0 {
            break;
        }
        relayed += sent;
    }
    if relayed != to.rows {
        return Err(format!("{}: relayed {relayed} of {} rows", to.name, to.rows));
    }
    Ok(rate(to.rows as u64, started.elapsed()))
}

/// Enqueues `messages` in the transaction `tx`.
async fn enqueue_all<C: OutboxConnection + ?Sized>(
    outbox: &Outbox,
    tx: &mut C,
    messages: &[OutgoingMessage],
) -> Result<(), String> {
    for message in messages {
        outbox.enqueue(tx, message).await.map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Times the destination's publisher publishing as many messages one after another, each
/// confirmed, without the table; keys of their own in every round (JetStream would drop a
/// repeated `Nats-Msg-Id`).
async fn looped_per_second(to: &Destination, target: &str, round: usize) -> Result<f64, String> {
    let messages = (0..to.rows)
        .map(|n| {
            Ok(OutboxMessage {
                id: i64::try_from(n).unwrap_or(i64::MAX),
                key: Key::new(format!("plain:{round}:{n}")).map_err(|e| e.to_string())?,
                destination: target.to_owned(),
                ordering_key: format!("agg-{}", n % 10),
                payload: b"{}".to_vec(),
                headers: Vec::new(),
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    let started = Instant::now();
    for message in &messages {
        to.publisher
            .publish_boxed(message)
            .await
            .map_err(|e| format!("{}: {e}", to.name))?;
    }
    Ok(rate(to.rows as u64, started.elapsed()))
}
