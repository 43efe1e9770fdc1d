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
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, StatusCode, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idempotency::{DynStore, Key, Scope};
use idempotency_http::{IdempotencyKey, IdempotencyLayer};
use metrics_exporter_prometheus::PrometheusHandle;
use tower::Service;

/// The header the upstream finds the attempt number in (1, or more after a takeover).
pub const IDEMPOTENCY_ATTEMPT: HeaderName = HeaderName::from_static("idempotency-attempt");

/// The prefix of the gateway's own endpoints on the main listener.
pub const ADMIN_PREFIX: &str = "/_idem";

/// Everything `idem serve` is configured with.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where the gateway listens.
    pub listen: SocketAddr,
    /// Where `/metrics` and `/healthz` are served instead of under [`ADMIN_PREFIX`].
    pub admin_listen: Option<SocketAddr>,
    /// The upstream's base URL (`http://host:port[/base]`).
    pub upstream: Uri,
    /// The store URL.
    pub store: String,
    /// The lease of a running request.
    pub lease: Duration,
    /// How long a completed key replays.
    pub retention: Duration,
    /// The request body limit.
    pub max_body: usize,
    /// The stored response limit.
    pub max_response: usize,
    /// The guarded methods.
    pub methods: Vec<Method>,
    /// Whether guarded requests must carry a key.
    pub require_key: bool,
    /// The header whose value (hashed) scopes keys.
    pub scope_header: Option<HeaderName>,
    /// Wait mode's deadline.
    pub wait: Option<Duration>,
    /// Run requests without the guard when the store is down.
    pub fail_open: bool,
    /// How long the upstream may take to answer.
    pub upstream_timeout: Duration,
}

/// Checks an upstream URL: `http://host[:port][/base]`, no query.
///
/// # Errors
///
/// What is wrong, for the user.
pub fn parse_upstream(text: &str) -> Result<Uri, String> {
    let uri: Uri = text.parse().map_err(|e| format!("`{text}` is not a URL: {e}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(format!(
                "`{text}`: https upstreams are not supported; reach the upstream over http on a private network"
            ));
        }
        _ => return Err(format!("`{text}`: the upstream must be an http:// URL")),
    }
    if uri.authority().is_none() {
        return Err(format!("`{text}`: the upstream URL has no host"));
    }
    if uri.query().is_some() {
        return Err(format!("`{text}`: the upstream URL must not have a query"));
    }
    Ok(uri)
}

/// A problem document of the gateway's own (the layer's are in `idempotency_http::Problem`).
fn problem(status: StatusCode, kind: &str, title: &str, detail: &str) -> Response {
    let body = serde_json::json!({
        "type": format!("urn:idempotency:problem:{kind}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1).
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

/// The proxy behind the layer: forwards a request to the upstream and brings the response back.
#[derive(Clone)]
pub struct Proxy {
    client: Client<HttpConnector, Body>,
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
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            upstream,
            timeout,
        }
    }

    fn target(&self, uri: &Uri) -> Result<Uri, String> {
        let base = self.upstream.path().trim_end_matches('/');
        let path = uri.path_and_query().map_or("/", |p| p.as_str());
        Uri::builder()
            .scheme("http")
            .authority(self.upstream.authority().map_or("", |a| a.as_str()))
            .path_and_query(format!("{base}{path}"))
            .build()
            .map_err(|e| e.to_string())
    }

    async fn forward(self, mut request: Request<Body>) -> Response {
        let key = request.extensions().get::<IdempotencyKey>().cloned();
        let target = match self.target(request.uri()) {
            Ok(target) => target,
            Err(why) => return problem(StatusCode::BAD_REQUEST, "bad-target", "Bad request target", &why),
        };
        *request.uri_mut() = target;
        let headers = request.headers_mut();
        strip_hop_by_hop(headers);
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
        let response = match tokio::time::timeout(self.timeout, self.client.request(request)).await {
            Err(_) => {
                metrics::counter!("idem_upstream_errors_total", "kind" => "timeout").increment(1);
                return problem(
                    StatusCode::GATEWAY_TIMEOUT,
                    "upstream-timeout",
                    "Upstream timed out",
                    "The upstream did not answer in time; the key was released and the request may be retried.",
                );
            }
            Ok(Err(error)) => {
                metrics::counter!("idem_upstream_errors_total", "kind" => "unreachable").increment(1);
                tracing::warn!(%error, upstream = %self.upstream, "upstream unreachable");
                return problem(
                    StatusCode::BAD_GATEWAY,
                    "upstream-unreachable",
                    "Upstream unreachable",
                    "The upstream could not be reached; the key was released and the request may be retried.",
                );
            }
            Ok(Ok(response)) => response,
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

#[derive(Clone)]
struct Admin {
    store: DynStore,
    store_url: String,
    metrics: PrometheusHandle,
}

async fn healthz(State(admin): State<Admin>) -> Response {
    let probe = async {
        let scope = Scope::new("idem-healthz").map_err(|e| e.to_string())?;
        let key = Key::new("probe").map_err(|e| e.to_string())?;
        admin.store.get(&scope, &key).await.map_err(|e| e.to_string())
    };
    match tokio::time::timeout(Duration::from_secs(2), probe).await {
        Ok(Ok(_)) => {
            axum::Json(serde_json::json!({ "status": "ok", "store": admin.store_url })).into_response()
        }
        Ok(Err(why)) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "store-unavailable",
            "Store unavailable",
            &why,
        ),
        Err(_) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "store-unavailable",
            "Store unavailable",
            "the store did not answer within 2s",
        ),
    }
}

async fn metrics_text(State(admin): State<Admin>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        admin.metrics.render(),
    )
        .into_response()
}

fn admin_router(admin: Admin, prefix: &str) -> Router {
    Router::new()
        .route(&format!("{prefix}/healthz"), get(healthz))
        .route(&format!("{prefix}/metrics"), get(metrics_text))
        .with_state(admin)
}

/// The gateway's router: the layer around the proxy, and the admin endpoints under
/// [`ADMIN_PREFIX`] unless they have a listener of their own.
pub fn router(config: &Config, store: DynStore, metrics: PrometheusHandle) -> (Router, Option<Router>) {
    let mut layer = IdempotencyLayer::new(store.clone())
        .name("gateway")
        .methods(config.methods.iter().cloned())
        .require_key(config.require_key)
        .max_body(config.max_body)
        .max_response(config.max_response)
        // The upstream chunks as it likes: store what ends within the limit all the same.
        .buffer_streamed_responses(true)
        .lease(config.lease)
        .retention(config.retention)
        .fail_open(config.fail_open);
    if let Some(name) = &config.scope_header {
        layer = layer.scope_from_header(name.clone());
    }
    if let Some(deadline) = config.wait {
        layer = layer.wait(deadline);
    }
    let proxy = tower::ServiceBuilder::new()
        .layer(layer)
        .service(Proxy::new(config.upstream.clone(), config.upstream_timeout));
    let admin = Admin {
        store,
        store_url: idempotency::redact_url(&config.store),
        metrics,
    };
    let main = Router::new().fallback_service(proxy);
    match config.admin_listen {
        Some(_) => (main, Some(admin_router(admin, ""))),
        None => (main.merge(admin_router(admin, ADMIN_PREFIX)), None),
    }
}

/// Runs the gateway until `shutdown`, then stops accepting, lets in-flight requests finish
/// (their outcomes recorded), and returns.
///
/// # Errors
///
/// The store cannot be opened, or a listener cannot be bound.
pub async fn serve(
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| format!("metrics: {e}"))?;
    let store = idempotency::open(&config.store)
        .await
        .map_err(|e| format!("store {}: {e}", idempotency::redact_url(&config.store)))?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    let (main, admin) = router(&config, store, metrics);
    let shutdown = futures_util::FutureExt::shared(Box::pin(shutdown));
    if let (Some(addr), Some(admin)) = (config.admin_listen, admin) {
        let admin_listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let _ = axum::serve(admin_listener, admin)
                .with_graceful_shutdown(stop)
                .await;
        });
    }
    tracing::info!(
        listen = %config.listen,
        upstream = %config.upstream,
        store = %idempotency::redact_url(&config.store),
        "idem gateway ready"
    );
    axum::serve(listener, main)
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|e| format!("serving: {e}"))?;
    // Requests whose clients went away finish on tasks of their own; let them record too.
    let limit = config.upstream_timeout + Duration::from_secs(5);
    if !idempotency_http::wait_for_detached_runs(limit).await {
        tracing::warn!(
            left = idempotency_http::detached_runs(),
            "exiting with requests still running; their leases protect the keys until a retry takes over"
        );
    }
    tracing::info!("drained; in-flight requests finished and recorded");
    Ok(())
}
