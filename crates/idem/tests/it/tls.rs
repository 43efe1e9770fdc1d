//! `idem serve` over TLS, end to end: the binary as a process of its own, an HTTPS client in
//! front of it and an HTTPS upstream behind it, each with certificates of a test CA made here.
//!
//! What must hold: a request runs once over HTTPS on both sides (64 copies of a key at once,
//! then a replay); a certificate replaced and reloaded with `SIGHUP` while 50 requests are in
//! flight fails none of them, and new connections get the new certificate; a pair that cannot
//! be used keeps the old one; client certificates are required when a client CA is given; an
//! upstream whose certificate is refused (another CA, another name, expired) or that speaks
//! plain HTTP gets nothing, and the client a `502 upstream-tls` naming the cause; unusable PEM
//! files stop the gateway at start with the path and the reason.

use crate::common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use bytes::Bytes;
use common::pki::{Ca, Leaf, Validity};
use common::{Process, free_addrs, idem};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use idempotency_testkit::eventually;
use rustls::pki_types::ServerName;
use tokio::sync::Notify;

/// What the HTTPS upstream saw.
#[derive(Default)]
struct Seen {
    /// Executions per forwarded key.
    calls: Mutex<HashMap<String, u32>>,
    /// Requests that arrived on `/hold` and wait for `release`.
    holding: AtomicU32,
    release: Notify,
    /// TLS handshakes the upstream refused or that broke off (a plaintext request among them).
    failed_handshakes: AtomicU32,
    /// Requests served, whatever their path.
    requests: AtomicU32,
}

impl Seen {
    fn calls(&self, key: &str) -> u32 {
        self.calls.lock().unwrap().get(key).copied().unwrap_or(0)
    }
}

fn count(seen: &Seen, headers: &HeaderMap) -> u32 {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_owned();
    let mut calls = seen.calls.lock().unwrap();
    let n = calls.entry(key).or_default();
    *n += 1;
    *n
}

/// `POST /pay`: counts the call, answers 201 with the count after a short while (so that
/// copies of one key overlap). `POST /hold`: counts, then waits for `release`. `GET /ping`.
fn upstream_app(seen: Arc<Seen>) -> Router {
    Router::new()
        .route(
            "/pay",
            post(|State(seen): State<Arc<Seen>>, headers: HeaderMap| async move {
                let n = count(&seen, &headers);
                tokio::time::sleep(Duration::from_millis(200)).await;
                (StatusCode::CREATED, format!("charged {n}")).into_response()
            }),
        )
        .route(
            "/hold",
            post(|State(seen): State<Arc<Seen>>, headers: HeaderMap| async move {
                let n = count(&seen, &headers);
                let released = seen.release.notified();
                seen.holding.fetch_add(1, Ordering::SeqCst);
                released.await;
                (StatusCode::CREATED, format!("held {n}")).into_response()
            }),
        )
        .route("/ping", get(|| async { "pong" }))
        .with_state(seen)
}

/// An HTTPS upstream presenting `leaf` (or plain HTTP when `None`), in this process.
async fn start_upstream(leaf: Option<&Leaf>) -> (SocketAddr, Arc<Seen>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Seen::default());
    let app = upstream_app(Arc::clone(&seen));
    let acceptor = leaf.map(|leaf| tokio_rustls::TlsAcceptor::from(Ca::server_config(leaf)));
    let counted = Arc::clone(&seen);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (app, seen, acceptor) = (app.clone(), Arc::clone(&counted), acceptor.clone());
            tokio::spawn(async move {
                let requests = Arc::clone(&seen);
                let service = TowerToHyperService::new(tower::ServiceExt::map_request(
                    app,
                    move |request: http::Request<hyper::body::Incoming>| {
                        requests.requests.fetch_add(1, Ordering::SeqCst);
                        request
                    },
                ));
                let builder = hyper::server::conn::http1::Builder::new();
                match acceptor {
                    None => {
                        let _ = builder.serve_connection(TokioIo::new(stream), service).await;
                    }
                    Some(acceptor) => match acceptor.accept(stream).await {
                        Ok(stream) => {
                            let _ = builder.serve_connection(TokioIo::new(stream), service).await;
                        }
                        Err(_) => {
                            seen.failed_handshakes.fetch_add(1, Ordering::SeqCst);
                        }
                    },
                }
            });
        }
    });
    (addr, seen)
}

type HttpsClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// An HTTPS client trusting `ca` only (presenting `identity` if given), `pool` connections kept.
fn https_client(ca: &Ca, identity: Option<&Leaf>) -> HttpsClient {
    let mut config = (*ca.client_config(identity)).clone();
    config.alpn_protocols.clear();
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_only()
        .enable_http1()
        .build();
    Client::builder(TokioExecutor::new()).build(connector)
}

/// `POST https://localhost:PORT{path}` with `key`: (status, body).
async fn post_tls(
    client: &HttpsClient,
    gateway: SocketAddr,
    path: &str,
    key: &str,
) -> Result<(u16, String), String> {
    let request = http::Request::post(format!("https://localhost:{}{path}", gateway.port()))
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"{\"amount\":10}")))
        .unwrap();
    let response = client.request(request).await.map_err(|e| format!("{e:?}"))?;
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// The certificate a new TLS connection to `addr` is shown (the handshake verified by `ca`).
async fn served_certificate(ca: &Ca, addr: SocketAddr) -> rustls::pki_types::CertificateDer<'static> {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let connector = tokio_rustls::TlsConnector::from(ca.client_config(None));
    let stream = connector
        .connect(ServerName::try_from("localhost").unwrap(), stream)
        .await
        .expect("a verified handshake");
    stream.get_ref().1.peer_certificates().unwrap()[0].clone()
}

/// Starts `idem serve` on `listen` with `args` and a plain admin listener on `admin`; waits
/// until the admin listener answers its health check.
async fn start_gateway(listen: SocketAddr, admin: SocketAddr, store: &str, args: &[&str]) -> Process {
    let (listen, admin_text) = (listen.to_string(), admin.to_string());
    let mut all = vec![
        "serve",
        "--listen",
        listen.as_str(),
        "--admin-listen",
        admin_text.as_str(),
        "--store",
        store,
    ];
    all.extend_from_slice(args);
    common::ready_on(common::spawn_serve(&all), admin, "/healthz", "idem serve").await
}

/// Waits until the series `name` with `labels` on the admin listener's `/metrics` reaches
/// `at_least`.
async fn metric_at_least(admin: SocketAddr, name: &str, labels: &[(&str, &str)], at_least: f64) {
    let client = common::client();
    let what = format!("{name} {labels:?} at least {at_least}");
    eventually(Duration::from_secs(30), &what, async || {
        common::metric_on(&client, admin, "/metrics", name, labels).await >= at_least
    })
    .await;
}

fn text(path: &std::path::Path) -> &str {
    path.to_str().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_on_both_sides_runs_each_key_once_and_a_reload_fails_no_request() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("idem test CA");
    let ca_file = ca.write(dir.path(), "ca");
    let upstream_leaf = ca.server(&["localhost"], 7, Validity::Current);
    let (upstream, seen) = start_upstream(Some(&upstream_leaf)).await;
    let first = ca.server(&["localhost", "127.0.0.1"], 1, Validity::Current);
    let (cert, key) = first.write(dir.path(), "gateway");
    let [listen, admin] = free_addrs(2)[..] else {
        unreachable!()
    };
    let store = common::sqlite_url(dir.path());
    let upstream_url = format!("https://localhost:{}", upstream.port());
    let mut gateway = start_gateway(
        listen,
        admin,
        &store,
        &[
            "--tls-cert",
            text(&cert),
            "--tls-key",
            text(&key),
            "--upstream",
            &upstream_url,
            "--upstream-ca",
            text(&ca_file),
            "--wait",
            "10s",
        ],
    )
    .await;
    assert_eq!(served_certificate(&ca, listen).await, first.der());

    // 64 copies of one key at once: one execution, every copy the same answer.
    let client = https_client(&ca, None);
    let copies = (0..64).map(|_| {
        let client = client.clone();
        tokio::spawn(async move { post_tls(&client, listen, "/pay", "order-64").await })
    });
    let answers: Vec<_> = futures_util::future::join_all(copies).await;
    for answer in answers {
        assert_eq!(answer.unwrap().unwrap(), (201, "charged 1".to_owned()));
    }
    assert_eq!(
        seen.calls("order-64"),
        1,
        "the upstream ran the key more than once"
    );
    // A replay, later, on a new connection.
    let replay = post_tls(&https_client(&ca, None), listen, "/pay", "order-64")
        .await
        .unwrap();
    assert_eq!(replay, (201, "charged 1".to_owned()));
    assert_eq!(seen.calls("order-64"), 1);

    // 50 requests held by the upstream; the certificate replaced and reloaded meanwhile.
    let held: Vec<_> = (0..50)
        .map(|n| {
            let client = client.clone();
            tokio::spawn(async move { post_tls(&client, listen, "/hold", &format!("held-{n}")).await })
        })
        .collect();
    eventually(
        Duration::from_secs(30),
        "50 requests held by the upstream",
        async || seen.holding.load(Ordering::SeqCst) == 50,
    )
    .await;
    let second = ca.server(&["localhost", "127.0.0.1"], 2, Validity::Current);
    second.write(dir.path(), "gateway");
    hangup(&gateway);
    metric_at_least(admin, "idem_tls_reloads_total", &[("result", "ok")], 1.0).await;
    assert_eq!(
        served_certificate(&ca, listen).await,
        second.der(),
        "a new connection after SIGHUP is shown the new certificate (serial 2)"
    );
    seen.release.notify_waiters();
    for (n, answer) in futures_util::future::join_all(held).await.into_iter().enumerate() {
        assert_eq!(answer.unwrap().unwrap(), (201, "held 1".to_owned()), "held-{n}");
    }

    // A key that is not a key: the new pair is refused, the served one stays.
    std::fs::write(
        &key,
        "-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n",
    )
    .unwrap();
    hangup(&gateway);
    metric_at_least(admin, "idem_tls_reloads_total", &[("result", "failed")], 1.0).await;
    assert_eq!(served_certificate(&ca, listen).await, second.der());
    assert_eq!(
        post_tls(&https_client(&ca, None), listen, "/pay", "after-bad-reload")
            .await
            .unwrap(),
        (201, "charged 1".to_owned())
    );
    assert_eq!(seen.failed_handshakes.load(Ordering::SeqCst), 0);
    assert!(
        gateway
            .terminate(Duration::from_secs(30))
            .is_some_and(|s| s.success())
    );
}

fn hangup(process: &Process) {
    let status = Command::new("kill")
        .args(["-HUP", &process.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_ca_requires_a_client_certificate_it_signed() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("idem test CA");
    let clients = Ca::new("idem test client CA");
    let clients_file = clients.write(dir.path(), "clients");
    let (upstream, seen) = start_upstream(None).await;
    let (cert, key) = ca
        .server(&["localhost"], 1, Validity::Current)
        .write(dir.path(), "gateway");
    let [listen, admin] = free_addrs(2)[..] else {
        unreachable!()
    };
    let upstream_url = format!("http://{upstream}");
    let _gateway = start_gateway(
        listen,
        admin,
        "memory://",
        &[
            "--tls-cert",
            text(&cert),
            "--tls-key",
            text(&key),
            "--tls-client-ca",
            text(&clients_file),
            "--upstream",
            &upstream_url,
        ],
    )
    .await;
    let without = post_tls(&https_client(&ca, None), listen, "/pay", "no-cert").await;
    assert!(
        without.is_err(),
        "served without a client certificate: {without:?}"
    );
    let stranger = Ca::new("another client CA").client("stranger");
    let other = post_tls(&https_client(&ca, Some(&stranger)), listen, "/pay", "other-ca").await;
    assert!(other.is_err(), "served a certificate of another CA: {other:?}");
    assert_eq!(seen.requests.load(Ordering::SeqCst), 0);
    let known = clients.client("billing");
    let answer = post_tls(&https_client(&ca, Some(&known)), listen, "/pay", "with-cert").await;
    assert_eq!(answer.unwrap(), (201, "charged 1".to_owned()));
    metric_at_least(admin, "idem_tls_handshake_failures_total", &[], 2.0).await;
}

/// An upstream whose certificate is refused: `502 upstream-tls` naming the cause, the key
/// released (the retry after the fix runs), and nothing reached the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_certificate_refused_is_a_502_naming_the_cause_and_sends_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("idem test CA");
    let ca_file = ca.write(dir.path(), "ca");
    let wrong_ca = Ca::new("not the upstream's CA").write(dir.path(), "wrong");
    let cases: [(&str, Option<Leaf>, &str, &str); 4] = [
        (
            "another CA",
            Some(ca.server(&["localhost"], 1, Validity::Current)),
            text(&wrong_ca),
            "UnknownIssuer",
        ),
        (
            "another name",
            Some(ca.server(&["payments.internal"], 1, Validity::Current)),
            text(&ca_file),
            "certificate not valid for name \"localhost\"",
        ),
        (
            "expired",
            Some(ca.server(&["localhost"], 1, Validity::Expired)),
            text(&ca_file),
            "expired",
        ),
        (
            "a plain HTTP upstream",
            None,
            text(&ca_file),
            "does not speak TLS",
        ),
    ];
    for (case, leaf, trusted, cause) in cases {
        let (upstream, seen) = start_upstream(leaf.as_ref()).await;
        let [listen, admin] = free_addrs(2)[..] else {
            unreachable!()
        };
        let upstream_url = format!("https://localhost:{}", upstream.port());
        let _gateway = start_gateway(
            listen,
            admin,
            "memory://",
            &["--upstream", &upstream_url, "--upstream-ca", trusted],
        )
        .await;
        let client = common::client();
        let seen_by_client = common::send(
            &client,
            listen,
            "POST",
            "/pay",
            &[("idempotency-key", "k-1")],
            b"{}",
        )
        .await;
        assert_eq!(seen_by_client.status, 502, "{case}");
        let problem = seen_by_client.json();
        assert_eq!(problem["type"], "urn:idempotency:problem:upstream-tls", "{case}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.contains(cause), "{case}: {detail}");
        assert!(
            detail.contains("127.0.0.1") || detail.contains("localhost"),
            "{case}: names no host: {detail}"
        );
        assert_eq!(
            seen.requests.load(Ordering::SeqCst),
            0,
            "{case}: a request reached the upstream"
        );
        assert_eq!(seen.calls("k-1"), 0, "{case}");
        if leaf.is_some() {
            // The upstream learns of the refusal from the gateway's alert, which may arrive
            // after the client has its answer.
            eventually(
                Duration::from_secs(10),
                "the upstream saw the handshake refused",
                async || seen.failed_handshakes.load(Ordering::SeqCst) >= 1,
            )
            .await;
        }
    }
}

#[test]
fn unusable_certificate_files_stop_the_gateway_at_start_with_the_path_and_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("idem test CA");
    let (cert, key) = ca
        .server(&["localhost"], 1, Validity::Current)
        .write(dir.path(), "good");
    let (other_cert, _) = ca
        .server(&["localhost"], 2, Validity::Current)
        .write(dir.path(), "other");
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "hello\n").unwrap();
    let missing = dir.path().join("missing.pem");
    let cases: Vec<(Vec<&str>, String)> = vec![
        (
            vec!["--tls-cert", text(&missing), "--tls-key", text(&key)],
            format!("certificate {}: No such file", missing.display()),
        ),
        (
            vec!["--tls-cert", text(&garbage), "--tls-key", text(&key)],
            format!("certificate {}: holds no CERTIFICATE block", garbage.display()),
        ),
        (
            vec!["--tls-cert", text(&cert), "--tls-key", text(&garbage)],
            format!("private key {}: holds no PRIVATE KEY block", garbage.display()),
        ),
        (
            vec!["--tls-cert", text(&other_cert), "--tls-key", text(&key)],
            "are not a usable pair".to_owned(),
        ),
        (vec!["--tls-cert", text(&cert)], "--tls-key".to_owned()),
        (
            vec!["--upstream-ca", text(&cert)],
            "are for an https:// upstream".to_owned(),
        ),
    ];
    for (args, expected) in cases {
        let mut all = vec![
            "serve",
            "--store",
            "memory://",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
        ];
        let upstream = if args.contains(&"--upstream-ca") {
            "http://127.0.0.1:9"
        } else {
            "https://localhost:9"
        };
        all.push(upstream);
        all.extend(args.iter().copied());
        let (code, _, stderr) = idem(&all);
        assert_ne!(code, 0, "{args:?} started");
        assert!(stderr.contains(&expected), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("BEGIN"),
            "{args:?}: PEM content in the error: {stderr}"
        );
    }
}
