//! What every broker adapter shares: the per-message [`Pipeline`] and the [`AdapterError`].
//!
//! A broker crate (RabbitMQ, NATS JetStream, Kafka, SQS) owns its fetch loop: how messages
//! arrive, how many at once, in which order, how offsets or receipts are tracked. What happens
//! to *one* message once it has arrived is the same on every broker, and lives here:
//!
//! 1. the [`Processor`](crate::Processor) decides its [`Disposition`](crate::Disposition); a
//!    processor that panics (the consumer core catches its handler's panics, this catches any
//!    other processor's) is a nack, never a dead worker;
//! 2. while it decides, the broker's hold on the message is kept alive at the broker's interval
//!    ([`Broker::keep_alive`]: JetStream progress acks, SQS visibility extensions), so that a
//!    long handler does not see its message handed to another consumer;
//! 3. the disposition is carried out ([`Broker::settle`]) within a bound
//!    ([`Pipeline::settle_timeout`], 10 s by default): on a connection that died an ack or a
//!    publisher confirm may never answer, and a worker waiting for it would never move on. A
//!    settlement that fails or times out is an [`AdapterError`] of kind
//!    [`AdapterErrorKind::Settle`]: the message was not acknowledged, the broker delivers it
//!    again, and the record answers the redelivery;
//! 4. every settlement is counted, with one metric family for every broker.
//!
//! A broker implements [`Broker`] for its message type: three methods, of which two have
//! defaults. `docs/WRITING-AN-ADAPTER.md` describes the whole contract and the test kit's
//! broker suite that checks it.
//!
//! # Metrics
//!
//! Labelled with the worker's name (`consumer`) and the broker's ([`Broker::NAME`]):
//! `idempotency_consumer_settled_total{consumer, broker, result}` (`acked`, `nacked`,
//! `dead_lettered`, `failed`), the histogram `idempotency_consumer_settle_duration_seconds{consumer,
//! broker}`, `idempotency_consumer_keep_alives_total{consumer, broker, result}` (`ok`,
//! `failed`) and `idempotency_consumer_processor_panics_total{consumer, broker}`.

mod broker;
mod pipeline;

pub use broker::{AdapterError, AdapterErrorKind, Broker, DEFAULT_SETTLE_TIMEOUT, PANIC_RETRY, retry_set_up};
pub use pipeline::{BatchPlan, Flow, Pipeline, batches};
