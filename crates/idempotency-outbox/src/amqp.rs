//! The relay's RabbitMQ publisher: publisher confirms, and a new connection after a lost one.

use std::fmt;

use idempotency_consumer::BoxError;
use lapin::options::ConfirmSelectOptions;
use lapin::{Channel, Connection};
use tokio::sync::Mutex;

use crate::{OutboxMessage, Publisher};

/// Publishes outbox messages to a RabbitMQ exchange, the destination as the routing key, with
/// the outbox key as the `Idempotency-Key` header and message id, persistent, and waits for
/// each publisher confirm. A failed publish drops the connection; the next one connects again.
pub struct AmqpPublisher {
    url: String,
    exchange: String,
    connection: Mutex<Option<(Connection, Channel)>>,
}

impl fmt::Debug for AmqpPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpPublisher")
            .field("url", &idempotency_core::redact_url(&self.url))
            .field("exchange", &self.exchange)
            .finish_non_exhaustive()
    }
}

impl AmqpPublisher {
    /// A publisher to `exchange` (`""`: the default exchange, where the routing key is the
    /// queue) on the broker at `url`; it connects on the first publish, over TLS for an
    /// `amqps://` URL (with RabbitMQ's `cacertfile`, `certfile`, `keyfile`: see
    /// [`idempotency_amqp::connect_url`]).
    pub fn new(url: impl Into<String>, exchange: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            exchange: exchange.into(),
            connection: Mutex::new(None),
        }
    }
}

impl AmqpPublisher {
    /// The connection and its confirming channel, made again when either is down.
    async fn open(&self, connection: &mut Option<(Connection, Channel)>) -> Result<(), BoxError> {
        let usable = connection.as_ref().is_some_and(|(connection, channel)| {
            connection.status().connected() && channel.status().connected()
        });
        if !usable {
            let opened = idempotency_amqp::connect_url(&self.url).await?;
            let channel = opened.create_channel().await?;
            channel.confirm_select(ConfirmSelectOptions::default()).await?;
            *connection = Some((opened, channel));
        }
        Ok(())
    }
}

impl Publisher for AmqpPublisher {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), BoxError> {
        let mut connection = self.connection.lock().await;
        self.open(&mut connection).await?;
        let Some((_, channel)) = connection.as_ref() else {
            return Err("no RabbitMQ channel".into());
        };
        let published = idempotency_amqp::publish_with_headers(
            channel,
            &self.exchange,
            &message.destination,
            &message.key,
            &message.payload,
            &message.headers,
        )
        .await;
        if let Err(error) = published {
            *connection = None;
            return Err(error.into());
        }
        Ok(())
    }

    /// The connection is up, or is made now (and kept for the next publish).
    async fn reachable(&self) -> Result<(), BoxError> {
        let mut connection = self.connection.lock().await;
        self.open(&mut connection).await
    }
}
