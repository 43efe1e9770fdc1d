//! The outbox on MySQL (the MariaDB `scripts/services` runs): the library writes the table in
//! the caller's MySQL transaction, and the one relay publishes it, with named locks keeping each
//! group with one relay at a time, also when a relay dies mid-round.

#![cfg(feature = "mysql")]

use crate::common;

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use idempotency_consumer::BoxError;
use idempotency_core::Key;
use idempotency_mysql::sqlx::{self, AssertSqlSafe, MySqlPool};
use idempotency_outbox::{
    Outbox, OutboxMessage, OutgoingMessage, Publisher, Relay, Tables, outbox_stats, purge_sent,
};
use idempotency_testkit::eventually;

const LIMIT: Duration = Duration::from_secs(120);

fn mysql_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// A pool on the server, and an outbox migrated in a database of the test's own.
async fn fresh() -> (MySqlPool, Tables) {
    let pool = idempotency_mysql::sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(16)
        .connect(&mysql_url())
        .await
        .unwrap_or_else(|e| panic!("MySQL at {} is needed for this test: {e}", mysql_url()));
    let database = format!(
        "outbox_{}",
        Key::generate().as_str().replace('-', "_").to_lowercase()
    );
    sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&pool)
        .await
        .unwrap();
    let tables = Tables::default().schema(&database).unwrap();
    tables.migrate_outbox(&pool).await.unwrap();
    tables.migrate_outbox(&pool).await.unwrap();
    tables.check_outbox(&pool).await.unwrap();
    (pool, tables)
}

async fn drop_database(pool: &MySqlPool, tables: &Tables) {
    let database = tables.qualified_outbox();
    let database = database.split('.').next().unwrap();
    sqlx::query(AssertSqlSafe(format!("DROP DATABASE {database}")))
        .execute(pool)
        .await
        .unwrap();
}

/// Records what it is asked to publish; hangs forever after `hang_after` when set.
#[derive(Default)]
struct Recording {
    published: Mutex<Vec<OutboxMessage>>,
    hang_after: Option<u32>,
    count: AtomicU32,
    hung: AtomicBool,
}

impl Publisher for &Recording {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), BoxError> {
        if self
            .hang_after
            .is_some_and(|after| self.count.fetch_add(1, Ordering::SeqCst) >= after)
        {
            self.hung.store(true, Ordering::SeqCst);
            std::future::pending::<()>().await;
        }
        self.published.lock().unwrap().push(message.clone());
        Ok(())
    }
}

/// A message enqueued in a MySQL transaction that rolls back is never published; one whose
/// transaction commits is published once, with `<name>:<id>` as its key and its headers byte
/// for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_enqueued_on_mysql_exists_exactly_when_its_transaction_commits() {
    let (pool, tables) = fresh().await;
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
            &OutgoingMessage::new("orders", "order-1", "shipped").header("trace", vec![0xff, 0x00]),
        )
        .await
        .unwrap();
    let keyed = outbox
        .enqueue(
            &mut tx,
            &OutgoingMessage::new("orders", "order-1", "paid").key(Key::new("order-1:paid").unwrap()),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let recording = Recording::default();
    let relay = Relay::new(pool.clone(), outbox, &recording).name("shop");
    assert_eq!(relay.relay_batch().await.unwrap(), 2);
    assert_eq!(
        relay.relay_batch().await.unwrap(),
        0,
        "sent rows are not sent again"
    );
    let published = recording.published.lock().unwrap().clone();
    assert_eq!(published.len(), 2);
    assert_eq!(published[0].id, id);
    assert_eq!(published[0].key.as_str(), format!("shop:{id}"));
    assert_eq!(published[0].payload, b"shipped");
    assert_eq!(published[0].headers, [("trace".to_owned(), vec![0xff, 0x00])]);
    assert_eq!(published[1].id, keyed);
    assert_eq!(published[1].key.as_str(), "order-1:paid");
    let stats = outbox_stats(&pool, &tables).await.unwrap();
    assert_eq!((stats.pending, stats.sent, stats.dead), (0, 2, 0));
    // Sent rows are kept for the retention, then deleted by the relay's cleanup.
    assert_eq!(
        purge_sent(&pool, &tables, Duration::from_secs(3600))
            .await
            .unwrap(),
        0
    );
    assert_eq!(purge_sent(&pool, &tables, Duration::ZERO).await.unwrap(), 2);
    let stats = outbox_stats(&pool, &tables).await.unwrap();
    assert_eq!((stats.pending, stats.sent, stats.dead), (0, 0, 0));
    drop_database(&pool, &tables).await;
}

/// Three relays on 40 aggregates of 25 events each; the first hangs after 25 publishes in its
/// first round and its task is aborted. Its connection is closed, so MySQL releases its named
/// locks and rolls its round back: the other two take its groups over, republish the 25 rows it
/// had not marked, and every aggregate reaches the publisher in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_mysql_relays_keep_every_aggregate_in_order_and_a_killed_one_costs_only_copies() {
    let (pool, tables) = fresh().await;
    let outbox = Outbox::new(tables.clone());
    for sequence in 0..25 {
        let mut tx = pool.begin().await.unwrap();
        for aggregate in 0..40 {
            let message = OutgoingMessage::new(
                "events",
                format!("agg-{aggregate}"),
                format!("agg-{aggregate}/{sequence}"),
            );
            outbox.enqueue(&mut tx, &message).await.unwrap();
        }
        tx.commit().await.unwrap();
    }
    let hanging: &'static Recording = Box::leak(Box::new(Recording {
        hang_after: Some(25),
        ..Recording::default()
    }));
    let recording: &'static Recording = Box::leak(Box::default());
    let first = Relay::new(pool.clone(), outbox.clone(), hanging)
        .name("shop")
        .poll(Duration::from_millis(50));
    let killed = tokio::spawn(async move { first.run_until(std::future::pending()).await });
    eventually(LIMIT, "the first relay hung mid-round", || async {
        hanging.hung.load(Ordering::SeqCst)
    })
    .await;
    common::take_over(pool.clone().into(), &tables, killed, || {
        Relay::new(pool.clone(), outbox.clone(), recording)
            .name("shop")
            .poll(Duration::from_millis(50))
    })
    .await;
    let before = hanging.published.lock().unwrap().clone();
    let after = recording.published.lock().unwrap().clone();
    assert_eq!(before.len(), 25, "the hung relay's first round published 25");
    assert_eq!(
        after.len(),
        1000,
        "every row by the survivors, the 25 unmarked ones again"
    );
    let mut seen: HashMap<String, Vec<u32>> = HashMap::new();
    for message in before.iter().chain(&after) {
        let text = String::from_utf8(message.payload.clone()).unwrap();
        let (aggregate, sequence) = text.split_once('/').unwrap();
        assert_eq!(aggregate, message.ordering_key);
        let sequences = seen.entry(aggregate.to_owned()).or_default();
        let sequence: u32 = sequence.parse().unwrap();
        if !sequences.contains(&sequence) {
            sequences.push(sequence);
        }
    }
    assert_eq!(seen.len(), 40);
    for (aggregate, sequences) in &seen {
        assert_eq!(*sequences, (0..25).collect::<Vec<_>>(), "{aggregate} in order");
    }
    // Each survivor's copies came in order too: a group was never with both at once.
    let mut last: HashMap<&str, u32> = HashMap::new();
    for message in &after {
        let text = std::str::from_utf8(&message.payload).unwrap();
        let sequence: u32 = text.split_once('/').unwrap().1.parse().unwrap();
        if let Some(previous) = last.insert(message.ordering_key.as_str(), sequence) {
            assert!(previous < sequence, "{text} after {previous}");
        }
    }
    drop_database(&pool, &tables).await;
}
