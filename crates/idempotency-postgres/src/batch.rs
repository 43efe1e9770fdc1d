//! `begin_many` and `complete_many` in one statement each.
//!
//! A batch's keys travel as arrays (`unnest`), so a batch of new keys costs one round trip and
//! one commit however long it is, where the single calls cost two statements per key. The
//! statement decides what it can decide without a row lock: it inserts the keys that have no
//! record and returns the records of the others unwritten, exactly as [`begin_on`]'s two
//! statements do for one key. Whatever needs more (an expired record, a lease that ran out, a
//! record a concurrent transaction committed after the statement's snapshot, the same key a
//! second time in the batch) then runs alone through [`begin_on`] on the same connection, so
//! every key gets the answer the single call would give.
//!
//! The keys are sent in [`lock_order`], and the insertion follows that order, so two batches
//! that insert the same new keys take their index locks in the same order and do not deadlock.
//! `complete_many`'s update joins the arrays to the table; should two batches complete the same
//! keys at once (only after a takeover), a deadlock the server detects fails one of them with
//! a retryable error, as a single `complete` fails.

use std::sync::Arc;

use idempotency_core::machine::{self, Effect};
use idempotency_core::{
    BeginRequest, Claim, Completion, ErrorKind, Fenced, Held, RecordState, StoreError, Timestamp, Token,
    failed_batch, lock_order, stored_millis,
};
use sqlx::postgres::{PgConnection, PgRow};
use sqlx::{AssertSqlSafe, Row};

use crate::error::map_error;
use crate::sql::Statements;
use crate::store::{begin_on, complete_on};

/// The positions of `batch` in lock order, and of those the first call on each key (the
/// calls that repeat a key run alone, after the statement).
fn firsts_in_lock_order<T: idempotency_core::BatchCall>(batch: &[T]) -> (Vec<usize>, Vec<usize>) {
    let order = lock_order(batch);
    let mut firsts: Vec<usize> = Vec::with_capacity(batch.len());
    for &at in &order {
        if firsts
            .last()
            .is_none_or(|&previous| batch[previous].record_key() != batch[at].record_key())
        {
            firsts.push(at);
        }
    }
    (order, firsts)
}

/// The answers of a batch once every call has one.
fn answered<R>(answers: Vec<Option<Result<R, StoreError>>>) -> Vec<Result<R, StoreError>> {
    answers
        .into_iter()
        .map(|answer| answer.unwrap_or_else(|| unreachable!("every call of the batch was answered")))
        .collect()
}

/// The position in the statement's arrays (`WITH ORDINALITY`, from 1) a row answers.
fn ordinal(row: &PgRow, what: &str) -> Result<usize, StoreError> {
    let ord: i64 = row.try_get(0).map_err(|e| map_error(what, e))?;
    usize::try_from(ord - 1)
        .map_err(|_| StoreError::new(ErrorKind::Protocol, format!("{what}: position {ord}")))
}

/// `begin` for every request of `requests` on `connection`: one statement for the batch, then
/// [`begin_on`] alone for the keys it could not decide.
pub(crate) async fn begin_batch(
    connection: &mut PgConnection,
    sql: &Statements,
    requests: &[BeginRequest],
) -> Vec<Result<Claim, StoreError>> {
    let (order, firsts) = firsts_in_lock_order(requests);
    let mut answers: Vec<Option<Result<Claim, StoreError>>> =
        std::iter::repeat_with(|| None).take(requests.len()).collect();
    let sent: Vec<&BeginRequest> = firsts.iter().map(|&at| &requests[at]).collect();
    let rows = sqlx::query(AssertSqlSafe(Arc::clone(&sql.begin_many)))
        .bind(sent.iter().map(|r| r.scope.as_str()).collect::<Vec<_>>())
        .bind(sent.iter().map(|r| r.key.as_str()).collect::<Vec<_>>())
        .bind(
            sent.iter()
                .map(|r| r.fingerprint.as_bytes().to_vec())
                .collect::<Vec<_>>(),
        )
        .bind(
            sent.iter()
                .map(|r| r.token.to_bytes().to_vec())
                .collect::<Vec<_>>(),
        )
        .bind(sent.iter().map(|r| stored_millis(r.lease)).collect::<Vec<_>>())
        .bind(
            sent.iter()
                .map(|r| stored_millis(r.retention))
                .collect::<Vec<_>>(),
        )
        .fetch_all(&mut *connection)
        .await;
    let rows = match rows {
        Ok(rows) => rows,
        Err(error) => return failed_batch(&map_error("begin a batch", error), requests.len()),
    };
    for row in &rows {
        let decided = decide_begin(row, &sent);
        match decided {
            Ok((i, Some(claim))) => answers[firsts[i]] = Some(Ok(claim)),
            Ok((_, None)) => {}
            Err(error) => return failed_batch(&error, requests.len()),
        }
    }
    // What the statement left open (and every repeated key) runs alone, in lock order.
    for at in order {
        if answers[at].is_none() {
            answers[at] = Some(begin_on(connection, sql, &requests[at]).await);
        }
    }
    answered(answers)
}

/// One row of the batch `begin`: the position it answers and, when the statement decided it,
/// the claim. `None` when the key needs the claiming upsert (expired, or a takeover).
fn decide_begin(row: &PgRow, sent: &[&BeginRequest]) -> Result<(usize, Option<Claim>), StoreError> {
    let i = ordinal(row, "decode a batch begin")?;
    let request = sent.get(i).ok_or_else(|| {
        StoreError::new(
            ErrorKind::Protocol,
            "a batch begin answered a key it was not sent",
        )
    })?;
    let claimed: bool = row.try_get(1).map_err(|e| map_error("decode a batch begin", e))?;
    let record = idempotency_core::sql::record(row, 2)?;
    if claimed {
        let RecordState::InFlight { lease_until, .. } = record.state else {
            return Err(StoreError::new(
                ErrorKind::Protocol,
                "a claimed record is not in flight",
            ));
        };
        return Ok((
            i,
            Some(Claim::Acquired(Held::acquired(
                request,
                record.attempt,
                lease_until,
            ))),
        ));
    }
    let now = Timestamp::from_unix_millis(
        row.try_get(14)
            .map_err(|e| map_error("decode a batch begin", e))?,
    );
    let (claim, effect) = machine::begin(now, Some(&record), request);
    Ok((i, (effect == Effect::None).then_some(claim)))
}

/// `complete` for every completion of `completions` on `connection`: one statement for the
/// batch, then [`complete_on`] alone for a key completed twice in the batch.
pub(crate) async fn complete_batch(
    connection: &mut PgConnection,
    sql: &Statements,
    completions: &[Completion],
) -> Vec<Result<Fenced<Timestamp>, StoreError>> {
    let (order, firsts) = firsts_in_lock_order(completions);
    let mut answers: Vec<Option<Result<Fenced<Timestamp>, StoreError>>> =
        std::iter::repeat_with(|| None).take(completions.len()).collect();
    // A completion by no attempt's token is fenced without asking the server, as `complete`.
    let sent: Vec<usize> = firsts
        .into_iter()
        .filter(|&at| {
            let lost = completions[at].held.token == Token::NONE;
            if lost {
                answers[at] = Some(Ok(Fenced::LeaseLost));
            }
            !lost
        })
        .collect();
    if !sent.is_empty() {
        let calls: Vec<&Completion> = sent.iter().map(|&at| &completions[at]).collect();
        let rows = sqlx::query(AssertSqlSafe(Arc::clone(&sql.complete_many)))
            .bind(calls.iter().map(|c| c.held.scope.as_str()).collect::<Vec<_>>())
            .bind(calls.iter().map(|c| c.held.key.as_str()).collect::<Vec<_>>())
            .bind(
                calls
                    .iter()
                    .map(|c| c.held.token.to_bytes().to_vec())
                    .collect::<Vec<_>>(),
            )
            .bind(
                calls
                    .iter()
                    .map(|c| c.outcome.as_bytes().to_vec())
                    .collect::<Vec<_>>(),
            )
            .bind(
                calls
                    .iter()
                    .map(|c| stored_millis(c.retention))
                    .collect::<Vec<_>>(),
            )
            .fetch_all(&mut *connection)
            .await;
        let rows = match rows {
            Ok(rows) => rows,
            Err(error) => return failed_batch(&map_error("complete a batch", error), completions.len()),
        };
        for row in &rows {
            let decoded = ordinal(row, "decode a batch complete").and_then(|i| {
                let ms: i64 = row
                    .try_get(1)
                    .map_err(|e| map_error("decode a batch complete", e))?;
                Ok((i, ms))
            });
            match decoded {
                Ok((i, ms)) if i < sent.len() => {
                    answers[sent[i]] = Some(Ok(Fenced::Accepted(Timestamp::from_unix_millis(ms))));
                }
                Ok(_) => {
                    let error = StoreError::new(
                        ErrorKind::Protocol,
                        "a batch complete answered a key it was not sent",
                    );
                    return failed_batch(&error, completions.len());
                }
                Err(error) => return failed_batch(&error, completions.len()),
            }
        }
        // Sent and not answered: the token no longer holds the record.
        for at in sent {
            answers[at].get_or_insert(Ok(Fenced::LeaseLost));
        }
    }
    // A key completed twice in the batch: the repeats, alone.
    for at in order {
        if answers[at].is_none() {
            let c = &completions[at];
            answers[at] = Some(complete_on(connection, sql, &c.held, &c.outcome, c.retention).await);
        }
    }
    answered(answers)
}
