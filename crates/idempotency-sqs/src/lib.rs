//! Idempotent Amazon SQS consumers, on the broker-neutral rules of `idempotency-consumer`.
//!
//! SQS delivers at least once. A standard queue may deliver a message twice outright; any queue
//! delivers it again when its handler outlives the **visibility timeout**, possibly to a second
//! consumer while the first is still running: the failure that makes SQS users charge twice.
//! [`Worker`] runs a [`Processor`] (an [`idempotency_consumer::Consumer`]) on every message and
//! carries out its decision:
//!
//! | the consumer decides | the worker does |
//! |---|---|
//! | `Ack` (the outcome is recorded, now or by an earlier delivery) | delete the message (batched `DeleteMessageBatch`) — **only after** the record is durable |
//! | `Nack { after }` (handler `Retry`, in flight elsewhere, store unreachable) | `ChangeMessageVisibility` to `after`: the message comes back then; nothing is deleted |
//! | `DeadLetter { reason }` (reused key, no key, `Fatal`, past the delivery limit) | send a copy with the reason attributes to the dead-letter queue, then delete the original; or, with [`DeadLetters::RedrivePolicy`], leave it to the queue's redrive policy |
//!
//! While a handler runs, the worker extends its message's visibility (`ChangeMessageVisibility`)
//! every third of the visibility timeout, so a long handler keeps its message to itself; the
//! extensions stop when the handler ends, and a failed one is logged and counted.
//!
//! # Keys
//!
//! The key comes from the `Idempotency-Key` message attribute by default (what the HTTP edge
//! propagates, and what [`Producer`] sets), or from the producer's `MessageDeduplicationId`
//! ([`KeySource::MessageId`] reads it on FIFO
//! queues), or from a function of the message. **Never** SQS's `MessageId` or the receipt
//! handle: a message sent twice gets two `MessageId`s, and every receive gets a new receipt
//! handle, so neither identifies the operation.
//!
//! # FIFO queues
//!
//! Messages of one message group are handled in order, one at a time; groups run concurrently.
//! When a message of a group is not acknowledged, the rest of that group's batch is returned
//! with it, so the group resumes in order. SQS's own deduplication of FIFO sends lasts five
//! minutes and covers only sends: a producer retrying after six minutes, a replayed dead-letter
//! queue, or a handler outliving its visibility all get past it. It keeps duplicate *sends* out of
//! the queue; the consumer's record keeps duplicate *effects* out of the world.
//!
//! # Delivery counts
//!
//! The delivery count is SQS's `ApproximateReceiveCount`, so backoff and the delivery limit hold
//! across consumer restarts. It is approximate: SQS may count a receive whose answer was lost.
//!
//! # What was verified only against moto
//!
//! The tests run against moto's server. moto's FIFO deduplication only covers messages still in
//! the queue, it accepts old receipt handles, and it keeps visibility in whole seconds; the
//! tests rely on none of these. The redrive-policy mode, KMS-encrypted queues and SQS's
//! throttling were not exercised.

mod dead_letters;
mod producer;
mod source;
mod worker;

use std::fmt;
use std::sync::Arc;

use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_sqs::types::{Message, MessageSystemAttributeName};
use idempotency_consumer::Delivery;
pub use idempotency_consumer::adapter::{AdapterError, AdapterErrorKind};

/// The SQS client this crate is built on, at the version this crate uses.
pub use aws_sdk_sqs;
pub use idempotency_consumer::{
    Consumer, DEAD_LETTER_REASON_HEADER, Disposition, Handler, HandlerError, IDEMPOTENCY_KEY_HEADER,
    KeySource, Processor,
};
pub use producer::Producer;
pub use source::{SOURCE, SqsSource};
pub use worker::{DeadLetters, Worker};

/// A received SQS message as a [`Delivery`]: message attributes as headers, the body as the
/// payload, `MessageDeduplicationId` as the message id, and `ApproximateReceiveCount` as the
/// delivery count.
#[derive(Debug, Clone)]
pub struct SqsMessage {
    message: Message,
    receive_count: u32,
}

impl SqsMessage {
    /// Wraps a message received with its system attributes (the [`Worker`] asks for them).
    #[must_use]
    pub fn new(message: Message) -> Self {
        let receive_count = system_attribute(&message, &MessageSystemAttributeName::ApproximateReceiveCount)
            .and_then(|count| count.parse::<u32>().ok())
            .unwrap_or(1)
            .max(1);
        Self {
            message,
            receive_count,
        }
    }

    /// The message as the SDK returned it.
    #[must_use]
    pub fn message(&self) -> &Message {
        &self.message
    }

    /// SQS's `MessageId`: new for every send, so never a key; useful in logs.
    #[must_use]
    pub fn sqs_message_id(&self) -> &str {
        self.message.message_id().unwrap_or_default()
    }

    /// The receipt handle of this receive (a new one every receive).
    #[must_use]
    pub fn receipt_handle(&self) -> &str {
        self.message.receipt_handle().unwrap_or_default()
    }

    /// The message group (FIFO queues).
    #[must_use]
    pub fn group_id(&self) -> Option<&str> {
        system_attribute(&self.message, &MessageSystemAttributeName::MessageGroupId)
    }
}

fn system_attribute<'m>(message: &'m Message, name: &MessageSystemAttributeName) -> Option<&'m str> {
    message
        .attributes()
        .and_then(|attributes| attributes.get(name))
        .map(String::as_str)
}

impl Delivery for SqsMessage {
    /// A message attribute's value: a `String` or `Number` attribute's text, a `Binary`
    /// attribute's bytes.
    fn header(&self, name: &str) -> Option<&[u8]> {
        let value = self.message.message_attributes()?.get(name)?;
        value
            .string_value()
            .map(str::as_bytes)
            .or_else(|| value.binary_value().map(AsRef::as_ref))
    }

    /// The producer's `MessageDeduplicationId` (FIFO queues); without one, SQS's `MessageId`,
    /// which every delivery of one message carries (SQS delivers at least once, and again after
    /// a visibility timeout), but which a producer's second send of the same operation does not
    /// share: keying by it makes SQS's own duplicates harmless, not a producer's retries.
    fn message_id(&self) -> Option<&str> {
        system_attribute(&self.message, &MessageSystemAttributeName::MessageDeduplicationId)
            .or_else(|| self.message.message_id())
    }

    fn payload(&self) -> &[u8] {
        self.message.body().unwrap_or_default().as_bytes()
    }

    fn delivery_count(&self) -> u32 {
        self.receive_count
    }

    fn headers(&self) -> Vec<(String, Vec<u8>)> {
        let Some(attributes) = self.message.message_attributes() else {
            return Vec::new();
        };
        let mut headers: Vec<(String, Vec<u8>)> = attributes
            .keys()
            .filter_map(|name| Some((name.clone(), self.header(name)?.to_vec())))
            .collect();
        headers.sort();
        headers
    }
}

/// What went wrong talking to SQS: the adapter error every broker shares, with
/// [`Broker::NAME`](idempotency_consumer::adapter::Broker::NAME) `sqs`. A queue that does not
/// exist is [`Refused`](AdapterErrorKind::Refused); settings SQS refuses (credentials,
/// permissions, a parameter, a FIFO send without a group, a redrive-policy worker on a queue
/// without one) are [`Config`](AdapterErrorKind::Config); the service out of reach at start is
/// [`Unreachable`](AdapterErrorKind::Unreachable), while running [`Lost`](AdapterErrorKind::Lost);
/// a delete, visibility change or dead-letter copy that failed is
/// [`Settle`](AdapterErrorKind::Settle), a send [`Publish`](AdapterErrorKind::Publish).
#[deprecated(note = "the adapter error every broker shares is `AdapterError`: use that name")]
pub type SqsError = AdapterError;

/// The broker's name in metrics and errors.
pub const BROKER: &str = "sqs";

/// An SQS error while doing `what`, as an error of `kind` unless the service's answer says
/// better: a queue that does not exist is `Refused`, and an answer a retry cannot change
/// (denied, invalid) met where `kind` would be retried (`Unreachable`, `Lost`) is `Config`.
pub(crate) fn sdk<E, R>(kind: AdapterErrorKind, what: &str, error: &SdkError<E, R>) -> AdapterError
where
    E: std::error::Error + ProvideErrorMetadata + 'static,
    R: fmt::Debug,
{
    match error {
        SdkError::ServiceError(service) => {
            let code = service.err().code().unwrap_or("error");
            let detail = format!("{code}: {}", service.err().message().unwrap_or_default());
            let message = format!("{what}: {detail}");
            if code.contains("NonExistentQueue") || code == "QueueDoesNotExist" {
                return AdapterError::new(AdapterErrorKind::Refused, BROKER, message);
            }
            let transient = code.contains("Throttl")
                || code.contains("OverLimit")
                || code.contains("InternalError")
                || code.contains("ServiceUnavailable");
            let kind = match kind {
                AdapterErrorKind::Unreachable | AdapterErrorKind::Lost if !transient => {
                    AdapterErrorKind::Config
                }
                other => other,
            };
            AdapterError::new(kind, BROKER, message)
        }
        other => AdapterError::new(
            kind,
            BROKER,
            format!("{what}: {}", aws_sdk_sqs::error::DisplayErrorContext(other)),
        ),
    }
}

/// A settings error.
pub(crate) fn config(message: impl Into<String>) -> AdapterError {
    AdapterError::new(AdapterErrorKind::Config, BROKER, message.into())
}

/// The HTTP client the SQS clients of this crate use: rustls with the `ring` provider, so no C
/// library is built. Pass it to an `aws_sdk_sqs::Config` of your own. It verifies servers
/// against the system's trust store (which honours `SSL_CERT_FILE` and `SSL_CERT_DIR`).
#[must_use]
pub fn http_client() -> aws_sdk_sqs::config::SharedHttpClient {
    idempotency_core::aws::https_client()
}

/// [`http_client`] verifying servers against the CA certificates in the PEM file `ca` instead
/// of the system's trust store: a compatible server or a TLS proxy with a private CA.
///
/// # Errors
///
/// [`AdapterErrorKind::Config`] naming the file and why it cannot be used.
pub fn http_client_trusting(
    ca: &std::path::Path,
) -> Result<aws_sdk_sqs::config::SharedHttpClient, AdapterError> {
    idempotency_core::aws::https_client_trusting(ca).map_err(config)
}

/// A client configured the usual AWS way (environment, profile, instance role), with
/// `endpoint` and `region` overriding what the environment says (a local server needs the
/// endpoint).
pub async fn client(endpoint: Option<&str>, region: Option<&str>) -> aws_sdk_sqs::Client {
    client_through(endpoint, region, http_client()).await
}

/// [`client`] through `http_client` (for example [`http_client_trusting`] a private CA).
pub async fn client_through(
    endpoint: Option<&str>,
    region: Option<&str>,
    http_client: aws_sdk_sqs::config::SharedHttpClient,
) -> aws_sdk_sqs::Client {
    let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest()).http_client(http_client);
    if let Some(endpoint) = endpoint {
        loader = loader.endpoint_url(endpoint);
    }
    if let Some(region) = region {
        loader = loader.region(aws_config::Region::new(region.to_owned()));
    }
    aws_sdk_sqs::Client::new(&loader.load().await)
}

/// The last path segment of a queue URL (its name), for logs and metric labels.
fn queue_name(url: &str) -> Arc<str> {
    Arc::from(url.trim_end_matches('/').rsplit('/').next().unwrap_or(url))
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_sqs::primitives::Blob;
    use aws_sdk_sqs::types::MessageAttributeValue;

    fn message() -> Message {
        Message::builder()
            .message_id("9f0c")
            .receipt_handle("rh-1")
            .body("{\"amount\":10}")
            .attributes(MessageSystemAttributeName::ApproximateReceiveCount, "3")
            .attributes(MessageSystemAttributeName::MessageDeduplicationId, "order-7")
            .attributes(MessageSystemAttributeName::MessageGroupId, "customer-1")
            .message_attributes(
                "Idempotency-Key",
                MessageAttributeValue::builder()
                    .data_type("String")
                    .string_value("order-7")
                    .build()
                    .unwrap(),
            )
            .message_attributes(
                "Trace",
                MessageAttributeValue::builder()
                    .data_type("Binary")
                    .binary_value(Blob::new(vec![0xff, 0x00]))
                    .build()
                    .unwrap(),
            )
            .build()
    }

    #[test]
    fn presents_attributes_dedup_id_body_and_receive_count() {
        let message = SqsMessage::new(message());
        assert_eq!(message.header("Idempotency-Key"), Some(&b"order-7"[..]));
        assert_eq!(message.header("Trace"), Some(&[0xff, 0x00][..]));
        assert_eq!(
            message.header("idempotency-key"),
            None,
            "names are case-sensitive"
        );
        assert_eq!(Delivery::message_id(&message), Some("order-7"));
        assert_eq!(message.sqs_message_id(), "9f0c");
        assert_eq!(message.payload(), b"{\"amount\":10}");
        assert_eq!(message.delivery_count(), 3);
        assert_eq!(message.group_id(), Some("customer-1"));
        assert_eq!(
            message.headers(),
            vec![
                ("Idempotency-Key".to_owned(), b"order-7".to_vec()),
                ("Trace".to_owned(), vec![0xff, 0x00]),
            ]
        );
    }

    #[test]
    fn a_bare_or_garbled_message_counts_as_a_first_delivery_without_key() {
        let bare = SqsMessage::new(Message::builder().build());
        assert_eq!(bare.delivery_count(), 1);
        assert_eq!(bare.header("Idempotency-Key"), None);
        assert_eq!(Delivery::message_id(&bare), None);
        assert_eq!(bare.payload(), b"");
        let standard = SqsMessage::new(Message::builder().message_id("9f0c").build());
        assert_eq!(
            Delivery::message_id(&standard),
            Some("9f0c"),
            "without a deduplication id, SQS's MessageId"
        );
        let garbled = SqsMessage::new(
            Message::builder()
                .attributes(MessageSystemAttributeName::ApproximateReceiveCount, "many")
                .build(),
        );
        assert_eq!(garbled.delivery_count(), 1);
        let key = KeySource::Header(IDEMPOTENCY_KEY_HEADER.into())
            .find(&bare)
            .unwrap_err();
        assert_eq!(key, "no Idempotency-Key header");
    }

    #[test]
    fn names_queues_by_their_last_segment() {
        assert_eq!(
            &*queue_name("http://127.0.0.1:5000/123456789012/payments"),
            "payments"
        );
        assert_eq!(
            &*queue_name("https://sqs.eu-west-1.amazonaws.com/1/orders.fifo/"),
            "orders.fifo"
        );
    }
}
