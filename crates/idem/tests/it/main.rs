//! `idem` from the outside, in one test binary (one link instead of one per file): each
//! module is one area (the gateway, the consumers, the relay, the operations commands, the
//! dashboard, TLS, the deployment files), and `common` the processes and servers they share.
//! `cargo nextest run -p idem -E 'test(/^relay::/)'` runs one area.

mod common;

mod boxes;
mod config;
mod consume;
#[cfg(feature = "kafka")]
mod consume_kafka;
mod consume_nats;
#[cfg(feature = "sqs")]
mod consume_sqs;
mod crash;
mod demo;
mod deploy;
mod first_start;
mod hostile_clients;
mod key_actions;
mod logs;
mod ops;
mod probes;
mod readme;
mod reconcile;
mod relay;
mod serve;
mod tls;
mod traces;
mod trust;
mod ui;
mod upstream_faults;

/// The upstream process the gateway tests start: this binary again, run with `--exact
/// --ignored` on this name ([`common::start_upstream`]).
#[test]
#[ignore = "helper: the upstream process the gateway tests start"]
fn upstream_process() {
    common::upstream_child();
}
