//! The command line: `idem`'s commands, each given to the module that owns its arguments and
//! its run (the entry point parses, settles `idem serve`'s file and dispatches here).

use clap::{Parser, Subcommand};

use crate::{Error, consume, demo, gateway, ops, probe, relay};

/// Effectively-once HTTP requests and the operations on their records.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about, propagate_version = true)]
pub struct Cli {
    /// The command.
    #[command(subcommand)]
    pub command: Command,
    /// Log lines as `text` (for people) or `json` (one JSON object per line, for a log
    /// pipeline), on standard error.
    #[arg(
        long,
        global = true,
        env = "IDEM_LOG_FORMAT",
        default_value = "text",
        value_enum
    )]
    pub log_format: crate::telemetry::LogFormat,
}

/// `idem`'s commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the idempotency gateway in front of an HTTP upstream.
    Serve(Box<gateway::Config>),
    /// Consume a broker's messages and POST each to an HTTP handler, once per key: acked only
    /// once the handler's answer is recorded.
    Consume(Box<consume::Config>),
    /// Run a payments upstream behind the gateway under a client retry storm, and count double
    /// charges from the upstream's ledger (there are none).
    Demo(demo::command::Args),
    /// Inspect and maintain the records of a store.
    Keys {
        /// What to do.
        #[command(subcommand)]
        action: ops::keys::Command,
    },
    /// Report requests in flight for longer than a duration: stale leases mean crashed or hung
    /// workers.
    Inflight(ops::keys::InflightArgs),
    /// Create or upgrade the store's schema (stores also do this when they open).
    Migrate(ops::StoreArgs),
    /// Inspect and maintain an inbox on PostgreSQL: list, show, replay dead messages, purge.
    Inbox {
        /// What to do.
        #[command(subcommand)]
        action: ops::boxes::InboxCommand,
    },
    /// Inspect and maintain an outbox on PostgreSQL or MySQL: pending and dead messages, the backlog,
    /// replay of dead rows, purge.
    Outbox {
        /// What to do.
        #[command(subcommand)]
        action: ops::boxes::OutboxCommand,
    },
    /// Publish the rows an application writes into an outbox table (PostgreSQL, MySQL), in order per
    /// group, each with its key as Idempotency-Key, once the broker confirms it (docs/OUTBOX.md).
    Relay(relay::Args),
    /// The dead letters of a consumer's source, on any broker: list them by reason, show them,
    /// replay them to the source after a fix, purge them.
    Dlq {
        /// What to do.
        #[command(subcommand)]
        action: ops::dlq::Command,
    },
    /// GET a URL and exit 0 on a 2xx answer within --timeout, 1 otherwise with the reason: a
    /// health check for the image, which has no shell or curl
    /// (`idem probe http://127.0.0.1:9090/readyz`).
    Probe(probe::Args),
}

impl Command {
    /// The level logged at without `IDEM_LOG`: `info` for the long-running commands, `error`
    /// for `demo` (its faults make the gateway warn by design, and the table reports them),
    /// `warn` for the others.
    #[must_use]
    pub fn log_level(&self) -> tracing::Level {
        match self {
            Self::Serve(_) | Self::Consume(_) | Self::Relay(_) => tracing::Level::INFO,
            Self::Demo(_) => tracing::Level::ERROR,
            _ => tracing::Level::WARN,
        }
    }
}

/// Runs one command until it is done (or, for the long-running ones, until SIGTERM or Ctrl-C);
/// what it prints.
///
/// # Errors
///
/// The command's.
pub async fn run(command: Command) -> Result<String, Error> {
    let shutdown = crate::server::shutdown_signal;
    match command {
        Command::Serve(config) => {
            gateway::serve(*config, shutdown()).await?;
            Ok(String::new())
        }
        Command::Consume(config) => {
            if let Some(name) = &config.help_source {
                return Ok(consume::source_help(name)?);
            }
            consume::consume(*config, shutdown()).await?;
            Ok(String::new())
        }
        Command::Demo(args) => demo::command::run(args).await,
        Command::Keys { action } => ops::keys::run(action).await,
        Command::Inflight(args) => ops::keys::inflight_command(args).await,
        Command::Migrate(args) => ops::keys::migrate(&args).await,
        Command::Inbox { action } => ops::boxes::run_inbox(action).await,
        Command::Outbox { action } => ops::boxes::run_outbox(action).await,
        Command::Dlq { action } => ops::dlq::run(action).await,
        Command::Probe(args) => probe::run(args).await,
        Command::Relay(args) => {
            let cli = <Cli as clap::CommandFactory>::command();
            let relay = cli
                .find_subcommand("relay")
                .unwrap_or_else(|| unreachable!("idem has a relay command"));
            relay::run(args, relay, shutdown()).await
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
