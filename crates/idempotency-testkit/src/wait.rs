//! Waiting in a test for something that happens in other tasks or processes (a worker drains a
//! queue, a relay publishes), with a limit that guards against hanging: the limit is never a
//! measure of speed, only the point at which the test gives up and says what it waited for.

use std::time::{Duration, Instant};

/// Waits until `done` answers `true`, asking every 50 ms; panics naming `what` once `limit` has
/// passed.
///
/// ```
/// use std::sync::atomic::{AtomicU32, Ordering};
/// use std::time::Duration;
///
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// let polls = AtomicU32::new(0);
/// idempotency_testkit::eventually(Duration::from_secs(5), "the third poll", async || {
///     polls.fetch_add(1, Ordering::SeqCst) == 2
/// })
/// .await;
/// assert_eq!(polls.load(Ordering::SeqCst), 3);
/// # });
/// ```
///
/// # Panics
///
/// When `done` has not answered `true` within `limit`.
pub async fn eventually(limit: Duration, what: &str, mut done: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !done().await {
        assert!(start.elapsed() < limit, "not within {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
