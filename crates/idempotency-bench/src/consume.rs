//! `idem consume` against a plain consumer feeding the same HTTP handler: messages per second
//! from a RabbitMQ queue to a handler that answers `200` at once, with the record (`idem
//! consume` as a process of its own, on the memory and the SQLite store) and without it (an
//! in-process consumer that posts each message and acks it, no key, no record), alternating in
//! one run.
//!
//! Each measurement fills a fresh queue with `MESSAGES` messages with distinct keys, then starts
//! the consumer and times the handler's calls from the first to the last, so that process start,
//! store opening and connecting are left out. Both variants have 64 messages in process at once.

use crate::servers::amqp_url;
use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotency_amqp::{Topology, publish};
use idempotency_core::Key;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};

use crate::gateway::{Process, sibling};
use crate::measure::{Samples, per_second, runtime};

const MESSAGES: u64 = 3000;
const PREFETCH: u16 = 64;

/// The handler: counts calls and notes when the first and the last came.
#[derive(Default)]
pub(crate) struct Calls {
    count: AtomicU64,
    span: Mutex<(Option<Instant>, Option<Instant>)>,
}

impl Calls {
    pub(crate) fn reset(&self) {
        self.count.store(0, Ordering::SeqCst);
        *self
            .span
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = (None, None);
    }

    fn call(&self) {
        let now = Instant::now();
        let mut span = self
            .span
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        span.0.get_or_insert(now);
        span.1 = Some(now);
        self.count.fetch_add(1, Ordering::SeqCst);
    }

    /// Messages per second between the first call and the last.
    pub(crate) fn rate(&self) -> f64 {
        let span = *self
            .span
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match span {
            (Some(first), Some(last)) if last > first => {
                (self.count.load(Ordering::SeqCst) - 1) as f64 / (last - first).as_secs_f64()
            }
            _ => 0.0,
        }
    }
}

pub(crate) async fn start_handler(calls: Arc<Calls>) -> Result<SocketAddr, String> {
    let app = axum::Router::new()
        .route(
            "/messages",
            axum::routing::post(
                |axum::extract::State(calls): axum::extract::State<Arc<Calls>>| async move {
                    calls.call();
                    "ok"
                },
            ),
        )
        .with_state(calls);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

/// A fresh queue holding `MESSAGES` messages with distinct keys.
async fn filled_queue(channel: &Channel, round: usize, variant: usize) -> Result<String, String> {
    let queue = format!("idem-bench-consume-{}-{round}-{variant}", std::process::id());
    // Declared as `idem consume` declares it (a queue with other arguments is refused); the
    // bench deletes it, with its retry and dead-letter queues, after the measurement.
    Topology::for_queue(&queue)
        .declare(channel)
        .await
        .map_err(|e| e.to_string())?;
    for i in 0..MESSAGES {
        let key = Key::new(format!("bench-{round}-{variant}-{i}")).map_err(|e| e.to_string())?;
        publish(channel, "", &queue, &key, b"{\"amount\":1000}")
            .await
            .map_err(|e| e.to_string())?;
    }
    Ok(queue)
}

/// Waits until the handler has had every message (at most a minute).
async fn drained(calls: &Calls) -> Result<(), String> {
    drained_all(calls, MESSAGES).await
}

/// Waits until the handler has had `messages` calls (at most a minute).
pub(crate) async fn drained_all(calls: &Calls, messages: u64) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while calls.count.load(Ordering::SeqCst) < messages {
        if Instant::now() > deadline {
            return Err(format!(
                "only {} of {messages} messages reached the handler in a minute",
                calls.count.load(Ordering::SeqCst)
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// `idem consume` from the source URL `from` to `handler` with `store` and `--prefetch
/// prefetch`, until dropped.
pub(crate) fn idem_consume(
    from: &str,
    handler: SocketAddr,
    store: &str,
    prefetch: u16,
) -> Result<Process, String> {
    Process::spawn(
        "idem consume",
        Command::new(sibling("idem")?)
            .args([
                "consume",
                "--from",
                from,
                "--to",
                &format!("http://{handler}/messages"),
                "--store",
                store,
                "--prefetch",
                &prefetch.to_string(),
                "--name",
                &format!("bench-{}", Key::generate()),
            ])
            .env("IDEM_LOG", "error"),
    )
}

/// A consumer without the guard: posts each message to the handler and acks it.
async fn plain(
    connection: &Connection,
    queue: &str,
    handler: SocketAddr,
    calls: &Calls,
) -> Result<(), String> {
    let channel = connection.create_channel().await.map_err(|e| e.to_string())?;
    channel
        .basic_qos(PREFETCH, BasicQosOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let deliveries = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| e.to_string())?;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let uri: http::Uri = format!("http://{handler}/messages")
        .parse()
        .map_err(|e| format!("{e}"))?;
    let consuming = deliveries.for_each_concurrent(usize::from(PREFETCH), |delivery| {
        let (client, uri) = (client.clone(), uri.clone());
        async move {
            let Ok(delivery) = delivery else { return };
            let request = http::Request::post(uri)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(delivery.data.clone())));
            if let Ok(request) = request
                && let Ok(response) = client.request(request).await
            {
                let _ = response.into_body().collect().await;
            }
            let _ = delivery.acker.ack(BasicAckOptions::default()).await;
        }
    });
    tokio::select! {
        () = consuming => Err("the plain consumer's deliveries ended".into()),
        done = drained(calls) => done,
    }?;
    let _ = channel.close(200, "done".into()).await;
    Ok(())
}

pub(crate) fn run(rounds: usize) -> Result<(), String> {
    runtime()?.block_on(run_async(rounds))
}

async fn run_async(rounds: usize) -> Result<(), String> {
    let calls = Arc::new(Calls::default());
    let handler = start_handler(Arc::clone(&calls)).await?;
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .map_err(|e| format!("RabbitMQ at {}: {e}", idempotency_core::redact_url(&amqp_url())))?;
    let channel = connection.create_channel().await.map_err(|e| e.to_string())?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let sqlite = format!("sqlite://{}", dir.path().join("consume.db").display());
    let variants = [
        "idem consume, memory store",
        "idem consume, SQLite store",
        "plain consumer (post, ack)",
    ];
    let mut rates = vec![Vec::new(); variants.len()];
    for round in 0..rounds {
        for (variant, samples) in rates.iter_mut().enumerate() {
            let queue = filled_queue(&channel, round, variant).await?;
            calls.reset();
            match variant {
                0 | 1 => {
                    let store = if variant == 0 {
                        "memory://"
                    } else {
                        sqlite.as_str()
                    };
                    let from = format!("{}?queue={queue}", amqp_url());
                    let _consume = idem_consume(&from, handler, store, PREFETCH)?;
                    drained(&calls).await?;
                }
                _ => plain(&connection, &queue, handler, &calls).await?,
            }
            samples.push(calls.rate());
            for name in [queue.clone(), format!("{queue}.retry"), format!("{queue}.dead")] {
                let _ = channel
                    .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                    .await;
            }
        }
    }
    println!(
        "\n## idem consume vs a plain consumer: RabbitMQ to an HTTP handler, {MESSAGES} messages, {PREFETCH} in process, {rounds} alternating rounds, medians\n"
    );
    print_rates(("variant", "plain"), &variants, rates, 2);
    Ok(())
}

/// Prints one row per variant (`columns`: what names a variant, and the variant the others
/// are divided by, whose index is `base`): its median rate, the ratio, the spread.
pub(crate) fn print_rates(
    columns: (&str, &str),
    variants: &[impl std::fmt::Display],
    rates: Vec<Vec<f64>>,
    base: usize,
) {
    let samples: Vec<Samples> = rates.into_iter().map(Samples::of).collect();
    let base_rate = samples[base].median;
    println!("| {} | messages/s | / {} | min–max |", columns.0, columns.1);
    println!("|---|---:|---:|---:|");
    for (name, sample) in variants.iter().zip(&samples) {
        println!(
            "| {name} | {} | {:.2} | {} |",
            per_second(sample.median),
            sample.median / base_rate,
            sample.spread()
        );
    }
}
