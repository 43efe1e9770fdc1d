//! Charges from a Kafka topic, once each, whatever the producer and the group do.
//!
//! [`run`] publishes `payments` charge events, **each twice** (as a producer that retries a
//! send whose acknowledgement it never saw), to a topic of 8 partitions; two workers of one
//! consumer group charge them, and a third joins half-way, so the group rebalances under load.
//! Every charge goes through the idempotency record: the copy, and any message a rebalance
//! hands to another member, is answered from the record instead of charging again.
//!
//! With `KAFKA_BROKERS` unset, the brokers are librdkafka's in-process cluster (nothing to
//! install); set it (`KAFKA_BROKERS=127.0.0.1:9092`) to run against a real cluster, where the
//! topic must exist with its partitions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotency::kafka::{KafkaMessage, Worker, idempotent_producer, publish};
use idempotency::{Attempt, DynStore, Key, Outcome};
use idempotency_consumer::{Consumer, Delivery, Handler, HandlerError};
use rdkafka::ClientConfig;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;

/// The topic's partitions (on the in-process cluster).
pub const PARTITIONS: i32 = 8;

/// What a run saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    /// Distinct payments published.
    pub payments: usize,
    /// Messages published (every payment twice).
    pub published: usize,
    /// Card charges made, by payment.
    pub charges: HashMap<String, u32>,
    /// How long until every payment was charged.
    pub elapsed: Duration,
}

/// Charges the card named in the payload, once per call: the side effect to keep single.
#[derive(Default)]
struct Card {
    charges: Mutex<HashMap<String, u32>>,
}

impl Handler<KafkaMessage> for Card {
    async fn handle(&self, message: &KafkaMessage, attempt: &Attempt) -> Result<Outcome, HandlerError> {
        // A real handler calls the payment provider here, passing the key on.
        *self
            .charges
            .lock()
            .map_err(|_| HandlerError::retry("the ledger lock is poisoned"))?
            .entry(attempt.key().as_str().to_owned())
            .or_default() += 1;
        Ok(Outcome::new(message.payload().to_vec()))
    }
}

/// Publishes `payments` payments twice each and charges them with a group of workers on
/// `store`; returns once every payment is charged (the workers then settle, commit and leave).
///
/// # Errors
///
/// A message for whatever failed: the cluster, a produce, a worker.
pub async fn run(store: DynStore, payments: usize) -> Result<Summary, String> {
    // Kept alive for the whole run when it is the in-process one.
    let mut local = None;
    let brokers = match std::env::var("KAFKA_BROKERS") {
        Ok(brokers) => brokers,
        Err(_) => {
            let cluster: MockCluster<'static, DefaultProducerContext> =
                MockCluster::new(1).map_err(|e| format!("the in-process Kafka cluster: {e}"))?;
            for (topic, partitions) in [("payments", PARTITIONS), ("payments.dead", 1)] {
                cluster
                    .create_topic(topic, partitions, 1)
                    .map_err(|e| format!("creating {topic}: {e}"))?;
            }
            let brokers = cluster.bootstrap_servers();
            local = Some(cluster);
            brokers
        }
    };
    let started = Instant::now();
    let producer = idempotent_producer(&brokers).map_err(|e| e.to_string())?;
    let card = Arc::new(Card::default());
    let processor = Arc::new(Consumer::new("kafka-charges", store, Arc::clone(&card)));
    let member = |name: &str| {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &brokers)
            .set("group.id", "kafka-charges")
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500");
        let worker = Worker::new(config, "payments", Arc::clone(&processor)).name(name);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn(async move { worker.run_until(async { drop(stopped.await) }).await });
        (stop, running)
    };
    let mut members = vec![member("charges-1"), member("charges-2")];
    // Keys of this run: a store kept from an earlier run already holds that run's payments.
    let run = Key::generate();
    let keys: Vec<Key> = (0..payments)
        .map(|n| Key::new(format!("payment-{run}-{n}")).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    for (half, keys) in keys.chunks(payments.div_ceil(2).max(1)).enumerate() {
        if half == 1 {
            // A member joins while the first half is being charged.
            members.push(member("charges-3"));
        }
        // Every payment twice: the producer retried a send whose acknowledgement was lost.
        let sends = keys.iter().flat_map(|key| {
            let payload = format!("{{\"payment\":\"{key}\",\"amount\":1000}}");
            [payload.clone(), payload].map(|payload| {
                let producer = &producer;
                async move {
                    publish(
                        producer,
                        "payments",
                        key,
                        Some(key.as_str().as_bytes()),
                        payload.as_bytes(),
                    )
                    .await
                }
            })
        });
        for sent in futures_util::future::join_all(sends).await {
            sent.map_err(|e| e.to_string())?;
        }
    }
    loop {
        let charged = card
            .charges
            .lock()
            .map_err(|_| "the ledger lock is poisoned")?
            .len();
        if charged >= payments {
            break;
        }
        if started.elapsed() > Duration::from_secs(300) {
            return Err(format!(
                "only {charged} of {payments} payments were charged in 5 minutes"
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let elapsed = started.elapsed();
    for (stop, running) in members {
        let _ = stop.send(());
        running
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
    }
    drop(local);
    let charges = card
        .charges
        .lock()
        .map_err(|_| "the ledger lock is poisoned")?
        .clone();
    Ok(Summary {
        payments,
        published: payments * 2,
        charges,
        elapsed,
    })
}
