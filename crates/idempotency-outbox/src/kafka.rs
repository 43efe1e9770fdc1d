//! The relay's Kafka publisher: an idempotent producer, the ordering key as the record key.

use idempotency_consumer::BoxError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

use crate::{OutboxError, OutboxMessage, Publisher};

/// Publishes outbox messages to Kafka, the destination as the topic and the ordering key as the
/// record key (so an aggregate's events share a partition and keep their order), with the
/// outbox key as `Idempotency-Key`, and waits for each delivery report.
#[derive(derive_more::Debug)]
pub struct KafkaPublisher {
    #[debug(skip)]
    producer: FutureProducer,
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
    /// Unless the URL says otherwise, the producer does not ask the brokers to create a topic it
    /// publishes to (`allow.auto.create.topics=false`: a row whose topic is missing fails, and
    /// is parked after its attempts, instead of creating a topic with the brokers' defaults),
    /// and sends each record at once (`linger.ms=0`: the relay waits for each delivery report
    /// before the next record, so there is never a batch to wait for).
    ///
    /// # Errors
    ///
    /// What is wrong with the URL or a setting, never echoing the password.
    pub fn from_url(url: &str) -> Result<Self, idempotency_kafka::AdapterError> {
        Ok(Self::with_producer(
            idempotency_kafka::producer_from_url_with_defaults(
                url,
                &[("allow.auto.create.topics", "false"), ("linger.ms", "0")],
            )?,
        ))
    }

    /// A publisher on `producer` (configure it with `enable.idempotence=true`).
    #[must_use]
    pub fn with_producer(producer: FutureProducer) -> Self {
        Self { producer }
    }

    /// Checks that the brokers know `topic` (else every publish to it would fail, or create it
    /// with the brokers' defaults where they create topics on first use), asking for its
    /// metadata within `timeout`.
    ///
    /// # Errors
    ///
    /// [`OutboxError::Destination`]: the topic does not exist, or the brokers did not answer.
    pub async fn check_topic(&self, topic: &str, timeout: std::time::Duration) -> Result<(), OutboxError> {
        let refused = |why: String| OutboxError::Destination(why);
        let producer = self.producer.clone();
        let name = topic.to_owned();
        let metadata =
            tokio::task::spawn_blocking(move || producer.client().fetch_metadata(Some(&name), timeout))
                .await
                .map_err(|e| refused(e.to_string()))?
                .map_err(|e| refused(format!("the brokers did not describe the topic `{topic}` ({e})")))?;
        match metadata.topics().iter().find(|t| t.name() == topic) {
            Some(found) if found.error().is_none() && !found.partitions().is_empty() => Ok(()),
            Some(found) => Err(refused(format!(
                "the topic `{topic}` does not exist ({})",
                found.error().map_or_else(
                    || "no partitions".to_owned(),
                    |e| rdkafka::error::RDKafkaErrorCode::from(e).to_string()
                )
            ))),
            None => Err(refused(format!("the topic `{topic}` does not exist"))),
        }
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

    /// The brokers answer a metadata request (of no topic) within 5 s.
    async fn reachable(&self) -> Result<(), BoxError> {
        let producer = self.producer.clone();
        let timeout = std::time::Duration::from_secs(5);
        tokio::task::spawn_blocking(move || producer.client().fetch_metadata(Some(""), timeout).map(|_| ()))
            .await??;
        Ok(())
    }
}
