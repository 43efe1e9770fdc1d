//! Same-transaction mode on MySQL and MariaDB: the store is a [`TransactionalStore`] whose
//! transaction is an sqlx transaction on the store's pool, so the record commits with the
//! business rows written through it (see [`idempotency_core::transaction`] and
//! [`Guard::run_in_transaction`](idempotency_core::Guard::run_in_transaction)).
//!
//! * The claim is the first thing the transaction does: a consistent read (which starts the
//!   transaction's snapshot), then the `INSERT` of a new key. A concurrent duplicate's insert
//!   **waits on the uncommitted row** and, once this transaction commits, reads the completed
//!   record under a shared lock and gets the replay; if this transaction rolls back, the
//!   duplicate's insert goes through and it runs. No gap locks are taken, so duplicates do not
//!   deadlock on a new key.
//! * An operation the policy releases, a panic, a lost or killed connection rolls everything
//!   back: no record, no business rows. A retry runs from scratch.
//! * Uncommitted, the in-flight record is invisible to other sessions, so its lease never
//!   expires under them; a duplicate waits for as long as the transaction runs, at most
//!   `innodb_lock_wait_timeout` (50 s by default), then fails with a retryable
//!   [`ErrorKind::Timeout`](idempotency_core::ErrorKind). Lower it on the pool's sessions if
//!   duplicates should give up sooner.
//! * A deadlock inside the transaction (InnoDB rolled it back) is a retryable
//!   [`ErrorKind::Timeout`](idempotency_core::ErrorKind): the guard's caller runs the whole
//!   transaction again.
//! * `complete` sets the session's `LAST_INSERT_ID()` to the record's expiry (that is how the
//!   expiry comes back without a second read); read `LAST_INSERT_ID()` before it if the
//!   operation needs its own.
//!
//! ```no_run
//! use idempotency_core::{Decision, Execution, Fingerprint, Guard, Key, Outcome, Scope};
//! use idempotency_mysql::MysqlStore;
//!
//! # async fn example(store: MysqlStore) -> Result<(), Box<dyn std::error::Error>> {
//! let guard = Guard::new(store);
//! let policy = |row: &Result<u64, sqlx::Error>| match row {
//!     Ok(id) => Decision::Complete(Outcome::new(id.to_string())),
//!     Err(_) => Decision::Release, // roll back: neither the row nor the record remains
//! };
//! let key = Key::new("order-7-charge")?;
//! let run = guard
//!     .run_in_transaction(Scope::global(), key, Fingerprint::of_bytes(b"EUR 10"), policy, |tx, attempt| {
//!         Box::pin(async move {
//!             sqlx::query("INSERT INTO charges (idempotency_key, cents) VALUES (?, 1000)")
//!                 .bind(attempt.key().as_str())
//!                 .execute(&mut **tx)
//!                 .await
//!                 .map(|done| done.last_insert_id())
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
    BeginRequest, Claim, Fenced, Held, Outcome, StoreError, Timestamp, TransactionalStore,
};
use sqlx::mysql::MySql;

use idempotency_core::sql::{self, Savepoint};

use crate::error::map_error;
use crate::store::{MysqlStore, Within, begin_on, complete_on};

/// The transaction a same-transaction operation writes through.
pub type MysqlTransaction = sqlx::Transaction<'static, MySql>;

impl TransactionalStore for MysqlStore {
    type Transaction = MysqlTransaction;

    async fn begin_transaction(&self) -> Result<MysqlTransaction, StoreError> {
        self.pool()
            .begin()
            .await
            .map_err(|e| map_error("begin a transaction", e))
    }

    async fn begin_in(&self, tx: &mut MysqlTransaction, request: &BeginRequest) -> Result<Claim, StoreError> {
        begin_on(tx, self, request, Within::Transaction).await
    }

    async fn complete_in(
        &self,
        tx: &mut MysqlTransaction,
        held: &Held,
        outcome: &Outcome,
        retention: Duration,
    ) -> Result<Fenced<Timestamp>, StoreError> {
        complete_on(tx, self.statements(), held, outcome, retention).await
    }

    async fn withdraw_in(&self, tx: &mut MysqlTransaction, held: &Held) -> Result<Fenced<()>, StoreError> {
        sql::withdraw(self, &mut **tx, held).await
    }

    /// `SAVEPOINT`: MySQL replaces a savepoint of the same name, so a batch's savepoints do
    /// not pile up.
    async fn savepoint(&self, tx: &mut MysqlTransaction) -> Result<(), StoreError> {
        sql::savepoint::<MySql>(tx, Savepoint::Set, map_error).await
    }

    async fn rollback_to_savepoint(&self, tx: &mut MysqlTransaction) -> Result<(), StoreError> {
        sql::savepoint::<MySql>(tx, Savepoint::RollBack, map_error).await
    }

    async fn commit(&self, tx: MysqlTransaction) -> Result<(), StoreError> {
        tx.commit().await.map_err(|e| map_error("commit", e))
    }

    async fn rollback(&self, tx: MysqlTransaction) {
        // Best effort: a failed rollback (connection gone) rolls back on the server anyway.
        let _ = tx.rollback().await;
    }
}
