//! `idem keys list|get|stats|purge|release|forget|complete`, `idem inflight` and `idem migrate`:
//! their arguments and their runs. Human tables by default, JSON with `--json`.

use std::fmt::Write as _;
use std::time::Duration;

use idempotency::{
    Access, DynStore, Key, ListFilter, RecordState, RecordSummary, Scope, ScopeSecret, StateFilter, Stats,
    SummaryState, Timestamp, Token,
};
use serde_json::{Value, json};

use super::key_actions::KeyAction;
use super::{Confirm, age, key, open, rfc3339, scope, table};
use crate::error::Error;
use crate::units::format_duration;

/// `idem keys …`: the records of a store.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
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

/// The key a single-key action changes, and its store.
#[derive(Debug, clap::Args)]
pub struct KeyActionArgs {
    #[command(flatten)]
    store: super::StoreArgs,
    /// The key.
    key: String,
    /// The key's scope ("" for the global scope; `idem keys list` shows the gateway's).
    #[arg(long, default_value = "")]
    scope: String,
    /// Change the record without asking (otherwise asked on the terminal).
    #[arg(long, short = 'y')]
    yes: bool,
}

/// `idem keys forget`.
#[derive(Debug, clap::Args)]
pub struct ForgetArgs {
    #[command(flatten)]
    action: KeyActionArgs,
    /// Forget the key even while an attempt runs (its completion is then refused, and a retry
    /// runs beside it).
    #[arg(long)]
    force: bool,
}

/// `idem keys complete`.
#[derive(Debug, clap::Args)]
pub struct CompleteArgs {
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
    #[arg(long, default_value = "24h", value_parser = crate::flags::parse_retention)]
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

/// `idem keys list`.
#[derive(Debug, clap::Args)]
pub struct ListArgs {
    #[command(flatten)]
    store: super::StoreArgs,
    /// Only this scope ("" for the global scope).
    #[arg(long)]
    scope: Option<String>,
    /// Only records in this state.
    #[arg(long, value_enum)]
    state: Option<StateArg>,
    /// Only records whose state began at least this long ago.
    #[arg(long, value_parser = crate::units::parse_duration)]
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

/// `idem keys get`.
#[derive(Debug, clap::Args)]
pub struct GetArgs {
    #[command(flatten)]
    store: super::StoreArgs,
    /// The key.
    key: String,
    /// The key's scope ("" for the global scope). The gateway's scopes are hashes of the scope
    /// header; `idem keys list` shows them.
    #[arg(long, default_value = "")]
    scope: String,
}

/// `idem keys stats`.
#[derive(Debug, clap::Args)]
pub struct StatsArgs {
    #[command(flatten)]
    store: super::StoreArgs,
    /// Only this scope.
    #[arg(long)]
    scope: Option<String>,
}

/// `idem keys purge`.
#[derive(Debug, clap::Args)]
pub struct PurgeArgs {
    #[command(flatten)]
    store: super::StoreArgs,
    /// Records deleted per batch.
    #[arg(long, default_value_t = 1000)]
    batch: u64,
}

/// `idem inflight`.
#[derive(Debug, clap::Args)]
pub struct InflightArgs {
    #[command(flatten)]
    store: super::StoreArgs,
    /// Only requests in flight for at least this long.
    #[arg(long, default_value = "5m", value_parser = crate::units::parse_duration)]
    older_than: Duration,
    /// Only this scope.
    #[arg(long)]
    scope: Option<String>,
    /// At most this many records.
    #[arg(long, default_value_t = 100)]
    limit: usize,
}

/// Runs `idem keys …`; what it prints.
///
/// # Errors
///
/// The store's; a key or scope that does not parse; what the single-key actions refuse.
pub async fn run(action: Command) -> Result<String, Error> {
    match action {
        Command::List(args) => {
            let filter = list_filter(&args)?;
            list(
                &open(&args.store, Access::ReadOnly).await?,
                &filter,
                args.store.json,
            )
            .await
        }
        Command::Get(args) => {
            let key = key(&args.key)?;
            let scope = scope(&args.scope)?;
            get(
                &open(&args.store, Access::ReadOnly).await?,
                &scope,
                &key,
                args.store.json,
            )
            .await
        }
        Command::Stats(args) => {
            let scope = args.scope.as_deref().map(scope).transpose()?;
            stats(
                &open(&args.store, Access::ReadOnly).await?,
                scope.as_ref(),
                args.store.json,
            )
            .await
        }
        Command::Release(args) => key_action(&args, KeyAction::Release).await,
        Command::Forget(args) => key_action(&args.action, KeyAction::Forget { force: args.force }).await,
        Command::Complete(args) => {
            let outcome = stored_response(&args)?;
            let action = KeyAction::Complete {
                outcome,
                retention: args.retention,
                force: args.force,
            };
            key_action(&args.action, action).await
        }
        Command::Purge(args) => {
            purge(
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
    super::key_actions::act(
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

/// Runs `idem inflight`: the requests in flight for longer than `--older-than`.
///
/// # Errors
///
/// The store's; a scope that does not parse.
pub async fn inflight_command(args: InflightArgs) -> Result<String, Error> {
    let scope = args.scope.as_deref().map(scope).transpose()?;
    inflight(
        &open(&args.store, Access::ReadOnly).await?,
        scope,
        args.older_than,
        args.limit.max(1),
        args.store.json,
    )
    .await
}

/// Runs `idem migrate`: the store's schema, created or upgraded.
///
/// # Errors
///
/// The store's.
pub async fn migrate(args: &super::StoreArgs) -> Result<String, Error> {
    let _store = open(args, Access::Create).await?;
    let url = idempotency::redact_url(&args.store);
    Ok(if args.json {
        serde_json::json!({ "store": url, "schema": "ready" }).to_string()
    } else {
        format!("{url}: schema ready\n")
    })
}

fn summary_json(record: &RecordSummary, now: Timestamp) -> Value {
    let mut value = json!({
        "scope": record.scope.as_str(),
        "key": record.key.as_str(),
        "attempt": record.attempt,
        "created_at": rfc3339(record.created_at),
        "expires_at": rfc3339(record.expires_at),
    });
    match &record.state {
        SummaryState::InFlight {
            acquired_at,
            lease_until,
        } => {
            value["state"] = json!("in_flight");
            value["acquired_at"] = json!(rfc3339(*acquired_at));
            value["lease_until"] = json!(rfc3339(*lease_until));
            value["lease_expired"] = json!(lease_expired(&record.state, now));
        }
        SummaryState::Completed {
            completed_at,
            outcome_len,
        } => {
            value["state"] = json!("completed");
            value["completed_at"] = json!(rfc3339(*completed_at));
            value["outcome_bytes"] = json!(outcome_len);
        }
    }
    value
}

fn summary_row(record: &RecordSummary, now: Timestamp) -> Vec<String> {
    let (state, since, note) = match &record.state {
        SummaryState::InFlight {
            acquired_at,
            lease_until,
        } => (
            "in-flight",
            *acquired_at,
            if lease_expired(&record.state, now) {
                "lease expired".to_owned()
            } else {
                format!("lease until {}", rfc3339(*lease_until))
            },
        ),
        SummaryState::Completed {
            completed_at,
            outcome_len,
        } => ("completed", *completed_at, format!("{outcome_len} bytes")),
    };
    vec![
        if record.scope.as_str().is_empty() {
            "-".into()
        } else {
            record.scope.redacted().to_string()
        },
        record.key.as_str().to_owned(),
        state.to_owned(),
        record.attempt.to_string(),
        age(since, now),
        note,
    ]
}

/// Records as a table, a row each.
fn records_table(records: &[RecordSummary], now: Timestamp) -> String {
    let rows: Vec<Vec<String>> = records.iter().map(|record| summary_row(record, now)).collect();
    table(&["SCOPE", "KEY", "STATE", "ATTEMPT", "AGE", "NOTE"], &rows)
}

/// Whether a record is in flight with its lease run out at `now`, the store's time: a crashed
/// or hung attempt.
fn lease_expired(state: &SummaryState, now: Timestamp) -> bool {
    matches!(state, SummaryState::InFlight { lease_until, .. } if *lease_until <= now)
}

/// `idem keys list`: one page of records.
///
/// # Errors
///
/// The store's error.
pub async fn list(store: &DynStore, filter: &ListFilter, json_out: bool) -> Result<String, Error> {
    let records = store.list(filter).await?;
    let now = store.now().await?;
    if json_out {
        let next = records
            .last()
            .filter(|_| records.len() == filter.limit)
            .map(|last| json!({ "scope": last.scope.as_str(), "key": last.key.as_str() }));
        return Ok(
            json!({ "records": records.iter().map(|record| summary_json(record, now)).collect::<Vec<_>>(), "next_after": next })
                .to_string(),
        );
    }
    if records.is_empty() {
        return Ok("no records\n".into());
    }
    let mut out = records_table(&records, now);
    if records.len() == filter.limit {
        let last = &records[records.len() - 1];
        let _ = writeln!(
            out,
            "(first {} shown; continue with --after-scope '{}' --after-key '{}')",
            filter.limit,
            last.scope.as_str(),
            last.key.as_str()
        );
    }
    Ok(out)
}

/// How a stored outcome reads: an HTTP response the gateway stored, or bytes.
fn outcome_json(bytes: &[u8]) -> Value {
    match idempotency_http::StoredOutcome::decode(bytes) {
        Some(idempotency_http::StoredOutcome::Response {
            status,
            headers,
            body,
        }) => json!({
            "kind": "http_response",
            "status": status.as_u16(),
            "headers": headers
                .iter()
                .map(|(name, value)| json!([name.as_str(), String::from_utf8_lossy(value.as_bytes())]))
                .collect::<Vec<_>>(),
            "body": String::from_utf8_lossy(&body),
        }),
        Some(idempotency_http::StoredOutcome::NotReplayable) => json!({ "kind": "http_not_replayable" }),
        None => json!({ "kind": "bytes", "text": String::from_utf8_lossy(bytes), "len": bytes.len() }),
    }
}

/// The record of `scope` and `key` as `idem keys get --json` prints it: its summary, its
/// fingerprint, and its outcome decoded when the gateway stored it (`held_by` while in flight).
///
/// # Errors
///
/// The store's error, or [`Error::NoRecord`].
pub async fn record_json(store: &DynStore, scope: &Scope, key: &Key) -> Result<Value, Error> {
    let Some(record) = store.get(scope, key).await? else {
        return Err(Error::NoRecord {
            key: key.as_str().into(),
            scope: scope.as_str().into(),
        });
    };
    let mut value = summary_json(&record.summary(), store.now().await?);
    value["fingerprint"] = json!(record.fingerprint.to_string());
    match &record.state {
        // The gateway's scope secret: an operator sees that it is there, never what it is.
        RecordState::Completed { outcome, .. } if (scope.clone(), key.clone()) == ScopeSecret::record() => {
            value["outcome"] = json!({ "kind": "secret", "text": "(the scope secret, not shown)", "len": outcome.as_bytes().len() });
        }
        RecordState::Completed { outcome, .. } => value["outcome"] = outcome_json(outcome.as_bytes()),
        // A released record is held by no attempt: the last one gave the key up, and the next
        // request runs again as attempt + 1.
        RecordState::InFlight { token, .. } => {
            value["held_by"] = json!(if *token == Token::NONE {
                "nobody (released)"
            } else {
                "an attempt"
            });
        }
    }
    Ok(value)
}

/// The fields of [`record_json`] that `idem keys get` and the dashboard show, in their order
/// (the outcome aside).
pub(crate) const RECORD_FIELDS: [&str; 12] = [
    "scope",
    "key",
    "state",
    "attempt",
    "held_by",
    "fingerprint",
    "created_at",
    "acquired_at",
    "lease_until",
    "lease_expired",
    "completed_at",
    "expires_at",
];

/// `idem keys get`: one record, with its outcome decoded when the gateway stored it.
///
/// # Errors
///
/// The store's error, or no such record.
pub async fn get(store: &DynStore, scope: &Scope, key: &Key, json_out: bool) -> Result<String, Error> {
    let value = record_json(store, scope, key).await?;
    if json_out {
        return Ok(value.to_string());
    }
    let mut out = String::new();
    for field in RECORD_FIELDS {
        if let Some(v) = value.get(field) {
            let text = v.as_str().map_or_else(|| v.to_string(), str::to_owned);
            let _ = writeln!(out, "{field:<14}{text}");
        }
    }
    if let Some(outcome) = value.get("outcome") {
        match outcome["kind"].as_str() {
            Some("http_response") => {
                let _ = writeln!(out, "{:<14}HTTP {}", "outcome", outcome["status"]);
                for header in outcome["headers"].as_array().into_iter().flatten() {
                    let _ = writeln!(
                        out,
                        "{:<14}{}: {}",
                        "",
                        header[0].as_str().unwrap_or(""),
                        header[1].as_str().unwrap_or("")
                    );
                }
                let _ = writeln!(out, "{:<14}{}", "", outcome["body"].as_str().unwrap_or(""));
            }
            Some("http_not_replayable") => {
                let _ = writeln!(
                    out,
                    "{:<14}an HTTP response too large to store (retries get 409)",
                    "outcome"
                );
            }
            _ => {
                let _ = writeln!(
                    out,
                    "{:<14}{} bytes: {}",
                    "outcome",
                    outcome["len"],
                    outcome["text"].as_str().unwrap_or("")
                );
            }
        }
    }
    Ok(out)
}

fn stats_json(stats: &Stats) -> Value {
    json!({
        "in_flight": stats.in_flight,
        "stale_leases": stats.stale_leases,
        "completed": stats.completed,
        "expired": stats.expired,
        "oldest_in_flight_ms": stats.oldest_in_flight.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
    })
}

/// `idem keys stats`.
///
/// # Errors
///
/// The store's error.
pub async fn stats(store: &DynStore, scope: Option<&Scope>, json_out: bool) -> Result<String, Error> {
    let stats = store.stats(scope).await?;
    if json_out {
        return Ok(stats_json(&stats).to_string());
    }
    let rows = vec![
        vec!["in flight".to_owned(), stats.in_flight.to_string()],
        vec![
            "  of which stale (lease expired)".to_owned(),
            stats.stale_leases.to_string(),
        ],
        vec!["completed".to_owned(), stats.completed.to_string()],
        vec!["expired, not yet purged".to_owned(), stats.expired.to_string()],
        vec![
            "oldest in flight".to_owned(),
            stats
                .oldest_in_flight
                .map_or_else(|| "-".to_owned(), format_duration),
        ],
    ];
    Ok(table(&["RECORDS", "COUNT"], &rows))
}

/// `idem keys purge`: deletes expired records, `batch` at a time, until none are left.
///
/// # Errors
///
/// The store's error.
pub async fn purge(store: &DynStore, batch: u64, json_out: bool) -> Result<String, Error> {
    let mut total = 0_u64;
    loop {
        let deleted = store.purge_expired(batch).await?;
        total += deleted;
        if deleted < batch {
            break;
        }
    }
    Ok(if json_out {
        json!({ "purged": total }).to_string()
    } else {
        format!("purged {total} expired records\n")
    })
}

/// `idem inflight --older-than D`: the stale-lease report.
///
/// # Errors
///
/// The store's error.
pub async fn inflight(
    store: &DynStore,
    scope: Option<Scope>,
    older_than: Duration,
    limit: usize,
    json_out: bool,
) -> Result<String, Error> {
    let mut filter = ListFilter::default()
        .state(StateFilter::InFlight)
        .older_than(older_than)
        .limit(limit);
    if let Some(scope) = scope {
        filter = filter.scope(scope);
    }
    let records = store.list(&filter).await?;
    let now = store.now().await?;
    let stale = records.iter().filter(|r| lease_expired(&r.state, now)).count();
    if json_out {
        return Ok(json!({
            "older_than_ms": u64::try_from(older_than.as_millis()).unwrap_or(u64::MAX),
            "records": records.iter().map(|record| summary_json(record, now)).collect::<Vec<_>>(),
            "stale": stale,
        })
        .to_string());
    }
    if records.is_empty() {
        return Ok(format!(
            "no requests in flight for longer than {}\n",
            format_duration(older_than)
        ));
    }
    let mut out = records_table(&records, now);
    let _ = writeln!(
        out,
        "{} in flight for longer than {}, {stale} with an expired lease: their workers crashed or hung, \
         and the next retry of each takes over (attempt + 1).",
        records.len(),
        format_duration(older_than)
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::SystemTime;

    use idempotency::{BeginRequest, Claim, Fingerprint, ManualClock, MemoryStore, Store};

    use super::*;

    /// "Stale" is decided by the store's clock. Here the store's clock is an hour behind the
    /// host's: a lease that the store says runs for another 50 minutes is not stale, although
    /// the host's clock is past its end.
    #[tokio::test]
    async fn stale_leases_are_judged_by_the_stores_clock() {
        let behind = Timestamp::from_system_time(SystemTime::now() - Duration::from_secs(3600));
        let clock = Arc::new(ManualClock::at(behind));
        let store: DynStore = Arc::new(MemoryStore::with_clock(clock.clone()));
        let request = BeginRequest::new(
            Scope::global(),
            Key::new("k").unwrap(),
            Fingerprint::of_bytes(b""),
        )
        .lease(Duration::from_secs(600));
        assert!(matches!(store.begin(&request).await.unwrap(), Claim::Acquired(_)));
        clock.advance(Duration::from_secs(60));
        let report: Value =
            serde_json::from_str(&inflight(&store, None, Duration::ZERO, 10, true).await.unwrap()).unwrap();
        assert_eq!(report["stale"], 0, "{report}");
        assert_eq!(report["records"][0]["lease_expired"], false, "{report}");
        // Past the lease by the store's clock: stale.
        clock.advance(Duration::from_secs(600));
        let report: Value =
            serde_json::from_str(&inflight(&store, None, Duration::ZERO, 10, true).await.unwrap()).unwrap();
        assert_eq!(report["stale"], 1, "{report}");
    }
}
