//! The SQS adapter from the outside, in one test binary (one link instead of one per file): the
//! broker suite and the worker, on the local AWS server.

mod common;

mod suite;
mod worker;
