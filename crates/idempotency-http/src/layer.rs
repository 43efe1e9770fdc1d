//! The layer and its configuration.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::header::{AUTHORIZATION, PROXY_AUTHORIZATION};
use http::request::Parts;
use http::{HeaderName, Method, StatusCode};
use idempotency_core::{FingerprintMode, Guard, JsonPointer, Scope, ScopeSecret, Store};
use tower::Layer;

use crate::config::{Config, ReconcileFn, default_is_final};
use crate::future::DetachedRuns;
use crate::service::IdempotencyService;

/// A `tower` layer that makes the wrapped service idempotent per `Idempotency-Key`.
///
/// See the [crate docs](crate) for the behaviour. Configure with the `#[must_use]` builder
/// methods; the layer is cheap to clone. Different routes can carry differently configured layers.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::{MemoryStore, ScopeSecret};
/// use idempotency_http::IdempotencyLayer;
///
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .require_key(true)
///     .max_body(64 * 1024)
///     .retention(Duration::from_secs(24 * 3600))
///     .scope_from_header(http::header::AUTHORIZATION, ScopeSecret::new("from your configuration")?)
///     .wait(Duration::from_secs(5));
/// # let _ = layer;
/// # Ok::<(), idempotency_core::SecretError>(())
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer<S> {
    guard: Guard<S>,
    config: Arc<Config>,
    detached: DetachedRuns,
}

impl<S> fmt::Debug for IdempotencyLayer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("methods", &self.config.methods)
            .field("require_key", &self.config.require_key)
            .field("max_body", &self.config.max_body)
            .field("max_response", &self.config.max_response)
            .field("buffer_streamed", &self.config.buffer_streamed)
            .field("wait", &self.config.wait)
            .field("fail_open", &self.config.fail_open)
            .finish_non_exhaustive()
    }
}

impl<S: Store + Clone> IdempotencyLayer<S> {
    /// A layer over `store`. Defaults:
    /// - POST and PATCH guarded; requests without a key pass through;
    /// - bodies and stored responses up to 1 MiB;
    /// - lease 60 s, retention 24 h;
    /// - one global scope;
    /// - fingerprint of the raw body;
    /// - [`default_is_final`];
    /// - `409` at once for a request in flight;
    /// - fail closed.
    pub fn new(store: S) -> Self {
        Self {
            guard: Guard::new(store).name("http").log_keys(crate::KeyLog::Hash),
            config: Arc::new(Config {
                methods: vec![Method::POST, Method::PATCH],
                require_key: false,
                key_header: crate::IDEMPOTENCY_KEY,
                key_from: None,
                max_body: 1 << 20,
                max_response: 1 << 20,
                buffer_streamed: false,
                scope: Arc::new(|_: &Parts| Scope::global()),
                fingerprint: FingerprintMode::Raw,
                fingerprint_headers: Vec::new(),
                is_final: Arc::new(default_is_final),
                wait: None,
                fail_open: false,
                allowed_headers: Vec::new(),
                body_budget: None,
                log_keys: crate::log::KeyLog::Hash,
                reconcile: None,
            }),
            detached: DetachedRuns::default(),
        }
    }

    /// The runs of this layer (and its clones) that finish on tasks of their own because their
    /// clients went away; a server waits for them before it exits.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotency_core::MemoryStore;
    /// use idempotency_http::IdempotencyLayer;
    /// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
    /// let layer = IdempotencyLayer::new(MemoryStore::new());
    /// let detached = layer.detached_runs();
    /// // … serve with `layer` until shutdown, then:
    /// assert!(detached.wait(Duration::from_secs(30)).await);
    /// # });
    /// ```
    #[must_use]
    pub fn detached_runs(&self) -> DetachedRuns {
        self.detached.clone()
    }

    fn with(mut self, change: impl FnOnce(&mut Config)) -> Self {
        change(Arc::make_mut(&mut self.config));
        self
    }

    /// How the key appears in the `info` event each guarded request logs
    /// ([`KeyLog::Hash`](crate::KeyLog::Hash) by default: a digest; see [`crate::log`]).
    #[must_use]
    pub fn log_keys(mut self, log: crate::KeyLog) -> Self {
        self.guard = self.guard.log_keys(log);
        self.with(|c| c.log_keys = log)
    }

    /// Names the layer in logs and metrics (default `http`): a route's name, say.
    #[must_use]
    pub fn name(mut self, name: impl Into<metrics::SharedString>) -> Self {
        self.guard = self.guard.name(name);
        self
    }

    /// Shares `other`'s body budget ([`max_buffered`](Self::max_buffered)) and its detached runs
    /// ([`detached_runs`](Self::detached_runs)): layers on several routes of one server, each
    /// configured its own way, then bound the memory of request bodies together and are waited
    /// for together at shutdown. Set `max_buffered` on `other` first; a later `max_buffered`
    /// here gives this layer a budget of its own again.
    #[must_use]
    pub fn shares_with<T>(mut self, other: &IdempotencyLayer<T>) -> Self {
        self.detached = other.detached.clone();
        let budget = other.config.body_budget.clone();
        self.with(|c| c.body_budget = budget)
    }

    /// The methods the layer guards; others pass through untouched (default POST, PATCH).
    #[must_use]
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.with(|c| c.methods = methods)
    }

    /// Whether a guarded request without a key is refused with `400` (default: passed through).
    #[must_use]
    pub fn require_key(self, required: bool) -> Self {
        self.with(|c| c.require_key = required)
    }

    /// The largest request body buffered for the fingerprint; larger ones get `413` before the
    /// handler runs (default 1 MiB).
    #[must_use]
    pub fn max_body(self, bytes: usize) -> Self {
        self.with(|c| c.max_body = bytes)
    }

    /// The largest response stored for replay; a larger or streamed response is passed through
    /// and recorded as not replayable (default 1 MiB).
    #[must_use]
    pub fn max_response(self, bytes: usize) -> Self {
        self.with(|c| c.max_response = bytes)
    }

    /// Whether a response body of unknown length (chunked, streamed) is read up to
    /// [`IdempotencyLayer::max_response`] so that it can be stored when it ends within the
    /// limit; a longer one is passed through (its first part from memory) and recorded as not
    /// replayable. Off by default: a streamed response, such as server-sent events, then starts
    /// flowing at once and is never stored. A proxy, whose upstream chunks whatever it likes,
    /// turns it on.
    #[must_use]
    pub fn buffer_streamed_responses(self, buffer: bool) -> Self {
        self.with(|c| c.buffer_streamed = buffer)
    }

    /// How long a request may run without a heartbeat before a retry may take over (default 60 s).
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.guard = self.guard.lease(lease);
        self
    }

    /// How long a stored response replays (default 24 h). Every stored response says until when
    /// in its `Idempotency-Key-Expires` header.
    #[must_use]
    pub fn retention(mut self, retention: Duration) -> Self {
        self.guard = self.guard.retention(retention);
        self
    }

    /// Derives the scope from the request (for example the authenticated principal), so that two
    /// principals using the same key never see each other's responses.
    #[must_use]
    pub fn scope(self, scope: impl Fn(&Parts) -> Scope + Send + Sync + 'static) -> Self {
        self.with(|c| c.scope = Arc::new(scope))
    }

    /// Scopes by a header's value (for example `Authorization`): the scope is an HMAC-SHA256
    /// of the value under `secret`, so neither the store nor the downstream that receives
    /// [`IdempotencyKey::message_key`](crate::IdempotencyKey::message_key) can recover a
    /// credential from it, not even a weak Basic password. Requests without the header share the
    /// global scope.
    ///
    /// What does not change the principal is normalised first: whitespace around the value,
    /// and for `Authorization` and `Proxy-Authorization` the scheme's case and the spaces after
    /// it (`bearer  T` is `Bearer T`). The credential itself is compared byte for byte, so a
    /// token refresh gives the new token a new scope: a retry must send the credential its first
    /// try sent.
    ///
    /// Every instance serving the same keys needs the same secret: from configuration, or
    /// [`ScopeSecret::kept_in`] the shared store.
    #[must_use]
    pub fn scope_from_header(self, name: HeaderName, secret: ScopeSecret) -> Self {
        self.scope(move |parts: &Parts| match parts.headers.get(&name) {
            Some(value) => secret.scope(&principal(&name, value.as_bytes())),
            None => Scope::global(),
        })
    }

    /// The header the key is read from (default `Idempotency-Key`), for clients that send
    /// theirs as another header (`X-Request-Id`, say). The value is read the same way.
    #[must_use]
    pub fn key_header(self, name: HeaderName) -> Self {
        self.with(|c| c.key_header = name)
    }

    /// Reads the key from the JSON body's member at `pointer` when the key header is absent (a
    /// `refund_id` the client sends anyway). A string member is the key, a number its decimal
    /// text; a member that is absent or `null` is no key (`400 missing-key` with
    /// [`require_key`](Self::require_key), else the request passes through unguarded). A body
    /// that is not JSON is `400 invalid-body`; a member of another type, or a string that is not
    /// a key, is `400 invalid-key`. The header wins when both are there.
    ///
    /// ```
    /// use idempotency_core::{JsonPointer, MemoryStore};
    /// use idempotency_http::IdempotencyLayer;
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).key_from(JsonPointer::new("/refund_id")?);
    /// # let _ = layer;
    /// # Ok::<(), idempotency_core::FingerprintError>(())
    /// ```
    #[must_use]
    pub fn key_from(self, pointer: JsonPointer) -> Self {
        self.with(|c| c.key_from = Some(pointer))
    }

    /// How the body enters the fingerprint (default: the raw bytes). With
    /// [`FingerprintMode::CanonicalJson`], a body that is not JSON is fingerprinted raw; with
    /// [`FingerprintMode::JsonPointers`], it is refused (`400 invalid-body`), since the members
    /// that decide a mismatch cannot be read; a member the body lacks counts as `null`.
    #[must_use]
    pub fn fingerprint(self, mode: FingerprintMode) -> Self {
        self.with(|c| c.fingerprint = mode)
    }

    /// Adds a request header to the fingerprint (method, path and query always are).
    #[must_use]
    pub fn fingerprint_header(self, name: HeaderName) -> Self {
        self.with(|c| c.fingerprint_headers.push(name))
    }

    /// Which response statuses are final (stored and replayed); the others release the key so a
    /// retry runs again (default [`default_is_final`]).
    #[must_use]
    pub fn final_status(self, is_final: impl Fn(StatusCode) -> bool + Send + Sync + 'static) -> Self {
        self.with(|c| c.is_final = Arc::new(is_final))
    }

    /// Wait mode: a request whose key is in flight waits up to `deadline` for the first one to
    /// finish and gets its replay, instead of an immediate `409`. It is answered the moment the
    /// first request's outcome is recorded when that request runs through this layer (or a
    /// clone), and reads the record again every 20 to 250 ms otherwise
    /// ([`Guard::wait_in_flight`](idempotency_core::Guard::wait_in_flight)).
    #[must_use]
    pub fn wait(self, deadline: Duration) -> Self {
        self.with(|c| c.wait = Some(deadline))
    }

    /// Bounds the memory that guarded request bodies take across all requests through this
    /// layer (and its clones) together: a request whose body would push the total past `bytes`
    /// is answered `503` [`Problem::Overloaded`](crate::Problem::Overloaded) with `Retry-After`,
    /// and nothing runs. Without it (the default), only [`max_body`](Self::max_body) bounds each
    /// body, and as many connections as the server takes may each hold that much.
    #[must_use]
    pub fn max_buffered(self, bytes: usize) -> Self {
        let permits = bytes.min(tokio::sync::Semaphore::MAX_PERMITS);
        self.with(|c| c.body_budget = Some(Arc::new(tokio::sync::Semaphore::new(permits))))
    }

    /// Fail open: when the store is unreachable, run the handler without idempotency instead of
    /// answering `503` (default: fail closed). Duplicates may then run twice.
    #[must_use]
    pub fn fail_open(self, open: bool) -> Self {
        self.with(|c| c.fail_open = open)
    }

    /// Asks `reconcile` whether an earlier attempt took effect before a recovered attempt (one
    /// that took the key over after an attempt whose outcome is unknown) runs the handler: the
    /// answer is adopted as the key's outcome, lets the handler run, or leaves the key in flight
    /// (see [`crate::reconcile`] for the contract). Without it, a recovered attempt runs the
    /// handler, which must then deduplicate by [`IdempotencyKey::message_key`](crate::IdempotencyKey::message_key).
    ///
    /// The function runs while the attempt holds the key's lease; it should give up (answer
    /// [`Reconciled::Unresolved`](crate::Reconciled::Unresolved)) well within the lease.
    ///
    /// ```
    /// use http::{Response, StatusCode};
    /// use idempotency_core::MemoryStore;
    /// use idempotency_http::{IdempotencyLayer, Reconcile, Reconciled};
    ///
    /// // The service's own ledger of the charges it made, by the key they were made under.
    /// async fn charge_made_under(key: &str) -> Result<Option<String>, std::io::Error> {
    ///     # let _ = key;
    ///     Ok(None)
    /// }
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).reconcile(|asked: Reconcile| async move {
    ///     match charge_made_under(asked.key.message_key().as_str()).await {
    ///         Ok(Some(charge)) => {
    ///             let mut answer = Response::new(charge.into());
    ///             *answer.status_mut() = StatusCode::CREATED;
    ///             Reconciled::Happened(answer)
    ///         }
    ///         Ok(None) => Reconciled::DidNotHappen,
    ///         Err(error) => Reconciled::Unresolved(error.to_string()),
    ///     }
    /// });
    /// # let _ = layer;
    /// ```
    #[must_use]
    pub fn reconcile<F, Fut>(self, reconcile: F) -> Self
    where
        F: Fn(crate::Reconcile) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = crate::Reconciled> + Send + 'static,
    {
        let reconcile: ReconcileFn = Arc::new(move |asked| Box::pin(reconcile(asked)));
        self.with(|c| c.reconcile = Some(reconcile))
    }

    /// Stores (and replays) a response header that is not stored by default: `Set-Cookie` and
    /// other credential headers are left out of replays unless allowed here. Hop-by-hop headers
    /// are never stored.
    #[must_use]
    pub fn store_header(self, name: HeaderName) -> Self {
        self.with(|c| c.allowed_headers.push(name))
    }
}

/// The part of a credential header's value that names the principal: without surrounding
/// whitespace, and for the authorization headers with the scheme lowercased and one space after
/// it. A value without a space is a credential alone (some APIs send a bare token) and keeps its
/// case: lowercasing it could give two principals one scope.
fn principal<'a>(name: &HeaderName, value: &'a [u8]) -> Cow<'a, [u8]> {
    let value = value.trim_ascii();
    if name != AUTHORIZATION && name != PROXY_AUTHORIZATION {
        return Cow::Borrowed(value);
    }
    match value.iter().position(|&b| b == b' ' || b == b'\t') {
        Some(end) => {
            let mut normal = value[..end].to_ascii_lowercase();
            normal.push(b' ');
            normal.extend_from_slice(value[end..].trim_ascii_start());
            Cow::Owned(normal)
        }
        None => Cow::Borrowed(value),
    }
}

impl<S: Store + Clone, I> Layer<I> for IdempotencyLayer<S> {
    type Service = IdempotencyService<I, S>;

    fn layer(&self, inner: I) -> Self::Service {
        IdempotencyService::new(
            inner,
            self.guard.clone(),
            Arc::clone(&self.config),
            self.detached.clone(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_principal_ignores_what_does_not_name_it() {
        let auth = |value: &[u8]| principal(&AUTHORIZATION, value).into_owned();
        assert_eq!(auth(b"Bearer abc"), b"bearer abc");
        assert_eq!(auth(b"  BEARER \t abc  "), b"bearer abc");
        assert_eq!(auth(b"basic YWxpY2U6cA=="), b"basic YWxpY2U6cA==");
        // The credential keeps its case; a bare token keeps it too.
        assert_ne!(auth(b"Bearer ABC"), auth(b"Bearer abc"));
        assert_ne!(auth(b"ABC"), auth(b"abc"));
        assert_eq!(auth(b" ABC "), b"ABC");
        let api_key = HeaderName::from_static("x-api-key");
        assert_eq!(principal(&api_key, b" Key One "), &b"Key One"[..]);
    }
}
