//! The stored form of a response: what a replay sends back.
//!
//! Layout (version 1): `1`, a kind byte (`0` a response, `1` not replayable), then for a response
//! the status (u16), the number of headers (u16), each header as name length (u16), name, value
//! length (u32), value, and the body to the end. Integers are big-endian.

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use idempotency_core::Outcome;

const VERSION: u8 = 1;

/// What the layer stored as a key's outcome, decoded: for operators' tools (`idem keys get`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stored {
    /// A response to replay.
    Response {
        /// Its status.
        status: StatusCode,
        /// The headers that are replayed.
        headers: HeaderMap,
        /// Its body.
        body: Bytes,
    },
    /// The response was passed through without being stored.
    NotReplayable,
}

impl Stored {
    /// Decodes an outcome the layer stored; `None` when `bytes` is not one (another
    /// application's outcome, or a newer format).
    #[must_use]
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        decode(&Outcome::new(Bytes::copy_from_slice(bytes)))
    }

    /// The outcome the layer stores for this: the inverse of [`Stored::decode`].
    ///
    /// ```
    /// use http::{HeaderMap, StatusCode};
    /// use idempotency_http::StoredOutcome;
    ///
    /// let stored = StoredOutcome::Response { status: StatusCode::CREATED, headers: HeaderMap::new(), body: "ok".into() };
    /// assert_eq!(StoredOutcome::decode(stored.encode().as_bytes()), Some(stored));
    /// ```
    #[must_use]
    pub fn encode(&self) -> Outcome {
        match self {
            Self::Response {
                status,
                headers,
                body,
            } => encode_response(*status, headers, body),
            Self::NotReplayable => encode_not_replayable(),
        }
    }
}

pub(crate) fn encode_response(status: StatusCode, headers: &HeaderMap, body: &Bytes) -> Outcome {
    let mut out = BytesMut::with_capacity(8 + body.len() + headers.len() * 32);
    out.put_u8(VERSION);
    out.put_u8(0);
    out.put_u16(status.as_u16());
    out.put_u16(u16::try_from(headers.len()).unwrap_or(u16::MAX));
    for (name, value) in headers.iter().take(usize::from(u16::MAX)) {
        out.put_u16(u16::try_from(name.as_str().len()).unwrap_or(u16::MAX));
        out.put_slice(name.as_str().as_bytes());
        out.put_u32(u32::try_from(value.len()).unwrap_or(u32::MAX));
        out.put_slice(value.as_bytes());
    }
    out.put_slice(body);
    Outcome::new(out.freeze())
}

pub(crate) fn encode_not_replayable() -> Outcome {
    Outcome::new(Bytes::from_static(&[VERSION, 1]))
}

/// Decodes a stored outcome; `None` when it is not one this version wrote.
pub(crate) fn decode(outcome: &Outcome) -> Option<Stored> {
    let bytes = outcome.clone().into_bytes();
    let mut at = 0usize;
    let take = |at: &mut usize, n: usize| -> Option<Bytes> {
        let slice = bytes.get(*at..*at + n)?;
        *at += n;
        Some(bytes.slice_ref(slice))
    };
    let u8_at = |at: &mut usize| take(at, 1).map(|b| b[0]);
    let u16_at = |at: &mut usize| take(at, 2).map(|b| u16::from_be_bytes([b[0], b[1]]));
    let u32_at = |at: &mut usize| take(at, 4).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
    if u8_at(&mut at)? != VERSION {
        return None;
    }
    match u8_at(&mut at)? {
        1 => Some(Stored::NotReplayable),
        0 => {
            let status = StatusCode::from_u16(u16_at(&mut at)?).ok()?;
            let count = usize::from(u16_at(&mut at)?);
            // The count is data: a damaged one must not size an allocation (a header takes at
            // least 7 bytes), nor make the map outgrow what `HeaderMap` holds (it panics).
            let mut headers =
                HeaderMap::try_with_capacity(count.min(bytes.len().saturating_sub(at) / 7)).ok()?;
            for _ in 0..count {
                let name_len = usize::from(u16_at(&mut at)?);
                let name = HeaderName::from_bytes(&take(&mut at, name_len)?).ok()?;
                let value_len = usize::try_from(u32_at(&mut at)?).ok()?;
                let value = HeaderValue::from_maybe_shared(take(&mut at, value_len)?).ok()?;
                headers.try_append(name, value).ok()?;
            }
            let body = bytes.slice(at..);
            Some(Stored::Response {
                status,
                headers,
                body,
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_round_trip() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.append("x-multi", HeaderValue::from_static("a"));
        headers.append("x-multi", HeaderValue::from_static("b"));
        let body = Bytes::from_static(b"{\"id\":1}\x00\xff");
        let outcome = encode_response(StatusCode::CREATED, &headers, &body);
        assert_eq!(
            decode(&outcome),
            Some(Stored::Response {
                status: StatusCode::CREATED,
                headers,
                body
            })
        );
        assert_eq!(decode(&encode_not_replayable()), Some(Stored::NotReplayable));
    }

    #[test]
    fn a_damaged_header_count_is_refused_without_a_panic() {
        // Found by the stored_response fuzz target: 51,200 headers claimed, none there. It used
        // to size the map from the count, and HeaderMap panics past 32,768.
        let claimed = [
            1, 0, 1, 0, 200, 0, 1, 0, 8, 98, 97, 100, 230, 110, 97, 109, 101, 0, 0, 0, 1, 118,
        ];
        assert_eq!(Stored::decode(&claimed), None);
        // 40,000 real headers: more than a HeaderMap holds.
        let mut many = vec![1, 0, 0, 200];
        many.extend_from_slice(&40_000u16.to_be_bytes());
        for _ in 0..40_000 {
            many.extend_from_slice(&[0, 1, b'x', 0, 0, 0, 0]);
        }
        assert_eq!(Stored::decode(&many), None);
    }

    #[test]
    fn garbage_is_not_decoded() {
        for bytes in [
            &b""[..],
            b"\x02\x00",
            b"\x01\x07",
            b"\x01\x00\x00",
            b"\x01\x00\x00\xc8\x00\x05",
        ] {
            assert_eq!(decode(&Outcome::new(bytes.to_vec())), None, "{bytes:?}");
        }
    }
}
