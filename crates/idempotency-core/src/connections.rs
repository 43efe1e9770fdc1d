//! Connections for the sqlx-based stores (PostgreSQL, MySQL), taken back without a ping
//! (feature `sqlx`).
//!
//! sqlx's pool pings every connection it takes back (a round trip to the server, on a task
//! spawned for it), so each statement through it cost two round trips and two wakeups of the
//! server: a replay, which is one read, cost the server twice its work. The stores' operations
//! therefore take their connections from a [`deadpool`] pool that takes them back as they are
//! when there is no doubt about their state:
//!
//! * a connection whose operation succeeded goes back unchecked, ready for the next statement;
//! * one whose operation failed, or that was dropped mid-statement (the caller's future was
//!   cancelled), is closed at once, not kept: whatever it left half sent, unread or open (a
//!   transaction sqlx would roll back on its next use, holding its row locks until then) ends
//!   with the session, and the next caller gets a fresh connection;
//! * one older than [`MAX_LIFETIME`] is replaced, as sqlx's pool does, so that connections
//!   move to a server that failed over or reloaded its configuration.
//!
//! A store keeps its sqlx pool for the application's own transactions (same-transaction mode)
//! and for creating its schema. How a store uses it:
//!
//! ```text
//! let connections = Connections::new(pool.connect_options(), None, max, wait, map_error);
//! let row = connections
//!     .run(async |connection| statement.fetch_optional(connection).await.map_err(map))
//!     .await?;
//! ```

use std::sync::Arc;
use std::time::Duration;

use deadpool::Runtime;
use deadpool::managed::{
    self, Metrics, Object, PoolError, QueueMode, RecycleError, RecycleResult, TimeoutType,
};
use futures_util::future::BoxFuture;
use sqlx::Connection;

use crate::{ErrorKind, StoreError};

/// How long a connection serves before it is replaced (sqlx's pool's default, kept).
pub const MAX_LIFETIME: Duration = Duration::from_secs(30 * 60);

/// How a store names a driver error: `doing` says what it was doing.
pub type MapError = fn(&str, sqlx::Error) -> StoreError;

/// What runs on every new connection before its first use (a session setting).
pub type AfterConnect<C> =
    Arc<dyn for<'c> Fn(&'c mut C) -> BoxFuture<'c, Result<(), sqlx::Error>> + Send + Sync>;

/// Opens and checks the connections of one [`Connections`].
struct Opener<C: Connection> {
    options: Arc<C::Options>,
    after_connect: Option<AfterConnect<C>>,
}

impl<C: Connection> std::fmt::Debug for Opener<C> {
    // The options hold the password: none of them is shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opener").finish_non_exhaustive()
    }
}

impl<C: Connection> managed::Manager for Opener<C> {
    type Type = C;
    type Error = sqlx::Error;

    async fn create(&self) -> Result<C, sqlx::Error> {
        let mut connection = C::connect_with(&self.options).await?;
        if let Some(after_connect) = &self.after_connect {
            after_connect(&mut connection).await?;
        }
        Ok(connection)
    }

    async fn recycle(&self, _: &mut C, metrics: &Metrics) -> RecycleResult<sqlx::Error> {
        // Only settled connections come back (`Checked`'s drop closes the others).
        if metrics.age() > MAX_LIFETIME {
            return Err(RecycleError::message("the connection is past its lifetime"));
        }
        Ok(())
    }
}

/// A store's connections: at most `max` open; a caller waits at most `wait` for one.
pub struct Connections<C: Connection> {
    pool: managed::Pool<Opener<C>>,
    map_error: MapError,
}

impl<C: Connection> Clone for Connections<C> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            map_error: self.map_error,
        }
    }
}

impl<C: Connection> std::fmt::Debug for Connections<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connections")
            .field("status", &self.pool.status())
            .finish_non_exhaustive()
    }
}

impl<C: Connection> Connections<C> {
    /// Connections opened with `options` (a sqlx pool's `connect_options()`) and prepared by
    /// `after_connect`; `map_error` names a failure to connect.
    #[must_use]
    pub fn new(
        options: Arc<C::Options>,
        after_connect: Option<AfterConnect<C>>,
        max: usize,
        wait: Duration,
        map_error: MapError,
    ) -> Self {
        let pool = managed::Pool::builder(Opener {
            options,
            after_connect,
        })
        .max_size(max.max(1))
        // The most recently used first: under a light load the same few stay warm and the
        // rest are not woken.
        .queue_mode(QueueMode::Lifo)
        .wait_timeout(Some(wait))
        .create_timeout(Some(wait))
        .recycle_timeout(Some(wait))
        .runtime(Runtime::Tokio1)
        .build()
        .unwrap_or_else(|error| unreachable!("a runtime and a size are set: {error}"));
        Self { pool, map_error }
    }

    /// Runs `operation` on a connection, which goes back for the next operation only if this
    /// one succeeded; otherwise it is closed.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Timeout`] when no connection became free within the wait; a failure to
    /// connect as the store names it ([`ErrorKind::Unavailable`] when the server cannot be
    /// reached); or the operation's error.
    pub async fn run<T>(
        &self,
        operation: impl AsyncFnOnce(&mut C) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut checked = Checked {
            object: Some(self.get().await?),
            settled: false,
        };
        let connection = checked
            .object
            .as_deref_mut()
            .unwrap_or_else(|| unreachable!("taken only when dropped"));
        let result = operation(connection).await;
        checked.settled = result.is_ok();
        result
    }

    async fn get(&self) -> Result<Object<Opener<C>>, StoreError> {
        self.pool.get().await.map_err(|error| match error {
            PoolError::Timeout(TimeoutType::Wait) => StoreError::new(
                ErrorKind::Timeout,
                "get a connection: none became free in time (all busy, or the server is slow)",
            ),
            PoolError::Timeout(_) => StoreError::new(
                ErrorKind::Unavailable,
                "get a connection: the server did not answer in time",
            ),
            PoolError::Backend(error) => (self.map_error)("connect", error),
            other => StoreError::new(ErrorKind::Unavailable, format!("get a connection: {other}")),
        })
    }
}

/// A connection taken for one operation. Dropped unsettled (its operation failed, or its future
/// was dropped mid-statement), it closes the connection instead of giving it back.
struct Checked<C: Connection> {
    /// `Some` until dropped.
    object: Option<Object<Opener<C>>>,
    settled: bool,
}

impl<C: Connection> Drop for Checked<C> {
    fn drop(&mut self) {
        if !self.settled
            && let Some(object) = self.object.take()
        {
            // Out of the pool (which opens another when needed), and closed with its socket:
            // the server ends the session and whatever it left open.
            drop(Object::take(object));
        }
    }
}
