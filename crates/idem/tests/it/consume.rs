//! `idem consume` from the outside: the binary as a process of its own between RabbitMQ and an
//! HTTP handler (this test's, with a ledger of every call), and its refusals of bad input.

use crate::common;

use std::time::{Duration, Instant};

use common::consume::{self, Broker, Ledger, start, start_handler, until};
use idempotency::Key;
use idempotency_amqp::{Topology, publish};
use lapin::BasicProperties;
use lapin::options::{BasicGetOptions, BasicPublishOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection, ConnectionProperties};

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// A queue of the test's own, declared as `idem consume` declares it, and a channel on it.
struct Rabbit {
    _connection: Connection,
    channel: Channel,
    queue: String,
}

impl Rabbit {
    async fn new(name: &str) -> Self {
        let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("RabbitMQ at {} is needed for this test: {e}", amqp_url()));
        let channel = connection.create_channel().await.unwrap();
        let queue = format!("idem-consume-{name}-{}", Key::generate());
        Topology::for_queue(&queue).declare(&channel).await.unwrap();
        Self {
            _connection: connection,
            channel,
            queue,
        }
    }

    /// The messages waiting in `queue` (a passive declare counts the ready ones).
    async fn waiting(&self, queue: &str) -> u32 {
        idempotency_amqp::queue_depth(&self.channel, queue).await.unwrap()
    }
}

impl Broker for Rabbit {
    fn source_name(&self) -> String {
        self.queue.clone()
    }

    fn from(&self) -> String {
        format!("{}?queue={}", amqp_url(), self.queue)
    }

    async fn publish(&self, key: &str, payload: &[u8]) {
        publish(&self.channel, "", &self.queue, &Key::new(key).unwrap(), payload)
            .await
            .unwrap();
    }

    async fn dead_letters(&self) -> Vec<(String, String)> {
        let dead = format!("{}.dead", self.queue);
        let mut found = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(1);
        while Instant::now() < deadline {
            let Some(message) = self
                .channel
                .basic_get(dead.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap()
            else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let headers = message.delivery.properties.headers().clone().unwrap_or_default();
            let header = |name: &str| match headers.inner().get(name) {
                Some(AMQPValue::LongString(value)) => String::from_utf8_lossy(value.as_bytes()).into_owned(),
                _ => String::new(),
            };
            found.push((header("Idempotency-Key"), header("Idempotency-Dead-Reason")));
        }
        found
    }

    /// The messages waiting in the queue and its retry queue (unacked ones are not counted:
    /// RabbitMQ counts ready messages only; a closed consumer's come back as ready).
    async fn outstanding(&self) -> u64 {
        let retry = format!("{}.retry", self.queue);
        u64::from(self.waiting(&self.queue).await + self.waiting(&retry).await)
    }

    async fn dead_depth(&self) -> u64 {
        u64::from(self.waiting(&format!("{}.dead", self.queue)).await)
    }

    fn missing_source(&self) -> String {
        format!("{}?queue=idem-missing-{}", amqp_url(), Key::generate())
    }
}

/// `idem dlq` refuses what it cannot use, saying why, and changes nothing.
#[test]
fn dlq_bad_input_is_refused_with_a_clear_error() {
    let cases: [(&[&str], i32, &str); 5] = [
        (
            &["list", "--from", "ftp://127.0.0.1/queue"],
            1,
            "unknown scheme `ftp`",
        ),
        (
            &["list", "--from", "amqp://guest:s3cret@127.0.0.1:5672/%2f"],
            1,
            "names no queue",
        ),
        (
            &["purge", "--from", "amqp://127.0.0.1/%2f?queue=q", "--yes"],
            2,
            "--older-than",
        ),
        (
            &[
                "replay",
                "--from",
                "amqp://127.0.0.1/%2f?queue=q",
                "--older-than",
                "soon",
            ],
            2,
            "soon",
        ),
        (
            &["list", "--from", "amqp://guest:s3cret@127.0.0.1:1/%2f?queue=q"],
            1,
            "cannot connect",
        ),
    ];
    for (args, code, says) in cases {
        let mut all = vec!["dlq"];
        all.extend_from_slice(args);
        let (exit, out, err) = common::idem(&all);
        assert_eq!(exit, code, "{args:?}: {out}{err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(
            !err.contains("s3cret"),
            "{args:?}: the password is never shown: {err}"
        );
    }
}

common::consume::scenarios!(name => Rabbit::new(name).await);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_in_the_middle_of_a_batch_reruns_only_what_was_not_recorded() {
    let _ = consume::kill_9_in_the_middle_of_a_batch(&Rabbit::new("kill-batch").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_success_too_long_to_keep_is_recorded_not_run_again() {
    let ledger = Ledger::default();
    let handler = start_handler(ledger.clone()).await;
    let rabbit = Rabbit::new("big").await;
    let admin = common::free_addr();
    let _consume = start(&rabbit, handler, admin, &[]).await;
    for _ in 0..2 {
        rabbit.publish("big", b"big:3000000").await;
    }
    consume::count_at_least(admin, "duplicate", 1.0).await;
    assert_eq!(consume::count(admin, "executed").await, 1.0);
    assert_eq!(ledger.calls("big"), vec![1]);
    consume::until_settled(&rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_content_type_property_reaches_the_handler() {
    let ledger = Ledger::default();
    let handler = start_handler(ledger.clone()).await;
    let rabbit = Rabbit::new("content-type").await;
    let _consume = start(&rabbit, handler, common::free_addr(), &[]).await;
    let mut headers = FieldTable::default();
    headers.insert(
        "Idempotency-Key".into(),
        AMQPValue::LongString(LongString::from("typed")),
    );
    let properties = BasicProperties::default()
        .with_headers(headers)
        .with_content_type("application/json".into());
    rabbit
        .channel
        .basic_publish(
            "".into(),
            rabbit.queue.as_str().into(),
            BasicPublishOptions::default(),
            b"{\"amount\":1000}",
            properties,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    rabbit.publish("untyped", b"raw").await;
    until("both calls", || {
        ledger.calls("typed").len() == 1 && ledger.calls("untyped").len() == 1
    })
    .await;
    assert_eq!(
        ledger.header("typed", "content-type").as_deref(),
        Some("application/json")
    );
    assert_eq!(
        ledger.header("untyped", "content-type").as_deref(),
        Some("application/octet-stream")
    );
}

/// A handler with a ledger of the charges it made, and the reconcile endpoint that reads it.
/// `POST /messages`: a key's first call charges (`charged-…`, `down-…`) or not (`lost-…`) and
/// answers 500 either way, as a handler that crashed around its side effect; later calls
/// charge and answer 200. `GET /ledger/{key}`: 200 with the charge, 404, or 503 for `down-…`.
#[derive(Clone, Default)]
struct Charges {
    calls: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, u32>>>,
    charged: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    asked: std::sync::Arc<std::sync::Mutex<Vec<(String, String)>>>,
}

impl Charges {
    fn calls(&self, key: &str) -> u32 {
        self.calls.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    fn charges(&self, key: &str) -> usize {
        self.charged.lock().unwrap().iter().filter(|k| *k == key).count()
    }

    async fn start(&self) -> std::net::SocketAddr {
        use axum::extract::{Path, State};
        use axum::http::{HeaderMap, StatusCode};

        async fn charge(State(charges): State<Charges>, headers: HeaderMap) -> (StatusCode, String) {
            let key = headers["idempotency-key"].to_str().unwrap().to_owned();
            let call = {
                let mut calls = charges.calls.lock().unwrap();
                let n = calls.entry(key.clone()).or_default();
                *n += 1;
                *n
            };
            if call > 1 || !key.starts_with("lost-") {
                charges.charged.lock().unwrap().push(key.clone());
            }
            if call == 1 {
                return (StatusCode::INTERNAL_SERVER_ERROR, "crashed".into());
            }
            (StatusCode::OK, format!("charged {key} on call {call}"))
        }

        async fn ledger(
            State(charges): State<Charges>,
            Path(key): Path<String>,
            headers: HeaderMap,
        ) -> (StatusCode, String) {
            let attempt = headers["idempotency-attempt"].to_str().unwrap().to_owned();
            charges.asked.lock().unwrap().push((key.clone(), attempt));
            if key.starts_with("down-") {
                return (StatusCode::SERVICE_UNAVAILABLE, "the ledger is down".into());
            }
            if charges.charged.lock().unwrap().contains(&key) {
                (StatusCode::OK, format!("charged {key} (from the ledger)"))
            } else {
                (StatusCode::NOT_FOUND, String::new())
            }
        }

        let app = axum::Router::new()
            .route("/messages", axum::routing::post(charge))
            .route("/ledger/{key}", axum::routing::get(ledger))
            .with_state(self.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        addr
    }
}

/// `--reconcile`: a message whose first call charged is adopted from the ledger on its retry
/// (one call, one charge); one whose first call did not charge runs again (404); while the
/// ledger cannot tell, the handler is not called again and the message ends dead-lettered with
/// the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_asks_the_ledger_before_it_calls_the_handler_again() {
    let charges = Charges::default();
    let handler = charges.start().await;
    let rabbit = Rabbit::new("reconcile").await;
    let admin = common::free_addr();
    let _consume = start(
        &rabbit,
        handler,
        admin,
        &[
            "--store",
            "memory://",
            "--reconcile",
            "GET /ledger/{key}",
            "--max-deliveries",
            "3",
        ],
    )
    .await;
    for key in ["charged-1", "lost-1", "down-1"] {
        rabbit.publish(key, key.as_bytes()).await;
    }
    consume::count_at_least(admin, "executed", 2.0).await;
    consume::count_at_least(admin, "dead_lettered", 1.0).await;
    assert_eq!(
        (charges.calls("charged-1"), charges.charges("charged-1")),
        (1, 1),
        "adopted"
    );
    assert_eq!(
        (charges.calls("lost-1"), charges.charges("lost-1")),
        (2, 1),
        "ran again"
    );
    assert_eq!(charges.calls("down-1"), 1, "never called blind");
    let asked = charges.asked.lock().unwrap().clone();
    assert!(asked.contains(&("charged-1".into(), "2".into())), "{asked:?}");
    assert!(asked.contains(&("lost-1".into(), "2".into())), "{asked:?}");
    assert_eq!(
        asked.iter().filter(|(key, _)| key == "down-1").count(),
        2,
        "asked before attempts 2 and 3: {asked:?}"
    );
    let dead = rabbit.dead_letters().await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, "down-1");
    assert!(
        dead[0].1.contains("reconcile") && dead[0].1.contains("503"),
        "{dead:?}"
    );
    for (result, expected) in [("adopted", 1.0), ("did_not_happen", 1.0), ("unresolved", 2.0)] {
        let counted = common::metric(
            &common::client(),
            admin,
            "idempotency_reconciled_total",
            &[("result", result)],
        )
        .await;
        assert_eq!(counted, expected, "{result}");
    }
    consume::until_settled(&rabbit).await;
}

/// `--log-format json`: one line per message, with its decision and disposition, the key as a
/// digest and the trace id of its `traceparent` header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_message_is_one_json_line_with_its_decision() {
    use std::io::{BufRead, BufReader};

    let ledger = Ledger::default();
    let handler = start_handler(ledger.clone()).await;
    let rabbit = Rabbit::new("json-log").await;
    let admin = common::free_addr();
    let (from, to, admin_text) = (
        rabbit.from(),
        format!("http://{handler}/messages"),
        admin.to_string(),
    );
    let args = [
        "consume",
        "--from",
        &from,
        "--to",
        &to,
        "--admin-listen",
        &admin_text,
        "--store",
        "memory://",
        "--log-format",
        "json",
    ];
    let mut consume = common::ready(
        common::spawn_idem(&args, &[], "info", true),
        admin,
        "idem consume",
    )
    .await;
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let mut headers = FieldTable::default();
    headers.insert(
        "Idempotency-Key".into(),
        AMQPValue::LongString(LongString::from("order-json-1")),
    );
    headers.insert(
        "traceparent".into(),
        AMQPValue::LongString(LongString::from(format!("00-{trace}-00f067aa0ba902b7-01"))),
    );
    for _ in 0..2 {
        rabbit
            .channel
            .basic_publish(
                "".into(),
                rabbit.queue.as_str().into(),
                BasicPublishOptions::default(),
                b"charge",
                BasicProperties::default().with_headers(headers.clone()),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    consume::count_at_least(admin, "duplicate", 1.0).await;
    let status = tokio::task::spawn_blocking(move || {
        let status = consume.terminate(Duration::from_secs(30));
        (status, consume)
    });
    let (status, mut consume) = status.await.unwrap();
    assert_eq!(status.and_then(|status| status.code()), Some(0));
    let lines: Vec<String> = BufReader::new(consume.child.stderr.take().unwrap())
        .lines()
        .map(Result::unwrap)
        .collect();
    assert!(
        !lines.join("\n").contains("order-json-1"),
        "the key is in the log"
    );
    let mut events: Vec<(String, String)> = lines
        .iter()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
        .filter(|event| event["target"] == "idempotency_consumer::message")
        .map(|event| {
            let fields = &event["fields"];
            assert_eq!(fields["trace_id"], trace, "{event}");
            assert_eq!(fields["key"].as_str().map(str::len), Some(16), "{event}");
            (
                fields["decision"].as_str().unwrap().to_owned(),
                fields["disposition"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    events.sort();
    assert_eq!(
        events,
        [
            ("acquired".into(), "ack".into()),
            ("replayed".into(), "ack".into())
        ]
    );
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
                "--to-ca".into(),
                "/nonexistent/ca.pem".into(),
            ],
            1,
            "--to https://h/m: TLS: CA bundle /nonexistent/ca.pem: No such file",
        ),
        (
            vec![
                "--from".into(),
                format!("{amqp}?queue=q"),
                "--to".into(),
                "http://h/m".into(),
                "--to-insecure-skip-verify".into(),
            ],
            1,
            "are for an https:// handler",
        ),
        (
            vec![
                "--from".into(),
                format!("{amqp}?queue=q"),
                "--to".into(),
                "ftp://h/m".into(),
            ],
            1,
            "not an http:// or https:// URL",
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
    let flag = |name: &str, value: &str| {
        vec![
            "--from".into(),
            format!("{amqp}?queue=q"),
            "--to".into(),
            "http://127.0.0.1:1/m".into(),
            name.into(),
            value.into(),
        ]
    };
    let cases = cases.into_iter().chain([
        (flag("--batch", "0"), 2, "--batch"),
        (flag("--batch", "1001"), 2, "--batch"),
        (flag("--batch", "lots"), 2, "--batch"),
        (flag("--linger", "2s"), 2, "--linger: must be from 0s to 1s"),
        (flag("--linger", "later"), 2, "--linger"),
    ]);
    for (args, code, message) in cases {
        let mut all = vec!["consume"];
        all.extend(args.iter().map(String::as_str));
        let (status, _, err) = common::idem(&all);
        assert_eq!(status, code, "{args:?}: {err}");
        assert!(err.contains(message), "{args:?}: {err}");
        assert!(!err.contains("s3cret"), "{args:?}: the password leaked: {err}");
    }
}

/// `--admin-listen 127.0.0.1:0` takes a port the kernel picks, and the start line names it, so
/// that whatever started the consumer can probe it without choosing a port first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_start_line_names_the_admin_address_the_kernel_picked() {
    let rabbit = Rabbit::new("port-zero").await;
    let from = rabbit.from();
    let args = [
        "consume",
        "--from",
        &from,
        "--to",
        "http://127.0.0.1:1/messages",
        "--admin-listen",
        "127.0.0.1:0",
        "--store",
        "memory://",
        "--log-format",
        "json",
    ];
    let mut consume = common::spawn_idem(&args, &[], "info", true);
    let admin = common::address_in(&common::logged(&mut consume, "starting"), "admin_listen");
    let client = common::client();
    let live = common::send(&client, admin, "GET", "/_idem/livez", &[], b"").await;
    assert_eq!(live.status, 200, "the admin listener at the announced address");
    drop(consume);
}
