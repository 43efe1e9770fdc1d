//! The JetStream adapter from the outside, in one test binary (one link instead of one per file):
//! the broker suite, JetStream's own cases and TLS.

mod jetstream;
mod suite;
mod tls;
