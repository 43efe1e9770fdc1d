//! The ack rules of `docs/CONSUMERS.md`, on the reference store with injected faults (Tokio's paused clock
//! makes leases and backoff instant).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_consumer::{
    Backoff, Consumer, Delivery, Disposition, Handler, HandlerError, KeySource, Processor,
};
use idempotency_core::{Attempt, Key, MemoryStore, Outcome};
use idempotency_testkit::FaultyStore;
use idempotency_testkit::faults::Op;
use idempotency_testkit::message::TestMessage;

type Message = TestMessage;

/// Charges once per call; fails the first `fail_first` calls with `Retry` (or always with
/// `Fatal` when `fatal`); can be made slow.
#[derive(Default)]
struct Charger {
    charges: Mutex<Vec<String>>,
    calls: AtomicU32,
    fail_first: u32,
    fatal: bool,
    slow: Option<Duration>,
    panics: bool,
}

impl Handler<Message> for Charger {
    async fn handle(&self, message: &Message, attempt: &Attempt) -> Result<Outcome, HandlerError> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some(slow) = self.slow {
            tokio::time::sleep(slow).await;
        }
        if self.fatal {
            return Err(HandlerError::fatal("card declined"));
        }
        if self.panics {
            panic!("index out of bounds: the payload has no amount");
        }
        if call <= self.fail_first {
            return Err(HandlerError::retry(format!("gateway timeout on call {call}")));
        }
        self.charges.lock().unwrap().push(attempt.key().to_string());
        Ok(Outcome::new(format!(
            "charged {}",
            String::from_utf8_lossy(&message.payload)
        )))
    }
}

type TestStore = FaultyStore<MemoryStore>;
type TestConsumer = Consumer<TestStore, Arc<Charger>>;

fn consumer(charger: Charger) -> (TestConsumer, Arc<Charger>, TestStore) {
    let charger = Arc::new(charger);
    let store = FaultyStore::new(MemoryStore::new());
    let consumer = Consumer::new("payments", store.clone(), Arc::clone(&charger)).backoff(Backoff {
        initial: Duration::from_secs(1),
        max: Duration::from_secs(60),
    });
    (consumer, charger, store)
}

#[tokio::test(start_paused = true)]
async fn the_first_delivery_executes_and_redeliveries_are_acked_without_side_effects() {
    let (consumer, charger, _) = consumer(Charger::default());
    let message = Message::keyed("pay-1", "EUR 10");
    assert_eq!(consumer.process(&message).await, Disposition::Ack);
    for _ in 0..3 {
        assert_eq!(consumer.process(&message.redelivered()).await, Disposition::Ack);
    }
    assert_eq!(charger.charges.lock().unwrap().as_slice(), ["pay-1"]);
}

#[tokio::test(start_paused = true)]
async fn a_message_without_a_key_is_dead_lettered_unless_keyed_by_content() {
    let (consumer, charger, _) = consumer(Charger::default());
    let keyless = Message::keyless("EUR 10");
    let Disposition::DeadLetter { reason } = consumer.process(&keyless).await else {
        panic!("dead-letter")
    };
    assert_eq!(reason, "no Idempotency-Key header");
    let bad = Message::keyed("has space", "EUR 10");
    let Disposition::DeadLetter { reason } = consumer.process(&bad).await else {
        panic!("dead-letter")
    };
    assert!(
        reason.starts_with("invalid key in the Idempotency-Key header: "),
        "{reason}"
    );
    assert_eq!(charger.calls.load(Ordering::SeqCst), 0, "nothing may run");

    let by_content = consumer.clone().keys(KeySource::ContentHash);
    assert_eq!(by_content.process(&keyless).await, Disposition::Ack);
    assert_eq!(by_content.process(&keyless.redelivered()).await, Disposition::Ack);
    assert_eq!(charger.charges.lock().unwrap().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_message_id_can_be_the_key() {
    let (consumer, charger, _) = consumer(Charger::default());
    let consumer = consumer.keys(KeySource::MessageId);
    let message = Message {
        id: Some("msg-42".into()),
        ..Message::keyless("EUR 10")
    };
    assert_eq!(consumer.process(&message).await, Disposition::Ack);
    assert_eq!(consumer.process(&message.redelivered()).await, Disposition::Ack);
    assert_eq!(charger.charges.lock().unwrap().as_slice(), ["msg-42"]);
    let custom = consumer.keys(KeySource::Custom(Arc::new(|m: &dyn Delivery| {
        Key::composite(["order", std::str::from_utf8(m.payload()).ok()?]).ok()
    })));
    assert_eq!(custom.process(&message).await, Disposition::Ack);
    assert_eq!(charger.charges.lock().unwrap().last().unwrap(), "order:EUR%2010");
}

#[tokio::test(start_paused = true)]
async fn a_reused_key_with_another_payload_is_dead_lettered() {
    let (consumer, charger, _) = consumer(Charger::default());
    assert_eq!(
        consumer.process(&Message::keyed("pay-1", "EUR 10")).await,
        Disposition::Ack
    );
    let Disposition::DeadLetter { reason } = consumer.process(&Message::keyed("pay-1", "EUR 99")).await
    else {
        panic!("dead-letter")
    };
    assert!(reason.contains("different payload"), "{reason}");
    assert_eq!(charger.charges.lock().unwrap().len(), 1);
}

/// A copy of a message whose first delivery is still running (5 s): handled by the same
/// consumer, it is woken the moment the first records its outcome and acked as a duplicate,
/// without waiting for the lease (60 s) or a redelivery.
#[tokio::test(start_paused = true)]
async fn a_duplicate_of_a_message_in_flight_is_acked_when_the_first_copy_completes() {
    let (consumer, charger, _) = consumer(Charger {
        slow: Some(Duration::from_secs(5)),
        ..Charger::default()
    });
    let consumer = Arc::new(consumer);
    let message = Message::keyed("pay-1", "EUR 10");
    let started = tokio::time::Instant::now();
    let first = {
        let (consumer, message) = (Arc::clone(&consumer), message.clone());
        tokio::spawn(async move { consumer.process(&message).await })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(consumer.process(&message.redelivered()).await, Disposition::Ack);
    assert_eq!(
        charger.charges.lock().unwrap().len(),
        1,
        "acked before the first copy's outcome"
    );
    // The paused clock stands still while anything can run: the duplicate was answered at
    // the very instant the first copy completed, woken rather than polling.
    assert_eq!(started.elapsed(), Duration::from_secs(5));
    assert_eq!(first.await.unwrap(), Disposition::Ack);
    assert_eq!(charger.calls.load(Ordering::SeqCst), 1);
}

/// A copy handled by another consumer (another process: a guard of its own) over the same
/// store learns of the first copy's outcome by reading the record again: within one pause
/// (at most 250 ms) of the completion, not at the lease's end.
#[tokio::test(start_paused = true)]
async fn a_duplicate_in_another_consumer_reads_the_outcome_within_a_pause() {
    let (consumer, charger, store) = consumer(Charger {
        slow: Some(Duration::from_secs(5)),
        ..Charger::default()
    });
    let elsewhere = Consumer::new("payments", store.clone(), Arc::clone(&charger));
    let message = Message::keyed("pay-1", "EUR 10");
    let started = tokio::time::Instant::now();
    let (first, duplicate) = tokio::join!(consumer.process(&message), async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let answer = elsewhere.process(&message.redelivered()).await;
        (answer, started.elapsed())
    });
    assert_eq!(first, Disposition::Ack);
    assert_eq!(duplicate.0, Disposition::Ack);
    assert!(
        duplicate.1 > Duration::from_secs(5) && duplicate.1 <= Duration::from_millis(5250),
        "answered at {:?} on the paused clock",
        duplicate.1
    );
    assert_eq!(charger.calls.load(Ordering::SeqCst), 1);
}

/// A copy that waited `in_flight_wait` without the first copy finishing is put back for the
/// lease's remaining time, never acked; with no wait, at once. The first copy's outcome
/// answers the redelivery.
#[tokio::test(start_paused = true)]
async fn a_duplicate_still_in_flight_after_its_wait_is_requeued_not_acked() {
    let (consumer, charger, _) = consumer(Charger {
        slow: Some(Duration::from_secs(5)),
        ..Charger::default()
    });
    for wait in [Duration::from_secs(2), Duration::ZERO] {
        let impatient = consumer.clone().in_flight_wait(wait);
        let key = format!("pay-wait-{}", wait.as_secs());
        let message = Message::keyed(&key, "EUR 10");
        let (first, duplicate) = tokio::join!(consumer.process(&message), async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let answer = impatient.process(&message.redelivered()).await;
            (answer, charger.charges.lock().unwrap().contains(&key))
        });
        let (Disposition::Nack { after }, false) = duplicate else {
            panic!("{wait:?}: {duplicate:?}")
        };
        assert!(after >= Duration::from_secs(1), "{after:?}");
        assert_eq!(first, Disposition::Ack);
        assert_eq!(consumer.process(&message.redelivered()).await, Disposition::Ack);
    }
    assert_eq!(charger.calls.load(Ordering::SeqCst), 2, "one call per key");
}

#[tokio::test(start_paused = true)]
async fn a_handler_failing_twice_is_retried_with_backoff_and_charges_once() {
    let (consumer, charger, _) = consumer(Charger {
        fail_first: 2,
        ..Charger::default()
    });
    let first = Message::keyed("pay-1", "EUR 10");
    assert_eq!(
        consumer.process(&first).await,
        Disposition::Nack {
            after: Duration::from_secs(1)
        }
    );
    let second = first.redelivered();
    assert_eq!(
        consumer.process(&second).await,
        Disposition::Nack {
            after: Duration::from_secs(2)
        }
    );
    assert_eq!(consumer.process(&second.redelivered()).await, Disposition::Ack);
    assert_eq!(charger.calls.load(Ordering::SeqCst), 3);
    assert_eq!(charger.charges.lock().unwrap().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_handler_that_always_fails_is_dead_lettered_after_the_limit() {
    let (consumer, charger, _) = consumer(Charger {
        fail_first: u32::MAX,
        ..Charger::default()
    });
    let consumer = consumer.max_deliveries(3);
    let mut message = Message::keyed("pay-1", "EUR 10");
    assert!(matches!(
        consumer.process(&message).await,
        Disposition::Nack { .. }
    ));
    message = message.redelivered();
    assert!(matches!(
        consumer.process(&message).await,
        Disposition::Nack { .. }
    ));
    message = message.redelivered();
    let Disposition::DeadLetter { reason } = consumer.process(&message).await else {
        panic!("dead-letter")
    };
    assert!(
        reason.contains("failed 3 deliveries") && reason.contains("gateway timeout"),
        "{reason}"
    );
    assert_eq!(charger.charges.lock().unwrap().len(), 0);

    let (fatal, charger, _) = self::consumer(Charger {
        fatal: true,
        ..Charger::default()
    });
    let verdict = fatal.process(&Message::keyed("pay-2", "EUR 10")).await;
    assert_eq!(
        verdict,
        Disposition::DeadLetter {
            reason: "card declined".into()
        }
    );
    assert_eq!(
        charger.calls.load(Ordering::SeqCst),
        1,
        "a fatal error is not retried"
    );
}

#[tokio::test(start_paused = true)]
async fn a_store_that_is_down_requeues_without_running_the_handler() {
    let (consumer, charger, store) = consumer(Charger::default());
    store.set_down(true);
    let message = Message::keyed("pay-1", "EUR 10");
    assert!(matches!(
        consumer.process(&message).await,
        Disposition::Nack { .. }
    ));
    assert!(matches!(
        consumer.process(&message.redelivered()).await,
        Disposition::Nack { .. }
    ));
    assert_eq!(
        charger.calls.load(Ordering::SeqCst),
        0,
        "nothing may run while the store is down"
    );
    store.set_down(false);
    assert_eq!(consumer.process(&message.redelivered()).await, Disposition::Ack);
    assert_eq!(charger.charges.lock().unwrap().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn an_outcome_that_cannot_be_recorded_is_never_acked() {
    let (consumer, charger, store) = consumer(Charger::default());
    let consumer = consumer.lease(Duration::from_secs(10));
    store.fail_next(Op::Complete, u32::MAX);
    let message = Message::keyed("pay-1", "EUR 10");
    assert!(matches!(
        consumer.process(&message).await,
        Disposition::Nack { .. }
    ));
    assert_eq!(
        charger.charges.lock().unwrap().len(),
        1,
        "the side effect happened"
    );
}

/// A handler that panics is a failed delivery, not a crash: the key is released, the message
/// is retried with backoff, and at the delivery limit it is dead-lettered with reason `panic:`.
#[tokio::test(start_paused = true)]
async fn a_panicking_handler_is_retried_then_dead_lettered_with_reason_panic() {
    let (consumer, charger, store) = consumer(Charger {
        panics: true,
        ..Charger::default()
    });
    let consumer = consumer.max_deliveries(3);
    let mut message = Message::keyed("pay-poison", "EUR ??");
    for delivery in 1..=2 {
        assert_eq!(
            consumer.process(&message).await,
            Disposition::Nack {
                after: Duration::from_secs(1 << (delivery - 1))
            },
            "delivery {delivery}"
        );
        message = message.redelivered();
    }
    match consumer.process(&message).await {
        Disposition::DeadLetter { reason } => {
            assert!(reason.starts_with("panic:"), "{reason}");
            assert!(reason.contains("the payload has no amount"), "{reason}");
        }
        other => panic!("expected a dead letter, got {other:?}"),
    }
    assert_eq!(charger.calls.load(Ordering::SeqCst), 3);
    // Each panic released the key: nothing is left in flight.
    let record = idempotency_core::Store::get(
        &store,
        &idempotency_core::Scope::new("payments").unwrap(),
        &Key::new("pay-poison").unwrap(),
    )
    .await
    .unwrap()
    .expect("a released record is kept");
    assert!(
        matches!(record.state, idempotency_core::RecordState::InFlight { token, .. } if token == idempotency_core::Token::NONE)
    );
}

/// Every consumer metric, each provoked by its event, with the consumer's name: every `result`
/// of `idempotency_consumer_messages_total`, the panics, and the guard's own metrics under the
/// consumer's name.
#[test]
fn every_consumer_metric_moves_when_its_event_happens() {
    let metrics = idempotency_testkit::recorded::record_metrics_paused(async {
        let (plain, _, store) = consumer(Charger::default());
        let message = Message::keyed("pay-1", "EUR 10");
        assert_eq!(plain.process(&message).await, Disposition::Ack); // executed
        assert_eq!(plain.process(&message.redelivered()).await, Disposition::Ack); // duplicate
        store.set_down(true);
        let down = plain.process(&Message::keyed("pay-2", "EUR 10")).await; // store_unavailable
        assert!(matches!(down, Disposition::Nack { .. }));
        store.set_down(false);
        let missing = plain.process(&Message::default()).await; // dead_lettered
        assert!(matches!(missing, Disposition::DeadLetter { .. }));
        let (failing, _, _) = consumer(Charger {
            fail_first: 1,
            ..Charger::default()
        });
        let retried = failing.process(&Message::keyed("pay-3", "EUR 10")).await; // retried
        assert!(matches!(retried, Disposition::Nack { .. }));
        let (panicking, _, _) = consumer(Charger {
            panics: true,
            ..Charger::default()
        });
        let panicked = panicking.process(&Message::keyed("pay-4", "EUR 10")).await;
        assert!(matches!(panicked, Disposition::Nack { .. }));
        // In flight: a slow first delivery holds the key while its copy arrives.
        let (slow, _, _) = consumer(Charger {
            slow: Some(Duration::from_secs(5)),
            ..Charger::default()
        });
        let copy = Message::keyed("pay-5", "EUR 10");
        let impatient = slow.clone().in_flight_wait(Duration::ZERO);
        let (first, second) = tokio::join!(slow.process(&copy), async {
            tokio::time::sleep(Duration::from_millis(10)).await;
            impatient.process(&copy.redelivered()).await
        });
        assert_eq!(first, Disposition::Ack);
        assert!(matches!(second, Disposition::Nack { .. }));
    });
    let result = |result: &str| {
        metrics.counter(
            "idempotency_consumer_messages_total",
            &[("consumer", "payments"), ("result", result)],
        )
    };
    for (name, expected) in [
        ("executed", 2),
        ("duplicate", 1),
        ("store_unavailable", 1),
        ("dead_lettered", 1),
        ("retried", 2),
        ("in_flight", 1),
    ] {
        assert_eq!(result(name), expected, "{name}: {metrics:?}");
    }
    assert_eq!(
        metrics.counter("idempotency_consumer_panics_total", &[("consumer", "payments")]),
        1
    );
    // pay-1, pay-3, pay-4 and pay-5 were acquired; pay-2 met the store down.
    assert_eq!(
        metrics.counter("idempotency_acquired_total", &[("guard", "payments")]),
        4
    );
    assert!(
        metrics.counter(
            "idempotency_store_errors_total",
            &[("guard", "payments"), ("op", "begin")]
        ) >= 1
    );
}

// ---- Batches (`Processor::process_many`): each message answered as alone, two round trips.

/// A clock that follows Tokio's (paused) clock, so that the store's leases run out as the
/// test's time passes.
#[derive(Debug)]
struct TokioClock(tokio::time::Instant);

impl idempotency_core::Clock for TokioClock {
    fn now(&self) -> idempotency_core::Timestamp {
        let elapsed = u64::try_from(self.0.elapsed().as_millis()).unwrap();
        idempotency_core::Timestamp::from_unix_millis(1_767_225_600_000 + i64::try_from(elapsed).unwrap())
    }
}

/// The side effects of a batch's handlers, as an upstream that deduplicates by the forwarded
/// key records them: every run (key, attempt, whether it took an expired lease over), and the
/// effects, one per key. Fails `poison` keys fatally, and parks the handler of `blocks` until
/// the test ends (a crash in the middle of the batch), telling `started` when it is there.
#[derive(Default)]
struct Ledger {
    runs: Mutex<Vec<(String, u32, bool)>>,
    effects: Mutex<std::collections::BTreeSet<String>>,
    poison: Vec<String>,
    /// Keys whose handler fails, to be retried.
    failing: Vec<String>,
    /// Every handler waits here for the others before it returns.
    barrier: Option<Arc<tokio::sync::Barrier>>,
    slow: Option<Duration>,
    blocks: Mutex<Option<String>>,
    started: tokio::sync::Notify,
}

impl Handler<Message> for Ledger {
    async fn handle(&self, _: &Message, attempt: &Attempt) -> Result<Outcome, HandlerError> {
        let key = attempt.key().to_string();
        self.runs
            .lock()
            .unwrap()
            .push((key.clone(), attempt.number(), attempt.recovered()));
        if let Some(slow) = self.slow {
            tokio::time::sleep(slow).await;
        }
        if let Some(barrier) = &self.barrier {
            barrier.wait().await;
        }
        if self.failing.contains(&key) {
            return Err(HandlerError::retry("the card service timed out"));
        }
        let blocks = {
            let mut blocks = self.blocks.lock().unwrap();
            blocks.take_if(|blocked| *blocked == key)
        };
        if blocks.is_some() {
            self.started.notify_one();
            std::future::pending::<()>().await;
        }
        if self.poison.contains(&key) {
            return Err(HandlerError::fatal("the payload has no amount"));
        }
        self.effects.lock().unwrap().insert(key.clone());
        Ok(Outcome::new(format!("charged {key}")))
    }
}

impl Ledger {
    fn runs_of(&self, key: &str) -> usize {
        self.runs
            .lock()
            .unwrap()
            .iter()
            .filter(|(k, _, _)| k == key)
            .count()
    }
}

fn batch_consumer(ledger: Ledger, lease: Duration) -> (Consumer<MemoryStore, Arc<Ledger>>, Arc<Ledger>) {
    let ledger = Arc::new(ledger);
    let store = MemoryStore::with_clock(Arc::new(TokioClock(tokio::time::Instant::now())));
    let consumer = Consumer::new("payments", store, Arc::clone(&ledger)).lease(lease);
    (consumer, ledger)
}

/// Messages `pay-N` of EUR 10, for each N of `numbers`.
fn payments(numbers: std::ops::RangeInclusive<u32>) -> Vec<Message> {
    numbers
        .map(|n| Message::keyed(&format!("pay-{n}"), "EUR 10"))
        .collect()
}

/// The dispositions `process_many` hands over for `messages` as an ordered batch, in order.
async fn many<P: Processor<Message>>(processor: &P, messages: &[Message]) -> Vec<Disposition> {
    decide(processor, messages, idempotency_consumer::Decisions::channel()).await
}

/// The dispositions `process_many` hands over to `sink` for `messages`, in order.
async fn decide<P: Processor<Message>>(
    processor: &P,
    messages: &[Message],
    sink: (
        idempotency_consumer::Decisions,
        tokio::sync::mpsc::UnboundedReceiver<Disposition>,
    ),
) -> Vec<Disposition> {
    let batch: Vec<&Message> = messages.iter().collect();
    let (decided, mut dispositions) = sink;
    processor.process_many(&batch, &decided).await;
    drop(decided);
    let mut handed = Vec::new();
    while let Some(disposition) = dispositions.recv().await {
        handed.push(disposition);
    }
    handed
}

/// The same key twice in one batch runs once: the second copy waits for the first one's
/// outcome (recorded before it is answered) and is acked as a duplicate.
#[tokio::test(start_paused = true)]
async fn the_same_key_twice_in_a_batch_runs_once() {
    let (consumer, ledger) = batch_consumer(Ledger::default(), Duration::from_secs(60));
    let messages = [
        Message::keyed("pay-1", "EUR 10"),
        Message::keyed("pay-2", "EUR 20"),
        Message::keyed("pay-1", "EUR 10"),
        Message::keyed("pay-3", "EUR 30"),
    ];
    let decided = many(&consumer, &messages).await;
    assert_eq!(decided, vec![Disposition::Ack; 4]);
    assert_eq!(ledger.runs_of("pay-1"), 1);
    assert_eq!(ledger.runs.lock().unwrap().len(), 3);
    // Recorded: the whole batch again is all duplicates.
    assert_eq!(many(&consumer, &messages).await, vec![Disposition::Ack; 4]);
    assert_eq!(ledger.runs.lock().unwrap().len(), 3);
}

/// A poison message and a reused key in one batch are dead-lettered, exactly those two; their
/// neighbours run and are acked, in order.
#[tokio::test(start_paused = true)]
async fn a_poison_message_and_a_reused_key_dead_letter_alone() {
    let (consumer, ledger) = batch_consumer(
        Ledger {
            poison: vec!["pay-poison".into()],
            ..Ledger::default()
        },
        Duration::from_secs(60),
    );
    assert_eq!(
        consumer.process(&Message::keyed("pay-reused", "EUR 10")).await,
        Disposition::Ack
    );
    let messages = [
        Message::keyed("pay-1", "EUR 10"),
        Message::keyed("pay-poison", "EUR 20"),
        Message::keyed("pay-2", "EUR 30"),
        Message::keyed("pay-reused", "EUR 99"),
        Message::default(),
        Message::keyed("pay-3", "EUR 40"),
    ];
    let decided = many(&consumer, &messages).await;
    let dead: Vec<String> = decided
        .iter()
        .filter_map(|disposition| match disposition {
            Disposition::DeadLetter { reason } => Some(reason.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(decided.len(), 6, "{decided:?}");
    assert_eq!(dead.len(), 3, "{dead:?}");
    assert_eq!(dead[0], "the payload has no amount");
    assert!(dead[1].contains("different payload"), "{}", dead[1]);
    assert_eq!(dead[2], "no Idempotency-Key header");
    for acked in [0, 2, 5] {
        assert_eq!(decided[acked], Disposition::Ack, "message {acked}");
    }
    let effects = ledger.effects.lock().unwrap().clone();
    assert_eq!(
        effects.into_iter().collect::<Vec<_>>(),
        ["pay-1", "pay-2", "pay-3", "pay-reused"]
    );
}

/// A handler slower than the lease, four times over in one batch: the heartbeat keeps every
/// claimed lease alive, so the last message's key is still held when another consumer (a
/// redelivery elsewhere) asks for it after the lease would have run out; it runs once.
#[tokio::test(start_paused = true)]
async fn the_last_lease_of_a_batch_outlives_slow_handlers_before_it() {
    let (consumer, ledger) = batch_consumer(
        Ledger {
            slow: Some(Duration::from_secs(2)),
            ..Ledger::default()
        },
        Duration::from_secs(3),
    );
    let elsewhere = consumer.clone().in_flight_wait(Duration::ZERO);
    let messages = payments(1..=4);
    let (decided, competitor) = tokio::join!(many(&consumer, &messages), async {
        // Past the first lease (3 s) and before the last handler starts (6 s).
        tokio::time::sleep(Duration::from_secs(5)).await;
        elsewhere.process(&messages[3].redelivered()).await
    });
    assert!(
        matches!(competitor, Disposition::Nack { .. }),
        "the last key was taken over: {competitor:?}"
    );
    assert_eq!(decided, vec![Disposition::Ack; 4]);
    assert_eq!(ledger.runs_of("pay-4"), 1);
    assert!(
        ledger
            .runs
            .lock()
            .unwrap()
            .iter()
            .all(|(_, attempt, _)| *attempt == 1)
    );
}

/// A crash (the task aborted) while the third handler of a batch runs: nothing of the batch
/// was recorded, and every key of it stays held until its lease runs out (a redelivery then
/// runs nothing and is not acked). Redelivered after the leases, every message runs once more
/// and is acked (none lost), each as a recovered attempt that the handler can tell from a
/// first one (the upstream that deduplicates by the key applies each effect once).
#[tokio::test(start_paused = true)]
async fn a_crash_in_the_middle_of_a_batch_loses_nothing_and_runs_nothing_twice() {
    let (consumer, ledger) = batch_consumer(
        Ledger {
            blocks: Mutex::new(Some("pay-3".into())),
            ..Ledger::default()
        },
        Duration::from_secs(10),
    );
    let messages = payments(1..=6);
    let crashed = {
        let (consumer, messages) = (consumer.clone(), messages.clone());
        tokio::spawn(async move { many(&consumer, &messages).await })
    };
    ledger.started.notified().await;
    crashed.abort();
    assert!(crashed.await.unwrap_err().is_cancelled());
    let before: Vec<String> = ledger
        .runs
        .lock()
        .unwrap()
        .iter()
        .map(|(k, _, _)| k.clone())
        .collect();
    assert_eq!(before, ["pay-1", "pay-2", "pay-3"]);
    // Redelivered while the leases hold: nothing runs, nothing is acked.
    let early = consumer.clone().in_flight_wait(Duration::ZERO);
    let redelivered: Vec<Message> = messages.iter().map(Message::redelivered).collect();
    let decided = many(&early, &redelivered).await;
    assert!(matches!(decided[..], [Disposition::Nack { .. }]), "{decided:?}");
    assert_eq!(ledger.runs.lock().unwrap().len(), 3);
    // After the leases: everything runs and is acked.
    tokio::time::sleep(Duration::from_secs(11)).await;
    let decided = many(&consumer, &redelivered).await;
    assert_eq!(decided, vec![Disposition::Ack; 6]);
    let runs = ledger.runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 3 + 6, "{runs:?}");
    for (index, (key, attempt, recovered)) in runs[3..].iter().enumerate() {
        assert_eq!(key, &format!("pay-{}", index + 1));
        assert!(
            *attempt == 2 && *recovered,
            "{key}: attempt {attempt}, recovered {recovered}"
        );
    }
    let effects = ledger.effects.lock().unwrap().clone();
    assert_eq!(effects.len(), 6, "every message's effect, once: {effects:?}");
}

/// A handler that never ends in the middle of a batch does not hold its predecessors back:
/// after the linger their outcomes are recorded and their dispositions handed over (a Kafka
/// partition commits them) while it still runs. Liveness: counting effects would not show it.
#[tokio::test(start_paused = true)]
async fn a_stuck_handler_does_not_hold_back_the_acks_before_it() {
    let (consumer, ledger) = batch_consumer(
        Ledger {
            blocks: Mutex::new(Some("pay-3".into())),
            ..Ledger::default()
        },
        Duration::from_secs(60),
    );
    let messages = payments(1..=4);
    let (decided, mut dispositions) = idempotency_consumer::Decisions::channel();
    let running = {
        let (consumer, messages) = (consumer.clone(), messages.clone());
        tokio::spawn(async move {
            let batch: Vec<&Message> = messages.iter().collect();
            consumer.process_many(&batch, &decided).await;
        })
    };
    assert_eq!(dispositions.recv().await, Some(Disposition::Ack));
    assert_eq!(dispositions.recv().await, Some(Disposition::Ack));
    // Recorded before they were handed over: a redelivery elsewhere is a duplicate.
    let elsewhere = consumer.clone().in_flight_wait(Duration::ZERO);
    assert_eq!(many(&elsewhere, &messages[..2]).await, vec![Disposition::Ack; 2]);
    assert_eq!(ledger.runs.lock().unwrap().len(), 3, "the third still runs");
    assert!(
        dispositions.try_recv().is_err(),
        "nothing after the stuck message"
    );
    running.abort();
}

/// A store that is down fails the batch's claims: the first message is put back and ends the
/// batch; no handler runs.
#[tokio::test(start_paused = true)]
async fn a_batch_on_a_store_that_is_down_runs_nothing_and_is_put_back() {
    let (consumer, charger, store) = consumer(Charger::default());
    store.set_down(true);
    let messages = payments(1..=3);
    let decided = many(&consumer, &messages).await;
    assert!(matches!(decided[..], [Disposition::Nack { .. }]), "{decided:?}");
    assert_eq!(charger.calls.load(Ordering::SeqCst), 0);
    store.set_down(false);
    assert_eq!(many(&consumer, &messages).await, vec![Disposition::Ack; 3]);
    assert_eq!(charger.charges.lock().unwrap().len(), 3);
}

/// A completion of the batch that fails transiently is tried again on its own and the message
/// acked; outcomes that cannot be recorded at all are never acked, and nothing after the
/// first of them is handed over.
#[tokio::test(start_paused = true)]
async fn batch_outcomes_are_acked_only_once_recorded() {
    let (consumer, charger, store) = consumer(Charger::default());
    let consumer = consumer.lease(Duration::from_secs(10));
    let messages = payments(1..=3);
    store.fail_next(Op::Complete, 1);
    assert_eq!(many(&consumer, &messages).await, vec![Disposition::Ack; 3]);
    let unrecorded = payments(4..=6);
    store.fail_next(Op::Complete, u32::MAX);
    let decided = many(&consumer, &unrecorded).await;
    assert!(matches!(decided[..], [Disposition::Nack { .. }]), "{decided:?}");
    assert_eq!(
        charger.charges.lock().unwrap().len(),
        6,
        "the side effects happened"
    );
}

/// In a batch of independent messages (RabbitMQ, JetStream, SQS) a message to be retried is
/// nacked alone: every other message of the batch runs once and is acked. In an ordered batch
/// (a Kafka partition) the same nack ends it.
#[tokio::test(start_paused = true)]
async fn a_nack_ends_an_ordered_batch_but_not_an_unordered_one() {
    let ledger = Ledger {
        failing: vec!["pay-2".into()],
        ..Ledger::default()
    };
    let (consumer, ledger) = batch_consumer(ledger, Duration::from_secs(60));
    let messages = payments(1..=4);
    let nack = Disposition::Nack {
        after: Duration::from_secs(1),
    };
    let unordered = decide(&consumer, &messages, idempotency_consumer::Decisions::unordered()).await;
    assert_eq!(
        unordered,
        vec![Disposition::Ack, nack.clone(), Disposition::Ack, Disposition::Ack]
    );
    for key in ["pay-1", "pay-2", "pay-3", "pay-4"] {
        assert_eq!(ledger.runs_of(key), 1, "{key}");
    }

    let mut batch = payments(5..=7);
    batch.insert(2, Message::keyed("pay-2", "EUR 10"));
    let ordered = many(&consumer, &batch).await;
    assert_eq!(ordered, vec![Disposition::Ack, Disposition::Ack, nack]);
    assert_eq!(ledger.runs_of("pay-7"), 0, "nothing after the nack runs");
}

/// The handlers of a batch of independent messages run at once, as the worker's concurrency
/// ran them before batches: four handlers that each wait for the other three all return.
#[tokio::test(start_paused = true)]
async fn an_unordered_batch_runs_its_handlers_at_once() {
    let ledger = Ledger {
        barrier: Some(Arc::new(tokio::sync::Barrier::new(4))),
        ..Ledger::default()
    };
    let (consumer, ledger) = batch_consumer(ledger, Duration::from_secs(60));
    let messages = payments(1..=4);
    let decided = tokio::time::timeout(
        Duration::from_secs(600),
        decide(&consumer, &messages, idempotency_consumer::Decisions::unordered()),
    )
    .await
    .expect("the handlers waited for each other: they ran one after another");
    assert_eq!(decided, vec![Disposition::Ack; 4]);
    assert_eq!(ledger.runs.lock().unwrap().len(), 4);
}
