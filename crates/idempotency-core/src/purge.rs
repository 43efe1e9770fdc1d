//! Cleanup that runs by itself: expired records purged in bounded batches on an interval.
//!
//! Expired records are treated as absent by every store, but SQLite and PostgreSQL keep their
//! rows until something deletes them, and the table grows until the disk fills. [`Purger`] is
//! the task that deletes them: `idem serve` runs one by default, and a service that embeds the
//! HTTP layer or a consumer spawns its own. A store that expires records by itself (Redis, and
//! DynamoDB's TTL) says so with [`StoreAdmin::expires_by_itself`], and the purger then does
//! nothing.
//!
//! # Metrics
//!
//! | metric | kind | meaning |
//! |---|---|---|
//! | `idempotency_purged_total` | counter | expired records deleted |
//! | `idempotency_purge_duration_seconds` | histogram | how long one round took |
//! | `idempotency_purge_errors_total` | counter | rounds that failed (the next round tries again) |

use std::time::{Duration, Instant};

use crate::{StoreAdmin, StoreError};

/// Purges expired records every `every`, at most `batch` per store call; see the
/// [module docs](self).
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::{MemoryStore, Purger};
///
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// let purger = Purger::new(MemoryStore::new()).every(Duration::from_secs(60)).batch(1000);
/// assert_eq!(purger.round().await?, 0); // one round now; `run` repeats it on the interval
/// # Ok::<(), idempotency_core::StoreError>(()) }).unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct Purger<S> {
    store: S,
    every: Duration,
    batch: u64,
    max_batches: u32,
}

impl<S: StoreAdmin> Purger<S> {
    /// A purger over `store`: every minute, 1000 records per call, at most 100 calls a round
    /// (so one round deletes at most 100,000 records and the next round goes on).
    pub fn new(store: S) -> Self {
        Self {
            store,
            every: Duration::from_secs(60),
            batch: 1000,
            max_batches: 100,
        }
    }

    /// The interval between rounds (at least 10 ms).
    #[must_use]
    pub fn every(mut self, every: Duration) -> Self {
        self.every = every.max(Duration::from_millis(10));
        self
    }

    /// The most records one store call deletes (at least 1): a bound on how long a call holds
    /// the store's locks.
    #[must_use]
    pub fn batch(mut self, batch: u64) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// One round: batches until one comes back short (or the round's bound is reached).
    ///
    /// # Errors
    ///
    /// The store's error; what was deleted before it stays deleted.
    pub async fn round(&self) -> Result<u64, StoreError> {
        let started = Instant::now();
        let mut total = 0;
        let mut result = Ok(());
        for _ in 0..self.max_batches {
            match self.store.purge_expired(self.batch).await {
                Ok(purged) => {
                    total += purged;
                    metrics::counter!("idempotency_purged_total").increment(purged);
                    if purged < self.batch {
                        break;
                    }
                }
                Err(error) => {
                    result = Err(error);
                    break;
                }
            }
        }
        metrics::histogram!("idempotency_purge_duration_seconds").record(started.elapsed().as_secs_f64());
        match result {
            Ok(()) => Ok(total),
            Err(error) => {
                metrics::counter!("idempotency_purge_errors_total").increment(1);
                Err(error)
            }
        }
    }

    /// Runs a round every interval, forever (drop the future, or abort its task, to stop it).
    /// Errors are logged and counted; the next round tries again. Returns at once for a store
    /// that expires records by itself.
    pub async fn run(self) {
        if self.store.expires_by_itself() {
            tracing::info!("the store expires records by itself: no purge task is needed");
            return;
        }
        loop {
            tokio::time::sleep(self.every).await;
            match self.round().await {
                Ok(0) => {}
                Ok(purged) => tracing::debug!(purged, "purged expired records"),
                Err(error) => tracing::warn!(%error, "purging expired records failed; retrying next round"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        BeginRequest, Claim, Fingerprint, Key, ManualClock, MemoryStore, Outcome, Scope, Store, StoreAdmin,
    };
    use std::sync::Arc;

    #[tokio::test]
    async fn a_round_deletes_expired_records_in_batches_and_keeps_live_ones() {
        let clock = Arc::new(ManualClock::default());
        let store = MemoryStore::with_clock(clock.clone());
        for n in 0..25 {
            let request = BeginRequest::new(
                Scope::global(),
                Key::new(format!("k{n}")).unwrap(),
                Fingerprint::of_bytes(b""),
            )
            .retention(Duration::from_secs(if n < 20 { 1 } else { 3600 }));
            let Claim::Acquired(held) = store.begin(&request).await.unwrap() else {
                panic!("acquired")
            };
            let keep = if n < 20 { 1 } else { 3600 };
            let done = store
                .complete(&held, Outcome::from(&b"x"[..]), Duration::from_secs(keep))
                .await
                .unwrap();
            assert!(!done.is_lease_lost());
        }
        clock.advance(Duration::from_secs(2));
        let purger = Purger::new(store.clone()).batch(7);
        assert_eq!(purger.round().await.unwrap(), 20);
        assert_eq!(purger.round().await.unwrap(), 0);
        assert_eq!(store.stats(None).await.unwrap().completed, 5);
    }
}
