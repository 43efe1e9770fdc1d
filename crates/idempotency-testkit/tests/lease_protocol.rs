//! The lease protocol, checked exhaustively with [stateright](https://docs.rs/stateright): every
//! interleaving of a few workers, a store, a clock and a lossy network, within bounds.
//!
//! - **Workers** `begin` with a token of their own, run the side effect once they hold the
//!   record, heartbeat with `extend`, then `complete` (or `release` before the effect, as a
//!   handler that failed would). They crash at any step (their state is gone; they start again
//!   with a new token), and retry an operation whose answer never came, with the same token.
//!   An `InFlight` answer sends a worker back to start with a new token, as a consumer that
//!   nacks the message and gets it again.
//! - **The store** applies each request atomically through core's own [`machine`] functions
//!   (the store under test is `Transitions`: core's functions, or a mutant of them).
//! - **The clock** is logical: it advances a second at a time, past any lease.
//! - **The network** delivers requests and replies in any order, loses replies (a worker then
//!   retries), and delivers some requests twice.
//!
//! The properties are listed in [`PROPERTIES`] and [`LIMITS`]: the first must hold in every
//! reachable state; the second are what leases cannot promise, and the checker must find a
//! trace for each (`docs/PROTOCOL.md` explains them and their mitigations).
//!
//! `cargo nextest run -p idempotency-testkit --test lease_protocol --no-capture` prints the
//! figures (states, time) and the traces.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use idempotency_core::machine::{self, Effect};
use idempotency_core::{
    BeginRequest, Claim, Fenced, Fingerprint, Key, Outcome, Record, RecordState, Scope, Timestamp, Token,
};
use stateright::{Checker, HasDiscoveries, Model, Path, Property};

/// A lease is two ticks of the clock.
const LEASE: Duration = Duration::from_secs(2);
/// A completed record is kept three ticks.
const RETENTION: Duration = Duration::from_secs(3);

/// The properties that must hold in every reachable state.
const ONE_OUTCOME: &str = "at most one outcome is written per key incarnation";
const COMPLETED_STAYS: &str = "a completed outcome never changes until the record expires";
const FENCED: &str = "no complete, release or extend with a stale token changes anything";
const EXACT_REPLAY: &str = "a replay returns exactly the outcome that was written";
const NO_MISMATCH_RUN: &str = "a request with another payload never acquires the key";
const ENDS_COMPLETED: &str = "if a worker's completion is accepted, the key ends completed";
const PROPERTIES: [&str; 6] = [
    ONE_OUTCOME,
    COMPLETED_STAYS,
    FENCED,
    EXACT_REPLAY,
    NO_MISMATCH_RUN,
    ENDS_COMPLETED,
];

/// What leases cannot promise: the checker must find a trace for each.
const ONE_EFFECT: &str = "at most one attempt runs the side effect of a key incarnation";
const NO_OVERLAP: &str = "no two live attempts have run the side effect of one incarnation at once";
const LIMITS: [&str; 2] = [ONE_EFFECT, NO_OVERLAP];

/// What the reconcile hook adds: an attempt after the first asks whether the side effect
/// already happened before it runs it. It holds with a truthful hook; without one, or with one
/// that lies, the checker must find a trace.
const NO_BLIND_RERUN: &str = "no attempt runs the side effect of an incarnation whose side effect had happened when it acquired the key";
/// With a hook, the model must reach an adoption.
const REACHES_ADOPTION: &str =
    "an attempt adopts the outcome of a side effect that happened, and runs nothing";

/// What the model must be able to do at all (so that the properties are not true vacuously).
const REACHES_COMPLETION: &str = "a key ends completed";
const REACHES_TAKEOVER: &str = "an expired lease is taken over";
const REACHES_FENCING: &str =
    "two attempts ran the side effect after a lease expired, and the stale one's complete was refused";
const EXAMPLES: [&str; 3] = [REACHES_COMPLETION, REACHES_TAKEOVER, REACHES_FENCING];

/// The reconcile hook that attempts after the first ask before they run the side effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hook {
    /// None: the attempt runs (what a gateway without `--reconcile` does).
    None,
    /// It answers from the upstream's ledger: "it happened" exactly when a side effect of the
    /// incarnation ran; the attempt then adopts it and runs nothing.
    Truthful,
    /// It always answers "it did not happen".
    Lying,
}

/// The store's transitions.
trait Transitions: Clone + Send + Sync + 'static {
    fn begin(&self, now: Timestamp, record: Option<&Record>, request: &BeginRequest) -> (Claim, Effect) {
        machine::begin(now, record, request)
    }

    fn complete(
        &self,
        now: Timestamp,
        record: Option<&Record>,
        token: Token,
        outcome: Outcome,
    ) -> (Fenced<Timestamp>, Effect) {
        machine::complete(now, record, token, outcome, RETENTION)
    }

    fn release(&self, now: Timestamp, record: Option<&Record>, token: Token) -> (Fenced<()>, Effect) {
        machine::release(now, record, token)
    }

    fn extend(&self, now: Timestamp, record: Option<&Record>, token: Token) -> (Fenced<Timestamp>, Effect) {
        machine::extend(now, record, token, LEASE)
    }
}

/// Core's `machine`, as every store that decides in-process runs it.
#[derive(Clone)]
struct Core;

impl Transitions for Core {}

/// What each worker sends: a token (its bits), and for `complete` the outcome.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Op {
    Begin { token: u128 },
    Extend { token: u128 },
    Complete { token: u128, outcome: Vec<u8> },
    Release { token: u128 },
}

impl Op {
    fn token(&self) -> Token {
        match self {
            Self::Begin { token }
            | Self::Extend { token }
            | Self::Complete { token, .. }
            | Self::Release { token } => Token::from_u128(*token),
        }
    }
}

/// The store's answer, as the worker reads it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Answer {
    /// `incarnation` (the record's creation time) is for the checks, not the worker.
    Acquired {
        attempt: u32,
        incarnation: i64,
    },
    Replay {
        outcome: Vec<u8>,
    },
    InFlight,
    Mismatch,
    /// A `complete` accepted: the incarnation completed and its expiry (for the checks).
    Completed {
        incarnation: i64,
        expires_at: i64,
    },
    Accepted,
    LeaseLost,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Message {
    Request { worker: usize, op: Op },
    Reply { worker: usize, op: Op, answer: Answer },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Phase {
    /// Not holding the record: the next step is a `begin`.
    Idle,
    /// Holding the record of `incarnation` with `token`, the side effect run or not; `beat`
    /// says whether it sent a heartbeat since the clock last moved (one a tick at most).
    Holding {
        token: u128,
        incarnation: i64,
        effect_done: bool,
        beat: bool,
        /// A side effect of the incarnation had happened when it acquired the key, and it was
        /// not told so: running the side effect would run it again blind.
        blind: bool,
    },
    /// Finished: its own outcome recorded, a replay, or a mismatch.
    Done(End),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum End {
    Completed,
    Replayed,
    Mismatch,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Worker {
    /// Which payload it sends: workers with different payloads reuse the key.
    payload: u8,
    /// How many times it has started over (crash, release, lease lost, in flight): its token
    /// is derived from it, and the bound on it keeps the state space finite.
    generation: u8,
    phase: Phase,
    /// The request it waits for an answer to.
    pending: Option<Op>,
}

/// What the checks remember about the run (ghost state: no real component holds it).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
struct Ghost {
    /// Every outcome the store wrote, with the incarnation it completed.
    outcomes: Vec<(i64, Vec<u8>)>,
    /// Every side effect run: (incarnation, worker).
    effects: Vec<(i64, usize)>,
    /// The incarnation and expiry of a completion some worker was told was accepted.
    accepted: Option<(i64, Timestamp)>,
    /// Safety properties seen broken (by name).
    broken: Vec<&'static str>,
    /// An attempt after the first acquired the key.
    taken_over: bool,
    /// A `complete` was refused while another attempt held or had completed the record.
    stale_complete_refused: bool,
    /// An attempt adopted a side effect that had happened, from the hook.
    adopted: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    /// The logical clock, in seconds.
    now: u8,
    record: Option<Record>,
    workers: Vec<Worker>,
    /// A multiset, kept sorted so that the order of sending does not make states differ.
    network: Vec<Message>,
    losses_left: u8,
    duplicates_left: u8,
    crashes_left: u8,
    ghost: Ghost,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Action {
    Send(usize, Op),
    /// The store applies a request.
    Deliver(Message),
    /// The store applies a request that stays in the network, to be applied again.
    Duplicate(Message),
    Lose(Message),
    /// A reply reaches its worker.
    Receive(Message),
    /// A worker whose request or reply was lost sends the request again.
    Retry(usize),
    RunEffect(usize),
    Crash(usize),
    Tick,
}

/// The bounds of one check.
#[derive(Clone, Debug)]
struct Bounds {
    /// The payload of each worker.
    payloads: Vec<u8>,
    max_clock: u8,
    max_generations: u8,
    losses: u8,
    duplicates: u8,
    crashes: u8,
    hook: Hook,
}

struct Protocol<T> {
    transitions: T,
    bounds: Bounds,
}

fn scope() -> Scope {
    Scope::new("model").unwrap()
}

fn key() -> Key {
    Key::new("k").unwrap()
}

fn at(seconds: u8) -> Timestamp {
    Timestamp::from_unix_millis(i64::from(seconds) * 1000)
}

/// Worker `worker`'s token in its generation `generation`: distinct per worker and generation,
/// never [`Token::NONE`], and readable in traces (the high bits are what `Token`'s `Debug`
/// shows).
fn token(worker: usize, generation: u8) -> u128 {
    ((worker as u128 + 1) << 120) | ((u128::from(generation) + 1) << 64)
}

/// The outcome a worker completes with: who ran it, and in which generation.
fn outcome_of(worker: usize, generation: u8) -> Vec<u8> {
    format!("w{worker}g{generation}").into_bytes()
}

fn fingerprint(payload: u8) -> Fingerprint {
    Fingerprint::of_bytes(&[payload])
}

/// Whether `record` is in flight, held by `token` and live at `now`: the only case in which
/// `complete`, `release` and `extend` may write.
fn held_by(record: Option<&Record>, token: Token, now: Timestamp) -> bool {
    matches!(
        machine::live(now, record),
        Some(Record { state: RecordState::InFlight { token: held, .. }, .. }) if *held == token && token != Token::NONE
    )
}

impl<T: Transitions> Protocol<T> {
    fn new(transitions: T, bounds: Bounds) -> Self {
        Self { transitions, bounds }
    }

    /// Whether nothing more can happen.
    fn is_terminal(&self, state: &State) -> bool {
        let mut actions = Vec::new();
        self.actions(state, &mut actions);
        actions.is_empty()
    }

    /// The store applies `op` from `worker`: the answer, and the checks of the transition.
    fn apply(&self, state: &mut State, worker: usize, op: &Op) -> Answer {
        let now = at(state.now);
        let before = state.record.clone();
        let (answer, effect) = match op {
            Op::Begin { token } => {
                let request = BeginRequest::new(scope(), key(), fingerprint(state.workers[worker].payload))
                    .lease(LEASE)
                    .retention(RETENTION)
                    .token(Token::from_u128(*token));
                let (claim, effect) = self.transitions.begin(now, before.as_ref(), &request);
                let after = match &effect {
                    Effect::Put(record) => Some(record),
                    Effect::None => before.as_ref(),
                };
                let answer = match claim {
                    Claim::Acquired(held) => {
                        let record = after.expect("acquired without a record");
                        if record.fingerprint != request.fingerprint {
                            state.ghost.broken.push(NO_MISMATCH_RUN);
                        }
                        state.ghost.taken_over |= held.attempt > 1;
                        Answer::Acquired {
                            attempt: held.attempt,
                            incarnation: record.created_at.unix_millis(),
                        }
                    }
                    Claim::Replay(completed) => {
                        let incarnation = before.as_ref().map_or(-1, |r| r.created_at.unix_millis());
                        let written = state
                            .ghost
                            .outcomes
                            .iter()
                            .find(|(i, _)| *i == incarnation)
                            .map(|(_, o)| o.as_slice());
                        if written != Some(completed.outcome.as_bytes()) {
                            state.ghost.broken.push(EXACT_REPLAY);
                        }
                        Answer::Replay {
                            outcome: completed.outcome.as_bytes().to_vec(),
                        }
                    }
                    Claim::InFlight { .. } => Answer::InFlight,
                    Claim::Mismatch => Answer::Mismatch,
                };
                (answer, effect)
            }
            Op::Complete { token, outcome } => {
                let (fenced, effect) = self.transitions.complete(
                    now,
                    before.as_ref(),
                    Token::from_u128(*token),
                    Outcome::new(outcome.clone()),
                );
                let other_holder = match machine::live(now, before.as_ref()).map(|r| &r.state) {
                    Some(
                        RecordState::InFlight { token: held, .. }
                        | RecordState::Completed { token: held, .. },
                    ) => held.as_u128() != *token && *held != Token::NONE,
                    None => false,
                };
                state.ghost.stale_complete_refused |= fenced.is_lease_lost() && other_holder;
                let answer = match fenced {
                    Fenced::Accepted(expires_at) => Answer::Completed {
                        incarnation: match &effect {
                            Effect::Put(record) => record.created_at.unix_millis(),
                            Effect::None => before.as_ref().map_or(-1, |r| r.created_at.unix_millis()),
                        },
                        expires_at: expires_at.unix_millis(),
                    },
                    Fenced::LeaseLost => Answer::LeaseLost,
                };
                (answer, effect)
            }
            Op::Release { token } => {
                let (fenced, effect) =
                    self.transitions
                        .release(now, before.as_ref(), Token::from_u128(*token));
                (fenced_answer(fenced.is_lease_lost()), effect)
            }
            Op::Extend { token } => {
                let (fenced, effect) =
                    self.transitions
                        .extend(now, before.as_ref(), Token::from_u128(*token));
                (fenced_answer(fenced.is_lease_lost()), effect)
            }
        };
        let Effect::Put(after) = effect else {
            return answer;
        };
        if !matches!(op, Op::Begin { .. }) && !held_by(before.as_ref(), op.token(), now) {
            state.ghost.broken.push(FENCED);
        }
        if let Some(old) = machine::live(now, before.as_ref())
            && matches!(old.state, RecordState::Completed { .. })
            && *old != after
        {
            state.ghost.broken.push(COMPLETED_STAYS);
        }
        if let RecordState::Completed { outcome, .. } = &after.state {
            let incarnation = after.created_at.unix_millis();
            let newly = !matches!(
                &before,
                Some(old) if old.created_at == after.created_at && matches!(old.state, RecordState::Completed { .. })
            );
            if newly {
                if state.ghost.outcomes.iter().any(|(i, _)| *i == incarnation) {
                    state.ghost.broken.push(ONE_OUTCOME);
                }
                state
                    .ghost
                    .outcomes
                    .push((incarnation, outcome.as_bytes().to_vec()));
            }
        }
        state.record = Some(after);
        answer
    }

    /// The store applies the request `message` and sends its reply.
    fn deliver(&self, state: &mut State, message: &Message) {
        let Message::Request { worker, op } = message else {
            unreachable!("only requests are delivered to the store")
        };
        let answer = self.apply(state, *worker, op);
        state.network.push(Message::Reply {
            worker: *worker,
            op: op.clone(),
            answer,
        });
    }

    /// `worker` reads the answer to `op`, if it still waits for it. An attempt after the first
    /// asks the hook (atomically with reading the answer: the hook reads the upstream's ledger
    /// of side effects, the ghost's `effects`).
    fn receive(&self, state: &mut State, worker: usize, op: &Op, answer: &Answer) {
        let happened = matches!(
            answer,
            Answer::Acquired { attempt, incarnation }
                if *attempt > 1 && state.ghost.effects.iter().any(|(i, _)| i == incarnation)
        );
        let adopted = happened && self.bounds.hook == Hook::Truthful;
        let w = &mut state.workers[worker];
        if w.pending.as_ref() != Some(op) {
            // An answer to a request it no longer waits for (a duplicate, or from before a
            // crash): nobody reads it.
            return;
        }
        w.pending = None;
        match (op, answer) {
            (Op::Begin { token }, Answer::Acquired { incarnation, .. }) => {
                // An adopted outcome is the side effect's: the attempt completes with it.
                w.phase = Phase::Holding {
                    token: *token,
                    incarnation: *incarnation,
                    effect_done: adopted,
                    beat: true,
                    blind: happened && !adopted,
                };
                state.ghost.adopted |= adopted;
            }
            (Op::Begin { .. }, Answer::Replay { .. }) => w.phase = Phase::Done(End::Replayed),
            (Op::Begin { .. }, Answer::Mismatch) => w.phase = Phase::Done(End::Mismatch),
            // In flight elsewhere: begin again later. The token is the same: it acquired
            // nothing, so a new one would make no difference but more states.
            (Op::Begin { .. }, Answer::InFlight) => w.phase = Phase::Idle,
            (
                Op::Complete { .. },
                Answer::Completed {
                    incarnation,
                    expires_at,
                },
            ) => {
                w.phase = Phase::Done(End::Completed);
                state.ghost.accepted = Some((*incarnation, Timestamp::from_unix_millis(*expires_at)));
            }
            // Extended: the handler goes on. Refused: it goes on too, and its `complete` will
            // be refused.
            (Op::Extend { .. }, _) => {}
            // Released, or its lease lost: start over with a new token.
            _ => {
                w.phase = Phase::Idle;
                w.generation += 1;
            }
        }
    }
}

fn fenced_answer(lease_lost: bool) -> Answer {
    if lease_lost {
        Answer::LeaseLost
    } else {
        Answer::Accepted
    }
}

impl<T: Transitions> Model for Protocol<T> {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            now: 0,
            record: None,
            workers: self
                .bounds
                .payloads
                .iter()
                .map(|payload| Worker {
                    payload: *payload,
                    generation: 0,
                    phase: Phase::Idle,
                    pending: None,
                })
                .collect(),
            network: Vec::new(),
            losses_left: self.bounds.losses,
            duplicates_left: self.bounds.duplicates,
            crashes_left: self.bounds.crashes,
            ghost: Ghost::default(),
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        if state.now < self.bounds.max_clock {
            actions.push(Action::Tick);
        }
        for (index, worker) in state.workers.iter().enumerate() {
            if matches!(worker.phase, Phase::Done(_)) || worker.generation >= self.bounds.max_generations {
                continue;
            }
            if state.crashes_left > 0 {
                actions.push(Action::Crash(index));
            }
            if worker.pending.is_some() {
                let in_network = state.network.iter().any(|message| match message {
                    Message::Request { worker, .. } | Message::Reply { worker, .. } => *worker == index,
                });
                if !in_network {
                    actions.push(Action::Retry(index));
                }
                continue;
            }
            match &worker.phase {
                Phase::Idle => actions.push(Action::Send(
                    index,
                    Op::Begin {
                        token: token(index, worker.generation),
                    },
                )),
                Phase::Holding {
                    token,
                    effect_done,
                    beat,
                    ..
                } => {
                    if !*beat {
                        actions.push(Action::Send(index, Op::Extend { token: *token }));
                    }
                    if *effect_done {
                        actions.push(Action::Send(
                            index,
                            Op::Complete {
                                token: *token,
                                outcome: outcome_of(index, worker.generation),
                            },
                        ));
                    } else {
                        actions.push(Action::RunEffect(index));
                        // The handler failed before its side effect.
                        actions.push(Action::Send(index, Op::Release { token: *token }));
                    }
                }
                Phase::Done(_) => {}
            }
        }
        let mut seen: Option<&Message> = None;
        for message in &state.network {
            // Equal messages lead to equal states.
            if seen == Some(message) {
                continue;
            }
            seen = Some(message);
            match message {
                Message::Request { .. } => {
                    actions.push(Action::Deliver(message.clone()));
                    if state.duplicates_left > 0 {
                        actions.push(Action::Duplicate(message.clone()));
                    }
                }
                Message::Reply { .. } => actions.push(Action::Receive(message.clone())),
            }
            // Only replies are lost: a lost request is the same as one not sent yet (the worker
            // sends it again), and a request applied twice is a duplicate.
            if state.losses_left > 0 && matches!(message, Message::Reply { .. }) {
                actions.push(Action::Lose(message.clone()));
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        let take = |state: &mut State, message: &Message| {
            let index = state
                .network
                .iter()
                .position(|m| m == message)
                .expect("a message in the network");
            state.network.remove(index);
        };
        match action {
            Action::Tick => {
                state.now += 1;
                for worker in &mut state.workers {
                    if let Phase::Holding { beat, .. } = &mut worker.phase {
                        *beat = false;
                    }
                }
            }
            Action::Send(worker, op) => {
                if let (Op::Extend { .. }, Phase::Holding { beat, .. }) =
                    (&op, &mut state.workers[worker].phase)
                {
                    *beat = true;
                }
                state.workers[worker].pending = Some(op.clone());
                state.network.push(Message::Request { worker, op });
            }
            Action::Retry(worker) => {
                let op = state.workers[worker].pending.clone().expect("a pending request");
                state.network.push(Message::Request { worker, op });
            }
            Action::Deliver(message) => {
                take(&mut state, &message);
                self.deliver(&mut state, &message);
            }
            Action::Duplicate(message) => {
                // The request stays, to be applied a second time.
                state.duplicates_left -= 1;
                self.deliver(&mut state, &message);
            }
            Action::Lose(message) => {
                take(&mut state, &message);
                state.losses_left -= 1;
            }
            Action::Receive(message) => {
                take(&mut state, &message);
                let Message::Reply { worker, op, answer } = &message else {
                    unreachable!("only replies are received")
                };
                self.receive(&mut state, *worker, op, answer);
            }
            Action::RunEffect(worker) => {
                let Phase::Holding {
                    incarnation,
                    effect_done,
                    blind,
                    ..
                } = &mut state.workers[worker].phase
                else {
                    unreachable!("only a holder runs the side effect")
                };
                *effect_done = true;
                if *blind {
                    state.ghost.broken.push(NO_BLIND_RERUN);
                }
                state.ghost.effects.push((*incarnation, worker));
            }
            Action::Crash(worker) => {
                state.crashes_left -= 1;
                let w = &mut state.workers[worker];
                w.phase = Phase::Idle;
                w.pending = None;
                w.generation += 1;
            }
        }
        state.network.sort();
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(ONE_OUTCOME, |_, s: &State| !s.ghost.broken.contains(&ONE_OUTCOME)),
            Property::always(COMPLETED_STAYS, |_, s: &State| {
                !s.ghost.broken.contains(&COMPLETED_STAYS)
            }),
            Property::always(FENCED, |_, s: &State| !s.ghost.broken.contains(&FENCED)),
            Property::always(EXACT_REPLAY, |_, s: &State| {
                !s.ghost.broken.contains(&EXACT_REPLAY)
            }),
            Property::always(NO_MISMATCH_RUN, |_, s: &State| {
                !s.ghost.broken.contains(&NO_MISMATCH_RUN)
            }),
            // Liveness within the bounds: a state from which nothing more can happen (every
            // worker finished or out of tries, the clock at its end) keeps the accepted outcome,
            // unless its retention is over.
            Property::always(ENDS_COMPLETED, |model: &Self, s: &State| {
                let Some((incarnation, expires_at)) = s.ghost.accepted else {
                    return true;
                };
                let completed = matches!(
                    &s.record,
                    Some(record) if record.created_at.unix_millis() == incarnation
                        && matches!(record.state, RecordState::Completed { .. })
                );
                completed || at(s.now) >= expires_at || !model.is_terminal(s)
            }),
            Property::always(ONE_EFFECT, |_, s: &State| {
                let effects = &s.ghost.effects;
                effects.iter().enumerate().all(|(i, (incarnation, _))| {
                    effects[i + 1..].iter().all(|(other, _)| other != incarnation)
                })
            }),
            Property::always(NO_OVERLAP, |_, s: &State| {
                let running: Vec<i64> = s
                    .workers
                    .iter()
                    .filter_map(|w| match w.phase {
                        Phase::Holding {
                            incarnation,
                            effect_done: true,
                            ..
                        } => Some(incarnation),
                        _ => None,
                    })
                    .collect();
                running
                    .iter()
                    .enumerate()
                    .all(|(i, incarnation)| !running[i + 1..].contains(incarnation))
            }),
            Property::sometimes(REACHES_COMPLETION, |_, s: &State| {
                matches!(
                    &s.record,
                    Some(Record {
                        state: RecordState::Completed { .. },
                        ..
                    })
                )
            }),
            Property::always(NO_BLIND_RERUN, |_, s: &State| {
                !s.ghost.broken.contains(&NO_BLIND_RERUN)
            }),
            Property::sometimes(REACHES_TAKEOVER, |_, s: &State| s.ghost.taken_over),
            Property::sometimes(REACHES_ADOPTION, |_, s: &State| s.ghost.adopted),
            Property::sometimes(REACHES_FENCING, |_, s: &State| {
                let effects = &s.ghost.effects;
                s.ghost.stale_complete_refused
                    && effects.iter().enumerate().any(|(i, (incarnation, _))| {
                        effects[i + 1..].iter().any(|(other, _)| other == incarnation)
                    })
            }),
        ]
    }
}

/// What a check found.
struct Report {
    states: usize,
    max_depth: usize,
    elapsed: Duration,
    discoveries: std::collections::HashMap<&'static str, Path<State, Action>>,
}

impl Report {
    fn trace(&self, property: &str) -> Option<String> {
        self.discoveries
            .iter()
            .find(|(name, _)| **name == property)
            .map(|(_, path)| describe(path))
    }

    fn figures(&self, what: &str) -> String {
        format!(
            "{what}: {} states, depth {}, {:.1} s",
            self.states,
            self.max_depth,
            self.elapsed.as_secs_f64()
        )
    }
}

/// Checks every reachable state of `transitions` within `bounds`, breadth first (so that each
/// trace found is a shortest one), or until `until` is found broken.
fn check<T: Transitions>(transitions: T, bounds: Bounds, until: Option<&'static str>) -> Report {
    let started = Instant::now();
    let mut builder = Protocol::new(transitions, bounds).checker().threads(2);
    if let Some(property) = until {
        builder = builder.finish_when(HasDiscoveries::AnyOf([property].into()));
    }
    let checker = builder.spawn_bfs().join();
    Report {
        states: checker.unique_state_count(),
        max_depth: checker.max_depth(),
        elapsed: started.elapsed(),
        discoveries: checker.discoveries(),
    }
}

/// A shortest trace that breaks `property` (or shows it, for an example), found by checking
/// ever deeper: the checker keeps the last of the traces it finds, not the shortest.
fn shortest<T: Transitions>(transitions: &T, bounds: &Bounds, property: &'static str) -> String {
    for depth in 2..=64 {
        let checker = Protocol::new(transitions.clone(), bounds.clone())
            .checker()
            .threads(2)
            .target_max_depth(depth)
            .finish_when(HasDiscoveries::AnyOf([property].into()))
            .spawn_bfs()
            .join();
        if let Some(path) = checker.discovery(property) {
            return describe(&path);
        }
    }
    panic!("no trace of \"{property}\" within 64 steps")
}

/// `w1g0` for worker 1's token of its generation 0.
fn token_name(token: u128) -> String {
    if token == 0 {
        return "none".into();
    }
    format!("w{}g{}", (token >> 120) - 1, ((token >> 64) & 0xff) - 1)
}

fn op_name(op: &Op) -> String {
    match op {
        Op::Begin { token } => format!("begin({})", token_name(*token)),
        Op::Extend { token } => format!("extend({})", token_name(*token)),
        Op::Complete { token, outcome } => format!(
            "complete({}, {:?})",
            token_name(*token),
            String::from_utf8_lossy(outcome)
        ),
        Op::Release { token } => format!("release({})", token_name(*token)),
    }
}

fn record_name(record: Option<&Record>) -> String {
    match record {
        None => "no record".into(),
        Some(record) => {
            let state = match &record.state {
                RecordState::InFlight {
                    token, lease_until, ..
                } => format!(
                    "in flight, held by {}, lease until t={}",
                    token_name(token.as_u128()),
                    lease_until.unix_millis() / 1000
                ),
                RecordState::Completed { token, outcome, .. } => format!(
                    "completed by {} with {:?}",
                    token_name(token.as_u128()),
                    String::from_utf8_lossy(outcome.as_bytes())
                ),
            };
            format!(
                "attempt {}, {state}, expires t={}",
                record.attempt,
                record.expires_at.unix_millis() / 1000
            )
        }
    }
}

/// A trace, a numbered line per step: the action, then what the store holds after it.
fn describe(path: &Path<State, Action>) -> String {
    let mut text = String::new();
    let steps = path.clone().into_vec();
    let mut step = 0;
    for (before, action) in &steps {
        let Some(action) = action else { continue };
        step += 1;
        let line = match action {
            Action::Tick => format!("clock t={} -> t={}", before.now, before.now + 1),
            Action::Send(worker, op) => format!("worker {worker} sends {}", op_name(op)),
            Action::Retry(worker) => format!(
                "worker {worker} got no answer and sends {} again",
                before.workers[*worker]
                    .pending
                    .as_ref()
                    .map_or_else(String::new, op_name)
            ),
            Action::Deliver(Message::Request { worker, op }) => {
                format!("store applies worker {worker}'s {}", op_name(op))
            }
            Action::Duplicate(Message::Request { worker, op }) => format!(
                "store applies worker {worker}'s {} (the network will deliver it again)",
                op_name(op)
            ),
            Action::Receive(Message::Reply { worker, op, answer }) => {
                format!("worker {worker} reads {answer:?} for {}", op_name(op))
            }
            Action::Lose(Message::Request { worker, op }) => {
                format!("network loses worker {worker}'s {}", op_name(op))
            }
            Action::Lose(Message::Reply { worker, op, answer }) => format!(
                "network loses the reply {answer:?} to worker {worker}'s {}",
                op_name(op)
            ),
            Action::RunEffect(worker) => format!("worker {worker} RUNS THE SIDE EFFECT"),
            Action::Crash(worker) => format!("worker {worker} crashes"),
            other => format!("{other:?}"),
        };
        let _ = writeln!(text, "{step:>3}. {line}");
    }
    let last = path.last_state();
    let _ = writeln!(text, "     store: {}", record_name(last.record.as_ref()));
    if !last.ghost.broken.is_empty() {
        let _ = writeln!(text, "     broken: {:?}", last.ghost.broken);
    }
    text
}

/// Two workers with one payload: a lost reply, a crash, four ticks of the clock (two leases;
/// records expire within the run).
fn two_workers_crashing() -> Bounds {
    Bounds {
        payloads: vec![0, 0],
        max_clock: 4,
        max_generations: 2,
        losses: 1,
        duplicates: 0,
        crashes: 1,
        hook: Hook::None,
    }
}

/// Two workers with one payload: a lost reply and a request applied twice (a retry whose
/// first copy was still on its way), over three ticks.
fn two_workers_duplicating() -> Bounds {
    Bounds {
        payloads: vec![0, 0],
        max_clock: 3,
        max_generations: 2,
        losses: 1,
        duplicates: 1,
        crashes: 0,
        hook: Hook::None,
    }
}

/// Three workers, the third reusing the key with another payload: a lost reply and a crash.
fn three_workers() -> Bounds {
    Bounds {
        payloads: vec![0, 0, 1],
        max_clock: 4,
        max_generations: 1,
        losses: 1,
        duplicates: 0,
        crashes: 1,
        hook: Hook::None,
    }
}

/// Checks `transitions` within `bounds`; panics (with a shortest trace) unless every property
/// holds, every limit has a trace and every example was reached.
fn assert_checked<T: Transitions>(transitions: &T, bounds: &Bounds, what: &str) {
    let report = check(transitions.clone(), bounds.clone(), None);
    eprintln!("{}", report.figures(what));
    // Without a truthful hook, an attempt after the first runs the side effect blind.
    let (hook_holds, hook_limits, hook_examples): (&[&'static str], &[&'static str], &[&'static str]) =
        match bounds.hook {
            Hook::Truthful => (&[NO_BLIND_RERUN], &[], &[REACHES_ADOPTION]),
            Hook::None | Hook::Lying => (&[], &[NO_BLIND_RERUN], &[]),
        };
    for property in PROPERTIES.iter().chain(hook_holds).copied() {
        if report.trace(property).is_some() {
            let trace = shortest(transitions, bounds, property);
            panic!("{what}: \"{property}\" is broken:\n{trace}");
        }
    }
    for example in EXAMPLES.iter().chain(hook_examples) {
        assert!(
            report.trace(example).is_some(),
            "{what}: the model never reaches \"{example}\": the properties may hold vacuously"
        );
    }
    for limit in LIMITS.iter().chain(hook_limits) {
        assert!(
            report.trace(limit).is_some(),
            "{what}: no trace breaks \"{limit}\""
        );
    }
}

#[test]
fn core_machine_keeps_every_property_with_crashes_and_lost_replies() {
    assert_checked(&Core, &two_workers_crashing(), "two workers, crash");
    // The limits, in their shortest form, and fencing at work after them.
    for limit in LIMITS.into_iter().chain([REACHES_FENCING]) {
        let trace = shortest(&Core, &two_workers_crashing(), limit);
        eprintln!("the limit \"{limit}\":\n{trace}");
    }
}

/// The reconcile hook: with a truthful one, no attempt after the first runs the side effect of
/// an incarnation whose side effect had happened (it adopts it instead); what is left of the
/// limits is two attempts running at once, after a lease expired under a live one.
#[test]
fn a_truthful_reconcile_hook_never_runs_a_side_effect_again_blind() {
    let bounds = Bounds {
        hook: Hook::Truthful,
        ..two_workers_crashing()
    };
    assert_checked(&Core, &bounds, "two workers, crash, truthful hook");
    let trace = shortest(&Core, &two_workers_crashing(), NO_BLIND_RERUN);
    eprintln!("without the hook, \"{NO_BLIND_RERUN}\" is broken:\n{trace}");
    let trace = shortest(&Core, &bounds, REACHES_ADOPTION);
    eprintln!("with the hook, \"{REACHES_ADOPTION}\":\n{trace}");
}

#[test]
fn a_reconcile_hook_that_lies_is_caught() {
    let bounds = Bounds {
        hook: Hook::Lying,
        ..two_workers_crashing()
    };
    assert_caught(
        &Core,
        &bounds,
        "a hook that says nothing happened",
        NO_BLIND_RERUN,
    );
}

#[test]
fn core_machine_keeps_every_property_with_requests_applied_twice() {
    assert_checked(&Core, &two_workers_duplicating(), "two workers, duplicate");
}

#[test]
fn core_machine_keeps_every_property_with_three_workers_and_a_reused_key() {
    assert_checked(&Core, &three_workers(), "three workers");
}

/// Panics unless the checker finds `property` broken by `mutant`; prints a shortest trace.
fn assert_caught<T: Transitions>(mutant: &T, bounds: &Bounds, what: &str, property: &'static str) {
    let report = check(mutant.clone(), bounds.clone(), Some(property));
    eprintln!("{}", report.figures(what));
    assert!(
        report.trace(property).is_some(),
        "the mutant \"{what}\" was not caught: \"{property}\" holds"
    );
    let trace = shortest(mutant, bounds, property);
    eprintln!("{what}: \"{property}\" is broken:\n{trace}");
}

/// `complete` without the token check: whoever holds the record, the outcome is written.
#[derive(Clone)]
struct CompleteIgnoresToken;

impl Transitions for CompleteIgnoresToken {
    fn complete(
        &self,
        now: Timestamp,
        record: Option<&Record>,
        _token: Token,
        outcome: Outcome,
    ) -> (Fenced<Timestamp>, Effect) {
        let holder = match machine::live(now, record).map(|r| &r.state) {
            Some(RecordState::InFlight { token, .. } | RecordState::Completed { token, .. }) => *token,
            None => Token::NONE,
        };
        machine::complete(now, record, holder, outcome, RETENTION)
    }
}

#[test]
fn a_complete_without_its_token_check_is_caught() {
    assert_caught(
        &CompleteIgnoresToken,
        &two_workers_crashing(),
        "complete without the token check",
        FENCED,
    );
}

/// A takeover that ignores the fingerprint: an expired lease goes to any payload.
#[derive(Clone)]
struct TakeoverIgnoresFingerprint;

impl Transitions for TakeoverIgnoresFingerprint {
    fn begin(&self, now: Timestamp, record: Option<&Record>, request: &BeginRequest) -> (Claim, Effect) {
        if let Some(live) = machine::live(now, record)
            && let RecordState::InFlight { lease_until, .. } = live.state
            && now >= lease_until
        {
            let mut request = request.clone();
            request.fingerprint = live.fingerprint;
            return machine::begin(now, record, &request);
        }
        machine::begin(now, record, request)
    }
}

#[test]
fn a_takeover_that_ignores_the_fingerprint_is_caught() {
    assert_caught(
        &TakeoverIgnoresFingerprint,
        &three_workers(),
        "takeover ignoring the fingerprint",
        NO_MISMATCH_RUN,
    );
}

/// `release` of a record whoever holds it.
#[derive(Clone)]
struct ReleaseIgnoresToken;

impl Transitions for ReleaseIgnoresToken {
    fn release(&self, now: Timestamp, record: Option<&Record>, token: Token) -> (Fenced<()>, Effect) {
        match machine::live(now, record).map(|r| &r.state) {
            Some(RecordState::InFlight { token: holder, .. }) if *holder != Token::NONE => {
                machine::release(now, record, *holder)
            }
            _ => machine::release(now, record, token),
        }
    }
}

#[test]
fn a_release_of_a_record_another_token_holds_is_caught() {
    assert_caught(
        &ReleaseIgnoresToken,
        &two_workers_crashing(),
        "release ignoring the token",
        FENCED,
    );
}
