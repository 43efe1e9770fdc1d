//! `amqps://` end to end: a worker consuming over TLS (`scripts/services rabbitmq-tls`: a TLS
//! terminator on 5671 in front of the shared RabbitMQ), verified against the test CA named by
//! RabbitMQ's `cacertfile`, presenting `certfile`/`keyfile`; and each way verification must
//! fail, failing at the start check with its cause.

use std::sync::Arc;
use std::time::Duration;

use idempotency_amqp::{AdapterErrorKind, AmqpSource, Topology};
use idempotency_consumer::Consumer;
use idempotency_core::{Key, MemoryStore};
use idempotency_testkit::brokers::Charger;
use idempotency_testkit::eventually;
use idempotency_testkit::tls::file;
use lapin::options::{BasicPublishOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};

/// The amqps endpoint, named as its certificate names it.
fn tls_url() -> String {
    std::env::var("AMQPS_URL").unwrap_or_else(|_| "amqps://guest:guest@localhost:5671/%2f".into())
}

fn plain_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

const CHECK: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_over_amqps_with_the_ca_and_a_client_certificate_runs_each_key_once() {
    let queue = format!("idem-tls-{}", Key::generate());
    let url = format!(
        "{}?queue={queue}&expires=10m&cacertfile={}&certfile={}&keyfile={}",
        tls_url(),
        file("ca.pem"),
        file("client.pem"),
        file("client.key")
    );
    let source = AmqpSource::from_url(&url).unwrap();
    source.check(CHECK).await.unwrap_or_else(|e| {
        panic!(
            "amqps at {} is needed (scripts/services rabbitmq-tls): {e}",
            tls_url()
        )
    });

    // The queues as the worker declares them, so that the messages can be published first.
    let plain = Connection::connect(&plain_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = plain.create_channel().await.unwrap();
    let topology = Topology::for_queue(&queue).expires(Duration::from_secs(600));
    topology.declare(&channel).await.unwrap();
    let keys = ["tls-1", "tls-2", "tls-3"];
    for _ in 0..2 {
        for key in keys {
            let mut headers = FieldTable::default();
            headers.insert("Idempotency-Key".into(), AMQPValue::LongString(key.into()));
            channel
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    b"ok",
                    BasicProperties::default().with_headers(headers),
                )
                .await
                .unwrap()
                .await
                .unwrap();
        }
    }

    let charger = Charger::default();
    let consumer = Arc::new(Consumer::new("tls", MemoryStore::new(), charger.clone()));
    let stop = Arc::new(tokio::sync::Notify::new());
    let stopped = Arc::clone(&stop);
    let worker = source.worker(consumer);
    let running = tokio::spawn(async move { worker.run_until(stopped.notified_owned()).await });
    eventually(Duration::from_secs(30), "every key run", async || {
        keys.iter().all(|key| charger.0.effects(key) == 1)
    })
    .await;
    eventually(Duration::from_secs(30), "every copy acked", async || {
        channel
            .queue_declare(
                queue.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .is_ok_and(|q| q.message_count() == 0)
    })
    .await;
    stop.notify_one();
    running.await.unwrap().unwrap();
    for key in keys {
        assert_eq!(charger.0.calls(key), [1], "{key}");
    }
    for queue in [&topology.queue, &topology.retry_queue, &topology.dead_queue] {
        let _ = channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
}

/// The start check fails with the cause: the system's trust store does not know the test CA
/// (verification is on by default), another CA, another name, a plain client on the TLS port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_ca_a_wrong_name_and_a_plain_client_fail_the_start_check() {
    let check = async |url: String| {
        AmqpSource::from_url(&url)
            .unwrap()
            .check(CHECK)
            .await
            .unwrap_err()
    };
    let system = check(format!("{}?queue=q", tls_url())).await;
    assert_eq!(system.kind(), AdapterErrorKind::Unreachable, "{system}");
    assert!(system.to_string().contains("UnknownIssuer"), "{system}");
    let other = check(format!(
        "{}?queue=q&cacertfile={}",
        tls_url(),
        file("other-ca.pem")
    ))
    .await;
    assert!(other.to_string().contains("UnknownIssuer"), "{other}");
    let name = check(format!(
        "amqps://guest:guest@127.0.0.1:5671/%2f?queue=q&cacertfile={}",
        file("ca.pem")
    ))
    .await;
    assert!(name.to_string().contains("not valid for name"), "{name}");
    let plain = check("amqp://guest:guest@localhost:5671/%2f?queue=q".into()).await;
    assert_eq!(plain.kind(), AdapterErrorKind::Unreachable, "{plain}");
    for error in [&system, &other, &name, &plain] {
        assert!(!error.to_string().contains("guest:guest"), "{error}");
    }
}

#[test]
fn tls_parameters_are_checked_when_the_url_is_parsed() {
    for (url, why) in [
        (
            format!("{}?queue=q&cacertfile=/nonexistent/ca.pem", tls_url()),
            "`cacertfile` /nonexistent/ca.pem: No such file",
        ),
        (
            format!("{}?queue=q&certfile={}", tls_url(), file("client.pem")),
            "needs both `certfile` and `keyfile`",
        ),
        (
            format!("{}?queue=q&verify=verify_none", tls_url()),
            "`verify` is refused",
        ),
        (
            format!("{}?queue=q&server_name_indication=h", tls_url()),
            "`server_name_indication` is not supported",
        ),
        (
            format!("{}?queue=q&cacertfile={}", plain_url(), file("ca.pem")),
            "it is for amqps:// URLs",
        ),
    ] {
        let error = AmqpSource::from_url(&url).unwrap_err();
        assert_eq!(error.kind(), AdapterErrorKind::Config, "{url}");
        assert!(error.to_string().contains(why), "{url}: {error}");
    }
}

/// A publisher's connection (`connect_url`, which the outbox relay's `AmqpPublisher` uses) over
/// amqps with the CA: a confirmed publish arrives on the queue; another CA is refused at
/// connect with the cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_over_amqps_with_the_ca_delivers_and_another_ca_is_refused() {
    let queue = format!("idem-tls-publish-{}", Key::generate());
    let plain = Connection::connect(&plain_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let reader = plain.create_channel().await.unwrap();
    let mut arguments = FieldTable::default();
    arguments.insert("x-expires".into(), AMQPValue::LongUInt(600_000));
    reader
        .queue_declare(
            queue.as_str().into(),
            lapin::options::QueueDeclareOptions::default(),
            arguments,
        )
        .await
        .unwrap();

    let url = format!(
        "{}?heartbeat=10&cacertfile={}&certfile={}&keyfile={}",
        tls_url(),
        file("ca.pem"),
        file("client.pem"),
        file("client.key")
    );
    let connection = idempotency_amqp::connect_url(&url).await.unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await
        .unwrap();
    let key = Key::new("published-over-tls").unwrap();
    idempotency_amqp::publish_with_headers(&channel, "", &queue, &key, b"event", &[])
        .await
        .unwrap();
    let got = reader
        .basic_get(
            queue.as_str().into(),
            lapin::options::BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
        .expect("the published message on the queue");
    assert_eq!(got.delivery.data, b"event");
    let _ = connection.close(200, "done".into()).await;

    let other = format!("{}?cacertfile={}", tls_url(), file("other-ca.pem"));
    let refused = idempotency_amqp::connect_url(&other).await.unwrap_err();
    assert_eq!(refused.kind(), AdapterErrorKind::Unreachable, "{refused}");
    assert!(refused.to_string().contains("UnknownIssuer"), "{refused}");
    assert!(!refused.to_string().contains("guest:guest"), "{refused}");
    let _ = reader
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await;
}
