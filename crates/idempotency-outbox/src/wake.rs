//! The loop the inbox workers and the outbox relays share: rounds of work, idle waits ended by a
//! `NOTIFY` or the poll interval, backoff after failures, a periodic cleanup, and a stop that
//! lets the round in progress finish.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idempotency_consumer::Backoff;
use idempotency_postgres::sqlx::PgPool;
use idempotency_postgres::sqlx::postgres::PgListener;
use tokio::sync::Notify;

use crate::OutboxError;

/// How many loops, how much a round takes, how often they look for work, and how long done
/// rows are kept: the settings an inbox worker and an outbox relay share, set by the methods
/// [`pace_setters!`] writes.
#[derive(Debug, Clone)]
pub(crate) struct Pace {
    /// How many loops run rounds at once.
    pub(crate) loops: usize,
    /// How many rows one round takes at most.
    pub(crate) batch: u32,
    /// The longest an idle loop waits without a notification.
    pub(crate) poll: Duration,
    /// Whether idle loops `LISTEN` for notifications (PostgreSQL).
    pub(crate) listen: bool,
    /// How long done rows are kept.
    pub(crate) retention: Duration,
    /// How often the cleanup runs.
    pub(crate) cleanup_every: Duration,
}

impl Pace {
    /// `loops` loops taking `batch` rows a round, polling every second and listening, done rows
    /// kept 7 days and cleaned up every minute.
    pub(crate) fn new(loops: usize, batch: u32) -> Self {
        Self {
            loops,
            batch,
            poll: Duration::from_secs(1),
            listen: true,
            retention: idempotency_core::DEFAULT_CONSUMER_RETENTION,
            cleanup_every: Duration::from_secs(60),
        }
    }
}

/// The builder methods of a [`Pace`] held in a `pace` field: `batch`, `notifications`, `poll`
/// and `retention`. The caller says what a round takes (`batch`), what idles (`idle`), what the
/// notifications are for on its databases (`notifications`), and which rows are kept and
/// what that means (`kept`).
macro_rules! pace_setters {
    (batch: $batch:literal, idle: $idle:literal, notifications: $notifications:literal, kept: $kept:literal $(,)?) => {
        #[doc = $batch]
        #[must_use]
        pub fn batch(mut self, batch: u32) -> Self {
            self.pace.batch = batch.max(1);
            self
        }

        #[doc = concat!("Whether idle ", $idle, " `LISTEN` for the notifications sent when messages arrive (",
            $notifications, "); without, they only poll, and a message waits up to the poll interval.")]
        #[must_use]
        pub fn notifications(mut self, listen: bool) -> Self {
            self.pace.listen = listen;
            self
        }

        #[doc = concat!("The longest idle ", $idle, " wait without a notification.")]
        #[must_use]
        pub fn poll(mut self, poll: ::std::time::Duration) -> Self {
            self.pace.poll = poll;
            self
        }

        #[doc = concat!("How long ", $kept, ", and how often the cleanup runs.")]
        #[must_use]
        pub fn retention(
            mut self,
            retention: ::std::time::Duration,
            cleanup_every: ::std::time::Duration,
        ) -> Self {
            self.pace.retention = retention;
            self.pace.cleanup_every = cleanup_every;
            self
        }
    };
}
pub(crate) use pace_setters;

/// Listens on `listen`'s channel (a pool and a channel; `None`: polling only), runs
/// `pace.loops` loops of rounds of `round` (each returns whether there may be more work right
/// away) and `cleanup` every `pace.cleanup_every`, until `shutdown`; then lets each
/// loop finish its round. `what` names the loops in logs.
pub(crate) async fn run<R, RF, C, CF, S>(
    listen: Option<(&PgPool, &str)>,
    what: &str,
    pace: &Pace,
    round: R,
    cleanup: C,
    shutdown: S,
) -> Result<(), OutboxError>
where
    R: Fn() -> RF,
    RF: Future<Output = Result<bool, OutboxError>>,
    C: Fn() -> CF,
    CF: Future<Output = ()>,
    S: Future<Output = ()>,
{
    let mut listener = if let Some((pool, channel)) = listen {
        let mut listener = PgListener::connect_with(pool)
            .await
            .map_err(OutboxError::db("connect for notifications"))?;
        listener
            .listen(channel)
            .await
            .map_err(OutboxError::db("listen for notifications"))?;
        Some(listener)
    } else {
        None
    };
    let wake = Notify::new();
    let stopping = AtomicBool::new(false);
    let listening = async {
        let Some(listener) = listener.as_mut() else {
            return std::future::pending().await;
        };
        let backoff = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(5),
        };
        let mut failures = 0_u32;
        loop {
            match listener.try_recv().await {
                Ok(Some(_)) => {
                    failures = 0;
                    wake.notify_waiters();
                }
                // The connection was lost and made again: a notification sent in between is
                // gone, so the loops look for work now rather than at their next poll (which
                // may be long where notifications are relied on).
                Ok(None) => {
                    failures = 0;
                    tracing::info!(what, "notifications resumed; looking for what they missed");
                    wake.notify_waiters();
                }
                Err(error) => {
                    // The listener connects again on the next call; polling covers the gap.
                    failures = failures.saturating_add(1);
                    tracing::warn!(what, %error, "notifications interrupted");
                    tokio::time::sleep(backoff.delay(failures).min(pace.poll)).await;
                    wake.notify_waiters();
                }
            }
        }
    };
    let rounds = futures_util::future::join_all(
        (0..pace.loops.max(1)).map(|_| repeat(&round, what, pace.poll, &wake, &stopping)),
    );
    let cleaning = async {
        let mut last = tokio::time::Instant::now();
        while !stopping.load(Ordering::SeqCst) {
            if last.elapsed() >= pace.cleanup_every {
                cleanup().await;
                last = tokio::time::Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(200).min(pace.cleanup_every)).await;
        }
    };
    let running = futures_util::future::join(rounds, cleaning);
    tokio::pin!(running);
    tokio::select! {
        () = shutdown => {}
        () = listening => {}
        _ = &mut running => {}
    }
    stopping.store(true, Ordering::SeqCst);
    wake.notify_waiters();
    running.await;
    Ok(())
}

/// One loop: rounds until stopped, waiting when idle and backing off after failures.
async fn repeat<R, RF>(round: &R, what: &str, poll: Duration, wake: &Notify, stopping: &AtomicBool)
where
    R: Fn() -> RF,
    RF: Future<Output = Result<bool, OutboxError>>,
{
    let backoff = Backoff {
        initial: Duration::from_millis(100),
        max: Duration::from_secs(5),
    };
    let mut failures = 0_u32;
    while !stopping.load(Ordering::SeqCst) {
        // Registered before the round, so a notification during it is not missed.
        let notified = wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        match round().await {
            Ok(true) => failures = 0,
            Ok(false) => {
                failures = 0;
                tokio::select! {
                    () = notified => {}
                    () = tokio::time::sleep(poll) => {}
                }
            }
            Err(error) => {
                failures = failures.saturating_add(1);
                tracing::warn!(what, %error, "round failed; retrying");
                tokio::time::sleep(backoff.delay(failures)).await;
            }
        }
    }
}
