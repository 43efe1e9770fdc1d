//! Same-transaction mode: the record commits in the caller's database transaction.
//!
//! With a separate store there is always a moment between "the side effect is committed" and
//! "the record says so" where a crash leaves the two disagreeing. When the side effect is itself
//! a write to the database that holds the records, that moment can be removed: the record is
//! claimed inside the business transaction, the business rows are written through it, and the
//! completion commits with them — all or nothing.
//!
//! A store that can do this implements [`TransactionalStore`] (PostgreSQL does). The
//! [`Guard`](crate::Guard) drives it with [`Guard::run_in_transaction`](crate::Guard::run_in_transaction),
//! which answers with the same [`Execution`](crate::Execution) as [`Guard::run`](crate::Guard::run):
//!
//! | the operation's value, by the policy | what happens | `recorded` |
//! |---|---|---|
//! | `Complete(outcome)` | completion written in the transaction, then commit | `Completed` |
//! | `Release` | rollback: neither record nor business rows | `Released` |
//! | — (the completion or the commit fails) | rollback, or a commit whose fate is unknown | `Failed` |
//!
//! A panic, or a dropped future, rolls the transaction back as well. Uncommitted, the claim is
//! invisible to other sessions, so no lease can expire under the operation: a concurrent
//! duplicate waits on the store's row lock, then replays (or, after a rollback, runs).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use crate::{Attempt, BeginRequest, Claim, Completion, Fenced, Held, Outcome, Store, StoreError, Timestamp};

/// A store that can claim and complete a record inside a database transaction that the caller
/// writes its business rows through; see the [module docs](self).
pub trait TransactionalStore: Store {
    /// The open transaction handed to the operation (for PostgreSQL, an sqlx transaction).
    type Transaction: Send;

    /// Opens a transaction.
    fn begin_transaction(&self) -> impl Future<Output = Result<Self::Transaction, StoreError>> + Send;

    /// `begin` inside `tx`: the claim takes the record's row lock until `tx` ends.
    fn begin_in(
        &self,
        tx: &mut Self::Transaction,
        request: &BeginRequest,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// `complete` inside `tx`, for a record claimed there; visible once `tx` commits.
    fn complete_in(
        &self,
        tx: &mut Self::Transaction,
        held: &Held,
        outcome: &Outcome,
        retention: Duration,
    ) -> impl Future<Output = Result<Fenced<Timestamp>, StoreError>> + Send;

    /// Undoes a claim made in `tx` whose operation is not to count (a batch's claim whose
    /// operation failed or did not run), the rest of the transaction going on: a first
    /// attempt's record (`held.attempt == 1`: a new key, or an expired record claimed afresh)
    /// is removed, as if never claimed; a record taken over is released as
    /// [`Store::release`] releases it (held by no attempt, the next claim takes it over as the
    /// next attempt).
    fn withdraw_in(
        &self,
        tx: &mut Self::Transaction,
        held: &Held,
    ) -> impl Future<Output = Result<Fenced<()>, StoreError>> + Send;

    /// Sets a savepoint in `tx` that [`TransactionalStore::rollback_to_savepoint`] returns
    /// to: a batch sets one before each operation, so that a failing operation's writes roll
    /// back alone. Setting one again sets a newer one (on PostgreSQL, nested in the previous:
    /// keep a transaction's savepoints to 64, the subtransactions a PostgreSQL backend tracks
    /// without overflowing to disk).
    fn savepoint(&self, tx: &mut Self::Transaction) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Undoes what `tx` wrote since the latest [`TransactionalStore::savepoint`]; the
    /// transaction goes on (a failed statement since then no longer aborts it).
    fn rollback_to_savepoint(
        &self,
        tx: &mut Self::Transaction,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// [`TransactionalStore::begin_in`] for every request of `requests`, one answer per
    /// request in order, each what its single call would answer had the calls run one after
    /// another (as [`Store::begin_many`]). The default loops over `begin_in`; a store that can
    /// claim a batch in one statement overrides it.
    fn begin_many_in(
        &self,
        tx: &mut Self::Transaction,
        requests: &[BeginRequest],
    ) -> impl Future<Output = Vec<Result<Claim, StoreError>>> + Send
    where
        Self: Sync,
    {
        async move {
            let mut answers = Vec::with_capacity(requests.len());
            for request in requests {
                answers.push(self.begin_in(tx, request).await);
            }
            answers
        }
    }

    /// [`TransactionalStore::complete_in`] for every completion of `completions`, in order,
    /// as [`Store::complete_many`]. The default loops over `complete_in`.
    fn complete_many_in(
        &self,
        tx: &mut Self::Transaction,
        completions: &[Completion],
    ) -> impl Future<Output = Vec<Result<Fenced<Timestamp>, StoreError>>> + Send
    where
        Self: Sync,
    {
        async move {
            let mut answers = Vec::with_capacity(completions.len());
            for c in completions {
                answers.push(self.complete_in(tx, &c.held, &c.outcome, c.retention).await);
            }
            answers
        }
    }

    /// Commits `tx`. An error leaves the commit's fate unknown to the caller.
    fn commit(&self, tx: Self::Transaction) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Rolls `tx` back (best effort: a transaction whose connection is gone is rolled back by
    /// the server).
    fn rollback(&self, tx: Self::Transaction) -> impl Future<Output = ()> + Send;
}

/// An operation that runs inside the record's transaction of a store `S`, for
/// [`Guard::run_operation_in_transaction`](crate::Guard::run_operation_in_transaction).
///
/// Unlike a closure (see [`Guard::run_in_transaction`](crate::Guard::run_in_transaction)), an
/// implementation can borrow what it works on (a delivered message, a request). The trait is
/// parameterised by the store rather than by its transaction type, whose lifetime parameters
/// would otherwise keep the compiler from proving the whole run `Send` on a spawned task.
pub trait TxOperation<S: TransactionalStore + ?Sized>: Send {
    /// What the operation returns; the guard's [`OutcomePolicy`](crate::OutcomePolicy) decides
    /// from it whether to commit (and what outcome to store) or to roll back.
    type Value: Send;

    /// Writes the business rows through `tx`.
    fn run(self, tx: &mut S::Transaction, attempt: Attempt) -> impl Future<Output = Self::Value> + Send;
}

/// The future a same-transaction closure returns: boxed, `Send`, and borrowing the transaction
/// (`Box::pin(async move { … })`).
pub type TxFuture<'t, T> = Pin<Box<dyn Future<Output = T> + Send + 't>>;

/// Boxed as a trait object so that the higher-ranked closure bound is not proved again, with
/// erased lifetimes, where the future's `Send` is checked.
type BoxedClosure<S, T> = Box<
    dyn for<'t> FnOnce(&'t mut <S as TransactionalStore>::Transaction, Attempt) -> TxFuture<'t, T> + Send,
>;

/// A closure over the transaction of a store `S`, as a [`TxOperation`].
pub struct InTransaction<S: TransactionalStore + ?Sized, T>(BoxedClosure<S, T>);

impl<S: TransactionalStore + ?Sized, T> InTransaction<S, T> {
    /// Wraps `operation`.
    pub fn new<F>(operation: F) -> Self
    where
        F: for<'t> FnOnce(&'t mut S::Transaction, Attempt) -> TxFuture<'t, T> + Send + 'static,
    {
        Self(Box::new(operation))
    }
}

impl<S: TransactionalStore + ?Sized, T> fmt::Debug for InTransaction<S, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("InTransaction(..)")
    }
}

impl<S: TransactionalStore + ?Sized, T: Send> TxOperation<S> for InTransaction<S, T> {
    type Value = T;

    fn run(self, tx: &mut S::Transaction, attempt: Attempt) -> impl Future<Output = T> + Send {
        (self.0)(tx, attempt)
    }
}
