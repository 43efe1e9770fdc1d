//! Waiting for another attempt's outcome: what a duplicate does while the first copy of its
//! key runs.
//!
//! A duplicate that finds its key in flight must not run, and must not give up on the key
//! either: the holder may finish in a moment, or may have died, in which case its lease runs
//! out and the duplicate takes over. Answering "in flight" at once and coming back after the
//! whole remaining lease settles the duplicate a lease late when the first copy took a tenth
//! of a second. [`InFlightWait`] asks again as soon as there is news, for as long as the
//! caller's wait allows:
//!
//! - **In this process**: a [`Guard`](crate::Guard) that records an outcome (a completion or a
//!   release) wakes at once every run of its clones waiting on that key.
//! - **Elsewhere** (another process, another host): the record is read again after a pause
//!   of 20 ms, doubling to 250 ms, and never later than the lease's end, when the duplicate
//!   takes over.
//!
//! ```
//! use std::time::Duration;
//! use idempotency_core::{Decision, Execution, Fingerprint, Guard, Key, MemoryStore, Outcome, Scope};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! let guard = Guard::new(MemoryStore::new());
//! let (scope, key) = (Scope::global(), Key::new("order-7")?);
//! let policy = |_: &()| Decision::Complete(Outcome::new("charged"));
//! let (started, finish) = (tokio::sync::Notify::new(), tokio::sync::Notify::new());
//! let first = guard.run(scope.clone(), key.clone(), Fingerprint::of_bytes(b"EUR 10"), policy, |_| async {
//!     started.notify_one();
//!     finish.notified().await; // the charge takes a while
//! });
//! let duplicate = async {
//!     started.notified().await;
//!     let mut waiting = guard.wait_in_flight(&scope, &key, Duration::from_secs(30));
//!     loop {
//!         match guard.run(scope.clone(), key.clone(), Fingerprint::of_bytes(b"EUR 10"), policy, |_| async {}).await? {
//!             Execution::InFlight { retry_after, .. } => {
//!                 finish.notify_one(); // let the first copy finish (it wakes the duplicate)
//!                 if !waiting.again(retry_after).await {
//!                     break Ok::<_, idempotency_core::StoreError>(None); // waited long enough
//!                 }
//!             }
//!             other => break Ok(Some(other)),
//!         }
//!     }
//! };
//! let (first, duplicate) = tokio::join!(first, duplicate);
//! assert!(matches!(first?, Execution::Executed { .. }));
//! assert!(matches!(duplicate?, Some(Execution::Replayed(_))));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::{Key, Scope};

/// The first pause before a key in flight is read again.
pub const FIRST_PAUSE: Duration = Duration::from_millis(20);

/// The longest pause between two reads of a key in flight.
pub const MAX_PAUSE: Duration = Duration::from_millis(250);

/// The shortest pause: a lease that has just run out is read again, not spun on.
const MIN_PAUSE: Duration = Duration::from_millis(1);

/// The runs of one guard (and its clones) waiting on keys in flight, so that recording an
/// outcome wakes them. Empty, as it is almost always, it costs a recorded outcome one atomic
/// load.
#[derive(Default)]
pub(crate) struct Waiters {
    /// How many [`InFlightWait`]s are registered: outcomes look their key up only when some are.
    registered: AtomicUsize,
    keys: Mutex<HashMap<(Scope, Key), watch::Sender<()>>>,
}

impl fmt::Debug for Waiters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Waiters")
            .field("registered", &self.registered.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Waiters {
    fn lock(&self) -> MutexGuard<'_, HashMap<(Scope, Key), watch::Sender<()>>> {
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wakes the runs waiting on `(scope, key)`: its outcome was just recorded.
    pub(crate) fn wake(&self, scope: &Scope, key: &Key) {
        if self.registered.load(Ordering::SeqCst) == 0 {
            return;
        }
        if let Some(sender) = self.lock().get(&(scope.clone(), key.clone())) {
            sender.send_replace(());
        }
    }

    /// A receiver that changes when `(scope, key)`'s outcome is recorded from now on.
    fn register(&self, scope: &Scope, key: &Key) -> watch::Receiver<()> {
        self.registered.fetch_add(1, Ordering::SeqCst);
        self.lock()
            .entry((scope.clone(), key.clone()))
            .or_insert_with(|| watch::channel(()).0)
            .subscribe()
    }

    /// Forgets `woken`, and the key once nobody waits on it.
    fn unregister(&self, scope: &Scope, key: &Key, woken: watch::Receiver<()>) {
        drop(woken);
        let mut keys = self.lock();
        let entry = (scope.clone(), key.clone());
        if keys
            .get(&entry)
            .is_some_and(|sender| sender.receiver_count() == 0)
        {
            keys.remove(&entry);
        }
        drop(keys);
        self.registered.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Paces a run's re-reads of a key another attempt holds, for up to a wait; from
/// [`Guard::wait_in_flight`](crate::Guard::wait_in_flight). See the [module docs](self).
///
/// Nothing is registered until the first [`again`](Self::again): a run that never finds its
/// key in flight pays nothing for it.
#[must_use]
pub struct InFlightWait {
    waiters: Arc<Waiters>,
    scope: Scope,
    key: Key,
    /// When to stop waiting; `None`: not before the lease ends.
    deadline: Option<Instant>,
    pause: Duration,
    woken: Option<watch::Receiver<()>>,
}

impl fmt::Debug for InFlightWait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlightWait")
            .field("scope", &self.scope.redacted())
            .field("key", &self.key.redacted())
            .field("deadline", &self.deadline)
            .field("pause", &self.pause)
            .finish_non_exhaustive()
    }
}

impl InFlightWait {
    pub(crate) fn new(waiters: &Arc<Waiters>, scope: &Scope, key: &Key, wait: Duration) -> Self {
        Self {
            waiters: Arc::clone(waiters),
            scope: scope.clone(),
            key: key.clone(),
            deadline: Instant::now().checked_add(wait),
            pause: FIRST_PAUSE,
            woken: None,
        }
    }

    /// Called after an in-flight answer whose lease has `retry_after` left: waits until it is
    /// time to read the key again, and says whether to. `false` once the wait is over: the
    /// caller answers "in flight" (HTTP `409`, a nack with a delay).
    ///
    /// The first call registers for this process's wake-up and returns at once (an outcome
    /// recorded between the answer and the registration would otherwise be missed); later
    /// calls return when this process records the key's outcome, or after the next pause (20
    /// ms doubling to 250 ms), or when the lease ends, or at the end of the wait, whichever
    /// comes first.
    pub async fn again(&mut self, retry_after: Duration) -> bool {
        let now = Instant::now();
        let left = match self.deadline {
            Some(deadline) if deadline > now => deadline - now,
            Some(_) => return false,
            None => Duration::MAX,
        };
        let Some(woken) = &mut self.woken else {
            self.woken = Some(self.waiters.register(&self.scope, &self.key));
            return true;
        };
        let pause = self.pause.min(retry_after).min(left).max(MIN_PAUSE);
        tokio::select! {
            // The sender lives while this receiver does; an error cannot happen, and would
            // only end the pause early.
            _ = woken.changed() => {}
            () = tokio::time::sleep(pause) => {}
        }
        self.pause = (self.pause * 2).min(MAX_PAUSE);
        true
    }
}

impl Drop for InFlightWait {
    fn drop(&mut self) {
        if let Some(woken) = self.woken.take() {
            self.waiters.unregister(&self.scope, &self.key, woken);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> (Scope, Key) {
        (Scope::new("tests").unwrap(), Key::new("k").unwrap())
    }

    #[tokio::test(start_paused = true)]
    async fn a_wake_ends_the_pause_and_only_for_its_key() {
        let waiters = Arc::new(Waiters::default());
        let (scope, key) = names();
        let mut waiting = InFlightWait::new(&waiters, &scope, &key, Duration::from_secs(60));
        assert!(
            waiting.again(Duration::from_secs(60)).await,
            "the first call asks again at once"
        );
        let other = Key::new("other").unwrap();
        let started = Instant::now();
        let wait = waiting.again(Duration::from_secs(60));
        tokio::pin!(wait);
        // Another key's outcome does not end the pause; this key's does, before the pause.
        tokio::select! {
            biased;
            _ = &mut wait => panic!("woken by another key"),
            () = async { waiters.wake(&scope, &other); tokio::task::yield_now().await } => {}
        }
        waiters.wake(&scope, &key);
        assert!(wait.await);
        assert_eq!(
            Instant::now(),
            started,
            "the wake ended the pause (the clock is paused)"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn pauses_double_to_the_most_and_stop_at_the_lease_and_the_deadline() {
        let waiters = Arc::new(Waiters::default());
        let (scope, key) = names();
        let mut waiting = InFlightWait::new(&waiters, &scope, &key, Duration::from_secs(1));
        assert!(waiting.again(Duration::from_secs(60)).await);
        let mut pauses = Vec::new();
        loop {
            let before = Instant::now();
            if !waiting.again(Duration::from_secs(60)).await {
                break;
            }
            pauses.push((Instant::now() - before).as_millis());
        }
        // 20, 40, 80, 160, 250, then what is left of the second.
        assert_eq!(pauses, [20, 40, 80, 160, 250, 250, 200]);
        // A lease ending sooner than the pause: read again when it ends.
        let mut waiting = InFlightWait::new(&waiters, &scope, &key, Duration::from_secs(60));
        assert!(waiting.again(Duration::from_millis(5)).await);
        let before = Instant::now();
        assert!(waiting.again(Duration::from_millis(5)).await);
        assert_eq!((Instant::now() - before).as_millis(), 5);
        // No wait at all: in flight at once.
        let mut waiting = InFlightWait::new(&waiters, &scope, &key, Duration::ZERO);
        assert!(!waiting.again(Duration::from_secs(60)).await);
    }

    #[tokio::test]
    async fn registrations_are_forgotten_when_the_waits_end() {
        let waiters = Arc::new(Waiters::default());
        let (scope, key) = names();
        let mut first = InFlightWait::new(&waiters, &scope, &key, Duration::from_secs(1));
        let mut second = InFlightWait::new(&waiters, &scope, &key, Duration::from_secs(1));
        assert!(first.again(Duration::from_secs(1)).await);
        assert!(second.again(Duration::from_secs(1)).await);
        assert_eq!(waiters.registered.load(Ordering::SeqCst), 2);
        assert_eq!(waiters.lock().len(), 1);
        drop(first);
        assert_eq!(waiters.lock().len(), 1, "the second still waits");
        drop(second);
        assert_eq!(waiters.registered.load(Ordering::SeqCst), 0);
        assert!(waiters.lock().is_empty());
    }
}
