//! [`TxConsumer`]'s batch path ([`Processor::process_many`]):
//! a batch's messages in one database transaction, each handler after a savepoint, one commit,
//! then the dispositions (so every ack follows the commit; see
//! [`idempotency_core::TransactionBatch`]).
//!
//! Each message keeps the answers of [`Processor::process`]:
//!
//! - a message without a usable key is dead-lettered at its turn;
//! - a duplicate is acked, a reused key with another payload dead-lettered;
//! - a handler that fails (or panics) has its writes rolled back to its savepoint and its key
//!   released, and is settled as a single failed message is: nacked, which ends the batch
//!   (what ran before it commits), or dead-lettered, and the batch goes on;
//! - a message whose key is in flight (held by another consumer, or by an earlier message of
//!   this batch) is decided alone once the transaction committed, and so is everything after it;
//! - a store that fails ends the batch: what it had not committed is delivered again.
//!
//! A transaction holds at most [`MOST_PER_TRANSACTION`] messages; a longer batch takes
//! several, one after another.

use std::time::Instant;

use idempotency_core::{Claimed, ErrorKind, Execution, Key, Outcome, StoreError, TransactionalStore};

use crate::transactional::Handle;
use crate::{
    Decisions, Delivery, Disposition, HandlerError, Processor, TxConsumer, TxHandler, complete_on_success,
};

/// The most messages one transaction of a batch holds: each runs after a savepoint, and a
/// PostgreSQL backend tracks 64 subtransactions in memory (more slow down every other
/// session's snapshots until the commit).
pub const MOST_PER_TRANSACTION: usize = 64;

/// See the [module docs](self).
pub(crate) async fn process_many<S, H, M>(consumer: &TxConsumer<S, H>, messages: &[&M], sink: &Decisions)
where
    S: TransactionalStore,
    H: TxHandler<M, S>,
    M: Delivery + Sync,
{
    let mut start = 0;
    while start < messages.len() && !sink.is_closed() {
        let end = messages.len().min(start + MOST_PER_TRANSACTION);
        match in_one_transaction(consumer, &messages[start..end], sink).await {
            Some(decided) => start += decided,
            None => return,
        }
    }
}

/// What a message of the transaction comes to once it commits.
enum Slot {
    /// Decided without writing (no key, a duplicate, a mismatch, a store failure).
    Decided(Disposition),
    /// Its handler ran in the transaction: settled from its execution.
    Ran(Key),
    /// Its key was in flight: decided alone after the commit.
    Alone,
}

/// Runs `messages` in one transaction and hands their dispositions over: how many were handed
/// (at least one), or `None` when the batch ends (a nack was handed, or the sink closed).
async fn in_one_transaction<S, H, M>(
    consumer: &TxConsumer<S, H>,
    messages: &[&M],
    sink: &Decisions,
) -> Option<usize>
where
    S: TransactionalStore,
    H: TxHandler<M, S>,
    M: Delivery + Sync,
{
    let started = Instant::now();
    let inner = &consumer.inner;
    let rules = &inner.rules;
    let (keys, items) = crate::batch::keys_of(rules, messages);
    let (mut batch, claims) = match inner
        .guard
        .claim_many_in_transaction::<Result<Outcome, HandlerError>>(items)
        .await
    {
        Ok(opened) => opened,
        Err(_) => {
            // No transaction: the first message alone says what the store answers.
            return hand_over(sink, [consumer.process(messages[0]).await]);
        }
    };
    let mut claimed = crate::batch::by_message(&keys, claims);
    let mut slots: Vec<Slot> = Vec::with_capacity(messages.len());
    for (index, message) in messages.iter().enumerate() {
        if sink.is_closed() {
            break;
        }
        let message: &M = message;
        let Some(key) = &keys[index] else {
            if let Err(dead) = rules.key(message) {
                slots.push(Slot::Decided(dead));
                continue;
            }
            // The key function answers differently now: the message is tried again.
            let retry = rules.store_unavailable(&"the message's key changed", message.delivery_count());
            slots.push(Slot::Decided(retry));
            break;
        };
        let claim = claimed[index].take().unwrap_or_else(|| {
            Err(StoreError::new(
                ErrorKind::Protocol,
                "the store answered fewer claims than it was asked for",
            ))
        });
        match claim {
            Err(error) => {
                slots.push(Slot::Decided(rules.settle::<Outcome>(
                    Err(error),
                    key,
                    message,
                    started,
                )));
                break;
            }
            Ok(Claimed::Answer(Execution::InFlight { .. })) => {
                slots.push(Slot::Alone);
                break;
            }
            Ok(Claimed::Answer(answer)) => {
                slots.push(Slot::Decided(rules.settle(Ok(answer), key, message, started)));
            }
            Ok(Claimed::Run(run)) => {
                let handle = Handle {
                    handler: &inner.handler,
                    message,
                };
                match batch.run(run, handle, &complete_on_success).await {
                    Ok(None) => slots.push(Slot::Ran(key.clone())),
                    Ok(Some(released)) => {
                        // Its writes are rolled back and its key released: settled now. A
                        // nack ends the batch (what ran before it commits); a dead letter
                        // does not.
                        let disposition = rules.settle(Ok(released), key, message, started);
                        let ends = sink.ends(&disposition);
                        slots.push(Slot::Decided(disposition));
                        if ends {
                            break;
                        }
                    }
                    Err(error) => {
                        // The transaction is lost, and with it every write of this batch:
                        // the messages that ran are delivered again.
                        for claim in claimed.into_iter().flatten() {
                            if let Ok(Claimed::Run(run)) = claim {
                                batch.skip(run);
                            }
                        }
                        batch.rollback().await;
                        let nack = rules.settle::<Outcome>(Err(error), key, message, started);
                        let mut dispositions: Vec<Disposition> = slots
                            .into_iter()
                            .map(|slot| match slot {
                                Slot::Decided(disposition) => disposition,
                                Slot::Ran(_) | Slot::Alone => nack.clone(),
                            })
                            .collect();
                        dispositions.push(nack);
                        return hand_over(sink, dispositions);
                    }
                }
            }
        }
    }
    // Claimed after the end of the transaction's run, never run: released at its commit.
    for claim in claimed.into_iter().flatten() {
        if let Ok(Claimed::Run(run)) = claim {
            batch.skip(run);
        }
    }
    let mut executions = batch.commit().await.into_iter();
    let mut dispositions = Vec::with_capacity(slots.len());
    for (slot, message) in slots.into_iter().zip(messages) {
        let message: &M = message;
        let disposition = match slot {
            Slot::Decided(disposition) => disposition,
            Slot::Ran(key) => {
                let execution = executions.next().ok_or_else(|| {
                    StoreError::new(ErrorKind::Protocol, "a batch answered fewer runs than ran")
                });
                rules.settle(execution, &key, message, started)
            }
            Slot::Alone => consumer.process(message).await,
        };
        dispositions.push(disposition);
    }
    if dispositions.is_empty() {
        // Closed before the first message: nothing was decided.
        return None;
    }
    hand_over(sink, dispositions)
}

/// Hands `dispositions` over in order up to and including the first nack of an ordered
/// batch: how many were handed, or `None` when a nack ended the batch.
fn hand_over(sink: &Decisions, dispositions: impl IntoIterator<Item = Disposition>) -> Option<usize> {
    let mut handed = 0;
    for disposition in dispositions {
        let ends = sink.ends(&disposition);
        sink.send(disposition);
        handed += 1;
        if ends {
            return None;
        }
    }
    Some(handed)
}
