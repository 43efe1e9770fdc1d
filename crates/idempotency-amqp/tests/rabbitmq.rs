//! Idempotent consumption against the real RabbitMQ server (`AMQP_URL`, default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`, which `scripts/services` starts): a crash before
//! the ack, a storm of duplicates across ten consumers, delayed retries, dead-lettering with
//! reasons, and a store outage.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use idempotency_amqp::{
    AmqpMessage, DEAD_REASON_HEADER, Topology, Worker, process, publish, replay_dead_letters,
};
use idempotency_consumer::{Backoff, Consumer, Delivery, Disposition, Handler, HandlerError, Processor};
use idempotency_core::{Attempt, Key, MemoryStore, Outcome};
use idempotency_testkit::{FaultyStore, TcpProxy};
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

async fn connect() -> Connection {
    Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("RabbitMQ at {} is needed for this test: {e}", amqp_url()))
}

struct Setup {
    connection: Connection,
    channel: Channel,
    topology: Topology,
    acks: Arc<AtomicUsize>,
}

impl Setup {
    async fn new() -> Self {
        let connection = connect().await;
        let channel = connection.create_channel().await.unwrap();
        let topology =
            Topology::for_queue(&format!("idem-test-{}", Key::generate())).expires(Duration::from_secs(600));
        topology.declare(&channel).await.unwrap();
        Self {
            connection,
            channel,
            topology,
            acks: Arc::default(),
        }
    }

    async fn publish_copy(&self, key: Option<&str>, payload: &str) {
        let mut headers = FieldTable::default();
        if let Some(key) = key {
            headers.insert("Idempotency-Key".into(), AMQPValue::LongString(key.into()));
        }
        self.publish_to(&self.topology.queue, headers, payload.as_bytes())
            .await;
    }

    /// Publishes `payload` with `headers` to `queue` and waits for the confirm.
    async fn publish_to(&self, queue: &str, headers: FieldTable, payload: &[u8]) {
        self.channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                payload,
                BasicProperties::default().with_headers(headers),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// Puts a dead letter of `key` (payload `EUR ??`) on the dead-letter queue, as the consumer
    /// would after four failed deliveries (the test reads its own away to inspect it).
    async fn publish_dead_copy(&self, key: &str) {
        let mut headers = FieldTable::default();
        headers.insert("Idempotency-Key".into(), AMQPValue::LongString(key.into()));
        for (name, value) in idempotency_consumer::dead_letter_headers(&self.topology.queue, 4, "panic: boom")
        {
            headers.insert(name.into(), AMQPValue::LongString(value.as_str().into()));
        }
        headers.insert("x-idempotency-deliveries".into(), AMQPValue::LongInt(4));
        self.publish_to(&self.topology.dead_queue, headers, b"EUR ??")
            .await;
    }

    /// Dead-lettered messages: (key, reason, source, deliveries, when).
    async fn dead_letters(&self) -> Vec<(String, String, String, String, String)> {
        let mut found = Vec::new();
        while let Some(message) = self
            .channel
            .basic_get(
                self.topology.dead_queue.as_str().into(),
                BasicGetOptions { no_ack: true },
            )
            .await
            .unwrap()
        {
            let message = AmqpMessage::new(message.delivery);
            let text = |name: &str| {
                message
                    .header(name)
                    .map(|v| String::from_utf8_lossy(v).into_owned())
                    .unwrap_or_default()
            };
            found.push((
                text("Idempotency-Key"),
                text(DEAD_REASON_HEADER),
                text("Idempotency-Dead-Source"),
                text("Idempotency-Dead-Deliveries"),
                text("Idempotency-Dead-At"),
            ));
        }
        found
    }

    fn worker(&self, consumer: Arc<TestConsumer>, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<()> {
        let (topology, acks) = (self.topology.clone(), Arc::clone(&self.acks));
        tokio::spawn(async move {
            let connection = connect().await;
            let channel = connection.create_channel().await.unwrap();
            topology.declare(&channel).await.unwrap();
            channel.basic_qos(5, BasicQosOptions::default()).await.unwrap();
            let mut deliveries = channel
                .basic_consume(
                    topology.queue.as_str().into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
            while !stop.load(Ordering::SeqCst) {
                let Ok(Some(Ok(delivery))) =
                    tokio::time::timeout(Duration::from_millis(100), deliveries.next()).await
                else {
                    continue;
                };
                if let Ok(Disposition::Ack) = process(&consumer, &channel, &topology, delivery).await {
                    acks.fetch_add(1, Ordering::SeqCst);
                }
            }
            // Dropping a lapin connection does not close it: its consumer would stay registered
            // and be handed (and sit on) later tests' deliveries.
            let _ = channel.close(200, "stopped".into()).await;
            let _ = connection.close(200, "stopped".into()).await;
        })
    }

    async fn cleanup(self) {
        for queue in [
            &self.topology.queue,
            &self.topology.retry_queue,
            &self.topology.dead_queue,
        ] {
            let _ = self
                .channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
    }
}

#[derive(Default)]
struct Charger {
    charges: Mutex<HashMap<String, u32>>,
    calls: AtomicU32,
    fail_first: u32,
    /// How long each call takes.
    hold: Duration,
    /// The key whose every call panics, and how many calls it got.
    poison: Option<&'static str>,
    poison_calls: AtomicU32,
}

impl Handler<AmqpMessage> for Charger {
    async fn handle(&self, message: &AmqpMessage, attempt: &Attempt) -> Result<Outcome, HandlerError> {
        if self.poison == Some(attempt.key().as_str()) {
            self.poison_calls.fetch_add(1, Ordering::SeqCst);
            panic!("poison message: cannot parse the payment");
        }
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        tokio::time::sleep(self.hold).await;
        if call <= self.fail_first {
            return Err(HandlerError::retry(format!("gateway timeout on call {call}")));
        }
        *self
            .charges
            .lock()
            .unwrap()
            .entry(attempt.key().to_string())
            .or_default() += 1;
        Ok(Outcome::new(message.payload().to_vec()))
    }
}

type TestConsumer = Consumer<FaultyStore<MemoryStore>, Arc<Charger>>;

fn consumer(charger: &Arc<Charger>, store: &FaultyStore<MemoryStore>) -> Arc<TestConsumer> {
    Arc::new(
        Consumer::new("amqp-tests", store.clone(), Arc::clone(charger))
            .backoff(Backoff {
                initial: Duration::from_millis(100),
                max: Duration::from_secs(1),
            })
            .max_deliveries(4),
    )
}

async fn until(mut done: impl FnMut() -> bool, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        if done() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_before_the_ack_is_redelivered_and_not_run_again() {
    let setup = Setup::new().await;
    let (charger, store) = (Arc::new(Charger::default()), FaultyStore::new(MemoryStore::new()));
    let consumer = consumer(&charger, &store);
    publish(
        &setup.channel,
        "",
        &setup.topology.queue,
        &Key::new("pay-1").unwrap(),
        b"EUR 10",
    )
    .await
    .unwrap();
    // The first consumer performs the side effect and records it; then its connection is lost
    // before the ack.
    {
        let doomed = connect().await;
        let channel = doomed.create_channel().await.unwrap();
        let message = channel
            .basic_get(setup.topology.queue.as_str().into(), BasicGetOptions::default())
            .await
            .unwrap()
            .expect("the message");
        let message = AmqpMessage::new(message.delivery);
        // Every string header, for adapters that keep messages whole (the inbox).
        assert!(
            message
                .headers()
                .contains(&("Idempotency-Key".to_owned(), b"pay-1".to_vec())),
            "{:?}",
            message.headers()
        );
        let verdict = consumer.process(&message).await;
        assert_eq!(verdict, Disposition::Ack);
        doomed.close(320, "crash".into()).await.unwrap();
    }
    assert_eq!(charger.charges.lock().unwrap().get("pay-1"), Some(&1));
    let stop = Arc::new(AtomicBool::new(false));
    let running = setup.worker(Arc::clone(&consumer), Arc::clone(&stop));
    let acks = Arc::clone(&setup.acks);
    assert!(
        until(|| acks.load(Ordering::SeqCst) == 1, Duration::from_secs(10)).await,
        "the redelivery was not acked"
    );
    stop.store(true, Ordering::SeqCst);
    running.await.unwrap();
    assert_eq!(
        charger.charges.lock().unwrap().get("pay-1"),
        Some(&1),
        "the side effect ran twice"
    );
    assert_eq!(charger.calls.load(Ordering::SeqCst), 1);
    setup.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_duplicates_across_ten_consumers_charges_each_key_once() {
    let setup = Setup::new().await;
    let (charger, store) = (Arc::new(Charger::default()), FaultyStore::new(MemoryStore::new()));
    let consumer = consumer(&charger, &store);
    let keys: Vec<String> = (0..20).map(|i| format!("order-{i}")).collect();
    for _copy in 0..3 {
        for key in &keys {
            setup.publish_copy(Some(key), "EUR 10").await;
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let running: Vec<_> = (0..10)
        .map(|_| setup.worker(Arc::clone(&consumer), Arc::clone(&stop)))
        .collect();
    let acks = Arc::clone(&setup.acks);
    assert!(
        until(|| acks.load(Ordering::SeqCst) == 60, Duration::from_secs(30)).await,
        "acked {} of 60",
        acks.load(Ordering::SeqCst)
    );
    stop.store(true, Ordering::SeqCst);
    for worker in running {
        worker.await.unwrap();
    }
    let charges = charger.charges.lock().unwrap().clone();
    assert_eq!(charges.len(), keys.len());
    assert!(
        charges.values().all(|n| *n == 1),
        "a key was charged twice: {charges:?}"
    );
    setup.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_retried_with_backoff_then_dead_lettered_with_the_reason() {
    let setup = Setup::new().await;
    let (charger, store) = (
        Arc::new(Charger {
            fail_first: 2,
            ..Charger::default()
        }),
        FaultyStore::new(MemoryStore::new()),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let running = setup.worker(consumer(&charger, &store), Arc::clone(&stop));
    publish(
        &setup.channel,
        "",
        &setup.topology.queue,
        &Key::new("flaky").unwrap(),
        b"EUR 10",
    )
    .await
    .unwrap();
    let acks = Arc::clone(&setup.acks);
    assert!(until(|| acks.load(Ordering::SeqCst) == 1, Duration::from_secs(10)).await);
    stop.store(true, Ordering::SeqCst);
    running.await.unwrap();
    assert_eq!(charger.calls.load(Ordering::SeqCst), 3);
    assert_eq!(charger.charges.lock().unwrap().get("flaky"), Some(&1));

    let (charger, store) = (
        Arc::new(Charger {
            fail_first: u32::MAX,
            ..Charger::default()
        }),
        FaultyStore::new(MemoryStore::new()),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let running = setup.worker(consumer(&charger, &store), Arc::clone(&stop));
    publish(
        &setup.channel,
        "",
        &setup.topology.queue,
        &Key::new("hopeless").unwrap(),
        b"EUR 10",
    )
    .await
    .unwrap();
    let calls = Arc::clone(&charger);
    assert!(
        until(
            || calls.calls.load(Ordering::SeqCst) == 4,
            Duration::from_secs(15)
        )
        .await
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    running.await.unwrap();
    let dead = setup.dead_letters().await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, "hopeless");
    assert!(dead[0].1.contains("failed 4 deliveries"), "{dead:?}");
    assert_eq!(
        charger.calls.load(Ordering::SeqCst),
        4,
        "no delivery past the limit"
    );
    setup.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_key_and_a_reused_key_are_dead_lettered_not_dropped() {
    let setup = Setup::new().await;
    let (charger, store) = (Arc::new(Charger::default()), FaultyStore::new(MemoryStore::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let running = setup.worker(consumer(&charger, &store), Arc::clone(&stop));
    setup.publish_copy(None, "EUR 10").await;
    setup.publish_copy(Some("pay-7"), "EUR 10").await;
    let acks = Arc::clone(&setup.acks);
    assert!(until(|| acks.load(Ordering::SeqCst) == 1, Duration::from_secs(10)).await);
    setup.publish_copy(Some("pay-7"), "EUR 99").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    running.await.unwrap();
    let mut dead = setup.dead_letters().await;
    dead.sort();
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert!(
        dead[0].0.is_empty() && dead[0].1 == "no Idempotency-Key header",
        "{dead:?}"
    );
    assert!(
        dead[1].0 == "pay-7" && dead[1].1.contains("different payload"),
        "{dead:?}"
    );
    assert_eq!(charger.charges.lock().unwrap().get("pay-7"), Some(&1));
    setup.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_store_is_down_nothing_is_acked_or_lost() {
    let setup = Setup::new().await;
    let (charger, store) = (Arc::new(Charger::default()), FaultyStore::new(MemoryStore::new()));
    store.set_down(true);
    let stop = Arc::new(AtomicBool::new(false));
    let running = setup.worker(consumer(&charger, &store), Arc::clone(&stop));
    for i in 0..5 {
        publish(
            &setup.channel,
            "",
            &setup.topology.queue,
            &Key::new(format!("pay-{i}")).unwrap(),
            b"EUR 10",
        )
        .await
        .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        setup.acks.load(Ordering::SeqCst),
        0,
        "acked while the store was down"
    );
    assert_eq!(charger.calls.load(Ordering::SeqCst), 0);
    assert!(
        setup.dead_letters().await.is_empty(),
        "nothing may be dead-lettered for an outage"
    );
    store.set_down(false);
    let acks = Arc::clone(&setup.acks);
    assert!(
        until(|| acks.load(Ordering::SeqCst) == 5, Duration::from_secs(15)).await,
        "not processed after recovery"
    );
    stop.store(true, Ordering::SeqCst);
    running.await.unwrap();
    let charges = charger.charges.lock().unwrap().clone();
    assert_eq!(charges.len(), 5);
    assert!(charges.values().all(|n| *n == 1), "{charges:?}");
    setup.cleanup().await;
}

/// Ready messages in `queue` (unacknowledged ones are not counted).
async fn ready(channel: &Channel, queue: &str) -> u32 {
    channel
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap()
        .message_count()
}

/// Runs `worker` on a task of its own until the returned sender is used (or dropped).
fn spawn_worker(
    worker: Worker<TestConsumer>,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), idempotency_amqp::AmqpError>>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        worker
            .run_until(async {
                let _ = stopped.await;
            })
            .await
    });
    (stop, running)
}

/// A proxy in front of the broker, and the broker's URL through it: amqp://user:pass@HOST:PORT/vhost
/// with HOST:PORT replaced by the proxy's address.
async fn broker_through_a_proxy() -> (TcpProxy, String) {
    let url = amqp_url();
    let (head, rest) = url.split_once("://").unwrap();
    let (credentials, rest) = rest.rsplit_once('@').unwrap_or(("", rest));
    let (authority, vhost) = rest.split_once('/').unwrap_or((rest, ""));
    let broker = tokio::net::lookup_host(authority).await.unwrap().next().unwrap();
    let proxy = TcpProxy::start(broker).await.unwrap();
    let at = if credentials.is_empty() { "" } else { "@" };
    let proxied = format!(
        "{head}://{credentials}{at}127.0.0.1:{}/{vhost}",
        proxy.addr().port()
    );
    (proxy, proxied)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_reconnects_after_losing_the_broker_and_charges_each_key_once() {
    let setup = Setup::new().await;
    let (proxy, proxied) = broker_through_a_proxy().await;

    let charger = Arc::new(Charger {
        hold: Duration::from_millis(10),
        ..Charger::default()
    });
    let store = FaultyStore::new(MemoryStore::new());
    let keys: Vec<String> = (0..150).map(|i| format!("order-{i}")).collect();
    for key in &keys {
        setup.publish_copy(Some(key), "EUR 10").await;
    }
    let worker = Worker::new(proxied, setup.topology.clone(), consumer(&charger, &store)).prefetch(8);
    let (stop, running) = spawn_worker(worker);
    let charged = |charger: &Charger| charger.charges.lock().unwrap().len();
    assert!(until(|| charged(&charger) >= 30, Duration::from_secs(10)).await);
    // The broker goes away with deliveries in flight, and stays away for a second.
    proxy.set_down(true);
    proxy.cut();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        charged(&charger) < keys.len(),
        "the outage came too late to test anything"
    );
    proxy.set_down(false);
    assert!(
        until(|| charged(&charger) == keys.len(), Duration::from_secs(30)).await,
        "charged {} of {} keys",
        charged(&charger),
        keys.len()
    );
    // Every delivery settles: nothing waits in the queue or its retry queue.
    let settled = async {
        ready(&setup.channel, &setup.topology.queue).await
            + ready(&setup.channel, &setup.topology.retry_queue).await
    };
    let mut left = settled.await;
    for _ in 0..100 {
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        left = ready(&setup.channel, &setup.topology.queue).await
            + ready(&setup.channel, &setup.topology.retry_queue).await;
    }
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert_eq!(left, 0, "messages left unsettled");
    assert!(proxy.accepted() >= 2, "the worker did not reconnect");
    let charges = charger.charges.lock().unwrap().clone();
    assert!(
        charges.values().all(|&n| n == 1),
        "a key was charged twice: {charges:?}"
    );
    assert!(setup.dead_letters().await.is_empty());
    setup.cleanup().await;
}

#[tokio::test]
async fn a_worker_refuses_a_topology_the_broker_rejects() {
    let setup = Setup::new().await;
    // The retry queue exists without its dead-letter arguments: a declaration conflict.
    let clash = Topology::for_queue(&format!("idem-clash-{}", Key::generate()));
    setup
        .channel
        .queue_declare(
            clash.retry_queue.as_str().into(),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let charger = Arc::new(Charger::default());
    let worker = Worker::new(
        amqp_url(),
        clash.clone(),
        consumer(&charger, &FaultyStore::new(MemoryStore::new())),
    );
    let refused = tokio::time::timeout(Duration::from_secs(10), worker.run_until(std::future::pending()))
        .await
        .expect("a refused topology must end the worker")
        .unwrap_err();
    assert!(refused.to_string().contains("PRECONDITION_FAILED"), "{refused}");
    for queue in [&clash.queue, &clash.retry_queue, &clash.dead_queue] {
        let _ = setup
            .channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    setup.cleanup().await;
}

#[tokio::test]
async fn an_expiring_topology_declares_x_expires_on_its_queues() {
    let setup = Setup::new().await;
    // Setup's topology expires; declaring its queues without x-expires is a conflict.
    let plain = Topology::for_queue(&setup.topology.queue);
    let channel = setup.connection.create_channel().await.unwrap();
    let refused = plain.declare(&channel).await.unwrap_err();
    assert!(refused.to_string().contains("x-expires"), "{refused}");
    let again = setup.connection.create_channel().await.unwrap();
    setup.topology.declare(&again).await.unwrap();
    setup.cleanup().await;
}

/// A handler that panics on one message every time: the worker keeps consuming the others
/// throughout (each charged exactly once), and the poison message is dead-lettered with reason
/// `panic` after exactly `max_deliveries` (4) attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_is_dead_lettered_and_the_worker_keeps_consuming() {
    let setup = Setup::new().await;
    let charger = Arc::new(Charger {
        hold: Duration::from_millis(5),
        poison: Some("poison"),
        ..Charger::default()
    });
    let store = FaultyStore::new(MemoryStore::new());
    setup.publish_copy(Some("poison"), "EUR ??").await;
    let healthy: Vec<String> = (0..40).map(|i| format!("order-{i}")).collect();
    for key in &healthy[..20] {
        setup.publish_copy(Some(key), "EUR 10").await;
    }
    let worker = Worker::new(amqp_url(), setup.topology.clone(), consumer(&charger, &store)).prefetch(4);
    let (stop, running) = spawn_worker(worker);
    let poisoned = Arc::clone(&charger);
    assert!(
        until(
            || poisoned.poison_calls.load(Ordering::SeqCst) >= 2,
            Duration::from_secs(15)
        )
        .await,
        "the poison message was not redelivered"
    );
    // More work arrives while the poison message is still being retried.
    for key in &healthy[20..] {
        setup.publish_copy(Some(key), "EUR 10").await;
    }
    let charged = |charger: &Charger| charger.charges.lock().unwrap().len();
    assert!(
        until(|| charged(&charger) == healthy.len(), Duration::from_secs(20)).await,
        "charged {} of {}",
        charged(&charger),
        healthy.len()
    );
    let mut dead = Vec::new();
    for _ in 0..100 {
        dead = setup.dead_letters().await;
        if !dead.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!running.is_finished(), "the worker stopped");
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, "poison");
    assert!(dead[0].1.starts_with("panic:"), "{dead:?}");
    assert!(dead[0].1.contains("cannot parse the payment"), "{dead:?}");
    // What an operator needs to look at it and replay it: where from, how often, when.
    assert_eq!(
        (dead[0].2.as_str(), dead[0].3.as_str()),
        (setup.topology.queue.as_str(), "4"),
        "{dead:?}"
    );
    assert!(httpdate::parse_http_date(&dead[0].4).is_ok(), "{dead:?}");
    assert_eq!(
        charger.poison_calls.load(Ordering::SeqCst),
        4,
        "exactly max_deliveries attempts"
    );
    let charges = charger.charges.lock().unwrap().clone();
    assert!(charges.values().all(|&n| n == 1), "{charges:?}");

    // The fix is deployed (the handler no longer panics on it): the dead letter is replayed
    // to its queue, with a fresh delivery count, and charged once.
    setup.publish_dead_copy("poison").await;
    let fixed = Arc::new(Charger::default());
    let stop = Arc::new(AtomicBool::new(false));
    let running = setup.worker(consumer(&fixed, &store), Arc::clone(&stop));
    assert_eq!(
        replay_dead_letters(&setup.channel, &setup.topology, 10)
            .await
            .unwrap(),
        1
    );
    assert!(
        until(
            || fixed.charges.lock().unwrap().get("poison") == Some(&1),
            Duration::from_secs(10)
        )
        .await
    );
    stop.store(true, Ordering::SeqCst);
    running.await.unwrap();
    assert!(setup.dead_letters().await.is_empty());
    setup.cleanup().await;
}

/// A quorum queue's `x-delivery-count` counts the broker's own redeliveries (a worker that died
/// before settling), which the requeue header cannot see.
#[tokio::test]
async fn quorum_queues_delivery_count_is_counted() {
    let setup = Setup::new().await;
    let mut headers = FieldTable::default();
    headers.insert("x-delivery-count".into(), AMQPValue::LongLongInt(6));
    headers.insert("Idempotency-Key".into(), AMQPValue::LongString("k".into()));
    setup.publish_to(&setup.topology.queue, headers, b"x").await;
    let got = setup
        .channel
        .basic_get(
            setup.topology.queue.as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
        .expect("the message");
    assert_eq!(AmqpMessage::new(got.delivery).delivery_count(), 7);
    setup.cleanup().await;
}

/// `idempotency_amqp_reconnects_total{queue}` counts a worker's reconnections.
#[test]
fn reconnections_are_counted() {
    let mut queue = String::new();
    let metrics = idempotency_testkit::recorded::record_metrics(async {
        let setup = Setup::new().await;
        queue = setup.topology.queue.clone();
        let (proxy, proxied) = broker_through_a_proxy().await;
        let charger = Arc::new(Charger::default());
        let store = FaultyStore::new(MemoryStore::new());
        let worker = Worker::new(proxied, setup.topology.clone(), consumer(&charger, &store));
        let (stop, running) = spawn_worker(worker);
        assert!(until(|| proxy.accepted() >= 1, Duration::from_secs(10)).await);
        tokio::time::sleep(Duration::from_millis(300)).await;
        proxy.cut();
        assert!(
            until(|| proxy.accepted() >= 2, Duration::from_secs(10)).await,
            "no reconnection"
        );
        stop.send(()).unwrap();
        running.await.unwrap().unwrap();
        setup.cleanup().await;
    });
    assert!(
        metrics.counter("idempotency_amqp_reconnects_total", &[("queue", queue.as_str())]) >= 1,
        "{metrics:?}"
    );
}
