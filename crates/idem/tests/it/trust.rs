//! A CA named for a connection is the only CA trusted for it (docs/TLS.md), for every kind of
//! connection `idem` makes.
//!
//! Each case gives `idem` a system trust store of the test's own (`SSL_CERT_FILE` holding the
//! test CA that signed every TLS test server, `SSL_CERT_DIR` an empty directory), then:
//! - names no CA: the connection is made (the system store trusts the server), which shows the
//!   environment does what the case relies on;
//! - names another CA (`other-ca.pem`): refused, and the error names the cause
//!   (`UnknownIssuer`, OpenSSL's `certificate verify failed` for Kafka).
//!
//! The servers are those `scripts/services` starts beside the shared ones (PostgreSQL 5433,
//! MariaDB 3307, Redis 6390, a Redis Cluster on 7100-7102, RabbitMQ behind stunnel on 5671,
//! NATS 4223, Kafka behind stunnel on 9094, the local AWS server behind stunnel on 5443), and
//! an HTTPS server of the test's own with the test CA's `localhost` certificate for the
//! gateway's upstream, the consumer's handler and the relay's webhook.

use crate::common;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use idempotency::Key;
use idempotency_testkit::tls::file;

/// How long a command that is refused at start may take to exit: its checks at start wait 10 s
/// at most for a server; one that is still running after this connected.
const EXIT_WITHIN: std::time::Duration = std::time::Duration::from_secs(30);

/// The cause every refusal by rustls names: the server's chain does not lead to a trusted CA.
const UNKNOWN_ISSUER: &str = "UnknownIssuer";

/// A system trust store of the test's own that trusts the test CA alone: the environment of
/// every `idem` the cases run.
struct SystemStore {
    /// An empty `SSL_CERT_DIR`: the machine's `/etc/ssl/certs` is not read.
    dir: tempfile::TempDir,
}

impl SystemStore {
    fn trusting_the_test_ca() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("SSL_CERT_FILE", file("ca.pem")),
            ("SSL_CERT_DIR", self.dir.path().display().to_string()),
        ];
        // The local AWS server takes any credentials; the SDK's chain still wants some.
        for (name, default) in [
            ("AWS_ACCESS_KEY_ID", "test"),
            ("AWS_SECRET_ACCESS_KEY", "test"),
            ("AWS_REGION", "us-east-1"),
        ] {
            env.push((name, std::env::var(name).unwrap_or_else(|_| default.into())));
        }
        env
    }

    /// `idem args` run to completion: (exit code, stderr). A command still running after
    /// [`EXIT_WITHIN`] connected where it should not have (a consumer or a relay runs until it
    /// is stopped): it is killed, and its exit code is `-1`.
    fn run(&self, args: &[&str]) -> (i32, String) {
        let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(args)
            .envs(self.env())
            .env("IDEM_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stderr = child.stderr.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = std::io::Read::read_to_string(&mut stderr, &mut text);
            text
        });
        let deadline = std::time::Instant::now() + EXIT_WITHIN;
        let code = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status.code().unwrap_or(-1);
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                break -1;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        (code, reader.join().unwrap())
    }

    /// `idem args` succeeds.
    #[track_caller]
    fn connects(&self, args: &[&str]) {
        let (code, err) = self.run(args);
        assert_eq!(code, 0, "the system store trusts the server: {args:?}\n{err}");
    }

    /// `idem args` fails with exit code 1, its error naming `cause`.
    #[track_caller]
    fn refuses(&self, args: &[&str], cause: &str) {
        let (code, err) = self.run(args);
        assert_eq!(
            code, 1,
            "another CA is named, so the server is refused: {args:?}\n{err}"
        );
        assert!(err.contains(cause), "{cause:?} is not in: {err}");
    }

    /// `idem args` (a long-running command, with `--log-format json`) reaches the log line
    /// `message`, logged once its connections are made; then it is stopped.
    fn reaches(&self, args: &[&str], message: &str) {
        let mut all = args.to_vec();
        all.extend(["--log-format", "json"]);
        let mut process = common::spawn_idem(&all, &self.env(), "info", true);
        common::logged(&mut process, message);
        drop(process);
    }
}

fn tls_env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.into())
}

/// `url` with `parameter=other-ca.pem` added to its query.
fn naming_another_ca(url: &str, parameter: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{parameter}={}", file("other-ca.pem"))
}

#[test]
fn postgresql_sslrootcert_is_the_only_ca() {
    let store = SystemStore::trusting_the_test_ca();
    let url = tls_env("DATABASE_TLS_URL", "postgres://postgres@localhost:5433/test") + "?sslmode=verify-full";
    store.connects(&["migrate", "--store", &url]);
    let other = naming_another_ca(&url, "sslrootcert");
    store.refuses(&["migrate", "--store", &other], UNKNOWN_ISSUER);
    store.refuses(&["keys", "stats", "--store", &other], UNKNOWN_ISSUER);
}

#[test]
fn mysql_ssl_ca_is_the_only_ca() {
    let store = SystemStore::trusting_the_test_ca();
    let url = tls_env("MYSQL_TLS_URL", "mysql://root@localhost:3307/test") + "?ssl-mode=VERIFY_IDENTITY";
    store.connects(&["migrate", "--store", &url]);
    let other = naming_another_ca(&url, "ssl-ca");
    store.refuses(&["migrate", "--store", &other], UNKNOWN_ISSUER);
    store.refuses(&["keys", "stats", "--store", &other], UNKNOWN_ISSUER);
}

#[test]
fn redis_ca_is_the_only_ca() {
    let store = SystemStore::trusting_the_test_ca();
    let url = tls_env("REDIS_TLS_URL", "rediss://localhost:6390");
    store.connects(&["keys", "stats", "--store", &url]);
    store.refuses(
        &["keys", "stats", "--store", &naming_another_ca(&url, "ca")],
        UNKNOWN_ISSUER,
    );
}

#[test]
fn redis_cluster_ca_is_the_only_ca() {
    let store = SystemStore::trusting_the_test_ca();
    let url = tls_env(
        "REDIS_CLUSTER_TLS_URL",
        "rediss-cluster://localhost:7100,localhost:7101,localhost:7102",
    );
    store.connects(&["keys", "stats", "--store", &url]);
    store.refuses(
        &["keys", "stats", "--store", &naming_another_ca(&url, "ca")],
        UNKNOWN_ISSUER,
    );
}

#[cfg(feature = "dynamodb")]
#[test]
fn dynamodb_ca_is_the_only_ca() {
    let store = SystemStore::trusting_the_test_ca();
    let endpoint = tls_env("AWS_TLS_ENDPOINT_URL", "https://localhost:5443");
    let table = format!("trust-{}", Key::generate());
    let url = format!("dynamodb://{table}?region=us-east-1&endpoint={endpoint}");
    store.connects(&["migrate", "--store", &url]);
    store.refuses(
        &["keys", "stats", "--store", &naming_another_ca(&url, "ca")],
        UNKNOWN_ISSUER,
    );
}

/// `idem consume --from FROM` with a handler nothing listens on and an in-memory store.
fn consume_args(from: &str) -> Vec<&str> {
    vec![
        "consume",
        "--from",
        from,
        "--to",
        "http://127.0.0.1:1/m",
        "--store",
        "memory://",
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_cacertfile_is_the_only_ca() {
    let store = SystemStore::trusting_the_test_ca();
    let queue = format!("trust-{}", Key::generate());
    let from = format!(
        "{}?queue={queue}",
        tls_env("AMQPS_URL", "amqps://guest:guest@localhost:5671/%2f")
    );
    store.reaches(&consume_args(&from), "consuming");
    let other = naming_another_ca(&from, "cacertfile");
    store.refuses(&consume_args(&other), UNKNOWN_ISSUER);
    // The consumer declared the queue and its two companions on the shared broker.
    let connection = lapin::Connection::connect(
        &tls_env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"),
        lapin::ConnectionProperties::default(),
    )
    .await
    .unwrap();
    let channel = connection.create_channel().await.unwrap();
    for name in [queue.clone(), format!("{queue}.retry"), format!("{queue}.dead")] {
        let _ = channel
            .queue_delete(
                name.as_str().into(),
                lapin::options::QueueDeleteOptions::default(),
            )
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_ca_is_the_only_ca() {
    use idempotency_testkit::nats::TestStream;

    let store = SystemStore::trusting_the_test_ca();
    let url = tls_env("NATS_TLS_URL", "tls://localhost:4223");
    let client = async_nats::ConnectOptions::new()
        .add_root_certificates(file("ca.pem").into())
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("NATS with TLS at {url} is needed (scripts/services nats-tls): {e}"));
    let stream = TestStream::on(async_nats::jetstream::new(client), "trust", |_| {}).await;
    let from = format!(
        "{url}?stream={}&consumer=idem&subject={}&dead_letter={}",
        stream.stream, stream.work, stream.dead
    );
    store.reaches(&consume_args(&from), "consuming");
    store.refuses(&consume_args(&naming_another_ca(&from, "ca")), UNKNOWN_ISSUER);
}

#[cfg(feature = "kafka")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_ssl_ca_location_is_the_only_ca() {
    use idempotency_kafka::rdkafka::ClientConfig;
    use idempotency_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use idempotency_kafka::rdkafka::client::DefaultClientContext;

    let store = SystemStore::trusting_the_test_ca();
    let brokers = tls_env("KAFKA_TLS_BROKERS", "localhost:9094");
    let topic = format!("trust-{}", Key::generate());
    let security = "security.protocol=SASL_SSL&sasl.mechanism=SCRAM-SHA-512";
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("security.protocol", "SASL_SSL")
        .set("sasl.mechanism", "SCRAM-SHA-512")
        .set("sasl.username", "idem")
        .set("sasl.password", "idem-test-password")
        .set("ssl.ca.location", file("ca.pem"))
        .create()
        .unwrap();
    let dead = format!("{topic}.dead");
    let topics = [
        NewTopic::new(&topic, 1, TopicReplication::Fixed(1)),
        NewTopic::new(&dead, 1, TopicReplication::Fixed(1)),
    ];
    let options = AdminOptions::new().operation_timeout(Some(std::time::Duration::from_secs(10)));
    for created in admin.create_topics(&topics, &options).await.unwrap_or_else(|e| {
        panic!("the SASL_SSL Kafka broker at {brokers} is needed (scripts/services kafka-tls): {e}")
    }) {
        created.unwrap();
    }
    let from = format!("kafka://idem:idem-test-password@{brokers}?topic={topic}&group=trust&{security}");
    store.reaches(&consume_args(&from), "consuming");
    let other = naming_another_ca(&from, "ssl.ca.location");
    store.refuses(&consume_args(&other), "certificate verify failed");
}

#[cfg(feature = "sqs")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_ca_is_the_only_ca() {
    let store = SystemStore::trusting_the_test_ca();
    let plain = tls_env("AWS_ENDPOINT_URL", "http://127.0.0.1:5000");
    let endpoint = tls_env("AWS_TLS_ENDPOINT_URL", "https://localhost:5443");
    let client = idempotency_sqs::client(Some(&plain), Some("us-east-1")).await;
    let queue = format!("trust-{}", Key::generate());
    let mut paths = Vec::new();
    for name in [queue.clone(), format!("{queue}-dead")] {
        let created = client
            .create_queue()
            .queue_name(name)
            .send()
            .await
            .unwrap_or_else(|e| {
                panic!("the local AWS server at {plain} is needed (scripts/services): {e:?}")
            });
        paths.push(
            created
                .queue_url
                .unwrap()
                .splitn(4, '/')
                .nth(3)
                .unwrap()
                .to_owned(),
        );
    }
    let from = format!("sqs://?queue_url={endpoint}/{}&wait=0s", paths[0]);
    store.reaches(&consume_args(&from), "consuming");
    store.refuses(&consume_args(&naming_another_ca(&from, "ca")), UNKNOWN_ISSUER);
}

/// An HTTPS server with the test CA's `localhost` certificate that answers every request with
/// `201`, counting the requests that reached it.
async fn https_server() -> (SocketAddr, Arc<AtomicU32>) {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    let chain = CertificateDer::pem_file_iter(file("server.pem"))
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(file("server.key")).unwrap();
    let config =
        rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&served);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (acceptor, counted) = (acceptor.clone(), Arc::clone(&counted));
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(stream).await else {
                    return;
                };
                let service = hyper::service::service_fn(move |_request| {
                    counted.fetch_add(1, Ordering::SeqCst);
                    async {
                        Ok::<_, std::convert::Infallible>(
                            http::Response::builder()
                                .status(201)
                                .body(http_body_util::Full::new(bytes::Bytes::from_static(b"made\n")))
                                .unwrap(),
                        )
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, served)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateways_upstream_ca_is_the_only_ca() {
    let store = SystemStore::trusting_the_test_ca();
    let (upstream, served) = https_server().await;
    let upstream = format!("https://localhost:{}", upstream.port());
    let other = file("other-ca.pem");
    let client = common::client();
    for (flags, status, cause) in [
        (vec![], 201, None),
        (vec!["--upstream-ca", other.as_str()], 502, Some(UNKNOWN_ISSUER)),
    ] {
        let listen = common::free_addr().to_string();
        let mut args = vec![
            "serve",
            "--listen",
            &listen,
            "--upstream",
            &upstream,
            "--store",
            "memory://",
        ];
        args.extend(flags);
        let gateway = common::spawn_idem(&args, &store.env(), "warn", false);
        let gateway = common::ready(gateway, listen.parse().unwrap(), "idem serve").await;
        let key = format!("trust-{}", Key::generate());
        let seen = common::send(
            &client,
            listen.parse().unwrap(),
            "POST",
            "/pay",
            &[("Idempotency-Key", &key)],
            b"{}",
        )
        .await;
        assert_eq!(seen.status, status, "{args:?}: {:?}", seen.body);
        if let Some(cause) = cause {
            let detail = seen.json()["detail"].as_str().unwrap_or_default().to_owned();
            assert!(detail.contains(cause), "{cause:?} is not in: {detail}");
        }
        drop(gateway);
    }
    assert_eq!(
        served.load(Ordering::SeqCst),
        1,
        "only the request over the system's store reached it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumers_to_ca_is_the_only_ca() {
    use idempotency_testkit::nats::{TestStream, nats_url};

    let store = SystemStore::trusting_the_test_ca();
    let (handler, _) = https_server().await;
    let to = format!("https://localhost:{}/m", handler.port());
    let stream = TestStream::new("trustto", |_| {}).await;
    let from = format!(
        "{}?stream={}&consumer=idem&subject={}&dead_letter={}",
        nats_url(),
        stream.stream,
        stream.work,
        stream.dead
    );
    let args = ["consume", "--from", &from, "--to", &to, "--store", "memory://"];
    store.reaches(&args, "consuming");
    let other = file("other-ca.pem");
    let mut naming = args.to_vec();
    naming.extend(["--to-ca", other.as_str()]);
    store.refuses(&naming, UNKNOWN_ISSUER);
}

/// An outbox table of the test's own on the shared PostgreSQL, made by `idem relay migrate`;
/// dropped with the value.
struct Outbox {
    table: String,
}

impl Outbox {
    fn new(store: &SystemStore) -> Self {
        let table = format!("trust_outbox_{}", Key::generate().as_str().replace('-', ""));
        store.connects(&[
            "relay",
            "migrate",
            "--database",
            &common::database_url(),
            "--outbox-table",
            &table,
        ]);
        Self { table }
    }

    /// `idem relay` from this table to `to`, with `more`.
    fn relay<'a>(&'a self, database: &'a str, to: &'a str, more: &[&'a str]) -> Vec<&'a str> {
        let mut args = vec![
            "relay",
            "--database",
            database,
            "--outbox-table",
            &self.table,
            "--to",
            to,
        ];
        args.extend(more);
        args
    }
}

impl Drop for Outbox {
    fn drop(&mut self) {
        let _ = Command::new("psql")
            .args([
                &common::database_url(),
                "-qc",
                &format!("DROP TABLE IF EXISTS {} CASCADE", self.table),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relays_webhook_to_ca_is_the_only_ca() {
    let store = SystemStore::trusting_the_test_ca();
    let outbox = Outbox::new(&store);
    let database = common::database_url();
    let (webhook, _) = https_server().await;
    let to = format!("https://localhost:{}/hooks/{{destination}}", webhook.port());
    store.reaches(&outbox.relay(&database, &to, &[]), "relaying");
    let other = file("other-ca.pem");
    store.refuses(
        &outbox.relay(&database, &to, &["--to-ca", &other]),
        UNKNOWN_ISSUER,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relays_broker_destination_ca_is_the_only_ca() {
    let store = SystemStore::trusting_the_test_ca();
    let outbox = Outbox::new(&store);
    let database = common::database_url();
    let to = format!(
        "{}?exchange=amq.direct",
        tls_env("AMQPS_URL", "amqps://guest:guest@localhost:5671/%2f")
    );
    store.reaches(&outbox.relay(&database, &to, &[]), "relaying");
    let other = naming_another_ca(&to, "cacertfile");
    store.refuses(&outbox.relay(&database, &other, &[]), UNKNOWN_ISSUER);
}

#[test]
fn a_relay_broker_url_names_its_own_ca_not_to_ca() {
    let store = SystemStore::trusting_the_test_ca();
    let other = file("other-ca.pem");
    let (code, err) = store.run(&[
        "relay",
        "--database",
        &common::database_url(),
        "--to",
        "amqp://guest:guest@127.0.0.1:5672/%2f?exchange=amq.direct",
        "--to-ca",
        &other,
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("--to-ca, --to-client-cert and --to-insecure-skip-verify are for a webhook"),
        "{err}"
    );
}
