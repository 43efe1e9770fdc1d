//! What can go wrong in the `idem` commands, as one typed error.

use idempotency::StoreError;
use idempotency_consumer::adapter::AdapterError;

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
    /// `idem keys release|forget|complete` changed nothing: the record is not in a state the
    /// action applies to, or it changed while the action ran.
    #[error("idem keys {action} {key}: {why}")]
    Refused {
        /// The action.
        action: &'static str,
        /// The key.
        key: String,
        /// Why, and what to do instead.
        why: String,
    },
    /// A change to a record was not confirmed (`--yes`, or `y` on a terminal).
    #[error("{0}")]
    Unconfirmed(String),
    /// A command-line value is not valid (the message names the flag).
    #[error("{0}")]
    Usage(String),
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
    /// The dashboard's settings are refused.
    #[error(transparent)]
    Ui(#[from] UiError),
    /// A TLS setting cannot be used (the message names the file or flag and why).
    #[error("TLS: {0}")]
    Tls(#[from] crate::tls::TlsError),
    /// The metrics recorder could not be installed.
    #[error("metrics: {0}")]
    Metrics(#[source] metrics_exporter_prometheus::BuildError),
    /// The upstream URL is not one the gateway can forward to.
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// `idem consume` cannot consume from its source or call its handler.
    #[error(transparent)]
    Consume(#[from] ConsumeError),
    /// `idem probe` got no `2xx` answer.
    #[error("probe {url}: {why}")]
    Probe {
        /// The URL, its password redacted.
        url: String,
        /// What it got instead.
        why: String,
    },
    /// The demo's temporary directory could not be created.
    #[error("a temporary directory for the demo's store: {0}")]
    TempDir(#[source] std::io::Error),
    /// A client task of the demo failed.
    #[error("a client task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// `idem dlq` could not read or settle a source's dead letters.
    #[error("dead letters of {from}: {error}")]
    DeadLetters {
        /// The source URL, its password redacted.
        from: String,
        /// What went wrong.
        #[source]
        error: AdapterError,
    },
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

/// Why an upstream URL is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UpstreamError {
    /// Not a URL at all.
    #[error("`{text}` is not a URL: {reason}")]
    NotAUrl {
        /// What was given.
        text: String,
        /// The URI parser's message (its error type is not `Clone`).
        reason: String,
    },
    /// Any scheme but `http://` and `https://`.
    #[error("`{0}`: the upstream must be an http:// or https:// URL")]
    NotHttp(String),
    /// An `https://` upstream that TLS cannot be set up for (the reason names the file or the
    /// host).
    #[error("{0}")]
    Tls(String),
    /// No host.
    #[error("`{0}`: the upstream URL has no host")]
    NoHost(String),
    /// A query string.
    #[error("`{0}`: the upstream URL must not have a query")]
    Query(String),
}

/// A source `idem consume` cannot consume from, or a handler URL it cannot call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumeError {
    /// `--from` is not a URL of a source this build consumes from.
    #[error("--from {from}: {}", .error.message())]
    Source {
        /// The URL, its password redacted.
        from: String,
        /// Why, as the source's parser says.
        #[source]
        error: AdapterError,
    },
    /// `--to` is not an `http://` URL.
    #[error("--to {to}: {why}")]
    Handler {
        /// The URL, its password redacted.
        to: String,
        /// Why.
        why: String,
    },
    /// The broker could not be reached at start, or refused the consumer's setup (a queue
    /// declared with other arguments, a topic that does not exist).
    #[error("--from {from}: {error}")]
    Broker {
        /// The URL, its password redacted.
        from: String,
        /// What the broker's adapter says, with its kind.
        #[source]
        error: AdapterError,
    },
    /// `--help-source` names no source this build has.
    #[error("--help-source {name}: no such source (this build has: {known})")]
    UnknownSource {
        /// The name given.
        name: String,
        /// The names of the sources this build has.
        known: String,
    },
}

/// Why the dashboard cannot start as configured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UiError {
    /// `--ui` without `--admin-listen`: the dashboard is served on the admin listener only.
    #[error(
        "--ui needs --admin-listen: the dashboard is served on the admin listener, apart from the traffic"
    )]
    NoAdminListener,
    /// No token, and an address other hosts can reach.
    #[error(
        "--ui on {0}: without --admin-token (or IDEM_ADMIN_TOKEN_FILE) the dashboard listens on a loopback address only"
    )]
    NoToken(std::net::SocketAddr),
}
