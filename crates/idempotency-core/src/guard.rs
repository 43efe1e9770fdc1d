//! The guard: runs one operation under the record protocol.
//!
//! [`Guard::run`] does what every edge (HTTP layer, consumer adapter, gateway) must do, so none
//! of them re-implements it:
//!
//! 1. `begin` with a fresh fencing token. Anything but `Acquired` is returned without running the
//!    operation ([`Execution::Replayed`], [`Execution::InFlight`], [`Execution::Mismatch`]); a
//!    store error is returned as `Err` — the caller must fail closed.
//! 2. Run the operation while a heartbeat calls `extend` every lease/3, so a long operation keeps
//!    its lease. If the heartbeat learns the lease was lost (another attempt took over), the
//!    [`Attempt`] handed to the operation says so; the operation is not cancelled halfway.
//! 3. Ask the [`OutcomePolicy`] whether the value is final: `complete` with the encoded outcome,
//!    `release` so that a retry runs again, or leave the record in flight when the outcome is
//!    unknown ([`Decision::Unknown`]: the retry waits for the lease to end, then runs again as a
//!    recovered attempt). A panic releases the record and then resumes unwinding. Transient store errors while settling are retried with backoff for as long as
//!    the attempt still holds its lease: the operation has run, and giving up early would let a
//!    retry run it again once the lease expires.
//!
//! # Cancellation
//!
//! If the future returned by `run` is dropped while the operation runs, the operation is dropped
//! with it and the record stays in flight until its lease expires (then the next attempt takes
//! over with `recovered: true`). Edges whose futures can be dropped by their caller (hyper drops
//! the service future when the client disconnects) must run the guard on a spawned task.
//!
//! # Observability
//!
//! Each run is a `tracing` span `idempotency.run` (scope and key shortened; fields
//! `transaction`, `attempt` and `result`), each store call inside it a `debug` span `idempotency.store` (field `op`), and the
//! guard emits
//! these `metrics` (all labelled `guard`, the guard's [name](Guard::name)):
//!
//! | metric | kind | meaning |
//! |---|---|---|
//! | `idempotency_acquired_total` | counter | attempts that ran (`recovered` label: `true` for takeovers) |
//! | `idempotency_replayed_total` | counter | duplicates answered from a stored outcome |
//! | `idempotency_in_flight_total` | counter | duplicates that arrived while an attempt held the key |
//! | `idempotency_mismatch_total` | counter | keys reused with another payload |
//! | `idempotency_lease_takeovers_total` | counter | expired leases taken over |
//! | `idempotency_lease_lost_total` | counter | `complete`/`release`/`extend` refused for a stale token (`op` label) |
//! | `idempotency_heartbeat_late_total` | counter | heartbeats answered after the lease they extend ran out (`how`: `after_lease`) or after more than the heartbeat interval (`slow`) |
//! | `idempotency_outcome_unknown_total` | counter | operations whose outcome is unknown, left in flight until their lease ends |
//! | `idempotency_store_errors_total` | counter | failed store calls (`op`, `kind` labels) |
//! | `idempotency_store_duration_seconds` | histogram | store call latency (`op` label) |

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use metrics::SharedString;
use tracing::Instrument;

use crate::wait::{InFlightWait, Waiters};

mod batch;
mod transaction_batch;
use crate::{
    Backoff, BeginRequest, Claim, Completed, DEFAULT_LEASE, DEFAULT_RETENTION, ErrorKind, Fenced,
    Fingerprint, Held, InTransaction, Key, Outcome, Scope, Store, StoreError, Timestamp, Token,
    TransactionalStore, TxFuture, TxOperation,
};
pub use batch::{Claimed, ClaimedRun, RunLease};
pub use transaction_batch::TransactionBatch;

/// What to record for a finished operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The result is final: store this outcome and replay it to duplicates.
    Complete(Outcome),
    /// The result is not final, and the operation surely did not take effect, or may be run
    /// again (a transient failure): release the record so that a retry runs again, as attempt
    /// + 1 with `recovered`.
    Release,
    /// Whether the operation took effect is unknown: the request reached a remote system and
    /// its answer was lost (a dropped connection, a timeout, a truncated reply). Nothing is
    /// recorded and the record stays in flight until its lease ends, so that a retry does not
    /// run it again while the remote system may still be working on it; the first retry after
    /// that runs again as attempt + 1 with `recovered`, and should look for the first attempt's
    /// traces (or pass the key on, so that the remote system deduplicates).
    ///
    /// In [`Guard::run_in_transaction`] the transaction rolls back as for [`Decision::Release`]:
    /// what the operation wrote through it is undone with the claim.
    Unknown,
}

/// Decides, from an operation's value, whether it is final ([`Decision::Complete`]) or must be
/// retried ([`Decision::Release`]).
///
/// Any `Fn(&T) -> Decision` is a policy:
///
/// ```
/// use idempotency_core::{Decision, Outcome, OutcomePolicy};
///
/// let policy = |result: &Result<u64, std::io::Error>| match result {
///     Ok(charge_id) => Decision::Complete(Outcome::new(charge_id.to_string())),
///     Err(_) => Decision::Release,
/// };
/// assert_eq!(policy.decide(&Err(std::io::Error::other("gateway timeout"))), Decision::Release);
/// ```
pub trait OutcomePolicy<T> {
    /// The decision for `value`.
    fn decide(&self, value: &T) -> Decision;
}

impl<T, F> OutcomePolicy<T> for F
where
    F: Fn(&T) -> Decision,
{
    fn decide(&self, value: &T) -> Decision {
        self(value)
    }
}

/// The attempt an operation runs as; handed to the operation by [`Guard::run`].
#[derive(Debug, Clone)]
pub struct Attempt {
    scope: Scope,
    key: Key,
    number: u32,
    recovered: bool,
    lease_lost: Arc<AtomicBool>,
}

impl Attempt {
    /// The attempt that holds `held`.
    fn of(held: &Held) -> Self {
        Self {
            scope: held.scope.clone(),
            key: held.key.clone(),
            number: held.attempt,
            recovered: held.recovered,
            lease_lost: Arc::default(),
        }
    }

    /// The scope of the record.
    #[must_use]
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The idempotency key, to propagate downstream (messages, calls to other services).
    #[must_use]
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// 1 for the first attempt; each lease takeover adds one.
    #[must_use]
    pub fn number(&self) -> u32 {
        self.number
    }

    /// Whether a previous attempt's lease expired without completing: it may have partially run.
    #[must_use]
    pub fn recovered(&self) -> bool {
        self.recovered
    }

    /// Whether the heartbeat has learned that another attempt took the record over. The outcome
    /// of this attempt will not be recorded; a long operation may stop early.
    #[must_use]
    pub fn is_lease_lost(&self) -> bool {
        self.lease_lost.load(Ordering::Relaxed)
    }
}

/// What happened to the outcome of an operation that ran.
#[derive(Debug, Clone)]
pub enum Recorded {
    /// Stored; duplicates replay it until `expires_at`.
    Completed {
        /// When the record expires.
        expires_at: Timestamp,
    },
    /// Released; the next retry runs the operation again.
    Released,
    /// Another attempt took the record over while this one ran; this outcome was discarded and
    /// the newer attempt's stands.
    LeaseLost,
    /// The store failed while settling; the record stays in flight until its lease expires, then
    /// a retry takes over with `recovered: true`.
    Failed(StoreError),
    /// The outcome is unknown ([`Decision::Unknown`]); the record stays in flight until its
    /// lease expires, then a retry takes over with `recovered: true`.
    Unknown,
}

/// The result of [`Guard::run`].
#[derive(Debug)]
pub enum Execution<T> {
    /// The operation ran in this call.
    Executed {
        /// What the operation returned.
        value: T,
        /// The attempt number.
        attempt: u32,
        /// Whether a previous attempt may have partially run.
        recovered: bool,
        /// What happened to its outcome.
        recorded: Recorded,
    },
    /// The operation had already completed: this is its stored outcome.
    Replayed(Completed),
    /// Another attempt holds the key; try again after `retry_after`.
    InFlight {
        /// The holder's attempt number.
        attempt: u32,
        /// When the holder's lease runs out.
        retry_after: Duration,
    },
    /// The key was first used with a different fingerprint; nothing ran.
    Mismatch,
}

/// Runs operations under the record protocol; see the [module docs](self).
///
/// ```
/// use idempotency_core::{Decision, Execution, Fingerprint, Guard, Key, MemoryStore, Outcome, Scope};
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// let guard = Guard::new(MemoryStore::new()).name("charges");
/// let charge = |amount: u64| {
///     let guard = guard.clone();
///     async move {
///         let key = Key::new("order-7-charge")?;
///         let fingerprint = Fingerprint::of_bytes(&amount.to_be_bytes());
///         let policy = |receipt: &String| Decision::Complete(Outcome::new(receipt.clone()));
///         guard
///             .run(Scope::global(), key, fingerprint, policy, |_attempt| async move {
///                 format!("charged {amount}") // the side effect runs here, once
///             })
///             .await
///             .map_err(Box::<dyn std::error::Error>::from)
///     }
/// };
/// assert!(matches!(charge(10).await?, Execution::Executed { .. }));
/// let Execution::Replayed(done) = charge(10).await? else { unreachable!() };
/// assert_eq!(done.outcome.as_bytes(), b"charged 10");
/// assert!(matches!(charge(99).await?, Execution::Mismatch));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct Guard<S> {
    store: S,
    name: SharedString,
    lease: Duration,
    retention: Duration,
    heartbeat: Option<Duration>,
    /// How keys appear in the guard's log lines.
    key_log: crate::KeyLog,
    /// The handles of the metrics every run moves, registered on first use and shared by the
    /// clones: looking a labelled metric up in the recorder on every call cost as much as a
    /// store call on the memory store.
    hot: Arc<std::sync::OnceLock<HotMetrics>>,
    /// The runs of this guard and its clones waiting on a key in flight: woken when an outcome
    /// is recorded here ([`Guard::wait_in_flight`]).
    waiters: Arc<Waiters>,
}

/// The metrics of every run, by handle.
#[derive(Debug)]
struct HotMetrics {
    acquired: metrics::Counter,
    acquired_recovered: metrics::Counter,
    replayed: metrics::Counter,
    in_flight: metrics::Counter,
    mismatch: metrics::Counter,
    /// `idempotency_store_duration_seconds` for each [`Op`], indexed by it.
    durations: Vec<metrics::Histogram>,
}

/// A store operation the guard times and counts, named by its `op` label.
#[derive(Debug, Clone, Copy)]
enum Op {
    Begin,
    Complete,
    BeginMany,
    CompleteMany,
    Release,
    Extend,
    Commit,
    BeginTransaction,
    Savepoint,
}

impl Op {
    const ALL: [Op; 9] = [
        Op::Begin,
        Op::Complete,
        Op::BeginMany,
        Op::CompleteMany,
        Op::Release,
        Op::Extend,
        Op::Commit,
        Op::BeginTransaction,
        Op::Savepoint,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Op::Begin => "begin",
            Op::Complete => "complete",
            Op::BeginMany => "begin_many",
            Op::CompleteMany => "complete_many",
            Op::Release => "release",
            Op::Extend => "extend",
            Op::Commit => "commit",
            Op::BeginTransaction => "begin_transaction",
            Op::Savepoint => "savepoint",
        }
    }
}

impl HotMetrics {
    fn new(guard: &SharedString) -> Self {
        Self {
            acquired: metrics::counter!("idempotency_acquired_total", "guard" => guard.clone(), "recovered" => "false"),
            acquired_recovered: metrics::counter!("idempotency_acquired_total", "guard" => guard.clone(), "recovered" => "true"),
            replayed: metrics::counter!("idempotency_replayed_total", "guard" => guard.clone()),
            in_flight: metrics::counter!("idempotency_in_flight_total", "guard" => guard.clone()),
            mismatch: metrics::counter!("idempotency_mismatch_total", "guard" => guard.clone()),
            durations: Op::ALL
                .iter()
                .map(|op| metrics::histogram!("idempotency_store_duration_seconds", "guard" => guard.clone(), "op" => op.as_str()))
                .collect(),
        }
    }
}

impl<S: Store> Guard<S> {
    /// A guard over `store` with a 60 s lease, 24 h retention and a heartbeat every lease/3.
    pub fn new(store: S) -> Self {
        Self {
            store,
            name: SharedString::const_str("default"),
            lease: DEFAULT_LEASE,
            retention: DEFAULT_RETENTION,
            heartbeat: None,
            key_log: crate::KeyLog::Plain,
            hot: Arc::default(),
            waiters: Arc::default(),
        }
    }

    fn hot(&self) -> &HotMetrics {
        self.hot.get_or_init(|| HotMetrics::new(&self.name))
    }

    /// Names the guard in spans and metrics labels (for example the route or consumer name).
    #[must_use]
    pub fn name(mut self, name: impl Into<SharedString>) -> Self {
        self.name = name.into();
        self.hot = Arc::default();
        self
    }

    /// How long an attempt may run without a heartbeat before another may take over.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long a completed outcome is replayed.
    #[must_use]
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// How often the heartbeat extends the lease (default: lease/3).
    #[must_use]
    pub fn heartbeat_every(mut self, every: Duration) -> Self {
        self.heartbeat = Some(every);
        self
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// How keys appear in the guard's log lines (default [`KeyLog::Plain`](crate::KeyLog::Plain):
    /// truncated past 16 bytes).
    #[must_use]
    pub fn log_keys(mut self, how: crate::KeyLog) -> Self {
        self.key_log = how;
        self
    }

    /// How keys appear in the guard's log lines.
    pub fn key_log(&self) -> crate::KeyLog {
        self.key_log
    }

    /// The guard's name ([`name`](Self::name)), as logs and metrics label it.
    pub fn label(&self) -> &str {
        &self.name
    }

    /// The configured lease.
    pub fn lease_duration(&self) -> Duration {
        self.lease
    }

    /// The configured retention.
    pub fn retention_duration(&self) -> Duration {
        self.retention
    }

    /// Paces the re-reads of `(scope, key)` after [`Execution::InFlight`] answers, for up to
    /// `wait`: a run of this guard (or a clone) that records the key's outcome ends the pause at
    /// once; otherwise the key is read again after 20 ms, doubling to 250 ms, and when its
    /// lease ends. See [`wait`](crate::wait).
    pub fn wait_in_flight(&self, scope: &Scope, key: &Key, wait: Duration) -> InFlightWait {
        InFlightWait::new(&self.waiters, scope, key, wait)
    }

    /// Runs `operation` at most once per `(scope, key)`; see the [module docs](self).
    ///
    /// # Errors
    ///
    /// The store's error when `begin` fails: the operation did not run, and the caller must fail
    /// closed (HTTP `503`, nack the message).
    pub async fn run<T, P, F, Fut>(
        &self,
        scope: Scope,
        key: Key,
        fingerprint: Fingerprint,
        policy: P,
        operation: F,
    ) -> Result<Execution<T>, StoreError>
    where
        P: OutcomePolicy<T>,
        F: FnOnce(Attempt) -> Fut,
        Fut: Future<Output = T>,
    {
        let span = self.span(&scope, &key, false);
        self.run_inner(scope, key, fingerprint, policy, operation, &span)
            .instrument(span.clone())
            .await
    }

    async fn run_inner<T, P, F, Fut>(
        &self,
        scope: Scope,
        key: Key,
        fingerprint: Fingerprint,
        policy: P,
        operation: F,
        span: &tracing::Span,
    ) -> Result<Execution<T>, StoreError>
    where
        P: OutcomePolicy<T>,
        F: FnOnce(Attempt) -> Fut,
        Fut: Future<Output = T>,
    {
        let request = self.request(scope, key, fingerprint);
        let asked = tokio::time::Instant::now();
        let claim = self.begin(&request).await?;
        let held = match self.acquired(claim, span) {
            Ok(held) => held,
            Err(answer) => return Ok(answer),
        };
        // Until when this attempt surely holds the lease, by the local clock: the time the last
        // accepted `begin` or `extend` was *sent*, plus the lease.
        let held_until = Mutex::new(later(asked, self.lease));
        let context = Attempt::of(&held);
        let lease_lost = Arc::clone(&context.lease_lost);
        let work = AssertUnwindSafe(operation(context)).catch_unwind();
        let heartbeat = self.heartbeat(&held, &lease_lost, &held_until);
        let finished = tokio::select! {
            finished = work => finished,
            never = heartbeat => match never {},
        };
        let value = match finished {
            Ok(value) => value,
            Err(panic) => {
                span.record("result", "panicked");
                tracing::error!(
                    scope = %held.scope.redacted(),
                    key = %held.key.logged(self.key_log),
                    "operation panicked; releasing the key so a retry can run"
                );
                let _ = self.release(&held, held_for(&held_until)).await;
                std::panic::resume_unwind(panic);
            }
        };
        let deadline = held_for(&held_until);
        let recorded = match policy.decide(&value) {
            Decision::Complete(outcome) => self.complete(&held, outcome, deadline).await,
            Decision::Release => self.release(&held, deadline).await,
            Decision::Unknown => self.unknown(&held),
        };
        Ok(self.executed(value, &held, recorded, span))
    }

    /// The span of one run (scope and key shortened); `attempt` and `result` are recorded as
    /// the run goes.
    ///
    /// At the `debug` level: a span at `info` has its fields formatted by `tracing-subscriber`'s
    /// fmt layer on every run even when nothing is logged in it, which cost the gateway a tenth
    /// of its instructions. The warnings and errors of a run carry the scope and the key
    /// themselves.
    fn span(&self, scope: &Scope, key: &Key, transaction: bool) -> tracing::Span {
        tracing::debug_span!(
            "idempotency.run",
            guard = &*self.name,
            scope = %scope.redacted(),
            key = %key.logged(self.key_log),
            transaction,
            attempt = tracing::field::Empty,
            result = tracing::field::Empty,
        )
    }

    /// The request `begin` is asked with: a fresh token and this guard's timings.
    fn request(&self, scope: Scope, key: Key, fingerprint: Fingerprint) -> BeginRequest {
        BeginRequest {
            scope,
            key,
            fingerprint,
            token: Token::random(),
            lease: self.lease,
            retention: self.retention,
        }
    }

    /// `begin`, tried twice while the store fails transiently. The retry reuses the token, so a
    /// first try that took effect but whose reply was lost is recognised as ours instead of
    /// blocking the key for a whole lease.
    async fn begin(&self, request: &BeginRequest) -> Result<Claim, StoreError> {
        self.retrying((&request.scope, &request.key), Op::Begin, Until::Tries(2), || {
            self.store.begin(request)
        })
        .await
    }

    /// The held record if `claim` acquired it (counted and logged), else the answer for a
    /// duplicate: the one place both the ordinary and the same-transaction path read a claim.
    ///
    /// The attempt and the result go on `span`, the run's own: never on whatever span is
    /// current, which is the caller's when the run's span is disabled, and whose fields are the
    /// caller's to record (the HTTP layer's request span has an `attempt` of its own).
    fn acquired<T>(&self, claim: Claim, span: &tracing::Span) -> Result<Held, Execution<T>> {
        let (result, metric, answer) = match claim {
            Claim::Acquired(held) => {
                span.record("attempt", held.attempt);
                if held.recovered {
                    self.hot().acquired_recovered.increment(1);
                    metrics::counter!("idempotency_lease_takeovers_total", "guard" => self.name.clone())
                        .increment(1);
                    tracing::warn!(
                        scope = %held.scope.redacted(),
                        key = %held.key.logged(self.key_log),
                        attempt = held.attempt,
                        "took over an expired lease: a previous attempt may have partially run"
                    );
                } else {
                    self.hot().acquired.increment(1);
                }
                return Ok(held);
            }
            Claim::Replay(completed) => ("replayed", &self.hot().replayed, Execution::Replayed(completed)),
            Claim::InFlight { attempt, retry_after } => (
                "in_flight",
                &self.hot().in_flight,
                Execution::InFlight { attempt, retry_after },
            ),
            Claim::Mismatch => ("mismatch", &self.hot().mismatch, Execution::Mismatch),
        };
        span.record("result", result);
        metric.increment(1);
        Err(answer)
    }

    /// The answer for an operation that ran, with its outcome's fate on the span.
    fn executed<T>(&self, value: T, held: &Held, recorded: Recorded, span: &tracing::Span) -> Execution<T> {
        span.record(
            "result",
            match &recorded {
                Recorded::Completed { .. } => "completed",
                Recorded::Released => "released",
                Recorded::LeaseLost => "lease_lost",
                Recorded::Failed(_) => "settle_failed",
                Recorded::Unknown => "outcome_unknown",
            },
        );
        Execution::Executed {
            value,
            attempt: held.attempt,
            recovered: held.recovered,
            recorded,
        }
    }

    /// Extends the lease every `heartbeat` until dropped; never returns.
    async fn heartbeat(
        &self,
        held: &Held,
        lease_lost: &AtomicBool,
        held_until: &Mutex<tokio::time::Instant>,
    ) -> std::convert::Infallible {
        let every = self.heartbeat_interval();
        loop {
            tokio::time::sleep(every).await;
            self.beat(held, lease_lost, held_until, every).await;
        }
    }

    /// How often a held lease is extended: the configured heartbeat, or a third of the lease.
    fn heartbeat_interval(&self) -> Duration {
        self.heartbeat
            .unwrap_or(self.lease / 3)
            .max(Duration::from_millis(1))
    }

    /// One heartbeat of `held`: extends its lease unless it was lost, and notes the answer.
    async fn beat(
        &self,
        held: &Held,
        lease_lost: &AtomicBool,
        held_until: &Mutex<tokio::time::Instant>,
        every: Duration,
    ) {
        if lease_lost.load(Ordering::Relaxed) {
            return;
        }
        let sent = tokio::time::Instant::now();
        let answer = self.timed(Op::Extend, self.store.extend(held, self.lease)).await;
        self.check_late(held, sent, every, held_for(held_until));
        match answer {
            Ok(Fenced::Accepted(_)) => {
                *held_until.lock().unwrap_or_else(PoisonError::into_inner) = later(sent, self.lease);
            }
            Ok(Fenced::LeaseLost) => {
                lease_lost.store(true, Ordering::Relaxed);
                metrics::counter!("idempotency_lease_lost_total", "guard" => self.name.clone(), "op" => "extend")
                    .increment(1);
                tracing::warn!(
                    scope = %held.scope.redacted(),
                    key = %held.key.logged(self.key_log),
                    "heartbeat refused: another attempt took the key over"
                );
            }
            // Keep beating: the lease is still ours until it expires, and the store may come
            // back before then.
            Err(error) => tracing::warn!(
                scope = %held.scope.redacted(),
                key = %held.key.logged(self.key_log),
                %error,
                "heartbeat failed"
            ),
        }
    }

    /// Counts and logs a heartbeat whose answer came late: after the lease it was to extend had
    /// run out (another attempt could have taken the key over meanwhile), or after longer than
    /// the heartbeat interval (the margin left is shrinking). Either means the store is too slow
    /// or too busy for this lease.
    fn check_late(
        &self,
        held: &Held,
        sent: tokio::time::Instant,
        every: Duration,
        held_until: tokio::time::Instant,
    ) {
        let now = tokio::time::Instant::now();
        let took = now - sent;
        let how = if now > held_until {
            "after_lease"
        } else if took > every {
            "slow"
        } else {
            return;
        };
        metrics::counter!("idempotency_heartbeat_late_total", "guard" => self.name.clone(), "how" => how)
            .increment(1);
        tracing::warn!(
            scope = %held.scope.redacted(),
            key = %held.key.logged(self.key_log),
            took_ms = took.as_millis(),
            lease_ms = self.lease.as_millis(),
            how,
            "a heartbeat came late: the store is too slow or too busy for this lease"
        );
    }

    /// Leaves the record in flight: the heartbeat stops with the run, and the lease runs out.
    fn unknown(&self, held: &Held) -> Recorded {
        metrics::counter!("idempotency_outcome_unknown_total", "guard" => self.name.clone()).increment(1);
        tracing::warn!(
            scope = %held.scope.redacted(),
            key = %held.key.logged(self.key_log),
            "the outcome is unknown; the key stays in flight until its lease ends, then a retry runs again as a recovered attempt"
        );
        Recorded::Unknown
    }

    async fn complete(&self, held: &Held, outcome: Outcome, deadline: tokio::time::Instant) -> Recorded {
        let result = self
            .retrying(
                (&held.scope, &held.key),
                Op::Complete,
                Until::Deadline(deadline),
                || self.store.complete(held, outcome.clone(), self.retention),
            )
            .await;
        self.completion(held, result)
    }

    /// What the answer of a `complete` of `held` means for its outcome, counted and logged.
    fn completion(&self, held: &Held, result: Result<Fenced<Timestamp>, StoreError>) -> Recorded {
        match result {
            Ok(Fenced::Accepted(expires_at)) => {
                self.waiters.wake(&held.scope, &held.key);
                Recorded::Completed { expires_at }
            }
            Ok(Fenced::LeaseLost) => {
                tracing::warn!(
                    scope = %held.scope.redacted(),
                    key = %held.key.logged(self.key_log),
                    "complete refused: another attempt took the key over; this outcome is discarded"
                );
                self.lease_lost("complete")
            }
            Err(error) => self.not_recorded(
                held,
                error,
                "could not record the outcome; the key stays in flight until its lease expires",
            ),
        }
    }

    /// A `complete` or `release` refused for a stale token (`op`), counted.
    fn lease_lost(&self, op: &'static str) -> Recorded {
        metrics::counter!("idempotency_lease_lost_total", "guard" => self.name.clone(), "op" => op)
            .increment(1);
        Recorded::LeaseLost
    }

    /// A `complete` or `release` of `held` the store did not take (`error`), logged with `why`.
    fn not_recorded(&self, held: &Held, error: StoreError, why: &'static str) -> Recorded {
        tracing::error!(
            scope = %held.scope.redacted(),
            key = %held.key.logged(self.key_log),
            %error,
            "{why}"
        );
        Recorded::Failed(error)
    }

    async fn release(&self, held: &Held, deadline: tokio::time::Instant) -> Recorded {
        match self
            .retrying(
                (&held.scope, &held.key),
                Op::Release,
                Until::Deadline(deadline),
                || self.store.release(held),
            )
            .await
        {
            Ok(Fenced::Accepted(())) => {
                self.waiters.wake(&held.scope, &held.key);
                Recorded::Released
            }
            Ok(Fenced::LeaseLost) => self.lease_lost("release"),
            Err(error) => self.not_recorded(
                held,
                error,
                "could not release the key; it stays in flight until its lease expires",
            ),
        }
    }

    /// Calls a store operation again while it fails transiently, with [`STORE_RETRY`]'s backoff
    /// (50 ms doubling to 1 s), until `until` says stop. Every operation retried here is safe to
    /// repeat: `begin` and `complete` with the same token are accepted again. A repeated
    /// `release` whose first try took effect (its answer lost) answers `LeaseLost`: the key is
    /// free all the same, but the run is reported, and counted, as a lost lease.
    async fn retrying<R, Fut>(
        &self,
        (scope, key): (&Scope, &Key),
        op: Op,
        until: Until,
        mut call: impl FnMut() -> Fut,
    ) -> Result<R, StoreError>
    where
        Fut: Future<Output = Result<R, StoreError>>,
    {
        let mut tries = 1;
        loop {
            let backoff = STORE_RETRY.delay(tries);
            match self.timed(op, call()).await {
                Err(error) if error.is_retryable() && until.allows(tries, backoff) => {
                    tracing::warn!(
                        scope = %scope.redacted(),
                        key = %key.logged(self.key_log),
                        %error,
                        tries,
                        "{} failed; retrying",
                        op.as_str()
                    );
                    tokio::time::sleep(backoff).await;
                    tries += 1;
                }
                other => return other,
            }
        }
    }

    async fn timed<R>(
        &self,
        op: Op,
        call: impl Future<Output = Result<R, StoreError>>,
    ) -> Result<R, StoreError> {
        let result = self.timed_call(op, call).await;
        if let Err(error) = &result {
            self.count_error(op, error);
        }
        result
    }

    /// A batch call timed as one round trip, each failed answer counted.
    async fn timed_many<R>(
        &self,
        op: Op,
        call: impl Future<Output = Vec<Result<R, StoreError>>>,
    ) -> Vec<Result<R, StoreError>> {
        let answers = self.timed_call(op, call).await;
        for error in answers.iter().filter_map(|answer| answer.as_ref().err()) {
            self.count_error(op, error);
        }
        answers
    }

    /// Runs a store call in its span and records its duration.
    async fn timed_call<R>(&self, op: Op, call: impl Future<Output = R>) -> R {
        let started = Instant::now();
        let result = call
            .instrument(tracing::info_span!("idempotency.store", op = op.as_str()))
            .await;
        self.hot().durations[op as usize].record(started.elapsed().as_secs_f64());
        result
    }

    fn count_error(&self, op: Op, error: &StoreError) {
        metrics::counter!(
            "idempotency_store_errors_total",
            "guard" => self.name.clone(),
            "op" => op.as_str(),
            "kind" => error.kind().as_str(),
        )
        .increment(1);
    }
}

impl<S: TransactionalStore> Guard<S> {
    /// Runs `operation` at most once per `(scope, key)` inside a transaction of the store, with
    /// the record claimed and completed in that same transaction; see
    /// [`transaction`](crate::transaction). The answers are those of [`Guard::run`]: the policy
    /// decides from the operation's value whether to commit with the outcome
    /// ([`Recorded::Completed`]) or to roll everything back ([`Recorded::Released`]); a failed
    /// completion or commit is [`Recorded::Failed`] (rolled back, or a commit whose fate is
    /// unknown: the retry replays if it did commit). There is no heartbeat: an uncommitted claim
    /// cannot expire under the operation.
    ///
    /// ```no_run
    /// use idempotency_core::{Decision, Execution, Fingerprint, Guard, Key, Outcome, Scope};
    /// use idempotency_core::TransactionalStore;
    ///
    /// # async fn example<S: TransactionalStore>(guard: Guard<S>) -> Result<(), Box<dyn std::error::Error>> {
    /// let policy = |written: &Result<u64, std::io::Error>| match written {
    ///     Ok(rows) => Decision::Complete(Outcome::new(rows.to_string())),
    ///     Err(_) => Decision::Release, // roll the rows back; a retry runs again
    /// };
    /// let run = guard
    ///     .run_in_transaction(
    ///         Scope::global(),
    ///         Key::new("order-7-charge")?,
    ///         Fingerprint::of_bytes(b"EUR 10"),
    ///         policy,
    ///         |_tx, _attempt| Box::pin(async move { Ok(1) /* write the charge row through `_tx` */ }),
    ///     )
    ///     .await?;
    /// assert!(matches!(run, Execution::Executed { .. } | Execution::Replayed(_)));
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// The store's error when the transaction or the claim fails: the operation did not run,
    /// and the caller must fail closed.
    pub async fn run_in_transaction<T, P, F>(
        &self,
        scope: Scope,
        key: Key,
        fingerprint: Fingerprint,
        policy: P,
        operation: F,
    ) -> Result<Execution<T>, StoreError>
    where
        T: Send,
        P: OutcomePolicy<T>,
        F: for<'t> FnOnce(&'t mut S::Transaction, Attempt) -> TxFuture<'t, T> + Send + 'static,
    {
        self.run_operation_in_transaction(scope, key, fingerprint, policy, InTransaction::new(operation))
            .await
    }

    /// [`Guard::run_in_transaction`] for a [`TxOperation`]: an operation that borrows what it
    /// works on (a delivered message, a request), which a closure returning a boxed future
    /// cannot hold.
    ///
    /// # Errors
    ///
    /// As [`Guard::run_in_transaction`].
    pub async fn run_operation_in_transaction<P, O>(
        &self,
        scope: Scope,
        key: Key,
        fingerprint: Fingerprint,
        policy: P,
        operation: O,
    ) -> Result<Execution<O::Value>, StoreError>
    where
        P: OutcomePolicy<O::Value>,
        O: TxOperation<S>,
    {
        let span = self.span(&scope, &key, true);
        self.run_in_transaction_inner(scope, key, fingerprint, policy, operation, &span)
            .instrument(span.clone())
            .await
    }

    async fn run_in_transaction_inner<P, O>(
        &self,
        scope: Scope,
        key: Key,
        fingerprint: Fingerprint,
        policy: P,
        operation: O,
        span: &tracing::Span,
    ) -> Result<Execution<O::Value>, StoreError>
    where
        P: OutcomePolicy<O::Value>,
        O: TxOperation<S>,
    {
        let request = self.request(scope, key, fingerprint);
        let mut tx = self
            .timed(Op::BeginTransaction, self.store.begin_transaction())
            .await?;
        let claim = match self
            .timed(Op::Begin, self.store.begin_in(&mut tx, &request))
            .await
        {
            Ok(claim) => claim,
            Err(error) => {
                self.store.rollback(tx).await;
                return Err(error);
            }
        };
        let held = match self.acquired(claim, span) {
            Ok(held) => held,
            Err(answer) => {
                // Nothing was written.
                self.store.rollback(tx).await;
                return Ok(answer);
            }
        };
        // A panic unwinds through here and drops the transaction, which rolls it back.
        let value = operation.run(&mut tx, Attempt::of(&held)).await;
        let recorded = match policy.decide(&value) {
            Decision::Complete(outcome) => self.commit(tx, &held, &outcome).await,
            Decision::Release | Decision::Unknown => {
                self.store.rollback(tx).await;
                Recorded::Released
            }
        };
        Ok(self.executed(value, &held, recorded, span))
    }

    /// Writes the completion in `tx` and commits it with the operation's rows.
    async fn commit(&self, mut tx: S::Transaction, held: &Held, outcome: &Outcome) -> Recorded {
        let completed = self
            .timed(
                Op::Complete,
                self.store.complete_in(&mut tx, held, outcome, self.retention),
            )
            .await;
        let failed = match completed {
            Ok(Fenced::Accepted(expires_at)) => {
                return match self.timed(Op::Commit, self.store.commit(tx)).await {
                    Ok(()) => {
                        self.waiters.wake(&held.scope, &held.key);
                        Recorded::Completed { expires_at }
                    }
                    Err(error) => {
                        tracing::error!(
                            scope = %held.scope.redacted(),
                            key = %held.key.logged(self.key_log),
                            %error,
                            "commit failed; its fate is unknown, a retry replays if it committed"
                        );
                        Recorded::Failed(error)
                    }
                };
            }
            // Unreachable while the claim's row lock is held; refuse to commit rather than guess.
            Ok(Fenced::LeaseLost) => StoreError::new(
                ErrorKind::Protocol,
                "the record claimed in this transaction was not there to complete",
            ),
            Err(error) => error,
        };
        tracing::error!(
            scope = %held.scope.redacted(),
            key = %held.key.logged(self.key_log),
            error = %failed,
            "could not record the outcome; rolling the transaction back"
        );
        self.store.rollback(tx).await;
        Recorded::Failed(failed)
    }
}

/// The backoff between tries of a store call that failed transiently.
const STORE_RETRY: Backoff = Backoff {
    initial: Duration::from_millis(50),
    max: Duration::from_secs(1),
};

/// How long [`Guard::retrying`] keeps trying.
#[derive(Debug, Clone, Copy)]
enum Until {
    /// At most this many tries in all.
    Tries(u32),
    /// Until the next try would start after this instant: the end of the lease this attempt
    /// surely holds. Settling an outcome is worth retrying for that long, because the operation
    /// has already run: giving up early leaves the key in flight, and after the lease a retry
    /// would run the operation a second time. Past the lease, another attempt may have taken
    /// over and the answer would be `LeaseLost` anyway.
    Deadline(tokio::time::Instant),
}

impl Until {
    fn allows(self, tries: u32, backoff: Duration) -> bool {
        match self {
            Self::Tries(most) => tries < most,
            Self::Deadline(deadline) => tokio::time::Instant::now() + backoff < deadline,
        }
    }
}

/// `start + duration`, or about thirty years on when that is past what an `Instant` holds (a
/// lease of `Duration::MAX`): never a panic.
fn later(start: tokio::time::Instant, duration: Duration) -> tokio::time::Instant {
    start
        .checked_add(duration)
        .unwrap_or_else(|| start + Duration::from_secs(30 * 365 * 86_400))
}

fn held_for(held_until: &Mutex<tokio::time::Instant>) -> tokio::time::Instant {
    *held_until.lock().unwrap_or_else(PoisonError::into_inner)
}
