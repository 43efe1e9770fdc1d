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
use std::sync::{Arc, Mutex, PoisonError, RwLock};
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
use crate::admin::SharedPolicy;
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

/// The route table requests go through now: a reload swaps it, and requests already running
/// finish with the services they took.
#[derive(Clone)]
pub(crate) struct LiveRoutes(Arc<RwLock<RouteTable>>);

impl LiveRoutes {
    pub(crate) fn new(table: RouteTable) -> Self {
        Self(Arc::new(RwLock::new(table)))
    }

    fn replace(&self, table: RouteTable) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = table;
    }
}

impl Service<Request<Body>> for LiveRoutes {
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let mut table = self.0.read().unwrap_or_else(PoisonError::into_inner).clone();
        table.call(request)
    }
}

/// What a reload of the configuration file needs: the running settings, the command line to
/// merge the file with again, and what it replaces.
pub(crate) struct Reloader {
    current: Mutex<Config>,
    args: Vec<std::ffi::OsString>,
    store: DynStore,
    base: IdempotencyLayer<DynStore>,
    live: LiveRoutes,
    policy: SharedPolicy,
}

impl std::fmt::Debug for Reloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloader").finish_non_exhaustive()
    }
}

impl Reloader {
    pub(crate) fn new(
        config: &Config,
        args: Vec<std::ffi::OsString>,
        store: DynStore,
        base: IdempotencyLayer<DynStore>,
        live: LiveRoutes,
        policy: SharedPolicy,
    ) -> Self {
        Self {
            current: Mutex::new(config.clone()),
            args,
            store,
            base,
            live,
            policy,
        }
    }

    /// Reads the file again and merges it with the command line and the environment as at
    /// start: the routes and the per-request settings are replaced for new requests; the
    /// settings of the process (the store, the listeners, TLS, the limits of connections) keep
    /// their running values, and their names are returned.
    ///
    /// # Errors
    ///
    /// Why the file or the merged settings are refused: nothing is replaced then.
    pub(crate) fn reload(&self) -> Result<Vec<&'static str>, String> {
        let current = self
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let command = crate::flags::secrets_from_files(super::command(), &|name| std::env::var_os(name))
            .map_err(|error| error.to_string())?;
        let merged =
            crate::config_file::try_merge(&command, self.args.clone()).map_err(|error| error.to_string())?;
        let serve = merged
            .matches
            .subcommand_matches("serve")
            .ok_or("the command line is not `idem serve`")?;
        let mut next =
            <Config as clap::FromArgMatches>::from_arg_matches(serve).map_err(|error| error.to_string())?;
        next.routes = merged.file.map(|file| file.routes).unwrap_or_default();
        next.reload_args.clone_from(&current.reload_args);
        if next.scope_secret.is_none() {
            // The secret the store keeps, read at start.
            next.scope_secret.clone_from(&current.scope_secret);
        }
        let restart = keep_process_settings(&current, &mut next);
        next.check().map_err(|error| error.to_string())?;
        let base = layer(&next, &self.store, None).shares_with(&self.base);
        let proxy = proxy(&next, &next.upstream, next.upstream_timeout).map_err(|error| error.to_string())?;
        let fallback = guarded(&next, base.clone(), proxy);
        let table =
            RouteTable::new(&next, &self.store, &base, fallback).map_err(|error| error.to_string())?;
        self.live.replace(table);
        *self.policy.write().unwrap_or_else(PoisonError::into_inner) = policy(&next);
        *self.current.lock().unwrap_or_else(PoisonError::into_inner) = next;
        Ok(restart)
    }
}

/// Gives `next` the running values of the settings a running process cannot change (the store,
/// the listeners and their TLS, the connection and memory limits, the upstream's TLS files);
/// returns the names of those `next` wanted to change.
fn keep_process_settings(current: &Config, next: &mut Config) -> Vec<&'static str> {
    let mut restart = Vec::new();
    macro_rules! keep {
        ($($field:ident => $name:literal),* $(,)?) => {$(
            if format!("{:?}", next.$field) != format!("{:?}", current.$field) {
                restart.push($name);
                next.$field = current.$field.clone();
            }
        )*};
    }
    keep!(
        listen => "listen",
        admin_listen => "admin-listen",
        store => "store",
        no_migrate => "no-migrate",
        tls_cert => "tls-cert",
        tls_key => "tls-key",
        tls_client_ca => "tls-client-ca",
        upstream_ca => "upstream-ca",
        upstream_client_cert => "upstream-client-cert",
        upstream_client_key => "upstream-client-key",
        upstream_insecure_skip_verify => "upstream-insecure-skip-verify",
        scope_secret => "scope-secret",
        max_buffered => "max-buffered",
        max_connections => "max-connections",
        header_timeout => "header-timeout",
        purge_every => "purge-every",
        drain_timeout => "drain-timeout",
    );
    restart
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
