//! `idem consume` from NATS JetStream: the binary as a process of its own between a stream and
//! an HTTP handler with a ledger of every call.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use common::Process;
use futures_util::StreamExt;
use idempotency::Key;

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// Every call the handler got, by key; keys starting with `refuse` are answered 422, those
/// starting with `flaky` 503 on their first call.
#[derive(Clone, Default)]
struct Ledger(Arc<Mutex<HashMap<String, Vec<u32>>>>);

impl Ledger {
    fn calls(&self, key: &str) -> Vec<u32> {
        self.0.lock().unwrap().get(key).cloned().unwrap_or_default()
    }
}

async fn handle(State(ledger): State<Ledger>, headers: HeaderMap) -> (StatusCode, &'static str) {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    let key = header("idempotency-key");
    let attempt = header("idempotency-attempt").parse().unwrap_or(0);
    let calls = {
        let mut ledger = ledger.0.lock().unwrap();
        let calls = ledger.entry(key.clone()).or_default();
        calls.push(attempt);
        calls.len()
    };
    if key.starts_with("slow") {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        ledger
            .0
            .lock()
            .unwrap()
            .entry(format!("{key}:finished"))
            .or_default()
            .push(attempt);
    }
    if key.starts_with("refuse") {
        (StatusCode::UNPROCESSABLE_ENTITY, "no such account")
    } else if key.starts_with("flaky") && calls == 1 {
        (StatusCode::SERVICE_UNAVAILABLE, "busy")
    } else {
        (StatusCode::OK, "done")
    }
}

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

/// A stream of the test's own with a work subject and a dead-letter subject.
struct Setup {
    js: jetstream::Context,
    stream: String,
    work: String,
    dead: String,
}

async fn setup() -> Setup {
    let client = async_nats::connect(nats_url())
        .await
        .unwrap_or_else(|e| panic!("NATS JetStream at {} is needed for this test: {e}", nats_url()));
    let js = jetstream::new(client);
    let id = Key::generate().as_str().replace('-', "");
    let stream = format!("IDEMCONSUME_{id}");
    let (work, dead) = (format!("consume.{id}.work"), format!("consume.{id}.dead"));
    js.create_stream(jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![work.clone(), dead.clone()],
        max_age: Duration::from_secs(600),
        ..Default::default()
    })
    .await
    .unwrap();
    Setup {
        js,
        stream,
        work,
        dead,
    }
}

impl Setup {
    async fn publish(&self, key: &str, payload: &'static [u8]) {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Idempotency-Key", key);
        self.js
            .publish_with_headers(self.work.clone(), headers, payload.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// The dead letters' (key, reason), reading for up to 2 s.
    async fn dead_letters(&self) -> Vec<(String, String)> {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        let reader: jetstream::consumer::PullConsumer = stream
            .create_consumer(jetstream::consumer::pull::Config {
                filter_subject: self.dead.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        let mut batch = reader
            .fetch()
            .max_messages(100)
            .expires(Duration::from_secs(2))
            .messages()
            .await
            .unwrap();
        let mut found = Vec::new();
        while let Some(Ok(message)) = batch.next().await {
            let headers = message.headers.clone().unwrap_or_default();
            let header = |name: &str| {
                headers
                    .get(name)
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default()
            };
            found.push((header("Idempotency-Key"), header("Idempotency-Dead-Reason")));
        }
        found
    }
}

async fn start_consume(setup: &Setup, handler: SocketAddr, admin: SocketAddr) -> Process {
    start_consume_with(setup, handler, admin, &["--store", "memory://", "--lease", "3s"]).await
}

/// `idem consume` on the work subject (ack wait 2 s), with `more` flags.
async fn start_consume_with(setup: &Setup, handler: SocketAddr, admin: SocketAddr, more: &[&str]) -> Process {
    let from = format!(
        "{}?stream={}&consumer=idem&subject={}&dead_letter={}&ack_wait=2s",
        nats_url(),
        setup.stream,
        setup.work,
        setup.dead
    );
    let child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args([
            "consume",
            "--from",
            &from,
            "--to",
            &format!("http://{handler}/messages"),
            "--admin-listen",
            &admin.to_string(),
        ])
        .args(more)
        .env("IDEM_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start idem consume");
    common::ready(Process { child }, admin, "idem consume").await
}

async fn metric_at_least(admin: SocketAddr, result: &str, at_least: f64) {
    common::metric_at_least(
        admin,
        "idempotency_consumer_messages_total",
        &[("result", result)],
        at_least,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_three_times_runs_once_failures_retry_and_refusals_dead_letter() {
    let ledger = Ledger::default();
    let handler = start_handler(ledger.clone()).await;
    let setup = setup().await;
    let admin = common::free_addr();
    let _consume = start_consume(&setup, handler, admin).await;
    let keys: Vec<String> = (0..10).map(|i| format!("order-{i}")).collect();
    for _ in 0..3 {
        for key in &keys {
            setup.publish(key, b"charge").await;
        }
    }
    setup.publish("flaky-1", b"charge").await;
    setup.publish("refuse-1", b"charge").await;
    metric_at_least(admin, "duplicate", 20.0).await;
    metric_at_least(admin, "executed", 11.0).await;
    metric_at_least(admin, "dead_lettered", 1.0).await;
    for key in &keys {
        assert_eq!(ledger.calls(key), vec![1], "{key}");
    }
    assert_eq!(
        ledger.calls("flaky-1"),
        vec![1, 2],
        "a 503 is retried as the next attempt"
    );
    assert_eq!(ledger.calls("refuse-1"), vec![1], "a 422 is not retried");
    let dead = setup.dead_letters().await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, "refuse-1");
    assert!(
        dead[0].1.contains("422") && dead[0].1.contains("no such account"),
        "{dead:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_stream_or_dead_letter_subject_is_a_clear_error() {
    let setup = setup().await;
    for (from, why) in [
        (
            format!(
                "{}?stream=NO_SUCH_STREAM_IDEM&consumer=c&dead_letter={}",
                nats_url(),
                setup.dead
            ),
            "the stream cannot be found",
        ),
        (
            format!(
                "{}?stream={}&consumer=c&dead_letter=nowhere.idem",
                nats_url(),
                setup.stream
            ),
            "which no stream stores",
        ),
        (
            format!(
                "{}?stream={}&consumer=whole&dead_letter={}",
                nats_url(),
                setup.stream,
                setup.dead
            ),
            "would receive its own dead letters",
        ),
    ] {
        let (code, _, err) = common::idem(&[
            "consume",
            "--from",
            &from,
            "--to",
            "http://127.0.0.1:1/m",
            "--store",
            "memory://",
        ]);
        assert_eq!(code, 1, "{from}: {err}");
        assert!(err.contains(why), "{from}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_call_finishes_records_and_acks() {
    let ledger = Ledger::default();
    let handler = start_handler(ledger.clone()).await;
    let setup = setup().await;
    let mut consume = start_consume(&setup, handler, common::free_addr()).await;
    setup.publish("slow-term", b"charge").await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while ledger.calls("slow-term").is_empty() {
        assert!(Instant::now() < deadline, "the call never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let status = consume
        .terminate(Duration::from_secs(20))
        .expect("idem consume exits");
    assert!(status.success(), "{status}");
    assert_eq!(
        ledger.calls("slow-term:finished"),
        vec![1],
        "the call ran to its end"
    );
    // Acked: a new consumer process on the same durable consumer gets nothing to do.
    let admin = common::free_addr();
    let _again = start_consume(&setup, handler, admin).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        ledger.calls("slow-term"),
        vec![1],
        "the message came back: it was not acked"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_call_waits_for_the_lease_then_runs_attempt_two() {
    let ledger = Ledger::default();
    let handler = start_handler(ledger.clone()).await;
    let setup = setup().await;
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("idem.db").display());
    let settings = ["--store", store.as_str(), "--lease", "4s"];
    let mut consume = start_consume_with(&setup, handler, common::free_addr(), &settings).await;
    setup.publish("slow-kill", b"charge").await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while ledger.calls("slow-kill").is_empty() {
        assert!(Instant::now() < deadline, "the call never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    consume.kill9();
    let killed_at = Instant::now();
    let admin = common::free_addr();
    let _consume = start_consume_with(&setup, handler, admin, &settings).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while ledger.calls("slow-kill").len() < 2 {
        assert!(Instant::now() < deadline, "the message never ran again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        killed_at.elapsed() >= Duration::from_secs(3),
        "called again {:?} after the kill, inside the 4 s lease",
        killed_at.elapsed()
    );
    assert_eq!(ledger.calls("slow-kill"), vec![1, 2], "the retry is attempt 2");
    metric_at_least(admin, "executed", 1.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_wait_while_the_handler_is_down_and_none_is_lost() {
    let ledger = Ledger::default();
    // Nothing listens on the handler's address for the first 5 s.
    let handler = common::free_addr();
    let setup = setup().await;
    let admin = common::free_addr();
    let _consume = start_consume(&setup, handler, admin).await;
    let keys: Vec<String> = (0..10).map(|i| format!("waiting-{i}")).collect();
    for key in &keys {
        setup.publish(key, b"charge").await;
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let client = common::client();
    let name = "idempotency_consumer_messages_total";
    assert!(common::metric(&client, admin, name, &[("result", "retried")]).await >= 10.0);
    assert_eq!(
        common::metric(&client, admin, name, &[("result", "dead_lettered")]).await,
        0.0
    );
    start_handler_on(handler, ledger.clone()).await;
    metric_at_least(admin, "executed", 10.0).await;
    for key in &keys {
        assert_eq!(ledger.calls(key).len(), 1, "{key}");
    }
    assert_eq!(
        common::metric(&client, admin, name, &[("result", "dead_lettered")]).await,
        0.0
    );
    assert!(setup.dead_letters().await.is_empty());
}
