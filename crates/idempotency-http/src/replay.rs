//! Answering a duplicate with the stored response.

use http::{HeaderName, HeaderValue, Response};
use idempotency_core::{Completed, Timestamp};

use crate::body::ResponseBody;
use crate::problem::{Problem, problem};
use crate::stored::{self, Stored};

/// Replays carry this header with the value `true`.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Every stored response (the first and its replays) says until when its key is remembered, as
/// an HTTP-date: retries after that run again.
pub const IDEMPOTENCY_KEY_EXPIRES: HeaderName = HeaderName::from_static("idempotency-key-expires");

pub(crate) fn expires_header(expires_at: Timestamp) -> HeaderValue {
    // An HTTP-date has four digits of year (`httpdate` panics past 9999): a retention that long
    // is "forever" as far as a client can tell.
    let last = std::time::UNIX_EPOCH + std::time::Duration::from_secs(253_402_300_799);
    let at = expires_at.to_system_time().clamp(std::time::UNIX_EPOCH, last);
    HeaderValue::from_str(&httpdate::fmt_http_date(at))
        .unwrap_or_else(|_| HeaderValue::from_static("Thu, 01 Jan 1970 00:00:00 GMT"))
}

pub(crate) fn replay<B>(done: &Completed) -> Response<ResponseBody<B>> {
    match stored::decode(&done.outcome) {
        Some(Stored::Response {
            status,
            headers,
            body,
        }) => {
            let mut response = Response::new(ResponseBody::full(body));
            *response.status_mut() = status;
            *response.headers_mut() = headers;
            response
                .headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            response
                .headers_mut()
                .insert(IDEMPOTENCY_KEY_EXPIRES, expires_header(done.expires_at));
            response
        }
        Some(Stored::NotReplayable) => problem(&Problem::NotReplayable),
        None => problem(&Problem::StoredResponseUnreadable),
    }
}
