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
use idempotency_testkit::nats::TestStream;
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
    let TestStream {
        js,
        stream,
        work,
        dead,
        ..
    } = TestStream::on(jetstream::new(client), "tls", |_| {}).await;
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

/// The error of a worker's connection to `url`, which must fail.
async fn refused_at_connect(url: &str) -> idempotency_nats::AdapterError {
    let consumer = Arc::new(Consumer::new("refused", MemoryStore::new(), Charger::default()));
    NatsSource::from_url(url)
        .unwrap()
        .connect(CONNECT, consumer)
        .await
        .unwrap_err()
}

/// Connecting fails with the cause: the system's trust store does not know the test CA
/// (verification is on by default), another CA, another name, and a client requiring TLS of a
/// server without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_ca_a_wrong_name_and_a_server_without_tls_fail_at_connect() {
    let connect = async |url: String| refused_at_connect(&url).await;
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

/// A nats-server of the test's own, over TLS with the test CA, with JetStream and `auth` (the
/// lines of its configuration that say who may connect).
struct AuthServer {
    process: std::process::Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for AuthServer {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

impl AuthServer {
    /// A server that admits one NKey user.
    async fn nkey(user: &nkeys::KeyPair) -> Self {
        let public = user.public_key();
        Self::start(&format!(
            "authorization {{ users: [ {{ nkey: \"{public}\" }} ] }}\n"
        ))
        .await
    }

    /// A server in operator mode, as Synadia's service runs: it trusts `operator`'s key, knows
    /// `account` (and a system account, which JetStream needs) and admits the users whose JWTs
    /// the account signed.
    async fn operator(operator: &nkeys::KeyPair, account: &nkeys::KeyPair) -> Self {
        let system = nkeys::KeyPair::new_account();
        Self::start(&format!(
            "trusted_keys: [\"{}\"]\n\
             resolver: MEMORY\n\
             system_account: {}\n\
             resolver_preload: {{\n  {}: \"{}\"\n  {}: \"{}\"\n}}\n",
            operator.public_key(),
            system.public_key(),
            system.public_key(),
            account_jwt(operator, &system, "SYS", false),
            account.public_key(),
            account_jwt(operator, account, "idem", true),
        ))
        .await
    }

    async fn start(auth: &str) -> Self {
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
             {auth}",
            store = dir.path().join("js").display(),
            cert = file("server.pem"),
            key = file("server.key"),
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
        eventually(
            Duration::from_secs(20),
            "the test's nats-server listening",
            async || tokio::net::TcpStream::connect(&address).await.is_ok(),
        )
        .await;
        Self {
            process,
            url: format!("tls://localhost:{port}"),
            _dir: dir,
        }
    }
}

/// A NATS JWT (`ed25519-nkey`): `claims` with `jti`, `iat`, `iss` and `sub` added, signed by
/// `issuer`.
fn nats_jwt(issuer: &nkeys::KeyPair, subject: &str, mut claims: serde_json::Value) -> String {
    use base64::Engine as _;
    let encode = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    claims["jti"] = Key::generate().as_str().replace('-', "").to_uppercase().into();
    claims["iat"] = now.into();
    claims["iss"] = issuer.public_key().into();
    claims["sub"] = subject.into();
    let header = encode(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let body = encode(claims.to_string().as_bytes());
    let signed = format!("{header}.{body}");
    let signature = issuer.sign(signed.as_bytes()).unwrap();
    format!("{signed}.{}", encode(&signature))
}

/// An account JWT without limits, signed by `operator`, with JetStream or without.
fn account_jwt(operator: &nkeys::KeyPair, account: &nkeys::KeyPair, name: &str, jetstream: bool) -> String {
    let storage = if jetstream { -1 } else { 0 };
    let claims = serde_json::json!({
        "name": name,
        "nats": {
            "limits": {
                "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
                "wildcards": true, "conn": -1, "leaf": -1,
                "mem_storage": storage, "disk_storage": storage, "streams": storage, "consumer": storage
            },
            "default_permissions": { "pub": {}, "sub": {} },
            "type": "account",
            "version": 2
        }
    });
    nats_jwt(operator, &account.public_key(), claims)
}

/// A credentials file, as `nsc` writes them: the user's JWT (signed by `account`) and seed.
fn creds(account: &nkeys::KeyPair, user: &nkeys::KeyPair) -> String {
    let claims = serde_json::json!({
        "name": "worker",
        "nats": { "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2 }
    });
    let jwt = nats_jwt(account, &user.public_key(), claims);
    format!(
        "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
         ************************* IMPORTANT *************************\n\
         NKEY Seed printed below can be used to sign and prove identity.\n\n\
         -----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n",
        user.seed().unwrap()
    )
}

/// An NKey seed in a file authenticates the worker (a message runs once); another user's seed
/// is refused by the server, and a public key where the seed belongs is refused before
/// connecting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_nkey_seed_authenticates_and_another_users_is_refused() {
    let user = nkeys::KeyPair::new_user();
    let server = AuthServer::nkey(&user).await;
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
    runs_once_and_a_stranger_is_refused(client, &server.url, "nkey", &seed, &stranger).await;

    let public = format!(
        "{}?stream=NKEY&consumer=workers&ca={}&nkey={public}",
        server.url,
        file("ca.pem")
    );
    let public = refused_at_connect(&public).await;
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
    let malformed = refused_at_connect(&creds).await;
    assert_eq!(malformed.kind(), AdapterErrorKind::Config, "{malformed}");
    assert!(
        malformed.to_string().contains(&format!("`creds` {garbage}")),
        "{malformed}"
    );
}

/// A credentials file (a user JWT its account signed, and the user's seed) authenticates the
/// worker against a server in operator mode, over TLS: a message runs once. A user of an
/// account the server does not know is refused by the server, with its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credentials_file_authenticates_and_an_unknown_accounts_user_is_refused() {
    let operator = nkeys::KeyPair::new_operator();
    let account = nkeys::KeyPair::new_account();
    let server = AuthServer::operator(&operator, &account).await;
    let files = tempfile::tempdir().unwrap();
    let write = |name: &str, text: String| {
        let path = files.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let user = nkeys::KeyPair::new_user();
    let user_creds = write("user.creds", creds(&account, &user));
    let stranger = write("stranger.creds", creds(&nkeys::KeyPair::new_account(), &user));

    let client = async_nats::ConnectOptions::with_credentials_file(&user_creds)
        .await
        .unwrap()
        .add_root_certificates(file("ca.pem").into())
        .connect(&server.url)
        .await
        .unwrap();
    runs_once_and_a_stranger_is_refused(client, &server.url, "creds", &user_creds, &stranger).await;
}

/// Over `client`'s connection, a stream named after `auth` (the URL parameter, `nkey` or
/// `creds`) gets two copies of one message; a worker whose URL gives `auth=FILE` runs it once
/// and acknowledges both; one given `auth=STRANGER` is refused by the server.
async fn runs_once_and_a_stranger_is_refused(
    client: async_nats::Client,
    server: &str,
    auth: &str,
    auth_file: &str,
    stranger: &str,
) {
    let js = jetstream::new(client);
    let stream = auth.to_uppercase();
    js.create_stream(jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![format!("{auth}.work"), format!("{auth}.dead")],
        ..Default::default()
    })
    .await
    .unwrap();
    let key = format!("{auth}-1");
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Idempotency-Key", key.as_str());
    for _ in 0..2 {
        js.publish_with_headers(format!("{auth}.work"), headers.clone(), "ok".into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let url = |path: &str| {
        format!(
            "{server}?stream={stream}&consumer=workers&subject={auth}.work&dead_letter={auth}.dead&ca={}&{auth}={path}",
            file("ca.pem")
        )
    };
    let charger = Charger::default();
    let consumer = Arc::new(Consumer::new(
        auth.to_owned(),
        MemoryStore::new(),
        charger.clone(),
    ));
    let worker = NatsSource::from_url(&url(auth_file))
        .unwrap()
        .connect(CONNECT, consumer)
        .await
        .unwrap();
    let stop = Arc::new(tokio::sync::Notify::new());
    let stopped = Arc::clone(&stop);
    let running = tokio::spawn(async move { worker.run_until(stopped.notified_owned()).await });
    let stream = js.get_stream(&stream).await.unwrap();
    eventually(Duration::from_secs(30), "both copies acknowledged", async || {
        let info = stream.clone().consumer_info("workers").await;
        info.is_ok_and(|info| {
            info.num_pending == 0 && info.num_ack_pending == 0 && info.delivered.stream_sequence == 2
        })
    })
    .await;
    assert_eq!(charger.0.effects(&key), 1);
    stop.notify_one();
    running.await.unwrap().unwrap();

    let refused = refused_at_connect(&url(stranger)).await;
    assert_eq!(refused.kind(), AdapterErrorKind::Unreachable, "{refused}");
    assert!(refused.to_string().contains("authorization"), "{refused}");
}
