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

/// Reads a PEM file of CA certificates and checks that every `CERTIFICATE` block in it is a
/// usable trust anchor, returning the file's bytes for a client that takes PEM (the AWS SDK's
/// trust store, which would panic on a block it cannot use).
///
/// ```
/// let error = idempotency_core::pem::read_ca_file("/nonexistent/ca.pem".as_ref()).unwrap_err();
/// assert!(error.starts_with("No such file"));
/// ```
///
/// # Errors
///
/// The reason (unreadable, no certificate, a block that is not a certificate a CA can have),
/// never the file's content.
#[cfg(feature = "rustls")]
pub fn read_ca_file(path: &Path) -> Result<Vec<u8>, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;

    let pem = std::fs::read(path).map_err(|e| e.to_string())?;
    let mut roots = rustls::RootCertStore::empty();
    for certificate in CertificateDer::pem_slice_iter(&pem) {
        let certificate = certificate.map_err(|e| format!("not a PEM file of certificates ({e})"))?;
        roots
            .add(certificate)
            .map_err(|e| format!("holds a certificate that cannot be a CA ({e})"))?;
    }
    if roots.is_empty() {
        return Err("holds no certificate (no -----BEGIN CERTIFICATE----- block)".into());
    }
    Ok(pem)
}

#[cfg(all(test, feature = "rustls"))]
mod tests {
    use super::read_ca_file;

    #[test]
    fn a_ca_file_must_hold_usable_certificates() {
        let dir = std::env::temp_dir().join(format!("idem-pem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cases = [
            ("empty.pem", "", "holds no certificate"),
            (
                "key.pem",
                "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIA==\n-----END PRIVATE KEY-----\n",
                "holds no certificate",
            ),
            (
                "garbage.pem",
                "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n",
                "cannot be a CA",
            ),
            (
                "broken.pem",
                "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n",
                "not a PEM file",
            ),
        ];
        for (name, text, expected) in cases {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            let error = read_ca_file(&path).unwrap_err();
            assert!(error.contains(expected), "{name}: {error}");
            assert!(
                !error.contains("bm90"),
                "{name}: the content is not echoed: {error}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
