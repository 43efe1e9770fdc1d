//! `idem serve`: the idempotency gateway, a reverse proxy that puts the HTTP layer in front of
//! any upstream. Its flags are [`Config`] (parsed in [`crate::flags`]), the proxy is
//! [`proxy`], the admin endpoints are [`crate::admin`], the HTTP server is [`crate::server`].

use std::future::Future;

use axum::Router;
use idempotency::{DynStore, ScopeSecret, Watched};
use idempotency_http::DetachedRuns;
use metrics_exporter_prometheus::PrometheusHandle;

mod config;
pub mod proxy;
pub mod route;
mod routes;
mod upstream;

use crate::admin::{ADMIN_PREFIX, Admin, admin_router};
use crate::error::Error;
use crate::server::{self, bind, bind_optional};
use crate::tls::ListenerTls;
pub use config::Config;
pub use proxy::{IDEMPOTENCY_ATTEMPT, Proxy};

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
    let base = route::effect::layer(config, &store, None).max_buffered(config.max_buffered);
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
        std::sync::Arc::new(std::sync::RwLock::new(route::effect::policy(config)));
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
