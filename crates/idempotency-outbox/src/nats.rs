//! The relay's NATS JetStream publisher: the outbox key as `Nats-Msg-Id`, so the stream itself
//! drops a republish within its duplicate window, and the consumer's record drops it after.

use async_nats::HeaderMap;
use async_nats::jetstream;
use idempotency_consumer::BoxError;

use crate::{OutboxError, OutboxMessage, Publisher};

/// Publishes outbox messages to JetStream, the destination as the subject, with the outbox key
/// as `Idempotency-Key` and `Nats-Msg-Id`, and waits for each publish acknowledgement. Headers
/// that are not UTF-8 are sent lossily (NATS headers are text).
#[derive(derive_more::Debug)]
pub struct NatsPublisher {
    #[debug(skip)]
    jetstream: jetstream::Context,
}

impl NatsPublisher {
    /// A publisher on `jetstream` (a stream must capture the destinations).
    #[must_use]
    pub fn new(jetstream: jetstream::Context) -> Self {
        Self { jetstream }
    }

    /// A publisher on a client of the server `url` names, with the same connection parameters
    /// as `idem consume`'s NATS sources (`tls://`, `tls_required`, `ca`, `cert`, `key`, `nkey`,
    /// `creds`; see [`idempotency_nats::connect_url`]); the first connection must work within
    /// `timeout`.
    ///
    /// # Errors
    ///
    /// A malformed URL or unusable file, or a server that does not answer or refuses the
    /// connection, with the reason.
    pub async fn connect(
        url: &str,
        timeout: std::time::Duration,
    ) -> Result<Self, idempotency_nats::AdapterError> {
        let client = idempotency_nats::connect_url(url, timeout).await?;
        Ok(Self::new(jetstream::new(client)))
    }

    /// Checks that a stream captures `subject` (else every publish to it would fail): the
    /// stream's name.
    ///
    /// # Errors
    ///
    /// [`OutboxError::Destination`]: no stream captures it, or the server could not be asked.
    pub async fn check_subject(&self, subject: &str) -> Result<String, OutboxError> {
        self.jetstream.stream_by_subject(subject).await.map_err(|e| {
            OutboxError::Destination(format!(
                "no JetStream stream captures the subject `{subject}` ({e})"
            ))
        })
    }
}

impl Publisher for NatsPublisher {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), BoxError> {
        let mut headers = HeaderMap::new();
        for (name, value) in &message.headers {
            headers.insert(name.as_str(), String::from_utf8_lossy(value).as_ref());
        }
        headers.insert(idempotency_core::IDEMPOTENCY_KEY_HEADER, message.key.as_str());
        headers.insert("Nats-Msg-Id", message.key.as_str());
        self.jetstream
            .publish_with_headers(
                message.destination.clone(),
                headers,
                bytes::Bytes::from(message.payload.clone()),
            )
            .await?
            .await?;
        Ok(())
    }

    /// The client is connected (it reconnects by itself).
    async fn reachable(&self) -> Result<(), BoxError> {
        match self.jetstream.client().connection_state() {
            async_nats::connection::State::Connected => Ok(()),
            state => Err(format!("the NATS client is {state}").into()),
        }
    }
}
