//! The inbox against the real PostgreSQL server: dedup at the door, competing workers, retries,
//! dead rows and their replay, and bad input.

use crate::common;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{LedgerHandler, Running, fresh, ledger_counts, pool};
use idempotency_consumer::{Backoff, Disposition, HandlerError, Processor};
use idempotency_core::Key;
use idempotency_outbox::{
    Inbox, InboxHandler, InboxMessage, InboxReceiver, InboxState, InboxWorker, Received, RetryPolicy, Tables,
    inbox_list, inbox_replay, inbox_stats,
};
use idempotency_postgres::PgTransaction;
use idempotency_postgres::sqlx::{self, AssertSqlSafe};
use idempotency_testkit::eventually;
use idempotency_testkit::message::TestMessage;

const LIMIT: Duration = Duration::from_secs(120);

/// A broker message for the receiver: a `trace` header of raw bytes, then the key header.
fn message(key: &str, payload: &str) -> TestMessage {
    let mut message = TestMessage::keyless(payload);
    message.headers = vec![
        ("trace".to_owned(), vec![0xff, 0x01]),
        ("Idempotency-Key".to_owned(), key.as_bytes().to_vec()),
    ];
    message
}

/// A stored key answers a copy as a duplicate and another payload as a mismatch; the receiver
/// acks the first two and dead-letters the third, and messages without a usable key, with their
/// reasons. The headers are kept byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_door_stores_once_and_turns_away_what_it_cannot_key() {
    let pool = pool().await;
    let (tables, _) = fresh(&pool).await;
    let inbox = Inbox::new(pool.clone(), tables.clone(), "orders").unwrap();
    let key = Key::new("order-1").unwrap();
    assert_eq!(
        inbox.receive(&key, b"EUR 10", &[]).await.unwrap(),
        Received::Stored
    );
    assert_eq!(
        inbox.receive(&key, b"EUR 10", &[]).await.unwrap(),
        Received::Duplicate
    );
    assert_eq!(
        inbox.receive(&key, b"EUR 99", &[]).await.unwrap(),
        Received::Mismatch
    );
    // Another consumer's inbox in the same table is its own.
    let other = Inbox::new(pool.clone(), tables.clone(), "invoices").unwrap();
    assert_eq!(
        other.receive(&key, b"EUR 99", &[]).await.unwrap(),
        Received::Stored
    );

    let receiver = InboxReceiver::new(inbox.clone());
    assert_eq!(
        receiver.process(&message("order-2", "EUR 20")).await,
        Disposition::Ack
    );
    assert_eq!(
        receiver.process(&message("order-2", "EUR 20")).await,
        Disposition::Ack
    );
    let reused = receiver.process(&message("order-2", "EUR 21")).await;
    assert!(
        matches!(&reused, Disposition::DeadLetter { reason } if reason.contains("different payload")),
        "{reused:?}"
    );
    let keyless = receiver.process(&TestMessage::keyless("x")).await;
    assert!(
        matches!(&keyless, Disposition::DeadLetter { reason } if reason == "no Idempotency-Key header"),
        "{keyless:?}"
    );
    let invalid = receiver.process(&message("bad\nkey", "x")).await;
    assert!(
        matches!(&invalid, Disposition::DeadLetter { reason } if reason.starts_with("invalid key in the Idempotency-Key header: ")),
        "{invalid:?}"
    );
    let shown = idempotency_outbox::inbox_show(&pool, &tables, "orders", "order-2")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(shown.payload.as_deref(), Some(&b"EUR 20"[..]));
    assert_eq!(
        shown.headers,
        vec![
            ("trace".to_owned(), vec![0xff, 0x01]),
            ("Idempotency-Key".to_owned(), b"order-2".to_vec())
        ]
    );
    let stats = inbox_stats(&pool, &tables, Some("orders")).await.unwrap();
    assert_eq!(stats.pending, 2);
    assert!(
        Inbox::new(pool.clone(), tables, "").is_err(),
        "an empty consumer name"
    );
}

/// Four workers compete for 2,000 messages: every one is handled exactly once (a ledger row in
/// the marking transaction, counted without a unique constraint).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_competing_workers_handle_each_message_once() {
    let pool = pool().await;
    let (tables, ledger) = fresh(&pool).await;
    let inbox = Inbox::new(pool.clone(), tables.clone(), "payments").unwrap();
    for n in 0..2000 {
        let key = Key::new(format!("payment-{n}")).unwrap();
        inbox.receive(&key, b"EUR 10", &[]).await.unwrap();
    }
    let worker = InboxWorker::new(
        inbox.clone(),
        Arc::new(LedgerHandler {
            ledger: ledger.clone(),
        }),
    )
    .workers(4);
    let running = Running::spawn(|stopped| async move { worker.run_until(stopped).await });
    eventually(LIMIT, "the backlog drained", || {
        let (pool, tables) = (pool.clone(), tables.clone());
        async move {
            inbox_stats(&pool, &tables, Some("payments"))
                .await
                .unwrap()
                .pending
                == 0
        }
    })
    .await;
    running.stop().await;
    assert_eq!(ledger_counts(&pool, &ledger).await, (2000, 2000));
}

/// Fails for the keys in `failing` (after writing its ledger row, which the rollback undoes).
struct Flaky {
    ledger: String,
    failing: Mutex<HashSet<String>>,
}

impl InboxHandler for Flaky {
    async fn handle(&self, message: &InboxMessage, tx: &mut PgTransaction) -> Result<(), HandlerError> {
        common::record(tx, &self.ledger, &message.key).await?;
        if self.failing.lock().unwrap().contains(&message.key) {
            return Err(HandlerError::retry("the tax service answered 503"));
        }
        if message.key == "panics" {
            panic!("cannot parse the order");
        }
        Ok(())
    }
}

/// A message that keeps failing goes `dead` after the attempt limit with its error visible;
/// its rows are rolled back each time; once the handler is fixed, a replay runs it once. A
/// panicking handler does not take the worker down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_goes_dead_and_a_replay_runs_it_once_fixed() {
    let pool = pool().await;
    let (tables, ledger) = fresh(&pool).await;
    let inbox = Inbox::new(pool.clone(), tables.clone(), "orders").unwrap();
    for key in ["poison", "panics", "healthy"] {
        inbox.receive(&Key::new(key).unwrap(), b"{}", &[]).await.unwrap();
    }
    let handler = Arc::new(Flaky {
        ledger: ledger.clone(),
        failing: Mutex::new(HashSet::from(["poison".to_owned()])),
    });
    let retry = RetryPolicy {
        backoff: Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(50),
        },
        max_attempts: 3,
    };
    let worker = InboxWorker::new(inbox.clone(), Arc::clone(&handler))
        .retry(retry)
        .poll(Duration::from_millis(50));
    let running = Running::spawn(|stopped| async move { worker.run_until(stopped).await });
    eventually(LIMIT, "two dead, one processed", || {
        let (pool, tables) = (pool.clone(), tables.clone());
        async move {
            let stats = inbox_stats(&pool, &tables, Some("orders")).await.unwrap();
            (stats.pending, stats.dead, stats.processed) == (0, 2, 1)
        }
    })
    .await;
    let dead = inbox_list(&pool, &tables, Some(InboxState::Dead), Some("orders"), 10)
        .await
        .unwrap();
    let errors: Vec<_> = dead
        .iter()
        .map(|row| (row.key.as_str(), row.attempts, row.last_error.clone().unwrap()))
        .collect();
    assert_eq!(errors[0].0, "poison");
    assert_eq!(errors[0].1, 3);
    assert!(
        errors[0].2.contains("failed 3 attempts") && errors[0].2.contains("503"),
        "{errors:?}"
    );
    assert_eq!(errors[1].0, "panics");
    assert!(
        errors[1].2.contains("panic: cannot parse the order"),
        "{errors:?}"
    );
    // Only the healthy message's row survived the rollbacks.
    assert_eq!(ledger_counts(&pool, &ledger).await, (1, 1));

    handler.failing.lock().unwrap().clear();
    assert_eq!(
        inbox_replay(&pool, &tables, Some("orders"), Some("poison"))
            .await
            .unwrap(),
        1
    );
    eventually(LIMIT, "the replayed message processed", || {
        let (pool, tables) = (pool.clone(), tables.clone());
        async move {
            inbox_stats(&pool, &tables, Some("orders"))
                .await
                .unwrap()
                .processed
                == 2
        }
    })
    .await;
    running.stop().await;
    assert_eq!(ledger_counts(&pool, &ledger).await, (2, 2));
    // Replaying again finds nothing dead under that key.
    assert_eq!(
        inbox_replay(&pool, &tables, Some("orders"), Some("poison"))
            .await
            .unwrap(),
        0
    );
}

/// Missing tables, a table of another version and unsafe names are refused clearly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_tables_and_versions_are_clear_errors() {
    let pool = pool().await;
    let missing = Tables::default()
        .schema(common::SCHEMA)
        .unwrap()
        .inbox("no_such_inbox")
        .unwrap();
    let error = missing.check(&pool).await.unwrap_err().to_string();
    assert!(
        error.contains("does not exist") && error.contains("idem inbox migrate"),
        "{error}"
    );

    let (tables, _) = fresh(&pool).await;
    tables.check(&pool).await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "COMMENT ON TABLE {} IS 'idempotency-inbox v99'",
        tables.qualified_inbox()
    )))
    .execute(&pool)
    .await
    .unwrap();
    for error in [
        tables.check(&pool).await.unwrap_err().to_string(),
        tables.migrate(&pool).await.unwrap_err().to_string(),
    ] {
        assert!(error.contains("v99") && error.contains("v1"), "{error}");
    }
    let unsafe_name = Tables::default()
        .inbox("inbox; DROP TABLE x")
        .unwrap_err()
        .to_string();
    assert!(unsafe_name.contains("unsafe SQL identifier"), "{unsafe_name}");
}
