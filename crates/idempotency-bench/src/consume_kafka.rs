//! `idem consume` from Kafka at several `--prefetch` settings: messages per second from a topic
//! of librdkafka's in-process cluster (`MockCluster`, which listens on loopback like a real
//! broker) to the HTTP handler of `consume.rs`, `idem consume` as a process of its own on the
//! memory store, the settings alternating in one run.
//!
//! On Kafka, `--prefetch` is how many fetched messages a partition queues before its fetching
//! is paused (docs/CONSUMERS.md, "Prefetch and pauses"), and a batch is at most the prefetch:
//! the figures show what the default (16) costs against larger ones. Each measurement publishes
//! `MESSAGES` messages with distinct keys to a topic of its own with `PARTITIONS` partitions
//! (not timed), starts `idem consume`, and times the handler's calls from the first to the last.

use std::sync::Arc;

use idempotency_core::Key;
use idempotency_kafka::idempotent_producer;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::FutureProducer;

use crate::consume::{Calls, drained_all, idem_consume, print_rates, start_handler};
use crate::kafka::publish_all;
use crate::measure::runtime;

/// Messages per measurement.
const MESSAGES: u64 = 20_000;

/// The topics' partitions: `idem consume` processes them at once, each in order.
const PARTITIONS: i32 = 8;

/// The `--prefetch` settings measured; the first is `idem consume`'s default.
const PREFETCH: [u16; 3] = [16, 256, 4096];

/// A fresh topic (and its dead-letter topic) holding `MESSAGES` messages with distinct keys.
async fn filled_topic(
    cluster: &MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
    producer: &FutureProducer,
    round: usize,
    variant: usize,
) -> Result<String, String> {
    let topic = format!("idem-bench-consume-{round}-{variant}");
    for (name, partitions) in [(topic.clone(), PARTITIONS), (format!("{topic}.dead"), 1)] {
        cluster
            .create_topic(&name, partitions, 1)
            .map_err(|e| format!("topic {name}: {e}"))?;
    }
    let keys: Vec<Key> = (0..MESSAGES)
        .map(|i| Key::new(format!("bench-{round}-{variant}-{i}")))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    publish_all(producer, &topic, &keys).await?;
    Ok(topic)
}

pub(crate) fn run(rounds: usize) -> Result<(), String> {
    runtime()?.block_on(run_async(rounds))
}

async fn run_async(rounds: usize) -> Result<(), String> {
    let calls = Arc::new(Calls::default());
    let handler = start_handler(Arc::clone(&calls)).await?;
    let cluster = MockCluster::new(1).map_err(|e| e.to_string())?;
    let bootstrap = cluster.bootstrap_servers();
    let producer = idempotent_producer(&bootstrap).map_err(|e| e.to_string())?;
    let mut rates = vec![Vec::new(); PREFETCH.len()];
    for round in 0..rounds {
        for (variant, (prefetch, samples)) in PREFETCH.iter().zip(rates.iter_mut()).enumerate() {
            let topic = filled_topic(&cluster, &producer, round, variant).await?;
            calls.reset();
            let from = format!("kafka://{bootstrap}?topic={topic}&group={topic}");
            let _consume = idem_consume(&from, handler, "memory://", *prefetch)?;
            drained_all(&calls, MESSAGES).await?;
            samples.push(calls.rate());
        }
    }
    println!(
        "\n## idem consume from Kafka (librdkafka's MockCluster, {PARTITIONS} partitions) to an HTTP handler, memory store, by --prefetch: {MESSAGES} messages, {rounds} alternating rounds, medians\n"
    );
    print_rates(("--prefetch", "default (16)"), &PREFETCH, rates, 0);
    Ok(())
}
