//! `idem inbox` and `idem outbox` against the real PostgreSQL server: a poison message parked as
//! dead with its error visible, replayed once the handler is fixed, the counts, and bad input.

use crate::common;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::idem;
use idempotency::postgres::PgTransaction;
use idempotency::postgres::sqlx::{self, AssertSqlSafe};
use idempotency_consumer::{Backoff, HandlerError};
use idempotency_outbox::{
    Inbox, InboxHandler, InboxMessage, InboxWorker, Outbox, OutgoingMessage, RetryPolicy, Tables,
};
use idempotency_testkit::eventually;

const SCHEMA: &str = "idempotency_outbox_tests";

/// Fails the keys in `failing` with the tax service's error; records what it handled.
struct Tax {
    failing: Mutex<HashSet<String>>,
    handled: Mutex<Vec<String>>,
}

impl InboxHandler for Tax {
    async fn handle(&self, message: &InboxMessage, _tx: &mut PgTransaction) -> Result<(), HandlerError> {
        if self.failing.lock().unwrap().contains(&message.key) {
            return Err(HandlerError::retry("the tax service answered 503"));
        }
        self.handled.lock().unwrap().push(message.key.clone());
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_find_a_dead_message_and_replay_it_once_fixed() {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    // The time orders runs (old tables are dropped by it); the random part keeps two tests of
    // one process (`cargo test` runs them as threads) apart when they start in the same instant.
    let random = idempotency_core::Key::generate().as_str().replace('-', "");
    let suffix = format!("{}_{}", now.as_secs(), &random[20..]);
    let (inbox_table, outbox_table) = (format!("inbox_{suffix}"), format!("outbox_{suffix}"));
    let url = common::database_url();
    let at = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend([
            "--database",
            url.as_str(),
            "--schema",
            SCHEMA,
            "--inbox-table",
            inbox_table.as_str(),
            "--outbox-table",
            outbox_table.as_str(),
        ]);
        idem(&all)
    };
    // Before the tables exist: a clear error, and nothing created.
    let (code, _, err) = at(&["inbox", "list"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("does not exist") && err.contains("idem inbox migrate"),
        "{err}"
    );
    let (code, out, err) = at(&["inbox", "migrate"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("ready"), "{out}");

    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let tables = Tables::default()
        .schema(SCHEMA)
        .unwrap()
        .inbox(&inbox_table)
        .unwrap()
        .outbox(&outbox_table)
        .unwrap();
    let inbox = Inbox::new(pool.clone(), tables.clone(), "invoices").unwrap();
    for key in ["invoice-1", "poison", "invoice-2"] {
        inbox
            .receive(&idempotency::Key::new(key).unwrap(), b"{\"amount\":1000}", &[])
            .await
            .unwrap();
    }
    let handler = Arc::new(Tax {
        failing: Mutex::new(HashSet::from(["poison".to_owned()])),
        handled: Mutex::new(Vec::new()),
    });
    let retry = RetryPolicy {
        backoff: Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(50),
        },
        max_attempts: 3,
    };
    let worker = InboxWorker::new(inbox, Arc::clone(&handler))
        .retry(retry)
        .poll(Duration::from_millis(50));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move { worker.run_until(async { drop(stopped.await) }).await });
    eventually(Duration::from_secs(60), "the poison message dead", async || {
        let (_, out, _) = at(&["inbox", "stats", "--json"]);
        let stats: serde_json::Value = serde_json::from_str(&out).unwrap();
        stats["dead"] == 1 && stats["pending"] == 0
    })
    .await;

    let (code, out, err) = at(&["inbox", "list", "--state", "dead"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("poison")
            && out.contains("failed 3 attempts, the last with: the tax service answered 503"),
        "{out}"
    );
    assert!(!out.contains("invoice-1"), "{out}");
    let (_, out, _) = at(&["inbox", "list", "--state", "dead", "--json"]);
    let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(rows[0]["key"], "poison");
    assert_eq!(rows[0]["attempts"], 3);
    let (code, out, err) = at(&["inbox", "show", "--consumer", "invoices", "poison"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("{\"amount\":1000}"), "{out}");

    handler.failing.lock().unwrap().clear();
    let (code, out, err) = at(&["inbox", "replay", "--consumer", "invoices", "--key", "poison"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "1 dead message(s) back to pending\n");
    eventually(
        Duration::from_secs(60),
        "the replayed message processed",
        async || {
            let (_, out, _) = at(&["inbox", "stats", "--json"]);
            let stats: serde_json::Value = serde_json::from_str(&out).unwrap();
            stats["processed"] == 3
        },
    )
    .await;
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
    let handled = handler.handled.lock().unwrap().clone();
    assert_eq!(
        handled.iter().filter(|key| *key == "poison").count(),
        1,
        "{handled:?}"
    );

    // The outbox's counts.
    let mut tx = pool.begin().await.unwrap();
    Outbox::new(tables.clone())
        .enqueue(&mut tx, &OutgoingMessage::new("invoices", "invoice-1", "sent"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let (code, out, err) = at(&["outbox", "stats", "--json"]);
    assert_eq!(code, 0, "{err}");
    let stats: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (stats["pending"].as_i64(), stats["sent"].as_i64()),
        (Some(1), Some(0))
    );
    let (code, out, _) = at(&["outbox", "list"]);
    assert_eq!(code, 0);
    assert!(out.contains("invoice-1") && out.contains("pending"), "{out}");

    // Purging keeps what is not old enough; pending rows cannot be purged at all.
    let (code, out, err) = at(&["inbox", "purge", "--state", "processed", "--older-than", "1h"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "0 processed row(s) purged\n");
    let (code, out, err) = at(&["inbox", "purge", "--state", "processed", "--older-than", "0s"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "3 processed row(s) purged\n");
    let (code, _, err) = at(&["inbox", "purge", "--state", "pending"]);
    assert_eq!(code, 2, "{err}");

    for table in [tables.qualified_inbox(), tables.qualified_outbox()] {
        sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {table}")))
            .execute(&pool)
            .await
            .unwrap();
    }
}

/// Bad names and unreachable databases are clear errors, without the password.
#[test]
fn bad_input_is_refused_clearly() {
    let (code, _, err) = idem(&[
        "inbox",
        "list",
        "--database",
        "postgres://postgres@127.0.0.1:5432/test",
        "--inbox-table",
        "x; DROP TABLE y",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("unsafe SQL identifier"), "{err}");
    let (code, _, err) = idem(&[
        "inbox",
        "stats",
        "--database",
        "postgres://app:hunter2@127.0.0.1:1/db",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(!err.contains("hunter2"), "{err}");
    let (code, _, err) = idem(&[
        "inbox",
        "list",
        "--database",
        "postgres://x@127.0.0.1:1/db",
        "--state",
        "lost",
    ]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = idem(&["outbox", "stats"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--database"), "{err}");
}
