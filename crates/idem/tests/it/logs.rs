//! `idem serve --log-format json`: one JSON line per guarded request, read from the process's
//! standard error, with the decision, the attempt and the statuses, and never the credential the
//! scope comes from, the scope itself or (by default) the key.

use crate::common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use common::{client, free_addr, ready, send};
use tokio::sync::{mpsc, watch};

const CREDENTIAL: &str = "Bearer s3cret-token-of-alice";
const KEY: &str = "order-alpha-7";

/// Stops `gateway` with SIGTERM (it exits 0) and returns its standard error's lines: SIGTERM
/// ends the process and so its log.
async fn stopped(mut gateway: common::Process) -> Vec<String> {
    let status = tokio::task::spawn_blocking(move || {
        let status = gateway.terminate(Duration::from_secs(30));
        (status, gateway)
    });
    let (status, mut gateway) = status.await.unwrap();
    assert_eq!(status.and_then(|status| status.code()), Some(0));
    let stderr = gateway.child.stderr.take().unwrap();
    BufReader::new(stderr).lines().map(Result::unwrap).collect()
}

/// An upstream with `/pay` (answers at once), `/hold` (holds until released, reporting each
/// arrival) and `/stall` (never answers).
async fn upstream() -> (SocketAddr, mpsc::UnboundedReceiver<()>, watch::Sender<bool>) {
    let (arrived, arrivals) = mpsc::unbounded_channel();
    let (release, released) = watch::channel(false);
    let app = Router::new()
        .route("/pay", post(|| async { (http::StatusCode::CREATED, "charged") }))
        .route(
            "/hold",
            post(move || {
                let (arrived, mut released) = (arrived.clone(), released.clone());
                async move {
                    let _ = arrived.send(());
                    let _ = released.wait_for(|released| *released).await;
                    (http::StatusCode::CREATED, "held")
                }
            }),
        )
        .route("/stall", post(std::future::pending::<()>));
    let addr = common::serve_app(app).await;
    (addr, arrivals, release)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_guarded_request_is_one_json_line_with_its_decision_and_no_secret() {
    let (upstream, mut arrivals, release) = upstream().await;
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
        "--scope-header",
        "authorization",
        "--upstream-timeout",
        "300ms",
        "--log-format",
        "json",
    ];
    let gateway = ready(common::spawn_idem(&args, &[], "info", true), listen, "idem serve").await;
    let client = client();
    let post = async |path: &str, key: &str, body: &[u8]| {
        let headers = [("idempotency-key", key), ("authorization", CREDENTIAL)];
        send(&client, listen, "POST", path, &headers, body).await.status
    };

    assert_eq!(post("/pay", KEY, b"{\"cents\":100}").await, 201);
    assert_eq!(post("/pay", KEY, b"{\"cents\":100}").await, 201, "the replay");
    assert_eq!(post("/pay", KEY, b"{\"cents\":999}").await, 422);
    let held = {
        let client = client.clone();
        tokio::spawn(async move {
            let headers = [("idempotency-key", "order-beta-8"), ("authorization", CREDENTIAL)];
            send(&client, listen, "POST", "/hold", &headers, b"{}")
                .await
                .status
        })
    };
    arrivals.recv().await.unwrap();
    assert_eq!(post("/hold", "order-beta-8", b"{}").await, 409);
    release.send(true).unwrap();
    assert_eq!(held.await.unwrap(), 201);
    assert_eq!(post("/stall", "order-gamma-9", b"{}").await, 504);

    let lines = stopped(gateway).await;
    let all = lines.join("\n");
    for secret in [
        CREDENTIAL,
        "s3cret-token-of-alice",
        KEY,
        "order-beta-8",
        "order-gamma-9",
    ] {
        assert!(!all.contains(secret), "`{secret}` is in the log:\n{all}");
    }
    let events: Vec<serde_json::Value> = lines
        .iter()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}")))
        .filter(|event: &serde_json::Value| event["target"] == "idempotency_http::request")
        .collect();
    let mut seen: Vec<(String, u64, u64)> = events
        .iter()
        .map(|event| {
            let fields = &event["fields"];
            assert_eq!(fields["method"], "POST");
            assert_eq!(
                fields["route"], "gateway",
                "the route's name: the default route's without a file"
            );
            assert_eq!(
                fields["scope"].as_str().map(str::len),
                Some(16),
                "a digest: {event}"
            );
            assert_eq!(
                fields["key"].as_str().map(str::len),
                Some(16),
                "a digest: {event}"
            );
            assert!(fields["total_ms"].as_f64().is_some(), "{event}");
            (
                fields["decision"].as_str().unwrap().to_owned(),
                fields["attempt"].as_u64().unwrap(),
                fields["status"].as_u64().unwrap(),
            )
        })
        .collect();
    seen.sort();
    let mut expected = vec![
        ("acquired".to_owned(), 1, 201),
        ("replayed".to_owned(), 0, 201),
        ("mismatch".to_owned(), 0, 422),
        ("in-flight".to_owned(), 0, 409),
        ("acquired".to_owned(), 1, 201),
        ("unknown".to_owned(), 1, 504),
    ];
    expected.sort();
    assert_eq!(seen, expected, "{all}");
    let keys = |decision: &str| -> Vec<&str> {
        events
            .iter()
            .filter(|event| event["fields"]["decision"] == decision)
            .map(|event| event["fields"]["key"].as_str().unwrap())
            .collect()
    };
    assert_eq!(keys("replayed"), keys("mismatch"), "one key, one digest");
    let acquired = events
        .iter()
        .find(|event| event["fields"]["path"] == "/pay" && event["fields"]["decision"] == "acquired")
        .unwrap();
    assert_eq!(acquired["fields"]["upstream_status"], 201);
}

/// The text log line of a guarded request carries each of its span's fields once: the
/// guard records the attempt on its own run span, the request span records it for itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_log_line_names_each_field_once() {
    let (upstream, _arrivals, _release) = upstream().await;
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
        "--log-format",
        "text",
    ];
    let gateway = ready(common::spawn_idem(&args, &[], "info", true), listen, "idem serve").await;
    let headers = [("idempotency-key", KEY)];
    assert_eq!(
        send(&client(), listen, "POST", "/pay", &headers, b"{}")
            .await
            .status,
        201
    );
    let lines = stopped(gateway).await;
    let line = lines
        .iter()
        .find(|line| line.contains("idempotency.request{"))
        .unwrap_or_else(|| panic!("no request line:\n{}", lines.join("\n")));
    let span = line
        .split("idempotency.request{")
        .nth(1)
        .unwrap()
        .split('}')
        .next()
        .unwrap();
    for field in ["route=", "decision=", "attempt="] {
        assert_eq!(span.matches(field).count(), 1, "{field} in: {line}");
    }
}

#[test]
fn malformed_log_flags_are_refused() {
    for (args, why) in [
        (
            &["serve", "--upstream", "http://127.0.0.1:1", "--log-keys", "loud"][..],
            "expected hash, plain or off",
        ),
        (
            &["serve", "--upstream", "http://127.0.0.1:1", "--log-format", "xml"][..],
            "--log-format",
        ),
    ] {
        let (code, _, err) = common::idem(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(why), "{args:?}: {err}");
    }
}

/// `--listen 127.0.0.1:0` and `--admin-listen 127.0.0.1:0` take ports the kernel picks, and
/// the ready line names the ports taken, so that whatever started the gateway can find it
/// without choosing a port first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ready_line_names_the_addresses_the_kernel_picked() {
    let args = [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--upstream",
        "http://127.0.0.1:1",
        "--store",
        "memory://",
        "--log-format",
        "json",
    ];
    let mut gateway = common::spawn_idem(&args, &[], "info", true);
    let ready = common::logged(&mut gateway, "idem gateway ready");
    let (listen, admin) = (
        common::address_in(&ready, "listen"),
        common::address_in(&ready, "admin_listen"),
    );
    assert_ne!(listen, admin);
    let client = client();
    let probe = send(&client, admin, "GET", "/healthz", &[], b"").await;
    assert_eq!(probe.status, 200, "the admin listener at the announced address");
    // The upstream refuses connections: the gateway at the announced address says so.
    let proxied = send(&client, listen, "GET", "/orders", &[], b"").await;
    assert_eq!(proxied.status, 502, "the main listener at the announced address");
    drop(gateway);
}
