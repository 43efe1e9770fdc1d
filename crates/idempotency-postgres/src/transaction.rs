//! Same-transaction mode: the idempotency record commits in the same transaction as the
//! business writes.
//!
//! With a separate store, there is always a moment between "the side effect is committed" and
//! "the record says so" (or the reverse) where a crash leaves the two disagreeing. When the side
//! effect is itself a write to the same PostgreSQL database, that moment can be removed: the
//! record is claimed inside the business transaction, the business rows are written, and the
//! completion commits with them — all or nothing.
//!
//! * The claim is the same single-statement upsert as [`Store::begin`](idempotency_core::Store::begin); inside the
//!   transaction it takes the row lock. A concurrent duplicate's claim **waits on that lock**
//!   and, once this transaction commits, sees the completed record and gets the replay; if this
//!   transaction rolls back, the duplicate claims the key and runs.
//! * An operation error, a panic, a lost connection or a terminated backend rolls everything
//!   back: no record, no business rows. A retry runs from scratch.
//! * Uncommitted, the in-flight record is invisible to other sessions, so its lease never
//!   expires under them; a duplicate waits for as long as the transaction runs. Bound that wait
//!   with `lock_timeout` (or `statement_timeout`) on the pool's connections if needed.
//! * Times inside the transaction are its start time (`now()`).
//!
//! [`PostgresStore::run_in_transaction`] manages the transaction; [`PostgresStore::begin_in`] and
//! [`PostgresStore::complete_in`] work inside a transaction the caller already holds.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use idempotency_core::{
    BeginRequest, Claim, Completed, Fenced, Key, Outcome, Scope, StoreError, Timestamp, Token,
};
use sqlx::postgres::{PgConnection, Postgres};

use crate::error::map_error;
use crate::store::{PostgresStore, begin_on, complete_on};

/// The future a same-transaction operation returns: boxed and `Send`, so that the whole call
/// can run on a spawned task (`Box::pin(async move { … })`).
pub type TxFuture<'t, T, E> = Pin<Box<dyn Future<Output = Result<(T, Outcome), E>> + Send + 't>>;

/// An operation that runs inside the record's transaction (see
/// [`PostgresStore::run_operation_in_transaction`]).
///
/// Unlike a closure returning a [`TxFuture`], an implementation can borrow what it works on:
///
/// ```no_run
/// use idempotency_core::{BeginRequest, Fingerprint, Key, Outcome, Scope};
/// use idempotency_postgres::{PostgresStore, TxAttempt, TxOperation};
///
/// struct Charge<'a> { order: &'a str, cents: i64 }
///
/// impl TxOperation for Charge<'_> {
///     type Value = i64;
///     type Error = sqlx::Error;
///
///     async fn run(
///         self,
///         tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
///         attempt: TxAttempt,
///     ) -> Result<(i64, Outcome), sqlx::Error> {
///         let id: i64 = sqlx::query_scalar("INSERT INTO charges (key, order_id, cents) VALUES ($1, $2, $3) RETURNING id")
///             .bind(attempt.key.as_str())
///             .bind(self.order)
///             .bind(self.cents)
///             .fetch_one(&mut **tx)
///             .await?;
///         Ok((id, Outcome::new(id.to_string())))
///     }
/// }
///
/// # async fn example(store: PostgresStore, order: String) -> Result<(), Box<dyn std::error::Error>> {
/// let request = BeginRequest::new(Scope::global(), Key::new(format!("charge-{order}"))?, Fingerprint::of_bytes(b"1000"));
/// let run = store.run_operation_in_transaction(request, Charge { order: &order, cents: 1000 }).await?;
/// # let _ = run;
/// # Ok(())
/// # }
/// ```
pub trait TxOperation: Send {
    /// What the operation returns to its caller.
    type Value: Send;
    /// How the operation fails (everything is then rolled back).
    type Error: Send;

    /// Writes the business rows through `tx` and returns the value and the outcome to store.
    fn run(
        self,
        tx: &mut sqlx::Transaction<'static, Postgres>,
        attempt: TxAttempt,
    ) -> impl Future<Output = Result<(Self::Value, Outcome), Self::Error>> + Send;
}

/// A closure returning a [`TxFuture`], as a [`TxOperation`]. Boxed as a trait object so that
/// the higher-ranked closure bound is not re-proved, with erased lifetimes, where the future's
/// `Send` is checked.
type BoxedClosure<T, E> = Box<
    dyn for<'t> FnOnce(&'t mut sqlx::Transaction<'static, Postgres>, TxAttempt) -> TxFuture<'t, T, E> + Send,
>;

struct Closure<T, E>(BoxedClosure<T, E>);

impl<T: Send, E: Send> TxOperation for Closure<T, E> {
    type Value = T;
    type Error = E;

    fn run(
        self,
        tx: &mut sqlx::Transaction<'static, Postgres>,
        attempt: TxAttempt,
    ) -> impl Future<Output = Result<(T, Outcome), E>> + Send {
        (self.0)(tx, attempt)
    }
}

/// The attempt a same-transaction operation runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxAttempt {
    /// The scope of the record.
    pub scope: Scope,
    /// The idempotency key (to propagate into the messages the operation writes).
    pub key: Key,
    /// The attempt number: 1, unless a non-transactional attempt's lease expired before.
    pub number: u32,
    /// Whether a previous (non-transactional) attempt may have partially run.
    pub recovered: bool,
}

/// What [`PostgresStore::run_in_transaction`] did.
#[derive(Debug)]
pub enum TxExecution<T> {
    /// The operation ran and its writes committed with the completed record.
    Executed {
        /// What the operation returned.
        value: T,
        /// The attempt number.
        attempt: u32,
        /// When the record expires.
        expires_at: Timestamp,
    },
    /// The operation had already committed: its stored outcome.
    Replayed(Completed),
    /// A non-transactional attempt holds a live lease on the key.
    InFlight {
        /// The holder's attempt number.
        attempt: u32,
        /// When its lease runs out.
        retry_after: std::time::Duration,
    },
    /// The key was first used with a different fingerprint; nothing ran.
    Mismatch,
}

/// Why [`PostgresStore::run_in_transaction`] failed. Either way, the transaction was rolled back
/// or never committed: no record and no business rows were written, and a retry is safe.
#[derive(Debug)]
pub enum TxError<E> {
    /// The store or the connection failed (see [`StoreError::is_retryable`]). If it happened at
    /// commit, the commit's fate is unknown to the caller; a retry replays if it did commit.
    Store(StoreError),
    /// The operation returned an error; everything was rolled back.
    Operation(E),
}

impl<E: fmt::Display> fmt::Display for TxError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Store(error) => write!(f, "{error}"),
            Self::Operation(error) => write!(f, "operation failed and was rolled back: {error}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for TxError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Store(error) => Some(error),
            Self::Operation(error) => Some(error),
        }
    }
}

impl PostgresStore {
    /// Runs `operation` in a new transaction together with the idempotency record.
    ///
    /// The operation receives the open transaction and writes its business rows through it, and
    /// returns its value and the outcome to store for duplicates. On `Ok`, the completion and the
    /// business rows commit together; on `Err` (or a panic), everything rolls back.
    ///
    /// ```no_run
    /// use idempotency_core::{BeginRequest, Fingerprint, Key, Outcome, Scope};
    /// use idempotency_postgres::{PostgresStore, TxExecution};
    /// # async fn example(store: PostgresStore) -> Result<(), Box<dyn std::error::Error>> {
    /// let request = BeginRequest::new(Scope::global(), Key::new("order-7-charge")?, Fingerprint::of_bytes(b"EUR 10"));
    /// let run = store
    ///     .run_in_transaction(request, |tx, attempt| {
    ///         Box::pin(async move {
    ///             let id: i64 = sqlx::query_scalar("INSERT INTO charges (key, cents) VALUES ($1, 1000) RETURNING id")
    ///                 .bind(attempt.key.as_str())
    ///                 .fetch_one(&mut **tx)
    ///                 .await?;
    ///             Ok::<_, sqlx::Error>((id, Outcome::new(id.to_string())))
    ///         })
    ///     })
    ///     .await?;
    /// match run {
    ///     TxExecution::Executed { value: id, .. } => println!("charged, row {id}"),
    ///     TxExecution::Replayed(done) => println!("already charged: {:?}", done.outcome),
    ///     other => println!("not now: {other:?}"),
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`TxError::Store`] when the database fails (nothing is committed, or the commit's fate is
    /// unknown), [`TxError::Operation`] when the operation fails (everything rolled back).
    pub async fn run_in_transaction<T, E, F>(
        &self,
        request: BeginRequest,
        operation: F,
    ) -> Result<TxExecution<T>, TxError<E>>
    where
        F: for<'t> FnOnce(&'t mut sqlx::Transaction<'static, Postgres>, TxAttempt) -> TxFuture<'t, T, E>
            + Send
            + 'static,
        T: Send,
        E: Send,
    {
        self.run_operation_in_transaction(request, Closure(Box::new(operation)))
            .await
    }

    /// Runs a [`TxOperation`] in a new transaction together with the idempotency record: the
    /// same as [`PostgresStore::run_in_transaction`], for operations that borrow data (a
    /// delivered message, a request) which a closure returning a boxed future cannot hold.
    ///
    /// # Errors
    ///
    /// As [`PostgresStore::run_in_transaction`].
    pub async fn run_operation_in_transaction<O: TxOperation>(
        &self,
        request: BeginRequest,
        operation: O,
    ) -> Result<TxExecution<O::Value>, TxError<O::Error>> {
        let mut tx = self
            .pool()
            .begin()
            .await
            .map_err(|e| TxError::Store(map_error("begin a transaction", e)))?;
        let claim = self.begin_in(&mut tx, &request).await.map_err(TxError::Store)?;
        let (token, attempt, recovered) = match claim {
            Claim::Acquired {
                token,
                attempt,
                recovered,
                ..
            } => (token, attempt, recovered),
            // Nothing was written; dropping the transaction rolls it back.
            Claim::Replay(done) => return Ok(TxExecution::Replayed(done)),
            Claim::InFlight { attempt, retry_after } => {
                return Ok(TxExecution::InFlight { attempt, retry_after });
            }
            Claim::Mismatch => return Ok(TxExecution::Mismatch),
        };
        let context = TxAttempt {
            scope: request.scope.clone(),
            key: request.key.clone(),
            number: attempt,
            recovered,
        };
        let (value, outcome) = match operation.run(&mut tx, context).await {
            Ok(done) => done,
            Err(error) => {
                // Best effort: a failed rollback (connection gone) rolls back on the server anyway.
                let _ = tx.rollback().await;
                return Err(TxError::Operation(error));
            }
        };
        let completed = self
            .complete_in(
                &mut tx,
                &request.scope,
                &request.key,
                token,
                &outcome,
                request.retention,
            )
            .await
            .map_err(TxError::Store)?;
        let Fenced::Accepted(expires_at) = completed else {
            // Unreachable while the row lock is held; refuse to commit rather than guess.
            let _ = tx.rollback().await;
            return Err(TxError::Store(StoreError::new(
                idempotency_core::ErrorKind::Protocol,
                "the record claimed in this transaction was not there to complete",
            )));
        };
        tx.commit()
            .await
            .map_err(|e| TxError::Store(map_error("commit", e)))?;
        Ok(TxExecution::Executed {
            value,
            attempt,
            expires_at,
        })
    }

    /// Claims the record inside a transaction the caller holds (see the [module docs](self)).
    /// On `Acquired`, write the business rows, then [`PostgresStore::complete_in`], then commit.
    ///
    /// # Errors
    ///
    /// The database's error; the caller should roll back.
    pub async fn begin_in(&self, tx: &mut PgConnection, request: &BeginRequest) -> Result<Claim, StoreError> {
        begin_on(tx, self.statements(), request).await
    }

    /// Completes, inside the caller's transaction, a record claimed there by
    /// [`PostgresStore::begin_in`]; it becomes visible when the caller commits.
    ///
    /// # Errors
    ///
    /// The database's error; the caller should roll back.
    pub async fn complete_in(
        &self,
        tx: &mut PgConnection,
        scope: &Scope,
        key: &Key,
        token: Token,
        outcome: &Outcome,
        retention: std::time::Duration,
    ) -> Result<Fenced<Timestamp>, StoreError> {
        complete_on(tx, self.statements(), (scope, key, token), outcome, retention).await
    }
}
