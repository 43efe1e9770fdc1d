//! `idem consume` from NATS JetStream: the binary as a process of its own between a stream and
//! an HTTP handler with a ledger of every call.

use crate::common;

use std::time::Duration;

use async_nats::jetstream;
use common::consume::{self, Broker};

use idempotency_testkit::nats::{TestStream, header, nats_url};

/// A stream of the test's own with a work subject and a dead-letter subject.
struct Nats(TestStream);

impl Nats {
    async fn new() -> Self {
        Self(TestStream::new("idemconsume", |_| {}).await)
    }
}

impl Broker for Nats {
    fn source_name(&self) -> String {
        format!("{}/idem", self.0.stream)
    }

    /// The durable consumer `idem` on the work subject, with a 2 s ack wait.
    fn from(&self) -> String {
        format!(
            "{}?stream={}&consumer=idem&subject={}&dead_letter={}&ack_wait=2s",
            nats_url(),
            self.0.stream,
            self.0.work,
            self.0.dead
        )
    }

    async fn publish(&self, key: &str, payload: &[u8]) {
        self.0.publish(Some(key), payload).await;
    }

    async fn dead_letters(&self) -> Vec<(String, String)> {
        let dead = self.0.dead_letters().await;
        let pair = |headers| {
            (
                header(headers, "Idempotency-Key"),
                header(headers, "Idempotency-Dead-Reason"),
            )
        };
        dead.iter().map(pair).collect()
    }

    /// The durable consumer's messages not yet delivered, and delivered but not acked.
    async fn outstanding(&self) -> u64 {
        let stream = self.0.js.get_stream(&self.0.stream).await.unwrap();
        let info = stream.consumer_info("idem").await.unwrap();
        info.num_pending + u64::try_from(info.num_ack_pending).unwrap()
    }

    /// The dead-letter subject's messages in the stream, counted by a consumer that reads
    /// nothing.
    async fn dead_depth(&self) -> u64 {
        let stream = self.0.js.get_stream(&self.0.stream).await.unwrap();
        let mut counter: jetstream::consumer::PullConsumer = stream
            .create_consumer(jetstream::consumer::pull::Config {
                filter_subject: self.0.dead.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        let info = counter.info().await.unwrap();
        let (pending, name) = (info.num_pending, info.name.clone());
        stream.delete_consumer(&name).await.unwrap();
        pending
    }

    fn missing_source(&self) -> String {
        format!(
            "{}?stream=MISSING_{}&consumer=idem",
            nats_url(),
            idempotency::Key::generate().as_str().replace('-', "_")
        )
    }
}

common::consume::scenarios!(_name => Nats::new().await);

/// An https handler verified with a private CA: three copies of each message, one call each,
/// over TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_handler_with_a_private_ca_is_called_once_per_key() {
    let nats = Nats::new().await;
    let dir = tempfile::tempdir().unwrap();
    let ca = common::pki::Ca::new("idem test CA");
    let ca_file = ca.write(dir.path(), "ca");
    let leaf = ca.server(&["localhost"], 1, common::pki::Validity::Current);
    let ledger = consume::Ledger::default();
    let refused = std::sync::Arc::default();
    let handler = consume::start_tls_handler(ledger.clone(), &leaf, std::sync::Arc::clone(&refused)).await;
    let admin = common::free_addr();
    let to = format!("https://localhost:{}/messages", handler.port());
    let ca_text = ca_file.to_str().unwrap();
    let _consume = consume::start_to(
        &nats,
        &to,
        admin,
        &["--store", "memory://", "--lease", "3s", "--to-ca", ca_text],
    )
    .await;
    let keys: Vec<String> = (0..5).map(|i| format!("tls-{i}")).collect();
    for _ in 0..3 {
        for key in &keys {
            nats.publish(key, key.as_bytes()).await;
        }
    }
    consume::count_at_least(admin, "duplicate", 10.0).await;
    for key in &keys {
        assert_eq!(ledger.calls(key), vec![1], "{key}");
    }
    consume::until_settled(&nats).await;
    assert_eq!(refused.load(std::sync::atomic::Ordering::SeqCst), 0);
}

/// An https handler whose certificate the consumer does not trust: refused at start, naming the
/// host and the cause; the handler gets no request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_handler_of_another_ca_stops_the_consumer_at_start() {
    let nats = Nats::new().await;
    let dir = tempfile::tempdir().unwrap();
    let ca = common::pki::Ca::new("idem test CA");
    let wrong = common::pki::Ca::new("another CA").write(dir.path(), "wrong");
    let leaf = ca.server(&["localhost"], 1, common::pki::Validity::Current);
    let ledger = consume::Ledger::default();
    let refused = std::sync::Arc::default();
    let handler = consume::start_tls_handler(ledger.clone(), &leaf, std::sync::Arc::clone(&refused)).await;
    let to = format!("https://localhost:{}/messages", handler.port());
    let (code, _, stderr) = common::idem(&[
        "consume",
        "--from",
        &nats.from(),
        "--to",
        &to,
        "--to-ca",
        wrong.to_str().unwrap(),
        "--store",
        "memory://",
    ]);
    assert_ne!(code, 0);
    let expected = format!(
        "the certificate of localhost:{} is refused: UnknownIssuer",
        handler.port()
    );
    assert!(stderr.contains(&expected), "{stderr}");
    assert!(ledger.keys().is_empty());
    // The handler counts the refused handshake once the client has hung up: wait for it.
    idempotency_testkit::eventually(
        Duration::from_secs(10),
        "the handler saw the refused handshake",
        async || refused.load(std::sync::atomic::Ordering::SeqCst) >= 1,
    )
    .await;
    assert_eq!(refused.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// `--key-from json:/order/id`: a producer that carries its key in the JSON body (and sets no
/// `Idempotency-Key`) gets one handler call per key, the key forwarded to the handler; a
/// message without the member is dead-lettered with the reason. A key source this broker's
/// messages lack, or one that is not a key source, stops `idem consume` at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_the_json_payload_runs_once_and_a_message_without_it_is_dead_lettered() {
    let nats = Nats::new().await;
    let ledger = consume::Ledger::default();
    let handler = consume::start_handler(ledger.clone()).await;
    let admin = common::free_addr();
    let _consume = consume::start(
        &nats,
        handler,
        admin,
        &[
            "--store",
            "memory://",
            "--lease",
            "3s",
            "--key-from",
            "json:/order/id",
        ],
    )
    .await;
    for _ in 0..3 {
        nats.0
            .publish(None, br#"{"order":{"id":"o-1"},"amount":10}"#)
            .await;
    }
    nats.0.publish(None, br#"{"amount":20}"#).await;
    consume::count_at_least(admin, "duplicate", 2.0).await;
    consume::until_settled(&nats).await;
    assert_eq!(ledger.calls("o-1"), vec![1]);
    let dead = nats.dead_letters().await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert!(
        dead[0].1.starts_with("no key at /order/id in the JSON payload"),
        "{dead:?}"
    );

    consume::refused_at_start(
        &nats,
        &nats.from(),
        &["--key-from", "record-key"],
        &["only Kafka records have a record key"],
        &[],
    );
    for (bad, why) in [
        ("header", "is not a key source"),
        ("header:", "a header name is 1 to 256 visible ASCII characters"),
        ("json:order", "must be empty or start with '/'"),
    ] {
        let (code, _, err) = common::idem(&[
            "consume",
            "--from",
            &nats.from(),
            "--to",
            "http://127.0.0.1:1/m",
            "--key-from",
            bad,
        ]);
        assert_eq!(code, 2, "{bad}: {err}");
        assert!(err.contains(why), "{bad}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_in_the_middle_of_a_batch_reruns_only_what_was_not_recorded() {
    let _ = consume::kill_9_in_the_middle_of_a_batch(&Nats::new().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_stream_or_dead_letter_subject_is_a_clear_error() {
    let setup = Nats::new().await;
    for (from, why) in [
        (
            format!(
                "{}?stream=NO_SUCH_STREAM_IDEM&consumer=c&dead_letter={}",
                nats_url(),
                setup.0.dead
            ),
            "the stream cannot be found",
        ),
        (
            format!(
                "{}?stream={}&consumer=c&dead_letter=nowhere.idem",
                nats_url(),
                setup.0.stream
            ),
            "which no stream stores",
        ),
        (
            format!(
                "{}?stream={}&consumer=whole&dead_letter={}",
                nats_url(),
                setup.0.stream,
                setup.0.dead
            ),
            "would receive its own dead letters",
        ),
    ] {
        consume::refused_at_start(&setup, &from, &[], &[why], &[]);
    }
}
