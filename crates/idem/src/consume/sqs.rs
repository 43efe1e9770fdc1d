//! `sqs://` sources: `idempotency-sqs`'s worker, with visibility heartbeats while a call runs.

use std::sync::Arc;

use super::source::Sqs;
use super::{Config, ConsumeError, Processor, Shutdown};

/// Without a long poll, the pause after a receive that found nothing.
#[cfg(feature = "sqs")]
const SHORT_POLL_PAUSE: std::time::Duration = std::time::Duration::from_millis(200);

/// Consumes the queue until `shutdown`: a message is deleted only once its outcome is
/// recorded, a refused one sent to the dead-letter queue (or left to the redrive policy).
#[cfg(feature = "sqs")]
pub(super) async fn run(
    config: &Config,
    sqs: Sqs,
    processor: Arc<Processor>,
    shutdown: Shutdown,
) -> Result<(), ConsumeError> {
    use idempotency_sqs::{DeadLetters, Worker};

    let refuse = |why: String| ConsumeError::Broker {
        from: idempotency::redact_url(&config.from),
        why,
    };
    let client = idempotency_sqs::client(sqs.endpoint.as_deref(), sqs.region.as_deref()).await;
    let dead_letters = match &sqs.dead_letter_url {
        Some(url) => DeadLetters::Queue(url.clone()),
        None => DeadLetters::RedrivePolicy,
    };
    let concurrency = usize::from(config.concurrency.unwrap_or(config.prefetch));
    let mut worker = Worker::new(client, sqs.queue_url.clone(), dead_letters, processor)
        .concurrency(concurrency)
        .batch_size(usize::from(config.prefetch))
        .visibility_timeout(sqs.visibility);
    worker = if sqs.wait.is_zero() {
        worker.short_polling(SHORT_POLL_PAUSE)
    } else {
        worker.wait_time(sqs.wait)
    };
    match tokio::time::timeout(super::START_CHECK, worker.check()).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) if error.is_retryable() => {
            return Err(refuse(format!("cannot reach SQS: {error}")));
        }
        Ok(Err(error)) => return Err(refuse(error.to_string())),
        Err(_) => return Err(refuse("SQS did not answer within 10 s".into())),
    }
    tracing::info!(queue = %sqs.queue_name(), to = %config.to, "consuming");
    worker
        .run_until(shutdown)
        .await
        .map_err(|e| refuse(e.to_string()))
}

/// Without the `sqs` feature: refused (the source is checked before anything starts, so this
/// is not reached).
#[cfg(not(feature = "sqs"))]
pub(super) async fn run(
    config: &Config,
    _sqs: Sqs,
    _processor: Arc<Processor>,
    _shutdown: Shutdown,
) -> Result<(), ConsumeError> {
    Err(super::source::not_built(&config.from, "sqs"))
}
