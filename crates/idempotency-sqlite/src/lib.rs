//! The embedded, durable idempotency store on SQLite — the default store of the `idem` binary.
//!
//! * **Durable**: write-ahead logging, and `synchronous = FULL` by default, so a completed record
//!   survives a crash of the process *and* of the machine. `synchronous=normal` trades the last
//!   commits before a power loss for throughput; see [`Synchronous`].
//! * **Safe across processes**: every write is a `BEGIN IMMEDIATE` transaction that takes the
//!   write lock before reading, so two processes on one file never deadlock on a read-to-write
//!   upgrade (`SQLITE_BUSY_SNAPSHOT`, which skips the busy handler); a writer that finds the lock
//!   held waits up to the busy timeout (5 s by default) and then fails with a retryable
//!   [`ErrorKind::Timeout`](idempotency_core::ErrorKind::Timeout).
//! * **Self-installing**: the schema is created on first open and versioned with
//!   `PRAGMA user_version`; a database from a newer version, or another application's database,
//!   is refused with [`ErrorKind::Schema`](idempotency_core::ErrorKind::Schema). Any number of
//!   processes may open a new file at once (replicas started together): the schema is created
//!   by the first to take the write lock and found by the others, and each open waits for a
//!   lock another holds up to the busy timeout (`busy_timeout_ms`), including the locks
//!   SQLite's own busy handler does not wait for (switching a new file to write-ahead logging).
//! * **Same behaviour as the reference model**: decisions are made by
//!   [`idempotency_core::machine`] inside the write transaction, and the store passes the
//!   conformance suite and the model-based property test of `idempotency-testkit`.
//! * **Time** comes from the store's [`Clock`](idempotency_core::Clock) (the system clock by
//!   default): every process sharing a file is on one host, so one clock.
//!
//! All of a store's operations run on one thread that owns the connection; one process therefore
//! issues one write at a time, which is also what SQLite allows.
//!
//! ```
//! use std::time::Duration;
//! use idempotency_core::{Decision, Execution, Fingerprint, Guard, Key, Outcome, Scope};
//! use idempotency_sqlite::SqliteStore;
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! # let dir = tempfile::tempdir()?;
//! # let url = format!("sqlite://{}/idem.db", dir.path().display());
//! let store = SqliteStore::open(&url).await?; // e.g. "sqlite://idem.db"
//! let guard = Guard::new(store).retention(Duration::from_secs(24 * 3600));
//! let run = guard
//!     .run(
//!         Scope::global(),
//!         Key::new("invoice-2026-0042")?,
//!         Fingerprint::of_bytes(b"send invoice 42"),
//!         |sent: &bool| Decision::Complete(Outcome::new(if *sent { "sent" } else { "skipped" })),
//!         |_attempt| async { true /* send the e-mail here */ },
//!     )
//!     .await?;
//! assert!(matches!(run, Execution::Executed { .. }));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```

mod options;
pub mod sql;
mod store;

pub use options::{DEFAULT_MAX_BATCH, KIND, Location, MAX_BATCH_LIMIT, SqliteOptions, Synchronous};
pub use rusqlite;
pub use store::SqliteStore;
