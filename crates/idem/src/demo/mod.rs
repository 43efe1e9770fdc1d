//! `idem demo`: a sample payments upstream that charges through a payment provider, the gateway
//! in front of it on the embedded SQLite store, and a client storm — retries after timeouts,
//! duplicates, concurrent races, a key reused with another payload — against an upstream that
//! also fails *after* charging (a 500, a dropped connection). It ends in a table whose
//! double-charge count comes from the provider's own ledger.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::RngExt;
use serde_json::json;

use idempotency::Backoff;

use crate::error::Error;
use crate::gateway::{self, Config};
use crate::units::format_duration;

pub mod command;
pub mod consume;

/// How the demo's clients back off between retries: 20 ms doubling to 320 ms.
const CLIENT_RETRY: Backoff = Backoff {
    initial: Duration::from_millis(20),
    max: Duration::from_millis(320),
};

/// How long the demo's clients wait for an answer: 100 ms on the first try, as impatient
/// clients do, doubling on each retry up to 3.2 s, so that a loaded machine slows the storm
/// down instead of failing payments.
const CLIENT_TIMEOUT: Backoff = Backoff {
    initial: Duration::from_millis(100),
    max: Duration::from_millis(3200),
};

/// What the demo is asked to do.
#[derive(Debug, Clone)]
pub struct Options {
    /// Roughly how many requests the storm sends.
    pub requests: usize,
    /// The store URL; `None`: a fresh SQLite file in a temporary directory.
    pub store: Option<String>,
    /// Payments in progress at once.
    pub concurrency: usize,
    /// Show the progress bar.
    pub progress: bool,
    /// Send the storm straight to the upstream, without the gateway: what the clients' retries
    /// do to the ledger on their own.
    pub direct: bool,
    /// Whether the upstream passes the forwarded `Idempotency-Key` on to its payment provider
    /// (the default); turning it off shows the double charges the propagation prevents.
    pub propagate: bool,
    /// Whether the gateway asks the upstream's lookup (`GET /charges/by-key/{key}`) before it
    /// runs a payment again.
    pub reconcile: bool,
}

/// The payment provider behind the sample upstream. It deduplicates by the idempotency key the
/// upstream passes it, as real providers do, and its ledger is where double charges are
/// counted: every charge beyond the first for one order (the key the upstream was called with).
#[derive(Debug, Default)]
struct Provider {
    /// The provider's idempotency keys it has charged for, and the charge.
    charged: Mutex<HashMap<String, String>>,
    /// Charges made per order.
    orders: Mutex<HashMap<String, u64>>,
    /// The first charge of each order, and its amount: what the provider's lookup by order
    /// answers.
    first: Mutex<HashMap<String, (String, i64)>>,
    charges: AtomicU64,
}

impl Provider {
    /// Charges once per `provider_key`: a key it has seen gets the charge it made then.
    fn charge(&self, provider_key: &str, order: &str, amount: i64) -> String {
        let mut charged = self
            .charged
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(charge) = charged.get(provider_key) {
            return charge.clone();
        }
        let charge = format!("ch_{}", self.charges.fetch_add(1, Ordering::Relaxed) + 1);
        charged.insert(provider_key.to_owned(), charge.clone());
        self.first
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(order.to_owned())
            .or_insert_with(|| (charge.clone(), amount));
        *self
            .orders
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(order.to_owned())
            .or_default() += 1;
        charge
    }

    /// The first charge made for `order`, and its amount.
    fn lookup(&self, order: &str) -> Option<(String, i64)> {
        self.first
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(order)
            .cloned()
    }

    /// (charges made, charges beyond the first for an order).
    fn charges(&self) -> (u64, u64) {
        let orders = self
            .orders
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let doubles = orders.values().map(|n| n.saturating_sub(1)).sum();
        (self.charges.load(Ordering::Relaxed), doubles)
    }
}

/// The sample upstream: a merchant's payments service that charges through the [`Provider`].
#[derive(Debug, Default)]
struct Upstream {
    provider: Provider,
    /// Whether the upstream passes the `Idempotency-Key` it receives on to the provider, as the
    /// README tells users to; without it, it makes a fresh key per call, as a naive service
    /// would.
    propagate: bool,
    /// Calls that went as far as charging.
    executions: AtomicU64,
    /// Of those, the ones with `Idempotency-Attempt` of 2 or more: the gateway ran the payment
    /// again after a release or an unknown outcome.
    re_executions: AtomicU64,
    /// Calls that charged and then failed: a 500, or a connection dropped before the answer.
    faults_after_charging: AtomicU64,
    /// Lookups by key that found the payment (the gateway adopts each instead of charging
    /// again).
    found: AtomicU64,
}

/// What the sample upstream does after charging, now and then.
enum AfterCharging {
    Answer,
    Fail,
    Drop,
}

/// `POST /charges`: charges once per call through the provider. It is slow now and then (client
/// timeouts), fails transiently before charging on about 3% of calls (503), and after charging
/// on about 4%: a 500 (its own bug) or a dropped connection (a crash), so the gateway has to run
/// the payment again and only the propagated key stands between that and a double charge.
async fn charge(State(upstream): State<Arc<Upstream>>, headers: HeaderMap, body: Bytes) -> Response {
    let Some(key) = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
    else {
        return (
            StatusCode::BAD_REQUEST,
            "the gateway always forwards Idempotency-Key",
        )
            .into_response();
    };
    let amount = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|json| json["amount_cents"].as_i64());
    let Some(amount) = amount else {
        return (StatusCode::UNPROCESSABLE_ENTITY, "amount_cents is required").into_response();
    };
    let (latency, fail_before, after) = {
        let mut rng = rand::rng();
        let slow = rng.random_ratio(1, 10);
        let latency = if slow {
            rng.random_range(150..300)
        } else {
            rng.random_range(2..20)
        };
        let after = match rng.random_range(0..100) {
            0 | 1 => AfterCharging::Fail,
            2 | 3 => AfterCharging::Drop,
            _ => AfterCharging::Answer,
        };
        (Duration::from_millis(latency), rng.random_ratio(3, 100), after)
    };
    tokio::time::sleep(latency).await;
    if fail_before {
        return (StatusCode::SERVICE_UNAVAILABLE, "card network busy, try again").into_response();
    }
    let attempt = headers
        .get(gateway::IDEMPOTENCY_ATTEMPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("1")
        .to_owned();
    upstream.executions.fetch_add(1, Ordering::Relaxed);
    if attempt != "1" {
        upstream.re_executions.fetch_add(1, Ordering::Relaxed);
    }
    let provider_key = if upstream.propagate {
        key.clone()
    } else {
        idempotency::Key::generate().as_str().to_owned()
    };
    let charge_id = upstream.provider.charge(&provider_key, &key, amount);
    match after {
        AfterCharging::Answer => (
            StatusCode::CREATED,
            [("set-cookie", "session=upstream-only; HttpOnly")],
            axum::Json(json!({ "charge_id": charge_id, "amount_cents": amount, "attempt": attempt })),
        )
            .into_response(),
        AfterCharging::Fail => {
            upstream.faults_after_charging.fetch_add(1, Ordering::Relaxed);
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "charged, then failed to save the order",
            )
                .into_response()
        }
        AfterCharging::Drop => {
            upstream.faults_after_charging.fetch_add(1, Ordering::Relaxed);
            // The answer's headers go out, then the body breaks off: the connection is cut
            // before the client learns the outcome, as when the service crashes.
            let broken = futures_util::stream::once(async {
                Err::<Bytes, _>(std::io::Error::other("the service crashed after charging"))
            });
            (StatusCode::CREATED, axum::body::Body::from_stream(broken)).into_response()
        }
    }
}

/// `GET /charges/by-key/{key}`: the upstream's lookup, the reconcile hook's question. It asks
/// the provider for the payment made for that order (the key the gateway forwarded): what the
/// payment request answered (`201` and the charge), or `404` when none was made.
async fn by_key(
    State(upstream): State<Arc<Upstream>>,
    axum::extract::Path(key): axum::extract::Path<String>,
) -> Response {
    match upstream.provider.lookup(&key) {
        Some((charge_id, amount)) => {
            upstream.found.fetch_add(1, Ordering::Relaxed);
            (
                StatusCode::CREATED,
                axum::Json(json!({ "charge_id": charge_id, "amount_cents": amount, "reconciled": true })),
            )
                .into_response()
        }
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn serve(router: Router) -> Result<SocketAddr, Error> {
    let (listener, addr) = crate::server::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok(addr)
}

#[derive(Debug, Default)]
struct Counters {
    requests: AtomicU64,
    /// Payments whose client is done (answered, or gave up): the progress, which the requests
    /// cannot measure (their number depends on the retries).
    payments_done: AtomicU64,
    replays: AtomicU64,
    conflicts: AtomicU64,
    mismatches: AtomicU64,
    timeouts: AtomicU64,
    released: AtomicU64,
    failed_payments: AtomicU64,
    /// Latencies of answered requests, in microseconds (3 significant digits).
    latencies: Mutex<Latencies>,
}

/// What one request got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Got {
    Ok,
    Conflict,
    Mismatch,
    Retryable,
    Timeout,
}

struct Storm {
    client: Client<HttpConnector, Full<Bytes>>,
    gateway: SocketAddr,
    counters: Counters,
}

impl Storm {
    async fn send(&self, tenant: &str, key: &str, amount: i64, try_number: u32) -> Got {
        let body = json!({ "amount_cents": amount, "currency": "EUR" }).to_string();
        let request = http::Request::post(format!("http://{}/charges", self.gateway))
            .header("authorization", tenant)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)));
        let Ok(request) = request else {
            return Got::Retryable;
        };
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        // The client gives up after its timeout and retries.
        let response = tokio::time::timeout(CLIENT_TIMEOUT.delay(try_number), async {
            let response = self.client.request(request).await.ok()?;
            let replayed = response.headers().contains_key("idempotent-replayed");
            let status = response.status();
            let _ = response.into_body().collect().await.ok()?;
            Some((status, replayed))
        })
        .await;
        let got = match response {
            Err(_) => {
                self.counters.timeouts.fetch_add(1, Ordering::Relaxed);
                Got::Timeout
            }
            Ok(None) => Got::Retryable,
            Ok(Some((status, replayed))) => {
                if replayed {
                    self.counters.replays.fetch_add(1, Ordering::Relaxed);
                }
                match status.as_u16() {
                    200..=299 => Got::Ok,
                    409 => {
                        self.counters.conflicts.fetch_add(1, Ordering::Relaxed);
                        Got::Conflict
                    }
                    422 => {
                        self.counters.mismatches.fetch_add(1, Ordering::Relaxed);
                        Got::Mismatch
                    }
                    _ => {
                        self.counters.released.fetch_add(1, Ordering::Relaxed);
                        Got::Retryable
                    }
                }
            }
        };
        if got != Got::Timeout {
            self.counters
                .latencies
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .record(started.elapsed());
        }
        got
    }

    /// Sends until the answer is final (success or mismatch) or 20 tries have gone, backing
    /// off after conflicts, timeouts and 5xx; returns the last answer.
    async fn until_final(&self, tenant: &str, key: &str, amount: i64) -> Got {
        let mut got = Got::Timeout;
        for try_number in 1..=20_u32 {
            got = self.send(tenant, key, amount, try_number).await;
            match got {
                Got::Ok | Got::Mismatch => break,
                Got::Conflict | Got::Retryable | Got::Timeout => {
                    tokio::time::sleep(CLIENT_RETRY.delay(try_number)).await;
                }
            }
        }
        got
    }

    /// Sends until the payment succeeds (see `until_final`); returns whether it did.
    async fn until_done(&self, tenant: &str, key: &str, amount: i64) -> bool {
        self.until_final(tenant, key, amount).await == Got::Ok
    }

    /// One payment, in one of four client behaviours.
    async fn payment(&self, n: usize) {
        let tenant = ["Bearer tenant-a", "Bearer tenant-b", "Bearer tenant-c"][n % 3];
        let key = format!("payment-{n}");
        let amount = 1000 + i64::try_from(n % 500).unwrap_or(0);
        let done = match n % 20 {
            // Concurrent copies racing each other (a double-click, a retrying load balancer).
            0..=4 => {
                let racers = (0..3).map(|_| self.until_done(tenant, &key, amount));
                futures_util::future::join_all(racers)
                    .await
                    .into_iter()
                    .all(|ok| ok)
            }
            // A plain duplicate: the client sends the same request twice.
            5..=8 => {
                self.until_done(tenant, &key, amount).await && self.until_done(tenant, &key, amount).await
            }
            // The key reused with another payload: rejected, never charged.
            9..=11 => {
                let ok = self.until_done(tenant, &key, amount).await;
                let reused = self.until_final(tenant, &key, amount + 1).await;
                ok && reused == Got::Mismatch
            }
            // Retries after timeouts and transient failures only.
            _ => self.until_done(tenant, &key, amount).await,
        };
        if !done {
            self.counters.failed_payments.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The demo's outcome.
#[derive(Debug, Clone)]
pub struct Report {
    /// The store the gateway ran on (password redacted); `None` without the gateway.
    pub store: Option<String>,
    /// Logical payments the clients made.
    pub payments: u64,
    /// Requests sent.
    pub requests: u64,
    /// Requests beyond the first of each payment.
    pub duplicates: u64,
    /// Responses replayed from the store.
    pub replays: u64,
    /// `409` answers (a duplicate arrived while the first was running).
    pub conflicts: u64,
    /// `422` answers (a key reused with another payload).
    pub mismatches: u64,
    /// Requests the client gave up on.
    pub client_timeouts: u64,
    /// `5xx` answers the clients got and retried: the upstream failed (the key was released),
    /// or its answer was lost (the key stayed in flight until its lease ended).
    pub released: u64,
    /// Payments that did not succeed within their tries.
    pub failed_payments: u64,
    /// Whether the upstream passed the forwarded key on to the provider.
    pub propagated: bool,
    /// Whether the gateway asked the upstream's lookup before running a payment again.
    pub reconcile: bool,
    /// Payments the lookup found after a fault: adopted by the gateway instead of run again.
    pub reconciled: u64,
    /// Calls of the upstream that went as far as charging.
    pub executions: u64,
    /// Of those, runs the gateway started again (`Idempotency-Attempt` 2 or more) after a
    /// release or an unknown outcome.
    pub re_executions: u64,
    /// Upstream calls that charged and then failed (a 500, a dropped connection).
    pub faults_after_charging: u64,
    /// Charges the provider made.
    pub charges: u64,
    /// Charges beyond the first for one order, from the provider's ledger.
    pub double_charges: u64,
    /// Latency percentiles of answered requests.
    pub p50: Duration,
    /// See `p50`.
    pub p90: Duration,
    /// See `p50`.
    pub p99: Duration,
    /// How long the storm took.
    pub elapsed: Duration,
}

impl Report {
    /// The report as JSON.
    #[must_use]
    pub fn to_json(&self) -> serde_json::Value {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        json!({
            "store": self.store,
            "through_gateway": self.store.is_some(),
            "payments": self.payments,
            "requests": self.requests,
            "duplicates": self.duplicates,
            "replays": self.replays,
            "conflicts": self.conflicts,
            "mismatches_rejected": self.mismatches,
            "client_timeouts": self.client_timeouts,
            "server_errors_retried": self.released,
            "failed_payments": self.failed_payments,
            "key_propagated": self.propagated,
            "reconcile": self.reconcile,
            "reconciled": self.reconciled,
            "upstream_executions": self.executions,
            "re_executions": self.re_executions,
            "faults_after_charging": self.faults_after_charging,
            "charges": self.charges,
            "double_charges": self.double_charges,
            "latency_ms": { "p50": ms(self.p50), "p90": ms(self.p90), "p99": ms(self.p99) },
            "elapsed_ms": ms(self.elapsed),
        })
    }

    /// The report as a table.
    #[must_use]
    pub fn to_table(&self) -> String {
        let ms = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1000.0);
        let mut rows = vec![
            vec!["payments".into(), self.payments.to_string()],
            vec!["requests sent".into(), self.requests.to_string()],
            vec!["duplicates sent".into(), self.duplicates.to_string()],
            vec!["replays served".into(), self.replays.to_string()],
            vec![
                "conflicts (409, still running)".into(),
                self.conflicts.to_string(),
            ],
            vec!["mismatches rejected (422)".into(), self.mismatches.to_string()],
            vec!["client timeouts".into(), self.client_timeouts.to_string()],
            vec!["5xx answers (retried)".into(), self.released.to_string()],
        ];
        rows.extend(ledger_rows(
            "upstream",
            [
                self.executions,
                self.re_executions,
                self.faults_after_charging,
                self.charges,
                self.double_charges,
            ],
        ));
        rows.insert(
            rows.len() - 2,
            vec![
                "reconciled (found by the lookup, not run again)".into(),
                if self.reconcile {
                    self.reconciled.to_string()
                } else {
                    "- (no --reconcile)".into()
                },
            ],
        );
        rows.push(vec![
            "latency p50 / p90 / p99 (ms)".into(),
            format!("{} / {} / {}", ms(self.p50), ms(self.p90), ms(self.p99)),
        ]);
        let route = match &self.store {
            Some(store) => format!("through the gateway on {store}"),
            None => "straight to the upstream, without the gateway".to_owned(),
        };
        let mut out = format!(
            "idem demo: {} payments, {} requests {route} in {}\n\n",
            self.payments,
            self.requests,
            format_duration(Duration::from_millis(
                u64::try_from(self.elapsed.as_millis()).unwrap_or(u64::MAX)
            ))
        );
        out.push_str(&crate::ops::table(&["", ""], &rows));
        if !self.propagated && self.reconcile {
            out.push_str(&format!(
                "\nThe upstream did not pass the Idempotency-Key on to the provider, but the gateway \
                 asked its lookup before running a payment again: {} payments charged before a fault \
                 were found and their charges adopted instead of made again.\n",
                self.reconciled
            ));
        } else if !self.propagated {
            out.push_str(
                "\nThe upstream did not pass the Idempotency-Key on to the provider: each run after a \
                 fault charged again. Pass it on, or let the gateway ask first (--reconcile), and \
                 none is charged twice.\n",
            );
        }
        if self.failed_payments > 0 {
            out.push_str(&format!(
                "\n{} payments did not get the answer they should within 20 tries (the upstream kept \
                 failing, or a key reused with another payload was not rejected).\n",
                self.failed_payments
            ));
        }
        out
    }
}

/// The table rows both demos end with: the `service`'s executions, its re-executions and
/// faults after charging, and the provider's charges and double charges.
fn ledger_rows(
    service: &str,
    [executions, re_executions, faults, charges, doubles]: [u64; 5],
) -> Vec<Vec<String>> {
    vec![
        vec![format!("{service} executions"), executions.to_string()],
        vec!["re-executions (attempt 2+)".into(), re_executions.to_string()],
        vec![format!("{service} faults after charging"), faults.to_string()],
        vec!["provider charges".into(), charges.to_string()],
        vec!["DOUBLE CHARGES (provider ledger)".into(), doubles.to_string()],
    ]
}

/// Latencies in an HDR histogram: constant memory however long the storm, quantiles to three
/// significant digits.
#[derive(Debug)]
struct Latencies(hdrhistogram::Histogram<u64>);

impl Default for Latencies {
    fn default() -> Self {
        // `new` fails only for more than five significant digits.
        Self(hdrhistogram::Histogram::new(3).expect("three significant digits are valid"))
    }
}

impl Latencies {
    /// Adds one latency.
    fn record(&mut self, latency: Duration) {
        let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX).max(1);
        // `record` grows the histogram to fit (`saturating_record` would not: it clamps to the
        // current top, which starts at 2); it fails only past what a histogram can hold.
        if self.0.record(micros).is_err() {
            self.0.saturating_record(micros);
        }
    }

    /// The latency at `quantile` (0.5: the median); zero when nothing was recorded.
    fn quantile(&self, quantile: f64) -> Duration {
        if self.0.is_empty() {
            return Duration::ZERO;
        }
        Duration::from_micros(self.0.value_at_quantile(quantile))
    }
}

/// Runs the demo: the upstream, the gateway in front of it (unless `direct`), the storm, and
/// the report from the provider's ledger.
///
/// # Errors
///
/// The store cannot be opened, or a local listener cannot be bound.
pub async fn run(options: Options) -> Result<Report, Error> {
    let (store_url, _temp) = demo_store(options.store.as_deref())?;
    let service = Arc::new(Upstream {
        propagate: options.propagate,
        ..Upstream::default()
    });
    let upstream = serve(
        Router::new()
            .route("/charges", post(charge))
            .route("/charges/by-key/{key}", axum::routing::get(by_key))
            .with_state(Arc::clone(&service)),
    )
    .await?;
    let target = if options.direct {
        upstream
    } else {
        start_gateway(upstream, &store_url, options.reconcile).await?
    };
    let storm = Arc::new(Storm {
        client: Client::builder(TokioExecutor::new()).build_http(),
        gateway: target,
        counters: Counters::default(),
    });
    // About 2.6 requests per payment on average (races, duplicates, reuse, retries).
    let payments = (options.requests * 10 / 26).max(1);
    let started = Instant::now();
    let (storm_over, over) = tokio::sync::watch::channel(false);
    let progress = options
        .progress
        .then(|| show_progress(Arc::clone(&storm), payments as u64, over));
    send_storm(&storm, payments, options.concurrency).await?;
    let elapsed = started.elapsed();
    // The last update (100%) is shown before the report.
    let _ = storm_over.send(true);
    if let Some(progress) = progress {
        let _ = progress.await;
    }
    Ok(report(&storm, &service, &options, &store_url, payments, elapsed))
}

/// The store `store` names, or a fresh SQLite file in a temporary directory, removed when the
/// returned directory is dropped.
fn demo_store(store: Option<&str>) -> Result<(String, Option<tempfile::TempDir>), Error> {
    Ok(match store {
        Some(url) => (url.to_owned(), None),
        None => {
            let dir = tempfile::Builder::new()
                .prefix("idem-demo-")
                .tempdir()
                .map_err(Error::TempDir)?;
            let url = format!("sqlite://{}", dir.path().join("idem.db").display());
            (url, Some(dir))
        }
    })
}

/// The gateway on `store_url` in front of `upstream`, as the README's `idem serve` would run it
/// for this upstream: keys required, scoped by `Authorization`, with a 1 s lease so that a
/// payment whose answer was lost is taken over within the clients' retries; with `reconcile`,
/// asking the upstream's lookup before every attempt after the first.
async fn start_gateway(upstream: SocketAddr, store_url: &str, reconcile: bool) -> Result<SocketAddr, Error> {
    let reconcile = reconcile.then(|| {
        crate::reconcile::ReconcileTemplate::parse("GET /charges/by-key/{key}")
            .expect("the demo's template is valid")
    });
    let config = Config {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        upstream: crate::flags::parse_upstream(&format!("http://{upstream}"))?,
        store: store_url.to_owned(),
        methods: vec![http::Method::POST],
        require_key: true,
        scope_header: Some(http::header::AUTHORIZATION),
        upstream_timeout: Duration::from_secs(30),
        lease: Duration::from_secs(1),
        reconcile,
        ..Config::default()
    };
    let store = idempotency::open(store_url)
        .await
        .map_err(|e| Error::open(store_url, e))?;
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .build_recorder()
        .handle();
    serve(gateway::router(&config, store, metrics)?.main).await
}

/// Progress on standard error until aborted, as payments done out of `target`: a bar on a
/// terminal, and elsewhere (a CI log, a pipe) a line at each quarter, which a log keeps
/// readable. The requests sent so far are shown beside it (retries and duplicates make them
/// about 2.6 a payment, never a known total).
/// It makes a last update and ends once `over` turns true.
fn show_progress(
    storm: Arc<Storm>,
    target: u64,
    over: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        show_bar(storm, target, over)
    } else {
        show_quarters(storm, target, over)
    }
}

/// Waits for the next update: 100 ms, or the end of the storm. False once the storm is over
/// (after its last update).
async fn next_update(over: &mut tokio::sync::watch::Receiver<bool>) -> bool {
    if *over.borrow() {
        return false;
    }
    tokio::select! {
        () = tokio::time::sleep(Duration::from_millis(100)) => {}
        _ = over.changed() => {}
    }
    true
}

/// A line on standard error each time another quarter of the `target` payments is done.
fn show_quarters(
    storm: Arc<Storm>,
    target: u64,
    mut over: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut shown = 0;
        loop {
            let done = storm.counters.payments_done.load(Ordering::Relaxed).min(target);
            let quarter = (done.saturating_mul(4) / target.max(1)).min(4);
            while shown < quarter {
                shown += 1;
                eprintln!(
                    "idem demo: {}% ({done}/{target} payments, {} requests, {} replays, {} conflicts)",
                    shown * 25,
                    storm.counters.requests.load(Ordering::Relaxed),
                    storm.counters.replays.load(Ordering::Relaxed),
                    storm.counters.conflicts.load(Ordering::Relaxed)
                );
            }
            if !next_update(&mut over).await {
                return;
            }
        }
    })
}

/// A progress bar on standard error, updated until the storm is over.
fn show_bar(
    storm: Arc<Storm>,
    target: u64,
    mut over: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let bar = ProgressBar::with_draw_target(Some(target), ProgressDrawTarget::stderr()).with_style(
        ProgressStyle::with_template("[{bar:30}] {pos}/{len} payments, {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("#>-"),
    );
    tokio::spawn(async move {
        // Leaves the bar on its line when the task ends.
        let _finish = FinishOnDrop(bar.clone());
        loop {
            bar.set_position(storm.counters.payments_done.load(Ordering::Relaxed).min(target));
            bar.set_message(format!(
                "{} requests, {} replays, {} conflicts",
                storm.counters.requests.load(Ordering::Relaxed),
                storm.counters.replays.load(Ordering::Relaxed),
                storm.counters.conflicts.load(Ordering::Relaxed)
            ));
            if !next_update(&mut over).await {
                return;
            }
        }
    })
}

/// Leaves the progress bar as it is, on a line of its own, when dropped.
struct FinishOnDrop(ProgressBar);

impl Drop for FinishOnDrop {
    fn drop(&mut self) {
        self.0.abandon();
    }
}

/// Runs `payments` payments, `concurrency` at a time, and waits for all of them.
async fn send_storm(storm: &Arc<Storm>, payments: usize, concurrency: usize) -> Result<(), Error> {
    let semaphore = Arc::new(tokio::sync::Semaphore::new(concurrency.max(1)));
    let mut tasks = tokio::task::JoinSet::new();
    for n in 0..payments {
        // The semaphore is never closed: acquiring only waits.
        let Ok(permit) = Arc::clone(&semaphore).acquire_owned().await else {
            break;
        };
        let storm = Arc::clone(storm);
        tasks.spawn(async move {
            storm.payment(n).await;
            storm.counters.payments_done.fetch_add(1, Ordering::Relaxed);
            drop(permit);
        });
    }
    while let Some(done) = tasks.join_next().await {
        done?;
    }
    Ok(())
}

/// The report: the storm's counters and latencies, the upstream's and the provider's counts.
fn report(
    storm: &Storm,
    upstream: &Upstream,
    options: &Options,
    store_url: &str,
    payments: usize,
    elapsed: Duration,
) -> Report {
    let counters = &storm.counters;
    let latencies = counters
        .latencies
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let (charges, double_charges) = upstream.provider.charges();
    let requests = counters.requests.load(Ordering::Relaxed);
    Report {
        store: (!options.direct).then(|| idempotency::redact_url(store_url)),
        payments: payments as u64,
        requests,
        duplicates: requests.saturating_sub(payments as u64),
        replays: counters.replays.load(Ordering::Relaxed),
        conflicts: counters.conflicts.load(Ordering::Relaxed),
        mismatches: counters.mismatches.load(Ordering::Relaxed),
        client_timeouts: counters.timeouts.load(Ordering::Relaxed),
        released: counters.released.load(Ordering::Relaxed),
        failed_payments: counters.failed_payments.load(Ordering::Relaxed),
        propagated: options.propagate,
        reconcile: options.reconcile,
        reconciled: upstream.found.load(Ordering::Relaxed),
        executions: upstream.executions.load(Ordering::Relaxed),
        re_executions: upstream.re_executions.load(Ordering::Relaxed),
        faults_after_charging: upstream.faults_after_charging.load(Ordering::Relaxed),
        charges,
        double_charges,
        p50: latencies.quantile(0.50),
        p90: latencies.quantile(0.90),
        p99: latencies.quantile(0.99),
        elapsed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_quantiles_keep_three_significant_digits_at_any_size() {
        let mut latencies = Latencies::default();
        assert_eq!(latencies.quantile(0.5), Duration::ZERO);
        for ms in 1..=100 {
            latencies.record(Duration::from_millis(ms));
        }
        latencies.record(Duration::from_secs(30));
        let near = |got: Duration, want: Duration| got.abs_diff(want) <= want / 500;
        assert!(
            near(latencies.quantile(0.5), Duration::from_millis(51)),
            "{:?}",
            latencies.quantile(0.5)
        );
        assert!(
            near(latencies.quantile(0.9), Duration::from_millis(91)),
            "{:?}",
            latencies.quantile(0.9)
        );
        assert!(
            near(latencies.quantile(1.0), Duration::from_secs(30)),
            "{:?}",
            latencies.quantile(1.0)
        );
    }
}
