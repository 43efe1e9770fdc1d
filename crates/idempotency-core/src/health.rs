//! Whether a store's writes are working, as seen by the requests that use it.
//!
//! A health check that only reads can report "ok" while every write fails (a full disk, a
//! read-only replica after a failover, a revoked grant), and a load balancer then keeps sending
//! requests that all fail. [`Watched`] wraps a store and records the result of every write
//! (`begin`, `complete`, `release`, `extend`) in a [`WriteHealth`] the health check reads.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;

use crate::{
    BeginRequest, Claim, Completion, Fenced, Held, Key, ListFilter, Outcome, Record, RecordSummary, Scope,
    Stats, Store, StoreAdmin, StoreError, Timestamp, Token,
};

/// The results of a store's recent writes: shared by a [`Watched`] store and whoever reports
/// its health.
#[derive(Debug, Clone, Default)]
pub struct WriteHealth(Arc<State>);

#[derive(Debug, Default)]
struct State {
    /// Whether `failing` holds anything: a write that works while nothing failed (the common
    /// case, on every request's hot path) reads this and takes no lock.
    any: AtomicBool,
    /// The failures since the last write that worked, and the first and last of them.
    failing: Mutex<Option<Failing>>,
}

#[derive(Debug, Clone)]
struct Failing {
    count: u64,
    first: Instant,
    last: Instant,
    error: StoreError,
}

/// Writes have failed since the last one that worked.
#[derive(Debug, Clone)]
pub struct WriteFailure {
    /// How many writes failed in a row.
    pub count: u64,
    /// How long ago the first of them failed.
    pub since: Duration,
    /// How long ago the last of them failed.
    pub last: Duration,
    /// The last one's error.
    pub error: StoreError,
}

impl fmt::Display for WriteFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} store write(s) failed in a row over the last {}s (the last {}s ago): {}",
            self.count,
            self.since.as_secs(),
            self.last.as_secs(),
            self.error
        )
    }
}

impl WriteHealth {
    /// Records one write's result: an error adds to the failures, a success clears them.
    pub fn record<T>(&self, result: &Result<T, StoreError>) {
        if result.is_ok() && !self.0.any.load(Ordering::Acquire) {
            return;
        }
        let mut failing = self.0.failing.lock().unwrap_or_else(PoisonError::into_inner);
        match result {
            Ok(_) => {
                *failing = None;
                self.0.any.store(false, Ordering::Release);
            }
            Err(error) => {
                let now = Instant::now();
                self.0.any.store(true, Ordering::Release);
                let failing = failing.get_or_insert_with(|| Failing {
                    count: 0,
                    first: now,
                    last: now,
                    error: error.clone(),
                });
                failing.count += 1;
                failing.last = now;
                failing.error = error.clone();
            }
        }
    }

    /// The failures since the last write that worked, if the last write failed.
    #[must_use]
    pub fn failure(&self) -> Option<WriteFailure> {
        let failing = self.0.failing.lock().unwrap_or_else(PoisonError::into_inner);
        failing.as_ref().map(|failing| WriteFailure {
            count: failing.count,
            since: failing.first.elapsed(),
            last: failing.last.elapsed(),
            error: failing.error.clone(),
        })
    }
}

/// A store whose writes are recorded in a [`WriteHealth`]; everything else passes through.
///
/// ```
/// use idempotency_core::{BeginRequest, Fingerprint, Key, MemoryStore, Scope, Store, Watched};
///
/// # tokio_test_block_on(async {
/// let store = Watched::new(MemoryStore::new());
/// let health = store.health();
/// store.begin(&BeginRequest::new(Scope::global(), Key::new("k")?, Fingerprint::of_bytes(b""))).await?;
/// assert!(health.failure().is_none());
/// # Ok::<(), Box<dyn std::error::Error>>(()) });
/// # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
/// #     tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Watched<S> {
    inner: S,
    health: WriteHealth,
}

impl<S> Watched<S> {
    /// Wraps `inner` with a fresh [`WriteHealth`].
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            health: WriteHealth::default(),
        }
    }

    /// The health its writes are recorded in.
    #[must_use]
    pub fn health(&self) -> WriteHealth {
        self.health.clone()
    }

    fn record<T>(&self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        self.health.record(&result);
        result
    }

    /// Records a batch's answers: its first failure if any, else a success.
    fn record_all<T>(&self, results: Vec<Result<T, StoreError>>) -> Vec<Result<T, StoreError>> {
        match results.iter().find(|result| result.is_err()) {
            Some(failed) => self.health.record(failed),
            None if !results.is_empty() => self.health.record(&Ok::<(), StoreError>(())),
            None => {}
        }
        results
    }
}

#[async_trait]
impl<S: Store> Store for Watched<S> {
    async fn begin(&self, request: &BeginRequest) -> Result<Claim, StoreError> {
        self.record(self.inner.begin(request).await)
    }

    async fn complete(
        &self,
        held: &Held,
        outcome: Outcome,
        retention: Duration,
    ) -> Result<Fenced<Timestamp>, StoreError> {
        self.record(self.inner.complete(held, outcome, retention).await)
    }

    async fn release(&self, held: &Held) -> Result<Fenced<()>, StoreError> {
        self.record(self.inner.release(held).await)
    }

    async fn extend(&self, held: &Held, lease: Duration) -> Result<Fenced<Timestamp>, StoreError> {
        self.record(self.inner.extend(held, lease).await)
    }

    async fn get(&self, scope: &Scope, key: &Key) -> Result<Option<Record>, StoreError> {
        self.inner.get(scope, key).await
    }

    async fn begin_many(&self, requests: &[BeginRequest]) -> Vec<Result<Claim, StoreError>> {
        self.record_all(self.inner.begin_many(requests).await)
    }

    async fn complete_many(&self, completions: &[Completion]) -> Vec<Result<Fenced<Timestamp>, StoreError>> {
        self.record_all(self.inner.complete_many(completions).await)
    }
}

#[async_trait]
impl<S: StoreAdmin> StoreAdmin for Watched<S> {
    async fn stats(&self, scope: Option<&Scope>) -> Result<Stats, StoreError> {
        self.inner.stats(scope).await
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordSummary>, StoreError> {
        self.inner.list(filter).await
    }

    async fn purge_expired(&self, limit: u64) -> Result<u64, StoreError> {
        self.record(self.inner.purge_expired(limit).await)
    }

    async fn forget(&self, scope: &Scope, key: &Key, token: Token) -> Result<Fenced<()>, StoreError> {
        self.record(self.inner.forget(scope, key, token).await)
    }

    fn expires_by_itself(&self) -> bool {
        self.inner.expires_by_itself()
    }

    async fn now(&self) -> Result<Timestamp, StoreError> {
        self.inner.now().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[test]
    fn a_success_clears_the_failures() {
        let health = WriteHealth::default();
        assert!(health.failure().is_none());
        let disk_full = || {
            Err::<(), _>(StoreError::new(
                ErrorKind::Unavailable,
                "database or disk is full",
            ))
        };
        health.record(&disk_full());
        health.record(&disk_full());
        let failure = health.failure().expect("failing");
        assert_eq!(failure.count, 2);
        assert!(
            failure.to_string().contains("2 store write(s) failed in a row"),
            "{failure}"
        );
        assert!(
            failure.to_string().contains("database or disk is full"),
            "{failure}"
        );
        health.record(&Ok(()));
        assert!(health.failure().is_none());
    }
}
