//! Reading the `Idempotency-Key` header, and the key a handler runs under.

use http::{HeaderMap, HeaderName};
use idempotency_core::{Key, KeyError, Scope};

/// The header name, lowercase as HTTP/2 requires: core's
/// [`IDEMPOTENCY_KEY_HEADER`](idempotency_core::IDEMPOTENCY_KEY_HEADER) as an HTTP header name.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The key of a request: `Ok(None)` when the header is absent, `Err(why)` when it is malformed.
///
/// The header is an RFC 8941 sf-string (`"…"`), parsed with the `sfv` parser. A value not starting
/// with `"` is taken as the key itself, as Stripe-style clients send it (a UUID is not a valid
/// sf-token, since it may start with a digit). Either way the key must then be 1 to 255 bytes of
/// visible ASCII. Two `Idempotency-Key` headers are an error: which one is meant is unknowable.
///
/// ```
/// use http::{HeaderMap, HeaderValue};
/// use idempotency_http::{IDEMPOTENCY_KEY, key_from_headers};
///
/// let mut headers = HeaderMap::new();
/// headers.insert(IDEMPOTENCY_KEY, HeaderValue::from_static("\"order-1\""));
/// assert_eq!(key_from_headers(&headers)?.unwrap().as_str(), "order-1");
/// headers.insert(IDEMPOTENCY_KEY, HeaderValue::from_static("\"unterminated"));
/// assert!(key_from_headers(&headers).is_err());
/// # Ok::<(), idempotency_http::KeyHeaderError>(())
/// ```
///
/// # Errors
///
/// [`KeyHeaderError`] saying what is wrong with the header.
pub fn key_from_headers(headers: &HeaderMap) -> Result<Option<Key>, KeyHeaderError> {
    key_from_header(headers, &IDEMPOTENCY_KEY)
}

/// As [`key_from_headers`], from the header `name` (a client that sends its key as
/// `X-Request-Id`, say).
///
/// ```
/// use http::{HeaderMap, HeaderName, HeaderValue};
/// use idempotency_http::key_from_header;
///
/// let name = HeaderName::from_static("x-request-id");
/// let mut headers = HeaderMap::new();
/// headers.insert(&name, HeaderValue::from_static("order-1"));
/// assert_eq!(key_from_header(&headers, &name)?.unwrap().as_str(), "order-1");
/// # Ok::<(), idempotency_http::KeyHeaderError>(())
/// ```
///
/// # Errors
///
/// [`KeyHeaderError`] saying what is wrong with the header.
pub fn key_from_header(headers: &HeaderMap, name: &HeaderName) -> Result<Option<Key>, KeyHeaderError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyHeaderError::Repeated);
    }
    let raw = value.as_bytes();
    if raw.first() == Some(&b'"') {
        let item = sfv::Parser::new(raw)
            .parse_item::<sfv::Item>()
            .map_err(|e| KeyHeaderError::NotString(e.to_string()))?;
        if !item.params.is_empty() {
            return Err(KeyHeaderError::Parameters);
        }
        match item.bare_item {
            sfv::BareItem::String(text) => Ok(Some(Key::new(text.as_str())?)),
            _ => Err(KeyHeaderError::NotString("another kind of item".into())),
        }
    } else {
        Ok(Some(Key::from_bytes(raw)?))
    }
}

/// Why an `Idempotency-Key` header is refused (a `400` [`Problem::InvalidKey`](crate::Problem::InvalidKey)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyHeaderError {
    /// The header appears more than once: which one is meant is unknowable.
    #[error("the header appears more than once")]
    Repeated,
    /// The value starts with `"` but is not an RFC 8941 sf-string (the parser's message: its
    /// error type is not `Clone`, as a problem document's fields are).
    #[error("not a structured-field string: {0}")]
    NotString(String),
    /// The sf-string carries parameters.
    #[error("parameters are not allowed on the key")]
    Parameters,
    /// The key itself is not 1 to 255 bytes of visible ASCII.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// The key read from the body ([`IdempotencyLayer::key_from`](crate::IdempotencyLayer::key_from))
    /// is not one: not a string or a number, or not 1 to 255 bytes of visible ASCII.
    #[error("the body's member {pointer} is not a key: {why}")]
    FromBody {
        /// The JSON pointer the key is read from.
        pointer: String,
        /// What is wrong with the member.
        why: String,
    },
}

/// What the handler finds in the request's extensions: the key it runs under, to propagate into
/// the messages it publishes and the calls it makes downstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey {
    /// The scope of the key.
    pub scope: Scope,
    /// The key.
    pub key: Key,
    /// The attempt number: 1, or more after a previous attempt's lease expired.
    pub attempt: u32,
    /// Whether a previous attempt may have partially run.
    pub recovered: bool,
}

impl IdempotencyKey {
    /// The key to put on the messages the handler publishes and the calls it makes downstream
    /// ([`Key::qualified`]): the same for every retry of this request, different for another
    /// scope's equal key. A consumer keyed on it runs once per API request, however often the
    /// client retried and the broker redelivered.
    ///
    /// ```
    /// use idempotency_core::{Key, KeyError, Scope};
    /// use idempotency_http::IdempotencyKey;
    ///
    /// let request = IdempotencyKey { scope: Scope::new("tenant-a")?, key: Key::new("pay-1")?, attempt: 1, recovered: false };
    /// assert_eq!(request.message_key().as_str(), "tenant-a:pay-1");
    /// # Ok::<(), idempotency_core::KeyError>(())
    /// ```
    #[must_use]
    pub fn message_key(&self) -> Key {
        Key::qualified(&self.scope, &self.key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn parse(values: &[&[u8]]) -> Result<Option<Key>, KeyHeaderError> {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(IDEMPOTENCY_KEY, HeaderValue::from_bytes(value).unwrap());
        }
        key_from_headers(&headers)
    }

    #[test]
    fn the_header_name_is_cores() {
        assert!(
            IDEMPOTENCY_KEY
                .as_str()
                .eq_ignore_ascii_case(idempotency_core::IDEMPOTENCY_KEY_HEADER)
        );
    }

    #[test]
    fn accepts_sf_strings_and_bare_tokens() {
        assert_eq!(
            parse(&[b"\"8e03978e-40d5-43e8\""]).unwrap().unwrap().as_str(),
            "8e03978e-40d5-43e8"
        );
        assert_eq!(
            parse(&[b"8e03978e-40d5-43e8"]).unwrap().unwrap().as_str(),
            "8e03978e-40d5-43e8"
        );
        assert_eq!(parse(&[b"\"a\\\"b\""]).unwrap().unwrap().as_str(), "a\"b");
        assert_eq!(parse(&[]), Ok(None));
    }

    #[test]
    fn rejects_malformed_keys() {
        let too_long = format!("\"{}\"", "x".repeat(256));
        for bad in [
            &b"\"\""[..],
            b"\"unterminated",
            b"\"a\";p=1",
            b"\"has space\"",
            too_long.as_bytes(),
            b"caf\xc3\xa9",
            b"\"caf\xc3\xa9\"",
            b"a b",
        ] {
            assert!(parse(&[bad]).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        assert_eq!(
            parse(&[b"a", b"b"]).map_err(|e| e.to_string()),
            Err("the header appears more than once".into())
        );
    }
}
