//! Kafka: messages per second consumed and committed by the same `idempotency_kafka::Worker`
//! with the guard deciding each partition's messages in batches (the worker's default), with the
//! guard deciding each message alone (`batch(1)`), and without the guard, on librdkafka's
//! in-process cluster (`MockCluster`), in the same run, with the Redis and PostgreSQL stores, and
//! the same-transaction mode against a bare transaction. The pairs are those of the RabbitMQ and
//! NATS figures (`consumers.rs`).
//!
//! Each measurement publishes `MESSAGES` (100,000) events with distinct keys to a topic of its own with 8
//! or 32 partitions (not timed), then times one worker from its first message to its last: every
//! partition at once, each in order, offsets committed in batches. "Without" is the same worker
//! whose processor acks (or inserts its row and acks) with no record. The PostgreSQL tables are
//! vacuumed and analyzed before each measurement (not timed), as in `consumers.rs`. `--prefetch N` sets every
//! variant's `Worker::prefetch` (how many fetched messages a partition queues before its fetching
//! is paused); without it the worker's default.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use idempotency_consumer::{Decisions, Delivery, Disposition, Processor, process_each};
use idempotency_core::Key;
use idempotency_kafka::{KafkaMessage, Worker, idempotent_producer, publish};
use rdkafka::ClientConfig;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::FutureProducer;

use crate::consumers::{Pair, Work, consumer_free_handle, drop_rows, insert_row, pairs, vacuum};
use crate::cpu::Usage;
use crate::measure::per_second;
use crate::measure::runtime;

/// Messages per measurement: five times the other consumers' count, since a batched worker
/// drains 20,000 in about the time its partitions take to start, which would then be most of
/// what is measured.
const MESSAGES: usize = 100_000;

/// The topics' partition counts measured: the worker processes a partition's messages in
/// order, so partitions are its concurrency.
const PARTITIONS: [i32; 2] = [8, 32];

/// A processor doing `work`, timing its first and last message.
struct Measured {
    work: Arc<Work>,
    done: AtomicU64,
    first: OnceLock<Instant>,
    last: Mutex<Option<Instant>>,
}

impl Processor<KafkaMessage> for Measured {
    async fn process(&self, message: &KafkaMessage) -> Disposition {
        self.first.get_or_init(Instant::now);
        let disposition = match &*self.work {
            Work::Ack => {
                let _ = consumer_free_handle(message.payload());
                Disposition::Ack
            }
            Work::Insert(pool, table) => {
                let key = message.header("Idempotency-Key").unwrap_or_default();
                match insert_row(pool, table, &String::from_utf8_lossy(key), message.payload()).await {
                    Ok(()) => Disposition::Ack,
                    Err(_) => Disposition::Nack {
                        after: Duration::from_millis(100),
                    },
                }
            }
            Work::Guard(consumer) => consumer.process(message).await,
            Work::InTransaction(consumer) => consumer.process(message).await,
        };
        self.finished(1);
        disposition
    }

    async fn process_many(&self, messages: &[&KafkaMessage], decided: &Decisions) {
        self.first.get_or_init(Instant::now);
        let before = decided.count();
        match &*self.work {
            Work::Guard(consumer) => consumer.process_many(messages, decided).await,
            Work::InTransaction(consumer) => consumer.process_many(messages, decided).await,
            // The others decide each message alone, as `process`.
            Work::Ack | Work::Insert(..) => return process_each(self, messages, decided).await,
        }
        self.finished(decided.count() - before);
    }
}

impl Measured {
    /// `count` more messages decided, the last just now.
    fn finished(&self, count: usize) {
        *self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Instant::now());
        self.done.fetch_add(count as u64, Ordering::SeqCst);
    }
}

/// Publishes one event per key to `topic`, all at once, each with its key as the record key.
pub(crate) async fn publish_all(producer: &FutureProducer, topic: &str, keys: &[Key]) -> Result<(), String> {
    let sent = futures_util::future::join_all(keys.iter().map(|key| {
        publish(
            producer,
            topic,
            key,
            Some(key.as_str().as_bytes()),
            b"{\"amount\":1000}",
        )
    }))
    .await;
    sent.into_iter()
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("publishing to {topic}: {e}"))?;
    Ok(())
}

pub(crate) fn run(rounds: usize, prefetch: Option<usize>, wanted: &[Pair]) -> Result<(), String> {
    let runtime = runtime()?;
    runtime.block_on(async {
        let queued = prefetch.map_or_else(|| "the worker's default prefetch".to_owned(), |n| format!("prefetch {n}"));
        println!(
            "\n## Kafka (librdkafka's MockCluster): messages/s consumed and committed by one worker, the guard deciding batches vs each message alone vs no guard ({MESSAGES} messages per measurement, {queued})\n"
        );
        println!(
            "| store | partitions | batched msg/s | per message msg/s | batched / per message | without msg/s | batched / without | per message / without | batched min–max | per message min–max |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        let cluster = MockCluster::new(1).map_err(|e| e.to_string())?;
        let producer = idempotent_producer(&cluster.bootstrap_servers()).map_err(|e| e.to_string())?;
        let (postgres, table, pairs) = pairs().await?;
        // Where the machine's time went (the brokers run inside the bench), per measured pair,
        // partitions and variant.
        let mut cpu_rows = Vec::new();
        for (pair, with_work, without_work) in pairs {
            if !wanted.contains(&pair) {
                continue;
            }
            let store_name = pair.name();
            let (with_work, without_work) = (Arc::new(with_work), Arc::new(without_work));
            for partitions in PARTITIONS {
                let mut measured: [Vec<(f64, Usage)>; 3] = Default::default();
                for round in 0..rounds {
                    for (variant, (work, batch)) in [
                        (&with_work, idempotency_kafka::DEFAULT_BATCH),
                        (&with_work, 1),
                        (&without_work, idempotency_kafka::DEFAULT_BATCH),
                    ]
                    .into_iter()
                    .enumerate()
                    {
                        vacuum(store_name, &postgres, &table).await?;
                        let tag = format!("{}-{round}-{}", std::process::id(), Key::generate());
                        measured[variant]
                            .push(measure(&cluster, &producer, work, &tag, partitions, batch, prefetch).await?);
                    }
                }
                let [batched, single, without] = crate::cpu::split(
                    measured,
                    &format!("{store_name} | {partitions}"),
                    ["batched", "per message", "without"],
                    &mut cpu_rows,
                );
                println!(
                    "| {store_name} | {partitions} | {} | {} | {:.2} | {} | {:.2} | {:.2} | {} | {} |",
                    per_second(batched.median),
                    per_second(single.median),
                    batched.median / single.median,
                    per_second(without.median),
                    batched.median / without.median,
                    single.median / without.median,
                    batched.spread(),
                    single.spread(),
                );
            }
        }
        crate::cpu::print_table(&["store", "partitions", "variant"], &cpu_rows);
        drop_rows(&postgres, &table).await;
        Ok(())
    })
}

/// Publishes the events to a new topic, then times a worker draining it.
async fn measure(
    cluster: &MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
    producer: &FutureProducer,
    work: &Arc<Work>,
    tag: &str,
    partitions: i32,
    batch: usize,
    prefetch: Option<usize>,
) -> Result<(f64, Usage), String> {
    let topic = format!("bench-{tag}");
    cluster
        .create_topic(&topic, partitions, 1)
        .map_err(|e| e.to_string())?;
    let keys = (0..MESSAGES)
        .map(|i| Key::new(format!("m-{tag}-{i}")).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    publish_all(producer, &topic, &keys).await?;
    let measured = Arc::new(Measured {
        work: Arc::clone(work),
        done: AtomicU64::new(0),
        first: OnceLock::new(),
        last: Mutex::new(None),
    });
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", cluster.bootstrap_servers())
        .set("group.id", tag);
    let worker = Worker::new(config, topic, Arc::clone(&measured))
        .concurrency(partitions.unsigned_abs() as usize)
        .batch(batch);
    let worker = match prefetch {
        Some(messages) => worker.prefetch(messages),
        None => worker,
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move { worker.run_until(async { drop(stopped.await) }).await });
    let started = Instant::now();
    // From the first message handled (not the worker's start: joining the group takes
    // seconds of idle machine), as the rate is.
    let mut cpu = None;
    while measured.done.load(Ordering::SeqCst) < MESSAGES as u64 {
        if cpu.is_none() && measured.first.get().is_some() {
            cpu = Some((measured.done.load(Ordering::SeqCst), crate::cpu::Snapshot::take()));
        }
        if started.elapsed() > Duration::from_secs(600) {
            return Err(format!(
                "the Kafka worker did not drain {MESSAGES} messages in 10 minutes"
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Seen at the latest by the poll after the first message: all of them handled within one
    // 10 ms poll would leave nothing to measure.
    let (done, cpu) = cpu.ok_or("the worker drained the topic before the CPU time could be read")?;
    let usage = cpu.since(MESSAGES as u64 - done);
    let _ = stop.send(());
    running
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    let first = *measured.first.get().ok_or("no message was processed")?;
    let last = measured
        .last
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .ok_or("no message was processed")?;
    Ok((crate::measure::rate(MESSAGES as u64 - 1, last - first), usage))
}
