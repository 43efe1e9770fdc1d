//! The record state machine as pure functions ([`crate::guide::protocol`]).
//!
//! Each function takes the store time, the record as it is (or `None`), and the operation's
//! arguments, and returns the answer plus the [`Effect`] the store must apply **atomically with
//! the read** (under a lock, in a write transaction). Stores that can run this logic in-process
//! (memory, SQLite, any SQL store with `SELECT … FOR UPDATE`) call these functions so that they
//! behave exactly like the reference model; stores that must decide server-side (a Lua script, a
//! single SQL statement) implement the same table and are held to it by the conformance suite.
//!
//! | operation | record before | answer |
//! |---|---|---|
//! | `begin` | none, or expired | new in-flight record, attempt 1 → `Acquired` |
//! | | fingerprint differs | `Mismatch` (checked before anything else) |
//! | | in flight with the caller's own token | `Acquired` again (a retried `begin`) |
//! | | in flight, lease live | `InFlight { retry_after }` |
//! | | in flight, lease expired | takeover: caller's token, attempt + 1 → `Acquired { recovered: true }` |
//! | | completed | `Replay` |
//! | `complete` | in flight with this token (lease expired or not) | completed, kept for `retention` |
//! | | completed by this token | accepted again, outcome unchanged (a retried `complete`) |
//! | | anything else | `LeaseLost`, nothing written |
//! | `release` | in flight with this token | kept with its fingerprint and attempt, held by [`Token::NONE`], lease ended now |
//! | | anything else | `LeaseLost` |
//! | `extend` | in flight with this token | lease moved to now + lease |
//! | | anything else | `LeaseLost` |
//!
//! An expired record (`now >= expires_at`) is treated as absent by every operation, and
//! [`Token::NONE`] holds nothing: `complete`, `release` and `extend` with it are `LeaseLost`.
//!
//! A released record is an in-flight record whose lease has ended and that no attempt holds: the
//! next `begin` with the same fingerprint takes it over as attempt + 1 with `recovered`, since
//! the released attempt may have partly run; another fingerprint is a `Mismatch`; the released
//! attempt's token is refused from then on. It keeps its expiry, so a key that has run before
//! never looks new until its retention is over.

use std::time::Duration;

use crate::{BeginRequest, Claim, Completed, Fenced, Held, Outcome, Record, RecordState, Timestamp, Token};

/// What a store must write after a transition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Nothing changes.
    None,
    /// Insert or replace the record with this one.
    Put(Record),
}

/// The record if it exists and has not expired at `now`.
#[must_use]
pub fn live(now: Timestamp, existing: Option<&Record>) -> Option<&Record> {
    existing.filter(|record| !record.is_expired(now))
}

/// `begin`: see the [module table](self).
#[must_use]
pub fn begin(now: Timestamp, existing: Option<&Record>, request: &BeginRequest) -> (Claim, Effect) {
    let lease_until = now.after(request.lease);
    let Some(record) = live(now, existing) else {
        let record = Record {
            scope: request.scope.clone(),
            key: request.key.clone(),
            fingerprint: request.fingerprint,
            attempt: 1,
            created_at: now,
            expires_at: now.after(request.retention).max(lease_until),
            state: RecordState::InFlight {
                token: request.token,
                acquired_at: now,
                lease_until,
            },
        };
        let claim = Claim::Acquired(Held::acquired(request, 1, lease_until));
        return (claim, Effect::Put(record));
    };
    if record.fingerprint != request.fingerprint {
        return (Claim::Mismatch, Effect::None);
    }
    match &record.state {
        RecordState::Completed {
            outcome,
            completed_at,
            ..
        } => (
            Claim::Replay(Completed {
                outcome: outcome.clone(),
                attempt: record.attempt,
                completed_at: *completed_at,
                expires_at: record.expires_at,
            }),
            Effect::None,
        ),
        RecordState::InFlight {
            token,
            lease_until: held_until,
            ..
        } if *token == request.token && *token != Token::NONE => (
            Claim::Acquired(Held::acquired(request, record.attempt, *held_until)),
            Effect::None,
        ),
        RecordState::InFlight {
            lease_until: held_until,
            ..
        } if now < *held_until => (
            Claim::InFlight {
                attempt: record.attempt,
                retry_after: held_until.since(now),
            },
            Effect::None,
        ),
        RecordState::InFlight { .. } => {
            let attempt = record.attempt.saturating_add(1);
            let taken_over = Record {
                attempt,
                expires_at: record
                    .expires_at
                    .max(now.after(request.retention))
                    .max(lease_until),
                state: RecordState::InFlight {
                    token: request.token,
                    acquired_at: now,
                    lease_until,
                },
                ..record.clone()
            };
            let claim = Claim::Acquired(Held::acquired(request, attempt, lease_until));
            (claim, Effect::Put(taken_over))
        }
    }
}

/// `complete`: see the [module table](self). The accepted value is the record's expiry.
pub fn complete(
    now: Timestamp,
    existing: Option<&Record>,
    token: Token,
    outcome: Outcome,
    retention: Duration,
) -> (Fenced<Timestamp>, Effect) {
    match live(now, existing) {
        Some(record) => match &record.state {
            RecordState::InFlight { token: held, .. } if *held == token && token != Token::NONE => {
                let expires_at = now.after(retention);
                let completed = Record {
                    expires_at,
                    state: RecordState::Completed {
                        token,
                        outcome,
                        completed_at: now,
                    },
                    ..record.clone()
                };
                (Fenced::Accepted(expires_at), Effect::Put(completed))
            }
            RecordState::Completed { token: held, .. } if *held == token => {
                (Fenced::Accepted(record.expires_at), Effect::None)
            }
            _ => (Fenced::LeaseLost, Effect::None),
        },
        None => (Fenced::LeaseLost, Effect::None),
    }
}

/// `release`: see the [module table](self).
pub fn release(now: Timestamp, existing: Option<&Record>, token: Token) -> (Fenced<()>, Effect) {
    let Some(record) = live(now, existing) else {
        return (Fenced::LeaseLost, Effect::None);
    };
    match &record.state {
        RecordState::InFlight {
            token: held,
            acquired_at,
            ..
        } if *held == token && token != Token::NONE => {
            let released = Record {
                state: RecordState::InFlight {
                    token: Token::NONE,
                    acquired_at: *acquired_at,
                    lease_until: now,
                },
                ..record.clone()
            };
            (Fenced::Accepted(()), Effect::Put(released))
        }
        _ => (Fenced::LeaseLost, Effect::None),
    }
}

/// `extend`: see the [module table](self). The accepted value is the new end of the lease.
pub fn extend(
    now: Timestamp,
    existing: Option<&Record>,
    token: Token,
    lease: Duration,
) -> (Fenced<Timestamp>, Effect) {
    match live(now, existing) {
        Some(record) => match &record.state {
            RecordState::InFlight {
                token: held,
                acquired_at,
                ..
            } if *held == token && token != Token::NONE => {
                let lease_until = now.after(lease);
                let extended = Record {
                    expires_at: record.expires_at.max(lease_until),
                    state: RecordState::InFlight {
                        token,
                        acquired_at: *acquired_at,
                        lease_until,
                    },
                    ..record.clone()
                };
                (Fenced::Accepted(lease_until), Effect::Put(extended))
            }
            _ => (Fenced::LeaseLost, Effect::None),
        },
        None => (Fenced::LeaseLost, Effect::None),
    }
}
