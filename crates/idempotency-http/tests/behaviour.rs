//! The layer's behaviour through a real server and a real HTTP client, on every store:
//! memory, SQLite, PostgreSQL and Redis.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use common::{Counters, DynStore, app, client, send, serve};
use http::StatusCode;
use idempotency_core::ScopeSecret;
use idempotency_http::IdempotencyLayer;
use idempotency_testkit::FaultyStore;

fn layer(store: DynStore) -> IdempotencyLayer<DynStore> {
    IdempotencyLayer::new(store)
        .scope_from_header(http::header::AUTHORIZATION, ScopeSecret::generate())
        .max_body(64 * 1024)
}

async fn start(
    store: DynStore,
    configure: impl FnOnce(IdempotencyLayer<DynStore>) -> IdempotencyLayer<DynStore>,
) -> (std::net::SocketAddr, Counters) {
    let counters = Counters::default();
    let router: Router = app(counters.clone()).layer(configure(layer(store)));
    (serve(router).await, counters)
}

/// Same key twice: one execution, the identical status, headers and body, the replay header,
/// no `Set-Cookie`, `Location` kept, the expiry advertised on both.
pub async fn replays_the_stored_response(store: DynStore) {
    let (addr, counters) = start(store, |l| l).await;
    let http = client();
    let first = send(
        &http,
        addr,
        "POST",
        "/charges",
        &[b"\"k-replay\""],
        &[],
        b"{\"amount\":10}",
        false,
    )
    .await;
    let second = send(
        &http,
        addr,
        "POST",
        "/charges",
        &[b"\"k-replay\""],
        &[],
        b"{\"amount\":10}",
        false,
    )
    .await;
    assert_eq!(counters.charges.load(Ordering::SeqCst), 1);
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(
        (second.status, second.body.clone()),
        (first.status, first.body.clone())
    );
    assert!(
        first.text().contains("\"key\":\"k-replay\""),
        "the handler sees the key: {}",
        first.text()
    );
    assert_eq!(second.headers["idempotent-replayed"], "true");
    assert!(first.headers.get("idempotent-replayed").is_none());
    assert_eq!(second.headers["location"], first.headers["location"]);
    assert_eq!(second.headers["content-type"], "application/json");
    assert!(
        first.headers.contains_key("set-cookie"),
        "the first caller gets its cookie"
    );
    assert!(
        second.headers.get("set-cookie").is_none(),
        "credentials must not be replayed"
    );
    assert!(first.headers.contains_key("idempotency-key-expires"));
    assert_eq!(
        second.headers["idempotency-key-expires"],
        first.headers["idempotency-key-expires"]
    );
}

/// 64 concurrent identical requests to a slow handler: one execution; the rest get 409 with
/// Retry-After.
pub async fn concurrent_duplicates_execute_once(store: DynStore) {
    let (addr, counters) = start(store, |l| l).await;
    let http = client();
    let requests: Vec<_> = (0..64)
        .map(|_| {
            let http = http.clone();
            tokio::spawn(async move {
                send(
                    &http,
                    addr,
                    "POST",
                    "/charges?delay_ms=500",
                    &[b"k-race"],
                    &[],
                    b"{}",
                    false,
                )
                .await
            })
        })
        .collect();
    let mut created = 0;
    for request in requests {
        let seen = request.await.unwrap();
        match seen.status {
            StatusCode::CREATED => created += 1,
            StatusCode::CONFLICT => {
                assert!(
                    seen.headers.contains_key("retry-after"),
                    "409 without Retry-After"
                );
                assert_eq!(seen.problem_type(), "urn:idempotency:problem:request-in-flight");
                assert_eq!(seen.headers["content-type"], "application/problem+json");
            }
            other => panic!("unexpected {other}: {}", seen.text()),
        }
    }
    assert_eq!(counters.charges.load(Ordering::SeqCst), 1, "executions");
    assert_eq!(created, 1);
}

/// The same storm in wait mode: every caller gets the one response.
pub async fn wait_mode_replays_to_concurrent_duplicates(store: DynStore) {
    let (addr, counters) = start(store, |l| l.wait(Duration::from_secs(10))).await;
    let http = client();
    let requests: Vec<_> = (0..64)
        .map(|_| {
            let http = http.clone();
            tokio::spawn(async move {
                send(
                    &http,
                    addr,
                    "POST",
                    "/charges?delay_ms=300",
                    &[b"k-wait"],
                    &[],
                    b"{}",
                    false,
                )
                .await
            })
        })
        .collect();
    let mut bodies = Vec::new();
    for request in requests {
        let seen = request.await.unwrap();
        assert_eq!(seen.status, StatusCode::CREATED, "{}", seen.text());
        bodies.push(seen.body);
    }
    assert_eq!(counters.charges.load(Ordering::SeqCst), 1, "executions");
    assert!(
        bodies.iter().all(|b| b == &bodies[0]),
        "every caller must get the same response"
    );
}

/// Same key with another body or another path: 422, nothing runs.
pub async fn a_reused_key_is_unprocessable(store: DynStore) {
    let (addr, counters) = start(store, |l| l).await;
    let http = client();
    let first = send(
        &http,
        addr,
        "POST",
        "/charges",
        &[b"k-reuse"],
        &[],
        b"{\"amount\":10}",
        false,
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let other_body = send(
        &http,
        addr,
        "POST",
        "/charges",
        &[b"k-reuse"],
        &[],
        b"{\"amount\":99}",
        false,
    )
    .await;
    assert_eq!(other_body.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other_body.problem_type(), "urn:idempotency:problem:key-reused");
    let other_path = send(
        &http,
        addr,
        "POST",
        "/other",
        &[b"k-reuse"],
        &[],
        b"{\"amount\":10}",
        false,
    )
    .await;
    assert_eq!(other_path.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(counters.charges.load(Ordering::SeqCst), 1);
}

/// Missing and invalid keys, oversized bodies, and unguarded methods.
pub async fn bad_requests_are_refused_before_the_handler(store: DynStore) {
    let (addr, counters) = start(store, |l| l.require_key(true)).await;
    let http = client();
    let missing = send(&http, addr, "POST", "/charges", &[], &[], b"{}", false).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(missing.problem_type(), "urn:idempotency:problem:missing-key");
    let too_long = "k".repeat(256);
    let invalid: [&[&[u8]]; 6] = [
        &[b"\"\""],
        &[too_long.as_bytes()],
        &[b"\"a\tb\""],
        &[b"caf\xc3\xa9"],
        &[b"a", b"b"],
        &[b"\"unterminated"],
    ];
    for keys in invalid {
        let seen = send(&http, addr, "POST", "/charges", keys, &[], b"{}", false).await;
        assert_eq!(seen.status, StatusCode::BAD_REQUEST, "{keys:?}: {}", seen.text());
        assert_eq!(seen.problem_type(), "urn:idempotency:problem:invalid-key");
    }
    // Raw connections: the server answers 413 and closes while a client may still be writing,
    // which an HTTP client reports as a broken pipe instead of the response.
    let announced = format!(
        "POST /charges HTTP/1.1\r\nhost: x\r\nidempotency-key: k-big\r\ncontent-length: {}\r\n\r\n",
        64 * 1024 + 1
    );
    // Only the head is sent: the announced length alone must be refused.
    let (status, text) = common::raw_exchange(addr, &announced, &[]).await;
    assert_eq!(status, 413, "{text}");
    assert!(text.contains("urn:idempotency:problem:body-too-large"), "{text}");
    let chunked_head =
        "POST /charges HTTP/1.1\r\nhost: x\r\nidempotency-key: k-big\r\ntransfer-encoding: chunked\r\n\r\n";
    let chunk = [
        format!("{:x}\r\n", 1024).into_bytes(),
        vec![b'x'; 1024],
        b"\r\n".to_vec(),
    ]
    .concat();
    let chunks: Vec<&[u8]> = (0..65)
        .map(|_| chunk.as_slice())
        .chain([&b"0\r\n\r\n"[..]])
        .collect();
    let (status, text) = common::raw_exchange(addr, chunked_head, &chunks).await;
    assert_eq!(status, 413, "{text}");
    let read = send(&http, addr, "GET", "/charges", &[], &[], b"", false).await;
    assert_eq!(
        (read.status, read.text().as_str()),
        (StatusCode::OK, "list of charges")
    );
    assert_eq!(counters.charges.load(Ordering::SeqCst), 0, "nothing may have run");
    // The key refused for an oversized body is still free.
    let ok = send(&http, addr, "POST", "/charges", &[b"k-big"], &[], b"{}", false).await;
    assert_eq!(ok.status, StatusCode::CREATED);
}

/// A 500 or a panic releases the key; the retry executes once more and its success is stored.
pub async fn failures_release_the_key(store: DynStore) {
    for mode in ["status", "panic"] {
        let (addr, counters) = start(store.clone(), |l| l).await;
        let http = client();
        let path = format!("/flaky?mode={mode}");
        let key = format!("k-flaky-{mode}");
        let first = send(&http, addr, "POST", &path, &[key.as_bytes()], &[], b"", false).await;
        assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR, "{mode}");
        let second = send(&http, addr, "POST", &path, &[key.as_bytes()], &[], b"", false).await;
        assert_eq!(second.status, StatusCode::CREATED, "{mode}: {}", second.text());
        let third = send(&http, addr, "POST", &path, &[key.as_bytes()], &[], b"", false).await;
        assert_eq!(third.status, StatusCode::CREATED);
        assert_eq!(third.headers["idempotent-replayed"], "true");
        assert_eq!(counters.flaky.load(Ordering::SeqCst), 2, "{mode}: executions");
    }
}

/// The client disconnects while the handler runs: the handler finishes exactly once and the
/// retry gets the replay.
pub async fn a_disconnect_does_not_cancel_the_handler(store: DynStore) {
    use tokio::io::AsyncWriteExt;
    let (addr, counters) = start(Arc::clone(&store), |l| l).await;
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    socket
        .write_all(
            b"POST /charges?delay_ms=300 HTTP/1.1\r\nhost: x\r\nidempotency-key: k-gone\r\ncontent-length: 2\r\n\r\n{}",
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(socket);
    common::wait_until_completed(&store, "k-gone").await;
    assert_eq!(
        counters.charges.load(Ordering::SeqCst),
        1,
        "the handler must finish"
    );
    let http = client();
    let retry = send(
        &http,
        addr,
        "POST",
        "/charges?delay_ms=300",
        &[b"k-gone"],
        &[],
        b"{}",
        false,
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(
        counters.charges.load(Ordering::SeqCst),
        1,
        "the retry must not run again"
    );
}

/// The store is down: 503 with Retry-After and no execution; with fail-open the handler runs.
pub async fn an_unreachable_store_fails_closed_or_open(store: DynStore) {
    let faulty = FaultyStore::new(store);
    faulty.set_down(true);
    let (addr, counters) = start(Arc::new(faulty.clone()), |l| l).await;
    let http = client();
    let closed = send(&http, addr, "POST", "/charges", &[b"k-down"], &[], b"{}", false).await;
    assert_eq!(closed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(closed.headers.contains_key("retry-after"));
    assert_eq!(closed.problem_type(), "urn:idempotency:problem:store-unavailable");
    assert_eq!(counters.charges.load(Ordering::SeqCst), 0);

    let (addr, counters) = start(Arc::new(faulty.clone()), |l| l.fail_open(true)).await;
    let open = send(&http, addr, "POST", "/charges", &[b"k-down"], &[], b"{}", false).await;
    assert_eq!(open.status, StatusCode::CREATED);
    assert_eq!(counters.charges.load(Ordering::SeqCst), 1);
}

/// Two principals using the same key never see each other's responses.
pub async fn scopes_isolate_principals(store: DynStore) {
    let (addr, counters) = start(store, |l| l).await;
    let http = client();
    let alice = send(
        &http,
        addr,
        "POST",
        "/charges",
        &[b"k-shared"],
        &[("authorization", "Bearer alice")],
        b"{}",
        false,
    )
    .await;
    let bob = send(
        &http,
        addr,
        "POST",
        "/charges",
        &[b"k-shared"],
        &[("authorization", "Bearer bob")],
        b"{}",
        false,
    )
    .await;
    assert_eq!(
        (alice.status, bob.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert_ne!(alice.body, bob.body, "bob got alice's response");
    assert!(bob.headers.get("idempotent-replayed").is_none());
    let alice_again = send(
        &http,
        addr,
        "POST",
        "/charges",
        &[b"k-shared"],
        // The scheme's case and the spaces after it do not change the principal.
        &[("authorization", "BEARER   alice")],
        b"{}",
        false,
    )
    .await;
    assert_eq!(alice_again.body, alice.body);
    assert_eq!(alice_again.headers["idempotent-replayed"], "true");
    assert_eq!(counters.charges.load(Ordering::SeqCst), 2);
}

/// A response over the stored limit, and a streamed one: passed through the first time, never
/// run again, the retry gets the "not replayable" problem.
pub async fn unstorable_responses_are_not_replayed(store: DynStore) {
    let (addr, counters) = start(store, |l| l).await;
    let http = client();
    for (path, counter) in [("/big", &counters.big), ("/stream", &counters.stream)] {
        let key = format!("k-{}", &path[1..]);
        let first = send(&http, addr, "POST", path, &[key.as_bytes()], &[], b"", false).await;
        assert_eq!(first.status, StatusCode::OK, "{path}");
        assert!(!first.body.is_empty());
        let retry = send(&http, addr, "POST", path, &[key.as_bytes()], &[], b"", false).await;
        assert_eq!(retry.status, StatusCode::CONFLICT, "{path}: {}", retry.text());
        assert_eq!(
            retry.problem_type(),
            "urn:idempotency:problem:outcome-not-replayable"
        );
        assert_eq!(counter.load(Ordering::SeqCst), 1, "{path} ran again");
    }
}

/// With `buffer_streamed_responses`, a streamed response that ends within the limit is stored
/// and replayed; a longer one reaches the client whole (the part read while trying to store
/// it first), and its retry gets the "not replayable" problem.
pub async fn streamed_responses_within_the_limit_are_stored(store: DynStore) {
    let (addr, counters) = start(store, |l| l.buffer_streamed_responses(true)).await;
    let http = client();
    let first = send(&http, addr, "POST", "/stream", &[b"k-s"], &[], b"", false).await;
    let replay = send(&http, addr, "POST", "/stream", &[b"k-s"], &[], b"", false).await;
    assert_eq!((first.text().as_str(), replay.text().as_str()), ("abc", "abc"));
    assert_eq!(replay.headers.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(counters.stream.load(Ordering::SeqCst), 1);

    let first = send(&http, addr, "POST", "/big-stream", &[b"k-bs"], &[], b"", false).await;
    assert_eq!(first.status, StatusCode::OK);
    let expected: Vec<u8> = (0..32_u8).flat_map(|i| vec![b'a' + i % 26; 64 << 10]).collect();
    assert!(
        first.body == expected,
        "the passed-through body differs ({} bytes)",
        first.body.len()
    );
    let retry = send(&http, addr, "POST", "/big-stream", &[b"k-bs"], &[], b"", false).await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(
        retry.problem_type(),
        "urn:idempotency:problem:outcome-not-replayable"
    );
    assert_eq!(counters.big_stream.load(Ordering::SeqCst), 1);
}

macro_rules! on_stores {
    ($($store:ident),*) => {$(
        mod $store {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn replay() { replays_the_stored_response(common::$store().await).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_duplicates() { concurrent_duplicates_execute_once(common::$store().await).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn wait_mode() { wait_mode_replays_to_concurrent_duplicates(common::$store().await).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn reused_key() { a_reused_key_is_unprocessable(common::$store().await).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn bad_requests() { bad_requests_are_refused_before_the_handler(common::$store().await).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn failures_release() { failures_release_the_key(common::$store().await).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn disconnect() { a_disconnect_does_not_cancel_the_handler(common::$store().await).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn store_unreachable() { an_unreachable_store_fails_closed_or_open(common::$store().await).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn scopes() { scopes_isolate_principals(common::$store().await).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn unstorable() { unstorable_responses_are_not_replayed(common::$store().await).await }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn streamed() { streamed_responses_within_the_limit_are_stored(common::$store().await).await }
        }
    )*};
}

on_stores!(memory, sqlite, postgres, redis);

/// Different layers on different routes: one requires a key and fingerprints canonical JSON,
/// the other lets keyless requests through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_can_be_configured_differently() {
    use axum::routing::post;
    use idempotency_core::FingerprintMode;

    let counters = Counters::default();
    let store = common::memory().await;
    let strict = IdempotencyLayer::new(Arc::clone(&store))
        .require_key(true)
        .fingerprint(FingerprintMode::CanonicalJson);
    let lenient = IdempotencyLayer::new(store);
    let charges = app(counters.clone());
    let router: Router = Router::new()
        .route(
            "/strict",
            post(|| async { (StatusCode::CREATED, "strict") }).layer(strict),
        )
        .route(
            "/lenient",
            post(|| async { (StatusCode::CREATED, "lenient") }).layer(lenient),
        )
        .merge(charges);
    let addr = serve(router).await;
    let http = client();

    let keyless = send(&http, addr, "POST", "/strict", &[], &[], b"{}", false).await;
    assert_eq!(keyless.status, StatusCode::BAD_REQUEST);
    let keyless = send(&http, addr, "POST", "/lenient", &[], &[], b"{}", false).await;
    assert_eq!(keyless.status, StatusCode::CREATED);

    // Canonical JSON: whitespace and member order do not make another request.
    let first = send(
        &http,
        addr,
        "POST",
        "/strict",
        &[b"k-json"],
        &[],
        br#"{"a":1,"b":2}"#,
        false,
    )
    .await;
    let same = send(
        &http,
        addr,
        "POST",
        "/strict",
        &[b"k-json"],
        &[],
        br#"{ "b": 2, "a": 1 }"#,
        false,
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(same.headers["idempotent-replayed"], "true");
    let raw_first = send(
        &http,
        addr,
        "POST",
        "/lenient",
        &[b"k-raw"],
        &[],
        br#"{"a":1,"b":2}"#,
        false,
    )
    .await;
    let raw_other = send(
        &http,
        addr,
        "POST",
        "/lenient",
        &[b"k-raw"],
        &[],
        br#"{ "b": 2, "a": 1 }"#,
        false,
    )
    .await;
    assert_eq!(raw_first.status, StatusCode::CREATED);
    assert_eq!(
        raw_other.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "raw bytes differ"
    );
    assert_eq!(counters.charges.load(Ordering::SeqCst), 0);
}

/// Independently of any server: dropping the service's future while the handler runs does not
/// cancel the handler; it finishes once and its response is stored for the retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_future_still_finishes_and_records() {
    use idempotency_core::{Key, RecordState, Scope, Store};
    use tower::{Layer, Service};

    let counters = Counters::default();
    let store = common::memory().await;
    let mut service = IdempotencyLayer::new(Arc::clone(&store)).layer(app(counters.clone()));
    let request = || {
        http::Request::post("/charges?delay_ms=200")
            .header("idempotency-key", "k-dropped")
            .body(axum::body::Body::from("{}"))
            .unwrap()
    };
    std::future::poll_fn(|cx| Service::<http::Request<axum::body::Body>>::poll_ready(&mut service, cx))
        .await
        .unwrap();
    let future = service.call(request());
    // The caller gives up after 50 ms: the future is dropped mid-handler.
    assert!(
        tokio::time::timeout(Duration::from_millis(50), future)
            .await
            .is_err()
    );
    common::wait_until_completed(&store, "k-dropped").await;
    assert_eq!(
        counters.charges.load(Ordering::SeqCst),
        1,
        "the handler must have finished"
    );
    let record = store
        .get(&Scope::global(), &Key::new("k-dropped").unwrap())
        .await
        .unwrap()
        .expect("the outcome must be recorded");
    assert!(
        matches!(record.state, RecordState::Completed { .. }),
        "{record:?}"
    );

    std::future::poll_fn(|cx| Service::<http::Request<axum::body::Body>>::poll_ready(&mut service, cx))
        .await
        .unwrap();
    let retry = service.call(request()).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(counters.charges.load(Ordering::SeqCst), 1);
}

/// Extreme settings do not panic: a lease of `Duration::MAX` (no `Instant` can hold its end), a
/// retention of three million days (clamped to the thousand years every store keeps at most),
/// a wait of `Duration::MAX`. The request runs once, its expiry is advertised, and it replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_durations_neither_panic_nor_run_twice() {
    let (addr, counters) = start(common::memory().await, |l| {
        l.lease(Duration::MAX)
            .retention(Duration::from_secs(3_000_000 * 86_400))
            .wait(Duration::MAX)
    })
    .await;
    let http = client();
    let mut answers = Vec::new();
    for _ in 0..2 {
        answers.push(
            send(
                &http,
                addr,
                "POST",
                "/charges",
                &[b"\"k-extreme\""],
                &[],
                b"{\"amount\":10}",
                false,
            )
            .await,
        );
    }
    assert_eq!(counters.charges.load(Ordering::SeqCst), 1);
    assert_eq!(answers[0].status, StatusCode::CREATED);
    assert_eq!(answers[1].status, StatusCode::CREATED);
    assert_eq!(
        answers[1]
            .headers
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    // Clamped as every store clamps it: about a thousand years on, a date a client can read.
    let year = Duration::from_secs(365 * 86_400);
    for answer in &answers {
        let header = answer.headers["idempotency-key-expires"].to_str().unwrap();
        let expires = httpdate::parse_http_date(header).unwrap();
        let ahead = expires.duration_since(std::time::SystemTime::now()).unwrap();
        assert!(
            ahead > year * 990 && ahead <= idempotency_core::MAX_DURATION,
            "{header}"
        );
    }
}

/// A response marked `OutcomeUnknown`, a body that breaks off midway and a service error leave
/// the key in flight: whether the request took effect is unknown, so the retry gets `409` (the
/// first answer says for how long, in `Retry-After`) instead of running again at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_outcomes_keep_the_key_in_flight() {
    use std::sync::atomic::AtomicU32;

    use axum::body::Body;
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;
    use idempotency_core::{Key, RecordState, Scope, Store, Token};
    use idempotency_http::OutcomeUnknown;
    use tower::{Layer, ServiceExt};

    let store = common::memory().await;
    let runs = Arc::new(AtomicU32::new(0));
    let count = |runs: &Arc<AtomicU32>| {
        let runs = Arc::clone(runs);
        move || {
            runs.fetch_add(1, Ordering::SeqCst);
        }
    };
    let (marked, broken) = (count(&runs), count(&runs));
    let router: Router = Router::new()
        .route(
            "/marked",
            post(move || async move {
                marked();
                let mut response = (StatusCode::GATEWAY_TIMEOUT, "the provider timed out").into_response();
                response.extensions_mut().insert(OutcomeUnknown);
                response
            }),
        )
        .route(
            "/broken-body",
            post(move || async move {
                broken();
                let chunks: Vec<Result<&'static str, std::io::Error>> = vec![
                    Ok("{\"charge\":"),
                    Err(std::io::Error::other("the handler's stream broke")),
                ];
                Response::new(Body::from_stream(futures_util::stream::iter(chunks)))
            }),
        )
        .layer(
            IdempotencyLayer::new(Arc::clone(&store))
                .lease(Duration::from_secs(7))
                .buffer_streamed_responses(true),
        );
    let addr = serve(router).await;
    let http = client();
    for (path, status, problem) in [
        ("/marked", StatusCode::GATEWAY_TIMEOUT, None),
        (
            "/broken-body",
            StatusCode::INTERNAL_SERVER_ERROR,
            Some("urn:idempotency:problem:outcome-unknown"),
        ),
    ] {
        let key = format!("k-unknown{}", path.replace('/', "-"));
        let first = send(&http, addr, "POST", path, &[key.as_bytes()], &[], b"{}", false).await;
        assert_eq!(first.status, status, "{path}: {}", first.text());
        if let Some(problem) = problem {
            assert_eq!(first.problem_type(), problem, "{path}");
        }
        assert_eq!(first.headers["retry-after"], "7", "{path}: the lease");
        let retry = send(&http, addr, "POST", path, &[key.as_bytes()], &[], b"{}", false).await;
        assert_eq!(retry.status, StatusCode::CONFLICT, "{path}: {}", retry.text());
        let record = store
            .get(&Scope::global(), &Key::new(key).unwrap())
            .await
            .unwrap()
            .expect("the record stays");
        assert!(
            matches!(record.state, RecordState::InFlight { token, .. } if token != Token::NONE),
            "{path}: still held, not released: {record:?}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2, "each handler ran once");

    // A service error says nothing about whether the request took effect either.
    let failing =
        IdempotencyLayer::new(Arc::clone(&store)).layer(tower::service_fn(|_: http::Request<Body>| async {
            Err::<Response, _>(std::io::Error::other("connection reset"))
        }));
    let request = || {
        http::Request::post("/")
            .header("idempotency-key", "k-service-error")
            .body(Body::from("{}"))
            .unwrap()
    };
    assert!(failing.clone().oneshot(request()).await.is_err());
    let retry = failing.oneshot(request()).await.expect("answered by the layer");
    assert_eq!(retry.status(), StatusCode::CONFLICT);
}

/// The default policy releases 408, 409, 425 and 429 (the retry runs again, as the next attempt)
/// and stores other 4xx; a custom policy can make a 5xx final, replayed like any stored answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outcome_policy_decides_per_status() {
    use std::sync::atomic::AtomicU32;

    use axum::extract::Query;
    use axum::routing::post;
    use idempotency_http::IdempotencyKey;

    #[derive(serde::Deserialize)]
    struct Answer {
        status: u16,
    }
    let runs = Arc::new(AtomicU32::new(0));
    let handler = {
        let runs = Arc::clone(&runs);
        move |Query(answer): Query<Answer>, axum::Extension(key): axum::Extension<IdempotencyKey>| {
            let runs = Arc::clone(&runs);
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::IM_A_TEAPOT);
                (status, format!("attempt {}", key.attempt))
            }
        }
    };
    let store = common::memory().await;
    let router: Router = Router::new()
        .route(
            "/default",
            post(handler.clone()).layer(IdempotencyLayer::new(Arc::clone(&store))),
        )
        .route(
            "/stripe",
            // Stripe's choice: a 5xx is final, and replayed.
            post(handler).layer(
                IdempotencyLayer::new(Arc::clone(&store))
                    .final_status(|status| !matches!(status.as_u16(), 408 | 409 | 425 | 429)),
            ),
        );
    let addr = serve(router).await;
    let http = client();
    let twice = |path: String, key: String| {
        let http = http.clone();
        async move {
            let first = send(&http, addr, "POST", &path, &[key.as_bytes()], &[], b"", false).await;
            let second = send(&http, addr, "POST", &path, &[key.as_bytes()], &[], b"", false).await;
            (first, second)
        }
    };
    for status in [408_u16, 409, 425, 429, 500, 503] {
        let before = runs.load(Ordering::SeqCst);
        let (first, second) = twice(
            format!("/default?status={status}"),
            format!("k-released-{status}"),
        )
        .await;
        assert_eq!(first.status.as_u16(), status);
        assert_eq!(
            second.text(),
            "attempt 2",
            "{status}: the retry runs again as attempt 2"
        );
        assert!(second.headers.get("idempotent-replayed").is_none(), "{status}");
        assert_eq!(runs.load(Ordering::SeqCst) - before, 2, "{status}");
    }
    for (path, status) in [
        ("/default", 422_u16),
        ("/default", 404),
        ("/stripe", 500),
        ("/stripe", 503),
    ] {
        let before = runs.load(Ordering::SeqCst);
        let (first, second) = twice(
            format!("{path}?status={status}"),
            format!("k-final{path}-{status}"),
        )
        .await;
        assert_eq!((first.status.as_u16(), second.status.as_u16()), (status, status));
        assert_eq!(second.headers["idempotent-replayed"], "true", "{path} {status}");
        assert_eq!(second.text(), "attempt 1", "{path} {status}");
        assert_eq!(
            runs.load(Ordering::SeqCst) - before,
            1,
            "{path} {status}: stored, not run again"
        );
    }
    // Stripe's choice still releases 429: the client was told to come back.
    let (_, second) = twice("/stripe?status=429".into(), "k-stripe-429".into()).await;
    assert_eq!(second.text(), "attempt 2");
}

/// Wait mode, a duplicate through the same layer: answered with the replay at the very
/// instant the first request's outcome is recorded (the paused clock stands still while
/// anything can run), not at the next re-read of the record.
#[tokio::test(start_paused = true)]
async fn wait_mode_answers_a_duplicate_the_moment_the_first_completes() {
    use axum::body::Body;
    use tower::{Layer, ServiceExt};

    let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let service = IdempotencyLayer::new(idempotency_core::MemoryStore::new())
        .wait(Duration::from_secs(30))
        .layer(tower::service_fn({
            let runs = Arc::clone(&runs);
            move |_: http::Request<Body>| {
                let runs = Arc::clone(&runs);
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    Ok::<_, std::convert::Infallible>(http::Response::new(Body::from("charged")))
                }
            }
        }));
    let request = || {
        http::Request::post("/charges")
            .header("idempotency-key", "k-wait-wake")
            .body(Body::from("{}"))
            .unwrap()
    };
    let started = tokio::time::Instant::now();
    let first = tokio::spawn(service.clone().oneshot(request()));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let duplicate = service.oneshot(request()).await.unwrap();
    assert_eq!(started.elapsed(), Duration::from_secs(5));
    assert_eq!(duplicate.status(), StatusCode::OK);
    assert_eq!(duplicate.headers()["idempotent-replayed"], "true");
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A partner's API: the key comes as `X-Request-Id`, or from the body's `refund_id` when no key
/// header is sent, and only `amount` and `currency` decide a mismatch (a missing member counts
/// as `null`). A body that is not JSON cannot be read for either, and is refused with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_from_another_header_or_the_body_and_fingerprints_of_chosen_members() {
    use idempotency_core::{FingerprintMode, JsonPointer};

    let pointers = vec![
        JsonPointer::new("/amount").unwrap(),
        JsonPointer::new("/currency").unwrap(),
    ];
    let (addr, counters) = start(common::memory().await, |layer| {
        layer
            .key_header(http::HeaderName::from_static("x-request-id"))
            .key_from(JsonPointer::new("/refund_id").unwrap())
            .fingerprint(FingerprintMode::JsonPointers(pointers))
    })
    .await;
    let http = client();
    let post = async |headers: &[(&str, &str)], body: &str| {
        send(
            &http,
            addr,
            "POST",
            "/charges",
            &[],
            headers,
            body.as_bytes(),
            false,
        )
        .await
    };
    let by_header = [("x-request-id", "partner-1")];

    // Another note is the same request; another amount is not.
    let first = post(&by_header, r#"{"amount":10,"currency":"EUR","note":"a"}"#).await;
    let retry = post(&by_header, r#"{"note":"b","currency":"EUR","amount":10}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(first.text().contains("\"key\":\"partner-1\""), "{}", first.text());
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    let other = post(&by_header, r#"{"amount":11,"currency":"EUR"}"#).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    // Idempotency-Key is not this route's header: the request has no key and passes through.
    let unkeyed = send(
        &http,
        addr,
        "POST",
        "/charges",
        &[b"k"],
        &[],
        br#"{"amount":1}"#,
        false,
    )
    .await;
    assert!(unkeyed.text().contains("\"key\":\"\""), "{}", unkeyed.text());
    assert_eq!(counters.charges.load(Ordering::SeqCst), 2);

    // The key from the body: a string, or a number's text; a missing currency is `null`.
    let refund = post(&[], r#"{"refund_id":"re-1","amount":5}"#).await;
    let again = post(&[], r#"{"refund_id":"re-1","amount":5,"currency":null}"#).await;
    assert!(refund.text().contains("\"key\":\"re-1\""), "{}", refund.text());
    assert_eq!(again.headers["idempotent-replayed"], "true");
    let numbered = post(&[], r#"{"refund_id":42,"amount":5}"#).await;
    assert!(numbered.text().contains("\"key\":\"42\""), "{}", numbered.text());
    // The header wins over the body.
    let both = post(
        &[("x-request-id", "re-header")],
        r#"{"refund_id":"re-body","amount":5}"#,
    )
    .await;
    assert!(both.text().contains("\"key\":\"re-header\""), "{}", both.text());
    // No key anywhere: passed through unguarded.
    let keyless = post(&[], r#"{"amount":5}"#).await;
    assert_eq!(keyless.status, StatusCode::CREATED);
    assert_eq!(counters.charges.load(Ordering::SeqCst), 6);

    // Refused, with the reason, and nothing runs.
    for (headers, body, status, kind, why) in [
        (&[][..], "amount=5", 400, "invalid-body", "this body is not JSON"),
        (
            &by_header[..],
            "amount=5",
            400,
            "invalid-body",
            "this one is not JSON",
        ),
        (
            &[][..],
            r#"{"refund_id":{"id":1}}"#,
            400,
            "invalid-key",
            "the body's member /refund_id is not a key: an object",
        ),
        (&[][..], r#"{"refund_id":true}"#, 400, "invalid-key", "a boolean"),
        (
            &[][..],
            r#"{"refund_id":""}"#,
            400,
            "invalid-key",
            "/refund_id is not a key",
        ),
    ] {
        let refused = post(headers, body).await;
        assert_eq!(refused.status.as_u16(), status, "{body}: {}", refused.text());
        assert!(
            refused
                .text()
                .contains(&format!("urn:idempotency:problem:{kind}")),
            "{body}: {}",
            refused.text()
        );
        assert!(refused.text().contains(why), "{body}: {}", refused.text());
    }
    assert_eq!(counters.charges.load(Ordering::SeqCst), 6);
}

/// With `require_key`, a body without the key's member is `400 missing-key`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_required_key_missing_from_header_and_body_is_refused() {
    use idempotency_core::JsonPointer;

    let (addr, counters) = start(common::memory().await, |layer| {
        layer
            .require_key(true)
            .key_from(JsonPointer::new("/refund_id").unwrap())
    })
    .await;
    let http = client();
    for body in [r#"{"amount":5}"#, r#"{"refund_id":null}"#] {
        let refused = send(&http, addr, "POST", "/charges", &[], &[], body.as_bytes(), false).await;
        assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{body}");
        assert!(
            refused.text().contains("urn:idempotency:problem:missing-key"),
            "{body}: {}",
            refused.text()
        );
    }
    let ran = send(
        &http,
        addr,
        "POST",
        "/charges",
        &[],
        &[],
        br#"{"refund_id":"re-9"}"#,
        false,
    )
    .await;
    assert_eq!(ran.status, StatusCode::CREATED);
    assert_eq!(counters.charges.load(Ordering::SeqCst), 1);
}
