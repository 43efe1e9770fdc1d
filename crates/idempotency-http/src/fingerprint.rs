//! What makes two requests "the same request".

use bytes::Bytes;
use http::HeaderValue;
use idempotency_core::{Fingerprint, FingerprintMode};

use crate::config::Config;
use crate::problem::Problem;

/// The fingerprint: method, path and query, the configured headers, and the body.
///
/// A body that is not JSON under [`FingerprintMode::JsonPointers`] is refused
/// ([`Problem::InvalidBody`]): the members that decide a mismatch cannot be read. Under
/// [`FingerprintMode::CanonicalJson`] its bytes identify it.
pub(crate) fn fingerprint(
    parts: &http::request::Parts,
    body: &Bytes,
    config: &Config,
) -> Result<Fingerprint, Problem> {
    let base = || {
        let mut builder = Fingerprint::builder()
            .part("method", parts.method.as_str().as_bytes())
            .part(
                "target",
                parts.uri.path_and_query().map_or("/", |p| p.as_str()).as_bytes(),
            );
        for name in &config.fingerprint_headers {
            let values: Vec<&[u8]> = parts
                .headers
                .get_all(name)
                .iter()
                .map(HeaderValue::as_bytes)
                .collect();
            builder = builder.part(name.as_str(), &values.join(&b'\n'));
        }
        builder
    };
    match base().payload(&config.fingerprint, body) {
        Ok(builder) => Ok(builder.finish()),
        Err(error) if matches!(config.fingerprint, FingerprintMode::JsonPointers(_)) => {
            Err(Problem::InvalidBody(format!(
                "the members that identify the request are read from a JSON body, and this one is not JSON ({error})"
            )))
        }
        // A body that is not JSON under the canonical JSON mode: its bytes still identify it.
        Err(_) => Ok(base()
            .payload(&FingerprintMode::Raw, body)
            .map(idempotency_core::FingerprintBuilder::finish)
            .unwrap_or_else(|_| Fingerprint::of_bytes(body))),
    }
}
