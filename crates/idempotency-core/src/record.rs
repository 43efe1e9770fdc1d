//! The record model: what a store keeps per `(scope, key)` and what its operations return.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;

use crate::{DecodeError, Fingerprint, Key, Scope, Timestamp};

/// Default lease: how long an attempt may run without a heartbeat before another caller may take
/// the key over.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);

/// Default retention for HTTP responses: how long a completed key replays.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// Default retention for message consumers, whose redeliveries and DLQ replays come later.
pub const DEFAULT_CONSUMER_RETENTION: Duration = Duration::from_secs(7 * 24 * 60 * 60);

/// A fencing token: a random 128-bit value that identifies one attempt.
///
/// Only the holder of the current token may `complete`, `release` or `extend` a record, so a
/// worker whose lease expired and was taken over can neither overwrite the newer attempt's result
/// nor delete its record. An attempt counter alone cannot fence: a record that expired and is
/// created again starts counting at 1 again.
///
/// A released record is held by [`Token::NONE`], which [`Token::random`] never returns: once an
/// attempt has released its record, its token is refused like any stale one.
///
/// Callers generate the token ([`Token::random`]) and pass it to `begin`, which makes a retried
/// `begin` whose reply was lost safe: the store recognises its own token and answers `Acquired`
/// again instead of `InFlight`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token(u128);

impl Token {
    /// The token of no attempt: a released record holds it, so that no attempt can
    /// `complete`, `release` or `extend` that record until a new `begin` takes it over.
    pub const NONE: Self = Self(0);

    /// A fresh token from a cryptographically secure generator; never [`Token::NONE`].
    #[must_use]
    pub fn random() -> Self {
        loop {
            let bits: u128 = rand::random();
            if bits != 0 {
                return Self(bits);
            }
        }
    }

    /// The token with the given bits (for stores that read tokens back).
    #[must_use]
    pub const fn from_u128(bits: u128) -> Self {
        Self(bits)
    }

    /// The token's bits.
    #[must_use]
    pub const fn as_u128(self) -> u128 {
        self.0
    }

    /// The token as 16 big-endian bytes.
    #[must_use]
    pub const fn to_bytes(self) -> [u8; 16] {
        self.0.to_be_bytes()
    }

    /// The token from 16 big-endian bytes.
    #[must_use]
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(u128::from_be_bytes(bytes))
    }

    /// The token from a slice of 16 big-endian bytes, as a store reads it back.
    ///
    /// # Errors
    ///
    /// [`DecodeError::Length`] when `bytes` is not 16 bytes long.
    pub fn from_slice(bytes: &[u8]) -> Result<Self, DecodeError> {
        bytes
            .try_into()
            .map(Self::from_bytes)
            .map_err(|_| DecodeError::Length {
                field: "token",
                expected: 16,
                found: bytes.len(),
            })
    }

    /// The token as 32 lowercase hex digits (the same as its `Display`).
    #[must_use]
    pub fn to_hex(self) -> String {
        hex::encode(self.to_bytes())
    }

    /// The token from 32 hex digits, as [`Token::to_hex`] writes them.
    ///
    /// ```
    /// use idempotency_core::Token;
    ///
    /// let token = Token::random();
    /// assert_eq!(Token::from_hex(&token.to_hex())?, token);
    /// assert!(Token::from_hex("not hex").is_err());
    /// # Ok::<(), idempotency_core::DecodeError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`DecodeError::Hex`] when `text` is not 32 hex digits.
    pub fn from_hex(text: &str) -> Result<Self, DecodeError> {
        let mut bytes = [0u8; 16];
        hex::decode_to_slice(text, &mut bytes).map_err(|_| DecodeError::Hex {
            field: "token",
            digits: 32,
        })?;
        Ok(Self::from_bytes(bytes))
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Half the token is enough to tell attempts apart in logs.
        write!(f, "Token({:016x}…)", (self.0 >> 64) as u64)
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// The stored result of a completed operation: opaque bytes that the edge (HTTP layer,
/// consumer) encodes and decodes. Cloning is cheap.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Outcome(Bytes);

impl Outcome {
    /// Wraps the encoded outcome.
    #[must_use]
    pub fn new(bytes: impl Into<Bytes>) -> Self {
        Self(bytes.into())
    }

    /// An empty outcome, for operations whose only result is "it happened".
    #[must_use]
    pub fn empty() -> Self {
        Self(Bytes::new())
    }

    /// The encoded outcome.
    #[must_use]
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The encoded outcome as shared bytes.
    #[must_use]
    pub fn into_bytes(self) -> Bytes {
        self.0
    }

    /// Length of the encoded outcome in bytes.
    #[must_use]
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the encoded outcome is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Outcome({} bytes)", self.0.len())
    }
}

impl From<Bytes> for Outcome {
    fn from(bytes: Bytes) -> Self {
        Self(bytes)
    }
}

impl From<Vec<u8>> for Outcome {
    fn from(bytes: Vec<u8>) -> Self {
        Self(bytes.into())
    }
}

impl From<&'static [u8]> for Outcome {
    fn from(bytes: &'static [u8]) -> Self {
        Self(Bytes::from_static(bytes))
    }
}

/// What `begin` needs: the address, the fingerprint, the caller's token and the timings.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::{BeginRequest, Fingerprint, Key, Scope};
///
/// let request = BeginRequest::new(Scope::global(), Key::new("k-1")?, Fingerprint::of_bytes(b"{}"))
///     .lease(Duration::from_secs(30))
///     .retention(Duration::from_secs(3600));
/// assert_eq!(request.lease, Duration::from_secs(30));
/// # Ok::<(), idempotency_core::KeyError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BeginRequest {
    /// Whose key this is.
    pub scope: Scope,
    /// The idempotency key.
    pub key: Key,
    /// What defines "the same request".
    pub fingerprint: Fingerprint,
    /// The fencing token this attempt will hold if it acquires the record.
    pub token: Token,
    /// How long the attempt may run without a heartbeat.
    pub lease: Duration,
    /// How long the record is kept (an in-flight record at least this long, so operators can see
    /// abandoned attempts; a completed record is kept for the retention given to `complete`).
    pub retention: Duration,
}

impl BeginRequest {
    /// A request with a fresh random token, [`DEFAULT_LEASE`] and [`DEFAULT_RETENTION`].
    #[must_use]
    pub fn new(scope: Scope, key: Key, fingerprint: Fingerprint) -> Self {
        Self {
            scope,
            key,
            fingerprint,
            token: Token::random(),
            lease: DEFAULT_LEASE,
            retention: DEFAULT_RETENTION,
        }
    }

    /// Sets the lease.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Sets the retention.
    #[must_use]
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Sets the token (to retry a `begin` whose reply was lost, reuse its token).
    #[must_use]
    pub fn token(mut self, token: Token) -> Self {
        self.token = token;
        self
    }
}

/// The record an attempt holds: what `begin` hands out when it acquires the key
/// ([`Claim::Acquired`]) and what `complete`, `release` and `extend` take, so that they always
/// name the record and the fencing token of the attempt that acquired it.
///
/// ```
/// use idempotency_core::{BeginRequest, Claim, Fingerprint, Key, MemoryStore, Outcome, Scope, Store};
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let store = MemoryStore::new();
/// let request = BeginRequest::new(Scope::global(), Key::new("order-1")?, Fingerprint::of_bytes(b"pay"));
/// let Claim::Acquired(held) = store.begin(&request).await? else { unreachable!() };
/// assert_eq!((held.attempt, held.recovered), (1, false));
/// let _ = store.complete(&held, Outcome::new("done"), request.retention).await?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// Whose key this is.
    pub scope: Scope,
    /// The idempotency key.
    pub key: Key,
    /// The fencing token of this attempt.
    pub token: Token,
    /// 1 for the first attempt; each lease takeover adds one.
    pub attempt: u32,
    /// `true` when a previous attempt's lease expired without completing: it may have
    /// partially run, so the operation should check for its traces (or be naturally idempotent
    /// downstream).
    pub recovered: bool,
    /// When the lease runs out unless extended (as of the acquisition).
    pub lease_until: Timestamp,
}

impl Held {
    /// The handle of the attempt that `request` acquired as attempt number `attempt` (the
    /// request's token), for stores that learn only the attempt number and the lease from
    /// their server.
    #[must_use]
    pub fn acquired(request: &BeginRequest, attempt: u32, lease_until: Timestamp) -> Self {
        Self {
            scope: request.scope.clone(),
            key: request.key.clone(),
            token: request.token,
            attempt,
            recovered: attempt > 1,
            lease_until,
        }
    }
}

/// The answer to `begin`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The caller holds the record and must run the operation, then `complete` or `release`
    /// it with this handle.
    Acquired(Held),
    /// Another attempt holds a live lease.
    InFlight {
        /// The attempt number of the holder.
        attempt: u32,
        /// When the holder's lease runs out (the earliest a takeover can happen).
        retry_after: Duration,
    },
    /// The operation already completed: here is its outcome.
    Replay(Completed),
    /// The key was first used with a different fingerprint: neither run nor replay.
    Mismatch,
}

/// A completed operation, as replayed to duplicates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completed {
    /// The stored outcome.
    pub outcome: Outcome,
    /// The attempt that completed it.
    pub attempt: u32,
    /// When it completed (store time).
    pub completed_at: Timestamp,
    /// When the record expires; duplicates after that run again.
    pub expires_at: Timestamp,
}

/// The answer of an operation that requires the fencing token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Fenced<T> {
    /// The token is current and the operation took effect.
    Accepted(T),
    /// The token is not current (taken over, released, expired, or never held): nothing changed.
    LeaseLost,
}

impl Fenced<()> {
    /// [`Fenced::Accepted`] when the fenced write happened (the token held the record),
    /// [`Fenced::LeaseLost`] otherwise.
    pub fn accepted_if(written: bool) -> Self {
        if written {
            Self::Accepted(())
        } else {
            Self::LeaseLost
        }
    }
}

impl<T> Fenced<T> {
    /// Whether the token was rejected.
    pub fn is_lease_lost(&self) -> bool {
        matches!(self, Self::LeaseLost)
    }

    /// The accepted value, if any.
    pub fn accepted(self) -> Option<T> {
        match self {
            Self::Accepted(value) => Some(value),
            Self::LeaseLost => None,
        }
    }
}

/// A record as the store holds it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Record {
    /// Whose key this is.
    pub scope: Scope,
    /// The idempotency key.
    pub key: Key,
    /// The fingerprint of the request that created the record.
    pub fingerprint: Fingerprint,
    /// The current attempt number.
    pub attempt: u32,
    /// When the record was created (store time).
    pub created_at: Timestamp,
    /// When the record expires and is treated as absent.
    pub expires_at: Timestamp,
    /// In flight or completed.
    pub state: RecordState,
}

/// The state of a [`Record`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RecordState {
    /// An attempt holds the record.
    InFlight {
        /// The holder's fencing token.
        token: Token,
        /// When the current attempt acquired the record.
        acquired_at: Timestamp,
        /// When the holder's lease runs out unless extended.
        lease_until: Timestamp,
    },
    /// The operation completed.
    Completed {
        /// The token of the attempt that completed it (a retried `complete` with this token is
        /// accepted again and changes nothing).
        token: Token,
        /// The stored outcome.
        outcome: Outcome,
        /// When it completed.
        completed_at: Timestamp,
    },
}

impl Record {
    /// Whether the record has expired at `now` (expired records are treated as absent).
    #[must_use]
    pub fn is_expired(&self, now: Timestamp) -> bool {
        now >= self.expires_at
    }

    /// A summary without the outcome body, for listings.
    #[must_use]
    pub fn summary(&self) -> RecordSummary {
        RecordSummary {
            scope: self.scope.clone(),
            key: self.key.clone(),
            fingerprint: self.fingerprint,
            attempt: self.attempt,
            created_at: self.created_at,
            expires_at: self.expires_at,
            state: match &self.state {
                RecordState::InFlight {
                    acquired_at,
                    lease_until,
                    ..
                } => SummaryState::InFlight {
                    acquired_at: *acquired_at,
                    lease_until: *lease_until,
                },
                RecordState::Completed {
                    outcome,
                    completed_at,
                    ..
                } => SummaryState::Completed {
                    completed_at: *completed_at,
                    outcome_len: outcome.len(),
                },
            },
        }
    }

    /// The token the record holds: its current attempt's while in flight ([`Token::NONE`] once
    /// released), the completing attempt's once completed. [`StoreAdmin::forget`](crate::StoreAdmin::forget)
    /// is fenced by it.
    #[must_use]
    pub fn token(&self) -> Token {
        match &self.state {
            RecordState::InFlight { token, .. } | RecordState::Completed { token, .. } => *token,
        }
    }

    /// When the record's current state began: the acquisition of the current attempt, or the
    /// completion.
    #[must_use]
    pub fn state_since(&self) -> Timestamp {
        match &self.state {
            RecordState::InFlight { acquired_at, .. } => *acquired_at,
            RecordState::Completed { completed_at, .. } => *completed_at,
        }
    }
}

/// A record without its outcome body or token, as listed for operators.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordSummary {
    /// Whose key this is.
    pub scope: Scope,
    /// The idempotency key.
    pub key: Key,
    /// The fingerprint of the request that created the record.
    pub fingerprint: Fingerprint,
    /// The current attempt number.
    pub attempt: u32,
    /// When the record was created.
    pub created_at: Timestamp,
    /// When the record expires.
    pub expires_at: Timestamp,
    /// In flight or completed.
    pub state: SummaryState,
}

/// The state part of a [`RecordSummary`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SummaryState {
    /// An attempt holds the record.
    InFlight {
        /// When the current attempt acquired the record.
        acquired_at: Timestamp,
        /// When its lease runs out.
        lease_until: Timestamp,
    },
    /// The operation completed.
    Completed {
        /// When it completed.
        completed_at: Timestamp,
        /// Size of the stored outcome in bytes.
        outcome_len: usize,
    },
}

/// Which records a listing returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateFilter {
    /// Only in-flight records.
    InFlight,
    /// Only completed records.
    Completed,
}

/// Which records `list` returns, in `(scope, key)` order. Expired records are never listed.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::{ListFilter, StateFilter};
///
/// // The stale-lease report: attempts that have been running for more than five minutes.
/// let filter = ListFilter::default()
///     .state(StateFilter::InFlight)
///     .older_than(Duration::from_secs(300))
///     .limit(50);
/// # let _ = filter;
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListFilter {
    /// Only this scope.
    pub scope: Option<Scope>,
    /// Only this state.
    pub state: Option<StateFilter>,
    /// Only records whose current state began at least this long ago (in-flight: acquired;
    /// completed: completed).
    pub older_than: Option<Duration>,
    /// Resume after this `(scope, key)` (the last one of the previous page).
    pub after: Option<(Scope, Key)>,
    /// At most this many records (default 100).
    pub limit: usize,
}

impl Default for ListFilter {
    fn default() -> Self {
        Self {
            scope: None,
            state: None,
            older_than: None,
            after: None,
            limit: 100,
        }
    }
}

impl ListFilter {
    /// Only records of `scope`.
    #[must_use]
    pub fn scope(mut self, scope: Scope) -> Self {
        self.scope = Some(scope);
        self
    }

    /// Only records in `state`.
    #[must_use]
    pub fn state(mut self, state: StateFilter) -> Self {
        self.state = Some(state);
        self
    }

    /// Only records whose state began at least `age` ago.
    #[must_use]
    pub fn older_than(mut self, age: Duration) -> Self {
        self.older_than = Some(age);
        self
    }

    /// Resume after `(scope, key)`.
    #[must_use]
    pub fn after(mut self, scope: Scope, key: Key) -> Self {
        self.after = Some((scope, key));
        self
    }

    /// At most `limit` records.
    #[must_use]
    pub fn limit(mut self, limit: usize) -> Self {
        self.limit = limit;
        self
    }

    /// The page of `found` (summaries that passed [`ListFilter::matches`]): in `(scope, key)`
    /// byte order, at most [`ListFilter::limit`] of them. Stores that filter in memory use it so
    /// that their pages agree with the SQL stores' `ORDER BY scope, key` (C collation).
    #[must_use]
    pub fn page(&self, mut found: Vec<RecordSummary>) -> Vec<RecordSummary> {
        found.sort_unstable_by(|a, b| (&a.scope, &a.key).cmp(&(&b.scope, &b.key)));
        found.truncate(self.limit);
        found
    }

    /// Whether `record` passes this filter at `now` (the order and limit are
    /// [`ListFilter::page`]'s).
    #[must_use]
    pub fn matches(&self, record: &Record, now: Timestamp) -> bool {
        if record.is_expired(now) {
            return false;
        }
        if self.scope.as_ref().is_some_and(|scope| &record.scope != scope) {
            return false;
        }
        match (self.state, &record.state) {
            (Some(StateFilter::InFlight), RecordState::Completed { .. })
            | (Some(StateFilter::Completed), RecordState::InFlight { .. }) => return false,
            _ => {}
        }
        if self
            .older_than
            .is_some_and(|age| now.since(record.state_since()) < age)
        {
            return false;
        }
        match &self.after {
            Some((scope, key)) => (&record.scope, &record.key) > (scope, key),
            None => true,
        }
    }
}

/// Counts by state, for operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stats {
    /// Live in-flight records (including those whose lease has expired).
    pub in_flight: u64,
    /// In-flight records whose lease has expired and that nobody has taken over yet: each is an
    /// attempt that crashed or hung.
    pub stale_leases: u64,
    /// Live completed records.
    pub completed: u64,
    /// Expired records not yet purged (they behave as absent).
    pub expired: u64,
    /// Age of the oldest live in-flight attempt (now − its acquisition).
    pub oldest_in_flight: Option<Duration>,
}

impl Stats {
    /// Adds `record` to the counts at `now`.
    pub fn count(&mut self, record: &Record, now: Timestamp) {
        if record.is_expired(now) {
            self.expired += 1;
            return;
        }
        match &record.state {
            RecordState::InFlight {
                acquired_at,
                lease_until,
                ..
            } => {
                self.in_flight += 1;
                if now >= *lease_until {
                    self.stale_leases += 1;
                }
                let age = now.since(*acquired_at);
                self.oldest_in_flight = Some(self.oldest_in_flight.map_or(age, |oldest| oldest.max(age)));
            }
            RecordState::Completed { .. } => self.completed += 1,
        }
    }
}
