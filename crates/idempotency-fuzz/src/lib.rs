//! The bodies of the fuzz targets in `fuzz/`: every parser that reads input an attacker or a
//! misconfiguration controls, with the properties it must keep.
//!
//! Each function takes raw bytes, feeds them to one parser, and panics when a property breaks;
//! a panic of the parser itself is a finding too. `fuzz/fuzz_targets/*.rs` call them under
//! libFuzzer (`scripts/fuzz`, nightly Rust), and this crate's `tests/corpus.rs` replays the
//! committed corpus and every crash ever found (`fuzz/regressions/`) on stable Rust, as part of
//! `scripts/test`.
//!
//! | target | parser | properties |
//! |---|---|---|
//! | `key_header` | the `Idempotency-Key` header (`idempotency_http::key_from_headers`) | a key it accepts is 1 to 255 bytes of visible ASCII, and reads back as itself from the sf-string form |
//! | `stored_response` | the stored-response decoder (`StoredOutcome::decode`) | what it decodes encodes and decodes to the same response |
//! | `store_url` | every store's URL parser (`Registry::check`) | no password or credential parameter is echoed in an error |
//! | `canonical_json` | RFC 8785 canonicalisation and JSON Pointer selection for fingerprints | the fingerprint ignores member order and whitespace |
//! | `consumer_key` | a message's key (`KeySource`) and its dead-letter headers | a key is valid; dead-letter header values are one line |

/// The fuzzing guide (`docs/FUZZING.md`): the targets, how to run them, and what a finding
/// becomes.
#[doc = include_str!("../../../docs/FUZZING.md")]
pub mod guide {}

use bytes::Bytes;
use http::{HeaderMap, HeaderValue};
use idempotency_consumer::{Delivery, KeySource, dead_letter_headers};
use idempotency_core::{Fingerprint, JsonPointer, Key, is_credential, is_scheme};
use idempotency_http::{IDEMPOTENCY_KEY, StoredOutcome, key_from_headers};

/// A target's body: the fuzzer's bytes in, a panic when a property breaks.
pub type Body = fn(&[u8]);

/// Every target: its name (the file under `fuzz/fuzz_targets/` and the corpus folder) and its
/// body.
pub const TARGETS: &[(&str, Body)] = &[
    ("key_header", key_header),
    ("stored_response", stored_response),
    ("store_url", store_url),
    ("canonical_json", canonical_json),
    ("consumer_key", consumer_key),
];

/// Whether `key` is what a [`Key`] may be: 1 to 255 bytes of visible ASCII.
fn is_valid_key(key: &Key) -> bool {
    let text = key.as_str();
    (1..=255).contains(&text.len()) && text.bytes().all(|b| (0x21..=0x7e).contains(&b))
}

/// The `Idempotency-Key` header, as a client sends it.
///
/// # Panics
///
/// When an accepted key is not a valid key, or does not read back as itself.
pub fn key_header(data: &[u8]) {
    let Ok(value) = HeaderValue::from_bytes(data) else {
        return;
    };
    let mut headers = HeaderMap::new();
    headers.append(IDEMPOTENCY_KEY, value);
    let Ok(key) = key_from_headers(&headers) else {
        return;
    };
    let key = key.expect("the header is present");
    assert!(is_valid_key(&key), "accepted an invalid key {key:?}");
    let quoted = format!("\"{}\"", key.as_str().replace('\\', "\\\\").replace('"', "\\\""));
    let mut again = HeaderMap::new();
    again.append(
        IDEMPOTENCY_KEY,
        HeaderValue::from_str(&quoted).expect("an sf-string is a header value"),
    );
    assert_eq!(
        key_from_headers(&again).expect("the sf-string form of a key parses"),
        Some(key),
        "the sf-string form of the key reads back as another key"
    );
}

/// The stored form of a response, as a store hands it back (possibly damaged, or another
/// application's).
///
/// # Panics
///
/// When a decoded response does not survive encoding and decoding again.
pub fn stored_response(data: &[u8]) {
    if let Some(stored) = StoredOutcome::decode(data) {
        let encoded = stored.encode();
        let again = StoredOutcome::decode(encoded.as_bytes()).expect("an encoded response decodes");
        assert_eq!(again, stored, "a response changed through encoding");
    }
}

/// The parts of `url` that are secrets (a userinfo password, credential query parameters), found
/// as URL syntax places them (RFC 3986: a scheme, then an authority only after `//`, whose
/// userinfo ends at its last `@`; the authority ends at the first `/`, `?` or `#`; the query runs
/// from the first `?` to a `#`): each as a range of `url`, with the forms a parser may show it
/// in (as written, percent-decoded). `redact_url` masks more than this; showing less than it
/// would be a leak only where this finds a secret.
fn secrets(url: &str) -> Vec<(std::ops::Range<usize>, Vec<String>)> {
    // Where a part of `url` starts in it.
    let offset = |part: &str| part.as_ptr() as usize - url.as_ptr() as usize;
    let after_scheme = match url.split_once(':') {
        Some((scheme, rest)) if is_scheme(scheme) => rest,
        _ => url,
    };
    let (authority, path_onwards) = match after_scheme.strip_prefix("//") {
        Some(rest) => rest.split_at(rest.find(['/', '?', '#']).unwrap_or(rest.len())),
        None => ("", after_scheme),
    };
    let mut found = Vec::new();
    if let Some(at) = authority.rfind('@')
        && let Some((_, password)) = authority[..at].split_once(':')
    {
        found.push(offset(password)..offset(password) + password.len());
    }
    let query = path_onwards.split_once('?').map(|(_, query)| query);
    let query = query.map(|query| query.split_once('#').map_or(query, |(query, _)| query));
    if let Some(query) = query {
        for pair in query.split('&') {
            // Which names are credentials is the product's rule, shared; where the query and
            // its values are is read here on its own.
            if let Some((name, value)) = pair.split_once('=')
                && is_credential(name)
            {
                found.push(offset(value)..offset(value) + value.len());
            }
        }
    }
    found
        .into_iter()
        .map(|range| {
            let raw = &url[range.clone()];
            let decoded = url::form_urlencoded::parse(format!("x={raw}").as_bytes())
                .next()
                .map(|(_, value)| value.into_owned())
                .unwrap_or_default();
            let forms = [raw.to_owned(), decoded]
                .into_iter()
                // Short secrets occur by chance in any message ("pass" in "password").
                .filter(|form| form.len() >= 6)
                .collect();
            (range, forms)
        })
        .collect()
}

/// `secret` with every ASCII letter and digit replaced by `Z` or `0`, the rest kept; all `Z`s
/// when it has neither, so that a mask always differs from the secret.
fn mask(secret: &str) -> String {
    if !secret.chars().any(|c| c.is_ascii_alphanumeric()) {
        return "Z".repeat(secret.len());
    }
    secret
        .chars()
        .map(|c| match c {
            c if c.is_ascii_digit() => '0',
            c if c.is_ascii_alphabetic() => 'Z',
            c => c,
        })
        .collect()
}

/// A store URL, as an operator types it (`--store`, `IDEM_STORE`): every store's parser, without
/// connecting anywhere.
///
/// # Panics
///
/// When an error message shows a secret of the URL that the same message for the URL with that
/// secret masked in its place does not (so the secret is echoed, not part of the message's own
/// text or of another part of the URL).
pub fn store_url(data: &[u8]) {
    let Ok(url) = std::str::from_utf8(data) else {
        return;
    };
    let registry = idempotency::registry();
    let Err(error) = registry.check(url) else {
        return;
    };
    let message = error.to_string();
    for (range, forms) in secrets(url) {
        for form in forms.iter().filter(|form| message.contains(form.as_str())) {
            // The secret masked where it is, and only there: the same text elsewhere in the URL
            // (not a secret's place) may well be shown. Only its letters and digits are masked:
            // its punctuation may be the URL's structure to a parser (a `,` between the nodes
            // of a `redis-cluster://` URL), and masking it would make another error.
            let mut masked = url.to_owned();
            masked.replace_range(range.clone(), &mask(&url[range.clone()]));
            let masked_message = registry
                .check(&masked)
                .err()
                .map(|error| error.to_string())
                .unwrap_or_default();
            assert!(
                masked_message.contains(form.as_str()),
                "the secret {form:?} of {url:?} is echoed: {message}"
            );
        }
    }
}

/// A JSON body whose fingerprint ignores member order and whitespace (RFC 8785), whole or by
/// JSON Pointers.
///
/// # Panics
///
/// When the same JSON written another way gets another fingerprint.
pub fn canonical_json(data: &[u8]) {
    let canonical = Fingerprint::of_canonical_json(data);
    let pointers = [
        JsonPointer::new("/amount").expect("a valid pointer"),
        JsonPointer::new("/a~1b/0").expect("a valid pointer"),
    ];
    let selected = Fingerprint::of_json_pointers(data, &pointers);
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    // The same value, written again: another member order is not produced by serde_json (its
    // map is sorted), but whitespace and escapes differ from the input's.
    let Ok(rewritten) = serde_json::to_vec_pretty(&value) else {
        return;
    };
    if let Ok(fingerprint) = canonical {
        assert_eq!(
            Fingerprint::of_canonical_json(&rewritten).ok(),
            Some(fingerprint),
            "the same JSON written again has another canonical fingerprint"
        );
    }
    if let Ok(fingerprint) = selected {
        assert_eq!(
            Fingerprint::of_json_pointers(&rewritten, &pointers).ok(),
            Some(fingerprint),
            "the same JSON written again selects other members"
        );
    }
}

/// A message split out of fuzz bytes: `key header value 0xFF message id 0xFF payload`.
#[derive(Debug)]
struct Message {
    header: Vec<u8>,
    message_id: Option<String>,
    payload: Bytes,
}

impl Delivery for Message {
    fn header(&self, name: &str) -> Option<&[u8]> {
        (name == "Idempotency-Key").then_some(self.header.as_slice())
    }

    fn message_id(&self) -> Option<&str> {
        self.message_id.as_deref()
    }

    fn payload(&self) -> &[u8] {
        &self.payload
    }

    fn delivery_count(&self) -> u32 {
        1
    }
}

/// A message's key from its header, its message id or its payload, and the headers of its
/// dead-letter copy.
///
/// # Panics
///
/// When a key found is not a valid key, a content-hash key is not `sha256:` and 64 hex digits,
/// or a dead-letter header value spans lines.
pub fn consumer_key(data: &[u8]) {
    let mut parts = data.splitn(3, |b| *b == 0xFF);
    let message = Message {
        header: parts.next().unwrap_or_default().to_vec(),
        message_id: parts.next().map(|id| String::from_utf8_lossy(id).into_owned()),
        payload: Bytes::copy_from_slice(parts.next().unwrap_or_default()),
    };
    for source in [
        KeySource::Header("Idempotency-Key".into()),
        KeySource::MessageId,
        KeySource::ContentHash,
    ] {
        match source.find(&message) {
            Ok(key) => assert!(is_valid_key(&key), "{source:?} found an invalid key {key:?}"),
            Err(reason) => {
                let headers = dead_letter_headers("fuzz", 3, &reason.into_reason());
                for (name, value) in headers {
                    assert!(
                        !value.contains(['\r', '\n']),
                        "the dead-letter header {name} spans lines: {value:?}"
                    );
                }
            }
        }
    }
    let hashed = KeySource::ContentHash
        .find(&message)
        .expect("a content hash is a key");
    let digest = hashed.as_str().strip_prefix("sha256:").expect("sha256: first");
    assert!(
        digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit()),
        "not a SHA-256 digest: {hashed:?}"
    );
}
