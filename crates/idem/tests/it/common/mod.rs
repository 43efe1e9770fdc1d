//! Shared set-up for the `idem` end-to-end tests: an upstream in a process of its own (this
//! test binary, run again in upstream mode), the `idem` binary as another process, and a client.

#![allow(dead_code, unreachable_pub, clippy::print_stdout)] // each test crate uses a part

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

pub mod consume;
pub mod pki;
pub mod raw;

const UPSTREAM_ENV: &str = "IDEM_TEST_UPSTREAM";
const UPSTREAM_READY: &str = "UPSTREAM LISTENING ON ";
/// Where the upstream process listens, when a test names the address (a restart on the same one).
const UPSTREAM_ADDR_ENV: &str = "IDEM_TEST_UPSTREAM_ADDR";

/// Executions per forwarded key, in the upstream process.
type Calls = Arc<Mutex<HashMap<String, u32>>>;

fn query(uri: &Uri, name: &str) -> Option<String> {
    uri.query()?
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_owned())
}

fn count(calls: &Calls, headers: &HeaderMap) -> (String, u32) {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_owned();
    let mut calls = calls.lock().unwrap();
    let n = calls.entry(key.clone()).or_default();
    *n += 1;
    (key, *n)
}

fn echo_response(headers: &HeaderMap, key: &str, calls: u32, body: &Bytes) -> Response {
    let attempt = headers
        .get("idempotency-attempt")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_owned();
    let json = serde_json::json!({
        "key": key,
        "attempt": attempt,
        "calls": calls,
        "body": String::from_utf8_lossy(body),
    });
    (
        StatusCode::CREATED,
        [("set-cookie", "session=abc; HttpOnly"), ("x-upstream", "yes")],
        json.to_string(),
    )
        .into_response()
}

/// `POST /echo`: counts the call and echoes what it got. `POST /slow?ms=N`: counts the call,
/// then answers as `/echo` after N ms (or the `X-Delay-Ms` header's N).
/// `POST /flaky`: 503 on a key's first call, then as `/echo`. `POST /big?bytes=N`: a chunked body
/// of N bytes. `GET /calls?key=K`: how many times K ran. Anything else: `404` with the path it
/// arrived at, verbatim.
fn upstream_app() -> Router {
    let calls: Calls = Arc::default();
    Router::new()
        .route(
            "/echo",
            post(
                |State(calls): State<Calls>, headers: HeaderMap, body: Bytes| async move {
                    let (key, n) = count(&calls, &headers);
                    echo_response(&headers, &key, n, &body)
                },
            ),
        )
        .route(
            "/slow",
            post(
                |State(calls): State<Calls>, uri: Uri, headers: HeaderMap, body: Bytes| async move {
                    // Counted on arrival: a call whose gateway dies mid-way has still started.
                    let (key, n) = count(&calls, &headers);
                    // `X-Delay-Ms` (outside the request's fingerprint) wins over `?ms=`.
                    let ms: u64 = headers
                        .get("x-delay-ms")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned)
                        .or_else(|| query(&uri, "ms"))
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(500);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    echo_response(&headers, &key, n, &body)
                },
            ),
        )
        .route(
            "/flaky",
            post(
                |State(calls): State<Calls>, headers: HeaderMap, body: Bytes| async move {
                    let (key, n) = count(&calls, &headers);
                    if n == 1 {
                        return (StatusCode::SERVICE_UNAVAILABLE, "try again").into_response();
                    }
                    echo_response(&headers, &key, n, &body)
                },
            ),
        )
        .route(
            "/big",
            post(
                |State(calls): State<Calls>, uri: Uri, headers: HeaderMap| async move {
                    let _ = count(&calls, &headers);
                    let bytes: usize = query(&uri, "bytes").and_then(|v| v.parse().ok()).unwrap_or(1024);
                    let chunks: Vec<Result<Bytes, std::convert::Infallible>> = (0..bytes.div_ceil(1000))
                        .map(|_| Ok(Bytes::from(vec![b'x'; 1000])))
                        .collect();
                    axum::body::Body::from_stream(futures_util::stream::iter(chunks)).into_response()
                },
            ),
        )
        // An API's routes, for the configuration file's tests: answered as `/echo` is.
        .route(
            "/v1/{*rest}",
            post(
                |State(calls): State<Calls>, uri: Uri, headers: HeaderMap, body: Bytes| async move {
                    let (key, n) = count(&calls, &headers);
                    if let Some(ms) = query(&uri, "ms").and_then(|v| v.parse().ok()) {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                    }
                    echo_response(&headers, &key, n, &body)
                },
            ),
        )
        .route(
            "/calls",
            get(|State(calls): State<Calls>, uri: Uri| async move {
                let key = query(&uri, "key").unwrap_or_default();
                let n = calls.lock().unwrap().get(&key).copied().unwrap_or(0);
                n.to_string()
            }),
        )
        .fallback(|uri: Uri| async move { (StatusCode::NOT_FOUND, uri.path().to_owned()) })
        .with_state(calls)
}

/// The upstream process's body: serves [`upstream_app`] until killed. Call it from an ignored
/// test named `upstream_process`; it does nothing unless this binary was started as the
/// upstream.
pub fn upstream_child() {
    if std::env::var(UPSTREAM_ENV).is_err() {
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let addr = std::env::var(UPSTREAM_ADDR_ENV).unwrap_or_else(|_| "127.0.0.1:0".into());
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        println!("{UPSTREAM_READY}{}", listener.local_addr().unwrap());
        axum::serve(listener, upstream_app()).await.unwrap();
    });
}

/// A child process killed (SIGKILL) when dropped.
pub struct Process {
    pub child: Child,
}

impl Process {
    /// SIGKILL, and wait for it.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM; returns its exit status once it exits (within `limit`).
    pub fn terminate(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Starts the upstream process; returns it and its address.
pub fn start_upstream() -> (Process, SocketAddr) {
    start_upstream_at(None)
}

/// Starts the upstream process on `addr` (a loopback port of its own when `None`); returns it
/// and its address.
pub fn start_upstream_at(addr: Option<SocketAddr>) -> (Process, SocketAddr) {
    let mut command = Command::new(std::env::current_exe().unwrap());
    if let Some(addr) = addr {
        command.env(UPSTREAM_ADDR_ENV, addr.to_string());
    }
    let mut process = Process {
        child: command
            .args([
                "upstream_process",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(UPSTREAM_ENV, "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the upstream process"),
    };
    let stdout = BufReader::new(process.child.stdout.take().unwrap());
    for line in stdout.lines() {
        let line = line.expect("upstream output");
        if let Some(at) = line.find(UPSTREAM_READY) {
            let addr = line[at + UPSTREAM_READY.len()..].trim().parse().unwrap();
            return (process, addr);
        }
    }
    panic!("the upstream process exited before listening");
}

/// A free loopback port (bound, then released for the gateway to take), chosen as
/// [`free_addrs`] chooses: a port the kernel hands out for `127.0.0.1:0` may be handed to
/// another test's server, or be taken by a client connection, before the gateway binds it.
pub fn free_addr() -> SocketAddr {
    free_addrs(1)[0]
}

/// A loopback port held without listening on it: a connection to it is refused, as to a port
/// nothing holds, and no other test can take it meanwhile (the socket does not allow its
/// address to be reused). [`HeldPort::free`] lets it go, for a server to bind it at once.
pub struct HeldPort {
    socket: tokio::net::TcpSocket,
    /// The port's address.
    pub addr: SocketAddr,
}

impl HeldPort {
    /// A free loopback port, held, chosen as [`free_addrs`] chooses (once freed, a port of the
    /// kernel's range could be taken by a client connection before the server binds it).
    pub fn new() -> Self {
        loop {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            let addr = SocketAddr::from(([127, 0, 0, 1], unassigned_port()));
            if socket.bind(addr).is_ok() {
                return Self { socket, addr };
            }
        }
    }

    /// Lets the port go; its address, to bind.
    pub fn free(self) -> SocketAddr {
        drop(self.socket);
        self.addr
    }
}

/// A port below the kernel's range for ports it assigns (32768 and up here), where neither
/// a bind to port 0 nor a client connection of another test lands: only another test's
/// choice of the same port could, and the caller's bind tells.
fn unassigned_port() -> u16 {
    rand::random_range(20_000..32_000_u16)
}

/// `n` distinct free loopback ports below the kernel's range for outgoing connections
/// (32768 and up here), so that no client connection of another test takes one between the
/// choice and the bind; each is held until all are chosen.
pub fn free_addrs(n: usize) -> Vec<SocketAddr> {
    let mut held = Vec::new();
    while held.len() < n {
        if let Ok(listener) = std::net::TcpListener::bind(("127.0.0.1", unassigned_port())) {
            held.push(listener);
        }
    }
    held.iter()
        .map(|listener| listener.local_addr().unwrap())
        .collect()
}

/// `idem` with `args`, run to completion: (exit code, stdout, stderr).
pub fn idem(args: &[&str]) -> (i32, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .output()
        .unwrap();
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The first line of `process`'s JSON log (`--log-format json`, standard error captured)
/// whose message is `message`. The rest of the log is read to its end on a thread of its own,
/// so the process never writes into a closed pipe. Panics when the process exits first.
pub fn logged(process: &mut Process, message: &str) -> serde_json::Value {
    use std::io::{BufRead, BufReader};

    let mut lines = BufReader::new(process.child.stderr.take().expect("stderr captured")).lines();
    let event = lines
        .by_ref()
        .map_while(Result::ok)
        .map(|line| {
            serde_json::from_str::<serde_json::Value>(&line)
                .unwrap_or_else(|e| panic!("not JSON ({e}): {line}"))
        })
        .find(|event| event["fields"]["message"] == message)
        .unwrap_or_else(|| panic!("the process exited before it logged `{message}`"));
    std::thread::spawn(move || lines.for_each(drop));
    event
}

/// The address a logged `event` names in `field`, a port the kernel picked (never `0`).
pub fn address_in(event: &serde_json::Value, field: &str) -> SocketAddr {
    let text = event["fields"][field]
        .as_str()
        .unwrap_or_else(|| panic!("no {field}: {event}"));
    let addr: SocketAddr = text.parse().unwrap_or_else(|e| panic!("{field} `{text}`: {e}"));
    assert_ne!(addr.port(), 0, "{event}");
    addr
}

/// `idem` with `args` and `env` as a process of its own, logging at `log` (`IDEM_LOG`); its
/// standard error piped for the test to read when `capture_stderr`, else shown.
pub fn spawn_idem(args: &[&str], env: &[(&str, String)], log: &str, capture_stderr: bool) -> Process {
    Process {
        child: Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(args)
            .envs(env.iter().map(|(name, value)| (*name, value.as_str())))
            .env("IDEM_LOG", log)
            .stdout(Stdio::null())
            .stderr(if capture_stderr {
                Stdio::piped()
            } else {
                Stdio::inherit()
            })
            .spawn()
            .expect("start idem"),
    }
}

/// Serves `app` on a loopback port of its own (an upstream, a handler, a receiver of a test's).
pub async fn serve_app(app: Router) -> SocketAddr {
    serve_app_on(SocketAddr::from(([127, 0, 0, 1], 0)), app).await
}

/// Serves `app` on `addr` (a [`HeldPort`] just freed, say): its bound address.
pub async fn serve_app_on(addr: SocketAddr, app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// `idem` with `args` (a `serve` command line) as a process of its own, logging warnings.
pub fn spawn_serve(args: &[&str]) -> Process {
    Process {
        child: Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(args)
            .env("IDEM_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start idem serve"),
    }
}

/// Starts `idem serve` on `listen` with `args`, and waits until its health check passes (or
/// `healthy` is false: until it accepts connections).
pub async fn start_gateway(listen: SocketAddr, args: &[&str], healthy: bool) -> Process {
    let listen_text = listen.to_string();
    let mut all = vec!["serve", "--listen", listen_text.as_str()];
    all.extend_from_slice(args);
    let mut process = spawn_serve(&all);
    if healthy {
        return ready(process, listen, "idem serve").await;
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Ok(Some(status)) = process.child.try_wait() {
            panic!("idem serve exited: {status}");
        }
        if tokio::net::TcpStream::connect(listen).await.is_ok() {
            return process;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    process.kill9();
    panic!("idem serve did not become ready on {listen}");
}

/// The PostgreSQL server the tests use: `DATABASE_URL`, or the loopback default that
/// `scripts/services` starts.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// The URL of a SQLite store in `dir` (its file is `idem.db`, which some tests open directly).
pub fn sqlite_url(dir: &std::path::Path) -> String {
    format!("sqlite://{}", dir.join("idem.db").display())
}

/// `idem serve` in front of the test upstream, each a process of its own, on a store of the
/// test's own. Dropped, it stops the gateway, then the upstream.
pub struct Fronted {
    /// The gateway.
    pub gateway: Process,
    /// The gateway's address.
    pub addr: SocketAddr,
    /// The store's URL.
    pub store: String,
    /// The folder a SQLite store's file (`idem.db`) lives in.
    pub dir: tempfile::TempDir,
    /// The upstream's address.
    pub upstream: SocketAddr,
    upstream_process: Process,
}

impl Fronted {
    /// On a new SQLite file, with `flags` after `--upstream` and `--store`; returns once the
    /// gateway is healthy.
    pub async fn sqlite(flags: &[&str]) -> Self {
        Self::start(None, flags, true).await
    }

    /// On `store` when given (a new SQLite file otherwise), with `flags` after `--upstream`
    /// and `--store`; `healthy` as [`start_gateway`] takes it.
    pub async fn start(store: Option<&str>, flags: &[&str], healthy: bool) -> Self {
        let (upstream_process, upstream) = start_upstream();
        let dir = tempfile::tempdir().unwrap();
        let store = store.map_or_else(|| sqlite_url(dir.path()), str::to_owned);
        let up = format!("http://{upstream}");
        let mut all = vec!["--upstream", up.as_str(), "--store", store.as_str()];
        all.extend_from_slice(flags);
        let addr = free_addr();
        let gateway = start_gateway(addr, &all, healthy).await;
        Self {
            gateway,
            addr,
            store,
            dir,
            upstream,
            upstream_process,
        }
    }
}

/// Waits until `process` answers `200` on `GET /_idem/healthz` at `admin` (at most 20 s);
/// panics naming `what` if it exits first or never does.
pub async fn ready(process: Process, admin: SocketAddr, what: &str) -> Process {
    ready_on(process, admin, "/_idem/healthz", what).await
}

/// As [`ready`], with the health check at `path` (`/healthz` on an admin listener of its own).
pub async fn ready_on(mut process: Process, admin: SocketAddr, path: &str, what: &str) -> Process {
    let client = client();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(Some(status)) = process.child.try_wait() {
            panic!("{what} exited: {status}");
        }
        let seen = try_send(&client, admin, "GET", path, &[], b"").await;
        if seen.is_some_and(|seen| seen.status == 200) {
            return process;
        }
        if Instant::now() > deadline {
            process.kill9();
            panic!("{what} did not become ready on {admin}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the series `name` with `labels` on `admin`'s metrics reaches `at_least` (at
/// most 30 s).
pub async fn metric_at_least(admin: SocketAddr, name: &str, labels: &[(&str, &str)], at_least: f64) {
    let client = client();
    let what = format!("{name} {labels:?} at least {at_least}");
    idempotency_testkit::eventually(Duration::from_secs(30), &what, async || {
        metric(&client, admin, name, labels).await >= at_least
    })
    .await;
}

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A response as the client saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Seen {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_default()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

pub async fn try_send(
    client: &HttpClient,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Option<Seen> {
    let mut builder = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let response = client
        .request(builder.body(Full::new(Bytes::copy_from_slice(body))).ok()?)
        .await
        .ok()?;
    let (parts, body) = response.into_parts();
    Some(Seen {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body: body.collect().await.ok()?.to_bytes(),
    })
}

pub async fn send(
    client: &HttpClient,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Seen {
    try_send(client, addr, method, path, headers, body)
        .await
        .unwrap_or_else(|| panic!("{method} {path} on {addr} failed"))
}

/// How many times the upstream ran `key` (as forwarded).
pub async fn calls(client: &HttpClient, upstream: SocketAddr, key: &str) -> u32 {
    let seen = send(client, upstream, "GET", &format!("/calls?key={key}"), &[], b"").await;
    String::from_utf8_lossy(&seen.body).parse().unwrap()
}

/// The value of one series on the gateway's `/_idem/metrics` (Prometheus text): the sum over
/// the lines whose name is `name` and whose labels include every `name="value"` of `labels`.
pub async fn metric(client: &HttpClient, gateway: SocketAddr, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric_on(client, gateway, "/_idem/metrics", name, labels).await
}

/// As [`metric`], from the metrics page at `path` (`/metrics` on an admin listener of its own).
pub async fn metric_on(
    client: &HttpClient,
    addr: SocketAddr,
    path: &str,
    name: &str,
    labels: &[(&str, &str)],
) -> f64 {
    let page = send(client, addr, "GET", path, &[], b"").await;
    let text = String::from_utf8_lossy(&page.body).into_owned();
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (series_name, series_labels) = match series.split_once('{') {
                Some((n, l)) => (n, l),
                None => (series, ""),
            };
            let wanted = series_name == name
                && labels
                    .iter()
                    .all(|(k, v)| series_labels.contains(&format!("{k}=\"{v}\"")));
            wanted.then(|| value.parse::<f64>().ok()).flatten()
        })
        .sum()
}

/// A PostgreSQL role of this process that may only read the store's records, for the tests of
/// what a read-only store refuses.
pub struct ReadOnlyRole {
    name: String,
    /// `url` with the role as its user.
    pub url: String,
}

impl ReadOnlyRole {
    /// Creates the role (dropping a leftover of an earlier run), with `SELECT` on
    /// `public.idempotency_records` only.
    pub async fn create(pool: &idempotency::postgres::sqlx::PgPool, url: &str, what: &str) -> Self {
        use idempotency::postgres::sqlx::{self, AssertSqlSafe};
        let name = format!("idem_{what}_{}", std::process::id());
        for statement in [
            format!("DROP ROLE IF EXISTS {name}"),
            format!("CREATE ROLE {name} LOGIN"),
            format!("GRANT USAGE ON SCHEMA public TO {name}"),
            format!("GRANT SELECT ON public.idempotency_records TO {name}"),
        ] {
            sqlx::raw_sql(AssertSqlSafe(statement))
                .execute(pool)
                .await
                .unwrap();
        }
        let mut reader = url::Url::parse(url).unwrap();
        reader.set_username(&name).unwrap();
        Self {
            name,
            url: reader.into(),
        }
    }

    /// Drops the role.
    pub async fn drop(self, pool: &idempotency::postgres::sqlx::PgPool) {
        use idempotency::postgres::sqlx::{self, AssertSqlSafe};
        let name = &self.name;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "REVOKE ALL ON public.idempotency_records FROM {name}; REVOKE USAGE ON SCHEMA public FROM {name}; DROP ROLE {name}"
        )))
        .execute(pool)
        .await
        .unwrap();
    }
}
