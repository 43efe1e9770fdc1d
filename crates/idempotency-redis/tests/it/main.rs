//! The Redis store from the outside, in one test binary (one link instead of one per file): the
//! conformance suite, batching, fencing, lost replies, a restart, TLS and bad input, each a module.

mod common;

mod bad_input;
mod batching;
mod conformance;
mod fencing;
mod lost_reply;
mod restart;
#[cfg(feature = "tls")]
mod tls;
