//! The HTTP layer: requests per second and latency percentiles through the layer against the
//! bare handler, with new keys and with replays, measured by the same in-process load generator
//! in the same run, on the memory, SQLite, PostgreSQL and Redis stores.
//!
//! The servers (axum) run on one runtime worker thread, the load generator (a hyper client with
//! keep-alive, 32 concurrent callers) on another, in one process: every variant is driven by the
//! same client the same way, and the ratio is what the layer adds on the server's thread.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idempotency_core::{MemoryStore, StoreAdmin};
use idempotency_http::IdempotencyLayer;

use crate::measure::{Samples, median, per_second};

const CALLERS: usize = 32;
type DynStore = Arc<dyn StoreAdmin>;
type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// One measured variant: throughput and latency percentiles (µs).
struct Measured {
    rate: f64,
    p50: f64,
    p99: f64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Keys {
    /// A fresh key per request: every request runs the handler and stores its response.
    New,
    /// The same key per caller, completed beforehand: every request is a replay.
    Replay,
}

/// The servers' runtime and the load generator's, one worker thread each.
///
/// The servers (and the stores' connections) get one worker thread, the load generator the
/// other: with both in one runtime, work stealing moved tasks between the two cores and the
/// bare handler's throughput jumped between two levels (about 100k and 210k req/s) from one
/// window to the next, drowning the layer's cost.
fn runtimes() -> Result<(tokio::runtime::Runtime, tokio::runtime::Runtime), String> {
    let runtime = |name: &str| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name(name)
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    };
    Ok((runtime("bench-server")?, runtime("bench-client")?))
}

pub(crate) fn run(window: Duration, rounds: usize) -> Result<(), String> {
    let (server, load_generator) = runtimes()?;
    let bare = server.block_on(serve(handler_router()))?;
    let stores = server.block_on(stores())?;
    println!(
        "\n## HTTP layer vs the bare handler (same load generator, {CALLERS} concurrent callers, keep-alive)\n"
    );
    println!(
        "| store | keys | layer req/s | bare req/s | layer / bare | layer p50 / p99 (µs) | bare p50 / p99 (µs) |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|");
    let client: HttpClient =
        load_generator.block_on(async { Client::builder(TokioExecutor::new()).build_http() });
    for (index, (name, store)) in stores.into_iter().enumerate() {
        let layered = server
            .block_on(serve(handler_router().layer(
                IdempotencyLayer::new(Arc::clone(&store)).retention(Duration::from_secs(120)),
            )))?;
        for keys in [Keys::New, Keys::Replay] {
            let rounds = Alternating {
                load_generator: &load_generator,
                client: &client,
                window,
                rounds,
            };
            let columns = rounds.compare((layered, bare), keys, &format!("s{index}"))?;
            let keys = if keys == Keys::New { "new" } else { "replay" };
            println!("| {name} | {keys} | {columns} |");
        }
    }
    Ok(())
}

fn handler_router() -> Router {
    Router::new().route(
        "/charges",
        post(|body: Bytes| async move {
            (
                StatusCode::CREATED,
                format!(r#"{{"charge":"ch_1","request_bytes":{}}}"#, body.len()),
            )
        }),
    )
}

async fn serve(router: Router) -> Result<SocketAddr, String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(addr)
}

async fn stores() -> Result<Vec<(&'static str, DynStore)>, String> {
    let mut stores: Vec<(&'static str, DynStore)> = vec![("memory", Arc::new(MemoryStore::new()))];
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?.keep();
    let sqlite = idempotency_sqlite::SqliteStore::open(&format!("sqlite://{}/http-bench.db", dir.display()))
        .await
        .map_err(|e| e.to_string())?;
    stores.push(("sqlite (FULL)", Arc::new(sqlite)));
    let url =
        std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let options = idempotency_postgres::PostgresOptions::from_url(&url)
        .and_then(|o| o.schema("idempotency_bench"))
        .and_then(|o| o.table(&format!("http_{}", std::process::id())))
        .map_err(|e| e.to_string())?
        .max_connections(16);
    let postgres = idempotency_postgres::PostgresStore::connect_with(options)
        .await
        .map_err(|e| format!("PostgreSQL at {url}: {e}"))?;
    stores.push(("postgres", Arc::new(postgres)));
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let redis = idempotency_redis::RedisStore::connect(&url)
        .await
        .and_then(|s| s.prefix(&format!("idem-http-bench:{}:", std::process::id())))
        .map_err(|e| format!("Redis at {url}: {e}"))?;
    stores.push(("redis", Arc::new(redis)));
    Ok(stores)
}

/// Rounds that alternate between two servers under the same load generator.
struct Alternating<'a> {
    load_generator: &'a tokio::runtime::Runtime,
    client: &'a HttpClient,
    window: Duration,
    rounds: usize,
}

impl Alternating<'_> {
    /// Measures `ours` and `theirs` in alternating rounds; returns the table columns: both
    /// rates, their ratio, and both p50 / p99.
    fn compare(
        &self,
        (ours, theirs): (SocketAddr, SocketAddr),
        keys: Keys,
        tag: &str,
    ) -> Result<String, String> {
        let mut measured = (Vec::new(), Vec::new());
        for round in 0..self.rounds {
            let tag = format!("{tag}-r{round}-{}", std::process::id());
            let run = |addr| {
                self.load_generator
                    .block_on(load(self.client, addr, keys, &tag, self.window))
            };
            measured.0.push(run(ours)?);
            measured.1.push(run(theirs)?);
        }
        let (ours, theirs) = (summarize(&measured.0), summarize(&measured.1));
        Ok(format!(
            "{} | {} | {:.2} | {:.0} / {:.0} | {:.0} / {:.0}",
            per_second(ours.rate),
            per_second(theirs.rate),
            ours.rate / theirs.rate,
            ours.p50,
            ours.p99,
            theirs.p50,
            theirs.p99,
        ))
    }
}

fn summarize(rounds: &[Measured]) -> Measured {
    let rates: Vec<f64> = rounds.iter().map(|m| m.rate).collect();
    let mut p50: Vec<f64> = rounds.iter().map(|m| m.p50).collect();
    let mut p99: Vec<f64> = rounds.iter().map(|m| m.p99).collect();
    Measured {
        rate: Samples::of(rates).median,
        p50: median(&mut p50),
        p99: median(&mut p99),
    }
}

/// Runs `CALLERS` request loops against `addr` for `window`.
async fn load(
    client: &HttpClient,
    addr: SocketAddr,
    keys: Keys,
    tag: &str,
    window: Duration,
) -> Result<Measured, String> {
    let started = Instant::now();
    let deadline = started + window;
    let tasks: Vec<_> = (0..CALLERS)
        .map(|caller| {
            let client = client.clone();
            let replay_key = format!("replay-{tag}-{caller}");
            let tag = tag.to_owned();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut n = 0u64;
                if keys == Keys::Replay {
                    // Complete the key once, so that every measured request replays it.
                    request(&client, addr, &replay_key).await?;
                }
                while Instant::now() < deadline {
                    let key = match keys {
                        Keys::New => format!("new-{tag}-{caller}-{n}"),
                        Keys::Replay => replay_key.clone(),
                    };
                    n += 1;
                    let sent = Instant::now();
                    request(&client, addr, &key).await?;
                    latencies.push(sent.elapsed());
                }
                Ok::<_, String>(latencies)
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await.map_err(|e| e.to_string())??);
    }
    let elapsed = started.elapsed();
    latencies.sort_unstable();
    let percentile = |p: f64| {
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let index = ((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1));
        latencies.get(index).map_or(0.0, |d| d.as_secs_f64() * 1e6)
    };
    Ok(Measured {
        rate: crate::measure::rate(latencies.len() as u64, elapsed),
        p50: percentile(0.50),
        p99: percentile(0.99),
    })
}

async fn request(client: &HttpClient, addr: SocketAddr, key: &str) -> Result<(), String> {
    let request = http::Request::post(format!("http://{addr}/charges"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            br#"{"amount":1000,"currency":"EUR"}"#,
        )))
        .map_err(|e| e.to_string())?;
    let response = client.request(request).await.map_err(|e| e.to_string())?;
    let status = response.status();
    let _ = response.into_body().collect().await.map_err(|e| e.to_string())?;
    if status != StatusCode::CREATED {
        return Err(format!("unexpected status {status}"));
    }
    Ok(())
}
