//! The single-key actions operators take after an incident: `idem keys release`, `forget` and
//! `complete`. Each reads the key's record, says what it is about to change, asks for a
//! confirmation (`--yes`, or `y` on a terminal), changes it through the store's fenced
//! operations only, prints what changed and writes one audit line (target `idem::audit`, at
//! warn level so that it shows by default; the key truncated past 16 bytes, as log lines show
//! keys).
//!
//! Every change is fenced by the token the record held when it was read: when the record
//! changed in between (the running attempt completed, another attempt took over, the record
//! expired), nothing is changed and the command says so.
//!
//! | action | changes | refused when |
//! | --- | --- | --- |
//! | `release` | the running attempt's lease ends now; its `complete` gets `LeaseLost`, the next retry runs as attempt n + 1 | no record, completed, or no attempt holds it |
//! | `forget` | the record is deleted; the next request runs as a new first attempt | no record; in flight with a live lease, unless `--force` |
//! | `complete` | the outcome given is recorded as a new attempt's (the record's fingerprint kept): retries replay it | no record (the fingerprint is unknown); completed; in flight with a live lease, unless `--force` |

use std::fmt::Write as _;
use std::time::Duration;

use idempotency::{
    BeginRequest, Claim, DynStore, Fenced, Held, Key, KeyLog, Outcome, Record, RecordState, Scope, Timestamp,
    Token,
};
use serde_json::json;

use super::{Confirm, confirmed};
use crate::error::Error;

/// What `idem keys release|forget|complete` does to the record.
#[derive(Debug, Clone)]
pub enum KeyAction {
    /// End the running attempt's lease now.
    Release,
    /// Delete the record; `force` allows it while an attempt runs.
    Forget {
        /// Forget an in-flight record whose lease is live.
        force: bool,
    },
    /// Record `outcome` as a new attempt's; `force` takes over a live lease first.
    Complete {
        /// What retries replay (the gateway's stored response: see
        /// `idempotency_http::StoredOutcome`).
        outcome: Outcome,
        /// How long the outcome is kept.
        retention: Duration,
        /// Take over an in-flight record whose lease is live.
        force: bool,
    },
}

impl KeyAction {
    fn name(&self) -> &'static str {
        match self {
            Self::Release => "release",
            Self::Forget { .. } => "forget",
            Self::Complete { .. } => "complete",
        }
    }
}

/// The lease a takeover by `idem keys complete` holds while it records the outcome.
const TAKEOVER_LEASE: Duration = Duration::from_secs(30);

/// Runs `action` on the record of `scope` and `key`; what changed, as a line of text or JSON.
///
/// # Errors
///
/// [`Error::NoRecord`]; [`Error::Refused`] when the record is not in a state the action applies
/// to, when the confirmation was not given, or when the record changed while the action ran
/// (nothing changed then); the store's errors (a read-only role is refused by the server).
pub async fn act(
    store: &DynStore,
    scope: &Scope,
    key: &Key,
    action: &KeyAction,
    confirm: Confirm,
    json: bool,
) -> Result<String, Error> {
    let record = store.get(scope, key).await?.ok_or_else(|| Error::NoRecord {
        key: key.as_str().into(),
        scope: scope.as_str().into(),
    })?;
    let now = store.now().await?;
    let state = State::of(&record, now);
    let refuse = |why: String| Error::Refused {
        action: action.name(),
        key: key.as_str().into(),
        why,
    };
    let question = match (action, state) {
        (KeyAction::Release, State::Running) => format!(
            "End the lease of attempt {} of key {key} (scope {:?}) now? Its completion will be refused and the next retry runs as attempt {}.",
            record.attempt,
            scope.as_str(),
            record.attempt + 1
        ),
        (KeyAction::Release, other) => {
            return Err(refuse(format!("it is {}: no attempt holds it", other.text())));
        }
        (KeyAction::Forget { force: false } | KeyAction::Complete { force: false, .. }, State::Running) => {
            return Err(refuse(format!(
                "attempt {} is running (its lease ends at {}); pass --force to {} it anyway, or `idem keys release` it first",
                record.attempt,
                crate::ops::rfc3339(lease_end(&record)),
                action.name()
            )));
        }
        (KeyAction::Complete { .. }, State::Completed) => {
            return Err(refuse(
                "it is completed; `idem keys forget` it first to record another outcome".into(),
            ));
        }
        (KeyAction::Forget { .. }, state) => format!(
            "Delete the record of key {key} (scope {:?}, {}, attempt {})? The next request with this key runs as a new first attempt.",
            scope.as_str(),
            state.text(),
            record.attempt
        ),
        (KeyAction::Complete { outcome, .. }, state) => format!(
            "Record an outcome of {} bytes for key {key} (scope {:?}, {}) as attempt {}? Retries replay it.",
            outcome.len(),
            scope.as_str(),
            state.text(),
            record.attempt + 1
        ),
    };
    confirmed(confirm, &question)?;

    let changed = match action {
        KeyAction::Release => {
            let held = held(&record, record.token());
            match store.release(&held).await? {
                Fenced::Accepted(()) => format!(
                    "released key {key}: attempt {}'s lease ended; the next retry runs as attempt {}",
                    record.attempt,
                    record.attempt + 1
                ),
                Fenced::LeaseLost => return Err(refuse(changed_meanwhile())),
            }
        }
        KeyAction::Forget { .. } => match store.forget(scope, key, record.token()).await? {
            Fenced::Accepted(()) => {
                format!("forgot key {key}: the next request with it runs as a new first attempt")
            }
            Fenced::LeaseLost => return Err(refuse(changed_meanwhile())),
        },
        KeyAction::Complete {
            outcome, retention, ..
        } => {
            if state == State::Running
                && store
                    .release(&held(&record, record.token()))
                    .await?
                    .is_lease_lost()
            {
                return Err(refuse(changed_meanwhile()));
            }
            let request =
                BeginRequest::new(scope.clone(), key.clone(), record.fingerprint).lease(TAKEOVER_LEASE);
            let held = match store.begin(&request).await? {
                Claim::Acquired(held) => held,
                _ => return Err(refuse(changed_meanwhile())),
            };
            match store.complete(&held, outcome.clone(), *retention).await? {
                Fenced::Accepted(expires_at) => format!(
                    "completed key {key} as attempt {}: retries replay the outcome given until {}",
                    held.attempt,
                    crate::ops::rfc3339(expires_at)
                ),
                Fenced::LeaseLost => return Err(refuse(changed_meanwhile())),
            }
        }
    };
    // The key only in its logged form (truncated): what was printed names it whole.
    tracing::warn!(
        target: "idem::audit",
        action = action.name(),
        scope = scope.as_str(),
        key = %key.logged(KeyLog::Plain),
        attempt = record.attempt,
        was = state.text(),
        "an operator changed a key's record"
    );
    Ok(if json {
        let mut out = json!({
            "action": action.name(),
            "scope": scope.as_str(),
            "key": key.as_str(),
            "attempt": record.attempt,
            "was": state.text(),
            "changed": changed,
        })
        .to_string();
        out.push('\n');
        out
    } else {
        let mut out = String::new();
        let _ = writeln!(out, "{changed}");
        out
    })
}

/// What the record was when the action read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// An attempt holds it and its lease is live.
    Running,
    /// In flight, but released or its lease ended: the next retry takes it over.
    Ended,
    /// Completed.
    Completed,
}

impl State {
    fn of(record: &Record, now: Timestamp) -> Self {
        match &record.state {
            RecordState::Completed { .. } => Self::Completed,
            RecordState::InFlight {
                token, lease_until, ..
            } if *token != Token::NONE && *lease_until > now => Self::Running,
            RecordState::InFlight { .. } => Self::Ended,
        }
    }

    fn text(self) -> &'static str {
        match self {
            Self::Running => "in flight",
            Self::Ended => "in flight with its lease ended",
            Self::Completed => "completed",
        }
    }
}

fn lease_end(record: &Record) -> Timestamp {
    match &record.state {
        RecordState::InFlight { lease_until, .. } => *lease_until,
        RecordState::Completed { completed_at, .. } => *completed_at,
    }
}

fn held(record: &Record, token: Token) -> Held {
    Held {
        scope: record.scope.clone(),
        key: record.key.clone(),
        token,
        attempt: record.attempt,
        recovered: false,
        lease_until: lease_end(record),
    }
}

fn changed_meanwhile() -> String {
    "the record changed while the command ran (completed, taken over or expired); nothing was changed: look at it again with `idem keys get`".into()
}
