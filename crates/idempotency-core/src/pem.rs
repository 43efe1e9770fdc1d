//! The first check of a PEM file a connection setting names (a CA, a client certificate or
//! key): that it can be read and holds a PEM block. Stores and brokers make it when they parse
//! their URL, so that a wrong path is refused with the setting's name and the path rather than
//! later, by the driver, as "No such file or directory". The client library then reads the
//! file itself and judges its content.

use std::path::Path;

/// Checks that `path` is a readable file holding a PEM block (`-----BEGIN `).
///
/// ```
/// let error = idempotency_core::pem::check_file("/nonexistent/ca.pem".as_ref()).unwrap_err();
/// assert!(error.starts_with("No such file"));
/// ```
///
/// # Errors
///
/// The reason, never the file's content.
pub fn check_file(path: &Path) -> Result<(), String> {
    let text = std::fs::read(path).map_err(|e| e.to_string())?;
    if text.windows(11).any(|w| w == b"-----BEGIN ") {
        Ok(())
    } else {
        Err("not a PEM file (no -----BEGIN line)".into())
    }
}
