//! Group commit: concurrent `begin`s, and concurrent `complete`s, sent to the store together.
//!
//! On a SQL store every `begin` of a new key and every `complete` is a transaction of its own:
//! a round trip, a statement and a commit per call, so a request that claims a key and records
//! its outcome pays two commits. The stores' [`Store::begin_many`] and [`Store::complete_many`]
//! run a whole batch in one statement and one commit; [`GroupCommit`] wraps a store so that
//! the single calls of concurrent requests ride in those batches.
//!
//! - **No waiting at idle.** At most [`GroupSettings::in_flight`] calls or batches of each kind
//!   are at the store at once. A call that finds one of those slots free goes at once, alone,
//!   as it would without the wrapper.
//! - **A window under load.** A call that finds them all busy queues. The first call to queue
//!   opens a window; it closes when [`GroupSettings::max_batch`] calls are in it or
//!   [`GroupSettings::linger`] after that first call queued, whichever comes first, and the
//!   window's calls go as one batch as soon as a slot is free. No call waits for company longer
//!   than the linger.
//! - **The same answers.** Each call gets its request's answer from the batch, which the
//!   [`Store`] contract defines as the answer its single call would get had the batch's calls
//!   run one after another (each key its own claim, token, fencing and attempt; a key twice in a
//!   batch is claimed by its first request and in flight for the second).
//! - **The same failures.** A batch whose statement or commit fails fails every call in it with
//!   that error, as a failed single call fails: the effect of each is unknown to its caller, who
//!   holds its token and decides (every store answers a retry with the same token as it
//!   answered the first).
//!
//! Everything else (`release`, `extend`, reads, the operators' calls, `begin_many` and
//! `complete_many` themselves) goes straight to the wrapped store. The metric
//! `idempotency_group_commit_batch_size{op}` (`op` = `begin` or `complete`) is the size of each
//! call or batch sent.
//!
//! ```
//! # async fn run() -> Result<(), idempotency_core::StoreError> {
//! use idempotency_core::{BeginRequest, Claim, Fingerprint, GroupCommit, Key, MemoryStore, Scope, Store};
//!
//! let store = GroupCommit::new(MemoryStore::new());
//! let key = Key::new("order-1").expect("a valid key");
//! let request = BeginRequest::new(Scope::global(), key, Fingerprint::of_bytes(b"{}"));
//! assert!(matches!(store.begin(&request).await?, Claim::Acquired(_)));
//! # Ok(()) }
//! # tokio::runtime::Runtime::new().unwrap().block_on(run()).unwrap();
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::time::Instant;

use crate::{
    BeginRequest, Claim, Completion, ErrorKind, Fenced, Held, Key, ListFilter, Outcome, Record,
    RecordSummary, Scope, Stats, Store, StoreAdmin, StoreError, Timestamp, Token,
};

/// The most calls one batch may hold: a batch holds its connection (and its rows' locks) for
/// its whole statement.
pub const MAX_BATCH: usize = 1000;

/// The longest linger: past it, the wait for company costs more than a commit saves.
pub const MAX_LINGER: Duration = Duration::from_secs(1);

/// The most calls or batches of one kind at the store at once.
pub const MAX_IN_FLIGHT: usize = 64;

/// How a [`GroupCommit`] gathers calls into batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct GroupSettings {
    /// The most calls in one batch (default 64).
    pub max_batch: usize,
    /// How long the first call queued in a window waits for others at the most (default
    /// 1 ms). A call that finds a slot free does not wait at all.
    pub linger: Duration,
    /// How many calls or batches of each kind (`begin`, `complete`) may be at the store at
    /// once (default 2): while they are, calls queue and ride together in the next batch.
    pub in_flight: usize,
}

impl Default for GroupSettings {
    fn default() -> Self {
        Self {
            max_batch: 64,
            linger: Duration::from_millis(1),
            in_flight: 2,
        }
    }
}

impl GroupSettings {
    /// Sets the most calls in one batch, from 1 to [`MAX_BATCH`].
    #[must_use]
    pub fn max_batch(mut self, max: usize) -> Self {
        self.max_batch = max.clamp(1, MAX_BATCH);
        self
    }

    /// Sets how long the first call of a window waits for others at the most, up to
    /// [`MAX_LINGER`].
    #[must_use]
    pub fn linger(mut self, linger: Duration) -> Self {
        self.linger = linger.min(MAX_LINGER);
        self
    }

    /// Sets how many calls or batches of each kind may be at the store at once, from 1 to
    /// [`MAX_IN_FLIGHT`].
    #[must_use]
    pub fn in_flight(mut self, in_flight: usize) -> Self {
        self.in_flight = in_flight.clamp(1, MAX_IN_FLIGHT);
        self
    }
}

/// A store whose concurrent `begin`s and `complete`s go to it in batches; see the
/// [module docs](self). Its clones share the wrapped store, the slots and the queues.
pub struct GroupCommit<S> {
    shared: Arc<Shared<S>>,
}

struct Shared<S> {
    inner: Arc<S>,
    settings: GroupSettings,
    begins: Lane<BeginRequest, Claim>,
    completes: Lane<Completion, Fenced<Timestamp>>,
}

impl<S> Clone for GroupCommit<S> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S> fmt::Debug for GroupCommit<S>
where
    S: fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GroupCommit")
            .field("inner", &self.shared.inner)
            .field("settings", &self.shared.settings)
            .finish_non_exhaustive()
    }
}

impl<S: Store + 'static> GroupCommit<S> {
    /// `inner` with the default [`GroupSettings`].
    #[must_use]
    pub fn new(inner: S) -> Self {
        Self::with_settings(inner, GroupSettings::default())
    }

    /// `inner` with `settings`.
    #[must_use]
    pub fn with_settings(inner: S, settings: GroupSettings) -> Self {
        Self {
            shared: Arc::new(Shared {
                inner: Arc::new(inner),
                settings,
                begins: Lane::new("begin", settings.in_flight),
                completes: Lane::new("complete", settings.in_flight),
            }),
        }
    }

    /// The wrapped store.
    #[must_use]
    pub fn inner(&self) -> &S {
        &self.shared.inner
    }

    /// The settings the calls are gathered with.
    #[must_use]
    pub fn settings(&self) -> GroupSettings {
        self.shared.settings
    }

    fn begin_batches(&self) -> RunBatch<BeginRequest, Claim> {
        let inner = Arc::clone(&self.shared.inner);
        Arc::new(move |requests: Vec<BeginRequest>| {
            let inner = Arc::clone(&inner);
            Box::pin(async move { inner.begin_many(&requests).await })
        })
    }

    fn complete_batches(&self) -> RunBatch<Completion, Fenced<Timestamp>> {
        let inner = Arc::clone(&self.shared.inner);
        Arc::new(move |completions: Vec<Completion>| {
            let inner = Arc::clone(&inner);
            Box::pin(async move { inner.complete_many(&completions).await })
        })
    }
}

/// Runs one batch: one answer per item, in order.
type RunBatch<T, R> =
    Arc<dyn Fn(Vec<T>) -> Pin<Box<dyn Future<Output = Vec<Result<R, StoreError>>> + Send>> + Send + Sync>;

/// One queued call.
struct Job<T, R> {
    item: T,
    reply: oneshot::Sender<Result<R, StoreError>>,
    queued: Instant,
}

/// The calls of one kind: its slots, and the queue its dispatcher takes batches from (started
/// by the first call that queues, on that call's runtime).
struct Lane<T, R> {
    op: &'static str,
    slots: Arc<Semaphore>,
    queue: OnceLock<mpsc::UnboundedSender<Job<T, R>>>,
}

impl<T: Send + 'static, R: Send + 'static> Lane<T, R> {
    fn new(op: &'static str, in_flight: usize) -> Self {
        Self {
            op,
            slots: Arc::new(Semaphore::new(in_flight.max(1))),
            queue: OnceLock::new(),
        }
    }

    /// A slot for a call that goes alone, if one is free.
    fn free_slot(&self) -> Option<OwnedSemaphorePermit> {
        let slot = Arc::clone(&self.slots).try_acquire_owned().ok()?;
        metrics::histogram!("idempotency_group_commit_batch_size", "op" => self.op).record(1.0);
        Some(slot)
    }

    /// Queues `item` for the next batch and waits for its answer.
    async fn queued(
        &self,
        item: T,
        settings: GroupSettings,
        run: impl FnOnce() -> RunBatch<T, R>,
    ) -> Result<R, StoreError> {
        let queue = self.queue.get_or_init(|| {
            let (jobs, queue) = mpsc::unbounded_channel();
            tokio::spawn(dispatch(queue, Arc::clone(&self.slots), settings, run(), self.op));
            jobs
        });
        let (reply, answer) = oneshot::channel();
        queue
            .send(Job {
                item,
                reply,
                queued: Instant::now(),
            })
            .map_err(|_| stopped(self.op))?;
        answer.await.map_err(|_| stopped(self.op))?
    }
}

/// The dispatcher is gone (its Tokio runtime shut down): whether a batch it was sending ran is
/// unknown.
fn stopped(op: &str) -> StoreError {
    StoreError::new(
        ErrorKind::Unavailable,
        format!(
            "the group commit's {op} dispatcher stopped (its Tokio runtime shut down); the outcome of the call is unknown"
        ),
    )
}

/// Takes the queued calls a window at a time and sends each window as one batch once a slot is
/// free; ends when every handle on the lane is gone.
async fn dispatch<T, R>(
    mut queue: mpsc::UnboundedReceiver<Job<T, R>>,
    slots: Arc<Semaphore>,
    settings: GroupSettings,
    run: RunBatch<T, R>,
    op: &'static str,
) where
    T: Send + 'static,
    R: Send + 'static,
{
    while let Some(first) = queue.recv().await {
        let closes = first.queued + settings.linger;
        let mut window = vec![first];
        // What queued meanwhile, then company until the window closes.
        while window.len() < settings.max_batch {
            match queue.try_recv() {
                Ok(job) => window.push(job),
                Err(_) => break,
            }
        }
        while window.len() < settings.max_batch {
            match tokio::time::timeout_at(closes, queue.recv()).await {
                Ok(Some(job)) => window.push(job),
                Ok(None) | Err(_) => break,
            }
        }
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        // Calls that queued while the slot was busy ride along, up to the limit.
        while window.len() < settings.max_batch {
            match queue.try_recv() {
                Ok(job) => window.push(job),
                Err(_) => break,
            }
        }
        let run = Arc::clone(&run);
        tokio::spawn(async move {
            let _slot = slot;
            send(window, &run, op).await;
        });
    }
}

/// Sends `window` as one batch and answers each call from its item of the answers.
async fn send<T, R>(window: Vec<Job<T, R>>, run: &RunBatch<T, R>, op: &'static str) {
    metrics::histogram!("idempotency_group_commit_batch_size", "op" => op).record(window.len() as f64);
    let len = window.len();
    let (items, replies): (Vec<T>, Vec<_>) = window.into_iter().map(|job| (job.item, job.reply)).unzip();
    let answers = run(items).await;
    if answers.len() != len {
        let error = StoreError::new(
            ErrorKind::Protocol,
            format!("a batch of {len} {op}s got {} answers", answers.len()),
        );
        for reply in replies {
            let _ = reply.send(Err(error.clone()));
        }
        return;
    }
    for (reply, answer) in replies.into_iter().zip(answers) {
        // A caller that went away meanwhile has no use for its answer.
        let _ = reply.send(answer);
    }
}

#[async_trait]
impl<S: Store + 'static> Store for GroupCommit<S> {
    async fn begin(&self, request: &BeginRequest) -> Result<Claim, StoreError> {
        let shared = &self.shared;
        if let Some(slot) = shared.begins.free_slot() {
            let claim = shared.inner.begin(request).await;
            drop(slot);
            return claim;
        }
        shared
            .begins
            .queued(request.clone(), shared.settings, || self.begin_batches())
            .await
    }

    async fn complete(
        &self,
        held: &Held,
        outcome: Outcome,
        retention: Duration,
    ) -> Result<Fenced<Timestamp>, StoreError> {
        let shared = &self.shared;
        if let Some(slot) = shared.completes.free_slot() {
            let done = shared.inner.complete(held, outcome, retention).await;
            drop(slot);
            return done;
        }
        let completion = Completion::new(held.clone(), outcome, retention);
        shared
            .completes
            .queued(completion, shared.settings, || self.complete_batches())
            .await
    }

    async fn release(&self, held: &Held) -> Result<Fenced<()>, StoreError> {
        self.shared.inner.release(held).await
    }

    async fn extend(&self, held: &Held, lease: Duration) -> Result<Fenced<Timestamp>, StoreError> {
        self.shared.inner.extend(held, lease).await
    }

    async fn get(&self, scope: &Scope, key: &Key) -> Result<Option<Record>, StoreError> {
        self.shared.inner.get(scope, key).await
    }

    async fn begin_many(&self, requests: &[BeginRequest]) -> Vec<Result<Claim, StoreError>> {
        self.shared.inner.begin_many(requests).await
    }

    async fn complete_many(&self, completions: &[Completion]) -> Vec<Result<Fenced<Timestamp>, StoreError>> {
        self.shared.inner.complete_many(completions).await
    }
}

#[async_trait]
impl<S: StoreAdmin + 'static> StoreAdmin for GroupCommit<S> {
    async fn stats(&self, scope: Option<&Scope>) -> Result<Stats, StoreError> {
        self.shared.inner.stats(scope).await
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordSummary>, StoreError> {
        self.shared.inner.list(filter).await
    }

    async fn purge_expired(&self, limit: u64) -> Result<u64, StoreError> {
        self.shared.inner.purge_expired(limit).await
    }

    async fn forget(&self, scope: &Scope, key: &Key, token: Token) -> Result<Fenced<()>, StoreError> {
        self.shared.inner.forget(scope, key, token).await
    }

    fn expires_by_itself(&self) -> bool {
        self.shared.inner.expires_by_itself()
    }

    async fn now(&self) -> Result<Timestamp, StoreError> {
        self.shared.inner.now().await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use tokio::sync::Notify;

    use super::*;
    use crate::{Fingerprint, MemoryStore, failed_batch};

    /// The memory store, with its single `begin`s held at a gate until the test opens it, and
    /// its batches recorded (their sizes and the virtual time they were sent).
    #[derive(Debug, Default)]
    struct Gated {
        store: MemoryStore,
        gate: Notify,
        batches: Mutex<Vec<(usize, Instant)>>,
        completion_batches: Mutex<Vec<usize>>,
        fail_batches: bool,
        short_answers: bool,
        /// Hold single `complete`s at the gate too.
        gate_completes: bool,
    }

    #[async_trait]
    impl Store for Gated {
        async fn begin(&self, request: &BeginRequest) -> Result<Claim, StoreError> {
            self.gate.notified().await;
            self.store.begin(request).await
        }

        async fn complete(
            &self,
            held: &Held,
            outcome: Outcome,
            retention: Duration,
        ) -> Result<Fenced<Timestamp>, StoreError> {
            if self.gate_completes {
                self.gate.notified().await;
            }
            self.store.complete(held, outcome, retention).await
        }

        async fn release(&self, held: &Held) -> Result<Fenced<()>, StoreError> {
            self.store.release(held).await
        }

        async fn extend(&self, held: &Held, lease: Duration) -> Result<Fenced<Timestamp>, StoreError> {
            self.store.extend(held, lease).await
        }

        async fn get(&self, scope: &Scope, key: &Key) -> Result<Option<Record>, StoreError> {
            self.store.get(scope, key).await
        }

        async fn begin_many(&self, requests: &[BeginRequest]) -> Vec<Result<Claim, StoreError>> {
            self.batches
                .lock()
                .expect("not poisoned")
                .push((requests.len(), Instant::now()));
            if self.fail_batches {
                let error = StoreError::new(ErrorKind::Unavailable, "connection reset by peer");
                return failed_batch(&error, requests.len());
            }
            let mut answers = crate::begin_each(&self.store, requests).await;
            if self.short_answers {
                answers.pop();
            }
            answers
        }

        async fn complete_many(
            &self,
            completions: &[Completion],
        ) -> Vec<Result<Fenced<Timestamp>, StoreError>> {
            self.completion_batches
                .lock()
                .expect("not poisoned")
                .push(completions.len());
            crate::complete_each(&self.store, completions).await
        }
    }

    fn request(key: &str) -> BeginRequest {
        BeginRequest::new(
            Scope::global(),
            Key::new(key).expect("a valid key"),
            Fingerprint::of_bytes(b"payload"),
        )
    }

    /// A wrapper of `gated` that sends one call or batch at a time and lingers `linger`.
    fn one_at_a_time(gated: Gated, linger: Duration) -> GroupCommit<Gated> {
        GroupCommit::with_settings(gated, GroupSettings::default().in_flight(1).linger(linger))
    }

    /// Starts `keys`' begins behind a call that holds the only slot, lets them queue, then opens
    /// the gate; their answers, in the order of `keys`, and the held call's.
    async fn queued_behind_a_held_call(
        store: &GroupCommit<Gated>,
        keys: &[&str],
    ) -> (Result<Claim, StoreError>, Vec<Result<Claim, StoreError>>) {
        let held = tokio::spawn({
            let store = store.clone();
            async move { store.begin(&request("held")).await }
        });
        // Virtual time: the clock moves only once every task waits, so the held call is at the
        // gate and every other call has queued when this sleep ends.
        tokio::time::sleep(Duration::from_millis(1)).await;
        let queued: Vec<_> = keys
            .iter()
            .map(|key| {
                let (store, request) = (store.clone(), request(key));
                tokio::spawn(async move { store.begin(&request).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(5)).await;
        store.inner().gate.notify_one();
        let held = held.await.expect("the held call ends");
        let mut answers = Vec::new();
        for call in queued {
            answers.push(call.await.expect("a queued call ends"));
        }
        (held, answers)
    }

    #[tokio::test(start_paused = true)]
    async fn calls_that_queue_behind_busy_slots_go_as_one_batch_each_with_its_own_answer() {
        let store = one_at_a_time(Gated::default(), Duration::from_millis(1));
        let (held, answers) = queued_behind_a_held_call(&store, &["a", "b", "c", "a"]).await;
        assert!(matches!(held, Ok(Claim::Acquired(_))), "{held:?}");
        let batches = store.inner().batches.lock().expect("not poisoned").clone();
        assert_eq!(batches.iter().map(|(len, _)| *len).collect::<Vec<_>>(), [4]);
        for (answer, key) in answers[..3].iter().zip(["a", "b", "c"]) {
            let Ok(Claim::Acquired(held)) = answer else {
                panic!("{key}: {answer:?}");
            };
            assert_eq!(held.key.as_str(), key);
        }
        // The same key twice in one batch: the first claims it, the second finds it in flight.
        assert!(
            matches!(answers[3], Ok(Claim::InFlight { attempt: 1, .. })),
            "{:?}",
            answers[3]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_that_finds_a_slot_free_goes_alone_at_once() {
        let store = GroupCommit::new(Gated::default());
        let call = tokio::spawn({
            let store = store.clone();
            async move { store.begin(&request("alone")).await }
        });
        tokio::task::yield_now().await;
        store.inner().gate.notify_one();
        assert!(matches!(call.await.expect("ends"), Ok(Claim::Acquired(_))));
        assert!(store.inner().batches.lock().expect("not poisoned").is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_window_closes_at_its_linger_without_company() {
        let linger = Duration::from_millis(10);
        let store = one_at_a_time(Gated::default(), linger);
        let held = tokio::spawn({
            let store = store.clone();
            async move { store.begin(&request("held")).await }
        });
        tokio::time::sleep(Duration::from_millis(1)).await;
        let queued_at = Instant::now();
        let lone = tokio::spawn({
            let store = store.clone();
            async move { store.begin(&request("lone")).await }
        });
        // The slot frees long before the window closes: the call still goes when it closes, not
        // later and not sooner, and alone.
        tokio::time::sleep(Duration::from_millis(2)).await;
        store.inner().gate.notify_one();
        held.await.expect("ends").expect("the held call claims");
        assert!(matches!(lone.await.expect("ends"), Ok(Claim::Acquired(_))));
        let batches = store.inner().batches.lock().expect("not poisoned").clone();
        assert_eq!(batches, [(1, queued_at + linger)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_batch_fails_every_call_in_it_with_its_error() {
        let gated = Gated {
            fail_batches: true,
            ..Gated::default()
        };
        let store = one_at_a_time(gated, Duration::ZERO);
        let (held, answers) = queued_behind_a_held_call(&store, &["a", "b", "c"]).await;
        assert!(matches!(held, Ok(Claim::Acquired(_))));
        assert_eq!(answers.len(), 3);
        for answer in answers {
            let error = answer.expect_err("the batch failed");
            assert_eq!(error.kind(), ErrorKind::Unavailable);
            assert!(error.to_string().contains("connection reset by peer"), "{error}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_answered_short_fails_every_call_in_it() {
        let gated = Gated {
            short_answers: true,
            ..Gated::default()
        };
        let store = one_at_a_time(gated, Duration::ZERO);
        let (_, answers) = queued_behind_a_held_call(&store, &["a", "b"]).await;
        for answer in answers {
            let error = answer.expect_err("no answer can be trusted");
            assert_eq!(error.kind(), ErrorKind::Protocol);
            assert!(
                error.to_string().contains("a batch of 2 begins got 1 answers"),
                "{error}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn completions_ride_in_batches_and_are_fenced_each_by_its_own_token() {
        let gated = Gated {
            gate_completes: true,
            ..Gated::default()
        };
        let store = one_at_a_time(gated, Duration::from_millis(1));
        let mut held = Vec::new();
        for key in ["a", "b", "c", "d"] {
            let claim = store.inner().store.begin(&request(key)).await.expect("begins");
            let Claim::Acquired(claim) = claim else {
                panic!("{key}: {claim:?}");
            };
            held.push(claim);
        }
        // `b`'s holder is not the record's any more: only its completion is refused.
        let released = store.release(&held[1]).await.expect("releases");
        assert!(matches!(released, Fenced::Accepted(())), "{released:?}");
        let complete = |claim: &Held| {
            let (store, claim) = (store.clone(), claim.clone());
            tokio::spawn(async move {
                store
                    .complete(&claim, Outcome::new(&b"done"[..]), Duration::from_secs(60))
                    .await
            })
        };
        // `a` holds the only slot at the gate; the others queue behind it.
        let first = complete(&held[0]);
        tokio::time::sleep(Duration::from_millis(1)).await;
        let queued: Vec<_> = held[1..].iter().map(complete).collect();
        tokio::time::sleep(Duration::from_secs(5)).await;
        store.inner().gate.notify_one();
        let first = first.await.expect("ends").expect("completes");
        assert!(matches!(first, Fenced::Accepted(_)), "{first:?}");
        let mut answers = Vec::new();
        for call in queued {
            answers.push(call.await.expect("ends").expect("completes"));
        }
        assert_eq!(
            *store.inner().completion_batches.lock().expect("not poisoned"),
            [3]
        );
        assert!(answers[0].is_lease_lost(), "{answers:?}");
        assert!(
            matches!(
                (&answers[1], &answers[2]),
                (Fenced::Accepted(_), Fenced::Accepted(_))
            ),
            "{answers:?}"
        );
    }
}
