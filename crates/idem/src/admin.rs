//! The admin endpoints of `idem serve` and `idem consume`: `/healthz` (the store answers and
//! its writes work), `/metrics` (Prometheus) and, for the gateway, `/policy` (its idempotency
//! policy per route, as the IETF draft asks servers to publish), under [`ADMIN_PREFIX`] on the
//! main listener or on a listener of their own.

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

/// What the admin endpoints (`/healthz`, `/metrics`) answer from.
#[derive(Clone)]
pub struct Admin {
    store: DynStore,
    /// The store's kind (its URL scheme): enough for an operator, and no credential can be in it.
    store_kind: String,
    /// The results of the guarded requests' store writes.
    health: WriteHealth,
    metrics: PrometheusHandle,
    /// The gateway's published policy (`/policy`), when there is one; a reload replaces it.
    policy: Option<SharedPolicy>,
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin")
            .field("store_kind", &self.store_kind)
            .finish_non_exhaustive()
    }
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
        }
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

/// `/healthz` and `/metrics` under `prefix` (`""` on a listener of their own,
/// [`ADMIN_PREFIX`] beside the gateway's proxy), and `/policy` when the gateway publishes one.
pub fn admin_router(admin: Admin, prefix: &str) -> Router {
    let router = Router::new()
        .route(&format!("{prefix}/healthz"), get(healthz))
        .route(&format!("{prefix}/metrics"), get(metrics_text));
    let router = if admin.policy.is_some() {
        router.route(&format!("{prefix}/policy"), get(policy))
    } else {
        router
    };
    router.with_state(admin)
}
