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
use idempotency_testkit::recorded::record_metrics_paused;

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

/// Every metric of the guard, the lanes and the purger, each provoked by its event and
/// checked with its labels (`docs/OPERATIONS.md` lists them). The late-heartbeat counter has a
/// test of its own below.
#[test]
fn every_metric_moves_when_its_event_happens() {
    let metrics = record_metrics_paused(async {
        let store = store();
        let guard = guard(&store).name("metrics");
        let run = |key: &'static str, payload: &'static str| {
            let guard = guard.clone();
            async move {
                guard
                    .run(
                        Scope::global(),
                        Key::new(key).unwrap(),
                        fp(payload),
                        store_it,
                        |_| async { String::new() },
                    )
                    .await
            }
        };
        // Acquired, then replayed, then a mismatch.
        run("k1", "a").await.unwrap();
        run("k1", "a").await.unwrap();
        run("k1", "b").await.unwrap();
        // In flight: a second run while the first holds the key.
        let slow = guard.run(
            Scope::global(),
            Key::new("k2").unwrap(),
            fp("a"),
            store_it,
            |_| async {
                tokio::time::sleep(Duration::from_secs(1)).await;
                String::new()
            },
        );
        let (first, second) = tokio::join!(slow, async {
            tokio::time::sleep(Duration::from_millis(10)).await;
            run("k2", "a").await
        });
        assert!(matches!(first.unwrap(), Execution::Executed { .. }));
        assert!(matches!(second.unwrap(), Execution::InFlight { .. }));
        // A takeover: an attempt that never finished, its lease over.
        let abandoned =
            idempotency_core::BeginRequest::new(Scope::global(), Key::new("k3").unwrap(), fp("a"))
                .lease(Duration::from_secs(1));
        assert!(matches!(
            store.begin(&abandoned).await.unwrap(),
            idempotency_core::Claim::Acquired(_)
        ));
        tokio::time::sleep(Duration::from_secs(2)).await;
        run("k3", "a").await.unwrap();
        // Lease lost on complete: another attempt takes over while this one runs.
        let taken = guard
            .clone()
            .lease(Duration::from_secs(1))
            .heartbeat_every(Duration::from_secs(3600))
            .run(
                Scope::global(),
                Key::new("k4").unwrap(),
                fp("a"),
                store_it,
                |_| {
                    let store = store.clone();
                    async move {
                        tokio::time::sleep(Duration::from_secs(2)).await;
                        let other = idempotency_core::BeginRequest::new(
                            Scope::global(),
                            Key::new("k4").unwrap(),
                            fp("a"),
                        );
                        assert!(matches!(
                            store.begin(&other).await.unwrap(),
                            idempotency_core::Claim::Acquired(_)
                        ));
                        String::new()
                    }
                },
            )
            .await
            .unwrap();
        assert!(matches!(
            taken,
            Execution::Executed {
                recorded: Recorded::LeaseLost,
                ..
            }
        ));
        // An unknown outcome.
        let unknown = |_: &String| Decision::Unknown;
        guard
            .run(
                Scope::global(),
                Key::new("k5").unwrap(),
                fp("a"),
                unknown,
                |_| async { String::new() },
            )
            .await
            .unwrap();
        // A store error on begin.
        store.set_down(true);
        assert!(run("k6", "a").await.is_err());
        store.set_down(false);
        // The lanes shed new work that waited too long.
        let lanes = idempotency_core::Lanes::new(1, 0, Duration::from_millis(10));
        let _held = lanes.new_work().await.unwrap();
        assert_eq!(lanes.new_work().await.unwrap_err().kind(), ErrorKind::Overloaded);
        // The purger deletes expired records, and counts a failed round.
        tokio::time::sleep(Duration::from_secs(25 * 3600)).await;
        let purger = idempotency_core::Purger::new(store.clone());
        assert!(purger.round().await.unwrap() > 0);
        store.fail_next(Op::Admin, 1);
        assert!(purger.round().await.is_err());
    });
    let guard = [("guard", "metrics")];
    let count = |name: &str, labels: &[(&str, &str)]| {
        let mut all = guard.to_vec();
        all.extend_from_slice(labels);
        metrics.counter(name, &all)
    };
    // k1, k2, k4, k5 acquired anew; k3 taken over.
    assert_eq!(
        count("idempotency_acquired_total", &[("recovered", "false")]),
        4,
        "{metrics:?}"
    );
    assert_eq!(count("idempotency_acquired_total", &[("recovered", "true")]), 1);
    assert_eq!(count("idempotency_replayed_total", &[]), 1);
    assert_eq!(count("idempotency_mismatch_total", &[]), 1);
    assert_eq!(count("idempotency_in_flight_total", &[]), 1);
    assert_eq!(count("idempotency_lease_takeovers_total", &[]), 1);
    assert_eq!(count("idempotency_lease_lost_total", &[("op", "complete")]), 1);
    assert_eq!(count("idempotency_outcome_unknown_total", &[]), 1);
    // The guard tries a failed begin again before it gives up: each try is counted.
    assert!(
        count(
            "idempotency_store_errors_total",
            &[("op", "begin"), ("kind", "unavailable")]
        ) >= 1
    );
    assert!(
        metrics.histogram_count(
            "idempotency_store_duration_seconds",
            &[("guard", "metrics"), ("op", "begin")]
        ) >= 8
    );
    assert!(
        metrics.histogram_count(
            "idempotency_store_duration_seconds",
            &[("guard", "metrics"), ("op", "complete")]
        ) >= 4
    );
    assert_eq!(metrics.counter("idempotency_store_shed_total", &[]), 1);
    assert!(metrics.counter("idempotency_purged_total", &[]) > 0);
    assert_eq!(
        metrics.histogram_count("idempotency_purge_duration_seconds", &[]),
        2
    );
    assert_eq!(metrics.counter("idempotency_purge_errors_total", &[]), 1);
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
