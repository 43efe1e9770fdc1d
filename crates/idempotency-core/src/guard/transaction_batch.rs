//! Same-transaction mode in batches: one database transaction for a batch of operations, a
//! savepoint for each, one commit.
//!
//! [`Guard::claim_many_in_transaction`] opens the transaction and claims every key in it with
//! one [`TransactionalStore::begin_many_in`]; [`TransactionBatch::run`] runs each claimed
//! operation after a [savepoint](TransactionalStore::savepoint); [`TransactionBatch::commit`]
//! records the outcomes with one [`TransactionalStore::complete_many_in`] and commits once.
//!
//! Each operation keeps the answers of [`Guard::run_in_transaction`], with one difference:
//!
//! | the operation's value, by the policy | what happens | `recorded` |
//! |---|---|---|
//! | `Complete(outcome)` | completion written in the transaction, committed with the batch | `Completed` |
//! | `Release` or `Unknown` | rolled back to its savepoint (its rows undone), its claim withdrawn in the transaction; answered at once | `Released` |
//! | — (a completion, a release or the commit fails) | the whole batch rolls back, or commits with an unknown fate | `Failed` |
//!
//! A released operation's key is claimable again at once. Its claim was made before its
//! savepoint, so it is [withdrawn](TransactionalStore::withdraw_in) at the commit: a new key's
//! record is removed, as [`Guard::run_in_transaction`]'s rollback leaves it; a record taken
//! over is released, so its next attempt is numbered one higher than after that rollback. A
//! claim whose operation never ran ([`TransactionBatch::skip`]) is withdrawn the same way. A panic or a
//! dropped batch rolls the whole transaction back: nothing of it is committed, and every
//! message of it is delivered again.
//!
//! Savepoints nest on PostgreSQL: keep a batch to 64 operations, the subtransactions a backend
//! tracks in memory (more slow down every other session's snapshots until the commit).

use super::{Decision, Execution, Guard, Op, OutcomePolicy, Recorded, later};
use crate::{
    BeginRequest, Claimed, ClaimedRun, Completion, ErrorKind, Fenced, Fingerprint, Key, Outcome, Scope,
    StoreError, TransactionalStore, TxOperation,
};

/// A batch of operations in one transaction of the store, opened by
/// [`Guard::claim_many_in_transaction`]: a savepoint before each operation
/// ([`TransactionBatch::run`]), so that one its policy releases rolls back alone (its claim
/// withdrawn: a new key leaves no record), and one commit ([`TransactionBatch::commit`]) for
/// the others, whose outcomes are recorded in one statement. Nothing of the batch is committed
/// if any of that fails. Savepoints nest on PostgreSQL: keep a batch to 64 operations.
/// Dropped without [`TransactionBatch::commit`], it rolls back (the transaction's drop does).
#[must_use = "a batch commits nothing until it is committed"]
pub struct TransactionBatch<'g, S: TransactionalStore, T> {
    guard: &'g Guard<S>,
    tx: S::Transaction,
    /// The runs whose outcome is to be recorded, in the order they ran, with their values.
    ran: Vec<(ClaimedRun, T, Outcome)>,
    /// Claims to withdraw at the commit: rolled back to their savepoints, or never run.
    released: Vec<ClaimedRun>,
}

impl<S: TransactionalStore, T> std::fmt::Debug for TransactionBatch<'_, S, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransactionBatch")
            .field("ran", &self.ran.len())
            .field("released", &self.released.len())
            .finish_non_exhaustive()
    }
}

impl<S: TransactionalStore> Guard<S> {
    /// Opens a transaction and claims every `(scope, key, fingerprint)` of `items` in it with
    /// one [`TransactionalStore::begin_many_in`]: the batch, and one answer per item in order,
    /// as [`Guard::claim_many`] answers (the claims hold their row locks until the batch ends,
    /// and cannot expire meanwhile: they are not committed).
    ///
    /// # Errors
    ///
    /// When the transaction cannot be opened.
    pub async fn claim_many_in_transaction<T>(
        &self,
        items: Vec<(Scope, Key, Fingerprint)>,
    ) -> Result<(TransactionBatch<'_, S, T>, Vec<Result<Claimed<T>, StoreError>>), StoreError> {
        let requests: Vec<BeginRequest> = items
            .into_iter()
            .map(|(scope, key, fingerprint)| self.request(scope, key, fingerprint))
            .collect();
        let mut tx = self
            .timed(Op::BeginTransaction, self.store.begin_transaction())
            .await?;
        let sent = tokio::time::Instant::now();
        let answers = if requests.is_empty() {
            Vec::new()
        } else {
            self.timed_many(Op::BeginMany, self.store.begin_many_in(&mut tx, &requests))
                .await
        };
        let claims = answers
            .into_iter()
            .map(|answer| {
                answer.map(|claim| match self.acquired(claim, &tracing::Span::none()) {
                    Ok(held) => Claimed::Run(ClaimedRun::new(held, later(sent, self.lease))),
                    Err(answer) => Claimed::Answer(answer),
                })
            })
            .collect();
        let batch = TransactionBatch {
            guard: self,
            tx,
            ran: Vec::new(),
            released: Vec::new(),
        };
        Ok((batch, claims))
    }
}

impl<S: TransactionalStore, T> TransactionBatch<'_, S, T> {
    /// Runs `operation` as `run`'s attempt after a savepoint. When `policy` completes its
    /// value, the outcome is recorded at [`TransactionBatch::commit`], which answers it
    /// (`Ok(None)`). Otherwise its writes are rolled back to the savepoint and its claim is
    /// withdrawn with the commit: it is answered now, [`Recorded::Released`] (`Ok(Some(_))`),
    /// and the batch goes on.
    ///
    /// # Errors
    ///
    /// When the savepoint cannot be set or returned to: the transaction is then unusable, and
    /// the caller rolls the batch back ([`TransactionBatch::rollback`]).
    pub async fn run<O, P>(
        &mut self,
        run: ClaimedRun,
        operation: O,
        policy: &P,
    ) -> Result<Option<Execution<T>>, StoreError>
    where
        O: TxOperation<S, Value = T>,
        P: OutcomePolicy<T>,
    {
        let guard = self.guard;
        if let Err(error) = guard
            .timed(Op::Savepoint, guard.store.savepoint(&mut self.tx))
            .await
        {
            self.released.push(run);
            return Err(error);
        }
        // A panic unwinds through here and drops the batch, which rolls the transaction back.
        let value = operation.run(&mut self.tx, run.attempt().clone()).await;
        match policy.decide(&value) {
            Decision::Complete(outcome) => {
                self.ran.push((run, value, outcome));
                Ok(None)
            }
            Decision::Release | Decision::Unknown => {
                let rolled_back = guard
                    .timed(Op::Savepoint, guard.store.rollback_to_savepoint(&mut self.tx))
                    .await;
                let execution = guard.executed(value, run.held(), Recorded::Released, &tracing::Span::none());
                self.released.push(run);
                rolled_back.map(|()| Some(execution))
            }
        }
    }

    /// Notes a claim whose operation is not to run (the batch ends before its turn): its claim
    /// is withdrawn at the commit, and its key claimable again at once.
    pub fn skip(&mut self, run: ClaimedRun) {
        self.released.push(run);
    }

    /// Withdraws the claims of the operations rolled back to their savepoints and of those
    /// skipped, records the other runs' outcomes with one
    /// [`TransactionalStore::complete_many_in`], and commits: the [`Execution`] of each run
    /// whose outcome was to be recorded, in the order they ran. If any of that fails, the
    /// transaction is rolled back (or its commit's fate is unknown), and each of them answers
    /// [`Recorded::Failed`]: nothing of it is known to be committed, and its message is to be
    /// delivered again.
    pub async fn commit(self) -> Vec<Execution<T>> {
        let Self {
            guard,
            mut tx,
            ran,
            released,
        } = self;
        let store = &guard.store;
        let mut failed: Option<StoreError> = None;
        for run in &released {
            run.finish();
            if failed.is_none()
                && let Err(error) = guard
                    .timed(Op::Release, store.withdraw_in(&mut tx, run.held()))
                    .await
            {
                failed = Some(error);
            }
        }
        let completions: Vec<Completion> = ran
            .iter()
            .map(|(run, _, outcome)| Completion::new(run.held().clone(), outcome.clone(), guard.retention))
            .collect();
        let mut expiries = Vec::with_capacity(completions.len());
        if failed.is_none() && !completions.is_empty() {
            let answers = guard
                .timed_many(Op::CompleteMany, store.complete_many_in(&mut tx, &completions))
                .await;
            for answer in answers {
                match answer {
                    Ok(Fenced::Accepted(expires_at)) => expiries.push(expires_at),
                    // Unreachable while the claim's row lock is held; refuse to commit rather
                    // than guess.
                    Ok(Fenced::LeaseLost) => {
                        failed = Some(StoreError::new(
                            ErrorKind::Protocol,
                            "a record claimed in this transaction was not there to complete",
                        ));
                        break;
                    }
                    Err(error) => {
                        failed = Some(error);
                        break;
                    }
                }
            }
        }
        if failed.is_none() && expiries.len() != completions.len() {
            failed = Some(StoreError::new(
                ErrorKind::Protocol,
                "the store answered fewer completions than it was asked for",
            ));
        }
        let failed = match failed {
            Some(error) => {
                tracing::error!(guard = &*guard.name, %error, "could not record a batch's outcomes; rolling its transaction back");
                store.rollback(tx).await;
                Some(error)
            }
            None => match guard.timed(Op::Commit, store.commit(tx)).await {
                Ok(()) => None,
                Err(error) => {
                    tracing::error!(guard = &*guard.name, %error, "a batch's commit failed; its fate is unknown, a redelivery replays what committed");
                    Some(error)
                }
            },
        };
        let mut expiries = expiries.into_iter();
        ran.into_iter()
            .map(|(run, value, _)| {
                run.finish();
                let held = run.held();
                let recorded = match (&failed, expiries.next()) {
                    (None, Some(expires_at)) => {
                        guard.waiters.wake(&held.scope, &held.key);
                        Recorded::Completed { expires_at }
                    }
                    (Some(error), _) => Recorded::Failed(error.clone()),
                    (None, None) => unreachable!("an expiry per completion when nothing failed"),
                };
                guard.executed(value, held, recorded, &tracing::Span::none())
            })
            .collect()
    }

    /// Rolls the whole batch back: nothing of it is committed; every key it claimed is as it
    /// was before the batch.
    pub async fn rollback(self) {
        for run in self.ran.iter().map(|(run, _, _)| run).chain(&self.released) {
            run.finish();
        }
        self.guard.store.rollback(self.tx).await;
    }
}
