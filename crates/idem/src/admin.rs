//! The admin endpoints of `idem serve` and `idem consume`: `/livez` (the process answers),
//! `/readyz` (the store answers, its writes work, and the process is not draining), `/healthz`
//! (the store answers and its writes work, whether draining or not: kept as it always was),
//! `/metrics` (Prometheus) and, for the gateway, `/policy` (its idempotency policy per route, as
//! the IETF draft asks servers to publish), under [`ADMIN_PREFIX`] on the main listener or on a
//! listener of their own.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::header;
use idempotency::{
    BeginRequest, Claim, DynStore, Fingerprint, Key, Outcome, Scope, ScopeSecret, WriteHealth,
};
use idempotency_http::Problem;
use metrics_exporter_prometheus::PrometheusHandle;

/// The gateway's policy as `/policy` publishes it, replaced when the configuration is reloaded.
pub type SharedPolicy = std::sync::Arc<std::sync::RwLock<serde_json::Value>>;

/// The prefix of the gateway's own endpoints on the main listener.
pub const ADMIN_PREFIX: &str = "/_idem";

/// Whether the process is shutting down: set at the first moment of `SIGTERM`, so that
/// `/readyz` answers `503` (and load balancers stop sending) while running work drains.
#[derive(Debug, Clone, Default)]
pub struct Draining(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Draining {
    /// From now on, `/readyz` answers `503`.
    pub fn start(&self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether [`start`](Self::start) was called.
    #[must_use]
    pub fn is_draining(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// What the admin endpoints (`/healthz`, `/metrics`) answer from.
#[derive(Clone, derive_more::Debug)]
pub struct Admin {
    #[debug(skip)]
    store: DynStore,
    /// The store's kind (its URL scheme): enough for an operator, and no credential can be in it.
    store_kind: String,
    /// The results of the guarded requests' store writes.
    #[debug(skip)]
    health: WriteHealth,
    #[debug(skip)]
    metrics: PrometheusHandle,
    /// The gateway's published policy (`/policy`), when there is one; a reload replaces it.
    #[debug(skip)]
    policy: Option<SharedPolicy>,
    /// Set when shutdown begins: `/readyz` answers `503` from then on.
    #[debug(skip)]
    draining: Draining,
}

impl Admin {
    /// The admin state of the store opened from `url`.
    pub fn new(store: DynStore, url: &str, health: WriteHealth, metrics: PrometheusHandle) -> Self {
        Self {
            store,
            store_kind: idempotency::registry()
                .kind(url)
                .map_or("unknown", |kind| kind.name)
                .to_owned(),
            health,
            metrics,
            policy: None,
            draining: Draining::default(),
        }
    }

    /// What `/readyz` reads to know that shutdown has begun; start it when the signal comes.
    #[must_use]
    pub fn draining(&self) -> Draining {
        self.draining.clone()
    }

    /// The process's metrics, as `/metrics` renders them.
    #[must_use]
    pub fn metrics(&self) -> &PrometheusHandle {
        &self.metrics
    }

    /// The store the admin endpoints check.
    #[must_use]
    pub fn store(&self) -> &DynStore {
        &self.store
    }

    /// The store's kind (its URL scheme): no credential can be in it.
    #[must_use]
    pub fn store_kind(&self) -> &str {
        &self.store_kind
    }

    /// Publishes `policy` at `/policy`: what clients may rely on, per route.
    #[must_use]
    pub fn policy(mut self, policy: SharedPolicy) -> Self {
        self.policy = Some(policy);
        self
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

/// Why the store check failed: the text the health endpoints answer with.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StoreCheckError {
    /// Writes failed, and so does a probe write now.
    #[error("{failure}; a probe write failed too: {now}")]
    Writes {
        failure: idempotency::WriteFailure,
        now: idempotency::StoreError,
    },
    /// The store does not answer a read.
    #[error(transparent)]
    Read(#[from] idempotency::StoreError),
    /// The probe's scope or key is refused by the key rules.
    #[error(transparent)]
    Key(#[from] idempotency::KeyError),
    /// The store did not answer in time.
    #[error("the store did not answer within 2s")]
    Timeout,
}

/// `Ok` when the store answers a read and its writes work: the last guarded request's write
/// worked, or, when it failed, a probe write works now. What failed otherwise.
pub(crate) async fn store_check(admin: &Admin) -> Result<(), StoreCheckError> {
    let probe = async {
        if let Some(failure) = admin.health.failure() {
            probe_write(&admin.store)
                .await
                .map_err(|now| StoreCheckError::Writes { failure, now })?;
        }
        let scope = Scope::new("idem-healthz")?;
        let key = Key::new("probe")?;
        admin.store.get(&scope, &key).await?;
        Ok(())
    };
    tokio::time::timeout(Duration::from_secs(2), probe)
        .await
        .unwrap_or(Err(StoreCheckError::Timeout))
}

/// `200` `{"status": STATUS}` when the store check passes, `503` with what failed otherwise.
async fn store_answer(admin: &Admin, status: &str) -> Response {
    match store_check(admin).await {
        Ok(()) => {
            axum::Json(serde_json::json!({ "status": status, "store": admin.store_kind })).into_response()
        }
        Err(why) => Problem::StoreUnavailable
            .to_response_with_detail(&why.to_string())
            .map(Body::from),
    }
}

/// The store check alone, draining or not.
async fn healthz(State(admin): State<Admin>) -> Response {
    store_answer(&admin, "ok").await
}

/// `200` while the process answers: a liveness probe that restarts it only when it is wedged,
/// never because its store is away (a restart would not bring the store back).
async fn livez() -> Response {
    axum::Json(serde_json::json!({ "status": "alive" })).into_response()
}

/// `503` from the moment shutdown begins (`{"status":"draining"}`), else as `/healthz`: a
/// readiness probe that takes the process out of rotation while the store is away or it drains.
async fn readyz(State(admin): State<Admin>) -> Response {
    if admin.draining.is_draining() {
        return (
            http::StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({ "status": "draining", "store": admin.store_kind })),
        )
            .into_response();
    }
    store_answer(&admin, "ready").await
}

async fn metrics_text(State(admin): State<Admin>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        admin.metrics.render(),
    )
        .into_response()
}

async fn policy(State(admin): State<Admin>) -> Response {
    match &admin.policy {
        Some(policy) => {
            let policy = policy
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone();
            axum::Json(policy).into_response()
        }
        None => http::StatusCode::NOT_FOUND.into_response(),
    }
}

/// `/livez`, `/readyz`, `/healthz` and `/metrics` under `prefix` (`""` on a listener of their
/// own, [`ADMIN_PREFIX`] beside the gateway's proxy), and `/policy` when the gateway publishes
/// one.
pub fn admin_router(admin: Admin, prefix: &str) -> Router {
    let router = Router::new()
        .route(&format!("{prefix}/livez"), get(livez))
        .route(&format!("{prefix}/readyz"), get(readyz))
        .route(&format!("{prefix}/healthz"), get(healthz))
        .route(&format!("{prefix}/metrics"), get(metrics_text));
    let router = if admin.policy.is_some() {
        router.route(&format!("{prefix}/policy"), get(policy))
    } else {
        router
    };
    router.with_state(admin)
}
