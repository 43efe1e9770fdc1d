//! One `tracing` event per guarded request (target `idempotency_http::request`, level `info`):
//! what an operator searches the logs for when a retry got a `409` or a replay. Its fields:
//!
//! | field | what |
//! | --- | --- |
//! | `route` | the layer's name ([`IdempotencyLayer::name`](crate::IdempotencyLayer::name): a route's, in `idem serve`) |
//! | `method`, `path` | the request's |
//! | `scope` | the first 16 hex digits of the SHA-256 of the scope: never the scope, which may be derived from a credential |
//! | `key` | as [`KeyLog`] says: a digest like the scope's (the layer's default), the key (truncated past 16 bytes), or nothing; the guard's own warnings show keys the same way |
//! | `attempt` | the attempt that ran (`0` when none did: a replay, a `409`, a `422`) |
//! | `decision` | `acquired`, `released`, `unknown`, `replayed`, `in-flight`, `mismatch`, `overloaded` or `store-error` |
//! | `status`, `upstream_status` | the answer's status; the upstream's, when it ran |
//! | `store_ms`, `upstream_ms`, `total_ms` | time in the guard outside the upstream call (its store calls), in the upstream call, and in all |
//! | `trace_id` | the W3C trace id of the request's `traceparent`, when it has a valid one |

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::request::Parts;
pub use idempotency_core::KeyLog;
use idempotency_core::{Key, Scope};
use sha2::{Digest, Sha256};

/// What the guard decided for a request, as its log event says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decided {
    Acquired,
    Released,
    Unknown,
    Replayed,
    InFlight,
    Mismatch,
    Overloaded,
    StoreError,
}

impl Decided {
    fn as_str(self) -> &'static str {
        match self {
            Self::Acquired => "acquired",
            Self::Released => "released",
            Self::Unknown => "unknown",
            Self::Replayed => "replayed",
            Self::InFlight => "in-flight",
            Self::Mismatch => "mismatch",
            Self::Overloaded => "overloaded",
            Self::StoreError => "store-error",
        }
    }
}

/// The first 16 hex digits of the SHA-256 of `text`.
fn digest(text: &str) -> String {
    let digest = Sha256::digest(text.as_bytes());
    digest[..8].iter().map(|byte| format!("{byte:02x}")).collect()
}

/// The trace id of a valid W3C `traceparent` (`00-TRACEID-SPANID-FLAGS`, 32 hex digits, not
/// all zeros).
pub(crate) fn trace_id(parts: &Parts) -> Option<String> {
    let value = parts.headers.get("traceparent")?.to_str().ok()?;
    let mut fields = value.trim().split('-');
    let (version, trace, span) = (fields.next()?, fields.next()?, fields.next()?);
    let hex = |text: &str, len: usize| {
        text.len() == len
            && text
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let valid = hex(version, 2)
        && version != "ff"
        && hex(trace, 32)
        && hex(span, 16)
        && trace.bytes().any(|b| b != b'0');
    valid.then(|| trace.to_owned())
}

/// A guarded request's log event, filled in as it runs.
#[derive(Debug)]
pub(crate) struct RequestLog {
    started: Instant,
    method: String,
    path: String,
    scope: String,
    key: Option<String>,
    trace_id: Option<String>,
    /// Nanoseconds in the upstream call, set when it returns.
    upstream: Arc<AtomicU64>,
    upstream_status: Arc<AtomicU64>,
}

impl RequestLog {
    pub(crate) fn new(started: Instant, parts: &Parts, scope: &Scope, key: &Key, log: KeyLog) -> Self {
        Self {
            started,
            method: parts.method.to_string(),
            path: parts.uri.path().to_owned(),
            scope: digest(scope.as_str()),
            key: match log {
                KeyLog::Off => None,
                shown => Some(key.logged(shown).to_string()),
            },
            trace_id: trace_id(parts),
            upstream: Arc::default(),
            upstream_status: Arc::default(),
        }
    }

    /// What the upstream call reports its time and status through.
    pub(crate) fn upstream_timer(&self) -> UpstreamTimer {
        UpstreamTimer {
            nanos: Arc::clone(&self.upstream),
            status: Arc::clone(&self.upstream_status),
        }
    }

    /// Emits the event.
    pub(crate) fn emit(&self, route: &str, decided: Decided, attempt: u32, status: u16) {
        let total = self.started.elapsed();
        let upstream = Duration::from_nanos(self.upstream.load(Ordering::Relaxed));
        let store = total.saturating_sub(upstream);
        let upstream_status = match self.upstream_status.load(Ordering::Relaxed) {
            0 => None,
            code => Some(code),
        };
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        // The request's span (`idempotency.request`) carries the decision to a trace.
        let span = tracing::Span::current();
        span.record("decision", decided.as_str());
        span.record("attempt", attempt);
        tracing::info!(
            target: "idempotency_http::request",
            route,
            method = %self.method,
            path = %self.path,
            scope = %self.scope,
            key = self.key.as_deref(),
            attempt,
            decision = decided.as_str(),
            status,
            upstream_status,
            store_ms = ms(store),
            upstream_ms = ms(upstream),
            total_ms = ms(total),
            trace_id = self.trace_id.as_deref(),
            "request"
        );
    }
}

/// Records the upstream call's duration and status into a [`RequestLog`].
#[derive(Debug, Clone)]
pub(crate) struct UpstreamTimer {
    nanos: Arc<AtomicU64>,
    status: Arc<AtomicU64>,
}

impl UpstreamTimer {
    pub(crate) fn record(&self, took: Duration, status: Option<u16>) {
        self.nanos.store(
            u64::try_from(took.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        self.status.store(status.map_or(0, u64::from), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(traceparent: &str) -> Parts {
        http::Request::builder()
            .header("traceparent", traceparent)
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    #[test]
    fn only_a_valid_traceparent_gives_a_trace_id() {
        let id = "4bf92f3577b34da6a3ce929d0e0e4736";
        assert_eq!(
            trace_id(&parts(&format!("00-{id}-00f067aa0ba902b7-01"))).as_deref(),
            Some(id)
        );
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "garbage",
            "",
        ] {
            assert_eq!(trace_id(&parts(bad)), None, "{bad}");
        }
    }

    #[test]
    fn keys_are_logged_as_configured_and_scopes_only_as_digests() {
        let scope = Scope::new("tenant-secret-42").unwrap();
        let key = Key::new("order-7").unwrap();
        let request = parts("x");
        let hashed = RequestLog::new(Instant::now(), &request, &scope, &key, KeyLog::Hash);
        assert_eq!(hashed.key.as_deref().map(str::len), Some(16));
        assert_ne!(hashed.key.as_deref(), Some("order-7"));
        assert!(!hashed.scope.contains("tenant"));
        let plain = RequestLog::new(Instant::now(), &request, &scope, &key, KeyLog::Plain);
        assert_eq!(plain.key.as_deref(), Some("order-7"));
        assert_eq!(
            RequestLog::new(Instant::now(), &request, &scope, &key, KeyLog::Off).key,
            None
        );
        assert_eq!("plain".parse(), Ok(KeyLog::Plain));
        assert!("loud".parse::<KeyLog>().is_err());
    }
}
