//! The `Store` contract and its error type.
//!
//! The contract is split in two small capability traits: [`Store`], the protocol every edge (HTTP
//! layer, consumer, gateway) drives, and [`StoreAdmin`], the inspection and cleanup operations the
//! operations CLI needs. Every store passes the conformance suite in `idempotency-testkit`.

use std::borrow::Cow;
use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::{
    BeginRequest, Claim, Fenced, Held, Key, ListFilter, Outcome, Record, RecordSummary, Scope, Stats,
    Timestamp, Token,
};

/// The class of a [`StoreError`], for deciding what to do about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The store URL or options are invalid; retrying cannot help.
    InvalidConfig,
    /// The store cannot be reached or the connection broke; retry later.
    Unavailable,
    /// The store did not answer in time, or is busy; retry later.
    Timeout,
    /// The store's data is damaged or is not a store of ours.
    Corrupt,
    /// The store refuses writes (read-only file, read-only replica, permissions).
    ReadOnly,
    /// The store's schema is missing or from an incompatible version.
    Schema,
    /// The store answered something this client does not understand (for example a value of the
    /// wrong type at a record's location).
    Protocol,
    /// Anything else the backend reported.
    Backend,
    /// The store is saturated and shed this call to keep capacity for the attempts already
    /// running (see [`crate::Lanes`]); nothing was done. Come back later: the caller is told to,
    /// rather than retrying at once and adding to the load.
    Overloaded,
}

impl ErrorKind {
    /// A short lowercase name, stable for logs and metrics labels.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::InvalidConfig => "invalid_config",
            Self::Unavailable => "unavailable",
            Self::Timeout => "timeout",
            Self::Corrupt => "corrupt",
            Self::ReadOnly => "read_only",
            Self::Schema => "schema",
            Self::Protocol => "protocol",
            Self::Backend => "backend",
            Self::Overloaded => "overloaded",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failure of the store itself (as opposed to a protocol answer such as `LeaseLost`).
///
/// When a store operation fails, its effect is unknown to the caller: edges fail closed (HTTP
/// `503`, consumers nack) and never treat an error as "not a duplicate".
///
/// ```
/// use idempotency_core::{ErrorKind, StoreError};
///
/// let err = StoreError::new(ErrorKind::Unavailable, "connection refused");
/// assert!(err.is_retryable());
/// assert_eq!(err.to_string(), "store unavailable: connection refused");
/// ```
pub struct StoreError {
    kind: ErrorKind,
    message: Cow<'static, str>,
    source: Option<Arc<dyn StdError + Send + Sync + 'static>>,
}

impl StoreError {
    /// An error of `kind` with a message for humans.
    pub fn new(kind: ErrorKind, message: impl Into<Cow<'static, str>>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// Attaches the underlying error.
    #[must_use]
    pub fn with_source(mut self, source: impl StdError + Send + Sync + 'static) -> Self {
        self.source = Some(Arc::new(source));
        self
    }

    /// The class of the error.
    #[must_use]
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message, without the kind prefix.
    #[must_use]
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether retrying the same operation later may succeed (the store was unreachable, busy or
    /// slow).
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        matches!(self.kind, ErrorKind::Unavailable | ErrorKind::Timeout)
    }
}

impl Clone for StoreError {
    fn clone(&self) -> Self {
        Self {
            kind: self.kind,
            message: self.message.clone(),
            source: self.source.clone(),
        }
    }
}

impl fmt::Debug for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreError")
            .field("kind", &self.kind)
            .field("message", &self.message)
            .field("source", &self.source)
            .finish()
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            ErrorKind::InvalidConfig => "invalid store configuration",
            ErrorKind::Unavailable => "store unavailable",
            ErrorKind::Timeout => "store timed out",
            ErrorKind::Corrupt => "store data is corrupt",
            ErrorKind::ReadOnly => "store is read-only",
            ErrorKind::Schema => "store schema error",
            ErrorKind::Protocol => "unexpected data in store",
            ErrorKind::Backend => "store error",
            ErrorKind::Overloaded => "store overloaded",
        };
        write!(f, "{what}: {}", self.message)
    }
}

impl StdError for StoreError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|source| source as &(dyn StdError + 'static))
    }
}

/// A store URL fit for error messages and logs: the password in the authority, and the value
/// of every query parameter that carries a credential (`password`, `pass`, `sslpassword`,
/// `sslkey`, tokens, secrets, API and access keys), replaced by `***`.
///
/// The userinfo is taken to end at the **last** `@`, so a password with an unescaped `/`, `?`
/// or `#` is hidden whole. This errs on the side of hiding: a URL that also has an `@` in its
/// path or query may show less of its host than it could, never a secret. The URL is not
/// parsed with a URL parser on purpose: the URLs that most need redacting are the ones a parser
/// refuses, in the error that says so.
///
/// ```
/// use idempotency_core::redact_url;
///
/// assert_eq!(redact_url("postgres://app:s3cret@db:5432/orders?x=1"), "postgres://app:***@db:5432/orders?x=1");
/// assert_eq!(redact_url("postgres://db/orders?user=app&password=s3cret"), "postgres://db/orders?user=app&password=***");
/// assert_eq!(redact_url("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
/// assert_eq!(redact_url("redis+unix:///run/redis.sock?db=1&pass=s3cret"), "redis+unix:///run/redis.sock?db=1&pass=***");
/// assert_eq!(redact_url("admin:s3cret@db/app"), "admin:***@db/app"); // no scheme
/// assert_eq!(redact_url("postgres://db/app?password=p@ss&x=1"), "postgres://db/app?password=***&x=1");
/// assert_eq!(redact_url("postgres://app:pa?ss@db/app"), "postgres://app:***@db/app");
/// ```
#[must_use]
pub fn redact_url(url: &str) -> String {
    // A `://` counts only after a scheme (RFC 3986: a letter, then letters, digits, `+`, `-`,
    // `.`): in `db?password=…&next=http://x` it belongs to a parameter's value.
    let start = match url.find("://") {
        Some(at) if is_scheme(&url[..at]) => at + 3,
        _ => 0,
    };
    let rest = &url[start..];
    // Two readings of where secrets are, both masked. A password written without escaping may
    // hold `/`, `?` or `@`, so the userinfo runs to the *last* `@`; and a credential parameter's
    // value may hold an `@` too, so the query (from the first `?`) is read on its own, each
    // value running to the next `&`.
    let mut masked: Vec<(usize, usize)> = Vec::new();
    if let Some(at) = rest.rfind('@')
        && let Some(colon) = rest[..at].find(':')
    {
        masked.push((start + colon + 1, start + at));
    }
    if let Some(question) = rest.find('?') {
        let mut offset = start + question + 1;
        for pair in url[offset..].split('&') {
            if let Some((name, _)) = pair.split_once('=')
                && is_credential(name)
            {
                masked.push((offset + name.len() + 1, offset + pair.len()));
            }
            offset += pair.len() + 1;
        }
    }
    masked.sort_unstable();
    let mut out = String::with_capacity(url.len());
    let mut at = 0;
    let mut masking = false;
    for (from, to) in masked {
        if masking && from < at {
            // Overlaps the secret just masked: one mask covers both.
            at = at.max(to);
            continue;
        }
        out.push_str(&url[at..from]);
        out.push_str("***");
        at = to;
        masking = true;
    }
    out.push_str(&url[at..]);
    out
}

/// Whether `text` is an RFC 3986 URL scheme: a letter, then letters, digits, `+`, `-` and `.`.
#[must_use]
pub fn is_scheme(text: &str) -> bool {
    text.starts_with(|c: char| c.is_ascii_alphabetic())
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// Whether a query parameter of a store URL carries a credential: any name holding one of these
/// words, in any case (`password`, `sslpassword`, `pass`, `aws_secret_access_key`, `sslkey`,
/// `auth_token`, ...). [`redact_url`] masks the values of these parameters.
///
/// ```
/// use idempotency_core::is_credential;
///
/// assert!(is_credential("sslPassword"));
/// assert!(is_credential("aws_secret_access_key"));
/// assert!(!is_credential("sslmode"));
/// ```
#[must_use]
pub fn is_credential(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    [
        "pass",
        "pwd",
        "secret",
        "token",
        "key",
        "auth",
        "credential",
        "signature",
    ]
    .iter()
    .any(|word| name.contains(word))
}

/// The record protocol ([`crate::guide::protocol`]). All transitions are atomic in the store and timed by the
/// store's clock.
///
/// See [`crate::machine`] for the full transition table.
#[async_trait]
pub trait Store: Send + Sync + fmt::Debug {
    /// Claims `(scope, key)` for an attempt holding `request.token`, or reports why not.
    async fn begin(&self, request: &BeginRequest) -> Result<Claim, StoreError>;

    /// Stores `outcome` and keeps the record for `retention`, if `held`'s token still holds the
    /// record. The accepted value is the record's expiry.
    async fn complete(
        &self,
        held: &Held,
        outcome: Outcome,
        retention: Duration,
    ) -> Result<Fenced<Timestamp>, StoreError>;

    /// Ends `held`'s lease if its token holds the record, so that a retry may run again: the
    /// record keeps its fingerprint, attempt and expiry, is held by [`Token::NONE`](crate::Token::NONE),
    /// and the next `begin` takes it over as attempt + 1 with `recovered`
    /// ([`crate::machine`]).
    async fn release(&self, held: &Held) -> Result<Fenced<()>, StoreError>;

    /// Moves the lease to now + `lease` if `held`'s token holds the record (the heartbeat). The
    /// accepted value is the new end of the lease.
    async fn extend(&self, held: &Held, lease: Duration) -> Result<Fenced<Timestamp>, StoreError>;

    /// The live record at `(scope, key)`, if any (expired records are absent).
    async fn get(&self, scope: &Scope, key: &Key) -> Result<Option<Record>, StoreError>;

    /// [`Store::begin`] for each request of a batch: one answer per request, in the batch's
    /// order, each the answer its single call would get had the calls run one after another in
    /// that order (each key its own claim, token, fencing, attempt, mismatch and in-flight
    /// answer; a key twice in one batch is claimed by its first request and in flight for its
    /// second).
    ///
    /// The default runs the single calls one after another. A store that can do better runs
    /// the batch in one round trip or one transaction; if that round trip or transaction
    /// fails, every request of the batch gets an error of the same kind and, as for a single
    /// call that fails, its effect is unknown to the caller.
    async fn begin_many(&self, requests: &[BeginRequest]) -> Vec<Result<Claim, StoreError>> {
        begin_each(self, requests).await
    }

    /// [`Store::complete`] for each completion of a batch, answered as
    /// [`Store::begin_many`] answers: one result per completion, in order, each what its
    /// single call would return; a failed batch round trip fails every completion of it.
    async fn complete_many(&self, completions: &[Completion]) -> Vec<Result<Fenced<Timestamp>, StoreError>> {
        complete_each(self, completions).await
    }
}

/// [`Store::begin_many`] as single calls, one after another: the default, and what a store
/// with a native batch does for a batch too small to gain from it.
pub async fn begin_each<S: Store + ?Sized>(
    store: &S,
    requests: &[BeginRequest],
) -> Vec<Result<Claim, StoreError>> {
    let mut claims = Vec::with_capacity(requests.len());
    for request in requests {
        claims.push(store.begin(request).await);
    }
    claims
}

/// [`Store::complete_many`] as single calls, one after another (see [`begin_each`]).
pub async fn complete_each<S: Store + ?Sized>(
    store: &S,
    completions: &[Completion],
) -> Vec<Result<Fenced<Timestamp>, StoreError>> {
    let mut done = Vec::with_capacity(completions.len());
    for completion in completions {
        done.push(
            store
                .complete(&completion.held, completion.outcome.clone(), completion.retention)
                .await,
        );
    }
    done
}

/// One completion of a [`Store::complete_many`] batch: the arguments of one
/// [`Store::complete`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The attempt that ran, holding the record.
    pub held: Held,
    /// What it produced.
    pub outcome: Outcome,
    /// How long the completed record is kept.
    pub retention: Duration,
}

impl Completion {
    /// The completion of `held` with `outcome`, kept for `retention`.
    #[must_use]
    pub fn new(held: Held, outcome: Outcome, retention: Duration) -> Self {
        Self {
            held,
            outcome,
            retention,
        }
    }
}

/// A call of a batch, by the record it touches.
pub trait BatchCall {
    /// The scope and key of the record the call touches.
    fn record_key(&self) -> (&Scope, &Key);
}

impl BatchCall for BeginRequest {
    fn record_key(&self) -> (&Scope, &Key) {
        (&self.scope, &self.key)
    }
}

impl BatchCall for Completion {
    fn record_key(&self) -> (&Scope, &Key) {
        (&self.held.scope, &self.held.key)
    }
}

/// The positions of a batch's calls in the order a store that locks a row per key should run
/// them: by scope, then key, and a key's calls in the batch's order. Two transactions that take
/// their locks in this one order cannot deadlock on each other.
///
/// ```
/// use idempotency_core::{BeginRequest, Fingerprint, Key, Scope, lock_order};
///
/// let request = |key: &str| BeginRequest::new(Scope::global(), Key::new(key).unwrap(), Fingerprint::of_bytes(b""));
/// let batch = [request("b"), request("a"), request("b"), request("c")];
/// assert_eq!(lock_order(&batch), [1, 0, 2, 3]);
/// ```
#[must_use]
pub fn lock_order<T: BatchCall>(batch: &[T]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..batch.len()).collect();
    // Stable: a key's calls keep the batch's order.
    order.sort_by(|a, b| {
        let ((scope_a, key_a), (scope_b, key_b)) = (batch[*a].record_key(), batch[*b].record_key());
        (scope_a.as_str(), key_a.as_str()).cmp(&(scope_b.as_str(), key_b.as_str()))
    });
    order
}

/// The answers of a batch of `len` calls run in one round trip or transaction: its answers,
/// or, when it failed, [`failed_batch`].
#[must_use]
pub fn batch_answers<T>(len: usize, batch: Result<Vec<T>, StoreError>) -> Vec<Result<T, StoreError>> {
    match batch {
        Ok(answers) => answers.into_iter().map(Ok).collect(),
        Err(error) => failed_batch(&error, len),
    }
}

/// The answers of a batch whose one round trip or transaction failed: every call of it gets
/// `error`'s kind and message (the effect of each is unknown, as for a single call that fails).
#[must_use]
pub fn failed_batch<T>(error: &StoreError, len: usize) -> Vec<Result<T, StoreError>> {
    (0..len).map(|_| Err(error.clone())).collect()
}

/// Inspection and cleanup, for operators.
#[async_trait]
pub trait StoreAdmin: Store {
    /// Counts by state, for one scope or all.
    async fn stats(&self, scope: Option<&Scope>) -> Result<Stats, StoreError>;

    /// Live records matching `filter`, in `(scope, key)` order, without outcome bodies.
    async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordSummary>, StoreError>;

    /// Deletes up to `limit` expired records and returns how many were deleted. Call it in a loop
    /// until it returns less than `limit` to purge everything.
    async fn purge_expired(&self, limit: u64) -> Result<u64, StoreError>;

    /// Deletes the live record of `scope` and `key` if it still holds `token` ([`Record::token`]
    /// of the record an operator read with [`Store::get`]), so that the key runs again as a new
    /// first attempt: [`Fenced::Accepted`]. When the record is gone, expired, or holds another
    /// token (taken over, completed by another attempt, or created anew since it was read),
    /// nothing is deleted: [`Fenced::LeaseLost`]. Deleting an in-flight record lets a second
    /// attempt run beside the first: operators' tools ask for that explicitly
    /// (`idem keys forget --force`).
    async fn forget(&self, scope: &Scope, key: &Key, token: Token) -> Result<Fenced<()>, StoreError>;

    /// The store's clock now: the time its records' leases and expiries are measured against,
    /// which operators' tools compare them with (never the tool host's clock, which may be
    /// skewed). The default is the local system clock, right for stores on it; stores on a
    /// server clock or a configured [`crate::Clock`] override it.
    async fn now(&self) -> Result<Timestamp, StoreError> {
        Ok(Timestamp::from_system_time(std::time::SystemTime::now()))
    }

    /// Whether the store deletes expired records by itself (Redis' key expiry, DynamoDB's TTL):
    /// then `purge_expired` has nothing to do, and a [`crate::Purger`] does not run.
    fn expires_by_itself(&self) -> bool {
        false
    }
}

macro_rules! forward_store {
    ($($ptr:ty),*) => {$(
        #[async_trait]
        impl<S: Store + ?Sized> Store for $ptr {
            async fn begin(&self, request: &BeginRequest) -> Result<Claim, StoreError> {
                (**self).begin(request).await
            }
            async fn complete(&self, held: &Held, outcome: Outcome, retention: Duration)
                -> Result<Fenced<Timestamp>, StoreError> {
                (**self).complete(held, outcome, retention).await
            }
            async fn release(&self, held: &Held) -> Result<Fenced<()>, StoreError> {
                (**self).release(held).await
            }
            async fn extend(&self, held: &Held, lease: Duration) -> Result<Fenced<Timestamp>, StoreError> {
                (**self).extend(held, lease).await
            }
            async fn get(&self, scope: &Scope, key: &Key) -> Result<Option<Record>, StoreError> {
                (**self).get(scope, key).await
            }
            async fn begin_many(&self, requests: &[BeginRequest]) -> Vec<Result<Claim, StoreError>> {
                (**self).begin_many(requests).await
            }
            async fn complete_many(&self, completions: &[Completion])
                -> Vec<Result<Fenced<Timestamp>, StoreError>> {
                (**self).complete_many(completions).await
            }
        }

        #[async_trait]
        impl<S: StoreAdmin + ?Sized> StoreAdmin for $ptr {
            async fn stats(&self, scope: Option<&Scope>) -> Result<Stats, StoreError> {
                (**self).stats(scope).await
            }
            async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordSummary>, StoreError> {
                (**self).list(filter).await
            }
            async fn purge_expired(&self, limit: u64) -> Result<u64, StoreError> {
                (**self).purge_expired(limit).await
            }
            async fn forget(&self, scope: &Scope, key: &Key, token: Token) -> Result<Fenced<()>, StoreError> {
                (**self).forget(scope, key, token).await
            }
            fn expires_by_itself(&self) -> bool {
                (**self).expires_by_itself()
            }
            async fn now(&self) -> Result<Timestamp, StoreError> {
                (**self).now().await
            }
        }
    )*};
}

forward_store!(Arc<S>, Box<S>);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_keeps_everything_but_the_password() {
        assert_eq!(
            redact_url("postgres://u:p@h:1/d?x=y"),
            "postgres://u:***@h:1/d?x=y"
        );
        assert_eq!(redact_url("redis://u:p@h:6379"), "redis://u:***@h:6379");
        assert_eq!(redact_url("postgres://u@h/d"), "postgres://u@h/d");
        assert_eq!(redact_url("postgres://h/d"), "postgres://h/d");
        assert_eq!(redact_url("u:p@h/d"), "u:***@h/d");
        assert_eq!(redact_url("sqlite:///var/lib/a@b.db"), "sqlite:///var/lib/a@b.db");
        assert_eq!(redact_url(""), "");
    }

    #[test]
    fn redaction_covers_credentials_in_the_query() {
        assert_eq!(
            redact_url("postgres://h/d?user=u&password=p&sslmode=require&sslpassword=q&sslkey=/k.pem"),
            "postgres://h/d?user=u&password=***&sslmode=require&sslpassword=***&sslkey=***"
        );
        assert_eq!(
            redact_url("postgres://u:p@h/d?PASSWORD=p&auth_token=t&application_name=x"),
            "postgres://u:***@h/d?PASSWORD=***&auth_token=***&application_name=x"
        );
        assert_eq!(
            redact_url("sqlite://x.db?synchronous=full"),
            "sqlite://x.db?synchronous=full"
        );
        assert_eq!(redact_url("redis://h:1?password"), "redis://h:1?password");
    }

    /// Every URL form each store accepts, with the secret it may carry: the secret never
    /// survives, and what is not secret stays readable.
    #[test]
    fn every_stores_url_forms_lose_their_secrets() {
        let forms = [
            // PostgreSQL (sqlx): userinfo, query parameters, Azure-style user@server names, and
            // passwords with unescaped reserved characters.
            (
                "postgres://app:S3CRET@db:5432/orders",
                "postgres://app:***@db:5432/orders",
            ),
            (
                "postgresql://app:S3CRET@db/orders?sslmode=require",
                "postgresql://app:***@db/orders?sslmode=require",
            ),
            (
                "postgres://db/orders?user=app&password=S3CRET",
                "postgres://db/orders?user=app&password=***",
            ),
            (
                "postgres://db/orders?sslpassword=S3CRET&sslkey=/S3CRET.pem",
                "postgres://db/orders?sslpassword=***&sslkey=***",
            ),
            (
                "postgres://app@srv:S3CRET@db.example/orders",
                "postgres://app@srv:***@db.example/orders",
            ),
            ("postgres://app:S3/CRET@db/orders", "postgres://app:***@db/orders"),
            ("postgres://app:S3?CRET@db/orders", "postgres://app:***@db/orders"),
            ("postgres://app:S3@CRET@db/orders", "postgres://app:***@db/orders"),
            // An `@` inside a credential parameter (found by the store_url fuzz target: the part
            // of the value before the `@` was shown).
            (
                "postgres://db/orders?password=S3@CRET",
                "postgres://db/orders?password=***",
            ),
            (
                "postgresql:/4:p%u/0ss%2redis://127.0.0.0.0.0379?passFwordx=S3CRETpwy@h/",
                "postgresql:***",
            ),
            // No scheme before the `://`: it is in a parameter's value (found by the fuzz
            // target: the parameters before it were shown).
            (
                "db?password=S3CRET&next=http://x",
                "db?password=***&next=http://x",
            ),
            // Redis: a password alone, ACL user and password, TLS, unix sockets, clusters.
            (
                "redis://:S3CRET@127.0.0.1:6379/0",
                "redis://:***@127.0.0.1:6379/0",
            ),
            (
                "redis://app:S3CRET@127.0.0.1:6379",
                "redis://app:***@127.0.0.1:6379",
            ),
            (
                "rediss://app:S3CRET@cache.example:6380/2",
                "rediss://app:***@cache.example:6380/2",
            ),
            (
                "rediss://:S3CRET@cache.example:6380?ca=/etc/ca.pem&cert=/etc/c.pem&key=/S3CRET.key",
                "rediss://:***@cache.example:6380?ca=/etc/ca.pem&cert=/etc/c.pem&key=***",
            ),
            (
                "redis+unix:///run/redis.sock?db=1&user=app&pass=S3CRET",
                "redis+unix:///run/redis.sock?db=1&user=app&pass=***",
            ),
            (
                "unix:///run/redis.sock?pass=S3CRET",
                "unix:///run/redis.sock?pass=***",
            ),
            (
                "redis-cluster://:S3CRET@h1:7000,h2:7001",
                "redis-cluster://:***@h1:7000,h2:7001",
            ),
            (
                "redis-cluster://:S3CRET@h1:7000,:S3CRET@h2:7001",
                "redis-cluster://:***@h2:7001",
            ),
            // SQLite: paths, which may hold `@` and `:`, and options; no credentials to hide.
            ("sqlite://idem.db", "sqlite://idem.db"),
            (
                "sqlite:///var/lib/idem/a@b.db?mode=rwc",
                "sqlite:///var/lib/idem/a@b.db?mode=rwc",
            ),
            ("sqlite::memory:", "sqlite::memory:"),
            ("memory://", "memory://"),
            // MySQL and DynamoDB, as their stores will take them.
            (
                "mysql://root:S3CRET@127.0.0.1:3306/test?ssl-key=/S3CRET.pem",
                "mysql://root:***@127.0.0.1:3306/test?ssl-key=***",
            ),
            // TLS parameters: the CA and the certificate stay readable, the key and its
            // password do not.
            (
                "postgres://app:S3CRET@db/orders?sslmode=verify-full&sslrootcert=/etc/ca.pem&sslcert=/etc/c.pem&sslkey=/S3CRET.key&sslpassword=S3CRET",
                "postgres://app:***@db/orders?sslmode=verify-full&sslrootcert=/etc/ca.pem&sslcert=/etc/c.pem&sslkey=***&sslpassword=***",
            ),
            (
                "mariadb://app:S3CRET@db/orders?ssl-mode=VERIFY_IDENTITY&ssl-ca=/etc/ca.pem&ssl-cert=/etc/c.pem&ssl-key=/S3CRET.key",
                "mariadb://app:***@db/orders?ssl-mode=VERIFY_IDENTITY&ssl-ca=/etc/ca.pem&ssl-cert=/etc/c.pem&ssl-key=***",
            ),
            (
                "dynamodb://idem?region=eu-west-1&aws_access_key_id=AK&aws_secret_access_key=S3CRET",
                "dynamodb://idem?region=eu-west-1&aws_access_key_id=***&aws_secret_access_key=***",
            ),
        ];
        for (url, redacted) in forms {
            assert_eq!(redact_url(url), redacted, "{url}");
            assert!(!redact_url(url).contains("S3"), "{url}");
        }
    }
}
