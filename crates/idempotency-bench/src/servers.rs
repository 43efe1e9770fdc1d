//! The servers the benchmarks measure against, on loopback unless the environment names
//! others (the same variables and defaults as the test suite's).

/// `name` from the environment, or `default`.
pub(crate) fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// RabbitMQ's URL (`AMQP_URL`).
pub(crate) fn amqp_url() -> String {
    env_or("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
}

/// A connection to RabbitMQ with a channel on it, and `queue` declared (durable settings left
/// at the broker's defaults). The connection is returned so that the caller keeps it open.
pub(crate) async fn rabbit_queue(queue: &str) -> Result<(lapin::Connection, lapin::Channel), String> {
    let url = amqp_url();
    let connection = lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
        .await
        .map_err(|e| format!("RabbitMQ at {}: {e}", idempotency_core::redact_url(&url)))?;
    let channel = connection.create_channel().await.map_err(|e| e.to_string())?;
    channel
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok((connection, channel))
}
