//! `idem serve`: the idempotency gateway, a reverse proxy that puts the HTTP layer in front of
//! any upstream. Its flags are [`Config`] (parsed in [`crate::flags`]), the proxy is
//! [`proxy`], the admin endpoints are [`crate::admin`], the HTTP server is [`crate::server`].

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use axum::Router;
use http::header::HeaderName;
use http::{Method, Uri};
use idempotency::{DynStore, ScopeSecret, Watched};
use idempotency_http::DetachedRuns;
use metrics_exporter_prometheus::PrometheusHandle;

pub mod proxy;
mod routes;

use crate::admin::{ADMIN_PREFIX, Admin, admin_router};
use crate::error::Error;
use crate::flags::{
    FlagError, PurgeEvery, SecretParser, StatusSet, parse_client_timeout, parse_drain_delay,
    parse_drain_timeout, parse_header_name, parse_lease, parse_limit, parse_method, parse_purge_every,
    parse_retention, parse_status_set, parse_upstream, parse_upstream_timeout, parse_wait,
};
use crate::server::{self, bind, bind_optional};
use crate::tls::{ClientFiles, ListenerTls, ServerFiles};
pub use proxy::{IDEMPOTENCY_ATTEMPT, Proxy};

/// Everything `idem serve` is configured with: the command line's flags (each also an `IDEM_*`
/// environment variable) are these fields, so a setting is added in one place. `Default` is the
/// command line's defaults, with an upstream on `http://127.0.0.1:3000`.
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    /// The upstream's base URL (http://host:port[/base], or https://…); https is verified against
    /// --upstream-ca or, without it, the system's trust store.
    #[arg(long, env = "IDEM_UPSTREAM", value_parser = parse_upstream)]
    pub upstream: Uri,
    /// A private CA (PEM bundle): the only CA trusted for an https upstream (without it, the
    /// system's trust store).
    #[arg(long, env = "IDEM_UPSTREAM_CA")]
    pub upstream_ca: Option<PathBuf>,
    /// A client certificate (PEM chain) presented to an https upstream; needs
    /// --upstream-client-key.
    #[arg(long, env = "IDEM_UPSTREAM_CLIENT_CERT", requires = "upstream_client_key")]
    pub upstream_client_cert: Option<PathBuf>,
    /// The private key (PEM) of --upstream-client-cert.
    #[arg(long, env = "IDEM_UPSTREAM_CLIENT_KEY", requires = "upstream_client_cert")]
    pub upstream_client_key: Option<PathBuf>,
    /// INSECURE: accept any certificate from an https upstream, for any name (logged as a
    /// warning at start). For tests against a server whose CA you cannot get.
    #[arg(long, env = "IDEM_UPSTREAM_INSECURE_SKIP_VERIFY")]
    pub upstream_insecure_skip_verify: bool,
    /// Where the gateway listens.
    #[arg(long, env = "IDEM_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Serve HTTPS on --listen with this certificate chain (PEM, leaf first); needs --tls-key.
    /// SIGHUP reads the pair again (new connections get it; a bad pair keeps the old one).
    #[arg(long, env = "IDEM_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "IDEM_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA (PEM bundle): mutual TLS.
    #[arg(long, env = "IDEM_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// Serve /metrics and /healthz here instead of under /_idem/ on the main listener.
    #[arg(long, env = "IDEM_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// The dashboard (`--ui`) and its settings.
    #[command(flatten)]
    pub dashboard: crate::ui::UiFlags,
    /// A TOML file with these settings (the flags' long names as keys) and per-route policies
    /// (`[[route]]` tables); the flags and IDEM_* variables win over it. See docs/HTTP.md.
    #[arg(long, env = "IDEM_CONFIG")]
    pub config: Option<PathBuf>,
    /// Check the --config file, print the effective settings and routes and where each comes
    /// from, and exit.
    #[arg(long, requires = "config")]
    pub check: bool,
    /// The routes of the --config file, in file order.
    #[arg(skip)]
    pub routes: Vec<crate::config_file::RouteSpec>,
    /// The process's command line, when its settings come from a --config file: SIGHUP merges
    /// the file with it again.
    #[arg(skip)]
    pub reload_args: Option<Vec<std::ffi::OsString>>,
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
    #[arg(long, env = "IDEM_SCOPE_SECRET", hide_env_values = true, value_parser = SecretParser::SCOPE_SECRET)]
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
    /// Before an attempt after the first runs (an earlier one's answer was lost or timed out,
    /// or released the key), ask the upstream whether it took effect: `[METHOD ]/path/{key}` or
    /// an `http(s)://` URL with `{key}`. A 2xx or a 4xx other than 404 is adopted as the key's
    /// outcome and nothing runs again; 404 lets the attempt run; anything else keeps the key in
    /// flight (503). See docs/RECONCILE.md.
    #[arg(long, env = "IDEM_RECONCILE", value_parser = crate::reconcile::parse_reconcile)]
    pub reconcile: Option<crate::reconcile::ReconcileTemplate>,
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
    /// After SIGTERM, how long the gateway goes on serving while `/_idem/readyz` answers 503,
    /// before it stops accepting and drains: time for load balancers to take it out of
    /// rotation (Kubernetes removes a terminating pod's endpoints in parallel with the signal).
    #[arg(long, env = "IDEM_DRAIN_DELAY", default_value = "0s", value_parser = parse_drain_delay)]
    pub drain_delay: Duration,
    /// How each guarded request's log event shows its key: `hash` (a digest: lines of one key
    /// can be found together, and nothing a client sent is written down), `plain` or `off`.
    #[arg(long, env = "IDEM_LOG_KEYS", default_value = "hash")]
    pub log_keys: idempotency_http::KeyLog,
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
        let upstream_tls = self.upstream_ca.is_some()
            || self.upstream_client_cert.is_some()
            || self.upstream_insecure_skip_verify;
        if upstream_tls && self.upstream.scheme_str() != Some("https") {
            return Err(FlagError::Conflict(
                "--upstream-ca, --upstream-client-cert and --upstream-insecure-skip-verify are for an https:// upstream; this one is http://",
            ));
        }
        if self.upstream_insecure_skip_verify && self.upstream_ca.is_some() {
            return Err(FlagError::Conflict(
                "--upstream-insecure-skip-verify verifies nothing, so --upstream-ca would be ignored: give one or the other",
            ));
        }
        if self.routes.iter().any(|route| {
            route
                .max_body
                .is_some_and(|max_body| max_body > self.max_buffered)
        }) {
            return Err(FlagError::Conflict(
                "a route's max-body is larger than --max-buffered: a body of the largest size it allows could never be buffered",
            ));
        }
        Ok(())
    }

    /// How the gateway verifies an https upstream and presents itself to it.
    #[must_use]
    pub fn upstream_tls(&self) -> ClientFiles {
        ClientFiles {
            ca: self.upstream_ca.clone(),
            cert: self.upstream_client_cert.clone(),
            key: self.upstream_client_key.clone(),
            insecure_skip_verify: self.upstream_insecure_skip_verify,
        }
    }

    /// The listener's certificate files, when it serves HTTPS.
    #[must_use]
    pub fn listener_tls(&self) -> Option<ServerFiles> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(ServerFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: self.tls_client_ca.clone(),
            }),
            _ => None,
        }
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
    /// What SIGHUP reloads the configuration file with, when there is one.
    reloader: Option<std::sync::Arc<routes::Reloader>>,
    /// Started when shutdown begins: `/readyz` answers `503` from then on.
    pub draining: crate::admin::Draining,
}

/// The gateway's routers: the layer around the proxy, and the admin endpoints.
///
/// # Errors
///
/// [`Error::Tls`] or [`Error::Upstream`] when an https upstream's TLS cannot be set up (a CA
/// or client certificate file that cannot be used).
pub fn router(config: &Config, store: DynStore, metrics: PrometheusHandle) -> Result<Routers, Error> {
    let watched = Watched::new(store);
    let health = watched.health();
    let store: DynStore = std::sync::Arc::new(watched);
    let base = routes::layer(config, &store, None).max_buffered(config.max_buffered);
    let detached = base.detached_runs();
    let live = routes::LiveRoutes::new(routes::RouteTable::build(config, &store, &base)?);
    let main = Router::new().fallback_service(live.clone());
    // The server span, only when spans are exported: no work per request otherwise.
    let main = if crate::telemetry::exporting() {
        main.layer(axum::middleware::from_fn(traced))
    } else {
        main
    };
    let policy: crate::admin::SharedPolicy =
        std::sync::Arc::new(std::sync::RwLock::new(routes::policy(config)));
    let reloader = config.reload_args.clone().map(|args| {
        std::sync::Arc::new(routes::Reloader::new(
            config,
            args,
            store.clone(),
            base.clone(),
            live,
            std::sync::Arc::clone(&policy),
        ))
    });
    let admin = Admin::new(store, &config.store, health, metrics).policy(policy);
    let draining = admin.draining();
    let (main, admin) = match config.admin_listen {
        Some(_) => {
            let router = admin_router(admin.clone(), "");
            let router = config
                .dashboard
                .serve_beside(router, admin, crate::ui::Process::Gateway)?;
            (main, Some(router))
        }
        None => (main.merge(admin_router(admin, ADMIN_PREFIX)), None),
    };
    Ok(Routers {
        main,
        admin,
        detached,
        reloader,
        draining,
    })
}

/// The server span of every request through the gateway (`idem.request`), continuing the
/// client's trace when its `traceparent` carries one; the layer's and the proxy's spans are its
/// children.
async fn traced(request: axum::extract::Request, next: axum::middleware::Next) -> axum::response::Response {
    use tracing::Instrument;
    let span = tracing::info_span!(
        "idem.request",
        otel.kind = "server",
        http.request.method = %request.method(),
        url.path = %request.uri().path(),
        http.response.status_code = tracing::field::Empty,
    );
    crate::telemetry::continue_from(&span, request.headers());
    let response = next.run(request).instrument(span.clone()).await;
    span.record("http.response.status_code", response.status().as_u16());
    response
}

/// `idem serve`'s command line as the binary parses it: what a reload merges the configuration
/// file with again.
fn command() -> clap::Command {
    use clap::Args;
    clap::Command::new("idem").subcommand(Config::augment_args(clap::Command::new("serve")))
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
    config.dashboard.check(config.admin_listen)?;
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(Error::Metrics)?;
    // The listeners are bound before the store is opened: an address already taken is
    // reported before anything touches the store (no migration by a process that cannot
    // serve), and the address is held from the moment the process starts.
    let listener_tls = config.listener_tls().map(ListenerTls::new).transpose()?;
    let (listener, bound) = bind(config.listen).await?;
    let (admin_listener, admin_bound) = bind_optional(config.admin_listen).await?.unzip();
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
        reloader,
        draining,
    } = router(&config, store, metrics)?;
    if listener_tls.is_some() || reloader.is_some() {
        tokio::spawn(reload_on_hangup(listener_tls.clone(), reloader));
    }
    // Shutdown begins with the signal: `/readyz` answers 503 at once, the listener keeps
    // serving for `--drain-delay` (load balancers see the 503 and stop sending), then it
    // stops accepting and running requests drain.
    let (drain_delay, draining_now) = (config.drain_delay, draining.clone());
    let shutdown = async move {
        shutdown.await;
        draining_now.start();
        tracing::info!(delay = ?drain_delay, "shutting down: /readyz answers 503 from now on");
        tokio::time::sleep(drain_delay).await;
    };
    let limits = server::Limits {
        header_timeout: config.header_timeout,
        max_connections: config.max_connections as usize,
        drain_timeout: config.drain_timeout,
    };
    // The admin listener answers probes until the main listener has drained.
    let (drained, admin_stop) = tokio::sync::oneshot::channel::<()>();
    if let (Some(admin_listener), Some(admin)) = (admin_listener, admin) {
        let stop = async move {
            let _ = admin_stop.await;
        };
        // The admin listener stays plain: it answers probes and scrapes on an address of the
        // pod or host (see docs/TLS.md); on the main listener, the admin paths are HTTPS too.
        tokio::spawn(server::serve(
            admin_listener,
            admin,
            limits,
            None,
            DetachedRuns::default(),
            stop,
        ));
    }
    tracing::info!(
        listen = %bound,
        admin_listen = admin_bound.map(tracing::field::display),
        tls = listener_tls.is_some(),
        client_certificates = config.tls_client_ca.is_some(),
        upstream = %config.upstream,
        store = %idempotency::redact_url(&config.store),
        "idem gateway ready"
    );
    if server::serve(listener, main, limits, listener_tls.as_ref(), detached, shutdown).await {
        tracing::info!("drained; in-flight requests finished and recorded");
    }
    drop(drained);
    if let Some(purging) = purging {
        purging.abort();
    }
    Ok(())
}

/// On every `SIGHUP`: reads the configuration file again (an invalid one leaves the running
/// configuration in place, and the log says why, with the line and column), and the listener's
/// certificate and key (a pair that cannot be used leaves the current one in place).
async fn reload_on_hangup(tls: Option<ListenerTls>, reloader: Option<std::sync::Arc<routes::Reloader>>) {
    let Ok(mut hangups) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) else {
        tracing::warn!(
            "SIGHUP cannot be caught here: the certificate and the configuration file will not be reloaded"
        );
        return;
    };
    while hangups.recv().await.is_some() {
        if let Some(reloader) = &reloader {
            match reloader.reload() {
                Ok(restart) => {
                    metrics::counter!("idem_config_reloads_total", "result" => "ok").increment(1);
                    if !restart.is_empty() {
                        tracing::warn!(
                            settings = %restart.join(", "),
                            "SIGHUP: these settings changed but need a restart; they keep their running values"
                        );
                    }
                    tracing::info!(
                        "SIGHUP: the configuration file was reloaded; new requests get its routes and settings"
                    );
                }
                Err(error) => {
                    metrics::counter!("idem_config_reloads_total", "result" => "failed").increment(1);
                    tracing::error!(%error, "SIGHUP: the configuration file was not taken; the running configuration stays");
                }
            }
        }
        let Some(tls) = &tls else {
            continue;
        };
        match tls.reload() {
            Ok(()) => {
                metrics::counter!("idem_tls_reloads_total", "result" => "ok").increment(1);
                tracing::info!("SIGHUP: the listener's certificate and key were reloaded");
            }
            Err(error) => {
                metrics::counter!("idem_tls_reloads_total", "result" => "failed").increment(1);
                tracing::warn!(%error, "SIGHUP: the new certificate was not taken; the previous one is still served");
            }
        }
    }
}

#[cfg(test)]
mod config_tests {
    use super::*;
    use crate::flags::UpstreamError;

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
        assert!(parse_upstream("https://a").is_ok());
        assert_eq!(
            parse_upstream("ftp://a").unwrap_err().to_string(),
            "`ftp://a`: the upstream must be an http:// or https:// URL"
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
