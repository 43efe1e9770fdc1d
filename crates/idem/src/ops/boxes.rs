//! `idem inbox list|show|replay|purge|stats` and `idem outbox list|stats|replay|purge`: the inbox
//! (on PostgreSQL) and the outbox (on PostgreSQL, MySQL or MariaDB). Human tables by default,
//! JSON with `--json`. Inspection runs in read-only sessions and never creates a table.

use std::time::Duration;

use idempotency::mysql::sqlx::mysql::MySqlPoolOptions;
use idempotency::postgres::sqlx::{self, PgPool, postgres::PgPoolOptions};
use idempotency_outbox::{Database, InboxRow, InboxState, Tables};
use serde_json::{Value, json};

use super::{age_text, table};
use crate::error::Error;

/// Where the inbox and outbox tables are, and how to print.
#[derive(Debug, clap::Args)]
pub struct BoxArgs {
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
    fn location(&self) -> Result<Location, Error> {
        let tables = Tables::default()
            .schema(&self.schema)
            .and_then(|t| t.inbox(&self.inbox_table))
            .and_then(|t| t.outbox(&self.outbox_table))
            .map_err(|e| Error::Boxes(e.to_string()))?;
        Ok(Location {
            database: self.database.clone(),
            tables,
        })
    }
}

/// An inbox row's state, as `--state` names it.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum InboxStateArg {
    /// Not handled yet.
    Pending,
    /// Handled.
    Processed,
    /// Parked after too many failures.
    Dead,
}

impl From<InboxStateArg> for InboxState {
    fn from(state: InboxStateArg) -> Self {
        match state {
            InboxStateArg::Pending => Self::Pending,
            InboxStateArg::Processed => Self::Processed,
            InboxStateArg::Dead => Self::Dead,
        }
    }
}

/// A finished inbox row's state, as `idem inbox purge --state` names it.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum FinishedStateArg {
    /// Handled.
    Processed,
    /// Parked after too many failures.
    Dead,
}

/// `idem inbox …`.
#[derive(Debug, clap::Subcommand)]
pub enum InboxCommand {
    /// List inbox rows in arrival order, with their attempts and last error.
    List {
        /// Where the tables are.
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
        /// Where the tables are.
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
        /// Where the tables are.
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
        /// Where the tables are.
        #[command(flatten)]
        at: BoxArgs,
        /// Which rows.
        #[arg(long, value_enum)]
        state: FinishedStateArg,
        /// Only rows finished at least this long ago.
        #[arg(long, default_value = "7d", value_parser = crate::units::parse_duration)]
        older_than: Duration,
        /// Only this consumer's rows.
        #[arg(long)]
        consumer: Option<String>,
    },
    /// Count rows by state, and the oldest pending one's age.
    Stats {
        /// Where the tables are.
        #[command(flatten)]
        at: BoxArgs,
        /// Only this consumer's rows.
        #[arg(long)]
        consumer: Option<String>,
    },
    /// Create the inbox and outbox tables (under the migration lock; safe to repeat).
    Migrate {
        /// Where the tables are.
        #[command(flatten)]
        at: BoxArgs,
    },
}

/// `idem outbox …`.
#[derive(Debug, clap::Subcommand)]
pub enum OutboxCommand {
    /// List outbox rows not yet published (with --all, the sent ones too).
    List {
        /// Where the tables are.
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
        /// Where the tables are.
        #[command(flatten)]
        at: BoxArgs,
    },
    /// Make dead rows (parked after too many failed publishes) pending again, after a fix.
    Replay {
        /// Where the tables are.
        #[command(flatten)]
        at: BoxArgs,
        /// Only this row.
        #[arg(long)]
        id: Option<i64>,
    },
    /// Delete dead rows parked at least this long ago.
    Purge {
        /// Where the tables are.
        #[command(flatten)]
        at: BoxArgs,
        /// How long ago (`0s`: every dead row).
        #[arg(long, value_parser = crate::units::parse_duration)]
        older_than: Duration,
    },
}

/// Runs `idem inbox …`; what it prints.
///
/// # Errors
///
/// The database's; tables that are not there.
pub async fn run_inbox(action: InboxCommand) -> Result<String, Error> {
    match action {
        InboxCommand::List {
            at,
            state,
            consumer,
            limit,
        } => {
            inbox_list(
                &at.location()?,
                state.map(Into::into),
                consumer.as_deref(),
                i64::from(limit.max(1)),
                at.json,
            )
            .await
        }
        InboxCommand::Show { at, consumer, key } => {
            inbox_show(&at.location()?, &consumer, &key, at.json).await
        }
        InboxCommand::Replay { at, consumer, key } => {
            inbox_replay(&at.location()?, consumer.as_deref(), key.as_deref(), at.json).await
        }
        InboxCommand::Purge {
            at,
            state,
            older_than,
            consumer,
        } => {
            let state = match state {
                FinishedStateArg::Processed => InboxState::Processed,
                FinishedStateArg::Dead => InboxState::Dead,
            };
            inbox_purge(&at.location()?, state, consumer.as_deref(), older_than, at.json).await
        }
        InboxCommand::Stats { at, consumer } => {
            inbox_stats(&at.location()?, consumer.as_deref(), at.json).await
        }
        InboxCommand::Migrate { at } => {
            let location = at.location()?;
            migrate(&location).await?;
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

/// Runs `idem outbox …`; what it prints.
///
/// # Errors
///
/// The database's; tables that are not there.
pub async fn run_outbox(action: OutboxCommand) -> Result<String, Error> {
    match action {
        OutboxCommand::List { at, all, limit } => {
            outbox_list(&at.location()?, all, i64::from(limit.max(1)), at.json).await
        }
        OutboxCommand::Stats { at } => outbox_stats(&at.location()?, at.json).await,
        OutboxCommand::Replay { at, id } => outbox_replay(&at.location()?, id, at.json).await,
        OutboxCommand::Purge { at, older_than } => outbox_purge(&at.location()?, older_than, at.json).await,
    }
}

/// Where the tables are.
#[derive(Debug, Clone)]
pub struct Location {
    /// The database's URL: `postgres://…`, or for an outbox `mysql://…` and `mariadb://…`.
    pub database: String,
    /// The tables' names.
    pub tables: Tables,
}

impl Location {
    /// A pool of two connections; `read_only` sessions refuse every write.
    async fn pool(&self, read_only: bool) -> Result<PgPool, Error> {
        self.pool_of(2, read_only).await
    }

    /// Whether the URL names a MySQL or MariaDB server.
    pub(crate) fn is_mysql(&self) -> bool {
        matches!(
            self.database.split_once("://").map(|(scheme, _)| scheme),
            Some("mysql" | "mariadb")
        )
    }

    /// A pool of `connections` on the outbox's database, PostgreSQL or MySQL; `read_only`
    /// sessions refuse every write.
    pub(crate) async fn database_of(&self, connections: u32, read_only: bool) -> Result<Database, Error> {
        if !self.is_mysql() {
            return Ok(Database::Postgres(self.pool_of(connections, read_only).await?));
        }
        let url = idempotency::redact_url(&self.database);
        let options = idempotency::mysql::MysqlOptions::from_url(&self.database)
            .map_err(|e| Error::Boxes(e.to_string()))?;
        let pool = MySqlPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(Duration::from_secs(10))
            .after_connect(move |connection, _| {
                Box::pin(async move {
                    if read_only {
                        sqlx::query("SET SESSION TRANSACTION READ ONLY")
                            .execute(connection)
                            .await?;
                    }
                    Ok(())
                })
            })
            .connect_with(options.connect)
            .await
            .map_err(|e| Error::Boxes(format!("{url}: {}", idempotency::redact_url(&e.to_string()))))?;
        Ok(Database::MySql(pool))
    }

    /// A pool of `connections`; `read_only` sessions refuse every write. The database's URL is
    /// redacted in errors, the driver's message included.
    pub(crate) async fn pool_of(&self, connections: u32, read_only: bool) -> Result<PgPool, Error> {
        let url = idempotency::redact_url(&self.database);
        if self.is_mysql() {
            return Err(Error::Boxes(format!(
                "{url}: the inbox is on PostgreSQL (the outbox may be on MySQL: `idem outbox`, `idem relay`)"
            )));
        }
        let pool = PgPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(Duration::from_secs(10))
            .after_connect(move |connection, _| {
                Box::pin(async move {
                    if read_only {
                        sqlx::query("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
                            .execute(connection)
                            .await?;
                    }
                    Ok(())
                })
            })
            .connect(&self.database)
            .await
            .map_err(|e| Error::Boxes(format!("{url}: {}", idempotency::redact_url(&e.to_string()))))?;
        Ok(pool)
    }

    /// A pool on tables that exist with this version's mark.
    pub(crate) async fn checked(&self, read_only: bool) -> Result<PgPool, Error> {
        let pool = self.pool(read_only).await?;
        self.tables.check(&pool).await?;
        Ok(pool)
    }

    /// A pool of `connections` whose outbox table exists and is of this version (a service
    /// that only relays has no inbox).
    pub(crate) async fn outbox(&self, connections: u32, read_only: bool) -> Result<Database, Error> {
        let database = self.database_of(connections, read_only).await?;
        self.tables.check_outbox(&database).await?;
        Ok(database)
    }
}

/// An age the server reported in seconds, shown as `idem keys` shows ages (a negative or
/// non-finite value, which a skewed clock could give, shows as 0s).
fn seconds(value: f64) -> String {
    age_text(Duration::try_from_secs_f64(value).unwrap_or_default())
}

fn row_json(row: &InboxRow) -> Value {
    json!({
        "id": row.id,
        "consumer": row.consumer,
        "key": row.key,
        "state": row.state.as_str(),
        "attempts": row.attempts,
        "last_error": row.last_error,
        "age_seconds": row.age_seconds,
        "payload_bytes": row.payload_bytes,
    })
}

/// `idem inbox list`.
///
/// # Errors
///
/// [`Error::Boxes`] when the database or the tables are not there.
pub async fn inbox_list(
    at: &Location,
    state: Option<InboxState>,
    consumer: Option<&str>,
    limit: i64,
    json_out: bool,
) -> Result<String, Error> {
    let pool = at.checked(true).await?;
    let rows = idempotency_outbox::inbox_list(&pool, &at.tables, state, consumer, limit).await?;
    if json_out {
        return Ok(Value::Array(rows.iter().map(row_json).collect()).to_string() + "\n");
    }
    let lines: Vec<Vec<String>> = rows
        .iter()
        .map(|row| {
            vec![
                row.id.to_string(),
                row.consumer.clone(),
                row.key.clone(),
                row.state.to_string(),
                row.attempts.to_string(),
                seconds(row.age_seconds),
                row.last_error.clone().unwrap_or_default(),
            ]
        })
        .collect();
    Ok(table(
        &["ID", "CONSUMER", "KEY", "STATE", "ATTEMPTS", "AGE", "LAST ERROR"],
        &lines,
    ))
}

/// `idem inbox show`.
///
/// # Errors
///
/// [`Error::Boxes`]; also when there is no such row.
pub async fn inbox_show(at: &Location, consumer: &str, key: &str, json_out: bool) -> Result<String, Error> {
    let pool = at.checked(true).await?;
    let row = idempotency_outbox::inbox_show(&pool, &at.tables, consumer, key)
        .await?
        .ok_or_else(|| Error::Boxes(format!("no inbox row for consumer {consumer:?} and key {key:?}")))?;
    let payload = row.payload.clone().unwrap_or_default();
    let text = String::from_utf8_lossy(&payload).into_owned();
    let headers: Vec<(String, String)> = row
        .headers
        .iter()
        .map(|(name, value)| (name.clone(), String::from_utf8_lossy(value).into_owned()))
        .collect();
    if json_out {
        let mut value = row_json(&row);
        value["payload"] = Value::String(text);
        value["headers"] = headers.iter().map(|(name, value)| json!([name, value])).collect();
        return Ok(value.to_string() + "\n");
    }
    let mut lines = vec![
        vec!["id".into(), row.id.to_string()],
        vec!["consumer".into(), row.consumer.clone()],
        vec!["key".into(), row.key.clone()],
        vec!["state".into(), row.state.to_string()],
        vec!["attempts".into(), row.attempts.to_string()],
        vec!["age".into(), seconds(row.age_seconds)],
        vec!["last error".into(), row.last_error.unwrap_or_default()],
    ];
    lines.extend(
        headers
            .into_iter()
            .map(|(name, value)| vec![format!("header {name}"), value]),
    );
    lines.push(vec!["payload".into(), text]);
    Ok(table(&["", ""], &lines))
}

/// `idem inbox replay`: dead rows back to pending.
///
/// # Errors
///
/// [`Error::Boxes`].
pub async fn inbox_replay(
    at: &Location,
    consumer: Option<&str>,
    key: Option<&str>,
    json_out: bool,
) -> Result<String, Error> {
    let pool = at.checked(false).await?;
    let replayed = idempotency_outbox::inbox_replay(&pool, &at.tables, consumer, key).await?;
    Ok(if json_out {
        json!({ "replayed": replayed }).to_string() + "\n"
    } else {
        format!("{replayed} dead message(s) back to pending\n")
    })
}

/// `idem inbox purge`.
///
/// # Errors
///
/// [`Error::Boxes`], also for `--state pending`.
pub async fn inbox_purge(
    at: &Location,
    state: InboxState,
    consumer: Option<&str>,
    older_than: Duration,
    json_out: bool,
) -> Result<String, Error> {
    let pool = at.checked(false).await?;
    let purged = idempotency_outbox::inbox_purge(&pool, &at.tables, state, consumer, older_than).await?;
    Ok(if json_out {
        json!({ "purged": purged }).to_string() + "\n"
    } else {
        format!("{purged} {state} row(s) purged\n")
    })
}

/// `idem inbox stats`.
///
/// # Errors
///
/// [`Error::Boxes`].
pub async fn inbox_stats(at: &Location, consumer: Option<&str>, json_out: bool) -> Result<String, Error> {
    let pool = at.checked(true).await?;
    let stats = idempotency_outbox::inbox_stats(&pool, &at.tables, consumer).await?;
    if json_out {
        return Ok(json!({
            "pending": stats.pending,
            "processed": stats.processed,
            "dead": stats.dead,
            "oldest_pending_seconds": stats.oldest_pending_seconds,
        })
        .to_string()
            + "\n");
    }
    Ok(table(
        &["PENDING", "PROCESSED", "DEAD", "OLDEST PENDING"],
        &[vec![
            stats.pending.to_string(),
            stats.processed.to_string(),
            stats.dead.to_string(),
            stats
                .oldest_pending_seconds
                .map(seconds)
                .unwrap_or_else(|| "-".into()),
        ]],
    ))
}

/// `idem outbox list`.
///
/// # Errors
///
/// [`Error::Boxes`].
pub async fn outbox_list(at: &Location, all: bool, limit: i64, json_out: bool) -> Result<String, Error> {
    let pool = at.outbox(2, true).await?;
    let rows = idempotency_outbox::outbox_list(&pool, &at.tables, all, limit).await?;
    if json_out {
        let rows: Vec<Value> = rows
            .iter()
            .map(|row| {
                json!({
                    "id": row.id,
                    "ordering_key": row.ordering_key,
                    "destination": row.destination,
                    "key": row.key,
                    "sent": row.sent,
                    "dead": row.dead,
                    "attempts": row.attempts,
                    "last_error": row.last_error,
                    "age_seconds": row.age_seconds,
                })
            })
            .collect();
        return Ok(Value::Array(rows).to_string() + "\n");
    }
    let lines: Vec<Vec<String>> = rows
        .iter()
        .map(|row| {
            vec![
                row.id.to_string(),
                row.ordering_key.clone(),
                row.destination.clone(),
                if row.sent {
                    "sent"
                } else if row.dead {
                    "dead"
                } else {
                    "pending"
                }
                .into(),
                row.attempts.to_string(),
                seconds(row.age_seconds),
                row.last_error.clone().unwrap_or_default(),
            ]
        })
        .collect();
    Ok(table(
        &[
            "ID",
            "ORDERING KEY",
            "DESTINATION",
            "STATE",
            "ATTEMPTS",
            "AGE",
            "LAST ERROR",
        ],
        &lines,
    ))
}

/// `idem outbox stats`.
///
/// # Errors
///
/// [`Error::Boxes`].
pub async fn outbox_stats(at: &Location, json_out: bool) -> Result<String, Error> {
    let pool = at.outbox(2, true).await?;
    let stats = idempotency_outbox::outbox_stats(&pool, &at.tables).await?;
    if json_out {
        return Ok(json!({
            "pending": stats.pending,
            "dead": stats.dead,
            "sent": stats.sent,
            "oldest_pending_seconds": stats.oldest_pending_seconds,
        })
        .to_string()
            + "\n");
    }
    Ok(table(
        &["PENDING", "DEAD", "SENT", "OLDEST PENDING"],
        &[vec![
            stats.pending.to_string(),
            stats.dead.to_string(),
            stats.sent.to_string(),
            stats
                .oldest_pending_seconds
                .map(seconds)
                .unwrap_or_else(|| "-".into()),
        ]],
    ))
}

/// `idem outbox replay`: dead rows (all, or `id`) back to pending.
///
/// # Errors
///
/// [`Error::Boxes`].
pub async fn outbox_replay(at: &Location, id: Option<i64>, json_out: bool) -> Result<String, Error> {
    let pool = at.outbox(2, false).await?;
    let replayed = idempotency_outbox::outbox_replay(&pool, &at.tables, id).await?;
    Ok(if json_out {
        json!({ "replayed": replayed }).to_string() + "\n"
    } else {
        format!("{replayed} dead row(s) back to pending\n")
    })
}

/// `idem outbox purge`: dead rows parked at least `older_than` ago.
///
/// # Errors
///
/// [`Error::Boxes`].
pub async fn outbox_purge(at: &Location, older_than: Duration, json_out: bool) -> Result<String, Error> {
    let pool = at.outbox(2, false).await?;
    let purged = idempotency_outbox::outbox_purge_dead(&pool, &at.tables, older_than).await?;
    Ok(if json_out {
        json!({ "purged": purged }).to_string() + "\n"
    } else {
        format!("{purged} dead row(s) purged\n")
    })
}

/// `idem migrate --inbox-outbox`: creates the tables.
///
/// # Errors
///
/// [`Error::Boxes`].
pub async fn migrate(at: &Location) -> Result<(), Error> {
    let pool = at.pool(false).await?;
    at.tables.migrate(&pool).await.map_err(Error::from)
}

#[cfg(test)]
mod tests {
    use super::seconds;

    #[test]
    fn ages_show_in_whole_seconds_and_odd_values_as_zero() {
        assert_eq!(seconds(12.345), "12s");
        assert_eq!(seconds(7200.5), "2h");
        assert_eq!(seconds(0.2), "0s");
        for odd in [-1.0, f64::NAN, f64::INFINITY, f64::MAX] {
            assert_eq!(seconds(odd), "0s", "{odd}");
        }
    }
}
