//! An axum service with two routes protected differently by the idempotency layer, on the
//! embedded SQLite store.
//!
//! ```sh
//! cargo run -p axum-service-example            # listens on 127.0.0.1:3000, store ./example.db
//! ```
//!
//! * `POST /payments` — a key is **required**, the body is fingerprinted as canonical JSON (so
//!   whitespace and member order do not matter), responses are scoped by `Authorization`, and a
//!   duplicate arriving while the first is running waits up to 5 s for its response.
//! * `POST /emails` — a key is **optional** (requests without one are not deduplicated), a
//!   duplicate in flight gets `409` at once, and responses are kept for one hour.
//!
//! Try it:
//!
//! ```sh
//! curl -si localhost:3000/payments -H 'Idempotency-Key: "pay-1"' -d '{"amount": 1000}'
//! curl -si localhost:3000/payments -H 'Idempotency-Key: "pay-1"' -d '{ "amount":1000 }'  # replay
//! curl -si localhost:3000/payments -H 'Idempotency-Key: "pay-1"' -d '{"amount": 5}'      # 422
//! curl -si localhost:3000/payments -d '{"amount": 1000}'                                  # 400
//! ```
#![allow(clippy::print_stdout)] // telling the user where it listens is the point

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::routing::post;
use axum::{Extension, Json, Router};
use idempotency_core::{FingerprintMode, ScopeSecret};
use idempotency_http::{IdempotencyKey, IdempotencyLayer};
use idempotency_sqlite::SqliteStore;

#[derive(Clone, Default)]
struct Ledger {
    next_id: Arc<AtomicU64>,
}

async fn pay(
    State(ledger): State<Ledger>,
    key: Extension<IdempotencyKey>,
    Json(body): Json<serde_json::Value>,
) -> (
    StatusCode,
    [(header::HeaderName, String); 1],
    Json<serde_json::Value>,
) {
    // A real service would charge a card here, passing `key.key` to the payment provider.
    let id = ledger.next_id.fetch_add(1, Ordering::SeqCst) + 1;
    let payment =
        serde_json::json!({ "id": id, "amount": body["amount"], "idempotency_key": key.key.as_str() });
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/payments/{id}"))],
        Json(payment),
    )
}

async fn email(State(ledger): State<Ledger>) -> (StatusCode, &'static str) {
    let _ = ledger.next_id.load(Ordering::SeqCst);
    (StatusCode::ACCEPTED, "queued")
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("STORE_URL").unwrap_or_else(|_| "sqlite://example.db".into());
    let listen = std::env::var("LISTEN").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let store = SqliteStore::open(&url).await?;

    let payments = IdempotencyLayer::new(store.clone())
        .name("payments")
        .require_key(true)
        .fingerprint(FingerprintMode::CanonicalJson)
        // Generated once and kept in the store, so every instance on it scopes alike.
        .scope_from_header(header::AUTHORIZATION, ScopeSecret::kept_in(&store).await?)
        .wait(Duration::from_secs(5));
    let emails = IdempotencyLayer::new(store)
        .name("emails")
        .retention(Duration::from_secs(3600));

    let app = Router::new()
        .route("/payments", post(pay).layer(payments))
        .route("/emails", post(email).layer(emails))
        .with_state(Ledger::default());

    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("listening on http://{listen} (store {url})");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
