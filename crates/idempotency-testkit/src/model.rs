//! The model-based property test: random interleavings of operations from several clients,
//! applied to the store under test and to the in-memory reference model, with every answer
//! compared.
//!
//! Three clients work on two keys with two possible payloads; each remembers the token of its
//! last `begin` per key and uses it for `complete`, `release`, `extend` and retried `begin`s, so
//! the sequences exercise stale tokens, takeovers, mismatches and replays. With a manual clock,
//! time advances between operations and every timestamp must match the model's exactly; with a
//! real clock, leases are long, time is not advanced, and timestamps are compared only as
//! present or absent.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    BeginRequest, Claim, Fenced, Fingerprint, Key, ListFilter, ManualClock, MemoryStore, Outcome, Record,
    RecordState, RecordSummary, Scope, Stats, Store, StoreAdmin, SummaryState, Timestamp, Token,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use crate::{Harness, TimeControl};

/// The number of cases the suite runs by default.
pub const DEFAULT_CASES: u32 = 1000;

const CLIENTS: usize = 3;
const KEYS: usize = 2;

/// One step of a client.
#[derive(Debug, Clone)]
enum Op {
    Begin {
        client: usize,
        key: usize,
        payload: u8,
        short_lease: bool,
    },
    RetryBegin {
        client: usize,
        key: usize,
        payload: u8,
    },
    Complete {
        client: usize,
        key: usize,
        outcome: u8,
        short_retention: bool,
    },
    Release {
        client: usize,
        key: usize,
    },
    Extend {
        client: usize,
        key: usize,
        short_lease: bool,
    },
    Get {
        key: usize,
    },
    Stats,
    List,
    Advance {
        seconds: u64,
    },
}

fn op_strategy(exact: bool) -> BoxedStrategy<Op> {
    let client = 0..CLIENTS;
    let key = 0..KEYS;
    let payload = 0..2u8;
    // With a real clock nothing may expire during a sequence, so every duration is long.
    let short = if exact {
        any::<bool>().boxed()
    } else {
        Just(false).boxed()
    };
    let mut ops = vec![
        (
            3,
            (client.clone(), key.clone(), payload.clone(), short.clone())
                .prop_map(|(client, key, payload, short_lease)| Op::Begin {
                    client,
                    key,
                    payload,
                    short_lease,
                })
                .boxed(),
        ),
        (
            1,
            (client.clone(), key.clone(), payload)
                .prop_map(|(client, key, payload)| Op::RetryBegin { client, key, payload })
                .boxed(),
        ),
        (
            2,
            (client.clone(), key.clone(), any::<u8>(), short.clone())
                .prop_map(|(client, key, outcome, short_retention)| Op::Complete {
                    client,
                    key,
                    outcome,
                    short_retention,
                })
                .boxed(),
        ),
        (
            1,
            (client.clone(), key.clone())
                .prop_map(|(client, key)| Op::Release { client, key })
                .boxed(),
        ),
        (
            1,
            (client, key.clone(), short)
                .prop_map(|(client, key, short_lease)| Op::Extend {
                    client,
                    key,
                    short_lease,
                })
                .boxed(),
        ),
        (1, key.prop_map(|key| Op::Get { key }).boxed()),
        (1, Just(Op::Stats).boxed()),
        (1, Just(Op::List).boxed()),
    ];
    if exact {
        ops.push((2, (1..40u64).prop_map(|seconds| Op::Advance { seconds }).boxed()));
    }
    proptest::strategy::Union::new_weighted(ops).boxed()
}

/// Runs `cases` random sequences against a store from `harness` and the reference model, and
/// panics (with a shrunk counterexample) on the first difference.
///
/// This is a blocking function: it builds its own Tokio runtime, so call it from a plain
/// `#[test]`.
pub fn check_against_model<H: Harness>(harness: &H, cases: u32) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let store = runtime.block_on(harness.store());
    let time = harness.time();
    let exact = time.is_exact();
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let case = std::sync::atomic::AtomicU64::new(0);
    let strategy = proptest::collection::vec(op_strategy(exact), 1..40);
    let result = runner.run(&strategy, |ops| {
        let case = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        runtime.block_on(run_case(&store, &time, case, &ops))
    });
    if let Err(failure) = result {
        panic!("the store disagrees with the reference model: {failure}");
    }
}

async fn run_case<S: StoreAdmin>(
    store: &S,
    time: &TimeControl,
    case: u64,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let exact = time.is_exact();
    let scope = Scope::new(format!("model-{}-{case}", Key::generate())).expect("scope");
    let model_clock = ManualClock::at(time.manual_now().unwrap_or(Timestamp::from_unix_millis(0)));
    let model = MemoryStore::with_clock(Arc::new(model_clock.clone()));
    let keys: Vec<Key> = (0..KEYS)
        .map(|k| Key::new(format!("key-{k}")).expect("key"))
        .collect();
    // The token each client last used per key. Clients that never began hold a token nobody has.
    let mut tokens: HashMap<(usize, usize), Token> = HashMap::new();
    let unit = Duration::from_secs(10);
    let lease = |short: bool| if short { unit } else { Duration::from_secs(600) };
    let retention = |short: bool| {
        if short {
            unit * 3
        } else {
            Duration::from_secs(7200)
        }
    };
    let norm = Normalizer { exact };

    for (step, op) in ops.iter().enumerate() {
        let context = || format!("step {step}: {op:?}");
        match *op {
            Op::Begin {
                client,
                key,
                payload,
                short_lease,
            } => {
                let token = Token::random();
                tokens.insert((client, key), token);
                let request = BeginRequest::new(scope.clone(), keys[key].clone(), payload_fp(payload))
                    .token(token)
                    .lease(lease(short_lease))
                    .retention(retention(false));
                let (got, want) = (store.begin(&request).await, model.begin(&request).await);
                prop_assert_eq!(
                    norm.claim(store_ok(got)?),
                    norm.claim(want.expect("model")),
                    "{}",
                    context()
                );
            }
            Op::RetryBegin { client, key, payload } => {
                let token = token_of(&mut tokens, client, key);
                let request = BeginRequest::new(scope.clone(), keys[key].clone(), payload_fp(payload))
                    .token(token)
                    .lease(lease(false))
                    .retention(retention(false));
                let (got, want) = (store.begin(&request).await, model.begin(&request).await);
                prop_assert_eq!(
                    norm.claim(store_ok(got)?),
                    norm.claim(want.expect("model")),
                    "{}",
                    context()
                );
            }
            Op::Complete {
                client,
                key,
                outcome,
                short_retention,
            } => {
                let token = token_of(&mut tokens, client, key);
                let outcome = Outcome::new(vec![outcome; usize::from(outcome % 5)]);
                let retention = retention(short_retention);
                let got = store
                    .complete(&scope, &keys[key], token, outcome.clone(), retention)
                    .await;
                let want = model
                    .complete(&scope, &keys[key], token, outcome, retention)
                    .await;
                prop_assert_eq!(
                    norm.fenced(store_ok(got)?),
                    norm.fenced(want.expect("model")),
                    "{}",
                    context()
                );
            }
            Op::Release { client, key } => {
                let token = token_of(&mut tokens, client, key);
                let got = store.release(&scope, &keys[key], token).await;
                let want = model.release(&scope, &keys[key], token).await;
                prop_assert_eq!(store_ok(got)?, want.expect("model"), "{}", context());
            }
            Op::Extend {
                client,
                key,
                short_lease,
            } => {
                let token = token_of(&mut tokens, client, key);
                let got = store.extend(&scope, &keys[key], token, lease(short_lease)).await;
                let want = model.extend(&scope, &keys[key], token, lease(short_lease)).await;
                prop_assert_eq!(
                    norm.fenced(store_ok(got)?),
                    norm.fenced(want.expect("model")),
                    "{}",
                    context()
                );
            }
            Op::Get { key } => {
                let got = store.get(&scope, &keys[key]).await;
                let want = model.get(&scope, &keys[key]).await;
                prop_assert_eq!(
                    store_ok(got)?.map(|r| norm.record(r)),
                    want.expect("model").map(|r| norm.record(r)),
                    "{}",
                    context()
                );
            }
            Op::Stats => {
                let got = store.stats(Some(&scope)).await;
                let want = model.stats(Some(&scope)).await;
                let (got, want) = (norm.stats(store_ok(got)?), norm.stats(want.expect("model")));
                // A purged-or-not expired record is an implementation detail; live counts are not.
                prop_assert_eq!(
                    (
                        got.in_flight,
                        got.stale_leases,
                        got.completed,
                        got.oldest_in_flight
                    ),
                    (
                        want.in_flight,
                        want.stale_leases,
                        want.completed,
                        want.oldest_in_flight
                    ),
                    "{}",
                    context()
                );
            }
            Op::List => {
                let filter = ListFilter::default().scope(scope.clone());
                let got = store.list(&filter).await;
                let want = model.list(&filter).await;
                let got: Vec<_> = store_ok(got)?.into_iter().map(|s| norm.summary(s)).collect();
                let want: Vec<_> = want
                    .expect("model")
                    .into_iter()
                    .map(|s| norm.summary(s))
                    .collect();
                prop_assert_eq!(got, want, "{}", context());
            }
            Op::Advance { seconds } => {
                time.pass(Duration::from_secs(seconds)).await;
                model_clock.advance(Duration::from_secs(seconds));
            }
        }
    }
    Ok(())
}

/// A store error fails the case (and is shrunk like any other failure).
fn store_ok<T>(result: Result<T, idempotency_core::StoreError>) -> Result<T, TestCaseError> {
    result.map_err(|error| TestCaseError::fail(format!("store error: {error}")))
}

fn payload_fp(payload: u8) -> Fingerprint {
    Fingerprint::of_bytes(&[b'p', payload])
}

fn token_of(tokens: &mut HashMap<(usize, usize), Token>, client: usize, key: usize) -> Token {
    *tokens.entry((client, key)).or_insert_with(Token::random)
}

/// Erases timestamps when the clock is real (they cannot match the model's).
struct Normalizer {
    exact: bool,
}

impl Normalizer {
    fn ts(&self, t: Timestamp) -> Timestamp {
        if self.exact {
            t
        } else {
            Timestamp::from_unix_millis(0)
        }
    }

    fn claim(&self, claim: Claim) -> Claim {
        match claim {
            Claim::Acquired {
                token,
                attempt,
                recovered,
                lease_until,
            } => Claim::Acquired {
                token,
                attempt,
                recovered,
                lease_until: self.ts(lease_until),
            },
            Claim::InFlight { attempt, retry_after } => Claim::InFlight {
                attempt,
                retry_after: if self.exact { retry_after } else { Duration::ZERO },
            },
            Claim::Replay(mut done) => {
                done.completed_at = self.ts(done.completed_at);
                done.expires_at = self.ts(done.expires_at);
                Claim::Replay(done)
            }
            Claim::Mismatch => Claim::Mismatch,
        }
    }

    fn fenced(&self, fenced: Fenced<Timestamp>) -> Fenced<Timestamp> {
        match fenced {
            Fenced::Accepted(t) => Fenced::Accepted(self.ts(t)),
            Fenced::LeaseLost => Fenced::LeaseLost,
        }
    }

    fn record(&self, mut record: Record) -> Record {
        record.created_at = self.ts(record.created_at);
        record.expires_at = self.ts(record.expires_at);
        record.state = match record.state {
            RecordState::InFlight {
                token,
                acquired_at,
                lease_until,
            } => RecordState::InFlight {
                token,
                acquired_at: self.ts(acquired_at),
                lease_until: self.ts(lease_until),
            },
            RecordState::Completed {
                token,
                outcome,
                completed_at,
            } => RecordState::Completed {
                token,
                outcome,
                completed_at: self.ts(completed_at),
            },
        };
        record
    }

    fn summary(&self, mut summary: RecordSummary) -> RecordSummary {
        summary.created_at = self.ts(summary.created_at);
        summary.expires_at = self.ts(summary.expires_at);
        summary.state = match summary.state {
            SummaryState::InFlight {
                acquired_at,
                lease_until,
            } => SummaryState::InFlight {
                acquired_at: self.ts(acquired_at),
                lease_until: self.ts(lease_until),
            },
            SummaryState::Completed {
                completed_at,
                outcome_len,
            } => SummaryState::Completed {
                completed_at: self.ts(completed_at),
                outcome_len,
            },
        };
        summary
    }

    fn stats(&self, mut stats: Stats) -> Stats {
        if !self.exact {
            stats.oldest_in_flight = stats.oldest_in_flight.map(|_| Duration::ZERO);
        }
        stats
    }
}
