//! What the layer does, shared by every service it makes: its settings and the reconcile hook's
//! types. The bottom of the crate: it imports only the key and the log settings.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, HeaderName, Method, Response, StatusCode, Uri};
use idempotency_core::{FingerprintMode, JsonPointer, Scope};

use crate::key::IdempotencyKey;

pub(crate) type ScopeFn = Arc<dyn Fn(&Parts) -> Scope + Send + Sync>;
pub(crate) type FinalFn = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;

/// What the layer does, shared by every service it makes.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) methods: Vec<Method>,
    pub(crate) require_key: bool,
    /// The header the key is read from.
    pub(crate) key_header: HeaderName,
    /// Where in a JSON body the key is, when the header is absent.
    pub(crate) key_from: Option<JsonPointer>,
    pub(crate) max_body: usize,
    pub(crate) max_response: usize,
    pub(crate) buffer_streamed: bool,
    pub(crate) scope: ScopeFn,
    pub(crate) fingerprint: FingerprintMode,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) is_final: FinalFn,
    pub(crate) wait: Option<Duration>,
    pub(crate) fail_open: bool,
    pub(crate) allowed_headers: Vec<HeaderName>,
    /// The bytes of request bodies all requests through the layer may hold at once.
    pub(crate) body_budget: Option<Arc<tokio::sync::Semaphore>>,
    /// How keys appear in the per-request log event.
    pub(crate) log_keys: crate::log::KeyLog,
    /// Asked before a recovered attempt runs ([`crate::reconcile`]).
    pub(crate) reconcile: Option<ReconcileFn>,
}

/// The default outcome policy ([`crate::guide`]): 2xx and 4xx are final and stored, except 408, 409, 425
/// and 429; 1xx, 3xx and 5xx release the key so that a retry runs again.
///
/// 3xx is released rather than stored because a redirect usually points at a resource whose
/// creation is not confirmed by the redirect itself; configure [`IdempotencyLayer::final_status`](crate::IdempotencyLayer::final_status)
/// to store it.
#[must_use]
pub fn default_is_final(status: StatusCode) -> bool {
    (status.is_success() || status.is_client_error()) && !matches!(status.as_u16(), 408 | 409 | 425 | 429)
}

/// A response whose outcome was adopted from a reconcile function carries this header with the
/// value `true` (its replays too).
pub const IDEMPOTENCY_RECONCILED: HeaderName = HeaderName::from_static("idempotency-reconciled");

/// What a reconcile function is asked about: the recovered attempt's key and the request it is
/// a retry of.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Reconcile {
    /// The key, the attempt about to run (the one whose outcome is unknown is `attempt - 1`, or
    /// earlier when several in a row were lost).
    pub key: IdempotencyKey,
    /// The request's method.
    pub method: Method,
    /// The request's target.
    pub uri: Uri,
    /// The request's headers.
    pub headers: HeaderMap,
}

/// A reconcile function's answer about a recovered attempt.
#[derive(Debug)]
pub enum Reconciled {
    /// The earlier attempt took effect, and this is what it answered (or would have answered):
    /// stored as the key's outcome and answered without running the handler.
    Happened(Response<Bytes>),
    /// The earlier attempt did not take effect: the handler runs.
    DidNotHappen,
    /// It cannot be told now (why, for the log: the client is not told): nothing runs, and the
    /// key stays in flight until this attempt's lease ends.
    Unresolved(String),
}

/// The boxed future a reconcile function returns.
pub(crate) type ReconcileFuture = Pin<Box<dyn Future<Output = Reconciled> + Send>>;

/// A reconcile function, as the layer keeps it.
pub(crate) type ReconcileFn = Arc<dyn Fn(Reconcile) -> ReconcileFuture + Send + Sync>;

impl Reconcile {
    /// What to ask about `request`, which runs as `key`.
    pub(crate) fn of<B>(request: &http::Request<B>, key: IdempotencyKey) -> Self {
        Self {
            key,
            method: request.method().clone(),
            uri: request.uri().clone(),
            headers: request.headers().clone(),
        }
    }
}
