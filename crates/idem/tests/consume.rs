//! `idem consume` from the outside: the binary as a process of its own between RabbitMQ and an
//! HTTP handler (this test's, with a ledger of every call), and its refusals of bad input.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use common::Process;
use idempotency::Key;
use idempotency_amqp::{Topology, publish};
use lapin::BasicProperties;
use lapin::options::{BasicGetOptions, BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection, ConnectionProperties};

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// What the handler answers for a key, call after call (then 200).
type Script = HashMap<String, Vec<(u16, &'static str)>>;

/// Every call the handler got: key → the `Idempotency-Attempt` of each call.
#[derive(Clone, Default)]
struct Ledger {
    calls: Arc<Mutex<HashMap<String, Vec<u32>>>>,
    script: Arc<Mutex<Script>>,
    /// Keys whose long call ran to its end.
    finished: Arc<Mutex<Vec<String>>>,
    /// The `content-type` of each key's last call.
    content_types: Arc<Mutex<HashMap<String, String>>>,
}

impl Ledger {
    fn calls(&self, key: &str) -> Vec<u32> {
        self.calls.lock().unwrap().get(key).cloned().unwrap_or_default()
    }
}

async fn handle(State(ledger): State<Ledger>, headers: HeaderMap, body: String) -> (StatusCode, String) {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    if let Some(content_type) = headers.get("content-type").and_then(|v| v.to_str().ok()) {
        ledger
            .content_types
            .lock()
            .unwrap()
            .insert(key.clone(), content_type.to_owned());
    }
    let attempt = headers
        .get("idempotency-attempt")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    ledger
        .calls
        .lock()
        .unwrap()
        .entry(key.clone())
        .or_default()
        .push(attempt);
    // `sleep:N` in the body: a long handler, N ms.
    if let Some(ms) = body.strip_prefix("sleep:").and_then(|ms| ms.parse().ok()) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        ledger.finished.lock().unwrap().push(key.clone());
    }
    let next = ledger
        .script
        .lock()
        .unwrap()
        .get_mut(&key)
        .filter(|answers| !answers.is_empty())
        .map(|answers| answers.remove(0));
    // `big:N` in the body: an answer of N bytes.
    if let Some(len) = body.strip_prefix("big:").and_then(|n| n.parse().ok()) {
        return (StatusCode::OK, "x".repeat(len));
    }
    match next {
        Some((status, text)) => (StatusCode::from_u16(status).unwrap(), text.to_owned()),
        None => (StatusCode::OK, format!("handled {body}")),
    }
}

/// The handler, on a loopback port of its own.
async fn start_handler(ledger: Ledger) -> SocketAddr {
    start_handler_on("127.0.0.1:0".parse().unwrap(), ledger).await
}

async fn start_handler_on(addr: SocketAddr, ledger: Ledger) -> SocketAddr {
    let app = axum::Router::new()
        .route("/messages", axum::routing::post(handle))
        .with_state(ledger);
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// A queue of the test's own, declared as `idem consume` declares it, and a channel on it.
async fn fresh_queue(name: &str) -> (Connection, Channel, String) {
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("RabbitMQ at {} is needed for this test: {e}", amqp_url()));
    let channel = connection.create_channel().await.unwrap();
    let queue = format!("idem-consume-{name}-{}", Key::generate());
    Topology::for_queue(&queue).declare(&channel).await.unwrap();
    (connection, channel, queue)
}

async fn start_consume(queue: &str, handler: SocketAddr, admin: SocketAddr) -> Process {
    // A short lease: a copy that arrives while the first is running comes back once the
    // lease's remaining time has passed (the consumer core's wait for a key in flight).
    start_consume_with(queue, handler, admin, &["--store", "memory://", "--lease", "3s"]).await
}

async fn start_consume_with(queue: &str, handler: SocketAddr, admin: SocketAddr, more: &[&str]) -> Process {
    let child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args([
            "consume",
            "--from",
            &format!("{}?queue={queue}", amqp_url()),
            "--to",
            &format!("http://{handler}/messages"),
            "--admin-listen",
            &admin.to_string(),
        ])
        .args(more)
        .env(
            "IDEM_LOG",
            std::env::var("IDEM_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start idem consume");
    // Ready once its admin endpoint answers (the store is open then).
    common::ready(Process { child }, admin, "idem consume").await
}

/// Waits until `done` holds, at most 30 s.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    idempotency_testkit::eventually(Duration::from_secs(30), what, async || done()).await;
}

/// The messages waiting in `queue` (none in flight: a passive declare counts the ready ones).
async fn waiting(channel: &Channel, queue: &str) -> u32 {
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap()
        .message_count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_published_three_times_is_handled_once() {
    let ledger = Ledger::default();
    let handler = start_handler(ledger.clone()).await;
    let (_connection, channel, queue) = fresh_queue("dups").await;
    let admin = common::free_addr();
    let _consume = start_consume(&queue, handler, admin).await;
    let keys: Vec<Key> = (0..20).map(|i| Key::new(format!("order-{i}")).unwrap()).collect();
    for _ in 0..3 {
        for key in &keys {
            publish(&channel, "", &queue, key, key.as_str().as_bytes())
                .await
                .unwrap();
        }
    }
    let client = common::client();
    let duplicates = "idempotency_consumer_messages_total";
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let seen = common::metric(&client, admin, duplicates, &[("result", "duplicate")]).await;
        let executed = common::metric(&client, admin, duplicates, &[("result", "executed")]).await;
        if seen + executed >= 60.0 {
            assert_eq!(executed, 20.0);
            break;
        }
        if Instant::now() > deadline {
            let mut counts = Vec::new();
            for result in ["executed", "duplicate", "in_flight", "retried", "dead_lettered"] {
                counts.push((
                    result,
                    common::metric(&client, admin, duplicates, &[("result", result)]).await,
                ));
            }
            panic!("not every copy was settled after 30 s: {counts:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for key in &keys {
        assert_eq!(ledger.calls(key.as_str()), vec![1], "{key}");
    }
    assert_eq!(waiting(&channel, &queue).await, 0, "every copy was acked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_failing_twice_is_called_three_times_and_the_message_acked_once() {
    let ledger = Ledger::default();
    ledger
        .script
        .lock()
        .unwrap()
        .insert("flaky".into(), vec![(500, "down"), (503, "still down")]);
    let handler = start_handler(ledger.clone()).await;
    let (_connection, channel, queue) = fresh_queue("flaky").await;
    let admin = common::free_addr();
    let _consume = start_consume(&queue, handler, admin).await;
    publish(&channel, "", &queue, &Key::new("flaky").unwrap(), b"charge")
        .await
        .unwrap();
    until("three calls", || ledger.calls("flaky").len() == 3).await;
    let client = common::client();
    let name = "idempotency_consumer_messages_total";
    common::metric_at_least(admin, name, &[("result", "executed")], 1.0).await;
    assert_eq!(
        ledger.calls("flaky"),
        vec![1, 2, 3],
        "each retry is the next attempt"
    );
    assert_eq!(
        common::metric(&client, admin, name, &[("result", "retried")]).await,
        2.0
    );
    assert_eq!(
        common::metric(&client, admin, name, &[("result", "dead_lettered")]).await,
        0.0
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(ledger.calls("flaky").len(), 3, "no call after the success");
    assert_eq!(waiting(&channel, &queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_message_is_dead_lettered_with_the_status() {
    let ledger = Ledger::default();
    ledger
        .script
        .lock()
        .unwrap()
        .insert("bad".into(), vec![(422, "amount must be positive")]);
    let handler = start_handler(ledger.clone()).await;
    let (_connection, channel, queue) = fresh_queue("refused").await;
    let admin = common::free_addr();
    let _consume = start_consume(&queue, handler, admin).await;
    publish(&channel, "", &queue, &Key::new("bad").unwrap(), b"-5")
        .await
        .unwrap();
    let dead = format!("{queue}.dead");
    let deadline = Instant::now() + Duration::from_secs(30);
    let message = loop {
        if let Some(message) = channel
            .basic_get(dead.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            break message;
        }
        assert!(Instant::now() < deadline, "nothing was dead-lettered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let headers = message.delivery.properties.headers().clone().unwrap_or_default();
    let reason = match headers.inner().get("Idempotency-Dead-Reason") {
        Some(AMQPValue::LongString(reason)) => String::from_utf8_lossy(reason.as_bytes()).into_owned(),
        other => panic!("no reason: {other:?}"),
    };
    assert!(reason.contains("422"), "{reason}");
    assert!(reason.contains("amount must be positive"), "{reason}");
    assert_eq!(message.delivery.data, b"-5");
    assert_eq!(ledger.calls("bad"), vec![1], "a refused message is not retried");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_success_too_long_to_keep_is_recorded_not_run_again() {
    let ledger = Ledger::default();
    let handler = start_handler(ledger.clone()).await;
    let (_connection, channel, queue) = fresh_queue("big").await;
    let admin = common::free_addr();
    let _consume = start_consume(&queue, handler, admin).await;
    let key = Key::new("big").unwrap();
    for _ in 0..2 {
        publish(&channel, "", &queue, &key, b"big:3000000").await.unwrap();
    }
    let client = common::client();
    let name = "idempotency_consumer_messages_total";
    let deadline = Instant::now() + Duration::from_secs(30);
    while common::metric(&client, admin, name, &[("result", "duplicate")]).await < 1.0 {
        if Instant::now() > deadline {
            let mut counts = Vec::new();
            for result in ["executed", "duplicate", "in_flight", "retried", "dead_lettered"] {
                counts.push((
                    result,
                    common::metric(&client, admin, name, &[("result", result)]).await,
                ));
            }
            panic!(
                "the copy was not answered from the record: {counts:?}, calls {:?}",
                ledger.calls("big")
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        common::metric(&client, admin, name, &[("result", "executed")]).await,
        1.0
    );
    assert_eq!(ledger.calls("big"), vec![1]);
    assert_eq!(waiting(&channel, &queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_wait_while_the_handler_is_down_and_none_is_lost() {
    let ledger = Ledger::default();
    // Nothing listens on the handler's address for the first 5 s.
    let handler = common::free_addr();
    let (_connection, channel, queue) = fresh_queue("outage").await;
    let admin = common::free_addr();
    let _consume = start_consume(&queue, handler, admin).await;
    let keys: Vec<Key> = (0..10)
        .map(|i| Key::new(format!("waiting-{i}")).unwrap())
        .collect();
    for key in &keys {
        publish(&channel, "", &queue, key, b"charge").await.unwrap();
    }
    let client = common::client();
    let name = "idempotency_consumer_messages_total";
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(common::metric(&client, admin, name, &[("result", "retried")]).await >= 10.0);
    assert_eq!(
        common::metric(&client, admin, name, &[("result", "dead_lettered")]).await,
        0.0
    );
    start_handler_on(handler, ledger.clone()).await;
    common::metric_at_least(admin, name, &[("result", "executed")], 10.0).await;
    for key in &keys {
        assert_eq!(ledger.calls(key.as_str()).len(), 1, "{key}");
    }
    assert_eq!(
        common::metric(&client, admin, name, &[("result", "dead_lettered")]).await,
        0.0
    );
    assert_eq!(waiting(&channel, &format!("{queue}.dead")).await, 0);
    assert_eq!(waiting(&channel, &queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_call_lets_the_call_finish_be_recorded_and_acked() {
    let ledger = Ledger::default();
    let handler = start_handler(ledger.clone()).await;
    let (_connection, channel, queue) = fresh_queue("sigterm").await;
    let mut consume = start_consume(&queue, handler, common::free_addr()).await;
    publish(&channel, "", &queue, &Key::new("long").unwrap(), b"sleep:1500")
        .await
        .unwrap();
    until("the call started", || ledger.calls("long").len() == 1).await;
    let status = consume
        .terminate(Duration::from_secs(20))
        .expect("idem consume exits");
    assert!(status.success(), "{status}");
    assert_eq!(*ledger.finished.lock().unwrap(), vec!["long".to_owned()]);
    assert_eq!(
        waiting(&channel, &queue).await,
        0,
        "the message was acked, not returned"
    );
    assert_eq!(ledger.calls("long"), vec![1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_call_waits_for_the_lease_then_runs_attempt_two() {
    let ledger = Ledger::default();
    let handler = start_handler(ledger.clone()).await;
    let (_connection, channel, queue) = fresh_queue("kill").await;
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("idem.db").display());
    let settings = ["--store", store.as_str(), "--lease", "4s"];
    let mut consume = start_consume_with(&queue, handler, common::free_addr(), &settings).await;
    publish(&channel, "", &queue, &Key::new("killed").unwrap(), b"sleep:300")
        .await
        .unwrap();
    until("the call started", || ledger.calls("killed").len() == 1).await;
    consume.kill9();
    let killed_at = Instant::now();
    // The broker redelivers; the record's lease still runs: no call until it ends.
    let admin = common::free_addr();
    let _consume = start_consume_with(&queue, handler, admin, &settings).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while ledger.calls("killed").len() < 2 {
        assert!(Instant::now() < deadline, "the message never ran again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        killed_at.elapsed() >= Duration::from_secs(3),
        "called again {:?} after the kill, inside the 4 s lease",
        killed_at.elapsed()
    );
    assert_eq!(ledger.calls("killed"), vec![1, 2], "the retry is attempt 2");
    let name = "idempotency_consumer_messages_total";
    common::metric_at_least(admin, name, &[("result", "executed")], 1.0).await;
    assert_eq!(waiting(&channel, &queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_content_type_property_reaches_the_handler() {
    let ledger = Ledger::default();
    let handler = start_handler(ledger.clone()).await;
    let (_connection, channel, queue) = fresh_queue("content-type").await;
    let _consume = start_consume(&queue, handler, common::free_addr()).await;
    let mut headers = FieldTable::default();
    headers.insert(
        "Idempotency-Key".into(),
        AMQPValue::LongString(LongString::from("typed")),
    );
    let properties = BasicProperties::default()
        .with_headers(headers)
        .with_content_type("application/json".into());
    channel
        .basic_publish(
            "".into(),
            queue.as_str().into(),
            BasicPublishOptions::default(),
            b"{\"amount\":1000}",
            properties,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    publish(&channel, "", &queue, &Key::new("untyped").unwrap(), b"raw")
        .await
        .unwrap();
    until("both calls", || {
        ledger.calls("typed").len() == 1 && ledger.calls("untyped").len() == 1
    })
    .await;
    let seen = ledger.content_types.lock().unwrap().clone();
    assert_eq!(seen["typed"], "application/json", "{seen:?}");
    assert_eq!(seen["untyped"], "application/octet-stream", "{seen:?}");
}

#[test]
fn bad_input_is_refused_with_a_clear_error() {
    let amqp = amqp_url();
    let cases: Vec<(Vec<String>, i32, &str)> = vec![
        (
            vec![
                "--from".into(),
                "ftp://u:s3cret@h/x".into(),
                "--to".into(),
                "http://127.0.0.1:1/m".into(),
            ],
            1,
            "unknown scheme `ftp`",
        ),
        (
            vec![
                "--from".into(),
                amqp.clone(),
                "--to".into(),
                "http://127.0.0.1:1/m".into(),
            ],
            1,
            "names no queue",
        ),
        (
            vec![
                "--from".into(),
                "nats://127.0.0.1:1?stream=S&consumer=C".into(),
                "--to".into(),
                "http://127.0.0.1:1/m".into(),
                "--store".into(),
                "memory://".into(),
            ],
            1,
            "cannot connect to the server",
        ),
        (
            vec![
                "--from".into(),
                "nats://127.0.0.1:4222?stream=S".into(),
                "--to".into(),
                "http://127.0.0.1:1/m".into(),
            ],
            1,
            "names no consumer",
        ),
        (
            vec![
                "--from".into(),
                format!("{amqp}?queue=q"),
                "--to".into(),
                "https://h/m".into(),
            ],
            1,
            "https is not supported",
        ),
        (
            vec![
                "--from".into(),
                format!("{amqp}?queue=q"),
                "--to".into(),
                "ftp://h/m".into(),
            ],
            1,
            "not an http:// URL",
        ),
        (
            vec![
                "--from".into(),
                "amqp://u:s3cret@127.0.0.1:1/%2f?queue=q".into(),
                "--to".into(),
                "http://127.0.0.1:1/m".into(),
                "--store".into(),
                "memory://".into(),
            ],
            1,
            "cannot connect to the broker",
        ),
        (
            vec![
                "--from".into(),
                format!("{amqp}?queue=q"),
                "--to".into(),
                "http://127.0.0.1:1/m".into(),
                "--handler-timeout".into(),
                "soon".into(),
            ],
            2,
            "--handler-timeout",
        ),
        (
            vec![
                "--from".into(),
                format!("{amqp}?queue=q"),
                "--to".into(),
                "http://127.0.0.1:1/m".into(),
                "--name".into(),
                "two words".into(),
            ],
            2,
            "not a valid consumer name",
        ),
        (vec!["--to".into(), "http://127.0.0.1:1/m".into()], 2, "--from"),
    ];
    for (args, code, message) in cases {
        let mut all = vec!["consume"];
        all.extend(args.iter().map(String::as_str));
        let (status, _, err) = common::idem(&all);
        assert_eq!(status, code, "{args:?}: {err}");
        assert!(err.contains(message), "{args:?}: {err}");
        assert!(!err.contains("s3cret"), "{args:?}: the password leaked: {err}");
    }
}
