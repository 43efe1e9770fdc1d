//! `idem serve`: the idempotency gateway, a reverse proxy that puts the HTTP layer in front of
//! any upstream.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::header::{self, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{Method, Request, Uri};
use idempotency::{
    BeginRequest, Claim, DynStore, Fingerprint, Key, Outcome, Scope, ScopeSecret, Watched, WriteHealth,
};
use idempotency_http::{DetachedRuns, IdempotencyKey, IdempotencyLayer, Problem, strip_hop_by_hop};
use metrics_exporter_prometheus::PrometheusHandle;
use tower::Service;

use crate::error::Error;
use crate::upstream::{Failure, Upstream};
use crate::{server, units};

/// The header the upstream finds the attempt number in (1, or more after a takeover). The
/// gateway sets it on guarded requests and removes it from all others, so the upstream can
/// trust it: a client cannot forge it.
pub const IDEMPOTENCY_ATTEMPT: HeaderName = HeaderName::from_static("idempotency-attempt");

/// The prefix of the gateway's own endpoints on the main listener.
pub const ADMIN_PREFIX: &str = "/_idem";

/// Everything `idem serve` is configured with: the command line's flags (each also an `IDEM_*`
/// environment variable) are these fields, so a setting is added in one place. `Default` is the
/// command line's defaults, with an upstream on `http://127.0.0.1:3000`.
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    /// The upstream's base URL (http://host:port[/base]).
    #[arg(long, env = "IDEM_UPSTREAM", value_parser = parse_upstream)]
    pub upstream: Uri,
    /// Where the gateway listens.
    #[arg(long, env = "IDEM_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Serve /metrics and /healthz here instead of under /_idem/ on the main listener.
    #[arg(long, env = "IDEM_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// The store: sqlite://PATH, postgres://..., mysql://..., redis://..., redis-cluster://h:p,h:p, memory://
    #[arg(long, env = "IDEM_STORE", default_value = "sqlite://idem.db")]
    pub store: String,
    /// How long a request may run without a heartbeat before a retry may take over.
    #[arg(long, env = "IDEM_LEASE", default_value = "30s", value_parser = parse_lease)]
    pub lease: Duration,
    /// Do not create or upgrade the store's schema on start: refuse to start on a store that
    /// `idem migrate` has not prepared (for a role that may not run DDL, or a deployment that
    /// migrates in a step of its own).
    #[arg(long, env = "IDEM_NO_MIGRATE")]
    pub no_migrate: bool,
    /// How long a completed request's response is replayed.
    #[arg(long, env = "IDEM_RETENTION", default_value = "24h", value_parser = parse_retention)]
    pub retention: Duration,
    /// The largest request body (413 beyond it).
    #[arg(long, env = "IDEM_MAX_BODY", default_value = "1MiB", value_parser = parse_limit)]
    pub max_body: usize,
    /// The most memory all guarded request bodies may hold at once (503 beyond it, nothing
    /// runs); at least --max-body.
    #[arg(long, env = "IDEM_MAX_BUFFERED", default_value = "128MiB", value_parser = parse_limit)]
    pub max_buffered: usize,
    /// The largest response that is stored for replay (larger ones pass through, not replayable).
    #[arg(long, env = "IDEM_MAX_RESPONSE", default_value = "1MiB", value_parser = parse_limit)]
    pub max_response: usize,
    /// The guarded methods, comma-separated.
    #[arg(long, env = "IDEM_METHODS", default_value = "POST,PATCH", value_delimiter = ',', value_parser = parse_method)]
    pub methods: Vec<Method>,
    /// Answer 400 to guarded requests without an Idempotency-Key.
    #[arg(long, env = "IDEM_REQUIRE_KEY")]
    pub require_key: bool,
    /// Scope keys by a keyed hash of this header's value (for example Authorization).
    #[arg(long, env = "IDEM_SCOPE_HEADER", value_parser = parse_header_name)]
    pub scope_header: Option<HeaderName>,
    /// The secret (16 bytes or more) the scope hash is keyed with; every gateway on one store
    /// needs the same. Without it, the first gateway generates one and keeps it in the store.
    #[arg(long, env = "IDEM_SCOPE_SECRET", hide_env_values = true, value_parser = SecretParser)]
    pub scope_secret: Option<ScopeSecret>,
    /// Wait mode: a duplicate of a running request waits up to this long for its response.
    #[arg(long, env = "IDEM_WAIT", value_parser = parse_wait)]
    pub wait: Option<Duration>,
    /// Forward requests without the guard while the store is unreachable (default: 503).
    #[arg(long, env = "IDEM_FAIL_OPEN")]
    pub fail_open: bool,
    /// How long the upstream may take to answer, body included (504 after it; the outcome is
    /// unknown, so the key stays in flight until its lease ends).
    #[arg(long, env = "IDEM_UPSTREAM_TIMEOUT", default_value = "60s", value_parser = parse_upstream_timeout)]
    pub upstream_timeout: Duration,
    /// The upstream statuses that release the key, so that a retry runs again: classes (`5xx`)
    /// and codes (`429`), comma-separated, or `none`; every other answer is stored and replayed.
    /// Stripe's choice, a 5xx is final: `--release-on 408,409,425,429`.
    #[arg(long, env = "IDEM_RELEASE_ON", default_value = "1xx,3xx,5xx,408,409,425,429", value_parser = parse_status_set)]
    pub release_on: StatusSet,
    /// How long a client may take to send a request's headers (the connection is closed after).
    #[arg(long, env = "IDEM_HEADER_TIMEOUT", default_value = "10s", value_parser = parse_client_timeout)]
    pub header_timeout: Duration,
    /// How long a client may take to send a request's body (408 after it; nothing runs).
    #[arg(long, env = "IDEM_BODY_TIMEOUT", default_value = "30s", value_parser = parse_client_timeout)]
    pub body_timeout: Duration,
    /// How many client connections are served at once (more wait to be accepted).
    #[arg(long, env = "IDEM_MAX_CONNECTIONS", default_value = "512", value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_connections: u32,
    /// How often expired records are purged, in batches of 1000 (`off`: never; the store's
    /// table then grows until `idem keys purge` runs). Ignored by stores that expire records by
    /// themselves (Redis).
    #[arg(long, env = "IDEM_PURGE_EVERY", default_value = "1m", value_parser = parse_purge_every)]
    pub purge_every: PurgeEvery,
    /// How long shutdown waits for running requests; what still runs after it is abandoned to
    /// its lease, and a retry takes it over.
    #[arg(long, env = "IDEM_DRAIN_TIMEOUT", default_value = "30s", value_parser = parse_drain_timeout)]
    pub drain_timeout: Duration,
}

impl Config {
    /// The checks that involve more than one flag.
    ///
    /// # Errors
    ///
    /// [`FlagError::Conflict`] saying which flags and why.
    pub fn check(&self) -> Result<(), FlagError> {
        if self.max_buffered < self.max_body {
            return Err(FlagError::Conflict(
                "--max-buffered is smaller than --max-body: a body of the largest size allowed could never be buffered",
            ));
        }
        Ok(())
    }
}

impl Default for Config {
    /// The defaults clap holds for the flags (nothing is written twice), read without the
    /// `IDEM_*` environment, with an upstream on `http://127.0.0.1:3000`.
    fn default() -> Self {
        use clap::{Args, FromArgMatches};
        let command = Self::augment_args(clap::Command::new("idem serve")).mut_args(|arg| arg.env(None));
        command
            .try_get_matches_from(["idem serve", "--upstream", "http://127.0.0.1:3000"])
            .and_then(|matches| Self::from_arg_matches(&matches))
            .expect("the flags' defaults parse (tested)")
    }
}

/// Why an upstream URL is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UpstreamError {
    /// Not a URL at all.
    #[error("`{text}` is not a URL: {reason}")]
    NotAUrl {
        /// What was given.
        text: String,
        /// The URI parser's message (its error type is not `Clone`).
        reason: String,
    },
    /// An `https://` upstream.
    #[error("`{0}`: https upstreams are not supported; reach the upstream over http on a private network")]
    Https(String),
    /// Any scheme but `http://`.
    #[error("`{0}`: the upstream must be an http:// URL")]
    NotHttp(String),
    /// No host.
    #[error("`{0}`: the upstream URL has no host")]
    NoHost(String),
    /// A query string.
    #[error("`{0}`: the upstream URL must not have a query")]
    Query(String),
}

/// Checks an upstream URL: `http://host[:port][/base]`, no query.
///
/// # Errors
///
/// An [`UpstreamError`] that says what is wrong.
pub fn parse_upstream(text: &str) -> Result<Uri, UpstreamError> {
    let uri: Uri = text
        .parse()
        .map_err(|e: http::uri::InvalidUri| UpstreamError::NotAUrl {
            text: text.into(),
            reason: e.to_string(),
        })?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => return Err(UpstreamError::Https(text.into())),
        _ => return Err(UpstreamError::NotHttp(text.into())),
    }
    if uri.authority().is_none() {
        return Err(UpstreamError::NoHost(text.into()));
    }
    if uri.query().is_some() {
        return Err(UpstreamError::Query(text.into()));
    }
    Ok(uri)
}

/// A flag value that is not an HTTP method or header name the gateway accepts, or a duration or
/// size outside what makes sense for its setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FlagError {
    /// Not a duration or a size at all.
    #[error(transparent)]
    Unit(#[from] units::UnitError),
    /// A duration or size outside its setting's range.
    #[error("`{text}` is out of range for {setting}: {why}")]
    OutOfRange {
        /// What was given.
        text: String,
        /// The setting.
        setting: &'static str,
        /// The range, and what goes wrong outside it.
        why: &'static str,
    },
    /// Not one of the standard methods.
    #[error("`{0}` is not an HTTP method (GET, POST, PUT, PATCH, DELETE, ...)")]
    Method(String),
    /// Not a valid header name.
    #[error("`{0}` is not a header name")]
    HeaderName(String),
    /// Not a status class (`5xx`) or code (`429`).
    #[error("`{0}` is not an HTTP status (100 to 599) or class (1xx to 5xx)")]
    Status(String),
    /// Flags that contradict each other.
    #[error("{0}")]
    Conflict(&'static str),
    /// A scope secret that is too short (the value itself is never echoed).
    #[error("--scope-secret: {0}")]
    ScopeSecret(#[from] idempotency::SecretError),
}

/// `--scope-secret`: 16 bytes or more.
///
/// # Errors
///
/// [`FlagError::ScopeSecret`], which does not repeat the value.
pub fn parse_scope_secret(text: &str) -> Result<ScopeSecret, FlagError> {
    Ok(ScopeSecret::new(text.as_bytes())?)
}

/// Parses `--scope-secret` with [`parse_scope_secret`]. A plain `value_parser` function's
/// error would make clap print "invalid value '`<the secret>`'": this one's error names the flag
/// and the reason only.
#[derive(Debug, Clone, Copy)]
struct SecretParser;

impl clap::builder::TypedValueParser for SecretParser {
    type Value = ScopeSecret;

    fn parse_ref(
        &self,
        _command: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<ScopeSecret, clap::Error> {
        let refuse =
            |why: String| clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("{why}\n"));
        let text = value
            .to_str()
            .ok_or_else(|| refuse("--scope-secret: not valid UTF-8".into()))?;
        parse_scope_secret(text).map_err(|e| refuse(e.to_string()))
    }
}

/// A set of HTTP statuses, as `--release-on` takes it: classes (`5xx`) and single codes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StatusSet {
    /// Whole classes, by their first digit.
    classes: Vec<u16>,
    /// Single codes.
    codes: Vec<u16>,
}

impl StatusSet {
    /// Whether `status` is in the set.
    #[must_use]
    pub fn contains(&self, status: http::StatusCode) -> bool {
        let code = status.as_u16();
        self.classes.contains(&(code / 100)) || self.codes.contains(&code)
    }
}

/// Parses `--release-on`: `none`, or a comma-separated list of classes (`1xx` to `5xx`) and
/// codes (100 to 599).
///
/// # Errors
///
/// [`FlagError::Status`] naming the item that is neither.
pub fn parse_status_set(text: &str) -> Result<StatusSet, FlagError> {
    let mut set = StatusSet::default();
    if text.trim().eq_ignore_ascii_case("none") {
        return Ok(set);
    }
    for item in text.split(',').map(str::trim) {
        let bad = || FlagError::Status(item.to_owned());
        let lower = item.to_ascii_lowercase();
        if let Some(class) = lower.strip_suffix("xx") {
            match class.parse::<u16>() {
                Ok(class @ 1..=5) if lower.len() == 3 => set.classes.push(class),
                _ => return Err(bad()),
            }
        } else {
            match item.parse::<u16>() {
                Ok(code @ 100..=599) if item.len() == 3 => set.codes.push(code),
                _ => return Err(bad()),
            }
        }
    }
    Ok(set)
}

/// A duration flag within `[min, max]`.
pub(crate) fn bounded_duration(
    text: &str,
    setting: &'static str,
    (min, max): (Duration, Duration),
    why: &'static str,
) -> Result<Duration, FlagError> {
    let duration = units::parse_duration(text)?;
    if duration < min || duration > max {
        return Err(FlagError::OutOfRange {
            text: text.into(),
            setting,
            why,
        });
    }
    Ok(duration)
}

/// `--lease`: 1 s to 24 h. A zero lease lets a concurrent duplicate take a running request over
/// and run it again; a longer one than a day leaves a crashed request's key blocked for as long.
///
/// # Errors
///
/// [`FlagError`] saying why.
pub fn parse_lease(text: &str) -> Result<Duration, FlagError> {
    let range = (Duration::from_secs(1), Duration::from_secs(86_400));
    bounded_duration(
        text,
        "--lease",
        range,
        "from 1s to 24h (a shorter lease lets a duplicate run while the first still runs)",
    )
}

/// `--retention`: 1 s to 3650 days. Zero would replay nothing: every retry would run again.
///
/// # Errors
///
/// [`FlagError`] saying why.
pub fn parse_retention(text: &str) -> Result<Duration, FlagError> {
    let range = (Duration::from_secs(1), Duration::from_secs(3650 * 86_400));
    bounded_duration(
        text,
        "--retention",
        range,
        "from 1s to 3650d (with none, every retry runs again)",
    )
}

/// `--upstream-timeout`: 100 ms to 24 h. Zero would answer 504 while the upstream runs.
///
/// # Errors
///
/// [`FlagError`] saying why.
pub fn parse_upstream_timeout(text: &str) -> Result<Duration, FlagError> {
    let range = (Duration::from_millis(100), Duration::from_secs(86_400));
    bounded_duration(text, "--upstream-timeout", range, "from 100ms to 24h")
}

/// `--header-timeout` and `--body-timeout`: 100 ms to 1 h. Without a bound, a client that
/// never finishes its request holds its connection forever.
///
/// # Errors
///
/// [`FlagError`] saying why.
pub fn parse_client_timeout(text: &str) -> Result<Duration, FlagError> {
    let range = (Duration::from_millis(100), Duration::from_secs(3600));
    bounded_duration(text, "a client timeout", range, "from 100ms to 1h")
}

/// `--drain-timeout`: 0 s to 1 h (zero: exit at once on shutdown, abandoning what runs).
///
/// # Errors
///
/// [`FlagError`] saying why.
pub fn parse_drain_timeout(text: &str) -> Result<Duration, FlagError> {
    let range = (Duration::ZERO, Duration::from_secs(3600));
    bounded_duration(text, "--drain-timeout", range, "from 0s to 1h")
}

/// `--purge-every`: an interval, or never.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PurgeEvery(pub Option<Duration>);

/// `--purge-every`: `off`, or 1 s to 24 h.
///
/// # Errors
///
/// [`FlagError`] saying why.
pub fn parse_purge_every(text: &str) -> Result<PurgeEvery, FlagError> {
    if text.trim().eq_ignore_ascii_case("off") {
        return Ok(PurgeEvery(None));
    }
    let range = (Duration::from_secs(1), Duration::from_secs(86_400));
    bounded_duration(text, "--purge-every", range, "from 1s to 24h, or off")
        .map(|every| PurgeEvery(Some(every)))
}

/// `--wait`: 1 ms to 1 h.
///
/// # Errors
///
/// [`FlagError`] saying why.
pub fn parse_wait(text: &str) -> Result<Duration, FlagError> {
    let range = (Duration::from_millis(1), Duration::from_secs(3600));
    bounded_duration(text, "--wait", range, "from 1ms to 1h")
}

/// `--max-body` and `--max-response`: 1 byte to 1 GiB (bodies are held in memory).
///
/// # Errors
///
/// [`FlagError`] saying why.
pub fn parse_limit(text: &str) -> Result<usize, FlagError> {
    let size = units::parse_size(text)?;
    if size == 0 || size > 1 << 30 {
        return Err(FlagError::OutOfRange {
            text: text.into(),
            setting: "a size limit",
            why: "from 1B to 1GiB (bodies are held in memory)",
        });
    }
    Ok(size)
}

/// A standard HTTP method, in any case.
///
/// # Errors
///
/// [`FlagError::Method`] for anything else.
pub fn parse_method(text: &str) -> Result<Method, FlagError> {
    let upper = text.trim().to_ascii_uppercase();
    match upper.as_str() {
        "GET" | "HEAD" | "POST" | "PUT" | "PATCH" | "DELETE" | "OPTIONS" => {
            Method::from_bytes(upper.as_bytes()).map_err(|_| FlagError::Method(text.into()))
        }
        _ => Err(FlagError::Method(text.into())),
    }
}

/// A header name.
///
/// # Errors
///
/// [`FlagError::HeaderName`] when it is not one.
pub fn parse_header_name(text: &str) -> Result<HeaderName, FlagError> {
    HeaderName::from_bytes(text.trim().as_bytes()).map_err(|_| FlagError::HeaderName(text.into()))
}

/// A problem document, as the layer writes its own.
fn problem(problem: &Problem) -> Response {
    problem.to_response().map(Body::from)
}

/// The path with its `.` and `..` segments resolved (RFC 3986 §5.2.4), percent-encoded ones
/// (`%2e%2e`) included, so that a request target can never climb above the upstream's base path:
/// `..` at the root stays at the root.
fn remove_dot_segments(path: &str) -> String {
    let is = |segment: &str, dots: usize| {
        let decoded = segment.to_ascii_lowercase().replace("%2e", ".");
        decoded.len() == dots && decoded.bytes().all(|b| b == b'.')
    };
    let mut kept: Vec<&str> = Vec::new();
    let segments: Vec<&str> = path.split('/').skip(1).collect();
    let last = segments.len().saturating_sub(1);
    let mut trailing_slash = false;
    for (i, segment) in segments.iter().enumerate() {
        if is(segment, 1) {
            trailing_slash = i == last;
        } else if is(segment, 2) {
            kept.pop();
            trailing_slash = i == last;
        } else {
            kept.push(segment);
            trailing_slash = false;
        }
    }
    let mut out = format!("/{}", kept.join("/"));
    if trailing_slash && !out.ends_with('/') {
        out.push('/');
    }
    out
}

/// Whether `path` may hold a `.` or `..` segment, written plainly or percent-encoded: any `.`,
/// or any `%2e` in either case. A `false` is certain; a `true` only sends the path through
/// [`remove_dot_segments`].
fn may_have_dot_segments(path: &str) -> bool {
    path.contains('.')
        || path
            .as_bytes()
            .windows(3)
            .any(|w| w[0] == b'%' && w[1] == b'2' && w[2].eq_ignore_ascii_case(&b'e'))
}

/// The proxy behind the layer: forwards a request to the upstream and brings the response back.
#[derive(Clone)]
pub struct Proxy {
    connections: Upstream,
    upstream: Uri,
    timeout: Duration,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("upstream", &self.upstream)
            .finish_non_exhaustive()
    }
}

impl Proxy {
    /// A proxy to `upstream`.
    #[must_use]
    pub fn new(upstream: Uri, timeout: Duration) -> Self {
        Self {
            connections: Upstream::new(&upstream),
            upstream,
            timeout,
        }
    }

    /// The path and query the upstream gets: the request's, behind the upstream's base path,
    /// dot segments resolved.
    fn target(&self, uri: &Uri) -> Result<PathAndQuery, http::Error> {
        let base = self.upstream.path().trim_end_matches('/');
        let path = uri.path();
        match uri.path_and_query() {
            // Nothing to resolve and no base path to put in front: the request's own path and
            // query, shared rather than parsed again (building the target cost a twentieth of
            // the gateway's instructions per request).
            Some(own) if base.is_empty() && path.starts_with('/') && !may_have_dot_segments(path) => {
                Ok(own.clone())
            }
            _ => {
                let path = remove_dot_segments(path);
                let path = match uri.query() {
                    Some(query) => format!("{base}{path}?{query}"),
                    None => format!("{base}{path}"),
                };
                Ok(PathAndQuery::try_from(path)?)
            }
        }
    }

    async fn forward(self, mut request: Request<Body>) -> Response {
        let key = request.extensions().get::<IdempotencyKey>().cloned();
        let target = match self.target(request.uri()) {
            Ok(target) => target,
            Err(why) => {
                return problem(&Problem::BadTarget(why.to_string()));
            }
        };
        // Origin form: the connection is to the upstream already, and `Upstream` sets `Host`.
        *request.uri_mut() = Uri::from(target);
        let headers = request.headers_mut();
        strip_hop_by_hop(headers);
        // Only the gateway says which attempt this is: a client's own value never reaches the
        // upstream, on guarded requests and on the others alike.
        headers.remove(IDEMPOTENCY_ATTEMPT);
        if let Some(host) = headers.remove(header::HOST) {
            headers.insert("x-forwarded-host", host);
        }
        if let Some(key) = &key {
            // The scoped key: the upstream can pass it on to its own downstream calls.
            if let Ok(value) = HeaderValue::from_str(key.message_key().as_str()) {
                headers.insert(idempotency_http::IDEMPOTENCY_KEY, value);
            }
            headers.insert(IDEMPOTENCY_ATTEMPT, HeaderValue::from(key.attempt));
        }
        // The timeout covers the whole response, its body included.
        let deadline = Box::pin(tokio::time::sleep(self.timeout));
        let response = match self.connections.send(request, deadline).await {
            Err(Failure::TimedOut) => {
                metrics::counter!("idem_upstream_errors_total", "kind" => "timeout").increment(1);
                tracing::warn!(upstream = %self.upstream, "upstream timed out; the outcome is unknown");
                return problem(&Problem::UpstreamTimeout);
            }
            // Only a failure to connect proves that nothing was sent: the key may be released.
            Err(Failure::Unreachable(error)) => {
                metrics::counter!("idem_upstream_errors_total", "kind" => "unreachable").increment(1);
                tracing::warn!(%error, upstream = %self.upstream, "upstream unreachable");
                return problem(&Problem::UpstreamUnreachable);
            }
            // Anything else happened after the request (or part of it) was sent.
            Err(Failure::AnswerLost(error)) => {
                metrics::counter!("idem_upstream_errors_total", "kind" => "answer_lost").increment(1);
                tracing::warn!(%error, upstream = %self.upstream, "upstream answer lost; the outcome is unknown");
                return problem(&Problem::UpstreamAnswerLost);
            }
            Ok(response) => response,
        };
        let (mut parts, body) = response.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        Response::from_parts(parts, Body::new(body))
    }
}

impl Service<Request<Body>> for Proxy {
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let proxy = self.clone();
        Box::pin(async move { Ok(proxy.forward(request).await) })
    }
}

/// What the admin endpoints (`/healthz`, `/metrics`) answer from.
#[derive(Clone)]
pub(crate) struct Admin {
    store: DynStore,
    /// The store's kind (its URL scheme): enough for an operator, and no credential can be in it.
    store_kind: String,
    /// The results of the guarded requests' store writes.
    health: WriteHealth,
    metrics: PrometheusHandle,
}

impl Admin {
    /// The admin state of the store opened from `url`.
    pub(crate) fn new(store: DynStore, url: &str, health: WriteHealth, metrics: PrometheusHandle) -> Self {
        Self {
            store,
            store_kind: idempotency::registry()
                .kind(url)
                .map_or("unknown", |kind| kind.name)
                .to_owned(),
            health,
            metrics,
        }
    }
}

/// One write of a throwaway record (kept for a second), through the watched store: when writes
/// failed last, a health check tries one, so that a gateway a load balancer took out of
/// rotation (and that no request reaches) still notices when the store recovers.
async fn probe_write(store: &DynStore) -> Result<(), idempotency::StoreError> {
    let (scope, _) = ScopeSecret::record();
    let request = BeginRequest::new(scope, Key::generate(), Fingerprint::of_bytes(b"healthz"))
        .lease(Duration::from_secs(1))
        .retention(Duration::from_secs(1));
    match store.begin(&request).await? {
        Claim::Acquired(held) => store
            .complete(&held, Outcome::from(&b""[..]), Duration::from_secs(1))
            .await
            .map(drop),
        other => Err(idempotency::StoreError::new(
            idempotency::ErrorKind::Protocol,
            format!("a fresh key was not acquired: {other:?}"),
        )),
    }
}

/// `200` when the store answers a read and its writes work: the last guarded request's write
/// worked, or, when it failed, a probe write works now. `503` with what failed otherwise.
async fn healthz(State(admin): State<Admin>) -> Response {
    let probe = async {
        if let Some(failure) = admin.health.failure() {
            probe_write(&admin.store)
                .await
                .map_err(|now| format!("{failure}; a probe write failed too: {now}"))?;
        }
        let scope = Scope::new("idem-healthz").map_err(|e| e.to_string())?;
        let key = Key::new("probe").map_err(|e| e.to_string())?;
        admin.store.get(&scope, &key).await.map_err(|e| e.to_string())
    };
    match tokio::time::timeout(Duration::from_secs(2), probe).await {
        Ok(Ok(_)) => {
            axum::Json(serde_json::json!({ "status": "ok", "store": admin.store_kind })).into_response()
        }
        Ok(Err(why)) => Problem::StoreUnavailable
            .to_response_with_detail(&why)
            .map(Body::from),
        Err(_) => Problem::StoreUnavailable
            .to_response_with_detail("the store did not answer within 2s")
            .map(Body::from),
    }
}

async fn metrics_text(State(admin): State<Admin>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        admin.metrics.render(),
    )
        .into_response()
}

pub(crate) fn admin_router(admin: Admin, prefix: &str) -> Router {
    Router::new()
        .route(&format!("{prefix}/healthz"), get(healthz))
        .route(&format!("{prefix}/metrics"), get(metrics_text))
        .with_state(admin)
}

/// The gateway's routers and the handle on its layer's detached runs.
#[derive(Debug)]
pub struct Routers {
    /// The layer around the proxy, with the admin endpoints under [`ADMIN_PREFIX`] unless they
    /// have a listener of their own.
    pub main: Router,
    /// The admin endpoints, when `admin_listen` gives them a listener of their own.
    pub admin: Option<Router>,
    /// The guarded runs whose clients went away, finishing on tasks of their own: the gateway
    /// waits for them before it exits.
    pub detached: DetachedRuns,
}

/// The gateway's routers: the layer around the proxy, and the admin endpoints.
pub fn router(config: &Config, store: DynStore, metrics: PrometheusHandle) -> Routers {
    let watched = Watched::new(store);
    let health = watched.health();
    let store: DynStore = std::sync::Arc::new(watched);
    let mut layer = IdempotencyLayer::new(store.clone())
        .name("gateway")
        .methods(config.methods.iter().cloned())
        .require_key(config.require_key)
        .max_body(config.max_body)
        .max_buffered(config.max_buffered)
        .max_response(config.max_response)
        // The upstream chunks as it likes: store what ends within the limit all the same.
        .buffer_streamed_responses(true)
        .lease(config.lease)
        .retention(config.retention)
        .fail_open(config.fail_open);
    if let Some(name) = &config.scope_header {
        // `serve` fills the secret in from the store when the flag is absent; a router built
        // without one (a test) gets a fresh secret of its own.
        let secret = config.scope_secret.clone().unwrap_or_else(ScopeSecret::generate);
        layer = layer.scope_from_header(name.clone(), secret);
    }
    let release_on = config.release_on.clone();
    layer = layer.final_status(move |status| !release_on.contains(status));
    if let Some(deadline) = config.wait {
        layer = layer.wait(deadline);
    }
    let detached = layer.detached_runs();
    let body_timeout = config.body_timeout;
    let proxy = tower::ServiceBuilder::new()
        .map_request(move |request: Request<Body>| {
            request.map(|body| Body::new(server::BodyDeadline::new(body, body_timeout)))
        })
        .layer(layer)
        .service(Proxy::new(config.upstream.clone(), config.upstream_timeout));
    let admin = Admin::new(store, &config.store, health, metrics);
    let main = Router::new().fallback_service(proxy);
    let (main, admin) = match config.admin_listen {
        Some(_) => (main, Some(admin_router(admin, ""))),
        None => (main.merge(admin_router(admin, ADMIN_PREFIX)), None),
    };
    Routers {
        main,
        admin,
        detached,
    }
}

/// A listener on `addr`.
///
/// # Errors
///
/// [`Error::Listen`] when it cannot be bound.
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, Error> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Listen {
            addr: addr.to_string(),
            source,
        })
}

/// Runs the gateway until `shutdown`, then stops accepting, lets in-flight requests finish
/// (their outcomes recorded), and returns.
///
/// # Errors
///
/// The store cannot be opened, or a listener cannot be bound.
pub async fn serve(
    mut config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(Error::Metrics)?;
    let access = if config.no_migrate {
        idempotency::Access::Existing
    } else {
        idempotency::Access::Create
    };
    let store = idempotency::open_with(&config.store, access)
        .await
        .map_err(|e| Error::open(&config.store, e))?;
    if config.scope_header.is_some() && config.scope_secret.is_none() {
        let secret = ScopeSecret::kept_in(&*store)
            .await
            .map_err(|e| Error::open(&config.store, e))?;
        config.scope_secret = Some(secret);
    }
    let listener = bind(config.listen).await?;
    // Expired records are deleted in the background, so the table does not grow without bound.
    let purging = config.purge_every.0.map(|every| {
        tokio::spawn(
            idempotency::Purger::new(store.clone())
                .every(every)
                .batch(1000)
                .run(),
        )
    });
    let Routers {
        main,
        admin,
        detached,
    } = router(&config, store, metrics);
    let shutdown = futures_util::FutureExt::shared(Box::pin(shutdown));
    let limits = server::Limits {
        header_timeout: config.header_timeout,
        max_connections: config.max_connections as usize,
        drain_timeout: config.drain_timeout,
    };
    if let (Some(addr), Some(admin)) = (config.admin_listen, admin) {
        let admin_listener = bind(addr).await?;
        let stop = shutdown.clone();
        tokio::spawn(server::serve(
            admin_listener,
            admin,
            limits,
            DetachedRuns::default(),
            stop,
        ));
    }
    tracing::info!(
        listen = %config.listen,
        upstream = %config.upstream,
        store = %idempotency::redact_url(&config.store),
        "idem gateway ready"
    );
    if server::serve(listener, main, limits, detached, shutdown).await {
        tracing::info!("drained; in-flight requests finished and recorded");
    }
    if let Some(purging) = purging {
        purging.abort();
    }
    Ok(())
}

#[cfg(test)]
mod config_tests {
    use super::*;

    #[test]
    fn the_default_is_the_flags_defaults_whatever_the_environment() {
        let config = Config::default();
        assert_eq!(config.listen, SocketAddr::from(([127, 0, 0, 1], 8080)));
        assert_eq!(config.store, "sqlite://idem.db");
        assert_eq!(config.lease, Duration::from_secs(30));
        assert_eq!(config.retention, Duration::from_secs(86_400));
        assert_eq!((config.max_body, config.max_response), (1 << 20, 1 << 20));
        assert_eq!(config.methods, vec![Method::POST, Method::PATCH]);
        assert_eq!(config.upstream_timeout, Duration::from_secs(60));
        assert!(!config.require_key && !config.fail_open);
        assert!(config.scope_header.is_none() && config.wait.is_none() && config.admin_listen.is_none());
        assert_eq!(config.upstream, "http://127.0.0.1:3000");
    }

    #[test]
    fn upstreams_and_flags_are_refused_with_the_reason() {
        assert_eq!(
            parse_upstream("https://a").unwrap_err().to_string(),
            "`https://a`: https upstreams are not supported; reach the upstream over http on a private network"
        );
        assert!(matches!(
            parse_upstream("http://a/?q=1"),
            Err(UpstreamError::Query(_))
        ));
        assert!(matches!(
            parse_upstream("ftp://a"),
            Err(UpstreamError::NotHttp(_))
        ));
        assert!(matches!(
            parse_upstream("not a url"),
            Err(UpstreamError::NotAUrl { .. })
        ));
        assert_eq!(parse_method("patch"), Ok(Method::PATCH));
        assert!(parse_method("FETCH").is_err());
        assert!(parse_header_name("bad header").is_err());
    }

    #[test]
    fn release_on_takes_classes_codes_or_none() {
        use http::StatusCode;
        let default = Config::default().release_on;
        for (code, released) in [(500, true), (503, true), (429, true), (408, true), (302, true)] {
            assert_eq!(
                default.contains(StatusCode::from_u16(code).unwrap()),
                released,
                "{code}"
            );
        }
        for code in [200, 201, 400, 404, 422] {
            assert!(!default.contains(StatusCode::from_u16(code).unwrap()), "{code}");
        }
        let stripe = parse_status_set("408, 409,425,429").unwrap();
        assert!(!stripe.contains(StatusCode::INTERNAL_SERVER_ERROR));
        assert!(stripe.contains(StatusCode::TOO_MANY_REQUESTS));
        assert!(
            !parse_status_set("none")
                .unwrap()
                .contains(StatusCode::BAD_GATEWAY)
        );
        for bad in ["", "6xx", "0xx", "55xx", "5x", "99", "600", "abc", "429,", "4290"] {
            assert_eq!(
                parse_status_set(bad),
                Err(FlagError::Status(
                    bad.rsplit(',').next().unwrap().trim().to_owned()
                )),
                "{bad}"
            );
        }
    }
}

#[cfg(test)]
mod target_tests {
    use super::*;

    /// The target as it is built without the shortcut: dot segments resolved, the base path in
    /// front, the query kept.
    fn resolved(upstream: &str, uri: &Uri) -> String {
        let upstream: Uri = upstream.parse().unwrap();
        let base = upstream.path().trim_end_matches('/');
        let path = remove_dot_segments(uri.path());
        let query = uri.query().map(|q| format!("?{q}")).unwrap_or_default();
        format!("{base}{path}{query}")
    }

    #[test]
    fn the_shortcut_builds_the_same_target_as_resolving() {
        let paths = [
            "/",
            "/payments",
            "/payments?amount=10&x=%2F",
            "/a/",
            "/a//b",
            "//a",
            "/%41b",
            "/v1/orders/42/capture?retry=1",
            "/a/./b",
            "/a/../../b",
            "/a/%2E%2e/b",
            "/a/%2e/b?q=..",
            "/file.json",
            "*",
        ];
        for upstream in [
            "http://127.0.0.1:9000",
            "http://127.0.0.1:9000/",
            "http://up:81/base/",
        ] {
            let proxy = Proxy::new(upstream.parse().unwrap(), Duration::from_secs(1));
            for path in paths {
                let uri: Uri = path.parse().unwrap();
                assert_eq!(
                    proxy.target(&uri).unwrap().to_string(),
                    resolved(upstream, &uri),
                    "{upstream} + {path}"
                );
            }
        }
    }

    #[test]
    fn dot_segments_are_suspected_in_any_spelling() {
        for path in [
            "/a/./b",
            "/a/../b",
            "/a/%2e%2e/b",
            "/a/%2E/b",
            "/a/%2e%2E",
            "/x.json",
        ] {
            assert!(may_have_dot_segments(path), "{path}");
        }
        for path in ["/", "/payments", "/a/%2f/b", "/%e2%82%ac", "/%2"] {
            assert!(!may_have_dot_segments(path), "{path}");
        }
    }
}
