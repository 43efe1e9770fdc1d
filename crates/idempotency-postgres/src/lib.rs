//! The PostgreSQL idempotency store.
//!
//! * **No read-then-write window.** `complete`, `release` and `extend` are each a single
//!   statement (a conditional update in a CTE), decided by the server under the row lock.
//!   `begin` first reads the record with a plain `SELECT`: a replay, an in-flight conflict and a
//!   mismatch are answered from that read alone, with no lock and no write. Every write is one
//!   conditional statement that decides again on what it finds: the insert of a new key (which
//!   returns a record a concurrent caller committed first) and the claim of an expired record or
//!   a takeover (under the row lock).
//! * **One round trip per statement, no ping before or after.** The store's operations run on
//!   connections of their own ([`idempotency_core::connections`]) that are handed out and taken
//!   back without a check (sqlx's pool pings every connection it takes back: a second round
//!   trip per statement). A connection the server closed (a restart) fails its next statement
//!   with a retryable [`ErrorKind::Unavailable`](idempotency_core::ErrorKind) and is replaced;
//!   one left mid-statement (a cancelled caller) is closed, never reused. [`PostgresStore::pool`]
//!   is the application's (same-transaction mode), so up to twice `max_connections` can be open.
//! * **Server time.** Leases and retention use the server's `now()`, so application instances
//!   with skewed clocks agree.
//! * **Operators' view.** Times are `timestamptz`, keys and scopes readable `text`; indexes on
//!   the expiry (for `purge_expired`, in bounded `SKIP LOCKED` batches) and on in-flight
//!   acquisition time (for `stats` and the stale-lease report).
//! * **Safe names.** The table and schema are configurable and validated
//!   ([`Identifier`]): they are the only text formatted into SQL, everything else is bound.
//! * **Same-transaction mode** ([`transaction`]): the record is claimed and completed inside the
//!   business transaction, so a crash can never leave a side effect without its record or a
//!   record without its side effect.
//! * **Typed failures.** A refused connection, a terminated backend, a server restart or an
//!   exhausted pool is a retryable [`ErrorKind::Unavailable`](idempotency_core::ErrorKind) or
//!   [`ErrorKind::Timeout`](idempotency_core::ErrorKind), never a wrong answer; the pool
//!   reconnects by itself when the server is back.
//! * **Capacity kept for lease-keeping.** `begin` and the reads use at most
//!   `max_connections - lease_connections` connections at once (a quarter of the pool is kept by
//!   default), so a storm of retries never delays a running attempt's heartbeat past its lease;
//!   past that, new work waits at most `acquire_timeout` and is then shed with
//!   [`ErrorKind::Overloaded`](idempotency_core::ErrorKind) ([`idempotency_core::Lanes`]).
//! * **Group commit, when asked for** (`?batch=on` in the URL, or
//!   [`GroupCommit`](idempotency_core::GroupCommit) around a store built in code): concurrent
//!   claims of new keys, and concurrent completions, go to the server as one batch statement and
//!   one commit (`begin_many`, `complete_many`) whenever the calls ahead of them are still at
//!   the server; each call gets exactly its single call's answer, and a call that finds the
//!   store idle goes at once.
//!
//! ```no_run
//! use idempotency_core::{Guard, StoreAdmin};
//! use idempotency_postgres::{PostgresOptions, PostgresStore};
//! # async fn example() -> Result<(), idempotency_core::StoreError> {
//! let store = PostgresStore::connect_with(
//!     PostgresOptions::from_url("postgres://app@db.internal/payments")?.table("payment_keys")?,
//! )
//! .await?;
//! println!("{:?}", store.stats(None).await?);
//! let guard = Guard::new(store);
//! # let _ = guard;
//! # Ok(())
//! # }
//! ```

mod batch;
mod error;
mod options;
mod sql;
mod store;
pub mod transaction;

pub use idempotency_core::Identifier;
pub use options::{KIND, PostgresOptions};
pub use sql::SCHEMA_VERSION;
/// The sqlx this crate is built on, for same-transaction operations to write through.
pub use sqlx;
pub use store::{Operation, PostgresStore};
pub use transaction::PgTransaction;
