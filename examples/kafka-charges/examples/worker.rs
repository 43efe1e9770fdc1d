//! The smallest Kafka worker: the README's snippet, kept compiling here.
//! `cargo run -p kafka-example --example worker` runs it against `KAFKA_BROKERS` (a real cluster
//! with a `payments` topic) and the store `STORE_URL` names.

use std::sync::Arc;

use idempotency::kafka::{KafkaMessage, Worker};
use idempotency::{Attempt, Outcome};
use idempotency_consumer::{Consumer, Handler, HandlerError};
use rdkafka::ClientConfig;

struct Charge;

impl Handler<KafkaMessage> for Charge {
    async fn handle(&self, _message: &KafkaMessage, attempt: &Attempt) -> Result<Outcome, HandlerError> {
        // Charge the card here, passing attempt.key() on to the provider.
        Ok(Outcome::new(format!("charged {}", attempt.key())))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store_url = std::env::var("STORE_URL").unwrap_or_else(|_| "sqlite://charges.db".into());
    let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let store = idempotency::open(&store_url).await?;
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", brokers)
        .set("group.id", "charges");
    let consumer = Consumer::new("charges", store, Charge);
    let worker = Worker::new(config, "payments", Arc::new(consumer));
    // Ctrl-C: stop taking messages, let running handlers settle, commit, leave the group.
    worker
        .run_until(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
