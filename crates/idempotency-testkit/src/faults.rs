//! A store wrapper that injects failures, for testing what edges do when the store misbehaves.
//!
//! [`FaultyStore`] forwards to a real store and can, per operation:
//!
//! * be **down** — every call fails with [`ErrorKind::Unavailable`] and reaches nothing;
//! * **fail the next n calls** before they reach the store;
//! * **lose the next n replies** — the call reaches the store and takes effect, then the caller
//!   gets an error, as when a connection drops after the server committed;
//! * **hold the next call** until the test opens a [`Gate`], as a store that is slow for one
//!   caller, ordered by events rather than by a delay.
//!
//! It also counts the calls per operation.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::{
    BeginRequest, Claim, ErrorKind, Fenced, Held, Key, ListFilter, Outcome, Record, RecordSummary, Scope,
    Stats, Store, StoreAdmin, StoreError, Timestamp, Token,
};

/// A store operation, for aiming faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// `begin`
    Begin,
    /// `complete`
    Complete,
    /// `release`
    Release,
    /// `extend`
    Extend,
    /// `get`
    Get,
    /// `stats`, `list` and `purge_expired`
    Admin,
}

#[derive(Debug, Default)]
struct Faults {
    down: AtomicBool,
    plan: Mutex<HashMap<Op, Plan>>,
}

#[derive(Debug, Default)]
struct Plan {
    fail_next: u32,
    lose_next: u32,
    calls: u64,
    delay: Duration,
    /// The next call waits until its [`Gate`] is opened (dropped).
    hold: Option<tokio::sync::oneshot::Receiver<()>>,
}

/// Holds the call of a [`FaultyStore`] it was made for ([`FaultyStore::hold_next`]) until it
/// is opened or dropped.
#[derive(Debug)]
pub struct Gate(
    #[expect(dead_code, reason = "held only to be dropped: dropping it opens the gate")]
    tokio::sync::oneshot::Sender<()>,
);

impl Gate {
    /// Lets the held call reach the store.
    pub fn open(self) {
        drop(self);
    }
}

enum Fault {
    None,
    Fail,
    LoseReply,
}

/// A store wrapper that injects failures; see the [module docs](self). Clones share the faults.
#[derive(Debug, Clone)]
pub struct FaultyStore<S> {
    inner: S,
    faults: Arc<Faults>,
}

impl<S> FaultyStore<S> {
    /// Wraps `inner`, initially healthy.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            faults: Arc::default(),
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Takes the store down (every call fails without reaching it) or brings it back.
    pub fn set_down(&self, down: bool) {
        self.faults.down.store(down, Ordering::SeqCst);
    }

    /// Makes the next `n` calls of `op` fail before reaching the store.
    pub fn fail_next(&self, op: Op, n: u32) {
        self.with_plan(op, |plan| plan.fail_next += n);
    }

    /// Makes the next `n` calls of `op` take effect in the store and then fail, as if the reply
    /// was lost.
    pub fn lose_next_replies(&self, op: Op, n: u32) {
        self.with_plan(op, |plan| plan.lose_next += n);
    }

    /// Makes every later call of `op` wait `delay` before it reaches the store, as a slow or
    /// busy store would (zero: no delay).
    pub fn delay(&self, op: Op, delay: Duration) {
        self.with_plan(op, |plan| plan.delay = delay);
    }

    /// Makes the next call of `op` wait, before it reaches the store, until the returned gate
    /// is opened (or dropped); later calls go through.
    #[must_use = "the call is held until the gate is opened or dropped"]
    pub fn hold_next(&self, op: Op) -> Gate {
        let (gate, held) = tokio::sync::oneshot::channel();
        self.with_plan(op, |plan| plan.hold = Some(held));
        Gate(gate)
    }

    /// How many times `op` was called (failed calls included).
    pub fn calls(&self, op: Op) -> u64 {
        self.with_plan(op, |plan| plan.calls)
    }

    fn with_plan<R>(&self, op: Op, f: impl FnOnce(&mut Plan) -> R) -> R {
        let mut plans = self.faults.plan.lock().unwrap_or_else(PoisonError::into_inner);
        f(plans.entry(op).or_default())
    }

    fn next_fault(&self, op: Op) -> Fault {
        let down = self.faults.down.load(Ordering::SeqCst);
        self.with_plan(op, |plan| {
            plan.calls += 1;
            if down {
                Fault::Fail
            } else if plan.fail_next > 0 {
                plan.fail_next -= 1;
                Fault::Fail
            } else if plan.lose_next > 0 {
                plan.lose_next -= 1;
                Fault::LoseReply
            } else {
                Fault::None
            }
        })
    }

    async fn call<R>(
        &self,
        op: Op,
        call: impl Future<Output = Result<R, StoreError>>,
    ) -> Result<R, StoreError> {
        let delay = self.with_plan(op, |plan| plan.delay);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let fault = self.next_fault(op);
        // Counted, then held: a test sees the call before it reaches the store.
        if let Some(hold) = self.with_plan(op, |plan| plan.hold.take()) {
            // The gate opens when its sender is gone.
            let _ = hold.await;
        }
        match fault {
            Fault::None => call.await,
            Fault::Fail => Err(injected(op, "refused")),
            Fault::LoseReply => {
                let _ = call.await;
                Err(injected(op, "reply lost"))
            }
        }
    }
}

fn injected(op: Op, what: &str) -> StoreError {
    StoreError::new(ErrorKind::Unavailable, format!("injected fault: {op:?} {what}"))
}

#[async_trait]
impl<S: Store> Store for FaultyStore<S> {
    async fn begin(&self, request: &BeginRequest) -> Result<Claim, StoreError> {
        self.call(Op::Begin, self.inner.begin(request)).await
    }

    async fn complete(
        &self,
        held: &Held,
        outcome: Outcome,
        retention: Duration,
    ) -> Result<Fenced<Timestamp>, StoreError> {
        self.call(Op::Complete, self.inner.complete(held, outcome, retention))
            .await
    }

    async fn release(&self, held: &Held) -> Result<Fenced<()>, StoreError> {
        self.call(Op::Release, self.inner.release(held)).await
    }

    async fn extend(&self, held: &Held, lease: Duration) -> Result<Fenced<Timestamp>, StoreError> {
        self.call(Op::Extend, self.inner.extend(held, lease)).await
    }

    async fn get(&self, scope: &Scope, key: &Key) -> Result<Option<Record>, StoreError> {
        self.call(Op::Get, self.inner.get(scope, key)).await
    }
}

#[async_trait]
impl<S: StoreAdmin> StoreAdmin for FaultyStore<S> {
    async fn stats(&self, scope: Option<&Scope>) -> Result<Stats, StoreError> {
        self.call(Op::Admin, self.inner.stats(scope)).await
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordSummary>, StoreError> {
        self.call(Op::Admin, self.inner.list(filter)).await
    }

    async fn purge_expired(&self, limit: u64) -> Result<u64, StoreError> {
        self.call(Op::Admin, self.inner.purge_expired(limit)).await
    }

    async fn forget(&self, scope: &Scope, key: &Key, token: Token) -> Result<Fenced<()>, StoreError> {
        self.call(Op::Admin, self.inner.forget(scope, key, token)).await
    }
}
