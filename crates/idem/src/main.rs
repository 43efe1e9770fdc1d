//! `idem`: the idempotency gateway in front of any HTTP service, a payments demo, and the
//! operations CLI for idempotency stores. See `idem --help`.
#![allow(clippy::print_stdout, clippy::print_stderr)] // a command-line program: output is the point

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

/// mimalloc instead of the C library's allocator: a gateway request makes about seventy short
/// allocations (headers, bodies, futures, the record), and glibc's `malloc` and `free` were an
/// eighth of its instructions. A well-kept crate, a small C build with no system dependency.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
use idem::key_actions::{Confirm, KeyAction};
use idem::{Error, consume, demo, gateway, ops, units};
use idempotency::{Access, DynStore, Key, ListFilter, Scope, StateFilter};
use idempotency_consumer::dead_letters::{Selection, Settle};

/// Effectively-once HTTP requests and the operations on their records.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log lines as `text` (for people) or `json` (one JSON object per line, for a log
    /// pipeline), on standard error.
    #[arg(
        long,
        global = true,
        env = "IDEM_LOG_FORMAT",
        default_value = "text",
        value_enum
    )]
    log_format: LogFormat,
}

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line: `timestamp`, `level`, `fields` (the message and the event's
    /// fields), `target` and the spans it is in.
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the idempotency gateway in front of an HTTP upstream.
    Serve(Box<gateway::Config>),
    /// Consume a broker's messages and POST each to an HTTP handler, once per key: acked only
    /// once the handler's answer is recorded.
    Consume(Box<consume::Config>),
    /// Run a payments upstream behind the gateway under a client retry storm, and count double
    /// charges from the upstream's ledger (there are none).
    Demo(DemoArgs),
    /// Inspect and maintain the records of a store.
    Keys {
        #[command(subcommand)]
        action: KeysCommand,
    },
    /// Report requests in flight for longer than a duration: stale leases mean crashed or hung
    /// workers.
    Inflight(InflightArgs),
    /// Create or upgrade the store's schema (stores also do this when they open).
    Migrate(StoreArgs),
    /// Inspect and maintain an inbox on PostgreSQL: list, show, replay dead messages, purge.
    Inbox {
        #[command(subcommand)]
        action: InboxCommand,
    },
    /// Inspect and maintain an outbox on PostgreSQL or MySQL: pending and dead messages, the backlog,
    /// replay of dead rows, purge.
    Outbox {
        #[command(subcommand)]
        action: OutboxCommand,
    },
    /// Publish the rows an application writes into an outbox table (PostgreSQL, MySQL), in order per
    /// group, each with its key as Idempotency-Key, once the broker confirms it (docs/OUTBOX.md).
    Relay(RelayArgs),
    /// The dead letters of a consumer's source, on any broker: list them by reason, show them,
    /// replay them to the source after a fix, purge them.
    Dlq {
        #[command(subcommand)]
        action: DlqCommand,
    },
    /// GET a URL and exit 0 on a 2xx answer within --timeout, 1 otherwise with the reason: a
    /// health check for the image, which has no shell or curl
    /// (`idem probe http://127.0.0.1:9090/readyz`).
    Probe {
        /// The URL: http://HOST:PORT/PATH or https://….
        url: String,
        /// How long the answer may take.
        #[arg(long, default_value = "2s", value_parser = idem::units::parse_duration)]
        timeout: Duration,
    },
}

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
struct RelayArgs {
    #[command(subcommand)]
    action: Option<RelayCommand>,
    #[command(flatten)]
    config: Box<idem::relay::Config>,
}

#[derive(Debug, Subcommand)]
enum RelayCommand {
    /// Create the outbox table (or upgrade one of version 1), with the trigger that wakes the
    /// relays.
    Migrate {
        /// The database: postgres://…, mysql://… or mariadb://….
        #[arg(long, env = "IDEM_DATABASE")]
        database: String,
        /// The table's schema (on MySQL a database; `public`: the URL's own).
        #[arg(long, env = "IDEM_SCHEMA", default_value = "public")]
        schema: String,
        /// The table.
        #[arg(long, env = "IDEM_OUTBOX_TABLE", default_value = "idempotency_outbox")]
        outbox_table: String,
    },
}

/// Where the dead letters are: the consumer's own source URL.
#[derive(Debug, Args)]
struct DlqFrom {
    /// The source `idem consume --from` consumes (amqp://…?queue=…, nats://…, kafka://…,
    /// sqs://…): its dead-letter queue, subject or topic is found as the consumer writes it.
    #[arg(long, env = "IDEM_FROM")]
    from: String,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Which dead letters a command takes.
#[derive(Debug, Args)]
struct DlqFilter {
    /// Only those whose reason contains this text (case-insensitive).
    #[arg(long)]
    reason: Option<String>,
    /// Only the one(s) with this Idempotency-Key.
    #[arg(long)]
    key: Option<String>,
}

#[derive(Debug, Subcommand)]
enum DlqCommand {
    /// Count the dead letters by reason, with the oldest one's age; takes nothing.
    List {
        #[command(flatten)]
        from: DlqFrom,
        /// Only reasons containing this text (case-insensitive).
        #[arg(long)]
        reason: Option<String>,
        /// Read at most this many.
        #[arg(long, default_value_t = 100_000)]
        limit: usize,
    },
    /// Show dead letters one by one: key, reason, deliveries, when, headers, payload; takes
    /// nothing.
    Show {
        #[command(flatten)]
        from: DlqFrom,
        #[command(flatten)]
        filter: DlqFilter,
        /// At most this many.
        #[arg(long, default_value_t = 20)]
        limit: usize,
    },
    /// Publish dead letters back to their source with their key and headers, then remove them:
    /// one whose key completed meanwhile is acked as a duplicate, one that failed runs again.
    Replay {
        #[command(flatten)]
        from: DlqFrom,
        #[command(flatten)]
        filter: DlqFilter,
        /// Only those dead-lettered at least this long ago.
        #[arg(long, value_parser = units::parse_duration)]
        older_than: Option<Duration>,
        /// At most this many.
        #[arg(long, default_value_t = 1000)]
        limit: usize,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
    },
    /// Delete dead letters for good.
    Purge {
        #[command(flatten)]
        from: DlqFrom,
        #[command(flatten)]
        filter: DlqFilter,
        /// Only those dead-lettered at least this long ago (`0s`: all of them).
        #[arg(long, value_parser = units::parse_duration)]
        older_than: Duration,
        /// At most this many.
        #[arg(long, default_value_t = 100_000)]
        limit: usize,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
    },
}

impl DlqFilter {
    /// The selection of these filters, up to `limit`.
    fn selection(&self, limit: usize) -> Selection {
        let mut selection = Selection::all(limit.max(1));
        if let Some(reason) = &self.reason {
            selection = selection.reason(reason.clone());
        }
        if let Some(key) = &self.key {
            selection = selection.key(key.clone());
        }
        selection
    }
}

/// `idem dlq …`.
async fn dlq(action: DlqCommand) -> Result<String, Error> {
    let confirm = |yes: bool| if yes { Confirm::Yes } else { Confirm::Ask };
    match action {
        DlqCommand::List { from, reason, limit } => {
            idem::dlq::list(&from.from, reason.as_deref(), limit.max(1), from.json).await
        }
        DlqCommand::Show { from, filter, limit } => {
            idem::dlq::show(&from.from, &filter.selection(limit), from.json).await
        }
        DlqCommand::Replay {
            from,
            filter,
            older_than,
            limit,
            yes,
        } => {
            let mut selection = filter.selection(limit);
            if let Some(age) = older_than {
                selection = selection.older_than(age);
            }
            idem::dlq::settle(&from.from, &selection, Settle::Replay, confirm(yes), from.json).await
        }
        DlqCommand::Purge {
            from,
            filter,
            older_than,
            limit,
            yes,
        } => {
            let selection = filter.selection(limit).older_than(older_than);
            idem::dlq::settle(&from.from, &selection, Settle::Purge, confirm(yes), from.json).await
        }
    }
}

#[derive(Debug, Args)]
struct BoxArgs {
    /// The database holding the tables: postgres://… (the inbox and the outbox), or mysql://…
    /// and mariadb://… (the outbox).
    #[arg(long, env = "IDEM_DATABASE")]
    database: String,
    /// The tables' schema.
    #[arg(long, env = "IDEM_SCHEMA", default_value = "public")]
    schema: String,
    /// The inbox table.
    #[arg(long, env = "IDEM_INBOX_TABLE", default_value = "idempotency_inbox")]
    inbox_table: String,
    /// The outbox table.
    #[arg(long, env = "IDEM_OUTBOX_TABLE", default_value = "idempotency_outbox")]
    outbox_table: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

impl BoxArgs {
    fn location(&self) -> Result<idem::boxes::Location, Error> {
        let tables = idempotency_outbox::Tables::default()
            .schema(&self.schema)
            .and_then(|t| t.inbox(&self.inbox_table))
            .and_then(|t| t.outbox(&self.outbox_table))
            .map_err(|e| Error::Boxes(e.to_string()))?;
        Ok(idem::boxes::Location {
            database: self.database.clone(),
            tables,
        })
    }
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum InboxStateArg {
    Pending,
    Processed,
    Dead,
}

impl From<InboxStateArg> for idempotency_outbox::InboxState {
    fn from(state: InboxStateArg) -> Self {
        match state {
            InboxStateArg::Pending => Self::Pending,
            InboxStateArg::Processed => Self::Processed,
            InboxStateArg::Dead => Self::Dead,
        }
    }
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum FinishedStateArg {
    Processed,
    Dead,
}

#[derive(Debug, Subcommand)]
enum InboxCommand {
    /// List inbox rows in arrival order, with their attempts and last error.
    List {
        #[command(flatten)]
        at: BoxArgs,
        /// Only rows in this state.
        #[arg(long, value_enum)]
        state: Option<InboxStateArg>,
        /// Only this consumer's rows.
        #[arg(long)]
        consumer: Option<String>,
        /// At most this many rows.
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Show one row with its headers and payload.
    Show {
        #[command(flatten)]
        at: BoxArgs,
        /// The consumer.
        #[arg(long)]
        consumer: String,
        /// The idempotency key.
        key: String,
    },
    /// Put dead rows back to pending (after the handler is fixed): all of them, one
    /// consumer's, or one key's.
    Replay {
        #[command(flatten)]
        at: BoxArgs,
        /// Only this consumer's rows.
        #[arg(long)]
        consumer: Option<String>,
        /// Only this key's row.
        #[arg(long)]
        key: Option<String>,
    },
    /// Delete processed or dead rows finished longer ago than --older-than.
    Purge {
        #[command(flatten)]
        at: BoxArgs,
        /// Which rows.
        #[arg(long, value_enum)]
        state: FinishedStateArg,
        /// Only rows finished at least this long ago.
        #[arg(long, default_value = "7d", value_parser = units::parse_duration)]
        older_than: Duration,
        /// Only this consumer's rows.
        #[arg(long)]
        consumer: Option<String>,
    },
    /// Count rows by state, and the oldest pending one's age.
    Stats {
        #[command(flatten)]
        at: BoxArgs,
        /// Only this consumer's rows.
        #[arg(long)]
        consumer: Option<String>,
    },
    /// Create the inbox and outbox tables (under the migration lock; safe to repeat).
    Migrate {
        #[command(flatten)]
        at: BoxArgs,
    },
}

#[derive(Debug, Subcommand)]
enum OutboxCommand {
    /// List outbox rows not yet published (with --all, the sent ones too).
    List {
        #[command(flatten)]
        at: BoxArgs,
        /// Sent rows too.
        #[arg(long)]
        all: bool,
        /// At most this many rows.
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Pending, dead and sent counts, and the oldest pending row's age.
    Stats {
        #[command(flatten)]
        at: BoxArgs,
    },
    /// Make dead rows (parked after too many failed publishes) pending again, after a fix.
    Replay {
        #[command(flatten)]
        at: BoxArgs,
        /// Only this row.
        #[arg(long)]
        id: Option<i64>,
    },
    /// Delete dead rows parked at least this long ago.
    Purge {
        #[command(flatten)]
        at: BoxArgs,
        /// How long ago (`0s`: every dead row).
        #[arg(long, value_parser = units::parse_duration)]
        older_than: Duration,
    },
}

#[derive(Debug, Args)]
struct StoreArgs {
    /// The store: sqlite://PATH, postgres://..., mysql://..., redis://..., redis-cluster://h:p,h:p, memory://
    #[arg(long, env = "IDEM_STORE", default_value = "sqlite://idem.db")]
    store: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
struct DemoArgs {
    #[command(subcommand)]
    mode: Option<DemoMode>,
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

#[derive(Debug, Subcommand)]
enum DemoMode {
    /// The same payments service fed from a broker that delivers at least once (copies of a
    /// message, lost acks, a key reused with another payment), through `idem consume`'s
    /// consumer on the embedded SQLite store; double charges counted from the provider's ledger.
    Consume(DemoConsumeArgs),
}

#[derive(Debug, Args)]
struct DemoConsumeArgs {
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

#[derive(Debug, Subcommand)]
enum KeysCommand {
    /// List records, oldest first within each scope.
    List(ListArgs),
    /// Show one record, with the stored response when the gateway stored it.
    Get(GetArgs),
    /// Count records by state.
    Stats(StatsArgs),
    /// Delete expired records.
    Purge(PurgeArgs),
    /// End an in-flight attempt's lease now: its completion is refused, the next retry runs as
    /// the next attempt.
    Release(KeyActionArgs),
    /// Delete a key's record so that the key runs again as a new first attempt.
    Forget(ForgetArgs),
    /// Record an outcome by hand (an HTTP response, as the gateway stores it): retries replay it.
    Complete(CompleteArgs),
}

#[derive(Debug, Args)]
struct KeyActionArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// The key.
    key: String,
    /// The key's scope ("" for the global scope; `idem keys list` shows the gateway's).
    #[arg(long, default_value = "")]
    scope: String,
    /// Change the record without asking (otherwise asked on the terminal).
    #[arg(long, short = 'y')]
    yes: bool,
}

#[derive(Debug, Args)]
struct ForgetArgs {
    #[command(flatten)]
    action: KeyActionArgs,
    /// Forget the key even while an attempt runs (its completion is then refused, and a retry
    /// runs beside it).
    #[arg(long)]
    force: bool,
}

#[derive(Debug, Args)]
struct CompleteArgs {
    #[command(flatten)]
    action: KeyActionArgs,
    /// The response's status (100 to 599).
    #[arg(long, value_parser = clap::value_parser!(u16).range(100..=599))]
    status: u16,
    /// A file holding the response's body ("-" for standard input).
    #[arg(long)]
    body: String,
    /// A response header, `Name: value` (repeatable), e.g. `--header 'Content-Type: application/json'`.
    #[arg(long = "header", value_name = "NAME: VALUE")]
    headers: Vec<String>,
    /// How long the outcome is replayed.
    #[arg(long, default_value = "24h", value_parser = idem::flags::parse_retention)]
    retention: Duration,
    /// Take the key over even while an attempt runs (its completion is then refused).
    #[arg(long)]
    force: bool,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum StateArg {
    InFlight,
    Completed,
}

#[derive(Debug, Args)]
struct ListArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Only this scope ("" for the global scope).
    #[arg(long)]
    scope: Option<String>,
    /// Only records in this state.
    #[arg(long, value_enum)]
    state: Option<StateArg>,
    /// Only records whose state began at least this long ago.
    #[arg(long, value_parser = units::parse_duration)]
    older_than: Option<Duration>,
    /// At most this many records.
    #[arg(long, default_value_t = 100)]
    limit: usize,
    /// Continue after this scope (with --after-key): the last row of the previous page.
    #[arg(long, requires = "after_key")]
    after_scope: Option<String>,
    /// Continue after this key (with --after-scope).
    #[arg(long, requires = "after_scope")]
    after_key: Option<String>,
}

#[derive(Debug, Args)]
struct GetArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// The key.
    key: String,
    /// The key's scope ("" for the global scope). The gateway's scopes are hashes of the scope
    /// header; `idem keys list` shows them.
    #[arg(long, default_value = "")]
    scope: String,
}

#[derive(Debug, Args)]
struct StatsArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Only this scope.
    #[arg(long)]
    scope: Option<String>,
}

#[derive(Debug, Args)]
struct PurgeArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Records deleted per batch.
    #[arg(long, default_value_t = 1000)]
    batch: u64,
}

#[derive(Debug, Args)]
struct InflightArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Only requests in flight for at least this long.
    #[arg(long, default_value = "5m", value_parser = units::parse_duration)]
    older_than: Duration,
    /// Only this scope.
    #[arg(long)]
    scope: Option<String>,
    /// At most this many records.
    #[arg(long, default_value_t = 100)]
    limit: usize,
}

fn scope(text: &str) -> Result<Scope, Error> {
    Scope::new(text).map_err(|source| Error::Invalid {
        what: "scope",
        text: text.into(),
        source,
    })
}

fn key(text: &str) -> Result<Key, Error> {
    Key::new(text).map_err(|source| Error::Invalid {
        what: "key",
        text: text.into(),
        source,
    })
}

/// The store of an operations command, opened no further than `access` allows: only `idem
/// migrate` creates anything.
async fn open(args: &StoreArgs, access: Access) -> Result<DynStore, Error> {
    idempotency::open_with(&args.store, access)
        .await
        .map_err(|e| Error::open(&args.store, e))
}

async fn shutdown_signal() {
    let terminate = async {
        #[cfg(unix)]
        {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut signal) => {
                    signal.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        }
        #[cfg(not(unix))]
        std::future::pending::<()>().await;
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
    tracing::info!("shutting down: no new connections; finishing in-flight requests");
}

/// Runs one command; its output is printed on success.
async fn run(command: Command) -> Result<String, Error> {
    match command {
        Command::Serve(config) => {
            gateway::serve(*config, shutdown_signal()).await?;
            Ok(String::new())
        }
        Command::Consume(config) => {
            if let Some(name) = &config.help_source {
                return Ok(consume::source_help(name)?);
            }
            consume::consume(*config, shutdown_signal()).await?;
            Ok(String::new())
        }
        Command::Demo(args) => demo(args).await,
        Command::Keys { action } => keys(action).await,
        Command::Inflight(args) => {
            let scope = args.scope.as_deref().map(scope).transpose()?;
            ops::inflight(
                &open(&args.store, Access::ReadOnly).await?,
                scope,
                args.older_than,
                args.limit.max(1),
                args.store.json,
            )
            .await
        }
        Command::Inbox { action } => inbox(action).await,
        Command::Dlq { action } => dlq(action).await,
        Command::Probe { url, timeout } => idem::probe::probe(&url, timeout).await,
        Command::Relay(args) => match args.action {
            Some(RelayCommand::Migrate {
                database,
                schema,
                outbox_table,
            }) => idem::relay::migrate(&database, &schema, &outbox_table).await,
            None => {
                let command = <Cli as clap::CommandFactory>::command();
                let relay = command
                    .find_subcommand("relay")
                    .unwrap_or_else(|| unreachable!("idem has a relay command"));
                idem::relay::relay(*args.config, relay, shutdown_signal()).await?;
                Ok(String::new())
            }
        },
        Command::Outbox { action } => match action {
            OutboxCommand::List { at, all, limit } => {
                idem::boxes::outbox_list(&at.location()?, all, i64::from(limit.max(1)), at.json).await
            }
            OutboxCommand::Stats { at } => idem::boxes::outbox_stats(&at.location()?, at.json).await,
            OutboxCommand::Replay { at, id } => {
                idem::boxes::outbox_replay(&at.location()?, id, at.json).await
            }
            OutboxCommand::Purge { at, older_than } => {
                idem::boxes::outbox_purge(&at.location()?, older_than, at.json).await
            }
        },
        Command::Migrate(args) => {
            let _store = open(&args, Access::Create).await?;
            let url = idempotency::redact_url(&args.store);
            Ok(if args.json {
                serde_json::json!({ "store": url, "schema": "ready" }).to_string()
            } else {
                format!("{url}: schema ready\n")
            })
        }
    }
}

/// `idem demo`: the report, or an error carrying it when the ledger shows double charges.
async fn demo(args: DemoArgs) -> Result<String, Error> {
    if let Some(DemoMode::Consume(args)) = args.mode {
        return demo_consume(args).await;
    }
    let report = demo::run(demo::Options {
        requests: args.requests,
        store: args.store,
        concurrency: args.concurrency,
        progress: !args.quiet && !args.json,
        direct: args.direct,
        propagate: !args.no_key_propagation,
        reconcile: args.reconcile,
    })
    .await?;
    let text = if args.json {
        report.to_json().to_string()
    } else {
        report.to_table()
    };
    // Asking before running again leaves no double charge, with the key passed on or not.
    verdict(
        text,
        report.double_charges,
        args.direct || (args.no_key_propagation && !args.reconcile),
    )
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
async fn demo_consume(args: DemoConsumeArgs) -> Result<String, Error> {
    let report = demo::consume::run(demo::consume::Options {
        payments: args.payments as usize,
        store: args.store,
        concurrency: usize::from(args.concurrency),
        direct: args.direct,
        propagate: !args.no_key_propagation,
    })
    .await?;
    let text = if args.json {
        report.to_json().to_string()
    } else {
        report.to_table()
    };
    verdict(
        text,
        report.double_charges,
        args.direct || args.no_key_propagation,
    )
}

/// `idem inbox …`.
async fn inbox(action: InboxCommand) -> Result<String, Error> {
    use idem::boxes;
    match action {
        InboxCommand::List {
            at,
            state,
            consumer,
            limit,
        } => {
            boxes::inbox_list(
                &at.location()?,
                state.map(Into::into),
                consumer.as_deref(),
                i64::from(limit.max(1)),
                at.json,
            )
            .await
        }
        InboxCommand::Show { at, consumer, key } => {
            boxes::inbox_show(&at.location()?, &consumer, &key, at.json).await
        }
        InboxCommand::Replay { at, consumer, key } => {
            boxes::inbox_replay(&at.location()?, consumer.as_deref(), key.as_deref(), at.json).await
        }
        InboxCommand::Purge {
            at,
            state,
            older_than,
            consumer,
        } => {
            let state = match state {
                FinishedStateArg::Processed => idempotency_outbox::InboxState::Processed,
                FinishedStateArg::Dead => idempotency_outbox::InboxState::Dead,
            };
            boxes::inbox_purge(&at.location()?, state, consumer.as_deref(), older_than, at.json).await
        }
        InboxCommand::Stats { at, consumer } => {
            boxes::inbox_stats(&at.location()?, consumer.as_deref(), at.json).await
        }
        InboxCommand::Migrate { at } => {
            let location = at.location()?;
            boxes::migrate(&location).await?;
            let url = idempotency::redact_url(&location.database);
            Ok(if at.json {
                serde_json::json!({ "database": url, "inbox": location.tables.qualified_inbox(), "outbox": location.tables.qualified_outbox(), "schema": "ready" }).to_string()
            } else {
                format!(
                    "{url}: {} and {} ready\n",
                    location.tables.qualified_inbox(),
                    location.tables.qualified_outbox()
                )
            })
        }
    }
}

/// `idem keys …`.
async fn keys(action: KeysCommand) -> Result<String, Error> {
    match action {
        KeysCommand::List(args) => {
            let filter = list_filter(&args)?;
            ops::list(
                &open(&args.store, Access::ReadOnly).await?,
                &filter,
                args.store.json,
            )
            .await
        }
        KeysCommand::Get(args) => {
            let key = key(&args.key)?;
            let scope = scope(&args.scope)?;
            ops::get(
                &open(&args.store, Access::ReadOnly).await?,
                &scope,
                &key,
                args.store.json,
            )
            .await
        }
        KeysCommand::Stats(args) => {
            let scope = args.scope.as_deref().map(scope).transpose()?;
            ops::stats(
                &open(&args.store, Access::ReadOnly).await?,
                scope.as_ref(),
                args.store.json,
            )
            .await
        }
        KeysCommand::Release(args) => key_action(&args, KeyAction::Release).await,
        KeysCommand::Forget(args) => key_action(&args.action, KeyAction::Forget { force: args.force }).await,
        KeysCommand::Complete(args) => {
            let outcome = stored_response(&args)?;
            let action = KeyAction::Complete {
                outcome,
                retention: args.retention,
                force: args.force,
            };
            key_action(&args.action, action).await
        }
        KeysCommand::Purge(args) => {
            ops::purge(
                &open(&args.store, Access::Existing).await?,
                args.batch.max(1),
                args.store.json,
            )
            .await
        }
    }
}

/// Runs `action` on the key `args` name; changes go through a store opened without DDL.
async fn key_action(args: &KeyActionArgs, action: KeyAction) -> Result<String, Error> {
    let key = key(&args.key)?;
    let scope = scope(&args.scope)?;
    let confirm = if args.yes { Confirm::Yes } else { Confirm::Ask };
    idem::key_actions::act(
        &open(&args.store, Access::Existing).await?,
        &scope,
        &key,
        &action,
        confirm,
        args.store.json,
    )
    .await
}

/// The response `idem keys complete` records, as the gateway stores one.
fn stored_response(args: &CompleteArgs) -> Result<idempotency::Outcome, Error> {
    let body = if args.body == "-" {
        let mut body = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut body)
            .map_err(|e| Error::Usage(format!("--body -: {e}")))?;
        body
    } else {
        std::fs::read(&args.body).map_err(|e| Error::Usage(format!("--body {}: {e}", args.body)))?
    };
    let mut headers = http::HeaderMap::new();
    for header in &args.headers {
        let parsed = header.split_once(':').and_then(|(name, value)| {
            let name = http::HeaderName::from_bytes(name.trim().as_bytes()).ok()?;
            let value = http::HeaderValue::from_str(value.trim()).ok()?;
            Some((name, value))
        });
        let (name, value) = parsed.ok_or_else(|| {
            Error::Usage(format!(
                "--header `{header}`: expected `Name: value` with a valid header name and value"
            ))
        })?;
        headers.append(name, value);
    }
    let status = http::StatusCode::from_u16(args.status)
        .map_err(|e| Error::Usage(format!("--status {}: {e}", args.status)))?;
    Ok(idempotency_http::StoredOutcome::Response {
        status,
        headers,
        body: body.into(),
    }
    .encode())
}

/// The filter `idem keys list` asks the store with.
fn list_filter(args: &ListArgs) -> Result<ListFilter, Error> {
    let mut filter = ListFilter::default().limit(args.limit.max(1));
    if let Some(text) = &args.scope {
        filter = filter.scope(scope(text)?);
    }
    if let Some(state) = args.state {
        filter = filter.state(match state {
            StateArg::InFlight => StateFilter::InFlight,
            StateArg::Completed => StateFilter::Completed,
        });
    }
    if let Some(age) = args.older_than {
        filter = filter.older_than(age);
    }
    if let (Some(after_scope), Some(after_key)) = (&args.after_scope, &args.after_key) {
        filter = filter.after(scope(after_scope)?, key(after_key)?);
    }
    Ok(filter)
}

/// Logs go to standard error, filtered by `IDEM_LOG` (`tracing-subscriber`'s `EnvFilter`
/// syntax: `debug`, `warn,idempotency=debug`, …); without it, `serve` logs at `info`, `demo`
/// at `error` (its faults make the gateway warn by design, and the table reports them) and the
/// other commands at `warn`. Directives that do not parse are ignored.
fn init_logging(command: &Command, format: LogFormat) -> idem::telemetry::Telemetry {
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;

    let default = match command {
        Command::Serve(_) | Command::Consume(_) | Command::Relay(_) => tracing::Level::INFO,
        Command::Demo(_) => tracing::Level::ERROR,
        _ => tracing::Level::WARN,
    };
    let filter = tracing_subscriber::EnvFilter::builder()
        .with_default_directive(tracing_subscriber::filter::LevelFilter::from_level(default).into())
        .with_env_var("IDEM_LOG")
        .from_env_lossy();
    // Colours only on a terminal: a log file or a collector would keep the escape codes.
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let fmt = match format {
        LogFormat::Text => fmt.with_target(false).boxed(),
        // JSON lines carry their target: `idempotency_http::request` marks the request events.
        LogFormat::Json => fmt.json().with_current_span(false).with_span_list(false).boxed(),
    };
    // Spans go to the exporter whatever IDEM_LOG says of the log lines.
    let (telemetry, traces) = match idem::telemetry::Telemetry::start() {
        Ok(started) => started,
        Err(error) => {
            eprintln!("idem: warning: traces are not exported: {error}");
            (idem::telemetry::Telemetry::default(), None)
        }
    };
    let traces = traces.map(|layer| layer.with_filter(tracing_subscriber::filter::LevelFilter::INFO));
    tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(traces)
        .init();
    telemetry
}

fn main() -> ExitCode {
    // The sources `--from` takes are the brokers this build has: their examples come from the
    // registry, not from a paragraph written by hand.
    let command = <Cli as clap::CommandFactory>::command()
        .mut_subcommand("consume", |consume| consume.after_help(consume::sources_help()));
    // `IDEM_STORE_FILE` and the other secrets' files, read as their variables would be.
    let (command, secrets) = match idem::flags::secrets_from_files(command, &|name| std::env::var_os(name)) {
        Ok(read) => read,
        Err(error) => clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("{error}\n")).exit(),
    };
    // `idem serve --config FILE`: the file's settings where no flag or variable gives one.
    let merged = match idem::config_file::merge(&command, std::env::args_os().collect(), &secrets) {
        Ok(merged) => merged,
        Err(error) => {
            eprintln!("idem: error: {error}");
            return ExitCode::FAILURE;
        }
    };
    let mut cli = match <Cli as clap::FromArgMatches>::from_arg_matches(&merged.matches) {
        Ok(cli) => cli,
        Err(error) => error.exit(),
    };
    if let Command::Serve(config) = &mut cli.command {
        if let Some(file) = &merged.file {
            config.routes.clone_from(&file.routes);
            config.reload_args = Some(std::env::args_os().collect());
        }
        if let Err(conflict) = config.check() {
            clap::Error::raw(clap::error::ErrorKind::ArgumentConflict, format!("{conflict}\n")).exit();
        }
        if config.check {
            if let Some(serve) = command.find_subcommand("serve") {
                print!("{}", idem::config_file::report(&merged, serve));
            }
            return ExitCode::SUCCESS;
        }
        for warning in merged.file.iter().flat_map(|file| &file.warnings) {
            eprintln!("idem: warning: {warning}");
        }
    }
    let telemetry = init_logging(&cli.command, cli.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("idem: error: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(run(cli.command));
    // The spans still waiting go out before the exit.
    telemetry.shutdown();
    match result {
        Ok(output) => {
            print!("{output}");
            if !output.is_empty() && !output.ends_with('\n') {
                println!();
            }
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("idem: error: {error}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::Cli;

    /// The variables several commands read, each for one setting: one `ConfigMap` shared by a
    /// gateway, a consumer and a relay through `envFrom` configures each the same way. Every
    /// other variable is read by one command only (docs/DEPLOYING.md lists them).
    const SHARED: &[&str] = &[
        "IDEM_ADMIN_LISTEN",
        "IDEM_ADMIN_TOKEN",
        "IDEM_DATABASE",
        "IDEM_FROM",
        "IDEM_INBOX_TABLE",
        "IDEM_LEASE",
        "IDEM_LOG_KEYS",
        "IDEM_OUTBOX_TABLE",
        "IDEM_RECONCILE",
        "IDEM_RETENTION",
        "IDEM_SCHEMA",
        "IDEM_STORE",
        "IDEM_UI",
        "IDEM_UI_DATABASE",
        "IDEM_UI_SCHEMA",
    ];

    /// Every `(command path, flag)` that reads each variable.
    fn variables(command: &clap::Command, path: &str, found: &mut BTreeMap<String, Vec<(String, String)>>) {
        for arg in command.get_arguments() {
            if let (Some(env), Some(long)) = (arg.get_env().and_then(|env| env.to_str()), arg.get_long()) {
                found
                    .entry(env.to_owned())
                    .or_default()
                    .push((path.to_owned(), long.to_owned()));
            }
        }
        for sub in command.get_subcommands() {
            variables(sub, &format!("{path} {}", sub.get_name()), found);
        }
    }

    /// A variable means one thing wherever it is read: the same flag in every command that
    /// reads it, and only the listed variables are read by more than one (`IDEM_TO` was
    /// `idem consume`'s handler and `idem relay`'s destination, `IDEM_BATCH` a claim window
    /// and a relay round, `IDEM_RETENTION` a record's life and a sent row's, `IDEM_CONFIG`
    /// the gateway's routes and the relay's tables).
    #[test]
    fn a_variable_means_one_thing_wherever_it_is_read() {
        let mut found = BTreeMap::new();
        variables(&<Cli as clap::CommandFactory>::command(), "idem", &mut found);
        for (variable, readers) in &found {
            let commands: std::collections::BTreeSet<&str> =
                readers.iter().map(|(path, _)| path.as_str()).collect();
            if commands.len() > 1 {
                assert!(
                    SHARED.contains(&variable.as_str()),
                    "{variable} is read by {readers:?}: give each its own variable, or list it as shared"
                );
            }
            let flags: std::collections::BTreeSet<&str> =
                readers.iter().map(|(_, long)| long.as_str()).collect();
            assert_eq!(
                flags.len(),
                1,
                "{variable} is read as different flags: {readers:?}"
            );
        }
        for variable in SHARED {
            assert!(
                found.contains_key(*variable),
                "{variable} is listed but read by no command"
            );
        }
        // The relay's own settings are its own.
        for variable in [
            "IDEM_RELAY_TO",
            "IDEM_RELAY_CONFIG",
            "IDEM_RELAY_BATCH",
            "IDEM_RELAY_RETENTION",
        ] {
            assert_eq!(found[variable].len(), 1, "{variable}: {:?}", found[variable]);
        }
    }
}
