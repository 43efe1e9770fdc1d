//! The ack rules of `docs/CONSUMERS.md`, on the reference store with injected faults (Tokio's paused clock
//! makes leases and backoff instant).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_consumer::{
    Backoff, Consumer, Delivery, Disposition, Handler, HandlerError, KeySource, Processor,
};
use idempotency_core::{Attempt, Key, MemoryStore, Outcome};
use idempotency_testkit::FaultyStore;
use idempotency_testkit::faults::Op;

#[derive(Debug, Clone, Default)]
struct Message {
    headers: HashMap<String, Vec<u8>>,
    id: Option<String>,
    payload: Vec<u8>,
    deliveries: u32,
}

impl Message {
    fn keyed(key: &str, payload: &str) -> Self {
        Self {
            headers: HashMap::from([("Idempotency-Key".to_string(), key.as_bytes().to_vec())]),
            payload: payload.as_bytes().to_vec(),
            deliveries: 1,
            ..Self::default()
        }
    }

    fn redelivered(&self) -> Self {
        Self {
            deliveries: self.deliveries + 1,
            ..self.clone()
        }
    }
}

impl Delivery for Message {
    fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.get(name).map(Vec::as_slice)
    }
    fn message_id(&self) -> Option<&str> {
        self.id.as_deref()
    }
    fn payload(&self) -> &[u8] {
        &self.payload
    }
    fn delivery_count(&self) -> u32 {
        self.deliveries
    }
}

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
    let keyless = Message {
        payload: b"EUR 10".to_vec(),
        deliveries: 1,
        ..Message::default()
    };
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
        payload: b"EUR 10".to_vec(),
        deliveries: 1,
        ..Message::default()
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
