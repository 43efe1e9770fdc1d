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
//! | `decision` | `acquired`, `reconciled` (an earlier attempt's outcome adopted from the reconcile function), `released`, `unknown`, `replayed`, `in-flight`, `mismatch`, `overloaded` or `store-error` |
//! | `status`, `upstream_status` | the answer's status; the upstream's, when it ran |
//! | `store_ms`, `upstream_ms`, `total_ms` | time in the guard outside the upstream call (its store calls), in the upstream call, and in all |
//! | `trace_id` | the W3C trace id of the request's `traceparent`, when it has a valid one |

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::request::Parts;
use http::{HeaderValue, Method, Uri};
pub use idempotency_core::KeyLog;
use idempotency_core::{Key, Scope};

/// What the guard decided for a request, as its log event says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decided {
    Acquired,
    Reconciled,
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
            Self::Reconciled => "reconciled",
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

/// A guarded request's log event, filled in as it runs. It keeps what it needs as it came (all
/// cheap clones); the digests and the trace id are worked out only when the event is logged.
#[derive(Debug)]
pub(crate) struct RequestLog {
    started: Instant,
    method: Method,
    uri: Uri,
    scope: Scope,
    key: Key,
    key_log: KeyLog,
    traceparent: Option<HeaderValue>,
    /// What the upstream call reports.
    upstream: Arc<Upstream>,
}

/// The upstream call's duration (nanoseconds) and status (`0`: none).
#[derive(Debug, Default)]
struct Upstream {
    nanos: AtomicU64,
    status: AtomicU64,
}

impl RequestLog {
    pub(crate) fn new(started: Instant, parts: &Parts, scope: &Scope, key: &Key, key_log: KeyLog) -> Self {
        Self {
            started,
            method: parts.method.clone(),
            uri: parts.uri.clone(),
            scope: scope.clone(),
            key: key.clone(),
            key_log,
            traceparent: parts.headers.get("traceparent").cloned(),
            upstream: Arc::default(),
        }
    }

    /// What the upstream call reports its time and status through.
    pub(crate) fn upstream_timer(&self) -> UpstreamTimer {
        UpstreamTimer(Arc::clone(&self.upstream))
    }

    /// The first 16 hex digits of the scope's SHA-256 (core's [`Scope::digest`]).
    fn scope_digest(&self) -> String {
        let mut digest = Scope::digest(self.scope.as_str().as_bytes()).as_str().to_owned();
        digest.truncate(16);
        digest
    }

    /// The key as [`KeyLog`] shows it, or `None` when it is not logged.
    fn key_shown(&self) -> Option<String> {
        (self.key_log != KeyLog::Off).then(|| self.key.logged(self.key_log).to_string())
    }

    /// Records the decision on the request's span and emits the event.
    pub(crate) fn emit(&self, route: &str, decided: Decided, attempt: u32, status: u16) {
        let total = self.started.elapsed();
        let upstream = Duration::from_nanos(self.upstream.nanos.load(Ordering::Relaxed));
        let store = total.saturating_sub(upstream);
        let upstream_status = match self.upstream.status.load(Ordering::Relaxed) {
            0 => None,
            code => Some(code),
        };
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        // The request's span (`idempotency.request`) carries the decision to a trace.
        let span = tracing::Span::current();
        span.record("decision", decided.as_str());
        span.record("attempt", attempt);
        // The fields are evaluated only when the event is enabled: no digest otherwise.
        tracing::info!(
            target: "idempotency_http::request",
            route,
            method = %self.method,
            path = self.uri.path(),
            scope = %self.scope_digest(),
            key = self.key_shown(),
            attempt,
            decision = decided.as_str(),
            status,
            upstream_status,
            store_ms = ms(store),
            upstream_ms = ms(upstream),
            total_ms = ms(total),
            trace_id = self.traceparent.as_ref().and_then(|value| idempotency_core::trace::trace_id(value.as_bytes())),
            "request"
        );
    }
}

/// Records the upstream call's duration and status into a [`RequestLog`].
#[derive(Debug, Clone)]
pub(crate) struct UpstreamTimer(Arc<Upstream>);

impl UpstreamTimer {
    pub(crate) fn record(&self, took: Duration, status: Option<u16>) {
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.0.nanos.store(nanos, Ordering::Relaxed);
        self.0
            .status
            .store(status.map_or(0, u64::from), Ordering::Relaxed);
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
    fn keys_are_logged_as_configured_and_scopes_only_as_digests() {
        let scope = Scope::new("tenant-secret-42").unwrap();
        let key = Key::new("order-7").unwrap();
        let request = parts("x");
        let hashed = RequestLog::new(Instant::now(), &request, &scope, &key, KeyLog::Hash);
        assert_eq!(hashed.key_shown().as_deref().map(str::len), Some(16));
        assert_ne!(hashed.key_shown().as_deref(), Some("order-7"));
        assert_eq!(hashed.scope_digest().len(), 16);
        assert!(!hashed.scope_digest().contains("tenant"));
        let plain = RequestLog::new(Instant::now(), &request, &scope, &key, KeyLog::Plain);
        assert_eq!(plain.key_shown().as_deref(), Some("order-7"));
        assert_eq!(
            RequestLog::new(Instant::now(), &request, &scope, &key, KeyLog::Off).key_shown(),
            None
        );
        assert_eq!("plain".parse(), Ok(KeyLog::Plain));
        assert!("loud".parse::<KeyLog>().is_err());
    }
}
