//! Capturing the handler's response so that it can be stored, and answering with it.

use std::pin::Pin;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{Response, header};
use http_body::Body;
use http_body_util::BodyExt;
use idempotency_core::Recorded;

use crate::body::{BoxError, ResponseBody};
use crate::config::Config;
use crate::problem::{Problem, problem, retry_after_value};
use crate::replay::{IDEMPOTENCY_KEY_EXPIRES, expires_header};

/// What the handler produced, as the guard's policy sees it.
pub(crate) enum Captured<B, E> {
    /// The whole response, small enough to store.
    Buffered {
        parts: http::response::Parts,
        body: Bytes,
    },
    /// A response too large or streamed to store: passed through, `prefix` (what was read of
    /// it while trying to store it) first.
    Streaming {
        parts: http::response::Parts,
        prefix: Bytes,
        body: Pin<Box<B>>,
    },
    /// The inner service failed.
    Failed(E),
    /// The response body failed while being read.
    BodyFailed(BoxError),
}

impl<B, E> Captured<B, E> {
    /// The upstream's status, when it answered.
    pub(crate) fn status(&self) -> Option<u16> {
        match self {
            Self::Buffered { parts, .. } | Self::Streaming { parts, .. } => Some(parts.status.as_u16()),
            Self::Failed(_) | Self::BodyFailed(_) => None,
        }
    }

    /// Whether this is a reconcile function's answer, adopted as the key's outcome.
    pub(crate) fn adopted(&self) -> bool {
        matches!(self, Self::Buffered { parts, .. } if parts.extensions.get::<crate::outcome::Adopted>().is_some())
    }
}

pub(crate) async fn capture<B, E>(result: Result<Response<B>, E>, config: &Config) -> Captured<B, E>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let max_response = config.max_response as u64;
    let (parts, body) = match result {
        Err(error) => return Captured::Failed(error),
        Ok(response) => response.into_parts(),
    };
    let mut body = Box::pin(body);
    let hint = body.size_hint();
    let unknown = match hint.exact() {
        Some(len) if len <= max_response => {
            return match body.collect().await {
                Ok(collected) => Captured::Buffered {
                    parts,
                    body: collected.to_bytes(),
                },
                Err(error) => Captured::BodyFailed(error.into()),
            };
        }
        Some(_) => false,
        None => config.buffer_streamed && hint.lower() <= max_response,
    };
    if !unknown {
        return Captured::Streaming {
            parts,
            prefix: Bytes::new(),
            body,
        };
    }
    // Of unknown length: read up to the limit; store it if it ends there.
    let mut read = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(error) => return Captured::BodyFailed(error.into()),
        };
        if let Ok(data) = frame.into_data() {
            read.extend_from_slice(&data);
        }
        if read.len() as u64 > max_response {
            return Captured::Streaming {
                parts,
                prefix: read.freeze(),
                body,
            };
        }
    }
    Captured::Buffered {
        parts,
        body: read.freeze(),
    }
}

/// The answer to the request that ran: its response, with `Idempotency-Key-Expires` when it was
/// stored, or `Retry-After: lease` when its outcome is unknown (retries get `409` until then).
pub(crate) fn respond_executed<B, E>(
    captured: Captured<B, E>,
    recorded: &Recorded,
    lease: Duration,
) -> Result<Response<ResponseBody<B>>, E> {
    let mut response = match captured {
        Captured::Buffered { parts, body } => Response::from_parts(parts, ResponseBody::full(body)),
        Captured::Streaming { parts, prefix, body } => {
            Response::from_parts(parts, ResponseBody::inner(prefix, body))
        }
        Captured::Failed(error) => return Err(error),
        Captured::BodyFailed(error) => {
            tracing::warn!(error = %error, "the response body failed; the outcome is unknown");
            problem(&problem_in(&*error).unwrap_or(Problem::OutcomeUnknown))
        }
    };
    match recorded {
        Recorded::Completed { expires_at } => {
            response
                .headers_mut()
                .insert(IDEMPOTENCY_KEY_EXPIRES, expires_header(*expires_at));
        }
        Recorded::Unknown => {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, retry_after_value(lease));
        }
        Recorded::Released | Recorded::LeaseLost | Recorded::Failed(_) => {}
    }
    Ok(response)
}

/// The [`Problem`] a failed body says happened (a proxy's upstream timing out), wherever it is
/// in the error's chain of sources: a framework may have wrapped it on the way.
pub(crate) fn problem_in(error: &(dyn std::error::Error + 'static)) -> Option<Problem> {
    let mut cause = Some(error);
    while let Some(error) = cause {
        if let Some(problem) = error.downcast_ref::<Problem>() {
            return Some(problem.clone());
        }
        cause = error.source();
    }
    None
}
