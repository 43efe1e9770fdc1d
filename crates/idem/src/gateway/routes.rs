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
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use http::Request;
use idempotency::{DynStore, ScopeSecret};
use idempotency_http::IdempotencyLayer;
use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceExt};

use super::config::{Config, command};
use super::proxy::{Proxy, may_have_dot_segments, remove_dot_segments};
use crate::admin::SharedPolicy;
use crate::config_file::{RouteFingerprint, RouteSpec};
use crate::error::Error;
use crate::flags::StatusSet;
use crate::reconcile::ReconcileTemplate;
use crate::server;
use crate::tls;

/// A route's service: its layer (or none, for `guard = false`) around its proxy.
pub(crate) type RouteService = BoxCloneSyncService<Request<Body>, Response, Infallible>;

/// The routes in file order, and the service of the requests none of them takes.
#[derive(Clone)]
pub(crate) struct RouteTable(Arc<Table>);

struct Table {
    routes: Vec<(RouteSpec, RouteService)>,
    fallback: RouteService,
}

impl RouteTable {
    /// The table of `config`: the gateway's own layer `base` (with `config`'s settings) around a
    /// proxy to `config.upstream` for the requests no route takes, and each route's settings
    /// over `config`'s in a layer that shares `base`'s body budget. Routes to the same upstream
    /// share its connections; the upstream TLS settings (the system's trust store among them)
    /// are read once.
    pub(crate) fn build(
        config: &Config,
        store: &DynStore,
        base: &IdempotencyLayer<DynStore>,
    ) -> Result<Self, Error> {
        let mut proxies = Proxies::new(config);
        let settings = Effective::of(config, None);
        let proxy = proxies.get(settings.upstream, settings.upstream_timeout)?;
        let fallback = guarded(
            config,
            proxies.reconciling(base.clone(), &settings, &proxy)?,
            proxy,
        );
        let mut routes = Vec::with_capacity(config.routes.len());
        for route in &config.routes {
            let settings = Effective::of(config, Some(route));
            let proxy = proxies.get(settings.upstream, settings.upstream_timeout)?;
            let service = if route.guard {
                let layer = layer(config, store, Some(route)).shares_with(base);
                guarded(config, proxies.reconciling(layer, &settings, &proxy)?, proxy)
            } else {
                BoxCloneSyncService::new(proxy)
            };
            routes.push((route.clone(), service));
        }
        Ok(Self(Arc::new(Table { routes, fallback })))
    }

    /// The service of the first route that takes a request with `method` to `path`, or the
    /// fallback's.
    fn pick(&self, method: &http::Method, path: &str) -> RouteService {
        let table = &self.0;
        if table.routes.is_empty() {
            return table.fallback.clone();
        }
        let path = matched_path(path);
        table
            .routes
            .iter()
            .find(|(route, _)| route.matches(method, &path))
            .map_or(&table.fallback, |(_, service)| service)
            .clone()
    }
}

/// The proxies of one table, one per upstream: routes to the same upstream share its
/// connections, and its TLS client settings are made at most once.
struct Proxies<'a> {
    config: &'a Config,
    tls: Option<Arc<rustls::ClientConfig>>,
    made: Vec<Proxy>,
}

impl<'a> Proxies<'a> {
    fn new(config: &'a Config) -> Self {
        Self {
            config,
            tls: None,
            made: Vec::new(),
        }
    }

    /// A proxy to `upstream` that waits `timeout` for its answers.
    fn get(&mut self, upstream: &http::Uri, timeout: Duration) -> Result<Proxy, Error> {
        if let Some(made) = self.made.iter().find(|proxy| proxy.upstream() == upstream) {
            return Ok(made.clone().timeout(timeout));
        }
        let tls = if upstream.scheme_str() == Some("https") {
            if self.tls.is_none() {
                if self.config.upstream_insecure_skip_verify {
                    tracing::warn!(
                        "--upstream-insecure-skip-verify: the upstream's certificate is NOT verified; anyone on the path can read and change the traffic"
                    );
                }
                self.tls = Some(tls::client_config(&self.config.upstream_tls())?);
            }
            self.tls.clone()
        } else {
            None
        };
        let proxy = Proxy::new(upstream.clone(), timeout, tls)?;
        self.made.push(proxy.clone());
        Ok(proxy)
    }

    /// `layer` asking the reconcile hook of `settings`, when it has one, through `proxy` (its
    /// upstream's) or, for an absolute URL, a proxy to that URL's origin with the same timeout.
    fn reconciling(
        &mut self,
        layer: IdempotencyLayer<DynStore>,
        settings: &Effective<'_>,
        proxy: &Proxy,
    ) -> Result<IdempotencyLayer<DynStore>, Error> {
        let Some(template) = settings.reconcile else {
            return Ok(layer);
        };
        let asks = match template.origin() {
            Some(origin) => self.get(origin, settings.upstream_timeout)?,
            None => proxy.clone(),
        };
        let template = Arc::new(template.clone());
        let max_response = settings.max_response;
        Ok(layer.reconcile(move |asked| {
            let (asks, template) = (asks.clone(), Arc::clone(&template));
            async move { asks.reconcile(&template, asked, max_response).await }
        }))
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
        let service = self
            .0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .pick(request.method(), request.uri().path());
        Box::pin(service.oneshot(request))
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
    pub(crate) fn reload(&self) -> Result<Vec<&'static str>, ReloadError> {
        let current = self
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let (command, secrets) = crate::flags::secrets_from_files(command(), &|name| std::env::var_os(name))?;
        let merged = crate::config_file::try_merge(&command, self.args.clone(), &secrets)?;
        let serve = merged
            .matches
            .subcommand_matches("serve")
            .ok_or(ReloadError::NotServe)?;
        let mut next = <Config as clap::FromArgMatches>::from_arg_matches(serve)
            .map_err(|error| ReloadError::Merge(crate::config_file::MergeError::Flags(error)))?;
        next.routes = merged.file.map(|file| file.routes).unwrap_or_default();
        next.reload_args.clone_from(&current.reload_args);
        if next.scope_secret.is_none() {
            // The secret the store keeps, read at start.
            next.scope_secret.clone_from(&current.scope_secret);
        }
        let restart = keep_process_settings(&current, &mut next);
        next.check()?;
        let base = layer(&next, &self.store, None).shares_with(&self.base);
        let table = RouteTable::build(&next, &self.store, &base).map_err(Box::new)?;
        self.live.replace(table);
        *self.policy.write().unwrap_or_else(PoisonError::into_inner) = policy(&next);
        *self.current.lock().unwrap_or_else(PoisonError::into_inner) = next;
        Ok(restart)
    }
}

/// Why a reload was refused; the running configuration stays.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReloadError {
    /// A `*_FILE` variable names a secret file that cannot be used.
    #[error(transparent)]
    Secrets(#[from] crate::flags::SecretFileError),
    /// The file, or the command line merged with it, is refused.
    #[error(transparent)]
    Merge(#[from] crate::config_file::MergeError),
    /// The process was not started as `idem serve` (nothing to reload).
    #[error("the command line is not `idem serve`")]
    NotServe,
    /// A merged setting is out of its range.
    #[error(transparent)]
    Flags(#[from] crate::flags::FlagError),
    /// The routes cannot be built (an upstream URL or its TLS settings).
    #[error(transparent)]
    Routes(#[from] Box<Error>),
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
        dashboard => "ui",
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
        drain_delay => "drain-delay",
    );
    restart
}

/// A route's settings over the gateway's (or the gateway's alone): what its layer is built
/// with, and what its policy publishes.
struct Effective<'a> {
    name: &'a str,
    /// The methods guarded.
    methods: &'a [http::Method],
    require_key: bool,
    max_body: usize,
    max_response: usize,
    lease: Duration,
    retention: Duration,
    wait: Option<Duration>,
    release_on: &'a StatusSet,
    key_header: Option<&'a http::HeaderName>,
    key_from: Option<&'a idempotency::JsonPointer>,
    fingerprint: Option<&'a RouteFingerprint>,
    scope_header: Option<&'a http::HeaderName>,
    upstream: &'a http::Uri,
    upstream_timeout: Duration,
    reconcile: Option<&'a ReconcileTemplate>,
}

impl<'a> Effective<'a> {
    fn of(config: &'a Config, route: Option<&'a RouteSpec>) -> Self {
        Self {
            name: route.map_or("gateway", |route| route.name.as_str()),
            methods: route
                .and_then(|route| route.methods.as_deref())
                .unwrap_or(&config.methods),
            require_key: route.and_then(|r| r.require_key).unwrap_or(config.require_key),
            max_body: route.and_then(|r| r.max_body).unwrap_or(config.max_body),
            max_response: route.and_then(|r| r.max_response).unwrap_or(config.max_response),
            lease: route.and_then(|r| r.lease).unwrap_or(config.lease),
            retention: route.and_then(|r| r.retention).unwrap_or(config.retention),
            wait: route.and_then(|r| r.wait).or(config.wait),
            release_on: route
                .and_then(|r| r.release_on.as_ref())
                .unwrap_or(&config.release_on),
            key_header: route.and_then(|r| r.key_header.as_ref()),
            key_from: route.and_then(|r| r.key_from.as_ref()),
            fingerprint: route.and_then(|r| r.fingerprint.as_ref()),
            scope_header: route
                .and_then(|r| r.scope_header.as_ref())
                .or(config.scope_header.as_ref()),
            upstream: route
                .and_then(|r| r.upstream.as_ref())
                .unwrap_or(&config.upstream),
            upstream_timeout: route
                .and_then(|r| r.upstream_timeout)
                .unwrap_or(config.upstream_timeout),
            reconcile: route
                .and_then(|r| r.reconcile.as_ref())
                .or(config.reconcile.as_ref()),
        }
    }
}

/// The gateway's layer with `route`'s settings over `config`'s, or `config`'s alone.
pub(crate) fn layer(
    config: &Config,
    store: &DynStore,
    route: Option<&RouteSpec>,
) -> IdempotencyLayer<DynStore> {
    let settings = Effective::of(config, route);
    let mut layer = IdempotencyLayer::new(store.clone())
        .name(settings.name.to_owned())
        .methods(settings.methods.iter().cloned())
        .require_key(settings.require_key)
        .max_body(settings.max_body)
        .max_response(settings.max_response)
        // The upstream chunks as it likes: store what ends within the limit all the same.
        .buffer_streamed_responses(true)
        .lease(settings.lease)
        .retention(settings.retention)
        .fail_open(config.fail_open)
        .log_keys(config.log_keys);
    if let Some(header) = settings.key_header {
        layer = layer.key_header(header.clone());
    }
    if let Some(pointer) = settings.key_from {
        layer = layer.key_from(pointer.clone());
    }
    if let Some(fingerprint) = settings.fingerprint {
        layer = layer.fingerprint(fingerprint.mode());
    }
    if let Some(name) = settings.scope_header {
        // `serve` fills the secret in from the store when the flag is absent; a router built
        // without one (a test) gets a fresh secret of its own.
        let secret = config.scope_secret.clone().unwrap_or_else(ScopeSecret::generate);
        layer = layer.scope_from_header(name.clone(), secret);
    }
    let release_on = settings.release_on.clone();
    layer = layer.final_status(move |status| !release_on.contains(status));
    if let Some(deadline) = settings.wait {
        layer = layer.wait(deadline);
    }
    layer
}

/// The service of requests a layer guards, in front of `proxy`: the body deadline, the layer,
/// the proxy.
fn guarded(config: &Config, layer: IdempotencyLayer<DynStore>, proxy: Proxy) -> RouteService {
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

/// The published policy (`/_idem/policy`): for each route in file order, then for the requests
/// no route takes, what a client may rely on. The schema is in `docs/HTTP.md`.
pub(crate) fn policy(config: &Config) -> serde_json::Value {
    let entry = |route: Option<&RouteSpec>| {
        let settings = Effective::of(config, route);
        let guarded = route.is_none_or(|route| route.guard);
        let names = |methods: &[http::Method]| methods.iter().map(ToString::to_string).collect::<Vec<_>>();
        let seconds = |duration: Duration| duration.as_secs_f64();
        let (body, members) = match settings.fingerprint {
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
            "name": settings.name,
            "path": route.map(|route| route.path.as_str()),
            "methods": route.and_then(|route| route.methods.as_deref()).map(names),
            "guarded": guarded,
            "guarded_methods": if guarded { names(settings.methods) } else { Vec::new() },
            "key_header": settings
                .key_header
                .map_or("Idempotency-Key".to_owned(), |header| canonical_header(header.as_str())),
            "key_from": settings.key_from.map(|pointer| pointer.as_str()),
            "require_key": settings.require_key,
            "retention_seconds": seconds(settings.retention),
            "lease_seconds": seconds(settings.lease),
            "wait_seconds": settings.wait.map(seconds),
            "release_on": settings.release_on.items(),
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
