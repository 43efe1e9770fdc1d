//! The operations commands: `keys list|get|stats|purge`, `inflight`, `migrate`. Human tables by
//! default, JSON with `--json`.

use std::fmt::Write as _;
use std::time::{Duration, UNIX_EPOCH};

use idempotency::{
    DynStore, Key, ListFilter, RecordState, RecordSummary, Scope, ScopeSecret, StateFilter, Stats,
    SummaryState, Timestamp, Token,
};
use serde_json::{Value, json};

use crate::error::Error;
use crate::units::format_duration;

/// A timestamp as RFC 3339 UTC, to the millisecond. Clamped to years 1970 to 9999, which the
/// format (and `humantime`, which writes it) can show: a stored time outside them is damaged.
#[must_use]
pub fn rfc3339(time: Timestamp) -> String {
    // 9999-12-31T23:59:59.999Z
    let last = UNIX_EPOCH + Duration::from_millis(253_402_300_799_999);
    humantime::format_rfc3339_millis(time.to_system_time().clamp(UNIX_EPOCH, last)).to_string()
}

fn age(since: Timestamp, now: Timestamp) -> String {
    age_text(now.since(since))
}

/// An age as the operations commands show it: whole seconds, in the largest exact unit.
pub(crate) fn age_text(age: Duration) -> String {
    format_duration(Duration::from_secs(age.as_secs()))
}

/// Renders rows as a left-aligned text table without borders, with a header unless every
/// header cell is empty.
#[must_use]
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut table = comfy_table::Table::new();
    table
        .load_preset(comfy_table::presets::NOTHING)
        .set_content_arrangement(comfy_table::ContentArrangement::Disabled);
    if header.iter().any(|h| !h.is_empty()) {
        table.set_header(header.iter().copied());
    }
    for row in rows {
        table.add_row(row.iter().map(String::as_str));
    }
    let mut out = String::new();
    for line in table.lines() {
        // The preset pads every cell with a space on each side; the first and last are noise.
        out.push_str(line.strip_prefix(' ').unwrap_or(&line).trim_end());
        out.push('\n');
    }
    out
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
