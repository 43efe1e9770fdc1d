//! What can go wrong in the `idem` commands, as one typed error.

use idempotency::StoreError;

use crate::gateway::UpstreamError;

/// A failed `idem` command; its message is what the user reads after `idem: error:`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The store could not be opened (the URL is shown with its password redacted).
    #[error("store {url}: {source}")]
    Open {
        /// The redacted store URL.
        url: String,
        /// Why.
        #[source]
        source: StoreError,
    },
    /// A store operation failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// `idem keys get` found no record.
    #[error("no record for key {key} in scope {scope:?}")]
    NoRecord {
        /// The key asked for.
        key: String,
        /// Its scope.
        scope: String,
    },
    /// A key or scope given on the command line is not valid.
    #[error("invalid {what} `{text}`: {source}")]
    Invalid {
        /// `key` or `scope`.
        what: &'static str,
        /// What was given.
        text: String,
        /// Why it is invalid.
        #[source]
        source: idempotency::KeyError,
    },
    /// The demo could not set itself up.
    #[error("the demo could not start: {0}")]
    Demo(String),
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The metrics recorder could not be installed.
    #[error("metrics: {0}")]
    Metrics(#[source] metrics_exporter_prometheus::BuildError),
    /// The upstream URL is not one the gateway can forward to.
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// `idem consume` cannot consume from its source or call its handler.
    #[error(transparent)]
    Consume(#[from] crate::consume::ConsumeError),
    /// The demo's temporary directory could not be created.
    #[error("a temporary directory for the demo's store: {0}")]
    TempDir(#[source] std::io::Error),
    /// A client task of the demo failed.
    #[error("a client task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// An inbox or outbox command failed (the database URL is shown with its password
    /// redacted).
    #[error("{0}")]
    Boxes(String),
    /// An inbox or outbox operation failed.
    #[error(transparent)]
    Outbox(#[from] idempotency_outbox::OutboxError),
    /// The demo's ledger shows double charges (the report, then the verdict).
    #[error("{report}\nthe upstream's ledger shows double charges")]
    DoubleCharges {
        /// The demo's report.
        report: String,
    },
}

impl Error {
    /// The error of opening the store at `url`, with the URL's password redacted.
    #[must_use]
    pub fn open(url: &str, source: StoreError) -> Self {
        Self::Open {
            url: idempotency::redact_url(url),
            source,
        }
    }
}
