//! `idem dlq`: the dead letters `idem consume` (and the library's workers) wrote, on every
//! broker: listed by reason, shown, replayed to their source after a fix, purged.
//!
//! `--from` is the consumer's own source URL: the dead-letter destination is found as the
//! consumer found it (`<queue>.dead`, the `dead_letter` subject or topic, `dead_letter_url`).
//! Each broker implements the kit's
//! `DeadLetterQueue` (`idempotency_consumer::dead_letters`); what a listing
//! changes on each is in its docs and in `docs/CONSUMERS.md` (nothing is taken; RabbitMQ and SQS
//! see the messages received once more).

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use idempotency_consumer::dead_letters::{DeadLetter, DeadLetterQueue, Selection, Settle};

use super::{Confirm, age_text};
use crate::error::Error;

/// How much of a payload `show` prints.
const PREVIEW: usize = 200;

/// Where the dead letters are: the consumer's own source URL.
#[derive(Debug, clap::Args)]
pub struct DlqFrom {
    /// The source `idem consume --from` consumes (amqp://…?queue=…, nats://…, kafka://…,
    /// sqs://…): its dead-letter queue, subject or topic is found as the consumer writes it.
    #[arg(long, env = "IDEM_FROM")]
    from: String,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Which dead letters a command takes.
#[derive(Debug, clap::Args)]
pub struct DlqFilter {
    /// Only those whose reason contains this text (case-insensitive).
    #[arg(long)]
    reason: Option<String>,
    /// Only the one(s) with this Idempotency-Key.
    #[arg(long)]
    key: Option<String>,
}

/// `idem dlq …`.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Count the dead letters by reason, with the oldest one's age; takes nothing.
    List {
        /// The consumer's source.
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
        /// The consumer's source.
        #[command(flatten)]
        from: DlqFrom,
        /// Which dead letters.
        #[command(flatten)]
        filter: DlqFilter,
        /// At most this many.
        #[arg(long, default_value_t = 20)]
        limit: usize,
    },
    /// Publish dead letters back to their source with their key and headers, then remove them:
    /// one whose key completed meanwhile is acked as a duplicate, one that failed runs again.
    Replay {
        /// The consumer's source.
        #[command(flatten)]
        from: DlqFrom,
        /// Which dead letters.
        #[command(flatten)]
        filter: DlqFilter,
        /// Only those dead-lettered at least this long ago.
        #[arg(long, value_parser = crate::units::parse_duration)]
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
        /// The consumer's source.
        #[command(flatten)]
        from: DlqFrom,
        /// Which dead letters.
        #[command(flatten)]
        filter: DlqFilter,
        /// Only those dead-lettered at least this long ago (`0s`: all of them).
        #[arg(long, value_parser = crate::units::parse_duration)]
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

/// Runs `idem dlq …`; what it prints.
///
/// # Errors
///
/// The broker's; a source URL that does not parse; a change not confirmed.
pub async fn run(action: Command) -> Result<String, Error> {
    let confirm = |yes: bool| if yes { Confirm::Yes } else { Confirm::Ask };
    match action {
        Command::List { from, reason, limit } => {
            list(&from.from, reason.as_deref(), limit.max(1), from.json).await
        }
        Command::Show { from, filter, limit } => show(&from.from, &filter.selection(limit), from.json).await,
        Command::Replay {
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
            settle(&from.from, &selection, Settle::Replay, confirm(yes), from.json).await
        }
        Command::Purge {
            from,
            filter,
            older_than: age,
            limit,
            yes,
        } => {
            let selection = filter.selection(limit).older_than(age);
            settle(&from.from, &selection, Settle::Purge, confirm(yes), from.json).await
        }
    }
}

/// Opens the dead-letter destination of the source `from`.
async fn open(from: &str) -> Result<Box<dyn DeadLetterQueue>, Error> {
    let shown = idempotency::redact_url(from);
    let failed = |error| Error::DeadLetters {
        from: shown.clone(),
        error,
    };
    let kind = idempotency::sources().kind(from).map_err(failed)?;
    (kind.dead_letters)(from.to_owned()).await.map_err(failed)
}

/// The dead letters of a source, grouped by reason.
#[derive(Debug, Clone)]
pub struct Groups {
    /// The dead-letter destination's name.
    pub name: String,
    /// How many dead letters the groups hold.
    pub total: usize,
    /// (reason, count, the oldest one's age), the largest group first.
    pub reasons: Vec<(String, usize, Duration)>,
}

/// The dead letters of the source `from` (at most `limit` read), grouped by reason; `reason`
/// keeps only the reasons containing it.
///
/// # Errors
///
/// As [`list`].
pub async fn groups(from: &str, reason: Option<&str>, limit: usize) -> Result<Groups, Error> {
    let mut queue = open(from).await?;
    let letters = queue.browse(limit).await.map_err(|error| Error::DeadLetters {
        from: idempotency::redact_url(from),
        error,
    })?;
    let now = SystemTime::now();
    let selection = reason.map_or_else(
        || Selection::all(usize::MAX),
        |r| Selection::all(usize::MAX).reason(r),
    );
    let mut groups: BTreeMap<&str, (usize, Duration)> = BTreeMap::new();
    let mut total = 0;
    for letter in letters.iter().filter(|l| selection.matches(l, now)) {
        let group = groups.entry(letter.reason.as_str()).or_default();
        group.0 += 1;
        group.1 = group.1.max(letter.age(now));
        total += 1;
    }
    let mut reasons: Vec<_> = groups
        .into_iter()
        .map(|(reason, (count, oldest))| (reason.to_owned(), count, oldest))
        .collect();
    reasons.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok(Groups {
        name: queue.name(),
        total,
        reasons,
    })
}

/// `idem dlq list`: the dead letters grouped by reason, with their counts and the oldest one's
/// age; `reason` keeps only the reasons containing it.
///
/// # Errors
///
/// [`Error::DeadLetters`] when the source URL is not valid, the broker cannot be reached, or
/// the destination does not exist.
pub async fn list(from: &str, reason: Option<&str>, limit: usize, json: bool) -> Result<String, Error> {
    let Groups { name, total, reasons } = groups(from, reason, limit).await?;
    if json {
        let reasons: Vec<_> = reasons
            .iter()
            .map(|(reason, count, oldest)| {
                serde_json::json!({ "reason": reason, "count": count, "oldest_seconds": oldest.as_secs() })
            })
            .collect();
        return Ok(
            serde_json::json!({ "dead_letters": name, "total": total, "reasons": reasons }).to_string(),
        );
    }
    let rows: Vec<Vec<String>> = reasons
        .iter()
        .map(|(reason, count, oldest)| vec![count.to_string(), age_text(*oldest), reason.clone()])
        .collect();
    let mut out = format!("{name}: {total} dead letters\n");
    if !rows.is_empty() {
        out.push('\n');
        out.push_str(&crate::ops::table(&["COUNT", "OLDEST", "REASON"], &rows));
    }
    Ok(out)
}

/// `idem dlq show`: the dead letters `selection` picks, one by one: where, key, reason,
/// deliveries, when, headers and the start of the payload.
///
/// # Errors
///
/// As [`list`].
pub async fn show(from: &str, selection: &Selection, json: bool) -> Result<String, Error> {
    let mut queue = open(from).await?;
    let letters = queue
        .browse(usize::MAX)
        .await
        .map_err(|error| Error::DeadLetters {
            from: idempotency::redact_url(from),
            error,
        })?;
    let now = SystemTime::now();
    let shown: Vec<&DeadLetter> = letters
        .iter()
        .filter(|l| selection.matches(l, now))
        .take(selection.limit)
        .collect();
    if json {
        let letters: Vec<_> = shown
            .iter()
            .map(|l| {
                serde_json::json!({
                    "id": l.id,
                    "key": l.key,
                    "reason": l.reason,
                    "source": l.source,
                    "deliveries": l.deliveries,
                    "dead_at": l.dead_at.map(httpdate::fmt_http_date),
                    "age_seconds": l.age(now).as_secs(),
                    "headers": l.headers.iter().map(|(n, v)| serde_json::json!([n, v])).collect::<Vec<_>>(),
                    "payload": String::from_utf8_lossy(&l.payload),
                })
            })
            .collect();
        return Ok(serde_json::json!({ "dead_letters": queue.name(), "letters": letters }).to_string());
    }
    let mut out = format!(
        "{}: {} of {} dead letters\n",
        queue.name(),
        shown.len(),
        letters.len()
    );
    for letter in shown {
        let payload = String::from_utf8_lossy(&letter.payload[..letter.payload.len().min(PREVIEW)])
            .escape_debug()
            .to_string();
        out.push_str(&format!(
            "\n#{id}  key {key}\n  reason:     {reason}\n  source:     {source}\n  deliveries: {deliveries}\n  dead:       {at} ({age} ago)\n",
            id = letter.id,
            key = letter.key.as_deref().unwrap_or("(none)"),
            reason = letter.reason,
            source = letter.source.as_deref().unwrap_or("-"),
            deliveries = letter.deliveries.map_or_else(|| "-".to_owned(), |n| n.to_string()),
            at = letter.dead_at.map_or_else(|| "-".to_owned(), httpdate::fmt_http_date),
            age = age_text(letter.age(now)),
        ));
        for (name, value) in &letter.headers {
            out.push_str(&format!("  header:     {name}: {value}\n"));
        }
        let more = if letter.payload.len() > PREVIEW {
            " …"
        } else {
            ""
        };
        out.push_str(&format!(
            "  payload:    {payload}{more} ({} bytes)\n",
            letter.payload.len()
        ));
    }
    Ok(out)
}

/// `idem dlq replay` and `idem dlq purge`: settles the dead letters `selection` picks, once
/// confirmed; what was done, as a line or JSON, and one audit line in the log.
///
/// # Errors
///
/// As [`list`]; [`Error::Unconfirmed`] without `--yes` or a `y` on a terminal (nothing is
/// changed then); [`Error::DeadLetters`] when a replay could not be published (what was done
/// before stays done; the message that failed stays a dead letter).
pub async fn settle(
    from: &str,
    selection: &Selection,
    settle: Settle,
    confirm: Confirm,
    json: bool,
) -> Result<String, Error> {
    let failed = |error| Error::DeadLetters {
        from: idempotency::redact_url(from),
        error,
    };
    let mut queue = open(from).await?;
    let (verb, done) = match settle {
        Settle::Replay => ("replay", "replayed"),
        Settle::Purge => ("purge", "purged"),
    };
    // The question says how many will change, which takes reading them first; with `--yes`
    // they are read once, by the settlement itself (on RabbitMQ and SQS each read is a delivery).
    if confirm == Confirm::Ask {
        let now = SystemTime::now();
        let matching = queue
            .browse(usize::MAX)
            .await
            .map_err(failed)?
            .iter()
            .filter(|l| selection.matches(l, now))
            .count()
            .min(selection.limit);
        if matching == 0 {
            return Ok(report(&queue.name(), verb, done, 0, json));
        }
        let question = format!(
            "{verb} {matching} dead letters of {}{}?",
            queue.name(),
            if settle == Settle::Replay {
                " to their source"
            } else {
                " (deleted for good)"
            }
        );
        super::confirmed(confirm, &question)?;
    }
    let settled = queue.settle(selection, settle).await.map_err(failed)?;
    if settled > 0 {
        tracing::warn!(
            target: "idem::audit",
            dead_letters = %queue.name(),
            action = verb,
            count = settled,
            reason = selection.reason.as_deref().unwrap_or("*"),
            "an operator settled dead letters"
        );
    }
    Ok(report(&queue.name(), verb, done, settled, json))
}

/// What a replay or purge did, as a line or JSON.
fn report(queue: &str, verb: &str, done: &str, count: usize, json: bool) -> String {
    if json {
        serde_json::json!({ "dead_letters": queue, "action": verb, "count": count }).to_string()
    } else {
        format!("{queue}: {done} {count} dead letters\n")
    }
}
