//! `idem demo`: a sample payments upstream with a ledger, the gateway in front of it on the
//! embedded SQLite store, and a client storm — retries after timeouts, duplicates, concurrent
//! races, a key reused with another payload — ending in a table whose double-charge count comes
//! from the upstream's own ledger.

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
}

/// The upstream's ledger: every charge it made, by forwarded key.
#[derive(Debug, Default)]
struct Ledger {
    charges: Mutex<HashMap<String, Vec<i64>>>,
}

impl Ledger {
    fn charges(&self) -> (u64, u64) {
        let charges = self
            .charges
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let total: usize = charges.values().map(Vec::len).sum();
        let doubles: usize = charges.values().map(|c| c.len().saturating_sub(1)).sum();
        (total as u64, doubles as u64)
    }
}

/// The sample upstream: `POST /charges` charges once per call; it is slow now and then (client
/// timeouts) and fails transiently (503) before charging on about 3% of calls.
async fn charge(State(ledger): State<Arc<Ledger>>, headers: HeaderMap, body: Bytes) -> Response {
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
    let (latency, fail) = {
        let mut rng = rand::rng();
        let slow = rng.random_ratio(1, 10);
        let latency = if slow {
            rng.random_range(150..300)
        } else {
            rng.random_range(2..20)
        };
        (Duration::from_millis(latency), rng.random_ratio(3, 100))
    };
    tokio::time::sleep(latency).await;
    if fail {
        return (StatusCode::SERVICE_UNAVAILABLE, "card network busy, try again").into_response();
    }
    let charge_id = {
        let mut charges = ledger
            .charges
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let entry = charges.entry(key).or_default();
        entry.push(amount);
        format!("ch_{}_{}", charges.len(), amount)
    };
    let attempt = headers
        .get(gateway::IDEMPOTENCY_ATTEMPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("1")
        .to_owned();
    (
        StatusCode::CREATED,
        [("set-cookie", "session=upstream-only; HttpOnly")],
        axum::Json(json!({ "charge_id": charge_id, "amount_cents": amount, "attempt": attempt })),
    )
        .into_response()
}

async fn serve(router: Router) -> Result<SocketAddr, Error> {
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let listener = gateway::bind(any).await?;
    let addr = listener.local_addr().map_err(|source| Error::Listen {
        addr: any.to_string(),
        source,
    })?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok(addr)
}

#[derive(Debug, Default)]
struct Counters {
    requests: AtomicU64,
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
    /// `5xx` answers (the key was released; the retry ran again).
    pub released: u64,
    /// Payments that did not succeed within their tries.
    pub failed_payments: u64,
    /// Charges in the upstream's ledger.
    pub charges: u64,
    /// Charges beyond the first for a payment, from the ledger.
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
            "released_5xx": self.released,
            "failed_payments": self.failed_payments,
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
        let rows = vec![
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
            vec!["upstream 5xx (key released)".into(), self.released.to_string()],
            vec!["charges made (upstream ledger)".into(), self.charges.to_string()],
            vec!["DOUBLE CHARGES".into(), self.double_charges.to_string()],
            vec![
                "latency p50 / p90 / p99 (ms)".into(),
                format!("{} / {} / {}", ms(self.p50), ms(self.p90), ms(self.p99)),
            ],
        ];
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
        if self.failed_payments > 0 {
            out.push_str(&format!(
                "\n{} payments did not succeed within 20 tries (the upstream kept failing).\n",
                self.failed_payments
            ));
        }
        out
    }
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
/// the report from the upstream's ledger.
///
/// # Errors
///
/// The store cannot be opened, or a local listener cannot be bound.
pub async fn run(options: Options) -> Result<Report, Error> {
    // A store of its own unless told otherwise, removed when `_temp` is dropped.
    let (store_url, _temp) = match &options.store {
        Some(url) => (url.clone(), None),
        None => {
            let dir = tempfile::Builder::new()
                .prefix("idem-demo-")
                .tempdir()
                .map_err(Error::TempDir)?;
            let url = format!("sqlite://{}", dir.path().join("idem.db").display());
            (url, Some(dir))
        }
    };
    let ledger = Arc::new(Ledger::default());
    let upstream = serve(
        Router::new()
            .route("/charges", post(charge))
            .with_state(Arc::clone(&ledger)),
    )
    .await?;
    let target = if options.direct {
        upstream
    } else {
        start_gateway(upstream, &store_url).await?
    };
    let storm = Arc::new(Storm {
        client: Client::builder(TokioExecutor::new()).build_http(),
        gateway: target,
        counters: Counters::default(),
    });
    // About 2.6 requests per payment on average (races, duplicates, reuse, retries).
    let payments = (options.requests * 10 / 26).max(1);
    let started = Instant::now();
    let progress = options
        .progress
        .then(|| show_progress(Arc::clone(&storm), options.requests as u64));
    send_storm(&storm, payments, options.concurrency).await?;
    let elapsed = started.elapsed();
    if let Some(progress) = progress {
        progress.abort();
    }
    Ok(report(&storm, &ledger, &options, &store_url, payments, elapsed))
}

/// The gateway on `store_url` in front of `upstream`, as the README's `idem serve` would run it
/// for this upstream: keys required, scoped by `Authorization`.
async fn start_gateway(upstream: SocketAddr, store_url: &str) -> Result<SocketAddr, Error> {
    let config = Config {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        upstream: gateway::parse_upstream(&format!("http://{upstream}"))?,
        store: store_url.to_owned(),
        methods: vec![http::Method::POST],
        require_key: true,
        scope_header: Some(http::header::AUTHORIZATION),
        upstream_timeout: Duration::from_secs(30),
        ..Config::default()
    };
    let store = idempotency::open(store_url)
        .await
        .map_err(|e| Error::open(store_url, e))?;
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .build_recorder()
        .handle();
    serve(gateway::router(&config, store, metrics).main).await
}

/// A progress bar on standard error (drawn only when it is a terminal), updated until aborted.
fn show_progress(storm: Arc<Storm>, target: u64) -> tokio::task::JoinHandle<()> {
    let bar = ProgressBar::with_draw_target(Some(target), ProgressDrawTarget::stderr()).with_style(
        ProgressStyle::with_template("[{bar:30}] {pos}/{len} requests, {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("#>-"),
    );
    tokio::spawn(async move {
        // Finishes the bar when the task is aborted (the storm is over).
        let _finish = FinishOnDrop(bar.clone());
        loop {
            bar.set_position(storm.counters.requests.load(Ordering::Relaxed).min(target));
            bar.set_message(format!(
                "{} replays, {} conflicts",
                storm.counters.replays.load(Ordering::Relaxed),
                storm.counters.conflicts.load(Ordering::Relaxed)
            ));
            tokio::time::sleep(Duration::from_millis(100)).await;
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
            drop(permit);
        });
    }
    while let Some(done) = tasks.join_next().await {
        done?;
    }
    Ok(())
}

/// The report: the storm's counters and latencies, the ledger's charges.
fn report(
    storm: &Storm,
    ledger: &Ledger,
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
    let (charges, double_charges) = ledger.charges();
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
