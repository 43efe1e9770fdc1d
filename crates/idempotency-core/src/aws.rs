//! The HTTPS client the AWS SDK crates (the DynamoDB store, the SQS adapter) are built with:
//! rustls with the *ring* provider, verifying servers against the system's trust store or
//! against a named CA alone. One place, so that both crates trust exactly the same way.

use std::path::Path;

use aws_smithy_http_client::tls::{self, TlsContext, TrustStore, rustls_provider::CryptoMode};
pub use aws_smithy_runtime_api::client::http::SharedHttpClient;

/// An HTTPS client verifying servers against the system's trust store (which honours
/// `SSL_CERT_FILE` and `SSL_CERT_DIR`).
#[must_use]
pub fn https_client() -> SharedHttpClient {
    aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(CryptoMode::Ring))
        .build_https()
}

/// [`https_client`] verifying servers against the CA certificates in the PEM file `ca` and
/// nothing else (a compatible server, or a TLS proxy, with a private CA). The file is checked
/// as [`read_ca_file`](crate::pem::read_ca_file) checks it first: the SDK's trust store would
/// panic on a block it cannot use.
///
/// ```
/// let error = idempotency_core::aws::https_client_trusting("/nonexistent/ca.pem".as_ref()).unwrap_err();
/// assert!(error.starts_with("ca=/nonexistent/ca.pem: No such file"), "{error}");
/// ```
///
/// # Errors
///
/// `ca=PATH: REASON` when the file cannot be read or used as a CA, or no TLS context can be
/// built from it; never the file's content.
pub fn https_client_trusting(ca: &Path) -> Result<SharedHttpClient, String> {
    let refuse = |why: String| format!("ca={}: {why}", ca.display());
    let pem = crate::pem::read_ca_file(ca).map_err(|why| refuse(why.to_string()))?;
    let context = TlsContext::builder()
        .with_trust_store(TrustStore::empty().with_pem_certificate(pem))
        .build()
        .map_err(|e| refuse(e.to_string()))?;
    Ok(aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(CryptoMode::Ring))
        .tls_context(context)
        .build_https())
}
