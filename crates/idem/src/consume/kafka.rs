//! `kafka://` sources: a member of a consumer group, on `idempotency-kafka`'s worker.

use std::sync::Arc;

use super::source::Kafka;
use super::{Config, ConsumeError, Processor, Shutdown};

/// The longest `max.poll.interval.ms` librdkafka accepts.
#[cfg(feature = "kafka")]
const MAX_POLL_INTERVAL: std::time::Duration = std::time::Duration::from_secs(86_400);

/// Consumes the topic until `shutdown`: partitions in parallel, each in order; offsets
/// committed only past recorded messages; a refused message produced to the dead-letter topic.
#[cfg(feature = "kafka")]
pub(super) async fn run(
    config: &Config,
    kafka: Kafka,
    processor: Arc<Processor>,
    shutdown: Shutdown,
) -> Result<(), ConsumeError> {
    use std::time::Duration;

    use idempotency_kafka::rdkafka::ClientConfig;

    let refuse = |why: String| ConsumeError::Broker {
        from: idempotency::redact_url(&config.from),
        why,
    };
    // On SIGTERM the running calls get the handler timeout to finish, and a bit more to be
    // recorded; meanwhile the poll thread waits for them, so the group must not count the
    // member as gone before that.
    let settle = config.handler_timeout + Duration::from_secs(5);
    // librdkafka accepts at most 24 h; a handler timeout that long may see the member leave
    // the group before a shutdown's last call ends (its message then comes back, answered by
    // the record).
    let poll_interval = (settle + Duration::from_secs(60)).min(MAX_POLL_INTERVAL);
    let mut client = ClientConfig::new();
    client
        .set("bootstrap.servers", &kafka.brokers)
        .set("group.id", &kafka.group)
        .set(
            "max.poll.interval.ms",
            poll_interval.as_millis().max(300_000).to_string(),
        );
    for (name, value) in &kafka.settings {
        client.set(name, value);
    }
    let partitions = usize::from(config.concurrency.unwrap_or(config.prefetch));
    let worker = idempotency_kafka::Worker::new(client, kafka.topic.clone(), processor)
        .name(config.name.clone())
        .dead_letter_topic(kafka.dead_letter.clone())
        .partitions_at_once(partitions)
        .max_queued(usize::from(config.prefetch))
        .settle_timeout(settle);
    worker
        .check(super::START_CHECK)
        .await
        .map_err(|e| refuse(e.to_string()))?;
    tracing::info!(topic = %kafka.topic, group = %kafka.group, to = %config.to, "consuming");
    worker
        .run_until(shutdown)
        .await
        .map_err(|e| refuse(e.to_string()))
}

/// Without the `kafka` feature: refused (the source is checked before anything starts, so
/// this is not reached).
#[cfg(not(feature = "kafka"))]
pub(super) async fn run(
    config: &Config,
    _kafka: Kafka,
    _processor: Arc<Processor>,
    _shutdown: Shutdown,
) -> Result<(), ConsumeError> {
    Err(super::source::not_built(&config.from, "kafka"))
}
