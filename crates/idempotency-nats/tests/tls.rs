//! NATS over TLS end to end: a worker on a JetStream stream of a server that requires TLS
//! (`scripts/services nats-tls`, port 4223), verified against the test CA named by `ca=`,
//! presenting `cert=`/`key=`; and each way verification must fail, failing at connect with its
//! cause.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use idempotency_consumer::Consumer;
use idempotency_core::{Key, MemoryStore};
use idempotency_nats::{AdapterErrorKind, NatsSource};
use idempotency_testkit::brokers::Charger;
use idempotency_testkit::eventually;
use idempotency_testkit::tls::file;

/// The server requiring TLS, named as its certificate names it.
fn tls_url() -> String {
    std::env::var("NATS_TLS_URL").unwrap_or_else(|_| "tls://localhost:4223".into())
}

const CONNECT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_over_tls_with_the_ca_and_a_client_certificate_runs_each_key_once() {
    let client = async_nats::ConnectOptions::new()
        .add_root_certificates(file("ca.pem").into())
        .connect(tls_url())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "NATS with TLS at {} is needed (scripts/services nats-tls): {e}",
                tls_url()
            )
        });
    let js = jetstream::new(client);
    let id = Key::generate().as_str().replace('-', "");
    let (stream, work, dead) = (
        format!("TLS_{id}"),
        format!("tls.{id}.work"),
        format!("tls.{id}.dead"),
    );
    js.create_stream(jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![work.clone(), dead.clone()],
        max_age: Duration::from_secs(600),
        ..Default::default()
    })
    .await
    .unwrap();
    let keys = ["tls-1", "tls-2", "tls-3"];
    for _ in 0..2 {
        for key in keys {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Idempotency-Key", key);
            js.publish_with_headers(work.clone(), headers, "ok".into())
                .await
                .unwrap()
                .await
                .unwrap();
        }
    }
    let url = format!(
        "{}?stream={stream}&consumer=workers&subject={work}&dead_letter={dead}&ca={}&cert={}&key={}",
        tls_url(),
        file("ca.pem"),
        file("client.pem"),
        file("client.key")
    );
    let source = NatsSource::from_url(&url).unwrap();
    assert!(source.tls.required, "tls:// requires TLS");
    let charger = Charger::default();
    let consumer = Arc::new(Consumer::new("tls", MemoryStore::new(), charger.clone()));
    let worker = source.connect(CONNECT, consumer).await.unwrap();
    let stop = Arc::new(tokio::sync::Notify::new());
    let stopped = Arc::clone(&stop);
    let running = tokio::spawn(async move { worker.run_until(stopped.notified_owned()).await });
    eventually(Duration::from_secs(30), "every key run", async || {
        keys.iter().all(|key| charger.0.effects(key) == 1)
    })
    .await;
    let stream = js.get_stream(&stream).await.unwrap();
    eventually(Duration::from_secs(30), "every copy acked", async || {
        let info = stream.clone().consumer_info("workers").await.unwrap();
        info.num_pending == 0 && info.num_ack_pending == 0
    })
    .await;
    stop.notify_one();
    running.await.unwrap().unwrap();
    for key in keys {
        assert_eq!(charger.0.calls(key), [1], "{key}");
    }
}

/// Connecting fails with the cause: the system's trust store does not know the test CA
/// (verification is on by default), another CA, another name, and a client requiring TLS of a
/// server without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_ca_a_wrong_name_and_a_server_without_tls_fail_at_connect() {
    let connect = async |url: String| {
        let consumer = Arc::new(Consumer::new("tls", MemoryStore::new(), Charger::default()));
        NatsSource::from_url(&url)
            .unwrap()
            .connect(CONNECT, consumer)
            .await
            .unwrap_err()
    };
    let system = connect(format!("{}?stream=S&consumer=C", tls_url())).await;
    assert_eq!(system.kind(), AdapterErrorKind::Unreachable, "{system}");
    assert!(system.to_string().contains("UnknownIssuer"), "{system}");
    let other = connect(format!(
        "{}?stream=S&consumer=C&ca={}",
        tls_url(),
        file("other-ca.pem")
    ))
    .await;
    assert!(other.to_string().contains("UnknownIssuer"), "{other}");
    let name = connect(format!(
        "tls://127.0.0.1:4223?stream=S&consumer=C&ca={}",
        file("ca.pem")
    ))
    .await;
    assert!(name.to_string().contains("not valid for name"), "{name}");
    let plain_server = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let without = connect(format!("{plain_server}?stream=S&consumer=C&tls_required=true")).await;
    assert_eq!(without.kind(), AdapterErrorKind::Unreachable, "{without}");
}

#[test]
fn tls_parameters_are_checked_when_the_url_is_parsed() {
    for (url, why) in [
        (
            format!("{}?stream=S&consumer=C&ca=/nonexistent/ca.pem", tls_url()),
            "`ca` /nonexistent/ca.pem: No such file",
        ),
        (
            format!("{}?stream=S&consumer=C&cert={}", tls_url(), file("client.pem")),
            "needs both `cert` and `key`",
        ),
        (
            format!("{}?stream=S&consumer=C&tls_required=yes", tls_url()),
            "tls_required=yes: expected true or false",
        ),
        (
            format!("{}?stream=S&consumer=C&nkey=/nonexistent/user.nk", tls_url()),
            "`nkey` /nonexistent/user.nk: No such file",
        ),
        (
            format!(
                "{}?stream=S&consumer=C&nkey={}&creds={}",
                tls_url(),
                file("ca.pem"),
                file("ca.pem")
            ),
            "give `nkey` or `creds`, not both",
        ),
    ] {
        let error = NatsSource::from_url(&url).unwrap_err();
        assert_eq!(error.kind(), AdapterErrorKind::Config, "{url}");
        assert!(error.to_string().contains(why), "{url}: {error}");
    }
}

/// A nats-server of the test's own, over TLS with the test CA, that admits one NKey user.
struct NkeyServer {
    process: std::process::Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for NkeyServer {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

impl NkeyServer {
    async fn start(user: &nkeys::KeyPair) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = format!(
            "listen: 127.0.0.1:{port}\n\
             jetstream {{ store_dir: \"{store}\" }}\n\
             tls {{ cert_file: \"{cert}\", key_file: \"{key}\" }}\n\
             authorization {{ users: [ {{ nkey: \"{public}\" }} ] }}\n",
            store = dir.path().join("js").display(),
            cert = file("server.pem"),
            key = file("server.key"),
            public = user.public_key(),
        );
        let path = dir.path().join("nats.conf");
        std::fs::write(&path, config).unwrap();
        let process = std::process::Command::new(
            std::env::var("NATS_SERVER").unwrap_or_else(|_| "/usr/sbin/nats-server".into()),
        )
        .arg("-c")
        .arg(&path)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("nats-server is needed (scripts/services nats installs it)");
        let address = format!("127.0.0.1:{port}");
        eventually(Duration::from_secs(20), "the NKey server listening", async || {
            tokio::net::TcpStream::connect(&address).await.is_ok()
        })
        .await;
        Self {
            process,
            url: format!("tls://localhost:{port}"),
            _dir: dir,
        }
    }
}

/// An NKey seed in a file authenticates the worker (a message runs once); another user's seed
/// is refused by the server, and a public key where the seed belongs is refused before
/// connecting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_nkey_seed_authenticates_and_another_users_is_refused() {
    let user = nkeys::KeyPair::new_user();
    let server = NkeyServer::start(&user).await;
    let files = tempfile::tempdir().unwrap();
    let write = |name: &str, text: String| {
        let path = files.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let seed = write("user.nk", format!("{}\n", user.seed().unwrap()));
    let stranger = write("stranger.nk", nkeys::KeyPair::new_user().seed().unwrap());
    let public = write("public.nk", user.public_key());

    let client = async_nats::ConnectOptions::with_nkey(user.seed().unwrap())
        .add_root_certificates(file("ca.pem").into())
        .connect(&server.url)
        .await
        .unwrap();
    let js = jetstream::new(client);
    js.create_stream(jetstream::stream::Config {
        name: "NKEY".into(),
        subjects: vec!["nkey.work".into(), "nkey.dead".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Idempotency-Key", "nkey-1");
    js.publish_with_headers("nkey.work", headers, "ok".into())
        .await
        .unwrap()
        .await
        .unwrap();

    let url = |seed_file: &str| {
        format!(
            "{}?stream=NKEY&consumer=workers&subject=nkey.work&dead_letter=nkey.dead&ca={}&nkey={seed_file}",
            server.url,
            file("ca.pem")
        )
    };
    let charger = Charger::default();
    let consumer = Arc::new(Consumer::new("nkey", MemoryStore::new(), charger.clone()));
    let worker = NatsSource::from_url(&url(&seed))
        .unwrap()
        .connect(CONNECT, consumer)
        .await
        .unwrap();
    let stop = Arc::new(tokio::sync::Notify::new());
    let stopped = Arc::clone(&stop);
    let running = tokio::spawn(async move { worker.run_until(stopped.notified_owned()).await });
    eventually(Duration::from_secs(30), "the message run", async || {
        charger.0.effects("nkey-1") == 1
    })
    .await;
    stop.notify_one();
    running.await.unwrap().unwrap();

    let consumer = Arc::new(Consumer::new("nkey", MemoryStore::new(), Charger::default()));
    let refused = NatsSource::from_url(&url(&stranger))
        .unwrap()
        .connect(CONNECT, Arc::clone(&consumer))
        .await
        .unwrap_err();
    assert_eq!(refused.kind(), AdapterErrorKind::Unreachable, "{refused}");
    assert!(refused.to_string().contains("authorization"), "{refused}");
    let public = NatsSource::from_url(&url(&public))
        .unwrap()
        .connect(CONNECT, consumer)
        .await
        .unwrap_err();
    assert_eq!(public.kind(), AdapterErrorKind::Config, "{public}");
    assert!(public.to_string().contains("not an NKey seed"), "{public}");
    assert!(!public.to_string().contains(&user.public_key()), "{public}");

    // A credentials file that is not one is refused with its path.
    let garbage = write("user.creds", "not a credentials file".into());
    let creds = format!(
        "{}?stream=NKEY&consumer=workers&ca={}&creds={garbage}",
        server.url,
        file("ca.pem")
    );
    let consumer = Arc::new(Consumer::new("nkey", MemoryStore::new(), Charger::default()));
    let malformed = NatsSource::from_url(&creds)
        .unwrap()
        .connect(CONNECT, consumer)
        .await
        .unwrap_err();
    assert_eq!(malformed.kind(), AdapterErrorKind::Config, "{malformed}");
    assert!(
        malformed.to_string().contains(&format!("`creds` {garbage}")),
        "{malformed}"
    );
}
