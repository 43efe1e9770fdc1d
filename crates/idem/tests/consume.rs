//! `idem consume` from the outside: the binary as a process of its own between RabbitMQ and an
//! HTTP handler (this test's, with a ledger of every call), and its refusals of bad input.

mod common;

use std::time::{Duration, Instant};

use common::consume::{self, Broker, Ledger, start, start_handler, until};
use idempotency::Key;
use idempotency_amqp::{Topology, publish};
use lapin::BasicProperties;
use lapin::options::{BasicGetOptions, BasicPublishOptions, QueueDeclareOptions};
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
        self.channel
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_published_three_times_is_handled_once() {
    consume::three_copies_run_once(&Rabbit::new("dups").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_failing_twice_is_called_three_times_and_the_message_acked_once() {
    consume::failing_twice_then_ok(&Rabbit::new("flaky").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_message_is_dead_lettered_with_the_status() {
    consume::refused_is_dead_lettered(&Rabbit::new("refused").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_call_waits_for_the_lease_then_runs_attempt_two() {
    consume::kill_9_mid_call(&Rabbit::new("kill").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_in_the_middle_of_a_batch_reruns_only_what_was_not_recorded() {
    let _ = consume::kill_9_in_the_middle_of_a_batch(&Rabbit::new("kill-batch").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_call_lets_the_call_finish_be_recorded_and_acked() {
    consume::sigterm_mid_call(&Rabbit::new("sigterm").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_message_metadata_reaches_the_handler() {
    consume::metadata_reaches_the_handler(&Rabbit::new("meta").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_wait_while_the_handler_is_down_and_none_is_lost() {
    consume::handler_outage(&Rabbit::new("outage").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_arriving_mid_call_is_acked_when_the_first_call_is_recorded() {
    consume::duplicate_in_flight_settles_with_the_first(&Rabbit::new("copy").await).await;
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
