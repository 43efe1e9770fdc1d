//! Request fingerprints: what makes two requests "the same request".
//!
//! A [`Fingerprint`] is a SHA-256 digest stored with the record when a key is first used. A later
//! request with the same key and a *different* fingerprint is a mismatch: it is never executed and
//! never replayed (HTTP `422`, consumers dead-letter it), because a client that reuses a key for a
//! different payload has a bug that silently returning the first response would hide.
//!
//! Three ways to digest a payload ([`FingerprintMode`]):
//!
//! * [`FingerprintMode::Raw`] (the default) — the bytes as sent.
//! * [`FingerprintMode::CanonicalJson`] — the RFC 8785 canonical form of a JSON document: member
//!   order and whitespace do not matter.
//! * [`FingerprintMode::JsonPointers`] — only selected members (JSON Pointers, RFC 6901), each in
//!   canonical form; a missing member counts as `null`.
//! * [`FingerprintMode::Ignore`] — not the payload: the other parts alone.
//!
//! Several parts (method, path, selected headers, body) are combined with
//! [`FingerprintBuilder`], which length-prefixes every part so that no two different sequences
//! of parts can produce the same digest.

use std::fmt;

use sha2::{Digest, Sha256};

/// Why a payload could not be fingerprinted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FingerprintError {
    /// The payload was expected to be JSON and is not.
    #[error("body is not valid JSON: {0}")]
    InvalidJson(String),
    /// A configured JSON Pointer is not valid RFC 6901 syntax.
    #[error("invalid JSON Pointer {pointer:?}: it must be empty or start with '/'")]
    InvalidPointer {
        /// The rejected pointer.
        pointer: String,
    },
}

/// A SHA-256 digest of what defines "the same request".
///
/// ```
/// use idempotency_core::Fingerprint;
///
/// let a = Fingerprint::of_canonical_json(br#"{"amount": 100, "currency": "EUR"}"#)?;
/// let b = Fingerprint::of_canonical_json(br#"{"currency":"EUR","amount":100}"#)?;
/// assert_eq!(a, b);
/// assert_ne!(a, Fingerprint::of_bytes(br#"{"amount": 100, "currency": "EUR"}"#));
/// # Ok::<(), idempotency_core::FingerprintError>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Wraps a digest computed elsewhere (for example read back from a store).
    #[must_use]
    pub const fn from_digest(digest: [u8; 32]) -> Self {
        Self(digest)
    }

    /// The raw digest.
    #[must_use]
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// SHA-256 of `bytes` as they are.
    #[must_use]
    pub fn of_bytes(bytes: &[u8]) -> Self {
        Self(Sha256::digest(bytes).into())
    }

    /// SHA-256 of the RFC 8785 canonical form of the JSON document in `json`.
    ///
    /// # Errors
    ///
    /// [`FingerprintError::InvalidJson`] when `json` is not a JSON document.
    pub fn of_canonical_json(json: &[u8]) -> Result<Self, FingerprintError> {
        Ok(Self(Sha256::digest(canonical_json(json)?).into()))
    }

    /// Digest of the selected members of a JSON document, each in canonical form; a member the
    /// document lacks counts as `null`.
    ///
    /// ```
    /// use idempotency_core::{Fingerprint, JsonPointer};
    ///
    /// let pointers = [JsonPointer::new("/amount")?, JsonPointer::new("/currency")?];
    /// let a = Fingerprint::of_json_pointers(br#"{"amount":1,"currency":"EUR","note":"a"}"#, &pointers)?;
    /// let b = Fingerprint::of_json_pointers(br#"{"note":"b","currency":"EUR","amount":1}"#, &pointers)?;
    /// assert_eq!(a, b); // `note` is not part of the identity of the request
    /// # Ok::<(), idempotency_core::FingerprintError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`FingerprintError::InvalidJson`] when `json` is not a JSON document.
    pub fn of_json_pointers(json: &[u8], pointers: &[JsonPointer]) -> Result<Self, FingerprintError> {
        let mut hasher = Sha256::new();
        hash_json_pointers(&mut hasher, json, pointers)?;
        Ok(Self(hasher.finalize().into()))
    }

    /// A builder that combines several labelled parts into one fingerprint.
    #[must_use]
    pub fn builder() -> FingerprintBuilder {
        FingerprintBuilder {
            hasher: Sha256::new(),
        }
    }

    /// The digest as 64 lowercase hex characters.
    #[must_use]
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The digest from 64 hex characters, as [`Fingerprint::to_hex`] writes them (for stores
    /// that keep fingerprints as text).
    ///
    /// ```
    /// use idempotency_core::Fingerprint;
    ///
    /// let fingerprint = Fingerprint::of_bytes(b"pay 10");
    /// assert_eq!(Fingerprint::from_hex(&fingerprint.to_hex())?, fingerprint);
    /// assert!(Fingerprint::from_hex("abc").is_err());
    /// # Ok::<(), idempotency_core::DecodeError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`DecodeError::Hex`](crate::DecodeError::Hex) when `text` is not 64 hex digits.
    pub fn from_hex(text: &str) -> Result<Self, crate::DecodeError> {
        let mut digest = [0u8; 32];
        hex::decode_to_slice(text, &mut digest).map_err(|_| crate::DecodeError::Hex {
            field: "fingerprint",
            digits: 64,
        })?;
        Ok(Self(digest))
    }

    /// The digest from its 32 raw bytes (for stores that keep fingerprints as binary).
    ///
    /// # Errors
    ///
    /// [`DecodeError::Length`](crate::DecodeError::Length) when `bytes` is not 32 bytes long.
    pub fn from_slice(bytes: &[u8]) -> Result<Self, crate::DecodeError> {
        bytes
            .try_into()
            .map(Self)
            .map_err(|_| crate::DecodeError::Length {
                field: "fingerprint",
                expected: 32,
                found: bytes.len(),
            })
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &self.to_hex()[..16])
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// A validated JSON Pointer (RFC 6901), such as `/amount` or `/items/0/sku`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct JsonPointer(String);

impl JsonPointer {
    /// Validates `pointer`: it must be empty (the whole document) or start with `/`.
    ///
    /// # Errors
    ///
    /// [`FingerprintError::InvalidPointer`] otherwise.
    pub fn new(pointer: impl Into<String>) -> Result<Self, FingerprintError> {
        let pointer = pointer.into();
        if pointer.is_empty() || pointer.starts_with('/') {
            Ok(Self(pointer))
        } else {
            Err(FingerprintError::InvalidPointer { pointer })
        }
    }

    /// The pointer as text.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// How a payload (an HTTP body, a message) is digested. See the [module docs](self).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum FingerprintMode {
    /// The bytes as sent.
    #[default]
    Raw,
    /// The RFC 8785 canonical form of a JSON document.
    CanonicalJson,
    /// The selected members of a JSON document, each in canonical form.
    JsonPointers(Vec<JsonPointer>),
    /// Not the payload at all: only the other parts (an HTTP request's method, path and query)
    /// identify the request, for routes whose bodies carry nothing that decides a mismatch.
    Ignore,
}

/// Combines labelled parts into one [`Fingerprint`]; see [`Fingerprint::builder`].
///
/// ```
/// use idempotency_core::{Fingerprint, FingerprintMode};
///
/// let fingerprint = Fingerprint::builder()
///     .part("method", b"POST")
///     .part("path", b"/v1/charges")
///     .payload(&FingerprintMode::CanonicalJson, br#"{"amount": 100}"#)?
///     .finish();
/// # let _ = fingerprint;
/// # Ok::<(), idempotency_core::FingerprintError>(())
/// ```
#[derive(derive_more::Debug)]
pub struct FingerprintBuilder {
    #[debug(skip)]
    hasher: Sha256,
}

impl FingerprintBuilder {
    /// Adds a labelled part. Labels and values are length-prefixed, so `("ab", "c")` and
    /// `("a", "bc")` differ.
    #[must_use]
    pub fn part(mut self, label: &str, value: &[u8]) -> Self {
        self.write_label(label);
        self.hasher.update((value.len() as u64).to_be_bytes());
        self.hasher.update(value);
        self
    }

    /// Adds the payload, digested according to `mode`.
    ///
    /// # Errors
    ///
    /// [`FingerprintError::InvalidJson`] when a JSON mode is used and the payload is not JSON.
    pub fn payload(mut self, mode: &FingerprintMode, payload: &[u8]) -> Result<Self, FingerprintError> {
        match mode {
            FingerprintMode::Raw => Ok(self.part("payload", payload)),
            FingerprintMode::CanonicalJson => {
                let canonical = canonical_json(payload)?;
                Ok(self.part("payload-json", &canonical))
            }
            FingerprintMode::JsonPointers(pointers) => {
                self.write_label("payload-pointers");
                hash_json_pointers(&mut self.hasher, payload, pointers)?;
                Ok(self)
            }
            FingerprintMode::Ignore => Ok(self.part("payload-ignored", b"")),
        }
    }

    /// The combined digest.
    #[must_use]
    pub fn finish(self) -> Fingerprint {
        Fingerprint(self.hasher.finalize().into())
    }

    fn write_label(&mut self, label: &str) {
        self.hasher.update((label.len() as u64).to_be_bytes());
        self.hasher.update(label.as_bytes());
    }
}

fn hash_json_pointers(
    hasher: &mut Sha256,
    json: &[u8],
    pointers: &[JsonPointer],
) -> Result<(), FingerprintError> {
    let document: serde_json::Value =
        serde_json::from_slice(json).map_err(|e| FingerprintError::InvalidJson(e.to_string()))?;
    hasher.update((pointers.len() as u64).to_be_bytes());
    for pointer in pointers {
        hasher.update((pointer.0.len() as u64).to_be_bytes());
        hasher.update(pointer.0.as_bytes());
        match document.pointer(&pointer.0) {
            // A missing member counts as `null`: a client that leaves out an optional member and
            // one that sends it as `null` mean the same request.
            None => hash_canonical(hasher, &serde_json::Value::Null)?,
            Some(value) => hash_canonical(hasher, value)?,
        }
    }
    Ok(())
}

/// Adds `value`'s canonical form, length-prefixed.
fn hash_canonical(hasher: &mut Sha256, value: &serde_json::Value) -> Result<(), FingerprintError> {
    let canonical =
        serde_json_canonicalizer::to_vec(value).map_err(|e| FingerprintError::InvalidJson(e.to_string()))?;
    hasher.update([1u8]);
    hasher.update((canonical.len() as u64).to_be_bytes());
    hasher.update(&canonical);
    Ok(())
}

/// The RFC 8785 canonical serialization of the JSON document in `json`.
pub(crate) fn canonical_json(json: &[u8]) -> Result<Vec<u8>, FingerprintError> {
    let document: serde_json::Value =
        serde_json::from_slice(json).map_err(|e| FingerprintError::InvalidJson(e.to_string()))?;
    serde_json_canonicalizer::to_vec(&document).map_err(|e| FingerprintError::InvalidJson(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_fingerprint_is_sha256() {
        // SHA-256("abc"), FIPS 180-2 test vector.
        assert_eq!(
            Fingerprint::of_bytes(b"abc").to_hex(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn canonical_json_follows_rfc_8785() {
        // RFC 8785 §3.2.3 sorting and number formatting.
        let canonical = canonical_json(br#"{"b": 1e1, "a": [1.0, "\u0041"], "c": -0}"#).unwrap();
        assert_eq!(canonical, br#"{"a":[1,"A"],"b":10,"c":0}"#);
    }

    #[test]
    fn invalid_json_is_a_typed_error() {
        assert!(matches!(
            Fingerprint::of_canonical_json(b"{\"a\":"),
            Err(FingerprintError::InvalidJson(_))
        ));
        let pointers = [JsonPointer::new("/a").unwrap()];
        assert!(matches!(
            Fingerprint::of_json_pointers(b"nope", &pointers),
            Err(FingerprintError::InvalidJson(_))
        ));
    }

    #[test]
    fn pointer_syntax_is_validated() {
        assert!(JsonPointer::new("").is_ok());
        assert!(JsonPointer::new("/a/0").is_ok());
        assert_eq!(
            JsonPointer::new("amount"),
            Err(FingerprintError::InvalidPointer {
                pointer: "amount".into()
            })
        );
    }

    #[test]
    fn a_missing_member_counts_as_null() {
        let pointers = [JsonPointer::new("/a").unwrap()];
        let missing = Fingerprint::of_json_pointers(b"{}", &pointers).unwrap();
        let null = Fingerprint::of_json_pointers(br#"{"a":null}"#, &pointers).unwrap();
        let zero = Fingerprint::of_json_pointers(br#"{"a":0}"#, &pointers).unwrap();
        let text = Fingerprint::of_json_pointers(br#"{"a":"null"}"#, &pointers).unwrap();
        assert_eq!(missing, null);
        assert_ne!(null, zero);
        assert_ne!(null, text);
    }

    #[test]
    fn parts_are_length_prefixed() {
        let a = Fingerprint::builder().part("x", b"ab").part("y", b"c").finish();
        let b = Fingerprint::builder().part("x", b"a").part("y", b"bc").finish();
        assert_ne!(a, b);
    }

    #[test]
    fn payload_modes_differ_as_documented() {
        let body_a = br#"{"amount": 1, "note": "x"}"#;
        let body_b = br#"{"note":"y","amount":1}"#;
        let fp = |mode: &FingerprintMode, body: &[u8]| {
            Fingerprint::builder().payload(mode, body).unwrap().finish()
        };
        assert_ne!(
            fp(&FingerprintMode::Raw, body_a),
            fp(&FingerprintMode::Raw, body_b)
        );
        assert_ne!(
            fp(&FingerprintMode::CanonicalJson, body_a),
            fp(&FingerprintMode::CanonicalJson, body_b)
        );
        let amount = FingerprintMode::JsonPointers(vec![JsonPointer::new("/amount").unwrap()]);
        assert_eq!(fp(&amount, body_a), fp(&amount, body_b));
        assert!(
            Fingerprint::builder()
                .payload(&FingerprintMode::CanonicalJson, b"x")
                .is_err()
        );
        // Ignored: any payload, JSON or not, is the same; the other parts still count.
        assert_eq!(
            fp(&FingerprintMode::Ignore, body_a),
            fp(&FingerprintMode::Ignore, b"not json")
        );
        let with_path = |path: &[u8]| {
            Fingerprint::builder()
                .part("path", path)
                .payload(&FingerprintMode::Ignore, body_a)
                .unwrap()
                .finish()
        };
        assert_ne!(with_path(b"/a"), with_path(b"/b"));
    }
}
