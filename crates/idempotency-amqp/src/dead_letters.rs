//! `<queue>.dead` as a [`DeadLetterQueue`]: what `idem dlq` reads, replays and purges.
//!
//! AMQP 0-9-1 has no way to look at a queue without taking its messages. A listing takes them
//! with `basic.get` without acking and gives them all back at once by closing its channel:
//! RabbitMQ puts them back where they were (a classic queue keeps its order), the depth is the
//! same afterwards, and only the `redelivered` flag (and a quorum queue's delivery count) show
//! that they were read. A replay or purge takes every message the same way, acks the selected
//! ones once settled (a replay after the work queue confirmed the copy) and gives the others
//! back.

use std::time::SystemTime;

use idempotency_consumer::adapter::{AdapterError, AdapterErrorKind};
use idempotency_consumer::dead_letters::{
    Bytes, DeadLetter, DeadLetterQueue, DlqFuture, OpenFuture, Selection, Settle, is_dead_letter_header,
};
use lapin::options::{BasicAckOptions, BasicGetOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection};

use crate::{AmqpSource, BROKER, DELIVERIES_HEADER, Route, Topology, amqp, publish_confirmed};

/// How long opening waits for the broker.
const CONNECT: std::time::Duration = std::time::Duration::from_secs(10);

/// Opens the dead-letter queue of the `amqp://…?queue=QUEUE` source `url`.
pub(crate) fn open(url: String) -> OpenFuture {
    Box::pin(async move {
        let source = AmqpSource::from_url(&url)?;
        let connection = tokio::time::timeout(CONNECT, crate::tls::connect(&source.url, &source.tls))
            .await
            .map_err(|_| {
                AdapterError::new(
                    AdapterErrorKind::Unreachable,
                    BROKER,
                    format!("the broker did not answer within {CONNECT:?}"),
                )
            })?
            .map_err(|error| {
                AdapterError::new(
                    AdapterErrorKind::Unreachable,
                    BROKER,
                    format!(
                        "cannot connect to the broker: {}",
                        idempotency_core::redact_url(&error.to_string())
                    ),
                )
            })?;
        let topology = Topology::for_queue(&source.queue);
        let queue = AmqpDeadLetters { connection, topology };
        for name in [&queue.topology.dead_queue, &queue.topology.queue] {
            let channel = queue.channel().await?;
            queue_depth(&channel, name).await?;
            let _ = channel.close(200, "checked".into()).await;
        }
        let boxed: Box<dyn DeadLetterQueue> = Box::new(queue);
        Ok(boxed)
    })
}

/// The ready messages of `queue`, by a passive declare; a missing queue is a clear error
/// (and closes `channel`, as any failed declare does).
///
/// # Errors
///
/// [`AdapterErrorKind::Config`] naming the queue when it does not exist.
pub async fn queue_depth(channel: &Channel, queue: &str) -> Result<u32, AdapterError> {
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(|error| {
            AdapterError::new(
                AdapterErrorKind::Config,
                BROKER,
                format!("the queue `{queue}` does not exist ({error})"),
            )
        })?;
    Ok(declared.message_count())
}

/// A header's value as text.
fn text(value: &AMQPValue) -> String {
    match value {
        AMQPValue::LongString(value) => String::from_utf8_lossy(value.as_bytes()).into_owned(),
        AMQPValue::ShortString(value) => value.as_str().to_owned(),
        AMQPValue::ByteArray(value) => String::from_utf8_lossy(value.as_slice()).into_owned(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::Boolean(b) => b.to_string(),
        other => format!("{other:?}"),
    }
}

/// The dead-letter queue of one work queue.
struct AmqpDeadLetters {
    connection: Connection,
    topology: Topology,
}

impl AmqpDeadLetters {
    async fn channel(&self) -> Result<Channel, AdapterError> {
        self.connection
            .create_channel()
            .await
            .map_err(amqp(AdapterErrorKind::Lost, "opening a channel"))
    }

    /// Takes up to `limit` messages of the dead-letter queue on `channel` without acking them.
    async fn take(
        &self,
        channel: &Channel,
        limit: usize,
    ) -> Result<Vec<(DeadLetter, lapin::message::BasicGetMessage)>, AdapterError> {
        let ready = queue_depth(channel, &self.topology.dead_queue).await? as usize;
        let mut taken = Vec::new();
        while taken.len() < ready.min(limit) {
            let Some(message) = channel
                .basic_get(
                    self.topology.dead_queue.as_str().into(),
                    BasicGetOptions { no_ack: false },
                )
                .await
                .map_err(amqp(AdapterErrorKind::Lost, "reading the dead-letter queue"))?
            else {
                break;
            };
            let headers = message
                .delivery
                .properties
                .headers()
                .as_ref()
                .map(|headers| {
                    headers
                        .inner()
                        .iter()
                        .map(|(name, value)| (name.as_str().to_owned(), text(value)))
                        .collect()
                })
                .unwrap_or_default();
            let letter = DeadLetter::new(
                (taken.len() + 1).to_string(),
                headers,
                Bytes::copy_from_slice(&message.delivery.data),
            );
            taken.push((letter, message));
        }
        Ok(taken)
    }
}

impl DeadLetterQueue for AmqpDeadLetters {
    fn name(&self) -> String {
        self.topology.dead_queue.clone()
    }

    fn browse(&mut self, limit: usize) -> DlqFuture<'_, Vec<DeadLetter>> {
        Box::pin(async move {
            let channel = self.channel().await?;
            let taken = self.take(&channel, limit).await;
            // Closing the channel gives back every message it holds unacked.
            let _ = channel.close(200, "browsed".into()).await;
            Ok(taken?.into_iter().map(|(letter, _)| letter).collect())
        })
    }

    fn settle<'a>(&'a mut self, selection: &'a Selection, settle: Settle) -> DlqFuture<'a, usize> {
        Box::pin(async move {
            let channel = self.channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .map_err(amqp(AdapterErrorKind::Lost, "enabling publisher confirms"))?;
            let settled = async {
                let now = SystemTime::now();
                let mut settled = 0;
                for (letter, message) in self.take(&channel, usize::MAX).await? {
                    if settled >= selection.limit || !selection.matches(&letter, now) {
                        continue;
                    }
                    if settle == Settle::Replay {
                        let delivery = &message.delivery;
                        let mut headers = FieldTable::default();
                        let original = delivery.properties.headers().clone().unwrap_or_default();
                        for (name, value) in original.inner() {
                            if !is_dead_letter_header(name.as_str()) && name.as_str() != DELIVERIES_HEADER {
                                headers.insert(name.clone(), value.clone());
                            }
                        }
                        publish_confirmed(
                            &channel,
                            Route::Queue,
                            self.topology.queue.clone(),
                            delivery.data.clone(),
                            delivery.properties.clone().with_headers(headers),
                            AdapterErrorKind::Publish,
                        )
                        .await?;
                    }
                    message
                        .delivery
                        .ack(BasicAckOptions::default())
                        .await
                        .map_err(amqp(AdapterErrorKind::Settle, "acking a settled dead letter"))?;
                    settled += 1;
                }
                Ok::<_, AdapterError>(settled)
            }
            .await;
            // The messages not selected go back where they were.
            let _ = channel.close(200, "settled".into()).await;
            settled
        })
    }
}
