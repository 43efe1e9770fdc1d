//! Same-transaction consumers against the real PostgreSQL server: the record, the charge row
//! and the completion commit together, so every delivery path (duplicates racing, a failing or
//! panicking handler, a lost connection) ends with exactly one charge row per key.

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_consumer::{Backoff, Decisions, Disposition, HandlerError, Processor, TxConsumer, TxHandler};
use idempotency_core::{Attempt, Key, Outcome, RecordState, Scope, Store};
use idempotency_postgres::{PgTransaction, PostgresStore};
use idempotency_testkit::message::TestMessage;
use sqlx::AssertSqlSafe;

/// A delivered message: the key header, the amount in cents as text, the delivery count.
type Message = TestMessage;

/// Writes a charge row from the borrowed message; fails on demand, after writing.
#[derive(Default)]
struct Charger {
    table: String,
    /// How many more times each key fails with `Retry` (after its row is written).
    failures: Mutex<HashMap<String, u32>>,
    /// Panic after the row is written, once.
    panic_once: AtomicBool,
    hold: Duration,
    /// A key whose handler, after writing its row, says so here and never returns.
    stall: Option<(String, Arc<tokio::sync::Notify>)>,
}

impl TxHandler<Message, PostgresStore> for Charger {
    async fn handle(
        &self,
        message: &Message,
        tx: &mut PgTransaction,
        attempt: &Attempt,
    ) -> Result<Outcome, HandlerError> {
        let cents: i64 = message
            .text()
            .parse()
            .map_err(|_| HandlerError::fatal(format!("not an amount: {:?}", message.text())))?;
        let id: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "INSERT INTO {} (key, cents) VALUES ($1, $2) RETURNING id",
            self.table
        )))
        .bind(attempt.key().as_str())
        .bind(cents)
        .fetch_one(&mut **tx)
        .await
        .map_err(|e| HandlerError::retry(e.to_string()))?;
        tokio::time::sleep(self.hold).await;
        if let Some((key, reached)) = &self.stall
            && key == attempt.key().as_str()
        {
            reached.notify_one();
            std::future::pending::<()>().await;
        }
        if self.panic_once.swap(false, Ordering::SeqCst) {
            panic!("the handler crashed after writing its row");
        }
        let mut failures = self.failures.lock().unwrap();
        if let Some(left) = failures.get_mut(attempt.key().as_str()).filter(|left| **left > 0) {
            *left -= 1;
            return Err(HandlerError::retry("the gateway timed out"));
        }
        Ok(Outcome::new(id.to_string()))
    }
}

struct Setup {
    store: PostgresStore,
    table: String,
}

impl Setup {
    async fn new() -> Self {
        let store = common::fresh_store().await;
        let table = format!(
            "{}.c_{}",
            common::SCHEMA,
            store.table().rsplit('_').next().unwrap()
        );
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE {table} (id bigserial PRIMARY KEY, key text NOT NULL, cents bigint NOT NULL)"
        )))
        .execute(store.pool())
        .await
        .unwrap();
        Self { store, table }
    }

    fn charger(&self) -> Charger {
        Charger {
            table: self.table.clone(),
            ..Charger::default()
        }
    }

    fn consumer(&self, store: PostgresStore, charger: Charger) -> TxConsumer<PostgresStore, Charger> {
        TxConsumer::new("tx-payments", store, charger).backoff(Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(2),
        })
    }

    async fn rows(&self, key: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {} WHERE key = $1",
            self.table
        )))
        .bind(key)
        .fetch_one(self.store.pool())
        .await
        .unwrap()
    }

    /// How many transactions wrote the completed records of `keys` (each record's `xmin`).
    async fn committed_by(&self, keys: &[String]) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(DISTINCT xmin::text) FROM {} WHERE key = ANY($1) AND completed",
            self.store.table()
        )))
        .bind(keys)
        .fetch_one(self.store.pool())
        .await
        .unwrap()
    }

    /// Whether the key's record is completed (`Some(true)`), in flight, or absent.
    async fn completed(&self, key: &str) -> Option<bool> {
        self.store
            .get(&Scope::new("tx-payments").unwrap(), &Key::new(key).unwrap())
            .await
            .unwrap()
            .map(|record| matches!(record.state, RecordState::Completed { .. }))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_commit_one_charge_and_all_ack() {
    let setup = Setup::new().await;
    let charger = Charger {
        hold: Duration::from_millis(20),
        ..setup.charger()
    };
    let consumer = Arc::new(setup.consumer(setup.store.clone(), charger));
    for round in 0..3 {
        let key = format!("order-{round}");
        let message = Message::keyed(&key, "1000");
        let copies: Vec<_> = (0..32)
            .map(|copy| {
                let (consumer, message) = (Arc::clone(&consumer), message.clone());
                tokio::spawn(async move {
                    let message = if copy % 2 == 0 {
                        message
                    } else {
                        message.redelivered()
                    };
                    consumer.process(&message).await
                })
            })
            .collect();
        for copy in copies {
            // A duplicate waits on the row lock of the uncommitted claim, then replays.
            assert_eq!(copy.await.unwrap(), Disposition::Ack);
        }
        assert_eq!(setup.rows(&key).await, 1, "{key}");
        assert_eq!(setup.completed(&key).await, Some(true));
    }
}

#[tokio::test]
async fn failed_attempts_roll_back_their_rows() {
    let setup = Setup::new().await;
    let charger = setup.charger();
    charger.failures.lock().unwrap().insert("order-1".into(), 2);
    let consumer = setup.consumer(setup.store.clone(), charger).max_deliveries(5);
    let mut message = Message::keyed("order-1", "1000");
    for delivery in 1..=2 {
        assert_eq!(
            consumer.process(&message).await,
            Disposition::Nack {
                after: Duration::from_millis(100 << (delivery - 1))
            }
        );
        // The row the failed attempt wrote went with its transaction, and so did the claim.
        assert_eq!(setup.rows("order-1").await, 0);
        assert_eq!(setup.completed("order-1").await, None);
        message = message.redelivered();
    }
    assert_eq!(consumer.process(&message).await, Disposition::Ack);
    assert_eq!(consumer.process(&message.redelivered()).await, Disposition::Ack);
    assert_eq!(setup.rows("order-1").await, 1);

    // Always failing: dead-lettered at the limit, with the reason; nothing written.
    let always = setup.charger();
    always.failures.lock().unwrap().insert("order-2".into(), u32::MAX);
    let consumer = setup.consumer(setup.store.clone(), always).max_deliveries(3);
    let mut message = Message::keyed("order-2", "1000");
    message.deliveries = 3;
    let Disposition::DeadLetter { reason } = consumer.process(&message).await else {
        panic!("expected a dead letter");
    };
    assert_eq!(
        reason,
        "failed 3 deliveries, the last with: the gateway timed out"
    );
    assert_eq!(setup.rows("order-2").await, 0);
}

#[tokio::test]
async fn bad_messages_are_dead_lettered_with_the_reason() {
    let setup = Setup::new().await;
    let consumer = setup.consumer(setup.store.clone(), setup.charger());

    let keyless = Message::keyless("1000");
    let Disposition::DeadLetter { reason } = consumer.process(&keyless).await else {
        panic!("expected a dead letter");
    };
    assert_eq!(reason, "no Idempotency-Key header");

    let Disposition::DeadLetter { reason } = consumer.process(&Message::keyed("order-3", "ten euros")).await
    else {
        panic!("expected a dead letter");
    };
    assert_eq!(reason, "not an amount: \"ten euros\"");
    assert_eq!(
        setup.completed("order-3").await,
        None,
        "a fatal failure leaves no record"
    );

    assert_eq!(
        consumer.process(&Message::keyed("order-4", "1000")).await,
        Disposition::Ack
    );
    let Disposition::DeadLetter { reason } = consumer.process(&Message::keyed("order-4", "9999")).await
    else {
        panic!("expected a dead letter");
    };
    assert!(reason.contains("different payload"), "{reason}");
    assert_eq!(setup.rows("order-4").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_leaves_nothing_and_the_redelivery_charges_once() {
    let setup = Setup::new().await;
    let charger = setup.charger();
    charger.panic_once.store(true, Ordering::SeqCst);
    let consumer = Arc::new(setup.consumer(setup.store.clone(), charger));
    let message = Message::keyed("order-5", "1000");
    // The panic is caught: a failed delivery, retried later, its transaction rolled back.
    let Disposition::Nack { .. } = consumer.process(&message).await else {
        panic!("a panicking handler's message must be requeued");
    };
    assert_eq!(setup.rows("order-5").await, 0);
    assert_eq!(setup.completed("order-5").await, None);
    assert_eq!(consumer.process(&message.redelivered()).await, Disposition::Ack);
    assert_eq!(setup.rows("order-5").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_connection_requeues_and_nothing_is_charged_twice() {
    let setup = Setup::new().await;
    let proxy = common::start_proxy().await;
    let proxied = common::proxied(&setup.store, &proxy, 4).await;
    let charger = Charger {
        hold: Duration::from_millis(300),
        ..setup.charger()
    };
    let consumer = Arc::new(setup.consumer(proxied, charger));

    // The connection is cut while the handler holds its transaction open.
    let message = Message::keyed("order-6", "1000");
    let running = {
        let (consumer, message) = (Arc::clone(&consumer), message.clone());
        tokio::spawn(async move { consumer.process(&message).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    proxy.set_down(true);
    proxy.cut();
    let Disposition::Nack { .. } = running.await.unwrap() else {
        panic!("a lost connection must requeue");
    };
    // While the server is unreachable, deliveries are requeued, never acked.
    let Disposition::Nack { .. } = consumer.process(&message.redelivered()).await else {
        panic!("an unreachable store must requeue");
    };
    assert_eq!(setup.rows("order-6").await, 0);
    assert_eq!(setup.completed("order-6").await, None);

    proxy.set_down(false);
    let mut redelivery = message.redelivered().redelivered();
    let mut disposition = consumer.process(&redelivery).await;
    // The pool may hand out a connection that died in the cut before it notices; requeue again.
    for _ in 0..5 {
        if disposition == Disposition::Ack {
            break;
        }
        redelivery = redelivery.redelivered();
        disposition = consumer.process(&redelivery).await;
    }
    assert_eq!(disposition, Disposition::Ack);
    assert_eq!(
        consumer.process(&redelivery.redelivered()).await,
        Disposition::Ack
    );
    assert_eq!(setup.rows("order-6").await, 1);
}

/// `process_many` of `messages` on `consumer`: the dispositions it handed over, in order.
async fn decide_batch(
    consumer: &TxConsumer<PostgresStore, Charger>,
    messages: &[Message],
) -> Vec<Disposition> {
    let (decided, mut dispositions) = Decisions::channel();
    let batch: Vec<&Message> = messages.iter().collect();
    consumer.process_many(&batch, &decided).await;
    drop(decided);
    let mut handed = Vec::new();
    while let Some(disposition) = dispositions.recv().await {
        handed.push(disposition);
    }
    handed
}

/// `count` messages keyed `{prefix}-0`, `{prefix}-1`, … of 1000 cents.
fn charges(prefix: &str, count: usize) -> Vec<Message> {
    (0..count)
        .map(|i| Message::keyed(&format!("{prefix}-{i}"), "1000"))
        .collect()
}

/// A batch is one transaction: its records commit together (one writer). A handler that
/// fails fatally is rolled back to its savepoint and dead-lettered alone, the batch going on;
/// one that fails to be retried is rolled back alone, nacked, and ends the batch, whose
/// earlier messages commit; the messages after it never ran, and their redelivery runs them
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_commits_once_and_a_failing_message_rolls_back_alone() {
    let setup = Setup::new().await;
    let charger = setup.charger();
    charger.failures.lock().unwrap().insert("b-7".into(), 1);
    let consumer = setup.consumer(setup.store.clone(), charger);
    let mut messages = charges("b", 10);
    messages[5].payload = "ten euros".into();

    let handed = decide_batch(&consumer, &messages).await;
    let mut expected = vec![Disposition::Ack; 5];
    expected.push(Disposition::DeadLetter {
        reason: "not an amount: \"ten euros\"".into(),
    });
    expected.push(Disposition::Ack);
    expected.push(Disposition::Nack {
        after: Duration::from_millis(100),
    });
    assert_eq!(handed, expected);
    for (i, rows) in [1, 1, 1, 1, 1, 0, 1, 0, 0, 0].into_iter().enumerate() {
        assert_eq!(setup.rows(&format!("b-{i}")).await, rows, "b-{i}");
    }
    let committed: Vec<String> = [0, 1, 2, 3, 4, 6].iter().map(|i| format!("b-{i}")).collect();
    assert_eq!(
        setup.committed_by(&committed).await,
        1,
        "one transaction for the batch"
    );
    assert_eq!(
        setup.completed("b-5").await,
        None,
        "a fatal failure leaves no record"
    );

    // The nacked message and those after it come again: each runs once.
    let again: Vec<Message> = messages[7..].iter().map(Message::redelivered).collect();
    assert_eq!(decide_batch(&consumer, &again).await, vec![Disposition::Ack; 3]);
    // And the whole batch once more is all duplicates (the dead letter's key was never
    // recorded: its fatal payload is dead-lettered again).
    let mut replayed = decide_batch(&consumer, &messages).await;
    assert!(matches!(replayed.remove(5), Disposition::DeadLetter { .. }));
    assert_eq!(replayed, vec![Disposition::Ack; 9]);
    for i in (0..10).filter(|i| *i != 5) {
        assert_eq!(setup.rows(&format!("b-{i}")).await, 1, "b-{i}");
    }
}

/// The same key twice in one batch: the first runs, the second is a duplicate once the
/// batch committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_twice_in_a_batch_runs_once() {
    let setup = Setup::new().await;
    let consumer = setup.consumer(setup.store.clone(), setup.charger());
    let mut messages = charges("twice", 3);
    messages.push(messages[1].clone());
    assert_eq!(
        decide_batch(&consumer, &messages).await,
        vec![Disposition::Ack; 4]
    );
    assert_eq!(setup.rows("twice-1").await, 1);
}

/// A batch whose task is aborted in the middle (a crash) has handed nothing over and
/// committed nothing: its redelivery runs every message once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_in_the_middle_of_a_batch_commits_nothing_and_the_redelivery_runs_each_once() {
    let setup = Setup::new().await;
    let reached = Arc::new(tokio::sync::Notify::new());
    let charger = Charger {
        stall: Some(("crash-5".into(), Arc::clone(&reached))),
        ..setup.charger()
    };
    let consumer = Arc::new(setup.consumer(setup.store.clone(), charger));
    let messages = charges("crash", 8);
    let (decided, mut dispositions) = Decisions::channel();
    let running = {
        let (consumer, messages, decided) = (Arc::clone(&consumer), messages.clone(), decided.clone());
        tokio::spawn(async move {
            let batch: Vec<&Message> = messages.iter().collect();
            consumer.process_many(&batch, &decided).await;
        })
    };
    reached.notified().await;
    running.abort();
    assert!(running.await.unwrap_err().is_cancelled());
    drop(decided);
    assert_eq!(
        dispositions.recv().await,
        None,
        "nothing is acked before the batch commits"
    );
    for i in 0..8 {
        assert_eq!(setup.rows(&format!("crash-{i}")).await, 0, "crash-{i}");
        assert_eq!(setup.completed(&format!("crash-{i}")).await, None, "crash-{i}");
    }

    let fresh = setup.consumer(setup.store.clone(), setup.charger());
    let again: Vec<Message> = messages.iter().map(Message::redelivered).collect();
    assert_eq!(decide_batch(&fresh, &again).await, vec![Disposition::Ack; 8]);
    for i in 0..8 {
        assert_eq!(setup.rows(&format!("crash-{i}")).await, 1, "crash-{i}");
    }
}
