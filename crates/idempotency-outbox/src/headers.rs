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
