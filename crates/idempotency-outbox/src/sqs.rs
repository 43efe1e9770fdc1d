//! The relay's SQS publisher: the key as the `Idempotency-Key` message attribute and, on a FIFO
//! queue, the deduplication id; the ordering group as the message group.

use idempotency_consumer::BoxError;
use idempotency_sqs::aws_sdk_sqs::Client;

use crate::{OutboxMessage, Publisher};

/// Sends outbox messages to SQS, the destination as the queue URL, and returns once
/// `SendMessage` was answered. The headers go as string attributes (SQS takes ten in all, the
/// key's included: a row with more fails); the body must be UTF-8 text.
#[derive(derive_more::Debug)]
pub struct SqsPublisher {
    #[debug(skip)]
    client: Client,
}

impl SqsPublisher {
    /// A publisher on `client`.
    #[must_use]
    pub fn new(client: Client) -> Self {
        Self { client }
    }
}

impl Publisher for SqsPublisher {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), BoxError> {
        let body = String::from_utf8(message.payload.clone())
            .map_err(|_| "an SQS message body is text, and this payload is not UTF-8")?;
        let attributes: Vec<(String, String)> = message
            .headers
            .iter()
            .map(|(name, value)| (name.clone(), String::from_utf8_lossy(value).into_owned()))
            .collect();
        let group = if message.ordering_key.is_empty() {
            "outbox"
        } else {
            message.ordering_key.as_str()
        };
        idempotency_sqs::Producer::new(self.client.clone(), message.destination.clone())
            .send_with_attributes(&message.key, group, body, &attributes)
            .await?;
        Ok(())
    }

    /// SQS answers a request (a `ListQueues` of one queue: any queue URL a row names is on
    /// the same endpoint).
    async fn reachable(&self) -> Result<(), BoxError> {
        self.client.list_queues().max_results(1).send().await?;
        Ok(())
    }
}
