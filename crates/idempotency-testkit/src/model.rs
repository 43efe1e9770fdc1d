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
    BeginRequest, Claim, Fenced, Fingerprint, Held, Key, ListFilter, ManualClock, MemoryStore, Outcome,
    Record, RecordState, RecordSummary, Scope, Stats, Store, StoreAdmin, SummaryState, Timestamp, Token,
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
    let shared = if harness.model_store_per_case() {
        None
    } else {
        Some(runtime.block_on(harness.store()))
    };
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
        runtime.block_on(async {
            match &shared {
                Some(store) => run_case(store, &time, case, &ops).await,
                None => run_case(&harness.store().await, &time, case, &ops).await,
            }
        })
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
    let mut twin = Twin::new(store, time, case);
    for (step, op) in ops.iter().enumerate() {
        twin.step(op)
            .await
            .map_err(|failure| TestCaseError::fail(format!("step {step}: {op:?}: {failure}")))?;
    }
    Ok(())
}

/// The store under test and the reference model, driven with the same operations on the same
/// records: every answer of the one must equal the other's (timestamps compared when the
/// harness controls the clock).
struct Twin<'s, S> {
    store: &'s S,
    time: &'s TimeControl,
    model: MemoryStore,
    model_clock: ManualClock,
    scope: Scope,
    keys: Vec<Key>,
    /// The token each client last used per key. Clients that never began hold a token nobody
    /// has.
    tokens: HashMap<(usize, usize), Token>,
    norm: Normalizer,
}

/// The unit of the model's short leases and retentions.
const UNIT: Duration = Duration::from_secs(10);

fn lease(short: bool) -> Duration {
    if short { UNIT } else { Duration::from_secs(600) }
}

fn retention(short: bool) -> Duration {
    if short {
        UNIT * 3
    } else {
        Duration::from_secs(7200)
    }
}

impl<'s, S: StoreAdmin> Twin<'s, S> {
    fn new(store: &'s S, time: &'s TimeControl, case: u64) -> Self {
        let model_clock = ManualClock::at(time.manual_now().unwrap_or(Timestamp::from_unix_millis(0)));
        Self {
            store,
            time,
            model: MemoryStore::with_clock(Arc::new(model_clock.clone())),
            model_clock,
            scope: Scope::new(format!("model-{}-{case}", Key::generate())).expect("scope"),
            keys: (0..KEYS)
                .map(|k| Key::new(format!("key-{k}")).expect("key"))
                .collect(),
            tokens: HashMap::new(),
            norm: Normalizer {
                exact: time.is_exact(),
            },
        }
    }

    /// Runs `op` on both; the failure says how they disagree.
    async fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Begin {
                client,
                key,
                payload,
                short_lease,
            } => {
                let token = Token::random();
                self.tokens.insert((client, key), token);
                self.begin(key, payload, token, lease(short_lease)).await
            }
            Op::RetryBegin { client, key, payload } => {
                let token = self.token(client, key);
                self.begin(key, payload, token, lease(false)).await
            }
            Op::Complete {
                client,
                key,
                outcome,
                short_retention,
            } => {
                let held = self.held(client, key);
                let outcome = Outcome::new(vec![outcome; usize::from(outcome % 5)]);
                let retention = retention(short_retention);
                let got = self.store.complete(&held, outcome.clone(), retention).await;
                let want = self.model.complete(&held, outcome, retention).await;
                prop_assert_eq!(
                    self.norm.fenced(store_ok(got)?),
                    self.norm.fenced(want.expect("model"))
                );
                Ok(())
            }
            Op::Release { client, key } => {
                let held = self.held(client, key);
                let (got, want) = (self.store.release(&held).await, self.model.release(&held).await);
                prop_assert_eq!(store_ok(got)?, want.expect("model"));
                Ok(())
            }
            Op::Extend {
                client,
                key,
                short_lease,
            } => {
                let held = self.held(client, key);
                let got = self.store.extend(&held, lease(short_lease)).await;
                let want = self.model.extend(&held, lease(short_lease)).await;
                prop_assert_eq!(
                    self.norm.fenced(store_ok(got)?),
                    self.norm.fenced(want.expect("model"))
                );
                Ok(())
            }
            Op::Get { key } => self.get(key).await,
            Op::Stats => self.stats().await,
            Op::List => self.list().await,
            Op::Advance { seconds } => {
                self.time.pass(Duration::from_secs(seconds)).await;
                self.model_clock.advance(Duration::from_secs(seconds));
                Ok(())
            }
        }
    }

    fn token(&mut self, client: usize, key: usize) -> Token {
        token_of(&mut self.tokens, client, key)
    }

    fn held(&mut self, client: usize, key: usize) -> Held {
        let token = self.token(client, key);
        crate::cases::held(&self.scope, &self.keys[key], token)
    }

    async fn begin(
        &self,
        key: usize,
        payload: u8,
        token: Token,
        lease: Duration,
    ) -> Result<(), TestCaseError> {
        let request = BeginRequest::new(self.scope.clone(), self.keys[key].clone(), payload_fp(payload))
            .token(token)
            .lease(lease)
            .retention(retention(false));
        let (got, want) = (self.store.begin(&request).await, self.model.begin(&request).await);
        prop_assert_eq!(
            self.norm.claim(store_ok(got)?),
            self.norm.claim(want.expect("model"))
        );
        Ok(())
    }

    async fn get(&self, key: usize) -> Result<(), TestCaseError> {
        let got = self.store.get(&self.scope, &self.keys[key]).await;
        let want = self.model.get(&self.scope, &self.keys[key]).await;
        prop_assert_eq!(
            store_ok(got)?.map(|r| self.norm.record(r)),
            want.expect("model").map(|r| self.norm.record(r))
        );
        Ok(())
    }

    async fn stats(&self) -> Result<(), TestCaseError> {
        let got = self.store.stats(Some(&self.scope)).await;
        let want = self.model.stats(Some(&self.scope)).await;
        let (got, want) = (
            self.norm.stats(store_ok(got)?),
            self.norm.stats(want.expect("model")),
        );
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
            )
        );
        Ok(())
    }

    async fn list(&self) -> Result<(), TestCaseError> {
        let filter = ListFilter::default().scope(self.scope.clone());
        let got = self.store.list(&filter).await;
        let want = self.model.list(&filter).await;
        let got: Vec<_> = store_ok(got)?.into_iter().map(|s| self.norm.summary(s)).collect();
        let want: Vec<_> = want
            .expect("model")
            .into_iter()
            .map(|s| self.norm.summary(s))
            .collect();
        prop_assert_eq!(got, want);
        Ok(())
    }
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
            Claim::Acquired(held) => Claim::Acquired(Held {
                lease_until: self.ts(held.lease_until),
                ..held
            }),
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
