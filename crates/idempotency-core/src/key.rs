//! Idempotency keys and scopes.
//!
//! A [`Key`] names one logical operation ("charge order 12345"); a [`Scope`] names whose key it
//! is (a tenant, an authenticated principal, a consumer). Every record is addressed by the pair,
//! so one tenant can never replay another tenant's response by guessing its key.
//!
//! # Choosing a key
//!
//! Three strategies produce good keys:
//!
//! * **Producer-supplied id** — the client generates a fresh id once per logical operation and
//!   reuses it on every retry: [`Key::generate`] makes a UUIDv7 (time-ordered, so indexes stay
//!   compact).
//! * **Content hash** — when the payload *is* the identity of the operation (a webhook body, an
//!   imported row): [`Key::content_hash`] hashes the RFC 8785 canonical form of a JSON document,
//!   so key order and whitespace do not matter.
//! * **Business composite** — when the operation is identified by business ids:
//!   [`Key::composite`] joins parts with `:` and escapes separators, so `("a:b", "c")` and
//!   `("a", "b:c")` give different keys.
//!
//! Never use a broker's delivery tag, a redelivery counter or any id the transport assigns per
//! *delivery*: a redelivered message gets a new one, so the duplicate would look new and run
//! again — exactly the case the key exists to catch.

use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};

/// The longest key or scope accepted, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// Why a key or a scope was rejected.
///
/// The header that carries an idempotency key, on HTTP requests and on messages alike: the HTTP
/// layer reads it, the consumers read it from message headers by default, and the publishers
/// set it. (HTTP header names are case-insensitive; broker headers are not, so this is the one
/// spelling.)
pub const IDEMPOTENCY_KEY_HEADER: &str = "Idempotency-Key";

/// Positions are byte offsets into the rejected input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is empty.
    #[error("idempotency key is empty")]
    Empty,
    /// The input is longer than [`MAX_KEY_LEN`] bytes.
    #[error("idempotency key is {len} bytes long; at most {max} bytes are allowed", max = MAX_KEY_LEN)]
    TooLong {
        /// Length of the rejected input in bytes.
        len: usize,
    },
    /// The input contains a control character (0x00–0x1F or 0x7F).
    #[error("idempotency key contains a control character (0x{byte:02X}) at byte {position}")]
    ControlCharacter {
        /// Byte offset of the offending character.
        position: usize,
        /// The offending byte.
        byte: u8,
    },
    /// The input contains a space; keys are visible ASCII only.
    #[error("idempotency key contains a space at byte {position}; only visible ASCII (0x21-0x7E) is allowed")]
    Whitespace {
        /// Byte offset of the space.
        position: usize,
    },
    /// The input contains a byte outside ASCII (for example UTF-8 text).
    #[error(
        "idempotency key contains a non-ASCII byte (0x{byte:02X}) at byte {position}; only visible ASCII (0x21-0x7E) is allowed"
    )]
    NonAscii {
        /// Byte offset of the first non-ASCII byte.
        position: usize,
        /// The offending byte.
        byte: u8,
    },
    /// [`Key::content_hash`] was given something that is not a JSON document.
    #[error("content to hash is not valid JSON: {0}")]
    InvalidJson(String),
}

/// Checks the characters shared by keys and scopes: visible ASCII only.
fn check_visible_ascii(bytes: &[u8]) -> Result<(), KeyError> {
    if bytes.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong { len: bytes.len() });
    }
    for (position, &byte) in bytes.iter().enumerate() {
        match byte {
            0x21..=0x7E => {}
            b' ' => return Err(KeyError::Whitespace { position }),
            0x00..=0x1F | 0x7F => return Err(KeyError::ControlCharacter { position, byte }),
            _ => return Err(KeyError::NonAscii { position, byte }),
        }
    }
    Ok(())
}

/// A validated idempotency key: 1 to 255 bytes of visible ASCII (0x21–0x7E).
///
/// Cloning is cheap (the text is shared).
///
/// ```
/// use idempotency_core::{Key, KeyError};
///
/// let key = Key::new("order-12345-payment")?;
/// assert_eq!(key.as_str(), "order-12345-payment");
///
/// assert_eq!(Key::new(""), Err(KeyError::Empty));
/// assert!(matches!(Key::new("caf\u{e9}"), Err(KeyError::NonAscii { position: 3, .. })));
/// # Ok::<(), KeyError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(Arc<str>);

impl Key {
    /// Validates `key` and wraps it.
    ///
    /// # Errors
    ///
    /// [`KeyError::Empty`], [`KeyError::TooLong`], or the first character that is not visible
    /// ASCII.
    pub fn new(key: impl AsRef<str>) -> Result<Self, KeyError> {
        let key = key.as_ref();
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        check_visible_ascii(key.as_bytes())?;
        Ok(Self(Arc::from(key)))
    }

    /// Validates raw bytes (as they arrive in an HTTP or message header) and wraps them.
    ///
    /// # Errors
    ///
    /// As [`Key::new`]; bytes that are not UTF-8 are reported as [`KeyError::NonAscii`].
    pub fn from_bytes(key: &[u8]) -> Result<Self, KeyError> {
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        check_visible_ascii(key)?;
        // Visible ASCII is valid UTF-8.
        let text = std::str::from_utf8(key).map_err(|e| KeyError::NonAscii {
            position: e.valid_up_to(),
            byte: key[e.valid_up_to()],
        })?;
        Ok(Self(Arc::from(text)))
    }

    /// A fresh producer-side key: a UUIDv7 in its hyphenated form.
    ///
    /// Generate it once per logical operation and reuse it on every retry of that operation.
    #[must_use]
    pub fn generate() -> Self {
        Self(Arc::from(uuid::Uuid::now_v7().hyphenated().to_string()))
    }

    /// A key derived from a JSON document's content: `sha256:` followed by the hex SHA-256 of
    /// its RFC 8785 canonical form, so that member order and whitespace do not change the key.
    ///
    /// ```
    /// use idempotency_core::Key;
    ///
    /// let a = Key::content_hash(br#"{"amount": 100, "currency": "EUR"}"#)?;
    /// let b = Key::content_hash(br#"{"currency":"EUR","amount":100}"#)?;
    /// assert_eq!(a, b);
    /// # Ok::<(), idempotency_core::KeyError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`KeyError::InvalidJson`] when `json` is not a JSON document.
    pub fn content_hash(json: &[u8]) -> Result<Self, KeyError> {
        let canonical =
            crate::fingerprint::canonical_json(json).map_err(|e| KeyError::InvalidJson(e.to_string()))?;
        let digest = Sha256::digest(&canonical);
        let mut text = String::with_capacity(7 + 64);
        text.push_str("sha256:");
        push_hex(&mut text, &digest);
        Ok(Self(Arc::from(text)))
    }

    /// A business composite key: the parts joined with `:`.
    ///
    /// Each part is percent-escaped (`%`, `:` and every byte that is not visible ASCII), so the
    /// encoding is unambiguous: `("a:b", "c")` and `("a", "b:c")` give different keys.
    ///
    /// ```
    /// use idempotency_core::Key;
    ///
    /// let key = Key::composite(["order", "12345", "payment", "v3"])?;
    /// assert_eq!(key.as_str(), "order:12345:payment:v3");
    /// assert_ne!(Key::composite(["a:b", "c"])?, Key::composite(["a", "b:c"])?);
    /// assert_eq!(Key::composite(["caf\u{e9} 1"])?.as_str(), "caf%C3%A9%201");
    /// # Ok::<(), idempotency_core::KeyError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`KeyError::Empty`] when there are no parts or all are empty, [`KeyError::TooLong`] when
    /// the escaped result exceeds 255 bytes.
    pub fn composite<I, P>(parts: I) -> Result<Self, KeyError>
    where
        I: IntoIterator<Item = P>,
        P: AsRef<str>,
    {
        let mut text = String::new();
        for (index, part) in parts.into_iter().enumerate() {
            if index > 0 {
                text.push(':');
            }
            for &byte in part.as_ref().as_bytes() {
                match byte {
                    b'%' | b':' => push_percent(&mut text, byte),
                    0x21..=0x7E => text.push(char::from(byte)),
                    _ => push_percent(&mut text, byte),
                }
            }
        }
        if text.bytes().all(|b| b == b':') {
            return Err(KeyError::Empty);
        }
        Self::new(text)
    }

    /// The key that names `key` in `scope` on its own, for a system that has no scopes: the
    /// messages a request publishes, the downstream calls it makes. Two requests share it
    /// exactly when they share scope and key, so an API retry and a broker redelivery meet at
    /// one idempotency boundary, and two tenants' equal keys stay apart.
    ///
    /// The encoding is injective, so no caller can make its key name another scope's:
    /// - in the global scope, the key with `%` and `:` percent-escaped (no `:` is left);
    /// - in any other scope, the escaped scope, `:`, and the escaped key (exactly one `:`);
    /// - when that exceeds 255 bytes, `sha256::` and the hex SHA-256 of it (two `:`).
    ///
    /// A key without `%` and `:` (a UUID, a ULID) therefore reaches the global scope's
    /// downstream unchanged.
    ///
    /// ```
    /// use idempotency_core::{Key, Scope};
    ///
    /// let key = Key::new("order-7")?;
    /// assert_eq!(Key::qualified(&Scope::global(), &key), key);
    /// assert_eq!(Key::qualified(&Scope::new("tenant-a")?, &key).as_str(), "tenant-a:order-7");
    /// // A client in the global scope cannot send what tenant-a's request forwards.
    /// let forged = Key::new("tenant-a:order-7")?;
    /// assert_eq!(Key::qualified(&Scope::global(), &forged).as_str(), "tenant-a%3Aorder-7");
    /// let long = Key::qualified(&Scope::digest(b"Bearer secret"), &Key::new("k".repeat(255))?);
    /// assert!(long.as_str().starts_with("sha256::"));
    /// # Ok::<(), idempotency_core::KeyError>(())
    /// ```
    #[must_use]
    pub fn qualified(scope: &Scope, key: &Self) -> Self {
        let escape = |text: &mut String, part: &str| {
            for &byte in part.as_bytes() {
                match byte {
                    b'%' | b':' => push_percent(text, byte),
                    _ => text.push(char::from(byte)),
                }
            }
        };
        let mut text = String::new();
        if !scope.as_str().is_empty() {
            escape(&mut text, scope.as_str());
            text.push(':');
        }
        escape(&mut text, key.as_str());
        if text.len() <= MAX_KEY_LEN {
            return Self(Arc::from(text));
        }
        let mut hashed = String::with_capacity(8 + 64);
        hashed.push_str("sha256::");
        push_hex(&mut hashed, &Sha256::digest(text.as_bytes()));
        Self(Arc::from(hashed))
    }
}

impl Key {
    /// The key in a JSON document's member at `pointer`, for producers that carry it in the
    /// body rather than a header (the gateway's `key-from`, `idem consume --key-from json:…`):
    /// a string is the key, a number its decimal text; an absent or `null` member is no key.
    ///
    /// ```
    /// use idempotency_core::{JsonPointer, Key};
    ///
    /// let pointer = JsonPointer::new("/order/id")?;
    /// let key = Key::from_json(br#"{"order":{"id":"o-7"}}"#, &pointer)?;
    /// assert_eq!(key.map(|key| key.to_string()).as_deref(), Some("o-7"));
    /// assert_eq!(Key::from_json(br#"{"order":{"id":42}}"#, &pointer)?.unwrap().as_str(), "42");
    /// assert_eq!(Key::from_json(br#"{"order":{}}"#, &pointer)?, None);
    /// assert!(Key::from_json(br#"{"order":{"id":true}}"#, &pointer).is_err());
    /// assert!(Key::from_json(b"not json", &pointer).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`JsonKeyError::NotJson`] for a document that is not JSON, [`JsonKeyError::NotAKey`] for
    /// a member that is neither a string nor a number, or not 1 to 255 bytes of visible ASCII.
    pub fn from_json(document: &[u8], pointer: &crate::JsonPointer) -> Result<Option<Self>, JsonKeyError> {
        let document: serde_json::Value =
            serde_json::from_slice(document).map_err(|error| JsonKeyError::NotJson(error.to_string()))?;
        let refused = |why: String| JsonKeyError::NotAKey {
            pointer: pointer.as_str().to_owned(),
            why,
        };
        let text = match document.pointer(pointer.as_str()) {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::String(text)) => text.clone(),
            Some(serde_json::Value::Number(number)) => number.to_string(),
            Some(other) => {
                let kind = match other {
                    serde_json::Value::Bool(_) => "a boolean",
                    serde_json::Value::Array(_) => "an array",
                    _ => "an object",
                };
                return Err(refused(format!("{kind}, where a string or a number is expected")));
            }
        };
        Self::new(text)
            .map(Some)
            .map_err(|error| refused(error.to_string()))
    }

    /// The key as logs show it under `how`.
    #[must_use]
    pub fn logged(&self, how: KeyLog) -> LoggedKey<'_> {
        LoggedKey { key: self, how }
    }
}

/// Why [`Key::from_json`] found no usable key in a document.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JsonKeyError {
    /// The document is not JSON (the parser's reason).
    #[error("not JSON ({0})")]
    NotJson(String),
    /// The member is not a key: not a string or a number, or not 1 to 255 bytes of visible
    /// ASCII.
    #[error("the member {pointer} is not a key: {why}")]
    NotAKey {
        /// The JSON pointer the key is read from.
        pointer: String,
        /// What is wrong with the member.
        why: String,
    },
}

/// How keys appear in logs: a key is not a secret, but it may carry an order number or an
/// e-mail address a log pipeline should not keep.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KeyLog {
    /// The key, truncated past 16 bytes ([`Key::redacted`]).
    #[default]
    Plain,
    /// The first 16 hex digits of its SHA-256: the lines of one key can be found together, and
    /// nothing a client sent is written down.
    Hash,
    /// Not shown (`(not logged)`).
    Off,
}

impl std::str::FromStr for KeyLog {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "hash" => Ok(Self::Hash),
            "plain" => Ok(Self::Plain),
            "off" => Ok(Self::Off),
            other => Err(format!("`{other}`: expected hash, plain or off")),
        }
    }
}

/// A key as [`Key::logged`] shows it.
#[derive(Debug, Clone, Copy)]
pub struct LoggedKey<'k> {
    key: &'k Key,
    how: KeyLog,
}

impl fmt::Display for LoggedKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.how {
            KeyLog::Plain => fmt::Display::fmt(&self.key.redacted(), f),
            KeyLog::Hash => {
                let digest = Sha256::digest(self.key.as_str().as_bytes());
                let mut text = String::with_capacity(16);
                push_hex(&mut text, &digest[..8]);
                f.write_str(&text)
            }
            KeyLog::Off => f.write_str("(not logged)"),
        }
    }
}

/// What a key and a scope share as checked text: read as text, shown as the text (or
/// redacted), parsed with `new`.
macro_rules! checked_text {
    ($name:ident, as_str: $as_str:literal, redacted: $redacted:literal) => {
        impl $name {
            #[doc = $as_str]
            #[must_use]
            pub fn as_str(&self) -> &str {
                &self.0
            }

            #[doc = $redacted]
            #[must_use]
            pub fn redacted(&self) -> Redacted<'_> {
                Redacted(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_tuple(stringify!($name)).field(&&*self.0).finish()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl std::str::FromStr for $name {
            type Err = KeyError;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::new(s)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

checked_text!(
    Key,
    as_str: "The key as text.",
    redacted: "A form of the key that is safe and short enough for logs: keys longer than 16 \
               bytes are truncated, with their length appended."
);
checked_text!(
    Scope,
    as_str: "The scope as text (empty for [`Scope::global`]).",
    redacted: "A form of the scope that is short enough for logs."
);

/// A key or scope shortened for log lines; see [`Key::redacted`].
#[derive(Debug, Clone, Copy)]
pub struct Redacted<'a>(&'a str);

impl fmt::Display for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 16;
        if self.0.len() <= SHOWN {
            f.write_str(self.0)
        } else {
            // Keys are ASCII, so any byte index is a char boundary.
            write!(f, "{}…({} bytes)", &self.0[..SHOWN], self.0.len())
        }
    }
}

/// The namespace a key lives in: a tenant, an authenticated principal, a consumer name, a
/// route group.
///
/// A scope is 0 to 255 bytes of visible ASCII; the empty scope ([`Scope::global`]) is the
/// namespace of callers that have no principal. When the natural scope is a secret (a bearer
/// token, an API key), use [`Scope::digest`] so the secret is never stored.
///
/// ```
/// use idempotency_core::Scope;
///
/// let tenant = Scope::new("tenant-42")?;
/// let principal = Scope::digest(b"Bearer s3cr3t");
/// assert_eq!(principal.as_str().len(), 64);
/// assert!(Scope::new("two words").is_err());
/// # Ok::<(), idempotency_core::KeyError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Scope(Arc<str>);

impl Scope {
    /// Validates `scope` and wraps it.
    ///
    /// # Errors
    ///
    /// [`KeyError::TooLong`] or the first character that is not visible ASCII.
    pub fn new(scope: impl AsRef<str>) -> Result<Self, KeyError> {
        let scope = scope.as_ref();
        check_visible_ascii(scope.as_bytes())?;
        Ok(Self(Arc::from(scope)))
    }

    /// The empty scope, shared by callers without a principal.
    #[must_use]
    pub fn global() -> Self {
        Self(Arc::from(""))
    }

    /// A scope made from a secret or from arbitrary bytes: the lowercase hex SHA-256 of `value`.
    ///
    /// Two different values give two different scopes, and the value itself is never stored.
    #[must_use]
    pub fn digest(value: &[u8]) -> Self {
        let digest = Sha256::digest(value);
        let mut text = String::with_capacity(64);
        push_hex(&mut text, &digest);
        Self(Arc::from(text))
    }
}

impl Default for Scope {
    fn default() -> Self {
        Self::global()
    }
}

pub(crate) fn push_hex(out: &mut String, bytes: &[u8]) {
    out.push_str(&hex::encode(bytes));
}

fn push_percent(out: &mut String, byte: u8) {
    const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
    out.push('%');
    out.push(char::from(DIGITS[usize::from(byte >> 4)]));
    out.push(char::from(DIGITS[usize::from(byte & 0x0F)]));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_visible_ascii_from_one_to_255_bytes() {
        assert!(Key::new("a").is_ok());
        assert!(Key::new("~!\"#$%&'()*+,-./0123456789:;<=>?@[\\]^_`{|}").is_ok());
        assert!(Key::new("x".repeat(255)).is_ok());
    }

    #[test]
    fn rejects_empty_key() {
        assert_eq!(Key::new(""), Err(KeyError::Empty));
        assert_eq!(Key::from_bytes(b""), Err(KeyError::Empty));
    }

    #[test]
    fn rejects_256_byte_key() {
        assert_eq!(Key::new("x".repeat(256)), Err(KeyError::TooLong { len: 256 }));
        let err = Key::new("x".repeat(256)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "idempotency key is 256 bytes long; at most 255 bytes are allowed"
        );
    }

    #[test]
    fn rejects_control_characters() {
        for (input, position, byte) in [
            ("a\tb", 1, 0x09),
            ("\0", 0, 0x00),
            ("ab\x7f", 2, 0x7F),
            ("a\nb", 1, 0x0A),
        ] {
            assert_eq!(
                Key::new(input),
                Err(KeyError::ControlCharacter { position, byte }),
                "{input:?}"
            );
        }
    }

    #[test]
    fn rejects_spaces() {
        assert_eq!(Key::new("a b"), Err(KeyError::Whitespace { position: 1 }));
    }

    #[test]
    fn rejects_non_ascii() {
        assert_eq!(
            Key::new("café"),
            Err(KeyError::NonAscii {
                position: 3,
                byte: 0xC3
            })
        );
        assert_eq!(
            Key::from_bytes(&[b'a', 0xFF]),
            Err(KeyError::NonAscii {
                position: 1,
                byte: 0xFF
            })
        );
        assert!(Key::new("café").unwrap_err().to_string().contains("non-ASCII"));
    }

    #[test]
    fn generated_keys_are_uuid_v7_and_unique() {
        let a = Key::generate();
        let b = Key::generate();
        assert_ne!(a, b);
        assert_eq!(a.as_str().len(), 36);
        assert_eq!(a.as_str().as_bytes()[14], b'7', "version nibble: {a}");
    }

    #[test]
    fn content_hash_ignores_member_order_and_whitespace() {
        let a = Key::content_hash(br#"{"b": [1, 2.0, "x"], "a": {"y": 1, "x": 2}}"#).unwrap();
        let b = Key::content_hash(br#"{"a":{"x":2,"y":1},"b":[1,2,"x"]}"#).unwrap();
        assert_eq!(a, b);
        assert!(a.as_str().starts_with("sha256:"));
        assert_eq!(a.as_str().len(), 7 + 64);
        let c = Key::content_hash(br#"{"a":{"x":2,"y":1},"b":[1,2,"y"]}"#).unwrap();
        assert_ne!(a, c);
    }

    #[test]
    fn content_hash_rejects_invalid_json() {
        assert!(matches!(
            Key::content_hash(b"{not json"),
            Err(KeyError::InvalidJson(_))
        ));
    }

    #[test]
    fn qualified_keys_are_valid_unambiguous_and_bounded() {
        let q = |scope: &str, key: &str| Key::qualified(&Scope::new(scope).unwrap(), &Key::new(key).unwrap());
        assert_ne!(q("a:b", "c"), q("a", "b:c"));
        assert_ne!(q("a", "b"), q("b", "a"));
        assert_eq!(q("t", "50%").as_str(), "t:50%25");
        assert_eq!(q("", "a:b").as_str(), "a%3Ab");
        // 100 + 1 + 154 = 255 bytes fits; one more byte is hashed.
        assert_eq!(q(&"s".repeat(100), &"k".repeat(154)).as_str().len(), 255);
        let hashed = q(&"s".repeat(100), &"k".repeat(155));
        assert_eq!(hashed.as_str().len(), 8 + 64);
        assert_ne!(hashed, q(&"s".repeat(100), &"k".repeat(156)));
        for key in [
            q("a:b", "c"),
            hashed,
            q(&"%".repeat(85), "x"),
            q("", &":".repeat(255)),
        ] {
            assert_eq!(
                Key::new(key.as_str()).unwrap(),
                key,
                "a qualified key is a valid key"
            );
        }
    }

    /// Every scope and key over an alphabet of the characters that matter (the separator, the
    /// escape, hex digits) up to three bytes long, and the long forms that are hashed: no two
    /// (scope, key) pairs share a qualified key. A global-scope client sending
    /// `<alice's scope>:order-1` is one of them.
    #[test]
    fn qualified_keys_are_injective_across_scopes() {
        let alphabet = ["a", ":", "%", "3", "A"];
        let mut words = vec![String::new()];
        for _ in 0..3 {
            let longer: Vec<String> = words
                .iter()
                .filter(|w| w.len() == words.last().map_or(0, String::len))
                .flat_map(|w| alphabet.iter().map(move |c| format!("{w}{c}")))
                .collect();
            words.extend(longer);
        }
        let long: Vec<String> = ["s", ":", "sha256:"]
            .iter()
            .map(|prefix| format!("{prefix}{}", "x".repeat(240)))
            .collect();
        let mut seen = std::collections::HashMap::new();
        for scope in words.iter().chain(&long) {
            for key in words.iter().chain(&long).filter(|k| !k.is_empty()) {
                let qualified = Key::qualified(&Scope::new(scope).unwrap(), &Key::new(key).unwrap());
                if let Some(first) = seen.insert(qualified.clone(), (scope.clone(), key.clone())) {
                    panic!("{first:?} and {:?} both give {qualified:?}", (scope, key));
                }
            }
        }
        assert!(seen.len() > 20_000, "{}", seen.len());
        let alice = Scope::digest(b"Bearer alice");
        let forged = Key::new(format!("{alice}:order-1")).unwrap();
        assert_ne!(
            Key::qualified(&Scope::global(), &forged),
            Key::qualified(&alice, &Key::new("order-1").unwrap())
        );
    }

    #[test]
    fn composite_keys_escape_separators() {
        assert_eq!(Key::composite(["a:b", "c"]).unwrap().as_str(), "a%3Ab:c");
        assert_eq!(Key::composite(["a", "b:c"]).unwrap().as_str(), "a:b%3Ac");
        assert_eq!(Key::composite(["100%", "x"]).unwrap().as_str(), "100%25:x");
        assert_eq!(Key::composite(["a", ""]).unwrap().as_str(), "a:");
        assert_eq!(Key::composite(Vec::<&str>::new()), Err(KeyError::Empty));
        assert_eq!(Key::composite(["", ""]), Err(KeyError::Empty));
        assert!(matches!(
            Key::composite(["x".repeat(300)]),
            Err(KeyError::TooLong { len: 300 })
        ));
    }

    #[test]
    fn scopes_allow_empty_and_reject_invisible_bytes() {
        assert_eq!(Scope::new("").unwrap(), Scope::global());
        assert!(Scope::new("tenant-1").is_ok());
        assert_eq!(Scope::new("a b"), Err(KeyError::Whitespace { position: 1 }));
        assert!(matches!(
            Scope::new("x".repeat(256)),
            Err(KeyError::TooLong { .. })
        ));
        assert_ne!(Scope::digest(b"alice"), Scope::digest(b"bob"));
        assert!(Scope::new(Scope::digest(b"alice").as_str()).is_ok());
    }

    #[test]
    fn redacted_form_truncates_long_keys() {
        let key = Key::new("x".repeat(40)).unwrap();
        assert_eq!(
            key.redacted().to_string(),
            format!("{}…(40 bytes)", "x".repeat(16))
        );
        assert_eq!(Key::new("short").unwrap().redacted().to_string(), "short");
    }
}
