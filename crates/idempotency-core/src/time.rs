//! Store time.
//!
//! Leases and retention are decided by **the store's clock**, never by the caller's: many
//! instances with skewed clocks must agree on whether a lease has expired. Networked stores read
//! the server's clock (SQL `now()`, Redis `TIME`); embedded stores (memory, SQLite) read a
//! [`Clock`], which tests replace with a [`ManualClock`] to step through lease expiry without
//! sleeping.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A point in store time: milliseconds since the Unix epoch.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(i64);

impl Timestamp {
    /// The timestamp `millis` milliseconds after the Unix epoch.
    #[must_use]
    pub const fn from_unix_millis(millis: i64) -> Self {
        Self(millis)
    }

    /// Milliseconds since the Unix epoch.
    #[must_use]
    pub const fn unix_millis(self) -> i64 {
        self.0
    }

    /// This timestamp moved `duration` later (saturating).
    #[must_use]
    pub fn after(self, duration: Duration) -> Self {
        Self(self.0.saturating_add(duration_millis(duration)))
    }

    /// How long after `earlier` this timestamp is; zero when it is not later.
    #[must_use]
    pub fn since(self, earlier: Self) -> Duration {
        Duration::from_millis(u64::try_from(self.0.saturating_sub(earlier.0)).unwrap_or(0))
    }

    /// The same instant as a [`SystemTime`].
    #[must_use]
    pub fn to_system_time(self) -> SystemTime {
        match u64::try_from(self.0) {
            Ok(millis) => UNIX_EPOCH + Duration::from_millis(millis),
            Err(_) => UNIX_EPOCH - Duration::from_millis(self.0.unsigned_abs()),
        }
    }

    /// The instant of a [`SystemTime`], truncated to milliseconds.
    #[must_use]
    pub fn from_system_time(time: SystemTime) -> Self {
        match time.duration_since(UNIX_EPOCH) {
            Ok(after) => Self(duration_millis(after)),
            Err(before) => Self(-duration_millis(before.duration())),
        }
    }
}

impl fmt::Debug for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Timestamp({})", self.0)
    }
}

/// Whole milliseconds in `duration`, saturating at `i64::MAX`.
#[must_use]
pub fn duration_millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// A source of store time for embedded stores.
pub trait Clock: Send + Sync + fmt::Debug {
    /// The current time.
    fn now(&self) -> Timestamp;
}

/// The operating system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_system_time(SystemTime::now())
    }
}

/// A clock that only moves when told to; clones share the same time.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::{Clock, ManualClock};
///
/// let clock = ManualClock::new();
/// let start = clock.now();
/// clock.advance(Duration::from_secs(61));
/// assert_eq!(clock.now().since(start), Duration::from_secs(61));
/// ```
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<AtomicI64>);

impl ManualClock {
    /// A clock set to 2026-01-01T00:00:00Z.
    #[must_use]
    pub fn new() -> Self {
        Self::at(Timestamp::from_unix_millis(1_767_225_600_000))
    }

    /// A clock set to `start`.
    #[must_use]
    pub fn at(start: Timestamp) -> Self {
        Self(Arc::new(AtomicI64::new(start.unix_millis())))
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.0.fetch_add(duration_millis(by), Ordering::SeqCst);
    }

    /// Sets the clock to `to`.
    pub fn set(&self, to: Timestamp) {
        self.0.store(to.unix_millis(), Ordering::SeqCst);
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.0.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_round_trip_through_system_time() {
        let now = SystemClock.now();
        assert_eq!(Timestamp::from_system_time(now.to_system_time()), now);
        let before_epoch = Timestamp::from_unix_millis(-1500);
        assert_eq!(
            Timestamp::from_system_time(before_epoch.to_system_time()),
            before_epoch
        );
    }

    #[test]
    fn arithmetic_saturates() {
        let t = Timestamp::from_unix_millis(i64::MAX - 1);
        assert_eq!(t.after(Duration::from_secs(10)).unix_millis(), i64::MAX);
        assert_eq!(
            Timestamp::from_unix_millis(5).since(Timestamp::from_unix_millis(9)),
            Duration::ZERO
        );
    }

    #[test]
    fn manual_clock_clones_share_time() {
        let a = ManualClock::new();
        let b = a.clone();
        a.advance(Duration::from_millis(250));
        assert_eq!(b.now(), a.now());
        b.set(Timestamp::from_unix_millis(7));
        assert_eq!(a.now().unix_millis(), 7);
    }
}
