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

    /// This timestamp moved `duration` later, with `duration` clamped to [`MAX_DURATION`] (as
    /// every store clamps it) and the sum saturating.
    #[must_use]
    pub fn after(self, duration: Duration) -> Self {
        Self(self.0.saturating_add(stored_millis(duration)))
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

/// The longest lease or retention a store keeps: 1000 years. Longer durations, up to
/// `Duration::MAX`, are clamped to it, so that "now + duration" fits every store's time type
/// (PostgreSQL's `interval` and `timestamptz`, Redis' `PEXPIRE` and its Lua numbers, SQLite's
/// integers) and every calendar a record's expiry is shown in. Nobody keeps a key longer, and
/// nobody meant a lease of `u64::MAX` seconds as anything but "as long as possible".
pub const MAX_DURATION: Duration = Duration::from_secs(1000 * 365 * 86_400);

/// Whole milliseconds in `duration` clamped to [`MAX_DURATION`]: what a store adds to its
/// clock for a lease or a retention. Stores use this, never [`duration_millis`], for any
/// duration a caller chose.
#[must_use]
pub fn stored_millis(duration: Duration) -> i64 {
    duration_millis(duration.min(MAX_DURATION))
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

/// The one backoff policy of the toolkit: the wait before try number `n` is
/// `initial × 2^(n − 1)`, at most `max`. The guard retries store calls with it, the consumers
/// delay redeliveries with it, the RabbitMQ worker reconnects with it.
///
/// A function of the try number rather than a stateful iterator (such as `backon`'s), because
/// a redelivered message carries its delivery count and nothing else: the delay before its
/// next delivery must be computed from that count alone. The loops use the same function.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::Backoff;
///
/// let backoff = Backoff { initial: Duration::from_millis(100), max: Duration::from_secs(1) };
/// assert_eq!(backoff.delay(1), Duration::from_millis(100));
/// assert_eq!(backoff.delay(3), Duration::from_millis(400));
/// assert_eq!(backoff.delay(10), Duration::from_secs(1));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The delay after the first failed delivery (default 1 s).
    pub initial: Duration,
    /// The longest delay (default 5 min).
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(300),
        }
    }
}

impl Backoff {
    /// The delay before the try after try number `deliveries` (for a message: before
    /// redelivering a message delivered `deliveries` times).
    #[must_use]
    pub fn delay(&self, deliveries: u32) -> Duration {
        let doublings = deliveries.saturating_sub(1).min(30);
        self.initial.saturating_mul(1 << doublings).min(self.max)
    }
}
