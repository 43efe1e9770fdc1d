//! The DynamoDB store from the outside, in one test binary (one link instead of one per file): the
//! conformance suite, clock skew, large outcomes, outages and TLS, on the local AWS server.

mod common;

mod clock_skew;
mod conformance;
mod large_outcomes;
mod outage;
mod tls;
