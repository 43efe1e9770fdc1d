//! The RabbitMQ adapter from the outside, in one test binary (one link instead of one per file):
//! the broker suite, RabbitMQ's own cases and TLS.

mod rabbitmq;
mod suite;
#[cfg(feature = "tls")]
mod tls;
