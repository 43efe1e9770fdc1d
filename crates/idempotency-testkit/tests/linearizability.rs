//! The linearizability checker finds what it must: hand-made histories with a known verdict, and
//! a store whose `begin` reads, then writes (check-then-act), which no sequential test catches.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::machine::{self, Effect};
use idempotency_core::{
    BeginRequest, Claim, Clock, Fenced, Fingerprint, Held, Key, Outcome, Record, Scope, Store, StoreError,
    SystemClock, Timestamp, Token,
};
use idempotency_testkit::history::{Input, Operation, Output};
use idempotency_testkit::linearizability::{self, Scale};

fn scope() -> Scope {
    Scope::new("s").unwrap()
}

fn key() -> Key {
    Key::new("k").unwrap()
}

fn op(input: Input, output: Option<Output>, called: u64, returned: Option<u64>) -> Operation {
    Operation {
        scope: scope(),
        key: key(),
        input,
        output,
        called,
        returned,
    }
}

fn begin(token: u128) -> Input {
    Input::Begin {
        fingerprint: Fingerprint::of_bytes(b"p"),
        token: Token::from_u128(token),
    }
}

fn acquired(attempt: u32) -> Option<Output> {
    Some(Output::Acquired {
        attempt,
        recovered: attempt > 1,
    })
}

#[test]
fn a_sequential_history_of_the_model_is_linearizable() {
    let history = vec![
        op(begin(1), acquired(1), 0, Some(1)),
        op(begin(2), Some(Output::InFlight { attempt: 1 }), 2, Some(3)),
        op(
            Input::Release {
                token: Token::from_u128(1),
            },
            Some(Output::Accepted),
            4,
            Some(5),
        ),
        op(begin(2), acquired(2), 6, Some(7)),
        op(
            Input::Complete {
                token: Token::from_u128(1),
                outcome: Outcome::new("late"),
            },
            Some(Output::LeaseLost),
            8,
            Some(9),
        ),
    ];
    linearizability::check(&history).unwrap();
}

#[test]
fn two_overlapping_begins_that_both_acquire_are_not() {
    let history = vec![
        op(begin(1), acquired(1), 0, Some(3)),
        op(begin(2), acquired(1), 1, Some(2)),
    ];
    let violation = linearizability::check(&history).unwrap_err();
    assert!(!violation.undecided);
    assert_eq!(violation.linearized, 1, "{violation}");
}

#[test]
fn concurrent_calls_may_be_ordered_either_way() {
    // The second begin was called first but the first one's order explains the answers.
    let history = vec![
        op(begin(2), Some(Output::InFlight { attempt: 1 }), 0, Some(5)),
        op(begin(1), acquired(1), 1, Some(2)),
    ];
    linearizability::check(&history).unwrap();
}

#[test]
fn a_call_without_an_answer_may_have_taken_effect_or_not() {
    // The begin's answer was lost, and a later begin found the record held by it.
    let took_effect = vec![
        op(begin(1), None, 0, None),
        op(begin(2), Some(Output::InFlight { attempt: 1 }), 1, Some(2)),
    ];
    linearizability::check(&took_effect).unwrap();
    // Or it never arrived: the later begin acquired.
    let never = vec![op(begin(1), None, 0, None), op(begin(2), acquired(1), 1, Some(2))];
    linearizability::check(&never).unwrap();
}

#[test]
fn a_read_that_misses_a_completed_write_is_not() {
    let history = vec![
        op(begin(1), acquired(1), 0, Some(1)),
        op(Input::Get, Some(Output::Absent), 2, Some(3)),
    ];
    linearizability::check(&history).unwrap_err();
}

/// A store whose `begin` reads the record, lets other tasks run, then writes what it decided:
/// check-then-act. Every other operation is atomic. Sequential tests cannot tell it from the
/// reference model.
#[derive(Debug, Clone, Default)]
struct CheckThenAct {
    records: Arc<Mutex<HashMap<(Scope, Key), Record>>>,
}

impl CheckThenAct {
    fn now() -> Timestamp {
        SystemClock.now()
    }

    fn read(&self, scope: &Scope, key: &Key) -> Option<Record> {
        self.records
            .lock()
            .unwrap()
            .get(&(scope.clone(), key.clone()))
            .cloned()
    }

    fn write(&self, effect: Effect) {
        if let Effect::Put(record) = effect {
            self.records
                .lock()
                .unwrap()
                .insert((record.scope.clone(), record.key.clone()), record);
        }
    }

    /// An atomic transition, as the other operations have.
    fn atomically<T>(
        &self,
        held: &Held,
        decide: impl FnOnce(Timestamp, Option<&Record>) -> (T, Effect),
    ) -> T {
        let mut records = self.records.lock().unwrap();
        let slot = (held.scope.clone(), held.key.clone());
        let (answer, effect) = decide(Self::now(), records.get(&slot));
        if let Effect::Put(record) = effect {
            records.insert(slot, record);
        }
        answer
    }
}

#[async_trait]
impl Store for CheckThenAct {
    async fn begin(&self, request: &BeginRequest) -> Result<Claim, StoreError> {
        let seen = self.read(&request.scope, &request.key);
        // The window between the check and the act.
        tokio::time::sleep(Duration::from_micros(50)).await;
        let (claim, effect) = machine::begin(Self::now(), seen.as_ref(), request);
        self.write(effect);
        Ok(claim)
    }

    async fn complete(
        &self,
        held: &Held,
        outcome: Outcome,
        retention: Duration,
    ) -> Result<Fenced<Timestamp>, StoreError> {
        Ok(self.atomically(held, |now, record| {
            machine::complete(now, record, held.token, outcome, retention)
        }))
    }

    async fn release(&self, held: &Held) -> Result<Fenced<()>, StoreError> {
        Ok(self.atomically(held, |now, record| machine::release(now, record, held.token)))
    }

    async fn extend(&self, held: &Held, lease: Duration) -> Result<Fenced<Timestamp>, StoreError> {
        Ok(self.atomically(held, |now, record| {
            machine::extend(now, record, held.token, lease)
        }))
    }

    async fn get(&self, scope: &Scope, key: &Key) -> Result<Option<Record>, StoreError> {
        Ok(self
            .read(scope, key)
            .filter(|record| !record.is_expired(Self::now())))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_then_act_begin_is_caught() {
    let scale = Scale {
        histories: 5,
        operations: 400,
        ..Scale::default()
    };
    let (histories, _) = linearizability::run(CheckThenAct::default(), None, scale).await;
    let violation = histories
        .iter()
        .find_map(|history| linearizability::check(history).err())
        .expect("the check-then-act store passed the linearizability check");
    eprintln!("caught the check-then-act begin:\n{violation}");
    assert!(!violation.undecided);
}
