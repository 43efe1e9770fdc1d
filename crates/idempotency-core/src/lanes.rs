//! Capacity kept for lease-keeping, for stores with a bounded connection pool.
//!
//! A running attempt keeps its key with `extend` (the heartbeat) and gives it back with
//! `complete` or `release`. If those calls queue behind new work, a storm of retries (each a
//! `begin`) delays the heartbeats past the lease, other instances take the keys over, and the
//! operations run again: the retries cause the very duplicates they are retried to avoid.
//!
//! [`Lanes`] splits a store's connections in two: new work (`begin` and the reads) may use at
//! most `connections - reserved` of them at once, so `reserved` are always there for
//! lease-keeping, which may use any. New work beyond its lane waits a bounded time, then is shed
//! with [`ErrorKind::Overloaded`]: the caller answers "busy, retry later" (HTTP `503` with
//! `Retry-After`) instead of queueing without bound. The bound is on time, not on the queue's
//! length: a burst that a fast store drains in milliseconds must not be shed, and a queue that
//! does not move within the wait is saturation whatever its length.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::{ErrorKind, StoreError};

/// The new-work lane of a store's connections; see the [module docs](self).
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::Lanes;
///
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// // 16 connections, 4 kept for lease-keeping: at most 12 begins at once.
/// let lanes = Lanes::new(16, 4, Duration::from_secs(1));
/// assert_eq!(lanes.new_work_capacity(), 12);
/// let permit = lanes.new_work().await?; // held while the begin runs
/// drop(permit);
/// # Ok::<(), idempotency_core::StoreError>(()) }).unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct Lanes {
    new_work: Arc<Semaphore>,
    capacity: usize,
    wait: Duration,
}

impl Lanes {
    /// Lanes over `connections`, `reserved` of them kept for lease-keeping (at least one
    /// connection is left for new work). New work waits at most `wait` for its lane.
    #[must_use]
    pub fn new(connections: u32, reserved: u32, wait: Duration) -> Self {
        let capacity = connections.saturating_sub(reserved).max(1) as usize;
        Self {
            new_work: Arc::new(Semaphore::new(capacity)),
            capacity,
            wait,
        }
    }

    /// How many new-work calls may run at once.
    #[must_use]
    pub fn new_work_capacity(&self) -> usize {
        self.capacity
    }

    /// A place in the new-work lane, held for the length of one call.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Overloaded`] when the wait passes its bound: nothing was done, and the
    /// caller should be told to come back later.
    pub async fn new_work(&self) -> Result<OwnedSemaphorePermit, StoreError> {
        match tokio::time::timeout(self.wait, Arc::clone(&self.new_work).acquire_owned()).await {
            Ok(Ok(permit)) => Ok(permit),
            Ok(Err(_)) => Err(self.shed("its lane is closed")),
            Err(_) => Err(self.shed("the wait for a connection passed its bound")),
        }
    }

    fn shed(&self, why: &str) -> StoreError {
        metrics::counter!("idempotency_store_shed_total").increment(1);
        StoreError::new(
            ErrorKind::Overloaded,
            format!(
                "the store is saturated ({} new calls at once, the rest kept for lease-keeping): {why}",
                self.capacity
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn new_work_is_bounded_queued_and_then_shed() {
        let lanes = Lanes::new(3, 1, Duration::from_secs(1));
        assert_eq!(lanes.new_work_capacity(), 2);
        let first = lanes.new_work().await.unwrap();
        let _second = lanes.new_work().await.unwrap();
        // The lane is full: a third waits, and gets the first's place when it is given back.
        let waiter = tokio::spawn({
            let lanes = lanes.clone();
            async move { lanes.new_work().await.map(drop) }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(first);
        assert!(waiter.await.unwrap().is_ok());
        // Nobody gives a place back: the wait ends in a shed after its bound.
        let _third = lanes.new_work().await.unwrap();
        let shed = lanes.new_work().await.unwrap_err();
        assert_eq!(shed.kind(), ErrorKind::Overloaded);
        assert!(!shed.is_retryable());
    }
}
