//! `idem-bench`: the project's benchmark harness.
//!
//! Every figure is a throughput measured for a fixed time, repeated in alternating rounds with
//! its baseline (the bare operations the store is built on, on the same connection), so both see
//! the same machine state; the table reports the median of the rounds and the ratio of medians.
//! Nothing here asserts a number: `docs/BENCHMARKS.md` records what was measured and how.
//!
//! ```text
//! cargo run --release -p idempotency-bench -- [memory|sqlite|postgres|redis|http|gateway|consumers|all] [--seconds S] [--rounds R]
//! ```
#![allow(clippy::print_stdout)] // printing the report is this program's job

mod consumers;
mod http;
mod measure;
mod memory;
mod postgres;
mod redis;
mod sqlite;

use std::process::ExitCode;
use std::time::Duration;

/// What to run and for how long.
#[derive(Debug, Clone)]
struct Settings {
    targets: Vec<String>,
    seconds: f64,
    rounds: usize,
}

const TARGETS: [&str; 7] = [
    "memory",
    "sqlite",
    "postgres",
    "redis",
    "http",
    "gateway",
    "consumers",
];

fn parse_args() -> Result<Settings, String> {
    let mut settings = Settings {
        targets: Vec::new(),
        seconds: 2.0,
        rounds: 3,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--seconds" => {
                let value = args.next().ok_or("--seconds needs a value")?;
                settings.seconds = value
                    .parse()
                    .ok()
                    .filter(|s: &f64| *s > 0.0 && s.is_finite())
                    .ok_or_else(|| format!("--seconds {value:?}: expected a positive number"))?;
            }
            "--rounds" => {
                let value = args.next().ok_or("--rounds needs a value")?;
                settings.rounds = value
                    .parse()
                    .ok()
                    .filter(|r| *r > 0)
                    .ok_or_else(|| format!("--rounds {value:?}: expected a positive integer"))?;
            }
            "all" => settings.targets.extend(TARGETS.iter().map(|t| (*t).to_string())),
            target if TARGETS.contains(&target) => settings.targets.push(target.to_string()),
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if settings.targets.is_empty() {
        settings.targets.extend(TARGETS.iter().map(|t| (*t).to_string()));
    }
    Ok(settings)
}

fn main() -> ExitCode {
    let settings = match parse_args() {
        Ok(settings) => settings,
        Err(message) => {
            if !message.is_empty() {
                eprintln!("idem-bench: {message}");
            }
            eprintln!(
                "usage: idem-bench [memory|sqlite|postgres|redis|http|gateway|consumers|all]... [--seconds S] [--rounds R]"
            );
            return if message.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(2)
            };
        }
    };
    let window = Duration::from_secs_f64(settings.seconds);
    println!(
        "# idem-bench: {} s per measurement, {} alternating rounds, median reported; {} CPUs",
        settings.seconds,
        settings.rounds,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    for target in &settings.targets {
        let result = match target.as_str() {
            "memory" => memory::run(window, settings.rounds),
            "sqlite" => sqlite::run(window, settings.rounds),
            "postgres" => postgres::run(window, settings.rounds),
            "redis" => redis::run(window, settings.rounds),
            "http" => http::run(window, settings.rounds),
            "gateway" => http::run_gateway(window, settings.rounds),
            "consumers" => consumers::run(window, settings.rounds),
            _ => unreachable!("targets are validated"),
        };
        if let Err(error) = result {
            eprintln!("idem-bench: {target}: {error}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
