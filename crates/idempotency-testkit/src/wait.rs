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
pub async fn eventually(limit: Duration, what: &str, done: impl AsyncFnMut() -> bool) {
    eventually_explained(limit, done, || what.to_owned()).await;
}

/// [`eventually`], and when `limit` has passed, the panic says what `explain` finds then (where
/// each partition stands, what each member ran): for a wait whose stall is the bug a test
/// exists for.
///
/// # Panics
///
/// When `done` has not answered `true` within `limit`, with `explain`'s text.
pub async fn eventually_explained(
    limit: Duration,
    mut done: impl AsyncFnMut() -> bool,
    explain: impl FnOnce() -> String,
) {
    let start = Instant::now();
    while !done().await {
        if start.elapsed() >= limit {
            panic!("not within {limit:?}: {}", explain());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    #[should_panic(expected = "not within 200ms: p0 committed 3 of 9")]
    async fn a_stall_is_explained_by_what_is_found_when_the_wait_gives_up() {
        eventually_explained(
            Duration::from_millis(200),
            async || false,
            || "p0 committed 3 of 9".to_owned(),
        )
        .await;
    }
}
