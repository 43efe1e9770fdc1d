//! Linearizability of a store's concurrent histories, checked against the reference model.
//!
//! The conformance cases and the model test check sequences of operations; a store can pass them
//! all and still let two concurrent `begin`s both acquire (a check-then-act: read, then write).
//! This module runs many concurrent clients against a real store, records every call with a
//! [`Recorder`], and checks each key's history for an order of its operations that (1) respects
//! real time (an operation that returned before another was called comes first), and (2) gives
//! every operation the answer the reference model ([`machine`], as the memory store runs it)
//! gives in that order. A call whose answer was lost (a cut connection) may have taken effect at
//! any moment after it was called, or never.
//!
//! The search is the Wing–Gong algorithm with Lowe's memoisation (as in Porcupine and Knossos):
//! linearize a call whose interval has begun before any unlinearized return, backtrack at a
//! return that nothing could explain, and remember each (set of linearized calls, model state)
//! already tried. It is written here because no maintained crate on the registry checks
//! histories against a user's model with memoisation (stateright's tester enumerates every
//! order, which is fine for a dozen operations, not for a thousand).
//!
//! **Time in the model.** Store clocks and the model's cannot be lined up call by call, so the
//! workload keeps time out of it: leases and retention are an hour, nothing expires during a
//! run, and a lease ends only by `release` (the next `begin` then takes over, as after an
//! expiry). Answers are compared without their times. Expiry itself is held to the model by the
//! conformance cases and the model test.
//!
//! [`check_harness`] runs the whole check on a [`Harness`]'s store, with connection cuts when
//! the harness offers them ([`Harness::store_with_cuts`]); [`conformance_suite!`](crate::conformance_suite)
//! includes it.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idempotency_core::machine::{self, Effect};
use idempotency_core::{
    BeginRequest, Claim, Completion, Fenced, Fingerprint, Held, Key, Outcome, Record, Scope, Store,
    Timestamp, Token,
};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};

use crate::Harness;
use crate::history::{Input, Operation, Output, Recorder};

/// The lease and the retention of every operation of the workload: longer than any run.
pub const LONG: Duration = Duration::from_secs(3600);

/// The model's clock: any fixed time works, since nothing expires (see the [module docs](self)).
const MODEL_NOW: Timestamp = Timestamp::from_unix_millis(1_000_000_000);

/// How many steps the search may take on one history before it gives up (and the check fails:
/// an undecided history proves nothing).
const SEARCH_BUDGET: u64 = 50_000_000;

/// Cuts a store's connections to its server, for the faults of the check.
#[async_trait]
pub trait Cutter: Send + Sync + std::fmt::Debug {
    /// Drops every open connection of the store under test: calls in flight fail, whether or
    /// not the server applied them, and the store reconnects.
    async fn cut(&self);
}

#[async_trait]
impl Cutter for crate::TcpProxy {
    async fn cut(&self) {
        crate::TcpProxy::cut(self);
    }
}

/// How much the check runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scale {
    /// Keys, each with a history of its own.
    pub histories: usize,
    /// Operations per history (at least).
    pub operations: usize,
    /// Clients working on each key at once.
    pub clients: usize,
    /// Keys worked on at once.
    pub at_once: usize,
    /// Connection cuts while each group of keys runs (when the harness can cut).
    pub cuts: usize,
}

impl Default for Scale {
    /// 20 histories of 1000 operations, 4 clients on each key, 5 keys at once, 3 cuts a group.
    fn default() -> Self {
        Self {
            histories: 20,
            operations: 1000,
            clients: 4,
            at_once: 5,
            cuts: 3,
        }
    }
}

/// What the check measured.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Histories checked.
    pub histories: usize,
    /// Operations in all.
    pub operations: usize,
    /// Operations whose answer was lost.
    pub unanswered: usize,
    /// Operations that ran while another one on the same key ran (the ones whose order the
    /// check had to find).
    pub concurrent: usize,
    /// Connection cuts.
    pub cuts: usize,
    /// Search steps in all.
    pub steps: u64,
    /// How long the workload ran.
    pub run: Duration,
    /// How long the checking took.
    pub check: Duration,
}

/// Why a history is not linearizable.
#[derive(Debug, Clone)]
pub struct Violation {
    /// The longest prefix of operations the search could order.
    pub linearized: usize,
    /// The operation whose answer no order could explain.
    pub stuck: Operation,
    /// The operations whose intervals overlap it.
    pub concurrent: Vec<Operation>,
    /// The model's record after the longest order found.
    pub model: Option<Record>,
    /// Whether the search ran out of budget instead.
    pub undecided: bool,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.undecided {
            writeln!(f, "the search gave up after {SEARCH_BUDGET} steps")?;
        }
        writeln!(
            f,
            "no order explains {} (after {} operations ordered; the model then held {:?})",
            self.stuck, self.linearized, self.model
        )?;
        writeln!(f, "operations overlapping it:")?;
        for operation in &self.concurrent {
            writeln!(f, "  {operation}")?;
        }
        Ok(())
    }
}

/// The reference model's answer to `input` on `record`, and the record after it.
#[must_use]
pub fn step(record: Option<&Record>, scope: &Scope, key: &Key, input: &Input) -> (Output, Option<Record>) {
    let now = MODEL_NOW;
    let apply = |effect: Effect| match effect {
        Effect::Put(record) => Some(record),
        Effect::None => record.cloned(),
    };
    match input {
        Input::Begin { fingerprint, token } => {
            let request = BeginRequest::new(scope.clone(), key.clone(), *fingerprint)
                .lease(LONG)
                .retention(LONG)
                .token(*token);
            let (claim, effect) = machine::begin(now, record, &request);
            (Output::of_claim(&claim), apply(effect))
        }
        Input::Complete { token, outcome } => {
            let (fenced, effect) = machine::complete(now, record, *token, outcome.clone(), LONG);
            (Output::of_fenced(&fenced), apply(effect))
        }
        Input::Release { token } => {
            let (fenced, effect) = machine::release(now, record, *token);
            (Output::of_fenced(&fenced), apply(effect))
        }
        Input::Extend { token } => {
            let (fenced, effect) = machine::extend(now, record, *token, LONG);
            (Output::of_fenced(&fenced), apply(effect))
        }
        Input::Get => (Output::of_record(machine::live(now, record)), record.cloned()),
    }
}

/// A set of operations (by index), as the memo table keys it.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Bits(Vec<u64>);

impl Bits {
    fn new(len: usize) -> Self {
        Self(vec![0; len.div_ceil(64)])
    }

    fn set(&mut self, i: usize) {
        self.0[i / 64] |= 1 << (i % 64);
    }

    fn clear(&mut self, i: usize) {
        self.0[i / 64] &= !(1 << (i % 64));
    }
}

/// Checks one key's history (every operation on the same scope and key); returns the number of
/// search steps it took.
///
/// # Errors
///
/// A [`Violation`] naming the operation no order could explain, or saying that the search ran
/// out of budget.
pub fn check(history: &[Operation]) -> Result<u64, Box<Violation>> {
    // A read whose answer was lost constrains nothing.
    let ops: Vec<&Operation> = history
        .iter()
        .filter(|op| op.output.is_some() || op.input != Input::Get)
        .collect();
    let Some(first) = ops.first() else {
        return Ok(0);
    };
    let (scope, key) = (&first.scope, &first.key);
    let n = ops.len();

    // Entries: a call and a return per operation, by time; an unanswered call returns after
    // everything else. Entry 2i is operation i's call, 2i + 1 its return.
    let mut order: Vec<usize> = (0..2 * n).collect();
    let is_call = |entry: usize| entry.is_multiple_of(2);
    let time = |entry: usize| {
        let op = ops[entry / 2];
        if is_call(entry) {
            op.called
        } else {
            op.returned.unwrap_or(u64::MAX)
        }
    };
    order.sort_by_key(|&entry| (time(entry), entry % 2));
    // A doubly linked list over the entries, in time order; `HEAD` is the sentinel.
    const END: usize = usize::MAX;
    let head = 2 * n;
    let mut next = vec![END; 2 * n + 1];
    let mut prev = vec![END; 2 * n + 1];
    let mut last = head;
    for &entry in &order {
        next[last] = entry;
        prev[entry] = last;
        last = entry;
    }
    let unlink = |next: &mut Vec<usize>, prev: &mut Vec<usize>, x: usize| {
        next[prev[x]] = next[x];
        if next[x] != END {
            prev[next[x]] = prev[x];
        }
    };
    let relink = |next: &mut Vec<usize>, prev: &mut Vec<usize>, x: usize| {
        next[prev[x]] = x;
        if next[x] != END {
            prev[next[x]] = x;
        }
    };

    let mut state: Option<Record> = None;
    let mut linearized = Bits::new(n);
    let mut count = 0usize;
    let mut memo: HashSet<(Bits, Option<Record>)> = HashSet::new();
    let mut stack: Vec<(usize, Option<Record>)> = Vec::new();
    let mut best: (usize, usize, Option<Record>) = (0, END, None);
    let mut steps = 0u64;
    let mut entry = next[head];
    while next[head] != END {
        steps += 1;
        if steps > SEARCH_BUDGET {
            return Err(violation(&ops, best, true));
        }
        if is_call(entry) {
            // A call: try to linearize it here.
            let op = ops[entry / 2];
            let (output, after) = step(state.as_ref(), scope, key, &op.input);
            let answers = op.output.as_ref().is_none_or(|seen| *seen == output);
            if answers {
                let mut with = linearized.clone();
                with.set(entry / 2);
                if memo.insert((with.clone(), after.clone())) {
                    stack.push((entry, std::mem::replace(&mut state, after)));
                    linearized = with;
                    count += 1;
                    unlink(&mut next, &mut prev, entry);
                    unlink(&mut next, &mut prev, entry + 1);
                    entry = next[head];
                    continue;
                }
            }
            entry = next[entry];
        } else {
            // A return whose call could not be placed before it: undo the last placement.
            if count >= best.0 && best.1 != entry {
                best = (count, entry, state.clone());
            }
            let Some((call, before)) = stack.pop() else {
                return Err(violation(&ops, best, false));
            };
            state = before;
            linearized.clear(call / 2);
            count -= 1;
            relink(&mut next, &mut prev, call + 1);
            relink(&mut next, &mut prev, call);
            entry = next[call];
        }
    }
    Ok(steps)
}

fn violation(ops: &[&Operation], best: (usize, usize, Option<Record>), undecided: bool) -> Box<Violation> {
    let (linearized, entry, model) = best;
    let stuck = ops[entry.min(2 * ops.len() - 1) / 2].clone();
    let end = stuck.returned.unwrap_or(u64::MAX);
    let concurrent = ops
        .iter()
        .filter(|op| op.called < end && op.returned.is_none_or(|returned| returned > stuck.called))
        .filter(|op| op.called != stuck.called)
        .take(16)
        .map(|op| (*op).clone())
        .collect();
    Box::new(Violation {
        linearized,
        stuck,
        concurrent,
        model,
        undecided,
    })
}

/// One client's memory of a key: the request of its last `begin`, the attempt it holds, and
/// tokens it held before (stale now, or soon).
struct Client {
    scope: Scope,
    key: Key,
    rng: SmallRng,
    last_begin: Option<BeginRequest>,
    held: Option<Held>,
    stale: Vec<Token>,
}

impl Client {
    fn holding(&self, token: Token) -> Held {
        crate::held(&self.scope, &self.key, token)
    }

    /// A token for `complete`, `release` or `extend`: mostly the one held, else a stale one,
    /// now and then one that never held anything, or the token of no attempt.
    fn some_token(&mut self) -> Token {
        match (self.rng.random_range(0..10), &self.held) {
            (0, _) => Token::NONE,
            (1, _) => Token::random(),
            (2..=7, Some(held)) => held.token,
            _ => self.stale.last().copied().unwrap_or_else(Token::random),
        }
    }

    fn drop_held(&mut self) {
        if let Some(held) = self.held.take() {
            self.stale.push(held.token);
            if self.stale.len() > 4 {
                self.stale.remove(0);
            }
        }
    }

    /// One random operation; `late` allows completing with the held token (only late in a
    /// history, so that most of it is spent in flight, where the races are).
    async fn act<S: Store>(&mut self, store: &S, late: bool) {
        let choice = self.rng.random_range(0..100);
        match choice {
            0..=29 => {
                // A request with the usual payload, or now and then another one.
                let payload: &[u8] = if self.rng.random_range(0..10) == 0 {
                    b"other"
                } else {
                    b"usual"
                };
                let request = BeginRequest::new(
                    self.scope.clone(),
                    self.key.clone(),
                    Fingerprint::of_bytes(payload),
                )
                .lease(LONG)
                .retention(LONG);
                self.begin(store, request).await;
            }
            30..=37 => {
                // A retried begin: the same token, as after a lost reply.
                let request = self.last_begin.clone().unwrap_or_else(|| {
                    BeginRequest::new(
                        self.scope.clone(),
                        self.key.clone(),
                        Fingerprint::of_bytes(b"usual"),
                    )
                    .lease(LONG)
                    .retention(LONG)
                });
                self.begin(store, request).await;
            }
            38..=51 => {
                let token = self.some_token();
                let held = self.holding(token);
                if let Ok(Fenced::Accepted(())) = store.release(&held).await
                    && self.held.as_ref().is_some_and(|h| h.token == held.token)
                {
                    self.drop_held();
                }
            }
            52..=61 => {
                let token = self.some_token();
                let held = self.holding(token);
                if let Ok(Fenced::LeaseLost) = store.extend(&held, LONG).await
                    && self.held.as_ref().is_some_and(|h| h.token == held.token)
                {
                    self.drop_held();
                }
            }
            62..=76 => {
                let _ = store.get(&self.scope, &self.key).await;
            }
            _ => {
                let token = match (&self.held, late && choice >= 95) {
                    (Some(held), true) => held.token,
                    _ => {
                        // Not the held token, unless late: a stale or unknown one.
                        let token = self.some_token();
                        if self.held.as_ref().is_some_and(|h| h.token == token) && !late {
                            Token::random()
                        } else {
                            token
                        }
                    }
                };
                let outcome = Outcome::new(format!("outcome {:08x}", self.rng.random::<u32>()));
                let result = if self.rng.random_range(0..3) == 0 {
                    // The batch call, now and then with a stale or unknown token beside it.
                    let mut batch = vec![Completion::new(self.holding(token), outcome, LONG)];
                    if self.rng.random() {
                        let other = self.some_token();
                        let outcome = Outcome::new(format!("beside {:08x}", self.rng.random::<u32>()));
                        batch.insert(
                            self.rng.random_range(0..2),
                            Completion::new(self.holding(other), outcome, LONG),
                        );
                    }
                    let position = batch
                        .iter()
                        .position(|c| c.held.token == token)
                        .expect("in the batch");
                    store.complete_many(&batch).await.swap_remove(position).map(drop)
                } else {
                    store
                        .complete(&self.holding(token), outcome, LONG)
                        .await
                        .map(drop)
                };
                if result.is_ok() && self.held.as_ref().is_some_and(|h| h.token == token) {
                    self.drop_held();
                }
            }
        }
    }

    async fn begin<S: Store>(&mut self, store: &S, request: BeginRequest) {
        let claims = match (self.rng.random_range(0..3), self.last_begin.clone()) {
            // The batch call, alone or after the client's earlier begin retried (the same key
            // twice in one batch: the first's answer comes before the second's).
            (0, Some(earlier)) if self.rng.random() => store.begin_many(&[earlier, request.clone()]).await,
            (0, _) => store.begin_many(std::slice::from_ref(&request)).await,
            _ => vec![store.begin(&request).await],
        };
        self.last_begin = Some(request);
        for claim in claims {
            if let Ok(Claim::Acquired(held)) = claim {
                if self.held.as_ref().is_some_and(|h| h.token != held.token) {
                    self.drop_held();
                }
                self.held = Some(held);
            }
        }
    }
}

/// Runs the workload on `store` (cutting its connections with `cutter`, if any) and returns
/// each key's history.
pub async fn run<S: Store + Clone + 'static>(
    store: S,
    cutter: Option<Arc<dyn Cutter>>,
    scale: Scale,
) -> (Vec<Vec<Operation>>, Summary) {
    let started = Instant::now();
    let recorder = Recorder::new(store);
    let scope = Scope::new("linearizability").expect("a valid scope");
    let seed: u64 = rand::random();
    let per_client = scale.operations.div_ceil(scale.clients);
    let mut cuts = 0;
    let mut keys = Vec::new();
    for group in 0..scale.histories.div_ceil(scale.at_once) {
        let group_keys: Vec<Key> = (0..scale.at_once)
            .map(|i| group * scale.at_once + i)
            .take_while(|i| *i < scale.histories)
            .map(|i| Key::new(format!("history-{i}")).expect("a valid key"))
            .collect();
        let done = Arc::new(AtomicUsize::new(0));
        let total = group_keys.len() * scale.clients * per_client;
        let mut tasks = Vec::new();
        for key in &group_keys {
            for client in 0..scale.clients {
                let (recorder, done) = (recorder.clone(), Arc::clone(&done));
                let mut client = Client {
                    scope: scope.clone(),
                    key: key.clone(),
                    rng: SmallRng::seed_from_u64(seed ^ (keys.len() * 64 + client) as u64),
                    last_begin: None,
                    held: None,
                    stale: Vec::new(),
                };
                tasks.push(tokio::spawn(async move {
                    for i in 0..per_client {
                        client.act(&recorder, i >= per_client * 4 / 5).await;
                        done.fetch_add(1, Ordering::Relaxed);
                        // A store that answers without waiting (memory) would otherwise run a
                        // client's calls back to back, never interleaved with the others'.
                        tokio::task::yield_now().await;
                    }
                }));
            }
        }
        // The cuts come at even steps of the group's progress, so they land mid-run however
        // fast the store is.
        if let Some(cutter) = &cutter {
            for cut in 1..=scale.cuts {
                let at = total * cut / (scale.cuts + 1);
                while done.load(Ordering::Relaxed) < at
                    && !tasks.iter().all(tokio::task::JoinHandle::is_finished)
                {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                cutter.cut().await;
                cuts += 1;
            }
        }
        for task in tasks {
            task.await
                .expect("a client of the linearizability check panicked");
        }
        keys.extend(group_keys);
    }
    let run = started.elapsed();
    let all = recorder.history();
    let histories: Vec<Vec<Operation>> = keys
        .iter()
        .map(|key| all.iter().filter(|op| &op.key == key).cloned().collect())
        .collect();
    let summary = Summary {
        histories: histories.len(),
        operations: all.len(),
        concurrent: histories.iter().map(|history| concurrent(history)).sum(),
        unanswered: all.iter().filter(|op| op.output.is_none()).count(),
        cuts,
        run,
        ..Summary::default()
    };
    (histories, summary)
}

/// How many operations of `history` overlap another one.
fn concurrent(history: &[Operation]) -> usize {
    let mut spans: Vec<(u64, u64)> = history
        .iter()
        .map(|op| (op.called, op.returned.unwrap_or(u64::MAX)))
        .collect();
    spans.sort_unstable();
    let mut overlapping = vec![false; spans.len()];
    let mut reach: Option<(u64, usize)> = None;
    for (i, &(called, returned)) in spans.iter().enumerate() {
        if let Some((end, owner)) = reach
            && called < end
        {
            overlapping[i] = true;
            overlapping[owner] = true;
        }
        if reach.is_none_or(|(end, _)| returned > end) {
            reach = Some((returned, i));
        }
    }
    overlapping.iter().filter(|o| **o).count()
}

/// Checks every history; panics with the first violation, naming the store.
///
/// # Panics
///
/// When a history is not linearizable, or the search could not decide.
pub fn check_all(what: &str, histories: &[Vec<Operation>], mut summary: Summary) -> Summary {
    let started = Instant::now();
    for (i, history) in histories.iter().enumerate() {
        match check(history) {
            Ok(steps) => summary.steps += steps,
            Err(violation) => {
                let mut text = String::new();
                let _ = write!(
                    text,
                    "{what}: history {i} ({} operations) is not linearizable: {violation}",
                    history.len()
                );
                panic!("{text}");
            }
        }
    }
    summary.check = started.elapsed();
    summary
}

/// The whole check on a store of `harness`: the workload at the harness's
/// [`Harness::linearizability`] scale, with connection cuts if the harness can make them, then
/// every history checked. Prints a one-line summary.
///
/// # Panics
///
/// When a history is not linearizable, or its search could not decide.
pub async fn check_harness<H: Harness>(harness: &H) -> Summary {
    let scale = harness.linearizability();
    let (store, cutter) = match harness.store_with_cuts().await {
        Some((store, cutter)) => (store, Some(Arc::from(cutter))),
        None => (harness.store().await, None),
    };
    let what = format!("{harness:?}");
    let (histories, summary) = run(store, cutter, scale).await;
    let summary = tokio::task::spawn_blocking(move || check_all(&what, &histories, summary))
        .await
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic.into_panic()));
    eprintln!(
        "linearizability: {} histories, {} operations ({} concurrent, {} unanswered, {} cuts), run {:.1} s, checked in {:.1} s ({} steps)",
        summary.histories,
        summary.operations,
        summary.concurrent,
        summary.unanswered,
        summary.cuts,
        summary.run.as_secs_f64(),
        summary.check.as_secs_f64(),
        summary.steps
    );
    summary
}
