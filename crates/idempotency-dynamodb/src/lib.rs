//! A DynamoDB store for idempotency records.
//!
//! One item per (scope, key). Every transition is decided by the reference state machine
//! (`idempotency_core::machine`) and written with **one conditional write** that only succeeds
//! if the item is still what the decision was made on (its version attribute, or its absence):
//! two workers racing on a key cannot both win, and a loser re-reads and decides again.
//!
//! - `begin` first writes the new record on the condition that the key is absent or expired,
//!   asking DynamoDB for the old item when the condition fails
//!   (`ReturnValuesOnConditionCheckFailure`), so a duplicate is answered (replay, in flight,
//!   mismatch) without a second read. A takeover is a write conditioned on the version read.
//! - `complete`, `release` and `extend` read the item with a strongly consistent read, decide,
//!   and write conditioned on its version. A token that does not hold the record gets
//!   `LeaseLost` and writes nothing (fencing).
//!
//! # Time
//!
//! DynamoDB has no server clock that conditions can use, so the store decides with the
//! caller's clock ([`DynamoDbOptions::clock`]). Clocks of different hosts disagree: a takeover
//! is allowed only once the lease has been over for [`DynamoDbOptions::max_clock_skew`] more
//! (default 1 s) by the taking host's clock. A skew beyond that bound lets a takeover start
//! while the holder still believes its lease is live; the holder's `complete` is then refused
//! (`LeaseLost`), but both attempts may have run.
//!
//! # Expiry and cost
//!
//! Items carry a `ttl` attribute (seconds) for DynamoDB's TTL deletion, which lags by up to
//! days; an expired item is treated as absent by every operation. `purge_expired`, `list` and
//! `stats` scan the table (paginated, strongly consistent): their cost grows with the table,
//! so run them from operators' tools, not request paths.

mod store;
mod url;

pub use store::{DynamoDbOptions, DynamoDbStore, http_client};
pub use url::{DynamoDbUrl, KIND};
