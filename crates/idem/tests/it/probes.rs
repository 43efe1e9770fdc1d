//! `/_idem/livez` and `/_idem/readyz` of `idem serve`, a process of its own: readiness turns
//! 503 at the first moment of SIGTERM while running requests still run (and they then
//! complete), and liveness stays 200 while the store is away and readiness is 503. Every step
//! waits for an event (a request reaching the upstream, a probe's answer), never for a time.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use common::{Process, client, free_addr, ready_on, send, spawn_serve, try_send};
use tokio::sync::{mpsc, watch};

/// An upstream that holds every request until released, and reports each arrival.
struct Holding {
    addr: SocketAddr,
    arrivals: mpsc::UnboundedReceiver<()>,
    release: watch::Sender<bool>,
}

impl Holding {
    async fn start() -> Self {
        let (arrived, arrivals) = mpsc::unbounded_channel();
        let (release, released) = watch::channel(false);
        let app = Router::new().route(
            "/pay",
            post(move || {
                let (arrived, mut released) = (arrived.clone(), released.clone());
                async move {
                    let _ = arrived.send(());
                    let _ = released.wait_for(|released| *released).await;
                    (http::StatusCode::CREATED, "charged")
                }
            }),
        );
        let addr = common::serve_app(app).await;
        Self {
            addr,
            arrivals,
            release,
        }
    }
}

/// `idem serve` on its own listener and admin listener with `more` flags, ready when
/// `/readyz` says so.
async fn gateway(upstream: SocketAddr, store: &str, more: &[&str]) -> (Process, SocketAddr, SocketAddr) {
    let (listen, admin) = (free_addr(), free_addr());
    let (listen_text, admin_text, upstream_text) = (
        listen.to_string(),
        admin.to_string(),
        format!("http://{upstream}"),
    );
    let mut args = vec![
        "serve",
        "--listen",
        &listen_text,
        "--admin-listen",
        &admin_text,
        "--upstream",
        &upstream_text,
        "--store",
        store,
    ];
    args.extend_from_slice(more);
    let process = spawn_serve(&args);
    (
        ready_on(process, admin, "/readyz", "idem serve").await,
        listen,
        admin,
    )
}

/// Polls `path` on `admin` until it answers `status` (at most 20 s: a bound on a failure, not
/// a timing the test relies on).
async fn until_status(admin: SocketAddr, path: &str, status: u16) -> common::Seen {
    let client = client();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(seen) = try_send(&client, admin, "GET", path, &[], b"").await
            && seen.status == status
        {
            return seen;
        }
        assert!(Instant::now() < deadline, "{path} never answered {status}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_sigterm_readyz_is_503_while_running_requests_finish_then_they_complete() {
    let mut upstream = Holding::start().await;
    let (mut process, listen, admin) = gateway(upstream.addr, "memory://", &[]).await;
    let running: Vec<_> = (0..3)
        .map(|n| {
            tokio::spawn(async move {
                let key = format!("order-{n}");
                try_send(
                    &client(),
                    listen,
                    "POST",
                    "/pay",
                    &[("idempotency-key", &key)],
                    b"{}",
                )
                .await
            })
        })
        .collect();
    for _ in 0..3 {
        upstream.arrivals.recv().await.unwrap();
    }
    let exited = tokio::task::spawn_blocking(move || process.terminate(Duration::from_secs(30)));

    let draining = until_status(admin, "/readyz", 503).await;
    assert_eq!(draining.json()["status"], "draining");
    let alive = send(&client(), admin, "GET", "/livez", &[], b"").await;
    assert_eq!(alive.status, 200, "liveness does not follow the drain");
    // The upstream holds all three until released: they are running, by construction.
    assert!(running.iter().all(|request| !request.is_finished()));

    upstream.release.send(true).unwrap();
    for request in running {
        let seen = request
            .await
            .unwrap()
            .expect("the running request got its answer");
        assert_eq!(seen.status, 201, "{:?}", seen.body);
    }
    let status = exited.await.unwrap().expect("the gateway exits after the drain");
    assert_eq!(status.code(), Some(0));
}

/// `--drain-delay`: after SIGTERM the gateway goes on serving new requests while `/readyz` is
/// 503, so that a load balancer that has not yet seen the 503 loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_drain_delay_new_requests_are_served_while_readyz_is_503() {
    let upstream = Holding::start().await;
    upstream.release.send(true).unwrap();
    let (mut process, listen, admin) = gateway(upstream.addr, "memory://", &["--drain-delay", "10m"]).await;
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &process.child.id().to_string()])
        .status();
    until_status(admin, "/readyz", 503).await;
    let served = send(
        &client(),
        listen,
        "POST",
        "/pay",
        &[("idempotency-key", "late")],
        b"{}",
    )
    .await;
    assert_eq!(served.status, 201, "a request during the delay is served");
    process.kill9();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn livez_stays_200_while_the_store_is_away_and_readyz_is_503_until_it_is_back() {
    let upstream = Holding::start().await;
    let database = common::database_url();
    let (proxy, store) = idempotency_testkit::TcpProxy::in_front_of(&database)
        .await
        .unwrap();
    let proxy = Arc::new(proxy);
    let (mut process, _listen, admin) = gateway(upstream.addr, &store, &[]).await;

    proxy.set_down(true);
    proxy.cut();
    let unready = until_status(admin, "/readyz", 503).await;
    assert_eq!(
        unready.json()["type"],
        "urn:idempotency:problem:store-unavailable"
    );
    let alive = send(&client(), admin, "GET", "/livez", &[], b"").await;
    assert_eq!(
        alive.status, 200,
        "a store away is no reason to restart the process"
    );

    proxy.set_down(false);
    let ready = until_status(admin, "/readyz", 200).await;
    assert_eq!(ready.json()["status"], "ready");
    process.kill9();
}

#[test]
fn a_malformed_drain_delay_is_refused() {
    for (value, why) in [("soon", "--drain-delay"), ("11m", "from 0s to 10m")] {
        let (code, _, err) = common::idem(&[
            "serve",
            "--upstream",
            "http://127.0.0.1:1",
            "--drain-delay",
            value,
        ]);
        assert_eq!(code, 2, "{value}: {err}");
        assert!(err.contains(why), "{value}: {err}");
    }
}

/// `idem probe URL`, the image's health check (it has no shell or curl): exit 0 on a `2xx`,
/// 1 with the status and the body on another answer, 1 naming the cause when nothing answers
/// or the URL is not one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_probe_exits_0_on_a_2xx_and_1_with_the_reason_otherwise() {
    let app = Router::new()
        .route("/ok", axum::routing::get(|| async { "ready" }))
        .route(
            "/down",
            axum::routing::get(|| async { (http::StatusCode::SERVICE_UNAVAILABLE, "store: unreachable") }),
        )
        .route(
            "/slow",
            axum::routing::get(|| async {
                std::future::pending::<()>().await;
                "never"
            }),
        );
    let addr = common::serve_app(app).await;
    let refused = common::HeldPort::new();
    let probe = |url: String, more: &[&str]| {
        let mut args = vec!["probe".to_owned(), url];
        args.extend(more.iter().map(|s| (*s).to_owned()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        common::idem(&args)
    };
    let (code, out, err) = probe(format!("http://{addr}/ok"), &[]);
    assert_eq!((code, out.trim()), (0, "200 OK"), "{err}");
    for (url, more, says) in [
        (
            format!("http://{addr}/down"),
            &[][..],
            "answered 503 Service Unavailable: store: unreachable",
        ),
        (
            format!("http://{addr}/slow"),
            &["--timeout", "300ms"][..],
            "no answer within 300ms",
        ),
        (
            format!("http://{}/readyz", refused.addr),
            &[][..],
            "Connection refused",
        ),
        (
            "ftp://h/x".to_owned(),
            &[][..],
            "takes an http:// or https:// URL",
        ),
        (
            "http://u:S3CRET@127.0.0.1:1/".to_owned(),
            &[][..],
            "probe http://u:***@127.0.0.1:1/",
        ),
    ] {
        let (code, _, err) = probe(url.clone(), more);
        assert_eq!(code, 1, "{url}: {err}");
        assert!(err.contains(says), "{url}: {err}");
        assert!(!err.contains("S3CRET"), "{err}");
    }
}
