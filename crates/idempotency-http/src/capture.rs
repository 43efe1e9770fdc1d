//! Capturing the handler's response so that it can be stored, and answering with it.

use std::pin::Pin;

use bytes::{Bytes, BytesMut};
use http::Response;
use http_body::Body;
use http_body_util::BodyExt;
use idempotency_core::Recorded;

use crate::body::ResponseBody;
use crate::layer::Config;
use crate::problem::Problem;
use crate::replay::{IDEMPOTENCY_KEY_EXPIRES, expires_header};
use crate::service::problem;

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
    BodyFailed,
}

pub(crate) async fn capture<B, E>(result: Result<Response<B>, E>, config: &Config) -> Captured<B, E>
where
    B: Body<Data = Bytes>,
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
                Err(_) => Captured::BodyFailed,
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
        let Ok(frame) = frame else {
            return Captured::BodyFailed;
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

pub(crate) fn respond_executed<B, E>(
    captured: Captured<B, E>,
    recorded: &Recorded,
) -> Result<Response<ResponseBody<B>>, E> {
    let mut response = match captured {
        Captured::Buffered { parts, body } => Response::from_parts(parts, ResponseBody::full(body)),
        Captured::Streaming { parts, prefix, body } => {
            Response::from_parts(parts, ResponseBody::inner(prefix, body))
        }
        Captured::Failed(error) => return Err(error),
        Captured::BodyFailed => return Ok(problem(&Problem::HandlerFailed)),
    };
    if let Recorded::Completed { expires_at } = recorded {
        response
            .headers_mut()
            .insert(IDEMPOTENCY_KEY_EXPIRES, expires_header(*expires_at));
    }
    Ok(response)
}
