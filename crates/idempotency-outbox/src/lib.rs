//! The inbox and the transactional outbox on PostgreSQL (the outbox on MySQL too): one crate, since both are tables of the
//! same database with the same lifecycle (created under the project's migration lock, woken by
//! `LISTEN/NOTIFY` with polling as the fallback, cleaned up after a retention, inspected by
//! `idem inbox` and `idem outbox`).
//!
//! # The inbox
//!
//! A consumer stores each message before the broker is acknowledged, then handles it from the
//! table:
//!
//! 1. [`InboxReceiver`] (a [`Processor`](idempotency_consumer::Processor) for the RabbitMQ,
//!    NATS and Kafka workers) calls [`Inbox::receive`]: `INSERT … ON CONFLICT DO NOTHING` keyed
//!    by (consumer, idempotency key), with the payload, headers and fingerprint. The broker's
//!    message is acknowledged only once that insert committed; a duplicate is acknowledged too;
//!    a key stored with another payload, or a message without a usable key, is dead-lettered
//!    with the reason.
//! 2. [`InboxWorker`]s claim due rows in batches with `FOR UPDATE SKIP LOCKED` and run the
//!    [`InboxHandler`] in the transaction that marks each row processed: the handler's business
//!    writes commit with the mark, or not at all. A failure is recorded on the row (error text,
//!    attempt count) and retried after a backoff; past the limit, or on a fatal error, the row
//!    is `dead` until `idem inbox replay`.
//!
//! A crash at any point loses nothing (the message is acknowledged only once stored) and runs
//! nothing twice (the handler's writes and the processed mark are one transaction).
//!
//! # The outbox
//!
//! [`Outbox::enqueue`] writes an outgoing message in the caller's business transaction, so it
//! exists exactly when that transaction commits. A [`Relay`] publishes pending rows with a
//! [`Publisher`] that waits for the broker's acknowledgement, in id order per ordering key, and
//! marks them sent. Every message carries `<outbox>:<id>` as its `Idempotency-Key`: a relay that
//! crashes between publishing and marking publishes again, and the consumer's record answers
//! the copy. Publishers: [`AmqpPublisher`] (RabbitMQ, publisher confirms), [`NatsPublisher`]
//! (JetStream acks, the key as `Nats-Msg-Id` too), with the `kafka` feature `KafkaPublisher`
//! (an idempotent producer, the ordering key as the record key), and with the `sqs` feature
//! `SqsPublisher` (the key as an attribute and a FIFO queue's deduplication id).
//!
//! **On MySQL and MariaDB** (the `mysql` feature) the outbox is the same table and the same
//! relay: [`Outbox::enqueue`] takes a MySQL transaction, [`Relay::new`] and the operations
//! functions a `MySqlPool` (any [`Database`]); groups are held with named locks, and relays poll
//! since MySQL has no notifications. The inbox stays on PostgreSQL.
//!
//! # Operations
//!
//! [`inbox_list`], [`inbox_show`], [`inbox_replay`], [`inbox_purge`], [`inbox_stats`],
//! [`outbox_list`] and [`outbox_stats`] are what `idem inbox` and `idem outbox` run. The workers
//! and relays refresh gauges of the backlog, its oldest age and the dead rows, and count what
//! they receive, handle, publish and fail to publish (`docs/OPERATIONS.md` lists the metrics).

/// The outbox and inbox guide (`docs/OUTBOX.md`): the outbox table any language writes to,
/// the relay's guarantees, the destinations, the inbox, and `idem relay`.
#[doc = include_str!("../../../docs/OUTBOX.md")]
pub mod guide {}

mod admin;
mod database;
mod dialect;
mod headers;
mod inbox;
mod inbox_worker;
#[cfg(feature = "mysql")]
mod mysql;
mod outbox;
mod postgres;
mod schema;
mod wake;

pub use admin::{
    InboxRow, InboxState, InboxStats, UnknownInboxState, inbox_list, inbox_purge, inbox_replay, inbox_show,
    inbox_stats, outbox_list, outbox_purge_dead, outbox_replay, outbox_stats, purge_sent,
};
pub use database::Database;
pub use dialect::{OutboxRow, OutboxStats};
pub use inbox::{Inbox, InboxHandler, InboxMessage, InboxReceiver, Received, RetryPolicy};
pub use inbox_worker::InboxWorker;
pub use outbox::{
    DEFAULT_MAX_ATTEMPTS, Outbox, OutboxConnection, OutboxMessage, OutgoingMessage, Publisher, Relay,
};
pub use schema::{OUTBOX_VERSION, SCHEMA_VERSION, Tables};

mod amqp;
pub use amqp::AmqpPublisher;
mod nats;
pub use nats::NatsPublisher;
#[cfg(feature = "kafka")]
mod kafka;
#[cfg(feature = "kafka")]
pub use kafka::KafkaPublisher;
#[cfg(feature = "sqs")]
mod sqs;
#[cfg(feature = "sqs")]
pub use sqs::SqsPublisher;

use idempotency_postgres::sqlx;

/// What went wrong in the inbox or the outbox.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// A table is missing, or carries another version's mark.
    #[error("{0}")]
    Schema(String),
    /// A statement failed.
    #[error("PostgreSQL: {what}: {source}")]
    Database {
        /// What was being done.
        what: &'static str,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// A MySQL or MariaDB statement failed.
    #[cfg(feature = "mysql")]
    #[error("MySQL: {what}: {source}")]
    MySql {
        /// What was being done.
        what: &'static str,
        /// The driver's error.
        #[source]
        source: idempotency_mysql::sqlx::Error,
    },
    /// A setting or an argument is invalid.
    #[error("{0}")]
    Invalid(String),
    /// A destination that does not exist or could not be asked about (a subject no stream
    /// captures, a topic the brokers do not have).
    #[error("{0}")]
    Destination(String),
    /// The broker refused or did not acknowledge every message of a relay round.
    #[error("publishing failed: {0}")]
    Publish(String),
}

impl OutboxError {
    /// Wraps a driver error with what was being done.
    pub(crate) fn db(what: &'static str) -> impl FnOnce(sqlx::Error) -> Self {
        move |source| Self::Database { what, source }
    }
}
