//! The service: what happens to one request.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, header};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idempotency_core::{
    Completed, Decision, Execution, Fingerprint, FingerprintMode, Guard, Key, Recorded, Scope, Store,
    Timestamp,
};
use tower::Service;

use crate::body::{BoxError, ResponseBody};
use crate::key::key_from_headers;
use crate::layer::Config;
use crate::problem::Problem;
use crate::stored::{self, Stored};

/// Replays carry this header with the value `true`.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Every stored response (the first and its replays) says until when its key is remembered, as
/// an HTTP-date: retries after that run again.
pub const IDEMPOTENCY_KEY_EXPIRES: HeaderName = HeaderName::from_static("idempotency-key-expires");

/// What the handler finds in the request's extensions: the key it runs under, to propagate into
/// the messages it publishes and the calls it makes downstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey {
    /// The scope of the key.
    pub scope: Scope,
    /// The key.
    pub key: Key,
    /// The attempt number: 1, or more after a previous attempt's lease expired.
    pub attempt: u32,
    /// Whether a previous attempt may have partially run.
    pub recovered: bool,
}

impl IdempotencyKey {
    /// The key to put on the messages the handler publishes and the calls it makes downstream
    /// ([`Key::qualified`]): the same for every retry of this request, different for another
    /// scope's equal key. A consumer keyed on it runs once per API request, however often the
    /// client retried and the broker redelivered.
    ///
    /// ```
    /// use idempotency_core::{Key, Scope};
    /// use idempotency_http::IdempotencyKey;
    ///
    /// let request = IdempotencyKey { scope: Scope::new("tenant-a")?, key: Key::new("pay-1")?, attempt: 1, recovered: false };
    /// assert_eq!(request.message_key().as_str(), "tenant-a:pay-1");
    /// # Ok::<(), idempotency_core::KeyError>(())
    /// ```
    #[must_use]
    pub fn message_key(&self) -> Key {
        Key::qualified(&self.scope, &self.key)
    }
}

/// The service a [`crate::IdempotencyLayer`] wraps around `I`.
pub struct IdempotencyService<I, S> {
    inner: I,
    guard: Guard<S>,
    config: Arc<Config>,
}

impl<I: Clone, S: Clone> Clone for IdempotencyService<I, S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            guard: self.guard.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<I, S> fmt::Debug for IdempotencyService<I, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService").finish_non_exhaustive()
    }
}

impl<I, S> IdempotencyService<I, S> {
    pub(crate) fn new(inner: I, guard: Guard<S>, config: Arc<Config>) -> Self {
        Self { inner, guard, config }
    }
}

/// The future of [`IdempotencyService`].
pub type ResponseFuture<B, E> = Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

impl<I, S, ReqBody, ResBody> Service<Request<ReqBody>> for IdempotencyService<I, S>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    I::Future: Send + 'static,
    I::Error: Send + 'static,
    S: Store + Clone + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = I::Error;
    type Future = ResponseFuture<ResBody, I::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The instance that was polled ready is the one to call (tower's `Service` contract).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(handle(
            inner,
            self.guard.clone(),
            Arc::clone(&self.config),
            request,
        ))
    }
}

fn problem<B>(problem: &Problem) -> Response<ResponseBody<B>> {
    problem.to_response().map(ResponseBody::full)
}

fn passthrough<B>(response: Response<B>) -> Response<ResponseBody<B>> {
    response.map(|body| ResponseBody::inner(Bytes::new(), Box::pin(body)))
}

async fn handle<I, S, ReqBody, ResBody>(
    mut inner: I,
    guard: Guard<S>,
    config: Arc<Config>,
    request: Request<ReqBody>,
) -> Result<Response<ResponseBody<ResBody>>, I::Error>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    I::Future: Send + 'static,
    I::Error: Send + 'static,
    S: Store + Clone + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    if !config.methods.contains(request.method()) {
        return inner.call(request).await.map(passthrough);
    }
    let key = match key_from_headers(request.headers()) {
        Ok(Some(key)) => key,
        Ok(None) if config.require_key => return Ok(problem(&Problem::MissingKey)),
        Ok(None) => return inner.call(request).await.map(passthrough),
        Err(why) => return Ok(problem(&Problem::InvalidKey(why))),
    };
    let (parts, body) = request.into_parts();
    let too_large = Problem::BodyTooLarge {
        limit: config.max_body,
    };
    // A declared length over the limit is refused before a byte is read.
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > config.max_body as u64) {
        return Ok(problem(&too_large));
    }
    let bytes = match Limited::new(body, config.max_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) if error.is::<LengthLimitError>() => return Ok(problem(&too_large)),
        Err(_) => return Ok(problem(&Problem::BodyUnreadable)),
    };
    let scope = (config.scope)(&parts);
    let fingerprint = fingerprint(&parts, &bytes, &config);
    let request = Request::from_parts(parts, ReqBody::from(bytes));
    // If the client goes away, hyper drops this future; the guarded run must still finish and
    // record its outcome. `DetachOnDrop` polls it here and, only if it is dropped unfinished,
    // moves it onto a task of its own: the guarantee of a spawned task without paying a task
    // switch on every request.
    let run = AssertUnwindSafe(run_guarded(
        inner,
        guard,
        config,
        scope,
        key,
        fingerprint,
        request,
    ))
    .catch_unwind();
    match DetachOnDrop::new(run).await {
        Ok(result) => result,
        Err(_) => {
            // The guard released the key before the panic reached this point.
            tracing::error!("the idempotent request handler panicked");
            Ok(problem(&Problem::HandlerFailed))
        }
    }
}

/// A future that finishes on a task of its own if it is dropped before it is done.
struct DetachOnDrop<T: Send + 'static> {
    future: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
}

impl<T: Send + 'static> DetachOnDrop<T> {
    fn new(future: impl Future<Output = T> + Send + 'static) -> Self {
        Self {
            future: Some(Box::pin(future)),
        }
    }
}

impl<T: Send + 'static> Future for DetachOnDrop<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let Some(future) = self.future.as_mut() else {
            panic!("DetachOnDrop polled after completion");
        };
        let output = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(output)
    }
}

/// Runs moved onto tasks of their own because their requests were dropped, and not yet done.
static DETACHED: AtomicUsize = AtomicUsize::new(0);

/// Counts a detached run until it is dropped (done, or its task cancelled).
struct Detached;

impl Detached {
    fn start() -> Self {
        DETACHED.fetch_add(1, Ordering::SeqCst);
        Self
    }
}

impl Drop for Detached {
    fn drop(&mut self) {
        DETACHED.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How many guarded runs are finishing on tasks of their own because their clients went away
/// (in this process, across all layers).
#[must_use]
pub fn detached_runs() -> usize {
    DETACHED.load(Ordering::SeqCst)
}

/// Waits until no guarded run is finishing on a task of its own, for at most `limit`; returns
/// whether they all finished. A server that drains on shutdown calls this after its last
/// connection closed, so that the runs of clients that went away still record their outcomes
/// before the process exits.
pub async fn wait_for_detached_runs(limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while detached_runs() > 0 {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}

impl<T: Send + 'static> Drop for DetachOnDrop<T> {
    fn drop(&mut self) {
        if let Some(future) = self.future.take() {
            match tokio::runtime::Handle::try_current() {
                // The future is boxed, so moving it to a task does not move what it pinned.
                Ok(runtime) => {
                    let detached = Detached::start();
                    drop(runtime.spawn(async move {
                        let output = future.await;
                        drop(detached);
                        output
                    }));
                }
                Err(_) => {
                    tracing::error!("an idempotent request was dropped outside a runtime and cancelled");
                }
            }
        }
    }
}

/// The fingerprint: method, path and query, the configured headers, and the body.
fn fingerprint(parts: &http::request::Parts, body: &Bytes, config: &Config) -> Fingerprint {
    let base = || {
        let mut builder = Fingerprint::builder()
            .part("method", parts.method.as_str().as_bytes())
            .part(
                "target",
                parts.uri.path_and_query().map_or("/", |p| p.as_str()).as_bytes(),
            );
        for name in &config.fingerprint_headers {
            let values: Vec<&[u8]> = parts
                .headers
                .get_all(name)
                .iter()
                .map(HeaderValue::as_bytes)
                .collect();
            builder = builder.part(name.as_str(), &values.join(&b'\n'));
        }
        builder
    };
    match base().payload(&config.fingerprint, body) {
        Ok(builder) => builder.finish(),
        // A body that is not JSON under a JSON mode: its bytes still identify it.
        Err(_) => base()
            .payload(&FingerprintMode::Raw, body)
            .map(idempotency_core::FingerprintBuilder::finish)
            .unwrap_or_else(|_| Fingerprint::of_bytes(body)),
    }
}

/// What the handler produced, as the guard's policy sees it.
enum Captured<B, E> {
    /// The whole response, small enough to store.
    Buffered {
        parts: http::response::Parts,
        body: Bytes,
    },
    /// A response too large or streamed to store: passed through, `prefix` (what was read of
    /// it while trying to store it) first.
    Streaming {
        parts: http::response::Parts,
        prefix: Bytes,
        body: Pin<Box<B>>,
    },
    /// The inner service failed.
    Failed(E),
    /// The response body failed while being read.
    BodyFailed,
}

async fn capture<B, E>(result: Result<Response<B>, E>, config: &Config) -> Captured<B, E>
where
    B: Body<Data = Bytes>,
{
    let max_response = config.max_response as u64;
    let (parts, body) = match result {
        Err(error) => return Captured::Failed(error),
        Ok(response) => response.into_parts(),
    };
    let mut body = Box::pin(body);
    let hint = body.size_hint();
    let unknown = match hint.exact() {
        Some(len) if len <= max_response => {
            return match body.collect().await {
                Ok(collected) => Captured::Buffered {
                    parts,
                    body: collected.to_bytes(),
                },
                Err(_) => Captured::BodyFailed,
            };
        }
        Some(_) => false,
        None => config.buffer_streamed && hint.lower() <= max_response,
    };
    if !unknown {
        return Captured::Streaming {
            parts,
            prefix: Bytes::new(),
            body,
        };
    }
    // Of unknown length: read up to the limit; store it if it ends there.
    let mut read = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            return Captured::BodyFailed;
        };
        if let Ok(data) = frame.into_data() {
            read.extend_from_slice(&data);
        }
        if read.len() as u64 > max_response {
            return Captured::Streaming {
                parts,
                prefix: read.freeze(),
                body,
            };
        }
    }
    Captured::Buffered {
        parts,
        body: read.freeze(),
    }
}

fn decide<B, E>(captured: &Captured<B, E>, config: &Config) -> Decision {
    match captured {
        Captured::Buffered { parts, body } if (config.is_final)(parts.status) => Decision::Complete(
            stored::encode_response(parts.status, &storable_headers(&parts.headers, config), body),
        ),
        Captured::Streaming { parts, .. } if (config.is_final)(parts.status) => {
            Decision::Complete(stored::encode_not_replayable())
        }
        _ => Decision::Release,
    }
}

/// Never stored: hop-by-hop headers (and those `Connection` names), framing and date, which the
/// server sets anew, and this layer's own headers.
const NEVER_STORED: [&str; 11] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
    "date",
    "idempotent-replayed",
    "idempotency-key-expires",
];

/// Not stored unless allowed ([`crate::IdempotencyLayer::store_header`]): credentials.
const CREDENTIALS: [&str; 5] = [
    "set-cookie",
    "set-cookie2",
    "authorization",
    "proxy-authorization",
    "cookie",
];

fn storable_headers(headers: &HeaderMap, config: &Config) -> HeaderMap {
    let listed_by_connection: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .collect();
    let mut kept = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let name_str = name.as_str();
        let hop = NEVER_STORED.contains(&name_str) || listed_by_connection.iter().any(|n| n == name_str);
        let secret = CREDENTIALS.contains(&name_str) && !config.allowed_headers.contains(name);
        if !hop && !secret {
            kept.append(name.clone(), value.clone());
        }
    }
    kept
}

fn expires_header(expires_at: Timestamp) -> HeaderValue {
    HeaderValue::from_str(&httpdate::fmt_http_date(expires_at.to_system_time()))
        .unwrap_or_else(|_| HeaderValue::from_static("Thu, 01 Jan 1970 00:00:00 GMT"))
}

fn replay<B>(done: &Completed) -> Response<ResponseBody<B>> {
    match stored::decode(&done.outcome) {
        Some(Stored::Response {
            status,
            headers,
            body,
        }) => {
            let mut response = Response::new(ResponseBody::full(body));
            *response.status_mut() = status;
            *response.headers_mut() = headers;
            response
                .headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            response
                .headers_mut()
                .insert(IDEMPOTENCY_KEY_EXPIRES, expires_header(done.expires_at));
            response
        }
        Some(Stored::NotReplayable) => problem(&Problem::NotReplayable),
        None => problem(&Problem::StoredResponseUnreadable),
    }
}

fn respond_executed<B, E>(
    captured: Captured<B, E>,
    recorded: &Recorded,
) -> Result<Response<ResponseBody<B>>, E> {
    let mut response = match captured {
        Captured::Buffered { parts, body } => Response::from_parts(parts, ResponseBody::full(body)),
        Captured::Streaming { parts, prefix, body } => {
            Response::from_parts(parts, ResponseBody::inner(prefix, body))
        }
        Captured::Failed(error) => return Err(error),
        Captured::BodyFailed => return Ok(problem(&Problem::HandlerFailed)),
    };
    if let Recorded::Completed { expires_at } = recorded {
        response
            .headers_mut()
            .insert(IDEMPOTENCY_KEY_EXPIRES, expires_header(*expires_at));
    }
    Ok(response)
}

async fn run_guarded<I, S, ReqBody, ResBody>(
    inner: I,
    guard: Guard<S>,
    config: Arc<Config>,
    scope: Scope,
    key: Key,
    fingerprint: Fingerprint,
    request: Request<ReqBody>,
) -> Result<Response<ResponseBody<ResBody>>, I::Error>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    I::Future: Send + 'static,
    I::Error: Send + 'static,
    S: Store + Clone + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
{
    let deadline = config.wait.map(|wait| tokio::time::Instant::now() + wait);
    let mut poll = Duration::from_millis(20);
    // The handler runs at most once, whichever loop iteration acquires the key.
    let mut pending = Some((inner, request));
    loop {
        let run = guard
            .run(
                scope.clone(),
                key.clone(),
                fingerprint,
                |captured: &Captured<ResBody, I::Error>| decide(captured, &config),
                |attempt| {
                    let (mut inner, mut request) = pending.take().expect("the handler runs at most once");
                    request.extensions_mut().insert(IdempotencyKey {
                        scope: attempt.scope().clone(),
                        key: attempt.key().clone(),
                        attempt: attempt.number(),
                        recovered: attempt.recovered(),
                    });
                    let config = Arc::clone(&config);
                    async move { capture(inner.call(request).await, &config).await }
                },
            )
            .await;
        match run {
            Ok(Execution::Executed { value, recorded, .. }) => return respond_executed(value, &recorded),
            Ok(Execution::Replayed(done)) => return Ok(replay(&done)),
            Ok(Execution::Mismatch) => return Ok(problem(&Problem::KeyReused)),
            Ok(Execution::InFlight { retry_after, .. }) => {
                let now = tokio::time::Instant::now();
                match deadline {
                    Some(deadline) if now < deadline => {
                        tokio::time::sleep(poll.min(retry_after).min(deadline - now)).await;
                        poll = (poll * 2).min(Duration::from_millis(250));
                    }
                    _ => return Ok(problem(&Problem::InFlight { retry_after })),
                }
            }
            Err(error) => {
                if config.fail_open {
                    tracing::warn!(%error, "idempotency store unavailable; running without it (fail-open)");
                    let (mut inner, request) = pending.take().expect("the handler has not run");
                    return inner.call(request).await.map(passthrough);
                }
                tracing::warn!(%error, "idempotency store unavailable; refusing the request (fail-closed)");
                return Ok(problem(&Problem::StoreUnavailable));
            }
        }
    }
}
