//! The first check of a PEM file a connection setting names (a CA, a client certificate or
//! key): that it can be read and holds a PEM block. Stores and brokers make it when they parse
//! their URL, so that a wrong path is refused with the setting's name and the path rather than
//! later, by the driver, as "No such file or directory". The client library then reads the
//! file itself and judges its content.

use std::path::Path;

/// Why a PEM file a setting names cannot be used. Its text is the reason alone, never the
/// file's content: callers prefix it with the setting's name and the path.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PemError {
    /// The file could not be read (missing, a directory, no permission).
    #[error("{0}")]
    Unreadable(#[from] std::io::Error),
    /// The file holds no PEM block at all.
    #[error("not a PEM file (no -----BEGIN line)")]
    NotPem,
    /// A `CERTIFICATE` block could not be decoded.
    #[error("not a PEM file of certificates ({0})")]
    NotCertificates(String),
    /// A certificate that cannot serve as a trust anchor.
    #[error("holds a certificate that cannot be a CA ({0})")]
    NotCa(String),
    /// A CA file without a single `CERTIFICATE` block (a key file, say).
    #[error("holds no certificate (no -----BEGIN CERTIFICATE----- block)")]
    NoCertificate,
}

/// Checks that `path` is a readable file holding a PEM block (`-----BEGIN `).
///
/// ```
/// let error = idempotency_core::pem::check_file("/nonexistent/ca.pem".as_ref()).unwrap_err();
/// assert!(error.to_string().starts_with("No such file"));
/// ```
///
/// # Errors
///
/// [`PemError::Unreadable`] or [`PemError::NotPem`].
pub fn check_file(path: &Path) -> Result<(), PemError> {
    let text = std::fs::read(path)?;
    if text.windows(11).any(|w| w == b"-----BEGIN ") {
        Ok(())
    } else {
        Err(PemError::NotPem)
    }
}

/// Reads a PEM file of CA certificates and checks that every `CERTIFICATE` block in it is a
/// usable trust anchor, returning the file's bytes for a client that takes PEM (the AWS SDK's
/// trust store, which would panic on a block it cannot use).
///
/// ```
/// let error = idempotency_core::pem::read_ca_file("/nonexistent/ca.pem".as_ref()).unwrap_err();
/// assert!(error.to_string().starts_with("No such file"));
/// ```
///
/// # Errors
///
/// The reason (unreadable, no certificate, a block that is not a certificate a CA can have),
/// never the file's content.
#[cfg(feature = "rustls")]
pub fn read_ca_file(path: &Path) -> Result<Vec<u8>, PemError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;

    let pem = std::fs::read(path)?;
    let mut roots = rustls::RootCertStore::empty();
    for certificate in CertificateDer::pem_slice_iter(&pem) {
        let certificate = certificate.map_err(|e| PemError::NotCertificates(e.to_string()))?;
        roots
            .add(certificate)
            .map_err(|e| PemError::NotCa(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(PemError::NoCertificate);
    }
    Ok(pem)
}

/// The trust anchors of a client connection: the certificates of the CA file `ca` **alone**
/// when one is named, the operating system's trust store when none is.
///
/// A named CA is the only one trusted, as libpq treats `sslrootcert` and the MySQL client
/// `ssl-ca`: adding it to the system's store would also accept any certificate that store
/// vouches for (on Debian, the machine's own self-signed `ssl-cert-snakeoil`). The system's
/// store is what `rustls-native-certs` reads (`SSL_CERT_FILE` and `SSL_CERT_DIR` when set);
/// certificates in it that cannot be parsed are skipped, as every client does, while a named
/// CA file is strict ([`read_ca_file`]).
///
/// ```
/// let error = idempotency_core::pem::trust_anchors(Some("/nonexistent/ca.pem".as_ref())).unwrap_err();
/// assert!(error.to_string().starts_with("No such file"));
/// ```
///
/// # Errors
///
/// For a named CA, as [`read_ca_file`]. The system's store never fails: what it lacks shows as
/// a refused certificate (`UnknownIssuer`) at the handshake.
#[cfg(feature = "rustls")]
pub fn trust_anchors(ca: Option<&Path>) -> Result<rustls::RootCertStore, PemError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;

    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(path) => {
            let pem = read_ca_file(path)?;
            for certificate in CertificateDer::pem_slice_iter(&pem) {
                let certificate = certificate.map_err(|e| PemError::NotCertificates(e.to_string()))?;
                roots
                    .add(certificate)
                    .map_err(|e| PemError::NotCa(e.to_string()))?;
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            for error in &native.errors {
                tracing::debug!(%error, "a certificate of the system's trust store was skipped");
            }
            roots.add_parsable_certificates(native.certs);
        }
    }
    Ok(roots)
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
            let error = read_ca_file(&path).unwrap_err().to_string();
            assert!(error.contains(expected), "{name}: {error}");
            assert!(
                !error.contains("bm90"),
                "{name}: the content is not echoed: {error}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
