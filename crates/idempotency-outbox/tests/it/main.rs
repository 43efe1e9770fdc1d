//! The inbox and the outbox from the outside, in one test binary (one link instead of one per
//! file): transactions, relays and their crashes, publishers, metrics and MySQL, each a module.

mod common;

mod crash;
mod inbox;
mod metrics;
mod mysql;
mod outbox;
mod publishers;
