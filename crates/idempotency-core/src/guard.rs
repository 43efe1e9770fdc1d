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
//!    or `release` so that a retry runs again. A panic releases the record and then resumes
//!    unwinding. Transient store errors while settling are retried with backoff for as long as
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
//! Each run is a `tracing` span `idempotency.run` (scope and key shortened; fields `attempt` and
//! `result`), each store call inside it a `debug` span `idempotency.store` (field `op`), and the
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
//! | `idempotency_store_errors_total` | counter | failed store calls (`op`, `kind` labels) |
//! | `idempotency_store_duration_seconds` | histogram | store call latency (`op` label) |

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use tracing::Instrument;

use crate::{
    BeginRequest, Claim, Completed, DEFAULT_LEASE, DEFAULT_RETENTION, Fenced, Fingerprint, Key, Outcome,
    Scope, Store, StoreError, Timestamp, Token,
};

/// What to record for a finished operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The result is final: store this outcome and replay it to duplicates.
    Complete(Outcome),
    /// The result is not final (a transient failure): delete the record so a retry runs again.
    Release,
}

/// Decides, from an operation's value, whether it is final ([`Decision::Complete`]) or must be
/// retried ([`Decision::Release`]).
///
/// Any `Fn(&T) -> Decision` is a policy:
///
/// ```
/// use idempotency_core::{Decision, Outcome, OutcomePolicy};
///
/// let policy = |result: &Result<u64, String>| match result {
///     Ok(charge_id) => Decision::Complete(Outcome::new(charge_id.to_string())),
///     Err(_) => Decision::Release,
/// };
/// assert_eq!(policy.decide(&Err("gateway timeout".into())), Decision::Release);
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
    name: &'static str,
    lease: Duration,
    retention: Duration,
    heartbeat: Option<Duration>,
}

impl<S: Store> Guard<S> {
    /// A guard over `store` with a 60 s lease, 24 h retention and a heartbeat every lease/3.
    pub fn new(store: S) -> Self {
        Self {
            store,
            name: "default",
            lease: DEFAULT_LEASE,
            retention: DEFAULT_RETENTION,
            heartbeat: None,
        }
    }

    /// Names the guard in spans and metrics labels (for example the route or consumer name).
    #[must_use]
    pub fn name(mut self, name: &'static str) -> Self {
        self.name = name;
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

    /// The configured lease.
    pub fn lease_duration(&self) -> Duration {
        self.lease
    }

    /// The configured retention.
    pub fn retention_duration(&self) -> Duration {
        self.retention
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
        let span = tracing::info_span!(
            "idempotency.run",
            guard = self.name,
            scope = %scope.redacted(),
            key = %key.redacted(),
            attempt = tracing::field::Empty,
            result = tracing::field::Empty,
        );
        self.run_inner(scope, key, fingerprint, policy, operation)
            .instrument(span)
            .await
    }

    async fn run_inner<T, P, F, Fut>(
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
        let request = BeginRequest {
            scope,
            key,
            fingerprint,
            token: Token::random(),
            lease: self.lease,
            retention: self.retention,
        };
        let span = tracing::Span::current();
        // A retried `begin` reuses the token, so a first try that took effect but whose reply
        // was lost is recognised as ours instead of blocking the key for a whole lease.
        let asked = tokio::time::Instant::now();
        let claim = self
            .retrying("begin", Until::Tries(2), || self.store.begin(&request))
            .await?;
        let (token, attempt, recovered) = match claim {
            Claim::Acquired {
                token,
                attempt,
                recovered,
                ..
            } => (token, attempt, recovered),
            Claim::Replay(completed) => {
                span.record("result", "replayed");
                metrics::counter!("idempotency_replayed_total", "guard" => self.name).increment(1);
                return Ok(Execution::Replayed(completed));
            }
            Claim::InFlight { attempt, retry_after } => {
                span.record("result", "in_flight");
                metrics::counter!("idempotency_in_flight_total", "guard" => self.name).increment(1);
                return Ok(Execution::InFlight { attempt, retry_after });
            }
            Claim::Mismatch => {
                span.record("result", "mismatch");
                metrics::counter!("idempotency_mismatch_total", "guard" => self.name).increment(1);
                return Ok(Execution::Mismatch);
            }
        };
        span.record("attempt", attempt);
        metrics::counter!(
            "idempotency_acquired_total",
            "guard" => self.name,
            "recovered" => if recovered { "true" } else { "false" },
        )
        .increment(1);
        if recovered {
            metrics::counter!("idempotency_lease_takeovers_total", "guard" => self.name).increment(1);
            tracing::warn!(
                attempt,
                "took over an expired lease: a previous attempt may have partially run"
            );
        }

        // Until when this attempt surely holds the lease, by the local clock: the time the last
        // accepted `begin` or `extend` was *sent*, plus the lease.
        let held_until = Mutex::new(asked + self.lease);
        let lease_lost = Arc::new(AtomicBool::new(false));
        let context = Attempt {
            scope: request.scope.clone(),
            key: request.key.clone(),
            number: attempt,
            recovered,
            lease_lost: Arc::clone(&lease_lost),
        };
        let work = AssertUnwindSafe(operation(context)).catch_unwind();
        let heartbeat = self.heartbeat(&request, token, &lease_lost, &held_until);
        let finished = tokio::select! {
            finished = work => finished,
            never = heartbeat => match never {},
        };

        let value = match finished {
            Ok(value) => value,
            Err(panic) => {
                span.record("result", "panicked");
                tracing::error!("operation panicked; releasing the key so a retry can run");
                let _ = self.release(&request, token, held(&held_until)).await;
                std::panic::resume_unwind(panic);
            }
        };
        let deadline = held(&held_until);
        let recorded = match policy.decide(&value) {
            Decision::Complete(outcome) => self.complete(&request, token, outcome, deadline).await,
            Decision::Release => self.release(&request, token, deadline).await,
        };
        span.record(
            "result",
            match &recorded {
                Recorded::Completed { .. } => "completed",
                Recorded::Released => "released",
                Recorded::LeaseLost => "lease_lost",
                Recorded::Failed(_) => "settle_failed",
            },
        );
        Ok(Execution::Executed {
            value,
            attempt,
            recovered,
            recorded,
        })
    }

    /// Extends the lease every `heartbeat` until dropped; never returns.
    async fn heartbeat(
        &self,
        request: &BeginRequest,
        token: Token,
        lease_lost: &AtomicBool,
        held_until: &Mutex<tokio::time::Instant>,
    ) -> std::convert::Infallible {
        let every = self
            .heartbeat
            .unwrap_or(self.lease / 3)
            .max(Duration::from_millis(1));
        loop {
            tokio::time::sleep(every).await;
            if lease_lost.load(Ordering::Relaxed) {
                continue;
            }
            let sent = tokio::time::Instant::now();
            match self
                .timed(
                    "extend",
                    self.store.extend(&request.scope, &request.key, token, self.lease),
                )
                .await
            {
                Ok(Fenced::Accepted(_)) => {
                    *held_until.lock().unwrap_or_else(PoisonError::into_inner) = sent + self.lease;
                }
                Ok(Fenced::LeaseLost) => {
                    lease_lost.store(true, Ordering::Relaxed);
                    metrics::counter!("idempotency_lease_lost_total", "guard" => self.name, "op" => "extend")
                        .increment(1);
                    tracing::warn!("heartbeat refused: another attempt took the key over");
                }
                // Keep beating: the lease is still ours until it expires, and the store may come
                // back before then.
                Err(error) => tracing::warn!(%error, "heartbeat failed"),
            }
        }
    }

    async fn complete(
        &self,
        request: &BeginRequest,
        token: Token,
        outcome: Outcome,
        deadline: tokio::time::Instant,
    ) -> Recorded {
        let result = self
            .retrying("complete", Until::Deadline(deadline), || {
                self.store.complete(
                    &request.scope,
                    &request.key,
                    token,
                    outcome.clone(),
                    self.retention,
                )
            })
            .await;
        match result {
            Ok(Fenced::Accepted(expires_at)) => Recorded::Completed { expires_at },
            Ok(Fenced::LeaseLost) => {
                metrics::counter!("idempotency_lease_lost_total", "guard" => self.name, "op" => "complete")
                    .increment(1);
                tracing::warn!(
                    "complete refused: another attempt took the key over; this outcome is discarded"
                );
                Recorded::LeaseLost
            }
            Err(error) => {
                tracing::error!(%error, "could not record the outcome; the key stays in flight until its lease expires");
                Recorded::Failed(error)
            }
        }
    }

    async fn release(
        &self,
        request: &BeginRequest,
        token: Token,
        deadline: tokio::time::Instant,
    ) -> Recorded {
        match self
            .retrying("release", Until::Deadline(deadline), || {
                self.store.release(&request.scope, &request.key, token)
            })
            .await
        {
            Ok(Fenced::Accepted(())) => Recorded::Released,
            Ok(Fenced::LeaseLost) => {
                metrics::counter!("idempotency_lease_lost_total", "guard" => self.name, "op" => "release")
                    .increment(1);
                Recorded::LeaseLost
            }
            Err(error) => {
                tracing::error!(%error, "could not release the key; it stays in flight until its lease expires");
                Recorded::Failed(error)
            }
        }
    }

    /// Calls a store operation again while it fails transiently, with doubling backoff from
    /// 50 ms (at most 1 s), until `until` says stop. Every operation retried here is safe to
    /// repeat: `begin` and `complete` with the same token are accepted again, and a repeated
    /// `release` finds nothing to delete.
    async fn retrying<R, Fut>(
        &self,
        op: &'static str,
        until: Until,
        mut call: impl FnMut() -> Fut,
    ) -> Result<R, StoreError>
    where
        Fut: Future<Output = Result<R, StoreError>>,
    {
        let mut backoff = Duration::from_millis(50);
        let mut tries = 1;
        loop {
            match self.timed(op, call()).await {
                Err(error) if error.is_retryable() && until.allows(tries, backoff) => {
                    tracing::warn!(%error, tries, "{op} failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    tries += 1;
                }
                other => return other,
            }
        }
    }

    async fn timed<R>(
        &self,
        op: &'static str,
        call: impl Future<Output = Result<R, StoreError>>,
    ) -> Result<R, StoreError> {
        let started = Instant::now();
        let result = call
            .instrument(tracing::debug_span!("idempotency.store", op))
            .await;
        metrics::histogram!("idempotency_store_duration_seconds", "guard" => self.name, "op" => op)
            .record(started.elapsed().as_secs_f64());
        if let Err(error) = &result {
            metrics::counter!(
                "idempotency_store_errors_total",
                "guard" => self.name,
                "op" => op,
                "kind" => error.kind().as_str(),
            )
            .increment(1);
        }
        result
    }
}

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

fn held(held_until: &Mutex<tokio::time::Instant>) -> tokio::time::Instant {
    *held_until.lock().unwrap_or_else(PoisonError::into_inner)
}
