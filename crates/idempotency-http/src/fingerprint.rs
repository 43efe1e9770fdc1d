//! What makes two requests "the same request".

use bytes::Bytes;
use http::HeaderValue;
use idempotency_core::{Fingerprint, FingerprintMode};

use crate::layer::Config;

/// The fingerprint: method, path and query, the configured headers, and the body.
pub(crate) fn fingerprint(parts: &http::request::Parts, body: &Bytes, config: &Config) -> Fingerprint {
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
        Ok(builder) => builder.finish(),
        // A body that is not JSON under a JSON mode: its bytes still identify it.
        Err(_) => base()
            .payload(&FingerprintMode::Raw, body)
            .map(idempotency_core::FingerprintBuilder::finish)
            .unwrap_or_else(|_| Fingerprint::of_bytes(body)),
    }
}
