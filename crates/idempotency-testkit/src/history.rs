//! A history recorder: a [`Store`] wrapper that writes down every call it forwards, when it was
//! called, when it returned and what it answered, for [`crate::linearizability`] to check.
//!
//! Times are positions on one counter shared by every call on the recorder: a call's `called`
//! is taken before the call starts and its `returned` after it ends, so that when one call's
//! `returned` is below another's `called`, the first really ended before the second began. A
//! call that failed (the connection was cut, the server was away) has no answer: it may or may
//! not have taken effect, at any moment after it was called, and the checker treats it so.
//!
//! ```
//! use idempotency_core::{BeginRequest, Fingerprint, Key, MemoryStore, Scope, Store};
//! use idempotency_testkit::history::Recorder;
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let store = Recorder::new(MemoryStore::new());
//! let key = Key::new("order-1")?;
//! let request = BeginRequest::new(Scope::global(), key.clone(), Fingerprint::of_bytes(b"pay"));
//! store.begin(&request).await?;
//! let history = store.history();
//! assert_eq!(history.len(), 1);
//! assert_eq!(history[0].key, key);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::{
    BeginRequest, Claim, Completion, Fenced, Fingerprint, Held, Key, Outcome, Record, RecordState, Scope,
    Store, StoreError, Timestamp, Token,
};

/// What a call asked.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Input {
    /// `begin` with this fingerprint and token.
    Begin {
        /// The request's fingerprint.
        fingerprint: Fingerprint,
        /// The request's token.
        token: Token,
    },
    /// `complete` with this token and outcome.
    Complete {
        /// The held record's token.
        token: Token,
        /// The outcome to store.
        outcome: Outcome,
    },
    /// `release` with this token.
    Release {
        /// The held record's token.
        token: Token,
    },
    /// `extend` with this token.
    Extend {
        /// The held record's token.
        token: Token,
    },
    /// `get`.
    Get,
}

/// What a call answered, without the times in it (the model's clock is not the store's).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Output {
    /// `begin` acquired the record.
    Acquired {
        /// The attempt number.
        attempt: u32,
        /// Whether an earlier attempt may have partly run.
        recovered: bool,
    },
    /// `begin` found the record completed.
    Replay {
        /// The completed attempt's number.
        attempt: u32,
        /// The stored outcome.
        outcome: Outcome,
    },
    /// `begin` found the record held.
    InFlight {
        /// The holding attempt's number.
        attempt: u32,
    },
    /// `begin` found the record with another fingerprint.
    Mismatch,
    /// `complete`, `release` or `extend` accepted.
    Accepted,
    /// `complete`, `release` or `extend` refused.
    LeaseLost,
    /// `get` found no record.
    Absent,
    /// `get` found a record.
    Found(Found),
}

/// A record as `get` returned it, without its times.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Found {
    /// The record's fingerprint.
    pub fingerprint: Fingerprint,
    /// Its attempt number.
    pub attempt: u32,
    /// The holder's token, or the completing attempt's.
    pub token: Token,
    /// The outcome, if completed.
    pub outcome: Option<Outcome>,
}

impl Output {
    /// `begin`'s answer.
    #[must_use]
    pub fn of_claim(claim: &Claim) -> Self {
        match claim {
            Claim::Acquired(held) => Self::Acquired {
                attempt: held.attempt,
                recovered: held.recovered,
            },
            Claim::Replay(completed) => Self::Replay {
                attempt: completed.attempt,
                outcome: completed.outcome.clone(),
            },
            Claim::InFlight { attempt, .. } => Self::InFlight { attempt: *attempt },
            Claim::Mismatch => Self::Mismatch,
        }
    }

    /// `complete`'s, `release`'s or `extend`'s answer.
    #[must_use]
    pub fn of_fenced<T>(fenced: &Fenced<T>) -> Self {
        if fenced.is_lease_lost() {
            Self::LeaseLost
        } else {
            Self::Accepted
        }
    }

    /// `get`'s answer.
    #[must_use]
    pub fn of_record(record: Option<&Record>) -> Self {
        let Some(record) = record else {
            return Self::Absent;
        };
        let (token, outcome) = match &record.state {
            RecordState::InFlight { token, .. } => (*token, None),
            RecordState::Completed { token, outcome, .. } => (*token, Some(outcome.clone())),
        };
        Self::Found(Found {
            fingerprint: record.fingerprint,
            attempt: record.attempt,
            token,
            outcome,
        })
    }
}

/// One call, as the recorder saw it.
#[derive(Debug, Clone)]
pub struct Operation {
    /// The record's scope.
    pub scope: Scope,
    /// The record's key.
    pub key: Key,
    /// What was asked.
    pub input: Input,
    /// What was answered; `None` when the call failed (its effect is unknown).
    pub output: Option<Output>,
    /// When it was called (a position on the recorder's counter).
    pub called: u64,
    /// When it returned; `None` when it failed.
    pub returned: Option<u64>,
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let input = match &self.input {
            Input::Begin { fingerprint, token } => {
                format!("begin(fp {}…, {token:?})", &fingerprint.to_hex()[..8])
            }
            Input::Complete { token, outcome } => {
                format!(
                    "complete({token:?}, {:?})",
                    String::from_utf8_lossy(outcome.as_bytes())
                )
            }
            Input::Release { token } => format!("release({token:?})"),
            Input::Extend { token } => format!("extend({token:?})"),
            Input::Get => "get".to_owned(),
        };
        match (&self.output, self.returned) {
            (Some(output), Some(returned)) => {
                write!(f, "[{}..{returned}] {input} -> {output:?}", self.called)
            }
            _ => write!(f, "[{}..] {input} -> (no answer)", self.called),
        }
    }
}

/// Forwards every call to the store it wraps and records it; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct Recorder<S> {
    inner: S,
    clock: Arc<AtomicU64>,
    log: Arc<Mutex<Vec<Operation>>>,
}

impl<S: Store> Recorder<S> {
    /// Records the calls to `inner`.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            clock: Arc::default(),
            log: Arc::default(),
        }
    }

    /// The calls recorded so far, in the order they returned (failed calls when they failed).
    #[must_use]
    pub fn history(&self) -> Vec<Operation> {
        self.log.lock().expect("history lock").clone()
    }

    async fn record<T>(
        &self,
        scope: &Scope,
        key: &Key,
        input: Input,
        call: impl Future<Output = Result<T, StoreError>>,
        output: impl FnOnce(&T) -> Output,
    ) -> Result<T, StoreError> {
        let called = self.clock.fetch_add(1, Ordering::SeqCst);
        let result = call.await;
        let returned = self.clock.fetch_add(1, Ordering::SeqCst);
        let (output, returned) = match &result {
            Ok(value) => (Some(output(value)), Some(returned)),
            Err(_) => (None, None),
        };
        self.log.lock().expect("history lock").push(Operation {
            scope: scope.clone(),
            key: key.clone(),
            input,
            output,
            called,
            returned,
        });
        result
    }

    /// Records each call of a batch as a call of its own, all called when the batch was and
    /// returned when it returned: the checker may then order them any way (a store is held to
    /// the batch's order only for calls on one key, which the model's single calls cover).
    async fn record_many<T>(
        &self,
        calls: Vec<(Scope, Key, Input)>,
        batch: impl Future<Output = Vec<Result<T, StoreError>>>,
        output: impl Fn(&T) -> Output,
    ) -> Vec<Result<T, StoreError>> {
        let called = self.clock.fetch_add(1, Ordering::SeqCst);
        let results = batch.await;
        let returned = self.clock.fetch_add(1, Ordering::SeqCst);
        assert_eq!(
            results.len(),
            calls.len(),
            "a batch answers every call of it, once"
        );
        let mut log = self.log.lock().expect("history lock");
        for ((scope, key, input), result) in calls.into_iter().zip(&results) {
            let (output, returned) = match result {
                Ok(value) => (Some(output(value)), Some(returned)),
                Err(_) => (None, None),
            };
            log.push(Operation {
                scope,
                key,
                input,
                output,
                called,
                returned,
            });
        }
        results
    }
}

#[async_trait]
impl<S: Store> Store for Recorder<S> {
    async fn begin_many(&self, requests: &[BeginRequest]) -> Vec<Result<Claim, StoreError>> {
        let calls = requests
            .iter()
            .map(|request| {
                let input = Input::Begin {
                    fingerprint: request.fingerprint,
                    token: request.token,
                };
                (request.scope.clone(), request.key.clone(), input)
            })
            .collect();
        self.record_many(calls, self.inner.begin_many(requests), Output::of_claim)
            .await
    }

    async fn complete_many(&self, completions: &[Completion]) -> Vec<Result<Fenced<Timestamp>, StoreError>> {
        let calls = completions
            .iter()
            .map(|completion| {
                let input = Input::Complete {
                    token: completion.held.token,
                    outcome: completion.outcome.clone(),
                };
                (completion.held.scope.clone(), completion.held.key.clone(), input)
            })
            .collect();
        self.record_many(calls, self.inner.complete_many(completions), Output::of_fenced)
            .await
    }

    async fn begin(&self, request: &BeginRequest) -> Result<Claim, StoreError> {
        let input = Input::Begin {
            fingerprint: request.fingerprint,
            token: request.token,
        };
        self.record(
            &request.scope,
            &request.key,
            input,
            self.inner.begin(request),
            Output::of_claim,
        )
        .await
    }

    async fn complete(
        &self,
        held: &Held,
        outcome: Outcome,
        retention: Duration,
    ) -> Result<Fenced<Timestamp>, StoreError> {
        let input = Input::Complete {
            token: held.token,
            outcome: outcome.clone(),
        };
        self.record(
            &held.scope,
            &held.key,
            input,
            self.inner.complete(held, outcome, retention),
            Output::of_fenced,
        )
        .await
    }

    async fn release(&self, held: &Held) -> Result<Fenced<()>, StoreError> {
        let input = Input::Release { token: held.token };
        self.record(
            &held.scope,
            &held.key,
            input,
            self.inner.release(held),
            Output::of_fenced,
        )
        .await
    }

    async fn extend(&self, held: &Held, lease: Duration) -> Result<Fenced<Timestamp>, StoreError> {
        let input = Input::Extend { token: held.token };
        self.record(
            &held.scope,
            &held.key,
            input,
            self.inner.extend(held, lease),
            Output::of_fenced,
        )
        .await
    }

    async fn get(&self, scope: &Scope, key: &Key) -> Result<Option<Record>, StoreError> {
        self.record(scope, key, Input::Get, self.inner.get(scope, key), |record| {
            Output::of_record(record.as_ref())
        })
        .await
    }
}
