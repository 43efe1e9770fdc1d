//! `idem-bench`: the project's benchmark harness.
//!
//! Every figure is a throughput measured for a fixed time, repeated in alternating rounds with
//! its baseline (the bare operations the store is built on, on the same connection), so both see
//! the same machine state; the table reports the median of the rounds and the ratio of medians.
//! Nothing here asserts a number: `docs/BENCHMARKS.md` records what was measured and how.
//!
//! ```text
//! cargo run --release -p idempotency-bench -- [memory|sqlite|postgres|mysql|redis|batches|http|consumers|kafka|consume-kafka|inbox|outbox|dynamodb|sqs|all] [--seconds S] [--rounds R]
//! scripts/bench-gateway          # gateway: idem serve on each store vs nginx vs the upstream (wrk)
//! ```
#![allow(clippy::print_stdout)] // printing the report is this program's job

mod aws;
mod batches;
mod boxes;
mod consume;
mod consume_kafka;
mod consumers;
mod cpu;
mod gateway;
mod http;
mod kafka;
mod measure;
mod memory;
mod mysql;
mod postgres;
mod redis;
mod relay;
mod servers;
mod sql_store;
mod sqlite;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, ValueEnum};

/// What to measure, and for how long.
#[derive(Debug, Parser)]
#[command(
    name = "idem-bench",
    about = "Measures the idempotency toolkit against its bare baselines, side by side in one run."
)]
struct Settings {
    /// What to measure (default: all of them).
    #[arg(value_enum)]
    targets: Vec<Target>,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 2.0, value_parser = positive_seconds)]
    seconds: f64,
    /// Alternating rounds per figure (the median is reported).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..))]
    rounds: u16,
    /// `gateway`, `gateway-memory`: wrk's connections.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..))]
    connections: u16,
    /// `gateway`: the stores to put the gateway on, in order.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "memory,redis,redis-batched,sqlite,sqlite-single,postgres,postgres-batched,mysql,mysql-batched"
    )]
    stores: Vec<String>,
    /// `gateway-memory`: how many requests to send.
    #[arg(long, default_value_t = 200_000)]
    requests: u64,
    /// `kafka`: the worker's prefetch (messages queued per partition before its fetching is
    /// paused); the worker's default when absent.
    #[arg(long, value_parser = clap::value_parser!(u32).range(2..))]
    prefetch: Option<u32>,
    /// `consumers`, `kafka`: the store pairs to measure, in their usual order (default: all).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "redis,postgres,same-transaction"
    )]
    pairs: Vec<consumers::Pair>,
    /// `upstream`: where the upstream listens.
    #[arg(long, default_value = "127.0.0.1:9000")]
    listen: String,
}

/// One figure of the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Target {
    Memory,
    Sqlite,
    Postgres,
    Mysql,
    Redis,
    /// `begin_many`/`complete_many` against the single calls on SQLite, PostgreSQL, MySQL and
    /// Redis: keys per second with 8 and 32 callers, 32 keys per caller's window.
    Batches,
    Http,
    /// `idem serve` on each store vs nginx vs the upstream, each a process, loaded by wrk
    /// (needs nginx and wrk: `scripts/bench-gateway`).
    Gateway,
    /// The gateway's resident memory on SQLite under new-key requests with 1 KiB bodies.
    GatewayMemory,
    /// The fast upstream the gateway benchmark starts (runs until killed).
    Upstream,
    /// `idem consume` (memory and SQLite stores) vs a plain consumer feeding the same HTTP
    /// handler from RabbitMQ (needs `target/release/idem`).
    Consume,
    /// `idem consume` from Kafka at several `--prefetch` settings (needs `target/release/idem`
    /// built with `--features kafka`).
    ConsumeKafka,
    Consumers,
    Kafka,
    Inbox,
    Outbox,
    /// The outbox relay vs the same publisher in a loop, for RabbitMQ, NATS, Kafka, SQS and a
    /// webhook, from PostgreSQL (and RabbitMQ from MySQL).
    Relay,
    Dynamodb,
    Sqs,
    /// Every target, in this order.
    All,
}

fn positive_seconds(text: &str) -> Result<f64, String> {
    text.parse()
        .ok()
        .filter(|s: &f64| *s > 0.0 && s.is_finite())
        .ok_or_else(|| format!("{text:?}: expected a positive number"))
}

fn main() -> ExitCode {
    let settings = Settings::parse();
    let window = Duration::from_secs_f64(settings.seconds);
    let rounds = usize::from(settings.rounds);
    let every = Target::value_variants()
        .iter()
        .copied()
        // The gateway figures need nginx and wrk and run for minutes: `scripts/bench-gateway`.
        .filter(|t| {
            !matches!(
                t,
                Target::All
                    | Target::Gateway
                    | Target::GatewayMemory
                    | Target::Upstream
                    | Target::Consume
                    | Target::ConsumeKafka
            )
        });
    let targets: Vec<Target> = if settings.targets.is_empty() || settings.targets.contains(&Target::All) {
        every.collect()
    } else {
        settings.targets.clone()
    };
    if targets.contains(&Target::Upstream) {
        return match gateway::run_upstream(&settings.listen) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("idem-bench: upstream: {error}");
                ExitCode::FAILURE
            }
        };
    }
    println!(
        "# idem-bench: {} s per measurement, {} alternating rounds, median reported; {} CPUs",
        settings.seconds,
        settings.rounds,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    for target in targets {
        let result = match target {
            Target::Memory => memory::run(window, rounds),
            Target::Sqlite => sqlite::run(window, rounds),
            Target::Postgres => sql_store::run::<postgres::Postgres>(window, rounds),
            Target::Mysql => sql_store::run::<mysql::Mysql>(window, rounds),
            Target::Redis => redis::run(window, rounds),
            Target::Batches => batches::run(window, rounds),
            Target::Http => http::run(window, rounds),
            Target::Gateway => gateway::run(
                window,
                rounds,
                usize::from(settings.connections),
                &settings.stores,
            ),
            Target::GatewayMemory => {
                gateway::run_memory(usize::from(settings.connections), settings.requests)
            }
            Target::Upstream => Ok(()),
            Target::Consume => consume::run(rounds),
            Target::ConsumeKafka => consume_kafka::run(rounds),
            Target::Consumers | Target::All => consumers::run(window, rounds, &settings.pairs),
            Target::Kafka => kafka::run(rounds, settings.prefetch.map(|n| n as usize), &settings.pairs),
            Target::Inbox => boxes::run_inbox(rounds),
            Target::Outbox => boxes::run_outbox(rounds),
            Target::Relay => relay::run_relay(rounds),
            Target::Dynamodb => aws::run_dynamodb(window, rounds),
            Target::Sqs => aws::run_sqs(rounds),
        };
        if let Err(error) = result {
            eprintln!("idem-bench: {target:?}: {error}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
