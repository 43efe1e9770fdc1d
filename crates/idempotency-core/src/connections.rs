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
//! * one older than the store's sqlx pool's `max_lifetime` (30 minutes unless the application's
//!   pool sets another) is replaced, as sqlx's pool does, so that connections move to a server
//!   that failed over or reloaded its configuration.
//!
//! A store keeps its sqlx pool for the application's own transactions (same-transaction mode)
//! and for creating its schema. How a store uses it:
//!
//! ```text
//! let lifetime = pool.options().get_max_lifetime();
//! let connections = Connections::new("postgres", pool.connect_options(), None, max, wait, lifetime, map_error);
//! let row = connections
//!     .run(async |connection| statement.fetch_optional(connection).await.map_err(map))
//!     .await?;
//! ```
//!
//! Metrics, labelled `store` with the name given to [`Connections::new`]:
//! `idempotency_store_connections_opened_total` (counter), `idempotency_store_connections_closed_total`
//! (counter, `reason`: `failed`, `abandoned` or `lifetime`), `idempotency_store_connections_open`
//! and `idempotency_store_connections_in_use` (gauges).

use std::sync::Arc;
use std::time::Duration;

use deadpool::Runtime;
use deadpool::managed::{
    self, Metrics, Object, PoolError, QueueMode, RecycleError, RecycleResult, TimeoutType,
};
use futures_util::future::BoxFuture;
use metrics::{Counter, Gauge};
use sqlx::Connection;

use crate::{ErrorKind, StoreError};

/// How a store names a driver error: `doing` says what it was doing.
pub type MapError = fn(&str, sqlx::Error) -> StoreError;

/// What runs on every new connection before its first use (a session setting).
pub type AfterConnect<C> =
    Arc<dyn for<'c> Fn(&'c mut C) -> BoxFuture<'c, Result<(), sqlx::Error>> + Send + Sync>;

/// The metrics of one [`Connections`], registered once: an operation only moves them.
#[derive(Clone)]
struct Meters {
    opened: Counter,
    failed: Counter,
    abandoned: Counter,
    past_lifetime: Counter,
    open: Gauge,
    in_use: Gauge,
}

impl Meters {
    fn new(store: &'static str) -> Self {
        let closed = |reason: &'static str| metrics::counter!("idempotency_store_connections_closed_total", "store" => store, "reason" => reason);
        Self {
            opened: metrics::counter!("idempotency_store_connections_opened_total", "store" => store),
            failed: closed("failed"),
            abandoned: closed("abandoned"),
            past_lifetime: closed("lifetime"),
            open: metrics::gauge!("idempotency_store_connections_open", "store" => store),
            in_use: metrics::gauge!("idempotency_store_connections_in_use", "store" => store),
        }
    }
}

/// A connection and the gauge of open ones, which it leaves when it is closed, wherever that
/// happens (after a failure, past its lifetime, with the pool).
struct Tracked<C> {
    connection: C,
    open: Gauge,
}

impl<C> Drop for Tracked<C> {
    fn drop(&mut self) {
        self.open.decrement(1.0);
    }
}

/// Opens and checks the connections of one [`Connections`].
struct Opener<C: Connection> {
    options: Arc<C::Options>,
    after_connect: Option<AfterConnect<C>>,
    /// How long a connection serves before it is replaced; `None`: as long as it works.
    lifetime: Option<Duration>,
    meters: Meters,
}

impl<C: Connection> std::fmt::Debug for Opener<C> {
    // The options hold the password: none of them is shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opener").finish_non_exhaustive()
    }
}

impl<C: Connection> managed::Manager for Opener<C> {
    type Type = Tracked<C>;
    type Error = sqlx::Error;

    async fn create(&self) -> Result<Tracked<C>, sqlx::Error> {
        let mut connection = C::connect_with(&self.options).await?;
        if let Some(after_connect) = &self.after_connect {
            after_connect(&mut connection).await?;
        }
        self.meters.opened.increment(1);
        self.meters.open.increment(1.0);
        Ok(Tracked {
            connection,
            open: self.meters.open.clone(),
        })
    }

    async fn recycle(&self, _: &mut Tracked<C>, metrics: &Metrics) -> RecycleResult<sqlx::Error> {
        // Only settled connections come back (`Checked`'s drop closes the others).
        if self.lifetime.is_some_and(|lifetime| metrics.age() > lifetime) {
            self.meters.past_lifetime.increment(1);
            return Err(RecycleError::message("the connection is past its lifetime"));
        }
        Ok(())
    }
}

/// A store's connections: at most `max` open; a caller waits at most `wait` for one.
pub struct Connections<C: Connection> {
    pool: managed::Pool<Opener<C>>,
    map_error: MapError,
    meters: Meters,
}

impl<C: Connection> Clone for Connections<C> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            map_error: self.map_error,
            meters: self.meters.clone(),
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
    /// `after_connect`, each replaced once older than `lifetime` (the sqlx pool's
    /// `get_max_lifetime()`); `map_error` names a failure to connect. `store` labels the metrics
    /// (`postgres`, `mysql`).
    #[must_use]
    pub fn new(
        store: &'static str,
        options: Arc<C::Options>,
        after_connect: Option<AfterConnect<C>>,
        max: usize,
        wait: Duration,
        lifetime: Option<Duration>,
        map_error: MapError,
    ) -> Self {
        let meters = Meters::new(store);
        let pool = managed::Pool::builder(Opener {
            options,
            after_connect,
            lifetime,
            meters: meters.clone(),
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
        Self {
            pool,
            map_error,
            meters,
        }
    }

    /// How the store classifies its server's errors (what it was built with).
    #[must_use]
    pub fn map_error(&self) -> MapError {
        self.map_error
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
            state: State::Running,
            meters: &self.meters,
        };
        self.meters.in_use.increment(1.0);
        let connection = &mut checked
            .object
            .as_deref_mut()
            .unwrap_or_else(|| unreachable!("taken only when dropped"))
            .connection;
        let result = operation(connection).await;
        checked.state = if result.is_ok() {
            State::Settled
        } else {
            State::Failed
        };
        result
    }

    /// Runs a batch of calls in one transaction on one connection
    /// ([`crate::sql::in_one_transaction`]): one answer per call, in the batch's order, or the
    /// failure of the transaction as every call's answer ([`crate::failed_batch`]). New work
    /// (a batch of `begin`s) passes the store's `lanes`, and holds one lane for the batch.
    pub async fn batch<X, T, R>(
        &self,
        lanes: Option<&crate::Lanes>,
        store: &X,
        batch: &[T],
        each: impl for<'c> FnMut(&'c mut C, &'c X, &'c T) -> BoxFuture<'c, Result<R, StoreError>> + Send,
    ) -> Vec<Result<R, StoreError>>
    where
        C::Database: sqlx::Database<Connection = C>,
        X: Sync + ?Sized,
        T: crate::BatchCall + Sync,
        R: Send,
    {
        let answers = async {
            let _lane = match lanes {
                Some(lanes) => Some(lanes.new_work().await?),
                None => None,
            };
            self.run(async |connection| {
                crate::sql::in_one_transaction::<C::Database, _, _, _>(
                    connection,
                    store,
                    batch,
                    self.map_error,
                    each,
                )
                .await
            })
            .await
        };
        crate::batch_answers(batch.len(), answers.await)
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

/// Where the operation on a [`Checked`] connection is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Not finished: dropped in this state, the caller's future was dropped mid-operation.
    Running,
    /// Succeeded: the connection goes back.
    Settled,
    /// Failed: the connection is closed.
    Failed,
}

/// A connection taken for one operation. Dropped unsettled (its operation failed, or its future
/// was dropped mid-statement), it closes the connection instead of giving it back.
struct Checked<'a, C: Connection> {
    /// `Some` until dropped.
    object: Option<Object<Opener<C>>>,
    state: State,
    meters: &'a Meters,
}

impl<C: Connection> Drop for Checked<'_, C> {
    fn drop(&mut self) {
        self.meters.in_use.decrement(1.0);
        let closed = match self.state {
            State::Settled => return,
            State::Failed => &self.meters.failed,
            State::Running => &self.meters.abandoned,
        };
        if let Some(object) = self.object.take() {
            closed.increment(1);
            // Out of the pool (which opens another when needed), and closed with its socket:
            // the server ends the session and whatever it left open.
            drop(Object::take(object));
        }
    }
}
