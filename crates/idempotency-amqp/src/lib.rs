//! Idempotent RabbitMQ consumers (lapin), on the broker-neutral rules of
//! `idempotency-consumer`.
//!
//! A [`Topology`] for queue `Q` declares three durable queues:
//! * `Q`: the work;
//! * `Q.retry`: delayed retries. A message waits there for its own TTL (`expiration`), then
//!   RabbitMQ dead-letters it back to `Q` through the default exchange;
//! * `Q.dead`: dead letters, each with the reason in the `Idempotency-Dead-Reason` header.
//!
//! [`settle`] carries out a [`Disposition`] with manual acks:
//! * `Ack`: `basic.ack`, only after the outcome is recorded;
//! * `Nack { after }`: publish a copy to `Q.retry` with `expiration = after` and the delivery
//!   count plus one (`x-idempotency-deliveries`), wait for the publisher confirm, then ack the
//!   original;
//! * `DeadLetter { reason }`: publish a copy to `Q.dead` with the reason, wait for the confirm,
//!   then ack.
//!
//! A crash between the confirm and the ack redelivers the original. The copy already holds its
//! place, and the record makes the extra delivery a duplicate.
//!
//! The channel must be in confirm mode: [`Topology::declare`] puts it there.
//!
//! [`Worker`] runs all of this for one queue as a long-lived consumer: prefetch, concurrent
//! processing, reconnection with backoff when the broker goes away (its unsettled deliveries
//! come back, and the record makes the completed ones duplicates), and a graceful stop.
//!
//! Per-message TTLs in one retry queue expire in queue order: a short delay queued behind a long
//! one waits for it. With the default capped exponential backoff this delays some retries up to
//! the cap (5 min by default); use one topology per delay class if that matters.

use std::time::Duration;

mod dead_letters;
pub use dead_letters::queue_depth;
mod source;
mod tls;
mod worker;
pub use source::{AmqpSource, SOURCE};
pub use tls::{AmqpTls, connect_url};
pub use worker::{DEFAULT_SET_UP_TIMEOUT, Worker};

use idempotency_consumer::IDEMPOTENCY_KEY_HEADER;
pub use idempotency_consumer::adapter::{AdapterError, AdapterErrorKind};
use idempotency_consumer::adapter::{Broker, DEFAULT_SETTLE_TIMEOUT, Pipeline};
use idempotency_consumer::{
    DEAD_LETTER_AT_HEADER, DEAD_LETTER_DELIVERIES_HEADER, DEAD_LETTER_REASON_HEADER,
    DEAD_LETTER_SOURCE_HEADER, Delivery, Disposition, Processor, dead_letter_headers,
};
use idempotency_core::Key;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel};

/// The header a dead-lettered message carries its reason in.
pub const DEAD_REASON_HEADER: &str = DEAD_LETTER_REASON_HEADER;

/// The header that counts deliveries across delayed retries.
pub const DELIVERIES_HEADER: &str = "x-idempotency-deliveries";

/// A RabbitMQ operation that failed: the adapter error every broker shares, with
/// [`Broker::NAME`] `rabbitmq`. A lost or refused
/// connection is [`Lost`](AdapterErrorKind::Lost), a declaration the broker refused (a queue
/// that exists with other arguments) [`Refused`](AdapterErrorKind::Refused), an unconfirmed or
/// late settlement [`Settle`](AdapterErrorKind::Settle).
#[deprecated(note = "the adapter error every broker shares is `AdapterError`: use that name")]
pub type AmqpError = AdapterError;

/// How long a settlement may take before it is given up: on a connection that died, an ack or a
/// publisher confirm may never answer, and a worker waiting for it would never reconnect.
pub const SETTLE_TIMEOUT: Duration = DEFAULT_SETTLE_TIMEOUT;

/// How long a delivery whose settlement failed is kept before it is handed back to its queue
/// (`basic.nack` with requeue): a destination that keeps refusing copies is not retried in a
/// tight loop.
pub const SETTLE_RETRY: Duration = Duration::from_secs(1);

/// The broker's name in metrics and errors.
pub const BROKER: &str = "rabbitmq";

/// A client or broker error while doing `what`, as an error of `kind`.
fn amqp(kind: AdapterErrorKind, what: &str) -> impl FnOnce(lapin::Error) -> AdapterError {
    move |error| AdapterError::new(kind, BROKER, format!("{what}: {error}")).with_source(error)
}

/// The error of declaring `queue`: [`AdapterErrorKind::Refused`] when the broker refused the
/// declaration (a channel-level error: a queue that exists with other arguments, no
/// permission), [`AdapterErrorKind::Lost`] otherwise (the connection went, say): only the
/// first is a configuration error that retrying cannot mend.
fn declaring(queue: &str) -> impl FnOnce(lapin::Error) -> AdapterError + '_ {
    move |error| {
        let kind = if error.is_amqp_soft_error() {
            AdapterErrorKind::Refused
        } else {
            AdapterErrorKind::Lost
        };
        amqp(kind, &format!("declaring queue {queue}"))(error)
    }
}

/// The queues of one consumer; see the [crate docs](crate).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// The work queue.
    pub queue: String,
    /// Where delayed retries wait.
    pub retry_queue: String,
    /// Where dead letters go.
    pub dead_queue: String,
    /// Delete the queues after they have been unused this long (`x-expires`): for short-lived
    /// environments and tests. `None` (the default) keeps them.
    pub expires: Option<Duration>,
}

impl Topology {
    /// The topology of queue `queue`: `queue`, `queue.retry`, `queue.dead`.
    #[must_use]
    pub fn for_queue(queue: &str) -> Self {
        Self {
            queue: queue.to_owned(),
            retry_queue: format!("{queue}.retry"),
            dead_queue: format!("{queue}.dead"),
            expires: None,
        }
    }

    /// Delete the queues after they have been unused (no consumer, no declaration) for
    /// `after`: RabbitMQ's `x-expires`. Declaring a queue again with another value fails.
    #[must_use]
    pub fn expires(mut self, after: Duration) -> Self {
        self.expires = Some(after);
        self
    }

    /// Declares the three queues (durable; declaring again is a no-op) and puts `channel` in
    /// confirm mode.
    ///
    /// # Errors
    ///
    /// The broker refused a declaration (for example a queue exists with other arguments).
    ///
    /// # Errors
    ///
    /// [`AdapterErrorKind::Refused`] when the broker refuses a declaration (a queue that exists
    /// with other arguments), [`AdapterErrorKind::Lost`] when the channel fails.
    pub async fn declare(&self, channel: &Channel) -> Result<(), AdapterError> {
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let mut common = FieldTable::default();
        if let Some(after) = self.expires {
            let millis = i64::try_from(after.as_millis()).unwrap_or(i64::MAX).max(1);
            common.insert("x-expires".into(), AMQPValue::LongLongInt(millis));
        }
        channel
            .queue_declare(self.queue.as_str().into(), durable, common.clone())
            .await
            .map_err(declaring(&self.queue))?;
        let mut retry = common.clone();
        retry.insert("x-dead-letter-exchange".into(), AMQPValue::LongString("".into()));
        retry.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(self.queue.as_str().into()),
        );
        channel
            .queue_declare(self.retry_queue.as_str().into(), durable, retry)
            .await
            .map_err(declaring(&self.retry_queue))?;
        channel
            .queue_declare(self.dead_queue.as_str().into(), durable, common)
            .await
            .map_err(declaring(&self.dead_queue))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(amqp(
                AdapterErrorKind::Lost,
                "putting the channel in confirm mode",
            ))
    }
}

/// A RabbitMQ delivery as a [`Delivery`].
#[derive(Debug)]
pub struct AmqpMessage {
    delivery: lapin::message::Delivery,
    deliveries: u32,
}

fn header_value<'a>(table: &'a FieldTable, name: &str) -> Option<&'a AMQPValue> {
    table.inner().get(name)
}

impl AmqpMessage {
    /// Hands the message back to its queue (`basic.nack` with requeue), for a message whose
    /// settlement failed. A failure is logged: the channel is then gone, and the broker puts
    /// the message back itself.
    pub(crate) async fn requeue(&self) {
        let options = lapin::options::BasicNackOptions {
            requeue: true,
            ..Default::default()
        };
        if let Err(error) = self.delivery.nack(options).await {
            tracing::warn!(%error, "could not hand a message back; the broker will when the channel closes");
        }
    }

    /// Wraps a delivery. The delivery count is the larger of two counts:
    /// - the `x-idempotency-deliveries` header (1 when absent), which every requeue path of this
    ///   crate increments, plus one if the broker says this is a redelivery;
    /// - on a quorum queue, the broker's own `x-delivery-count` (the redeliveries so far) plus
    ///   one, which also counts the redeliveries after a worker died before settling.
    #[must_use]
    pub fn new(delivery: lapin::message::Delivery) -> Self {
        let number = |name: &str| {
            delivery
                .properties
                .headers()
                .as_ref()
                .and_then(|h| header_value(h, name))
                .and_then(|v| match v {
                    AMQPValue::ShortInt(n) => u32::try_from(*n).ok(),
                    AMQPValue::LongInt(n) => u32::try_from(*n).ok(),
                    AMQPValue::LongLongInt(n) => u32::try_from(*n).ok(),
                    AMQPValue::LongUInt(n) => Some(*n),
                    _ => None,
                })
        };
        let counted = number(DELIVERIES_HEADER)
            .unwrap_or(1)
            .saturating_add(u32::from(delivery.redelivered));
        let by_broker = number("x-delivery-count").map_or(0, |n| n.saturating_add(1));
        let deliveries = counted.max(by_broker);
        Self { delivery, deliveries }
    }

    /// The lapin delivery.
    #[must_use]
    pub fn delivery(&self) -> &lapin::message::Delivery {
        &self.delivery
    }
}

impl Delivery for AmqpMessage {
    fn header(&self, name: &str) -> Option<&[u8]> {
        let headers = self.delivery.properties.headers().as_ref()?;
        match header_value(headers, name)? {
            AMQPValue::LongString(value) => Some(value.as_bytes()),
            AMQPValue::ShortString(value) => Some(value.as_str().as_bytes()),
            _ => None,
        }
    }

    fn message_id(&self) -> Option<&str> {
        self.delivery
            .properties
            .message_id()
            .as_ref()
            .map(ShortString::as_str)
    }

    fn payload(&self) -> &[u8] {
        &self.delivery.data
    }

    /// The message's `content_type` property, else a `content-type` header.
    fn content_type(&self) -> Option<&str> {
        self.delivery
            .properties
            .content_type()
            .as_ref()
            .map(ShortString::as_str)
            .or_else(|| {
                self.header("content-type")
                    .and_then(|value| std::str::from_utf8(value).ok())
            })
    }

    fn delivery_count(&self) -> u32 {
        self.deliveries
    }

    /// The string headers (long and short strings), as the adapter's own headers are; headers
    /// of other AMQP types are left out.
    fn headers(&self) -> Vec<(String, Vec<u8>)> {
        let Some(headers) = self.delivery.properties.headers().as_ref() else {
            return Vec::new();
        };
        headers
            .inner()
            .iter()
            .filter_map(|(name, value)| match value {
                AMQPValue::LongString(value) => Some((name.to_string(), value.as_bytes().to_vec())),
                AMQPValue::ShortString(value) => Some((name.to_string(), value.as_str().as_bytes().to_vec())),
                _ => None,
            })
            .collect()
    }
}

/// Moves up to `limit` messages from the dead-letter queue back to the work queue, after the
/// cause is fixed; returns how many it moved. Each copy keeps its payload, properties and
/// `Idempotency-Key`, loses the dead-letter headers and starts its delivery count again; it is
/// published with a confirm before its dead-letter copy is acked, so nothing is lost (a crash in
/// between leaves a duplicate, which the record answers without running it twice).
///
/// ```no_run
/// # async fn example(channel: &lapin::Channel) -> Result<(), idempotency_amqp::AdapterError> {
/// use idempotency_amqp::{Topology, replay_dead_letters};
/// let moved = replay_dead_letters(channel, &Topology::for_queue("payments"), 100).await?;
/// println!("{moved} dead letters back on payments");
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// [`AdapterError`] when a publish was not confirmed or an ack failed; what was moved before
/// stays moved.
pub async fn replay_dead_letters(
    channel: &Channel,
    topology: &Topology,
    limit: usize,
) -> Result<usize, AdapterError> {
    let mut moved = 0;
    while moved < limit {
        let Some(message) = channel
            .basic_get(
                topology.dead_queue.as_str().into(),
                BasicGetOptions { no_ack: false },
            )
            .await
            .map_err(amqp(AdapterErrorKind::Lost, "reading the dead-letter queue"))?
        else {
            break;
        };
        let delivery = message.delivery;
        let mut headers = delivery.properties.headers().clone().unwrap_or_default();
        let dead = [
            DEAD_LETTER_REASON_HEADER,
            DEAD_LETTER_SOURCE_HEADER,
            DEAD_LETTER_DELIVERIES_HEADER,
            DEAD_LETTER_AT_HEADER,
            DELIVERIES_HEADER,
        ];
        let kept: Vec<_> = headers
            .inner()
            .iter()
            .filter(|(name, _)| !dead.contains(&name.as_str()))
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        headers = FieldTable::default();
        for (name, value) in kept {
            headers.insert(name, value);
        }
        let properties = delivery.properties.clone().with_headers(headers);
        publish_confirmed(
            channel,
            Route::Queue,
            topology.queue.clone(),
            delivery.data.clone(),
            properties,
            AdapterErrorKind::Publish,
        )
        .await?;
        delivery
            .ack(BasicAckOptions::default())
            .await
            .map_err(amqp(AdapterErrorKind::Settle, "acking a replayed dead letter"))?;
        moved += 1;
    }
    Ok(moved)
}

/// RabbitMQ as the per-message pipeline sees it: one channel (in confirm mode) and the
/// consumer's queues. RabbitMQ holds an unacknowledged delivery for as long as the consumer's
/// channel is open, so there is no hold to keep alive.
#[derive(Debug, Clone)]
pub struct RabbitMq {
    channel: Channel,
    topology: Topology,
}

impl RabbitMq {
    /// Settles deliveries of `topology`'s queue on `channel`.
    #[must_use]
    pub fn new(channel: Channel, topology: Topology) -> Self {
        Self { channel, topology }
    }
}

impl Broker for RabbitMq {
    type Message = AmqpMessage;
    const NAME: &'static str = BROKER;

    /// See the [crate docs](crate): a copy to `Q.retry` or `Q.dead`, confirmed by the broker,
    /// then the ack.
    async fn settle(&self, message: &AmqpMessage, disposition: &Disposition) -> Result<(), AdapterError> {
        settle(&self.channel, &self.topology, message, disposition).await
    }

    /// After a pause ([`SETTLE_RETRY`], so that a destination that keeps refusing copies is not
    /// retried in a tight loop), `basic.nack` with requeue: left alone, the unacknowledged
    /// delivery would sit on this channel until the channel closes.
    async fn give_back(&self, message: &AmqpMessage) {
        tokio::time::sleep(SETTLE_RETRY).await;
        message.requeue().await;
    }
}

/// Processes one delivery with `consumer`, then settles it on `channel`, through the shared
/// per-message [`Pipeline`] (named after the queue).
///
/// # Errors
///
/// [`AdapterErrorKind::Settle`] when the settlement could not be confirmed, or did not finish
/// within [`SETTLE_TIMEOUT`]. The delivery has then been handed back to its queue (after
/// [`SETTLE_RETRY`]), and the broker delivers it again; the record makes it a duplicate.
pub async fn process<P>(
    consumer: &P,
    channel: &Channel,
    topology: &Topology,
    delivery: lapin::message::Delivery,
) -> Result<Disposition, AdapterError>
where
    P: Processor<AmqpMessage>,
{
    let pipeline = Pipeline::new(
        RabbitMq::new(channel.clone(), topology.clone()),
        topology.queue.clone(),
    );
    pipeline.process(consumer, &AmqpMessage::new(delivery)).await
}

/// Processes deliveries that arrived together with `consumer` as one batch
/// ([`Pipeline::process_batch`]: their keys claimed in one store round trip, their outcomes
/// recorded in one more), then settles each on `channel` as soon as its own outcome is
/// recorded. Answers, in order, what [`process`] answers for each.
pub async fn process_batch<P>(
    consumer: &P,
    channel: &Channel,
    topology: &Topology,
    deliveries: Vec<lapin::message::Delivery>,
) -> Vec<Result<Disposition, AdapterError>>
where
    P: Processor<AmqpMessage>,
{
    let pipeline = Pipeline::new(
        RabbitMq::new(channel.clone(), topology.clone()),
        topology.queue.clone(),
    );
    let messages: Vec<AmqpMessage> = deliveries.into_iter().map(AmqpMessage::new).collect();
    let batch: Vec<&AmqpMessage> = messages.iter().collect();
    pipeline.process_batch(consumer, &batch).await
}

/// Carries out `disposition`; see the [crate docs](crate).
///
/// # Errors
///
/// [`AdapterErrorKind::Settle`] when a publish was not confirmed or the ack could not be sent.
pub async fn settle(
    channel: &Channel,
    topology: &Topology,
    message: &AmqpMessage,
    disposition: &Disposition,
) -> Result<(), AdapterError> {
    let copy_to = |queue: &str, change: &dyn Fn(&mut FieldTable), expiration: Option<Duration>| {
        let mut headers = message.delivery.properties.headers().clone().unwrap_or_default();
        change(&mut headers);
        let mut properties = message.delivery.properties.clone().with_headers(headers);
        if let Some(after) = expiration {
            properties = properties.with_expiration(after.as_millis().max(1).to_string().into());
        }
        publish_confirmed(
            channel,
            Route::Queue,
            queue.to_owned(),
            message.delivery.data.clone(),
            properties,
            AdapterErrorKind::Settle,
        )
    };
    match disposition {
        Disposition::Ack => {}
        Disposition::Nack { after } => {
            let next = i32::try_from(message.deliveries.saturating_add(1)).unwrap_or(i32::MAX);
            copy_to(
                &topology.retry_queue,
                &|headers| {
                    headers.insert(DELIVERIES_HEADER.into(), AMQPValue::LongInt(next));
                },
                Some(*after),
            )
            .await?;
        }
        Disposition::DeadLetter { reason } => {
            copy_to(
                &topology.dead_queue,
                &|headers| {
                    for (name, value) in dead_letter_headers(&topology.queue, message.deliveries, reason) {
                        headers.insert(name.into(), AMQPValue::LongString(value.as_str().into()));
                    }
                },
                None,
            )
            .await?;
        }
    }
    message
        .delivery
        .ack(BasicAckOptions::default())
        .await
        .map(|_| ())
        .map_err(amqp(AdapterErrorKind::Settle, "acking a delivery"))
}

/// Where a publish goes: to a queue by its name (the worker's own copies: retries, dead
/// letters, replays), or to whatever an exchange routes it to.
#[derive(Debug, Clone, Copy)]
enum Route<'a> {
    /// The queue named by the routing key, through the default exchange, as mandatory: a
    /// queue that does not exist (deleted, expired) returns the message and the publish fails,
    /// instead of the broker confirming a message it dropped. The original is then not let go.
    Queue,
    /// An event: the application's exchange decides where it goes.
    Exchange(&'a str),
}

/// Publishes and waits for the broker's confirm; a failure is an error of `kind`.
async fn publish_confirmed(
    channel: &Channel,
    route: Route<'_>,
    routing_key: String,
    payload: Vec<u8>,
    properties: BasicProperties,
    kind: AdapterErrorKind,
) -> Result<(), AdapterError> {
    let failed = amqp(kind, "publishing");
    let (exchange, mandatory) = match route {
        Route::Queue => ("", true),
        Route::Exchange(exchange) => (exchange, false),
    };
    let options = BasicPublishOptions {
        mandatory,
        ..BasicPublishOptions::default()
    };
    let confirm = match channel
        .basic_publish(
            exchange.into(),
            routing_key.as_str().into(),
            options,
            &payload,
            properties,
        )
        .await
    {
        Ok(confirm) => confirm.await.map_err(failed)?,
        Err(error) => return Err(failed(error)),
    };
    if confirm.is_nack() {
        return Err(AdapterError::new(
            kind,
            BROKER,
            format!("the broker refused a publish to {routing_key} (nack)"),
        ));
    }
    if let Some(returned) = confirm.take_message() {
        return Err(AdapterError::new(
            kind,
            BROKER,
            format!(
                "no queue took the publish to {routing_key} ({} {}); is the queue there?",
                returned.reply_code, returned.reply_text
            ),
        ));
    }
    Ok(())
}

/// Publishes `payload` to `exchange` with `routing_key`, with `key` as the `Idempotency-Key`
/// header and the message id, persistent, and waits for the publisher confirm. The channel
/// must be in confirm mode. Through the default exchange (`""`), the routing key names a queue,
/// and a queue that does not exist fails the publish instead of losing the message.
///
/// # Errors
///
/// [`AdapterError`] when the publish was not confirmed, or no queue took it through the default
/// exchange; publishing again with the same key is safe.
pub async fn publish(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    key: &Key,
    payload: &[u8],
) -> Result<(), AdapterError> {
    publish_with_headers(channel, exchange, routing_key, key, payload, &[]).await
}

/// [`publish`] with more headers (as long strings) besides the `Idempotency-Key`.
///
/// # Errors
///
/// As [`publish`].
pub async fn publish_with_headers(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    key: &Key,
    payload: &[u8],
    more: &[(String, Vec<u8>)],
) -> Result<(), AdapterError> {
    let mut headers = FieldTable::default();
    for (name, value) in more {
        headers.insert(
            name.as_str().into(),
            AMQPValue::LongString(LongString::from(value.clone())),
        );
    }
    headers.insert(
        IDEMPOTENCY_KEY_HEADER.into(),
        AMQPValue::LongString(LongString::from(key.as_str())),
    );
    let properties = BasicProperties::default()
        .with_headers(headers)
        .with_message_id(key.as_str().into())
        .with_delivery_mode(2);
    // Through the default exchange the routing key names a queue: one that does not exist
    // must fail the publish (mandatory), not be confirmed and dropped. A named exchange decides
    // for itself; an event nobody is bound to is not an error.
    let route = if exchange.is_empty() {
        Route::Queue
    } else {
        Route::Exchange(exchange)
    };
    publish_confirmed(
        channel,
        route,
        routing_key.to_owned(),
        payload.to_vec(),
        properties,
        AdapterErrorKind::Publish,
    )
    .await
}
