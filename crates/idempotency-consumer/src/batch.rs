//! [`Consumer`]'s batch path ([`Processor::process_many`](crate::Processor::process_many)):
//! the keys of a batch claimed in one store round trip, the handlers run one after another in
//! the batch's order (an ordered batch; an unordered one runs them all at once) while the
//! guard keeps every claimed lease alive, and the outcomes
//! recorded together before their dispositions are handed over (so before any ack): at the end
//! of the batch, or as soon as a handler runs longer than the consumer's
//! [linger](crate::Consumer::linger), so that a slow handler does not hold its predecessors'
//! acks (and a Kafka partition's commits) back.
//!
//! Each message keeps the answers of [`Processor::process`](crate::Processor::process):
//!
//! - a message without a usable key is dead-lettered at its turn;
//! - a duplicate is acked, a reused key with another payload dead-lettered;
//! - a message whose key is in flight first has the outcomes run so far recorded (its key may
//!   be held by an earlier message of the same batch), then waits for its key as a single
//!   message does; if the key is still in flight it is nacked;
//! - a handler that fails has its release recorded; if its message is to be delivered again
//!   (nacked), the outcomes run so far are recorded with it. A fatal failure, a panic at the
//!   delivery limit or a mismatch dead-letters that message alone;
//! - a store that fails the claim of a message nacks it.
//!
//! In an [ordered](crate::Decisions::is_ordered) batch (a Kafka partition's) a nack ends the
//! batch: the broker delivers that message again before the ones after it. In an unordered
//! one (RabbitMQ, JetStream, SQS) every message is decided. A batch also ends before its next handler once the worker [closed](crate::Decisions::close)
//! the sink (it is stopping).
//!
//! The claimed messages after the end of a batch did not run: their keys are handed back
//! (released) and their messages offered again by the broker's worker.

use std::time::Instant;

use idempotency_core::{
    Claimed, ClaimedRun, ErrorKind, Execution, Fingerprint, Key, Outcome, RunLease, Scope, Store, StoreError,
};

use crate::{
    Consumer, Decisions, Delivery, Disposition, Handler, HandlerError, catching_panics, complete_on_success,
};

/// A message whose handler ran and whose outcome is not recorded yet.
struct Ran {
    index: usize,
    key: Key,
    run: ClaimedRun,
    value: Result<Outcome, HandlerError>,
}

/// See the [module docs](self).
pub(crate) async fn process_many<S, H, M>(consumer: &Consumer<S, H>, messages: &[&M], sink: &Decisions)
where
    S: Store,
    H: Handler<M>,
    M: Delivery + Sync,
{
    if !sink.is_ordered() {
        return process_unordered(consumer, messages, sink).await;
    }
    let started = Instant::now();
    let rules = &consumer.rules;
    let (keys, claims) = claim_batch(consumer, messages).await;
    let mut claimed = by_message(&keys, claims);
    let leases: Vec<RunLease> = claimed
        .iter()
        .filter_map(|claim| match claim {
            Some(Ok(Claimed::Run(run))) => Some(run.lease()),
            _ => None,
        })
        .collect();
    let work = async {
        let mut decided = Decided {
            dispositions: Vec::with_capacity(messages.len()),
            handed: 0,
            nacked: false,
            sink,
        };
        let mut ran: Vec<Ran> = Vec::new();
        for (index, message) in messages.iter().enumerate() {
            if sink.is_closed() {
                break;
            }
            let message: &M = message;
            decided.dispositions.push(None);
            let Some(key) = &keys[index] else {
                // No usable key: the dead letter, counted and logged now.
                if let Err(dead) = rules.key(message) {
                    decided.set(index, dead);
                    continue;
                }
                // The key function answers differently now: the message is tried again.
                let retry = rules.store_unavailable(&"the message's key changed", message.delivery_count());
                decided.set(index, retry);
                break;
            };
            let claim = claimed[index].take().unwrap_or_else(|| {
                Err(StoreError::new(
                    ErrorKind::Protocol,
                    "the store answered fewer claims than it was asked for",
                ))
            });
            let ends = match claim {
                Err(error) => {
                    let disposition = rules.settle::<Outcome>(Err(error), key, message, started);
                    let ends = sink.ends(&disposition);
                    decided.set(index, disposition);
                    ends
                }
                Ok(Claimed::Answer(Execution::InFlight { .. })) => {
                    record(consumer, messages, &mut ran, &mut decided, started).await;
                    let disposition = consumer.process_keyed(message, key.clone(), started).await;
                    let ends = sink.ends(&disposition);
                    decided.set(index, disposition);
                    ends
                }
                Ok(Claimed::Answer(answer)) => {
                    decided.set(index, rules.settle(Ok(answer), key, message, started));
                    false
                }
                Ok(Claimed::Run(run)) => {
                    let attempt = run.attempt().clone();
                    let handling = catching_panics(consumer.handler.handle(message, &attempt));
                    tokio::pin!(handling);
                    let value = if ran.is_empty() {
                        handling.await
                    } else {
                        tokio::select! {
                            biased;
                            value = &mut handling => value,
                            () = tokio::time::sleep(consumer.linger) => {
                                // A slow handler: what ran before it is recorded and handed
                                // over meanwhile.
                                record(consumer, messages, &mut ran, &mut decided, started).await;
                                handling.await
                            }
                        }
                    };
                    let failed = value.is_err();
                    ran.push(Ran {
                        index,
                        key: key.clone(),
                        run,
                        value,
                    });
                    if failed && sink.is_ordered() {
                        // Its release goes out now, with the outcomes before it: a nack ends
                        // the batch, and the answer is known only once recorded.
                        record(consumer, messages, &mut ran, &mut decided, started).await;
                        decided.dispositions[index].as_ref().is_some_and(|d| sink.ends(d))
                    } else {
                        false
                    }
                }
            };
            if ends {
                break;
            }
        }
        record(consumer, messages, &mut ran, &mut decided, started).await;
    };
    tokio::select! {
        () = work => {}
        never = consumer.guard.keep_alive(&leases) => match never {},
    }
    // Claimed after the end of the batch, never run: handed back for the next delivery.
    for claim in claimed.into_iter().flatten() {
        if let Ok(Claimed::Run(run)) = claim {
            let _ = consumer.guard.hand_back(run).await;
        }
    }
}

/// A batch of independent messages ([`Decisions::unordered`]): the keys claimed in one round
/// trip, every claimed message's handler running at once (as the worker's concurrency ran
/// them before batches), the outcomes recorded together as the handlers finish (those
/// finished within the consumer's linger of each other in one round trip), and the
/// dispositions handed over in the batch's order. Messages whose key is in flight wait for it
/// afterwards, one by one, as single messages do.
async fn process_unordered<S, H, M>(consumer: &Consumer<S, H>, messages: &[&M], sink: &Decisions)
where
    S: Store,
    H: Handler<M>,
    M: Delivery + Sync,
{
    let started = Instant::now();
    let rules = &consumer.rules;
    let (keys, claims) = claim_batch(consumer, messages).await;
    let claimed = by_message(&keys, claims);
    let mut decided = Decided {
        dispositions: vec![None; messages.len()],
        handed: 0,
        nacked: false,
        sink,
    };
    let mut leases = Vec::new();
    let mut running = futures_util::stream::FuturesUnordered::new();
    let mut in_flight = Vec::new();
    for (index, (claim, key)) in claimed.into_iter().zip(&keys).enumerate() {
        let message: &M = messages[index];
        let Some(key) = key else {
            // No usable key: the dead letter, counted and logged; or, if the key function
            // answers differently now, the message is tried again.
            let disposition = rules.key(message).err().unwrap_or_else(|| {
                rules.store_unavailable(&"the message's key changed", message.delivery_count())
            });
            decided.set(index, disposition);
            continue;
        };
        let claim = claim.unwrap_or_else(|| {
            Err(StoreError::new(
                ErrorKind::Protocol,
                "the store answered fewer claims than it was asked for",
            ))
        });
        match claim {
            Err(error) => decided.set(index, rules.settle::<Outcome>(Err(error), key, message, started)),
            Ok(Claimed::Answer(Execution::InFlight { .. })) => in_flight.push(index),
            Ok(Claimed::Answer(answer)) => {
                decided.set(index, rules.settle(Ok(answer), key, message, started));
            }
            Ok(Claimed::Run(run)) => {
                leases.push(run.lease());
                let handler = &consumer.handler;
                running.push(async move {
                    let value = catching_panics(handler.handle(message, run.attempt())).await;
                    Ran {
                        index,
                        key: key.clone(),
                        run,
                        value,
                    }
                });
            }
        }
    }
    let work = async {
        let mut ran: Vec<Ran> = Vec::new();
        let mut flush_at: Option<tokio::time::Instant> = None;
        loop {
            let flush = async {
                match flush_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                done = futures_util::StreamExt::next(&mut running) => match done {
                    Some(done) => {
                        ran.push(done);
                        flush_at.get_or_insert_with(|| tokio::time::Instant::now() + consumer.linger);
                    }
                    None => break,
                },
                () = flush => {
                    record(consumer, messages, &mut ran, &mut decided, started).await;
                    flush_at = None;
                }
            }
        }
        record(consumer, messages, &mut ran, &mut decided, started).await;
    };
    tokio::select! {
        () = work => {}
        never = consumer.guard.keep_alive(&leases) => match never {},
    }
    // A key in flight (held elsewhere, or by an earlier message of this batch, now recorded)
    // waits for its outcome as a single message does.
    for index in in_flight {
        if let Some(key) = &keys[index] {
            let disposition = consumer
                .process_keyed(messages[index], key.clone(), started)
                .await;
            decided.set(index, disposition);
        }
    }
}

/// Each message's key (see [`keys_of`]), and the claims of those that have one, in one
/// round trip.
async fn claim_batch<S, H, M>(
    consumer: &Consumer<S, H>,
    messages: &[&M],
) -> (
    Vec<Option<Key>>,
    Vec<Result<Claimed<Result<Outcome, HandlerError>>, StoreError>>,
)
where
    S: Store,
    M: Delivery + Sync,
{
    let (keys, items) = keys_of(&consumer.rules, messages);
    let claims = consumer.guard.claim_many(items).await;
    (keys, claims)
}

/// What a batch claims for a message: its scope, key and fingerprint.
pub(crate) type ToClaim = (Scope, Key, Fingerprint);

/// The key of each message of a batch (`None` where it has no usable key: it is found again,
/// and the failure counted, at the message's turn), and what to claim: scope, key and
/// fingerprint of each message that has a key.
pub(crate) fn keys_of<M: Delivery>(
    rules: &crate::Rules,
    messages: &[&M],
) -> (Vec<Option<Key>>, Vec<ToClaim>) {
    let keys: Vec<Option<Key>> = messages
        .iter()
        .map(|message| rules.keys.find(*message).ok())
        .collect();
    let items = messages
        .iter()
        .zip(&keys)
        .filter_map(|(message, key)| {
            key.clone()
                .map(|key| (rules.scope.clone(), key, Fingerprint::of_bytes(message.payload())))
        })
        .collect();
    (keys, items)
}

/// The claims of the messages that have a key, placed by message (`None` for the others).
pub(crate) fn by_message<C>(keys: &[Option<Key>], claims: Vec<C>) -> Vec<Option<C>> {
    let mut claims = claims.into_iter();
    keys.iter()
        .map(|key| key.as_ref().and_then(|_| claims.next()))
        .collect()
}

/// The dispositions of a batch so far, handed to the sink in order as the first ones become
/// known.
struct Decided<'a> {
    dispositions: Vec<Option<Disposition>>,
    handed: usize,
    /// A nack that ends the (ordered) batch was handed over: nothing after it is.
    nacked: bool,
    sink: &'a Decisions,
}

impl Decided<'_> {
    /// Notes the disposition of message `index`, and hands over those now known in order, up
    /// to and including the first nack of an ordered batch: it ends there for the caller.
    fn set(&mut self, index: usize, disposition: Disposition) {
        self.dispositions[index] = Some(disposition);
        while let Some(Some(next)) = self.dispositions.get(self.handed) {
            if self.nacked {
                return;
            }
            self.nacked = self.sink.ends(next);
            self.sink.send(next.clone());
            self.handed += 1;
        }
    }
}

/// Records the outcomes of `ran` in one round trip and notes each message's disposition.
async fn record<S, H, M>(
    consumer: &Consumer<S, H>,
    messages: &[&M],
    ran: &mut Vec<Ran>,
    decided: &mut Decided<'_>,
    started: Instant,
) where
    S: Store,
    M: Delivery + Sync,
{
    if ran.is_empty() {
        return;
    }
    let ran = std::mem::take(ran);
    let mut places = Vec::with_capacity(ran.len());
    let mut finishing = Vec::with_capacity(ran.len());
    for Ran {
        index,
        key,
        run,
        value,
    } in ran
    {
        places.push((index, key));
        finishing.push((run, value));
    }
    let executions = consumer.guard.finish_many(finishing, &complete_on_success).await;
    for ((index, key), execution) in places.into_iter().zip(executions) {
        let disposition = consumer
            .rules
            .settle(Ok(execution), &key, messages[index], started);
        decided.set(index, disposition);
    }
}
