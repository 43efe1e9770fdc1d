//! The `idem` binary's parts, as a library for its tests and for embedding:
//!
//! * [`cli`]: the command line, each command given to the module that owns it;
//! * [`gateway`]: the idempotency gateway (`idem serve`), a reverse proxy with the HTTP layer in
//!   front of any upstream;
//! * [`consume`]: `idem consume`, a broker's messages to an HTTP handler, on a registry of
//!   sources;
//! * [`flags`]: the flags' parsers; [`config_file`]: `idem serve --config FILE` (settings and
//!   routes in TOML); [`admin`]: the `/healthz` and `/metrics` endpoints;
//! * [`server`]: the gateway's HTTP/1 server, with the limits untrusted clients need;
//! * [`tls`]: TLS for the listener (reloaded on `SIGHUP`) and for `https://` upstreams and handlers;
//! * [`telemetry`]: OpenTelemetry traces (OTLP export, `traceparent` in and out);
//! * [`demo`]: the payments demo (`idem demo`);
//! * [`ops`]: the operations commands, each with its arguments: `idem keys …`, `idem
//!   inflight`, `idem migrate`, an operator's changes to one key, `idem inbox|outbox …` and
//!   `idem dlq …`;
//! * [`relay`]: `idem relay`, the outbox relay for services in any language;
//! * [`ui`]: the dashboard (`--ui`) of the gateway and of `idem consume`;
//! * [`units`]: human durations and sizes as the flags take them;
//! * [`placeholder`]: a `{key}` or `{destination}` put into a URL, encoded only as it must be;
//! * [`probe`]: `idem probe URL`, a health check for an image without a shell;
//! * [`error`]: what can go wrong, as one typed [`Error`].

pub use error::Error;
/// Human durations and sizes as the flags take them (core's, shared with the broker URLs).
pub use idempotency_core::units;

/// The guides of the `idem` binary's operators, as part of these docs.
pub mod guide {
    /// Deploying `idem` (`docs/DEPLOYING.md`): the image, the gateway as a sidecar, probes,
    /// secrets, logs and traces, with the manifests under `deploy/`.
    #[doc = include_str!("../../../docs/DEPLOYING.md")]
    pub mod deploying {}

    /// Operating `idem` (`docs/OPERATIONS.md`): metrics, alerts, the dashboard, and changing
    /// one key after an incident.
    #[doc = include_str!("../../../docs/OPERATIONS.md")]
    pub mod operations {}

    /// TLS on every connection (`docs/TLS.md`): how each is set, its default and its test.
    #[doc = include_str!("../../../docs/TLS.md")]
    pub mod tls {}
}

pub mod admin;
pub mod cli;
pub mod config_file;
pub mod consume;
pub mod demo;
pub mod error;
pub mod flags;
pub mod gateway;
pub mod ops;
pub mod placeholder;
pub mod probe;
pub mod reconcile;
pub mod relay;
pub mod server;
pub mod telemetry;
pub mod tls;
pub mod ui;
