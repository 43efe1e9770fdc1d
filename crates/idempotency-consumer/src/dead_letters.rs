//! Dead letters as an operator handles them: read without taking them, then replay the ones a
//! fix made good and purge the rest. Each broker implements [`DeadLetterQueue`] for the
//! dead-letter destination its adapter writes; `idem dlq` runs the same commands on all of them.
//!
//! Every dead letter carries the headers of [`dead_letter_headers`](crate::dead_letter_headers)
//! (reason, source, deliveries, when) besides the original ones, so a [`DeadLetter`] reads the
//! same on every broker. A replay publishes the message to its source with its original headers
//! (the `Idempotency-Key` among them) and only then removes the dead-letter copy: a crash in
//! between leaves both, and the copy replayed twice is recognised by its key and acknowledged
//! as a duplicate once the first completed. Replaying is safe by construction: a replayed
//! message whose key completed is acknowledged without running, one that failed runs again.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime};

pub use bytes::Bytes;

use crate::adapter::AdapterError;
use crate::{
    DEAD_LETTER_AT_HEADER, DEAD_LETTER_DELIVERIES_HEADER, DEAD_LETTER_REASON_HEADER,
    DEAD_LETTER_SOURCE_HEADER, IDEMPOTENCY_KEY_HEADER,
};

/// One dead-lettered message, as read from its dead-letter destination.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Where it is in the destination, as the broker numbers it: its position in the queue
    /// (RabbitMQ), its stream sequence (NATS), `partition:offset` (Kafka), its message id (SQS).
    pub id: String,
    /// Its `Idempotency-Key`, if it has a readable one.
    pub key: Option<String>,
    /// Why it was dead-lettered (`-` when the broker moved it without saying).
    pub reason: String,
    /// Where it was consumed from.
    pub source: Option<String>,
    /// How many times it had been delivered.
    pub deliveries: Option<u32>,
    /// When it was dead-lettered.
    pub dead_at: Option<SystemTime>,
    /// Its headers, the dead-letter ones included, in the broker's order (values as text, lossy).
    pub headers: Vec<(String, String)>,
    /// Its payload.
    pub payload: Bytes,
}

impl DeadLetter {
    /// A dead letter at `id` with `headers` and `payload`: the standard headers read into their
    /// fields (header names compared without case).
    #[must_use]
    pub fn new(id: impl Into<String>, headers: Vec<(String, String)>, payload: Bytes) -> Self {
        let find = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.clone())
        };
        Self {
            id: id.into(),
            key: find(IDEMPOTENCY_KEY_HEADER),
            reason: find(DEAD_LETTER_REASON_HEADER).unwrap_or_else(|| "-".to_owned()),
            source: find(DEAD_LETTER_SOURCE_HEADER),
            deliveries: find(DEAD_LETTER_DELIVERIES_HEADER).and_then(|v| v.parse().ok()),
            dead_at: find(DEAD_LETTER_AT_HEADER).and_then(|v| httpdate::parse_http_date(&v).ok()),
            headers,
            payload,
        }
    }

    /// How long ago it was dead-lettered (zero when it does not say, or says the future).
    #[must_use]
    pub fn age(&self, now: SystemTime) -> Duration {
        self.dead_at
            .and_then(|at| now.duration_since(at).ok())
            .unwrap_or_default()
    }
}

/// Whether `name` is one of the headers a dead-letter copy gains, which a replayed message
/// must not carry back to its source.
#[must_use]
pub fn is_dead_letter_header(name: &str) -> bool {
    [
        DEAD_LETTER_REASON_HEADER,
        DEAD_LETTER_SOURCE_HEADER,
        DEAD_LETTER_DELIVERIES_HEADER,
        DEAD_LETTER_AT_HEADER,
    ]
    .iter()
    .any(|dead| dead.eq_ignore_ascii_case(name))
}

/// Which dead letters a replay or a purge takes.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct Selection {
    /// Only those whose reason contains this text (case-insensitive).
    pub reason: Option<String>,
    /// Only the one(s) with this key.
    pub key: Option<String>,
    /// Only those dead-lettered at least this long ago.
    pub older_than: Option<Duration>,
    /// At most this many.
    pub limit: usize,
}

impl Selection {
    /// Every dead letter, up to `limit`.
    #[must_use]
    pub fn all(limit: usize) -> Self {
        Self {
            limit,
            ..Self::default()
        }
    }

    /// Only those whose reason contains `reason` (case-insensitive).
    #[must_use]
    pub fn reason(mut self, reason: impl Into<String>) -> Self {
        self.reason = Some(reason.into());
        self
    }

    /// Only those with `key`.
    #[must_use]
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Only those dead-lettered at least `age` ago.
    #[must_use]
    pub fn older_than(mut self, age: Duration) -> Self {
        self.older_than = Some(age);
        self
    }

    /// Whether `letter` is selected (the limit aside), at `now`.
    #[must_use]
    pub fn matches(&self, letter: &DeadLetter, now: SystemTime) -> bool {
        self.reason
            .as_ref()
            .is_none_or(|reason| letter.reason.to_lowercase().contains(&reason.to_lowercase()))
            && self
                .key
                .as_ref()
                .is_none_or(|key| letter.key.as_ref() == Some(key))
            && self
                .older_than
                .is_none_or(|age| letter.dead_at.is_some() && letter.age(now) >= age)
    }
}

/// What happens to the selected dead letters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// Published to their source with their original headers, then removed.
    Replay,
    /// Removed.
    Purge,
}

/// The future a [`DeadLetterQueue`] method returns.
pub type DlqFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, AdapterError>> + Send + 'a>>;

/// A broker's dead-letter destination for one source, as `idem dlq` handles it.
pub trait DeadLetterQueue: Send {
    /// The destination's name (the queue, subject, topic or queue URL), for messages.
    fn name(&self) -> String;

    /// Up to `limit` dead letters, oldest first, without taking them: the destination holds the
    /// same messages afterwards, in the same order where the broker keeps one.
    fn browse(&mut self, limit: usize) -> DlqFuture<'_, Vec<DeadLetter>>;

    /// Replays or purges the dead letters `selection` picks; the others stay. Returns how many
    /// were settled.
    fn settle<'a>(&'a mut self, selection: &'a Selection, settle: Settle) -> DlqFuture<'a, usize>;
}

/// The future [`SourceKind::dead_letters`](crate::source::SourceKind::dead_letters) returns.
pub type OpenFuture = Pin<Box<dyn Future<Output = Result<Box<dyn DeadLetterQueue>, AdapterError>> + Send>>;

#[cfg(test)]
mod tests {
    use super::*;

    fn letter(reason: &str, key: &str, age: u64) -> DeadLetter {
        let at = SystemTime::now() - Duration::from_secs(age);
        DeadLetter::new(
            "1",
            vec![
                (IDEMPOTENCY_KEY_HEADER.to_owned(), key.to_owned()),
                (DEAD_LETTER_REASON_HEADER.to_owned(), reason.to_owned()),
                ("idempotency-dead-deliveries".to_owned(), "5".to_owned()),
                (DEAD_LETTER_AT_HEADER.to_owned(), httpdate::fmt_http_date(at)),
            ],
            Bytes::from_static(b"{}"),
        )
    }

    #[test]
    fn a_dead_letter_reads_its_standard_headers() {
        let dead = letter("the handler refused the message: 422", "pay-1", 120);
        assert_eq!(dead.key.as_deref(), Some("pay-1"));
        assert_eq!(dead.deliveries, Some(5));
        assert!(dead.age(SystemTime::now()) >= Duration::from_secs(119));
        let bare = DeadLetter::new("2", Vec::new(), Bytes::new());
        assert_eq!((bare.reason.as_str(), bare.key, bare.dead_at), ("-", None, None));
        assert!(is_dead_letter_header("idempotency-dead-reason"));
        assert!(!is_dead_letter_header("Idempotency-Key"));
    }

    #[test]
    fn a_selection_picks_by_reason_key_and_age() {
        let now = SystemTime::now();
        let dead = letter("The handler refused the message: 422 amount", "pay-1", 3600);
        assert!(Selection::all(10).matches(&dead, now));
        assert!(Selection::all(10).reason("REFUSED").matches(&dead, now));
        assert!(!Selection::all(10).reason("timeout").matches(&dead, now));
        assert!(Selection::all(10).key("pay-1").matches(&dead, now));
        assert!(!Selection::all(10).key("pay-2").matches(&dead, now));
        assert!(
            Selection::all(10)
                .older_than(Duration::from_secs(60))
                .matches(&dead, now)
        );
        assert!(
            !Selection::all(10)
                .older_than(Duration::from_secs(7200))
                .matches(&dead, now)
        );
        // Without a date, no age is proven: an age filter never purges it.
        let undated = DeadLetter::new("3", Vec::new(), Bytes::new());
        assert!(
            !Selection::all(10)
                .older_than(Duration::ZERO)
                .matches(&undated, now)
        );
    }
}
