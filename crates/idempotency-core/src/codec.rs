//! Decoding stored records, and the state's columns for writing them, for store authors.
//!
//! A store keeps a record as columns or hash fields; reading one back is the same job in every
//! store: check that the scope and key are still valid, that the fingerprint and token have the
//! right length, and that the state's fields agree with each other (a completed record has an
//! outcome and a completion time, an in-flight one an acquisition time and a lease). A store
//! maps its columns into [`RecordParts`] and nothing more; [`RecordParts::into_record`] and
//! [`RecordParts::into_summary`] do the checks, and every failure is one typed
//! [`DecodeError`], which converts into a [`StoreError`] of kind
//! [`ErrorKind::Corrupt`].
//!
//! ```
//! use idempotency_core::{Fingerprint, Outcome, RecordParts, RecordState, Token};
//!
//! let parts = RecordParts {
//!     scope: "tenant-7".into(),
//!     key: "order-1".into(),
//!     fingerprint: Fingerprint::of_bytes(b"pay 10"),
//!     attempt: 1,
//!     created_at: 1_700_000_000_000,
//!     expires_at: 1_700_086_400_000,
//!     completed: true,
//!     acquired_at: None,
//!     lease_until: None,
//!     completed_at: Some(1_700_000_000_250),
//! };
//! let record = parts.clone().into_record(Token::random(), Some(Outcome::new("charged")))?;
//! assert!(matches!(record.state, RecordState::Completed { .. }));
//! // A completed record without its outcome is damaged, and says so.
//! let error = parts.into_record(Token::random(), None).unwrap_err();
//! assert_eq!(error.to_string(), "a completed record without an outcome");
//! # Ok::<(), idempotency_core::DecodeError>(())
//! ```

use crate::{
    ErrorKind, Fingerprint, Key, KeyError, Outcome, Record, RecordState, RecordSummary, Scope, StoreError,
    SummaryState, Timestamp, Token,
};

/// The state-dependent columns of a record, as a row-shaped store writes them next to the
/// scope, key, fingerprint, attempt and times: the inverse of [`RecordParts::into_record`].
///
/// ```
/// use idempotency_core::{BeginRequest, Fingerprint, Key, Record, RecordColumns, Scope, Timestamp, machine};
///
/// let request = BeginRequest::new(Scope::global(), Key::new("k")?, Fingerprint::of_bytes(b""));
/// let (_, machine::Effect::Put(record)) = machine::begin(Timestamp::from_unix_millis(1_000), None, &request) else {
///     unreachable!("a new key is written")
/// };
/// let columns = RecordColumns::of(&record);
/// assert!(!columns.completed);
/// assert_eq!(columns.acquired_at, Some(1_000));
/// assert_eq!(columns.outcome, None);
/// # Ok::<(), idempotency_core::KeyError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordColumns<'a> {
    /// The token of the current (or completing) attempt.
    pub token: Token,
    /// Whether the record is completed.
    pub completed: bool,
    /// In flight: when the attempt acquired the record, in Unix milliseconds.
    pub acquired_at: Option<i64>,
    /// In flight: when the lease runs out, in Unix milliseconds.
    pub lease_until: Option<i64>,
    /// Completed: when it completed, in Unix milliseconds.
    pub completed_at: Option<i64>,
    /// Completed: the stored outcome.
    pub outcome: Option<&'a [u8]>,
}

impl<'a> RecordColumns<'a> {
    /// The columns of `record`'s state.
    #[must_use]
    pub fn of(record: &'a Record) -> Self {
        match &record.state {
            RecordState::InFlight {
                token,
                acquired_at,
                lease_until,
            } => Self {
                token: *token,
                completed: false,
                acquired_at: Some(acquired_at.unix_millis()),
                lease_until: Some(lease_until.unix_millis()),
                completed_at: None,
                outcome: None,
            },
            RecordState::Completed {
                token,
                outcome,
                completed_at,
            } => Self {
                token: *token,
                completed: true,
                acquired_at: None,
                lease_until: None,
                completed_at: Some(completed_at.unix_millis()),
                outcome: Some(outcome.as_bytes()),
            },
        }
    }
}

/// Why stored data is not a valid record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The stored scope or key is no longer a valid one.
    #[error("an invalid {field} ({source})")]
    Invalid {
        /// `scope` or `key`.
        field: &'static str,
        /// Why it is invalid.
        #[source]
        source: KeyError,
    },
    /// A binary field has the wrong length.
    #[error("a {field} of {found} bytes (expected {expected})")]
    Length {
        /// Which field.
        field: &'static str,
        /// The length it must have.
        expected: usize,
        /// The length it has.
        found: usize,
    },
    /// A field kept as hex text is not the expected number of hex digits.
    #[error("a {field} that is not {digits} hex digits")]
    Hex {
        /// Which field.
        field: &'static str,
        /// How many hex digits it must have.
        digits: usize,
    },
    /// The attempt number is negative or does not fit 32 bits.
    #[error("an attempt number out of range ({0})")]
    Attempt(i64),
    /// A field the record's state requires is missing.
    #[error("{state} record without {missing}")]
    Missing {
        /// `a completed` or `an in-flight`.
        state: &'static str,
        /// The missing field.
        missing: &'static str,
    },
    /// The stored state tag is none this version knows.
    #[error("an unknown state {0:?}")]
    UnknownState(String),
}

impl From<DecodeError> for StoreError {
    fn from(error: DecodeError) -> Self {
        Self::new(ErrorKind::Corrupt, format!("a stored record has {error}")).with_source(error)
    }
}

/// A record as a store keeps it, column by column; see the [module docs](self).
///
/// Times are Unix milliseconds, as the stores keep them. The fields of the other state are
/// ignored (an in-flight record's `completed_at` may be anything).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordParts {
    /// The scope, as stored.
    pub scope: String,
    /// The key, as stored.
    pub key: String,
    /// The fingerprint ([`Fingerprint::from_slice`] or [`Fingerprint::from_hex`] decodes it).
    pub fingerprint: Fingerprint,
    /// The attempt number.
    pub attempt: i64,
    /// When the record was created.
    pub created_at: i64,
    /// When the record expires.
    pub expires_at: i64,
    /// Whether the record is completed (else in flight).
    pub completed: bool,
    /// In flight: when the current attempt acquired the record.
    pub acquired_at: Option<i64>,
    /// In flight: when the lease runs out.
    pub lease_until: Option<i64>,
    /// Completed: when it completed.
    pub completed_at: Option<i64>,
}

impl RecordParts {
    /// The record, with the token of its current (or completing) attempt and, for a completed
    /// record, its outcome.
    ///
    /// # Errors
    ///
    /// A [`DecodeError`] naming what is wrong with the stored data.
    pub fn into_record(self, token: Token, outcome: Option<Outcome>) -> Result<Record, DecodeError> {
        let state = if self.completed {
            RecordState::Completed {
                token,
                outcome: outcome.ok_or(DecodeError::Missing {
                    state: COMPLETED,
                    missing: "an outcome",
                })?,
                completed_at: require(self.completed_at, COMPLETED, "completed_at")?,
            }
        } else {
            RecordState::InFlight {
                token,
                acquired_at: require(self.acquired_at, IN_FLIGHT, "acquired_at")?,
                lease_until: require(self.lease_until, IN_FLIGHT, "lease_until")?,
            }
        };
        let (scope, key, attempt) = self.identity()?;
        Ok(Record {
            scope,
            key,
            fingerprint: self.fingerprint,
            attempt,
            created_at: Timestamp::from_unix_millis(self.created_at),
            expires_at: Timestamp::from_unix_millis(self.expires_at),
            state,
        })
    }

    /// The summary of the record, for listings, with the stored outcome's length (`None` is
    /// read as 0).
    ///
    /// # Errors
    ///
    /// A [`DecodeError`] naming what is wrong with the stored data.
    pub fn into_summary(self, outcome_len: Option<i64>) -> Result<RecordSummary, DecodeError> {
        let state = if self.completed {
            SummaryState::Completed {
                completed_at: require(self.completed_at, COMPLETED, "completed_at")?,
                outcome_len: outcome_len.and_then(|len| usize::try_from(len).ok()).unwrap_or(0),
            }
        } else {
            SummaryState::InFlight {
                acquired_at: require(self.acquired_at, IN_FLIGHT, "acquired_at")?,
                lease_until: require(self.lease_until, IN_FLIGHT, "lease_until")?,
            }
        };
        let (scope, key, attempt) = self.identity()?;
        Ok(RecordSummary {
            scope,
            key,
            fingerprint: self.fingerprint,
            attempt,
            created_at: Timestamp::from_unix_millis(self.created_at),
            expires_at: Timestamp::from_unix_millis(self.expires_at),
            state,
        })
    }

    /// The scope, the key and the attempt number, checked.
    fn identity(&self) -> Result<(Scope, Key, u32), DecodeError> {
        Ok((scope(&self.scope)?, key(&self.key)?, attempt(self.attempt)?))
    }
}

const COMPLETED: &str = "a completed";
const IN_FLIGHT: &str = "an in-flight";

fn require(
    millis: Option<i64>,
    state: &'static str,
    missing: &'static str,
) -> Result<Timestamp, DecodeError> {
    millis
        .map(Timestamp::from_unix_millis)
        .ok_or(DecodeError::Missing { state, missing })
}

fn scope(text: &str) -> Result<Scope, DecodeError> {
    Scope::new(text).map_err(|source| DecodeError::Invalid {
        field: "scope",
        source,
    })
}

fn key(text: &str) -> Result<Key, DecodeError> {
    Key::new(text).map_err(|source| DecodeError::Invalid { field: "key", source })
}

fn attempt(n: i64) -> Result<u32, DecodeError> {
    u32::try_from(n).map_err(|_| DecodeError::Attempt(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn in_flight() -> RecordParts {
        RecordParts {
            scope: String::new(),
            key: "k".into(),
            fingerprint: Fingerprint::of_bytes(b"x"),
            attempt: 2,
            created_at: 1,
            expires_at: 100,
            completed: false,
            acquired_at: Some(5),
            lease_until: Some(50),
            completed_at: None,
        }
    }

    #[test]
    fn decodes_each_state_and_names_what_is_missing() {
        let token = Token::random();
        let record = in_flight().into_record(token, None).unwrap();
        assert_eq!(record.attempt, 2);
        assert_eq!(
            record.state,
            RecordState::InFlight {
                token,
                acquired_at: Timestamp::from_unix_millis(5),
                lease_until: Timestamp::from_unix_millis(50),
            }
        );
        let no_lease = RecordParts {
            lease_until: None,
            ..in_flight()
        };
        assert_eq!(
            no_lease.clone().into_record(token, None).unwrap_err().to_string(),
            "an in-flight record without lease_until"
        );
        assert!(no_lease.into_summary(None).is_err());
        let completed = RecordParts {
            completed: true,
            ..in_flight()
        };
        assert_eq!(
            completed.clone().into_summary(Some(3)).unwrap_err(),
            DecodeError::Missing {
                state: COMPLETED,
                missing: "completed_at"
            }
        );
        let done = RecordParts {
            completed_at: Some(9),
            ..completed
        };
        assert_eq!(
            done.into_summary(Some(3)).unwrap().state,
            SummaryState::Completed {
                completed_at: Timestamp::from_unix_millis(9),
                outcome_len: 3
            }
        );
    }

    #[test]
    fn rejects_invalid_fields_as_corrupt() {
        let token = Token::random();
        let bad_key = RecordParts {
            key: "two words".into(),
            ..in_flight()
        };
        let error = StoreError::from(bad_key.into_record(token, None).unwrap_err());
        assert_eq!(error.kind(), ErrorKind::Corrupt);
        assert!(error.to_string().contains("an invalid key"), "{error}");
        let negative = RecordParts {
            attempt: -1,
            ..in_flight()
        };
        assert_eq!(
            negative.into_record(token, None).unwrap_err(),
            DecodeError::Attempt(-1)
        );
        assert_eq!(
            Token::from_slice(&[0; 15]).unwrap_err().to_string(),
            "a token of 15 bytes (expected 16)"
        );
        assert!(Fingerprint::from_hex(&"g".repeat(64)).is_err());
    }
}
