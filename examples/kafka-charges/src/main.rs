//! `cargo run -p kafka-example [STORE_URL] [PAYMENTS]`: see the library docs.
#![allow(clippy::print_stdout, clippy::print_stderr)] // the report is this program's output

use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let url = args.next().unwrap_or_else(|| {
        format!(
            "sqlite://{}",
            std::env::temp_dir().join("kafka-example.db").display()
        )
    });
    let payments = match args.next().map(|n| n.parse::<usize>()) {
        None => 1000,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => {
            eprintln!("usage: kafka-example [STORE_URL] [PAYMENTS (a positive number)]");
            return ExitCode::from(2);
        }
    };
    let store = match idempotency::open(&url).await {
        Ok(store) => store,
        Err(error) => {
            eprintln!("kafka-example: the store: {error}");
            return ExitCode::from(2);
        }
    };
    match kafka_example::run(store, payments).await {
        Ok(summary) => {
            let twice = summary.charges.values().filter(|n| **n > 1).count();
            println!("payments published          {}", summary.payments);
            println!("messages (each one twice)   {}", summary.published);
            println!("payments charged            {}", summary.charges.len());
            println!("payments charged twice      {twice}");
            println!(
                "time                        {:.1} s",
                summary.elapsed.as_secs_f64()
            );
            if twice == 0 && summary.charges.len() == summary.payments {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(error) => {
            eprintln!("kafka-example: {error}");
            ExitCode::FAILURE
        }
    }
}
