//! The Kafka adapter from the outside, in one test binary (one link instead of one per file): the
//! broker suite, the worker, the mock cluster and same-transaction mode.

mod common;

mod mock_cluster;
mod same_transaction;
mod suite;
mod worker;
