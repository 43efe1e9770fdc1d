//! Every inbox and outbox metric moves when its event happens (a binary of its own: the
//! process-wide recorder sees the metrics of every runtime thread).

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{Running, fresh, pool};
use idempotency_consumer::{BoxError, Delivery, HandlerError, Processor};
use idempotency_core::Key;
use idempotency_outbox::{
    Inbox, InboxHandler, InboxMessage, InboxReceiver, InboxWorker, Outbox, OutboxMessage, OutgoingMessage,
    Publisher, Relay, RetryPolicy, inbox_stats, outbox_stats,
};
use idempotency_postgres::PgTransaction;
use idempotency_testkit::eventually;

const LIMIT: Duration = Duration::from_secs(60);

/// A message without any header.
struct Keyless;

impl Delivery for Keyless {
    fn header(&self, _: &str) -> Option<&[u8]> {
        None
    }
    fn message_id(&self) -> Option<&str> {
        None
    }
    fn payload(&self) -> &[u8] {
        b"x"
    }
    fn delivery_count(&self) -> u32 {
        1
    }
}

/// Fails `retried` once, and `dead` always.
struct Handler(AtomicBool);

impl InboxHandler for Handler {
    async fn handle(&self, message: &InboxMessage, _tx: &mut PgTransaction) -> Result<(), HandlerError> {
        match message.key.as_str() {
            "retried" if !self.0.swap(true, Ordering::SeqCst) => Err(HandlerError::retry("once")),
            "dead" => Err(HandlerError::fatal("never")),
            _ => Ok(()),
        }
    }
}

/// Fails while its flag is set.
struct Flaky(AtomicBool);

impl Publisher for Flaky {
    async fn publish(&self, _message: &OutboxMessage) -> Result<(), BoxError> {
        if self.0.load(Ordering::SeqCst) {
            return Err("the broker is away".into());
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_inbox_and_outbox_metric_moves_when_its_event_happens() {
    let _ = idempotency_testkit::recorded::global();
    let pool = pool().await;
    let (tables, _) = fresh(&pool).await;
    let consumer = tables.qualified_inbox().replace('.', "-");
    let inbox = Inbox::new(pool.clone(), tables.clone(), &consumer).unwrap();
    for (key, payload) in [
        ("done", "a"),
        ("done", "a"),
        ("done", "b"),
        ("retried", "a"),
        ("dead", "a"),
    ] {
        inbox
            .receive(&Key::new(key).unwrap(), payload.as_bytes(), &[])
            .await
            .unwrap();
    }
    let _ = InboxReceiver::new(inbox.clone()).process(&Keyless).await;
    let retry = RetryPolicy {
        backoff: idempotency_consumer::Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(10),
        },
        max_attempts: 5,
    };
    let worker = InboxWorker::new(inbox, Arc::new(Handler(AtomicBool::new(false))))
        .retry(retry)
        .poll(Duration::from_millis(50))
        // Everything processed is past the window at once.
        .retention(Duration::ZERO, Duration::from_millis(100));
    let running = Running::spawn(|stopped| async move { worker.run_until(stopped).await });
    let labels = [("consumer", consumer.as_str())];
    eventually(LIMIT, "processed rows purged", || {
        let metrics = idempotency_testkit::recorded::global();
        async move { metrics.counter("idempotency_inbox_purged_total", &labels) >= 2 }
    })
    .await;
    running.stop().await;
    let stats = inbox_stats(&pool, &tables, Some(&consumer)).await.unwrap();
    assert_eq!((stats.pending, stats.dead), (0, 1));

    let outbox = Outbox::new(tables.clone());
    let mut tx = pool.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, &OutgoingMessage::new("q", "a", "1"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let publisher = Arc::new(Flaky(AtomicBool::new(true)));
    let relay = Relay::new(pool.clone(), outbox, Arc::clone(&publisher))
        .name(consumer.clone())
        .poll(Duration::from_millis(50))
        .retention(Duration::from_secs(3600), Duration::from_millis(100));
    assert!(relay.relay_batch().await.is_err());
    publisher.0.store(false, Ordering::SeqCst);
    let running = Running::spawn(|stopped| async move { relay.run_until(stopped).await });
    eventually(LIMIT, "published", || {
        let (pool, tables) = (pool.clone(), tables.clone());
        async move { outbox_stats(&pool, &tables).await.unwrap().pending == 0 }
    })
    .await;
    // A cleanup round refreshes the gauges after the publish.
    tokio::time::sleep(Duration::from_millis(300)).await;
    running.stop().await;

    let metrics = idempotency_testkit::recorded::global();
    let received = |result| {
        metrics.counter(
            "idempotency_inbox_received_total",
            &[("consumer", consumer.as_str()), ("result", result)],
        )
    };
    assert_eq!(
        [
            received("stored"),
            received("duplicate"),
            received("mismatch"),
            received("no_key")
        ],
        [3, 1, 1, 1]
    );
    let handled = |result| {
        metrics.counter(
            "idempotency_inbox_messages_total",
            &[("consumer", consumer.as_str()), ("result", result)],
        )
    };
    assert_eq!(
        [handled("processed"), handled("retried"), handled("dead")],
        [2, 1, 1]
    );
    assert_eq!(metrics.gauge("idempotency_inbox_backlog", &labels), 0.0);
    assert_eq!(metrics.gauge("idempotency_inbox_dead", &labels), 1.0);
    assert_eq!(
        metrics.gauge("idempotency_inbox_oldest_pending_seconds", &labels),
        0.0
    );
    let outbox_labels = [("outbox", consumer.as_str())];
    assert_eq!(
        metrics.counter("idempotency_outbox_published_total", &outbox_labels),
        1
    );
    assert_eq!(
        metrics.counter("idempotency_outbox_relay_errors_total", &outbox_labels),
        1
    );
    assert_eq!(metrics.gauge("idempotency_outbox_backlog", &outbox_labels), 0.0);
    assert_eq!(
        metrics.gauge("idempotency_outbox_oldest_pending_seconds", &outbox_labels),
        0.0
    );
}
