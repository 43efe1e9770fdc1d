//! The MySQL and MariaDB idempotency store.
//!
//! * **Reads that change nothing write nothing.** `begin` first reads the record with a
//!   consistent (non-locking) read: a replay, an in-flight conflict and a mismatch are answered
//!   from it alone, with no lock and no write. A new key is one `INSERT` (a concurrent
//!   duplicate gets a duplicate-key error and reads the winner's record); only an expired
//!   record or a takeover is decided again under the row lock (`SELECT … FOR UPDATE`), by the
//!   core's state machine, in a short transaction.
//! * **One statement for lease-keeping.** `complete`, `release` and `extend` are each one
//!   conditional `UPDATE` decided by the server under the row lock; the new expiry or end of
//!   lease comes back in the reply (`LAST_INSERT_ID(expr)`), so there is no second read.
//! * **No check-then-act, no gap locks.** Claims never lock an absent row (`FOR UPDATE` on a
//!   missing key takes a gap lock under `REPEATABLE READ`, and two such claims deadlock on
//!   their inserts). A `begin` that InnoDB still picks as a deadlock victim runs again, at most
//!   eight rounds, and is counted ([`MysqlStore::deadlock_retries`],
//!   `idempotency_mysql_deadlock_retries_total`).
//! * **Server time.** Leases and retention use the server's clock (`UTC_TIMESTAMP(3)`,
//!   `SYSDATE(3)` in UTC sessions), so application instances with skewed clocks agree. Times
//!   are `DATETIME(3)` in UTC, readable by operators.
//! * **Exact keys.** Scope and key are `VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin`:
//!   compared byte for byte (`Key` and `key` are two keys), readable in any client.
//! * **Safe names.** The table name is configurable and validated
//!   ([`Identifier`](idempotency_core::Identifier)): it is the only text formatted into SQL,
//!   everything else is bound. The table lives in the URL's database.
//! * **Migrations** run under a named lock (`GET_LOCK('idempotency-migrate')`) and record the
//!   schema version as the table's comment; a table of that name that is not a records table
//!   of this version is refused ([`ErrorKind::Schema`](idempotency_core::ErrorKind)), never
//!   altered.
//! * **Same-transaction mode** ([`transaction`]): the record is claimed and completed inside
//!   the business transaction, so a crash can never leave a side effect without its record or
//!   a record without its side effect.
//! * **Typed failures.** A refused, lost or killed connection, a server restart or an
//!   exhausted pool is a retryable [`ErrorKind::Unavailable`](idempotency_core::ErrorKind) or
//!   [`ErrorKind::Timeout`](idempotency_core::ErrorKind) (so are a lock wait timeout and a
//!   deadlock), never a wrong answer; wrong credentials and an unknown database are
//!   [`ErrorKind::InvalidConfig`](idempotency_core::ErrorKind).
//! * **One round trip per statement.** The store's operations run on connections of their own
//!   ([`idempotency_core::connections`]) that go back without the `COM_PING` sqlx's pool sends
//!   on every release; one left mid-statement (a cancelled caller) is closed, never reused.
//!   [`MysqlStore::pool`] is the application's (same-transaction mode), so up to twice
//!   `max_connections` can be open.
//! * **Capacity kept for lease-keeping**, as on PostgreSQL ([`idempotency_core::Lanes`]).
//! * **Bounded purges.** `purge_expired(limit)` is one `DELETE … ORDER BY expires_at LIMIT n`
//!   along the expiry index.
//! * **Group commit, when asked for** (`?batch=on` in the URL, or
//!   [`GroupCommit`](idempotency_core::GroupCommit) around a store built in code): concurrent
//!   claims of new keys, and concurrent completions, go to the server as one batch in one
//!   transaction (`begin_many`, `complete_many`) whenever the calls ahead of them are still at
//!   the server; each call gets exactly its single call's answer, and a call that finds the
//!   store idle goes at once.
//!
//! Tested on MariaDB 10.11 (the whole conformance suite, the 64-way races, the
//! linearizability check through a connection-cutting proxy, same-transaction mode, connection
//! loss and kills). The SQL avoids what MariaDB and MySQL 8 do differently (`RETURNING`,
//! `FOR SHARE`, CTEs in writes), so MySQL 8.0+ is expected to work; it is not tested here.
//! MariaDB 10.6+ and MySQL 8.0+ are supported; older versions lack nothing the store uses
//! but are no longer maintained by their vendors.
//!
//! ```no_run
//! use idempotency_core::{Guard, StoreAdmin};
//! use idempotency_mysql::{MysqlOptions, MysqlStore};
//! # async fn example() -> Result<(), idempotency_core::StoreError> {
//! let store = MysqlStore::connect_with(
//!     MysqlOptions::from_url("mysql://app@db.internal/payments")?.table("payment_keys")?,
//! )
//! .await?;
//! println!("{:?}", store.stats(None).await?);
//! let guard = Guard::new(store);
//! # let _ = guard;
//! # Ok(())
//! # }
//! ```

mod error;
mod options;
mod sql;
mod store;
pub mod transaction;

pub use options::{KIND, MysqlOptions};
pub use sql::SCHEMA_VERSION;
/// The sqlx this crate is built on, for same-transaction operations to write through.
pub use sqlx;
pub use store::{MysqlStore, Operation};
pub use transaction::MysqlTransaction;
