//! Sending messages that consumers can deduplicate.

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::MessageAttributeValue;
use idempotency_consumer::IDEMPOTENCY_KEY_HEADER;
use idempotency_core::Key;
use sha2::{Digest, Sha256};

use idempotency_consumer::adapter::AdapterErrorKind;

use crate::{AdapterError, config, sdk};

/// The longest `MessageDeduplicationId` SQS accepts.
const DEDUP_ID_MAX: usize = 128;

/// The message attributes SQS carries at most.
const MAX_ATTRIBUTES: usize = 10;

/// Sends messages to one queue with their idempotency key: as the `Idempotency-Key` message
/// attribute (which the consumer's record is keyed by) and, on a FIFO queue, as the
/// `MessageDeduplicationId`, so that SQS drops a retried send within its five-minute window.
/// That window does not replace the consumer's record: see the [crate docs](crate#fifo-queues).
///
/// Keys are visible ASCII, which SQS accepts in a deduplication id; a key longer than 128
/// characters is sent as `sha256:` and the hex digest of the key.
///
/// ```no_run
/// # async fn example(client: aws_sdk_sqs::Client) -> Result<(), Box<dyn std::error::Error>> {
/// use idempotency_core::Key;
/// use idempotency_sqs::Producer;
///
/// let payments = Producer::new(client, "https://sqs.eu-west-1.amazonaws.com/123456789012/payments.fifo");
/// let key = Key::new("charge-7f3a")?;
/// // Retrying this send with the same key is safe: SQS drops the copy within five minutes,
/// // and the consumer's record answers any copy that gets through.
/// payments.send_in_group(&key, "customer-42", r#"{"amount":1000}"#).await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, derive_more::Debug)]
pub struct Producer {
    #[debug(skip)]
    client: Client,
    queue_url: String,
    fifo: bool,
}

impl Producer {
    /// A producer for the queue at `queue_url` (a FIFO queue when the URL ends in `.fifo`).
    pub fn new(client: Client, queue_url: impl Into<String>) -> Self {
        let queue_url = queue_url.into();
        let fifo = queue_url.trim_end_matches('/').ends_with(".fifo");
        Self {
            client,
            queue_url,
            fifo,
        }
    }

    /// Sends `body` with `key` to a standard queue; returns SQS's `MessageId`.
    ///
    /// # Errors
    ///
    /// [`AdapterErrorKind::Config`] on a FIFO queue (it needs a group: use
    /// [`send_in_group`](Self::send_in_group)); the service's error otherwise.
    pub async fn send(&self, key: &Key, body: impl Into<String>) -> Result<String, AdapterError> {
        if self.fifo {
            return Err(config(format!(
                "{} is a FIFO queue: send with a message group (send_in_group)",
                self.queue_url
            )));
        }
        self.send_message(key, None, body.into(), &[]).await
    }

    /// Sends `body` with `key` in message group `group` (FIFO queues keep a group's order);
    /// on a standard queue the group is ignored. Returns SQS's `MessageId`.
    ///
    /// # Errors
    ///
    /// The service's error (an empty or over-long group is refused by SQS).
    pub async fn send_in_group(
        &self,
        key: &Key,
        group: &str,
        body: impl Into<String>,
    ) -> Result<String, AdapterError> {
        self.send_message(key, Some(group), body.into(), &[]).await
    }

    /// [`send_in_group`](Self::send_in_group) with message attributes (text) besides the
    /// `Idempotency-Key`; SQS takes ten in all, so the key and the first nine are sent and the
    /// rest refused with an error naming them, rather than dropped.
    ///
    /// # Errors
    ///
    /// [`AdapterErrorKind::Config`] for more than nine attributes or an attribute SQS cannot
    /// carry; the service's error otherwise.
    pub async fn send_with_attributes(
        &self,
        key: &Key,
        group: &str,
        body: impl Into<String>,
        attributes: &[(String, String)],
    ) -> Result<String, AdapterError> {
        if attributes.len() > MAX_ATTRIBUTES - 1 {
            let names: Vec<&str> = attributes.iter().map(|(name, _)| name.as_str()).collect();
            return Err(config(format!(
                "SQS carries ten message attributes, the Idempotency-Key among them; this message has {} more: {}",
                attributes.len(),
                names.join(", ")
            )));
        }
        self.send_message(key, Some(group), body.into(), attributes).await
    }

    async fn send_message(
        &self,
        key: &Key,
        group: Option<&str>,
        body: String,
        attributes: &[(String, String)],
    ) -> Result<String, AdapterError> {
        let attribute = MessageAttributeValue::builder()
            .data_type("String")
            .string_value(key.as_str())
            .build()
            .map_err(|e| config(e.to_string()))?;
        let mut send = self
            .client
            .send_message()
            .queue_url(&self.queue_url)
            .message_body(body)
            .message_attributes(IDEMPOTENCY_KEY_HEADER, attribute);
        for (name, value) in attributes {
            let value = MessageAttributeValue::builder()
                .data_type("String")
                .string_value(value)
                .build()
                .map_err(|e| config(format!("the message attribute {name}: {e}")))?;
            send = send.message_attributes(name, value);
        }
        if self.fifo {
            send = send
                .message_group_id(group.unwrap_or_default())
                .message_deduplication_id(deduplication_id(key));
        }
        let sent = send
            .send()
            .await
            .map_err(|e| sdk(AdapterErrorKind::Publish, "send a message", &e))?;
        Ok(sent.message_id().unwrap_or_default().to_owned())
    }
}

/// The `MessageDeduplicationId` for `key`: the key itself, or `sha256:<hex>` when it is longer
/// than SQS allows.
#[must_use]
pub(crate) fn deduplication_id(key: &Key) -> String {
    if key.as_str().len() <= DEDUP_ID_MAX {
        return key.as_str().to_owned();
    }
    let digest = Sha256::digest(key.as_str().as_bytes());
    let mut id = String::with_capacity(71);
    id.push_str("sha256:");
    for byte in digest {
        id.push_str(&format!("{byte:02x}"));
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_keys_are_their_own_dedup_id_and_long_ones_are_hashed() {
        let key = Key::new("charge-7f3a:{retry}").unwrap();
        assert_eq!(deduplication_id(&key), "charge-7f3a:{retry}");
        let exact = Key::new("k".repeat(128)).unwrap();
        assert_eq!(deduplication_id(&exact), "k".repeat(128));
        let long = Key::new("k".repeat(129)).unwrap();
        let id = deduplication_id(&long);
        assert!(id.starts_with("sha256:"), "{id}");
        assert_eq!(id.len(), 71);
        assert_ne!(id, deduplication_id(&Key::new("k".repeat(130)).unwrap()));
    }
}
