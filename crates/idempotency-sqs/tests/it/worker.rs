//! What is SQS's own, against the local server: queues missing at start or deleted while the
//! worker runs, and FIFO group order under concurrency. What every broker must do is the broker
//! suite's (`tests/suite.rs`).

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{Ledger, Running, client, depth, drain, queues, stop_all, two_workers, worker};
use idempotency_consumer::{Consumer, Delivery, Handler, HandlerError};
use idempotency_core::{Attempt, Key, MemoryStore, Outcome};
use idempotency_sqs::{Producer, SqsMessage};
use idempotency_testkit::eventually;

/// Charges a card: the side effect is a ledger entry, after `slow`.
#[derive(Clone, Default)]
struct Charge {
    ledger: Ledger,
    slow: Duration,
}

impl Handler<SqsMessage> for Charge {
    async fn handle(&self, message: &SqsMessage, attempt: &Attempt) -> Result<Outcome, HandlerError> {
        let body = String::from_utf8_lossy(message.payload()).into_owned();
        tokio::time::sleep(self.slow).await;
        self.ledger.record(attempt.key().as_str());
        Ok(Outcome::new(format!("charged {body}")))
    }
}

fn key(text: &str) -> Key {
    Key::new(text).unwrap()
}

/// A queue that does not exist is a configuration error at start; one deleted while the worker
/// runs makes receives fail, which are counted and retried, and the worker stops cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_queues_are_named_and_receive_failures_counted() {
    let _ = idempotency_testkit::recorded::global();
    let client = client();
    let (source, dead) = queues(&client, "gone").await;
    let consumer = Arc::new(Consumer::new("sqs-gone", MemoryStore::new(), Charge::default()));
    let missing = format!("{source}-missing");
    let error = worker(
        &client,
        &missing,
        &dead,
        Arc::clone(&consumer),
        Duration::from_secs(5),
    )
    .run_until(std::future::pending())
    .await
    .unwrap_err();
    assert!(!error.is_retryable(), "{error}");
    assert!(error.to_string().contains("look up the queue"), "{error}");
    let error = worker(
        &client,
        &source,
        &format!("{dead}-missing"),
        Arc::clone(&consumer),
        Duration::from_secs(5),
    )
    .run_until(std::future::pending())
    .await
    .unwrap_err();
    assert!(
        error.to_string().contains("look up the dead-letter queue"),
        "{error}"
    );
    let error = idempotency_sqs::Worker::new(
        client.clone(),
        &source,
        idempotency_sqs::DeadLetters::RedrivePolicy,
        Arc::clone(&consumer),
    )
    .run_until(std::future::pending())
    .await
    .unwrap_err();
    assert!(error.to_string().contains("has no redrive policy"), "{error}");

    let running = Running::start(worker(&client, &source, &dead, consumer, Duration::from_secs(5)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    client.delete_queue().queue_url(&source).send().await.unwrap();
    let queue_name = source.rsplit('/').next().unwrap().to_owned();
    eventually(Duration::from_secs(30), "a counted receive failure", || {
        let queue_name = queue_name.clone();
        async move {
            idempotency_testkit::recorded::global()
                .counter("idempotency_sqs_receive_errors_total", &[("queue", &queue_name)])
                > 0
        }
    })
    .await;
    assert!(running.is_running(), "a failing receive stopped the worker");
    running.stop().await;
}

/// Four message groups, 25 messages each, two workers with eight slots each: every group's
/// effects happen in the order its messages were sent, and each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_queue_keeps_each_groups_order_under_concurrency() {
    const GROUPS: usize = 4;
    const EACH: usize = 25;
    let client = client();
    let (source, dead) = queues(&client, "order.fifo").await;
    let charge = Charge {
        slow: Duration::from_millis(3),
        ..Charge::default()
    };
    let producer = Producer::new(client.clone(), &source);
    for i in 0..EACH {
        for group in 0..GROUPS {
            let name = format!("g{group}-{i:02}");
            producer
                .send_in_group(&key(&name), &format!("customer-{group}"), name.clone())
                .await
                .unwrap();
        }
    }
    // The same key sent again within the window: SQS drops it at the send.
    producer
        .send_in_group(&key("g0-00"), "customer-0", "g0-00")
        .await
        .unwrap();
    assert_eq!(
        depth(&client, &source).await,
        u64::try_from(GROUPS * EACH).unwrap(),
        "the resent key was not dropped by its MessageDeduplicationId"
    );
    let consumer = Arc::new(Consumer::new("sqs-fifo", MemoryStore::new(), charge.clone()));
    let workers = two_workers(&client, (&source, &dead), &consumer, Duration::from_secs(5));
    eventually(Duration::from_secs(60), "every group", || async {
        charge.ledger.total() == u32::try_from(GROUPS * EACH).unwrap() && depth(&client, &source).await == 0
    })
    .await;
    stop_all(workers).await;
    let order = charge.ledger.order();
    for group in 0..GROUPS {
        let seen: Vec<&String> = order
            .iter()
            .filter(|key| key.starts_with(&format!("g{group}-")))
            .collect();
        let sent: Vec<String> = (0..EACH).map(|i| format!("g{group}-{i:02}")).collect();
        assert_eq!(
            seen,
            sent.iter().collect::<Vec<_>>(),
            "group {group} out of order"
        );
    }
    assert!(drain(&client, &dead).await.is_empty());
}
