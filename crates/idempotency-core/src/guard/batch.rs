//! The guard's batch path: records claimed in one store round trip ([`Guard::claim_many`]),
//! their operations run by the caller (in order, or not), their leases kept alive together
//! ([`Guard::keep_alive`]), and their outcomes recorded in one round trip
//! ([`Guard::finish_many`]) before the caller acknowledges anything.
//!
//! Each key keeps the answers of [`Guard::run`]: its own claim, token, fencing, attempt,
//! replay, in-flight and mismatch answers, since the store's batch calls answer each key as its
//! single call would. What the batch changes is the number of round trips (two per batch
//! instead of two per key) and, on SQL stores, of commits.
//!
//! The caller runs the operations, and must catch their panics (a consumer turns a panic into
//! a failed value, which the policy releases). A [`ClaimedRun`] dropped without being finished
//! (the task aborted: a crash) keeps its lease until it runs out, then the key is taken over
//! as a recovered attempt, exactly as after a crash of [`Guard::run`].
//!
//! ```
//! use idempotency_core::{Claimed, Decision, Execution, Fingerprint, Guard, Key, MemoryStore, Outcome, Recorded, Scope};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! let guard = Guard::new(MemoryStore::new());
//! let item = |key: &str| (Scope::global(), Key::new(key).unwrap(), Fingerprint::of_bytes(b"EUR 10"));
//! // `order-1` twice: the first claims it, the second finds it in flight (its own batch holds it).
//! let claims = guard.claim_many::<u32>(vec![item("order-1"), item("order-2"), item("order-1")]).await;
//! let mut ran = Vec::new();
//! for claim in claims {
//!     match claim.unwrap() {
//!         Claimed::Run(run) => ran.push((run, 10)), // the side effect runs here, in order
//!         Claimed::Answer(answer) => assert!(matches!(answer, Execution::InFlight { .. })),
//!     }
//! }
//! let policy = |charged: &u32| Decision::Complete(Outcome::new(charged.to_string()));
//! let finished = guard.finish_many(ran, &policy).await;
//! assert!(finished.iter().all(|run| matches!(
//!     run,
//!     Execution::Executed { recorded: Recorded::Completed { .. }, .. }
//! )));
//! // Recorded: the same keys again are replays.
//! let again = guard.claim_many::<u32>(vec![item("order-1")]).await;
//! assert!(matches!(again[0], Ok(Claimed::Answer(Execution::Replayed(_)))));
//! # });
//! ```

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::{Attempt, Decision, Execution, Guard, Op, OutcomePolicy, Recorded, STORE_RETRY, held_for, later};
use crate::{BeginRequest, Completion, Fingerprint, Held, Key, Scope, Store, StoreError};

/// One answer of [`Guard::claim_many`]: a record this guard now holds, whose operation the
/// caller runs, or the answer for a key it does not hold (a replay, a key in flight, a
/// mismatch), as [`Guard::run`] would give it.
#[derive(Debug)]
#[must_use = "a claimed run holds its key until it is finished or handed back"]
pub enum Claimed<T> {
    /// The key is held: run the operation as [`ClaimedRun::attempt`], then finish it with
    /// [`Guard::finish_many`] (or hand it back with [`Guard::hand_back`]).
    Run(ClaimedRun),
    /// The key is not held: [`Execution::Replayed`], [`Execution::InFlight`] or
    /// [`Execution::Mismatch`].
    Answer(Execution<T>),
}

/// A record claimed by [`Guard::claim_many`] whose outcome is not recorded yet.
#[derive(Debug)]
pub struct ClaimedRun {
    attempt: Attempt,
    live: Arc<Live>,
}

/// What the heartbeat and the finishing share of a claimed run.
#[derive(Debug)]
struct Live {
    held: Held,
    /// The attempt's flag: set when the heartbeat finds another attempt took the key over.
    lease_lost: Arc<AtomicBool>,
    /// Until when the run surely holds its lease, by the local clock (see [`Guard::run`]).
    held_until: Mutex<tokio::time::Instant>,
    /// Set once its outcome is recorded or it was handed back: the heartbeat stops.
    finished: AtomicBool,
}

impl ClaimedRun {
    /// A run of `held`, which surely holds its lease until `held_until`.
    pub(super) fn new(held: Held, held_until: tokio::time::Instant) -> Self {
        let attempt = Attempt::of(&held);
        Self {
            live: Arc::new(Live {
                lease_lost: Arc::clone(&attempt.lease_lost),
                held,
                held_until: Mutex::new(held_until),
                finished: AtomicBool::new(false),
            }),
            attempt,
        }
    }

    /// The record it holds.
    pub(super) fn held(&self) -> &Held {
        &self.live.held
    }

    /// Marks it finished: a heartbeat that keeps its lease stops.
    pub(super) fn finish(&self) {
        self.live.finished.store(true, Ordering::Release);
    }

    /// The attempt the operation runs as (its number, whether it took an expired lease over,
    /// whether the heartbeat found the lease lost meanwhile).
    #[must_use]
    pub fn attempt(&self) -> &Attempt {
        &self.attempt
    }

    /// A handle on this run's lease, for [`Guard::keep_alive`].
    #[must_use]
    pub fn lease(&self) -> RunLease {
        RunLease(Arc::clone(&self.live))
    }
}

/// A claimed run's lease, kept alive by [`Guard::keep_alive`] until the run is finished.
#[derive(Debug, Clone)]
pub struct RunLease(Arc<Live>);

impl<S: Store> Guard<S> {
    /// Claims every `(scope, key, fingerprint)` of `items` with one [`Store::begin_many`]
    /// (tried a second time, for the keys whose first try failed transiently, with the same
    /// tokens), and answers each in order: [`Claimed::Run`] when this guard now holds the key,
    /// [`Claimed::Answer`] otherwise, or the store's error for that key (the caller fails it
    /// closed). The same key twice in `items` is claimed by its first occurrence; the second
    /// finds it in flight.
    ///
    /// Counted and logged as [`Guard::run`]'s claims are; the round trip is timed as
    /// `op="begin_many"`.
    pub async fn claim_many<T>(
        &self,
        items: Vec<(Scope, Key, Fingerprint)>,
    ) -> Vec<Result<Claimed<T>, StoreError>> {
        if items.is_empty() {
            return Vec::new();
        }
        let requests: Vec<BeginRequest> = items
            .into_iter()
            .map(|(scope, key, fingerprint)| self.request(scope, key, fingerprint))
            .collect();
        let asked = tokio::time::Instant::now();
        let mut sent = vec![asked; requests.len()];
        let mut answers = self
            .timed_many(Op::BeginMany, self.store.begin_many(&requests))
            .await;
        let failed: Vec<usize> = answers
            .iter()
            .enumerate()
            .filter(|(_, answer)| answer.as_ref().is_err_and(StoreError::is_retryable))
            .map(|(index, _)| index)
            .collect();
        if let Some(&first) = failed.first() {
            if let Err(error) = &answers[first] {
                tracing::warn!(guard = &*self.name, %error, keys = failed.len(), "begin_many failed; retrying");
            }
            tokio::time::sleep(STORE_RETRY.delay(1)).await;
            let again: Vec<BeginRequest> = failed.iter().map(|&index| requests[index].clone()).collect();
            let asked = tokio::time::Instant::now();
            let retried = self
                .timed_many(Op::BeginMany, self.store.begin_many(&again))
                .await;
            for (index, answer) in failed.into_iter().zip(retried) {
                answers[index] = answer;
                sent[index] = asked;
            }
        }
        answers
            .into_iter()
            .zip(sent)
            .map(|(answer, sent)| {
                answer.map(|claim| match self.acquired(claim, &tracing::Span::none()) {
                    Ok(held) => Claimed::Run(ClaimedRun::new(held, later(sent, self.lease))),
                    Err(answer) => Claimed::Answer(answer),
                })
            })
            .collect()
    }

    /// Extends the leases of `leases` every heartbeat interval (a third of the lease by
    /// default) until dropped, skipping those finished or lost; never returns. Run it beside
    /// the operations of a batch, so that the last run of a long batch still holds its key when
    /// its turn comes.
    pub async fn keep_alive(&self, leases: &[RunLease]) -> std::convert::Infallible {
        let every = self.heartbeat_interval();
        let runs: Vec<_> = leases.iter().map(|lease| Arc::clone(&lease.0)).collect();
        loop {
            tokio::time::sleep(every).await;
            for live in &runs {
                if !live.finished.load(Ordering::Acquire) {
                    self.beat(&live.held, &live.lease_lost, &live.held_until, every)
                        .await;
                }
            }
        }
    }

    /// Records the outcome of each run of `finished` (its run and the operation's value) as
    /// `policy` decides: the completions in one [`Store::complete_many`] (timed as
    /// `op="complete_many"`; a completion that failed transiently is tried again on its own
    /// while the run surely holds its lease), the releases and unknown outcomes one by one.
    /// Answers each run as [`Guard::run`] would, in order. Acknowledge a message only after
    /// its answer here says [`Recorded::Completed`].
    pub async fn finish_many<T, P: OutcomePolicy<T>>(
        &self,
        finished: Vec<(ClaimedRun, T)>,
        policy: &P,
    ) -> Vec<Execution<T>> {
        let decisions: Vec<Decision> = finished.iter().map(|(_, value)| policy.decide(value)).collect();
        let mut recorded: Vec<Option<Recorded>> = finished.iter().map(|_| None).collect();
        let completions: Vec<(usize, Completion)> = finished
            .iter()
            .zip(&decisions)
            .enumerate()
            .filter_map(|(index, ((run, _), decision))| match decision {
                Decision::Complete(outcome) => Some((
                    index,
                    Completion::new(run.live.held.clone(), outcome.clone(), self.retention),
                )),
                _ => None,
            })
            .collect();
        if !completions.is_empty() {
            let batch: Vec<Completion> = completions
                .iter()
                .map(|(_, completion)| completion.clone())
                .collect();
            let answers = self
                .timed_many(Op::CompleteMany, self.store.complete_many(&batch))
                .await;
            for ((index, completion), answer) in completions.into_iter().zip(answers) {
                let live = &finished[index].0.live;
                recorded[index] = Some(match answer {
                    Err(error) if error.is_retryable() => {
                        tracing::warn!(guard = &*self.name, %error, "complete_many failed for a key; retrying it alone");
                        let deadline = held_for(&live.held_until);
                        self.complete(&live.held, completion.outcome, deadline).await
                    }
                    answer => self.completion(&live.held, answer),
                });
            }
        }
        let mut executions = Vec::with_capacity(finished.len());
        for (((run, value), decision), recorded) in finished.into_iter().zip(decisions).zip(recorded) {
            let live = &run.live;
            let recorded = match (recorded, decision) {
                (Some(recorded), _) => recorded,
                (None, Decision::Release) => self.release(&live.held, held_for(&live.held_until)).await,
                (None, _) => self.unknown(&live.held),
            };
            live.finished.store(true, Ordering::Release);
            executions.push(self.executed(value, &live.held, recorded, &tracing::Span::none()));
        }
        executions
    }

    /// Releases a claimed run whose operation did not run (a batch that stopped before its
    /// turn): the key can be claimed again at once, as the next attempt.
    pub async fn hand_back(&self, run: ClaimedRun) -> Recorded {
        let live = &run.live;
        let recorded = self.release(&live.held, held_for(&live.held_until)).await;
        live.finished.store(true, Ordering::Release);
        recorded
    }
}
