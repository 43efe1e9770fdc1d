//! The operations commands, each in its module with its arguments and its run: [`keys`] (`idem
//! keys …`, `idem inflight`, `idem migrate`), [`key_actions`] (the single-key changes after an
//! incident), [`boxes`] (`idem inbox …`, `idem outbox …`) and [`dlq`] (`idem dlq …`). This
//! module holds what they share: the store they open, keys and scopes from the command line,
//! tables and ages as they print them, and the confirmation a change asks for.

use std::io::{BufRead as _, IsTerminal as _, Write as _};
use std::time::{Duration, UNIX_EPOCH};

use idempotency::{Access, DynStore, Key, Scope, Timestamp};

use crate::error::Error;
use crate::units::format_duration;

pub mod boxes;
pub mod dlq;
pub mod key_actions;
pub mod keys;

/// A timestamp as RFC 3339 UTC, to the millisecond. Clamped to years 1970 to 9999, which the
/// format (and `humantime`, which writes it) can show: a stored time outside them is damaged.
#[must_use]
pub fn rfc3339(time: Timestamp) -> String {
    // 9999-12-31T23:59:59.999Z
    let last = UNIX_EPOCH + Duration::from_millis(253_402_300_799_999);
    humantime::format_rfc3339_millis(time.to_system_time().clamp(UNIX_EPOCH, last)).to_string()
}

/// How long ago `since` was at `now`, as [`age_text`] shows it.
pub(crate) fn age(since: Timestamp, now: Timestamp) -> String {
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

/// The store an operations command works on.
#[derive(Debug, clap::Args)]
pub struct StoreArgs {
    /// The store: sqlite://PATH, postgres://..., mysql://..., redis://..., redis-cluster://h:p,h:p, memory://
    #[arg(long, env = "IDEM_STORE", default_value = "sqlite://idem.db")]
    pub store: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `text` as a scope, or the usage error that names it.
///
/// # Errors
///
/// [`Error::Invalid`] when `text` is not a scope.
pub fn scope(text: &str) -> Result<Scope, Error> {
    Scope::new(text).map_err(|source| Error::Invalid {
        what: "scope",
        text: text.into(),
        source,
    })
}

/// `text` as a key, or the usage error that names it.
///
/// # Errors
///
/// [`Error::Invalid`] when `text` is not a key.
pub fn key(text: &str) -> Result<Key, Error> {
    Key::new(text).map_err(|source| Error::Invalid {
        what: "key",
        text: text.into(),
        source,
    })
}

/// The store of an operations command, opened no further than `access` allows: only `idem
/// migrate` creates anything.
///
/// # Errors
///
/// The store's, with its URL redacted.
pub async fn open(args: &StoreArgs, access: Access) -> Result<DynStore, Error> {
    idempotency::open_with(&args.store, access)
        .await
        .map_err(|e| Error::open(&args.store, e))
}

/// How the action is confirmed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confirm {
    /// `--yes`: no question.
    Yes,
    /// Ask on the terminal; refuse when standard input is not one.
    Ask,
}

/// Asks `question` on the terminal unless `confirm` is [`Confirm::Yes`]; without a terminal,
/// [`Error::Unconfirmed`].
pub(crate) fn confirmed(confirm: Confirm, question: &str) -> Result<(), Error> {
    if confirm == Confirm::Yes {
        return Ok(());
    }
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Err(Error::Unconfirmed(format!(
            "{question}\nstandard input is not a terminal: pass --yes to confirm"
        )));
    }
    let mut stderr = std::io::stderr();
    let _ = write!(stderr, "{question} [y/N] ");
    let _ = stderr.flush();
    let mut answer = String::new();
    stdin
        .lock()
        .read_line(&mut answer)
        .map_err(|e| Error::Unconfirmed(format!("no answer: {e}")))?;
    if matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes") {
        Ok(())
    } else {
        Err(Error::Unconfirmed("not confirmed: nothing was changed".into()))
    }
}
