//! The gateway's routes: each `[[route]]` of the configuration file
//! ([`crate::config_file`]) is a service of its own, a layer configured for it around a proxy
//! to its upstream, and a request goes to the first route whose path and methods match, or to
//! the gateway's own settings.
//!
//! One layer per route rather than one layer with a per-request policy: each route's settings
//! are fixed when the table is built, the layer's hot path stays as it is, and the layers share
//! one body budget and one set of detached runs ([`IdempotencyLayer::shares_with`]).

use std::borrow::Cow;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::Response;
use http::Request;
use idempotency::{DynStore, ScopeSecret};
use idempotency_http::IdempotencyLayer;
use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceExt};

use super::Config;
use super::proxy::{Proxy, may_have_dot_segments, remove_dot_segments};
use crate::config_file::{RouteFingerprint, RouteSpec};
use crate::error::Error;
use crate::server;
use crate::tls;

/// A route's service: its layer (or none, for `guard = false`) around its proxy.
pub(crate) type RouteService = BoxCloneSyncService<Request<Body>, Response, Infallible>;

/// The routes in file order, and the service of the requests none of them takes.
#[derive(Clone)]
pub(crate) struct RouteTable {
    routes: Arc<[(RouteSpec, RouteService)]>,
    fallback: RouteService,
}

impl RouteTable {
    /// The table of `config.routes`, each route's settings over the gateway's; the gateway's
    /// own layer is `base`, which the routes' layers share their body budget with.
    pub(crate) fn new(
        config: &Config,
        store: &DynStore,
        base: &IdempotencyLayer<DynStore>,
        fallback: RouteService,
    ) -> Result<Self, Error> {
        let mut routes = Vec::with_capacity(config.routes.len());
        for route in &config.routes {
            routes.push((route.clone(), route_service(config, store, base, route)?));
        }
        Ok(Self {
            routes: routes.into(),
            fallback,
        })
    }
}

/// The path a route is matched against: dot segments resolved and percent-encoding decoded, as
/// the upstream will read it, so that `/v1/./payments` or `/v1/%70ayments` cannot slip past the
/// route of `/v1/payments`.
pub(crate) fn matched_path(path: &str) -> Cow<'_, str> {
    let path: Cow<'_, str> = if may_have_dot_segments(path) {
        Cow::Owned(remove_dot_segments(path))
    } else {
        Cow::Borrowed(path)
    };
    if path.contains('%') {
        Cow::Owned(
            percent_encoding::percent_decode_str(&path)
                .decode_utf8_lossy()
                .into_owned(),
        )
    } else {
        path
    }
}

impl Service<Request<Body>> for RouteTable {
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Each call takes a clone of its route's service and waits for it to be ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let path = matched_path(request.uri().path());
        let service = self
            .routes
            .iter()
            .find(|(route, _)| route.matches(request.method(), &path))
            .map_or(&self.fallback, |(_, service)| service)
            .clone();
        Box::pin(service.oneshot(request))
    }
}

/// The gateway's layer with `route`'s settings over `config`'s, or `config`'s alone.
pub(crate) fn layer(
    config: &Config,
    store: &DynStore,
    route: Option<&RouteSpec>,
) -> IdempotencyLayer<DynStore> {
    let methods = route
        .and_then(|route| route.methods.clone())
        .unwrap_or_else(|| config.methods.clone());
    let mut layer = IdempotencyLayer::new(store.clone())
        .name(route.map_or_else(|| "gateway".to_owned(), |route| route.name.clone()))
        .methods(methods)
        .require_key(route.and_then(|r| r.require_key).unwrap_or(config.require_key))
        .max_body(route.and_then(|r| r.max_body).unwrap_or(config.max_body))
        .max_response(route.and_then(|r| r.max_response).unwrap_or(config.max_response))
        // The upstream chunks as it likes: store what ends within the limit all the same.
        .buffer_streamed_responses(true)
        .lease(route.and_then(|r| r.lease).unwrap_or(config.lease))
        .retention(route.and_then(|r| r.retention).unwrap_or(config.retention))
        .fail_open(config.fail_open);
    if let Some(header) = route.and_then(|r| r.key_header.clone()) {
        layer = layer.key_header(header);
    }
    if let Some(pointer) = route.and_then(|r| r.key_from.clone()) {
        layer = layer.key_from(pointer);
    }
    if let Some(fingerprint) = route.and_then(|r| r.fingerprint.as_ref()) {
        layer = layer.fingerprint(fingerprint.mode());
    }
    if let Some(name) = route
        .and_then(|r| r.scope_header.clone())
        .or_else(|| config.scope_header.clone())
    {
        // `serve` fills the secret in from the store when the flag is absent; a router built
        // without one (a test) gets a fresh secret of its own.
        let secret = config.scope_secret.clone().unwrap_or_else(ScopeSecret::generate);
        layer = layer.scope_from_header(name, secret);
    }
    let release_on = route
        .and_then(|r| r.release_on.clone())
        .unwrap_or_else(|| config.release_on.clone());
    layer = layer.final_status(move |status| !release_on.contains(status));
    if let Some(deadline) = route.and_then(|r| r.wait).or(config.wait) {
        layer = layer.wait(deadline);
    }
    layer
}

/// A proxy to `upstream` with the gateway's upstream TLS settings.
pub(crate) fn proxy(
    config: &Config,
    upstream: &http::Uri,
    timeout: std::time::Duration,
) -> Result<Proxy, Error> {
    let tls = if upstream.scheme_str() == Some("https") {
        if config.upstream_insecure_skip_verify {
            tracing::warn!(
                %upstream,
                "--upstream-insecure-skip-verify: the upstream's certificate is NOT verified; anyone on the path can read and change the traffic"
            );
        }
        Some(tls::client_config(&config.upstream_tls())?)
    } else {
        None
    };
    Ok(Proxy::new(upstream.clone(), timeout, tls)?)
}

/// The service of requests a layer guards, in front of `proxy`: the body deadline, the layer,
/// the proxy.
pub(crate) fn guarded(config: &Config, layer: IdempotencyLayer<DynStore>, proxy: Proxy) -> RouteService {
    let body_timeout = config.body_timeout;
    let service = tower::ServiceBuilder::new()
        .map_request(move |request: Request<Body>| {
            request.map(|body| Body::new(server::BodyDeadline::new(body, body_timeout)))
        })
        .layer(layer)
        .service(proxy)
        .map_response(|response| response.map(Body::new));
    BoxCloneSyncService::new(service)
}

fn route_service(
    config: &Config,
    store: &DynStore,
    base: &IdempotencyLayer<DynStore>,
    route: &RouteSpec,
) -> Result<RouteService, Error> {
    let upstream = route.upstream.as_ref().unwrap_or(&config.upstream);
    let proxy = proxy(
        config,
        upstream,
        route.upstream_timeout.unwrap_or(config.upstream_timeout),
    )?;
    if !route.guard {
        return Ok(BoxCloneSyncService::new(proxy));
    }
    Ok(guarded(
        config,
        layer(config, store, Some(route)).shares_with(base),
        proxy,
    ))
}

/// The published policy (`/_idem/policy`): for each route in file order, then for the requests
/// no route takes, what a client may rely on. The schema is in `docs/HTTP.md`.
pub(crate) fn policy(config: &Config) -> serde_json::Value {
    let entry = |route: Option<&RouteSpec>| {
        let guarded = route.is_none_or(|route| route.guard);
        let methods = route.and_then(|route| route.methods.as_ref());
        let guarded_methods: Vec<String> = if guarded {
            methods
                .unwrap_or(&config.methods)
                .iter()
                .map(ToString::to_string)
                .collect()
        } else {
            Vec::new()
        };
        let seconds = |duration: std::time::Duration| duration.as_secs_f64();
        let fingerprint = route.and_then(|route| route.fingerprint.as_ref());
        let (body, members) = match fingerprint {
            None | Some(RouteFingerprint::Body) => ("whole", Vec::new()),
            Some(RouteFingerprint::Nothing) => ("none", Vec::new()),
            Some(RouteFingerprint::Members(pointers)) => (
                "members",
                pointers
                    .iter()
                    .map(|pointer| pointer.as_str().to_owned())
                    .collect(),
            ),
        };
        serde_json::json!({
            "name": route.map_or("gateway", |route| route.name.as_str()),
            "path": route.map(|route| route.path.as_str()),
            "methods": methods.map(|methods| methods.iter().map(ToString::to_string).collect::<Vec<_>>()),
            "guarded": guarded,
            "guarded_methods": guarded_methods,
            "key_header": route
                .and_then(|route| route.key_header.as_ref())
                .map_or("Idempotency-Key".to_owned(), |header| canonical_header(header.as_str())),
            "key_from": route.and_then(|route| route.key_from.as_ref()).map(|pointer| pointer.as_str()),
            "require_key": route.and_then(|route| route.require_key).unwrap_or(config.require_key),
            "retention_seconds": seconds(route.and_then(|route| route.retention).unwrap_or(config.retention)),
            "lease_seconds": seconds(route.and_then(|route| route.lease).unwrap_or(config.lease)),
            "wait_seconds": route.and_then(|route| route.wait).or(config.wait).map(seconds),
            "release_on": route
                .and_then(|route| route.release_on.as_ref())
                .unwrap_or(&config.release_on)
                .items(),
            "fingerprint": {
                "method_and_target": true,
                "body": body,
                "members": members,
            },
        })
    };
    serde_json::json!({
        "routes": config.routes.iter().map(|route| entry(Some(route))).collect::<Vec<_>>(),
        "default": entry(None),
    })
}

/// `x-request-id` as `X-Request-Id`: header names are case-insensitive, and this is how people
/// write them.
fn canonical_header(name: &str) -> String {
    name.split('-')
        .map(|word| {
            let mut chars = word.chars();
            chars.next().map_or_else(String::new, |first| {
                first.to_ascii_uppercase().to_string() + chars.as_str()
            })
        })
        .collect::<Vec<_>>()
        .join("-")
}
