//! Text put into a URL at a placeholder: the reconcile hook's `{key}`, the relay webhook's
//! `{destination}`.
//!
//! A value is encoded only as much as it must be to stay one path segment, or one query value,
//! and to keep the URL valid (RFC 3986 §2.3: producers should not percent-encode unreserved
//! characters, and routers that match literal paths, such as Express's, Go's `ServeMux` and most
//! frameworks' exact routes, do not route `orders%2Ecreated` to `/hook/orders.created`):
//!
//! | in a path segment | encoded |
//! |---|---|
//! | letters, digits, `-` `.` `_` `~`, the sub-delimiters `!` `$` `&` `'` `(` `)` `*` `+` `,` `;` `=`, `:` and `@` | never (RFC 3986's `pchar`) |
//! | `/` `?` `#` `%`, space, `"` `<` `>` `[` `\` `]` `^` `` ` `` `{` `\|` `}`, controls, non-ASCII (as UTF-8) | always |
//! | a value that is the whole segment `.` or `..` | its dots (`%2E`), which a client or router would otherwise resolve as "this" or "the parent" directory |
//!
//! In a query (after the template's `?`), `&`, `=` and `+` are encoded as well, so that the
//! value stays one parameter's value (`+` reads as a space in form decoding).
//!
//! Hand-written rather than `percent_encoding`'s sets alone: the crate's sets encode a fixed
//! set of bytes, and the dot-segment rule depends on where the placeholder stands.

use std::fmt::Write as _;

/// Where a placeholder stands in its URL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// In the path: the value must stay one segment.
    Path,
    /// In the query: the value must stay one parameter's value.
    Query,
}

/// Whether `byte` goes into `part` as it is.
fn literal(byte: u8, part: Part) -> bool {
    match byte {
        b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => true,
        b'!' | b'$' | b'\'' | b'(' | b')' | b'*' | b',' | b';' | b':' | b'@' => true,
        b'&' | b'=' | b'+' => part == Part::Path,
        _ => false,
    }
}

/// `value` encoded for `part` (see the module's table). `whole_segment` says that the value is
/// a path segment by itself (the placeholder stands between `/` and `/`, `?`, `#` or the end),
/// where `.` and `..` must not stay dot-segments.
#[must_use]
pub fn encode(value: &str, part: Part, whole_segment: bool) -> String {
    if part == Part::Path && whole_segment && matches!(value, "." | "..") {
        return "%2E".repeat(value.len());
    }
    let mut encoded = String::with_capacity(value.len());
    for &byte in value.as_bytes() {
        if literal(byte, part) {
            encoded.push(char::from(byte));
        } else {
            let _ = write!(encoded, "%{byte:02X}");
        }
    }
    encoded
}

/// `template` with every `placeholder` in it replaced by `value`, encoded for where each one
/// stands: in the path, or in the query (after the first `?`).
#[must_use]
pub fn fill(template: &str, placeholder: &str, value: &str) -> String {
    let mut filled = String::with_capacity(template.len() + value.len());
    let mut rest = template;
    let mut part = Part::Path;
    while let Some(at) = rest.find(placeholder) {
        let before = &rest[..at];
        if before.contains('?') {
            part = Part::Query;
        }
        let after = &rest[at + placeholder.len()..];
        let starts = filled.ends_with('/') && before.is_empty() || before.ends_with('/');
        let ends = after.is_empty() || after.starts_with(['/', '?', '#']);
        filled.push_str(before);
        filled.push_str(&encode(value, part, starts && ends));
        rest = after;
    }
    filled.push_str(rest);
    filled
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_segment_keeps_what_rfc_3986_allows_in_it() {
        let cases = [
            ("orders.created", "orders.created"),
            ("order:12345:payment:v3", "order:12345:payment:v3"),
            ("a-b_c~d", "a-b_c~d"),
            ("k!$&'()*+,;=@", "k!$&'()*+,;=@"),
            ("a/b", "a%2Fb"),
            ("a?b#c", "a%3Fb%23c"),
            ("100%", "100%25"),
            ("with space", "with%20space"),
            ("\"<>[\\]^`{|}", "%22%3C%3E%5B%5C%5D%5E%60%7B%7C%7D"),
            ("tab\there", "tab%09here"),
            ("café", "caf%C3%A9"),
            ("...", "..."),
        ];
        for (value, expected) in cases {
            assert_eq!(encode(value, Part::Path, true), expected, "{value:?}");
        }
    }

    #[test]
    fn a_dot_segment_is_encoded_only_when_it_would_be_one() {
        assert_eq!(fill("https://h/hooks/{d}", "{d}", "."), "https://h/hooks/%2E");
        assert_eq!(
            fill("https://h/hooks/{d}/x", "{d}", ".."),
            "https://h/hooks/%2E%2E/x"
        );
        assert_eq!(
            fill("https://h/hooks/{d}?a=1", "{d}", ".."),
            "https://h/hooks/%2E%2E?a=1"
        );
        assert_eq!(fill("https://h/hooks/v{d}", "{d}", "."), "https://h/hooks/v.");
        assert_eq!(
            fill("https://h/hooks/{d}.json", "{d}", ".."),
            "https://h/hooks/...json"
        );
        assert_eq!(fill("https://h/q?d={d}", "{d}", ".."), "https://h/q?d=..");
    }

    #[test]
    fn a_query_value_stays_one_value() {
        assert_eq!(
            fill("https://h/lookup?key={key}&v=1", "{key}", "a&b=c+d e"),
            "https://h/lookup?key=a%26b%3Dc%2Bd%20e&v=1"
        );
        assert_eq!(
            fill("/by-key/{key}?again={key}", "{key}", "a+b"),
            "/by-key/a+b?again=a%2Bb"
        );
    }

    #[test]
    fn a_template_without_the_placeholder_is_unchanged() {
        assert_eq!(fill("https://h/hook", "{destination}", "x/y"), "https://h/hook");
    }
}
