//! The storage-neutral core of the idempotency toolkit: keys, fingerprints, the record state
//! machine with leases and fencing tokens, the [`Store`] contract, the in-memory reference store
//! and the [`Guard`] that runs an operation under the protocol.
//!
//! This crate does no I/O of its own. Stores live in their own crates (`idempotency-sqlite`, …),
//! edges (the HTTP layer, message consumers) drive the [`Guard`].
//!
//! # The protocol in one picture
//!
//! ```text
//!            begin(scope, key, fingerprint, token, lease)
//!   none ───────────────────────────────────────────────▶ InFlight { token, lease_until }
//!                                                             │ extend (heartbeat)  │ lease expired +
//!                         complete(token, outcome) ◀──────────┤                     │ begin by another
//!   Completed { outcome } ◀────────────────────────────────────┘                     ▼
//!        │  begin → Replay                 release(token) → held by nobody   takeover: new token,
//!        ▼  (until retention expires)                                        attempt + 1, recovered
//! ```
//!
//! See [`machine`] for the full transition table, and [`guard`] for how an operation is run. The
//! guides are part of these docs: [`guide::protocol`] (keys, the record state machine, leases and
//! fencing) and [`guide::writing_a_store`] (how a store is built on this crate, and what the
//! conformance suite demands).
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "aws")]
pub mod aws;
pub mod codec;
#[cfg(feature = "sqlx")]
pub mod connections;
pub mod fingerprint;
pub mod group_commit;
pub mod guard;
pub mod guide;
pub mod health;
pub mod identifier;
pub mod key;
pub mod lanes;
pub mod machine;
mod memory;
pub mod pem;
pub mod purge;
mod record;
pub mod registry;
pub mod secret;
#[cfg(feature = "sqlx")]
pub mod sql;
mod store;
mod time;
pub mod trace;
pub mod transaction;
pub mod units;
pub mod wait;

pub use codec::{DecodeError, RecordColumns, RecordParts};
pub use fingerprint::{Fingerprint, FingerprintBuilder, FingerprintError, FingerprintMode, JsonPointer};
pub use group_commit::{GroupCommit, GroupSettings};
pub use guard::{
    Attempt, Claimed, ClaimedRun, Decision, Execution, Guard, OutcomePolicy, Recorded, RunLease,
    TransactionBatch,
};
pub use health::{Watched, WriteFailure, WriteHealth};
pub use identifier::Identifier;
pub use key::{
    IDEMPOTENCY_KEY_HEADER, JsonKeyError, Key, KeyError, KeyLog, LoggedKey, MAX_KEY_LEN, Redacted, Scope,
};
pub use lanes::Lanes;
pub use memory::MemoryStore;
pub use purge::Purger;
pub use record::{
    BeginRequest, Claim, Completed, DEFAULT_CONSUMER_RETENTION, DEFAULT_LEASE, DEFAULT_RETENTION, Fenced,
    Held, ListFilter, Outcome, Record, RecordState, RecordSummary, StateFilter, Stats, SummaryState, Token,
};
pub use registry::{Access, DynStore, OpenFuture, Registry, StoreKind};
pub use secret::{ScopeSecret, SecretError};
pub use store::{
    BatchCall, Completion, ErrorKind, Store, StoreAdmin, StoreError, batch_answers, begin_each,
    complete_each, failed_batch, is_credential, is_scheme, lock_order, redact_url,
};
pub use time::{
    Backoff, Clock, MAX_DURATION, ManualClock, SystemClock, Timestamp, duration_millis, stored_millis,
};
pub use transaction::{InTransaction, TransactionalStore, TxFuture, TxOperation};
pub use wait::InFlightWait;
