//! Reading the `Idempotency-Key` header.

use http::HeaderMap;
use idempotency_core::Key;

/// The header name, lowercase as HTTP/2 requires.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The key of a request: `Ok(None)` when the header is absent, `Err(why)` when it is malformed.
///
/// The header is an RFC 8941 sf-string (`"…"`), parsed with the `sfv` parser. A value not starting
/// with `"` is taken as the key itself, as Stripe-style clients send it (a UUID is not a valid
/// sf-token, since it may start with a digit). Either way the key must then be 1 to 255 bytes of
/// visible ASCII. Two `Idempotency-Key` headers are an error: which one is meant is unknowable.
pub(crate) fn key_from_headers(headers: &HeaderMap) -> Result<Option<Key>, String> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err("the header appears more than once".into());
    }
    let raw = value.as_bytes();
    if raw.first() == Some(&b'"') {
        let item = sfv::Parser::new(raw)
            .parse_item::<sfv::Item>()
            .map_err(|e| format!("not a structured-field string: {e}"))?;
        if !item.params.is_empty() {
            return Err("parameters are not allowed on the key".into());
        }
        match item.bare_item {
            sfv::BareItem::String(text) => Key::new(text.as_str()).map(Some).map_err(|e| e.to_string()),
            _ => Err("not a structured-field string".into()),
        }
    } else {
        Key::from_bytes(raw).map(Some).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn parse(values: &[&[u8]]) -> Result<Option<Key>, String> {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(IDEMPOTENCY_KEY, HeaderValue::from_bytes(value).unwrap());
        }
        key_from_headers(&headers)
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
            parse(&[b"a", b"b"]),
            Err("the header appears more than once".into())
        );
    }
}
