//! The outbox against the real PostgreSQL and RabbitMQ servers: messages that exist exactly when
//! their transaction commits, three relays keeping 50 aggregates in order while one of them dies
//! between publishing and marking, and a broker outage.

use crate::common;

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use common::{Running, fresh, pool};
use futures_util::StreamExt;
use idempotency_consumer::{BoxError, Consumer, Delivery, Disposition, Handler, HandlerError, Processor};
use idempotency_core::{Attempt, MemoryStore, Outcome};
use idempotency_outbox::{
    AmqpPublisher, Outbox, OutboxMessage, OutgoingMessage, Publisher, Relay, outbox_stats,
};
use idempotency_postgres::sqlx::PgPool;
use idempotency_testkit::TcpProxy;
use idempotency_testkit::eventually;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties};

const LIMIT: Duration = Duration::from_secs(120);

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// Records what it is asked to publish.
#[derive(Default)]
struct Recording(Mutex<Vec<OutboxMessage>>);

impl Publisher for Recording {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), BoxError> {
        self.0.lock().unwrap().push(message.clone());
        Ok(())
    }
}

/// A message enqueued in a transaction that rolls back is never published; one whose
/// transaction commits is published once, with `<name>:<id>` as its key and its headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_exists_exactly_when_its_transaction_commits() {
    let pool = pool().await;
    let (tables, _) = fresh(&pool).await;
    let outbox = Outbox::new(tables.clone());
    let mut tx = pool.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, &OutgoingMessage::new("orders", "order-1", "created"))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let id = outbox
        .enqueue(
            &mut tx,
            &OutgoingMessage::new("orders", "order-1", "shipped").header("trace", vec![0xff]),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let recording = std::sync::Arc::new(Recording::default());
    let relay = Relay::new(pool.clone(), outbox, std::sync::Arc::clone(&recording)).name("shop");
    assert_eq!(relay.relay_batch().await.unwrap(), 1);
    assert_eq!(relay.relay_batch().await.unwrap(), 0);
    let published = recording.0.lock().unwrap().clone();
    assert_eq!(published.len(), 1);
    assert_eq!(published[0].key.as_str(), format!("shop:{id}"));
    assert_eq!(published[0].payload, b"shipped");
    assert_eq!(published[0].headers, vec![("trace".to_owned(), vec![0xff])]);
    let stats = outbox_stats(&pool, &tables).await.unwrap();
    assert_eq!((stats.pending, stats.sent), (0, 1));
}

/// A RabbitMQ queue of its own, and a channel on it.
async fn queue(name: &str) -> (Connection, Channel) {
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("RabbitMQ at {} is needed for this test: {e}", amqp_url()));
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_declare(name.into(), QueueDeclareOptions::default(), FieldTable::default())
        .await
        .unwrap();
    (connection, channel)
}

/// Everything in `queue` until it has been quiet for a second: (key, payload) in arrival order.
async fn drain(channel: &Channel, queue: &str) -> Vec<(String, String)> {
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut received = Vec::new();
    while let Ok(Some(delivery)) = tokio::time::timeout(Duration::from_secs(1), consumer.next()).await {
        let delivery = delivery.unwrap();
        let key = match delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|headers| headers.inner().get("Idempotency-Key").cloned())
        {
            Some(AMQPValue::LongString(key)) => String::from_utf8_lossy(key.as_bytes()).into_owned(),
            other => panic!("no Idempotency-Key: {other:?}"),
        };
        received.push((key, String::from_utf8_lossy(&delivery.data).into_owned()));
        delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    channel
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    received
}

/// Publishes through an [`AmqpPublisher`]; after `hang_after` publishes, the next one never
/// returns (the relay is killed there, between publishing and marking).
struct Hanging {
    inner: AmqpPublisher,
    hang_after: u32,
    published: AtomicU32,
    hung: std::sync::Arc<AtomicBool>,
}

impl Publisher for Hanging {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), BoxError> {
        if self.published.load(Ordering::SeqCst) >= self.hang_after {
            self.hung.store(true, Ordering::SeqCst);
            std::future::pending::<()>().await;
        }
        self.inner.publish(message).await?;
        self.published.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// Enqueues `events` events for each of `aggregates` aggregates, interleaved, one transaction
/// per round of aggregates; the payload is `aggregate/sequence`.
async fn enqueue_interleaved(pool: &PgPool, outbox: &Outbox, queue: &str, aggregates: usize, events: usize) {
    for sequence in 0..events {
        let mut tx = pool.begin().await.unwrap();
        for aggregate in 0..aggregates {
            let message = OutgoingMessage::new(
                queue,
                format!("agg-{aggregate}"),
                format!("agg-{aggregate}/{sequence}"),
            );
            outbox.enqueue(&mut tx, &message).await.unwrap();
        }
        tx.commit().await.unwrap();
    }
}

/// A received message, as our consumers see it.
struct Received<'a>(&'a str, &'a str);

impl Delivery for Received<'_> {
    fn header(&self, name: &str) -> Option<&[u8]> {
        (name == "Idempotency-Key").then_some(self.0.as_bytes())
    }
    fn message_id(&self) -> Option<&str> {
        None
    }
    fn payload(&self) -> &[u8] {
        self.1.as_bytes()
    }
    fn delivery_count(&self) -> u32 {
        1
    }
}

/// Applies each event to its aggregate, checking it is the next one in sequence.
#[derive(Default)]
struct Apply(Mutex<HashMap<String, usize>>);

impl<'a> Handler<Received<'a>> for Apply {
    async fn handle(&self, message: &Received<'a>, _attempt: &Attempt) -> Result<Outcome, HandlerError> {
        let (aggregate, sequence) = message.1.split_once('/').unwrap();
        let sequence: usize = sequence.parse().unwrap();
        let mut next = self.0.lock().unwrap();
        let expected = next.entry(aggregate.to_owned()).or_default();
        assert_eq!(sequence, *expected, "{aggregate} out of order");
        *expected += 1;
        Ok(Outcome::empty())
    }
}

/// Runs the received messages, in arrival order, through an idempotent consumer that applies
/// each event to its aggregate in sequence; checks every event was applied once, and returns
/// how many copies the consumer answered as duplicates.
async fn consume_in_order(received: &[(String, String)], aggregates: usize, events: usize) -> usize {
    let apply = std::sync::Arc::new(Apply::default());
    let consumer = Consumer::new("outbox-order", MemoryStore::new(), std::sync::Arc::clone(&apply));
    for (key, payload) in received {
        assert_eq!(consumer.process(&Received(key, payload)).await, Disposition::Ack);
    }
    let applied: usize = apply.0.lock().unwrap().values().sum();
    assert_eq!(applied, aggregates * events, "events lost");
    received.len() - applied
}

/// 50 aggregates × 40 events through three relays arrive in per-aggregate order. The first relay
/// is killed between publishing 25 messages and marking them (the two others start then): those
/// 25 are published again, and an idempotent consumer answers exactly those copies from its
/// record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_relays_keep_every_aggregate_in_order_and_a_killed_one_costs_only_copies() {
    let pool = pool().await;
    let (tables, _) = fresh(&pool).await;
    let queue_name = tables.qualified_outbox().replace('.', "-");
    let (_connection, channel) = queue(&queue_name).await;
    let outbox = Outbox::new(tables.clone());
    enqueue_interleaved(&pool, &outbox, &queue_name, 50, 40).await;
    let hung = std::sync::Arc::new(AtomicBool::new(false));
    let hanging = Relay::new(
        pool.clone(),
        outbox.clone(),
        Hanging {
            inner: AmqpPublisher::new(amqp_url(), ""),
            hang_after: 25,
            published: AtomicU32::new(0),
            hung: std::sync::Arc::clone(&hung),
        },
    )
    .name("shop")
    .poll(Duration::from_millis(100));
    let killed = tokio::spawn(async move { hanging.run_until(std::future::pending()).await });
    eventually(LIMIT, "the first relay hung mid-round", || {
        let hung = hung.load(Ordering::SeqCst);
        async move { hung }
    })
    .await;
    common::take_over(pool.clone().into(), &tables, killed, || {
        Relay::new(pool.clone(), outbox.clone(), AmqpPublisher::new(amqp_url(), ""))
            .name("shop")
            .poll(Duration::from_millis(100))
    })
    .await;
    let received = drain(&channel, &queue_name).await;
    let duplicates = consume_in_order(&received, 50, 40).await;
    // The killed relay's first round published 25 rows and marked none.
    assert_eq!(duplicates, 25);
    eprintln!("republished after the kill and deduplicated by key: {duplicates}");
}

/// The broker is unreachable for 5 s while events are enqueued: the backlog grows, then drains
/// when the broker is back, with nothing lost and nothing doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_grows_the_backlog_and_it_drains() {
    let pool = pool().await;
    let (tables, _) = fresh(&pool).await;
    let queue_name = tables.qualified_outbox().replace('.', "-");
    let (_connection, channel) = queue(&queue_name).await;
    let (proxy, proxied) = TcpProxy::in_front_of(&amqp_url()).await.unwrap();
    let outbox = Outbox::new(tables.clone());
    let relay = Relay::new(pool.clone(), outbox.clone(), AmqpPublisher::new(proxied, ""))
        .poll(Duration::from_millis(100));
    let running = Running::spawn(|stopped| async move { relay.run_until(stopped).await });
    enqueue_interleaved(&pool, &outbox, &queue_name, 10, 10).await;
    eventually(LIMIT, "the first 100 sent", || {
        let (pool, tables) = (pool.clone(), tables.clone());
        async move { outbox_stats(&pool, &tables).await.unwrap().pending == 0 }
    })
    .await;
    proxy.set_down(true);
    let more = Outbox::new(tables.clone());
    for sequence in 10..20 {
        let mut tx = pool.begin().await.unwrap();
        for aggregate in 0..10 {
            let message = OutgoingMessage::new(
                &queue_name,
                format!("agg-{aggregate}"),
                format!("agg-{aggregate}/{sequence}"),
            );
            more.enqueue(&mut tx, &message).await.unwrap();
        }
        tx.commit().await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let backlog = outbox_stats(&pool, &tables).await.unwrap();
    assert_eq!(backlog.pending, 100, "the backlog while the broker is away");
    assert!(backlog.oldest_pending_seconds.unwrap() >= 4.0, "{backlog:?}");
    proxy.set_down(false);
    eventually(LIMIT, "the backlog drained", || {
        let (pool, tables) = (pool.clone(), tables.clone());
        async move { outbox_stats(&pool, &tables).await.unwrap().pending == 0 }
    })
    .await;
    running.stop().await;
    let received = drain(&channel, &queue_name).await;
    assert_eq!(consume_in_order(&received, 10, 20).await, 0, "copies");
}
