//! Store options and the `sqlite:` URL.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{Access, Clock, ErrorKind, StoreError, SystemClock, redact_url};

/// Where the database lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A database file (created if missing; its directory must exist).
    File(PathBuf),
    /// A private in-memory database, gone when the store is dropped.
    Memory,
}

/// SQLite's `synchronous` setting: how hard each commit is pushed to disk.
///
/// Both survive a crash of the *process* (a committed transaction is in the WAL file, which the
/// kernel holds). They differ on power loss or an operating-system crash: with `Normal`, the last
/// commits before the loss may be rolled back, and a duplicate arriving after the reboot would run
/// again. `Full` (the default) syncs the WAL on every commit and closes that window, at the cost
/// of one `fsync` per write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Synchronous {
    /// `PRAGMA synchronous = FULL`: every commit is durable on return (the default).
    #[default]
    Full,
    /// `PRAGMA synchronous = NORMAL`: commits survive a process crash; the last few may be lost
    /// on power loss.
    Normal,
}

impl Synchronous {
    pub(crate) fn pragma(self) -> &'static str {
        match self {
            Self::Full => "FULL",
            Self::Normal => "NORMAL",
        }
    }
}

/// How to open a [`crate::SqliteStore`].
///
/// ```
/// use std::time::Duration;
/// use idempotency_sqlite::{Location, SqliteOptions, Synchronous};
///
/// let options = SqliteOptions::from_url("sqlite://idem.db?synchronous=normal&busy_timeout_ms=2000")?;
/// assert_eq!(options.location, Location::File("idem.db".into()));
/// assert_eq!(options.synchronous, Synchronous::Normal);
/// assert_eq!(options.busy_timeout, Duration::from_secs(2));
///
/// assert!(SqliteOptions::from_url("postgres://localhost/db").is_err());
/// # Ok::<(), idempotency_core::StoreError>(())
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SqliteOptions {
    /// Where the database lives.
    pub location: Location,
    /// How hard commits are pushed to disk.
    pub synchronous: Synchronous,
    /// How long a write waits for another process's write lock before failing with a retryable
    /// [`ErrorKind::Timeout`] (default 5 s).
    pub busy_timeout: Duration,
    /// The store's clock (default: the system clock). Every instance sharing a file must read
    /// the same clock; on one host the system clock is that clock.
    pub clock: Arc<dyn Clock>,
    /// What opening may do to the file (default [`Access::Create`]). With
    /// [`Access::ReadOnly`] the file is opened read-only and no pragma that writes is run; with
    /// it and [`Access::Existing`], a missing file or one that is not a store of ours is refused
    /// before anything is written.
    pub access: Access,
    /// How many state transitions (`begin`, `complete`, `release`, `extend`) may share one write
    /// transaction, and so one fsync (default [`DEFAULT_MAX_BATCH`]); 1 gives each its own. See
    /// [`SqliteStore`](crate::SqliteStore)'s group commit.
    pub max_batch: usize,
}

/// How many transitions share a write transaction by default: enough that a burst of callers
/// shares a few fsyncs, few enough that the last of them waits for no more than a few
/// milliseconds of statements.
pub const DEFAULT_MAX_BATCH: usize = 64;

/// The most a URL or a caller may set [`SqliteOptions::max_batch`] to.
pub const MAX_BATCH_LIMIT: usize = 1024;

impl SqliteOptions {
    /// Options for a database file at `path`.
    #[must_use]
    pub fn file(path: impl Into<PathBuf>) -> Self {
        Self::at(Location::File(path.into()))
    }

    /// Options for a private in-memory database.
    #[must_use]
    pub fn memory() -> Self {
        Self::at(Location::Memory)
    }

    fn at(location: Location) -> Self {
        Self {
            location,
            synchronous: Synchronous::default(),
            busy_timeout: Duration::from_secs(5),
            clock: Arc::new(SystemClock),
            access: Access::Create,
            max_batch: DEFAULT_MAX_BATCH,
        }
    }

    /// Parses a store URL:
    ///
    /// * `sqlite://PATH` or `sqlite:PATH` — a file; `sqlite:///var/lib/idem.db` is absolute,
    ///   `sqlite://idem.db` is relative to the working directory;
    /// * `sqlite::memory:` or `sqlite://:memory:` — a private in-memory database.
    ///
    /// Query parameters: `synchronous=full|normal`, `busy_timeout_ms=N`, `max_batch=N` (1 to
    /// 1024 transitions a write transaction; 1 turns group commit off).
    ///
    /// The path and the parameters are percent-decoded (`sqlite:///srv/my%20data/idem.db` is the
    /// file `/srv/my data/idem.db`), with the URL crate family's decoders. The split into path
    /// and query stays hand-written: `sqlite://idem.db` names a file relative to the working
    /// directory, where a generic URL parser would read `idem.db` as a host.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::InvalidConfig`] naming what is wrong: another scheme, an empty path, an
    /// unknown parameter or a bad value.
    pub fn from_url(url: &str) -> Result<Self, StoreError> {
        // Errors show the URL without credential-like parameters, which may hold secrets.
        let shown = redact_url(url);
        let rest = url
            .strip_prefix("sqlite:")
            .ok_or_else(|| invalid(format!("`{}` is not a sqlite: URL", redact_url(url))))?;
        let rest = rest.strip_prefix("//").unwrap_or(rest);
        let (path, query) = match rest.split_once('?') {
            Some((path, query)) => (path, Some(query)),
            None => (rest, None),
        };
        let path = percent_encoding::percent_decode_str(path)
            .decode_utf8()
            .map_err(|_| invalid(format!("`{shown}`: the path is not UTF-8 once percent-decoded")))?;
        let mut options = match &*path {
            "" => return Err(invalid(format!("`{shown}` names no database file"))),
            ":memory:" => Self::memory(),
            path => Self::file(path),
        };
        for (name, value) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
            match &*name {
                "synchronous" => {
                    options.synchronous = match value.to_ascii_lowercase().as_str() {
                        "full" => Synchronous::Full,
                        "normal" => Synchronous::Normal,
                        _ => {
                            return Err(invalid(format!(
                                "synchronous={value:?} in `{shown}`: expected `full` or `normal`"
                            )));
                        }
                    }
                }
                "busy_timeout_ms" => {
                    let millis: u64 = value.parse().map_err(|_| {
                        invalid(format!(
                            "busy_timeout_ms={value:?} in `{shown}`: expected a number of milliseconds"
                        ))
                    })?;
                    options.busy_timeout = Duration::from_millis(millis);
                }
                "max_batch" => {
                    let batch = value
                        .parse::<usize>()
                        .ok()
                        .filter(|n| (1..=MAX_BATCH_LIMIT).contains(n))
                        .ok_or_else(|| {
                            invalid(format!(
                                "max_batch={value:?} in `{shown}`: expected 1 to {MAX_BATCH_LIMIT} transitions a transaction"
                            ))
                        })?;
                    options.max_batch = batch;
                }
                other => {
                    return Err(invalid(format!(
                        "unknown parameter `{other}` in `{shown}` (known: synchronous, busy_timeout_ms, max_batch)"
                    )));
                }
            }
        }
        Ok(options)
    }

    /// Sets the `synchronous` level.
    #[must_use]
    pub fn synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// Sets the busy timeout.
    #[must_use]
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Sets what opening may do to the file.
    #[must_use]
    pub fn access(mut self, access: Access) -> Self {
        self.access = access;
        self
    }

    /// Sets how many transitions may share a write transaction (clamped to 1..=1024); 1 gives
    /// each its own transaction and fsync.
    #[must_use]
    pub fn max_batch(mut self, batch: usize) -> Self {
        self.max_batch = batch.clamp(1, MAX_BATCH_LIMIT);
        self
    }

    /// Sets the clock (tests use a `ManualClock`).
    #[must_use]
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }
}

fn invalid(message: String) -> StoreError {
    StoreError::new(ErrorKind::InvalidConfig, message)
}

idempotency_core::url_store_kind! {
    /// `sqlite://PATH` and `sqlite::memory:` URLs (see [`SqliteOptions::from_url`]), for a
    /// [`Registry`](idempotency_core::Registry).
    name: "sqlite",
    schemes: &["sqlite"],
    example: "sqlite://PATH",
    options: SqliteOptions,
    open: crate::SqliteStore::open_with,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_file_and_memory_urls() {
        let cases = [
            ("sqlite://idem.db", Location::File("idem.db".into())),
            ("sqlite:idem.db", Location::File("idem.db".into())),
            (
                "sqlite:///var/lib/idem.db",
                Location::File("/var/lib/idem.db".into()),
            ),
            ("sqlite::memory:", Location::Memory),
            ("sqlite://:memory:", Location::Memory),
        ];
        for (url, location) in cases {
            let options = SqliteOptions::from_url(url).unwrap();
            assert_eq!(options.location, location, "{url}");
            assert_eq!(options.synchronous, Synchronous::Full, "{url}");
        }
    }

    #[test]
    fn decodes_percent_escapes_in_the_path_and_the_parameters() {
        let options =
            SqliteOptions::from_url("sqlite:///srv/my%20data/idem%23.db?synchronous=%4Eormal").unwrap();
        assert_eq!(options.location, Location::File("/srv/my data/idem#.db".into()));
        assert_eq!(options.synchronous, Synchronous::Normal);
        let error = SqliteOptions::from_url("sqlite:///srv/%FF.db").unwrap_err();
        assert!(error.to_string().contains("not UTF-8"), "{error}");
    }

    #[test]
    fn parses_parameters() {
        let options =
            SqliteOptions::from_url("sqlite://x.db?synchronous=NORMAL&busy_timeout_ms=250").unwrap();
        assert_eq!(options.synchronous, Synchronous::Normal);
        assert_eq!(options.busy_timeout, Duration::from_millis(250));
    }

    #[test]
    fn rejects_malformed_urls_with_clear_messages() {
        let cases = [
            ("postgres://user:secret@db/app", "is not a sqlite: URL"),
            ("idem.db", "is not a sqlite: URL"),
            ("sqlite://", "names no database file"),
            ("sqlite:", "names no database file"),
            ("sqlite://x.db?synchronous=off", "expected `full` or `normal`"),
            (
                "sqlite://x.db?busy_timeout_ms=soon",
                "expected a number of milliseconds",
            ),
            ("sqlite://x.db?journal=delete", "unknown parameter `journal`"),
            ("sqlite://x.db?max_batch=0", "expected 1 to 1024"),
            ("sqlite://x.db?max_batch=5000", "expected 1 to 1024"),
            ("sqlite://x.db?max_batch=many", "expected 1 to 1024"),
            ("sqlite://x.db?password=s3cret", "unknown parameter `password`"),
            (
                "sqlite://x.db?synchronous=off&api_key=s3cret",
                "expected `full` or `normal`",
            ),
        ];
        for (url, expected) in cases {
            let error = SqliteOptions::from_url(url).unwrap_err();
            assert_eq!(error.kind(), ErrorKind::InvalidConfig, "{url}");
            assert!(error.to_string().contains(expected), "{url}: {error}");
            assert!(
                !error.to_string().contains("s3cret"),
                "a secret is echoed: {error}"
            );
        }
        let error = SqliteOptions::from_url("postgres://user:secret@db/app").unwrap_err();
        assert!(
            !error.to_string().contains("secret"),
            "credentials leaked: {error}"
        );
    }
}
