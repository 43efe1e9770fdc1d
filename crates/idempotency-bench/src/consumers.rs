//! Consumers: messages per second consumed and acknowledged with the guard (`process` of the
//! broker adapter) against the same consumer without it (handle, then ack), on the same broker
//! in the same run, for RabbitMQ and NATS JetStream, with the Redis and PostgreSQL stores.
//!
//! Each measurement publishes `MESSAGES` messages with distinct keys first (not timed), then
//! times one consumer draining them with up to 64 messages in process at once. Two pairs:
//! * a handler that does nothing but count, with the guard on each store vs plain acks: what the
//!   idempotency record costs per message;
//! * a handler that inserts one row into PostgreSQL, in same-transaction mode (claim, row and
//!   completion in one commit) vs the same insert in its own transaction: a consumer whose side
//!   effect is a database write, with and without the record.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures_util::StreamExt;
use idempotency_consumer::adapter::BatchPlan;
use idempotency_consumer::{Consumer, Delivery, Disposition, Handler, HandlerError, TxConsumer, TxHandler};
use idempotency_core::{Attempt, Key, Outcome, StoreAdmin};
use idempotency_postgres::{PgTransaction, PostgresStore};
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeleteOptions};
use lapin::types::FieldTable;

use crate::cpu::Usage;
use crate::measure::{per_second, runtime};

pub(crate) const MESSAGES: usize = 20_000;
/// How long the bench's records live.
pub(crate) const RETENTION: Duration = Duration::from_secs(60);
/// Messages in process at once, in every variant (a consumer with a prefetch of 100 works so).
const CONCURRENCY: usize = 64;
/// The batched variant's largest batch (the workers' default): the plan makes it half the
/// concurrency, two batches in flight.
const BATCH: usize = idempotency_consumer::DEFAULT_BATCH;
/// How long a batch waits for more messages (the workers' default).
const LINGER: Duration = idempotency_consumer::DEFAULT_LINGER;
pub(crate) type DynStore = Arc<dyn StoreAdmin>;

/// Counts what it handles.
#[derive(Default)]
pub(crate) struct Count(AtomicU64);

impl<M: Sync> Handler<M> for Count {
    async fn handle(&self, _message: &M, _attempt: &Attempt) -> Result<Outcome, HandlerError> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Ok(Outcome::empty())
    }
}

/// Inserts one row per message, in the record's transaction.
pub(crate) struct InsertRow(pub(crate) String);

impl<M: Delivery + Sync> TxHandler<M, PostgresStore> for InsertRow {
    async fn handle(
        &self,
        message: &M,
        tx: &mut PgTransaction,
        attempt: &Attempt,
    ) -> Result<Outcome, HandlerError> {
        insert_row(&mut **tx, &self.0, attempt.key().as_str(), message.payload())
            .await
            .map_err(HandlerError::retry)?;
        Ok(Outcome::empty())
    }
}

pub(crate) async fn insert_row<'e>(
    executor: impl sqlx::PgExecutor<'e>,
    table: &str,
    key: &str,
    payload: &[u8],
) -> Result<(), String> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {table} (key, payload) VALUES ($1, $2)"
    )))
    .bind(key)
    .bind(payload)
    .execute(executor)
    .await
    .map(|_| ())
    .map_err(|e| e.to_string())
}

/// What a consumer does with each message.
pub(crate) enum Work {
    /// Nothing but the ack.
    Ack,
    /// The guard on a store, around a handler that counts.
    Guard(Consumer<DynStore, Count>),
    /// Insert a row in its own transaction, then ack.
    Insert(sqlx::PgPool, String),
    /// Insert a row in the record's transaction.
    InTransaction(TxConsumer<PostgresStore, InsertRow>),
}

pub(crate) fn run(_window: Duration, rounds: usize, wanted: &[Pair]) -> Result<(), String> {
    let runtime = runtime()?;
    runtime.block_on(async {
        let plan = BatchPlan::new(BATCH, CONCURRENCY);
        // The worker's plan, and the whole concurrency as one batch at a time (as the workers
        // ran before their plan kept two batches in flight).
        let one_at_a_time = BatchPlan {
            size: CONCURRENCY,
            in_flight: 1,
        };
        println!(
            "\n## Consumers: messages/s consumed and acked, the guard deciding batches of up to {} ({} in flight) vs one batch of {CONCURRENCY} at a time vs each message alone vs no guard ({MESSAGES} messages per measurement)\n",
            plan.size, plan.in_flight
        );
        println!("| broker | store | batched msg/s | one batch at a time msg/s | per message msg/s | without msg/s | batched / without | one at a time / without | per message / without | batched / one at a time | batched / per message | batched min–max | one at a time min–max | per message min–max | without min–max |");
        println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        let (postgres, table, pairs) = pairs().await?;
        // Where the machine's time went, per measured broker, pair and variant.
        let mut cpu_rows = Vec::new();
        for (pair, with_work, without_work) in &pairs {
            if !wanted.contains(pair) {
                continue;
            }
            let store_name = pair.name();
            for broker in ["rabbitmq", "nats"] {
                let mut measured: [Vec<(f64, Usage)>; 4] = Default::default();
                for round in 0..rounds {
                    for (variant, (work, batches)) in [
                        (with_work, Some(plan)),
                        (with_work, Some(one_at_a_time)),
                        (with_work, None),
                        (without_work, None),
                    ]
                    .into_iter()
                    .enumerate()
                    {
                        vacuum(store_name, &postgres, &table).await?;
                        let tag = format!("{}-{round}-{}", std::process::id(), Key::generate());
                        measured[variant].push(match broker {
                            "rabbitmq" => rabbitmq(work, &tag, batches).await?,
                            _ => nats(work, &tag, batches).await?,
                        });
                    }
                }
                let [batched, one, single, without] =
                    crate::cpu::split(measured, &format!("{broker} | {store_name}"), VARIANTS, &mut cpu_rows);
                println!(
                    "| {broker} | {store_name} | {} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {} | {} | {} |",
                    per_second(batched.median),
                    per_second(one.median),
                    per_second(single.median),
                    per_second(without.median),
                    batched.median / without.median,
                    one.median / without.median,
                    single.median / without.median,
                    batched.median / one.median,
                    batched.median / single.median,
                    batched.spread(),
                    one.spread(),
                    single.spread(),
                    without.spread(),
                );
            }
        }
        crate::cpu::print_table(&["broker", "store", "variant"], &cpu_rows);
        drop_rows(&postgres, &table).await;
        Ok(())
    })
}

/// The variants of each row, in the order they are measured.
const VARIANTS: [&str; 4] = ["batched", "one batch at a time", "per message", "without"];

/// A pair of variants measured by `consumers` and `kafka` (`--pairs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Pair {
    /// The guard on Redis vs no guard.
    Redis,
    /// The guard on PostgreSQL vs no guard.
    Postgres,
    /// Same-transaction mode on PostgreSQL vs the insert in its own transaction.
    SameTransaction,
}

impl Pair {
    /// What the report's rows of this pair are named.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Redis => "redis",
            Self::Postgres => "postgres",
            Self::SameTransaction => "postgres, insert a row: same transaction vs own transaction",
        }
    }
}

/// The stores, the table rows are inserted into, and the three pairs measured: (which, with the
/// record, without it).
pub(crate) async fn pairs() -> Result<(PostgresStore, String, [(Pair, Work, Work); 3]), String> {
    let (redis, postgres) = stores().await?;
    let table = format!("idempotency_bench.consumer_rows_{}", std::process::id());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {table} (id bigserial PRIMARY KEY, key text NOT NULL, payload bytea NOT NULL)"
    )))
    .execute(postgres.pool())
    .await
    .map_err(|e| e.to_string())?;
    // A short retention: the records must not outlive the bench in the shared servers, where
    // a Redis keyspace full of them would slow every SCAN of the test suite.
    let guarded = |store: &DynStore| {
        Work::Guard(Consumer::new("bench", Arc::clone(store), Count::default()).retention(RETENTION))
    };
    let redis: DynStore = Arc::new(redis);
    let postgres_dyn: DynStore = Arc::new(postgres.clone());
    let pairs = [
        (Pair::Redis, guarded(&redis), Work::Ack),
        (Pair::Postgres, guarded(&postgres_dyn), Work::Ack),
        (
            Pair::SameTransaction,
            Work::InTransaction(
                TxConsumer::new("bench", postgres.clone(), InsertRow(table.clone())).retention(RETENTION),
            ),
            Work::Insert(postgres.pool().clone(), table.clone()),
        ),
    ];
    Ok((postgres, table, pairs))
}

/// Vacuums and analyzes the records table and the table rows are inserted into, as autovacuum
/// would between measurements: each measurement inserts and completes 20,000 records (a dead
/// row version each) and the previous ones' rows, and a server without autovacuum (the shared
/// one here runs without) would otherwise give each measurement a table more bloated than the
/// last, whatever the variant.
/// Does nothing for a pair of another store than PostgreSQL (`store_name`).
pub(crate) async fn vacuum(store_name: &str, postgres: &PostgresStore, table: &str) -> Result<(), String> {
    if !store_name.starts_with("postgres") {
        return Ok(());
    }
    for table in [postgres.table(), table.to_owned()] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("VACUUM ANALYZE {table}")))
            .execute(postgres.pool())
            .await
            .map_err(|e| format!("vacuum {table}: {e}"))?;
    }
    Ok(())
}

/// Drops the table rows were inserted into, and the records table of the run.
pub(crate) async fn drop_rows(postgres: &PostgresStore, table: &str) {
    let drop = format!(
        "DROP TABLE IF EXISTS {table}; DROP TABLE IF EXISTS {}",
        postgres.table()
    );
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
        .execute(postgres.pool())
        .await;
}

pub(crate) async fn stores() -> Result<(idempotency_redis::RedisStore, PostgresStore), String> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let redis = idempotency_redis::RedisStore::connect(&url)
        .await
        .and_then(|s| s.prefix(&format!("idem-consumer-bench:{}:", std::process::id())))
        .map_err(|e| format!("Redis at {url}: {e}"))?;
    let url =
        std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let options = idempotency_postgres::PostgresOptions::from_url(&url)
        .and_then(|o| o.schema("idempotency_bench"))
        .and_then(|o| o.table(&format!("consumers_{}", std::process::id())))
        .map_err(|e| e.to_string())?;
    let postgres = PostgresStore::connect_with(options)
        .await
        .map_err(|e| format!("PostgreSQL at {url}: {e}"))?;
    Ok((redis, postgres))
}

async fn rabbitmq(work: &Work, tag: &str, batches: Option<BatchPlan>) -> Result<(f64, Usage), String> {
    let url = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let connection = lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
        .await
        .map_err(|e| format!("RabbitMQ at {url}: {e}"))?;
    let channel = connection.create_channel().await.map_err(|e| e.to_string())?;
    let topology =
        idempotency_amqp::Topology::for_queue(&format!("idem-bench-{tag}")).expires(Duration::from_secs(600));
    topology.declare(&channel).await.map_err(|e| e.to_string())?;
    for i in 0..MESSAGES {
        let key = Key::new(format!("m-{tag}-{i}")).map_err(|e| e.to_string())?;
        idempotency_amqp::publish(&channel, "", &topology.queue, &key, b"{\"amount\":1000}")
            .await
            .map_err(|e| e.to_string())?;
    }
    channel
        .basic_qos(128, BasicQosOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let deliveries = channel
        .basic_consume(
            topology.queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| e.to_string())?;
    let cpu = crate::cpu::Snapshot::take();
    let started = Instant::now();
    if let Some(plan) = batches {
        drain_batches(deliveries, plan, |deliveries| {
            let (channel, topology) = (&channel, &topology);
            async move {
                let deliveries = deliveries
                    .into_iter()
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| e.to_string())?;
                let settled = match work {
                    Work::Guard(consumer) => {
                        idempotency_amqp::process_batch(consumer, channel, topology, deliveries).await
                    }
                    Work::InTransaction(consumer) => {
                        idempotency_amqp::process_batch(consumer, channel, topology, deliveries).await
                    }
                    Work::Ack | Work::Insert(..) => return Err(NOT_BATCHED.into()),
                };
                all_acked(settled)
            }
        })
        .await?;
    } else {
        drain(deliveries, |delivery| {
            let (channel, topology) = (&channel, &topology);
            async move {
                let delivery = delivery.map_err(|e| e.to_string())?;
                let ack = async |delivery: lapin::message::Delivery| {
                    delivery
                        .ack(BasicAckOptions::default())
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                };
                let settled = |done: Result<Disposition, idempotency_amqp::AdapterError>| {
                    expect_ack(done.map_err(|e| e.to_string())?)
                };
                match work {
                    Work::Ack => {
                        let _ = consumer_free_handle(&delivery.data);
                        ack(delivery).await
                    }
                    Work::Insert(pool, table) => {
                        let key = delivery
                            .properties
                            .message_id()
                            .as_ref()
                            .map_or("", |id| id.as_str());
                        insert_row(pool, table, key, &delivery.data).await?;
                        ack(delivery).await
                    }
                    Work::Guard(consumer) => {
                        settled(idempotency_amqp::process(consumer, channel, topology, delivery).await)
                    }
                    Work::InTransaction(consumer) => {
                        settled(idempotency_amqp::process(consumer, channel, topology, delivery).await)
                    }
                }
            }
        })
        .await?;
    }
    let rate = crate::measure::rate(MESSAGES as u64, started.elapsed());
    let usage = cpu.since(MESSAGES as u64);
    for queue in [&topology.queue, &topology.retry_queue, &topology.dead_queue] {
        let _ = channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    Ok((rate, usage))
}

/// Handles the first `MESSAGES` items of `stream`, `CONCURRENCY` at a time; the first error
/// fails the measurement.
async fn drain<T, F, Fut>(stream: impl futures_util::Stream<Item = T>, handle: F) -> Result<(), String>
where
    F: Fn(T) -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    let failure: std::sync::Mutex<Option<String>> = std::sync::Mutex::default();
    stream
        .take(MESSAGES)
        .for_each_concurrent(CONCURRENCY, |item| {
            let (handle, failure) = (&handle, &failure);
            async move {
                if let Err(error) = handle(item).await {
                    *failure.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(error);
                }
            }
        })
        .await;
    match failure
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
    {
        Some(error) => Err(error),
        None => Ok(()),
    }
}

/// Handles the first `MESSAGES` items of `stream` in batches of `plan` (each lingering
/// [`LINGER`]), as the RabbitMQ and JetStream workers do with theirs: at most [`CONCURRENCY`]
/// messages in process at once, as [`drain`]. The first error fails the measurement.
async fn drain_batches<T, F, Fut>(
    stream: impl futures_util::Stream<Item = T>,
    plan: BatchPlan,
    handle: F,
) -> Result<(), String>
where
    F: Fn(Vec<T>) -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    let failed = std::sync::Mutex::new(None);
    idempotency_consumer::adapter::batches(stream.take(MESSAGES), plan.size, LINGER)
        .for_each_concurrent(plan.in_flight, |batch| {
            let handled = handle(batch);
            let failed = &failed;
            async move {
                if let Err(error) = handled.await {
                    failed
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .get_or_insert(error);
                }
            }
        })
        .await;
    match failed
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
    {
        Some(error) => Err(error),
        None => Ok(()),
    }
}

/// What a batched measurement of a variant without the guard answers.
const NOT_BATCHED: &str = "only the guard decides batches";

/// Every message of a batch of fresh ones must be acked.
fn all_acked<E: std::fmt::Display>(settled: Vec<Result<Disposition, E>>) -> Result<(), String> {
    settled
        .into_iter()
        .try_for_each(|done| expect_ack(done.map_err(|e| e.to_string())?))
}

/// A fresh message must be acked (executed once); anything else means the bench is wrong.
fn expect_ack(disposition: Disposition) -> Result<(), String> {
    match disposition {
        Disposition::Ack => Ok(()),
        other => Err(format!("a fresh message was not acked: {other:?}")),
    }
}

/// What the unguarded consumer does per message: the same nothing the handler does.
pub(crate) fn consumer_free_handle(payload: &[u8]) -> usize {
    std::hint::black_box(payload.len())
}

async fn nats(work: &Work, tag: &str, batches: Option<BatchPlan>) -> Result<(f64, Usage), String> {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let client = async_nats::connect(&url)
        .await
        .map_err(|e| format!("NATS at {url}: {e}"))?;
    let js = jetstream::new(client);
    let id = tag.replace(['-', ':'], "");
    let (name, subject, dead) = (
        format!("IDEMBENCH_{id}"),
        format!("idembench.{id}.work"),
        format!("idembench.{id}.dead"),
    );
    let stream = js
        .create_stream(jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone(), dead.clone()],
            max_age: Duration::from_secs(600),
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    for i in 0..MESSAGES {
        let key = Key::new(format!("m-{tag}-{i}")).map_err(|e| e.to_string())?;
        idempotency_nats::publish(
            &js,
            subject.clone(),
            &key,
            bytes::Bytes::from_static(b"{\"amount\":1000}"),
        )
        .await
        .map_err(|e| e.to_string())?;
    }
    let puller: jetstream::consumer::PullConsumer = stream
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("bench".into()),
            filter_subject: subject.clone(),
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    let messages = puller.messages().await.map_err(|e| e.to_string())?;
    let cpu = crate::cpu::Snapshot::take();
    let started = Instant::now();
    if let Some(plan) = batches {
        drain_batches(messages, plan, |messages| {
            let (js, dead) = (&js, &dead);
            async move {
                let messages = messages
                    .into_iter()
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| e.to_string())?;
                let progress = Duration::from_secs(10);
                let settled = match work {
                    Work::Guard(consumer) => {
                        idempotency_nats::process_batch(consumer, js, dead, messages, progress).await
                    }
                    Work::InTransaction(consumer) => {
                        idempotency_nats::process_batch(consumer, js, dead, messages, progress).await
                    }
                    Work::Ack | Work::Insert(..) => return Err(NOT_BATCHED.into()),
                };
                all_acked(settled)
            }
        })
        .await?;
    } else {
        drain(messages, |message| {
            let (js, dead) = (&js, &dead);
            async move {
                let message = message.map_err(|e| e.to_string())?;
                let progress = Duration::from_secs(10);
                let settled = |done: Result<Disposition, idempotency_nats::AdapterError>| {
                    expect_ack(done.map_err(|e| e.to_string())?)
                };
                match work {
                    Work::Ack => {
                        let _ = consumer_free_handle(&message.payload);
                        message.double_ack().await.map_err(|e| e.to_string())
                    }
                    Work::Insert(pool, table) => {
                        let key = message
                            .headers
                            .as_ref()
                            .and_then(|h| h.get("Idempotency-Key"))
                            .map_or("", |v| v.as_str())
                            .to_owned();
                        insert_row(pool, table, &key, &message.payload).await?;
                        message.double_ack().await.map_err(|e| e.to_string())
                    }
                    Work::Guard(consumer) => {
                        settled(idempotency_nats::process(consumer, js, dead, message, progress).await)
                    }
                    Work::InTransaction(consumer) => {
                        settled(idempotency_nats::process(consumer, js, dead, message, progress).await)
                    }
                }
            }
        })
        .await?;
    }
    let rate = crate::measure::rate(MESSAGES as u64, started.elapsed());
    let usage = cpu.since(MESSAGES as u64);
    let _ = js.delete_stream(&name).await;
    Ok((rate, usage))
}
