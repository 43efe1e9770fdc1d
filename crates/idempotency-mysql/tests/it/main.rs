//! The MySQL/MariaDB store from the outside, in one test binary (one link instead of one per
//! file): the conformance suite, connection loss, deadlocks, races, round trips, same-transaction
//! mode, TLS and bad input, each a module, on the server `MYSQL_URL` names.

mod common;

mod bad_input;
mod conformance;
mod connection_loss;
mod deadlock;
mod races;
mod reads_write_nothing;
mod round_trips;
mod same_transaction;
#[cfg(feature = "tls")]
mod tls;
