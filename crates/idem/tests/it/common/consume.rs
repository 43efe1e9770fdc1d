//! What every broker's `idem consume` tests share: a handler with a ledger of every call, the
//! consumer as a process of its own, and the scenarios each broker must pass.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};

use super::Process;

/// What the handler answers for a key, call after call (then 200).
type Script = HashMap<String, Vec<(u16, &'static str)>>;

/// Every call the handler got: key → the `Idempotency-Attempt` of each call.
#[derive(Clone, Default)]
pub struct Ledger {
    calls: Arc<Mutex<HashMap<String, Vec<u32>>>>,
    script: Arc<Mutex<Script>>,
    /// Keys whose long call ran to its end.
    pub finished: Arc<Mutex<Vec<String>>>,
    /// The request headers of each key's last call.
    pub headers: Arc<Mutex<HashMap<String, HeaderMap>>>,
    /// While true, every call waits (after it is counted) until it turns false.
    pub closed: Arc<tokio::sync::watch::Sender<bool>>,
}

impl Ledger {
    /// The attempts of each call for `key`, in order.
    pub fn calls(&self, key: &str) -> Vec<u32> {
        self.calls.lock().unwrap().get(key).cloned().unwrap_or_default()
    }

    /// The handler answers `key`'s next calls with these, then 200.
    pub fn script(&self, key: &str, answers: Vec<(u16, &'static str)>) {
        self.script.lock().unwrap().insert(key.into(), answers);
    }

    /// Every key called so far.
    pub fn keys(&self) -> Vec<String> {
        self.calls.lock().unwrap().keys().cloned().collect()
    }

    /// The header `name` of `key`'s last call.
    pub fn header(&self, key: &str, name: &str) -> Option<String> {
        let headers = self.headers.lock().unwrap();
        let value = headers.get(key)?.get(name)?;
        Some(value.to_str().ok()?.to_owned())
    }
}

async fn handle(State(ledger): State<Ledger>, headers: HeaderMap, body: String) -> (StatusCode, String) {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let attempt = headers
        .get("idempotency-attempt")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    ledger.headers.lock().unwrap().insert(key.clone(), headers);
    ledger
        .calls
        .lock()
        .unwrap()
        .entry(key.clone())
        .or_default()
        .push(attempt);
    let _ = ledger.closed.subscribe().wait_for(|closed| !closed).await;
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
pub async fn start_handler(ledger: Ledger) -> SocketAddr {
    start_handler_on("127.0.0.1:0".parse().unwrap(), ledger).await
}

/// The handler on `addr`.
pub async fn start_handler_on(addr: SocketAddr, ledger: Ledger) -> SocketAddr {
    let app = axum::Router::new()
        .route("/messages", axum::routing::post(handle))
        .with_state(ledger);
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// The handler over TLS with `leaf`'s certificate, on a loopback port of its own; counts the
/// handshakes that failed in `refused`.
pub async fn start_tls_handler(
    ledger: Ledger,
    leaf: &super::pki::Leaf,
    refused: Arc<std::sync::atomic::AtomicU32>,
) -> SocketAddr {
    let app = axum::Router::new()
        .route("/messages", axum::routing::post(handle))
        .with_state(ledger);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(super::pki::Ca::server_config(leaf));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (app, acceptor, refused) = (app.clone(), acceptor.clone(), Arc::clone(&refused));
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(stream).await else {
                    refused.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    return;
                };
                let service = hyper_util::service::TowerToHyperService::new(app);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// A broker with a source of the test's own.
#[allow(async_fn_in_trait)] // used by these tests only, never as `dyn`
pub trait Broker {
    /// `--from` for `idem consume`.
    fn from(&self) -> String;

    /// The lease of the `kill -9` scenario: longer than the broker takes to hand a dead
    /// consumer's message to the next one, so that the next one finds the lease running.
    fn kill_lease(&self) -> Duration {
        Duration::from_secs(4)
    }

    /// What `idem consume` names the source in the `Idempotency-Source` header.
    fn source_name(&self) -> String;

    /// Environment variables `idem consume` needs for this broker.
    fn env(&self) -> Vec<(&'static str, String)> {
        Vec::new()
    }

    /// Publishes `payload` with `key` as its `Idempotency-Key`.
    async fn publish(&self, key: &str, payload: &[u8]);

    /// Publishes copy number `copy` of a message: where copies of one key are delivered in
    /// order (a Kafka partition), each copy goes elsewhere, so that they can arrive at once.
    async fn publish_copy(&self, key: &str, payload: &[u8], copy: i32) {
        let _ = copy;
        self.publish(key, payload).await;
    }

    /// Publishes where messages are delivered in the order published (one Kafka partition):
    /// a batch's scenario relies on the order.
    async fn publish_in_order(&self, key: &str, payload: &[u8]) {
        self.publish(key, payload).await;
    }

    /// The dead letters so far, as (key, reason), reading for a moment.
    async fn dead_letters(&self) -> Vec<(String, String)>;

    /// Messages of the source the consumer has not acknowledged (or committed past) yet.
    async fn outstanding(&self) -> u64;

    /// What the broker counts in the dead-letter destination, read without taking anything
    /// (RabbitMQ and SQS: the ready or visible messages; NATS: the subject's messages in the
    /// stream; Kafka: the records in the topic).
    async fn dead_depth(&self) -> u64;

    /// `--from` naming a source that does not exist on this broker.
    fn missing_source(&self) -> String;
}

/// `idem consume --from FROM` (and `more`), with the broker's environment, a handler nothing
/// listens on and an in-memory store, stops at start with exit code 1, its error naming each of
/// `causes` and holding none of `secrets`.
pub fn refused_at_start<B: Broker>(broker: &B, from: &str, more: &[&str], causes: &[&str], secrets: &[&str]) {
    let output = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["consume", "--from", from, "--to", "http://127.0.0.1:1/m"])
        .args(["--store", "memory://"])
        .args(more)
        .envs(broker.env())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{from}: {err}");
    for cause in causes {
        assert!(err.contains(cause), "{from}: {err}");
    }
    for secret in secrets {
        assert!(!err.contains(secret), "{from}: a secret leaked: {err}");
    }
}

/// `idem dlq` with `args` and the broker's environment: (exit code, stdout, stderr).
pub fn dlq<B: Broker>(broker: &B, args: &[&str]) -> (i32, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("dlq")
        .args(args)
        .envs(broker.env())
        .output()
        .unwrap();
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// `idem dlq list --json` of the broker's source: {reason: count}, and the total.
fn dlq_counts<B: Broker>(broker: &B) -> (std::collections::BTreeMap<String, u64>, u64) {
    let from = broker.from();
    let (code, out, err) = dlq(broker, &["list", "--from", &from, "--json"]);
    assert_eq!(code, 0, "{out}\n{err}");
    let listed: serde_json::Value = serde_json::from_str(&out).unwrap();
    let counts = listed["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|group| {
            let reason = group["reason"].as_str().unwrap();
            // The handler's own words end the reason.
            let short = reason.rsplit(": ").next().unwrap().to_owned();
            (short, group["count"].as_u64().unwrap())
        })
        .collect();
    (counts, listed["total"].as_u64().unwrap())
}

/// `idem dlq` on the broker: 20 messages refused for 3 reasons are listed grouped (twice, the
/// depth unchanged), shown, 5 of one reason replayed after the fix and consumed once each,
/// the rest purged; a source that does not exist is named.
pub async fn dead_letters_listed_replayed_purged<B: Broker>(broker: &B) {
    let ledger = Ledger::default();
    let reasons = ["card expired", "amount too large", "unknown merchant"];
    let keys: Vec<String> = (0..20).map(|i| format!("dlq-{i}")).collect();
    for (i, key) in keys.iter().enumerate() {
        ledger.script(key, vec![(422, reasons[i % 3])]);
    }
    let handler = start_handler(ledger.clone()).await;
    let admin = super::free_addr();
    let _consume = start(broker, handler, admin, &[]).await;
    for key in &keys {
        broker.publish(key, key.as_bytes()).await;
    }
    count_at_least(admin, "dead_lettered", 20.0).await;
    until_settled(broker).await;
    let depth = broker.dead_depth().await;
    assert!(depth >= 20, "{depth}");

    let expected: std::collections::BTreeMap<String, u64> = [
        ("card expired", 7),
        ("amount too large", 7),
        ("unknown merchant", 6),
    ]
    .into_iter()
    .map(|(reason, count)| (reason.to_owned(), count))
    .collect();
    let from = broker.from();
    assert_eq!(dlq_counts(broker), (expected.clone(), 20));
    assert_eq!(dlq_counts(broker), (expected, 20), "a listing takes nothing");
    assert_eq!(
        broker.dead_depth().await,
        depth,
        "a listing leaves the depth as it was"
    );
    let (code, out, err) = dlq(broker, &["list", "--from", &from]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("20 dead letters") && out.contains("card expired"),
        "{out}"
    );
    let (code, out, err) = dlq(broker, &["show", "--from", &from, "--key", "dlq-4"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("key dlq-4") && out.contains("amount too large") && out.contains("payload:"),
        "{out}"
    );

    // Without --yes (and no terminal), nothing changes.
    let (code, _, err) = dlq(broker, &["replay", "--from", &from, "--reason", "card expired"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("--yes"), "{err}");

    // The handler was fixed (its scripted refusals are spent): five of one reason go back.
    let (code, out, err) = dlq(
        broker,
        &[
            "replay",
            "--from",
            &from,
            "--reason",
            "card expired",
            "--limit",
            "5",
            "--yes",
            "--json",
        ],
    );
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&out).unwrap()["count"],
        5,
        "{out}"
    );
    count_at_least(admin, "executed", 5.0).await;
    until_settled(broker).await;
    let replayed: Vec<&String> = keys.iter().filter(|key| ledger.calls(key).len() == 2).collect();
    assert_eq!(
        replayed.len(),
        5,
        "each replayed message consumed once more: {replayed:?}"
    );
    for key in &replayed {
        let i: usize = key.trim_start_matches("dlq-").parse().unwrap();
        assert_eq!(i % 3, 0, "{key}: only the selected reason was replayed");
    }
    assert!(keys.iter().all(|key| ledger.calls(key).len() <= 2));
    assert_eq!(count(admin, "executed").await, 5.0);
    let (left, total) = dlq_counts(broker);
    assert_eq!(total, 15, "{left:?}");
    assert_eq!(left.get("card expired"), Some(&2));

    // The rest purged.
    let (code, out, err) = dlq(broker, &["purge", "--from", &from, "--older-than", "0s", "--yes"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("purged 15"), "{out}");
    assert_eq!(dlq_counts(broker).1, 0);

    // A source that does not exist is named, and nothing runs.
    let missing = broker.missing_source();
    let (code, _, err) = dlq(broker, &["replay", "--from", &missing, "--yes"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("does not exist") || err.contains("stored by no stream"),
        "{err}"
    );
}

/// Waits until the broker has every message of the source acknowledged.
pub async fn until_settled<B: Broker>(broker: &B) {
    idempotency_testkit::eventually(
        Duration::from_secs(30),
        "every message acknowledged",
        async || broker.outstanding().await == 0,
    )
    .await;
}

/// `idem consume` from `broker` to `handler`, its admin endpoint on `admin`, with `more` flags
/// (by default a memory store and a 3 s lease: a consumer killed mid-call is taken over
/// soon).
pub async fn start<B: Broker>(broker: &B, handler: SocketAddr, admin: SocketAddr, more: &[&str]) -> Process {
    start_to(broker, &format!("http://{handler}/messages"), admin, more).await
}

/// As [`start`], with `to` as the handler's URL.
pub async fn start_to<B: Broker>(broker: &B, to: &str, admin: SocketAddr, more: &[&str]) -> Process {
    let defaults = ["--store", "memory://", "--lease", "3s"];
    let child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args([
            "consume",
            "--from",
            &broker.from(),
            "--to",
            to,
            "--admin-listen",
            &admin.to_string(),
        ])
        .args(if more.is_empty() { &defaults[..] } else { more })
        .env(
            "IDEM_LOG",
            std::env::var("IDEM_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .envs(broker.env())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start idem consume");
    // Ready once its admin endpoint answers (the store is open then).
    super::ready(Process { child }, admin, "idem consume").await
}

/// Waits until `done` holds, at most 30 s.
pub async fn until(what: &str, mut done: impl FnMut() -> bool) {
    idempotency_testkit::eventually(Duration::from_secs(30), what, async || done()).await;
}

const MESSAGES: &str = "idempotency_consumer_messages_total";

/// The consumer core's count of messages with `result`.
pub async fn count(admin: SocketAddr, result: &str) -> f64 {
    super::metric(&super::client(), admin, MESSAGES, &[("result", result)]).await
}

/// Waits until the consumer core counted at least `at_least` messages with `result`.
pub async fn count_at_least(admin: SocketAddr, result: &str, at_least: f64) {
    super::metric_at_least(admin, MESSAGES, &[("result", result)], at_least).await;
}

/// Every message published three times with one key: one handler call per key, as attempt 1;
/// the copies are acked from the record.
pub async fn three_copies_run_once<B: Broker>(broker: &B) {
    let ledger = Ledger::default();
    let handler = start_handler(ledger.clone()).await;
    let admin = super::free_addr();
    let _consume = start(broker, handler, admin, &[]).await;
    let keys: Vec<String> = (0..10).map(|i| format!("order-{i}")).collect();
    for _ in 0..3 {
        for key in &keys {
            broker.publish(key, key.as_bytes()).await;
        }
    }
    count_at_least(admin, "duplicate", 20.0).await;
    assert_eq!(count(admin, "executed").await, 10.0);
    for key in &keys {
        assert_eq!(ledger.calls(key), vec![1], "{key}");
    }
    assert_eq!(count(admin, "dead_lettered").await, 0.0);
    until_settled(broker).await;
}

/// A handler answering 500, then 503, then 200: called three times, as attempts 1, 2 and 3;
/// no call after the success, nothing dead-lettered.
pub async fn failing_twice_then_ok<B: Broker>(broker: &B) {
    let ledger = Ledger::default();
    ledger.script("flaky", vec![(500, "down"), (503, "still down")]);
    let handler = start_handler(ledger.clone()).await;
    let admin = super::free_addr();
    let _consume = start(broker, handler, admin, &[]).await;
    broker.publish("flaky", b"charge").await;
    until("three calls", || ledger.calls("flaky").len() == 3).await;
    count_at_least(admin, "executed", 1.0).await;
    assert_eq!(
        ledger.calls("flaky"),
        vec![1, 2, 3],
        "each retry is the next attempt"
    );
    assert_eq!(count(admin, "retried").await, 2.0);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(ledger.calls("flaky").len(), 3, "no call after the success");
    assert_eq!(count(admin, "dead_lettered").await, 0.0);
    assert!(broker.dead_letters().await.is_empty());
    until_settled(broker).await;
}

/// A handler answering 422: called once, the message dead-lettered with the status and the
/// answer's body in the reason.
pub async fn refused_is_dead_lettered<B: Broker>(broker: &B) {
    let ledger = Ledger::default();
    ledger.script("bad", vec![(422, "amount must be positive")]);
    let handler = start_handler(ledger.clone()).await;
    let admin = super::free_addr();
    let _consume = start(broker, handler, admin, &[]).await;
    broker.publish("bad", b"-5").await;
    count_at_least(admin, "dead_lettered", 1.0).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let dead = loop {
        let dead = broker.dead_letters().await;
        if !dead.is_empty() {
            break dead;
        }
        assert!(Instant::now() < deadline, "nothing reached the dead letters");
    };
    assert_eq!(dead.len(), 1, "{dead:?}");
    let (key, reason) = &dead[0];
    assert_eq!(key, "bad");
    assert!(reason.contains("422"), "{reason}");
    assert!(reason.contains("amount must be positive"), "{reason}");
    assert_eq!(ledger.calls("bad"), vec![1], "a refused message is not retried");
    until_settled(broker).await;
}

/// The settings of the `kill -9` scenarios: a SQLite store in a directory of their own that
/// the processes share, and the broker's kill lease.
pub struct Killable {
    _dir: tempfile::TempDir,
    store: String,
    lease: Duration,
    lease_text: String,
}

impl Killable {
    fn new<B: Broker>(broker: &B) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = super::sqlite_url(dir.path());
        let lease = broker.kill_lease();
        Self {
            _dir: dir,
            store,
            lease,
            lease_text: format!("{}s", lease.as_secs()),
        }
    }

    /// `--store` and `--lease`.
    fn settings(&self) -> [&str; 4] {
        [
            "--store",
            self.store.as_str(),
            "--lease",
            self.lease_text.as_str(),
        ]
    }
}

/// `kill -9` of `idem consume` while the handler runs: after a restart the message comes
/// back, and the handler is not called again while the first call's lease lives; then once
/// more, as attempt 2.
pub async fn kill_9_mid_call<B: Broker>(broker: &B) {
    let ledger = Ledger::default();
    let handler = start_handler(ledger.clone()).await;
    let killable = Killable::new(broker);
    let settings = killable.settings();
    let mut consume = start(broker, handler, super::free_addr(), &settings).await;
    broker.publish("killed", b"sleep:300").await;
    until("the call started", || ledger.calls("killed").len() == 1).await;
    let started = Instant::now();
    consume.kill9();
    let admin = super::free_addr();
    let _consume = start(broker, handler, admin, &settings).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while ledger.calls("killed").len() < 2 {
        assert!(Instant::now() < deadline, "the message never ran again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        started.elapsed() >= killable.lease - Duration::from_secs(1),
        "called again {:?} after the first call, inside the {:?} lease",
        started.elapsed(),
        killable.lease
    );
    assert_eq!(ledger.calls("killed"), vec![1, 2], "the retry is attempt 2");
    count_at_least(admin, "executed", 1.0).await;
    until_settled(broker).await;
    assert_eq!(ledger.calls("killed").len(), 2, "no call after the success");
}

/// `kill -9` in the middle of a batch: six messages published before the consumer starts are
/// decided together (or in batches one after another); the fourth's call is long. The three
/// before it are recorded and acked while it runs (the linger), so the next process answers
/// them from the record; the fourth runs again as attempt 2 after the dead process's lease;
/// the two after it, claimed by the dead process's batch or not, run exactly once. Nothing
/// recorded runs twice, nothing is lost. Answers the ledger and the keys, in order.
pub async fn kill_9_in_the_middle_of_a_batch<B: Broker>(broker: &B) -> (Ledger, Vec<String>) {
    let keys: Vec<String> = (0..6).map(|n| format!("batch-{n}")).collect();
    for (n, key) in keys.iter().enumerate() {
        let payload: &[u8] = if n == 3 { b"sleep:3000" } else { b"charge" };
        broker.publish_in_order(key, payload).await;
    }
    let ledger = Ledger::default();
    let handler = start_handler(ledger.clone()).await;
    let killable = Killable::new(broker);
    let settings = killable.settings();
    let first_admin = super::free_addr();
    let mut first = start(broker, handler, first_admin, &settings).await;
    until("the fourth call started", || ledger.calls(&keys[3]).len() == 1).await;
    // The three before it are recorded (counted once settled) while it runs.
    count_at_least(first_admin, "executed", 3.0).await;
    first.kill9();
    let _second = start(broker, handler, super::free_addr(), &settings).await;
    until("every message after the first three ran", || {
        ledger.calls(&keys[3]).len() == 2 && keys[4..].iter().all(|key| !ledger.calls(key).is_empty())
    })
    .await;
    until_settled(broker).await;
    for key in &keys[..3] {
        assert_eq!(
            ledger.calls(key),
            vec![1],
            "{key}: recorded before the kill, never run again"
        );
    }
    assert_eq!(
        ledger.calls(&keys[3]),
        vec![1, 2],
        "the killed call runs again as attempt 2"
    );
    for key in &keys[4..] {
        assert_eq!(ledger.calls(key).len(), 1, "{key}: runs exactly once");
    }
    (ledger, keys)
}

/// SIGTERM while the handler runs: the call finishes, is recorded and acked, and the process
/// exits 0; a new consumer finds nothing to do.
pub async fn sigterm_mid_call<B: Broker>(broker: &B) {
    let ledger = Ledger::default();
    let handler = start_handler(ledger.clone()).await;
    let admin = super::free_addr();
    let mut consume = start(broker, handler, admin, &[]).await;
    let client = super::client();
    let probe = async |path: &str| {
        super::try_send(&client, admin, "GET", path, &[], b"")
            .await
            .map(|seen| seen.status)
    };
    assert_eq!(probe("/_idem/readyz").await, Some(200));
    broker.publish("long", b"sleep:1500").await;
    until("the call started", || ledger.calls("long").len() == 1).await;
    let pid = consume.child.id().to_string();
    let exited = tokio::task::spawn_blocking(move || consume.terminate(Duration::from_secs(30)));
    // From the signal on, readiness is 503 while the running call finishes; liveness stays 200.
    let _ = Command::new("kill").args(["-TERM", &pid]).status();
    let mut seen = None;
    while seen != Some(503) {
        seen = probe("/_idem/readyz").await;
        assert!(
            seen.is_some(),
            "the admin listener closed before readiness said 503"
        );
    }
    assert_eq!(probe("/_idem/livez").await, Some(200));
    let status = exited.await.unwrap().expect("idem consume exits");
    assert!(status.success(), "{status}");
    assert_eq!(*ledger.finished.lock().unwrap(), vec!["long".to_owned()]);
    until_settled(broker).await;
    // Acked: a new consumer (whose memory store knows nothing of the first call) gets no copy.
    let admin = super::free_addr();
    let _again = start(broker, handler, admin, &[]).await;
    broker.publish("after", b"charge").await;
    until("the next message", || ledger.calls("after").len() == 1).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        ledger.calls("long"),
        vec![1],
        "the message came back: it was not acked"
    );
}

/// A copy of a message arriving while the first copy's call runs (1.5 s), with a 60 s lease:
/// the copy waits for the first call's outcome and is acked as a duplicate as soon as it is
/// recorded, never put back to come again after the lease; the handler is called once. The
/// bound is an event, not a timing: the duplicate is counted within 30 s, half the lease.
pub async fn duplicate_in_flight_settles_with_the_first<B: Broker>(broker: &B) {
    let ledger = Ledger::default();
    let handler = start_handler(ledger.clone()).await;
    let admin = super::free_addr();
    let settings = ["--store", "memory://", "--lease", "60s"];
    let _consume = start(broker, handler, admin, &settings).await;
    broker.publish_copy("twice", b"sleep:1500", 0).await;
    until("the first call started", || ledger.calls("twice").len() == 1).await;
    let published = Instant::now();
    broker.publish_copy("twice", b"sleep:1500", 1).await;
    count_at_least(admin, "duplicate", 1.0).await;
    eprintln!(
        "{}: the copy was acked {:?} after it was published, the first call taking 1.5 s (lease 60 s)",
        broker.source_name(),
        published.elapsed()
    );
    assert_eq!(
        *ledger.finished.lock().unwrap(),
        ["twice"],
        "acked before the first call finished"
    );
    assert_eq!(ledger.calls("twice"), vec![1]);
    assert_eq!(
        count(admin, "in_flight").await,
        0.0,
        "the copy was put back instead of waiting for the outcome"
    );
    assert_eq!(count(admin, "executed").await, 1.0);
    until_settled(broker).await;
}

/// Nothing listens on the handler's address until the messages were retried: they are
/// retried, none is lost or dead-lettered; once the handler is up, each runs once. The
/// address is held meanwhile: a server of another test that bound it would answer for the
/// handler.
pub async fn handler_outage<B: Broker>(broker: &B) {
    let ledger = Ledger::default();
    let handler = super::HeldPort::new();
    assert!(
        std::net::TcpListener::bind(handler.addr).is_err(),
        "a held port can be bound by another server"
    );
    let admin = super::free_addr();
    let _consume = start(broker, handler.addr, admin, &[]).await;
    let keys: Vec<String> = (0..10).map(|i| format!("waiting-{i}")).collect();
    for key in &keys {
        broker.publish(key, b"charge").await;
    }
    count_at_least(admin, "retried", 2.0).await;
    assert_eq!(count(admin, "executed").await, 0.0);
    assert_eq!(count(admin, "dead_lettered").await, 0.0);
    let handler = handler.free();
    start_handler_on(handler, ledger.clone()).await;
    count_at_least(admin, "executed", 10.0).await;
    for key in &keys {
        assert_eq!(ledger.calls(key).len(), 1, "{key}");
    }
    assert_eq!(count(admin, "dead_lettered").await, 0.0);
    assert!(broker.dead_letters().await.is_empty());
    until_settled(broker).await;
}

/// The handler gets the payload with the key, its scope, the attempt, the delivery count and
/// the source as headers, and `application/octet-stream` for a message without a content type.
pub async fn metadata_reaches_the_handler<B: Broker>(broker: &B) {
    let ledger = Ledger::default();
    let handler = start_handler(ledger.clone()).await;
    let admin = super::free_addr();
    let _consume = start(broker, handler, admin, &[]).await;
    broker.publish("meta-1", b"charge").await;
    until("the call", || ledger.calls("meta-1").len() == 1).await;
    let header = |name: &str| ledger.header("meta-1", name);
    assert_eq!(header("idempotency-scope").as_deref(), Some("idem-consume"));
    assert_eq!(header("idempotency-attempt").as_deref(), Some("1"));
    assert_eq!(header("idempotency-delivery-count").as_deref(), Some("1"));
    assert_eq!(header("idempotency-source"), Some(broker.source_name()));
    assert_eq!(
        header("content-type").as_deref(),
        Some("application/octet-stream")
    );
    until_settled(broker).await;
}

/// The scenarios every broker passes through `idem consume`, one `#[tokio::test]` each, on the
/// broker `$broker` evaluates to, with `$name` bound to a name of the scenario's own (for a
/// broker whose queues are named per test):
///
/// ```text
/// common::consume::scenarios!(name => Rabbit::new(name).await);
/// common::consume::scenarios!(_name => Kafka::new());
/// ```
#[allow(unused_macros)] // the test crates of other brokers do not run it
macro_rules! scenarios {
    ($name:ident => $broker:expr) => {
        common::consume::scenarios!(@tests $name => $broker;
            dead_letters_are_listed_by_reason_replayed_and_purged: dead_letters_listed_replayed_purged("dlq"),
            every_message_published_three_times_is_handled_once: three_copies_run_once("dups"),
            a_handler_failing_twice_is_called_three_times_and_the_message_acked_once:
                failing_twice_then_ok("flaky"),
            a_refused_message_is_dead_lettered_with_the_status: refused_is_dead_lettered("refused"),
            kill_9_mid_call_waits_for_the_lease_then_runs_attempt_two: kill_9_mid_call("kill"),
            sigterm_mid_call_finishes_records_and_acks: sigterm_mid_call("sigterm"),
            the_message_metadata_reaches_the_handler: metadata_reaches_the_handler("meta"),
            messages_wait_while_the_handler_is_down_and_none_is_lost: handler_outage("outage"),
            a_copy_arriving_mid_call_is_acked_when_the_first_call_is_recorded:
                duplicate_in_flight_settles_with_the_first("copy"),
        );
    };
    (@tests $name:ident => $broker:expr; $($test:ident: $scenario:ident($label:literal)),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                let $name = $label;
                common::consume::$scenario(&$broker).await;
            }
        )*
    };
}
#[allow(unused_imports)] // the test crates of other brokers do not run it
pub(crate) use scenarios;
