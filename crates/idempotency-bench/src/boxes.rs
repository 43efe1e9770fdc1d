//! The inbox and the outbox on PostgreSQL.
//!
//! * `inbox`: messages/s handled by `InboxWorker`s, 1 and 4 competing, over the same inbox in the
//!   same run. Each measurement stores `MESSAGES` messages first (not timed), then times the
//!   workers from start until no message is pending. The handler inserts one ledger row in the
//!   marking transaction.
//! * `outbox`: the latency from an enqueue's commit to the broker's publisher confirm, for one
//!   relay that `LISTEN`s for the enqueue's `NOTIFY` and for one that only polls (every 100 ms),
//!   alternating in the same run. Messages are enqueued one per transaction, every 5 ms, and
//!   published to a RabbitMQ queue with confirms.

use crate::servers::{amqp_url, rabbit_queue};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotency_consumer::{BoxError, HandlerError};
use idempotency_core::Key;
use idempotency_outbox::{
    AmqpPublisher, Inbox, InboxHandler, InboxMessage, InboxWorker, Outbox, OutboxMessage, OutgoingMessage,
    Publisher, Relay, Tables, inbox_stats,
};
use idempotency_postgres::PgTransaction;
use idempotency_postgres::sqlx::{self, AssertSqlSafe, PgPool};

use crate::measure::{Samples, per_second, rate, runtime};

const MESSAGES: usize = 3000;
const LATENCY_MESSAGES: usize = 400;

fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// Inserts one ledger row per message in the marking transaction.
struct Ledger(String);

impl InboxHandler for Ledger {
    async fn handle(&self, message: &InboxMessage, tx: &mut PgTransaction) -> Result<(), HandlerError> {
        sqlx::query(AssertSqlSafe(format!("INSERT INTO {} (key) VALUES ($1)", self.0)))
            .bind(&message.key)
            .execute(&mut **tx)
            .await
            .map_err(HandlerError::retry)?;
        Ok(())
    }
}

/// Tables of this bench run, created fresh, and the ledger.
async fn setup(pool: &PgPool) -> Result<(Tables, String), String> {
    let tag = std::process::id();
    let tables = Tables::default()
        .schema("idempotency_bench")
        .and_then(|t| t.inbox(&format!("inbox_{tag}")))
        .and_then(|t| t.outbox(&format!("outbox_{tag}")))
        .map_err(|e| e.to_string())?;
    tables.migrate(pool).await.map_err(|e| e.to_string())?;
    let ledger = format!("idempotency_bench.ledger_{tag}");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {ledger} (key text NOT NULL)"
    )))
    .execute(pool)
    .await
    .map_err(|e| e.to_string())?;
    Ok((tables, ledger))
}

async fn teardown(pool: &PgPool, tables: &Tables, ledger: &str) {
    for table in [
        tables.qualified_inbox(),
        tables.qualified_outbox(),
        ledger.to_owned(),
    ] {
        let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
            .execute(pool)
            .await;
    }
}

pub(crate) fn run_inbox(rounds: usize) -> Result<(), String> {
    runtime()?.block_on(async {
        let pool = PgPool::connect(&database_url())
            .await
            .map_err(|e| e.to_string())?;
        let (tables, ledger) = setup(&pool).await?;
        println!(
            "\n## Inbox: messages/s handled by competing workers ({MESSAGES} messages per measurement)\n"
        );
        println!("| workers | msg/s | min–max |");
        println!("|---:|---:|---:|");
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(), Vec::new()];
        for round in 0..rounds {
            for (variant, workers) in [1, 4].into_iter().enumerate() {
                let consumer = format!("bench-{round}-{workers}");
                rates[variant].push(inbox_rate(&pool, &tables, &ledger, &consumer, workers).await?);
            }
        }
        for (workers, rates) in [1, 4].into_iter().zip(rates) {
            let samples = Samples::of(rates);
            println!(
                "| {workers} | {} | {} |",
                per_second(samples.median),
                samples.spread()
            );
        }
        teardown(&pool, &tables, &ledger).await;
        Ok(())
    })
}

async fn inbox_rate(
    pool: &PgPool,
    tables: &Tables,
    ledger: &str,
    consumer: &str,
    workers: usize,
) -> Result<f64, String> {
    let inbox = Inbox::new(pool.clone(), tables.clone(), consumer).map_err(|e| e.to_string())?;
    for n in 0..MESSAGES {
        let key = Key::new(format!("m-{n}")).map_err(|e| e.to_string())?;
        inbox
            .receive(&key, b"{\"amount\":1000}", &[])
            .await
            .map_err(|e| e.to_string())?;
    }
    let worker = InboxWorker::new(inbox, Arc::new(Ledger(ledger.to_owned()))).workers(workers);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let started = Instant::now();
    let running = tokio::spawn(async move { worker.run_until(async { drop(stopped.await) }).await });
    loop {
        let stats = inbox_stats(pool, tables, Some(consumer))
            .await
            .map_err(|e| e.to_string())?;
        if stats.pending == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed();
    let _ = stop.send(());
    running
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    Ok(rate(MESSAGES as u64, elapsed))
}

/// Publishes with confirms and notes when each confirm arrived.
struct Timed {
    inner: AmqpPublisher,
    confirmed: Mutex<HashMap<i64, Instant>>,
}

impl Publisher for Timed {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), BoxError> {
        self.inner.publish(message).await?;
        self.confirmed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(message.id, Instant::now());
        Ok(())
    }
}

pub(crate) fn run_outbox(rounds: usize) -> Result<(), String> {
    runtime()?.block_on(async {
        let pool = PgPool::connect(&database_url()).await.map_err(|e| e.to_string())?;
        let (tables, ledger) = setup(&pool).await?;
        let queue = format!("idem-bench-outbox-{}", std::process::id());
        let (_connection, channel) = rabbit_queue(&queue).await?;
        println!(
            "\n## Outbox: from the enqueue's commit to the publisher confirm ({LATENCY_MESSAGES} messages per measurement, one every 5 ms)\n"
        );
        println!("| relay | p50 | p99 | max |");
        println!("|---|---:|---:|---:|");
        let mut latencies: Vec<Vec<Duration>> = vec![Vec::new(), Vec::new()];
        for _ in 0..rounds {
            for (variant, listen) in [true, false].into_iter().enumerate() {
                latencies[variant].extend(outbox_latencies(&pool, &tables, &queue, listen).await?);
            }
        }
        for (name, mut values) in ["LISTEN/NOTIFY (and polling every 100 ms)", "polling every 100 ms only"]
            .into_iter()
            .zip(latencies)
        {
            values.sort();
            let at = |q: f64| {
                #[expect(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss, reason = "an index into a short list")]
                let index = ((values.len() as f64 - 1.0) * q).round() as usize;
                format!("{:.1} ms", values[index].as_secs_f64() * 1000.0)
            };
            println!("| {name} | {} | {} | {} |", at(0.5), at(0.99), at(1.0));
        }
        let _ = channel
            .queue_delete(queue.as_str().into(), lapin::options::QueueDeleteOptions::default())
            .await;
        teardown(&pool, &tables, &ledger).await;
        Ok(())
    })
}

async fn outbox_latencies(
    pool: &PgPool,
    tables: &Tables,
    queue: &str,
    listen: bool,
) -> Result<Vec<Duration>, String> {
    let publisher = Arc::new(Timed {
        inner: AmqpPublisher::new(amqp_url(), ""),
        confirmed: Mutex::new(HashMap::new()),
    });
    let outbox = Outbox::new(tables.clone());
    let relay = Relay::new(pool.clone(), outbox.clone(), Arc::clone(&publisher))
        .notifications(listen)
        .poll(Duration::from_millis(100));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move { relay.run_until(async { drop(stopped.await) }).await });
    // Let the relay drain what an earlier measurement left and start listening.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut committed = HashMap::new();
    for n in 0..LATENCY_MESSAGES {
        let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
        let id = outbox
            .enqueue(
                &mut tx,
                &OutgoingMessage::new(queue, format!("agg-{}", n % 10), "{}"),
            )
            .await
            .map_err(|e| e.to_string())?;
        tx.commit().await.map_err(|e| e.to_string())?;
        committed.insert(id, Instant::now());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let started = Instant::now();
    loop {
        let confirmed = publisher
            .confirmed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len();
        if confirmed >= LATENCY_MESSAGES {
            break;
        }
        if started.elapsed() > Duration::from_secs(60) {
            return Err(format!(
                "only {confirmed} of {LATENCY_MESSAGES} outbox messages confirmed in 60 s"
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    running
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    let confirmed = publisher
        .confirmed
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    Ok(committed
        .iter()
        .filter_map(|(id, at)| {
            confirmed
                .get(id)
                .map(|confirmed| confirmed.saturating_duration_since(*at))
        })
        .collect())
}
