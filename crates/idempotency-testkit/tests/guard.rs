//! The guard's protocol: run once, replay, in flight, mismatch, release, panic, heartbeat,
//! fencing, store failures and metrics. Time is Tokio's paused clock, which the store also reads,
//! so leases of minutes pass instantly.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotency_core::{
    Clock, Decision, ErrorKind, Execution, Fingerprint, Guard, Key, MemoryStore, Outcome, Record,
    RecordState, Recorded, Scope, Store, Timestamp, Token,
};
use idempotency_testkit::FaultyStore;
use idempotency_testkit::faults::Op;

/// Store time that follows Tokio's (pausable) clock.
#[derive(Debug)]
struct TokioClock {
    start: tokio::time::Instant,
}

impl Clock for TokioClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_unix_millis(1_767_225_600_000).after(self.start.elapsed())
    }
}

type TestStore = FaultyStore<MemoryStore>;

fn store() -> TestStore {
    FaultyStore::new(MemoryStore::with_clock(Arc::new(TokioClock {
        start: tokio::time::Instant::now(),
    })))
}

fn guard(store: &TestStore) -> Guard<TestStore> {
    Guard::new(store.clone())
        .lease(Duration::from_secs(60))
        .name("test")
}

fn key() -> Key {
    Key::new("order-1").unwrap()
}

fn fp(payload: &str) -> Fingerprint {
    Fingerprint::of_bytes(payload.as_bytes())
}

// An `OutcomePolicy<String>` receives `&String`.
#[allow(clippy::ptr_arg)]
fn store_it(value: &String) -> Decision {
    Decision::Complete(Outcome::new(value.clone()))
}

fn store_ok(value: &Result<String, String>) -> Decision {
    match value {
        Ok(v) => Decision::Complete(Outcome::new(v.clone())),
        Err(_) => Decision::Release,
    }
}

#[tokio::test(start_paused = true)]
async fn runs_once_then_replays_and_rejects_a_mismatch() {
    let store = store();
    let guard = guard(&store);
    let runs = AtomicUsize::new(0);
    let charge = || async {
        runs.fetch_add(1, Ordering::SeqCst);
        "charged".to_string()
    };
    let first = guard
        .run(Scope::global(), key(), fp("a"), store_it, |_| charge())
        .await
        .unwrap();
    let Execution::Executed {
        value,
        attempt: 1,
        recovered: false,
        recorded: Recorded::Completed { .. },
    } = first
    else {
        panic!("{first:?}")
    };
    assert_eq!(value, "charged");
    let second = guard
        .run(Scope::global(), key(), fp("a"), store_it, |_| charge())
        .await
        .unwrap();
    let Execution::Replayed(done) = second else {
        panic!("{second:?}")
    };
    assert_eq!(done.outcome.as_bytes(), b"charged");
    let third = guard
        .run(Scope::global(), key(), fp("b"), store_it, |_| charge())
        .await
        .unwrap();
    assert!(matches!(third, Execution::Mismatch), "{third:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_release_decision_lets_the_retry_run_again() {
    let store = store();
    let guard = guard(&store);
    let failed = guard
        .run(Scope::global(), key(), fp("a"), store_ok, |_| async {
            Err("gateway 503".to_string())
        })
        .await
        .unwrap();
    assert!(
        matches!(
            failed,
            Execution::Executed {
                recorded: Recorded::Released,
                ..
            }
        ),
        "{failed:?}"
    );
    assert_released(&store).await;
    let retried = guard
        .run(Scope::global(), key(), fp("a"), store_ok, |_| async {
            Ok("ok".to_string())
        })
        .await
        .unwrap();
    assert!(
        matches!(
            retried,
            Execution::Executed {
                attempt: 2,
                recovered: true,
                recorded: Recorded::Completed { .. },
                ..
            }
        ),
        "{retried:?}"
    );
}

/// The key's record is kept after a release, held by no attempt, with the first attempt's count.
async fn assert_released(store: &TestStore) {
    let record = store.get(&Scope::global(), &key()).await.unwrap();
    assert!(
        matches!(
            &record,
            Some(Record {
                attempt: 1,
                state: RecordState::InFlight {
                    token: Token::NONE,
                    ..
                },
                ..
            })
        ),
        "the key must be released and keep its attempt: {record:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_panic_releases_the_key_and_keeps_unwinding() {
    let store = store();
    let guard = guard(&store);
    let task = {
        let guard = guard.clone();
        tokio::spawn(async move {
            guard
                .run(Scope::global(), key(), fp("a"), store_it, |_| async {
                    if key().as_str() == "order-1" {
                        panic!("handler bug");
                    }
                    String::new()
                })
                .await
        })
    };
    let joined = task.await;
    assert!(
        joined.is_err_and(|e| e.is_panic()),
        "the panic must reach the caller"
    );
    assert_released(&store).await;
    let retried = guard
        .run(Scope::global(), key(), fp("a"), store_it, |_| async {
            "ok".to_string()
        })
        .await
        .unwrap();
    assert!(
        matches!(
            retried,
            Execution::Executed {
                attempt: 2,
                recovered: true,
                ..
            }
        ),
        "{retried:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_duplicate_during_the_run_is_in_flight() {
    let store = store();
    let guard = guard(&store);
    let (release_first, wait) = tokio::sync::oneshot::channel::<()>();
    let first = {
        let guard = guard.clone();
        tokio::spawn(async move {
            guard
                .run(Scope::global(), key(), fp("a"), store_it, |_| async {
                    wait.await.unwrap();
                    "first".to_string()
                })
                .await
                .unwrap()
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let duplicate = guard
        .run(Scope::global(), key(), fp("a"), store_it, |_| async {
            unreachable!("must not run")
        })
        .await
        .unwrap();
    let Execution::InFlight {
        attempt: 1,
        retry_after,
    } = duplicate
    else {
        panic!("{duplicate:?}")
    };
    assert!(retry_after <= Duration::from_secs(60) && retry_after > Duration::ZERO);
    release_first.send(()).unwrap();
    assert!(matches!(first.await.unwrap(), Execution::Executed { .. }));
    let later = guard
        .run(Scope::global(), key(), fp("a"), store_it, |_| async {
            unreachable!("must not run")
        })
        .await
        .unwrap();
    assert!(matches!(later, Execution::Replayed(_)));
}

#[tokio::test(start_paused = true)]
async fn the_heartbeat_keeps_a_long_operation_leased() {
    let store = store();
    let guard = guard(&store);
    let long = {
        let guard = guard.clone();
        tokio::spawn(async move {
            guard
                .run(Scope::global(), key(), fp("a"), store_it, |_| async {
                    // Ten leases long.
                    tokio::time::sleep(Duration::from_secs(600)).await;
                    "done".to_string()
                })
                .await
                .unwrap()
        })
    };
    for _ in 0..9 {
        tokio::time::sleep(Duration::from_secs(60)).await;
        let duplicate = guard
            .run(Scope::global(), key(), fp("a"), store_it, |_| async {
                unreachable!("taken over")
            })
            .await
            .unwrap();
        assert!(
            matches!(duplicate, Execution::InFlight { attempt: 1, .. }),
            "{duplicate:?}"
        );
    }
    let finished = long.await.unwrap();
    assert!(matches!(
        finished,
        Execution::Executed {
            recorded: Recorded::Completed { .. },
            ..
        }
    ));
    let beats = store.calls(Op::Extend);
    assert!(
        (29..=31).contains(&beats),
        "expected a heartbeat every 20 s for 600 s, got {beats}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_taken_over_attempt_learns_it_and_its_outcome_is_discarded() {
    let store = store();
    let guard = guard(&store);
    // The heartbeat cannot reach the store, so the lease runs out while the operation runs.
    store.fail_next(Op::Extend, 3);
    let stale = {
        let guard = guard.clone();
        tokio::spawn(async move {
            guard
                .run(
                    Scope::global(),
                    key(),
                    fp("a"),
                    |_: &bool| Decision::Complete(Outcome::new("stale")),
                    |attempt| async move {
                        tokio::time::sleep(Duration::from_secs(100)).await;
                        attempt.is_lease_lost()
                    },
                )
                .await
                .unwrap()
        })
    };
    tokio::time::sleep(Duration::from_secs(61)).await;
    let newer = guard
        .run(Scope::global(), key(), fp("a"), store_it, |attempt| async move {
            assert!(attempt.recovered() && attempt.number() == 2);
            "newer".to_string()
        })
        .await
        .unwrap();
    assert!(
        matches!(
            newer,
            Execution::Executed {
                attempt: 2,
                recovered: true,
                ..
            }
        ),
        "{newer:?}"
    );
    match stale.await.unwrap() {
        Execution::Executed {
            value: saw_lease_lost,
            recorded: Recorded::LeaseLost,
            ..
        } => assert!(
            saw_lease_lost,
            "the heartbeat must tell the operation its lease was lost"
        ),
        other => panic!("{other:?}"),
    }
    let record = store.get(&Scope::global(), &key()).await.unwrap().unwrap();
    let RecordState::Completed { outcome, .. } = record.state else {
        panic!("completed")
    };
    assert_eq!(
        outcome.as_bytes(),
        b"newer",
        "the stale attempt overwrote the newer outcome"
    );
}

#[tokio::test(start_paused = true)]
async fn a_store_that_is_down_fails_closed() {
    let store = store();
    let guard = guard(&store);
    store.set_down(true);
    let ran = AtomicUsize::new(0);
    let error = guard
        .run(Scope::global(), key(), fp("a"), store_it, |_| async {
            ran.fetch_add(1, Ordering::SeqCst);
            String::new()
        })
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable);
    assert_eq!(
        ran.load(Ordering::SeqCst),
        0,
        "nothing may run while the store is down"
    );
}

#[tokio::test(start_paused = true)]
async fn a_lost_begin_reply_is_retried_with_the_same_token() {
    let store = store();
    let guard = guard(&store);
    store.lose_next_replies(Op::Begin, 1);
    let run = guard
        .run(Scope::global(), key(), fp("a"), store_it, |_| async {
            "ok".to_string()
        })
        .await
        .unwrap();
    assert!(
        matches!(
            run,
            Execution::Executed {
                attempt: 1,
                recorded: Recorded::Completed { .. },
                ..
            }
        ),
        "{run:?}"
    );
    assert_eq!(store.calls(Op::Begin), 2);
}

#[tokio::test(start_paused = true)]
async fn transient_complete_failures_are_retried() {
    let store = store();
    let guard = guard(&store);
    store.fail_next(Op::Complete, 2);
    store.lose_next_replies(Op::Complete, 1);
    let run = guard
        .run(Scope::global(), key(), fp("a"), store_it, |_| async {
            "ok".to_string()
        })
        .await
        .unwrap();
    assert!(
        matches!(
            run,
            Execution::Executed {
                recorded: Recorded::Completed { .. },
                ..
            }
        ),
        "{run:?}"
    );
    assert_eq!(store.calls(Op::Complete), 4);
}

#[tokio::test(start_paused = true)]
async fn a_store_down_while_settling_is_waited_out_within_the_lease() {
    let store = store();
    let guard = guard(&store);
    let outage = {
        let store = store.clone();
        tokio::spawn(async move {
            // The store goes down while the operation runs and comes back 20 s later, well
            // inside the 60 s lease.
            tokio::time::sleep(Duration::from_secs(1)).await;
            store.set_down(true);
            tokio::time::sleep(Duration::from_secs(20)).await;
            store.set_down(false);
        })
    };
    let run = guard
        .run(Scope::global(), key(), fp("a"), store_it, |_| async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            "ok".to_string()
        })
        .await
        .unwrap();
    outage.await.unwrap();
    assert!(
        matches!(
            run,
            Execution::Executed {
                recorded: Recorded::Completed { .. },
                ..
            }
        ),
        "the outcome must be recorded once the store is back: {run:?}"
    );
    let again = guard
        .run(Scope::global(), key(), fp("a"), store_it, |_| async {
            unreachable!("ran twice")
        })
        .await
        .unwrap();
    assert!(matches!(again, Execution::Replayed(_)));
}

#[tokio::test(start_paused = true)]
async fn a_persistent_complete_failure_is_retried_until_the_lease_ends_then_reported() {
    let store = store();
    let guard = guard(&store);
    store.fail_next(Op::Complete, u32::MAX);
    let started = tokio::time::Instant::now();
    let run = guard
        .run(Scope::global(), key(), fp("a"), store_it, |_| async {
            "ok".to_string()
        })
        .await
        .unwrap();
    let Execution::Executed {
        recorded: Recorded::Failed(error),
        ..
    } = run
    else {
        panic!("{run:?}")
    };
    assert_eq!(error.kind(), ErrorKind::Unavailable);
    // Paused time: the guard kept trying for (almost) the whole 60 s lease, no longer.
    let waited = started.elapsed();
    assert!(
        waited > Duration::from_secs(55) && waited < Duration::from_secs(60),
        "settled for {waited:?}"
    );
    assert!(
        store.calls(Op::Complete) > 10,
        "{} tries",
        store.calls(Op::Complete)
    );
    let record = store.get(&Scope::global(), &key()).await.unwrap().unwrap();
    assert!(
        matches!(record.state, RecordState::InFlight { .. }),
        "nothing may claim it completed"
    );
}

#[test]
fn metrics_count_each_answer() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let guard = Guard::new(MemoryStore::new()).name("metrics");
            let ok = |_: Scope, key: Key, fp: Fingerprint| {
                let guard = guard.clone();
                async move {
                    guard
                        .run(Scope::global(), key, fp, store_it, |_| async { String::new() })
                        .await
                }
            };
            ok(Scope::global(), key(), fp("a")).await.unwrap();
            ok(Scope::global(), key(), fp("a")).await.unwrap();
            ok(Scope::global(), key(), fp("a")).await.unwrap();
            ok(Scope::global(), key(), fp("b")).await.unwrap();
        });
    });
    let counters: Vec<(String, u64)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| match value {
            DebugValue::Counter(n) => Some((key.key().name().to_string(), n)),
            _ => None,
        })
        .collect();
    let count = |name: &str| {
        counters
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v)
            .sum::<u64>()
    };
    assert_eq!(count("idempotency_acquired_total"), 1, "{counters:?}");
    assert_eq!(count("idempotency_replayed_total"), 2, "{counters:?}");
    assert_eq!(count("idempotency_mismatch_total"), 1, "{counters:?}");
    assert_eq!(count("idempotency_store_errors_total"), 0, "{counters:?}");
}

/// A heartbeat whose answer takes longer than the heartbeat interval, or comes after the lease
/// it extends ran out, is counted (and logged): the store is too slow for the lease.
#[test]
fn late_heartbeats_are_counted() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        runtime.block_on(async {
            let store = FaultyStore::new(MemoryStore::new());
            // Lease 3 s, a heartbeat every second, each answered after 1.5 s: slow, not yet
            // past the lease.
            store.delay(Op::Extend, Duration::from_millis(1500));
            let guard = Guard::new(store.clone())
                .name("late")
                .lease(Duration::from_secs(3))
                .heartbeat_every(Duration::from_secs(1));
            guard
                .run(Scope::global(), key(), fp("a"), store_it, |_| async {
                    tokio::time::sleep(Duration::from_secs(4)).await;
                    String::new()
                })
                .await
                .unwrap();
            // Answered after 4 s: past the 3 s lease.
            store.delay(Op::Extend, Duration::from_secs(4));
            guard
                .run(
                    Scope::global(),
                    Key::new("late-2").unwrap(),
                    fp("a"),
                    store_it,
                    |_| async {
                        tokio::time::sleep(Duration::from_secs(6)).await;
                        String::new()
                    },
                )
                .await
                .unwrap();
        });
    });
    // A snapshot drains the counters: take one, then read both labels from it.
    let snapshot = snapshotter.snapshot().into_vec();
    let late = |how: &str| -> u64 {
        snapshot
            .iter()
            .filter(|(key, _, _, _)| {
                key.key().name() == "idempotency_heartbeat_late_total"
                    && key.key().labels().any(|l| l.key() == "how" && l.value() == how)
            })
            .map(|(_, _, _, value)| match value {
                DebugValue::Counter(n) => *n,
                _ => 0,
            })
            .sum()
    };
    assert_eq!(late("slow"), 1);
    assert_eq!(late("after_lease"), 1);
}
