//! What is RabbitMQ's own, against the real server (`AMQP_URL`, default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`, which `scripts/services` starts): reconnection
//! after losing the broker, topology declarations, quorum queues' delivery count, and replaying
//! dead letters. What every broker must do is the broker suite's (`tests/suite.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use idempotency_amqp::{AmqpMessage, Topology, Worker, process, replay_dead_letters};
use idempotency_consumer::{Backoff, Consumer, Delivery, Disposition};
use idempotency_core::{Key, MemoryStore};
use idempotency_testkit::brokers::{Charger, spawn_until_stopped, stop_and_wait};
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

type TestConsumer = Consumer<FaultyStore<MemoryStore>, Charger>;

fn consumer(charger: &Charger, store: &FaultyStore<MemoryStore>) -> Arc<TestConsumer> {
    Arc::new(
        Consumer::new("amqp-tests", store.clone(), charger.clone())
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

/// Ready messages in `queue` (unacknowledged ones are not counted).
async fn ready(channel: &Channel, queue: &str) -> u32 {
    look_at(channel, queue).await.message_count()
}

/// Consumers registered on `queue`.
async fn consumers(channel: &Channel, queue: &str) -> u32 {
    look_at(channel, queue).await.consumer_count()
}

/// `queue` as a passive declaration sees it.
async fn look_at(channel: &Channel, queue: &str) -> lapin::Queue {
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
}

/// Waits until a consumer is registered on the setup's queue: a worker's set-up is complete.
async fn until_consuming(setup: &Setup) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::time::Instant::now() < deadline {
        if consumers(&setup.channel, &setup.topology.queue).await >= 1 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// Runs `worker` on a task of its own until the returned sender is used (or dropped).
fn spawn_worker(
    worker: Worker<TestConsumer>,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), idempotency_amqp::AdapterError>>,
) {
    spawn_until_stopped(|stopped| async move { worker.run_until(stopped).await })
}

/// A proxy in front of the broker, and the broker's URL through it (the same credentials and
/// vhost, the proxy's address).
async fn broker_through_a_proxy() -> (TcpProxy, String) {
    TcpProxy::in_front_of(&amqp_url()).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_reconnects_after_losing_the_broker_and_charges_each_key_once() {
    let setup = Setup::new().await;
    let (proxy, proxied) = broker_through_a_proxy().await;

    let charger = Charger::default();
    let store = FaultyStore::new(MemoryStore::new());
    let keys: Vec<String> = (0..150).map(|i| format!("order-{i}")).collect();
    for key in &keys {
        setup.publish_copy(Some(key), "sleep:10").await;
    }
    let worker = Worker::new(proxied, setup.topology.clone(), consumer(&charger, &store)).prefetch(8);
    let (stop, running) = spawn_worker(worker);
    let charged = |charger: &Charger| charger.0.all_effects().len();
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
    stop_and_wait(stop, running).await.unwrap();
    assert_eq!(left, 0, "messages left unsettled");
    assert!(proxy.accepted() >= 2, "the worker did not reconnect");
    let charges = charger.0.all_effects();
    assert!(
        charges.values().all(|&n| n == 1),
        "a key was charged twice: {charges:?}"
    );
    assert_eq!(
        ready(&setup.channel, &setup.topology.dead_queue).await,
        0,
        "dead-lettered"
    );
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
    let charger = Charger::default();
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

/// A dead letter put back after the fix (`replay_dead_letters`) goes to its queue with a fresh
/// delivery count and runs once; the dead-letter queue is empty after. (How a message gets
/// there is the broker suite's `a_poison_message_is_dead_lettered_and_the_worker_goes_on`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_replayed_after_the_fix_runs_once() {
    let setup = Setup::new().await;
    let (fixed, store) = (Charger::default(), FaultyStore::new(MemoryStore::new()));
    setup.publish_dead_copy("poison").await;
    let stop = Arc::new(AtomicBool::new(false));
    let running = setup.worker(consumer(&fixed, &store), Arc::clone(&stop));
    assert_eq!(
        replay_dead_letters(&setup.channel, &setup.topology, 10)
            .await
            .unwrap(),
        1
    );
    assert!(until(|| fixed.0.effects("poison") == 1, Duration::from_secs(10)).await);
    stop.store(true, Ordering::SeqCst);
    running.await.unwrap();
    assert_eq!(fixed.0.calls("poison"), [1], "a fresh delivery count, one call");
    assert_eq!(
        ready(&setup.channel, &setup.topology.dead_queue).await,
        0,
        "dead-lettered"
    );
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
        let charger = Charger::default();
        let store = FaultyStore::new(MemoryStore::new());
        let worker = Worker::new(proxied, setup.topology.clone(), consumer(&charger, &store));
        let (stop, running) = spawn_worker(worker);
        assert!(until_consuming(&setup).await, "the worker never consumed");
        proxy.cut();
        assert!(
            until(|| proxy.accepted() >= 2, Duration::from_secs(10)).await,
            "no reconnection"
        );
        stop_and_wait(stop, running).await.unwrap();
        setup.cleanup().await;
    });
    assert!(
        metrics.counter("idempotency_amqp_reconnects_total", &[("queue", queue.as_str())]) >= 1,
        "{metrics:?}"
    );
}

/// A connection lost at any step of the worker's set-up (the handshake, the channel, each
/// declaration, the prefetch, the consume) is a lost connection, not a refused topology: the
/// worker connects again and consumes, even when it was its first attempt. The proxy cuts at
/// each of the set-up's requests in turn, whatever the timing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_at_any_step_of_the_set_up_is_connected_again() {
    let setup = Setup::new().await;
    let (charger, store) = (Charger::default(), FaultyStore::new(MemoryStore::new()));
    let fast = Backoff {
        initial: Duration::from_millis(10),
        max: Duration::from_millis(50),
    };
    // A connection that lapin leaves waiting for the broker's answer (a cut while it opens,
    // before `connection.open-ok`) is ended by the set-up timeout.
    let worker = |proxied: String| {
        Worker::new(proxied, setup.topology.clone(), consumer(&charger, &store))
            .reconnect(fast)
            .set_up_timeout(Duration::from_secs(1))
    };
    // How many requests the set-up takes: counted on a worker left alone until it consumes
    // (idle, it sends nothing more).
    let steps = {
        let (proxy, proxied) = broker_through_a_proxy().await;
        let (stop, running) = spawn_worker(worker(proxied));
        assert!(until_consuming(&setup).await, "the worker never consumed");
        let steps = proxy.round_trips();
        stop_and_wait(stop, running).await.unwrap();
        steps
    };
    assert!(
        steps >= 8,
        "a handshake, a channel, 3 declarations, confirms, prefetch, consume: {steps}"
    );
    for step in 1..=steps {
        let key = format!("cut-at-{step}");
        setup.publish_copy(Some(&key), "EUR 1").await;
        let (proxy, proxied) = broker_through_a_proxy().await;
        proxy.cut_at_round_trip(Some(step));
        let (stop, running) = spawn_worker(worker(proxied));
        assert!(
            until(|| charger.0.effects(&key) == 1, Duration::from_secs(10)).await,
            "cut at request {step} of {steps}: never consumed again (accepted {} connections)",
            proxy.accepted()
        );
        assert!(proxy.accepted() >= 2, "request {step}: the cut happened");
        stop_and_wait(stop, running)
            .await
            .unwrap_or_else(|e| panic!("cut at request {step} of {steps}: {e}"));
    }
    setup.cleanup().await;
}

/// A broker that accepts the connection and then does not answer (a network that drops every
/// packet, a hung load balancer) costs the worker one set-up timeout per attempt, not the
/// worker: it gives the connection up, connects again, and consumes once the broker answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_does_not_answer_the_set_up_is_given_up_and_connected_again() {
    let setup = Setup::new().await;
    let (charger, store) = (Charger::default(), FaultyStore::new(MemoryStore::new()));
    setup.publish_copy(Some("after-the-stall"), "EUR 1").await;
    let (proxy, proxied) = broker_through_a_proxy().await;
    proxy.stall(true);
    let worker = Worker::new(proxied, setup.topology.clone(), consumer(&charger, &store))
        .reconnect(Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(50),
        })
        .set_up_timeout(Duration::from_millis(300));
    let (stop, running) = spawn_worker(worker);
    assert!(
        until(|| proxy.accepted() >= 3, Duration::from_secs(10)).await,
        "the worker kept waiting on a connection that never answered"
    );
    assert_eq!(
        charger.0.effects("after-the-stall"),
        0,
        "nothing got through the stall"
    );
    proxy.stall(false);
    assert!(
        until(
            || charger.0.effects("after-the-stall") == 1,
            Duration::from_secs(10)
        )
        .await,
        "never consumed once the broker answered"
    );
    stop_and_wait(stop, running).await.unwrap();
    setup.cleanup().await;
}

/// The check at start (`idem consume`) connects and closes; a broker that answered the
/// connection and then stops answering (its `close-ok` never comes) has answered: the check
/// passes without waiting on the close for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_start_check_does_not_wait_for_good_on_a_close_never_answered() {
    let (proxy, proxied) = broker_through_a_proxy().await;
    // A probe check counts the connection's requests; the last one is the close.
    let source = idempotency_amqp::AmqpSource::from_url(&format!("{proxied}?queue=checked")).unwrap();
    source.check(Duration::from_secs(10)).await.unwrap();
    let requests = proxy.round_trips();
    proxy.stall_at_round_trip(Some(requests + requests));
    let checked =
        tokio::time::timeout(Duration::from_secs(60), source.check(Duration::from_millis(300))).await;
    checked
        .expect("the check waited for good on a close the broker never answered")
        .unwrap();
    assert_eq!(proxy.round_trips(), requests + requests, "the close was held");
}
