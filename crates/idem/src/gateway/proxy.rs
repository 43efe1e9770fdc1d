//! The gateway's reverse proxy: the request target resolved under the upstream's base path,
//! the hop-by-hop headers dropped, the attempt header set, and each way the upstream can fail
//! answered as a problem.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tracing::Instrument;

use axum::body::Body;
use axum::response::Response;
use http::header::{self, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{Request, Uri};
use http_body_util::BodyExt;
use idempotency_http::{IdempotencyKey, Problem, Reconcile, Reconciled, strip_hop_by_hop};
use rustls::ClientConfig;
use tower::Service;

use super::upstream::{Failure, Upstream};
use crate::error::UpstreamError;
use crate::reconcile::{Meaning, ReconcileTemplate};

/// The header the upstream finds the attempt number in (1, or more after a takeover). The
/// gateway sets it on guarded requests and removes it from all others, so the upstream can
/// trust it: a client cannot forge it.
pub const IDEMPOTENCY_ATTEMPT: HeaderName = HeaderName::from_static("idempotency-attempt");

/// A problem document, as the layer writes its own, marked as the proxy's own answer.
fn problem(problem: &Problem) -> Response {
    let mut response = problem.to_response().map(Body::from);
    response.extensions_mut().insert(OwnAnswer(problem.title()));
    response
}

/// Marks an answer the proxy made itself because the upstream's did not come (or could not be
/// asked for): never mistaken for the upstream's.
#[derive(Debug, Clone, Copy)]
struct OwnAnswer(&'static str);

/// The path with its `.` and `..` segments resolved (RFC 3986 §5.2.4), percent-encoded ones
/// (`%2e%2e`) included, so that a request target can never climb above the upstream's base path:
/// `..` at the root stays at the root.
pub(crate) fn remove_dot_segments(path: &str) -> String {
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
pub(crate) fn may_have_dot_segments(path: &str) -> bool {
    path.contains('.')
        || path
            .as_bytes()
            .windows(3)
            .any(|w| w[0] == b'%' && w[1] == b'2' && w[2].eq_ignore_ascii_case(&b'e'))
}

/// The proxy behind the layer: forwards a request to the upstream and brings the response back.
#[derive(Clone, derive_more::Debug)]
pub struct Proxy {
    #[debug(skip)]
    connections: Upstream,
    // An upstream URL may carry user information.
    #[debug("{:?}", idempotency::redact_url(&upstream.to_string()))]
    upstream: Uri,
    #[debug(skip)]
    timeout: Duration,
}

impl Proxy {
    /// A proxy to `upstream`; an `https://` upstream is reached with `tls` (see
    /// [`crate::tls::client_config`]).
    ///
    /// # Errors
    ///
    /// [`UpstreamError::Tls`] for an `https://` upstream without `tls`, or whose host cannot be
    /// checked against a certificate.
    pub fn new(
        upstream: Uri,
        timeout: Duration,
        tls: Option<Arc<ClientConfig>>,
    ) -> Result<Self, UpstreamError> {
        Ok(Self {
            connections: Upstream::new(&upstream, tls)?,
            upstream,
            timeout,
        })
    }

    /// The upstream's base URL.
    #[must_use]
    pub fn upstream(&self) -> &Uri {
        &self.upstream
    }

    /// The same proxy (its connections shared) waiting `timeout` for an answer.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
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
        let sent = if crate::telemetry::exporting() {
            // The upstream call's span; the upstream continues the trace from it.
            let span = tracing::info_span!(
                "upstream",
                otel.kind = "client",
                http.request.method = %request.method(),
                url.full = %format_args!("{}{}", self.upstream, request.uri()),
                http.response.status_code = tracing::field::Empty,
            );
            span.in_scope(|| crate::telemetry::propagate(request.headers_mut()));
            let sent = self
                .connections
                .send(request, deadline)
                .instrument(span.clone())
                .await;
            if let Ok(response) = &sent {
                span.record("http.response.status_code", response.status().as_u16());
            }
            sent
        } else {
            self.connections.send(request, deadline).await
        };
        let response = match sent {
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
            // A refused certificate sent nothing either.
            Err(Failure::Tls(error)) => {
                metrics::counter!("idem_upstream_errors_total", "kind" => "tls").increment(1);
                tracing::warn!(%error, upstream = %self.upstream, "no TLS connection to the upstream");
                return problem(&Problem::UpstreamTls(error));
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

impl Proxy {
    /// Asks the upstream the reconcile hook's question about `asked` (see
    /// [`crate::reconcile`]): `template`'s request, with `asked`'s headers but those of its body
    /// and connection, and the key and attempt the upstream would get; an answer's body is read
    /// up to `max_response` bytes.
    pub(crate) async fn reconcile(
        self,
        template: &ReconcileTemplate,
        asked: Reconcile,
        max_response: usize,
    ) -> Reconciled {
        let target = template.target(&asked.key.message_key());
        let mut request = Request::new(Body::empty());
        *request.method_mut() = template.method().clone();
        *request.headers_mut() = asked.headers;
        for name in [
            header::CONTENT_LENGTH,
            header::CONTENT_TYPE,
            header::CONTENT_ENCODING,
            header::EXPECT,
        ] {
            request.headers_mut().remove(name);
        }
        *request.uri_mut() = match target.parse() {
            Ok(uri) => uri,
            Err(error) => return Reconciled::Unresolved(format!("the question's target: {error}")),
        };
        request.extensions_mut().insert(asked.key);
        let response = self.forward(request).await;
        let status = response.status();
        if let Some(OwnAnswer(why)) = response.extensions().get::<OwnAnswer>() {
            return Reconciled::Unresolved(format!("the reconcile hook gave no answer: {why}"));
        }
        match Meaning::of(status) {
            Meaning::Happened => {}
            Meaning::DidNotHappen => return Reconciled::DidNotHappen,
            Meaning::Unknown => {
                return Reconciled::Unresolved(format!(
                    "the reconcile hook answered {status}, which says neither what happened nor that nothing did"
                ));
            }
        }
        let (parts, body) = response.into_parts();
        match http_body_util::Limited::new(body, max_response).collect().await {
            Ok(body) => Reconciled::Happened(Response::from_parts(parts, body.to_bytes())),
            Err(error) => {
                Reconciled::Unresolved(format!("the reconcile hook's answer could not be read: {error}"))
            }
        }
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

#[cfg(test)]
mod target_tests {
    use super::*;

    #[tokio::test]
    async fn the_proxy_shows_its_upstream_without_the_password() {
        let upstream: Uri = "http://app:s3cret@127.0.0.1:8080/api".parse().unwrap();
        let shown = format!(
            "{:?}",
            Proxy::new(upstream, Duration::from_secs(1), None).unwrap()
        );
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("127.0.0.1:8080/api"), "{shown}");
    }

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
            let proxy = Proxy::new(upstream.parse().unwrap(), Duration::from_secs(1), None).unwrap();
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
