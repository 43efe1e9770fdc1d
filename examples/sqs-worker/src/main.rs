//! The README's SQS worker: charges from a queue, recorded in DynamoDB.

use std::sync::Arc;

use idempotency::sqs::{Consumer, DeadLetters, Handler, HandlerError, Producer, SqsMessage, Worker};
use idempotency::{Attempt, Key, Outcome};

struct Charge;

impl Handler<SqsMessage> for Charge {
    async fn handle(&self, _message: &SqsMessage, attempt: &Attempt) -> Result<Outcome, HandlerError> {
        // Charge the card here, passing attempt.key() on to the provider.
        Ok(Outcome::new(format!("charged {}", attempt.key())))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let client = idempotency::sqs::client(None, None).await; // the usual AWS environment
    let queue = std::env::var("QUEUE_URL")?;
    let dead = std::env::var("DEAD_LETTER_QUEUE_URL")?;
    // The producer sets Idempotency-Key (and, on FIFO queues, MessageDeduplicationId).
    Producer::new(client.clone(), &queue)
        .send(&Key::new("charge-42")?, r#"{"amount":1000}"#)
        .await?;
    let store = idempotency::open("dynamodb://charges?region=eu-west-1").await?;
    let worker = Worker::new(
        client,
        queue,
        DeadLetters::Queue(dead),
        Arc::new(Consumer::new("charges", store, Charge)),
    )
    .visibility_timeout(std::time::Duration::from_secs(60));
    // Ctrl-C: stop receiving, let running handlers settle, flush the deletes.
    worker
        .run_until(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
