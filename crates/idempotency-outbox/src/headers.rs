//! Headers as a `jsonb` column: `[{"name": …, "value": …}]`, with `"hex"` instead of `"value"`
//! for a value that is not UTF-8, so that no byte is lost and operators can read the rest. An
//! application that writes rows itself may also write an object of text values,
//! `{"content-type": "application/json"}` (`docs/OUTBOX.md`).

use serde_json::{Value, json};

/// Encodes `headers` for the `headers` column.
pub(crate) fn to_json(headers: &[(String, Vec<u8>)]) -> Value {
    Value::Array(
        headers
            .iter()
            .map(|(name, value)| match std::str::from_utf8(value) {
                Ok(text) => json!({ "name": name, "value": text }),
                Err(_) => json!({ "name": name, "hex": hex::encode(value) }),
            })
            .collect(),
    )
}

/// Decodes the `headers` column read as text; what it does not understand is skipped.
pub(crate) fn from_text(text: &str) -> Vec<(String, Vec<u8>)> {
    serde_json::from_str(text)
        .map(|value| from_json(&value))
        .unwrap_or_default()
}

/// Why a row's `headers` are not headers: the reason, as the row's error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct InvalidHeaders(String);

/// Decodes the `headers` column read as text, refusing what is not headers: an object of text
/// values, or the list `to_json` writes. The reason names what is wrong.
pub(crate) fn parse(text: &str) -> Result<Vec<(String, Vec<u8>)>, InvalidHeaders> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| InvalidHeaders(format!("the headers are not JSON: {e}")))?;
    match &value {
        Value::Object(entries) => {
            if let Some((name, _)) = entries.iter().find(|(_, value)| !value.is_string()) {
                return Err(InvalidHeaders(format!(
                    "the headers are a JSON object whose values must be text, and {name:?}'s is not"
                )));
            }
        }
        Value::Array(entries) => {
            let readable = |entry: &Value| {
                entry.get("name").is_some_and(Value::is_string)
                    && (entry.get("value").is_some_and(Value::is_string)
                        || entry
                            .get("hex")
                            .and_then(Value::as_str)
                            .is_some_and(|hex| hex::decode(hex).is_ok()))
            };
            if let Some(at) = entries.iter().position(|entry| !readable(entry)) {
                return Err(InvalidHeaders(format!(
                    "the headers' entry {at} is not {{\"name\": …, \"value\": …}} (or \"hex\")"
                )));
            }
        }
        other => {
            return Err(InvalidHeaders(format!(
                "the headers are a JSON object of text values, not {}",
                match other {
                    Value::Null => "null",
                    Value::Bool(_) => "a boolean",
                    Value::Number(_) => "a number",
                    _ => "a string",
                }
            )));
        }
    }
    Ok(from_json(&value))
}

/// Decodes the `headers` column; entries it does not understand are skipped.
pub(crate) fn from_json(value: &Value) -> Vec<(String, Vec<u8>)> {
    if let Value::Object(entries) = value {
        return entries
            .iter()
            .filter_map(|(name, value)| Some((name.clone(), value.as_str()?.as_bytes().to_vec())))
            .collect();
    }
    value
        .as_array()
        .map(|entries| {
            entries
                .iter()
                .filter_map(|entry| {
                    let name = entry.get("name")?.as_str()?.to_owned();
                    let value = match (entry.get("value"), entry.get("hex")) {
                        (Some(Value::String(text)), _) => text.clone().into_bytes(),
                        (_, Some(Value::String(hex))) => hex::decode(hex).ok()?,
                        _ => return None,
                    };
                    Some((name, value))
                })
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_not_headers_is_refused_with_the_reason() {
        assert_eq!(parse(r#"{"a": "1"}"#), Ok(vec![("a".to_owned(), b"1".to_vec())]));
        assert_eq!(parse("[]"), Ok(Vec::new()));
        assert_eq!(
            parse(&to_json(&[("b".to_owned(), vec![0xff])]).to_string())
                .unwrap()
                .len(),
            1
        );
        for (text, says) in [
            ("not json", "not JSON"),
            ("42", "not a number"),
            ("\"text\"", "not a string"),
            ("null", "not null"),
            (r#"{"a": 1}"#, "\"a\"'s is not"),
            (r#"[{"name": "a"}]"#, "entry 0"),
            (r#"[{"name": "a", "hex": "zz"}]"#, "entry 0"),
        ] {
            let refused = parse(text).unwrap_err().to_string();
            assert!(refused.contains(says), "{text}: {refused}");
        }
    }

    #[test]
    fn headers_round_trip_byte_for_byte() {
        let headers = vec![
            ("Idempotency-Key".to_owned(), b"order-1".to_vec()),
            ("binary".to_owned(), vec![0xff, 0x00, 0x80]),
            ("empty".to_owned(), Vec::new()),
        ];
        let encoded = to_json(&headers);
        assert_eq!(encoded[1]["hex"], "ff0080");
        assert_eq!(from_json(&encoded), headers);
        assert_eq!(from_text(&encoded.to_string()), headers);
        assert_eq!(from_text("not json"), Vec::new());
        assert_eq!(
            from_json(&json!({"content-type": "text/plain", "not text": 1})),
            vec![("content-type".to_owned(), b"text/plain".to_vec())]
        );
        assert_eq!(from_json(&json!([{"name": 1}, {"value": "x"}])), Vec::new());
    }
}
