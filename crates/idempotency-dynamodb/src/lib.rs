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
//! - `complete`, `release` and `extend` are one `UpdateItem` each, conditioned on the item being
//!   in flight, held by the caller's token and live: exactly the cases in which the machine
//!   writes. When the condition fails, the old item comes back with the failure and the
//!   machine answers from it: a token that does not hold the record gets `LeaseLost` and writes
//!   nothing (fencing); a retried `complete` whose first try landed is accepted again. The one
//!   case an update expression cannot decide, an `extend` whose lease would outlive the
//!   record's retention (it has no `max`), is written after that answer, conditioned on the
//!   item's version: a second request, only near the end of a record's retention.
//! - `begin_many` and `complete_many` are the single calls one after another (the contract's
//!   default): `TransactWriteItems` keeps a condition per item but is all or nothing, so one
//!   key's failed condition (a duplicate) would cancel every other key's write, and
//!   `BatchWriteItem` takes no conditions. A batch costs what its calls cost.
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
//!
//! # What was verified only against moto
//!
//! No real DynamoDB is reachable from the machines the tests run on: every test runs against
//! moto's server (`scripts/services`), one request at a time. moto's threaded server does not
//! make a conditional write atomic, so the race tests need it to serve requests one by one;
//! DynamoDB makes every conditional write atomic. Verified only there:
//!
//! - conditional `PutItem`/`UpdateItem` with `ReturnValuesOnConditionCheckFailure=ALL_OLD`
//!   (the conformance suite, its 64-way races and the model comparison);
//! - `TransactWriteItems` for outcomes split into chunk items;
//! - the server killed and restarted mid-run (`tests/it/outage.rs`, on a moto that records its
//!   requests and replays them on start, since moto keeps its tables in memory);
//! - TTL: moto accepts the TTL setting but deletes nothing, so only "expired items are treated
//!   as absent" is tested, not DynamoDB's deletion itself.

mod store;
mod url;

pub use store::{DynamoDbOptions, DynamoDbStore, http_client, http_client_trusting};
pub use url::{DynamoDbUrl, KIND};
