//! The same-transaction mode against librdkafka's in-process cluster and the real PostgreSQL
//! server: the handler writes its business row in the record's transaction, and the offset is
//! committed to Kafka only after that transaction commits.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{Cluster, eventually};
use idempotency_consumer::{Backoff, Delivery, HandlerError, TxConsumer, TxHandler};
use idempotency_core::{Attempt, Outcome};
use idempotency_kafka::{KafkaMessage, Worker, publish};
use idempotency_postgres::sqlx::{self, AssertSqlSafe};
use idempotency_postgres::{PgTransaction, PostgresOptions, PostgresStore};
use idempotency_testkit::brokers::{spawn_until_stopped, stop_and_wait};

const SCHEMA: &str = "idempotency_kafka_tests";

/// Inserts one charge row per call in the record's transaction; the keys in `fail_once` fail
/// with `Retry` after writing their row, once.
struct ChargeRow {
    table: String,
    fail_once: Mutex<HashSet<String>>,
    calls: Arc<Mutex<HashMap<String, u32>>>,
}

impl TxHandler<KafkaMessage, PostgresStore> for ChargeRow {
    async fn handle(
        &self,
        message: &KafkaMessage,
        tx: &mut PgTransaction,
        attempt: &Attempt,
    ) -> Result<Outcome, HandlerError> {
        let key = attempt.key().as_str();
        *self.calls.lock().unwrap().entry(key.to_owned()).or_default() += 1;
        let cents: i64 = std::str::from_utf8(message.payload())
            .ok()
            .and_then(|text| text.parse().ok())
            .ok_or_else(|| HandlerError::fatal("the payload is not an amount in cents"))?;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (key, cents) VALUES ($1, $2)",
            self.table
        )))
        .bind(key)
        .bind(cents)
        .execute(&mut **tx)
        .await
        .map_err(|e| HandlerError::retry(e.to_string()))?;
        if self.fail_once.lock().unwrap().remove(key) {
            return Err(HandlerError::retry("the ledger service timed out"));
        }
        Ok(Outcome::new("charged"))
    }
}

/// A store and a charges table of their own on the server `DATABASE_URL` names (or the loopback
/// default `scripts/services` starts); panics when the server is unreachable.
async fn store_and_table() -> (PostgresStore, String) {
    let url =
        std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let suffix = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    let options = PostgresOptions::from_url(&url)
        .unwrap()
        .schema(SCHEMA)
        .unwrap()
        .table(&format!("records_{suffix}"))
        .unwrap()
        .max_connections(16);
    let store = PostgresStore::connect_with(options)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {url} is needed for this test: {e}"));
    let table = format!("{SCHEMA}.charges_{suffix}");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {table} (id bigserial PRIMARY KEY, key text NOT NULL, cents bigint NOT NULL)"
    )))
    .execute(store.pool())
    .await
    .unwrap();
    (store, table)
}

/// 64 copies of one charge spread over 8 partitions and 3 workers of one group make one row; a
/// handler that fails after writing its row rolls the row and the record back, and the retry
/// runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_copies_make_one_row_and_a_failure_rolls_back() {
    let cluster = Cluster::new(1, &[("charges", 8), ("charges.dead", 1)]);
    let (store, table) = store_and_table().await;
    let calls = Arc::new(Mutex::new(HashMap::new()));
    let handler = ChargeRow {
        table: table.clone(),
        fail_once: Mutex::new(HashSet::from(["charge-2".to_owned()])),
        calls: Arc::clone(&calls),
    };
    let processor = Arc::new(
        TxConsumer::new("kafka-same-transaction", store.clone(), handler).backoff(Backoff {
            initial: Duration::from_millis(20),
            max: Duration::from_millis(200),
        }),
    );
    // The copies carry distinct record keys, so they land on every partition.
    let charge = idempotency_core::Key::new("charge-1").unwrap();
    let copies = (0..64).map(|n| {
        let record_key = format!("copy-{n}");
        let (producer, charge) = (&cluster.producer, &charge);
        async move {
            publish(producer, "charges", charge, Some(record_key.as_bytes()), b"1000")
                .await
                .unwrap();
        }
    });
    futures_util::future::join_all(copies).await;
    cluster.publish("charges", "charge-2", b"2500").await;
    let workers: Vec<_> = (0..3)
        .map(|n| {
            let worker = Worker::new(
                cluster.config("same-transaction"),
                "charges",
                Arc::clone(&processor),
            )
            .name(format!("same-transaction-{n}"))
            .commit_every(Duration::from_millis(100), 10);
            spawn_until_stopped(|stopped| async move { worker.run_until(stopped).await })
        })
        .collect();
    eventually(Duration::from_secs(120), "the group's offsets at the end", || {
        cluster.committed_and_end("same-transaction", "charges", 8) == (65, 65)
    })
    .await;
    for (stop, running) in workers {
        stop_and_wait(stop, running).await.unwrap();
    }
    let rows: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT key, count(*) FROM {table} GROUP BY key ORDER BY key"
    )))
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(rows, [("charge-1".to_owned(), 1), ("charge-2".to_owned(), 1)]);
    // The copies waited on the first one's row lock and replayed it; the failed charge ran
    // again once.
    let calls = calls.lock().unwrap().clone();
    assert_eq!(
        calls,
        HashMap::from([("charge-1".to_owned(), 1), ("charge-2".to_owned(), 2)])
    );
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE {table}; DROP TABLE {}",
        store.table()
    )))
    .execute(store.pool())
    .await
    .unwrap();
}
