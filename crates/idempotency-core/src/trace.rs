//! The W3C trace context as the log lines of the HTTP layer and the consumers read it.

/// The trace id of a W3C `traceparent` value (`00-TRACEID-SPANID-FLAGS`): 32 lowercase hex
/// digits, not all zeros, with a valid version and span id; `None` for anything else.
///
/// ```
/// let id = "4bf92f3577b34da6a3ce929d0e0e4736";
/// let header = format!("00-{id}-00f067aa0ba902b7-01");
/// assert_eq!(idempotency_core::trace::trace_id(header.as_bytes()), Some(id));
/// assert_eq!(idempotency_core::trace::trace_id(b"garbage"), None);
/// ```
#[must_use]
pub fn trace_id(traceparent: &[u8]) -> Option<&str> {
    let value = std::str::from_utf8(traceparent).ok()?.trim();
    let mut fields = value.split('-');
    let (version, trace, span) = (fields.next()?, fields.next()?, fields.next()?);
    let hex = |text: &str, len: usize| {
        text.len() == len
            && text
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let valid = hex(version, 2)
        && version != "ff"
        && hex(trace, 32)
        && hex(span, 16)
        && trace.bytes().any(|b| b != b'0');
    valid.then_some(trace)
}

#[cfg(test)]
mod tests {
    use super::trace_id;

    #[test]
    fn only_a_valid_traceparent_gives_a_trace_id() {
        let id = "4bf92f3577b34da6a3ce929d0e0e4736";
        let valid = format!("00-{id}-00f067aa0ba902b7-01");
        assert_eq!(trace_id(valid.as_bytes()), Some(id));
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "garbage",
            "",
        ] {
            assert_eq!(trace_id(bad.as_bytes()), None, "{bad}");
        }
        assert_eq!(trace_id(&[0xff, 0xfe]), None, "not UTF-8");
    }
}
