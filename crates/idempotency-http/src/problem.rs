//! RFC 9457 problem responses, one stable `type` per error.
//!
//! The `type` URIs are URNs: stable identifiers that clients match on, not pages to fetch. The
//! titles of the first three are the IETF draft's (draft-ietf-httpapi-idempotency-key-header).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

use crate::key::KeyHeaderError;
use crate::outcome::OutcomeUnknown;

/// What every problem with an unknown outcome adds: why the retry gets `409` for a while.
const KEPT_IN_FLIGHT: &str = "The Idempotency-Key stays reserved until this attempt's lease ends \
    (retries get 409 until then; see Retry-After); the first retry after that runs again as a \
    new attempt, with Idempotency-Attempt raised.";

/// An error the layer answers itself, without (or instead of) running the handler.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Problem {
    /// The route requires an `Idempotency-Key` and the request has none (400).
    MissingKey,
    /// The `Idempotency-Key` header is malformed, or appears more than once (400).
    InvalidKey(KeyHeaderError),
    /// The key was first used with another payload, method or path (422).
    KeyReused,
    /// A request with this key is being processed (409, with `Retry-After`).
    InFlight {
        /// When to try again.
        retry_after: Duration,
    },
    /// The idempotency store cannot be reached; nothing ran (503, with `Retry-After`).
    StoreUnavailable,
    /// The request body is larger than the configured limit; nothing ran (413).
    BodyTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The request body could not be read (400).
    BodyUnreadable,
    /// The request body is not what the route reads from it: not JSON, when the key or the
    /// fingerprint is taken from its members (400; the reason is given).
    InvalidBody(String),
    /// The request body did not arrive within the server's time limit; nothing ran (408).
    RequestTimeout,
    /// The first request's response was too large or streamed, so it was not stored; the request
    /// will not run again (409).
    NotReplayable,
    /// The handler panicked; the key was released (500).
    HandlerFailed,
    /// The handler answered, but its response body failed before it was complete: whether the
    /// request took effect is unknown, and the key stays in flight until its lease ends (500).
    OutcomeUnknown,
    /// A stored response could not be decoded (500).
    StoredResponseUnreadable,
    /// A proxy's upstream could not be reached: nothing was sent, and the key was released (502).
    UpstreamUnreachable,
    /// A proxy could not make a TLS connection to the upstream (its certificate was refused,
    /// say; the reason is given), so nothing was sent (502).
    UpstreamTls(String),
    /// A proxy sent the request, but no complete answer came back (the connection dropped, the
    /// answer was malformed or truncated): the outcome is unknown, and the key stays in flight
    /// until its lease ends (502).
    UpstreamAnswerLost,
    /// A proxy sent the request, but the whole answer did not arrive within its timeout: the
    /// outcome is unknown, and the key stays in flight until its lease ends (504).
    UpstreamTimeout,
    /// A proxy could not make the upstream's request target from the request's (400).
    BadTarget(String),
    /// An earlier attempt's outcome is unknown, and the reconcile function could not tell
    /// whether it took effect (it failed, timed out or gave an answer it cannot stand by), so
    /// nothing ran: the key stays in flight until this attempt's lease ends (503, with
    /// `Retry-After`). See [`crate::reconcile`].
    Unreconciled,
    /// The server is at a limit it keeps to stay up (what is named here); nothing ran (503, with
    /// `Retry-After`).
    Overloaded {
        /// Which limit: "request bodies held in memory", "the idempotency store's capacity".
        what: &'static str,
    },
}

impl Problem {
    /// The stable `type` URI.
    #[must_use]
    pub fn type_uri(&self) -> &'static str {
        match self {
            Self::MissingKey => "urn:idempotency:problem:missing-key",
            Self::InvalidKey(_) => "urn:idempotency:problem:invalid-key",
            Self::KeyReused => "urn:idempotency:problem:key-reused",
            Self::InFlight { .. } => "urn:idempotency:problem:request-in-flight",
            Self::StoreUnavailable => "urn:idempotency:problem:store-unavailable",
            Self::BodyTooLarge { .. } => "urn:idempotency:problem:body-too-large",
            Self::BodyUnreadable => "urn:idempotency:problem:body-unreadable",
            Self::InvalidBody(_) => "urn:idempotency:problem:invalid-body",
            Self::RequestTimeout => "urn:idempotency:problem:request-timeout",
            Self::NotReplayable => "urn:idempotency:problem:outcome-not-replayable",
            Self::HandlerFailed => "urn:idempotency:problem:handler-failed",
            Self::OutcomeUnknown => "urn:idempotency:problem:outcome-unknown",
            Self::StoredResponseUnreadable => "urn:idempotency:problem:stored-response-unreadable",
            Self::UpstreamUnreachable => "urn:idempotency:problem:upstream-unreachable",
            Self::UpstreamTls(_) => "urn:idempotency:problem:upstream-tls",
            Self::UpstreamAnswerLost => "urn:idempotency:problem:upstream-answer-lost",
            Self::UpstreamTimeout => "urn:idempotency:problem:upstream-timeout",
            Self::BadTarget(_) => "urn:idempotency:problem:bad-target",
            Self::Overloaded { .. } => "urn:idempotency:problem:overloaded",
            Self::Unreconciled => "urn:idempotency:problem:outcome-unreconciled",
        }
    }

    /// The HTTP status.
    #[must_use]
    pub fn status(&self) -> StatusCode {
        match self {
            Self::MissingKey
            | Self::InvalidKey(_)
            | Self::BodyUnreadable
            | Self::InvalidBody(_)
            | Self::BadTarget(_) => StatusCode::BAD_REQUEST,
            Self::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Self::InFlight { .. } | Self::NotReplayable => StatusCode::CONFLICT,
            Self::StoreUnavailable | Self::Overloaded { .. } | Self::Unreconciled => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::HandlerFailed | Self::OutcomeUnknown | Self::StoredResponseUnreadable => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            Self::UpstreamUnreachable | Self::UpstreamTls(_) | Self::UpstreamAnswerLost => {
                StatusCode::BAD_GATEWAY
            }
            Self::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// The short human-readable summary.
    #[must_use]
    pub fn title(&self) -> &'static str {
        match self {
            Self::MissingKey => "Idempotency-Key is missing",
            Self::InvalidKey(_) => "Idempotency-Key is invalid",
            Self::KeyReused => "Idempotency-Key is already used",
            Self::InFlight { .. } => "A request is outstanding for this Idempotency-Key",
            Self::StoreUnavailable => "Idempotency store unavailable",
            Self::BodyTooLarge { .. } => "Request body too large",
            Self::BodyUnreadable => "Request body unreadable",
            Self::InvalidBody(_) => "Request body invalid",
            Self::RequestTimeout => "Request body too slow",
            Self::NotReplayable => "Original response cannot be replayed",
            Self::HandlerFailed => "Request handler failed",
            Self::OutcomeUnknown => "Outcome unknown",
            Self::StoredResponseUnreadable => "Stored response unreadable",
            Self::UpstreamUnreachable => "Upstream unreachable",
            Self::UpstreamTls(_) => "Upstream TLS failed",
            Self::UpstreamAnswerLost => "Upstream answer lost",
            Self::UpstreamTimeout => "Upstream timed out",
            Self::BadTarget(_) => "Bad request target",
            Self::Overloaded { .. } => "Too busy",
            Self::Unreconciled => "Outcome not reconciled",
        }
    }

    /// The explanation for this occurrence.
    #[must_use]
    pub fn detail(&self) -> String {
        match self {
            Self::MissingKey => {
                "This operation is idempotent and it requires correct usage of Idempotency Key.".into()
            }
            Self::InvalidKey(why) => format!("The idempotency key is invalid: {why}."),
            Self::KeyReused => {
                "This operation is idempotent and it requires correct usage of Idempotency Key. \
                Idempotency Key MUST not be reused across different payloads of this operation."
                    .into()
            }
            Self::InFlight { .. } => {
                "A request with the same Idempotency-Key for the same operation is being \
                processed or is outstanding."
                    .into()
            }
            Self::StoreUnavailable => {
                "The idempotency store cannot be reached, so the request was not processed. Retry later."
                    .into()
            }
            Self::BodyTooLarge { limit } => {
                format!("The request body exceeds {limit} bytes; the request was not processed.")
            }
            Self::BodyUnreadable => {
                "The request body could not be read; the request was not processed.".into()
            }
            Self::InvalidBody(why) => {
                format!("The request body cannot be used: {why}; the request was not processed.")
            }
            Self::RequestTimeout => {
                "The request body did not arrive in time; the request was not processed.".into()
            }
            Self::NotReplayable => {
                "The first request with this Idempotency-Key was processed, but its response \
                was too large or streamed and was not stored. It will not be processed again."
                    .into()
            }
            Self::HandlerFailed => "The request failed and was not recorded; it may be retried.".into(),
            Self::OutcomeUnknown => format!(
                "The request ran, but its response failed before it was complete: whether it \
                took effect is unknown. {KEPT_IN_FLIGHT}"
            ),
            Self::StoredResponseUnreadable => {
                "The stored response for this Idempotency-Key cannot be read.".into()
            }
            Self::UpstreamUnreachable => "The upstream could not be reached, so nothing was sent to it; the \
                key was released and the request may be retried."
                .into(),
            Self::UpstreamTls(why) => format!(
                "No TLS connection to the upstream could be made ({why}), so nothing was sent to \
                it; the key was released and the request may be retried once the upstream's \
                certificate is trusted."
            ),
            Self::UpstreamAnswerLost => format!(
                "The request was sent to the upstream, but no complete answer came back (the \
                connection dropped, or the answer was malformed or truncated): whether it took \
                effect is unknown. {KEPT_IN_FLIGHT}"
            ),
            Self::UpstreamTimeout => format!(
                "The request was sent to the upstream, but its whole answer did not arrive within \
                the upstream timeout: whether it took effect is unknown. {KEPT_IN_FLIGHT}"
            ),
            Self::BadTarget(why) => format!("The request target cannot be forwarded: {why}."),
            Self::Overloaded { what } => format!(
                "The server is at its limit of {what}, so the request was not processed. Retry later."
            ),
            Self::Unreconciled => format!(
                "An earlier attempt with this Idempotency-Key may have taken effect, and whether it \
                did could not be found out now, so the request was not run again. {KEPT_IN_FLIGHT} \
                That attempt asks again before it runs."
            ),
        }
    }

    /// Whether the problem says that the request may have taken effect: its response carries
    /// [`OutcomeUnknown`], so that the layer keeps the key in flight instead of releasing it.
    #[must_use]
    pub fn is_outcome_unknown(&self) -> bool {
        matches!(
            self,
            Self::OutcomeUnknown | Self::UpstreamAnswerLost | Self::UpstreamTimeout | Self::Unreconciled
        )
    }

    /// The `application/problem+json` response.
    #[must_use]
    pub fn to_response(&self) -> Response<Bytes> {
        self.to_response_with_detail(&self.detail())
    }

    /// The `application/problem+json` response with another `detail` (a health check's reason,
    /// say); the `type`, `title`, status and `Retry-After` stay this problem's.
    #[must_use]
    pub fn to_response_with_detail(&self, detail: &str) -> Response<Bytes> {
        let body = serde_json::json!({
            "type": self.type_uri(),
            "title": self.title(),
            "status": self.status().as_u16(),
            "detail": detail,
        });
        let mut response = Response::new(Bytes::from(body.to_string()));
        *response.status_mut() = self.status();
        if self.is_outcome_unknown() {
            response.extensions_mut().insert(OutcomeUnknown);
        }
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        let retry_after = match self {
            Self::InFlight { retry_after } => Some(*retry_after),
            Self::StoreUnavailable | Self::Overloaded { .. } => Some(Duration::from_secs(1)),
            _ => None,
        };
        if let Some(after) = retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, retry_after_value(after));
        }
        response
    }
}

/// `Retry-After` for `after`: whole seconds rounded up, at least 1.
pub(crate) fn retry_after_value(after: Duration) -> HeaderValue {
    let seconds = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    HeaderValue::from(seconds.max(1))
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.title(), self.detail())
    }
}

/// A problem is also an error: a body that fails with one is answered with that problem instead
/// of the generic one, a response body (a proxy's upstream timing out mid-body, say) instead of
/// [`Problem::OutcomeUnknown`], a request body (a server's read deadline) instead of
/// [`Problem::BodyUnreadable`].
impl std::error::Error for Problem {}

/// `problem` as the response the layer answers with.
pub(crate) fn problem<B>(problem: &Problem) -> Response<crate::body::ResponseBody<B>> {
    problem.to_response().map(crate::body::ResponseBody::full)
}
