//! Payments from the HTTP edge to the charge row, effectively once.
//!
//! 1. `POST /payments` runs behind the idempotency layer (key required, canonical-JSON
//!    fingerprint, scoped by `Authorization`, duplicates in flight wait for the first
//!    response). The handler validates the payment and publishes `payment.initiated` to
//!    RabbitMQ with the request's [`IdempotencyKey::message_key`], and waits for the broker's
//!    confirm before answering `202`. If the broker does not confirm, it answers `503`, the
//!    layer releases the key, and the client's retry publishes again.
//! 2. The charger consumes `payment.initiated` in **same-transaction mode** on PostgreSQL: it
//!    claims the message's key, charges the [`Gateway`] (passing the key, as real payment
//!    providers accept), and writes the charge row in the record's transaction. A crash, a lost
//!    connection or a gateway timeout rolls the row and the claim back together; the
//!    redelivery charges again with the same key, which the gateway answers from its own
//!    record.
//!
//! However often the client retries and the broker redelivers, the charges table ends with
//! one row per payment.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use idempotency_amqp::AmqpMessage;
use idempotency_consumer::{Backoff, Delivery, HandlerError, TxConsumer, TxHandler};
use idempotency_core::{Attempt, FingerprintMode, Outcome, ScopeSecret, Store};
use idempotency_http::{IdempotencyKey, IdempotencyLayer};
use idempotency_postgres::sqlx::{self, AssertSqlSafe, PgPool};
use idempotency_postgres::{PgTransaction, PostgresStore};
use lapin::Channel;

/// The queue `payment.initiated` messages go to.
pub const QUEUE: &str = "payment.initiated";

/// Creates the charges table `table` if it is missing.
///
/// It deliberately has no unique constraint on `payment_key`, so that the end-to-end test
/// shows the consumer, not a constraint, keeping one row per payment. In production, add one
/// as a second line of defence.
///
/// # Errors
///
/// The database's error.
pub async fn create_charges_table(pool: &PgPool, table: &str) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {table} (
            id bigserial PRIMARY KEY,
            payment_key text NOT NULL,
            account text NOT NULL,
            amount_cents bigint NOT NULL,
            currency text NOT NULL,
            gateway_ref text NOT NULL,
            charged_at timestamptz NOT NULL DEFAULT now()
        )"
    )))
    .execute(pool)
    .await
    .map(|_| ())
}

/// A payment as the API accepts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payment {
    /// The account to charge.
    pub account: String,
    /// The amount, in the currency's minor unit.
    pub amount_cents: i64,
    /// An ISO 4217 code: three capital letters.
    pub currency: String,
}

impl Payment {
    /// Reads and validates a payment from JSON.
    ///
    /// # Errors
    ///
    /// What is wrong with it, for the client.
    pub fn from_json(json: &serde_json::Value) -> Result<Self, String> {
        let account = json["account"]
            .as_str()
            .filter(|a| !a.is_empty() && a.len() <= 64)
            .ok_or("`account` must be a string of 1 to 64 characters")?;
        let amount_cents = json["amount_cents"]
            .as_i64()
            .filter(|&a| a > 0)
            .ok_or("`amount_cents` must be a positive integer")?;
        let currency = json["currency"]
            .as_str()
            .filter(|c| c.len() == 3 && c.bytes().all(|b| b.is_ascii_uppercase()))
            .ok_or("`currency` must be three capital letters")?;
        Ok(Self {
            account: account.to_owned(),
            amount_cents,
            currency: currency.to_owned(),
        })
    }

    /// The `payment.initiated` message body.
    #[must_use]
    pub fn to_message(&self, payment_id: &str) -> Vec<u8> {
        serde_json::json!({
            "payment_id": payment_id,
            "account": self.account,
            "amount_cents": self.amount_cents,
            "currency": self.currency,
        })
        .to_string()
        .into_bytes()
    }
}

/// Where the API publishes.
#[derive(Debug, Clone)]
pub struct Publisher {
    /// A channel in confirm mode (see [`idempotency_amqp::Topology::declare`]).
    pub channel: Channel,
    /// The queue to publish to.
    pub queue: String,
}

fn problem(status: StatusCode, title: &str, detail: &str) -> Response {
    let body = serde_json::json!({ "type": "about:blank", "title": title, "status": status.as_u16(), "detail": detail });
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

async fn initiate(
    State(publisher): State<Publisher>,
    Extension(key): Extension<IdempotencyKey>,
    Json(body): Json<serde_json::Value>,
) -> Response {
    let payment = match Payment::from_json(&body) {
        Ok(payment) => payment,
        // Stored and replayed: the same request is just as invalid the next time.
        Err(why) => return problem(StatusCode::UNPROCESSABLE_ENTITY, "invalid payment", &why),
    };
    // One key from the client's retry to the broker's redelivery.
    let message_key = key.message_key();
    let payment_id = message_key.as_str();
    let published = idempotency_amqp::publish(
        &publisher.channel,
        "",
        &publisher.queue,
        &message_key,
        &payment.to_message(payment_id),
    )
    .await;
    if let Err(error) = published {
        tracing::warn!(%error, "payment.initiated not confirmed");
        // 5xx releases the key: the client's retry publishes again, and the consumer dedupes.
        return problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "payment not accepted yet",
            "the message broker did not confirm; retry with the same key",
        );
    }
    (
        StatusCode::ACCEPTED,
        Json(serde_json::json!({ "payment_id": payment_id, "status": "pending" })),
    )
        .into_response()
}

/// The API: `POST /payments` behind the idempotency layer on `store`, keys scoped by the
/// caller's `Authorization` under `scope_secret` (the same on every instance).
pub fn api<S: Store + Clone + 'static>(store: S, scope_secret: ScopeSecret, publisher: Publisher) -> Router {
    let layer = IdempotencyLayer::new(store)
        .name("payments-api")
        .require_key(true)
        .fingerprint(FingerprintMode::CanonicalJson)
        .scope_from_header(header::AUTHORIZATION, scope_secret)
        .wait(Duration::from_secs(5));
    Router::new()
        .route("/payments", post(initiate))
        .layer(layer)
        .with_state(publisher)
}

/// Why the gateway refused to answer this time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayTimeout;

/// A fake payment provider that, like real ones, deduplicates charges by idempotency key: a
/// repeated charge with the same key returns the first charge's reference without charging
/// again.
#[derive(Debug, Default)]
pub struct Gateway {
    charges: Mutex<HashMap<String, String>>,
    calls: AtomicU64,
    fail_every: u64,
    fail_after_charge: bool,
    latency: Duration,
}

impl Gateway {
    /// A gateway whose calls take `latency` and always answer.
    #[must_use]
    pub fn new(latency: Duration) -> Self {
        Self {
            latency,
            ..Self::default()
        }
    }

    /// Every `every`-th call times out; after making the charge if `after_charge` (the
    /// ambiguous failure that makes providers' idempotency keys necessary).
    #[must_use]
    pub fn timing_out(mut self, every: u64, after_charge: bool) -> Self {
        self.fail_every = every;
        self.fail_after_charge = after_charge;
        self
    }

    /// Charges `amount_cents` to `account` under `key`; returns the charge's reference.
    ///
    /// # Errors
    ///
    /// [`GatewayTimeout`] on injected failures.
    pub async fn charge(
        &self,
        key: &str,
        account: &str,
        amount_cents: i64,
    ) -> Result<String, GatewayTimeout> {
        tokio::time::sleep(self.latency).await;
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        let fail = self.fail_every > 0 && call.is_multiple_of(self.fail_every);
        if fail && !self.fail_after_charge {
            return Err(GatewayTimeout);
        }
        let reference = {
            let mut charges = self
                .charges
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let next = charges.len() + 1;
            charges
                .entry(key.to_owned())
                .or_insert_with(|| format!("ch_{next}_{account}_{amount_cents}"))
                .clone()
        };
        if fail {
            return Err(GatewayTimeout);
        }
        Ok(reference)
    }

    /// How many distinct charges the gateway made.
    #[must_use]
    pub fn charges(&self) -> usize {
        self.charges
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }

    /// How many times it was called.
    #[must_use]
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }
}

/// Charges `payment.initiated` messages and writes the charge row in the record's transaction.
#[derive(Debug, Clone)]
pub struct Charger {
    gateway: Arc<Gateway>,
    table: Arc<str>,
}

impl Charger {
    /// A charger that calls `gateway` and writes to the charges table `table`.
    #[must_use]
    pub fn new(gateway: Arc<Gateway>, table: &str) -> Self {
        Self {
            gateway,
            table: table.into(),
        }
    }
}

impl TxHandler<AmqpMessage, PostgresStore> for Charger {
    async fn handle(
        &self,
        message: &AmqpMessage,
        tx: &mut PgTransaction,
        attempt: &Attempt,
    ) -> Result<Outcome, HandlerError> {
        let json: serde_json::Value = serde_json::from_slice(message.payload())
            .map_err(|e| HandlerError::fatal(format!("payment.initiated is not JSON: {e}")))?;
        let payment = Payment::from_json(&json).map_err(HandlerError::fatal)?;
        let reference = self
            .gateway
            .charge(attempt.key().as_str(), &payment.account, payment.amount_cents)
            .await
            .map_err(|GatewayTimeout| HandlerError::retry("the payment gateway timed out"))?;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (payment_key, account, amount_cents, currency, gateway_ref)
             VALUES ($1, $2, $3, $4, $5)",
            self.table
        )))
        .bind(attempt.key().as_str())
        .bind(&payment.account)
        .bind(payment.amount_cents)
        .bind(&payment.currency)
        .bind(&reference)
        .execute(&mut **tx)
        .await
        .map_err(|e| HandlerError::retry(format!("writing the charge: {e}")))?;
        Ok(Outcome::new(reference))
    }
}

/// The charger as a same-transaction consumer on `store`: retries after 100 ms doubling to 5 s,
/// dead-lettered after 8 deliveries.
#[must_use]
pub fn charger(store: PostgresStore, charger: Charger) -> TxConsumer<PostgresStore, Charger> {
    TxConsumer::new("payments-charger", store, charger)
        .backoff(Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(5),
        })
        .max_deliveries(8)
}
