//! A real server on 127.0.0.1:0, a real HTTP client, a test application, and the stores.

#![allow(dead_code, unreachable_pub)] // each test crate uses a part

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idempotency_core::{MemoryStore, StoreAdmin};
use idempotency_http::IdempotencyKey;

pub type DynStore = Arc<dyn StoreAdmin>;

/// Counts handler executions per route.
#[derive(Clone, Default)]
pub struct Counters {
    pub charges: Arc<AtomicUsize>,
    pub flaky: Arc<AtomicUsize>,
    pub big: Arc<AtomicUsize>,
    pub stream: Arc<AtomicUsize>,
    pub big_stream: Arc<AtomicUsize>,
}

#[derive(serde::Deserialize)]
pub struct Delay {
    delay_ms: Option<u64>,
}

/// The application under the layer:
/// - `POST /charges[?delay_ms=N]`: a 201 with `Location`, `Set-Cookie`, a JSON body naming the
///   charge and the key it ran under;
/// - `POST /flaky?mode=status|panic`: fails once (500 or a panic), then succeeds;
/// - `POST /big`: a 2 MiB body of known length;
/// - `POST /stream`: a streamed body (`abc`);
/// - `POST /big-stream`: a streamed body of 2 MiB;
/// - `GET /charges`: a plain read.
pub fn app(counters: Counters) -> Router {
    Router::new()
        .route("/charges", post(charge).get(|| async { "list of charges" }))
        .route("/other", post(charge))
        .route("/flaky", post(flaky))
        .route("/big", post(big))
        .route("/stream", post(stream))
        .route("/big-stream", post(big_stream))
        .with_state(counters)
}

async fn charge(
    State(counters): State<Counters>,
    Query(delay): Query<Delay>,
    key: Option<axum::Extension<IdempotencyKey>>,
    body: Bytes,
) -> Response {
    if let Some(ms) = delay.delay_ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let n = counters.charges.fetch_add(1, Ordering::SeqCst) + 1;
    let key = key.map(|k| k.0.key.to_string()).unwrap_or_default();
    let body = format!(r#"{{"charge":{n},"key":"{key}","request_bytes":{}}}"#, body.len());
    (
        StatusCode::CREATED,
        [
            ("location", format!("/charges/{n}")),
            ("set-cookie", "session=secret; HttpOnly".to_string()),
            ("content-type", "application/json".to_string()),
        ],
        body,
    )
        .into_response()
}

#[derive(serde::Deserialize)]
pub struct Mode {
    mode: String,
}

async fn flaky(State(counters): State<Counters>, Query(mode): Query<Mode>) -> Response {
    let n = counters.flaky.fetch_add(1, Ordering::SeqCst) + 1;
    if n == 1 {
        if mode.mode == "panic" {
            panic!("first attempt panics");
        }
        return (StatusCode::INTERNAL_SERVER_ERROR, "try again").into_response();
    }
    (StatusCode::CREATED, format!("succeeded on attempt {n}")).into_response()
}

async fn big(State(counters): State<Counters>) -> Response {
    counters.big.fetch_add(1, Ordering::SeqCst);
    (StatusCode::OK, vec![b'x'; 2 << 20]).into_response()
}

async fn stream(State(counters): State<Counters>) -> Response {
    counters.stream.fetch_add(1, Ordering::SeqCst);
    let chunks = futures_util::stream::iter(["a", "b", "c"].map(|c| Ok::<_, Infallible>(Bytes::from(c))));
    Response::new(Body::from_stream(chunks))
}

async fn big_stream(State(counters): State<Counters>) -> Response {
    counters.big_stream.fetch_add(1, Ordering::SeqCst);
    let chunks = (0..32_u8).map(|i| Ok::<_, Infallible>(Bytes::from(vec![b'a' + i % 26; 64 << 10])));
    Response::new(Body::from_stream(futures_util::stream::iter(chunks)))
}

/// Serves `router` on 127.0.0.1:0 until the test ends.
pub async fn serve(router: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    addr
}

pub type HttpClient = Client<HttpConnector, BoxBody<Bytes, Infallible>>;

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A response as the client saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Seen {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn problem_type(&self) -> String {
        let json: serde_json::Value = serde_json::from_slice(&self.body).unwrap_or_default();
        json["type"].as_str().unwrap_or_default().to_owned()
    }
}

// One argument per request part keeps the call sites readable as tables.
#[allow(clippy::too_many_arguments)]
/// Sends a request; `keys` become `Idempotency-Key` headers (raw values), `chunked` sends the
/// body without a length.
pub async fn send(
    client: &HttpClient,
    addr: SocketAddr,
    method: &str,
    path: &str,
    keys: &[&[u8]],
    extra: &[(&str, &str)],
    body: &[u8],
    chunked: bool,
) -> Seen {
    let mut builder = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    for key in keys {
        builder = builder.header("idempotency-key", http::HeaderValue::from_bytes(key).unwrap());
    }
    for (name, value) in extra {
        builder = builder.header(*name, *value);
    }
    let body: BoxBody<Bytes, Infallible> = if chunked {
        let chunks: Vec<Result<http_body::Frame<Bytes>, Infallible>> = body
            .chunks(1024)
            .map(|c| Ok(http_body::Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        BoxBody::new(StreamBody::new(futures_util::stream::iter(chunks)))
    } else {
        BoxBody::new(Full::new(Bytes::copy_from_slice(body)))
    };
    let response = client.request(builder.body(body).unwrap()).await.unwrap();
    let (parts, body) = response.into_parts();
    Seen {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

/// The stores the behaviour runs on.
pub async fn memory() -> DynStore {
    Arc::new(MemoryStore::new())
}

pub async fn sqlite() -> DynStore {
    // The directory must outlive the store, which lives as long as the test's server.
    let path = tempfile::tempdir().unwrap().keep().join("http.db");
    Arc::new(
        idempotency_sqlite::SqliteStore::open(&format!("sqlite://{}", path.display()))
            .await
            .unwrap(),
    )
}

pub async fn postgres() -> DynStore {
    let url =
        std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    // Named as the PostgreSQL store's tests name theirs, which drop it once it is an hour old.
    let table = idempotency_testkit::sql::fresh_table("h");
    let options = idempotency_postgres::PostgresOptions::from_url(&url)
        .unwrap()
        .schema("idempotency_tests")
        .unwrap()
        .table(&table)
        .unwrap();
    Arc::new(
        idempotency_postgres::PostgresStore::connect_with(options)
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {url} is needed for this test: {e}")),
    )
}

pub async fn redis() -> DynStore {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    Arc::new(
        idempotency_redis::RedisStore::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("Redis at {url} is needed for this test: {e}"))
            .prefix(&format!(
                "idem-http-test:{}:",
                idempotency_testkit::sql::fresh_suffix()
            ))
            .unwrap(),
    )
}

/// Writes `head` and then `body` on a raw connection, ignoring write errors (the server may
/// answer and close before the body is sent), and returns the response's status and text.
pub async fn raw_exchange(addr: SocketAddr, head: &str, body: &[&[u8]]) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    socket.write_all(head.as_bytes()).await.unwrap();
    for chunk in body {
        if socket.write_all(chunk).await.is_err() {
            break;
        }
    }
    let mut response = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(5), socket.read(&mut buffer)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
            Ok(Ok(n)) => response.extend_from_slice(&buffer[..n]),
        }
        if response.windows(4).any(|w| w == b"\r\n\r\n") && response.len() > 200 {
            break;
        }
    }
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP response: {text:?}"));
    (status, text)
}

/// Waits (polling every 20 ms, at most 5 s) until the record of `key` in the global scope is
/// completed; whether it is, is for the caller to assert.
pub async fn wait_until_completed(store: &DynStore, key: &str) {
    use idempotency_core::{Key, RecordState, Scope};
    let key = Key::new(key).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while tokio::time::Instant::now() < deadline {
        let record = store.get(&Scope::global(), &key).await;
        if matches!(record, Ok(Some(ref r)) if matches!(r.state, RecordState::Completed { .. })) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
