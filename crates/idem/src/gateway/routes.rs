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
use idempotency::DynStore;
use idempotency_http::IdempotencyLayer;
use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceExt};

use super::config::{Config, command};
use super::proxy::{Proxy, may_have_dot_segments, remove_dot_segments};
use super::route::RouteSpec;
use super::route::effect::{Effective, layer, policy};
use crate::admin::SharedPolicy;
use crate::error::Error;
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
