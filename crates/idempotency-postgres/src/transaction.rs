//! Same-transaction mode on PostgreSQL: the store is a
//! [`TransactionalStore`] whose transaction is an sqlx
//! transaction on the store's pool, so the record commits with the business rows written
//! through it (see [`idempotency_core::transaction`] and
//! [`Guard::run_in_transaction`](idempotency_core::Guard::run_in_transaction)).
//!
//! * The claim is the same single-statement upsert as [`Store::begin`](idempotency_core::Store::begin);
//!   inside the transaction it takes the row lock. A concurrent duplicate's claim **waits on
//!   that lock** and, once this transaction commits, sees the completed record and gets the
//!   replay; if this transaction rolls back, the duplicate claims the key and runs.
//! * An operation the policy releases, a panic, a lost connection or a terminated backend rolls
//!   everything back: no record, no business rows. A retry runs from scratch.
//! * Uncommitted, the in-flight record is invisible to other sessions, so its lease never
//!   expires under them; a duplicate waits for as long as the transaction runs. Bound that wait
//!   with `lock_timeout` (or `statement_timeout`) on the pool's connections if needed.
//! * Times inside the transaction are its start time (`now()`).
//!
//! ```no_run
//! use idempotency_core::{Decision, Execution, Fingerprint, Guard, Key, Outcome, Scope};
//! use idempotency_postgres::PostgresStore;
//!
//! # async fn example(store: PostgresStore) -> Result<(), Box<dyn std::error::Error>> {
//! let guard = Guard::new(store);
//! let policy = |row: &Result<i64, sqlx::Error>| match row {
//!     Ok(id) => Decision::Complete(Outcome::new(id.to_string())),
//!     Err(_) => Decision::Release, // roll back: neither the row nor the record remains
//! };
//! let key = Key::new("order-7-charge")?;
//! let run = guard
//!     .run_in_transaction(Scope::global(), key, Fingerprint::of_bytes(b"EUR 10"), policy, |tx, attempt| {
//!         Box::pin(async move {
//!             sqlx::query_scalar("INSERT INTO charges (key, cents) VALUES ($1, 1000) RETURNING id")
//!                 .bind(attempt.key().as_str())
//!                 .fetch_one(&mut **tx)
//!                 .await
//!         })
//!     })
//!     .await?;
//! match run {
//!     Execution::Executed { value: Ok(id), .. } => println!("charged, row {id}"),
//!     Execution::Replayed(done) => println!("already charged: {:?}", done.outcome),
//!     other => println!("not now: {other:?}"),
//! }
//! # Ok(())
//! # }
//! ```

use std::time::Duration;

use idempotency_core::{
    BeginRequest, Claim, Completion, Fenced, Held, Outcome, StoreError, Timestamp, TransactionalStore,
};
use sqlx::postgres::Postgres;

use idempotency_core::sql::{self, Savepoint};

use crate::batch;
use crate::error::map_error;
use crate::store::{PostgresStore, begin_on, complete_on};

/// The transaction a same-transaction operation writes through.
pub type PgTransaction = sqlx::Transaction<'static, Postgres>;

impl TransactionalStore for PostgresStore {
    type Transaction = PgTransaction;

    async fn begin_transaction(&self) -> Result<PgTransaction, StoreError> {
        self.pool()
            .begin()
            .await
            .map_err(|e| map_error("begin a transaction", e))
    }

    async fn begin_in(&self, tx: &mut PgTransaction, request: &BeginRequest) -> Result<Claim, StoreError> {
        let claim = begin_on(tx, self.statements(), request).await;
        self.claimed(1).await;
        claim
    }

    async fn complete_in(
        &self,
        tx: &mut PgTransaction,
        held: &Held,
        outcome: &Outcome,
        retention: Duration,
    ) -> Result<Fenced<Timestamp>, StoreError> {
        complete_on(tx, self.statements(), held, outcome, retention).await
    }

    async fn withdraw_in(&self, tx: &mut PgTransaction, held: &Held) -> Result<Fenced<()>, StoreError> {
        sql::withdraw(self, &mut **tx, held).await
    }

    async fn savepoint(&self, tx: &mut PgTransaction) -> Result<(), StoreError> {
        sql::savepoint::<Postgres>(tx, Savepoint::Set, map_error).await
    }

    async fn rollback_to_savepoint(&self, tx: &mut PgTransaction) -> Result<(), StoreError> {
        sql::savepoint::<Postgres>(tx, Savepoint::RollBack, map_error).await
    }

    /// One statement for the batch, as [`Store::begin_many`](idempotency_core::Store::begin_many)
    /// on the pool; the new keys' row locks are held until the transaction ends.
    async fn begin_many_in(
        &self,
        tx: &mut PgTransaction,
        requests: &[BeginRequest],
    ) -> Vec<Result<Claim, StoreError>> {
        let answers = batch::begin_batch(tx, self.statements(), requests).await;
        self.claimed(requests.len()).await;
        answers
    }

    /// One statement for the batch, as [`Store::complete_many`](idempotency_core::Store::complete_many).
    async fn complete_many_in(
        &self,
        tx: &mut PgTransaction,
        completions: &[Completion],
    ) -> Vec<Result<Fenced<Timestamp>, StoreError>> {
        batch::complete_batch(tx, self.statements(), completions).await
    }

    async fn commit(&self, tx: PgTransaction) -> Result<(), StoreError> {
        tx.commit().await.map_err(|e| map_error("commit", e))
    }

    async fn rollback(&self, tx: PgTransaction) {
        // Best effort: a failed rollback (connection gone) rolls back on the server anyway.
        let _ = tx.rollback().await;
    }
}
