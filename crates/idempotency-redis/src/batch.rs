//! Concurrent `begin`s and `complete`s on a single server, sent as one script call per batch.
//!
//! A record's script costs the server far more than the command that carries it: on the
//! benchmark machine a `begin` of a new key is about 14 µs of Redis CPU, of which the `EVALSHA`
//! itself (parsing, the script lookup, the Lua call, `TIME`) is about 4. Redis runs one script at
//! a time, so under load that fixed part is what the callers queue behind. The [`Batcher`]
//! shares it. At most [`IN_FLIGHT`] script calls are on the wire at once. A call that finds one
//! of those slots free sends its own one-key script at once. A call that finds them all busy
//! hands its job to a dispatcher task and waits for its reply; when a slot frees, the dispatcher
//! takes every job queued meanwhile, up to [`MAX_BATCH`] of each kind, and sends the `begin`s as
//! one call of the batch script and the `complete`s as another.
//!
//! - **No waiting for company.** With a slot free, a call goes out at once, as it would without
//!   the batcher: there is no timer, only the jobs that queued while the slots were busy ride
//!   together.
//! - **The same answers.** The batch script runs the very function of the one-key script for
//!   each key in turn, so every key gets the reply that separate calls in that order would have
//!   given (two `begin`s of one key in one batch: the first acquires, the second finds it in
//!   flight). A key whose value is foreign gets its own error; the others are not affected.
//! - **The same failures.** A batch whose reply is lost fails every call in it the way a lost
//!   reply fails one call: the outcome is unknown, and each caller, who holds its token, decides
//!   (every script answers a retry with the same token as it answered the first).
//!
//! Cluster connections are not batched: the keys of one script must share a slot.

use std::sync::Arc;

use idempotency_core::{ErrorKind, StoreError, failed_batch};
use redis::Value;
use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::error::{map_error, map_script_error};
use crate::scripts;
use crate::store::Connection;

/// The most jobs of one kind in one batch script call: a batch holds the server for its whole run
/// (about 0.3 ms at this size on the benchmark machine), so it stays short.
pub(crate) const MAX_BATCH: usize = 32;

/// How many batches may be on the wire at once: while they are, jobs queue and ride together in
/// the next one. Two keep the server busy while a reply travels back.
pub(crate) const IN_FLIGHT: usize = 2;

/// Which script a job runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `begin`, [`scripts::BEGIN_ARGS`] arguments.
    Begin,
    /// `complete`, [`scripts::COMPLETE_ARGS`] arguments.
    Complete,
}

/// One call's share of a batch.
struct Job {
    kind: Kind,
    key: String,
    args: Vec<Vec<u8>>,
    reply: oneshot::Sender<Result<Value, StoreError>>,
}

/// The scripts, the connection and the slots the callers and the dispatcher share.
struct Shared {
    connection: Connection,
    /// The one-key scripts, for a call that finds a slot free.
    begin: redis::Script,
    complete: redis::Script,
    /// The batch scripts.
    begin_many: redis::Script,
    complete_many: redis::Script,
    /// One permit per script call on the wire, direct or batched.
    slots: Arc<Semaphore>,
}

impl Shared {
    fn scripts(&self, kind: Kind) -> (&redis::Script, &redis::Script, &'static str) {
        match kind {
            Kind::Begin => (&self.begin, &self.begin_many, "begin"),
            Kind::Complete => (&self.complete, &self.complete_many, "complete"),
        }
    }
}

/// The handle the store's clones share: dropping the last one ends the dispatcher.
#[derive(Clone)]
pub(crate) struct Batcher {
    jobs: mpsc::UnboundedSender<Job>,
    shared: Arc<Shared>,
}

impl Batcher {
    /// Starts the dispatcher on the current Tokio runtime.
    pub(crate) fn start(connection: Connection) -> Self {
        let (jobs, queue) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            connection,
            begin: redis::Script::new(&scripts::begin()),
            complete: redis::Script::new(&scripts::complete()),
            begin_many: redis::Script::new(&scripts::begin_many()),
            complete_many: redis::Script::new(&scripts::complete_many()),
            slots: Arc::new(Semaphore::new(IN_FLIGHT)),
        });
        tokio::spawn(dispatch(queue, Arc::clone(&shared)));
        Self { jobs, shared }
    }

    /// Runs the `kind` script on `key` with `args` (the one-key script's arguments): at once when
    /// a slot is free, else in a batch with whatever else queues meanwhile; the reply is what the
    /// one-key script would have answered.
    pub(crate) async fn call(
        &self,
        kind: Kind,
        key: String,
        args: Vec<Vec<u8>>,
    ) -> Result<Value, StoreError> {
        if let Ok(slot) = Arc::clone(&self.shared.slots).try_acquire_owned() {
            // Nothing queues while a slot is free: no hop through the dispatcher.
            let (one, _, op) = self.shared.scripts(kind);
            metrics::histogram!("idempotency_redis_batch_size", "op" => op).record(1.0);
            let mut invocation = one.key(key);
            for arg in &args {
                invocation.arg(&arg[..]);
            }
            let reply = invocation
                .invoke_async::<Value>(&mut self.shared.connection.clone())
                .await
                .map_err(|e| map_error("run a script", e));
            drop(slot);
            return reply;
        }
        let (reply, answer) = oneshot::channel();
        self.jobs
            .send(Job {
                kind,
                key,
                args,
                reply,
            })
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

/// The dispatcher is gone: its runtime shut down. Whether a batch it was sending ran is unknown.
fn stopped() -> StoreError {
    StoreError::new(
        ErrorKind::Unavailable,
        "the Redis store's dispatcher stopped (its Tokio runtime shut down); the outcome of the call is unknown",
    )
}

async fn dispatch(mut queue: mpsc::UnboundedReceiver<Job>, shared: Arc<Shared>) {
    while let Some(first) = queue.recv().await {
        let Ok(slot) = Arc::clone(&shared.slots).acquire_owned().await else {
            return;
        };
        let (mut begins, mut completes) = (Vec::new(), Vec::new());
        let mut next = Some(first);
        while let Some(job) = next {
            let batch = match job.kind {
                Kind::Begin => &mut begins,
                Kind::Complete => &mut completes,
            };
            batch.push(job);
            next = if begins.len() < MAX_BATCH && completes.len() < MAX_BATCH {
                queue.try_recv().ok()
            } else {
                None
            };
        }
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            let _slot = slot;
            futures_util::future::join(
                send(&shared, Kind::Begin, begins),
                send(&shared, Kind::Complete, completes),
            )
            .await;
        });
    }
}

/// Sends `jobs` as one call of the batch script of `kind` and answers each from its item of the
/// reply.
async fn send(shared: &Shared, kind: Kind, jobs: Vec<Job>) {
    if jobs.is_empty() {
        return;
    }
    let (_, many, _) = shared.scripts(kind);
    let calls: Vec<(&str, &[Vec<u8>])> = jobs.iter().map(|job| (job.key.as_str(), &job.args[..])).collect();
    let replies = run_many(&shared.connection, many, kind, &calls).await;
    for (job, reply) in jobs.into_iter().zip(replies) {
        let _ = job.reply.send(reply);
    }
}

/// Runs one call of the batch script `many` (of `kind`) for `calls` (each a record key and its
/// one-key script's arguments; keys that share a slot on a cluster): one reply per call, in
/// order, each what the one-key script would have answered, or the call's failure for every
/// call when the batch's reply was lost or unreadable.
pub(crate) async fn run_many<A: AsRef<[u8]>>(
    connection: &Connection,
    many: &redis::Script,
    kind: Kind,
    calls: &[(&str, &[A])],
) -> Vec<Result<Value, StoreError>> {
    let (op, doing) = match kind {
        Kind::Begin => ("begin", "run a batch of begins"),
        Kind::Complete => ("complete", "run a batch of completes"),
    };
    metrics::histogram!("idempotency_redis_batch_size", "op" => op).record(calls.len() as f64);
    let mut invocation = many.prepare_invoke();
    for (key, args) in calls {
        invocation.key(*key);
        for arg in *args {
            invocation.arg(arg.as_ref());
        }
    }
    let reply = invocation.invoke_async::<Value>(&mut connection.clone()).await;
    match reply {
        Ok(Value::Array(items)) if items.len() == calls.len() => {
            items.into_iter().map(|item| item_result(item, doing)).collect()
        }
        Ok(other) => failed_batch(
            &StoreError::new(
                ErrorKind::Protocol,
                format!("{doing}: unexpected reply {other:?}"),
            ),
            calls.len(),
        ),
        Err(error) => failed_batch(&map_error(doing, error), calls.len()),
    }
}

/// One key's item: its reply, or the error it answered (`{'error', text}`).
fn item_result(item: Value, doing: &str) -> Result<Value, StoreError> {
    if let Value::Array(fields) = &item
        && let [Value::BulkString(tag), Value::BulkString(text)] = fields.as_slice()
        && tag.as_slice() == b"error"
    {
        return Err(map_script_error(doing, &String::from_utf8_lossy(text)));
    }
    Ok(item)
}
