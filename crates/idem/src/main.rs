//! `idem`: the idempotency gateway in front of any HTTP service, a payments demo, and the
//! operations CLI for idempotency stores. See `idem --help`.
#![allow(clippy::print_stdout, clippy::print_stderr)] // a command-line program: output is the point

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use http::{HeaderName, Method};
use idem::{demo, gateway, ops, units};
use idempotency::{DynStore, Key, ListFilter, Scope, StateFilter};

/// Effectively-once HTTP requests and the operations on their records.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the idempotency gateway in front of an HTTP upstream.
    Serve(ServeArgs),
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
}

fn duration(text: &str) -> Result<Duration, String> {
    units::parse_duration(text)
}

fn size(text: &str) -> Result<usize, String> {
    units::parse_size(text)
}

fn method(text: &str) -> Result<Method, String> {
    let upper = text.trim().to_ascii_uppercase();
    match upper.as_str() {
        "GET" | "HEAD" | "POST" | "PUT" | "PATCH" | "DELETE" | "OPTIONS" => {
            Method::from_bytes(upper.as_bytes()).map_err(|e| e.to_string())
        }
        _ => Err(format!(
            "`{text}` is not an HTTP method (GET, POST, PUT, PATCH, DELETE, ...)"
        )),
    }
}

fn header_name(text: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(text.trim().as_bytes()).map_err(|_| format!("`{text}` is not a header name"))
}

fn upstream(text: &str) -> Result<http::Uri, String> {
    gateway::parse_upstream(text)
}

#[derive(Debug, Args)]
struct StoreArgs {
    /// The store: sqlite://PATH, postgres://..., redis://..., redis-cluster://h:p,h:p, memory://
    #[arg(long, env = "IDEM_STORE", default_value = "sqlite://idem.db")]
    store: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// The upstream's base URL (http://host:port[/base]).
    #[arg(long, env = "IDEM_UPSTREAM", value_parser = upstream)]
    upstream: http::Uri,
    /// Where the gateway listens.
    #[arg(long, env = "IDEM_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Serve /metrics and /healthz here instead of under /_idem/ on the main listener.
    #[arg(long, env = "IDEM_ADMIN_LISTEN")]
    admin_listen: Option<SocketAddr>,
    /// The store: sqlite://PATH, postgres://..., redis://..., redis-cluster://h:p,h:p, memory://
    #[arg(long, env = "IDEM_STORE", default_value = "sqlite://idem.db")]
    store: String,
    /// How long a request may run without a heartbeat before a retry may take over.
    #[arg(long, env = "IDEM_LEASE", default_value = "30s", value_parser = duration)]
    lease: Duration,
    /// How long a completed request's response is replayed.
    #[arg(long, env = "IDEM_RETENTION", default_value = "24h", value_parser = duration)]
    retention: Duration,
    /// The largest request body (413 beyond it).
    #[arg(long, env = "IDEM_MAX_BODY", default_value = "1MiB", value_parser = size)]
    max_body: usize,
    /// The largest response that is stored for replay (larger ones pass through, not replayable).
    #[arg(long, env = "IDEM_MAX_RESPONSE", default_value = "1MiB", value_parser = size)]
    max_response: usize,
    /// The guarded methods, comma-separated.
    #[arg(long, env = "IDEM_METHODS", default_value = "POST,PATCH", value_delimiter = ',', value_parser = method)]
    methods: Vec<Method>,
    /// Answer 400 to guarded requests without an Idempotency-Key.
    #[arg(long, env = "IDEM_REQUIRE_KEY")]
    require_key: bool,
    /// Scope keys by a hash of this header's value (for example Authorization).
    #[arg(long, env = "IDEM_SCOPE_HEADER", value_parser = header_name)]
    scope_header: Option<HeaderName>,
    /// Wait mode: a duplicate of a running request waits up to this long for its response.
    #[arg(long, env = "IDEM_WAIT", value_parser = duration)]
    wait: Option<Duration>,
    /// Forward requests without the guard while the store is unreachable (default: 503).
    #[arg(long, env = "IDEM_FAIL_OPEN")]
    fail_open: bool,
    /// How long the upstream may take to answer (504 after it, and the key is released).
    #[arg(long, env = "IDEM_UPSTREAM_TIMEOUT", default_value = "60s", value_parser = duration)]
    upstream_timeout: Duration,
}

#[derive(Debug, Args)]
struct DemoArgs {
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
    #[arg(long, value_parser = duration)]
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
    #[arg(long, default_value = "5m", value_parser = duration)]
    older_than: Duration,
    /// Only this scope.
    #[arg(long)]
    scope: Option<String>,
    /// At most this many records.
    #[arg(long, default_value_t = 100)]
    limit: usize,
}

fn scope(text: &str) -> Result<Scope, String> {
    Scope::new(text).map_err(|e| format!("invalid scope `{text}`: {e}"))
}

async fn open(args: &StoreArgs) -> Result<DynStore, String> {
    idempotency::open(&args.store)
        .await
        .map_err(|e| format!("store {}: {e}", idempotency::redact_url(&args.store)))
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

async fn run(command: Command) -> Result<String, String> {
    match command {
        Command::Serve(args) => {
            let config = gateway::Config {
                listen: args.listen,
                admin_listen: args.admin_listen,
                upstream: args.upstream,
                store: args.store,
                lease: args.lease,
                retention: args.retention,
                max_body: args.max_body,
                max_response: args.max_response,
                methods: args.methods,
                require_key: args.require_key,
                scope_header: args.scope_header,
                wait: args.wait,
                fail_open: args.fail_open,
                upstream_timeout: args.upstream_timeout,
            };
            gateway::serve(config, shutdown_signal()).await?;
            Ok(String::new())
        }
        Command::Demo(args) => {
            let report = demo::run(demo::Options {
                requests: args.requests,
                store: args.store,
                concurrency: args.concurrency,
                progress: !args.quiet && !args.json,
                direct: args.direct,
            })
            .await?;
            let text = if args.json {
                report.to_json().to_string()
            } else {
                report.to_table()
            };
            if report.double_charges > 0 && !args.direct {
                return Err(format!("{text}\nthe upstream's ledger shows double charges"));
            }
            Ok(text)
        }
        Command::Keys { action } => match action {
            KeysCommand::List(args) => {
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
                    let key = Key::new(after_key).map_err(|e| format!("invalid key `{after_key}`: {e}"))?;
                    filter = filter.after(scope(after_scope)?, key);
                }
                ops::list(&open(&args.store).await?, &filter, args.store.json).await
            }
            KeysCommand::Get(args) => {
                let key = Key::new(&args.key).map_err(|e| format!("invalid key `{}`: {e}", args.key))?;
                ops::get(
                    &open(&args.store).await?,
                    &scope(&args.scope)?,
                    &key,
                    args.store.json,
                )
                .await
            }
            KeysCommand::Stats(args) => {
                let scope = args.scope.as_deref().map(scope).transpose()?;
                ops::stats(&open(&args.store).await?, scope.as_ref(), args.store.json).await
            }
            KeysCommand::Purge(args) => {
                ops::purge(&open(&args.store).await?, args.batch.max(1), args.store.json).await
            }
        },
        Command::Inflight(args) => {
            let scope = args.scope.as_deref().map(scope).transpose()?;
            ops::inflight(
                &open(&args.store).await?,
                scope,
                args.older_than,
                args.limit.max(1),
                args.store.json,
            )
            .await
        }
        Command::Migrate(args) => {
            let _store = open(&args).await?;
            let url = idempotency::redact_url(&args.store);
            Ok(if args.json {
                serde_json::json!({ "store": url, "schema": "ready" }).to_string()
            } else {
                format!("{url}: schema ready\n")
            })
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let level = match std::env::var("IDEM_LOG").as_deref() {
        Ok("error") => tracing::Level::ERROR,
        Ok("debug") => tracing::Level::DEBUG,
        Ok("trace") => tracing::Level::TRACE,
        Ok("warn") => tracing::Level::WARN,
        Ok(_) => tracing::Level::INFO,
        Err(_) if matches!(cli.command, Command::Serve(_)) => tracing::Level::INFO,
        Err(_) => tracing::Level::WARN,
    };
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("idem: error: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli.command)) {
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
