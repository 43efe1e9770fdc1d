//! OpenTelemetry traces from the outside: `idem serve` and `idem consume` as processes of their
//! own, exporting OTLP (HTTP/protobuf) to a receiver in this test that decodes each export with
//! the OpenTelemetry protocol's own types. The spans are read after SIGTERM, which flushes the
//! exporter: every step is ordered by events.

use crate::common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::routing::post;
use common::consume::{Ledger, start_handler};
use common::{client, free_addr, ready, send};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use prost::Message;

/// A span as the receiver decoded it.
#[derive(Debug, Clone)]
struct Span {
    name: String,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    attributes: HashMap<String, String>,
}

/// An OTLP/HTTP receiver: every span of every export, and the service names they came from.
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Span>>>,
    services: Arc<Mutex<Vec<String>>>,
}

impl Receiver {
    async fn start(&self) -> SocketAddr {
        let receiver = self.clone();
        let app = Router::new().route(
            "/v1/traces",
            post(move |body: Bytes| {
                let receiver = receiver.clone();
                async move {
                    let export = ExportTraceServiceRequest::decode(body).expect("an OTLP export");
                    for resource in export.resource_spans {
                        let service = resource
                            .resource
                            .iter()
                            .flat_map(|resource| &resource.attributes)
                            .find(|attribute| attribute.key == "service.name")
                            .map(|attribute| text(attribute.value.as_ref().and_then(|v| v.value.as_ref())))
                            .unwrap_or_default();
                        receiver.services.lock().unwrap().push(service);
                        for scope in resource.scope_spans {
                            for span in scope.spans {
                                receiver.spans.lock().unwrap().push(Span {
                                    name: span.name,
                                    trace_id: hex(&span.trace_id),
                                    span_id: hex(&span.span_id),
                                    parent_span_id: hex(&span.parent_span_id),
                                    attributes: span
                                        .attributes
                                        .into_iter()
                                        .map(|attribute| {
                                            let value =
                                                text(attribute.value.as_ref().and_then(|v| v.value.as_ref()));
                                            (attribute.key, value)
                                        })
                                        .collect(),
                                });
                            }
                        }
                    }
                    http::StatusCode::OK
                }
            }),
        );
        common::serve_app(app).await
    }

    /// As [`start`](Self::start), over TLS with `leaf`'s certificate; counts the refused
    /// handshakes.
    async fn start_tls(&self, leaf: &common::pki::Leaf) -> (SocketAddr, Arc<std::sync::atomic::AtomicU32>) {
        let plain = self.start().await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(common::pki::Ca::server_config(leaf));
        let refused: Arc<std::sync::atomic::AtomicU32> = Arc::default();
        let counted = Arc::clone(&refused);
        // TLS terminated here, then the bytes go to the plain receiver.
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (acceptor, refused) = (acceptor.clone(), Arc::clone(&counted));
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(stream).await else {
                        refused.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        return;
                    };
                    let mut backend = tokio::net::TcpStream::connect(plain).await.unwrap();
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut backend).await;
                });
            }
        });
        (addr, refused)
    }

    fn in_trace(&self, trace_id: &str) -> Vec<Span> {
        self.spans
            .lock()
            .unwrap()
            .iter()
            .filter(|span| span.trace_id == trace_id)
            .cloned()
            .collect()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

fn text(value: Option<&Any>) -> String {
    match value {
        Some(Any::StringValue(text)) => text.clone(),
        Some(Any::IntValue(number)) => number.to_string(),
        Some(Any::BoolValue(flag)) => flag.to_string(),
        Some(Any::DoubleValue(number)) => number.to_string(),
        other => format!("{other:?}"),
    }
}

/// The variables that turn the export on, to `receiver`, flushing every 100 ms.
fn otel_env(receiver: SocketAddr, service: &str) -> Vec<(&'static str, String)> {
    vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{receiver}")),
        ("OTEL_SERVICE_NAME", service.to_owned()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100".to_owned()),
    ]
}

fn traceparent(trace_id: &str) -> String {
    format!("00-{trace_id}-00f067aa0ba902b7-01")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_continues_the_clients_trace_through_the_store_to_the_upstream_and_a_replay_skips_it() {
    let receiver = Receiver::default();
    let otlp = receiver.start().await;
    // The upstream notes the traceparent each request brought.
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let upstream = {
        let seen = Arc::clone(&seen);
        let app = Router::new().route(
            "/pay",
            post(move |headers: http::HeaderMap| {
                let seen = Arc::clone(&seen);
                async move {
                    let parent = headers.get("traceparent").map(|v| v.to_str().unwrap().to_owned());
                    seen.lock().unwrap().push(parent.unwrap_or_default());
                    (http::StatusCode::CREATED, "charged")
                }
            }),
        );
        common::serve_app(app).await
    };
    let listen = free_addr();
    let (listen_text, upstream_text) = (listen.to_string(), format!("http://{upstream}"));
    let args = [
        "serve",
        "--listen",
        &listen_text,
        "--upstream",
        &upstream_text,
        "--store",
        "memory://",
    ];
    let env = otel_env(otlp, "idem-gateway-test");
    let mut gateway = ready(
        common::spawn_idem(&args, &env, "warn", false),
        listen,
        "idem serve",
    )
    .await;
    let (first, replay) = (
        "4bf92f3577b34da6a3ce929d0e0e4736",
        "5ce0e9a56015fec5aadfa328ae398115",
    );
    let pay = async |trace: &str| {
        let headers = [
            ("idempotency-key", "order-traced-1"),
            ("traceparent", &traceparent(trace)),
        ];
        send(&client(), listen, "POST", "/pay", &headers, b"{}").await
    };
    assert_eq!(pay(first).await.status, 201);
    let replayed = pay(replay).await;
    assert_eq!(replayed.header("idempotent-replayed"), Some("true"));
    let exited = tokio::task::spawn_blocking(move || gateway.terminate(Duration::from_secs(30)));
    assert_eq!(exited.await.unwrap().and_then(|status| status.code()), Some(0));

    assert!(
        receiver
            .services
            .lock()
            .unwrap()
            .iter()
            .all(|service| service == "idem-gateway-test")
    );
    let spans = receiver.in_trace(first);
    let named = |name: &str| -> Vec<&Span> { spans.iter().filter(|span| span.name == name).collect() };
    let server = named("idem.request");
    assert_eq!(server.len(), 1, "{spans:#?}");
    assert_eq!(
        server[0].parent_span_id, "00f067aa0ba902b7",
        "the client's span is the parent"
    );
    let guarded = named("idempotency.request");
    assert_eq!(guarded.len(), 1, "{spans:#?}");
    assert_eq!(guarded[0].attributes["decision"], "acquired");
    assert_eq!(guarded[0].attributes["attempt"], "1");
    assert_eq!(guarded[0].parent_span_id, server[0].span_id);
    assert!(
        named("idempotency.store").len() >= 2,
        "begin and complete: {spans:#?}"
    );
    let upstream_span = named("upstream");
    assert_eq!(upstream_span.len(), 1, "{spans:#?}");
    assert_eq!(upstream_span[0].attributes["http.response.status_code"], "201");
    // The upstream got the trace, with the upstream span as its parent.
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen, [format!("00-{first}-{}-01", upstream_span[0].span_id)]);

    let spans = receiver.in_trace(replay);
    let guarded: Vec<&Span> = spans
        .iter()
        .filter(|span| span.name == "idempotency.request")
        .collect();
    assert_eq!(guarded.len(), 1, "{spans:#?}");
    assert_eq!(guarded[0].attributes["decision"], "replayed");
    assert!(
        spans.iter().all(|span| span.name != "upstream"),
        "a replay calls no upstream: {spans:#?}"
    );
}

/// RabbitMQ: a queue of the test's own, as `idem consume` declares it.
struct Rabbit {
    _connection: lapin::Connection,
    channel: lapin::Channel,
    queue: String,
}

impl Rabbit {
    /// `--from` for `idem consume`.
    fn from(&self) -> String {
        let url =
            std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
        format!("{url}?queue={}", self.queue)
    }

    async fn new() -> Self {
        let url =
            std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
        let connection = lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("RabbitMQ at {url} is needed for this test: {e}"));
        let channel = connection.create_channel().await.unwrap();
        let queue = format!("idem-traces-{}", idempotency::Key::generate());
        idempotency_amqp::Topology::for_queue(&queue)
            .declare(&channel)
            .await
            .unwrap();
        Self {
            _connection: connection,
            channel,
            queue,
        }
    }

    async fn publish_traced(&self, key: &str, payload: &[u8], traceparent: Option<&str>) {
        use lapin::types::{AMQPValue, FieldTable, LongString};
        let mut headers = FieldTable::default();
        headers.insert(
            "Idempotency-Key".into(),
            AMQPValue::LongString(LongString::from(key)),
        );
        if let Some(traceparent) = traceparent {
            headers.insert(
                "traceparent".into(),
                AMQPValue::LongString(LongString::from(traceparent)),
            );
        }
        self.channel
            .basic_publish(
                "".into(),
                self.queue.as_str().into(),
                lapin::options::BasicPublishOptions::default(),
                payload,
                lapin::BasicProperties::default().with_headers(headers),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_consume_continues_a_messages_trace_to_the_handler() {
    let receiver = Receiver::default();
    let otlp = receiver.start().await;
    let ledger = Ledger::default();
    let handler = start_handler(ledger.clone()).await;
    let rabbit = Rabbit::new().await;
    let admin = free_addr();
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
    ];
    let env = otel_env(otlp, "idem-consume-test");
    let mut consume = ready(
        common::spawn_idem(&args, &env, "warn", false),
        admin,
        "idem consume",
    )
    .await;
    let trace = "0af7651916cd43dd8448eb211c80319c";
    rabbit
        .publish_traced("order-traced-2", b"charge", Some(&traceparent(trace)))
        .await;
    common::consume::until("the handler's call", || ledger.calls("order-traced-2").len() == 1).await;
    let exited = tokio::task::spawn_blocking(move || consume.terminate(Duration::from_secs(30)));
    assert_eq!(exited.await.unwrap().and_then(|status| status.code()), Some(0));

    let spans = receiver.in_trace(trace);
    let call: Vec<&Span> = spans.iter().filter(|span| span.name == "idem.handler").collect();
    assert_eq!(call.len(), 1, "{spans:#?}");
    assert_eq!(
        call[0].parent_span_id, "00f067aa0ba902b7",
        "the message's span is the parent"
    );
    let received = ledger
        .header("order-traced-2", "traceparent")
        .expect("the handler got a traceparent");
    assert_eq!(received, format!("00-{trace}-{}-01", call[0].span_id));
}

/// An `https://` collector is verified against the system's trust store, which `SSL_CERT_FILE`
/// names here: with the collector's CA the spans arrive; with another CA the handshake is
/// refused and nothing is exported (the request itself is served all the same).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_collector_gets_the_spans_only_when_its_certificate_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let ca = common::pki::Ca::new("collector CA");
    let ca_file = ca.write(dir.path(), "collector-ca");
    let other_file = common::pki::Ca::new("another CA").write(dir.path(), "other-ca");
    let leaf = ca.server(&["localhost"], 7, common::pki::Validity::Current);
    let receiver = Receiver::default();
    let (collector, refused) = receiver.start_tls(&leaf).await;
    let upstream = {
        let app = Router::new().route("/pay", post(|| async { (http::StatusCode::CREATED, "charged") }));
        common::serve_app(app).await
    };
    for (trust, trace, exported) in [
        (&ca_file, "1bf92f3577b34da6a3ce929d0e0e4731", true),
        (&other_file, "2bf92f3577b34da6a3ce929d0e0e4732", false),
    ] {
        let listen = free_addr();
        let (listen_text, upstream_text) = (listen.to_string(), format!("http://{upstream}"));
        let args = [
            "serve",
            "--listen",
            &listen_text,
            "--upstream",
            &upstream_text,
            "--store",
            "memory://",
        ];
        let env = [
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                format!("https://localhost:{}", collector.port()),
            ),
            ("OTEL_BSP_SCHEDULE_DELAY", "100".to_owned()),
            ("SSL_CERT_FILE", trust.display().to_string()),
        ];
        let mut gateway = ready(
            common::spawn_idem(&args, &env, "warn", false),
            listen,
            "idem serve",
        )
        .await;
        let headers = [("idempotency-key", trace), ("traceparent", &traceparent(trace))];
        assert_eq!(
            send(&client(), listen, "POST", "/pay", &headers, b"{}")
                .await
                .status,
            201
        );
        let exited = tokio::task::spawn_blocking(move || gateway.terminate(Duration::from_secs(30)));
        assert_eq!(exited.await.unwrap().and_then(|status| status.code()), Some(0));
        let spans = receiver.in_trace(trace);
        if exported {
            assert!(spans.iter().any(|span| span.name == "upstream"), "{spans:#?}");
            assert_eq!(refused.load(std::sync::atomic::Ordering::SeqCst), 0);
        } else {
            assert!(
                spans.is_empty(),
                "exported to a collector of another CA: {spans:#?}"
            );
            assert!(
                refused.load(std::sync::atomic::Ordering::SeqCst) > 0,
                "no handshake was refused"
            );
        }
    }
}
