//! The relay's Kafka publisher: an idempotent producer, the ordering key as the record key.

use std::fmt;

use idempotency_consumer::BoxError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::{OutboxMessage, Publisher};

/// Publishes outbox messages to Kafka, the destination as the topic and the ordering key as the
/// record key (so an aggregate's events share a partition and keep their order), with the
/// outbox key as `Idempotency-Key`, and waits for each delivery report.
pub struct KafkaPublisher {
    producer: FutureProducer,
}

impl fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaPublisher").finish_non_exhaustive()
    }
}

impl KafkaPublisher {
    /// A publisher with an idempotent producer for `bootstrap_servers`
    /// ([`idempotency_kafka::idempotent_producer`]).
    ///
    /// # Errors
    ///
    /// The client's error for an invalid configuration.
    pub fn new(bootstrap_servers: &str) -> Result<Self, rdkafka::error::KafkaError> {
        Ok(Self::with_producer(idempotency_kafka::idempotent_producer(
            bootstrap_servers,
        )?))
    }

    /// A publisher with an idempotent producer for the brokers and librdkafka settings a
    /// `kafka://[USER:PASSWORD@]HOST:PORT[,…][?SETTING=V…]` URL names, as `idem consume`'s
    /// Kafka sources take them (TLS, SASL; see [`idempotency_kafka::producer_from_url`]).
    ///
    /// # Errors
    ///
    /// What is wrong with the URL or a setting, never echoing the password.
    pub fn from_url(url: &str) -> Result<Self, idempotency_kafka::AdapterError> {
        Ok(Self::with_producer(idempotency_kafka::producer_from_url(url)?))
    }

    /// A publisher on `producer` (configure it with `enable.idempotence=true`).
    #[must_use]
    pub fn with_producer(producer: FutureProducer) -> Self {
        Self { producer }
    }
}

impl Publisher for KafkaPublisher {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), BoxError> {
        let mut headers = OwnedHeaders::new();
        for (name, value) in &message.headers {
            headers = headers.insert(Header {
                key: name.as_str(),
                value: Some(value.as_slice()),
            });
        }
        headers = headers.insert(Header {
            key: idempotency_core::IDEMPOTENCY_KEY_HEADER,
            value: Some(message.key.as_str()),
        });
        let record = FutureRecord::to(&message.destination)
            .payload(&message.payload)
            .key(&message.ordering_key)
            .headers(headers);
        self.producer
            .send(record, idempotency_kafka::PRODUCE_TIMEOUT)
            .await
            .map_err(|(error, _)| error)?;
        Ok(())
    }
}
