//! `idem-bench`: the project's benchmark harness.
//!
//! Every figure is a throughput measured for a fixed time, repeated in alternating rounds with
//! its baseline (the bare operations the store is built on, on the same connection), so both see
//! the same machine state; the table reports the median of the rounds and the ratio of medians.
//! Nothing here asserts a number: `docs/BENCHMARKS.md` records what was measured and how.
//!
//! ```text
//! cargo run --release -p idempotency-bench -- [memory|sqlite|postgres|redis|http|gateway|consumers|kafka|inbox|outbox|dynamodb|sqs|all] [--seconds S] [--rounds R]
//! ```
#![allow(clippy::print_stdout)] // printing the report is this program's job

mod aws;
mod boxes;
mod consumers;
mod http;
mod kafka;
mod measure;
mod memory;
mod postgres;
mod redis;
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
}

/// One figure of the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Target {
    Memory,
    Sqlite,
    Postgres,
    Redis,
    Http,
    Gateway,
    Consumers,
    Kafka,
    Inbox,
    Outbox,
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
        .filter(|t| *t != Target::All);
    let targets: Vec<Target> = if settings.targets.is_empty() || settings.targets.contains(&Target::All) {
        every.collect()
    } else {
        settings.targets.clone()
    };
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
            Target::Postgres => postgres::run(window, rounds),
            Target::Redis => redis::run(window, rounds),
            Target::Http => http::run(window, rounds),
            Target::Gateway => http::run_gateway(window, rounds),
            Target::Consumers | Target::All => consumers::run(window, rounds),
            Target::Kafka => kafka::run(rounds),
            Target::Inbox => boxes::run_inbox(rounds),
            Target::Outbox => boxes::run_outbox(rounds),
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
