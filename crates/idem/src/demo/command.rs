//! `idem demo` and `idem demo consume`: their arguments, and the verdict on the report (an error
//! when the provider's ledger shows a double charge where there must be none).

use crate::error::Error;

/// `idem demo`.
#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    mode: Option<Mode>,
    /// About how many requests the client storm sends.
    #[arg(long, default_value_t = 3000)]
    requests: usize,
    /// The gateway's store (default: a fresh SQLite file in a temporary directory).
    #[arg(long)]
    store: Option<String>,
    /// Payments in progress at once.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Send the same storm straight to the upstream, without the gateway, to see what the
    /// retries do on their own.
    #[arg(long)]
    direct: bool,
    /// The sample upstream does not pass the forwarded Idempotency-Key on to its payment
    /// provider: shows the double charges that passing it on prevents.
    #[arg(long)]
    no_key_propagation: bool,
    /// The gateway asks the upstream's lookup (`GET /charges/by-key/{key}`) before it runs a
    /// payment again, and adopts a charge it finds (see docs/RECONCILE.md).
    #[arg(long, conflicts_with = "direct")]
    reconcile: bool,
}

/// `idem demo`'s other modes.
#[derive(Debug, clap::Subcommand)]
pub enum Mode {
    /// The same payments service fed from a broker that delivers at least once (copies of a
    /// message, lost acks, a key reused with another payment), through `idem consume`'s
    /// consumer on the embedded SQLite store; double charges counted from the provider's ledger.
    Consume(ConsumeArgs),
}

/// `idem demo consume`.
#[derive(Debug, clap::Args)]
pub struct ConsumeArgs {
    /// How many payments are published (each as one or more messages).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    payments: u32,
    /// The consumer's store (default: a fresh SQLite file in a temporary directory).
    #[arg(long)]
    store: Option<String>,
    /// Messages handled at once.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..=4096))]
    concurrency: u16,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Feed the service straight from the broker without the record, to see what the
    /// redeliveries do on their own.
    #[arg(long)]
    direct: bool,
    /// The service does not pass the message's Idempotency-Key on to its payment provider:
    /// shows the double charges that passing it on prevents.
    #[arg(long)]
    no_key_propagation: bool,
}

/// Runs `idem demo`: the report, or an error carrying it when the ledger shows double charges.
///
/// # Errors
///
/// [`Error::DoubleCharges`] with the report; the demo's own (a store that cannot open, a port).
pub async fn run(args: Args) -> Result<String, Error> {
    if let Some(Mode::Consume(args)) = args.mode {
        return demo_consume(args).await;
    }
    let report = super::run(super::Options {
        requests: args.requests,
        store: args.store,
        concurrency: args.concurrency,
        progress: !args.quiet && !args.json,
        direct: args.direct,
        propagate: !args.no_key_propagation,
        reconcile: args.reconcile,
    })
    .await?;
    let text = printed(args.json, || report.to_json(), || report.to_table());
    // Asking before running again leaves no double charge, with the key passed on or not.
    let shows_doubles = args.direct || (args.no_key_propagation && !args.reconcile);
    verdict(text, report.double_charges, shows_doubles)
}

/// A report as asked: one line of JSON, or the table.
fn printed(
    json: bool,
    as_json: impl FnOnce() -> serde_json::Value,
    table: impl FnOnce() -> String,
) -> String {
    if json { as_json().to_string() } else { table() }
}

/// A demo's printed report, or an error carrying it when the provider's ledger shows double
/// charges in a mode that must have none: through the gateway or the consumer, with the key
/// passed on, a double charge is a defect; the other modes (`shows_doubles`) exist to show them.
fn verdict(text: String, double_charges: u64, shows_doubles: bool) -> Result<String, Error> {
    if double_charges > 0 && !shows_doubles {
        return Err(Error::DoubleCharges { report: text });
    }
    Ok(text)
}

/// `idem demo consume`: the report, or an error carrying it when the ledger shows double
/// charges.
async fn demo_consume(args: ConsumeArgs) -> Result<String, Error> {
    let report = super::consume::run(super::consume::Options {
        payments: args.payments as usize,
        store: args.store,
        concurrency: usize::from(args.concurrency),
        direct: args.direct,
        propagate: !args.no_key_propagation,
    })
    .await?;
    let text = printed(args.json, || report.to_json(), || report.to_table());
    verdict(
        text,
        report.double_charges,
        args.direct || args.no_key_propagation,
    )
}
